"""The data types of a replay trace, `Request` and `Trace`, and what every loader shares.

A `Trace` is an arrival-ordered list of `Request` objects, each carrying the prompt as token
ids; `Trace` also computes the cache hit-rate bounds of its workload
(`Trace.infinite_cache_hit_rate`, `Trace.capacity_bound_hit_rate`). The loaders are in
`kvroute.replay.real_traces`, `kvroute.replay.synthetic` and `kvroute.replay.trace_files`;
`kvroute.replay.traces` re-exports them all.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

__all__ = ["PathLike", "QWEN3_REGULAR_VOCAB", "Request", "Trace"]

PathLike = Union[str, "os.PathLike[str]"]

#: Number of regular (non-special) Qwen3 tokens; pseudo-token ids are drawn from [0, this).
QWEN3_REGULAR_VOCAB = 151_643

_U64 = np.uint64


# --------------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Request:
    """One request of a trace.

    Equality and hashing are by identity (``eq=False``): comparing the ``tokens`` arrays
    field-wise would be ambiguous.

    Attributes
    ----------
    request_id:
        Index of the request in its trace's arrival order (0-based).
    arrival_s:
        Arrival time in seconds from the trace start.
    tokens:
        Prompt token ids, 1-D ``np.uint32`` (coerced on construction).
    output_length:
        Number of tokens to decode for this request.
    session:
        Conversation id (for session-affinity policies); ``""`` if unknown.
    """

    request_id: int
    arrival_s: float
    tokens: np.ndarray
    output_length: int
    session: str = ""

    def __post_init__(self) -> None:
        tokens = self.tokens
        if not isinstance(tokens, np.ndarray) or tokens.dtype != np.uint32 or tokens.ndim != 1:
            tokens = np.ascontiguousarray(tokens, dtype=np.uint32).reshape(-1)
            object.__setattr__(self, "tokens", tokens)
        if self.output_length < 0:
            raise ValueError(f"output_length must be >= 0, got {self.output_length}")

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens."""
        return int(self.tokens.shape[0])


@dataclass
class Trace:
    """An arrival-ordered list of requests plus where it came from.

    Attributes
    ----------
    name:
        Short identifier (e.g. ``"mooncake_conversation_trace"``, ``"mt-bench"``).
    requests:
        Requests sorted by ``arrival_s`` with ``request_id`` equal to their index.
    synthetic:
        True when the token contents *and* arrival times are made up (not real data).
    description:
        Human-readable provenance, licence and caveats.
    """

    name: str
    requests: List[Request]
    synthetic: bool
    description: str

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Arrival time of the last request, in seconds (0.0 for an empty trace)."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def total_prompt_tokens(self) -> int:
        """Sum of prompt lengths over all requests, in tokens."""
        return sum(r.prompt_length for r in self.requests)

    def limit(self, n: Optional[int]) -> Trace:
        """The first ``n`` requests (by arrival); the whole trace when ``n`` is None.

        Parameters
        ----------
        n:
            Maximum number of requests to keep (>= 0), or None for all.

        Returns
        -------
        Trace
            A new trace sharing the `Request` objects (token arrays are not copied).
        """
        if n is None or n >= len(self.requests):
            return dataclasses.replace(self, requests=list(self.requests))
        if n < 0:
            raise ValueError(f"limit must be >= 0, got {n}")
        return dataclasses.replace(
            self,
            requests=self.requests[:n],
            description=f"{self.description} [first {n} of {len(self.requests)} requests]",
        )

    def scaled(self, speed: float) -> Trace:
        """The same requests arriving ``speed`` times faster (``arrival_s / speed``).

        Parameters
        ----------
        speed:
            Time compression factor (> 0); 2.0 replays a 60 s trace in 30 s.

        Returns
        -------
        Trace
            A new trace; token arrays are shared, not copied.
        """
        if not (speed > 0 and math.isfinite(speed)):
            raise ValueError(f"speed must be a positive finite number, got {speed}")
        reqs = [dataclasses.replace(r, arrival_s=r.arrival_s / speed) for r in self.requests]
        desc = self.description if speed == 1.0 else f"{self.description} [arrivals x{speed:g}]"
        return dataclasses.replace(self, requests=reqs, description=desc)

    def infinite_cache_hit_rate(self, block_size: int) -> float:
        """Share of prompt tokens one shared, never-evicting prefix cache would serve.

        Requests are taken in list (arrival) order. For each, the hit is the longest prefix
        of *full* blocks of ``block_size`` tokens such that every prefix ``tokens[:k *
        block_size]`` (not just block ``k-1`` alone) occurred in some earlier request; a
        trailing partial block never hits.

        Parameters
        ----------
        block_size:
            KV block size in tokens (> 0).

        Returns
        -------
        float
            Hit tokens / total prompt tokens, in [0, 1] (0.0 for a trace with no tokens).

        Notes
        -----
        Each prefix is identified by a 64-bit key: the wrapping sum over its tokens of
        ``splitmix64(token | position << 32)``, taken at block boundaries (a cumulative sum,
        so no per-block Python). Because a key fixes the whole prefix, "prefix k seen
        earlier" implies all shorter prefixes were seen, and the hit of each request is just
        the count of its keys whose first occurrence is in an earlier request — found for all
        requests at once with one `np.unique`. Collisions are ~2^-64 per pair.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        total, keys, owner = self._block_keys(block_size)
        if total == 0 or keys.size == 0:
            return 0.0
        # `return_index` gives the first occurrence in the flattened (arrival-ordered) array.
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        first_owner = owner[first][inverse.reshape(-1)]
        hit_blocks = int(np.count_nonzero(first_owner < owner))
        return hit_blocks * block_size / total

    def capacity_bound_hit_rate(self, block_size: int, capacity_blocks: int) -> float:
        """Share of prompt tokens the best offline cache of ``capacity_blocks`` blocks could
        serve: Belady's furthest-next-use eviction, with bypass, over one pooled cache.

        Requests are taken in list (arrival) order, each as the sequence of its full blocks'
        prefix keys (as in `infinite_cache_hit_rate`). A block is a hit when its key is cached;
        on a miss the block is cached unless every cached block is needed again sooner
        (evicting the one needed furthest in the future, or never). This is the optimal
        offline policy for a cache of that size (Belady 1966; with bypass, the incoming block
        is one more eviction candidate).

        Why it bounds a fleet: with ``capacity_blocks`` = workers x blocks per worker, the
        union of the workers' caches under any routing and any eviction (vLLM's LRU included)
        holds at most ``capacity_blocks`` blocks, each computed for an earlier request, and a
        request's hit on its worker is a hit in that union; so the union is one admissible
        pooled cache and scores at most the optimum. The bound is looser still because it
        ignores that vLLM's hits stop at the first missing block, that running requests pin
        their blocks, and that a block is only cached once its prefill is done. It assumes
        the requests are served in arrival order; concurrent requests on different workers
        may be served in another order, which can change the optimum slightly.

        Parameters
        ----------
        block_size:
            KV block size in tokens (> 0).
        capacity_blocks:
            Blocks the pooled cache holds (> 0): the fleet's total.

        Returns
        -------
        float
            Hit tokens / total prompt tokens, in [0, `infinite_cache_hit_rate`].

        Notes
        -----
        One Python loop over every block of the trace: the full Mooncake conversation trace
        (12,031 requests, ~9 M blocks of 16 tokens) takes 7-8 s on this 2-core machine (one
        run per capacity).
        """
        import heapq

        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        total, keys, _ = self._block_keys(block_size)
        if total == 0 or keys.size == 0:
            return 0.0
        _, ids = np.unique(keys, return_inverse=True)
        ids = ids.reshape(-1)
        n = ids.size
        order = np.argsort(ids, kind="stable")  # positions grouped by id, ascending
        nxt = np.full(n, n, dtype=np.int64)      # n = never used again
        same = ids[order[:-1]] == ids[order[1:]]
        nxt[order[:-1][same]] = order[1:][same]
        cached: Dict[int, int] = {}  # id -> its next use
        heap: List[Tuple[int, int]] = []  # (-next use, id), stale entries skipped
        hits = 0
        never = n
        for x, nx in zip(ids.tolist(), nxt.tolist()):
            if x in cached:
                hits += 1
                if nx == never:
                    del cached[x]
                else:
                    cached[x] = nx
                    heapq.heappush(heap, (-nx, x))
                continue
            if nx == never:
                continue  # never needed again: bypass
            if len(cached) >= capacity_blocks:
                while cached.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                far, y = heap[0]
                if -far <= nx:
                    continue  # every cached block is needed sooner: bypass
                heapq.heappop(heap)
                del cached[y]
            cached[x] = nx
            heapq.heappush(heap, (-nx, x))
        return hits * block_size / total

    def _block_keys(self, block_size: int) -> Tuple[int, np.ndarray, np.ndarray]:
        """(total prompt tokens, prefix key of every full block in arrival order, index of
        the request each key belongs to)."""
        total = 0
        key_chunks: List[np.ndarray] = []
        owner_chunks: List[np.ndarray] = []
        max_len = max((r.prompt_length for r in self.requests), default=0)
        pos_hi = np.arange(max_len, dtype=_U64) << _U64(32)
        for i, r in enumerate(self.requests):
            n = r.prompt_length
            total += n
            nb = n // block_size
            if nb == 0:
                continue
            m = nb * block_size
            e = _splitmix64(r.tokens[:m].astype(_U64) | pos_hi[:m])
            keys = np.cumsum(e.reshape(nb, block_size).sum(axis=1, dtype=_U64), dtype=_U64)
            key_chunks.append(keys)
            owner_chunks.append(np.full(nb, i, dtype=np.int64))
        if not key_chunks:
            return total, np.empty(0, dtype=_U64), np.empty(0, dtype=np.int64)
        return total, np.concatenate(key_chunks), np.concatenate(owner_chunks)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (a bijection on 64-bit ints); modifies ``x``.

    Parameters
    ----------
    x:
        ``np.uint64`` array; overwritten and returned.
    """
    x += _U64(0x9E3779B97F4A7C15)
    x ^= x >> _U64(30)
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return x


def _finish(reqs: List[Tuple[float, np.ndarray, int, str]]) -> List[Request]:
    """Sort ``(arrival_s, tokens, output_length, session)`` by arrival; number them."""
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i][0], i))
    out = []
    for rid, i in enumerate(order):
        arrival, toks, out_len, session = reqs[i]
        toks.flags.writeable = False
        out.append(Request(rid, float(arrival), toks, int(out_len), session))
    return out
