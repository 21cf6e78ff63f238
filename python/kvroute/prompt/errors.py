"""The prompt package's exceptions: what a tokenizer refuses (`UnsupportedPrompt`) and when it
sheds load (`TokenizerBusy`)."""

from __future__ import annotations

__all__ = ["TokenizerBusy", "UnsupportedPrompt"]


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
