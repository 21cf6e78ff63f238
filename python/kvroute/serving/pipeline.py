"""The request pipeline every front runs, and the contract a front fulfils.

One request, in order (each stage a module with its contract):

=============  ==========================================================================
authenticate   the tenant of the request's API key (`kvroute.serving.auth.Auth.tenant_of`):
               401 for a missing, unknown or revoked key; and whether the request may see
               its decision (`Pipeline.may_explain`)
admit          the tenant's rate and concurrency limits (`Auth.admit`, shared by every
               process of ``kvroute serve --workers N``: `kvroute.serving.shared_limits`):
               429 with ``Retry-After``
parse          the body within ``max_body_bytes`` (`kvroute.serving.request.parse_body`):
               413 / 400
tokenize       the prompt's token ids within ``max_prompt_tokens``
               (`kvroute.serving.request.encode_routed`): 400, 503 for a full lane
decide         `kvroute.Router.select_worker` (or `kvroute.PDRouter.select_pair`) without
               the workers whose circuit is open, that are unhealthy, or failed this request
dispatch       attempts with retry and backoff, circuit breakers, health
               (`kvroute.serving.breaker`, `kvroute.serving.forward`,
               `kvroute.serving.health`, `kvroute.serving.retry`)
relay          the engine's answer, streamed chunk by chunk (`kvroute.serving.relay`)
account        the router's load released, delivered tokens reported, the decision log and
               the access log written, the response cache filled, metrics, and the tenant's
               in-flight slot given back once the last byte is sent (`AfterSend`)
=============  ==========================================================================

`Pipeline` runs authenticate, admit and account; the front (`Front`: the OpenAI proxy
`kvroute.serving.proxy.Proxy`, the prefill/decode front `kvroute.serving.pd.PDFront`) runs
parse to relay for its mode. The route table (`kvroute.serving.app.route_table`) is the
same for every front. Thread-safety: a pipeline lives on one event loop.
"""

from __future__ import annotations

import hmac
from typing import Any, Dict, Mapping, Optional, Protocol

from starlette.requests import Request
from starlette.responses import Response

from kvroute.serving.auth import Auth, AuthError, sha256_hex
from kvroute.serving.common import EXPLAIN_HEADER, error_response

__all__ = ["Front", "Pipeline", "AfterSend"]


class Front(Protocol):
    """What a front gives the route table (`kvroute.serving.app.route_table`). Every method
    answers for the whole front (both pools in prefill/decode mode)."""

    metrics: Any  #: has ``observe_tenant(name, status)`` and ``render()``
    decisions: Any  #: `kvroute.serving.admin.DecisionLog` or None (off)

    async def start(self) -> None: ...
    async def aclose(self) -> None: ...

    async def handle(self, request: Request, path: str, tenant: Any = None,
                     explain: bool = False) -> Response:
        """Parse to relay for one admitted request; never raises for bad input."""

    async def explain(self, request: Request) -> Response:
        """``POST /v1/explain``: the decision for a body, without forwarding it."""

    async def models(self) -> Response: ...
    def health(self) -> Response: ...
    def ready(self) -> Response: ...
    def workers_view(self) -> Dict[str, Any]: ...
    def render_metrics(self) -> Response: ...
    def snapshot(self, request: Request) -> Response: ...

    def add_worker(self, body: Any) -> Dict[str, Any]:
        """``POST /admin/workers``; raises ValueError for a bad body."""

    def remove_worker(self, name: str) -> Dict[str, Any]:
        """``DELETE /admin/workers/{name}``; raises KeyError for an unknown worker."""

    def reload(self, auth: Auth, new_cfg: Any, old_cfg: Any) -> Dict[str, Any]:
        """``POST /admin/reload`` of a re-read config; raises ValueError (nothing applied)."""


def refusal(e: AuthError) -> Response:
    """The OpenAI-shaped error response of a refused request."""
    return error_response(e.status, e.message, headers=e.headers)


class Pipeline:
    """authenticate -> admit -> the front's stages -> account, for one app.

    Parameters
    ----------
    front:
        The `Front` of the app's mode.
    auth:
        `kvroute.serving.auth.Auth` (tenants, admin key), or ``None``: every route open.
    """

    def __init__(self, front: Front, auth: Optional[Auth]) -> None:
        self.front = front
        self.auth = auth

    # -- authenticate --------------------------------------------------------------------------
    def may_explain(self, headers: Mapping[str, str], tenant: Any) -> bool:
        """Whether a request that asks with ``x-kvroute-explain: 1`` gets its decision and
        every worker's score terms (``x-kvroute-decision`` / ``x-kvroute-scores``; they name
        every worker's URL, match and load, as ``POST /v1/explain`` does): with no tenants and
        no admin key, yes; with tenants, only a tenant whose config sets ``explain: true``;
        with an admin key and no tenants, only a request presenting the admin key."""
        if headers.get(EXPLAIN_HEADER, "").strip().lower() not in ("1", "true", "yes"):
            return False
        auth = self.auth
        if auth is None or (not auth.enabled and auth.admin_key_sha256 is None):
            return True
        if tenant is not None:
            return bool(getattr(tenant, "explain", False))
        key = auth._bearer(headers)
        return (key is not None and auth.admin_key_sha256 is not None
                and hmac.compare_digest(sha256_hex(key), auth.admin_key_sha256))

    def sync(self) -> None:
        """Before authenticating: apply a reload another process of the server made
        (`kvroute.serving.shared_limits.SharedLimits.poll`)."""
        shared = self.auth.shared if self.auth is not None else None
        if shared is not None:
            shared.poll()

    def admin_refusal(self, request: Request, write: bool = False) -> Optional[Response]:
        """The error response for a request to an admin route without the admin key, else
        None. ``write``: a route that changes the router, closed (403) unless an admin key is
        configured."""
        self.sync()
        auth = self.auth
        if write and (auth is None or auth.admin_key_sha256 is None):
            return error_response(403, "admin routes that change the router need an admin key "
                                       "(admin: {key_sha256: ...} in the config)")
        if auth is None:
            return None
        try:
            auth.check_admin(request.headers)
        except AuthError as e:
            return refusal(e)
        return None

    def tenant_refusal(self, request: Request) -> Optional[Response]:
        """For routes a tenant key opens (``GET /v1/models``): the refusal, else None."""
        self.sync()
        if self.auth is None:
            return None
        try:
            self.auth.tenant_of(request.headers)
        except AuthError as e:
            return refusal(e)
        return None

    # -- the whole request ---------------------------------------------------------------------
    async def run(self, request: Request, path: str) -> Response:
        """One proxied ``POST`` through every stage. Never raises for a refused request or bad
        input: those are error responses."""
        auth = self.auth
        front = self.front
        self.sync()
        if auth is None or not auth.enabled:
            return await front.handle(request, path, None,
                                      self.may_explain(request.headers, None))
        try:
            tenant = auth.tenant_of(request.headers)
            assert tenant is not None
            auth.admit(tenant)
        except AuthError as e:
            front.metrics.observe_tenant(e.tenant, e.reason)
            return refusal(e)
        try:
            resp = await front.handle(request, path, tenant,
                                      self.may_explain(request.headers, tenant))
        except BaseException:
            auth.release(tenant)
            raise

        def done(status: int) -> None:
            auth.release(tenant)
            front.metrics.observe_tenant(tenant.name, status)

        return AfterSend(resp, done)


class AfterSend(Response):
    """The account stage's hook: sends ``inner`` and then calls ``done(status)``, also when
    the client went away mid-response (a stream ends there), so a tenant's in-flight slot
    lasts as long as its response."""

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
