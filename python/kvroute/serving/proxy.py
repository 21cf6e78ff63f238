"""The one-pool front of the request pipeline (`kvroute.serving.pipeline`): route, forward,
release.

One `Proxy` serves every admitted request of an app (the pipeline authenticated and admitted
it). Per request (``POST /v1/completions`` or
``POST /v1/chat/completions``, a JSON object as vLLM's OpenAI server takes it):

1. Tokenize as the engine will (`kvroute.prompt.PromptTokenizer`, off the event
   loop): the model's chat template for ``messages``, ``prompt`` text, or token ids as they
   are. Without a tokenizer only token-id prompts are matched against the index; text prompts
   are routed on load and the session key alone (see `Proxy`).
2. ``router.select_worker(tokens, session_key=kvroute.session_key(headers, body),
   exclude=<workers whose circuit is open> | <workers that already failed this request>)``;
   ``headers`` as the client sent them (an ``x-request-id`` kvroute generated is no session
   key: `kvroute.serving.routes.client_headers`).
3. Forward the body unchanged to ``worker.url + path`` over the proxy's aiohttp pool
   (`kvroute.serving.forward.Forwarder`: keep-alive connections per worker; connect and read
   timeouts), with
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
worker URL, a connection that broke before the response headers, see
`kvroute.serving.breaker.retryable`; no
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
import logging
import math
import os
import time
from typing import (
    Any,
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

import httpx
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvroute._router import Decision, NoWorkerAvailable, Router, Worker
from kvroute.serving import defaults as D
from kvroute.serving.breaker import CircuitBreaker, failure_kind
from kvroute.serving.common import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    PID_HEADER,
    STAGE_ERRORS,
    UDS_SCHEME,
    WORKER_HEADER,
    decision_dict,
    error_response,
    scores_list,
    stage_error,
)
from kvroute.serving.forward import (
    Forwarder,
    Outgoing,
    Transport,
    no_cookies,
    upstream_headers,
    utf8_headers,
)
from kvroute.serving.health import FirstByteTimeout, guard_first_byte, recovered_at, stop_checks
from kvroute.serving.hitrate import StreamReport, report_body
from kvroute.serving.limits import RequestLimits
from kvroute.serving.relay import UpstreamStream, log_entry, replay_cached, response_headers
from kvroute.serving.request import encode_routed, parse_body, select_kwargs, until_disconnect
from kvroute.serving.response_cache import CACHE_HEADER, ResponseCache, lookup_cached
from kvroute.serving.routes import client_headers, note_routed, request_id_of

__all__ = ["Proxy"]

log = logging.getLogger("kvroute.serving.proxy")


class _ScrapeOptions(TypedDict, total=False):
    """`PrometheusScraper` keywords the proxy was given (absent = the scraper's default)."""

    timeout_s: float
    stale_after_s: float


class _NoWorker(Exception):
    """No worker could take the request (all excluded, or every attempt failed to connect)."""


class Proxy:
    """Routes OpenAI-style requests to engine workers with a `kvroute.Router`.

    Parameters
    ----------
    router:
        The `kvroute.Router` over the workers (its worker URLs are where requests go). Not
        closed by the proxy.
    tokenizer:
        A `kvroute.prompt.PromptTokenizer` (or anything with ``async
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
        upstream_timeout_s: float = D.UPSTREAM_TIMEOUT_S,
        connect_timeout_s: float = D.CONNECT_TIMEOUT_S,
        max_retries: int = D.MAX_RETRIES,
        breaker_failures: int = D.BREAKER_FAILURES,
        breaker_reset_s: float = D.BREAKER_RESET_S,
        scrape_metrics_interval_s: Optional[float] = None,
        scrape_timeout_s: Optional[float] = D.SCRAPE_TIMEOUT_S,
        scrape_stale_after_s: Optional[float] = D.SCRAPE_STALE_AFTER_S,
        orca: Any = D.ORCA,
        metrics: Any = None,
        health_check: Optional[Mapping[str, Any]] = None,
        client: Optional[httpx.AsyncClient] = None,
        decision_log_size: Optional[int] = D.DECISION_LOG_SIZE,
        response_cache: Any = None,
        first_byte_timeout_s: Optional[float] = D.FIRST_BYTE_TIMEOUT_S,
        retry: Any = None,
        recovery_ramp_s: float = D.RECOVERY_RAMP_S,
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
        from kvroute.serving.admin import DecisionLog

        self.response_cache = ResponseCache.from_options(response_cache)
        self.decisions: Optional[DecisionLog] = (
            DecisionLog(decision_log_size, expand=log_entry)
            if decision_log_size is not None else None)
        self._own_client = client is None
        self._client = client
        self._transport: Optional[Transport] = None
        self._forward: Optional[Forwarder] = None
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
            self._transport = Transport(httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                trust_env=False))
            self._client = httpx.AsyncClient(
                transport=self._transport,
                timeout=httpx.Timeout(self.upstream_timeout_s, connect=self.connect_timeout_s),
                cookies=no_cookies(), trust_env=False, follow_redirects=False)
            self._forward = Forwarder(self._transport, self.connect_timeout_s,
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
        """``GET /workers``: `kvroute.serving.fleet.workers_view`."""
        from kvroute.serving.fleet import workers_view

        return workers_view(self)

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

    def snapshot(self, request: Request) -> Response:
        """``GET /admin/snapshot``: this replica's index, streamed in `kvroute.snapshot`'s
        format."""
        from starlette.responses import StreamingResponse

        from kvroute.snapshot import aiter_snapshot

        rid = self.replicas.replica_id if self.replicas is not None else None
        return StreamingResponse(aiter_snapshot(self.router, rid),
                                 media_type="application/x-kvroute-snapshot")

    def add_worker(self, body: Any) -> Dict[str, Any]:
        """``POST /admin/workers`` (`kvroute.serving.admin.worker_from_json`). Raises
        ValueError for a bad body or a duplicate."""
        from kvroute.serving.admin import add_worker, worker_from_json

        w = add_worker(self, worker_from_json(body))
        return {"added": w.name, "workers": [x.name for x in self.router.workers]}

    def remove_worker(self, name: str) -> Dict[str, Any]:
        """``DELETE /admin/workers/{name}``. Raises KeyError (its message names the
        workers) for an unknown worker."""
        from kvroute.serving.admin import remove_worker

        try:
            remove_worker(self, name)
        except KeyError:
            raise KeyError(f"no worker {name!r}; workers: "
                           f"{[w.name for w in self.router.workers]}") from None
        return {"removed": name, "workers": [x.name for x in self.router.workers]}

    def reload(self, auth: Any, new_cfg: Any, old_cfg: Any) -> Dict[str, Any]:
        """``POST /admin/reload``: `kvroute.serving.admin.reload`. Raises ValueError for a
        prefill/decode config (this front routes one pool)."""
        from kvroute.serving.admin import reload

        if new_cfg.is_pd:
            raise ValueError("the reloaded config is pd_disaggregation; this server routes "
                             "one pool")
        return reload(self, auth, new_cfg, old_cfg)

    def render_metrics(self) -> Response:
        """``GET /metrics``: `RouterMetrics.render` in the Prometheus text format."""
        data, content_type = self.metrics.render()
        return Response(content=data, media_type=None, headers={"content-type": content_type})

    async def models(self) -> Response:
        """``GET /v1/models``: `kvroute.serving.fleet.models`."""
        from kvroute.serving.fleet import models

        return await models(self)

    # -- request path ------------------------------------------------------------------------
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
        """`kvroute.serving.forward.upstream_headers` of the request for ``worker``."""
        return upstream_headers(request.headers.raw, worker.dp_rank,
                                tenant.name if tenant is not None else None, self._orca_headers)

    def _build_request(self, url: str, raw: bytes,
                       headers: List[Tuple[bytes, bytes]]) -> Any:
        """The upstream request: an `Outgoing` for the proxy's own forwarder when every
        header value is UTF-8 (aiohttp's encoding), else an ``httpx.Request`` (sent by
        ``httpx``, header bytes as they are; of the given client when there is one). Raises
        httpx.InvalidURL for a malformed worker URL."""
        if self._forward is not None:  # our own client: no default header fields added
            if utf8_headers(headers):
                return Outgoing(url, raw, headers)
            return httpx.Request("POST", url, content=raw, headers=headers)
        assert self._client is not None
        return self._client.build_request("POST", url, content=raw, headers=headers)

    @property
    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.upstream_timeout_s, connect=self.connect_timeout_s)

    async def _select(self, tokens: np.ndarray, kw: Mapping[str, Any], explain: bool,
                      failed: Set[str], dry_run: bool = False) -> Decision:
        """The decide stage: `select_now`, or with ``lmcache_aware`` (it blocks on the LMCache
        controller) the same on a worker thread. Raises _NoWorker."""
        if getattr(self.router, "_lmcache", None) is None:
            return self.select_now(tokens, kw, explain, failed, dry_run)
        names, exclude = self._exclusions(failed, dry_run)
        t0 = time.perf_counter()
        select = functools.partial(self.router.select_worker, tokens, explain=explain,
                                   exclude=exclude, dry_run=dry_run, **kw)
        try:
            d = await self._select_off_loop(select, dry_run)
        except NoWorkerAvailable:  # a worker was removed meanwhile
            raise _NoWorker(self._no_worker_message(names, failed)) from None
        return self._selected(d, tokens, kw, dry_run, t0)

    def select_now(self, tokens: np.ndarray, kw: Mapping[str, Any], explain: bool,
                   failed: Set[str], dry_run: bool = False) -> Decision:
        """The decide stage on the caller's thread (microseconds; not for ``lmcache_aware``):
        `kvroute.Router.select_worker` without ``failed`` and the workers whose circuit is
        open, that are unhealthy or held back by the recovery ramp; the decision counted in
        the metrics and shared with the replicas. Raises _NoWorker when none is left."""
        names, exclude = self._exclusions(failed, dry_run)
        t0 = time.perf_counter()
        try:
            d = self.router.select_worker(tokens, explain=explain, exclude=exclude,
                                          dry_run=dry_run, **kw)
        except NoWorkerAvailable:  # a worker was removed meanwhile
            raise _NoWorker(self._no_worker_message(names, failed)) from None
        return self._selected(d, tokens, kw, dry_run, t0)

    def _exclusions(self, failed: Set[str], dry_run: bool) -> Tuple[Dict[str, Worker], Set[str]]:
        names = self._workers()
        exclude = (failed | self._unavailable(names)) & set(names)
        if len(exclude) >= len(names):
            raise _NoWorker(self._no_worker_message(names, failed))
        if not dry_run:
            # Recovering workers get a growing share; none is held back when that would
            # leave no worker.
            exclude |= self.ramp.hold_back(
                {n: self._recovered_at(w) for n, w in names.items()}, exclude)
        return names, exclude

    def _selected(self, d: Decision, tokens: np.ndarray, kw: Mapping[str, Any],
                  dry_run: bool, t0: float) -> Decision:
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
            _, body = await parse_body(request, self.limits.max_body_bytes)
            path = CHAT_PATH if "messages" in body else COMPLETIONS_PATH
            tokens = await self._tokens(path, body)
        except STAGE_ERRORS as e:
            return stage_error(e)
        try:
            d = await self._select(tokens, self._select_kwargs(request, body), True, set(),
                                   dry_run=True)
        except _NoWorker as e:
            return error_response(503, str(e))
        return JSONResponse({"decision": decision_dict(d, 1, request_id_of(request.scope)),
                             "scores": scores_list(d),
                             "path": path, "prompt_tokens": int(len(tokens))})

    async def handle(self, request: Request, path: str, tenant: Any = None,
                     explain: bool = False) -> Response:
        """Routes and forwards one ``POST`` to ``path`` (``/v1/completions`` or
        ``/v1/chat/completions``); see the module docstring. Never raises for bad input or
        unreachable workers: those become 400 / 503 error responses.

        ``tenant``: the `kvroute.serving.auth.Tenant` the request was admitted for, or
        ``None`` (no tenants configured). With a tenant, a body ``model`` outside its
        ``allowed_models`` is refused (403), its ``trust_session_key`` decides whether the
        client's session key is used, and ``Authorization`` is not forwarded (the engines
        get ``x-kvroute-tenant: <name>`` instead). ``explain``: answer with the decision and
        every worker's score terms in ``x-kvroute-decision`` / ``x-kvroute-scores`` (the
        pipeline's authenticate stage decides who may: `kvroute.serving.pipeline`)."""
        await self._ensure_started()
        try:
            raw, body = await parse_body(request, self.limits.max_body_bytes)
            if tenant is not None and not tenant.model_allowed(body.get("model")):
                return error_response(403, f"tenant {tenant.name} may not use model "
                                           f"{body.get('model')!r}", "PermissionDeniedError")
            cache_key = None
            if self.response_cache is not None:
                cache_key, hit, result, similarity = await lookup_cached(
                    self.response_cache, self._client, self.metrics,
                    tenant.name if tenant is not None else None, path, body)
                if hit is not None:
                    note_routed(request.scope, tenant=tenant.name if tenant else None,
                                worker=None, cache=result)
                    if self.decisions is not None:
                        self.decisions.record({"request_id": request_id_of(request.scope),
                                               "tenant": tenant.name if tenant else None,
                                               "path": path, "cache": result, "worker": None,
                                               "similarity": similarity})
                    return replay_cached(hit, result, similarity)
            tokens = await self._tokens(path, body)
        except STAGE_ERRORS as e:
            return stage_error(e)
        kw = self._select_kwargs(request, body, tenant)
        resp = await until_disconnect(
            request, self._dispatch(request, path, raw, tokens, kw, explain, tenant, cache_key))
        if resp is None:  # the client went away before the response started
            return Response(status_code=499)
        return resp

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
                entry = {"request_id": request_id_of(request.scope),
                         "tenant": tenant.name if tenant is not None else None, "path": path,
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
                    self.breaker_failure(worker.name)
                    kind = failure_kind(e)
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
                    self.breaker_failure(worker.name)
                else:
                    self.breaker_success(worker.name)
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
                headers = response_headers(upstream.headers, worker.name, d, explain, attempts,
                                           request_id_of(request.scope))
                if cache_key is not None:
                    headers.append((CACHE_HEADER.encode(), b"miss"))
                ctype = upstream.headers.get("content-type", "")
                if ctype.startswith("text/event-stream"):
                    handed_off = True
                    return UpstreamStream(self, d, worker.name, upstream, headers, t0, cache_key,
                                           StreamReport(self.router, d, entry))
                try:
                    chunks = [c async for c in upstream.aiter_raw()]
                except httpx.HTTPError as e:
                    self.breaker_failure(worker.name)
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
        if isinstance(req, Outgoing):
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

    def _no_worker_message(self, names: Iterable[str], failed: Set[str]) -> str:
        names = list(names)
        opened = [n for n in names if n not in failed and not self.breaker(n).available()]
        workers = self._workers()
        sick = [n for n in names if n not in failed and n not in opened
                and self._health is not None and n in workers
                and not self._health.healthy(self.base_url(workers[n].url))]
        parts = []
        if failed:
            parts.append(f"unreachable: {', '.join(sorted(failed))}")
        if opened:
            parts.append(f"circuit open: {', '.join(sorted(opened))}")
        if sick:
            parts.append(f"unhealthy: {', '.join(sorted(sick))}")
        return (f"no worker available among {len(names)} "
                f"({'; '.join(parts) or 'none configured'})")

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

    def breaker_failure(self, worker: str) -> None:
        if self.breaker(worker).record_failure():
            log.warning("circuit of worker %s opened after %d consecutive failures", worker,
                        self.breaker(worker).consecutive_failures)
            self.metrics.set_circuit_open(worker, True)

    def breaker_success(self, worker: str) -> None:
        if self.breaker(worker).record_success():
            log.info("circuit of worker %s closed", worker)
            self.metrics.set_circuit_open(worker, False)
