"""An LMCache controller as a source of cache knowledge for the ``lmcache_aware`` policy.

Two lookup modes (shapes from LMCache's controller docs, ``docs/source/kv_cache_management/
lookup.rst`` and ``examples/cache_controller/lookup`` in the ``lmcache`` package):

- ``occupancy``: ``GET /controller/workers``; each worker entry carries ``instance_id`` and
  ``key_count`` (accepted as a list, or a dict under ``"workers"``). The score input is the
  key count.
- ``prefix_lookup``: per request ``POST /lookup`` with ``{"tokens": [...]}``; the answer is
  ``{"event_id": ..., "layout_info": {instance_id: [location, matched_tokens]}}`` (older
  releases put the instance ids at the top level; both are read). The score input is the
  matched prefix length in tokens.

As the vLLM router fork documents it, a background thread (``kvroute-lmcache-poll``) polls
``GET /controller/workers`` every ``poll_interval_s`` seconds and keeps the last snapshot;
the request path only reads that snapshot (occupancy) and never waits on the controller.
``prefix_lookup`` needs the prompt, so it asks the controller on the request path, but only
while the last poll found the controller up; otherwise the request falls back at once.

Every controller call has one deadline, ``timeout_ms`` for the whole call: name resolution,
connect, request, status line, headers and the whole body (a body trickled in small pieces
is cut off at the deadline). A call that fails, times out, answers an error status or a body
that is not the documented shape, lists no worker, or lists no instance that
``worker_map`` maps to a configured worker, marks the controller down: the router decides
with its fallback policy and says so (``reason="controller_down"``). The next good poll
brings it back by itself.

``worker_map`` maps LMCache ``instance_id`` to kvroute worker names (URLs).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Dict, Mapping, Optional
from urllib.parse import urlsplit

import numpy as np

from kvroute.policies import LOOKUP_MODES, LmcacheAware

__all__ = ["LMCacheSource", "ControllerError"]


class ControllerError(Exception):
    """One failed controller call (down, timed out, error status, bad or empty answer)."""


def _shutdown(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class LMCacheSource:
    """Per-worker numbers from an LMCache controller, polled in the background
    (thread-safe).

    Parameters
    ----------
    controller_url:
        e.g. ``"http://10.0.0.9:9000"`` (http or https).
    worker_map:
        LMCache instance id -> kvroute worker name.
    lookup_mode:
        ``"occupancy"`` (default) or ``"prefix_lookup"``.
    poll_interval_s:
        Seconds between polls, ``> 0`` (``poll_interval_secs``: deprecated alias).
    timeout_ms:
        Deadline of one whole controller call in milliseconds, ``> 0``.
    start:
        Start the polling thread now (default); ``False`` for a source polled by hand
        (`poll_once`).

    Defaults are `kvroute.policies.LmcacheAware`'s. Raises ValueError for a bad URL, mode,
    period or timeout. Call `close` to stop the thread.
    """

    def __init__(self, controller_url: str, worker_map: Mapping[str, str], *,
                 lookup_mode: str = LmcacheAware.lookup_mode,
                 poll_interval_s: float = LmcacheAware.poll_interval_s,
                 timeout_ms: float = LmcacheAware.controller_timeout_ms,
                 poll_interval_secs: Optional[float] = None, start: bool = True) -> None:
        if poll_interval_secs is not None:
            warnings.warn("LMCacheSource(poll_interval_secs=) is deprecated; use poll_interval_s",
                          DeprecationWarning, stacklevel=2)
            poll_interval_s = poll_interval_secs
        if lookup_mode not in LOOKUP_MODES:
            raise ValueError(f"lookup_mode must be one of {LOOKUP_MODES}, got {lookup_mode!r}")
        if not poll_interval_s > 0 or not timeout_ms > 0:
            raise ValueError("poll_interval_s and timeout_ms must be > 0")
        parts = urlsplit(controller_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"controller_url must be an http(s) URL, got {controller_url!r}")
        self.url = controller_url.rstrip("/")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._base = parts.path.rstrip("/")
        self.worker_map = dict(worker_map)
        self.mode = lookup_mode
        self.poll_interval_s = float(poll_interval_s)
        self.timeout_s = float(timeout_ms) / 1000.0
        self._lock = threading.Lock()
        self._snapshot: Optional[Dict[str, float]] = None  # replaced whole, never mutated
        self._up = False
        self.failures = 0
        self.calls = 0
        self.polls = 0
        self.last_error: Optional[str] = None
        # Name resolution cannot be given a timeout: it runs here, waited for until the
        # call's deadline.
        self._resolver = ThreadPoolExecutor(1, thread_name_prefix="kvroute-lmcache-dns")
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if start:
            self._thread = threading.Thread(target=self._run, name="kvroute-lmcache-poll",
                                            daemon=True)
            self._thread.start()

    @classmethod
    def from_policy(cls, policy: LmcacheAware) -> LMCacheSource:
        """The source a `kvroute.policies.LmcacheAware` describes (the caller closes it)."""
        return cls(policy.controller_url or "", policy.worker_map or {},
                   lookup_mode=policy.lookup_mode, poll_interval_s=policy.poll_interval_s,
                   timeout_ms=policy.controller_timeout_ms)

    # -- the request path --------------------------------------------------------------------
    @property
    def up(self) -> bool:
        """True while the last poll succeeded (a mapped worker was listed)."""
        return self._up

    def scores(self, tokens: np.ndarray) -> Optional[Dict[str, float]]:
        """Worker name -> key count (occupancy: the last snapshot, no I/O) or matched tokens
        (prefix_lookup: one call bounded by the deadline, only while the controller is up);
        None when the controller is down (the router then falls back)."""
        if self.mode == "prefix_lookup":
            if not self._up:
                return None
            try:
                return self._lookup(tokens)
            except ControllerError as e:
                self._mark_down(e)
                return None
        return self._snapshot

    # -- polling -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.poll_interval_s)

    def poll_once(self) -> bool:
        """One ``GET /controller/workers``: replaces the snapshot, or marks the controller
        down. Returns True on success."""
        self.polls += 1
        try:
            body = self._call("GET", "/controller/workers", None)
            entries = body.get("workers", []) if isinstance(body, dict) else body
            if not isinstance(entries, list) or not entries:
                raise ControllerError("the controller lists no worker")
            occ: Dict[str, float] = {}
            for e in entries:
                if not isinstance(e, Mapping):
                    raise ControllerError(f"worker entry is not a mapping: {e!r}")
                name = self.worker_map.get(str(e.get("instance_id")))
                if name is not None:
                    occ[name] = occ.get(name, 0.0) + float(e.get("key_count", 0))
            if not occ:
                raise ControllerError("no listed instance is in lmcache_worker_map")
        except (ControllerError, ValueError, TypeError) as e:
            self._mark_down(e)
            return False
        with self._lock:
            self._snapshot = occ
            self._up = True
            self.last_error = None
        return True

    def _mark_down(self, err: BaseException) -> None:
        with self._lock:
            self.failures += 1
            self._up = False
            self._snapshot = None
            self.last_error = str(err) or type(err).__name__

    def _lookup(self, tokens: np.ndarray) -> Dict[str, float]:
        body = self._call("POST", "/lookup", {"tokens": np.asarray(tokens).tolist()})
        if not isinstance(body, dict):
            raise ControllerError("lookup answer is not a mapping")
        layout = body.get("layout_info", body)
        if not isinstance(layout, dict):
            raise ControllerError("layout_info is not a mapping")
        out: Dict[str, float] = {}
        for inst, info in layout.items():
            if inst == "event_id" or not isinstance(info, (list, tuple)) or len(info) < 2:
                continue
            name = self.worker_map.get(str(inst))
            if name is not None:
                out[name] = max(out.get(name, 0.0), float(info[1]))
        return out

    # -- one bounded call --------------------------------------------------------------------
    def _call(self, method: str, path: str, payload: Any) -> Any:
        """One HTTP call finished within ``timeout_s`` of its start, or ControllerError."""
        self.calls += 1
        deadline = time.monotonic() + self.timeout_s

        def left() -> float:
            rest = deadline - time.monotonic()
            if rest <= 0:
                raise ControllerError(f"controller call exceeded {self.timeout_s * 1000:g} ms")
            return rest

        try:
            fut = self._resolver.submit(socket.getaddrinfo, self._host, self._port,
                                        type=socket.SOCK_STREAM)
            try:
                addrs = fut.result(timeout=left())
            except FutureTimeout:
                raise ControllerError(f"resolving {self._host} exceeded the deadline") from None
            conn = self._connection(str(addrs[0][4][0]), left())
            # A watchdog at the deadline shuts the socket down, so no read (status line,
            # headers, body) outlives it however the bytes are paced.
            watchdog = threading.Timer(left(), _shutdown, (conn,))
            watchdog.daemon = True
            watchdog.start()
            try:
                data = json.dumps(payload).encode() if payload is not None else None
                headers = {"Host": f"{self._host}:{self._port}", "Accept": "application/json"}
                if data is not None:
                    headers["Content-Type"] = "application/json"
                conn.request(method, self._base + path, body=data, headers=headers)
                assert conn.sock is not None
                conn.sock.settimeout(left())
                resp = conn.getresponse()
                if not 200 <= resp.status < 300:
                    raise ControllerError(f"controller answered HTTP {resp.status}")
                chunks = []
                while True:
                    conn.sock.settimeout(left())
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    left()
            finally:
                watchdog.cancel()
                conn.close()
            left()  # a body cut short by the watchdog
            return json.loads(b"".join(chunks))
        except ControllerError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:
            if isinstance(e, (socket.timeout, TimeoutError)) or time.monotonic() >= deadline:
                # a read timed out, or the watchdog cut the socket at the deadline
                raise ControllerError(
                    f"controller call exceeded {self.timeout_s * 1000:g} ms") from None
            raise ControllerError(f"controller call failed: {e!r}") from None

    def _connection(self, ip: str, timeout: float) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self._scheme == "https":
            import ssl

            conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout,
                                               context=ssl.create_default_context())
            conn.connect()  # TLS needs the host name: resolved again by the OS cache
        else:
            conn = http.client.HTTPConnection(ip, self._port, timeout=timeout)
            conn.connect()
        return conn

    def stats(self) -> Dict[str, Any]:
        """``up``, ``polls``, ``calls``, ``failures``, ``last_error``."""
        return {"up": self._up, "polls": self.polls, "calls": self.calls,
                "failures": self.failures, "last_error": self.last_error}

    def close(self) -> None:
        """Stops the polling thread (waits for a call in flight, at most its deadline).
        Idempotent."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(self.timeout_s + 1.0)
        self._resolver.shutdown(wait=False)
