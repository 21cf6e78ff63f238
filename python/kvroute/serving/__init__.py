"""Building blocks for serving kvroute in front of OpenAI-compatible engines (vLLM, SGLang).

* The request pipeline every front runs: `kvroute.serving.pipeline` (stages and the `Front`
  contract), `kvroute.serving.app` (the one route table), `kvroute.serving.build` (the mode
  switch), the fronts `kvroute.serving.proxy` (one pool) and `kvroute.serving.pd`
  (prefill/decode), and their stages `request`, `breaker`, `forward`, `relay`, `common`.
* `PromptTokenizer` (re-exported from `kvroute.prompt`): request bodies to the token ids the
  engine will prefill.
* `kvroute.serving.load` — engine-reported load: vLLM's ORCA response header
  (`parse_orca_header`, `apply_orca`) and a Prometheus `/metrics` scraper
  (`PrometheusScraper`) feeding `Router.update_load`, with bounded staleness.
* `kvroute.serving.metrics` — `RouterMetrics`: kvroute's own Prometheus metrics (decisions,
  match ratio, select latency, upstream outcomes, and the router's counters at scrape time).
* `kvroute.serving.auth` — `Auth`, `Tenant`, `TokenBucket`: tenants' API keys (SHA-256),
  rate and concurrency limits, allowed models, the admin key.
* `kvroute.serving.admin` — `DecisionLog` (``GET /admin/decisions``) and run-time worker
  changes and config reload.
* `kvroute.serving.response_cache` — `ResponseCache` (in memory), `RedisResponseCache`
  (shared), `SemanticIndex` (similar prompts through an embeddings endpoint).
* `kvroute.serving.health` — `HealthChecker` (active health checks), `RecoveryRamp`.
* `kvroute.serving.retry` — `RetryPolicy`: what is retried, exponential backoff with jitter.
* `kvroute.serving.limits` — `RequestLimits`: body bytes, prompt characters and tokens.
* `kvroute.serving.routes` — pass-through routes, request ids, access logs, error shapes.

Names are re-exported lazily, so importing one module (e.g. the tokenizer, used by the
replay traces) does not import the others' dependencies (httpx, prometheus-client).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "Auth",
    "DecisionLog",
    "HealthChecker",
    "PrefixCache",
    "RecoveryRamp",
    "RequestLimits",
    "RetryPolicy",
    "RedisResponseCache",
    "ResponseCache",
    "SemanticIndex",
    "Tenant",
    "TokenBucket",
    "ORCA_REQUEST_HEADER",
    "ORCA_RESPONSE_HEADER",
    "PrometheusScraper",
    "PromptTokenizer",
    "RouterMetrics",
    "UnsupportedPrompt",
    "apply_orca",
    "orca_request_headers",
    "parse_orca_header",
]

_HOME = {
    "HealthChecker": "health",
    "RecoveryRamp": "health",
    "RequestLimits": "limits",
    "RetryPolicy": "retry",
    "PrefixCache": "kvroute.prompt",
    "PromptTokenizer": "kvroute.prompt",
    "UnsupportedPrompt": "kvroute.prompt",
    "ORCA_REQUEST_HEADER": "load",
    "ORCA_RESPONSE_HEADER": "load",
    "PrometheusScraper": "load",
    "apply_orca": "load",
    "orca_request_headers": "load",
    "parse_orca_header": "load",
    "RouterMetrics": "metrics",
    "Auth": "auth",
    "Tenant": "auth",
    "TokenBucket": "auth",
    "DecisionLog": "admin",
    "ResponseCache": "response_cache",
    "RedisResponseCache": "response_cache",
    "SemanticIndex": "response_cache",
}

if TYPE_CHECKING:
    from kvroute.prompt import PrefixCache, PromptTokenizer, UnsupportedPrompt
    from kvroute.serving.admin import DecisionLog
    from kvroute.serving.auth import Auth, Tenant, TokenBucket
    from kvroute.serving.health import HealthChecker, RecoveryRamp
    from kvroute.serving.limits import RequestLimits
    from kvroute.serving.load import (
        ORCA_REQUEST_HEADER,
        ORCA_RESPONSE_HEADER,
        PrometheusScraper,
        apply_orca,
        orca_request_headers,
        parse_orca_header,
    )
    from kvroute.serving.metrics import RouterMetrics
    from kvroute.serving.response_cache import (
        RedisResponseCache,
        ResponseCache,
        SemanticIndex,
    )
    from kvroute.serving.retry import RetryPolicy


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'kvroute.serving' has no attribute {name!r}")
    home = module if "." in module else f"kvroute.serving.{module}"
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
