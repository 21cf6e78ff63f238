"""compare_dynamo.py's report: the tables it prints, the verdicts against the targets, and
the machine and versions recorded with every run."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import msgspec
import numpy as np
from _dynamo_measure import DYN_PEER
from bench_select import fmt_row

import kvroute

ROOT = Path(__file__).resolve().parents[1]


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


def versions(dcore: Any, core_path: Optional[str] = None) -> dict:
    """Versions of both sides and of the kvroute._core measured (``core_path``: the
    ``--core`` build loaded instead of the installed one, if any)."""
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
                           "from_core_flag": core_path is not None}
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
