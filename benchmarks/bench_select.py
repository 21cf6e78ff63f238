#!/usr/bin/env python
"""Latency of `Router.select_worker` (and its parts) from Python over a large index.

Fills a Router with ~``--index-blocks`` distinct blocks through `Router.ingest` (real vLLM
map-era payloads encoded by kvroute.wire), with realistic sharing:

* ``--sys-prompts`` shared system prompts of ``--sys-blocks`` blocks;
* conversations: a system prompt plus ``--conv-min`` .. ``--conv-max`` blocks of their own,
  each held by 1, 2 or 4 workers (``--replicas``); a system prompt is stored on every worker
  holding one of its conversations.

Then routes prompts of ``--lengths`` tokens whose first ``--hit-frac`` of blocks is the
prefix of a stored conversation (so the lookup walks that many blocks) followed by fresh
random tokens (a new turn), and times each call with ``time.perf_counter_ns``. No prompt is
timed twice (each has its own fresh tail), and the prefixes come from every stored
conversation long enough, in a seeded random order, each used once before any is used again:
a call is *cold* when its prefix had not been looked up on that router before (its blocks'
slots are not in the CPU caches from an earlier lookup), *warm* when it had. Each mode that
reads the index has a router of its own, so no mode warms another's prefixes.

``--inputs`` picks the token containers, timed interleaved (one new prompt per container
per step, the order rotating every step): ``uint32`` (a NumPy array, read in place),
``list`` (``ndarray.tolist()`` of the prompt, built outside the timed region: fresh int
objects, as a tokenizer's ``Encoding.ids`` hands them over) and ``array('I')``.

* ``block_keys``: `kvroute.block_keys` alone (key computation + binding);
* ``find_matches``: `Router.find_matches` (keys + lookup + a dict of every worker);
* ``select``: `Router.select_worker` with ``speculative_ttl_s=0`` (no insert per decision);
* ``select+spec``: `Router.select_worker` with the default ``speculative_ttl_s=2.0`` (each
  decision inserts its unmatched blocks for the chosen worker; with ``--same-prompts`` the
  runs after the first match the credits the first gave, as a burst of one prompt would);
* ``spec-miss``: the same on a router of its own whose credits last 1 µs, so each decision
  inserts a credit and matches none (the extra hashing and insert of a credit, never its
  walk);
* ``spec-overlap``: the default again, on a router of its own, each timed call preceded by an
  untimed decision of the same prompt that excludes the worker the timed call would choose:
  another worker is credited over the blocks the holder has for real (a burst's request sent
  away from the holder by load), and the timed walk goes through both.

`Router.complete` runs outside the timed region. Prompts are built outside it too.

Reported per row: the p50 and p99 of each pass (min-max over ``--runs`` passes: the
headline, what a caller sees), cold and warm percentiles pooled over the passes, on-CPU
percentiles. ``--same-prompts`` times the same prompts in every pass and adds the
best-of-N "work" table (each prompt's fastest pass: a secondary figure, the code's cost
without the machine's noise, with every pass after the first warm).

Run ``python benchmarks/bench_select.py`` (about 2 min on 2 cores) or ``--quick`` (~10 s).
"""

from __future__ import annotations

import os

# numpy's OpenBLAS threads spin after numpy calls and steal the second core on small boxes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import array  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_override import preload_core  # noqa: E402

_CORE_PATH = preload_core(sys.argv) if __name__ == "__main__" else None

import kvroute  # noqa: E402
import kvroute.wire as ee  # noqa: E402  (engine-faithful vLLM payload encoder)

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
    """Prompts of `length` tokens: a stored conversation's first hit_frac blocks + new tokens.

    The prefixes walk a seeded random permutation of every conversation long enough; each is
    handed out once before any is handed out again. `next()` returns ``(tokens, cold)``,
    ``cold`` True the first time the prefix is handed out. Warm-up calls
    (``next(warm_up=True)``) draw from ``reserve`` conversations of their own, so they use up
    no cold prefix."""

    def __init__(self, corpus: Corpus, length: int, hit_frac: float, rng: np.random.Generator,
                 reserve: int = 32):
        bs = corpus.block_size
        self.length = length
        self.rng = rng
        want = int(round(hit_frac * (length // bs)))
        lens = np.array([len(corpus.sys[s].hashes) + len(c.hashes)
                         for s, c in zip(corpus.conv_sys, corpus.convs)])
        ok = np.flatnonzero(lens >= want)
        if len(ok) == 0:  # nothing that long: use the longest conversations
            ok = np.argsort(lens)[-8:]
        ok = rng.permutation(ok)
        reserve = min(reserve, len(ok) // 2)
        self.warm_up = [corpus.full_tokens(int(i))[:want * bs] for i in ok[:reserve]]
        self.sources = [corpus.full_tokens(int(i))[:want * bs] for i in ok[reserve:]]
        self.i = 0

    def next(self, warm_up: bool = False) -> tuple[np.ndarray, bool]:
        if warm_up and self.warm_up:
            cold, src = False, self.warm_up[int(self.rng.integers(0, len(self.warm_up)))]
        else:
            cold = self.i < len(self.sources)
            k = self.i if cold else int(self.rng.integers(0, len(self.sources)))
            self.i += 1
            src = self.sources[k]
        src = src[:self.length]
        tail = self.rng.integers(0, VOCAB, self.length - len(src), dtype=np.uint32)
        return np.concatenate([src, tail]), cold


class FixedPrompts:
    """The same prompts in the same order on every run (``--same-prompts``), so that each
    prompt's fastest run can be taken: its cost without the machine's noise. Cold only in
    the first run."""

    def __init__(self, src: PromptSource, warm_up: int, count: int):
        self.prompts = ([src.next(warm_up=True) for _ in range(warm_up)]
                        + [src.next() for _ in range(count)])
        self.i = 0
        self.runs = 0

    def rewind(self) -> None:
        self.i = 0
        self.runs += 1

    def next(self, warm_up: bool = False) -> tuple[np.ndarray, bool]:
        p, cold = self.prompts[self.i % len(self.prompts)]
        self.i += 1
        return p, cold and self.runs <= 1


# Token containers (--inputs): built from the uint32 prompt outside the timed region.
INPUTS = {
    "uint32": lambda t: t,
    "list": lambda t: t.tolist(),  # fresh int objects, as a tokenizer returns them
    "array('I')": lambda t: array.array("I", t.tobytes()),
}


# Mode prefixes of select_worker's modes (their results are Decisions, the 12 us target's).
DECIDING = ("select", "spec-")


def credit_elsewhere(router: kvroute.Router):
    """``spec-overlap``'s untimed step before each call: the decision the timed call would
    make is taken with its worker excluded, so another worker is credited with the blocks it
    lacks (from block 0 if it holds none of the prompt), over the blocks the first holds for
    real, as when load sends a request of a burst away from the holder."""
    select, complete = router.select_worker, router.complete

    def before(tokens):
        holder = select(tokens, dry_run=True).worker
        complete(select(tokens, exclude=[holder]))

    return before


@dataclass
class Timed:
    """One input container's timed calls in one pass."""

    wall: np.ndarray  # ns per call
    cpu: np.ndarray  # on-CPU ns per call
    cold: np.ndarray  # bool per call: the prompt's prefix not looked up before on this router
    results: list


def time_calls(fn, prompts, calls: int, warmup: int, inputs: list[str],
               after=None, before=None) -> dict[str, Timed]:
    """Per-call wall and on-CPU nanoseconds of fn(tokens) for every input container,
    interleaved: each step draws one prompt per container and times them in an order that
    rotates every step; `before(tokens)` and `after(result)` run untimed.

    On-CPU time (CLOCK_THREAD_CPUTIME_ID around the wall clock) excludes time the thread
    spent preempted, so it separates kvroute's cost from noise on a shared machine.
    """
    out = {k: Timed(np.empty(calls, dtype=np.int64), np.empty(calls, dtype=np.int64),
                    np.zeros(calls, dtype=bool), []) for k in inputs}
    clock, tclock = time.perf_counter_ns, time.thread_time_ns
    k = len(inputs)
    for i in range(warmup + calls):
        for j in range(k):
            name = inputs[(i + j) % k]
            tok, cold = prompts.next(warm_up=i < warmup)
            arg = INPUTS[name](tok)
            if before is not None:
                before(arg)
            c0 = tclock()
            t0 = clock()
            r = fn(arg)
            t1 = clock()
            c1 = tclock()
            if after is not None:
                after(r)
            if i >= warmup:
                t = out[name]
                t.wall[i - warmup] = t1 - t0
                t.cpu[i - warmup] = c1 - c0
                t.cold[i - warmup] = cold
                t.results.append(r)
    return out


def pct(ns: np.ndarray) -> dict[str, float]:
    us = ns / 1e3
    return {"p50": float(np.percentile(us, 50)), "p90": float(np.percentile(us, 90)),
            "p99": float(np.percentile(us, 99)), "mean": float(us.mean()),
            "max": float(us.max())}


def loadavg() -> str:
    """1/5/15-minute load averages: other work on the machine shows up in the tails."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"


def fmt_row(cols: list, widths: list[int]) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cols, widths))


# -- main ---------------------------------------------------------------------------------
WIDTHS = [6, 4, 12, 10, 11, 11, 7, 7, 5, 7, 7, 6, 7, 7, 7]
HEADER = ["tokens", "N", "what", "input", "p50/pass", "p99/pass", "cold50", "cold99", "cold",
          "warm50", "warm99", "warm", "cpu p50", "cpu p99", "matched"]


def span(xs: list[float]) -> str:
    """min-max of per-pass figures (one figure for one pass)."""
    return f"{min(xs):.1f}-{max(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"


def row(length: int, n: int, mode: str, inp: str, runs: list[Timed], matched: float) -> str:
    p50s = [pct(r.wall)["p50"] for r in runs]
    p99s = [pct(r.wall)["p99"] for r in runs]
    wall = np.concatenate([r.wall for r in runs])
    cold = np.concatenate([r.cold for r in runs])
    c = pct(np.concatenate([r.cpu for r in runs]))

    def part(sel: np.ndarray) -> list[str]:
        if not sel.any():
            return ["-", "-", "0"]
        q = pct(wall[sel])
        return [f"{q['p50']:.1f}", f"{q['p99']:.1f}", str(int(sel.sum()))]

    no_index = mode == "block_keys"  # no router: cold/warm does not apply
    cw = ["-", "-", "-", "-", "-", "-"] if no_index else part(cold) + part(~cold)
    return fmt_row([length, n, mode, inp, span(p50s), span(p99s), *cw, f"{c['p50']:.1f}",
                    f"{c['p99']:.1f}", "-" if matched != matched else f"{matched:.0f}"],
                   WIDTHS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workers", default="8,64,256", help="worker counts, comma-separated")
    ap.add_argument("--lengths", default="1024,8192,32768", help="prompt lengths in tokens")
    ap.add_argument("--index-blocks", type=int, default=1_000_000,
                    help="distinct blocks to index")
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per cell and run")
    ap.add_argument("--warmup", type=int, default=200, help="untimed calls before each cell")
    ap.add_argument("--runs", type=int, default=3,
                    help="passes over every cell (per-pass p50 / p99 min-max shown)")
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
    ap.add_argument("--era", default="map", help="kvroute.wire era of the fill payloads")
    ap.add_argument("--modes",
                    default="block_keys,find_matches,select,select+spec,spec-miss,spec-overlap",
                    help="what to time")
    ap.add_argument("--inputs", default="uint32",
                    help=f"token containers, timed interleaved: {', '.join(INPUTS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--same-prompts", action="store_true",
                    help="time the same prompts in every pass and also print each prompt's "
                         "fastest pass (best-of-N 'work': the code's cost without the "
                         "machine's noise; every pass after the first is warm)")
    ap.add_argument("--keep-gc", action="store_true",
                    help="leave Python's cyclic GC on during timed loops")
    ap.add_argument("--core", default=None,
                    help="a saved build of kvroute._core to measure (A/B runs)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run (< 1 min): 300k blocks, 2 passes of 500 calls")
    args = ap.parse_args()
    if args.quick:
        args.index_blocks = min(args.index_blocks, 300_000)
        args.calls, args.warmup, args.runs = min(args.calls, 500), min(args.warmup, 50), 2
    workers = [int(x) for x in args.workers.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = args.modes.split(",")
    unknown = set(modes) - {"block_keys", "find_matches", "select", "select+spec", "spec-miss",
                            "spec-overlap"}
    if unknown:
        ap.error(f"unknown --modes {sorted(unknown)}")
    inputs = args.inputs.split(",")
    if set(inputs) - set(INPUTS):
        ap.error(f"unknown --inputs {sorted(set(inputs) - set(INPUTS))}; known: {list(INPUTS)}")
    rng = np.random.default_rng(args.seed)

    t0 = time.perf_counter()
    corpus = build_corpus(args, rng)
    print(f"# corpus: {corpus.distinct_blocks:,} distinct blocks, {len(corpus.sys)} system "
          f"prompts x {args.sys_blocks} blocks, {len(corpus.convs)} conversations of "
          f"{args.conv_min}-{args.conv_max} blocks, "
          f"{sum(len(c.payloads) for c in corpus.convs):,} payloads "
          f"({args.event_blocks} blocks/event, era={args.era}); "
          f"encoded in {time.perf_counter() - t0:.1f} s")
    print(f"# kvroute {getattr(kvroute, '__version__', '?')}, numpy {np.__version__}, "
          f"python {sys.version.split()[0]}; {args.runs} pass(es) x {args.calls} timed calls "
          f"per cell and input after {args.warmup} warm-up; inputs {', '.join(inputs)} "
          f"(interleaved); hit_frac={args.hit_frac}; gc "
          f"{'on' if args.keep_gc else 'off'} while timing"
          + (f"; core {_CORE_PATH}" if _CORE_PATH else ""))
    print(f"# load average at start: {loadavg()}")
    print(fmt_row(HEADER, WIDTHS))

    lines = []
    for n in workers:
        names = [f"w{i}" for i in range(n)]
        prng = np.random.default_rng(args.seed + n)
        reps = replica_counts(args, len(corpus.convs), prng)
        placement = [prng.choice(n, size=min(int(k), n), replace=False) for k in reps]
        routers = {"off": kvroute.Router(names, block_size=args.block_size, speculative_ttl_s=0)}
        if "find_matches" in modes:  # its own, so that it warms no prefix select walks
            routers["fm"] = kvroute.Router(names, block_size=args.block_size,
                                           speculative_ttl_s=0)
        if "select+spec" in modes:
            routers["on"] = kvroute.Router(names, block_size=args.block_size)
        if "spec-miss" in modes:
            # Every credit expires within a microsecond, before the next call.
            routers["miss"] = kvroute.Router(names, block_size=args.block_size,
                                             speculative_ttl_s=1e-6)
        if "spec-overlap" in modes:
            routers["overlap"] = kvroute.Router(names, block_size=args.block_size)
        for key, r in routers.items():
            secs = fill(r, names, corpus, placement)
            st = r.stats()
            blocks = sum(w["blocks_stored"] for w in st["workers"].values())
            print(f"# N={n} spec={key}: filled {st['distinct_block_keys']:,} keys / "
                  f"{st['indexed_entries']:,} (block, worker) entries in {secs:.1f} s "
                  f"({blocks / secs / 1e6:.2f} M blocks/s incl. Python loop); "
                  f"index_memory_bytes={st['index_memory_bytes'] / 2**20:.0f} MiB")
        off = routers["off"]
        on = routers.get("on")
        miss = routers.get("miss")
        ovl = routers.get("overlap")
        fns = {
            "block_keys": (lambda t: kvroute.block_keys(t, args.block_size), None),
            "find_matches": (routers["fm"].find_matches if "fm" in routers else None, None),
            "select": (off.select_worker, off.complete),
            "select+spec": (on.select_worker if on else None, on.complete if on else None),
            "spec-miss": (miss.select_worker if miss else None, miss.complete if miss else None),
            "spec-overlap": (ovl.select_worker if ovl else None, ovl.complete if ovl else None),
        }
        befores = {"spec-overlap": credit_elsewhere(ovl) if ovl else None}
        for length in lengths:
            # One prompt source per mode (each mode its own router): cold prefixes first.
            srcs = {}
            for mi, mode in enumerate(modes):
                srcs[mode] = PromptSource(corpus, length, args.hit_frac,
                                          np.random.default_rng([length, mi]))
                if args.same_prompts:
                    srcs[mode] = FixedPrompts(srcs[mode], args.warmup * len(inputs),
                                              args.calls * len(inputs))
            samples: dict[tuple[str, str], list[Timed]] = {
                (m, k): [] for m in modes for k in inputs}
            matched: dict[tuple[str, str], list[float]] = {
                (m, k): [] for m in modes for k in inputs}
            for _ in range(args.runs):
                for mode in modes:
                    fn, after = fns[mode]
                    src = srcs[mode]
                    if args.same_prompts:
                        src.rewind()
                    gc.collect()
                    if not args.keep_gc:
                        gc.disable()
                    try:
                        out = time_calls(fn, src, args.calls, args.warmup, inputs,
                                         after=after, before=befores.get(mode))
                    finally:
                        gc.enable()
                    for k, t in out.items():
                        if mode == "find_matches":
                            matched[mode, k] += [max(m.blocks for m in r.values())
                                                 for r in t.results]
                        elif mode.startswith(DECIDING):
                            matched[mode, k] += [d.matched_blocks for d in t.results]
                        t.results = []
                        samples[mode, k].append(t)
            for mode in modes:
                for k in inputs:
                    ms = matched[mode, k]
                    m = float(np.mean(ms)) if ms else float("nan")
                    line = row(length, n, mode, k, samples[mode, k], m)
                    lines.append((length, n, modes.index(mode), inputs.index(k), line,
                                  samples[mode, k]))
                    print(line, flush=True)
        if on is not None:
            st = on.stats()
            print(f"# N={n} spec=on after timing: {st['speculative_entries']:,} speculative "
                  f"entries, {st['distinct_block_keys']:,} keys, index_memory_bytes="
                  f"{st['index_memory_bytes'] / 2**20:.0f} MiB")
        for r in routers.values():
            r.close()
        del routers, off, on, fns
        gc.collect()

    print(f"# load average at end: {loadavg()}")
    print()
    print(f"Latency in microseconds per call from Python; {args.runs} pass(es) x {args.calls} "
          f"calls per row (index ~{args.index_blocks:,} blocks, block_size {args.block_size}, "
          f"hit_frac {args.hit_frac})")
    print(fmt_row(HEADER, WIDTHS))
    print(fmt_row(["-" * w for w in WIDTHS], WIDTHS))
    for entry in sorted(lines, key=lambda x: x[:4]):
        print(entry[4])
    print("p50/pass, p99/pass: each pass's wall-clock percentile, min-max over the passes "
          "(the headline); cold50/cold99 (cold = count): calls whose prompt prefix had not "
          "been looked up on that router before, pooled over the passes; warm50/warm99 "
          "(warm = count): the others; cpu p50/p99: on-CPU time of the calling thread "
          "(excludes preemption), pooled; matched: mean matched blocks (find_matches: best "
          "worker; select: chosen worker)")
    for length, n, mi, ki, _line, runs in lines:
        mode = modes[mi]
        if length == 8192 and n == 64 and mode.startswith(DECIDING):
            p99s = [pct(r.wall)["p99"] for r in runs]
            cold = np.concatenate([r.cold for r in runs])
            wall = np.concatenate([r.wall for r in runs])
            c99 = f"{pct(wall[cold])['p99']:.1f}" if cold.any() else "-"
            print(f"target p99 <= 12 us per pass (8K tokens, 64 workers, {mode}, "
                  f"{inputs[ki]}): per-pass p99 {span(p99s)} us, cold p99 {c99} us -> "
                  f"{'met' if max(p99s) <= 12.0 else 'NOT met'}")
    if len(inputs) > 1:
        print()
        print("Per-pass p50 ratio to the first input (same mode, same passes):")
        by = {(x[0], x[1], x[2], x[3]): x[5] for x in lines}
        for (length, n, mi, ki), runs in sorted(by.items()):
            if ki == 0:
                continue
            base = by[length, n, mi, 0]
            rs = [pct(r.wall)["p50"] / pct(b.wall)["p50"] for r, b in zip(runs, base)]
            print(f"  {length} tokens, N={n}, {modes[mi]}: {inputs[ki]} / {inputs[0]} = "
                  f"{min(rs):.2f}-{max(rs):.2f}" if len(rs) > 1 else
                  f"  {length} tokens, N={n}, {modes[mi]}: {inputs[ki]} / {inputs[0]} = "
                  f"{rs[0]:.2f}")
    if args.same_prompts and args.runs > 1:
        print()
        print(f"Secondary, best-of-N: each prompt's fastest of {args.runs} passes (wall, "
              "microseconds; passes after the first are warm), then percentiles over the "
              "prompts")
        wh = ["tokens", "N", "what", "input", "p50", "p90", "p99", "max"]
        ww = [6, 4, 12, 10, 7, 7, 7, 7]
        print(fmt_row(wh, ww))
        print(fmt_row(["-" * w for w in ww], ww))
        for length, n, mi, ki, _line, runs in sorted(lines, key=lambda x: x[:4]):
            best = np.min(np.stack([r.wall for r in runs]), axis=0) / 1e3
            q = np.percentile(best, [50, 90, 99])
            print(fmt_row([length, n, modes[mi], inputs[ki], f"{q[0]:.1f}", f"{q[1]:.1f}",
                           f"{q[2]:.1f}", f"{best.max():.0f}"], ww))


if __name__ == "__main__":
    main()
