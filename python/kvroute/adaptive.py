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

With ``tune_ttl`` (the default) it also moves the router's ``speculative_ttl_s`` (how long a
speculative credit outlives its request's first token) by the factor ``ttl_factor`` within
``[min_ttl_s, max_ttl_s]``, at the same intervals, from two one-sided per-request sums over
the interval, each a share of its prompt tokens:

* ``over`` = sum of ``max(captured - delivered, 0)``: blocks the router counted on the chosen
  worker that the engine did not reuse. A credit that outlives the engine's real blocks is
  one source (the router keeps crediting a worker with blocks it never stored or already
  evicted), so when ``over`` exceeds ``ttl_over_tol`` and ``under`` does not exceed
  ``ttl_under_tol``, the TTL is **shortened** (divided by ``ttl_factor``);
* ``under`` = sum of ``max(delivered - captured, 0)``: blocks the engine reused that the
  router did not know of when it chose. With events flowing, that is a credit that expired
  before the engine's BlockStored arrived (events slower than the TTL), which also sends
  later turns away from their home; when ``under`` exceeds ``ttl_under_tol`` and ``over``
  does not exceed ``ttl_over_tol``, the TTL is **lengthened** (multiplied by
  ``ttl_factor``);
* both or neither: unchanged.

The rule cannot tell a stale credit from a block the engine evicted before the request ran
(both raise ``over``), nor an expired credit from lost events (both raise ``under``); the
bounds keep either mistake small: by default a quarter to four times the router's TTL at
attach time. A router with credits off (TTL 0) keeps them off.

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
    weight before and after, ``why`` (``"imbalance"``, ``"gap"``, ``"missed"`` or
    ``"hold"``), and the TTL's decision."""

    reports: int
    imbalance: float
    missed: float
    gap: float
    before: float
    after: float
    why: str
    #: speculative_ttl_s before and after (None without TTL tuning), ``ttl_why``:
    #: ``"stale"`` (shortened), ``"expired"`` (lengthened), ``"hold"`` or None; ``over`` /
    #: ``under``: the interval's one-sided sums, shares of prompt tokens.
    ttl_before: Optional[float] = None
    ttl_after: Optional[float] = None
    ttl_why: Optional[str] = None
    over: float = 0.0
    under: float = 0.0


class AdaptiveCacheWeight:
    """Tunes ``router.cache_weight`` online (see the module docstring).

    Parameters
    ----------
    router:
        The `kvroute.Router` (a policy with a ``cache_weight``: ``kv_aware``,
        ``lmcache_aware``); its current weight is the start.
    min_weight, max_weight:
        Bounds, ``0 <= min_weight <= max_weight <= 1``. The defaults, 0.4 and 0.85, come
        from the Mooncake replay (benchmarks/README.md, "Adaptive cache_weight"): at 0.3 the
        TTFT mean at 10x the trace's rate is 15 % above the best fixed weight (0.4: 4 %), at
        1.0 both loads collapse on some seeds (one worker's queue runs away), and the
        signals below do not separate the weights in between, so the controller settles
        wherever it enters that plateau; the bounds keep it from starting or drifting
        outside.
    step:
        Change per interval, ``(0, 1]``.
    interval:
        Reports per decision.
    imbalance_tol, miss_tol, gap_tol:
        Thresholds of the three signals (excess pending prefill of the hottest worker in mean
        prompts; shares of prompt tokens).
    sample_every:
        Read the router's queues every this many reports.
    tune_ttl:
        Also tune ``router.speculative_ttl_s`` (see the module docstring); ignored when the
        router has no such attribute or its TTL is 0.
    min_ttl_s, max_ttl_s:
        The TTL's bounds in seconds; None: a quarter of / four times the TTL at attach time.
    ttl_factor:
        The TTL's change per interval (> 1): divided or multiplied by it.
    ttl_over_tol, ttl_under_tol:
        Thresholds of ``over`` and ``under`` (shares of prompt tokens).

    Raises
    ------
    ValueError
        Bounds, step, factor or thresholds out of range.
    """

    def __init__(self, router: Any, *, min_weight: float = 0.4, max_weight: float = 0.85,
                 step: float = 0.05, interval: int = 100, imbalance_tol: float = 6.0,
                 miss_tol: float = 0.005, gap_tol: float = 0.05, sample_every: int = 8,
                 tune_ttl: bool = True, min_ttl_s: Optional[float] = None,
                 max_ttl_s: Optional[float] = None, ttl_factor: float = 1.25,
                 ttl_over_tol: float = 0.05, ttl_under_tol: float = 0.02) -> None:
        self.check_settings(min_weight=min_weight, max_weight=max_weight, step=step,
                            interval=interval, imbalance_tol=imbalance_tol, miss_tol=miss_tol,
                            gap_tol=gap_tol, sample_every=sample_every, min_ttl_s=min_ttl_s,
                            max_ttl_s=max_ttl_s, ttl_factor=ttl_factor,
                            ttl_over_tol=ttl_over_tol, ttl_under_tol=ttl_under_tol)
        ttl0 = getattr(router, "speculative_ttl_s", None) if tune_ttl else None
        ttl0 = float(ttl0) if isinstance(ttl0, (int, float)) and ttl0 > 0 else None
        lo = ttl0 / 4 if ttl0 is not None and min_ttl_s is None else min_ttl_s
        hi = ttl0 * 4 if ttl0 is not None and max_ttl_s is None else max_ttl_s
        if ttl0 is not None and not (lo is not None and hi is not None and 0 < lo <= hi):
            raise ValueError(f"need 0 < min_ttl_s <= max_ttl_s, got {lo}, {hi}")
        self.min_ttl_s, self.max_ttl_s = lo, hi
        self.ttl_factor = float(ttl_factor)
        self.ttl_over_tol, self.ttl_under_tol = float(ttl_over_tol), float(ttl_under_tol)
        #: The speculative TTL being tuned (seconds), or None: not tuned.
        self.ttl_s: Optional[float] = None
        if ttl0 is not None:
            assert lo is not None and hi is not None
            self.ttl_s = min(max(ttl0, lo), hi)
            if self.ttl_s != ttl0:
                router.speculative_ttl_s = self.ttl_s
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

    @staticmethod
    def check_settings(*, min_weight: float = 0.4, max_weight: float = 0.85,
                       step: float = 0.05, interval: int = 100, imbalance_tol: float = 6.0,
                       miss_tol: float = 0.005, gap_tol: float = 0.05, sample_every: int = 8,
                       tune_ttl: bool = True, min_ttl_s: Optional[float] = None,
                       max_ttl_s: Optional[float] = None, ttl_factor: float = 1.25,
                       ttl_over_tol: float = 0.05, ttl_under_tol: float = 0.02) -> None:
        """Raises ValueError naming the first setting out of range (the constructor's
        keyword arguments and defaults; no router needed)."""
        if not 0.0 <= min_weight <= max_weight <= 1.0:
            raise ValueError(f"need 0 <= min_weight <= max_weight <= 1, got {min_weight}, "
                             f"{max_weight}")
        if not 0.0 < step <= 1.0 or interval < 1 or sample_every < 1:
            raise ValueError(f"need 0 < step <= 1, interval >= 1, sample_every >= 1; got "
                             f"{step}, {interval}, {sample_every}")
        if imbalance_tol <= 0 or miss_tol < 0 or gap_tol < 0:
            raise ValueError("imbalance_tol must be > 0, miss_tol and gap_tol >= 0")
        if not ttl_factor > 1.0 or ttl_over_tol < 0 or ttl_under_tol < 0:
            raise ValueError(f"need ttl_factor > 1, ttl_over_tol and ttl_under_tol >= 0; got "
                             f"{ttl_factor}, {ttl_over_tol}, {ttl_under_tol}")
        if (min_ttl_s is not None and not min_ttl_s > 0) or (
                min_ttl_s is not None and max_ttl_s is not None and min_ttl_s > max_ttl_s):
            raise ValueError(f"need 0 < min_ttl_s <= max_ttl_s, got {min_ttl_s}, {max_ttl_s}")

    def _reset(self) -> None:
        self._n = 0
        self._prompt = self._available = self._captured = self._delivered = 0
        self._over = self._under = 0
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
            diff = report.captured_tokens - report.delivered_tokens
            if diff > 0:
                self._over += diff
            else:
                self._under -= diff
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
            over, under = self._over / prompt, self._under / prompt
            ttl_before = ttl_after = self.ttl_s
            ttl_why: Optional[str] = None
            if ttl_before is not None:
                assert self.min_ttl_s is not None and self.max_ttl_s is not None
                ttl_why, ttl_after = "hold", ttl_before
                if over > self.ttl_over_tol and under <= self.ttl_under_tol:
                    ttl_why, ttl_after = "stale", ttl_before / self.ttl_factor
                elif under > self.ttl_under_tol and over <= self.ttl_over_tol:
                    ttl_why, ttl_after = "expired", ttl_before * self.ttl_factor
                ttl_after = round(min(max(ttl_after, self.min_ttl_s), self.max_ttl_s), 6)
                self.ttl_s = ttl_after
            adj = Adjustment(self.reports, imbalance, missed, gap, before, after, why,
                             ttl_before, ttl_after, ttl_why, over, under)
            self.history.append(adj)
            self._reset()
        log.debug("interval: excess queue %.2f prompts, missed %.3f, gap %.3f -> %s; over "
                  "%.3f, under %.3f -> TTL %s", imbalance, missed, gap, why, over, under,
                  ttl_why)
        if after != before:
            self.router.cache_weight = after
            log.info("cache_weight %.3f -> %.3f (%s: excess queue %.2f mean prompts, missed "
                     "%.3f, gap %.3f of prompt tokens over %d requests)", before, after, why,
                     imbalance, missed, gap, self.interval)
        if ttl_after != ttl_before:
            self.router.speculative_ttl_s = ttl_after
            log.info("speculative_ttl_s %.3g -> %.3g (%s: over %.3f, under %.3f of prompt "
                     "tokens over %d requests)", ttl_before, ttl_after, ttl_why, over, under,
                     self.interval)
        return adj

    def _imbalance(self) -> Optional[float]:
        try:
            ws = self.router.stats()["workers"].values()
        except Exception:  # noqa: BLE001 - a closed router: no sample
            return None
        q = [float(w.get("pending_prefill_tokens") or 0) for w in ws]
        return max(q) - sum(q) / len(q) if q else 0.0
