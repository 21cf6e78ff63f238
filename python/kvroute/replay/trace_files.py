"""Trace files of your own traffic: JSONL, one request per line, in one of `TRACE_FORMATS`
(detected from the first line's keys, or given), and the proxy's access log turned into one.

- ``openai`` (`load_openai_jsonl`): ``{"timestamp": s, "body": {...}, "path":
  "/v1/chat/completions" | "/v1/completions", "session_id": str, "user": str,
  "output_length": int}``, only ``timestamp`` and ``body`` required; bodies tokenized by
  `kvroute.prompt.PromptTokenizer.encode_request` (the model's chat template, as
  the serving proxy and vLLM do).
- ``tokens`` (`load_tokens_jsonl`): ``{"timestamp": s, "prompt_token_ids": [int, ...],
  "output_length": int, "session_id": str}``.
- ``mooncake`` (`kvroute.replay.real_traces.load_mooncake`): ``{"timestamp": ms,
  "input_length": int, "output_length": int, "hash_ids": [int, ...]}``.

Timestamps of ``openai`` and ``tokens`` are seconds from any origin (shifted so the first
request arrives at 0); Mooncake's are milliseconds from the trace start. The full schema:
``python/kvroute/replay/README.md``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from kvroute.replay.real_traces import default_tokenizer_dir, load_mooncake
from kvroute.replay.trace_types import PathLike, Trace, _finish

__all__ = [
    "TRACE_FORMATS",
    "access_log_to_openai",
    "detect_format",
    "load_jsonl",
    "load_openai_jsonl",
    "load_tokens_jsonl",
]

#: Formats of a trace file (`load_jsonl`'s ``format``).
TRACE_FORMATS = ("auto", "mooncake", "tokens", "openai")


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
