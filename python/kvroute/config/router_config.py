"""`RouterConfig`: the whole file, and what it gives a Router (``workers()``,
``router_kwargs()``, the prefill / decode pools).
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Mapping, Optional
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from kvroute import policies as P
from kvroute._worker import Worker
from kvroute.config._base import _DEFAULTS, ConfigError, NonNegFloat, PosInt, _Model, _seconds
from kvroute.config.events import KvEventsConfig, LimitsConfig
from kvroute.config.policy import (
    _POLICY_MODELS,
    LmcacheAwarePolicy,
    Policy,
    _as_policy_dict,
    _pool_kwargs,
    _PoolIndexKeys,
)
from kvroute.config.serving import (
    AdaptiveCacheWeightConfig,
    HealthCheckConfig,
    MetricsServerConfig,
    ReplicasConfig,
    ResponseCacheConfig,
    RetryConfig,
    ServingConfig,
    VllmRetryConfig,
)
from kvroute.config.tenants import AdminConfig, TenantConfig
from kvroute.config.workers import Mode, PdMode, RegularMode, WorkerConfig

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
