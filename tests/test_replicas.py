"""Router replicas as one system: load shared through a real redis-server or nats-server,
index snapshots restored with a catch-up replay and restart fencing, GET /ready."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import pytest
from _util import TIMEOUT, await_for, free_port, require, require_executable, wait_for

import kvroute
from kvroute import wire
from kvroute.sim.publisher import EventPublisher
from kvroute.snapshot import (
    SnapshotError,
    iter_snapshot,
    parse_snapshot,
    restore_snapshot,
)

BS = 4


class RedisServer:
    """Debian's redis-server on a loopback port, no persistence; `stop` / `start` again on
    the same port (an outage)."""

    def __init__(self, tmp_path) -> None:
        require("redis")
        self.exe = require_executable("redis-server")
        self.port = free_port()
        self.dir = str(tmp_path)
        self.proc = None
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.option = ("redis_url", self.url)  # the Replicas keyword naming this store

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        wait_for(up, "redis-server to listen")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(TIMEOUT)
            self.proc = None


class NatsServer:
    """Debian's nats-server (core NATS, no JetStream) on a loopback port; `stop` / `start`
    again on the same port (an outage)."""

    def __init__(self, tmp_path) -> None:
        require("nats")
        self.exe = require_executable("nats-server")
        self.port = free_port()
        self.proc = None
        self.url = f"nats://127.0.0.1:{self.port}"
        self.option = ("nats_url", self.url)

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "-a", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        wait_for(up, "nats-server to listen")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(TIMEOUT)
            self.proc = None


class SharedDir:
    """The shared store of replicas on one host (``file://``, what ``kvroute serve --workers
    N`` gives its processes): `stop` moves the directory away (every write and read in it
    fails), `start` puts it back."""

    def __init__(self, tmp_path) -> None:
        self.path = tmp_path / "replicas"
        self.away = tmp_path / "replicas-away"
        self.url = f"file://{self.path}"
        self.option = ("local_dir", str(self.path))

    def start(self) -> None:
        if self.away.exists():
            self.away.rename(self.path)
        else:
            self.path.mkdir()

    def stop(self) -> None:
        self.path.rename(self.away)


@pytest.fixture(params=["redis", "nats", "file"])
def store(request, tmp_path):
    """The shared store, started: a real redis-server or nats-server, or a directory."""
    srv = {"redis": RedisServer, "nats": NatsServer, "file": SharedDir}[request.param](tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _stored(hashes, parent, first_token):
    return wire.stored(hashes, parent, list(range(first_token, first_token + BS * len(hashes))),
                       BS)


def _peer(router, worker):
    w = router.stats()["workers"][worker]
    return w["peer_inflight_requests"], w["peer_pending_prefill_tokens"]


def test_shared_load_reaches_peers_and_survives_an_outage(store):
    from kvroute.serving.shared_load import SharedLoad

    ws = ["http://w0", "http://w1"]
    a = kvroute.Router(ws, block_size=BS, seed=1)
    b = kvroute.Router(ws, block_size=BS, seed=2)
    payload = wire.encode_batch([_stored([1], None, 0)])
    for r in (a, b):
        for w in ws:
            r.ingest(w, payload, seq=0)  # events seen: kv_aware decides, not the fallback

    async def run() -> None:
        stale = 2.0  # room for a loaded machine: a peer older than this is dropped
        kw = dict(sync_interval_s=0.05, max_staleness_s=stale)
        sa = SharedLoad(a, store.url, replica_id="a", **kw)
        sb = SharedLoad(b, store.url, replica_id="b", **kw)
        sa.start()
        sb.start()
        try:
            # Credits are published once (pub/sub, best effort): decide only once both
            # replicas are subscribed, i.e. each has seen the other's load document.
            await await_for(lambda: "a" in sb.status()["peers"] and "b" in sa.status()["peers"],
                            "the replicas to see each other")
            prompt = list(range(1000, 1064))
            d = a.select_worker(prompt)
            sa.on_decision(d, prompt, {})
            other = next(w for w in ws if w != d.worker)
            # b sees a's request in flight and its speculative credit
            await await_for(lambda: _peer(b, d.worker) == (1, 64), "b to see a's load")
            await await_for(lambda: b.find_matches(prompt)[d.worker].blocks == 16,
                            "a's credit at b")
            assert _peer(b, other) == (0, 0)
            assert b.select_worker(list(range(5000, 5064))).worker == other
            st = sb.status()
            assert st["connected"] and set(st["peers"]) == {"a"}
            assert 0 <= st["peers"]["a"]["age_s"] < stale
            # The store goes away: after max_staleness_s b routes on its own load, and keeps
            # routing
            store.stop()
            await await_for(lambda: _peer(b, d.worker) == (0, 0), "b to drop a's load")
            assert not sb.status()["connected"] and sb.status()["errors"] > 0
            assert b.select_worker(list(range(7000, 7064))).worker in ws
            # The store comes back: b sees a's load again
            store.start()
            await await_for(lambda: _peer(b, d.worker)[0] == 1, "b to resync")
            assert sb.status()["connected"]
            a.complete(d)
            await await_for(lambda: _peer(b, d.worker) == (0, 0), "a's request done at b")
        finally:
            await sa.aclose()
            await sb.aclose()

    asyncio.run(run())
    a.close()
    b.close()


def test_snapshot_round_trip_and_refusals():
    ws = ["http://w0", "http://w1"]
    src = kvroute.Router(ws, block_size=BS)
    src.ingest(ws[0], wire.encode_batch([_stored([1, 2, 3], None, 0)]), seq=0)
    src.ingest(ws[0], wire.encode_batch([_stored([4], 3, 12),
                                         wire.stored([9], None, list(range(90, 94)), BS,
                                                     medium="CPU")]), seq=1)
    src.ingest(ws[1], wire.encode_batch([_stored([7, 8], None, 0)]), seq=5)
    data = b"".join(iter_snapshot(src, "src"))
    snap = parse_snapshot(data)
    assert snap.block_size == BS and snap.replica_id == "src"
    assert {w.name: (w.last_seq, w.num_entries) for w in snap.workers} == {
        ws[0]: (1, 5), ws[1]: (5, 2)}

    dst = kvroute.Router(ws, block_size=BS)
    assert restore_snapshot(dst, snap) == {ws[0]: "restored", ws[1]: "restored"}
    for w in ws:
        assert dst.worker_blocks(w) == src.worker_blocks(w)
        assert dst.stats()["workers"][w]["last_seq"] == src.stats()["workers"][w]["last_seq"]
    prompt = list(range(16))
    assert dst.find_matches(prompt) == src.find_matches(prompt)
    # a second restore is refused: the streams have a position (and no replay endpoint)
    assert restore_snapshot(dst, snap) == {ws[0]: "has_events", ws[1]: "has_events"}

    with pytest.raises(SnapshotError, match="magic"):
        parse_snapshot(b"x" + data[1:])
    with pytest.raises(SnapshotError, match="truncated"):
        parse_snapshot(data[:-4])
    with pytest.raises(SnapshotError, match="truncated"):
        parse_snapshot(data[:len(data) // 2])
    with pytest.raises(SnapshotError, match="block_size"):
        restore_snapshot(kvroute.Router(ws, block_size=8), snap)
    src.close()
    dst.close()


def _publish(pub, first_hash, n, parent=None):
    for i in range(n):
        h = first_hash + i
        pub.publish([_stored([h], parent, 4 * h)])
        parent = h


def _blocks_equal(a, b, worker):
    return a.worker_blocks(worker) == b.worker_blocks(worker)


def test_restore_catches_up_from_replay_and_fences_an_engine_restart():
    pub = EventPublisher(replay_endpoint="tcp://127.0.0.1:*")
    w = kvroute.Worker(url="http://e0", kv_endpoint=pub.endpoint,
                       replay_endpoint=pub.replay_endpoint)
    src = kvroute.Router([w], block_size=BS)
    assert pub.wait_subscribers(1)
    _publish(pub, 100, 5)  # seq 0..4
    wait_for(lambda: src.stats()["workers"][w.name]["last_seq"] == 4, "src at seq 4")
    snap = parse_snapshot(b"".join(iter_snapshot(src)))
    _publish(pub, 105, 3, parent=104)  # seq 5..7, after the snapshot
    wait_for(lambda: src.stats()["workers"][w.name]["last_seq"] == 7, "src at seq 7")

    # A replica starting now: the snapshot (at 4), then 5..7 from the engine's replay.
    dst = kvroute.Router([w], block_size=BS)
    assert restore_snapshot(dst, snap) == {w.name: "restored"}
    wait_for(lambda: dst.stats()["workers"][w.name]["state"] == "exact"
             and dst.stats()["workers"][w.name]["last_seq"] == 7, "dst caught up")
    assert _blocks_equal(dst, src, w.name)
    assert dst.stats()["workers"][w.name]["batches_recovered"] == 3
    ep, rep = pub.endpoint, pub.replay_endpoint
    pub.close()
    src.close()
    dst.close()

    # The engine restarts (same endpoints, sequence from 0, other blocks) after the snapshot
    # was taken: batch 4 differs, so the restored state is dropped and the new process
    # replayed from 0.
    pub2 = EventPublisher(ep, replay_endpoint=rep)
    _publish(pub2, 500, 6)  # seq 0..5
    late = kvroute.Router([w], block_size=BS)
    assert restore_snapshot(late, snap) == {w.name: "restored"}
    wait_for(lambda: late.stats()["workers"][w.name]["state"] == "exact"
             and late.stats()["workers"][w.name]["last_seq"] == 5, "late replayed pub2")
    held = {k for k in late.worker_blocks(w.name)}
    assert held == set(range(500, 506))
    assert late.stats()["workers"][w.name]["backward_jumps"] == 1
    late.close()
    pub2.close()


def test_ready_waits_for_recovering_workers():
    from kvroute.serving.replicas import readiness

    pub = EventPublisher(replay_endpoint="tcp://127.0.0.1:*", start_seq=3)
    w = kvroute.Worker(url="http://e0", kv_endpoint=pub.endpoint,
                       replay_endpoint=pub.replay_endpoint)
    r = kvroute.Router([w], block_size=BS, replay_timeout_s=5.0)
    assert readiness(r)[0]
    assert not readiness(r, "running")[0]
    assert pub.wait_subscribers(1)
    pub.pause_replay()
    pub.publish([_stored([1], None, 0)])  # seq 3: joined late, replays 0..2
    wait_for(lambda: r.stats()["workers"][w.name]["state"] == "recovering", "recovering")
    ok, body = readiness(r)
    assert not ok and body["not_ready"] == [w.name]
    pub.resume_replay()
    wait_for(lambda: readiness(r)[0], "ready")
    r.close()
    pub.close()


def test_replicas_config_section():
    from kvroute.config import ConfigError, load_config

    base = {"mode": {"type": "regular", "worker_urls": ["http://a:8000"]}}
    cfg = load_config({**base, "replicas": {"redis_url": "redis://h:6379/0",
                                            "sync_interval_s": 0.2,
                                            "bootstrap_from": ["http://peer:8080"]}})
    assert cfg.replicas.max_staleness_s == 1.0 and cfg.replicas.sync_interval_s == 0.2
    with pytest.raises(ConfigError, match="max_staleness_s"):
        load_config({**base, "replicas": {"sync_interval_s": 2.0}})
    with pytest.raises(ConfigError, match="bootstrap_from"):
        load_config({**base, "replicas": {"bootstrap_from": ["peer:8080"]}})
    with pytest.raises(ConfigError, match="unknown|redis_uri|not permitted|Extra"):
        load_config({**base, "replicas": {"redis_uri": "x"}})


def test_shared_load_arguments():
    from kvroute.serving.shared_load import SharedLoad

    r = kvroute.Router(["http://w0"], block_size=BS)
    with pytest.raises(ValueError, match="exceed"):
        SharedLoad(r, "redis://x", sync_interval_s=1.0, max_staleness_s=0.5)
    with pytest.raises(ValueError, match="url or client"):
        SharedLoad(r)
    with pytest.raises(ValueError, match=">= 0"):
        r.set_peer_load("http://w0", -1, 0, 0)
    with pytest.raises(KeyError):
        r.set_peer_load("http://nope", 1, 0, 0)
    r.close()


def test_shared_load_close_ends_a_sync_loop_that_dropped_a_cancellation():
    # On Python < 3.12 asyncio.wait_for returns the inner result and drops the cancellation
    # when both land in one loop iteration; the sync loop then goes on. aclose still ends it.
    from kvroute.serving.shared_load import SharedLoad

    class Dropping(SharedLoad):
        dropped = 0

        async def sync_once(self) -> None:
            try:
                await asyncio.sleep(60)  # aclose finds the task here
            except asyncio.CancelledError:
                if self.dropped == 0:
                    self.dropped += 1
                    return
                raise

    async def main() -> tuple:
        r = kvroute.Router(["http://w0"], block_size=BS)
        s = Dropping(r, "redis://127.0.0.1:1/0", sync_interval_s=0.01, max_staleness_s=0.5,
                     share_speculative=False)
        s.start()
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await asyncio.wait_for(s.aclose(), TIMEOUT)
        r.close()
        return s.dropped, time.monotonic() - t0

    dropped, took = asyncio.run(main())
    assert dropped == 1 and took < 2.0


def test_proxy_exposes_replicas_in_workers_and_metrics(store):
    require("fastapi")
    from kvroute.serving.proxy import Proxy

    r = kvroute.Router(["http://w0", "http://w1"], block_size=BS)
    kind, url = store.option
    proxy = Proxy(r, replicas={kind: url, "replica_id": "p0", "sync_interval_s": 0.05,
                               "max_staleness_s": 0.5})

    async def run() -> None:
        await proxy.start()
        try:
            await await_for(lambda: proxy.workers_view()["replicas"]["shared_load"]["connected"],
                            "first sync")
            view = proxy.workers_view()
            assert view["replicas"]["replica_id"] == "p0"
            assert view["replicas"]["bootstrap"]["state"] == "none"
            assert view["workers"]["http://w0"]["peer_inflight_requests"] == 0
            text = proxy.render_metrics().body.decode()
            assert "kvroute_shared_load_connected 1.0" in text
            assert "kvroute_shared_load_sync_errors_total 0.0" in text
            assert proxy.ready().status_code == 200
        finally:
            await proxy.aclose()

    asyncio.run(run())
    r.close()
