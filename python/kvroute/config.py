"""Router configuration from YAML (or a dict), validated with pydantic.

The shape follows the vLLM router's ``RouterConfig`` (github.com/vllm-project/router,
``src/config/types.rs``; SGLang's sgl-router has the same): a ``mode`` tagged by ``type``
(``regular`` with ``worker_urls``, or prefill/decode with ``prefill_urls`` / ``decode_urls``
and optional ``prefill_policy`` / ``decode_policy``) and a ``policy`` tagged by ``type`` with
each policy's own parameters under their names there (``cache_threshold``,
``balance_abs_threshold``, ``balance_rel_threshold``, ``eviction_interval_secs``,
``max_tree_size``, ``load_check_interval_secs``, ``virtual_nodes``). kvroute adds per-worker
KV-event endpoints, the KV-aware policies and the ingestion knobs. Durations are in seconds
under ``*_s`` keys; every such key is also accepted as ``*_secs``, the vLLM router's spelling
(``eviction_interval_secs``, ``speculative_ttl_secs``, ...), without a warning::

    mode:
      type: regular        # or pd_disaggregation (aliases: prefill_decode, vllm_prefill_decode)
      workers:
        - url: http://10.0.0.5:8000
          kv_events: tcp://10.0.0.5:5557     # optional: the engine's KV-event publisher
          replay: tcp://10.0.0.5:5558        # optional: its replay socket
          dp_rank: 0                         # optional
      # worker_urls: [http://10.0.0.5:8000, ...]   # vLLM-router shorthand, no KV events
    policy:
      type: kv_aware
      cache_weight: 0.7
      fallback_policy: power_of_two
    block_size: 16
    kv_events: {topic: "", ingest_threads: 1, ingest_nice: 0, replay_timeout_s: 1.0,
                degraded_hold_s: 60}
    speculative_ttl_s: 2.0
    limits: {max_blocks_per_worker: 4194304, max_blocks_total: 33554432,
             max_speculative_blocks: 4194304, max_payload_bytes: 67108864}
    seed: 0

The vLLM router fork's configurations (and the vLLM router's) load as they are:

- ``mode.type``: ``regular``, ``pd_disaggregation``, ``prefill_decode``,
  ``vllm_prefill_decode`` (the three PD names mean the same); ``prefill_urls`` entries are a
  URL or ``[url, bootstrap_port or null]``; ``prefill_policy`` / ``decode_policy`` under
  ``mode`` or at the top level; a pool without its own policy uses ``policy``.
- ``mode.kv_events: {topic_filter, default_port}`` (the fork's v0.12): ``topic_filter`` is
  the SUB topic filter (over ``kv_events.topic``); a worker without ``kv_events`` in a pool
  routed by ``kv_aware`` / ``cost`` subscribes to ``tcp://<host of its url>:<default_port>``
  (in ``kv-events-pd.yaml`` that includes the prefill pool, whose policy is then
  ``policy``'s default, ``kv_aware``).
- ``kv_aware`` / ``cost`` policy keys ``block_size``, ``enable_speculative``,
  ``speculative_ttl_ms`` set that pool's Router (``block_size``; speculative credits off,
  or their TTL in ms), over the top-level ``block_size`` / ``speculative_ttl_s``.
- ``lmcache_aware``: ``controller_url`` (or ``lmcache_controller_url``),
  ``lmcache_worker_map`` (or ``worker_map``: every value must name a worker of the pool the
  policy routes), ``poll_interval_secs``, ``controller_timeout_ms``, ``lookup_mode``,
  ``cache_weight``, ``fallback_policy``.
- Server keys of the vLLM router's ``RouterConfig`` honoured by ``kvroute serve``: ``host``,
  ``port``, ``log_level`` (``warn`` = ``warning``), ``metrics: {host, port}`` (``GET
  /metrics`` also on that listener), ``health_check: {failure_threshold, success_threshold,
  timeout_secs, check_interval_secs, endpoint}`` (`kvroute.serving.health`),
  ``intra_node_data_parallel_size`` (each URL becomes that many workers, ``dp_rank`` 0..N-1,
  rank r's KV events and replay on port + r), ``model_path`` (the served model name and the
  tokenizer: a directory with ``tokenizer.json`` or a Hugging Face id found in the local
  cache; nothing is downloaded). The vLLM router keys kvroute has no counterpart for
  (`VLLM_ROUTER_KEYS_NOT_HONOURED`: ``api_key``, ``discovery``, ``circuit_breaker``, ...) are
  refused in one problem naming all of them.
- The vLLM router's request-path keys ``retry: {max_retries, initial_backoff_ms,
  max_backoff_ms, backoff_multiplier, jitter_factor}`` (its ``max_retries`` counts attempts),
  ``disable_retries``, ``max_payload_size`` and ``request_id_headers`` set
  ``serving.max_retries`` / ``serving.retry``, ``serving.max_body_bytes`` and
  ``serving.request_id_headers``.
- ``serving:`` (`ServingConfig`, `kvroute serve`'s HTTP front): timeouts
  (``upstream_timeout_s``, ``connect_timeout_s``, ``first_byte_timeout_s``), ``max_retries``
  and ``retry`` (backoff, ``retry_on``), ``circuit_breaker``, ``recovery_ramp_s``, limits
  (``max_body_bytes``, ``max_prompt_tokens``, ``chars_per_token``), the tokenizer's lanes and
  prefix cache (``tokenizer_threads``, ``long_prompt_chars``, ``long_prompt_threads``,
  ``tokenizer_max_queued``, ``prefix_cache_tokens``), ``request_id_headers``,
  ``access_log``, ``access_log_bodies``, the serving process's garbage collector
  (``gc_threshold``, ``gc_freeze``); see ``python/kvroute/serving/README.md``.

- ``tenants: [{name, key | key_sha256, rate_limit_rps, burst, max_concurrent,
  allowed_models, trust_session_key, revoked}]`` and ``admin: {key | key_sha256,
  protect_metrics}`` (the fork's multi-tenant API keys; `kvroute.serving.auth`): a plaintext
  ``key`` is replaced by its SHA-256 at load. ``response_cache: {max_entries, max_bytes,
  ttl_s, deterministic_only}``: the exact-match response cache
  (`kvroute.serving.response_cache`; ``backend: redis`` + ``redis_url`` shares it between
  router instances; ``semantic: {embeddings_url, model, threshold, max_entries, timeout_s}``
  serves the answer of a similar earlier prompt, in memory).
- ``adaptive_cache_weight: true`` or ``{min_weight, max_weight, step, interval,
  imbalance_tol, miss_tol, gap_tol, sample_every, tune_ttl, min_ttl_s, max_ttl_s, ttl_factor,
  ttl_over_tol, ttl_under_tol}``: tune the policy's ``cache_weight`` and
  ``speculative_ttl_s`` online from the engines' delivered cached tokens
  (`kvroute.adaptive.AdaptiveCacheWeight`, whose defaults fill the keys left out; ``kvroute
  serve --adaptive-cache-weight`` is ``true``); regular mode, ``kv_aware`` /
  ``lmcache_aware`` only.
- ``replicas: {redis_url | nats_url, replica_id, key_prefix, sync_interval_s, max_staleness_s,
  share_speculative, bootstrap_from, bootstrap_timeout_s, bootstrap_key_env}``: replicas of
  ``kvroute serve`` sharing in-flight load through Redis and starting from a peer's index
  snapshot (`kvroute.serving.replicas`).

``kvroute serve`` serves both modes: regular through `kvroute.fastapi.create_app`,
prefill/decode through `kvroute.serving.pd` (prefill request, then the decode request with
the engines' ``kv_transfer_params`` or SGLang's bootstrap fields, streamed from the decode
worker; ``--pd-uncached-token-threshold`` skips the prefill pool as `kvroute.PDRouter`).

Defaults where the vLLM router's YAML and its CLI differ: its YAML ``PolicyConfig`` has no
defaults (every key of a policy is required there); kvroute fills a missing key with the
vLLM router CLI's default (cache_aware 0.3, 64, 1.5, 120 s, 2^26; power_of_two 5 s;
consistent_hash 160). Its ``RouterConfig`` defaults to policy ``random``; kvroute's default
policy is ``kv_aware`` (fallback ``power_of_two``). ``kvroute serve`` listens on
127.0.0.1:8080 unless ``host`` / ``port`` (or ``--host`` / ``--port``) say otherwise; the
``metrics`` and ``health_check`` sections take the vLLM router's defaults (127.0.0.1:29000;
3, 2, 5 s, 60 s, ``/health``) for the keys they leave out.

Every mapping rejects keys it does not know, naming them and the keys it allows; every
``type`` rejects unknown values, listing the allowed ones. `load_config` reports every
problem at every level in one `ConfigError`. Each policy mapping becomes a
`kvroute.policies` object (``to_policy()``), whose class gives the defaults. See
``examples/router.yaml`` and ``examples/router-pd.yaml``.

Use::

    cfg = kvroute.config.load_config("router.yaml")
    router = kvroute.Router(cfg.workers(), **cfg.router_kwargs())   # or router_from_config(...)
    cfg.router_kwargs()["policy"]    # e.g. KvAware(cache_weight=0.7)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Mapping, Optional, Union
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from kvroute import _core
from kvroute import policies as P
from kvroute._router import Router, Worker, _z85_problem

__all__ = [
    "ConfigError",
    "RouterConfig",
    "WorkerConfig",
    "POLICY_TYPES",
    "FALLBACK_POLICY_TYPES",
    "MODE_TYPES",
    "load_config",
    "router_from_config",
]

# Policies that cannot be a fallback: they read the KV-event index or a controller.
_INDEX_POLICIES = tuple(n for n in P.POLICIES if n not in P.FALLBACK_POLICIES)
# The native defaults (cpp/router/router.h RouterOptions): every default below comes from here
# or from the `kvroute.policies` classes.
_DEFAULTS = _core.RouterOptions()


class ConfigError(ValueError):
    """An invalid router configuration. ``problems`` lists ``(key path, message)`` pairs."""

    def __init__(self, message: str, problems: Optional[List[tuple]] = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])


# -- building blocks ---------------------------------------------------------------------------

class _Model(BaseModel):
    """Strict, closed, immutable. Unknown keys are reported with the keys that are allowed."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # Input keys a subclass accepts and rewrites in `_prepare` (shorthands), besides its fields.
    _shorthand_keys: ClassVar[tuple] = ()

    @classmethod
    def _allowed_keys(cls) -> List[str]:
        keys: List[str] = ["type"] if "type" in cls.model_fields else []
        for name, field in cls.model_fields.items():
            if name == "type":
                continue
            keys.append(name)
            alias = field.validation_alias
            if isinstance(alias, AliasChoices):
                keys.extend(c for c in alias.choices if isinstance(c, str) and c not in keys)
            elif isinstance(alias, str) and alias not in keys:
                keys.append(alias)
        keys.extend(k for k in cls._shorthand_keys if k not in keys)
        return keys

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        allowed = cls._allowed_keys()
        # An unknown key stays in the mapping, its value wrapped: pydantic then reports it
        # (extra_forbidden, with its path) together with every other problem at every level,
        # and `_message` names the allowed keys.
        data = {k: (v if k in allowed else _UnknownKey(allowed, v)) for k, v in data.items()}
        for field in cls.model_fields.values():
            alias = field.validation_alias
            if isinstance(alias, AliasChoices):
                given = [c for c in alias.choices if isinstance(c, str) and c in data]
                if len(given) > 1:
                    raise ValueError(f"{' and '.join(given)} name the same setting; give one")
        return cls._prepare(dict(data))


class _UnknownKey:
    """The value of a key its mapping does not know, with the keys that mapping allows."""

    def __init__(self, allowed: List[str], value: Any) -> None:
        self.allowed = allowed
        self.value = value


NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
PosInt = Annotated[int, Field(ge=1)]


def _seconds(name: str, default: Any = None, **kw: Any) -> Any:
    """A ``<name>_s`` field (seconds) that also accepts ``<name>_secs``, the vLLM router's
    spelling, without a warning (users bring those files as they are)."""
    if default is None and "default_factory" not in kw:
        return Field(validation_alias=AliasChoices(f"{name}_s", f"{name}_secs"), **kw)
    return Field(default, validation_alias=AliasChoices(f"{name}_s", f"{name}_secs"), **kw)
_ENDPOINT_HELP = "a ZeroMQ endpoint such as tcp://10.0.0.5:5557"


def _check_endpoint(v: Optional[str], what: str) -> Optional[str]:
    if v is None:
        return v
    scheme, sep, rest = v.partition("://")
    if not sep or not scheme or not rest or any(c.isspace() for c in v):
        raise ValueError(f"{what} must be {_ENDPOINT_HELP}, got {v!r}")
    return v


# -- workers -----------------------------------------------------------------------------------

class WorkerConfig(_Model):
    """One engine: where requests go and, optionally, where its KV events come from.

    Also accepted in a worker list as a bare URL string (no KV events).
    """

    url: str = Field(min_length=1, description="Where requests go; the worker's identity.")
    kv_events: Optional[str] = Field(
        None, validation_alias=AliasChoices("kv_events", "kv_endpoint"),
        description="The engine's KV-event publisher (vLLM --kv-events-config endpoint).")
    replay: Optional[str] = Field(
        None, validation_alias=AliasChoices("replay", "replay_endpoint"),
        description="The engine's replay socket (vLLM --kv-events-config replay_endpoint).")
    dp_rank: Optional[Annotated[int, Field(ge=0)]] = Field(
        None, description="Data-parallel rank this endpoint publishes for.")
    bind: bool = Field(False, description="Bind the SUB socket instead of connecting.")
    curve_server_key: Optional[str] = Field(
        None, description="The publisher's CurveZMQ public key (Z85, 40 characters): the SUB "
                          "socket connects as a CURVE client (connected workers only).")
    bootstrap_port: Optional[Annotated[int, Field(ge=1, le=65535)]] = Field(
        None, description="PD prefill workers: the bootstrap port of the vLLM / SGLang routers' "
                          "prefill_urls entries. Kept for the proxy; not used for routing.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.strip() or any(c.isspace() for c in v):
            raise ValueError(f"url must be a non-empty string without spaces, got {v!r}")
        return v

    @field_validator("kv_events")
    @classmethod
    def _kv(cls, v: Optional[str]) -> Optional[str]:
        return _check_endpoint(v, "kv_events")

    @field_validator("replay")
    @classmethod
    def _replay(cls, v: Optional[str]) -> Optional[str]:
        return _check_endpoint(v, "replay")

    @field_validator("curve_server_key")
    @classmethod
    def _curve(cls, v: Optional[str]) -> Optional[str]:
        why = None if v is None else _z85_problem(v)
        if why:
            raise ValueError(f"curve_server_key {why}")
        return v

    @model_validator(mode="after")
    def _curve_connected(self) -> WorkerConfig:
        if self.curve_server_key is not None and (self.bind or self.kv_events is None):
            raise ValueError("curve_server_key is for a connected kv_events endpoint (bind: "
                             "false); a bound socket is a CURVE server with "
                             "kv_events.curve_secret_key")
        return self

    @property
    def name(self) -> str:
        """As `kvroute.Worker.name`: ``url`` or ``url|dp=<rank>``."""
        return self.url if self.dp_rank is None else f"{self.url}|dp={self.dp_rank}"

    def to_worker(self) -> Worker:
        return Worker(self.url, kv_endpoint=self.kv_events, dp_rank=self.dp_rank,
                      bind=self.bind, replay_endpoint=self.replay,
                      curve_server_key=self.curve_server_key)


def _worker_entries(value: Any) -> Any:
    """A worker list entry may be a bare URL string."""
    if isinstance(value, list):
        return [{"url": w} if isinstance(w, str) else w for w in value]
    return value


def _url_entries(value: Any, key: str, allow_port: bool) -> List[Any]:
    """``worker_urls`` / ``decode_urls``: URL strings; ``prefill_urls`` also ``[url, port]``."""
    if not isinstance(value, list):
        raise ValueError(f"{key} must be a list of URL strings, got {type(value).__name__}")
    out: List[Any] = []
    for i, u in enumerate(value):
        if isinstance(u, str):
            out.append({"url": u})
        elif allow_port and isinstance(u, (list, tuple)) and len(u) == 2 and isinstance(u[0], str):
            out.append({"url": u[0], "bootstrap_port": u[1]})
        else:
            form = "a URL string or [url, bootstrap_port]" if allow_port else "a URL string"
            raise ValueError(f"{key}[{i}] must be {form}, got {u!r}")
    return out


def _unique(workers: List[WorkerConfig], where: str) -> List[WorkerConfig]:
    if not workers:
        raise ValueError(f"{where} needs at least one worker")
    seen: Dict[str, int] = {}
    for i, w in enumerate(workers):
        if w.name in seen:
            raise ValueError(f"{where}: worker {w.name!r} appears twice "
                             f"(entries {seen[w.name]} and {i})")
        seen[w.name] = i
    return workers


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


# -- modes -------------------------------------------------------------------------------------

class ModeKvEventsConfig(_Model):
    """``mode.kv_events`` of the vLLM router fork (v0.12): ``topic_filter`` is the ZeroMQ SUB
    prefix filter (overrides the top-level ``kv_events.topic``); ``default_port``: a worker
    without its own ``kv_events`` endpoint, in a pool whose policy reads KV events
    (``kv_aware``, ``cost``), publishes on ``tcp://<host of its url>:<default_port>`` (data-
    parallel rank r on ``default_port + r``)."""

    topic_filter: Optional[str] = None
    default_port: Optional[Annotated[int, Field(ge=1, le=65535)]] = None


class RegularMode(_Model):
    """One pool of workers. ``workers`` (with KV endpoints) or the vLLM router's
    ``worker_urls`` (URLs only), not both."""

    type: Literal["regular"]
    workers: List[WorkerConfig]
    kv_events: Optional[ModeKvEventsConfig] = None
    _shorthand_keys: ClassVar[tuple] = ("worker_urls",)

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        if "worker_urls" in data:
            if "workers" in data:
                raise ValueError("give either workers or worker_urls, not both")
            data["workers"] = _url_entries(data.pop("worker_urls"), "worker_urls", False)
        elif "workers" not in data:
            raise ValueError("regular mode needs workers (or worker_urls)")
        else:
            data["workers"] = _worker_entries(data["workers"])
        return data

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: List[WorkerConfig]) -> List[WorkerConfig]:
        return _unique(v, "workers")


class PdMode(_Model):
    """Prefill/decode disaggregation: separate prefill and decode pools, each routed by its own
    policy. ``prefill`` / ``decode`` worker lists, or the vLLM / SGLang routers'
    ``prefill_urls`` (URL or ``[url, bootstrap_port]``) / ``decode_urls``. ``prefill_policy``
    / ``decode_policy`` may sit here (as in the vLLM router) or at the top level."""

    type: Literal["pd_disaggregation", "prefill_decode", "vllm_prefill_decode"]
    prefill: List[WorkerConfig]
    decode: List[WorkerConfig]
    prefill_policy: Optional[Policy] = None
    decode_policy: Optional[Policy] = None
    kv_events: Optional[ModeKvEventsConfig] = None
    _shorthand_keys: ClassVar[tuple] = ("prefill_urls", "decode_urls")

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        for pool in ("prefill", "decode"):
            short = f"{pool}_urls"
            if short in data:
                if pool in data:
                    raise ValueError(f"give either {pool} or {short}, not both")
                data[pool] = _url_entries(data.pop(short), short, pool == "prefill")
            elif pool not in data:
                raise ValueError(f"{data.get('type', 'pd')} mode needs {pool} (or {short})")
            else:
                data[pool] = _worker_entries(data[pool])
            key = f"{pool}_policy"
            if key in data:
                data[key] = _as_policy_dict(data[key], P.DEFAULT_POLICY)
        return data

    @field_validator("type")
    @classmethod
    def _canonical(cls, v: str) -> str:
        return "pd_disaggregation"

    @field_validator("prefill")
    @classmethod
    def _prefill(cls, v: List[WorkerConfig]) -> List[WorkerConfig]:
        return _unique(v, "prefill")

    @field_validator("decode")
    @classmethod
    def _decode(cls, v: List[WorkerConfig]) -> List[WorkerConfig]:
        return _unique(v, "decode")


Mode = Annotated[Union[RegularMode, PdMode], Field(discriminator="type")]
MODE_TYPES = ("regular", "pd_disaggregation", "prefill_decode", "vllm_prefill_decode")


# -- the rest ----------------------------------------------------------------------------------

class KvEventsConfig(_Model):
    """KV-event ingestion (Router ``topic``, ``ingest_threads``, ``ingest_nice``,
    ``replay_timeout_s``, ``degraded_hold_s``, ``stale_after_s``, ``receive_hwm``,
    ``max_replay_queue_bytes``, ``allowed_publisher_ips``, ``curve_secret_key``,
    ``curve_allowed_publisher_keys``; the ``*_secs`` spellings are
    accepted too)."""

    topic: str = Field(_DEFAULTS.topic,
                       description='ZeroMQ SUB prefix filter on the topic frame (vLLM default "").')
    ingest_threads: PosInt = _DEFAULTS.ingest_threads
    ingest_nice: Annotated[int, Field(ge=0, le=19)] = Field(
        _DEFAULTS.ingest_nice, description="Nice increment of the ingestion threads (0-19; Linux).")
    replay_timeout_s: PosFloat = _seconds("replay_timeout", _DEFAULTS.replay_timeout_s)
    degraded_hold_s: NonNegFloat = _seconds("degraded_hold", _DEFAULTS.degraded_hold_s)
    stale_after_s: NonNegFloat = Field(
        _DEFAULTS.stale_after_s,
        description="A worker silent this long reads stale (decisions: as degraded); 0 = off.")
    receive_hwm: PosInt = Field(_DEFAULTS.receive_hwm,
                                description="Messages a SUB socket queues at most.")
    max_replay_queue_bytes: PosInt = Field(
        _DEFAULTS.max_replay_queue_bytes,
        description="Bytes of live messages kept per worker while it replays.")
    allowed_publisher_ips: Optional[List[str]] = Field(
        None, description="Bound SUB sockets accept publishers from these IP addresses only.")
    curve_secret_key: Optional[str] = Field(
        None, description="The router's CurveZMQ secret key (Z85): bound SUB sockets are CURVE "
                          "servers with it.")
    curve_allowed_publisher_keys: Optional[List[str]] = Field(
        None, description="Publisher public keys (Z85) bound CURVE sockets accept; needs "
                          "curve_secret_key.")

    @field_validator("curve_secret_key")
    @classmethod
    def _curve_secret(cls, v: Optional[str]) -> Optional[str]:
        why = None if v is None else _z85_problem(v)
        if why:
            raise ValueError(f"curve_secret_key {why}")
        return v

    @field_validator("curve_allowed_publisher_keys")
    @classmethod
    def _curve_allowed(cls, v: Optional[List[str]]) -> Optional[List[str]]:
        for i, k in enumerate(v or ()):
            why = _z85_problem(k)
            if why:
                raise ValueError(f"curve_allowed_publisher_keys[{i}] {why}")
        return v

    @model_validator(mode="after")
    def _curve_pair(self) -> KvEventsConfig:
        if self.curve_allowed_publisher_keys and self.curve_secret_key is None:
            raise ValueError("curve_allowed_publisher_keys needs curve_secret_key")
        return self


class LimitsConfig(_Model):
    """Memory caps on indexed blocks and on the blocks of live speculative credits (``null`` =
    no cap), and the largest accepted payload."""

    max_blocks_per_worker: Optional[PosInt] = _DEFAULTS.index.max_blocks_per_worker or None
    max_blocks_total: Optional[PosInt] = _DEFAULTS.index.max_blocks_total or None
    max_speculative_blocks: Optional[PosInt] = _DEFAULTS.index.max_speculative_blocks or None
    max_payload_bytes: PosInt = _DEFAULTS.limits.max_payload_bytes


class CircuitBreakerConfig(_Model):
    """Per-worker circuit breaker of ``kvroute serve``: open after ``failures`` consecutive
    upstream failures, let requests through again (ramped up) after ``reset_s`` seconds (also
    accepted as ``reset_secs``)."""

    failures: PosInt = 3
    reset_s: PosFloat = _seconds("reset", 10.0)


class ScrapeMetricsConfig(_Model):
    """Prometheus scrape of every worker's ``/metrics`` (vLLM ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc``) every ``interval_s`` seconds with a ``timeout_s`` bound;
    load older than ``stale_after_s`` is forgotten (each also accepted as ``*_secs``)."""

    interval_s: PosFloat = _seconds("interval", 1.0)
    timeout_s: PosFloat = _seconds("timeout", 0.5)
    stale_after_s: PosFloat = _seconds("stale_after", 5.0)


RetryKind = Literal["connect", "timeout", "5xx", "429"]
_RETRY_KINDS: List[RetryKind] = ["connect", "timeout", "5xx", "429"]


class RetryConfig(_Model):
    """Backoff between retries and what is retried (`kvroute.serving.retry.RetryPolicy`;
    the vLLM router's ``retry`` section without ``max_retries``, which is
    ``serving.max_retries``). Defaults are the vLLM router's."""

    initial_backoff_ms: NonNegFloat = 50.0
    max_backoff_ms: NonNegFloat = 30_000.0
    backoff_multiplier: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1.5
    jitter_factor: Annotated[float, Field(ge=0, le=1)] = 0.2
    retry_on: List[RetryKind] = Field(default_factory=lambda: list(_RETRY_KINDS))

    @field_validator("retry_on", mode="before")
    @classmethod
    def _kinds_as_strings(cls, v: Any) -> Any:
        # YAML reads a bare 429 as an int.
        return [str(x) if isinstance(x, int) else x for x in v] if isinstance(v, list) else v


class VllmRetryConfig(_Model):
    """The vLLM router's top-level ``retry`` section (``RetryConfig``; its ``max_retries``
    counts attempts, default 5)."""

    max_retries: PosInt = 5
    initial_backoff_ms: NonNegFloat = 50.0
    max_backoff_ms: NonNegFloat = 30_000.0
    backoff_multiplier: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1.5
    jitter_factor: Annotated[float, Field(ge=0, le=1)] = 0.2


class ServingConfig(_Model):
    """The HTTP front of ``kvroute serve`` / `kvroute.fastapi.create_app` (the Router itself
    ignores it). Command-line flags and keyword arguments override these."""

    model: Optional[str] = Field(None, description="The engines' served model name.")
    tokenizer: Optional[str] = Field(
        None, description="Directory with the model's tokenizer.json and tokenizer_config.json.")
    upstream_timeout_s: PosFloat = _seconds("upstream_timeout", 600.0)
    connect_timeout_s: PosFloat = _seconds("connect_timeout", 5.0)
    max_retries: Annotated[int, Field(ge=0, le=16)] = 2
    circuit_breaker: CircuitBreakerConfig = Field(default_factory=CircuitBreakerConfig)
    scrape_metrics: Optional[ScrapeMetricsConfig] = None
    orca: Literal["text", "json", "off"] = "text"
    first_byte_timeout_s: Optional[PosFloat] = Field(
        None, validation_alias=AliasChoices("first_byte_timeout_s", "first_byte_timeout_secs"))
    retry: RetryConfig = Field(default_factory=RetryConfig)
    recovery_ramp_s: NonNegFloat = _seconds("recovery_ramp", 10.0)
    max_body_bytes: Optional[PosInt] = 32 << 20
    max_prompt_tokens: Union[PosInt, Literal["auto"], None] = "auto"
    chars_per_token: PosFloat = 16.0
    tokenizer_threads: Optional[PosInt] = None
    long_prompt_chars: Optional[PosInt] = 65536
    long_prompt_threads: Optional[PosInt] = None
    tokenizer_max_queued: Optional[Annotated[int, Field(ge=0)]] = None
    prefix_cache_tokens: Annotated[int, Field(ge=0)] = 1 << 22
    request_id_headers: List[str] = Field(default_factory=lambda: ["x-request-id"],
                                          min_length=1)
    access_log: bool = True
    access_log_bodies: bool = False  # also log completion bodies (a replay trace's source)
    # kvroute serve's process: the garbage collector's thresholds (gc.set_threshold; null:
    # CPython's 700, 10, 10) and a gc.freeze() of the heap built before serving.
    gc_threshold: Optional[Annotated[List[PosInt], Field(min_length=3, max_length=3)]] = [
        50_000, 20, 100]
    gc_freeze: bool = True

    def tokenizer_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for `kvroute.prompt.PromptTokenizer.from_dir`."""
        return {"max_workers": self.tokenizer_threads,
                "long_prompt_chars": self.long_prompt_chars,
                "long_workers": self.long_prompt_threads,
                "max_queued": self.tokenizer_max_queued,
                "prefix_cache_tokens": self.prefix_cache_tokens}

    def create_router_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for `kvroute.fastapi.create_router` (not ``tokenizer``/``model``),
        plus ``request_id_headers``, ``access_log`` and ``access_log_bodies``
        (`kvroute.fastapi.create_app`'s)."""
        sm = self.scrape_metrics
        return {
            "first_byte_timeout_s": self.first_byte_timeout_s,
            "retry": self.retry.model_dump(),
            "recovery_ramp_s": self.recovery_ramp_s,
            "limits": {"max_body_bytes": self.max_body_bytes,
                       "max_prompt_tokens": self.max_prompt_tokens,
                       "chars_per_token": self.chars_per_token},
            "request_id_headers": list(self.request_id_headers),
            "access_log": self.access_log,
            "access_log_bodies": self.access_log_bodies,
            "upstream_timeout_s": self.upstream_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "max_retries": self.max_retries,
            "breaker_failures": self.circuit_breaker.failures,
            "breaker_reset_s": self.circuit_breaker.reset_s,
            "scrape_metrics_interval_s": sm.interval_s if sm is not None else None,
            "scrape_timeout_s": sm.timeout_s if sm is not None else 0.5,
            "scrape_stale_after_s": sm.stale_after_s if sm is not None else None,
            "orca": False if self.orca == "off" else self.orca.upper(),
        }


class MetricsServerConfig(_Model):
    """The vLLM router's ``metrics`` section (``MetricsConfig``: Prometheus on its own
    listener): ``kvroute serve`` serves ``GET /metrics`` on ``host:port`` as well as on the
    main port. Defaults are the vLLM router's (127.0.0.1:29000)."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 29000


class HealthCheckConfig(_Model):
    """The vLLM router's ``health_check`` section (``HealthCheckConfig``): ``kvroute serve``
    sends ``GET <worker url><endpoint>`` to every worker every ``check_interval_s`` seconds
    (bounded by ``timeout_s``); ``failure_threshold`` consecutive failures take the worker
    out of routing, ``success_threshold`` consecutive successes bring it back. Defaults are
    the vLLM router's; ``*_secs`` spellings accepted."""

    failure_threshold: PosInt = 3
    success_threshold: PosInt = 2
    timeout_s: PosFloat = _seconds("timeout", 5.0)
    check_interval_s: PosFloat = _seconds("check_interval", 60.0)
    endpoint: str = Field("/health", min_length=1)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"endpoint must be a path starting with '/', got {v!r}")
        return v


def _hash_keys(data: Dict[str, Any]) -> Dict[str, Any]:
    """A plaintext ``key`` becomes its ``key_sha256`` (hex SHA-256 of the UTF-8 key); the
    plaintext is not kept."""
    if "key" in data:
        import hashlib

        if "key_sha256" in data:
            raise ValueError("key and key_sha256 name the same setting; give one")
        key = data.pop("key")
        if not isinstance(key, str) or not key:
            raise ValueError("key must be a non-empty string")
        data["key_sha256"] = hashlib.sha256(key.encode("utf-8")).hexdigest()
    return data


Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class TenantConfig(_Model):
    """One tenant of ``kvroute serve`` (`kvroute.serving.auth`): its API key (``key_sha256``,
    or ``key`` hashed at load), a token bucket (``rate_limit_rps`` requests per second,
    ``burst`` deep, default ``max(1, ceil(rate_limit_rps))``), ``max_concurrent`` requests in
    flight, ``allowed_models`` (fnmatch patterns), ``trust_session_key`` (use the client's
    session headers / body fields for the hashing policies) and ``revoked``."""

    _shorthand_keys: ClassVar[tuple] = ("key",)
    name: str = Field(min_length=1)
    key_sha256: Sha256Hex
    rate_limit_rps: Optional[PosFloat] = None
    burst: Optional[PosInt] = None
    max_concurrent: Optional[PosInt] = None
    allowed_models: List[str] = Field(default_factory=lambda: ["*"])
    trust_session_key: bool = False
    revoked: bool = False

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        return _hash_keys(data)


class AdminConfig(_Model):
    """The admin key of ``kvroute serve`` (``key_sha256``, or ``key`` hashed at load): needed
    for ``/admin/*``, ``GET /workers``, ``POST /v1/explain``, and ``GET /metrics`` when
    ``protect_metrics``."""

    _shorthand_keys: ClassVar[tuple] = ("key",)
    key_sha256: Sha256Hex
    protect_metrics: bool = False

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        return _hash_keys(data)


class SemanticCacheConfig(_Model):
    """Semantic mode of the response cache (`kvroute.serving.response_cache.SemanticIndex`):
    the ``/v1/embeddings`` URL (and ``model``) that embeds prompts, the cosine ``threshold``
    for a hit, at most ``max_entries`` embeddings, ``timeout_s`` per embedding request."""

    embeddings_url: str = Field(min_length=1)
    model: Optional[str] = None
    threshold: Annotated[float, Field(gt=0, le=1)] = 0.95
    max_entries: PosInt = 1024
    timeout_s: PosFloat = _seconds("timeout", 5.0)


class ResponseCacheConfig(_Model):
    """``kvroute serve``'s exact-match response cache (`kvroute.serving.response_cache`): in
    memory, LRU over ``max_entries`` entries and ``max_bytes`` body bytes, entries live
    ``ttl_s`` seconds (``ttl_secs`` accepted); ``deterministic_only``: only requests with
    ``temperature`` 0 or a ``seed``. ``backend: redis`` with ``redis_url``
    (``redis://host:port/db``): shared by router instances, expired by Redis
    (``max_entries`` does not apply there)."""

    max_entries: PosInt = 1024
    max_bytes: PosInt = 64 << 20
    ttl_s: PosFloat = _seconds("ttl", 300.0)
    deterministic_only: bool = True
    backend: Literal["memory", "redis"] = "memory"
    redis_url: Optional[str] = Field(None, min_length=1)
    semantic: Optional[SemanticCacheConfig] = None


class AdaptiveCacheWeightConfig(_Model):
    """``adaptive_cache_weight``: online tuning of the policy's ``cache_weight`` and of
    ``speculative_ttl_s`` from what the engines delivered (`kvroute.adaptive`). ``true`` (or
    ``{}``) turns it on with `kvroute.adaptive.AdaptiveCacheWeight`'s defaults; a mapping
    sets any of its keyword arguments (the keys below; a key left out keeps the class's
    default); ``false`` or absent: off. Regular mode and a policy with a ``cache_weight``
    (``kv_aware``, ``lmcache_aware``) only."""

    min_weight: Optional[Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]] = None
    max_weight: Optional[Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]] = None
    step: Optional[Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]] = None
    interval: Optional[PosInt] = None
    imbalance_tol: Optional[PosFloat] = None
    miss_tol: Optional[NonNegFloat] = None
    gap_tol: Optional[NonNegFloat] = None
    sample_every: Optional[PosInt] = None
    tune_ttl: Optional[bool] = None
    min_ttl_s: Optional[PosFloat] = Field(
        None, validation_alias=AliasChoices("min_ttl_s", "min_ttl_secs"))
    max_ttl_s: Optional[PosFloat] = Field(
        None, validation_alias=AliasChoices("max_ttl_s", "max_ttl_secs"))
    ttl_factor: Optional[Annotated[float, Field(gt=1, allow_inf_nan=False)]] = None
    ttl_over_tol: Optional[NonNegFloat] = None
    ttl_under_tol: Optional[NonNegFloat] = None

    @model_validator(mode="after")
    def _bounds(self) -> AdaptiveCacheWeightConfig:
        from kvroute.adaptive import AdaptiveCacheWeight

        AdaptiveCacheWeight.check_settings(**self.kwargs())
        return self

    def kwargs(self) -> Dict[str, Any]:
        """The keys given, as `kvroute.adaptive.AdaptiveCacheWeight` keyword arguments."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ReplicasConfig(_Model):
    """Router replicas as one system (`kvroute.serving.replicas`): ``redis_url`` shares
    every replica's in-flight load and speculative credits through Redis (synced every
    ``sync_interval_s``; peers' counts older than ``max_staleness_s`` are not used);
    ``nats_url`` does the same through NATS (neither: standalone); ``bootstrap_from`` lists
    peer URLs whose index snapshot a starting replica loads (``GET /admin/snapshot``, admin
    key from the ``bootstrap_key_env`` variable) before ``GET /ready`` answers 200."""

    redis_url: Optional[str] = Field(None, min_length=1)
    nats_url: Optional[str] = Field(None, min_length=1)
    replica_id: Optional[str] = Field(None, min_length=1)
    key_prefix: str = Field("kvroute", min_length=1)
    sync_interval_s: PosFloat = _seconds("sync_interval", 0.1)
    max_staleness_s: PosFloat = _seconds("max_staleness", 1.0)
    share_speculative: bool = True
    bootstrap_from: List[str] = Field(default_factory=list)
    bootstrap_timeout_s: PosFloat = _seconds("bootstrap_timeout", 10.0)
    bootstrap_key_env: str = "KVROUTE_ADMIN_KEY"

    @model_validator(mode="after")
    def _staleness(self) -> ReplicasConfig:
        if not self.max_staleness_s > self.sync_interval_s:
            raise ValueError(f"max_staleness_s ({self.max_staleness_s}) must exceed "
                             f"sync_interval_s ({self.sync_interval_s})")
        if self.redis_url is not None and self.nats_url is not None:
            raise ValueError("give redis_url or nats_url, not both")
        if self.nats_url is not None and not self.nats_url.startswith(("nats://", "tls://")):
            raise ValueError(f"nats_url must be nats:// or tls://, got {self.nats_url!r}")
        if self.redis_url is not None and not self.redis_url.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must be redis://, rediss:// or unix://, got "
                             f"{self.redis_url!r}")
        for u in self.bootstrap_from:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"bootstrap_from: {u!r} is not an http(s) URL")
        return self


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _tcp_port_plus(endpoint: Optional[str], rank: int) -> Optional[str]:
    """``tcp://host:port`` with ``port + rank`` (vLLM: data-parallel rank r publishes on the
    endpoint's port + r); other endpoints unchanged."""
    if endpoint is None or rank == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + rank}"
    return endpoint


class RouterConfig(_Model):
    """A whole router configuration. Build one with `load_config`."""

    mode: Mode
    policy: Policy = Field(default_factory=lambda: _POLICY_MODELS[P.DEFAULT_POLICY](
        type=P.DEFAULT_POLICY))
    prefill_policy: Optional[Policy] = None
    decode_policy: Optional[Policy] = None
    block_size: PosInt = _DEFAULTS.index.block_size
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    speculative_ttl_s: NonNegFloat = _seconds("speculative_ttl", _DEFAULTS.speculative_ttl_s)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] = _DEFAULTS.seed
    serving: ServingConfig = Field(default_factory=ServingConfig)
    # The vLLM router's server keys (src/config/types.rs RouterConfig), for `kvroute serve`.
    host: Optional[str] = Field(None, min_length=1)
    port: Optional[Annotated[int, Field(ge=0, le=65535)]] = None
    log_level: Optional[str] = None
    metrics: Optional[MetricsServerConfig] = None
    health_check: Optional[HealthCheckConfig] = None
    intra_node_data_parallel_size: PosInt = 1
    model_path: Optional[str] = Field(None, min_length=1)
    # PD mode: skip the prefill pool when the decode worker would prefill at most this many
    # tokens (`kvroute.PDRouter`); None: never skip.
    pd_uncached_token_threshold: Optional[Annotated[int, Field(ge=0)]] = None
    # `kvroute serve`'s API keys and limits (kvroute.serving.auth).
    tenants: Optional[List[TenantConfig]] = None
    admin: Optional[AdminConfig] = None
    response_cache: Optional[ResponseCacheConfig] = None
    # Replicas sharing load through Redis, bootstrap from a peer (kvroute.serving.replicas).
    replicas: Optional[ReplicasConfig] = None
    # Online tuning of cache_weight and speculative_ttl_s (kvroute.adaptive); true = defaults.
    adaptive_cache_weight: Optional[AdaptiveCacheWeightConfig] = None

    # The vLLM router's request-path keys, folded into `serving` (see `_vllm_router_keys`).
    retry: Optional[VllmRetryConfig] = None
    disable_retries: bool = False
    max_payload_size: Optional[PosInt] = None
    request_id_headers: Optional[List[str]] = Field(None, min_length=1)

    @model_validator(mode="after")
    def _vllm_router_keys(self) -> RouterConfig:
        """The vLLM router's top-level ``retry`` (its ``max_retries`` counts attempts: 1 = no
        retry), ``disable_retries``, ``max_payload_size`` and ``request_id_headers`` set
        ``serving.max_retries`` / ``serving.retry``, ``serving.max_body_bytes`` and
        ``serving.request_id_headers``; giving a setting both ways is refused."""
        sv = self.serving
        given = sv.model_fields_set
        update: Dict[str, Any] = {}
        r = self.retry
        if r is not None:
            if "retry" in given or "max_retries" in given:
                raise ValueError("retry is set both at the top level (the vLLM router's) and "
                                 "under serving; keep one")
            update["max_retries"] = max(0, min(16, r.max_retries - 1))
            update["retry"] = RetryConfig(initial_backoff_ms=r.initial_backoff_ms,
                                          max_backoff_ms=r.max_backoff_ms,
                                          backoff_multiplier=r.backoff_multiplier,
                                          jitter_factor=r.jitter_factor)
        if self.disable_retries:
            update["max_retries"] = 0
        for top, key in (("max_payload_size", "max_body_bytes"),
                         ("request_id_headers", "request_id_headers")):
            v = getattr(self, top)
            if v is None:
                continue
            if key in given:
                raise ValueError(f"{top} (the vLLM router's) and serving.{key} name the same "
                                 f"setting; keep one")
            update[key] = v
        if not update:
            return self
        return self.model_copy(update={"serving": sv.model_copy(update=update)})

    @field_validator("adaptive_cache_weight", mode="before")
    @classmethod
    def _adaptive_shape(cls, v: Any) -> Any:
        if v is True:
            return {}
        if v is False or v is None:
            return None
        if not isinstance(v, Mapping):
            raise ValueError(f"must be true, false or a mapping of AdaptiveCacheWeight "
                             f"settings ({', '.join(AdaptiveCacheWeightConfig.model_fields)}), "
                             f"got {v!r}")
        return v

    @model_validator(mode="after")
    def _adaptive_fits(self) -> RouterConfig:
        if self.adaptive_cache_weight is None:
            return self
        if self.is_pd:
            raise ValueError("adaptive_cache_weight tunes one pool's cache_weight; not in "
                             "prefill/decode mode (remove the key)")
        if "cache_weight" not in type(self.policy).model_fields:
            raise ValueError(f"adaptive_cache_weight tunes the policy's cache_weight; policy "
                             f"{self.policy.type} has none (use kv_aware or lmcache_aware)")
        return self

    def adaptive_kwargs(self) -> Optional[Dict[str, Any]]:
        """`kvroute.adaptive.AdaptiveCacheWeight` keyword arguments from
        ``adaptive_cache_weight`` (``{}``: its defaults), or None: not configured."""
        a = self.adaptive_cache_weight
        return None if a is None else a.kwargs()

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        low = {"warn": "warning"}.get(v.lower(), v.lower())
        if low not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {v!r}")
        return low

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        mode = data.get("mode")
        if isinstance(mode, Mapping) and "type" not in mode:
            pd = any(k in mode for k in ("prefill", "decode", "prefill_urls", "decode_urls"))
            data["mode"] = {"type": "pd_disaggregation" if pd else "regular", **mode}
        for key in ("policy", "prefill_policy", "decode_policy"):
            if key in data:
                data[key] = _as_policy_dict(data[key], P.DEFAULT_POLICY)
        return data

    @model_validator(mode="after")
    def _pd_policies(self) -> RouterConfig:
        if isinstance(self.mode, PdMode):
            for key in ("prefill_policy", "decode_policy"):
                if getattr(self, key) is not None and getattr(self.mode, key) is not None:
                    raise ValueError(f"{key} is set both at the top level and under mode; keep one")
        else:
            for key in ("prefill_policy", "decode_policy"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} applies only to mode type pd_disaggregation "
                                     f"(mode type is {self.mode.type!r})")
        for where, pol, pool in self._pools():
            if isinstance(pol, LmcacheAwarePolicy):
                known = {w.url for w in pool} | {w.name for w in pool}
                stray = sorted(v for v in pol.lmcache_worker_map.values() if v not in known)
                if stray:
                    raise ValueError(
                        f"{where}: lmcache_worker_map names no worker of the pool it routes: "
                        f"{', '.join(stray)} (workers: {', '.join(w.name for w in pool)})")
        return self

    def _pools(self) -> List[tuple]:
        """``(label, policy model, worker configs)`` for each pool."""
        if isinstance(self.mode, PdMode):
            return [("prefill_policy", self._pd_policy("prefill_policy"), self.mode.prefill),
                    ("decode_policy", self._pd_policy("decode_policy"), self.mode.decode)]
        return [("policy", self.policy, self.mode.workers)]

    def _expand(self, pool: List[WorkerConfig], policy: BaseModel) -> List[Worker]:
        """The pool's workers: one per data-parallel rank when ``intra_node_data_parallel_size``
        > 1 (rank r's KV events and replay on port + r), and ``mode.kv_events.default_port``
        for the workers without an endpoint when the policy reads KV events."""
        mk = self.mode.kv_events
        port = mk.default_port if mk is not None and isinstance(policy, _PoolIndexKeys) else None
        out: List[Worker] = []
        for w in pool:
            kv = w.kv_events
            if kv is None and port is not None:
                host = urlsplit(w.url).hostname
                kv = f"tcp://{host}:{port}" if host else None
            if w.dp_rank is not None or self.intra_node_data_parallel_size == 1:
                out.append(Worker(w.url, kv_endpoint=kv, dp_rank=w.dp_rank, bind=w.bind,
                                  replay_endpoint=w.replay, curve_server_key=w.curve_server_key))
                continue
            for r in range(self.intra_node_data_parallel_size):
                out.append(Worker(w.url, kv_endpoint=_tcp_port_plus(kv, r), dp_rank=r,
                                  bind=w.bind, replay_endpoint=_tcp_port_plus(w.replay, r),
                                  curve_server_key=w.curve_server_key))
        return out

    # -- views ---------------------------------------------------------------------------------
    @property
    def is_pd(self) -> bool:
        """True in prefill/decode disaggregation mode."""
        return isinstance(self.mode, PdMode)

    def _common_kwargs(self) -> Dict[str, Any]:
        ev, lim = self.kv_events, self.limits
        return {
            "block_size": self.block_size,
            "speculative_ttl_s": self.speculative_ttl_s,
            "seed": self.seed,
            "topic": (self.mode.kv_events.topic_filter
                      if self.mode.kv_events is not None
                      and self.mode.kv_events.topic_filter is not None else ev.topic),
            "ingest_threads": ev.ingest_threads,
            "ingest_nice": ev.ingest_nice,
            "replay_timeout_s": ev.replay_timeout_s,
            "degraded_hold_s": ev.degraded_hold_s,
            "stale_after_s": ev.stale_after_s,
            "receive_hwm": ev.receive_hwm,
            "max_replay_queue_bytes": ev.max_replay_queue_bytes,
            "allowed_publisher_ips": ev.allowed_publisher_ips,
            "curve_secret_key": ev.curve_secret_key,
            "curve_allowed_publisher_keys": ev.curve_allowed_publisher_keys,
            "max_payload_bytes": lim.max_payload_bytes,
            "max_blocks_per_worker": lim.max_blocks_per_worker,
            "max_blocks_total": lim.max_blocks_total,
            "max_speculative_blocks": lim.max_speculative_blocks,
        }

    def _need(self, pd: bool, what: str) -> None:
        if pd and not self.is_pd:
            raise ConfigError(f"{what} needs mode type pd_disaggregation; this config is "
                              f"{self.mode.type!r}: use workers() and router_kwargs()")
        if not pd and self.is_pd:
            raise ConfigError(f"{what} is for mode type regular; this config is "
                              "pd_disaggregation: use prefill_workers() / prefill_router_kwargs() "
                              "and decode_workers() / decode_router_kwargs()")

    def router_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for ``kvroute.Router(self.workers(), **kwargs)`` (regular mode):
        ``policy`` (a `kvroute.policies` object), ``fallback`` (another, for the policies
        that have one: ``kv_aware``, ``cost``, ``lmcache_aware``) and the common settings
        (``block_size``, ``speculative_ttl_s``, ``seed``, ``topic``, ``ingest_threads``,
        ``ingest_nice``, ``replay_timeout_s``, ``degraded_hold_s``, the caps and
        ``max_payload_bytes``)."""
        self._need(False, "router_kwargs()")
        return _pool_kwargs(self.policy, self._common_kwargs())

    def workers(self) -> List[Worker]:
        """The workers as `kvroute.Worker` (regular mode), one per data-parallel rank."""
        self._need(False, "workers()")
        assert isinstance(self.mode, RegularMode)
        return self._expand(self.mode.workers, self.policy)

    def _pd_policy(self, key: str) -> BaseModel:
        assert isinstance(self.mode, PdMode)
        return getattr(self.mode, key) or getattr(self, key) or self.policy

    def prefill_policy_config(self) -> BaseModel:
        """PD mode: ``prefill_policy`` (under mode or top level), else ``policy``."""
        self._need(True, "prefill_policy_config()")
        return self._pd_policy("prefill_policy")

    def decode_policy_config(self) -> BaseModel:
        """PD mode: ``decode_policy`` (under mode or top level), else ``policy``."""
        self._need(True, "decode_policy_config()")
        return self._pd_policy("decode_policy")

    def prefill_workers(self) -> List[Worker]:
        """PD mode: the prefill pool as `kvroute.Worker`."""
        self._need(True, "prefill_workers()")
        assert isinstance(self.mode, PdMode)
        return self._expand(self.mode.prefill, self._pd_policy("prefill_policy"))

    def decode_workers(self) -> List[Worker]:
        """PD mode: the decode pool as `kvroute.Worker`."""
        self._need(True, "decode_workers()")
        assert isinstance(self.mode, PdMode)
        return self._expand(self.mode.decode, self._pd_policy("decode_policy"))

    def prefill_router_kwargs(self) -> Dict[str, Any]:
        """PD mode: ``kvroute.Router(self.prefill_workers(), **kwargs)``."""
        return _pool_kwargs(self.prefill_policy_config(), self._common_kwargs())

    def decode_router_kwargs(self) -> Dict[str, Any]:
        """PD mode: ``kvroute.Router(self.decode_workers(), **kwargs)``."""
        return _pool_kwargs(self.decode_policy_config(), self._common_kwargs())


# -- loading -----------------------------------------------------------------------------------

class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that rejects a key given twice in one mapping (PyYAML keeps the last)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: Dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1} "
                              f"(first at line {seen[key] + 1})")
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

#: Top-level keys of the vLLM router's ``RouterConfig`` (vllm-project/router
#: src/config/types.rs) that kvroute has no counterpart for: a config naming any of them is
#: refused with one problem listing them all (kvroute's own equivalents, where it has one:
#: ``serving.upstream_timeout_s``, ``serving.max_retries``, ``serving.circuit_breaker``,
#: ``limits.max_payload_bytes`` for KV-event payloads).
VLLM_ROUTER_KEYS_NOT_HONOURED = (
    "connection_mode", "request_timeout_secs",
    "worker_startup_timeout_secs", "worker_startup_check_interval_secs", "api_key",
    "api_key_validation_urls", "discovery", "log_dir",
    "max_concurrent_requests", "queue_size", "queue_timeout_secs",
    "rate_limit_tokens_per_second", "cors_allowed_origins", "circuit_breaker",
    "disable_circuit_breaker", "enable_igw", "history_backend",
    "enable_profiling", "profile_timeout_secs", "kv_connector", "program_scheduling",
)

_UNION_FIELDS = {"mode", "policy", "prefill_policy", "decode_policy", "fallback_policy"}
_TAGS = set(POLICY_TYPES) | set(MODE_TYPES)


def _path(loc: tuple) -> str:
    out = ""
    prev: Any = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif prev in _UNION_FIELDS and part in _TAGS:
            pass  # the union member pydantic entered, not a key
        else:
            out += f".{part}" if out else str(part)
        prev = part
    return out or "(top level)"


def _message(err: Mapping[str, Any]) -> str:
    kind, msg, ctx = err["type"], err["msg"], err.get("ctx") or {}
    if kind == "union_tag_invalid":
        allowed = ctx.get("expected_tags", "").replace("'", "")
        return f"unknown type {ctx.get('tag')!r}; allowed: {allowed}"
    if kind == "union_tag_not_found":
        return "missing 'type'"
    if kind == "missing":
        return "required key is missing"
    if kind == "extra_forbidden":
        allowed = getattr(err.get("input"), "allowed", None)
        key = err["loc"][-1] if err.get("loc") else "?"
        return f"unknown key {key!r}" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    if msg.startswith("Value error, "):
        return msg[len("Value error, "):]
    value = err.get("input")
    if isinstance(value, list):
        msg += " (got a list)"
    elif not isinstance(value, Mapping):
        msg += f" (got {value!r})"
    return msg


def _format(e: ValidationError, source: str) -> ConfigError:
    problems: List[tuple] = []
    unknown: Dict[str, tuple] = {}  # the unknown keys of one mapping make one problem
    for err in e.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden" and loc:
            where = _path(loc[:-1])
            if where not in unknown:
                unknown[where] = ([], getattr(err.get("input"), "allowed", None))
                problems.append((where, None))
            unknown[where][0].append(loc[-1])
        else:
            problems.append((_path(loc), _message(err)))
    for i, (where, msg) in enumerate(problems):
        if msg is None:
            keys, allowed = unknown[where]
            what = ", ".join(repr(k) for k in keys)
            msg = f"unknown key{'s' if len(keys) > 1 else ''} {what}"
            problems[i] = (where, msg + (f"; allowed: {', '.join(allowed)}" if allowed else ""))
    lines = "\n".join(f"  {p}: {m}" for p, m in problems)
    return ConfigError(f"invalid kvroute config{source}:\n{lines}", problems)


def load_config(source: Union[str, Path, Mapping[str, Any], RouterConfig]) -> RouterConfig:
    """Reads and validates a configuration.

    Parameters
    ----------
    source:
        Path of a YAML file (``str`` or `Path`), or the configuration as a mapping (e.g. from
        JSON), or an already built `RouterConfig` (returned as is).

    Raises
    ------
    ConfigError
        (a ValueError) naming every bad key with what is allowed, or a YAML syntax error.
    FileNotFoundError
        No such file.
    """
    if isinstance(source, RouterConfig):
        return source
    where = ""
    if isinstance(source, (str, Path)):
        path = Path(source)
        where = f" ({path})"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"kvroute config file not found: {path}") from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        except ConfigError as e:
            raise ConfigError(f"invalid kvroute config{where}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"invalid kvroute config{where}: not valid YAML: {e}") from None
    elif isinstance(source, Mapping):
        data = source
    else:
        raise TypeError(f"load_config takes a YAML path or a mapping, got {type(source).__name__}")
    if data is None:
        raise ConfigError(f"invalid kvroute config{where}: it is empty (mode is required)")
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid kvroute config{where}: the top level must be a mapping, "
                          f"got {type(data).__name__}")
    data = dict(data)
    foreign = [k for k in data if k in VLLM_ROUTER_KEYS_NOT_HONOURED]
    foreign_problem = (
        "(top level)",
        f"vLLM router key{'s' if len(foreign) > 1 else ''} kvroute cannot honour: "
        f"{', '.join(foreign)} (remove them; see kvroute.config.VLLM_ROUTER_KEYS_NOT_HONOURED)")
    for k in foreign:
        del data[k]
    try:
        cfg = RouterConfig.model_validate(data)
    except ValidationError as e:
        err = _format(e, where)
        if not foreign:
            raise err from None
        problems = [foreign_problem, *err.problems]
    else:
        if not foreign:
            return cfg
        problems = [foreign_problem]
    lines = "\n".join(f"  {p}: {m}" for p, m in problems)
    raise ConfigError(f"invalid kvroute config{where}:\n{lines}", problems)


def router_from_config(source: Union[str, Path, Mapping[str, Any], RouterConfig]) -> Router:
    """A `kvroute.Router` built from a configuration (regular mode).

    A ``pd_disaggregation`` config needs one router per pool: ``cfg = load_config(...)``,
    then ``Router(cfg.prefill_workers(), **cfg.prefill_router_kwargs())`` and
    ``Router(cfg.decode_workers(), **cfg.decode_router_kwargs())``.
    """
    cfg = load_config(source)
    if cfg.is_pd:
        raise ConfigError(
            "router_from_config builds one router, but this config is pd_disaggregation "
            "(two pools): load it with load_config() and build Router(cfg.prefill_workers(), "
            "**cfg.prefill_router_kwargs()) and Router(cfg.decode_workers(), "
            "**cfg.decode_router_kwargs())")
    return Router(cfg.workers(), **cfg.router_kwargs())
