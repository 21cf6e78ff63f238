"""Helpers the tests import: what CI always has (`require`, `require_executable`,
`require_file`), polling, free loopback ports, a uvicorn server in a thread, engine stand-in
processes, the slow-joiner guard for KV-event publishers.

Fixtures live in conftest.py; this module holds plain functions and classes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Sequence

import pytest

# -- what CI always has -------------------------------------------------------------------------
# A test skips only for an optional dependency CI does not install. CI runs scripts/setup.sh
# (the test extra: every optional Python dependency; redis-server, nats-server, cmake, g++)
# with the shared data beside the checkout, so a missing one of those is a broken environment:
# these fail, saying what to install, instead of skipping.

SETUP_HINT = "scripts/setup.sh installs it (pip install -e '.[test]' for Python packages)"


def require(module: str) -> Any:
    """``import module`` (a package of the test extra), or fail saying how to install it.
    At module level a failure is a collection error of that test file."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} is not importable ({e}); {SETUP_HINT}", pytrace=False)


def require_executable(name: str) -> str:
    """The path of program ``name`` on PATH, or fail saying how to install it."""
    exe = shutil.which(name)
    if exe is None:
        pytest.fail(f"{name} is not on PATH; {SETUP_HINT}", pytrace=False)
    return exe


def require_file(path: Path, what: str) -> Path:
    """``path`` if it is a file, else fail: ``what`` is missing from the shared data
    ($KVROUTE_SHARED_DATA, else ../shared/data beside the checkout, as in CI)."""
    if not path.is_file():
        pytest.fail(f"{what} not found: {path} is missing (the shared data is "
                    "$KVROUTE_SHARED_DATA, else shared/data beside the checkout)", pytrace=False)
    return path


TIMEOUT = 30.0  # default bound on every poll, in seconds: generous for a loaded 2-core machine


def _timed_out(what: str, timeout: float, info: Optional[Callable[[], object]]) -> AssertionError:
    return AssertionError(f"timed out after {timeout} s waiting for {what}"
                          + (f"\n{info()}" if info else ""))


def wait_for(cond: Callable[[], Any], what: str = "condition", timeout: float = TIMEOUT, *,
             interval: float = 0.01, info: Optional[Callable[[], object]] = None) -> Any:
    """Calls ``cond`` every ``interval`` seconds until it returns something truthy, and
    returns that value. ``cond`` is asked once more at the deadline; if it is still falsy,
    raises AssertionError naming ``what`` (plus ``info()``, if given)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    value = cond()
    if value:
        return value
    raise _timed_out(what, timeout, info)


async def await_for(cond: Callable[[], Any], what: str = "condition", timeout: float = TIMEOUT,
                    *, interval: float = 0.01) -> Any:
    """`wait_for` for coroutines: sleeps with ``asyncio.sleep``, so the event loop runs its
    other tasks (callbacks, streams) between the calls to ``cond``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        await asyncio.sleep(interval)
    value = cond()
    if value:
        return value
    raise _timed_out(what, timeout, None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (the OS's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toks(n: int, off: int = 0) -> List[int]:
    """``n`` consecutive token ids starting at ``off``."""
    return list(range(off, off + n))


class UvicornThread:
    """An ASGI app served by uvicorn on 127.0.0.1 in a daemon thread.

    ``port=None`` takes a free port. ``start=False`` leaves the start to the caller (and lets
    it change ``port``/``url`` first, e.g. to come back on a port a stopped server held).
    `stop` is idempotent.
    """

    def __init__(self, app: Any, port: Optional[int] = None, *, start: bool = True) -> None:
        self.app = app
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: Any = None
        self.thread: Optional[threading.Thread] = None
        if start:
            self.start()

    def start(self) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="error",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), "uvicorn to start")
        assert self.server.started, f"uvicorn failed to start on {self.url}"

    def stop(self) -> None:
        if self.server is not None and not self.server.should_exit:
            self.server.should_exit = True
            self.thread.join(timeout=TIMEOUT)


# -- engine stand-ins (kvroute.sim.server subprocesses) ----------------------------------------

@contextlib.contextmanager
def standin_engines(n: int, tokenizer_dir: Any, **kw: Any) -> Iterator[list]:
    """``n`` `kvroute.sim.server.EngineServerProcess` engines (keyword arguments as its
    constructor), started in parallel; on exit each is killed (SIGKILL: an engine may still
    be generating an abandoned answer) and its log removed."""
    from kvroute.sim.server import EngineServerProcess

    engines = [EngineServerProcess(tokenizer_dir=tokenizer_dir, **kw) for _ in range(n)]
    try:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda e: e.start(timeout=60), engines))
        yield engines
    finally:
        for e in engines:
            e.kill()
            with contextlib.suppress(OSError):
                os.unlink(e.log_path)


def standin_stats(engine: Any) -> dict:
    """``GET /standin/stats`` of a stand-in engine (anything with a ``url``)."""
    import httpx

    return httpx.get(f"{engine.url}/standin/stats", timeout=TIMEOUT).json()


def wait_subscribed(engines: Sequence[Any], before: Optional[Sequence[int]] = None) -> None:
    """Until every engine's KV-event PUB socket has seen a subscription beyond ``before``
    (its ``kv_subscriptions`` count earlier; default 0). ZeroMQ drops what a PUB socket sends
    before a subscriber joins (the slow joiner)."""
    before = before if before is not None else [0] * len(engines)
    for e, n in zip(engines, before):
        wait_for(lambda e=e, n=n: standin_stats(e)["kv_subscriptions"] > n,
                 f"{e.url} to see the router's subscription", interval=0.02)


# -- KV-event publishers -----------------------------------------------------------------------

def await_first_batch(router: Any, name: str, send_empty: Callable[[], Any],
                      timeout: float = 5.0) -> None:
    """Slow-joiner guard: calls ``send_empty`` (publish an empty batch) every 20 ms until
    the router has received a batch for worker ``name``."""
    def seen() -> bool:
        return router.stats()["workers"][name]["batches"] > 0
    end = time.monotonic() + timeout
    while not seen() and time.monotonic() < end:
        send_empty()
        time.sleep(0.02)
    assert seen(), f"{name} never received a batch"


def stop_process(proc: Any) -> str:
    """SIGINT to a server process started with stderr piped, then its stderr (text); killed
    when it does not exit within `TIMEOUT`."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return (err or b"").decode(errors="replace")
