"""Prefill/decode disaggregation behind one OpenAI-compatible front (``kvroute serve`` with a
``pd_disaggregation`` / ``vllm_prefill_decode`` configuration), routed by `kvroute.PDRouter`.

One request (``POST /v1/completions`` or ``/v1/chat/completions``):

1. `PDRouter.select_pair` picks the decode worker, then the prefill worker, unless the decode
   worker would prefill at most ``pd_uncached_token_threshold`` tokens itself (the prefill
   pool is then skipped and the request goes to the decode worker as it is).
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
   client asked for ``stream``. Both requests carry the same ``X-Request-Id``
   (the client's, else a new one) and ``X-data-parallel-rank`` for a worker with a rank.

A failed prefill or decode request answers 502 with the upstream's status and a short text;
the router's load for the request is released in every case. Without a tokenizer only
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
import json
import secrets
import uuid
from typing import Any, AsyncIterator, Callable, Dict, Mapping, Optional
from urllib.parse import urlsplit

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvroute._router import Worker
from kvroute.pd import PDDecision, PDRouter
from kvroute.serving.hitrate import StreamReport, report_answer, report_body
from kvroute.serving.proxy import CHAT_PATH, COMPLETIONS_PATH, DP_RANK_HEADER, _token_id_prompt

__all__ = ["create_pd_app", "PREFILL_KV_TRANSFER_PARAMS"]

#: What the prefill request carries (vLLM's NIXL connector; the vLLM PD proxies).
PREFILL_KV_TRANSFER_PARAMS: Dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "upstream_error",
                                   "code": status}}, status_code=status)


class _PDFront:
    def __init__(self, router: PDRouter, bootstrap_ports: Mapping[str, Optional[int]],
                 tokenizer: Any, upstream_timeout_s: float, connect_timeout_s: float) -> None:
        self.router = router
        self.bootstrap_ports = dict(bootstrap_ports)
        self.tokenizer = tokenizer
        self.timeout = httpx.Timeout(upstream_timeout_s, connect=connect_timeout_s)
        self.client: Optional[httpx.AsyncClient] = None

    def _client(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=self.timeout, trust_env=False)
        return self.client

    async def aclose(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.aclose()

    async def _tokens(self, path: str, body: Mapping[str, Any]) -> np.ndarray:
        if self.tokenizer is not None:
            return await self.tokenizer.aencode_request(path, body)
        return _token_id_prompt(path, body)

    @staticmethod
    def _headers(rid: str, worker: Worker) -> Dict[str, str]:
        h = {"X-Request-Id": rid, "Content-Type": "application/json"}
        if worker.dp_rank is not None:
            h[DP_RANK_HEADER] = str(worker.dp_rank)
        return h

    async def handle(self, request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            tokens = await self._tokens(path, body)
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error",
                                           "code": 400}}, status_code=400)
        pd = self.router.select_pair(tokens)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            return await self._dispatch(pd, path, body, rid)
        except BaseException:
            self.router.complete(pd)
            raise

    async def _dispatch(self, pd: PDDecision, path: str, body: Dict[str, Any],
                        rid: str) -> Response:
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
                try:
                    r = await client.post(url, json=pre, headers=self._headers(rid, prefill_w))
                except httpx.HTTPError as e:
                    self.router.complete(pd)
                    return _error(502, f"prefill worker {prefill_w.name}: {e!r}")
                if r.status_code != 200:
                    self.router.complete(pd)
                    return _error(502, f"prefill worker {prefill_w.name} answered "
                                       f"{r.status_code}: {r.text[:200]}")
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
            upstream = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            await _discard(prefill_task, prefill_answered)
            self.router.complete(pd)
            return _error(502, f"decode worker {decode_w.name}: {e!r}")
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
                  upstream_timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                  **_ignored: Any) -> FastAPI:
    """The FastAPI application serving a prefill/decode configuration (see the module
    docstring). ``cfg`` is a `kvroute.config.RouterConfig` in PD mode; ``tokenizer`` a
    `kvroute.serving.tokenizer.PromptTokenizer` or None. The `PDRouter` is at
    ``app.state.kvroute_pd_router`` and closed at shutdown. Other `create_router` keywords
    (retries, breakers, scraping, ORCA) do not apply to this front and are ignored. Raises
    ValueError for a ``unix://`` worker URL."""
    uds = [w.url for pool in (cfg.mode.prefill, cfg.mode.decode) for w in pool
           if w.url.startswith("unix://")]
    if uds:
        raise ValueError(f"prefill/decode mode does not take unix:// workers ({', '.join(uds)}): "
                         "the decode engine reaches the prefill engine's KV cache over the "
                         "network (SGLang's bootstrap_host is the prefill URL's host); give "
                         "http:// URLs")
    router = PDRouter.from_config(cfg, pd_uncached_token_threshold=pd_uncached_token_threshold)
    boots = {w.url: w.bootstrap_port for w in cfg.mode.prefill}
    front = _PDFront(router, boots, tokenizer, upstream_timeout_s, connect_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await front.aclose()
            router.close()

    app = FastAPI(title="kvroute (prefill/decode)", lifespan=lifespan)

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        return await front.handle(request, COMPLETIONS_PATH)

    @app.post(CHAT_PATH)
    async def chat(request: Request) -> Response:
        return await front.handle(request, CHAT_PATH)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok", "prefill": len(router.prefill.workers),
                             "decode": len(router.decode.workers)})

    app.state.kvroute_pd_router = router
    return app
