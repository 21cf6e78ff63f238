"""Every default of ``kvroute serve``, written once.

Plain constants, importable without pydantic or the serving extra's packages. They are the
defaults of `kvroute.config.ServingConfig` and its sections (`RetryConfig`,
`CircuitBreakerConfig`, `ScrapeMetricsConfig`, `HealthCheckConfig`), the keyword defaults of
the classes that run them (`kvroute.serving.proxy.Proxy`, `kvroute.serving.pd.PDFront`,
`kvroute.serving.limits.RequestLimits`, `kvroute.serving.retry.RetryPolicy`,
`kvroute.serving.breaker.CircuitBreaker`, `kvroute.serving.load.PrometheusScraper`,
`kvroute.serving.health.HealthChecker` / `RecoveryRamp`, `kvroute.serving.admin.DecisionLog`,
`kvroute.serving.routes`), and the ``(default ...)`` of ``kvroute serve --help``
(`kvroute.serving.cli_options.SERVE_FLAGS`). The tokenizer's own defaults live in
`kvroute.prompt.tokenizer` (which imports nothing of `kvroute.serving`) and are re-exported
here. tests/test_serve_options.py checks that every one of these places agrees.
"""

from __future__ import annotations

from typing import Final, Tuple

from kvroute.prompt.tokenizer import (
    LONG_MAX_QUEUED,
    LONG_PROMPT_CHARS,
    MAX_QUEUED,
    PREFIX_CACHE_TOKENS,
)

__all__ = [
    "ACCESS_LOG", "ACCESS_LOG_BODIES", "ACCESS_LOG_FILE", "BREAKER_FAILURES",
    "BREAKER_RESET_S", "CHARS_PER_TOKEN", "CONNECT_TIMEOUT_S", "DECISION_LOG_SIZE",
    "FIRST_BYTE_TIMEOUT_S", "GC_FREEZE", "GC_THRESHOLD", "HEALTH_CHECK_INTERVAL_S",
    "HEALTH_ENDPOINT", "HEALTH_FAILURE_THRESHOLD", "HEALTH_SUCCESS_THRESHOLD",
    "HEALTH_TIMEOUT_S", "HOST", "LOG_LEVEL", "LONG_MAX_QUEUED", "LONG_PROMPT_CHARS",
    "MAX_BODY_BYTES", "MAX_PROMPT_TOKENS", "MAX_QUEUED", "MAX_RETRIES", "MAX_RETRIES_LIMIT",
    "ORCA", "PORT", "PREFIX_CACHE_TOKENS", "RECOVERY_MIN_SHARE", "RECOVERY_RAMP_S",
    "REQUEST_ID_HEADER", "REQUEST_ID_HEADERS", "RETRY_BACKOFF_MULTIPLIER",
    "RETRY_INITIAL_BACKOFF_MS", "RETRY_JITTER_FACTOR", "RETRY_MAX_BACKOFF_MS", "RETRY_ON",
    "SCRAPE_INTERVAL_S", "SCRAPE_STALE_AFTER_S", "SCRAPE_TIMEOUT_S", "UPSTREAM_TIMEOUT_S",
]

# -- the server (the vLLM router's host, port, log_level keys) ---------------------------------
HOST: Final = "127.0.0.1"
PORT: Final = 8080
LOG_LEVEL: Final = "info"

# -- forwarding (serving.*; Proxy, PDFront) -----------------------------------------------------
#: Seconds of silence allowed from a worker (read / write timeout).
UPSTREAM_TIMEOUT_S: Final = 600.0
#: TCP connect timeout, seconds.
CONNECT_TIMEOUT_S: Final = 5.0
#: Seconds one attempt waits for the response headers; None: only the upstream timeout.
FIRST_BYTE_TIMEOUT_S: Final = None
#: Further workers tried after a failure before any byte reached the client.
MAX_RETRIES: Final = 2
#: The most ``serving.max_retries`` accepts.
MAX_RETRIES_LIMIT: Final = 16
#: vLLM's ORCA load report asked for, in the config's spelling (``text``, ``json``, ``off``).
ORCA: Final = "text"
#: Routing decisions kept for ``GET /admin/decisions``.
DECISION_LOG_SIZE: Final = 1024

# -- retry backoff (serving.retry; RetryPolicy; the vLLM router's defaults) ---------------------
RETRY_INITIAL_BACKOFF_MS: Final = 50.0
RETRY_MAX_BACKOFF_MS: Final = 30_000.0
RETRY_BACKOFF_MULTIPLIER: Final = 1.5
RETRY_JITTER_FACTOR: Final = 0.2
#: Failure kinds retried (every kind there is).
RETRY_ON: Final[Tuple[str, ...]] = ("connect", "timeout", "5xx", "429")

# -- circuit breaker (serving.circuit_breaker; CircuitBreaker) ---------------------------------
BREAKER_FAILURES: Final = 3
BREAKER_RESET_S: Final = 10.0

# -- recovery ramp (serving.recovery_ramp_s; RecoveryRamp) -------------------------------------
RECOVERY_RAMP_S: Final = 10.0
#: The share of its requests a worker gets right at recovery (not a config key).
RECOVERY_MIN_SHARE: Final = 0.1

# -- load scraping (serving.scrape_metrics, off by default; PrometheusScraper) -----------------
SCRAPE_INTERVAL_S: Final = 1.0
SCRAPE_TIMEOUT_S: Final = 0.5
SCRAPE_STALE_AFTER_S: Final = 5.0

# -- active health checks (health_check, off by default; HealthChecker; the vLLM router's) -----
HEALTH_FAILURE_THRESHOLD: Final = 3
HEALTH_SUCCESS_THRESHOLD: Final = 2
HEALTH_TIMEOUT_S: Final = 5.0
HEALTH_CHECK_INTERVAL_S: Final = 60.0
HEALTH_ENDPOINT: Final = "/health"

# -- request limits (serving.max_body_bytes ...; RequestLimits) --------------------------------
MAX_BODY_BYTES: Final = 32 << 20
#: ``auto``: the workers' ``max_model_len``.
MAX_PROMPT_TOKENS: Final = "auto"
CHARS_PER_TOKEN: Final = 16.0

# -- request ids and the access log (serving.request_id_headers, access_log*) -----------------
#: The header a request's id is read from and answered in.
REQUEST_ID_HEADER: Final = "x-request-id"
REQUEST_ID_HEADERS: Final[Tuple[str, ...]] = (REQUEST_ID_HEADER,)
ACCESS_LOG: Final = True
ACCESS_LOG_BODIES: Final = False
#: None: the access lines go to stderr; a path: appended there.
ACCESS_LOG_FILE: Final = None

# -- the serving process's garbage collector (serving.gc_threshold, gc_freeze) ----------------
GC_THRESHOLD: Final[Tuple[int, int, int]] = (50_000, 20, 100)
GC_FREEZE: Final = True
