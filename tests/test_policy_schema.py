"""Each policy owns its knobs (issue 39): the native schema (`kvroute._core.policy_schema`,
declared in each cpp/scoring/<policy>.cc), the Python classes and config models checked
against it at import, and a policy and its fallback each keeping their own values."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvroute
from kvroute import Router, _core, policies
from kvroute.config import policy as config_policy
from kvroute.policies import CacheAware, ConsistentHash, KvAware

NAMES = ["http://w0", "http://w1", "http://w2"]


def test_schema_lists_every_policy_and_knob_with_its_type_default_range_and_doc():
    schema = _core.policy_schema()
    assert list(schema) == [n.strip() for n in _core.policy_names().split(",")]
    assert [k["name"] for k in schema["kv_aware"]] == ["cache_weight", "size_aware"]
    assert schema["round_robin"] == []
    types = {"bool": bool, "int": int, "float": float}
    for name, knobs in schema.items():
        for k in knobs:
            assert set(k) == {"name", "type", "default", "min", "max", "doc"}, name
            assert type(k["default"]) is types[k["type"]] and k["doc"], (name, k["name"])
            if k["type"] == "bool":
                assert k["min"] is None and k["max"] is None
            else:
                assert k["min"] <= k["default"] <= k["max"], (name, k["name"])
    vn = next(k for k in schema["consistent_hash"] if k["name"] == "virtual_nodes")
    assert (vn["type"], vn["default"], vn["min"], vn["max"]) == ("int", 160, 1, 2**32 - 1)
    cost = {k["name"]: k for k in schema["cost"]}
    assert cost["temperature"]["max"] == math.inf
    assert policies.SCHEMA == {n: tuple(k) for n, k in schema.items()}


def test_policy_and_fallback_each_keep_their_own_knobs():
    # two knobs of the same name, one per role: each keeps its value (refused before issue 39)
    r = Router(NAMES, policy=ConsistentHash(virtual_nodes=1),
               fallback=ConsistentHash(virtual_nodes=400))
    try:
        o = r._core.options
        assert o.policy_params == {"virtual_nodes": 1}
        assert o.fallback_params == {"virtual_nodes": 400}
    finally:
        r.close()
    # kv_aware with its cache_weight, a fallback with its own knobs; with no KV events the
    # fallback decides, as the same policy with the same knobs would
    prompts = [list(range(i * 100, i * 100 + 64)) for i in range(40)]
    r = Router(NAMES, policy=KvAware(cache_weight=0.9), fallback=ConsistentHash(virtual_nodes=3))
    ref = Router(NAMES, policy=ConsistentHash(virtual_nodes=3))
    other = Router(NAMES, policy=ConsistentHash(virtual_nodes=400))
    try:
        got = [r.select_worker(p, dry_run=True) for p in prompts]
        assert {d.policy for d in got} == {"consistent_hash"} and all(d.fallback for d in got)
        picks = [d.worker for d in got]
        assert picks == [ref.select_worker(p, dry_run=True).worker for p in prompts]
        assert picks != [other.select_worker(p, dry_run=True).worker for p in prompts]
        o = r._core.options
        assert o.policy_params == {"cache_weight": 0.9, "size_aware": False}
        assert o.fallback_params == {"virtual_nodes": 3}
        assert r.cache_weight == 0.9
        r.cache_weight = 0.2  # the policy's knob only
        assert r._core.options.policy_params["cache_weight"] == 0.2
        assert r._core.options.fallback_params == {"virtual_nodes": 3}
        # a new policy without a fallback: the running fallback keeps its knobs
        r.set_policy(KvAware(cache_weight=0.6))
        o = r._core.options
        assert (o.policy_params["cache_weight"], o.fallback_params) == (0.6, {"virtual_nodes": 3})
        r.set_policy(KvAware(), fallback=CacheAware(cache_threshold=0.9, max_tree_size=100))
        o = r._core.options
        assert o.policy_params["cache_weight"] == KvAware.cache_weight
        assert o.fallback_params["cache_threshold"] == 0.9
        assert o.fallback_params["max_tree_size"] == 100
        assert "cache_weight" not in o.fallback_params
    finally:
        for x in (r, ref, other):
            x.close()


def test_flat_keywords_set_the_knob_of_each_role_that_has_it():
    r = Router(NAMES, policy="consistent_hash", fallback="consistent_hash", virtual_nodes=9)
    try:
        o = r._core.options
        assert o.policy_params == o.fallback_params == {"virtual_nodes": 9}
    finally:
        r.close()
    r = Router(NAMES, policy="round_robin", cache_weight=0.3)  # a knob of neither: kept, unused
    try:
        assert r.cache_weight == 0.3
        r.cache_weight = 0.4
        assert r.cache_weight == 0.4 and r._core.options.policy_params == {}
    finally:
        r.close()


def test_native_set_policy_refuses_a_knob_of_another_policy():
    r = Router(NAMES)
    try:
        o = r._core.options
        with pytest.raises(ValueError, match="power_of_two: unknown parameter cache_weight"):
            r._core.set_policy("kv_aware", {}, "power_of_two", {"cache_weight": 0.5})
        with pytest.raises(ValueError, match=r"kv_aware: cache_weight must be a number in "
                                             r"\[0, 1\], got 2"):
            r._core.set_policy("kv_aware", {"cache_weight": 2.0}, "power_of_two", {})
        with pytest.raises(ValueError, match="kv_aware: size_aware must be true or false"):
            r._core.set_policy_param("size_aware", 1)
        assert r._core.options.policy_params == o.policy_params  # nothing changed
    finally:
        r.close()


# -- the checks at import ------------------------------------------------------------------------

def _knob(schema: dict, policy: str, name: str) -> dict:
    return next(k for k in schema[policy] if k["name"] == name)


def test_a_class_that_disagrees_with_the_schema_is_named():
    schema = copy.deepcopy(_core.policy_schema())
    assert policies.schema_problems(schema, policies.REGISTRY) == []
    _knob(schema, "kv_aware", "cache_weight")["default"] = 0.8
    _knob(schema, "consistent_hash", "virtual_nodes")["type"] = "float"
    schema["cost"].append({"name": "decay", "type": "float", "default": 0.0, "min": 0.0,
                           "max": 1.0, "doc": "new"})
    schema["cache_aware"] = [k for k in schema["cache_aware"] if k["name"] != "max_tree_size"]
    problems = policies.schema_problems(schema, policies.REGISTRY)
    assert problems == [
        "kv_aware.cache_weight: default 0.7 here, 0.8 native",
        "cost.decay: a native knob, no field of Cost",
        "cache_aware.max_tree_size: a field of CacheAware, no native knob (list it in "
        "CacheAware.python_fields if it is Python's own)",
        "consistent_hash.virtual_nodes: type int here, float native",
    ]
    with pytest.raises(ImportError, match=r"kvroute.policies and the native policy schema .*"
                                          r"disagree: kv_aware.cache_weight: default 0.7 here"):
        policies.check_schema(schema, policies.REGISTRY)
    schema["greedy"] = []
    assert policies.schema_problems(schema, policies.REGISTRY)[0].startswith(
        "policies: kv_aware, cost")


def test_a_config_model_that_disagrees_with_the_schema_is_named():
    schema = copy.deepcopy(_core.policy_schema())
    models = config_policy._POLICY_MODELS
    assert config_policy.model_problems(schema, models) == []
    _knob(schema, "cache_aware", "cache_threshold")["max"] = 0.5
    _knob(schema, "cost", "temperature")["default"] = 1.0
    problems = config_policy.model_problems(schema, models)
    assert problems == [
        "cost.temperature: default 0.0 in CostPolicy, 1.0 native",
        "cache_aware.cache_threshold: bounds [0, 1] in CacheAwarePolicy, [0.0, 0.5] native",
    ]
    with pytest.raises(ImportError, match="kvroute.config.policy's models disagree"):
        config_policy.check_models(schema, models)
    without = {k: v for k, v in models.items() if k != "random"}
    assert config_policy.model_problems(_core.policy_schema(), without)[0].startswith("models")


def test_importing_kvroute_against_a_disagreeing_core_fails_naming_the_knob():
    # The extension is loaded first, its schema changed (a knob the classes lack; a changed
    # default is no mismatch: the classes take their defaults from the schema), then the
    # package imported.
    pkg = Path(kvroute.__file__).resolve().parent
    # the extension's folder: site-packages/kvroute in an editable install, else the source
    core_dir = Path(_core.__file__).resolve().parent
    code = textwrap.dedent(f"""
        import importlib.util, sys
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not type(f).__module__.startswith('_editable')]
        sys.path.insert(0, {str(pkg.parent)!r})
        spec = importlib.util.spec_from_file_location(
            'kvroute', {str(pkg / '__init__.py')!r},
            submodule_search_locations=[{str(pkg)!r}, {str(core_dir)!r}])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules['kvroute'] = pkg
        import kvroute._core as core
        real = core.policy_schema
        def changed():
            s = real()
            s['cost'].append({{'name': 'decay', 'type': 'float', 'default': 0.0, 'min': 0.0,
                              'max': 1.0, 'doc': 'a knob this kvroute.policies lacks'}})
            return s
        core.policy_schema = changed
        try:
            spec.loader.exec_module(pkg)
        except ImportError as e:
            print('IMPORT ERROR:', e)
        else:
            print('imported')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "IMPORT ERROR: kvroute.policies and the native policy schema" in out.stdout, \
        out.stdout + out.stderr
    assert "cost.decay: a native knob, no field of Cost" in out.stdout
