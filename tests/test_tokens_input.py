"""Token containers: a list of ints, numpy arrays, array.array, memoryview and other buffer
objects give the same block keys and the same routing decision; wrong shapes and formats
raise ValueError saying what is expected (cpp/bindings/convert.h, TokenView)."""

from __future__ import annotations

import array

import numpy as np
import pytest

import kvroute
import kvroute.wire as ee
from kvroute import Router

BS = 16
N_TOKENS = 40 * BS + 7  # 40 full blocks and a partial one


def _tokens() -> list:
    rng = np.random.default_rng(11)
    return rng.integers(0, 151_936, N_TOKENS, dtype=np.int64).tolist()


def _containers(toks: list) -> dict:
    """The same token ids in every container a caller may hand the router."""
    u32 = np.array(toks, dtype=np.uint32)
    return {
        "numpy uint32": u32,
        "numpy int64": np.array(toks, dtype=np.int64),
        "numpy uint32, strided": np.repeat(u32, 2)[::2],
        "array('I')": array.array("I", toks),
        "array('L')": array.array("L", toks),
        "array('q')": array.array("q", toks),
        "memoryview of array('I')": memoryview(array.array("I", toks)),
        "memoryview of numpy uint32": memoryview(u32),
        "memoryview of numpy uint64": memoryview(np.array(toks, dtype=np.uint64)),
        "tuple": tuple(toks),
    }


def test_every_container_gives_the_same_block_keys():
    toks = _tokens()
    want = kvroute.block_keys(toks)
    assert want.dtype == np.uint64 and want.shape == (N_TOKENS // BS,)
    for name, c in _containers(toks).items():
        assert np.array_equal(kvroute.block_keys(c), want), name


def test_strided_buffers_are_read_item_by_item():
    toks = _tokens()
    doubled = array.array("I", [t for t in toks for _ in range(2)])
    view = memoryview(doubled)[::2]  # every other item: stride 8 bytes, not contiguous
    assert not view.c_contiguous
    assert np.array_equal(kvroute.block_keys(view), kvroute.block_keys(toks))
    reversed_view = memoryview(array.array("I", toks[::-1]))[::-1]  # negative stride
    assert np.array_equal(kvroute.block_keys(reversed_view), kvroute.block_keys(toks))


def _router_with_prefix(toks: list) -> Router:
    """w1 holds the first 24 blocks of toks, w0 the first 8, w2 nothing."""
    r = Router(["w0", "w1", "w2"], block_size=BS, seed=1, speculative_ttl_s=0)
    hashes = list(range(1, 25))
    payload = ee.encode_batch([ee.stored(hashes, None, toks[: 24 * BS], BS)], era="map")
    assert r.ingest("w1", payload)
    payload = ee.encode_batch([ee.stored(hashes[:8], None, toks[: 8 * BS], BS)], era="map")
    assert r.ingest("w0", payload)
    return r


def test_every_container_gives_the_same_decision_and_matches():
    toks = _tokens()
    r = _router_with_prefix(toks)
    try:
        want = r.select_worker(toks, dry_run=True)
        want_matches = r.find_matches(toks)
        assert want.worker == "w1" and want.matched_blocks == 24
        for name, c in _containers(toks).items():
            got = r.select_worker(c)  # the one-argument path (select_plain)
            r.complete(got)
            assert (got.worker, got.matched_blocks, got.matched_tokens) == \
                (want.worker, want.matched_blocks, want.matched_tokens), name
            got = r.select_worker(c, dry_run=True)  # the general path
            assert (got.worker, got.matched_blocks) == (want.worker, want.matched_blocks), name
            assert r.find_matches(c) == want_matches, name
    finally:
        r.close()


def test_uint32_buffers_are_read_in_place():
    # A view of the caller's memory: changing the memory changes the keys.
    a = array.array("I", _tokens())
    before = kvroute.block_keys(a)
    a[0] += 1
    assert not np.array_equal(kvroute.block_keys(a), before)
    assert np.array_equal(kvroute.block_keys(a), kvroute.block_keys(list(a)))


def test_empty_containers_have_no_keys():
    for c in ([], array.array("I"), memoryview(array.array("q")), np.empty(0, np.uint32)):
        assert kvroute.block_keys(c).shape == (0,)


@pytest.mark.parametrize(
    "tokens, match",
    [
        (array.array("d", [1.0] * 32), r"format 'I' \(or 'L'\) of 4-byte items.*got format 'd'"),
        (array.array("f", [1.0] * 32), r"got format 'f' of 4-byte items"),
        (memoryview(np.zeros((2, 16), dtype=np.uint32)), r"1-D, got a 2-D buffer"),
        (memoryview(np.zeros(32, dtype=">u4")), r"got format '>I'"),
        (memoryview(np.zeros(32, dtype=np.float32)), r"got format 'f'"),
        (np.zeros((2, 16), dtype=np.uint32), r"1-D"),
        (np.zeros(32, dtype=np.float64), r"integer"),
        (array.array("i", [1, -2] * 16), r"\[0, 2\*\*32\).*-2 at position 1"),
        (array.array("Q", [1, 2**32] * 16), r"\[0, 2\*\*32\).*4294967296 at position 1"),
        (memoryview(np.array([1, -3] * 16, dtype=np.int64)), r"-3 at position 1"),
    ],
)
def test_wrong_formats_and_shapes_raise_value_error(tokens, match):
    with pytest.raises(ValueError, match=match):
        kvroute.block_keys(tokens)
    r = Router(["w0"], block_size=BS)
    try:
        with pytest.raises(ValueError, match=match):
            r.select_worker(tokens)
    finally:
        r.close()


def test_list_ids_across_int_representations_read_exactly():
    """A list's ints are read inline when they are small exact ints (one 30-bit digit on
    CPython <= 3.11, compact on 3.12+) and through the C API otherwise: ids on both sides of
    every boundary give the same block keys as the same ids in a uint32 array."""
    ids = [0, 1, 255, 256, 2**15 - 1, 2**15, 2**30 - 1, 2**30, 2**31, 2**32 - 1] * 8
    as_list = kvroute.block_keys(ids, block_size=16)
    as_array = kvroute.block_keys(np.array(ids, dtype=np.uint32), block_size=16)
    assert list(as_list) == list(as_array)
    with pytest.raises(ValueError, match="position 3"):
        kvroute.block_keys([1, 2, 3, -1] + [0] * 12, block_size=16)
    with pytest.raises(ValueError, match="position 1"):
        kvroute.block_keys([1, 2**32] + [0] * 14, block_size=16)


class _IntSub(int):
    pass


@pytest.mark.parametrize("pos", [0, 37, 150, 198, 199])
def test_long_list_with_odd_items_reads_each_one_exactly(pos):
    """Long lists are read four items at a time while all four are small exact ints; an item
    that is not (a bool, an int subclass, a zero, an int of two digits) falls back to
    the per-item read wherever it sits, and a bad item is reported at its own position."""
    rng = np.random.default_rng(pos)
    ids = rng.integers(1, 151_936, 200).tolist()
    odd = {0: True, 1: _IntSub(7), 2: 0, 3: 2**31 + 5}
    for k, v in odd.items():
        ids[(pos + k) % 200] = v
    want = np.array([int(v) for v in ids], dtype=np.uint32)
    assert list(kvroute.block_keys(ids)) == list(kvroute.block_keys(want))
    for bad, match in (("x", "got str at position"), (-4, "-4 at position"),
                       (2**33, "8589934592 at position")):
        with pytest.raises(ValueError, match=f"{match} {pos}\\b"):
            kvroute.block_keys(ids[:pos] + [bad] + ids[pos + 1:])
