"""Request limits of the proxy: body bytes, prompt characters, prompt tokens.

`RequestLimits` is checked in this order, each as early as it can be:

1. ``max_body_bytes``: a ``Content-Length`` above it is refused before the body is read; a
   body without one (chunked) is counted while it is read and refused once past it. **413**.
2. ``max_prompt_chars``: the characters of the prompt's strings (`kvroute.prompt.
   prompt_chars`), before tokenizing: a prompt that cannot fit is refused without spending
   tokenizer time on it (a 10 MB prompt takes tens of seconds to encode). Default
   ``max_prompt_tokens * chars_per_token``. **400**.
3. ``max_prompt_tokens`` (the engines' ``max_model_len``; ``"auto"`` reads it from the
   workers' ``GET /v1/models``, the smallest ``max_model_len`` any of them reports): the
   token count after tokenizing. **400**.

Errors are the OpenAI shape the proxy answers with (``{"error": {"message", "type", "param",
"code"}}``).
"""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable, Iterable, Mapping, Optional, Union

from kvroute.serving import defaults as D

__all__ = ["BodyTooLarge", "PromptTooLong", "RequestLimits", "read_body"]


class BodyTooLarge(Exception):
    """The request body is larger than ``max_body_bytes`` (answered with 413)."""


class PromptTooLong(ValueError):
    """The prompt is longer than ``max_prompt_chars`` / ``max_prompt_tokens`` (400)."""


class RequestLimits:
    """The proxy's request limits.

    Parameters
    ----------
    max_body_bytes:
        Largest request body, bytes >= 1; ``None``: no limit.
    max_prompt_tokens:
        Largest prompt in tokens (the engines' ``max_model_len``), an int >= 1, ``"auto"``
        (learnt from the workers' ``/v1/models`` once one answers), or ``None``: no limit.
    chars_per_token:
        ``max_prompt_chars`` = ``max_prompt_tokens * chars_per_token`` unless given; > 0.
        The default 16 is far above what text tokenizes to (3-5 characters per token for
        English with BPE vocabularies), so only prompts that cannot fit are refused early.
    max_prompt_chars:
        Largest prompt in characters, checked before tokenizing; ``None``: derived as above.

    Raises
    ------
    ValueError
        A value out of range.
    """

    def __init__(self, max_body_bytes: Optional[int] = D.MAX_BODY_BYTES,
                 max_prompt_tokens: Union[int, str, None] = D.MAX_PROMPT_TOKENS,
                 chars_per_token: float = D.CHARS_PER_TOKEN,
                 max_prompt_chars: Optional[int] = None) -> None:
        for name, v in (("max_body_bytes", max_body_bytes),
                        ("max_prompt_chars", max_prompt_chars)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")
        if max_prompt_tokens is not None and max_prompt_tokens != "auto" and (
                isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int)
                or max_prompt_tokens < 1):
            raise ValueError(f"max_prompt_tokens must be an int >= 1, 'auto' or None, got "
                             f"{max_prompt_tokens!r}")
        if isinstance(chars_per_token, bool) or not isinstance(chars_per_token, (int, float)) \
                or not chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {chars_per_token!r}")
        self.max_body_bytes = max_body_bytes
        self.auto = max_prompt_tokens == "auto"
        self.max_prompt_tokens: Optional[int] = None if self.auto else max_prompt_tokens  # type: ignore[assignment]
        self.chars_per_token = float(chars_per_token)
        self._max_prompt_chars = max_prompt_chars

    @classmethod
    def from_options(cls, options: Any) -> RequestLimits:
        """From a `RequestLimits`, a mapping of its keywords, or ``None`` (defaults)."""
        if isinstance(options, RequestLimits):
            return options
        if options is None:
            return cls()
        return cls(**dict(options))

    @property
    def max_prompt_chars(self) -> Optional[int]:
        """The character bound checked before tokenizing (None: none)."""
        if self._max_prompt_chars is not None:
            return self._max_prompt_chars
        if self.max_prompt_tokens is None:
            return None
        return int(math.ceil(self.max_prompt_tokens * self.chars_per_token))

    def learn_max_model_len(self, values: Iterable[Any]) -> None:
        """With ``max_prompt_tokens="auto"``: take the smallest positive int of ``values``
        (the ``max_model_len`` of the workers' models)."""
        got = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        if self.auto and got:
            self.max_prompt_tokens = min(got)

    def check_chars(self, chars: int, param: str) -> None:
        """Raises PromptTooLong when ``chars`` is over ``max_prompt_chars``."""
        limit = self.max_prompt_chars
        if limit is not None and chars > limit:
            raise PromptTooLong(
                f"the {param} has more than {limit} characters, more than "
                f"{self.max_prompt_tokens} tokens (this model's maximum context length) can "
                f"hold at {self.chars_per_token:g} characters per token; please reduce the "
                f"length of the {param}")

    def check_tokens(self, tokens: int, param: str) -> None:
        """Raises PromptTooLong when ``tokens`` is over ``max_prompt_tokens``."""
        limit = self.max_prompt_tokens
        if limit is not None and tokens > limit:
            raise PromptTooLong(
                f"this model's maximum context length is {limit} tokens; the {param} has "
                f"{tokens} tokens; please reduce the length of the {param}")

    async def tokens_within(self, body: Mapping[str, Any],
                            encode: Callable[[], Awaitable[Any]]) -> Any:
        """``await encode()`` (the prompt's token ids, a sized array) for a request ``body``
        within the limits: its prompt characters checked before encoding, its token count
        after. The ``param`` named in an error: ``messages``, ``input`` or ``prompt``,
        whichever the body has. Raises PromptTooLong, or what ``encode`` raises."""
        from kvroute.prompt import prompt_chars

        param = "messages" if "messages" in body else "input" if "input" in body else "prompt"
        limit = self.max_prompt_chars
        if limit is not None:
            self.check_chars(prompt_chars(body, limit), param)
        tokens = await encode()
        self.check_tokens(len(tokens), param)
        return tokens

    def as_dict(self) -> dict:
        """The limits in effect (``max_prompt_tokens`` None while ``"auto"`` has not learnt
        it yet)."""
        return {"max_body_bytes": self.max_body_bytes,
                "max_prompt_tokens": self.max_prompt_tokens, "auto": self.auto,
                "max_prompt_chars": self.max_prompt_chars}


async def read_body(request: Any, max_bytes: Optional[int]) -> bytes:
    """The body of a starlette ``Request``, at most ``max_bytes`` (None: no bound).

    Raises
    ------
    BodyTooLarge
        ``Content-Length`` or the bytes received exceed ``max_bytes`` (the rest is not read).
    starlette.requests.ClientDisconnect
        The client left while sending.
    """
    if max_bytes is None:
        return await request.body()
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the request body has {int(declared)} bytes; at most {max_bytes} "
                           f"are accepted (max_body_bytes)")
    parts = []
    n = 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > max_bytes:
            raise BodyTooLarge(f"the request body has more than {max_bytes} bytes; at most "
                               f"{max_bytes} are accepted (max_body_bytes)")
        parts.append(chunk)
    body = b"".join(parts)
    request._body = body  # starlette's cache: request.body() / json() read it later
    return body


async def learn_max_model_len(limits: RequestLimits, client: Any, urls: Any,
                              interval_s: float = 5.0) -> None:
    """With ``max_prompt_tokens="auto"``: asks every worker's ``GET /v1/models`` (vLLM
    reports ``max_model_len`` per model) until one answers with it, every ``interval_s``
    seconds; ``urls()`` gives the current worker base URLs. Returns once learnt."""
    import asyncio

    while limits.auto and limits.max_prompt_tokens is None:
        for url in list(urls()):
            try:
                r = await client.get(url + "/v1/models", timeout=5.0)
                data = r.json().get("data") if r.status_code == 200 else None
            except Exception:  # noqa: BLE001 - any failure: try the next worker
                continue
            if isinstance(data, list):
                limits.learn_max_model_len(m.get("max_model_len") for m in data
                                           if isinstance(m, dict))
            if limits.max_prompt_tokens is not None:
                return
        await asyncio.sleep(interval_s)
