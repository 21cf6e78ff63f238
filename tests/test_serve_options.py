"""``kvroute serve``'s options (issue 39, item 3): every default written once
(`kvroute.serving.defaults`), the same in the config models, in the keyword defaults of the
classes that run them and in ``kvroute serve --help``; one table from the flags to the config
keys (`kvroute.serving.cli_options.SERVE_FLAGS`), each flag winning over its key; and
``serving.access_log_file`` / ``--access-log-file``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import sys
from typing import Any, List

import httpx
import pytest
from _util import TIMEOUT, UvicornThread, free_port, stop_process, wait_for
from test_operator import MODEL, echo_engine

import kvroute.cli as cli
from kvroute.config import (
    CircuitBreakerConfig,
    HealthCheckConfig,
    RetryConfig,
    ScrapeMetricsConfig,
    ServingConfig,
    load_config,
)
from kvroute.serving import cli_options
from kvroute.serving import defaults as D
from kvroute.serving.cli_options import SERVE_FLAGS, serve_options


def _default(cls: Any, name: str, method: str = "__init__") -> Any:
    p = inspect.signature(getattr(cls, method)).parameters[name]
    assert p.default is not inspect.Parameter.empty, f"{cls.__name__}.{name} has no default"
    return p.default


def _config_default(model: Any, name: str) -> Any:
    return model.model_fields[name].get_default(call_default_factory=True)


# -- every default written once --------------------------------------------------------------

def test_every_serving_config_default_is_its_runtime_class_keyword_default():
    from kvroute.prompt import PromptTokenizer
    from kvroute.serving.admin import DecisionLog
    from kvroute.serving.breaker import CircuitBreaker
    from kvroute.serving.health import HealthChecker, RecoveryRamp
    from kvroute.serving.limits import RequestLimits
    from kvroute.serving.load import PrometheusScraper
    from kvroute.serving.pd import PDFront
    from kvroute.serving.proxy import Proxy
    from kvroute.serving.retry import RETRY_ON, RetryPolicy
    from kvroute.serving.routes import RequestContext, install

    S = ServingConfig
    # (config model, its key) -> (class, keyword) of each runtime counterpart
    pairs = [
        ((S, "upstream_timeout_s"), [(Proxy, "upstream_timeout_s")]),
        ((S, "connect_timeout_s"), [(Proxy, "connect_timeout_s")]),
        ((S, "max_retries"), [(Proxy, "max_retries"), (RetryPolicy, "max_retries")]),
        ((S, "first_byte_timeout_s"), [(Proxy, "first_byte_timeout_s")]),
        ((S, "recovery_ramp_s"), [(Proxy, "recovery_ramp_s"), (RecoveryRamp, "ramp_s")]),
        ((S, "orca"), [(Proxy, "orca")]),
        ((S, "max_body_bytes"), [(RequestLimits, "max_body_bytes")]),
        ((S, "max_prompt_tokens"), [(RequestLimits, "max_prompt_tokens")]),
        ((S, "chars_per_token"), [(RequestLimits, "chars_per_token")]),
        ((S, "long_prompt_chars"), [(PromptTokenizer, "long_prompt_chars")]),
        ((S, "prefix_cache_tokens"), [(PromptTokenizer, "prefix_cache_tokens")]),
        ((S, "access_log"), [(RequestContext, "access_log"), (install, "access_log")]),
        ((S, "access_log_bodies"), [(RequestContext, "access_log_bodies"),
                                    (install, "access_log_bodies")]),
        ((CircuitBreakerConfig, "failures"), [(Proxy, "breaker_failures"),
                                              (CircuitBreaker, "failures")]),
        ((CircuitBreakerConfig, "reset_s"), [(Proxy, "breaker_reset_s"),
                                             (CircuitBreaker, "reset_s")]),
        ((ScrapeMetricsConfig, "interval_s"), [(PrometheusScraper, "interval_s")]),
        ((ScrapeMetricsConfig, "timeout_s"), [(PrometheusScraper, "timeout_s"),
                                              (Proxy, "scrape_timeout_s")]),
        ((ScrapeMetricsConfig, "stale_after_s"), [(PrometheusScraper, "stale_after_s"),
                                                  (Proxy, "scrape_stale_after_s")]),
        ((RetryConfig, "initial_backoff_ms"), [(RetryPolicy, "initial_backoff_ms")]),
        ((RetryConfig, "max_backoff_ms"), [(RetryPolicy, "max_backoff_ms")]),
        ((RetryConfig, "backoff_multiplier"), [(RetryPolicy, "backoff_multiplier")]),
        ((RetryConfig, "jitter_factor"), [(RetryPolicy, "jitter_factor")]),
        ((HealthCheckConfig, "failure_threshold"), [(HealthChecker, "failure_threshold")]),
        ((HealthCheckConfig, "success_threshold"), [(HealthChecker, "success_threshold")]),
        ((HealthCheckConfig, "timeout_s"), [(HealthChecker, "timeout_s")]),
        ((HealthCheckConfig, "check_interval_s"), [(HealthChecker, "check_interval_s")]),
        ((HealthCheckConfig, "endpoint"), [(HealthChecker, "endpoint")]),
    ]
    for (model, key), runtime in pairs:
        want = _config_default(model, key)
        for cls, kw in runtime:
            got = _default(cls, kw) if inspect.isclass(cls) else \
                inspect.signature(cls).parameters[kw].default
            assert got == want, f"{model.__name__}.{key} = {want!r}, {cls.__name__}({kw}=" \
                                f"{got!r})"
    # the keys whose runtime form differs in shape
    assert list(_default(RequestContext, "request_id_headers")) == \
        _config_default(S, "request_id_headers") == \
        list(inspect.signature(install).parameters["request_id_headers"].default)
    assert sorted(_config_default(RetryConfig, "retry_on")) == sorted(RETRY_ON)
    # not config keys, one default each
    assert _default(Proxy, "decision_log_size") == _default(PDFront, "decision_log_size") == \
        _default(DecisionLog, "size") == D.DECISION_LOG_SIZE
    assert _config_default(S, "gc_threshold") == list(D.GC_THRESHOLD)
    assert _config_default(S, "access_log_file") is None


def test_the_defaults_module_needs_no_pydantic():
    """Plain constants: it imports typing and the tokenizer's constants, and kvroute.prompt
    imports no pydantic (`pip install kvroute` without the config extra can read them)."""
    import ast
    from pathlib import Path

    import kvroute.prompt

    def imports(path: Path) -> set:
        tree = ast.parse(path.read_text())
        out = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        return out | {n.module for n in ast.walk(tree)
                      if isinstance(n, ast.ImportFrom) and n.module}

    assert imports(Path(D.__file__)) <= {"__future__", "typing", "kvroute.prompt.tokenizer"}
    for f in Path(kvroute.prompt.__file__).parent.glob("*.py"):
        assert not any(m.split(".")[0] in ("pydantic", "fastapi") for m in imports(f)), f


# -- the one table -----------------------------------------------------------------------------

def _key_default(key: str) -> Any:
    """The config's default of a key path under ``serving`` or ``health_check``."""
    top, *path = key.split(".")
    model: Any = {"serving": ServingConfig, "health_check": HealthCheckConfig}[top]
    for i, p in enumerate(path):
        if i == len(path) - 1:
            return _config_default(model, p)
        sub = model.model_fields[p].annotation
        model = next((a for a in getattr(sub, "__args__", (sub,)) if hasattr(a, "model_fields")),
                     sub)
    raise AssertionError(key)


def test_every_table_default_is_the_config_default():
    checked = 0
    for row in SERVE_FLAGS:
        if row.const is not cli_options._UNSET or row.default is cli_options._UNSET:
            continue
        if row.key.startswith(("serving.", "health_check.")):
            want = _key_default(row.key)
            got = list(row.default) if isinstance(row.default, tuple) else row.default
            assert got == want, f"{row.flag}: table {row.default!r}, config {want!r}"
            checked += 1
    assert checked >= 30
    # the server keys' defaults: serve_options with neither flag nor key
    so = serve_options(load_config({"mode": {"worker_urls": ["http://a"]}}),
                       argparse.Namespace())
    rows = {r.key: r for r in SERVE_FLAGS}
    assert (so["host"], so["port"], so["log_level"]) == (
        rows["host"].default, rows["port"].default, rows["log_level"].default)


def test_the_docstring_table_is_the_table():
    doc = cli_options.__doc__ or ""
    rule = next(ln for ln in doc.splitlines() if ln.startswith("=="))
    flag_w, key_w = (len(c) for c in rule.split()[:2])
    listed = [(ln[:flag_w].split()[0], ln[flag_w + 1:flag_w + 1 + key_w].strip())
              for ln in doc.splitlines() if ln.startswith("--")]
    assert listed == [(r.flag, r.key) for r in SERVE_FLAGS]
    for row in SERVE_FLAGS:
        for alias in row.names[1:]:
            assert f"``{alias}`` = ``{row.flag}``" in doc.replace("\n", " ")


def _parsed(monkeypatch, argv: List[str]) -> argparse.Namespace:
    got: list = []
    monkeypatch.setattr(cli, "serve_cmd", lambda args: got.append(args) or 0)
    assert cli.main(["serve", "--worker-urls", "http://a", *argv]) == 0
    return got[0]


def test_serve_help_shows_the_defaults_written_once(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in (",".join(str(x) for x in D.GC_THRESHOLD), f"default {D.UPSTREAM_TIMEOUT_S:g}",
                  f"default {D.CONNECT_TIMEOUT_S:g}", f"default {D.MAX_RETRIES}",
                  f"default {D.HEALTH_CHECK_INTERVAL_S:g}", f"default {D.PREFIX_CACHE_TOKENS}",
                  f"default {D.LONG_PROMPT_CHARS}", D.REQUEST_ID_HEADER, "--access-log-file"):
        assert shown in text, shown
    # every row is declared on the serve parser, every flag name of it
    for row in SERVE_FLAGS:
        for name in row.names:
            assert name in text, name


def test_every_flag_wins_over_its_key(monkeypatch):
    cfg = load_config({"mode": {"worker_urls": ["http://a"]},
                       "serving": {"upstream_timeout_s": 30, "orca": "json",
                                   "access_log_file": "/from/config.log",
                                   "circuit_breaker": {"failures": 9},
                                   "scrape_metrics": {"interval_s": 4}}})
    so = serve_options(cfg, _parsed(monkeypatch, [
        "--upstream-timeout", "7", "--orca", "off", "--access-log-file", "/from/flag.log",
        "--breaker-failures", "2", "--scrape-stale-after-s", "9", "--port", "0",
        "--pd-uncached-token-threshold", "3"]))
    c = so["config"]
    assert (c.serving.upstream_timeout_s, c.serving.orca, c.serving.access_log_file) == (
        7.0, "off", "/from/flag.log")
    assert c.serving.circuit_breaker.failures == 2
    assert (c.serving.scrape_metrics.interval_s, c.serving.scrape_metrics.stale_after_s) == (
        4.0, 9.0)
    assert (so["port"], c.pd_uncached_token_threshold) == (0, 3)
    assert so["options"] == {"upstream_timeout_s": 7.0, "orca": False, "breaker_failures": 2,
                             "scrape_stale_after_s": 9.0}
    # without the flags: the config's keys
    so = serve_options(cfg, _parsed(monkeypatch, []))
    assert so["config"].serving.access_log_file == "/from/config.log"
    assert so["options"] == {}


def test_a_flag_inside_a_section_that_is_off(monkeypatch):
    plain = load_config({"mode": {"worker_urls": ["http://a"]}})
    # --scrape-stale-after-s alone does not turn scraping on; --scrape-interval-s does
    so = serve_options(plain, _parsed(monkeypatch, ["--scrape-stale-after-s", "9"]))
    assert so["config"].serving.scrape_metrics is None and so["options"] == {}
    so = serve_options(plain, _parsed(monkeypatch, ["--scrape-interval-s", "2"]))
    assert so["config"].serving.scrape_metrics == ScrapeMetricsConfig(interval_s=2)
    # --disable-health-check wins over a --health-* flag
    so = serve_options(plain, _parsed(monkeypatch, ["--health-failure-threshold", "2",
                                                    "--disable-health-check"]))
    assert so["config"].health_check is None and "health_check" not in so["options"]


def test_a_bad_flag_value_names_the_flag_and_its_key(monkeypatch):
    plain = load_config({"mode": {"worker_urls": ["http://a"]}})
    for argv, named in ((["--max-retries", "17"], "--max-retries (serving.max_retries)"),
                        (["--connect-timeout", "0"], "--connect-timeout-s "
                                                     "(serving.connect_timeout_s)"),
                        (["--health-check-endpoint", "x"], "--health-check-endpoint "
                                                           "(health_check.endpoint)"),
                        (["--port", "70000"], "--port (port)")):
        with pytest.raises(ValueError, match=re.escape(named)):
            serve_options(plain, _parsed(monkeypatch, argv))


def test_a_serving_flag_in_prefill_decode_mode_is_not_taken_for_an_orca_request(monkeypatch):
    """Applying a flag keeps which serving keys the config set: the prefill/decode front
    refuses ``orca`` only when it was asked for."""
    from kvroute.fastapi import create_app

    pd = load_config({"mode": {"type": "vllm_prefill_decode", "prefill_urls": [["http://p", None]],
                               "decode_urls": ["http://d"]}, "policy": "round_robin"})
    so = serve_options(pd, _parsed(monkeypatch, ["--max-prompt-tokens", "100"]))
    assert "orca" not in so["config"].serving.model_fields_set
    app = create_app(so["config"], **so["options"])
    app.state.kvroute_pd_router.close()
    so = serve_options(pd, _parsed(monkeypatch, ["--orca", "json"]))
    with pytest.raises(ValueError, match="orca"):
        create_app(so["config"], **so["options"])


# -- --access-log-file -------------------------------------------------------------------------

@pytest.mark.slow  # a subprocess
def test_kvroute_serve_access_log_file_gets_the_json_access_lines(tmp_path):
    engine = UvicornThread(echo_engine("e0"))
    conf = {"mode": {"type": "regular", "worker_urls": [engine.url]},
            "policy": {"type": "round_robin"}, "serving": {"model": MODEL, "orca": "off"}}
    path = tmp_path / "router.yaml"
    path.write_text(json.dumps(conf))  # JSON is YAML
    log = tmp_path / "access.log"
    log.write_text("an earlier line\n")  # appended to, not replaced
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path), "--host",
         "127.0.0.1", "--port", str(port), "--no-doctor", "--log-level", "warning",
         "--access-log-file", str(log)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "kvroute serve to answer /health", timeout=60)
        for i in range(3):
            r = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT,
                           json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2},
                           headers={"x-request-id": f"req-{i}"})
            assert r.status_code == 200, r.text
    finally:
        err = stop_process(proc)
        engine.stop()
    lines = log.read_text().splitlines()
    assert lines[0] == "an earlier line"
    entries = [json.loads(x) for x in lines[1:]]
    completions = [e for e in entries if e.get("path") == "/v1/completions"]
    assert [e.get("request_id") for e in completions] == ["req-0", "req-1", "req-2"], entries
    assert all(e["status"] == 200 for e in completions)
    # and not on stderr
    assert "req-1" not in err
