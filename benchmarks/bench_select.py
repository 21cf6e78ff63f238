#!/usr/bin/env python
"""Latency of `Router.select_worker` (and its parts) from Python over a large index.

Fills a Router with ~``--index-blocks`` distinct blocks through `Router.ingest` (real vLLM
map-era payloads from tests/engine_events.py), with realistic sharing:

* ``--sys-prompts`` shared system prompts of ``--sys-blocks`` blocks;
* conversations: a system prompt plus ``--conv-min`` .. ``--conv-max`` blocks of their own,
  each held by 1, 2 or 4 workers (``--replicas``); a system prompt is stored on every worker
  holding one of its conversations.

Then routes prompts of ``--lengths`` tokens whose first ``--hit-frac`` of blocks is the
prefix of a stored conversation (so the lookup walks that many blocks) followed by fresh
random tokens (a new turn), and times each call with ``time.perf_counter_ns``:

* ``block_keys``: `kvroute.block_keys` alone (key computation + binding);
* ``find_matches``: `Router.find_matches` (keys + lookup + a dict of every worker);
* ``select``: `Router.select_worker` with ``speculative_ttl=0`` (no insert per decision);
* ``select+spec``: `Router.select_worker` with the default ``speculative_ttl=2.0`` (each
  decision inserts its unmatched blocks for the chosen worker).

`Router.complete` runs outside the timed region. Prompts are built outside it too.

Run ``python benchmarks/bench_select.py`` (about 2 min on 2 cores) or ``--quick`` (~10 s).
"""

from __future__ import annotations

import os

# numpy's OpenBLAS threads spin after numpy calls and steal the second core on small boxes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import kvroute  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import engine_events as ee  # noqa: E402

VOCAB = 151_936  # Qwen-sized vocabulary: most ids need 5 msgpack bytes, as in real traffic


# -- corpus -------------------------------------------------------------------------------
@dataclass
class Chain:
    """A run of blocks stored as one request: its tokens and engine block hashes."""

    tokens: np.ndarray  # uint32, len = blocks * block_size
    hashes: np.ndarray  # uint64 engine block hashes
    payloads: list[bytes]  # encoded BlockStored batches, in order


@dataclass
class Corpus:
    block_size: int
    sys: list[Chain]
    convs: list[Chain]
    conv_sys: np.ndarray  # system prompt index of each conversation

    @property
    def distinct_blocks(self) -> int:
        return sum(len(c.hashes) for c in self.sys) + sum(len(c.hashes) for c in self.convs)

    def full_tokens(self, i: int) -> np.ndarray:
        """System prompt + conversation tokens of conversation i."""
        return np.concatenate([self.sys[self.conv_sys[i]].tokens, self.convs[i].tokens])


def encode_chain(tokens: np.ndarray, hashes: np.ndarray, parent: int | None, block_size: int,
                 event_blocks: int, era: str) -> list[bytes]:
    """BlockStored payloads of one chain, ``event_blocks`` blocks per event (one per batch)."""
    out = []
    hs = hashes.tolist()
    for s in range(0, len(hs), event_blocks):
        h = hs[s:s + event_blocks]
        t = tokens[s * block_size:(s + len(h)) * block_size].tolist()
        out.append(ee.encode_batch([ee.stored(h, parent, t, block_size)], era=era, ts=1.0))
        parent = h[-1]
    return out


def build_corpus(args: argparse.Namespace, rng: np.random.Generator) -> Corpus:
    bs = args.block_size
    sys_chains = []
    for _ in range(args.sys_prompts):
        toks = rng.integers(0, VOCAB, args.sys_blocks * bs, dtype=np.uint32)
        hs = rng.integers(1, 2**63, args.sys_blocks, dtype=np.uint64)
        sys_chains.append(Chain(toks, hs, encode_chain(toks, hs, None, bs, args.event_blocks,
                                                       args.era)))
    convs, conv_sys = [], []
    total = args.sys_prompts * args.sys_blocks
    while total < args.index_blocks:
        n = int(rng.integers(args.conv_min, args.conv_max + 1))
        n = min(n, args.index_blocks - total)
        s = int(rng.integers(0, args.sys_prompts))
        toks = rng.integers(0, VOCAB, n * bs, dtype=np.uint32)
        hs = rng.integers(1, 2**63, n, dtype=np.uint64)
        parent = int(sys_chains[s].hashes[-1])
        convs.append(Chain(toks, hs, encode_chain(toks, hs, parent, bs, args.event_blocks,
                                                  args.era)))
        conv_sys.append(s)
        total += n
    return Corpus(bs, sys_chains, convs, np.array(conv_sys))


def replica_counts(args: argparse.Namespace, n: int, rng: np.random.Generator) -> np.ndarray:
    """How many workers hold each conversation, from ``--replicas`` "1:0.7,2:0.2,4:0.1"."""
    pairs = [p.split(":") for p in args.replicas.split(",")]
    ks = np.array([int(k) for k, _ in pairs])
    ps = np.array([float(p) for _, p in pairs])
    return rng.choice(ks, size=n, p=ps / ps.sum())


def fill(router: kvroute.Router, names: list[str], corpus: Corpus,
         placement: list[np.ndarray]) -> float:
    """Ingests every conversation on its workers (system prompt first). Returns seconds."""
    have_sys: set[tuple[int, int]] = set()
    t0 = time.perf_counter()
    for i, conv in enumerate(corpus.convs):
        s = int(corpus.conv_sys[i])
        for w in placement[i]:
            name = names[w]
            if (s, w) not in have_sys:
                have_sys.add((s, w))
                for p in corpus.sys[s].payloads:
                    router.ingest(name, p)
            for p in conv.payloads:
                router.ingest(name, p)
    return time.perf_counter() - t0


# -- timing -------------------------------------------------------------------------------
class PromptSource:
    """Prompts of `length` tokens: a stored conversation's first hit_frac blocks + new tokens."""

    def __init__(self, corpus: Corpus, length: int, hit_frac: float, rng: np.random.Generator):
        bs = corpus.block_size
        self.length = length
        self.rng = rng
        want = int(round(hit_frac * (length // bs)))
        lens = np.array([len(corpus.sys[s].hashes) + len(c.hashes)
                         for s, c in zip(corpus.conv_sys, corpus.convs)])
        ok = np.flatnonzero(lens >= want)
        if len(ok) == 0:  # nothing that long: use the longest conversations
            ok = np.argsort(lens)[-8:]
        self.sources = [corpus.full_tokens(int(i))[:want * bs] for i in ok[:256]]

    def next(self) -> np.ndarray:
        src = self.sources[int(self.rng.integers(0, len(self.sources)))]
        src = src[:self.length]
        tail = self.rng.integers(0, VOCAB, self.length - len(src), dtype=np.uint32)
        return np.concatenate([src, tail])


def time_calls(fn, prompts: PromptSource, calls: int, warmup: int,
               after=None) -> tuple[np.ndarray, list]:
    """Per-call nanoseconds of fn(tokens); `after(result)` runs untimed after each call."""
    out = np.empty(calls, dtype=np.int64)
    results = []
    clock = time.perf_counter_ns
    for i in range(warmup + calls):
        tok = prompts.next()
        t0 = clock()
        r = fn(tok)
        t1 = clock()
        if after is not None:
            after(r)
        if i >= warmup:
            out[i - warmup] = t1 - t0
            results.append(r)
    return out, results


def pct(ns: np.ndarray) -> dict[str, float]:
    us = ns / 1e3
    return {"p50": float(np.percentile(us, 50)), "p90": float(np.percentile(us, 90)),
            "p99": float(np.percentile(us, 99)), "mean": float(us.mean()),
            "max": float(us.max())}


def fmt_row(cols: list, widths: list[int]) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cols, widths))


# -- main ---------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workers", default="8,64,256", help="worker counts, comma-separated")
    ap.add_argument("--lengths", default="1024,8192,32768", help="prompt lengths in tokens")
    ap.add_argument("--index-blocks", type=int, default=1_000_000,
                    help="distinct blocks to index")
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per cell")
    ap.add_argument("--warmup", type=int, default=200, help="untimed calls before each cell")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hit-frac", type=float, default=0.75,
                    help="fraction of a prompt's blocks that is a stored prefix")
    ap.add_argument("--sys-prompts", type=int, default=16)
    ap.add_argument("--sys-blocks", type=int, default=64, help="blocks per system prompt")
    ap.add_argument("--conv-min", type=int, default=64, help="min conversation blocks")
    ap.add_argument("--conv-max", type=int, default=2048, help="max conversation blocks")
    ap.add_argument("--replicas", default="1:0.7,2:0.2,4:0.1",
                    help="workers per conversation k:probability,...")
    ap.add_argument("--event-blocks", type=int, default=128,
                    help="blocks per BlockStored event when filling")
    ap.add_argument("--era", default="map", help="engine_events era of the fill payloads")
    ap.add_argument("--modes", default="block_keys,find_matches,select,select+spec",
                    help="what to time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-gc", action="store_true",
                    help="leave Python's cyclic GC on during timed loops")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 200k blocks, 300 calls, 64 workers")
    args = ap.parse_args()
    if args.quick:
        args.index_blocks = min(args.index_blocks, 200_000)
        args.calls, args.warmup = min(args.calls, 300), min(args.warmup, 50)
        if args.workers == ap.get_default("workers"):
            args.workers = "64"
    workers = [int(x) for x in args.workers.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = args.modes.split(",")
    rng = np.random.default_rng(args.seed)

    t0 = time.perf_counter()
    corpus = build_corpus(args, rng)
    print(f"# corpus: {corpus.distinct_blocks:,} distinct blocks, {len(corpus.sys)} system "
          f"prompts x {args.sys_blocks} blocks, {len(corpus.convs)} conversations, "
          f"{sum(len(c.payloads) for c in corpus.convs):,} payloads "
          f"({args.event_blocks} blocks/event, era={args.era}); "
          f"encoded in {time.perf_counter() - t0:.1f} s")
    print(f"# kvroute {getattr(kvroute, '__version__', '?')}, numpy {np.__version__}, "
          f"python {sys.version.split()[0]}, {args.calls} timed calls per cell after "
          f"{args.warmup} warm-up, hit_frac={args.hit_frac}, gc "
          f"{'on' if args.keep_gc else 'off'} while timing")

    rows = []
    for n in workers:
        names = [f"w{i}" for i in range(n)]
        prng = np.random.default_rng(args.seed + n)
        reps = replica_counts(args, len(corpus.convs), prng)
        placement = [prng.choice(n, size=min(int(k), n), replace=False) for k in reps]
        need_spec = "select+spec" in modes
        routers = {"off": kvroute.Router(names, block_size=args.block_size, speculative_ttl=0)}
        if need_spec:
            routers["on"] = kvroute.Router(names, block_size=args.block_size)
        for key, r in routers.items():
            secs = fill(r, names, corpus, placement)
            st = r.stats()
            blocks = sum(w["blocks_stored"] for w in st["workers"].values())
            print(f"# N={n} spec={key}: filled {st['distinct_block_keys']:,} keys / "
                  f"{st['indexed_entries']:,} (block, worker) entries in {secs:.1f} s "
                  f"({blocks / secs / 1e6:.2f} M blocks/s incl. Python loop); "
                  f"index_memory_bytes={st['index_memory_bytes'] / 2**20:.0f} MiB")
        off = routers["off"]
        for length in lengths:
            src = PromptSource(corpus, length, args.hit_frac, np.random.default_rng(length))
            gc.collect()
            if not args.keep_gc:
                gc.disable()
            try:
                cell: dict[str, tuple[dict, float]] = {}
                if "block_keys" in modes:
                    ns, _ = time_calls(lambda t: kvroute.block_keys(t, args.block_size), src,
                                       args.calls, args.warmup)
                    cell["block_keys"] = (pct(ns), float("nan"))
                if "find_matches" in modes:
                    ns, res = time_calls(off.find_matches, src, args.calls, args.warmup)
                    best = np.mean([max(m.blocks for m in r.values()) for r in res])
                    cell["find_matches"] = (pct(ns), best)
                if "select" in modes:
                    ns, res = time_calls(off.select_worker, src, args.calls, args.warmup,
                                         after=off.complete)
                    cell["select"] = (pct(ns), float(np.mean([d.matched_blocks for d in res])))
                if need_spec:
                    on = routers["on"]
                    ns, res = time_calls(on.select_worker, src, args.calls, args.warmup,
                                         after=on.complete)
                    cell["select+spec"] = (pct(ns),
                                           float(np.mean([d.matched_blocks for d in res])))
            finally:
                gc.enable()
            for mode, (p, matched) in cell.items():
                rows.append((length, n, mode, p, matched))
                print(fmt_row([length, n, mode, f"{p['p50']:.1f}", f"{p['p90']:.1f}",
                               f"{p['p99']:.1f}", f"{p['mean']:.1f}", f"{p['max']:.0f}",
                               "-" if matched != matched else f"{matched:.0f}"],
                              [6, 4, 12, 8, 8, 8, 8, 8, 8]), flush=True)
        if need_spec:
            st = routers["on"].stats()
            print(f"# N={n} spec=on after timing: {st['speculative_entries']:,} speculative "
                  f"entries, {st['distinct_block_keys']:,} keys")
        for r in routers.values():
            r.close()
        del routers, off
        gc.collect()

    print()
    print(f"select_worker latency in microseconds, {args.calls} calls per row "
          f"(index ~{args.index_blocks:,} blocks, block_size {args.block_size}, "
          f"hit_frac {args.hit_frac})")
    hdr = ["tokens", "N", "what", "p50", "p90", "p99", "mean", "max", "matched"]
    widths = [6, 4, 12, 8, 8, 8, 8, 8, 8]
    print(fmt_row(hdr, widths))
    print(fmt_row(["-" * w for w in widths], widths))
    for length, n, mode, p, matched in sorted(rows, key=lambda r: (r[0], r[1])):
        print(fmt_row([length, n, mode, f"{p['p50']:.1f}", f"{p['p90']:.1f}", f"{p['p99']:.1f}",
                       f"{p['mean']:.1f}", f"{p['max']:.0f}",
                       "-" if matched != matched else f"{matched:.0f}"], widths))
    print("matched = mean matched blocks (find_matches: best worker; select: chosen worker)")
    target = [r for r in rows if r[0] == 8192 and r[1] == 64 and r[2].startswith("select")]
    for length, n, mode, p, _ in target:
        verdict = "met" if p["p99"] <= 25.0 else "NOT met"
        print(f"target p99 <= 25 us (8K tokens, 64 workers, {mode}): "
              f"p99 = {p['p99']:.1f} us -> {verdict}")


if __name__ == "__main__":
    main()
