"""vLLM's normalisation of chat request fields before the template sees them
(``vllm/entrypoints/chat_utils.py`` ``parse_chat_messages`` and ``_postprocess_messages``,
``ChatCompletionToolsParam.model_dump()``): text parts joined with ``"\\n"`` for
string-content templates, assistant ``tool_calls`` arguments parsed from JSON to dicts, tools
with their declared fields first. Multimodal parts raise `UnsupportedPrompt`."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, Dict, List, Optional

from kvroute.prompt.errors import UnsupportedPrompt
from kvroute.prompt.templates import ContentFormat

# Content part types vLLM reads as text (vllm/entrypoints/chat_utils.py MM_PARSER_MAP), and
# the key holding the text.
_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text",
                   "refusal": "refusal", "thinking": "thinking"}


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
