"""compare_dynamo.py's workload, the same for both sides: the Mooncake trace (or a generated
trace of its form) cut into blocks, the events that build an index over N workers in both
wire forms (vLLM msgpack for kvroute, KvCacheEvent JSON for Dynamo), the prompts looked up,
and the mooncake_bench-style replay. See compare_dynamo.py's docstring for what each part
measures."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import msgspec
import numpy as np

import kvroute.wire as ee  # engine-faithful vLLM payload encoder
from kvroute.replay.traces import MOONCAKE_BLOCK_TOKENS, mooncake_block_tokens

# -- workload ------------------------------------------------------------------------------
_U64 = np.uint64
_HASH_SALT = _U64(0x636F6D706172652D)  # "compare-"
def as_list(tokens: np.ndarray) -> list:
    """Token ids as a new Python list of new int objects, the form a tokenizer returns
    (``tokenizers`` ``Encoding.ids``). Not a pool of shared int objects: a list of those
    points all over the heap, which slows down every reader of it."""
    return tokens.tolist()


def engine_hashes(ids: np.ndarray) -> np.ndarray:
    """Engine block hashes (63-bit, uint64) of block identities: splitmix64 of the id."""
    x = ids.astype(_U64) + _HASH_SALT
    x += _U64(0x9E3779B97F4A7C15)
    x ^= x >> _U64(30)
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return x >> _U64(1)


class MooncakeBlocks:
    """The Mooncake trace in arrival order, cut into blocks of ``block_size`` tokens.

    A block's identity is ``hash_id * (512 // block_size) + position in its 512-token block``;
    equal hash ids mean equal prefixes in the trace, so equal identities mean equal prefixes.
    """

    def __init__(self, path: Optional[Path], block_size: int,
                 rows: Optional[list[tuple[float, int, list[int]]]] = None) -> None:
        """From a Mooncake JSONL file, or from ``rows`` of (timestamp ms, input_length,
        hash_ids) when given (`shaped_rows`)."""
        if block_size <= 0 or MOONCAKE_BLOCK_TOKENS % block_size:
            raise ValueError(f"block_size must divide {MOONCAKE_BLOCK_TOKENS}, got {block_size}")
        if rows is None:
            if path is None or not path.is_file():
                raise FileNotFoundError(f"Mooncake trace not found at {path} "
                                        f"(pass --data-dir or set KVROUTE_SHARED_DATA)")
            rows = []
            with path.open("r", encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        o = json.loads(line)
                        rows.append((float(o["timestamp"]), int(o["input_length"]),
                                     o["hash_ids"]))
        rows = sorted(rows, key=lambda r: r[0])  # stable, as kvroute.replay.traces.load_mooncake
        self.block_size = block_size
        self.per = MOONCAKE_BLOCK_TOKENS // block_size
        self.lengths = [r[1] for r in rows]
        self.hash_ids = [r[2] for r in rows]
        self.next_fresh = max(max(h) for h in self.hash_ids) + 1

    def __len__(self) -> int:
        return len(self.hash_ids)

    def tokens(self, i: int) -> np.ndarray:
        """uint32 prompt tokens of request i."""
        return mooncake_block_tokens(self.hash_ids[i], self.lengths[i])

    def ids(self, i: int) -> np.ndarray:
        """int64 identity of each full block of request i."""
        n = self.lengths[i] // self.block_size
        j = np.arange(n)
        h = np.asarray(self.hash_ids[i], dtype=np.int64)
        return h[j // self.per] * self.per + j % self.per

    def fresh_tokens(self, n: int) -> np.ndarray:
        """n pseudo-tokens of hash ids the trace never uses (so no index holds them)."""
        if n <= 0:
            return np.empty(0, dtype=np.uint32)
        nb = -(-n // MOONCAKE_BLOCK_TOKENS)
        ids = list(range(self.next_fresh, self.next_fresh + nb))
        self.next_fresh += nb
        return mooncake_block_tokens(ids, n)


# The published shape of the FAST'25 release's two other workloads (its README: requests, mean
# input and output tokens, arrival pattern). Their files are not in the shared data; these
# generated stand-ins have the same counts, means and arrival pattern, and the prefix structure
# the release describes: tool-and-agent requests share a few long tool/system prefixes and grow
# step by step within a session; synthetic ones are multi-turn conversations over long
# documents with Poisson arrivals.
SHAPES = {
    "toolagent-shaped": {"requests": 23_608, "mean_input": 8_596, "duration_s": 3600.0},
    "synthetic-shaped": {"requests": 3_993, "mean_input": 15_325, "duration_s": 3600.0},
}


def shaped_rows(kind: str, seed: int = 0) -> list[tuple[float, int, list[int]]]:
    """A generated trace in Mooncake's form: rows of (timestamp ms, input_length, hash_ids),
    512-token blocks, equal hash id = equal prefix up to that block's end (the last block may
    be partial, with an id of its own, as in the release). ``kind`` is a key of `SHAPES`.

    toolagent-shaped: 40 tool/system prefixes of 2-7K tokens, Zipf-popular (s = 1.1);
    sessions of 1-12 steps, each step the previous prompt plus 300-1,500 new tokens (tool
    output and the model's last answer). synthetic-shaped: 8 system prompts of 200-1,000
    tokens; conversations of 1-8 turns over a document of 4-16K tokens, each turn adding
    500-3,000 tokens. Session starts are Poisson over ``duration_s``; steps follow 2-30 s
    apart. Lengths are scaled once so the mean input equals the published mean (to ~1 %).
    """
    if kind not in SHAPES:
        raise ValueError(f"trace kind must be one of {sorted(SHAPES)}, got {kind!r}")
    shape = SHAPES[kind]
    rng = np.random.default_rng(seed)
    if kind == "toolagent-shaped":
        prefixes = rng.integers(2_000, 7_001, 40)
        pop = 1.0 / np.arange(1, 41) ** 1.1
        steps, grow, pick_prefix = (1, 12), (300, 1_500), lambda: int(
            rng.choice(40, p=pop / pop.sum()))
    else:
        prefixes = rng.integers(200, 1_001, 8)
        steps, grow, pick_prefix = (1, 8), (500, 3_000), lambda: int(rng.integers(0, 8))
    # Sessions as segment lists: (segment id, tokens). Segment ids < 1000 are shared prefixes.
    sessions: list[tuple[float, list[tuple[int, int]], list[int]]] = []
    n_req, seg_id = 0, 1000
    while n_req < shape["requests"]:
        k = int(rng.integers(steps[0], steps[1] + 1))
        k = min(k, shape["requests"] - n_req)
        pre = pick_prefix()
        segs = [(pre, int(prefixes[pre]))]
        if kind == "synthetic-shaped":  # the conversation's document
            segs.append((seg_id, int(rng.integers(4_000, 16_001))))
            seg_id += 1
        cuts = []
        for _ in range(k):
            segs.append((seg_id, int(rng.integers(grow[0], grow[1] + 1))))
            seg_id += 1
            cuts.append(len(segs))
        sessions.append((0.0, segs, cuts))
        n_req += k
    # One scale for every segment length so the mean input matches the published one.
    total = sum(sum(t for _, t in segs[:c]) for _, segs, cuts in sessions for c in cuts)
    scale = shape["mean_input"] * n_req / total
    ids: dict[tuple, int] = {}
    rows = []
    starts = np.sort(rng.uniform(0.0, shape["duration_s"], len(sessions)))
    for (_, segs, cuts), t0 in zip(sessions, starts):
        segs = [(sid, max(1, round(t * scale))) for sid, t in segs]
        t = float(t0)
        for c in cuts:
            length = sum(n for _, n in segs[:c])
            # hash id of block b: (previous block's id, the segment pieces inside block b)
            hids, prev, pos, si, off = [], -1, 0, 0, 0
            while pos < length:
                end = min(pos + MOONCAKE_BLOCK_TOKENS, length)
                pieces = []
                while pos < end:
                    sid, n = segs[si]
                    take = min(n - off, end - pos)
                    pieces.append((sid, off, off + take))
                    pos += take
                    off += take
                    if off == n:
                        si, off = si + 1, 0
                key = (prev, tuple(pieces))
                prev = ids.setdefault(key, len(ids))
                hids.append(prev)
            rows.append((t * 1000.0, length, hids))
            t += float(rng.uniform(2.0, 30.0))
    return rows


def dyn_stored_json(event_id: int, parent: Optional[int], hashes: list, local: list) -> bytes:
    """Dynamo KvCacheEvent (Stored) as the JSON bytes RadixTree.apply_event parses."""
    return msgspec.json.encode({"event_id": event_id, "data": {"stored": {
        "parent_hash": parent,
        "blocks": [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, local)]}}})


def dyn_removed_json(event_id: int, hashes: list) -> bytes:
    """Dynamo KvCacheEvent (Removed) as JSON bytes."""
    return msgspec.json.encode({"event_id": event_id,
                                "data": {"removed": {"block_hashes": hashes}}})


@dataclass
class Payloads:
    """One event per entry, both wire forms: (worker, vLLM msgpack, Dynamo JSON, blocks)."""

    worker: list[int] = field(default_factory=list)
    kv: list[bytes] = field(default_factory=list)
    dyn: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)

    def add(self, w: int, kv: bytes, dyn: bytes, n: int) -> None:
        self.worker.append(w)
        self.kv.append(kv)
        self.dyn.append(dyn)
        self.blocks.append(n)

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks)


@dataclass
class IndexWorkload:
    n_workers: int
    entries: int  # (block, worker) pairs
    distinct: int
    held: dict[int, tuple[int, int]]  # request -> (its worker, leading blocks that worker holds)
    store: Payloads
    remove: Payloads


def build_index(trace: MooncakeBlocks, dcore: Any, n_workers: int, index_blocks: int,
                event_blocks: int, seed: int) -> IndexWorkload:
    """Places trace requests on random workers until ``index_blocks`` distinct blocks are
    stored, and encodes the BlockStored / BlockRemoved events of both sides."""
    bs = trace.block_size
    rng = np.random.default_rng(seed + n_workers)
    holds: list[set] = [set() for _ in range(n_workers)]
    distinct: set = set()
    spans = []  # (worker, request, first new block, end)
    held: dict[int, tuple[int, int]] = {}
    for r in range(len(trace)):
        if len(distinct) >= index_blocks:
            break
        w = int(rng.integers(n_workers))
        ids = trace.ids(r).tolist()
        have = holds[w]
        i = 0
        while i < len(ids) and ids[i] in have:
            i += 1
        end = i
        while end < len(ids) and len(distinct) < index_blocks:
            distinct.add(ids[end])
            have.add(ids[end])
            end += 1
        if end > i:
            spans.append((w, r, i, end))
        held[r] = (w, end)
    store, remove = Payloads(), Payloads()
    chunks = []
    eid = 0
    for w, r, i, end in spans:
        toks = trace.tokens(r)
        hs = engine_hashes(trace.ids(r)[:end]).tolist()
        local = dcore.compute_block_hash_for_seq(as_list(toks[:end * bs]), bs)
        for s in range(i, end, event_blocks):
            e = min(s + event_blocks, end)
            parent = hs[s - 1] if s > 0 else None
            kvp = ee.encode_batch([ee.stored(hs[s:e], parent, as_list(toks[s * bs:e * bs]), bs)],
                                  era="map", ts=1.0)
            store.add(w, kvp, dyn_stored_json(eid, parent, hs[s:e], local[s:e]), e - s)
            chunks.append((w, hs[s:e][::-1]))
            eid += 1
    for w, rev in reversed(chunks):  # newest first, each chain tail first (as vLLM evicts)
        remove.add(w, ee.encode_batch([ee.removed(rev)], era="map", ts=1.0),
                   dyn_removed_json(eid, rev), len(rev))
        eid += 1
    return IndexWorkload(n_workers, store.total_blocks, len(distinct), held, store, remove)


class PromptSource:
    """Prompts of ``length`` tokens: the first ``hit_frac`` of an indexed request's blocks
    (held by its worker), then fresh tokens no worker holds. The prefixes come from up to
    4,096 indexed requests in a random order, each used once before any is used again."""

    def __init__(self, trace: MooncakeBlocks, wl: IndexWorkload, length: int, hit_frac: float,
                 rng: np.random.Generator) -> None:
        bs = trace.block_size
        self.trace, self.length, self.rng = trace, length, rng
        self.want = int(round(hit_frac * (length // bs)))
        ok = [r for r, (_, h) in wl.held.items() if h >= self.want]
        if not ok:  # nothing that long indexed: the longest ones, matched as far as they go
            ok = sorted(wl.held, key=lambda r: wl.held[r][1])[-8:]
        ok = [ok[i] for i in rng.permutation(len(ok))[:4096]]
        self.sources = [(trace.tokens(r)[:min(self.want, wl.held[r][1]) * bs]) for r in ok]
        self.used = 0
        self.last_cold = False  # whether the last prompt's prefix was new to the indexes

    def next(self) -> np.ndarray:
        """The next prompt (uint32); its prefix is one not handed out before while any is
        left (``last_cold`` True), then a random one again."""
        self.last_cold = self.used < len(self.sources)
        k = self.used if self.last_cold else int(self.rng.integers(len(self.sources)))
        self.used += 1
        src = self.sources[k][:self.length]
        return np.concatenate([src, self.trace.fresh_tokens(self.length - len(src))])


# -- replay (mooncake_bench style) ---------------------------------------------------------
@dataclass
class ReplayOp:
    worker: int
    tokens: np.ndarray  # the request's prompt, uint32 (kvroute's input)
    token_list: list  # the same as a new list of new ints (Dynamo's fastest input; kvroute's
    # "kvroute (list)" side)
    events: list[tuple[bytes, bytes, int]]  # (vLLM msgpack, Dynamo JSON, blocks)


@dataclass
class Replay:
    workers: int
    ops: list[ReplayOp]
    lookups: int
    lookup_blocks: int
    events: int
    stored_blocks: int
    removed_blocks: int


def build_replay(trace: MooncakeBlocks, dcore: Any, n_workers: int, n_requests: int,
                 capacity: int, event_blocks: int, seed: int) -> Replay:
    """Each worker is an LRU prefix cache of ``capacity`` blocks (no request overlaps another
    on its worker). A request hits its cached prefix, evicts least recently used blocks
    (BlockRemoved; a chain's tail goes before its head, as vLLM frees in reverse) and stores
    the rest of its full blocks (BlockStored, ``event_blocks`` per event)."""
    bs = trace.block_size
    rng = np.random.default_rng(seed + 7)
    caches: dict[int, OrderedDict] = {}
    ops = []
    eid = 0
    n_events = stored = removed = lookup_blocks = 0
    for r in range(min(n_requests, len(trace)) if n_requests > 0 else len(trace)):
        w = int(rng.integers(n_workers))
        cache = caches.setdefault(w, OrderedDict())
        toks = trace.tokens(r)
        hs = engine_hashes(trace.ids(r)).tolist()[:capacity]
        lookup_blocks += len(toks) // bs
        hit = 0
        while hit < len(hs) and hs[hit] in cache:
            hit += 1
        new = hs[hit:]
        evicted = []
        for h in hs[:hit]:  # not evictable while this request uses them
            cache.move_to_end(h)
        while len(cache) + len(new) > capacity:
            evicted.append(cache.popitem(last=False)[0])
        events = []
        if evicted:
            events.append((ee.encode_batch([ee.removed(evicted)], era="map", ts=1.0),
                           dyn_removed_json(eid, evicted), len(evicted)))
            eid += 1
            removed += len(evicted)
        if new:
            local = dcore.compute_block_hash_for_seq(as_list(toks[:len(hs) * bs]), bs)
            for s in range(hit, len(hs), event_blocks):
                e = min(s + event_blocks, len(hs))
                parent = hs[s - 1] if s > 0 else None
                kvp = ee.encode_batch(
                    [ee.stored(hs[s:e], parent, as_list(toks[s * bs:e * bs]), bs)],
                    era="map", ts=1.0)
                events.append((kvp, dyn_stored_json(eid, parent, hs[s:e], local[s:e]), e - s))
                eid += 1
            stored += len(new)
        for h in reversed(hs):  # the request ends: head most recently used, tail least
            cache[h] = None
            cache.move_to_end(h)
        n_events += len(events)
        ops.append(ReplayOp(w, toks, as_list(toks), events))
    return Replay(n_workers, ops, len(ops), lookup_blocks, n_events, stored, removed)
