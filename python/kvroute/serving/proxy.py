"""The OpenAI-compatible proxy behind `kvroute.fastapi`: route, forward, release.

One `Proxy` serves every request of an app. Per request (``POST /v1/completions`` or
``POST /v1/chat/completions``, a JSON object as vLLM's OpenAI server takes it):

1. Tokenize as the engine will (`kvroute.serving.tokenizer.PromptTokenizer`, off the event
   loop): the model's chat template for ``messages``, ``prompt`` text, or token ids as they
   are. Without a tokenizer only token-id prompts are matched against the index; text prompts
   are routed on load and the session key alone (see `Proxy`).
2. ``router.select_worker(tokens, session_key=kvroute.session_key(headers, body),
   exclude=<workers whose circuit is open> | <workers that already failed this request>)``.
3. Forward the body unchanged to ``worker.url + path`` over one shared pool of httpx
   connections (connect and read timeouts), with vLLM's ORCA load-report request
   header when enabled, and ``X-data-parallel-rank`` for a worker with a ``dp_rank`` (vLLM's
   ``_get_data_parallel_rank`` and SGLang's data-parallel controller read it; a client's own
   ``x-data-parallel-rank`` is never forwarded). The client's header fields go as the raw
   bytes it sent (repeated fields kept, non-ASCII values intact), minus hop-by-hop ones (RFC
   9110 7.6.1, including those named in ``Connection``), ``Host``, ``Content-Length`` and
   ``x-kvroute-*``. Without a client ``Accept-Encoding`` the proxy asks for ``identity`` (the
   body is passed through undecoded, so it must not ask for a compression the client did not).
4. Pass the response through: status, header fields (minus hop-by-hop ones; repeated fields
   such as ``Set-Cookie`` kept apart), and the body byte for byte: an SSE stream
   (``text/event-stream``) chunk by chunk as it arrives, anything else once complete. Add
   ``x-kvroute-worker``.
5. Release: ``router.first_token(decision)`` at the first streamed chunk,
   ``router.complete(decision)`` when the response ends, fails, or the client disconnects.

Failures: a connect error, a malformed worker URL, or a connection that broke before the
response headers arrived (see `_retryable`) marks the worker failed for this request and the
next-best worker is tried, at most ``max_retries`` times; every worker has a circuit breaker
(`CircuitBreaker`). Upstream 4xx / 5xx responses are passed through as they are. When no
worker can be reached the client gets 503, and a body that is not a valid request 400, both as
vLLM's error JSON (its OpenAI server's ``ErrorResponse`` / ``ErrorInfo``: ``{"error":
{"message", "type", "param", "code"}}``, ``code`` = the HTTP status). A client that goes away
before the response starts gets (in the access log) 499.

Thread-safety: a `Proxy` lives on one event loop; `CircuitBreaker` is not locked (only that
loop touches it). `kvroute.Router` calls are thread-safe. Most return in microseconds and run
on the loop; ``select_worker`` of a router with an LMCache controller (policy
``lmcache_aware``) makes blocking HTTP calls (up to ``controller_timeout_ms`` each), so the
proxy runs it on a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import functools
import http.cookiejar
import json
import logging
import time
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
    TypedDict,
)

import anyio
import httpx
import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvroute._router import Decision, NoWorkerAvailable, Router, Worker
from kvroute.serving.response_cache import CACHE_HEADER, SIMILARITY_HEADER, ResponseCache
from kvroute.session import session_key

__all__ = [
    "COMPLETIONS_PATH",
    "CHAT_PATH",
    "CircuitBreaker",
    "Proxy",
    "decision_dict",
    "error_response",
]

log = logging.getLogger("kvroute.serving.proxy")

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

# RFC 9110 section 7.6.1 connection-specific fields, plus the ones the HTTP layers recompute.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
# The client's x-data-parallel-rank is dropped: only the router picks the rank (vLLM would
# read the client's value first).
_DROP_REQUEST = _HOP_BY_HOP | {"host", "content-length", "x-data-parallel-rank"}
# uvicorn writes its own date and server headers; content-length is recomputed.
_DROP_RESPONSE = _HOP_BY_HOP | {"content-length", "date", "server"}

EXPLAIN_HEADER = "x-kvroute-explain"
WORKER_HEADER = "x-kvroute-worker"
DECISION_HEADER = "x-kvroute-decision"
SCORES_HEADER = "x-kvroute-scores"
TENANT_HEADER = "x-kvroute-tenant"
UDS_SCHEME = "unix://"
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM serving_engine._get_data_parallel_rank
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"  # vLLM serve/utils/orca_metrics.py


def error_response(status: int, message: str, err_type: Optional[str] = None,
                   param: Optional[str] = None,
                   headers: Optional[Mapping[str, str]] = None) -> JSONResponse:
    """A JSON error in vLLM's OpenAI-server shape: ``{"error": {"message", "type", "param",
    "code"}}`` with ``code`` = ``status`` (vLLM ``ErrorInfo``)."""
    kind = err_type or {400: "BadRequestError", 404: "NotFoundError", 502: "BadGatewayError",
                        503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}.get(
                            status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def decision_dict(d: Decision, attempts: int = 1) -> Dict[str, Any]:
    """A `kvroute.Decision` as JSON-ready fields (``scores`` not included; see
    `scores_list`)."""
    return {"worker": d.worker, "matched_tokens": int(d.matched_tokens),
            "matched_blocks": int(d.matched_blocks), "prompt_tokens": int(d.prompt_tokens),
            "prefill_tokens": int(d.prefill_tokens), "policy": d.policy, "reason": d.reason,
            "fallback": bool(d.fallback), "degraded": bool(d.degraded),
            "request_id": int(d.request_id), "attempts": attempts}


def scores_list(d: Decision) -> List[Dict[str, Any]]:
    """Per-worker score terms of a decision made with ``explain=True``: ``worker``,
    ``matched_blocks``, ``match`` (tier-weighted matched share of the prompt, [0, 1]),
    ``load`` ([0, 1]) and ``score`` (the policy's value; see ``kvroute.Router``)."""
    return [{"worker": s.worker, "matched_blocks": int(s.matched_blocks),
             "match": round(float(s.match), 6), "load": round(float(s.load), 6),
             "score": round(float(s.score), 6)} for s in (d.scores or [])]


class CircuitBreaker:
    """Consecutive-failure circuit breaker of one worker.

    ``closed`` (traffic flows) -> ``open`` after ``failures`` consecutive failures (connect
    errors, timeouts, broken streams, 5xx responses); ``open`` -> ``half_open`` once
    ``reset_s`` seconds have passed; ``half_open`` lets one probe request through: a response
    below 500 closes the circuit, a failure opens it for another ``reset_s``.

    Parameters
    ----------
    failures:
        Consecutive failures that open the circuit, >= 1.
    reset_s:
        Seconds an open circuit waits before letting a probe through, >= 0.
    clock:
        Monotonic clock in seconds (tests pass their own).

    Raises
    ------
    ValueError
        ``failures < 1`` or ``reset_s < 0``.
    """

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    def __init__(self, failures: int = 3, reset_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
            raise ValueError(f"breaker failures must be an int >= 1, got {failures!r}")
        if not isinstance(reset_s, (int, float)) or reset_s < 0:
            raise ValueError(f"breaker reset_s must be a number >= 0 seconds, got {reset_s!r}")
        self.failures = failures
        self.reset_s = float(reset_s)
        self._clock = clock
        self.consecutive_failures = 0
        self.times_opened = 0
        self._opened_at: Optional[float] = None
        self._probing = False
        self._probe_ticket = 0  # the ticket of the last probe handed out

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"``."""
        if self._opened_at is None:
            return self.CLOSED
        if self._clock() - self._opened_at >= self.reset_s:
            return self.HALF_OPEN
        return self.OPEN

    def available(self) -> bool:
        """True if a request may go to the worker now: closed, or half-open with no probe in
        flight."""
        s = self.state
        return s == self.CLOSED or (s == self.HALF_OPEN and not self._probing)

    def on_dispatch(self) -> int:
        """A request is being sent: in half-open state with no probe in flight it becomes the
        probe.

        Returns
        -------
        int
            A probe ticket (> 0, true) when this request took the probe slot, else 0 (false).
            Pass it to `abandon`.
        """
        if self.state == self.HALF_OPEN and not self._probing:
            self._probing = True
            self._probe_ticket += 1
            return self._probe_ticket
        return 0

    def abandon(self, ticket: int) -> None:
        """The request in flight ended without a verdict (client gone). If it holds the probe
        slot (``ticket`` is the current probe's, from `on_dispatch`), the slot is freed; any
        other request's abandon leaves the probe in flight alone."""
        if ticket and self._probing and ticket == self._probe_ticket:
            self._probing = False

    def record_success(self) -> bool:
        """The worker answered (status < 500). Returns True if this closed an open circuit."""
        was_open = self._opened_at is not None
        self.consecutive_failures = 0
        self._opened_at = None
        self._probing = False
        return was_open

    def record_failure(self) -> bool:
        """The worker failed. Returns True if this opened the circuit (it was closed)."""
        self.consecutive_failures += 1
        self._probing = False
        if self._opened_at is not None:  # a failed probe, or a straggler: wait reset_s again
            self._opened_at = self._clock()
            return False
        if self.consecutive_failures >= self.failures:
            self._opened_at = self._clock()
            self.times_opened += 1
            return True
        return False

    def snapshot(self) -> Dict[str, Any]:
        """``state``, ``consecutive_failures``, ``times_opened``, ``retry_in_s`` (seconds until
        an open circuit lets a probe through; 0 when not open)."""
        retry_in = 0.0
        if self.state == self.OPEN and self._opened_at is not None:
            retry_in = max(0.0, self.reset_s - (self._clock() - self._opened_at))
        return {"state": self.state, "consecutive_failures": self.consecutive_failures,
                "times_opened": self.times_opened, "retry_in_s": round(retry_in, 3)}


class _ScrapeOptions(TypedDict, total=False):
    """`PrometheusScraper` keywords the proxy was given (absent = the scraper's default)."""

    timeout_s: float
    stale_after_s: float


class _NoWorker(Exception):
    """No worker could take the request (all excluded, or every attempt failed to connect)."""


def _retryable(exc: BaseException) -> bool:
    """Errors after which the request is tried on another worker.

    A connect error or connect timeout, and a malformed worker URL (``httpx.InvalidURL``, not
    an ``httpx.HTTPError``): the request never reached the engine. Deliberately also a
    connection that broke before the response headers arrived (RemoteProtocolError /
    ReadError / WriteError while sending or waiting for the headers, e.g. a pooled keep-alive
    connection to a worker that just died): the engine may have received the request and,
    for a non-streaming one, even generated the whole answer before the connection broke, so
    a retry can repeat that work. Generation has no side effects beyond compute, and the
    alternative is failing a request a healthy worker could serve. Timeouts are not retried
    (the engine may still be busy with it)."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                            httpx.ReadError, httpx.WriteError, httpx.InvalidURL))


class Proxy:
    """Routes OpenAI-style requests to engine workers with a `kvroute.Router`.

    Parameters
    ----------
    router:
        The `kvroute.Router` over the workers (its worker URLs are where requests go). Not
        closed by the proxy.
    tokenizer:
        A `kvroute.serving.tokenizer.PromptTokenizer` (or anything with ``async
        aencode_request(path, body) -> numpy uint32 array`` that raises ValueError on a bad
        body). ``None``: deliberately, requests are still served: a completions ``prompt``
        given as token ids (a list of ints, or a list holding one such list) is matched as
        is; text prompts and chat messages route with no prefix match (``kv_aware`` then
        decides on load alone, the hashing policies on ``kvroute.session_key`` of the
        headers and body, else on the empty prompt).
    model:
        The engines' served model name. Answers ``GET /v1/models`` when no worker does, and
        a request whose ``model`` differs from it is routed with ``lora_name=<that model>``
        (vLLM answers 404 to model names that are neither served nor a loaded LoRA adapter,
        so a different accepted name is an adapter, and its blocks are keyed by its name).
        ``None``: no LoRA keying.
    upstream_timeout_s:
        Read / write timeout towards a worker, in seconds: the longest silence allowed between
        bytes (a non-streaming request waits its whole generation for the first byte).
    connect_timeout_s:
        TCP connect timeout, seconds. A connect timeout counts as a connect error (retried).
    max_retries:
        Further workers tried after a retryable failure (see `_retryable`: a connect error,
        a malformed worker URL, or a connection that broke before the response headers, in
        which case the engine may already have done the work of a non-streaming request),
        >= 0 (so at most ``1 + max_retries`` attempts per request).
    breaker_failures, breaker_reset_s:
        Per-worker `CircuitBreaker` settings.
    scrape_metrics_interval_s:
        Scrape each worker's Prometheus ``/metrics`` (vLLM names) this often with
        `kvroute.serving.load.PrometheusScraper` and feed `Router.update_load`; ``None``: off.
    scrape_timeout_s, scrape_stale_after_s:
        Passed to the scraper when given (per-scrape timeout; age after which a worker's
        scraped signals are forgotten).
    orca:
        Ask each worker for vLLM's ORCA load report (``endpoint-load-metrics-format``
        request header; vLLM answers on non-streaming responses) and apply it with
        `kvroute.serving.load.apply_orca`. ``True`` = ``"TEXT"``, or the format name
        (``"TEXT"`` / ``"JSON"``); ``False``: off.
    metrics:
        A `kvroute.serving.metrics.RouterMetrics` (``GET /metrics`` renders its registry);
        default: one on a registry of its own.
    health_check:
        Active health checks (`kvroute.serving.health.HealthChecker` keywords:
        ``failure_threshold``, ``success_threshold``, ``timeout_s``, ``check_interval_s``,
        ``endpoint``; the vLLM router's ``health_check`` section), or ``None``: off. A worker
        whose URL is marked unhealthy is not chosen and does not count in ``GET /health``.
    decision_log_size:
        Keep the last this many routing decisions (with every worker's score terms) for
        ``GET /admin/decisions`` (`kvroute.serving.admin.DecisionLog`); ``None``: off (and
        decisions are made without score terms unless a request asks to explain).
    replicas:
        `kvroute.serving.replicas.Replicas` (or a mapping of its keywords: the config's
        ``replicas`` section): load shared with peer replicas through Redis or NATS,
        bootstrap from a peer's snapshot, ``GET /ready``; ``None``: standalone.
    response_cache:
        Exact-match response cache (`kvroute.serving.response_cache.ResponseCache`, or a
        mapping of its keywords: ``max_entries``, ``max_bytes``, ``ttl_s``,
        ``deterministic_only``); ``None``: off.
    client:
        An ``httpx.AsyncClient`` to send with, used as it is configured (its timeouts, cookie
        jar, redirects; not closed by the proxy). Default: one pooled
        ``httpx.AsyncHTTPTransport`` created at `start` (unlimited connections, 256 kept
        alive, no proxy from the environment) that requests are forwarded through directly,
        so no cookie jar is shared between clients, no redirect is followed and none of the
        client layer's default header fields (``User-Agent``, ``Accept``) are added. A
        given client adds its configured default header fields to what the client sent,
        except ``Accept-Encoding`` (``identity`` unless the client sent one).

    Raises
    ------
    ValueError
        A negative timeout or retry count, bad breaker settings.
    """

    def __init__(
        self,
        router: Router,
        *,
        tokenizer: Any = None,
        model: Optional[str] = None,
        upstream_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_retries: int = 2,
        breaker_failures: int = 3,
        breaker_reset_s: float = 10.0,
        scrape_metrics_interval_s: Optional[float] = None,
        scrape_timeout_s: Optional[float] = None,
        scrape_stale_after_s: Optional[float] = None,
        orca: Any = True,
        metrics: Any = None,
        health_check: Optional[Mapping[str, Any]] = None,
        client: Optional[httpx.AsyncClient] = None,
        decision_log_size: Optional[int] = 1024,
        response_cache: Any = None,
        replicas: Any = None,
    ) -> None:
        if not isinstance(router, Router):
            raise ValueError(f"router must be a kvroute.Router, got {type(router).__name__}")
        for knob, val in (("upstream_timeout_s", upstream_timeout_s),
                          ("connect_timeout_s", connect_timeout_s)):
            if not isinstance(val, (int, float)) or not val > 0:
                raise ValueError(f"{knob} must be a number of seconds > 0, got {val!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if scrape_metrics_interval_s is not None and not scrape_metrics_interval_s > 0:
            raise ValueError("scrape_metrics_interval_s must be > 0 seconds or None, got "
                             f"{scrape_metrics_interval_s!r}")
        if orca is True:
            orca = "TEXT"
        if orca not in (False, None) and (not isinstance(orca, str)
                                          or orca.upper() not in ("TEXT", "JSON")):
            raise ValueError(f"orca must be a bool, 'TEXT' or 'JSON', got {orca!r}")
        CircuitBreaker(breaker_failures, breaker_reset_s)  # validates
        self._health_options = dict(health_check) if health_check is not None else None
        self._health: Any = None
        if self._health_options is not None:
            from kvroute.serving.health import HealthChecker

            HealthChecker(lambda: (), None, **self._health_options)  # type: ignore[arg-type]
        self.router = router
        self.tokenizer = tokenizer
        self.model = model
        self.upstream_timeout_s = float(upstream_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_retries = max_retries
        self.breaker_failures = breaker_failures
        self.breaker_reset_s = float(breaker_reset_s)
        self.scrape_metrics_interval_s = scrape_metrics_interval_s
        self._scrape_kwargs = _ScrapeOptions()
        if scrape_timeout_s is not None:
            self._scrape_kwargs["timeout_s"] = scrape_timeout_s
        if scrape_stale_after_s is not None:
            self._scrape_kwargs["stale_after_s"] = scrape_stale_after_s
        self.orca_format: Optional[str] = orca.upper() if orca else None
        if metrics is None:
            from kvroute.serving.metrics import RouterMetrics

            metrics = RouterMetrics(router)  # on a registry of its own
        self.metrics = metrics
        self.auth: Any = None  # kvroute.serving.auth.Auth, set by kvroute.fastapi.create_router
        from kvroute.serving.admin import DecisionLog

        self.response_cache = ResponseCache.from_options(response_cache)
        self.decisions: Optional[DecisionLog] = (
            DecisionLog(decision_log_size, expand=_log_entry)
            if decision_log_size is not None else None)
        self._own_client = client is None
        self._client = client
        self._transport: Optional[_Transport] = None
        self._breakers: Dict[str, CircuitBreaker] = {}
        self._scraper: Any = None
        self._orca_headers: Dict[str, str] = {}
        self._started = False
        self._start_lock: Optional[asyncio.Lock] = None
        from kvroute.serving.replicas import Replicas

        self.replicas = Replicas.from_options(router, replicas)
        if self.replicas is not None and self.replicas.shared is not None:
            self.replicas.shared.register_metrics(self.metrics.registry,
                                                  getattr(self.metrics, "namespace", "kvroute"))

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Creates the shared HTTP client and starts the metrics scraper. Idempotent.

        Raises ValueError for ``unix://`` workers with a client given to the proxy."""
        if self._started:
            return
        if self._client is not None and any(w.url.startswith(UDS_SCHEME)
                                            for w in self.router.workers):
            raise ValueError("unix:// workers need the proxy's own HTTP client (client=None)")
        if self._client is None:
            # One pool for forwarding, /v1/models and the scraper. Requests are forwarded with
            # the transport itself (see _send): no cookie jar shared between clients, no
            # redirects, none of the client layer's per-request cost.
            self._transport = _Transport(httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                trust_env=False))
            self._client = httpx.AsyncClient(
                transport=self._transport,
                timeout=httpx.Timeout(self.upstream_timeout_s, connect=self.connect_timeout_s),
                cookies=_no_cookies(), trust_env=False, follow_redirects=False)
        if self.orca_format:
            from kvroute.serving.load import orca_request_headers

            self._orca_headers = dict(orca_request_headers(self.orca_format))
        if self.scrape_metrics_interval_s is not None and self._scraper is None:
            from kvroute.serving.load import PrometheusScraper

            targets = {w.name: self.base_url(w.url) + "/metrics" for w in self.router.workers}
            self._scraper = PrometheusScraper(self.router, targets,
                                              interval_s=self.scrape_metrics_interval_s,
                                              client=self._client, **self._scrape_kwargs)
            self._scraper.start()
        if self._health_options is not None and self._health is None:
            from kvroute.serving.health import HealthChecker

            self._health = HealthChecker(lambda: [self.base_url(w.url)
                                                  for w in self.router.workers],
                                         self._client, **self._health_options)
            self._health.start()
        if self.replicas is not None:
            await self.replicas.start(self._client)
        self._started = True

    async def aclose(self) -> None:
        """Stops the scraper and closes the HTTP client if the proxy created it. Idempotent."""
        scraper, self._scraper = self._scraper, None
        if scraper is not None:
            await scraper.aclose()
        if self.replicas is not None:
            await self.replicas.aclose()
        health, self._health = self._health, None
        if health is not None:
            await health.aclose()
        if self.response_cache is not None:
            await self.response_cache.aclose()
        if self._own_client and self._client is not None:
            client, self._client = self._client, None
            self._transport = None
            await client.aclose()
        self._started = False

    async def _ensure_started(self) -> None:
        # Deliberately lazy as well: an app that mounts the router without running its
        # lifespan (e.g. a mounted sub-application) still works. Nothing closes the client
        # and scraper then unless the application calls `aclose` (or enters
        # kvroute.fastapi.lifespan); its pooled connections end with the process.
        if not self._started:
            if self._start_lock is None:
                self._start_lock = asyncio.Lock()
            async with self._start_lock:
                await self.start()

    def base_url(self, url: str) -> str:
        """Where requests for a worker URL go, without a trailing ``/``: the URL itself, or for
        ``unix:///path.sock`` an ``http://`` URL whose host (``uds-<hash>.kvroute.invalid``)
        the proxy's transport sends over that socket (one connection pool per socket).
        Raises httpx.InvalidURL for ``unix://`` without an absolute socket path, ValueError
        with a client given to the proxy (it cannot reach the socket)."""
        if not url.startswith(UDS_SCHEME):
            return url.rstrip("/")
        if self._transport is None:
            raise ValueError("unix:// workers need the proxy's own HTTP client (client=None)")
        return self._transport.uds_base(url)

    # -- fleet view ----------------------------------------------------------------------------
    def breaker(self, worker: str) -> CircuitBreaker:
        """The circuit breaker of a worker (by name), created closed on first use."""
        b = self._breakers.get(worker)
        if b is None:
            b = self._breakers[worker] = CircuitBreaker(self.breaker_failures,
                                                        self.breaker_reset_s)
        return b

    def _workers(self) -> Dict[str, Worker]:
        return {w.name: w for w in self.router.workers}

    def _unavailable(self, names: Iterable[str]) -> Set[str]:
        return {n for n in names if not self._up(n)}

    def _up(self, name: str) -> bool:
        """Circuit available and (with health checks) the worker's URL healthy."""
        if self._health is not None:
            w = self.router._workers.get(name)
            if w is not None and not self._health.healthy(self.base_url(w.url)):
                return False
        return self.breaker(name).available()

    def workers_view(self) -> Dict[str, Any]:
        """``GET /workers``: per worker its URL, data-parallel rank, index ``state``
        (``exact``, ``recovering``, ``degraded``, ``stale``), ``degraded`` (degraded or stale),
        ``indexed_blocks``, load (``inflight_requests``,
        ``pending_prefill_tokens``, ``num_requests_waiting``, ``kv_cache_usage_perc``),
        event counters, ``last_recv_age_s``, ``circuit`` (`CircuitBreaker.snapshot`) and
        ``scrape`` (the scraper's status of that worker, ``None`` when scraping is off), the
        other replicas' ``peer_inflight_requests`` / ``peer_pending_prefill_tokens``; plus the
        index totals and ``replicas`` (`kvroute.serving.replicas.Replicas.status`, or None)."""
        st = self.router.stats()
        scrape = self._scraper.status() if self._scraper is not None else {}
        keys = ("state", "indexed_blocks", "inflight_requests", "pending_prefill_tokens",
                "num_requests_waiting", "kv_cache_usage_perc", "last_recv_age_s", "events",
                "batches", "gaps", "batches_recovered", "replays", "dropped",
                "peer_inflight_requests", "peer_pending_prefill_tokens")
        out: Dict[str, Any] = {}
        for w in self.router.workers:
            ws = st["workers"].get(w.name, {})
            row: Dict[str, Any] = {"url": w.url, "dp_rank": w.dp_rank,
                                   "kv_endpoint": w.kv_endpoint}
            row.update({k: ws.get(k) for k in keys})
            # stale (silent past stale_after_s) is routed as degraded: both are not exact
            row["degraded"] = ws.get("state") in ("degraded", "stale")
            row["circuit"] = self.breaker(w.name).snapshot()
            row["scrape"] = _jsonable(scrape.get(w.name)) if isinstance(scrape, Mapping) else None
            out[w.name] = row
        return {"workers": out,
                "index": {k: st.get(k) for k in ("events_applied", "distinct_block_keys",
                                                  "indexed_entries", "index_memory_bytes",
                                                  "dropped")},
                "policy": self.router.policy, "block_size": self.router.block_size,
                "replicas": self.replicas.status() if self.replicas is not None else None}

    def health(self) -> Response:
        """200 while at least one worker can take a request now, else 503.

        A worker can when its circuit is closed, or half-open (``reset_s`` passed since it
        opened) with no probe request in flight; an open circuit, or a half-open one whose
        probe is in flight, does not count. ``available`` in the body is that count."""
        names = list(self._workers())
        up = [n for n in names if self._up(n)]
        body = {"status": "ok" if up else "unavailable", "workers": len(names),
                "available": len(up)}
        return JSONResponse(body, status_code=200 if up else 503)

    def ready(self) -> Response:
        """``GET /ready``: 200 once every worker's index is exact or explicitly degraded /
        stale and a configured bootstrap is over, else 503
        (`kvroute.serving.replicas.readiness`)."""
        from kvroute.serving.replicas import readiness

        ok, body = (self.replicas.readiness() if self.replicas is not None
                    else readiness(self.router))
        return JSONResponse(body, status_code=200 if ok else 503)

    def render_metrics(self) -> Response:
        """``GET /metrics``: `RouterMetrics.render` in the Prometheus text format."""
        data, content_type = self.metrics.render()
        return Response(content=data, media_type=None, headers={"content-type": content_type})

    async def models(self) -> Response:
        """``GET /v1/models``: the first available worker's answer, else the configured model,
        else 503."""
        await self._ensure_started()
        assert self._client is not None
        for name, w in self._workers().items():
            if not self.breaker(name).available():
                continue
            try:
                r = await self._client.get(self.base_url(w.url) + "/v1/models",
                                           timeout=min(self.upstream_timeout_s, 10.0))
            except (httpx.HTTPError, httpx.InvalidURL):
                continue
            if r.status_code == 200:
                return Response(content=r.content, status_code=200,
                                headers={"content-type": r.headers.get("content-type",
                                                                       "application/json"),
                                         WORKER_HEADER: name})
        if self.model:
            return JSONResponse({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": int(time.time()),
                 "owned_by": "kvroute", "root": self.model, "parent": None}]})
        return error_response(503, "no worker answered /v1/models and no model is configured")

    # -- request path ------------------------------------------------------------------------
    async def _parse(self, request: Request) -> Tuple[bytes, Dict[str, Any]]:
        """The raw body and its JSON object. Raises ValueError for a body that is not a JSON
        object (or nests too deeply to parse), starlette's ClientDisconnect when the client
        left while sending it."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"request body must be a JSON object: {e}") from None
        except RecursionError:
            raise ValueError("request body must be a JSON object: it nests too deeply") from None
        if not isinstance(body, dict):
            raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
        return raw, body

    async def _tokens(self, path: str, body: Mapping[str, Any]) -> np.ndarray:
        if self.tokenizer is None:
            return _token_id_prompt(path, body)
        from kvroute.serving.tokenizer import UnsupportedPrompt

        try:
            return await self.tokenizer.aencode_request(path, body)
        except RecursionError:
            raise ValueError("the request nests too deeply to tokenize") from None
        except UnsupportedPrompt as e:
            # Deliberately forwarded, not refused: the engine serves these (batched prompts,
            # prompt_embeds, images, a request chat_template); kvroute just cannot see their
            # blocks, so they route on load / session key like an empty prompt.
            log.debug("routing without a prefix match: %s", e)
            return np.empty(0, dtype=np.uint32)

    def _select_kwargs(self, request: Request, body: Mapping[str, Any],
                       tenant: Any = None) -> Dict[str, Any]:
        # An untrusted tenant's session headers / body fields are ignored: "" lets the
        # hashing policies hash the prompt.
        trusted = tenant is None or tenant.trust_session_key
        kw: Dict[str, Any] = {"session_key": session_key(request.headers, body)
                              if trusted else ""}
        salt = body.get("cache_salt")
        if isinstance(salt, str) and salt:
            kw["cache_salt"] = salt  # vLLM: the salt keys the prompt's first block
        requested = body.get("model")
        if self.model and isinstance(requested, str) and requested and requested != self.model:
            kw["lora_name"] = requested
        return kw

    def _upstream_headers(self, request: Request, worker: Worker,
                          tenant: Any = None) -> List[Tuple[bytes, bytes]]:
        """The client's header fields as raw byte pairs (order and repeats kept), minus the
        dropped ones, plus the ORCA request and data-parallel rank fields. For a tenant's
        request ``Authorization`` (the router's API key) is dropped and
        ``x-kvroute-tenant: <tenant name>`` added."""
        raw = request.headers.raw
        drop = _DROP_REQUEST | _connection_tokens(raw)
        if tenant is not None:
            drop = drop | {"authorization"}
        out = [(k, v) for k, v in raw
               if k.lower().decode("latin-1") not in drop
               and not k.lower().startswith(b"x-kvroute-")]
        sent = {k.lower() for k, _ in out}
        if self._orca_headers and ORCA_FORMAT_HEADER.encode() not in sent:
            out += [(k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in self._orca_headers.items()]
        if b"accept-encoding" not in sent:
            # The body is relayed undecoded: never ask for a compression the client did not.
            out.append((b"accept-encoding", b"identity"))
        if worker.dp_rank is not None:
            out.append((DP_RANK_HEADER.encode("latin-1"), str(worker.dp_rank).encode()))
        if tenant is not None:
            out.append((TENANT_HEADER.encode(), tenant.name.encode("utf-8")))
        return out

    def _build_request(self, url: str, raw: bytes,
                       headers: List[Tuple[bytes, bytes]]) -> httpx.Request:
        """The upstream request. Raises httpx.InvalidURL for a malformed worker URL."""
        if self._transport is not None:  # our own client: no default header fields added
            return httpx.Request("POST", url, content=raw, headers=headers,
                                 extensions={"timeout": self._timeout.as_dict()})
        assert self._client is not None
        return self._client.build_request("POST", url, content=raw, headers=headers)

    @property
    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.upstream_timeout_s, connect=self.connect_timeout_s)

    async def _select(self, tokens: np.ndarray, kw: Mapping[str, Any], explain: bool,
                      failed: Set[str], dry_run: bool = False) -> Decision:
        names = self._workers()
        exclude = (failed | self._unavailable(names)) & set(names)
        if len(exclude) >= len(names):
            raise _NoWorker(_no_worker_message(names, failed, self))
        t0 = time.perf_counter()
        select = functools.partial(self.router.select_worker, tokens, explain=explain,
                                   exclude=exclude, dry_run=dry_run, **kw)
        try:
            if getattr(self.router, "_lmcache", None) is None:
                d = select()  # microseconds: on the loop
            else:
                d = await self._select_off_loop(select, dry_run)
        except NoWorkerAvailable:  # a worker was removed meanwhile
            raise _NoWorker(_no_worker_message(names, failed, self)) from None
        if not dry_run:  # an explain is not a routed request
            self.metrics.observe_decision(d, time.perf_counter() - t0)
            if self.replicas is not None:
                self.replicas.on_decision(d, tokens, kw)
        return d

    async def _select_off_loop(self, select: Callable[[], Decision], dry_run: bool) -> Decision:
        """``select()`` on a worker thread (it blocks on the LMCache controller). If the caller
        is cancelled meanwhile, the decision the thread still makes is released when it
        arrives, so its load is not accounted forever."""
        fut = asyncio.ensure_future(asyncio.to_thread(select))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not dry_run:
                def release(f: asyncio.Future[Decision]) -> None:
                    if not f.cancelled() and f.exception() is None:
                        self.router.complete(f.result())
                fut.add_done_callback(release)
            raise

    async def explain(self, request: Request) -> Response:
        """``POST /v1/explain``: the decision for a completions or chat body (chat when it
        has ``messages``) with every worker's score terms, without forwarding it. A dry run
        (`Router.select_worker` ``dry_run=True``): nothing is accounted, credited or learned,
        so asking changes no later decision."""
        try:
            _, body = await self._parse(request)
            path = CHAT_PATH if "messages" in body else COMPLETIONS_PATH
            tokens = await self._tokens(path, body)
        except ValueError as e:
            return error_response(400, str(e))
        except ClientDisconnect:
            return Response(status_code=499)
        try:
            d = await self._select(tokens, self._select_kwargs(request, body), True, set(),
                                   dry_run=True)
        except _NoWorker as e:
            return error_response(503, str(e))
        return JSONResponse({"decision": decision_dict(d), "scores": scores_list(d),
                             "path": path, "prompt_tokens": int(len(tokens))})

    async def handle(self, request: Request, path: str, tenant: Any = None) -> Response:
        """Routes and forwards one ``POST`` to ``path`` (``/v1/completions`` or
        ``/v1/chat/completions``); see the module docstring. Never raises for bad input or
        unreachable workers: those become 400 / 503 error responses.

        ``tenant``: the `kvroute.serving.auth.Tenant` the request was admitted for, or
        ``None`` (no tenants configured). With a tenant, a body ``model`` outside its
        ``allowed_models`` is refused (403), its ``trust_session_key`` decides whether the
        client's session key is used, and ``Authorization`` is not forwarded (the engines
        get ``x-kvroute-tenant: <name>`` instead)."""
        await self._ensure_started()
        try:
            raw, body = await self._parse(request)
            if tenant is not None and not tenant.model_allowed(body.get("model")):
                return error_response(403, f"tenant {tenant.name} may not use model "
                                           f"{body.get('model')!r}", "PermissionDeniedError")
            cache_key = None
            cache = self.response_cache
            if cache is not None and cache.cacheable(body):
                cache_key = cache.key(tenant.name if tenant is not None else None, path, body)
                hit = await cache.aget(cache_key)
                result, similarity = "hit", None
                if hit is None and cache.semantic is not None:
                    hit, similarity = await self._semantic_lookup(
                        cache, tenant.name if tenant is not None else None, path, body,
                        cache_key)
                    result = "semantic_hit"
                self.metrics.observe_cache(result if hit is not None else "miss")
                if hit is not None:
                    if self.decisions is not None:
                        self.decisions.record({"tenant": tenant.name if tenant else None,
                                               "path": path, "cache": result, "worker": None,
                                               "similarity": similarity})
                    return _replay(hit, result, similarity)
            tokens = await self._tokens(path, body)
        except ValueError as e:
            return error_response(400, str(e))
        except ClientDisconnect:  # gone while sending the body: nothing to answer
            return Response(status_code=499)
        explain = request.headers.get(EXPLAIN_HEADER, "").strip().lower() in ("1", "true", "yes")
        kw = self._select_kwargs(request, body, tenant)
        resp = await _until_disconnect(
            request, self._dispatch(request, path, raw, tokens, kw, explain, tenant, cache_key))
        if resp is None:  # the client went away before the response started
            return Response(status_code=499)
        return resp

    async def _semantic_lookup(self, cache: ResponseCache, tenant: Optional[str], path: str,
                               body: Mapping[str, Any], key: str
                               ) -> Tuple[Any, Optional[float]]:
        """(the stored answer of the most similar earlier request at or above the threshold,
        or None; that similarity, None when nothing was compared). Fail-open: an embedding
        error is a miss."""
        from kvroute.serving.response_cache import prompt_text

        sem = cache.semantic
        text = prompt_text(path, body)
        if sem is None or text is None:
            return None, None
        group = sem.group(tenant, path, body)
        try:
            vec = await sem.embed(self._client, text)
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            log.warning("semantic cache: embedding failed: %s: %s", type(e).__name__, e)
            return None, None
        sem.remember(key, group, vec)
        best, sim = sem.nearest(group, vec)
        if best is None:
            return None, None
        self.metrics.observe_similarity(sim)
        if sim >= sem.threshold:
            hit = await cache.aget(best)
            if hit is not None:
                return hit, sim
        return None, sim

    async def _dispatch(self, request: Request, path: str, raw: bytes, tokens: np.ndarray,
                        kw: Mapping[str, Any], explain: bool, tenant: Any = None,
                        cache_key: Optional[str] = None) -> Response:
        assert self._client is not None
        failed: Set[str] = set()
        attempts = 0
        while True:
            try:
                d = await self._select(tokens, kw, explain or self.decisions is not None,
                                       failed)
            except _NoWorker as e:
                return error_response(503, str(e))
            attempts += 1
            if self.decisions is not None:
                # The Decision itself: its fields become JSON when the log is read.
                self.decisions.record({
                    "tenant": tenant.name if tenant is not None else None, "path": path,
                    "decision": d, "attempts": attempts})
            if attempts > 1:
                self.metrics.observe_retry()
            worker = self._workers().get(d.worker)
            if worker is None:  # removed between select and here
                self.router.complete(d)
                failed.add(d.worker)
                continue
            breaker = self.breaker(worker.name)
            probe = breaker.on_dispatch()
            t0 = time.perf_counter()
            handed_off = False
            verdict = False
            try:
                try:
                    req = self._build_request(self.base_url(worker.url) + path, raw,
                                              self._upstream_headers(request, worker, tenant))
                    upstream = await self._send(req)
                except (httpx.HTTPError, httpx.InvalidURL) as e:
                    verdict = True
                    self._breaker_failure(worker.name)
                    if _retryable(e):
                        self.metrics.observe_upstream(worker.name, "connect_error",
                                                      time.perf_counter() - t0)
                        failed.add(worker.name)
                        log.warning("worker %s unreachable (%s: %s); %s", worker.name,
                                    type(e).__name__, e,
                                    "retrying" if attempts <= self.max_retries else "giving up")
                        if attempts <= self.max_retries:
                            continue
                        return error_response(
                            503, f"no worker reachable: {len(failed)} attempt(s) failed to "
                                 f"connect ({', '.join(sorted(failed))})")
                    timeout = isinstance(e, httpx.TimeoutException)
                    self.metrics.observe_upstream(worker.name, "timeout" if timeout else "error",
                                                  time.perf_counter() - t0)
                    return error_response(504 if timeout else 502,
                                          f"worker {worker.name}: {type(e).__name__}: {e}",
                                          headers={WORKER_HEADER: worker.name})
                verdict = True
                if upstream.status_code >= 500:
                    self._breaker_failure(worker.name)
                else:
                    self._breaker_success(worker.name)
                if self.orca_format:
                    self._apply_orca(worker.name, upstream.headers)
                headers = _response_headers(upstream.headers, worker.name, d, explain, attempts)
                if cache_key is not None:
                    headers.append((CACHE_HEADER.encode(), b"miss"))
                ctype = upstream.headers.get("content-type", "")
                if ctype.startswith("text/event-stream"):
                    handed_off = True
                    return _UpstreamStream(self, d, worker.name, upstream, headers, t0, cache_key)
                try:
                    chunks = [c async for c in upstream.aiter_raw()]
                except httpx.HTTPError as e:
                    self._breaker_failure(worker.name)
                    self.metrics.observe_upstream(worker.name, "read_error",
                                                  time.perf_counter() - t0)
                    return error_response(502, f"worker {worker.name} broke off its response: "
                                               f"{type(e).__name__}: {e}",
                                          headers={WORKER_HEADER: worker.name})
                finally:
                    await upstream.aclose()
                self.metrics.observe_upstream(worker.name, upstream.status_code,
                                              time.perf_counter() - t0)
                content = b"".join(chunks)
                resp = Response(content=content, status_code=upstream.status_code)
                resp.raw_headers.extend(headers)  # after Starlette's content-length
                if cache_key is not None and self.response_cache is not None:
                    await self.response_cache.aput(cache_key, upstream.status_code, headers,
                                                   [content], stream=False)
                return resp
            finally:
                if not handed_off:
                    self.router.complete(d)
                    if not verdict:  # cancelled (client gone) before the worker answered
                        breaker.abandon(probe)

    async def _send(self, req: httpx.Request) -> httpx.Response:
        """Sends a request and returns once the response headers are in (body unread)."""
        if self._transport is not None:
            return await self._transport.handle_async_request(req)
        assert self._client is not None
        return await self._client.send(req, stream=True)

    def _apply_orca(self, worker: str, headers: httpx.Headers) -> None:
        from kvroute.serving.load import apply_orca

        try:
            apply_orca(self.router, worker, headers)
        except (ValueError, KeyError) as e:  # a malformed report never fails the request
            log.debug("ignoring ORCA report of %s: %s", worker, e)

    def _breaker_failure(self, worker: str) -> None:
        if self.breaker(worker).record_failure():
            log.warning("circuit of worker %s opened after %d consecutive failures", worker,
                        self.breaker(worker).consecutive_failures)
            self.metrics.set_circuit_open(worker, True)

    def _breaker_success(self, worker: str) -> None:
        if self.breaker(worker).record_success():
            log.info("circuit of worker %s closed", worker)
            self.metrics.set_circuit_open(worker, False)


class _Transport(httpx.AsyncBaseTransport):
    """The proxy's transport: TCP through one pool, and per unix socket a pool of its own,
    chosen by the request's host (see `Proxy.base_url`)."""

    def __init__(self, tcp: httpx.AsyncHTTPTransport) -> None:
        self.tcp = tcp
        self._uds: Dict[str, httpx.AsyncHTTPTransport] = {}  # host -> transport
        self._hosts: Dict[str, str] = {}  # socket path -> host

    def uds_base(self, url: str) -> str:
        path = url[len(UDS_SCHEME):]
        if not path.startswith("/") or len(path) < 2:
            # InvalidURL: as a malformed http URL, the request fails over to another worker
            raise httpx.InvalidURL(f"a unix socket worker URL is unix:///absolute/path.sock, "
                                   f"got {url!r}")
        host = self._hosts.get(path)
        if host is None:
            import hashlib

            host = f"uds-{hashlib.sha256(path.encode()).hexdigest()[:16]}.kvroute.invalid"
            self._uds[host] = httpx.AsyncHTTPTransport(
                uds=path, limits=httpx.Limits(max_connections=None,
                                              max_keepalive_connections=64))
            self._hosts[path] = host
        return f"http://{host}"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = self._uds.get(request.url.host)
        return await (t if t is not None else self.tcp).handle_async_request(request)

    async def aclose(self) -> None:
        for t in [self.tcp, *self._uds.values()]:
            await t.aclose()


class _UpstreamStream(StreamingResponse):
    """An upstream SSE response relayed chunk by chunk; releases the decision exactly once
    (first chunk: first_token; end, error or client disconnect: complete)."""

    def __init__(self, proxy: Proxy, decision: Decision, worker: str, upstream: httpx.Response,
                 headers: List[Tuple[bytes, bytes]], t0: float,
                 cache_key: Optional[str] = None) -> None:
        self._proxy = proxy
        self._cache_key = cache_key
        self._cache_headers = headers
        self._decision = decision
        self._worker = worker
        self._upstream = upstream
        self._t0 = t0
        self._done = False
        super().__init__(self._relay(), status_code=upstream.status_code)
        self.raw_headers.extend(headers)

    async def _relay(self) -> AsyncIterator[bytes]:
        first = True
        outcome: Any = "disconnect"
        kept: Optional[List[bytes]] = [] if self._cache_key is not None else None
        try:
            async for chunk in self._upstream.aiter_raw():
                if first and chunk:
                    first = False
                    self._proxy.router.first_token(self._decision)
                if kept is not None:
                    kept.append(chunk)
                yield chunk
            outcome = self._upstream.status_code
            cache = self._proxy.response_cache
            if kept is not None and cache is not None and self._cache_key is not None:
                await cache.aput(self._cache_key, outcome, self._cache_headers, kept,
                                 stream=True)
        except httpx.HTTPError as e:
            outcome = "read_error"
            self._proxy._breaker_failure(self._worker)
            log.warning("worker %s broke off a stream: %s: %s", self._worker, type(e).__name__, e)
            # vLLM's in-stream error event (serving_engine create_streaming_error_response)
            err = {"error": {"message": f"worker {self._worker} broke off the stream: "
                                        f"{type(e).__name__}", "type": "BadGatewayError",
                             "param": None, "code": 502}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            self._finish(outcome)

    def _finish(self, outcome: Any) -> None:
        if self._done:
            return
        self._done = True
        self._proxy.router.complete(self._decision)
        self._proxy.metrics.observe_upstream(self._worker, outcome, time.perf_counter() - self._t0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # The client may be gone with the relay suspended at a yield: release now rather
            # than whenever the generator is garbage-collected.
            self._finish("disconnect")
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._upstream.aclose()


# -- helpers -----------------------------------------------------------------------------------

def _log_entry(entry: Dict[str, Any]) -> Dict[str, Any]:
    """A decision-log entry for ``GET /admin/decisions``: a held ``decision`` (recorded as the
    `kvroute.Decision`, cheap) becomes its `decision_dict` fields and ``scores``."""
    d = entry.get("decision")
    if d is None:
        return dict(entry)
    out = {k: v for k, v in entry.items() if k not in ("decision", "attempts")}
    out.update(decision_dict(d, entry.get("attempts", 1)))
    out["scores"] = scores_list(d)
    return out


def _replay(hit: Any, result: str = "hit", similarity: Optional[float] = None) -> Response:
    """A `kvroute.serving.response_cache.CachedResponse` as a response: the same status,
    header fields and body bytes (a stream as the same chunks), plus ``x-kvroute-cache:
    <result>`` and, for a semantic hit, ``x-kvroute-cache-similarity``."""
    resp: Response
    if hit.stream:
        async def chunks() -> AsyncIterator[bytes]:
            for c in hit.chunks:
                yield c
        resp = StreamingResponse(chunks(), status_code=hit.status)
    else:
        resp = Response(content=b"".join(hit.chunks), status_code=hit.status)
    resp.raw_headers.extend(hit.headers)
    resp.raw_headers.append((CACHE_HEADER.encode(), result.encode()))
    if similarity is not None:
        resp.raw_headers.append((SIMILARITY_HEADER.encode(), f"{similarity:.6f}".encode()))
    return resp


def _no_cookies() -> http.cookiejar.CookieJar:
    """A cookie jar that stores nothing: a proxy must not carry one client's cookies (from
    an upstream Set-Cookie) to another client's requests."""
    return http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


def _jsonable(x: Any) -> Any:
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "_asdict"):
        return _jsonable(x._asdict())
    if hasattr(x, "__dict__"):
        return _jsonable(vars(x))
    return str(x)


def _no_worker_message(names: Iterable[str], failed: Set[str], proxy: Proxy) -> str:
    names = list(names)
    opened = [n for n in names if n not in failed and not proxy.breaker(n).available()]
    parts = []
    if failed:
        parts.append(f"unreachable: {', '.join(sorted(failed))}")
    if opened:
        parts.append(f"circuit open: {', '.join(sorted(opened))}")
    return f"no worker available among {len(names)} ({'; '.join(parts) or 'none configured'})"


def _connection_tokens(raw: Iterable[Tuple[bytes, bytes]]) -> Set[str]:
    """Field names listed in ``Connection`` header fields (hop-by-hop, RFC 9110 7.6.1),
    lower-cased."""
    out: Set[str] = set()
    for k, v in raw:
        if k.lower() == b"connection":
            out.update(t.strip().lower() for t in v.decode("latin-1").split(",") if t.strip())
    return out


def _response_headers(upstream: httpx.Headers, worker: str, d: Decision, explain: bool,
                      attempts: int) -> List[Tuple[bytes, bytes]]:
    """The upstream response's header fields as raw byte pairs for the ASGI response (each
    repeated field, e.g. ``Set-Cookie``, kept as its own pair), minus hop-by-hop ones, plus
    kvroute's."""
    raw = upstream.raw
    drop = _DROP_RESPONSE | _connection_tokens(raw) | {WORKER_HEADER, DECISION_HEADER,
                                                       SCORES_HEADER}
    out = [(k.lower(), v) for k, v in raw if k.lower().decode("latin-1") not in drop]
    out.append((WORKER_HEADER.encode(), worker.encode("latin-1", "replace")))
    if explain:
        out.append((DECISION_HEADER.encode(),
                    json.dumps(decision_dict(d, attempts), separators=(",", ":")).encode()))
        out.append((SCORES_HEADER.encode(),
                    json.dumps(scores_list(d), separators=(",", ":")).encode()))
    return out


def _token_id_prompt(path: str, body: Mapping[str, Any]) -> np.ndarray:
    """Without a tokenizer: a completions prompt given as token ids, else an empty prompt.

    Raises ValueError when the body lacks ``prompt`` (completions) / ``messages`` (chat)."""
    if path == CHAT_PATH:
        if not isinstance(body.get("messages"), list):
            raise ValueError("a chat completions request needs 'messages' (a list)")
        return np.empty(0, dtype=np.uint32)
    if "prompt" not in body:
        raise ValueError("a completions request needs 'prompt'")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
        p = p[0]
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
        if min(p) < 0 or max(p) >= 1 << 32:
            raise ValueError("prompt token ids must be in [0, 2**32)")
        return np.asarray(p, dtype=np.uint32)
    return np.empty(0, dtype=np.uint32)


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Optional[Response]:
    """Runs ``work`` until it returns or the client disconnects (then cancels it and returns
    None), as vLLM's ``with_cancellation`` does. The request body must have been read."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # We are cancelled (the server shuts down, or the app's own cancel scope): the work
        # may already have returned a stream that nobody will send now.
        watcher.cancel()
        task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, return_exceptions=True)
            await _discard(task)
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await _discard(task)  # it may have finished in the same instant
    return None


async def _discard(task: asyncio.Future[Response]) -> None:
    """Releases the response of finished ``work`` that will not be sent: a streaming one holds
    a decision and an upstream connection."""
    if task.cancelled() or task.exception() is not None:
        return
    resp = task.result()
    if isinstance(resp, _UpstreamStream):
        resp._finish("disconnect")
        await resp._upstream.aclose()
