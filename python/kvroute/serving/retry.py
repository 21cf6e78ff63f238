"""When a failed upstream attempt is tried again, and how long to wait first.

`RetryPolicy` carries the vLLM router's ``retry`` section (vllm-project/router
``src/config/types.rs`` ``RetryConfig``: ``max_retries``, ``initial_backoff_ms``,
``max_backoff_ms``, ``backoff_multiplier``, ``jitter_factor``; the same keys as SGLang's
gateway) plus which failures are retried (``retry_on``). The proxy asks it after every failed
attempt whose failure happened **before any byte reached the client**; once a byte of the
answer was relayed, nothing is retried.

Backoff before retry ``n`` (1-based): ``min(max_backoff, initial_backoff *
backoff_multiplier ** (n - 1))`` scaled by ``1 + U[-jitter_factor, +jitter_factor]`` (the vLLM
router's ``D' = D * (1 + U[-j, +j])``), so concurrent retries after one engine failure do not
arrive at the same instant.
"""

from __future__ import annotations

import random
from typing import Any, Callable, FrozenSet, Iterable, Mapping, Optional

from kvroute.serving import defaults as D

__all__ = ["RETRY_ON", "RetryPolicy"]

#: Failure kinds a `RetryPolicy` may retry: ``connect`` (connect error or timeout, a refused or
#: reset connection before the response headers, a malformed worker URL), ``timeout`` (no
#: response within ``first_byte_timeout_s``, or the worker taken out by its health check while
#: the request waited), ``5xx`` (500, 502, 503, 504 answered by the engine), ``429``.
RETRY_ON: FrozenSet[str] = frozenset(D.RETRY_ON)

# The 5xx statuses that say "this engine cannot serve now" (not 501 / 505: the request itself).
_RETRY_5XX = frozenset({500, 502, 503, 504})


class RetryPolicy:
    """Which failures are retried on another worker, and the backoff before each retry.

    Parameters
    ----------
    max_retries:
        Further attempts after the first, >= 0 (at most ``1 + max_retries`` attempts).
    initial_backoff_ms, max_backoff_ms:
        Delay before the first retry and the cap on any delay, milliseconds >= 0.
    backoff_multiplier:
        Growth of the delay per retry, >= 1.
    jitter_factor:
        Relative jitter in [0, 1].
    retry_on:
        Failure kinds to retry, a subset of `RETRY_ON`. Default: all of them.
    rng:
        ``() -> float`` uniform in [0, 1) (tests pass their own); default `random.random`.

    Raises
    ------
    ValueError
        A value out of its range or an unknown failure kind.
    """

    def __init__(self, max_retries: int = D.MAX_RETRIES, *,
                 initial_backoff_ms: float = D.RETRY_INITIAL_BACKOFF_MS,
                 max_backoff_ms: float = D.RETRY_MAX_BACKOFF_MS,
                 backoff_multiplier: float = D.RETRY_BACKOFF_MULTIPLIER,
                 jitter_factor: float = D.RETRY_JITTER_FACTOR,
                 retry_on: Optional[Iterable[str]] = None,
                 rng: Callable[[], float] = random.random) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        for name, v, lo in (("initial_backoff_ms", initial_backoff_ms, 0.0),
                            ("max_backoff_ms", max_backoff_ms, 0.0),
                            ("backoff_multiplier", backoff_multiplier, 1.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo:
                raise ValueError(f"retry {name} must be a number >= {lo:g}, got {v!r}")
        if (isinstance(jitter_factor, bool) or not isinstance(jitter_factor, (int, float))
                or not 0.0 <= jitter_factor <= 1.0):
            raise ValueError(f"retry jitter_factor must be in [0, 1], got {jitter_factor!r}")
        kinds = RETRY_ON if retry_on is None else frozenset(retry_on)
        unknown = sorted(kinds - RETRY_ON)
        if unknown:
            raise ValueError(f"retry_on: unknown failure kind(s) {unknown}; allowed: "
                             f"{sorted(RETRY_ON)}")
        self.max_retries = max_retries
        self.initial_backoff_s = float(initial_backoff_ms) / 1000.0
        self.max_backoff_s = float(max_backoff_ms) / 1000.0
        self.backoff_multiplier = float(backoff_multiplier)
        self.jitter_factor = float(jitter_factor)
        self.retry_on = kinds
        self._rng = rng

    @classmethod
    def from_options(cls, options: Any, max_retries: int) -> RetryPolicy:
        """A policy from a `RetryPolicy`, a mapping of its keywords (``max_retries`` in it
        wins over the argument), or ``None`` (defaults with ``max_retries``)."""
        if isinstance(options, RetryPolicy):
            return options
        kw = dict(options) if isinstance(options, Mapping) else {}
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"retry must be a RetryPolicy or a mapping, got "
                             f"{type(options).__name__}")
        kw.setdefault("max_retries", max_retries)
        return cls(**kw)

    def status_kind(self, status: int) -> Optional[str]:
        """``"5xx"`` / ``"429"`` for an upstream status this policy may retry, else None."""
        if status == 429:
            return "429" if "429" in self.retry_on else None
        if status in _RETRY_5XX:
            return "5xx" if "5xx" in self.retry_on else None
        return None

    def retries(self, kind: str, attempts: int) -> bool:
        """True if a failure of ``kind`` after ``attempts`` attempts (>= 1) is retried."""
        return kind in self.retry_on and attempts <= self.max_retries

    def backoff_s(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based), jitter included."""
        base = min(self.max_backoff_s,
                   self.initial_backoff_s * self.backoff_multiplier ** max(0, retry - 1))
        j = self.jitter_factor
        return max(0.0, base * (1.0 + j * (2.0 * self._rng() - 1.0)))

    def as_dict(self) -> dict:
        """The settings, as the config spells them (milliseconds)."""
        return {"max_retries": self.max_retries,
                "initial_backoff_ms": self.initial_backoff_s * 1000.0,
                "max_backoff_ms": self.max_backoff_s * 1000.0,
                "backoff_multiplier": self.backoff_multiplier,
                "jitter_factor": self.jitter_factor, "retry_on": sorted(self.retry_on)}
