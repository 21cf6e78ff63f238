#!/usr/bin/env python
"""kvroute side by side with NVIDIA Dynamo's KV indexer, same process, same inputs.

Dynamo side: the ``ai-dynamo-runtime`` wheel's Python bindings (``dynamo._core``):
``compute_block_hash_for_seq(tokens, kv_block_size)`` (per-block xxh3 "local" hashes) and
``RadixTree`` (``apply_event(worker_id, event_json_bytes)``, ``find_matches(hashes)`` ->
``OverlapScores.scores`` = ``{(worker_id, dp_rank): matched blocks}``). ``apply_event`` takes one
Dynamo ``KvCacheEvent`` serialised as JSON (``lib/kv-router/src/protocols.rs``)::

    {"event_id": 7, "data": {"stored": {"parent_hash": 12 | null,
                                        "blocks": [{"block_hash": 13, "tokens_hash": 99}, ...]}}}
    {"event_id": 8, "data": {"removed": {"block_hashes": [13, ...]}}}

kvroute side: `kvroute.Router` fed vLLM msgpack batches (`kvroute.wire`, map era) through
`Router.ingest`, looked up with `Router.find_matches` / `Router.select_worker`.

Workload (both sides get the same one): the Mooncake conversation trace
(``$KVROUTE_SHARED_DATA/mooncake_conversation_trace.jsonl``, kvcache-ai/Mooncake, Apache-2.0),
its 512-token hash ids expanded to pseudo-tokens as the replay does
(`kvroute.replay.traces.mooncake_block_tokens`), cut into ``--block-size`` blocks. Requests in
arrival order go to a seeded random worker of N; each stores on its worker the blocks that
worker does not hold yet, until ``--index-blocks`` distinct blocks are indexed. Engine block
hashes are a fixed 63-bit function of the block's identity (its prefix), the same on every
worker, as vLLM's are.

Parts (``--parts``):

* ``lookup``: prompts of ``--lengths`` tokens whose first ``--hit-frac`` is the prefix of an
  indexed request, the rest fresh tokens; hashing included on both sides; the sides
  alternate request by request (the order rotates every call). Both sides get what a server
  hands them: a fresh list of ints per call (``ndarray.tolist()``: new int objects, as a
  tokenizer's ``Encoding.ids``), and kvroute also a uint32 array. The same work per call on
  both sides: kvroute ``find_matches`` (a dict of every worker's match) against Dynamo's
  ``find_matches(...)`` plus its ``.scores`` dict; kvroute ``select_worker`` (one decision)
  against Dynamo's ``find_matches`` without ``.scores`` (its per-worker scores left in Rust).
  No prompt repeats (fresh tails); prefixes walk a random permutation of the indexed
  requests, so a call is *cold* (prefix not looked up before in this index) until each was
  used once, *warm* after. Every call's per-worker overlap is compared between the two
  (``mismatches`` must be 0).
* ``ingest``: the stored events that build the index (one event per call on both sides,
  ``--event-blocks`` blocks each, encoding done beforehand); churn at full size (the newest
  tenth of the events removed and stored again, five times); the same blocks all removed;
  and stored again into the emptied indexes; blocks/s of wall time. ``zmq``: kvroute only,
  the same payloads over real ZeroMQ (pyzmq PUB -> the Router's native SUB) at the smallest N.
* ``memory``: resident bytes per indexed (block, worker) pair: VmRSS growth around building the
  index in a fresh interpreter per side (payloads loaded before the baseline).
* ``replay``: in the style of Dynamo's ``lib/kv-router/benches/mooncake_bench.rs``: the trace's
  requests partitioned at random over ``--replay-workers`` workers, each worker an LRU prefix
  cache of ``--replay-capacity`` blocks whose BlockStored / BlockRemoved events follow each
  request; the merged sequence (lookup, then that request's events) replayed closed-loop with
  one and with two Python threads (each thread owns half of the workers). ops/s counts lookups
  plus events; p99 is the lookup latency. Lookups: kvroute ``select_worker`` on a uint32
  array and on a fresh list (``kvroute (list)``), Dynamo ``find_matches`` on a fresh list
  without ``.scores`` (one answer per request on every side).

Run ``python benchmarks/compare_dynamo.py`` (~4 min on 2 cores) or ``--quick`` (~10 s).
Needs ``pip install ai-dynamo-runtime==1.6.1`` (the ``bench`` extra).
"""

from __future__ import annotations

import os

# numpy's OpenBLAS threads spin after numpy calls and steal the second core on small boxes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402
import platform  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import OrderedDict  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Optional, Sequence  # noqa: E402

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_override import preload_core  # noqa: E402

_CORE_PATH = preload_core(sys.argv) if __name__ == "__main__" else None

import kvroute  # noqa: E402
import kvroute.wire as ee  # noqa: E402  (engine-faithful vLLM payload encoder)
from kvroute.replay.traces import (  # noqa: E402
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_FILE,
    mooncake_block_tokens,
)

from bench_ingest import bind_pubs, loadavg, rss_bytes, task_cpu  # noqa: E402
from bench_select import fmt_row  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DYNAMO_REQUIREMENT = "ai-dynamo-runtime==1.6.1"


def import_dynamo() -> Any:
    """``dynamo._core`` or a SystemExit that says how to install it."""
    try:
        import dynamo._core as dcore
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(f"compare_dynamo needs NVIDIA Dynamo's Python bindings: "
                         f"pip install {DYNAMO_REQUIREMENT} ({e})") from e
    return dcore


def default_data_dir() -> Path:
    return Path(os.environ.get("KVROUTE_SHARED_DATA", ROOT.parent / "shared" / "data"))


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


# -- on-CPU time ---------------------------------------------------------------------------
class ThreadCpu:
    """On-CPU nanoseconds of some threads of this process (``/proc/self/task/<tid>/schedstat``,
    first field), e.g. the thread a Dynamo ``RadixTree`` runs its work on."""

    def __init__(self, tids: set[int]) -> None:
        self.fds = [os.open(f"/proc/self/task/{t}/schedstat", os.O_RDONLY) for t in tids]

    def ns(self) -> int:
        return sum(int(os.pread(fd, 128, 0).split()[0]) for fd in self.fds)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def new_threads(make: Callable[[], Any]) -> tuple[Any, set[int]]:
    """Calls make() and returns its result and the ids of the threads it started."""
    before = set(os.listdir("/proc/self/task"))
    obj = make()
    time.sleep(0.05)
    return obj, {int(t) for t in set(os.listdir("/proc/self/task")) - before}


# -- lookup --------------------------------------------------------------------------------
LOOKUP_SIDES = ["kv find_matches (np)", "kv find_matches (list)", "kv select (np)",
                "kv select (list)", "dynamo (list)"]
# Dynamo's call timed in two parts: hash + find_matches ("dynamo (list)"), then + .scores.
DYN_SCORES = "dynamo (list) +.scores"
# Which Dynamo figure a kvroute side is compared with: the same work per call.
DYN_PEER = {"kv find_matches (np)": DYN_SCORES, "kv find_matches (list)": DYN_SCORES,
            "kv select (np)": "dynamo (list)", "kv select (list)": "dynamo (list)"}


def time_lookups(router: kvroute.Router, tree: Any, dcore: Any, src: PromptSource, calls: int,
                 warmup: int, bs: int, tree_cpu: Optional[ThreadCpu] = None) -> dict:
    """Interleaved per-call wall times (ns) of every side; the order rotates each call. Each
    call's list is new (`as_list`), built outside the timed region, one per side that takes
    a list, so no side reads ints another side has just read.

    Also on-CPU ns per call: the calling thread's, plus for Dynamo its tree thread's
    (``tree_cpu``), read outside the wall-clock window. On-CPU time leaves out time spent
    preempted, so it stays meaningful on a loaded machine.

    Returns ``{"ns": {side: int64 array}, "cpu": {side: int64 array}, "cold": bool array,
    "mismatches": n, "matched": mean best blocks}``; the sides are LOOKUP_SIDES and
    DYN_SCORES (Dynamo's call including its ``.scores`` dict)."""
    hash_seq, find = dcore.compute_block_hash_for_seq, tree.find_matches
    fns: dict[str, Callable] = {
        "kv find_matches (np)": router.find_matches,
        "kv find_matches (list)": router.find_matches,
        "kv select (np)": router.select_worker,
        "kv select (list)": router.select_worker,
    }
    sides = LOOKUP_SIDES + [DYN_SCORES]
    ns = {s: np.empty(calls, dtype=np.int64) for s in sides}
    cpu = {s: np.empty(calls, dtype=np.int64) for s in sides}
    cold = np.zeros(calls, dtype=bool)
    clock, tclock = time.perf_counter_ns, time.thread_time_ns
    other = tree_cpu.ns if tree_cpu is not None else (lambda: 0)
    mismatches, matched = 0, []
    k = len(LOOKUP_SIDES)
    for i in range(warmup + calls):
        tok = src.next()
        res = {}
        for j in range(k):
            side = LOOKUP_SIDES[(i + j) % k]
            arg = as_list(tok) if side.endswith("(list)") else tok
            if side == "dynamo (list)":
                o0 = other()
                c0 = tclock()
                t0 = clock()
                r = find(hash_seq(arg, bs))
                t1 = clock()
                c1 = tclock()
                o1 = other()
                c2 = tclock()
                t2 = clock()
                res[DYN_SCORES] = r.scores
                t3 = clock()
                c3 = tclock()
                if i >= warmup:
                    n = i - warmup
                    ns[side][n] = t1 - t0
                    cpu[side][n] = c1 - c0 + o1 - o0
                    ns[DYN_SCORES][n] = t1 - t0 + t3 - t2
                    cpu[DYN_SCORES][n] = c1 - c0 + o1 - o0 + c3 - c2
                continue
            fn = fns[side]
            c0 = tclock()
            t0 = clock()
            r = fn(arg)
            t1 = clock()
            c1 = tclock()
            res[side] = r
            if i >= warmup:
                ns[side][i - warmup] = t1 - t0
                cpu[side][i - warmup] = c1 - c0
        if i >= warmup:
            cold[i - warmup] = src.last_cold
        router.complete(res["kv select (np)"])
        router.complete(res["kv select (list)"])
        kv = {int(n[1:]): m.blocks for n, m in res["kv find_matches (np)"].items() if m.blocks}
        kl = {int(n[1:]): m.blocks for n, m in res["kv find_matches (list)"].items()
              if m.blocks}
        dy = {int(w): s for (w, _dp), s in res[DYN_SCORES].items() if s}
        if kv != dy or kl != dy:
            mismatches += 1
        matched.append(max(kv.values(), default=0))
    return {"ns": ns, "cpu": cpu, "cold": cold, "mismatches": mismatches,
            "matched": float(np.mean(matched))}


def stats_us(ns: np.ndarray) -> dict[str, float]:
    us = ns / 1e3
    if not len(us):
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan"), "n": 0}
    return {"p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99)),
            "mean": float(us.mean()), "n": int(len(us))}


# -- ingestion -----------------------------------------------------------------------------
def feed(apply: Callable, targets: Sequence, p: Payloads, payloads: list,
         calls: Optional[list[int]] = None) -> float:
    """Seconds to call ``apply(targets[worker], payload)`` for every event of `p` in order;
    with ``calls``, also each call's ns in it."""
    ws = p.worker
    clock = time.perf_counter_ns
    t0 = time.perf_counter()
    if calls is None:
        for j in range(len(payloads)):
            apply(targets[ws[j]], payloads[j])
    else:
        for j in range(len(payloads)):
            c0 = clock()
            apply(targets[ws[j]], payloads[j])
            calls[j] = clock() - c0
    return time.perf_counter() - t0


def feed_kv(router: kvroute.Router, names: list[str], p: Payloads,
            calls: Optional[list[int]] = None) -> float:
    return feed(router.ingest, names, p, p.kv, calls)


def feed_dyn(tree: Any, p: Payloads, calls: Optional[list[int]] = None) -> float:
    return feed(tree.apply_event, range(max(p.worker, default=-1) + 1), p, p.dyn, calls)


def feed_both(router: kvroute.Router, names: list[str], tree: Any, p: Payloads,
              kv_first: bool, kv_calls: Optional[list[int]] = None,
              dy_calls: Optional[list[int]] = None) -> tuple[float, float]:
    """The same events into both indexes, one side after the other, cyclic GC off.
    Returns (kvroute seconds, Dynamo seconds); fills the per-call ns lists if given."""
    gc.collect()
    gc.disable()
    try:
        if kv_first:
            kv_s = feed_kv(router, names, p, kv_calls)
            return kv_s, feed_dyn(tree, p, dy_calls)
        dy_s = feed_dyn(tree, p, dy_calls)
        return feed_kv(router, names, p, kv_calls), dy_s
    finally:
        gc.enable()


def work_seconds(runs: list[list[int]]) -> float:
    """Each event's fastest call across the runs, summed (s): the same events in the same
    order into fresh indexes, so an event's work is the same in every run and the minimum
    leaves out what the VM's slow spells and preemption added (as bench_select.py's work per
    call does for lookups)."""
    return float(np.min(np.array(runs, dtype=np.int64), axis=0).sum()) / 1e9


def check_same_match(router: kvroute.Router, tree: Any, dcore: Any, probe: np.ndarray, bs: int,
                     what: str) -> None:
    """A stored prompt must match the same number of blocks on both sides, and some."""
    dyn_hit = max(tree.find_matches(
        dcore.compute_block_hash_for_seq(probe.tolist(), bs)).scores.values(), default=0)
    kv_hit = max((m.blocks for m in router.find_matches(probe).values()), default=0)
    if dyn_hit != kv_hit or kv_hit == 0:
        raise SystemExit(f"{what} check failed: a stored prompt matches {kv_hit} blocks in "
                         f"kvroute, {dyn_hit} in Dynamo")


def churn_payloads(wl: "IndexWorkload", fraction: int, rounds: int) -> tuple[Payloads, int]:
    """The newest 1/fraction of the store events removed (newest first, each chain's tail
    first: the start of ``wl.remove``) then stored again in their order, ``rounds`` times.
    Returns the payloads and the blocks they carry (removed + stored)."""
    m = max(1, len(wl.store.kv) // fraction)
    out = Payloads()
    for _ in range(rounds):
        for p, lo, hi in ((wl.remove, 0, m), (wl.store, len(wl.store.kv) - m, len(wl.store.kv))):
            for j in range(lo, hi):
                out.add(p.worker[j], p.kv[j], p.dyn[j], p.blocks[j])
    return out, sum(out.blocks)


def ingest_row(n: int, op: str, blocks: int, p: Payloads, kv_s: float, dy_s: float) -> dict:
    return {"workers": n, "op": op, "blocks": blocks, "events": len(p.kv),
            "kv_bytes_per_block": sum(map(len, p.kv)) / blocks,
            "dyn_bytes_per_block": sum(map(len, p.dyn)) / blocks,
            "kv_s": kv_s, "dyn_s": dy_s, "kv_blocks_per_s": blocks / kv_s,
            "dyn_blocks_per_s": blocks / dy_s}


def check_kv(router: kvroute.Router, stored: int, removed: int) -> None:
    st = router.stats()
    got = sum(w["blocks_stored"] for w in st["workers"].values())
    rem = sum(w["blocks_removed"] for w in st["workers"].values())
    orphans = sum(w["orphan_stores"] for w in st["workers"].values())
    bad = {k: v for k, v in st["dropped"].items() if v}
    if got != stored or rem != removed or orphans or bad:
        raise SystemExit(f"kvroute ingest check failed: stored {got}/{stored}, removed "
                         f"{rem}/{removed}, orphans {orphans}, drops {bad}")


def bench_zmq(wl: IndexWorkload, block_size: int, timeout: float) -> dict:
    """kvroute end to end: one pyzmq PUB per worker -> Router's native SUBs -> index."""
    import zmq

    ctx = zmq.Context()
    n = wl.n_workers
    ports, pubs = bind_pubs(ctx, n)
    workers = [kvroute.Worker(f"w{i}", kv_endpoint=f"tcp://127.0.0.1:{port}")
               for i, port in enumerate(ports)]
    before = set(task_cpu())
    router = kvroute.Router(workers, block_size=block_size, speculative_ttl_s=0)
    mine = {t for t in task_cpu() if t not in before}
    # Slow joiner: publish probes (an empty batch, seq 0) until every SUB has received one.
    empty = ee.encode_batch([], era="map", ts=1.0)
    seqs = [0] * n
    deadline = time.perf_counter() + timeout
    while True:
        for w, s in enumerate(pubs):
            s.send_multipart([b"", seqs[w].to_bytes(8, "big"), empty])
            seqs[w] += 1
        st = router.stats()["workers"]
        if all(st[f"w{i}"]["batches"] > 0 for i in range(n)):
            break
        if time.perf_counter() > deadline:
            raise SystemExit("zmq: subscribers did not connect in time")
        time.sleep(0.01)
    cpu0 = {t: c for t, (_, c) in task_cpu().items() if t in mine}
    total = wl.store.total_blocks
    t0 = time.perf_counter()
    for w, p in zip(wl.store.worker, wl.store.kv):
        pubs[w].send_multipart([b"", seqs[w].to_bytes(8, "big"), p], copy=False)
        seqs[w] += 1
    t_sent = time.perf_counter() - t0
    deadline = time.perf_counter() + timeout
    got = 0
    while got < total and time.perf_counter() < deadline:
        time.sleep(0.0005)
        st = router.stats()
        got = sum(x["blocks_stored"] for x in st["workers"].values())
    secs = time.perf_counter() - t0
    cpu = sum(c - cpu0.get(t, 0.0) for t, (name, c) in task_cpu().items()
              if t in mine and not name.startswith("ZMQbg"))
    gaps = sum(x["gaps"] for x in router.stats()["workers"].values())
    router.close()
    for s in pubs:
        s.close()
    ctx.term()
    return {"workers": n, "blocks": got, "expected": total, "send_s": t_sent, "total_s": secs,
            "blocks_per_s": got / secs, "blocks_per_cpu_s": got / cpu if cpu > 0 else None,
            "gaps": gaps, "complete": got >= total}


# -- memory (child process) ----------------------------------------------------------------
def memory_child(side: str, path: str, n_workers: int, block_size: int) -> None:
    """Fresh interpreter: load one side's payloads, then build its index; print JSON."""
    with open(path, "rb") as f:
        workers, payloads = pickle.load(f)
    gc.collect()
    base = rss_bytes()
    out: dict[str, Any] = {}
    if side == "kvroute":
        names = [f"w{i}" for i in range(n_workers)]
        r = kvroute.Router(names, block_size=block_size, speculative_ttl_s=0)
        ingest = r.ingest
        for w, p in zip(workers, payloads):
            ingest(names[w], p)
        gc.collect()
        out["rss"] = rss_bytes() - base
        st = r.stats()
        out["index_bytes"] = st["index_memory_bytes"]
        out["entries"] = st["indexed_entries"]
    else:
        tree = import_dynamo().RadixTree()
        apply = tree.apply_event
        for w, p in zip(workers, payloads):
            apply(w, p)
        tree.find_matches([])  # the tree's thread has applied everything before this returns
        gc.collect()
        out["rss"] = rss_bytes() - base
    print(json.dumps(out))


def dump_store(wl: IndexWorkload, path: Path) -> None:
    """The store workload as benchmarks/ab_ingest/payloads.h reads it: u32 workers, u32
    payloads, then per payload u32 worker, u32 length and the msgpack batch (little-endian)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<II", wl.n_workers, len(wl.store.kv)))
        for w, p in zip(wl.store.worker, wl.store.kv):
            f.write(struct.pack("<II", int(w), len(p)))
            f.write(p)
    print(f"# wrote {path}", flush=True)


def bench_memory(wl: IndexWorkload, block_size: int, tmp: Path) -> dict:
    res: dict[str, Any] = {"workers": wl.n_workers, "entries": wl.entries}
    for side, payloads in (("kvroute", wl.store.kv), ("dynamo", wl.store.dyn)):
        path = tmp / f"mem_{side}_{wl.n_workers}.pkl"
        with open(path, "wb") as f:
            pickle.dump((wl.store.worker, payloads), f, protocol=pickle.HIGHEST_PROTOCOL)
        cmd = [sys.executable, __file__, "--mem-child", side, "--mem-file", str(path),
               "--mem-workers", str(wl.n_workers), "--block-size", str(block_size)]
        if _CORE_PATH:
            cmd += ["--core", _CORE_PATH]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        path.unlink()
        if proc.returncode != 0:
            raise SystemExit(f"memory child ({side}) failed:\n{proc.stderr[-2000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        res[side] = out
    return res


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


def run_replay(side: str, rp: Replay, dcore: Any, threads: int, block_size: int) -> dict:
    """Closed-loop replay of every op; thread t replays the workers w with w % threads == t.
    ``side``: "kvroute" (select_worker on the uint32 array), "kvroute (list)" (on the list)
    or "dynamo" (hash of the list + find_matches, its scores left in Rust: one answer per
    request, as select_worker's)."""
    names = [f"w{i}" for i in range(rp.workers)]
    kv_side = side.startswith("kvroute")
    if kv_side:
        router = kvroute.Router(names, block_size=block_size, speculative_ttl_s=0)
        select, complete, ingest = router.select_worker, router.complete, router.ingest
        from_list = side == "kvroute (list)"

        def lookup(op: ReplayOp) -> None:
            complete(select(op.token_list if from_list else op.tokens))

        def event(w: int, kv: bytes, _dy: bytes) -> None:
            ingest(names[w], kv)
    else:
        tree, tids = new_threads(dcore.RadixTree)
        tree_cpu = ThreadCpu(tids)
        hash_seq, find, apply = dcore.compute_block_hash_for_seq, tree.find_matches, \
            tree.apply_event

        def lookup(op: ReplayOp) -> None:
            find(hash_seq(op.token_list, block_size))

        def event(w: int, _kv: bytes, dy: bytes) -> None:
            apply(w, dy)

    parts = [[op for op in rp.ops if op.worker % threads == t] for t in range(threads)]
    lat = [np.empty(len(p), dtype=np.int64) for p in parts]
    cpu = [0] * threads
    barrier = threading.Barrier(threads + 1)

    def run(t: int) -> None:
        clock = time.perf_counter_ns
        out = lat[t]
        barrier.wait()
        c0 = time.thread_time_ns()
        for i, op in enumerate(parts[t]):
            t0 = clock()
            lookup(op)
            out[i] = clock() - t0
            for kv, dy, _n in op.events:
                event(op.worker, kv, dy)
        cpu[t] = time.thread_time_ns() - c0

    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    gc.collect()
    gc.disable()
    other0 = tree_cpu.ns() if side == "dynamo" else 0
    try:
        barrier.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        gc.enable()
    cpu_s = (sum(cpu) + (tree_cpu.ns() - other0 if side == "dynamo" else 0)) / 1e9
    if side == "dynamo":
        tree_cpu.close()
    if kv_side:
        check_kv(router, rp.stored_blocks, rp.removed_blocks)
        router.close()
    ops = rp.lookups + rp.events
    blocks = rp.lookup_blocks + rp.stored_blocks + rp.removed_blocks
    s = stats_us(np.concatenate(lat))
    return {"side": side, "threads": threads, "ops": ops, "wall_s": wall, "ops_per_s": ops / wall,
            "cpu_s": cpu_s, "ops_per_cpu_s": ops / cpu_s,
            "block_ops_per_s": blocks / wall, "lookup_p50_us": s["p50"],
            "lookup_p99_us": s["p99"], "lookup_mean_us": s["mean"]}


# -- report --------------------------------------------------------------------------------
def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def spread(blocks: int, runs: Optional[list]) -> str:
    """min-max M blocks/s over runs."""
    if not runs or len(runs) < 2:
        return "-"
    return f"{blocks / max(runs) / 1e6:.2f}-{blocks / min(runs) / 1e6:.2f}"


def machine_info() -> dict:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "python": sys.version.split()[0],
                            "platform": platform.platform()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "L2 cache",
                             "L3 cache", "Hypervisor vendor"):
                info[k.strip()] = v.strip()
    except OSError:
        pass
    return info


def versions(dcore: Any) -> dict:
    import importlib.metadata as md

    out = {"kvroute": getattr(kvroute, "__version__", "?"), "numpy": np.__version__,
           "msgspec": msgspec.__version__}
    for dist in ("ai-dynamo-runtime", "pyzmq"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    out["dynamo._core"] = getattr(dcore, "__version__", "?")
    core = Path(sys.modules["kvroute._core"].__file__)
    st = core.stat()
    out["kvroute_core"] = {"path": str(core), "bytes": st.st_size,
                           "mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(st.st_mtime)),
                           "sha256": __import__("hashlib").sha256(core.read_bytes()).hexdigest(),
                           "from_core_flag": _CORE_PATH is not None}
    try:
        out["kvroute_commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
            text=True).stdout.strip()
        out["kvroute_cpp_dirty"] = bool(subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "cpp"], capture_output=True,
            text=True).stdout.strip())
    except OSError:
        pass
    return out


def print_tables(res: dict) -> None:
    a = res["args"]
    if res["lookup"]:
        print(f"\n### Lookup: prompt tokens -> per-worker overlap, hashing included "
              f"(us per call from Python; one pass of {a['calls']} interleaved calls per side "
              f"and cell; index {a['index_blocks']:,} blocks, block size {a['block_size']})")
        w = [6, 4, 22, 18, 7, 7, 7, 7, 7, 7, 9, 9, 9, 9, 6, 6, 6, 4]
        hdr = ["tokens", "N", "kvroute path", "Dynamo path", "kv p50", "kv p99", "dyn p50",
               "dyn p99", "ratio50", "ratio99", "kv cold50", "dy cold50", "kv warm50",
               "dy warm50", "kv cpu", "dyncpu", "matchd", "mism"]
        print(fmt_row(hdr, w))
        print(fmt_row(["-" * x for x in w], w))
        for row in res["lookup"]:
            for side, peer in DYN_PEER.items():
                k, d = row["sides"][side], row["sides"][peer]
                kc, dc = row["cpu"][side]["p50"], row["cpu"][peer]["p50"]
                print(fmt_row([row["tokens"], row["workers"], side.replace("kv ", ""),
                               peer.replace("dynamo ", ""),
                               f"{k['p50']:.1f}", f"{k['p99']:.1f}",
                               f"{d['p50']:.1f}", f"{d['p99']:.1f}",
                               ratio(k["p50"], d["p50"]), ratio(k["p99"], d["p99"]),
                               f"{row['cold'][side]['p50']:.1f}",
                               f"{row['cold'][peer]['p50']:.1f}",
                               f"{row['warm'][side]['p50']:.1f}",
                               f"{row['warm'][peer]['p50']:.1f}", f"{kc:.1f}", f"{dc:.1f}",
                               f"{row['matched']:.0f}", row["mismatches"]], w))
            c = row["cold"]["kv select (np)"]["n"]
            print(f"  ({row['tokens']} tokens, N={row['workers']}: {c} cold calls, "
                  f"{row['warm']['kv select (np)']['n']} warm)")
        print("ratio = kvroute / Dynamo time (< 1: kvroute faster), the same work per call: "
              "find_matches (a dict of every worker's match) against Dynamo "
              "compute_block_hash_for_seq(list) + RadixTree.find_matches + .scores (a dict); "
              "select (one decision) against Dynamo without .scores; (np) = a uint32 array, "
              "(list) = a new list of new ints per call and side; cold = the prompt's prefix "
              "not looked up before in these indexes, warm = looked up before; kv cpu / "
              "dyncpu = p50 on-CPU us per call (kvroute: calling thread; Dynamo: calling "
              "thread + its RadixTree thread), immune to preemption; matchd = mean best "
              "per-worker overlap in blocks; mism = calls whose per-worker overlap differed "
              "between the indexes (must be 0)")
        if res.get("fixed"):
            f = res["fixed"]
            print(f"fixed cost (one unmatched block, {f['calls']} calls): kvroute select "
                  f"p50 {f['kv select (list)']['p50']:.1f} us (on-CPU "
                  f"{f['cpu']['kv select (list)']['p50']:.1f}); Dynamo hash+find_matches p50 "
                  f"{f['dynamo (list)']['p50']:.1f} us (on-CPU, both threads, "
                  f"{f['cpu']['dynamo (list)']['p50']:.1f}), "
                  f"find_matches([]) alone p50 "
                  f"{f['dynamo find_matches([])']['p50']:.1f} us (its request/response hop "
                  f"to the RadixTree thread)")
    if res["ingest"]:
        print(f"\n### Ingestion: one event ({a['event_blocks']} blocks) per call, each side "
              f"in its own wire format, encoding excluded (M blocks/s of wall time)")
        w = [4, 7, 10, 8, 9, 9, 8, 7, 7, 11, 11, 8, 8, 7]
        hdr = ["N", "op", "blocks", "events", "kv B/blk", "dyn B/blk", "kv M/s", "dyn M/s",
               "ratio", "kv range", "dyn range", "kv work", "dyn work", "ratioW"]
        print(fmt_row(hdr, w))
        print(fmt_row(["-" * x for x in w], w))
        for row in res["ingest"]:
            work = ["-", "-", "-"]
            if "kv_work_s" in row:
                kw, dw = row["blocks"] / row["kv_work_s"], row["blocks"] / row["dyn_work_s"]
                work = [f"{kw / 1e6:.2f}", f"{dw / 1e6:.2f}", ratio(kw, dw)]
            print(fmt_row([row["workers"], row["op"], f"{row['blocks']:,}", f"{row['events']:,}",
                           f"{row['kv_bytes_per_block']:.0f}",
                           f"{row['dyn_bytes_per_block']:.0f}",
                           f"{row['kv_blocks_per_s'] / 1e6:.2f}",
                           f"{row['dyn_blocks_per_s'] / 1e6:.2f}",
                           ratio(row["kv_blocks_per_s"], row["dyn_blocks_per_s"]),
                           spread(row["blocks"], row.get("kv_runs_s")),
                           spread(row["blocks"], row.get("dyn_runs_s")), *work], w))
        print("ratio = kvroute / Dynamo blocks per second (> 1: kvroute faster); kvroute: "
              "Router.ingest(vLLM msgpack batch); Dynamo: RadixTree.apply_event(KvCacheEvent "
              "JSON); Python loop included on both sides; store: median of the runs (fresh "
              "indexes, first side alternating), range = min-max M/s; remove: one run; "
              "churn: at full size, the newest tenth of the events removed and stored again, "
              "5 times (steady state: tables at full load), one run; re-store: the stores "
              "again into the emptied indexes (tables sized, filling from empty), one run; "
              "work (store): M blocks/s from each event's fastest call across the runs, "
              "summed (the VM's slow spells and preemption left out, as bench_select.py's "
              "work per call), ratioW its kvroute / Dynamo ratio")
    if res.get("zmq"):
        z = res["zmq"]
        cpu = f"{z['blocks_per_cpu_s'] / 1e6:.2f}" if z["blocks_per_cpu_s"] else "-"
        print(f"kvroute over ZeroMQ end to end (N={z['workers']} PUB sockets, "
              f"{z['blocks']:,}/{z['expected']:,} blocks): {z['blocks_per_s'] / 1e6:.2f} "
              f"M blocks/s wall ({cpu} M per ingest-thread CPU-s), publisher took "
              f"{z['send_s']:.2f} s of {z['total_s']:.2f} s, gaps {z['gaps']}")
    if res["memory"]:
        print("\n### Memory per indexed (block, worker): VmRSS growth while building the "
              "index, fresh process per side")
        w = [4, 10, 10, 10, 11, 10, 7]
        hdr = ["N", "entries", "kv RSS B", "kv idx B", "dyn RSS B", "kv MiB", "ratio"]
        print(fmt_row(hdr, w))
        print(fmt_row(["-" * x for x in w], w))
        for row in res["memory"]:
            e = row["entries"]
            kv, dy = row["kvroute"]["rss"] / e, row["dynamo"]["rss"] / e
            print(fmt_row([row["workers"], f"{e:,}", f"{kv:.1f}",
                           f"{row['kvroute']['index_bytes'] / e:.1f}", f"{dy:.1f}",
                           f"{row['kvroute']['rss'] / 2**20:.0f}", ratio(kv, dy)], w))
        print("B = bytes per (block, worker) entry; kv idx = stats()['index_memory_bytes'] / "
              "entries; ratio = kvroute / Dynamo RSS bytes (< 1: kvroute smaller)")
    if res["replay"]:
        rp = res["replay_workload"]
        print(f"\n### Index replay, mooncake_bench style: {rp['lookups']:,} requests over "
              f"{rp['workers']} workers (LRU {a['replay_capacity']} blocks each), "
              f"{rp['events']:,} events ({rp['stored_blocks']:,} blocks stored, "
              f"{rp['removed_blocks']:,} removed), closed loop")
        w = [7, 14, 9, 9, 11, 9, 9, 8, 8, 11, 7]
        hdr = ["threads", "side", "ops", "wall s", "ops/s", "M blk/s", "p50 us", "p99 us",
               "ratio", "ops/cpu-s", "ratioC"]
        print(fmt_row(hdr, w))
        print(fmt_row(["-" * x for x in w], w))
        by = {(r["side"], r["threads"]): r for r in res["replay"]}
        for r in res["replay"]:
            other = by.get(("dynamo", r["threads"]))
            mine = other and r["side"].startswith("kvroute")
            rt = ratio(r["ops_per_s"], other["ops_per_s"]) if mine else ""
            rc = ratio(r["ops_per_cpu_s"], other["ops_per_cpu_s"]) if mine else ""
            print(fmt_row([r["threads"], r["side"], f"{r['ops']:,}", f"{r['wall_s']:.2f}",
                           f"{r['ops_per_s']:,.0f}", f"{r['block_ops_per_s'] / 1e6:.2f}",
                           f"{r['lookup_p50_us']:.1f}", f"{r['lookup_p99_us']:.1f}", rt,
                           f"{r['ops_per_cpu_s']:,.0f}", rc], w))
        print("ops = lookups + events; M blk/s = (lookup blocks + event blocks) / wall; p50/p99 "
              "= lookup latency (kvroute select_worker + complete, on a uint32 array or on a "
              "new list per request (list); Dynamo hash of a new list + find_matches, its "
              "scores left in Rust: one answer per request on every side); ratio = "
              "kvroute / Dynamo ops/s; ops/cpu-s = ops per on-CPU second of the replay "
              "threads (+ Dynamo's RadixTree thread), ratioC its kvroute / Dynamo ratio")
    print(f"\nload average: start {res['loadavg_start']}, end {res['loadavg_end']}")


def verdicts(res: dict) -> list[str]:
    out = []
    for row in res["lookup"]:
        if row["tokens"] == 8192 and row["workers"] == 64:
            for side, peer in DYN_PEER.items():
                d = row["sides"][peer]
                k = row["sides"][side]
                out.append(f"lookup 8K/64 {side} vs {peer}: Dynamo/kvroute = "
                           f"{d['p50'] / k['p50']:.2f}x "
                           f"(p50), {d['mean'] / k['mean']:.2f}x (mean) -> target >= 3x "
                           f"{'met' if d['p50'] / k['p50'] >= 3 else 'NOT met'} at p50; "
                           f"p99 {k['p99']:.1f} us -> target <= 12 us "
                           f"{'met' if k['p99'] <= 12 else 'NOT met'}")
    for row in res["ingest"]:
        if row["op"] in ("store", "churn"):
            r = row["kv_blocks_per_s"] / row["dyn_blocks_per_s"]
            what = "ingest" if row["op"] == "store" else "ingest, steady state (churn),"
            line = (f"{what} N={row['workers']}: kvroute {row['kv_blocks_per_s'] / 1e6:.2f} "
                    f"M/s = {r:.2f}x Dynamo -> >= 2x {'met' if r >= 2 else 'NOT met'}, "
                    f">= 3M/s {'met' if row['kv_blocks_per_s'] >= 3e6 else 'NOT met'}")
            if "kv_work_s" in row:
                kw = row["blocks"] / row["kv_work_s"]
                rw = row["dyn_work_s"] / row["kv_work_s"]
                line += (f"; work {kw / 1e6:.2f} M/s = {rw:.2f}x Dynamo's -> >= 3M/s "
                         f"{'met' if kw >= 3e6 else 'NOT met'}")
            out.append(line)
    for row in res["memory"]:
        e = row["entries"]
        kv, dy = row["kvroute"]["rss"] / e, row["dynamo"]["rss"] / e
        out.append(f"memory N={row['workers']}: kvroute {kv:.0f} B/entry (RSS), "
                   f"{kv / dy:.2f}x Dynamo -> <= 48 B {'met' if kv <= 48 else 'NOT met'}, "
                   f"<= 0.5x {'met' if kv / dy <= 0.5 else 'NOT met'}")
    return out


# -- main ----------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--parts", default="lookup,ingest,zmq,memory,replay", help="what to run")
    ap.add_argument("--workers", default="8,64,256", help="worker counts, comma-separated")
    ap.add_argument("--lengths", default="1024,8192,32768", help="prompt lengths in tokens")
    ap.add_argument("--index-blocks", type=int, default=1_000_000,
                    help="distinct blocks to index")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--event-blocks", type=int, default=64, help="blocks per stored event")
    ap.add_argument("--ingest-runs", type=int, default=3,
                    help="store runs per side and N (fresh indexes; median shown)")
    ap.add_argument("--calls", type=int, default=1000, help="timed calls per side and cell")
    ap.add_argument("--warmup", type=int, default=100, help="untimed calls before each cell")
    ap.add_argument("--hit-frac", type=float, default=0.75,
                    help="fraction of a prompt's blocks that is an indexed prefix")
    ap.add_argument("--replay-workers", type=int, default=1024)
    ap.add_argument("--replay-requests", type=int, default=4000,
                    help="first requests of the trace to replay (0: all 12,031)")
    ap.add_argument("--replay-capacity", type=int, default=4096, help="blocks per worker")
    ap.add_argument("--replay-threads", default="1,2")
    ap.add_argument("--zmq-timeout", type=float, default=120.0)
    ap.add_argument("--trace", default="conversation",
                    choices=["conversation", *SHAPES],
                    help="the Mooncake conversation trace (shared data), or a generated "
                         "stand-in with the published shape of the release's tool-and-agent "
                         "or synthetic workload (shaped_rows)")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="shared data directory (default $KVROUTE_SHARED_DATA or ../shared/data)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run (~10 s): 30k blocks, N=4,16, 1K/4K tokens, 60 calls, "
                         "replay of 300 requests over 64 workers (explicit flags win)")
    ap.add_argument("--core", default=None,
                    help="path of a saved kvroute._core build to measure instead of the "
                         "installed one (e.g. the 'before' .so)")
    ap.add_argument("--dump-store", type=Path, default=None,
                    help="write each N's store workload (kvroute's msgpack batches) to "
                         "DIR/store_N.bin for benchmarks/ab_ingest, and stop")
    ap.add_argument("--mem-child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--mem-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--mem-workers", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mem_child:
        memory_child(args.mem_child, args.mem_file, args.mem_workers, args.block_size)
        return {}
    if args.quick:  # smaller values for every knob left at its default
        quick = {"index_blocks": 30_000, "workers": "4,16", "lengths": "1024,4096",
                 "calls": 60, "warmup": 10, "replay_workers": 64, "replay_requests": 300,
                 "replay_capacity": 1024, "ingest_runs": 1}
        for k, v in quick.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    parts = set(args.parts.split(","))
    unknown = parts - {"lookup", "ingest", "zmq", "memory", "replay"}
    if unknown:
        ap.error(f"unknown --parts {sorted(unknown)}")
    dcore = import_dynamo()
    workers = [int(x) for x in args.workers.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    data_dir = args.data_dir or default_data_dir()
    res: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None
                                                        else sys.argv[1:])),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if not k.startswith("mem_")},
        "machine": machine_info(), "versions": versions(dcore),
        "loadavg_start": loadavg(), "lookup": [], "ingest": [], "memory": [], "replay": [],
        "zmq": None, "fixed": None,
    }
    kc = res["versions"]["kvroute_core"]
    print(f"# kvroute vs Dynamo ({res['versions']['ai-dynamo-runtime']}); kvroute._core "
          f"{kc['path']} (built {kc['mtime']} UTC, sha256 {kc['sha256'][:12]}); load average "
          f"{res['loadavg_start']}", flush=True)
    t0 = time.perf_counter()
    if args.trace == "conversation":
        trace = MooncakeBlocks(data_dir / MOONCAKE_FILE, args.block_size)
    else:
        trace = MooncakeBlocks(None, args.block_size, shaped_rows(args.trace, args.seed))
    res["trace"] = {"name": args.trace, "requests": len(trace),
                    "mean_input": float(np.mean(trace.lengths))}
    print(f"# trace: {args.trace}, {len(trace):,} requests, mean input "
          f"{res['trace']['mean_input']:,.0f} tokens ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    bs = args.block_size
    tmp = Path(tempfile.mkdtemp(prefix="compare_dynamo_"))
    for n in workers if parts & {"lookup", "ingest", "zmq", "memory"} else []:
        t0 = time.perf_counter()
        wl = build_index(trace, dcore, n, args.index_blocks, args.event_blocks, args.seed)
        print(f"# N={n}: {wl.distinct:,} distinct blocks, {wl.entries:,} (block, worker) "
              f"entries from {len(wl.held):,} requests, {len(wl.store.kv):,} events; encoded "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
        names = [f"w{i}" for i in range(n)]
        if args.dump_store is not None:
            dump_store(wl, args.dump_store / f"store_{n}.bin")
            continue
        if parts & {"lookup", "ingest"}:
            kv_runs, dy_runs = [], []
            kv_calls, dy_calls = [], []  # per run, each event's ns
            for run in range(args.ingest_runs):  # fresh indexes each run; the last one stays
                if run:
                    router.close()
                    del router, tree
                    time.sleep(1.0)  # let Dynamo's tree thread free the previous tree
                router = kvroute.Router(names, block_size=bs, speculative_ttl_s=0)
                tree, tree_tids = new_threads(dcore.RadixTree)
                kv_calls.append([0] * len(wl.store.kv))
                dy_calls.append([0] * len(wl.store.dyn))
                kv_s, dy_s = feed_both(router, names, tree, wl.store, kv_first=run % 2 == 1,
                                       kv_calls=kv_calls[-1], dy_calls=dy_calls[-1])
                kv_runs.append(kv_s)  # (which side goes first alternates)
                dy_runs.append(dy_s)
                check_kv(router, wl.entries, 0)
            kv_s, dy_s = float(np.median(kv_runs)), float(np.median(dy_runs))
            st = router.stats()
            if st["indexed_entries"] != wl.entries or st["distinct_block_keys"] != wl.distinct:
                raise SystemExit(f"kvroute index holds {st['indexed_entries']} entries / "
                                 f"{st['distinct_block_keys']} keys, expected {wl.entries} / "
                                 f"{wl.distinct}")
            ing = {**ingest_row(n, "store", wl.entries, wl.store, kv_s, dy_s),
                   "runs": args.ingest_runs, "kv_runs_s": kv_runs, "dyn_runs_s": dy_runs,
                   "kv_work_s": work_seconds(kv_calls), "dyn_work_s": work_seconds(dy_calls)}
            print(f"# N={n}: store kvroute {ing['kv_blocks_per_s'] / 1e6:.2f} M/s, Dynamo "
                  f"{ing['dyn_blocks_per_s'] / 1e6:.2f} M/s", flush=True)
            if "lookup" in parts:
                tree_cpu = ThreadCpu(tree_tids)
                if res["fixed"] is None:
                    one = PromptSource(trace, wl, bs, 0.0, np.random.default_rng(1))
                    fx = time_lookups(router, tree, dcore, one, 2000, 100, bs, tree_cpu)
                    empty = np.empty(2000, dtype=np.int64)
                    for i in range(2000):
                        c0 = time.perf_counter_ns()
                        tree.find_matches([])
                        empty[i] = time.perf_counter_ns() - c0
                    res["fixed"] = {"calls": 2000, **{s: stats_us(v) for s, v in fx["ns"].items()},
                                    "cpu": {s: stats_us(v) for s, v in fx["cpu"].items()},
                                    "dynamo find_matches([])": stats_us(empty)}
                for length in lengths:
                    src = PromptSource(trace, wl, length, args.hit_frac,
                                       np.random.default_rng(args.seed + length))
                    gc.collect()
                    gc.disable()
                    try:
                        out = time_lookups(router, tree, dcore, src, args.calls, args.warmup, bs,
                                           tree_cpu)
                    finally:
                        gc.enable()
                    cold = out["cold"]
                    row = {"tokens": length, "workers": n, "matched": out["matched"],
                           "mismatches": out["mismatches"],
                           "sides": {s: stats_us(v) for s, v in out["ns"].items()},
                           "cold": {s: stats_us(v[cold]) for s, v in out["ns"].items()},
                           "warm": {s: stats_us(v[~cold]) for s, v in out["ns"].items()},
                           "cpu": {s: stats_us(v) for s, v in out["cpu"].items()}}
                    res["lookup"].append(row)
                    k, d = row["sides"]["kv select (np)"], row["sides"]["dynamo (list)"]
                    print(f"# N={n} {length} tokens: kv select p50 {k['p50']:.1f} / p99 "
                          f"{k['p99']:.1f} us, Dynamo p50 {d['p50']:.1f} / p99 {d['p99']:.1f} "
                          f"us, matched {out['matched']:.0f}, mismatches {out['mismatches']}",
                          flush=True)
            if "ingest" in parts:
                kv_first = args.ingest_runs % 2 == 1
                # Churn at full size: the newest tenth of the events removed (chain tails
                # first, as vLLM evicts) and stored again, five times, so the indexes stay
                # between 90 and 100 % of their entries and the tables at their full load.
                probe = PromptSource(trace, wl, 1024, 1.0, np.random.default_rng(3)).next()
                churn, churn_blocks = churn_payloads(wl, 10, 5)
                kv_c, dy_c = feed_both(router, names, tree, churn, kv_first)
                check_kv(router, wl.entries + churn_blocks // 2, churn_blocks // 2)
                if router.stats()["indexed_entries"] != wl.entries:
                    raise SystemExit("kvroute churn check failed: entries changed")
                check_same_match(router, tree, dcore, probe, bs, "churn")
                churned = ingest_row(n, "churn", churn_blocks, churn, kv_c, dy_c)
                kv_r, dy_r = feed_both(router, names, tree, wl.remove, kv_first)
                check_kv(router, wl.entries + churn_blocks // 2, wl.entries + churn_blocks // 2)
                left = router.stats()["indexed_entries"]
                if left:
                    raise SystemExit(f"kvroute holds {left} entries after removing all")
                res["ingest"].append(ing)
                res["ingest"].append(churned)
                res["ingest"].append(ingest_row(n, "remove", wl.entries, wl.remove, kv_r, dy_r))
                # The same stores again into the emptied indexes: filling from empty with the
                # tables already sized (kvroute does not grow them again). Lighter than a
                # steady state (the tables run below their full load): that is "churn".
                kv_a, dy_a = feed_both(router, names, tree, wl.store, kv_first)
                check_kv(router, 2 * wl.entries + churn_blocks // 2,
                         wl.entries + churn_blocks // 2)
                check_same_match(router, tree, dcore, probe, bs, "re-store")
                res["ingest"].append(ingest_row(n, "re-store", wl.entries, wl.store, kv_a, dy_a))
            if "lookup" in parts:
                tree_cpu.close()
            router.close()
            del router, tree
        if "zmq" in parts and n == min(workers):
            res["zmq"] = bench_zmq(wl, bs, args.zmq_timeout)
            print(f"# zmq N={n}: {res['zmq']['blocks_per_s'] / 1e6:.2f} M blocks/s", flush=True)
        if "memory" in parts:
            res["memory"].append(bench_memory(wl, bs, tmp))
            m = res["memory"][-1]
            print(f"# memory N={n}: kvroute {m['kvroute']['rss'] / wl.entries:.1f} B/entry, "
                  f"Dynamo {m['dynamo']['rss'] / wl.entries:.1f} B/entry", flush=True)
        del wl
        gc.collect()
    if "replay" in parts:
        t0 = time.perf_counter()
        rp = build_replay(trace, dcore, args.replay_workers, args.replay_requests,
                          args.replay_capacity, args.event_blocks, args.seed)
        res["replay_workload"] = {"workers": rp.workers, "lookups": rp.lookups,
                                  "lookup_blocks": rp.lookup_blocks, "events": rp.events,
                                  "stored_blocks": rp.stored_blocks,
                                  "removed_blocks": rp.removed_blocks}
        print(f"# replay: {rp.lookups:,} requests, {rp.events:,} events over {rp.workers} "
              f"workers; built in {time.perf_counter() - t0:.1f} s", flush=True)
        for threads in [int(x) for x in args.replay_threads.split(",")]:
            for side in ("kvroute", "kvroute (list)", "dynamo"):
                r = run_replay(side, rp, dcore, threads, bs)
                res["replay"].append(r)
                print(f"# replay {side} x{threads}: {r['ops_per_s']:,.0f} ops/s, lookup p99 "
                      f"{r['lookup_p99_us']:.1f} us", flush=True)
        del rp
    try:
        tmp.rmdir()
    except OSError:
        pass
    res["loadavg_end"] = loadavg()
    print_tables(res)
    res["verdicts"] = verdicts(res)
    print()
    for v in res["verdicts"]:
        print(v)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
        print(f"\nwrote {args.json}")
    return res


if __name__ == "__main__":
    main()
