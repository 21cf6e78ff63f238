"""The proxy's routes beyond completions and chat, request ids, access logs, error shapes.

Pass-through routes (`PASS_THROUGH`): forwarded like completions and chat (routing, retries,
breakers, tenants' limits) to the same path on the chosen worker. Where the body has a prompt
kvroute can tokenize as the engine would, the route is cache-aware (the prompt's token ids
are matched against the index); otherwise it is routed on load (and the session key) alone.
Behind the prefill/decode front (`kvroute.serving.pd`) they go to the decode pool, without a
prefill:

===================  ===========================================================================
``/v1/embeddings``   ``input``: one string or one list of token ids -> a completions prompt
                     (``add_special_tokens`` default True, vLLM's embedding default);
                     ``messages`` -> a chat prompt; several inputs: load only
``/v1/responses``    ``instructions`` (a system message) + ``input``: a string (a user message)
                     or a list of ``{"role", "content"}`` messages whose content is a string or
                     text parts (``input_text`` / ``output_text``) -> a chat prompt; other
                     input items (tool calls, files): load only
``/v1/messages``     Anthropic Messages: ``system`` (string or text blocks) + ``messages``
                     (string or ``text`` blocks) -> a chat prompt; ``tools`` or other blocks:
                     load only
``/tokenize``        ``prompt`` -> completions, ``messages`` -> chat (vLLM's ``/tokenize``)
``/v1/rerank``       load only (a query with many documents: one prompt per pair)
``/detokenize``      load only (no prompt)
===================  ===========================================================================

The chat shapes are approximations of how vLLM's Responses and Anthropic front-ends build
the conversation: a mismatch costs prefix hits, never correctness (the engine gets the body
unchanged).

`RequestContext` (an ASGI middleware, installed by `install`): every request gets a request
id, the first of ``request_id_headers`` the client sent (default ``x-request-id``), else a
generated one in the vLLM router's form (``chatcmpl-`` / ``cmpl-`` / ``req-`` + 24
alphanumerics). It is added to the request as ``x-request-id`` when the client did not send
that field, so it reaches the engine (vLLM takes it as the request id with
``--enable-request-id-headers``), and set on the response (replacing an engine's echo). Each
request then writes one JSON access-log line to the ``kvroute.access`` logger at INFO:
``ts`` (Unix s), ``request_id``, ``method``, ``path``, ``status``, ``ttfb_ms`` (until the
response headers), ``latency_ms`` (until the last byte), ``client``, and for routed requests
``tenant``, ``worker``, ``attempts`` and ``decision`` (``matched_tokens``, ``prompt_tokens``,
``prefill_tokens``, ``policy``, ``reason``, ``fallback``, ``degraded``), or ``cache`` for a
response-cache hit; behind the prefill/decode front ``worker`` and ``decision`` are the
decode worker's, ``prefill_worker`` and ``prefill_decision`` the prefill worker's (null when
the prefill pool was skipped). With ``access_log_bodies`` (config
``serving.access_log_bodies``, off by default: the lines then hold your users' prompts), a
POST to ``/v1/chat/completions`` or ``/v1/completions`` also logs ``body`` (the JSON body as
received; bodies over 16 MiB are left out) and ``session_id`` (the ``x-session-id`` or
``x-user-id`` header, if sent): `kvroute.replay.traces.access_log_to_openai` turns such a log
into a replay trace.

`install` also makes every error the OpenAI shape ``{"error": {"message", "type", "param",
"code"}}``: unknown routes (404), wrong methods (405, with ``Allow``), request validation
(400).
"""

from __future__ import annotations

import json
import logging
import random
import string
import time
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from kvroute.serving import defaults as D

__all__ = ["ACCESS_LOG", "PASS_THROUGH", "RequestContext", "install", "prompt_request",
           "request_id_of"]

ACCESS_LOG = logging.getLogger("kvroute.access")

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_TEXT_PARTS = ("text", "input_text", "output_text")
_ALNUM = string.ascii_letters + string.digits
_RNG = random.Random()  # ids need to be unique, not secret
#: The header a request's id is answered in (and added to the request as), raw.
REQUEST_ID_RAW = D.REQUEST_ID_HEADER.encode("latin-1")

Prompt = Optional[Tuple[str, Dict[str, Any]]]


def _one_input(x: Any) -> Any:
    """A single prompt (string or token-id list) from an embeddings ``input``, else None."""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            return x
        if len(x) == 1:
            return _one_input(x[0])
    return None


def _text(content: Any, kinds: Sequence[str]) -> Optional[str]:
    """A message content as text: a string, or a list of text parts joined with newlines (as
    vLLM joins text parts); None for other parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            if not isinstance(p, Mapping) or p.get("type") not in kinds:
                return None
            t = p.get("text")
            if not isinstance(t, str):
                return None
            out.append(t)
        return "\n".join(out)
    return None


def _embeddings(body: Mapping[str, Any]) -> Prompt:
    if isinstance(body.get("messages"), list):
        return _CHAT, {"messages": body["messages"], "add_generation_prompt": False}
    p = _one_input(body.get("input"))
    if p is None:
        return None
    return _COMPLETIONS, {"prompt": p,
                          "add_special_tokens": body.get("add_special_tokens", True)}


def _responses(body: Mapping[str, Any]) -> Prompt:
    msgs = []
    ins = body.get("instructions")
    if isinstance(ins, str) and ins:
        msgs.append({"role": "system", "content": ins})
    inp = body.get("input")
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for item in inp:
            if not isinstance(item, Mapping) or item.get("type", "message") != "message":
                return None
            text = _text(item.get("content"), _TEXT_PARTS)
            role = item.get("role")
            if text is None or not isinstance(role, str):
                return None
            msgs.append({"role": "system" if role == "developer" else role, "content": text})
    else:
        return None
    return _CHAT, {"messages": msgs}


def _messages(body: Mapping[str, Any]) -> Prompt:
    if body.get("tools"):
        return None
    msgs = []
    system = body.get("system")
    if system is not None:
        text = _text(system, ("text",))
        if text is None:
            return None
        msgs.append({"role": "system", "content": text})
    for m in body.get("messages") or []:
        if not isinstance(m, Mapping):
            return None
        text = _text(m.get("content"), ("text",))
        if text is None or not isinstance(m.get("role"), str):
            return None
        msgs.append({"role": m["role"], "content": text})
    if not msgs:
        return None
    return _CHAT, {"messages": msgs}


def _tokenize(body: Mapping[str, Any]) -> Prompt:
    if "messages" in body:
        keep = ("messages", "add_generation_prompt", "continue_final_message", "tools",
                "chat_template_kwargs", "add_special_tokens")
        return _CHAT, {k: body[k] for k in keep if k in body}
    if "prompt" in body:
        return _COMPLETIONS, {"prompt": body["prompt"],
                              "add_special_tokens": body.get("add_special_tokens", True)}
    return None


def _load_only(body: Mapping[str, Any]) -> Prompt:
    return None


#: Pass-through POST routes: path -> ``body -> (completions or chat path, body to tokenize)``
#: or None (route on load alone).
PASS_THROUGH: Dict[str, Callable[[Mapping[str, Any]], Prompt]] = {
    "/v1/embeddings": _embeddings,
    "/v1/responses": _responses,
    "/v1/messages": _messages,
    "/v1/rerank": _load_only,
    "/tokenize": _tokenize,
    "/detokenize": _load_only,
}


def prompt_request(path: str, body: Mapping[str, Any]) -> Prompt:
    """The completions / chat request whose prompt a pass-through request carries, else
    None (also for paths not in `PASS_THROUGH`). Never raises."""
    fn = PASS_THROUGH.get(path)
    if fn is None:
        return None
    try:
        return fn(body)
    except (TypeError, AttributeError, KeyError):
        return None


# -- request ids and access logs -----------------------------------------------------------------

def _generate(path: str) -> str:
    """A request id in the vLLM router's form (``src/middleware.rs`` ``generate_request_id``)."""
    prefix = ("chatcmpl-" if "/chat/completions" in path else "cmpl-" if "/completions" in path
              else "req-")
    return prefix + "".join(_RNG.choices(_ALNUM, k=24))


def request_id_of(scope: Mapping[str, Any]) -> Optional[str]:
    """The request id `RequestContext` gave a request (its ASGI scope), or None."""
    state = scope.get("state")
    return state.get("kvroute_request_id") if isinstance(state, dict) else None


def client_headers(scope: Mapping[str, Any], headers: Mapping[str, str]) -> Mapping[str, str]:
    """``headers`` (a request's, names lower-case) as the client sent them: without the
    ``x-request-id`` `RequestContext` generated for it, if it did (a per-request id is no
    session key)."""
    state = scope.get("state")
    if isinstance(state, dict) and state.get("kvroute_request_id_generated"):
        return {k: v for k, v in headers.items() if k != D.REQUEST_ID_HEADER}
    return headers


class RequestContext:
    """ASGI middleware: request ids and JSON access logs (see the module docstring).

    Parameters
    ----------
    app:
        The ASGI app.
    request_id_headers:
        Header names (case-insensitive) a client's request id is read from, first match wins.
    access_log:
        Write the access log lines (to ``kvroute.access`` at INFO; nothing is formatted when
        that logger does not log INFO).
    access_log_bodies:
        Also log the bodies of completion requests (``body``, ``session_id``).
    """

    def __init__(self, app: Any, request_id_headers: Sequence[str] = D.REQUEST_ID_HEADERS,
                 access_log: bool = D.ACCESS_LOG,
                 access_log_bodies: bool = D.ACCESS_LOG_BODIES) -> None:
        self.app = app
        self.names = [h.lower().encode("latin-1") for h in request_id_headers]
        self.access_log = access_log
        self.access_log_bodies = access_log and access_log_bodies

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = list(scope.get("headers") or [])
        found = {k.lower(): v for k, v in headers if k.lower() in self.names}
        rid: Optional[str] = None
        for n in self.names:
            if n in found:
                rid = found[n].decode("latin-1")
                break
        generated = rid is None
        if rid is None:
            rid = _generate(scope.get("path", ""))
        if REQUEST_ID_RAW not in found:
            headers.append((REQUEST_ID_RAW, rid.encode("latin-1")))
            scope = dict(scope)
            scope["headers"] = headers
        state = scope.setdefault("state", {})
        state["kvroute_request_id"] = rid
        if generated:
            state["kvroute_request_id_generated"] = True
        rid_raw = rid.encode("latin-1")
        meta: Dict[str, Any] = {"status": 499, "ttfb": None}

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                meta["status"] = message["status"]
                meta["ttfb"] = time.perf_counter() - t0
                message = dict(message)
                message["headers"] = [(k, v) for k, v in message.get("headers") or []
                                      if k.lower() != REQUEST_ID_RAW] + [(REQUEST_ID_RAW, rid_raw)]
            await send(message)

        if (self.access_log_bodies and scope.get("method") == "POST"
                and scope.get("path") in (_CHAT, _COMPLETIONS)):
            receive = _body_recorder(receive, meta, headers)
        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            meta["status"] = 500 if meta["ttfb"] is None else meta["status"]
            raise
        finally:
            if self.access_log and ACCESS_LOG.isEnabledFor(logging.INFO):
                ACCESS_LOG.info(_access_line(scope, rid, meta, time.perf_counter() - t0))


_MAX_LOGGED_BODY = 16 << 20  # bytes


def _body_recorder(receive: Any, meta: Dict[str, Any], headers: Sequence[Tuple[bytes, bytes]]
                   ) -> Any:
    """``receive`` that keeps the request body's bytes in ``meta["body"]`` (up to
    _MAX_LOGGED_BODY) and the session header in ``meta["session_id"]``."""
    for k, v in headers:
        if k.lower() in (b"x-session-id", b"x-user-id") and v:
            meta["session_id"] = v.decode("latin-1")
            break
    parts: list = []
    size = [0]

    async def recv() -> Any:
        message = await receive()
        if message.get("type") == "http.request" and size[0] <= _MAX_LOGGED_BODY:
            chunk = message.get("body", b"")
            size[0] += len(chunk)
            parts.append(chunk)
            if not message.get("more_body", False) and size[0] <= _MAX_LOGGED_BODY:
                meta["body"] = b"".join(parts)
        return message

    return recv


def _access_line(scope: Mapping[str, Any], rid: str, meta: Mapping[str, Any],
                 seconds: float) -> str:
    client = scope.get("client")
    entry: Dict[str, Any] = {
        "ts": round(time.time(), 3), "request_id": rid, "method": scope.get("method"),
        "path": scope.get("path"), "status": meta["status"],
        "ttfb_ms": round(meta["ttfb"] * 1000.0, 3) if meta["ttfb"] is not None else None,
        "latency_ms": round(seconds * 1000.0, 3),
        "client": f"{client[0]}:{client[1]}" if client else None}
    state = scope.get("state") or {}
    routed = state.get("kvroute_routed")
    if routed:
        entry.update(routed)
        for key in ("decision", "prefill_decision"):
            d = routed.get(key)
            if d is not None:
                entry[key] = {
                    "matched_tokens": int(d.matched_tokens),
                    "prompt_tokens": int(d.prompt_tokens),
                    "prefill_tokens": int(d.prefill_tokens), "policy": d.policy,
                    "reason": d.reason, "fallback": bool(d.fallback),
                    "degraded": bool(d.degraded)}
    if meta.get("body") is not None:
        try:
            entry["body"] = json.loads(meta["body"])
        except ValueError:
            pass  # not JSON: the proxy answered 400; nothing to replay
        if meta.get("session_id"):
            entry["session_id"] = meta["session_id"]
    return json.dumps(entry, separators=(",", ":"), default=str)


def note_routed(scope: Any, **fields: Any) -> None:
    """The proxy's hook: remember ``tenant``, ``worker``, ``attempts``, ``decision`` (a
    `kvroute.Decision`) or ``cache`` of a request for its access-log line (cheap: the
    decision is turned into JSON only when the line is written); the prefill/decode front
    adds ``prefill_worker`` and ``prefill_decision`` (None when the prefill pool was
    skipped)."""
    state = scope.setdefault("state", {})
    state["kvroute_routed"] = fields


# -- OpenAI-shaped errors --------------------------------------------------------------------------

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                413: "RequestEntityTooLargeError", 422: "BadRequestError"}


def error_response(status: int, message: str, headers: Optional[Mapping[str, str]] = None
                   ) -> Any:
    """``{"error": {"message", "type", "param", "code"}}`` (the shape of
    `kvroute.serving.proxy.error_response`, built here so this module does not import the
    proxy)."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message,
                                   "type": _ERROR_TYPES.get(status, "InternalServerError"),
                                   "param": None, "code": status}},
                        status_code=status, headers=headers)


def install(app: Any, *, request_id_headers: Sequence[str] = D.REQUEST_ID_HEADERS,
            access_log: bool = D.ACCESS_LOG,
            access_log_bodies: bool = D.ACCESS_LOG_BODIES) -> None:
    """Adds `RequestContext` and the OpenAI-shaped error handlers (404, 405, 400 for request
    validation, any other ``HTTPException``) to a FastAPI / Starlette ``app``. Call before the
    app starts."""
    from starlette.exceptions import HTTPException

    async def http_error(request: Any, exc: Any) -> Any:
        status = int(getattr(exc, "status_code", 500))
        detail = getattr(exc, "detail", None)
        if status == 404 and detail in (None, "Not Found"):
            detail = f"no route {request.method} {request.url.path}"
        elif status == 405 and detail in (None, "Method Not Allowed"):
            detail = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(status, str(detail), headers=getattr(exc, "headers", None))

    app.add_exception_handler(HTTPException, http_error)
    try:
        from fastapi.exceptions import RequestValidationError
    except ImportError:  # plain Starlette
        pass
    else:
        async def invalid(request: Any, exc: Any) -> Any:
            return error_response(400, f"invalid request: {exc.errors()}")

        app.add_exception_handler(RequestValidationError, invalid)
    app.add_middleware(RequestContext, request_id_headers=tuple(request_id_headers),
                       access_log=access_log, access_log_bodies=access_log_bodies)
