"""`router_from_config`: a `kvroute.Router` from a configuration.

The only module of `kvroute.config` that imports the Router. `Router.from_config` imports
`kvroute.config.loader` (`regular_router_args`), which imports nothing of `kvroute._router`,
so the router and the config models depend one way only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Union

from kvroute._router import Router
from kvroute.config.loader import regular_router_args
from kvroute.config.router_config import RouterConfig


def router_from_config(source: Union[str, Path, Mapping[str, Any], RouterConfig]) -> Router:
    """A `kvroute.Router` built from a configuration (regular mode).

    A ``pd_disaggregation`` config needs one router per pool: ``cfg = load_config(...)``,
    then ``Router(cfg.prefill_workers(), **cfg.prefill_router_kwargs())`` and
    ``Router(cfg.decode_workers(), **cfg.decode_router_kwargs())``. Same as
    `kvroute.Router.from_config`.
    """
    workers, kwargs = regular_router_args(source)
    return Router(workers, **kwargs)
