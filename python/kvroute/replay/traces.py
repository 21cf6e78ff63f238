"""Request traces for replaying against a router: real (Mooncake, MT-Bench) and synthetic.

A `Trace` is an arrival-ordered list of `Request` objects, each carrying the prompt as
token ids, so the router's prefix matching sees the same sharing structure the workload has.

Sources
-------
* `load_mooncake` — the Mooncake FAST'25 conversation trace (kvcache-ai/Mooncake,
  Apache-2.0): real arrival times and lengths; its anonymised 512-token prefix-block ids are
  expanded to deterministic *pseudo*-token ids (no real text exists in the trace).
* `load_mt_bench` — the 80 two-turn MT-Bench questions (lm-sys/FastChat, Apache-2.0) rendered
  with Qwen3's chat template and tokenized with the real Qwen3 tokenizer. Arrival times are
  synthetic and the assistant's first answer is a deterministic stand-in text.
* `synthetic_conversations` — fully synthetic multi-turn chats over shared system prompts.
* `load_jsonl` — a trace file of your own traffic, one JSON object per line, in one of
  `TRACE_FORMATS` (detected from the first line's keys, or given):

  - ``openai`` (`load_openai_jsonl`): ``{"timestamp": s, "body": {...}, "path":
    "/v1/chat/completions" | "/v1/completions", "session_id": str, "user": str,
    "output_length": int}``, only ``timestamp`` and ``body`` required; bodies tokenized by
    `kvroute.prompt.PromptTokenizer.encode_request` (the model's chat template, as
    the serving proxy and vLLM do).
  - ``tokens`` (`load_tokens_jsonl`): ``{"timestamp": s, "prompt_token_ids": [int, ...],
    "output_length": int, "session_id": str}``.
  - ``mooncake`` (`load_mooncake`): ``{"timestamp": ms, "input_length": int,
    "output_length": int, "hash_ids": [int, ...]}``.

  Timestamps of ``openai`` and ``tokens`` are seconds from any origin (shifted so the first
  request arrives at 0); Mooncake's are milliseconds from the trace start. The full schema:
  ``python/kvroute/replay/README.md``.

Real data is read from a directory given by argument, else from the environment variable
``KVROUTE_SHARED_DATA``; with neither, a loader that needs it raises FileNotFoundError.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from kvroute._shared_data import shared_data_dir

# One implementation of transformers' chat-template rendering, shared with the serving
# tokenizer; re-exported here (it is in __all__).
from kvroute.prompt import render_chat_template

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "MOONCAKE_FILE",
    "MT_BENCH_FILE",
    "QWEN3_REGULAR_VOCAB",
    "Request",
    "TRACE_FORMATS",
    "Trace",
    "default_data_dir",
    "default_tokenizer_dir",
    "detect_format",
    "access_log_to_openai",
    "load_jsonl",
    "load_mooncake",
    "load_mt_bench",
    "load_openai_jsonl",
    "load_tokens_jsonl",
    "load_trace",
    "mooncake_block_tokens",
    "render_chat_template",
    "synthetic_conversations",
]

PathLike = Union[str, "os.PathLike[str]"]

#: Tokens per Mooncake ``hash_ids`` block.
MOONCAKE_BLOCK_TOKENS = 512
#: Number of regular (non-special) Qwen3 tokens; pseudo-token ids are drawn from [0, this).
QWEN3_REGULAR_VOCAB = 151_643
#: File names inside the shared data directory.
MOONCAKE_FILE = "mooncake_conversation_trace.jsonl"
MT_BENCH_FILE = "mt_bench_question.jsonl"
QWEN3_TOKENIZER_SUBDIR = "tokenizers/qwen3"

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
# Salt so the Mooncake pseudo-tokens are not a plain splitmix64 stream of the block index.
_MOONCAKE_SALT = _U64(0x6B76726F7574652D)  # "kvroute-"


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


_BLOCK_POS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=_U64)


def mooncake_block_tokens(hash_ids: Sequence[int], input_length: int) -> np.ndarray:
    """Expand Mooncake prefix-block ids into ``input_length`` deterministic pseudo-tokens.

    Token ``p`` (0..511) of block id ``h`` is
    ``splitmix64((h << 9 | p) + salt) mod 151643`` — a pure function of ``(h, p)``, so equal
    ids give equal 512-token blocks, different ids give (with overwhelming probability)
    different blocks, and any block size dividing 512 keeps the trace's sharing structure.

    Parameters
    ----------
    hash_ids:
        The request's block ids (non-negative, < 2^55).
    input_length:
        Prompt length in tokens; the last block is cut to
        ``input_length - 512 * (len(hash_ids) - 1)`` tokens.

    Returns
    -------
    np.ndarray
        ``np.uint32`` array of length ``input_length``.
    """
    nb = len(hash_ids)
    if not (512 * (nb - 1) < input_length <= 512 * nb):
        raise ValueError(
            f"input_length {input_length} does not match {nb} blocks of {MOONCAKE_BLOCK_TOKENS}"
        )
    ids = np.asarray(hash_ids, dtype=_U64)
    x = (ids << _U64(9))[:, None] | _BLOCK_POS[None, :]
    x += _MOONCAKE_SALT
    x = _splitmix64(x).reshape(-1)[:input_length]
    return (x % _U64(QWEN3_REGULAR_VOCAB)).astype(np.uint32)


def default_data_dir() -> Path:
    """The shared data directory: ``$KVROUTE_SHARED_DATA``.

    Raises
    ------
    FileNotFoundError
        ``KVROUTE_SHARED_DATA`` is not set (pass ``data_dir`` to the loader instead).
    """
    return shared_data_dir()


def _data_dir(data_dir: Optional[PathLike]) -> Path:
    d = shared_data_dir(data_dir)
    if not d.is_dir():
        raise FileNotFoundError(
            f"shared data directory {d} not found (pass data_dir or set KVROUTE_SHARED_DATA)"
        )
    return d


def _finish(reqs: List[Tuple[float, np.ndarray, int, str]]) -> List[Request]:
    """Sort ``(arrival_s, tokens, output_length, session)`` by arrival; number them."""
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i][0], i))
    out = []
    for rid, i in enumerate(order):
        arrival, toks, out_len, session = reqs[i]
        toks.flags.writeable = False
        out.append(Request(rid, float(arrival), toks, int(out_len), session))
    return out


# --------------------------------------------------------------------------------------------
# Mooncake
# --------------------------------------------------------------------------------------------


def load_mooncake(path: PathLike, *, limit: Optional[int] = None) -> Trace:
    """Load a Mooncake-format JSONL trace, expanding block ids into pseudo-tokens.

    Parameters
    ----------
    path:
        JSONL file; each line has ``timestamp`` (ms from trace start), ``input_length`` and
        ``output_length`` (tokens) and ``hash_ids`` (512-token prefix-block ids).
    limit:
        Keep only the first ``limit`` requests by arrival (None: all). Only those are
        expanded, so small limits load fast.

    Returns
    -------
    Trace
        ``synthetic=False`` (arrivals and sharing are real; token *values* are pseudo-ids,
        see `mooncake_block_tokens`); ``session=""`` for every request.

    Notes
    -----
    The full conversation trace (12,031 requests, ~145 M tokens) takes a few seconds and
    ~0.6 GB for the token arrays.
    """
    path = Path(path)
    rows: List[Tuple[int, float, int, int, List[int]]] = []
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                o = json.loads(line)
                row = (lineno, float(o["timestamp"]), int(o["input_length"]),
                       int(o["output_length"]), o["hash_ids"])
                if not isinstance(row[4], list) or not all(
                        isinstance(h, int) and h >= 0 for h in row[4]):
                    raise ValueError("hash_ids must be a list of non-negative integers")
                if not math.isfinite(row[1]) or row[3] < 0:
                    raise ValueError("timestamp must be finite and output_length >= 0")
                rows.append(row)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line: {e}") from e
    rows.sort(key=lambda r: r[1])  # stable: file order breaks ties
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        rows = rows[:limit]
    reqs = []
    for lineno, ts_ms, in_len, out_len, hash_ids in rows:
        try:
            reqs.append((ts_ms / 1000.0, mooncake_block_tokens(hash_ids, in_len), out_len, ""))
        except (ValueError, TypeError, OverflowError) as e:
            raise ValueError(f"{path}:{lineno}: not a Mooncake trace line: {e}") from e
    desc = (
        f"Mooncake-format trace {path.name}: real arrival times and prompt/output lengths; "
        f"prompt tokens are deterministic pseudo-ids expanded from the anonymised "
        f"{MOONCAKE_BLOCK_TOKENS}-token prefix-block hash_ids (equal ids -> equal tokens). "
        "Source: kvcache-ai/Mooncake FAST'25 traces, Apache-2.0."
    )
    return Trace(name=path.stem, requests=_finish(reqs), synthetic=False, description=desc)


# --------------------------------------------------------------------------------------------
# Synthetic conversations
# --------------------------------------------------------------------------------------------


def synthetic_conversations(
    *,
    n_conversations: int = 200,
    turns: Tuple[int, int] = (2, 6),
    n_system_prompts: int = 4,
    system_tokens: Tuple[int, int] = (500, 2000),
    user_tokens: Tuple[int, int] = (50, 400),
    output_tokens: Tuple[int, int] = (50, 400),
    think_time_s: Tuple[float, float] = (2.0, 20.0),
    arrival_rate_per_s: float = 2.0,
    seed: int = 0,
) -> Trace:
    """Deterministic multi-turn chats sharing a few system prompts.

    Turn ``k`` of a conversation sends ``system + user_1 + out_1 + ... + out_{k-1} + user_k``
    (random token ids from the regular Qwen3 vocabulary) and asks for ``len(out_k)`` tokens;
    the outputs are generated up front, so turn ``k+1``'s prompt begins with exactly turn
    ``k``'s prompt followed by turn ``k``'s output. Integer ranges are inclusive.

    Parameters
    ----------
    n_conversations:
        Number of conversations.
    turns:
        Inclusive range of turns per conversation.
    n_system_prompts:
        Number of distinct system prompts; each conversation picks one uniformly.
    system_tokens, user_tokens, output_tokens:
        Inclusive length ranges, in tokens, of system prompts, user messages and outputs.
    think_time_s:
        Range, in seconds, of the gap between a turn's arrival and the next turn's arrival.
    arrival_rate_per_s:
        Rate of the Poisson process of conversation starts, per second (the first starts at
        t = 0).
    seed:
        Seed of the generator; equal arguments give identical traces.

    Returns
    -------
    Trace
        ``name="synthetic-conversations"``, ``synthetic=True``, sessions ``"synth-<i>"``.
        The defaults give ~800 requests with prompts up to ~7k tokens over ~2 minutes.
    """
    if n_conversations < 0 or n_system_prompts < 1:
        raise ValueError("n_conversations must be >= 0 and n_system_prompts >= 1")
    if arrival_rate_per_s <= 0:
        raise ValueError(f"arrival_rate_per_s must be > 0, got {arrival_rate_per_s}")
    for nm, (lo, hi) in (("turns", turns), ("system_tokens", system_tokens),
                         ("user_tokens", user_tokens), ("output_tokens", output_tokens),
                         ("think_time_s", think_time_s)):
        if not 0 <= lo <= hi:
            raise ValueError(f"{nm} must be a range (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")
    if turns[0] < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")

    rng = np.random.default_rng(seed)

    def rand_tokens(rng_range: Tuple[int, int]) -> np.ndarray:
        n = int(rng.integers(rng_range[0], rng_range[1] + 1))
        return rng.integers(0, QWEN3_REGULAR_VOCAB, size=n, dtype=np.uint32)

    systems = [rand_tokens(system_tokens) for _ in range(n_system_prompts)]
    gaps = rng.exponential(1.0 / arrival_rate_per_s, size=n_conversations)
    starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n_conversations else gaps
    reqs: List[Tuple[float, np.ndarray, int, str]] = []
    for c in range(n_conversations):
        sys_idx = int(rng.integers(0, n_system_prompts))
        n_turns = int(rng.integers(turns[0], turns[1] + 1))
        history = systems[sys_idx]
        t = float(starts[c])
        for k in range(n_turns):
            if k:
                t += float(rng.uniform(think_time_s[0], think_time_s[1]))
            prompt = np.concatenate([history, rand_tokens(user_tokens)])
            out = rand_tokens(output_tokens)
            reqs.append((t, prompt, len(out), f"synth-{c}"))
            history = np.concatenate([prompt, out])
    desc = (
        f"SYNTHETIC multi-turn conversations (made-up token ids and arrivals; seed {seed}): "
        f"{n_conversations} conversations of {turns[0]}-{turns[1]} turns starting as a Poisson "
        f"process at {arrival_rate_per_s:g}/s, over {n_system_prompts} shared system prompts "
        f"of {system_tokens[0]}-{system_tokens[1]} tokens; each turn's prompt is the previous "
        f"prompt + its {output_tokens[0]}-{output_tokens[1]}-token stand-in output + a new "
        f"{user_tokens[0]}-{user_tokens[1]}-token user message; think time "
        f"{think_time_s[0]:g}-{think_time_s[1]:g} s between turn arrivals."
    )
    return Trace(name="synthetic-conversations", requests=_finish(reqs), synthetic=True,
                 description=desc)


def synthetic_bursts(
    *,
    n_groups: int = 60,
    group_size: int = 8,
    document_tokens: int = 6000,
    question_tokens: Tuple[int, int] = (50, 200),
    output_tokens: Tuple[int, int] = (50, 200),
    burst_window_s: float = 1.0,
    group_gap_s: float = 1.5,
    seed: int = 0,
) -> Trace:
    """Deterministic bursts of requests that share a new long prefix (a document asked
    several questions at once, a batch job, a fan-out agent step).

    Each group is a fresh ``document_tokens``-token prefix followed by ``group_size``
    different questions, arriving uniformly within ``burst_window_s``; groups start every
    ``group_gap_s``. This is the workload where a router that waits for BlockStored events
    spreads a burst over the fleet, and speculative insert keeps it together.

    Returns
    -------
    Trace
        ``name="synthetic-bursts"``, ``synthetic=True``, sessions ``"burst-<group>"``.
    """
    if n_groups < 0 or group_size < 1 or document_tokens < 0:
        raise ValueError("n_groups >= 0, group_size >= 1 and document_tokens >= 0 required")
    rng = np.random.default_rng(seed)
    reqs: List[Tuple[float, np.ndarray, int, str]] = []
    for g in range(n_groups):
        doc = rng.integers(0, QWEN3_REGULAR_VOCAB, size=document_tokens, dtype=np.uint32)
        start = g * group_gap_s
        for t in np.sort(rng.uniform(0.0, burst_window_s, size=group_size)):
            q = rng.integers(0, QWEN3_REGULAR_VOCAB,
                             size=int(rng.integers(question_tokens[0], question_tokens[1] + 1)),
                             dtype=np.uint32)
            out = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
            reqs.append((start + float(t), np.concatenate([doc, q]), out, f"burst-{g}"))
    desc = (f"SYNTHETIC bursts (made-up token ids and arrivals; seed {seed}): {n_groups} groups "
            f"of {group_size} requests sharing a new {document_tokens}-token prefix, each group "
            f"arriving within {burst_window_s:g} s, one group every {group_gap_s:g} s.")
    return Trace(name="synthetic-bursts", requests=_finish(reqs), synthetic=True,
                 description=desc)


# --------------------------------------------------------------------------------------------
# MT-Bench with the Qwen3 chat template
# --------------------------------------------------------------------------------------------


def _stand_in_answer(question_id: int, n_tokens: int, tokenizer: Any, seed: int) -> str:
    """Deterministic placeholder assistant answer of about ``n_tokens`` Qwen3 tokens."""
    words = (
        "the a of to and in is that for it as with on this be by are which from can one "
        "answer first second example result step approach idea point detail reason because "
        "however therefore also more most each other such when where how what why consider "
        "note important simple clear overall finally summary question response"
    ).split()
    rng = np.random.default_rng([seed, question_id])
    head = f"(Stand-in answer {question_id}, not model output.)"
    body = " ".join(words[i] for i in rng.integers(0, len(words), size=max(n_tokens, 1)))
    text = f"{head} {body.capitalize()}."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) > n_tokens:
        text = tokenizer.decode(ids[:n_tokens]).rstrip()
    return text


def load_mt_bench(
    data_dir: Optional[PathLike] = None,
    *,
    tokenizer_dir: Optional[PathLike] = None,
    arrival_rate_per_s: float = 1.0,
    output_tokens: int = 256,
    think_time_s: Tuple[float, float] = (2.0, 10.0),
    chat_template_kwargs: Optional[Dict[str, Any]] = None,
    seed: int = 0,
) -> Trace:
    """The 80 two-turn MT-Bench questions, chat-templated and tokenized for Qwen3.

    Turn 1 sends ``[user: turns[0]]``; turn 2 sends ``[user: turns[0], assistant: answer1,
    user: turns[1]]``, both rendered with ``add_generation_prompt=True`` and tokenized
    without adding special tokens (the template has them). ``answer1`` is a deterministic
    **stand-in** text of ``output_tokens`` tokens, not a real model answer; since it has
    no ``<think>`` block, turn 2's prompt starts with all of turn 1's prompt tokens (with
    ``chat_template_kwargs={"enable_thinking": False}`` turn 1 ends with an empty
    ``<think>\\n\\n</think>\\n\\n`` that Qwen3's template drops from earlier assistant turns,
    so turn 2 shares all but those last 4 tokens).

    Parameters
    ----------
    data_dir:
        Shared data directory holding ``mt_bench_question.jsonl`` (None:
        ``$KVROUTE_SHARED_DATA``, see `default_data_dir`).
    tokenizer_dir:
        Directory with ``tokenizer.json`` and ``tokenizer_config.json`` (default
        ``<data_dir>/tokenizers/qwen3``).
    arrival_rate_per_s:
        Poisson rate of first turns, per second (the first arrives at t = 0).
    output_tokens:
        Tokens to decode per request, and the stand-in answer's length in tokens.
    think_time_s:
        Range, in seconds, of the gap between a question's turn-1 and turn-2 arrivals.
    chat_template_kwargs:
        Extra template variables, as vLLM's ``chat_template_kwargs`` (e.g.
        ``{"enable_thinking": False}``).
    seed:
        Seed for arrivals and stand-in answers.

    Returns
    -------
    Trace
        ``name="mt-bench"``, 160 requests, ``synthetic=False`` (real prompt text, made-up
        arrivals), sessions ``"mtbench-<question_id>"``.
    """
    from tokenizers import Tokenizer

    d = _data_dir(data_dir)
    tdir = Path(tokenizer_dir) if tokenizer_dir is not None else d / QWEN3_TOKENIZER_SUBDIR
    tokenizer = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    with (tdir / "tokenizer_config.json").open("r", encoding="utf-8") as f:
        config = json.load(f)
    with (d / MT_BENCH_FILE).open("r", encoding="utf-8") as f:
        questions = [json.loads(line) for line in f if line.strip()]

    if arrival_rate_per_s <= 0:
        raise ValueError(f"arrival_rate_per_s must be > 0, got {arrival_rate_per_s}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / arrival_rate_per_s, size=len(questions))
    starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    thinks = rng.uniform(think_time_s[0], think_time_s[1], size=len(questions))

    def encode(messages: List[Dict[str, str]]) -> np.ndarray:
        text = render_chat_template(messages, config, add_generation_prompt=True,
                                    **(chat_template_kwargs or {}))
        return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    reqs: List[Tuple[float, np.ndarray, int, str]] = []
    for q, t1, think in zip(questions, starts, thinks):
        qid = int(q["question_id"])
        turn1, turn2 = q["turns"][0], q["turns"][1]
        answer1 = _stand_in_answer(qid, output_tokens, tokenizer, seed)
        session = f"mtbench-{qid}"
        msgs1 = [{"role": "user", "content": turn1}]
        msgs2 = msgs1 + [{"role": "assistant", "content": answer1},
                         {"role": "user", "content": turn2}]
        reqs.append((float(t1), encode(msgs1), output_tokens, session))
        reqs.append((float(t1 + think), encode(msgs2), output_tokens, session))
    desc = (
        f"MT-Bench ({len(questions)} real two-turn questions, lm-sys/FastChat, Apache-2.0) "
        "rendered with the Qwen3 chat template and tokenized with the Qwen3 tokenizer. "
        f"Arrivals are synthetic (turn 1 Poisson at {arrival_rate_per_s:g}/s, turn 2 "
        f"{think_time_s[0]:g}-{think_time_s[1]:g} s later; seed {seed}); the assistant's "
        "turn-1 answer inside turn 2's prompt is a deterministic stand-in text."
    )
    return Trace(name="mt-bench", requests=_finish(reqs), synthetic=False, description=desc)


# --------------------------------------------------------------------------------------------
# Your own traffic: token-id JSONL and OpenAI-format request logs
# --------------------------------------------------------------------------------------------


def _records(path: Path) -> List[Tuple[int, Dict[str, Any]]]:
    """``(line number, JSON object)`` for each non-empty line; ValueError naming the line."""
    out = []
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                o = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            if not isinstance(o, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got "
                                 f"{type(o).__name__}")
            out.append((lineno, o))
    return out


def detect_format(record: Dict[str, Any]) -> str:
    """The trace format of one parsed JSONL record, by its keys.

    Returns
    -------
    str
        ``"mooncake"`` (has ``hash_ids``), ``"tokens"`` (has ``prompt_token_ids``) or
        ``"openai"`` (has ``body``).

    Raises
    ------
    ValueError
        None of those keys.
    """
    for key, fmt in (("hash_ids", "mooncake"), ("prompt_token_ids", "tokens"),
                     ("body", "openai")):
        if key in record:
            return fmt
    raise ValueError(f"cannot tell the trace format from the keys {sorted(record)}: a record "
                     "needs 'hash_ids' (mooncake), 'prompt_token_ids' (tokens) or 'body' "
                     "(openai); or pass the format")


def _timestamp(o: Dict[str, Any]) -> float:
    t = o.get("timestamp")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ValueError(f"'timestamp' must be a finite number of seconds, got {t!r}")
    return float(t)


def _output_length(o: Dict[str, Any], body: Optional[Dict[str, Any]], default: int) -> int:
    n = o.get("output_length")
    if n is None and body is not None:
        n = body.get("max_completion_tokens", body.get("max_tokens"))
    if n is None:
        return default
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"'output_length' must be an int >= 0, got {n!r}")
    return n


def _session(o: Dict[str, Any], body: Optional[Dict[str, Any]]) -> str:
    for v in (o.get("session_id"), o.get("user"), body.get("user") if body else None):
        if v is not None:
            if not isinstance(v, (str, int)) or isinstance(v, bool):
                raise ValueError(f"'session_id' / 'user' must be a string, got {v!r}")
            return str(v)
    return ""


def _by_arrival(path: Path, records: List[Tuple[int, Dict[str, Any]]], limit: Optional[int]
                ) -> List[Tuple[int, float, Dict[str, Any]]]:
    """Records with their timestamps (shifted so the first arrives at 0), sorted by arrival
    (file order breaks ties), cut to ``limit``."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    rows = []
    for lineno, o in records:
        try:
            rows.append((lineno, _timestamp(o), o))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from e
    rows.sort(key=lambda r: r[1])
    t0 = rows[0][1] if rows else 0.0
    return [(ln, t - t0, o) for ln, t, o in rows[:limit]]


def load_tokens_jsonl(path: PathLike, *, limit: Optional[int] = None,
                      output_tokens: int = 256) -> Trace:
    """Load a token-id JSONL trace (one request per line, see the module docstring).

    Parameters
    ----------
    path:
        JSONL file; each line ``{"timestamp": s, "prompt_token_ids": [int, ...],
        "output_length": int, "session_id": str}`` (the last two optional).
    limit:
        Keep only the first ``limit`` requests by arrival (None: all).
    output_tokens:
        Tokens to decode for a line without ``output_length``.

    Returns
    -------
    Trace
        ``synthetic=False``, arrivals shifted so the first is at 0 s.

    Raises
    ------
    ValueError
        A malformed line (the message names ``path:line``).
    """
    path = Path(path)
    reqs: List[Tuple[float, np.ndarray, int, str]] = []
    for lineno, t, o in _by_arrival(path, _records(path), limit):
        try:
            ids = o.get("prompt_token_ids")
            if not isinstance(ids, list) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32
                    for x in ids):
                raise ValueError("'prompt_token_ids' must be a list of token ids in [0, 2^32)")
            reqs.append((t, np.asarray(ids, dtype=np.uint32), _output_length(o, None,
                         output_tokens), _session(o, None)))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from e
    desc = (f"token-id trace {path.name}: real prompts (token ids as recorded) and arrival "
            "times from the file.")
    return Trace(name=path.stem, requests=_finish(reqs), synthetic=False, description=desc)


def default_tokenizer_dir(data_dir: Optional[PathLike] = None) -> Path:
    """``<shared data>/tokenizers/qwen3``, the tokenizer an OpenAI-format trace uses unless one
    is given. FileNotFoundError when the shared data directory is not set or lacks it."""
    d = shared_data_dir(data_dir) / QWEN3_TOKENIZER_SUBDIR
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {d}")
    return d


def load_openai_jsonl(path: PathLike, *, tokenizer_dir: Optional[PathLike] = None,
                      data_dir: Optional[PathLike] = None, limit: Optional[int] = None,
                      output_tokens: int = 256,
                      default_chat_template_kwargs: Optional[Dict[str, Any]] = None) -> Trace:
    """Load an OpenAI-format request log, tokenized as the serving proxy tokenizes.

    Parameters
    ----------
    path:
        JSONL file; each line ``{"timestamp": s, "path": "/v1/chat/completions" |
        "/v1/completions", "body": {...}, "session_id": str, "user": str, "output_length":
        int}``; only ``timestamp`` and ``body`` are required (see the module docstring).
    tokenizer_dir:
        The engines' model: a directory with ``tokenizer.json`` and
        ``tokenizer_config.json`` (its ``chat_template``). None: `default_tokenizer_dir`.
    data_dir:
        Shared data directory for the default tokenizer (None: ``$KVROUTE_SHARED_DATA``).
    limit:
        Keep only the first ``limit`` requests by arrival (None: all); only those are
        tokenized.
    output_tokens:
        Tokens to decode for a line with neither ``output_length`` nor the body's
        ``max_completion_tokens`` / ``max_tokens``.
    default_chat_template_kwargs:
        The engine's ``--default-chat-template-kwargs``.

    Returns
    -------
    Trace
        ``synthetic=False``; prompts are the token ids
        `kvroute.prompt.PromptTokenizer.encode_request` gives (what vLLM
        prefills), arrivals shifted so the first is at 0 s.

    Raises
    ------
    ValueError
        A malformed line or a body the tokenizer cannot encode (the message names
        ``path:line``); an unreadable tokenizer.
    FileNotFoundError
        No ``tokenizer_dir`` and no shared data tokenizer.
    """
    from kvroute.prompt import (
        CHAT_COMPLETIONS_PATH,
        COMPLETIONS_PATH,
        PromptTokenizer,
    )

    path = Path(path)
    rows = _by_arrival(path, _records(path), limit)
    if tokenizer_dir is not None:
        tdir = Path(tokenizer_dir)
    else:
        try:
            tdir = default_tokenizer_dir(data_dir)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"{path}: an OpenAI-format trace is tokenized with the engines' model "
                f"tokenizer: give its directory (--tokenizer DIR, or tokenizer_dir=); {e}") from e
    reqs: List[Tuple[float, np.ndarray, int, str]] = []
    with PromptTokenizer.from_dir(
            tdir, default_chat_template_kwargs=default_chat_template_kwargs) as tok:
        for lineno, t, o in rows:
            try:
                body = o.get("body")
                if not isinstance(body, dict):
                    raise ValueError("'body' must be a JSON object (the request body)")
                route = o.get("path")
                if route is None:
                    route = CHAT_COMPLETIONS_PATH if "messages" in body else COMPLETIONS_PATH
                tokens = tok.encode_request(route, body)
                reqs.append((t, tokens, _output_length(o, body, output_tokens),
                             _session(o, body)))
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
    desc = (f"OpenAI-format request log {path.name}: real prompts and arrival times, "
            f"tokenized with the chat template and tokenizer in {tdir}.")
    return Trace(name=path.stem, requests=_finish(reqs), synthetic=False, description=desc)


#: Formats of a trace file (`load_jsonl`'s ``format``).
def access_log_to_openai(lines: Iterable[str]) -> Tuple[List[Dict[str, Any]], Dict[str, int]]:
    """The proxy's access log (the ``kvroute.access`` JSON lines, written with
    ``serving.access_log_bodies: true``; see `kvroute.serving.routes`) as ``openai``-format
    trace records.

    Parameters
    ----------
    lines:
        The log's lines; each access line is a JSON object, possibly after a logging prefix
        (the text before its first ``{`` is ignored). Other lines are skipped.

    Returns
    -------
    (records, skipped)
        ``records``: ``{"timestamp", "path", "body", "session_id"?}`` per successful (status
        < 400) POST to ``/v1/chat/completions`` or ``/v1/completions`` with a logged body, in
        log order; ``timestamp`` = the line's ``ts`` (Unix seconds, written when the response
        ended) minus its ``latency_ms``: the arrival. ``skipped``: counts by reason
        (``not_access_line``, ``other_route``, ``error_status``, ``no_body``).
    """
    records: List[Dict[str, Any]] = []
    skipped = {"not_access_line": 0, "other_route": 0, "error_status": 0, "no_body": 0}
    for line in lines:
        start = line.find("{")
        try:
            o = json.loads(line[start:]) if start >= 0 else None
        except ValueError:
            o = None
        if not isinstance(o, dict) or "request_id" not in o or "ts" not in o:
            skipped["not_access_line"] += line.strip() != ""
            continue
        if o.get("method") != "POST" or o.get("path") not in ("/v1/chat/completions",
                                                               "/v1/completions"):
            skipped["other_route"] += 1
            continue
        if not isinstance(o.get("status"), int) or o["status"] >= 400:
            skipped["error_status"] += 1
            continue
        if not isinstance(o.get("body"), dict):
            skipped["no_body"] += 1
            continue
        rec: Dict[str, Any] = {
            "timestamp": round(float(o["ts"]) - float(o.get("latency_ms") or 0.0) / 1000.0, 6),
            "path": o["path"], "body": o["body"]}
        if o.get("session_id"):
            rec["session_id"] = str(o["session_id"])
        records.append(rec)
    return records, skipped


TRACE_FORMATS = ("auto", "mooncake", "tokens", "openai")


def load_jsonl(path: PathLike, format: str = "auto", *, limit: Optional[int] = None,
               **kw: Any) -> Trace:
    """Load a JSONL trace file in one of `TRACE_FORMATS`.

    Parameters
    ----------
    path:
        The file.
    format:
        ``"auto"`` (by the first record's keys, see `detect_format`), ``"mooncake"``
        (`load_mooncake`), ``"tokens"`` (`load_tokens_jsonl`) or ``"openai"``
        (`load_openai_jsonl`).
    limit:
        Keep only the first ``limit`` requests by arrival (None: all).
    **kw:
        Passed to the loader (``tokenizer_dir``, ``data_dir``, ``output_tokens``,
        ``default_chat_template_kwargs`` for openai; ``output_tokens`` for tokens).

    Raises
    ------
    ValueError
        Unknown format, undetectable or malformed records (naming ``path:line``).
    FileNotFoundError, OSError
        The file cannot be read.
    """
    path = Path(path)
    if format not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {format!r}; one of {', '.join(TRACE_FORMATS)}")
    if format == "auto":
        with path.open("r", encoding="utf-8") as f:
            first = next(((n, ln) for n, ln in enumerate(f, 1) if ln.strip()), None)
        if first is None:
            return Trace(name=path.stem, requests=[], synthetic=False,
                         description=f"empty trace {path.name}")
        try:
            o = json.loads(first[1])
            if not isinstance(o, dict):
                raise ValueError(f"expected a JSON object, got {type(o).__name__}")
            format = detect_format(o)
        except ValueError as e:
            raise ValueError(f"{path}:{first[0]}: {e}") from e
    if format == "mooncake":
        return load_mooncake(path, limit=limit)
    if format == "tokens":
        return load_tokens_jsonl(path, limit=limit,
                                 **{k: v for k, v in kw.items() if k == "output_tokens"})
    return load_openai_jsonl(path, limit=limit, **kw)


# --------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------


def load_trace(spec: Optional[str], data_dir: Optional[PathLike] = None, *,
               format: str = "auto", **kw: Any) -> Trace:
    """Load a trace by name or path.

    Parameters
    ----------
    spec:
        ``None`` or ``"synthetic"``: `synthetic_conversations`; ``"bursts"``:
        `synthetic_bursts`; ``"mooncake"``: the Mooncake
        conversation trace in the data directory; ``"mt_bench"`` (or ``"mt-bench"``):
        `load_mt_bench`; anything else: path to a JSONL trace file (`load_jsonl`).
    data_dir:
        Shared data directory (None: ``$KVROUTE_SHARED_DATA``).
    format:
        For a file: one of `TRACE_FORMATS` (default ``"auto"``).
    **kw:
        Passed to the loader. ``limit`` (max requests, by arrival) is accepted for every
        source.

    Returns
    -------
    Trace
    """
    limit = kw.pop("limit", None)
    if spec is None or spec == "synthetic":
        return synthetic_conversations(**kw).limit(limit)
    if spec == "bursts":
        return synthetic_bursts(**kw).limit(limit)
    if spec == "mooncake":
        return load_mooncake(_data_dir(data_dir) / MOONCAKE_FILE, limit=limit, **kw)
    if spec in ("mt_bench", "mt-bench"):
        return load_mt_bench(data_dir, **kw).limit(limit)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {spec!r} is neither 'synthetic', 'bursts', 'mooncake', 'mt_bench' nor an "
            "existing file"
        )
    if data_dir is not None:
        kw.setdefault("data_dir", data_dir)
    return load_jsonl(path, format=format, limit=limit, **kw)
