"""The picker's ext_proc transport on the native gRPC server (``kvroute._epp``, cpp/epp).

The C++ server runs gRPC's asynchronous API on one thread, which answers every message that
needs no decision (request headers with a body to come, response headers and body, trailers)
and calls `NativeTransport.handle` (with the GIL) for the rest, on that thread:

- a request to decide: `kvroute.epp.picker.RequestState.decide_now` answers at once when
  nothing needs the event loop (the common case); otherwise the rest
  (`RequestState.decide_rest`: a long prompt for the tokenizer's thread pools, the
  ``lmcache_aware`` policy) runs on the event loop and answers through ``answer``;
- the response's status and served endpoint, its body chunks: reported to the state;
- the end of the stream: the request accounted.

No grpcio and no Envoy protos are imported in this path: the server is gRPC C++. Everything
the handler touches (the router, the tokenizer, the tenants' limits, the metrics) is safe to
use from the server's thread beside the event loop's; the state of one request is only
touched by one of them at a time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, Optional, Tuple

from kvroute.epp.picker import EndpointPicker, RequestState

__all__ = ["NativeTransport", "available"]

log = logging.getLogger("kvroute.epp")

_DECIDE, _RESPONSE, _BODY, _DONE = 0, 1, 2, 3


def available() -> bool:
    """Whether ``kvroute._epp`` was built (gRPC C++ found at build time)."""
    try:
        from kvroute import _epp  # noqa: F401
    except ImportError:
        return False
    return True


class NativeTransport:
    """The native server on ``address`` (``host:port``, port 0: a free one) feeding
    ``picker``; created on the event loop that runs the deferred decisions.
    ``max_message_bytes`` bounds a received message. Raises RuntimeError if it cannot
    listen."""

    def __init__(self, picker: EndpointPicker, address: str, max_message_bytes: int) -> None:
        from kvroute import _epp

        self.picker = picker
        self._states: Dict[int, RequestState] = {}
        self._loop = asyncio.get_running_loop()
        self.server = _epp.ExtProcServer(address, max_message_bytes, self.handle)
        self.port = int(self.server.port)

    def set_serving(self, service: str, serving: bool) -> None:
        self.server.set_serving(service, serving)

    def stop(self, grace_s: float) -> None:
        """Stops the server (its open streams are accounted as they end)."""
        self.server.shutdown(grace_s)
        for st in list(self._states.values()):
            st.ended = True
            st.account()
        self._states.clear()

    def stats(self) -> Dict[str, Any]:
        return dict(self.server.stats())

    def handle(self, ev: Tuple[Any, ...]) -> Any:
        """One event of the server's thread (see the module docstring); for a decision, the
        answer or None (deferred)."""
        kind, sid = ev[0], ev[1]
        if kind == _DECIDE:
            st = self.picker.state()
            self._states[sid] = st
            answer = st.decide_now(ev[2], ev[3], ev[4])
            if answer is None:
                self._loop.call_soon_threadsafe(self._defer, sid, st)
            return answer
        st_: Optional[RequestState] = self._states.get(sid)
        if st_ is None:
            return None
        if kind == _RESPONSE:
            st_.response(ev[2] or None, ev[3] or None, ev[4], ev[5] or None)
        elif kind == _BODY:
            st_.body(ev[2])
        else:
            del self._states[sid]
            st_.ended = True  # a decision still running is accounted when it is made
            st_.account()
        return None

    def _defer(self, sid: int, st: RequestState) -> None:
        self._loop.create_task(self._answer_later(sid, st))

    async def _answer_later(self, sid: int, st: RequestState) -> None:
        try:
            answer = await st.decide_rest()
        except Exception as e:  # noqa: BLE001 - answered, never left hanging
            log.exception("deciding stream %s", sid)
            answer = st.refuse(500, f"the endpoint picker failed: {type(e).__name__}: {e}")
        if st.ended:  # Envoy gave up on the request meanwhile
            st.account()
            return
        if not self.server.answer(sid, answer):
            self._states.pop(sid, None)
            st.account()
