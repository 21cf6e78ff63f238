"""Smoke test of benchmarks/compare_dynamo.py, the side-by-side harness against NVIDIA
Dynamo's KV indexer (``dynamo._core.RadixTree``), on a tiny configuration of the real
Mooncake trace. Dynamo's bindings (``ai-dynamo-runtime==1.6.1``, the ``bench`` extra) and the
shared data are part of CI's environment: without them the tests fail."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _util import require

dcore = require("dynamo._core")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compare_dynamo.py"


@pytest.fixture(scope="module")
def cd():
    """The harness as a module (benchmarks/ is not a package)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module("compare_dynamo")
    finally:
        sys.path.remove(str(SCRIPT.parent))


@pytest.fixture(scope="module")
def trace(cd, shared_data):
    return cd.MooncakeBlocks(shared_data / "mooncake_conversation_trace.jsonl", 16)


def test_both_indexes_agree_on_every_worker_overlap(cd, trace):
    """The same events applied to both sides give the same per-worker prefix match, and
    removing them all leaves both empty: the two wire encoders carry the same content."""
    import kvroute

    wl = cd.build_index(trace, dcore, 5, 6000, 32, seed=3)
    assert wl.distinct == 6000 and wl.entries >= 6000
    assert wl.store.total_blocks == wl.remove.total_blocks == wl.entries
    names = [f"w{i}" for i in range(5)]
    router = kvroute.Router(names, block_size=16, speculative_ttl_s=0)
    tree = dcore.RadixTree()
    cd.feed_kv(router, names, wl.store)
    cd.feed_dyn(tree, wl.store)
    cd.check_kv(router, wl.entries, 0)

    src = cd.PromptSource(trace, wl, 2048, 0.5, np.random.default_rng(0))
    assert src.want == 64
    res = cd.time_lookups(router, tree, dcore, src, calls=20, warmup=2, bs=16)
    assert res["mismatches"] == 0
    assert res["matched"] >= 64  # the indexed half of every prompt is found
    assert set(res["ns"]) == set(cd.LOOKUP_SIDES) | {cd.DYN_SCORES}
    assert all(len(v) == 20 and (v > 0).all() for v in res["ns"].values())
    # Dynamo's call with its .scores dict includes the call without it.
    assert (res["ns"][cd.DYN_SCORES] >= res["ns"]["dynamo (list)"]).all()
    # Prefixes are handed out once each before any repeats: the first calls are cold.
    n_cold = min(len(src.sources) - 2, 20)  # two went to the warm-up calls
    assert res["cold"].tolist() == [True] * n_cold + [False] * (20 - n_cold)

    tok = src.next()
    held = {n: m.blocks for n, m in router.find_matches(tok).items() if m.blocks}
    scores = tree.find_matches(dcore.compute_block_hash_for_seq(cd.as_list(tok), 16)).scores
    assert held and held == {f"w{w}": s for (w, _dp), s in scores.items() if s}

    cd.feed_kv(router, names, wl.remove)
    cd.feed_dyn(tree, wl.remove)
    cd.check_kv(router, wl.entries, wl.entries)
    assert router.stats()["indexed_entries"] == 0
    assert not tree.find_matches(dcore.compute_block_hash_for_seq(cd.as_list(tok), 16)).scores
    router.close()


@pytest.mark.slow
def test_replay_workload_is_consistent(cd, trace):
    """The mooncake_bench-style replay: every stored block is later removed or still cached,
    and both sides replay the same number of operations without errors."""
    rp = cd.build_replay(trace, dcore, n_workers=32, n_requests=60, capacity=512,
                         event_blocks=64, seed=0)
    assert rp.lookups == 60 and rp.stored_blocks > 0 and rp.removed_blocks > 0
    assert rp.events == sum(len(op.events) for op in rp.ops)
    for threads in (1, 2):
        kv = cd.run_replay("kvroute", rp, dcore, threads, 16)  # checks kvroute's counters
        dy = cd.run_replay("dynamo", rp, dcore, threads, 16)
        assert kv["ops"] == dy["ops"] == rp.lookups + rp.events
        assert kv["ops_per_s"] > 0 and dy["ops_per_s"] > 0


@pytest.mark.slow
def test_quick_run_prints_ratios_and_writes_json(tmp_path, shared_data):
    out = tmp_path / "cd.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--workers", "4", "--lengths", "1024",
         "--parts", "lookup,ingest,memory", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "KVROUTE_SHARED_DATA": str(shared_data)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio = kvroute / Dynamo" in proc.stdout
    res = json.loads(out.read_text())
    assert res["versions"]["ai-dynamo-runtime"] == importlib.metadata.version("ai-dynamo-runtime")
    (row,) = res["lookup"]
    assert row["mismatches"] == 0 and row["matched"] > 0
    stores = [r for r in res["ingest"] if r["op"] == "store"]
    assert stores and all(r["kv_blocks_per_s"] > 0 and r["dyn_blocks_per_s"] > 0 for r in stores)
    # Work: each event's fastest call summed, so no more than any run's whole time.
    for r in stores:
        assert 0 < r["kv_work_s"] <= min(r["kv_runs_s"])
        assert 0 < r["dyn_work_s"] <= min(r["dyn_runs_s"])
    # Churn (steady state at full size): removals and stores of the same events, in equal
    # number, on both sides (the harness checks kvroute's counts and a lookup on both).
    (churn,) = [r for r in res["ingest"] if r["op"] == "churn"]
    assert churn["blocks"] > 0 and churn["blocks"] % 2 == 0
    assert churn["kv_blocks_per_s"] > 0 and churn["dyn_blocks_per_s"] > 0
    (mem,) = res["memory"]
    assert mem["kvroute"]["entries"] == mem["entries"] > 0
    assert mem["kvroute"]["rss"] > 0 and mem["dynamo"]["rss"] > 0


def test_work_is_each_events_fastest_run_summed(cd):
    # Three runs of three events (ns): the second event was slow in run 1, the first in run 2.
    runs = [[300, 900, 200], [800, 100, 250], [310, 120, 190]]
    assert cd.work_seconds(runs) == (300 + 100 + 190) / 1e9
    assert cd.work_seconds([[5, 7]]) == 12 / 1e9


def test_dump_store_writes_what_ab_ingest_reads(cd, trace, tmp_path):
    """--dump-store's file (benchmarks/ab_ingest/payloads.h's format) holds the store
    workload itself: its header, and batches that, ingested, index every entry."""
    import struct

    import kvroute

    wl = cd.build_index(trace, dcore, 3, 2000, 32, seed=5)
    path = tmp_path / "store_3.bin"
    cd.dump_store(wl, path)
    data = path.read_bytes()
    workers, count = struct.unpack_from("<II", data, 0)
    assert (workers, count) == (3, len(wl.store.kv))
    names = [f"w{i}" for i in range(3)]
    router = kvroute.Router(names, block_size=16, speculative_ttl_s=0)
    off = 8
    for j in range(count):
        w, n = struct.unpack_from("<II", data, off)
        off += 8
        assert w == int(wl.store.worker[j]) and data[off:off + n] == wl.store.kv[j]
        assert router.ingest(names[w], data[off:off + n])
        off += n
    assert off == len(data)
    assert router.stats()["indexed_entries"] == wl.entries
