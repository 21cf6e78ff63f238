"""The pipeline's relay stage: an engine's answer passed to the client, and the replies built
from kvroute's own records (a response-cache hit, a decision-log entry).

- `UpstreamStream`: an SSE answer relayed chunk by chunk; it releases the decision exactly
  once (first chunk: ``first_token``; end, error or client gone: ``complete``), feeds the
  delivered-reuse report and stores the answer in the response cache.
- `response_headers`: the upstream header fields passed on (hop-by-hop ones dropped, repeated
  fields kept apart) plus ``x-kvroute-worker`` and, when the request may see it, the decision.
- `replay_cached`: a `kvroute.serving.response_cache.CachedResponse` as a response.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

import anyio
import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvroute.serving.common import (
    DECISION_HEADER,
    SCORES_HEADER,
    WORKER_HEADER,
    decision_dict,
    scores_list,
)
from kvroute.serving.forward import DROP_RESPONSE, connection_tokens
from kvroute.serving.hitrate import StreamReport
from kvroute.serving.response_cache import CACHE_HEADER, SIMILARITY_HEADER

__all__ = ["UpstreamStream", "response_headers", "replay_cached", "log_entry"]

log = logging.getLogger("kvroute.serving.proxy")


class UpstreamStream(StreamingResponse):
    """An upstream SSE response relayed chunk by chunk; releases the decision exactly once
    (first chunk: first_token; end, error or client disconnect: complete)."""

    def __init__(self, proxy: Any, decision: Any, worker: str, upstream: Any,
                 headers: List[Tuple[bytes, bytes]], t0: float,
                 cache_key: Optional[str] = None,
                 delivered: Optional[StreamReport] = None) -> None:
        self._proxy = proxy
        self._delivered = delivered
        self._cache_key = cache_key
        self._cache_headers = headers
        self._decision = decision
        self._worker = worker
        self._upstream = upstream
        self._t0 = t0
        self._done = False
        super().__init__(self._relay(), status_code=upstream.status_code)
        self.raw_headers.extend(headers)

    async def _relay(self) -> AsyncIterator[bytes]:
        first = True
        outcome: Any = "disconnect"
        kept: Optional[List[bytes]] = [] if self._cache_key is not None else None
        try:
            async for chunk in self._upstream.aiter_raw():
                if first and chunk:
                    first = False
                    self._proxy.router.first_token(self._decision)
                if kept is not None:
                    kept.append(chunk)
                if self._delivered is not None:
                    self._delivered.feed(chunk)
                yield chunk
            outcome = self._upstream.status_code
            if self._delivered is not None:
                self._delivered.finish(outcome)
            cache = self._proxy.response_cache
            if kept is not None and cache is not None and self._cache_key is not None:
                await cache.aput(self._cache_key, outcome, self._cache_headers, kept,
                                 stream=True)
        except httpx.HTTPError as e:
            outcome = "read_error"
            self._proxy.breaker_failure(self._worker)
            log.warning("worker %s broke off a stream: %s: %s", self._worker, type(e).__name__, e)
            # vLLM's in-stream error event (serving_engine create_streaming_error_response)
            err = {"error": {"message": f"worker {self._worker} broke off the stream: "
                                        f"{type(e).__name__}", "type": "BadGatewayError",
                             "param": None, "code": 502}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            self._finish(outcome)

    def _finish(self, outcome: Any) -> None:
        if self._done:
            return
        self._done = True
        self._proxy.router.complete(self._decision)
        self._proxy.metrics.observe_upstream(self._worker, outcome, time.perf_counter() - self._t0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # The client may be gone with the relay suspended at a yield: release now rather
            # than whenever the generator is garbage-collected.
            self._finish("disconnect")
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._upstream.aclose()

    async def release_unsent(self) -> None:
        """Never sent (the client left as it was returned): release now."""
        self._finish("disconnect")
        await self._upstream.aclose()


def response_headers(upstream: Any, worker: str, d: Any, explain: bool, attempts: int,
                     request_id: Optional[str] = None) -> List[Tuple[bytes, bytes]]:
    """The upstream response's header fields as raw byte pairs for the ASGI response (each
    repeated field, e.g. ``Set-Cookie``, kept as its own pair), minus hop-by-hop ones, plus
    ``x-kvroute-worker`` and, with ``explain``, ``x-kvroute-decision`` and
    ``x-kvroute-scores``."""
    raw = upstream.raw
    drop = DROP_RESPONSE | connection_tokens(raw) | {WORKER_HEADER, DECISION_HEADER,
                                                      SCORES_HEADER}
    out = [(k.lower(), v) for k, v in raw if k.lower().decode("latin-1") not in drop]
    out.append((WORKER_HEADER.encode(), worker.encode("latin-1", "replace")))
    if explain:
        out.append((DECISION_HEADER.encode(), json.dumps(
            decision_dict(d, attempts, request_id), separators=(",", ":")).encode()))
        out.append((SCORES_HEADER.encode(),
                    json.dumps(scores_list(d), separators=(",", ":")).encode()))
    return out


def replay_cached(hit: Any, result: str = "hit", similarity: Optional[float] = None
                  ) -> Response:
    """A `kvroute.serving.response_cache.CachedResponse` as a response: the same status,
    header fields and body bytes (a stream as the same chunks), plus ``x-kvroute-cache:
    <result>`` and, for a semantic hit, ``x-kvroute-cache-similarity``."""
    resp: Response
    if hit.stream:
        async def chunks() -> AsyncIterator[bytes]:
            for c in hit.chunks:
                yield c
        resp = StreamingResponse(chunks(), status_code=hit.status)
    else:
        resp = Response(content=b"".join(hit.chunks), status_code=hit.status)
    resp.raw_headers.extend(hit.headers)
    resp.raw_headers.append((CACHE_HEADER.encode(), result.encode()))
    if similarity is not None:
        resp.raw_headers.append((SIMILARITY_HEADER.encode(), f"{similarity:.6f}".encode()))
    return resp


def log_entry(entry: Dict[str, Any]) -> Dict[str, Any]:
    """A decision-log entry for ``GET /admin/decisions``: a held ``decision`` (recorded as the
    `kvroute.Decision`, cheap) becomes its `decision_dict` fields and ``scores``; a held
    ``prefill_decision`` (prefill/decode mode) the same under ``prefill``."""
    d = entry.get("decision")
    if d is None:
        return dict(entry)
    out = {k: v for k, v in entry.items() if k not in ("decision", "prefill_decision",
                                                       "attempts")}
    out.update(decision_dict(d, entry.get("attempts", 1), entry.get("request_id")))
    out["scores"] = scores_list(d)
    dl = out.pop("delivered", None) or {}
    out["delivered_tokens"] = dl.get("delivered_tokens")
    out["engine_prompt_tokens"] = dl.get("engine_prompt_tokens")
    out["prediction_error"] = dl.get("prediction_error")
    if "prefill_decision" in entry:
        p = entry["prefill_decision"]
        out["prefill"] = (None if p is None else
                          {**decision_dict(p, entry.get("attempts", 1), entry.get("request_id")),
                           "scores": scores_list(p)})
    return out
