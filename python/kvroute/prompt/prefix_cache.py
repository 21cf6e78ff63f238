"""`PrefixCache`: token ids of rendered chat prefixes, so a conversation's next turn encodes
only what is new (see the class for why this is exact)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["PrefixCache"]


class PrefixCache:
    """Token ids of rendered chat prefixes, so a turn that extends the previous one encodes
    only its new part.

    Exact by construction: ``tokenizers`` splits the input on added tokens before it
    normalizes and pre-tokenizes the pieces between them, so for a cut right before a
    boundary token (a special added token without ``lstrip``, e.g. Qwen3's ``<|im_start|>``)
    ``encode(a + b) == encode(a) + encode(b)`` when no special tokens are added (the chat
    default, ``add_special_tokens=False``). `encode` finds the cached prefix that ends at the
    latest such boundary, encodes the rest up to the last boundary (and stores that prefix:
    in the next turn it is followed by the assistant's answer), then the tail after it. When
    no prefix is cached, the text before the first boundary (the first message: a chat
    application's system prompt, which its other conversations share) is encoded and stored
    on its own too.
    Prefixes are keyed by a BLAKE2b digest of their UTF-8 text, computed incrementally, so
    the lookup costs one pass over the text.

    Parameters
    ----------
    boundaries:
        The boundary token strings.
    max_tokens:
        Bound on the token ids kept over all entries (LRU), >= 1.

    Thread-safe (one lock around the LRU).
    """

    def __init__(self, boundaries: Sequence[str], max_tokens: int = 1 << 22) -> None:
        import re
        import threading
        from collections import OrderedDict

        if not boundaries:
            raise ValueError("PrefixCache needs at least one boundary token")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        self._re = re.compile("|".join(re.escape(b) for b in sorted(boundaries, key=len,
                                                                      reverse=True)))
        self.max_tokens = max_tokens
        self._lru: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._lru)

    def encode(self, text: str, encode: Any, encode_many: Any = None) -> np.ndarray:
        """``encode(text)`` (``str -> uint32 array``, no special tokens added), reusing and
        storing prefixes. ``encode_many`` (``list of str -> list of arrays``, the same
        encoding of each), when given, encodes a miss's pieces in one call."""
        import hashlib

        bounds = [m.start() for m in self._re.finditer(text) if m.start() > 0]
        if not bounds:
            return encode(text)
        h = hashlib.blake2b(digest_size=16)
        digests = []
        prev = 0
        for b in bounds:
            h.update(text[prev:b].encode("utf-8", "surrogatepass"))
            digests.append(h.copy().digest())
            prev = b
        hit, head = -1, None
        with self._lock:
            for i in range(len(bounds) - 1, -1, -1):
                head = self._lru.get(digests[i])
                if head is not None:
                    self._lru.move_to_end(digests[i])
                    hit = i
                    break
        last = len(bounds) - 1
        tail = text[bounds[last]:]
        if hit == last:
            self.hits += 1
            assert head is not None
            return np.concatenate([head, encode(tail)])
        if hit >= 0:
            self.hits += 1
        else:
            self.misses += 1
        # Nothing cached: keep the first message on its own as well (a chat application's
        # system prompt, which its other conversations start with).
        first = hit < 0 and last >= 2
        start = bounds[0] if first else bounds[hit] if hit >= 0 else 0
        pieces = ([text[:bounds[0]]] if first else []) + [text[start:bounds[last]], tail]
        ids = (list(encode_many(pieces)) if encode_many is not None
               else [encode(p) for p in pieces])
        if first:
            head = ids.pop(0)
            self._put(digests[0], head)
        head = ids[0] if head is None else np.concatenate([head, ids[0]])
        self._put(digests[last], head)
        return np.concatenate([head, ids[1]])

    def _put(self, key: bytes, ids: np.ndarray) -> None:
        if len(ids) > self.max_tokens:
            return
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._lru[key] = ids
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                _, dropped = self._lru.popitem(last=False)
                self._tokens -= len(dropped)
