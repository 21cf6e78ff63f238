"""The pipeline's parse and tokenize stages, and the wait that ends when the client leaves.

- `parse_body`: the raw body (within ``max_body_bytes``) and its JSON object;
- `select_kwargs`: what a request adds to `kvroute.Router.select_worker` (session key, cache
  salt, LoRA name);
- `encode_routed` / `encode_prompt`: the token ids a request is routed on;
- `until_disconnect`: run a dispatch until it answers or the client goes away.

Every front (`kvroute.serving.proxy`, `kvroute.serving.pd`) runs these the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Dict, Mapping, Optional, Tuple

import anyio
import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from kvroute.serving.common import CHAT_PATH
from kvroute.serving.limits import PromptTooLong, read_body
from kvroute.serving.routes import PASS_THROUGH, prompt_request
from kvroute.session import session_key

__all__ = ["parse_body", "select_kwargs", "encode_prompt", "encode_routed", "until_disconnect",
           "loads"]

log = logging.getLogger("kvroute.serving.request")

_decode_json = msgspec.json.Decoder().decode


def loads(raw: bytes) -> Any:
    """``json.loads`` semantics, decoded by msgspec (4.5 -> 0.7 us for a 170-byte chat body,
    60 -> 19 us for 56 kB; this machine): what msgspec refuses (NaN, lone surrogates, a BOM,
    malformed input) is decoded again by ``json.loads``, which accepts it or raises its own
    error."""
    try:
        return _decode_json(raw)
    except (msgspec.DecodeError, RecursionError):
        return json.loads(raw)


def select_kwargs(headers: Mapping[str, str], body: Mapping[str, Any],
                  model: Optional[str] = None, trusted: bool = True) -> Dict[str, Any]:
    """`kvroute.Router.select_worker` keywords of a request: ``session_key``
    (`kvroute.session_key` of the headers and body; ``""`` unless ``trusted``),
    ``cache_salt`` (the body's, which keys the prompt's first block in vLLM) and, when the
    body names a ``model`` other than ``model``, ``lora_name``
    (see `kvroute.serving.proxy.Proxy`)."""
    kw: Dict[str, Any] = {"session_key": session_key(headers, body) if trusted else ""}
    salt = body.get("cache_salt")
    if isinstance(salt, str) and salt:
        kw["cache_salt"] = salt
    requested = body.get("model")
    if model and isinstance(requested, str) and requested and requested != model:
        kw["lora_name"] = requested
    return kw


async def parse_body(request: Request, max_bytes: Optional[int]
                     ) -> Tuple[bytes, Dict[str, Any]]:
    """The raw body (at most ``max_bytes``, `kvroute.serving.limits.read_body`) and its JSON
    object. Raises ValueError for a body that is not a JSON object (or nests too deeply to
    parse), BodyTooLarge, starlette's ClientDisconnect when the client left while sending
    it."""
    raw = await read_body(request, max_bytes)
    try:
        body = loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"request body must be a JSON object: {e}") from None
    except RecursionError:
        raise ValueError("request body must be a JSON object: it nests too deeply") from None
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
    return raw, body


async def encode_prompt(tokenizer: Any, path: str, body: Mapping[str, Any]) -> np.ndarray:
    """The token ids of a completions / chat body (``path``): ``tokenizer.aencode_request``,
    or without a tokenizer `token_id_prompt`. A prompt kvroute cannot tokenize as the
    engine would (`kvroute.prompt.UnsupportedPrompt`) gives an empty array (routed
    without a prefix match). Raises ValueError for a malformed body, TokenizerBusy."""
    if tokenizer is None:
        return token_id_prompt(path, body)
    from kvroute.prompt import UnsupportedPrompt

    try:
        return await tokenizer.aencode_request(path, body)
    except RecursionError:
        raise ValueError("the request nests too deeply to tokenize") from None
    except UnsupportedPrompt as e:
        # Deliberately forwarded, not refused: the engine serves these (batched prompts,
        # prompt_embeds, images, a request chat_template); kvroute just cannot see their
        # blocks, so they route on load / session key like an empty prompt.
        log.debug("routing without a prefix match: %s", e)
        return np.empty(0, dtype=np.uint32)


async def encode_routed(tokenizer: Any, path: str, body: Mapping[str, Any]) -> np.ndarray:
    """The token ids a request is routed on: `encode_prompt` for completions and chat; for a
    pass-through route (`kvroute.serving.routes.PASS_THROUGH`) the prompt its body carries
    (`kvroute.serving.routes.prompt_request`), else an empty array (routed on load). Raises
    ValueError for a malformed completions / chat body, PromptTooLong, TokenizerBusy."""
    if path not in PASS_THROUGH:
        return await encode_prompt(tokenizer, path, body)
    # Cache-aware where the body has a prompt kvroute can tokenize; otherwise (and when it
    # does not tokenize: the engine judges its own API) routed on load.
    mapped = prompt_request(path, body)
    if mapped is None:
        return np.empty(0, dtype=np.uint32)
    try:
        return await encode_prompt(tokenizer, *mapped)
    except PromptTooLong:
        raise
    except ValueError as e:
        log.debug("%s routed on load: %s", path, e)
        return np.empty(0, dtype=np.uint32)


def token_id_prompt(path: str, body: Mapping[str, Any]) -> np.ndarray:
    """Without a tokenizer: a completions prompt given as token ids, else an empty prompt.

    Raises ValueError when the body lacks ``prompt`` (completions) / ``messages`` (chat)."""
    if path == CHAT_PATH:
        if not isinstance(body.get("messages"), list):
            raise ValueError("a chat completions request needs 'messages' (a list)")
        return np.empty(0, dtype=np.uint32)
    if "prompt" not in body:
        raise ValueError("a completions request needs 'prompt'")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
        p = p[0]
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
        if min(p) < 0 or max(p) >= 1 << 32:
            raise ValueError("prompt token ids must be in [0, 2**32)")
        return np.asarray(p, dtype=np.uint32)
    return np.empty(0, dtype=np.uint32)


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Optional[Response]:
    """Runs ``work`` until it returns or the client disconnects (then cancels it and returns
    None), as vLLM's ``with_cancellation`` does. The request body must have been read."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # We are cancelled (the server shuts down, or the app's own cancel scope): the work
        # may already have returned a stream that nobody will send now.
        watcher.cancel()
        task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, return_exceptions=True)
            await _discard(task)
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await _discard(task)  # it may have finished in the same instant
    return None


async def _discard(task: asyncio.Future[Response]) -> None:
    """Releases the response of finished ``work`` that will not be sent: a streaming one
    holds a decision and an upstream connection (its ``release_unsent()``)."""
    if task.cancelled() or task.exception() is not None:
        return
    resp = task.result()
    if hasattr(resp, "release_unsent"):
        await resp.release_unsent()
