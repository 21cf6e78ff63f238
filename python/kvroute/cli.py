"""`kvroute` command line.

    kvroute demo     route a few prompts across 4 simulated vLLM publishers on loopback
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import Optional, Sequence

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo(args: argparse.Namespace) -> int:
    """Four stand-in engines publish real vLLM-format KV events over ZeroMQ PUB sockets on
    127.0.0.1; the router ingests them on native threads and routes follow-up prompts."""
    import zmq

    from kvroute import Router, Worker, wire

    bs = args.block_size
    rng = np.random.default_rng(args.seed)
    ctx = zmq.Context()
    pubs, workers = [], []
    for i in range(args.workers):
        sock = ctx.socket(zmq.PUB)
        port = _free_port()
        sock.bind(f"tcp://127.0.0.1:{port}")
        pubs.append(sock)
        workers.append(Worker(f"http://127.0.0.1:{8000 + i}", f"tcp://127.0.0.1:{port}"))
    seqs = [0] * len(pubs)

    def publish(i: int, events: list) -> None:
        payload = wire.encode_batch(events, era="map", dp_rank=0)
        pubs[i].send_multipart(wire.frames(b"kv-events", seqs[i], payload))
        seqs[i] += 1

    system = rng.integers(0, 150_000, 8 * bs).tolist()  # a shared system prompt: 8 blocks
    convs = [system + rng.integers(0, 150_000, int(rng.integers(4, 40)) * bs).tolist()
             for _ in range(args.workers * 2)]
    with Router(workers, block_size=bs, cache_weight=args.cache_weight, seed=args.seed) as router:
        deadline = time.monotonic() + 5  # slow joiner: wait until every SUB socket is live
        while time.monotonic() < deadline and any(
                w["batches"] == 0 for w in router.stats()["workers"].values()):
            for i in range(len(pubs)):
                publish(i, [])
            time.sleep(0.02)
        next_hash = 1
        for c, conv in enumerate(convs):  # conversation c's first turn ran on worker c % N
            n = len(conv) // bs
            publish(c % len(pubs), [wire.stored(list(range(next_hash, next_hash + n)), None,
                                                conv[: n * bs], bs)])
            next_hash += n
        while router.stats()["events_applied"] < len(convs):
            time.sleep(0.01)
        print(f"{len(pubs)} workers, block_size {bs}, cache_weight {args.cache_weight}: "
              f"{router.stats()['distinct_block_keys']} blocks indexed from ZeroMQ events\n")
        print(f"{'request':<28}{'worker':<24}{'matched/prompt tokens':>22}{'policy':>12}")
        order = rng.permutation(len(convs))
        for c in order:
            follow_up = convs[c] + rng.integers(0, 150_000, 3 * bs).tolist()
            d = router.select_worker(follow_up)
            print(f"{'turn 2 of conversation ' + str(c):<28}{d.worker:<24}"
                  f"{f'{d.matched_tokens}/{d.prompt_tokens}':>22}{d.policy:>12}")
            router.complete(d)
        fresh = system + rng.integers(0, 150_000, 20 * bs).tolist()
        d = router.select_worker(fresh)
        print(f"{'new chat, same system':<28}{d.worker:<24}"
              f"{f'{d.matched_tokens}/{d.prompt_tokens}':>22}{d.policy:>12}")
        st = router.stats()
        print(f"\nindex: {st['indexed_entries']} (block, worker) entries, "
              f"{st['index_memory_bytes'] / 1024:.0f} KiB; dropped: {st['dropped'] or 'none'}")
    for s in pubs:
        s.close(0)
    ctx.term()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware LLM request router")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="route prompts across simulated vLLM publishers on loopback")
    d.add_argument("--workers", type=int, default=4)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--cache-weight", type=float, default=0.7)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=demo)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
