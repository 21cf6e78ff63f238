"""Chat template rendering as transformers does it (``transformers/utils/chat_template_utils.py``).

A model's Jinja ``chat_template`` is compiled in the environment transformers uses: sandbox,
``trim_blocks``, ``lstrip_blocks``, ``tojson`` keeping non-ASCII, ``raise_exception``,
``strftime_now``, the ``{% generation %}`` tag and ``loopcontrols``. Compiled templates and
their variables are cached per template string (``functools.lru_cache``, 16 templates).
`chat_template_content_format` is vLLM's ``--chat-template-content-format auto`` rule.
Only ``jinja2`` is needed.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Dict, FrozenSet, Literal, Optional

__all__ = ["ContentFormat", "chat_template_content_format", "render_chat_template"]

ContentFormat = Literal["string", "openai"]

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

    class _Environment(ImmutableSandboxedEnvironment):
        """The sandbox with its attribute check remembered per (type, attribute): jinja's
        check reads only the object's type and the attribute's name (an underscore name, an
        internal attribute of functions, methods, types, frames and generators, a method
        that mutates a list, dict, set or deque), so the answers are the same; the check
        ran on every attribute a template reads (about a fifth of a chat render)."""

        _safe: Dict[Any, bool] = {}

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            key = (type(obj), attr)
            ok = self._safe.get(key)
            if ok is None:
                ok = self._safe[key] = super().is_safe_attribute(obj, attr, value)
            return ok

    env = _Environment(
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
