"""kvroute.fastapi end to end on loopback: real engine STAND-INS (`kvroute.sim.server`
subprocesses speaking vLLM's OpenAI API and publishing real KV events over ZeroMQ; vLLM itself
needs a GPU), the real Qwen3 tokenizer and chat template, kvroute served by uvicorn on a real
port, and real httpx clients. MT-Bench questions as the conversations."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest
from _util import require

fastapi = require("fastapi")
uvicorn = require("uvicorn")
httpx = require("httpx")
require("prometheus_client")

from _util import (  # noqa: E402
    TIMEOUT,
    UvicornThread,
    free_port,
    standin_engines,
    wait_for,
    wait_subscribed,
)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import kvroute  # noqa: E402
from kvroute.fastapi import create_router, proxy_of  # noqa: E402
from kvroute.prompt import PromptTokenizer  # noqa: E402
from kvroute.sim.server import DEFAULT_MODEL  # noqa: E402

MODEL = DEFAULT_MODEL
TOKEN_DELAY_S = 0.02  # stand-in engines: one output token every 20 ms


# -- helpers ----------------------------------------------------------------------------------

def serve(router: kvroute.Router, **kw: Any) -> UvicornThread:
    app = fastapi.FastAPI()
    api = create_router(router, **kw)
    app.include_router(api)
    srv = UvicornThread(app)
    srv.api = api  # type: ignore[attr-defined]
    return srv


def inflight(router: kvroute.Router) -> Dict[str, tuple]:
    return {w: (s["inflight_requests"], s["pending_prefill_tokens"])
            for w, s in router.stats()["workers"].items()}


def all_released(router: kvroute.Router) -> bool:
    return all(v == (0, 0) for v in inflight(router).values())


def metric_samples(text: str) -> Dict[tuple, float]:
    """Prometheus text -> {(sample name, sorted labels): value}, parsed by prometheus-client."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Dict[tuple, float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(qwen3: Path):
    tok = PromptTokenizer.from_dir(qwen3)
    yield tok
    tok.close()


@pytest.fixture(scope="module")
def engines(qwen3: Path):
    """Four stand-in engines, started together: three for the fleet, one to be killed."""
    with standin_engines(4, qwen3, model=MODEL, token_delay_s=TOKEN_DELAY_S) as started:
        yield started  # killed at the end: one may still be generating an abandoned answer


@pytest.fixture(scope="module")
def fleet(engines):
    return engines[:3]


@pytest.fixture(scope="module")
def kv(fleet, tokenizer):
    """kvroute (kv_aware, block size 16) in front of the 3 engines, scraping their /metrics."""
    router = kvroute.Router([e.worker() for e in fleet], block_size=16, cache_weight=0.7)
    wait_subscribed(fleet)
    srv = serve(router, tokenizer=tokenizer, model=MODEL, scrape_metrics_interval_s=0.5,
                scrape_stale_after_s=30.0)
    client = httpx.Client(base_url=srv.url, timeout=TIMEOUT)
    yield router, srv, client
    client.close()
    srv.stop()
    router.close()


def chat(messages: List[dict], **extra: Any) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}


# -- tests ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_second_turn_lands_on_the_worker_that_served_the_first(kv, mt_bench_questions):
    router, _, client = kv
    convs = [q for q in mt_bench_questions if len(q["turns"][0]) > 200][:4]
    for q in convs:
        stored = {w: s["blocks_stored"] for w, s in router.stats()["workers"].items()}
        turn1 = [{"role": "user", "content": q["turns"][0]}]
        r1 = client.post("/v1/chat/completions", json=chat(turn1))
        assert r1.status_code == 200, r1.text
        w1 = r1.headers["x-kvroute-worker"]
        answer = r1.json()["choices"][0]["message"]["content"]
        turn2 = turn1 + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": q["turns"][1]}]
        # The engine publishes the first turn's full blocks over ZeroMQ: wait until the
        # router applied them (not just its own speculative credit for w1).
        full_blocks = r1.json()["usage"]["prompt_tokens"] // 16
        wait_for(lambda w=w1, n=stored[w1] + full_blocks:
                 router.stats()["workers"][w]["blocks_stored"] >= n, "turn 1's BlockStored")
        r2 = client.post("/v1/chat/completions", json=chat(turn2),
                         headers={"x-kvroute-explain": "1"})
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-kvroute-worker"] == w1
        cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        decision = json.loads(r2.headers["x-kvroute-decision"])
        assert decision["worker"] == w1 and decision["policy"] == "kv_aware"
        assert decision["prompt_tokens"] == r2.json()["usage"]["prompt_tokens"]
        # The router saw the engine's own prefix cache: same tokens, same blocks.
        assert cached > 0 and decision["matched_tokens"] == cached
        scores = {s["worker"]: s for s in json.loads(r2.headers["x-kvroute-scores"])}
        assert set(scores) == {w.name for w in router.workers}
        assert scores[w1]["match"] > 0 and scores[w1]["score"] == max(
            s["score"] for s in scores.values())
    wait_for(lambda: all_released(router), "every decision to be released")


def _stream_bytes(url: str, path: str, body: dict, headers: dict) -> tuple:
    with httpx.Client(timeout=TIMEOUT) as c:
        with c.stream("POST", url + path, json=body, headers=headers) as r:
            return r.status_code, r.headers, b"".join(r.iter_raw())


@pytest.mark.slow
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat([{"role": "user", "content": "Name three prime numbers."}],
                                  stream=True, max_tokens=12)),
    ("/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
                         "stream": True}),
])
def test_streaming_is_passed_through_byte_for_byte(kv, fleet, path, body):
    router, srv, _ = kv
    by_url = {e.url: e for e in fleet}
    # Same request id both ways, so the stand-in's (deterministic) stream is the same; only
    # "created" (whole seconds) can differ if the two land in different seconds: retry then.
    for attempt in range(5):
        headers = {"X-Request-Id": f"bytes-{path.count('chat')}-{attempt}"}
        status, h, proxied = _stream_bytes(srv.url, path, body, headers)
        assert status == 200 and h["content-type"].startswith("text/event-stream")
        worker = h["x-kvroute-worker"]
        _, _, direct = _stream_bytes(by_url[worker].url, path, body, headers)
        assert proxied.startswith(b"data: ") and proxied.endswith(b"data: [DONE]\n\n")
        if proxied == direct:
            break
        created = re.compile(rb'"created":\d+')
        assert created.sub(b"", proxied) == created.sub(b"", direct)
    else:
        pytest.fail("proxied stream never matched the direct one")
    wait_for(lambda: all_released(router), "the streams' decisions to be released")


@pytest.mark.slow
def test_stream_is_relayed_chunk_by_chunk_and_released_on_client_disconnect(kv, fleet):
    router, srv, _ = kv
    by_url = {e.url: e for e in fleet}
    body = {"model": MODEL, "prompt": "Count slowly to a thousand: one, two, three,",
            "max_tokens": 2000, "stream": True}  # 2000 x 20 ms: the stream outlives the test
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            worker = r.headers["x-kvroute-worker"]
            chunks = r.iter_raw()  # keep it: a dropped iterator closes the response
            assert next(chunks).startswith(b"data: ")
            # The first chunk reached us while the engine is still generating: the prefill
            # part of the load is released (first_token), the request is still in flight.
            assert inflight(router)[worker] == (1, 0)
            assert httpx.get(f"{worker}/standin/stats").json()["running"] == 1
        # leaving the blocks closes the connection mid-stream
    wait_for(lambda: all_released(router), "the disconnected stream's load to be released")
    # ...and kvroute closed its upstream request, so the engine stopped generating.
    wait_for(lambda: httpx.get(f"{by_url[worker].url}/standin/stats").json()["running"] == 0,
             "the engine to abort the abandoned request")

    # A non-streaming request whose client gives up long before the answer (3000 x 20 ms =
    # 60 s, twice the poll bound): released when the client leaves, not when the engine ends.
    with httpx.Client(base_url=srv.url, timeout=1.0) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3000})
    wait_for(lambda: all_released(router), "the abandoned request's load to be released")


@pytest.mark.slow
def test_load_is_released_after_normal_streaming_and_error_responses(kv):
    router, _, client = kv
    prompt = {"model": MODEL, "prompt": "Tell me about the ocean.", "max_tokens": 4}
    ok = client.post("/v1/completions", json=prompt)
    assert ok.status_code == 200 and ok.json()["object"] == "text_completion"
    assert ok.headers["content-type"].startswith("application/json")
    with client.stream("POST", "/v1/completions", json={**prompt, "stream": True}) as r:
        assert r.status_code == 200 and b"[DONE]" in b"".join(r.iter_raw())
    # Upstream errors are passed through with their status and body.
    bad_param = client.post("/v1/completions", json={**prompt, "max_tokens": -1})
    assert bad_param.status_code == 400 and "x-kvroute-worker" in bad_param.headers
    assert bad_param.json()["error"]["code"] == 400
    unknown_model = client.post("/v1/completions", json={**prompt, "model": "no-such-model"})
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["code"] == 404
    # Bodies kvroute cannot route are refused before any worker is chosen.
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # RecursionError
    for raw in (b"{not json", b"[1, 2]", json.dumps({"model": MODEL}).encode(), deep):
        r = client.post("/v1/completions", content=raw,
                        headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
        assert "x-kvroute-worker" not in r.headers
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": "hello"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    wait_for(lambda: all_released(router), "every decision to be released")


@pytest.mark.slow
def test_metrics_workers_models_health_and_explain(kv, fleet, tokenizer):
    router, _, client = kv
    before = metric_samples(client.get("/metrics").text)
    stored = {w: s["blocks_stored"] for w, s in router.stats()["workers"].items()}
    served = []
    for i in range(3):
        # Longer than one block (16 tokens), so each prompt stores at least one full block.
        prompt = f"Metrics {i}: " + "hello there, how are you today? " * 6
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                 "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 16
        served.append(r.headers["x-kvroute-worker"])
    # This test's own BlockStored events reached the index (whatever other tests stored).
    w0 = served[0]
    wait_for(lambda: router.stats()["workers"][w0]["blocks_stored"] > stored[w0],
             "the BlockStored of the first prompt")
    m = client.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    after = metric_samples(m.text)
    assert total(after, "kvroute_decisions_total") - total(before, "kvroute_decisions_total") == 3
    assert (total(after, "kvroute_upstream_requests_total", outcome="2xx")
            - total(before, "kvroute_upstream_requests_total", outcome="2xx")) == 3
    assert total(after, "kvroute_select_latency_seconds_count") >= 3

    names = {e.url for e in fleet}
    view = client.get("/workers").json()
    assert set(view["workers"]) == names
    for w in view["workers"].values():
        assert w["state"] == "exact" and w["degraded"] is False
        assert w["circuit"]["state"] == "closed" and w["inflight_requests"] == 0
    assert view["workers"][w0]["indexed_blocks"] > 0
    # The scraper reads every engine's /metrics (vLLM names) and reports its age.
    wait_for(lambda: all((w["scrape"] or {}).get("ok") for w in
                         client.get("/workers").json()["workers"].values()),
             "a good /metrics scrape of every worker")

    models = client.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert models.headers["x-kvroute-worker"] in names
    assert client.get("/health").json() == {"status": "ok", "workers": 3, "available": 3}

    # POST /v1/explain: the decision with every worker's terms, nothing forwarded.
    body = chat([{"role": "user", "content": "Explain yourself, in detail please."}])
    served_before = {e.url: len(httpx.get(f"{e.url}/standin/stats").json()["request_ids"])
                     for e in fleet}
    ex = client.post("/v1/explain", json=body)
    assert ex.status_code == 200
    out = ex.json()
    assert out["path"] == "/v1/chat/completions"
    assert out["prompt_tokens"] == len(tokenizer.encode_request("/v1/chat/completions", body))
    assert {s["worker"] for s in out["scores"]} == names
    best = max(out["scores"], key=lambda s: s["score"])
    assert out["decision"]["worker"] in names and out["decision"]["policy"] == "kv_aware"
    assert best["score"] == next(s["score"] for s in out["scores"]
                                 if s["worker"] == out["decision"]["worker"])
    assert {e.url: len(httpx.get(f"{e.url}/standin/stats").json()["request_ids"])
            for e in fleet} == served_before
    assert client.post("/v1/explain", content=b"nope").status_code == 400
    assert all_released(router)


@pytest.fixture
def pair(engines, tokenizer):
    """A kvroute with a short breaker over two engines, the first of which gets killed."""
    victim, alive = engines[3], engines[0]
    router = kvroute.Router([victim.worker(), alive.worker()], block_size=16)
    wait_subscribed([victim, alive])
    srv = serve(router, tokenizer=tokenizer, model=MODEL, max_retries=2, breaker_failures=2,
                breaker_reset_s=600.0, connect_timeout_s=5.0)
    client = httpx.Client(base_url=srv.url, timeout=TIMEOUT)
    yield router, srv, client, (victim, alive)
    client.close()
    srv.stop()
    router.close()
    victim.kill()


@pytest.mark.slow
def test_a_killed_worker_is_routed_around_and_its_circuit_opens(pair, tokenizer,
                                                                mt_bench_questions):
    router, _, client, engines = pair
    dead, alive = engines
    # Three conversations whose first turn ran on `dead` (sent to it directly): kvroute
    # learns that from its KV events, so each second turn prefers `dead`. (The last MT-Bench
    # questions: no other test sends them, so `alive` holds none of their blocks.)
    turn2s = []
    for q in mt_bench_questions[-3:]:
        turn1 = [{"role": "user", "content": q["turns"][0]}]
        r1 = httpx.post(f"{dead.url}/v1/chat/completions", json=chat(turn1), timeout=TIMEOUT)
        assert r1.status_code == 200
        turn2s.append(turn1 + [{"role": "assistant",
                                "content": r1.json()["choices"][0]["message"]["content"]},
                               {"role": "user", "content": q["turns"][1]}])
    for t in turn2s:
        tokens = tokenizer.encode_request("/v1/chat/completions", chat(t))
        wait_for(lambda t=tokens: router.find_matches(t)[dead.url].blocks > 0,
                 "turn 1's BlockStored")  # sent directly: no speculative credit here
    dead.kill()  # SIGKILL: its index entries stay, so kv_aware still prefers it

    explain = {"x-kvroute-explain": "1"}
    for t in turn2s[:2]:  # two connect errors, each retried on the other worker
        r = client.post("/v1/chat/completions", json=chat(t), headers=explain)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-worker"] == alive.url
        assert json.loads(r.headers["x-kvroute-decision"])["attempts"] == 2
    view = client.get("/workers").json()["workers"]
    assert view[dead.url]["circuit"]["state"] == "open"
    assert view[dead.url]["circuit"]["consecutive_failures"] == 2
    assert view[alive.url]["circuit"]["state"] == "closed"
    assert client.get("/health").json()["available"] == 1
    # With the circuit open the dead worker is excluded up front: one attempt.
    r = client.post("/v1/chat/completions", json=chat(turn2s[2]), headers=explain)
    assert r.status_code == 200 and r.headers["x-kvroute-worker"] == alive.url
    assert json.loads(r.headers["x-kvroute-decision"])["attempts"] == 1
    # No scraper here: the load the engine reported came back in vLLM's ORCA header.
    assert router.stats()["workers"][alive.url]["kv_cache_usage_perc"] is not None
    m = metric_samples(client.get("/metrics").text)
    assert total(m, "kvroute_retries_total") == 2
    assert total(m, "kvroute_upstream_requests_total", worker=dead.url,
                 outcome="connect_error") == 2
    assert total(m, "kvroute_circuit_open", worker=dead.url) == 1
    wait_for(lambda: all_released(router), "every decision to be released")


def test_no_reachable_worker_gives_503_without_a_tokenizer():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    router = kvroute.Router(dead, policy="round_robin")
    srv = serve(router, tokenizer=None, model=MODEL, max_retries=5, orca=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3, 4]})
            assert r.status_code == 503
            msg = r.json()["error"]["message"]
            assert all(u in msg for u in dead)  # both tried once, then none left
            m = metric_samples(c.get("/metrics").text)
            assert total(m, "kvroute_upstream_requests_total", outcome="connect_error") == 2
            assert total(m, "kvroute_retries_total") == 1
            assert c.get("/v1/models").json()["data"][0]["id"] == MODEL  # configured fallback
        assert all_released(router)
        assert proxy_of(srv.api).breaker(dead[0]).consecutive_failures == 1
    finally:
        srv.stop()
        router.close()


@pytest.mark.slow
def test_kvroute_serve_runs_from_a_config_file(fleet, qwen3, tmp_path):
    cfg = {"mode": {"type": "regular", "workers": [
        {"url": e.url, "kv_events": e.kv_endpoint, "replay": e.replay_endpoint} for e in fleet]},
        "policy": {"type": "kv_aware", "cache_weight": 0.7}, "block_size": 16}
    path = tmp_path / "router.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path), "--host",
         "127.0.0.1", "--port", str(port), "--tokenizer", str(qwen3), "--model", MODEL,
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(healthy, "kvroute serve to answer /health", timeout=60)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=TIMEOUT,
                       json=chat([{"role": "user", "content": "Hello from kvroute serve"}]))
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-worker"] in {e.url for e in fleet}
        assert r.json()["choices"][0]["message"]["content"]
        assert set(httpx.get(f"{url}/workers").json()["workers"]) == {e.url for e in fleet}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0


@pytest.mark.slow
def test_kvroute_serve_workers_runs_replicas_on_one_port(fleet, tmp_path):
    cfg = {"mode": {"type": "regular", "workers": [
        {"url": e.url, "kv_events": e.kv_endpoint, "replay": e.replay_endpoint} for e in fleet]},
        "policy": {"type": "kv_aware"}, "block_size": 16}
    path = tmp_path / "router.yaml"
    path.write_text(json.dumps(cfg))
    port = free_port()
    shm_before = set(Path("/dev/shm").glob("kvroute-replicas-*"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path), "--host",
         "127.0.0.1", "--port", str(port), "--model", MODEL, "--workers", "2",
         "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    pids: set = set()
    try:
        def both_answered() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            try:  # a new connection each time: the kernel spreads them over the replicas
                r = httpx.get(f"{url}/health", timeout=5)
            except httpx.HTTPError:
                return False
            if r.status_code == 200:
                pids.add(int(r.headers["x-kvroute-pid"]))
            return len(pids) == 2
        wait_for(both_answered, "both kvroute serve processes to answer /health", timeout=90)
        assert proc.pid not in pids  # the replicas answer, not the parent
        dirs = [d for d in Path("/dev/shm").glob("kvroute-replicas-*") if d not in shm_before]
        assert len(dirs) == 1 or not os.access("/dev/shm", os.W_OK)  # the replicas' directory
        peers: dict = {}

        def each_sees_the_other() -> bool:
            r = httpx.get(f"{url}/workers", timeout=5)
            sl = r.json()["replicas"]["shared_load"]
            assert sl["transport"] == "file", sl
            peers[r.headers.get("x-kvroute-pid") or r.json()["replicas"]["replica_id"]] = \
                list(sl["peers"])
            return len(peers) == 2 and all(len(v) == 1 for v in peers.values())
        wait_for(each_sees_the_other, "each replica to read the other's load", timeout=60)
        for i in range(4):  # each replica routes and forwards (a new connection each time)
            r = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT,
                           json={"model": MODEL, "prompt": list(range(1, 40 + i)),
                                 "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-worker"] in {e.url for e in fleet}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0
    for pid in pids:  # the replicas are gone with the parent
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert not any(d.exists() for d in dirs)  # removed with them


def test_circuit_breaker_states():
    from kvroute.serving.breaker import CircuitBreaker

    now = [0.0]
    b = CircuitBreaker(failures=2, reset_s=10.0, clock=lambda: now[0])
    assert b.state == "closed" and b.available()
    assert b.record_failure() is False and b.available()  # 1 of 2
    b.record_success()  # consecutive failures only
    assert not b.record_failure() and b.record_failure()  # opens on the 2nd in a row
    assert b.state == "open" and not b.available() and b.snapshot()["retry_in_s"] == 10.0
    assert not b.on_dispatch()  # a straggler sent while open takes no probe slot
    assert b.ramp_from == 10.0  # the ramp starts when the circuit turns half-open
    now[0] = 10.0
    assert b.state == "half_open" and b.available()
    probe = b.on_dispatch()  # the first request in half-open state is the probe ...
    assert probe and b.available()  # ... and the others are not refused (the ramp limits them)
    assert b.record_failure() is False and b.state == "open"  # failed: another 10 s
    now[0] = 19.0
    assert not b.available()
    now[0] = 20.0
    assert b.available() and b.ramp_from == 20.0
    assert b.record_success() is True and b.state == "closed" and b.times_opened == 1
    assert b.ramp_from == 20.0  # closing keeps the ramp's start
    assert not b.on_dispatch()  # closed: no probe
    with pytest.raises(ValueError, match="failures"):
        CircuitBreaker(failures=0)
    with pytest.raises(ValueError, match="reset_s"):
        CircuitBreaker(reset_s=-1)


# -- the proxy against an in-process upstream (no engines) -------------------------------------

def echo_app() -> Any:
    """An upstream that answers /v1/completions with the header fields it received (values
    decoded as UTF-8), two Set-Cookie fields and a hop-by-hop field named in Connection."""
    from fastapi.responses import JSONResponse

    app = fastapi.FastAPI()

    @app.post("/v1/completions")
    async def echo(request: fastapi.Request) -> Any:
        await request.body()
        resp = JSONResponse({"headers": [[k.decode("latin-1"), v.decode("utf-8", "replace")]
                                         for k, v in request.headers.raw]})
        resp.raw_headers += [(b"set-cookie", b"a=1; Path=/"),
                             (b"set-cookie", b"b=2; Expires=Wed, 21 Oct 2026 07:28:00 GMT"),
                             (b"connection", b"x-up-hop"), (b"x-up-hop", b"1")]
        return resp

    return app


@pytest.fixture(scope="module")
def echo():
    srv = UvicornThread(echo_app())
    yield srv
    srv.stop()


def received(r: Any) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for k, v in r.json()["headers"]:
        out.setdefault(k.lower(), []).append(v)
    return out


def test_header_fields_are_forwarded_raw_and_hop_by_hop_ones_dropped(echo):
    router = kvroute.Router([kvroute.Worker(echo.url, dp_rank=1)], policy="round_robin")
    srv = serve(router, tokenizer=None, orca=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            for field in ("accept", "accept-encoding", "user-agent"):  # the client sends none
                del c.headers[field]
            r = c.post("/v1/completions", json={"prompt": [1, 2, 3]}, headers=[
                ("x-data-parallel-rank", "7"), ("x-title", "café".encode()),
                ("x-multi", "1"), ("x-multi", "2"),
                ("connection", "keep-alive, x-hop"), ("x-hop", "secret"),
                ("x-kvroute-explain", "1")])
            assert r.status_code == 200, r.text
            got = received(r)
            # Only the router's rank reaches the engine (vLLM would take the client's).
            assert got["x-data-parallel-rank"] == ["1"]
            assert got["x-title"] == ["café"]  # non-ASCII bytes intact, no 500
            assert got["x-multi"] == ["1", "2"]  # repeated fields kept apart
            assert "x-hop" not in got and "x-kvroute-explain" not in got
            # The body is relayed undecoded: never ask for a compression the client did not.
            assert got["accept-encoding"] == ["identity"]
            assert "user-agent" not in got and "accept" not in got
            # Response: each Set-Cookie its own field, hop-by-hop fields dropped.
            assert r.headers.get_list("set-cookie") == [
                "a=1; Path=/", "b=2; Expires=Wed, 21 Oct 2026 07:28:00 GMT"]
            assert "x-up-hop" not in r.headers
            assert r.headers["x-kvroute-worker"] == f"{echo.url}|dp=1"
            assert json.loads(r.headers["x-kvroute-decision"])["attempts"] == 1

            r = c.post("/v1/completions", json={"prompt": [1, 2, 3]},
                       headers={"accept-encoding": "gzip", "user-agent": "my-agent/1"})
            got = received(r)
            assert got["accept-encoding"] == ["gzip"] and got["user-agent"] == ["my-agent/1"]

            # Bodies that nest too deeply for json.loads are a 400, not a 500.
            deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            r = c.post("/v1/completions", content=deep,
                       headers={"content-type": "application/json"})
            assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"]
            r = c.post("/v1/explain", content=deep)
            assert r.status_code == 400
        assert all_released(router)
    finally:
        srv.stop()
        router.close()


def test_a_malformed_worker_url_counts_as_unreachable(echo):
    bad = "http://127.0.0.1:notaport"
    router = kvroute.Router([bad, echo.url], policy="round_robin")
    srv = serve(router, tokenizer=None, orca=False, breaker_failures=2, breaker_reset_s=600.0)
    proxy = proxy_of(srv.api)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            for _ in range(10):  # round robin: every other request picks `bad` first
                r = c.post("/v1/completions", json={"prompt": [1, 2, 3]})
                assert r.status_code == 200, r.text  # retried on the good worker
                assert r.headers["x-kvroute-worker"] == echo.url
                if proxy.breaker(bad).state == "open":
                    break
            assert proxy.breaker(bad).state == "open"
            m = metric_samples(c.get("/metrics").text)
            assert total(m, "kvroute_upstream_requests_total", worker=bad,
                         outcome="connect_error") == 2
            assert c.get("/health").json() == {"status": "ok", "workers": 2, "available": 1}
        assert all_released(router)
    finally:
        srv.stop()
        router.close()

    only_bad = kvroute.Router([bad], policy="round_robin")
    srv = serve(only_bad, tokenizer=None, orca=False)
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1]}, timeout=TIMEOUT)
        assert r.status_code == 503 and bad in r.json()["error"]["message"]
        assert all_released(only_bad)
    finally:
        srv.stop()
        only_bad.close()


def test_a_blocking_lmcache_lookup_runs_off_the_event_loop(echo):
    from types import SimpleNamespace

    router = kvroute.Router([echo.url], policy="round_robin")
    threads = []

    def scores(tokens: Any) -> None:  # stands in for LMCacheSource's blocking HTTP lookup
        threads.append(threading.current_thread())
        return None

    router._lmcache = SimpleNamespace(scores=scores, close=lambda: None)
    srv = serve(router, tokenizer=None, orca=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            assert c.post("/v1/completions", json={"prompt": [1, 2, 3]}).status_code == 200
            assert c.post("/v1/explain", json={"prompt": [1, 2, 3]}).status_code == 200
        assert len(threads) == 2
        assert all(t is not srv.thread for t in threads)  # not the thread running the loop
        assert all_released(router)
    finally:
        srv.stop()
        router.close()


def test_client_gone_while_sending_the_body_is_499_not_500():
    import asyncio

    from starlette.requests import Request

    from kvroute.serving.proxy import Proxy

    router = kvroute.Router(["http://127.0.0.1:1"], policy="round_robin")

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def main() -> None:
        proxy = Proxy(router, orca=False)
        try:
            scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                     "headers": [(b"content-type", b"application/json")]}
            resp = await proxy.handle(Request(scope, receive), "/v1/completions")
            assert resp.status_code == 499
            resp = await proxy.explain(Request(scope, receive))
            assert resp.status_code == 499
        finally:
            await proxy.aclose()

    try:
        asyncio.run(main())
        assert all_released(router)
    finally:
        router.close()


def test_a_stream_returned_as_the_handler_is_cancelled_is_released():
    import asyncio
    from types import SimpleNamespace

    from starlette.requests import Request

    from kvroute.serving.relay import UpstreamStream as _UpstreamStream
    from kvroute.serving.request import until_disconnect as _until_disconnect

    completed, observed, closed = [], [], []
    decision = object()
    proxy = SimpleNamespace(router=SimpleNamespace(complete=completed.append,
                                                   first_token=lambda d: None),
                            metrics=SimpleNamespace(
                                observe_upstream=lambda w, o, s: observed.append(o)))

    class Upstream:
        status_code = 200

        async def aiter_raw(self):  # never iterated here
            yield b""

        async def aclose(self) -> None:
            closed.append(True)

    async def main() -> None:
        never = asyncio.Event()

        async def receive() -> dict:  # the client stays connected
            await never.wait()
            return {"type": "http.disconnect"}

        ready = asyncio.Event()

        async def work() -> Any:
            await ready.wait()
            return _UpstreamStream(proxy, decision, "w", Upstream(), [], 0.0)

        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        outer = asyncio.ensure_future(_until_disconnect(request, work()))
        await asyncio.sleep(0.01)  # outer waits on the work and the disconnect watcher
        # The work returns its stream and, before the handler resumes, the handler is
        # cancelled (server shutdown): nobody will send that stream.
        ready.set()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer

    asyncio.run(main())
    assert completed == [decision] and observed == ["disconnect"] and closed == [True]


def test_request_bodies_decode_as_json_loads_does():
    import math

    from kvroute.serving.request import loads as _loads

    body = b'{"prompt": [1, 2], "x": 123456789012345678901234567890, "y": -0.0}'
    assert _loads(body) == json.loads(body)
    # What msgspec refuses is decoded again by json.loads: the same values, or its error.
    assert math.isnan(_loads(b'{"t": NaN}')["t"])
    assert _loads(b'{"s": "\\ud800"}') == {"s": "\ud800"}
    assert _loads('\ufeff{"a": 1}'.encode()) == json.loads('\ufeff{"a": 1}'.encode())
    with pytest.raises(json.JSONDecodeError, match="Extra data"):
        _loads(b'{"a": 1} x')


def test_forwarder_errors_read_as_the_httpx_ones_the_retry_path_handles():
    import asyncio

    import aiohttp
    import httpx

    from kvroute.serving.forward import as_httpx as _as_httpx

    conn_key = type("K", (), {"ssl": None, "host": "h", "port": 1})()
    cases = [
        (aiohttp.ClientConnectorError(conn_key, OSError(111, "refused")), httpx.ConnectError),
        (aiohttp.ConnectionTimeoutError("connect"), httpx.ConnectTimeout),
        (aiohttp.SocketTimeoutError("read"), httpx.ReadTimeout),
        (asyncio.TimeoutError(), httpx.ReadTimeout),
        (aiohttp.ServerDisconnectedError(), httpx.RemoteProtocolError),
        (aiohttp.ClientPayloadError("cut"), httpx.RemoteProtocolError),
        (aiohttp.InvalidURL("x"), httpx.InvalidURL),
    ]
    for err, want in cases:
        assert type(_as_httpx(err)) is want, err
    assert type(_as_httpx(aiohttp.ClientOSError(), reading=True)) is httpx.ReadError
    assert type(_as_httpx(aiohttp.ClientOSError())) is httpx.WriteError
