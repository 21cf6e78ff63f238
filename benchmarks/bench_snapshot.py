"""Bootstrap cost vs index size: a peer's snapshot dumped, parsed and restored.

Builds a router of ``--workers`` workers holding ``--entries`` (block, worker) entries in all
(each worker's prompts of 64 blocks, chained, ingested as engine events with sequence
numbers), then times, per size: `kvroute.snapshot.iter_snapshot` (the peer's dump), bytes
out, `parse_snapshot` and `restore_snapshot` into a fresh router (no replay endpoint: the
restore alone), and checks the restored index equals the source's, worker for worker.

    PYTHONPATH=python python3 benchmarks/bench_snapshot.py --entries 100000 1000000 --runs 3

Prints one line per size with the median of ``--runs`` (and the range).
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvroute
from kvroute import wire
from kvroute.snapshot import iter_snapshot, parse_snapshot, restore_snapshot

BS = 16
BLOCKS_PER_EVENT = 64


def build(workers: int, entries: int) -> kvroute.Router:
    names = [f"http://w{i}" for i in range(workers)]
    r = kvroute.Router(names, block_size=BS, max_blocks_per_worker=None, max_blocks_total=None)
    per_worker = entries // workers
    h = 1
    for name in names:
        seq = 0
        done = 0
        while done < per_worker:
            n = min(BLOCKS_PER_EVENT, per_worker - done)
            tokens = list(range(h * 7, h * 7 + n * BS))
            ev = wire.stored(list(range(h, h + n)), None, tokens, BS)
            r.ingest(name, wire.encode_batch([ev]), seq=seq)
            seq += 1
            h += n
            done += n
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--entries", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    print(f"workers={a.workers}; median (min-max) of {a.runs} runs")
    print(f"{'entries':>10} {'bytes':>11} {'dump ms':>16} {'parse ms':>16} {'restore ms':>16} "
          f"{'total ms':>16}")
    for n in a.entries:
        src = build(a.workers, n)
        names = [w.name for w in src.workers]
        cols: dict = {"dump": [], "parse": [], "restore": [], "total": []}
        size = 0
        for _ in range(a.runs):
            t0 = time.perf_counter()
            data = b"".join(iter_snapshot(src))
            t1 = time.perf_counter()
            snap = parse_snapshot(data)
            t2 = time.perf_counter()
            dst = kvroute.Router(names, block_size=BS, max_blocks_per_worker=None,
                                 max_blocks_total=None)
            t3 = time.perf_counter()
            res = restore_snapshot(dst, snap)
            t4 = time.perf_counter()
            assert set(res.values()) == {"restored"}, res
            if len(cols["dump"]) < a.runs - 1:
                dst.close()
            size = len(data)
            cols["dump"].append(t1 - t0)
            cols["parse"].append(t2 - t1)
            cols["restore"].append(t4 - t3)
            cols["total"].append((t1 - t0) + (t2 - t1) + (t4 - t3))
        for name in names:  # block for block
            assert dst.worker_blocks(name) == src.worker_blocks(name)
        dst.close()
        src.close()

        def fmt(xs: list) -> str:
            return (f"{statistics.median(xs) * 1e3:7.1f} "
                    f"({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})")
        print(f"{n:>10} {size:>11} {fmt(cols['dump']):>16} {fmt(cols['parse']):>16} "
              f"{fmt(cols['restore']):>16} {fmt(cols['total']):>16}")


if __name__ == "__main__":
    main()
