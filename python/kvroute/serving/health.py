"""Active worker health checks: the vLLM router's ``health_check`` section
(vllm-project/router ``src/config/types.rs`` ``HealthCheckConfig``).

Every ``check_interval_s`` seconds each worker URL gets ``GET <url><endpoint>`` bounded by
``timeout_s``; an answer with a 2xx status is a success, anything else (error status,
timeout, refused connection) a failure. ``failure_threshold`` consecutive failures mark the
URL unhealthy: `kvroute.serving.proxy.Proxy` then routes around every worker at that URL
(each data-parallel rank) and ``GET /health`` does not count them; ``success_threshold``
consecutive successes mark it healthy again. Workers start healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Callable, Dict, Iterable, Optional, Set

import httpx

__all__ = ["HealthChecker", "HEALTH_CHECK_DEFAULTS"]

#: The vLLM router's ``HealthCheckConfig::default()`` (seconds for the ``*_s`` keys).
HEALTH_CHECK_DEFAULTS: Dict[str, Any] = {
    "failure_threshold": 3, "success_threshold": 2, "timeout_s": 5.0,
    "check_interval_s": 60.0, "endpoint": "/health",
}


class HealthChecker:
    """Polls every worker URL's health endpoint on an asyncio task.

    Parameters
    ----------
    urls:
        A callable returning the current worker URLs (workers may be added and removed).
    client:
        The ``httpx.AsyncClient`` to send with (not closed here).
    failure_threshold, success_threshold:
        Consecutive failures / successes that flip a URL's state, ints >= 1.
    timeout_s, check_interval_s:
        Bound of one check and the period, seconds > 0.
    endpoint:
        Path appended to the worker URL, starting with ``/``.

    Raises
    ------
    ValueError
        A bad threshold, period or endpoint.
    """

    def __init__(self, urls: Callable[[], Iterable[str]], client: httpx.AsyncClient, *,
                 failure_threshold: int = 3, success_threshold: int = 2,
                 timeout_s: float = 5.0, check_interval_s: float = 60.0,
                 endpoint: str = "/health") -> None:
        for name, v in (("failure_threshold", failure_threshold),
                        ("success_threshold", success_threshold)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"health_check {name} must be an int >= 1, got {v!r}")
        for name, f in (("timeout_s", timeout_s), ("check_interval_s", check_interval_s)):
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
                raise ValueError(f"health_check {name} must be a number of seconds > 0, "
                                 f"got {f!r}")
        if not isinstance(endpoint, str) or not endpoint.startswith("/"):
            raise ValueError(f"health_check endpoint must be a path starting with '/', "
                             f"got {endpoint!r}")
        self._urls = urls
        self._client = client
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.timeout_s = float(timeout_s)
        self.check_interval_s = float(check_interval_s)
        self.endpoint = endpoint
        self._unhealthy: Set[str] = set()
        self._streak: Dict[str, int] = {}  # > 0: successes in a row, < 0: failures in a row
        self._task: Optional[asyncio.Task[None]] = None

    def healthy(self, url: str) -> bool:
        """False while ``url`` is marked unhealthy."""
        return url not in self._unhealthy

    def status(self) -> Dict[str, Dict[str, Any]]:
        """Per URL: ``healthy`` and the current ``streak`` (+successes / -failures)."""
        return {u: {"healthy": u not in self._unhealthy, "streak": s}
                for u, s in self._streak.items()}

    async def check_once(self) -> None:
        """Checks every URL once, concurrently."""
        urls = sorted(set(self._urls()))
        results = await asyncio.gather(*(self._probe(u) for u in urls))
        for u, ok in zip(urls, results):
            s = self._streak.get(u, 0)
            s = (s + 1 if s > 0 else 1) if ok else (s - 1 if s < 0 else -1)
            self._streak[u] = s
            if not ok and -s >= self.failure_threshold:
                self._unhealthy.add(u)
            elif ok and s >= self.success_threshold:
                self._unhealthy.discard(u)
        for u in set(self._streak) - set(urls):  # removed workers
            del self._streak[u]
            self._unhealthy.discard(u)

    async def _probe(self, url: str) -> bool:
        try:
            r = await self._client.get(url.rstrip("/") + self.endpoint, timeout=self.timeout_s)
            return 200 <= r.status_code < 300
        except (httpx.HTTPError, OSError):
            return False

    async def _run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.check_interval_s)

    def start(self) -> None:
        """Starts the polling task on the running loop. Idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                 name="kvroute-health-check")

    async def aclose(self) -> None:
        """Stops the polling task. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
