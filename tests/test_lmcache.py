"""lmcache_aware against an LMCache controller STAND-IN: a real FastAPI server on loopback
serving the controller's shapes (`GET /controller/workers`, `POST /lookup`). The real
controller (`lmcache` on PyPI) needs a GPU build of torch and vLLM and cannot run here."""

from __future__ import annotations

import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from _util import UvicornThread, wait_for  # noqa: E402
from kvroute import Router  # noqa: E402

W = ["http://w0", "http://w1", "http://w2"]
MAP = {"inst-0": W[0], "inst-1": W[1], "inst-2": W[2]}


class StandIn(UvicornThread):
    """A stand-in LMCache controller whose answers the test sets; `start` serves it."""

    def __init__(self) -> None:
        self.key_counts = {"inst-0": 10, "inst-1": 500, "inst-2": 40}
        self.matched = {"inst-0": 0, "inst-1": 16, "inst-2": 96}
        self.calls = 0
        app = fastapi.FastAPI()

        @app.get("/controller/workers")
        def workers():
            self.calls += 1
            return {"workers": [{"instance_id": k, "key_count": v, "ip": "127.0.0.1"}
                                for k, v in self.key_counts.items()]}

        @app.post("/lookup")
        def lookup(body: dict):
            self.calls += 1
            n = len(body["tokens"])
            return {"event_id": "e1", "layout_info": {k: ["LocalCPUBackend", min(v, n)]
                                                      for k, v in self.matched.items()}}

        super().__init__(app, start=False)


@pytest.fixture
def controller():
    c = StandIn()
    c.start()
    yield c
    c.stop()


def test_occupancy_mode_prefers_the_instance_with_most_keys(controller):
    r = Router(W, policy="lmcache_aware", lmcache_controller_url=controller.url,
               lmcache_worker_map=MAP, cache_weight=0.9, poll_interval_s=0.2)
    d = r.select_worker(list(range(100)), explain=True)
    assert d.worker == W[1] and d.policy == "lmcache_aware" and d.reason == "policy"
    assert {s.worker: s.match for s in d.scores}[W[1]] == pytest.approx(1.0)
    r.close()


def test_prefix_lookup_mode_scores_matched_tokens(controller):
    r = Router(W, policy="lmcache_aware", lmcache_controller_url=controller.url,
               lmcache_worker_map=MAP, lookup_mode="prefix_lookup")
    d = r.select_worker(list(range(128)))
    assert d.worker == W[2] and controller.calls == 1
    r.close()


def test_controller_down_falls_back_within_the_timeout_and_recovers(controller):
    r = Router(W, policy="lmcache_aware", lmcache_controller_url=controller.url,
               lmcache_worker_map=MAP, lookup_mode="prefix_lookup", controller_timeout_ms=300,
               fallback="round_robin")
    assert r.select_worker([1, 2, 3]).reason == "policy"
    controller.stop()
    t0 = time.monotonic()
    d = r.select_worker([1, 2, 3])
    assert time.monotonic() - t0 < 1.0
    assert d.fallback and d.reason == "controller_down" and d.policy == "round_robin"
    back = StandIn()
    back.port, back.url = controller.port, controller.url
    back.start()
    try:
        wait_for(lambda: r.select_worker([1, 2, 3]).reason == "policy",
                 "routing to switch back to the controller", timeout=5, interval=0.05)
    finally:
        back.stop()
        r.close()


def test_lmcache_aware_needs_its_controller():
    with pytest.raises(ValueError, match="lmcache_controller_url"):
        Router(W, policy="lmcache_aware")
