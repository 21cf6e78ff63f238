"""The request pipeline under every front (issue 39's defects, each failing on the code before
it): keys enforced in prefill/decode mode, explain data only for those allowed, the decision
log keyed by x-request-id, worker URLs validated at start-up, request ids passed byte for
byte, the prediction-error mean on /metrics, and tenant limits / reloads shared by the
processes of ``kvroute serve --workers N``.

Real HTTP on loopback: the engines are FastAPI stand-ins (`test_operator.echo_engine`) served
by uvicorn, the router a real `kvroute.fastapi.create_app`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest
from _util import TIMEOUT, UvicornThread, free_port, stop_process, wait_for
from test_operator import ADMIN_KEY, KEYS, MODEL, bearer, echo_engine, sha

from kvroute.config import ConfigError
from kvroute.fastapi import create_app

LATIN1_ID = b"req-\xe9t\xe9-\xff"  # not UTF-8: must reach the engine as these bytes


@pytest.fixture(scope="module")
def engines():
    srvs = [UvicornThread(echo_engine(f"e{i}")) for i in range(2)]
    yield srvs
    for s in srvs:
        s.stop()


def tenants(**alpha: Any) -> List[Dict[str, Any]]:
    return [{"name": "alpha", "key": KEYS["alpha"], **alpha},
            {"name": "gone", "key": KEYS["gone"], "revoked": True}]


def pd_config(engines: List[UvicornThread], **extra: Any) -> Dict[str, Any]:
    return {"mode": {"type": "vllm_prefill_decode",
                     "prefill_urls": [[engines[0].url, None]],
                     "decode_urls": [engines[1].url]},
            "policy": "round_robin", "serving": {"model": MODEL},
            "tenants": tenants(), "admin": {"key": ADMIN_KEY}, **extra}


def regular_config(engines: List[UvicornThread], **extra: Any) -> Dict[str, Any]:
    return {"mode": {"type": "regular", "worker_urls": [e.url for e in engines]},
            "policy": {"type": "round_robin"}, "serving": {"model": MODEL, "orca": "off"},
            **extra}


def completion(c: httpx.Client, key: str = None, **headers: Any) -> httpx.Response:
    h = {**(bearer(key) if key else {}), **headers}
    return c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3, 4],
                                           "max_tokens": 2}, headers=h)


# -- prefill/decode mode runs the same pipeline ---------------------------------------------------

def test_prefill_decode_mode_enforces_tenant_keys(engines):
    srv = UvicornThread(create_app(pd_config(engines)))
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            r = completion(c)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["type"] == "AuthenticationError"
            assert completion(c, "sk-not-a-key").status_code == 401
            assert completion(c, KEYS["gone"]).status_code == 401
            assert c.get("/v1/models").status_code == 401
            r = completion(c, KEYS["alpha"])
            assert r.status_code == 200, r.text
            seen = r.json()["headers"]  # the decode engine's view of the request
            assert seen["x-kvroute-tenant"] == "alpha"
            assert not any(k.lower() == "authorization" for k in seen)
    finally:
        srv.stop()


def test_prefill_decode_mode_serves_every_route_of_the_table(engines):
    srv = UvicornThread(create_app(pd_config(engines)))
    admin = bearer(ADMIN_KEY)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            r = completion(c, KEYS["alpha"], **{"x-request-id": "pd-req-1"})
            assert r.status_code == 200
            ready = c.get("/ready")
            assert ready.status_code == 200 and set(ready.json()) >= {"prefill", "decode"}
            assert c.get("/workers", headers=bearer(KEYS["alpha"])).status_code == 401
            w = c.get("/workers", headers=admin)
            assert w.status_code == 200
            assert list(w.json()["decode"]["workers"]) == [engines[1].url]
            assert list(w.json()["prefill"]["workers"]) == [engines[0].url]
            ex = c.post("/v1/explain", json={"prompt": [1, 2, 3]}, headers=admin)
            assert ex.status_code == 200, ex.text
            assert ex.json()["decision"]["worker"] == engines[1].url
            assert ex.json()["prefill"]["decision"]["worker"] == engines[0].url
            d = c.get("/admin/decisions", params={"request_id": "pd-req-1"}, headers=admin)
            [entry] = d.json()["decisions"]
            assert entry["tenant"] == "alpha" and entry["worker"] == engines[1].url
            assert entry["prefill"]["worker"] == engines[0].url
            assert c.get("/admin/snapshot", headers=admin).status_code == 400  # which pool?
            snap = c.get("/admin/snapshot", params={"pool": "decode"}, headers=admin)
            assert snap.status_code == 200 and snap.content
            assert c.post("/admin/workers", json={"url": "http://127.0.0.1:9"},
                          headers=admin).status_code == 400  # no pool named
            added = c.post("/admin/workers", json={"pool": "decode", "url": "http://127.0.0.1:9"},
                           headers=admin)
            assert added.status_code == 201 and added.json()["pool"] == "decode"
            gone = c.delete("/admin/workers/http://127.0.0.1:9", headers=admin)
            assert gone.status_code == 200 and gone.json()["pool"] == "decode"
    finally:
        srv.stop()


@pytest.mark.parametrize("extra, key", [
    ({"response_cache": {"max_entries": 10}}, "response_cache"),
    ({"replicas": {"redis_url": "redis://127.0.0.1:1"}}, "replicas"),
    ({"adaptive_cache_weight": True}, "adaptive_cache_weight"),
])
def test_prefill_decode_mode_refuses_what_it_cannot_honour(engines, extra, key):
    with pytest.raises(ConfigError, match=key):
        create_app(pd_config(engines, **extra))


# -- explain data ---------------------------------------------------------------------------

def test_a_tenant_does_not_get_the_scores_of_every_worker(engines):
    srv = UvicornThread(create_app(regular_config(engines, tenants=tenants(),
                                                  admin={"key": ADMIN_KEY})))
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            r = completion(c, KEYS["alpha"], **{"x-kvroute-explain": "1"})
            assert r.status_code == 200
            assert "x-kvroute-decision" not in r.headers
            assert "x-kvroute-scores" not in r.headers
            assert "x-kvroute-worker" in r.headers
    finally:
        srv.stop()


def test_explain_headers_need_the_admin_key_when_one_is_configured(engines):
    srv = UvicornThread(create_app(regular_config(engines, admin={"key": ADMIN_KEY})))
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            r = completion(c, None, **{"x-kvroute-explain": "1"})
            assert r.status_code == 200 and "x-kvroute-scores" not in r.headers
            r = completion(c, ADMIN_KEY, **{"x-kvroute-explain": "1"})
            scores = json.loads(r.headers["x-kvroute-scores"])
            assert {s["worker"] for s in scores} == {e.url for e in engines}
    finally:
        srv.stop()


def test_explain_headers_stay_open_without_auth(engines):
    srv = UvicornThread(create_app(regular_config(engines)))
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            r = completion(c, None, **{"x-kvroute-explain": "1", "x-request-id": "open-1"})
            decision = json.loads(r.headers["x-kvroute-decision"])
            assert decision["request_id"] == "open-1"
            assert isinstance(decision["decision_id"], int)
    finally:
        srv.stop()


# -- the decision log ---------------------------------------------------------------------------

def test_the_decision_log_is_keyed_by_the_request_id(engines):
    srv = UvicornThread(create_app(regular_config(engines)))
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            for i in range(3):
                assert completion(c, None, **{"x-request-id": f"client-{i}"}).status_code == 200
            r = c.get("/admin/decisions", params={"request_id": "client-1"}).json()
            [entry] = r["decisions"]
            assert entry["request_id"] == "client-1"
            all_ids = [e["request_id"] for e in c.get("/admin/decisions").json()["decisions"]]
            assert all_ids == ["client-0", "client-1", "client-2"]
    finally:
        srv.stop()


# -- worker URLs ------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://x", "http://", "http://h:99999",
                                 "http://h:0", "unix://relative.sock"])
def test_a_worker_url_requests_cannot_reach_is_refused_at_start_up(url):
    cfg = {"mode": {"type": "regular", "worker_urls": ["http://127.0.0.1:1", url]},
           "policy": "round_robin"}
    with pytest.raises(ConfigError, match="worker URL"):
        create_app(cfg)
    pd = {"mode": {"type": "vllm_prefill_decode", "prefill_urls": [[url, None]],
                   "decode_urls": ["http://127.0.0.1:1"]}, "policy": "round_robin"}
    with pytest.raises(ConfigError, match="worker URL"):
        create_app(pd)


def test_the_same_url_is_refused_by_the_admin_route():
    from kvroute.serving.build import validate_worker_url

    for url in ("127.0.0.1:8000", "ftp://x", "http://", "http://h:99999"):
        with pytest.raises(ValueError):
            validate_worker_url(url)
    assert validate_worker_url("http://10.0.0.5:8000") == "http://10.0.0.5:8000"
    assert validate_worker_url("unix:///run/engine.sock") == "unix:///run/engine.sock"


# -- request ids byte for byte -------------------------------------------------------------------

def _raw_post(url: str, rid: bytes, key: str = None) -> Dict[str, Any]:
    """POST a completion with a non-UTF-8 x-request-id (httpx sends header bytes as given)."""
    headers = [(b"x-request-id", rid), (b"content-type", b"application/json")]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    r = httpx.post(url + "/v1/completions", headers=headers, timeout=TIMEOUT,
                   content=json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}))
    assert r.status_code == 200, r.text
    assert r.headers.raw[[k.lower() for k, _ in r.headers.raw].index(b"x-request-id")][1] == rid
    return r.json()


def test_request_ids_reach_the_engine_byte_for_byte(engines):
    for cfg in (regular_config(engines), pd_config(engines, tenants=None, admin=None)):
        srv = UvicornThread(create_app(cfg))
        try:
            seen = _raw_post(srv.url, LATIN1_ID)["headers"]  # the engine's latin-1 reading
            rid = next(v for k, v in seen.items() if k.lower() == "x-request-id")
            assert rid.encode("latin-1") == LATIN1_ID, (cfg["mode"]["type"], rid)
        finally:
            srv.stop()


# -- metrics ---------------------------------------------------------------------------------

def test_the_mean_prediction_error_is_readable_from_metrics():
    import kvroute
    from kvroute.serving.metrics import RouterMetrics

    with kvroute.Router([kvroute.Worker("http://a:1"), kvroute.Worker("http://b:1")],
                        policy="round_robin", block_size=16) as router:
        metrics = RouterMetrics(router)
        for cached in (32, 16):  # nothing captured: the error is -cached / 64, below 0
            d = router.select_worker(list(range(64)))
            router.report_delivered(d, cached, prompt_tokens=64)
            router.complete(d)
        text = metrics.render()[0].decode()
    sums = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvroute_prefix_prediction_error_sum{")}
    counts = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines()
              if line.startswith("kvroute_prefix_prediction_error_count{")}
    assert sorted(sums.values()) == [-0.5, -0.25] and sorted(counts.values()) == [1.0, 1.0]


# -- logging ---------------------------------------------------------------------------------

def test_log_level_governs_kvroute_loggers(capfd):
    import logging

    from kvroute.serving import logs

    try:
        logs.configure("info")
        logging.getLogger("kvroute.adaptive").info("cache_weight 0.7 -> 0.8")
        logging.getLogger("kvroute.access").info('{"request_id":"x"}')
        logging.getLogger("kvroute.x").debug("not at info")
        err = capfd.readouterr().err
        assert "INFO:     kvroute.adaptive: cache_weight 0.7 -> 0.8" in err
        assert '{"request_id":"x"}\n' in err and "kvroute.access:" not in err
        assert "not at info" not in err
        logs.configure("debug")
        logging.getLogger("kvroute.x").debug("now at debug")
        assert "now at debug" in capfd.readouterr().err
    finally:
        for name in ("kvroute", "kvroute.access"):
            lg = logging.getLogger(name)
            for h in list(lg.handlers):
                lg.removeHandler(h)
            lg.setLevel(logging.NOTSET)


# -- the processes of kvroute serve --workers N share limits and reloads ------------------------

def test_shared_limits_count_every_process(tmp_path):
    from kvroute.serving.auth import AuthError, Tenant
    from kvroute.serving.shared_limits import SharedLimits

    a, b = SharedLimits(str(tmp_path), 0), SharedLimits(str(tmp_path), 1)
    t = Tenant("alpha", sha("k"), max_concurrent=2)
    a.admit(t)
    b.admit(t)
    for side in (a, b):
        with pytest.raises(AuthError) as e:
            side.admit(t)
        assert e.value.reason == "concurrency"
    a.release(t)
    b.admit(t)
    assert a.inflight("alpha") == b.inflight("alpha") == 2
    r = Tenant("beta", sha("k2"), rate_limit_rps=0.001, burst=5)
    admitted = 0
    for i in range(12):
        try:
            (a if i % 2 else b).admit(r)
            admitted += 1
        except AuthError as e:
            assert e.reason == "rate_limit"
    assert admitted == 5  # one bucket for both processes
    calls: List[int] = []
    b.on_generation = lambda: calls.append(1)
    a.bump()
    b.poll()
    b.poll()
    assert calls == [1]


def _serve_workers(path: Path, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path), "--host",
         "127.0.0.1", "--port", str(port), "--workers", "2", "--no-doctor", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_kvroute_serve_workers_shares_tenant_limits_and_reloads(engines, tmp_path):
    admin_cfg = {"key": ADMIN_KEY}
    cfg = regular_config(engines, tenants=tenants(max_concurrent=2), admin=admin_cfg)
    path = tmp_path / "router.yaml"
    path.write_text(json.dumps(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    shm_before = set(Path("/dev/shm").glob("kvroute-replicas-*"))
    proc = _serve_workers(path, port, "--log-level", "info")
    try:
        pids: set = set()

        def both_answer() -> bool:
            assert proc.poll() is None
            try:
                r = httpx.get(f"{url}/health", timeout=5)
            except httpx.HTTPError:
                return False
            pids.add(r.headers.get("x-kvroute-pid"))
            return len(pids) == 2
        wait_for(both_answer, "both processes to answer /health", timeout=90)

        statuses: List[int] = []
        lock = threading.Lock()
        start = threading.Barrier(8)

        def one() -> None:
            with httpx.Client(timeout=TIMEOUT) as c:  # a connection each: both processes
                start.wait()
                r = c.post(f"{url}/v1/completions", headers=bearer(KEYS["alpha"]),
                           json={"model": MODEL, "prompt": [1, 2], "delay_s": 1.5})
            with lock:
                statuses.append(r.status_code)
        threads = [threading.Thread(target=one) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert sorted(statuses) == [200, 200] + [429] * 6, statuses

        # revoke alpha's key and reload through one process: every process refuses it
        cfg["tenants"] = tenants(max_concurrent=2, revoked=True)
        path.write_text(json.dumps(cfg))
        r = httpx.post(f"{url}/admin/reload", headers=bearer(ADMIN_KEY), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        answered: set = set()
        for _ in range(12):
            with httpx.Client(timeout=TIMEOUT) as c:
                r = c.post(f"{url}/v1/completions", headers=bearer(KEYS["alpha"]),
                           json={"model": MODEL, "prompt": [1, 2]})
                assert r.status_code == 401, r.text
                answered.add(c.get(f"{url}/health").headers.get("x-kvroute-pid"))
    finally:
        err = stop_process(proc)
    access = [json.loads(line) for line in err.splitlines() if line.startswith('{"ts"')]
    assert sum(1 for a in access if a["path"] == "/v1/completions") == 8 + 12, err[-2000:]
    # the processes' shared directory (limits, reloads, load) goes with the server
    assert set(Path("/dev/shm").glob("kvroute-replicas-*")) <= shm_before


@pytest.mark.slow
def test_kvroute_serve_writes_the_access_log_that_becomes_a_trace(engines, tmp_path):
    cfg = regular_config(engines)
    cfg["serving"]["access_log_bodies"] = True
    path = tmp_path / "router.yaml"
    path.write_text(json.dumps(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path), "--host",
         "127.0.0.1", "--port", str(port), "--no-doctor", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def up() -> bool:
            assert proc.poll() is None
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, "kvroute serve to answer /health", timeout=60)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for i in range(3):
            r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=TIMEOUT,
                           headers={"x-session-id": f"s-{i}"})
            assert r.status_code == 200
    finally:
        err = stop_process(proc)
    log = tmp_path / "access.log"
    log.write_text(err)  # the access lines among uvicorn's own (the converter skips those)
    out = tmp_path / "trace.jsonl"
    done = subprocess.run([sys.executable, "-m", "kvroute.cli", "access-log-to-trace",
                           str(log), str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["session_id"] for r in records] == ["s-0", "s-1", "s-2"]
    assert all(r["body"] == chat for r in records)


def test_a_tenant_with_explain_in_its_config_gets_the_scores(engines):
    srv = UvicornThread(create_app(regular_config(engines, tenants=tenants(explain=True),
                                                  admin={"key": ADMIN_KEY})))
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            r = completion(c, KEYS["alpha"], **{"x-kvroute-explain": "1"})
            scores = json.loads(r.headers["x-kvroute-scores"])
            assert {s["worker"] for s in scores} == {e.url for e in engines}
            assert completion(c, KEYS["alpha"]).headers.get("x-kvroute-scores") is None
    finally:
        srv.stop()


def test_prefill_decode_processes_share_their_load(engines, tmp_path):
    """Two PD fronts over one directory (what two processes of ``kvroute serve --workers 2``
    get): a request held on the decode worker by one is counted in the other's load."""
    cfg = pd_config(engines, tenants=None, admin=None)
    apps = [UvicornThread(create_app(cfg, replicas={"local_dir": str(tmp_path),
                                                    "replica_id": rid,
                                                    "sync_interval_s": 0.02}))
            for rid in ("a", "b")]
    try:
        held = threading.Thread(target=lambda: httpx.post(
            apps[0].url + "/v1/completions", timeout=TIMEOUT,
            json={"model": MODEL, "prompt": [1, 2, 3], "delay_s": 2.0}))
        held.start()

        def peer_sees_it() -> bool:
            w = httpx.get(apps[1].url + "/workers", timeout=TIMEOUT).json()
            return w["decode"]["workers"][engines[1].url]["peer_inflight_requests"] == 1
        wait_for(peer_sees_it, "the other front to count the held request", timeout=10)
        held.join()
        wait_for(lambda: httpx.get(apps[1].url + "/workers", timeout=TIMEOUT).json()
                 ["decode"]["workers"][engines[1].url]["peer_inflight_requests"] == 0,
                 "the release to reach the other front", timeout=10)
    finally:
        for a in apps:
            a.stop()


def test_prefill_decode_mode_refuses_replicas_through_a_store(engines):
    with pytest.raises(ConfigError, match="replicas"):
        create_app(pd_config(engines), replicas={"redis_url": "redis://127.0.0.1:1"})
