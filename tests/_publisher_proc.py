"""A KV-event publisher in its own process, for tests that kill and restart an engine.

    python tests/_publisher_proc.py --endpoint tcp://127.0.0.1:PORT --blocks N --start-hash H

Binds the live socket (an XPUB: on the wire exactly a vLLM PUB, but it sees subscribers),
prints ``ready`` on stdout, waits up to ``--wait-sub`` seconds for a subscriber (so a
reconnecting router does not miss the first batches), then publishes N stored blocks, one per
batch, sequence numbers from 0: block i has engine hash ``H + i``, no parent (each block is a
run of its own, indexable on its own) and tokens ``range(T + i * B, T + (i + 1) * B)`` with
``T = --token-base`` and ``B = --block-size``. After that it publishes an empty batch every
``--interval`` seconds until killed, so a subscriber can see it is alive.
"""

from __future__ import annotations

import argparse
import sys
import time

import zmq

from kvroute import wire


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--start-hash", type=int, required=True)
    ap.add_argument("--token-base", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--topic", default="kv-events")
    ap.add_argument("--era", default="map")
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--wait-sub", type=float, default=5.0,
                    help="seconds to wait for a subscriber before publishing (0: do not wait)")
    a = ap.parse_args(argv)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.XPUB_VERBOSE, 1)
    end = time.monotonic() + 5
    while True:  # the port may still be held by the process we replace
        try:
            sock.bind(a.endpoint)
            break
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > end:
                raise
            time.sleep(0.02)
    print("ready", flush=True)

    if a.wait_sub > 0 and sock.poll(a.wait_sub * 1000, zmq.POLLIN):
        sock.recv()  # a subscription: batches sent from now on reach that subscriber

    topic, bs, seq = a.topic.encode(), a.block_size, 0
    for i in range(a.blocks):
        toks = list(range(a.token_base + i * bs, a.token_base + (i + 1) * bs))
        payload = wire.encode_batch([wire.stored([a.start_hash + i], None, toks, bs)], era=a.era)
        sock.send_multipart(wire.frames(topic, seq, payload))
        seq += 1
    empty = wire.encode_batch([], era=a.era)
    while True:
        time.sleep(a.interval)
        sock.send_multipart(wire.frames(topic, seq, empty))
        seq += 1
        while True:  # discard subscription messages
            try:
                sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break


if __name__ == "__main__":
    sys.exit(main())
