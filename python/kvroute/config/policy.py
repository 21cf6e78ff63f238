"""The ``policy`` mappings: one model per `kvroute.policies` type, with that class's defaults;
``to_policy()`` builds the object, ``fallback_policy`` the fallback (``POLICY_TYPES``,
``FALLBACK_POLICY_TYPES``).

The models are checked at import against the policy classes and the native schema
(`kvroute.policies.SCHEMA`): every parameter of a class is a key of its model, and each
native knob has the schema's default and bounds (`model_problems`; ImportError naming each
difference).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Mapping, Optional, Union

import annotated_types
from pydantic import (
    AliasChoices,
    BaseModel,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from kvroute import policies as P
from kvroute.config._base import NonNegFloat, PosFloat, PosInt, _Model, _seconds

# Policies that cannot be a fallback: they read the KV-event index or a controller.
_INDEX_POLICIES = tuple(n for n in P.POLICIES if n not in P.FALLBACK_POLICIES)



# -- policies ----------------------------------------------------------------------------------
# One model per policy type: the YAML shape of a `kvroute.policies` object, with only its own
# parameters and their defaults taken from that class. Names of the parameters the vLLM router
# has are the vLLM router's (see each class); `to_policy` builds the object.

class _PolicyModel(_Model):
    # YAML key -> the `kvroute.policies` field, where they differ.
    _renames: ClassVar[Dict[str, str]] = {}
    # YAML keys that are not parameters of the policy object.
    _not_passed: ClassVar[tuple] = ("type", "fallback_policy")

    def to_policy(self) -> P.Policy:
        """The `kvroute.policies` object. Raises ValueError for a value it rejects."""
        own = {self._renames.get(k, k): getattr(self, k) for k in type(self).model_fields
               if k not in self._not_passed}
        return P.from_name(self.type, **own)  # type: ignore[attr-defined]

    @model_validator(mode="after")
    def _as_object(self) -> _PolicyModel:
        self.to_policy()  # what the object rejects, the config rejects
        return self


class RoundRobinPolicy(_PolicyModel):
    """Workers in turn (`kvroute.policies.RoundRobin`)."""

    type: Literal["round_robin"]


class RandomPolicy(_PolicyModel):
    """Uniform, seeded by ``seed`` (`kvroute.policies.Random`)."""

    type: Literal["random"]


class PowerOfTwoPolicy(_PolicyModel):
    """Two distinct random workers; the less loaded wins (`kvroute.policies.PowerOfTwo`)."""

    type: Literal["power_of_two"]
    # The vLLM router's PolicyConfig::PowerOfTwo field load_check_interval_secs
    # (src/config/types.rs; src/main.rs sets 5). Accepted so vLLM-router configs load;
    # kvroute's load is live (its own accounting and Router.update_load), so nothing polls and
    # the value is not passed to the Router.
    load_check_interval_s: PosInt = _seconds("load_check_interval", 5)
    _not_passed: ClassVar[tuple] = ("type", "load_check_interval_s")


class LeastLoadPolicy(_PolicyModel):
    """The least loaded worker; ties broken by a seeded random choice
    (`kvroute.policies.LeastLoad`)."""

    type: Literal["least_load"]


class ConsistentHashPolicy(_PolicyModel):
    """Hash ring over worker names; the request's session key picks the worker
    (`kvroute.policies.ConsistentHash`)."""

    type: Literal["consistent_hash"]
    virtual_nodes: Annotated[int, Field(ge=1, le=2**32 - 1)] = P.ConsistentHash.virtual_nodes


class RendezvousHashPolicy(_PolicyModel):
    """Highest random weight over (session key, worker) (`kvroute.policies.RendezvousHash`)."""

    type: Literal["rendezvous_hash"]


class CacheAwarePolicy(_PolicyModel):
    """The SGLang / vLLM routers' approximate policy (a radix tree of the router's decisions;
    `kvroute.policies.CacheAware`).

    Keys as in the vLLM router's ``PolicyConfig::CacheAware`` (src/config/types.rs), whose
    CLI defaults (src/main.rs) are the defaults; ``eviction_interval_s`` is also accepted as
    the vLLM router's ``eviction_interval_secs``.
    """

    type: Literal["cache_aware"]
    cache_threshold: Annotated[float, Field(ge=0, le=1)] = P.CacheAware.cache_threshold
    balance_abs_threshold: Annotated[int, Field(ge=0)] = P.CacheAware.balance_abs_threshold
    balance_rel_threshold: Annotated[float, Field(ge=1, allow_inf_nan=False)] = \
        P.CacheAware.balance_rel_threshold
    eviction_interval_s: NonNegFloat = _seconds("eviction_interval",
                                                P.CacheAware.eviction_interval_s)
    max_tree_size: PosInt = P.CacheAware.max_tree_size


_Fallback = Annotated[
    Union[RoundRobinPolicy, RandomPolicy, PowerOfTwoPolicy, LeastLoadPolicy,
          ConsistentHashPolicy, RendezvousHashPolicy, CacheAwarePolicy],
    Field(discriminator="type"),
]
FALLBACK_POLICY_TYPES = P.FALLBACK_POLICIES


def _as_policy_dict(value: Any, default_type: Optional[str]) -> Any:
    """``"name"`` -> ``{"type": "name"}``; a mapping without ``type`` gets ``default_type``."""
    if isinstance(value, str):
        return {"type": value}
    if isinstance(value, Mapping) and "type" not in value and default_type is not None:
        return {"type": default_type, **value}
    return value


def _default_fallback() -> Any:
    return _FALLBACK_MODELS[P.DEFAULT_FALLBACK](type=P.DEFAULT_FALLBACK)


class _IndexPolicy(_PolicyModel):
    """Policies with a fallback (they read the KV-event index or a controller);
    ``fallback_policy`` decides while the index is empty (no worker has sent an event), every
    worker is degraded, or the controller is unreachable."""

    @field_validator("fallback_policy", mode="before", check_fields=False)
    @classmethod
    def _fallback(cls, v: Any) -> Any:
        if isinstance(v, str) and v in _INDEX_POLICIES:
            raise ValueError(f"fallback_policy {v!r} needs KV events (or a controller) itself; "
                             f"allowed: {', '.join(FALLBACK_POLICY_TYPES)}")
        return _as_policy_dict(v, None)

    def fallback(self) -> P.Policy:
        """The fallback as a `kvroute.policies` object."""
        return self.fallback_policy.to_policy()  # type: ignore[attr-defined]


class _PoolIndexKeys(_IndexPolicy):
    """The vLLM router fork's per-policy KV-event keys (its v0.12 ``kv_aware`` config): they
    set the Router of the pool this policy routes, over the top-level values.

    ``block_size`` -> the pool's ``block_size``; ``enable_speculative: false`` -> speculative
    credits off (``speculative_ttl_s`` 0); ``speculative_ttl_ms`` -> ``speculative_ttl_s``
    (/ 1000)."""

    block_size: Optional[PosInt] = None
    enable_speculative: Optional[bool] = None
    speculative_ttl_ms: Optional[NonNegFloat] = None
    _not_passed: ClassVar[tuple] = ("type", "fallback_policy", "block_size",
                                    "enable_speculative", "speculative_ttl_ms")

    def pool_kwargs(self) -> Dict[str, Any]:
        """Router keywords these keys set (empty when none is given)."""
        out: Dict[str, Any] = {}
        if self.block_size is not None:
            out["block_size"] = self.block_size
        if self.enable_speculative is False:
            out["speculative_ttl_s"] = 0.0
        elif self.speculative_ttl_ms is not None:
            out["speculative_ttl_s"] = self.speculative_ttl_ms / 1000.0
        return out


class KvAwarePolicy(_PoolIndexKeys):
    """``score = cache_weight * match + (1 - cache_weight) * (1 - load)``, with Dynamo's
    size-aware load and match credit weighted by saturation; ``size_aware``: at full weight
    at every load (`kvroute.policies.KvAware`)."""

    type: Literal["kv_aware"]
    cache_weight: Annotated[float, Field(ge=0, le=1)] = P.KvAware.cache_weight
    size_aware: StrictBool = P.KvAware.size_aware
    fallback_policy: _Fallback = Field(
        default_factory=_default_fallback,
        description="A policy that needs no KV events: a name, or a mapping with its "
                    "parameters (e.g. {type: consistent_hash, virtual_nodes: 100}).")


class CostPolicy(_PoolIndexKeys):
    """NVIDIA Dynamo's KV-router cost: ``prefill_load_scale * (queued + prompt blocks -
    credited matched blocks) + active blocks``, lowest wins; ``temperature > 0`` samples a
    softmax over the cost range, as Dynamo (`kvroute.policies.Cost`)."""

    type: Literal["cost"]
    prefill_load_scale: NonNegFloat = P.Cost.prefill_load_scale
    temperature: NonNegFloat = P.Cost.temperature
    fallback_policy: _Fallback = Field(
        default_factory=_default_fallback,
        description="A policy that needs no KV events: a name, or a mapping with its "
                    "parameters (e.g. {type: consistent_hash, virtual_nodes: 100}).")


class LmcacheAwarePolicy(_IndexPolicy):
    """Scores from an LMCache controller (`kvroute.lmcache`): ``cache_weight * value / max
    value + (1 - cache_weight) * (1 - load)``; ``fallback_policy`` decides while the
    controller is unreachable (`kvroute.policies.LmcacheAware`; ``poll_interval_s`` is also
    accepted as ``poll_interval_secs``)."""

    type: Literal["lmcache_aware"]
    cache_weight: Annotated[float, Field(ge=0, le=1)] = P.LmcacheAware.cache_weight
    lmcache_controller_url: str = Field(
        validation_alias=AliasChoices("lmcache_controller_url", "controller_url"),
        description="The LMCache controller (the fork's key: controller_url).")
    lmcache_worker_map: Dict[str, str] = Field(
        validation_alias=AliasChoices("lmcache_worker_map", "worker_map"),
        description="LMCache instance_id -> worker URL (the worker's name); every value must "
                    "name a worker of the pool this policy routes.")
    lookup_mode: Literal["occupancy", "prefix_lookup"] = P.LmcacheAware.lookup_mode  # type: ignore[assignment]
    poll_interval_s: PosFloat = _seconds("poll_interval", P.LmcacheAware.poll_interval_s)
    controller_timeout_ms: PosFloat = P.LmcacheAware.controller_timeout_ms
    fallback_policy: _Fallback = Field(
        default_factory=_default_fallback,
        description="A policy that needs neither KV events nor the controller.")
    _renames: ClassVar[Dict[str, str]] = {"lmcache_controller_url": "controller_url",
                                          "lmcache_worker_map": "worker_map"}


Policy = Annotated[
    Union[KvAwarePolicy, CostPolicy, CacheAwarePolicy, RoundRobinPolicy, RandomPolicy,
          PowerOfTwoPolicy, LeastLoadPolicy, ConsistentHashPolicy, RendezvousHashPolicy,
          LmcacheAwarePolicy],
    Field(discriminator="type"),
]
POLICY_TYPES = P.POLICIES
_POLICY_MODELS: Dict[str, Any] = {
    c.model_fields["type"].annotation.__args__[0]: c  # type: ignore[union-attr]
    for c in (KvAwarePolicy, CostPolicy, CacheAwarePolicy, RoundRobinPolicy, RandomPolicy,
              PowerOfTwoPolicy, LeastLoadPolicy, ConsistentHashPolicy, RendezvousHashPolicy,
              LmcacheAwarePolicy)}
_FALLBACK_MODELS: Dict[str, Any] = {
    c.model_fields["type"].annotation.__args__[0]: c  # type: ignore[union-attr]
    for c in (RoundRobinPolicy, RandomPolicy, PowerOfTwoPolicy, LeastLoadPolicy,
              ConsistentHashPolicy, RendezvousHashPolicy, CacheAwarePolicy)}

def _policy_kwargs(policy: BaseModel) -> Dict[str, Any]:
    """Router keyword arguments for one policy: ``policy`` (a `kvroute.policies` object) and,
    for a policy with a fallback, ``fallback``."""
    out: Dict[str, Any] = {"policy": policy.to_policy()}  # type: ignore[attr-defined]
    if isinstance(policy, _IndexPolicy):
        out["fallback"] = policy.fallback()
    return out


def _pool_kwargs(policy: BaseModel, common: Dict[str, Any]) -> Dict[str, Any]:
    """One pool's Router keywords: the policy (and fallback), the common settings, then the
    policy's own pool keys (``block_size``, speculative settings) over them."""
    extra = policy.pool_kwargs() if isinstance(policy, _PoolIndexKeys) else {}
    return {**_policy_kwargs(policy), **common, **extra}


# -- the models against the classes and the native schema --------------------------------------

def _bounds(field: Any) -> tuple:
    """``(lo, hi)`` of a pydantic field's ge / gt / le constraints (gt n: lo n + 1 for an int,
    else n marked open as ``("gt", n)``); None where unconstrained."""
    lo: Any = None
    hi: Any = None
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        elif isinstance(m, annotated_types.Gt):
            lo = int(m.gt) + 1 if field.annotation is int else ("gt", m.gt)  # type: ignore[call-overload]
        elif isinstance(m, annotated_types.Le):
            hi = m.le
    return lo, hi


def model_problems(schema: Mapping[str, Any], models: Mapping[str, Any]) -> List[str]:
    """What the config ``models`` (by policy type) disagree on with the `kvroute.policies`
    classes (their parameters: the models' keys but ``_not_passed``, through ``_renames``)
    and ``schema`` (`kvroute.policies.SCHEMA`: default, lower and upper bound of each native
    knob; an unbounded native knob may have no upper bound here). Empty: none."""
    out = []
    if set(models) != set(P.REGISTRY):
        out.append(f"models for {', '.join(sorted(models))}, policies "
                   f"{', '.join(sorted(P.REGISTRY))}")
    for name, model in models.items():
        cls = P.REGISTRY.get(name)
        if cls is None:
            continue
        keys = {model._renames.get(k, k): k for k in model.model_fields
                if k not in model._not_passed}
        params = {f.name for f in dataclasses.fields(cls)}
        for missing in sorted(params - keys.keys()):
            out.append(f"{name}.{missing}: a parameter of {cls.__name__}, no key of "
                       f"{model.__name__}")
        for extra in sorted(keys.keys() - params):
            out.append(f"{name}.{extra}: a key of {model.__name__}, no parameter of "
                       f"{cls.__name__}")
        for knob in schema.get(name, ()):
            field = model.model_fields.get(keys.get(knob["name"], ""))
            if field is None:
                continue
            where = f"{name}.{knob['name']}"
            if field.default != knob["default"]:
                out.append(f"{where}: default {field.default!r} in {model.__name__}, "
                           f"{knob['default']!r} native")
            if knob["type"] == "bool":
                continue
            lo, hi = _bounds(field)
            unbounded = knob["max"] == math.inf or (knob["type"] == "int" and
                                                     knob["max"] == 2**63 - 1)
            if lo != knob["min"] or not (hi == knob["max"] or (hi is None and unbounded)):
                out.append(f"{where}: bounds [{lo}, {hi}] in {model.__name__}, "
                           f"[{knob['min']}, {knob['max']}] native")
    return out


def check_models(schema: Mapping[str, Any], models: Mapping[str, Any]) -> None:
    """ImportError listing `model_problems`, if any."""
    problems = model_problems(schema, models)
    if problems:
        raise ImportError("kvroute.config.policy's models disagree with kvroute.policies and "
                          "the native policy schema (kvroute._core.policy_schema()): " +
                          "; ".join(problems) + ". Update kvroute/config/policy.py")


check_models(P.SCHEMA, _POLICY_MODELS)
