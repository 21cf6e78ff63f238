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

The loaders live by source in `kvroute.replay.real_traces` (Mooncake, MT-Bench),
`kvroute.replay.synthetic` and `kvroute.replay.trace_files` (your own traffic), the data types
in `kvroute.replay.trace_types`; this module re-exports them and adds `load_trace`, which loads
any of them by name or path.

Real data is read from a directory given by argument, else from the environment variable
``KVROUTE_SHARED_DATA``; with neither, a loader that needs it raises FileNotFoundError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

# One implementation of transformers' chat-template rendering, shared with the serving
# tokenizer; re-exported here (it is in __all__).
from kvroute.prompt import render_chat_template
from kvroute.replay.real_traces import (
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_FILE,
    MT_BENCH_FILE,
    _data_dir,
    default_data_dir,
    default_tokenizer_dir,
    load_mooncake,
    load_mt_bench,
    mooncake_block_tokens,
)
from kvroute.replay.synthetic import synthetic_bursts, synthetic_conversations
from kvroute.replay.trace_files import (
    TRACE_FORMATS,
    access_log_to_openai,
    detect_format,
    load_jsonl,
    load_openai_jsonl,
    load_tokens_jsonl,
)
from kvroute.replay.trace_types import QWEN3_REGULAR_VOCAB, PathLike, Request, Trace

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
    "synthetic_bursts",
    "synthetic_conversations",
]


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
