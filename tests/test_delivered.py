"""Predicted vs delivered prefix reuse (`kvroute.delivered`, `Router.report_delivered`): the
engines' usage shapes, the three numbers per request, the metrics, the gap warning and its
named cause, and the proxy reading real stand-in engine answers (streaming and not)."""

from __future__ import annotations

import json
import logging
import pickle
import time

import pytest
from _util import require

from kvroute import Router, wire
from kvroute.delivered import (
    ERROR_BUCKETS,
    HitRateTracker,
    Usage,
    UsageScanner,
    parse_usage,
    usage_from_body,
)

A, B = "http://10.0.0.5:8000", "http://10.0.0.6:8000"
TOKENS = list(range(1000, 1064))  # four 16-token blocks


# -- the engines' shapes ----------------------------------------------------------------------

def test_vllm_non_streaming_usage():
    body = {"id": "chatcmpl-1", "choices": [],
            "usage": {"prompt_tokens": 70, "completion_tokens": 8, "total_tokens": 78,
                      "prompt_tokens_details": {"cached_tokens": 48}}}
    assert usage_from_body(json.dumps(body).encode()) == Usage(48, 70)
    # vLLM leaves the details out (null) when nothing was cached, or when the option is off.
    body["usage"]["prompt_tokens_details"] = None
    assert usage_from_body(json.dumps(body)) == Usage(None, 70)
    assert usage_from_body(b"not json") == Usage()
    assert usage_from_body(b'{"usage": null}') == Usage()


def test_sglang_meta_info_and_malformed_values():
    assert parse_usage({"text": "hi", "meta_info": {"prompt_tokens": 33, "cached_tokens": 32,
                                                     "completion_tokens": 4}}) == Usage(32, 33)
    assert parse_usage([{"meta_info": {"prompt_tokens": 5, "cached_tokens": 0}}]) == Usage(0, 5)
    bad = {"usage": {"prompt_tokens": -1, "prompt_tokens_details": {"cached_tokens": "7"}}}
    assert parse_usage(bad) == Usage()


def test_stream_scanner_reads_the_final_usage_chunk_across_any_split():
    chunks = [
        b'data: {"choices":[{"delta":{"content":"usage"}}]}\n\n',  # the word, not the key
        b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n',
        b"data: [DONE]\n\n",
    ]
    raw = b"".join(chunks)
    for step in (1, 7, 64, len(raw)):
        s = UsageScanner()
        for i in range(0, len(raw), step):
            s.feed(raw[i:i + step])
        assert s.close() == Usage(32, 40), step
    # continuous_usage_stats: usage on every chunk without details; the final one has them
    s = UsageScanner()
    s.feed(b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":40}}\n\n')
    s.feed(b'data: {"choices":[],"usage":{"prompt_tokens":40,'
           b'"prompt_tokens_details":{"cached_tokens":16}}}\n\n')
    s.feed(b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":40}}\n\n')
    assert s.close() == Usage(16, 40)
    s = UsageScanner()
    s.feed(b'data: {"text":"a","meta_info":{"prompt_tokens":9,"cached_tokens":0}}')  # no newline
    assert s.close() == Usage(0, 9)


# -- the router's three numbers ---------------------------------------------------------------

@pytest.fixture
def router():
    r = Router([A, B], block_size=16)
    assert r.ingest(A, wire.encode_batch([wire.stored([1, 2, 3, 4], None, TOKENS, 16)]), 0)
    assert r.ingest(B, wire.encode_batch([wire.stored([11], None, TOKENS[:16], 16)]), 0)
    yield r
    r.close()


def test_decision_carries_available_beside_captured(router):
    d = router.select_worker(TOKENS + [7, 8], exclude=[A])  # the best holder excluded
    assert (d.worker, d.matched_tokens, d.available_tokens, d.available_blocks) == (B, 16, 64, 4)
    back = pickle.loads(pickle.dumps(d))
    assert (back.available_tokens, back.available_blocks) == (64, 4)
    router.complete(d)
    d = router.select_worker(TOKENS + [7, 8], dry_run=True)
    assert d.worker == A and d.matched_tokens == d.available_tokens == 64


def test_report_delivered_sums_the_three_numbers(router):
    d = router.select_worker(TOKENS + [7, 8], exclude=[A])
    rep = router.report_delivered(d, 16, prompt_tokens=66)
    assert (rep.available_tokens, rep.captured_tokens, rep.delivered_tokens) == (64, 16, 16)
    assert rep.error == 0.0 and rep.engine_prompt_tokens == 66
    d2 = router.select_worker(TOKENS + [9, 9])
    rep2 = router.report_delivered(d2, 32, prompt_tokens=66)
    assert rep2.captured_tokens == 64 and rep2.error == pytest.approx((64 - 32) / 66)
    snap = router.hit_rate.snapshot()
    assert snap["totals"] == {"available": 128, "captured": 80, "delivered": 48}
    assert snap["reports"] == 2 and snap["unreported"] == 0
    assert snap["workers"][A]["reports"] == 1 and snap["workers"][B]["reports"] == 1
    with pytest.raises(ValueError):
        router.report_delivered(d, -1)


def test_a_missing_count_is_zero_only_after_the_worker_reported_one(router):
    d = router.select_worker(TOKENS, exclude=[B])
    assert router.report_delivered(d, None, prompt_tokens=64).delivered_tokens is None
    assert router.hit_rate.snapshot()["unreported"] == 1
    assert router.report_delivered(d, 48, prompt_tokens=64).delivered_tokens == 48
    # now a usage without details from A means vLLM / SGLang left a zero count out
    assert router.report_delivered(d, None, prompt_tokens=64).delivered_tokens == 0
    assert router.report_delivered(d, None).delivered_tokens is None  # no usage at all


def test_metrics_expose_the_three_numbers_and_the_error_histogram(router):
    require("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from kvroute.serving.metrics import RouterMetrics

    d = router.select_worker(TOKENS + [1])
    router.report_delivered(d, 32, prompt_tokens=65)
    router.report_delivered(d, None)
    body, _ = RouterMetrics(router).render()
    s = {(x.name, frozenset(x.labels.items())): x.value
         for f in text_string_to_metric_families(body.decode()) for x in f.samples}
    assert s[("kvroute_prefix_tokens_total", frozenset({("kind", "available")}))] == 64
    assert s[("kvroute_prefix_tokens_total", frozenset({("kind", "captured")}))] == 64
    assert s[("kvroute_prefix_tokens_total", frozenset({("kind", "delivered")}))] == 32
    err = (64 - 32) / 65
    first = next(ub for ub in ERROR_BUCKETS if err <= ub)
    assert s[("kvroute_prefix_prediction_error_bucket",
              frozenset({("worker", A), ("le", repr(first))}))] == 1
    assert s[("kvroute_prefix_prediction_error_bucket",
              frozenset({("worker", A), ("le", "0.02")}))] == 0
    # negative observations: no _sum / _count (the +Inf bucket is the count)
    assert s[("kvroute_prefix_prediction_error_bucket",
              frozenset({("worker", A), ("le", "+Inf")}))] == 1
    assert s[("kvroute_delivered_reports_total",
              frozenset({("worker", A), ("reported", "false")}))] == 1


# -- the gap warning --------------------------------------------------------------------------

class _D:
    """A decision-shaped record (the tracker reads only these fields)."""

    def __init__(self, worker, prompt, captured, available=None):
        self.worker, self.prompt_tokens, self.matched_tokens = worker, prompt, captured
        self.available_tokens = captured if available is None else available


def _feed(t, n, prompt, captured, delivered, engine_prompt=None):
    for _ in range(n):
        t.record(_D(A, prompt, captured), delivered, engine_prompt)


@pytest.mark.parametrize("case,expect", [
    ("tokenization", "tokenization or chat template"),
    ("block_size", "block size"),
    ("events", "events not arriving"),
    ("keys", "keys blocks differently"),
])
def test_a_sustained_gap_warns_with_the_likely_cause(caplog, case, expect):
    stats = {"workers": {A: {"blocks_stored": 0, "last_recv_age_s": -1, "dropped": {}}}}
    t = HitRateTracker(16, window=8, min_reports=8, worker_stats=lambda: stats)
    with caplog.at_level(logging.WARNING, logger="kvroute.delivered"):
        _feed(t, 4, 128, 64, 64, 128)  # agreeing: no warning
        assert not caplog.records
        if case == "tokenization":
            _feed(t, 8, 128, 96, 0, 131)
        elif case == "block_size":
            _feed(t, 8, 128, 96, 24, 128)
        elif case == "events":
            _feed(t, 8, 128, 0, 96, 128)
        else:
            _feed(t, 8, 128, 96, 0, 128)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned  # once per warn_interval_s
    assert A in warned[0] and expect in warned[0]
    assert t.snapshot()["workers"][A]["last_warning"] == warned[0]


def test_no_warning_while_captured_and_delivered_agree(caplog):
    t = HitRateTracker(16, window=8, min_reports=4)
    with caplog.at_level(logging.WARNING, logger="kvroute.delivered"):
        _feed(t, 20, 128, 64, 48, 128)  # 16 of 128 apart: within gap_ratio 0.2
    assert not caplog.records


def test_events_cause_names_a_block_size_mismatch_the_stream_counted():
    stats = {"workers": {A: {"dropped": {"block_size_mismatch": 3}}}}
    t = HitRateTracker(16, window=4, min_reports=4, worker_stats=lambda: stats)
    _feed(t, 4, 128, 0, 96, 128)
    w = t.snapshot()["workers"][A]["last_warning"]
    assert "block_size_mismatch" in w and "--block-size" in w


# -- the proxy, against a real stand-in engine -------------------------------------------------

def test_proxy_reports_delivered_from_streaming_and_plain_answers(qwen3):
    httpx = require("httpx")
    fastapi = require("fastapi")
    from _util import TIMEOUT, UvicornThread, standin_engines, wait_for, wait_subscribed

    from kvroute.fastapi import create_router
    from kvroute.prompt import PromptTokenizer
    from kvroute.sim.server import DEFAULT_MODEL

    tok = PromptTokenizer.from_dir(qwen3)
    with standin_engines(1, qwen3, model=DEFAULT_MODEL) as (eng,):
        router = Router([eng.worker()], block_size=16)
        wait_subscribed([eng])
        app = fastapi.FastAPI()
        app.include_router(create_router(router, tokenizer=tok, model=DEFAULT_MODEL))
        srv = UvicornThread(app)
        try:
            msgs = [{"role": "user", "content": "Tell me about the history of the Roman "
                     "aqueducts and how their gradients were surveyed. " * 4}]
            body = {"model": DEFAULT_MODEL, "messages": msgs, "max_tokens": 2}
            with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
                r1 = c.post("/v1/chat/completions", json=body)
                assert r1.status_code == 200, r1.text
                full = r1.json()["usage"]["prompt_tokens"] // 16
                wait_for(lambda: router.stats()["workers"][eng.url]["blocks_stored"] >= full,
                         "the first answer's BlockStored")
                time.sleep(0.05)
                with c.stream("POST", "/v1/chat/completions",
                              json={**body, "stream": True,
                                    "stream_options": {"include_usage": True}}) as r2:
                    assert r2.status_code == 200
                    text = b"".join(r2.iter_raw())
                usage = [json.loads(line[5:]) for line in text.split(b"\n")
                         if line.startswith(b"data: {") and b'"usage"' in line][-1]["usage"]
                log = c.get("/admin/decisions").json()
        finally:
            srv.stop()
            router.close()
            tok.close()
    entries = log["decisions"] if isinstance(log, dict) else log
    first, second = entries[-2], entries[-1]
    assert first["delivered_tokens"] == 0 and first["matched_tokens"] == 0
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    # the router predicted exactly what the engine reused: same tokens, same blocks
    assert second["delivered_tokens"] == cached == second["matched_tokens"]
    assert second["available_tokens"] == cached and second["prediction_error"] == 0
    assert second["engine_prompt_tokens"] == second["prompt_tokens"]
    snap = router.hit_rate.snapshot()
    assert snap["reports"] == 2 and snap["totals"]["delivered"] == cached
