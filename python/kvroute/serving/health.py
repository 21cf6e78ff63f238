"""Worker availability: active health checks, the recovery ramp, the first-byte guard.

`HealthChecker` runs the vLLM router's ``health_check`` section (vllm-project/router
``src/config/types.rs`` ``HealthCheckConfig``: ``failure_threshold`` 3, ``success_threshold``
2, ``timeout_secs`` 5, ``check_interval_secs`` 60, ``endpoint`` ``/health``; SGLang's gateway
has the same five settings). Each worker URL is probed with ``GET <url><endpoint>`` bounded by
``timeout_s``; a 2xx answer is a success, anything else (error status, timeout, refused
connection) a failure. ``failure_threshold`` consecutive failures mark the URL unhealthy:
`kvroute.serving.proxy.Proxy` then routes around every worker at that URL (each
data-parallel rank), ``GET /health`` does not count them, and requests still waiting for
their first byte from it are abandoned and retried elsewhere (`first_byte`);
``success_threshold`` consecutive successes mark it healthy again. Workers start healthy.

Timing. A URL is probed every ``check_interval_s``. After a failed probe the next one follows
``confirm_interval_s`` later (default ``min(1, check_interval_s / failure_threshold)``)
instead of a whole interval (also while an unhealthy URL collects its successes), so a
failing or hung engine (SIGSTOP: connections are accepted
by the kernel, nothing answers) is out ``(failure_threshold - 1) * (confirm_interval_s +
timeout_s)`` after its first failed probe, and at most ``check_interval_s`` plus that after
it stopped answering. A request that failed to connect, waited past its first-byte
timeout, or has waited ``timeout_s`` for its response headers asks for a probe of that URL at
once (`poke`), so with traffic a hang is noticed ``timeout_s`` after it began, not at the
next periodic probe: out after ``timeout_s + (failure_threshold - 1) * confirm_interval_s +
failure_threshold * timeout_s`` (22 s with the vLLM router's defaults, inside its 60 s
interval). Probes of different URLs run concurrently and independently: a
hung engine never delays the checks of the others.

`RecoveryRamp`: a worker that comes back (health check healthy again, circuit half-open or
closed again) gets a share of the requests that it would otherwise be chosen for that grows
linearly from ``min_share`` to 1 over ``ramp_s`` seconds: a burst right after recovery is
served (when every worker is ramping none is held back), and a
single recovered engine among healthy ones is not flooded at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
import time
from typing import Any, Awaitable, Callable, Dict, Iterable, Mapping, Optional, Set, Tuple, TypeVar

import httpx

from kvroute.serving import defaults as D

__all__ = ["FirstByteTimeout", "HealthChecker", "HEALTH_CHECK_DEFAULTS", "RecoveryRamp",
           "first_byte", "first_byte_timeout", "guard_first_byte", "recovered_at"]

#: The vLLM router's ``HealthCheckConfig::default()`` (seconds for the ``*_s`` keys).
HEALTH_CHECK_DEFAULTS: Dict[str, Any] = {
    "failure_threshold": 3, "success_threshold": 2, "timeout_s": 5.0,
    "check_interval_s": 60.0, "endpoint": "/health",
}

T = TypeVar("T")


class HealthChecker:
    """Probes every worker URL's health endpoint on asyncio tasks.

    Parameters
    ----------
    urls:
        A callable returning the current worker URLs (workers may be added and removed).
    client:
        The ``httpx.AsyncClient`` to send with (not closed here).
    failure_threshold, success_threshold:
        Consecutive failures / successes that flip a URL's state, ints >= 1.
    timeout_s, check_interval_s:
        Bound of one probe and the period, seconds > 0.
    endpoint:
        Path appended to the worker URL, starting with ``/``.
    confirm_interval_s:
        Delay of the next probe after a failed one, seconds > 0; default
        ``min(1, check_interval_s / failure_threshold)``.
    on_change:
        ``(url, healthy) -> None``, called when a URL flips.

    Raises
    ------
    ValueError
        A bad threshold, period or endpoint.
    """

    def __init__(self, urls: Callable[[], Iterable[str]], client: httpx.AsyncClient, *,
                 failure_threshold: int = D.HEALTH_FAILURE_THRESHOLD,
                 success_threshold: int = D.HEALTH_SUCCESS_THRESHOLD,
                 timeout_s: float = D.HEALTH_TIMEOUT_S,
                 check_interval_s: float = D.HEALTH_CHECK_INTERVAL_S,
                 endpoint: str = D.HEALTH_ENDPOINT, confirm_interval_s: Optional[float] = None,
                 on_change: Optional[Callable[[str, bool], None]] = None) -> None:
        for name, v in (("failure_threshold", failure_threshold),
                        ("success_threshold", success_threshold)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"health_check {name} must be an int >= 1, got {v!r}")
        for name, f in (("timeout_s", timeout_s), ("check_interval_s", check_interval_s),
                        ("confirm_interval_s", confirm_interval_s)):
            if name == "confirm_interval_s" and f is None:
                continue
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
        self.confirm_interval_s = float(confirm_interval_s) if confirm_interval_s is not None \
            else min(1.0, self.check_interval_s / failure_threshold)
        self.endpoint = endpoint
        self.on_change = on_change
        self._unhealthy: Set[str] = set()
        self._streak: Dict[str, int] = {}  # > 0: successes in a row, < 0: failures in a row
        self._due: Dict[str, float] = {}  # url -> monotonic time of its next probe
        self._probing: Set[str] = set()
        self._down: Dict[str, asyncio.Event] = {}
        self.changed_at: Dict[str, float] = {}  # url -> monotonic time it last flipped
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task[None]] = None
        self._probes: Set[asyncio.Task[None]] = set()

    def healthy(self, url: str) -> bool:
        """False while ``url`` is marked unhealthy."""
        return url not in self._unhealthy

    def status(self) -> Dict[str, Dict[str, Any]]:
        """Per URL: ``healthy`` and the current ``streak`` (+successes / -failures)."""
        return {u: {"healthy": u not in self._unhealthy, "streak": s}
                for u, s in self._streak.items()}

    def down_event(self, url: str) -> asyncio.Event:
        """An event set while ``url`` is unhealthy (a fresh, clear one after it recovers):
        `first_byte` abandons a request waiting on a URL that goes down."""
        ev = self._down.get(url)
        if ev is None:
            ev = self._down[url] = asyncio.Event()
            if url in self._unhealthy:
                ev.set()
        return ev

    def retry_after_s(self) -> float:
        """Seconds until an unhealthy URL can be healthy again at the earliest (its
        ``success_threshold`` probes, ``confirm_interval_s`` apart): a 503's
        ``Retry-After``."""
        return self.confirm_interval_s * self.success_threshold

    def poke(self, url: str) -> None:
        """Probe ``url`` now (a request failed to connect to it or timed out waiting)."""
        self._due[url] = 0.0
        if self._wake is not None:
            self._wake.set()

    def record(self, url: str, ok: bool) -> None:
        """Apply one probe result to ``url``'s streak and state."""
        s = self._streak.get(url, 0)
        s = (s + 1 if s > 0 else 1) if ok else (s - 1 if s < 0 else -1)
        self._streak[url] = s
        if not ok and -s >= self.failure_threshold and url not in self._unhealthy:
            self._unhealthy.add(url)
            self.changed_at[url] = time.monotonic()
            ev = self._down.get(url)
            if ev is not None:
                ev.set()
            if self.on_change is not None:
                self.on_change(url, False)
        elif ok and s >= self.success_threshold and url in self._unhealthy:
            self._unhealthy.discard(url)
            self.changed_at[url] = time.monotonic()
            self._down.pop(url, None)  # waiters of the old event already left
            if self.on_change is not None:
                self.on_change(url, True)

    def _forget_removed(self, urls: Set[str]) -> None:
        for u in set(self._streak) - urls:
            del self._streak[u]
            self._unhealthy.discard(u)
            self._down.pop(u, None)
            self.changed_at.pop(u, None)
        for u in set(self._due) - urls:
            del self._due[u]

    async def check_once(self) -> None:
        """Probes every URL once, concurrently, and applies the results."""
        urls = sorted(set(self._urls()))
        results = await asyncio.gather(*(self._probe(u) for u in urls))
        for u, ok in zip(urls, results):
            self.record(u, ok)
        self._forget_removed(set(urls))

    async def _probe(self, url: str) -> bool:
        try:
            r = await asyncio.wait_for(
                self._client.get(url.rstrip("/") + self.endpoint, timeout=self.timeout_s),
                self.timeout_s)
            return 200 <= r.status_code < 300
        except (httpx.HTTPError, OSError, asyncio.TimeoutError):
            return False

    async def _probe_and_record(self, url: str) -> None:
        try:
            ok = await self._probe(url)
            if url in self._due:  # not removed meanwhile
                self.record(url, ok)
                # Failing, or unhealthy and coming back: confirm quickly.
                steady = ok and url not in self._unhealthy
                self._due[url] = time.monotonic() + (
                    self.check_interval_s if steady else self.confirm_interval_s)
        finally:
            self._probing.discard(url)
            if self._wake is not None:
                self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            urls = set(self._urls())
            self._forget_removed(urls)
            now = time.monotonic()
            for u in urls:
                self._due.setdefault(u, now)
                if self._due[u] <= now and u not in self._probing:
                    self._probing.add(u)
                    self._due[u] = math.inf  # set when the probe ends
                    t = asyncio.get_running_loop().create_task(self._probe_and_record(u))
                    self._probes.add(t)
                    t.add_done_callback(self._probes.discard)
            nxt = min((d for d in self._due.values()), default=now + self.check_interval_s)
            # Re-read the URL list at least once an interval (workers added at run time).
            wait = max(0.0, min(nxt, now + self.check_interval_s) - time.monotonic())
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    def start(self) -> None:
        """Starts probing on the running loop. Idempotent."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                 name="kvroute-health-check")

    async def aclose(self) -> None:
        """Stops probing. Idempotent."""
        task, self._task = self._task, None
        tasks = [t for t in (task, *self._probes) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._probes.clear()
        self._probing.clear()


class RecoveryRamp:
    """The share of traffic a recovered worker gets, growing linearly over ``ramp_s``.

    Parameters
    ----------
    ramp_s:
        Seconds from recovery to a full share, >= 0 (0: no ramp).
    min_share:
        The share right at recovery, in (0, 1].
    clock, rng:
        Monotonic clock in seconds and a uniform [0, 1) source (tests pass their own).

    Raises
    ------
    ValueError
        Values out of range.
    """

    def __init__(self, ramp_s: float = D.RECOVERY_RAMP_S,
                 min_share: float = D.RECOVERY_MIN_SHARE,
                 clock: Callable[[], float] = time.monotonic,
                 rng: Callable[[], float] = random.random) -> None:
        if isinstance(ramp_s, bool) or not isinstance(ramp_s, (int, float)) or ramp_s < 0:
            raise ValueError(f"recovery_ramp_s must be a number of seconds >= 0, got {ramp_s!r}")
        if not isinstance(min_share, (int, float)) or not 0.0 < min_share <= 1.0:
            raise ValueError(f"recovery min_share must be in (0, 1], got {min_share!r}")
        self.ramp_s = float(ramp_s)
        self.min_share = float(min_share)
        self._clock = clock
        self._rng = rng

    def share(self, since: Optional[float]) -> float:
        """The share of a worker that recovered at monotonic time ``since`` (None: never
        down, 1.0)."""
        if since is None or self.ramp_s == 0.0:
            return 1.0
        t = self._clock() - since
        if t >= self.ramp_s:
            return 1.0
        return self.min_share + (1.0 - self.min_share) * max(0.0, t) / self.ramp_s

    def held_back(self, since: Optional[float]) -> bool:
        """True if this request should not go to a worker that recovered at ``since``
        (drawn with probability ``1 - share``)."""
        s = self.share(since)
        return s < 1.0 and self._rng() >= s

    def hold_back(self, since: Mapping[str, Optional[float]], exclude: Set[str]) -> Set[str]:
        """The workers to leave out of this request's choice: each of ``since`` (worker name
        -> the time it recovered, `recovered_at`) outside ``exclude`` drawn with
        `held_back`; none when that would leave every worker of ``since`` out."""
        held = {n for n, t in since.items() if n not in exclude and self.held_back(t)}
        return held if set(since) - exclude - held else set()


def recovered_at(circuit_since: Optional[float], health: Optional[HealthChecker],
                 url: str) -> Optional[float]:
    """Monotonic time a worker last came back: the later of ``circuit_since`` (its circuit
    breaker's ``ramp_from``) and the time ``health`` marked ``url`` healthy again (while it is
    healthy); None if it never went down (a `RecoveryRamp` share of 1)."""
    times = [circuit_since]
    if health is not None and health.healthy(url):
        times.append(health.changed_at.get(url))
    return max((t for t in times if t is not None), default=None)


async def stop_checks(health: Optional[HealthChecker], *tasks: Optional[asyncio.Task]) -> None:
    """Stops a front's background checks: closes ``health`` and cancels each of ``tasks``
    (e.g. the ``max_model_len`` learner of `limits.learn_max_model_len`), waiting for each to
    end; None entries are skipped. Exceptions of the cancelled tasks are not raised."""
    if health is not None:
        await health.aclose()
    for task in tasks:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class FirstByteTimeout(Exception):
    """No response headers within the first-byte timeout, or the worker was marked down
    while the request waited. ``reason``: ``"timeout"`` or ``"down"``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def first_byte_timeout(value: Any) -> Optional[float]:
    """A ``first_byte_timeout_s`` option as float seconds, or None (no bound). Raises
    ValueError unless it is a number > 0 or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"first_byte_timeout_s must be a number of seconds > 0 or None, got "
                         f"{value!r}")
    return float(value)


async def first_byte(send: Awaitable[T], timeout_s: Optional[float],
                     down: Optional[asyncio.Event] = None,
                     slow: Optional[Tuple[float, Callable[[], None]]] = None) -> T:
    """Awaits ``send`` (an upstream request that returns once its response headers arrived)
    for at most ``timeout_s`` seconds (None: no bound) and only while ``down`` is not set.
    ``slow``: ``(seconds, callback)``, the callback is called once if the headers take longer
    (the proxy asks for a health probe of the worker then).

    Raises
    ------
    FirstByteTimeout
        The bound passed or ``down`` was set first; ``send`` is cancelled (its connection
        is closed, so the engine aborts the request).
    """
    task = asyncio.ensure_future(send)
    if slow is not None:
        timer = asyncio.get_running_loop().call_later(slow[0], slow[1])
        task.add_done_callback(lambda _: timer.cancel())
    waiters = {task}
    down_task: Optional[asyncio.Future[Any]] = None
    if down is not None:
        if down.is_set():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise FirstByteTimeout("down", "the worker was marked unhealthy")
        down_task = asyncio.ensure_future(down.wait())
        waiters.add(down_task)
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        if down_task is not None:
            down_task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise
    if down_task is not None:
        down_task.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if task.done() and not task.cancelled() and task.exception() is None:
        # It finished in the same instant: the response is real; close it, it will not be read.
        resp = task.result()
        aclose = getattr(resp, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
    if down_task is not None and down_task in done:
        raise FirstByteTimeout("down", "the worker was marked unhealthy while the request "
                                       "waited for its first byte")
    raise FirstByteTimeout("timeout", f"no response within the first-byte timeout "
                                      f"({timeout_s:g} s)")


async def guard_first_byte(send: Awaitable[T], timeout_s: Optional[float],
                           health: Optional[HealthChecker], url: str) -> T:
    """`first_byte` for a request to the worker at ``url``: bounded by ``timeout_s`` (None:
    no bound) and, with a ``health`` checker, abandoned when ``url`` is marked unhealthy
    meanwhile; a wait as long as a health probe may take asks for a probe of ``url`` (a hang
    shows). Raises FirstByteTimeout."""
    if health is None:
        if timeout_s is None:
            return await send
        return await first_byte(send, timeout_s)
    return await first_byte(send, timeout_s, health.down_event(url),
                            (health.timeout_s, functools.partial(health.poke, url)))
