"""Router configuration: YAML / dict -> validated RouterConfig -> Router keyword arguments."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from _util import require

import kvroute
from kvroute import Worker
from kvroute.config import (
    FALLBACK_POLICY_TYPES,
    POLICY_TYPES,
    ConfigError,
    RouterConfig,
    load_config,
    router_from_config,
)
from kvroute.policies import (
    CacheAware,
    ConsistentHash,
    Cost,
    KvAware,
    LeastLoad,
    PowerOfTwo,
    Random,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# The keyword names router_kwargs() may use (kvroute.Router's).
ROUTER_KWARGS = {
    "policy", "fallback", "block_size", "speculative_ttl_s", "seed", "topic",
    "ingest_threads", "ingest_nice", "max_payload_bytes", "replay_timeout_s", "degraded_hold_s",
    "max_blocks_per_worker", "max_blocks_total", "max_speculative_blocks",
    "stale_after_s", "receive_hwm", "max_replay_queue_bytes", "allowed_publisher_ips",
    "curve_secret_key", "curve_allowed_publisher_keys",
}
COMMON = {
    "block_size": 16, "speculative_ttl_s": 2.0, "seed": 0, "topic": "", "ingest_threads": 1,
    "ingest_nice": 0, "replay_timeout_s": 1.0, "degraded_hold_s": 60.0,
    "max_payload_bytes": 64 << 20, "max_blocks_per_worker": 1 << 22, "max_blocks_total": 1 << 25,
    "max_speculative_blocks": 1 << 22,
    "stale_after_s": 0.0, "receive_hwm": 100_000, "max_replay_queue_bytes": 64 << 20,
    "allowed_publisher_ips": None, "curve_secret_key": None, "curve_allowed_publisher_keys": None,
}
W = {"worker_urls": ["http://a:8000", "http://b:8000"]}


def cfg(**top) -> RouterConfig:
    top.setdefault("mode", W)
    return load_config(top)


def problems(data) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(data)
    return str(ei.value)


# -- examples and defaults ---------------------------------------------------------------------

def test_example_regular_loads():
    c = load_config(EXAMPLES / "router.yaml")
    assert not c.is_pd
    kw = c.router_kwargs()
    assert set(kw) <= ROUTER_KWARGS
    assert kw == {**COMMON, "policy": KvAware(cache_weight=0.7), "fallback": PowerOfTwo()}
    ws = c.workers()
    assert all(isinstance(w, Worker) for w in ws)
    assert ws[0] == Worker("http://10.0.0.5:8000", kv_endpoint="tcp://10.0.0.5:5557",
                           replay_endpoint="tcp://10.0.0.5:5558")
    assert [w.name for w in ws[2:]] == ["http://10.0.0.7:8000|dp=0", "http://10.0.0.7:8000|dp=1"]
    assert load_config(str(EXAMPLES / "router.yaml")) == c  # str path too


def test_example_pd_loads():
    c = load_config(EXAMPLES / "router-pd.yaml")
    assert c.is_pd and c.mode.type == "pd_disaggregation"
    pk, dk = c.prefill_router_kwargs(), c.decode_router_kwargs()
    assert set(pk) <= ROUTER_KWARGS and set(dk) <= ROUTER_KWARGS
    assert pk == {**COMMON, "ingest_threads": 2, "policy": KvAware(cache_weight=0.8),
                  "fallback": LeastLoad()}
    assert dk == {**COMMON, "ingest_threads": 2, "policy": LeastLoad()}
    assert [w.url for w in c.prefill_workers()] == ["http://10.0.1.5:8000", "http://10.0.1.6:8000"]
    assert c.prefill_workers()[0].replay_endpoint == "tcp://10.0.1.5:5558"
    assert [w.kv_endpoint for w in c.decode_workers()] == ["tcp://10.0.2.5:5557",
                                                          "tcp://10.0.2.6:5557"]


def test_minimal_config_defaults():
    c = cfg()
    assert c.router_kwargs() == {**COMMON, "policy": KvAware(cache_weight=0.7),
                                 "fallback": PowerOfTwo()}
    assert c.workers() == [Worker("http://a:8000"), Worker("http://b:8000")]


def test_policy_types_match_the_router():
    assert set(POLICY_TYPES) == set(kvroute.POLICIES)
    assert set(FALLBACK_POLICY_TYPES) == set(kvroute.POLICIES) - {"kv_aware", "cost",
                                                                   "lmcache_aware"}


@pytest.mark.parametrize("ptype", POLICY_TYPES)
def test_every_policy_gives_router_keywords(ptype):
    extra = ({"lmcache_controller_url": "http://127.0.0.1:9000",
              "lmcache_worker_map": {"inst-0": "http://a:8000"}}
             if ptype == "lmcache_aware" else {})
    kw = cfg(policy={"type": ptype, **extra}).router_kwargs()
    assert kw["policy"].name == ptype
    assert set(kw) <= ROUTER_KWARGS
    # every name is a keyword of the Router (checked without building one)
    assert set(kw) <= set(inspect.signature(kvroute.Router.__init__).parameters)


def test_cache_aware_defaults_are_the_vllm_router_cli_defaults():
    kw = cfg(policy="cache_aware").router_kwargs()
    assert kw == {**COMMON, "policy": CacheAware(
        cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5,
        eviction_interval_s=120, max_tree_size=2**26)}


@pytest.mark.parametrize(
    "policy, own",
    [
        ({"type": "consistent_hash"}, {"policy": ConsistentHash(virtual_nodes=160)}),
        ({"type": "consistent_hash", "virtual_nodes": 40},
         {"policy": ConsistentHash(virtual_nodes=40)}),
        ({"type": "cost"}, {"policy": Cost(prefill_load_scale=1.0, temperature=0.0),
                            "fallback": PowerOfTwo()}),
        ({"type": "cost", "prefill_load_scale": 2, "temperature": 0.5, "fallback_policy": "random"},
         {"policy": Cost(prefill_load_scale=2.0, temperature=0.5), "fallback": Random()}),
        ({"type": "kv_aware", "cache_weight": 1}, {"policy": KvAware(cache_weight=1.0),
                                                   "fallback": PowerOfTwo()}),
        # vLLM-router key, accepted and not passed on
        ({"type": "power_of_two", "load_check_interval_secs": 10}, {"policy": PowerOfTwo()}),
        ({"type": "round_robin"}, {}),
        ({"type": "random"}, {}),
        ({"type": "least_load"}, {}),
        ({"type": "rendezvous_hash"}, {}),
    ],
)
def test_policy_parameters(policy, own):
    kw = cfg(policy=policy).router_kwargs()
    assert kw == {**COMMON, "policy": kvroute.policies.from_name(policy["type"]), **own}


def test_fallback_policy_with_parameters():
    kw = cfg(policy={"type": "kv_aware", "fallback_policy": {
        "type": "consistent_hash", "virtual_nodes": 64}}).router_kwargs()
    assert kw["fallback"] == ConsistentHash(virtual_nodes=64)
    kw = cfg(policy={"type": "cost", "fallback_policy": "cache_aware"}).router_kwargs()
    assert kw["fallback"] == CacheAware() and kw["fallback"].max_tree_size == 2**26


def test_top_level_settings_reach_the_router():
    kw = cfg(block_size=64, speculative_ttl_secs=0, seed=7,
             kv_events={"topic": "kv", "ingest_threads": 4, "ingest_nice": 5,
                        "replay_timeout_secs": 0.5, "degraded_hold_secs": 0, "stale_after_s": 30,
                        "receive_hwm": 1000, "max_replay_queue_bytes": 1 << 20,
                        "allowed_publisher_ips": ["10.0.0.5"]},
             limits={"max_blocks_per_worker": None, "max_blocks_total": 10,
                     "max_speculative_blocks": None, "max_payload_bytes": 1024}).router_kwargs()
    assert {k: v for k, v in kw.items() if k in COMMON} == {
        "block_size": 64, "speculative_ttl_s": 0.0, "seed": 7, "topic": "kv", "ingest_threads": 4,
        "ingest_nice": 5, "replay_timeout_s": 0.5, "degraded_hold_s": 0.0,
        "max_payload_bytes": 1024,
        "max_blocks_per_worker": None, "max_blocks_total": 10, "max_speculative_blocks": None,
        "stale_after_s": 30.0, "receive_hwm": 1000, "max_replay_queue_bytes": 1 << 20,
        "allowed_publisher_ips": ["10.0.0.5"], "curve_secret_key": None,
        "curve_allowed_publisher_keys": None}


def test_router_from_config_builds_a_router():
    # only keyword names the Router has always had (kv_aware policy)
    r = router_from_config({"mode": {"workers": ["w0", {"url": "w1"}]}, "seed": 3})
    try:
        assert [w.name for w in r.workers] == ["w0", "w1"] and r.policy == "kv_aware"
    finally:
        r.close()


# -- shorthands --------------------------------------------------------------------------------

def test_shorthands():
    # policy as a bare name; a policy mapping without type is kv_aware; mode type inferred
    assert cfg(policy="round_robin").policy.type == "round_robin"
    assert cfg(policy={"cache_weight": 0.2}).router_kwargs()["policy"] == KvAware(cache_weight=0.2)
    assert load_config({"mode": {"workers": ["http://a"]}}).mode.type == "regular"
    assert load_config({"mode": {"prefill": ["p"], "decode": ["d"]}}).is_pd
    # worker entries: bare URL strings, and the Worker field names as aliases
    c = load_config({"mode": {"workers": [
        "http://a", {"url": "http://b", "kv_endpoint": "tcp://b:5557",
                     "replay_endpoint": "tcp://b:5558", "dp_rank": 1, "bind": True}]}})
    assert c.workers() == [Worker("http://a"), Worker("http://b", "tcp://b:5557", 1, True,
                                                       "tcp://b:5558")]


@pytest.mark.parametrize("mtype", ["pd_disaggregation", "prefill_decode", "vllm_prefill_decode"])
def test_pd_vllm_router_form(mtype):
    c = load_config({
        "mode": {"type": mtype, "prefill_urls": [["http://p0:8000", 8998], "http://p1:8000",
                                                 ["http://p2:8000", None]],
                 "decode_urls": ["http://d0:8000"], "decode_policy": "round_robin"},
        "policy": {"type": "cost", "temperature": 0.1},
    })
    assert c.mode.type == "pd_disaggregation"
    assert [w.bootstrap_port for w in c.mode.prefill] == [8998, None, None]
    assert [w.url for w in c.prefill_workers()] == ["http://p0:8000", "http://p1:8000",
                                                    "http://p2:8000"]
    assert c.prefill_router_kwargs()["policy"] == Cost(temperature=0.1)  # falls back to `policy`
    assert c.decode_router_kwargs() == {**COMMON, "policy": kvroute.RoundRobin()}


def test_model_dump_round_trips():
    for name in ("router.yaml", "router-pd.yaml"):
        c = load_config(EXAMPLES / name)
        assert load_config(c.model_dump()) == c


def test_mode_specific_methods():
    regular, pd = cfg(), load_config(EXAMPLES / "router-pd.yaml")
    for call in (regular.prefill_workers, regular.decode_workers, regular.prefill_router_kwargs,
                 regular.decode_router_kwargs):
        with pytest.raises(ConfigError, match="pd_disaggregation"):
            call()
    for call in (pd.workers, pd.router_kwargs):
        with pytest.raises(ConfigError, match="prefill_workers"):
            call()
    with pytest.raises(ConfigError, match=r"prefill_workers\(\).*decode_router_kwargs"):
        router_from_config(EXAMPLES / "router-pd.yaml")


# -- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "data, expected",
    [
        # unknown keys: named, with what is allowed
        ({"mode": W, "blocksize": 16}, ["'blocksize'", "allowed: mode, policy", "block_size"]),
        ({"mode": W, "policy": {"type": "kv_aware", "cache_weigth": 0.5}},
         ["policy: unknown key 'cache_weigth'", "cache_weight, size_aware, fallback_policy"]),
        ({"mode": W, "policy": {"type": "round_robin", "cache_weight": 0.5}},
         ["policy: unknown key 'cache_weight'", "allowed: type"]),
        ({"mode": W, "policy": {"type": "kv_aware", "size_aware": "yes"}},
         ["policy.size_aware"]),
        ({"mode": W, "policy": {"type": "consistent_hash", "vnodes": 3, "x": 1}},
         ["unknown keys 'vnodes', 'x'", "virtual_nodes"]),
        ({"mode": {"workers": [{"url": "http://a", "kv_event": "tcp://a:1"}]}},
         ["mode.workers[0]: unknown key 'kv_event'", "kv_events"]),
        ({"mode": {"type": "regular", "workers": ["a"], "prefill": ["p"]}},
         ["mode: unknown key 'prefill'", "worker_urls"]),
        ({"mode": W, "kv_events": {"threads": 2}}, ["kv_events: unknown key 'threads'",
                                                   "ingest_threads"]),
        ({"mode": W, "limits": {"max_blocks": 2}}, ["limits: unknown key 'max_blocks'"]),
        # unknown types: every allowed one listed
        ({"mode": W, "policy": {"type": "least_loaded"}},
         ["policy: unknown type 'least_loaded'; allowed: " + ", ".join(POLICY_TYPES)]),
        ({"mode": W, "policy": "sticky"}, ["policy: unknown type 'sticky'"]),
        ({"mode": {"type": "openai", "worker_urls": ["a"]}},
         ["mode: unknown type 'openai'; allowed: regular, pd_disaggregation, prefill_decode"]),
        ({"mode": W, "policy": {"type": "kv_aware", "fallback_policy": "kv_aware"}},
         ["policy.fallback_policy", "needs KV events", ", ".join(FALLBACK_POLICY_TYPES)]),
        ({"mode": W, "policy": {"type": "cost", "fallback_policy": "cost"}}, ["needs KV events"]),
        ({"mode": W, "policy": {"type": "kv_aware", "fallback_policy": "nope"}},
         ["policy.fallback_policy: unknown type 'nope'", "least_load"]),
        # wrong types
        ({"mode": W, "block_size": "16"},
         ["block_size: Input should be a valid integer (got '16')"]),
        ({"mode": W, "block_size": True}, ["block_size", "valid integer"]),
        ({"mode": W, "block_size": 16.0}, ["block_size", "valid integer"]),
        ({"mode": W, "policy": {"cache_weight": "high"}}, ["policy.cache_weight", "valid number"]),
        ({"mode": W, "kv_events": {"topic": 5}}, ["kv_events.topic", "valid string"]),
        ({"mode": W, "kv_events": []}, ["kv_events"]),
        ({"mode": {"workers": [{"url": "http://a", "dp_rank": "0"}]}},
         ["mode.workers[0].dp_rank", "valid integer"]),
        ({"mode": {"workers": [7]}}, ["mode.workers[0]"]),
        ({"mode": {"worker_urls": "http://a"}}, ["worker_urls must be a list"]),
        ({"mode": W, "policy": 3}, ["policy"]),
        # out of range
        ({"mode": W, "policy": {"cache_weight": 1.5}},
         ["policy.cache_weight: Input should be less than or equal to 1 (got 1.5)"]),
        ({"mode": W, "policy": {"cache_weight": -0.1}}, ["policy.cache_weight", "greater than"]),
        ({"mode": W, "policy": {"type": "cache_aware", "cache_threshold": 1.01}},
         ["policy.cache_threshold"]),
        ({"mode": W, "policy": {"type": "cache_aware", "balance_rel_threshold": 0.9}},
         ["policy.balance_rel_threshold", "greater than or equal to 1"]),
        ({"mode": W, "policy": {"type": "cache_aware", "balance_abs_threshold": -1}},
         ["policy.balance_abs_threshold"]),
        ({"mode": W, "policy": {"type": "cache_aware", "max_tree_size": 0}},
         ["policy.max_tree_size"]),
        ({"mode": W, "policy": {"type": "cache_aware", "eviction_interval_secs": -5}},
         ["policy.eviction_interval_secs"]),
        ({"mode": W, "policy": {"type": "consistent_hash", "virtual_nodes": 0}},
         ["policy.virtual_nodes", "greater than or equal to 1"]),
        ({"mode": W, "policy": {"type": "cost", "temperature": -0.5}}, ["policy.temperature"]),
        ({"mode": W, "policy": {"type": "cost", "prefill_load_scale": float("inf")}},
         ["policy.prefill_load_scale"]),
        ({"mode": W, "policy": {"type": "kv_aware", "fallback_policy": {
            "type": "consistent_hash", "virtual_nodes": -1}}},
         ["policy.fallback_policy.virtual_nodes"]),
        ({"mode": W, "policy": {"type": "power_of_two", "load_check_interval_secs": 0}},
         ["policy.load_check_interval_secs"]),
        ({"mode": W, "block_size": 0}, ["block_size: Input should be greater than or equal to 1"]),
        ({"mode": W, "seed": -1}, ["seed"]),
        ({"mode": W, "speculative_ttl_secs": -1}, ["speculative_ttl_secs"]),
        ({"mode": W, "kv_events": {"ingest_threads": 0}}, ["kv_events.ingest_threads"]),
        ({"mode": W, "kv_events": {"ingest_nice": 20}}, ["kv_events.ingest_nice"]),
        ({"mode": W, "kv_events": {"replay_timeout_secs": 0}}, ["kv_events.replay_timeout_secs"]),
        ({"mode": W, "kv_events": {"degraded_hold_secs": -1}}, ["kv_events.degraded_hold_secs"]),
        ({"mode": W, "limits": {"max_blocks_total": 0}}, ["limits.max_blocks_total"]),
        ({"mode": W, "limits": {"max_payload_bytes": -1}}, ["limits.max_payload_bytes"]),
        ({"mode": {"workers": [{"url": "http://a", "dp_rank": -1}]}}, ["mode.workers[0].dp_rank"]),
        # workers
        ({"mode": {"workers": [{"url": "http://a", "kv_events": "10.0.0.5:5557"}]}},
         ["mode.workers[0].kv_events", "ZeroMQ endpoint such as tcp://"]),
        ({"mode": {"workers": [{"url": "http://a", "replay": "tcp://"}]}},
         ["mode.workers[0].replay"]),
        ({"mode": {"workers": [{"kv_events": "tcp://a:1"}]}},
         ["mode.workers[0].url: required key is missing"]),
        ({"mode": {"workers": [""]}}, ["mode.workers[0].url"]),
        ({"mode": {"workers": ["http://a", "http://b", "http://a"]}},
         ["'http://a' appears twice (entries 0 and 2)"]),
        ({"mode": {"workers": []}}, ["needs at least one worker"]),
        ({"mode": {"type": "regular"}}, ["needs workers (or worker_urls)"]),
        ({"mode": {"workers": ["a"], "worker_urls": ["b"]}}, ["either workers or worker_urls"]),
        ({"mode": {"prefill": ["p"]}}, ["needs decode (or decode_urls)"]),
        ({"mode": {"prefill": ["p"], "prefill_urls": ["q"], "decode": ["d"]}},
         ["either prefill or prefill_urls"]),
        ({"mode": {"prefill_urls": [["p", 1, 2]], "decode_urls": ["d"]}},
         ["prefill_urls[0] must be a URL string or [url, bootstrap_port]"]),
        ({"mode": {"prefill_urls": [["p", 70000]], "decode_urls": ["d"]}},
         ["mode.prefill[0].bootstrap_port"]),
        # policies per pool
        ({"mode": W, "prefill_policy": "random"},
         ["prefill_policy applies only to mode type pd_disaggregation"]),
        ({"mode": {"prefill": ["p"], "decode": ["d"], "decode_policy": "random"},
          "decode_policy": "random"}, ["decode_policy is set both"]),
        # structure
        ({}, ["mode: required key is missing"]),
        ({"mode": "regular"}, ["mode"]),
    ],
)
def test_invalid(data, expected):
    msg = problems(data)
    for part in expected:
        assert part in msg, f"{part!r} not in:\n{msg}"


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as ei:
        load_config({"mode": W, "block_size": 0, "seed": -2, "policy": {"cache_weight": 9}})
    assert [p for p, _ in ei.value.problems] == ["policy.cache_weight", "block_size", "seed"]
    assert isinstance(ei.value, ValueError)


def test_yaml_errors(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("mode:\n  worker_urls: [http://a]\nblock_size: 16\nblock_size: 32\n")
    with pytest.raises(ConfigError,
                       match=r"duplicate key 'block_size' at line 4 \(first at line 3\)"):
        load_config(p)
    p.write_text("mode: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    p.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load_config(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(p)
    p.write_text("mode:\n  worker_urls: [http://a]\npolicy: {type: kv_aware, cache_weight: 2}\n")
    with pytest.raises(ConfigError, match=r"r\.yaml\).*\n  policy\.cache_weight"):
        load_config(p)
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(TypeError):
        load_config(42)  # type: ignore[arg-type]


def test_yaml_file_matches_dict(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("mode:\n  type: regular\n  workers:\n    - url: http://a\n      kv_events: tcp://a:5557\n"
                 "policy:\n  type: consistent_hash\n  virtual_nodes: 32\nblock_size: 64\n")
    assert load_config(p) == load_config({
        "mode": {"type": "regular", "workers": [{"url": "http://a", "kv_events": "tcp://a:5557"}]},
        "policy": {"type": "consistent_hash", "virtual_nodes": 32}, "block_size": 64})


def test_config_is_immutable():
    c = cfg()
    with pytest.raises(ValueError, match="frozen"):  # pydantic's ValidationError
        c.block_size = 32  # type: ignore[misc]


def test_serving_section_defaults_and_errors():
    cfg = load_config({"mode": {"worker_urls": ["http://a:8000"]}})
    kw = cfg.serving.create_router_kwargs()
    assert kw["max_retries"] == 2 and kw["orca"] == "TEXT"
    assert kw["scrape_metrics_interval_s"] is None  # scraping off unless configured
    cfg = load_config({"mode": {"worker_urls": ["http://a:8000"]},
                       "serving": {"model": "m", "max_retries": 0, "orca": "off",
                                   "circuit_breaker": {"failures": 5},
                                   "scrape_metrics": {"interval_secs": 2}}})
    kw = cfg.serving.create_router_kwargs()
    assert (kw["max_retries"], kw["orca"], kw["breaker_failures"]) == (0, False, 5)
    assert (kw["scrape_metrics_interval_s"], kw["scrape_stale_after_s"]) == (2, 5.0)
    assert cfg.router_kwargs()  # the Router ignores the serving section
    with pytest.raises(ConfigError, match="orca"):
        load_config({"mode": {"worker_urls": ["http://a:8000"]}, "serving": {"orca": "xml"}})
    with pytest.raises(ConfigError, match="retries"):
        load_config({"mode": {"worker_urls": ["http://a:8000"]}, "serving": {"retries": 1}})


def test_create_app_takes_the_serving_section_and_arguments_win():
    fastapi_mod = require("kvroute.fastapi")
    conf = {"mode": {"worker_urls": ["http://127.0.0.1:9"]},
            "serving": {"model": "served-model", "max_retries": 0,
                        "circuit_breaker": {"failures": 7}, "orca": "json"}}
    app = fastapi_mod.create_app(conf)
    proxy = app.state.kvroute_proxy
    assert (proxy.model, proxy.max_retries, proxy.breaker_failures) == ("served-model", 0, 7)
    assert proxy.orca_format == "JSON"
    app.state.kvroute_router.close()
    app = fastapi_mod.create_app(conf, model="other", max_retries=3)
    proxy = app.state.kvroute_proxy
    assert (proxy.model, proxy.max_retries, proxy.breaker_failures) == ("other", 3, 7)
    app.state.kvroute_router.close()


# -- adaptive_cache_weight ----------------------------------------------------------------------

_REGULAR = {"mode": {"worker_urls": ["http://127.0.0.1:9"]}}


@pytest.mark.parametrize("value, kwargs", [
    (True, {}), ({}, {}), (False, None), (None, None),
    ({"min_weight": 0.4, "interval": 50, "tune_ttl": False, "max_ttl_secs": 6},
     {"min_weight": 0.4, "interval": 50, "tune_ttl": False, "max_ttl_s": 6.0}),
])
def test_adaptive_cache_weight_key(value, kwargs):
    cfg = load_config({**_REGULAR, "adaptive_cache_weight": value})
    assert cfg.adaptive_kwargs() == kwargs
    assert load_config(_REGULAR).adaptive_kwargs() is None


@pytest.mark.parametrize("value, match", [
    ("yes", r"adaptive_cache_weight: must be true, false or a mapping"),
    (0.5, r"adaptive_cache_weight: must be true, false or a mapping"),
    ({"min_weight": 0.9, "max_weight": 0.5}, r"adaptive_cache_weight: need 0 <= min_weight"),
    ({"step": 0}, r"adaptive_cache_weight\.step"),
    ({"ttl_factor": 1.0}, r"adaptive_cache_weight\.ttl_factor"),
    ({"min_ttl_s": 4, "max_ttl_s": 1}, r"adaptive_cache_weight: need 0 < min_ttl_s"),
    ({"cache_weight": 0.5}, r"adaptive_cache_weight: unknown key 'cache_weight'"),
])
def test_a_bad_adaptive_cache_weight_names_the_key(value, match):
    with pytest.raises(ConfigError, match=match):
        load_config({**_REGULAR, "adaptive_cache_weight": value})


def test_adaptive_cache_weight_needs_a_cache_weight_and_one_pool():
    with pytest.raises(ConfigError, match="policy round_robin has none"):
        load_config({**_REGULAR, "policy": "round_robin", "adaptive_cache_weight": True})
    with pytest.raises(ConfigError, match="not in prefill/decode mode"):
        load_config({"mode": {"prefill_urls": ["http://a:1"], "decode_urls": ["http://b:1"]},
                     "adaptive_cache_weight": True})


def test_create_app_attaches_the_configured_tuner():
    fastapi_mod = require("kvroute.fastapi")
    app = fastapi_mod.create_app({**_REGULAR, "speculative_ttl_s": 2.0,
                                  "adaptive_cache_weight": {"interval": 7, "max_weight": 0.8}})
    router, tuner = app.state.kvroute_router, app.state.kvroute_adaptive
    try:
        assert (tuner.interval, tuner.max_weight, tuner.ttl_s) == (7, 0.8, 2.0)
        assert tuner.router is router and tuner.observe in router.hit_rate.listeners
        assert router.cache_weight <= 0.8
    finally:
        router.close()
    app = fastapi_mod.create_app(_REGULAR)
    assert app.state.kvroute_adaptive is None
    app.state.kvroute_router.close()
