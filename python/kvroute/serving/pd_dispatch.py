"""The prefill/decode front's dispatch stage: one attempt of a request over a prefill and a
decode worker, in vLLM's (NIXL connector) or SGLang's (bootstrap) protocol.

See `kvroute.serving.pd` for the protocol of each engine and the failure handling around an
attempt. `PDAttempts` is the part of `kvroute.serving.pd.PDFront` that talks to the engines;
an attempt that fails before any byte reached the client raises `AttemptFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

import httpx
from starlette.responses import Response, StreamingResponse

from kvroute._router import Worker
from kvroute.pd import PDDecision
from kvroute.serving.breaker import failure_kind
from kvroute.serving.common import DP_RANK_HEADER, TENANT_HEADER, error_response
from kvroute.serving.health import FirstByteTimeout, guard_first_byte
from kvroute.serving.hitrate import StreamReport, report_answer, report_body

__all__ = ["PREFILL_KV_TRANSFER_PARAMS", "PDAttempts", "AttemptFailed"]

#: What the prefill request carries (vLLM's NIXL connector; the vLLM PD proxies).
PREFILL_KV_TRANSFER_PARAMS: Dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def _error(status: int, message: str) -> Response:
    return error_response(status, message, "upstream_error")


class AttemptFailed(Exception):
    """One prefill or decode request failed before any byte reached the client: ``kind`` is a
    `kvroute.serving.retry.RETRY_ON` kind (or ``"error"``, never retried); ``response`` is
    the client's answer if it is not retried."""

    def __init__(self, pool: str, worker: Worker, kind: str, response: Response) -> None:
        super().__init__(f"{pool} worker {worker.name}: {kind}")
        self.pool = pool
        self.worker = worker
        self.kind = kind
        self.response = response


class PDAttempts:
    """One attempt's requests to the engines (mixed into `kvroute.serving.pd.PDFront`, which
    provides ``router``, ``breaker``, ``_verdict``, ``pool_metrics``, ``retry``, ``health_checker``,
    ``first_byte_timeout_s``, ``bootstrap_ports`` and ``_client``)."""

    router: Any
    pool_metrics: Dict[str, Any]
    retry: Any
    health_checker: Any
    first_byte_timeout_s: Optional[float]
    bootstrap_ports: Dict[str, Optional[int]]

    breaker: Callable[[str, str], Any]
    _verdict: Callable[[str, Worker, bool], None]
    _client: Callable[[], httpx.AsyncClient]

    @staticmethod
    def _headers(rid: bytes, worker: Worker, tenant: Optional[str]
                 ) -> List[Tuple[bytes, bytes]]:
        """The header fields of a request to an engine: the client's request id as the bytes
        it sent, the worker's data-parallel rank, the tenant's name."""
        h = [(b"X-Request-Id", rid), (b"Content-Type", b"application/json")]
        if worker.dp_rank is not None:
            h.append((DP_RANK_HEADER.encode("latin-1"), str(worker.dp_rank).encode()))
        if tenant is not None:
            h.append((TENANT_HEADER.encode(), tenant.encode("utf-8")))
        return h

    async def _send(self, pool: str, worker: Worker, req: httpx.Request) -> httpx.Response:
        """``req`` sent until its response headers (body unread), bounded by the first-byte
        guard; the worker's circuit breaker gets the verdict (a status below 500 is a
        success). Raises AttemptFailed for a failure before the headers."""
        breaker = self.breaker(pool, worker.name)
        probe = breaker.on_dispatch()
        t0 = time.perf_counter()
        try:
            r = await guard_first_byte(self._client().send(req, stream=True),
                                       self.first_byte_timeout_s, self.health_checker,
                                       worker.url.rstrip("/"))
        except (httpx.HTTPError, httpx.InvalidURL, FirstByteTimeout) as e:
            kind = failure_kind(e)
            self._verdict(pool, worker, False)
            self.pool_metrics[pool].observe_upstream(
                worker.name, {"connect": "connect_error"}.get(kind, kind),
                time.perf_counter() - t0)
            status = 504 if kind == "timeout" else 502
            raise AttemptFailed(pool, worker, kind,
                                 _error(status, f"{pool} worker {worker.name}: {e!r}")) from e
        except BaseException:  # cancelled (client gone): no verdict
            breaker.abandon(probe)
            raise
        self._verdict(pool, worker, r.status_code < 500)
        return r

    async def _check_status(self, pool: str, worker: Worker, r: httpx.Response,
                            t0: float) -> None:
        """Raises AttemptFailed (``r`` read and closed) for a status the retry policy
        retries; the client's answer if it is not retried: a decode worker's answer as it is,
        502 naming a prefill worker. ``t0``: `time.perf_counter` when ``r`` was sent."""
        kind = self.retry.status_kind(r.status_code)
        if kind is None:
            return
        self.pool_metrics[pool].observe_upstream(worker.name, r.status_code,
                                            time.perf_counter() - t0)
        try:
            content = await r.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await r.aclose()
        if pool == "decode":
            answer: Response = Response(content, status_code=r.status_code,
                                        media_type=r.headers.get("content-type"))
        else:
            answer = _error(502, f"prefill worker {worker.name} answered {r.status_code}: "
                                 f"{content[:200].decode('utf-8', 'replace')}")
        raise AttemptFailed(pool, worker, kind, answer)

    async def _dispatch(self, pd: PDDecision, path: str, body: Dict[str, Any],
                        rid: bytes, tenant: Optional[str] = None,
                        extra_headers: Optional[Dict[str, str]] = None) -> Response:
        """One attempt; raises AttemptFailed before any byte reached the client. The load
        of ``pd`` is released here once the decode answer is handed on, by the caller
        otherwise."""
        client = self._client()
        decode_w = self.router.decode._workers[pd.decode.worker]
        decode_body = body
        prefill_task: Optional[asyncio.Task[httpx.Response]] = None
        if pd.prefill is not None:
            prefill_w = self.router.prefill._workers[pd.prefill.worker]
            boot = self.bootstrap_ports.get(prefill_w.url)
            url = prefill_w.url.rstrip("/") + path
            if boot is None:  # vLLM: prefill first, its kv_transfer_params to the decode
                pre = dict(body, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS),
                           stream=False, max_tokens=1)
                if "max_completion_tokens" in pre:
                    pre["max_completion_tokens"] = 1
                pre.pop("stream_options", None)
                t_pre = time.perf_counter()
                r = await self._send("prefill", prefill_w, client.build_request(
                    "POST", url, json=pre, headers=self._headers(rid, prefill_w, tenant)))
                try:
                    await self._check_status("prefill", prefill_w, r, t_pre)
                    await r.aread()
                except httpx.HTTPError as e:
                    self._verdict("prefill", prefill_w, False)
                    self.pool_metrics["prefill"].observe_upstream(prefill_w.name, "read_error",
                                                             time.perf_counter() - t_pre)
                    raise AttemptFailed("prefill", prefill_w, "error", _error(
                        502, f"prefill worker {prefill_w.name}: {e!r}")) from e
                finally:
                    await r.aclose()
                self.pool_metrics["prefill"].observe_upstream(prefill_w.name, r.status_code,
                                                         time.perf_counter() - t_pre)
                if r.status_code != 200:
                    if 400 <= r.status_code < 500:  # the request itself: the engine's answer
                        raise AttemptFailed("prefill", prefill_w, "error", Response(
                            r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json")))
                    raise AttemptFailed("prefill", prefill_w, "error", _error(
                        502, f"prefill worker {prefill_w.name} answered "
                             f"{r.status_code}: {r.text[:200]}"))
                self.router.first_token(pd)
                report_body(self.router.prefill, pd.prefill, r.status_code, r.content)
                try:
                    kv = r.json().get("kv_transfer_params")
                except (ValueError, AttributeError):
                    kv = None
                decode_body = dict(body)
                if kv:
                    decode_body["kv_transfer_params"] = kv
            else:  # SGLang: the same bootstrapped body to both at once
                decode_body = dict(body, bootstrap_host=urlsplit(prefill_w.url).hostname,
                                   bootstrap_port=boot,
                                   bootstrap_room=secrets.randbits(63))
                t_pre = time.perf_counter()
                prefill_task = asyncio.ensure_future(client.post(
                    url, json=decode_body, headers=self._headers(rid, prefill_w, tenant)))
        req = client.build_request("POST", decode_w.url.rstrip("/") + path, json=decode_body,
                                   headers=self._headers(rid, decode_w, tenant))
        prefill_decision = pd.prefill

        def prefill_answered(r: Optional[httpx.Response]) -> None:
            # SGLang's concurrent prefill: its answer (None: it failed) is only reported.
            assert prefill_decision is not None
            w = self.router.prefill._workers[prefill_decision.worker]
            self._verdict("prefill", w, r is not None and r.status_code < 500)
            self.pool_metrics["prefill"].observe_upstream(
                w.name, r.status_code if r is not None else "error", time.perf_counter() - t_pre)
            if r is not None:
                report_answer(self.router.prefill, prefill_decision, r.status_code, r.content,
                              r.headers.get("content-type", ""))

        t0 = time.perf_counter()
        try:
            upstream = await self._send("decode", decode_w, req)
            await self._check_status("decode", decode_w, upstream, t0)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and prefill_task is not None:
                prefill_task.cancel()  # the client left: no need for the prefill answer
                await asyncio.gather(prefill_task, return_exceptions=True)
            else:
                await _discard(prefill_task, prefill_answered)
            raise
        headers = {"x-kvroute-decode-worker": decode_w.name, **(extra_headers or {})}
        if pd.prefill is not None:
            headers["x-kvroute-prefill-worker"] = pd.prefill.worker
        ctype = upstream.headers.get("content-type", "application/json")

        finished = False

        async def finish(outcome: Any = None) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            await upstream.aclose()
            self.pool_metrics["decode"].observe_upstream(
                decode_w.name, upstream.status_code if outcome is None else outcome,
                time.perf_counter() - t0)
            if outcome == "read_error":
                self._verdict("decode", decode_w, False)
            if prefill_task is not None:
                await _discard(prefill_task, prefill_answered)
            self.router.complete(pd)

        # The decode worker's count is its own prefix cache's only when it prefilled itself.
        local = pd.prefill is None
        if body.get("stream"):
            delivered = StreamReport(self.router.decode, pd.decode) if local else None

            async def relay() -> AsyncIterator[bytes]:
                outcome: Any = "disconnect"  # unless the stream ends or breaks
                try:
                    async for chunk in upstream.aiter_raw():
                        if delivered is not None:
                            delivered.feed(chunk)
                        yield chunk
                    if delivered is not None:
                        delivered.finish(upstream.status_code)
                    outcome = None
                except httpx.HTTPError:
                    outcome = "read_error"
                    raise
                finally:
                    await finish(outcome)

            return _PDStream(finish, relay(), status_code=upstream.status_code,
                             media_type=ctype, headers=headers)
        try:
            content = await upstream.aread()
        except httpx.HTTPError as e:
            await finish("read_error")
            return _error(502, f"decode worker {decode_w.name} broke off its response: {e!r}")
        finally:
            await finish()
        if local:
            report_body(self.router.decode, pd.decode, upstream.status_code, content)
        return Response(content, status_code=upstream.status_code, media_type=ctype,
                        headers=headers)


class _PDStream(StreamingResponse):
    """The decode worker's streamed answer; `release_unsent` releases its load and upstream
    connection when it is never sent (the client left as it was returned:
    `kvroute.serving.proxy._until_disconnect`)."""

    def __init__(self, finish: Callable[[Any], Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._release = finish

    async def release_unsent(self) -> None:
        await self._release("disconnect")


async def _discard(task: Optional[asyncio.Task[httpx.Response]],
                   answered: Optional[Callable[[Optional[httpx.Response]], Any]] = None
                   ) -> None:
    """Awaits a concurrent prefill request (SGLang) and hands its answer (None if it failed)
    to ``answered``; its failure is not the client's (the decode answer is)."""
    if task is None:
        return
    try:
        r = await task
    except Exception:  # noqa: BLE001
        if answered is not None:
            answered(None)
        return
    with contextlib.suppress(Exception):
        if answered is not None:
            answered(r)
        await r.aclose()

