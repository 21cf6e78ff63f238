"""The engine stand-in (`kvroute.sim.server`): real subprocess servers on loopback, real HTTP,
real ZeroMQ, the real Qwen3 tokenizer and chat template.

Each assertion is about behaviour a router relies on: prompt tokens exactly as vLLM would
count them, streaming that reassembles to the non-streamed text, prefix reuse reported in
``cached_tokens``, KV events that a `kvroute.Router` indexes, load visible in ``/metrics`` and
in the ORCA header, vLLM's error JSON, and a killed engine's ports closed.
"""

import asyncio
import json
import os
import signal
import socket
import time
from typing import Any, Dict, List

import httpx
import numpy as np
import pytest
import zmq
from _util import await_for, free_port, standin_engines, wait_for, wait_subscribed
from prometheus_client.parser import text_string_to_metric_families

import kvroute
from kvroute.replay.traces import render_chat_template
from kvroute.sim.server import EngineServerProcess, StandinEngine, orca_header

MODEL = "Qwen/Qwen3-0.6B"
TIMEOUT = 30.0  # generous: a loaded 2-core machine


def rand_tokens(seed: int, n: int) -> List[int]:
    return np.random.default_rng(seed).integers(1000, 150_000, size=n).tolist()


def sse(text: str) -> List[Any]:
    """Parses an SSE body into its data payloads; checks the framing on the way."""
    assert text.endswith("\n\n"), text[-100:]
    out = []
    for event in text[:-2].split("\n\n"):
        assert event.startswith("data: "), event
        payload = event[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


def metrics(client: httpx.Client) -> Dict[str, float]:
    """``/metrics`` parsed with prometheus_client; sample name -> value (model label checked)."""
    out = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            assert s.labels.get("model_name") == MODEL, s
            out[s.name] = s.value
    return out


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer):
    return qwen3_tokenizer


@pytest.fixture(scope="module")
def chat_config(qwen3_chat_config):
    return qwen3_chat_config


@pytest.fixture(scope="module")
def servers(qwen3):
    with standin_engines(2, qwen3) as procs:
        yield procs


@pytest.fixture(scope="module")
def clients(servers):
    cs = [httpx.Client(base_url=s.url, timeout=TIMEOUT) for s in servers]
    yield cs
    for c in cs:
        c.close()


# ------------------------------------------------------------------------------------------
# HTTP API
# ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_completions_count_prompt_tokens_like_vllm_and_answer_deterministically(clients, tok):
    a, b = clients
    prompt = "Explain why prefix caching lowers the time to first token, in two sentences."
    ids = tok.encode(prompt).ids
    r = a.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 7},
               headers={"X-Request-Id": "req-text-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "cmpl-req-text-1" and body["object"] == "text_completion"
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert len(tok.encode(choice["text"]).ids) == 7
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 7,
                             "total_tokens": len(ids) + 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # The same prompt as token ids, on the other engine: same count, same answer.
    r2 = b.post("/v1/completions", json={"prompt": ids, "max_tokens": 7}).json()
    assert r2["usage"]["prompt_tokens"] == len(ids)
    assert r2["choices"][0]["text"] == choice["text"]
    # Another prompt, another answer.
    r3 = a.post("/v1/completions", json={"prompt": prompt + " Please.", "max_tokens": 7}).json()
    assert r3["choices"][0]["text"] != choice["text"]
    served = a.get("/standin/stats").json()["request_ids"]
    assert "cmpl-req-text-1" in served and r3["id"] in served and r2["id"] not in served


@pytest.mark.slow
def test_chat_is_tokenized_with_the_qwen3_template_and_tools(clients, tok, chat_config):
    a, _ = clients
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]
    plain = [messages[0], {"role": "user", "content": "Weather in Paris?"}]
    text = render_chat_template(plain, chat_config, add_generation_prompt=True, tools=[tool],
                                enable_thinking=False)
    assert "<tools>" in text and "<think>\n\n</think>" in text
    expected = tok.encode(text, add_special_tokens=False).ids

    req = {"model": MODEL, "messages": messages, "tools": [tool],
           "chat_template_kwargs": {"enable_thinking": False}}
    tokenized = a.post("/tokenize", json=req).json()
    assert tokenized["tokens"] == expected and tokenized["count"] == len(expected)
    r = a.post("/v1/chat/completions", json={**req, "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert body["usage"]["completion_tokens"] == 5
    # Options change the prompt: no tools, and thinking left on (template default).
    bare = a.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert bare == tok.encode(render_chat_template(plain, chat_config),
                              add_special_tokens=False).ids
    assert len(bare) < len(expected)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_chunks_join_to_the_non_streaming_text(clients, endpoint):
    a, _ = clients
    if endpoint == "chat":
        path, req = "/v1/chat/completions", {"messages": [
            {"role": "user", "content": f"Stream test {endpoint}: tell me about KV caches."}]}
    else:
        path, req = "/v1/completions", {"prompt": f"Stream test {endpoint}: KV caches are"}
    req = {**req, "model": MODEL, "max_tokens": 12}
    full = a.post(path, json=req).json()
    text = (full["choices"][0]["message"]["content"] if endpoint == "chat"
            else full["choices"][0]["text"])

    r = a.post(path, json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r.text)
    kind = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    assert {c["object"] for c in chunks} == {kind}
    assert len({c["id"] for c in chunks}) == 1
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == full["usage"][
        "prompt_tokens"] and last["usage"]["completion_tokens"] == 12
    assert all("usage" not in c for c in body)
    if endpoint == "chat":
        assert body[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        pieces = [c["choices"][0]["delta"]["content"] for c in body[1:]]
    else:
        pieces = [c["choices"][0]["text"] for c in body]
    assert len(pieces) == 12 and "".join(pieces) == text
    reasons = [c["choices"][0]["finish_reason"] for c in body]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}

    # Without include_usage: no usage anywhere, still [DONE]-terminated.
    r = a.post(path, json={**req, "stream": True})
    assert all("usage" not in c and c["choices"] for c in sse(r.text))


@pytest.mark.slow
def test_cached_tokens_report_prefix_reuse_in_whole_blocks(clients):
    a, _ = clients
    base = rand_tokens(1, 100)  # 6 full blocks + 4 tokens
    before = a.get("/standin/stats").json()

    def cached(prompt: List[int]) -> int:
        r = a.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(base) == 0
    after = a.get("/standin/stats").json()
    assert after["blocks_stored"] - before["blocks_stored"] == 6  # full prompt blocks only
    assert cached(base + rand_tokens(2, 20)) == 96  # the 6 blocks of the shared prefix
    assert cached(base[:96]) == 80  # fully cached: vLLM still computes the last token
    assert cached(rand_tokens(3, 100)) == 0
    s = a.get("/standin/stats").json()
    assert s["cached_tokens"] - before["cached_tokens"] == 96 + 80
    assert s["running"] == 0 and s["kv_cache_usage_perc"] == 0.0  # all freed, still cached


@pytest.mark.slow
def test_errors_are_vllm_error_json_and_the_server_survives(clients):
    a, _ = clients
    r = a.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `no-such-model` does not exist.",
                                  "type": "NotFoundError", "param": "model", "code": 404}}
    r = a.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"

    bad = [
        ("/v1/completions", {"max_tokens": 3}),                           # no prompt
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}),                   # out of vocabulary
        ("/v1/completions", {"prompt": ""}),
        ("/v1/completions", {"prompt": [1] * 65_530, "max_tokens": 100}),  # > max_model_len
        ("/v1/completions", {"prompt": ["a", "b"]}),                      # batch of two
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "stream_options": {"include_usage": True}}),
    ]
    for path, body in bad:
        r = a.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    r = a.post("/v1/completions", content=b"{not json", headers={"content-type":
                                                                "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400

    assert a.get("/health").status_code == 200 and a.get("/health").content == b""
    (card,) = a.get("/v1/models").json()["data"]
    assert card["id"] == MODEL and card["owned_by"] == "vllm"
    assert a.get("/standin/stats").json()["running"] == 0


# ------------------------------------------------------------------------------------------
# KV events into a real Router
# ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_second_chat_turn_routes_to_the_engine_that_served_the_first(servers, clients, tok,
                                                                     chat_config):
    router = kvroute.Router([s.worker() for s in servers], block_size=16, speculative_ttl_s=0)
    try:
        wait_subscribed(servers)  # no slow-joiner loss: both engines see the subscription
        first, other = servers[1], servers[0]  # not the first worker: no lucky tie-break
        turn1 = [{"role": "system", "content": "You are a helpful assistant for a routing "
                                               "test; answer in plain words."},
                 {"role": "user", "content": "Name three reasons to reuse a KV cache."}]
        ids1 = tok.encode(render_chat_template(turn1, chat_config),
                          add_special_tokens=False).ids
        r1 = clients[1].post("/v1/chat/completions",
                             json={"model": MODEL, "messages": turn1, "max_tokens": 20}).json()
        assert r1["usage"]["prompt_tokens"] == len(ids1)
        full_blocks = len(ids1) // 16
        assert full_blocks >= 2
        # Wait for the BlockStored events: the index holds every full block of turn 1.
        wait_for(lambda: router.find_matches(ids1)[first.url].blocks == full_blocks,
             "turn 1's blocks in the router's index")
        assert router.find_matches(ids1)[other.url].blocks == 0

        answer = r1["choices"][0]["message"]["content"]
        turn2 = turn1 + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "Now explain the second one."}]
        ids2 = tok.encode(render_chat_template(turn2, chat_config),
                          add_special_tokens=False).ids
        d = router.select_worker(ids2, explain=True)
        try:
            assert d.worker == first.url and not d.fallback and d.reason == "policy"
            assert d.matched_tokens >= 16 * (full_blocks - 1)
            r2 = httpx.post(f"{d.worker}/v1/chat/completions", timeout=TIMEOUT,
                            json={"model": MODEL, "messages": turn2, "max_tokens": 5}).json()
        finally:
            router.complete(d)
        assert r2["usage"]["prompt_tokens"] == len(ids2)
        # The engine reused exactly the blocks the router said it holds.
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == d.matched_tokens > 0
        st = router.stats()["workers"]
        assert st[first.url]["blocks_stored"] >= full_blocks and st[first.url]["gaps"] == 0
    finally:
        router.close()


# ------------------------------------------------------------------------------------------
# Load: /metrics and the ORCA header
# ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_metrics_and_orca_header_follow_running_and_waiting_requests(qwen3):
    cap, long_tokens, n = 2048, 5000, 40
    per_long = -(-(n + long_tokens) // 16)  # blocks pinned by one long request
    with EngineServerProcess(tokenizer_dir=qwen3, token_delay_s=0.02, max_num_seqs=2,
                             capacity_blocks=cap, replay=False) as srv:
        sync = httpx.Client(base_url=srv.url, timeout=TIMEOUT)

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT) as c:
                streams = []
                for seed in (11, 12):  # two long streams: read one chunk, keep them open
                    cm = c.stream("POST", "/v1/completions", json={
                        "prompt": rand_tokens(seed, n), "max_tokens": long_tokens,
                        "stream": True})
                    resp = await cm.__aenter__()
                    lines = resp.aiter_lines()
                    assert (await lines.__anext__()).startswith("data: ")
                    streams.append((cm, lines))
                m = metrics(sync)
                assert m["vllm:num_requests_running"] == 2
                assert m["vllm:num_requests_waiting"] == 0
                assert m["vllm:kv_cache_usage_perc"] == 2 * per_long / cap
                assert m["vllm:prompt_tokens_total"] == 2 * n

                # max_num_seqs=2: a third request waits; its response carries ORCA (TEXT).
                third = asyncio.ensure_future(c.post(
                    "/v1/completions", json={"prompt": rand_tokens(13, n), "max_tokens": 2},
                    headers={"endpoint-load-metrics-format": "TEXT"}))
                deadline = time.monotonic() + TIMEOUT
                while metrics(sync)["vllm:num_requests_waiting"] != 1:
                    assert not third.done(), third
                    assert time.monotonic() < deadline, "the third request never queued"
                    await asyncio.sleep(0.02)
                assert metrics(sync)["vllm:num_requests_running"] == 2
                await streams[0][0].__aexit__(None, None, None)  # client goes away
                r = await asyncio.wait_for(third, TIMEOUT)
                assert r.status_code == 200
                # Reported after the request finished: one long stream still pins its blocks.
                assert r.headers["endpoint-load-metrics"] == (
                    f"TEXT named_metrics.num_requests_waiting=0.0, "
                    f"named_metrics.kv_cache_usage_perc={per_long / cap}")

                r = await c.post("/v1/completions", json={"prompt": "json", "max_tokens": 1},
                                 headers={"endpoint-load-metrics-format": "json"})
                fmt, payload = r.headers["endpoint-load-metrics"].split(" ", 1)
                assert fmt == "JSON" and json.loads(payload) == {"named_metrics": {
                    "num_requests_waiting": 0.0, "kv_cache_usage_perc": per_long / cap}}
                for headers in ({}, {"endpoint-load-metrics-format": "xml"}):
                    r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                     headers=headers)
                    assert r.status_code == 200 and "endpoint-load-metrics" not in r.headers
                # vLLM adds it to non-streaming responses only.
                r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                          "stream": True},
                                 headers={"endpoint-load-metrics-format": "TEXT"})
                assert "endpoint-load-metrics" not in r.headers
                await streams[1][0].__aexit__(None, None, None)

        asyncio.run(scenario())
        # Disconnected streams release their blocks (they stay cached, not pinned).
        wait_for(lambda: (lambda m: m["vllm:num_requests_running"] == 0
                          and m["vllm:kv_cache_usage_perc"] == 0.0)(metrics(sync)),
                 "the disconnected streams to be released")
        m = metrics(sync)
        assert m["vllm:request_success_total"] == 5  # the aborted streams did not finish
        assert m["vllm:prefix_cache_queries_total"] == m["vllm:prompt_tokens_total"]
        sync.close()


@pytest.mark.slow
def test_a_non_streaming_request_is_aborted_when_its_client_disconnects(qwen3):
    # vLLM aborts a request whose client went away (with_cancellation), streaming or not: its
    # blocks are freed at once, not when the whole answer was generated for nobody.
    with EngineServerProcess(tokenizer_dir=qwen3, token_delay_s=0.02, replay=False) as srv:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as sync:
            for path, body in (("/v1/completions", {"prompt": "Count to a thousand:"}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Count to 1000."}]})):
                # 3000 tokens x 20 ms = 60 s: twice the poll bound below.
                with httpx.Client(base_url=srv.url, timeout=1.0) as impatient:
                    with pytest.raises(httpx.ReadTimeout):
                        impatient.post(path, json={**body, "max_tokens": 3000})
                wait_for(lambda: (lambda s: s["running"] == 0 and s["kv_cache_usage_perc"] == 0.0)(
                    sync.get("/standin/stats").json()), f"{path}: the abandoned request's abort")
            m = metrics(sync)
            assert m["vllm:request_success_total"] == 0  # aborted, not finished
            # Still serving normally afterwards.
            r = sync.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_start_detects_another_engine_answering_on_its_port(qwen3):
    with EngineServerProcess(tokenizer_dir=qwen3, replay=False) as first:
        # Fixed ports: the second engine's HTTP port is taken, nothing to retry with.
        clash = EngineServerProcess(tokenizer_dir=qwen3, port=first.port,
                                    kv_port=free_port(), replay=False)
        try:
            with pytest.raises(RuntimeError):
                clash.start(timeout=TIMEOUT)
        finally:
            clash.kill()
            os.unlink(clash.log_path)
        # Automatic ports that another engine took meanwhile (forced here): its /health
        # answers, but its kv_endpoint is not ours; start retries with new ports.
        second = EngineServerProcess(tokenizer_dir=qwen3, replay=False)
        second.port, second.url = first.port, first.url
        try:
            second.start(timeout=TIMEOUT)
            assert second.url != first.url
            assert httpx.get(f"{second.url}/standin/stats", timeout=TIMEOUT).json()[
                "kv_endpoint"] == second.kv_endpoint
        finally:
            second.stop()
            os.unlink(second.log_path)


def test_orca_header_format_matches_vllm():
    named = [("num_requests_waiting", 3.0), ("kv_cache_usage_perc", 0.25), ("bad", 1)]
    assert orca_header("TEXT", named) == {"endpoint-load-metrics": (
        "TEXT named_metrics.num_requests_waiting=3.0, named_metrics.kv_cache_usage_perc=0.25")}
    assert orca_header("Json", named) == {"endpoint-load-metrics": (
        'JSON {"named_metrics": {"num_requests_waiting": 3.0, "kv_cache_usage_perc": 0.25}}')}
    assert orca_header("", named) is None and orca_header("yaml", named) is None


# ------------------------------------------------------------------------------------------
# Crash
# ------------------------------------------------------------------------------------------

def test_kill_leaves_the_ports_closed(qwen3):
    with EngineServerProcess(tokenizer_dir=qwen3) as srv:
        assert httpx.get(f"{srv.url}/health", timeout=TIMEOUT).status_code == 200
        w = srv.worker()
        assert (w.url, w.kv_endpoint, w.replay_endpoint) == (srv.url, srv.kv_endpoint,
                                                             srv.replay_endpoint)
        srv.kill()
        assert srv.proc.returncode == -signal.SIGKILL and not srv.running
        for port in (srv.port, srv.kv_port, srv.replay_port):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{srv.url}/health", timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------
# The engine in process (no HTTP): events on the wire, eviction, admission
# ------------------------------------------------------------------------------------------

def _recv_batch(sub: zmq.Socket) -> tuple:
    assert sub.poll(TIMEOUT * 1000), "no KV event batch"
    topic, seq, payload = sub.recv_multipart()
    batch, drops = kvroute.decode_batch(payload)
    assert drops == {} and batch is not None
    return int.from_bytes(seq, "big"), batch["events"]


def test_engine_publishes_stored_and_evicted_blocks(qwen3):
    with StandinEngine(tokenizer_dir=qwen3, capacity_blocks=8, replay_endpoint=None) as eng:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(eng.kv_endpoint)
        try:
            wait_for(lambda: eng.stats()["kv_subscriptions"] >= 1, "the subscription")
            p1 = rand_tokens(21, 48)
            assert eng.prefill(p1) == 0
            seq, (ev,) = _recv_batch(sub)
            assert seq == 0 and ev["type"] == "BlockStored" and ev["medium"] == "GPU"
            assert ev["parent_block_hash"] is None and ev["block_size"] == 16
            assert ev["token_ids"] == p1 and len(ev["block_hashes"]) == 3
            h1 = ev["block_hashes"]

            p1b = p1 + rand_tokens(22, 16)
            assert eng.prefill(p1b) == 48
            seq, (ev,) = _recv_batch(sub)
            assert seq == 1 and ev["parent_block_hash"] == h1[-1]
            assert ev["token_ids"] == p1b[48:] and len(ev["block_hashes"]) == 1
            h_all = h1 + ev["block_hashes"]

            # 6 new blocks in a pool of 8 holding 4 cached: the 2 least recently freed go,
            # the prompt's tail first (vLLM frees a request's blocks in reverse order).
            p2 = rand_tokens(23, 96)
            assert eng.prefill(p2) == 0
            seq, (rm, st) = _recv_batch(sub)
            assert seq == 2 and rm["type"] == "BlockRemoved" and rm["medium"] == "GPU"
            assert rm["block_hashes"] == [h_all[3], h_all[2]]
            assert st["type"] == "BlockStored" and st["token_ids"] == p2
            assert eng.prefill(p1) == 32  # what is left of p1: its first two blocks
            s = eng.stats()
            assert (s["blocks_stored"], s["blocks_removed"], s["event_batches"]) == (11, 3, 4)
            assert s["kv_seq"] == 4
        finally:
            sub.close(0)


def test_generate_pins_blocks_and_queues_past_max_num_seqs(qwen3):
    with StandinEngine(tokenizer_dir=qwen3, capacity_blocks=16, max_num_seqs=1,
                       replay_endpoint=None, token_delay_s=0.001) as eng:
        with pytest.raises(ValueError, match="max_tokens"):
            eng.generate([1, 2, 3], 0)
        with pytest.raises(ValueError, match="maximum context length"):
            eng.generate([1] * 250, 10)

        async def scenario() -> None:
            g1 = eng.generate(rand_tokens(31, 40), 100)  # ceil(140 / 16) = 9 blocks
            first = await g1.__anext__()
            assert g1.cached_tokens == 0 and isinstance(first, int)
            s = eng.stats()
            assert s["running"] == 1 and s["kv_cache_usage_perc"] == 9 / 16
            with pytest.raises(RuntimeError, match="KV cache full"):
                eng.prefill(rand_tokens(32, 120))  # 8 blocks > 7 free
            g2 = eng.generate(rand_tokens(33, 20), 3)
            t2 = asyncio.ensure_future(g2.__anext__())
            await await_for(lambda: eng.stats()["waiting"] == 1, "g2 to queue", interval=0.005)
            assert not t2.done() and eng.stats()["running"] == 1
            await g1.aclose()  # releases its blocks, admits g2
            await asyncio.wait_for(t2, TIMEOUT)
            rest = [t async for t in g2]
            assert g2.completion_tokens == 3 and len(rest) == 2 and g2.finish_reason == "length"
            assert g1.finish_reason is None

        asyncio.run(scenario())
        s = eng.stats()
        assert (s["running"], s["waiting"], s["kv_cache_usage_perc"]) == (0, 0, 0.0)
        assert s["requests"] == 2 and s["requests_finished"] == 1


def test_engine_rejects_a_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        StandinEngine(tokenizer_dir=tmp_path)
