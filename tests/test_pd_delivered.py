"""Delivered prefix reuse in prefill/decode mode (kvroute.serving.pd): the front reads the
engines' ``usage.prompt_tokens_details.cached_tokens`` from the prefill answer (vLLM's JSON
answer; SGLang's answer read whole, JSON or SSE) and, when the prefill pool is skipped, from
the decode answer (streamed or not), and reports it to that pool's Router.

The engines are the vLLM stand-ins of `kvroute.sim.server` (`StandinEngine` behind its
FastAPI app, in process, on loopback): a real prefix cache and real vLLM-format KV events over
ZeroMQ, which the fronts' Routers index. They ignore the PD fields (``kv_transfer_params``,
SGLang's bootstrap fields), so each one prefills from its own cache, as an engine does."""

from __future__ import annotations

import itertools
import json
from typing import Any, List

import pytest
from _util import TIMEOUT, UvicornThread, require, standin_stats, wait_for, wait_subscribed

httpx = require("httpx")
require("fastapi")
require("uvicorn")
require("tokenizers")

from kvroute.config import load_config  # noqa: E402
from kvroute.fastapi import create_app as create_pd_app  # noqa: E402
from kvroute.sim.server import DEFAULT_MODEL, StandinEngine, create_app  # noqa: E402

BS = 16
_prompts = itertools.count()


class Standin:
    """One in-process stand-in engine served on loopback."""

    def __init__(self, tokenizer_dir: Any) -> None:
        self.engine = StandinEngine(tokenizer_dir=tokenizer_dir, block_size=BS,
                                    replay_endpoint=None)
        self.server = UvicornThread(create_app(self.engine))
        self.url = self.server.url
        self.kv_endpoint = self.engine.kv_endpoint

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture(scope="module")
def pair(qwen3):
    p, d = Standin(qwen3), Standin(qwen3)
    yield p, d
    p.close()
    d.close()


def _prompt() -> List[int]:
    """85 token ids (5 full blocks and 5 tokens: vLLM recomputes at least the last prompt
    token, so a prompt of whole blocks would reuse one block less than it holds) no other
    test in this module sends."""
    k = next(_prompts)
    return list(range(3000 + 100 * k, 3085 + 100 * k))


def _front(p: Standin, d: Standin, *, bootstrap_port: Any = None, **kw: Any):
    before = [standin_stats(e)["kv_subscriptions"] for e in (p, d)]
    cfg = {"mode": {"type": "vllm_prefill_decode",
                    "prefill": [{"url": p.url, "kv_events": p.kv_endpoint,
                                 "bootstrap_port": bootstrap_port}],
                    "decode": [{"url": d.url, "kv_events": d.kv_endpoint}],
                    "decode_policy": {"type": "kv_aware"}},
           "policy": {"type": "kv_aware"}, "block_size": BS}
    front = UvicornThread(create_pd_app(load_config(cfg), **kw))
    wait_subscribed([p, d], before)
    pdr = front.app.state.kvroute_pd_router
    reports: dict = {"prefill": [], "decode": []}
    for pool in ("prefill", "decode"):
        pdr.hit_rate[pool].listeners.append(reports[pool].append)
    return front, pdr, reports


def _send(front: Any, prompt: List[int], stream: bool) -> dict:
    """One completions request; the engine's usage as the client saw it."""
    body: dict = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 3}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", front.url + "/v1/completions", json=body,
                          timeout=TIMEOUT) as r:
            assert r.status_code == 200
            text = b"".join(r.iter_raw())
        return [json.loads(ln[5:]) for ln in text.split(b"\n")
                if ln.startswith(b"data: {") and b'"usage"' in ln][-1]["usage"]
    r = httpx.post(front.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _twice(front: Any, pool: Any, reports: list, stream: bool) -> list:
    """The same prompt twice, the second once the engine's blocks are indexed; the two
    reports of ``pool`` (the Router of the pool whose engine's count is reported)."""
    prompt = _prompt()
    stored = pool.stats()["workers"]
    stored = next(iter(stored.values()))["blocks_stored"]
    _send(front, prompt, stream)
    wait_for(lambda: next(iter(pool.stats()["workers"].values()))["blocks_stored"]
             >= stored + len(prompt) // BS, "the first answer's BlockStored")
    _send(front, prompt, stream)
    wait_for(lambda: len(reports) >= 2, "two delivered reports")
    return reports


def _check(first: Any, second: Any) -> None:
    assert first.delivered_tokens == 0 and first.captured_tokens == 0
    # the router predicted what the engine reused: the same tokens, the same blocks
    assert second.delivered_tokens == second.captured_tokens > 0
    assert second.captured_tokens % BS == 0 and second.error == 0
    assert second.engine_prompt_tokens == second.prompt_tokens == 85


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_vllm_prefill_answer_is_reported_to_the_prefill_pool(pair, stream):
    p, d = pair
    front, pdr, reports = _front(p, d)
    try:
        first, second = _twice(front, pdr.prefill, reports["prefill"], stream)
        _check(first, second)
        assert first.worker == second.worker == p.url
        # after a remote prefill the decode worker's count is not its own cache's
        assert reports["decode"] == []
        snap = pdr.hit_rate["prefill"].snapshot()
        assert snap["reports"] == 2 and snap["totals"]["delivered"] == second.delivered_tokens
    finally:
        front.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_sglang_prefill_answer_read_whole_is_reported(pair, stream):
    p, d = pair
    front, pdr, reports = _front(p, d, bootstrap_port=8998)
    try:
        first, second = _twice(front, pdr.prefill, reports["prefill"], stream)
        _check(first, second)
        assert reports["decode"] == []
    finally:
        front.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_skipped_prefill_reports_the_decode_answer_to_the_decode_pool(pair, stream):
    p, d = pair
    front, pdr, reports = _front(p, d, pd_uncached_token_threshold=10_000)
    try:
        first, second = _twice(front, pdr.decode, reports["decode"], stream)
        _check(first, second)
        assert first.worker == second.worker == d.url
        assert reports["prefill"] == []
    finally:
        front.stop()


def test_an_error_answer_is_not_reported(pair):
    p, d = pair
    front, pdr, reports = _front(p, d, pd_uncached_token_threshold=10_000)
    try:
        r = httpx.post(front.url + "/v1/completions",
                       json={"model": "no-such-model", "prompt": _prompt(), "max_tokens": 2},
                       timeout=TIMEOUT)
        assert r.status_code == 404
        assert reports["decode"] == [] and pdr.hit_rate["decode"].snapshot()["unreported"] == 0
    finally:
        front.stop()
