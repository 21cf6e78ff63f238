"""The ``kvroute serve`` processes: one uvicorn server per process, ``--workers N`` of them on
one port (``SO_REUSEPORT``), their shared directory, logging, the garbage collector.

`serve_cmd` is what ``kvroute serve`` runs (`kvroute.cli`). Each process configures kvroute's
loggers (`kvroute.serving.logs`), builds `kvroute.fastapi.create_app` from the config with the
command line applied (`kvroute.serving.cli_options.serve_options`) and serves it; with
``--workers N`` the processes share a directory in ``/dev/shm`` for their in-flight load
(`kvroute.serving.shared_load`) and their tenants' limits and reloads
(`kvroute.serving.shared_limits`).
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
from typing import TYPE_CHECKING, Any, Dict, Optional

from kvroute.serving.cli_options import _config_source, _doctor_checks, serve_options

if TYPE_CHECKING:
    from kvroute.config import RouterConfig

__all__ = ["serve_cmd", "tune_gc", "serial_tokenizers", "local_replicas"]


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
    # (a prefill/decode config has no replicas section: build.py refuses one)
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

        logs.configure(so["log_level"], cfg.serving.access_log, cfg.serving.access_log_file)
        if not cfg.is_pd and not args.no_doctor and not replica:
            _doctor_warnings(cfg, so)
        if port is not None:
            so["port"] = port
            if replica:
                so["metrics"] = None
        shared: Dict[str, Any] = {}
        if getattr(args, "replicas_dir", None):
            shared = {"shared_dir": args.replicas_dir, "process_index": replica or 0}
            so["options"]["replicas"] = local_replicas(cfg, args.replicas_dir)
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
    serial_tokenizers()
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


def serial_tokenizers() -> None:
    """Unless the environment says otherwise, ``TOKENIZERS_PARALLELISM=false`` for this
    serving process: the Hugging Face tokenizer then encodes each prompt on the calling thread
    instead of handing it to its rayon pool and waiting (a server encodes one prompt per call,
    and kvroute's own thread pools give the concurrency). Measured on this project's 2-vCPU
    machine, one CPU, a 25-token chat segment of the Qwen3 tokenizer: 51 -> 35 us of CPU per
    ``encode_batch_fast`` call."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
