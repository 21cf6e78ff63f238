"""A prefix-cache block pool modelled on vLLM's (`vllm/v1/core/block_pool.py`).

- A fixed number of blocks. A block is either used by running requests (``ref_cnt > 0``) or
  free. Free blocks sit in an LRU free queue; a free block may still hold a cached prefix.
- Allocating takes the least recently freed block from the head of the queue; if it still
  held a cached prefix, that prefix is evicted (-> ``BlockRemoved``).
- A cache hit on a free cached block takes it out of the queue (``ref_cnt`` 0 -> 1).
- Freeing a request returns its blocks to the tail of the queue (vLLM frees a request's blocks
  in reverse order, so the tail of a prompt is evicted before its head; we do the same).

Block hashes are the simulator's own: 64-bit, per-engine salted, each fixing its whole prefix
(`BlockPool.hash_blocks`), the form vLLM publishes by default (an int per block). The router
cannot recompute them; it must treat them as opaque ids, as with a real engine.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Optional

import numpy as np

_POS_HI = np.arange(1 << 20, dtype=np.uint64) << np.uint64(32)  # token position << 32


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (a bijection); modifies and returns ``x``."""
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


class BlockPool:
    """Blocks of one engine's KV cache.

    Parameters
    ----------
    num_blocks:
        Capacity in blocks (vLLM ``num_gpu_blocks``).
    salt:
        Per-engine secret mixed into every block hash.
    """

    def __init__(self, num_blocks: int, salt: bytes) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.salt = salt
        self._salt64 = np.uint64(int.from_bytes(hashlib.sha256(salt).digest()[:8], "big"))
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[Optional[int]] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        # LRU free queue: block id -> None, oldest first. Starts with every block, empty.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.evicted: list[int] = []  # hashes evicted since the last drain (BlockRemoved)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def hash_blocks(self, tokens: np.ndarray, block_size: int) -> list[int]:
        """The chained hashes of the full blocks of ``tokens``: block ``i``'s hash fixes the
        salt and every token of blocks ``0..i``. A list of ints in [0, 2^64).

        Vectorised: each token is mixed with its position (splitmix64 of ``token | position
        << 32``), the mixes are summed per block and cumulatively (the prefix's key, as
        `kvroute.replay.traces.Trace.infinite_cache_hit_rate` keys prefixes), and each
        prefix key is mixed with the salt's 64 bits. O(tokens) numpy work, no Python loop.
        """
        n = len(tokens) // block_size
        if n == 0:
            return []
        m = n * block_size
        x = np.asarray(tokens[:m], dtype=np.uint64) | _POS_HI[:m] if m <= _POS_HI.size else \
            np.asarray(tokens[:m], dtype=np.uint64) | (np.arange(m, dtype=np.uint64)
                                                      << np.uint64(32))
        e = _mix64(x)
        keys = np.cumsum(e.reshape(n, block_size).sum(axis=1, dtype=np.uint64),
                         dtype=np.uint64)
        keys ^= self._salt64
        return _mix64(keys).tolist()

    def longest_cached_prefix(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def touch(self, block_ids: list[int]) -> None:
        """A request starts using cached blocks (prefix hit)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` blocks from the head of the free queue, evicting cached prefixes.

        REQUIRES: ``n <= num_free``.
        """
        if n > len(self.free):
            raise RuntimeError(f"allocate({n}) with only {len(self.free)} free blocks")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                del self.cached[h]
                self.block_hash[b] = None
                self.evicted.append(h)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def cache(self, block_id: int, h: int) -> bool:
        """Marks a computed full block as cached under hash ``h``. Returns False if an
        identical block is already cached (vLLM keeps the first; no event is emitted)."""
        if h in self.cached:
            return False
        self.cached[h] = block_id
        self.block_hash[block_id] = h
        return True

    def free_blocks(self, block_ids: list[int]) -> None:
        """A request releases its blocks, freed in reverse order (tail evicted first)."""
        for b in reversed(block_ids):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free[b] = None

    def drain_evicted(self) -> list[int]:
        out, self.evicted = self.evicted, []
        return out

    def check(self) -> None:
        """Invariants (used by the tests): every block is either free or referenced, never
        both; the cache map and block_hash agree."""
        for b in range(self.num_blocks):
            assert (self.ref_cnt[b] == 0) == (b in self.free), b
            assert self.ref_cnt[b] >= 0
        for h, b in self.cached.items():
            assert self.block_hash[b] == h
        assert sum(1 for h in self.block_hash if h is not None) == len(self.cached)
