"""Prefix matching over many workers, speculative credits included, against a plain model.

`Index::FindMatches` walks runs of blocks held by the same (worker, tiers) set and touches the
holders once per run, and closes runs wherever a speculative credit moves a worker ahead. This
test checks it against the definition, block by block, per worker:

* depth starts at 0; at block i, a worker that holds block i on some tier advances by one
  (credit: tier weight of GPU if held there, else the better of CPU and disk);
* else, an unexpired speculative run of that worker whose first key is block i's key advances
  it by the length of the common prefix of the run and the prompt's keys from i (GPU credit);
* else the worker stops.

Prompts are drawn from a 3-letter alphabet of block contents, so many prompts share prefixes
and many workers hold the same runs of blocks (the case the run-length walk skips through).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute
import kvroute.wire as W

BS = 4
WORKERS = [f"w{i}" for i in range(5)]
TIERS = ["GPU", "CPU", "DISK"]
WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.25}
LETTERS = [np.arange(BS, dtype=np.uint32) + 100 * (c + 1) for c in range(3)]

prompt_st = st.lists(st.integers(0, 2), min_size=1, max_size=7)


def tokens_of(prompt: list[int]) -> np.ndarray:
    return np.concatenate([LETTERS[c] for c in prompt])


op_st = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 4), prompt_st, st.sampled_from(TIERS)),
    st.tuples(st.just("remove"), st.integers(0, 4), prompt_st, st.sampled_from(TIERS)),
    st.tuples(st.just("select"), st.integers(0, 4), prompt_st, st.floats(0.0, 3.0)),
)


class Model:
    def __init__(self) -> None:
        self.refs: dict[tuple[str, int], dict[str, int]] = {}  # (worker, key) -> tier refs
        self.spec: list[tuple[str, list[int], float]] = []      # (worker, keys, expiry)
        self.now = 0.0

    def weight(self, w: str, key: int) -> float:
        r = self.refs.get((w, key), {})
        if r.get("GPU", 0) > 0:
            return 1.0
        return max([WEIGHTS[t] for t in ("CPU", "DISK") if r.get(t, 0) > 0], default=0.0)

    def holds(self, w: str, key: int) -> bool:
        return any(v > 0 for v in self.refs.get((w, key), {}).values())

    def match(self, keys: list[int]) -> dict[str, tuple[int, float]]:
        out = {}
        for w in WORKERS:
            i, wt = 0, 0.0
            while i < len(keys):
                if self.holds(w, keys[i]):
                    wt += self.weight(w, keys[i])
                    i += 1
                    continue
                best = 0
                for sw, sk, exp in self.spec:
                    if sw != w or exp <= self.now or sk[0] != keys[i]:
                        continue
                    m = 0
                    while m < len(sk) and i + m < len(keys) and sk[m] == keys[i + m]:
                        m += 1
                    best = max(best, m)
                if best == 0:
                    break
                i += best
                wt += best
            out[w] = (i, wt)
        return out


@settings(max_examples=150, deadline=None)
@given(st.lists(op_st, min_size=1, max_size=40), st.lists(prompt_st, min_size=1, max_size=4))
def test_find_matches_equals_the_per_block_definition(ops, probes):
    r = kvroute.Router(WORKERS, block_size=BS, speculative_ttl_s=1.0, policy="kv_aware",
                       cache_weight=1.0)
    m = Model()
    now = 0.0
    # One engine hash per (worker, prefix): the worker's own block identity.
    hashes: dict[tuple[str, tuple[int, ...]], int] = {}

    def h(w: str, prefix: tuple[int, ...]) -> int:
        return hashes.setdefault((w, prefix), len(hashes) + 1)

    for op in ops:
        kind, wi, prompt, arg = op
        w = WORKERS[wi]
        keys = [int(k) for k in kvroute.block_keys(tokens_of(prompt), BS)]
        if kind == "store":
            ids = [h(w, tuple(prompt[:j + 1])) for j in range(len(prompt))]
            r.ingest(w, W.encode_batch([W.stored(ids, None, [int(t) for t in tokens_of(prompt)],
                                                 BS, medium=arg)]))
            if all(m.refs.get((w, k), {}).get(arg, 0) > 0 for k in keys):
                continue  # a run from token 0 held on this tier: a re-report, no reference
            for k in keys:
                m.refs.setdefault((w, k), {}).setdefault(arg, 0)
                m.refs[(w, k)][arg] += 1
        elif kind == "remove":
            prefix = tuple(prompt)
            if (w, prefix) not in hashes:
                continue
            r.ingest(w, W.encode_batch([W.removed([hashes[(w, prefix)]], medium=arg)]))
            ref = m.refs.get((w, keys[-1]), {})
            if ref.get(arg, 0) > 0:
                ref[arg] -= 1
        else:  # a decision: the chosen worker is credited with the blocks it lacks (only
            # when the index decided: the fallback before any event inserts nothing)
            now += arg
            d = r.select_worker(tokens_of(prompt), now=now)
            if d.policy == "kv_aware" and d.matched_blocks < len(keys):  # not the fallback
                m.spec.append((d.worker, keys[d.matched_blocks:], now + 1.0))
                m.now = now  # find_matches' clock: the latest one a credit was given with
            r.complete(d)
    for probe in probes:
        keys = [int(k) for k in kvroute.block_keys(tokens_of(probe), BS)]
        got = r.find_matches(tokens_of(probe))
        want = m.match(keys)
        for w in WORKERS:
            assert got[w].blocks == want[w][0], (w, probe)
            assert abs(got[w].weighted_tokens - want[w][1] * BS) < 1e-6, (w, probe)


def test_a_speculative_credit_ending_inside_a_run_of_shared_blocks():
    # A and B hold the same 6 blocks except A lost block 1; A is credited with blocks 1-2 by
    # a decision. Blocks 2-5 are one run of {A, B}; A must rejoin it at block 3, where its
    # credit ends (a walk that keeps the run open from block 2 would leave A at 3 blocks).
    a, b = "http://a", "http://b"
    r = kvroute.Router([a, b], block_size=BS, speculative_ttl_s=10.0, cache_weight=1.0)
    prompt = [0, 1, 2, 0, 1, 2]
    toks = [int(t) for t in tokens_of(prompt)]
    for w, base in ((a, 100), (b, 200)):
        r.ingest(w, W.encode_batch([W.stored([base + j for j in range(6)], None, toks, BS)]))
    r.ingest(a, W.encode_batch([W.removed([101])]))
    d = r.select_worker(tokens_of(prompt[:3]), exclude=[b], now=1.0)
    assert (d.worker, d.matched_blocks) == (a, 1)  # credited with blocks 1 and 2
    got = r.find_matches(tokens_of(prompt))
    assert got[a].blocks == 6 and got[b].blocks == 6
    assert got[a].weighted_tokens == 6 * BS
    r.complete(d)
    # After the credit expires, A stops at the hole.
    r.select_worker(tokens_of([2, 2, 2]), now=20.0)
    assert r.find_matches(tokens_of(prompt))[a].blocks == 1
