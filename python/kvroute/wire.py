"""Engine-faithful KV-event payloads: what vLLM and SGLang put on the wire, encoded by msgspec.

Used by the fleet simulator, the tests and the benchmarks to publish real msgpack batches.

Encodes real msgpack batches with ``msgspec`` from Structs whose field names, order,
defaults and options (``tag``, ``array_like``, ``omit_defaults``, ``gc=False``) mirror:

* vLLM  ``vllm/distributed/kv_events.py`` (vllm-project/vllm @b4e69e0a: original #16750
  shape; @0181ea17: map events and a batch without ``array_like``; forks with ``locality``).
* SGLang ``python/sglang/srt/disaggregation/kv_events.py`` (sgl-project/sglang @612d5790;
  2026 copies with ``BlockStoredWithMetadata``; the map-encoded copy in wow-look-at-my/sglang).

Facts that shape the bytes (cf. docs/kv-events.md §3-§5):
* msgspec ignores ``omit_defaults`` on ``array_like`` Structs (msgspec issue #720): array
  batches and events always carry every declared field, so arity depends on the engine
  version, never on the values. ``omit_defaults`` only drops keys of map encodings.
* vLLM ``lora_id``/``medium``/``lora_name`` have no default (always written); ``extra_keys``,
  ``group_idx``, ``kv_cache_spec_*``, ``locality`` default to None. A current vLLM still
  publishes ``group_idx=0`` and ``"full_attention"``, and so do :func:`stored`'s defaults.
* SGLang hashes are signed int64: pass ``as_hash(n, "i64")``; hashes are never converted here.

Describe events with :func:`stored` / :func:`removed` / :func:`cleared`, then call
``encode_batch(events, era=...)``; an era raises ValueError for a value its engine could not
publish (e.g. ``lora_name`` in the pre-#27577 ``"array"`` era). Run the file to self-check.
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import msgspec

from kvroute._shared_data import shared_data_dir

Hash = Union[int, bytes]
Era = Literal["map", "array", "array_full", "sglang", "sglang_map", "legacy2", "mapbatch"]
HashForm = Literal["u64", "i64", "bin16", "bin32"]
KVEVENTS_DIR_ENV = "KVROUTE_KVEVENTS_DIR"
"""Environment variable naming the engine-capture directory (overrides the shared data's)."""

class _VArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM KVCacheEvent up to PR #42892: tagged positional arrays, tag = class name."""

class VArrayBlockStoredV1(_VArrayEvent, tag="BlockStored"):
    """BlockStored from #19737 (medium) until #27577 (lora_name): 7 elements."""
    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]

class VArrayBlockStored(VArrayBlockStoredV1, tag="BlockStored"):
    """Last array-era BlockStored (#40984 .. #42892): always 12 elements. Versions in between
    wrote prefixes of it: 8 elements from #27577, 9 from #33304, 10 from #37688."""
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None

class VArrayBlockRemoved(_VArrayEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: Optional[str]

class VArrayBlockRemovedG(VArrayBlockRemoved, tag="BlockRemoved"):
    group_idx: Optional[int] = None  # #37688

class VArrayAllBlocksCleared(_VArrayEvent, tag="AllBlocksCleared"):
    """``["AllBlocksCleared"]``; SGLang's array form is identical."""

class LegacyBlockStored(_VArrayEvent, tag="BlockStored"):
    """Original vLLM (#16750) / early SGLang: no medium."""
    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]

class LegacyBlockRemoved(_VArrayEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]

class LegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]

class KVEventBatch(LegacyEventBatch):
    """vLLM EventBatch since #18925: ``[ts, events, data_parallel_rank]``, rank may be nil."""
    data_parallel_rank: Optional[int] = None

class MapEventBatch(KVEventBatch, array_like=False):
    """The same batch without array_like (vllm-project/vllm @0181ea17): None rank omitted."""

# vLLM map era (after #42892): the same fields as maps keyed by name, tag under "type".
class VMapBlockStored(VArrayBlockStored, array_like=False, tag="BlockStored"):
    locality: Optional[str] = None  # #48281

class VMapBlockRemoved(VArrayBlockRemovedG, array_like=False, tag="BlockRemoved"):
    locality: Optional[str] = None

class VMapAllBlocksCleared(VArrayAllBlocksCleared, array_like=False, tag="AllBlocksCleared"):
    """``{"type": "AllBlocksCleared"}``; SGLang's map form is identical."""

class _SArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """SGLang array events (2026; omit_defaults removed as redundant in sglang #32688)."""

class SGLangBlockStored(_SArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None  # "GPU", "CPU_PINNED", "DISK", "EXTERNAL"

class SGLangBlockStoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str

class SGLangBlockStoredWithMetadata(SGLangBlockStored, tag="BlockStored", kw_only=True):
    """Only for salted requests: position 7 is the map ``{"cache_salt": ...}``."""
    metadata: SGLangBlockStoredMetadata

class SGLangBlockRemoved(_SArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None

class SGLangEventBatch(msgspec.Struct, array_like=True, gc=False):
    """Always ``[ts, events, attn_dp_rank]``; the rank may be nil."""
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None

# SGLang map era: the same fields as maps (+ cache_salt, session_id); batch unchanged.
class SGLangMapBlockStored(SGLangBlockStored, array_like=False, omit_defaults=True,
                           tag="BlockStored"):
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None

class SGLangMapBlockRemoved(SGLangBlockRemoved, array_like=False, omit_defaults=True,
                            tag="BlockRemoved"):
    """``{"type": "BlockRemoved", "block_hashes": [...], "medium": ...}``"""

@dataclass(frozen=True)
class Stored:
    """Era-neutral BlockStored; build it with :func:`stored`."""
    block_hashes: list[Hash]
    parent: Optional[Hash]
    token_ids: list[int]
    block_size: int
    medium: Optional[str] = "GPU"
    lora_name: Optional[str] = None
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    lora_id: Optional[int] = None
    group_idx: Optional[int] = 0
    kv_cache_spec_kind: Optional[str] = "full_attention"
    kv_cache_spec_sliding_window: Optional[int] = None
    cache_salt: Optional[str] = None  # SGLang only; for vLLM put the salt in extra_keys
    locality: Optional[str] = None  # vLLM map era only

@dataclass(frozen=True)
class Removed:
    """Era-neutral BlockRemoved; build it with :func:`removed`."""
    block_hashes: list[Hash]
    medium: Optional[str] = "GPU"
    group_idx: Optional[int] = 0
    locality: Optional[str] = None

@dataclass(frozen=True)
class Cleared:
    """Era-neutral AllBlocksCleared; build it with :func:`cleared`."""

Event = Union[Stored, Removed, Cleared]

def stored(block_hashes: Sequence[Hash], parent: Optional[Hash], token_ids: Sequence[int],
           block_size: int, *, medium: Optional[str] = "GPU", lora_name: Optional[str] = None,
           extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None,
           lora_id: Optional[int] = None, group_idx: Optional[int] = 0,
           kv_cache_spec_kind: Optional[str] = "full_attention",
           kv_cache_spec_sliding_window: Optional[int] = None,
           cache_salt: Optional[str] = None, locality: Optional[str] = None) -> Stored:
    """A BlockStored; the defaults are what a current engine sends for a plain GPU store."""
    return Stored(list(block_hashes), parent, list(token_ids), block_size, medium, lora_name,
                  extra_keys, lora_id, group_idx, kv_cache_spec_kind,
                  kv_cache_spec_sliding_window, cache_salt, locality)

def removed(block_hashes: Sequence[Hash], medium: Optional[str] = "GPU", *,
            group_idx: Optional[int] = 0, locality: Optional[str] = None) -> Removed:
    """A BlockRemoved (``group_idx`` / ``locality`` reach only the eras that have them)."""
    return Removed(list(block_hashes), medium, group_idx, locality)

def cleared() -> Cleared:
    """An AllBlocksCleared (no fields: it clears every tier of the worker)."""
    return Cleared()

# Values meaning "not published" for an engine version that lacks the field.
_ABSENT: dict[str, tuple[Any, ...]] = {
    "medium": (None, "GPU"), "lora_name": (None,), "extra_keys": (None,), "group_idx": (None, 0),
    "kv_cache_spec_kind": (None, "full_attention"), "kv_cache_spec_sliding_window": (None,),
    "cache_salt": (None,), "locality": (None,)}
_VLLM = {"medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
         "kv_cache_spec_sliding_window"}
_SUPPORTED: dict[str, set[str]] = {
    "array": {"medium"}, "array_full": _VLLM, "map": _VLLM | {"locality"},
    "mapbatch": _VLLM | {"locality"}, "sglang": {"medium", "cache_salt"},
    "sglang_map": {"medium", "cache_salt"}, "legacy2": set()}

def _to_struct(ev: Event, era: str) -> msgspec.Struct:
    for f in fields(ev):
        value = getattr(ev, f.name)
        if f.name in _ABSENT and f.name not in _SUPPORTED[era] and value not in _ABSENT[f.name]:
            raise ValueError(f"era {era!r} cannot carry {f.name}={value!r}")
    vmap = era in ("map", "mapbatch")
    if isinstance(ev, Cleared):
        return VMapAllBlocksCleared() if vmap or era == "sglang_map" else VArrayAllBlocksCleared()
    if isinstance(ev, Removed):
        h: Any = ev.block_hashes
        if vmap:
            return VMapBlockRemoved(h, ev.medium, ev.group_idx, ev.locality)
        if era in ("sglang", "sglang_map"):
            cls = SGLangMapBlockRemoved if era == "sglang_map" else SGLangBlockRemoved
            return cls(h, ev.medium)
        if era == "array_full":
            return VArrayBlockRemovedG(h, ev.medium, ev.group_idx)
        return VArrayBlockRemoved(h, ev.medium) if era == "array" else LegacyBlockRemoved(h)
    head: dict[str, Any] = dict(block_hashes=ev.block_hashes, parent_block_hash=ev.parent,
                                token_ids=ev.token_ids, block_size=ev.block_size,
                                lora_id=ev.lora_id)
    rest: dict[str, Any] = dict(lora_name=ev.lora_name, extra_keys=ev.extra_keys,
                                group_idx=ev.group_idx, kv_cache_spec_kind=ev.kv_cache_spec_kind,
                                kv_cache_spec_sliding_window=ev.kv_cache_spec_sliding_window)
    if vmap:
        return VMapBlockStored(**head, medium=ev.medium, **rest, locality=ev.locality)
    if era == "array_full":
        return VArrayBlockStored(**head, medium=ev.medium, **rest)
    if era == "array":
        return VArrayBlockStoredV1(**head, medium=ev.medium)
    if era == "legacy2":
        return LegacyBlockStored(**head)
    if era == "sglang_map":
        return SGLangMapBlockStored(**head, medium=ev.medium, cache_salt=ev.cache_salt)
    if ev.cache_salt is not None:
        meta = SGLangBlockStoredMetadata(ev.cache_salt)
        return SGLangBlockStoredWithMetadata(**head, medium=ev.medium, metadata=meta)
    return SGLangBlockStored(**head, medium=ev.medium)

_ENCODER = msgspec.msgpack.Encoder()

def encode_batch(events: Sequence[Event], *, era: Era = "map", ts: Optional[float] = None,
                 dp_rank: Optional[int] = 0) -> bytes:
    """One batch payload exactly as the engine of ``era`` would publish it.

    map: vLLM after #42892 (map events, batch ``[ts, events, rank]``); array: vLLM #19737 ..
    #27577 (7-element events); array_full: last array-era vLLM (12 elements); mapbatch: map
    events in a map batch; sglang / sglang_map: SGLang array / map events, batch always 3
    long; legacy2: original ``[ts, events]`` with 6-element BlockStored (dp_rank ignored).
    """
    if era not in _SUPPORTED:
        raise ValueError(f"unknown era {era!r}")
    structs = [_to_struct(ev, era) for ev in events]
    t = time.time() if ts is None else float(ts)
    if era == "legacy2":
        return _ENCODER.encode(LegacyEventBatch(t, structs))
    if era in ("sglang", "sglang_map"):
        return _ENCODER.encode(SGLangEventBatch(t, structs, dp_rank))
    batch = MapEventBatch if era == "mapbatch" else KVEventBatch
    return _ENCODER.encode(batch(t, structs, dp_rank))

_BIN_PREFIX = hashlib.sha256(b"kvroute/tests/engine_events bin-hash prefix").digest()

def as_hash(n: int, form: HashForm = "u64") -> Hash:
    """Wire form of u64 ``n``: the int, its signed i64 reading, or 16/32 bytes whose last 8
    are ``n`` big-endian after a fixed prefix (as vLLM's int hash is a digest's last 8 bytes)."""
    if not 0 <= n < 1 << 64:
        raise ValueError(f"{n} is not a u64")
    if form == "u64":
        return n
    if form == "i64":
        return n - (1 << 64) if n >= 1 << 63 else n
    if form in ("bin16", "bin32"):
        return _BIN_PREFIX[: 8 if form == "bin16" else 24] + n.to_bytes(8, "big")
    raise ValueError(f"unknown hash form {form!r}")

def frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The 3-frame ZeroMQ PUB message: topic, seq (8 bytes, big-endian, unsigned), payload."""
    return [topic, seq.to_bytes(8, "big", signed=False), payload]

_POS = ("block_hashes", "parent", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")

def from_decoded(ev: Any) -> Event:
    """Era-neutral event from an untyped-decoded event in vLLM layout (array or map; not
    SGLang's salted position 7). A field the wire did not carry becomes None."""
    if isinstance(ev, dict):
        tag = ev["type"]
        d = {("parent" if k == "parent_block_hash" else k): v for k, v in ev.items()}
    else:
        tag = ev[0]
        names = _POS if tag == "BlockStored" else ("block_hashes", "medium", "group_idx")
        d = dict(zip(names, ev[1:]))
    if tag == "AllBlocksCleared":
        return Cleared()
    cls = Stored if tag == "BlockStored" else Removed
    known = {f.name for f in fields(cls)}
    kwargs = {k: None for k in known - set(_POS[:4])} | {k: v for k, v in d.items() if k in known}
    return cls(**kwargs)

# Capture file -> eras whose encoding should reproduce it byte-for-byte.
CAPTURE_ERAS: dict[str, tuple[Era, ...]] = {
    "vllm_qwen3-0.6b_blockstored_arraylike.payload.msgpack": ("array",),
    "sglang_qwen2.5-0.5b_blockstored_map.payload.msgpack": ("sglang_map",),
    "vllm0.26_qwen3-8b_blockstored_map.RECONSTRUCTED.payload.msgpack": ("map",),
    "msgspec-generated_legacy-arraylike_int-hashes.payload.msgpack": ("array", "sglang")}

def captures_dir(directory: Optional[Union[str, os.PathLike[str]]] = None) -> Path:
    """The directory of real engine captures (``MANIFEST.json`` + ``*.payload.msgpack``):
    ``directory``, else ``$KVROUTE_KVEVENTS_DIR``, else ``$KVROUTE_SHARED_DATA/kvevents``.

    Raises
    ------
    FileNotFoundError
        None of the three is given (existence is not checked).
    """
    if directory is not None:
        return Path(directory)
    env = os.environ.get(KVEVENTS_DIR_ENV)
    if env:
        return Path(env)
    return shared_data_dir(arg=f"directory, set {KVEVENTS_DIR_ENV}") / "kvevents"

def check_captures(directory: Optional[Union[str, os.PathLike[str]]] = None
                   ) -> dict[str, dict[str, bool]]:
    """Re-encode each capture's manifest ``expected`` value; report byte equality per era.
    ``directory`` as `captures_dir`."""
    directory = captures_dir(directory)
    manifest = json.loads((directory / "MANIFEST.json").read_text())
    out: dict[str, dict[str, bool]] = {}
    for name, eras in CAPTURE_ERAS.items():
        ts, evs, *rank = manifest[name]["expected"]
        wire = (directory / name).read_bytes()
        out[name] = {era: encode_batch([from_decoded(e) for e in evs], era=era, ts=ts,
                                       dp_rank=rank[0] if rank else None) == wire for era in eras}
    return out

def _selfcheck() -> None:
    dec, H, T = msgspec.msgpack.decode, [as_hash(2**64 - 1), 7], list(range(32))
    evs: list[Event] = [stored(H, 5, T, 16), removed([7]), cleared()]
    s_arr, r_arr = ["BlockStored", H, 5, T, 16, None, "GPU"], ["BlockRemoved", [7], "GPU"]
    s_map = {"type": "BlockStored", "block_hashes": H, "parent_block_hash": 5, "token_ids": T,
             "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
             "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    r_map = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    m_evs = [s_map, r_map, {"type": "AllBlocksCleared"}]
    c_arr = ["AllBlocksCleared"]
    assert dec(encode_batch(evs, era="array", ts=1.5)) == [1.5, [s_arr, r_arr, c_arr], 0]
    assert dec(encode_batch(evs, era="array", ts=1.5, dp_rank=None))[2] is None  # never dropped
    assert dec(encode_batch(evs[:2], era="array_full", ts=1))[1] == [
        [*s_arr, None, None, 0, "full_attention", None], [*r_arr, 0]]
    assert dec(encode_batch(evs, era="map", ts=2, dp_rank=3)) == [2.0, m_evs, 3]
    got = dec(encode_batch(evs, era="mapbatch", ts=2, dp_rank=None))
    assert got == {"ts": 2.0, "events": m_evs}
    ev = stored(H, None, T, 16, locality="LOCAL", extra_keys=[("salt",), None])
    got = dec(encode_batch([ev], ts=2))[1][0]
    assert got["locality"] == "LOCAL" and got["extra_keys"] == [["salt"], None]
    ev = stored([as_hash(2**64 - 1, "i64"), 7], None, T, 16, cache_salt="s")
    got = dec(encode_batch([ev, *evs[1:]], era="sglang", ts=3, dp_rank=None))
    s_salted = ["BlockStored", [-1, 7], None, T, 16, None, "GPU", {"cache_salt": "s"}]
    assert got == [3.0, [s_salted, r_arr, c_arr], None]
    assert dec(encode_batch(evs[:1], era="sglang", ts=3))[1][0] == s_arr
    assert dec(encode_batch(evs[:1], era="sglang_map", ts=3))[1][0] == {
        k: v for k, v in s_map.items() if k not in ("lora_name", "group_idx", "kv_cache_spec_kind")}
    assert dec(encode_batch(evs, era="legacy2", ts=4, dp_rank=9)) == [
        4.0, [s_arr[:-1], ["BlockRemoved", [7]], c_arr]]
    try:
        encode_batch([stored(H, None, T, 16, lora_name="a")], era="array")
        raise AssertionError("lora_name accepted by the pre-#27577 array era")
    except ValueError:
        pass
    assert as_hash(2**63, "i64") == -(2**63) and as_hash(5, "i64") == 5
    b16, b32 = as_hash(5, "bin16"), as_hash(5, "bin32")
    assert isinstance(b16, bytes) and isinstance(b32, bytes) and (len(b16), len(b32)) == (16, 32)
    assert int.from_bytes(b32[-8:], "big") == 5 and b16 != as_hash(6, "bin16")
    assert frames(b"kv", 5, b"p") == [b"kv", b"\x00" * 7 + b"\x05", b"p"]
    try:
        captures: Optional[Path] = captures_dir()
    except FileNotFoundError:
        captures = None
    if captures is not None and captures.is_dir():
        cap = "vllm_qwen3-0.6b_blockstored_arraylike"
        assert frames(b"", 5, b"")[1] == (captures / f"{cap}.seq").read_bytes()
        for name, res in check_captures(captures).items():
            print(f"{name}: {res}")
            assert all(res.values()), name
    else:
        print(f"captures not checked (set KVROUTE_SHARED_DATA or {KVEVENTS_DIR_ENV})")
    print("kvroute.wire self-check OK")

if __name__ == "__main__":
    _selfcheck()
