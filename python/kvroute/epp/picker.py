"""`EndpointPicker`: the request pipeline over Envoy's ext_proc stream (the EPP front).

One ext_proc stream is one HTTP request. The stages, in the order Envoy's messages bring them
(the same stages and the same config as ``kvroute serve``'s fronts,
`kvroute.serving.pipeline`):

================= ====================================== =====================================
message           stage                                  answer
================= ====================================== =====================================
request_headers   authenticate, admit (API keys,         continue; 401 / 403 / 429 as an
                  tenants' rate and concurrency limits)  ``ImmediateResponse``
request_body      parse (``max_body_bytes``), tokenize,  ``x-gateway-destination-endpoint``
(BUFFERED)        decide (the subset hint, circuit       header and ``envoy.lb`` metadata:
                  breakers, health, recovery ramp)       the worker, then ``max_retries``
                                                         fallbacks; 400 / 413 / 503
response_headers  the served endpoint (load moved to it  continue (``x-kvroute-worker``
(if sent)         when a fallback served), breakers,     added; the decision headers when
                  ORCA load report                       the request may see them)
response_body     the engine's ``usage``: delivered      continue
(if sent)         cached tokens (`kvroute.delivered`)
end of stream     account: the load released, the tenant's slot given back, the decision log
================= ====================================== =====================================

A request without a body (``GET /v1/models``) is decided on load at its headers. Requests
Envoy's data plane retries go down the endpoint list without asking again; route-level
retries to another pool open a new stream.

Thread-safety: the picker lives on one asyncio event loop (the gRPC server's).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from kvroute.epp import protocol as P
from kvroute.epp.protocol import pb

log = logging.getLogger("kvroute.epp")

__all__ = ["EndpointPicker"]

_COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


class _NoEndpoint(Exception):
    pass


class EndpointPicker:
    """The ext_proc servicer (``envoy.service.ext_proc.v3.ExternalProcessor/Process``).

    Parameters
    ----------
    proxy:
        The `kvroute.serving.proxy.Proxy` built from the router config: its router, tokenizer,
        limits, circuit breakers, health checks, recovery ramp, load scraping, replicas,
        metrics and decision log are the picker's. Started by the picker on first use.
    auth:
        `kvroute.serving.auth.Auth` (tenants, admin key) or None.
    fallbacks:
        Endpoints after the first in the answer, for the data plane's retries (distinct
        workers, in the policy's order of preference); default the proxy's ``max_retries``.
    on_change:
        Called with worker name -> ``ip:port`` when the router's workers changed (added or
        removed through the HTTP API or a reload), before the next decision uses them.
    """

    def __init__(self, proxy: Any, auth: Any = None, fallbacks: Optional[int] = None, *,
                 on_change: Optional[Callable[[Dict[str, str]], None]] = None) -> None:
        from prometheus_client import Counter

        self.proxy = proxy
        self.auth = auth
        self.fallbacks = proxy.max_retries if fallbacks is None else int(fallbacks)
        if self.fallbacks < 0:
            raise ValueError(f"fallbacks must be >= 0, got {fallbacks!r}")
        self._endpoint: Dict[str, str] = {}  # worker name -> ip:port
        self._names: Dict[str, List[str]] = {}  # ip:port -> worker names
        self._known: Tuple[int, int] = (0, -1)
        self.on_change = on_change
        ns = getattr(proxy.metrics, "namespace", "kvroute")
        reg = proxy.metrics.registry
        self.requests = Counter("epp_requests", "ext_proc streams by outcome: routed, or the "
                                "status of the picker's immediate response.", ["outcome"],
                                namespace=ns, registry=reg)
        self.served = Counter("epp_served", "Responses by which endpoint of the picker's list "
                              "served them: primary, fallback, other (not in the list), or "
                              "unknown (the data plane did not say).", ["by"],
                              namespace=ns, registry=reg)
        self.endpoints_of_workers()  # refuses a worker URL that is not ip:port now

    # -- endpoints -----------------------------------------------------------------------------
    def endpoints_of_workers(self) -> Dict[str, str]:
        """Worker name -> ``ip:port``, rebuilt when the router's worker set changed. Raises
        ValueError for a worker URL whose host is not an IP address."""
        workers = self.proxy.router._workers
        key = (id(workers), len(workers))
        if key != self._known or any(n not in self._endpoint for n in workers):
            ep = {n: P.endpoint_of_url(w.url) for n, w in workers.items()}
            names: Dict[str, List[str]] = {}
            for n, e in ep.items():
                names.setdefault(e, []).append(n)
            changed = self._known != (0, -1) and ep != self._endpoint
            self._endpoint, self._names, self._known = ep, names, key
            if changed and self.on_change is not None:
                self.on_change(dict(ep))
        return self._endpoint

    def names_at(self, endpoint: str) -> List[str]:
        """The workers (data-parallel ranks share one) at ``ip:port``."""
        self.endpoints_of_workers()
        return self._names.get(endpoint, [])

    # -- the servicer --------------------------------------------------------------------------
    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        """One HTTP request's ext_proc stream (see the module docstring)."""
        await self.proxy._ensure_started()
        st = _Stream(self)
        try:
            async for req in requests:
                resp = await st.on(req)
                yield resp
                if st.ended:
                    return
        finally:
            st.account()


class _Stream:
    """One request's state between Envoy's messages."""

    __slots__ = ("p", "tenant", "headers", "path", "decision", "tokens", "kw", "endpoints",
                 "workers", "served", "status", "report", "entry", "ended", "explain",
                 "t0", "scanner_body")

    def __init__(self, picker: EndpointPicker) -> None:
        self.p = picker
        self.tenant: Any = None
        self.headers: Dict[str, str] = {}
        self.path = ""
        self.decision: Any = None
        self.tokens: Any = None
        self.kw: Dict[str, Any] = {}
        self.endpoints: List[str] = []
        self.workers: List[str] = []
        self.served: Optional[str] = None
        self.status: Any = None
        self.report: Any = None
        self.entry: Optional[Dict[str, Any]] = None
        self.ended = False
        self.explain = False
        self.t0 = time.perf_counter()
        self.scanner_body: Optional[List[bytes]] = None

    def refuse(self, status: int, message: str, headers: Optional[Dict[str, str]] = None,
               err_type: Optional[str] = None) -> pb.ProcessingResponse:
        self.ended = True
        self.p.requests.labels(str(status)).inc()
        return P.immediate(status, message, err_type, headers)

    async def on(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return await self.on_request_headers(req)
        if kind == "request_body":
            return await self.on_request_body(req)
        if kind == "response_headers":
            return self.on_response_headers(req)
        if kind == "response_body":
            self.on_response_body(req.response_body)
            return P.continue_body("response_body")
        if kind in ("request_trailers", "response_trailers"):
            return P.continue_trailers(kind)
        return self.refuse(500, f"the endpoint picker got an ext_proc message it does not "
                                f"handle ({kind})")

    # -- authenticate, admit -------------------------------------------------------------------
    async def on_request_headers(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        from kvroute.serving.auth import AuthError

        self.headers = h = P.headers_of(req.request_headers)
        self.path = h.get(":path", "").split("?", 1)[0]
        p = self.p
        auth = p.auth
        if auth is not None:
            shared = auth.shared
            if shared is not None:
                shared.poll()
            if auth.enabled:
                try:
                    tenant = auth.tenant_of(h)
                    assert tenant is not None
                    auth.admit(tenant)
                except AuthError as e:
                    p.proxy.metrics.observe_tenant(e.tenant, e.reason)
                    return self.refuse(e.status, e.message, e.headers)
                self.tenant = tenant
        self.explain = _may_explain(auth, h, self.tenant)
        if req.request_headers.end_of_stream:  # no body: decided on load
            return await self.decide(req, {}, np.empty(0, dtype=np.uint32), "request_headers")
        return P.continue_headers()

    # -- parse, tokenize, decide ---------------------------------------------------------------
    async def on_request_body(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        from kvroute.serving.common import STAGE_ERRORS
        from kvroute.serving.limits import BodyTooLarge
        from kvroute.serving.request import loads

        body_msg = req.request_body
        if not body_msg.end_of_stream:
            return self.refuse(500, "the endpoint picker needs the whole request body in one "
                                    "message: configure Envoy's ext_proc processing_mode with "
                                    "request_body_mode: BUFFERED")
        raw = body_msg.body
        proxy = self.p.proxy
        limit = proxy.limits.max_body_bytes
        try:
            if limit is not None and len(raw) > limit:
                raise BodyTooLarge(f"request body exceeds max_body_bytes ({limit} bytes)")
            try:
                body = loads(raw) if raw else {}
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"request body must be a JSON object: {e}") from None
            except RecursionError:
                raise ValueError("request body must be a JSON object: it nests too "
                                 "deeply") from None
            if not isinstance(body, dict):
                raise ValueError("request body must be a JSON object, got "
                                 f"{type(body).__name__}")
            tenant = self.tenant
            if tenant is not None and not tenant.model_allowed(body.get("model")):
                return self.refuse(403, f"tenant {tenant.name} may not use model "
                                        f"{body.get('model')!r}", err_type="PermissionDeniedError")
            path = self.path
            if path in _COMPLETIONS or body:
                tokens = await proxy._tokens(path, body)
            else:
                tokens = np.empty(0, dtype=np.uint32)
        except STAGE_ERRORS as e:
            from kvroute.serving.limits import BodyTooLarge as _BTL

            if isinstance(e, _BTL):
                return self.refuse(413, str(e))
            if isinstance(e, ValueError):
                return self.refuse(400, str(e))
            return self.refuse(503, str(e), {"Retry-After": "1"})
        return await self.decide(req, body, tokens, "request_body")

    async def decide(self, req: pb.ProcessingRequest, body: Dict[str, Any], tokens: Any,
                     phase: str) -> pb.ProcessingResponse:
        from kvroute.serving.common import DP_RANK_HEADER, ORCA_FORMAT_HEADER, TENANT_HEADER
        from kvroute.serving.request import select_kwargs

        p = self.p
        proxy = p.proxy
        try:
            hint = P.subset_hint(req)
        except ValueError as e:
            return self.refuse(400, str(e))
        endpoint = p.endpoints_of_workers()
        names = proxy.router._workers
        excluded: Set[str] = set()
        if hint is not None:
            allowed = {n for e in hint for n in p.names_at(e)}
            excluded = {n for n in names if n not in allowed}
            if len(excluded) >= len(names):
                return self.refuse(503, "no endpoint of the subset hint is in the pool "
                                        f"({len(hint)} given)")
        tenant = self.tenant
        kw = select_kwargs(self.headers, body, proxy.model,
                           trusted=tenant is None or tenant.trust_session_key)
        want_scores = self.explain or proxy.decisions is not None
        try:
            d = await proxy._select(tokens, kw, want_scores, excluded)
        except Exception as e:  # _NoWorker: every allowed worker is down
            if type(e).__name__ != "_NoWorker":
                raise
            return self.refuse(503, str(e), {"Retry-After": str(proxy._retry_after_s())})
        self.decision, self.tokens, self.kw = d, tokens, kw
        chosen = [d.worker]
        eps = [endpoint[d.worker]]
        # Fallbacks: the policy's next choices without the ones already listed (dry runs:
        # nothing accounted until one of them serves).
        skip = excluded | proxy._unavailable(names) | {d.worker}
        router = proxy.router
        while len(eps) <= p.fallbacks and len(skip) < len(names):
            try:
                alt = router.select_worker(tokens, exclude=skip, dry_run=True, **kw).worker
            except Exception:  # NoWorkerAvailable: none left
                break
            skip.add(alt)
            if endpoint[alt] not in eps:
                eps.append(endpoint[alt])
                chosen.append(alt)
        self.endpoints, self.workers = eps, chosen
        extra: List[Tuple[str, str]] = []
        worker = names.get(d.worker)
        if worker is not None and worker.dp_rank is not None:
            extra.append((DP_RANK_HEADER, str(worker.dp_rank)))
        if tenant is not None:
            extra.append((TENANT_HEADER, tenant.name))
        if proxy.orca_format and ORCA_FORMAT_HEADER not in self.headers:
            extra.append((ORCA_FORMAT_HEADER, proxy.orca_format))
        remove = [k for k in self.headers
                  if k.startswith("x-kvroute-") or k == DP_RANK_HEADER.lower()]
        if tenant is not None:
            remove.append("authorization")
        if proxy.decisions is not None:
            self.entry = {"request_id": self.headers.get("x-request-id"),
                          "tenant": tenant.name if tenant is not None else None,
                          "path": self.path, "decision": d, "attempts": 1,
                          "endpoints": eps}
            proxy.decisions.record(self.entry)
        p.requests.labels("routed").inc()
        return P.route(eps, phase, extra, remove)

    # -- the response --------------------------------------------------------------------------
    def on_response_headers(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        from kvroute.serving.common import DECISION_HEADER, WORKER_HEADER

        h = P.headers_of(req.response_headers)
        self.status = P.status_of(h)
        d = self.decision
        if d is None:
            return P.continue_headers(True)
        p = self.p
        proxy = p.proxy
        served = P.served_endpoint(req)
        worker = d.worker
        if served is None:
            p.served.labels("unknown").inc()
        elif served == self.endpoints[0]:
            p.served.labels("primary").inc()
        else:
            # The data plane retried down the list: the ones before the served endpoint
            # failed; the load moves to the worker that serves.
            at = self.endpoints.index(served) if served in self.endpoints else -1
            p.served.labels("fallback" if at > 0 else "other").inc()
            for w in self.workers[:at if at > 0 else 1]:
                proxy.breaker_failure(w)
            names = ([self.workers[at]] if at > 0 else p.names_at(served))
            if names:
                worker = names[0]
                self._move_to(worker)
        if self.entry is not None:
            self.entry["served"] = served
            self.entry["status"] = self.status
        if self.status is not None and worker in proxy.router._workers:
            if self.status >= 500:
                proxy.breaker_failure(worker)
            else:
                proxy.breaker_success(worker)
            proxy.metrics.observe_upstream(worker, self.status, time.perf_counter() - self.t0)
            if proxy.orca_format:
                proxy._apply_orca(worker, h)
        ctype = h.get("content-type", "")
        self.report = ("sse" if ctype.startswith("text/event-stream") else "body")
        add = [(WORKER_HEADER, worker)]
        if self.explain:
            import json

            from kvroute.serving.common import decision_dict

            add.append((DECISION_HEADER, json.dumps(decision_dict(
                self.decision, 1, self.headers.get("x-request-id")), separators=(",", ":"))))
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=P._mutation(add))))

    def _move_to(self, worker: str) -> None:
        """Accounts the request's load on ``worker`` (a fallback that served) instead of the
        first choice: the first decision released, the same prompt decided again with every
        other worker excluded (so the served worker is credited with the prompt's blocks)."""
        router = self.p.proxy.router
        router.complete(self.decision)
        others = [n for n in router._workers if n != worker]
        try:
            self.decision = router.select_worker(self.tokens, exclude=others, **self.kw)
        except Exception as e:  # the worker was removed meanwhile
            log.debug("load not moved to %s: %s", worker, e)
            self.decision = None
            return
        if self.entry is not None:
            self.entry["decision"] = self.decision

    def on_response_body(self, msg: pb.HttpBody) -> None:
        """Reads the engine's ``usage`` (delivered cached tokens) from the response body,
        when the data plane sends it (``response_body_mode`` STREAMED or BUFFERED)."""
        if self.decision is None:
            return
        if self.scanner_body is None:
            self.scanner_body = []
        if msg.body:
            self.scanner_body.append(msg.body)

    # -- account -------------------------------------------------------------------------------
    def account(self) -> None:
        """The end of the stream (the HTTP request is over, or Envoy gave up on it): the load
        released, delivered tokens reported, the tenant's slot given back. Idempotent."""
        p = self.p
        proxy = p.proxy
        d, self.decision = self.decision, None
        if d is not None:
            proxy.router.complete(d)
            chunks, self.scanner_body = self.scanner_body, None
            if chunks and isinstance(self.status, int):
                from kvroute.serving.hitrate import report_answer

                try:
                    report_answer(proxy.router, d, self.status, b"".join(chunks),
                                  "text/event-stream" if self.report == "sse" else "",
                                  self.entry)
                except Exception as e:  # noqa: BLE001 - a report never fails the stream
                    log.debug("usage not reported: %s", e)
        tenant, self.tenant = self.tenant, None
        if tenant is not None and p.auth is not None:
            p.auth.release(tenant)
            proxy.metrics.observe_tenant(tenant.name, self.status if self.status else 499)


def _may_explain(auth: Any, headers: Dict[str, str], tenant: Any) -> bool:
    """`kvroute.serving.pipeline.Pipeline.may_explain` (the same rule)."""
    from kvroute.serving.common import EXPLAIN_HEADER

    if headers.get(EXPLAIN_HEADER, "").strip().lower() not in ("1", "true", "yes"):
        return False
    return _explain_rule(auth, headers, tenant)


@functools.lru_cache(maxsize=None)
def _pipeline_cls() -> Any:
    from kvroute.serving.pipeline import Pipeline

    return Pipeline


def _explain_rule(auth: Any, headers: Dict[str, str], tenant: Any) -> bool:
    pl = _pipeline_cls()(None, auth)  # type: ignore[arg-type]
    return bool(pl.may_explain(headers, tenant))
