"""Cost of the shared in-flight load: sync latency and CPU, and the shared store's traffic.

Starts a redis-server (Debian's, a free loopback port; or ``--redis-url``) or, with
``--nats``, a nats-server (with ``--local``: no server, a directory under ``/dev/shm``, the
store of ``kvroute serve --workers N``), then ``--replicas`` processes (as replicas are
deployed; several counts: one setting each), each a
`kvroute.Router` of ``--workers`` workers with ``--inflight`` requests in flight spread over
them (so every worker has load to publish) and its
`kvroute.serving.shared_load.SharedLoad`, syncing every ``--interval`` seconds; measured for
``--seconds`` after ``--warmup``. Reports per setting: the sync time (publish + read the
peers', median and p99 over all replicas), the replica process's CPU per sync and per second
(nothing else runs in it), the document size, and for Redis the server's network bytes and
commands per second (``INFO stats``: ``total_net_input_bytes``, ``total_net_output_bytes``,
``total_commands_processed``).

    PYTHONPATH=python python3 benchmarks/bench_shared_load.py --replicas 8 --workers 64 1000
    PYTHONPATH=python python3 benchmarks/bench_shared_load.py --local --replicas 2 8 \
        --workers 64 1000 --interval 0.02
    PYTHONPATH=python python3 benchmarks/bench_shared_load.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from typing import Any, List

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


def redis_stats(url: str) -> tuple:
    """The server's (network bytes in, bytes out, commands processed) so far."""
    import redis

    c = redis.Redis.from_url(url)
    info = c.info("stats")
    c.close()
    return (int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"]),
            int(info["total_commands_processed"]))


def replica(r: int, url: str, a: argparse.Namespace, workers: int, conn: Any) -> None:
    """One replica process: a Router of ``workers`` workers with ``a.inflight`` requests in
    flight and its SharedLoad; measures after "go"."""
    asyncio.run(_replica(r, url, a, workers, conn))


async def _replica(r: int, url: str, a: argparse.Namespace, workers: int, conn: Any) -> None:
    names = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(workers)]
    router = kvroute.Router(names, block_size=16, seed=r)
    for k in range(a.inflight):
        router.select_worker(list(range(k * 64, k * 64 + 64)))
    shared = SharedLoad(router, url, replica_id=f"bench-{workers}-{r}",
                        key_prefix=f"bench{workers}", sync_interval_s=a.interval,
                        max_staleness_s=max(1.0, 5 * a.interval), share_speculative=False)
    doc_bytes = len(json.dumps({"workers": shared._local_counts()}, separators=(",", ":")))
    conn.send("ready")
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, conn.recv)  # "go"
    shared.start()
    await asyncio.sleep(a.warmup)  # connections, first syncs
    shared.stats.sync_seconds.clear()
    syncs0, err0 = shared.stats.syncs, shared.stats.errors
    cpu0, t0 = time.process_time(), time.monotonic()
    lat: List[float] = []
    peers: List[int] = []
    while time.monotonic() - t0 < a.seconds:
        await asyncio.sleep(0.2)
        lat.extend(shared.stats.sync_seconds)
        shared.stats.sync_seconds.clear()
        peers.append(len(shared.status()["peers"]))
    dt = time.monotonic() - t0
    cpu = time.process_time() - cpu0
    syncs = shared.stats.syncs - syncs0
    out = {"lat": lat, "syncs": syncs, "dt": dt, "cpu": cpu, "doc": doc_bytes,
           "peers": statistics.median(peers) if peers else 0, "errors": shared.stats.errors - err0}
    t = time.monotonic()
    try:
        await asyncio.wait_for(shared.aclose(), 10.0)
        out["close_s"] = time.monotonic() - t
    except asyncio.TimeoutError:
        out["close_s"] = None  # SharedLoad.aclose did not return within 10 s
    conn.send(out)
    router.close()


def one(url: str, a: argparse.Namespace, workers: int, nats: bool) -> dict:
    nats = nats or url.startswith("file://")  # no server counters to read
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for r in range(a.n_replicas):
        mine, theirs = ctx.Pipe()
        pr = ctx.Process(target=replica, args=(r, url, a, workers, theirs), daemon=True)
        pr.start()
        theirs.close()  # a child that dies then shows as EOFError, not a hang
        pipes.append(mine)
        procs.append(pr)
    try:
        for c in pipes:
            assert c.recv() == "ready"
        for c in pipes:
            c.send("go")
        time.sleep(a.warmup)
        s0 = redis_stats(url) if not nats else (0, 0, 0)
        t0 = time.monotonic()
        time.sleep(a.seconds)
        s1 = redis_stats(url) if not nats else (0, 0, 0)
        dt = time.monotonic() - t0
        res = [c.recv() for c in pipes]
    finally:
        for pr in procs:
            pr.join(30)
            if pr.is_alive():
                pr.kill()
    lat = sorted(x for r in res for x in r["lat"])
    syncs = sum(r["syncs"] for r in res)
    out = {"p50": statistics.median(lat) if lat else float("nan"),
            "p99": lat[int(0.99 * (len(lat) - 1))] if lat else float("nan"),
            "syncs_per_s": sum(r["syncs"] / r["dt"] for r in res),
            "cpu_ms_per_sync": 1e3 * sum(r["cpu"] for r in res) / max(syncs, 1),
            "cpu_per_replica": statistics.mean(r["cpu"] / r["dt"] for r in res),
            "doc": res[0]["doc"], "peers": min(r["peers"] for r in res),
            "in": (s1[0] - s0[0]) / dt, "out": (s1[1] - s0[1]) / dt,
            "ops": (s1[2] - s0[2]) / dt, "errors": sum(r["errors"] for r in res),
            "close_hung": sum(r["close_s"] is None for r in res)}
    # per sync: the server's counters over its window against the syncs the replicas made
    # in theirs (the same length, started a warm-up after "go")
    per = max(out["syncs_per_s"] * dt, 1.0)
    out.update(in_per_sync=(s1[0] - s0[0]) / per, out_per_sync=(s1[1] - s0[1]) / per,
               ops_per_sync=(s1[2] - s0[2]) / per)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[8])
    p.add_argument("--workers", type=int, nargs="+", default=[64, 1000])
    p.add_argument("--inflight", type=int, default=2000, help="requests in flight per replica")
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--nats", action="store_true")
    p.add_argument("--redis-url")
    p.add_argument("--local", action="store_true",
                   help="a directory under /dev/shm as the store (kvroute serve --workers N)")
    p.add_argument("--quick", action="store_true", help="smoke: 2 replicas, 64 workers, 3 s")
    a = p.parse_args()
    if a.quick:
        a.replicas, a.workers, a.seconds, a.warmup = [2], [64], 3.0, 2.0
    proc = None
    url = a.redis_url
    tmp = None
    if a.local:
        tmp = tempfile.mkdtemp(prefix="kvroute-bench-shared-",
                               dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        url = f"file://{tmp}"
    elif url is None:
        proc, url = start_server(a.nats)
    kind = "directory" if a.local else "nats" if a.nats else "redis"
    try:
        print(f"{kind}: {', '.join(map(str, a.replicas))} replica processes, sync every "
              f"{a.interval} s, {a.inflight} requests in flight per replica, {a.seconds} s "
              f"after {a.warmup} s of warm-up; load average {os.getloadavg()[0]:.2f}")
        print(f"{'replicas':>8} {'workers':>8} {'doc B':>8} {'sync p50 ms':>12} {'p99 ms':>8} "
              f"{'syncs/s':>8} "
              f"{'CPU ms/sync':>12} {'CPU/replica':>12} {'store in KB/s':>14} "
              f"{'out KB/s':>10} {'ops/s':>8} {'in B/sync':>10} {'out B/sync':>11} "
              f"{'ops/sync':>9} {'peers':>6} {'errors':>7}", flush=True)
        for nr, w in [(nr, w) for nr in a.replicas for w in a.workers]:
            a.n_replicas = nr
            r = one(url, a, w, a.nats)
            print(f"{nr:>8} {w:>8} {r['doc']:>8} {r['p50'] * 1e3:12.2f} {r['p99'] * 1e3:8.2f} "
                  f"{r['syncs_per_s']:8.1f} {r['cpu_ms_per_sync']:12.2f} "
                  f"{r['cpu_per_replica']:12.3f} {r['in'] / 1e3:14.1f} {r['out'] / 1e3:10.1f} "
                  f"{r['ops']:8.0f} {r['in_per_sync']:10.0f} {r['out_per_sync']:11.0f} "
                  f"{r['ops_per_sync']:9.1f} {r['peers']:>6g} {r['errors']:>7}", flush=True)
            if r["close_hung"]:
                print(f"  SharedLoad.aclose did not return within 10 s in {r['close_hung']} "
                      f"of {nr} replicas", flush=True)
        print(f"load average after {os.getloadavg()[0]:.2f}")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
