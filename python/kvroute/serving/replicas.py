"""Router replicas as one system: shared load, readiness and bootstrap from a peer.

`Replicas` is what the ``replicas:`` section of the router configuration turns on in
``kvroute serve`` (`kvroute.config.ReplicasConfig`)::

    replicas:
      redis_url: redis://10.0.0.9:6379/0   # shared in-flight load (absent: standalone)
      # nats_url: nats://10.0.0.9:4222     # or through NATS instead (not both)
      replica_id: router-a                 # default <hostname>:<pid>
      key_prefix: kvroute
      sync_interval_s: 0.1
      max_staleness_s: 1.0
      share_speculative: true
      bootstrap_from: [http://10.0.0.2:8080, http://10.0.0.3:8080]
      bootstrap_timeout_s: 10
      bootstrap_key_env: KVROUTE_ADMIN_KEY

* shared load: `kvroute.serving.shared_load.SharedLoad` (Redis, or NATS);
* ``GET /admin/snapshot`` on every replica streams its index (`kvroute.snapshot`);
* bootstrap: at start a background task fetches the first peer's snapshot that answers
  (``Authorization: Bearer $<bootstrap_key_env>`` when that variable is set) and restores it
  (`kvroute.snapshot.restore_snapshot`); each restored worker then catches up from its
  engine's replay socket;
* ``GET /ready`` (`readiness`): 200 once the bootstrap is over (done, or every peer failed)
  and every worker's index is ``exact`` or explicitly not trusted (``degraded``, ``stale``);
  503 while a worker is ``recovering`` or the bootstrap runs. ``/health`` stays liveness.

Thread-safety: one asyncio event loop owns a `Replicas`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from kvroute.serving.shared_load import SharedLoad, default_replica_id

__all__ = ["Replicas", "readiness", "READY_STATES"]

log = logging.getLogger(__name__)

#: Worker states `readiness` accepts: exact, or explicitly not trusted.
READY_STATES = frozenset({"exact", "degraded", "stale"})
_RESTORE_RETRY_S = 0.05  # a worker busy recovering is retried this often ...
_RESTORE_RETRIES = 40    # ... this many times


def readiness(router: Any, bootstrap_state: str = "none") -> Tuple[bool, Dict[str, Any]]:
    """``(ready, body)`` for ``GET /ready``: ready when ``bootstrap_state`` is not
    ``"running"`` and every worker's ``state`` is in `READY_STATES`. ``body``: ``status``
    (``"ready"`` / ``"not_ready"``), ``bootstrap``, ``workers`` (name -> state),
    ``not_ready`` (the names holding it back)."""
    states = {name: w["state"] for name, w in router.stats()["workers"].items()}
    waiting = sorted(n for n, s in states.items() if s not in READY_STATES)
    ready = not waiting and bootstrap_state != "running"
    return ready, {"status": "ready" if ready else "not_ready", "bootstrap": bootstrap_state,
                   "workers": states, "not_ready": waiting}


class Replicas:
    """Shared load (Redis), bootstrap from a peer's snapshot and readiness for one replica.

    Parameters
    ----------
    router:
        The replica's `kvroute.Router`.
    redis_url, nats_url, local_dir:
        The shared store for `SharedLoad` (at most one; none: no shared load): Redis, NATS,
        or an absolute directory shared by the replicas of one host (`kvroute serve --workers
        N` gives its processes one).
    replica_id, key_prefix, sync_interval_s, max_staleness_s, share_speculative:
        `SharedLoad`'s.
    bootstrap_from:
        Peer base URLs (``http://host:port``) tried in order at `start`.
    bootstrap_timeout_s:
        Bound on one peer's snapshot download, seconds.
    bootstrap_key_env:
        Environment variable holding the admin key sent to the peers.

    Raises
    ------
    ValueError
        Bad shared-load settings (both URLs given), a non-positive timeout.
    """

    def __init__(
        self,
        router: Any,
        *,
        redis_url: Optional[str] = None,
        nats_url: Optional[str] = None,
        local_dir: Optional[str] = None,
        replica_id: Optional[str] = None,
        key_prefix: str = "kvroute",
        sync_interval_s: float = 0.1,
        max_staleness_s: float = 1.0,
        share_speculative: bool = True,
        bootstrap_from: Optional[List[str]] = None,
        bootstrap_timeout_s: float = 10.0,
        bootstrap_key_env: str = "KVROUTE_ADMIN_KEY",
    ) -> None:
        if not bootstrap_timeout_s > 0:
            raise ValueError(f"bootstrap_timeout_s must be > 0, got {bootstrap_timeout_s!r}")
        self.router = router
        self.replica_id = replica_id or default_replica_id()
        self.shared: Optional[SharedLoad] = None
        given = [u for u in (redis_url, nats_url, local_dir) if u is not None]
        if len(given) > 1:
            raise ValueError("give one of redis_url, nats_url and local_dir")
        url = given[0] if given else None
        if local_dir is not None:
            url = f"file://{local_dir}"
        if url is not None:
            ttl = float(router._core.options.speculative_ttl_s)
            self.shared = SharedLoad(router, url, replica_id=self.replica_id,
                                     key_prefix=key_prefix, sync_interval_s=sync_interval_s,
                                     max_staleness_s=max_staleness_s,
                                     share_speculative=share_speculative,
                                     speculative_ttl_s=ttl)
        self.bootstrap_from = [u.rstrip("/") for u in (bootstrap_from or [])]
        self.bootstrap_timeout_s = float(bootstrap_timeout_s)
        self.bootstrap_key_env = bootstrap_key_env
        self.bootstrap_state = "none" if not self.bootstrap_from else "pending"
        self.bootstrap_report: Dict[str, Any] = {}
        self._task: Optional[asyncio.Task] = None

    @classmethod
    def from_options(cls, router: Any, options: Any) -> Optional[Replicas]:
        """From a mapping of the keywords above (the config's ``replicas`` section), a
        `Replicas` (returned as is) or None."""
        if options is None or isinstance(options, Replicas):
            return options
        return cls(router, **dict(options))

    async def start(self, client: Any = None) -> None:
        """Starts the shared-load task and the bootstrap (with ``client``, an
        ``httpx.AsyncClient``, or one of its own). Idempotent."""
        if self.shared is not None:
            self.shared.start()
        if self.bootstrap_state == "pending" and self._task is None:
            self.bootstrap_state = "running"
            self._task = asyncio.get_running_loop().create_task(self._bootstrap(client),
                                                                name="kvroute-bootstrap")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        if self.shared is not None:
            await self.shared.aclose()

    def on_decision(self, decision: Any, tokens: Any, select_kwargs: Mapping[str, Any]) -> None:
        """The request path's hook after a decision (see `SharedLoad.on_decision`)."""
        if self.shared is not None:
            self.shared.on_decision(decision, tokens, select_kwargs)

    def readiness(self) -> Tuple[bool, Dict[str, Any]]:
        return readiness(self.router, self.bootstrap_state)

    def status(self) -> Dict[str, Any]:
        """For ``GET /workers``: ``replica_id``, ``shared_load`` (`SharedLoad.status` or
        None), ``bootstrap`` (state and report)."""
        return {"replica_id": self.replica_id,
                "shared_load": self.shared.status() if self.shared is not None else None,
                "bootstrap": {"state": self.bootstrap_state, **self.bootstrap_report}}

    def peer_load(self) -> Dict[str, Tuple[int, int, int]]:
        return self.shared.peer_load() if self.shared is not None else {}

    async def _bootstrap(self, client: Any) -> None:
        import httpx

        from kvroute.snapshot import SnapshotError, parse_snapshot, restore_snapshot

        own = client is None
        if own:
            client = httpx.AsyncClient(trust_env=False)
        headers = {}
        key = os.environ.get(self.bootstrap_key_env) if self.bootstrap_key_env else None
        if key:
            headers["authorization"] = f"Bearer {key}"
        t0 = time.monotonic()
        errors: Dict[str, str] = {}
        try:
            for peer in self.bootstrap_from:
                try:
                    r = await client.get(f"{peer}/admin/snapshot", headers=headers,
                                         timeout=self.bootstrap_timeout_s)
                    if r.status_code != 200:
                        raise SnapshotError(f"HTTP {r.status_code}: {r.text[:200]}")
                    t_fetch = time.monotonic() - t0
                    snap = await asyncio.to_thread(parse_snapshot, r.content)
                    result = await self._restore(snap, restore_snapshot)
                except (httpx.HTTPError, SnapshotError, OSError) as e:
                    errors[peer] = f"{type(e).__name__}: {e}"
                    log.warning("bootstrap from %s failed: %s", peer, errors[peer])
                    continue
                self.bootstrap_report = {
                    "peer": peer, "bytes": len(r.content), "entries": snap.num_entries,
                    "fetch_s": t_fetch, "restore_s": time.monotonic() - t0 - t_fetch,
                    "workers": result, "errors": errors}
                self.bootstrap_state = "done"
                log.info("bootstrapped from %s: %d entries in %.3f s", peer, snap.num_entries,
                         time.monotonic() - t0)
                return
            self.bootstrap_report = {"errors": errors}
            self.bootstrap_state = "failed"
        finally:
            if self.bootstrap_state == "running":
                self.bootstrap_state = "failed"
            if own:
                await client.aclose()

    async def _restore(self, snap: Any, restore: Any) -> Dict[str, str]:
        result: Dict[str, str] = await asyncio.to_thread(restore, self.router, snap)
        for _ in range(_RESTORE_RETRIES):  # workers in a replay of their own: once it ends
            busy = [n for n, r in result.items() if r == "busy"]
            if not busy:
                break
            await asyncio.sleep(_RESTORE_RETRY_S)
            result.update(await asyncio.to_thread(restore, self.router, snap, busy))
        return result
