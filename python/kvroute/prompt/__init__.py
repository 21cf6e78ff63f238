"""Prompts as the engine sees them: OpenAI-compatible request bodies to the token ids a vLLM
engine will prefill, so the router keys blocks on exactly those ids.

* `kvroute.prompt.tokenizer` — `PromptTokenizer` (vLLM's completions and chat paths, thread
  lanes for `PromptTokenizer.aencode_request`), `COMPLETIONS_PATH`, `CHAT_COMPLETIONS_PATH`.
* `kvroute.prompt.templates` — `render_chat_template`, `chat_template_content_format`: a
  model's Jinja chat template rendered as transformers renders it.
* `kvroute.prompt.messages` — vLLM's normalisation of ``messages`` and ``tools``.
* `kvroute.prompt.prefix_cache` — `PrefixCache`: token ids of rendered chat prefixes.
* `kvroute.prompt.sizes` — `prompt_chars`: a request's prompt size without tokenizing.
* `kvroute.prompt.errors` — `UnsupportedPrompt`, `TokenizerBusy`.

Needs ``numpy``; ``jinja2`` (templates) and ``tokenizers`` (`PromptTokenizer`) are imported
when first used. Sits below `kvroute.serving`, `kvroute.replay`, `kvroute.sim` and the
integrations, and imports none of them. See README.md in this directory.
"""

from __future__ import annotations

from kvroute.prompt.errors import TokenizerBusy, UnsupportedPrompt
from kvroute.prompt.prefix_cache import PrefixCache
from kvroute.prompt.sizes import prompt_chars
from kvroute.prompt.templates import (
    ContentFormat,
    chat_template_content_format,
    render_chat_template,
)
from kvroute.prompt.tokenizer import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, PromptTokenizer

__all__ = [
    "CHAT_COMPLETIONS_PATH",
    "COMPLETIONS_PATH",
    "ContentFormat",
    "PrefixCache",
    "PromptTokenizer",
    "TokenizerBusy",
    "UnsupportedPrompt",
    "chat_template_content_format",
    "prompt_chars",
    "render_chat_template",
]
