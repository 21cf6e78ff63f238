"""Tables, CSV/JSON and a PNG for replay results.

``results.json`` / ``results.csv`` hold only simulated quantities (virtual-time metrics and
the run's parameters), so two runs with the same arguments and seed write the same bytes;
the wall-clock measurements (routing time per decision, seconds per policy, the whole run's
seconds) go to ``timings.json``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Optional, Sequence

from kvroute.replay.runner import PolicyResult

COLUMNS = [
    ("policy", "policy", "{:<16}"),
    ("hit_rate", "hit rate", "{:>8.1%}"),
    ("ttft_mean", "TTFT mean", "{:>11.3f}"),
    ("ttft_p50", "p50", "{:>9.3f}"),
    ("ttft_p90", "p90", "{:>9.3f}"),
    ("ttft_p99", "p99", "{:>9.3f}"),
    ("e2e_mean", "E2E mean", "{:>10.2f}"),
    ("e2e_p99", "E2E p99", "{:>10.2f}"),
    ("throughput_tok_s", "out tok/s", "{:>10.0f}"),
    ("load_imbalance", "imbalance", "{:>10.2f}"),
    ("route_us_p50", "route p50 us", "{:>13.1f}"),
    ("route_us_p99", "p99 us", "{:>8.1f}"),
    ("fallback_share", "fallback", "{:>9.1%}"),
    ("available_hit_rate", "available", "{:>10.1%}"),
    ("predicted_hit_rate", "captured", "{:>10.1%}"),
    ("prediction_error", "pred err", "{:>9.1%}"),
]

#: `PolicyResult` fields measured on the wall clock (they differ run to run); written to
#: ``timings.json``, not ``results.json``.
TIMING_FIELDS = ("route_us_p50", "route_us_p99", "wall_s")
#: ``meta`` keys measured on the wall clock.
META_TIMING_KEYS = ("wall_s",)


def format_table(results: Sequence[PolicyResult], capacity_bound: Optional[float] = None
                 ) -> str:
    """The comparison table, one row per policy; with ``capacity_bound`` (a hit rate, see
    `kvroute.replay.traces.Trace.capacity_bound_hit_rate`) a last column gives each policy's
    hit rate as a share of it."""
    cols = list(COLUMNS)
    if capacity_bound is not None:
        cols.append(("share_of_capacity_bound", "of cap bound", "{:>13.1%}"))
    head = "".join(fmt.replace(".1%", "").replace(".3f", "").replace(".2f", "")
                   .replace(".0f", "").replace(".1f", "").format(title)
                   for _, title, fmt in cols)
    lines = [head, "-" * len(head)]
    for r in results:
        d = r.as_dict()
        if capacity_bound is not None:
            d["share_of_capacity_bound"] = _share(r.hit_rate, capacity_bound)
        lines.append("".join(_cell(fmt, d[key]) for key, _, fmt in cols))
    return "\n".join(lines)


def _cell(fmt: str, v: object) -> str:
    """One table cell; ``None`` (not measured, e.g. the PD rows' available) as ``-``."""
    if v is None:
        width = fmt[fmt.index(">") + 1:].split(".")[0] if ">" in fmt else ""
        return f"{'-':>{width}}" if width else "-"
    return fmt.format(v)


def _share(hit_rate: float, bound: float) -> float:
    return hit_rate / bound if bound > 0 else float("nan")


def write_outputs(results: Sequence[PolicyResult], out: Path, meta: dict) -> list[Path]:
    """Writes results.csv, results.json, timings.json and results.png into ``out``; returns
    the paths. ``results.json`` is ``{"meta": meta minus its wall-clock keys, "results": [one
    object per policy without the TIMING_FIELDS]}``, keys sorted; ``timings.json`` is
    ``{"wall_s": ..., "results": [{"policy", "route_us_p50", "route_us_p99", "wall_s"}]}``.
    With ``meta["capacity_bound"]`` each result also has ``share_of_capacity_bound``."""
    out.mkdir(parents=True, exist_ok=True)
    full = [r.as_dict() for r in results]
    rows = [{k: v for k, v in d.items() if k not in TIMING_FIELDS} for d in full]
    if meta.get("capacity_bound") is not None:
        for r in rows:
            r["share_of_capacity_bound"] = _share(r["hit_rate"], meta["capacity_bound"])
    timings = [{"policy": d["policy"], **{k: d[k] for k in TIMING_FIELDS}} for d in full]
    sim_meta = {k: v for k, v in meta.items() if k not in META_TIMING_KEYS}
    csv_path, json_path, png_path = out / "results.csv", out / "results.json", out / "results.png"
    timings_path = out / "timings.json"
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    json_path.write_text(json.dumps({"meta": sim_meta, "results": rows}, indent=2,
                                    sort_keys=True) + "\n")
    timings_path.write_text(json.dumps(
        {**{k: meta[k] for k in META_TIMING_KEYS if k in meta}, "results": timings},
        indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in results]
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.6))
    ax[0].bar(names, [r.hit_rate * 100 for r in results], color="tab:blue")
    if meta.get("infinite_cache_bound") is not None:
        ax[0].axhline(meta["infinite_cache_bound"] * 100, ls="--", color="k",
                      label="infinite cache")
    if meta.get("capacity_bound") is not None:
        ax[0].axhline(meta["capacity_bound"] * 100, ls=":", color="tab:purple",
                      label="capacity bound (pooled Belady)")
    if meta.get("infinite_cache_bound") is not None or meta.get("capacity_bound") is not None:
        ax[0].legend(loc="best", fontsize=8, framealpha=0.9)
    ax[0].set_ylabel("prefix-cache hit rate (%)")
    ax[1].bar(names, [r.ttft_p90 for r in results], color="tab:orange", label="p90")
    ax[1].bar(names, [r.ttft_mean for r in results], color="tab:red", alpha=0.7, label="mean")
    ax[1].set_yscale("log")  # one saturated policy's TTFT must not hide the others'
    ax[1].set_ylabel("TTFT (s, log scale)")
    ax[1].legend()
    ax[2].bar(names, [r.load_imbalance for r in results], color="tab:green")
    ax[2].set_ylabel("load imbalance (max/mean prefill)")
    for a in ax:
        a.tick_params(axis="x", rotation=20)
    fig.suptitle(f"{meta.get('trace', '')}: {meta.get('workers')} workers, "
                 f"cache_weight {meta.get('cache_weight')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return [csv_path, json_path, timings_path, png_path]
