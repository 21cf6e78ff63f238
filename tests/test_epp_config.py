"""`kvroute epp` / `kvroute gateway` at start-up: what they refuse, the endpoints file, the
command line, and the Envoy bootstrap `kvroute gateway` writes (checked by the real Envoy's
``--mode validate``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import yaml
from _util import SETUP_HINT

from kvroute.config import ConfigError, load_config
from kvroute.epp import gateway as G
from kvroute.epp.protocol import endpoint_of_url
from kvroute.epp.server import check_epp_config, with_endpoints

BASE: Dict[str, Any] = {
    "mode": {"type": "regular", "workers": [{"url": "http://10.0.0.5:8000"},
                                            {"url": "http://10.0.0.6:8000"}]},
    "policy": {"type": "kv_aware"}, "block_size": 16}


def cfg(**over: Any) -> Any:
    d = json.loads(json.dumps(BASE))
    for k, v in over.items():
        d[k] = v
    return load_config(d)


def envoy() -> str:
    try:
        return G.envoy_binary()
    except FileNotFoundError as e:
        pytest.fail(f"{e} ({SETUP_HINT})", pytrace=False)


@pytest.mark.parametrize("url,endpoint", [
    ("http://10.0.0.5:8000", "10.0.0.5:8000"), ("http://10.0.0.5", "10.0.0.5:80"),
    ("https://10.0.0.5", "10.0.0.5:443"), ("http://[::1]:9000", "[::1]:9000")])
def test_a_worker_url_gives_its_endpoint(url: str, endpoint: str) -> None:
    assert endpoint_of_url(url) == endpoint


@pytest.mark.parametrize("url", ["http://engine-0:8000", "unix:///tmp/e.sock", "10.0.0.5:80"])
def test_a_worker_url_without_an_ip_address_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="ip"):
        endpoint_of_url(url)


def test_a_plain_config_is_accepted_by_both_commands() -> None:
    check_epp_config(cfg())
    check_epp_config(cfg(), gateway=True)


@pytest.mark.parametrize("serving,epp_ok,gateway_ok", [
    ({"upstream_timeout_s": 30}, False, True),
    ({"connect_timeout_s": 2}, False, True),
    ({"retry": {"initial_backoff_ms": 10}}, False, True),
    ({"first_byte_timeout_s": 5}, False, False),
    ({"first_byte_timeout_s": None}, True, True),
    ({"max_retries": 1}, True, True),
])
def test_the_data_planes_keys_are_refused_by_the_picker_alone(serving: Dict[str, Any],
                                                              epp_ok: bool,
                                                              gateway_ok: bool) -> None:
    c = cfg(serving=serving)
    for gateway, ok in ((False, epp_ok), (True, gateway_ok)):
        if ok:
            check_epp_config(c, gateway=gateway)
        else:
            with pytest.raises(ConfigError, match=next(iter(serving))):
                check_epp_config(c, gateway=gateway)


def test_a_response_cache_is_refused() -> None:
    with pytest.raises(ConfigError, match="response_cache"):
        check_epp_config(cfg(response_cache={"max_entries": 10}))


def test_prefill_decode_mode_is_refused() -> None:
    c = load_config({"mode": {"type": "vllm_prefill_decode",
                              "prefill_urls": [["http://10.0.0.5:8000", None]],
                              "decode_urls": ["http://10.0.0.6:8000"]}})
    with pytest.raises(ConfigError, match="mode"):
        check_epp_config(c)


def test_the_gateway_refuses_a_backoff_envoy_cannot_follow() -> None:
    G._check_backoff(cfg().serving)
    with pytest.raises(ConfigError, match="backoff_multiplier"):
        G._check_backoff(cfg(serving={"retry": {"backoff_multiplier": 3.0}}).serving)


def test_an_endpoints_file_replaces_the_configs_workers(tmp_path: Path) -> None:
    src = tmp_path / "router.yaml"
    src.write_text(yaml.safe_dump(BASE))
    eps = tmp_path / "endpoints.yaml"
    eps.write_text(yaml.safe_dump({"workers": [
        {"url": "http://10.1.0.1:8000", "kv_events": "tcp://10.1.0.1:5557"}]}))
    c = load_config(with_endpoints(str(src), str(eps)))
    assert [w.url for w in c.workers()] == ["http://10.1.0.1:8000"]
    assert c.policy.type == "kv_aware"  # the rest of the config is kept
    eps.write_text(yaml.safe_dump({"endpoints": []}))
    with pytest.raises(ValueError, match="workers"):
        with_endpoints(str(src), str(eps))


def test_the_command_line_takes_the_serve_flags_and_its_own() -> None:
    from kvroute.cli import parser

    a = parser().parse_args(["epp", "--config", "r.yaml", "--grpc-port", "0", "--port", "0",
                             "--max-retries", "1", "--transport", "python"])
    assert (a.grpc_port, a.port, a.max_retries, a.transport) == (0, 0, 1, "python")
    g = parser().parse_args(["gateway", "--config", "r.yaml", "--response-headers", "skip"])
    assert g.grpc_port == 0 and g.response_headers == "skip" and not g.failure_mode_allow


def test_kvroute_epp_refuses_a_hostname_worker_at_start_up(tmp_path: Path) -> None:
    src = tmp_path / "router.yaml"
    src.write_text(yaml.safe_dump({**BASE, "mode": {"type": "regular", "workers": [
        {"url": "http://engine-0.engines:8000"}]}}))
    p = subprocess.run([sys.executable, "-m", "kvroute.cli", "epp", "--config", str(src),
                        "--grpc-port", "0", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "engine-0.engines" in p.stderr and "IP address" in p.stderr


def _bootstrap(serving: Any, tmp_path: Path, **kw: Any) -> Dict[str, Any]:
    cds = tmp_path / "clusters.json"
    G.write_clusters(cds, ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8001"], 5.0)
    return G.envoy_config(serving, host="127.0.0.1", port=0, epp_port=9002, admin_port=0,
                          cds_path=str(cds), **kw)


def _route(boot: Dict[str, Any]) -> Dict[str, Any]:
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"]


def test_the_envoy_bootstrap_follows_the_config(tmp_path: Path) -> None:
    c = cfg(serving={"max_retries": 3, "upstream_timeout_s": 42, "max_body_bytes": 1 << 20,
                     "retry": {"retry_on": ["connect", "429"], "initial_backoff_ms": 20,
                               "max_backoff_ms": 400}})
    boot = _bootstrap(c.serving, tmp_path, response_headers=False, response_body=True)
    route = _route(boot)
    assert route["idle_timeout"] == "42.0s"
    rp = route["retry_policy"]
    assert rp["num_retries"] == 3
    assert rp["retry_on"].split(",") == ["connect-failure", "refused-stream",
                                         "reset-before-request", "retriable-status-codes"]
    assert rp["retriable_status_codes"] == [429]
    assert rp["retry_back_off"] == {"base_interval": "0.020s", "max_interval": "0.400s"}
    listener = boot["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 1 << 20
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    mode = hcm["http_filters"][0]["typed_config"]["processing_mode"]
    assert mode["request_body_mode"] == "BUFFERED"
    assert (mode["response_header_mode"], mode["response_body_mode"]) == ("SKIP", "STREAMED")
    clusters = json.loads((tmp_path / "clusters.json").read_text())["resources"]
    eps = clusters[0]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in eps] == [8001,
                                                                                      8002]
    no_retry = _route(_bootstrap(cfg(serving={"max_retries": 0}).serving, tmp_path))
    assert "retry_policy" not in no_retry


@pytest.mark.parametrize("kw", [{}, {"response_headers": False, "response_body": True,
                                     "failure_mode_allow": True}])
def test_the_real_envoy_accepts_the_bootstrap(tmp_path: Path, kw: Dict[str, Any]) -> None:
    exe = envoy()
    boot = _bootstrap(cfg(serving={"max_retries": 2}).serving, tmp_path, **kw)
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(boot))
    p = subprocess.run([exe, "--mode", "validate", "-c", str(path), "--log-level", "error"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    # and refuses a broken one: the check can fail
    boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["http_filters"][0]["typed_config"]["processing_mode"][
        "request_body_mode"] = "SOMETIMES"
    path.write_text(json.dumps(boot))
    p = subprocess.run([exe, "--mode", "validate", "-c", str(path), "--log-level", "error"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
