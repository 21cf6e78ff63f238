"""`EndpointPicker`: the request pipeline of one ext_proc stream, whatever carries it.

One ext_proc stream is one HTTP request. The stages (the same stages and config as
``kvroute serve``'s fronts, `kvroute.serving.pipeline`), each a method of the stream's
`RequestState`:

================== ===================================== ====================================
Envoy sends        stage (`RequestState` method)         answer
================== ===================================== ====================================
request headers    (kept; answered "continue" by the     -
+ buffered body    transport)
                   `decide`: authenticate, admit (API    ``x-gateway-destination-endpoint``
                   keys, tenants' rate and concurrency   header and ``envoy.lb`` metadata:
                   limits), parse (``max_body_bytes``),  the worker, then up to
                   tokenize, decide (the subset hint,    ``fallbacks`` more; or an
                   circuit breakers, health, recovery    ``ImmediateResponse``: 400 / 401 /
                   ramp)                                 403 / 413 / 429 / 503
response headers   `response`: the served endpoint (the  continue (the decision's headers
(if sent)          load moves to a fallback that         when the request may see them)
                   served), breakers, ORCA load report
response body      `body`: the engine's ``usage``        continue
(if sent)          (delivered cached tokens)
end of stream      `account`: the load released, the tenant's slot given back, usage
                   reported
================== ===================================== ====================================

A request without a body (``GET /v1/models``) is decided on load at its headers. Envoy retries
go down the endpoint list without asking again; a route-level retry to another pool opens a
new stream.

The transports: `kvroute.epp.native` (the C++ gRPC server ``kvroute._epp``, default when
built) and `kvroute.epp.grpc_aio` (Python grpcio). Thread-safety: a picker and its states
live on one asyncio event loop.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import numpy as np

from kvroute.epp.protocol import endpoint_of_url

log = logging.getLogger("kvroute.epp")

__all__ = ["EndpointPicker", "RequestState", "Route", "Refusal"]

_COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
#: Envoy's per-request bound on the route's retries (router filter).
MAX_RETRIES_HEADER = "x-envoy-max-retries"
_EMPTY = np.empty(0, dtype=np.uint32)

#: A routing answer: (endpoints ``ip:port[,ip:port...]``, headers to set, headers to remove,
#: headers to add to the response, whether to read the response body).
Route = Tuple[str, List[Tuple[str, str]], List[str], List[Tuple[str, str]], bool]
#: A refusal: (HTTP status, OpenAI-shaped JSON body, response headers).
Refusal = Tuple[int, bytes, List[Tuple[str, str]]]


def _pass_through() -> Any:
    from kvroute.serving.routes import PASS_THROUGH

    return PASS_THROUGH


class EndpointPicker:
    """The picker's state shared by every stream.

    Parameters
    ----------
    proxy:
        The `kvroute.serving.proxy.Proxy` built from the router config: its router, tokenizer,
        limits, circuit breakers, health checks, recovery ramp, load scraping, replicas,
        metrics and decision log are the picker's.
    auth:
        `kvroute.serving.auth.Auth` (tenants, admin key) or None.
    fallbacks:
        Endpoints after the first in the answer, for the data plane's retries (distinct
        endpoints, in the policy's order of preference); default the proxy's ``max_retries``.
    on_change:
        Called with worker name -> ``ip:port`` when the router's workers changed (added or
        removed through the HTTP API or a reload), before the next decision uses them.
    read_body:
        Ask for the response body (delivered cached tokens) when the data plane sends it.

    Raises ValueError for a worker URL that is not ``http://<ip>:<port>``.
    """

    def __init__(self, proxy: Any, auth: Any = None, fallbacks: Optional[int] = None, *,
                 on_change: Optional[Callable[[Dict[str, str]], None]] = None,
                 read_body: bool = True) -> None:
        from prometheus_client import Counter

        from kvroute.serving.pipeline import Pipeline

        self.proxy = proxy
        self.auth = auth
        self._rules = Pipeline(proxy, auth)  # may_explain: the same rule as every front
        self.fallbacks = proxy.max_retries if fallbacks is None else int(fallbacks)
        if self.fallbacks < 0:
            raise ValueError(f"fallbacks must be >= 0, got {fallbacks!r}")
        self.read_body = read_body
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
        self._routed = self.requests.labels("routed")
        self.endpoints_of_workers()

    # -- endpoints -----------------------------------------------------------------------------
    def endpoints_of_workers(self) -> Dict[str, str]:
        """Worker name -> ``ip:port``, rebuilt when the router's worker set changed. Raises
        ValueError for a worker URL whose host is not an IP address."""
        workers = self.proxy.router._workers
        key = (id(workers), len(workers))
        if key != self._known or any(n not in self._endpoint for n in workers):
            ep = {n: endpoint_of_url(w.url) for n, w in workers.items()}
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

    def needs_loop(self, body: Dict[str, Any], raw_size: int) -> bool:
        """Whether deciding a request with this (parsed) body needs the event loop: the
        policy is ``lmcache_aware`` (it waits on the controller), or the prompt is longer than
        the tokenizer's ``inline_chars`` (its thread pools encode those)."""
        proxy = self.proxy
        if getattr(proxy.router, "_lmcache", None) is not None:
            return True
        tok = proxy.tokenizer
        inline = getattr(tok, "inline_chars", None)
        if inline is None or not body:
            return False
        if raw_size <= inline:  # a JSON body holds at most as many characters as bytes
            return False
        from kvroute.prompt.tokenizer import _text_chars

        return bool(_text_chars(body, inline) > inline)

    def state(self) -> RequestState:
        """A new request's state."""
        return RequestState(self)


class _Refused(Exception):
    """A stage's refusal (``answer``: the `Refusal`)."""

    def __init__(self, answer: Refusal) -> None:
        super().__init__(answer[0])
        self.answer = answer


def _error_body(status: int, message: str, err_type: Optional[str] = None) -> bytes:
    from kvroute.serving.common import ERROR_TYPES

    kind = err_type or ERROR_TYPES.get(status, "InternalServerError")
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}).encode()


class RequestState:
    """One request, between the data plane's messages."""

    __slots__ = ("p", "tenant", "path", "decision", "tokens", "kw", "endpoints", "workers",
                 "status", "sse", "entry", "chunks", "t0", "ended", "pending")

    def __init__(self, picker: EndpointPicker) -> None:
        self.p = picker
        self.tenant: Any = None
        self.path = ""
        self.decision: Any = None
        self.tokens: Any = None
        self.kw: Dict[str, Any] = {}
        self.endpoints: List[str] = []
        self.workers: List[str] = []
        self.status: Optional[int] = None
        self.sse = False
        self.entry: Optional[Dict[str, Any]] = None
        self.chunks: Optional[List[bytes]] = None
        self.t0 = time.perf_counter()
        self.ended = False  #: the stream ended (set by the transport)
        self.pending: Optional[Tuple[Dict[str, str], Dict[str, Any], Any]] = None

    def refuse(self, status: int, message: str, headers: Optional[Dict[str, str]] = None,
               err_type: Optional[str] = None) -> Refusal:
        self.p.requests.labels(str(status)).inc()
        hs = [("content-type", "application/json"), *(headers or {}).items()]
        return status, _error_body(status, message, err_type), hs

    # -- authenticate, admit, parse, tokenize, decide ------------------------------------------
    def decide_now(self, headers: Dict[str, str], raw: Optional[bytes],
                   subset: Union[List[str], None, bool]) -> Union[Route, Refusal, None]:
        """The answer to a request (its headers with lower-case names, its whole body or None
        when it has none, the subset hint: None when none was given, False when malformed),
        decided on the caller's thread. None when the rest needs the event loop (a prompt too
        long to tokenize inline, the ``lmcache_aware`` policy): then await `decide_rest`."""
        first = self._begin(headers, raw, subset)
        if not isinstance(first, dict):
            return first
        if self.p.needs_loop(first, len(raw or b"")):
            self.pending = (headers, first, subset)
            return None
        try:
            tokens = self._tokens_now(first)
        except Exception as e:  # noqa: BLE001 - STAGE_ERRORS answered, others re-raised
            return self._stage_error(e)
        try:
            excluded, kw, explain = self._plan(headers, first, subset)
        except _Refused as r:
            return r.answer
        proxy = self.p.proxy
        try:
            d = proxy.select_now(tokens, kw, explain or proxy.decisions is not None, excluded)
        except Exception as e:  # noqa: BLE001 - the proxy's _NoWorker, else re-raised
            return self._no_worker(e)
        return self._answer(headers, d, tokens, kw, excluded, explain)

    async def decide(self, headers: Dict[str, str], raw: Optional[bytes],
                     subset: Union[List[str], None, bool]) -> Union[Route, Refusal]:
        """`decide_now`, with what needs the event loop awaited."""
        first = self.decide_now(headers, raw, subset)
        if first is not None:
            return first
        return await self.decide_rest()

    async def decide_rest(self) -> Union[Route, Refusal]:
        """The rest of a decision `decide_now` left to the event loop."""
        assert self.pending is not None
        headers, body, subset = self.pending
        self.pending = None
        proxy = self.p.proxy
        try:
            tokens = (await proxy._tokens(self.path, body) if self._tokenized(body)
                      else _EMPTY)
        except Exception as e:  # noqa: BLE001 - STAGE_ERRORS answered, others re-raised
            return self._stage_error(e)
        try:
            excluded, kw, explain = self._plan(headers, body, subset)
        except _Refused as r:
            return r.answer
        try:
            d = await proxy._select(tokens, kw, explain or proxy.decisions is not None,
                                    excluded)
        except Exception as e:  # noqa: BLE001 - the proxy's _NoWorker, else re-raised
            return self._no_worker(e)
        return self._answer(headers, d, tokens, kw, excluded, explain)

    def _begin(self, headers: Dict[str, str], raw: Optional[bytes],
               subset: Union[List[str], None, bool]) -> Union[Dict[str, Any], Refusal]:
        """Authenticate, admit, parse: the body (``{}`` for none) or a refusal."""
        from kvroute.serving.auth import AuthError
        from kvroute.serving.limits import BodyTooLarge
        from kvroute.serving.request import loads

        p = self.p
        proxy = p.proxy
        self.path = headers.get(":path", "").split("?", 1)[0]
        auth = p.auth
        if auth is not None:
            if auth.shared is not None:
                auth.shared.poll()
            if auth.enabled:
                try:
                    tenant = auth.tenant_of(headers)
                    assert tenant is not None
                    auth.admit(tenant)
                except AuthError as e:
                    proxy.metrics.observe_tenant(e.tenant, e.reason)
                    return self.refuse(e.status, e.message, e.headers)
                self.tenant = tenant
        if subset is False:
            return self.refuse(400, "envoy.lb.subset_hint / x-gateway-destination-endpoint-"
                                    "subset must be a list of ip:port strings")
        if not raw:
            if self.path in _COMPLETIONS and headers.get(":method", "POST") == "POST":
                return self.refuse(400, f"a {self.path} request needs a JSON body")
            return {}
        limit = proxy.limits.max_body_bytes
        if limit is not None and len(raw) > limit:
            return self._stage_error(BodyTooLarge(
                f"request body exceeds max_body_bytes ({limit} bytes)"))
        try:
            body = loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return self.refuse(400, f"request body must be a JSON object: {e}")
        except RecursionError:
            return self.refuse(400, "request body must be a JSON object: it nests too deeply")
        if not isinstance(body, dict):
            return self.refuse(400, "request body must be a JSON object, got "
                                    f"{type(body).__name__}")
        tenant = self.tenant
        if tenant is not None and not tenant.model_allowed(body.get("model")):
            return self.refuse(403, f"tenant {tenant.name} may not use model "
                                    f"{body.get('model')!r}", None, "PermissionDeniedError")
        return body

    def _tokenized(self, body: Dict[str, Any]) -> bool:
        """Whether the request is routed on its prompt (completions, chat, the pass-through
        routes that carry one); any other route is decided on load."""
        return bool(body) and (self.path in _COMPLETIONS or self.path in _pass_through())

    def _tokens_now(self, body: Dict[str, Any]) -> Any:
        """The prompt's token ids on this thread, within the limits (as
        `kvroute.serving.limits.RequestLimits.tokens_within`)."""
        if not self._tokenized(body):
            return _EMPTY
        from kvroute.prompt import UnsupportedPrompt, prompt_chars
        from kvroute.serving.request import token_id_prompt

        proxy = self.p.proxy
        limits = proxy.limits
        param = "messages" if "messages" in body else "input" if "input" in body else "prompt"
        if limits.max_prompt_chars is not None:
            limits.check_chars(prompt_chars(body, limits.max_prompt_chars), param)
        path = self.path
        tok = proxy.tokenizer
        if path not in _COMPLETIONS:
            from kvroute.serving.routes import prompt_request

            mapped = prompt_request(path, body)
            if mapped is None:
                return _EMPTY
            path, body = mapped
        try:
            if tok is None:
                tokens = token_id_prompt(path, body)
            else:
                try:
                    tokens = tok.encode_request(path, body)
                except RecursionError:
                    raise ValueError("the request nests too deeply to tokenize") from None
                except UnsupportedPrompt:
                    tokens = _EMPTY
        except ValueError:
            if self.path in _COMPLETIONS:
                raise
            tokens = _EMPTY  # a pass-through route's prompt: the engine judges its own API
        limits.check_tokens(len(tokens), param)
        return tokens

    def _stage_error(self, e: BaseException) -> Refusal:
        from kvroute.serving.common import STAGE_ERRORS
        from kvroute.serving.limits import BodyTooLarge

        if not isinstance(e, STAGE_ERRORS):
            raise e
        if isinstance(e, BodyTooLarge):
            return self.refuse(413, str(e))
        if isinstance(e, ValueError):
            return self.refuse(400, str(e))
        return self.refuse(503, str(e), {"Retry-After": "1"})

    def _no_worker(self, e: BaseException) -> Refusal:
        if type(e).__name__ != "_NoWorker":
            raise e
        return self.refuse(503, str(e),
                           {"Retry-After": str(self.p.proxy._retry_after_s())})

    def _plan(self, headers: Dict[str, str], body: Dict[str, Any],
              subset: Union[List[str], None, bool]) -> Tuple[Set[str], Dict[str, Any], bool]:
        """(workers excluded by the subset hint, select keywords, explain); raises _Refused
        (503) when the subset hint leaves no worker."""
        from kvroute.serving.request import select_kwargs

        p = self.p
        names = p.proxy.router._workers
        excluded: Set[str] = set()
        if isinstance(subset, list):
            allowed = {n for e in subset for n in p.names_at(e)}
            excluded = {n for n in names if n not in allowed}
            if len(excluded) >= len(names):
                raise _Refused(self.refuse(503, "no endpoint of the subset hint is in the "
                                                f"pool ({len(subset)} given)"))
        tenant = self.tenant
        kw = select_kwargs(headers, body, p.proxy.model,
                           trusted=tenant is None or tenant.trust_session_key)
        return excluded, kw, p._rules.may_explain(headers, tenant)

    def _answer(self, headers: Dict[str, str], d: Any, tokens: Any, kw: Dict[str, Any],
                excluded: Set[str], explain: bool) -> Route:
        from kvroute.serving.common import (
            DECISION_HEADER,
            DP_RANK_HEADER,
            ORCA_FORMAT_HEADER,
            TENANT_HEADER,
            decision_dict,
        )

        p = self.p
        proxy = p.proxy
        endpoint = p.endpoints_of_workers()
        names = proxy.router._workers
        self.decision, self.tokens, self.kw = d, tokens, kw
        chosen = [d.worker]
        eps = [endpoint[d.worker]]
        if p.fallbacks:
            # The policy's next choices without the ones listed (dry runs: nothing accounted
            # until one of them serves).
            skip = excluded | proxy._unavailable(names) | {d.worker}
            router = proxy.router
            while len(eps) <= p.fallbacks and len(skip) < len(names):
                try:
                    alt = router.select_worker(tokens, exclude=skip, dry_run=True, **kw).worker
                except Exception:  # noqa: BLE001 - NoWorkerAvailable: none left
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
        tenant = self.tenant
        if tenant is not None:
            extra.append((TENANT_HEADER, tenant.name))
        if proxy.orca_format and ORCA_FORMAT_HEADER not in headers:
            extra.append((ORCA_FORMAT_HEADER, proxy.orca_format))
        # The data plane's retries stay on the list: no more than its fallbacks (a route's
        # retry policy may allow more, which would go to endpoints the picker left out).
        extra.append((MAX_RETRIES_HEADER, str(len(eps) - 1)))
        remove = [k for k in headers if k.startswith("x-kvroute-") or k == "x-data-parallel-rank"]
        if tenant is not None:
            remove.append("authorization")
        request_id = headers.get("x-request-id")
        if proxy.decisions is not None:
            self.entry = {"request_id": request_id,
                          "tenant": tenant.name if tenant is not None else None,
                          "path": self.path, "decision": d, "attempts": 1, "endpoints": eps}
            proxy.decisions.record(self.entry)
        response: List[Tuple[str, str]] = []
        if explain:
            response.append((DECISION_HEADER, json.dumps(decision_dict(d, 1, request_id),
                                                         separators=(",", ":"))))
        p._routed.inc()
        return ",".join(eps), extra, remove, response, p.read_body

    # -- the response --------------------------------------------------------------------------
    def response(self, status: Optional[int], served: Optional[str], content_type: str,
                 orca: Optional[str]) -> None:
        """The response headers: ``:status``, the endpoint that served (None / "" when the
        data plane did not say), ``content-type``, the ORCA report header's value."""
        self.status = status
        self.sse = content_type.startswith("text/event-stream")
        d = self.decision
        if d is None:
            return
        p = self.p
        proxy = p.proxy
        worker = d.worker
        if not served:
            p.served.labels("unknown").inc()
        elif served == self.endpoints[0]:
            p.served.labels("primary").inc()
        else:
            # The data plane retried down the list: the endpoints before the one that served
            # failed; the load moves to the worker that serves (not when the data plane
            # answers 5xx itself after the last attempt failed too).
            at = self.endpoints.index(served) if served in self.endpoints else -1
            p.served.labels("fallback" if at > 0 else "other").inc()
            for w in self.workers[:at if at > 0 else 1]:
                proxy.breaker_failure(w)
            names = [self.workers[at]] if at > 0 else p.names_at(served)
            if names:
                worker = names[0]
                if status is not None and status < 500:
                    self._move_to(worker)
        if self.entry is not None:
            self.entry["served"] = served or None
            self.entry["status"] = status
        if status and worker in proxy.router._workers:
            if status >= 500:
                proxy.breaker_failure(worker)
            else:
                proxy.breaker_success(worker)
            proxy.metrics.observe_upstream(worker, status, time.perf_counter() - self.t0)
            if orca and proxy.orca_format:
                proxy._apply_orca(worker, {"endpoint-load-metrics": orca})

    def _move_to(self, worker: str) -> None:
        """Accounts the request's load on ``worker`` (a fallback that served) instead of the
        first choice: the first decision released, the same prompt decided again with every
        other worker excluded (so the served worker is credited with the prompt's blocks)."""
        router = self.p.proxy.router
        router.complete(self.decision)
        others = [n for n in router._workers if n != worker]
        try:
            self.decision = router.select_worker(self.tokens, exclude=others, **self.kw)
        except Exception as e:  # noqa: BLE001 - the worker was removed meanwhile
            log.debug("load not moved to %s: %s", worker, e)
            self.decision = None
            return
        if self.entry is not None:
            self.entry["decision"] = self.decision

    def body(self, chunk: bytes) -> None:
        """A response body chunk (when the data plane sends them): kept for its ``usage``."""
        if self.decision is not None and chunk:
            if self.chunks is None:
                self.chunks = []
            self.chunks.append(chunk)

    # -- account -------------------------------------------------------------------------------
    def account(self) -> None:
        """The end of the stream (the HTTP request is over, or Envoy gave up on it): the load
        released, delivered tokens reported, the tenant's slot given back. Idempotent."""
        p = self.p
        proxy = p.proxy
        d, self.decision = self.decision, None
        if d is not None:
            proxy.router.complete(d)
            chunks, self.chunks = self.chunks, None
            if chunks and self.status is not None:
                from kvroute.serving.hitrate import report_answer

                try:
                    report_answer(proxy.router, d, self.status, b"".join(chunks),
                                  "text/event-stream" if self.sse else "", self.entry)
                except Exception as e:  # noqa: BLE001 - a report never fails the stream
                    log.debug("usage not reported: %s", e)
        tenant, self.tenant = self.tenant, None
        if tenant is not None and p.auth is not None:
            p.auth.release(tenant)
            proxy.metrics.observe_tenant(tenant.name, self.status or 499)
