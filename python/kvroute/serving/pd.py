"""Prefill/decode disaggregation behind the OpenAI-compatible routes (``kvroute serve`` or
`kvroute.fastapi.create_app` with a ``pd_disaggregation`` / ``vllm_prefill_decode``
configuration), routed by `kvroute.PDRouter`: `PDFront` is the request pipeline's front for
this mode (`kvroute.serving.pipeline`), so tenants, their limits, ``/v1/explain``,
``/ready``, ``/workers``, ``/admin/*`` and the access log work as in the one-pool mode;
what this mode cannot honour (the response cache, replicas, load scraping, ORCA, the adaptive
cache_weight) is refused at start-up (`kvroute.serving.build`).

One request (``POST /v1/completions`` or ``/v1/chat/completions``):

1. `PDRouter.select_pair` (with the request's ``session_key`` and ``cache_salt``,
   `kvroute.serving.request.select_kwargs`; a request id kvroute generated is no session key)
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
   client's, as the bytes it sent, else a generated one:
   `kvroute.serving.routes.RequestContext`), ``X-data-parallel-rank`` for a worker with a
   rank, and for a tenant's request ``x-kvroute-tenant`` (``Authorization`` is never
   forwarded).

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
worker of each pool has a circuit breaker (`kvroute.serving.breaker.CircuitBreaker`,
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
connections closed: `kvroute.serving.request.until_disconnect`).

Pass-through routes (`kvroute.serving.routes.PASS_THROUGH`: ``/v1/embeddings``,
``/v1/responses``, ``/v1/messages``, ``/v1/rerank``, ``/tokenize``, ``/detokenize``) go to
the decode pool alone (the same JSON body; no prefill), with the same retries, breakers,
ramp and limits: cache-aware where the body has a prompt kvroute can tokenize
(`kvroute.serving.request.encode_routed`), on load otherwise.

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
import functools
import json
import logging
import math
import os
import time
from typing import Any, Dict, Mapping, Optional, Set, Tuple

import httpx
import numpy as np
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvroute._router import NoWorkerAvailable, Worker
from kvroute.pd import PDDecision, PDRouter
from kvroute.serving import defaults as D
from kvroute.serving.breaker import CircuitBreaker
from kvroute.serving.common import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DECISION_HEADER,
    PID_HEADER,
    SCORES_HEADER,
    STAGE_ERRORS,
    decision_dict,
    error_response,
    jsonable,
    scores_list,
    stage_error,
)
from kvroute.serving.health import (
    HealthChecker,
    RecoveryRamp,
    first_byte_timeout,
    recovered_at,
    stop_checks,
)
from kvroute.serving.limits import RequestLimits, learn_max_model_len
from kvroute.serving.metrics import RouterMetrics
from kvroute.serving.pd_dispatch import PREFILL_KV_TRANSFER_PARAMS, AttemptFailed, PDAttempts
from kvroute.serving.relay import log_entry
from kvroute.serving.request import encode_routed, parse_body, select_kwargs, until_disconnect
from kvroute.serving.retry import RetryPolicy
from kvroute.serving.routes import (
    PASS_THROUGH,
    REQUEST_ID_RAW,
    client_headers,
    note_routed,
    request_id_of,
)

__all__ = ["PDFront", "PREFILL_KV_TRANSFER_PARAMS", "POOLS"]

log = logging.getLogger("kvroute.serving.pd")

#: The pools, as the metrics' namespaces and the breakers' keys name them.
POOLS = ("prefill", "decode")


class PDFront(PDAttempts):
    """The request pipeline's front in prefill/decode mode (`kvroute.serving.pipeline.Front`).

    Parameters
    ----------
    router:
        The `kvroute.PDRouter` (not closed here).
    bootstrap_ports:
        Prefill worker URL -> SGLang bootstrap port, or None (vLLM).
    tokenizer, model:
        As `kvroute.serving.proxy.Proxy`'s.
    upstream_timeout_s, connect_timeout_s, first_byte_timeout_s, retry, max_retries, limits,
    health_check, breaker_failures, breaker_reset_s, recovery_ramp_s, decision_log_size:
        As `kvroute.serving.proxy.Proxy`'s; the defaults are the config's
        (`kvroute.config.ServingConfig`), which `kvroute.serving.build` passes.

    Raises
    ------
    ValueError
        Bad settings.
    """

    def __init__(self, router: PDRouter, bootstrap_ports: Mapping[str, Optional[int]], *,
                 tokenizer: Any, model: Optional[str], upstream_timeout_s: float,
                 connect_timeout_s: float, first_byte_timeout_s: Optional[float],
                 retry: Any, max_retries: int, limits: Any,
                 health_check: Optional[Mapping[str, Any]] = None, breaker_failures: int,
                 breaker_reset_s: float, recovery_ramp_s: float,
                 decision_log_size: Optional[int] = D.DECISION_LOG_SIZE,
                 replicas: Optional[Mapping[str, Any]] = None) -> None:
        from kvroute.serving.admin import DecisionLog
        from kvroute.serving.replicas import Replicas

        CircuitBreaker(breaker_failures, breaker_reset_s)  # validates
        self.breaker_failures = breaker_failures
        self.breaker_reset_s = float(breaker_reset_s)
        self._breakers: Dict[Tuple[str, str], CircuitBreaker] = {}
        self.ramp = RecoveryRamp(recovery_ramp_s)
        #: Both pools' `RouterMetrics` on one registry, namespaces ``kvroute_prefill`` and
        #: ``kvroute_decode``; tenant counters are the decode pool's.
        self.registry = CollectorRegistry()
        self.pool_metrics = {"prefill": RouterMetrics(router.prefill, self.registry,
                                                      "kvroute_prefill"),
                             "decode": RouterMetrics(router.decode, self.registry,
                                                     "kvroute_decode")}
        self.metrics = self.pool_metrics["decode"]
        self.router = router
        self.bootstrap_ports = dict(bootstrap_ports)
        self.tokenizer = tokenizer
        self.model = model
        self.timeout = httpx.Timeout(upstream_timeout_s, connect=connect_timeout_s)
        self.first_byte_timeout_s = first_byte_timeout(first_byte_timeout_s)
        self.retry = RetryPolicy.from_options(retry, max_retries)
        self.limits = RequestLimits.from_options(limits)
        self._health_options = dict(health_check) if health_check is not None else None
        if self._health_options is not None:
            HealthChecker(lambda: (), None, **self._health_options)  # type: ignore[arg-type]
        self.health_checker: Optional[HealthChecker] = None
        self.client: Optional[httpx.AsyncClient] = None
        self._limits_task: Optional[asyncio.Task[None]] = None
        self.decisions: Optional[DecisionLog] = (
            DecisionLog(decision_log_size, expand=log_entry)
            if decision_log_size is not None else None)
        #: Per pool, the load shared with the other processes of ``kvroute serve --workers
        #: N`` (each pool in its own subdirectory of theirs); empty: this process alone.
        self.replicas: Dict[str, Replicas] = {}
        if replicas is not None:
            opts = dict(replicas)
            root = opts.pop("local_dir")
            for pool in POOLS:
                os.makedirs(os.path.join(root, pool), exist_ok=True)
                r = Replicas(self._pool(pool), local_dir=os.path.join(root, pool), **opts)
                if r.shared is not None:
                    r.shared.register_metrics(self.registry, f"kvroute_{pool}")
                self.replicas[pool] = r

    def _urls(self) -> Set[str]:
        return {w.url.rstrip("/") for r in (self.router.prefill, self.router.decode)
                for w in r.workers}

    def _client(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=self.timeout, trust_env=False)
        return self.client

    async def start(self) -> None:
        """Starts the health checks and, with ``max_prompt_tokens: auto``, learning the
        workers' ``max_model_len`` (on the running loop). Idempotent."""
        client = self._client()
        if self._health_options is not None and self.health_checker is None:
            self.health_checker = HealthChecker(self._urls, client, **self._health_options)
            self.health_checker.start()
        if self.limits.auto and self._limits_task is None:
            self._limits_task = asyncio.get_running_loop().create_task(
                learn_max_model_len(self.limits, client, lambda: sorted(self._urls())))
        for r in self.replicas.values():
            await r.start(client)

    async def aclose(self) -> None:
        for r in self.replicas.values():
            await r.aclose()
        health, self.health_checker = self.health_checker, None
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
        checker = self.health_checker
        if checker is not None and not checker.healthy(worker.url.rstrip("/")):
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
        return recovered_at(self.breaker(pool, worker.name).ramp_from, self.health_checker,
                            worker.url.rstrip("/"))

    def render_metrics(self) -> Response:
        """``GET /metrics``: both pools' `RouterMetrics` (one registry) in the Prometheus
        text format."""
        data, content_type = self.pool_metrics["decode"].render()
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
                self.pool_metrics[pool].set_circuit_open(worker.name, False)
        elif b.record_failure():
            log.warning("circuit of %s worker %s opened after %d consecutive failures", pool,
                        worker.name, b.consecutive_failures)
            self.pool_metrics[pool].set_circuit_open(worker.name, True)

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
        if not waits and self.health_checker is not None:
            waits = [self.health_checker.retry_after_s()]
        return max(1, math.ceil(min(waits, default=1.0)))

    def _unavailable(self, message: str) -> JSONResponse:
        return error_response(503, message, headers={"Retry-After": str(self.retry_after_s())})

    def _pool_workers(self, pool: str) -> Dict[str, Worker]:
        return {w.name: w for w in self._pool(pool).workers}

    # -- the routes of the table (kvroute.serving.app) -----------------------------------------
    def health(self) -> Response:
        up = self.available()
        body = {"status": "ok" if all(up.values()) else "unavailable",
                "prefill": len(self.router.prefill.workers),
                "decode": len(self.router.decode.workers), "available": up}
        headers = {PID_HEADER: str(os.getpid())}
        if all(up.values()):
            return JSONResponse(body, headers=headers)
        return JSONResponse(body, status_code=503,
                            headers={"Retry-After": str(self.retry_after_s()), **headers})

    def ready(self) -> Response:
        """``GET /ready``: 200 once every worker of both pools has an exact or explicitly
        degraded / stale index (`kvroute.serving.replicas.readiness` per pool)."""
        from kvroute.serving.replicas import readiness

        pools = {pool: readiness(self._pool(pool)) for pool in POOLS}
        ok = all(r for r, _ in pools.values())
        return JSONResponse({"status": "ready" if ok else "not_ready",
                             **{pool: body for pool, (_, body) in pools.items()}},
                            status_code=200 if ok else 503)

    def workers_view(self) -> Dict[str, Any]:
        """``GET /workers``: per pool, per worker its URL, rank, index state, load, circuit,
        health and recovery share (the one-pool view's fields), plus each pool's policy."""
        keys = ("state", "indexed_blocks", "inflight_requests", "pending_prefill_tokens",
                "num_requests_waiting", "kv_cache_usage_perc", "last_recv_age_s", "events",
                "batches", "gaps", "replays", "reconnects", "dropped",
                "peer_inflight_requests", "peer_pending_prefill_tokens")
        out: Dict[str, Any] = {}
        for pool in POOLS:
            r = self._pool(pool)
            st = r.stats()
            rows: Dict[str, Any] = {}
            for w in r.workers:
                ws = st["workers"].get(w.name, {})
                row: Dict[str, Any] = {"url": w.url, "dp_rank": w.dp_rank,
                                       "kv_endpoint": w.kv_endpoint}
                row.update({k: ws.get(k) for k in keys})
                row["degraded"] = ws.get("state") in ("degraded", "stale")
                row["circuit"] = self.breaker(pool, w.name).snapshot()
                row["health"] = (jsonable(self.health_checker.status().get(w.url.rstrip("/")))
                                 if self.health_checker is not None else None)
                row["recovery_share"] = round(self.recovery_share(pool, w), 3)
                rows[w.name] = row
            rep = self.replicas.get(pool)
            out[pool] = {"workers": rows, "policy": r.policy, "block_size": r.block_size,
                         "replicas": rep.status() if rep is not None else None}
        out["limits"] = self.limits.as_dict()
        out["tokenizer_lanes"] = (self.tokenizer.lanes()
                                  if hasattr(self.tokenizer, "lanes") else None)
        return out

    def snapshot(self, request: Request) -> Response:
        """``GET /admin/snapshot?pool=prefill|decode``: that pool's index in
        `kvroute.snapshot`'s format; 400 without a pool."""
        from starlette.responses import StreamingResponse

        from kvroute.snapshot import aiter_snapshot

        pool = request.query_params.get("pool")
        if pool not in POOLS:
            return error_response(400, "prefill/decode mode: name the index with "
                                       "?pool=prefill or ?pool=decode")
        return StreamingResponse(aiter_snapshot(self._pool(pool), None),
                                 media_type="application/x-kvroute-snapshot")

    def add_worker(self, body: Any) -> Dict[str, Any]:
        """``POST /admin/workers`` with ``"pool": "prefill" | "decode"`` beside the worker's
        keys (`kvroute.serving.admin.worker_from_json`; a prefill worker may carry
        ``bootstrap_port``). Raises ValueError for a bad body or a duplicate."""
        from kvroute.serving.admin import worker_from_json

        if not isinstance(body, Mapping) or body.get("pool") not in POOLS:
            raise ValueError("prefill/decode mode: the body needs \"pool\": \"prefill\" or "
                             "\"decode\"")
        fields = {k: v for k, v in body.items() if k not in ("pool", "bootstrap_port")}
        boot = body.get("bootstrap_port")
        if boot is not None and (body["pool"] != "prefill" or isinstance(boot, bool)
                                 or not isinstance(boot, int) or not 0 < boot < 65536):
            raise ValueError("bootstrap_port: a port in 1-65535, for a prefill worker")
        w = self._pool(body["pool"]).add_worker(worker_from_json(fields))
        if body["pool"] == "prefill":
            self.bootstrap_ports[w.url] = boot
        return {"added": w.name, "pool": body["pool"],
                "workers": [x.name for x in self._pool(body["pool"]).workers]}

    def remove_worker(self, name: str) -> Dict[str, Any]:
        """``DELETE /admin/workers/{name}``: from whichever pool holds it. Raises KeyError
        naming the workers for an unknown one."""
        for pool in POOLS:
            r = self._pool(pool)
            if name in self._pool_workers(pool):
                r.remove_worker(name)
                self._breakers.pop((pool, name), None)
                self.pool_metrics[pool].forget_worker(name)
                return {"removed": name, "pool": pool,
                        "workers": [x.name for x in r.workers]}
        raise KeyError(f"no worker {name!r}; prefill: "
                       f"{list(self._pool_workers('prefill'))}, decode: "
                       f"{list(self._pool_workers('decode'))}")

    def reload(self, auth: Any, new_cfg: Any, old_cfg: Any) -> Dict[str, Any]:
        """``POST /admin/reload``: the tenants and admin key are applied; anything else that
        changed (workers, policies, serving options) is listed under ``not_applied`` (use
        ``/admin/workers`` for workers). Raises ValueError for a one-pool config or a tenant
        table `Auth` refuses (nothing applied)."""
        from kvroute.serving.admin import apply_tenants

        if not new_cfg.is_pd:
            raise ValueError("the reloaded config is not pd_disaggregation; this server "
                             "routes a prefill and a decode pool")
        apply_tenants(auth, new_cfg)
        not_applied = [k for k in ("mode", "block_size", "serving", "kv_events", "limits",
                                   "health_check") if getattr(new_cfg, k, None)
                       != getattr(old_cfg, k, None)]
        return {"workers_added": [], "workers_removed": [],
                "tenants": [t.name for t in auth.tenants], "policy": "unchanged",
                "not_applied": not_applied}

    async def models(self) -> Response:
        """``GET /v1/models``: the first decode worker up that answers, else the configured
        model, else 503 with ``Retry-After``."""
        for w in self.router.decode.workers:
            if not self._up("decode", w):
                continue
            try:
                r = await self._client().get(w.url.rstrip("/") + "/v1/models", timeout=10.0)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return Response(r.content, media_type=r.headers.get("content-type"),
                                headers={"x-kvroute-worker": w.name})
        if self.model:
            return JSONResponse({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": int(time.time()),
                 "owned_by": "kvroute", "root": self.model, "parent": None}]})
        return self._unavailable("no decode worker answered /v1/models")

    async def _tokens(self, path: str, body: Mapping[str, Any]) -> np.ndarray:
        return await self.limits.tokens_within(
            body, functools.partial(encode_routed, self.tokenizer, path, body))

    async def _parsed(self, request: Request, path: Optional[str]
                      ) -> Tuple[Optional[Response], str, Dict[str, Any], np.ndarray]:
        """(a refusal or None, the path, the body, its token ids): the parse and tokenize
        stages; ``path`` None: chat when the body has ``messages``, else completions."""
        try:
            _, body = await parse_body(request, self.limits.max_body_bytes)
            path = path or (CHAT_PATH if "messages" in body else COMPLETIONS_PATH)
            return None, path, body, await self._tokens(path, body)
        except STAGE_ERRORS as e:
            return stage_error(e), path or "", {}, np.empty(0, np.uint32)

    async def explain(self, request: Request) -> Response:
        """``POST /v1/explain``: the pair (or the decode worker alone when the prefill pool
        would be skipped) for a completions or chat body with every worker's score terms; a
        dry run in both pools (nothing accounted)."""
        refused, path, body, tokens = await self._parsed(request, None)
        if refused is not None:
            return refused
        kw = select_kwargs(client_headers(request.scope, request.headers), body, self.model)
        rid = request_id_of(request.scope)
        try:
            d = self.router.decode.select_worker(
                tokens, exclude=self._exclude("decode", set()), explain=True, dry_run=True,
                **kw)
            threshold = self.router.threshold
            p = None
            if threshold is None or d.prefill_tokens > threshold:
                p = self.router.prefill.select_worker(
                    tokens, exclude=self._exclude("prefill", set()), explain=True,
                    dry_run=True, **kw)
        except NoWorkerAvailable as e:
            return self._unavailable(f"no worker available: {e}")
        return JSONResponse({
            "decision": decision_dict(d, 1, rid), "scores": scores_list(d),
            "prefill": None if p is None else {"decision": decision_dict(p, 1, rid),
                                               "scores": scores_list(p)},
            "path": path, "prompt_tokens": int(len(tokens))})

    async def handle(self, request: Request, path: str, tenant: Any = None,
                     explain: bool = False) -> Response:
        """Parse to relay for one admitted request (see the module docstring). ``tenant``:
        as for `kvroute.serving.proxy.Proxy.handle` (its ``allowed_models`` and
        ``trust_session_key`` apply); ``explain``: the decode decision and scores in
        ``x-kvroute-decision`` / ``x-kvroute-scores``."""
        refused, path, body, tokens = await self._parsed(request, path)
        if refused is not None:
            return refused
        if tenant is not None and not tenant.model_allowed(body.get("model")):
            return error_response(403, f"tenant {tenant.name} may not use model "
                                       f"{body.get('model')!r}", "PermissionDeniedError")
        resp = await until_disconnect(request, self._route(request, path, body, tokens,
                                                           tenant, explain))
        if resp is None:  # the client went away before the response started
            return Response(status_code=499)
        return resp

    async def _route(self, request: Request, path: str, body: Dict[str, Any],
                     tokens: np.ndarray, tenant: Any, explain: bool) -> Response:
        # RequestContext gave every request one (the client's or a generated one): passed on
        # as the bytes the client sent.
        rid = next((v for k, v in request.headers.raw if k.lower() == REQUEST_ID_RAW), b"")
        request_id = request_id_of(request.scope)
        tenant_name = tenant.name if tenant is not None else None
        kw = select_kwargs(client_headers(request.scope, request.headers), body, self.model,
                           trusted=tenant is None or tenant.trust_session_key)
        want_scores = explain or self.decisions is not None
        failed: Dict[str, Set[str]] = {"prefill": set(), "decode": set()}
        attempts = 0
        while True:
            t0 = time.perf_counter()
            try:
                exclude_decode = self._choice_exclude("decode", failed["decode"])
                if path in PASS_THROUGH:  # the decode pool serves it whole
                    pd = PDDecision(None, self.router.decode.select_worker(
                        tokens, exclude=exclude_decode, explain=want_scores, **kw))
                else:
                    pd = self.router.select_pair(
                        tokens, exclude_prefill=self._choice_exclude("prefill",
                                                                     failed["prefill"]),
                        exclude_decode=exclude_decode, explain=want_scores, **kw)
            except NoWorkerAvailable as e:
                return self._unavailable(f"no worker available: {e}")
            self.pool_metrics["decode"].observe_decision(pd.decode, time.perf_counter() - t0)
            if pd.prefill is not None:
                self.pool_metrics["prefill"].observe_decision(pd.prefill)
            for pool, d in (("decode", pd.decode), ("prefill", pd.prefill)):
                if d is not None and pool in self.replicas:
                    self.replicas[pool].on_decision(d, tokens, kw)
            attempts += 1
            if self.decisions is not None:
                self.decisions.record({"request_id": request_id, "tenant": tenant_name,
                                       "path": path, "decision": pd.decode,
                                       "prefill_decision": pd.prefill, "attempts": attempts})
            extra: Dict[str, str] = {}
            if explain:
                extra[DECISION_HEADER] = json.dumps(decision_dict(pd.decode, attempts,
                                                                  request_id),
                                                    separators=(",", ":"))
                extra[SCORES_HEADER] = json.dumps(scores_list(pd.decode), separators=(",", ":"))
            note_routed(request.scope, tenant=tenant_name, worker=pd.decode.worker,
                        attempts=attempts,
                        decision=pd.decode,
                        prefill_worker=pd.prefill.worker if pd.prefill is not None else None,
                        prefill_decision=pd.prefill)
            try:
                return await self._dispatch(pd, path, body, rid, tenant_name, extra)
            except AttemptFailed as f:
                self.router.complete(pd)
                failed[f.pool].add(f.worker.name)
                if f.kind in ("connect", "timeout") and self.health_checker is not None:
                    self.health_checker.poke(f.worker.url.rstrip("/"))
                if not self._may_retry(f.kind, attempts, f.pool, failed[f.pool]):
                    if f.kind == "connect":
                        return self._unavailable(f"no {f.pool} worker reachable: "
                                                 f"{len(failed[f.pool])} attempt(s) failed "
                                                 f"to connect "
                                                 f"({', '.join(sorted(failed[f.pool]))})")
                    return f.response
                self.pool_metrics[f.pool].observe_retry()
                await asyncio.sleep(self.retry.backoff_s(attempts))
            except BaseException:
                self.router.complete(pd)
                raise

