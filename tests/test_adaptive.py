"""`kvroute.adaptive.AdaptiveCacheWeight`: each signal moves cache_weight the way it should,
within its bounds, logged; attached to a real Router through report_delivered."""

from __future__ import annotations

import logging

import pytest

from kvroute import Router, wire
from kvroute.adaptive import AdaptiveCacheWeight
from kvroute.delivered import DeliveredReport, HitRateTracker


class FakeRouter:
    """cache_weight, stats() with given pending prefill per worker, and a hit_rate tracker."""

    def __init__(self, weight=0.7, pending=(100, 100, 100, 100)):
        self.cache_weight = weight
        self.pending = list(pending)
        self.hit_rate = HitRateTracker(16)

    def stats(self):
        return {"workers": {f"w{i}": {"pending_prefill_tokens": p}
                            for i, p in enumerate(self.pending)}}


def rep(available, captured, delivered, prompt=1000):
    return DeliveredReport("w0", prompt, available, captured, delivered, prompt, None)


def feed(ctl, n, *args):
    out = None
    for _ in range(n):
        out = ctl.observe(rep(*args)) or out
    return out


def test_missed_reuse_raises_the_weight_up_to_its_bound(caplog):
    r = FakeRouter(0.8)
    ctl = AdaptiveCacheWeight(r, interval=10, step=0.1, max_weight=0.95, sample_every=1)
    with caplog.at_level(logging.INFO, logger="kvroute.adaptive"):
        adj = feed(ctl, 10, 600, 400, 400)
    assert adj.why == "missed" and adj.after == pytest.approx(0.9)
    assert r.cache_weight == pytest.approx(0.9)
    assert "cache_weight 0.800 -> 0.900 (missed" in caplog.records[-1].getMessage()
    feed(ctl, 20, 600, 400, 400)
    assert r.cache_weight == 0.95 and ctl.history[-1].after == 0.95  # bounded


def test_uneven_queues_lower_the_weight_down_to_its_bound():
    r = FakeRouter(0.5, pending=(30000, 0, 0, 0))  # 22.5 mean prompts beyond the mean
    ctl = AdaptiveCacheWeight(r, interval=10, step=0.1, min_weight=0.35, sample_every=1)
    adj = feed(ctl, 10, 600, 400, 400)  # missed reuse too: imbalance wins
    assert adj.why == "imbalance" and r.cache_weight == pytest.approx(0.4)
    feed(ctl, 30, 600, 400, 400)
    assert r.cache_weight == 0.35


def test_reuse_that_was_not_delivered_lowers_the_weight():
    r = FakeRouter(0.7)
    ctl = AdaptiveCacheWeight(r, interval=5, step=0.05, sample_every=1)
    adj = feed(ctl, 5, 500, 500, 100)
    assert adj.why == "gap" and r.cache_weight == pytest.approx(0.65)


def test_agreeing_even_fleet_holds_and_unreported_requests_do_not_count():
    r = FakeRouter(0.7)
    ctl = AdaptiveCacheWeight(r, interval=5, sample_every=1)
    for _ in range(20):
        assert ctl.observe(DeliveredReport("w0", 100, 50, 0, None, None, None)) is None
    adj = feed(ctl, 5, 500, 500, 500)
    assert adj.why == "hold" and r.cache_weight == 0.7 and ctl.reports == 5


def test_bad_settings():
    with pytest.raises(ValueError):
        AdaptiveCacheWeight(FakeRouter(), min_weight=0.9, max_weight=0.5)
    with pytest.raises(ValueError):
        AdaptiveCacheWeight(FakeRouter(), step=0)


def test_attached_to_a_router_it_tunes_from_report_delivered():
    toks = list(range(64))
    with Router(["http://a", "http://b"], block_size=16, cache_weight=0.5) as router:
        assert router.ingest("http://a", wire.encode_batch([wire.stored([1, 2, 3, 4], None,
                                                                        toks, 16)]), 0)
        ctl = AdaptiveCacheWeight(router, interval=4, step=0.1, sample_every=1)
        for _ in range(4):
            # reuse left behind (a dry run: no speculative credit on b)
            d = router.select_worker(toks + [1], exclude=["http://a"], dry_run=True)
            router.report_delivered(d, 0, prompt_tokens=65)
        assert ctl.history[-1].why == "missed"
        assert router.cache_weight == pytest.approx(0.6)
        ctl.detach()
        router.report_delivered(d, 0, prompt_tokens=65)
        assert ctl.reports == 4
