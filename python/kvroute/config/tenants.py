"""Multi-tenant API keys: ``tenants`` (`TenantConfig`) and ``admin`` (`AdminConfig`); a
plaintext ``key`` is replaced by its SHA-256 at load.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Dict, List, Optional

from pydantic import (
    Field,
)

from kvroute.config._base import PosFloat, PosInt, _Model


def _hash_keys(data: Dict[str, Any]) -> Dict[str, Any]:
    """A plaintext ``key`` becomes its ``key_sha256`` (hex SHA-256 of the UTF-8 key); the
    plaintext is not kept."""
    if "key" in data:
        import hashlib

        if "key_sha256" in data:
            raise ValueError("key and key_sha256 name the same setting; give one")
        key = data.pop("key")
        if not isinstance(key, str) or not key:
            raise ValueError("key must be a non-empty string")
        data["key_sha256"] = hashlib.sha256(key.encode("utf-8")).hexdigest()
    return data


Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class TenantConfig(_Model):
    """One tenant of ``kvroute serve`` (`kvroute.serving.auth`): its API key (``key_sha256``,
    or ``key`` hashed at load), a token bucket (``rate_limit_rps`` requests per second,
    ``burst`` deep, default ``max(1, ceil(rate_limit_rps))``), ``max_concurrent`` requests in
    flight, ``allowed_models`` (fnmatch patterns), ``trust_session_key`` (use the client's
    session headers / body fields for the hashing policies), ``revoked`` and ``explain``
    (``x-kvroute-explain: 1`` answers with the decision and every worker's score terms; off
    by default: they name every worker's URL, load and match)."""

    _shorthand_keys: ClassVar[tuple] = ("key",)
    name: str = Field(min_length=1)
    key_sha256: Sha256Hex
    rate_limit_rps: Optional[PosFloat] = None
    burst: Optional[PosInt] = None
    max_concurrent: Optional[PosInt] = None
    allowed_models: List[str] = Field(default_factory=lambda: ["*"])
    trust_session_key: bool = False
    revoked: bool = False
    explain: bool = False

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        return _hash_keys(data)


class AdminConfig(_Model):
    """The admin key of ``kvroute serve`` (``key_sha256``, or ``key`` hashed at load): needed
    for ``/admin/*``, ``GET /workers``, ``POST /v1/explain``, and ``GET /metrics`` when
    ``protect_metrics``."""

    _shorthand_keys: ClassVar[tuple] = ("key",)
    key_sha256: Sha256Hex
    protect_metrics: bool = False

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        return _hash_keys(data)
