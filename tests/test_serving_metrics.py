"""kvroute.serving.metrics: the rendered exposition parsed back with prometheus-client, after
real decisions and real vLLM-format event batches ingested by the router."""

from __future__ import annotations

import time
from typing import Dict, FrozenSet, Tuple

import pytest
from _util import require

require("prometheus_client")

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvroute import Router, wire  # noqa: E402
from kvroute.serving.metrics import RouterMetrics, decision_reason, upstream_outcome  # noqa: E402

A, B = "http://10.0.0.5:8000", "http://10.0.0.6:8000"
TOKENS = list(range(64))  # four 16-token blocks

Samples = Dict[Tuple[str, FrozenSet[Tuple[str, str]]], float]


def scrape(metrics: RouterMetrics) -> Samples:
    body, ctype = metrics.render()
    assert ctype.startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def router():
    r = Router([A, B], block_size=16)
    # A: four blocks stored, then one removed. B: a store, a sequence gap (no replay socket,
    # so its state is dropped and marked degraded), and a payload with trailing bytes.
    assert r.ingest(A, wire.encode_batch([wire.stored([1, 2, 3, 4], None, TOKENS, 16)]), 0)
    assert r.ingest(A, wire.encode_batch([wire.removed([4])]), 1)
    assert r.ingest(B, wire.encode_batch([wire.stored([11], None, TOKENS[:16], 16)]), 0)
    r.ingest(B, wire.encode_batch([wire.stored([12], 11, TOKENS[16:32], 16)]), 3)
    assert not r.ingest(B, wire.encode_batch([wire.removed([11])]) + b"\x00", 4)
    yield r
    r.close()


def test_collector_reads_the_router_counters_at_scrape_time(router):
    m = RouterMetrics(router)
    stats = router.stats()
    wa, wb = stats["workers"][A], stats["workers"][B]
    s = scrape(m)
    assert val(s, "kvroute_events_applied_total") == stats["events_applied"] > 0
    assert val(s, "kvroute_blocks_stored_total", worker=A) == 4
    assert val(s, "kvroute_blocks_removed_total", worker=A) == 1
    assert val(s, "kvroute_indexed_blocks", worker=A) == 3
    assert val(s, "kvroute_blocks_stored_total", worker=B) == wb["blocks_stored"]
    assert val(s, "kvroute_dropped_batches_total", worker=B, reason="trailing_bytes") == 1
    assert ("kvroute_dropped_batches_total", frozenset({("worker", A), ("reason",
            "trailing_bytes")})) not in s
    assert val(s, "kvroute_sequence_gaps_total", worker=B) == wb["gaps"] == 1
    assert val(s, "kvroute_sequence_gaps_total", worker=A) == 0
    assert val(s, "kvroute_recovered_batches_total", worker=B) == wb["batches_recovered"]
    assert val(s, "kvroute_worker_degraded", worker=B) == 1
    assert val(s, "kvroute_worker_degraded", worker=A) == 0
    assert val(s, "kvroute_index_memory_bytes") == stats["index_memory_bytes"] > 0
    assert val(s, "kvroute_index_block_keys") == stats["distinct_block_keys"] == 3
    assert val(s, "kvroute_inflight_requests", worker=A) == wa["inflight_requests"] == 0

    # Scrape time, not registration time: later events and load show up.
    router.ingest(A, wire.encode_batch([wire.removed([3])]), 2)
    router.update_load(B, num_requests_waiting=7, kv_cache_usage_perc=0.25)
    s = scrape(m)
    assert val(s, "kvroute_blocks_removed_total", worker=A) == 2
    assert val(s, "kvroute_indexed_blocks", worker=A) == 2
    assert val(s, "kvroute_speculative_blocks") == 0
    assert val(s, "kvroute_speculative_dropped_total") == 0
    # A decision on new tokens credits its worker with them (the Router's speculative_ttl).
    router.complete(router.select_worker(list(range(500_000, 500_000 + 5 * 16))))
    s = scrape(m)
    assert val(s, "kvroute_speculative_blocks") == router.stats()["speculative_entries"] == 5
    assert val(s, "kvroute_reported_requests_waiting", worker=B) == 7
    assert val(s, "kvroute_reported_kv_cache_usage_ratio", worker=B) == 0.25
    assert ("kvroute_reported_kv_cache_usage_ratio", frozenset({("worker", A)})) not in s


def test_decisions_by_reason_match_ratio_latency_and_inflight(router):
    m = RouterMetrics(router)
    prompt = TOKENS + [7] * 16
    t0 = time.perf_counter()
    d = router.select_worker(prompt)
    m.observe_decision(d, time.perf_counter() - t0)
    assert d.worker == A and decision_reason(d) == "normal"
    s = scrape(m)
    assert val(s, "kvroute_decisions_total", policy="kv_aware", reason="normal") == 1
    assert val(s, "kvroute_inflight_requests", worker=A) == 1
    assert val(s, "kvroute_pending_prefill_tokens", worker=A) == d.prefill_tokens > 0
    ratio = d.matched_tokens / len(prompt)
    assert ratio == 48 / 80  # blocks 1-3 of A (block 4 was removed)
    assert val(s, "kvroute_matched_token_ratio_sum") == pytest.approx(ratio)
    assert val(s, "kvroute_matched_token_ratio_bucket", le="0.5") == 0
    assert val(s, "kvroute_matched_token_ratio_bucket", le="0.6") == 1
    assert val(s, "kvroute_select_latency_seconds_count") == 1
    assert 0 < val(s, "kvroute_select_latency_seconds_sum") < 60

    router.complete(d)
    assert val(scrape(m), "kvroute_inflight_requests", worker=A) == 0

    # B is degraded: a decision the policy makes for it says so.
    dd = router.select_worker([5] * 40, exclude=[A])
    m.observe_decision(dd)
    assert dd.degraded and not dd.fallback
    assert val(scrape(m), "kvroute_decisions_total", policy="kv_aware", reason="degraded") == 1
    assert val(scrape(m), "kvroute_select_latency_seconds_count") == 1  # not observed

    with Router([A, B]) as cold:  # no events yet: the fallback policy decides
        mc = RouterMetrics(cold)
        df = cold.select_worker(TOKENS)
        mc.observe_decision(df, 1e-5)
        assert df.fallback
        assert val(scrape(mc), "kvroute_decisions_total", policy=df.policy, reason="fallback") == 1
        assert val(scrape(mc), "kvroute_matched_token_ratio_bucket", le="0.0") == 1
        with pytest.raises(ValueError, match="select_seconds must be a non-negative"):
            mc.observe_decision(df, -1.0)
        assert val(scrape(mc), "kvroute_decisions_total", policy=df.policy, reason="fallback") == 1


def test_upstream_retries_and_circuit_breaker(router):
    m = RouterMetrics(router)
    m.observe_upstream(A, 200, 0.8)
    m.observe_upstream(A, 200, 2.0)
    m.observe_upstream(A, 503, 0.01)
    m.observe_upstream(B, "connect_error", 0.002)
    m.observe_upstream(B, "timeout")
    m.observe_retry()
    m.set_circuit_open(B, True)
    m.set_circuit_open(A, False)
    s = scrape(m)
    assert val(s, "kvroute_upstream_requests_total", worker=A, outcome="2xx") == 2
    assert val(s, "kvroute_upstream_requests_total", worker=A, outcome="5xx") == 1
    assert val(s, "kvroute_upstream_requests_total", worker=B, outcome="connect_error") == 1
    assert val(s, "kvroute_upstream_requests_total", worker=B, outcome="timeout") == 1
    assert val(s, "kvroute_upstream_latency_seconds_count", worker=A) == 3
    assert val(s, "kvroute_upstream_latency_seconds_bucket", worker=A, le="1.0") == 2
    assert val(s, "kvroute_upstream_latency_seconds_count", worker=B) == 1
    assert val(s, "kvroute_retries_total") == 1
    assert val(s, "kvroute_circuit_open", worker=B) == 1
    assert val(s, "kvroute_circuit_open", worker=A) == 0
    m.set_circuit_open(B, False)
    assert val(scrape(m), "kvroute_circuit_open", worker=B) == 0

    for bad in (True, "Connect Error", "x" * 40, 2.5):
        with pytest.raises(ValueError, match="upstream status|HTTP status"):
            m.observe_upstream(A, bad, 0.1)
    with pytest.raises(ValueError, match="seconds must be a non-negative"):
        m.observe_upstream(A, 200, float("nan"))
    assert val(scrape(m), "kvroute_upstream_requests_total", worker=A, outcome="2xx") == 2
    # A status no HTTP server should send still comes from the worker: counted, never raised
    # (raising would fail the request being passed through).
    for odd in (99, 600, 999):
        m.observe_upstream(A, odd, 0.1)
    assert val(scrape(m), "kvroute_upstream_requests_total", worker=A, outcome="other") == 3

    m.forget_worker(B)
    m.forget_worker(B)  # idempotent
    s = scrape(m)
    assert not any(dict(labels).get("worker") == B for (name, labels) in s
                   if name.startswith(("kvroute_upstream", "kvroute_circuit")))
    assert val(s, "kvroute_upstream_requests_total", worker=A, outcome="2xx") == 2


def test_registries_namespaces_and_outcome_labels(router):
    assert upstream_outcome(204) == "2xx" and upstream_outcome("disconnect") == "disconnect"
    assert upstream_outcome(600) == "other" and upstream_outcome(42) == "other"
    reg = CollectorRegistry()
    m = RouterMetrics(router, registry=reg, namespace="edge")
    assert val(scrape(m), "edge_blocks_stored_total", worker=A) == 4
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        RouterMetrics(router, registry=reg, namespace="edge")
    m.unregister()
    RouterMetrics(router, registry=reg, namespace="edge")  # free again
    with pytest.raises(ValueError, match="namespace must match"):
        RouterMetrics(router, namespace="kv-route")
    # Two RouterMetrics with default registries never collide.
    one, two = scrape(RouterMetrics(router)), scrape(RouterMetrics(router))
    assert {k: v for k, v in one.items() if not k[0].endswith("_created")} == \
        {k: v for k, v in two.items() if not k[0].endswith("_created")}
