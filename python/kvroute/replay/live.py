"""Replay a trace against live OpenAI-compatible engines that publish KV events.

`run_live` sends each request of a trace at its arrival time (wall clock, from the start of
the replay) to the worker a `kvroute.Router` chooses, as ``POST /v1/completions`` with the
prompt's token ids (``prompt``: list of ints, ``max_tokens``: the request's output length,
streamed with ``stream_options.include_usage``), and reads what the engine reports:
``usage.prompt_tokens_details.cached_tokens`` (vLLM sends it with
``--enable-prompt-tokens-details``; the kvroute stand-in always does). The router ingests the
engines' KV events over ZeroMQ as in production, so the table shows the router's prediction
(``predicted_hit_rate``) beside what the engines delivered (``hit_rate``).

Engines keep their prefix caches between policies: a second policy starts on caches the first
one warmed. Run one policy per fresh set of engines to compare policies fairly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, List, Optional, Sequence

import numpy as np

from kvroute import Router, Worker
from kvroute.policies import KvAware, for_name
from kvroute.replay.runner import PolicyResult
from kvroute.replay.trace_types import Trace


@dataclass(frozen=True)
class Engine:
    """A live engine: its OpenAI-compatible base URL and its KV-event endpoint (ZeroMQ PUB,
    the engine's ``--kv-events-config`` ``endpoint``)."""

    url: str
    kv_endpoint: str


def parse_engines(spec: str) -> List[Engine]:
    """``URL@KV_ENDPOINT,...`` (``http://10.0.0.1:8000@tcp://10.0.0.1:5557,...``) as `Engine`
    s. Raises ValueError naming the bad item."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        url, sep, kv = item.partition("@")
        if not sep or not url.startswith(("http://", "https://")) or "://" not in kv:
            raise ValueError(f"--engines item {item!r}: expected URL@KV_ENDPOINT, e.g. "
                             "http://10.0.0.1:8000@tcp://10.0.0.1:5557")
        out.append(Engine(url.rstrip("/"), kv))
    if not out:
        raise ValueError("--engines is empty")
    return out


_KEEPALIVE_S = 2.0


@contextlib.asynccontextmanager
async def _stream(client: Any, url: str, body: dict) -> AsyncIterator[Any]:
    """``client.stream("POST", url, json=body)``, sent once more on a fresh connection when
    the first attempt fails before any response byte arrived (a keep-alive connection the
    engine closed as it was reused): the request never reached the engine."""
    import httpx

    for attempt in range(2):
        cm = client.stream("POST", url, json=body)
        try:
            resp = await cm.__aenter__()
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
            if attempt == 1:
                raise
            continue
        try:
            yield resp
        except BaseException as e:
            if not await cm.__aexit__(type(e), e, e.__traceback__):
                raise
        else:
            await cm.__aexit__(None, None, None)
        return


@dataclass
class _Done:
    worker: str
    prompt: int
    cached: int
    matched: int
    arrival: float
    first_token: float
    finish: float
    output: int
    route_ns: int
    fallback: bool


def run_live(trace: Trace, policy: str, engines: Sequence[Engine], *,
             cache_weight: float = KvAware.cache_weight, block_size: int = 16,
             model: Optional[str] = None, seed: int = 0, timeout_s: float = 600.0,
             settle_s: float = 1.0) -> PolicyResult:
    """Replays ``trace`` on ``engines`` with one policy; returns its row (times in wall-clock
    seconds; ``hit_rate`` from the engines' ``cached_tokens``, ``predicted_hit_rate`` the
    router's matched tokens; ``load_imbalance`` = max / mean of the prompt tokens each engine
    computed). ``settle_s``: wait after subscribing, before the first request (ZeroMQ joins).
    Raises RuntimeError when an engine answers an error or its usage lacks ``cached_tokens``.
    """
    return asyncio.run(_run(trace, policy, list(engines), cache_weight, block_size, model,
                            seed, timeout_s, settle_s))


async def _run(trace: Trace, policy: str, engines: List[Engine], cache_weight: float,
               block_size: int, model: Optional[str], seed: int, timeout_s: float,
               settle_s: float) -> PolicyResult:
    import httpx

    t_start = time.perf_counter()
    router = Router([Worker(e.url, e.kv_endpoint) for e in engines],
                    policy=for_name(policy, {"cache_weight": cache_weight}),
                    block_size=block_size, seed=seed)
    done: List[_Done] = []
    try:
        await asyncio.sleep(settle_s)
        # Idle connections are dropped before uvicorn's 5 s keep-alive timeout (vLLM's and
        # SGLang's HTTP servers): a connection reused as the server closes it fails with
        # httpx.ReadError / RemoteProtocolError.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64,
                              keepalive_expiry=_KEEPALIVE_S)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            t0 = time.perf_counter()

            async def one(req: Any) -> None:
                delay = req.arrival_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                arrival = time.perf_counter() - t0
                r0 = time.perf_counter_ns()
                d = router.select_worker(req.tokens, session_key=req.session or None)
                route_ns = time.perf_counter_ns() - r0
                body: dict = {"prompt": req.tokens.tolist(), "max_tokens": req.output_length,
                              "stream": True, "stream_options": {"include_usage": True}}
                if model:
                    body["model"] = model
                first = None
                usage = None
                try:
                    async with _stream(client, f"{d.worker}/v1/completions", body) as resp:
                        if resp.status_code != 200:
                            text = (await resp.aread()).decode(errors="replace")[:300]
                            raise RuntimeError(f"{d.worker} answered {resp.status_code}: {text}")
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if first is None and chunk.get("choices"):
                                first = time.perf_counter() - t0
                                router.first_token(d)
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                finally:
                    router.complete(d)
                cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
                if cached is None:
                    raise RuntimeError(
                        f"{d.worker}: usage has no prompt_tokens_details.cached_tokens (start "
                        "vLLM with --enable-prompt-tokens-details)")
                end = time.perf_counter() - t0
                done.append(_Done(d.worker, len(req.tokens), int(cached), int(d.matched_tokens),
                                  arrival, first if first is not None else end, end,
                                  int((usage or {}).get("completion_tokens", 0)), route_ns,
                                  bool(d.fallback)))

            await asyncio.gather(*(one(r) for r in trace.requests))
    finally:
        router.close()
    return _summary(policy, done, [e.url for e in engines], t_start)


def _summary(policy: str, done: List[_Done], urls: List[str], t_start: float) -> PolicyResult:
    prompt = sum(x.prompt for x in done)
    ttft = np.array([x.first_token - x.arrival for x in done])
    e2e = np.array([x.finish - x.arrival for x in done])
    computed = np.array([sum(x.prompt - x.cached for x in done if x.worker == u) for u in urls],
                        dtype=float)
    us = np.array([x.route_ns for x in done]) / 1000.0
    span = max(x.finish for x in done) - min(x.arrival for x in done)
    return PolicyResult(
        policy=policy, requests=len(done),
        hit_rate=sum(x.cached for x in done) / prompt if prompt else 0.0,
        ttft_mean=float(ttft.mean()), ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p90=float(np.percentile(ttft, 90)), ttft_p99=float(np.percentile(ttft, 99)),
        e2e_mean=float(e2e.mean()), e2e_p99=float(np.percentile(e2e, 99)),
        throughput_tok_s=sum(x.output for x in done) / span if span > 0 else 0.0,
        load_imbalance=float(computed.max() / computed.mean()) if computed.mean() > 0 else 1.0,
        route_us_p50=float(np.percentile(us, 50)), route_us_p99=float(np.percentile(us, 99)),
        fallback_share=sum(x.fallback for x in done) / len(done),
        predicted_hit_rate=sum(x.matched for x in done) / prompt if prompt else 0.0,
        wall_s=time.perf_counter() - t_start)
