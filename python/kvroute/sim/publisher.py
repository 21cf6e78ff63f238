"""A stand-in for one engine's KV-event publisher (vLLM ``ZmqEventPublisher``), in pure pyzmq.

What it puts on the wire (cf. docs/kv-events.md §2):

* a PUB socket bound on ``endpoint``; every batch is one 3-frame message
  ``[topic, seq (8 bytes, unsigned, big-endian), payload]``, ``seq`` starting at 0 (or
  ``start_seq``) and increasing by one per batch;
* optionally a ROUTER socket bound on ``replay_endpoint``, served by a background thread.
  A client (a DEALER) sends ``["", start_seq (8 bytes BE)]``, which the ROUTER receives as
  ``[identity, "", start_seq]``. The reply is one message per buffered batch with
  ``seq >= start_seq``, oldest first, then an end marker whose seq is ``0xFFFF_FFFF_FFFF_FFFF``
  and whose payload is empty. Two layouts (``reply_layout``):

  ``"new"``  vLLM after PR #45177: ``[identity, "", topic, seq8, payload]``
  ``"old"``  older vLLM and SGLang:  ``[identity, "", seq8, payload]``

  The buffer keeps the last ``buffer_steps`` batches (vLLM default 10000). As in vLLM, a
  request for a sequence that is no longer buffered gets whatever is buffered from there on
  (the first reply then has a larger seq than requested) and the end marker.

Test hooks, for simulating what goes wrong in production:

* :meth:`EventPublisher.skip` takes sequence numbers without sending, i.e. batches *lost on
  the wire* (PUB high-water-mark drops). By default they stay in the replay buffer, so a
  subscriber can get them back; ``buffered=False`` also leaves them out of the buffer (a gap
  that cannot be replayed, as if it were older than the buffer).
* :meth:`EventPublisher.send_raw` sends arbitrary frames (garbage, truncated messages).
* :meth:`EventPublisher.pause_replay` / :meth:`EventPublisher.resume_replay` hold replay
  answers back (a slow or stuck engine); requests queue up meanwhile.
* :meth:`EventPublisher.wait_subscribers` waits until a subscriber has joined. The live
  socket is an XPUB, which sends exactly what a PUB sends but also reports subscriptions, so a
  test can avoid ZeroMQ's "slow joiner" losses without sleeping.

Every method may be called from any thread: a lock serialises the live socket and the buffer;
the replay socket lives on its own thread. Run this file for a self-test.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Iterable, Literal, Optional, Sequence, Union

import zmq

from kvroute import wire

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
"""Sequence number of the end-of-replay marker (vLLM: ``(-1).to_bytes(8, "big", signed=True)``)."""

ReplyLayout = Literal["new", "old"]
Batch = Union[bytes, Sequence["wire.Event"]]


def _seq8(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=False)


class EventPublisher:
    """One engine's KV-event publisher: live PUB stream plus optional replay ROUTER.

    Parameters
    ----------
    endpoint:
        Where the live socket binds. ``"tcp://127.0.0.1:*"`` (default) picks a free port;
        :attr:`endpoint` then holds the resolved address for subscribers to connect to.
    replay_endpoint:
        Where the replay ROUTER binds (``"tcp://127.0.0.1:*"`` picks a port), or ``None``
        (default, as vLLM's ``replay_endpoint=None``): no replay.
    topic:
        Topic frame of every message (vLLM default ``b""``); a ``str`` is UTF-8 encoded.
    start_seq:
        Sequence number of the first batch (0 for a freshly started engine).
    buffer_steps:
        Batches kept for replay (vLLM ``buffer_steps``, default 10000).
    reply_layout:
        ``"new"`` (topic frame in replies, vLLM after #45177) or ``"old"`` (no topic frame).
    era:
        Default :func:`kvroute.wire.encode_batch` era of :meth:`publish` (``"map"``: vLLM
        after #42892).
    dp_rank:
        Data-parallel rank written into each batch by :meth:`publish`.
    hwm:
        Send high-water mark of the live socket (vLLM default 100000).
    context:
        A ``zmq.Context`` to use; by default the publisher creates and terminates its own.
    bind_timeout:
        Seconds to keep retrying a bind that fails with "address in use" (rebinding a port
        that a closed publisher has just released).

    Raises
    ------
    ValueError
        Bad ``reply_layout``, ``buffer_steps`` or ``start_seq``.
    zmq.ZMQError
        An endpoint cannot be bound.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        *,
        replay_endpoint: Optional[str] = None,
        topic: Union[bytes, str] = b"",
        start_seq: int = 0,
        buffer_steps: int = 10_000,
        reply_layout: ReplyLayout = "new",
        era: wire.Era = "map",
        dp_rank: Optional[int] = 0,
        hwm: int = 100_000,
        context: Optional[zmq.Context] = None,
        bind_timeout: float = 5.0,
    ) -> None:
        if reply_layout not in ("new", "old"):
            raise ValueError(f"reply_layout must be 'new' or 'old', got {reply_layout!r}")
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps!r}")
        if not 0 <= start_seq < END_SEQ:
            raise ValueError(f"start_seq must be in [0, 2**64 - 1), got {start_seq!r}")
        self.topic: bytes = topic.encode() if isinstance(topic, str) else bytes(topic)
        self.reply_layout: ReplyLayout = reply_layout
        self.era = era
        self.dp_rank = dp_rank
        self.buffer_steps = buffer_steps
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._lock = threading.RLock()
        self._seq = start_seq
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._closed = False
        self._subscriptions = 0
        self._sent = 0
        self._skipped = 0
        # Replay counters, written by the replay thread.
        self.replay_requests = 0
        """Well-formed replay requests received (counted on receipt, even while paused)."""
        self.bad_replay_requests = 0
        """Replay requests that were not ``[identity, "", 8 bytes]`` (ignored, as vLLM does)."""
        self.replayed_batches = 0
        """Batch messages sent in replay answers (end markers not included)."""
        self._replay_gate = threading.Event()
        self._replay_gate.set()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

        self._pub = self._ctx.socket(zmq.XPUB)
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscription
            self.endpoint: str = self._bind(self._pub, endpoint, bind_timeout)
            self.replay_endpoint: Optional[str] = None
            self._router: Optional[zmq.Socket] = None
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._bind(self._router, replay_endpoint, bind_timeout)
                self._thread = threading.Thread(
                    target=self._serve_replay, name=f"replay {self.replay_endpoint}", daemon=True
                )
                self._thread.start()
        except BaseException:
            self.close()
            raise

    # -- setup -------------------------------------------------------------------------------
    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            try:
                sock.bind(endpoint)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= end:
                    raise
                time.sleep(0.02)
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else str(last)

    # -- state -------------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        """Sequence number the next batch will get."""
        with self._lock:
            return self._seq

    @property
    def sent(self) -> int:
        """Batches actually sent on the live socket (not counting :meth:`send_raw`)."""
        with self._lock:
            return self._sent

    @property
    def skipped(self) -> int:
        """Batches taken by :meth:`skip` (lost on the wire)."""
        with self._lock:
            return self._skipped

    def buffered_seqs(self) -> list[int]:
        """Sequence numbers currently held for replay, oldest first."""
        with self._lock:
            return [s for s, _ in self._buffer]

    # -- publishing --------------------------------------------------------------------------
    def encode(self, events: Iterable[wire.Event], *, era: Optional[wire.Era] = None,
               ts: Optional[float] = None) -> bytes:
        """The payload :meth:`publish` would send for ``events`` (kvroute.wire encoding)."""
        return wire.encode_batch(list(events), era=era or self.era, ts=ts, dp_rank=self.dp_rank)

    def publish(self, events: Iterable[wire.Event] = (), *, era: Optional[wire.Era] = None,
                ts: Optional[float] = None) -> int:
        """Encodes ``events`` (``wire.stored`` / ``removed`` / ``cleared``) as one batch,
        buffers it for replay and sends it. Returns its sequence number. An empty list is an
        empty batch (a heartbeat, or a way to make a gap visible)."""
        return self.publish_payload(self.encode(events, era=era, ts=ts))

    def publish_payload(self, payload: bytes) -> int:
        """Sends one already-encoded payload as the next batch (buffered for replay).
        Returns its sequence number."""
        return self._emit(bytes(payload), send=True, buffered=True)

    def skip(self, batches: Union[int, Sequence[Batch]] = 1, *, buffered: bool = True,
             era: Optional[wire.Era] = None) -> list[int]:
        """Takes sequence numbers without sending anything: batches lost on the wire.

        ``batches`` is a count (that many empty batches) or a list whose items are each an
        event list or an encoded payload. With ``buffered=True`` (default) the batches stay in
        the replay buffer, so a replay can recover them; with ``buffered=False`` they are
        gone for good (a gap older than the buffer). Returns the skipped sequence numbers.
        The subscriber only notices the gap when the next batch arrives.
        """
        items: Sequence[Batch] = [[]] * batches if isinstance(batches, int) else batches
        out = []
        with self._lock:
            for item in items:
                if isinstance(item, (bytes, bytearray)):
                    payload = bytes(item)
                else:
                    payload = self.encode(item, era=era)
                out.append(self._emit(payload, send=False, buffered=buffered))
        return out

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Sends arbitrary frames on the live socket (garbage, truncated or wrongly framed
        messages). Touches neither the sequence number nor the replay buffer."""
        with self._lock:
            self._check_open()
            self._pub.send_multipart([bytes(f) for f in frames])

    def _emit(self, payload: bytes, *, send: bool, buffered: bool) -> int:
        with self._lock:
            self._check_open()
            seq = self._seq
            if buffered:
                self._buffer.append((seq, payload))
            if send:
                self._pub.send_multipart(wire.frames(self.topic, seq, payload))
                self._sent += 1
            else:
                self._skipped += 1
            self._seq = seq + 1
            return seq

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("publisher is closed")

    # -- subscribers -------------------------------------------------------------------------
    @property
    def subscriptions(self) -> int:
        """Subscribe messages received so far (one per subscriber and topic prefix; a
        subscriber that reconnects subscribes again)."""
        with self._lock:
            self._drain_subscriptions()
            return self._subscriptions

    def wait_subscribers(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Waits until :attr:`subscriptions` reaches ``count``; False on timeout. Messages
        published after this returns True reach those subscribers (no slow-joiner loss)."""
        end = time.monotonic() + timeout
        while True:
            if self.subscriptions >= count:
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            with self._lock:
                self._pub.poll(int(min(left, 0.02) * 1000), zmq.POLLIN)

    def _drain_subscriptions(self) -> None:
        while not self._closed:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                self._subscriptions += 1

    # -- replay ------------------------------------------------------------------------------
    def pause_replay(self) -> None:
        """Stops answering replay requests (they queue up) until :meth:`resume_replay`. An
        answer already being sent is finished."""
        self._replay_gate.clear()

    def resume_replay(self) -> None:
        """Answers queued and future replay requests again."""
        self._replay_gate.set()

    def _reply_frames(self, ident: bytes, seq: int, payload: bytes) -> list[bytes]:
        if self.reply_layout == "new":
            return [ident, b"", self.topic, _seq8(seq), payload]
        return [ident, b"", _seq8(seq), payload]

    def _serve_replay(self) -> None:
        sock = self._router
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(50):
                    continue
                try:
                    request = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                if len(request) != 3 or request[1] != b"" or len(request[2]) != 8:
                    self.bad_replay_requests += 1
                    continue
                ident, start = request[0], int.from_bytes(request[2], "big")
                self.replay_requests += 1
                while not self._replay_gate.wait(0.05):  # paused: hold the request
                    if self._stop.is_set():
                        return
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for s, p in batches:
                    sock.send_multipart(self._reply_frames(ident, s, p))
                    self.replayed_batches += 1
                sock.send_multipart(self._reply_frames(ident, END_SEQ, b""))
        except zmq.ZMQError:
            if not self._stop.is_set():
                raise
        finally:
            sock.close(0)

    def drop_connections(self) -> None:
        """Closes the live PUB socket and binds a new one on the same endpoint: every
        subscriber's connection drops and is made again, as after a network drop, while the
        engine (its sequence numbers and replay buffer) stays the same. Needs a concrete
        endpoint (not a wildcard port), which :attr:`endpoint` always is."""
        with self._lock:
            self._check_open()
            hwm = self._pub.getsockopt(zmq.SNDHWM)
            self._pub.close(0)
            pub = self._ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, hwm)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self._bind(pub, self.endpoint, 5.0)
            self._pub = pub
            self._subscriptions = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the replay thread and closes both sockets (the ports are free again when it
        returns, if the publisher owns its context). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._replay_gate.set()
        router: Optional[zmq.Socket] = getattr(self, "_router", None)
        if self._thread is not None:
            self._thread.join()
        elif router is not None:
            router.close(0)
        if getattr(self, "_pub", None) is not None:
            self._pub.close(0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"EventPublisher(endpoint={self.endpoint!r}, replay_endpoint="
                f"{self.replay_endpoint!r}, seq={self._seq}, layout={self.reply_layout!r})")


def request_replay(endpoint: str, start_seq: int, *, timeout: float = 5.0,
                   context: Optional[zmq.Context] = None) -> list[list[bytes]]:
    """Client side, for tests: asks a replay ROUTER for everything from ``start_seq`` with a
    DEALER socket and returns the answer messages (frames after the empty delimiter), end
    marker included. Raises TimeoutError if the end marker does not arrive in time."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", _seq8(start_seq)])
        out: list[list[bytes]] = []
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0 or not sock.poll(left * 1000, zmq.POLLIN):
                raise TimeoutError(f"no end of replay from {endpoint} after {len(out)} messages")
            msg = sock.recv_multipart()
            if not msg or msg[0] != b"":
                raise ValueError(f"replay answer without empty delimiter: {msg!r}")
            out.append(msg[1:])
            if len(msg) >= 3 and msg[-2] == _seq8(END_SEQ):
                return out
    finally:
        sock.close(0)


def _selftest() -> None:
    import msgspec

    ev = wire.stored([1, 2], None, list(range(32)), 16)
    for layout in ("new", "old"):
        with EventPublisher(replay_endpoint="tcp://127.0.0.1:*", topic=b"kv-events",
                            reply_layout=layout, buffer_steps=4) as pub:
            replay_ep = pub.replay_endpoint
            assert replay_ep is not None
            sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(pub.endpoint)
            assert pub.wait_subscribers(1, timeout=5), "no subscriber"
            assert pub.publish([ev]) == 0
            assert pub.skip([[wire.removed([1])], b"raw"]) == [1, 2]
            assert pub.skip(1, buffered=False) == [3]
            assert pub.publish() == 4
            got = [sub.recv_multipart() for _ in range(2)]
            assert [int.from_bytes(m[1], "big") for m in got] == [0, 4]
            assert got[0][0] == b"kv-events"
            assert msgspec.msgpack.decode(got[0][2])[1][0]["block_hashes"] == [1, 2]
            assert pub.buffered_seqs() == [0, 1, 2, 4]
            answer = request_replay(replay_ep, 1)
            pre = [b"kv-events"] if layout == "new" else []
            assert [len(m) for m in answer] == [len(pre) + 2] * 4
            assert all(m[: len(pre)] == pre for m in answer)
            seqs = [int.from_bytes(m[len(pre)], "big") for m in answer]
            assert seqs == [1, 2, 4, END_SEQ], seqs
            assert answer[1][-1] == b"raw" and answer[-1][-1] == b""
            got_ev = msgspec.msgpack.decode(answer[0][-1])[1][0]
            assert wire.from_decoded(got_ev) == wire.removed([1])
            pub.publish()  # seq 5 evicts seq 0 (buffer_steps=4)
            assert pub.buffered_seqs() == [1, 2, 4, 5]
            answer = request_replay(replay_ep, 0)  # older than the buffer
            assert [int.from_bytes(m[len(pre)], "big") for m in answer][:1] == [1]
            pub.pause_replay()
            try:
                request_replay(replay_ep, 0, timeout=0.3)
                raise AssertionError("answered while paused")
            except TimeoutError:
                pass
            pub.resume_replay()
            assert int.from_bytes(request_replay(replay_ep, END_SEQ - 1)[0][len(pre)],
                                  "big") == END_SEQ
            sub.close(0)
            assert pub.replay_requests == 4 and pub.bad_replay_requests == 0
    # The port is free again after close(): rebind it.
    with EventPublisher() as a:
        ep = a.endpoint
    with EventPublisher(ep, start_seq=7) as b:
        assert b.endpoint == ep and b.seq == 7
    print("kvroute.sim.publisher self-test OK")


if __name__ == "__main__":
    _selftest()
