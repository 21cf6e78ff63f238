"""vLLM's OpenAI-server request preprocessing and ORCA load header, reproduced for the engine
stand-in (`kvroute.sim.standin_engine`, `kvroute.sim.standin_app`): the shapes vLLM hands its
chat template (messages, tools) and the load report it adds to a response."""

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = [
    "ORCA_REQUEST_HEADER",
    "ORCA_RESPONSE_HEADER",
    "orca_header",
    "vllm_chat_messages",
    "vllm_tool_dicts",
]

ORCA_REQUEST_HEADER = "endpoint-load-metrics-format"
"""Request header asking for an ORCA load report (vLLM
``ENDPOINT_LOAD_METRICS_FORMAT_HEADER_LABEL``, ``vllm/entrypoints/openai/api_server.py``)."""
ORCA_RESPONSE_HEADER = "endpoint-load-metrics"
"""Response header carrying it (``vllm/entrypoints/serve/utils/orca_metrics.py``)."""


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
