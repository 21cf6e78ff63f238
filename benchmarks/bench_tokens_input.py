#!/usr/bin/env python
"""What reading the prompt's tokens costs, per container: `kvroute.block_keys` (the binding's
token read, cpp/bindings/convert.h's TokenView, then hashing) on the same ids as a list of
ints, a NumPy uint32 array, an ``array.array('I')``, and optionally a NumPy int64 array or
a list drawn from a pool of shared int objects (``pooled list``).

Each step draws new random ids (Qwen-sized vocabulary) and builds every container from them
outside the timed region; a list is ``ndarray.tolist()``: new int objects, laid out as a
tokenizer's ``Encoding.ids`` hands them over (not a pool of shared ints). The containers are
timed interleaved, their order rotating every step. Reported per pass: each container's p50
and the list's extra cost per token over the uint32 array ((list p50 - uint32 p50) / tokens).

For instruction counts (deterministic, whatever the VM does), run it under callgrind with
``--callgrind`` (fewer calls, no timing) on an unstripped build of ``_core`` (link the
extension without the Release strip step)::

    valgrind --tool=callgrind --toggle-collect='pybind11::cpp_function::dispatcher*' \\
        "$(python -c 'import sys; print(sys.executable)')" \\
        benchmarks/bench_tokens_input.py --callgrind list

and once with ``uint32``: (list total - uint32 total) / (calls x tokens) = instructions per
token of the list read.

Run ``python benchmarks/bench_tokens_input.py`` (~10 s) or ``--quick`` (~2 s).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import array  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_override import preload_core  # noqa: E402

_CORE_PATH = preload_core(sys.argv) if __name__ == "__main__" else None

from kvroute import _core  # noqa: E402

VOCAB = 151_936

# One shared int object per id, for "pooled list": how a list built from such a pool reads
# (its items point all over the heap), against "list" (new ints, laid out in order).
_POOL = np.array(list(range(VOCAB)), dtype=object)

CONTAINERS = {
    "list": lambda a: a.tolist(),
    "pooled list": lambda a: _POOL[a].tolist(),
    "uint32": lambda a: a,
    "array('I')": lambda a: array.array("I", a.tobytes()),
    "int64": lambda a: a.astype(np.int64),
}


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per prompt")
    ap.add_argument("--calls", type=int, default=300, help="timed calls per container and pass")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--containers", default="list,uint32,array('I')",
                    help=f"comma-separated, of {', '.join(CONTAINERS)}")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--core", default=None, help="a saved build of kvroute._core (A/B runs)")
    ap.add_argument("--quick", action="store_true", help="2 passes of 100 calls")
    ap.add_argument("--callgrind", default=None, metavar="CONTAINER",
                    help="no timing: 50 calls on this container, for callgrind")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    bk = _core.block_keys
    if args.callgrind:
        make = CONTAINERS[args.callgrind]
        for _ in range(50):
            bk(make(rng.integers(0, VOCAB, args.tokens, dtype=np.uint32)), args.block_size,
               "", None)
        return
    if args.quick:
        args.calls, args.passes = min(args.calls, 100), min(args.passes, 2)
    names = args.containers.split(",")
    unknown = set(names) - set(CONTAINERS)
    if unknown:
        ap.error(f"unknown --containers {sorted(unknown)}")
    print(f"# {args.tokens} tokens per call, {args.passes} passes x {args.calls} calls per "
          f"container, interleaved; python {sys.version.split()[0]}"
          + (f"; core {_CORE_PATH}" if _CORE_PATH else "") + f"; load average {loadavg()}")
    gc.disable()
    for p in range(args.passes):
        ns: dict[str, list[int]] = {k: [] for k in names}
        for i in range(args.calls):
            a = rng.integers(0, VOCAB, args.tokens, dtype=np.uint32)
            made = {k: CONTAINERS[k](a) for k in names}
            for j in range(len(names)):
                k = names[(i + j) % len(names)]
                t0 = time.perf_counter_ns()
                bk(made[k], args.block_size, "", None)
                ns[k].append(time.perf_counter_ns() - t0)
        p50 = {k: float(np.percentile(v, 50)) / 1e3 for k, v in ns.items()}
        line = ", ".join(f"{k} {v:.2f}" for k, v in p50.items())
        extra = ""
        if "list" in p50 and "uint32" in p50:
            per = (p50["list"] - p50["uint32"]) * 1e3 / args.tokens
            extra = f"; list - uint32 per token {per:.2f} ns"
        print(f"pass {p}: block_keys p50 us: {line}{extra}", flush=True)
    print(f"# load average at end: {loadavg()}")


if __name__ == "__main__":
    main()
