"""The vLLM router fork's published configurations (shared data ``seed_configs/``, read where
they are, never copied) load as they are, with the meaning the fork documents; the vLLM
router's server keys reach ``kvroute serve``; keys kvroute cannot honour are refused in one
error."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
from pathlib import Path

import httpx
import pytest
from _util import require, require_file

from kvroute import PDRouter, Router
from kvroute.cli import _config_source, serve_options
from kvroute.config import ConfigError, load_config
from kvroute.policies import CacheAware, ConsistentHash, KvAware, LmcacheAware, PowerOfTwo


@pytest.fixture(scope="module")
def seeds(shared_data: Path) -> Path:
    d = shared_data / "seed_configs"
    require_file(d / "README.md", "the fork's configurations")
    return d


def _serve_args(**kw) -> argparse.Namespace:
    base = dict(config=None, worker_urls=None, policy=None, pd=False, prefill=None, decode=None,
                intra_node_data_parallel_size=None, pd_uncached_token_threshold=None,
                host=None, port=None, log_level=None,
                tokenizer=None, model=None, upstream_timeout_s=None, connect_timeout_s=None,
                max_retries=None, breaker_failures=None, breaker_reset_s=None,
                scrape_interval_s=None, scrape_stale_after_s=None, orca=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_lmcache_regular_loads_and_routes_as_documented(seeds):
    path = seeds / "lmcache-regular.yaml"
    cfg = load_config(path)
    kw = cfg.router_kwargs()
    assert kw["policy"] == LmcacheAware(
        controller_url="http://lmcache-controller:9000",
        worker_map={"vllm-001": "http://vllm-worker-001:8000",
                    "vllm-002": "http://vllm-worker-002:8000"},
        lookup_mode="occupancy", poll_interval_s=10.0, controller_timeout_ms=2000.0,
        cache_weight=0.7)
    assert kw["fallback"] == PowerOfTwo()
    assert [w.url for w in cfg.workers()] == ["http://vllm-worker-001:8000",
                                            "http://vllm-worker-002:8000"]
    with Router.from_config(path) as r:
        assert r.policy == "lmcache_aware"


def test_lmcache_pd_loads_with_both_pools(seeds):
    cfg = load_config(seeds / "lmcache-pd.yaml")
    assert cfg.is_pd
    pk, dk = cfg.prefill_router_kwargs(), cfg.decode_router_kwargs()
    assert pk["policy"].name == "lmcache_aware" and pk["policy"].cache_weight == 0.8
    assert pk["policy"].worker_map == {"prefill-instance-1": "http://prefill-1:8081",
                                       "prefill-instance-2": "http://prefill-2:8081"}
    assert pk["fallback"] == PowerOfTwo()
    assert dk["policy"] == ConsistentHash(virtual_nodes=160)
    with PDRouter.from_config(seeds / "lmcache-pd.yaml") as pd:
        assert (pd.prefill.policy, pd.decode.policy) == ("lmcache_aware", "consistent_hash")
        assert [w.url for w in pd.decode.workers] == ["http://decode-1:8083",
                                                      "http://decode-2:8083"]


def test_kv_events_pd_maps_the_nested_keys(seeds):
    cfg = load_config(seeds / "kv-events-pd.yaml")
    dk = cfg.decode_router_kwargs()
    assert dk["policy"] == KvAware()
    assert (dk["block_size"], dk["speculative_ttl_s"], dk["topic"]) == (16, 2.0, "")
    decode = cfg.decode_workers()
    assert [(w.url, w.kv_endpoint) for w in decode] == [
        ("http://decode1:8083", "tcp://decode1:5557"),
        ("http://decode2:8084", "tcp://decode2:5557")]
    assert cfg.mode.prefill[0].url == "http://prefill1:8081"
    assert cfg.mode.prefill[0].bootstrap_port is None
    assert cfg.model_path == "meta-llama/Llama-3.1-8B-Instruct"
    with PDRouter.from_config(seeds / "kv-events-pd.yaml") as pd:
        assert pd.decode.policy == "kv_aware" and pd.decode.block_size == 16


def test_pool_keys_of_kv_aware_override_the_top_level():
    cfg = load_config({"mode": {"type": "vllm_prefill_decode", "prefill_urls": [["http://p", 8998]],
                                "decode_urls": ["http://d"],
                                "decode_policy": {"type": "kv_aware", "block_size": 64,
                                                  "enable_speculative": False,
                                                  "speculative_ttl_ms": 500}}})
    dk, pk = cfg.decode_router_kwargs(), cfg.prefill_router_kwargs()
    assert (dk["block_size"], dk["speculative_ttl_s"]) == (64, 0.0)
    assert (pk["block_size"], pk["speculative_ttl_s"]) == (16, 2.0)
    assert cfg.mode.prefill[0].bootstrap_port == 8998
    cfg = load_config({"mode": {"worker_urls": ["http://a"]},
                       "policy": {"type": "kv_aware", "speculative_ttl_ms": 500}})
    assert cfg.router_kwargs()["speculative_ttl_s"] == 0.5


def test_cli_cache_aware_pd_flags_map_to_the_upstream_defaults(seeds):
    script = (seeds / "cli-cache-aware-pd.sh").read_text()
    body = " ".join(ln.rstrip("\\").strip() for ln in script.splitlines()
                    if ln.strip() and not ln.lstrip().startswith("#"))
    words = shlex.split(body)
    assert words[0] == "vllm-router"
    # kvroute serve's parser takes the same flags (what it has of them).
    from kvroute import cli

    parsed = {}

    def capture(args: argparse.Namespace) -> int:
        parsed["args"] = args
        return 0

    real = cli.serve_cmd
    cli.serve_cmd = capture
    try:
        cli.main(["serve", *words[1:]])
    finally:
        cli.serve_cmd = real
    args = parsed["args"]
    src = _config_source(args)
    assert src["mode"]["prefill_urls"] == [["http://prefill-1:8000", None],
                                           ["http://prefill-2:8000", None]]
    assert src["mode"]["decode_urls"] == ["http://decode-1:8000", "http://decode-2:8000"]
    cfg = load_config(src)
    pol = cfg.prefill_router_kwargs()["policy"]
    assert pol == CacheAware(cache_threshold=0.3, balance_abs_threshold=64,
                             balance_rel_threshold=1.5, eviction_interval_s=120,
                             max_tree_size=2**26)
    assert cfg.decode_router_kwargs()["policy"] == pol
    with PDRouter.from_config(cfg) as pd:
        assert pd.prefill.policy == pd.decode.policy == "cache_aware"


def test_server_keys_reach_kvroute_serve():
    cfg = load_config({
        "mode": {"type": "regular", "worker_urls": ["http://a:8000"]},
        "host": "0.0.0.0", "port": 3001, "log_level": "WARN",
        "metrics": {"host": "127.0.0.1", "port": 29001},
        "health_check": {"failure_threshold": 2, "success_threshold": 1, "timeout_secs": 1,
                         "check_interval_secs": 5, "endpoint": "/health"},
        "intra_node_data_parallel_size": 2})
    so = serve_options(cfg, _serve_args())
    assert (so["host"], so["port"], so["log_level"], so["metrics"]) == (
        "0.0.0.0", 3001, "warning", ("127.0.0.1", 29001))
    assert so["options"]["health_check"] == {"failure_threshold": 2, "success_threshold": 1,
                                             "timeout_s": 1.0, "check_interval_s": 5.0,
                                             "endpoint": "/health"}
    assert [(w.name, w.dp_rank) for w in cfg.workers()] == [("http://a:8000|dp=0", 0),
                                                          ("http://a:8000|dp=1", 1)]
    # the command line wins over the config
    so = serve_options(cfg, _serve_args(host="127.0.0.1", port=0, log_level="debug"))
    assert (so["host"], so["port"], so["log_level"]) == ("127.0.0.1", 0, "debug")
    # defaults without either
    so = serve_options(load_config({"mode": {"worker_urls": ["http://a"]}}), _serve_args())
    assert (so["host"], so["port"], so["log_level"], so["metrics"]) == (
        "127.0.0.1", 8080, "info", None)
    assert "health_check" not in so["options"]


def test_data_parallel_ranks_get_their_own_event_ports():
    cfg = load_config({"mode": {"type": "regular",
                                "workers": [{"url": "http://a:8000",
                                             "kv_events": "tcp://a:5557",
                                             "replay": "tcp://a:5600"}],
                                "kv_events": {"default_port": 7000}},
                       "intra_node_data_parallel_size": 3})
    assert [(w.kv_endpoint, w.replay_endpoint, w.dp_rank) for w in cfg.workers()] == [
        ("tcp://a:5557", "tcp://a:5600", 0), ("tcp://a:5558", "tcp://a:5601", 1),
        ("tcp://a:5559", "tcp://a:5602", 2)]


def test_unhonoured_and_unknown_keys_are_named_in_one_error():
    with pytest.raises(ConfigError) as ei:
        load_config({"mode": {"worker_urls": ["http://a"], "kv_events": {"port": 1}},
                     "circuit_breaker": {"failure_threshold": 3}, "api_key": "k",
                     "log_level": "loud",
                     "policy": {"type": "kv_aware", "block_sz": 16}})
    msg = str(ei.value)
    assert "kvroute cannot honour: circuit_breaker, api_key" in msg
    assert "log_level must be one of" in msg
    assert "mode.kv_events: unknown key 'port'" in msg
    assert "policy: unknown key 'block_sz'" in msg
    assert len(ei.value.problems) == 4


def test_lmcache_worker_map_must_name_workers_of_its_pool():
    with pytest.raises(ConfigError, match="names no worker of the pool it routes: http://x"):
        load_config({"mode": {"worker_urls": ["http://a"]},
                     "policy": {"type": "lmcache_aware", "controller_url": "http://c:9000",
                                "lmcache_worker_map": {"i0": "http://a", "i1": "http://x"}}})
    with pytest.raises(ValueError, match="names no configured worker: http://x"):
        Router(["http://a"], policy=LmcacheAware(controller_url="http://c:9000",
                                                 worker_map={"i1": "http://x"}))


def test_health_checker_takes_a_failing_worker_out_and_brings_it_back():
    from kvroute.serving.health import HealthChecker

    answers = {"http://a": [500, 500, 200, 200], "http://b": [200, 200, 200, 200]}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/healthz"
        url = f"{request.url.scheme}://{request.url.host}"
        return httpx.Response(answers[url].pop(0))

    async def run() -> list:
        seen = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            hc = HealthChecker(lambda: ["http://a", "http://b"], client, failure_threshold=2,
                               success_threshold=2, timeout_s=1, check_interval_s=1,
                               endpoint="/healthz")
            for _ in range(4):
                await hc.check_once()
                seen.append((hc.healthy("http://a"), hc.healthy("http://b")))
        return seen

    assert asyncio.run(run()) == [(True, True), (False, True), (False, True), (True, True)]


@pytest.mark.parametrize("name", ["lmcache-pd.yaml", "kv-events-pd.yaml"])
def test_kvroute_serve_builds_the_pd_front_for_the_fork_pd_configs(seeds, name):
    from kvroute.fastapi import create_app

    cfg = load_config(seeds / name)
    so = serve_options(cfg, _serve_args(config=str(seeds / name)))
    app = create_app(so["config"], tokenizer=so["tokenizer"], model=so["model"],
                     **so["options"])
    pd = app.state.kvroute_pd_router
    try:
        assert [w.url for w in pd.decode.workers] == [w.url for w in cfg.decode_workers()]
    finally:
        pd.close()


def test_pd_uncached_token_threshold_from_the_config_and_the_argument():
    conf = {"mode": {"prefill_urls": ["http://p"], "decode_urls": ["http://d"]},
            "pd_uncached_token_threshold": 256}
    with PDRouter.from_config(conf) as pd:
        assert pd.threshold == 256
    with PDRouter.from_config(conf, pd_uncached_token_threshold=0) as pd:
        assert pd.threshold == 0
    with PDRouter.from_config({"mode": conf["mode"]}) as pd:
        assert pd.threshold is None  # never skip unless configured


def test_health_check_section_takes_an_unhealthy_worker_out_of_routing():
    """kvroute serve's app with the vLLM router's health_check section, against two stand-in
    engines (FastAPI on loopback): the one whose /health answers 500 gets no request."""
    fastapi = require("fastapi")
    from _util import UvicornThread, wait_for
    from fastapi.responses import JSONResponse

    from kvroute.fastapi import create_app

    def engine(status: int) -> UvicornThread:
        app = fastapi.FastAPI()
        app.state.hits = 0

        @app.get("/health")
        async def health():
            return JSONResponse({}, status_code=status)

        @app.post("/v1/completions")
        async def completions():
            app.state.hits += 1
            return JSONResponse({"choices": [{"text": "ok"}]})

        return UvicornThread(app)

    good, bad = engine(200), engine(500)
    conf = load_config({"mode": {"worker_urls": [good.url, bad.url]}, "policy": "round_robin",
                        "health_check": {"failure_threshold": 1, "success_threshold": 1,
                                         "timeout_secs": 1, "check_interval_secs": 0.05}})
    so = serve_options(conf, _serve_args())
    front = UvicornThread(create_app(conf, **so["options"]))
    try:
        wait_for(lambda: httpx.get(front.url + "/health").json()["available"] == 1,
                 "the failing worker to be marked unhealthy")
        for _ in range(6):
            r = httpx.post(front.url + "/v1/completions", json={"prompt": [1, 2, 3]})
            assert r.status_code == 200
        assert (good.app.state.hits, bad.app.state.hits) == (6, 0)
    finally:
        front.stop()
        front.app.state.kvroute_router.close()
        good.stop()
        bad.stop()


@pytest.mark.slow  # a subprocess
def test_kvroute_serve_honours_host_port_log_level_and_the_metrics_listener(tmp_path):
    import signal
    import subprocess
    import sys

    from _util import free_port, wait_for

    port, mport = free_port(), free_port()
    conf = {"mode": {"type": "regular", "worker_urls": ["http://127.0.0.1:9"]},
            "policy": {"type": "round_robin"}, "host": "127.0.0.1", "port": port,
            "log_level": "warn", "metrics": {"host": "127.0.0.1", "port": mport}}
    path = tmp_path / "router.yaml"
    path.write_text(json.dumps(conf))  # JSON is YAML
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            try:
                return (httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
                        and httpx.get(f"http://127.0.0.1:{mport}/metrics").status_code == 200)
            except httpx.HTTPError:
                return False

        wait_for(up, "kvroute serve and its metrics listener", timeout=60)
        assert "kvroute_" in httpx.get(f"http://127.0.0.1:{mport}/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    assert code == 0


def _parsed_serve_args(monkeypatch, argv: list) -> argparse.Namespace:
    """``kvroute serve ARGV`` as the command line parses it (nothing is served)."""
    import kvroute.cli as cli

    got = []
    monkeypatch.setattr(cli, "serve_cmd", lambda args: got.append(args) or 0)
    assert cli.main(["serve", *argv]) == 0
    return got[0]


def test_serve_flags_override_the_serving_and_health_check_keys(monkeypatch):
    from kvroute.fastapi import create_app

    cfg = load_config({"mode": {"worker_urls": ["http://a"]},
                       "serving": {"retry": {"max_backoff_ms": 900, "jitter_factor": 0.1},
                                   "tokenizer_threads": 4, "max_prompt_tokens": 2048},
                       "health_check": {"failure_threshold": 5, "endpoint": "/ping"}})
    args = _parsed_serve_args(monkeypatch, [
        "--worker-urls", "http://a", "--first-byte-timeout", "3", "--recovery-ramp-s", "0",
        "--retry-on", "connect", "5xx", "--retry-jitter-factor", "0.5",
        "--retry-initial-backoff-ms", "20", "--health-check-interval-secs", "7",
        "--health-check-timeout-s", "0.5", "--max-payload-size", "1000",
        "--max-prompt-tokens", "none", "--long-prompt-chars", "5000",
        "--tokenizer-max-queued", "9", "--prefix-cache-tokens", "0", "--no-access-log",
        "--request-id-headers", "x-a", "x-b", "--retry-max-retries", "4"])
    so = serve_options(cfg, args)
    s = so["config"].serving
    assert (s.first_byte_timeout_s, s.recovery_ramp_s, s.max_body_bytes) == (3.0, 0.0, 1000)
    assert s.max_prompt_tokens is None  # --max-prompt-tokens none: no limit
    assert (s.retry.retry_on, s.retry.jitter_factor, s.retry.initial_backoff_ms) == (
        ["connect", "5xx"], 0.5, 20.0)
    assert s.retry.max_backoff_ms == 900  # the config's key the flags left alone
    assert (s.tokenizer_threads, s.long_prompt_chars, s.tokenizer_max_queued,
            s.prefix_cache_tokens) == (4, 5000, 9, 0)
    assert (s.access_log, s.request_id_headers) == (False, ["x-a", "x-b"])
    assert so["options"]["max_retries"] == 4
    assert so["options"]["health_check"] == {"failure_threshold": 5, "success_threshold": 2,
                                             "timeout_s": 0.5, "check_interval_s": 7.0,
                                             "endpoint": "/ping"}
    app = create_app(so["config"], **so["options"])
    try:
        proxy = app.state.kvroute_proxy
        assert proxy.first_byte_timeout_s == 3.0 and proxy.limits.max_body_bytes == 1000
        assert proxy.retry.retry_on == frozenset({"connect", "5xx"})
        assert proxy.retry.max_retries == 4 and proxy.ramp.ramp_s == 0.0
    finally:
        app.state.kvroute_router.close()
    # a --health-* flag alone turns the checks on; --disable-health-check turns them off
    plain = load_config({"mode": {"worker_urls": ["http://a"]}})
    so = serve_options(plain, _parsed_serve_args(
        monkeypatch, ["--worker-urls", "http://a", "--health-failure-threshold", "2"]))
    assert so["options"]["health_check"]["failure_threshold"] == 2
    so = serve_options(cfg, _parsed_serve_args(
        monkeypatch, ["--worker-urls", "http://a", "--disable-health-check",
                      "--disable-retries"]))
    assert "health_check" not in so["options"] and so["config"].health_check is None
    assert so["options"]["max_retries"] == 0
    with pytest.raises(ValueError, match="retry.jitter_factor"):
        serve_options(cfg, _parsed_serve_args(
            monkeypatch, ["--worker-urls", "http://a", "--retry-jitter-factor", "3"]))


def test_serving_gc_keys_flags_and_tuning(monkeypatch):
    """serving.gc_threshold / gc_freeze: defaults, the config's keys, the flags over them
    (``python``: CPython's thresholds), bad values named; `tune_gc` applies them."""
    import gc

    from kvroute.serving.process import tune_gc

    plain = load_config({"mode": {"worker_urls": ["http://a"]}})
    assert (plain.serving.gc_threshold, plain.serving.gc_freeze) == ([50_000, 20, 100], True)
    cfg = load_config({"mode": {"worker_urls": ["http://a"]},
                       "serving": {"gc_threshold": [9000, 5, 5], "gc_freeze": False}})
    assert (cfg.serving.gc_threshold, cfg.serving.gc_freeze) == ([9000, 5, 5], False)
    s = serve_options(cfg, _parsed_serve_args(monkeypatch, ["--worker-urls", "http://a"]))
    assert s["config"].serving.gc_threshold == [9000, 5, 5]
    s = serve_options(cfg, _parsed_serve_args(
        monkeypatch, ["--worker-urls", "http://a", "--gc-threshold", "python"]))
    assert s["config"].serving.gc_threshold is None
    s = serve_options(plain, _parsed_serve_args(
        monkeypatch, ["--worker-urls", "http://a", "--gc-threshold", "1000,2,3",
                      "--no-gc-freeze"]))
    assert (s["config"].serving.gc_threshold, s["config"].serving.gc_freeze) == (
        [1000, 2, 3], False)
    with pytest.raises(ValueError, match="gc_threshold"):
        load_config({"mode": {"worker_urls": ["http://a"]},
                     "serving": {"gc_threshold": [0, 1, 1]}})
    with pytest.raises(SystemExit):
        _parsed_serve_args(monkeypatch, ["--worker-urls", "http://a", "--gc-threshold", "7,8"])
    before = gc.get_threshold()
    try:
        tune_gc(s["config"].serving)
        assert gc.get_threshold() == (1000, 2, 3) and gc.get_freeze_count() == 0
        tune_gc(cfg.serving.model_copy(update={"gc_freeze": True}))
        assert gc.get_threshold() == (9000, 5, 5) and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
