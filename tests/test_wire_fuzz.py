"""Hypothesis-generated wire batches: every encoding and hash form, plus truncations and
wrong types. Nothing may raise; valid events must be applied; bad parts are counted."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute
import kvroute.wire as W

BS = 4
ERAS = ["map", "array_full", "mapbatch", "sglang", "sglang_map", "legacy2", "array"]
FORMS = ["u64", "i64", "bin16", "bin32"]


@st.composite
def batches(draw):
    """(era, form, events, runs): runs = [token list, blocks expected to match] of every run
    stored from the root since the last clear; a removal of one of a run's GPU blocks cuts
    its expected match there."""
    era = draw(st.sampled_from(ERAS))
    form = draw(st.sampled_from(["i64", "u64"] if era.startswith("sglang") else FORMS))
    n_events = draw(st.integers(0, 6))
    events, runs, next_hash = [], [], draw(st.integers(1, 2**62))
    stored = []  # (hash, run index, block index, medium) since the last clear
    for _ in range(n_events):
        kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared"]))
        if kind == "stored":
            n = draw(st.integers(1, 4))
            toks = draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * BS, max_size=n * BS))
            toks[0] = 4_000_000_000 + next_hash % 1000  # runs never share a block key (the
            # model cuts a run at a removed block; a twin run would still hold it)
            hashes = [W.as_hash(next_hash + i, form) for i in range(n)]
            medium = None if era == "legacy2" else draw(st.sampled_from(["GPU", "CPU", None]))
            stored += [(next_hash + i, len(runs), i, medium) for i in range(n)]
            next_hash += n
            events.append(W.stored(hashes, None, toks, BS, medium=medium,
                                   kv_cache_spec_kind=None, group_idx=None))
            runs.append([toks, n])
        elif kind == "removed":
            medium = None if era == "legacy2" else "GPU"
            if stored and draw(st.booleans()):  # one of the stored blocks
                h, run, block, m = draw(st.sampled_from(stored))
                if m in (None, "GPU"):  # a GPU removal does not touch a CPU copy
                    runs[run][1] = min(runs[run][1], block)
            else:  # a hash never stored (above every stored one): counted, nothing changes
                h = draw(st.integers(2**62 + 32, 2**63 - 1))
            events.append(W.removed([W.as_hash(h, form)], medium, group_idx=None))
        else:
            events.append(W.cleared())
            runs.clear()
            stored.clear()
    return era, form, events, runs


@settings(max_examples=150)
@given(batches())
def test_valid_batches_decode_and_apply(b):
    era, form, events, runs = b
    payload = W.encode_batch(events, era=era)
    batch, drops = kvroute.decode_batch(payload)
    assert drops == {} and len(batch["events"]) == len(events)
    r = kvroute.Router(["w"], block_size=BS, speculative_ttl_s=0)
    assert r.ingest("w", payload)
    st_ = r.stats()["workers"]["w"]
    assert st_["dropped"] == {} and st_["orphan_stores"] == 0
    for toks, want in runs:  # every run since the last clear, up to its first removed block
        assert r.find_matches(toks)["w"].blocks == want


@settings(max_examples=300)
@given(batches(), st.data())
def test_truncated_batches_are_counted_never_raised(b, data):
    era, form, events, _ = b
    payload = W.encode_batch(events, era=era)
    cut = data.draw(st.integers(0, len(payload) - 1))
    r = kvroute.Router(["w"], block_size=BS)
    assert not r.ingest("w", payload[:cut])
    assert r.stats()["workers"]["w"]["dropped"] == {"truncated": 1}


JUNK = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=5),
                 st.binary(max_size=40), st.integers(-2**63, 2**64 - 1),
                 st.lists(st.integers(-5, 5), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(-2**63, 2**64 - 1),
                                 max_size=2))


@pytest.mark.slow
@settings(max_examples=300)
@given(batches(), st.data())
def test_wrong_types_anywhere_never_raise(b, data):
    era, form, events, _ = b
    obj = msgspec.msgpack.decode(W.encode_batch(events, era=era))
    # Replace one node of the decoded tree with junk, re-encode, feed it.
    path = []
    node = obj
    while isinstance(node, (list, dict)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(list(range(len(node))) if isinstance(node, list)
                                        else list(node)))
        path.append(key)
        node = node[key]
    junk = data.draw(JUNK)
    if path:
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = junk
    else:
        obj = junk
    payload = msgspec.msgpack.encode(obj)
    batch, drops = kvroute.decode_batch(payload)
    assert batch is not None or sum(drops.values()) == 1
    r = kvroute.Router(["a", "b"], block_size=BS)
    r.ingest("a", payload)
    r.select_worker(list(range(3 * BS)))
    assert r.stats()["workers"]["b"]["dropped"] == {}
