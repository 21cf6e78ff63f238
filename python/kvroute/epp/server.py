"""``kvroute epp``: the endpoint picker's gRPC server (ext_proc + health) beside its HTTP API.

One process, one asyncio event loop:

- gRPC (``--grpc-port``, default 9002 as GAIE's EPP): ``envoy.service.ext_proc.v3.
  ExternalProcessor`` (`kvroute.epp.picker.EndpointPicker`) and ``grpc.health.v1.Health``
  with the services ``liveness`` (SERVING while the process runs), ``readiness`` and
  ``envoy.service.ext_proc.v3.ExternalProcessor`` (SERVING once ``GET /ready`` would answer
  200: every worker's index exact or explicitly degraded, a configured bootstrap over);
- HTTP (``--port``): the route table of ``kvroute serve`` over the same router (``/metrics``,
  ``/health``, ``/ready``, ``/workers``, ``/admin/*``, ``/v1/explain``; the OpenAI routes
  answer there too, through the same router and load accounting).

`check_epp_config` refuses at start-up what the picker cannot honour.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import Any, Callable, Dict, Optional

__all__ = ["EPP_REFUSED", "check_epp_config", "serve_epp", "epp_cmd", "with_endpoints",
           "HEALTH_SERVICES", "load_epp", "build_epp_app", "write_ready"]

log = logging.getLogger("kvroute.epp")

#: The gRPC health services the picker answers (GAIE endpoint picker protocol).
HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")

#: Config keys the endpoint picker cannot honour, with the reason (refused when set).
EPP_REFUSED: Dict[str, str] = {
    "response_cache": "the endpoint picker does not see responses whole; the response cache "
                      "is kvroute serve's",
    "serving.upstream_timeout_s": "the data plane (Envoy) times out upstream requests: set "
                                  "the route's idle_timeout (kvroute gateway writes it)",
    "serving.connect_timeout_s": "the data plane (Envoy) connects to the engines: set the "
                                 "cluster's connect_timeout (kvroute gateway writes it)",
    "serving.first_byte_timeout_s": "the data plane (Envoy) times out upstream requests: set "
                                    "the route's per_try_timeout",
    "serving.retry": "the data plane (Envoy) retries, down the picker's endpoint list: set the "
                     "route's retry_policy (kvroute gateway writes it); serving.max_retries "
                     "sets how many fallback endpoints the picker gives",
}


def _set_keys(cfg: Any) -> set:
    """The config keys given explicitly (``section.key``)."""
    out = set(cfg.model_fields_set)
    serving = getattr(cfg, "serving", None)
    if serving is not None:
        out |= {f"serving.{k}" for k in serving.model_fields_set}
    return out


def check_epp_config(cfg: Any, *, gateway: bool = False) -> None:
    """Raises ConfigError (one line naming the key) for a config the endpoint picker cannot
    honour: prefill/decode mode, a response cache, and (``gateway`` False) the data plane's
    timeouts and retry backoff, which `kvroute.epp.gateway` writes into Envoy's config
    instead. Worker URLs must be ``http://<ip>:<port>`` (checked by the picker)."""
    from kvroute.config import ConfigError

    if cfg.is_pd:
        raise ConfigError("mode: the endpoint picker routes one pool; prefill/decode "
                          "disaggregation is kvroute serve's (GAIE's prefill header "
                          "x-prefiller-host-port is not implemented)")
    asked = _set_keys(cfg)
    if cfg.response_cache is not None:
        asked.add("response_cache")
    # kvroute gateway writes the data plane's timeouts and retries into Envoy's config.
    honoured = {"serving.upstream_timeout_s", "serving.connect_timeout_s",
                "serving.retry"} if gateway else set()
    for key in sorted(EPP_REFUSED):
        if key in asked and key not in honoured:
            if key == "serving.first_byte_timeout_s" and cfg.serving.first_byte_timeout_s is None:
                continue
            raise ConfigError(f"{key}: {EPP_REFUSED[key]}; remove it from the config")


def with_endpoints(source: Any, endpoints_file: str) -> Dict[str, Any]:
    """The config ``source`` (a YAML path or a mapping) with its workers replaced by those of
    an endpoints file (GAIE's standalone mode): YAML or JSON, ``workers:`` a list in the
    config's ``mode.workers`` schema (``url``, ``kv_events``, ``replay``, ``dp_rank``).
    Raises ValueError for a file without such a list."""
    import yaml

    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        with open(source) as f:
            data = yaml.safe_load(f) or {}
    else:
        data = dict(source)
    with open(endpoints_file) as f:
        eps = yaml.safe_load(f)
    if not isinstance(eps, dict) or not isinstance(eps.get("workers"), list) \
            or not eps["workers"]:
        raise ValueError(f"endpoints file {endpoints_file}: needs 'workers:', a non-empty "
                         "list of workers in the config's mode.workers schema")
    mode = dict(data.get("mode") or {"type": "regular"})
    mode.pop("worker_urls", None)
    mode["workers"] = eps["workers"]
    data["mode"] = mode
    return data


async def serve_epp(app: Any, *, host: str, grpc_port: int, http_sock: socket.socket,
                    log_level: str = "info", fallbacks: Optional[int] = None,
                    on_listening: Optional[Callable[[int, int], Any]] = None,
                    on_endpoints: Optional[Callable[[Dict[str, str]], None]] = None,
                    transport: str = "auto",
                    stop: Optional[asyncio.Event] = None) -> None:
    """Serves ``app`` (`kvroute.fastapi.create_app` of a one-pool config) over HTTP on
    ``http_sock`` and its picker over gRPC on ``host:grpc_port`` until SIGINT / SIGTERM.
    Prints one line to stderr with both addresses once listening and calls
    ``on_listening(grpc port, http port)`` (awaited if it returns an awaitable).
    ``on_endpoints(worker name -> ip:port)`` is called when the
    workers change (``POST /admin/workers``, a reload). ``transport``: ``native`` (the C++
    server ``kvroute._epp``), ``python`` (grpcio) or ``auto`` (native when built). Stops, in
    order (HTTP, gRPC with a 5 s grace, the front), on SIGINT / SIGTERM or when ``stop`` is
    set; returns (the signal is not raised again)."""
    import uvicorn

    from kvroute.epp.native import available
    from kvroute.epp.picker import EndpointPicker

    proxy = app.state.kvroute_front
    pipeline = app.state.kvroute_pipeline
    picker = EndpointPicker(proxy, pipeline.auth, fallbacks, on_change=on_endpoints)
    max_msg = (proxy.limits.max_body_bytes or 64 << 20) + (1 << 20)
    if transport == "auto":
        transport = "native" if available() else "python"
    address = f"{host}:{grpc_port}"
    http = _uvicorn_server()(uvicorn.Config(app, log_level=log_level, lifespan="off"))
    loop = asyncio.get_running_loop()

    def shut(*_: Any) -> None:
        http.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shut)
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    if stopper is not None:
        stopper.add_done_callback(shut)
    async with app.router.lifespan_context(app):
        await proxy.start()
        if transport == "native":
            from kvroute.epp.native import NativeTransport

            native = NativeTransport(picker, address, max_msg)
            port = native.port

            async def set_serving(service: str, serving: bool) -> None:
                native.set_serving(service, serving)

            async def stop_grpc(grace_s: float) -> None:
                for s in HEALTH_SERVICES:
                    native.set_serving(s, False)
                await asyncio.to_thread(native.stop, grace_s)
        else:
            from kvroute.epp.grpc_aio import serve_grpc_aio

            port, set_serving, stop_grpc = await serve_grpc_aio(picker, address, max_msg)
        await set_serving("liveness", True)
        await set_serving("", True)
        for s in HEALTH_SERVICES[1:]:
            await set_serving(s, False)
        hport = http_sock.getsockname()[1]
        print(f"kvroute epp: ext_proc on {host}:{port} (gRPC, {transport}), HTTP on "
              f"http://{host}:{hport}, {len(proxy.router.workers)} endpoints",
              file=sys.stderr, flush=True)
        if on_listening is not None:
            out = on_listening(port, hport)
            if asyncio.iscoroutine(out):
                await out

        async def readiness() -> None:
            was = None
            while True:
                ok = proxy.ready().status_code == 200
                if ok != was:
                    for s in HEALTH_SERVICES[1:]:
                        await set_serving(s, ok)
                    log.info("readiness: %s", "SERVING" if ok else "NOT_SERVING")
                    was = ok
                await asyncio.sleep(0.5)

        watcher = asyncio.ensure_future(readiness())
        try:
            await http.serve(sockets=[http_sock])
        finally:
            watcher.cancel()
            if stopper is not None:
                stopper.cancel()
            await stop_grpc(5.0)
            await proxy.aclose()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def load_epp(args: argparse.Namespace, *, gateway: bool = False) -> Dict[str, Any]:
    """The config and options of ``kvroute epp`` / ``kvroute gateway`` from the command
    line: `kvroute.serving.cli_options.serve_options` plus the endpoint file and
    `check_epp_config`. Raises ValueError / OSError (ConfigError is a ValueError)."""
    from kvroute.config import load_config
    from kvroute.serving.cli_options import _config_source, serve_options

    args.prefill = args.decode = args.pd = None
    args.intra_node_data_parallel_size = None
    source = _config_source(args)
    if args.endpoints:
        source = with_endpoints(source, args.endpoints)
    so = serve_options(load_config(source), args)
    check_epp_config(so["config"], gateway=gateway)
    return so


def build_epp_app(so: Dict[str, Any]) -> Any:
    """`kvroute.fastapi.create_app` of the loaded options, refusing worker URLs that are not
    ``ip:port`` (`kvroute.epp.protocol.endpoint_of_url`)."""
    from kvroute.config import ConfigError
    from kvroute.epp.protocol import endpoint_of_url
    from kvroute.fastapi import create_app

    cfg = so["config"]
    for w in cfg.workers():
        try:
            endpoint_of_url(w.url)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return create_app(cfg, tokenizer=so["tokenizer"], model=so["model"],
                      config_file=None, **so["options"])


def _uvicorn_server() -> Any:
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its signal handling: `serve_epp` takes SIGINT / SIGTERM
        itself, so its shutdown runs to the end (uvicorn raises a captured signal again
        after ``serve`` returns, which would kill the process mid-shutdown)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    return Server


def write_ready(path: Optional[str], **ports: int) -> None:
    """Writes ``ports`` as JSON to ``path`` (atomically) when a path is given: how tests and
    scripts learn the ports of a server started on port 0."""
    if not path:
        return
    import json
    import os

    with open(path + ".tmp", "w") as f:
        json.dump(ports, f)
    os.replace(path + ".tmp", path)


def epp_cmd(args: argparse.Namespace) -> int:
    """``kvroute epp``: serves until SIGINT / SIGTERM."""
    from kvroute.serving import logs
    from kvroute.serving.process import _listen_socket, serial_tokenizers, tune_gc

    try:
        so = load_epp(args)
        cfg = so["config"]
        logs.configure(so["log_level"], cfg.serving.access_log, cfg.serving.access_log_file)
        app = build_epp_app(so)
        sock = _listen_socket(so["host"], so["port"])
    except (ValueError, OSError) as e:
        raise SystemExit(f"kvroute epp: {e}") from None
    tune_gc(cfg.serving)
    serial_tokenizers()
    try:
        asyncio.run(serve_epp(app, host=so["host"], grpc_port=args.grpc_port, http_sock=sock,
                              log_level=so["log_level"], fallbacks=args.fallbacks,
                              on_listening=lambda g, h: write_ready(args.ready_file,
                                                                    grpc_port=g, http_port=h),
                              transport=args.transport))
    except KeyboardInterrupt:
        pass
    except (OSError, RuntimeError) as e:  # the gRPC port taken, ...
        raise SystemExit(f"kvroute epp: {e}") from None
    return 0
