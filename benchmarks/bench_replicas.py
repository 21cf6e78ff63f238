"""Load imbalance of router replicas vs the staleness of their shared load (simulation).

N `kvroute.Router` replicas in one process, fed the same engine events, take requests round
robin (an L4 balancer), or with ``--sticky`` by prefix group (each client's connection kept on
one replica, so each replica sees other prefixes). Each replica's own in-flight counts are
published every ``sync`` seconds of simulated time, and each replica then sees the sum of the
others' last published counts (`Router.set_peer_load`), as `kvroute.serving.shared_load` does
through Redis: ``sync`` is the staleness of the shared view (0: every change at once; ``inf``:
no sharing, each replica sees only its own requests). One router alone (N = 1) is the
reference.

Workload (seeded): Poisson arrivals; each prompt = one of ``--groups`` shared prefixes
(Zipf-chosen, ``--prefix-tokens`` long) + a unique suffix; a request's service time = a
fixed decode time + its uncached prompt tokens x a prefill cost; the engine's BlockStored for
the prompt reaches every replica ``--event-lag`` after the decision. Speculative credits are
off, so only the load terms and the events steer.

Reported per setting: imbalance = time average over arrivals of max / mean requests in
flight per engine (the true global counts), its 99th percentile, and the prefix hit ratio
(matched / prompt tokens of the decisions).

    PYTHONPATH=python python3 benchmarks/bench_replicas.py --replicas 3 --sync 0 0.05 0.2 1 inf
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
from typing import Dict, List, Tuple

import kvroute
from kvroute import wire

BS = 16


class Engines:
    """What each engine has stored (block keys of contiguous prefixes) and its events."""

    def __init__(self, names: List[str]) -> None:
        self.held: Dict[str, set] = {n: set() for n in names}
        self.seq: Dict[str, int] = {n: 0 for n in names}

    def store(self, name: str, tokens: List[int]) -> Tuple[bytes, int]:
        keys = [int(k) for k in kvroute.block_keys(tokens, BS)]
        held = self.held[name]
        m = 0
        while m < len(keys) and keys[m] in held:
            m += 1
        new = keys[m:]
        held.update(new)
        ev = wire.stored(new, keys[m - 1] if m else None, tokens[m * BS:len(keys) * BS], BS)
        seq = self.seq[name]
        self.seq[name] += 1
        return wire.encode_batch([ev] if new else []), seq


def run(replicas: int, sync: float, a: argparse.Namespace) -> Dict[str, float]:
    rng = random.Random(a.seed)
    names = [f"http://e{i}" for i in range(a.engines)]
    routers = [kvroute.Router(names, block_size=BS, speculative_ttl_s=0, seed=a.seed + i,
                              cache_weight=a.cache_weight) for i in range(replicas)]
    eng = Engines(names)
    prefixes = [[rng.randrange(1000, 100000) for _ in range(a.prefix_tokens)]
                for _ in range(a.groups)]
    weights = [1.0 / (g + 1) ** a.zipf for g in range(a.groups)]
    inflight = {n: 0 for n in names}
    q: List[Tuple[float, int, str, tuple]] = []
    k = 0

    def push(t: float, kind: str, data: tuple) -> None:
        nonlocal k
        k += 1
        heapq.heappush(q, (t, k, kind, data))

    t = 0.0
    for i in range(a.requests):
        t += rng.expovariate(a.rate)
        push(t, "arrive", (i,))
    if replicas > 1 and math.isfinite(sync) and sync > 0:
        push(sync, "sync", ())
    published = [dict() for _ in routers]  # replica -> worker -> counts at its last publish

    def publish_all() -> None:
        for ri, r in enumerate(routers):
            published[ri] = {n: (w["inflight_requests"], w["pending_prefill_tokens"],
                                 w["active_blocks"]) for n, w in r.stats()["workers"].items()}
        for ri, r in enumerate(routers):
            for n in names:
                s = [sum(published[o][n][j] for o in range(len(routers)) if o != ri)
                     for j in range(3)]
                r.set_peer_load(n, *s)

    imb: List[float] = []
    matched = prompt_total = 0
    while q:
        t, _, kind, data = heapq.heappop(q)
        if kind == "arrive":
            (i,) = data
            g = rng.choices(range(a.groups), weights)[0]
            tokens = prefixes[g] + [rng.randrange(1000, 100000) for _ in range(a.suffix_tokens)]
            ri = g % replicas if a.sticky else i % replicas
            r = routers[ri]
            d = r.select_worker(tokens)
            inflight[d.worker] += 1
            counts = list(inflight.values())
            imb.append(max(counts) / (sum(counts) / len(counts)))
            matched += d.matched_tokens
            prompt_total += d.prompt_tokens
            prefill_s = d.prefill_tokens * a.prefill_s_per_token
            push(t + a.event_lag, "event", (d.worker, tokens))
            push(t + prefill_s, "first", (ri, d.request_id))
            push(t + prefill_s + a.decode_s, "done", (ri, d.request_id, d.worker))
            if replicas > 1 and sync == 0:
                publish_all()
        elif kind == "event":
            w, tokens = data
            payload, seq = eng.store(w, tokens)
            for r in routers:
                r.ingest(w, payload, seq=seq)
        elif kind == "first":
            ri, rid = data
            routers[ri].first_token(rid)
            if replicas > 1 and sync == 0:
                publish_all()
        elif kind == "done":
            ri, rid, w = data
            routers[ri].complete(rid)
            inflight[w] -= 1
            if replicas > 1 and sync == 0:
                publish_all()
        elif kind == "sync":
            publish_all()
            if any(x[2] != "sync" for x in q):
                push(t + sync, "sync", ())
    for r in routers:
        r.close()
    imb.sort()
    return {"imbalance": statistics.fmean(imb), "p99": imb[int(0.99 * (len(imb) - 1))],
            "hit": matched / max(prompt_total, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--sync", type=float, nargs="+", default=[0.0, 0.05, 0.2, 1.0, math.inf])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rate", type=float, default=40.0, help="arrivals per second")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--suffix-tokens", type=int, default=256)
    p.add_argument("--decode-s", type=float, default=1.5)
    p.add_argument("--prefill-s-per-token", type=float, default=5e-4)
    p.add_argument("--event-lag", type=float, default=0.02)
    p.add_argument("--cache-weight", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sticky", action="store_true",
                   help="a prefix group's requests all reach one replica (the balancer keeps a "
                        "client's connection on one replica) instead of round robin")
    a = p.parse_args()
    print(f"{a.engines} engines, {a.requests} requests at {a.rate}/s, {a.groups} prefixes "
          f"(zipf {a.zipf}), seed {a.seed}")
    print(f"{'setting':>28} {'imbalance':>10} {'p99':>6} {'hit':>6}")
    base = run(1, 0.0, a)
    print(f"{'single router':>28} {base['imbalance']:10.3f} {base['p99']:6.2f} {base['hit']:6.3f}")
    for s in a.sync:
        res = run(a.replicas, s, a)
        label = (f"{a.replicas} replicas, no sharing" if math.isinf(s)
                 else f"{a.replicas} replicas, sync {s:g} s")
        print(f"{label:>28} {res['imbalance']:10.3f} {res['p99']:6.2f} {res['hit']:6.3f}")


if __name__ == "__main__":
    main()
