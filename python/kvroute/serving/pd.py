"""Prefill/decode disaggregation behind one OpenAI-compatible front (``kvroute serve`` with a
``pd_disaggregation`` / ``vllm_prefill_decode`` configuration), routed by `kvroute.PDRouter`.

One request (``POST /v1/completions`` or ``/v1/chat/completions``):

1. `PDRouter.select_pair` (with the request's ``session_key`` and ``cache_salt``,
   `kvroute.serving.proxy.select_kwargs`; a request id kvroute generated is no session key)
   picks the decode worker, then the prefill worker, unless the decode worker would prefill
   at most ``pd_uncached_token_threshold`` tokens itself (the prefill pool is then skipped
   and the request goes to the decode worker as it is).
2. A prefill worker without a bootstrap port (vLLM, NIXL connector; the vLLM PD proxies'
   contract): the request goes to it with ``kv_transfer_params = {"do_remote_decode": true,
   "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
   "remote_host": null, "remote_port": null}``, ``stream: false``, ``max_tokens: 1`` (and
   ``max_completion_tokens: 1`` when given), without ``stream_options``; the
   ``kv_transfer_params`` of its answer are passed, as they are, to the decode request (the
   client's body otherwise unchanged).
3. A prefill worker with a bootstrap port (``prefill_urls: [[url, port]]``; SGLang's
   contract): ``bootstrap_host`` (the prefill URL's host), ``bootstrap_port`` and one random
   ``bootstrap_room`` are added to the body, and the same body goes to both workers at once;
   the prefill answer is read and discarded.
4. The decode worker's answer is the client's answer, streamed chunk by chunk when the
   client asked for ``stream``. Both requests carry the same ``X-Request-Id`` (the
   client's, else a generated one: `kvroute.serving.routes.RequestContext`) and
   ``X-data-parallel-rank`` for a worker with a rank.

Failures, as `kvroute.serving.proxy.Proxy` handles them and with its building blocks: a
prefill or decode attempt that fails before any byte reached the client (a connect error or
a connection broken before the response headers, ``first_byte_timeout_s`` passed or the
worker marked unhealthy while waiting, an engine's 500 / 502 / 503 / 504 / 429; which ones:
``retry.retry_on``) is retried as a new pair (both requests again: a new vLLM prefill whose
``kv_transfer_params`` the new decode request carries, a new SGLang ``bootstrap_room``)
without the worker that failed, after the `kvroute.serving.retry.RetryPolicy` backoff, at
most ``max_retries`` times and while that pool has another worker up. Active health checks
(`kvroute.serving.health.HealthChecker`, the config's ``health_check``) probe every prefill
and decode URL; an unhealthy worker is not chosen and a request waiting on it moves. Every
worker of each pool has a circuit breaker (`kvroute.serving.proxy.CircuitBreaker`,
``breaker_failures`` / ``breaker_reset_s``: connect errors, timeouts, broken answers and
statuses >= 500 count as failures, any other answer as a success; an open circuit is not
chosen), and a worker back from an open circuit or an unhealthy state gets a share of the
requests it would be chosen for that grows over ``recovery_ramp_s``
(`kvroute.serving.health.RecoveryRamp.hold_back`: never holding back every worker left).
When a pool has no worker up the answer is 503 with ``Retry-After`` (until the first open
circuit turns half-open, else one health-check confirmation); a prefill that still fails
answers 502 (the upstream's status and a short text), a prefill 4xx other than 429 is
passed through as the engine answered, a decode answer (any status) is the client's
answer. The router's load for the request is released in every case, at once when the
client goes away before the answer started (the request is cancelled, its upstream
connections closed: `kvroute.serving.proxy._until_disconnect`).

Pass-through routes (`kvroute.serving.routes.PASS_THROUGH`: ``/v1/embeddings``,
``/v1/responses``, ``/v1/messages``, ``/v1/rerank``, ``/tokenize``, ``/detokenize``) go to
the decode pool alone (the same JSON body; no prefill), with the same retries, breakers,
ramp and limits: cache-aware where the body has a prompt kvroute can tokenize
(`kvroute.serving.proxy.encode_routed`), on load otherwise.

``GET /metrics``: each pool's `kvroute.serving.metrics.RouterMetrics` on one registry, the
prefill pool's names prefixed ``kvroute_prefill_``, the decode pool's ``kvroute_decode_``
(``kvroute_decode_decisions_total``, ``..._upstream_requests_total``,
``..._upstream_latency_seconds``, ``..._retries_total`` (retries after a failure in that
pool), ``..._circuit_open``, ``..._inflight_requests``, ``..._prefix_tokens_total``,
``..._delivered_reports_total``, ...); ``kvroute serve`` also serves it on the ``metrics``
listener.

Limits (`kvroute.serving.limits.RequestLimits`): a body over ``max_body_bytes`` gets 413, a
prompt over ``max_prompt_tokens`` (``"auto"``: the workers' ``max_model_len``) 400, a full
tokenizer lane 503. Every error is OpenAI-shaped (``{"error": {"message", "type", "param",
"code"}}``, unknown routes and methods included), every request gets a request id and a JSON
access-log line (`kvroute.serving.routes.install`; the line names the decode ``worker`` and
``decision`` and the ``prefill_worker`` and ``prefill_decision``). ``GET /health`` answers
503 with ``Retry-After`` while either pool has no worker up. Without a tokenizer only
completions prompts given as token ids get a prefix match.

Delivered prefix reuse (`kvroute.delivered`, read by `kvroute.serving.hitrate` as the main
proxy reads it): the prefill worker's answer (vLLM's JSON answer to the ``max_tokens: 1``
request; SGLang's answer, JSON or SSE, read whole once the decode answer has ended) is
reported to the prefill pool's `Router` with ``report_delivered`` (its
``usage.prompt_tokens_details.cached_tokens`` / ``meta_info.cached_tokens``). The decode
worker's answer (streamed or not) is reported to the decode pool's `Router` only when the
prefill pool was skipped, i.e. when the decode worker prefilled from its own prefix cache: after
a remote prefill its count includes the prompt tokens received from the prefill worker (vLLM's
scheduler sets ``num_cached_tokens`` to the local plus the connector's external computed
tokens), which is not what the decode pool's index predicts. The sums are in
`PDRouter.hit_rate` (``app.state.kvroute_pd_router.hit_rate["prefill"]`` / ``["decode"]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from typing import Any, AsyncIterator, Callable, Dict, Mapping, Optional, Set, Tuple
from urllib.parse import urlsplit

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect

from kvroute._router import NoWorkerAvailable, Worker
from kvroute.pd import PDDecision, PDRouter
from kvroute.prompt import TokenizerBusy
from kvroute.serving.health import (
    FirstByteTimeout,
    HealthChecker,
    RecoveryRamp,
    first_byte_timeout,
    guard_first_byte,
    recovered_at,
    stop_checks,
)
from kvroute.serving.hitrate import StreamReport, report_answer, report_body
from kvroute.serving.limits import BodyTooLarge, RequestLimits, learn_max_model_len
from kvroute.serving.metrics import RouterMetrics
from kvroute.serving.proxy import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DP_RANK_HEADER,
    CircuitBreaker,
    _failure_kind,
    _until_disconnect,
    encode_routed,
    error_response,
    limit_response,
    parse_body,
    select_kwargs,
)
from kvroute.serving.retry import RetryPolicy
from kvroute.serving.routes import PASS_THROUGH, client_headers, note_routed

__all__ = ["create_pd_app", "PREFILL_KV_TRANSFER_PARAMS"]

log = logging.getLogger("kvroute.serving.pd")

#: The pools, as the metrics' namespaces and the breakers' keys name them.
POOLS = ("prefill", "decode")

#: What the prefill request carries (vLLM's NIXL connector; the vLLM PD proxies).
PREFILL_KV_TRANSFER_PARAMS: Dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def _error(status: int, message: str) -> JSONResponse:
    return error_response(status, message, "upstream_error")


class _AttemptFailed(Exception):
    """One prefill or decode request failed before any byte reached the client: ``kind`` is a
    `kvroute.serving.retry.RETRY_ON` kind (or ``"error"``, never retried); ``response`` is
    the client's answer if it is not retried."""

    def __init__(self, pool: str, worker: Worker, kind: str, response: Response) -> None:
        super().__init__(f"{pool} worker {worker.name}: {kind}")
        self.pool = pool
        self.worker = worker
        self.kind = kind
        self.response = response


class _PDFront:
    def __init__(self, router: PDRouter, bootstrap_ports: Mapping[str, Optional[int]],
                 tokenizer: Any, upstream_timeout_s: float, connect_timeout_s: float, *,
                 first_byte_timeout_s: Optional[float] = None, retry: Any = None,
                 max_retries: int = 2, limits: Any = None,
                 health_check: Optional[Mapping[str, Any]] = None,
                 breaker_failures: int = 3, breaker_reset_s: float = 10.0,
                 recovery_ramp_s: float = 10.0) -> None:
        CircuitBreaker(breaker_failures, breaker_reset_s)  # validates
        self.breaker_failures = breaker_failures
        self.breaker_reset_s = float(breaker_reset_s)
        self._breakers: Dict[Tuple[str, str], CircuitBreaker] = {}
        self.ramp = RecoveryRamp(recovery_ramp_s)
        #: Both pools' `RouterMetrics` on one registry, namespaces ``kvroute_prefill`` and
        #: ``kvroute_decode``.
        self.registry = CollectorRegistry()
        self.metrics = {"prefill": RouterMetrics(router.prefill, self.registry,
                                                 "kvroute_prefill"),
                        "decode": RouterMetrics(router.decode, self.registry,
                                                "kvroute_decode")}
        self.router = router
        self.bootstrap_ports = dict(bootstrap_ports)
        self.tokenizer = tokenizer
        self.timeout = httpx.Timeout(upstream_timeout_s, connect=connect_timeout_s)
        self.first_byte_timeout_s = first_byte_timeout(first_byte_timeout_s)
        self.retry = RetryPolicy.from_options(retry, max_retries)
        self.limits = RequestLimits.from_options(limits)
        self._health_options = dict(health_check) if health_check is not None else None
        if self._health_options is not None:
            HealthChecker(lambda: (), None, **self._health_options)  # type: ignore[arg-type]
        self.health: Optional[HealthChecker] = None
        self.client: Optional[httpx.AsyncClient] = None
        self._limits_task: Optional[asyncio.Task[None]] = None

    def _urls(self) -> Set[str]:
        return {w.url.rstrip("/") for r in (self.router.prefill, self.router.decode)
                for w in r.workers}

    def _client(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=self.timeout, trust_env=False)
        return self.client

    def start(self) -> None:
        """Starts the health checks and, with ``max_prompt_tokens: auto``, learning the
        workers' ``max_model_len`` (on the running loop). Idempotent."""
        client = self._client()
        if self._health_options is not None and self.health is None:
            self.health = HealthChecker(self._urls, client, **self._health_options)
            self.health.start()
        if self.limits.auto and self._limits_task is None:
            self._limits_task = asyncio.get_running_loop().create_task(
                learn_max_model_len(self.limits, client, lambda: sorted(self._urls())))

    async def aclose(self) -> None:
        health, self.health = self.health, None
        learner, self._limits_task = self._limits_task, None
        await stop_checks(health, learner)
        if self.client is not None:
            client, self.client = self.client, None
            await client.aclose()

    def breaker(self, pool: str, name: str) -> CircuitBreaker:
        """The circuit breaker of worker ``name`` of ``pool`` (``"prefill"`` / ``"decode"``),
        created closed on first use."""
        b = self._breakers.get((pool, name))
        if b is None:
            b = self._breakers[(pool, name)] = CircuitBreaker(self.breaker_failures,
                                                              self.breaker_reset_s)
        return b

    def _up(self, pool: str, worker: Worker) -> bool:
        """Circuit closed or half-open and (with health checks) the worker's URL healthy."""
        if self.health is not None and not self.health.healthy(worker.url.rstrip("/")):
            return False
        return self.breaker(pool, worker.name).available()

    def available(self) -> Dict[str, int]:
        """Workers up per pool: ``{"prefill": n, "decode": n}``."""
        return {pool: sum(self._up(pool, w) for w in self._pool(pool).workers)
                for pool in POOLS}

    def recovery_share(self, pool: str, worker: Worker) -> float:
        """The share of its requests a worker gets while it ramps up after recovering
        (`kvroute.serving.health.RecoveryRamp`), in (0, 1]; 1 unless recovering."""
        return self.ramp.share(self._recovered_at(pool, worker))

    def _recovered_at(self, pool: str, worker: Worker) -> Optional[float]:
        return recovered_at(self.breaker(pool, worker.name).ramp_from, self.health,
                            worker.url.rstrip("/"))

    def render_metrics(self) -> Response:
        """``GET /metrics``: both pools' `RouterMetrics` (one registry) in the Prometheus
        text format."""
        data, content_type = self.metrics["decode"].render()
        return Response(content=data, headers={"content-type": content_type})

    def _pool(self, pool: str) -> Any:
        return self.router.prefill if pool == "prefill" else self.router.decode

    def _exclude(self, pool: str, failed: Set[str]) -> Set[str]:
        return failed | {w.name for w in self._pool(pool).workers if not self._up(pool, w)}

    def _choice_exclude(self, pool: str, failed: Set[str]) -> Set[str]:
        """`_exclude` plus the recovering workers the ramp holds back from this request
        (never all that are left)."""
        ex = self._exclude(pool, failed)
        return ex | self.ramp.hold_back(
            {w.name: self._recovered_at(pool, w) for w in self._pool(pool).workers}, ex)

    def _verdict(self, pool: str, worker: Worker, ok: bool) -> None:
        """Records an attempt's outcome in the worker's circuit breaker (``ok``: it answered
        with a status below 500)."""
        b = self.breaker(pool, worker.name)
        if ok:
            if b.record_success():
                log.info("circuit of %s worker %s closed", pool, worker.name)
                self.metrics[pool].set_circuit_open(worker.name, False)
        elif b.record_failure():
            log.warning("circuit of %s worker %s opened after %d consecutive failures", pool,
                        worker.name, b.consecutive_failures)
            self.metrics[pool].set_circuit_open(worker.name, True)

    def _may_retry(self, kind: str, attempts: int, pool: str, failed: Set[str]) -> bool:
        """The retry policy allows it and the failed worker's pool has another worker up."""
        if not self.retry.retries(kind, attempts):
            return False
        names = {w.name for w in self._pool(pool).workers}
        return bool(names - self._exclude(pool, failed))

    def retry_after_s(self) -> int:
        """Whole seconds a client should wait when a pool has no worker up: until the first
        open circuit turns half-open, else one health-check confirmation, at least 1."""
        waits = [b.snapshot()["retry_in_s"] for b in self._breakers.values()
                 if b.state == CircuitBreaker.OPEN]
        if not waits and self.health is not None:
            waits = [self.health.retry_after_s()]
        return max(1, math.ceil(min(waits, default=1.0)))

    def _unavailable(self, message: str) -> JSONResponse:
        return error_response(503, message, headers={"Retry-After": str(self.retry_after_s())})

    async def _tokens(self, path: str, body: Mapping[str, Any]) -> np.ndarray:
        return await self.limits.tokens_within(
            body, lambda: encode_routed(self.tokenizer, path, body))

    @staticmethod
    def _headers(rid: str, worker: Worker) -> Dict[str, str]:
        h = {"X-Request-Id": rid, "Content-Type": "application/json"}
        if worker.dp_rank is not None:
            h[DP_RANK_HEADER] = str(worker.dp_rank)
        return h

    async def handle(self, request: Request, path: str) -> Response:
        try:
            _, body = await parse_body(request, self.limits.max_body_bytes)
            tokens = await self._tokens(path, body)
        except ValueError as e:
            return error_response(400, str(e))
        except (BodyTooLarge, TokenizerBusy) as e:
            return limit_response(e)
        except ClientDisconnect:
            return Response(status_code=499)
        resp = await _until_disconnect(request, self._route(request, path, body, tokens))
        if resp is None:  # the client went away before the response started
            return Response(status_code=499)
        return resp

    async def _route(self, request: Request, path: str, body: Dict[str, Any],
                     tokens: np.ndarray) -> Response:
        # RequestContext gave every request one (the client's or a generated one).
        rid = request.headers.get("x-request-id") or ""
        kw = select_kwargs(client_headers(request.scope, request.headers), body)
        failed: Dict[str, Set[str]] = {"prefill": set(), "decode": set()}
        attempts = 0
        while True:
            t0 = time.perf_counter()
            try:
                exclude_decode = self._choice_exclude("decode", failed["decode"])
                if path in PASS_THROUGH:  # the decode pool serves it whole
                    pd = PDDecision(None, self.router.decode.select_worker(
                        tokens, exclude=exclude_decode, **kw))
                else:
                    pd = self.router.select_pair(
                        tokens, exclude_prefill=self._choice_exclude("prefill",
                                                                     failed["prefill"]),
                        exclude_decode=exclude_decode, **kw)
            except NoWorkerAvailable as e:
                return self._unavailable(f"no worker available: {e}")
            self.metrics["decode"].observe_decision(pd.decode, time.perf_counter() - t0)
            if pd.prefill is not None:
                self.metrics["prefill"].observe_decision(pd.prefill)
            attempts += 1
            note_routed(request.scope, worker=pd.decode.worker, attempts=attempts,
                        decision=pd.decode,
                        prefill_worker=pd.prefill.worker if pd.prefill is not None else None,
                        prefill_decision=pd.prefill)
            try:
                return await self._dispatch(pd, path, body, rid)
            except _AttemptFailed as f:
                self.router.complete(pd)
                failed[f.pool].add(f.worker.name)
                if f.kind in ("connect", "timeout") and self.health is not None:
                    self.health.poke(f.worker.url.rstrip("/"))
                if not self._may_retry(f.kind, attempts, f.pool, failed[f.pool]):
                    if f.kind == "connect":
                        return self._unavailable(f"no {f.pool} worker reachable: "
                                                 f"{len(failed[f.pool])} attempt(s) failed "
                                                 f"to connect "
                                                 f"({', '.join(sorted(failed[f.pool]))})")
                    return f.response
                self.metrics[f.pool].observe_retry()
                await asyncio.sleep(self.retry.backoff_s(attempts))
            except BaseException:
                self.router.complete(pd)
                raise

    async def _send(self, pool: str, worker: Worker, req: httpx.Request) -> httpx.Response:
        """``req`` sent until its response headers (body unread), bounded by the first-byte
        guard; the worker's circuit breaker gets the verdict (a status below 500 is a
        success). Raises _AttemptFailed for a failure before the headers."""
        breaker = self.breaker(pool, worker.name)
        probe = breaker.on_dispatch()
        t0 = time.perf_counter()
        try:
            r = await guard_first_byte(self._client().send(req, stream=True),
                                       self.first_byte_timeout_s, self.health,
                                       worker.url.rstrip("/"))
        except (httpx.HTTPError, httpx.InvalidURL, FirstByteTimeout) as e:
            kind = _failure_kind(e)
            self._verdict(pool, worker, False)
            self.metrics[pool].observe_upstream(
                worker.name, {"connect": "connect_error"}.get(kind, kind),
                time.perf_counter() - t0)
            status = 504 if kind == "timeout" else 502
            raise _AttemptFailed(pool, worker, kind,
                                 _error(status, f"{pool} worker {worker.name}: {e!r}")) from e
        except BaseException:  # cancelled (client gone): no verdict
            breaker.abandon(probe)
            raise
        self._verdict(pool, worker, r.status_code < 500)
        return r

    async def _check_status(self, pool: str, worker: Worker, r: httpx.Response,
                            t0: float) -> None:
        """Raises _AttemptFailed (``r`` read and closed) for a status the retry policy
        retries; the client's answer if it is not retried: a decode worker's answer as it is,
        502 naming a prefill worker. ``t0``: `time.perf_counter` when ``r`` was sent."""
        kind = self.retry.status_kind(r.status_code)
        if kind is None:
            return
        self.metrics[pool].observe_upstream(worker.name, r.status_code,
                                            time.perf_counter() - t0)
        try:
            content = await r.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await r.aclose()
        if pool == "decode":
            answer: Response = Response(content, status_code=r.status_code,
                                        media_type=r.headers.get("content-type"))
        else:
            answer = _error(502, f"prefill worker {worker.name} answered {r.status_code}: "
                                 f"{content[:200].decode('utf-8', 'replace')}")
        raise _AttemptFailed(pool, worker, kind, answer)

    async def _dispatch(self, pd: PDDecision, path: str, body: Dict[str, Any],
                        rid: str) -> Response:
        """One attempt; raises _AttemptFailed before any byte reached the client. The load
        of ``pd`` is released here once the decode answer is handed on, by the caller
        otherwise."""
        client = self._client()
        decode_w = self.router.decode._workers[pd.decode.worker]
        decode_body = body
        prefill_task: Optional[asyncio.Task[httpx.Response]] = None
        if pd.prefill is not None:
            prefill_w = self.router.prefill._workers[pd.prefill.worker]
            boot = self.bootstrap_ports.get(prefill_w.url)
            url = prefill_w.url.rstrip("/") + path
            if boot is None:  # vLLM: prefill first, its kv_transfer_params to the decode
                pre = dict(body, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS),
                           stream=False, max_tokens=1)
                if "max_completion_tokens" in pre:
                    pre["max_completion_tokens"] = 1
                pre.pop("stream_options", None)
                t_pre = time.perf_counter()
                r = await self._send("prefill", prefill_w, client.build_request(
                    "POST", url, json=pre, headers=self._headers(rid, prefill_w)))
                try:
                    await self._check_status("prefill", prefill_w, r, t_pre)
                    await r.aread()
                except httpx.HTTPError as e:
                    self._verdict("prefill", prefill_w, False)
                    self.metrics["prefill"].observe_upstream(prefill_w.name, "read_error",
                                                             time.perf_counter() - t_pre)
                    raise _AttemptFailed("prefill", prefill_w, "error", _error(
                        502, f"prefill worker {prefill_w.name}: {e!r}")) from e
                finally:
                    await r.aclose()
                self.metrics["prefill"].observe_upstream(prefill_w.name, r.status_code,
                                                         time.perf_counter() - t_pre)
                if r.status_code != 200:
                    if 400 <= r.status_code < 500:  # the request itself: the engine's answer
                        raise _AttemptFailed("prefill", prefill_w, "error", Response(
                            r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json")))
                    raise _AttemptFailed("prefill", prefill_w, "error", _error(
                        502, f"prefill worker {prefill_w.name} answered "
                             f"{r.status_code}: {r.text[:200]}"))
                self.router.first_token(pd)
                report_body(self.router.prefill, pd.prefill, r.status_code, r.content)
                try:
                    kv = r.json().get("kv_transfer_params")
                except (ValueError, AttributeError):
                    kv = None
                decode_body = dict(body)
                if kv:
                    decode_body["kv_transfer_params"] = kv
            else:  # SGLang: the same bootstrapped body to both at once
                decode_body = dict(body, bootstrap_host=urlsplit(prefill_w.url).hostname,
                                   bootstrap_port=boot,
                                   bootstrap_room=secrets.randbits(63))
                t_pre = time.perf_counter()
                prefill_task = asyncio.ensure_future(client.post(
                    url, json=decode_body, headers=self._headers(rid, prefill_w)))
        req = client.build_request("POST", decode_w.url.rstrip("/") + path, json=decode_body,
                                   headers=self._headers(rid, decode_w))
        prefill_decision = pd.prefill

        def prefill_answered(r: Optional[httpx.Response]) -> None:
            # SGLang's concurrent prefill: its answer (None: it failed) is only reported.
            assert prefill_decision is not None
            w = self.router.prefill._workers[prefill_decision.worker]
            self._verdict("prefill", w, r is not None and r.status_code < 500)
            self.metrics["prefill"].observe_upstream(
                w.name, r.status_code if r is not None else "error", time.perf_counter() - t_pre)
            if r is not None:
                report_answer(self.router.prefill, prefill_decision, r.status_code, r.content,
                              r.headers.get("content-type", ""))

        t0 = time.perf_counter()
        try:
            upstream = await self._send("decode", decode_w, req)
            await self._check_status("decode", decode_w, upstream, t0)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and prefill_task is not None:
                prefill_task.cancel()  # the client left: no need for the prefill answer
                await asyncio.gather(prefill_task, return_exceptions=True)
            else:
                await _discard(prefill_task, prefill_answered)
            raise
        headers = {"x-kvroute-decode-worker": decode_w.name}
        if pd.prefill is not None:
            headers["x-kvroute-prefill-worker"] = pd.prefill.worker
        ctype = upstream.headers.get("content-type", "application/json")

        finished = False

        async def finish(outcome: Any = None) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            await upstream.aclose()
            self.metrics["decode"].observe_upstream(
                decode_w.name, upstream.status_code if outcome is None else outcome,
                time.perf_counter() - t0)
            if outcome == "read_error":
                self._verdict("decode", decode_w, False)
            if prefill_task is not None:
                await _discard(prefill_task, prefill_answered)
            self.router.complete(pd)

        # The decode worker's count is its own prefix cache's only when it prefilled itself.
        local = pd.prefill is None
        if body.get("stream"):
            delivered = StreamReport(self.router.decode, pd.decode) if local else None

            async def relay() -> AsyncIterator[bytes]:
                outcome: Any = "disconnect"  # unless the stream ends or breaks
                try:
                    async for chunk in upstream.aiter_raw():
                        if delivered is not None:
                            delivered.feed(chunk)
                        yield chunk
                    if delivered is not None:
                        delivered.finish(upstream.status_code)
                    outcome = None
                except httpx.HTTPError:
                    outcome = "read_error"
                    raise
                finally:
                    await finish(outcome)

            return _PDStream(finish, relay(), status_code=upstream.status_code,
                             media_type=ctype, headers=headers)
        try:
            content = await upstream.aread()
        except httpx.HTTPError as e:
            await finish("read_error")
            return _error(502, f"decode worker {decode_w.name} broke off its response: {e!r}")
        finally:
            await finish()
        if local:
            report_body(self.router.decode, pd.decode, upstream.status_code, content)
        return Response(content, status_code=upstream.status_code, media_type=ctype,
                        headers=headers)


class _PDStream(StreamingResponse):
    """The decode worker's streamed answer; `release_unsent` releases its load and upstream
    connection when it is never sent (the client left as it was returned:
    `kvroute.serving.proxy._until_disconnect`)."""

    def __init__(self, finish: Callable[[Any], Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._release = finish

    async def release_unsent(self) -> None:
        await self._release("disconnect")


async def _discard(task: Optional[asyncio.Task[httpx.Response]],
                   answered: Optional[Callable[[Optional[httpx.Response]], Any]] = None
                   ) -> None:
    """Awaits a concurrent prefill request (SGLang) and hands its answer (None if it failed)
    to ``answered``; its failure is not the client's (the decode answer is)."""
    if task is None:
        return
    try:
        r = await task
    except Exception:  # noqa: BLE001
        if answered is not None:
            answered(None)
        return
    with contextlib.suppress(Exception):
        if answered is not None:
            answered(r)
        await r.aclose()


def create_pd_app(cfg: Any, *, tokenizer: Any = None,
                  pd_uncached_token_threshold: Optional[int] = None,
                  **options: Any) -> FastAPI:
    """The FastAPI application serving a prefill/decode configuration (see the module
    docstring).

    Parameters
    ----------
    cfg:
        A `kvroute.config.RouterConfig` in PD mode, or what `kvroute.config.load_config`
        takes. Its ``serving:`` section and ``health_check`` give the defaults of
        ``options``.
    tokenizer:
        A `kvroute.serving.tokenizer.PromptTokenizer`, a directory to load one from (with the
        ``serving:`` section's tokenizer lanes and prefix cache; closed at shutdown), or
        None (the ``serving.tokenizer`` directory if set).
    pd_uncached_token_threshold:
        Wins over the config's key of that name (`kvroute.PDRouter`).
    **options:
        `kvroute.serving.proxy.Proxy` keywords that apply here: ``upstream_timeout_s``,
        ``connect_timeout_s``, ``first_byte_timeout_s``, ``max_retries``, ``retry``,
        ``limits``, ``health_check``, ``breaker_failures``, ``breaker_reset_s``,
        ``recovery_ramp_s``; `kvroute.serving.routes.install`'s ``request_id_headers``,
        ``access_log``, ``access_log_bodies``. Others (scraping, ORCA, tenants, response
        cache) do not apply to this front and are ignored.

    Returns
    -------
    fastapi.FastAPI
        The `PDRouter` is at ``app.state.kvroute_pd_router`` and closed at shutdown.

    Raises
    ------
    ValueError
        A ``unix://`` worker URL, a bad option.
    FileNotFoundError
        No such tokenizer directory.
    """
    from pathlib import Path

    from kvroute.config import load_config
    from kvroute.serving.routes import install

    cfg = load_config(cfg)
    uds = [w.url for pool in (cfg.mode.prefill, cfg.mode.decode) for w in pool
           if w.url.startswith("unix://")]
    if uds:
        raise ValueError(f"prefill/decode mode does not take unix:// workers ({', '.join(uds)}): "
                         "the decode engine reaches the prefill engine's KV cache over the "
                         "network (SGLang's bootstrap_host is the prefill URL's host); give "
                         "http:// URLs")
    options = {**cfg.serving.create_router_kwargs(), **options}
    if "health_check" not in options and cfg.health_check is not None:
        options["health_check"] = cfg.health_check.model_dump()
    if tokenizer is None:
        tokenizer = cfg.serving.tokenizer
    own_tokenizer = isinstance(tokenizer, (str, Path))
    if own_tokenizer:
        from kvroute.prompt import PromptTokenizer

        if not Path(tokenizer).is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {tokenizer}")
        tokenizer = PromptTokenizer.from_dir(Path(tokenizer), **cfg.serving.tokenizer_kwargs())
    router = PDRouter.from_config(cfg, pd_uncached_token_threshold=pd_uncached_token_threshold)
    boots = {w.url: w.bootstrap_port for w in cfg.mode.prefill}
    try:
        front = _PDFront(router, boots, tokenizer,
                         options.get("upstream_timeout_s", 600.0),
                         options.get("connect_timeout_s", 5.0),
                         first_byte_timeout_s=options.get("first_byte_timeout_s"),
                         retry=options.get("retry"), max_retries=options.get("max_retries", 2),
                         limits=options.get("limits"),
                         health_check=options.get("health_check"),
                         breaker_failures=options.get("breaker_failures", 3),
                         breaker_reset_s=options.get("breaker_reset_s", 10.0),
                         recovery_ramp_s=options.get("recovery_ramp_s", 10.0))
    except BaseException:
        router.close()
        raise

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        front.start()
        try:
            yield
        finally:
            await front.aclose()
            router.close()
            if own_tokenizer:
                await asyncio.to_thread(tokenizer.close)

    app = FastAPI(title="kvroute (prefill/decode)", lifespan=lifespan)

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        return await front.handle(request, COMPLETIONS_PATH)

    @app.post(CHAT_PATH)
    async def chat(request: Request) -> Response:
        return await front.handle(request, CHAT_PATH)

    def _pass_through(path: str) -> Any:
        async def route(request: Request) -> Response:
            return await front.handle(request, path)
        route.__name__ = "pass_through_" + path.strip("/").replace("/", "_")
        return route

    for extra in PASS_THROUGH:  # served by the decode pool alone
        app.post(extra)(_pass_through(extra))

    @app.get("/metrics")
    async def metrics() -> Response:
        return front.render_metrics()

    @app.get("/health")
    async def health() -> Response:
        up = front.available()
        body = {"status": "ok" if all(up.values()) else "unavailable",
                "prefill": len(router.prefill.workers), "decode": len(router.decode.workers),
                "available": up}
        if all(up.values()):
            return JSONResponse(body)
        return JSONResponse(body, status_code=503,
                            headers={"Retry-After": str(front.retry_after_s())})

    @app.get("/v1/models")
    async def models() -> Response:
        """The first decode worker up that answers; else 503 with ``Retry-After``."""
        for w in router.decode.workers:
            if not front._up("decode", w):
                continue
            try:
                r = await front._client().get(w.url.rstrip("/") + "/v1/models", timeout=10.0)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return Response(r.content, media_type=r.headers.get("content-type"),
                                headers={"x-kvroute-worker": w.name})
        return front._unavailable("no decode worker answered /v1/models")

    install(app, request_id_headers=options.get("request_id_headers") or ["x-request-id"],
            access_log=options.get("access_log", True),
            access_log_bodies=options.get("access_log_bodies", False))
    app.state.kvroute_pd_router = router
    app.state.kvroute_pd_front = front
    return app
