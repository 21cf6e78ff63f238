"""An LMCache controller as a source of cache knowledge for the ``lmcache_aware`` policy.

Two lookup modes (shapes from LMCache's controller docs, ``docs/source/kv_cache_management/
lookup.rst`` and ``examples/cache_controller/lookup`` in the ``lmcache`` package):

- ``occupancy``: ``GET /controller/workers`` every ``poll_interval_s`` seconds; each worker entry
  carries ``instance_id`` and ``key_count`` (accepted as a list, or a dict under
  ``"workers"``). The score input is the key count.
- ``prefix_lookup``: per request ``POST /lookup`` with ``{"tokens": [...]}``; the answer is
  ``{"event_id": ..., "layout_info": {instance_id: [location, matched_tokens]}}`` (older
  releases put the instance ids at the top level; both are read). The score input is the
  matched prefix length in tokens.

``worker_map`` maps LMCache ``instance_id`` to kvroute worker names (URLs). Every call is
bounded by ``timeout_ms``; a failed call marks the controller down, the router then decides
with its fallback policy and says so (``reason="controller_down"``), and the next successful
call brings it back by itself.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Mapping, Optional

import httpx
import numpy as np

from kvroute.policies import LOOKUP_MODES, LmcacheAware


class LMCacheSource:
    """Per-worker numbers from an LMCache controller (thread-safe).

    Parameters
    ----------
    controller_url:
        e.g. ``"http://10.0.0.9:9000"``.
    worker_map:
        LMCache instance id -> kvroute worker name.
    lookup_mode:
        ``"occupancy"`` (default) or ``"prefix_lookup"``.
    poll_interval_s:
        Occupancy refresh period in seconds, ``> 0`` (``poll_interval_secs``: deprecated
        alias).
    timeout_ms:
        Bound on every controller call in milliseconds, ``> 0``.

    Defaults are `kvroute.policies.LmcacheAware`'s. Raises ValueError for a bad mode or
    period.
    """

    def __init__(self, controller_url: str, worker_map: Mapping[str, str], *,
                 lookup_mode: str = LmcacheAware.lookup_mode,
                 poll_interval_s: float = LmcacheAware.poll_interval_s,
                 timeout_ms: float = LmcacheAware.controller_timeout_ms,
                 poll_interval_secs: Optional[float] = None) -> None:
        if poll_interval_secs is not None:
            warnings.warn("LMCacheSource(poll_interval_secs=) is deprecated; use poll_interval_s",
                          DeprecationWarning, stacklevel=2)
            poll_interval_s = poll_interval_secs
        if lookup_mode not in LOOKUP_MODES:
            raise ValueError(f"lookup_mode must be one of {LOOKUP_MODES}, got {lookup_mode!r}")
        if poll_interval_s <= 0 or timeout_ms <= 0:
            raise ValueError("poll_interval_s and timeout_ms must be > 0")
        self.url = controller_url.rstrip("/")
        self.worker_map = dict(worker_map)
        self.mode = lookup_mode
        self.poll_interval_s = float(poll_interval_s)
        self._client = httpx.Client(timeout=timeout_ms / 1000.0)
        self._lock = threading.Lock()
        self._occupancy: Optional[dict[str, float]] = None
        self._next_poll = 0.0
        self.failures = 0
        self.calls = 0

    @classmethod
    def from_policy(cls, policy: LmcacheAware) -> LMCacheSource:
        """The source a `kvroute.policies.LmcacheAware` describes (the caller closes it)."""
        return cls(policy.controller_url or "", policy.worker_map or {},
                   lookup_mode=policy.lookup_mode, poll_interval_s=policy.poll_interval_s,
                   timeout_ms=policy.controller_timeout_ms)

    def _fail(self) -> None:
        with self._lock:
            self.failures += 1

    def scores(self, tokens: np.ndarray) -> Optional[dict[str, float]]:
        """Worker name -> key count / matched tokens; None when the controller is down."""
        if self.mode == "prefix_lookup":
            return self._lookup(tokens)
        now = time.monotonic()
        with self._lock:
            due = now >= self._next_poll
            if due:
                self._next_poll = now + self.poll_interval_s
        if due:
            self._poll()
        with self._lock:
            return None if self._occupancy is None else dict(self._occupancy)

    def _poll(self) -> None:
        try:
            self.calls += 1
            r = self._client.get(f"{self.url}/controller/workers")
            r.raise_for_status()
            body: Any = r.json()
            entries = body.get("workers", []) if isinstance(body, dict) else body
            occ: dict[str, float] = {}
            for e in entries:
                name = self.worker_map.get(str(e.get("instance_id")))
                if name is not None:
                    occ[name] = occ.get(name, 0.0) + float(e.get("key_count", 0))
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            self._fail()
            occ = None  # type: ignore[assignment]
        with self._lock:
            self._occupancy = occ
            if occ is None:
                self._next_poll = 0.0  # retry on the next request, not after a full interval

    def _lookup(self, tokens: np.ndarray) -> Optional[dict[str, float]]:
        try:
            self.calls += 1
            r = self._client.post(f"{self.url}/lookup",
                                  json={"tokens": np.asarray(tokens).tolist()})
            r.raise_for_status()
            body = r.json()
            layout = body.get("layout_info", body)
            out: dict[str, float] = {}
            for inst, info in layout.items():
                if inst == "event_id" or not isinstance(info, (list, tuple)) or len(info) < 2:
                    continue
                name = self.worker_map.get(str(inst))
                if name is not None:
                    out[name] = max(out.get(name, 0.0), float(info[1]))
            return out
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            self._fail()
            return None

    def close(self) -> None:
        self._client.close()
