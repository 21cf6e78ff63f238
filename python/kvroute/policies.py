"""Routing policies as configuration objects: one frozen dataclass per policy.

Each object names a policy of the native registry (``cpp/scoring/policy.cc``) and carries only
that policy's parameters, validated when it is built (ValueError saying what was expected).
Each policy's native knobs are declared once, in its C++ file (``cpp/scoring/<name>.cc``:
name, type, default, range, doc), and exported as `kvroute._core.policy_schema` (`SCHEMA`):
the defaults and the checks of the fields below come from it, and this module refuses to
import (ImportError naming every difference) when its classes and the schema disagree on a
knob's name, type or default. So they are written in one place::

    import kvroute
    from kvroute.policies import KvAware, ConsistentHash

    router = kvroute.Router(workers, policy=KvAware(cache_weight=0.8),
                            fallback=ConsistentHash(virtual_nodes=100))

The YAML loader (`kvroute.config`), the command line and `kvroute.Router` all build their
policies through these classes; ``Router(policy="kv_aware", cache_weight=0.8)`` (a name plus
flat keywords) maps onto ``KvAware(cache_weight=0.8)`` with `from_name`.

========================  =====================  ==============================================
class                     ``name``               reads
========================  =====================  ==============================================
`KvAware`                 ``kv_aware``           the KV-event index and load
`Cost`                    ``cost``               the KV-event index and load (NVIDIA Dynamo's)
`CacheAware`              ``cache_aware``        its own approximate tree of past decisions
`LmcacheAware`            ``lmcache_aware``      an LMCache controller and load
`RoundRobin`              ``round_robin``        nothing
`Random`                  ``random``             the seeded random stream
`PowerOfTwo`              ``power_of_two``       load of two random workers
`LeastLoad`               ``least_load``         load
`ConsistentHash`          ``consistent_hash``    the session key (hash ring)
`RendezvousHash`          ``rendezvous_hash``    the session key (highest random weight)
========================  =====================  ==============================================

A fallback (the policy deciding while no worker has sent KV events, every worker is
degraded, or the LMCache controller is down) must need neither the index nor the controller:
any class above except `KvAware`, `Cost` and `LmcacheAware`. The policy and its fallback each
keep their own values, also of a knob of the same name (``policy=ConsistentHash(
virtual_nodes=50), fallback=ConsistentHash(virtual_nodes=400)``).

A new native knob is declared in its policy's C++ file and added here as a field of its class
(``knob: type = _default("<policy>", "<knob>")``), and in `kvroute.config.policy`'s model of
the policy; the import-time checks name what is missing.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple, Type

from kvroute import _core

__all__ = [
    "Policy",
    "KvAware",
    "Cost",
    "CacheAware",
    "LmcacheAware",
    "RoundRobin",
    "Random",
    "PowerOfTwo",
    "LeastLoad",
    "ConsistentHash",
    "RendezvousHash",
    "REGISTRY",
    "SCHEMA",
    "POLICIES",
    "FALLBACK_POLICIES",
    "from_name",
    "for_name",
    "DEFAULT_POLICY",
    "DEFAULT_FALLBACK",
]

#: Each policy's native knobs, from its C++ file: ``{policy: ({"name", "type" ("bool", "int",
#: "float"), "default", "min", "max" (inclusive; None for bool), "doc"}, ...)}``, in the
#: registry's order. The one place every default policy parameter comes from.
SCHEMA: Dict[str, Tuple[Dict[str, Any], ...]] = {
    name: tuple(knobs) for name, knobs in _core.policy_schema().items()}
#: Registry names of the default policy and fallback (the native RouterOptions defaults).
DEFAULT_POLICY: str = _core.RouterOptions().policy
DEFAULT_FALLBACK: str = _core.RouterOptions().fallback

_INF = math.inf
_INT_MAX = 2**63 - 1  # an int knob without an upper bound (the native int64)


def _default(policy: str, knob: str) -> Any:
    """The native default of ``policy``'s ``knob``; ImportError when the schema lacks it."""
    for k in SCHEMA.get(policy, ()):
        if k["name"] == knob:
            return k["default"]
    raise ImportError(f"kvroute.policies: the native policy schema has no knob {knob!r} of "
                      f"{policy!r} (kvroute._core.policy_schema(), cpp/scoring/{policy}.cc): "
                      "rebuild kvroute._core, or remove the field")


def _number(policy: str, key: str, value: Any, lo: float, hi: float = _INF, *,
            lo_open: bool = False) -> float:
    """``value`` as a float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), else ValueError."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    v = float(value) if ok else math.nan
    if math.isnan(v) or v > hi or v < lo or (lo_open and v == lo):
        span = (f"{'> ' if lo_open else '>= '}{lo:g}" if hi == _INF
                else f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
        raise ValueError(f"{policy}: {key} must be a number {span}, got {value!r}")
    return v


def _int(policy: str, key: str, value: Any, lo: int, hi: int = _INT_MAX) -> int:
    """``value`` as an int in ``[lo, hi]``, else ValueError (``>= lo`` when ``hi`` is the
    native int64 maximum)."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    v = int(value) if ok else lo - 1
    if v < lo or v > hi:
        span = f">= {lo}" if hi >= _INT_MAX else f"in [{lo}, {hi}]"
        raise ValueError(f"{policy}: {key} must be an int {span}, got {value!r}")
    return v


def _knob(policy: str, spec: Mapping[str, Any], value: Any) -> Any:
    """``value`` of the native knob ``spec`` (a `SCHEMA` entry), checked and normalised as the
    native side checks it; ValueError saying what was expected."""
    kind, key = spec["type"], spec["name"]
    if kind == "float":
        return _number(policy, key, value, spec["min"], spec["max"])
    if kind == "int":
        return _int(policy, key, value, spec["min"], spec["max"])
    if not isinstance(value, bool):
        raise ValueError(f"{policy}: {key} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class Policy:
    """Base of the policy objects. ``name`` is the registry name (``Decision.policy``)."""

    name: ClassVar[str] = ""
    #: Reads the KV-event index, so it cannot be a fallback.
    uses_index: ClassVar[bool] = False
    #: Reads an external source (the LMCache controller), so it cannot be a fallback.
    needs_controller: ClassVar[bool] = False
    #: Fields that are no native knob (read on the Python side); every other field is one of
    #: `SCHEMA` [name], checked by it.
    python_fields: ClassVar[Tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for spec in SCHEMA.get(self.name, ()):
            self._set(spec["name"], _knob(self.name, spec, getattr(self, spec["name"])))
        self._validate()

    def _validate(self) -> None:
        """Checks and normalises the fields that are no native knob (subclasses)."""

    def _set(self, key: str, value: Any) -> None:
        object.__setattr__(self, key, value)

    @property
    def can_fallback(self) -> bool:
        """True if this policy may serve as a fallback (needs neither index nor controller)."""
        return not (self.uses_index or self.needs_controller)

    def params(self) -> Dict[str, Any]:
        """Its native knobs (`SCHEMA` [name]), ``{knob: value}``."""
        return {k["name"]: getattr(self, k["name"]) for k in SCHEMA.get(self.name, ())}

    def write(self, options: _core.RouterOptions, *, as_fallback: bool = False) -> None:
        """Writes the policy into ``options``: its name and knobs into ``options.policy`` and
        ``options.policy_params`` (``options.fallback`` and ``options.fallback_params`` with
        ``as_fallback``).

        Raises ValueError when ``as_fallback`` and the policy cannot be a fallback."""
        if as_fallback:
            if not self.can_fallback:
                raise ValueError(
                    f"fallback {self.name!r} must be a policy that needs no KV events and no "
                    f"controller: one of {', '.join(FALLBACK_POLICIES)}")
            options.fallback = self.name
            options.fallback_params = self.params()
        else:
            options.policy = self.name
            options.policy_params = self.params()


@dataclass(frozen=True)
class KvAware(Policy):
    """Prefix reuse against load, from the KV-event index.

    ``score_w = cache_weight * match_w + (1 - cache_weight) * (1 - load_w)``, highest wins
    (``match_w``: tier-weighted matched prefix tokens / prompt tokens; ``load_w`` in ``[0, 1]``:
    the mean of queued prefill tokens, requests in flight (plus reported waiting) and reported
    KV usage, each over its fleet maximum; see `kvroute.Router` and
    ``cpp/scoring/kv_aware.cc``), with the size-aware terms below weighed in once every
    worker queues prefill.

    Parameters
    ----------
    cache_weight:
        In ``[0, 1]``; 1.0 = pure prefix affinity, 0.0 = pure load balancing.
    size_aware:
        NVIDIA Dynamo's size-aware terms (its ``DefaultWorkerScorer``) at full weight at every
        load: the load counts the prefill a worker computes before this request's first token
        (queued prefill plus the prompt's unmatched tokens), and a match behind a longer
        prefill queue counts less (``credit_w = 1 / (1 + excess queued prefill / prompt
        tokens)``). Off (the default), the terms are weighted by the fleet's saturation,
        ``s = (min / max queued prefill over the workers) ** 6``: 0 (the score above) while
        some worker has no queued prefill. In ``kvroute replay`` on the Mooncake trace (8
        workers) the default keeps kv_aware's mean and p90 TTFT below cache_aware's past
        saturation (12x the arrival rate) and near the plain score's at 10x, where full
        weight raises mean TTFT (first 3,000 requests, seeds 0-3: 0.755 s at full weight,
        0.639 s by default, 0.633 s with the plain score).
    """

    name: ClassVar[str] = "kv_aware"
    uses_index: ClassVar[bool] = True
    cache_weight: float = _default("kv_aware", "cache_weight")
    size_aware: bool = _default("kv_aware", "size_aware")


@dataclass(frozen=True)
class Cost(Policy):
    """NVIDIA Dynamo's KV-router cost, from the KV-event index (ai-dynamo/dynamo
    ``DefaultWorkerScorer``)::

        cost_w = prefill_load_scale * max(0, (queued prefill tokens_w + prompt tokens)
                                             / block_size - tier-credited matched blocks_w)
                 + blocks of the requests in flight on w

    lowest wins. Matched blocks are credited with the Router's ``tier_weights`` (Dynamo: GPU
    1.0, host 0.75, disk 0.25; kvroute's default CPU weight is 0.8, so pass
    ``tier_weights={"CPU": 0.75}`` for Dynamo's credits). ``cpp/scoring/cost.cc`` states the
    remaining deviations.

    Parameters
    ----------
    prefill_load_scale:
        Weight of the blocks still to prefill, ``>= 0``.
    temperature:
        ``>= 0``; above 0, samples worker w with probability proportional to
        ``exp(-(cost_w - min cost) / ((max cost - min cost) * temperature))`` (uniform when
        all costs are equal), as Dynamo's ``router_temperature``.
    """

    name: ClassVar[str] = "cost"
    uses_index: ClassVar[bool] = True
    prefill_load_scale: float = _default("cost", "prefill_load_scale")
    temperature: float = _default("cost", "temperature")


@dataclass(frozen=True)
class CacheAware(Policy):
    """The SGLang / vLLM routers' approximate policy: a radix tree of the router's own
    decisions, no KV events. Defaults are the vLLM router's CLI defaults
    (github.com/vllm-project/router ``src/main.rs``).

    Parameters
    ----------
    cache_threshold:
        In ``[0, 1]``: below this matched fraction the least loaded worker takes the request.
    balance_abs_threshold, balance_rel_threshold:
        The load is imbalanced (route to the least loaded) when max - min requests exceed
        ``balance_abs_threshold`` (an int ``>= 0``, requests: the source's ``usize``) and max
        exceeds ``balance_rel_threshold`` (a number ``>= 1``) x min.
    eviction_interval_s:
        Seconds between tree evictions, ``>= 0`` (vLLM router: ``eviction_interval_secs``);
        0 = no eviction (the tree is never cut back to ``max_tree_size``), as in the vLLM
        router and SGLang, which start no eviction thread for 0.
    max_tree_size:
        Tokens per worker the tree keeps, int ``>= 1``.
    """

    name: ClassVar[str] = "cache_aware"
    cache_threshold: float = _default("cache_aware", "cache_threshold")
    balance_abs_threshold: int = _default("cache_aware", "balance_abs_threshold")
    balance_rel_threshold: float = _default("cache_aware", "balance_rel_threshold")
    eviction_interval_s: float = _default("cache_aware", "eviction_interval_s")
    max_tree_size: int = _default("cache_aware", "max_tree_size")


LOOKUP_MODES = ("occupancy", "prefix_lookup")


@dataclass(frozen=True)
class LmcacheAware(Policy):
    """Scores from an LMCache controller (`kvroute.lmcache`):
    ``cache_weight * value / max value + (1 - cache_weight) * (1 - load)``. A background
    thread polls the controller; decisions read its last snapshot and never wait on it.
    While the controller is down, timed out, answering an error, or listing no mapped worker,
    the fallback decides (``reason="controller_down"``); routing switches back by itself.

    Parameters
    ----------
    controller_url:
        The controller, e.g. ``"http://10.0.0.9:9000"`` (Router keyword:
        ``lmcache_controller_url``). Required.
    worker_map:
        LMCache instance id -> worker name, non-empty (Router keyword: ``lmcache_worker_map``).
        Required; every value must name a worker of the Router (ValueError otherwise).
    lookup_mode:
        ``"occupancy"`` (key count per instance, polled) or ``"prefix_lookup"`` (matched
        tokens per request).
    poll_interval_s:
        Seconds between controller polls, ``> 0`` (the fork's ``poll_interval_secs``).
    controller_timeout_ms:
        Deadline of one whole controller call (connect to last body byte) in milliseconds,
        ``> 0``.
    cache_weight:
        In ``[0, 1]``, as `KvAware`.
    """

    name: ClassVar[str] = "lmcache_aware"
    needs_controller: ClassVar[bool] = True
    python_fields: ClassVar[Tuple[str, ...]] = (
        "controller_url", "worker_map", "lookup_mode", "poll_interval_s", "controller_timeout_ms")
    controller_url: Optional[str] = None
    worker_map: Optional[Mapping[str, str]] = None
    lookup_mode: str = "occupancy"
    poll_interval_s: float = 10.0
    controller_timeout_ms: float = 2000.0
    cache_weight: float = _default("lmcache_aware", "cache_weight")

    def _validate(self) -> None:
        n = self.name
        if not self.controller_url or not isinstance(self.controller_url, str) or \
                not self.worker_map or not isinstance(self.worker_map, Mapping):
            raise ValueError(
                f"{n} needs controller_url (a URL string) and worker_map (a non-empty mapping "
                "LMCache instance id -> worker name); as Router keywords: "
                f"lmcache_controller_url, lmcache_worker_map; got {self.controller_url!r}, "
                f"{self.worker_map!r}")
        self._set("worker_map", {str(k): str(v) for k, v in self.worker_map.items()})
        if self.lookup_mode not in LOOKUP_MODES:
            raise ValueError(f"{n}: lookup_mode must be one of {', '.join(LOOKUP_MODES)}, "
                             f"got {self.lookup_mode!r}")
        self._set("poll_interval_s",
                  _number(n, "poll_interval_s", self.poll_interval_s, 0, lo_open=True))
        self._set("controller_timeout_ms",
                  _number(n, "controller_timeout_ms", self.controller_timeout_ms, 0,
                          lo_open=True))

    __hash__ = None  # type: ignore[assignment]  # worker_map is a dict


@dataclass(frozen=True)
class RoundRobin(Policy):
    """Workers in turn."""

    name: ClassVar[str] = "round_robin"


@dataclass(frozen=True)
class Random(Policy):
    """Uniform, from the Router's seeded random stream."""

    name: ClassVar[str] = "random"


@dataclass(frozen=True)
class PowerOfTwo(Policy):
    """Two distinct random workers; the less loaded wins."""

    name: ClassVar[str] = "power_of_two"


@dataclass(frozen=True)
class LeastLoad(Policy):
    """The least loaded worker; ties broken by a seeded random choice."""

    name: ClassVar[str] = "least_load"


@dataclass(frozen=True)
class ConsistentHash(Policy):
    """Hash ring over worker names; the request's session key picks the worker, and removing
    a worker moves only its own sessions.

    Parameters
    ----------
    virtual_nodes:
        Ring points per worker, int in ``[1, 2**32 - 1]`` (the vLLM router's
        ``VIRTUAL_NODES_PER_WORKER`` is 160).
    """

    name: ClassVar[str] = "consistent_hash"
    virtual_nodes: int = _default("consistent_hash", "virtual_nodes")


@dataclass(frozen=True)
class RendezvousHash(Policy):
    """Highest random weight over (session key, worker)."""

    name: ClassVar[str] = "rendezvous_hash"


#: Policy classes by registry name, in the native registry's order.
REGISTRY: Dict[str, Type[Policy]] = {
    c.name: c for c in (KvAware, Cost, CacheAware, RoundRobin, Random, PowerOfTwo, LeastLoad,
                        ConsistentHash, RendezvousHash, LmcacheAware)
}
POLICIES: Tuple[str, ...] = tuple(REGISTRY)
FALLBACK_POLICIES: Tuple[str, ...] = tuple(
    n for n, c in REGISTRY.items() if not (c.uses_index or c.needs_controller))

_TYPES = {"float": float, "int": int, "bool": bool}


def schema_problems(schema: Mapping[str, Any], registry: Mapping[str, Type[Policy]]) -> List[str]:
    """What ``registry`` (policy classes by name) and ``schema`` (`SCHEMA`'s shape) disagree
    on: the policy names, and per policy its native knobs (each a field of the class of the
    schema's type and default; no other field but `Policy.python_fields`). Empty: none."""
    out = []
    if list(registry) != list(schema):
        out.append(f"policies: {', '.join(registry)} here, {', '.join(schema)} native")
    for name, cls in registry.items():
        knobs = {k["name"]: k for k in schema.get(name, ())}
        own = {f.name: f for f in fields(cls) if f.name not in cls.python_fields}
        for missing in sorted(knobs.keys() - own.keys()):
            out.append(f"{name}.{missing}: a native knob, no field of {cls.__name__}")
        for extra in sorted(own.keys() - knobs.keys()):
            out.append(f"{name}.{extra}: a field of {cls.__name__}, no native knob (list it in "
                       f"{cls.__name__}.python_fields if it is Python's own)")
        for key in sorted(knobs.keys() & own.keys()):
            k, f = knobs[key], own[key]
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", f.type)
            if kind != k["type"]:
                out.append(f"{name}.{key}: type {kind} here, {k['type']} native")
            elif f.default != k["default"] or type(f.default) is not _TYPES[k["type"]]:
                out.append(f"{name}.{key}: default {f.default!r} here, {k['default']!r} native")
    return out


def check_schema(schema: Mapping[str, Any], registry: Mapping[str, Type[Policy]]) -> None:
    """ImportError listing `schema_problems`, if any."""
    problems = schema_problems(schema, registry)
    if problems:
        raise ImportError(
            "kvroute.policies and the native policy schema (kvroute._core.policy_schema(), "
            "declared in cpp/scoring/<policy>.cc) disagree: " + "; ".join(problems) +
            ". Rebuild kvroute._core, or update kvroute/policies.py")


check_schema(SCHEMA, REGISTRY)


def policy_class(name: str) -> Type[Policy]:
    """The class of the policy ``name``; ValueError for an unknown name."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown policy {name!r}: expected one of {', '.join(POLICIES)}") from None


def from_name(name: str, **params: Any) -> Policy:
    """``from_name("kv_aware", cache_weight=0.8)`` == ``KvAware(cache_weight=0.8)``.

    Raises ValueError for an unknown name, a parameter the policy does not have, or a bad
    value."""
    cls = policy_class(name)
    own = {f.name for f in fields(cls)}
    extra = sorted(set(params) - own)
    if extra:
        raise ValueError(f"{name}: unknown parameter{'s' if len(extra) > 1 else ''} "
                         f"{', '.join(extra)}; its parameters: {', '.join(sorted(own)) or 'none'}")
    return cls(**params)


def for_name(name: str, shared: Optional[Mapping[str, Any]] = None) -> Policy:
    """The policy ``name`` with those of the ``shared`` parameters it has; the others are
    ignored (``shared`` is one flat set for several policies, as the command line's
    ``--cache-weight``). ValueError for an unknown name or a bad value."""
    cls = policy_class(name)
    own = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in (shared or {}).items() if k in own and v is not None})


def as_policy(value: Any, what: str = "policy") -> Policy:
    """A `Policy` from a `Policy` or a registry name; ValueError otherwise."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        return from_name(value)
    raise ValueError(f"{what} must be a kvroute.policies.Policy (e.g. KvAware()) or one of "
                     f"{', '.join(POLICIES)}, got {value!r}")

