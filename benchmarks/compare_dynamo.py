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
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_override import preload_core  # noqa: E402

_CORE_PATH = preload_core(sys.argv) if __name__ == "__main__" else None

from _dynamo_measure import (  # noqa: E402
    DYN_SCORES,
    LOOKUP_SIDES,
    ThreadCpu,
    bench_memory,
    bench_zmq,
    check_kv,
    check_same_match,
    churn_payloads,
    dump_store,
    feed_both,
    feed_dyn,
    feed_kv,
    import_dynamo,
    ingest_row,
    memory_child,
    new_threads,
    run_replay,
    stats_us,
    time_lookups,
    work_seconds,
)
from _dynamo_report import machine_info, print_tables, verdicts, versions  # noqa: E402
from _dynamo_workload import (  # noqa: E402
    SHAPES,
    MooncakeBlocks,
    PromptSource,
    as_list,
    build_index,
    build_replay,
    shaped_rows,
)
from bench_ingest import loadavg  # noqa: E402

import kvroute  # noqa: E402
from kvroute.replay.traces import MOONCAKE_FILE  # noqa: E402

# The harness's pieces, importable from here (tests/test_compare_dynamo.py uses them).
__all__ = [
    "DYN_SCORES",
    "LOOKUP_SIDES",
    "MooncakeBlocks",
    "PromptSource",
    "as_list",
    "build_index",
    "build_replay",
    "check_kv",
    "dump_store",
    "feed_dyn",
    "feed_kv",
    "main",
    "run_replay",
    "shaped_rows",
    "time_lookups",
    "work_seconds",
]

ROOT = Path(__file__).resolve().parents[1]


def default_data_dir() -> Path:
    return Path(os.environ.get("KVROUTE_SHARED_DATA", ROOT.parent / "shared" / "data"))


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
        "machine": machine_info(), "versions": versions(dcore, _CORE_PATH),
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
            router: Optional[kvroute.Router] = None  # the previous run's indexes
            for run in range(args.ingest_runs):  # fresh indexes each run; the last one stays
                if router is not None:
                    router.close()
                    router = tree = None
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
            res["memory"].append(bench_memory(wl, bs, tmp, _CORE_PATH))
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
