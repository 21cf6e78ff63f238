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
and decode URL; an unhealthy worker is not chosen and a request waiting on it moves. When
a pool has no worker up the answer is 503 with ``Retry-After``; a prefill that still fails
answers 502 (the upstream's status and a short text), a prefill 4xx other than 429 is
passed through as the engine answered, a decode answer (any status) is the client's
answer. The router's load for the request is released in every case.

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
import math
import secrets
from typing import Any, AsyncIterator, Callable, Dict, Mapping, Optional, Set
from urllib.parse import urlsplit

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from kvroute._router import NoWorkerAvailable, Worker
from kvroute.pd import PDDecision, PDRouter
from kvroute.serving.hitrate import StreamReport, report_answer, report_body
from kvroute.serving.health import (
    FirstByteTimeout,
    HealthChecker,
    first_byte_timeout,
    guard_first_byte,
)
from kvroute.serving.limits import BodyTooLarge, RequestLimits, learn_max_model_len
from kvroute.serving.proxy import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DP_RANK_HEADER,
    _failure_kind,
    encode_prompt,
    error_response,
    limit_response,
    parse_body,
    select_kwargs,
)
from kvroute.serving.retry import RetryPolicy
from kvroute.serving.routes import client_headers, note_routed
from kvroute.serving.tokenizer import TokenizerBusy

__all__ = ["create_pd_app", "PREFILL_KV_TRANSFER_PARAMS"]

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
                 health_check: Optional[Mapping[str, Any]] = None) -> None:
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
        if health is not None:
            await health.aclose()
        learner, self._limits_task = self._limits_task, None
        if learner is not None:
            learner.cancel()
            await asyncio.gather(learner, return_exceptions=True)
        if self.client is not None:
            client, self.client = self.client, None
            await client.aclose()

    def _up(self, worker: Worker) -> bool:
        return self.health is None or self.health.healthy(worker.url.rstrip("/"))

    def available(self) -> Dict[str, int]:
        """Workers up per pool: ``{"prefill": n, "decode": n}``."""
        return {"prefill": sum(self._up(w) for w in self.router.prefill.workers),
                "decode": sum(self._up(w) for w in self.router.decode.workers)}

    def _pool(self, pool: str) -> Any:
        return self.router.prefill if pool == "prefill" else self.router.decode

    def _exclude(self, pool: str, failed: Set[str]) -> Set[str]:
        return failed | {w.name for w in self._pool(pool).workers if not self._up(w)}

    def _may_retry(self, kind: str, attempts: int, pool: str, failed: Set[str]) -> bool:
        """The retry policy allows it and the failed worker's pool has another worker up."""
        if not self.retry.retries(kind, attempts):
            return False
        names = {w.name for w in self._pool(pool).workers}
        return bool(names - self._exclude(pool, failed))

    def retry_after_s(self) -> int:
        """Whole seconds a client should wait when a pool has no worker up, at least 1."""
        return max(1, math.ceil(self.health.retry_after_s() if self.health is not None
                                else 1.0))

    def _unavailable(self, message: str) -> JSONResponse:
        return error_response(503, message, headers={"Retry-After": str(self.retry_after_s())})

    async def _tokens(self, path: str, body: Mapping[str, Any]) -> np.ndarray:
        return await self.limits.tokens_within(
            body, lambda: encode_prompt(self.tokenizer, path, body))

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
        # RequestContext gave every request one (the client's or a generated one).
        rid = request.headers.get("x-request-id") or ""
        kw = select_kwargs(client_headers(request.scope, request.headers), body)
        failed: Dict[str, Set[str]] = {"prefill": set(), "decode": set()}
        attempts = 0
        while True:
            try:
                pd = self.router.select_pair(
                    tokens, exclude_prefill=self._exclude("prefill", failed["prefill"]),
                    exclude_decode=self._exclude("decode", failed["decode"]), **kw)
            except NoWorkerAvailable as e:
                return self._unavailable(f"no worker available: {e}")
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
                await asyncio.sleep(self.retry.backoff_s(attempts))
            except BaseException:
                self.router.complete(pd)
                raise

    async def _send(self, pool: str, worker: Worker, req: httpx.Request) -> httpx.Response:
        """``req`` sent until its response headers (body unread), bounded by the first-byte
        guard. Raises _AttemptFailed for a failure before them."""
        try:
            return await guard_first_byte(self._client().send(req, stream=True),
                                          self.first_byte_timeout_s, self.health,
                                          worker.url.rstrip("/"))
        except (httpx.HTTPError, httpx.InvalidURL, FirstByteTimeout) as e:
            kind = _failure_kind(e)
            status = 504 if kind == "timeout" else 502
            raise _AttemptFailed(pool, worker, kind,
                                 _error(status, f"{pool} worker {worker.name}: {e!r}")) from e

    async def _check_status(self, pool: str, worker: Worker, r: httpx.Response) -> None:
        """Raises _AttemptFailed (``r`` read and closed) for a status the retry policy
        retries; the client's answer if it is not retried: a decode worker's answer as it is,
        502 naming a prefill worker."""
        kind = self.retry.status_kind(r.status_code)
        if kind is None:
            return
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
                r = await self._send("prefill", prefill_w, client.build_request(
                    "POST", url, json=pre, headers=self._headers(rid, prefill_w)))
                try:
                    await self._check_status("prefill", prefill_w, r)
                    await r.aread()
                except httpx.HTTPError as e:
                    raise _AttemptFailed("prefill", prefill_w, "error", _error(
                        502, f"prefill worker {prefill_w.name}: {e!r}")) from e
                finally:
                    await r.aclose()
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
                prefill_task = asyncio.ensure_future(client.post(
                    url, json=decode_body, headers=self._headers(rid, prefill_w)))
        req = client.build_request("POST", decode_w.url.rstrip("/") + path, json=decode_body,
                                   headers=self._headers(rid, decode_w))
        prefill_decision = pd.prefill

        def prefill_answered(r: httpx.Response) -> None:
            report_answer(self.router.prefill, prefill_decision, r.status_code, r.content,
                          r.headers.get("content-type", ""))

        try:
            upstream = await self._send("decode", decode_w, req)
            await self._check_status("decode", decode_w, upstream)
        except BaseException:
            await _discard(prefill_task, prefill_answered)
            raise
        headers = {"x-kvroute-decode-worker": decode_w.name}
        if pd.prefill is not None:
            headers["x-kvroute-prefill-worker"] = pd.prefill.worker
        ctype = upstream.headers.get("content-type", "application/json")

        async def finish() -> None:
            await upstream.aclose()
            if prefill_task is not None:
                await _discard(prefill_task, prefill_answered)
            self.router.complete(pd)

        # The decode worker's count is its own prefix cache's only when it prefilled itself.
        local = pd.prefill is None
        if body.get("stream"):
            delivered = StreamReport(self.router.decode, pd.decode) if local else None

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in upstream.aiter_raw():
                        if delivered is not None:
                            delivered.feed(chunk)
                        yield chunk
                    if delivered is not None:
                        delivered.finish(upstream.status_code)
                finally:
                    await finish()

            return StreamingResponse(relay(), status_code=upstream.status_code,
                                     media_type=ctype, headers=headers)
        try:
            content = await upstream.aread()
        finally:
            await finish()
        if local:
            report_body(self.router.decode, pd.decode, upstream.status_code, content)
        return Response(content, status_code=upstream.status_code, media_type=ctype,
                        headers=headers)


async def _discard(task: Optional[asyncio.Task[httpx.Response]],
                   answered: Optional[Callable[[httpx.Response], Any]] = None) -> None:
    """Awaits a concurrent prefill request (SGLang) and hands its answer to ``answered``;
    its failure is not the client's (the decode answer is)."""
    if task is None:
        return
    with contextlib.suppress(Exception):
        r = await task
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
        ``limits``, ``health_check``; `kvroute.serving.routes.install`'s
        ``request_id_headers``, ``access_log``, ``access_log_bodies``. Others (breakers,
        scraping, ORCA, recovery ramp, tenants) do not apply to this front and are ignored.

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
        from kvroute.serving.tokenizer import PromptTokenizer

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
                         health_check=options.get("health_check"))
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
            if not front._up(w):
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
