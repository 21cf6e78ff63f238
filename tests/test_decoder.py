"""The wire decoder against real captures and against msgspec-encoded engine structs."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvroute
import kvroute.wire as ee

U64 = (1 << 64) - 1


def _u64(h):
    return h & U64 if isinstance(h, int) else h


# -- golden payloads ---------------------------------------------------------------------------

def _golden(shared_data):
    manifest = json.loads((shared_data / "kvevents" / "MANIFEST.json").read_text())
    return [(shared_data / "kvevents" / name, spec["expected"]) for name, spec in manifest.items()]


def _check_event(got: dict, exp) -> None:
    if isinstance(exp, list):  # tagged array: position -> field
        tag, *vals = exp
        names = {
            "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size",
                            "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                            "kv_cache_spec_kind", "kv_cache_spec_sliding_window"],
            "BlockRemoved": ["block_hashes", "medium", "group_idx"],
            "AllBlocksCleared": [],
        }[tag]
        exp = {"type": tag, **dict(zip(names, vals))}
    assert got["type"] == exp["type"]
    for k, v in exp.items():
        if k == "type":
            continue
        if k == "block_hashes":
            assert got[k] == [_u64(h) for h in v]
        elif k == "parent_block_hash":
            assert got[k] == (None if v is None else _u64(v))
        elif k == "extra_keys":
            assert got[k] == (None if v is None else
                              [None if e is None else msgspec.msgpack.encode(e) for e in v])
        elif k == "group_idx":
            assert got[k] == (v or 0)
        else:
            assert got[k] == v, k


def test_golden_payloads_decode_to_manifest(shared_data):
    cases = _golden(shared_data)
    assert len(cases) >= 4
    for path, (ts, events, rank) in cases:
        batch, drops = kvroute.decode_batch(path.read_bytes())
        assert drops == {}, path.name
        assert batch["ts"] == ts
        assert batch["data_parallel_rank"] == rank
        assert len(batch["events"]) == len(events), path.name
        for got, exp in zip(batch["events"], events):
            _check_event(got, exp)


def test_sglang_negative_hash_is_reinterpreted_as_u64(shared_data):
    p = shared_data / "kvevents" / "sglang_qwen2.5-0.5b_blockstored_map.payload.msgpack"
    batch, _ = kvroute.decode_batch(p.read_bytes())
    assert batch["events"][0]["block_hashes"] == [16196034758909408104, 9213906022183458822]


def test_real_vllm_capture_decodes_to_readable_text(shared_data, qwen3_tokenizer):
    tok = qwen3_tokenizer
    p = shared_data / "kvevents" / "vllm_qwen3-0.6b_blockstored_arraylike.payload.msgpack"
    batch, _ = kvroute.decode_batch(p.read_bytes())
    text = tok.decode(batch["events"][0]["token_ids"], skip_special_tokens=False)
    assert "players of all time" in text and "<|im_start|>assistant" in text


# -- every era, encoded from engine-shaped structs --------------------------------------------

ERAS_WITH_LORA = ["map", "array_full", "mapbatch"]
ALL_ERAS = ["map", "array", "array_full", "sglang", "sglang_map", "legacy2", "mapbatch"]


@pytest.mark.parametrize("era", ALL_ERAS)
@pytest.mark.parametrize("form", ["u64", "i64", "bin16", "bin32"])
def test_each_era_and_hash_form_round_trips(era, form):
    h = [ee.as_hash(n, form) for n in (1, 2, (1 << 63) + 5)]
    toks = list(range(48))
    evs = [
        ee.stored(h, None, toks, 16, medium="GPU"),
        ee.removed([h[2]], "GPU"),
        ee.cleared(),
    ]
    batch, drops = kvroute.decode_batch(ee.encode_batch(evs, era=era, ts=12.5, dp_rank=3))
    assert drops == {}
    assert batch["ts"] == 12.5
    assert batch["data_parallel_rank"] == (None if era == "legacy2" else 3)
    s, r, c = batch["events"]
    assert s["type"] == "BlockStored" and r["type"] == "BlockRemoved"
    assert c == {"type": "AllBlocksCleared"}
    assert s["token_ids"] == toks and s["block_size"] == 16 and s["parent_block_hash"] is None
    assert len(set(map(repr, s["block_hashes"]))) == 3  # distinct hashes stay distinct
    assert r["block_hashes"] == [s["block_hashes"][2]]
    if form in ("u64", "i64"):
        assert s["block_hashes"] == [1, 2, (1 << 63) + 5]
    if form == "bin16":
        assert s["block_hashes"][0][8:] == (1).to_bytes(8, "big")


@pytest.mark.parametrize("era", ERAS_WITH_LORA)
def test_new_fields_are_read(era):
    ev = ee.stored([7], 6, list(range(16)), 16, medium="CPU", lora_name="sql-adapter",
                   extra_keys=[("salt-1",)], group_idx=2, kv_cache_spec_kind="full_attention")
    batch, drops = kvroute.decode_batch(ee.encode_batch([ev], era=era))
    assert drops == {}
    s = batch["events"][0]
    assert s["parent_block_hash"] == 6
    assert s["lora_name"] == "sql-adapter"
    assert s["medium"] == "CPU" and s["tier"] == "CPU"
    assert s["extra_keys"] == [msgspec.msgpack.encode(["salt-1"])]
    assert s["group_idx"] == 2
    assert s["kv_cache_spec_kind"] == "full_attention"


@pytest.mark.parametrize("era", ["sglang", "sglang_map"])
def test_sglang_cache_salt_keys_the_first_block(era):
    ev = ee.stored([ee.as_hash(9, "i64")], None, list(range(16)), 16, cache_salt="tenant-a")
    batch, drops = kvroute.decode_batch(ee.encode_batch([ev], era=era))
    assert drops == {}
    assert batch["events"][0]["extra_keys"] == [msgspec.msgpack.encode(["tenant-a"])]


def test_tagged_map_with_unknown_fields_and_shuffled_keys():
    ev = {"token_ids": [1] * 16, "ownership": "x", "type": "BlockStored", "block_size": 16,
          "block_hashes": [5], "origin": {"a": 1}, "parent_block_hash": None, "locality": "REMOTE"}
    payload = msgspec.msgpack.encode([1.0, [ev, ["Mystery", 1, 2]], None])
    batch, drops = kvroute.decode_batch(payload)
    assert drops == {"unknown_tag": 1}
    assert len(batch["events"]) == 1
    assert batch["events"][0]["locality"] == "REMOTE"
    assert batch["events"][0]["medium"] is None and batch["events"][0]["tier"] == "GPU"


def test_array_event_with_extra_trailing_positions_is_read():
    ev = ["BlockStored", [5], None, [1] * 16, 16, None, "GPU", None, None, 0, "full_attention",
          None, "future-field", 42]
    batch, drops = kvroute.decode_batch(msgspec.msgpack.encode([1, [ev]]))
    assert drops == {} and batch["events"][0]["block_hashes"] == [5]
    assert batch["ts"] == 1.0


def test_cpu_placeholder_event_decodes():
    ev = ["BlockStored", [5, 6], None, [], 0, None, "CPU"]
    batch, drops = kvroute.decode_batch(msgspec.msgpack.encode([1.0, [ev], 0]))
    assert drops == {} and batch["events"][0]["token_ids"] == []


# -- malformed input: counted by reason, never raised ------------------------------------------

GOOD = ee.encode_batch([ee.stored([1, 2], None, list(range(32)), 16)], era="map")


@pytest.mark.parametrize(
    "payload, reason",
    [
        (GOOD[:-3], "truncated"),
        (b"", "truncated"),
        (b"\xc1", "parse_error"),
        (GOOD + b"\x00", "trailing_bytes"),
        (msgspec.msgpack.encode("hello"), "wrong_type"),
        (msgspec.msgpack.encode([1.0]), "wrong_type"),
        (msgspec.msgpack.encode(["ts", []]), "wrong_type"),
        (msgspec.msgpack.encode({"events": []}), "wrong_type"),
        (msgspec.msgpack.encode([1.0, {"a": 1}]), "wrong_type"),
    ],
)
def test_malformed_batches_are_dropped_and_counted(payload, reason):
    batch, drops = kvroute.decode_batch(payload)
    assert batch is None
    assert drops == {reason: 1}


@pytest.mark.parametrize(
    "event, reason",
    [
        (["BlockStored", "not-a-list", None, [], 16], "wrong_type"),
        (["BlockStored", [1], None, [-1] * 16, 16], "token_out_of_range"),
        (["BlockStored", [1], None, [1 << 33] * 16, 16], "token_out_of_range"),
        (["BlockStored", [1.5], None, [1] * 16, 16], "wrong_type"),
        (["BlockRemoved", [1], 7], "wrong_type"),
        ([], "wrong_type"),
        ([17], "wrong_type"),
        ({"block_hashes": [1]}, "wrong_type"),
        ({"type": "Nope"}, "unknown_tag"),
        (3, "wrong_type"),
    ],
)
def test_malformed_events_are_dropped_others_kept(event, reason):
    good = ["BlockRemoved", [9], "GPU"]
    batch, drops = kvroute.decode_batch(msgspec.msgpack.encode([1.0, [good, event, good], 0]))
    assert drops == {reason: 1}
    assert [e["type"] for e in batch["events"]] == ["BlockRemoved", "BlockRemoved"]


@given(st.binary(max_size=200))
def test_random_bytes_never_raise(data):
    batch, drops = kvroute.decode_batch(data)
    assert batch is not None or sum(drops.values()) == 1


@given(st.integers(0, len(GOOD)))
def test_every_truncation_is_dropped(n):
    batch, drops = kvroute.decode_batch(GOOD[:n])
    if n == len(GOOD):
        assert batch is not None and drops == {}
    else:
        assert batch is None and drops == {"truncated": 1}
