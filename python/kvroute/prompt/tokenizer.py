"""Prompt tokenization as a vLLM engine does it, so the router matches the engine's blocks.

The router keys blocks on token ids, so it must see exactly the ids the engine will prefill.
`PromptTokenizer` reproduces the two request paths of vLLM's OpenAI-compatible server:

* ``/v1/completions``: a string prompt is encoded with ``add_special_tokens=True`` (vLLM's
  ``CompletionRequest.add_special_tokens`` default); token-id prompts are used as they are.
* ``/v1/chat/completions``: the messages are normalised as vLLM's
  ``vllm/entrypoints/chat_utils.py`` does (``parse_chat_messages``: text parts joined with
  ``"\\n"`` for string-content templates, assistant ``tool_calls`` arguments parsed from JSON
  to dicts, ``tools`` as ``ChatCompletionToolsParam.model_dump()``), rendered with the model's
  Jinja ``chat_template`` in the environment transformers uses
  (``transformers/utils/chat_template_utils.py``: sandbox, ``trim_blocks``, ``lstrip_blocks``,
  ``tojson`` keeping non-ASCII, ``raise_exception``, ``strftime_now``), with the keyword
  arguments vLLM passes (``add_generation_prompt``, ``continue_final_message``, ``tools``,
  ``documents``, then ``chat_template_kwargs`` filtered to the template's variables as in
  ``vllm/renderers/hf.py`` ``resolve_chat_template_kwargs``), then encoded with
  ``add_special_tokens=False`` (``ChatCompletionRequest.add_special_tokens`` default: the
  template writes the special tokens).

Only the ``tokenizers`` library and ``jinja2`` are needed (no transformers, no torch).

Threads and the event loop
--------------------------
``tokenizers.Tokenizer.encode`` holds the GIL for the whole call (measured: a 128K-token
encode stalls every other Python thread for its full ~270 ms), while ``encode_batch`` /
``encode_batch_fast`` release it (``py.allow_threads``; the same stall drops to ~5 ms, the
interpreter's switch interval). `PromptTokenizer` therefore always encodes through
``encode_batch_fast`` (``encode_batch`` on older ``tokenizers``) with a batch of one, and
`PromptTokenizer.aencode_request` runs rendering + encoding on a small thread pool: the Jinja
rendering is pure Python and yields the GIL every switch interval, the encoding releases it.
A `PromptTokenizer` is safe to use from several threads at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Union

import numpy as np

from kvroute.prompt.errors import TokenizerBusy, UnsupportedPrompt
from kvroute.prompt.messages import _conversation, _tools
from kvroute.prompt.prefix_cache import PrefixCache
from kvroute.prompt.sizes import _text_chars, prompt_chars
from kvroute.prompt.templates import (
    _RESERVED_KWARGS,
    ContentFormat,
    _accepted_kwargs,
    _compile_chat_template,
    _render,
    _special_tokens,
    chat_template_content_format,
)

__all__ = ["CHAT_COMPLETIONS_PATH", "COMPLETIONS_PATH", "PromptTokenizer"]

#: OpenAI-compatible paths `PromptTokenizer.encode_request` understands.
COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"

PathLike = Union[str, Path]

_TOKEN_ID_LIMIT = 1 << 32


# The tokenizer's defaults, written once (``serving.long_prompt_chars``,
# ``serving.prefix_cache_tokens`` and ``kvroute serve --help`` read them through
# `kvroute.serving.defaults`).
#: Prompts over this many characters are encoded on the long lane.
LONG_PROMPT_CHARS = 65536
#: Token ids the chat `PrefixCache` keeps (2**22).
PREFIX_CACHE_TOKENS = 1 << 22
#: Prompts that may wait on the ordinary lane beyond its running ones.
MAX_QUEUED = 1024
#: Prompts that may wait on the long lane beyond its running ones.
LONG_MAX_QUEUED = 16


class _Lane:
    """A thread pool with a bounded number of waiting tasks."""

    def __init__(self, name: str, workers: int, max_queued: int) -> None:
        self.name = name
        self.workers = workers
        self.max_queued = max_queued
        self.pending = 0  # running + queued; only touched on the event loop thread
        self.executor = ThreadPoolExecutor(max_workers=workers,
                                           thread_name_prefix=f"kvroute-tokenize-{name}")

    async def run(self, fn: Any) -> Any:
        if self.pending >= self.workers + self.max_queued:
            raise TokenizerBusy(f"the tokenizer's {self.name} lane is full ({self.pending} "
                                f"prompts running or queued)")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        finally:
            self.pending -= 1


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


def _as_bool(v: Any, name: str, default: bool) -> bool:
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be true or false, got {v!r}")
    return v


def _truncation(k: Any) -> Optional[int]:
    """truncate_prompt_tokens as a positive count, or None for no truncation."""
    if k is None or k == -1 and not isinstance(k, bool):
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"truncate_prompt_tokens must be a positive int, -1 or null, got {k!r}")
    return k


def _token_ids(prompt: Any) -> np.ndarray:
    """Validated token ids as uint32 (ints in [0, 2**32))."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise ValueError(f"token ids must be a 1-D integer array, got shape {prompt.shape} "
                             f"dtype {prompt.dtype}")
        arr = prompt
    else:
        bad = next((x for x in prompt if type(x) is not int), None)  # noqa: E721 - no bools
        if bad is not None:
            raise ValueError(f"token ids must be ints in [0, 2**32), got {bad!r} "
                             f"({type(bad).__name__})")
        try:
            arr = np.array(prompt, dtype=np.int64)
        except OverflowError:
            raise ValueError("token ids must be ints in [0, 2**32), got one beyond 2**63") from None
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= _TOKEN_ID_LIMIT):
        lo, hi = int(arr.min()), int(arr.max())
        raise ValueError(f"token ids must be ints in [0, 2**32), got one = "
                         f"{lo if lo < 0 else hi}")
    return np.ascontiguousarray(arr, dtype=np.uint32)


# aencode_request sends a chat with more messages than this to the pool whatever their


class PromptTokenizer:
    """Turns OpenAI-compatible request bodies into the token ids a vLLM engine will prefill.

    Parameters
    ----------
    tokenizer_json:
        The model's ``tokenizer.json`` (loaded with ``tokenizers.Tokenizer.from_file``), or an
        already loaded ``tokenizers.Tokenizer`` to share.
    tokenizer_config:
        Path to ``tokenizer_config.json`` or its parsed dict (for ``chat_template`` and the
        special tokens); ``None``: no chat template (`encode_chat` raises ValueError). A list
        of named templates uses ``"default"``, and ``"tool_use"`` for requests with tools,
        as transformers does.
    max_workers:
        Threads of the pool `aencode_request` runs ordinary prompts on; default the
        machine's CPU count (``os.cpu_count()``).
    long_prompt_chars:
        Prompts with more characters than this are encoded on a lane of their own
        (``long_workers`` threads), so long prompts never wait in front of short ones and a
        few long ones cannot occupy every thread. ``None``: one lane.
    long_workers:
        Threads of the long-prompt lane; default ``max(1, cpu_count // 2)``.
    max_queued:
        Prompts that may wait per lane beyond its running ones before `aencode_request`
        raises `TokenizerBusy`; default 1024 (ordinary lane) and 16 (long lane), or this
        value for both.
    prefix_cache_tokens:
        Token ids kept by the chat `PrefixCache` (a turn extending an earlier conversation
        encodes only what is new; a conversation that starts with a cached system message
        encodes only the rest); 0 or no boundary token in the vocabulary: off. Only chat
        prompts of at least ``prefix_cache_min_chars`` characters use it (below, the cache's
        extra encode call costs more than it saves: Qwen3, this machine, a 150-character
        user-only chat 65 µs plain, 76 µs through the cache).
    inline_chars:
        `aencode_request` encodes requests whose prompt text (or message strings) totals at
        most this many characters on the calling thread (a chat with tools, documents, tool
        calls or more than 64 messages always goes to the pool): the hop to the pool costs more
        than encoding them (Qwen3, this machine: 300 characters take 63 µs inline and 180 µs
        through the pool; 4,000 take 890 µs either way). 0 sends everything to the pool.
    default_chat_template_kwargs:
        The engine's ``--default-chat-template-kwargs`` (e.g. ``{"enable_thinking": False}``),
        applied under each request's ``chat_template_kwargs``, as vLLM merges them.
    content_format:
        The engine's ``--chat-template-content-format``: ``"auto"`` (default; detected from
        the template, see `chat_template_content_format`), ``"string"`` or ``"openai"``.

    Raises
    ------
    ValueError
        Unreadable tokenizer files, a config that is not a JSON object, a bad option.
    """

    def __init__(
        self,
        tokenizer_json: Union[PathLike, Any],
        tokenizer_config: Union[PathLike, Mapping[str, Any], None] = None,
        *,
        max_workers: Optional[int] = None,
        default_chat_template_kwargs: Optional[Mapping[str, Any]] = None,
        content_format: Literal["auto", "string", "openai"] = "auto",
        inline_chars: int = 1024,
        long_prompt_chars: Optional[int] = LONG_PROMPT_CHARS,
        long_workers: Optional[int] = None,
        max_queued: Optional[int] = None,
        prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
        prefix_cache_min_chars: int = 256,
    ) -> None:
        import os

        from tokenizers import Tokenizer

        cpus = os.cpu_count() or 1
        if max_workers is None:
            max_workers = cpus
        if long_workers is None:
            long_workers = max(1, cpus // 2)
        for name, v in (("max_workers", max_workers), ("long_workers", long_workers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name, opt in (("long_prompt_chars", long_prompt_chars), ("max_queued", max_queued)):
            if opt is not None and (isinstance(opt, bool) or not isinstance(opt, int) or opt < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {opt!r}")
        for name, v in (("prefix_cache_tokens", prefix_cache_tokens),
                        ("prefix_cache_min_chars", prefix_cache_min_chars)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        self.long_prompt_chars = long_prompt_chars
        self.prefix_cache_min_chars = prefix_cache_min_chars
        if not isinstance(inline_chars, int) or inline_chars < 0:
            raise ValueError(f"inline_chars must be an int >= 0, got {inline_chars!r}")
        self.inline_chars = inline_chars
        if content_format not in ("auto", "string", "openai"):
            raise ValueError(f"content_format must be 'auto', 'string' or 'openai', got "
                             f"{content_format!r}")
        if isinstance(tokenizer_json, Tokenizer):
            self._tok = tokenizer_json  # shared: a Tokenizer is safe to use from many threads
        else:
            try:
                self._tok = Tokenizer.from_file(str(tokenizer_json))
            except Exception as e:  # tokenizers raises its own Exception type
                raise ValueError(f"cannot load tokenizer.json from {tokenizer_json}: {e}") from e
        if tokenizer_config is None or isinstance(tokenizer_config, Mapping):
            config = dict(tokenizer_config or {})
        else:
            try:
                with open(tokenizer_config, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read tokenizer_config.json from {tokenizer_config}: "
                                 f"{e}") from e
            if not isinstance(config, dict):
                raise ValueError(f"{tokenizer_config} must hold a JSON object")
        self.config: Dict[str, Any] = config
        self._special = _special_tokens(config)  # the template's special-token variables
        template = config.get("chat_template")
        # Several named templates ([{"name": "default", "template": ...}, {"name":
        # "tool_use", ...}]): transformers renders "tool_use" when the request has tools.
        self._named: Dict[str, str] = {}
        if isinstance(template, list):
            self._named = {t["name"]: t["template"] for t in template
                           if isinstance(t, Mapping) and isinstance(t.get("name"), str)
                           and isinstance(t.get("template"), str)}
            template = self._named.get("default")
        self.chat_template: Optional[str] = template if isinstance(template, str) else None
        for t in {self.chat_template, *self._named.values()} - {None}:
            try:
                _compile_chat_template(t)  # fail early on a broken template
            except Exception as e:  # jinja2.TemplateSyntaxError
                raise ValueError(f"the chat_template of {tokenizer_config} does not compile: "
                                 f"{e}") from e
        self._content_format_option = content_format
        self.content_format: ContentFormat = self._content_format(self.chat_template)
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        # A tokenizer.json that pads batches would pad a batch of pieces: encoded one by one.
        self._batch_ok = self._tok.padding is None
        self._lane = _Lane("short", max_workers, MAX_QUEUED if max_queued is None else max_queued)
        self._long_lane = (_Lane("long", long_workers,
                                 LONG_MAX_QUEUED if max_queued is None else max_queued)
                           if long_prompt_chars is not None else None)
        self._executor = self._lane.executor
        boundaries = [t.content for t in self._tok.get_added_tokens_decoder().values()
                      if t.special and not t.lstrip and t.content]
        self.prefix_cache: Optional[PrefixCache] = (
            PrefixCache(boundaries, prefix_cache_tokens)
            if prefix_cache_tokens > 0 and boundaries else None)

    def _content_format(self, template: Optional[str]) -> ContentFormat:
        if self._content_format_option != "auto":
            return self._content_format_option
        return "string" if template is None else chat_template_content_format(template)

    def _template_for(self, tools: Any) -> Optional[str]:
        if tools is not None and "tool_use" in self._named:
            return self._named["tool_use"]
        return self.chat_template

    @classmethod
    def from_dir(cls, path: PathLike, **kwargs: Any) -> PromptTokenizer:
        """From a directory holding ``tokenizer.json`` and ``tokenizer_config.json`` (a model
        snapshot, or ``$KVROUTE_SHARED_DATA/tokenizers/qwen3``). Keyword arguments as the
        class."""
        d = Path(path)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {d}")
        cfg = d / "tokenizer_config.json"
        return cls(d / "tokenizer.json", cfg if cfg.is_file() else None, **kwargs)

    # -- encoding ----------------------------------------------------------------------------
    def _encode_many(self, texts: List[str]) -> List[np.ndarray]:
        """The token ids of each text, no special tokens added, in one call (one GIL release);
        each as `_encode_text` gives it (used when the tokenizer pads no batch)."""
        return [np.asarray(e.ids, dtype=np.uint32)
                for e in self._encode_batch(texts, add_special_tokens=False)]

    def _encode_text(self, text: str, add_special_tokens: bool,
                     truncate: Optional[int] = None) -> np.ndarray:
        # encode_batch(_fast) releases the GIL, Tokenizer.encode does not (module docstring).
        if not truncate:
            enc = self._encode_batch([text], add_special_tokens=add_special_tokens)[0]
            return np.asarray(enc.ids, dtype=np.uint32)
        # Left truncation keeping the special tokens, as the engine's tokenizer does with
        # truncation_side="left": cut the content, then post-process.
        enc = self._encode_batch([text], add_special_tokens=False)[0]
        n_special = self._tok.num_special_tokens_to_add(False) if add_special_tokens else 0
        enc.truncate(max(truncate - n_special, 0), direction="left")
        if add_special_tokens:
            enc = self._tok.post_process(enc, add_special_tokens=True)
        return np.asarray(enc.ids, dtype=np.uint32)

    def encode_prompt(self, prompt: Any, *, add_special_tokens: bool = True,
                      truncate_prompt_tokens: Optional[int] = None) -> np.ndarray:
        """Token ids of a completions ``prompt``.

        Parameters
        ----------
        prompt:
            A string, encoded with ``add_special_tokens`` (vLLM's completions default True:
            the tokenizer's post-processor adds e.g. a BOS; Qwen3 adds nothing), or token ids
            (a list of ints or a 1-D integer array, each in ``[0, 2**32)``) used as they are.
            A one-element list of either is that prompt.
        add_special_tokens:
            The request field (vLLM's completions default True).
        truncate_prompt_tokens:
            The request field: keep only the last k tokens (vLLM truncates on the left,
            special tokens kept). None or -1 (the engine's max_model_len, unknown here): no
            truncation.

        Returns
        -------
        numpy.ndarray
            ``uint32``, shape ``(prompt tokens,)``.

        Raises
        ------
        UnsupportedPrompt
            Several prompts (``"batched prompts are not routed: send one prompt per
            request"``).
        ValueError
            Empty prompt, ids out of range or not ints, any other type.
        """
        k = _truncation(truncate_prompt_tokens)
        if isinstance(prompt, str):
            return self._encode_text(prompt, add_special_tokens, k)
        if isinstance(prompt, np.ndarray):
            return _token_ids(prompt)[-k:] if k else _token_ids(prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt is empty: expected a string or a non-empty list of "
                                 "token ids")
            if isinstance(prompt[0], (str, list, tuple)):
                if len(prompt) == 1:
                    return self.encode_prompt(prompt[0], add_special_tokens=add_special_tokens,
                                              truncate_prompt_tokens=truncate_prompt_tokens)
                raise UnsupportedPrompt("batched prompts are not routed: send one prompt per "
                                        f"request (got a list of {len(prompt)} prompts)")
            return _token_ids(prompt)[-k:] if k else _token_ids(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got "
                         f"{type(prompt).__name__}")

    def render_chat(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        documents: Optional[Sequence[Mapping[str, Any]]] = None,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> str:
        """The prompt text vLLM renders for a chat request (arguments as `encode_chat`).

        Raises
        ------
        UnsupportedPrompt
            Multimodal content parts.
        ValueError
            As `encode_chat`; also whatever the template raised on values of the wrong type
            (TypeError, AttributeError, IndexError, KeyError: e.g. a ``chat_template_kwargs``
            string the template adds to a number) and a request nested too deeply
            (RecursionError): bad input, not a server error.
        """
        try:
            return self._render_chat(messages, add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message, tools=tools,
                                     documents=documents,
                                     chat_template_kwargs=chat_template_kwargs)
        except (TypeError, AttributeError, IndexError, KeyError) as e:
            raise ValueError(f"the chat template failed on the request: {type(e).__name__}: "
                             f"{e}") from e
        except RecursionError:
            raise ValueError("the chat request nests too deeply to render") from None

    def _render_chat(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Optional[Sequence[Mapping[str, Any]]],
        documents: Optional[Sequence[Mapping[str, Any]]],
        chat_template_kwargs: Optional[Mapping[str, Any]],
    ) -> str:
        template = self._template_for(tools)
        if template is None:
            raise ValueError("this tokenizer has no chat_template: pass a tokenizer_config with "
                             "one to tokenize chat requests")
        conv = _conversation(messages, self._content_format(template))
        if documents is not None and not (isinstance(documents, (list, tuple))
                                          and all(isinstance(d, Mapping) for d in documents)):
            raise ValueError("documents must be a list of dicts (e.g. {'title': ..., 'text': ...})")
        kw: Dict[str, Any] = {"add_generation_prompt": _as_bool(add_generation_prompt,
                                                                "add_generation_prompt", True),
                              "continue_final_message": _as_bool(continue_final_message,
                                                                 "continue_final_message", False),
                              "tools": _tools(tools), "documents": documents}
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(f"chat_template_kwargs must be an object, got "
                             f"{type(chat_template_kwargs).__name__}")
        extra = {**self.default_chat_template_kwargs, **(chat_template_kwargs or {})}
        if extra:
            reserved = _RESERVED_KWARGS & extra.keys()
            if reserved:
                raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
            # vLLM passes only what the template reads or apply_chat_template takes; the
            # rest is dropped silently (resolve_chat_template_kwargs).
            accepted = _accepted_kwargs(template)
            kw.update({k: v for k, v in extra.items() if k in accepted})
        if kw["add_generation_prompt"] and kw["continue_final_message"]:
            raise ValueError("Cannot set both continue_final_message and add_generation_prompt "
                             "to true")
        import jinja2

        try:
            return _render(template, self._special, conv, **kw)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e

    def encode_chat(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
        documents: Optional[Sequence[Mapping[str, Any]]] = None,
        add_special_tokens: bool = False,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> np.ndarray:
        """Token ids of a chat request, as vLLM's ``/v1/chat/completions`` computes them.

        Parameters
        ----------
        messages:
            OpenAI chat messages: ``role``; ``content`` a string, null, or a list of text
            parts (``{"type": "text", "text": ...}``; also ``input_text``, ``output_text``,
            ``refusal``, ``thinking``), joined with ``"\\n"`` for string-content templates
            (Qwen3's) or passed as parts to templates that loop over them; assistant
            ``tool_calls`` (JSON-string arguments parsed to objects) and ``reasoning``; tool
            ``tool_call_id``; ``name``.
        add_generation_prompt, continue_final_message:
            As the request fields (defaults True / False); not both.
        tools:
            Request ``tools`` (``[{"type": "function", "function": {"name", "description",
            "parameters"}}]``), rendered as vLLM's ``model_dump()`` of them.
        chat_template_kwargs:
            Request ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``), over the
            engine defaults; keys the template does not read are ignored, as vLLM does.
        documents:
            Request ``documents`` for RAG templates.
        add_special_tokens:
            The request field (vLLM default False: the template writes the special tokens).
        truncate_prompt_tokens:
            As in `encode_prompt`.

        Returns
        -------
        numpy.ndarray
            ``uint32``, shape ``(prompt tokens,)``.

        Raises
        ------
        UnsupportedPrompt
            Multimodal content parts.
        ValueError
            Malformed messages / tools / kwargs, reserved kwargs (``chat_template``,
            ``tokenize``, ``messages``, ``conversation``), no chat template, or a template
            that rejects the conversation (its ``raise_exception`` message is kept).
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, tools=tools,
                                documents=documents, chat_template_kwargs=chat_template_kwargs)
        special = _as_bool(add_special_tokens, "add_special_tokens", False)
        truncate = _truncation(truncate_prompt_tokens)
        if (self.prefix_cache is not None and not special and not truncate
                and len(text) >= self.prefix_cache_min_chars):
            return self.prefix_cache.encode(text, lambda t: self._encode_text(t, False),
                                            self._encode_many if self._batch_ok else None)
        return self._encode_text(text, special, truncate)

    def encode_request(self, path: str, body: Mapping[str, Any]) -> np.ndarray:
        """Token ids of an OpenAI-compatible request body, by path.

        Parameters
        ----------
        path:
            ``"/v1/completions"`` (reads ``prompt``, ``add_special_tokens`` default True) or
            ``"/v1/chat/completions"`` (reads ``messages``, ``tools``, ``documents``,
            ``add_generation_prompt`` default True, ``continue_final_message`` default False,
            ``chat_template_kwargs``, ``add_special_tokens`` default False); both read
            ``truncate_prompt_tokens``. A query string or trailing slash is ignored.
        body:
            The parsed JSON body.

        Returns
        -------
        numpy.ndarray
            ``uint32``, shape ``(prompt tokens,)``.

        Raises
        ------
        UnsupportedPrompt
            Batched prompts, ``prompt_embeds``, multimodal parts, a request ``chat_template``.
        ValueError
            Unknown path, a body that is not an object, missing or malformed fields.
        """
        route = path.split("?", 1)[0].rstrip("/") if isinstance(path, str) else path
        if not isinstance(body, Mapping):
            raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
        if route == COMPLETIONS_PATH:
            prompt = body.get("prompt")
            if prompt is None:
                if body.get("prompt_embeds") is not None:
                    raise UnsupportedPrompt("prompt_embeds requests carry no token ids to route on")
                raise ValueError("a /v1/completions body needs 'prompt' (a string or a list of "
                                 "token ids)")
            return self.encode_prompt(prompt, add_special_tokens=_as_bool(
                body.get("add_special_tokens"), "add_special_tokens", True),
                truncate_prompt_tokens=body.get("truncate_prompt_tokens"))
        if route == CHAT_COMPLETIONS_PATH:
            if body.get("chat_template") is not None:
                raise UnsupportedPrompt("a request-supplied chat_template is not rendered by "
                                        "kvroute (vLLM needs --trust-request-chat-template)")
            if "messages" not in body:
                raise ValueError("a /v1/chat/completions body needs 'messages'")
            return self.encode_chat(
                body["messages"], tools=body.get("tools"), documents=body.get("documents"),
                add_generation_prompt=_as_bool(body.get("add_generation_prompt"),
                                               "add_generation_prompt", True),
                continue_final_message=_as_bool(body.get("continue_final_message"),
                                                "continue_final_message", False),
                chat_template_kwargs=body.get("chat_template_kwargs"),
                add_special_tokens=_as_bool(body.get("add_special_tokens"),
                                            "add_special_tokens", False),
                truncate_prompt_tokens=body.get("truncate_prompt_tokens"))
        raise ValueError(f"cannot tokenize requests to {path!r}: expected {COMPLETIONS_PATH!r} or "
                         f"{CHAT_COMPLETIONS_PATH!r}")

    async def aencode_request(self, path: str, body: Mapping[str, Any]) -> np.ndarray:
        """`encode_request` on the tokenizer's thread pool, so the event loop keeps serving
        while a long prompt is rendered and encoded (see the module docstring for why this
        works: the encoding releases the GIL). Same returns and raises."""
        if _text_chars(body, self.inline_chars) <= self.inline_chars:
            return self.encode_request(path, body)  # short: cheaper than the hop to the pool
        lane = self._lane
        if (self._long_lane is not None and self.long_prompt_chars is not None
                and prompt_chars(body, self.long_prompt_chars) > self.long_prompt_chars):
            lane = self._long_lane
        return await lane.run(functools.partial(self.encode_request, path, body))

    def lanes(self) -> Dict[str, Dict[str, int]]:
        """Per lane (``short``, ``long``): ``workers``, ``pending`` (running + queued),
        ``max_queued``."""
        return {lane.name: {"workers": lane.workers, "pending": lane.pending,
                            "max_queued": lane.max_queued}
                for lane in (self._lane, self._long_lane) if lane is not None}

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Shuts the thread pools down (waits for running tokenizations). Idempotent."""
        self._lane.executor.shutdown(wait=True)
        if self._long_lane is not None:
            self._long_lane.executor.shutdown(wait=True)

    def __enter__(self) -> PromptTokenizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
