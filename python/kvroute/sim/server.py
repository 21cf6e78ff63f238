"""Engine stand-in: a real HTTP server speaking vLLM's OpenAI-compatible API that publishes
real vLLM-format KV events over ZeroMQ for the prompts it serves.

It is a **stand-in** for ``vllm serve`` (vLLM needs a GPU; this machine has none). What is
real: the HTTP API shapes (``vllm/entrypoints/openai/``: completions, chat completions with
SSE streaming, ``usage.prompt_tokens_details.cached_tokens``, OpenAI error JSON), the Qwen3
tokenizer and chat template (tokenized as vLLM does), the prefix cache
(`kvroute.sim.block_pool.BlockPool`: full prompt blocks, LRU eviction, blocks of running
requests pinned), the KV events (`kvroute.sim.publisher.EventPublisher`: vLLM wire, map era,
3 frames with sequence numbers, replay ROUTER), the ``/metrics`` names and the ORCA load
header. What is not: the model. Output tokens are deterministic words drawn from a hash of
the prompt, one every ``token_delay_s`` seconds, always ``max_tokens`` of them
(``finish_reason`` "length").

Three layers, each usable alone:

* `StandinEngine`: the engine logic without HTTP (tokenize, prefill, generate, stats);
  reusable inside a Ray Serve replica.
* `create_app`: a FastAPI app over one engine.
* `EngineServerProcess`: runs ``python -m kvroute.sim.server ...`` as a subprocess (real
  sockets, killable with SIGKILL like a crashed engine).

Thread-safety: `StandinEngine` methods may be called from any thread; one lock guards the
block pool, the counters and the publisher. `StandinEngine.generate` must be iterated on an
asyncio event loop (any loop; admission waiters are woken with ``call_soon_threadsafe``).

Run ``python -m kvroute.sim.server --help`` for the CLI.
"""

import argparse
import asyncio
import collections
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import (
    Any,
    AsyncGenerator,
    AsyncIterator,
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

__all__ = [
    "DEFAULT_MODEL",
    "ORCA_REQUEST_HEADER",
    "ORCA_RESPONSE_HEADER",
    "EngineServerProcess",
    "Generation",
    "StandinEngine",
    "create_app",
    "default_tokenizer_dir",
    "main",
    "orca_header",
    "vllm_chat_messages",
    "vllm_tool_dicts",
]

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


ORCA_REQUEST_HEADER = "endpoint-load-metrics-format"
"""Request header asking for an ORCA load report (vLLM
``ENDPOINT_LOAD_METRICS_FORMAT_HEADER_LABEL``, ``vllm/entrypoints/openai/api_server.py``)."""
ORCA_RESPONSE_HEADER = "endpoint-load-metrics"
"""Response header carrying it (``vllm/entrypoints/serve/utils/orca_metrics.py``)."""

DEFAULT_CHAT_MAX_TOKENS = 16
"""Chat ``max_tokens`` when the request gives none. Deliberately not vLLM's default
(max_model_len - prompt length): a stand-in answer that long is useless and slow."""


# ------------------------------------------------------------------------------------------
# vLLM request preprocessing, reproduced
# ------------------------------------------------------------------------------------------

def vllm_tool_dicts(tools: Optional[Sequence[Mapping[str, Any]]]) -> Optional[List[Dict[str, Any]]]:
    """``tools`` as vLLM hands them to the chat template.

    vLLM parses each tool into ``ChatCompletionToolsParam(type="function",
    function=FunctionDefinition(name, description=None, parameters=None))`` and passes
    ``tool.model_dump()`` (``vllm/entrypoints/openai/chat_completion/serving.py``): declared
    fields first, missing optional ones as ``None``, unknown keys kept after them. The Qwen3
    template writes each tool with ``tojson``, so this shape decides the prompt tokens.

    Raises
    ------
    ValueError
        ``tools`` is not a list of objects each with a ``function`` object that has a string
        ``name``.
    """
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of objects, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': "
                             f"{{'name': str, ...}}}}, got {tool!r}")
        f = {"name": fn["name"], "description": fn.get("description"),
             "parameters": fn.get("parameters")}
        f.update({k: v for k, v in fn.items() if k not in f})
        d: Dict[str, Any] = {"type": tool.get("type", "function"), "function": f}
        d.update({k: v for k, v in tool.items() if k not in d})
        out.append(d)
    return out


def vllm_chat_messages(messages: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Chat messages as vLLM hands them to a "string"-content template such as Qwen3's.

    After ``vllm/entrypoints/chat_utils.py`` (``parse_chat_messages``): ``content`` becomes a
    string (a list of ``{"type": "text", "text": ...}`` parts joined with ``"\\n"``; ``None``
    becomes ``""``); other keys (``name``, ``tool_calls``, ``tool_call_id``,
    ``reasoning_content``) are kept; assistant ``tool_calls[].function.arguments`` given as a
    JSON string are parsed into objects (``_postprocess_messages``).

    Raises
    ------
    ValueError
        Not a non-empty list of objects with a string ``role``; a content part that is not
        text; arguments that are not valid JSON.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role', got {msg!r}")
        m = dict(msg)
        content = m.get("content")
        if content is None:
            m["content"] = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, Mapping) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ValueError(f"messages[{i}].content: the stand-in takes only text "
                                     f"parts {{'type': 'text', 'text': str}}, got {part!r}")
                texts.append(part["text"])
            m["content"] = "\n".join(texts)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts, "
                             f"got {type(content).__name__}")
        if m["role"] == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if not args:
                    fn["arguments"] = {}
                elif not isinstance(args, (dict, list)):
                    try:
                        fn["arguments"] = json.loads(args)
                    except (TypeError, ValueError) as exc:
                        raise ValueError(f"messages[{i}].tool_calls: arguments are not JSON: "
                                         f"{args!r}") from exc
                call["function"] = fn
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out


def orca_header(metrics_format: str, named_metrics: Sequence[tuple]) -> Optional[Dict[str, str]]:
    """The ORCA load report header vLLM adds to a non-streaming response.

    Format of ``create_orca_header`` in ``vllm/entrypoints/serve/utils/orca_metrics.py``
    (formerly ``vllm/entrypoints/openai/orca_metrics.py``), ``metrics_format`` case-insensitive:

    * ``TEXT``: ``endpoint-load-metrics: TEXT named_metrics.<name>=<float>, ...``
    * ``JSON``: ``endpoint-load-metrics: JSON {"named_metrics": {"<name>": <float>, ...}}``

    Floats as Python's ``str(float)``. Any other format (or an empty one): ``None``, no header.
    """
    fmt = (metrics_format or "").lower()
    if fmt not in ("text", "json"):
        return None
    pairs = [(n, v) for n, v in named_metrics if isinstance(n, str) and isinstance(v, float)]
    if fmt == "text":
        body = ", ".join(f"named_metrics.{n}={v}" for n, v in pairs)
        return {ORCA_RESPONSE_HEADER: f"TEXT {body}"}
    return {ORCA_RESPONSE_HEADER: f"JSON {json.dumps({'named_metrics': dict(pairs)})}"}


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


# ------------------------------------------------------------------------------------------
# HTTP
# ------------------------------------------------------------------------------------------

def _error(message: str, err_type: str = "BadRequestError", code: int = 400,
           param: Optional[str] = None) -> Any:
    """vLLM's ErrorResponse: ``{"error": {"message", "type", "param", "code"}}``
    (``vllm/entrypoints/serve/engine/protocol.py``)."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": err_type, "param": param,
                                   "code": code}}, status_code=code)


def _metrics_collector(engine: StandinEngine) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        """Reads `StandinEngine.stats` at scrape time; names and labels as vLLM V1's
        ``vllm/v1/metrics/loggers.py`` (labels ``model_name``, ``engine``)."""

        def collect(self) -> Any:
            s = engine.stats()
            labels = ["model_name", "engine"]
            values = [engine.model, "0"]

            def gauge(name: str, doc: str, v: float) -> Any:
                g = GaugeMetricFamily(name, doc, labels=labels)
                g.add_metric(values, v)
                return g

            def counter(name: str, doc: str, v: float) -> Any:
                c = CounterMetricFamily(name, doc, labels=labels)
                c.add_metric(values, v)
                return c

            yield gauge("vllm:num_requests_running",
                        "Number of requests in model execution batches.", s["running"])
            yield gauge("vllm:num_requests_waiting",
                        "Number of requests waiting to be processed.", s["waiting"])
            yield gauge("vllm:kv_cache_usage_perc",
                        "KV-cache usage. 1 means 100 percent usage.", s["kv_cache_usage_perc"])
            yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                          s["prompt_tokens"])
            yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                          s["generation_tokens"])
            yield counter("vllm:prefix_cache_queries",
                          "Prefix cache queries, in terms of number of queried tokens.",
                          s["prompt_tokens"])
            yield counter("vllm:prefix_cache_hits",
                          "Prefix cache hits, in terms of number of cached tokens.",
                          s["cached_tokens"])
            ok = CounterMetricFamily("vllm:request_success", "Count of successfully processed "
                                     "requests.", labels=labels + ["finished_reason"])
            ok.add_metric(values + ["length"], s["requests_finished"])
            yield ok

    return _Collector()


def create_app(engine: StandinEngine) -> Any:
    """A FastAPI app serving ``engine`` with vLLM's OpenAI-compatible routes.

    Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (non-streaming JSON or SSE
    ``data: {json}\\n\\n`` chunks then ``data: [DONE]\\n\\n``; ``stream_options.include_usage``
    adds a last chunk with ``choices: []`` and ``usage``), ``POST /tokenize``,
    ``GET /v1/models``, ``GET /health`` (200, empty body), ``GET /metrics`` (Prometheus text),
    ``GET /standin/stats`` (stand-in only: `StandinEngine.stats` + ``request_ids``).

    The request id is ``X-Request-Id`` if the request has one, else the body's
    ``request_id``, else a random hex; response ids are ``cmpl-<id>`` / ``chatcmpl-<id>``
    (vLLM) and ``request_ids`` lists those response ids. A non-streaming response to a
    request with the ``endpoint-load-metrics-format`` header (``TEXT`` or ``JSON``) carries
    the ORCA ``endpoint-load-metrics`` header with ``num_requests_waiting`` and
    ``kv_cache_usage_perc`` (see `orca_header`). Errors are vLLM's ``{"error": {...}}`` JSON:
    404 ``NotFoundError`` for an unknown ``model``, 400 for bad input. The app does not own
    the engine: close it yourself.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    app = FastAPI(title="kvroute engine stand-in (vLLM OpenAI-compatible API)")
    app.state.engine = engine
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_metrics_collector(engine))

    class _BadRequest(Exception):
        def __init__(self, message: str, err_type: str = "BadRequestError", code: int = 400,
                     param: Optional[str] = None) -> None:
            super().__init__(message)
            self.args_ = (message, err_type, code, param)

    @app.exception_handler(_BadRequest)
    async def _bad(_: Request, exc: _BadRequest) -> Any:
        return _error(*exc.args_)

    async def _body(request: Request) -> Dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise _BadRequest("request body must be a JSON object") from exc
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        return body

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Any:
        # Deliberately answer 500 with the error JSON instead of dropping the connection.
        return _error(f"internal error: {type(exc).__name__}: {exc}", "InternalServerError", 500)

    def _check_model(body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _BadRequest(f"model must be a string, got {type(model).__name__}",
                              param="model")
        if model and model != engine.model:  # vLLM accepts a missing or empty model
            raise _BadRequest(f"The model `{model}` does not exist.", "NotFoundError", 404,
                              "model")

    def _opt_int_field(body: Mapping[str, Any], name: str) -> Optional[int]:
        v = body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise _BadRequest(f"{name} must be an integer, got {v!r}", param=name)
        return v

    def _int_field(body: Mapping[str, Any], name: str, default: int) -> int:
        v = _opt_int_field(body, name)
        return default if v is None else v

    def _stream_flags(body: Mapping[str, Any]) -> tuple:
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise _BadRequest(f"stream must be a boolean, got {stream!r}", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise _BadRequest("stream_options must be an object", param="stream_options")
        if opts and not stream:
            raise _BadRequest("Stream options can only be defined when `stream=True`.",
                              param="stream_options")
        n = body.get("n", 1)
        if n not in (None, 1):
            raise _BadRequest(f"the stand-in serves n=1 only, got n={n!r}", param="n")
        return bool(stream), bool(opts.get("include_usage")), bool(
            opts.get("continuous_usage_stats"))

    def _request_id(request: Request, body: Mapping[str, Any]) -> str:
        rid = request.headers.get("X-Request-Id") or body.get("request_id")
        return str(rid) if rid else uuid.uuid4().hex

    def _usage(gen: Generation) -> Dict[str, Any]:
        return {"prompt_tokens": gen.prompt_tokens,
                "total_tokens": gen.prompt_tokens + gen.completion_tokens,
                "completion_tokens": gen.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": gen.cached_tokens or 0}}

    def _orca(request: Request) -> Optional[Dict[str, str]]:
        fmt = request.headers.get(ORCA_REQUEST_HEADER, "")
        if not fmt:
            return None
        s = engine.stats()
        # Order of vLLM's metrics snapshot: waiting is registered before KV usage.
        return orca_header(fmt, [("num_requests_waiting", float(s["waiting"])),
                                 ("kv_cache_usage_perc", float(s["kv_cache_usage_perc"]))])

    def _start(ids: List[int], max_tokens: int, rid: str) -> Generation:
        try:
            return engine.generate(ids, max_tokens, request_id=rid)
        except ValueError as exc:
            raise _BadRequest(str(exc)) from exc

    async def _collect(request: Request, gen: Generation) -> Optional[List[int]]:
        """All output tokens of a non-streaming request, or None when the client disconnected
        first: the generation is then cancelled and its blocks released (vLLM's
        ``with_cancellation`` aborts such requests). The body must have been read."""
        async def run() -> List[int]:
            return [t async for t in gen]

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            watcher.cancel()
            raise
        watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()  # not running any more: releases the blocks if still held
        return None

    def _sse(obj: Any) -> bytes:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()

    async def _tokenize(fn: Any, *args: Any, **kw: Any) -> List[int]:
        try:  # off the event loop: template rendering and BPE of long prompts take a while
            return await asyncio.to_thread(fn, *args, **kw)
        except ValueError as exc:
            raise _BadRequest(str(exc)) from exc

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _body(request)
        _check_model(body)
        stream, include_usage, continuous = _stream_flags(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if prompt is None:
            raise _BadRequest("prompt is required", param="prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            raise _BadRequest("the stand-in serves one prompt per request", param="prompt")
        max_tokens = _int_field(body, "max_tokens", 16)
        ids = await _tokenize(engine.tokenize_completion, prompt)
        cid, created, model = f"cmpl-{_request_id(request, body)}", int(time.time()), engine.model
        gen = _start(ids, max_tokens, cid)

        if not stream:
            toks = await _collect(request, gen)
            if toks is None:  # the client is gone: nobody reads the answer
                return Response(status_code=499)
            resp = {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": engine.detokenize(toks), "logprobs": None,
                                 "finish_reason": gen.finish_reason, "stop_reason": None,
                                 "prompt_logprobs": None}],
                    "usage": _usage(gen)}
            return JSONResponse(resp, headers=_orca(request))

        async def events() -> AsyncIterator[bytes]:
            try:
                i = 0
                async for tok in gen:
                    i += 1
                    chunk = {"id": cid, "object": "text_completion", "created": created,
                             "model": model,
                             "choices": [{"index": 0, "text": engine.token_text(tok),
                                          "logprobs": None,
                                          "finish_reason": "length" if i == max_tokens else None,
                                          "stop_reason": None}]}
                    if include_usage and continuous:
                        chunk["usage"] = _usage(gen)
                    yield _sse(chunk)
                if include_usage:
                    yield _sse({"id": cid, "object": "text_completion", "created": created,
                                "model": model, "choices": [], "usage": _usage(gen)})
                yield b"data: [DONE]\n\n"
            finally:
                await gen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await _body(request)
        _check_model(body)
        stream, include_usage, continuous = _stream_flags(body)
        if "messages" not in body:
            raise _BadRequest("messages is required", param="messages")
        max_tokens = _opt_int_field(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", DEFAULT_CHAT_MAX_TOKENS)
        agp = body.get("add_generation_prompt", True)
        if not isinstance(agp, bool):
            raise _BadRequest("add_generation_prompt must be a boolean",
                              param="add_generation_prompt")
        ids = await _tokenize(engine.tokenize_chat, body["messages"], add_generation_prompt=agp,
                              tools=body.get("tools"),
                              chat_template_kwargs=body.get("chat_template_kwargs"))
        cid = f"chatcmpl-{_request_id(request, body)}"
        created, model = int(time.time()), engine.model
        gen = _start(ids, max_tokens, cid)

        if not stream:
            toks = await _collect(request, gen)
            if toks is None:  # the client is gone: nobody reads the answer
                return Response(status_code=499)
            resp = {"id": cid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0,
                                 "message": {"role": "assistant",
                                             "content": engine.detokenize(toks),
                                             "tool_calls": []},
                                 "logprobs": None, "finish_reason": gen.finish_reason,
                                 "stop_reason": None}],
                    "usage": _usage(gen), "prompt_logprobs": None}
            return JSONResponse(resp, headers=_orca(request))

        def chunk(delta: Dict[str, Any], finish: Optional[str]) -> Dict[str, Any]:
            c = {"id": cid, "object": "chat.completion.chunk", "created": created,
                 "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}]}
            if include_usage and continuous:
                c["usage"] = _usage(gen)
            return c

        async def events() -> AsyncIterator[bytes]:
            try:
                yield _sse(chunk({"role": "assistant", "content": ""}, None))
                i = 0
                async for tok in gen:
                    i += 1
                    yield _sse(chunk({"content": engine.token_text(tok)},
                                     "length" if i == max_tokens else None))
                if include_usage:
                    yield _sse({"id": cid, "object": "chat.completion.chunk",
                                "created": created, "model": model, "choices": [],
                                "usage": _usage(gen)})
                yield b"data: [DONE]\n\n"
            finally:
                await gen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        """vLLM's ``/tokenize``: ``prompt`` or ``messages`` -> ``{"count", "max_model_len",
        "tokens", "token_strs"}``."""
        body = await _body(request)
        _check_model(body)
        if "messages" in body:
            agp = body.get("add_generation_prompt", True)
            ids = await _tokenize(engine.tokenize_chat, body["messages"],
                                  add_generation_prompt=bool(agp), tools=body.get("tools"),
                                  chat_template_kwargs=body.get("chat_template_kwargs"))
        elif "prompt" in body:
            ids = await _tokenize(engine.tokenize_completion, body["prompt"])
        else:
            raise _BadRequest("prompt or messages is required")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": None}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{
            "id": engine.model, "object": "model", "created": int(time.time()),
            "owned_by": "vllm", "root": engine.model, "parent": None,
            "max_model_len": engine.max_model_len, "permission": []}]}

    @app.get("/health")
    async def health() -> Any:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Any:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/standin/stats")
    async def standin_stats() -> Any:
        """Stand-in only (vLLM has no such route)."""
        out = engine.stats()
        out["request_ids"] = engine.served_request_ids()
        return out

    return app


# ------------------------------------------------------------------------------------------
# Subprocess wrapper and CLI
# ------------------------------------------------------------------------------------------

def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineServerProcess:
    """``python -m kvroute.sim.server`` as a subprocess: a stand-in engine with its own
    HTTP port, KV-event PUB port and (optionally) replay port on ``host``.

    Parameters
    ----------
    port, kv_port, replay_port:
        TCP ports; ``None`` picks free ones (asked of the OS when the object is made; if one
        was taken meanwhile, `start` retries with new ones).
    replay:
        Serve a replay ROUTER (``replay_endpoint``) or not (``None``).
    model, tokenizer_dir, block_size, capacity_blocks, token_delay_s, max_num_seqs, seed:
        As `StandinEngine`.
    host:
        Address every socket binds (default loopback).

    Attributes
    ----------
    url: str
        ``"http://HOST:PORT"``.
    kv_endpoint: str
        ``"tcp://HOST:KV_PORT"``.
    replay_endpoint: Optional[str]
        ``"tcp://HOST:REPLAY_PORT"`` or ``None``.
    proc: Optional[subprocess.Popen]
    log_path: str
        The subprocess's stdout + stderr.
    """

    def __init__(self, *, port: Optional[int] = None, kv_port: Optional[int] = None,
                 replay_port: Optional[int] = None, replay: bool = True,
                 model: str = DEFAULT_MODEL,
                 tokenizer_dir: Optional[Union[str, os.PathLike]] = None,
                 block_size: int = 16, capacity_blocks: int = 4096, token_delay_s: float = 0.0,
                 host: str = "127.0.0.1", max_num_seqs: int = 256, seed: int = 0) -> None:
        self.host = host
        self.replay = replay
        self._auto_ports = port is None or kv_port is None or (replay and replay_port is None)
        self._fixed = (port, kv_port, replay_port)
        self.model = model
        tdir = Path(tokenizer_dir) if tokenizer_dir is not None else default_tokenizer_dir()
        self.tokenizer_dir = str(tdir.resolve())
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.token_delay_s = token_delay_s
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        self.proc: Optional[subprocess.Popen] = None
        fd, self.log_path = tempfile.mkstemp(prefix="kvroute-standin-", suffix=".log")
        os.close(fd)
        self._pick_ports()

    def _pick_ports(self) -> None:
        port, kv_port, replay_port = self._fixed
        self.port = port if port is not None else _free_port(self.host)
        self.kv_port = kv_port if kv_port is not None else _free_port(self.host)
        self.replay_port = (replay_port if replay_port is not None else _free_port(self.host)) \
            if self.replay else None
        self.url = f"http://{self.host}:{self.port}"
        self.kv_endpoint = f"tcp://{self.host}:{self.kv_port}"
        self.replay_endpoint = (f"tcp://{self.host}:{self.replay_port}" if self.replay
                                else None)

    def command(self) -> List[str]:
        """The subprocess's argv."""
        return [sys.executable, "-m", "kvroute.sim.server", "--host", self.host,
                "--port", str(self.port), "--kv-endpoint", self.kv_endpoint,
                "--replay-endpoint", self.replay_endpoint or "none", "--model", self.model,
                "--tokenizer-dir", self.tokenizer_dir, "--block-size", str(self.block_size),
                "--capacity-blocks", str(self.capacity_blocks),
                "--token-delay-ms", repr(self.token_delay_s * 1000.0),
                "--max-num-seqs", str(self.max_num_seqs), "--seed", str(self.seed)]

    def start(self, timeout: float = 30) -> "EngineServerProcess":
        """Starts the subprocess and waits until ``GET /health`` answers 200 and
        ``GET /standin/stats`` reports this engine's ``kv_endpoint``.

        The second check tells a port clash apart: with ports picked automatically, another
        stand-in may have taken the same HTTP port meanwhile, and its ``/health`` would answer
        for ours. Such a clash (an answer from another engine, or "address already in use"
        in the log) is retried with new ports, at most 3 times in all.

        Raises
        ------
        RuntimeError
            Already started, the process exited (its log is in the message), or another
            engine answers on the port and the ports were given.
        TimeoutError
            No healthy answer within ``timeout`` seconds (the process is killed).
        """
        import httpx

        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self!r} is already running")
        attempts = 3 if self._auto_ports else 1
        for attempt in range(attempts):
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(self.command(), stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            end = time.monotonic() + timeout
            clash: Optional[str] = None
            with httpx.Client(timeout=2.0) as client:
                while True:
                    code = self.proc.poll()
                    if code is not None:
                        break
                    try:
                        if client.get(f"{self.url}/health").status_code == 200:
                            theirs = client.get(f"{self.url}/standin/stats").json().get(
                                "kv_endpoint")
                            if theirs == self.kv_endpoint:
                                return self
                            clash = theirs  # another engine answers on our HTTP port
                            break
                    except (httpx.HTTPError, ValueError, AttributeError):
                        pass  # not up yet, or not (yet) a stand-in's answer
                    if time.monotonic() > end:
                        self.kill()
                        raise TimeoutError(f"stand-in engine at {self.url} not healthy after "
                                           f"{timeout} s; log:\n{self._log_tail()}")
                    time.sleep(0.05)
            if clash is not None:
                self.kill()
                if attempt + 1 >= attempts:
                    raise RuntimeError(f"another engine (kv_endpoint {clash!r}) answers on "
                                       f"{self.url}; log:\n{self._log_tail()}")
                self._pick_ports()
                continue
            log_text = self._log_tail()
            in_use = "address already in use" in log_text.lower() or "EADDRINUSE" in log_text
            if not (in_use and attempt + 1 < attempts):
                raise RuntimeError(f"stand-in engine exited with {code} before it was healthy; "
                                   f"log:\n{log_text}")
            self._pick_ports()
        raise AssertionError("unreachable")

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text("utf-8", "replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crashed engine: no shutdown, the kernel closes its sockets. Waits
        for the process to be reaped. No-op if not running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM (uvicorn's graceful shutdown, then the engine's sockets are closed) and
        wait; SIGKILL after ``timeout`` seconds. No-op if not running."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def worker(self) -> Any:
        """``kvroute.Worker(url, kv_endpoint=..., replay_endpoint=...)`` for this engine."""
        from kvroute import Worker

        return Worker(self.url, kv_endpoint=self.kv_endpoint,
                      replay_endpoint=self.replay_endpoint)

    def __enter__(self) -> "EngineServerProcess":
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def __repr__(self) -> str:
        return (f"EngineServerProcess(url={self.url!r}, kv_endpoint={self.kv_endpoint!r}, "
                f"replay_endpoint={self.replay_endpoint!r}, running={self.running})")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """CLI: serve one stand-in engine with uvicorn until SIGINT / SIGTERM."""
    import uvicorn

    p = argparse.ArgumentParser(
        prog="python -m kvroute.sim.server",
        description="vLLM engine stand-in: OpenAI-compatible HTTP API + real KV events over "
                    "ZeroMQ (no model; deterministic output).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-endpoint", default="tcp://127.0.0.1:*",
                   help="KV-event PUB bind address (vLLM kv-events-config endpoint)")
    p.add_argument("--replay-endpoint", default="tcp://127.0.0.1:*",
                   help="replay ROUTER bind address, or 'none'")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    p.add_argument("--tokenizer-dir", default=None,
                   help="tokenizer.json + tokenizer_config.json (default "
                        "$KVROUTE_SHARED_DATA/tokenizers/qwen3)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--capacity-blocks", type=int, default=4096)
    p.add_argument("--token-delay-ms", type=float, default=0.0,
                   help="milliseconds between output tokens")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topic", default="", help="KV-event topic frame (vLLM default '')")
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    replay = None if a.replay_endpoint.lower() in ("", "none") else a.replay_endpoint
    engine = StandinEngine(model=a.model, tokenizer_dir=a.tokenizer_dir,
                           block_size=a.block_size, capacity_blocks=a.capacity_blocks,
                           kv_endpoint=a.kv_endpoint, replay_endpoint=replay, seed=a.seed,
                           token_delay_s=a.token_delay_ms / 1000.0, max_num_seqs=a.max_num_seqs,
                           topic=a.topic)
    print(json.dumps({"url": f"http://{a.host}:{a.port}", "kv_endpoint": engine.kv_endpoint,
                      "replay_endpoint": engine.replay_endpoint, "model": a.model}), flush=True)
    try:
        uvicorn.run(create_app(engine), host=a.host, port=a.port, log_level=a.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
