"""A fleet of simulated engines, each publishing real vLLM-format KV events on its own
ZeroMQ PUB socket on 127.0.0.1 (three frames: topic, 8-byte big-endian sequence, msgpack)."""

from __future__ import annotations

import hashlib
from typing import Callable, Optional

import zmq

from kvroute import wire
from kvroute.sim.engine import ServiceModel, SimEngine


class SimFleet:
    """N `SimEngine` s with their publishers.

    Parameters
    ----------
    n:
        Number of workers.
    capacity_blocks, block_size, model:
        Per-engine KV cache size (blocks), tokens per block, service model.
    era:
        Event encoding (`kvroute.wire` era): "map" (vLLM after #42892, default) or
        "array_full" (the last array-like era).
    seed:
        Seeds the engines' block-hash salts.
    event_delay_s:
        Virtual delay between a step's end and its events reaching the wire (live mode);
        0 = deterministic (events published at the step's end).
    """

    def __init__(self, n: int, *, capacity_blocks: int, block_size: int = 16,
                 model: ServiceModel = ServiceModel(), era: wire.Era = "map", seed: int = 0,
                 event_delay_s: float = 0.0, topic: bytes = b"kv-events") -> None:
        if n < 1:
            raise ValueError(f"a fleet needs at least one worker, got {n}")
        self.ctx = zmq.Context()
        self.era, self.topic, self.delay = era, topic, event_delay_s
        self.engines: list[SimEngine] = []
        self.socks: list[zmq.Socket] = []
        self.endpoints: list[str] = []
        self.seq = [0] * n
        self.pending: list[list[tuple[float, list]]] = [[] for _ in range(n)]
        self.events_sent = 0
        for i in range(n):
            s = self.ctx.socket(zmq.PUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default hwm
            port = s.bind_to_random_port("tcp://127.0.0.1")
            self.socks.append(s)
            self.endpoints.append(f"tcp://127.0.0.1:{port}")
            salt = hashlib.sha256(f"kvroute-sim/{seed}/{i}".encode()).digest()[:16]
            eng = SimEngine(f"sim-{i}", capacity_blocks, block_size, model,
                            publish=self._publisher(i), salt=salt)
            self.engines.append(eng)

    def _publisher(self, i: int) -> Callable[[list], None]:
        def publish(events: list) -> None:
            eng = self.engines[i]
            self.pending[i].append((eng.now + self.delay, events))
            if self.delay <= 0:
                self.deliver(i, eng.now)
        return publish

    def send(self, i: int, events: list) -> None:
        payload = wire.encode_batch(events, era=self.era, ts=self.engines[i].now, dp_rank=0)
        self.socks[i].send_multipart(wire.frames(self.topic, self.seq[i], payload))
        self.seq[i] += 1
        self.events_sent += len(events)

    def deliver(self, i: int, now: float) -> None:
        """Sends engine i's batches whose delivery time has come."""
        q = self.pending[i]
        k = 0
        while k < len(q) and q[k][0] <= now:
            self.send(i, q[k][1])
            k += 1
        if k:
            del q[:k]

    def deliver_all(self, now: float) -> None:
        for i in range(len(self.engines)):
            self.deliver(i, now)

    def next_event_time(self) -> Optional[tuple[float, int]]:
        """(time, engine index) of the earliest step end, or None when all are idle."""
        best = None
        for i, e in enumerate(self.engines):
            t = e.next_step_end
            if t is not None and (best is None or t < best[0]):
                best = (t, i)
        return best

    def advance_to(self, t: float) -> None:
        """Runs every engine step that ends at or before virtual time ``t``, in time order."""
        while True:
            nxt = self.next_event_time()
            if nxt is None or nxt[0] > t:
                return
            self.engines[nxt[1]].finish_step()

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()
