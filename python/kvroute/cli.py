"""`kvroute` command line.

    kvroute replay   replay a trace through the router and a simulated vLLM fleet, per policy
    kvroute demo     route a few prompts across 4 simulated vLLM publishers on loopback
    kvroute serve    run the OpenAI-compatible router (kvroute.fastapi) with uvicorn
    kvroute doctor   check, engine by engine, that the router will see what each one caches
    kvroute access-log-to-trace   the proxy's access log (with bodies) as an openai-format trace
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from kvroute import _core
from kvroute.policies import POLICIES, KvAware, for_name
from kvroute.serving.cli_options import (
    _config_source,
    _doctor_checks,
    add_serve_flags,
    serve_options,
)
from kvroute.serving.process import serve_cmd

# Flag defaults: the Router's (cpp/router/router.h RouterOptions) and the policy classes'.
_DEFAULTS = _core.RouterOptions()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo(args: argparse.Namespace) -> int:
    """Four stand-in engines publish real vLLM-format KV events over ZeroMQ PUB sockets on
    127.0.0.1; the router ingests them on native threads and routes follow-up prompts."""
    import zmq

    from kvroute import Router, Worker, wire

    try:
        policy = KvAware(cache_weight=args.cache_weight)
    except ValueError as e:
        raise SystemExit(f"kvroute demo: {e}") from None
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
    with Router(workers, policy=policy, block_size=bs, seed=args.seed) as router:
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


def replay_cmd(args: argparse.Namespace) -> int:
    """Replays a trace per policy and prints / writes the comparison table.

    Every argument is checked before the trace is loaded or any policy runs; a bad one ends
    the command with one line on stderr and exit code 2 (as argparse's own errors)."""
    import json
    import math
    from typing import NoReturn

    from kvroute.replay.report import format_table, write_outputs
    from kvroute.replay.runner import replay
    from kvroute.replay.traces import load_trace

    def fail(msg: str) -> NoReturn:
        print(f"kvroute replay: error: {msg}", file=sys.stderr)
        raise SystemExit(2)

    t0 = time.perf_counter()
    for flag, value, low in (("--workers", args.workers, 1), ("--block-size", args.block_size, 1),
                             ("--kv-capacity-blocks", args.kv_capacity_blocks, 1)):
        if value < low:
            fail(f"{flag} must be >= {low}, got {value}")
    if args.limit is not None and args.limit < 1:
        fail(f"--limit must be >= 1 (the number of requests to replay), got {args.limit}; "
             "omit it to replay the whole trace")
    if not (math.isfinite(args.speed) and args.speed > 0):
        fail(f"--speed must be a positive finite number (arrival-rate multiplier), got "
             f"{args.speed:g}")
    if not (0.0 <= args.cache_weight <= 1.0):
        fail(f"--cache-weight must be in [0, 1], got {args.cache_weight:g}")
    if not (math.isfinite(args.event_delay_ms) and args.event_delay_ms >= 0):
        fail(f"--event-delay-ms must be >= 0, got {args.event_delay_ms:g}")
    if not (math.isfinite(args.speculative_ttl_s) and args.speculative_ttl_s >= 0):
        fail(f"--speculative-ttl-s must be >= 0, got {args.speculative_ttl_s:g}")
    engines = None
    if args.engines is not None:
        from kvroute.replay.live import parse_engines

        try:
            engines = parse_engines(args.engines)
        except ValueError as e:
            fail(str(e))
        if args.pd or args.event_delay_ms:
            fail("--engines replays against live engines: --pd and --event-delay-ms do not "
                 "apply")
    if args.jobs is not None and args.jobs < 1:
        fail(f"--jobs must be >= 1, got {args.jobs}")
    if args.pd_threshold is not None and args.pd_threshold < 0:
        fail(f"--pd-threshold must be >= 0, got {args.pd_threshold}")
    if args.adaptive_cache_weight and args.pd is not None:
        fail("--adaptive-cache-weight tunes one pool's cache_weight; not with --pd")
    policies = [p.strip() for p in args.policies.split(",")]
    if not any(policies):
        fail(f"--policies is empty; give a comma-separated list of: {', '.join(POLICIES)}")
    if not all(policies):
        fail(f"--policies {args.policies!r} has an empty name")
    pd = None
    if args.pd:
        try:
            np_, nd = (int(x) for x in args.pd.split(":"))
        except ValueError:
            fail(f"--pd expects P:D (two worker counts), got {args.pd!r}")
        if np_ < 1 or nd < 1:
            fail(f"--pd needs at least one prefill and one decode worker, got {args.pd!r}")
        pd = dict(prefill_workers=np_, decode_workers=nd, decode_policy=args.decode_policy,
                  pd_uncached_token_threshold=args.pd_threshold)
    for name in policies + ([args.decode_policy] if args.pd else []):
        if name not in POLICIES:
            fail(f"unknown policy {name!r}; choose from: {', '.join(POLICIES)}")
        try:  # the policy objects check their own parameters (--cache-weight)
            for_name(name, {"cache_weight": args.cache_weight})
        except ValueError as e:
            fail(f"policy {name}: {e}")
    try:
        builtin = args.trace in (None, "synthetic", "bursts", "mooncake", "mt_bench", "mt-bench")
        if builtin and (args.format != "auto" or args.tokenizer is not None):
            fail("--format and --tokenizer apply to a --trace file only")
        file_kw: dict = {} if builtin else {"format": args.format}
        if args.tokenizer is not None:
            file_kw["tokenizer_dir"] = args.tokenizer
        trace = load_trace(args.trace, data_dir=args.data_dir, limit=args.limit, **file_kw)
    except (OSError, ValueError) as e:
        fail(str(e))
    if not trace.requests:
        fail(f"trace {trace.name!r} has no requests")
    if args.speed != 1.0:
        trace = trace.scaled(args.speed)
    n_tokens = sum(len(r.tokens) for r in trace.requests)
    bound = trace.infinite_cache_hit_rate(args.block_size)
    label = " (SYNTHETIC)" if trace.synthetic else ""
    print(f"trace {trace.name}{label}: {len(trace.requests)} requests, {n_tokens:,} prompt tokens,"
          f" {trace.requests[-1].arrival_s:.0f} s of arrivals (speed x{args.speed})")
    if engines is None:
        print(f"fleet: {args.workers} simulated vLLM workers, {args.kv_capacity_blocks} blocks "
              f"of {args.block_size} tokens each, events over ZeroMQ ({args.era} era), "
              f"event delay {args.event_delay_ms} ms, speculative TTL "
              f"{args.speculative_ttl_s} s; cache_weight {args.cache_weight}, seed {args.seed}")
    print(f"infinite-cache bound (one shared cache of unlimited size): {bound:.1%}")
    pooled = (pd["prefill_workers"] + pd["decode_workers"] if pd is not None
              else len(engines) if engines is not None else args.workers)
    cap_bound = trace.capacity_bound_hit_rate(args.block_size,
                                              pooled * args.kv_capacity_blocks)
    print(f"capacity bound (optimal offline eviction, Belady, over the fleet's {pooled} x "
          f"{args.kv_capacity_blocks} blocks pooled as one cache; no routing does better): "
          f"{cap_bound:.1%}\n")
    if pd is not None:
        print(f"PD mode: {np_} prefill + {nd} decode workers, decode policy {args.decode_policy}, "
              f"threshold {args.pd_threshold}; 'captured' column = share that skipped prefill")
    if engines is not None:
        from kvroute.replay.live import run_live

        print(f"live: {len(engines)} engines ({', '.join(e.url for e in engines)}); wall-clock "
              "times; 'hit rate' = the engines' cached_tokens, 'predicted' = the router's "
              "match; the engines' caches carry over from one policy to the next\n")
        try:
            results = [run_live(trace, p, engines, cache_weight=args.cache_weight,
                                block_size=args.block_size, model=args.model, seed=args.seed)
                       for p in policies]
        except (RuntimeError, OSError) as e:
            fail(str(e))
    else:
        results = replay(trace, policies, progress=not args.no_progress, pd=pd,
                         jobs=args.jobs, workers=args.workers, cache_weight=args.cache_weight,
                         kv_capacity_blocks=args.kv_capacity_blocks,
                         block_size=args.block_size, seed=args.seed, era=args.era,
                         event_delay_s=args.event_delay_ms / 1000.0,
                         speculative_ttl_s=args.speculative_ttl_s,
                         **({"size_aware": True} if args.size_aware else {}),
                         **({"adaptive": {}} if args.adaptive_cache_weight else {}))
    print(format_table(results, capacity_bound=cap_bound))
    out = Path(args.out or f"out/replay-{trace.name}")
    meta = {"trace": trace.name, "synthetic": trace.synthetic, "description": trace.description,
            "requests": len(trace.requests), "workers": args.workers,
            "cache_weight": args.cache_weight, "kv_capacity_blocks": args.kv_capacity_blocks,
            "block_size": args.block_size, "speed": args.speed, "seed": args.seed,
            "event_delay_ms": args.event_delay_ms, "speculative_ttl_s": args.speculative_ttl_s,
            "adaptive_cache_weight": bool(args.adaptive_cache_weight),
            "size_aware": bool(args.size_aware),
            "infinite_cache_bound": bound, "capacity_bound": cap_bound,
            "wall_s": time.perf_counter() - t0}
    if engines is not None:  # live: every result is a wall-clock measurement
        meta.update(workers=len(engines), engines=[e.url for e in engines])
    paths = write_outputs(results, out, meta)
    print(f"\ninfinite-cache bound {bound:.1%}, capacity bound {cap_bound:.1%}; "
          f"took {meta['wall_s']:.0f} s; wrote "
          + ", ".join(str(p) for p in paths))
    if args.json:
        print(json.dumps(meta))
    return 0


def access_log_cmd(args: argparse.Namespace) -> int:
    """Converts the proxy's access log (``serving.access_log_bodies: true``) into an
    openai-format trace file (`kvroute.replay.traces.access_log_to_openai`)."""
    import json

    from kvroute.replay.traces import access_log_to_openai

    def fail(msg: str) -> int:
        print(f"kvroute access-log-to-trace: error: {msg}", file=sys.stderr)
        return 2

    try:
        with open(args.log, encoding="utf-8", errors="replace") as f:
            records, skipped = access_log_to_openai(f)
    except OSError as e:
        return fail(str(e))
    if not records:
        return fail(f"{args.log}: no completion request with a logged body "
                    f"(skipped: {skipped}); run the proxy with serving.access_log_bodies: true")
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    except OSError as e:
        return fail(str(e))
    print(f"wrote {len(records)} requests to {args.out}; skipped {skipped}")
    return 0


def doctor_cmd(args: argparse.Namespace) -> int:
    """``kvroute doctor``: every check of `kvroute.doctor` per worker, printed; exit code 1
    when one failed, 2 for a configuration that does not load."""
    import json

    from kvroute import doctor
    from kvroute.config import load_config

    try:
        cfg = load_config(_config_source(args))
        if cfg.is_pd:
            raise ValueError("kvroute doctor checks a regular-mode configuration (one pool)")
        so = serve_options(cfg, args)
        checks = _doctor_checks(cfg, so["tokenizer"], so["model"], args.timeout_s)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvroute doctor: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([c.as_dict() for c in checks], indent=1))
    else:
        print(doctor.format_report(checks))
    return doctor.exit_code(checks)


class _PrefillAction(argparse.Action):
    """``--prefill URL [BOOTSTRAP_PORT]`` (repeatable), or several URLs after one flag as the
    vLLM router's published scripts write them: ``--prefill http://p1:8000 http://p2:8000``."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None
                 ) -> None:
        items = getattr(namespace, self.dest) or []
        vals = list(values)
        if len(vals) == 2 and vals[1].isdigit():
            items.append((vals[0], vals[1]))
        else:
            for v in vals:
                if v.isdigit():
                    if not items:
                        parser.error(f"{option_string}: a bootstrap port needs a URL first")
                    items[-1] = (items[-1][0], v)
                else:
                    items.append((v, None))
        setattr(namespace, self.dest, items)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        ap.error(f"unknown option {argv[0]!r} before the command; give a command first: "
                 "replay, demo, serve, epp, gateway, doctor or access-log-to-trace")
    args = ap.parse_args(argv)
    return args.func(args)


def parser() -> argparse.ArgumentParser:
    """The ``kvroute`` command line (every subcommand)."""
    ap = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware LLM request router")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replay", help="replay a trace through the router and a simulated fleet")
    r.add_argument("--trace", default=None,
                   help="'synthetic' (default), 'bursts', 'mooncake', 'mt_bench', or a JSONL "
                        "trace file (python/kvroute/replay/README.md: mooncake, token-id or "
                        "OpenAI-format request log)")
    r.add_argument("--format", default="auto", choices=["auto", "mooncake", "tokens", "openai"],
                   help="format of a --trace file (default: detected from its first line)")
    r.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="openai format: the engines' model tokenizer (tokenizer.json + "
                        "tokenizer_config.json; default <data dir>/tokenizers/qwen3)")
    r.add_argument("--data-dir", default=None,
                   help="the shared data directory, for the mooncake and mt_bench traces "
                        "(default: $KVROUTE_SHARED_DATA)")
    r.add_argument("--workers", type=int, default=8)
    r.add_argument("--policies", default="kv_aware,round_robin,power_of_two",
                   help=f"comma-separated, of: {', '.join(POLICIES)}")
    r.add_argument("--cache-weight", type=float, default=KvAware.cache_weight,
                   help="for the policies that have one (default %(default)s)")
    r.add_argument("--size-aware", action="store_true",
                   help="kv_aware with Dynamo's size-aware load and match credit at full "
                        "weight at every load (kvroute.policies.KvAware.size_aware)")
    r.add_argument("--adaptive-cache-weight", action="store_true",
                   help="tune cache_weight online from --cache-weight on "
                        "(kvroute.adaptive.AdaptiveCacheWeight); not with --pd")
    r.add_argument("--kv-capacity-blocks", type=int, default=29_205)
    r.add_argument("--block-size", type=int, default=_DEFAULTS.index.block_size)
    r.add_argument("--speed", type=float, default=1.0, help="arrival-rate multiplier")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--limit", type=int, default=None, help="first N requests only")
    r.add_argument("--era", default="map", choices=["map", "array_full"], help="event encoding")
    r.add_argument("--event-delay-ms", type=float, default=0.0,
                   help="live mode: virtual delay before a step's events reach the router")
    r.add_argument("--speculative-ttl-s", "--speculative-ttl", dest="speculative_ttl_s", type=float,
                   default=_DEFAULTS.speculative_ttl_s,
                   help="seconds (virtual) a decision credits its worker with the prompt's new "
                        "blocks; 0 = off (default %(default)s)")
    r.add_argument("--pd", default=None, metavar="P:D",
                   help="disaggregated mode: P prefill and D decode workers (each policy in "
                        "--policies routes the prefill pool)")
    r.add_argument("--decode-policy", default="consistent_hash", help="PD mode: decode pool policy")
    r.add_argument("--pd-threshold", type=int, default=None,
                   help="PD mode: skip prefill when the decode worker would compute at most "
                        "this many tokens")
    r.add_argument("--out", default=None, help="output directory (default out/replay-<trace>)")
    r.add_argument("--jobs", type=int, default=None,
                   help="policies replayed at once, one process each (default: the number of "
                        "policies, at most twice the CPU count; 1 = one after the other)")
    r.add_argument("--engines", default=None, metavar="URL@KV_ENDPOINT,...",
                   help="replay against live OpenAI-compatible engines publishing KV events "
                        "(e.g. http://h:8000@tcp://h:5557) instead of the simulated fleet; "
                        "reports the engines' cached_tokens beside the router's prediction")
    r.add_argument("--model", default=None,
                   help="--engines: the model name sent in each request (default: none, the "
                        "engine's)")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--json", action="store_true", help="also print run metadata as JSON")
    r.set_defaults(func=replay_cmd)
    from typing import NoReturn

    def replay_usage_error(message: str) -> NoReturn:  # one line, exit code 2, as replay_cmd's
        r.exit(2, f"kvroute replay: error: {message} (see kvroute replay --help)\n")

    r.error = replay_usage_error  # type: ignore[method-assign]

    def usage_error(message: str) -> NoReturn:  # one line, exit code 2, as the subcommands'
        ap.exit(2, f"kvroute: error: {message} (see kvroute --help)\n")

    ap.error = usage_error  # type: ignore[method-assign]
    d = sub.add_parser("demo", help="route prompts across simulated vLLM publishers on loopback")
    d.add_argument("--workers", type=int, default=4)
    d.add_argument("--block-size", type=int, default=_DEFAULTS.index.block_size)
    d.add_argument("--cache-weight", type=float, default=KvAware.cache_weight,
                   help="kv_aware's cache_weight, in [0, 1] (default %(default)s)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=demo)
    s = sub.add_parser("serve", help="run the OpenAI-compatible router in front of the workers")
    s.add_argument("--config", default=None,
                   help="router YAML (kvroute.config; regular or prefill/decode); its serving: "
                        "section and "
                        "the vLLM router's server keys (host, port, log_level, metrics, "
                        "health_check, model_path) give the defaults of the flags below "
                        "(examples/router.yaml)")
    s.add_argument("--worker-urls", nargs="+", default=None, metavar="URL",
                   help="instead of --config: the workers (the vLLM router's flag)")
    s.add_argument("--policy", default=None, choices=list(POLICIES),
                   help="with the worker flags: the policy (default cache_aware, as the vLLM "
                        "router; its parameters at their defaults)")
    s.add_argument("--vllm-pd-disaggregation", "--pd-disaggregation", dest="pd",
                   action="store_true",
                   help="with --prefill and --decode: prefill/decode disaggregation")
    s.add_argument("--prefill", nargs="+", action=_PrefillAction, default=None,
                   metavar="URL", help="prefill workers: URL [BOOTSTRAP_PORT], repeatable, or "
                                       "several URLs")
    s.add_argument("--decode", nargs="+", default=None, metavar="URL", help="decode workers")
    s.add_argument("--intra-node-data-parallel-size", type=int, default=None,
                   help="with the worker flags: data-parallel ranks per worker URL")
    # Every flag that sets a config key: the table of kvroute.serving.cli_options.
    add_serve_flags(s)
    s.add_argument("--adaptive-cache-weight", action="store_true",
                   help="tune cache_weight and speculative_ttl_s online from the engines' "
                        "delivered prefix hits and the workers' queues (kvroute.adaptive, "
                        "logged on kvroute.adaptive); the same as the config key "
                        "adaptive_cache_weight: true, whose mapping form sets its parameters")
    s.add_argument("--no-doctor", action="store_true",
                   help="skip the start-up checks of kvroute doctor (each engine sees one "
                        "1-token probe request)")
    s.add_argument("--workers", type=int, default=1,
                   help="serving processes on the one port (SO_REUSEPORT), each a full "
                        "router replica subscribed to every worker (default 1)")
    s.set_defaults(func=serve_cmd)

    e = sub.add_parser("epp", help="serve the router as a Gateway API Inference Extension "
                                   "endpoint picker (Envoy ext_proc over gRPC)")
    from kvroute.epp.cli import add_epp_parsers

    g = add_epp_parsers(sub, e, add_serve_flags)
    dr = sub.add_parser("doctor", help="check, engine by engine, that the router will see "
                                       "what each one caches (exit code 1 on a failure)")
    dr.add_argument("--config", required=True, help="router configuration (YAML)")
    dr.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="the router's tokenizer (default: the config's serving.tokenizer "
                         "or model_path)")
    dr.add_argument("--model", default=None, help="the engines' served model name")
    dr.add_argument("--timeout-s", type=float, default=3.0,
                    help="seconds to wait for a probe's KV events, per engine")
    dr.add_argument("--json", action="store_true", help="print the checks as JSON")
    # the serve flags it does not declare are not given (serve_options: the config's keys)
    dr.set_defaults(func=doctor_cmd, worker_urls=None, prefill=None, decode=None, pd=None)

    c = sub.add_parser("access-log-to-trace",
                       help="the proxy's access log (with bodies) as an openai-format trace")
    c.add_argument("log", help="access log file (kvroute.access lines, serving."
                               "access_log_bodies: true)")
    c.add_argument("out", help="trace file to write (JSONL, replay README's openai format)")
    c.set_defaults(func=access_log_cmd)
    for name, sp in (("demo", d), ("serve", s), ("epp", e), ("gateway", g), ("doctor", dr),
                     ("access-log-to-trace", c)):
        def sub_error(message: str, name: str = name) -> NoReturn:
            ap.exit(2, f"kvroute {name}: error: {message} (see kvroute {name} --help)\n")

        sp.error = sub_error  # type: ignore[method-assign]
    return ap


if __name__ == "__main__":
    sys.exit(main())
