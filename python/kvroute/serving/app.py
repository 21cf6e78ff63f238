"""The one route table of every front, and the application around it.

`route_table` gives the same routes in every mode (the OpenAI proxy, prefill/decode); a
feature a mode cannot honour is refused when the app is built (`kvroute.fastapi.create_app`),
never ignored. Access:

=========================  ===========================  =====================================
route                      who                          what
=========================  ===========================  =====================================
``POST /v1/completions``,  a tenant key (open without   the request pipeline
``/v1/chat/completions``,  tenants)                     (`kvroute.serving.pipeline`)
pass-through routes
``GET /v1/models``         a tenant key                 the first worker up's answer
``POST /v1/explain``       the admin key                the decision, not forwarded
``GET /health``            open                         200 while a request can be served
``GET /ready``             open                         200 once every index is trusted
``GET /metrics``           open, or the admin key       Prometheus text
                           (``protect_metrics``)
``GET /workers``           the admin key                per worker: index, load, circuit
``GET /admin/decisions``   the admin key                the last decisions, by request id
``GET /admin/snapshot``    the admin key                the index (``?pool=`` in PD mode)
``POST /admin/workers``,   an admin key must be         add / remove a worker
``DELETE /admin/...``      configured, and presented
``POST /admin/reload``     as above                     re-read the config file
=========================  ===========================  =====================================
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvroute.serving.common import CHAT_PATH, COMPLETIONS_PATH, error_response
from kvroute.serving.pipeline import Pipeline
from kvroute.serving.routes import PASS_THROUGH

__all__ = ["route_table", "FastPath", "build_app"]

PIPELINE_ATTR = "kvroute_pipeline"


def route_table(pipeline: Pipeline) -> APIRouter:
    """An ``APIRouter`` with every route of the table above, over ``pipeline``'s front. Its
    lifespan starts and closes the front."""
    front = pipeline.front

    @contextlib.asynccontextmanager
    async def _lifespan(app: Any) -> AsyncIterator[None]:
        await front.start()
        try:
            yield
        finally:
            await front.aclose()

    api = APIRouter(lifespan=_lifespan)
    setattr(api, PIPELINE_ATTR, pipeline)

    def _proxied(path: str) -> Any:
        async def route(request: Request) -> Response:
            return await pipeline.run(request, path)
        route.__name__ = "proxied_" + path.strip("/").replace("/", "_")
        return route

    api.post(COMPLETIONS_PATH, summary="OpenAI completions, routed by kvroute")(
        _proxied(COMPLETIONS_PATH))
    api.post(CHAT_PATH, summary="OpenAI chat completions, routed by kvroute")(
        _proxied(CHAT_PATH))
    for extra in PASS_THROUGH:
        api.post(extra, summary=f"{extra}, routed by kvroute (pass-through)")(_proxied(extra))

    @api.post("/v1/explain", summary="The routing decision for a request, not forwarded")
    async def explain(request: Request) -> Response:
        if (refused := pipeline.admin_refusal(request)) is not None:
            return refused
        return await front.explain(request)

    @api.get("/v1/models", summary="Models served by the workers")
    async def models(request: Request) -> Response:
        if (refused := pipeline.tenant_refusal(request)) is not None:
            return refused
        return await front.models()

    @api.get("/health", summary="200 while some worker can take a request now")
    async def health() -> Response:
        return front.health()

    @api.get("/ready", summary="200 once every worker's index is exact or degraded")
    async def ready() -> Response:
        return front.ready()

    @api.get("/metrics", summary="Prometheus metrics (kvroute_*)")
    async def metrics_route(request: Request) -> Response:
        auth = pipeline.auth
        if auth is not None and auth.protect_metrics:
            if (refused := pipeline.admin_refusal(request)) is not None:
                return refused
        return front.render_metrics()

    @api.get("/workers", summary="Per-worker index, load and circuit state")
    async def workers(request: Request) -> Response:
        if (refused := pipeline.admin_refusal(request)) is not None:
            return refused
        return JSONResponse(front.workers_view())

    @api.get("/admin/snapshot", summary="This replica's index snapshot (kvroute.snapshot)")
    async def admin_snapshot(request: Request) -> Response:
        if (refused := pipeline.admin_refusal(request)) is not None:
            return refused
        return front.snapshot(request)

    @api.get("/admin/decisions", summary="The most recent routing decisions")
    async def admin_decisions(request: Request, limit: Optional[int] = None,
                              tenant: Optional[str] = None,
                              request_id: Optional[str] = None) -> Response:
        if (refused := pipeline.admin_refusal(request)) is not None:
            return refused
        log = front.decisions
        if log is None:
            return error_response(404, "the decision log is off (decision_log_size: null)")
        entries = log.entries(limit if request_id is None else None, tenant)
        if request_id is not None:
            entries = [e for e in entries if e.get("request_id") == request_id][-(limit or 0):]
        return JSONResponse({"size": log.size, "recorded": log.recorded,
                             "decisions": entries})

    @api.post("/admin/workers", summary="Add a worker at run time")
    async def admin_add_worker(request: Request) -> Response:
        if (refused := pipeline.admin_refusal(request, write=True)) is not None:
            return refused
        try:
            return JSONResponse(front.add_worker(await request.json()), status_code=201)
        except ValueError as e:  # also a body that is not JSON
            return error_response(400, str(e))

    @api.delete("/admin/workers/{name:path}", summary="Remove a worker at run time")
    async def admin_remove_worker(request: Request, name: str) -> Response:
        if (refused := pipeline.admin_refusal(request, write=True)) is not None:
            return refused
        try:
            return JSONResponse(front.remove_worker(name))
        except KeyError as e:
            return error_response(404, str(e.args[0]) if e.args else f"no worker {name!r}")

    return api


class FastPath:
    """ASGI middleware: ``POST /v1/completions`` and ``POST /v1/chat/completions`` go straight
    to the pipeline (the same stages as the routes), skipping FastAPI's route matching,
    dependency solving and inner middleware (0.80 -> 0.59 ms of kvroute CPU per request at
    c32, 2 shared vCPUs); every other request continues down the app. Middleware added to the
    app after it still runs around it."""

    def __init__(self, app: Any, pipeline: Pipeline) -> None:
        self.app = app
        self.pipeline = pipeline

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path == COMPLETIONS_PATH or path == CHAT_PATH:
                response = await self.pipeline.run(Request(scope, receive, send), path)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(pipeline: Pipeline, *, title: str, closers: Callable[[], Any],
              load: Callable[[Any], Any], config: Any,
              reload_file: Union[str, Path, None],
              access: Any) -> FastAPI:
    """The FastAPI application of a front: `route_table`, `FastPath`, request ids and access
    logs (`kvroute.serving.routes.install` with ``access``: its keywords), and
    ``POST /admin/reload`` (``load(path)`` re-reads ``reload_file``; the front applies it).
    ``closers()`` (awaitable or not) runs at shutdown after the front closed."""
    api = route_table(pipeline)

    @contextlib.asynccontextmanager
    async def _close(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            out = closers()
            if asyncio.iscoroutine(out):
                await out

    app = FastAPI(title=title, summary="KV-cache-aware router for vLLM / SGLang engines",
                  lifespan=_close)
    app.include_router(api)
    from kvroute.serving.routes import install

    # Added first, so that install's request-id and access-log middleware wraps it.
    app.add_middleware(FastPath, pipeline=pipeline)
    install(app, **access)
    app.state.kvroute_pipeline = pipeline
    app.state.kvroute_config = config
    reload_lock = asyncio.Lock()

    @app.post("/admin/reload", summary="Re-read the config file: tenants, workers, policy")
    async def admin_reload(request: Request) -> Response:
        if (refused := pipeline.admin_refusal(request, write=True)) is not None:
            return refused
        if reload_file is None:
            return error_response(409, "the app was not built from a config file: nothing "
                                       "to reload")
        async with reload_lock:
            try:
                new_cfg = load(reload_file)
                assert pipeline.auth is not None  # create_app always gives one
                summary = pipeline.front.reload(pipeline.auth, new_cfg,
                                                app.state.kvroute_config)
            except (ValueError, OSError) as e:  # ConfigError is a ValueError
                return error_response(400, f"config not reloaded: {e}")
            app.state.kvroute_config = new_cfg
            on_reload = getattr(pipeline.auth, "on_reload", None)
            if on_reload is not None:  # the other processes of kvroute serve --workers N
                on_reload()
        return JSONResponse(summary)

    return app
