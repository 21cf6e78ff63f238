"""``kvroute serve`` in prefill/decode disaggregation (kvroute.serving.pd) against engine
STAND-INS: FastAPI apps on loopback that implement the engines' PD request contract (vLLM's
NIXL connector: the prefill answers with ``kv_transfer_params`` that the decode request must
carry; SGLang's bootstrap fields on both requests). No real engine runs here."""

from __future__ import annotations

import json

import httpx
import pytest
from _util import require

fastapi = require("fastapi")
require("uvicorn")

from _util import UvicornThread, wait_for  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from kvroute.config import load_config  # noqa: E402
from kvroute.fastapi import create_app as create_pd_app  # noqa: E402
from kvroute.serving.pd import PREFILL_KV_TRANSFER_PARAMS  # noqa: E402

KV_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
             "remote_engine_id": "prefill-engine-0", "remote_block_ids": [[3, 4, 5]],
             "remote_host": "10.0.0.9", "remote_port": 5600, "tp_size": 1}


class Engine:
    """A stand-in engine: records every request body and its headers; a prefill answers with
    KV_PARAMS, a decode streams three SSE chunks (or one JSON answer)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.bodies: list = []
        self.headers: list = []
        app = fastapi.FastAPI()

        @app.post("/v1/completions")
        async def completions(request: fastapi.Request):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            if self.role == "prefill":
                return JSONResponse({"id": "p", "choices": [{"text": "x", "index": 0}],
                                     "kv_transfer_params": KV_PARAMS})
            if body.get("stream"):
                async def gen():
                    for i in range(3):
                        yield f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(gen(), media_type="text/event-stream")
            return JSONResponse({"id": "d", "choices": [{"text": "decoded", "index": 0}]})

        self.server = UvicornThread(app)
        self.url = self.server.url


@pytest.fixture
def engines():
    p, d = Engine("prefill"), Engine("decode")
    yield p, d
    p.server.stop()
    d.server.stop()


def serve(cfg, **kw) -> UvicornThread:
    return UvicornThread(create_pd_app(load_config(cfg), **kw))


PROMPT = list(range(1000, 1064))


def test_vllm_prefill_then_decode_with_kv_transfer_params_streamed(engines):
    p, d = engines
    front = serve({"mode": {"type": "vllm_prefill_decode", "prefill_urls": [[p.url, None]],
                            "decode_urls": [d.url]},
                   "policy": "round_robin"})
    try:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 20, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", front.url + "/v1/completions", json=body,
                          headers={"x-request-id": "req-7"}, timeout=10) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-kvroute-prefill-worker"] == p.url
            chunks = b"".join(r.iter_raw()).decode()
        assert [ln for ln in chunks.split("\n\n") if ln][:3] == [
            f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}" for i in range(3)]
        assert chunks.rstrip().endswith("data: [DONE]")
        (pre,), (dec,) = p.bodies, d.bodies
        assert pre["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
        assert (pre["stream"], pre["max_tokens"]) == (False, 1)
        assert "stream_options" not in pre and pre["prompt"] == PROMPT
        assert dec["kv_transfer_params"] == KV_PARAMS  # as the prefill answered, unchanged
        assert (dec["stream"], dec["max_tokens"]) == (True, 20)
        assert dec["stream_options"] == {"include_usage": True}
        assert p.headers[0]["x-request-id"] == d.headers[0]["x-request-id"] == "req-7"
        pdr = front.app.state.kvroute_pd_router
        wait_for(lambda: all(w["inflight_requests"] == 0
                             for pool in pdr.stats().values()
                             for w in pool["workers"].values()), "the load to be released")
    finally:
        front.stop()


def test_sglang_bootstrap_fields_go_to_both_workers(engines):
    p, d = engines
    front = serve({"mode": {"type": "prefill_decode", "prefill_urls": [[p.url, 8998]],
                            "decode_urls": [d.url]}, "policy": "round_robin"})
    try:
        r = httpx.post(front.url + "/v1/completions",
                       json={"model": "m", "prompt": PROMPT, "max_tokens": 5}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        (pre,), (dec,) = p.bodies, d.bodies
        assert pre == dec
        assert (dec["bootstrap_host"], dec["bootstrap_port"]) == ("127.0.0.1", 8998)
        assert isinstance(dec["bootstrap_room"], int) and "kv_transfer_params" not in dec
    finally:
        front.stop()


def test_uncached_token_threshold_skips_the_prefill_pool(engines):
    p, d = engines
    front = serve({"mode": {"type": "pd_disaggregation", "prefill_urls": [p.url],
                            "decode_urls": [d.url]}, "policy": "round_robin"},
                  pd_uncached_token_threshold=10_000)
    try:
        r = httpx.post(front.url + "/v1/completions",
                       json={"model": "m", "prompt": PROMPT, "max_tokens": 5}, timeout=10)
        assert r.status_code == 200 and "x-kvroute-prefill-worker" not in r.headers
        assert p.bodies == [] and "kv_transfer_params" not in d.bodies[0]
    finally:
        front.stop()


def test_an_unreachable_prefill_pool_answers_503_and_releases_the_load(engines):
    p, d = engines
    p.server.stop()
    front = serve({"mode": {"type": "vllm_prefill_decode", "prefill_urls": [[p.url, None]],
                            "decode_urls": [d.url]}, "policy": "round_robin"})
    try:
        r = httpx.post(front.url + "/v1/completions",
                       json={"model": "m", "prompt": PROMPT}, timeout=10)
        assert r.status_code == 503
        assert "no prefill worker reachable" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert d.bodies == []
        st = front.app.state.kvroute_pd_router.stats()
        assert all(w["inflight_requests"] == 0 for w in st["decode"]["workers"].values())
    finally:
        front.stop()


def test_sglang_meta_info_cached_tokens_reach_the_prefill_pool():
    """SGLang's native shape (``meta_info.cached_tokens``, every SSE chunk carrying it) in
    the prefill answer, JSON and streamed: reported to the prefill pool's Router."""
    app = fastapi.FastAPI()

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        body = await request.json()
        meta = {"prompt_tokens": len(body["prompt"]), "cached_tokens": 32}
        if body.get("stream"):
            async def gen():
                for i in range(2):
                    yield f"data: {json.dumps({'text': f't{i}', 'meta_info': meta})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return JSONResponse({"text": "x", "meta_info": meta})

    p, d = UvicornThread(app), Engine("decode")
    front = serve({"mode": {"type": "prefill_decode", "prefill_urls": [[p.url, 8998]],
                            "decode_urls": [d.url]}, "policy": "round_robin"})
    try:
        reports: list = []
        pdr = front.app.state.kvroute_pd_router
        pdr.hit_rate["prefill"].listeners.append(reports.append)
        r = httpx.post(front.url + "/v1/completions",
                       json={"model": "m", "prompt": PROMPT, "max_tokens": 5}, timeout=10)
        assert r.status_code == 200
        with httpx.stream("POST", front.url + "/v1/completions", timeout=10,
                          json={"model": "m", "prompt": PROMPT, "stream": True}) as s:
            assert s.status_code == 200
            b"".join(s.iter_raw())
        wait_for(lambda: len(reports) == 2, "both prefill answers reported")
        assert [(x.worker, x.delivered_tokens, x.engine_prompt_tokens) for x in reports] == \
            [(p.url, 32, 64)] * 2
        assert pdr.hit_rate["decode"].snapshot()["reports"] == 0
    finally:
        front.stop()
        p.stop()
        d.server.stop()
