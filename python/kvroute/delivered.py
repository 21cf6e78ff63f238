"""Predicted vs delivered prefix reuse: what the router expected a request to reuse, and what
the engine says it reused.

Three numbers per request, in prompt tokens:

* **available**: the best prefix match any worker held when the decision was made
  (`kvroute.Decision.available_tokens`): what the fleet could have reused;
* **captured**: the chosen worker's match at decision time (``Decision.matched_tokens``):
  what the router expected the engine to reuse;
* **delivered**: the engine's own count of prompt tokens served from its prefix cache, read
  from the response.

Where the delivered count comes from (checked in the engines' sources):

=========  ==============================================================================
vLLM       ``usage.prompt_tokens_details.cached_tokens`` (``PromptTokenUsageInfo``), only
           with ``--enable-prompt-tokens-details``; in a stream, in the last chunk
           (``choices: []``) when the request asks ``stream_options: {"include_usage":
           true}`` (``continuous_usage_stats`` adds ``usage`` to every chunk, without the
           details). vLLM writes the details only when the count is non-zero
           (``chat_completion/serving.py``, ``completion/serving.py``: ``if
           self.enable_prompt_tokens_details and num_cached_tokens``).
SGLang     the same ``usage.prompt_tokens_details.cached_tokens`` with
           ``--enable-cache-report`` (``entrypoints/openai/usage_processor.py``, also only
           when > 0: ``_details_if_cached``); its native ``/generate`` answers
           ``meta_info.cached_tokens`` (every chunk of a stream carries ``meta_info``).
=========  ==============================================================================

Because both engines leave the details out when nothing was cached, a response that carries
``usage`` but no count is read as 0 cached tokens once the same worker has reported a count
before, and as unreported otherwise (the engine may not have the option on).

`HitRateTracker` (one per `kvroute.Router`, fed by `kvroute.Router.report_delivered`) sums the
three numbers, keeps per worker a histogram of the prediction error ``(captured - delivered)
/ prompt_tokens`` and warns when captured and delivered stay apart, naming the likely cause.

Thread-safety: `HitRateTracker` methods may be called from any thread (one lock).
`UsageScanner` is per response (not shared).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple, Union

__all__ = [
    "ERROR_BUCKETS",
    "DeliveredReport",
    "HitRateTracker",
    "Usage",
    "UsageScanner",
    "parse_usage",
    "usage_from_body",
]

log = logging.getLogger("kvroute.delivered")

#: Upper bounds of the prediction-error histogram, ``(captured - delivered) / prompt_tokens``:
#: negative when the engine reused more than the router expected, positive when less.
ERROR_BUCKETS = (-1.0, -0.5, -0.25, -0.1, -0.02, 0.02, 0.1, 0.25, 0.5, 1.0)

# Longest SSE line a scanner keeps while waiting for its end (a usage chunk is ~300 bytes;
# content chunks are skipped without parsing).
_MAX_LINE = 1 << 20


@dataclass(frozen=True)
class Usage:
    """What a response said about its prompt.

    Attributes
    ----------
    cached_tokens:
        Prompt tokens the engine served from its prefix cache, or ``None`` when the response
        carried no count.
    prompt_tokens:
        The engine's prompt length in tokens (``usage.prompt_tokens`` /
        ``meta_info.prompt_tokens``), or ``None``.
    """

    cached_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None

    @property
    def seen(self) -> bool:
        """Whether the response carried a usage block at all."""
        return self.cached_tokens is not None or self.prompt_tokens is not None


def _nonneg_int(v: Any) -> Optional[int]:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
        return None
    return int(v)


def parse_usage(obj: Any) -> Usage:
    """The `Usage` of one decoded JSON response or stream chunk.

    Reads ``usage.prompt_tokens_details.cached_tokens`` and ``usage.prompt_tokens`` (vLLM and
    SGLang OpenAI routes), else ``meta_info.cached_tokens`` / ``meta_info.prompt_tokens``
    (SGLang ``/generate``; a list of such objects, one per prompt, is summed over none: the
    first is read). Anything else (no usage, ``usage: null``, malformed values) gives an
    empty `Usage`; never raises."""
    if isinstance(obj, list) and obj:
        obj = obj[0]
    if not isinstance(obj, Mapping):
        return Usage()
    usage = obj.get("usage")
    if isinstance(usage, Mapping):
        details = usage.get("prompt_tokens_details")
        cached = _nonneg_int(details.get("cached_tokens")) if isinstance(details, Mapping) \
            else None
        return Usage(cached, _nonneg_int(usage.get("prompt_tokens")))
    meta = obj.get("meta_info")
    if isinstance(meta, Mapping):
        return Usage(_nonneg_int(meta.get("cached_tokens")),
                     _nonneg_int(meta.get("prompt_tokens")))
    return Usage()


def usage_from_body(body: Union[bytes, str]) -> Usage:
    """The `Usage` of a complete non-streaming JSON body (empty when it is not JSON)."""
    try:
        return parse_usage(json.loads(body))
    except (ValueError, UnicodeDecodeError):
        return Usage()


class UsageScanner:
    """Reads the usage of an SSE stream as its raw chunks go by (``feed``), without holding
    the stream: only the unfinished last line is buffered, and only ``data:`` lines that
    mention ``usage`` or ``meta_info`` are decoded. The last usage seen wins (vLLM's final
    ``include_usage`` chunk; SGLang's last ``meta_info``)."""

    __slots__ = ("_tail", "usage")

    def __init__(self) -> None:
        self._tail = b""
        self.usage = Usage()

    def feed(self, chunk: bytes) -> None:
        """One raw chunk of the stream, as it arrived (any split)."""
        if not chunk:
            return
        data = self._tail + chunk if self._tail else chunk
        lines = data.split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > _MAX_LINE:
            self._tail = b""  # a huge content line: not a usage chunk
        for line in lines:
            self._line(line)

    def close(self) -> Usage:
        """Ends the stream (a last line without newline is read) and returns its `Usage`."""
        if self._tail:
            self._line(self._tail)
            self._tail = b""
        return self.usage

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:") or (b'"usage"' not in line
                                             and b'"meta_info"' not in line):
            return
        u = usage_from_body(line[5:].strip())
        if u.seen and (u.cached_tokens is not None or self.usage.cached_tokens is None):
            self.usage = u


@dataclass(frozen=True)
class DeliveredReport:
    """One request's three numbers (prompt tokens) as `HitRateTracker.record` counted them.

    ``delivered_tokens`` is ``None`` when the engine reported no count (then nothing else was
    counted either); ``error`` = ``(captured - delivered) / prompt_tokens`` (``None`` without a
    count or with an empty prompt)."""

    worker: str
    prompt_tokens: int
    available_tokens: int
    captured_tokens: int
    delivered_tokens: Optional[int]
    engine_prompt_tokens: Optional[int]
    error: Optional[float]

    def as_dict(self) -> Dict[str, Any]:
        return {"worker": self.worker, "prompt_tokens": self.prompt_tokens,
                "available_tokens": self.available_tokens,
                "captured_tokens": self.captured_tokens,
                "delivered_tokens": self.delivered_tokens,
                "engine_prompt_tokens": self.engine_prompt_tokens,
                "prediction_error": None if self.error is None else round(self.error, 6)}


class _WorkerHits:
    __slots__ = ("reports", "unreported", "details_seen", "buckets", "error_sum", "window",
                 "last_warning_at", "last_warning", "available", "captured", "delivered")

    def __init__(self, window: int) -> None:
        self.reports = 0
        self.unreported = 0
        self.details_seen = False
        self.buckets = [0] * (len(ERROR_BUCKETS) + 1)  # the last one: +Inf
        self.error_sum = 0.0
        # (prompt, captured, delivered, engine prompt or -1)
        self.window: Deque[Tuple[int, int, int, int]] = collections.deque(maxlen=window)
        self.last_warning_at = -float("inf")
        self.last_warning: Optional[str] = None
        self.available = self.captured = self.delivered = 0


class HitRateTracker:
    """Sums of available / captured / delivered prompt tokens, the per-worker prediction
    error, and the warning when captured and delivered stay apart.

    Parameters
    ----------
    block_size:
        The router's block size (tokens), to tell a block-size mismatch from other causes.
    window:
        Reports per worker the gap check looks at (the most recent ones).
    min_reports:
        Reports in the window before the check runs.
    gap_ratio:
        Warn when ``|sum captured - sum delivered|`` over the window exceeds this share of its
        prompt tokens ...
    warn_interval_s:
        ... at most once per this many seconds per worker (logged on ``kvroute.delivered``).
    worker_stats:
        ``() -> router.stats()``-shaped dict, read only when a warning is being worded (to
        tell events that do not arrive from other causes). ``None``: not consulted.
    """

    def __init__(self, block_size: int, *, window: int = 64, min_reports: int = 16,
                 gap_ratio: float = 0.2, warn_interval_s: float = 60.0,
                 worker_stats: Optional[Callable[[], Mapping[str, Any]]] = None) -> None:
        if window < 1 or min_reports < 1 or not 0 < gap_ratio <= 1 or warn_interval_s < 0:
            raise ValueError(f"need window >= 1, min_reports >= 1, 0 < gap_ratio <= 1, "
                             f"warn_interval_s >= 0; got {window}, {min_reports}, {gap_ratio}, "
                             f"{warn_interval_s}")
        self.block_size = int(block_size)
        self.window = int(window)
        self.min_reports = int(min_reports)
        self.gap_ratio = float(gap_ratio)
        self.warn_interval_s = float(warn_interval_s)
        self._worker_stats = worker_stats
        self._lock = threading.Lock()
        self._workers: Dict[str, _WorkerHits] = {}
        self.totals = {"available": 0, "captured": 0, "delivered": 0}
        self.reports = 0
        self.unreported = 0
        #: Callables given each `DeliveredReport` after it is counted (e.g.
        #: `kvroute.adaptive.AdaptiveCacheWeight.observe`); an exception is logged, not raised.
        self.listeners: List[Callable[[DeliveredReport], Any]] = []

    def record(self, decision: Any, cached_tokens: Optional[int],
               prompt_tokens: Optional[int] = None) -> DeliveredReport:
        """Counts one finished request.

        Parameters
        ----------
        decision:
            Its `kvroute.Decision` (``worker``, ``prompt_tokens``, ``matched_tokens``,
            ``available_tokens``).
        cached_tokens:
            The engine's cached prompt tokens, or ``None`` (no count in the response).
        prompt_tokens:
            The engine's prompt length (``usage.prompt_tokens``), or ``None``. A response
            with usage but no count (``cached_tokens=None``, ``prompt_tokens`` given) counts
            as 0 cached tokens once this worker has reported a count before.

        Raises
        ------
        ValueError
            A negative or non-integer count.
        """
        for name, v in (("cached_tokens", cached_tokens), ("prompt_tokens", prompt_tokens)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {v!r}")
        worker = decision.worker
        prompt = int(decision.prompt_tokens)
        captured = int(decision.matched_tokens)
        available = max(int(getattr(decision, "available_tokens", captured)), captured)
        warn: Optional[str] = None
        with self._lock:
            w = self._workers.get(worker)
            if w is None:
                w = self._workers[worker] = _WorkerHits(self.window)
            if cached_tokens is None and prompt_tokens is not None and w.details_seen:
                cached_tokens = 0  # vLLM / SGLang leave a zero count out
            if cached_tokens is None:
                w.unreported += 1
                self.unreported += 1
                return self._tell(DeliveredReport(worker, prompt, available, captured, None,
                                                  prompt_tokens, None))
            w.details_seen = True
            delivered = int(cached_tokens)
            err = (captured - delivered) / prompt if prompt > 0 else None
            self.reports += 1
            w.reports += 1
            for k, v in (("available", available), ("captured", captured),
                         ("delivered", delivered)):
                self.totals[k] += v
            w.available += available
            w.captured += captured
            w.delivered += delivered
            if err is not None:
                w.error_sum += err
                w.buckets[_bucket(err)] += 1
            w.window.append((prompt, captured, delivered,
                             -1 if prompt_tokens is None else prompt_tokens))
            now = time.monotonic()
            if (len(w.window) >= self.min_reports
                    and now - w.last_warning_at >= self.warn_interval_s):
                gap = self._gap(w)
                if gap is not None:
                    w.last_warning_at = now
                    warn = gap
        report = DeliveredReport(worker, prompt, available, captured, delivered, prompt_tokens,
                                 err)
        if warn is not None:
            warn = self._worded(worker, warn)
            with self._lock:
                w.last_warning = warn
            log.warning("%s", warn)
        return self._tell(report)

    def _tell(self, report: DeliveredReport) -> DeliveredReport:
        for f in list(self.listeners):
            try:
                f(report)
            except Exception:  # noqa: BLE001 - a listener must never fail the request
                log.exception("hit-rate listener %r failed", f)
        return report

    def _gap(self, w: _WorkerHits) -> Optional[str]:
        """A cause key when the window's captured and delivered sums stay apart."""
        prompt = sum(r[0] for r in w.window)
        cap = sum(r[1] for r in w.window)
        dlv = sum(r[2] for r in w.window)
        if prompt <= 0 or abs(cap - dlv) <= self.gap_ratio * prompt:
            return None
        known = [r for r in w.window if r[3] >= 0 and r[0] > 0]
        if known and sum(1 for r in known if r[3] != r[0]) * 4 >= len(known):
            return "tokenization"
        if self.block_size > 1 and any(r[2] % self.block_size for r in w.window):
            return "block_size"
        return "events" if dlv > cap else "keys"

    def _worded(self, worker: str, cause: str) -> str:
        w = self._workers[worker]
        rows = list(w.window)
        cap = sum(r[1] for r in rows)
        dlv = sum(r[2] for r in rows)
        head = (f"worker {worker}: the router expected {cap} cached prompt tokens over its last "
                f"{len(rows)} requests, the engine reported {dlv}")
        st: Mapping[str, Any] = {}
        if self._worker_stats is not None and cause in ("events", "keys"):
            try:
                st = (self._worker_stats().get("workers") or {}).get(worker) or {}
            except Exception:  # noqa: BLE001 - a warning must never fail the request
                st = {}
        dropped = st.get("dropped") or {}
        if cause == "events" and dropped.get("block_size_mismatch"):
            cause = "block_size"
        if cause == "tokenization":
            diff = [(r[0], r[3]) for r in rows if r[3] >= 0 and r[3] != r[0]][-1]
            why = (f"likely cause: the router's tokenization or chat template differs from the "
                   f"engine's (last prompt: router {diff[0]} tokens, engine {diff[1]}): give "
                   f"the router the engine's tokenizer and chat template; check with `kvroute "
                   f"doctor`")
        elif cause == "block_size":
            why = (f"likely cause: block size: the router's block_size is {self.block_size}, "
                   f"and the engine's counts or BlockStored events do not fit it"
                   + (f" ({dropped['block_size_mismatch']} batches dropped as "
                      f"block_size_mismatch)" if dropped.get("block_size_mismatch") else "")
                   + ": set block_size to the engine's --block-size")
        elif cause == "events":
            age = st.get("last_recv_age_s")
            seen = (f"; its stream has {st.get('blocks_stored', 0)} blocks stored"
                    + (f", last message {age:.0f} s ago" if isinstance(age, (int, float))
                       and age >= 0 else "") if st else "")
            why = (f"likely cause: events not arriving (the engine reuses blocks the router "
                   f"does not know of{seen}): check the worker's kv_events endpoint, "
                   f"bind/connect topology and topic with `kvroute doctor`")
        else:
            orphans = st.get("orphan_stores")
            why = ("likely cause: the engine keys blocks differently from the router "
                   "(PYTHONHASHSEED / hash algorithm across engine restarts, cache_salt, "
                   "LoRA or other extra keys" + (f"; {orphans} stored blocks had an unknown "
                                                 f"parent" if orphans else "")
                   + "), or it evicts blocks before the request runs (KV cache too small "
                   "for the load); compare the engine's BlockStored token ids with the "
                   "router's with `kvroute doctor`")
        return f"{head}; {why}"

    def snapshot(self) -> Dict[str, Any]:
        """``{"totals": {available, captured, delivered}, "reports", "unreported", "workers":
        {name: {reports, unreported, available, captured, delivered, error_sum,
        buckets: [(upper bound, cumulative count)...], last_warning}}}`` (prompt tokens)."""
        with self._lock:
            workers = {}
            for name, w in self._workers.items():
                cum, acc = [], 0
                for ub, n in zip(list(ERROR_BUCKETS) + [float("inf")], w.buckets):
                    acc += n
                    cum.append((ub, acc))
                workers[name] = {"reports": w.reports, "unreported": w.unreported,
                                 "available": w.available, "captured": w.captured,
                                 "delivered": w.delivered, "error_sum": w.error_sum,
                                 "buckets": cum, "last_warning": w.last_warning}
            return {"totals": dict(self.totals), "reports": self.reports,
                    "unreported": self.unreported, "workers": workers}

    def forget_worker(self, worker: str) -> None:
        """Drops a removed worker's per-worker numbers (the totals keep them). Idempotent."""
        with self._lock:
            self._workers.pop(worker, None)


def _bucket(err: float) -> int:
    for i, ub in enumerate(ERROR_BUCKETS):
        if err <= ub:
            return i
    return len(ERROR_BUCKETS)
