"""Routing policies as configuration objects: one frozen dataclass per policy.

Each object names a policy of the native registry (``cpp/scoring/policy.cc``) and carries only
that policy's parameters, validated when it is built (ValueError saying what was expected).
The defaults are the C++ defaults (``cpp/scoring/policy.h`` ``PolicyParams``), read from
`kvroute._core` when this module is imported, so they are written in one place::

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
any class above except `KvAware`, `Cost` and `LmcacheAware`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple, Type

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
    "POLICIES",
    "FALLBACK_POLICIES",
    "from_name",
    "for_name",
    "DEFAULT_POLICY",
    "DEFAULT_FALLBACK",
]

# The C++ defaults: the one place every default policy parameter comes from.
_PARAMS = _core.PolicyParams()
#: Registry names of the default policy and fallback (the native RouterOptions defaults).
DEFAULT_POLICY: str = _core.RouterOptions().policy
DEFAULT_FALLBACK: str = _core.RouterOptions().fallback
_PARAM_NAMES = frozenset(n for n in dir(_PARAMS) if not n.startswith("_"))

_INF = math.inf


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


def _int(policy: str, key: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    v = int(value) if ok else lo - 1
    if v < lo or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{policy}: {key} must be an int {span}, got {value!r}")
    return v


@dataclass(frozen=True)
class Policy:
    """Base of the policy objects. ``name`` is the registry name (``Decision.policy``)."""

    name: ClassVar[str] = ""
    #: Reads the KV-event index, so it cannot be a fallback.
    uses_index: ClassVar[bool] = False
    #: Reads an external source (the LMCache controller), so it cannot be a fallback.
    needs_controller: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        """Checks and normalises the fields (subclasses)."""

    def _set(self, key: str, value: Any) -> None:
        object.__setattr__(self, key, value)

    @property
    def can_fallback(self) -> bool:
        """True if this policy may serve as a fallback (needs neither index nor controller)."""
        return not (self.uses_index or self.needs_controller)

    def params(self) -> Dict[str, Any]:
        """The native ``PolicyParams`` fields this policy sets, ``{field: value}``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _PARAM_NAMES}

    def write(self, options: _core.RouterOptions, *, as_fallback: bool = False) -> None:
        """Writes the policy into ``options``: its name into ``options.policy`` (or
        ``options.fallback`` with ``as_fallback``), its parameters into ``options.params``.

        Raises ValueError when ``as_fallback`` and the policy cannot be a fallback."""
        if as_fallback:
            if not self.can_fallback:
                raise ValueError(
                    f"fallback {self.name!r} must be a policy that needs no KV events and no "
                    f"controller: one of {', '.join(FALLBACK_POLICIES)}")
            options.fallback = self.name
        else:
            options.policy = self.name
        for key, value in self.params().items():
            setattr(options.params, key, value)


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
    cache_weight: float = _PARAMS.cache_weight
    size_aware: bool = _PARAMS.size_aware

    def _validate(self) -> None:
        self._set("cache_weight", _number(self.name, "cache_weight", self.cache_weight, 0, 1))
        if not isinstance(self.size_aware, bool):
            raise ValueError(f"{self.name}: size_aware must be true or false, got "
                             f"{self.size_aware!r}")


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
    prefill_load_scale: float = _PARAMS.prefill_load_scale
    temperature: float = _PARAMS.temperature

    def _validate(self) -> None:
        self._set("prefill_load_scale",
                  _number(self.name, "prefill_load_scale", self.prefill_load_scale, 0))
        self._set("temperature", _number(self.name, "temperature", self.temperature, 0))


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
    cache_threshold: float = _PARAMS.cache_threshold
    balance_abs_threshold: int = int(_PARAMS.balance_abs_threshold)
    balance_rel_threshold: float = _PARAMS.balance_rel_threshold
    eviction_interval_s: float = _PARAMS.eviction_interval_s
    max_tree_size: int = _PARAMS.max_tree_size

    def _validate(self) -> None:
        n = self.name
        self._set("cache_threshold", _number(n, "cache_threshold", self.cache_threshold, 0, 1))
        self._set("balance_abs_threshold",
                  _int(n, "balance_abs_threshold", self.balance_abs_threshold, 0))
        self._set("balance_rel_threshold",
                  _number(n, "balance_rel_threshold", self.balance_rel_threshold, 1))
        self._set("eviction_interval_s",
                  _number(n, "eviction_interval_s", self.eviction_interval_s, 0))
        self._set("max_tree_size", _int(n, "max_tree_size", self.max_tree_size, 1))


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
    controller_url: Optional[str] = None
    worker_map: Optional[Mapping[str, str]] = None
    lookup_mode: str = "occupancy"
    poll_interval_s: float = 10.0
    controller_timeout_ms: float = 2000.0
    cache_weight: float = _PARAMS.cache_weight

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
        self._set("cache_weight", _number(n, "cache_weight", self.cache_weight, 0, 1))

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
    virtual_nodes: int = _PARAMS.virtual_nodes

    def _validate(self) -> None:
        self._set("virtual_nodes", _int(self.name, "virtual_nodes", self.virtual_nodes, 1,
                                        2**32 - 1))


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

if set(POLICIES) != {n.strip() for n in _core.policy_names().split(",")}:  # pragma: no cover
    raise ImportError(f"kvroute.policies {POLICIES} and the native registry "
                      f"({_core.policy_names()}) disagree: rebuild kvroute._core")


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

