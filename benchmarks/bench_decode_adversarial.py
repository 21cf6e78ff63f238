#!/usr/bin/env python
"""Decode cost per byte and peak memory for valid, invalid and mixed KV-event payloads.

Each case builds one msgpack payload (docs/kv-events.md §3, array batch form) and times
``kvroute._core.decode_batch`` on it (the GIL is released inside; the time includes turning
the decoded batch into Python dicts, which only the valid cases pay for). Cases:

- ``valid``: BlockStored events of 16 blocks x 16 token ids (ids uniform below 2^17, so
  mostly uint32 forms), ~1 MiB: the fast path.
- ``invalid``: one array batch whose events are ~1M one-byte ints (each dropped as
  wrong_type), 1 MiB: the reference decoder, one drop per byte.
- ``mixed``: one valid BlockStored event then 64 one-byte invalid events, repeated, ~1 MiB.
- ``late_invalid``: BlockStored events whose last token id is negative (token_out_of_range,
  found after the event's bytes are read), ~1 MiB.
- ``invalid_16m``: as ``invalid`` at 16 MiB (memory: the reference decoder's tree budget).

For each case: ns per payload byte (best and median of --runs runs) and the peak RSS growth
(VmHWM) of a fresh process decoding it once. Run ``python benchmarks/bench_decode_adversarial.py``
(~1 min on 2 cores); ``--core PATH`` loads another build of ``_core`` to compare.

``--flood N``: instead, a Router with one worker whose publisher (pyzmq PUB, loopback) sends N
``invalid`` 1 MiB payloads; prints the process's RSS before, at its peak while the router
works through them, and 1 s after the last one was handled.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import time

import msgpack

MIB = 1 << 20


def _stored(rng: random.Random, bad_last: bool = False) -> list:
    hashes = [rng.getrandbits(63) for _ in range(16)]
    tokens = [rng.randrange(1 << 17) for _ in range(16 * 16)]
    if bad_last:
        tokens[-1] = -1
    return ["BlockStored", hashes, None, tokens, 16, None, "GPU"]


def payload(case: str) -> bytes:
    rng = random.Random(7)
    if case in ("invalid", "invalid_16m"):
        size = MIB if case == "invalid" else 16 * MIB
        head = b"\x92\xcb" + b"\0" * 8 + b"\xdd"  # [ts, array32 ...]
        n = size - len(head) - 4
        return head + n.to_bytes(4, "big") + b"\x01" * n
    events: list = []
    total = 0
    while total < MIB:
        if case == "valid":
            ev = _stored(rng)
            events.append(ev)
            total += len(msgpack.packb(ev))
        elif case == "late_invalid":
            ev = _stored(rng, bad_last=True)
            events.append(ev)
            total += len(msgpack.packb(ev))
        elif case == "mixed":
            ev = _stored(rng)
            events.append(ev)
            events.extend([1] * 64)
            total += len(msgpack.packb(ev)) + 64
        else:
            raise ValueError(case)
    return msgpack.packb([time.time(), events, None])


def load_core(path: str | None):
    if path is None:
        from kvroute import _core
        return _core
    spec = importlib.util.spec_from_file_location("_core", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def peak_child(case: str, core: str | None) -> None:
    """Runs in a fresh process: prints the VmHWM growth (bytes) of one decode."""
    mod = load_core(core)
    p = payload(case)
    before = vm_hwm_kib()
    _, drops = mod.decode_batch(p)
    after = vm_hwm_kib()
    print(json.dumps({"peak_growth": (after - before) * 1024,
                      "drops": {k: v for k, v in drops.items() if v}}))


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def flood(n: int) -> None:
    import zmq

    from kvroute import Router, Worker

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:0")
    router = Router([Worker("w", kv_endpoint=pub.getsockopt_string(zmq.LAST_ENDPOINT))])
    p = payload("invalid")
    per = len(p) - 15

    def dropped() -> int:
        return router.stats()["workers"]["w"]["dropped"].get("wrong_type", 0)

    while dropped() == 0:  # slow joiner
        pub.send_multipart([b"kv", p])
        time.sleep(0.05)
    base = dropped()
    before = rss_kib()
    peak = before
    for _ in range(n):
        pub.send_multipart([b"kv", p])
    t0 = time.perf_counter()
    while dropped() < base + n * per and time.perf_counter() - t0 < 120:
        peak = max(peak, rss_kib())
        time.sleep(0.01)
    handled_s = time.perf_counter() - t0
    time.sleep(1.0)
    after = rss_kib()
    print(f"flood of {n} x 1 MiB: handled {(dropped() - base) // per} in {handled_s:.1f} s; "
          f"RSS before {before / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB, "
          f"1 s after {after / 1024:.0f} MiB")
    router.close()
    ctx.destroy(linger=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--core", help="path of a _core*.so to load instead of kvroute's")
    ap.add_argument("--cases", default="valid,invalid,mixed,late_invalid,invalid_16m")
    ap.add_argument("--flood", type=int, help="flood a Router with this many 1 MiB payloads")
    ap.add_argument("--peak-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flood:
        flood(args.flood)
        return
    if args.peak_child:
        peak_child(args.peak_child, args.core)
        return
    mod = load_core(args.core)
    print(f"{'case':<14}{'bytes':>10}{'events':>9}{'ns/byte best':>14}{'median':>9}"
          f"{'peak RSS +MiB':>15}  drops")
    for case in args.cases.split(","):
        p = payload(case)
        times = []
        runs = args.runs if len(p) <= 2 * MIB else max(1, args.runs // 2)
        batch = None
        for _ in range(runs):
            t0 = time.perf_counter()
            batch, _drops = mod.decode_batch(p)
            times.append(time.perf_counter() - t0)
        cmd = [sys.executable, __file__, "--peak-child", case]
        if args.core:
            cmd += ["--core", args.core]
        child = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                          text=True).stdout)
        n_events = len(batch["events"]) if batch else 0
        print(f"{case:<14}{len(p):>10}{n_events:>9}{min(times) / len(p) * 1e9:>14.2f}"
              f"{statistics.median(times) / len(p) * 1e9:>9.2f}"
              f"{child['peak_growth'] / MIB:>15.1f}  {child['drops']}")


if __name__ == "__main__":
    main()
