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

Modules (each name is importable from `kvroute.config` as well):

- `kvroute.config.loader`: `load_config`, `VLLM_ROUTER_KEYS_NOT_HONOURED`.
- `kvroute.config.router_config`: `RouterConfig` (the whole file), ``LOG_LEVELS``.
- `kvroute.config.workers`: `WorkerConfig`, the modes (`RegularMode`, `PdMode`, ``MODE_TYPES``).
- `kvroute.config.policy`: one model per policy type (``POLICY_TYPES``, ``FALLBACK_POLICY_TYPES``).
- `kvroute.config.events`: `KvEventsConfig`, `LimitsConfig`.
- `kvroute.config.serving`: `ServingConfig` and the other ``kvroute serve`` sections.
- `kvroute.config.tenants`: `TenantConfig`, `AdminConfig`.
- `kvroute.config._base`: `ConfigError`, the base model and field types.
- `kvroute.config.build`: `router_from_config`, the one module here that imports
  `kvroute.Router` (`Router.from_config` imports `kvroute.config.loader`, so the router and
  the config models depend one way only).
"""

from __future__ import annotations

from kvroute.config._base import (
    ConfigError,
    NonNegFloat,
    PosFloat,
    PosInt,
)
from kvroute.config.build import (
    router_from_config,
)
from kvroute.config.events import (
    KvEventsConfig,
    LimitsConfig,
)
from kvroute.config.loader import (
    VLLM_ROUTER_KEYS_NOT_HONOURED,
    load_config,
)
from kvroute.config.policy import (
    FALLBACK_POLICY_TYPES,
    POLICY_TYPES,
    CacheAwarePolicy,
    ConsistentHashPolicy,
    CostPolicy,
    KvAwarePolicy,
    LeastLoadPolicy,
    LmcacheAwarePolicy,
    Policy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RendezvousHashPolicy,
    RoundRobinPolicy,
)
from kvroute.config.router_config import (
    LOG_LEVELS,
    RouterConfig,
)
from kvroute.config.serving import (
    AdaptiveCacheWeightConfig,
    CircuitBreakerConfig,
    HealthCheckConfig,
    MetricsServerConfig,
    ReplicasConfig,
    ResponseCacheConfig,
    RetryConfig,
    RetryKind,
    ScrapeMetricsConfig,
    SemanticCacheConfig,
    ServingConfig,
    VllmRetryConfig,
)
from kvroute.config.tenants import (
    AdminConfig,
    Sha256Hex,
    TenantConfig,
)
from kvroute.config.workers import (
    MODE_TYPES,
    Mode,
    ModeKvEventsConfig,
    PdMode,
    RegularMode,
    WorkerConfig,
)

# Every public name the single config.py module had.
__all__ = [
    "AdaptiveCacheWeightConfig",
    "AdminConfig",
    "CacheAwarePolicy",
    "CircuitBreakerConfig",
    "ConfigError",
    "ConsistentHashPolicy",
    "CostPolicy",
    "FALLBACK_POLICY_TYPES",
    "HealthCheckConfig",
    "KvAwarePolicy",
    "KvEventsConfig",
    "LOG_LEVELS",
    "LeastLoadPolicy",
    "LimitsConfig",
    "LmcacheAwarePolicy",
    "MODE_TYPES",
    "MetricsServerConfig",
    "Mode",
    "ModeKvEventsConfig",
    "NonNegFloat",
    "POLICY_TYPES",
    "PdMode",
    "Policy",
    "PosFloat",
    "PosInt",
    "PowerOfTwoPolicy",
    "RandomPolicy",
    "RegularMode",
    "RendezvousHashPolicy",
    "ReplicasConfig",
    "ResponseCacheConfig",
    "RetryConfig",
    "RetryKind",
    "RoundRobinPolicy",
    "RouterConfig",
    "ScrapeMetricsConfig",
    "SemanticCacheConfig",
    "ServingConfig",
    "Sha256Hex",
    "TenantConfig",
    "VLLM_ROUTER_KEYS_NOT_HONOURED",
    "VllmRetryConfig",
    "WorkerConfig",
    "load_config",
    "router_from_config",
]
