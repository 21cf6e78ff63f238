"""`kvroute gateway` with the response body sent to the picker (``--response-body``): the
engines' delivered cached tokens reach the router's hit-rate accounting through Envoy, for
non-streaming and streamed answers; without it, no request is reported. Real Envoy, real
`kvroute gateway` subprocesses, engine stand-ins with real KV events."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest
from _util import standin_engines, stop_process, wait_for, wait_subscribed

from kvroute.sim.server import DEFAULT_MODEL

pytestmark = pytest.mark.slow

SYSTEM = ("You route requests for an inference fleet. Keep every answer short and exact, "
          "and say which engine served it when asked. ") * 3


def gateway(cfg: Path, tmp: Path, *flags: str) -> Any:
    ready = tmp / f"ready-{len(flags)}.json"
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "gateway", "--config",
                             str(cfg), "--port", "0", "--log-level", "warning", "--ready-file",
                             str(ready), *flags], stderr=subprocess.PIPE)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, "the gateway to listen",
                 timeout=60)
    except AssertionError:
        stop_process(proc)
        raise
    if proc.poll() is not None:
        raise AssertionError(stop_process(proc))
    return proc, json.loads(ready.read_text())


def delivered(http_port: int) -> Dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).text
    out = {}
    for kind in ("captured", "delivered"):
        m = re.search(rf'^kvroute_prefix_tokens_total{{kind="{kind}"}} (\S+)$', text, re.M)
        out[kind] = float(m.group(1)) if m else 0.0
    m = re.findall(r'^kvroute_delivered_reports_total\{[^}]*reported="true"[^}]*\} (\S+)$',
                   text, re.M)
    out["reports"] = sum(float(v) for v in m)
    return out


def chat(base: str, user: str, stream: bool) -> List[str]:
    body: Dict[str, Any] = {"model": DEFAULT_MODEL, "max_tokens": 3, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            return [line for line in r.iter_lines() if line]
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return [r.text]


@pytest.mark.parametrize("stream", [False, True])
def test_delivered_cached_tokens_reach_the_router_through_envoy(qwen3: Path, tmp_path: Path,
                                                                stream: bool) -> None:
    with standin_engines(2, qwen3, model=DEFAULT_MODEL) as engines:
        cfg = tmp_path / "router.yaml"
        cfg.write_text(json.dumps({
            "mode": {"type": "regular", "workers": [
                {"url": e.url, "kv_events": e.kv_endpoint, "replay": e.replay_endpoint}
                for e in engines]},
            "policy": {"type": "kv_aware"}, "block_size": 16,
            "serving": {"model": DEFAULT_MODEL, "tokenizer": str(qwen3)}}))
        for flags, reads in ((("--response-body",), True), ((), False)):
            proc, ports = gateway(cfg, tmp_path, *flags)
            try:
                wait_subscribed(engines)
                base = f"http://127.0.0.1:{ports['port']}"
                before = delivered(ports["http_port"])
                for _ in range(4):  # the same prompt again: the engine reuses its blocks
                    out = chat(base, f"question {reads} {stream}", stream)
                    if stream:
                        assert out[-1] == "data: [DONE]"
                if reads:
                    wait_for(lambda h=ports["http_port"], n=before["reports"] + 4:
                             delivered(h)["reports"] >= n, "4 requests reported")
                    after = delivered(ports["http_port"])
                    assert after["delivered"] > before["delivered"], (before, after)
                else:
                    after = delivered(ports["http_port"])
                    assert after["reports"] == before["reports"] == 0
            finally:
                stop_process(proc)
