#!/usr/bin/env python
"""KV-event ingestion throughput (decode + apply) and index memory per (block, worker).

Three parts, each printing a plain table:

1. ``direct``: payloads pre-encoded with kvroute.wire (real vLLM msgpack), then
   timed `Router.ingest` calls in a Python loop (the GIL is released inside; decode and
   apply run on the calling thread). Blocks/s = blocks stored (or removed) / wall time.
   Cases vary blocks per event, events per batch, encoding era and hash form; one case runs
   two Python threads feeding two different workers.
2. ``zmq``: the same payloads over real ZeroMQ. A pyzmq PUB socket binds
   tcp://127.0.0.1:<free port>; a Router with ``Worker(url, kv_endpoint=...)`` connects its
   native SUB socket; 3-frame messages [topic, seq (8 bytes big-endian), payload] are sent
   and the clock stops when ``stats()['workers'][w]['blocks_stored']`` reaches the total.
3. ``memory``: ~``--mem-blocks`` distinct blocks held by 1 and by 4 workers each:
   ``index_memory_bytes / indexed_entries`` and the VmRSS growth per (block, worker) entry.

Run ``python benchmarks/bench_ingest.py`` (about 1-2 min on 2 cores) or ``--quick`` (~10 s).
"""

from __future__ import annotations

import os

# numpy's OpenBLAS threads spin after numpy calls and steal the second core on small boxes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402

import kvroute  # noqa: E402
import kvroute.wire as ee  # noqa: E402  (engine-faithful vLLM payload encoder)

VOCAB = 151_936  # Qwen-sized vocabulary: most ids need 5 msgpack bytes, as in real traffic


@dataclass(frozen=True)
class Case:
    name: str
    blocks_per_event: int
    events_per_batch: int = 1
    era: str = "map"
    hash_form: str = "u64"  # kvroute.wire.as_hash form
    # "store"; "remove": BlockRemoved of blocks stored beforehand (untimed); "restore": the
    # same stores again after storing and removing them all (untimed), so the tables are
    # already sized: steady state, no growth
    op: str = "store"
    threads: int = 1


CASES = [
    Case("store 1 ev x 16 blk", 16),
    Case("store 1 ev x 64 blk", 64),
    Case("store 1 ev x 256 blk", 256),
    Case("store 8 ev x 16 blk", 16, events_per_batch=8),
    Case("store 1x64 array era", 64, era="array_full"),
    Case("store 1x64 bin32 hash", 64, hash_form="bin32"),
    Case("store 1x64, sized tables", 64, op="restore"),
    Case("remove 1 ev x 64 blk", 64, op="remove"),
    Case("store 1x64, 2 threads", 64, threads=2),
]


@dataclass
class Stream:
    """Pre-encoded batches of one case: (worker index, payload, blocks in it)."""

    batches: list[tuple[int, bytes, int]]
    removes: list[tuple[int, bytes, int]]
    blocks: int


def build_stream(case: Case, total_blocks: int, workers: int, chain_blocks: int,
                 block_size: int, rng: np.random.Generator) -> Stream:
    """Batches of BlockStored events, workers interleaved. Each worker runs
    ``events_per_batch`` concurrent requests (chains of ``chain_blocks`` blocks linked by
    parent_block_hash); one batch carries one event of each."""
    bpe, epb = case.blocks_per_event, case.events_per_batch
    per_batch = bpe * epb
    nbatches = max(1, total_blocks // per_batch)
    # parent engine hash of each (worker, lane); None = the next event starts a request
    parents: dict[tuple[int, int], object] = {}
    done: dict[tuple[int, int], int] = {}
    batches: list[tuple[int, bytes, int]] = []
    removes: list[tuple[int, bytes, int]] = []
    toks = rng.integers(0, VOCAB, nbatches * per_batch * block_size, dtype=np.uint32)
    hs = rng.integers(0, 2**64, nbatches * per_batch, dtype=np.uint64, endpoint=False)
    toks_l = toks.tolist()
    hs_l = hs.tolist()
    if case.hash_form != "u64":
        hs_l = [ee.as_hash(h, case.hash_form) for h in hs_l]
    k = 0
    for b in range(nbatches):
        w = b % workers
        events = []
        for lane in range(epb):
            key = (w, lane)
            if done.get(key, 0) >= chain_blocks:
                parents[key], done[key] = None, 0
            h = hs_l[k:k + bpe]
            t = toks_l[k * block_size:(k + bpe) * block_size]
            events.append(ee.stored(h, parents.get(key), t, block_size))
            parents[key] = h[-1]
            done[key] = done.get(key, 0) + bpe
            k += bpe
        batches.append((w, ee.encode_batch(events, era=case.era, ts=1.0), per_batch))
        if case.op in ("remove", "restore"):
            rm = [ee.removed(e.block_hashes) for e in events]
            removes.append((w, ee.encode_batch(rm, era=case.era, ts=1.0), per_batch))
    return Stream(batches, removes, nbatches * per_batch)


def feed(router: kvroute.Router, names: list[str], batches, threads: int) -> tuple[float, float]:
    """Calls router.ingest for every batch; with threads > 1, thread i feeds the workers
    w with w % threads == i. Returns (wall seconds, CPU seconds of the feeding threads)."""
    if threads == 1:
        ingest = router.ingest
        c0 = time.thread_time()
        t0 = time.perf_counter()
        for w, p, _ in batches:
            ingest(names[w], p)
        t1 = time.perf_counter()
        return t1 - t0, time.thread_time() - c0
    parts = [[(names[w], p) for w, p, _ in batches if w % threads == i] for i in range(threads)]
    barrier = threading.Barrier(threads + 1)
    cpu = [0.0] * threads

    def run(i: int) -> None:
        ingest = router.ingest
        barrier.wait()
        c0 = time.thread_time()
        for name, p in parts[i]:
            ingest(name, p)
        cpu[i] = time.thread_time() - c0

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0, sum(cpu)


def check(router: kvroute.Router, stored: int, removed: int = 0) -> None:
    st = router.stats()
    got = sum(w["blocks_stored"] for w in st["workers"].values())
    rem = sum(w["blocks_removed"] for w in st["workers"].values())
    bad = {k: v for k, v in st["dropped"].items() if v}
    orphans = sum(w["orphan_stores"] for w in st["workers"].values())
    if got != stored or rem != removed or bad or orphans:
        raise SystemExit(f"ingest check failed: stored {got}/{stored}, removed {rem}/{removed}, "
                         f"drops {bad}, orphans {orphans}")


def loadavg() -> str:
    """1/5/15-minute load averages: other work on the machine shows up in the results."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"


def fmt_row(cols: list, widths: list[int]) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cols, widths))


# -- 1. direct ----------------------------------------------------------------------------
def bench_direct(args: argparse.Namespace, cases: list[Case]) -> list[str]:
    widths = [24, 8, 8, 5, 8, 10, 10, 11]
    hdr = ["case", "blocks", "payloads", "B/blk", "us/call", "M blk/s", "M blk/cpu-s",
           "wall spread"]
    out = [fmt_row(hdr, widths), fmt_row(["-" * w for w in widths], widths)]
    print(out[0], flush=True)
    names = [f"w{i}" for i in range(args.workers)]
    # Fixed cost of one ingest call: an empty batch (decoded, nothing to apply).
    empty = ee.encode_batch([], era="map", ts=1.0)
    r = kvroute.Router(names, block_size=args.block_size, speculative_ttl_s=0)
    n = 20000
    c0, t0 = time.thread_time(), time.perf_counter()
    for i in range(n):
        r.ingest(names[i % len(names)], empty)
    fixed_us = (time.perf_counter() - t0) / n * 1e6
    fixed_cpu_us = (time.thread_time() - c0) / n * 1e6
    r.close()
    fixed = (f"fixed cost of one ingest call from Python (empty batch, {n} calls): "
             f"{fixed_us:.2f} us wall, {fixed_cpu_us:.2f} us CPU")
    print(fixed, flush=True)
    for ci, case in enumerate(cases):
        rng = np.random.default_rng(args.seed + ci)
        stream = build_stream(case, args.blocks, args.workers, args.chain_blocks,
                              args.block_size, rng)
        nbytes = sum(len(p) for _, p, _ in stream.batches)
        rates, cpu_rates = [], []
        for _ in range(args.runs):
            r = kvroute.Router(names, block_size=args.block_size, speculative_ttl_s=0)
            gc.collect()
            gc.disable()
            try:
                if case.op == "remove":
                    feed(r, names, stream.batches, 1)
                    secs, cpu = feed(r, names, stream.removes, case.threads)
                    check(r, stream.blocks, stream.blocks)
                    calls = len(stream.removes)
                elif case.op == "restore":
                    feed(r, names, stream.batches, 1)
                    feed(r, names, stream.removes, 1)
                    secs, cpu = feed(r, names, stream.batches, case.threads)
                    check(r, 2 * stream.blocks, stream.blocks)
                    calls = len(stream.batches)
                else:
                    secs, cpu = feed(r, names, stream.batches, case.threads)
                    check(r, stream.blocks)
                    calls = len(stream.batches)
            finally:
                gc.enable()
            r.close()
            del r
            rates.append(stream.blocks / secs)
            cpu_rates.append(stream.blocks / cpu)
        med = float(np.median(rates))
        spread = f"{min(rates) / 1e6:.2f}-{max(rates) / 1e6:.2f}" if len(rates) > 1 else "-"
        us_call = stream.blocks / med / calls * 1e6
        line = fmt_row([case.name, stream.blocks, calls, f"{nbytes / stream.blocks:.0f}",
                        f"{us_call:.1f}", f"{med / 1e6:.2f}",
                        f"{float(np.median(cpu_rates)) / 1e6:.2f}", spread], widths)
        out.append(line)
        print(line, flush=True)
        del stream
    out.append(fixed)
    out.append(f"median of {args.runs} run(s); fresh Router with {args.workers} workers per run "
               f"(tables grow from empty); {args.block_size}-token blocks; requests of "
               f"{args.chain_blocks} blocks split into parent-linked events; B/blk = payload "
               f"bytes per block; us/call includes the Python loop; M blk/cpu-s = blocks per "
               f"second of CPU time of the feeding thread(s) (excludes preemption); wall "
               f"spread = min-max M blk/s over runs")
    return out


# -- 2. zmq -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) and name of every thread of this process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def bind_pubs(ctx, n: int) -> tuple[list[int], list]:
    """n pyzmq PUB sockets bound on free loopback ports that never drop (the subscriber is
    what is measured): (ports, sockets)."""
    import zmq

    ports = [free_port() for _ in range(n)]
    pubs = []
    for port in ports:
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(f"tcp://127.0.0.1:{port}")
        pubs.append(s)
    return ports, pubs


def bench_zmq(args: argparse.Namespace, cases: list[Case]) -> list[str]:
    import zmq

    widths = [24, 3, 3, 8, 8, 7, 8, 8, 11, 5]
    hdr = ["case", "pub", "thr", "blocks", "messages", "send s", "total s", "M blk/s",
           "M blk/cpu-s", "gaps"]
    out = [fmt_row(hdr, widths), fmt_row(["-" * w for w in widths], widths)]
    print(out[0], flush=True)
    ctx = zmq.Context()
    for ci, case in enumerate(cases):
        for npub, nthreads in args.zmq_layouts:
            rng = np.random.default_rng(args.seed + 100 + ci)
            stream = build_stream(case, args.zmq_blocks, npub, args.chain_blocks,
                                  args.block_size, rng)
            ports, pubs = bind_pubs(ctx, npub)
            workers = [kvroute.Worker(f"http://w{i}", kv_endpoint=f"tcp://127.0.0.1:{port}")
                       for i, port in enumerate(ports)]
            before = set(task_cpu())
            router = kvroute.Router(workers, block_size=args.block_size, speculative_ttl_s=0,
                                    ingest_threads=nthreads)
            # The Router's own threads: its ingestion threads (named like the process) and
            # its ZeroMQ context's I/O threads ("ZMQbg/...").
            mine = {t for t in task_cpu() if t not in before}
            time.sleep(0.5)  # slow joiner: let every SUB connect before publishing
            cpu0 = {t: c for t, (_, c) in task_cpu().items() if t in mine}
            seqs = [0] * npub
            topic = b""
            t0 = time.perf_counter()
            for w, p, _ in stream.batches:
                pubs[w].send_multipart([topic, seqs[w].to_bytes(8, "big"), p], copy=False)
                seqs[w] += 1
            t_sent = time.perf_counter() - t0
            deadline = time.perf_counter() + args.zmq_timeout
            got = 0
            while True:
                st = router.stats()
                got = sum(x["blocks_stored"] for x in st["workers"].values())
                if got >= stream.blocks or time.perf_counter() > deadline:
                    break
                time.sleep(0.0005)
            secs = time.perf_counter() - t0
            cpu1 = task_cpu()
            ingest_cpu = sum(c - cpu0.get(t, 0.0) for t, (name, c) in cpu1.items()
                             if t in mine and not name.startswith("ZMQbg"))
            gaps = sum(x["gaps"] for x in st["workers"].values())
            router.close()
            for s in pubs:
                s.close()
            rate = f"{got / secs / 1e6:.2f}" if got >= stream.blocks else (
                f"TIMEOUT {got}/{stream.blocks}")
            cpu_rate = f"{got / ingest_cpu / 1e6:.2f}" if ingest_cpu > 0 else "-"
            line = fmt_row([case.name, npub, nthreads, stream.blocks, len(stream.batches),
                            f"{t_sent:.2f}", f"{secs:.2f}", rate, cpu_rate, gaps], widths)
            out.append(line)
            print(line, flush=True)
    ctx.term()
    out.append("pub = PUB sockets (= workers, one native SUB each); thr = Router "
               "ingest_threads; total s = first send to last block applied (the clock stops "
               "within ~0.5 ms); send s = time the Python publisher took (it shares the 2 "
               "cores); M blk/cpu-s = blocks per CPU-second of the Router's ingestion threads "
               "(from /proc/self/task, 10 ms ticks; ZeroMQ I/O threads excluded)")
    return out


# -- 3. memory ----------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_child(args: argparse.Namespace, holders: int) -> None:
    """Runs in a fresh interpreter: prints one line 'keys entries index_bytes rss_bytes'."""
    nworkers = 8
    rng = np.random.default_rng(args.seed + 1000)
    # Payloads are generated once and reused for every holder (same content and engine
    # hashes on every worker), so their memory is in the baseline, not in the delta.
    stream = build_stream(Case("mem", 64), args.mem_blocks, nworkers, args.chain_blocks,
                          args.block_size, rng)
    names = [f"w{i}" for i in range(nworkers)]
    gc.collect()
    base = rss_bytes()
    r = kvroute.Router(names, block_size=args.block_size, speculative_ttl_s=0)
    ingest = r.ingest
    for w, p, _ in stream.batches:
        for j in range(holders):
            ingest(names[(w + j) % nworkers], p)
    gc.collect()
    rss = rss_bytes() - base
    st = r.stats()
    check(r, stream.blocks * holders)
    print(st["distinct_block_keys"], st["indexed_entries"], st["index_memory_bytes"], rss)


def bench_memory(args: argparse.Namespace) -> list[str]:
    import subprocess

    widths = [8, 10, 11, 10, 8, 9, 10]
    hdr = ["holders", "keys", "entries", "index MiB", "B/entry", "RSS +MiB", "RSS B/ent"]
    out = [fmt_row(hdr, widths), fmt_row(["-" * w for w in widths], widths)]
    print(out[0], flush=True)
    for holders in args.mem_holders:
        cmd = [sys.executable, __file__, "--mem-child", str(holders), "--mem-blocks",
               str(args.mem_blocks), "--chain-blocks", str(args.chain_blocks),
               "--block-size", str(args.block_size), "--seed", str(args.seed)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        keys, entries, index_bytes, rss = (int(x) for x in res.stdout.split()[-4:])
        line = fmt_row([holders, f"{keys:,}", f"{entries:,}", f"{index_bytes / 2**20:.0f}",
                        f"{index_bytes / entries:.1f}", f"{rss / 2**20:.0f}",
                        f"{rss / entries:.1f}"], widths)
        out.append(line)
        print(line, flush=True)
    out.append("one fresh process per row, 8 workers, each block stored on `holders` of them; "
               "index = stats()['index_memory_bytes'] (the core's estimate of its tables); "
               "RSS = VmRSS growth from before the Router was created to after ingestion; "
               "entries = (block, worker) pairs")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--parts", default="direct,zmq,memory", help="what to run")
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks per direct case")
    ap.add_argument("--runs", type=int, default=3, help="repetitions of each direct case")
    ap.add_argument("--workers", type=int, default=8, help="workers of the direct cases")
    ap.add_argument("--cases", default="",
                    help="substring filter on case names (comma-separated), e.g. '1 ev x 64'")
    ap.add_argument("--chain-blocks", type=int, default=512,
                    help="blocks per request chain (parent-linked events)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--zmq-blocks", type=int, default=1_000_000, help="blocks per zmq run")
    ap.add_argument("--zmq-cases", default="store 1 ev x 16 blk,store 1 ev x 64 blk",
                    help="direct case names to send over ZeroMQ")
    ap.add_argument("--zmq-layouts", default="1:1,4:1,4:2",
                    help="publishers:ingest_threads pairs")
    ap.add_argument("--zmq-timeout", type=float, default=60.0)
    ap.add_argument("--mem-blocks", type=int, default=1_000_000,
                    help="distinct blocks of the memory part")
    ap.add_argument("--mem-holders", default="1,4", help="workers holding each block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run (~10 s): 100k blocks")
    ap.add_argument("--mem-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mem_child:
        memory_child(args, args.mem_child)
        return
    if args.quick:
        args.blocks = min(args.blocks, 100_000)
        args.zmq_blocks = min(args.zmq_blocks, 100_000)
        args.mem_blocks = min(args.mem_blocks, 200_000)
        args.runs = 1
    args.zmq_layouts = [tuple(int(x) for x in p.split(":")) for p in args.zmq_layouts.split(",")]
    args.mem_holders = [int(x) for x in args.mem_holders.split(",")]
    parts = args.parts.split(",")
    cases = CASES
    if args.cases:
        pats = args.cases.split(",")
        cases = [c for c in CASES if any(p in c.name for p in pats)]
    zcases = [c for c in CASES if c.name in args.zmq_cases.split(",")]

    print(f"# kvroute, numpy {np.__version__}, python {sys.version.split()[0]}; "
          f"load average at start: {loadavg()}")
    sections = []
    if "direct" in parts:
        print("\n## direct: Router.ingest from one Python thread (decode + apply)")
        sections.append(("direct: Router.ingest (decode + apply), blocks per second",
                         bench_direct(args, cases)))
    if "zmq" in parts:
        print("\n## zmq: pyzmq PUB -> native SUB -> index")
        sections.append(("zmq: end to end over tcp://127.0.0.1", bench_zmq(args, zcases)))
    if "memory" in parts:
        print("\n## memory per (block, worker)")
        sections.append(("memory per (block, worker) entry", bench_memory(args)))
    print(f"# load average at end: {loadavg()}")
    print()
    for title, lines in sections:
        print(f"### {title}")
        for line in lines:
            print(line)
        print()


if __name__ == "__main__":
    main()
