"""Real traces from the shared data directory: the Mooncake FAST'25 conversation trace and
MT-Bench rendered with Qwen3's chat template.

* `load_mooncake` — the Mooncake FAST'25 conversation trace (kvcache-ai/Mooncake,
  Apache-2.0): real arrival times and lengths; its anonymised 512-token prefix-block ids are
  expanded to deterministic *pseudo*-token ids (`mooncake_block_tokens`; no real text exists
  in the trace).
* `load_mt_bench` — the 80 two-turn MT-Bench questions (lm-sys/FastChat, Apache-2.0) rendered
  with Qwen3's chat template and tokenized with the real Qwen3 tokenizer. Arrival times are
  synthetic and the assistant's first answer is a deterministic stand-in text.

Real data is read from a directory given by argument, else from the environment variable
``KVROUTE_SHARED_DATA``; with neither, a loader that needs it raises FileNotFoundError.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kvroute._shared_data import shared_data_dir
from kvroute.prompt import render_chat_template
from kvroute.replay.trace_types import (
    QWEN3_REGULAR_VOCAB,
    PathLike,
    Trace,
    _finish,
    _splitmix64,
)

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "MOONCAKE_FILE",
    "MT_BENCH_FILE",
    "QWEN3_TOKENIZER_SUBDIR",
    "default_data_dir",
    "default_tokenizer_dir",
    "load_mooncake",
    "load_mt_bench",
    "mooncake_block_tokens",
]

#: Tokens per Mooncake ``hash_ids`` block.
MOONCAKE_BLOCK_TOKENS = 512
#: File names inside the shared data directory.
MOONCAKE_FILE = "mooncake_conversation_trace.jsonl"
MT_BENCH_FILE = "mt_bench_question.jsonl"
QWEN3_TOKENIZER_SUBDIR = "tokenizers/qwen3"

_U64 = np.uint64
# Salt so the Mooncake pseudo-tokens are not a plain splitmix64 stream of the block index.
_MOONCAKE_SALT = _U64(0x6B76726F7574652D)  # "kvroute-"


# --------------------------------------------------------------------------------------------
# Shared data directory
# --------------------------------------------------------------------------------------------


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


def default_tokenizer_dir(data_dir: Optional[PathLike] = None) -> Path:
    """``<shared data>/tokenizers/qwen3``, the tokenizer an OpenAI-format trace uses unless one
    is given. FileNotFoundError when the shared data directory is not set or lacks it."""
    d = shared_data_dir(data_dir) / QWEN3_TOKENIZER_SUBDIR
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {d}")
    return d


# --------------------------------------------------------------------------------------------
# Mooncake
# --------------------------------------------------------------------------------------------


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
