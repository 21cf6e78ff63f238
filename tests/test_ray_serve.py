"""Ray Serve integration: `KvRouteRequestRouter` in front of real replicas on a local Ray.

Three `StandinLLMServer` replicas (the CPU engine stand-in: real Qwen3 tokenizer and chat
template, vLLM-like prefix cache, real vLLM-format KV events over ZeroMQ on 127.0.0.1) serve
real MT-Bench two-turn conversations through a deployment handle. With kvroute as the
deployment's request router, every second turn must land on the replica that served the
first and reuse its cached blocks; with Ray's default router (power of two choices) on the
same replicas, second turns scatter and find nothing cached.

Skipped when ``ray[serve]`` is not installed or the shared data is absent.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Dict, List

import numpy as np
import pytest
from _util import require, wait_for

require("ray.serve")

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402

from kvroute.integrations.ray_serve import (  # noqa: E402
    KV_EVENT_METADATA_KEY,
    KvRouteRequestRouter,
    kv_event_metadata,
    kv_routing_stats,
    live_routers,
    prompt_of,
)
from kvroute.sim.ray_replica import StandinLLMServer  # noqa: E402

N_REPLICAS = 3
N_CONVERSATIONS = 8
TIMEOUT_S = 60.0


wait_until = functools.partial(wait_for, timeout=TIMEOUT_S)  # a local Ray is slow to settle


def applied_seq(kv: Any, worker: str) -> int:
    """Sequence number of the last KV-event batch the router applied for a worker, or -1."""
    seq = kv.stats()["workers"][worker]["last_seq"]
    return -1 if seq is None else seq


# ------------------------------------------------------------------------------------------
# The convention, without a cluster
# ------------------------------------------------------------------------------------------

def test_prompt_of_reads_the_documented_convention() -> None:
    ids, path, body = prompt_of([], {"prompt_token_ids": [1, 2, 3]})
    assert ids.dtype == np.uint32 and ids.tolist() == [1, 2, 3] and path is None
    ids, path, _ = prompt_of([{"prompt_token_ids": [5, 6]}], {})
    assert ids.tolist() == [5, 6]
    ids, path, _ = prompt_of([{"prompt": [[7, 8, 9]]}], {})  # OpenAI: one prompt, as ids
    assert ids.tolist() == [7, 8, 9]
    ids, path, body = prompt_of([{"prompt": "hello"}], {})
    assert ids is None and path == "/v1/completions" and body == {"prompt": "hello"}
    msgs = [{"role": "user", "content": "hi"}]
    ids, path, body = prompt_of([], {"request": {"messages": msgs}})
    assert ids is None and path == "/v1/chat/completions" and body["messages"] == msgs

    class Model:  # a pydantic-like request object (Ray Serve LLM's CompletionRequest)
        def model_dump(self) -> Dict[str, Any]:
            return {"prompt": [4, 2]}

    assert prompt_of([Model()], {})[0].tolist() == [4, 2]
    # Nothing to route on: a batch of prompts, an HTTP request object, no arguments.
    assert prompt_of([{"prompt": ["a", "b"]}], {})[:2] == (None, None)
    assert prompt_of([object()], {}) == (None, None, None)
    assert prompt_of([], {}) == (None, None, None)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        prompt_of([{"prompt_token_ids": [1, -2]}], {})


def test_replica_side_dicts() -> None:
    meta = kv_event_metadata("tcp://*:5557", replay_endpoint="tcp://0.0.0.0:6557",
                             block_size=16, node_ip="10.1.2.3")
    assert meta == {"endpoint": "tcp://10.1.2.3:5557", "replay_endpoint": "tcp://10.1.2.3:6557",
                    "dp_rank": None, "block_size": 16}
    stats = kv_routing_stats(meta, num_requests_waiting=2, kv_cache_usage_perc=0.25)
    assert stats[KV_EVENT_METADATA_KEY] == meta
    assert stats["num_requests_waiting"] == 2.0 and stats["kv_cache_usage_perc"] == 0.25
    assert abs(stats["load_ts"] - time.time()) < 60
    assert "load_ts" not in kv_routing_stats(meta)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        kv_event_metadata("5557")
    with pytest.raises(ValueError, match="no port yet"):
        kv_event_metadata("tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match=r"kv_cache_usage_perc must be in \[0, 1\]"):
        kv_routing_stats(meta, kv_cache_usage_perc=42)


def test_unknown_router_option_is_named() -> None:
    router = object.__new__(KvRouteRequestRouter)  # initialize_state validates before state
    with pytest.raises(ValueError, match="unknown KvRouteRequestRouter option.*cache_wieght"):
        router.initialize_state(cache_wieght=0.5)
    with pytest.raises(ValueError, match="cache_weight"):
        router.initialize_state(cache_weight=2.0)


# ------------------------------------------------------------------------------------------
# On a local Ray
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_dir(qwen3) -> str:
    return str(qwen3)


@pytest.fixture(scope="module")
def conversations(mt_bench_questions) -> List[List[str]]:
    """MT-Bench two-turn questions, one per category (every 10th question)."""
    return [q["turns"] for q in mt_bench_questions[::10][:N_CONVERSATIONS]]


@pytest.fixture(scope="module")
def local_serve(tokenizer_dir):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # Handles only: no HTTP proxy (its router would subscribe to the replicas too).
    serve.start(proxy_location="Disabled")
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def _deployment(name: str, router_config: RequestRouterConfig | None) -> Any:
    opts: Dict[str, Any] = dict(name=name, num_replicas=N_REPLICAS,
                                ray_actor_options={"num_cpus": 0})
    if router_config is not None:
        opts["request_router_config"] = router_config
    return serve.deployment(StandinLLMServer, **opts)


def _turns(turns: List[str], first_answer: str | None) -> Dict[str, Any]:
    msgs = [{"role": "user", "content": turns[0]}]
    if first_answer is not None:
        msgs += [{"role": "assistant", "content": first_answer},
                 {"role": "user", "content": turns[1]}]
    return {"messages": msgs, "max_tokens": 8}


@pytest.fixture(scope="module")
def kv_app(local_serve, tokenizer_dir):
    """Three replicas behind KvRouteRequestRouter (routing on real KV events only:
    speculative_ttl_s=0 turns off the router's guess of what a replica is about to cache)."""
    config = RequestRouterConfig(
        request_router_class=KvRouteRequestRouter,
        request_router_kwargs={"tokenizer_dir": tokenizer_dir, "speculative_ttl_s": 0.0},
        request_routing_stats_period_s=1.0)
    dep = _deployment("standin", config)
    args = dict(kv_host="127.0.0.1", capacity_blocks=1024, min_kv_subscribers=1)
    handle = serve.run(dep.bind(tokenizer_dir, **args), name="kv", route_prefix=None)
    # The handle's request router is built on its first request; a prompt shorter than one
    # block leaves no KV events behind.
    handle.remote({"prompt": "hi", "max_tokens": 1}).result(timeout_s=TIMEOUT_S)
    router = wait_until(lambda: next((r for r in live_routers() if r.app_name == "kv"), None),
                        "the handle's KvRouteRequestRouter")
    wait_until(lambda: router.kvroute_router is not None
               and len(router.kvroute_router.workers) == N_REPLICAS, "3 kvroute workers")
    try:
        yield handle, router, dep, args
    finally:
        serve.delete("kv", _blocking=False)  # its replicas stop while the next tests run


@pytest.mark.slow
def test_second_turn_lands_on_the_replica_that_served_the_first(kv_app, conversations) -> None:
    handle, router, _, _ = kv_app
    kv = router.kvroute_router
    stats = kv.stats()["workers"]
    assert all(w["endpoint"].startswith("tcp://127.0.0.1:") for w in stats.values())

    firsts, seconds = [], []
    for turns in conversations:
        r1 = handle.remote(_turns(turns, None)).result(timeout_s=TIMEOUT_S)
        # Route the second turn only once the router has applied every KV-event batch the
        # first turn's replica published (no race with the event path).
        wait_until(lambda r1=r1: applied_seq(kv, r1["replica"]) >= r1["kv_seq"] - 1,
                   f"{r1['replica']}'s events up to {r1['kv_seq'] - 1}")
        # ... and once Ray has reported the first turn complete (on_request_completed runs
        # on the router's loop, after .result() returns), so no stale in-flight load weighs
        # against the replica: this checks prefix affinity, not the load trade-off.
        wait_until(lambda: router.inflight() == 0, "the first turn released")
        r2 = handle.remote(_turns(turns, r1["text"])).result(timeout_s=TIMEOUT_S)
        firsts.append(r1)
        seconds.append(r2)

    assert [r["replica"] for r in seconds] == [r["replica"] for r in firsts], (
        firsts, seconds, router.routing_counts())
    # The whole first-turn prompt is a prefix of the second turn's: all its full blocks hit.
    assert ([r["cached_tokens"] for r in seconds]
            == [16 * (r["prompt_tokens"] // 16) for r in firsts])
    assert all(r["cached_tokens"] > 0 for r in seconds)
    # First turns went to different replicas over the run (balanced, not one hot replica).
    assert len({r["replica"] for r in firsts}) >= 2
    counts = router.routing_counts()
    assert counts.get("kvroute", 0) >= N_CONVERSATIONS  # every second turn, at least


@pytest.mark.slow
def test_load_is_released_when_requests_finish(kv_app, conversations) -> None:
    handle, router, _, _ = kv_app
    kv = router.kvroute_router
    wait_until(lambda: router.inflight() == 0, "no request in flight in the request router")
    before = router.routing_counts().get("released", 0)
    n = 4
    refs = [handle.remote(_turns(turns, None)) for turns in conversations[:n]]
    for r in refs:
        r.result(timeout_s=TIMEOUT_S)
    wait_until(lambda: router.inflight() == 0, "every request released")
    workers = kv.stats()["workers"]
    assert all(w["inflight_requests"] == 0 and w["pending_prefill_tokens"] == 0
               for w in workers.values()), workers
    assert router.routing_counts().get("released", 0) - before >= n


@pytest.mark.slow
def test_replica_load_reaches_the_router(kv_app) -> None:
    _, router, _, _ = kv_app
    kv = router.kvroute_router
    # record_routing_stats -> controller -> long poll -> update_replicas -> update_load.
    wait_until(lambda: all(w["kv_cache_usage_perc"] is not None
                           for w in kv.stats()["workers"].values()),
               "kv_cache_usage_perc of every replica")


@pytest.mark.slow
def test_a_dead_replica_is_replaced_by_a_new_worker(kv_app, conversations) -> None:
    """A replica dies (SIGKILL-like ``ray.kill``): its worker goes, Serve's replacement
    becomes a worker with its own KV-event endpoint, and requests reach the new set."""
    handle, router, _, _ = kv_app
    kv = router.kvroute_router
    before = {w.name: w.kv_endpoint for w in kv.workers}
    victim = sorted(before)[0]
    # A replica actor's name is its full id (the kvroute worker name), in Serve's namespace.
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    wait_until(lambda: victim not in {w.name for w in kv.workers}
               and len(kv.workers) == N_REPLICAS, "the dead replica's worker replaced")
    after = {w.name: w.kv_endpoint for w in kv.workers}
    (new,) = set(after) - set(before)
    assert after[new] is not None and after[new] not in before.values()
    assert {worker for worker in after} == {router.worker_of(rid) for rid in router.curr_replicas}
    r = handle.remote(_turns(conversations[0], None)).result(timeout_s=TIMEOUT_S)
    assert r["replica"] in after


@pytest.mark.slow
def test_a_full_replica_passes_the_request_to_the_next_rank(local_serve, tokenizer_dir) -> None:
    """Two replicas taking one request at a time (``max_ongoing_requests=1``, ~1 s each).
    Two concurrent requests share a prefix cached on replica A: kvroute ranks A first for
    both, Ray finds A full for the second and sends it to the next rank, B, and the request
    router moves that request's load to B (``on_request_routed``)."""
    config = RequestRouterConfig(request_router_class=KvRouteRequestRouter,
                                 request_router_kwargs={"speculative_ttl_s": 0.0},
                                 request_routing_stats_period_s=1.0)
    dep = serve.deployment(StandinLLMServer, name="standin", num_replicas=2,
                           max_ongoing_requests=1, ray_actor_options={"num_cpus": 0},
                           request_router_config=config)
    handle = serve.run(dep.bind(tokenizer_dir, kv_host="127.0.0.1", capacity_blocks=1024,
                                token_delay_s=0.05, min_kv_subscribers=1),
                       name="busy", route_prefix=None)
    try:
        prefix = list(range(1000, 1480))  # 30 blocks, as token ids (no tokenizer needed)

        def body(i: int) -> Dict[str, Any]:
            return {"prompt_token_ids": prefix + list(range(2000 + 32 * i, 2032 + 32 * i)),
                    "max_tokens": 20}

        handle.remote({"prompt": "hi", "max_tokens": 1}).result(timeout_s=TIMEOUT_S)
        router = wait_until(lambda: next((r for r in live_routers() if r.app_name == "busy"),
                                         None), "the handle's KvRouteRequestRouter")
        kv = router.kvroute_router
        warm = handle.remote(body(0)).result(timeout_s=TIMEOUT_S)
        wait_until(lambda: applied_seq(kv, warm["replica"]) >= warm["kv_seq"] - 1
                   and router.inflight() == 0, "the warm-up's events, and its release")
        r1, r2 = [handle.remote(body(i)) for i in (1, 2)]
        outs = [r1.result(timeout_s=TIMEOUT_S), r2.result(timeout_s=TIMEOUT_S)]
        on_a = [o for o in outs if o["replica"] == warm["replica"]]
        on_b = [o for o in outs if o["replica"] != warm["replica"]]
        assert len(on_a) == 1 and len(on_b) == 1, outs
        assert on_a[0]["cached_tokens"] == len(prefix) and on_b[0]["cached_tokens"] == 0
        assert router.routing_counts().get("reaccounted", 0) >= 1
        wait_until(lambda: router.inflight() == 0, "both requests released")
        assert all(w["inflight_requests"] == 0 for w in kv.stats()["workers"].values())
    finally:
        serve.delete("busy", _blocking=False)


@pytest.mark.slow
def test_control_ray_default_router_scatters_second_turns(local_serve, tokenizer_dir,
                                                          conversations) -> None:
    """Same replicas and conversations, Ray's default router (power of two choices, blind
    to the prefix cache): a second turn lands on its first turn's replica only by chance
    (about 1 in 3 here), so at least one of 8 goes elsewhere (all 8 by chance: ~1.5e-4)
    and finds nothing cached."""
    handle = serve.run(_deployment("standin", None).bind(tokenizer_dir, kv_host="127.0.0.1",
                                                         capacity_blocks=1024),
                       name="p2c", route_prefix=None)
    try:
        pairs = []
        for turns in conversations:
            r1 = handle.remote(_turns(turns, None)).result(timeout_s=TIMEOUT_S)
            r2 = handle.remote(_turns(turns, r1["text"])).result(timeout_s=TIMEOUT_S)
            pairs.append((r1, r2))
    finally:
        serve.delete("p2c", _blocking=False)
    moved = [(r1, r2) for r1, r2 in pairs if r2["replica"] != r1["replica"]]
    assert moved, "Ray's default router kept every conversation on one replica"
    assert all(r2["cached_tokens"] == 0 for _, r2 in moved)
    stayed = [r2 for r1, r2 in pairs if r2["replica"] == r1["replica"]]
    assert all(r2["cached_tokens"] > 0 for r2 in stayed)
