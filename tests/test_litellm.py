"""LiteLLM integration: LiteLLM's own Router, in process, with kvroute choosing among three
engine stand-ins (real HTTP servers speaking vLLM's OpenAI API and publishing real KV events
over ZeroMQ, tokenizing with the real Qwen3 tokenizer and chat template).

Which engine served a request is read from the engine itself (``GET /standin/stats`` lists the
response ids it served), not from LiteLLM. The deployment-killing test runs last: it kills one
of the module's engines.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import yaml
from _util import await_for, require, standin_engines, standin_stats, wait_for, wait_subscribed

# LiteLLM fetches its model price map from GitHub at import unless told to use the bundled one.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = require("litellm")

from kvroute.integrations.litellm import (  # noqa: E402
    METADATA_MATCHED_TOKENS,
    METADATA_TRIED,
    METADATA_WORKER,
    KvRouteRoutingStrategy,
    kvroute_litellm_router,
    strategy_for,
)
from kvroute.sim.server import EngineServerProcess  # noqa: E402

# Raised by pydantic while LiteLLM imports its own types; nothing of ours.
pytestmark = pytest.mark.filterwarnings("ignore:Item .* `ReadOnly` qualifier:UserWarning")

ROOT = Path(__file__).resolve().parents[1]
GROUP = "qwen3"
MODEL = "openai/Qwen/Qwen3-0.6B"


@pytest.fixture(scope="module")
def engines(qwen3: Path):
    with standin_engines(3, qwen3) as procs:
        yield procs


def _model_list(engines) -> list:
    return [{"model_name": GROUP,
             "litellm_params": {"model": MODEL, "api_base": e.url + "/v1", "api_key": "none"},
             "model_info": {"kv_events": e.kv_endpoint, "kv_replay": e.replay_endpoint}}
            for e in engines]


def _indexed(strategy: KvRouteRoutingStrategy, engine: EngineServerProcess):
    """kvroute has applied every event batch the engine published so far."""
    router = strategy.kv_router(GROUP)
    return lambda: (router.stats()["workers"][engine.url + "/v1"]["last_seq"]
                    == standin_stats(engine)["kv_seq"] - 1)


def _released(strategy: KvRouteRoutingStrategy):
    """No open decision and no in-flight load left on any worker."""
    router = strategy.kv_router(GROUP)

    def clean() -> bool:
        ws = router.stats()["workers"].values()
        return strategy.open_requests() == 0 and all(
            w["inflight_requests"] == 0 and w["pending_prefill_tokens"] == 0 for w in ws)
    return clean


@pytest.fixture
def make_router(engines, qwen3):
    made: list = []

    def make(**router_settings) -> tuple:
        live = [e for e in engines if e.running]
        before = [standin_stats(e)["kv_subscriptions"] for e in live]
        age = router_settings.pop("_age", 600.0)
        llm_router = litellm.Router(model_list=_model_list(live), **router_settings)
        strategy = KvRouteRoutingStrategy(llm_router, tokenizer=qwen3, max_request_age=age)
        strategy.install()
        made.append(strategy)
        wait_subscribed(live, before)
        return llm_router, strategy

    yield make
    for s in made:
        s.close()


def _served_by(engines, response_id: str) -> EngineServerProcess:
    hits = [e for e in engines if e.running and response_id in standin_stats(e)["request_ids"]]
    assert len(hits) == 1, f"{response_id} served by {len(hits)} engines"
    return hits[0]


def _cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_second_turn_lands_on_the_worker_that_served_the_first(engines, make_router,
                                                               mt_bench_questions):
    llm_router, strategy = make_router()
    convs = mt_bench_questions[:3]

    async def turn1(q):
        meta: dict = {}
        messages = [{"role": "user", "content": q["turns"][0]}]
        resp = await llm_router.acompletion(model=GROUP, messages=messages, max_tokens=24,
                                            metadata=meta)
        return messages, resp, meta

    async def run():
        # Concurrent first turns: the router's in-flight load spreads them.
        firsts = await asyncio.gather(*(turn1(q) for q in convs))
        servers = [_served_by(engines, resp.id) for _, resp, _ in firsts]
        for srv in set(servers):
            await await_for(_indexed(strategy, srv), f"kvroute to apply {srv.url}'s events")
        await await_for(_released(strategy), "the first turns to be released")
        seconds = []
        for q, (messages, resp, _) in zip(convs, firsts):
            meta: dict = {}
            msgs = messages + [{"role": "assistant", "content": resp.choices[0].message.content},
                               {"role": "user", "content": q["turns"][1]}]
            r2 = await llm_router.acompletion(model=GROUP, messages=msgs, max_tokens=8,
                                              metadata=meta)
            seconds.append((r2, meta))
        await await_for(_released(strategy), "the second turns to be released")
        return firsts, servers, seconds

    firsts, servers, seconds = asyncio.run(run())
    for (_, _, meta), srv in zip(firsts, servers):
        assert meta[METADATA_WORKER] == srv.url + "/v1"     # kvroute's choice is who served
    assert len({s.url for s in servers}) >= 2               # not all piled on one engine
    for (resp2, meta2), srv1 in zip(seconds, servers):
        assert _served_by(engines, resp2.id) is srv1
        assert _cached(resp2) > 0
        # kvroute's prefix match is exactly the engine's prefix-cache hit: both tokenized the
        # conversation (chat template included) to the same ids.
        assert meta2[METADATA_MATCHED_TOKENS] == _cached(resp2)
    stats = strategy.stats()
    assert stats["routed"] == 6 and stats["released"]["success"] == 6
    assert stats["tokenize_errors"] == 0


@pytest.mark.slow
def test_text_completion_is_tokenized_as_a_completion(engines, make_router, mt_bench_questions):
    llm_router, strategy = make_router()
    prompt = " ".join(mt_bench_questions[10]["turns"]) + " " + mt_bench_questions[11]["turns"][0]

    async def run():
        r1 = await llm_router.atext_completion(model=GROUP, prompt=prompt, max_tokens=4)
        srv = _served_by(engines, r1.id)
        await await_for(_indexed(strategy, srv), "kvroute to apply the engine's events")
        await await_for(_released(strategy), "the first request to be released")
        m2: dict = {}
        r2 = await llm_router.atext_completion(model=GROUP, prompt=prompt + " Answer briefly.",
                                               max_tokens=4, metadata=m2)
        await await_for(_released(strategy), "the second request to be released")
        return srv, r2, m2

    srv, r2, m2 = asyncio.run(run())
    assert _served_by(engines, r2.id) is srv
    # Tokenized as a chat (template around it), the prompt would match nothing the engine
    # stored for the completion.
    assert m2[METADATA_MATCHED_TOKENS] == _cached(r2) > 0


@pytest.mark.slow
def test_load_is_released_after_success_stream_and_failure(engines, make_router,
                                                           mt_bench_questions):
    llm_router, strategy = make_router()
    router = strategy.kv_router(GROUP)
    messages = [{"role": "user", "content": mt_bench_questions[20]["turns"][0]}]

    async def run():
        stream = await llm_router.acompletion(model=GROUP, messages=messages, max_tokens=8,
                                              stream=True)
        # Routed, not yet read: the decision is open and loads exactly one worker.
        assert strategy.open_requests() == 1
        inflight = [w["inflight_requests"] for w in router.stats()["workers"].values()]
        assert sorted(inflight) == [0, 0, 1]
        chunks = [c async for c in stream]
        assert len(chunks) >= 8
        await llm_router.acompletion(model=GROUP, messages=messages, max_tokens=4)
        with pytest.raises(litellm.BadRequestError):   # longer than the engine's max_model_len
            await llm_router.acompletion(model=GROUP, messages=messages, max_tokens=10**7)
        await await_for(_released(strategy), "every decision to be released")

    asyncio.run(run())
    released = strategy.stats()["released"]
    assert released["success"] == 2 and released["failure"] == 1


@pytest.mark.slow
def test_sync_completion_routes_and_releases(engines, make_router, mt_bench_questions):
    llm_router, strategy = make_router()
    q = mt_bench_questions[30]
    messages = [{"role": "user", "content": q["turns"][0]}]
    r1 = llm_router.completion(model=GROUP, messages=messages, max_tokens=16)
    srv = _served_by(engines, r1.id)
    wait_for(_indexed(strategy, srv), "kvroute to apply the engine's events")
    wait_for(_released(strategy), "the first request to be released")
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": q["turns"][1]}]
    r2 = llm_router.completion(model=GROUP, messages=messages, max_tokens=4)
    assert _served_by(engines, r2.id) is srv and _cached(r2) > 0
    wait_for(_released(strategy), "the second request to be released")
    assert strategy.stats()["released"]["success"] == 2


@pytest.mark.slow
def test_abandoned_stream_is_released_after_max_request_age(engines, make_router,
                                                            mt_bench_questions):
    llm_router, strategy = make_router(_age=2.0)
    messages = [{"role": "user", "content": mt_bench_questions[40]["turns"][0]}]

    async def run():
        stream = await llm_router.acompletion(model=GROUP, messages=messages, max_tokens=4,
                                              stream=True)
        assert strategy.open_requests() == 1
        await asyncio.sleep(2.5)     # only a lower bound: the next routing call expires it
        await llm_router.acompletion(model=GROUP, messages=messages, max_tokens=4)
        await await_for(_released(strategy), "every decision to be released")
        return stream

    asyncio.run(run())
    assert strategy.stats()["expired"] == 1


@pytest.mark.slow
def test_config_file_and_strategy_lookup(engines, qwen3):
    with open(ROOT / "examples" / "litellm_config.yaml") as f:
        cfg = yaml.safe_load(f)
    live = [e for e in engines if e.running]
    for dep, e in zip(cfg["model_list"], live):
        dep["litellm_params"]["api_base"] = e.url + "/v1"
        dep["model_info"].update(kv_events=e.kv_endpoint, kv_replay=e.replay_endpoint)
    cfg["kvroute_settings"]["tokenizer"] = str(qwen3)
    cfg["model_list"].append({"model_name": "plain", "litellm_params": {
        "model": MODEL, "api_base": live[0].url + "/v1", "api_key": "none"}})
    before = [standin_stats(e)["kv_subscriptions"] for e in live]
    llm_router = kvroute_litellm_router(cfg)
    strategy = strategy_for(llm_router)
    try:
        assert strategy is not None and set(strategy.stats()["groups"]) == {GROUP}
        wait_subscribed(live, before)
        r = llm_router.completion(model=GROUP, messages=[{"role": "user", "content": "Hi"}],
                                  max_tokens=2)
        assert r.choices[0].finish_reason == "length"
        llm_router.completion(model="plain", messages=[{"role": "user", "content": "Hi"}],
                              max_tokens=2)
        assert strategy.stats()["shuffled"] == 1          # not a kvroute group: LiteLLM's choice
        wait_for(_released(strategy), "every decision to be released")
    finally:
        strategy.close()
    assert strategy_for(llm_router) is None


def test_bad_configurations_are_refused(qwen3):
    dep = {"model_name": GROUP, "litellm_params": {"model": MODEL, "api_key": "none"},
           "model_info": {"kv_events": "tcp://127.0.0.1:9"}}
    with pytest.raises(ValueError, match="api_base"):
        KvRouteRoutingStrategy(litellm.Router(model_list=[dep]))
    deps = [{"model_name": GROUP,
             "litellm_params": {"model": MODEL, "api_base": f"http://127.0.0.1:{p}/v1",
                                "api_key": "none"},
             "model_info": {"kv_events": f"tcp://127.0.0.1:{p}", "kv_block_size": bs}}
            for p, bs in ((9, 16), (10, 32))]
    with pytest.raises(ValueError, match="kv_block_size"):
        KvRouteRoutingStrategy(litellm.Router(model_list=deps))
    with pytest.raises(ValueError, match="kvroute_settings"):
        kvroute_litellm_router({"model_list": deps[:1], "kvroute_settings": {"cache_weigth": 1}})
    with pytest.raises(ValueError, match="model_list"):
        kvroute_litellm_router({"router_settings": {}})
    with pytest.raises(ValueError, match="max_request_age"):
        KvRouteRoutingStrategy(litellm.Router(model_list=deps[:1]), max_request_age=0)


@pytest.mark.slow
def test_killed_deployment_is_routed_around(engines, make_router, mt_bench_questions):
    """Runs last: kills the engine holding a conversation's prefix. kvroute still prefers it
    (its blocks are indexed), the connection is refused, LiteLLM retries and kvroute excludes
    the worker this request already failed on; LiteLLM's cooldown then keeps it out."""
    # LiteLLM cools a deployment down once its failures this minute exceed allowed_fails.
    llm_router, strategy = make_router(num_retries=2, allowed_fails=0, cooldown_time=60)
    q = mt_bench_questions[50]
    messages = [{"role": "user", "content": q["turns"][0]}]

    async def run():
        r1 = await llm_router.acompletion(model=GROUP, messages=messages, max_tokens=16)
        victim = _served_by(engines, r1.id)
        await await_for(_indexed(strategy, victim), "kvroute to apply the engine's events")
        await await_for(_released(strategy), "the first request to be released")
        victim.kill()
        msgs = messages + [{"role": "assistant", "content": r1.choices[0].message.content},
                           {"role": "user", "content": q["turns"][1]}]
        meta: dict = {}
        r2 = await llm_router.acompletion(model=GROUP, messages=msgs, max_tokens=4, metadata=meta)
        later = []
        for _ in range(3):
            m: dict = {}
            await llm_router.acompletion(model=GROUP, messages=msgs, max_tokens=4, metadata=m)
            later.append(m)
        await await_for(_released(strategy), "every decision to be released")
        return victim, r2, meta, later

    victim, r2, meta, later = asyncio.run(run())
    dead = victim.url + "/v1"
    assert meta[METADATA_TRIED] == [dead]                 # kvroute chose the prefix holder first
    assert meta[METADATA_WORKER] != dead and _served_by(engines, r2.id) is not victim
    # LiteLLM put the dead deployment in cooldown after that failure: no request tries it again.
    assert all(m[METADATA_TRIED] == [] and m[METADATA_WORKER] != dead for m in later)
    stats = strategy.stats()
    assert stats["by_worker"][dead] == 2 and stats["released"]["failure"] == 1
    assert stats["released"]["success"] == 5
