"""The proxy under engine failures, limits and every route: real HTTP on loopback, engines
are `tests/_echo_engine.py` processes (a stdlib server, SIGSTOP-able like a hung engine), kvroute
served by uvicorn through `kvroute.fastapi.create_app`."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, List

import pytest
from _util import require

fastapi = require("fastapi")
httpx = require("httpx")

from _util import UvicornThread, wait_for  # noqa: E402

from kvroute.fastapi import create_app  # noqa: E402

ECHO = str(Path(__file__).with_name("_echo_engine.py"))


class Engine:
    """One `_echo_engine.py` process."""

    def __init__(self, name: str, max_model_len: int = 4096) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, ECHO, name, str(max_model_len)],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def control(self, **kw: Any) -> None:
        httpx.post(self.url + "/control", json=kw, timeout=5).raise_for_status()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def engines(*names: str, **kw: Any) -> Iterator[List[Engine]]:
    started = [Engine(n, **kw) for n in names]
    try:
        yield started
    finally:
        for e in started:
            e.kill()


@contextlib.contextmanager
def front(workers: List[Engine], config: Any = None, **options: Any) -> Iterator[Any]:
    """kvroute (round_robin unless the config says otherwise) in front of ``workers``;
    yields an httpx.Client on it (``client.app`` is the FastAPI app)."""
    conf = {"mode": {"worker_urls": [e.url for e in workers]}, "policy": "round_robin",
            **(config or {})}
    app = create_app(conf, **options)
    try:
        with served(app) as client:
            yield client
    finally:
        app.state.kvroute_router.close()


@contextlib.contextmanager
def served(app: Any) -> Iterator[Any]:
    """``app`` on a loopback uvicorn thread; yields an httpx.Client on it (``client.app`` is
    the app)."""
    srv = UvicornThread(app)
    client = httpx.Client(base_url=srv.url, timeout=30)
    client.app = app  # type: ignore[attr-defined]
    try:
        yield client
    finally:
        client.close()
        srv.stop()


def completion(client: Any, **extra: Any) -> Any:
    return client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], **extra})


def parallel(fn: Any, n: int) -> list:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: fn(), range(n)))


FAST_HEALTH = {"failure_threshold": 2, "success_threshold": 2, "timeout_secs": 0.3,
               "check_interval_secs": 1.0}


# -- health ------------------------------------------------------------------------------------

def test_a_hung_engine_is_taken_out_within_one_health_interval_and_its_waiting_request_moves():
    health = {**FAST_HEALTH, "check_interval_secs": 5.0}
    with engines("a", "b") as (a, b), front([a, b], {"health_check": health}) as client:
        wait_for(lambda: client.get("/health").json()["available"] == 2, "both healthy")
        b.pause()  # SIGSTOP: the kernel still accepts connections, nothing answers
        t0 = time.monotonic()
        # Round robin: one of these two waits on b. After timeout_secs of waiting it asks for
        # a probe of b; b is out after its failure_threshold failed probes, and the request
        # moves to a.
        rs = parallel(lambda: completion(client), 2)
        assert [r.status_code for r in rs] == [200, 200]
        assert {r.json()["engine"] for r in rs} == {"a"}
        wait_for(lambda: client.get("/health").json()["available"] == 1, "b taken out",
                 timeout=10)
        took = time.monotonic() - t0
        # 0.3 s wait + 2 probes of 0.3 s + 1 s between them (min(1, 5 / 2)) = 1.9 s; the
        # interval is 5 s
        assert took < health["check_interval_secs"], took
        print(f"hung engine out after {took:.2f} s")
        rs = [completion(client) for _ in range(4)]
        assert [r.json()["engine"] for r in rs] == ["a"] * 4
        view = client.get("/workers").json()["workers"]
        assert view[b.url]["health"]["healthy"] is False
        assert view[a.url]["health"]["healthy"] is True
        b.resume()
        wait_for(lambda: client.get("/health").json()["available"] == 2, "b back", timeout=10)


def test_a_hung_engine_without_traffic_is_out_after_its_next_probes():
    with engines("a", "b") as (a, b), front([a, b], {"health_check": FAST_HEALTH}) as client:
        wait_for(lambda: client.get("/health").json()["available"] == 2, "both healthy")
        b.pause()
        t0 = time.monotonic()
        wait_for(lambda: client.get("/health").json()["available"] == 1, "b taken out",
                 timeout=10)
        took = time.monotonic() - t0
        # the next periodic probe within 1 s, + 0.3 s timeout + 0.5 s + 0.3 s confirmation
        assert took <= 2.1 + 1.0, took  # + slack for a loaded machine
        print(f"idle hung engine out after {took:.2f} s")
        b.resume()


def test_first_byte_timeout_retries_on_another_worker():
    with engines("slow", "fast") as (slow, fast), \
            front([slow, fast], first_byte_timeout_s=0.3) as client:
        slow.control(delay_s=3.0)
        t0 = time.monotonic()
        rs = [completion(client) for _ in range(2)]  # round robin: one starts on slow
        assert [r.status_code for r in rs] == [200, 200]
        assert {r.json()["engine"] for r in rs} == {"fast"}
        assert time.monotonic() - t0 < 2.5
    with engines("slow") as (slow,), front([slow], first_byte_timeout_s=0.3) as client:
        slow.control(delay_s=3.0)
        r = completion(client)
        assert r.status_code == 504 and r.json()["error"]["code"] == 504


def test_5xx_and_429_are_retried_with_backoff_and_passed_through_when_nobody_is_left():
    with engines("a", "b") as (a, b), front([a, b], max_retries=2) as client:
        a.control(fail=[503, 429, 500])
        rs = [completion(client) for _ in range(6)]
        assert [r.status_code for r in rs] == [200] * 6
        assert {r.json()["engine"] for r in rs} == {"a", "b"}
        metrics = client.get("/metrics").text
        assert "kvroute_retries_total 3.0" in metrics
        # Every worker answers 429: the last answer is passed through, not a 503.
        a.control(fail=[429] * 4)
        b.control(fail=[429] * 4)
        r = completion(client)
        assert r.status_code == 429 and "answers 429" in r.json()["error"]["message"]
    with engines("a", "b") as (a, b), \
            front([a, b], retry={"retry_on": ["connect", "timeout"]}) as client:
        a.control(fail=[503])
        b.control(fail=[503])
        assert completion(client).status_code == 503  # 5xx not retried: passed through


def test_backoff_grows_exponentially_with_jitter():
    from kvroute.serving.retry import RetryPolicy

    p = RetryPolicy(5, initial_backoff_ms=100, max_backoff_ms=250, backoff_multiplier=2,
                    jitter_factor=0.2, rng=lambda: 1.0)
    assert [round(p.backoff_s(n), 3) for n in (1, 2, 3, 4)] == [0.12, 0.24, 0.3, 0.3]
    p = RetryPolicy(5, initial_backoff_ms=100, jitter_factor=0.2, rng=lambda: 0.0)
    assert round(p.backoff_s(1), 3) == 0.08
    assert p.retries("connect", 5) and not p.retries("connect", 6)
    assert p.status_kind(503) == "5xx" and p.status_kind(429) == "429"
    assert p.status_kind(501) is None and p.status_kind(400) is None
    with pytest.raises(ValueError, match="retry_on"):
        RetryPolicy(retry_on=["4xx"])


def test_a_flapping_engine_fails_no_request():
    with engines("steady", "flappy") as (steady, flappy), \
            front([steady, flappy], {"health_check": {**FAST_HEALTH, "check_interval_secs":
                                                      0.2}}, max_retries=2) as client:
        statuses = []
        end = time.monotonic() + 3.0
        i = 0
        while time.monotonic() < end:
            if i % 5 == 0:  # health and answers flip every ~5 requests
                bad = (i // 5) % 2 == 1
                flappy.control(health=500 if bad else 200, fail=[502] * 3 if bad else [])
            statuses.append(completion(client).status_code)
            i += 1
            time.sleep(0.02)
        assert set(statuses) == {200}, statuses


def test_no_engine_up_answers_503_with_retry_after_everywhere_and_a_recovery_burst_is_served():
    with engines("a", "b") as (a, b), \
            front([a, b], {"health_check": FAST_HEALTH}, recovery_ramp_s=5.0) as client:
        a.control(health=500)
        b.control(health=500)
        wait_for(lambda: client.get("/health").status_code == 503, "both out", timeout=10)
        h = client.get("/health")
        assert h.json()["available"] == 0 and int(h.headers["retry-after"]) >= 1
        m = client.get("/v1/models")
        assert m.status_code == 503 and "retry-after" in m.headers
        assert m.json()["error"]["type"] == "ServiceUnavailableError"
        r = completion(client)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        a.control(health=200)
        b.control(health=200)

        def shares() -> list:
            return [w["recovery_share"] for w in client.get("/workers").json()["workers"].values()]

        # Each back at its own probe: both up and ramping, from 10 % towards 100 %.
        wait_for(lambda: all(0.1 <= x < 1.0 for x in shares()), "both back, ramping",
                 timeout=10, info=shares)
        assert client.get("/health").status_code == 200
        # Both ramping from 10 %: none is held back when that would leave no worker.
        rs = parallel(lambda: completion(client), 20)
        assert [r.status_code for r in rs] == [200] * 20
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 4096


def test_a_recovery_burst_after_open_circuits_is_served():
    with engines("a", "b") as (a, b), \
            front([a, b], breaker_failures=1, breaker_reset_s=0.5, max_retries=0) as client:
        a.control(fail=[500])
        b.control(fail=[500])
        assert [completion(client).status_code for _ in range(2)] == [500, 500]
        r = completion(client)  # both circuits open
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        time.sleep(0.6)
        rs = parallel(lambda: completion(client), 10)
        assert [r.status_code for r in rs] == [200] * 10


def test_recovery_ramp_grows_the_share_linearly():
    from kvroute.serving.health import RecoveryRamp

    now = [100.0]
    ramp = RecoveryRamp(10.0, 0.1, clock=lambda: now[0], rng=lambda: 0.5)
    assert ramp.share(None) == 1.0 and ramp.share(100.0) == pytest.approx(0.1)
    assert ramp.held_back(100.0)  # 0.5 >= 0.1
    now[0] = 105.0
    assert ramp.share(100.0) == pytest.approx(0.55) and not ramp.held_back(100.0)
    now[0] = 110.0
    assert ramp.share(100.0) == 1.0


# -- limits ------------------------------------------------------------------------------------

def test_oversize_bodies_get_413_before_and_while_reading():
    with engines("a") as (a,), front([a], limits={"max_body_bytes": 1000}) as client:
        r = client.post("/v1/completions", content=b"x" * 2000,
                        headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "RequestEntityTooLargeError"
        assert "max_body_bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: counted while read
            for _ in range(20):
                yield b" " * 100
        r = client.post("/v1/completions", content=chunks(),
                        headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert completion(client).status_code == 200


def test_oversize_prompts_get_400_naming_the_context_length():
    with engines("a", max_model_len=1000) as (a,), front([a]) as client:
        # max_prompt_tokens "auto": learnt from the engine's /v1/models
        wait_for(lambda: client.app.state.kvroute_proxy.limits.max_prompt_tokens == 1000,
                 "max_model_len learnt")
        r = client.post("/v1/completions", json={"model": "m", "prompt": list(range(1001))})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "maximum context length is 1000 tokens" in msg and "1001 tokens" in msg
        assert client.post("/v1/completions", json={"model": "m", "prompt": list(range(1000))}
                           ).status_code == 200
        t0 = time.monotonic()
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x" * 16001})
        assert r.status_code == 400 and "more than 16000 characters" in r.json()["error"][
            "message"]
        assert time.monotonic() - t0 < 1.0


def _words(n_chars: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    vocab = ["alpha", "router", "engine", "cache", "block", "prefix", "token", "worker",
             "latency", "stream", "queue", "health", "retry", "limit", "lane", "model"]
    out = []
    size = 0
    while size < n_chars:
        w = rng.choice(vocab) + rng.choice([" ", ", ", ". ", "\n"])
        out.append(w)
        size += len(w)
    return "".join(out)


@pytest.mark.slow  # 5-11 s here: the two 3 MB prompts are tokenized to the end
def test_small_chat_latency_stays_bounded_while_two_3mb_prompts_tokenize(qwen3):
    from kvroute.prompt import PromptTokenizer

    tok = PromptTokenizer.from_dir(qwen3)
    big = {"model": "m", "prompt": _words(3 << 20, 1), "max_tokens": 1}
    small = {"model": "m", "max_tokens": 4,
             "messages": [{"role": "user", "content": _words(2800, 2)}]}
    with engines("a", "b") as (a, b), \
            front([a, b], tokenizer=tok, limits={"max_prompt_tokens": None}) as client:
        lat = []
        for _ in range(3):  # warm
            t0 = time.monotonic()
            assert client.post("/v1/chat/completions", json=small).status_code == 200
            lat.append(time.monotonic() - t0)
        alone = min(lat)
        with ThreadPoolExecutor(2) as pool:
            bigs = [pool.submit(client.post, "/v1/completions", json=big) for _ in range(2)]
            proxy = client.app.state.kvroute_proxy
            wait_for(lambda: proxy.tokenizer.lanes()["long"]["pending"] == 2,
                     "both big prompts in the long lane", timeout=20)
            during = []
            for _ in range(5):
                t0 = time.monotonic()
                assert client.post("/v1/chat/completions", json=small).status_code == 200
                during.append(time.monotonic() - t0)
            assert proxy.tokenizer.lanes()["long"]["pending"] >= 1  # still in flight
            worst = max(during)
            print(f"small chat alone {alone * 1000:.0f} ms, with two 3 MB prompts tokenizing: "
                  f"max {worst * 1000:.0f} ms of {len(during)}")
            assert worst < 1.0, during
            assert [f.result().status_code for f in bigs] == [200, 200]


def test_tokenizer_lanes_are_bounded(qwen3):
    import asyncio

    from kvroute.prompt import PromptTokenizer, TokenizerBusy

    tok = PromptTokenizer.from_dir(qwen3, long_prompt_chars=1000, long_workers=1,
                                   max_queued=1, inline_chars=0)
    body = {"prompt": _words(200_000, 3)}

    async def run() -> list:
        return await asyncio.gather(*(tok.aencode_request("/v1/completions", body)
                                      for _ in range(3)), return_exceptions=True)

    try:
        out = asyncio.run(run())
        assert [type(x).__name__ for x in out].count("TokenizerBusy") == 1
        assert isinstance(out[2], TokenizerBusy) and "long lane is full" in str(out[2])
    finally:
        tok.close()


def test_prefix_cache_encodes_a_turn_extending_the_previous_one_exactly(qwen3, mt_bench_questions):
    from kvroute.prompt import PromptTokenizer

    cached = PromptTokenizer.from_dir(qwen3, prefix_cache_min_chars=0)
    plain = PromptTokenizer.from_dir(qwen3, prefix_cache_tokens=0)
    assert cached.prefix_cache is not None and plain.prefix_cache is None
    try:
        for q in mt_bench_questions[:10]:
            conv = [{"role": "system", "content": "You are helpful. " * 50},
                    {"role": "user", "content": q["turns"][0]}]
            for turn in q["turns"][1:] + ["and once more, briefly?"]:
                body = {"messages": conv}
                a = cached.encode_request("/v1/chat/completions", body)
                b = plain.encode_request("/v1/chat/completions", body)
                assert a.tolist() == b.tolist()
                conv = conv + [{"role": "assistant", "content": "An answer " + turn[:40]},
                               {"role": "user", "content": turn}]
        assert cached.prefix_cache.hits >= 10  # every later turn reused the earlier prefix
    finally:
        cached.close()
        plain.close()



def test_prefix_cache_reuses_a_system_prompt_across_conversations(qwen3, mt_bench_questions):
    from kvroute.prompt import PromptTokenizer

    cached = PromptTokenizer.from_dir(qwen3)  # the default min_chars: a ~600-char prompt uses it
    plain = PromptTokenizer.from_dir(qwen3, prefix_cache_tokens=0)
    system = {"role": "system", "content": "You answer questions about LLM serving. " * 12}
    try:
        firsts = [q["turns"][0] for q in mt_bench_questions[:12]]
        for i, q in enumerate(firsts):
            body = {"messages": [system, {"role": "user", "content": q}]}
            a = cached.encode_request("/v1/chat/completions", body)
            assert a.tolist() == plain.encode_request("/v1/chat/completions", body).tolist()
            # Each conversation is new: only the first one misses, the rest reuse the system
            # message stored on its own.
            assert (cached.prefix_cache.misses, cached.prefix_cache.hits) == (1, i)
        lone = {"messages": [{"role": "user", "content": firsts[0] * 3}]}
        n = len(cached.prefix_cache)
        assert (cached.encode_request("/v1/chat/completions", lone).tolist()
                == plain.encode_request("/v1/chat/completions", lone).tolist())
        assert len(cached.prefix_cache) == n + 1  # one message: only the prefix before the answer
    finally:
        cached.close()
        plain.close()

# -- routes, request ids, access logs, error shapes ----------------------------------------------

ROUTE_BODIES = {
    "/v1/embeddings": {"model": "m", "input": "embed this text"},
    "/v1/responses": {"model": "m", "instructions": "Be brief.", "input": "Hello there"},
    "/v1/messages": {"model": "m", "max_tokens": 8, "system": "Be brief.",
                     "messages": [{"role": "user", "content": [{"type": "text",
                                                                "text": "Hello"}]}]},
    "/v1/rerank": {"model": "m", "query": "q", "documents": ["a", "b"]},
    "/tokenize": {"model": "m", "prompt": "Hello there"},
    "/detokenize": {"model": "m", "tokens": [1, 2, 3]},
}


def test_every_pass_through_route_is_routed_with_request_ids_and_access_logs(qwen3, caplog):
    import json
    import logging

    from kvroute.prompt import PromptTokenizer

    caplog.set_level(logging.INFO, logger="kvroute.access")
    tok = PromptTokenizer.from_dir(qwen3)
    with engines("a", "b") as (a, b), front([a, b], {"policy": "kv_aware"}, tokenizer=tok) \
            as client:
        for path, body in ROUTE_BODIES.items():
            r = client.post(path, json=body, headers={"x-kvroute-explain": "1"})
            assert r.status_code == 200, (path, r.text)
            got = r.json()
            assert got["path"] == path and got["body"] == body  # forwarded unchanged
            rid = r.headers["x-request-id"]
            assert rid.startswith("req-") and len(rid) == 28
            assert got["headers"]["x-request-id"] == rid  # the engine got the same id
            prompt = json.loads(r.headers["x-kvroute-decision"])["prompt_tokens"]
            if path in ("/v1/rerank", "/detokenize"):
                assert prompt == 0, path  # load only
            else:
                assert prompt > 0, path  # cache-aware: the prompt was tokenized
        # A client's id is propagated to the engine and back.
        r = client.post("/v1/chat/completions", headers={"x-request-id": "my-id-1"},
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.headers["x-request-id"] == "my-id-1"
        assert r.json()["headers"]["x-request-id"] == "my-id-1"
        r = completion(client)
        assert r.headers["x-request-id"].startswith("cmpl-")
    lines = [json.loads(rec.getMessage()) for rec in caplog.records
             if rec.name == "kvroute.access"]
    by_id = {x["request_id"]: x for x in lines}
    entry = by_id["my-id-1"]
    assert entry["status"] == 200 and entry["path"] == "/v1/chat/completions"
    assert entry["worker"] in (a.url, b.url) and entry["attempts"] == 1
    assert entry["decision"]["prompt_tokens"] > 0  # no KV events here: the fallback decides
    assert entry["decision"]["fallback"] is True and entry["decision"]["reason"]
    assert entry["latency_ms"] >= entry["ttfb_ms"] > 0


def test_errors_are_openai_shaped_on_every_route():
    with engines("a") as (a,), front([a]) as client:
        r = client.get("/no/such/route")
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == 404 and err["type"] == "NotFoundError"
        assert "no route GET /no/such/route" in err["message"]
        assert "x-request-id" in r.headers
        r = client.get("/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == 405
        assert "POST" in r.headers["allow"]
        r = client.post("/v1/embeddings", content=b"not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        r = client.get("/admin/decisions", params={"limit": "many"})
        assert r.status_code == 400 and "error" in r.json()


# -- configuration -----------------------------------------------------------------------------

def test_serving_keys_and_the_vllm_router_request_keys_reach_the_proxy():
    from kvroute.config import ConfigError, load_config

    w = {"worker_urls": ["http://a"]}
    c = load_config({"mode": w, "retry": {"max_retries": 3, "initial_backoff_ms": 10,
                                          "jitter_factor": 0.5},
                     "max_payload_size": 1000, "request_id_headers": ["x-correlation-id"]})
    kw = c.serving.create_router_kwargs()
    assert kw["max_retries"] == 2  # the vLLM router counts attempts
    assert kw["retry"]["initial_backoff_ms"] == 10 and kw["retry"]["jitter_factor"] == 0.5
    assert kw["limits"]["max_body_bytes"] == 1000
    assert kw["request_id_headers"] == ["x-correlation-id"]
    assert load_config({"mode": w, "disable_retries": True}).serving.max_retries == 0
    c = load_config({"mode": w, "serving": {"first_byte_timeout_secs": 3, "recovery_ramp_s": 0,
                                            "max_prompt_tokens": None,
                                            "retry": {"retry_on": ["connect"]},
                                            "long_prompt_chars": 1000}})
    kw = c.serving.create_router_kwargs()
    assert (kw["first_byte_timeout_s"], kw["recovery_ramp_s"]) == (3, 0)
    assert kw["limits"]["max_prompt_tokens"] is None and kw["retry"]["retry_on"] == ["connect"]
    assert c.serving.tokenizer_kwargs()["long_prompt_chars"] == 1000
    with pytest.raises(ConfigError, match="retry is set both"):
        load_config({"mode": w, "retry": {"max_retries": 3}, "serving": {"max_retries": 1}})
    with pytest.raises(ConfigError, match="retry_on"):
        load_config({"mode": w, "serving": {"retry": {"retry_on": ["4xx"]}}})
    with engines("a") as (a,):
        conf = {"mode": {"worker_urls": [a.url]}, "request_id_headers": ["x-correlation-id"],
                "serving": {"first_byte_timeout_s": 2.5, "max_body_bytes": 100}}
        app = create_app(conf)
        try:
            proxy = app.state.kvroute_proxy
            assert proxy.first_byte_timeout_s == 2.5 and proxy.limits.max_body_bytes == 100
            srv = UvicornThread(app)
            try:
                r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1]},
                               headers={"x-correlation-id": "corr-7"})
                assert r.headers["x-request-id"] == "corr-7"
                assert r.json()["headers"]["x-request-id"] == "corr-7"
            finally:
                srv.stop()
        finally:
            app.state.kvroute_router.close()


def test_access_log_with_bodies_converts_to_a_replay_trace(qwen3, caplog, tmp_path):
    """serving.access_log_bodies: each completion's line holds its body and session header;
    `access_log_to_openai` turns the lines into an openai-format trace that tokenizes to the
    prompts the proxy routed."""
    import json
    import logging

    from kvroute.prompt import PromptTokenizer
    from kvroute.replay.traces import access_log_to_openai, load_jsonl

    caplog.set_level(logging.INFO, logger="kvroute.access")
    tok = PromptTokenizer.from_dir(qwen3)
    chat = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": 7}
    with engines("a") as (a,), front([a], {"serving": {"access_log_bodies": True}},
                                     tokenizer=tok) as client:
        r1 = client.post("/v1/chat/completions", json=chat, headers={"x-session-id": "s-1"})
        r2 = client.post("/v1/completions", json={"model": "m", "prompt": "Once upon a time"})
        r3 = client.get("/v1/models")
        assert r1.status_code == r2.status_code == r3.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvroute.access"]
    prompts = [json.loads(x)["decision"]["prompt_tokens"] for x in lines
               if '"decision"' in x]
    records, skipped = access_log_to_openai(lines)
    assert skipped["other_route"] == 1 and len(records) == 2
    assert records[0]["body"] == chat and records[0]["session_id"] == "s-1"
    assert records[0]["timestamp"] <= records[1]["timestamp"]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    trace = load_jsonl(path, tokenizer_dir=qwen3)
    assert [len(r.tokens) for r in trace.requests] == prompts
    assert trace.requests[0].session == "s-1" and trace.requests[0].output_length == 7


def test_a_generated_request_id_is_not_a_session_key():
    with engines("a", "b") as (a, b), front([a, b], {"policy": "consistent_hash"}) as client:
        # no session header: the hashing policy hashes the prompt, one engine for it
        got = {completion(client, prompt=[7, 8, 9]).json()["engine"] for _ in range(8)}
        assert len(got) == 1, got
        r = completion(client, prompt=[7, 8, 9])
        assert r.headers["x-request-id"].startswith("cmpl-")  # still generated and returned
        assert r.json()["headers"]["x-request-id"] == r.headers["x-request-id"]
