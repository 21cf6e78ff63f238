"""Per-worker circuit breakers and the classification of an attempt's failure.

Used by every front's dispatch stage (`kvroute.serving.proxy`, `kvroute.serving.pd`). Not
locked: a breaker lives on one event loop.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import httpx

from kvroute.serving import defaults as D
from kvroute.serving.health import FirstByteTimeout

__all__ = ["CircuitBreaker", "failure_kind", "retryable"]


class CircuitBreaker:
    """Consecutive-failure circuit breaker of one worker.

    ``closed`` (traffic flows) -> ``open`` after ``failures`` consecutive failures (connect
    errors, timeouts, broken streams, 5xx responses); ``open`` -> ``half_open`` once
    ``reset_s`` seconds have passed; ``half_open`` lets requests through again (the proxy
    ramps the worker's share up with `kvroute.serving.health.RecoveryRamp` from
    `ramp_from`, so a burst right after recovery is served rather than refused): a response
    below 500 closes the circuit, a failure opens it for another ``reset_s``. ``on_dispatch``
    marks the first request sent in half-open state as the probe (`snapshot` shows it).

    Parameters
    ----------
    failures:
        Consecutive failures that open the circuit, >= 1.
    reset_s:
        Seconds an open circuit waits before letting a probe through, >= 0.
    clock:
        Monotonic clock in seconds (tests pass their own).

    Raises
    ------
    ValueError
        ``failures < 1`` or ``reset_s < 0``.
    """

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    def __init__(self, failures: int = D.BREAKER_FAILURES, reset_s: float = D.BREAKER_RESET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
            raise ValueError(f"breaker failures must be an int >= 1, got {failures!r}")
        if not isinstance(reset_s, (int, float)) or reset_s < 0:
            raise ValueError(f"breaker reset_s must be a number >= 0 seconds, got {reset_s!r}")
        self.failures = failures
        self.reset_s = float(reset_s)
        self._clock = clock
        self.consecutive_failures = 0
        self.times_opened = 0
        self._opened_at: Optional[float] = None
        self._probing = False
        self._probe_ticket = 0  # the ticket of the last probe handed out
        self._ramp_from: Optional[float] = None

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"``."""
        if self._opened_at is None:
            return self.CLOSED
        if self._clock() - self._opened_at >= self.reset_s:
            return self.HALF_OPEN
        return self.OPEN

    def available(self) -> bool:
        """True if a request may go to the worker now: closed or half-open."""
        return self.state != self.OPEN

    @property
    def ramp_from(self) -> Optional[float]:
        """Clock time the circuit last turned half-open (the start of its recovery ramp), or
        None if it never opened."""
        return self._ramp_from if self._opened_at is None else self._opened_at + self.reset_s

    def on_dispatch(self) -> int:
        """A request is being sent: in half-open state with no probe in flight it becomes the
        probe.

        Returns
        -------
        int
            A probe ticket (> 0, true) when this request took the probe slot, else 0 (false).
            Pass it to `abandon`.
        """
        if self.state == self.HALF_OPEN and not self._probing:
            self._probing = True
            self._probe_ticket += 1
            return self._probe_ticket
        return 0

    def abandon(self, ticket: int) -> None:
        """The request in flight ended without a verdict (client gone). If it holds the probe
        slot (``ticket`` is the current probe's, from `on_dispatch`), the slot is freed; any
        other request's abandon leaves the probe in flight alone."""
        if ticket and self._probing and ticket == self._probe_ticket:
            self._probing = False

    def record_success(self) -> bool:
        """The worker answered (status < 500). Returns True if this closed an open circuit."""
        was_open = self._opened_at is not None
        if was_open:
            self._ramp_from = self.ramp_from
        self.consecutive_failures = 0
        self._opened_at = None
        self._probing = False
        return was_open

    def record_failure(self) -> bool:
        """The worker failed. Returns True if this opened the circuit (it was closed)."""
        self.consecutive_failures += 1
        self._probing = False
        if self._opened_at is not None:  # a failed probe, or a straggler: wait reset_s again
            self._opened_at = self._clock()
            return False
        if self.consecutive_failures >= self.failures:
            self._opened_at = self._clock()
            self.times_opened += 1
            return True
        return False

    def snapshot(self) -> Dict[str, Any]:
        """``state``, ``consecutive_failures``, ``times_opened``, ``retry_in_s`` (seconds until
        an open circuit lets a probe through; 0 when not open)."""
        retry_in = 0.0
        if self.state == self.OPEN and self._opened_at is not None:
            retry_in = max(0.0, self.reset_s - (self._clock() - self._opened_at))
        return {"state": self.state, "consecutive_failures": self.consecutive_failures,
                "times_opened": self.times_opened, "retry_in_s": round(retry_in, 3)}


def failure_kind(exc: BaseException) -> str:
    """The `kvroute.serving.retry.RETRY_ON` kind of an attempt's failure before its response
    headers: ``connect`` (see `retryable`), ``timeout`` (a first-byte timeout, the worker
    marked down, or httpx's read / write / pool timeout), else ``error`` (never retried)."""
    if isinstance(exc, FirstByteTimeout):
        return "timeout"
    if retryable(exc):
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    return "error"


def retryable(exc: BaseException) -> bool:
    """Errors after which the request is tried on another worker.

    A connect error or connect timeout, and a malformed worker URL (``httpx.InvalidURL``, not
    an ``httpx.HTTPError``): the request never reached the engine. Deliberately also a
    connection that broke before the response headers arrived (RemoteProtocolError /
    ReadError / WriteError while sending or waiting for the headers, e.g. a pooled keep-alive
    connection to a worker that just died): the engine may have received the request and,
    for a non-streaming one, even generated the whole answer before the connection broke, so
    a retry can repeat that work. Generation has no side effects beyond compute, and the
    alternative is failing a request a healthy worker could serve. Timeouts are not retried
    (the engine may still be busy with it)."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                            httpx.ReadError, httpx.WriteError, httpx.InvalidURL))
