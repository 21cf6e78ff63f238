"""lmcache_aware against an LMCache controller STAND-IN: a real HTTP server on 127.0.0.1
(port 0) serving the controller's shapes (`GET /controller/workers`, `POST /lookup`) and
misbehaving on demand (hangs, trickles its body, answers 500, lists no worker, lists only
unmapped instances, goes down and comes back). The real controller (`lmcache` on PyPI) needs
a GPU build of torch and vLLM and cannot run here."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from _util import wait_for

from kvroute import Router
from kvroute.lmcache import LMCacheSource

W = ["http://w0", "http://w1", "http://w2"]
MAP = {"inst-0": W[0], "inst-1": W[1], "inst-2": W[2]}


class StandIn:
    """A stand-in LMCache controller. ``mode``: ``ok``, ``hang`` (answers after 5 s),
    ``trickle`` (headers, then the body one byte every 50 ms), ``500``, ``empty`` (no
    workers), ``unmapped`` (only instances no map names)."""

    def __init__(self, port: int = 0) -> None:
        self.mode = "ok"
        self.key_counts = {"inst-0": 10, "inst-1": 500, "inst-2": 40}
        self.matched = {"inst-0": 0, "inst-1": 16, "inst-2": 96}
        self.calls = 0
        self._release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _answer(self, body: dict) -> None:
                outer.calls += 1
                mode = outer.mode
                if mode == "hang":
                    outer._release.wait(5)
                    return
                if mode == "500":
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if mode == "trickle":
                    for i in range(len(data)):
                        if outer._release.is_set():
                            return
                        try:
                            self.wfile.write(data[i:i + 1])
                            self.wfile.flush()
                        except OSError:  # the router gave up at its deadline
                            return
                        time.sleep(0.05)
                else:
                    self.wfile.write(data)

            def do_GET(self):
                counts = outer.key_counts
                if outer.mode == "empty":
                    counts = {}
                elif outer.mode == "unmapped":
                    counts = {"stranger": 7}
                self._answer({"workers": [{"instance_id": k, "key_count": v, "ip": "127.0.0.1"}
                                          for k, v in counts.items()]})

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                tokens = json.loads(self.rfile.read(n))["tokens"]
                self._answer({"event_id": "e1", "layout_info": {
                    k: ["LocalCPUBackend", min(v, len(tokens))] for k, v in outer.matched.items()}})

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def controller():
    c = StandIn()
    yield c
    c.stop()


def lmcache_router(url: str, **kw) -> Router:
    opts = dict(policy="lmcache_aware", lmcache_controller_url=url, lmcache_worker_map=MAP,
                poll_interval_s=0.05, controller_timeout_ms=300, fallback="round_robin")
    opts.update(kw)
    return Router(W, **opts)


def test_occupancy_mode_prefers_the_instance_with_most_keys(controller):
    with lmcache_router(controller.url, cache_weight=0.9) as r:
        wait_for(lambda: r._lmcache.up, "the first poll")
        d = r.select_worker(list(range(100)), explain=True)
        assert d.worker == W[1] and d.policy == "lmcache_aware" and d.reason == "policy"
        assert {s.worker: s.match for s in d.scores}[W[1]] == pytest.approx(1.0)


def test_prefix_lookup_mode_scores_matched_tokens(controller):
    with lmcache_router(controller.url, lookup_mode="prefix_lookup") as r:
        wait_for(lambda: r._lmcache.up, "the first poll")
        before = controller.calls
        d = r.select_worker(list(range(128)))
        assert d.worker == W[2] and d.reason == "policy"
        assert controller.calls >= before + 1


@pytest.mark.parametrize("mode", ["hang", "trickle"])
def test_one_deadline_bounds_the_whole_call(controller, mode):
    controller.mode = mode  # the trickled body takes ~5 s in all
    src = LMCacheSource(controller.url, MAP, timeout_ms=300, start=False)
    try:
        t0 = time.monotonic()
        assert src.poll_once() is False
        took = time.monotonic() - t0
        assert took < 0.6, f"{mode}: one poll took {took:.3f} s with a 300 ms deadline"
        assert "300 ms" in (src.last_error or "")
        assert src.scores([1, 2]) is None
    finally:
        src.close()


@pytest.mark.parametrize("mode", ["hang", "trickle", "500", "empty", "unmapped", "down"])
def test_request_path_never_waits_and_falls_back(controller, mode):
    with lmcache_router(controller.url) as r:
        wait_for(lambda: r._lmcache.up, "the first poll")
        assert r.select_worker([1, 2, 3]).reason == "policy"
        polls = r._lmcache.polls
        if mode == "down":
            controller.stop()
        else:
            controller.mode = mode
        worst = 0.0
        deadline = time.monotonic() + 5
        d = None
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            d = r.select_worker([1, 2, 3])
            worst = max(worst, time.monotonic() - t0)
            r.complete(d)
            if d.reason == "controller_down" and r._lmcache.polls > polls + 1:
                break
            time.sleep(0.01)
        assert d is not None and d.fallback and d.reason == "controller_down"
        assert d.policy == "round_robin"
        # a map lookup, never the controller's 300 ms (generous for a shared 2-core box)
        assert worst < 0.1, f"{mode}: a decision waited {worst * 1000:.1f} ms"


def test_routing_switches_back_by_itself(controller):
    with lmcache_router(controller.url) as r:
        wait_for(lambda: r._lmcache.up, "the first poll")
        for mode in ("500", "empty", "unmapped", "hang"):
            controller.mode = mode
            wait_for(lambda: r.select_worker([1]).reason == "controller_down",
                     f"fallback on {mode}", timeout=5, interval=0.02)
            controller._release.set()  # end a hung call now
            controller.mode = "ok"
            controller._release.clear()
            wait_for(lambda: r.select_worker([1]).reason == "policy",
                     f"routing to switch back after {mode}", timeout=5, interval=0.02)
        port = controller.port
        controller.stop()
        wait_for(lambda: r.select_worker([1]).reason == "controller_down", "fallback when down",
                 timeout=5, interval=0.02)
        back = StandIn(port)  # comes back where it was
        try:
            wait_for(lambda: r.select_worker([1]).reason == "policy",
                     "routing to switch back to the controller", timeout=5, interval=0.02)
        finally:
            back.stop()


def test_polling_runs_on_its_own_thread_and_stops_with_the_router(controller):
    r = lmcache_router(controller.url)
    wait_for(lambda: r._lmcache.polls >= 3, "three polls without any request")
    assert any(t.name == "kvroute-lmcache-poll" for t in threading.enumerate())
    r.close()
    polls = r._lmcache.polls
    time.sleep(0.2)
    assert r._lmcache.polls == polls


def test_map_entries_must_name_configured_workers():
    with pytest.raises(ValueError, match="names no configured worker: http://elsewhere"):
        Router(W, policy="lmcache_aware", lmcache_controller_url="http://127.0.0.1:9",
               lmcache_worker_map={**MAP, "inst-9": "http://elsewhere"})


def test_lmcache_aware_needs_its_controller():
    with pytest.raises(ValueError, match="lmcache_controller_url"):
        Router(W, policy="lmcache_aware")
