"""Operator features of `kvroute serve` on loopback: tenants and API keys, per-tenant limits,
admin routes. kvroute is served by uvicorn on a real port (`kvroute.fastapi.create_app` from
a config mapping) in front of echo engine stand-ins (a small FastAPI app per engine, also on
a real port, answering OpenAI-shaped completions with the header fields it received), and
real httpx clients talk to it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from typing import Any, Dict, List

import pytest
from _util import require, require_executable

fastapi = require("fastapi")
require("uvicorn")
httpx = require("httpx")
require("prometheus_client")

from _util import TIMEOUT, UvicornThread, wait_for  # noqa: E402
from fastapi import Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvroute.config import ConfigError, load_config  # noqa: E402
from kvroute.fastapi import create_app  # noqa: E402
from kvroute.serving.auth import TokenBucket  # noqa: E402
from kvroute.serving.response_cache import ResponseCache  # noqa: E402

MODEL = "stand-in/model"


# -- the engine stand-in ---------------------------------------------------------------------

def echo_engine(name: str) -> Any:
    """An OpenAI-shaped engine: ``/v1/completions`` and ``/v1/chat/completions`` answer with
    the request's header fields and body; a body ``"delay_s"`` holds the answer that long;
    ``"stream": true`` answers with 3 SSE events and ``[DONE]``; ``/v1/embeddings`` answers
    `bag_of_words` of its ``input``. Every answer carries ``n``,
    the engine's request count so far (two real answers never have the same bytes)."""
    app = fastapi.FastAPI()
    app.state.seen = []

    async def answer(request: Request) -> Any:
        body = await request.json()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers.raw}
        app.state.seen.append({"headers": headers, "body": body})
        await asyncio.sleep(float(body.get("delay_s", 0)))
        if body.get("stream"):
            async def events() -> Any:
                for i in range(3):
                    event = {'engine': name, 'i': i, 'n': len(app.state.seen)}
                    yield f"data: {json.dumps(event)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"engine": name, "n": len(app.state.seen), "headers": headers,
                             "body": body,
                             "choices": [{"text": "ok", "index": 0}]})

    async def embeddings(request: Request) -> Any:
        text = (await request.json())["input"]
        return JSONResponse({"object": "list", "data": [
            {"object": "embedding", "index": 0, "embedding": bag_of_words(text)}]})

    app.post("/v1/completions")(answer)
    app.post("/v1/chat/completions")(answer)
    app.post("/v1/embeddings")(embeddings)
    return app


def bag_of_words(text: str, dims: int = 64) -> List[float]:
    """A stand-in embedding: lower-cased words (punctuation dropped) hashed into ``dims``
    counts; same words = cosine 1, unrelated words = near 0."""
    import re
    import zlib

    v = [0.0] * dims
    for w in re.findall(r"[a-z0-9]+", text.lower()):
        v[zlib.crc32(w.encode()) % dims] += 1.0
    return v


@pytest.fixture(scope="module")
def engines():
    srvs = [UvicornThread(echo_engine(f"e{i}")) for i in range(2)]
    yield srvs
    for s in srvs:
        s.stop()


KEYS = {"alpha": "sk-alpha-0123", "beta": "sk-beta-4567", "gone": "sk-gone-89ab"}
ADMIN_KEY = "sk-admin-cdef"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config(engines: List[UvicornThread], **extra: Any) -> Dict[str, Any]:
    tenants = [
        {"name": "alpha", "key": KEYS["alpha"], "allowed_models": ["stand-in/*", "llama-3-?b"],
         "trust_session_key": True},
        {"name": "beta", "key_sha256": sha(KEYS["beta"]), "allowed_models": [MODEL]},
        {"name": "gone", "key": KEYS["gone"], "revoked": True},
    ]
    return {"mode": {"type": "regular", "worker_urls": [e.url for e in engines]},
            "policy": {"type": "consistent_hash"},
            "serving": {"model": MODEL, "orca": "off"},
            "tenants": tenants, "admin": {"key": ADMIN_KEY, "protect_metrics": True},
            **extra}


def serve(cfg: Dict[str, Any]) -> UvicornThread:
    return UvicornThread(create_app(cfg))


def bearer(key: str) -> Dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def body(**extra: Any) -> Dict[str, Any]:
    return {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4, **extra}


@pytest.fixture(scope="module")
def kv(engines):
    srv = serve(config(engines))
    client = httpx.Client(base_url=srv.url, timeout=TIMEOUT)
    yield srv, client
    client.close()
    srv.stop()


def samples(text: str) -> Dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# -- config ----------------------------------------------------------------------------------

def test_plaintext_keys_are_hashed_at_load_and_not_kept(engines):
    cfg = load_config(config(engines))
    alpha = cfg.tenants[0]
    assert alpha.key_sha256 == sha(KEYS["alpha"])
    assert KEYS["alpha"] not in repr(cfg.model_dump())
    assert cfg.admin.key_sha256 == sha(ADMIN_KEY)
    assert ADMIN_KEY not in repr(cfg.model_dump())


def test_example_config_loads():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "router-tenants.yaml")
    assert [t.name for t in cfg.tenants] == ["team-a", "batch-jobs"]
    assert cfg.tenants[0].key_sha256 == sha("sk-team-a-change-me")
    assert cfg.admin.key_sha256 == sha("sk-admin-change-me")
    assert cfg.response_cache.max_entries == 4096


def test_bad_tenant_config_is_refused(engines):
    base = config(engines)
    for bad in ({"name": "x"},                                   # no key
                {"name": "x", "key": "a", "key_sha256": sha("a")},  # both
                {"name": "x", "key_sha256": "abc"},              # not a SHA-256 hex
                {"name": "x", "key": "a", "rate_limit_rps": 0},
                {"name": "x", "key": "a", "colour": "red"}):
        with pytest.raises(ConfigError):
            load_config({**base, "tenants": [bad]})
    with pytest.raises(ValueError, match="twice"):
        create_app({**base, "tenants": [{"name": "x", "key": "a"}, {"name": "x", "key": "b"}]})


# -- keys --------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models"])
def test_public_routes_need_a_valid_tenant_key(kv, path):
    _, client = kv
    payload = body() if path == "/v1/completions" else {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    send = (lambda **kw: client.get(path, **kw)) if path == "/v1/models" else (
        lambda **kw: client.post(path, json=payload, **kw))
    for headers in ({}, bearer("sk-wrong"), {"Authorization": f"Basic {KEYS['alpha']}"},
                    {"Authorization": "Bearer"}, bearer(KEYS["gone"]), bearer(ADMIN_KEY)):
        r = send(headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "AuthenticationError"
    r = send(headers=bearer(KEYS["alpha"]))
    assert r.status_code == 200, r.text


def test_authorization_is_not_forwarded_the_tenant_name_is(kv):
    _, client = kv
    r = client.post("/v1/completions", json=body(),
                    headers={**bearer(KEYS["beta"]), "x-kvroute-tenant": "alpha"})
    assert r.status_code == 200, r.text
    seen = r.json()["headers"]
    assert "authorization" not in seen
    assert seen["x-kvroute-tenant"] == "beta"  # the client's own value is dropped


def test_health_stays_open(kv):
    _, client = kv
    assert client.get("/health").status_code == 200


def test_admin_routes_need_the_admin_key(kv):
    _, client = kv
    for method, path in (("GET", "/workers"), ("POST", "/v1/explain"), ("GET", "/metrics")):
        kw: Dict[str, Any] = {"json": body()} if method == "POST" else {}
        for headers in ({}, bearer(KEYS["alpha"]), bearer("nope")):
            r = client.request(method, path, headers=headers, **kw)
            assert r.status_code == 401, (path, headers, r.text)
        r = client.request(method, path, headers=bearer(ADMIN_KEY), **kw)
        assert r.status_code == 200, (path, r.text)


def test_admin_routes_are_closed_with_tenants_but_no_admin_key(engines):
    cfg = config(engines)
    del cfg["admin"]
    srv = serve(cfg)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            assert c.get("/workers", headers=bearer(KEYS["alpha"])).status_code == 403
            assert c.get("/metrics").status_code == 200  # not protected without admin
    finally:
        srv.stop()


def test_without_tenants_everything_is_open_and_authorization_forwarded(engines):
    cfg = config(engines)
    del cfg["tenants"], cfg["admin"]
    srv = serve(cfg)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", json=body(), headers=bearer("engine-key"))
            assert r.status_code == 200
            assert r.json()["headers"]["authorization"] == "Bearer engine-key"
            assert c.get("/workers").status_code == 200
    finally:
        srv.stop()


# -- models ----------------------------------------------------------------------------------

def test_allowed_models_with_wildcards(kv):
    _, client = kv
    for model, alpha, beta in ((MODEL, 200, 200), ("stand-in/other", 200, 403),
                               ("llama-3-8b", 200, 403), ("llama-3-70b", 403, 403),
                               ("other", 403, 403)):
        for tenant, want in (("alpha", alpha), ("beta", beta)):
            r = client.post("/v1/completions", json=body(model=model),
                            headers=bearer(KEYS[tenant]))
            assert r.status_code == want, (tenant, model, r.text)
            if want == 403:
                assert r.json()["error"]["type"] == "PermissionDeniedError"


# -- session keys ------------------------------------------------------------------------------

def test_untrusted_tenants_cannot_steer_the_hashing_policy(kv, engines):
    """consistent_hash over 2 workers: a trusted tenant's x-session-id picks the worker; an
    untrusted tenant's is ignored (the same prompt always lands on one worker)."""
    _, client = kv

    def workers(tenant: str) -> set:
        out = set()
        for i in range(24):
            r = client.post("/v1/completions", json=body(),
                            headers={**bearer(KEYS[tenant]), "x-session-id": f"s{i}"})
            assert r.status_code == 200
            out.add(r.headers["x-kvroute-worker"])
        return out

    assert len(workers("alpha")) == 2
    assert len(workers("beta")) == 1


# -- limits ----------------------------------------------------------------------------------

def test_token_bucket_unit():
    now = [0.0]
    b = TokenBucket(2.0, 3, clock=lambda: now[0])
    assert [b.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take() == pytest.approx(0.5)
    now[0] = 0.5
    assert b.take() == 0.0
    now[0] = 100.0  # capped at capacity
    assert [b.take() == 0.0 for _ in range(4)] == [True, True, True, False]


def _hammer(url: str, key: str, seconds: float, threads: int, payload: Dict[str, Any]) -> list:
    """``threads`` clients sending back to back for ``seconds``; returns (time the request
    was sent, status, headers). Each client connects first (a ``GET /health``) and all start
    together: a bucket that is full while connections are still being made caps its refill,
    which the span of send times would count."""
    out: list = []
    lock = threading.Lock()
    deadline: list = []
    start = threading.Barrier(threads, action=lambda: deadline.append(time.monotonic() + seconds))

    def run() -> None:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            c.get("/health")
            start.wait()
            stop = deadline[0]
            while (sent := time.monotonic()) < stop:
                r = c.post("/v1/completions", json=payload, headers=bearer(key))
                with lock:
                    out.append((sent, r.status_code, r.headers))

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def test_rate_limit_under_concurrency_is_accurate(engines):
    rps, burst, seconds = 20.0, 5, 3.0
    cfg = config(engines)
    cfg["tenants"] = [{"name": "alpha", "key": KEYS["alpha"], "rate_limit_rps": rps,
                       "burst": burst},
                      {"name": "beta", "key": KEYS["beta"], "rate_limit_rps": rps,
                       "burst": burst}]
    srv = serve(cfg)
    try:
        # One request first (on beta's bucket, full again long before it is checked): the
        # server's first completion pays its cold start, and a hammer whose first requests
        # wait on it would start the bucket's refill after the first send is timed.
        assert httpx.post(f"{srv.url}/v1/completions", json=body(), headers=bearer(KEYS["beta"]),
                          timeout=TIMEOUT).status_code == 200
        res = _hammer(srv.url, KEYS["alpha"], seconds, 8, body())
        # The bucket refills over the span between the first and the last request sent,
        # except what it cannot hold: while no request arrives for longer than it takes to
        # fill (burst / rps; the server stalled, e.g. a loaded machine), the refill past a
        # full bucket is lost, as a token bucket should.
        sent = sorted(t for t, _, _ in res)
        elapsed = sent[-1] - sent[0]
        lost = sum(max(0.0, b - a - burst / rps) * rps for a, b in zip(sent, sent[1:]))
        ok = sum(1 for _, s, _ in res if s == 200)
        limited = [h for _, s, h in res if s == 429]
        assert {s for _, s, _ in res} <= {200, 429}
        assert limited and all(int(h["retry-after"]) >= 1 for h in limited)
        expected = burst + rps * elapsed - lost
        print(f"token bucket: {ok} admitted of {len(res)} in {elapsed:.2f} s, expected "
              f"{expected:.1f} ({(ok - expected) / expected:+.1%}; refill lost to gaps in the "
              f"requests {lost:.1f})")
        assert abs(ok - expected) <= 0.1 * expected
        # independent buckets: beta's is still full
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            got = [c.post("/v1/completions", json=body(), headers=bearer(KEYS["beta"]))
                   .status_code for _ in range(burst)]
        assert got == [200] * burst
    finally:
        srv.stop()


def test_concurrency_limit(engines):
    limit = 3
    cfg = config(engines)
    cfg["tenants"] = [{"name": "alpha", "key": KEYS["alpha"], "max_concurrent": limit}]
    srv = serve(cfg)
    try:
        async def main() -> list:
            async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT) as c:
                rs = await asyncio.gather(*[
                    c.post("/v1/completions", json=body(delay_s=1.0, stream=bool(i % 2)),
                           headers=bearer(KEYS["alpha"])) for i in range(10)])
                after = await c.post("/v1/completions", json=body(),
                                     headers=bearer(KEYS["alpha"]))
                return [r.status_code for r in rs] + [after.status_code], rs

        codes, rs = asyncio.run(main())
        assert codes[:-1].count(200) == limit, codes
        assert codes[:-1].count(429) == 10 - limit, codes
        assert all(r.headers["retry-after"] == "1" for r in rs if r.status_code == 429)
        assert codes[-1] == 200  # slots (streams included) are given back
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            m = samples(c.get("/metrics", headers=bearer(ADMIN_KEY)).text)
        assert m[("kvroute_tenant_requests_total",
                  (("outcome", "concurrency"), ("tenant", "alpha")))] == 10 - limit
        assert m[("kvroute_tenant_requests_total",
                  (("outcome", "2xx"), ("tenant", "alpha")))] == limit + 1
    finally:
        srv.stop()


def test_tenant_metrics_count_refusals(kv):
    _, client = kv
    client.post("/v1/completions", json=body(), headers=bearer("nope"))
    client.post("/v1/completions", json=body(), headers=bearer(KEYS["gone"]))
    client.post("/v1/completions", json=body(model="x"), headers=bearer(KEYS["beta"]))
    m = samples(client.get("/metrics", headers=bearer(ADMIN_KEY)).text)
    assert m[("kvroute_tenant_requests_total", (("outcome", "bad_key"), ("tenant", "")))] >= 1
    assert m[("kvroute_tenant_requests_total",
              (("outcome", "revoked"), ("tenant", "gone")))] >= 1
    wait_for(lambda: ("kvroute_tenant_requests_total",
                      (("outcome", "4xx"), ("tenant", "beta"))) in samples(
        client.get("/metrics", headers=bearer(ADMIN_KEY)).text), "beta's 403 counted")


# -- admin API -------------------------------------------------------------------------------

def test_decision_log_is_a_bounded_ring_with_tenants_and_scores(engines):
    srv = UvicornThread(create_app(config(engines), decision_log_size=5))
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            for _ in range(4):
                assert c.post("/v1/completions", json=body(),
                              headers=bearer(KEYS["alpha"])).status_code == 200
            for _ in range(3):
                assert c.post("/v1/chat/completions", headers=bearer(KEYS["beta"]), json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                ).status_code == 200
            assert c.get("/admin/decisions", headers=bearer(KEYS["alpha"])).status_code == 401
            # built from a mapping: no file to reload
            assert c.post("/admin/reload", headers=bearer(ADMIN_KEY)).status_code == 409
            r = c.get("/admin/decisions", headers=bearer(ADMIN_KEY)).json()
            assert r["size"] == 5 and r["recorded"] == 7
            d = r["decisions"]
            assert [e["tenant"] for e in d] == ["alpha", "alpha", "beta", "beta", "beta"]
            assert [e["path"] for e in d][-1] == "/v1/chat/completions"
            ids = [e["decision_id"] for e in d]
            assert ids == sorted(ids) and len(set(ids)) == 5
            rids = [e["request_id"] for e in d]  # each request's generated x-request-id
            assert all(isinstance(r, str) for r in rids) and len(set(rids)) == 5
            urls = {e.url for e in engines}
            for e in d:
                assert e["policy"] == "consistent_hash" and e["reason"] and not e["fallback"]
                assert e["worker"] in urls
                assert e["matched_tokens"] == 0 and e["time"] <= time.time()
                assert {s["worker"] for s in e["scores"]} == urls
            assert c.get("/admin/decisions", params={"tenant": "alpha", "limit": 1},
                         headers=bearer(ADMIN_KEY)).json()["decisions"] == d[1:2]
    finally:
        srv.stop()


def test_workers_added_and_removed_at_run_time_without_dropping_requests(engines):
    cfg = config(engines[:1])
    srv = serve(cfg)
    e0, e1 = engines[0].url, engines[1].url
    try:
        async def main() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT) as c:
                admin = bearer(ADMIN_KEY)
                r = await c.post("/admin/workers", json={"url": e1}, headers=bearer(KEYS["alpha"]))
                assert r.status_code == 401
                r = await c.post("/admin/workers", json={"url": "ftp://x"}, headers=admin)
                assert r.status_code == 400
                r = await c.post("/admin/workers", json={"url": e1}, headers=admin)
                assert r.status_code == 201 and r.json()["workers"] == [e0, e1]
                assert (await c.post("/admin/workers", json={"url": e1},
                                     headers=admin)).status_code == 400  # duplicate
                # requests in flight on e0 (streams and not) while e0 is removed
                slow = [asyncio.ensure_future(c.post(
                    "/v1/completions", json=body(delay_s=0.6, stream=bool(i % 2)),
                    headers={**bearer(KEYS["alpha"]), "x-session-id": f"s{i}"}))
                    for i in range(16)]
                await asyncio.sleep(0.2)
                r = await c.delete(f"/admin/workers/{e0}", headers=admin)
                assert r.status_code == 200 and r.json()["workers"] == [e1]
                assert (await c.delete(f"/admin/workers/{e0}", headers=admin)).status_code == 404
                done = await asyncio.gather(*slow)
                assert [x.status_code for x in done] == [200] * 16
                assert {x.headers["x-kvroute-worker"] for x in done} == {e0, e1}
                for x in done:
                    if x.headers["content-type"].startswith("text/event-stream"):
                        assert x.text.endswith("data: [DONE]\n\n")
                after = [await c.post("/v1/completions", json=body(),
                                      headers={**bearer(KEYS["alpha"]), "x-session-id": f"s{i}"})
                         for i in range(8)]
                assert {x.headers["x-kvroute-worker"] for x in after} == {e1}
                w = (await c.get("/workers", headers=admin)).json()["workers"]
                assert list(w) == [e1] and w[e1]["inflight_requests"] == 0

        asyncio.run(main())
    finally:
        srv.stop()


def test_mutating_admin_routes_need_a_configured_admin_key(engines):
    cfg = config(engines)
    del cfg["tenants"], cfg["admin"]
    srv = serve(cfg)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            assert c.post("/admin/workers", json={"url": "http://127.0.0.1:9"}).status_code == 403
            assert c.delete(f"/admin/workers/{engines[0].url}").status_code == 403
            assert c.post("/admin/reload").status_code == 403
            assert c.get("/admin/decisions").status_code == 200  # read-only: open like /workers
    finally:
        srv.stop()


def test_reload_under_load_drops_no_request(engines, tmp_path):
    import yaml

    path = tmp_path / "router.yaml"
    cfg = config(engines[:1])
    cfg["tenants"] = cfg["tenants"][:1]  # alpha only
    path.write_text(yaml.safe_dump(cfg))
    srv = UvicornThread(create_app(str(path)))
    try:
        stop = threading.Event()
        results: list = []

        def load() -> None:
            with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
                i = 0
                while not stop.is_set():
                    r = c.post("/v1/completions", json=body(delay_s=0.05, stream=bool(i % 2)),
                               headers={**bearer(KEYS["alpha"]), "x-session-id": f"s{i}"})
                    results.append((r.status_code, r.headers.get("x-kvroute-worker")))
                    i += 1

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            assert c.post("/v1/completions", json=body(),
                          headers=bearer(KEYS["beta"])).status_code == 401
            time.sleep(0.5)
            new = config(engines[1:])           # e0 out, e1 in
            new["tenants"] = new["tenants"][:2]  # beta in
            new["policy"] = {"type": "consistent_hash", "virtual_nodes": 40}  # a knob changed
            path.write_text(yaml.safe_dump(new))
            r = c.post("/admin/reload", headers=bearer(ADMIN_KEY))
            assert r.status_code == 200, r.text
            summary = r.json()
            assert summary["workers_added"] == [engines[1].url]
            assert summary["workers_removed"] == [engines[0].url]
            assert summary["tenants"] == ["alpha", "beta"]
            assert "ConsistentHash" in summary["policy"] and not summary["not_applied"]
            time.sleep(0.5)
            assert c.post("/v1/completions", json=body(),
                          headers=bearer(KEYS["beta"])).status_code == 200
            # a broken file changes nothing
            path.write_text("mode: {type: regular, worker_urls: 7}\n")
            assert c.post("/admin/reload", headers=bearer(ADMIN_KEY)).status_code == 400
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join()
        codes = [s for s, _ in results]
        print(f"reload under load: {len(codes)} requests, "
              f"{sum(1 for s in codes if s != 200)} failed")
        assert codes and all(s == 200 for s in codes)
        workers = [w for _, w in results]
        assert workers[0] == engines[0].url and workers[-1] == engines[1].url
    finally:
        srv.stop()


# -- response cache ----------------------------------------------------------------------------

def test_response_cache_unit_lru_ttl_and_bounds():
    now = [0.0]
    c = ResponseCache(max_entries=2, max_bytes=10, ttl_s=5.0, clock=lambda: now[0])
    h = [(b"content-type", b"application/json"), (b"x-kvroute-worker", b"w")]
    assert c.put("a", 200, h, [b"aaa"], False) and c.put("b", 200, h, [b"bbb"], False)
    assert c.get("a").headers == h[:1]  # kvroute's own fields not stored; a is now recent
    assert c.put("c", 200, h, [b"ccc"], False)  # evicts b, the least recently used
    assert c.get("b") is None and c.get("a") is not None
    assert not c.put("big", 200, h, [b"x" * 11], False)  # larger than max_bytes
    assert not c.put("err", 500, h, [b"x"], False)
    c.put("d", 200, h, [b"dddd"], False)  # 3 entries > 2: c (least recent) dropped
    assert len(c) == 2 and c.nbytes == 7
    c.put("e", 200, h, [b"eeeeee"], False)  # 3 + 4 + 6 bytes > 10: a dropped
    assert c.nbytes == 10 and c.get("a") is None and len(c) == 2
    now[0] = 100.0
    assert c.get("e") is None and len(c) == 1  # expired, and dropped
    assert (c.hits, c.misses) == (2, 3)
    assert c.cacheable({"temperature": 0}) and c.cacheable({"seed": 3})
    assert not c.cacheable({}) and not c.cacheable({"temperature": 0.7})
    assert not c.cacheable({"temperature": 0, "n": 2}) and not c.cacheable({"seed": True})
    assert ResponseCache(deterministic_only=False).cacheable({"temperature": 0.7})
    assert c.key("alpha", "/v1/completions", {"a": 1, "b": 2}) == \
        c.key("alpha", "/v1/completions", {"b": 2, "a": 1})
    assert c.key("alpha", "/v1/completions", {"a": 1}) != c.key("beta", "/v1/completions",
                                                                 {"a": 1})


@pytest.fixture(scope="module")
def cached(engines):
    srv = serve(config(engines, response_cache={"max_entries": 64, "ttl_s": 60}))
    client = httpx.Client(base_url=srv.url, timeout=TIMEOUT)
    yield srv, client
    client.close()
    srv.stop()


def _engine_calls(engines) -> int:
    return sum(len(e.app.state.seen) for e in engines)


@pytest.mark.parametrize("stream", [False, True])
def test_cache_hit_replays_the_answer_byte_for_byte(cached, engines, stream):
    _, client = cached
    req = body(temperature=0, stream=stream, prompt=[9, 9, int(stream)])
    first = client.post("/v1/completions", json=req, headers=bearer(KEYS["alpha"]))
    assert first.status_code == 200 and first.headers["x-kvroute-cache"] == "miss"
    calls = _engine_calls(engines)
    second = client.post("/v1/completions", json=req, headers=bearer(KEYS["alpha"]))
    assert second.status_code == 200 and second.headers["x-kvroute-cache"] == "hit"
    assert second.content == first.content
    assert second.headers["content-type"] == first.headers["content-type"]
    assert "x-kvroute-worker" not in second.headers
    assert _engine_calls(engines) == calls  # no engine saw it
    if stream:
        assert first.headers["content-type"].startswith("text/event-stream")
        assert second.text.endswith("data: [DONE]\n\n")


def test_cache_has_no_cross_tenant_hits(cached):
    _, client = cached
    req = body(seed=11, prompt=[7, 7, 7])
    a = client.post("/v1/completions", json=req, headers=bearer(KEYS["alpha"]))
    b = client.post("/v1/completions", json=req, headers=bearer(KEYS["beta"]))
    assert a.headers["x-kvroute-cache"] == b.headers["x-kvroute-cache"] == "miss"
    assert a.content != b.content
    b2 = client.post("/v1/completions", json=req, headers=bearer(KEYS["beta"]))
    assert b2.headers["x-kvroute-cache"] == "hit" and b2.content == b.content


def test_sampled_requests_are_not_cached(cached, engines):
    _, client = cached
    calls = _engine_calls(engines)
    for _ in range(2):
        r = client.post("/v1/completions", json=body(temperature=0.8),
                        headers=bearer(KEYS["alpha"]))
        assert r.status_code == 200 and "x-kvroute-cache" not in r.headers
    assert _engine_calls(engines) == calls + 2


def test_cache_hits_and_misses_in_metrics_and_decisions(cached):
    _, client = cached
    req = body(temperature=0, prompt=[5, 5, 5, 5])
    for _ in range(3):
        client.post("/v1/completions", json=req, headers=bearer(KEYS["beta"]))
    m = samples(client.get("/metrics", headers=bearer(ADMIN_KEY)).text)
    assert m[("kvroute_response_cache_requests_total", (("result", "hit"),))] >= 2
    assert m[("kvroute_response_cache_requests_total", (("result", "miss"),))] >= 1
    d = client.get("/admin/decisions", params={"tenant": "beta", "limit": 2},
                   headers=bearer(ADMIN_KEY)).json()["decisions"]
    assert [e.get("cache") for e in d] == ["hit", "hit"] and d[0]["worker"] is None


# -- unix-domain-socket engines ----------------------------------------------------------------

class UdsServer:
    """An ASGI app served by uvicorn on a unix socket in a daemon thread."""

    def __init__(self, app: Any, path: str) -> None:
        import uvicorn

        self.path = path
        self.server = uvicorn.Server(uvicorn.Config(app, uds=path, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), "uvicorn on uds")
        assert self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT)


def test_unix_socket_workers(engines, tmp_path):
    sock = str(tmp_path / "engine.sock")
    uds = UdsServer(echo_engine("uds"), sock)
    url = f"unix://{sock}"
    cfg = config(engines[:1])
    del cfg["tenants"], cfg["admin"]
    cfg["mode"]["worker_urls"] = [url, engines[0].url]
    srv = serve(cfg)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            seen: Dict[str, set] = {}
            for i in range(24):
                r = c.post("/v1/completions", json=body(stream=bool(i % 2)),
                           headers={"x-session-id": f"s{i}"})
                assert r.status_code == 200, r.text
                seen.setdefault(r.headers["x-kvroute-worker"], set()).add(
                    "uds" if '"engine": "uds"' in r.text or '"engine":"uds"' in r.text
                    else "tcp")
            assert seen == {url: {"uds"}, engines[0].url: {"tcp"}}
            w = c.get("/workers").json()["workers"]
            assert w[url]["inflight_requests"] == 0 and w[url]["circuit"]["state"] == "closed"
        uds.stop()  # the socket's engine gone: its requests fail over to the TCP engine
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            for i in range(6):
                r = c.post("/v1/completions", json=body(), headers={"x-session-id": f"s{i}"})
                assert r.status_code == 200 and r.headers["x-kvroute-worker"] == engines[0].url
    finally:
        srv.stop()
        uds.stop()


def test_pd_mode_refuses_unix_socket_workers_at_startup(tmp_path):
    import yaml

    from kvroute.cli import main

    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump({"mode": {
        "type": "pd_disaggregation", "prefill_urls": ["unix:///run/prefill.sock"],
        "decode_urls": ["http://127.0.0.1:9"]}, "policy": {"type": "round_robin"}}))
    with pytest.raises(SystemExit, match=r"unix://.*prefill\.sock.*give http:// URLs"):
        main(["serve", "--config", str(path)])


@pytest.fixture
def redis_url(tmp_path):
    """A real redis-server (Debian's) on a free loopback port, no persistence."""
    import subprocess

    from _util import free_port

    require("redis")
    exe = require_executable("redis-server")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import socket

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        wait_for(up, "redis-server to listen")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(TIMEOUT)


@pytest.mark.parametrize("stream", [False, True])
def test_redis_cache_is_shared_between_router_instances(engines, redis_url, stream):
    rc = {"backend": "redis", "redis_url": redis_url, "ttl_s": 60}
    a = serve(config(engines, response_cache=rc))
    b = serve(config(engines, response_cache=rc))
    try:
        req = body(seed=3, stream=stream, prompt=[4, 2, int(stream)])
        with httpx.Client(timeout=TIMEOUT) as c:
            first = c.post(a.url + "/v1/completions", json=req, headers=bearer(KEYS["alpha"]))
            assert first.status_code == 200 and first.headers["x-kvroute-cache"] == "miss"
            calls = _engine_calls(engines)
            other = c.post(b.url + "/v1/completions", json=req, headers=bearer(KEYS["alpha"]))
            assert other.headers["x-kvroute-cache"] == "hit"
            assert other.content == first.content
            assert other.headers["content-type"] == first.headers["content-type"]
            assert _engine_calls(engines) == calls
            beta = c.post(b.url + "/v1/completions", json=req, headers=bearer(KEYS["beta"]))
            assert beta.headers["x-kvroute-cache"] == "miss" and beta.content != first.content
    finally:
        a.stop()
        b.stop()


def test_redis_down_is_a_miss_not_an_error(engines):
    require("redis")
    from _util import free_port

    rc = {"backend": "redis", "redis_url": f"redis://127.0.0.1:{free_port()}/0"}
    srv = serve(config(engines, response_cache=rc))
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            for _ in range(2):
                r = c.post("/v1/completions", json=body(temperature=0),
                           headers=bearer(KEYS["alpha"]))
                assert r.status_code == 200 and r.headers["x-kvroute-cache"] == "miss"
    finally:
        srv.stop()



def test_semantic_cache_serves_similar_prompts_with_the_similarity(engines):
    rc = {"semantic": {"embeddings_url": engines[0].url + "/v1/embeddings", "threshold": 0.9}}
    srv = serve(config(engines, response_cache=rc))

    def ask(text: str, tenant: str = "alpha", **extra: Any) -> Any:
        return c.post("/v1/chat/completions", headers=bearer(KEYS[tenant]), json={
            "model": MODEL, "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": text}], **extra})

    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            first = ask("What is the capital of France?")
            assert first.headers["x-kvroute-cache"] == "miss"
            near = ask("what is the capital of france")
            assert near.headers["x-kvroute-cache"] == "semantic_hit"
            assert float(near.headers["x-kvroute-cache-similarity"]) == pytest.approx(1.0)
            assert near.content == first.content
            for r in (ask("Explain quantum tunnelling to a child"),       # another question
                      ask("what is the capital of france", "beta"),       # another tenant
                      ask("what is the capital of france", max_tokens=9)):  # other params
                assert r.headers["x-kvroute-cache"] == "miss", r.headers
                assert r.content != first.content
            low = ask("Explain quantum tunnelling to an adult")
            assert low.headers["x-kvroute-cache"] == "miss"  # similar, below the threshold
            m = samples(c.get("/metrics", headers=bearer(ADMIN_KEY)).text)
            assert m[("kvroute_response_cache_requests_total",
                      (("result", "semantic_hit"),))] == 1
            assert m[("kvroute_response_cache_similarity_count", ())] >= 2
            d = c.get("/admin/decisions", headers=bearer(ADMIN_KEY)).json()["decisions"]
            assert [e["similarity"] for e in d if e.get("cache") == "semantic_hit"] == \
                [pytest.approx(1.0)]
    finally:
        srv.stop()


def test_openai_sdk_sees_its_own_error_classes(kv):
    """The OpenAI SDK (max_retries=0) maps kvroute's refusals to its error classes."""
    openai = require("openai")
    srv, _ = kv
    ok = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS["beta"], max_retries=0)
    r = ok.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    assert r.choices[0].text == "ok"
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    with pytest.raises(openai.PermissionDeniedError):
        ok.completions.create(model="other", prompt="hello", max_tokens=4)
