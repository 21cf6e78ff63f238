"""compare_dynamo.py's measurements: per-call lookup timing on both sides, feeding events,
ingestion over ZeroMQ, resident memory in a child process, the closed-loop replay, and the
checks that both indexes hold the same thing."""

from __future__ import annotations

import gc
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
from _dynamo_workload import IndexWorkload, Payloads, PromptSource, Replay, ReplayOp, as_list
from bench_ingest import bind_pubs, rss_bytes, task_cpu

import kvroute
import kvroute.wire as ee  # engine-faithful vLLM payload encoder

DYNAMO_REQUIREMENT = "ai-dynamo-runtime==1.6.1"
# The harness itself: the memory child runs it with --mem-child.
SCRIPT = Path(__file__).resolve().with_name("compare_dynamo.py")


def import_dynamo() -> Any:
    """``dynamo._core`` or a SystemExit that says how to install it."""
    try:
        import dynamo._core as dcore
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(f"compare_dynamo needs NVIDIA Dynamo's Python bindings: "
                         f"pip install {DYNAMO_REQUIREMENT} ({e})") from e
    return dcore


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


def churn_payloads(wl: IndexWorkload, fraction: int, rounds: int) -> tuple[Payloads, int]:
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


def bench_memory(wl: IndexWorkload, block_size: int, tmp: Path,
                 core_path: Optional[str] = None) -> dict:
    """VmRSS growth of each side building ``wl``'s index, in a fresh interpreter each
    (compare_dynamo.py ``--mem-child``; ``core_path``: its ``--core``)."""
    res: dict[str, Any] = {"workers": wl.n_workers, "entries": wl.entries}
    for side, payloads in (("kvroute", wl.store.kv), ("dynamo", wl.store.dyn)):
        path = tmp / f"mem_{side}_{wl.n_workers}.pkl"
        with open(path, "wb") as f:
            pickle.dump((wl.store.worker, payloads), f, protocol=pickle.HIGHEST_PROTOCOL)
        cmd = [sys.executable, str(SCRIPT), "--mem-child", side, "--mem-file", str(path),
               "--mem-workers", str(wl.n_workers), "--block-size", str(block_size)]
        if core_path:
            cmd += ["--core", core_path]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        path.unlink()
        if proc.returncode != 0:
            raise SystemExit(f"memory child ({side}) failed:\n{proc.stderr[-2000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        res[side] = out
    return res


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
