"""Each policy's contract: hashing stability, load balancing, Dynamo's cost, fallbacks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import kvroute
import kvroute.wire as W
from kvroute import Router
from kvroute.policies import CacheAware

BS = 16
NAMES = [f"http://w{i}" for i in range(6)]


def store(r, w, hashes, toks, medium="GPU"):
    assert r.ingest(w, W.encode_batch([W.stored(hashes, None, [int(t) for t in toks], BS,
                                                 medium=medium)]))


@pytest.mark.parametrize("policy", ["consistent_hash", "rendezvous_hash"])
def test_hashing_is_sticky_and_moves_only_the_removed_workers_sessions(policy):
    r = Router(NAMES, policy=policy)
    keys = [f"user-{i}" for i in range(600)]
    before = {k: r.select_worker([1, 2, 3], session_key=k).worker for k in keys}
    again = {k: r.select_worker([9, 9], session_key=k).worker for k in keys}
    assert before == again  # the session, not the prompt, decides
    spread = Counter(before.values())
    assert len(spread) == len(NAMES) and max(spread.values()) < 0.4 * len(keys)
    gone = NAMES[2]
    r.remove_worker(gone)
    after = {k: r.select_worker([1], session_key=k).worker for k in keys}
    moved = [k for k in keys if after[k] != before[k]]
    assert moved and all(before[k] == gone for k in moved)
    assert gone not in after.values()


def test_hashing_without_session_key_uses_the_prompt_prefix():
    r = Router(NAMES, policy="rendezvous_hash")
    prefix = list(range(300))
    a = r.select_worker(prefix + [1, 2]).worker
    b = r.select_worker(prefix + [7, 7, 7]).worker  # same first 256 tokens
    assert a == b


def test_least_load_and_random():
    r = Router(NAMES[:3], policy="least_load", seed=1)
    r.update_load(NAMES[0], num_requests_waiting=5)
    r.update_load(NAMES[1], num_requests_waiting=3)
    assert r.select_worker([1]).worker == NAMES[2]
    r2 = Router(NAMES, policy="random", seed=3)
    r3 = Router(NAMES, policy="random", seed=3)
    picks = [r2.select_worker([1]).worker for _ in range(200)]
    assert picks == [r3.select_worker([1]).worker for _ in range(200)]  # seeded
    assert set(picks) == set(NAMES)


def test_cost_prefers_cached_prefix_until_decode_load_outweighs_it():
    r = Router(NAMES[:2], policy="cost", speculative_ttl_s=0, seed=0)
    toks = np.arange(20 * BS, dtype=np.uint32)
    store(r, NAMES[0], list(range(1, 17)), toks[: 16 * BS])
    d = r.select_worker(toks, explain=True)
    costs = {s.worker: s.cost for s in d.scores}
    assert d.worker == NAMES[0] and d.policy == "cost"
    assert costs == {NAMES[0]: pytest.approx(4.0), NAMES[1]: pytest.approx(20.0)}
    # Keep w0 busy: its active blocks (20 per request) soon outweigh its prefix credit.
    picks = [r.select_worker(toks).worker for _ in range(3)]
    assert picks[0] == NAMES[1] or picks[1] == NAMES[1]


def test_cost_tier_credits_and_temperature():
    r = Router(NAMES[:2], policy="cost", speculative_ttl_s=0,
               tier_weights={"CPU": 0.5})
    toks = np.arange(10 * BS, dtype=np.uint32)
    store(r, NAMES[0], list(range(1, 11)), toks, medium="CPU")
    d = r.select_worker(toks, explain=True)
    assert {s.worker: s.cost for s in d.scores}[NAMES[0]] == pytest.approx(5.0)
    hot = Router(NAMES[:2], policy="cost", speculative_ttl_s=0, temperature=5.0, seed=1)
    store(hot, NAMES[0], list(range(1, 11)), toks)
    picks = Counter(hot.select_worker(toks).worker for _ in range(300))
    assert picks[NAMES[1]] > 0 and picks[NAMES[0]] > picks[NAMES[1]] // 2


@pytest.mark.parametrize("policy", ["kv_aware", "cost"])
def test_index_policies_fall_back_and_say_why(policy):
    r = Router(NAMES[:2], policy=policy, fallback="round_robin")
    d = r.select_worker([1] * BS)
    assert d.fallback and d.policy == "round_robin" and d.reason == "no_events"
    store(r, NAMES[0], [1], [5] * BS)
    d = r.select_worker([5] * BS)
    assert not d.fallback and d.policy == policy and d.reason == "policy"


def test_policies_without_index_never_fall_back():
    for p in ("round_robin", "random", "least_load", "consistent_hash", "rendezvous_hash",
              "cache_aware"):
        d = Router(NAMES[:2], policy=p).select_worker([1, 2, 3])
        assert not d.fallback and d.policy == p and d.reason == "policy"


def test_policy_names_match_the_core():
    assert set(kvroute._core.policy_names().split(", ")) == set(kvroute.POLICIES)


def test_cache_aware_follows_its_own_decisions_then_balances():
    r = Router(NAMES[:3], policy="cache_aware", seed=0, balance_abs_threshold=4,
               balance_rel_threshold=1.5)
    doc = list(range(1000, 1400))
    first = r.select_worker(doc + [1, 2])  # no events: the tree is built from decisions
    d = r.select_worker(doc + [3, 4], explain=True)
    assert d.worker == first.worker and not d.fallback
    assert {s.worker: s.match for s in d.scores}[first.worker] == pytest.approx(400 / 402)
    # Load the chosen worker past the thresholds: imbalance wins over the match.
    for _ in range(6):
        r.select_worker(doc + [9])  # never completed
    picks = [r.select_worker(doc + [5]).worker for _ in range(3)]
    assert any(p != first.worker for p in picks)
    # A prompt below cache_threshold of match goes to the least loaded worker.
    fresh = r.select_worker(list(range(50_000, 50_400)))
    loads = {k: v["inflight_requests"] for k, v in r.stats()["workers"].items()}
    assert loads[fresh.worker] == min(loads.values())


def test_cache_aware_forgets_removed_workers():
    r = Router(NAMES[:2], policy="cache_aware", seed=0)
    a = r.select_worker(list(range(500)))
    r.complete(a)
    r.remove_worker(a.worker)
    d = r.select_worker(list(range(500)), explain=True)
    assert d.worker != a.worker and all(s.match == 0 for s in d.scores)


@pytest.mark.parametrize("policy", ["consistent_hash", "rendezvous_hash"])
def test_exclude_moves_only_the_excluded_workers_sessions(policy):
    r = Router(NAMES, policy=policy)
    keys = [f"user-{i}" for i in range(400)]
    before = {k: r.select_worker([1], session_key=k).worker for k in keys}
    out = NAMES[3]
    after = {k: r.select_worker([1], session_key=k, exclude=[out]).worker for k in keys}
    moved = [k for k in keys if after[k] != before[k]]
    assert moved and all(before[k] == out for k in moved)
    assert out not in after.values()
    # Excluding is per request: the next request without it goes back.
    assert {k: r.select_worker([1], session_key=k).worker for k in keys} == before


@pytest.mark.parametrize("policy", [p for p in kvroute.POLICIES if p != "lmcache_aware"])
def test_exclude_is_never_chosen_even_with_the_best_prefix(policy):
    r = Router(NAMES[:3], policy=policy, speculative_ttl_s=0)
    toks = np.arange(10 * BS, dtype=np.uint32)
    store(r, NAMES[0], list(range(1, 11)), toks)
    assert r.select_worker(toks).worker == NAMES[0] or policy not in ("kv_aware", "cost")
    for _ in range(30):
        d = r.select_worker(toks, exclude=[NAMES[0], kvroute.Worker(NAMES[1]), "http://unknown"],
                            explain=True)
        assert d.worker == NAMES[2]
        assert d.matched_tokens == 0  # the chosen worker's match, not the excluded one's
        terms = {s.worker: s for s in d.scores}
        assert terms[NAMES[0]].score == 0 and terms[NAMES[0]].match == 0
        r.complete(d)


def test_exclude_every_worker_raises_and_leaves_no_load():
    r = Router(NAMES[:2])
    with pytest.raises(kvroute.NoWorkerAvailable, match="every worker is excluded"):
        r.select_worker([1, 2, 3], exclude=NAMES[:2])
    assert all(w["inflight_requests"] == 0 for w in r.stats()["workers"].values())


def test_clear_load_forgets_reported_signals_but_keeps_inflight():
    r = Router(NAMES[:2], policy="least_load")
    r.update_load(NAMES[0], num_requests_waiting=50, kv_cache_usage_perc=0.9)
    d = r.select_worker([1, 2])
    assert d.worker == NAMES[1]
    r.clear_load(NAMES[0])
    w0 = r.stats()["workers"][NAMES[0]]
    assert w0["num_requests_waiting"] == 0 and w0["kv_cache_usage_perc"] is None
    assert r.stats()["workers"][NAMES[1]]["inflight_requests"] == 1
    assert r.select_worker([1, 2]).worker == NAMES[0]
    with pytest.raises(KeyError):
        r.clear_load("http://nope")


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin", "cache_aware", "random"])
def test_dry_run_decides_without_side_effects(policy):
    def fresh():
        r = Router(NAMES[:3], policy=policy, speculative_ttl_s=10.0)
        store(r, NAMES[1], list(range(1, 5)), np.arange(4 * BS, dtype=np.uint32))
        return r

    toks = np.arange(8 * BS, dtype=np.uint32)
    a, b = fresh(), fresh()
    dry = [a.select_worker(toks, dry_run=True, now=1.0, explain=True) for _ in range(5)]
    assert all(d.request_id == 0 for d in dry)
    assert all(w["inflight_requests"] == 0 for w in a.stats()["workers"].values())
    assert a.stats()["speculative_entries"] == 0
    # The same real decisions follow on a router that was asked and on one that was not.
    real_a = [a.select_worker(toks, now=2.0).worker for _ in range(6)]
    real_b = [b.select_worker(toks, now=2.0).worker for _ in range(6)]
    assert real_a == real_b
    if policy == "kv_aware":
        assert dry[0].worker == NAMES[1] and dry[0].matched_blocks == 4
        assert a.stats()["speculative_entries"] > 0  # the real ones did credit


@pytest.mark.parametrize("interval, kept", [(0, True), (120, False)])
def test_cache_aware_eviction_interval_zero_never_evicts(interval, kept):
    """vllm-project/router and SGLang start their eviction thread only for an interval > 0:
    0 keeps the tree whole; 120 s cuts it back to max_tree_size (4 tokens) after a decision."""
    prompt = list(range(1000, 1064))
    with Router(["a", "b"], policy=CacheAware(eviction_interval_s=interval,
                                              max_tree_size=4)) as r:
        first = r.select_worker(prompt, now=1000.0)
        r.complete(first)
        d = r.select_worker(prompt, now=2000.0, explain=True)
        tree_match = {s.worker: s.match for s in d.scores}[first.worker]
        if kept:
            assert tree_match == 1.0 and d.worker == first.worker
        else:
            assert tree_match <= 4 / 64


# -- cost against an independent implementation of Dynamo's formula --------------------------
# ai-dynamo/dynamo lib/kv-router scheduling (DefaultWorkerScorer::worker_logit,
# softmax_sample_index; KvRouterConfig defaults): written here from the formula, not from
# kvroute's code.

def dynamo_cost(isl_tokens, block_size, active_prefill_tokens, decode_blocks, device_blocks,
                host_blocks=0, disk_blocks=0, prefill_load_scale=1.0, overlap_score_credit=1.0,
                host_cache_hit_weight=0.75, disk_cache_hit_weight=0.25):
    raw_prefill_blocks = (active_prefill_tokens + isl_tokens) / block_size
    overlap_credit_blocks = (overlap_score_credit * device_blocks
                             + host_cache_hit_weight * host_blocks
                             + disk_cache_hit_weight * disk_blocks)
    return (prefill_load_scale * max(0.0, raw_prefill_blocks - overlap_credit_blocks)
            + decode_blocks)


def dynamo_probabilities(costs, temperature):
    lo, hi = min(costs), max(costs)
    if lo == hi:
        return [1 / len(costs)] * len(costs)
    w = [np.exp(-(c - lo) / ((hi - lo) * temperature)) for c in costs]
    return [x / sum(w) for x in w]


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0])
def test_cost_matches_dynamos_formula_and_sampling(temperature):
    ws = NAMES[:3]
    r = Router(ws, policy="cost", temperature=temperature, speculative_ttl_s=0, seed=3,
               tier_weights={"CPU": 0.75})  # Dynamo's host_cache_hit_weight
    prompt = np.arange(10 * BS + 5, dtype=np.uint32)  # 10 full blocks and 5 tokens
    store(r, ws[0], list(range(1, 9)), prompt[: 8 * BS])                    # 8 blocks on GPU
    store(r, ws[1], list(range(101, 107)), prompt[: 6 * BS], medium="CPU")  # 6 on CPU
    # In-flight work, placed with exclude: w2 prefilling a 320-token prompt (20 blocks);
    # w1 decoding a 160-token one (its prefill done: 10 blocks, no queued prefill).
    other = np.arange(50_000, 50_320, dtype=np.uint32)
    held = r.select_worker(other, exclude=[ws[0], ws[1]])
    assert held.worker == ws[2]
    dec = r.select_worker(np.arange(60_000, 60_160, dtype=np.uint32), exclude=[ws[0], ws[2]])
    assert dec.worker == ws[1]
    r.first_token(dec)
    expected = [
        dynamo_cost(len(prompt), BS, 0, 0, device_blocks=8),
        dynamo_cost(len(prompt), BS, 0, 10, device_blocks=0, host_blocks=6),
        dynamo_cost(len(prompt), BS, 320, 20, device_blocks=0),
    ]
    d = r.select_worker(prompt, explain=True, dry_run=True)
    assert [s.cost for s in sorted(d.scores, key=lambda s: s.worker)] == pytest.approx(expected)
    if temperature == 0:
        assert d.worker == ws[int(np.argmin(expected))]
        return
    p = dynamo_probabilities(expected, temperature)
    n = 4000
    counts = Counter()
    for _ in range(n):
        x = r.select_worker(prompt)
        counts[x.worker] += 1
        r.complete(x)  # back to the same state: each draw sees the same costs
    for w, pw in zip(ws, p):
        sigma = (n * pw * (1 - pw)) ** 0.5
        assert abs(counts[w] - n * pw) < 5 * sigma, (w, counts, [n * q for q in p])
