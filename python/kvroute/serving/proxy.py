"""The OpenAI-compatible proxy behind `kvroute.fastapi`: route, forward, release.

One `Proxy` serves every request of an app. Per request (``POST /v1/completions`` or
``POST /v1/chat/completions``, a JSON object as vLLM's OpenAI server takes it):

1. Tokenize as the engine will (`kvroute.serving.tokenizer.PromptTokenizer`, off the event
   loop): the model's chat template for ``messages``, ``prompt`` text, or token ids as they
   are. Without a tokenizer only token-id prompts are matched against the index; text prompts
   are routed on load and the session key alone (see `Proxy`).
2. ``router.select_worker(tokens, session_key=kvroute.session_key(headers, body),
   exclude=<workers whose circuit is open> | <workers that already failed this request>)``;
   ``headers`` as the client sent them (an ``x-request-id`` kvroute generated is no session
   key: `kvroute.serving.routes.client_headers`).
3. Forward the body unchanged to ``worker.url + path`` over the proxy's aiohttp pool
   (`_Forwarder`: keep-alive connections per worker; connect and read timeouts), with
   vLLM's ORCA load-report request
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

Failures: before any byte reached the client, a failed attempt (a connect error, a malformed
worker URL, a connection that broke before the response headers, see `_retryable`; no
headers within ``first_byte_timeout_s`` or the worker marked unhealthy meanwhile; an engine's
500 / 502 / 503 / 504 / 429) marks the worker failed for this request and the next-best
worker is tried after an exponential backoff with jitter
(`kvroute.serving.retry.RetryPolicy`), at most ``max_retries`` times and only while another
worker is available; every worker has a circuit breaker (`CircuitBreaker`) and, with health
checks, an active health state (`kvroute.serving.health`); recovered workers are ramped up
(`kvroute.serving.health.RecoveryRamp`). When no worker can be reached the client gets 503
with ``Retry-After``, a body over the limits 413 / 400 (`kvroute.serving.limits`), a body
that is not a valid request 400, all as vLLM's error JSON (its OpenAI server's
``ErrorResponse`` / ``ErrorInfo``: ``{"error": {"message", "type", "param", "code"}}``,
``code`` = the HTTP status). Other upstream 4xx responses, and 5xx / 429 when no other worker
is left, are passed through as they are. A client that goes away before the response starts
gets (in the access log) 499.

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
import math
import os
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

import aiohttp
import anyio
import httpx
import msgspec
import numpy as np
from multidict import CIMultiDict as _CIMultiDict
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvroute._router import Decision, NoWorkerAvailable, Router, Worker
from kvroute.prompt import TokenizerBusy
from kvroute.serving.health import (
    FirstByteTimeout,
    guard_first_byte,
    recovered_at,
    stop_checks,
)
from kvroute.serving.hitrate import StreamReport, report_body
from kvroute.serving.limits import BodyTooLarge, PromptTooLong, RequestLimits, read_body
from kvroute.serving.response_cache import CACHE_HEADER, SIMILARITY_HEADER, ResponseCache
from kvroute.serving.routes import PASS_THROUGH, client_headers, note_routed, prompt_request
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
PID_HEADER = "x-kvroute-pid"  # GET /health: the answering process
UDS_SCHEME = "unix://"
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM serving_engine._get_data_parallel_rank
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"  # vLLM serve/utils/orca_metrics.py


def error_response(status: int, message: str, err_type: Optional[str] = None,
                   param: Optional[str] = None,
                   headers: Optional[Mapping[str, str]] = None) -> JSONResponse:
    """A JSON error in vLLM's OpenAI-server shape: ``{"error": {"message", "type", "param",
    "code"}}`` with ``code`` = ``status`` (vLLM ``ErrorInfo``)."""
    kind = err_type or {400: "BadRequestError", 404: "NotFoundError",
                        405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError",
                        429: "RateLimitError", 502: "BadGatewayError",
                        503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}.get(
                            status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def decision_dict(d: Decision, attempts: int = 1) -> Dict[str, Any]:
    """A `kvroute.Decision` as JSON-ready fields (``scores`` not included; see
    `scores_list`)."""
    return {"worker": d.worker, "matched_tokens": int(d.matched_tokens),
            "matched_blocks": int(d.matched_blocks), "prompt_tokens": int(d.prompt_tokens),
            "available_tokens": int(d.available_tokens),
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
    ``reset_s`` seconds have passed; ``half_open`` lets requests through again (the proxy
    ramps the worker's share up with `kvroute.serving.health.RecoveryRamp` from
    `ramp_from`, so a burst right after recovery is served rather than refused): a response
    below 500 closes the circuit, a failure opens it for another ``reset_s``. ``on_dispatch``
    marks the first request sent in half-open state as the probe (`snapshot` shows it).

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
        self._ramp_from: Optional[float] = None

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"``."""
        if self._opened_at is None:
            return self.CLOSED
        if self._clock() - self._opened_at >= self.reset_s:
            return self.HALF_OPEN
        return self.OPEN

    def available(self) -> bool:
        """True if a request may go to the worker now: closed or half-open."""
        return self.state != self.OPEN

    @property
    def ramp_from(self) -> Optional[float]:
        """Clock time the circuit last turned half-open (the start of its recovery ramp), or
        None if it never opened."""
        return self._ramp_from if self._opened_at is None else self._opened_at + self.reset_s

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
        if was_open:
            self._ramp_from = self.ramp_from
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


def limit_response(e: Exception) -> JSONResponse:
    """413 for a body over ``max_body_bytes``, 503 (``Retry-After: 1``) for a full tokenizer
    lane."""
    if isinstance(e, BodyTooLarge):
        return error_response(413, str(e), "RequestEntityTooLargeError")
    return error_response(503, str(e), headers={"Retry-After": "1"})


def _failure_kind(exc: BaseException) -> str:
    """The `kvroute.serving.retry.RETRY_ON` kind of an attempt's failure before its response
    headers: ``connect`` (see `_retryable`), ``timeout`` (a first-byte timeout, the worker
    marked down, or httpx's read / write / pool timeout), else ``error`` (never retried)."""
    if isinstance(exc, FirstByteTimeout):
        return "timeout"
    if _retryable(exc):
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    return "error"


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
    first_byte_timeout_s:
        Seconds a request waits for the response headers of one attempt (a streamed answer
        sends them at once, a non-streaming one after its whole generation); past it the
        attempt counts as a ``timeout`` failure (retried per ``retry``, else 504). ``None``:
        only ``upstream_timeout_s`` bounds the wait. With health checks on, a request
        waiting on a worker that is marked unhealthy is abandoned the same way.
    retry:
        `kvroute.serving.retry.RetryPolicy`, or a mapping of its keywords
        (``initial_backoff_ms``, ``max_backoff_ms``, ``backoff_multiplier``,
        ``jitter_factor``, ``retry_on``; ``max_retries`` defaults to the argument above).
        Only failures before any byte reached the client are retried.
    limits:
        `kvroute.serving.limits.RequestLimits` or a mapping of its keywords
        (``max_body_bytes``, default 32 MiB: 413 above; ``max_prompt_tokens``, default
        ``"auto"``: the workers' ``max_model_len``, 400 above; ``chars_per_token``,
        ``max_prompt_chars``: 400 before tokenizing); ``None``: the defaults.
    recovery_ramp_s:
        A worker back from an open circuit or an unhealthy state gets a share of the
        requests it is chosen for that grows from 10 % to all over this many seconds
        (`kvroute.serving.health.RecoveryRamp`); no worker is held back when every
        available worker is ramping. 0: no ramp.
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
        jar, redirects; not closed by the proxy). Default, created at `start`: requests are
        forwarded over aiohttp (`_Forwarder`: a keep-alive pool per worker, unlimited
        connections, no proxy from the environment, no cookie jar shared between clients,
        no redirect followed, none of a client library's default header fields such as
        ``User-Agent`` or ``Accept`` added), and an ``httpx.AsyncClient`` on a pooled
        transport serves the side traffic (``/v1/models``, scrapes, health checks). A given
        client adds its configured default header fields to what the client sent, except
        ``Accept-Encoding`` (``identity`` unless the client sent one).

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
        first_byte_timeout_s: Optional[float] = None,
        retry: Any = None,
        recovery_ramp_s: float = 10.0,
        limits: Any = None,
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
        from kvroute.serving.health import RecoveryRamp, first_byte_timeout
        from kvroute.serving.retry import RetryPolicy

        self.first_byte_timeout_s = first_byte_timeout(first_byte_timeout_s)
        self.retry = RetryPolicy.from_options(retry, max_retries)
        max_retries = self.retry.max_retries
        self.ramp = RecoveryRamp(recovery_ramp_s)
        self.limits = RequestLimits.from_options(limits)
        self._limits_task: Optional[asyncio.Task[None]] = None
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
        self._forward: Optional[_Forwarder] = None
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
            self._forward = _Forwarder(self._transport, self.connect_timeout_s,
                                       self.upstream_timeout_s)
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
        if self.limits.auto and self._limits_task is None:
            from kvroute.serving.limits import learn_max_model_len

            self._limits_task = asyncio.get_running_loop().create_task(learn_max_model_len(
                self.limits, self._client,
                lambda: [self.base_url(w.url) for w in self.router.workers]))
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
        learner, self._limits_task = self._limits_task, None
        await stop_checks(health, learner)
        if self.response_cache is not None:
            await self.response_cache.aclose()
        if self._own_client and self._client is not None:
            client, self._client = self._client, None
            forward, self._forward = self._forward, None
            self._transport = None
            await client.aclose()
            if forward is not None:
                await forward.aclose()
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

    def _recovered_at(self, worker: Worker) -> Optional[float]:
        """Monotonic time the worker last came back (circuit half-open, or its URL healthy
        again), None if it never went down (`kvroute.serving.health.RecoveryRamp`)."""
        return recovered_at(self.breaker(worker.name).ramp_from, self._health,
                            self.base_url(worker.url))

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
        event counters, ``last_recv_age_s``, ``circuit`` (`CircuitBreaker.snapshot`),
        ``health`` (``healthy``, ``streak``; ``None`` without health checks or before the
        first probe), ``recovery_share`` (`kvroute.serving.health.RecoveryRamp`: 1 unless
        recovering), ``scrape`` (the scraper's status of that worker, ``None`` when
        scraping is off) and ``prefix_tokens`` (prompt tokens over the requests whose cached
        count came back: ``available``, ``captured``, ``delivered``, ``reports``; see
        `kvroute.Router.report_delivered`); plus the index totals, ``hit_rate`` (the same
        sums over every worker), ``limits`` (`RequestLimits.as_dict`) and ``tokenizer_lanes``
        (`PromptTokenizer.lanes`, ``None`` without one); with replicas, the other replicas'
        ``peer_inflight_requests`` / ``peer_pending_prefill_tokens`` per worker and
        ``replicas`` (`kvroute.serving.replicas.Replicas.status`, else None)."""
        st = self.router.stats()
        hits = self.router.hit_rate.snapshot()
        scrape = self._scraper.status() if self._scraper is not None else {}
        keys = ("state", "indexed_blocks", "inflight_requests", "pending_prefill_tokens",
                "num_requests_waiting", "kv_cache_usage_perc", "last_recv_age_s", "events",
                "batches", "gaps", "batches_recovered", "replays", "reconnects", "resets",
                "dropped", "peer_inflight_requests", "peer_pending_prefill_tokens")
        out: Dict[str, Any] = {}
        for w in self.router.workers:
            ws = st["workers"].get(w.name, {})
            row: Dict[str, Any] = {"url": w.url, "dp_rank": w.dp_rank,
                                   "kv_endpoint": w.kv_endpoint}
            row.update({k: ws.get(k) for k in keys})
            # stale (silent past stale_after_s) is routed as degraded: both are not exact
            row["degraded"] = ws.get("state") in ("degraded", "stale")
            row["circuit"] = self.breaker(w.name).snapshot()
            row["health"] = (self._health.status().get(self.base_url(w.url))
                             if self._health is not None else None)
            row["recovery_share"] = round(self.ramp.share(self._recovered_at(w)), 3)
            row["scrape"] = _jsonable(scrape.get(w.name)) if isinstance(scrape, Mapping) else None
            wh = hits["workers"].get(w.name, {})
            row["prefix_tokens"] = {k: wh.get(k, 0) for k in ("available", "captured",
                                                               "delivered", "reports")}
            out[w.name] = row
        return {"workers": out,
                "index": {k: st.get(k) for k in ("events_applied", "distinct_block_keys",
                                                  "indexed_entries", "index_memory_bytes",
                                                  "dropped")},
                "policy": self.router.policy, "block_size": self.router.block_size,
                "hit_rate": {**hits["totals"], "reports": hits["reports"],
                             "unreported": hits["unreported"]},
                "limits": self.limits.as_dict(),
                "tokenizer_lanes": (self.tokenizer.lanes()
                                    if hasattr(self.tokenizer, "lanes") else None),
                "replicas": self.replicas.status() if self.replicas is not None else None}

    def health(self) -> Response:
        """200 while at least one worker can take a request now, else 503 with
        ``Retry-After``.

        A worker can when its circuit is closed or half-open (``reset_s`` passed since it
        opened) and, with health checks, its URL is not marked unhealthy. ``available`` in
        the body is that count."""
        names = list(self._workers())
        up = [n for n in names if self._up(n)]
        body = {"status": "ok" if up else "unavailable", "workers": len(names),
                "available": len(up)}
        if up:
            return JSONResponse(body, headers={PID_HEADER: str(os.getpid())})
        return JSONResponse(body, status_code=503,
                            headers={"Retry-After": str(self._retry_after_s()),
                                     PID_HEADER: str(os.getpid())})

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
        """``GET /v1/models``: the first available worker's answer, else the configured model;
        503 (with ``Retry-After``) when no worker is available or none answered and no model
        is configured."""
        await self._ensure_started()
        assert self._client is not None
        workers = self._workers()
        if not any(self._up(n) for n in workers):
            return error_response(503, f"no worker available among {len(workers)}",
                                  headers={"Retry-After": str(self._retry_after_s())})
        for name, w in workers.items():
            if not self._up(name):
                continue
            try:
                r = await self._client.get(self.base_url(w.url) + "/v1/models",
                                           timeout=min(self.upstream_timeout_s, 10.0))
            except (httpx.HTTPError, httpx.InvalidURL):
                continue
            if r.status_code == 200:
                if self.limits.auto and self.limits.max_prompt_tokens is None:
                    try:
                        self.limits.learn_max_model_len(
                            m.get("max_model_len") for m in r.json().get("data", [])
                            if isinstance(m, dict))
                    except (ValueError, AttributeError):
                        pass
                return Response(content=r.content, status_code=200,
                                headers={"content-type": r.headers.get("content-type",
                                                                       "application/json"),
                                         WORKER_HEADER: name})
        if self.model:
            return JSONResponse({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": int(time.time()),
                 "owned_by": "kvroute", "root": self.model, "parent": None}]})
        return error_response(503, "no worker answered /v1/models and no model is configured",
                              headers={"Retry-After": str(self._retry_after_s())})

    # -- request path ------------------------------------------------------------------------
    async def _parse(self, request: Request) -> Tuple[bytes, Dict[str, Any]]:
        return await parse_body(request, self.limits.max_body_bytes)

    async def _tokens(self, path: str, body: Mapping[str, Any]) -> np.ndarray:
        """The prompt's token ids, within the limits (raises PromptTooLong, a ValueError)."""
        return await self.limits.tokens_within(
            body, functools.partial(encode_routed, self.tokenizer, path, body))

    def _select_kwargs(self, request: Request, body: Mapping[str, Any],
                       tenant: Any = None) -> Dict[str, Any]:
        # An untrusted tenant's session headers / body fields are ignored: "" lets the
        # hashing policies hash the prompt.
        return select_kwargs(client_headers(request.scope, request.headers), body, self.model,
                             trusted=tenant is None or tenant.trust_session_key)

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
                       headers: List[Tuple[bytes, bytes]]) -> Any:
        """The upstream request: a `_Outgoing` for the proxy's own forwarder, else an
        ``httpx.Request`` of the given client. Raises httpx.InvalidURL for a malformed worker
        URL."""
        if self._forward is not None:  # our own client: no default header fields added
            return _Outgoing(url, raw, headers)
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
        if not dry_run:
            # Recovering workers get a growing share; none is held back when that would
            # leave no worker.
            exclude |= self.ramp.hold_back(
                {n: self._recovered_at(w) for n, w in names.items()}, exclude)
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
        except (BodyTooLarge, TokenizerBusy) as e:
            return limit_response(e)
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
                    note_routed(request.scope, tenant=tenant.name if tenant else None,
                                worker=None, cache=result)
                    if self.decisions is not None:
                        self.decisions.record({"tenant": tenant.name if tenant else None,
                                               "path": path, "cache": result, "worker": None,
                                               "similarity": similarity})
                    return _replay(hit, result, similarity)
            tokens = await self._tokens(path, body)
        except ValueError as e:
            return error_response(400, str(e))
        except (BodyTooLarge, TokenizerBusy) as e:
            return limit_response(e)
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
                return error_response(503, str(e),
                                      headers={"Retry-After": str(self._retry_after_s())})
            attempts += 1
            note_routed(request.scope, tenant=tenant.name if tenant is not None else None,
                        worker=d.worker, attempts=attempts, decision=d)
            entry = None
            if self.decisions is not None:
                # The Decision itself: its fields become JSON when the log is read.
                entry = {"tenant": tenant.name if tenant is not None else None, "path": path,
                         "decision": d, "attempts": attempts}
                self.decisions.record(entry)
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
                    upstream = await self._first_byte(worker, self._send(req))
                except (httpx.HTTPError, httpx.InvalidURL, FirstByteTimeout) as e:
                    verdict = True
                    self._breaker_failure(worker.name)
                    kind = _failure_kind(e)
                    if kind in ("connect", "timeout") and self._health is not None:
                        self._health.poke(self.base_url(worker.url))
                    self.metrics.observe_upstream(
                        worker.name, {"connect": "connect_error"}.get(kind, kind),
                        time.perf_counter() - t0)
                    failed.add(worker.name)
                    again = self._may_retry(kind, attempts, failed)
                    log.warning("worker %s: %s: %s; %s", worker.name, type(e).__name__, e,
                                "retrying" if again else "giving up")
                    if again:
                        await asyncio.sleep(self.retry.backoff_s(attempts))
                        continue
                    if kind == "connect":
                        return error_response(
                            503, f"no worker reachable: {len(failed)} attempt(s) failed to "
                                 f"connect ({', '.join(sorted(failed))})",
                            headers={"Retry-After": str(self._retry_after_s())})
                    return error_response(504 if kind == "timeout" else 502,
                                          f"worker {worker.name}: {type(e).__name__}: {e}",
                                          headers={WORKER_HEADER: worker.name})
                verdict = True
                if upstream.status_code >= 500:
                    self._breaker_failure(worker.name)
                else:
                    self._breaker_success(worker.name)
                status_kind = self.retry.status_kind(upstream.status_code)
                if status_kind is not None and self._may_retry(status_kind, attempts,
                                                               failed | {worker.name}):
                    # Answered before any byte reached the client: try another worker.
                    await upstream.aclose()
                    self.metrics.observe_upstream(worker.name, upstream.status_code,
                                                  time.perf_counter() - t0)
                    failed.add(worker.name)
                    log.warning("worker %s answered %d; retrying", worker.name,
                                upstream.status_code)
                    await asyncio.sleep(self.retry.backoff_s(attempts))
                    continue
                if self.orca_format:
                    self._apply_orca(worker.name, upstream.headers)
                headers = _response_headers(upstream.headers, worker.name, d, explain, attempts)
                if cache_key is not None:
                    headers.append((CACHE_HEADER.encode(), b"miss"))
                ctype = upstream.headers.get("content-type", "")
                if ctype.startswith("text/event-stream"):
                    handed_off = True
                    return _UpstreamStream(self, d, worker.name, upstream, headers, t0, cache_key,
                                           StreamReport(self.router, d, entry))
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
                report_body(self.router, d, upstream.status_code, content, entry)
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

    async def _send(self, req: Any) -> Any:
        """Sends a request and returns once the response headers are in (body unread): an
        ``httpx.Response``, or the forwarder's `_AioResponse` (the same ``status_code``,
        ``headers``, ``aiter_raw`` and ``aclose``; its errors raised as httpx's)."""
        if isinstance(req, _Outgoing):
            assert self._forward is not None
            return await self._forward.send(req)
        assert self._client is not None
        return await self._client.send(req, stream=True)

    async def _first_byte(self, worker: Worker, send: Awaitable[Any]) -> Any:
        """``send`` bounded by ``first_byte_timeout_s`` and abandoned when the health check
        marks the worker's URL unhealthy meanwhile (`kvroute.serving.health.first_byte`)."""
        return await guard_first_byte(send, self.first_byte_timeout_s, self._health,
                                      self.base_url(worker.url))

    def _may_retry(self, kind: str, attempts: int, failed: Set[str]) -> bool:
        """The retry policy allows a retry of ``kind`` and some worker outside ``failed`` is
        up (otherwise the failure is answered as it is, not turned into a 503)."""
        if not self.retry.retries(kind, attempts):
            return False
        names = self._workers()
        return len((failed | self._unavailable(names)) & set(names)) < len(names)

    def _retry_after_s(self) -> int:
        """Whole seconds a client should wait before trying again when no worker is up: until
        the first open circuit turns half-open, else one health-check interval, at least 1."""
        waits = [b.snapshot()["retry_in_s"] for n, b in self._breakers.items()
                 if b.state == CircuitBreaker.OPEN]
        if not waits and self._health is not None:
            waits = [self._health.retry_after_s()]
        return max(1, math.ceil(min(waits, default=1.0)))

    def _apply_orca(self, worker: str, headers: Any) -> None:
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
        self._paths: Dict[str, str] = {}  # host -> socket path

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
            self._paths[host] = path
        return f"http://{host}"

    def uds_path(self, host: str) -> Optional[str]:
        """The socket path behind a ``uds-<hash>.kvroute.invalid`` host, else None."""
        t = self._uds.get(host)
        return None if t is None else self._paths[host]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = self._uds.get(request.url.host)
        return await (t if t is not None else self.tcp).handle_async_request(request)

    async def aclose(self) -> None:
        for t in [self.tcp, *self._uds.values()]:
            await t.aclose()


class _Outgoing:
    """A request for `_Forwarder.send`: POST ``content`` to ``url`` with ``headers`` (raw
    byte pairs, sent in order)."""

    __slots__ = ("url", "content", "headers")

    def __init__(self, url: str, content: bytes, headers: List[Tuple[bytes, bytes]]) -> None:
        self.url = url
        self.content = content
        self.headers = headers


class _RawHeaders:
    """Response header fields as received: ``raw`` (byte pairs, repeats kept) and a
    case-insensitive ``get`` of the first value (latin-1), as ``httpx.Headers`` offers them."""

    __slots__ = ("raw",)

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def get(self, name: str, default: Optional[str] = None) -> Optional[str]:
        key = name.lower().encode("latin-1")
        for k, v in self.raw:
            if k.lower() == key:
                return str(v.decode("latin-1"))
        return default


class _AioResponse:
    """An upstream response from `_Forwarder` with the part of ``httpx.Response`` the proxy
    reads: ``status_code``, ``headers`` (`_RawHeaders`), ``aiter_raw()`` (the body as it
    arrives, transfer coding removed, content coding kept) and ``aclose()`` (the connection
    goes back to the pool when the body was read to its end, else it is closed, so the engine
    sees the client leave). aiohttp's errors are raised as the httpx ones `_retryable` and
    the relay handle."""

    __slots__ = ("_resp", "status_code", "headers")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers = _RawHeaders(resp.raw_headers)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise _as_httpx(e, reading=True) from e

    async def aclose(self) -> None:
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


def _as_httpx(e: BaseException, reading: bool = False) -> Exception:
    """An aiohttp error as the httpx exception of the same meaning (the proxy's retry and
    error paths are written against httpx's)."""
    msg = f"{type(e).__name__}: {e}"
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(msg)
    if isinstance(e, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return httpx.ReadTimeout(msg)
    if isinstance(e, aiohttp.ClientConnectorError):
        return httpx.ConnectError(msg)
    if isinstance(e, aiohttp.InvalidURL):
        return httpx.InvalidURL(msg)
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                      aiohttp.ClientResponseError)):
        return httpx.RemoteProtocolError(msg)
    if isinstance(e, aiohttp.ClientOSError):
        return httpx.ReadError(msg) if reading else httpx.WriteError(msg)
    return httpx.TransportError(msg)


# Seconds an idle upstream connection is kept: below uvicorn's default keep-alive timeout
# (5 s; vLLM and SGLang serve with uvicorn), so the proxy never reuses a connection the engine
# is closing.
_KEEPALIVE_S = 4.0


class _Forwarder:
    """The proxy's request path to the workers, on aiohttp: one ``ClientSession`` whose
    ``TCPConnector`` keeps a pool of keep-alive connections per worker ``host:port``
    (unlimited connections, idle ones kept `_KEEPALIVE_S`), and one session per unix socket
    (the ``uds-<hash>.kvroute.invalid`` hosts of ``transport``). Measured against httpx's
    pooled transport, whose per-request cost grows with the pooled connections (it polls each
    one): see benchmarks/README.md, bench_proxy.py.

    Sessions send no cookies (``DummyCookieJar``), follow no redirects, decode no content
    coding and add no ``User-Agent`` / ``Accept`` / ``Accept-Encoding`` / ``Content-Type``.
    Header values go as UTF-8 (aiohttp's encoding): a client's non-UTF-8 value bytes are sent
    as their latin-1 reading in UTF-8."""

    def __init__(self, transport: _Transport, connect_timeout_s: float,
                 read_timeout_s: float) -> None:
        self._transport = transport
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                              sock_read=read_timeout_s)
        self._tcp = self._session(aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S, ttl_dns_cache=10))
        self._uds: Dict[str, aiohttp.ClientSession] = {}

    def _session(self, connector: aiohttp.BaseConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))

    def _session_for(self, url: str) -> aiohttp.ClientSession:
        if ".kvroute.invalid" in url:
            host = url.split("://", 1)[-1].split("/", 1)[0]
            path = self._transport.uds_path(host)
            if path is not None:
                s = self._uds.get(host)
                if s is None:
                    s = self._uds[host] = self._session(aiohttp.UnixConnector(
                        path, limit=0, keepalive_timeout=_KEEPALIVE_S))
                return s
        return self._tcp

    async def send(self, req: _Outgoing) -> _AioResponse:
        """POSTs ``req``; returns once the response headers are in. Raises httpx's
        ConnectError / ConnectTimeout / ReadTimeout / RemoteProtocolError / WriteError /
        InvalidURL (see `_as_httpx`)."""
        headers = [(k.decode("latin-1"), _header_str(v)) for k, v in req.headers]
        try:
            resp = await self._session_for(req.url).post(
                req.url, data=req.content, headers=_CIMultiDict(headers),
                allow_redirects=False)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise _as_httpx(e) from e
        except ValueError as e:  # yarl: a malformed URL
            raise httpx.InvalidURL(str(e)) from e
        return _AioResponse(resp)

    async def aclose(self) -> None:
        for s in [self._tcp, *self._uds.values()]:
            await s.close()


def _header_str(v: bytes) -> str:
    """A header value as the ``str`` aiohttp encodes back to the same bytes (UTF-8), or its
    latin-1 reading when it is not UTF-8."""
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return v.decode("latin-1")


class _UpstreamStream(StreamingResponse):
    """An upstream SSE response relayed chunk by chunk; releases the decision exactly once
    (first chunk: first_token; end, error or client disconnect: complete)."""

    def __init__(self, proxy: Proxy, decision: Decision, worker: str, upstream: Any,
                 headers: List[Tuple[bytes, bytes]], t0: float,
                 cache_key: Optional[str] = None,
                 delivered: Optional[StreamReport] = None) -> None:
        self._proxy = proxy
        self._delivered = delivered
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
                if self._delivered is not None:
                    self._delivered.feed(chunk)
                yield chunk
            outcome = self._upstream.status_code
            if self._delivered is not None:
                self._delivered.finish(outcome)
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
    dl = out.pop("delivered", None) or {}
    out["delivered_tokens"] = dl.get("delivered_tokens")
    out["engine_prompt_tokens"] = dl.get("engine_prompt_tokens")
    out["prediction_error"] = dl.get("prediction_error")
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


def _response_headers(upstream: Any, worker: str, d: Decision, explain: bool,
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


_decode_json = msgspec.json.Decoder().decode


def _loads(raw: bytes) -> Any:
    """``json.loads`` semantics, decoded by msgspec (4.5 -> 0.7 us for a 170-byte chat body,
    60 -> 19 us for 56 kB; this machine): what msgspec refuses (NaN, lone surrogates, a BOM,
    malformed input) is decoded again by ``json.loads``, which accepts it or raises its own
    error."""
    try:
        return _decode_json(raw)
    except (msgspec.DecodeError, RecursionError):
        return json.loads(raw)


def select_kwargs(headers: Mapping[str, str], body: Mapping[str, Any],
                  model: Optional[str] = None, trusted: bool = True) -> Dict[str, Any]:
    """`kvroute.Router.select_worker` keywords of a request: ``session_key``
    (`kvroute.session_key` of the headers and body; ``""`` unless ``trusted``),
    ``cache_salt`` (the body's, which keys the prompt's first block in vLLM) and, when the
    body names a ``model`` other than ``model``, ``lora_name`` (see `Proxy`)."""
    kw: Dict[str, Any] = {"session_key": session_key(headers, body) if trusted else ""}
    salt = body.get("cache_salt")
    if isinstance(salt, str) and salt:
        kw["cache_salt"] = salt
    requested = body.get("model")
    if model and isinstance(requested, str) and requested and requested != model:
        kw["lora_name"] = requested
    return kw


async def parse_body(request: Request, max_bytes: Optional[int]
                     ) -> Tuple[bytes, Dict[str, Any]]:
    """The raw body (at most ``max_bytes``, `kvroute.serving.limits.read_body`) and its JSON
    object. Raises ValueError for a body that is not a JSON object (or nests too deeply to
    parse), BodyTooLarge, starlette's ClientDisconnect when the client left while sending
    it."""
    raw = await read_body(request, max_bytes)
    try:
        body = _loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"request body must be a JSON object: {e}") from None
    except RecursionError:
        raise ValueError("request body must be a JSON object: it nests too deeply") from None
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
    return raw, body


async def encode_prompt(tokenizer: Any, path: str, body: Mapping[str, Any]) -> np.ndarray:
    """The token ids of a completions / chat body (``path``): ``tokenizer.aencode_request``,
    or without a tokenizer `_token_id_prompt`. A prompt kvroute cannot tokenize as the
    engine would (`kvroute.serving.tokenizer.UnsupportedPrompt`) gives an empty array (routed
    without a prefix match). Raises ValueError for a malformed body, TokenizerBusy."""
    if tokenizer is None:
        return _token_id_prompt(path, body)
    from kvroute.prompt import UnsupportedPrompt

    try:
        return await tokenizer.aencode_request(path, body)
    except RecursionError:
        raise ValueError("the request nests too deeply to tokenize") from None
    except UnsupportedPrompt as e:
        # Deliberately forwarded, not refused: the engine serves these (batched prompts,
        # prompt_embeds, images, a request chat_template); kvroute just cannot see their
        # blocks, so they route on load / session key like an empty prompt.
        log.debug("routing without a prefix match: %s", e)
        return np.empty(0, dtype=np.uint32)


async def encode_routed(tokenizer: Any, path: str, body: Mapping[str, Any]) -> np.ndarray:
    """The token ids a request is routed on: `encode_prompt` for completions and chat; for a
    pass-through route (`kvroute.serving.routes.PASS_THROUGH`) the prompt its body carries
    (`kvroute.serving.routes.prompt_request`), else an empty array (routed on load). Raises
    ValueError for a malformed completions / chat body, PromptTooLong, TokenizerBusy."""
    if path not in PASS_THROUGH:
        return await encode_prompt(tokenizer, path, body)
    # Cache-aware where the body has a prompt kvroute can tokenize; otherwise (and when it
    # does not tokenize: the engine judges its own API) routed on load.
    mapped = prompt_request(path, body)
    if mapped is None:
        return np.empty(0, dtype=np.uint32)
    try:
        return await encode_prompt(tokenizer, *mapped)
    except PromptTooLong:
        raise
    except ValueError as e:
        log.debug("%s routed on load: %s", path, e)
        return np.empty(0, dtype=np.uint32)


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
    a decision and an upstream connection (``release_unsent()`` where it has one)."""
    if task.cancelled() or task.exception() is not None:
        return
    resp = task.result()
    if isinstance(resp, _UpstreamStream):
        resp._finish("disconnect")
        await resp._upstream.aclose()
    elif hasattr(resp, "release_unsent"):  # the prefill/decode front's stream
        await resp.release_unsent()
