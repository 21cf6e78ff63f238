"""Policy config objects (kvroute.policies): same decisions as the string form, the native
defaults, deprecated names, validation messages, picklable decisions, settable cache_weight,
and no import cycles inside the package."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pickle
import warnings
from pathlib import Path

import pytest

import kvroute
import kvroute.wire as W
from kvroute import Router, _core, policies
from kvroute.config import load_config
from kvroute.lmcache import LMCacheSource
from kvroute.policies import (
    CacheAware,
    ConsistentHash,
    Cost,
    KvAware,
    LeastLoad,
    LmcacheAware,
    PowerOfTwo,
    Random,
    RendezvousHash,
    RoundRobin,
)

BS = 16
NAMES = ["http://w0", "http://w1", "http://w2"]
PKG = Path(kvroute.__file__).resolve().parent


def _store(r: Router, worker: str, first_hash: int, tokens: list) -> None:
    n = len(tokens) // BS
    assert r.ingest(worker, W.encode_batch([W.stored(list(range(first_hash, first_hash + n)),
                                                     None, tokens[: n * BS], BS)]))


def _fields(d) -> dict:
    """Every public data attribute of a Decision / WorkerScore, scores as lists of dicts."""
    out = {}
    for name in dir(d):
        if name.startswith("_"):
            continue
        v = getattr(d, name)
        if callable(v):
            continue
        out[name] = [_fields(s) for s in v] if name == "scores" else v
    return out


def _decisions(r: Router) -> list:
    """A fixed request sequence on a router with three workers' prefixes indexed."""
    shared = list(range(1000, 1000 + 4 * BS))
    for i, w in enumerate(NAMES):
        _store(r, w, 100 * (i + 1), shared[: (i + 2) * BS // 2 * 2] + [7 + i] * BS * i)
    r.update_load(NAMES[0], num_requests_waiting=3)
    out = []
    for k in range(12):
        prompt = shared[: (k % 4 + 1) * BS] + [50 + k] * BS
        d = r.select_worker(prompt, explain=True, session_key=f"s{k % 5}", now=float(k))
        out.append(_fields(d))
        if k % 3 == 0:
            r.complete(d)
    return out


# -- the object form decides as the string form ------------------------------------------------

CASES = [
    (KvAware(cache_weight=0.4), "kv_aware", {"cache_weight": 0.4}),
    (Cost(prefill_load_scale=2.0, temperature=0.0), "cost",
     {"prefill_load_scale": 2.0, "temperature": 0.0}),
    (CacheAware(cache_threshold=0.5, balance_abs_threshold=8, balance_rel_threshold=1.2,
                eviction_interval_s=30, max_tree_size=1 << 20), "cache_aware",
     {"cache_threshold": 0.5, "balance_abs_threshold": 8, "balance_rel_threshold": 1.2,
      "eviction_interval_s": 30, "max_tree_size": 1 << 20}),
    (RoundRobin(), "round_robin", {}),
    (Random(), "random", {}),
    (PowerOfTwo(), "power_of_two", {}),
    (LeastLoad(), "least_load", {}),
    (ConsistentHash(virtual_nodes=40), "consistent_hash", {"virtual_nodes": 40}),
    (RendezvousHash(), "rendezvous_hash", {}),
]


@pytest.mark.parametrize("obj, name, flat", CASES, ids=[c[1] for c in CASES])
def test_policy_object_decides_as_the_name_with_keywords(obj, name, flat):
    assert obj.name == name
    common = dict(block_size=BS, seed=11, speculative_ttl_s=0.5)
    a = Router(NAMES, policy=obj, fallback=ConsistentHash(virtual_nodes=7)
               if name != "consistent_hash" else RoundRobin(), **common)
    b = Router(NAMES, policy=name, fallback="consistent_hash" if name != "consistent_hash"
               else "round_robin", **common, **flat, **({} if name == "consistent_hash"
                                                        else {"virtual_nodes": 7}))
    try:
        assert a.policy == b.policy == name
        oa, ob = a._core.options, b._core.options
        assert (oa.policy, oa.fallback) == (ob.policy, ob.fallback)
        for key in flat:
            assert oa.policy_params[key] == ob.policy_params[key] == getattr(obj, key)
        assert _decisions(a) == _decisions(b)
    finally:
        a.close()
        b.close()


def test_from_name_and_the_registry():
    assert policies.POLICIES == kvroute.POLICIES
    assert set(policies.POLICIES) == {n.strip() for n in _core.policy_names().split(",")}
    assert policies.from_name("kv_aware", cache_weight=0.2) == KvAware(cache_weight=0.2)
    assert policies.for_name("round_robin", {"cache_weight": 0.2}) == RoundRobin()
    assert policies.for_name("cost", {"cache_weight": 0.2, "temperature": 1}) == Cost(temperature=1)
    assert kvroute.KvAware is KvAware and kvroute.policies.ConsistentHash is ConsistentHash
    assert set(policies.FALLBACK_POLICIES) == set(policies.POLICIES) - {
        "kv_aware", "cost", "lmcache_aware"}


# -- defaults: the native ones -----------------------------------------------------------------

def _native_defaults(policy: str) -> dict:
    return {k["name"]: k["default"] for k in _core.policy_schema()[policy]}


def test_policy_defaults_are_the_cpp_defaults():
    schema = _core.policy_schema()
    assert list(schema) == list(policies.POLICIES)
    for name, cls in policies.REGISTRY.items():
        knobs = _native_defaults(name)
        assert cls().params() == knobs if name != "lmcache_aware" else \
            cls(controller_url="http://c", worker_map={"i": "a"}).params() == knobs
        for f in dataclasses.fields(cls):
            if f.name in knobs:
                assert f.default == knobs[f.name] and type(f.default) is type(knobs[f.name])
            else:
                assert f.name in cls.python_fields, (name, f.name)


def test_router_defaults_are_the_cpp_defaults():
    native = _core.RouterOptions()
    r = Router(["a"])
    try:
        o = r._core.options
        assert (o.policy, o.fallback) == (native.policy, native.fallback)
        for key in ("speculative_ttl_s", "seed", "topic", "ingest_threads", "ingest_nice",
                    "replay_timeout_s", "degraded_hold_s"):
            assert getattr(o, key) == getattr(native, key), key
        for key in ("block_size", "tier_weights", "max_blocks_per_worker", "max_blocks_total",
                    "max_speculative_blocks"):
            assert getattr(o.index, key) == getattr(native.index, key), key
        for key in ("max_payload_bytes", "max_blocks_per_event"):
            assert getattr(o.limits, key) == getattr(native.limits, key), key
        assert o.policy_params == _native_defaults(native.policy)
        assert o.fallback_params == _native_defaults(native.fallback)
        assert native.policy_params == native.fallback_params == {}  # given: none
        assert r.cache_weight == _native_defaults("kv_aware")["cache_weight"]
    finally:
        r.close()


def test_config_and_cli_defaults_are_the_cpp_defaults():
    native = _core.RouterOptions()
    kw = load_config({"mode": {"worker_urls": ["http://a"]}}).router_kwargs()
    assert kw["policy"] == KvAware() and kw["fallback"] == PowerOfTwo()
    assert kw["policy"].name == native.policy and kw["fallback"].name == native.fallback
    assert (kw["block_size"], kw["speculative_ttl_s"], kw["replay_timeout_s"],
            kw["degraded_hold_s"], kw["max_blocks_per_worker"]) == (
        native.index.block_size, native.speculative_ttl_s, native.replay_timeout_s,
        native.degraded_hold_s, native.index.max_blocks_per_worker)
    cfg = load_config({"mode": {"worker_urls": ["http://a"]}, "policy": "cache_aware"})
    assert cfg.router_kwargs()["policy"] == CacheAware()
    assert load_config({"mode": {"worker_urls": ["http://a"]},
                        "policy": "consistent_hash"}).router_kwargs()["policy"] == ConsistentHash()

    import argparse

    from kvroute import cli

    seen = {}
    real = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        ns = real(self, args, namespace)
        seen[ns.cmd] = ns
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", capture)
        for cmd in ("replay", "demo"):
            with pytest.raises(SystemExit):
                cli.main([cmd])
    assert seen["replay"].cache_weight == seen["demo"].cache_weight == \
        _native_defaults("kv_aware")["cache_weight"]
    assert seen["replay"].speculative_ttl_s == native.speculative_ttl_s
    assert seen["replay"].block_size == seen["demo"].block_size == native.index.block_size


# -- deprecated names --------------------------------------------------------------------------

@pytest.mark.parametrize("old, new, value, where", [
    ("speculative_ttl", "speculative_ttl_s", 0.25, lambda r: r._core.options.speculative_ttl_s),
    ("replay_timeout", "replay_timeout_s", 3.0, lambda r: r._core.options.replay_timeout_s),
    ("degraded_hold", "degraded_hold_s", 5.0, lambda r: r._core.options.degraded_hold_s),
    # a knob of neither kv_aware nor power_of_two: checked, kept unused
    ("eviction_interval_secs", "eviction_interval_s", 7.0,
     lambda r: r._other_knobs["eviction_interval_s"]),
    ("fallback_policy", "fallback", "least_load", lambda r: r._core.options.fallback),
])
def test_deprecated_router_keywords_warn_and_work(old, new, value, where):
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated; use '{new}'"):
        r = Router(["a"], **{old: value})
    try:
        assert where(r) == value
    finally:
        r.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Router(["a"], **{new: value}).close()  # the new name: no warning


def test_deprecated_poll_interval_secs_warns_and_works():
    with pytest.warns(DeprecationWarning, match="poll_interval_s"):
        src = LMCacheSource("http://127.0.0.1:1", {"i": "a"}, poll_interval_secs=3.0)
    assert src.poll_interval_s == 3.0
    src.close()
    with pytest.warns(DeprecationWarning, match="'poll_interval_secs' is deprecated"):
        r = Router(["a"], policy="lmcache_aware", lmcache_controller_url="http://127.0.0.1:1",
                   lmcache_worker_map={"i": "a"}, poll_interval_secs=3.0)
    assert r._lmcache.poll_interval_s == 3.0
    r.close()


def test_old_and_new_name_together_is_an_error():
    with pytest.raises(TypeError, match="not both"), pytest.warns(DeprecationWarning):
        Router(["a"], eviction_interval_secs=1.0, eviction_interval_s=2.0)
    with pytest.raises(TypeError, match="not both"), pytest.warns(DeprecationWarning):
        Router(["a"], speculative_ttl=1.0, speculative_ttl_s=0.5)


def test_yaml_secs_keys_load_without_a_warning(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("""
mode: {worker_urls: [http://a:8000]}
policy: {type: cache_aware, eviction_interval_secs: 30}
speculative_ttl_secs: 0.5
kv_events: {replay_timeout_secs: 2, degraded_hold_secs: 9}
serving:
  upstream_timeout_secs: 60
  connect_timeout_secs: 2
  circuit_breaker: {reset_secs: 4}
  scrape_metrics: {interval_secs: 2, timeout_secs: 0.25, stale_after_secs: 8}
""")
    new = tmp_path / "new.yaml"
    new.write_text(old.read_text().replace("_secs:", "_s:"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, b = load_config(old), load_config(new)
        assert a == b
        kw = a.router_kwargs()
        assert kw["policy"] == CacheAware(eviction_interval_s=30)
        assert (kw["speculative_ttl_s"], kw["replay_timeout_s"], kw["degraded_hold_s"]) == (
            0.5, 2.0, 9.0)
        assert a.serving.create_router_kwargs()["breaker_reset_s"] == 4.0
        assert a.serving.create_router_kwargs()["scrape_stale_after_s"] == 8.0
        load_config({"mode": {"worker_urls": ["http://a"]},
                     "policy": {"type": "power_of_two", "load_check_interval_secs": 5}})
        lm = load_config({"mode": {"worker_urls": ["http://a"]}, "policy": {
            "type": "lmcache_aware", "lmcache_controller_url": "http://c:9000",
            "lmcache_worker_map": {"i0": "http://a"}, "poll_interval_secs": 3}})
        assert lm.router_kwargs()["policy"] == LmcacheAware(
            controller_url="http://c:9000", worker_map={"i0": "http://a"}, poll_interval_s=3)
    with pytest.raises(ValueError, match="speculative_ttl_s and speculative_ttl_secs"):
        load_config({"mode": {"worker_urls": ["http://a"]}, "speculative_ttl_s": 1,
                     "speculative_ttl_secs": 1})


# -- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("build, message", [
    (lambda: KvAware(cache_weight=1.5),
     r"kv_aware: cache_weight must be a number in \[0, 1\], got 1.5"),
    (lambda: KvAware(cache_weight="0.5"), r"cache_weight must be a number in \[0, 1\], got '0.5'"),
    (lambda: KvAware(cache_weight=True), r"cache_weight must be a number"),
    (lambda: Cost(temperature=-1), r"cost: temperature must be a number >= 0, got -1"),
    (lambda: CacheAware(balance_rel_threshold=0.5), r"balance_rel_threshold must be a number >= 1"),
    (lambda: CacheAware(max_tree_size=0), r"max_tree_size must be an int >= 1, got 0"),
    (lambda: ConsistentHash(virtual_nodes=0),
     r"virtual_nodes must be an int in \[1, 4294967295\], got 0"),
    (lambda: ConsistentHash(virtual_nodes=1.5), r"virtual_nodes must be an int"),
    (lambda: LmcacheAware(), r"lmcache_aware needs controller_url .* and worker_map"),
    (lambda: LmcacheAware(controller_url="http://c", worker_map={"i": "a"}, lookup_mode="x"),
     r"lookup_mode must be one of occupancy, prefix_lookup, got 'x'"),
    (lambda: LmcacheAware(controller_url="http://c", worker_map={"i": "a"}, poll_interval_s=0),
     r"poll_interval_s must be a number > 0, got 0"),
    (lambda: policies.from_name("greedy"), r"unknown policy 'greedy': expected one of kv_aware"),
    (lambda: policies.from_name("round_robin", cache_weight=0.5),
     r"round_robin: unknown parameter cache_weight"),
    (lambda: Router(["a"], fallback=KvAware()), r"fallback 'kv_aware' must be a policy that needs "
                                                r"no KV events"),
    (lambda: Router(["a"], fallback="cost"), r"fallback 'cost' must be a policy that needs no KV"),
    (lambda: Router(["a"], policy=KvAware(), cache_weight=0.3),
     r"cache_weight given both as a keyword and in policy=KvAware"),
    (lambda: Router(["a"], policy=KvAware(), virtual_nodes=3),
     r"virtual_nodes is not a parameter of policy kv_aware or fallback power_of_two"),
    (lambda: Router(["a"], policy=3), r"policy must be a kvroute.policies.Policy"),
    (lambda: Router(["a"], cache_threshold=2), r"cache_threshold must be a number in \[0, 1\]"),
])
def test_bad_values_raise_value_error_saying_what_was_expected(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_unknown_router_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache_wieght'"):
        Router(["a"], cache_wieght=0.5)


def test_policy_objects_are_frozen_and_comparable():
    p = KvAware(cache_weight=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.cache_weight = 0.5  # type: ignore[misc]
    assert p == KvAware(cache_weight=1.0) and p != KvAware()
    assert {KvAware(), KvAware()} == {KvAware()}  # hashable (LmcacheAware holds a dict: not)
    assert isinstance(p.cache_weight, float)


# -- Decision pickling, settable cache_weight --------------------------------------------------

def test_decision_pickles_with_its_scores():
    r = Router(NAMES, block_size=BS, speculative_ttl_s=0, seed=1)
    try:
        prompt = list(range(3 * BS))
        _store(r, NAMES[1], 1, prompt)
        for explain in (False, True):
            d = r.select_worker(prompt + [9] * 5, explain=explain)
            back = pickle.loads(pickle.dumps(d))
            assert type(back) is type(d)
            assert _fields(back) == _fields(d)
            assert back.worker == NAMES[1] and back.matched_tokens == 3 * BS
            assert len(back.scores) == (len(NAMES) if explain else 0)
    finally:
        r.close()


def test_setting_cache_weight_changes_later_decisions():
    a, b = "http://a", "http://b"
    r = Router([a, b], block_size=BS, speculative_ttl_s=0, seed=3,
               policy=KvAware(cache_weight=1.0))
    try:
        prompt = list(range(4 * BS))
        _store(r, a, 1, prompt)                    # a holds the whole prompt ...
        r.update_load(a, num_requests_waiting=20)  # ... and is busy; b is idle and cold
        assert r.select_worker(prompt, dry_run=True).worker == a  # pure prefix affinity
        r.cache_weight = 0.0
        assert r.cache_weight == 0.0
        assert r.select_worker(prompt, dry_run=True).worker == b  # pure load
        r.cache_weight = 1
        assert r.select_worker(prompt, dry_run=True).worker == a
        for bad in (2, -0.1, "0.5", None, True):
            with pytest.raises(ValueError, match="cache_weight"):
                r.cache_weight = bad  # type: ignore[assignment]
        assert r.cache_weight == 1.0
    finally:
        r.close()


# -- layering ----------------------------------------------------------------------------------

def _imports(path: Path, name: str, lazy: bool) -> set:
    """kvroute modules ``name`` imports: when it is imported (``lazy=False``: not inside
    functions, not under ``if TYPE_CHECKING``), or anywhere (``lazy=True``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set = set()

    def add(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                parts = base.split(".")
                mod = ".".join(parts[: len(parts) - node.level + 1] + ([mod] if mod else []))
            if mod.startswith("kvroute"):
                for a in node.names:  # `from kvroute import policies`: the submodule
                    sub = f"{mod}.{a.name}"
                    out.add(sub if sub in MODULES else mod)

    def visit(nodes: list) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                add(node)
            else:
                visit(list(ast.iter_child_nodes(node)))

    if lazy:
        for node in ast.walk(tree):
            add(node)
    else:
        visit(tree.body)
    out.discard(name)
    return out & set(MODULES)


MODULES = {
    ".".join(("kvroute",) + p.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__"): p
    for p in PKG.rglob("*.py")
}
MODULES["kvroute._core"] = PKG / "_core.pyi"  # the extension module (its stub)


def _cycles(graph: dict) -> set:
    found: set = set()

    def walk(node: str, stack: list) -> None:
        for nxt in sorted(graph[node]):
            if nxt in stack:
                c = stack[stack.index(nxt):]
                k = c.index(min(c))
                found.add(tuple(c[k:] + c[:k]))
            elif len(stack) < len(graph):
                walk(nxt, stack + [nxt])

    for m in sorted(graph):
        walk(m, [m])
    return found


def _graph(lazy: bool) -> dict:
    return {m: _imports(p, m, lazy) if p.suffix == ".py" else set() for m, p in MODULES.items()}


def test_no_import_cycles_between_kvroute_modules():
    assert not _cycles(_graph(lazy=False))
    # Counting the imports inside functions too: `Router.from_config` reaches the YAML loader
    # (kvroute.config.loader), which builds Workers, not Routers; only kvroute.config.build
    # (router_from_config) imports the Router.
    assert not _cycles(_graph(lazy=True))
    g, lazy = _graph(lazy=False), _graph(lazy=True)
    assert not any(m.startswith("kvroute.config") for m in g["kvroute._router"])
    assert lazy["kvroute._router"] & {m for m in MODULES if m.startswith("kvroute.config")} \
        == {"kvroute.config.loader"}
    assert [m for m in MODULES if m.startswith("kvroute.config") and "kvroute._router" in lazy[m]] \
        == ["kvroute.config.build"]
    assert g["kvroute.policies"] == {"kvroute._core"}
    assert g["kvroute._worker"] == set()
    assert "kvroute._worker" in g["kvroute.config.workers"]
    assert "kvroute.policies" in g["kvroute.config.policy"]


def test_router_signature_reads_its_defaults_from_cpp():
    sig = inspect.signature(Router.__init__).parameters
    native = _core.RouterOptions()
    assert sig["speculative_ttl_s"].default == native.speculative_ttl_s
    assert sig["block_size"].default == native.index.block_size
    assert sig["max_blocks_per_worker"].default == (native.index.max_blocks_per_worker or None)
    assert kvroute.DEFAULT_TIER_WEIGHTS == dict(zip(("GPU", "CPU", "DISK"),
                                                    native.index.tier_weights))


# The same rule for a Router keyword and the config key that sets it.
@pytest.mark.parametrize("router_kw, config, name", [
    ({"seed": -1}, {"seed": -1}, "seed"),
    ({"seed": 1.5}, {"seed": 1.5}, "seed"),
    ({"fallback": "lmcache_aware"}, {"policy": {"type": "kv_aware",
                                                "fallback_policy": "lmcache_aware"}},
     "lmcache_aware"),
    ({"policy": "cache_aware", "balance_abs_threshold": 32.5},
     {"policy": {"type": "cache_aware", "balance_abs_threshold": 32.5}},
     "balance_abs_threshold"),
    ({"ingest_threads": 0}, {"kv_events": {"ingest_threads": 0}}, "ingest_threads"),
    ({"max_payload_bytes": 0}, {"limits": {"max_payload_bytes": 0}}, "max_payload_bytes"),
])
def test_router_keywords_and_config_keys_share_their_rules(router_kw, config, name):
    from kvroute.config import ConfigError, load_config

    with pytest.raises(ValueError, match=name):
        kvroute.Router(["a"], **router_kw)
    with pytest.raises(ConfigError, match=name):
        load_config({"mode": {"worker_urls": ["a"]}, **config})


def test_every_nested_problem_is_reported_in_one_error():
    from kvroute.config import ConfigError, load_config

    with pytest.raises(ConfigError) as ei:
        load_config({"mode": {"type": "vllm_prefill_decode", "prefill_urls": ["http://p"],
                              "decode_urls": ["http://d"], "kv_stuff": 1,
                              "decode_policy": {"type": "kv_aware", "cache_weight": 3,
                                                "bogus": 1}},
                     "model_paths": "x", "seed": -1})
    where = [p for p, _ in ei.value.problems]
    assert set(where) == {"mode", "mode.decode_policy", "mode.decode_policy.cache_weight",
                          "(top level)", "seed"}


def test_set_policy_switches_policies_and_knobs_at_run_time():
    r = Router(["a", "b"], policy=kvroute.ConsistentHash(virtual_nodes=8), block_size=BS)
    try:
        prompts = [list(range(i * 100, i * 100 + 64)) for i in range(40)]
        before = [r.select_worker(p, dry_run=True).worker for p in prompts]
        # same policy, other knob: the ring is rebuilt with the new point count
        r.set_policy(kvroute.ConsistentHash(virtual_nodes=400))
        assert r.policy == "consistent_hash"
        assert r._core.options.policy_params == {"virtual_nodes": 400}
        after = [r.select_worker(p, dry_run=True).worker for p in prompts]
        assert after != before  # 8 vs 400 points a worker place some sessions differently
        # another policy, and a fallback
        r.set_policy(kvroute.RoundRobin(), fallback=kvroute.LeastLoad())
        picks = [r.select_worker(p).worker for p in prompts[:4]]
        assert picks == ["a", "b", "a", "b"]
        o = r._core.options
        assert (o.policy, o.fallback) == ("round_robin", "least_load")
        # refused: nothing changes
        with pytest.raises(ValueError):
            r.set_policy("kv_aware", fallback="cost")
        with pytest.raises(ValueError):
            r.set_policy(kvroute.LmcacheAware(controller_url="http://127.0.0.1:1",
                                              worker_map={"i": "a"}))
        assert r._core.options.policy == "round_robin" and r.policy == "round_robin"
    finally:
        r.close()
