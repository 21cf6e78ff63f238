"""kvroute serve in front of real vLLM engines: policies compared on what the engines report.

Starts ``--engines`` vLLM CPU engines (`kvroute.sim.vllm_cpu`: vllm-cpu, a tiny random-weight
Qwen3, the real Qwen3 tokenizer, prefix caching, KV events with replay; needs
``bash scripts/setup_vllm.sh``), then for each policy a ``kvroute serve`` in front of them,
and plays multi-turn MT-Bench conversations through it: ``--users`` conversations, each a
system prompt (one of ``--system-prompts``) and the question's turns played in order, at most
``--concurrency`` requests in flight. Every request streams (``stream_options.include_usage``)
and asks for the decision (``x-kvroute-explain: 1``).

Per policy: requests; delivered hit rate = vLLM's ``usage.prompt_tokens_details.cached_tokens``
summed / prompt tokens summed; predicted = the decision's ``matched_tokens`` capped as vLLM caps
a hit (never the prompt's last token); the share of requests whose prediction equals what was
delivered and the mean absolute gap; TTFT p50 / p90 (first content chunk, client side); the
busiest engine's share of requests over the mean. Prompts never repeat across policies: each
policy's system prompts carry its own tag, so an earlier policy's cache holds nothing the next
can reuse.

Run: ``python benchmarks/bench_real_engines.py`` (2 engines, 12 users, ~5 min on 2 cores with
start-up), ``--engines 4 --users 40 --concurrency 8`` by hand for a larger fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

import httpx

from kvroute.sim import vllm_cpu as rv

ROOT = Path(__file__).resolve().parents[1]

SYSTEM_PROMPTS = [
    "You are a careful assistant for a routing benchmark. Answer in plain words, keep each "
    "answer short, never use lists, and say so when a question has no single answer.",
    "You are a terse technical writer. Prefer concrete examples over general statements, "
    "avoid repeating the question, and end every answer with one sentence of advice.",
    "You are a patient tutor. Explain each step as if to a first-year student, define every "
    "term you use, and check the arithmetic of any number you give.",
]


def serve(fleet: rv.Fleet, policy: str, tokenizer: Path, workdir: Path) -> tuple:
    cfg = {
        "mode": {"type": "regular", "workers": [
            {"url": e.url, "kv_events": e.kv_endpoint, "replay": e.replay_endpoint}
            for e in fleet.engines]},
        "policy": {"type": policy},
        "block_size": rv.BLOCK,
        "serving": {"model": rv.MODEL, "tokenizer": str(tokenizer)},
    }
    path = workdir / f"router-{policy}.json"
    path.write_text(json.dumps(cfg), "utf-8")
    port = rv.free_port()
    log = open(workdir / f"serve-{policy}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config",
                             str(path), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"kvroute serve ({policy}) did not come up; see {log.name}")


def one_request(client: httpx.Client, base: str, messages: List[Dict[str, str]],
                max_tokens: int) -> Dict[str, Any]:
    body = {"model": rv.MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft: Optional[float] = None
    usage: Dict[str, Any] = {}
    text: List[str] = []
    with client.stream("POST", f"{base}/v1/chat/completions", json=body,
                       headers={"x-kvroute-explain": "1"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        decision = json.loads(r.headers["x-kvroute-decision"])
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                delta = (c.get("delta") or {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(delta)
            if chunk.get("usage"):
                usage = chunk["usage"]
    prompt = int(usage.get("prompt_tokens", 0))
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    cap = (prompt - 1) // rv.BLOCK * rv.BLOCK if prompt else 0
    return {"worker": decision["worker"], "prompt": prompt, "cached": cached,
            "predicted": min(int(decision["matched_tokens"]), cap),
            "ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "answer": "".join(text)}


def run_policy(base: str, questions: List[dict], args: argparse.Namespace,
               tag: str) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    lock = threading.Lock()
    gate = threading.Semaphore(args.concurrency)

    def user(i: int) -> None:
        q = questions[i % len(questions)]
        system = f"[{tag}] " + SYSTEM_PROMPTS[i % args.system_prompts]
        messages = [{"role": "system", "content": system}]
        with httpx.Client(timeout=300) as client:
            for turn in q["turns"]:
                messages.append({"role": "user", "content": turn})
                with gate:
                    row = one_request(client, base, messages, args.max_tokens)
                messages.append({"role": "assistant", "content": row.pop("answer")})
                with lock:
                    rows.append(row)

    with ThreadPoolExecutor(max(args.users, 1)) as ex:
        for f in [ex.submit(user, i) for i in range(args.users)]:
            f.result()
    return rows


def summary(policy: str, rows: List[Dict[str, Any]], engines: int) -> Dict[str, Any]:
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    equal = sum(r["predicted"] == r["cached"] for r in rows)
    gap = statistics.fmean(abs(r["predicted"] - r["cached"]) for r in rows)
    ttft = sorted(r["ttft"] for r in rows)
    per = [sum(r["worker"] == w for r in rows) for w in {r["worker"] for r in rows}]
    per += [0] * (engines - len(per))
    return {"policy": policy, "requests": len(rows),
            "hit_rate": cached / prompt if prompt else 0.0,
            "predicted_equal": equal / len(rows), "mean_abs_gap": gap,
            "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2],
            "ttft_p90_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "imbalance": max(per) / (sum(per) / engines)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--users", type=int, default=12, help="conversations per policy")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    ap.add_argument("--system-prompts", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--policies", default="kv_aware,cache_aware,round_robin")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0,
                    help="each engine's VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--data", default=os.environ.get("KVROUTE_SHARED_DATA",
                                                     str(ROOT.parent / "shared" / "data")),
                    help="shared data directory (default $KVROUTE_SHARED_DATA or ../shared/data)")
    args = ap.parse_args()
    why = rv.available()
    if why is not None:
        print(f"bench_real_engines: {why}", file=sys.stderr)
        return 2
    data = Path(args.data)
    tokenizer = data / "tokenizers" / "qwen3"
    with open(data / "mt_bench_question.jsonl", encoding="utf-8") as f:
        questions = [json.loads(line) for line in f]
    policies = [p for p in args.policies.split(",") if p]
    t0 = time.monotonic()
    fleet = rv.Fleet(tokenizer, args.engines, args.kv_cache_gib).start()
    started = time.monotonic() - t0
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvroute-bench-") as d:
            for k, policy in enumerate(policies):
                proc, base, log = serve(fleet, policy, tokenizer, Path(d))
                try:
                    # Each policy its own questions too: nothing repeats across policies.
                    qs = questions[(k * args.users) % len(questions):] + questions
                    rows = run_policy(base, qs, args, tag=f"{policy}-{os.getpid()}")
                finally:
                    proc.terminate()
                    proc.wait(timeout=20)
                    log.close()
                results.append(summary(policy, rows, args.engines))
    finally:
        fleet.close()
    print(f"# {args.engines} vLLM CPU engines (vllm-cpu, tiny Qwen3, block {rv.BLOCK}), "
          f"{args.users} conversations per policy, concurrency {args.concurrency}, "
          f"{args.system_prompts} system prompts, max_tokens {args.max_tokens}; "
          f"engines up in {started:.0f} s; load average {os.getloadavg()[0]:.2f}")
    print(f"{'policy':<14}{'requests':>9}{'hit rate':>10}{'pred==deliv':>13}"
          f"{'|gap| tok':>11}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'imbalance':>11}")
    for r in results:
        print(f"{r['policy']:<14}{r['requests']:>9}{r['hit_rate']:>10.1%}"
              f"{r['predicted_equal']:>13.1%}{r['mean_abs_gap']:>11.1f}"
              f"{r['ttft_p50_ms']:>13.1f}{r['ttft_p90_ms']:>13.1f}{r['imbalance']:>11.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
