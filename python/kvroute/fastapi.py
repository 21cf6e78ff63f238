"""kvroute as a FastAPI router: an OpenAI-compatible proxy in front of vLLM / SGLang engines.

Mount it in your own app::

    import kvroute
    from fastapi import FastAPI
    from kvroute.fastapi import create_router
    from kvroute.prompt import PromptTokenizer

    router = kvroute.Router.from_config("router.yaml")
    app = FastAPI()
    app.include_router(create_router(router, model="Qwen/Qwen3-0.6B",
                                     tokenizer=PromptTokenizer.from_dir("qwen3/")))

``include_router`` also runs the router's lifespan (FastAPI >= 0.112.2), which creates the
shared ``httpx.AsyncClient`` (and the metrics scraper) at startup and closes them at shutdown.
Where the lifespan cannot run (an older FastAPI, a mounted sub-application), enter
``lifespan(api_router)`` from your own lifespan, or let the first request start the proxy.
`create_app` builds the whole application from a configuration file; ``kvroute serve`` runs it
with uvicorn.

Routes (the same in every mode: `kvroute.serving.app.route_table`; the request path:
`kvroute.serving.pipeline`):

=======================  ===============================================================
``POST /v1/completions``       routed and forwarded; SSE streamed chunk by chunk
``POST /v1/chat/completions``  same, tokenized with the model's chat template
``POST /v1/explain``           the decision and every worker's score terms for a completions
                               or chat body, without forwarding it
``POST /v1/embeddings``         pass-through, routed (`kvroute.serving.routes`): also
                               ``/v1/responses``, ``/v1/messages``, ``/v1/rerank``,
                               ``/tokenize``, ``/detokenize``
``GET /v1/models``             the first available worker's answer, else the configured
                               model; 503 with ``Retry-After`` when no worker is available
``GET /health``                200 while some worker can take a request (circuit not open,
                               URL not marked unhealthy), else 503 with ``Retry-After``
``GET /ready``                 200 once every worker's index is exact or explicitly
                               degraded / stale (and a configured bootstrap is over), else
                               503 (`kvroute.serving.replicas`)
``GET /admin/snapshot``        this replica's index, streamed in `kvroute.snapshot`'s format
                               (admin key when configured)
``GET /metrics``               Prometheus text (`kvroute.serving.metrics.RouterMetrics`)
``GET /workers``               per worker: index state, degraded flag, indexed blocks, load,
                               circuit state, scrape staleness (JSON)
``GET /admin/decisions``       the last routing decisions (tenant, worker, score terms)
``POST /admin/workers``        add a worker; ``DELETE /admin/workers/{name}`` removes one
``POST /admin/reload``         re-read the config file (`create_app` only): tenants,
                               workers, ``cache_weight``
=======================  ===============================================================

With tenants configured (`kvroute.serving.auth`) the proxied routes and ``/v1/models`` need a
tenant's API key, and ``/v1/explain``, ``/workers``, ``/admin/*`` (and ``/metrics`` with
``protect_metrics``) the admin key. A prefill/decode configuration gets the same routes over
`kvroute.serving.pd.PDFront`.

`create_app` also installs `kvroute.serving.routes.install`: ``x-request-id`` on every
request and response, JSON access-log lines (logger ``kvroute.access``), OpenAI-shaped 404 /
405 errors.

Every proxied response carries ``x-kvroute-worker: <worker name>``; a request with
``x-kvroute-explain: 1`` that may see it (`kvroute.serving.pipeline.Pipeline.may_explain`:
no auth configured, a tenant with ``explain: true``, or the admin key) also gets
``x-kvroute-decision`` (JSON: worker, matched / prompt /
prefill tokens, policy, reason, fallback, degraded, attempts) and ``x-kvroute-scores`` (JSON
list of per-worker ``match``, ``load``, ``score``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Optional, Union

from fastapi import APIRouter, FastAPI

from kvroute._router import Router
from kvroute.serving.app import PIPELINE_ATTR, build_app, route_table
from kvroute.serving.auth import Auth
from kvroute.serving.pipeline import Pipeline
from kvroute.serving.proxy import Proxy

__all__ = ["create_router", "create_app", "lifespan", "proxy_of"]


def create_router(
    router: Router,
    *,
    tokenizer: Any = None,
    model: Optional[str] = None,
    auth: Optional[Auth] = None,
    **proxy_options: Any,
) -> APIRouter:
    """An ``APIRouter`` with kvroute's OpenAI-compatible routes (see the module docstring).

    Parameters
    ----------
    router:
        The `kvroute.Router` over the engine workers; requests go to ``worker.url + path``.
        The caller keeps ownership (close it after the app stops).
    tokenizer:
        `kvroute.prompt.PromptTokenizer` for the engines' model, or ``None`` (then only
        token-id prompts get a prefix match; text routes on load / session key).
    model:
        The engines' served model name (``GET /v1/models`` fallback; other names in requests
        are keyed as LoRA adapters).
    auth:
        `kvroute.serving.auth.Auth` (tenants, their API keys and limits, the admin key), or
        ``None``: every route open.
    **proxy_options:
        `kvroute.serving.proxy.Proxy` keywords (its defaults: `kvroute.config.ServingConfig`).
        An unknown keyword raises TypeError.

    Returns
    -------
    fastapi.APIRouter
        With a lifespan that starts and closes the proxy; `proxy_of` gives its `Proxy`.

    Raises
    ------
    ValueError
        Bad settings (see `Proxy`).
    """
    proxy = Proxy(router, tokenizer=tokenizer, model=model, **proxy_options)
    return route_table(Pipeline(proxy, auth))


def proxy_of(api_router: APIRouter) -> Proxy:
    """The `Proxy` behind an ``APIRouter`` made by `create_router` (its breakers, metrics,
    ``workers_view``). Raises ValueError for another router."""
    pipeline = getattr(api_router, PIPELINE_ATTR, None)
    proxy = getattr(pipeline, "front", None)
    if not isinstance(proxy, Proxy):
        raise ValueError("expected an APIRouter made by kvroute.fastapi.create_router")
    return proxy


@contextlib.asynccontextmanager
async def lifespan(api_router: APIRouter) -> AsyncIterator[Proxy]:
    """``async with lifespan(api_router):`` starts the router's proxy (HTTP client, scraper)
    and closes it on exit, for apps whose FastAPI does not run included routers' lifespans."""
    proxy = proxy_of(api_router)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.aclose()


def create_app(
    config: Union[str, Path, Mapping[str, Any]],
    *,
    tokenizer: Any = None,
    model: Optional[str] = None,
    config_file: Union[str, Path, None] = None,
    shared_dir: Optional[str] = None,
    process_index: int = 0,
    **options: Any,
) -> FastAPI:
    """A FastAPI application serving kvroute from a router configuration, in its mode: one
    pool (`kvroute.serving.proxy.Proxy`) or prefill/decode (`kvroute.serving.pd.PDFront`),
    with the same routes, tenants, limits and admin API.

    Parameters
    ----------
    config:
        A YAML path, a mapping in `kvroute.config`'s shape, or a `kvroute.config.RouterConfig`.
        Its ``serving:`` section (`kvroute.config.ServingConfig`) gives the defaults of the
        arguments below.
    tokenizer:
        A directory holding ``tokenizer.json`` and ``tokenizer_config.json`` (loaded with
        `kvroute.prompt.PromptTokenizer.from_dir`), a ready tokenizer, or ``None``.
    model:
        The engines' served model name (see `create_router`).
    config_file:
        The YAML file ``POST /admin/reload`` re-reads; default ``config`` when it is a path
        (without one, reload answers 409).
    shared_dir:
        A directory the processes of one ``kvroute serve --workers N`` share: the tenants'
        limits are counted there for the whole server and a reload reaches every process
        (`kvroute.serving.shared_limits`). ``None``: this process alone.
    process_index:
        This process's index among them (0 <= index < 64).
    **options:
        `create_router` keywords (timeouts, retries, breaker, scraping, ORCA, ...).

    Returns
    -------
    fastapi.FastAPI
        Its lifespan starts the front and closes the router(s) at shutdown. State: the
        pipeline at ``app.state.kvroute_pipeline`` and its front at ``kvroute_front``; one
        pool: ``kvroute_router``, ``kvroute_proxy``, ``kvroute_adaptive`` (the
        `kvroute.adaptive.AdaptiveCacheWeight` of an ``adaptive_cache_weight`` config, else
        None); prefill/decode: ``kvroute_pd_router``, ``kvroute_pd_front``.

    Raises
    ------
    kvroute.config.ConfigError
        An invalid configuration, or one asking for a feature its mode cannot honour.
    FileNotFoundError
        No such config file or tokenizer directory.
    ValueError
        Bad options.
    """
    from kvroute.config import load_config
    from kvroute.serving.build import build_front

    cfg = load_config(config)
    built = build_front(cfg, tokenizer=tokenizer, model=model, options=options)
    auth = built.auth
    pipeline = Pipeline(built.front, auth)
    reload_file = config_file if config_file is not None else (
        config if isinstance(config, (str, Path)) else None)
    app = build_app(pipeline, title=built.title, closers=built.close, load=load_config,
                    config=cfg, reload_file=reload_file, access=built.access)
    if shared_dir is not None:
        from kvroute.serving.shared_limits import SharedLimits

        shared = SharedLimits(shared_dir, process_index)
        auth.shared = shared
        auth.on_reload = shared.bump  # type: ignore[attr-defined]

        def reload_here() -> None:
            if reload_file is None:
                return
            new_cfg = load_config(reload_file)
            built.front.reload(auth, new_cfg, app.state.kvroute_config)
            app.state.kvroute_config = new_cfg

        shared.on_generation = reload_here
    app.state.kvroute_front = built.front
    for k, v in built.state.items():
        setattr(app.state, k, v)
    return app
