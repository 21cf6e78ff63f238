"""Opt-in online tuning of ``cache_weight`` from what the engines delivered and how the
workers' queues look.

`AdaptiveCacheWeight` attaches to a `kvroute.Router` and, every ``interval`` requests reported
with `kvroute.Router.report_delivered`, moves the router's ``cache_weight`` by one ``step``
within ``[min_weight, max_weight]``, or leaves it:

* **down** when the queues are uneven: the hottest worker's pending prefill tokens beyond the
  fleet mean (the router's own accounting, sampled every ``sample_every`` reports, averaged
  over the interval), in units of the interval's mean prompt, exceeds ``imbalance_tol``:
  prefix affinity is piling work on a few workers;
* **down** when the engines reused less than the router expected: ``sum(captured -
  delivered) / sum(prompt)`` over the interval exceeds ``gap_tol`` (affinity bought nothing);
* **up** when reuse was left on the table: ``sum(available - captured) / sum(prompt)``
  exceeds ``miss_tol`` (some worker held a longer prefix than the one chosen);
* otherwise unchanged.

Every change is logged (logger ``kvroute.adaptive``, INFO) with the signals that caused it and
kept in `history`. The controller needs no load figure: it reads only prompt-token counts and
the router's queue accounting.

Thread-safety: `observe` may be called from any thread (one lock); it is called by the
router's `kvroute.delivered.HitRateTracker` after each report.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

__all__ = ["AdaptiveCacheWeight", "Adjustment"]

log = logging.getLogger("kvroute.adaptive")


@dataclass(frozen=True)
class Adjustment:
    """One interval's decision: ``reports`` (the reports seen so far), the signals, the
    weight before and after, and ``why`` (``"imbalance"``, ``"gap"``, ``"missed"`` or
    ``"hold"``)."""

    reports: int
    imbalance: float
    missed: float
    gap: float
    before: float
    after: float
    why: str


class AdaptiveCacheWeight:
    """Tunes ``router.cache_weight`` online (see the module docstring).

    Parameters
    ----------
    router:
        The `kvroute.Router` (a policy with a ``cache_weight``: ``kv_aware``,
        ``lmcache_aware``); its current weight is the start.
    min_weight, max_weight:
        Bounds, ``0 <= min_weight <= max_weight <= 1``.
    step:
        Change per interval, ``(0, 1]``.
    interval:
        Reports per decision.
    imbalance_tol, miss_tol, gap_tol:
        Thresholds of the three signals (excess pending prefill of the hottest worker in mean
        prompts; shares of prompt tokens).
    sample_every:
        Read the router's queues every this many reports.

    Raises
    ------
    ValueError
        Bounds, step or thresholds out of range.
    """

    def __init__(self, router: Any, *, min_weight: float = 0.3, max_weight: float = 0.95,
                 step: float = 0.05, interval: int = 100, imbalance_tol: float = 6.0,
                 miss_tol: float = 0.005, gap_tol: float = 0.05, sample_every: int = 8) -> None:
        if not 0.0 <= min_weight <= max_weight <= 1.0:
            raise ValueError(f"need 0 <= min_weight <= max_weight <= 1, got {min_weight}, "
                             f"{max_weight}")
        if not 0.0 < step <= 1.0 or interval < 1 or sample_every < 1:
            raise ValueError(f"need 0 < step <= 1, interval >= 1, sample_every >= 1; got "
                             f"{step}, {interval}, {sample_every}")
        if imbalance_tol <= 0 or miss_tol < 0 or gap_tol < 0:
            raise ValueError("imbalance_tol must be > 0, miss_tol and gap_tol >= 0")
        self.router = router
        self.min_weight, self.max_weight = float(min_weight), float(max_weight)
        self.step, self.interval = float(step), int(interval)
        self.imbalance_tol, self.miss_tol, self.gap_tol = imbalance_tol, miss_tol, gap_tol
        self.sample_every = int(sample_every)
        self.history: List[Adjustment] = []
        self._lock = threading.Lock()
        self._reset()
        self.reports = 0
        w = float(router.cache_weight)
        self.weight = min(max(w, self.min_weight), self.max_weight)
        if self.weight != w:
            router.cache_weight = self.weight
        router.hit_rate.listeners.append(self.observe)

    def _reset(self) -> None:
        self._n = 0
        self._prompt = self._available = self._captured = self._delivered = 0
        self._imb_sum = 0.0
        self._imb_n = 0

    def detach(self) -> None:
        """Stops tuning (the weight stays where it is). Idempotent."""
        try:
            self.router.hit_rate.listeners.remove(self.observe)
        except ValueError:
            pass

    def observe(self, report: Any) -> Optional[Adjustment]:
        """One `kvroute.delivered.DeliveredReport` (only counted ones, with a delivered
        count); returns the interval's `Adjustment` when this report closed one."""
        if report.delivered_tokens is None:
            return None
        with self._lock:
            self.reports += 1
            self._n += 1
            self._prompt += report.prompt_tokens
            self._available += report.available_tokens
            self._captured += report.captured_tokens
            self._delivered += report.delivered_tokens
            sample = self._n % self.sample_every == 0
        if sample:
            imb = self._imbalance()
            if imb is not None:
                with self._lock:
                    self._imb_sum += imb
                    self._imb_n += 1
        with self._lock:
            if self._n < self.interval:
                return None
            prompt = max(self._prompt, 1)
            missed = (self._available - self._captured) / prompt
            gap = (self._captured - self._delivered) / prompt
            # the hottest worker's pending prefill beyond the fleet mean, in mean prompts
            mean_prompt = self._prompt / self._n
            imbalance = (self._imb_sum / self._imb_n / mean_prompt
                         if self._imb_n and mean_prompt > 0 else 0.0)
            before = self.weight
            if imbalance > self.imbalance_tol:
                why, after = "imbalance", before - self.step
            elif gap > self.gap_tol:
                why, after = "gap", before - self.step
            elif missed > self.miss_tol:
                why, after = "missed", before + self.step
            else:
                why, after = "hold", before
            after = round(min(max(after, self.min_weight), self.max_weight), 6)
            self.weight = after
            adj = Adjustment(self.reports, imbalance, missed, gap, before, after, why)
            self.history.append(adj)
            self._reset()
        log.debug("interval: excess queue %.2f prompts, missed %.3f, gap %.3f -> %s",
                  imbalance, missed, gap, why)
        if after != before:
            self.router.cache_weight = after
            log.info("cache_weight %.3f -> %.3f (%s: excess queue %.2f mean prompts, missed "
                     "%.3f, gap %.3f of prompt tokens over %d requests)", before, after, why,
                     imbalance, missed, gap, self.interval)
        return adj

    def _imbalance(self) -> Optional[float]:
        try:
            ws = self.router.stats()["workers"].values()
        except Exception:  # noqa: BLE001 - a closed router: no sample
            return None
        q = [float(w.get("pending_prefill_tokens") or 0) for w in ws]
        return max(q) - sum(q) / len(q) if q else 0.0
