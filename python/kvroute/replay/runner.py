"""Replay a trace through the router and a simulated fleet over real ZeroMQ, per policy.

Deterministic mode (``event_delay_s=0``, the default): virtual time; before each routing
decision every event the fleet has published is applied by the router (the runner waits until
the router's applied-event count equals the events sent), and the router's speculative
entries run on the same virtual clock, so a seed gives the same table run after run.
Live mode (``event_delay_s > 0``): events reach the wire that much virtual time after the step
that produced them, as with a loaded network or a slow subscriber.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from kvroute import Router, Worker, _core
from kvroute.policies import KvAware, for_name
from kvroute.replay.trace_types import Trace
from kvroute.sim.engine import ServiceModel, SimRequest
from kvroute.sim.fleet import SimFleet
from kvroute.wire import Era


@dataclass
class PolicyResult:
    """One row of the replay table. Times in seconds unless the name says otherwise."""

    policy: str
    requests: int
    hit_rate: float            # prompt tokens served from engine prefix caches / prompt tokens
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    e2e_mean: float
    e2e_p99: float
    throughput_tok_s: float    # output tokens / (last finish - first arrival)
    load_imbalance: float      # max / mean prefill tokens computed per worker
    route_us_p50: float        # select_worker wall time, microseconds
    route_us_p99: float
    fallback_share: float      # decisions made by the fallback policy
    predicted_hit_rate: float  # captured: the chosen workers' matches / prompt tokens
    wall_s: float              # how long this policy's replay took
    # available: the best match any worker held at each decision / prompt tokens (None: PD)
    available_hit_rate: Optional[float] = None
    # mean over requests of |captured - delivered| / prompt tokens, delivered being the
    # simulated engine's own prefix hit (Router.report_delivered); None: PD
    prediction_error: Optional[float] = None
    # with adaptive cache_weight (run_policy adaptive=...): the weight at the end, else None
    final_cache_weight: Optional[float] = None
    # ... and its speculative_ttl_s at the end (None: not tuned)
    final_speculative_ttl_s: Optional[float] = None

    def as_dict(self) -> dict:
        return asdict(self)


def _wait_applied(router: Router, target: int, timeout_s: float = 30.0) -> None:
    core = router._core
    if core.events_applied() >= target:
        return
    deadline = time.monotonic() + timeout_s
    while core.events_applied() < target:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"router applied {core.events_applied()} of {target} events after {timeout_s} s; "
                f"stats: {router.stats()['dropped']}")
        time.sleep(0.00002)


_DEFAULTS = _core.RouterOptions()  # the Router's defaults (cpp/router/router.h)


def _ttl(speculative_ttl_s: float, speculative_ttl: Optional[float]) -> float:
    if speculative_ttl is None:
        return speculative_ttl_s
    warnings.warn("speculative_ttl is deprecated; use speculative_ttl_s", DeprecationWarning,
                  stacklevel=3)
    return speculative_ttl


def run_policy(trace: Trace, policy: str, *, workers: int = 8,
               cache_weight: float = KvAware.cache_weight,
               kv_capacity_blocks: int = 29_205, block_size: int = _DEFAULTS.index.block_size,
               model: ServiceModel = ServiceModel(), seed: int = 0, era: Era = "map",
               event_delay_s: float = 0.0,
               speculative_ttl_s: float = _DEFAULTS.speculative_ttl_s,
               progress: Optional[Callable[[int], object]] = None,
               speculative_ttl: Optional[float] = None,
               adaptive: Optional[dict] = None,
               size_aware: Optional[bool] = None) -> PolicyResult:
    """Replays ``trace`` with one policy (a name; ``cache_weight`` and ``size_aware`` apply to
    the policies that have them, ``None``: the policy's default) on a fresh fleet and router;
    returns its metrics. Times in seconds
    (``speculative_ttl``: deprecated alias of ``speculative_ttl_s``). ``adaptive``: keyword
    arguments of `kvroute.adaptive.AdaptiveCacheWeight` (``{}`` for its defaults) to tune
    ``cache_weight`` online from ``cache_weight`` on; ``None``: fixed."""
    speculative_ttl_s = _ttl(speculative_ttl_s, speculative_ttl)
    t_start = time.perf_counter()
    fleet = SimFleet(workers, capacity_blocks=kv_capacity_blocks, block_size=block_size,
                     model=model, era=era, seed=seed, event_delay_s=event_delay_s)
    names = [e.name for e in fleet.engines]
    router = Router([Worker(n, ep) for n, ep in zip(names, fleet.endpoints)],
                    policy=for_name(policy, {"cache_weight": cache_weight,
                                             "size_aware": size_aware}),
                    block_size=block_size, seed=seed, speculative_ttl_s=speculative_ttl_s)
    try:
        _join(router, fleet)
        tuner = None
        if adaptive is not None:
            from kvroute.adaptive import AdaptiveCacheWeight

            tuner = AdaptiveCacheWeight(router, **adaptive)
        by_name = {e.name: e for e in fleet.engines}
        abs_err = [0.0]

        def finished(r: SimRequest) -> None:
            router.complete(r.tag)
            # What the engine really reused, against what the router predicted.
            rep = router.report_delivered(r.tag, r.cached_tokens, prompt_tokens=len(r.tokens))
            abs_err[0] += abs(rep.error or 0.0)

        for e in fleet.engines:
            e.on_first_token = lambda r: router.first_token(r.tag)
            e.on_finish = finished
        route_ns = np.empty(len(trace.requests), dtype=np.int64)
        fallback = 0
        predicted = 0
        for k, req in enumerate(trace.requests):
            t = req.arrival_s
            fleet.advance_to(t)
            if event_delay_s > 0:
                fleet.deliver_all(t)
            _wait_applied(router, fleet.events_sent)
            t0 = time.perf_counter_ns()
            d = router.select_worker(req.tokens, now=t, session_key=req.session or None)
            route_ns[k] = time.perf_counter_ns() - t0
            fallback += d.fallback
            predicted += d.matched_tokens
            by_name[d.worker].add_request(
                SimRequest(req.request_id, req.tokens, req.output_length, t, tag=d), t)
            if progress is not None:
                progress(1)
        fleet.advance_to(float("inf"))
        done = [r for e in fleet.engines for r in e.finished]
        if len(done) != len(trace.requests):
            raise RuntimeError(f"{len(trace.requests) - len(done)} requests never finished")
        prompt = sum(e.prompt_tokens for e in fleet.engines)
        cached = sum(e.cached_tokens for e in fleet.engines)
        available = router.hit_rate.snapshot()["totals"]["available"]
        res = _summarize(policy, done, route_ns, fleet.engines,
                         hit_rate=cached / prompt if prompt else 0.0,
                         fallback=fallback,
                         predicted_hit_rate=predicted / prompt if prompt else 0.0,
                         t_start=t_start)
        res.available_hit_rate = available / prompt if prompt else 0.0
        res.prediction_error = abs_err[0] / len(done)
        if tuner is not None:
            res.final_cache_weight = tuner.weight
            res.final_speculative_ttl_s = tuner.ttl_s
            res.policy = f"{policy} adaptive"
        return res
    finally:
        router.close()
        fleet.close()


def _summarize(policy: str, done: list, route_ns: np.ndarray, prefill_engines: list, *,
               hit_rate: float, fallback: int, predicted_hit_rate: float,
               t_start: float) -> PolicyResult:
    """The table row from the finished requests; imbalance over ``prefill_engines``."""
    ttft = np.array([r.first_token_s - r.arrival_s for r in done])
    e2e = np.array([r.finish_s - r.arrival_s for r in done])
    prefill = np.array([e.prefill_tokens_computed for e in prefill_engines], dtype=float)
    span = max(r.finish_s for r in done) - min(r.arrival_s for r in done)
    us = route_ns / 1000.0
    return PolicyResult(
        policy=policy, requests=len(done), hit_rate=hit_rate,
        ttft_mean=float(ttft.mean()), ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p90=float(np.percentile(ttft, 90)), ttft_p99=float(np.percentile(ttft, 99)),
        e2e_mean=float(e2e.mean()), e2e_p99=float(np.percentile(e2e, 99)),
        throughput_tok_s=sum(r.output_length for r in done) / span if span > 0 else 0.0,
        load_imbalance=float(prefill.max() / prefill.mean()) if prefill.mean() > 0 else 1.0,
        route_us_p50=float(np.percentile(us, 50)), route_us_p99=float(np.percentile(us, 99)),
        fallback_share=fallback / len(done), predicted_hit_rate=predicted_hit_rate,
        wall_s=time.perf_counter() - t_start,
    )


def _join(router: Router, fleet: SimFleet, timeout_s: float = 10.0) -> None:
    """ZeroMQ slow joiner: send empty batches until every SUB socket receives them."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = router.stats()["workers"]
        if all(st[e.name]["batches"] > 0 for e in fleet.engines):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("router did not connect to every simulated worker")
        for i in range(len(fleet.engines)):
            fleet.send(i, [])
        time.sleep(0.01)


def replay(trace: Trace, policies: Sequence[str] = ("kv_aware", "round_robin", "power_of_two"),
           *, progress: bool = True, pd: Optional[dict] = None, jobs: Optional[int] = None,
           **kwargs) -> list[PolicyResult]:
    """Runs `run_policy` for each policy (or, with ``pd`` = `run_pd` keyword arguments, `run_pd`
    with each policy as the prefill policy); ``kwargs`` are passed through. Results in the
    order of ``policies``.

    ``jobs``: policies replayed at once, each in a process of its own (forked, so the trace
    is shared, not copied); default ``min(len(policies), 2 * os.cpu_count())`` (a replay
    process waits on its router's ingestion thread part of the time: on 2 vCPUs, 3 policies
    took 62 s with 3 processes against 112 s with 2); 1 (or a platform without fork) runs
    them one after the other in this process. Each policy has its own
    fleet, router and seed, so the results do not depend on ``jobs``."""
    import os

    if jobs is None:
        jobs = min(len(policies), 2 * (os.cpu_count() or 1))
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    import multiprocessing as mp

    if jobs > 1 and len(policies) > 1 and "fork" in mp.get_all_start_methods():
        return _replay_parallel(trace, list(policies), jobs, progress, pd, kwargs)
    results = []
    for p in policies:
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(trace.requests), desc=f"{p:<16}", unit="req", leave=False)
        try:
            cb = bar.update if bar else None
            results.append(_run_one(trace, p, pd, kwargs, cb))
        finally:
            if bar is not None:
                bar.close()
    return results


def _run_one(trace: Trace, policy: str, pd: Optional[dict], kwargs: dict,
             progress: Optional[Callable[[int], object]]) -> PolicyResult:
    if pd is not None:
        kw = {k: v for k, v in kwargs.items()
              if k not in ("workers", "event_delay_s", "adaptive", "size_aware")}
        return run_pd(trace, policy, progress=progress, **pd, **kw)
    return run_policy(trace, policy, progress=progress, **kwargs)


# What a forked replay process inherits: (trace, pd, kwargs, shared request counter).
_FORKED: Optional[tuple] = None


def _forked_run(policy: str) -> PolicyResult:
    assert _FORKED is not None  # set before the pool forked this process
    trace, pd, kwargs, counter = _FORKED
    pending = [0]

    def tick(n: int) -> None:
        pending[0] += n
        if pending[0] >= 200:
            with counter.get_lock():
                counter.value += pending[0]
            pending[0] = 0

    return _run_one(trace, policy, pd, kwargs, tick)


def _replay_parallel(trace: Trace, policies: list, jobs: int, progress: bool,
                     pd: Optional[dict], kwargs: dict) -> list[PolicyResult]:
    """`replay` with the policies in ``jobs`` forked processes; one progress bar over all."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, wait

    global _FORKED
    ctx = mp.get_context("fork")
    counter = ctx.Value("q", 0)
    _FORKED = (trace, pd, kwargs, counter)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(trace.requests) * len(policies),
                   desc=f"{len(policies)} policies, {jobs} processes", unit="req", leave=False)
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(policies)), mp_context=ctx) as pool:
            futures = [pool.submit(_forked_run, p) for p in policies]
            while True:
                done, not_done = wait(futures, timeout=0.5)
                if bar is not None:
                    bar.n = counter.value
                    bar.refresh()
                if not not_done or any(f.exception() is not None for f in done):
                    break
            return [f.result() for f in futures]  # raises the first policy's error
    finally:
        _FORKED = None
        if bar is not None:
            bar.close()


# Disaggregated prefill/decode --------------------------------------------------------------

# KV transfer from a prefill to a decode worker, per prompt token: Llama-3.1-8B holds 128 KiB
# of KV per token (2 x 32 layers x 8 KV heads x 128 x 2 bytes); at an assumed 50 GB/s
# (RDMA / NVLink-class link) that is 2.6 us per token.
KV_TRANSFER_S_PER_TOKEN = 131072 / 50e9


def run_pd(trace: Trace, prefill_policy: str = "kv_aware", *, prefill_workers: int = 4,
           decode_workers: int = 4, decode_policy: str = "consistent_hash",
           pd_uncached_token_threshold: Optional[int] = None,
           cache_weight: float = KvAware.cache_weight,
           kv_capacity_blocks: int = 29_205, block_size: int = _DEFAULTS.index.block_size,
           model: ServiceModel = ServiceModel(), seed: int = 0, era: Era = "map",
           speculative_ttl_s: float = _DEFAULTS.speculative_ttl_s,
           transfer_s_per_token: float = KV_TRANSFER_S_PER_TOKEN,
           progress: Optional[Callable[[int], object]] = None,
           speculative_ttl: Optional[float] = None) -> PolicyResult:
    """Replays ``trace`` on a prefill pool and a decode pool routed by a `kvroute.PDRouter`.

    A request goes to the prefill worker (prompt only), its KV moves to the decode worker
    (``transfer_s_per_token`` x prompt tokens), which computes the last prompt token and
    decodes; unless the decode worker's own cache leaves at most
    ``pd_uncached_token_threshold`` tokens uncached, then it prefills by itself. TTFT is the
    decode worker's first token. ``hit_rate`` = 1 - prompt tokens computed anywhere / prompt
    tokens. ``fallback_share`` counts prefill decisions made by the fallback policy;
    ``predicted_hit_rate`` is the share of requests that skipped the prefill pool.
    ``cache_weight`` applies to the pools' policies that have one.
    """
    speculative_ttl_s = _ttl(speculative_ttl_s, speculative_ttl)
    shared: dict[str, Any] = {"cache_weight": cache_weight}
    import heapq

    from kvroute.pd import PDRouter

    t_start = time.perf_counter()
    pf = SimFleet(prefill_workers, capacity_blocks=kv_capacity_blocks, block_size=block_size,
                  model=model, era=era, seed=seed)
    df = SimFleet(decode_workers, capacity_blocks=kv_capacity_blocks, block_size=block_size,
                  model=model, era=era, seed=seed + 1_000_003)
    pd = PDRouter([Worker(e.name, ep) for e, ep in zip(pf.engines, pf.endpoints)],
                  [Worker(e.name, ep) for e, ep in zip(df.engines, df.endpoints)],
                  prefill_policy=for_name(prefill_policy, shared),
                  decode_policy=for_name(decode_policy, shared),
                  pd_uncached_token_threshold=pd_uncached_token_threshold,
                  block_size=block_size, seed=seed, speculative_ttl_s=speculative_ttl_s)
    delayed: list = []  # (time, seq, engine, request): KV arriving at a decode worker
    out_len = {r.request_id: r.output_length for r in trace.requests}
    n_delayed = [0]
    try:
        _join(pd.prefill, pf)
        _join(pd.decode, df)
        p_by = {e.name: e for e in pf.engines}
        d_by = {e.name: e for e in df.engines}

        def prefill_done(r: SimRequest) -> None:
            pdd = r.tag
            pd.prefill.complete(pdd.prefill)
            eng = d_by[pdd.decode.worker]
            dreq = SimRequest(r.request_id, r.tokens, out_len[r.request_id], r.arrival_s,
                              tag=pdd, kv_received=True)
            n_delayed[0] += 1
            assert r.finish_s is not None  # on_finish runs after the engine set it
            heapq.heappush(delayed, (r.finish_s + transfer_s_per_token * len(r.tokens),
                                     n_delayed[0], eng, dreq))

        for e in pf.engines:
            e.on_finish = prefill_done
        for e in df.engines:
            e.on_first_token = lambda r: pd.decode.first_token(r.tag.decode)
            e.on_finish = lambda r: pd.decode.complete(r.tag.decode)

        def advance(t: float) -> None:
            while True:
                a, b = pf.next_event_time(), df.next_event_time()
                c = delayed[0][0] if delayed else None
                best = min((x for x in (a and a[0], b and b[0], c) if x is not None),
                           default=None)
                if best is None or best > t:
                    return
                if c is not None and c == best:
                    when, _, eng, req = heapq.heappop(delayed)
                    eng.add_request(req, when)
                elif a is not None and a[0] == best:
                    pf.engines[a[1]].finish_step()
                else:
                    assert b is not None  # best is a's, b's or c's time
                    df.engines[b[1]].finish_step()

        route_ns = np.empty(len(trace.requests), dtype=np.int64)
        fallback = skipped = 0
        for k, req in enumerate(trace.requests):
            t = req.arrival_s
            advance(t)
            _wait_applied(pd.prefill, pf.events_sent)
            _wait_applied(pd.decode, df.events_sent)
            t0 = time.perf_counter_ns()
            pdd = pd.select_pair(req.tokens, now=t, session_key=req.session or None)
            route_ns[k] = time.perf_counter_ns() - t0
            if pdd.prefill is None:  # skipped the prefill pool
                skipped += 1
                d_by[pdd.decode.worker].add_request(
                    SimRequest(req.request_id, req.tokens, req.output_length, t, tag=pdd), t)
            else:
                fallback += pdd.prefill.fallback
                p_by[pdd.prefill.worker].add_request(
                    SimRequest(req.request_id, req.tokens, 1, t, tag=pdd), t)
            if progress is not None:
                progress(1)
        advance(float("inf"))
        done = [r for e in df.engines for r in e.finished]
        if len(done) != len(trace.requests):
            raise RuntimeError(f"{len(trace.requests) - len(done)} requests never finished")
        prompt = sum(len(r.tokens) for r in trace.requests)
        computed = sum(e.prefill_tokens_computed for e in pf.engines + df.engines)
        return _summarize(f"pd {prefill_policy}", done, route_ns, pf.engines,
                          hit_rate=1.0 - computed / prompt if prompt else 0.0,
                          fallback=fallback, predicted_hit_rate=skipped / len(done),
                          t_start=t_start)
    finally:
        pd.close()
        pf.close()
        df.close()
