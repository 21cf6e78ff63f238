"""One router replica's cost with a fleet of simulated engines publishing at production rates.

Two parts (``--parts rate,ingest``):

rate
    The per-engine event rate, from the Mooncake conversation trace (``$KVROUTE_SHARED_DATA``
    ``/mooncake_conversation_trace.jsonl``) replayed through kvroute's simulator
    (`kvroute.replay.runner.run_policy`, kv_aware, ``--rate-workers`` simulated vLLM engines
    of 29,205 blocks of 16 tokens, arrivals ``--rate-speed`` times the trace's) with every
    batch each engine publishes counted: batches, BlockStored / BlockRemoved events, stored
    and removed blocks, payload bytes, over the simulated span (first arrival to the last
    batch). Per engine per second = totals / engines / span.
ingest
    One replica: a `kvroute.Router` of ``--engines`` workers in this process (real ZeroMQ SUB
    sockets, the native ingestion thread, the real decoder and index) fed by ``--procs``
    publisher processes, each binding ``engines / procs`` PUB sockets and publishing vLLM
    map-era batches (`kvroute.wire`) at the rate part's per-engine rates times ``--scale``:
    each batch one BlockStored of fresh blocks (random tokens, new hashes) and, once an
    engine holds ``--resident`` blocks, one BlockRemoved of its oldest. After a fill to
    ``--resident`` blocks per engine, ``--seconds`` of steady traffic, measured: CPU
    seconds per second of the ingestion thread(s) and of the whole router process (`/proc`),
    batches and blocks applied per second against sent (lag = sent - applied at the end),
    `select_worker` latency at ``--select-rate`` requests/s of 8,192-token prompts (half of
    them repeats of a stored prefix), RSS per (block, worker) entry.

    PYTHONPATH=python python3 benchmarks/bench_scale.py                       # ~1 min
    PYTHONPATH=python python3 benchmarks/bench_scale.py --quick               # smoke, ~30 s
    PYTHONPATH=python python3 benchmarks/bench_scale.py --parts ingest --rates O.json --scale 1 0.5

The publisher processes run 10 nice levels below the router (behind schedule they never
sleep, and would take the CPU from the router they measure). They pay msgpack's cost in numpy
(a template batch with fixed-width fields whose token ids and hashes are overwritten in
place); the router side is what is measured.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

BS = 16
TOPIC = b"kv-events"


# -- rate: per-engine event rates from the Mooncake replay -----------------------------------------
def engine_rates(data_dir: str, speed: float, workers: int, limit: Optional[int]) -> Dict[str, Any]:
    """Replays the Mooncake trace through the simulator and counts every published batch."""
    from kvroute import wire
    from kvroute.replay import runner
    from kvroute.replay.traces import load_mooncake
    from kvroute.sim.fleet import SimFleet

    tally = {"batches": 0, "stored_events": 0, "removed_events": 0, "stored_blocks": 0,
             "removed_blocks": 0, "bytes": 0, "last": 0.0, "stored_per_event": []}

    class CountingFleet(SimFleet):
        def send(self, i: int, events: list) -> None:
            if events:
                payload = wire.encode_batch(events, era=self.era, ts=self.engines[i].now,
                                            dp_rank=0)
                tally["batches"] += 1
                tally["bytes"] += len(payload)
                tally["last"] = max(tally["last"], self.engines[i].now)
                for e in events:
                    if isinstance(e, wire.Stored):
                        tally["stored_events"] += 1
                        tally["stored_blocks"] += len(e.block_hashes)
                    elif isinstance(e, wire.Removed):
                        tally["removed_events"] += 1
                        tally["removed_blocks"] += len(e.block_hashes)
            super().send(i, events)

    path = Path(data_dir) / "mooncake_conversation_trace.jsonl"
    trace = load_mooncake(path, limit=limit).scaled(speed)
    saved = runner.SimFleet
    runner.SimFleet = CountingFleet  # type: ignore[misc]
    t0 = time.perf_counter()
    try:
        res = runner.run_policy(trace, "kv_aware", workers=workers)
    finally:
        runner.SimFleet = saved  # type: ignore[misc]
    span = tally["last"] - trace.requests[0].arrival_s
    per = workers * span
    out = {"requests": len(trace.requests), "speed": speed, "workers": workers,
           "span_s": span, "hit_rate": res.hit_rate, "ttft_p50_s": res.ttft_p50,
           "wall_s": time.perf_counter() - t0,
           "requests_per_s_per_engine": len(trace.requests) / per}
    for k in ("batches", "stored_events", "removed_events", "stored_blocks", "removed_blocks",
              "bytes"):
        out[f"{k}_per_s"] = tally[k] / per
    out["totals"] = {k: v for k, v in tally.items() if k != "stored_per_event"}
    return out


# -- ingest: one replica, many engines -------------------------------------------------------------
class BatchTemplate:
    """A vLLM map-era batch (`kvroute.wire`) of one BlockStored of ``stored`` blocks and one
    BlockRemoved of ``removed`` hashes, with every token id (256..65535: msgpack uint16, 3
    bytes) and hash (>= 2^63: msgpack uint64, 9 bytes) at a fixed offset, overwritten per
    batch."""

    def __init__(self, stored: int, removed: int) -> None:
        from kvroute import wire

        self.stored, self.removed = stored, removed
        tok_mark, h_mark = 0xABCD, (1 << 63) + 0x5A5A5A5A5A5A5A5A
        hashes = [h_mark + i for i in range(stored + removed)]
        events: list = []
        if removed:
            events.append(wire.removed(hashes[stored:], "GPU"))
        events.append(wire.stored(hashes[:stored], None, [tok_mark] * (stored * BS), BS,
                                  medium="GPU"))
        raw = wire.encode_batch(events, era="map", ts=1.0, dp_rank=0)
        self.buf = np.frombuffer(raw, dtype=np.uint8).copy()
        b = bytes(raw)
        self.hash_off = np.array([b.index(b"\xcf" + h.to_bytes(8, "big")) + 1 for h in hashes],
                                 dtype=np.int64)
        tok = b"\xcd" + tok_mark.to_bytes(2, "big")
        offs, k = [], 0
        while True:
            k = b.find(tok, k)
            if k < 0:
                break
            offs.append(k + 1)
            k += 3
        if len(offs) != stored * BS:
            raise RuntimeError("template token offsets not found")
        self.tok_off = np.array(offs, dtype=np.int64)
        self.hash_idx = (self.hash_off[:, None] + np.arange(8)).ravel()
        self.tok_idx = (self.tok_off[:, None] + np.arange(2)).ravel()

    def fill(self, hashes: np.ndarray, tokens: np.ndarray) -> bytes:
        """``hashes``: uint64 [stored + removed] (stored first); ``tokens``: uint16
        [stored * 16]."""
        buf = self.buf
        buf[self.hash_idx] = hashes.astype(">u8").view(np.uint8)
        buf[self.tok_idx] = tokens.astype(">u2").view(np.uint8)
        return buf.tobytes()


def _split(total: float, rng: np.random.Generator) -> int:
    """An integer with mean ``total`` (floor + Bernoulli of the fraction)."""
    base = int(total)
    return base + int(rng.random() < total - base)


def publisher(index: int, n: int, first: int, rates: Dict[str, float], resident: int,
              scale: float, conn: Any, seed: int) -> None:
    """One publisher process: ``n`` PUB sockets (engines ``first`` .. ``first + n - 1``)."""
    import zmq

    _raise_fd_limit()
    os.nice(10)  # the load generator yields to the router it loads (behind schedule, it spins)
    ctx = zmq.Context()
    socks, eps = [], []
    for _ in range(n):
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        socks.append(s)
        eps.append(f"tcp://127.0.0.1:{port}")
    conn.send(eps)
    rng = np.random.default_rng(seed + index)
    seq = [0] * n
    fifo: List[List[np.ndarray]] = [[] for _ in range(n)]  # per engine: stored hash arrays
    held = [0] * n
    counter = np.uint64((1 << 63) + ((seed * 64 + index) << 40))
    templates: Dict[tuple, BatchTemplate] = {}
    sent = {"batches": 0, "stored": 0, "removed": 0, "bytes": 0}

    def send(i: int, stored: int, removed: int) -> None:
        nonlocal counter
        key = (stored, removed)
        t = templates.get(key)
        if t is None:
            t = templates[key] = BatchTemplate(stored, removed)
        new = counter + np.arange(stored, dtype=np.uint64)
        counter += np.uint64(stored)
        old: List[np.ndarray] = []
        need = removed
        q = fifo[i]
        while need:
            head = q[0]
            take = min(need, len(head))
            old.append(head[:take])
            if take == len(head):
                q.pop(0)
            else:
                q[0] = head[take:]
            need -= take
        hashes = np.concatenate([new, *old]) if old else new
        payload = t.fill(hashes, rng.integers(256, 65536, stored * BS, dtype=np.uint16))
        socks[i].send_multipart([TOPIC, seq[i].to_bytes(8, "big"), payload], copy=False)
        seq[i] += 1
        q.append(new)
        held[i] += stored - removed
        sent["batches"] += 1
        sent["stored"] += stored
        sent["removed"] += removed
        sent["bytes"] += len(payload)

    while True:
        cmd = conn.recv()
        if cmd[0] == "join":  # empty batches until the router has seen every socket
            for i in range(n):
                socks[i].send_multipart([TOPIC, seq[i].to_bytes(8, "big"),
                                         _empty_batch()])
                seq[i] += 1
            conn.send(None)
        elif cmd[0] == "fill":  # every engine to `resident` blocks, 64 blocks per batch
            for i in range(n):
                while held[i] < resident:
                    send(i, min(64, resident - held[i]), 0)
                if i % 16 == 15:
                    time.sleep(0.001)  # let the SUB side drain (HWM)
            conn.send(dict(sent))
        elif cmd[0] == "run":
            seconds = cmd[1]
            r_b = rates["batches_per_s"] * scale
            per_batch_stored = rates["stored_blocks_per_s"] / rates["batches_per_s"]
            per_batch_removed = rates["removed_blocks_per_s"] / rates["batches_per_s"]
            for k in sent:
                sent[k] = 0
            # Each engine sends at r_b batches/s; the n engines' sends are spread evenly
            # over each 1/r_b period (a tick every 1/(n r_b) s, one engine per tick).
            tick = 1.0 / (n * r_b)
            t0 = time.perf_counter()
            k = 0
            late = 0.0
            while True:
                due = t0 + k * tick
                now = time.perf_counter()
                if due > t0 + seconds:
                    break
                if due > now:
                    time.sleep(due - now)
                else:
                    late = max(late, now - due)
                i = k % n
                st = max(1, _split(per_batch_stored, rng))
                # the engine's cache stays at `resident` blocks (a full cache evicts what
                # it stores), at least the replay's removal rate
                rm = max(_split(per_batch_removed, rng), held[i] + st - resident)
                send(i, st, min(rm, held[i]))
                k += 1
            out = dict(sent)
            out["seconds"] = time.perf_counter() - t0
            out["max_late_s"] = late
            conn.send(out)
        elif cmd[0] == "stop":
            break
    for s in socks:
        s.close(0)
    ctx.term()


_EMPTY: Optional[bytes] = None


def _empty_batch() -> bytes:
    global _EMPTY
    if _EMPTY is None:
        from kvroute import wire
        _EMPTY = wire.encode_batch([], era="map", ts=1.0, dp_rank=0)
    return _EMPTY


def _raise_fd_limit() -> None:
    """A SUB or PUB socket takes a few file descriptors: the soft limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _thread_cpu_s() -> Dict[str, float]:
    """CPU seconds (user + system) of this process's threads, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: Dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _applied(router: Any) -> Dict[str, int]:
    st = router.stats()["workers"]
    return {"batches": sum(int(w.get("batches", 0)) for w in st.values()),
            "entries": sum(int(w.get("indexed_blocks", 0)) for w in st.values())}


def ingest(a: argparse.Namespace, rates: Dict[str, float], scale: float) -> Dict[str, Any]:
    import kvroute

    ctx = mp.get_context("spawn")
    per = [a.engines // a.procs + (1 if p < a.engines % a.procs else 0) for p in range(a.procs)]
    pipes, procs, eps = [], [], []
    first = 0
    for p, n in enumerate(per):
        mine, theirs = ctx.Pipe()
        pr = ctx.Process(target=publisher, args=(p, n, first, rates, a.resident, scale, theirs,
                                                 a.seed), daemon=True)
        pr.start()
        theirs.close()  # a child that dies then shows as EOFError, not a hang
        pipes.append(mine)
        procs.append(pr)
        first += n
    for c in pipes:
        eps.extend(c.recv())
    rss0 = _rss_bytes()
    workers = [kvroute.Worker(f"engine-{i}", ep) for i, ep in enumerate(eps)]
    router = kvroute.Router(workers, block_size=BS, seed=a.seed,
                            ingest_threads=a.ingest_threads)
    try:
        t = time.monotonic()
        while True:  # ZeroMQ slow joiner: until every SUB socket got a batch
            for c in pipes:
                c.send(("join",))
            for c in pipes:
                c.recv()
            st = router.stats()["workers"]
            if all(int(w.get("batches", 0)) > 0 for w in st.values()):
                break
            if time.monotonic() - t > 60:
                raise RuntimeError("the router did not connect to every engine in 60 s")
            time.sleep(0.2)
        t_fill = time.perf_counter()
        for c in pipes:
            c.send(("fill",))
        filled = [c.recv() for c in pipes]
        want = sum(f["stored"] for f in filled)
        while True:
            got = _applied(router)["entries"]
            if got >= want or time.perf_counter() - t_fill > 300:
                break
            time.sleep(0.1)
        fill_s = time.perf_counter() - t_fill
        entries = _applied(router)["entries"]
        rss_filled = _rss_bytes()
        index_b = int(router.stats().get("index_memory_bytes", 0))

        # steady state: publishers at the rate, this thread selecting at --select-rate
        prompts_rng = np.random.default_rng(a.seed)
        before = _applied(router)
        cpu0, th0, w0 = _cpu_s(), _thread_cpu_s(), time.perf_counter()
        for c in pipes:
            c.send(("run", a.seconds))
        lat: List[float] = []
        n_sel = int(a.select_rate * a.seconds)
        fresh = [prompts_rng.integers(256, 65536, 8192).astype(np.uint32) for _ in range(64)]
        t0 = time.perf_counter()
        for k in range(n_sel):
            due = t0 + k / a.select_rate
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            toks = fresh[k % 64] if k % 2 else prompts_rng.integers(
                256, 65536, 8192).astype(np.uint32)
            s = time.perf_counter_ns()
            d = router.select_worker(toks, dry_run=True)
            lat.append((time.perf_counter_ns() - s) / 1e3)
            del d
        runs = [c.recv() for c in pipes]
        wall = time.perf_counter() - w0
        after_send = _applied(router)
        cpu = _cpu_s() - cpu0
        th1 = _thread_cpu_s()
        ingest_cpu = sum(v - th0.get(k, 0.0) for k, v in th1.items() if "ingest" in k)
        sent_b = sum(r["batches"] for r in runs)
        sent_blocks = sum(r["stored"] + r["removed"] for r in runs)
        # lag: what was sent but not yet applied when the publishers stopped
        lag_batches = before["batches"] + sent_b - after_send["batches"]
        t_drain = time.perf_counter()
        while (_applied(router)["batches"] < before["batches"] + sent_b
               and time.perf_counter() - t_drain < 60):
            time.sleep(0.05)
        drain_s = time.perf_counter() - t_drain
        final = _applied(router)
        lat.sort()
        st = router.stats()
        dropped = sum(int(w.get("gaps", 0)) for w in st["workers"].values())
        return {
            "engines": a.engines, "procs": a.procs, "scale": scale, "resident": a.resident,
            "fill_s": fill_s, "entries": entries,
            "rss_per_entry_b": (rss_filled - rss0) / max(entries, 1),
            "rss_mb": rss_filled / 2**20, "index_b_per_entry": index_b / max(entries, 1),
            "seconds": wall, "sent_batches_per_s": sent_b / wall,
            "sent_blocks_per_s": sent_blocks / wall,
            "sent_mb_per_s": sum(r["bytes"] for r in runs) / wall / 2**20,
            "applied_batches_per_s": (after_send["batches"] - before["batches"]) / wall,
            "lag_batches_at_end": lag_batches, "drain_s": drain_s,
            "all_applied": final["batches"] >= before["batches"] + sent_b,
            "gaps": dropped,
            "cpu_per_s": cpu / wall, "ingest_cpu_per_s": ingest_cpu / wall,
            "ingest_threads": a.ingest_threads,
            "publisher_late_s": max(r["max_late_s"] for r in runs),
            "select_n": len(lat), "select_p50_us": statistics.median(lat) if lat else None,
            "select_p99_us": lat[int(0.99 * (len(lat) - 1))] if lat else None,
        }
    finally:
        for c in pipes:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for pr in procs:
            pr.join(10)
            if pr.is_alive():
                pr.kill()
        router.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="rate,ingest")
    p.add_argument("--data-dir", default=os.environ.get("KVROUTE_SHARED_DATA", "../shared/data"))
    p.add_argument("--rate-speed", type=float, default=8.0)
    p.add_argument("--rate-workers", type=int, default=8)
    p.add_argument("--rate-requests", type=int, default=None,
                   help="first N requests of the trace (default: all 12,031)")
    p.add_argument("--rates", help="a --json file of an earlier run (its rate part; skips the "
                   "replay)")
    p.add_argument("--engines", type=int, default=1000)
    p.add_argument("--procs", type=int, default=4, help="publisher processes")
    p.add_argument("--resident", type=int, default=2048, help="blocks held per engine")
    p.add_argument("--scale", type=float, nargs="+", default=[1.0],
                   help="multiples of the per-engine rate")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--ingest-threads", type=int, default=1, help="the Router's ingestion threads")
    p.add_argument("--select-rate", type=float, default=200.0, help="select_worker calls/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke: 1,000 trace requests, 200 engines, 5 s")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    _raise_fd_limit()
    if a.quick:
        a.rate_requests = a.rate_requests or 1000
        a.engines, a.procs, a.resident, a.seconds = 200, 2, 256, 5.0
    parts = set(a.parts.split(","))
    results: Dict[str, Any] = {"load_avg_before": os.getloadavg()}
    rates: Dict[str, Any]
    if a.rates:
        rates = json.loads(Path(a.rates).read_text())
        rates = rates.get("rate", rates)
    elif "rate" in parts or "ingest" in parts:
        rates = engine_rates(a.data_dir, a.rate_speed, a.rate_workers, a.rate_requests)
        print(f"rate: {rates['requests']} Mooncake requests at x{a.rate_speed:g} on "
              f"{a.rate_workers} simulated engines, {rates['span_s']:.1f} simulated s "
              f"(hit rate {rates['hit_rate']:.3f}, wall {rates['wall_s']:.0f} s); per engine "
              f"per s: {rates['requests_per_s_per_engine']:.2f} requests, "
              f"{rates['batches_per_s']:.1f} batches, {rates['stored_events_per_s']:.1f} "
              f"BlockStored ({rates['stored_blocks_per_s']:.0f} blocks), "
              f"{rates['removed_events_per_s']:.1f} BlockRemoved "
              f"({rates['removed_blocks_per_s']:.0f} blocks), "
              f"{rates['bytes_per_s'] / 1e3:.1f} KB", flush=True)
    results["rate"] = rates
    if "ingest" in parts:
        results["ingest"] = []
        for s in a.scale:
            r = ingest(a, rates, s)
            results["ingest"].append(r)
            print(f"ingest x{s:g}: {r['engines']} engines ({r['procs']} publisher processes), "
                  f"{r['entries']:,} entries after the fill ({r['fill_s']:.1f} s, RSS "
                  f"{r['rss_mb']:.0f} MB, {r['rss_per_entry_b']:.0f} B/entry, index "
                  f"{r['index_b_per_entry']:.0f} B/entry); "
                  f"{r['seconds']:.1f} s: sent {r['sent_batches_per_s']:,.0f} batches/s "
                  f"({r['sent_blocks_per_s']:,.0f} blocks/s, {r['sent_mb_per_s']:.1f} MB/s), "
                  f"applied {r['applied_batches_per_s']:,.0f} batches/s, lag at end "
                  f"{r['lag_batches_at_end']:,} batches (drained in {r['drain_s']:.2f} s, "
                  f"all applied: {r['all_applied']}, gaps {r['gaps']}); router CPU "
                  f"{r['cpu_per_s']:.2f} s/s, of it the {r['ingest_threads']} ingestion "
                  f"thread(s) {r['ingest_cpu_per_s']:.2f}; select_worker p50 / p99 "
                  f"{r['select_p50_us']:.0f} / {r['select_p99_us']:.0f} us "
                  f"({r['select_n']} calls); publishers at most "
                  f"{r['publisher_late_s'] * 1e3:.0f} ms behind schedule", flush=True)
    results["load_avg_after"] = os.getloadavg()
    print(f"load average before {results['load_avg_before'][0]:.2f}, after "
          f"{results['load_avg_after'][0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    sys.exit(main())
