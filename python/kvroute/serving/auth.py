"""Tenants, API keys and per-tenant limits for the proxy (`kvroute.fastapi`).

A client presents ``Authorization: Bearer <key>``; the key's SHA-256 (hex, of its UTF-8
bytes) is looked up among the tenants' ``key_sha256`` (plaintext keys never reach this
module: `kvroute.config` hashes ``key`` at load). Per tenant:

- a token bucket: ``rate_limit_rps`` tokens per second, ``burst`` deep (full at start);
  each admitted request takes one token; none left: **429** with ``Retry-After`` = whole
  seconds until a token is there (at least 1);
- ``max_concurrent`` requests in flight (admitted until the response has been sent, a
  stream until its last byte); more: **429**, ``Retry-After: 1``;
- ``allowed_models``: fnmatch patterns (``*``, ``?``, ``[...]``) over the body's ``model``;
  no match: **403** (checked by the proxy once the body is parsed, after the limits);
- ``trust_session_key``: false (the default) ignores the client's session headers and body
  fields (`kvroute.session_key`), so the hashing policies hash the prompt instead;
- ``revoked``: the key is refused (**401**);
- ``explain``: a request with ``x-kvroute-explain: 1`` gets its decision and every worker's
  score terms in the response headers (default false: they name every worker's URL, load and
  match, which ``POST /v1/explain`` keeps for the admin key).

A missing, malformed or unknown key: **401** with ``WWW-Authenticate: Bearer``. The admin key
(``admin:`` section) opens ``/admin/*``, ``GET /workers``, ``POST /v1/explain`` and, with
``protect_metrics``, ``GET /metrics``; tenant keys do not. With tenants but no admin key those
routes answer **403**. With neither, every route is open (and ``Authorization`` is forwarded
as the client sent it).

Thread-safety: an `Auth` lives on one event loop (no locks); `replace_tenants` swaps the
tenant table atomically and keeps the bucket and in-flight count of tenants that stay.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import math
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

__all__ = ["Auth", "Tenant", "TokenBucket", "AuthError", "sha256_hex"]


def sha256_hex(key: str) -> str:
    """Hex SHA-256 of ``key``'s UTF-8 bytes (the form ``key_sha256`` holds)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class AuthError(Exception):
    """A refused request: ``status`` (401, 403 or 429), ``message``, response ``headers``,
    and ``reason`` (``missing_key``, ``bad_key``, ``revoked``, ``not_admin``, ``no_admin_key``,
    ``rate_limit``, ``concurrency``) and the ``tenant`` name (``""`` when not known) for
    metrics."""

    def __init__(self, status: int, message: str, reason: str,
                 headers: Optional[Mapping[str, str]] = None, tenant: str = "") -> None:
        super().__init__(message)
        self.tenant = tenant
        self.status = status
        self.message = message
        self.reason = reason
        self.headers = dict(headers or {})


class TokenBucket:
    """``rate`` tokens per second up to ``capacity``; starts full.

    ``take()`` returns 0.0 when a token was taken, else the seconds until one will be there.
    ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, rate: float, capacity: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or not capacity >= 1:
            raise ValueError(f"token bucket needs rate > 0 and capacity >= 1, got {rate!r}, "
                             f"{capacity!r}")
        self.rate = float(rate)
        self.capacity = float(capacity)
        self._clock = clock
        self._tokens = float(capacity)
        self._at = clock()

    def take(self) -> float:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate


class Tenant:
    """One tenant's settings (from `kvroute.config.TenantConfig` or keywords) and its live
    state (bucket, requests in flight)."""

    def __init__(self, name: str, key_sha256: str, *, rate_limit_rps: Optional[float] = None,
                 burst: Optional[int] = None, max_concurrent: Optional[int] = None,
                 allowed_models: Iterable[str] = ("*",), trust_session_key: bool = False,
                 revoked: bool = False, explain: bool = False) -> None:
        self.name = name
        self.key_sha256 = key_sha256.lower()
        self.rate_limit_rps = rate_limit_rps
        self.burst = burst if burst is not None else (
            max(1, math.ceil(rate_limit_rps)) if rate_limit_rps else None)
        self.max_concurrent = max_concurrent
        self.allowed_models: Tuple[str, ...] = tuple(allowed_models)
        self.trust_session_key = bool(trust_session_key)
        self.revoked = bool(revoked)
        self.explain = bool(explain)
        self.bucket = (TokenBucket(rate_limit_rps, self.burst or 1) if rate_limit_rps
                       else None)
        self.inflight = 0

    @classmethod
    def from_config(cls, c: Any) -> Tenant:
        if isinstance(c, Tenant):
            return c
        fields = c if isinstance(c, Mapping) else c.model_dump()
        return cls(**fields)

    def _limits(self) -> tuple:
        return (self.rate_limit_rps, self.burst)

    def _limits_any(self) -> bool:
        """A rate or a concurrency limit is set (else admission counts nothing shared)."""
        return self.bucket is not None or self.max_concurrent is not None

    def model_allowed(self, model: Any) -> bool:
        """True if ``model`` (the body's ``model``; a missing one counts as ``""``) matches
        one of ``allowed_models``."""
        m = model if isinstance(model, str) else ""
        return any(fnmatch.fnmatchcase(m, p) for p in self.allowed_models)


class Auth:
    """The key table and limits of one app.

    Parameters
    ----------
    tenants:
        `kvroute.config.TenantConfig` objects, mappings of `Tenant` keywords, or `Tenant`s;
        ``None`` or empty: public routes are open.
    admin_key_sha256:
        Hex SHA-256 of the admin key, or ``None``.
    protect_metrics:
        ``GET /metrics`` needs the admin key.

    Raises
    ------
    ValueError
        Two tenants with one name or one key, or a tenant key equal to the admin key.
    """

    def __init__(self, tenants: Optional[Iterable[Any]] = None, *,
                 admin_key_sha256: Optional[str] = None, protect_metrics: bool = False) -> None:
        self.admin_key_sha256 = admin_key_sha256.lower() if admin_key_sha256 else None
        self.protect_metrics = bool(protect_metrics)
        self._by_key: Dict[str, Tenant] = {}
        self._by_name: Dict[str, Tenant] = {}
        #: `kvroute.serving.shared_limits.SharedLimits` when the limits are shared by the
        #: processes of ``kvroute serve --workers N``; None: this process's own.
        self.shared: Any = None
        self.replace_tenants(tenants or ())

    @classmethod
    def from_config(cls, cfg: Any) -> Optional[Auth]:
        """From a `kvroute.config.RouterConfig` (its ``tenants`` and ``admin``); ``None`` when
        it has neither."""
        tenants = getattr(cfg, "tenants", None)
        admin = getattr(cfg, "admin", None)
        if not tenants and admin is None:
            return None
        return cls(tenants, admin_key_sha256=admin.key_sha256 if admin else None,
                   protect_metrics=admin.protect_metrics if admin else False)

    @property
    def enabled(self) -> bool:
        """Tenants are configured: public routes need a tenant key."""
        return bool(self._by_name)

    @property
    def tenants(self) -> List[Tenant]:
        return list(self._by_name.values())

    def replace_tenants(self, tenants: Iterable[Any]) -> None:
        """Installs a new tenant table. A tenant that keeps its name keeps its in-flight count,
        and its bucket's level when its rate and burst are unchanged."""
        new = [Tenant.from_config(t) for t in tenants]
        by_name: Dict[str, Tenant] = {}
        by_key: Dict[str, Tenant] = {}
        for t in new:
            if t.name in by_name:
                raise ValueError(f"tenant {t.name!r} is configured twice")
            if t.key_sha256 in by_key:
                raise ValueError(f"tenants {by_key[t.key_sha256].name!r} and {t.name!r} share "
                                 "one key")
            if self.admin_key_sha256 and t.key_sha256 == self.admin_key_sha256:
                raise ValueError(f"tenant {t.name!r} has the admin key")
            old = self._by_name.get(t.name)
            if old is not None:
                t.inflight = old.inflight
                if old._limits() == t._limits():
                    t.bucket = old.bucket
            by_name[t.name] = t
            by_key[t.key_sha256] = t
        self._by_name, self._by_key = by_name, by_key

    # -- checks -------------------------------------------------------------------------------
    @staticmethod
    def _bearer(headers: Mapping[str, str]) -> Optional[str]:
        value = headers.get("authorization")
        if not value:
            return None
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip()

    def _unauthorized(self, message: str, reason: str) -> AuthError:
        return AuthError(401, message, reason, {"WWW-Authenticate": "Bearer"})

    def tenant_of(self, headers: Mapping[str, str]) -> Optional[Tenant]:
        """The tenant a public-route request belongs to; ``None`` when no tenants are
        configured. Raises `AuthError` 401 for a missing, unknown or revoked key."""
        if not self.enabled:
            return None
        key = self._bearer(headers)
        if key is None:
            raise self._unauthorized("missing API key (Authorization: Bearer <key>)",
                                     "missing_key")
        t = self._by_key.get(sha256_hex(key))
        if t is None:
            raise self._unauthorized("invalid API key", "bad_key")
        if t.revoked:
            raise AuthError(401, "API key revoked", "revoked", {"WWW-Authenticate": "Bearer"},
                            t.name)
        return t

    def admit(self, tenant: Tenant) -> None:
        """Takes a rate token and an in-flight slot of ``tenant``; `release` gives the slot
        back. Raises `AuthError` 429 (with ``Retry-After``) when either is exhausted; a
        request refused for concurrency does not spend a rate token. With `shared`, the
        counts are the whole server's."""
        if self.shared is not None and tenant._limits_any():
            self.shared.admit(tenant)
            tenant.inflight += 1
            return
        if tenant.max_concurrent is not None and tenant.inflight >= tenant.max_concurrent:
            raise AuthError(429, f"tenant {tenant.name}: {tenant.max_concurrent} requests "
                                 "already in flight", "concurrency", {"Retry-After": "1"},
                            tenant.name)
        if tenant.bucket is not None:
            wait = tenant.bucket.take()
            if wait > 0:
                raise AuthError(429, f"tenant {tenant.name}: rate limit of "
                                     f"{tenant.rate_limit_rps:g} requests/s exceeded",
                                "rate_limit", {"Retry-After": str(max(1, math.ceil(wait)))},
                                tenant.name)
        tenant.inflight += 1

    def release(self, tenant: Tenant) -> None:
        """Gives back the in-flight slot `admit` took."""
        tenant.inflight = max(0, tenant.inflight - 1)
        if self.shared is not None and tenant._limits_any():
            self.shared.release(tenant)

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """For admin routes. Open when neither tenants nor an admin key are configured;
        with tenants and no admin key: `AuthError` 403; else the admin key or 401."""
        if self.admin_key_sha256 is None:
            if self.enabled:
                raise AuthError(403, "admin routes are closed: no admin key is configured",
                                "no_admin_key")
            return
        key = self._bearer(headers)
        if key is None:
            raise self._unauthorized("missing admin key (Authorization: Bearer <key>)",
                                     "missing_key")
        if not hmac.compare_digest(sha256_hex(key), self.admin_key_sha256):
            raise self._unauthorized("not the admin key", "not_admin")
