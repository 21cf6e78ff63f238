"""Gap recovery, restarts, reconnects, bad input, memory caps and removal, over real ZeroMQ.

Publishers are `kvroute.sim.publisher.EventPublisher` (vLLM's ZmqEventPublisher: PUB stream +
replay ROUTER) or `tests/_publisher_proc.py` in a subprocess. Every test keeps its own truth
of what the engine holds and compares it with `Router.worker_blocks`. Nothing sleeps for
correctness: `wait_for` polls a condition with a timeout, `stays` checks that a condition
keeps holding for a short while (for "nothing comes back" checks).

Per-worker stats used here (besides the long-standing ones): ``state`` ("exact",
"recovering", "degraded"), ``replays``, ``batches_recovered``, ``resets``,
``replay_failures``, ``evicted_by_cap``; and ``Decision.degraded``.
"""

from __future__ import annotations

import random
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import msgspec
import pytest
import zmq
from _util import await_first_batch, free_port, toks, wait_for

import kvroute.wire as ee
from kvroute import Router, Worker
from kvroute.sim.publisher import END_SEQ, EventPublisher, request_replay

BS = 16
W0, W1 = "http://w0", "http://w1"
ANY = "tcp://127.0.0.1:*"
REPLAY_TIMEOUT = 2.0  # replay servers are threads of this process: room for a loaded machine
HELPER = Path(__file__).resolve().parent / "_publisher_proc.py"


# -- helpers ----------------------------------------------------------------------------------
def stays(pred: Callable[[], bool], duration: float = 0.3, what: str = "condition") -> None:
    end = time.monotonic() + duration
    while time.monotonic() < end:
        assert pred(), f"{what} stopped holding"
        time.sleep(0.01)


def make_router(workers, **kw) -> Router:
    kw.setdefault("block_size", BS)
    kw.setdefault("speculative_ttl_s", 0)
    kw.setdefault("seed", 7)
    kw.setdefault("replay_timeout_s", REPLAY_TIMEOUT)
    return Router(workers, **kw)


def wst(router: Router, name: str) -> dict:
    return router.stats()["workers"][name]


def held(router: Router, name: str) -> set:
    return set(router.worker_blocks(name))


def join(router: Router, pub: EventPublisher, name: str) -> dict:
    """Slow-joiner guard: wait until the router's SUB has subscribed (XPUB tells), then send
    empty batches until the router has seen one; returns the worker's stats once it is not
    recovering (a baseline for counters)."""
    assert pub.wait_subscribers(1, timeout=5), f"{name} never subscribed to {pub.endpoint}"
    await_first_batch(router, name, pub.publish)
    wait_for(lambda: wst(router, name)["state"] != "recovering", what=f"{name} settled")
    return wst(router, name)


class Truth:
    """A publisher plus what its engine holds: engine hashes stored minus removed."""

    def __init__(self, pub: EventPublisher) -> None:
        self.pub = pub
        self.held: set = set()
        self.stores = 0  # block hashes in all BlockStored published (live or skipped)

    def apply(self, events: Iterable) -> list:
        events = list(events)
        for ev in events:
            if isinstance(ev, ee.Stored):
                self.held.update(ev.block_hashes)
                self.stores += len(ev.block_hashes)
            elif isinstance(ev, ee.Removed):
                self.held.difference_update(ev.block_hashes)
            else:
                self.held.clear()
        return events

    def publish(self, *events) -> int:
        return self.pub.publish(self.apply(events))

    def skip(self, *batches: list, buffered: bool = True) -> list[int]:
        """Batches lost on the wire (still in the replay buffer unless ``buffered=False``)."""
        return self.pub.skip([self.apply(b) for b in batches], buffered=buffered)


class Chain:
    """Consecutive blocks of one prompt: each `next` stores the following n blocks with the
    previous block as parent, so nothing can be indexed out of order."""

    def __init__(self, first_hash: int, token_base: int = 0) -> None:
        self.hashes: list[int] = []
        self.next_hash = first_hash
        self.base = token_base

    def next(self, n: int = 1) -> ee.Stored:
        hs = list(range(self.next_hash, self.next_hash + n))
        parent = self.hashes[-1] if self.hashes else None
        ev = ee.stored(hs, parent, toks(n * BS, self.base + len(self.hashes) * BS), BS)
        self.hashes += hs
        self.next_hash += n
        return ev

    def tokens(self) -> list[int]:
        return toks(len(self.hashes) * BS, self.base)


@pytest.fixture
def pubs():
    """Factory of EventPublishers closed at teardown."""
    made: list[EventPublisher] = []

    def make(**kw) -> EventPublisher:
        kw.setdefault("topic", b"kv-events")
        p = EventPublisher(kw.pop("endpoint", ANY), **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def routers():
    made: list[Router] = []

    def make(workers, **kw) -> Router:
        r = make_router(workers, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture
def procs():
    """Starts tests/_publisher_proc.py; kills (by pid) whatever is still running at teardown."""
    started: list[subprocess.Popen] = []

    def start(endpoint: str, blocks: int, start_hash: int, token_base: int) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, str(HELPER), "--endpoint", endpoint, "--blocks", str(blocks),
             "--start-hash", str(start_hash), "--token-base", str(token_base),
             "--block-size", str(BS)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(p)
        ready, _, _ = select.select([p.stdout], [], [], 10)
        line = p.stdout.readline().strip() if ready else ""
        if line != "ready":
            p.kill()
            raise AssertionError(f"publisher process not ready: {line!r} {p.stderr.read()!r}")
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=5)
        p.stdout.close()
        p.stderr.close()


# -- the publisher itself (independent of the router) ----------------------------------------
@pytest.mark.parametrize("layout", ["new", "old"])
def test_publisher_replay_protocol(pubs, layout):
    pub = pubs(replay_endpoint=ANY, reply_layout=layout, buffer_steps=5)
    pre = [b"kv-events"] if layout == "new" else []
    ev = ee.stored([1, 2], None, toks(2 * BS), BS)
    assert pub.publish([ev]) == 0
    assert pub.skip([[ee.removed([1])], b"raw"]) == [1, 2]
    assert pub.skip(2, buffered=False) == [3, 4]
    assert pub.publish() == 5 and pub.seq == 6 and (pub.sent, pub.skipped) == (2, 4)

    def seqs(answer):
        return [int.from_bytes(m[len(pre)], "big") for m in answer]

    answer = request_replay(pub.replay_endpoint, 1)
    assert all(len(m) == len(pre) + 2 and m[: len(pre)] == pre for m in answer)
    assert seqs(answer) == [1, 2, 5, END_SEQ] and answer[-1][-1] == b""
    assert ee.from_decoded(msgspec.msgpack.decode(answer[0][-1])[1][0]) == ee.removed([1])
    assert answer[1][-1] == b"raw"
    for _ in range(3):
        pub.publish()
    assert pub.buffered_seqs() == [2, 5, 6, 7, 8]  # buffer_steps=5: seqs 0 and 1 fell out
    assert seqs(request_replay(pub.replay_endpoint, 0)) == [2, 5, 6, 7, 8, END_SEQ]
    assert seqs(request_replay(pub.replay_endpoint, 9)) == [END_SEQ]


def test_publisher_process_helper(procs):
    ep = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        procs(ep, blocks=3, start_hash=40, token_base=1000)
        sub.connect(ep)
        got = []
        while len(got) < 5:
            assert sub.poll(5000), f"only {len(got)} messages"
            got.append(sub.recv_multipart())
        assert [int.from_bytes(m[1], "big") for m in got] == [0, 1, 2, 3, 4]
        ts, evs, rank = msgspec.msgpack.decode(got[1][2])
        assert evs[0]["block_hashes"] == [41] and evs[0]["token_ids"] == toks(BS, 1000 + BS)
        assert msgspec.msgpack.decode(got[3][2])[1] == []
    finally:
        sub.close(0)
        ctx.term()


# -- a. gaps recovered by replay ---------------------------------------------------------------
@pytest.mark.parametrize("layout", ["new", "old"])
def test_gap_is_recovered_by_replay(pubs, routers, layout):
    pub = pubs(replay_endpoint=ANY, reply_layout=layout)
    router = routers([Worker(W0, pub.endpoint, replay_endpoint=pub.replay_endpoint)])
    base = join(router, pub, W0)
    t, c = Truth(pub), Chain(1)
    t.publish(c.next(2))
    t.publish(c.next(1), ee.stored([900], None, toks(BS, 50_000), BS))
    wait_for(lambda: held(router, W0) == t.held, what="pre-gap blocks")

    k = 3
    t.skip([c.next(1)], [ee.removed([900]), c.next(2)], [c.next(1)])  # lost on the wire
    t.publish(c.next(1))  # reveals the gap; its parent is in a lost batch

    def info():
        return wst(router, W0), sorted(held(router, W0) ^ t.held)

    def settled():
        s = wst(router, W0)
        return (s["state"] == "exact" and s["batches_recovered"] - base["batches_recovered"] == k
                and held(router, W0) == t.held)

    wait_for(settled, what="recovery", info=info)
    for _ in range(5):  # live flow goes on after the recovery
        t.publish(c.next(1))
    wait_for(lambda: held(router, W0) == t.held, what="post-recovery blocks", info=info)

    s = wst(router, W0)
    assert s["state"] == "exact" and s["gaps"] >= 1 and s["replays"] >= 1
    assert s["batches_recovered"] - base["batches_recovered"] == k
    assert s["resets"] == base["resets"] and s["replay_failures"] == base["replay_failures"]
    assert s["blocks_stored"] - base["blocks_stored"] == t.stores  # nothing applied twice
    assert s["indexed_blocks"] == len(t.held) and 900 not in held(router, W0)
    assert router.find_matches(c.tokens())[W0].blocks == len(c.hashes)  # chained in order
    d = router.select_worker(c.tokens())
    assert d.worker == W0 and d.matched_blocks == len(c.hashes) and not d.degraded
    router.complete(d)


def test_gaps_during_a_live_flood_are_all_recovered(pubs, routers):
    """Many gaps, some while an earlier one is still being recovered, with live batches
    overlapping the replays: every batch applied exactly once, in order."""
    pub = pubs(replay_endpoint=ANY)
    # The replay server is a thread of this process, contending with the flood for the GIL:
    # on a loaded machine an answer can take longer than the module's short timeout.
    router = routers([Worker(W0, pub.endpoint, replay_endpoint=pub.replay_endpoint)],
                     replay_timeout_s=5.0)
    base = join(router, pub, W0)
    t, c, rng = Truth(pub), Chain(1), random.Random(3)
    side: list[int] = []
    skipped, next_side = 0, 1_000_000
    for i in range(400):
        evs = [c.next(1)]
        if rng.random() < 0.3:
            evs.append(ee.stored([next_side], None, toks(BS, 100_000 + i * BS), BS))
            side.append(next_side)
            next_side += 1
        if side and rng.random() < 0.2:
            evs.append(ee.removed([side.pop(rng.randrange(len(side)))]))
        if i % 25 == 10:
            n = rng.randint(1, 4)
            t.skip(evs, *[[c.next(1)] for _ in range(n - 1)])
            skipped += n
        else:
            t.publish(*evs)
    t.publish(c.next(1))  # the last batch is live, so even a gap at the very end shows

    def info():
        return wst(router, W0), len(held(router, W0) ^ t.held)

    wait_for(lambda: wst(router, W0)["state"] == "exact" and held(router, W0) == t.held,
             timeout=10, what="convergence", info=info)
    s = wst(router, W0)
    assert s["gaps"] >= 1 and s["replays"] >= 1 and s["resets"] == base["resets"]
    assert s["batches_recovered"] - base["batches_recovered"] >= skipped
    assert s["blocks_stored"] - base["blocks_stored"] == t.stores
    assert router.find_matches(c.tokens())[W0].blocks == len(c.hashes)


def test_router_started_after_the_engine_replays_the_buffer(pubs, routers):
    """First contact at seq > 0: what the engine published before the router existed is
    fetched from the replay buffer (joining a running fleet is not a degradation)."""
    pub = pubs(replay_endpoint=ANY)
    t, c = Truth(pub), Chain(1)
    for i in range(5):  # no subscriber yet: only the replay buffer keeps these
        t.publish(c.next(1), ee.stored([10_000 + i], None, toks(BS, 90_000 + i * BS), BS))
    router = routers([Worker(W0, pub.endpoint, replay_endpoint=pub.replay_endpoint)])
    assert pub.wait_subscribers(1, timeout=5)
    t.publish(c.next(1))  # seq 5 is the first batch the router sees
    wait_for(lambda: held(router, W0) == t.held, what="history from the replay buffer",
             info=lambda: (wst(router, W0), held(router, W0)))
    s = wst(router, W0)
    assert s["state"] == "exact" and s["resets"] == 0 and s["replays"] == 1
    assert s["batches_recovered"] == 5 and s["joined_late"] == 1
    assert s["blocks_stored"] == t.stores
    assert router.find_matches(c.tokens())[W0].blocks == len(c.hashes)


def test_router_joining_after_the_buffer_moved_on_is_not_a_gap(pubs, routers):
    """First contact when the buffer no longer starts at 0: apply what it has, then go on
    from the live message without replaying again or degrading."""
    pub = pubs(replay_endpoint=ANY, buffer_steps=3)
    t, c = Truth(pub), Chain(1)
    for i in range(8):  # only the last 3 stay in the buffer
        t.publish(ee.stored([20_000 + i], None, toks(BS, 95_000 + i * BS), BS))
    router = routers([Worker(W0, pub.endpoint, replay_endpoint=pub.replay_endpoint)])
    assert pub.wait_subscribers(1, timeout=5)
    t.publish(c.next(1))
    t.publish(c.next(1))
    wait_for(lambda: wst(router, W0)["last_seq"] == pub.seq - 1, what="the live stream",
             info=lambda: wst(router, W0))
    s = wst(router, W0)
    assert s["state"] == "exact" and s["resets"] == 0 and s["replays"] == 1 and s["gaps"] == 0
    assert 1 <= s["batches_recovered"] <= 3  # what the 3-batch buffer still held
    assert router.find_matches(c.tokens())[W0].blocks == len(c.hashes)


def test_stats_and_routing_stay_responsive_while_a_worker_recovers(pubs, routers):
    """While a replay is pending the worker reports ``recovering``: `stats` and
    `select_worker` answer at once instead of waiting for the replay."""
    pub = pubs(replay_endpoint=ANY)
    router = routers([Worker(W0, pub.endpoint, replay_endpoint=pub.replay_endpoint)],
                     replay_timeout_s=3.0)
    base = join(router, pub, W0)
    t, c = Truth(pub), Chain(1)
    t.publish(c.next(2))
    wait_for(lambda: held(router, W0) == t.held)
    asked = pub.replay_requests
    pub.pause_replay()  # the engine is slow to answer (but answers within replay_timeout)
    t.skip([c.next(1)])
    t.publish(c.next(1))
    wait_for(lambda: pub.replay_requests > asked, what="a replay request")
    t0 = time.monotonic()
    s = wst(router, W0)
    took = time.monotonic() - t0
    assert took < 0.5, f"stats() blocked {took:.2f}s while a replay was pending"
    assert s["state"] == "recovering", s
    t0 = time.monotonic()
    d = router.select_worker(c.tokens())
    took = time.monotonic() - t0
    assert took < 0.5 and d.worker == W0, f"select_worker took {took:.2f}s"
    router.complete(d)
    pub.resume_replay()
    wait_for(lambda: wst(router, W0)["state"] == "exact" and held(router, W0) == t.held,
             what="recovered", info=lambda: wst(router, W0))
    s = wst(router, W0)
    assert s["batches_recovered"] - base["batches_recovered"] == 1
    assert s["resets"] == base["resets"] and s["replay_failures"] == base["replay_failures"]
    assert s["blocks_stored"] - base["blocks_stored"] == t.stores


def test_a_pending_replay_does_not_stall_other_workers(pubs, routers):
    """One engine slow to answer its replay must not hold back the other workers' events
    (default ``ingest_threads=1``: both sockets share one ingestion thread)."""
    p0, p1 = pubs(replay_endpoint=ANY), pubs()
    router = routers([Worker(W0, p0.endpoint, replay_endpoint=p0.replay_endpoint),
                      Worker(W1, p1.endpoint)], replay_timeout_s=3.0)
    join(router, p0, W0)
    join(router, p1, W1)
    t0, t1, c0, c1 = Truth(p0), Truth(p1), Chain(1), Chain(500, token_base=500_000)
    t0.publish(c0.next(2))
    wait_for(lambda: held(router, W0) == t0.held)
    asked = p0.replay_requests
    p0.pause_replay()
    t0.skip([c0.next(1)])
    t0.publish(c0.next(1))
    wait_for(lambda: p0.replay_requests > asked, what="a replay request")
    t1.publish(c1.next(2))
    wait_for(lambda: held(router, W1) == t1.held, timeout=1.0,
             what="W1's events while W0 waits for its replay (replay_timeout_s=3)")
    p0.resume_replay()
    wait_for(lambda: wst(router, W0)["state"] == "exact" and held(router, W0) == t0.held,
             what="W0 recovered", info=lambda: wst(router, W0))


# -- b. gaps that cannot be replayed -----------------------------------------------------------
@pytest.mark.parametrize("how", ["hole", "evicted"])
def test_gap_older_than_the_buffer_resets_and_degrades(pubs, routers, how):
    """``hole``: the lost batches were never buffered; ``evicted``: they fell out of a small
    buffer. Either way the replay cannot cover the gap: drop the worker's state, rebuild."""
    pub = pubs(replay_endpoint=ANY, buffer_steps=4 if how == "evicted" else 10_000)
    router = routers([Worker(W0, pub.endpoint, replay_endpoint=pub.replay_endpoint)])
    base = join(router, pub, W0)
    t, c = Truth(pub), Chain(1)
    t.publish(c.next(3))
    t.publish(ee.stored([900], None, toks(BS, 50_000), BS))
    wait_for(lambda: held(router, W0) == t.held)

    if how == "hole":
        t.skip([c.next(1)], [ee.removed([900])], [c.next(1)], buffered=False)
    else:
        t.skip(*[[c.next(1)] for _ in range(8)])  # the buffer keeps only the last 4 of them
    after = Chain(2000, token_base=200_000)  # runs from token 0: indexable after a reset
    pub.publish([after.next(2)])  # reveals the gap
    wait_for(lambda: wst(router, W0)["resets"] > base["resets"]
             and wst(router, W0)["state"] == "degraded",
             what="reset", info=lambda: wst(router, W0))
    orphans = wst(router, W0)["orphan_stores"]
    pub.publish([after.next(1)])
    pub.publish([ee.stored([3000], c.hashes[2], toks(BS, 300_000), BS),  # parent forgotten
                 ee.removed([1])])                                      # unknown now
    pub.publish([after.next(1)])
    want = set(after.hashes)
    wait_for(lambda: held(router, W0) == want, what="rebuilt index",
             info=lambda: (wst(router, W0), held(router, W0)))
    s = wst(router, W0)
    assert s["state"] == "degraded" and s["replays"] > base["replays"]
    assert s["orphan_stores"] > orphans and s["indexed_blocks"] == len(want)
    assert router.find_matches(c.tokens())[W0].blocks == 0
    d = router.select_worker(after.tokens())
    assert d.worker == W0 and d.degraded and d.matched_blocks == len(after.hashes)
    router.complete(d)


def test_replay_timeout_resets_and_a_late_answer_is_ignored(pubs, routers):
    pub = pubs(replay_endpoint=ANY)
    router = routers([Worker(W0, pub.endpoint, replay_endpoint=pub.replay_endpoint)])
    base = join(router, pub, W0)
    t, c = Truth(pub), Chain(1)
    t.publish(c.next(2))
    wait_for(lambda: held(router, W0) == t.held)
    pub.pause_replay()  # a stuck engine: the request is held past replay_timeout
    t.skip([ee.stored([1500], None, toks(BS, 70_000), BS)])
    after = Chain(2000, token_base=200_000)
    pub.publish([after.next(1)])
    def gave_up() -> bool:
        s = wst(router, W0)
        return (s["replay_failures"] > base["replay_failures"] and s["resets"] > base["resets"]
                and s["state"] == "degraded")

    wait_for(gave_up, what="replay timeout", info=lambda: wst(router, W0))
    sent = pub.replayed_batches
    pub.resume_replay()  # the late answer carries the lost batch (block 1500)
    wait_for(lambda: pub.replayed_batches > sent, what="late answer sent")
    pub.publish([after.next(1)])
    want = set(after.hashes)
    wait_for(lambda: held(router, W0) == want, what="post-gap blocks",
             info=lambda: (wst(router, W0), held(router, W0)))
    stays(lambda: held(router, W0) == want, what="late answer ignored")
    assert wst(router, W0)["state"] == "degraded"


# -- c. no replay endpoint ---------------------------------------------------------------------
def test_gap_without_replay_endpoint_degrades_only_that_worker(pubs, routers):
    p0, p1 = pubs(), pubs()
    router = routers([Worker(W0, p0.endpoint), Worker(W1, p1.endpoint)])
    base0, base1 = join(router, p0, W0), join(router, p1, W1)
    t0, t1, c0, c1 = Truth(p0), Truth(p1), Chain(1), Chain(500, token_base=500_000)
    t0.publish(c0.next(3))
    t1.publish(c1.next(4))
    wait_for(lambda: held(router, W0) == t0.held and held(router, W1) == t1.held)

    p0.skip([[c0.next(1)], [ee.removed([1])]])
    after = Chain(2000, token_base=200_000)
    p0.publish([after.next(2)])  # reveals the gap: nothing to replay from
    wait_for(lambda: wst(router, W0)["resets"] > base0["resets"]
             and wst(router, W0)["state"] == "degraded", what="reset",
             info=lambda: wst(router, W0))
    p0.publish([after.next(1), ee.stored([3000], c0.hashes[2], toks(BS, 300_000), BS)])
    t1.publish(c1.next(1))
    want = set(after.hashes)
    wait_for(lambda: held(router, W0) == want and held(router, W1) == t1.held,
             what="rebuilt index", info=lambda: (router.stats(), held(router, W0)))
    s0, s1 = wst(router, W0), wst(router, W1)
    assert s0["replays"] == 0 and s0["gaps"] >= 1 and s0["state"] == "degraded"
    assert s1["state"] == "exact" and s1["resets"] == base1["resets"] and s1["gaps"] == 0
    d = router.select_worker(after.tokens())
    assert d.degraded == (d.worker == W0)
    router.complete(d)
    d = router.select_worker(c1.tokens())
    assert d.worker == W1 and not d.degraded and d.matched_blocks == len(c1.hashes)
    router.complete(d)


# -- d. engine process restart -----------------------------------------------------------------
def test_publisher_process_restart_resets_the_worker(procs, routers):
    ep = f"tcp://127.0.0.1:{free_port()}"
    first = procs(ep, blocks=20, start_hash=1000, token_base=0)
    router = routers([Worker(W0, ep)])
    old = set(range(1000, 1020))
    wait_for(lambda: held(router, W0) == old, what="first process's blocks",
             info=lambda: wst(router, W0))
    base = wst(router, W0)
    first.kill()
    first.wait(timeout=5)
    procs(ep, blocks=5, start_hash=5000, token_base=100_000)  # same port, fresh seq from 0
    new = set(range(5000, 5005))
    wait_for(lambda: held(router, W0) == new, timeout=10, what="second process's blocks",
             info=lambda: (wst(router, W0), held(router, W0)))
    s = wst(router, W0)
    # Seen on the connection (lost, then made again) before the new process's seq 0 arrives.
    assert s["reconnects"] == base["reconnects"] + 1 and s["resets"] > base["resets"]
    assert s["indexed_blocks"] == 5
    assert router.find_matches(toks(BS, 0))[W0].blocks == 0
    assert router.find_matches(toks(BS, 100_000 + 4 * BS))[W0].blocks == 1
    seq = s["last_seq"]
    wait_for(lambda: wst(router, W0)["last_seq"] > seq, what="heartbeats from the new process")


def test_restart_seen_on_the_connection_before_the_new_process_publishes(pubs, routers):
    """A restarted engine that stays idle shows nothing in its sequence numbers: the router's
    SUB socket sees its connection lost and made again, and drops the old process's blocks."""
    pub = pubs()
    ep = pub.endpoint
    router = routers([Worker(W0, ep)])
    base = join(router, pub, W0)
    t, c = Truth(pub), Chain(1)
    for _ in range(3):
        t.publish(c.next(1))
    wait_for(lambda: held(router, W0) == t.held, what="the first process's blocks")
    pub.close()
    pub2 = pubs(endpoint=ep)
    assert pub2.wait_subscribers(1, timeout=5), "the router never reconnected"
    wait_for(lambda: held(router, W0) == set(), what="the old process's blocks dropped",
             info=lambda: wst(router, W0))
    s = wst(router, W0)
    assert s["reconnects"] == base["reconnects"] + 1 and s["state"] == "exact"
    t2, c2 = Truth(pub2), Chain(5000, token_base=100_000)
    t2.publish(c2.next(1))
    wait_for(lambda: held(router, W0) == t2.held, what="the new process's blocks")
    assert router.find_matches(c.tokens())[W0].blocks == 0


def _restart_with_missed_batches(pubs, routers, old_batches: int, missed: int):
    """An engine publishes ``old_batches`` batches, restarts (same ports, seq from 0, empty
    cache) and sends ``missed`` batches before the router has reconnected, then one more."""
    pub = pubs(replay_endpoint=ANY)
    ep, rep = pub.endpoint, pub.replay_endpoint
    router = routers([Worker(W0, ep, replay_endpoint=rep)])
    base = join(router, pub, W0)
    old = Chain(1)
    while pub.seq < old_batches:
        pub.publish([old.next(1)])
    wait_for(lambda: wst(router, W0)["last_seq"] == pub.seq - 1)
    pub.close()
    pub2 = pubs(endpoint=ep, replay_endpoint=rep)
    t, c = Truth(pub2), Chain(5000, token_base=100_000)
    for _ in range(missed):
        t.publish(c.next(1))  # almost surely lost: the router's SUB is still reconnecting
    assert pub2.wait_subscribers(1, timeout=5), "the router never reconnected"
    t.publish(c.next(1))
    wait_for(lambda: held(router, W0) == t.held and wst(router, W0)["state"] == "exact",
             what="only the new process's blocks",
             info=lambda: (wst(router, W0), sorted(held(router, W0))))
    s = wst(router, W0)
    assert s["resets"] > base["resets"]
    assert router.find_matches(c.tokens())[W0].blocks == len(c.hashes)
    assert router.find_matches(old.tokens())[W0].blocks == 0


def test_restart_whose_first_batches_were_missed_is_recovered_by_replay(pubs, routers):
    """seq goes backwards (20 -> 4): drop the old state, replay 0..3 from the new process."""
    _restart_with_missed_batches(pubs, routers, old_batches=20, missed=4)


def test_restart_that_looks_like_a_forward_gap_is_still_a_restart(pubs, routers):
    """The old process stopped at seq 1; the new one's first batch the router sees is seq 4:
    by numbers alone a forward gap. Replaying 2..3 of the *new* process onto the old state
    would leave the old blocks indexed as exact. The router has to notice the restart (its
    SUB reconnected; or the replayed batch at the old last seq is not the one it applied)."""
    _restart_with_missed_batches(pubs, routers, old_batches=2, missed=4)


# -- e. endpoint gone and back -----------------------------------------------------------------
def test_endpoint_back_without_replay_is_treated_as_a_restart(pubs, routers):
    """Connection lost and made again, the sequence continuing: the same engine or a new
    process numbering on from the old last batch look the same on the wire. Without a replay
    endpoint to tell them apart the router drops the old blocks (claiming less, never more)
    and indexes what comes next."""
    pub = pubs()
    ep = pub.endpoint
    router = routers([Worker(W0, ep)])
    base = join(router, pub, W0)
    t, c = Truth(pub), Chain(1)
    t.publish(c.next(2))
    wait_for(lambda: held(router, W0) == t.held)
    next_seq = pub.seq
    pub.close()
    time.sleep(0.3)  # the endpoint stays away a while (not a correctness wait)
    pub2 = pubs(endpoint=ep, start_seq=next_seq)  # same port, seq continues
    assert pub2.wait_subscribers(1, timeout=5), "the router never reconnected"
    c2 = Chain(700, token_base=700_000)
    t2 = Truth(pub2)
    t2.publish(c2.next(1))
    wait_for(lambda: held(router, W0) == t2.held, what="only the events after the reconnect",
             info=lambda: wst(router, W0))
    s = wst(router, W0)
    assert s["reconnects"] == base["reconnects"] + 1 and s["resets"] == base["resets"] + 1
    assert s["state"] == "exact" and s["last_seq"] == pub2.seq - 1
    assert router.find_matches(c.tokens())[W0].blocks == 0


def test_same_engine_back_is_verified_by_replay_and_kept(pubs, routers):
    """The live connection drops and is made again while the engine (and its replay buffer)
    stays: the router asks for the batch it applied last, finds the same payload, keeps every
    block, and replays what was published while it was away."""
    pub = pubs(replay_endpoint=ANY)
    router = routers([Worker(W0, pub.endpoint, replay_endpoint=pub.replay_endpoint)])
    base = join(router, pub, W0)
    t, c = Truth(pub), Chain(1)
    t.publish(c.next(3))
    wait_for(lambda: held(router, W0) == t.held)
    pub.drop_connections()
    t.publish(c.next(1))  # sent while the router is away: lost live, in the replay buffer
    assert pub.wait_subscribers(1, timeout=5), "the router never reconnected"
    wait_for(lambda: wst(router, W0)["reconnects"] == base["reconnects"] + 1,
             what="the reconnect seen")
    t.publish(c.next(1))
    wait_for(lambda: held(router, W0) == t.held and wst(router, W0)["state"] == "exact",
             what="every block kept, the missed batch replayed",
             info=lambda: (wst(router, W0), sorted(held(router, W0))))
    s = wst(router, W0)
    assert s["resets"] == base["resets"] and s["replays"] > base["replays"]
    assert router.find_matches(c.tokens())[W0].blocks == len(c.hashes)


def test_new_process_on_the_same_ports_is_caught_by_replay_verification(pubs, routers):
    """A restarted engine that numbers on from the old last batch and has not published yet:
    its replay buffer does not hold the batch the router applied last, so it is treated as a
    restart (old blocks dropped, exact)."""
    pub = pubs(replay_endpoint=ANY)
    ep, rep = pub.endpoint, pub.replay_endpoint
    router = routers([Worker(W0, ep, replay_endpoint=rep)])
    base = join(router, pub, W0)
    t, c = Truth(pub), Chain(1)
    t.publish(c.next(3))
    wait_for(lambda: held(router, W0) == t.held)
    next_seq = pub.seq
    pub.close()
    pub2 = pubs(endpoint=ep, replay_endpoint=rep, start_seq=next_seq)
    assert pub2.wait_subscribers(1, timeout=5), "the router never reconnected"
    wait_for(lambda: held(router, W0) == set() and wst(router, W0)["state"] == "exact",
             what="the old process's blocks dropped", info=lambda: wst(router, W0))
    assert wst(router, W0)["resets"] == base["resets"] + 1
    t2, c2 = Truth(pub2), Chain(700, token_base=700_000)
    t2.publish(c2.next(2))
    wait_for(lambda: held(router, W0) == t2.held, what="the new process's blocks",
             info=lambda: wst(router, W0))


# -- f. bad input -------------------------------------------------------------------------------
def test_garbage_oversized_and_truncated_are_counted_and_isolated(pubs, routers):
    p0, p1 = pubs(), pubs()
    router = routers([Worker(W0, p0.endpoint), Worker(W1, p1.endpoint)], max_payload_bytes=4096)
    _, base1 = join(router, p0, W0), join(router, p1, W1)
    t1, c1 = Truth(p1), Chain(500, token_base=500_000)
    big = p0.encode([ee.stored(list(range(1, 301)), None, toks(300 * BS), BS)])
    assert len(big) > 4096
    rounds = 5
    for _ in range(rounds):
        p0.send_raw([b"kv-events", b"\x00" * 8, b"\xc1\xc1", b"extra"])  # 4 frames
        p0.send_raw([b"kv-events", b"\x00" * 3, b"x"])                   # seq frame not 8 bytes
        p0.send_raw([b"kv-events"])                                      # 1 frame
        p0.publish_payload(b"\x93\x01")                                  # truncated msgpack
        p0.publish_payload(b"\xc1")                                      # not msgpack
        p0.publish_payload(big)                                          # > max_payload_bytes
        t1.publish(c1.next(1))
        d = router.select_worker(toks(3 * BS))
        assert d.worker in (W0, W1)
        router.complete(d)
    p0.publish([ee.stored([7777], None, toks(BS, 900_000), BS)])  # W0 still takes good ones
    want0 = {"bad_frames": 3 * rounds, "truncated": rounds, "parse_error": rounds,
             "oversized": rounds}
    wait_for(lambda: wst(router, W0)["dropped"] == want0 and 7777 in held(router, W0)
             and held(router, W1) == t1.held, what="drops counted",
             info=lambda: router.stats())
    s1 = wst(router, W1)
    assert s1["dropped"] == {} and s1["state"] == "exact" and s1["resets"] == base1["resets"]
    assert s1["blocks_stored"] - base1["blocks_stored"] == rounds
    assert not set(range(1, 301)) & held(router, W0)
    d = router.select_worker(c1.tokens())
    assert d.worker == W1 and d.matched_blocks == rounds and not d.degraded
    router.complete(d)


# -- g. memory caps -----------------------------------------------------------------------------
def _runs(n_runs: int, run_len: int, first_hash: int, token_base: int):
    """n_runs independent runs (prompts) of run_len blocks: (hashes, tokens, payload)."""
    out = []
    for r in range(n_runs):
        hs = list(range(first_hash + r * run_len, first_hash + (r + 1) * run_len))
        tk = toks(run_len * BS, token_base + r * run_len * BS)
        out.append((hs, tk, ee.encode_batch([ee.stored(hs, None, tk, BS)])))
    return out


def test_cap_per_worker_keeps_the_newest_blocks(routers):
    router = routers([Worker(W0)], max_blocks_per_worker=100)
    runs = _runs(100, 10, 1, 0)
    for seq, (_, _, payload) in enumerate(runs):
        assert router.ingest(W0, payload, seq)
    s = wst(router, W0)
    assert s["blocks_stored"] == 1000 and s["indexed_blocks"] == 100
    assert s["evicted_by_cap"] == 900
    assert held(router, W0) == {h for hs, _, _ in runs[90:] for h in hs}
    assert router.stats()["indexed_entries"] == 100
    for r, want in ((99, 10), (90, 10), (89, 0), (0, 0)):
        assert router.find_matches(runs[r][1])[W0].blocks == want, r
    d = router.select_worker(runs[99][1])
    assert d.matched_blocks == 10
    router.complete(d)


def test_cap_total_across_workers(routers):
    router = routers([Worker(W0), Worker(W1)], max_blocks_total=150)
    runs = {W0: _runs(10, 10, 1, 0), W1: _runs(10, 10, 10_001, 1_000_000)}
    for r in range(10):  # interleaved: W0 run r, then W1 run r
        for w in (W0, W1):
            assert router.ingest(w, runs[w][r][2], r)
    st = router.stats()
    ws = [st["workers"][w] for w in (W0, W1)]
    assert sum(w["indexed_blocks"] for w in ws) == 150
    assert sum(w["evicted_by_cap"] for w in ws) == 50
    assert st["indexed_entries"] <= 150
    for w, s in zip((W0, W1), ws):
        assert s["indexed_blocks"] + s["evicted_by_cap"] == 100
        order = [h for hs, _, _ in runs[w] for h in hs]
        assert held(router, w) == set(order[s["evicted_by_cap"]:]), w  # oldest go first
        assert router.find_matches(runs[w][-1][1])[w].blocks == 10


# -- h. removal under load ----------------------------------------------------------------------
def test_remove_worker_while_events_and_replays_are_in_flight(pubs, routers):
    p0, p1 = pubs(replay_endpoint=ANY), pubs()
    router = routers([Worker(W0, p0.endpoint, replay_endpoint=p0.replay_endpoint),
                      Worker(W1, p1.endpoint)])
    join(router, p0, W0)
    join(router, p1, W1)
    t1, c1 = Truth(p1), Chain(500, token_base=500_000)
    t1.publish(c1.next(3))
    stop = threading.Event()
    errors: list[BaseException] = []

    def flood():
        n = 0
        try:
            while not stop.is_set():  # independent blocks: indexable whatever recovery does
                batch = [ee.stored([1 + n], None, toks(BS, n * BS), BS)]
                if n % 20 == 19:
                    p0.skip([batch])  # keep replays going
                else:
                    p0.publish(batch)
                n += 1
                if n % 50 == 0:
                    time.sleep(0.001)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    th = threading.Thread(target=flood)
    th.start()
    try:
        wait_for(lambda: wst(router, W0)["replays"] >= 1 and wst(router, W0)["batches"] > 50,
                 what="flood and replays", info=lambda: wst(router, W0))
        wait_for(lambda: held(router, W1) == t1.held)
        router.remove_worker(W0)
    finally:
        stop.set()
        th.join(timeout=10)
    assert not th.is_alive() and not errors, errors

    def gone() -> bool:
        st = router.stats()
        return (W0 not in st["workers"] and st["distinct_block_keys"] == len(t1.held)
                and st["indexed_entries"] == len(t1.held)
                and W0 not in router.find_matches(toks(4 * BS)))

    assert gone(), router.stats()
    with pytest.raises(KeyError):
        router.worker_blocks(W0)
    stays(gone, what="nothing of the removed worker")  # late replay answers change nothing
    d = router.select_worker(toks(4 * BS))
    assert d.worker == W1 and not d.degraded
    router.complete(d)

    p2 = pubs()  # the same name again starts from nothing
    router.add_worker(Worker(W0, p2.endpoint))
    s = wst(router, W0)
    assert (s["blocks_stored"], s["resets"], s["replays"], s["gaps"]) == (0, 0, 0, 0)
    assert held(router, W0) == set()
    join(router, p2, W0)
    p2.publish([ee.stored([42], None, toks(BS, 800_000), BS)])
    wait_for(lambda: held(router, W0) == {42})
