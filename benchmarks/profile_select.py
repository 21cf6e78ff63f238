#!/usr/bin/env python
"""A fixed number of `select_worker` calls over bench_select.py's index, for instruction counts.

Builds bench_select.py's corpus (``--index-blocks`` distinct blocks, 16-token blocks, shared
system prompts, conversations on 1 / 2 / 4 replicas, seed 0) on ``--workers`` workers, then
makes ``--warmup`` + ``--calls`` selects of ``--length``-token prompts whose first 75 % of
blocks is a stored conversation. Timing is not the point (see bench_select.py): run it under
callgrind, which counts instructions exactly and repeatably whatever the VM is doing::

    valgrind --tool=callgrind --toggle-collect='*Router::Select*' \\
        "$(python -c 'import sys; print(sys.executable)')" benchmarks/profile_select.py
    callgrind_annotate callgrind.out.<pid>

(``sys.executable``, not ``python``: a pyenv shim would be profiled instead of Python.)
Instructions per select = the total over (warmup + calls). For source lines, build the
module with ``-O3 -g`` (RelWithDebInfo with CMAKE_CXX_FLAGS_RELWITHDEBINFO="-O3 -g -DNDEBUG";
pybind11 strips Release builds) and put it first on PYTHONPATH under ``python -S``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_override import preload_core  # noqa: E402

_CORE_PATH = preload_core(sys.argv) if __name__ == "__main__" else None

import bench_select as bs  # noqa: E402

import kvroute  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--length", type=int, default=8192, help="prompt length in tokens")
    ap.add_argument("--index-blocks", type=int, default=1_000_000)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--speculative-ttl", type=float, default=0.0,
                    help="0: no speculative credit (the select mode of bench_select.py)")
    ap.add_argument("--core", default=None,
                    help="a saved build of kvroute._core, e.g. an unstripped one for callgrind")
    a = ap.parse_args()
    args = argparse.Namespace(block_size=16, sys_prompts=16, sys_blocks=64, conv_min=64,
                              conv_max=2048, index_blocks=a.index_blocks, event_blocks=128,
                              era="map", replicas="1:0.7,2:0.2,4:0.1")
    rng = np.random.default_rng(0)
    corpus = bs.build_corpus(args, rng)
    names = [f"w{i}" for i in range(a.workers)]
    router = kvroute.Router(names, block_size=16, speculative_ttl_s=a.speculative_ttl)
    reps = bs.replica_counts(args, len(corpus.convs), rng)
    placement = [rng.choice(a.workers, size=min(int(k), a.workers), replace=False) for k in reps]
    bs.fill(router, names, corpus, placement)
    src = bs.PromptSource(corpus, a.length, 0.75, rng)
    prompts = [src.next()[0] for _ in range(a.warmup + a.calls)]
    select, complete = router.select_worker, router.complete
    for p in prompts:
        complete(select(p))
    st = router.stats()
    print(f"{a.warmup + a.calls} selects of {a.length} tokens; {st['indexed_entries']:,} entries "
          f"on {a.workers} workers")
    router.close()


if __name__ == "__main__":
    main()
