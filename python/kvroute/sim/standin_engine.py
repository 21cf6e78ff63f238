"""The engine stand-in's logic without HTTP: `StandinEngine` (tokenize as vLLM does, prefix
cache, admission, deterministic output, KV events, stats) and the `Generation` one request
runs as. `kvroute.sim.standin_app.create_app` serves it over HTTP; `kvroute.sim.server` runs
that as a process.

Thread-safety: `StandinEngine` methods may be called from any thread; one lock guards the
block pool, the counters and the publisher. `StandinEngine.generate` must be iterated on an
asyncio event loop (any loop; admission waiters are woken with ``call_soon_threadsafe``).
"""

import asyncio
import collections
import hashlib
import json
import os
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import (
    Any,
    AsyncGenerator,
    Deque,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Union,
)

import numpy as np

from kvroute import wire
from kvroute._shared_data import shared_data_dir
from kvroute.sim.block_pool import BlockPool
from kvroute.sim.publisher import EventPublisher
from kvroute.sim.vllm_protocol import vllm_chat_messages, vllm_tool_dicts

__all__ = ["DEFAULT_MODEL", "Generation", "StandinEngine", "default_tokenizer_dir"]

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"


def default_tokenizer_dir() -> Path:
    """``$KVROUTE_SHARED_DATA/tokenizers/qwen3``: ``tokenizer.json`` +
    ``tokenizer_config.json`` of Qwen/Qwen3-0.6B (the default ``tokenizer_dir``).

    Raises
    ------
    FileNotFoundError
        ``KVROUTE_SHARED_DATA`` is not set (pass ``tokenizer_dir`` instead).
    """
    return shared_data_dir(arg="tokenizer_dir") / "tokenizers" / "qwen3"


# ------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------

@dataclass
class _Seq:
    """One admitted request: the blocks it pins."""

    blocks: List[int]
    prompt_tokens: int
    cached_tokens: int


class Generation:
    """One request running through `StandinEngine.generate`: an ``AsyncIterator[int]`` of
    output token ids plus what the response's ``usage`` needs.

    Attributes (``cached_tokens`` and ``admitted`` are set when the first token is asked for:
    the request waits for admission, then is prefilled):

    request_id: str
    prompt_tokens: int
    cached_tokens: Optional[int]   prompt tokens reused from the prefix cache (vLLM
                                   ``prompt_tokens_details.cached_tokens``)
    completion_tokens: int         tokens yielded so far
    finish_reason: Optional[str]   ``"length"`` once all ``max_tokens`` were yielded

    ``aclose()``, or cancelling the task iterating it, releases the request's blocks at once
    (an iterator that is merely dropped releases them only when it is garbage-collected).
    `create_app` does so when the client disconnects, for streaming and non-streaming
    requests alike (vLLM aborts both), so a client that leaves frees its KV cache.
    """

    def __init__(self, engine: "StandinEngine", token_ids: List[int], max_tokens: int,
                 request_id: str) -> None:
        self.request_id = request_id
        self.prompt_tokens = len(token_ids)
        self.max_tokens = max_tokens
        self.cached_tokens: Optional[int] = None
        self.completion_tokens = 0
        self.finish_reason: Optional[str] = None
        self.admitted = False
        self._engine = engine
        self._tokens = token_ids
        self._agen = self._run()

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> int:
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        await self._agen.aclose()

    async def _run(self) -> AsyncGenerator[int, None]:
        eng = self._engine
        seq = await eng._admit_async(self._tokens, self.max_tokens, self.request_id)
        self.admitted = True
        self.cached_tokens = seq.cached_tokens
        try:
            out = eng.output_tokens(self._tokens, self.max_tokens)
            for tok in out:
                # Deliberately sleep(0) when there is no delay: other requests still interleave.
                await asyncio.sleep(eng.token_delay_s)
                self.completion_tokens += 1
                eng._count_generated(1)
                yield tok
            self.finish_reason = "length"
        finally:
            eng._release(seq, finished=self.finish_reason is not None)


class StandinEngine:
    """A vLLM engine stand-in without HTTP: tokenizer, prefix cache, KV-event publisher.

    Parameters
    ----------
    model:
        Served model name (``/v1/models``, ``model`` field checks, metric label).
    tokenizer_dir:
        Directory with ``tokenizer.json`` and ``tokenizer_config.json`` (its Jinja
        ``chat_template``); default `default_tokenizer_dir` (Qwen3).
    block_size:
        Tokens per KV block (vLLM ``--block-size``, default 16).
    capacity_blocks:
        KV cache size in blocks (vLLM ``num_gpu_blocks``). Also bounds one request:
        prompt + ``max_tokens`` <= ``capacity_blocks * block_size`` (``max_model_len``).
    kv_endpoint:
        Where the KV-event PUB socket binds (vLLM ``--kv-events-config`` ``endpoint``);
        ``"tcp://127.0.0.1:*"`` picks a free port. The resolved address is `kv_endpoint`.
    replay_endpoint:
        Where the replay ROUTER binds (vLLM ``replay_endpoint``), or ``None`` for no replay.
    seed:
        Seeds the block-hash salt and the output tokens.
    token_delay_s:
        Seconds between output tokens (``asyncio.sleep``), so requests overlap.
    max_num_seqs:
        Requests running at once (vLLM ``--max-num-seqs``); more wait FIFO (``waiting``).
    topic:
        Topic frame of every KV-event message (vLLM default ``""``).

    Raises
    ------
    ValueError
        Bad sizes or delay.
    FileNotFoundError
        ``tokenizer_dir`` lacks ``tokenizer.json`` or ``tokenizer_config.json``; no
        ``tokenizer_dir`` and no ``KVROUTE_SHARED_DATA``.
    zmq.ZMQError
        An endpoint cannot be bound.
    """

    def __init__(
        self,
        *,
        model: str = DEFAULT_MODEL,
        tokenizer_dir: Optional[Union[str, os.PathLike]] = None,
        block_size: int = 16,
        capacity_blocks: int = 4096,
        kv_endpoint: str = "tcp://127.0.0.1:*",
        replay_endpoint: Optional[str] = "tcp://127.0.0.1:*",
        seed: int = 0,
        token_delay_s: float = 0.0,
        max_num_seqs: int = 256,
        topic: str = "",
    ) -> None:
        from tokenizers import Tokenizer

        if block_size <= 0 or capacity_blocks <= 0 or max_num_seqs <= 0:
            raise ValueError(f"block_size, capacity_blocks and max_num_seqs must be > 0, got "
                             f"{block_size}, {capacity_blocks}, {max_num_seqs}")
        if not token_delay_s >= 0:
            raise ValueError(f"token_delay_s must be >= 0, got {token_delay_s!r}")
        tdir = Path(tokenizer_dir) if tokenizer_dir is not None else default_tokenizer_dir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (tdir / name).is_file():
                raise FileNotFoundError(f"{tdir / name} not found (tokenizer_dir must hold "
                                        f"tokenizer.json and tokenizer_config.json)")
        self.model = model
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.max_model_len = capacity_blocks * block_size
        self.seed = seed
        self.token_delay_s = float(token_delay_s)
        self.max_num_seqs = max_num_seqs
        self.tokenizer = Tokenizer.from_file(str(tdir / "tokenizer.json"))
        self.tokenizer_config = json.loads((tdir / "tokenizer_config.json").read_text("utf-8"))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        # Output vocabulary: plain " word" tokens, so per-token decodes concatenate to the
        # decode of the whole output (streamed text == non-streamed text, byte for byte).
        words = [i for t, i in self.tokenizer.get_vocab().items() if re.fullmatch(r"Ġ[a-z]{3,}", t)]
        self._words = np.asarray(sorted(words), dtype=np.int64)
        self._word_text = {int(i): self.tokenizer.decode([int(i)]) for i in self._words}

        self._lock = threading.RLock()
        self._pool = BlockPool(capacity_blocks, f"kvroute-standin-{seed}".encode())
        self._running = 0
        self._waiters: Deque[list] = collections.deque()  # [loop, future], FIFO
        self._counters: collections.Counter[str] = collections.Counter()
        self._served: Deque[str] = collections.deque(maxlen=100_000)
        self._closed = False
        self._pub = EventPublisher(kv_endpoint, replay_endpoint=replay_endpoint, topic=topic)
        self.kv_endpoint: str = self._pub.endpoint
        self.replay_endpoint: Optional[str] = self._pub.replay_endpoint

    # -- tokenization ------------------------------------------------------------------------
    def tokenize_completion(self, prompt: Union[str, Sequence[int]]) -> List[int]:
        """Prompt token ids of a completions request, as vLLM gets them.

        A string is encoded with the tokenizer's special tokens (``add_special_tokens=True``,
        vLLM's completions default; Qwen3 adds none); a list of ints is taken as it is.

        Raises
        ------
        ValueError
            Empty prompt, a token id outside ``[0, vocab size)``, or neither a string nor a
            list of ints.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True).ids
        elif isinstance(prompt, (list, tuple, np.ndarray)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is out of vocabulary "
                                 f"[0, {self.vocab_size})")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt cannot be empty")
        return list(ids)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], *,
                      add_generation_prompt: bool = True,
                      tools: Optional[Sequence[Mapping[str, Any]]] = None,
                      chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> List[int]:
        """Prompt token ids of a chat request, as vLLM builds them.

        Messages and tools are normalised as vLLM does (`vllm_chat_messages`,
        `vllm_tool_dicts`), rendered with the ``tokenizer_config.json`` chat template
        (`kvroute.replay.traces.render_chat_template`, with ``chat_template_kwargs`` as extra
        template variables, e.g. ``{"enable_thinking": False}``), then encoded without adding
        special tokens (vLLM's chat default: the template already wrote them).

        Raises
        ------
        ValueError
            Malformed messages, tools or ``chat_template_kwargs``; a template error.
        """
        from jinja2 import TemplateError

        from kvroute.prompt import render_chat_template

        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(f"chat_template_kwargs must be an object, got "
                             f"{type(chat_template_kwargs).__name__}")
        kwargs = dict(chat_template_kwargs or {})
        kwargs.pop("add_generation_prompt", None)
        kwargs["tools"] = vllm_tool_dicts(tools)
        try:
            text = render_chat_template(vllm_chat_messages(messages), self.tokenizer_config,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise ValueError("the rendered chat prompt is empty")
        return list(ids)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of output tokens (the tokenizer's decode)."""
        return self.tokenizer.decode([int(t) for t in token_ids])

    def token_text(self, token_id: int) -> str:
        """Text of one output token; the concatenation over an output equals `detokenize`."""
        t = self._word_text.get(int(token_id))
        return t if t is not None else self.tokenizer.decode([int(token_id)])

    def output_tokens(self, token_ids: Sequence[int], max_tokens: int) -> List[int]:
        """The deterministic output of a prompt: ``max_tokens`` word tokens drawn with a
        generator seeded by SHA-256 of (seed, prompt token ids). Same prompt, same output."""
        digest = hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes()).digest()
        rng = np.random.default_rng([self.seed, int.from_bytes(digest[:8], "little")])
        return [int(t) for t in self._words[rng.integers(0, len(self._words), size=max_tokens)]]

    # -- requests ----------------------------------------------------------------------------
    def check_request(self, token_ids: Sequence[int], max_tokens: int) -> None:
        """Raises ValueError if a request can never run (as vLLM rejects it with 400)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens!r}")
        if not token_ids:
            raise ValueError("the prompt cannot be empty")
        if len(token_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(token_ids) + max_tokens} tokens ({len(token_ids)} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                f"messages or completion.")

    def prefill(self, token_ids: Sequence[int]) -> int:
        """Prefills one prompt as a request that decodes nothing, and returns its cached
        (reused) prompt tokens.

        Finds the longest cached prefix (at most ``len - 1`` tokens, whole blocks: vLLM always
        recomputes the last prompt token), allocates the rest (evicting least recently freed
        cached blocks), caches the new full prompt blocks and publishes one event batch:
        ``BlockRemoved`` for the evictions, then ``BlockStored`` (block hashes, parent block
        hash, token ids, block size, medium ``"GPU"``) per contiguous run of new blocks. The
        blocks are freed to the LRU queue (still cached) before it returns. `generate` does
        the same for a whole request and holds the blocks until it ends.

        Raises
        ------
        ValueError
            Empty prompt or longer than ``max_model_len``.
        RuntimeError
            Not enough free blocks right now (running requests pin them).
        """
        ids = [int(t) for t in token_ids]
        with self._lock:
            self.check_request(ids, 1)
            seq = self._try_admit(ids, 0)
            if seq is None:
                raise RuntimeError(f"KV cache full: {len(ids)} prompt tokens need more than the "
                                   f"{self._pool.num_free} free blocks")
            self._release(seq, finished=True)
            return seq.cached_tokens

    def generate(self, token_ids: Sequence[int], max_tokens: int, *,
                 request_id: Optional[str] = None) -> Generation:
        """Runs one request: waits for admission (FIFO, at most ``max_num_seqs`` running and
        enough free blocks for prompt + ``max_tokens``), prefills as `prefill` does but pins
        the blocks, yields ``max_tokens`` output token ids (`output_tokens`) one every
        ``token_delay_s`` seconds, then frees the blocks to the LRU queue.

        Returns a `Generation`: ``async for tok in engine.generate(ids, 16): ...``.

        Raises
        ------
        ValueError
            At once: bad ``max_tokens``, empty or too long prompt (see `check_request`).
        """
        ids = [int(t) for t in token_ids]
        self.check_request(ids, max_tokens)
        return Generation(self, ids, max_tokens, request_id or f"standin-{uuid.uuid4().hex}")

    def served_request_ids(self) -> List[str]:
        """Request ids admitted so far, in order (the last 100,000)."""
        with self._lock:
            return list(self._served)

    def stats(self) -> Dict[str, Any]:
        """Counters and gauges (a snapshot).

        Returns
        -------
        dict
            ``model``, ``requests`` (admitted, prefill-only included), ``requests_finished``,
            ``prompt_tokens``, ``cached_tokens`` (prefix hits, tokens), ``generation_tokens``,
            ``running``, ``waiting``, ``kv_cache_usage_perc`` (pinned blocks / capacity, in
            [0, 1], as vLLM's ``1 - free / total``), ``block_size``, ``capacity_blocks``,
            ``free_blocks``, ``cached_blocks``, ``blocks_stored``, ``blocks_removed``,
            ``event_batches``, ``kv_seq`` (next sequence number), ``kv_subscriptions``
            (subscribe messages seen on the PUB socket), ``kv_endpoint``,
            ``replay_endpoint``.
        """
        with self._lock:
            c = self._counters
            pool = self._pool
            out = {
                "model": self.model,
                "requests": c["requests"],
                "requests_finished": c["requests_finished"],
                "prompt_tokens": c["prompt_tokens"],
                "cached_tokens": c["cached_tokens"],
                "generation_tokens": c["generation_tokens"],
                "running": self._running,
                "waiting": len(self._waiters),
                "kv_cache_usage_perc": (pool.num_blocks - pool.num_free) / pool.num_blocks,
                "block_size": self.block_size,
                "capacity_blocks": self.capacity_blocks,
                "free_blocks": pool.num_free,
                "cached_blocks": len(pool.cached),
                "blocks_stored": c["blocks_stored"],
                "blocks_removed": c["blocks_removed"],
                "event_batches": c["event_batches"],
                "kv_endpoint": self.kv_endpoint,
                "replay_endpoint": self.replay_endpoint,
            }
            if not self._closed:
                out["kv_seq"] = self._pub.seq
                out["kv_subscriptions"] = self._pub.subscriptions
            return out

    def close(self) -> None:
        """Closes the KV-event sockets (their ports are free when it returns). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pub.close()

    def __enter__(self) -> "StandinEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _try_admit(self, ids: List[int], max_tokens: int) -> Optional[_Seq]:
        """Admits now or returns None (not enough free blocks). REQUIRES: the lock held."""
        bs, pool = self.block_size, self._pool
        hashes = pool.hash_blocks(np.asarray(ids, dtype=np.uint32), bs)
        hit = pool.longest_cached_prefix(hashes)
        hit = min(hit, (len(ids) - 1) // bs)  # the last prompt token is always computed
        hit_ids = [pool.cached[h] for h in hashes[:hit]]
        need = -(-(len(ids) + max_tokens) // bs) - hit
        reusable = sum(1 for b in hit_ids if pool.ref_cnt[b] == 0)
        if need > pool.num_free - reusable:
            return None
        pool.touch(hit_ids)
        blocks = hit_ids + pool.allocate(need)
        events: list = []
        removed = pool.drain_evicted()
        if removed:
            events.append(wire.removed(removed, "GPU"))
        run: List[int] = []  # indices of a contiguous run of newly cached blocks
        stored = 0
        for i in range(hit, len(hashes)):
            if pool.cache(blocks[i], hashes[i]):
                run.append(i)
                continue
            stored += self._emit_run(run, hashes, ids, events)
            run = []
        stored += self._emit_run(run, hashes, ids, events)
        if events:
            self._pub.publish(events)
            self._counters["event_batches"] += 1
        self._counters.update(requests=1, prompt_tokens=len(ids), cached_tokens=hit * bs,
                              blocks_stored=stored, blocks_removed=len(removed))
        self._running += 1
        return _Seq(blocks, len(ids), hit * bs)

    def _emit_run(self, run: List[int], hashes: List[int], ids: List[int], events: list) -> int:
        if not run:
            return 0
        bs = self.block_size
        first, last = run[0], run[-1]
        parent = hashes[first - 1] if first > 0 else None
        events.append(wire.stored([hashes[i] for i in run], parent,
                                  ids[first * bs:(last + 1) * bs], bs, medium="GPU"))
        return len(run)

    async def _admit_async(self, ids: List[int], max_tokens: int, request_id: str) -> _Seq:
        """Waits for a slot and admits (FIFO: a waiter that cannot fit blocks the queue)."""
        loop = asyncio.get_running_loop()
        entry: Optional[list] = None  # [loop, future] while queued
        try:
            while True:
                with self._lock:
                    head = not self._waiters if entry is None else self._waiters[0] is entry
                    if head and self._running < self.max_num_seqs:
                        seq = self._try_admit(ids, max_tokens)
                        if seq is not None:
                            if entry is not None:
                                self._waiters.popleft()
                                entry = None
                            self._served.append(request_id)
                            self._wake_head()  # the next one may fit too
                            return seq
                    if entry is None:
                        entry = [loop, None]
                        self._waiters.append(entry)
                    entry[1] = fut = loop.create_future()
                await fut
        finally:
            if entry is not None:  # cancelled while queued
                with self._lock:
                    try:
                        self._waiters.remove(entry)
                    except ValueError:
                        pass
                    self._wake_head()

    def _wake_head(self) -> None:
        """Wakes the first waiter, which re-checks. REQUIRES: the lock held."""
        if not self._waiters:
            return
        loop, fut = self._waiters[0]

        def _set() -> None:
            if not fut.done():
                fut.set_result(None)

        if fut is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_set)

    def _count_generated(self, n: int) -> None:
        with self._lock:
            self._counters["generation_tokens"] += n

    def _release(self, seq: _Seq, *, finished: bool) -> None:
        with self._lock:
            self._pool.free_blocks(seq.blocks)
            self._running -= 1
            if finished:
                self._counters["requests_finished"] += 1
            self._wake_head()
