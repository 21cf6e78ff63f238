"""Router API: arguments, kv_aware scoring, load accounting, speculative inserts, fallback."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvroute
import kvroute.wire as ee
from kvroute import Router, Worker
from kvroute.policies import KvAware

BS = 16


def store(router, worker, hashes, tokens, parent=None, **kw):
    toks = [int(t) for t in tokens]
    payload = ee.encode_batch([ee.stored(hashes, parent, toks, BS, **kw)], era="map")
    assert router.ingest(worker, payload)


def prompt(n_tokens, offset=0):
    return np.arange(offset, offset + n_tokens, dtype=np.uint32)


@pytest.fixture
def router():
    r = Router(["w0", "w1", "w2"], block_size=BS, seed=1)
    yield r
    r.close()


# -- arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"workers": []}, "non-empty"),
        ({"workers": ["a"], "cache_weight": 1.5}, "cache_weight"),
        ({"workers": ["a"], "cache_weight": -0.1}, "cache_weight"),
        ({"workers": ["a"], "policy": "greedy"}, "expected one of kv_aware, cost, cache_aware"),
        ({"workers": ["a"], "fallback_policy": "kv_aware"}, "needs no KV events"),
        ({"workers": ["a"], "cache_threshold": 2}, "cache_threshold"),
        ({"workers": ["a"], "virtual_nodes": 0}, "virtual_nodes"),
        ({"workers": ["a"], "block_size": 0}, "block_size"),
        ({"workers": ["a"], "ingest_nice": 20}, "ingest_nice"),
        ({"workers": ["a"], "ingest_nice": -1}, "ingest_nice"),
        ({"workers": ["a"], "ingest_nice": True}, "ingest_nice"),
        ({"workers": ["a", "a"]}, "duplicate"),
        ({"workers": ["a"], "tier_weights": {"NVME": 1}}, "GPU, CPU or DISK"),
        ({"workers": [Worker("a", "tcp://not an endpoint")]}, "cannot connect"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Router(**kwargs)


@pytest.mark.parametrize(
    "tokens, match",
    [
        ([1, -2, 3], r"\[0, 2\*\*32\)"),
        (np.array([1, 2**33], dtype=np.int64), r"\[0, 2\*\*32\)"),
        ([1.5, 2.0], "integer"),
        (np.zeros((2, 2), dtype=np.int32), "1-D"),
        (["a", "b"], "integer"),
    ],
)
def test_bad_tokens_raise_value_error(router, tokens, match):
    with pytest.raises(ValueError, match=match):
        router.select_worker(tokens)


class _Id(int):
    """An int subclass: read through the general path of the list reader."""


def test_token_lists_read_like_uint32_arrays():
    # Around the digit boundaries of CPython ints (30-bit digits: 0, 1 and 2 digits) and the
    # top of the uint32 range; bools and int subclasses take the general path.
    edge = [0, 1, 255, 256, 2**15 - 1, 2**15, 2**30 - 1, 2**30, 2**31, 2**32 - 2, 2**32 - 1]
    rng = np.random.default_rng(3)
    for toks in (edge * 16, rng.integers(0, 2**32, 16 * 64, dtype=np.uint64).tolist()):
        want = kvroute.block_keys(np.array(toks, dtype=np.uint32))
        assert np.array_equal(kvroute.block_keys(toks), want)
        assert np.array_equal(kvroute.block_keys([_Id(t) for t in toks]), want)
    bools = [True, False] * 8
    assert np.array_equal(kvroute.block_keys(bools),
                          kvroute.block_keys(np.array(bools, dtype=np.uint32)))


@pytest.mark.parametrize(
    "bad, shown",
    [(2**32, "4294967296"), (-1, "-1"), (2**64, "9223372036854775807"),
     (-(2**70), "-9223372036854775808"), (_Id(2**32), "4294967296")],
)
def test_out_of_range_list_token_names_its_position(bad, shown):
    toks = list(range(40))
    toks[37] = bad
    with pytest.raises(ValueError, match=rf"got {shown} at position 37"):
        kvroute.block_keys(toks)


@pytest.mark.parametrize("policy", ["kv_aware", "power_of_two", "round_robin"])
def test_tokens_only_select_decides_as_the_general_call(policy):
    # select_worker(tokens) takes the binding's one-argument path; exclude=[] forces the
    # general one. Two routers with one seed must decide alike, random draws included.
    rs = [Router([f"w{i}" for i in range(6)], block_size=BS, seed=7, policy=policy)
          for _ in range(2)]
    rng = np.random.default_rng(5)
    sys_prompt = rng.integers(0, 50_000, 4 * BS).tolist()
    for r in rs:
        for i, w in enumerate(["w1", "w3", "w4"]):
            store(r, w, list(range(100 * i, 100 * i + 4 + i)),
                  sys_prompt + rng.integers(0, 50_000, i * BS).tolist())
    for k in range(40):
        toks = sys_prompt[: (k % 4 + 1) * BS] + list(range(k * 7, k * 7 + k % 3 * BS))
        a = rs[0].select_worker(toks if k % 2 else np.array(toks, dtype=np.int64))
        b = rs[1].select_worker(toks, exclude=[])
        assert (a.worker, a.matched_tokens, a.policy, a.request_id) == \
            (b.worker, b.matched_tokens, b.policy, b.request_id)
        if k % 3 == 0:
            rs[0].complete(a.request_id)
            rs[1].complete(b.request_id)
    for bad in (np.zeros((2, 16), dtype=np.uint32), np.ones(16, dtype=np.float32),
                [1, 2, "x"], [-1] * 16):
        for kw in ({}, {"exclude": []}):
            with pytest.raises(ValueError):
                rs[0].select_worker(bad, **kw)
    # Other sequences go the general way and decide as a list does.
    assert rs[0].select_worker(tuple(sys_prompt), dry_run=True).worker == \
        rs[0].select_worker(sys_prompt, dry_run=True).worker
    for r in rs:
        r.close()


def test_unknown_worker_raises_key_error(router):
    with pytest.raises(KeyError, match="nope"):
        router.remove_worker("nope")
    with pytest.raises(KeyError, match="nope"):
        router.update_load("nope", num_requests_waiting=1)
    with pytest.raises(KeyError, match="nope"):
        router.ingest("nope", b"")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        router.update_load("w0", kv_cache_usage_perc=2.0)


@pytest.mark.parametrize("dtype", [np.uint32, np.int32, np.int64, np.uint64, np.uint16])
def test_token_dtypes_give_the_same_keys(dtype):
    toks = list(range(100, 164))
    expect = kvroute.block_keys(toks, BS)
    assert expect.dtype == np.uint64 and expect.shape == (4,)
    np.testing.assert_array_equal(kvroute.block_keys(np.array(toks, dtype=dtype), BS), expect)


def test_block_keys_chain_lora_and_salt_never_alias():
    toks = list(range(64))
    base = kvroute.block_keys(toks, BS)
    assert len(set(base.tolist())) == 4
    # chained: the same block after a different prefix has a different key
    assert kvroute.block_keys([9] * 16 + toks[16:32], BS)[1] != base[1]
    assert not set(kvroute.block_keys(toks, BS, lora_name="a").tolist()) & set(base.tolist())
    salted = kvroute.block_keys(toks, BS, cache_salt="s")
    assert not set(salted.tolist()) & set(base.tolist())
    assert len(kvroute.block_keys(toks[:40], BS)) == 2  # trailing partial block has no key


# -- routing -----------------------------------------------------------------------------------

def test_fallback_until_first_event_then_kv_aware(router):
    d = router.select_worker(prompt(64))
    assert d.fallback and d.policy == "power_of_two"
    router.complete(d)
    store(router, "w2", [1, 2, 3, 4], prompt(64))
    d = router.select_worker(prompt(80), explain=True)
    assert not d.fallback and d.policy == "kv_aware"
    assert d.worker == "w2" and d.matched_tokens == 64 and d.prefill_tokens == 16
    by = {s.worker: s for s in d.scores}
    assert by["w2"].match == pytest.approx(64 / 80)
    assert by["w2"].score == pytest.approx(0.7 * 64 / 80 + 0.3 * 1.0)
    assert by["w0"].score == pytest.approx(0.3)


def test_block_removed_and_cleared_switch_the_choice(router):
    store(router, "w0", [1, 2, 3, 4], prompt(64))
    store(router, "w1", [11, 12], prompt(32))
    assert router.find_matches(prompt(64)) == {
        "w0": (4, 64, 64.0), "w1": (2, 32, 32.0), "w2": (0, 0, 0.0)}
    d = router.select_worker(prompt(64))
    router.complete(d)
    assert d.worker == "w0"
    router.ingest("w0", ee.encode_batch([ee.removed([1])], era="map"))
    assert router.find_matches(prompt(64))["w0"].blocks == 0  # first block gone: no prefix
    d = router.select_worker(prompt(64), explain=False)
    router.complete(d)
    assert d.worker == "w1"
    router.ingest("w1", ee.encode_batch([ee.cleared()], era="array_full"))
    assert router.find_matches(prompt(64))["w1"].blocks == 0
    assert router.stats()["workers"]["w1"]["indexed_blocks"] == 0


def test_tier_weights_credit_cpu_and_disk(router):
    store(router, "w0", [1, 2], prompt(32), medium="CPU")
    store(router, "w1", [5, 6], prompt(32), medium="STORAGE")
    m = router.find_matches(prompt(32))
    assert m["w0"] == (2, 32, pytest.approx(32 * 0.8))
    assert m["w1"] == (2, 32, pytest.approx(32 * 0.25))


def test_greedy_affinity_is_bounded_by_load():
    """Everyone shares a system prompt held by w0; load must spread the requests."""
    r = Router([f"w{i}" for i in range(4)], block_size=BS, seed=3, speculative_ttl_s=0)
    system = list(range(1000, 1000 + 10 * BS))
    store(r, "w0", list(range(1, 11)), system)
    counts = {f"w{i}": 0 for i in range(4)}
    for i in range(40):
        toks = np.array(system + list(range(i * 1000, i * 1000 + 90 * BS)), dtype=np.uint32)
        counts[r.select_worker(toks).worker] += 1  # never completed: load accumulates
    assert max(counts.values()) < 40 and min(counts.values()) > 0, counts


def test_cache_weight_one_is_pure_affinity_zero_is_pure_load():
    r1 = Router(["a", "b"], block_size=BS, cache_weight=1.0, speculative_ttl_s=0)
    r0 = Router(["a", "b"], block_size=BS, cache_weight=0.0, speculative_ttl_s=0, seed=5)
    for r in (r1, r0):
        store(r, "b", [1, 2], prompt(32))
    assert {r1.select_worker(prompt(48)).worker for _ in range(10)} == {"b"}
    assert {r0.select_worker(prompt(48)).worker for _ in range(10)} == {"a", "b"}


def test_load_is_released_by_complete_and_first_token(router):
    store(router, "w0", [1], prompt(16))
    d = router.select_worker(prompt(48))
    w = router.stats()["workers"][d.worker]
    assert w["inflight_requests"] == 1 and w["pending_prefill_tokens"] == d.prefill_tokens == 32
    assert router.first_token(d)
    w = router.stats()["workers"][d.worker]
    assert w["inflight_requests"] == 1 and w["pending_prefill_tokens"] == 0
    assert router.complete(d) and not router.complete(d)
    assert router.stats()["workers"][d.worker]["inflight_requests"] == 0
    with router.route(prompt(48)) as d2:
        assert router.stats()["workers"][d2.worker]["inflight_requests"] == 1
    assert router.stats()["workers"][d2.worker]["inflight_requests"] == 0


def test_reported_load_steers_away(router):
    store(router, "w0", [1], prompt(16))
    store(router, "w1", [5], prompt(16))
    router.update_load("w0", num_requests_waiting=50, kv_cache_usage_perc=0.95)
    d = router.select_worker(prompt(32), explain=True)
    assert d.worker == "w1"
    assert {s.worker: s.load for s in d.scores}["w0"] == pytest.approx((1.0 + 0.95) / 3)


def test_size_aware_a_match_behind_a_longer_prefill_queue_counts_less():
    """size_aware: credit_w = 1 / (1 + excess pending prefill / prompt tokens): a worker
    holding 64 of 80 prompt tokens but with 20 prompts' worth more queued prefill loses to an
    idle cold one; without size_aware the match wins."""
    plain = Router(["a", "b"], block_size=BS, seed=1, speculative_ttl_s=0)
    store(plain, "a", [1, 2, 3, 4], prompt(64))
    for i in range(10):
        plain.select_worker(prompt(160, offset=10_000 + 1_000 * i), exclude=["b"])
    assert plain.select_worker(prompt(80)).worker == "a"
    plain.close()
    r = Router(["a", "b"], block_size=BS, seed=1, speculative_ttl_s=0,
               policy=KvAware(size_aware=True))
    store(r, "a", [1, 2, 3, 4], prompt(64))
    for i in range(10):  # 10 x 160 uncached tokens queued on a, never first-tokened
        r.select_worker(prompt(160, offset=10_000 + 1_000 * i), exclude=["b"])
    assert r.stats()["workers"]["a"]["pending_prefill_tokens"] == 1600
    d = r.select_worker(prompt(80), explain=True)
    assert d.worker == "b"
    by = {s.worker: s for s in d.scores}
    assert by["a"].match == pytest.approx((64 / 80) / (1 + 1600 / 80))
    assert by["b"].match == 0


def test_default_kv_aware_discounts_a_match_once_every_queue_is_long():
    """Default kv_aware: with a worker idle the match wins (the plain score); once every
    worker queues prefill (min / max 0.9) the size-aware terms weigh in with s = 0.9^6 and a
    match behind 1,600 more queued tokens (20 prompts' worth) loses to the shorter queue."""
    r = Router(["a", "b"], block_size=BS, seed=1, speculative_ttl_s=0)
    store(r, "a", [1, 2, 3, 4], prompt(64))
    for i in range(10):  # 10 x 1,600 uncached tokens on a, never first-tokened
        r.select_worker(prompt(1600, offset=10_000 + 2_000 * i), exclude=["b"])
    assert r.select_worker(prompt(80), dry_run=True).worker == "a"  # b idle
    for i in range(5):  # 5 x 2,880 on b
        r.select_worker(prompt(2880, offset=40_000 + 3_000 * i), exclude=["a"])
    st = r.stats()["workers"]
    assert (st["a"]["pending_prefill_tokens"], st["b"]["pending_prefill_tokens"]) == (16000, 14400)
    d = r.select_worker(prompt(80), explain=True)
    assert d.worker == "b"
    by = {s.worker: s for s in d.scores}
    assert by["a"].match == pytest.approx((64 / 80) / (1 + 0.9 ** 6 * 1600 / 80))
    r.close()


def test_speculative_insert_groups_a_burst_then_expires():
    r = Router(["a", "b", "c"], block_size=BS, speculative_ttl_s=0.3, seed=2)
    store(r, "c", [99], [7] * BS)  # any event: leave fallback mode
    new_prefix = prompt(20 * BS, offset=5000)
    first = r.select_worker(new_prefix)
    r.complete(first)
    second = r.select_worker(new_prefix)
    assert second.worker == first.worker and second.matched_blocks == 20
    assert r.stats()["speculative_entries"] == 20
    time.sleep(0.35)
    third = r.select_worker(prompt(BS, offset=90000))  # any decision expires old entries
    assert r.find_matches(new_prefix)[first.worker].blocks <= 1
    r.complete(second)
    r.complete(third)


def test_speculative_credit_is_held_until_the_first_token():
    """A request queued on its worker longer than the ttl keeps its credit: its blocks are not
    computed yet; the ttl runs from its first token (or its completion)."""
    r = Router(["a", "b", "c"], block_size=BS, speculative_ttl_s=0.2, seed=3)
    store(r, "c", [99], [7] * BS)
    queued = prompt(10 * BS, offset=7000)
    d = r.select_worker(queued)
    time.sleep(0.3)  # past the ttl, no first token yet
    r.select_worker(prompt(BS, offset=80000))  # a later decision: the clock moves on
    assert r.find_matches(queued)[d.worker].blocks == 10
    assert r.stats()["speculative_entries"] == 11
    r.first_token(d)
    assert r.find_matches(queued)[d.worker].blocks == 10  # the ttl has just started
    time.sleep(0.3)
    r.select_worker(prompt(BS, offset=90000))
    assert r.find_matches(queued)[d.worker].blocks == 0
    e = r.select_worker(prompt(4 * BS, offset=60000))
    r.complete(e)  # completion without a first token releases the credit too
    time.sleep(0.3)
    r.select_worker(prompt(BS, offset=95000))
    assert r.find_matches(prompt(4 * BS, offset=60000))[e.worker].blocks == 0


def test_confirming_store_makes_speculative_entry_permanent():
    r = Router(["a", "b"], block_size=BS, speculative_ttl_s=0.2)
    store(r, "b", [99], [7] * BS)
    p = prompt(2 * BS, offset=300)
    d = r.select_worker(p)
    store(r, d.worker, [41, 42], p)
    r.first_token(d)  # the credit's ttl starts
    time.sleep(0.25)
    r.select_worker(prompt(BS, offset=70000))
    assert r.find_matches(p)[d.worker] == (2, 32, 32.0)
    assert r.stats()["speculative_entries"] <= 1


def test_lora_and_salt_do_not_alias(router):
    store(router, "w0", [1, 2], prompt(32), lora_name="adapter-a")
    store(router, "w1", [3, 4], prompt(32), extra_keys=[("salt-x",), None])
    assert router.find_matches(prompt(32))["w0"].blocks == 0
    assert router.find_matches(prompt(32), lora_name="adapter-a")["w0"].blocks == 2
    assert router.find_matches(prompt(32), lora_name="adapter-b")["w0"].blocks == 0
    assert router.find_matches(prompt(32), cache_salt="salt-x")["w1"].blocks == 2
    assert router.find_matches(prompt(32))["w1"].blocks == 0


def test_apply_time_drops_are_counted_by_reason(router):
    router.ingest("w0", ee.encode_batch([ee.stored([1], None, list(range(64)), 64)], era="map"))
    router.ingest("w0", ee.encode_batch([ee.stored([1, 2], None, list(range(16)), 16)], era="map"))
    router.ingest("w0", ee.encode_batch(
        [ee.stored([3], None, list(range(16)), 16, kv_cache_spec_kind="sliding_window")],
        era="map"))
    router.ingest("w0", b"\x92\xc1")
    router.ingest("w0", ee.encode_batch([ee.stored([5], 12345, list(range(16)), 16)], era="map"))
    router.ingest("w0", ee.encode_batch([ee.removed([777])], era="map"))
    w = router.stats()["workers"]["w0"]
    assert w["dropped"] == {"block_size_mismatch": 1, "bad_token_count": 1,
                            "unsupported_spec": 1, "parse_error": 1}
    assert w["orphan_stores"] == 1 and w["unknown_removes"] == 1
    assert w["indexed_blocks"] == 0
    assert router.stats()["dropped"]["parse_error"] == 1


def test_sequence_gaps_backward_jumps_and_rank():
    r = Router([Worker("u", dp_rank=1)], block_size=BS)
    ok = ee.encode_batch([ee.cleared()], era="map", dp_rank=1)
    for seq in (0, 1, 2, 5, 6, 0):
        assert r.ingest("u|dp=1", ok, seq=seq)
    assert not r.ingest("u|dp=1", ee.encode_batch([ee.cleared()], era="map", dp_rank=0), seq=1)
    w = r.stats()["workers"]["u|dp=1"]
    assert (w["gaps"], w["missing_batches"], w["backward_jumps"]) == (1, 2, 1)
    assert w["last_seq"] == 1
    assert w["dropped"] == {"rank_mismatch": 1} and w["last_dp_rank"] == 1


def test_add_and_remove_workers(router):
    store(router, "w1", [1, 2], prompt(32))
    router.remove_worker("w1")
    assert "w1" not in router.find_matches(prompt(32))
    assert router.stats()["indexed_entries"] == 0
    router.add_worker(Worker("w9"))
    with pytest.raises(ValueError, match="duplicate"):
        router.add_worker("w9")
    assert [w.name for w in router.workers] == ["w0", "w2", "w9"]


def test_a_name_added_again_names_the_new_worker(router):
    # Calls that name a worker find it by name: after a remove, the name is unknown, and
    # once added again it is the new worker (empty), not the one removed.
    store(router, "w1", [1, 2], prompt(32))
    router.remove_worker("w1")
    with pytest.raises(KeyError, match="w1"):
        store(router, "w1", [3], prompt(16, offset=100))
    with pytest.raises(KeyError, match="w1"):
        router.update_load("w1", num_requests_waiting=1)
    router.add_worker("w1")
    assert router.find_matches(prompt(32))["w1"].blocks == 0
    store(router, "w1", [3], prompt(16, offset=100))
    assert router.find_matches(prompt(16, offset=100))["w1"].blocks == 1
    assert router.stats()["workers"]["w1"]["indexed_blocks"] == 1


def test_round_robin_cycles():
    r = Router(["a", "b", "c"], policy="round_robin")
    assert [r.select_worker([1]).worker for _ in range(6)] == ["a", "b", "c"] * 2


def test_close_is_idempotent(router):
    router.close()
    router.close()


def test_speculative_credit_follows_a_partly_shared_prefix():
    r = Router(["a", "b", "c"], block_size=BS, speculative_ttl_s=5, seed=4)
    store(r, "c", [99], [7] * BS)
    shared = list(range(9000, 9000 + 6 * BS))
    first = r.select_worker(np.array(shared + list(range(100, 100 + 4 * BS)), dtype=np.uint32),
                            now=1.0)
    other = np.array(shared + list(range(500, 500 + 4 * BS)), dtype=np.uint32)
    m = r.find_matches(other)
    assert m[first.worker].blocks == 6  # the run is credited as far as the prompts agree
    assert all(v.blocks == 0 for k, v in m.items() if k != first.worker)
    r.first_token(first)  # the ttl runs from the clock's latest value, 1.0
    r.select_worker(np.array([1] * BS, dtype=np.uint32), now=7.0)  # past the TTL
    assert r.find_matches(other)[first.worker].blocks == 0
    r.remove_worker(first.worker)
    assert r.stats()["speculative_entries"] == 1


def test_size_aware_is_read_from_the_policy_and_refuses_a_non_bool():
    with pytest.raises(ValueError, match="size_aware must be true or false"):
        KvAware(size_aware=1)
    assert KvAware().size_aware is False and KvAware(size_aware=True).params()["size_aware"]
