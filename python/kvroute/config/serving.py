"""The HTTP front of ``kvroute serve``: `ServingConfig` (timeouts, retries, circuit breaker,
request limits, the tokenizer's lanes and prefix cache, access log, garbage collector), the
vLLM router's ``retry``, ``metrics`` and ``health_check`` sections, ``response_cache``,
``replicas`` and ``adaptive_cache_weight``.
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import (
    AliasChoices,
    Field,
    field_validator,
    model_validator,
)

from kvroute.config._base import NonNegFloat, PosFloat, PosInt, _Model, _seconds
from kvroute.serving import defaults as D


class CircuitBreakerConfig(_Model):
    """Per-worker circuit breaker of ``kvroute serve``: open after ``failures`` consecutive
    upstream failures, let requests through again (ramped up) after ``reset_s`` seconds (also
    accepted as ``reset_secs``)."""

    failures: PosInt = D.BREAKER_FAILURES
    reset_s: PosFloat = _seconds("reset", D.BREAKER_RESET_S)


class ScrapeMetricsConfig(_Model):
    """Prometheus scrape of every worker's ``/metrics`` (vLLM ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc``) every ``interval_s`` seconds with a ``timeout_s`` bound;
    load older than ``stale_after_s`` is forgotten (each also accepted as ``*_secs``)."""

    interval_s: PosFloat = _seconds("interval", D.SCRAPE_INTERVAL_S)
    timeout_s: PosFloat = _seconds("timeout", D.SCRAPE_TIMEOUT_S)
    stale_after_s: PosFloat = _seconds("stale_after", D.SCRAPE_STALE_AFTER_S)


RetryKind = Literal["connect", "timeout", "5xx", "429"]
_RETRY_KINDS: List[RetryKind] = list(D.RETRY_ON)  # type: ignore[arg-type]


class RetryConfig(_Model):
    """Backoff between retries and what is retried (`kvroute.serving.retry.RetryPolicy`;
    the vLLM router's ``retry`` section without ``max_retries``, which is
    ``serving.max_retries``). Defaults are the vLLM router's."""

    initial_backoff_ms: NonNegFloat = D.RETRY_INITIAL_BACKOFF_MS
    max_backoff_ms: NonNegFloat = D.RETRY_MAX_BACKOFF_MS
    backoff_multiplier: Annotated[float, Field(ge=1, allow_inf_nan=False)] = (
        D.RETRY_BACKOFF_MULTIPLIER)
    jitter_factor: Annotated[float, Field(ge=0, le=1)] = D.RETRY_JITTER_FACTOR
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
    initial_backoff_ms: NonNegFloat = D.RETRY_INITIAL_BACKOFF_MS
    max_backoff_ms: NonNegFloat = D.RETRY_MAX_BACKOFF_MS
    backoff_multiplier: Annotated[float, Field(ge=1, allow_inf_nan=False)] = (
        D.RETRY_BACKOFF_MULTIPLIER)
    jitter_factor: Annotated[float, Field(ge=0, le=1)] = D.RETRY_JITTER_FACTOR


class ServingConfig(_Model):
    """The HTTP front of ``kvroute serve`` / `kvroute.fastapi.create_app` (the Router itself
    ignores it). Command-line flags and keyword arguments override these."""

    model: Optional[str] = Field(None, description="The engines' served model name.")
    tokenizer: Optional[str] = Field(
        None, description="Directory with the model's tokenizer.json and tokenizer_config.json.")
    upstream_timeout_s: PosFloat = _seconds("upstream_timeout", D.UPSTREAM_TIMEOUT_S)
    connect_timeout_s: PosFloat = _seconds("connect_timeout", D.CONNECT_TIMEOUT_S)
    max_retries: Annotated[int, Field(ge=0, le=D.MAX_RETRIES_LIMIT)] = D.MAX_RETRIES
    circuit_breaker: CircuitBreakerConfig = Field(default_factory=CircuitBreakerConfig)
    scrape_metrics: Optional[ScrapeMetricsConfig] = None
    orca: Literal["text", "json", "off"] = D.ORCA
    first_byte_timeout_s: Optional[PosFloat] = Field(
        D.FIRST_BYTE_TIMEOUT_S,
        validation_alias=AliasChoices("first_byte_timeout_s", "first_byte_timeout_secs"))
    retry: RetryConfig = Field(default_factory=RetryConfig)
    recovery_ramp_s: NonNegFloat = _seconds("recovery_ramp", D.RECOVERY_RAMP_S)
    max_body_bytes: Optional[PosInt] = D.MAX_BODY_BYTES
    max_prompt_tokens: Union[PosInt, Literal["auto"], None] = D.MAX_PROMPT_TOKENS
    chars_per_token: PosFloat = D.CHARS_PER_TOKEN
    tokenizer_threads: Optional[PosInt] = None
    long_prompt_chars: Optional[PosInt] = D.LONG_PROMPT_CHARS
    long_prompt_threads: Optional[PosInt] = None
    tokenizer_max_queued: Optional[Annotated[int, Field(ge=0)]] = None
    prefix_cache_tokens: Annotated[int, Field(ge=0)] = D.PREFIX_CACHE_TOKENS
    request_id_headers: List[str] = Field(default_factory=lambda: list(D.REQUEST_ID_HEADERS),
                                          min_length=1)
    access_log: bool = D.ACCESS_LOG
    access_log_bodies: bool = D.ACCESS_LOG_BODIES  # also log completion bodies (a trace's source)
    # Where the access lines go: None, stderr; a path, appended there (kvroute.serving.logs).
    access_log_file: Optional[str] = Field(D.ACCESS_LOG_FILE, min_length=1)
    # kvroute serve's process: the garbage collector's thresholds (gc.set_threshold; null:
    # CPython's 700, 10, 10) and a gc.freeze() of the heap built before serving.
    gc_threshold: Optional[Annotated[List[PosInt], Field(min_length=3, max_length=3)]] = (
        Field(default_factory=lambda: list(D.GC_THRESHOLD)))
    gc_freeze: bool = D.GC_FREEZE

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
            "scrape_timeout_s": sm.timeout_s if sm is not None else D.SCRAPE_TIMEOUT_S,
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

    failure_threshold: PosInt = D.HEALTH_FAILURE_THRESHOLD
    success_threshold: PosInt = D.HEALTH_SUCCESS_THRESHOLD
    timeout_s: PosFloat = _seconds("timeout", D.HEALTH_TIMEOUT_S)
    check_interval_s: PosFloat = _seconds("check_interval", D.HEALTH_CHECK_INTERVAL_S)
    endpoint: str = Field(D.HEALTH_ENDPOINT, min_length=1)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"endpoint must be a path starting with '/', got {v!r}")
        return v



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
