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

Routes (see `kvroute.serving.proxy` for the request path):

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
``protect_metrics``) the admin key.

`create_app` also installs `kvroute.serving.routes.install`: ``x-request-id`` on every
request and response, JSON access-log lines (logger ``kvroute.access``), OpenAI-shaped 404 /
405 errors.

Every proxied response carries ``x-kvroute-worker: <worker name>``; a request with
``x-kvroute-explain: 1`` also gets ``x-kvroute-decision`` (JSON: worker, matched / prompt /
prefill tokens, policy, reason, fallback, degraded, attempts) and ``x-kvroute-scores`` (JSON
list of per-worker ``match``, ``load``, ``score``).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Optional, Union

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvroute._router import Router
from kvroute.serving.auth import Auth, AuthError
from kvroute.serving.proxy import CHAT_PATH, COMPLETIONS_PATH, Proxy, error_response

__all__ = ["create_router", "create_app", "lifespan", "proxy_of"]

_PROXY_ATTR = "kvroute_proxy"
_PUBLIC_ATTR = "kvroute_public"  # create_router's handler of the proxied POST routes


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
        `kvroute.serving.tokenizer.PromptTokenizer` for the engines' model, or ``None`` (then
        only token-id prompts get a prefix match; text routes on load / session key).
    model:
        The engines' served model name (``GET /v1/models`` fallback; other names in requests
        are keyed as LoRA adapters).
    auth:
        `kvroute.serving.auth.Auth` (tenants, their API keys and limits, the admin key), or
        ``None``: every route open.
    **proxy_options:
        `kvroute.serving.proxy.Proxy` keywords, with its defaults: ``upstream_timeout_s``,
        ``connect_timeout_s``, ``max_retries``, ``breaker_failures``, ``breaker_reset_s``,
        ``scrape_metrics_interval_s``, ``scrape_timeout_s``, ``scrape_stale_after_s``
        (seconds), ``orca`` (True / ``"TEXT"`` / ``"JSON"`` / False), ``metrics`` (a
        `RouterMetrics`), ``client`` (an ``httpx.AsyncClient``), ``replicas`` (the config's
        ``replicas`` section: `kvroute.serving.replicas`). An unknown keyword raises
        TypeError.

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

    @contextlib.asynccontextmanager
    async def _lifespan(app: Any) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.aclose()

    api = APIRouter(lifespan=_lifespan)
    setattr(api, _PROXY_ATTR, proxy)
    proxy.auth = auth

    async def public(request: Request, path: str) -> Response:
        if auth is None or not auth.enabled:
            return await proxy.handle(request, path)
        try:
            tenant = auth.tenant_of(request.headers)
            assert tenant is not None
            auth.admit(tenant)
        except AuthError as e:
            proxy.metrics.observe_tenant(e.tenant, e.reason)
            return _refusal(e)
        try:
            resp = await proxy.handle(request, path, tenant)
        except BaseException:
            auth.release(tenant)
            raise

        def done(status: int) -> None:
            auth.release(tenant)
            proxy.metrics.observe_tenant(tenant.name, status)

        return _AfterSend(resp, done)

    setattr(api, _PUBLIC_ATTR, public)

    @api.post(COMPLETIONS_PATH, summary="OpenAI completions, routed by kvroute")
    async def completions(request: Request) -> Response:
        return await public(request, COMPLETIONS_PATH)

    @api.post(CHAT_PATH, summary="OpenAI chat completions, routed by kvroute")
    async def chat_completions(request: Request) -> Response:
        return await public(request, CHAT_PATH)

    from kvroute.serving.routes import PASS_THROUGH

    def _pass_through(path: str) -> Any:
        async def route(request: Request) -> Response:
            return await public(request, path)
        route.__name__ = "pass_through_" + path.strip("/").replace("/", "_")
        return route

    for extra in PASS_THROUGH:
        api.post(extra, summary=f"{extra}, routed by kvroute (pass-through)")(
            _pass_through(extra))

    @api.post("/v1/explain", summary="The routing decision for a request, not forwarded")
    async def explain(request: Request) -> Response:
        if (refused := _admin_refusal(auth, request)) is not None:
            return refused
        return await proxy.explain(request)

    @api.get("/v1/models", summary="Models served by the workers")
    async def models(request: Request) -> Response:
        if auth is not None:
            try:
                auth.tenant_of(request.headers)
            except AuthError as e:
                return _refusal(e)
        return await proxy.models()

    @api.get("/health", summary="200 while some worker can take a request now")
    async def health() -> Response:
        return proxy.health()

    @api.get("/ready", summary="200 once every worker's index is exact or degraded")
    async def ready() -> Response:
        return proxy.ready()

    @api.get("/admin/snapshot", summary="This replica's index snapshot (kvroute.snapshot)")
    async def admin_snapshot(request: Request) -> Response:
        if (refused := _admin_refusal(auth, request)) is not None:
            return refused
        from fastapi.responses import StreamingResponse

        from kvroute.snapshot import aiter_snapshot

        rid = proxy.replicas.replica_id if proxy.replicas is not None else None
        return StreamingResponse(aiter_snapshot(router, rid),
                                 media_type="application/x-kvroute-snapshot")

    @api.get("/metrics", summary="Prometheus metrics (kvroute_*)")
    async def metrics_route(request: Request) -> Response:
        if auth is not None and auth.protect_metrics:
            if (refused := _admin_refusal(auth, request)) is not None:
                return refused
        return proxy.render_metrics()

    @api.get("/workers", summary="Per-worker index, load and circuit state")
    async def workers(request: Request) -> Response:
        if (refused := _admin_refusal(auth, request)) is not None:
            return refused
        return JSONResponse(proxy.workers_view())

    @api.get("/admin/decisions", summary="The most recent routing decisions")
    async def admin_decisions(request: Request, limit: Optional[int] = None,
                              tenant: Optional[str] = None) -> Response:
        if (refused := _admin_refusal(auth, request)) is not None:
            return refused
        log = proxy.decisions
        if log is None:
            return error_response(404, "the decision log is off (decision_log_size: null)")
        return JSONResponse({"size": log.size, "recorded": log.recorded,
                             "decisions": log.entries(limit, tenant)})

    @api.post("/admin/workers", summary="Add a worker at run time")
    async def admin_add_worker(request: Request) -> Response:
        if (refused := _admin_refusal(auth, request, write=True)) is not None:
            return refused
        from kvroute.serving.admin import add_worker, worker_from_json

        try:
            w = add_worker(proxy, worker_from_json(await request.json()))
        except ValueError as e:  # also a body that is not JSON
            return error_response(400, str(e))
        return JSONResponse({"added": w.name, "workers": [x.name for x in router.workers]},
                            status_code=201)

    @api.delete("/admin/workers/{name:path}", summary="Remove a worker at run time")
    async def admin_remove_worker(request: Request, name: str) -> Response:
        if (refused := _admin_refusal(auth, request, write=True)) is not None:
            return refused
        from kvroute.serving.admin import remove_worker

        try:
            remove_worker(proxy, name)
        except KeyError:
            return error_response(404, f"no worker {name!r}; workers: "
                                       f"{[w.name for w in router.workers]}")
        return JSONResponse({"removed": name, "workers": [x.name for x in router.workers]})

    return api


_ERROR_TYPES = {401: "AuthenticationError", 403: "PermissionDeniedError",
                429: "RateLimitError"}


def _refusal(e: AuthError) -> Response:
    return error_response(e.status, e.message, _ERROR_TYPES.get(e.status), headers=e.headers)


def _admin_refusal(auth: Optional[Auth], request: Request,
                   write: bool = False) -> Optional[Response]:
    """The error response for a request to an admin route without the admin key, else None.
    ``write``: a route that changes the router, closed (403) unless an admin key is
    configured."""
    if write and (auth is None or auth.admin_key_sha256 is None):
        return error_response(403, "admin routes that change the router need an admin key "
                                   "(admin: {key_sha256: ...} in the config)",
                              _ERROR_TYPES[403])
    if auth is None:
        return None
    try:
        auth.check_admin(request.headers)
    except AuthError as e:
        return _refusal(e)
    return None


class _FastPath:
    """ASGI middleware: ``POST /v1/completions`` and ``POST /v1/chat/completions`` go straight
    to `create_router`'s handler (the same auth, tenant accounting and `Proxy.handle` as the
    routes), skipping FastAPI's route matching, dependency solving and inner middleware
    (0.80 -> 0.59 ms of kvroute CPU per request at c32, 3 alternating runs of 5 s each, 2
    shared vCPUs); every other request continues down the app.
    Middleware added to the app after `create_app` still runs around it."""

    def __init__(self, app: Any, public: Any) -> None:
        self.app = app
        self.public = public

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path == COMPLETIONS_PATH or path == CHAT_PATH:
                response = await self.public(Request(scope, receive, send), path)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _AfterSend(Response):
    """Sends ``inner`` and then calls ``done(status)``, also when the client went away
    mid-response (a stream ends there): a tenant's in-flight slot lasts as long as its
    response."""

    def __init__(self, inner: Response, done: Any) -> None:  # no super().__init__: a wrapper
        self._inner = inner
        self._done = done
        self.status_code = inner.status_code
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self._inner(scope, receive, send)
        finally:
            self._done(self._inner.status_code)


def proxy_of(api_router: APIRouter) -> Proxy:
    """The `Proxy` behind an ``APIRouter`` made by `create_router` (its breakers, metrics,
    ``workers_view``). Raises ValueError for another router."""
    proxy = getattr(api_router, _PROXY_ATTR, None)
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
    **options: Any,
) -> FastAPI:
    """A FastAPI application serving kvroute from a router configuration.

    Parameters
    ----------
    config:
        A YAML path or a mapping in `kvroute.config`'s shape (``mode: regular``; a
        ``pd_disaggregation`` config is refused). Its ``serving:`` section
        (`kvroute.config.ServingConfig`: model, tokenizer, timeouts, retries, breaker,
        scraping, ORCA) gives the defaults of the arguments below.
    tokenizer:
        A directory holding ``tokenizer.json`` and ``tokenizer_config.json`` (loaded with
        `kvroute.serving.tokenizer.PromptTokenizer.from_dir`), a ready tokenizer, or ``None``.
    model:
        The engines' served model name (see `create_router`).
    config_file:
        The YAML file ``POST /admin/reload`` re-reads; default ``config`` when it is a path
        (without one, reload answers 409).
    **options:
        `create_router` keywords (timeouts, retries, breaker, scraping, ORCA).

    Returns
    -------
    fastapi.FastAPI
        Its lifespan starts the proxy and closes the `kvroute.Router` at shutdown; the
        router is at ``app.state.kvroute_router``, the proxy at ``app.state.kvroute_proxy``,
        the `kvroute.adaptive.AdaptiveCacheWeight` of an ``adaptive_cache_weight`` config at
        ``app.state.kvroute_adaptive`` (else None).

    Raises
    ------
    kvroute.config.ConfigError
        An invalid or prefill/decode configuration.
    FileNotFoundError
        No such config file or tokenizer directory.
    ValueError
        Bad options.
    """
    from kvroute.config import ConfigError, load_config

    cfg = load_config(config)
    # The config's `serving:` section gives the defaults; explicit arguments win.
    options = {**cfg.serving.create_router_kwargs(), **options}
    request_id_headers = options.pop("request_id_headers", None) or ["x-request-id"]
    access_log = options.pop("access_log", True)
    access_log_bodies = options.pop("access_log_bodies", False)
    if tokenizer is None:
        tokenizer = cfg.serving.tokenizer
    if model is None:
        model = cfg.serving.model
    if cfg.is_pd:
        raise ConfigError("kvroute serve routes one pool of workers; this config is "
                          "pd_disaggregation (mode type regular is needed)")
    own_tokenizer = isinstance(tokenizer, (str, Path))
    if own_tokenizer:
        from kvroute.prompt import PromptTokenizer

        tok_dir = Path(tokenizer)
        if not tok_dir.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {tok_dir}")
        tokenizer = PromptTokenizer.from_dir(tok_dir, **cfg.serving.tokenizer_kwargs())
    if "health_check" not in options and cfg.health_check is not None:
        options["health_check"] = cfg.health_check.model_dump()
    if "replicas" not in options and cfg.replicas is not None:
        options["replicas"] = cfg.replicas.model_dump()
    if "response_cache" not in options and cfg.response_cache is not None:
        options["response_cache"] = cfg.response_cache.model_dump()
    if "auth" not in options:  # always one, so a reload can introduce tenants
        options["auth"] = Auth.from_config(cfg) or Auth()
    router = Router(cfg.workers(), **cfg.router_kwargs())
    try:
        api = create_router(router, tokenizer=tokenizer, model=model, **options)
        adaptive_kw = cfg.adaptive_kwargs()
        adaptive = None
        if adaptive_kw is not None:
            from kvroute.adaptive import AdaptiveCacheWeight

            adaptive = AdaptiveCacheWeight(router, **adaptive_kw)  # logs each change
    except BaseException:
        router.close()
        raise

    @contextlib.asynccontextmanager
    async def _close_router(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            router.close()
            if own_tokenizer:
                # close() waits for running tokenizations: not on the event loop.
                await asyncio.to_thread(tokenizer.close)

    app = FastAPI(title="kvroute", summary="KV-cache-aware router for vLLM / SGLang engines",
                  lifespan=_close_router)
    app.include_router(api)
    from kvroute.serving.routes import install

    # Added first, so that install's request-id and access-log middleware wraps it.
    app.add_middleware(_FastPath, public=getattr(api, _PUBLIC_ATTR))
    install(app, request_id_headers=request_id_headers, access_log=access_log,
            access_log_bodies=access_log_bodies)
    app.state.kvroute_router = router
    app.state.kvroute_proxy = proxy_of(api)
    app.state.kvroute_config = cfg
    app.state.kvroute_adaptive = adaptive
    auth: Optional[Auth] = options["auth"]
    reload_lock = asyncio.Lock()
    reload_file = config_file if config_file is not None else (
        config if isinstance(config, (str, Path)) else None)

    @app.post("/admin/reload", summary="Re-read the config file: tenants, workers, policy")
    async def admin_reload(request: Request) -> Response:
        if (refused := _admin_refusal(auth, request, write=True)) is not None:
            return refused
        from kvroute.serving.admin import reload

        if reload_file is None:
            return error_response(409, "the app was not built from a config file: nothing "
                                       "to reload")
        async with reload_lock:
            try:
                new_cfg = load_config(reload_file)
                if new_cfg.is_pd:
                    raise ConfigError("the reloaded config is pd_disaggregation")
                summary = reload(app.state.kvroute_proxy, auth, new_cfg,
                                 app.state.kvroute_config)
            except (ValueError, OSError) as e:  # ConfigError is a ValueError
                return error_response(400, f"config not reloaded: {e}")
            app.state.kvroute_config = new_cfg
        return JSONResponse(summary)

    return app
