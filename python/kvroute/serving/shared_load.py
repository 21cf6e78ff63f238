"""In-flight load and speculative credits shared between router replicas through Redis, NATS
or a directory of the host.

Several ``kvroute serve`` replicas behind one L4 balancer each see only the requests they
routed; alone, each would send a burst to the same idle engine (every replica sees ~1/N of
the load). `SharedLoad` makes every replica's decisions count the others' requests in flight:

* a background asyncio task, every ``sync_interval_s``, reads this router's own per-worker
  counts (`Router.local_load`: requests in flight, pending prefill tokens, active blocks),
  writes them to Redis under its replica's key with a TTL of
  ``max_staleness_s``, and reads the other replicas' keys;
* the sum of the others' counts per worker goes into the native router
  (``Router.set_peer_load``), which adds it to its own counts in every decision's load terms.
  The request path reads only that local copy: no network round trip per request;
* with ``share_speculative`` each decision's speculative credit (the prompt's block keys
  past the chosen worker's match, `kvroute.block_keys`) is published on a Redis channel once
  per interval, and the other replicas credit the same worker with those blocks for the
  remaining ``speculative_ttl_s`` (so a burst of one new prefix lands on one worker whichever
  replica each request reached).

Redis layout (``redis://`` URLs; ``<p>`` = ``key_prefix``; every value is JSON, UTF-8)::

    <p>:replicas            set of replica ids that published
    <p>:load:<replica id>   {"v": 1, "replica": id, "seq": n, "time": unix s,
                             "interval_s": s, "workers": {name: [inflight, prefill, blocks]}}
                            (workers with all three 0 left out), PX = max_staleness_s
    <p>:credits             pub/sub channel: {"v": 1, "replica": id, "ttl_s": s,
                             "credits": [[worker, "<hex of little-endian uint64 keys>"], ...]}

A directory (``file:///dir``: replicas on one host, as `kvroute serve --workers N`'s): each
replica writes the same load document to ``<dir>/load.<replica id>.json`` (renamed into
place) and reads the others' files modified within ``max_staleness_s``; credits go over
ZeroMQ PUB/SUB on ``ipc://<dir>/credits.<digest of the replica id>``.

NATS (``nats://`` URLs, core publish / subscribe, no JetStream): each sync publishes the same
load document on subject ``<p>.load.<replica id>`` (``.``, ``*``, ``>`` and whitespace in
the id as ``_``) and flushes (one round trip to the server); a subscription to ``<p>.load.*``
keeps each peer's latest document with the time it arrived, and a document older than
``max_staleness_s`` is dropped (the TTL of the Redis key). Credits go on subject
``<p>.credits``.

Staleness, bounded: a peer's counts are used only while its document is younger than
``max_staleness_s`` (Redis: its key lives; NATS: it arrived within that time), and only while
this replica's last successful sync is at most ``max_staleness_s`` old. Past that (the store
down or unreachable) the peers' counts are cleared,
decisions run on this replica's own load (standalone), the store is retried every interval, and
the next successful sync brings the peers' counts back. `status` shows the view's age, each
peer's age (publish to now, by the hosts' clocks) and the error counts; `register_metrics`
exports them.

Thread-safety: one asyncio event loop owns a `SharedLoad`; `on_decision` must be called from
that loop. The native calls it makes are thread-safe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

__all__ = ["SharedLoad", "FORMAT_VERSION"]

log = logging.getLogger(__name__)

#: Version of the JSON documents in Redis (``"v"``); documents of another version are ignored.
FORMAT_VERSION = 1
_MAX_PENDING_CREDITS = 4096  # decisions kept for the next credit message; older ones dropped


def default_replica_id() -> str:
    """``<hostname>:<pid>``: unique per process on a host."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class _Peer:
    workers: Dict[str, Tuple[int, int, int]]
    seq: int
    published: float  # the peer's clock (unix s)
    seen_mono: float  # our monotonic clock when this seq was first read


@dataclass
class _Stats:
    syncs: int = 0
    errors: int = 0
    last_error: Optional[str] = None
    last_ok_mono: Optional[float] = None
    fallbacks: int = 0          # times the peers' counts were cleared (Redis unreachable)
    credits_sent: int = 0
    credits_received: int = 0
    credit_errors: int = 0
    sync_seconds: List[float] = field(default_factory=list)


def _subject_token(replica_id: str) -> str:
    return re.sub(r"[.*>\s]", "_", replica_id)


class _RedisBackend:
    """The shared store on Redis (layout in the module docstring)."""

    def __init__(self, owner: SharedLoad, url: Optional[str], client: Any) -> None:
        self.o = owner
        self.url = url
        self.own_client = client is None
        self.client = client

    async def open(self) -> None:
        if self.client is None:
            import redis.asyncio as aioredis

            assert self.url is not None
            self.client = aioredis.Redis.from_url(
                self.url, socket_timeout=self.o.timeout_s,
                socket_connect_timeout=self.o.timeout_s, health_check_interval=0)

    async def close(self) -> None:
        if self.client is None:
            return
        try:
            await asyncio.wait_for(self.client.delete(self.o.load_key(self.o.replica_id)),
                                   self.o.timeout_s)
        except Exception:  # Redis down: the key expires by itself
            pass
        if self.own_client:
            try:
                await self.client.aclose()
            except Exception:
                pass
            self.client = None

    async def exchange(self, doc: str) -> Dict[str, Any]:
        o = self.o
        ttl_ms = max(1, int(o.max_staleness_s * 1000))
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(o.load_key(o.replica_id), doc, px=ttl_ms)
            pipe.sadd(o.members_key, o.replica_id)
            pipe.smembers(o.members_key)
            _, _, members = await asyncio.wait_for(pipe.execute(), o.timeout_s)
        others = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
        others = [m for m in others if m != o.replica_id]
        values = (await asyncio.wait_for(self.client.mget([o.load_key(m) for m in others]),
                                         o.timeout_s)) if others else []
        gone = [rid for rid, raw in zip(others, values) if raw is None]
        if gone:  # its key expired: stopped, or cut off from Redis
            try:
                await asyncio.wait_for(self.client.srem(o.members_key, *gone), o.timeout_s)
            except Exception:
                pass  # removed by the next sync
        return {rid: raw for rid, raw in zip(others, values) if raw is not None}

    async def publish_credits(self, msg: str) -> None:
        await asyncio.wait_for(self.client.publish(self.o.credits_channel, msg),
                               self.o.timeout_s)

    async def listen_credits(self, on_message: Any) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            await asyncio.wait_for(pubsub.subscribe(self.o.credits_channel), self.o.timeout_s)
            while True:
                m = await pubsub.get_message(timeout=1.0)
                if m is not None and m.get("type") == "message":
                    on_message(m["data"])
        finally:
            try:
                await pubsub.aclose()
            except Exception:
                pass


class _NatsBackend:
    """The shared store on NATS core publish / subscribe (subjects in the module docstring)."""

    def __init__(self, owner: SharedLoad, url: str) -> None:
        self.o = owner
        self.url = url
        self.nc: Any = None
        self.latest: Dict[str, Tuple[bytes, float]] = {}  # peer -> (document, arrival mono)
        self.credit_handler: Any = None
        self._connecting: Optional[asyncio.Lock] = None

    @property
    def load_subject(self) -> str:
        return f"{self.o.key_prefix}.load"

    async def open(self) -> None:
        pass  # connected by the first exchange (a server down at start is retried)

    async def _connected(self) -> Any:
        if self.nc is not None:
            return self.nc
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self.nc is None:
                import nats

                async def quiet(e: Exception) -> None:  # counted by the sync task
                    pass
                nc = await nats.connect(
                    self.url, connect_timeout=self.o.timeout_s, allow_reconnect=True,
                    max_reconnect_attempts=-1, reconnect_time_wait=self.o.sync_interval_s,
                    error_cb=quiet, name=f"kvroute {self.o.replica_id}")
                own = _subject_token(self.o.replica_id)

                async def on_load(msg: Any) -> None:
                    if msg.subject.rsplit(".", 1)[-1] != own:
                        self.latest[msg.subject] = (msg.data, time.monotonic())
                await nc.subscribe(f"{self.load_subject}.*", cb=on_load)

                async def on_credit(msg: Any) -> None:
                    if self.credit_handler is not None:
                        self.credit_handler(msg.data)
                await nc.subscribe(self.o.credits_channel.replace(":", "."), cb=on_credit)
                self.nc = nc
        return self.nc

    async def close(self) -> None:
        nc, self.nc = self.nc, None
        if nc is not None:
            try:
                await asyncio.wait_for(nc.close(), self.o.timeout_s)
            except Exception:
                pass

    async def exchange(self, doc: str) -> Dict[str, Any]:
        o = self.o
        nc = await self._connected()
        if not nc.is_connected:
            raise ConnectionError(f"not connected to {self.url} (reconnecting)")
        await nc.publish(f"{self.load_subject}.{_subject_token(o.replica_id)}", doc.encode())
        await nc.flush(timeout=o.timeout_s)  # the server has it: one round trip
        now = time.monotonic()
        for subj in [k for k, (_, t) in self.latest.items() if now - t > o.max_staleness_s]:
            del self.latest[subj]
        return {subj.rsplit(".", 1)[-1]: data for subj, (data, _) in self.latest.items()}

    async def publish_credits(self, msg: str) -> None:
        nc = await self._connected()
        await nc.publish(self.o.credits_channel.replace(":", "."), msg.encode())

    async def listen_credits(self, on_message: Any) -> None:
        self.credit_handler = on_message  # the subscription's callback calls it
        await self._connected()
        while True:
            await asyncio.sleep(3600)


class _LocalBackend:
    """The shared store in a directory of this host (``file:///dir``; `kvroute serve
    --workers N` gives its replicas one under ``/dev/shm``): each replica's load document in
    ``load.<id>.json``, written to a temporary file and renamed over it (a reader sees a whole
    document), read by the others while its modification time is within
    ``max_staleness_s``; credits over ZeroMQ PUB/SUB on ``ipc://<dir>/credits.<digest of
    id>``, each replica subscribed to every peer whose load document it has read."""

    def __init__(self, owner: SharedLoad, url: str) -> None:
        from pathlib import Path

        self.o = owner
        self.dir = Path(url[len("file://"):])
        if not self.dir.is_absolute():
            raise ValueError(f"a file:// shared store needs an absolute directory, got {url!r}")
        self.token = re.sub(r"[^A-Za-z0-9_.-]", "_", owner.replica_id)
        self.path = self.dir / f"load.{self.token}.json"
        self.opened = False
        self.ctx: Any = None
        self.pub: Any = None
        self.sub: Any = None
        self.subscribed: set = set()

    def _endpoint(self, token: str) -> str:
        import hashlib

        digest = hashlib.blake2b(token.encode(), digest_size=6).hexdigest()
        return f"ipc://{self.dir}/credits.{digest}"  # short: a socket path has <= 107 bytes

    async def open(self) -> None:
        if self.opened:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.opened = True
        if self.o.share_speculative:
            import zmq
            import zmq.asyncio

            self.ctx = zmq.asyncio.Context()
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind(self._endpoint(self.token))
            self.sub = self.ctx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.LINGER, 0)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")

    async def close(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.pub is not None:
            self.pub.close()
            self.sub.close()
            self.ctx.term()
        self.ctx = self.pub = self.sub = None
        self.opened = False
        self.subscribed.clear()

    async def exchange(self, doc: str) -> Dict[str, Any]:
        tmp = self.dir / f".load.{self.token}.tmp"
        tmp.write_text(doc)
        os.replace(tmp, self.path)
        now = time.time()
        out: Dict[str, Any] = {}
        for p in self.dir.glob("load.*.json"):
            if p == self.path:
                continue
            try:
                if now - p.stat().st_mtime > self.o.max_staleness_s:
                    continue  # stopped, or killed before it could remove its file
                data = p.read_bytes()
            except FileNotFoundError:
                continue
            token = p.name[len("load."):-len(".json")]
            out[token] = data
            if self.sub is not None and token not in self.subscribed:
                self.sub.connect(self._endpoint(token))
                self.subscribed.add(token)
        return out

    async def publish_credits(self, msg: str) -> None:
        import zmq

        try:
            await self.pub.send(msg.encode(), flags=zmq.NOBLOCK)
        except zmq.Again:  # no room: credits are best effort
            pass

    async def listen_credits(self, on_message: Any) -> None:
        await self.open()
        while True:
            on_message(await self.sub.recv())


class SharedLoad:
    """Shares this router's in-flight load with its peer replicas through Redis or NATS (see
    the module docstring for the layouts and the staleness bound).

    Parameters
    ----------
    router:
        The `kvroute.Router` whose load is published and whose decisions get the peers'.
    url:
        The shared store: ``redis://host:port/db`` (``rediss://`` for TLS, ``unix://``),
        through ``redis.asyncio``; or ``nats://host:port`` (``tls://``), through ``nats-py``;
        or ``file:///dir``, a directory shared by replicas on one host (`_LocalBackend`).
    replica_id:
        This replica's name in Redis; default ``<hostname>:<pid>``. Must differ between
        replicas.
    key_prefix:
        Prefix of every Redis key and channel (replicas sharing load use the same one).
    sync_interval_s:
        Seconds between two syncs (publish own counts, read peers').
    max_staleness_s:
        Peers' counts older than this are not used (their keys expire after it; a view not
        refreshed for this long is cleared). Must be > ``sync_interval_s``.
    share_speculative:
        Publish each decision's speculative credit and apply the peers' (see above).
    speculative_ttl_s:
        Seconds a peer's credit lasts here (the router's own ``speculative_ttl_s``); 0
        turns credit sharing off.
    timeout_s:
        Bound on each Redis connect and command, seconds (default ``max_staleness_s / 2``).
    client:
        A ``redis.asyncio.Redis`` to use (not closed by `aclose`) instead of ``url``.

    Raises
    ------
    ValueError
        A non-positive interval, ``max_staleness_s <= sync_interval_s``, an empty replica id
        or prefix.
    """

    def __init__(
        self,
        router: Any,
        url: Optional[str] = None,
        *,
        replica_id: Optional[str] = None,
        key_prefix: str = "kvroute",
        sync_interval_s: float = 0.1,
        max_staleness_s: float = 1.0,
        share_speculative: bool = True,
        speculative_ttl_s: float = 2.0,
        timeout_s: Optional[float] = None,
        client: Any = None,
    ) -> None:
        for name, v in (("sync_interval_s", sync_interval_s),
                        ("max_staleness_s", max_staleness_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if not max_staleness_s > sync_interval_s:
            raise ValueError(f"max_staleness_s ({max_staleness_s}) must exceed "
                             f"sync_interval_s ({sync_interval_s})")
        if url is None and client is None:
            raise ValueError("give url or client")
        if not key_prefix:
            raise ValueError("key_prefix must not be empty")
        self.router = router
        self.replica_id = replica_id or default_replica_id()
        if not self.replica_id:
            raise ValueError("replica_id must not be empty")
        self.key_prefix = key_prefix
        self.sync_interval_s = float(sync_interval_s)
        self.max_staleness_s = float(max_staleness_s)
        self.speculative_ttl_s = float(speculative_ttl_s)
        self.share_speculative = bool(share_speculative) and self.speculative_ttl_s > 0
        self.timeout_s = float(timeout_s) if timeout_s is not None else self.max_staleness_s / 2
        self.url = url
        self._backend: Any
        if client is not None or (url or "").startswith(("redis://", "rediss://", "unix://")):
            self._backend = _RedisBackend(self, url, client)
            self.transport = "redis"
        elif (url or "").startswith(("nats://", "tls://")):
            self._backend = _NatsBackend(self, str(url))
            self.transport = "nats"
        elif (url or "").startswith("file://"):
            self._backend = _LocalBackend(self, str(url))
            self.transport = "file"
        else:
            raise ValueError(f"url must be redis://, rediss://, unix://, nats://, tls:// or "
                             f"file:// (a directory), got {url!r}")
        self._task: Optional[asyncio.Task] = None
        self._sub_task: Optional[asyncio.Task] = None
        self._peers: Dict[str, _Peer] = {}
        self._applied: Dict[str, Tuple[int, int, int]] = {}  # what set_peer_load holds
        self._seq = 0
        self._credits: List[Tuple[str, Any, int, Dict[str, Any]]] = []
        self.stats = _Stats()

    # -- keys ----------------------------------------------------------------------------------
    @property
    def members_key(self) -> str:
        return f"{self.key_prefix}:replicas"

    def load_key(self, replica: str) -> str:
        return f"{self.key_prefix}:load:{replica}"

    @property
    def credits_channel(self) -> str:
        return f"{self.key_prefix}:credits"

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the sync task (and the credit subscriber) on the running loop. Idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="kvroute-shared-load")
        if self.share_speculative and self._sub_task is None:
            self._sub_task = asyncio.get_running_loop().create_task(
                self._subscribe(), name="kvroute-shared-credits")

    async def aclose(self) -> None:
        """Stops the tasks, deletes this replica's key (Redis; best effort), closes the
        connection and clears the peers' counts from the router. Idempotent."""
        for t in (self._task, self._sub_task):
            if t is None:
                continue
            # Cancelled again until it ends: on Python < 3.12 `asyncio.wait_for` returns the
            # inner result and drops the cancellation when both land in one loop iteration,
            # and the sync loop would go on (a plain `await t` then never returns).
            while not t.done():
                t.cancel()
                await asyncio.wait({t}, timeout=0.1)
            if not t.cancelled():
                t.exception()  # retrieved: a task that failed is not logged as unretrieved
        self._task = self._sub_task = None
        await self._backend.close()
        self._peers.clear()
        self._apply_peers()

    # -- the request path's hook ---------------------------------------------------------------
    def on_decision(self, decision: Any, tokens: Any, select_kwargs: Mapping[str, Any]) -> None:
        """Queues a decision's speculative credit for the peers (O(1); the block keys are
        computed by the sync task). ``select_kwargs``: the ``lora_name`` / ``cache_salt`` /
        ``extra_keys`` the decision was made with. No-op for a dry run, a fallback decision
        or with credit sharing off."""
        if (not self.share_speculative or decision.request_id == 0 or decision.fallback
                or tokens is None):
            return
        if len(self._credits) >= _MAX_PENDING_CREDITS:
            return
        kw = {k: select_kwargs[k] for k in ("lora_name", "cache_salt", "extra_keys")
              if select_kwargs.get(k) is not None}
        self._credits.append((decision.worker, tokens, int(decision.matched_blocks), kw))

    # -- sync ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # store down, timeout, a bad document: keep routing
                self.stats.errors += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                if self.stats.errors == 1 or self.stats.errors % 100 == 0:
                    log.warning("shared load: sync with %s failed (%d so far): %s",
                                self.transport, self.stats.errors, self.stats.last_error)
            self._expire_view()
            await asyncio.sleep(max(0.0, self.sync_interval_s - (time.monotonic() - started)))

    def _local_counts(self) -> Dict[str, List[int]]:
        return {name: [a, b, c] for name, a, b, c in self.router.local_load()}

    async def sync_once(self) -> None:
        """One sync: publish this replica's counts, read the peers', apply their sums.
        Raises what the store's client raises (the task counts it and keeps going)."""
        t0 = time.monotonic()
        self._seq += 1
        doc = {"v": FORMAT_VERSION, "replica": self.replica_id, "seq": self._seq,
               "time": time.time(), "interval_s": self.sync_interval_s,
               "workers": self._local_counts()}
        await self._backend.open()
        docs = await self._backend.exchange(json.dumps(doc, separators=(",", ":")))
        now = time.monotonic()
        peers: Dict[str, _Peer] = {}
        for rid, raw in sorted(docs.items()):
            try:
                d = json.loads(raw)
                if d.get("v") != FORMAT_VERSION:
                    continue
                ws = {str(k): (int(v[0]), int(v[1]), int(v[2]))
                      for k, v in d["workers"].items()}
                seq, published = int(d["seq"]), float(d["time"])
                rid = str(d.get("replica", rid))
            except (ValueError, KeyError, TypeError, IndexError) as e:
                log.warning("shared load: ignoring replica %s's document: %s", rid, e)
                continue
            old = self._peers.get(rid)
            seen = old.seen_mono if old is not None and old.seq == seq else now
            peers[rid] = _Peer(ws, seq, published, seen)
        self._peers = peers
        self.stats.syncs += 1
        self.stats.last_ok_mono = now
        self._apply_peers()
        if self._credits:
            await self._publish_credits()
        dt = time.monotonic() - t0
        self.stats.sync_seconds.append(dt)
        if len(self.stats.sync_seconds) > 256:
            del self.stats.sync_seconds[:128]

    def _expire_view(self) -> None:
        """Clears the peers' counts once the view is older than max_staleness_s."""
        last = self.stats.last_ok_mono
        if self._peers and (last is None or time.monotonic() - last > self.max_staleness_s):
            self._peers = {}
            self.stats.fallbacks += 1
            log.warning("shared load: no sync with %s for %.1f s: routing on this "
                        "replica's own load", self.transport, self.max_staleness_s)
            self._apply_peers()

    def _apply_peers(self) -> None:
        sums: Dict[str, Tuple[int, int, int]] = {}
        for p in self._peers.values():
            for name, (a, b, c) in p.workers.items():
                s = sums.get(name, (0, 0, 0))
                sums[name] = (s[0] + a, s[1] + b, s[2] + c)
        known = {w.name for w in self.router.workers}
        for name in set(self._applied) | set(sums):
            v = sums.get(name, (0, 0, 0))
            if self._applied.get(name, (0, 0, 0)) == v or name not in known:
                continue
            try:
                self.router.set_peer_load(name, *v)
            except (KeyError, IndexError, ValueError):  # removed meanwhile
                continue
            self._applied[name] = v
        for name in [n for n, v in self._applied.items() if v == (0, 0, 0)]:
            del self._applied[name]

    # -- speculative credits -------------------------------------------------------------------
    async def _publish_credits(self) -> None:
        from kvroute._router import block_keys

        batch, self._credits = self._credits, []
        out = []
        bs = self.router.block_size
        for worker, tokens, matched, kw in batch:
            try:
                keys = block_keys(tokens, bs, **kw)
            except ValueError:
                continue
            rest = np.ascontiguousarray(keys[matched:], dtype="<u8")
            if rest.size:
                out.append([worker, rest.tobytes().hex()])
        if not out:
            return
        msg = {"v": FORMAT_VERSION, "replica": self.replica_id, "ttl_s": self.speculative_ttl_s,
               "credits": out}
        await self._backend.publish_credits(json.dumps(msg, separators=(",", ":")))
        self.stats.credits_sent += len(out)

    async def _subscribe(self) -> None:
        while True:
            try:
                await self._backend.open()
                await self._backend.listen_credits(self._apply_credits)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.stats.credit_errors += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                await asyncio.sleep(self.sync_interval_s)

    def _apply_credits(self, raw: Any) -> None:
        try:
            d = json.loads(raw)
            if d.get("v") != FORMAT_VERSION or d.get("replica") == self.replica_id:
                return
            ttl = min(float(d["ttl_s"]), self.speculative_ttl_s)
            items = [(str(w), np.frombuffer(bytes.fromhex(h), dtype="<u8"))
                     for w, h in d["credits"]]
        except (ValueError, KeyError, TypeError) as e:
            log.warning("shared load: ignoring a credit message: %s", e)
            return
        known = self.router._workers
        for worker, keys in items:
            if worker not in known or not keys.size:
                continue
            try:
                self.router.add_speculative(worker, keys, ttl)
                self.stats.credits_received += 1
            except (KeyError, IndexError, ValueError):
                continue

    # -- views ---------------------------------------------------------------------------------
    def view_age_s(self) -> Optional[float]:
        """Seconds since the last successful sync (None: none yet)."""
        last = self.stats.last_ok_mono
        return None if last is None else time.monotonic() - last

    def peer_load(self) -> Dict[str, Tuple[int, int, int]]:
        """Per worker, the peers' summed ``(inflight, pending_prefill, active_blocks)`` the
        router holds now (workers with none left out)."""
        return dict(self._applied)

    def status(self) -> Dict[str, Any]:
        """For ``GET /workers``: ``replica_id``, ``transport`` (``redis`` / ``nats`` / ``file``),
        ``connected`` (the view is fresh),
        ``view_age_s``, ``max_staleness_s``, ``sync_interval_s``, ``peers`` (per replica:
        ``age_s`` = now minus its publish time, by the two hosts' clocks; ``seq``;
        ``workers`` with load), counters (``syncs``, ``errors``, ``fallbacks``,
        ``credits_sent``, ``credits_received``), ``last_error``, ``sync_p50_s``."""
        age = self.view_age_s()
        now = time.time()
        lat = sorted(self.stats.sync_seconds)
        return {
            "replica_id": self.replica_id,
            "transport": self.transport,
            "connected": age is not None and age <= self.max_staleness_s,
            "view_age_s": age,
            "max_staleness_s": self.max_staleness_s,
            "sync_interval_s": self.sync_interval_s,
            "peers": {rid: {"age_s": max(0.0, now - p.published), "seq": p.seq,
                            "workers": len(p.workers)} for rid, p in self._peers.items()},
            "syncs": self.stats.syncs, "errors": self.stats.errors,
            "fallbacks": self.stats.fallbacks, "last_error": self.stats.last_error,
            "credits_sent": self.stats.credits_sent,
            "credits_received": self.stats.credits_received,
            "sync_p50_s": lat[len(lat) // 2] if lat else None,
        }

    def register_metrics(self, registry: Any, namespace: str = "kvroute") -> None:
        """Registers a collector on a prometheus-client registry::

            <ns>_shared_load_connected                1 while the peers' view is fresh
            <ns>_shared_load_view_age_seconds         seconds since the last sync
            <ns>_shared_load_peer_age_seconds{peer}   publish-to-now age of each peer's counts
            <ns>_shared_load_peers                    replicas whose counts are used
            <ns>_shared_load_sync_errors_total
            <ns>_shared_load_fallbacks_total          times the view was cleared (Redis away)
            <ns>_peer_inflight_requests{worker}       the peers' requests in flight
        """
        registry.register(_Collector(self, namespace))


class _Collector:
    def __init__(self, shared: SharedLoad, namespace: str) -> None:
        self.shared = shared
        self.ns = namespace

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

        st = self.shared.status()
        ns = self.ns
        yield GaugeMetricFamily(f"{ns}_shared_load_connected",
                                "1 while the peer replicas' load view is fresh",
                                value=1.0 if st["connected"] else 0.0)
        age = st["view_age_s"]
        yield GaugeMetricFamily(f"{ns}_shared_load_view_age_seconds",
                                "Seconds since the last sync with the shared store",
                                value=float("nan") if age is None else age)
        g = GaugeMetricFamily(f"{ns}_shared_load_peer_age_seconds",
                              "Age of each peer replica's published load", labels=["peer"])
        for rid, p in st["peers"].items():
            g.add_metric([rid], p["age_s"])
        yield g
        yield GaugeMetricFamily(f"{ns}_shared_load_peers", "Peer replicas whose load is used",
                                value=len(st["peers"]))
        yield CounterMetricFamily(f"{ns}_shared_load_sync_errors", "Failed syncs",
                                  value=st["errors"])
        yield CounterMetricFamily(f"{ns}_shared_load_fallbacks",
                                  "Times the peers' load was dropped (store unreachable)",
                                  value=st["fallbacks"])
        g = GaugeMetricFamily(f"{ns}_peer_inflight_requests",
                              "Requests in flight on the worker from the peer replicas",
                              labels=["worker"])
        for name, (inflight, _, _) in self.shared.peer_load().items():
            g.add_metric([name], inflight)
        yield g
