"""The admin side of the proxy: the decision log and run-time changes to the fleet.

`DecisionLog` keeps the most recent routing decisions (a bounded ring, oldest dropped first)
for ``GET /admin/decisions``. `add_worker` / `remove_worker` change the proxy's fleet while
it serves (``POST /admin/workers``, ``DELETE /admin/workers/{name}``, and ``POST
/admin/reload`` with the workers of the config file). Removing a worker never cuts a request
in flight: the request keeps its upstream connection and finishes; only new requests stop
going there (`kvroute.Router.complete` of a decision whose worker is gone is a no-op).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional

from kvroute._router import Worker
from kvroute.serving import defaults as D

__all__ = ["DecisionLog", "add_worker", "reload", "remove_worker", "worker_from_json"]


class DecisionLog:
    """A ring of the last ``size`` decisions (dicts; see `record`). Thread-safe.

    ``expand``: turns a recorded entry into the dict `entries` returns (the proxy passes one
    that replaces a held `kvroute.Decision` by its JSON fields); default: a copy."""

    def __init__(self, size: int = D.DECISION_LOG_SIZE,
                 expand: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"decision log size must be an int >= 1, got {size!r}")
        self._ring: Deque[Dict[str, Any]] = collections.deque(maxlen=size)
        self._lock = threading.Lock()
        self._expand = expand or dict
        self.recorded = 0

    @property
    def size(self) -> int:
        return self._ring.maxlen or 0

    def record(self, entry: Dict[str, Any]) -> None:
        """Appends one entry, stamped with ``time`` (Unix seconds) when it has none. Keep it
        cheap: work that only reading needs belongs in ``expand``."""
        entry.setdefault("time", time.time())
        with self._lock:
            self._ring.append(entry)
            self.recorded += 1

    def entries(self, limit: Optional[int] = None, tenant: Optional[str] = None
                ) -> List[Dict[str, Any]]:
        """The newest ``limit`` entries (all when ``None``), oldest first; only ``tenant``'s
        when given."""
        with self._lock:
            items = list(self._ring)
        if tenant is not None:
            items = [e for e in items if e.get("tenant") == tenant]
        if limit is not None:
            items = items[-limit:] if limit > 0 else []
        return [self._expand(e) for e in items]


def worker_from_json(body: Any) -> Worker:
    """A `kvroute.Worker` from ``{"url", "kv_events"?, "replay"?, "dp_rank"?}`` (the keys of
    a config's worker entry; ``kv_endpoint`` / ``replay_endpoint`` also accepted). Raises
    ValueError for anything else."""
    if not isinstance(body, Mapping):
        raise ValueError("expected a JSON object with 'url'")
    allowed = {"url", "kv_events", "kv_endpoint", "replay", "replay_endpoint", "dp_rank"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; allowed: {sorted(allowed)}")
    url = body.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://", "unix://")):
        raise ValueError(f"url must be http://, https:// or unix://..., got {url!r}")
    kv = body.get("kv_events", body.get("kv_endpoint"))
    replay = body.get("replay", body.get("replay_endpoint"))
    dp = body.get("dp_rank")
    for key, v in (("kv_events", kv), ("replay", replay)):
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{key} must be a ZeroMQ endpoint string, got {v!r}")
    if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 0):
        raise ValueError(f"dp_rank must be an int >= 0, got {dp!r}")
    return Worker(url, kv_endpoint=kv, dp_rank=dp, replay_endpoint=replay)


def add_worker(proxy: Any, worker: Worker) -> Worker:
    """Adds ``worker`` to the proxy's router (its events are ingested from now on) and to the
    metrics scrape when that is on. Raises ValueError for a duplicate."""
    w = proxy.router.add_worker(worker)
    scraper = getattr(proxy, "_scraper", None)
    if scraper is not None:
        scraper.add_target(w.name, proxy.base_url(w.url) + "/metrics")
    return w


def remove_worker(proxy: Any, name: str) -> None:
    """Removes worker ``name``: no new request goes there, requests in flight finish; its
    index, breaker, scrape target and request-path metric series are dropped. Raises
    KeyError for an unknown worker."""
    proxy.router.remove_worker(name)
    proxy._breakers.pop(name, None)
    scraper = getattr(proxy, "_scraper", None)
    if scraper is not None and name in scraper.targets:
        scraper.remove_target(name)
    proxy.metrics.forget_worker(name)


def apply_tenants(auth: Any, new_cfg: Any) -> None:
    """Installs a re-read config's tenants and admin key in ``auth``
    (`kvroute.serving.auth.Auth.replace_tenants`). Raises ValueError, changing nothing, for a
    tenant table `Auth` refuses (duplicate names or keys, a tenant with the admin key)."""
    from kvroute.serving.auth import Auth

    probe = Auth(new_cfg.tenants or (),
                 admin_key_sha256=new_cfg.admin.key_sha256 if new_cfg.admin else None)
    del probe  # validated: duplicate names / keys raise before anything changes
    auth.admin_key_sha256 = new_cfg.admin.key_sha256 if new_cfg.admin else None
    auth.protect_metrics = bool(new_cfg.admin.protect_metrics) if new_cfg.admin else False
    auth.replace_tenants(new_cfg.tenants or ())


def reload(proxy: Any, auth: Any, new_cfg: Any, old_cfg: Any) -> Dict[str, Any]:
    """Applies a re-read configuration (`kvroute.config.RouterConfig`) to a running proxy:
    the tenants and admin key (`kvroute.serving.auth.Auth.replace_tenants`), the workers
    (added and removed by name; workers that stay keep their index, load and breaker), and
    the policy, its fallback and their knobs (`kvroute.Router.set_policy`). What cannot
    change at run time (a switch to or from lmcache_aware, block size, serving options) is
    listed under ``not_applied`` and keeps its running value.

    Returns ``{"workers_added", "workers_removed", "tenants", "policy", "not_applied"}``.
    Raises ValueError (nothing applied) for a tenant table `Auth` refuses."""
    apply_tenants(auth, new_cfg)

    want = {w.name: w for w in new_cfg.workers()}
    have = {w.name: w for w in proxy.router.workers}
    removed = [n for n in have if n not in want]
    added = [n for n in want if n not in have]
    for n in removed:
        remove_worker(proxy, n)
    for n in added:
        add_worker(proxy, want[n])
    not_applied: List[str] = [f"worker {n} (changed endpoints: remove and add it)"
                              for n in want if n in have and want[n] != have[n]]

    old_kw, new_kw = old_cfg.router_kwargs(), new_cfg.router_kwargs()
    policy = "unchanged"
    new_p, new_fb = new_kw["policy"], new_kw.get("fallback")
    if (new_p, new_fb) != (old_kw["policy"], old_kw.get("fallback")):
        try:
            proxy.router.set_policy(new_p, new_fb)  # no fallback given: the running one stays
            policy = f"{new_p!r}" + ("" if new_fb is None else f", fallback {new_fb!r}")
        except ValueError as e:
            not_applied.append(f"policy ({e})")
    for key in ("block_size", "serving", "kv_events", "limits", "speculative_ttl_s"):
        if getattr(new_cfg, key) != getattr(old_cfg, key):
            not_applied.append(key)
    return {"workers_added": added, "workers_removed": removed,
            "tenants": [t.name for t in auth.tenants], "policy": policy,
            "not_applied": not_applied}
