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
import copy
import functools
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Literal, Optional, Union

import numpy as np

__all__ = [
    "CHAT_COMPLETIONS_PATH",
    "COMPLETIONS_PATH",
    "PrefixCache",
    "PromptTokenizer",
    "TokenizerBusy",
    "UnsupportedPrompt",
    "chat_template_content_format",
    "prompt_chars",
    "render_chat_template",
]

#: OpenAI-compatible paths `PromptTokenizer.encode_request` understands.
COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"

ContentFormat = Literal["string", "openai"]
PathLike = Union[str, Path]

_TOKEN_ID_LIMIT = 1 << 32
# Content part types vLLM reads as text (vllm/entrypoints/chat_utils.py MM_PARSER_MAP), and
# the key holding the text.
_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text",
                   "refusal": "refusal", "thinking": "thinking"}
# Keys of transformers' apply_chat_template that a request's chat_template_kwargs may set
# (vLLM accepts them even when the template does not name them) ...
_HF_APPLY_PARAMS = frozenset({
    "tools", "documents", "add_generation_prompt", "continue_final_message", "padding",
    "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
# ... of which these steer tokenization, not the template: accepted and not rendered.
_HF_NON_TEMPLATE = frozenset({
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
# Refused in chat_template_kwargs (vLLM raises for chat_template / tokenize; messages and
# conversation would collide with the conversation argument).
_RESERVED_KWARGS = frozenset({"chat_template", "tokenize", "messages", "conversation"})
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class UnsupportedPrompt(ValueError):
    """A well-formed request that kvroute cannot turn into the engine's token ids.

    Multimodal content parts, ``prompt_embeds``, several prompts in one completions request,
    or a request-supplied ``chat_template``. The engine may well serve it: route it without
    a prefix match (e.g. on a session key) rather than rejecting it. A `ValueError`, so code
    that only catches ValueError still treats it as "cannot tokenize".
    """


class TokenizerBusy(RuntimeError):
    """A tokenizer lane's queue is full (`PromptTokenizer` ``max_queued``): shed the request
    (the proxy answers 503 with ``Retry-After``) rather than queue it without bound."""


class PrefixCache:
    """Token ids of rendered chat prefixes, so a turn that extends the previous one encodes
    only its new part.

    Exact by construction: ``tokenizers`` splits the input on added tokens before it
    normalizes and pre-tokenizes the pieces between them, so for a cut right before a
    boundary token (a special added token without ``lstrip``, e.g. Qwen3's ``<|im_start|>``)
    ``encode(a + b) == encode(a) + encode(b)`` when no special tokens are added (the chat
    default, ``add_special_tokens=False``). `encode` finds the cached prefix that ends at the
    latest such boundary, encodes the rest up to the last boundary (and stores that prefix:
    in the next turn it is followed by the assistant's answer), then the tail after it. When
    no prefix is cached, the text before the first boundary (the first message: a chat
    application's system prompt, which its other conversations share) is encoded and stored
    on its own too.
    Prefixes are keyed by a BLAKE2b digest of their UTF-8 text, computed incrementally, so
    the lookup costs one pass over the text.

    Parameters
    ----------
    boundaries:
        The boundary token strings.
    max_tokens:
        Bound on the token ids kept over all entries (LRU), >= 1.

    Thread-safe (one lock around the LRU).
    """

    def __init__(self, boundaries: Sequence[str], max_tokens: int = 1 << 22) -> None:
        import re
        import threading
        from collections import OrderedDict

        if not boundaries:
            raise ValueError("PrefixCache needs at least one boundary token")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        self._re = re.compile("|".join(re.escape(b) for b in sorted(boundaries, key=len,
                                                                      reverse=True)))
        self.max_tokens = max_tokens
        self._lru: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._lru)

    def encode(self, text: str, encode: Any) -> np.ndarray:
        """``encode(text)`` (``str -> uint32 array``, no special tokens added), reusing and
        storing prefixes."""
        import hashlib

        bounds = [m.start() for m in self._re.finditer(text) if m.start() > 0]
        if not bounds:
            return encode(text)
        h = hashlib.blake2b(digest_size=16)
        digests = []
        prev = 0
        for b in bounds:
            h.update(text[prev:b].encode("utf-8", "surrogatepass"))
            digests.append(h.copy().digest())
            prev = b
        hit, head = -1, None
        with self._lock:
            for i in range(len(bounds) - 1, -1, -1):
                head = self._lru.get(digests[i])
                if head is not None:
                    self._lru.move_to_end(digests[i])
                    hit = i
                    break
        last = len(bounds) - 1
        if hit == last:
            self.hits += 1
        else:
            if hit >= 0:
                self.hits += 1
            else:
                self.misses += 1
            if hit < 0 and last >= 2:
                # Nothing cached: keep the first message on its own as well (a chat
                # application's system prompt, which its other conversations start with).
                head = encode(text[:bounds[0]])
                self._put(digests[0], head)
                hit = 0
            start = bounds[hit] if hit >= 0 else 0
            mid = encode(text[start:bounds[last]])
            head = mid if head is None else np.concatenate([head, mid])
            self._put(digests[last], head)
        assert head is not None
        return np.concatenate([head, encode(text[bounds[last]:])])

    def _put(self, key: bytes, ids: np.ndarray) -> None:
        if len(ids) > self.max_tokens:
            return
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._lru[key] = ids
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                _, dropped = self._lru.popitem(last=False)
                self._tokens -= len(dropped)


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
# Chat template rendering (the transformers environment)
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    """The Jinja environment transformers compiles chat templates in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' AssistantTracker): only
        marks assistant spans for masks; rendering passes the body through."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_passthrough"), [], [], body
                                          ).set_lineno(lineno)

        def _passthrough(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # transformers' override: keeps non-ASCII and does not HTML-escape.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> Any:
    """Compile a chat template once."""
    return _environment().from_string(template)


@functools.lru_cache(maxsize=16)
def _template_variables(template: str) -> FrozenSet[str]:
    """Variables a template reads from its caller (jinja2.meta.find_undeclared_variables)."""
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))


def _refers(node: Any, names: set, key: Optional[str] = None) -> bool:
    """Is ``node`` the variable ``names`` (or its ``[key]`` / ``.key``), possibly sliced,
    filtered or tested? The shapes vLLM's content-format detection accepts."""
    import jinja2.nodes as n

    while True:
        if isinstance(node, (n.Filter, n.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, n.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, n.Getattr):
        return node.attr == key and _refers(node.node, names)
    if isinstance(node, n.Getitem):
        return (isinstance(node.arg, n.Const) and node.arg.value == key
                and _refers(node.node, names))
    return False


@functools.lru_cache(maxsize=16)
def _accepted_kwargs(template: str) -> FrozenSet[str]:
    """``chat_template_kwargs`` keys vLLM passes on to this template."""
    return (_template_variables(template) | _HF_APPLY_PARAMS) - _HF_NON_TEMPLATE


@functools.lru_cache(maxsize=16)
def chat_template_content_format(template: str) -> ContentFormat:
    """How a chat template expects ``message.content``: ``"string"`` or ``"openai"``.

    The rule of vLLM's ``--chat-template-content-format auto`` (``vllm/renderers/hf.py``
    ``_detect_content_format``): ``"openai"`` (a list of ``{"type": "text", "text": ...}``
    parts) when the template loops over the content of a message taken from ``messages`` (or
    from a variable assigned from it), else ``"string"`` (parts joined with ``"\\n"``).
    A template that does not parse counts as ``"string"``, vLLM's default.
    """
    import jinja2.nodes as n

    try:
        ast = _environment().parse(template)
    except Exception:  # noqa: BLE001 - vLLM falls back to "string" on any parse failure
        return "string"
    lists = {"messages"}
    grew = True
    while grew:  # variables assigned from messages (messages[1:], messages|reverse, ...)
        grew = False
        for a in ast.find_all(n.Assign):
            if (isinstance(a.target, n.Name) and a.target.name not in lists
                    and _refers(a.node, lists)):
                lists.add(a.target.name)
                grew = True
    items = {f.target.name for f in ast.find_all(n.For)
             if isinstance(f.target, n.Name) and _refers(f.iter, lists)}
    if any(_refers(f.iter, items, "content") for f in ast.find_all(n.For)):
        return "openai"
    return "string"


def _special_tokens(tokenizer_config: Mapping[str, Any]) -> Dict[str, Any]:
    """The template variables transformers adds from the tokenizer's special tokens map: only
    the tokens that are set (an AddedToken dict contributes its ``content``)."""
    out: Dict[str, Any] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        v = tokenizer_config.get(key)
        if isinstance(v, Mapping):
            v = v.get("content")
        if v is not None:
            out[key] = v
    extra = tokenizer_config.get("additional_special_tokens")
    if extra:
        out["additional_special_tokens"] = [t.get("content") if isinstance(t, Mapping) else t
                                            for t in extra]
    return out


def render_chat_template(
    messages: Sequence[Mapping[str, Any]],
    tokenizer_config: Mapping[str, Any],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    documents: Optional[Sequence[Mapping[str, Any]]] = None,
    **template_kwargs: Any,
) -> str:
    """Render ``messages`` with a Hugging Face ``chat_template`` as transformers does.

    The low-level step: messages, tools and documents reach the template as given (no vLLM
    normalisation; `PromptTokenizer.encode_chat` does that). Uses a
    `jinja2.sandbox.ImmutableSandboxedEnvironment` with ``trim_blocks`` and
    ``lstrip_blocks``, the ``loopcontrols`` extension and ``{% generation %}`` tag, a
    ``tojson`` filter that keeps non-ASCII, the ``raise_exception`` / ``strftime_now``
    globals, and the config's special tokens that are set (``bos_token``, ``eos_token``,
    ``pad_token``, ..., ``additional_special_tokens``) as variables.

    Parameters
    ----------
    messages:
        Chat messages, each ``{"role": ..., "content": ...}`` plus whatever the template reads.
    tokenizer_config:
        Parsed ``tokenizer_config.json`` containing a string ``chat_template``.
    add_generation_prompt:
        Append the assistant-turn opener (vLLM's default for chat completions).
    continue_final_message:
        Cut the rendering right after the final message's text so the model continues it
        (transformers' rule: the last occurrence of the stripped text, keeping its leading
        whitespace if the template did). Incompatible with ``add_generation_prompt``.
    tools, documents:
        Tool JSON schemas and RAG documents, passed to the template as they are.
    **template_kwargs:
        Extra template variables (e.g. ``enable_thinking=False``).

    Returns
    -------
    str
        The prompt text, special tokens included as text.

    Raises
    ------
    ValueError
        No string ``chat_template``; both ``add_generation_prompt`` and
        ``continue_final_message``; ``continue_final_message`` with no final text to continue.
    jinja2.exceptions.TemplateError
        The template rejected the messages (``raise_exception``) or failed to render.
    """
    template = tokenizer_config.get("chat_template")
    if not isinstance(template, str):
        raise ValueError("tokenizer_config has no string chat_template (a model without a chat "
                         "template cannot serve /v1/chat/completions)")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible: "
                         "set add_generation_prompt=False to continue the final message")
    return _render(template, _special_tokens(tokenizer_config), messages,
                   add_generation_prompt=add_generation_prompt,
                   continue_final_message=continue_final_message, tools=tools,
                   documents=documents, **template_kwargs)


def _render(template: str, special: Mapping[str, Any], messages: Sequence[Mapping[str, Any]],
            *, add_generation_prompt: bool, continue_final_message: bool,
            tools: Optional[Sequence[Mapping[str, Any]]],
            documents: Optional[Sequence[Mapping[str, Any]]], **template_kwargs: Any) -> str:
    """`render_chat_template` after its checks, with the special-token variables given
    (`_special_tokens` of the config: a `PromptTokenizer` computes them once)."""
    compiled = _compile_chat_template(template)
    text = compiled.render(messages=list(messages), tools=None if tools is None else list(tools),
                           documents=None if documents is None else list(documents),
                           add_generation_prompt=add_generation_prompt,
                           **{**special, **template_kwargs})
    if continue_final_message:
        text = _cut_after_final_message(text, messages)
    return text


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """transformers' ``continue_final_message`` cut (chat_template_utils.render_jinja_template)."""
    if not messages:
        raise ValueError("continue_final_message needs at least one message")
    final = messages[-1].get("content")
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if isinstance(part, Mapping) and "text" in part:
                final = part["text"]
                break
        else:
            raise ValueError("continue_final_message is set but the final message has no text "
                             "part to continue")
    if not isinstance(final, str):
        raise ValueError(f"continue_final_message needs a text final message, got "
                         f"{type(final).__name__}")
    stripped = final.strip()
    if stripped not in text:
        raise ValueError("continue_final_message is set but the final message does not appear "
                         "in the rendered chat (the template changes it)")
    loc = text.rindex(stripped)
    if text[loc:loc + len(final.lstrip())] == final:
        return text[:loc + len(final.lstrip())]
    return text[:loc + len(stripped)]


# --------------------------------------------------------------------------------------------
# vLLM's message normalisation (vllm/entrypoints/chat_utils.py parse_chat_messages)
# --------------------------------------------------------------------------------------------


def _content(content: Any, fmt: ContentFormat, where: str) -> Any:
    """One message's content as the template will see it."""
    if content is None:
        return "" if fmt == "string" else []
    if isinstance(content, str):
        return content if fmt == "string" else [{"type": "text", "text": content}]
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where} must be a string, a list of content parts or null, got "
                         f"{type(content).__name__}")
    texts: List[str] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, Mapping):
            kind = part.get("type")
            if kind is None:
                raise ValueError(f"{where}[{j}] needs a 'type' (e.g. 'text'), got keys "
                                 f"{sorted(part)}")
            if kind not in _TEXT_PART_KEYS:
                raise UnsupportedPrompt(
                    f"{where}[{j}] has type {kind!r}: only text parts "
                    f"({', '.join(sorted(_TEXT_PART_KEYS))}) are tokenized by kvroute; "
                    "multimodal prompts are routed without a prefix match")
            text = part.get(_TEXT_PART_KEYS[kind])
            if text is None:
                continue  # vLLM skips text parts without text
            if not isinstance(text, str):
                raise ValueError(f"{where}[{j}].{_TEXT_PART_KEYS[kind]} must be a string, got "
                                 f"{type(text).__name__}")
        else:
            raise ValueError(f"{where}[{j}] must be a content part dict or a string, got "
                             f"{type(part).__name__}")
        if fmt == "openai":
            texts.append(text)
        elif text:  # vLLM drops empty parts before joining
            texts.append(text)
    if fmt == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def _tool_calls(tool_calls: Any, where: str) -> Optional[list]:
    """An assistant's tool calls with JSON-string arguments parsed to objects (vLLM's
    ``_postprocess_messages``: unparsable or missing arguments become ``{}``)."""
    if not isinstance(tool_calls, (list, tuple)):
        raise ValueError(f"{where}.tool_calls must be a list, got {type(tool_calls).__name__}")
    out = []
    for j, call in enumerate(tool_calls):
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise ValueError(f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': "
                             f"{{'name': ..., 'arguments': ...}}}}, got {call!r}")
        call = copy.deepcopy(dict(call))
        fn = call["function"] = dict(call["function"])
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except json.JSONDecodeError:
                fn["arguments"] = {}
        elif not isinstance(args, (dict, list)):
            fn["arguments"] = {}
        out.append(call)
    return out or None


def _conversation(messages: Any, fmt: ContentFormat) -> List[Dict[str, Any]]:
    """vLLM's ConversationMessage list for a request's ``messages``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} "
                         f"dicts, got {type(messages).__name__}"
                         + (" (empty)" if isinstance(messages, (list, tuple)) else ""))
    conv = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be a dict with 'role' and 'content', got "
                             f"{type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where} needs a string 'role', got {role!r}")
        msg: Dict[str, Any] = {"role": role, "content": _content(m.get("content"), fmt,
                                                                f"{where}.content")}
        if role == "assistant":
            if m.get("tool_calls") is not None:
                calls = _tool_calls(m["tool_calls"], where)
                if calls:
                    msg["tool_calls"] = calls
            if m.get("reasoning") is not None:  # current vLLM reads only "reasoning"
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(msg["content"], list):  # text-only tool results become a string
                msg["content"] = "\n".join(p["text"] for p in msg["content"])
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        conv.append(msg)
    return conv


def _tools(tools: Any) -> Optional[List[Dict[str, Any]]]:
    """Request tools as vLLM hands them to the template: ``ChatCompletionToolsParam.
    model_dump()`` (declared fields first, ``description`` / ``parameters`` null when absent,
    then extra fields in request order)."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, "
                         f"got {type(tools).__name__}")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': str, "
                             f"'description'?: str, 'parameters'?: object}}}}, got {tool!r}")
        kind = tool.get("type", "function")
        if kind != "function":
            raise ValueError(f"tools[{j}].type must be 'function', got {kind!r}")
        f = {"name": fn["name"], "description": fn.get("description"),
             "parameters": fn.get("parameters")}
        f.update({k: v for k, v in fn.items() if k not in f})
        t = {"type": "function", "function": f}
        t.update({k: v for k, v in tool.items() if k not in t})
        out.append(copy.deepcopy(t))
    return out


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
# length: the per-message normalisation and template loop cost more than their characters say.
_INLINE_MAX_MESSAGES = 64
_INLINE_MAX_DEPTH = 4  # nesting counted by _chars; deeper goes to the pool


def _chars(x: Any, limit: int, depth: int = 0) -> int:
    """Characters of the strings in ``x`` (a string, or lists / dicts of them nested at most
    ``_INLINE_MAX_DEPTH`` deep), counted until past ``limit``. A list longer than ``limit``
    (e.g. token ids), deeper nesting or another object counts as past the limit."""
    if isinstance(x, str):
        return len(x)
    if x is None or isinstance(x, (bool, int, float)):
        return 0
    if depth >= _INLINE_MAX_DEPTH or not isinstance(x, (list, tuple, Mapping)):
        return limit + 1
    items = x.values() if isinstance(x, Mapping) else x
    if len(x) > limit:
        return limit + 1
    total = 0
    for item in items:
        total += _chars(item, limit - total, depth + 1)
        if total > limit:
            break
    return total


def _text_chars(body: Mapping[str, Any], limit: int) -> int:
    """Characters of prompt text in a request body, counted until past ``limit``: a cheap
    bound on the tokenization cost that decides inline or pool (`aencode_request`).

    ``prompt``: its strings, also inside (nested) lists; a token-id list counts its length
    only when past ``limit``. ``messages``: every string of every message (content, content
    parts, reasoning, name). Counts as past the limit: ``tools``, ``documents``, a message
    with ``tool_calls``, more than ``_INLINE_MAX_MESSAGES`` messages, anything malformed."""
    if not isinstance(body, Mapping):
        return limit + 1
    prompt = body.get("prompt")
    if prompt is not None:
        return _chars(prompt, limit)
    messages = body.get("messages")
    if (not isinstance(messages, list) or len(messages) > _INLINE_MAX_MESSAGES
            or body.get("tools") or body.get("documents")):
        return limit + 1
    total = 0
    for m in messages:
        if not isinstance(m, Mapping) or m.get("tool_calls"):
            return limit + 1
        total += _chars(m, limit - total)
        if total > limit:
            break
    return total


def prompt_chars(body: Any, limit: int) -> int:
    """Characters of every string in a request's ``prompt``, ``messages``, ``input``,
    ``tools`` and ``documents`` (any nesting; a list of token ids counts its length), counted
    until past ``limit``: the size that decides the long-prompt lane and the
    ``max_prompt_chars`` check. Never raises."""
    total = 0
    stack = [body.get(k) for k in ("prompt", "messages", "input", "tools", "documents",
                                   "system", "instructions")] if isinstance(body, Mapping) \
        else [body]
    while stack and total <= limit:
        x = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            if x and all(isinstance(t, int) for t in x[:16]):
                total += len(x)
            else:
                stack.extend(x)
    return total


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
        long_prompt_chars: Optional[int] = 65536,
        long_workers: Optional[int] = None,
        max_queued: Optional[int] = None,
        prefix_cache_tokens: int = 1 << 22,
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
        self._lane = _Lane("short", max_workers, 1024 if max_queued is None else max_queued)
        self._long_lane = (_Lane("long", long_workers, 16 if max_queued is None else max_queued)
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
            return self.prefix_cache.encode(text, lambda t: self._encode_text(t, False))
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
