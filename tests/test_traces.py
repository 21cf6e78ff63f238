"""Replay traces: Mooncake expansion and cache bound, synthetic chats, MT-Bench templating."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from _util import require

from kvroute.replay.traces import (
    MOONCAKE_FILE,
    QWEN3_REGULAR_VOCAB,
    Request,
    Trace,
    default_data_dir,
    load_mooncake,
    load_mt_bench,
    load_trace,
    mooncake_block_tokens,
    render_chat_template,
    synthetic_conversations,
)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------ Mooncake


def test_block_expansion_is_deterministic_and_shares_equal_ids():
    a = mooncake_block_tokens([7, 8, 9], 1300)
    b = mooncake_block_tokens([7, 8, 10], 1100)
    c = mooncake_block_tokens([11, 8, 9], 1300)
    assert a.dtype == np.uint32 and a.ndim == 1
    assert len(a) == 1300 and len(b) == 1100  # input_length respected, last block partial
    assert np.array_equal(a, mooncake_block_tokens([7, 8, 9], 1300))  # deterministic
    assert np.array_equal(a[:1024], b[:1024])  # same ids 7, 8 -> same 1024 tokens
    assert common_prefix(a, b) < 1024 + 8  # ids 9 and 10 differ right away
    assert common_prefix(a, c) < 8  # different first id -> different from the first token
    # Block content depends only on the id, not on the position in the request.
    assert np.array_equal(c[512:1024], a[512:1024])
    # A partial block is the head of the full block with the same id.
    assert np.array_equal(mooncake_block_tokens([7, 9], 600)[512:], a[1024:1112])
    assert int(a.max()) < QWEN3_REGULAR_VOCAB
    # Pseudo-tokens look random: many distinct values per block.
    assert len(np.unique(a[:512])) > 480
    with pytest.raises(ValueError):
        mooncake_block_tokens([1, 2], 1025)  # needs 3 blocks
    with pytest.raises(ValueError):
        mooncake_block_tokens([1, 2, 3], 1024)  # last block empty


def test_load_mooncake_small_file(tmp_path):
    rows = [
        {"timestamp": 1500, "input_length": 1536, "output_length": 7, "hash_ids": [1, 2, 3]},
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 4]},
        {"timestamp": 2500, "input_length": 1024, "output_length": 9, "hash_ids": [5, 2]},
    ]
    path = write_jsonl(tmp_path / "small.jsonl", rows)
    tr = load_mooncake(path)
    assert tr.name == "small" and not tr.synthetic and len(tr) == 3
    assert [r.arrival_s for r in tr.requests] == [0.0, 1.5, 2.5]  # ms -> s, sorted
    assert [r.request_id for r in tr.requests] == [0, 1, 2]
    assert [r.output_length for r in tr.requests] == [5, 7, 9]
    assert [r.prompt_length for r in tr.requests] == [1100, 1536, 1024]
    assert all(r.session == "" for r in tr.requests)
    r0, r1, r2 = tr.requests
    assert common_prefix(r0.tokens, r1.tokens) >= 1024
    assert not r0.tokens.flags.writeable
    assert [r.request_id for r in load_mooncake(path, limit=2).requests] == [0, 1]
    assert len(load_trace(str(path), limit=1)) == 1

    # Infinite cache: r1 hits ids 1, 2 (1024 tokens); r2's block "2" follows a different
    # first block, so the chained prefix does not hit. r0's trailing 76 tokens are partial.
    total = 1100 + 1536 + 1024
    for bs in (512, 256, 16):
        assert tr.infinite_cache_hit_rate(bs) == pytest.approx(1024 / total)
    # Even at 4 tokens a block nothing more hits: blocks 3 and 4 differ from their first token.
    assert tr.infinite_cache_hit_rate(4) == pytest.approx(1024 / total)


def test_infinite_cache_hit_rate_chaining_and_partial_blocks():
    toks = np.arange(100, dtype=np.uint32)
    reqs = [
        Request(0, 0.0, toks[:40], 1),
        Request(1, 1.0, toks[:40], 1),  # repeats all 40: 4 full blocks of 10 hit
        Request(2, 2.0, toks[:35], 1),  # 3 full blocks hit, 5-token tail never hits
        Request(3, 3.0, np.concatenate([toks[10:20], toks[10:40]]), 1),  # wrong first block
        Request(4, 4.0, np.concatenate([toks[:20], toks[50:70]]), 1),  # 2 blocks, then new
    ]
    tr = Trace("t", reqs, synthetic=True, description="")
    total = 40 + 40 + 35 + 40 + 40
    assert tr.infinite_cache_hit_rate(10) == pytest.approx((40 + 30 + 0 + 20) / total)
    assert Trace("e", [], True, "").infinite_cache_hit_rate(16) == 0.0
    with pytest.raises(ValueError):
        tr.infinite_cache_hit_rate(0)


@pytest.fixture(scope="module")
def mooncake(shared_data):
    t0 = time.perf_counter()
    tr = load_mooncake(shared_data / MOONCAKE_FILE)
    return tr, time.perf_counter() - t0


@pytest.mark.slow
def test_full_mooncake_trace_loads_fast_and_matches_readme(mooncake, shared_data):
    tr, seconds = mooncake
    assert seconds < 20, f"loading took {seconds:.1f} s"
    assert len(tr) == 12_031
    assert tr.total_prompt_tokens / len(tr) == pytest.approx(12_035, abs=1)
    assert 58 * 60 < tr.duration_s < 60 * 60
    rows = [json.loads(line) for line in (shared_data / MOONCAKE_FILE).open()][:50]
    for r, row in zip(tr.requests, rows):  # file is in timestamp order
        assert r.prompt_length == row["input_length"]
        assert r.output_length == row["output_length"]
        assert r.arrival_s == row["timestamp"] / 1000
    # The first requests all start with hash id 0: they share their first 512 tokens.
    a, b = tr.requests[0].tokens, tr.requests[1].tokens
    assert rows[0]["hash_ids"][0] == rows[1]["hash_ids"][0]
    assert rows[0]["hash_ids"][1] != rows[1]["hash_ids"][1]
    assert 512 <= common_prefix(a, b) < 520


@pytest.mark.slow
def test_full_mooncake_infinite_cache_bound(mooncake):
    tr, _ = mooncake
    t0 = time.perf_counter()
    rate = tr.infinite_cache_hit_rate(512)
    assert time.perf_counter() - t0 < 30
    assert 0.33 <= rate <= 0.41  # README: ~37 % of input tokens
    # A smaller block size dividing 512 keeps the sharing structure (and can only add the
    # heads of shared partial blocks); checked on a slice to keep the test quick.
    part = tr.limit(2000)
    assert part.infinite_cache_hit_rate(32) == pytest.approx(
        part.infinite_cache_hit_rate(512), abs=0.005
    )


def test_load_trace_mooncake_by_name(shared_data):
    tr = load_trace("mooncake", shared_data, limit=10)
    assert len(tr) == 10 and tr.name == Path(MOONCAKE_FILE).stem


# ------------------------------------------------------------------------------ synthetic


def test_synthetic_is_deterministic():
    a = synthetic_conversations(n_conversations=30, seed=3)
    b = synthetic_conversations(n_conversations=30, seed=3)
    c = synthetic_conversations(n_conversations=30, seed=4)
    assert len(a) == len(b)
    for x, y in zip(a.requests, b.requests):
        assert np.array_equal(x.tokens, y.tokens)
        assert (x.arrival_s, x.output_length, x.session) == (y.arrival_s, y.output_length,
                                                             y.session)
    assert any(
        len(x.tokens) != len(y.tokens) or not np.array_equal(x.tokens, y.tokens)
        for x, y in zip(a.requests, c.requests)
    )


def test_synthetic_turns_extend_previous_turn_exactly():
    tr = synthetic_conversations(n_conversations=40, seed=1)
    assert tr.synthetic and tr.name == "synthetic-conversations"
    assert "synthetic" in tr.description.lower()
    arrivals = [r.arrival_s for r in tr.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert [r.request_id for r in tr.requests] == list(range(len(tr)))
    by_session = defaultdict(list)
    for r in tr.requests:
        by_session[r.session].append(r)
    assert len(by_session) == 40
    systems = set()
    for turns in by_session.values():
        assert 2 <= len(turns) <= 6
        systems.add(turns[0].tokens[:500].tobytes())
        for prev, nxt in zip(turns, turns[1:]):
            assert 2 <= nxt.arrival_s - prev.arrival_s <= 20
            assert 50 <= prev.output_length <= 400
            # next prompt = prev prompt + prev output (output_length tokens) + user message
            assert np.array_equal(nxt.tokens[: prev.prompt_length], prev.tokens)
            user_len = nxt.prompt_length - prev.prompt_length - prev.output_length
            assert 50 <= user_len <= 400
    assert len(systems) <= 4  # conversations share a few system prompts


def test_synthetic_default_size_is_replayable():
    tr = synthetic_conversations()
    assert 600 <= len(tr) <= 900
    assert max(r.prompt_length for r in tr.requests) <= 8192
    assert int(max(r.tokens.max() for r in tr.requests)) < QWEN3_REGULAR_VOCAB
    assert len(load_trace(None)) == len(tr)
    assert len(load_trace("synthetic", n_conversations=5, limit=3)) == 3


def test_limit_and_scaled():
    tr = synthetic_conversations(n_conversations=10, seed=2)
    assert len(tr.limit(None)) == len(tr) and len(tr.limit(4)) == 4
    assert tr.limit(4).requests == tr.requests[:4]
    fast = tr.scaled(4.0)
    assert [r.arrival_s for r in fast.requests] == [r.arrival_s / 4.0 for r in tr.requests]
    assert fast.requests[-1].tokens is tr.requests[-1].tokens
    with pytest.raises(ValueError):
        tr.scaled(0)


def test_default_data_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVROUTE_SHARED_DATA", str(tmp_path))
    assert default_data_dir() == tmp_path
    monkeypatch.delenv("KVROUTE_SHARED_DATA")
    with pytest.raises(FileNotFoundError, match="KVROUTE_SHARED_DATA"):
        default_data_dir()
    with pytest.raises(FileNotFoundError):
        load_trace(str(tmp_path / "missing.jsonl"))


# ------------------------------------------------------------------------------ MT-Bench


@pytest.fixture(scope="module")
def tok_and_config(qwen3_tokenizer, qwen3_chat_config):
    require("jinja2")
    return qwen3_tokenizer, qwen3_chat_config


@pytest.fixture(scope="module")
def mt_bench(shared_data, tok_and_config):
    return load_mt_bench(shared_data)


def by_session(tr: Trace) -> dict:
    out = defaultdict(list)
    for r in tr.requests:
        out[r.session].append(r)
    return out


@pytest.mark.slow
def test_mt_bench_shape(mt_bench, shared_data, mt_bench_questions):
    questions = mt_bench_questions
    assert len(questions) == 80
    assert len(mt_bench) == 160 and not mt_bench.synthetic and mt_bench.name == "mt-bench"
    sessions = by_session(mt_bench)
    assert set(sessions) == {f"mtbench-{q['question_id']}" for q in questions}
    for turns in sessions.values():
        assert len(turns) == 2
        assert 0 < turns[1].arrival_s - turns[0].arrival_s <= 10
        assert all(r.output_length == 256 for r in turns)
    assert len(load_trace("mt_bench", shared_data, limit=5)) == 5


@pytest.mark.slow
def test_mt_bench_tokens_decode_to_templated_question(mt_bench, tok_and_config,
                                                      mt_bench_questions):
    tok, _ = tok_and_config
    questions = {f"mtbench-{q['question_id']}": q for q in mt_bench_questions}
    for session, (t1, t2) in by_session(mt_bench).items():
        q = questions[session]
        text1 = tok.decode(t1.tokens.tolist(), skip_special_tokens=False)
        text2 = tok.decode(t2.tokens.tolist(), skip_special_tokens=False)
        assert text1 == f"<|im_start|>user\n{q['turns'][0]}<|im_end|>\n<|im_start|>assistant\n"
        assert q["turns"][0] in text2 and q["turns"][1] in text2
        assert "Stand-in answer" in text2
        assert text2.endswith(f"<|im_start|>user\n{q['turns'][1]}<|im_end|>\n"
                              "<|im_start|>assistant\n")
    # Special tokens are single ids (the template's text was not split into pieces).
    im_start = tok.token_to_id("<|im_start|>")
    assert all(int(r.tokens[0]) == im_start for r in mt_bench.requests)


@pytest.mark.slow
def test_mt_bench_turn2_shares_turn1_prefix(mt_bench, shared_data):
    fractions = []
    for t1, t2 in by_session(mt_bench).values():
        fractions.append(common_prefix(t1.tokens, t2.tokens) / t1.prompt_length)
    fractions = np.array(fractions)
    assert np.mean(fractions >= 0.9) >= 0.9
    # Measured: with the stand-in answer (no <think> block) turn 1's whole prompt is a
    # prefix of turn 2's for every question.
    assert fractions.min() == 1.0

    # With enable_thinking=False, turn 1 ends in an empty think block that the template
    # drops from earlier assistant turns: turn 2 shares all but those last 4 tokens.
    nothink = load_mt_bench(shared_data, chat_template_kwargs={"enable_thinking": False})
    for t1, t2 in by_session(nothink).values():
        assert common_prefix(t1.tokens, t2.tokens) == t1.prompt_length - 4


def test_render_chat_template_helpers(tok_and_config):
    import jinja2

    _, config = tok_and_config
    msgs = [{"role": "user", "content": "Hi"}]
    text = render_chat_template(msgs, config)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat_template(msgs, config, add_generation_prompt=False).endswith("<|im_end|>\n")
    bad = {**config, "chat_template": "{{ raise_exception('no ' + eos_token) }}"}
    with pytest.raises(jinja2.exceptions.TemplateError, match="no <\\|im_end\\|>"):
        render_chat_template(msgs, bad)


# ------------------------------------------------------------------------------ trace files


def test_tokens_jsonl_loads_sorts_and_shifts(tmp_path):
    from kvroute.replay.traces import load_jsonl

    p = write_jsonl(tmp_path / "tok.jsonl", [
        {"timestamp": 1000.5, "prompt_token_ids": [5, 6, 7, 8], "output_length": 3,
         "session_id": "a"},
        {"timestamp": 1000.0, "prompt_token_ids": [5, 6], "user": "u1"},
        {"timestamp": 1002.0, "prompt_token_ids": [9]},
    ])
    tr = load_jsonl(p)
    assert [r.arrival_s for r in tr.requests] == [0.0, 0.5, 2.0]
    assert [r.tokens.tolist() for r in tr.requests] == [[5, 6], [5, 6, 7, 8], [9]]
    assert [r.session for r in tr.requests] == ["u1", "a", ""]
    assert [r.output_length for r in tr.requests] == [256, 3, 256]
    assert [r.request_id for r in tr.requests] == [0, 1, 2]
    assert len(load_jsonl(p, limit=2)) == 2
    assert load_trace(str(p), format="tokens").requests[1].prompt_length == 4


@pytest.mark.parametrize("row,msg", [
    ({"timestamp": "x", "prompt_token_ids": [1]}, "timestamp"),
    ({"timestamp": 0, "prompt_token_ids": [1, -2]}, "prompt_token_ids"),
    ({"timestamp": 0, "prompt_token_ids": [1], "output_length": -1}, "output_length"),
])
def test_tokens_jsonl_errors_name_the_line(tmp_path, row, msg):
    from kvroute.replay.traces import load_jsonl

    p = write_jsonl(tmp_path / "t.jsonl", [{"timestamp": 0, "prompt_token_ids": [1]}, row])
    with pytest.raises(ValueError, match=rf"t\.jsonl:2: .*{msg}"):
        load_jsonl(p)


def test_format_detection(tmp_path):
    from kvroute.replay.traces import detect_format, load_jsonl

    assert detect_format({"hash_ids": []}) == "mooncake"
    assert detect_format({"prompt_token_ids": []}) == "tokens"
    assert detect_format({"body": {}}) == "openai"
    p = write_jsonl(tmp_path / "x.jsonl", [{"timestamp": 0, "foo": 1}])
    with pytest.raises(ValueError, match=r"x\.jsonl:1: cannot tell the trace format"):
        load_jsonl(p)
    with pytest.raises(ValueError, match="unknown trace format"):
        load_jsonl(p, format="csv")
    mc = write_jsonl(tmp_path / "m.jsonl", [
        {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}])
    assert load_jsonl(mc).requests[0].prompt_length == 600
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    assert len(load_jsonl(empty)) == 0


def test_openai_log_is_tokenized_as_the_proxy_does(tmp_path, qwen3, tok_and_config):
    """Chat and completions bodies give the token ids `PromptTokenizer.encode_request` gives,
    and a conversation's second turn extends its first turn's prompt."""
    from kvroute.prompt import PromptTokenizer
    from kvroute.replay.traces import load_jsonl

    turn1 = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "Name a prime number."}]
    turn2 = turn1 + [{"role": "assistant", "content": "Seven."},
                     {"role": "user", "content": "And an even one?"}]
    rows = [
        {"timestamp": 50.0, "path": "/v1/chat/completions", "session_id": "c1",
         "body": {"model": "m", "messages": turn1, "max_tokens": 16}},
        {"timestamp": 53.0, "body": {"model": "m", "messages": turn2, "user": "alice"},
         "session_id": "c1"},
        {"timestamp": 51.0, "path": "/v1/completions",
         "body": {"model": "m", "prompt": "Once upon a time", "max_completion_tokens": 8},
         "user": "bob"},
    ]
    p = write_jsonl(tmp_path / "log.jsonl", rows)
    tr = load_jsonl(p, tokenizer_dir=qwen3)
    assert tr.name == "log" and not tr.synthetic
    assert [r.arrival_s for r in tr.requests] == [0.0, 1.0, 3.0]
    with PromptTokenizer.from_dir(qwen3) as tok:
        want = [tok.encode_request(r.get("path", "/v1/chat/completions"), r["body"])
                for r in (rows[0], rows[2], rows[1])]
    for r, w in zip(tr.requests, want):
        assert r.tokens.tolist() == w.tolist()
    assert [r.session for r in tr.requests] == ["c1", "bob", "c1"]
    assert [r.output_length for r in tr.requests] == [16, 8, 256]
    t1, t2 = tr.requests[0].tokens, tr.requests[2].tokens
    assert common_prefix(t1, t2) >= len(t1) - 4  # Qwen3 drops an empty <think> block
    # auto-detected through load_trace, with the shared data's tokenizer by default
    assert len(load_trace(str(p), data_dir=qwen3.parent.parent)) == 3


def test_openai_log_errors_name_the_line(tmp_path, qwen3, tok_and_config):
    from kvroute.replay.traces import load_openai_jsonl

    p = write_jsonl(tmp_path / "log.jsonl", [
        {"timestamp": 0, "body": {"messages": [{"role": "user", "content": "hi"}]}},
        {"timestamp": 1, "body": {"model": "m"}},
    ])
    with pytest.raises(ValueError, match=r"log\.jsonl:2: .*prompt"):
        load_openai_jsonl(p, tokenizer_dir=qwen3)


# ------------------------------------------------------------------------------ capacity bound


def _one_token_trace(seq):
    """Each request is one token, so with block_size 1 its only block key is that token's."""
    return Trace("seq", [Request(i, float(i), [t], 1) for i, t in enumerate(seq)], False, "")


def _brute_force_best_hits(seq, cap):
    """Most hits any cache of ``cap`` items can get when it may keep, after each access, any
    subset of what it held plus the item just accessed (what a fleet's pooled caches can)."""
    from itertools import combinations

    states = {frozenset(): 0}
    for x in seq:
        nxt: dict = {}
        for st, h in states.items():
            h2 = h + (x in st)
            pool = sorted(st | {x})
            for k in range(min(cap, len(pool)) + 1):
                for keep in combinations(pool, k):
                    fk = frozenset(keep)
                    if nxt.get(fk, -1) < h2:
                        nxt[fk] = h2
        states = nxt
    return max(states.values())


def test_capacity_bound_is_the_offline_optimum_on_small_sequences():
    rng = np.random.default_rng(3)
    for _ in range(60):
        seq = rng.integers(0, 5, size=int(rng.integers(1, 11))).tolist()
        cap = int(rng.integers(1, 4))
        tr = _one_token_trace(seq)
        got = tr.capacity_bound_hit_rate(1, cap) * len(seq)
        assert round(got) == _brute_force_best_hits(seq, cap), (seq, cap)


def test_capacity_bound_limits():
    tr = synthetic_conversations(n_conversations=40, seed=2)
    inf = tr.infinite_cache_hit_rate(16)
    rates = [tr.capacity_bound_hit_rate(16, c) for c in (1, 50, 500, 5000, 10**7)]
    assert rates == sorted(rates)  # more capacity never hurts the optimum
    assert rates[-1] == pytest.approx(inf) and 0 <= rates[0] < inf
    with pytest.raises(ValueError):
        tr.capacity_bound_hit_rate(16, 0)
    assert Trace("e", [], False, "").capacity_bound_hit_rate(16, 10) == 0.0
