"""Adaptive cache_weight against a sweep of fixed weights in `kvroute replay`'s simulator.

Replays the first ``--limit`` requests of the Mooncake trace at each ``--speeds`` factor with
kv_aware on ``--workers`` simulated workers, once per fixed weight of ``--weights`` and once
per adaptive start of ``--starts`` (`kvroute.adaptive.AdaptiveCacheWeight` defaults, never
told the load), for each seed of ``--seeds``; prints the TTFT-mean table (mean over the
seeds, per-seed values in brackets, the adaptive rows as % against the best fixed weight)
and writes every run's numbers, and the adaptive runs' weight trajectories, to ``--out``
(JSON).

The results are virtual-time (`kvroute.replay.runner.run_policy`): the machine's load
changes how long the runs take, not their numbers. ``--jobs`` runs go at once (forked
processes).

Run: ``PYTHONPATH=python python3 benchmarks/bench_adaptive.py --speeds 6,10 --seeds 0,1,2``;
``--table A.json B.json`` prints the table of earlier runs merged (e.g. the fixed sweep and the
adaptive runs made separately).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import kvroute.adaptive as _adaptive
from kvroute.replay.runner import run_policy
from kvroute.replay.traces import load_trace

_TRACES: Dict[float, Any] = {}


def _trace(limit: int, speed: float) -> Any:
    if speed not in _TRACES:
        _TRACES[speed] = load_trace("mooncake", limit=limit).scaled(speed)
    return _TRACES[speed]


def _run(job: Tuple[int, float, int, str, float, Optional[dict]]) -> Dict[str, Any]:
    limit, speed, seed, kind, weight, adaptive = job
    trace = _trace(limit, speed)
    tuners: List[Any] = []

    class Recorded(_adaptive.AdaptiveCacheWeight):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            tuners.append(self)

    _adaptive.AdaptiveCacheWeight = Recorded  # type: ignore[misc] # run_policy imports it late
    t0 = time.perf_counter()
    res = run_policy(trace, "kv_aware", workers=_ARGS.workers, cache_weight=weight, seed=seed,
                     adaptive=adaptive, event_delay_s=_ARGS.event_delay_ms / 1000.0,
                     speculative_ttl_s=_ARGS.speculative_ttl_s)
    history = [{"reports": a.reports, "why": a.why, "weight": round(a.after, 3),
                "imbalance": round(a.imbalance, 3), "missed": round(a.missed, 4),
                "gap": round(a.gap, 4), "ttl_s": a.ttl_after, "ttl_why": a.ttl_why,
                "over": round(a.over, 4), "under": round(a.under, 4)}
               for t in tuners for a in t.history]
    return {"speed": speed, "seed": seed, "kind": kind, "weight": weight,
            "ttft_mean": res.ttft_mean, "ttft_p90": res.ttft_p90, "hit_rate": res.hit_rate,
            "final_cache_weight": res.final_cache_weight,
            "final_speculative_ttl_s": res.final_speculative_ttl_s,
            "trajectory": history, "wall_s": time.perf_counter() - t0}


_ARGS: Any = None


def main() -> None:
    global _ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=3000)
    ap.add_argument("--speeds", default="6,10")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--weights", default="0.3,0.5,0.7,0.9,1.0")
    ap.add_argument("--starts", default="0.3,0.7,1.0")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--event-delay-ms", type=float, default=0.0,
                    help="KV events reach the router this late (virtual ms)")
    ap.add_argument("--speculative-ttl-s", type=float, default=2.0)
    ap.add_argument("--adaptive", default="{}",
                    help="AdaptiveCacheWeight keyword arguments as JSON")
    ap.add_argument("--out", default="out/bench_adaptive.json")
    ap.add_argument("--table", nargs="+", metavar="JSON",
                    help="print the table of these earlier --out files (rows merged; a run "
                         "given twice counts once) and exit")
    _ARGS = args = ap.parse_args()
    if args.table:
        merged: Dict[tuple, Dict[str, Any]] = {}
        for path in args.table:
            with open(path) as f:
                for r in json.load(f)["rows"]:
                    merged[(r["speed"], r["seed"], r["kind"], r["weight"])] = r
        rows = list(merged.values())
        print(table(rows, sorted({r["speed"] for r in rows})))
        return
    speeds = [float(s) for s in args.speeds.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    kw = json.loads(args.adaptive)
    jobs = [(args.limit, sp, sd, "fixed", float(w), None)
            for sp in speeds for sd in seeds for w in args.weights.split(",") if w]
    jobs += [(args.limit, sp, sd, "adaptive", float(w), kw)
             for sp in speeds for sd in seeds for w in args.starts.split(",") if w]
    for sp in speeds:
        _trace(args.limit, sp)  # loaded once, shared by the forked processes
    t0 = time.perf_counter()
    with mp.get_context("fork").Pool(args.jobs) as pool:
        rows = pool.map(_run, jobs, chunksize=1)
    wall = time.perf_counter() - t0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "wall_s": wall, "loadavg": os.getloadavg(),
                   "rows": rows}, f, indent=1)
    print(table(rows, speeds))
    print(f"\n{len(rows)} runs in {wall:.0f} s; load average now "
          + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + f"; wrote {args.out}")


def table(rows: List[Dict[str, Any]], speeds: List[float]) -> str:
    """The markdown table: one row per fixed weight and adaptive start, one column per
    speed."""
    def cell(rs: List[Dict[str, Any]], kind: str, best: Optional[float]) -> str:
        rs = sorted(rs, key=lambda r: r["seed"])
        m = sum(r["ttft_mean"] for r in rs) / len(rs)
        per = ", ".join(f"{r['ttft_mean']:.3f}" for r in rs)
        if kind == "fixed":
            return f"{m:.3f} ({per})"
        fin = ", ".join(f"{r['final_cache_weight']:.2f}" for r in rs)
        ttl = [r.get("final_speculative_ttl_s") for r in rs]
        ttl_s = (", TTL " + ", ".join(f"{t:g}" for t in ttl)) if all(
            t is not None for t in ttl) else ""
        rel = f", {100 * (m / best - 1):+.1f} %" if best else ""
        return f"{m:.3f}{rel} ({per}; final {fin}{ttl_s})"

    keys = sorted({(r["kind"], r["weight"]) for r in rows}, key=lambda k: (k[0] != "fixed", k[1]))
    best = {}
    for sp in speeds:
        fixed = {}
        for r in rows:
            if r["speed"] == sp and r["kind"] == "fixed":
                fixed.setdefault(r["weight"], []).append(r["ttft_mean"])
        best[sp] = min(sum(v) / len(v) for v in fixed.values()) if fixed else None
    out = ["| | " + " | ".join(f"{sp:g}x" for sp in speeds) + " |",
           "|---|" + "---|" * len(speeds)]
    for kind, w in keys:
        cells = []
        for sp in speeds:
            rs = [r for r in rows if r["speed"] == sp and (r["kind"], r["weight"]) == (kind, w)]
            cells.append(cell(rs, kind, best[sp]) if rs else "")
        label = f"fixed {w:g}" if kind == "fixed" else f"adaptive from {w:g}"
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
