"""`kvroute` command line.

    kvroute replay   replay a trace through the router and a simulated vLLM fleet, per policy
    kvroute demo     route a few prompts across 4 simulated vLLM publishers on loopback
    kvroute serve    run the OpenAI-compatible router (kvroute.fastapi) with uvicorn
    kvroute doctor   check, engine by engine, that the router will see what each one caches
    kvroute access-log-to-trace   the proxy's access log (with bodies) as an openai-format trace
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

import numpy as np

from kvroute import _core
from kvroute.policies import POLICIES, KvAware, for_name

if TYPE_CHECKING:
    from kvroute.config import RouterConfig

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
    from pathlib import Path
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


def _tokenizer_dir(model_path: Optional[str]) -> Optional[str]:
    """The tokenizer directory ``model_path`` names (the fork's key): the path itself when it
    holds ``tokenizer.json``, else for a Hugging Face id (``org/name``) its snapshot in the
    local Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``);
    nothing is downloaded. None when neither exists."""
    import os
    from pathlib import Path

    if not model_path:
        return None
    p = Path(model_path).expanduser()
    if (p / "tokenizer.json").is_file():
        return str(p)
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    repo = Path(hub) / ("models--" + model_path.replace("/", "--")) / "snapshots"
    for snap in sorted(repo.glob("*"), key=lambda d: d.stat().st_mtime, reverse=True):
        if (snap / "tokenizer.json").is_file():
            return str(snap)
    return None


def serve_options(cfg: RouterConfig, args: argparse.Namespace) -> dict:
    """What ``kvroute serve`` runs with: the command line over the config (its ``serving:``
    section and the vLLM router's server keys) over the defaults. Keys: ``host``, ``port``,
    ``log_level``, ``metrics`` (``(host, port)`` or None), ``tokenizer``, ``model``, and
    ``options`` (`kvroute.fastapi.create_router` keywords)."""
    flags = {"upstream_timeout_s": args.upstream_timeout_s,
             "connect_timeout_s": args.connect_timeout_s,
             "max_retries": args.max_retries, "breaker_failures": args.breaker_failures,
             "breaker_reset_s": args.breaker_reset_s,
             "scrape_metrics_interval_s": args.scrape_interval_s,
             "scrape_stale_after_s": args.scrape_stale_after_s,
             "orca": (None if args.orca is None
                      else False if args.orca == "off" else args.orca.upper())}
    if getattr(args, "disable_retries", False):
        flags["max_retries"] = 0
    options = {k: v for k, v in flags.items() if v is not None}
    cfg = _with_serving_flags(cfg, args)
    if cfg.health_check is not None:
        options["health_check"] = cfg.health_check.model_dump()
    tokenizer = args.tokenizer or cfg.serving.tokenizer
    if tokenizer is None and cfg.model_path is not None:
        tokenizer = _tokenizer_dir(cfg.model_path)
        if tokenizer is None:
            print(f"kvroute serve: model_path {cfg.model_path!r}: no tokenizer.json there nor "
                  "in the local Hugging Face cache; text prompts route without a prefix "
                  "match (pass --tokenizer DIR)", file=sys.stderr)
    metrics = (cfg.metrics.host, cfg.metrics.port) if cfg.metrics is not None else None
    return {
        "host": args.host or cfg.host or "127.0.0.1",
        "port": args.port if args.port is not None else cfg.port if cfg.port is not None
        else 8080,
        "log_level": args.log_level or cfg.log_level or "info",
        "metrics": metrics,
        "tokenizer": tokenizer,
        "model": args.model or cfg.serving.model or cfg.model_path,
        "options": options,
        "config": cfg,
    }


#: ``kvroute serve`` flags that set a key of the config's ``serving:`` section
#: (``dest`` = the key).
_SERVING_FLAGS = ("first_byte_timeout_s", "recovery_ramp_s", "max_body_bytes",
                  "max_prompt_tokens", "chars_per_token", "tokenizer_threads",
                  "long_prompt_chars", "long_prompt_threads", "tokenizer_max_queued",
                  "prefix_cache_tokens", "request_id_headers", "access_log",
                  "access_log_bodies", "gc_threshold", "gc_freeze")
#: ``--retry-<key>`` flags (``dest`` ``retry_<key>``): keys of ``serving.retry``.
_RETRY_FLAGS = ("initial_backoff_ms", "max_backoff_ms", "backoff_multiplier", "jitter_factor",
                "on")
#: ``--health-*`` flags: keys of the ``health_check`` section.
_HEALTH_FLAGS = ("failure_threshold", "success_threshold", "timeout_s", "check_interval_s",
                 "endpoint")


def _with_serving_flags(cfg: RouterConfig, args: argparse.Namespace) -> RouterConfig:
    """``cfg`` with the serve flags that mirror config keys applied (each given flag wins over
    its key; validated as the key is). A ``--health-*`` flag turns the health checks on (the
    section's other keys at their defaults unless the config sets them);
    ``--disable-health-check`` turns them off. Raises ValueError naming the flag's key."""
    from pydantic import ValidationError

    from kvroute.config import HealthCheckConfig, ServingConfig

    serving = {k: getattr(args, k) for k in _SERVING_FLAGS if getattr(args, k, None) is not None}
    if serving.get("max_prompt_tokens") == "none":
        serving["max_prompt_tokens"] = None
    if serving.get("gc_threshold") == "python":
        serving["gc_threshold"] = None
    retry = {"retry_on" if k == "on" else k: getattr(args, "retry_" + k) for k in _RETRY_FLAGS
             if getattr(args, "retry_" + k, None) is not None}
    health = {k: getattr(args, "health_" + k) for k in _HEALTH_FLAGS
              if getattr(args, "health_" + k, None) is not None}
    update: dict = {}
    try:
        if serving or retry:
            data = cfg.serving.model_dump()
            data.update(serving)
            data["retry"] = {**data["retry"], **retry}
            update["serving"] = ServingConfig.model_validate(data)
        if getattr(args, "disable_health_check", False):
            update["health_check"] = None
        elif health:
            base = cfg.health_check.model_dump() if cfg.health_check is not None else {}
            update["health_check"] = HealthCheckConfig.model_validate({**base, **health})
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"
                        for err in e.errors())
        raise ValueError(f"bad flag value: {bad}") from None
    return cfg.model_copy(update=update) if update else cfg


def _doctor_checks(cfg: RouterConfig, tokenizer: Any, model: Optional[str],
                   timeout_s: float) -> list:
    """`kvroute.doctor.run` over a regular-mode config's workers (``tokenizer``: a directory
    or None)."""
    from pathlib import Path

    from kvroute import doctor

    kw = cfg.router_kwargs()
    tok = None
    if tokenizer is not None:
        from kvroute.prompt import PromptTokenizer

        if not Path(tokenizer).is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {tokenizer}")
        tok = PromptTokenizer.from_dir(Path(tokenizer))
    try:
        return doctor.run(cfg.workers(), block_size=kw.get("block_size", 16),
                          topic=kw.get("topic", ""), model=model, tokenizer=tok,
                          timeout_s=timeout_s)
    finally:
        if tok is not None:
            tok.close()


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


def serve_cmd(args: argparse.Namespace) -> int:
    """Runs `kvroute.fastapi.create_app` from a router config with uvicorn until interrupted;
    with a ``metrics`` section, ``GET /metrics`` is served on its own listener too. With
    ``--workers N`` (N > 1), `serve_workers` runs N such processes on one port."""
    workers = getattr(args, "workers", 1) or 1
    if workers < 1:
        raise SystemExit(f"kvroute serve: --workers must be >= 1, got {workers}")
    if workers > 1:
        return serve_workers(args, workers)
    return _serve_one(args)


def _listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (Linux: the kernel spreads
    new connections over every socket bound so, by a hash of the connection's addresses)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def serve_workers(args: argparse.Namespace, n: int) -> int:
    """``kvroute serve --workers N``: N processes (``spawn``, so none inherits the parent's
    threads), each a full replica (its own `kvroute.Router` subscribed to every worker's KV
    events, tokenizer, HTTP pool, circuit breakers and in-flight load accounting), each
    listening on ``host:port`` with ``SO_REUSEPORT``. Port 0 is resolved here first, so the
    replicas share one port. Only the first replica serves the config's ``metrics``
    listener. SIGINT / SIGTERM are passed on to every replica; when one exits, the others are
    stopped and its exit code is returned."""
    import multiprocessing
    import multiprocessing.connection
    import signal

    if not hasattr(socket, "SO_REUSEPORT"):
        raise SystemExit("kvroute serve: --workers needs SO_REUSEPORT (Linux, BSD, macOS)")
    from kvroute.config import load_config

    try:
        so = serve_options(load_config(_config_source(args)), args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"kvroute serve: {e}") from None
    # Holds the port (bound, not listening: it takes no connections) while the replicas bind.
    holder = _listen_socket(so["host"], so["port"])
    port = holder.getsockname()[1]
    # The replicas' shared load (unless the config shares it through Redis or NATS).
    shm = Path("/dev/shm")
    args.replicas_dir = tempfile.mkdtemp(prefix="kvroute-replicas-",
                                         dir=shm if shm.is_dir() and os.access(shm, os.W_OK)
                                         else None)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_serve_replica, args=(args, port, i), name=f"kvroute-serve-{i}")
             for i in range(n)]
    stopping = False

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in procs:
            p.start()
        print(f"kvroute serve: {n} processes on http://{so['host']}:{port} (SO_REUSEPORT)",
              file=sys.stderr, flush=True)
        code = 0
        while True:
            ended = [p for p in procs if p.exitcode is not None]
            if ended:
                break
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=1.0)
        if not stopping:
            print(f"kvroute serve: replica {ended[0].name} exited with {ended[0].exitcode}; "
                  "stopping the others", file=sys.stderr)
            code = ended[0].exitcode or 1
            forward(signal.SIGTERM, None)
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
                p.join()
            if p.exitcode not in (0, None) and not code and not stopping:
                code = p.exitcode
        return code
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        holder.close()
        shutil.rmtree(args.replicas_dir, ignore_errors=True)


#: Seconds between two syncs of `--workers` replicas' shared load through their directory
#: (a sync costs one small file write and a read per peer).
LOCAL_SYNC_INTERVAL_S = 0.02


def local_replicas(cfg: RouterConfig, directory: str) -> Dict[str, Any]:
    """The ``replicas`` options of a ``--workers`` replica: the config's section, with the
    in-flight load shared through ``directory`` unless the section names Redis or NATS (then
    the replicas share it there, with every other router)."""
    base = cfg.replicas.model_dump() if cfg.replicas is not None else {}
    if base.get("redis_url") is None and base.get("nats_url") is None:
        base["local_dir"] = directory
        if cfg.replicas is None or "sync_interval_s" not in cfg.replicas.model_fields_set:
            base["sync_interval_s"] = LOCAL_SYNC_INTERVAL_S
    return base


def _serve_replica(args: argparse.Namespace, port: int, index: int) -> None:
    """One ``--workers`` replica (a spawned process): `_serve_one` on the shared port. Its own
    process group, so a terminal's Ctrl-C reaches the parent alone (which passes it on once);
    it stops itself (SIGTERM, graceful) if the parent dies."""
    import signal
    import threading

    os.setpgrp()
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch_parent, name="kvroute-parent-watch", daemon=True).start()
    sys.exit(_serve_one(args, port=port, replica=index))


def _serve_one(args: argparse.Namespace, *, port: Optional[int] = None,
               replica: Optional[int] = None) -> int:
    """One serving process. ``port`` given: a ``--workers`` replica, listening with
    ``SO_REUSEPORT`` on that port; replica 0 alone serves the metrics listener."""
    import threading

    import uvicorn

    from kvroute.config import load_config
    from kvroute.fastapi import create_app

    try:
        so = serve_options(load_config(_config_source(args)), args)
        cfg: RouterConfig = so["config"]  # with the flags that mirror config keys applied
        from kvroute.serving import logs

        logs.configure(so["log_level"], cfg.serving.access_log,
                       getattr(cfg.serving, "access_log_file", None))
        if not cfg.is_pd and not args.no_doctor and not replica:
            _doctor_warnings(cfg, so)
        if port is not None:
            so["port"] = port
            if replica:
                so["metrics"] = None
        shared: Dict[str, Any] = {}
        if getattr(args, "replicas_dir", None):
            shared = {"shared_dir": args.replicas_dir, "process_index": replica or 0}
            if not cfg.is_pd:
                so["options"]["replicas"] = local_replicas(cfg, args.replicas_dir)
        if cfg.is_pd and args.pd_uncached_token_threshold is not None:
            so["options"]["pd_uncached_token_threshold"] = args.pd_uncached_token_threshold
        # create_app loads its config with load_config, which takes a RouterConfig as is.
        app = create_app(cfg, tokenizer=so["tokenizer"],  # type: ignore[arg-type]
                         model=so["model"], config_file=args.config, **shared,
                         **so["options"])
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        raise SystemExit(f"kvroute serve: {e}") from None
    if args.adaptive_cache_weight and getattr(app.state, "kvroute_adaptive", None) is None:
        # The flag = `adaptive_cache_weight: true`; a config that has the key is tuned already.
        from kvroute.adaptive import AdaptiveCacheWeight

        router = getattr(app.state, "kvroute_router", None)
        if router is None:
            raise SystemExit("kvroute serve: --adaptive-cache-weight tunes one pool's "
                             "cache_weight; not in prefill/decode mode")
        try:
            app.state.kvroute_adaptive = AdaptiveCacheWeight(router)  # logs each change
        except ValueError as e:
            raise SystemExit(f"kvroute serve: --adaptive-cache-weight: {e}") from None
    server = uvicorn.Server(uvicorn.Config(app, host=so["host"], port=so["port"],
                                           log_level=so["log_level"]))
    sockets = None
    if port is not None:
        sock = _listen_socket(so["host"], port)
        sockets = [sock]
    metrics_server, metrics_thread = None, None
    proxy = app.state.kvroute_front  # every front has render_metrics()
    if so["metrics"] is not None and proxy is not None:
        from fastapi import FastAPI
        from fastapi.responses import Response

        metrics_app = FastAPI(title="kvroute metrics")

        @metrics_app.get("/metrics")
        async def metrics_route() -> Response:
            return proxy.render_metrics()

        mhost, mport = so["metrics"]
        metrics_server = uvicorn.Server(uvicorn.Config(metrics_app, host=mhost, port=mport,
                                                       log_level=so["log_level"]))
        # Its own thread and loop: only the main server takes the process's signals.
        metrics_thread = threading.Thread(target=metrics_server.run, name="kvroute-metrics",
                                          daemon=True)
        metrics_thread.start()
    tune_gc(cfg.serving)
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # as uvicorn.run: the captured SIGINT re-raised after shutdown
        pass
    finally:
        if metrics_server is not None and metrics_thread is not None:
            metrics_server.should_exit = True
            metrics_thread.join(10)
    return 0


def _doctor_warnings(cfg: RouterConfig, so: dict) -> None:
    """The doctor's checks at start-up: each failure or warning logged (logger
    ``kvroute.doctor``), never fatal."""
    import logging

    log = logging.getLogger("kvroute.doctor")  # configured by kvroute.serving.logs
    try:
        checks = _doctor_checks(cfg, so["tokenizer"], so["model"], timeout_s=2.0)
    except Exception as e:  # noqa: BLE001 - deliberately never stops the server
        log.warning("the start-up checks did not run: %s: %s", type(e).__name__, e)
        return
    for c in checks:
        if c.status in ("fail", "warn"):
            log.warning("%s: %s: %s; fix: %s", c.worker, c.name, c.detail, c.fix)


def _prompt_tokens_flag(v: str) -> Any:
    """``--max-prompt-tokens``: an int, ``auto`` or ``none`` (no limit)."""
    if v in ("auto", "none"):
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, auto or none, got {v!r}") from None


def _gc_threshold_flag(v: str) -> Any:
    """``--gc-threshold``: three ints ``G0,G1,G2`` or ``python`` (CPython's defaults)."""
    if v == "python":
        return v
    try:
        t = [int(x) for x in v.split(",")]
    except ValueError:
        t = []
    if len(t) != 3:
        raise argparse.ArgumentTypeError(f"expected G0,G1,G2 (three ints) or python, got {v!r}")
    return t


def tune_gc(serving: Any) -> None:
    """The serving process's garbage collector, as ``serving`` (`ServingConfig`) says: the
    thresholds of ``gc.set_threshold`` (``gc_threshold``), then, with ``gc_freeze``, one full
    collection and ``gc.freeze()``: what is alive before serving (the app, the tokenizer, the
    router) moves to the permanent generation, which no collection scans again (the engines'
    servers do the same: vLLM's ``freeze_gc_heap``, SGLang's ``freeze_gc``). The effect on
    CPU per request: benchmarks/README.md, bench_proxy.py."""
    import gc

    if serving.gc_threshold is not None:
        gc.set_threshold(*serving.gc_threshold)
    if serving.gc_freeze:
        gc.collect()
        gc.freeze()


def _config_source(args: argparse.Namespace) -> Any:
    """``--config`` as given, or the configuration the vLLM router's command-line flags
    describe (``--worker-urls``, ``--policy``, ``--vllm-pd-disaggregation`` / ``--pd-
    disaggregation`` with ``--prefill`` and ``--decode``, ``--intra-node-data-parallel-size``);
    the policies get their defaults (cache_aware: the vLLM router CLI's)."""
    if args.config is not None:
        if args.worker_urls or args.prefill or args.decode or args.pd:
            raise ValueError("give --config or the worker flags (--worker-urls, --prefill, "
                             "--decode), not both")
        return args.config
    policy = {"type": args.policy or "cache_aware"}
    if args.pd or args.prefill or args.decode:
        if not (args.prefill and args.decode):
            raise ValueError("prefill/decode disaggregation needs --prefill URL... and "
                             "--decode URL...")
        prefill = [[u, int(p) if p is not None else None] for u, p in args.prefill]
        mode = {"type": "vllm_prefill_decode", "prefill_urls": prefill,
                "decode_urls": list(args.decode)}
    elif args.worker_urls:
        mode = {"type": "regular", "worker_urls": list(args.worker_urls)}
    else:
        raise ValueError("give --config FILE, or the workers: --worker-urls URL... (or "
                         "--vllm-pd-disaggregation --prefill URL [BOOTSTRAP_PORT] --decode URL...)")
    out = {"mode": mode, "policy": policy}
    if args.intra_node_data_parallel_size is not None:
        out["intra_node_data_parallel_size"] = args.intra_node_data_parallel_size
    return out


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
    s.add_argument("--pd-uncached-token-threshold", type=int, default=None,
                   help="prefill/decode: skip the prefill pool when the decode worker would "
                        "prefill at most this many tokens (default: never skip)")
    s.add_argument("--host", default=None, help="default: the config's host, else 127.0.0.1")
    s.add_argument("--port", type=int, default=None,
                   help="default: the config's port, else 8080")
    s.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with tokenizer.json + tokenizer_config.json (the engines' "
                        "model); without it only token-id prompts get a prefix match")
    s.add_argument("--model", default=None, help="the engines' served model name")
    s.add_argument("--upstream-timeout-s", "--upstream-timeout", dest="upstream_timeout_s",
                   type=float, default=None, help="seconds of silence allowed from a worker")
    s.add_argument("--connect-timeout-s", "--connect-timeout", dest="connect_timeout_s",
                   type=float, default=None, help="seconds (default 5)")
    s.add_argument("--max-retries", "--retry-max-retries", dest="max_retries", type=int,
                   default=None,
                   help="next-best workers tried after a failure before any byte reached the "
                        "client (serving.max_retries, default 2)")
    s.add_argument("--disable-retries", action="store_true", help="--max-retries 0")
    s.add_argument("--retry-initial-backoff-ms", type=float, default=None,
                   help="wait before the first retry (serving.retry.initial_backoff_ms, "
                        "default 50)")
    s.add_argument("--retry-max-backoff-ms", type=float, default=None,
                   help="cap on any wait (serving.retry.max_backoff_ms, default 30000)")
    s.add_argument("--retry-backoff-multiplier", type=float, default=None,
                   help="growth of the wait per retry (default 1.5)")
    s.add_argument("--retry-jitter-factor", type=float, default=None,
                   help="relative jitter of the wait, in [0, 1] (default 0.2)")
    s.add_argument("--retry-on", nargs="+", default=None, metavar="KIND",
                   help="failures retried, of: connect timeout 5xx 429 (default all)")
    s.add_argument("--first-byte-timeout-s", "--first-byte-timeout",
                   dest="first_byte_timeout_s", type=float, default=None,
                   help="seconds one attempt waits for the response headers "
                        "(serving.first_byte_timeout_s; default: no bound)")
    s.add_argument("--recovery-ramp-s", "--recovery-ramp", dest="recovery_ramp_s", type=float,
                   default=None, help="seconds over which a recovered worker's share grows "
                                      "from 10 %% to all (default 10; 0: no ramp)")
    s.add_argument("--health-check-interval-s", "--health-check-interval-secs",
                   dest="health_check_interval_s", type=float, default=None,
                   help="probe every worker's health endpoint this often (health_check."
                        "check_interval_s, default 60); any --health-* flag turns the "
                        "health checks on")
    s.add_argument("--health-check-timeout-s", "--health-check-timeout-secs",
                   dest="health_timeout_s", type=float, default=None,
                   help="bound of one probe, seconds (default 5)")
    s.add_argument("--health-failure-threshold", type=int, default=None,
                   help="consecutive failed probes that take a worker out (default 3)")
    s.add_argument("--health-success-threshold", type=int, default=None,
                   help="consecutive good probes that bring it back (default 2)")
    s.add_argument("--health-check-endpoint", dest="health_endpoint", default=None,
                   help="path probed (default /health)")
    s.add_argument("--disable-health-check", action="store_true",
                   help="no health checks, whatever the config says")
    s.add_argument("--max-body-bytes", "--max-payload-size", dest="max_body_bytes", type=int,
                   default=None, help="larger request bodies get 413 (serving.max_body_bytes, "
                                      "default 32 MiB)")
    s.add_argument("--max-prompt-tokens", type=_prompt_tokens_flag, default=None,
                   metavar="N|auto|none",
                   help="longer prompts get 400; auto (default): the workers' max_model_len")
    s.add_argument("--chars-per-token", type=float, default=None,
                   help="prompts over max-prompt-tokens times this many characters get 400 "
                        "before tokenizing (default 16)")
    s.add_argument("--gc-threshold", type=_gc_threshold_flag, default=None,
                   metavar="G0,G1,G2|python",
                   help="the serving process's gc.set_threshold (default 50000,20,100; "
                        "python: CPython's 700,10,10)")
    s.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_const", const=False,
                   default=None, help="no gc.freeze() of the heap built before serving")
    s.add_argument("--tokenizer-threads", type=int, default=None,
                   help="tokenizer threads for ordinary prompts (default: the CPU count)")
    s.add_argument("--long-prompt-chars", type=int, default=None,
                   help="prompts over this many characters go to the long lane (default 65536)")
    s.add_argument("--long-prompt-threads", type=int, default=None,
                   help="threads of the long lane (default: half the CPU count)")
    s.add_argument("--tokenizer-max-queued", type=int, default=None,
                   help="prompts waiting per lane before 503 (default 1024 ordinary, 16 long)")
    s.add_argument("--prefix-cache-tokens", type=int, default=None,
                   help="token ids kept for chat turns that extend an earlier one (0: off; "
                        "default 4194304)")
    s.add_argument("--request-id-headers", nargs="+", default=None, metavar="HEADER",
                   help="header fields a client's request id is read from (default "
                        "x-request-id)")
    s.add_argument("--no-access-log", dest="access_log", action="store_false", default=None,
                   help="no JSON access lines on the kvroute.access logger")
    s.add_argument("--access-log-bodies", action="store_const", const=True, default=None,
                   help="also log completion request bodies (a replay trace's source; the "
                        "lines then hold your users' prompts)")
    s.add_argument("--breaker-failures", type=int, default=None,
                   help="consecutive failures that open a worker's circuit")
    s.add_argument("--breaker-reset-s", "--breaker-reset", dest="breaker_reset_s", type=float,
                   default=None, help="seconds before an open circuit lets a probe through")
    s.add_argument("--scrape-interval-s", "--scrape-interval", dest="scrape_interval_s",
                   type=float, default=None,
                   help="scrape each worker's /metrics every this many seconds (default: off)")
    s.add_argument("--scrape-stale-after-s", "--scrape-stale-after", dest="scrape_stale_after_s",
                   type=float, default=None, help="seconds after which scraped load is forgotten")
    s.add_argument("--orca", default=None, choices=["text", "json", "off"],
                   help="ask workers for vLLM's ORCA load header in this format")
    s.add_argument("--log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="default: the config's log_level, else info")
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
    dr.set_defaults(func=doctor_cmd, worker_urls=None, prefill=None, decode=None, pd=None,
                    upstream_timeout_s=None, connect_timeout_s=None, max_retries=None,
                    breaker_failures=None, breaker_reset_s=None, scrape_interval_s=None,
                    scrape_stale_after_s=None, orca=None, host=None, port=None,
                    log_level=None)

    c = sub.add_parser("access-log-to-trace",
                       help="the proxy's access log (with bodies) as an openai-format trace")
    c.add_argument("log", help="access log file (kvroute.access lines, serving."
                               "access_log_bodies: true)")
    c.add_argument("out", help="trace file to write (JSONL, replay README's openai format)")
    c.set_defaults(func=access_log_cmd)
    for name, sp in (("demo", d), ("serve", s), ("doctor", dr), ("access-log-to-trace", c)):
        def sub_error(message: str, name: str = name) -> NoReturn:
            ap.exit(2, f"kvroute {name}: error: {message} (see kvroute {name} --help)\n")

        sp.error = sub_error  # type: ignore[method-assign]
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        ap.error(f"unknown option {argv[0]!r} before the command; give a command first: "
                 "replay, demo, serve, doctor or access-log-to-trace")
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
