"""Model-based tests of the KV block index, driven end to end through the Python API.

Real engine payloads (``kvroute.wire.encode_batch``: vLLM map / last array era, SGLang array)
go in through ``Router.ingest``; ``Router.find_matches`` and ``Router.stats`` come out and are
compared with a small pure-Python reference model of cpp/index/index.{h,cc}:

* per worker: engine hash -> (content, per-tier reference counts [GPU, CPU, DISK]);
* the model cannot compute kvroute's xxh3 chain keys, so a block's *content* is the whole
  prefix it ends: ``(lora_name or "", tuple(tokens from token 0 through this block))``.
  Equal content <=> equal chain key (up to 64-bit collisions).

Rules of the model (docs/kv-events.md §6 and index.cc):
* BlockStored with a parent engine hash the worker does not hold: ignored, counted as
  ``orphan_stores`` (one per block); the chain continues from the parent's content otherwise
  (the event's lora_name only matters at the root).
* A run from token 0 (no parent) whose every block the worker holds with that content on that
  tier: a re-report (vLLM ``kv_cache_report_mode="full"``); nothing changes, nothing counted.
* Otherwise, same hash stored again with the same content: +1 reference on that tier. With
  other content: the old content is dropped entirely (every tier) and the hash rebinds
  (``hash_rebound``).
* CPU placeholder (``token_ids=[]``, ``block_size=0``): +1 reference on a hash already held;
  unknown hash -> ``orphan_stores``.
* BlockRemoved: -1 on (hash, tier); a hash not held on that tier -> ``unknown_removes``.
  A hash with no reference left on any tier is forgotten.
* AllBlocksCleared: the worker forgets everything.
* Prefix match: contiguous blocks from the first whose content the worker holds on some tier;
  weight per block = best tier's weight (GPU 1.0, CPU 0.8, DISK 0.25).

Hypothesis profiles: ``index-ci`` (default: 60 examples x 40 steps) and ``index-dev`` (1000 x
100, about 2 minutes), chosen by ``HYPOTHESIS_PROFILE=ci|dev`` like conftest.py's profiles and
applied to this module's tests only.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvroute  # noqa: E402
import kvroute.wire as E  # noqa: E402

# -- hypothesis profiles ---------------------------------------------------------------------
# Registered under module-local names so that conftest.py's global "ci"/"dev" are untouched;
# HYPOTHESIS_PROFILE=ci (default) / dev picks index-ci / index-dev, any other name is used as is.
_COMMON = dict(deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("index-ci", max_examples=60, stateful_step_count=40, **_COMMON)
settings.register_profile("index-dev", max_examples=1000, stateful_step_count=100, **_COMMON)
_PROFILE_NAME = os.environ.get("HYPOTHESIS_PROFILE", "ci")
PROFILE = settings.get_profile(
    f"index-{_PROFILE_NAME}" if _PROFILE_NAME in ("ci", "dev") else _PROFILE_NAME)

# -- constants -------------------------------------------------------------------------------
BS = 4
WORKERS = ("w0", "w1", "w2")
GPU, CPU, DISK = 0, 1, 2
TIER_WEIGHT = (1.0, 0.8, 0.25)
LORAS = ("ad-a", "ad-b")
HASH_FORMS = ("u64", "i64", "bin16", "bin32")
VLLM_ERAS = ("map", "array_full")
# Wire `medium` strings an engine family really sends for each tier (None = nil = GPU).
MEDIA = {
    "vllm": {GPU: ("GPU", None), CPU: ("CPU",), DISK: ("DISK",)},
    "sglang": {GPU: ("GPU", None), CPU: ("CPU_PINNED", "CPU_TIER1"), DISK: ("DISK", "EXTERNAL")},
}
COMMON_BLOCKS = ((0, 0, 0, 0), (1, 2, 3, 0), (3, 3, 1, 1))

# Mostly a few common blocks, so that prefixes collide across workers and adapters.
block_tokens = st.one_of(
    st.sampled_from(COMMON_BLOCKS),
    st.sampled_from(COMMON_BLOCKS),
    st.tuples(*[st.integers(0, 3)] * BS),
)


def mix(i: int) -> int:
    """Distinct, well-spread u64 ids (half have the top bit set: negative as SGLang int64)."""
    return (i * 0x9E3779B97F4A7C15 + 0x1234567) % (1 << 64)


# -- reference model -------------------------------------------------------------------------
Content = tuple  # (lora_name or "", tokens tuple from token 0 through the block)


class WorkerModel:
    def __init__(self) -> None:
        self.blocks: dict[int, list] = {}  # engine hash id -> [content, [gpu, cpu, disk]]
        self.counts: Counter = Counter()

    def store(self, ids: list[int], parent: Optional[int], tokens: list[int], tier: int,
              lora: Optional[str]) -> None:
        if parent is not None and parent not in self.blocks:
            self.counts["orphan_stores"] += len(ids)
            return
        lora0, prefix = self.blocks[parent][0] if parent is not None else (lora or "", ())
        contents = []
        for i in range(len(ids)):
            prefix = prefix + tuple(tokens[i * BS:(i + 1) * BS])
            contents.append((lora0, prefix))
        if parent is None and ids and all(
                h in self.blocks and self.blocks[h][0] == c and self.blocks[h][1][tier] > 0
                for h, c in zip(ids, contents)):
            return  # a re-report of held blocks (vLLM kv_cache_report_mode "full")
        for h, content in zip(ids, contents):
            e = self.blocks.get(h)
            if e is not None and e[0] != content:
                self.counts["hash_rebound"] += 1
                e = None
            if e is None:
                e = self.blocks[h] = [content, [0, 0, 0]]
            e[1][tier] += 1
            self.counts["blocks_stored"] += 1

    def placeholder(self, ids: list[int], tier: int) -> None:
        for h in ids:
            e = self.blocks.get(h)
            if e is None:
                self.counts["orphan_stores"] += 1
                continue
            e[1][tier] += 1
            self.counts["blocks_stored"] += 1

    def remove(self, ids: list[int], tier: int) -> None:
        for h in ids:
            e = self.blocks.get(h)
            if e is None or e[1][tier] == 0:
                self.counts["unknown_removes"] += 1
                continue
            e[1][tier] -= 1
            self.counts["blocks_removed"] += 1
            if not any(e[1]):
                del self.blocks[h]

    def clear(self) -> None:
        self.counts["clears"] += 1
        self.blocks.clear()

    def tiers_by_content(self) -> dict[Content, set]:
        out: dict[Content, set] = {}
        for content, refs in self.blocks.values():
            out.setdefault(content, set()).update(t for t in range(3) if refs[t] > 0)
        return out

    def hash_of(self, content: Content) -> Optional[int]:
        for h, (c, _) in self.blocks.items():
            if c == content:
                return h
        return None

    def match(self, tokens, lora: Optional[str]) -> tuple[int, float]:
        tiers = self.tiers_by_content()
        n, weighted = 0, 0.0
        for i in range(len(tokens) // BS):
            t = tiers.get((lora or "", tuple(tokens[:(i + 1) * BS])))
            if not t:
                break
            n += 1
            weighted += TIER_WEIGHT[GPU] if GPU in t else max(TIER_WEIGHT[x] for x in t)
        return n, weighted


# -- abstract events -> wire -----------------------------------------------------------------
# ("store", ids, parent_id, tokens, tier, lora) | ("placeholder", ids, tier)
# | ("remove", ids, tier) | ("clear",)


def apply_model(m: WorkerModel, ev: tuple) -> None:
    kind = ev[0]
    if kind == "store":
        m.store(*ev[1:])
    elif kind == "placeholder":
        m.placeholder(*ev[1:])
    elif kind == "remove":
        m.remove(*ev[1:])
    else:
        m.clear()


def needs_vllm(ev: tuple) -> bool:
    return (ev[0] == "store" and ev[5] is not None) or ev[0] == "placeholder"


def to_wire(ev: tuple, form: str, era: str, medium: Optional[str]):
    def h(i):
        return E.as_hash(i, form)

    kind = ev[0]
    if kind == "store":
        _, ids, parent, tokens, _, lora = ev
        return E.stored([h(i) for i in ids], None if parent is None else h(parent), list(tokens),
                        BS, medium=medium, lora_name=lora)
    if kind == "placeholder":
        return E.stored([h(i) for i in ev[1]], None, [], 0, medium=medium)
    if kind == "remove":
        return E.removed([h(i) for i in ev[1]], medium)
    return E.cleared()


def check_matches(router: kvroute.Router, models: dict, tokens, lora: Optional[str]) -> None:
    got = router.find_matches(list(tokens), lora_name=lora)
    assert set(got) == set(models)
    for w, m in models.items():
        blocks, weighted = m.match(tokens, lora)
        exp = (blocks, blocks * BS, pytest.approx(weighted * BS, rel=1e-12, abs=1e-12))
        assert tuple(got[w]) == exp, (w, list(tokens), lora, got[w], exp)


COUNTERS = ("orphan_stores", "hash_rebound", "unknown_removes", "blocks_stored",
            "blocks_removed", "clears")


def check_stats(router: kvroute.Router, models: dict) -> None:
    s = router.stats()
    for w, m in models.items():
        ws = s["workers"][w]
        assert ws["indexed_blocks"] == len(m.blocks), w
        for c in COUNTERS:
            assert ws[c] == m.counts[c], (w, c, ws[c], m.counts[c])
        assert ws["dropped"] == {}, (w, ws["dropped"])
        assert ws["unknown_medium"] == 0
    per_worker = [set(m.tiers_by_content()) for m in models.values()]
    assert s["distinct_block_keys"] == len(set().union(*per_worker))
    assert s["indexed_entries"] == sum(len(k) for k in per_worker)
    assert s["speculative_entries"] == 0


# -- the state machine -----------------------------------------------------------------------
class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.router = kvroute.Router(list(WORKERS), block_size=BS, speculative_ttl_s=0)
        self.models = {w: WorkerModel() for w in WORKERS}
        self.forms = {w: "u64" for w in WORKERS}
        self._next = 0

    def teardown(self) -> None:
        self.router.close()

    # helpers
    def fresh(self) -> int:
        self._next += 1
        return mix(self._next)

    def held(self, w: str) -> list[int]:
        return sorted(self.models[w].blocks)

    def all_contents(self) -> list[Content]:
        return sorted(set().union(*(m.tiers_by_content() for m in self.models.values())))

    def pick_ids(self, w: str, n: int, data) -> list[int]:
        """Mostly fresh hashes; sometimes one the worker holds (duplicate or rebind)."""
        held = self.held(w)
        ids = []
        for _ in range(n):
            if held and data.draw(st.integers(0, 4), label="reuse") == 0:
                ids.append(data.draw(st.sampled_from(held), label="reused id"))
            else:
                ids.append(self.fresh())
        return ids

    def content_store(self, w: str, content: Content, last_id: int, tier: int) -> tuple:
        """A store whose last block is `content` under `last_id`, chained from the longest
        proper prefix the worker holds (fresh hashes for any missing ancestors)."""
        lora, toks = content
        m = self.models[w]
        nblk = len(toks) // BS
        parent, start = None, 0
        for j in range(nblk - 1, 0, -1):
            p = m.hash_of((lora, toks[:j * BS]))
            if p is not None:
                parent, start = p, j
                break
        ids = [self.fresh() for _ in range(start, nblk - 1)] + [last_id]
        return ("store", ids, parent, list(toks[start * BS:]), tier, lora or None)

    def send(self, w: str, events: list[tuple], data) -> None:
        eras = list(VLLM_ERAS)
        if self.forms[w] == "i64" and not any(needs_vllm(ev) for ev in events):
            eras.append("sglang")
        era = data.draw(st.sampled_from(eras), label="era")
        family = "sglang" if era == "sglang" else "vllm"
        wire = []
        for ev in events:
            medium = None
            if ev[0] in ("store", "placeholder", "remove"):
                tier = ev[-1] if ev[0] != "store" else ev[4]
                medium = data.draw(st.sampled_from(MEDIA[family][tier]), label="medium")
            wire.append(to_wire(ev, self.forms[w], era, medium))
        note(f"{w} <- {era}: {events}")
        assert self.router.ingest(w, E.encode_batch(wire, era=era)) is True
        for ev in events:
            apply_model(self.models[w], ev)

    # setup
    @initialize(forms=st.tuples(*[st.sampled_from(HASH_FORMS)] * len(WORKERS)))
    def choose_hash_forms(self, forms) -> None:
        self.forms = dict(zip(WORKERS, forms))
        note(f"hash forms: {self.forms}")

    # stores
    @rule(w=st.sampled_from(WORKERS), blocks=st.lists(block_tokens, min_size=1, max_size=4),
          tier=st.sampled_from([GPU, GPU, GPU, CPU, DISK]),
          lora=st.sampled_from([None, None, *LORAS]), data=st.data())
    def store_from_root(self, w, blocks, tier, lora, data) -> None:
        ids = self.pick_ids(w, len(blocks), data)
        tokens = [t for b in blocks for t in b]
        self.send(w, [("store", ids, None, tokens, tier, lora)], data)

    @precondition(lambda self: any(m.blocks for m in self.models.values()))
    @rule(blocks=st.lists(block_tokens, min_size=1, max_size=4),
          tier=st.sampled_from([GPU, GPU, GPU, CPU, DISK]), data=st.data())
    def store_extending(self, blocks, tier, data) -> None:
        w = data.draw(st.sampled_from([w for w in WORKERS if self.models[w].blocks]), label="w")
        parent = data.draw(st.sampled_from(self.held(w)), label="parent")
        lora = self.models[w].blocks[parent][0][0] or None  # engines resend the request's lora
        ids = self.pick_ids(w, len(blocks), data)
        tokens = [t for b in blocks for t in b]
        self.send(w, [("store", ids, parent, tokens, tier, lora)], data)

    @rule(w=st.sampled_from(WORKERS), blocks=st.lists(block_tokens, min_size=1, max_size=3),
          data=st.data())
    def store_orphan(self, w, blocks, data) -> None:
        ids = [self.fresh() for _ in blocks]
        tokens = [t for b in blocks for t in b]
        self.send(w, [("store", ids, self.fresh(), tokens, GPU, None)], data)

    @precondition(lambda self: any(m.blocks for m in self.models.values()))
    @rule(tier=st.sampled_from([GPU, CPU, DISK]), data=st.data())
    def store_same_hash_again(self, tier, data) -> None:
        """Duplicate store (same tier) or a store on another tier of a held hash."""
        w = data.draw(st.sampled_from([w for w in WORKERS if self.models[w].blocks]), label="w")
        h = data.draw(st.sampled_from(self.held(w)), label="hash")
        content = self.models[w].blocks[h][0]
        self.send(w, [self.content_store(w, content, h, tier)], data)

    @precondition(lambda self: any(m.blocks for m in self.models.values()))
    @rule(tier=st.sampled_from([CPU, DISK]), data=st.data())
    def store_placeholder(self, tier, data) -> None:
        """Older vLLM CPU offloading: a tier update by engine hash (some unknown)."""
        w = data.draw(st.sampled_from([w for w in WORKERS if self.models[w].blocks]), label="w")
        ids = data.draw(st.lists(st.one_of(st.sampled_from(self.held(w)), st.builds(self.fresh)),
                                 min_size=1, max_size=3), label="ids")
        self.send(w, [("placeholder", ids, tier)], data)

    @precondition(lambda self: any(m.blocks for m in self.models.values()))
    @rule(w=st.sampled_from(WORKERS), tier=st.sampled_from([GPU, GPU, CPU, DISK]),
          data=st.data())
    def store_prefix_held_elsewhere(self, w, tier, data) -> None:
        """Worker w caches a prefix some worker already holds (cross-worker collisions)."""
        content = data.draw(st.sampled_from(self.all_contents()), label="content")
        self.send(w, [self.content_store(w, content, self.fresh(), tier)], data)

    # removes / clears
    @precondition(lambda self: any(m.blocks for m in self.models.values()))
    @rule(data=st.data())
    def remove_blocks(self, data) -> None:
        w = data.draw(st.sampled_from([w for w in WORKERS if self.models[w].blocks]), label="w")
        m = self.models[w]
        ids = data.draw(st.lists(st.one_of(st.sampled_from(self.held(w)), st.builds(self.fresh)),
                                 min_size=1, max_size=4), label="ids")
        held_tiers = sorted({t for i in ids if i in m.blocks for t in range(3)
                             if m.blocks[i][1][t]})
        tier = data.draw(st.sampled_from(held_tiers) if held_tiers and data.draw(st.booleans())
                         else st.sampled_from([GPU, CPU, DISK]), label="tier")
        self.send(w, [("remove", ids, tier)], data)

    @rule(w=st.sampled_from(WORKERS), then_store=st.one_of(st.none(), block_tokens),
          data=st.data())
    def clear_worker(self, w, then_store, data) -> None:
        events: list[tuple] = [("clear",)]
        if then_store is not None:  # same batch: the store after the clear survives
            events.append(("store", [self.fresh()], None, list(then_store), GPU, None))
        self.send(w, events, data)

    # lookups
    @rule(suffix=st.lists(st.integers(0, 3), max_size=9), data=st.data())
    def lookup(self, suffix, data) -> None:
        contents = self.all_contents()
        if contents and data.draw(st.integers(0, 4), label="random prompt") > 0:
            lora, prefix = data.draw(st.sampled_from(contents), label="prefix")
        else:
            lora, prefix = "", ()
        tokens = list(prefix) + suffix
        other = data.draw(st.sampled_from([lora, lora, *(x for x in ("", *LORAS) if x != lora)]),
                          label="lora")
        check_matches(self.router, self.models, tokens, other or None)
        if other != lora and prefix:
            # The same tokens under another adapter match only what was stored under it.
            held_other = any(m.tiers_by_content().get((other, tuple(tokens[:BS])))
                             for m in self.models.values())
            if not held_other:
                got = self.router.find_matches(tokens, lora_name=other or None)
                assert all(x.blocks == 0 for x in got.values())

    @precondition(lambda self: any(m.blocks for m in self.models.values()))
    @rule()
    def lookup_every_held_prefix(self) -> None:
        for lora, toks in self.all_contents():
            check_matches(self.router, self.models, toks, lora or None)

    @invariant()
    def stats_agree(self) -> None:
        check_stats(self.router, self.models)


IndexMachine.TestCase.settings = PROFILE
TestIndexStateMachine = IndexMachine.TestCase


# -- example-based tests ---------------------------------------------------------------------
T8 = [1, 2, 3, 0, 0, 1, 2, 3]


@pytest.fixture
def router():
    r = kvroute.Router(list(WORKERS), block_size=BS, speculative_ttl_s=0)
    yield r
    r.close()


def ingest(router, w, events, era="map"):
    assert router.ingest(w, E.encode_batch(events, era=era)) is True


def match(router, tokens, w="w0", lora=None):
    return router.find_matches(tokens, lora_name=lora)[w]


@pytest.mark.parametrize("era,form", [("map", "u64"), ("array_full", "bin32"), ("sglang", "i64"),
                                      ("map", "bin16")])
def test_duplicate_store_then_single_remove_keeps_block(router, era, form):
    """A block filled twice at once (two copies, a continuation stored twice) needs two
    removes."""
    h = [E.as_hash(mix(1), form), E.as_hash(mix(2), form)]
    ingest(router, "w0", [E.stored(h[:1], None, T8[:BS], BS)], era)
    ingest(router, "w0", [E.stored(h[1:], h[0], T8[BS:], BS)], era)
    ingest(router, "w0", [E.stored(h[1:], h[0], T8[BS:], BS)], era)  # vLLM did not de-duplicate
    assert match(router, T8) == (2, 8, 8.0)
    ingest(router, "w0", [E.removed([h[1]])], era)
    assert match(router, T8) == (2, 8, 8.0)
    assert router.stats()["workers"]["w0"]["indexed_blocks"] == 2
    ingest(router, "w0", [E.removed([h[1]])], era)
    assert match(router, T8) == (1, 4, 4.0)
    ingest(router, "w0", [E.removed([h[1]])], era)  # nothing left on that hash
    ws = router.stats()["workers"]["w0"]
    assert (ws["indexed_blocks"], ws["unknown_removes"], ws["blocks_removed"]) == (1, 1, 2)


@pytest.mark.parametrize("era,form", [("map", "u64"), ("array_full", "bin32"), ("sglang", "i64")])
def test_rereported_prefix_adds_no_reference(router, era, form):
    """vLLM's kv_cache_report_mode "full" re-sends a prefix hit as a store from token 0 of
    blocks the worker holds: no new reference, so one remove per block evicts it."""
    h = [E.as_hash(mix(1), form), E.as_hash(mix(2), form)]
    ingest(router, "w0", [E.stored(h, None, T8, BS)], era)
    ingest(router, "w0", [E.stored(h, None, T8, BS)], era)  # re-report
    ingest(router, "w0", [E.stored(h[:1], None, T8[:BS], BS)], era)  # a shorter hit
    assert match(router, T8) == (2, 8, 8.0)
    ingest(router, "w0", [E.removed([h[1]])], era)
    assert match(router, T8) == (1, 4, 4.0)
    ingest(router, "w0", [E.removed([h[0]])], era)
    ws = router.stats()["workers"]["w0"]
    assert (ws["indexed_blocks"], ws["unknown_removes"], ws["blocks_stored"]) == (0, 0, 2)
    # Not a re-report: a run from token 0 of which a block is new adds a reference each.
    ingest(router, "w0", [E.stored(h[:1], None, T8[:BS], BS)], era)
    ingest(router, "w0", [E.stored(h, None, T8, BS)], era)
    ingest(router, "w0", [E.removed([h[0]])], era)
    assert match(router, T8) == (2, 8, 8.0)


@pytest.mark.parametrize("era,cpu",
                         [("map", "CPU"), ("array_full", "CPU"), ("sglang", "CPU_PINNED")])
def test_gpu_and_cpu_tiers_then_gpu_remove_leaves_cpu_weight(router, era, cpu):
    h = [E.as_hash(mix(1), "i64"), E.as_hash(mix(2), "i64")]
    ingest(router, "w0", [E.stored(h, None, T8, BS, medium="GPU")], era)
    ingest(router, "w0", [E.stored(h, None, T8, BS, medium=cpu)], era)
    assert match(router, T8) == (2, 8, 8.0)
    ingest(router, "w0", [E.removed(h, "GPU")], era)
    got = match(router, T8)
    assert (got.blocks, got.tokens) == (2, 8)
    assert got.weighted_tokens == pytest.approx(2 * 4 * 0.8)
    ingest(router, "w0", [E.removed([h[0]], "GPU")], era)  # wrong tier now: unknown remove
    ws = router.stats()["workers"]["w0"]
    assert (ws["indexed_blocks"], ws["unknown_removes"]) == (2, 1)
    ingest(router, "w0", [E.stored([h[1]], h[0], T8[4:], BS, medium="DISK")], era)
    assert match(router, T8).weighted_tokens == pytest.approx(4 * 0.8 + 4 * 0.8)  # best tier
    ingest(router, "w0", [E.removed([h[1]], cpu)], era)
    assert match(router, T8).weighted_tokens == pytest.approx(4 * 0.8 + 4 * 0.25)
    ingest(router, "w0", [E.removed([h[1]], "DISK")], era)
    assert match(router, T8) == (1, 4, pytest.approx(4 * 0.8))


def test_cpu_placeholder_is_a_tier_update_by_hash(router):
    ingest(router, "w0", [E.stored([mix(1), mix(2)], None, T8, BS)])
    ingest(router, "w0", [E.stored([mix(2), mix(9)], None, [], 0, medium="CPU")], "array_full")
    ws = router.stats()["workers"]["w0"]
    assert (ws["orphan_stores"], ws["blocks_stored"], ws["indexed_blocks"]) == (1, 3, 2)
    ingest(router, "w0", [E.removed([mix(2)], "GPU")])
    assert match(router, T8) == (2, 8, pytest.approx(4 + 4 * 0.8))


@pytest.mark.parametrize("form", HASH_FORMS)
def test_orphan_store_is_counted_not_indexed(router, form):
    ingest(router, "w1", [E.stored([E.as_hash(mix(5), form), E.as_hash(mix(6), form)],
                                   E.as_hash(mix(4), form), T8, BS)])
    ws = router.stats()["workers"]["w1"]
    assert (ws["orphan_stores"], ws["indexed_blocks"], ws["blocks_stored"]) == (2, 0, 0)
    assert all(m.blocks == 0 for m in router.find_matches(T8 * 2).values())
    # Its children are orphans too: the parent never became known.
    ingest(router, "w1", [E.stored([E.as_hash(mix(7), form)], E.as_hash(mix(6), form), T8[:4], BS)])
    assert router.stats()["workers"]["w1"]["orphan_stores"] == 3


def test_hash_rebound_drops_old_content_on_every_tier(router):
    a, b = [0, 0, 0, 0], [3, 3, 3, 3]
    ingest(router, "w2", [E.stored([mix(1)], None, a, BS)])
    ingest(router, "w2", [E.stored([mix(1)], None, a, BS)])
    ingest(router, "w2", [E.stored([mix(1)], None, a, BS, medium="CPU")])
    ingest(router, "w2", [E.stored([mix(1)], None, b, BS, medium="DISK")])  # rebind
    ws = router.stats()["workers"]["w2"]
    assert (ws["hash_rebound"], ws["indexed_blocks"]) == (1, 1)
    assert match(router, a, "w2") == (0, 0, 0.0)
    assert match(router, b, "w2") == (1, 4, pytest.approx(1.0))
    s = router.stats()
    assert (s["distinct_block_keys"], s["indexed_entries"]) == (1, 1)
    ingest(router, "w2", [E.removed([mix(1)], "DISK")])
    assert router.stats()["workers"]["w2"]["indexed_blocks"] == 0
    assert router.stats()["distinct_block_keys"] == 0


def test_rebind_of_the_parent_inside_its_own_extension(router):
    ingest(router, "w0", [E.stored([mix(1)], None, T8[:4], BS)])
    ingest(router, "w0", [E.stored([mix(1)], mix(1), T8[4:], BS)])  # chains from old content
    assert match(router, T8) == (0, 0, 0.0)
    assert router.stats()["workers"]["w0"]["hash_rebound"] == 1
    ingest(router, "w0", [E.stored([mix(2)], None, T8[:4], BS)])
    assert match(router, T8) == (2, 8, 8.0)


@pytest.mark.parametrize("era", VLLM_ERAS)
def test_lora_keys_never_alias(router, era):
    ingest(router, "w0", [E.stored([mix(1), mix(2)], None, T8, BS, lora_name="ad-a")], era)
    ingest(router, "w1", [E.stored([mix(1), mix(2)], None, T8, BS)], era)
    # an extension inherits the parent's adapter whatever its own lora_name says
    ingest(router, "w0", [E.stored([mix(3)], mix(2), T8[:4], BS, lora_name="ad-a")], era)
    got = router.find_matches(T8 + T8[:4], lora_name="ad-a")
    assert (got["w0"].blocks, got["w1"].blocks) == (3, 0)
    got = router.find_matches(T8 + T8[:4])
    assert (got["w0"].blocks, got["w1"].blocks) == (0, 2)
    assert all(m.blocks == 0 for m in router.find_matches(T8, lora_name="ad-b").values())


def test_clear_drops_only_that_worker(router):
    for w in ("w0", "w1"):
        ingest(router, w, [E.stored([mix(1), mix(2)], None, T8, BS)])
    ingest(router, "w0", [E.cleared(), E.stored([mix(3)], None, T8[:4], BS, medium="DISK")])
    got = router.find_matches(T8)
    assert (got["w0"].blocks, got["w1"].blocks) == (1, 2)
    assert got["w0"].weighted_tokens == pytest.approx(1.0)
    ws = router.stats()["workers"]["w0"]
    assert (ws["clears"], ws["indexed_blocks"]) == (1, 1)
    ingest(router, "w0", [E.removed([mix(1)])])  # forgotten by the clear
    assert router.stats()["workers"]["w0"]["unknown_removes"] == 1


@settings(PROFILE, max_examples=min(PROFILE.max_examples, 40))
@given(seqs=st.lists(st.lists(block_tokens, min_size=1, max_size=4), min_size=1, max_size=5),
       prompt=st.lists(st.integers(0, 3), max_size=20))
def test_root_stores_match_model(seqs, prompt):
    """Stateless cross-check: independent root runs on one worker vs the model."""
    r = kvroute.Router(list(WORKERS), block_size=BS, speculative_ttl_s=0)
    try:
        m = {w: WorkerModel() for w in WORKERS}
        n = 0
        for blocks in seqs:
            ids = [mix(n + i) for i in range(len(blocks))]
            n += len(blocks)
            toks = [t for b in blocks for t in b]
            ingest(r, "w0", [E.stored(ids, None, toks, BS)])
            m["w0"].store(ids, None, toks, GPU, None)
        check_matches(r, m, prompt, None)
        for blocks in seqs:
            check_matches(r, m, [t for b in blocks for t in b], None)
        check_stats(r, m)
    finally:
        r.close()


def test_two_hashes_same_content_refcounts_do_not_drift():
    """Regression: holder counts and engine-hash counts once saturated separately, so a worker
    holding one content under two engine hashes lost it while references remained."""
    r = kvroute.Router(["w0"], block_size=4, speculative_ttl_s=0)
    a = [1, 2, 3, 0]

    def ing(evs, era="map"):
        r.ingest("w0", E.encode_batch(evs, era=era))

    ing([E.stored([101], None, a, 4, medium="CPU")])
    ing([E.stored([102], None, a, 4, medium="CPU")])
    ing([E.stored([101] * 40000, None, [], 0, medium="CPU")], "array_full")
    ing([E.stored([102] * 40000, None, [], 0, medium="CPU")], "array_full")
    ing([E.removed([101] * 40001, "CPU")])
    ing([E.removed([102] * 30000, "CPU")])
    assert r.find_matches(a)["w0"] == (1, 4, pytest.approx(3.2))
    ing([E.removed([102] * 10001, "CPU")])
    assert r.find_matches(a)["w0"].blocks == 0
    assert r.stats()["workers"]["w0"]["indexed_blocks"] == 0
