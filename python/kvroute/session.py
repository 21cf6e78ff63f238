"""Session keys for the hashing policies (``consistent_hash``, ``rendezvous_hash``).

`session_key` picks the identifier that keeps one conversation / user / tenant on one worker,
with the lookup order of the vLLM router's consistent-hash policy
(github.com/vllm-project/router, ``src/policies/hash_key.rs``: ``SESSION_HEADER_NAMES``,
``extract_hash_key`` and ``extract_session_id``; earlier inline in
``src/policies/consistent_hash.rs``):

1. HTTP headers, case-insensitive, first non-empty value wins:
   ``x-session-id``, ``x-user-id``, ``x-tenant-id``, ``x-correlation-id``, ``x-request-id``,
   ``x-trace-id``. (The vLLM router checks ``x-correlation-id``, which is per session, before
   the per-request ``x-request-id``, and ``x-trace-id`` last; kept here so both routers agree.)
2. Request body (the OpenAI-style JSON object, as a mapping): ``session_params.session_id``,
   ``user`` (OpenAI's end-user field), ``session_id``, ``user_id``. Non-empty strings or
   integers (not booleans).
3. Where the vLLM router hashes the request text, kvroute hashes the prompt's token ids: the
   hex digest of BLAKE2b (8-byte digest) over the first ``prefix_tokens`` ids, each encoded as
   a little-endian uint32. Prompts that share that prefix (a system prompt, a conversation's
   earlier turns) get the same key, whatever their tail.
4. Otherwise ``""`` (the router then hashes the prompt itself).

Explicit identifiers are returned as given (after stripping surrounding whitespace), without
the ``header:`` / ``session:`` / ``user:`` prefixes the vLLM router adds, so a client can use
the same id across headers and body and address its session by it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Optional

import numpy as np

__all__ = ["SESSION_HEADERS", "SESSION_BODY_FIELDS", "session_key", "prefix_hash"]

SESSION_HEADERS = (
    "x-session-id",
    "x-user-id",
    "x-tenant-id",
    "x-correlation-id",
    "x-request-id",
    "x-trace-id",
)
"""Header names checked in order (lower case; matched case-insensitively)."""

SESSION_BODY_FIELDS = (
    ("session_params", "session_id"),
    ("user",),
    ("session_id",),
    ("user_id",),
)
"""Body field paths checked in order, after the headers."""


def _as_id(value: Any) -> Optional[str]:
    """A usable identifier: a non-empty (stripped) string or an int that is not a bool."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("latin-1")
    if isinstance(value, str):
        value = value.strip()
        return value or None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return str(int(value))
    return None


def _from_headers(headers: Mapping[Any, Any]) -> Optional[str]:
    lowered: dict[str, Any] = {}
    for k, v in headers.items():
        if isinstance(k, (bytes, bytearray)):
            k = bytes(k).decode("latin-1")
        if not isinstance(k, str):
            continue
        k = k.strip().lower()
        if k in SESSION_HEADERS and k not in lowered:
            # An empty first occurrence does not hide a later non-empty one.
            if _as_id(v) is not None:
                lowered[k] = v
    for name in SESSION_HEADERS:
        if name in lowered:
            return _as_id(lowered[name])
    return None


def _from_body(body: Mapping[str, Any]) -> Optional[str]:
    for path in SESSION_BODY_FIELDS:
        node: Any = body
        for part in path:
            if not isinstance(node, Mapping) or part not in node:
                node = None
                break
            node = node[part]
        found = _as_id(node)
        if found is not None:
            return found
    return None


def prefix_hash(tokens: Any, prefix_tokens: int = 256) -> str:
    """Hex BLAKE2b-64 of the first ``prefix_tokens`` token ids (little-endian uint32 each).

    ``tokens``: a sequence of ints or a 1-D integer numpy array, ids in ``[0, 2**32)``.
    Returns ``""`` for an empty prompt. The same ids give the same key whatever the container
    or integer dtype.

    Raises
    ------
    ValueError
        Non-integer ids, ids outside ``[0, 2**32)``, not 1-D, or ``prefix_tokens < 1``.
    """
    if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, (int, np.integer)) \
            or prefix_tokens < 1:
        raise ValueError(f"prefix_tokens must be a positive int, got {prefix_tokens!r}")
    if isinstance(tokens, (str, bytes, bytearray)):
        raise ValueError("tokens must be token ids (ints), not text")
    head = tokens[: int(prefix_tokens)]
    arr = head if isinstance(head, np.ndarray) else np.asarray(head)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return ""
    if arr.dtype == object:  # Python ints beyond 64 bits, or mixed types
        items = arr.tolist()
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise ValueError("tokens must be integer token ids")
        lo, hi = min(items), max(items)
    elif arr.dtype.kind in "iu":
        lo, hi = int(arr.min()), int(arr.max())
    else:
        raise ValueError(f"tokens must be integer token ids, got dtype {arr.dtype}")
    if lo < 0 or hi >= 1 << 32:
        raise ValueError(f"token ids must be in [0, 2**32), got values in [{lo}, {hi}]")
    data = (arr.astype("<u4") if arr.dtype != object else np.asarray(items, dtype="<u4")).tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def session_key(
    headers: Optional[Mapping[str, str]],
    body: Optional[Mapping[str, Any]],
    tokens: Any = None,
    *,
    prefix_tokens: int = 256,
) -> str:
    """The session key of one request for ``consistent_hash`` / ``rendezvous_hash``.

    Parameters
    ----------
    headers:
        Request headers (any mapping; names matched case-insensitively; ``bytes`` names and
        values, as ASGI gives them, are decoded as Latin-1). ``None``: none.
    body:
        The parsed JSON body (a mapping). ``None``: none.
    tokens:
        The prompt's token ids (list of ints or 1-D integer numpy array), used when neither
        headers nor body name a session.
    prefix_tokens:
        How many leading token ids the fallback hash covers.

    Returns
    -------
    str
        In order (see the module docstring): the first non-empty of the headers
        ``x-session-id``, ``x-user-id``, ``x-tenant-id``, ``x-correlation-id``,
        ``x-request-id``, ``x-trace-id``; then the body fields ``session_params.session_id``,
        ``user``, ``session_id``, ``user_id``; then `prefix_hash` of the tokens; else ``""``.

    Raises
    ------
    ValueError
        Only from the token fallback (bad token ids or ``prefix_tokens``).
    """
    if headers:
        found = _from_headers(headers)
        if found is not None:
            return found
    if body and isinstance(body, Mapping):
        found = _from_body(body)
        if found is not None:
            return found
    if tokens is not None:
        return prefix_hash(tokens, prefix_tokens)
    return ""
