"""The engine stand-in's HTTP side: `create_app`, a FastAPI app serving one
`kvroute.sim.standin_engine.StandinEngine` with vLLM's OpenAI-compatible routes, its
Prometheus ``/metrics`` (vLLM V1's names) and vLLM's error JSON."""

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional

from kvroute.sim.standin_engine import Generation, StandinEngine
from kvroute.sim.vllm_protocol import ORCA_REQUEST_HEADER, orca_header

__all__ = ["DEFAULT_CHAT_MAX_TOKENS", "create_app"]

DEFAULT_CHAT_MAX_TOKENS = 16
"""Chat ``max_tokens`` when the request gives none. Deliberately not vLLM's default
(max_model_len - prompt length): a stand-in answer that long is useless and slow."""


# ------------------------------------------------------------------------------------------
# HTTP
# ------------------------------------------------------------------------------------------

def _error(message: str, err_type: str = "BadRequestError", code: int = 400,
           param: Optional[str] = None) -> Any:
    """vLLM's ErrorResponse: ``{"error": {"message", "type", "param", "code"}}``
    (``vllm/entrypoints/serve/engine/protocol.py``)."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": err_type, "param": param,
                                   "code": code}}, status_code=code)


def _metrics_collector(engine: StandinEngine) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        """Reads `StandinEngine.stats` at scrape time; names and labels as vLLM V1's
        ``vllm/v1/metrics/loggers.py`` (labels ``model_name``, ``engine``)."""

        def collect(self) -> Any:
            s = engine.stats()
            labels = ["model_name", "engine"]
            values = [engine.model, "0"]

            def gauge(name: str, doc: str, v: float) -> Any:
                g = GaugeMetricFamily(name, doc, labels=labels)
                g.add_metric(values, v)
                return g

            def counter(name: str, doc: str, v: float) -> Any:
                c = CounterMetricFamily(name, doc, labels=labels)
                c.add_metric(values, v)
                return c

            yield gauge("vllm:num_requests_running",
                        "Number of requests in model execution batches.", s["running"])
            yield gauge("vllm:num_requests_waiting",
                        "Number of requests waiting to be processed.", s["waiting"])
            yield gauge("vllm:kv_cache_usage_perc",
                        "KV-cache usage. 1 means 100 percent usage.", s["kv_cache_usage_perc"])
            yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                          s["prompt_tokens"])
            yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                          s["generation_tokens"])
            yield counter("vllm:prefix_cache_queries",
                          "Prefix cache queries, in terms of number of queried tokens.",
                          s["prompt_tokens"])
            yield counter("vllm:prefix_cache_hits",
                          "Prefix cache hits, in terms of number of cached tokens.",
                          s["cached_tokens"])
            ok = CounterMetricFamily("vllm:request_success", "Count of successfully processed "
                                     "requests.", labels=labels + ["finished_reason"])
            ok.add_metric(values + ["length"], s["requests_finished"])
            yield ok

    return _Collector()


def create_app(engine: StandinEngine) -> Any:
    """A FastAPI app serving ``engine`` with vLLM's OpenAI-compatible routes.

    Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (non-streaming JSON or SSE
    ``data: {json}\\n\\n`` chunks then ``data: [DONE]\\n\\n``; ``stream_options.include_usage``
    adds a last chunk with ``choices: []`` and ``usage``), ``POST /tokenize``,
    ``GET /v1/models``, ``GET /health`` (200, empty body), ``GET /metrics`` (Prometheus text),
    ``GET /standin/stats`` (stand-in only: `StandinEngine.stats` + ``request_ids``).

    The request id is ``X-Request-Id`` if the request has one, else the body's
    ``request_id``, else a random hex; response ids are ``cmpl-<id>`` / ``chatcmpl-<id>``
    (vLLM) and ``request_ids`` lists those response ids. A non-streaming response to a
    request with the ``endpoint-load-metrics-format`` header (``TEXT`` or ``JSON``) carries
    the ORCA ``endpoint-load-metrics`` header with ``num_requests_waiting`` and
    ``kv_cache_usage_perc`` (see `orca_header`). Errors are vLLM's ``{"error": {...}}`` JSON:
    404 ``NotFoundError`` for an unknown ``model``, 400 for bad input. The app does not own
    the engine: close it yourself.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    app = FastAPI(title="kvroute engine stand-in (vLLM OpenAI-compatible API)")
    app.state.engine = engine
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_metrics_collector(engine))

    class _BadRequest(Exception):
        def __init__(self, message: str, err_type: str = "BadRequestError", code: int = 400,
                     param: Optional[str] = None) -> None:
            super().__init__(message)
            self.args_ = (message, err_type, code, param)

    @app.exception_handler(_BadRequest)
    async def _bad(_: Request, exc: _BadRequest) -> Any:
        return _error(*exc.args_)

    async def _body(request: Request) -> Dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise _BadRequest("request body must be a JSON object") from exc
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        return body

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Any:
        # Deliberately answer 500 with the error JSON instead of dropping the connection.
        return _error(f"internal error: {type(exc).__name__}: {exc}", "InternalServerError", 500)

    def _check_model(body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _BadRequest(f"model must be a string, got {type(model).__name__}",
                              param="model")
        if model and model != engine.model:  # vLLM accepts a missing or empty model
            raise _BadRequest(f"The model `{model}` does not exist.", "NotFoundError", 404,
                              "model")

    def _opt_int_field(body: Mapping[str, Any], name: str) -> Optional[int]:
        v = body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise _BadRequest(f"{name} must be an integer, got {v!r}", param=name)
        return v

    def _int_field(body: Mapping[str, Any], name: str, default: int) -> int:
        v = _opt_int_field(body, name)
        return default if v is None else v

    def _stream_flags(body: Mapping[str, Any]) -> tuple:
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise _BadRequest(f"stream must be a boolean, got {stream!r}", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise _BadRequest("stream_options must be an object", param="stream_options")
        if opts and not stream:
            raise _BadRequest("Stream options can only be defined when `stream=True`.",
                              param="stream_options")
        n = body.get("n", 1)
        if n not in (None, 1):
            raise _BadRequest(f"the stand-in serves n=1 only, got n={n!r}", param="n")
        return bool(stream), bool(opts.get("include_usage")), bool(
            opts.get("continuous_usage_stats"))

    def _request_id(request: Request, body: Mapping[str, Any]) -> str:
        rid = request.headers.get("X-Request-Id") or body.get("request_id")
        return str(rid) if rid else uuid.uuid4().hex

    def _usage(gen: Generation) -> Dict[str, Any]:
        return {"prompt_tokens": gen.prompt_tokens,
                "total_tokens": gen.prompt_tokens + gen.completion_tokens,
                "completion_tokens": gen.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": gen.cached_tokens or 0}}

    def _orca(request: Request) -> Optional[Dict[str, str]]:
        fmt = request.headers.get(ORCA_REQUEST_HEADER, "")
        if not fmt:
            return None
        s = engine.stats()
        # Order of vLLM's metrics snapshot: waiting is registered before KV usage.
        return orca_header(fmt, [("num_requests_waiting", float(s["waiting"])),
                                 ("kv_cache_usage_perc", float(s["kv_cache_usage_perc"]))])

    def _start(ids: List[int], max_tokens: int, rid: str) -> Generation:
        try:
            return engine.generate(ids, max_tokens, request_id=rid)
        except ValueError as exc:
            raise _BadRequest(str(exc)) from exc

    async def _collect(request: Request, gen: Generation) -> Optional[List[int]]:
        """All output tokens of a non-streaming request, or None when the client disconnected
        first: the generation is then cancelled and its blocks released (vLLM's
        ``with_cancellation`` aborts such requests). The body must have been read."""
        async def run() -> List[int]:
            return [t async for t in gen]

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            watcher.cancel()
            raise
        watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()  # not running any more: releases the blocks if still held
        return None

    def _sse(obj: Any) -> bytes:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()

    async def _tokenize(fn: Any, *args: Any, **kw: Any) -> List[int]:
        try:  # off the event loop: template rendering and BPE of long prompts take a while
            return await asyncio.to_thread(fn, *args, **kw)
        except ValueError as exc:
            raise _BadRequest(str(exc)) from exc

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _body(request)
        _check_model(body)
        stream, include_usage, continuous = _stream_flags(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if prompt is None:
            raise _BadRequest("prompt is required", param="prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            raise _BadRequest("the stand-in serves one prompt per request", param="prompt")
        max_tokens = _int_field(body, "max_tokens", 16)
        ids = await _tokenize(engine.tokenize_completion, prompt)
        cid, created, model = f"cmpl-{_request_id(request, body)}", int(time.time()), engine.model
        gen = _start(ids, max_tokens, cid)

        if not stream:
            toks = await _collect(request, gen)
            if toks is None:  # the client is gone: nobody reads the answer
                return Response(status_code=499)
            resp = {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": engine.detokenize(toks), "logprobs": None,
                                 "finish_reason": gen.finish_reason, "stop_reason": None,
                                 "prompt_logprobs": None}],
                    "usage": _usage(gen)}
            return JSONResponse(resp, headers=_orca(request))

        async def events() -> AsyncIterator[bytes]:
            try:
                i = 0
                async for tok in gen:
                    i += 1
                    chunk = {"id": cid, "object": "text_completion", "created": created,
                             "model": model,
                             "choices": [{"index": 0, "text": engine.token_text(tok),
                                          "logprobs": None,
                                          "finish_reason": "length" if i == max_tokens else None,
                                          "stop_reason": None}]}
                    if include_usage and continuous:
                        chunk["usage"] = _usage(gen)
                    yield _sse(chunk)
                if include_usage:
                    yield _sse({"id": cid, "object": "text_completion", "created": created,
                                "model": model, "choices": [], "usage": _usage(gen)})
                yield b"data: [DONE]\n\n"
            finally:
                await gen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await _body(request)
        _check_model(body)
        stream, include_usage, continuous = _stream_flags(body)
        if "messages" not in body:
            raise _BadRequest("messages is required", param="messages")
        max_tokens = _opt_int_field(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", DEFAULT_CHAT_MAX_TOKENS)
        agp = body.get("add_generation_prompt", True)
        if not isinstance(agp, bool):
            raise _BadRequest("add_generation_prompt must be a boolean",
                              param="add_generation_prompt")
        ids = await _tokenize(engine.tokenize_chat, body["messages"], add_generation_prompt=agp,
                              tools=body.get("tools"),
                              chat_template_kwargs=body.get("chat_template_kwargs"))
        cid = f"chatcmpl-{_request_id(request, body)}"
        created, model = int(time.time()), engine.model
        gen = _start(ids, max_tokens, cid)

        if not stream:
            toks = await _collect(request, gen)
            if toks is None:  # the client is gone: nobody reads the answer
                return Response(status_code=499)
            resp = {"id": cid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0,
                                 "message": {"role": "assistant",
                                             "content": engine.detokenize(toks),
                                             "tool_calls": []},
                                 "logprobs": None, "finish_reason": gen.finish_reason,
                                 "stop_reason": None}],
                    "usage": _usage(gen), "prompt_logprobs": None}
            return JSONResponse(resp, headers=_orca(request))

        def chunk(delta: Dict[str, Any], finish: Optional[str]) -> Dict[str, Any]:
            c = {"id": cid, "object": "chat.completion.chunk", "created": created,
                 "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}]}
            if include_usage and continuous:
                c["usage"] = _usage(gen)
            return c

        async def events() -> AsyncIterator[bytes]:
            try:
                yield _sse(chunk({"role": "assistant", "content": ""}, None))
                i = 0
                async for tok in gen:
                    i += 1
                    yield _sse(chunk({"content": engine.token_text(tok)},
                                     "length" if i == max_tokens else None))
                if include_usage:
                    yield _sse({"id": cid, "object": "chat.completion.chunk",
                                "created": created, "model": model, "choices": [],
                                "usage": _usage(gen)})
                yield b"data: [DONE]\n\n"
            finally:
                await gen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        """vLLM's ``/tokenize``: ``prompt`` or ``messages`` -> ``{"count", "max_model_len",
        "tokens", "token_strs"}``."""
        body = await _body(request)
        _check_model(body)
        if "messages" in body:
            agp = body.get("add_generation_prompt", True)
            ids = await _tokenize(engine.tokenize_chat, body["messages"],
                                  add_generation_prompt=bool(agp), tools=body.get("tools"),
                                  chat_template_kwargs=body.get("chat_template_kwargs"))
        elif "prompt" in body:
            ids = await _tokenize(engine.tokenize_completion, body["prompt"])
        else:
            raise _BadRequest("prompt or messages is required")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": None}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{
            "id": engine.model, "object": "model", "created": int(time.time()),
            "owned_by": "vllm", "root": engine.model, "parent": None,
            "max_model_len": engine.max_model_len, "permission": []}]}

    @app.get("/health")
    async def health() -> Any:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Any:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/standin/stats")
    async def standin_stats() -> Any:
        """Stand-in only (vLLM has no such route)."""
        out = engine.stats()
        out["request_ids"] = engine.served_request_ids()
        return out

    return app
