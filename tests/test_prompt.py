"""kvroute.prompt: request bodies to the token ids a vLLM engine prefills, with the real
Qwen3 tokenizer and chat template from ../shared/data."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from _util import require

require("tokenizers")

from kvroute.prompt import (  # noqa: E402
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    PromptTokenizer,
    UnsupportedPrompt,
    chat_template_content_format,
    render_chat_template,
)
from kvroute.replay.traces import render_chat_template as traces_render  # noqa: E402

# Qwen3 ids, checked by hand against tokenizer.json's vocab / added_tokens.
IM_START, IM_END, NL, NLNL = 151644, 151645, 198, 271
SYSTEM, USER, ASSISTANT = 8948, 872, 77091
THINK, END_THINK = 151667, 151668
HI = 13048
YOU_ARE_TERSE = [2610, 525, 50537, 13]  # "You are terse."

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def tok(qwen3):
    t = PromptTokenizer.from_dir(qwen3)
    yield t
    t.close()


@pytest.fixture(scope="module")
def raw(qwen3_tokenizer):
    return qwen3_tokenizer


def test_short_chat_matches_the_hand_checked_chatml_tokens(tok):
    ids = tok.encode_chat(CHAT)
    assert ids.dtype == np.uint32 and ids.ndim == 1
    assert ids.tolist() == ([IM_START, SYSTEM, NL, *YOU_ARE_TERSE, IM_END, NL,
                             IM_START, USER, NL, HI, IM_END, NL,
                             IM_START, ASSISTANT, NL])
    # add_generation_prompt=False ends after the user's turn; special tokens are not added
    # twice (chat prompts are encoded with add_special_tokens=False).
    assert tok.encode_chat(CHAT, add_generation_prompt=False).tolist()[-3:] == [HI, IM_END, NL]
    assert tok.content_format == "string"


def test_request_paths_and_the_chat_body_fields(tok):
    body = {"model": "m", "messages": CHAT, "max_tokens": 8}
    np.testing.assert_array_equal(tok.encode_request(CHAT_COMPLETIONS_PATH, body),
                                  tok.encode_chat(CHAT))
    np.testing.assert_array_equal(tok.encode_request(CHAT_COMPLETIONS_PATH + "/?x=1", body),
                                  tok.encode_chat(CHAT))
    no_gen = tok.encode_request(CHAT_COMPLETIONS_PATH, {**body, "add_generation_prompt": False})
    assert no_gen.tolist() == tok.encode_chat(CHAT, add_generation_prompt=False).tolist()
    with pytest.raises(ValueError, match="expected '/v1/completions' or '/v1/chat/completions'"):
        tok.encode_request("/v1/embeddings", body)
    with pytest.raises(ValueError, match="JSON object"):
        tok.encode_request(CHAT_COMPLETIONS_PATH, [CHAT])
    with pytest.raises(ValueError, match="needs 'messages'"):
        tok.encode_request(CHAT_COMPLETIONS_PATH, {"model": "m"})
    with pytest.raises(ValueError, match="add_generation_prompt must be true or false"):
        tok.encode_request(CHAT_COMPLETIONS_PATH, {**body, "add_generation_prompt": "yes"})
    with pytest.raises(UnsupportedPrompt, match="chat_template"):
        tok.encode_request(CHAT_COMPLETIONS_PATH, {**body, "chat_template": "{{ 1 }}"})


def test_tools_render_as_vllm_model_dump(tok):
    text = tok.render_chat(CHAT, tools=[WEATHER])
    # vLLM hands the template ChatCompletionToolsParam.model_dump(): declared fields in order,
    # a missing description as null.
    line = ('{"type": "function", "function": {"name": "get_weather", "description": null, '
            '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
            '"required": ["city"]}}}')
    assert f"<tools>\n{line}\n</tools>" in text
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    via_body = tok.encode_request(CHAT_COMPLETIONS_PATH, {"messages": CHAT, "tools": [WEATHER]})
    np.testing.assert_array_equal(via_body, tok.encode_chat(CHAT, tools=[WEATHER]))
    assert len(via_body) > len(tok.encode_chat(CHAT)) + 50
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        tok.encode_chat(CHAT, tools=[{"type": "function", "function": {"description": "x"}}])
    with pytest.raises(ValueError, match=r"tools\[0\].type must be 'function'"):
        tok.encode_chat(CHAT, tools=[{**WEATHER, "type": "custom"}])


def test_tool_call_turns_render_arguments_as_objects(tok):
    msgs = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    text = tok.render_chat(msgs, tools=[WEATHER])
    # The JSON-string arguments were parsed (vLLM's _postprocess_messages) and re-dumped by
    # the template's tojson, so the spacing is json.dumps's, not the client's.
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'  # untouched


def test_chat_template_kwargs_change_the_prompt_as_vllm_passes_them(tok):
    plain = tok.encode_chat(CHAT)
    nothink = tok.encode_chat(CHAT, chat_template_kwargs={"enable_thinking": False})
    assert nothink.tolist() == plain.tolist() + [THINK, NLNL, END_THINK, NLNL]
    body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    assert tok.encode_request(CHAT_COMPLETIONS_PATH, body).tolist() == nothink.tolist()
    # Keys the template does not read are dropped, as vLLM does; apply_chat_template's own
    # parameters may be overridden from chat_template_kwargs.
    assert tok.encode_chat(CHAT, chat_template_kwargs={"unused": 1}).tolist() == plain.tolist()
    overridden = tok.encode_chat(CHAT, chat_template_kwargs={"add_generation_prompt": False})
    assert overridden.tolist() == tok.encode_chat(CHAT, add_generation_prompt=False).tolist()
    for key in ("tokenize", "chat_template", "messages"):
        with pytest.raises(ValueError, match=f"may not set \\['{key}'\\]"):
            tok.encode_chat(CHAT, chat_template_kwargs={key: True})
    with pytest.raises(ValueError, match="chat_template_kwargs must be an object"):
        tok.encode_chat(CHAT, chat_template_kwargs=["enable_thinking"])


def test_engine_default_chat_template_kwargs(tok, raw):
    with PromptTokenizer(raw, tok.config,
                         default_chat_template_kwargs={"enable_thinking": False}) as t:
        assert t.encode_chat(CHAT).tolist()[-4:] == [THINK, NLNL, END_THINK, NLNL]
        # the request overrides the engine default
        on = t.encode_chat(CHAT, chat_template_kwargs={"enable_thinking": True})
        assert on.tolist()[-3:] == [IM_START, ASSISTANT, NL]


def test_text_parts_are_flattened_for_a_string_content_template(tok):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": ""},
             {"type": "text", "text": "second"}]
    flat = tok.render_chat([{"role": "user", "content": parts}])
    # vLLM joins the text parts with "\n" (dropping empty ones) for string-content templates.
    assert flat == tok.render_chat([{"role": "user", "content": "first\nsecond"}])
    with pytest.raises(UnsupportedPrompt, match="'image_url'"):
        tok.encode_chat([{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\] needs a 'type'"):
        tok.encode_chat([{"role": "user", "content": [{"text": "x"}]}])


def test_content_format_detection_and_openai_parts():
    loops = ("{% for m in messages %}{{ m.role }}:{% for p in m['content'] %}[{{ p.text }}]"
             "{% endfor %}\n{% endfor %}")
    aliased = ("{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content | list %}"
               "{{ p.text }}{% endfor %}{% endfor %}")
    assert chat_template_content_format(loops) == "openai"
    assert chat_template_content_format(aliased) == "openai"
    assert chat_template_content_format("{% for m in messages %}{{ m.content }}{% endfor %}") \
        == "string"
    assert chat_template_content_format("{% for x in y %}{% for p in x.content %}{% endfor %}"
                                        "{% endfor %}") == "string"  # not from messages


def test_openai_content_format_template_gets_parts(raw):
    loops = ("{% for m in messages %}{{ m.role }}:{% for p in m['content'] %}[{{ p.text }}]"
             "{% endfor %}|{% endfor %}")
    with PromptTokenizer(raw, {"chat_template": loops}) as t:
        assert t.content_format == "openai"
        text = t.render_chat([{"role": "user", "content": "a"},
                              {"role": "user", "content": [{"type": "text", "text": "b"},
                                                           {"type": "text", "text": "c"}]}])
        assert text == "user:[a]|user:[b][c]|"


def test_named_templates_use_tool_use_for_requests_with_tools(raw):
    cfg = {"chat_template": [{"name": "default", "template": "plain:{{ messages[0].content }}"},
                             {"name": "tool_use", "template":
                              "tools:{{ tools | length }}:{{ messages[0].content }}"}]}
    with PromptTokenizer(raw, cfg) as t:
        msgs = [{"role": "user", "content": "x"}]
        assert t.render_chat(msgs) == "plain:x"
        assert t.render_chat(msgs, tools=[WEATHER]) == "tools:1:x"


def test_continue_final_message(tok):
    msgs = [{"role": "user", "content": "Say a number."},
            {"role": "assistant", "content": "The number is"}]
    text = tok.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe number is")
    ids = tok.encode_request(CHAT_COMPLETIONS_PATH, {"messages": msgs, "add_generation_prompt":
                                                     False, "continue_final_message": True})
    assert ids[-1] != IM_END
    with pytest.raises(ValueError, match="Cannot set both"):
        tok.encode_chat(msgs, continue_final_message=True)


def test_template_errors_and_malformed_messages_are_value_errors(tok, raw, tmp_path):
    cfg = {"chat_template": "{{ raise_exception('roles must alternate') }}"}
    with PromptTokenizer(raw, cfg) as t:
        with pytest.raises(ValueError, match="chat template rejected the messages: roles must"):
            t.encode_chat(CHAT)
    with PromptTokenizer(raw) as t:
        with pytest.raises(ValueError, match="no chat_template"):
            t.encode_chat(CHAT)
    with pytest.raises(ValueError, match="does not compile"):
        PromptTokenizer(raw, {"chat_template": "{% for m in messages %}"})
    with pytest.raises(ValueError, match="cannot load tokenizer.json"):
        PromptTokenizer(tmp_path / "missing.json")
    (tmp_path / "cfg.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        PromptTokenizer(raw, tmp_path / "cfg.json")
    for bad, match in [([], "non-empty list"), ("hi", "non-empty list"),
                       ([{"content": "x"}], r"messages\[0\] needs a string 'role'"),
                       (["x"], r"messages\[0\] must be a dict"),
                       ([{"role": "user", "content": 3}], r"messages\[0\].content must be")]:
        with pytest.raises(ValueError, match=match):
            tok.encode_chat(bad)


def test_completions_prompts(tok, raw):
    text = "The capital of France is"
    ids = tok.encode_request(COMPLETIONS_PATH, {"prompt": text})
    assert ids.tolist() == raw.encode(text, add_special_tokens=True).ids
    # A one-element list is that prompt; token ids pass through unchanged.
    assert tok.encode_request(COMPLETIONS_PATH, {"prompt": [text]}).tolist() == ids.tolist()
    given = [151644, 0, 5, 2**32 - 1]
    out = tok.encode_request(COMPLETIONS_PATH, {"prompt": given})
    assert out.dtype == np.uint32 and out.tolist() == given
    assert tok.encode_request(COMPLETIONS_PATH, {"prompt": [given]}).tolist() == given
    np.testing.assert_array_equal(tok.encode_prompt(np.array(given, dtype=np.int64)), given)


def test_special_tokens_and_truncation_follow_the_request_fields(qwen3, tok, raw):
    """With a tokenizer whose post-processor adds a BOS (as Llama's does), completions add it
    by default, chat prompts do not, and left truncation keeps it."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    bos = 151643  # <|endoftext|> standing in for a BOS token
    with_bos = Tokenizer.from_file(str(qwen3 / "tokenizer.json"))
    with_bos.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                 special_tokens=[("<|endoftext|>", bos)])
    text = "The capital of France is Paris"
    plain = raw.encode(text, add_special_tokens=False).ids
    with PromptTokenizer(with_bos, tok.config) as t:
        assert t.encode_request(COMPLETIONS_PATH, {"prompt": text}).tolist() == [bos, *plain]
        assert t.encode_request(COMPLETIONS_PATH, {"prompt": text, "add_special_tokens": False}
                                ).tolist() == plain
        assert t.encode_request(COMPLETIONS_PATH, {"prompt": text, "truncate_prompt_tokens": 3}
                                ).tolist() == [bos, *plain[-2:]]
        chat = tok.encode_chat(CHAT).tolist()
        assert t.encode_request(CHAT_COMPLETIONS_PATH, {"messages": CHAT}).tolist() == chat
        assert t.encode_request(CHAT_COMPLETIONS_PATH, {"messages": CHAT, "add_special_tokens":
                                                        True}).tolist() == [bos, *chat]
        assert t.encode_request(CHAT_COMPLETIONS_PATH, {"messages": CHAT,
                                                        "truncate_prompt_tokens": 5}
                                ).tolist() == chat[-5:]
    assert tok.encode_request(COMPLETIONS_PATH, {"prompt": [5, 6, 7, 8],
                                                 "truncate_prompt_tokens": 2}).tolist() == [7, 8]
    assert tok.encode_request(COMPLETIONS_PATH, {"prompt": text, "truncate_prompt_tokens": -1}
                              ).tolist() == plain
    for bad in (0, -2, True, "3"):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be a positive int"):
            tok.encode_request(COMPLETIONS_PATH, {"prompt": text, "truncate_prompt_tokens": bad})


@pytest.mark.parametrize("prompt,exc,match", [
    ([1, -1], ValueError, r"\[0, 2\*\*32\), got one = -1"),
    ([1, 2**32], ValueError, r"got one = 4294967296"),
    ([1, 2**70], ValueError, r"beyond 2\*\*63"),
    ([1, 2.5], ValueError, r"got 2.5 \(float\)"),
    ([1, True], ValueError, r"got True \(bool\)"),
    ([], ValueError, "prompt is empty"),
    ({"text": "x"}, ValueError, "string or a list of token ids, got dict"),
    (None, ValueError, "needs 'prompt'"),
    (["a", "b"], UnsupportedPrompt, "batched prompts are not routed: send one prompt per request"),
    ([[1, 2], [3]], UnsupportedPrompt, "batched prompts are not routed"),
])
def test_bad_completions_prompts_are_rejected(tok, prompt, exc, match):
    with pytest.raises(exc, match=match):
        tok.encode_request(COMPLETIONS_PATH, {"prompt": prompt})


def test_prompt_embeds_are_unsupported(tok):
    with pytest.raises(UnsupportedPrompt, match="prompt_embeds"):
        tok.encode_request(COMPLETIONS_PATH, {"prompt_embeds": "AAAA"})


def test_traces_reexport_is_the_same_renderer(qwen3_chat_config):
    cfg = qwen3_chat_config
    assert traces_render is render_chat_template
    assert render_chat_template(CHAT, cfg, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def long_chat(raw, n_tokens: int, qs: list) -> list:
    """A multi-turn chat of about n_tokens Qwen3 tokens from the MT-Bench questions ``qs``."""
    msgs, total, i = [{"role": "system", "content": "You are a helpful assistant."}], 0, 0
    while total < n_tokens:
        q = qs[i % len(qs)]
        for turn in q["turns"]:
            answer = f"Answer {i}: " + " ".join(reversed(turn.split()))
            msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
            total += len(raw.encode(turn + answer, add_special_tokens=False).ids) + 10
        i += 1
    msgs.append({"role": "user", "content": "Summarise the conversation."})
    return msgs


def test_event_loop_keeps_running_during_a_32k_token_tokenization(tok, raw, mt_bench_questions,
                                                                  monkeypatch):
    body = {"messages": long_chat(raw, 32_000, mt_bench_questions)}
    spans = []
    native = tok._encode_batch

    def spy(texts, **kw):  # times the native encode call on the pool thread
        t0 = time.perf_counter()
        out = native(texts, **kw)
        spans.append((t0, time.perf_counter()))
        return out

    monkeypatch.setattr(tok, "_encode_batch", spy)

    async def main():
        ticks, stop = [], asyncio.Event()

        async def ticker():
            while not stop.is_set():
                await asyncio.sleep(0.001)
                ticks.append(time.perf_counter())

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        start = time.perf_counter()
        ids = await tok.aencode_request(CHAT_COMPLETIONS_PATH, body)
        stop.set()
        await t
        return ids, [x for x in ticks if x >= start]

    ids, ticks = asyncio.run(main())
    assert 32_000 <= len(ids) <= 40_000
    np.testing.assert_array_equal(ids, tok.encode_request(CHAT_COMPLETIONS_PATH, body))
    # The loop ran *while* the native encoding ran on the pool thread: it releases the GIL
    # (Tokenizer.encode would not: no tick could land inside it). One tick inside is the
    # proof; the bounds are loose for a loaded 2-core machine. The longest call is the
    # conversation's bulk (the prefix cache encodes the first message on its own).
    enc_start, enc_end = max(spans, key=lambda s: s[1] - s[0])
    assert sum(enc_start < x < enc_end for x in ticks) >= 1
    gaps = np.diff(ticks)
    assert gaps.max() < 2.0


def test_template_type_errors_are_bad_requests_not_crashes(raw):
    # A template expression that fails on a request value of the wrong type (here a
    # chat_template_kwargs string added to a number) is the request's fault: ValueError
    # (400 in the proxy), not a TypeError (500).
    cfg = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"
                            "{{ budget + 1 }}/{{ items | length }}"}
    t = PromptTokenizer(raw, cfg, inline_chars=0)
    msgs = [{"role": "user", "content": "hi"}]
    try:
        assert t.render_chat(msgs, chat_template_kwargs={"budget": 1, "items": [1, 2]}
                             ) == "hi2/2"
        for kwargs in ({"budget": "ten", "items": []},  # str + int
                       {"budget": 1, "items": 3}):  # len() of an int
            with pytest.raises(ValueError, match="chat template failed"):
                t.encode_chat(msgs, chat_template_kwargs=kwargs)
            with pytest.raises(ValueError, match="chat template failed"):
                asyncio.run(t.aencode_request(CHAT_COMPLETIONS_PATH,
                                              {"messages": msgs, "chat_template_kwargs": kwargs}))
    finally:
        t.close()


def test_short_requests_are_encoded_inline_and_long_ones_on_the_pool(qwen3):
    import asyncio
    import threading

    t = PromptTokenizer.from_dir(qwen3)
    seen = []
    real = t.encode_request

    def spy(path, body):
        seen.append(threading.current_thread() is threading.main_thread())
        return real(path, body)

    t.encode_request = spy
    short = {"messages": [{"role": "user", "content": "hi " * 100}]}
    long = {"prompt": "hello " * 1000}
    got_short = asyncio.run(t.aencode_request("/v1/chat/completions", short))
    got_long = asyncio.run(t.aencode_request("/v1/completions", long))
    assert seen == [True, False]  # inline on the event loop's thread, then the pool
    assert np.array_equal(got_short, real("/v1/chat/completions", short))
    assert np.array_equal(got_long, real("/v1/completions", long))

    # Long text hidden in a list prompt (nested too), and chats whose cost is not in their
    # contents' length: the pool as well. A short list prompt or token ids: inline.
    seen.clear()
    tool_call = {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}
    pool = [("/v1/completions", {"prompt": ["hello " * 1000]}),
            ("/v1/completions", {"prompt": [["hello " * 1000]]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "hello " * 1000}]}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "documents": [{"title": "t", "text": "d"}]}),
            ("/v1/chat/completions", {"messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 65}),
            ("/v1/chat/completions", {"messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok", "reasoning": "hmm " * 1000},
                {"role": "user", "content": "and?"}]})]
    inline = [("/v1/completions", {"prompt": ["hello " * 10]}),
              ("/v1/completions", {"prompt": list(range(1000))})]
    for path, body in pool + inline:
        assert np.array_equal(asyncio.run(t.aencode_request(path, body)), real(path, body))
    assert seen == [False] * len(pool) + [True] * len(inline)
    with pytest.raises(ValueError, match="inline_chars"):
        PromptTokenizer.from_dir(qwen3, inline_chars=-1)
    t.close()
