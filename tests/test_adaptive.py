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


# -- the speculative TTL ------------------------------------------------------------------------

class TtlRouter(FakeRouter):
    def __init__(self, ttl=2.0, **kw):
        super().__init__(**kw)
        self.speculative_ttl_s = ttl


def test_credits_the_engine_did_not_deliver_shorten_the_ttl_to_its_bound(caplog):
    r = TtlRouter(2.0)
    ctl = AdaptiveCacheWeight(r, interval=10, sample_every=1, gap_tol=1.0)
    with caplog.at_level(logging.INFO, logger="kvroute.adaptive"):
        adj = feed(ctl, 10, 500, 500, 300)  # over 0.2 of prompt tokens, under 0
    assert (adj.ttl_why, adj.ttl_before, adj.ttl_after) == ("stale", 2.0, 1.6)
    assert r.speculative_ttl_s == pytest.approx(1.6) and adj.over == pytest.approx(0.2)
    assert "speculative_ttl_s 2 -> 1.6 (stale: over 0.200" in caplog.records[-1].getMessage()
    feed(ctl, 100, 500, 500, 300)
    assert r.speculative_ttl_s == ctl.min_ttl_s == 0.5  # a quarter of the TTL at attach


def test_reuse_the_router_did_not_know_of_lengthens_the_ttl_to_its_bound():
    r = TtlRouter(2.0)
    ctl = AdaptiveCacheWeight(r, interval=10, sample_every=1, max_ttl_s=3.0)
    adj = feed(ctl, 10, 0, 0, 160)  # under 0.16
    assert adj.ttl_why == "expired" and r.speculative_ttl_s == pytest.approx(2.5)
    feed(ctl, 30, 0, 0, 160)
    assert r.speculative_ttl_s == 3.0


def test_ttl_holds_on_mixed_or_small_signals_and_stays_off_when_credits_are_off():
    r = TtlRouter(2.0)
    ctl = AdaptiveCacheWeight(r, interval=4, sample_every=1)
    # half the requests over by 0.2, half under by 0.2: both beyond their tolerances
    for i in range(4):
        ctl.observe(rep(500, 500, 300) if i % 2 else rep(300, 300, 500))
    assert ctl.history[-1].ttl_why == "hold" and r.speculative_ttl_s == 2.0
    feed(ctl, 4, 500, 500, 490)
    assert ctl.history[-1].ttl_why == "hold"
    off = AdaptiveCacheWeight(TtlRouter(0.0), interval=4)
    assert off.ttl_s is None and feed(off, 4, 0, 0, 500).ttl_why is None
    assert AdaptiveCacheWeight(TtlRouter(2.0), tune_ttl=False).ttl_s is None
    assert AdaptiveCacheWeight(FakeRouter()).ttl_s is None  # a router without a TTL
    with pytest.raises(ValueError):
        AdaptiveCacheWeight(TtlRouter(), ttl_factor=1.0)
    with pytest.raises(ValueError):
        AdaptiveCacheWeight(TtlRouter(), min_ttl_s=3.0, max_ttl_s=1.0)


def test_attached_to_a_router_it_tunes_the_router_s_ttl():
    toks = list(range(64))
    with Router(["http://a", "http://b"], block_size=16, speculative_ttl_s=2.0) as router:
        ctl = AdaptiveCacheWeight(router, interval=4, sample_every=1)
        for _ in range(4):
            # the engine reused 48 tokens the router did not know of
            d = router.select_worker(toks + [1], dry_run=True)
            router.report_delivered(d, 48, prompt_tokens=65)
        assert ctl.history[-1].ttl_why == "expired"
        assert router.speculative_ttl_s == pytest.approx(2.5)
        assert router._core.options.speculative_ttl_s == pytest.approx(2.5)
        with pytest.raises(ValueError):
            router.speculative_ttl_s = -1.0
