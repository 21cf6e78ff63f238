"""In-flight load and speculative credits shared between router replicas through Redis.

Several ``kvroute serve`` replicas behind one L4 balancer each see only the requests they
routed; alone, each would send a burst to the same idle engine (every replica sees ~1/N of
the load). `SharedLoad` makes every replica's decisions count the others' requests in flight:

* a background asyncio task, every ``sync_interval_s``, reads this router's own per-worker
  counts (``router.stats()``: ``inflight_requests``, ``pending_prefill_tokens``,
  ``active_blocks``), writes them to Redis under its replica's key with a TTL of
  ``max_staleness_s``, and reads the other replicas' keys;
* the sum of the others' counts per worker goes into the native router
  (``Router.set_peer_load``), which adds it to its own counts in every decision's load terms.
  The request path reads only that local copy: no network round trip per request;
* with ``share_speculative`` each decision's speculative credit (the prompt's block keys
  past the chosen worker's match, `kvroute.block_keys`) is published on a Redis channel once
  per interval, and the other replicas credit the same worker with those blocks for the
  remaining ``speculative_ttl_s`` (so a burst of one new prefix lands on one worker whichever
  replica each request reached).

Redis layout (``<p>`` = ``key_prefix``; every value is JSON, UTF-8)::

    <p>:replicas            set of replica ids that published
    <p>:load:<replica id>   {"v": 1, "replica": id, "seq": n, "time": unix s,
                             "interval_s": s, "workers": {name: [inflight, prefill, blocks]}}
                            (workers with all three 0 left out), PX = max_staleness_s
    <p>:credits             pub/sub channel: {"v": 1, "replica": id, "ttl_s": s,
                             "credits": [[worker, "<hex of little-endian uint64 keys>"], ...]}

Staleness, bounded: a peer's counts are used only while its key lives (it published within
``max_staleness_s``), and only while this replica's last successful sync is at most
``max_staleness_s`` old. Past that (Redis down or unreachable) the peers' counts are cleared,
decisions run on this replica's own load (standalone), Redis is retried every interval, and
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


class SharedLoad:
    """Shares this router's in-flight load with its peer replicas through Redis (see the
    module docstring for the layout and the staleness bound).

    Parameters
    ----------
    router:
        The `kvroute.Router` whose load is published and whose decisions get the peers'.
    redis_url:
        ``redis://host:port/db`` (``rediss://`` for TLS), read by ``redis.asyncio``.
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
        A ``redis.asyncio.Redis`` to use (not closed by `aclose`); default one from
        ``redis_url``.

    Raises
    ------
    ValueError
        A non-positive interval, ``max_staleness_s <= sync_interval_s``, an empty replica id
        or prefix.
    """

    def __init__(
        self,
        router: Any,
        redis_url: Optional[str] = None,
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
        if redis_url is None and client is None:
            raise ValueError("give redis_url or client")
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
        self._url = redis_url
        self._own_client = client is None
        self._client = client
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
        if self._client is None:
            import redis.asyncio as aioredis

            assert self._url is not None  # __init__: redis_url or client
            self._client = aioredis.Redis.from_url(
                self._url, socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s, health_check_interval=0)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="kvroute-shared-load")
        if self.share_speculative and self._sub_task is None:
            self._sub_task = asyncio.get_running_loop().create_task(
                self._subscribe(), name="kvroute-shared-credits")

    async def aclose(self) -> None:
        """Stops the tasks, deletes this replica's key (best effort) and clears the peers'
        counts from the router. Idempotent."""
        for t in (self._task, self._sub_task):
            if t is not None:
                t.cancel()
        for t in (self._task, self._sub_task):
            if t is not None:
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
        self._task = self._sub_task = None
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.delete(self.load_key(self.replica_id)),
                                       self.timeout_s)
            except Exception:  # Redis down: the key expires by itself
                pass
            if self._own_client:
                try:
                    await self._client.aclose()
                except Exception:
                    pass
                self._client = None
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
            except Exception as e:  # Redis down, timeout, a bad document: keep routing
                self.stats.errors += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                if self.stats.errors == 1 or self.stats.errors % 100 == 0:
                    log.warning("shared load: sync with Redis failed (%d so far): %s",
                                self.stats.errors, self.stats.last_error)
            self._expire_view()
            await asyncio.sleep(max(0.0, self.sync_interval_s - (time.monotonic() - started)))

    def _local_counts(self) -> Dict[str, List[int]]:
        out: Dict[str, List[int]] = {}
        for name, w in self.router.stats()["workers"].items():
            c = [int(w["inflight_requests"]), int(w["pending_prefill_tokens"]),
                 int(w.get("active_blocks", 0))]
            if any(c):
                out[name] = c
        return out

    async def sync_once(self) -> None:
        """One sync: publish this replica's counts, read the peers', apply their sums.
        Raises what Redis raises (the task counts it and keeps going)."""
        t0 = time.monotonic()
        self._seq += 1
        doc = {"v": FORMAT_VERSION, "replica": self.replica_id, "seq": self._seq,
               "time": time.time(), "interval_s": self.sync_interval_s,
               "workers": self._local_counts()}
        ttl_ms = max(1, int(self.max_staleness_s * 1000))
        client = self._client
        async with client.pipeline(transaction=False) as pipe:
            pipe.set(self.load_key(self.replica_id), json.dumps(doc, separators=(",", ":")),
                     px=ttl_ms)
            pipe.sadd(self.members_key, self.replica_id)
            pipe.smembers(self.members_key)
            _, _, members = await asyncio.wait_for(pipe.execute(), self.timeout_s)
        others = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
        others = [m for m in others if m != self.replica_id]
        values = (await asyncio.wait_for(client.mget([self.load_key(m) for m in others]),
                                         self.timeout_s)) if others else []
        now = time.monotonic()
        gone = []
        peers: Dict[str, _Peer] = {}
        for rid, raw in zip(others, values):
            if raw is None:
                gone.append(rid)  # its key expired: stopped, or cut off from Redis
                continue
            try:
                d = json.loads(raw)
                if d.get("v") != FORMAT_VERSION:
                    continue
                ws = {str(k): (int(v[0]), int(v[1]), int(v[2]))
                      for k, v in d["workers"].items()}
                seq, published = int(d["seq"]), float(d["time"])
            except (ValueError, KeyError, TypeError, IndexError) as e:
                log.warning("shared load: ignoring replica %s's document: %s", rid, e)
                continue
            old = self._peers.get(rid)
            seen = old.seen_mono if old is not None and old.seq == seq else now
            peers[rid] = _Peer(ws, seq, published, seen)
        if gone:
            try:
                await asyncio.wait_for(client.srem(self.members_key, *gone), self.timeout_s)
            except Exception:
                pass  # removed by the next sync
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
            log.warning("shared load: no sync with Redis for %.1f s: routing on this "
                        "replica's own load", self.max_staleness_s)
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
        await asyncio.wait_for(self._client.publish(self.credits_channel,
                                                    json.dumps(msg, separators=(",", ":"))),
                               self.timeout_s)
        self.stats.credits_sent += len(out)

    async def _subscribe(self) -> None:
        while True:
            pubsub = None
            try:
                pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                await asyncio.wait_for(pubsub.subscribe(self.credits_channel), self.timeout_s)
                while True:
                    m = await pubsub.get_message(timeout=1.0)
                    if m is not None and m.get("type") == "message":
                        self._apply_credits(m["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.stats.credit_errors += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                await asyncio.sleep(self.sync_interval_s)
            finally:
                if pubsub is not None:
                    try:
                        await pubsub.aclose()
                    except Exception:
                        pass

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
        """For ``GET /workers``: ``replica_id``, ``connected`` (the view is fresh),
        ``view_age_s``, ``max_staleness_s``, ``sync_interval_s``, ``peers`` (per replica:
        ``age_s`` = now minus its publish time, by the two hosts' clocks; ``seq``;
        ``workers`` with load), counters (``syncs``, ``errors``, ``fallbacks``,
        ``credits_sent``, ``credits_received``), ``last_error``, ``sync_p50_s``."""
        age = self.view_age_s()
        now = time.time()
        lat = sorted(self.stats.sync_seconds)
        return {
            "replica_id": self.replica_id,
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
