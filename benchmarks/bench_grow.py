"""Lookups while ingestion crosses the index's table growths: the worst stall a lookup sees.

One worker streams BlockStored events (64 blocks each, parent-linked, 1M+ blocks) into a
fresh Router, so every table doubles in size many times; a second Python thread calls
`find_matches` on a 1K-token prompt every 200 us meanwhile. A table that grows under the
index's write lock stalls every lookup for the whole rehash; kvroute grows it beforehand under
the read lock (cpp/index/README.md). Prints the lookup latency percentiles and the worst calls,
and the slowest ingest calls (those that grew a table) with the index size at that point.

    python benchmarks/bench_grow.py                # 3M blocks, ~30 s
    python benchmarks/bench_grow.py --blocks 500000
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ingest as B  # noqa: E402

import kvroute  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--blocks", type=int, default=3_000_000, help="blocks streamed")
    ap.add_argument("--pause-us", type=float, default=200.0, help="between two lookups")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    stream = B.build_stream(B.Case("store 1 ev x 64 blk", 64), args.blocks, 1, 1024, 16, rng)
    router = kvroute.Router(["w0"], speculative_ttl_s=0)
    prompt = rng.integers(0, 150_000, 1024, dtype=np.uint32)
    stop = threading.Event()
    lookups: list[int] = []

    def look() -> None:
        while not stop.is_set():
            t0 = time.perf_counter_ns()
            router.find_matches(prompt)
            lookups.append(time.perf_counter_ns() - t0)
            time.sleep(args.pause_us / 1e6)

    t = threading.Thread(target=look)
    print(f"# kvroute {getattr(kvroute, '__version__', '?')}; {args.blocks:,} blocks in "
          f"{len(stream.batches):,} events; load average at start: {B.loadavg()}")
    t.start()
    calls = []
    n = 0
    for _w, payload, blocks in stream.batches:
        t0 = time.perf_counter_ns()
        router.ingest("w0", payload)
        calls.append((time.perf_counter_ns() - t0, n))
        n += blocks
    stop.set()
    t.join()
    lat = np.array(lookups, dtype=np.float64) / 1e3
    worst = sorted(lat)[-5:]
    print(f"lookups during ingestion: {len(lat):,}; p50 {np.percentile(lat, 50):.1f} us, "
          f"p99 {np.percentile(lat, 99):.1f} us, p99.9 {np.percentile(lat, 99.9):.1f} us, "
          f"max {lat.max() / 1e3:.2f} ms; five worst (ms): "
          + ", ".join(f"{x / 1e3:.2f}" for x in worst))
    print("slowest ingest calls (they grew a table; ms at index size):")
    for dt, at in sorted(calls, reverse=True)[:6]:
        print(f"  {dt / 1e6:7.2f} ms at {at:,} blocks")
    print(f"(Python switches threads every {sys.getswitchinterval() * 1e3:.0f} ms: a lookup can "
          f"wait that long for the GIL while the ingesting thread runs Python)")
    print(f"# load average at end: {B.loadavg()}")
    return {"lookup_us": lat.tolist(), "ingest_ns": [c[0] for c in calls]}


if __name__ == "__main__":
    main()
