"""`kvroute doctor` against real engine stand-ins (`kvroute.sim.server` subprocesses: vLLM's
HTTP API, real KV events over ZeroMQ, the Qwen3 tokenizer), each misconfiguration injected
in the router's configuration or tokenizer; the event checks also over synthetic batches."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from _util import free_port, require, standin_engines

require("httpx")
require("zmq")

from kvroute import Worker  # noqa: E402
from kvroute import doctor as dr  # noqa: E402
from kvroute.sim.server import DEFAULT_MODEL  # noqa: E402

FAST = {"timeout_s": 0.6, "settle_s": 0.2}


@pytest.fixture(scope="module")
def engines(qwen3):
    """Two stand-ins: block size 16 (the router's) and 32."""
    from kvroute.sim.server import EngineServerProcess

    e32 = EngineServerProcess(tokenizer_dir=qwen3, model=DEFAULT_MODEL, block_size=32)
    with standin_engines(1, qwen3, model=DEFAULT_MODEL) as (e16,):
        e32.start(timeout=60)
        try:
            yield e16, e32
        finally:
            e32.kill()
            os.unlink(e32.log_path)


@pytest.fixture(scope="module")
def tok(qwen3):
    from kvroute.prompt import PromptTokenizer

    t = PromptTokenizer.from_dir(qwen3)
    yield t
    t.close()


def run(workers, tok, block_size=16, **kw):
    return dr.run(workers, block_size=block_size, model=DEFAULT_MODEL, tokenizer=tok,
                  **{**FAST, **kw})


def by_name(checks):
    assert len({c.worker for c in checks}) == 1
    return {c.name: c for c in checks}


def assert_only_failure(checks, name, *words):
    c = by_name(checks)
    assert c[name].status == "fail", dr.format_report(checks)
    for w in words:
        assert w in c[name].detail + " " + (c[name].fix or ""), c[name]
    assert c[name].fix
    assert dr.exit_code(checks) == 1
    return c


def test_a_healthy_engine_passes_every_check(engines, tok):
    e16, _ = engines
    checks = run([e16.worker()], tok)
    assert [c.name for c in checks] == ["topology", "reachable", "events", "block_size",
                                        "stored_tokens", "dp_rank", "clock", "replay",
                                        "tokenization"]
    assert all(c.status == "ok" for c in checks), dr.format_report(checks)
    assert dr.exit_code(checks) == 0


def test_unreachable_engine(tok):
    checks = run([Worker(f"http://127.0.0.1:{free_port()}")], tok)
    c = assert_only_failure(checks, "reachable", "engine is running")
    assert all(c[n].status == "skip" for n in ("events", "tokenization"))


def test_events_not_arriving(engines, tok):
    e16, _ = engines
    w = Worker(e16.url, kv_endpoint=f"tcp://127.0.0.1:{free_port()}")
    c = assert_only_failure(run([w], tok), "events", "no event batch arrived",
                            "enable_kv_cache_events", "bind: true")
    assert c["reachable"].status == "ok" and c["block_size"].status == "skip"


def test_wildcard_endpoint_the_router_would_connect_to(engines, tok):
    e16, _ = engines
    port = e16.kv_endpoint.rsplit(":", 1)[1]
    c = assert_only_failure(run([Worker(e16.url, kv_endpoint=f"tcp://*:{port}")], tok),
                            "topology", "bind address", "engine's host")
    assert c["events"].status == "skip"


def test_router_binds_where_the_engine_binds(engines, tok):
    e16, _ = engines
    w = Worker(e16.url, kv_endpoint=e16.kv_endpoint, bind=True)
    assert_only_failure(run([w], tok), "events", "cannot bind", "bind: false")


def test_block_size_differs(engines, tok):
    _, e32 = engines
    c = assert_only_failure(run([e32.worker()], tok), "block_size", "stores 32",
                            "block_size: 32")
    assert c["stored_tokens"].status == "ok"


def test_chat_template_differs(engines, qwen3, tmp_path):
    from kvroute.prompt import PromptTokenizer

    e16, _ = engines
    os.symlink(Path(qwen3) / "tokenizer.json", tmp_path / "tokenizer.json")
    conf = json.loads((Path(qwen3) / "tokenizer_config.json").read_text())
    conf["chat_template"] = "[router template]\n" + conf["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf))
    other = PromptTokenizer.from_dir(tmp_path)
    try:
        c = assert_only_failure(run([e16.worker()], other), "tokenization", "chat template",
                                "tokenizer_config.json")
    finally:
        other.close()
    assert "tokenizer:" not in c["tokenization"].detail  # the completions prompt agreed


def test_no_tokenizer_warns(engines):
    e16, _ = engines
    checks = run([e16.worker()], None)
    assert by_name(checks)["tokenization"].status == "warn"
    assert dr.exit_code(checks) == 0


def test_dp_rank_differs(engines, tok):
    e16, _ = engines
    w = Worker(e16.url, kv_endpoint=e16.kv_endpoint, dp_rank=2,
               replay_endpoint=e16.replay_endpoint)
    assert_only_failure(run([w], tok), "dp_rank", "publishes rank [0]", "port + 2")


def test_replay_endpoint_not_answering(engines, tok):
    e16, _ = engines
    w = Worker(e16.url, kv_endpoint=e16.kv_endpoint,
               replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    assert_only_failure(run([w], tok), "replay", "no answer", "replay_endpoint")


def test_two_workers_on_one_endpoint():
    ws = [Worker("http://a:8000", kv_endpoint="tcp://10.0.0.5:5557"),
          Worker("http://b:8000", kv_endpoint="tcp://10.0.0.5:5557")]
    checks = dr.check_topology(ws)
    assert [c.status for c in checks] == ["ok", "fail"]
    assert "also http://a:8000's" in checks[1].detail


# -- the event checks over synthetic batches ---------------------------------------------------

PROBE = list(range(2000, 2072))  # 4 blocks of 16 and 8 tokens


def batch(events, ts=1000.0, rank=0):
    return {"ts": ts, "data_parallel_rank": rank, "events": events}


def stored(tokens, parent=None, bs=16):
    n = len(tokens) // bs
    return {"type": "BlockStored", "block_hashes": list(range(n)), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": bs}


def test_stored_token_ids_that_differ_from_the_prompt():
    shifted = [1] + PROBE[:63]  # an engine that prepends a BOS token
    c = {x.name: x for x in dr.check_stored("w", PROBE, [batch([stored(shifted)])],
                                            block_size=16, dp_rank=None, recv_times=[1000.0])}
    assert c["stored_tokens"].status == "fail" and "position 0" in c["stored_tokens"].detail
    assert "BOS" in c["stored_tokens"].fix
    assert c["block_size"].status == "ok"


def test_stored_token_ids_over_several_events_agree():
    evs = [stored(PROBE[:32]), stored(PROBE[32:64], parent=1)]
    c = {x.name: x for x in dr.check_stored("w", PROBE, [batch(evs)], block_size=16,
                                            dp_rank=0, recv_times=[1000.1])}
    assert c["stored_tokens"].status == c["dp_rank"].status == c["clock"].status == "ok"


def test_clock_skew():
    c = {x.name: x for x in dr.check_stored("w", PROBE, [batch([stored(PROBE[:64])], ts=1030.0)],
                                            block_size=16, dp_rank=None, recv_times=[1000.0])}
    assert c["clock"].status == "fail" and "+30.0 s" in c["clock"].detail
    assert "NTP" in c["clock"].fix


# -- the command line and kvroute serve's start-up ---------------------------------------------

def _config(tmp_path, worker, **extra):
    import yaml

    w = {"url": worker.url, "kv_events": worker.kv_endpoint}
    if getattr(worker, "replay_endpoint", None):
        w["replay"] = worker.replay_endpoint
    cfg = {"mode": {"type": "regular", "workers": [w]}, "block_size": 16, **extra}
    p = tmp_path / "router.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_cli_prints_each_failure_with_its_fix_and_exits_non_zero(engines, qwen3, tmp_path,
                                                                  capsys):
    from kvroute.cli import main

    _, e32 = engines
    p = _config(tmp_path, e32, serving={"tokenizer": str(qwen3), "model": DEFAULT_MODEL})
    assert main(["doctor", "--config", str(p), "--timeout-s", "0.6"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  block_size" in out and "fix: set block_size: 32" in out
    assert "1 failed, 0 warnings, 8 ok" in out
    assert main(["doctor", "--config", str(p), "--timeout-s", "0.6", "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert {r["check"]: r["status"] for r in rows}["block_size"] == "fail"


def test_serve_start_up_logs_the_failures_as_warnings(engines, tmp_path, caplog):
    import argparse

    from kvroute.config import load_config
    from kvroute.serving import cli_options, process

    e16, _ = engines
    w = Worker(e16.url, kv_endpoint=f"tcp://127.0.0.1:{free_port()}")
    cfg = load_config(str(_config(tmp_path, w)))
    ns = argparse.Namespace(**{k: None for k in (
        "upstream_timeout_s", "connect_timeout_s", "max_retries", "breaker_failures",
        "breaker_reset_s", "scrape_interval_s", "scrape_stale_after_s", "orca", "tokenizer",
        "model", "host", "port", "log_level")})
    with caplog.at_level(logging.WARNING, logger="kvroute.doctor"):
        process._doctor_warnings(cfg, cli_options.serve_options(cfg, ns))
    msgs = [r.getMessage() for r in caplog.records]
    assert any("events: no event batch arrived" in m and "fix:" in m for m in msgs), msgs
    assert any("tokenization" in m for m in msgs)  # no tokenizer configured: a warning
