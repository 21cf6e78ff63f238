"""Cost of the shared in-flight load: sync latency and the shared store's traffic.

Starts a redis-server (Debian's, a free loopback port; or ``--redis-url``) or, with
``--nats``, a nats-server, then ``--replicas`` `kvroute.serving.shared_load.SharedLoad`
instances in one event loop, each over a `kvroute.Router` of ``--workers`` workers with
``--inflight`` requests in flight spread over them (so every worker has load to publish),
syncing every ``--interval`` seconds for ``--seconds``. Reports per setting: the sync time
(publish + read the peers', median and p99 over all replicas), the document size, and for
Redis the server's network bytes per second in and out (``INFO stats``).

    PYTHONPATH=python python3 benchmarks/bench_shared_load.py --replicas 8 --workers 64 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from typing import List

import kvroute
from kvroute.serving.shared_load import SharedLoad


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(nats: bool) -> tuple:
    port = free_port()
    if nats:
        cmd = [shutil.which("nats-server") or "nats-server", "-a", "127.0.0.1", "-p", str(port)]
        url = f"nats://127.0.0.1:{port}"
    else:
        cmd = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
               "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tempfile.mkdtemp()]
        url = f"redis://127.0.0.1:{port}/0"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, url
        time.sleep(0.01)
    raise RuntimeError("server did not start")


async def redis_bytes(url: str) -> tuple:
    import redis.asyncio as aioredis

    c = aioredis.Redis.from_url(url)
    info = await c.info("stats")
    await c.aclose()
    return int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"])


async def one(url: str, a: argparse.Namespace, workers: int, nats: bool) -> dict:
    names = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(workers)]
    routers: List[kvroute.Router] = []
    shared: List[SharedLoad] = []
    for r in range(a.replicas):
        router = kvroute.Router(names, block_size=16, seed=r)
        for k in range(a.inflight):
            router.select_worker(list(range(k * 64, k * 64 + 64)))
        routers.append(router)
        shared.append(SharedLoad(router, url, replica_id=f"bench-{workers}-{r}",
                                 key_prefix=f"bench{workers}", sync_interval_s=a.interval,
                                 max_staleness_s=max(1.0, 5 * a.interval),
                                 share_speculative=False))
    doc_bytes = len(json.dumps({"workers": shared[0]._local_counts()}))
    for s in shared:
        s.start()
    await asyncio.sleep(1.0)  # warm up: connections, first syncs
    for s in shared:
        s.stats.sync_seconds.clear()
    b0 = await redis_bytes(url) if not nats else (0, 0)
    t0 = time.monotonic()
    await asyncio.sleep(a.seconds)
    dt = time.monotonic() - t0
    b1 = await redis_bytes(url) if not nats else (0, 0)
    lat = sorted(x for s in shared for x in s.stats.sync_seconds)
    syncs = sum(len(s.stats.sync_seconds) for s in shared)
    peers = [len(s.status()["peers"]) for s in shared]
    errors = sum(s.stats.errors for s in shared)
    for s in shared:
        await s.aclose()
    for r in routers:
        r.close()
    return {"p50": statistics.median(lat), "p99": lat[int(0.99 * (len(lat) - 1))],
            "syncs_per_s": syncs / dt, "doc": doc_bytes, "peers": min(peers),
            "in": (b1[0] - b0[0]) / dt, "out": (b1[1] - b0[1]) / dt, "errors": errors}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--workers", type=int, nargs="+", default=[64, 1000])
    p.add_argument("--inflight", type=int, default=2000, help="requests in flight per replica")
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--nats", action="store_true")
    p.add_argument("--redis-url")
    a = p.parse_args()
    proc = None
    url = a.redis_url
    if url is None:
        proc, url = start_server(a.nats)
    try:
        print(f"{'nats' if a.nats else 'redis'}: {a.replicas} replicas in one process, sync "
              f"every {a.interval} s, {a.inflight} requests in flight per replica, "
              f"{a.seconds} s")
        print(f"{'workers':>8} {'doc B':>8} {'sync p50 ms':>12} {'p99 ms':>8} {'syncs/s':>8} "
              f"{'store in KB/s':>14} {'out KB/s':>10} {'peers':>6} {'errors':>7}")
        for w in a.workers:
            r = asyncio.run(one(url, a, w, a.nats))
            print(f"{w:>8} {r['doc']:>8} {r['p50'] * 1e3:12.2f} {r['p99'] * 1e3:8.2f} "
                  f"{r['syncs_per_s']:8.1f} {r['in'] / 1e3:14.1f} {r['out'] / 1e3:10.1f} "
                  f"{r['peers']:>6} {r['errors']:>7}")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
