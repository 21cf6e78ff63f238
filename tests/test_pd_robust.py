"""The prefill/decode front (kvroute.serving.pd) under engine failures, limits and bad routes:
real HTTP on loopback, engines are `tests/_echo_engine.py` processes (SIGSTOP-able like a hung
engine; a prefill answer without ``kv_transfer_params`` is passed on as none)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, Iterator, List

import pytest
from _util import require, wait_for

fastapi = require("fastapi")
httpx = require("httpx")

from test_proxy_robust import (  # noqa: E402
    FAST_HEALTH,
    Engine,
    completion,
    engines,
    parallel,
    served,
)

from kvroute.fastapi import create_app as create_pd_app  # noqa: E402


@contextlib.contextmanager
def pd_front(prefill: List[Engine], decode: List[Engine], config: Any = None,
             **options: Any) -> Iterator[Any]:
    """The PD front (vLLM's contract, round robin in both pools) in front of the engines;
    yields an httpx.Client on it (``client.app`` is the FastAPI app)."""
    conf = {"mode": {"type": "vllm_prefill_decode",
                     "prefill_urls": [[e.url, None] for e in prefill],
                     "decode_urls": [e.url for e in decode]},
            "policy": "round_robin", **(config or {})}
    with served(create_pd_app(conf, **options)) as client:
        yield client


def available(client: Any) -> dict:
    return client.get("/health").json()["available"]


def released(client: Any) -> bool:
    st = client.app.state.kvroute_pd_router.stats()
    return all(w["inflight_requests"] == 0 for pool in st.values()
               for w in pool["workers"].values())


def test_a_hung_prefill_engine_is_taken_out_and_its_waiting_request_moves():
    health = {**FAST_HEALTH, "check_interval_secs": 5.0}
    with engines("p0", "p1", "d") as (p0, p1, d), \
            pd_front([p0, p1], [d], {"health_check": health}) as client:
        wait_for(lambda: available(client) == {"prefill": 2, "decode": 1}, "all healthy")
        p1.pause()  # SIGSTOP: the kernel still accepts connections, nothing answers
        t0 = time.monotonic()
        # Round robin: one of the two prefills waits on p1; after timeout_secs of waiting it
        # asks for a probe, p1 is out after its failure_threshold failed probes and the
        # request is tried again as a new pair on p0.
        rs = parallel(lambda: completion(client), 2)
        assert [r.status_code for r in rs] == [200, 200]
        assert {r.headers["x-kvroute-prefill-worker"] for r in rs} == {p0.url}
        assert {r.json()["engine"] for r in rs} == {"d"}
        wait_for(lambda: available(client)["prefill"] == 1, "p1 taken out", timeout=10)
        took = time.monotonic() - t0
        assert took < health["check_interval_secs"], took
        print(f"hung prefill engine out after {took:.2f} s")
        r = client.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        rs = [completion(client) for _ in range(4)]
        assert [r.headers["x-kvroute-prefill-worker"] for r in rs] == [p0.url] * 4
        wait_for(lambda: released(client), "the load to be released")
        p1.resume()
        wait_for(lambda: available(client)["prefill"] == 2, "p1 back", timeout=10)


def test_a_hung_decode_engine_hits_the_first_byte_timeout_and_moves():
    with engines("p", "d0", "d1") as (p, d0, d1), \
            pd_front([p], [d0, d1], first_byte_timeout_s=0.5) as client:
        d0.pause()
        try:
            rs = [completion(client) for _ in range(2)]  # round robin: one starts on d0
            assert [r.status_code for r in rs] == [200, 200]
            assert {r.json()["engine"] for r in rs} == {"d1"}
            wait_for(lambda: released(client), "the load to be released")
        finally:
            d0.resume()
    with engines("p", "d") as (p, d), pd_front([p], [d], first_byte_timeout_s=0.3) as client:
        d.pause()
        try:
            t0 = time.monotonic()
            r = completion(client)
            assert r.status_code == 504 and "decode worker" in r.json()["error"]["message"]
            assert time.monotonic() - t0 < 5.0
            wait_for(lambda: released(client), "the load to be released")
        finally:
            d.resume()


def test_5xx_is_retried_on_another_pair_and_passed_through_when_nobody_is_left(caplog):
    caplog.set_level(logging.INFO, logger="kvroute.access")
    retry = {"initial_backoff_ms": 1, "max_backoff_ms": 5}
    with engines("p", "d0", "d1") as (p, d0, d1), \
            pd_front([p], [d0, d1], {"retry": retry}) as client:
        d0.control(fail=[503])
        rs = [completion(client) for _ in range(2)]
        assert [r.status_code for r in rs] == [200, 200]
        def lines() -> list:  # a line is written once its response is sent: wait for both
            return [json.loads(rec.getMessage()) for rec in caplog.records
                    if rec.name == "kvroute.access"]
        wait_for(lambda: len(lines()) == 2, "both access lines")
        assert sorted(x["attempts"] for x in lines()) == [1, 2], lines()
        retried = next(x for x in lines() if x["attempts"] == 2)
        assert retried["worker"] == d1.url and retried["prefill_worker"] == p.url
    with engines("p", "d") as (p, d), pd_front([p], [d], {"retry": retry}) as client:
        d.control(fail=[503])
        r = completion(client)  # no other decode worker: the engine's answer as it is
        assert r.status_code == 503 and r.json()["error"]["message"] == "d answers 503"
        p.control(fail=[400])
        r = completion(client)  # a prefill 4xx is the request's fault: passed through
        assert r.status_code == 400 and r.json()["error"]["message"] == "p answers 400"
        p.control(fail=[500])
        r = completion(client)  # no other prefill worker: not retried
        assert r.status_code == 502 and "prefill worker" in r.json()["error"]["message"]
        assert completion(client).status_code == 200
        wait_for(lambda: released(client), "the load to be released")


def test_no_decode_worker_up_answers_503_with_retry_after():
    with engines("p", "d") as (p, d), pd_front([p], [d], {"health_check": FAST_HEALTH}) \
            as client:
        wait_for(lambda: available(client) == {"prefill": 1, "decode": 1}, "all healthy")
        assert client.get("/v1/models").json()["data"][0]["owned_by"] == "d"
        d.control(health=503)
        wait_for(lambda: available(client)["decode"] == 0, "d taken out", timeout=10)
        for r in (client.get("/health"), completion(client), client.get("/v1/models")):
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) >= 1
        assert client.get("/health").json()["status"] == "unavailable"
        assert completion(client).json()["error"]["code"] == 503


def test_oversize_bodies_and_prompts_are_refused():
    with engines("p", "d", max_model_len=1000) as (p, d), \
            pd_front([p], [d], {"serving": {"max_body_bytes": 100_000}}) as client:
        r = client.post("/v1/completions", content=b"x" * 100_001,
                        headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "RequestEntityTooLargeError"
        limits = client.app.state.kvroute_pd_front.limits
        wait_for(lambda: limits.max_prompt_tokens == 1000, "max_model_len learnt")
        r = client.post("/v1/completions", json={"model": "m", "prompt": list(range(1001))})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "maximum context length is 1000 tokens" in msg and "1001 tokens" in msg
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x" * 16001})
        assert r.status_code == 400 and "more than 16000 characters" in r.json()["error"][
            "message"]
        assert client.post("/v1/completions", json={"model": "m", "prompt": list(range(1000))}
                           ).status_code == 200


def test_errors_are_openai_shaped_and_request_ids_reach_both_engines(caplog):
    caplog.set_level(logging.INFO, logger="kvroute.access")
    with engines("p", "d") as (p, d), pd_front([p], [d]) as client:
        r = client.get("/no/such/route")
        assert r.status_code == 404 and "x-request-id" in r.headers
        err = r.json()["error"]
        assert err["code"] == 404 and err["type"] == "NotFoundError"
        assert "no route GET /no/such/route" in err["message"]
        r = client.get("/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == 405
        r = client.post("/v1/chat/completions", content=b"not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        r = completion(client, stream=True)
        assert r.status_code == 200 and r.headers["x-request-id"].startswith("cmpl-")
        r = client.post("/v1/completions", headers={"x-request-id": "my-id-1"},
                        json={"model": "m", "prompt": [1, 2, 3]})
        assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-1"
        assert r.json()["headers"]["X-Request-Id"] == "my-id-1"  # the decode engine's view
    lines = {x["request_id"]: x for x in (json.loads(rec.getMessage())
                                          for rec in caplog.records
                                          if rec.name == "kvroute.access")}
    entry = lines["my-id-1"]
    assert entry["status"] == 200 and entry["path"] == "/v1/completions"
    assert (entry["worker"], entry["prefill_worker"], entry["attempts"]) == (d.url, p.url, 1)
    assert entry["decision"]["prompt_tokens"] == entry["prefill_decision"]["prompt_tokens"] == 3


def test_the_serving_section_reaches_the_pd_front(qwen3):
    conf = {"serving": {"tokenizer": str(qwen3), "tokenizer_threads": 3,
                        "long_prompt_threads": 1, "tokenizer_max_queued": 5,
                        "first_byte_timeout_s": 7, "max_prompt_tokens": 500, "max_retries": 4,
                        "retry": {"retry_on": ["connect"]}},
            "health_check": {"check_interval_secs": 30}}
    with engines("p", "d") as (p, d), pd_front([p], [d], conf) as client:
        front = client.app.state.kvroute_pd_front
        lanes = front.tokenizer.lanes()
        assert lanes["short"]["workers"] == 3 and lanes["long"]["workers"] == 1
        assert lanes["short"]["max_queued"] == 5
        assert front.first_byte_timeout_s == 7
        assert front.limits.max_prompt_tokens == 500
        assert (front.retry.max_retries, front.retry.retry_on) == (4, frozenset({"connect"}))
        assert front.health_checker.check_interval_s == 30
        r = client.post("/v1/chat/completions",
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert r.json()["body"]["messages"] == [{"role": "user", "content": "hi"}]
        r = client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hello " * 600}]})
        assert r.status_code == 400 and "maximum context length is 500" in r.json()[
            "error"]["message"]


def test_a_session_stays_on_its_decode_worker():
    with engines("p", "d0", "d1") as (p, d0, d1), \
            pd_front([p], [d0, d1], {"decode_policy": {"type": "consistent_hash"}}) as client:
        for session in ("alice", "bob", "carol"):
            got = {client.post("/v1/completions", headers={"x-session-id": session},
                               json={"model": "m", "prompt": [i, 2, 3]}).json()["engine"]
                   for i in range(4)}
            assert len(got) == 1, (session, got)
        # Without a session header the prompt decides (not the generated request id).
        got = {client.post("/v1/completions", json={"model": "m", "prompt": [7, 8, 9]}
                           ).json()["engine"] for _ in range(6)}
        assert len(got) == 1, got


# -- circuit breakers and the recovery ramp ---------------------------------------------------

def _prefill_workers(rs: List[Any]) -> List[str]:
    return [r.headers["x-kvroute-prefill-worker"] for r in rs]


def test_a_flapping_prefill_engine_opens_its_circuit_and_comes_back_ramped():
    from kvroute.serving.health import RecoveryRamp

    retry = {"initial_backoff_ms": 1, "max_backoff_ms": 5}
    with engines("p0", "p1", "d") as (p0, p1, d), \
            pd_front([p0, p1], [d], {"retry": retry}, breaker_failures=2,
                     breaker_reset_s=0.5, recovery_ramp_s=30.0) as client:
        front = client.app.state.kvroute_pd_front
        p1.control(fail=[500, 500])
        rs = [completion(client) for _ in range(4)]  # round robin: two start on p1
        assert [r.status_code for r in rs] == [200] * 4  # retried on p0
        assert front.breaker("prefill", p1.url).state == "open"
        assert available(client) == {"prefill": 1, "decode": 1}
        metrics = client.get("/metrics").text
        assert f'kvroute_prefill_circuit_open{{worker="{p1.url}"}} 1.0' in metrics
        rs = [completion(client) for _ in range(4)]
        assert _prefill_workers(rs) == [p0.url] * 4  # open: never chosen
        time.sleep(0.6)
        assert front.breaker("prefill", p1.url).state == "half_open"
        w1 = next(w for w in front.router.prefill.workers if w.name == p1.url)
        assert 0.1 <= front.recovery_share("prefill", w1) < 0.2
        # Every draw of 0.5 holds back a worker whose share is below 0.5: p1 gets nothing
        # yet, where round robin alone would give it every other request.
        front.ramp = RecoveryRamp(30.0, 0.1, rng=lambda: 0.5)
        rs = [completion(client) for _ in range(6)]
        assert _prefill_workers(rs) == [p0.url] * 6
        # A draw below its share: p1 serves again, and its first answer closes the circuit.
        front.ramp = RecoveryRamp(30.0, 0.1, rng=lambda: 0.0)
        rs = [completion(client) for _ in range(4)]
        assert [r.status_code for r in rs] == [200] * 4
        assert set(_prefill_workers(rs)) == {p0.url, p1.url}
        assert front.breaker("prefill", p1.url).state == "closed"
        assert f'kvroute_prefill_circuit_open{{worker="{p1.url}"}} 0.0' in client.get(
            "/metrics").text
        wait_for(lambda: released(client), "the load to be released")


def test_open_circuits_answer_503_and_a_recovery_burst_is_never_held_back():
    from kvroute.serving.health import RecoveryRamp

    with engines("p", "d0", "d1") as (p, d0, d1), \
            pd_front([p], [d0, d1], breaker_failures=1, breaker_reset_s=0.5,
                     max_retries=0) as client:
        front = client.app.state.kvroute_pd_front
        d0.control(fail=[500])
        d1.control(fail=[500])
        assert [completion(client).status_code for _ in range(2)] == [500, 500]
        r = completion(client)  # both decode circuits open
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert client.get("/health").status_code == 503
        time.sleep(0.6)
        # Both ramping; a draw that holds back every ramping worker holds back none.
        front.ramp = RecoveryRamp(30.0, 0.1, rng=lambda: 0.5)
        rs = parallel(lambda: completion(client), 10)
        assert [r.status_code for r in rs] == [200] * 10
        wait_for(lambda: released(client), "the load to be released")


# -- metrics -------------------------------------------------------------------------------------

def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_count_each_pools_decisions_requests_retries_and_reports():
    retry = {"initial_backoff_ms": 1, "max_backoff_ms": 5}
    with engines("p", "d0", "d1") as (p, d0, d1), \
            pd_front([p], [d0, d1], {"retry": retry}) as client:
        d0.control(fail=[503])
        rs = [completion(client) for _ in range(3)] + [completion(client, stream=True)]
        assert [r.status_code for r in rs] == [200] * 4
        r = client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        m = _samples(r.text)
        # 4 requests, one of them retried on d1 after d0's 503: 5 pairs chosen.
        for pool in ("prefill", "decode"):
            assert sum(v for (name, labels), v in m.items()
                       if name == f"kvroute_{pool}_decisions_total"
                       and ("policy", "round_robin") in labels) == 5, pool
        assert m[("kvroute_prefill_upstream_requests_total",
                  (("outcome", "2xx"), ("worker", p.url)))] == 5
        assert m[("kvroute_decode_upstream_requests_total",
                  (("outcome", "5xx"), ("worker", d0.url)))] == 1
        ok = sum(m.get(("kvroute_decode_upstream_requests_total",
                        (("outcome", "2xx"), ("worker", w.url))), 0) for w in (d0, d1))
        assert ok == 4
        assert m[("kvroute_decode_retries_total", ())] == 1
        assert m[("kvroute_prefill_retries_total", ())] == 0
        assert m[("kvroute_prefill_upstream_latency_seconds_count", (("worker", p.url),))] == 5
        # Every prefill answer was reported to the prefill pool (the stand-in gives no count).
        assert m[("kvroute_prefill_delivered_reports_total",
                  (("reported", "false"), ("worker", p.url)))] == 5
        assert ("kvroute_prefill_prefix_tokens_total", (("kind", "delivered"),)) in m
        assert m[("kvroute_decode_inflight_requests", (("worker", d0.url),))] == 0


# -- pass-through routes ----------------------------------------------------------------------

def test_pass_through_routes_go_to_the_decode_pool(caplog):
    from test_proxy_robust import ROUTE_BODIES

    caplog.set_level(logging.INFO, logger="kvroute.access")
    with engines("p", "d") as (p, d), pd_front([p], [d]) as client:
        bodies = {**ROUTE_BODIES, "/tokenize": {"model": "m", "prompt": [5, 6, 7, 8]}}
        for path, body in bodies.items():
            r = client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            got = r.json()
            assert (got["engine"], got["path"], got["body"]) == ("d", path, body)
            assert r.headers["x-kvroute-decode-worker"] == d.url
            assert "x-kvroute-prefill-worker" not in r.headers
            assert got["headers"]["X-Request-Id"] == r.headers["x-request-id"]
        wait_for(lambda: released(client), "the load to be released")
    lines = {x["path"]: x for x in (json.loads(rec.getMessage()) for rec in caplog.records
                                    if rec.name == "kvroute.access")}
    assert lines["/tokenize"]["decision"]["prompt_tokens"] == 4  # token ids: cache-aware
    assert lines["/detokenize"]["decision"]["prompt_tokens"] == 0  # load only
    assert lines["/tokenize"]["prefill_worker"] is None
    assert lines["/tokenize"]["worker"] == d.url


# -- client disconnects -----------------------------------------------------------------------

@pytest.mark.parametrize("contract", ["vllm", "sglang"])
def test_a_client_that_leaves_releases_the_load_at_once(contract):
    with engines("p", "d") as (p, d):
        conf = None
        if contract == "sglang":  # a bootstrap port: the prefill request runs concurrently
            conf = {"mode": {"type": "pd_disaggregation", "prefill_urls": [[p.url, 8998]],
                             "decode_urls": [d.url]}}
            p.control(delay_s=3.0)
        with pd_front([p], [d], conf) as client:
            _leave_early(client, d)
        p.control(delay_s=0.0)


def _leave_early(client: Any, d: Engine) -> None:
    d.control(delay_s=3.0)
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3]}, timeout=0.5)
    # The request is cancelled when the client goes: its load is released long before the
    # engines would have answered.
    wait_for(lambda: released(client), "the load to be released", timeout=1.5)
    assert time.monotonic() - t0 < 2.5
    d.control(delay_s=0.0)


def test_kvroute_serve_in_pd_mode_serves_metrics_on_the_metrics_listener(tmp_path):
    import signal
    import subprocess
    import sys

    from _util import free_port

    with engines("p", "d") as (p, d):
        port, mport = free_port(), free_port()
        conf = {"mode": {"type": "vllm_prefill_decode", "prefill_urls": [[p.url, None]],
                         "decode_urls": [d.url]},
                "policy": "round_robin", "metrics": {"host": "127.0.0.1", "port": mport}}
        path = tmp_path / "pd.yaml"
        path.write_text(json.dumps(conf))
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path), "--host",
             "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-doctor"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            def up() -> bool:
                assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
                except httpx.HTTPError:
                    return False
            wait_for(up, "kvroute serve to answer /health", timeout=60)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": "m", "prompt": [1, 2, 3]})
            assert r.status_code == 200 and r.json()["engine"] == "d"
            for base in (f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{port}"):
                m = _samples(wait_for(lambda base=base: httpx.get(f"{base}/metrics").text,
                                      "metrics"))
                assert m[("kvroute_decode_upstream_requests_total",
                          (("outcome", "2xx"), ("worker", d.url)))] == 1, base
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        assert code == 0
