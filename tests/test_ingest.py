"""End to end over real ZeroMQ on loopback: pyzmq publishers play vLLM/SGLang workers."""

from __future__ import annotations

import resource
import threading
import time

import numpy as np
import pytest
import zmq
from _util import await_first_batch, free_port, toks, wait_for

import kvroute.wire as ee
from kvroute import Router, Worker

BS = 16


class Engine:
    """A stand-in for one engine's KV-event publisher: a real PUB socket sending real
    msgpack batches (vLLM framing: [topic, seq 8-byte big-endian, payload])."""

    def __init__(self, ctx: zmq.Context, *, topic: bytes = b"kv-events", era: str = "map",
                 bind: bool = True, endpoint: str | None = None) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self.endpoint = f"tcp://127.0.0.1:{free_port()}"
            self.sock.bind(self.endpoint)
        else:
            self.endpoint = endpoint
            self.sock.connect(endpoint)
        self.topic, self.era, self.seq = topic, era, 0

    def send(self, *events, frames: int = 3) -> None:
        payload = ee.encode_batch(list(events), era=self.era)
        if frames == 3:
            self.sock.send_multipart(ee.frames(self.topic, self.seq, payload))
        else:
            self.sock.send_multipart([self.topic, payload])
        self.seq += 1

    def close(self) -> None:
        self.sock.close(0)


def join(router: Router, engine: Engine, name: str) -> None:
    """Slow-joiner guard: empty batches from ``engine`` until the router has seen one."""
    await_first_batch(router, name, engine.send)


def blocks_stored(router, name):
    return router.stats()["workers"][name]["blocks_stored"]


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def fleet(ctx):
    engines = [Engine(ctx, era=era) for era in ("map", "array_full", "sglang")]
    router = Router([Worker(f"http://w{i}", e.endpoint) for i, e in enumerate(engines)],
                    block_size=BS, seed=7, speculative_ttl_s=0)
    for i, e in enumerate(engines):
        join(router, e, f"http://w{i}")
    yield router, engines
    router.close()
    for e in engines:
        e.close()


def test_select_follows_the_blocks_and_switches_on_remove_and_clear(fleet):
    router, (e0, e1, e2) = fleet
    p = toks(8 * BS)
    e1.send(ee.stored([101, 102, 103, 104, 105, 106], None, p[: 6 * BS], BS))
    e2.send(ee.stored([ee.as_hash((1 << 63) + 1, "i64"), ee.as_hash((1 << 63) + 2, "i64")],
                      None, p[: 2 * BS], BS))
    wait_for(lambda: blocks_stored(router, "http://w1") == 6
             and blocks_stored(router, "http://w2") == 2)
    d = router.select_worker(p)
    assert d.worker == "http://w1" and d.matched_tokens == 6 * BS
    router.complete(d)
    e1.send(ee.removed([101]))
    wait_for(lambda: router.stats()["workers"]["http://w1"]["blocks_removed"] == 1)
    d = router.select_worker(p)
    assert d.worker == "http://w2" and d.matched_tokens == 2 * BS
    router.complete(d)
    e2.send(ee.cleared())
    wait_for(lambda: router.stats()["workers"]["http://w2"]["clears"] == 1)
    assert all(m.blocks == 0 for m in router.find_matches(p).values())
    w = router.stats()["workers"]["http://w0"]
    assert w["gaps"] == 0 and w["last_seq"] is not None


def test_sequence_gap_and_restart_are_counted(fleet):
    router, (e0, _, _) = fleet
    e0.seq += 3
    e0.send()
    e0.seq = 0
    e0.send()
    wait_for(lambda: router.stats()["workers"]["http://w0"]["backward_jumps"] == 1)
    w = router.stats()["workers"]["http://w0"]
    assert w["gaps"] == 1 and w["missing_batches"] == 3


def test_two_frame_messages_topic_filter_and_bind(ctx):
    port = free_port()
    router = Router([Worker("http://a", f"tcp://127.0.0.1:{port}", bind=True)],
                    block_size=BS, topic="kv@")
    good = Engine(ctx, topic=b"kv@pod-a@qwen", bind=False, endpoint=f"tcp://127.0.0.1:{port}")
    other = Engine(ctx, topic=b"metrics", bind=False, endpoint=f"tcp://127.0.0.1:{port}")
    try:
        join(router, good, "http://a")
        for _ in range(20):
            other.send(ee.stored([1], None, toks(BS), BS))
        good.send(ee.stored([2], None, toks(BS, 50), BS), frames=2)
        wait_for(lambda: blocks_stored(router, "http://a") == 1)
        time.sleep(0.05)
        w = router.stats()["workers"]["http://a"]
        assert w["blocks_stored"] == 1 and w["unsequenced_batches"] == 1
        assert router.find_matches(toks(BS, 50))["http://a"].blocks == 1
    finally:
        router.close()
        good.close()
        other.close()


def test_garbage_is_counted_and_other_workers_unaffected(fleet):
    router, (e0, e1, _) = fleet
    e0.sock.send_multipart([b"kv-events", b"\x00" * 8, b"\xc1\xc1", b"extra"])  # 4 frames
    e0.sock.send_multipart([b"kv-events", b"\x00" * 3, b"x"])                 # bad seq frame
    e0.sock.send_multipart([b"kv-events", (99).to_bytes(8, "big"), b"\x93\x01"])  # truncated
    e1.send(ee.stored([7], None, toks(BS), BS))
    wait_for(lambda: sum(router.stats()["workers"]["http://w0"]["dropped"].values()) == 3)
    wait_for(lambda: blocks_stored(router, "http://w1") == 1)
    assert router.stats()["workers"]["http://w0"]["dropped"] == {"bad_frames": 2, "truncated": 1}
    assert router.stats()["workers"]["http://w1"]["dropped"] == {}


def test_remove_worker_while_events_in_flight(fleet):
    router, (e0, e1, _) = fleet
    stop = threading.Event()

    def flood():
        n = 0
        while not stop.is_set():
            e0.send(ee.stored([10_000 + n], None, toks(BS, n), BS))
            n += 1

    t = threading.Thread(target=flood)
    t.start()
    try:
        wait_for(lambda: blocks_stored(router, "http://w0") > 50)
        e1.send(ee.stored([5], None, toks(BS), BS))
        wait_for(lambda: blocks_stored(router, "http://w1") == 1)
        router.remove_worker("http://w0")
    finally:
        stop.set()
        t.join()
    time.sleep(0.05)
    st = router.stats()
    assert "http://w0" not in st["workers"]
    assert st["indexed_entries"] == 1 and st["distinct_block_keys"] == 1
    assert "http://w0" not in router.find_matches(toks(BS))


def test_add_worker_while_running(fleet, ctx):
    router, _ = fleet
    e = Engine(ctx)
    try:
        router.add_worker(Worker("http://late", e.endpoint))
        join(router, e, "http://late")
        e.send(ee.stored([1, 2], None, toks(2 * BS, 900), BS))
        wait_for(lambda: blocks_stored(router, "http://late") == 2)
        d = router.select_worker(toks(3 * BS, 900))
        assert d.worker == "http://late"
    finally:
        e.close()


def test_concurrent_select_while_events_stream(fleet):
    router, engines = fleet
    stop = threading.Event()
    errors: list[BaseException] = []
    names = {f"http://w{i}" for i in range(3)}
    picks = [0]

    def publish(i, e):
        n = 0
        while not stop.is_set():
            base = (i * 1_000_000) + n * 4
            kind = "i64" if i == 2 else "u64"
            e.send(ee.stored([ee.as_hash(base + k + 1, kind) for k in range(4)],
                             None, toks(4 * BS, n % 50), BS))
            if n % 3 == 0:
                e.send(ee.removed([ee.as_hash(base + 1, "i64" if i == 2 else "u64")]))
            n += 1

    def route():
        rng = np.random.default_rng(threading.get_ident() % 1000)
        try:
            while not stop.is_set():
                p = np.arange(int(rng.integers(0, 50)), 200, dtype=np.int64)
                d = router.select_worker(p, explain=True)
                assert d.worker in names and d.matched_tokens <= len(p)
                assert len(d.scores) == 3
                router.complete(d)
                picks[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(i, e)) for i, e in enumerate(engines)]
    threads += [threading.Thread(target=route) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive(), "deadlock"
    assert not errors, errors
    assert picks[0] > 100
    st = router.stats()
    assert sum(w["inflight_requests"] for w in st["workers"].values()) == 0
    assert all(w["blocks_stored"] > 0 for w in st["workers"].values())


def test_close_with_live_sockets_does_not_hang(ctx):
    e = Engine(ctx)
    r = Router([Worker("a", e.endpoint)], block_size=BS)
    join(r, e, "a")
    t0 = time.monotonic()
    r.close()
    r.close()
    del r
    assert time.monotonic() - t0 < 2
    e.close()


def test_more_workers_than_zeromqs_default_socket_cap(ctx):
    # ZeroMQ's default cap of 1,023 sockets per context, at three per subscription, stopped
    # a router at ~340 workers. 400 workers, all on one engine's endpoint: each receives.
    n = 400
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 6 * n  # ~4 descriptors per subscription, and the test's own
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    e = Engine(ctx)
    r = Router([Worker(f"w{i}", e.endpoint) for i in range(n)], block_size=BS)
    try:
        def all_joined() -> bool:
            e.send()
            st = r.stats()["workers"]
            return all(st[f"w{i}"]["batches"] > 0 for i in range(n))
        wait_for(all_joined, f"all {n} workers to receive a batch", interval=0.05)
        e.send(ee.stored([0x1234], None, list(range(BS)), BS))
        wait_for(lambda: all(blocks_stored(r, f"w{i}") == 1 for i in range(n)),
                 "the block on every worker")
    finally:
        r.close()
        e.close()


def _ingest_threads_nice() -> list[int]:
    """Nice values of this process's threads named kvroute-ingest (/proc/<pid>/task/<tid>/stat,
    field 19)."""
    import os

    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "kvroute-ingest":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # a thread that just ended
            continue
        out.append(int(stat.rsplit(")", 1)[1].split()[16]))
    return out


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux threads")
@pytest.mark.parametrize("nice", [0, 7])
def test_ingest_nice_lowers_only_the_ingestion_threads(ctx, nice):
    import os

    base = os.getpriority(os.PRIO_PROCESS, 0)
    engines = [Engine(ctx) for _ in range(2)]
    router = Router([Worker(f"w{i}", e.endpoint) for i, e in enumerate(engines)],
                    block_size=BS, speculative_ttl_s=0, ingest_threads=2, ingest_nice=nice)
    try:
        for i, e in enumerate(engines):
            join(router, e, f"w{i}")
        assert _ingest_threads_nice() == [min(base + nice, 19)] * 2
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's thread is untouched
        engines[1].send(ee.stored([1, 2], None, toks(2 * BS), BS))
        wait_for(lambda: blocks_stored(router, "w1") == 2, what="blocks applied at low priority")
        assert router.select_worker(toks(2 * BS)).worker == "w1"
    finally:
        router.close()
        for e in engines:
            e.close()
