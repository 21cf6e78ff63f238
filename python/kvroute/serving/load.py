"""Engine-reported load for the router: vLLM's ORCA response header and a /metrics scraper.

The router counts its own in-flight requests and pending prefill tokens; engines add what
only they know, through `kvroute.Router.update_load`: ``num_requests_waiting`` (the queue)
and ``kv_cache_usage_perc`` in ``[0, 1]``. Two sources, both from vLLM's OpenAI server:

ORCA load report (per response)
    A request carrying ``endpoint-load-metrics-format: TEXT`` (or ``JSON``) gets a response
    header ``endpoint-load-metrics`` with the engine's gauges at that moment
    (``vllm/entrypoints/serve/utils/orca_metrics.py``, older versions
    ``vllm/entrypoints/openai/orca_metrics.py``)::

        endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.4, named_metr...
        endpoint-load-metrics: JSON {"named_metrics": {"kv_cache_usage_perc": 0.4, ...}}

    (the full TEXT form: ``named_metrics.kv_cache_usage_perc=0.4,
    named_metrics.num_requests_waiting=2.0``; JSON: the same names under ``named_metrics``)

    vLLM attaches it only to non-streaming chat / completions responses (a streaming
    response's headers leave before the work is done), so streams need the scraper.

Prometheus scrape (per interval)
    `PrometheusScraper` GETs each worker's ``/metrics`` and reads the vLLM gauges
    ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
    ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before vLLM renamed it),
    labelled ``model_name`` and, per data-parallel engine, ``engine``.

Thread-safety: `parse_orca_header` and `apply_orca` are pure / call the thread-safe router.
A `PrometheusScraper` belongs to one asyncio event loop; call its methods from that loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Union

from kvroute.serving import defaults as D

__all__ = [
    "ORCA_KV_CACHE_USAGE",
    "ORCA_NUM_REQUESTS_WAITING",
    "ORCA_REQUEST_HEADER",
    "ORCA_RESPONSE_HEADER",
    "PrometheusScraper",
    "VLLM_KV_CACHE_USAGE",
    "VLLM_NUM_REQUESTS_RUNNING",
    "VLLM_NUM_REQUESTS_WAITING",
    "apply_orca",
    "orca_request_headers",
    "parse_orca_header",
    "parse_vllm_metrics",
]

log = logging.getLogger(__name__)

#: Request header asking a vLLM server for a load report, and its values.
ORCA_REQUEST_HEADER = "endpoint-load-metrics-format"
ORCA_FORMATS = ("TEXT", "JSON")
#: Response header carrying the report.
ORCA_RESPONSE_HEADER = "endpoint-load-metrics"
#: Keys of `parse_orca_header`'s result for the two gauges vLLM reports (ORCA's flattened
#: ``named_metrics.<name>`` form).
ORCA_KV_CACHE_USAGE = "named_metrics.kv_cache_usage_perc"
ORCA_NUM_REQUESTS_WAITING = "named_metrics.num_requests_waiting"

#: vLLM Prometheus gauges (vllm/v1/metrics/loggers.py).
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
VLLM_GPU_CACHE_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"

_ORCA_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


# --------------------------------------------------------------------------------------------
# ORCA
# --------------------------------------------------------------------------------------------


def orca_request_headers(fmt: str = "TEXT") -> Dict[str, str]:
    """The request header that asks a vLLM server for an ORCA load report.

    Parameters
    ----------
    fmt:
        ``"TEXT"`` or ``"JSON"`` (case-insensitive), the report's format.

    Returns
    -------
    dict
        ``{"endpoint-load-metrics-format": "TEXT"}`` (or ``"JSON"``), to merge into the
        upstream request's headers.

    Raises
    ------
    ValueError
        Any other format.
    """
    if not isinstance(fmt, str) or fmt.upper() not in ORCA_FORMATS:
        raise ValueError(f"ORCA format must be 'TEXT' or 'JSON', got {fmt!r}")
    return {ORCA_REQUEST_HEADER: fmt.upper()}


def _number(key: str, v: Any, value: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"ORCA metric {key!r} must be a number, got {v!r} in {value!r}")
    return float(v)


def parse_orca_header(value: str) -> Dict[str, float]:
    """Parses an ``endpoint-load-metrics`` header value (both ORCA formats).

    Parameters
    ----------
    value:
        ``"TEXT k=v, named_metrics.name=v, ..."`` or ``"JSON {...}"``; the format prefix may
        be missing (some servers omit it): a value starting with ``{`` is read as JSON.

    Returns
    -------
    dict[str, float]
        Flattened ORCA names: top-level fields as they are (``cpu_utilization``), map fields
        as ``<map>.<name>`` (``named_metrics.kv_cache_usage_perc``). A TEXT report with no
        metrics is ``{}``.

    Raises
    ------
    ValueError
        A value that is neither form, with the form expected: ``TEXT key=number, ...`` or
        ``JSON {"named_metrics": {"name": number}}``.
    """
    if not isinstance(value, str):
        raise ValueError(f"ORCA header value must be a string, got {type(value).__name__}")
    raw = value.strip()
    head, _, rest = raw.partition(" ")
    fmt = head.upper()
    if fmt in ORCA_FORMATS:
        body = rest.strip()
    elif raw.startswith("{"):
        fmt, body = "JSON", raw
    else:
        fmt, body = "TEXT", raw
    out: Dict[str, float] = {}
    if fmt == "JSON":
        try:
            doc = json.loads(body)
        except json.JSONDecodeError as e:
            raise ValueError(f'malformed ORCA JSON report {value!r} ({e.msg}): expected '
                             f'JSON {{"named_metrics": {{"name": number}}}}') from None
        if not isinstance(doc, dict):
            raise ValueError(f'malformed ORCA JSON report {value!r}: expected an object like '
                             f'{{"named_metrics": {{"name": number}}}}')
        for k, v in doc.items():
            if isinstance(v, dict):
                for name, x in v.items():
                    out[f"{k}.{name}"] = _number(f"{k}.{name}", x, value)
            else:
                out[k] = _number(k, v, value)
        return out
    if not body:
        return out
    for item in body.split(","):
        key, eq, num = item.strip().partition("=")
        key, num = key.strip(), num.strip()
        if not eq or not _ORCA_KEY.match(key):
            raise ValueError(f"malformed ORCA TEXT report {value!r} at {item.strip()!r}: expected "
                             "TEXT key=number, named_metrics.name=number, ...")
        try:
            out[key] = float(num)
        except ValueError:
            raise ValueError(f"malformed ORCA TEXT report {value!r}: {key} = {num!r} is not a "
                             "number") from None
    return out


def _header(headers: Any, name: str) -> Optional[str]:
    """A header from an httpx / starlette Headers (case-insensitive) or a plain mapping."""
    v = headers.get(name) if hasattr(headers, "get") else None
    if v is None and isinstance(headers, Mapping):
        v = next((val for k, val in headers.items() if str(k).lower() == name), None)
    return v


def apply_orca(router: Any, worker_name: str, headers: Any) -> bool:
    """Feeds an upstream response's ORCA load report to the router.

    Reads ``named_metrics.num_requests_waiting`` and ``named_metrics.kv_cache_usage_perc``
    (vLLM's names) from the ``endpoint-load-metrics`` header and calls
    ``router.update_load(worker_name, ...)`` with those present (usage clamped to
    ``[0, 1]``).

    Parameters
    ----------
    router:
        A `kvroute.Router`.
    worker_name:
        The worker that sent the response (``decision.worker``).
    headers:
        The response headers: ``httpx.Headers``, starlette ``Headers`` or a dict.

    Returns
    -------
    bool
        True if a report was applied; False if there was none, it held neither gauge, or it
        was malformed or out of range (logged at WARNING).

    Raises
    ------
    KeyError
        Unknown worker (from the router).
    """
    value = _header(headers, ORCA_RESPONSE_HEADER)
    if value is None:
        return False
    # Deliberately fail-open: a bad load report from an engine must not fail the request it
    # came with; the router keeps its previous load for the worker.
    try:
        report = parse_orca_header(value)
    except ValueError as e:
        log.warning("ignoring ORCA load report from %s: %s", worker_name, e)
        return False
    waiting = report.get(ORCA_NUM_REQUESTS_WAITING)
    usage = report.get(ORCA_KV_CACHE_USAGE)
    if waiting is None and usage is None:
        return False
    if (waiting is not None and not (math.isfinite(waiting) and waiting >= 0)) or (
            usage is not None and not math.isfinite(usage)):
        log.warning("ignoring ORCA load report from %s: out of range %r", worker_name, value)
        return False
    router.update_load(worker_name, num_requests_waiting=waiting,
                       kv_cache_usage_perc=None if usage is None else min(max(usage, 0.0), 1.0))
    return True


# --------------------------------------------------------------------------------------------
# Prometheus scraper
# --------------------------------------------------------------------------------------------


@dataclass
class _Target:
    url: str
    added: float
    last_ok: Optional[float] = None
    ok: bool = False
    last_error: Optional[str] = None
    scrapes: int = 0
    errors: int = 0
    stale: bool = False
    num_requests_waiting: Optional[float] = None
    num_requests_running: Optional[float] = None
    kv_cache_usage_perc: Optional[float] = None


def parse_vllm_metrics(text: str) -> Dict[str, Optional[float]]:
    """vLLM's load gauges from a ``/metrics`` exposition.

    Parsed with ``prometheus_client.parser.text_string_to_metric_families``. Request counts are
    summed over label sets (one per data-parallel ``engine`` of the server); KV-cache usage is
    the largest over them (the fullest engine), since a sum of fractions means nothing.

    Returns
    -------
    dict
        ``num_requests_waiting``, ``num_requests_running`` (requests), ``kv_cache_usage_perc``
        (fraction in ``[0, 1]``); None for a gauge that is absent.

    Raises
    ------
    ValueError
        Text that is not a Prometheus exposition, or has neither ``vllm:num_requests_waiting``
        nor a KV-cache usage gauge.
    """
    from prometheus_client.parser import text_string_to_metric_families

    sums: Dict[str, float] = {}
    maxes: Dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in (VLLM_NUM_REQUESTS_WAITING, VLLM_NUM_REQUESTS_RUNNING):
                    sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
                elif s.name in (VLLM_KV_CACHE_USAGE, VLLM_GPU_CACHE_USAGE_LEGACY):
                    maxes[s.name] = max(maxes.get(s.name, -math.inf), float(s.value))
    except ValueError as e:
        raise ValueError(f"not a Prometheus text exposition: {e}") from None
    usage = maxes.get(VLLM_KV_CACHE_USAGE, maxes.get(VLLM_GPU_CACHE_USAGE_LEGACY))
    out = {"num_requests_waiting": sums.get(VLLM_NUM_REQUESTS_WAITING),
           "num_requests_running": sums.get(VLLM_NUM_REQUESTS_RUNNING),
           "kv_cache_usage_perc": usage}
    if out["num_requests_waiting"] is None and usage is None:
        raise ValueError(f"no {VLLM_NUM_REQUESTS_WAITING} or {VLLM_KV_CACHE_USAGE} in /metrics")
    for k, v in out.items():
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{k} = {v} out of range in /metrics")
    return out


class PrometheusScraper:
    """Scrapes every worker's vLLM ``/metrics`` on an interval and feeds the router's load.

    Each round GETs all targets concurrently (one shared ``httpx.AsyncClient``), parses the
    text with prometheus-client's parser (`parse_vllm_metrics`) and calls
    ``router.update_load(worker, num_requests_waiting=..., kv_cache_usage_perc=...)``.

    ``num_requests_waiting`` is the queue only: kvroute already counts the requests it sent
    as in flight, and the engine's running requests are mostly those, so adding
    ``vllm:num_requests_running`` would count them twice. Pass ``count_running=True`` when
    other clients also send to the engines directly (the router then sees waiting + running).

    Staleness is bounded and visible: when a worker's last good scrape is older than
    ``stale_after_s`` (or it never had one ``stale_after_s`` after being added), the next
    round calls ``router.clear_load(worker)`` so its last numbers stop steering decisions:
    they steer at most ``stale_after_s + interval_s + timeout_s`` after the engine went
    quiet. `status` shows every worker's age, errors and last values.

    Parameters
    ----------
    router:
        A `kvroute.Router`.
    targets:
        Worker name -> its metrics URL (e.g. ``"http://10.0.0.5:8000/metrics"``).
    interval_s:
        Seconds between the starts of two rounds.
    timeout_s:
        Bound on each GET (connect + read), in seconds.
    stale_after_s:
        Age in seconds of the last good scrape past which the worker's load is cleared.
    client:
        A shared ``httpx.AsyncClient`` (not closed by `aclose`); default: one of our own.
    count_running:
        Report ``waiting + running`` as ``num_requests_waiting`` (see above).

    Raises
    ------
    ValueError
        Non-positive interval / timeout / stale_after_s, a target that is not an http(s) URL.
    """

    def __init__(
        self,
        router: Any,
        targets: Mapping[str, str],
        *,
        interval_s: float = D.SCRAPE_INTERVAL_S,
        timeout_s: float = D.SCRAPE_TIMEOUT_S,
        stale_after_s: float = D.SCRAPE_STALE_AFTER_S,
        client: Any = None,
        count_running: bool = False,
    ) -> None:
        import httpx

        for name, v in (("interval_s", interval_s), ("timeout_s", timeout_s),
                        ("stale_after_s", stale_after_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        self.router = router
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.stale_after_s = float(stale_after_s)
        self.count_running = bool(count_running)
        self._own_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s), follow_redirects=False)
        self._targets: Dict[str, _Target] = {}
        self._task: Optional[asyncio.Task] = None
        self.rounds = 0
        for worker, url in targets.items():
            self.add_target(worker, url)

    # -- targets -----------------------------------------------------------------------------
    def add_target(self, worker: str, url: str) -> None:
        """Scrapes ``url`` for ``worker`` from the next round on (replacing its URL if it was
        a target). Raises ValueError for a URL that is not http(s)."""
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"metrics URL for {worker!r} must be http(s)://..., got {url!r}")
        self._targets[str(worker)] = _Target(url=url, added=time.monotonic())

    def remove_target(self, worker: str) -> None:
        """Stops scraping ``worker`` (its load in the router is left as it is). Raises
        KeyError if it is not a target."""
        if worker not in self._targets:
            raise KeyError(f"{worker!r} is not a scrape target; targets: {list(self._targets)}")
        del self._targets[worker]

    @property
    def targets(self) -> Dict[str, str]:
        """Worker name -> metrics URL."""
        return {w: t.url for w, t in self._targets.items()}

    # -- scraping ----------------------------------------------------------------------------
    async def _scrape(self, worker: str, t: _Target) -> None:
        try:
            resp = await self._client.get(t.url, timeout=self.timeout_s)
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code} from {t.url}")
            values = parse_vllm_metrics(resp.text)
        except Exception as e:  # noqa: BLE001
            # Deliberately any Exception, not only httpx.HTTPError / ValueError: e.g.
            # httpx.InvalidURL for a malformed URL is neither, and one bad target must not
            # end the round for the others (their staleness is handled after it).
            self._fail(t, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            return
        waiting = values["num_requests_waiting"]
        running = values["num_requests_running"]
        usage = values["kv_cache_usage_perc"]
        if self.count_running and waiting is not None:
            waiting += running or 0.0
        if worker not in self._targets or self._targets[worker] is not t:
            return  # removed or replaced while the GET was in flight
        try:
            self.router.update_load(worker, num_requests_waiting=waiting,
                                    kv_cache_usage_perc=None if usage is None else min(usage, 1.0))
        except (KeyError, ValueError) as e:  # worker left the router, or a value it refuses
            self._fail(t, f"router refused the load: {e}")
            return
        t.ok, t.last_ok, t.last_error, t.stale = True, time.monotonic(), None, False
        t.scrapes += 1
        t.num_requests_waiting = values["num_requests_waiting"]
        t.num_requests_running = running
        t.kv_cache_usage_perc = usage

    @staticmethod
    def _fail(t: _Target, error: str) -> None:
        t.ok, t.last_error = False, error
        t.scrapes += 1
        t.errors += 1

    def _expire(self, now: float) -> None:
        for worker, t in self._targets.items():
            since = t.last_ok if t.last_ok is not None else t.added
            if not t.stale and now - since > self.stale_after_s:
                t.stale = True
                try:
                    self.router.clear_load(worker)
                except KeyError:
                    pass  # the worker left the router; nothing to forget
                log.warning("load of %s is stale (no good scrape of %s for %.1f s): cleared",
                            worker, t.url, now - since)

    async def scrape_once(self) -> None:
        """One round: scrapes every target concurrently, then clears the load of workers whose
        last good scrape is older than ``stale_after_s``. Never raises for a target's
        failure (it is recorded in `status`)."""
        items = list(self._targets.items())
        results = await asyncio.gather(*(self._scrape(w, t) for w, t in items),
                                       return_exceptions=True)
        for (worker, t), r in zip(items, results):
            if isinstance(r, BaseException):  # _scrape records its errors; this is a bug
                log.error("scraping %s failed: %r", worker, r)
                self._fail(t, f"{type(r).__name__}: {r}")
        self._expire(time.monotonic())
        self.rounds += 1

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            try:
                await self.scrape_once()
            except Exception:  # noqa: BLE001 - keep scraping whatever one round hit
                log.exception("metrics scrape round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - start)))

    def start(self) -> asyncio.Task:
        """Starts scraping every ``interval_s`` on the running event loop (the first round
        at once). Idempotent; returns the task. Raises RuntimeError outside a running loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="kvroute-metrics-scraper")
        return self._task

    @property
    def running(self) -> bool:
        """Whether the scrape loop is running."""
        return self._task is not None and not self._task.done()

    async def aclose(self) -> None:
        """Stops the loop and closes the HTTP client if it is ours. Idempotent. The router
        keeps the last loads (call ``router.clear_load`` to forget them)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Waits for the task without taking on its CancelledError: a cancellation of the
            # caller itself still propagates.
            await asyncio.wait({task})
        if self._own_client:
            await self._client.aclose()

    async def __aenter__(self) -> PrometheusScraper:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def status(self) -> Dict[str, Dict[str, Union[float, bool, str, None, int]]]:
        """Per worker: ``url``; ``age_s`` (seconds since its last good scrape, None before
        the first); ``ok`` (the last scrape was good); ``stale`` (its load was cleared for
        age); ``last_error``; ``scrapes`` / ``errors`` (counts); and the last good values
        ``num_requests_waiting``, ``num_requests_running`` (requests),
        ``kv_cache_usage_perc`` (fraction)."""
        now = time.monotonic()
        return {w: {"url": t.url,
                    "age_s": None if t.last_ok is None else now - t.last_ok,
                    "ok": t.ok, "stale": t.stale, "last_error": t.last_error,
                    "scrapes": t.scrapes, "errors": t.errors,
                    "num_requests_waiting": t.num_requests_waiting,
                    "num_requests_running": t.num_requests_running,
                    "kv_cache_usage_perc": t.kv_cache_usage_perc}
                for w, t in self._targets.items()}
