"""The proxy's side of predicted vs delivered prefix reuse: read the engine's cached-token
count from each answered request and hand it to `kvroute.Router.report_delivered`.

`report_body` reads a complete JSON body; `StreamReport` reads an SSE stream chunk by chunk
as it is relayed (only the usage chunk is decoded); `report_answer` reads a complete body of
either kind (an answer read whole, e.g. the prefill worker's in prefill/decode mode). All
are deliberately fail-open: a response without a count, or one that is not JSON, is counted
as unreported and never fails the request. A decision-log entry (``/admin/decisions``) given
to them gets the engine's
numbers under ``"delivered"`` (`kvroute.delivered.DeliveredReport.as_dict`).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from kvroute.delivered import DeliveredReport, Usage, UsageScanner, usage_from_body

__all__ = ["StreamReport", "report_answer", "report_body", "report_usage"]

log = logging.getLogger("kvroute.serving")


def report_usage(router: Any, decision: Any, usage: Usage,
                 entry: Optional[Dict[str, Any]] = None) -> Optional[DeliveredReport]:
    """``router.report_delivered(decision, usage.cached_tokens, prompt_tokens=...)``, and the
    report stored in ``entry["delivered"]`` when an entry is given. None on any error."""
    try:
        rep = router.report_delivered(decision, usage.cached_tokens,
                                      prompt_tokens=usage.prompt_tokens)
    except Exception as e:  # noqa: BLE001 - accounting must never fail a request
        log.debug("report_delivered failed: %s: %s", type(e).__name__, e)
        return None
    if entry is not None:
        entry["delivered"] = rep.as_dict()
    return rep


def report_body(router: Any, decision: Any, status: int, body: bytes,
                entry: Optional[Dict[str, Any]] = None) -> Optional[DeliveredReport]:
    """Reports a complete non-streaming answer (only a 2xx one: an error has no usage)."""
    if not 200 <= status < 300:
        return None
    return report_usage(router, decision, usage_from_body(body), entry)


def report_answer(router: Any, decision: Any, status: int, body: bytes, content_type: str,
                  entry: Optional[Dict[str, Any]] = None) -> Optional[DeliveredReport]:
    """Reports a complete answer read whole: an SSE body (``content_type``
    ``text/event-stream``) as `StreamReport` reads it, any other as `report_body`."""
    if content_type.startswith("text/event-stream"):
        sr = StreamReport(router, decision, entry)
        sr.feed(body)
        return sr.finish(status)
    return report_body(router, decision, status, body, entry)


class StreamReport:
    """Reads one relayed SSE stream's usage (`feed` per raw chunk) and reports it once at its
    end (`finish`, only when the stream ended normally with a 2xx status)."""

    __slots__ = ("_router", "_decision", "_entry", "_scanner")

    def __init__(self, router: Any, decision: Any,
                 entry: Optional[Dict[str, Any]] = None) -> None:
        self._router = router
        self._decision = decision
        self._entry = entry
        self._scanner: Optional[UsageScanner] = UsageScanner()

    def feed(self, chunk: bytes) -> None:
        if self._scanner is not None:
            self._scanner.feed(chunk)

    def finish(self, status: Any) -> Optional[DeliveredReport]:
        """``status``: the upstream HTTP status when the stream ended, else an error kind
        (nothing reported). Idempotent."""
        scanner, self._scanner = self._scanner, None
        if scanner is None or not isinstance(status, int) or not 200 <= status < 300:
            return None
        return report_usage(self._router, self._decision, scanner.close(), self._entry)
