"""Cheap bounds on a request's prompt size, counted without tokenizing: `prompt_chars` (the
long-prompt lane, the ``max_prompt_chars`` limit) and the inline-or-pool decision of
`kvroute.prompt.PromptTokenizer.aencode_request`. Every count stops once past its limit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["prompt_chars"]

_INLINE_MAX_MESSAGES = 64
_INLINE_MAX_DEPTH = 4  # nesting counted by _chars; deeper goes to the pool


def _chars(x: Any, limit: int, depth: int = 0) -> int:
    """Characters of the strings in ``x`` (a string, or lists / dicts of them nested at most
    ``_INLINE_MAX_DEPTH`` deep), counted until past ``limit``. A list longer than ``limit``
    (e.g. token ids), deeper nesting or another object counts as past the limit."""
    if isinstance(x, str):
        return len(x)
    if x is None or isinstance(x, (bool, int, float)):
        return 0
    if depth >= _INLINE_MAX_DEPTH or not isinstance(x, (list, tuple, Mapping)):
        return limit + 1
    items = x.values() if isinstance(x, Mapping) else x
    if len(x) > limit:
        return limit + 1
    total = 0
    for item in items:
        total += _chars(item, limit - total, depth + 1)
        if total > limit:
            break
    return total


def _text_chars(body: Mapping[str, Any], limit: int) -> int:
    """Characters of prompt text in a request body, counted until past ``limit``: a cheap
    bound on the tokenization cost that decides inline or pool (`aencode_request`).

    ``prompt``: its strings, also inside (nested) lists; a token-id list counts its length
    only when past ``limit``. ``messages``: every string of every message (content, content
    parts, reasoning, name). Counts as past the limit: ``tools``, ``documents``, a message
    with ``tool_calls``, more than ``_INLINE_MAX_MESSAGES`` messages, anything malformed."""
    if not isinstance(body, Mapping):
        return limit + 1
    prompt = body.get("prompt")
    if prompt is not None:
        return _chars(prompt, limit)
    messages = body.get("messages")
    if (not isinstance(messages, list) or len(messages) > _INLINE_MAX_MESSAGES
            or body.get("tools") or body.get("documents")):
        return limit + 1
    total = 0
    for m in messages:
        if not isinstance(m, Mapping) or m.get("tool_calls"):
            return limit + 1
        total += _chars(m, limit - total)
        if total > limit:
            break
    return total


def prompt_chars(body: Any, limit: int) -> int:
    """Characters of every string in a request's ``prompt``, ``messages``, ``input``,
    ``tools`` and ``documents`` (any nesting; a list of token ids counts its length), counted
    until past ``limit``: the size that decides the long-prompt lane and the
    ``max_prompt_chars`` check. Never raises."""
    total = 0
    stack = [body.get(k) for k in ("prompt", "messages", "input", "tools", "documents",
                                   "system", "instructions")] if isinstance(body, Mapping) \
        else [body]
    while stack and total <= limit:
        x = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            if x and all(isinstance(t, int) for t in x[:16]):
                total += len(x)
            else:
                stack.extend(x)
    return total
