#!/usr/bin/env python
"""Per-request overhead of kvroute's OpenAI-compatible proxy (`kvroute serve`).

Starts one engine STAND-IN (`kvroute.sim.server`: vLLM's OpenAI API, the real Qwen3
tokenizer, real KV events over ZeroMQ, ``--token-delay-ms 0``; vLLM itself needs a GPU) and
``kvroute serve`` in front of it (its own process, uvicorn, the Qwen3 tokenizer, kv_aware,
ORCA on), then sends the same small non-streaming ``/v1/completions`` request
(``--prompt-words`` words, ``--max-tokens`` output tokens):

* with an async httpx client at each fixed ``--concurrency``: ``--warmup`` requests, then
  ``--requests`` timed ones, directly to the engine and through kvroute, alternating the two
  for ``--rounds`` rounds; each request's latency is taken with ``time.perf_counter``;
* with ``wrk`` (Debian package ``wrk``) when it is on PATH: ``--wrk-seconds`` per target,
  ``--concurrency`` connections, one thread, its ``--latency`` percentiles.

Prints one table per load generator and concurrency: p50 / p90 / p99 / mean latency in ms and
requests/s per target, and the difference (kvroute - direct); the async-client tables also
give the CPU time the engine and the kvroute processes spent per request (from /proc, so it
does not depend on how busy the machine is). On a 2-core machine the client, kvroute and the
engine share the cores, so latency differences include CPU contention; kvroute's own
select_worker time (from its /metrics) is printed too.

Run ``python benchmarks/bench_proxy.py`` (about 2 min) or ``--quick`` (~30 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import httpx
import numpy as np

from kvroute.sim.server import DEFAULT_MODEL, EngineServerProcess

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVROUTE_SHARED_DATA", ROOT.parent / "shared" / "data"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            log = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise SystemExit(f"kvroute serve exited with {proc.returncode}:\n{log}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"kvroute serve at {url} not healthy after {timeout} s")


async def run_client(url: str, body: dict, n: int, concurrency: int) -> np.ndarray:
    """``n`` POSTs of ``body`` to ``url`` with ``concurrency`` in flight; latencies in s."""
    lat = np.empty(n)
    next_i = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60.0, trust_env=False) as client:
        async def worker() -> None:
            nonlocal next_i
            while next_i < n:
                i = next_i
                next_i += 1
                t0 = time.perf_counter()
                r = await client.post(url, json=body)
                lat[i] = time.perf_counter() - t0
                if r.status_code != 200:
                    raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc/<pid>/stat), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def row(name: str, lat_s: np.ndarray, wall_s: Optional[float],
        cpu: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    ms = lat_s * 1e3
    out = {"name": name, "n": len(ms), "p50": float(np.percentile(ms, 50)),
           "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99)),
           "mean": float(ms.mean()), "rps": len(ms) / wall_s if wall_s else float("nan")}
    for proc, sec in (cpu or {}).items():
        out[f"cpu_{proc}"] = sec / len(ms) * 1e3
    return out


def print_table(title: str, rows: List[Dict[str, float]]) -> None:
    print(f"\n{title}")
    cpu = "cpu_engine" in rows[0]
    print(f"{'target':<22}{'requests':>9}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}"
          f"{'req/s':>9}" + (f"{'engine CPU ms/req':>19}{'kvroute CPU ms/req':>20}" if cpu else ""))
    for r in rows:
        print(f"{r['name']:<22}{r['n']:>9}{r['p50']:>9.2f}{r['p90']:>9.2f}{r['p99']:>9.2f}"
              f"{r['mean']:>9.2f}{r['rps']:>9.0f}"
              + (f"{r['cpu_engine']:>19.2f}{r['cpu_kvroute']:>20.2f}" if cpu else ""))
    if len(rows) == 2:
        d, k = rows
        print(f"{'kvroute - direct':<22}{'':>9}{k['p50'] - d['p50']:>+9.2f}"
              f"{k['p90'] - d['p90']:>+9.2f}{k['p99'] - d['p99']:>+9.2f}"
              f"{k['mean'] - d['mean']:>+9.2f}")


_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def run_wrk(url: str, body: dict, seconds: int, concurrency: int, name: str) -> Dict[str, float]:
    """One wrk run (1 thread, ``concurrency`` connections) with a POST script."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\n'
                'wrk.headers["Content-Type"] = "application/json"\n'
                f"wrk.body = {json.dumps(json.dumps(body))}\n")
        script = f.name
    try:
        out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--latency",
                              "-s", script, url], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(script)
    pct = {}
    for p, v, unit in re.findall(r"^\s+(50|90|99)%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M):
        pct[p] = float(v) * _WRK_UNITS[unit]
    avg = re.search(r"Latency\s+([\d.]+)(us|ms|s|m)", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if bad:
        raise SystemExit(f"wrk {url}: {bad.group(1)} non-2xx responses")
    if len(pct) != 3 or not (avg and rps and total):
        raise SystemExit(f"cannot parse wrk output:\n{out}")
    return {"name": name, "n": int(total.group(1)), "p50": pct["50"], "p90": pct["90"],
            "p99": pct["99"], "mean": float(avg.group(1)) * _WRK_UNITS[avg.group(2)],
            "rps": float(rps.group(1))}


def select_us(kvroute_url: str) -> Optional[float]:
    """Mean select_worker time inside kvroute, from its /metrics (microseconds)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{kvroute_url}/metrics").text
    s = c = None
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "kvroute_select_latency_seconds_sum":
                s = smp.value
            elif smp.name == "kvroute_select_latency_seconds_count":
                c = smp.value
    return s / c * 1e6 if s is not None and c else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000,
                    help="timed requests per target and round")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="direct/kvroute alternations")
    ap.add_argument("--concurrency", default="1,8",
                    help="comma-separated requests in flight (one table per value)")
    ap.add_argument("--prompt-words", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--wrk-seconds", type=int, default=10)
    ap.add_argument("--no-wrk", action="store_true")
    ap.add_argument("--no-tokenizer", action="store_true",
                    help="run kvroute without a tokenizer (text routes on load only)")
    ap.add_argument("--data-dir", default=str(SHARED))
    ap.add_argument("--quick", action="store_true", help="500 requests, 1 round, wrk 3 s")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.warmup, a.rounds, a.wrk_seconds = 500, 100, 1, 3
    try:
        concurrencies = [int(c) for c in str(a.concurrency).split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency takes comma-separated ints, got {a.concurrency!r}") \
            from None
    if not concurrencies or min(concurrencies) < 1:
        raise SystemExit(f"--concurrency values must be >= 1, got {a.concurrency!r}")
    qwen3 = Path(a.data_dir) / "tokenizers" / "qwen3"
    if not (qwen3 / "tokenizer.json").is_file():
        raise SystemExit(f"Qwen3 tokenizer not found in {qwen3} (set --data-dir)")
    words = ("the quick brown fox jumps over a lazy dog while routers count blocks of "
             "cached tokens").split()
    body = {"model": DEFAULT_MODEL, "max_tokens": a.max_tokens,
            "prompt": " ".join(words[i % len(words)] for i in range(a.prompt_words))}

    engine = EngineServerProcess(tokenizer_dir=qwen3, model=DEFAULT_MODEL, token_delay_s=0.0)
    engine.start(timeout=60)
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-bench-proxy-"))
    cfg = tmp / "router.yaml"
    cfg.write_text(json.dumps({"mode": {"type": "regular", "workers": [
        {"url": engine.url, "kv_events": engine.kv_endpoint, "replay": engine.replay_endpoint}]},
        "policy": {"type": "kv_aware"}, "block_size": 16}))
    port = free_port()
    kv_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(cfg), "--port",
           str(port), "--model", DEFAULT_MODEL, "--log-level", "warning"]
    if not a.no_tokenizer:
        cmd += ["--tokenizer", str(qwen3)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_healthy(kv_url, proc)
        import tokenizers
        import uvicorn
        print(f"python {sys.version.split()[0]}, httpx {httpx.__version__}, uvicorn "
              f"{uvicorn.__version__}, tokenizers {tokenizers.__version__}; {os.cpu_count()} "
              f"CPUs (client, kvroute and the engine share them)")
        prompt_tokens = httpx.post(f"{engine.url}/v1/completions", json=body).json()["usage"][
            "prompt_tokens"]
        print(f"request: POST /v1/completions, {prompt_tokens} prompt tokens, max_tokens "
              f"{a.max_tokens}, non-streaming; kvroute {'without' if a.no_tokenizer else 'with'} "
              f"the Qwen3 tokenizer, kv_aware, ORCA on")
        targets = [("direct to engine", f"{engine.url}/v1/completions"),
                   ("through kvroute", f"{kv_url}/v1/completions")]
        for conc in concurrencies:
            for _, url in targets:
                asyncio.run(run_client(url, body, a.warmup, conc))
            lat: Dict[str, List[np.ndarray]] = {n: [] for n, _ in targets}
            wall: Dict[str, float] = {n: 0.0 for n, _ in targets}
            cpu = {n: {"engine": 0.0, "kvroute": 0.0} for n, _ in targets}
            pids = {"engine": engine.proc.pid, "kvroute": proc.pid}
            for _ in range(a.rounds):
                for name, url in targets:
                    c0 = {k: cpu_seconds(p) for k, p in pids.items()}
                    t0 = time.perf_counter()
                    lat[name].append(asyncio.run(run_client(url, body, a.requests, conc)))
                    wall[name] += time.perf_counter() - t0
                    for k, p in pids.items():
                        cpu[name][k] += cpu_seconds(p) - c0[k]
            print_table(f"async httpx client, concurrency {conc}, "
                        f"{a.rounds} x {a.requests} requests per target after {a.warmup} warm-up",
                        [row(n, np.concatenate(lat[n]), wall[n], cpu[n]) for n, _ in targets])
        for conc in concurrencies:
            if a.no_wrk:
                break
            if not shutil.which("wrk"):
                print("\n(wrk not on PATH: apt-get install wrk for the wrk tables)")
                break
            rows = [run_wrk(url, body, a.wrk_seconds, conc, name) for name, url in targets]
            print_table(f"wrk -t1 -c{conc} -d{a.wrk_seconds}s --latency", rows)
        us = select_us(kv_url)
        if us is not None:
            print(f"\nkvroute select_worker mean: {us:.1f} us per decision (its /metrics)")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        engine.stop()
        Path(engine.log_path).unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
