"""Block keys of a prompt (`block_keys`) and KV-event payload decoding (`decode_batch`), as
the native router computes them; the token-container checks `Router.select_worker` shares."""

from __future__ import annotations

import array
from typing import Any, Optional, Sequence

import msgspec
import numpy as np

from kvroute import _core

__all__ = ["block_keys", "decode_batch"]


# Token containers the binding reads as they are (select_worker's one-argument path).
_PLAIN_TOKENS = (list, np.ndarray, array.array, memoryview)


def _as_tokens(tokens: Any) -> Any:
    # A list (item by item), array.array and memoryview (the buffer protocol) are checked and
    # read by the binding itself (cpp/bindings/convert.h, TokenView).
    if type(tokens) in _PLAIN_TOKENS and type(tokens) is not np.ndarray:
        return tokens
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer token ids, got dtype {arr.dtype}")
    return arr


def _extras(
    cache_salt: Optional[str], extra_keys: Optional[Sequence[Optional[Sequence[Any]]]]
) -> Optional[list]:
    """Per-block extra keys as canonical msgpack bytes (the event path packs the same way)."""
    if cache_salt is None and extra_keys is None:
        return None
    out: list = [None if e is None else msgspec.msgpack.encode(list(e)) for e in (extra_keys or [])]
    if cache_salt is not None:
        salt = msgspec.msgpack.encode([cache_salt])
        if out:
            raise ValueError("pass cache_salt or extra_keys, not both")
        out = [salt]
    return out


def block_keys(
    tokens: Any,
    block_size: int = 16,
    *,
    lora_name: Optional[str] = None,
    cache_salt: Optional[str] = None,
    extra_keys: Optional[Sequence[Optional[Sequence[Any]]]] = None,
) -> np.ndarray:
    """kvroute's chained block keys of a prompt.

    Parameters
    ----------
    tokens:
        1-D token ids, values in ``[0, 2**32)``, in any of these containers (the binding
        reads them in C, cpp/bindings/convert.h; costs in benchmarks/README.md, "The list
        path"):

        * ``list`` of ints, as tokenizers return them (``tokenizers`` ``Encoding.ids``): read
          item by item: on CPython 3.11 the benchmark machine spends 1.68 ns per token more
          than on an array (median of 20 passes, 1.47-2.55); CPython 3.12+ reads small ints
          inline;
        * zero-copy, read in place: a C-contiguous ``numpy.ndarray`` of ``uint32``, an
          ``array.array('I')``, a ``memoryview`` or any buffer object of 4-byte unsigned items
          (format ``'I'``, or ``'L'`` where it is 4 bytes), C-contiguous;
        * other integer dtypes or buffer formats (``int64``, ``array('q')``, strided views):
          range-checked and copied; other sequences (tuples) through ``numpy.asarray``.
    block_size:
        Tokens per block (the engine's ``--block-size``). The trailing partial block has no key.
    lora_name, cache_salt, extra_keys:
        Change the keys, so adapters and salts never alias (see cpp/common/block_key.h).

    Returns
    -------
    numpy.ndarray
        ``uint64``, shape ``(len(tokens) // block_size,)``.

    Raises
    ------
    ValueError
        Non-integer or out-of-range token ids (the message names the position); not 1-D;
        a buffer whose format is not an integer one (the message says which formats are
        read); ``block_size <= 0``.
    """
    return _core.block_keys(
        _as_tokens(tokens), int(block_size), lora_name or "", _extras(cache_salt, extra_keys)
    )


def decode_batch(payload: bytes) -> tuple[Optional[dict], dict]:
    """Decodes one KV-event payload (msgpack) as the ingestion threads do.

    Returns ``(batch, drops)``: ``batch`` is ``{"ts", "data_parallel_rank", "events"}`` or
    ``None`` if the whole payload was dropped; ``drops`` counts dropped parts by reason.
    Integer block hashes come back as unsigned 64-bit ints (a negative int64 from SGLang is
    reinterpreted); ``bin`` hashes as their 16-byte normalised form. String fields
    (``medium``, ``lora_name``, ``locality``, ``kv_cache_spec_kind``) are ``str``, or
    ``bytes`` when the publisher's bytes are not UTF-8 (the event is kept, as `Router.ingest`
    keeps it).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    return _core.decode_batch(bytes(payload))
