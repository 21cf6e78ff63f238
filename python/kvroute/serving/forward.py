"""The dispatch stage's HTTP clients: how a request reaches a worker and its answer comes back.

- `Forwarder` (aiohttp): the proxy's request path, a keep-alive pool per worker.
- `Transport` (httpx): the side traffic (``/v1/models``, scrapes, health checks), TCP and
  ``unix://`` sockets, and requests whose header bytes aiohttp would re-encode.
- `upstream_headers` / `connection_tokens`: which client header fields are forwarded
  (hop-by-hop fields dropped, RFC 9110 7.6.1).

Not locked: both live on one event loop.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
from typing import Any, AsyncIterator, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import aiohttp
import httpx
from multidict import CIMultiDict as _CIMultiDict

from kvroute.serving.common import DP_RANK_HEADER, TENANT_HEADER, UDS_SCHEME

__all__ = ["Forwarder", "Transport", "Outgoing", "upstream_headers", "connection_tokens",
           "no_cookies", "as_httpx"]

# RFC 9110 section 7.6.1 connection-specific fields, plus the ones the HTTP layers recompute.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
# The client's x-data-parallel-rank is dropped: only the router picks the rank (vLLM would
# read the client's value first).
DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "x-data-parallel-rank"}
# uvicorn writes its own date and server headers; content-length is recomputed.
DROP_RESPONSE = HOP_BY_HOP | {"content-length", "date", "server"}


def connection_tokens(raw: Iterable[Tuple[bytes, bytes]]) -> Set[str]:
    """Field names listed in ``Connection`` header fields (hop-by-hop, RFC 9110 7.6.1),
    lower-cased."""
    out: Set[str] = set()
    for k, v in raw:
        if k.lower() == b"connection":
            out.update(t.strip().lower() for t in v.decode("latin-1").split(",") if t.strip())
    return out


def upstream_headers(raw: List[Tuple[bytes, bytes]], dp_rank: Optional[int],
                     tenant: Optional[str] = None,
                     extra: Mapping[str, str] = {}) -> List[Tuple[bytes, bytes]]:  # noqa: B006
    """The client's header fields (``raw``: byte pairs as received, order and repeats kept)
    to forward to a worker: minus hop-by-hop fields, ``Host``, ``Content-Length``, a client's
    ``x-data-parallel-rank`` and ``x-kvroute-*``; plus ``extra`` (e.g. the ORCA request
    field) unless the client sent it, ``accept-encoding: identity`` unless the client asked
    for a coding (the body is relayed undecoded), the worker's ``X-data-parallel-rank`` and,
    for a tenant's request, ``x-kvroute-tenant`` instead of ``Authorization``."""
    drop = DROP_REQUEST | connection_tokens(raw)
    if tenant is not None:
        drop = drop | {"authorization"}
    out = [(k, v) for k, v in raw
           if k.lower().decode("latin-1") not in drop and not k.lower().startswith(b"x-kvroute-")]
    sent = {k.lower() for k, _ in out}
    for k, v in extra.items():
        if k.lower().encode("latin-1") not in sent:
            out.append((k.encode("latin-1"), v.encode("latin-1")))
    if b"accept-encoding" not in sent:
        out.append((b"accept-encoding", b"identity"))
    if dp_rank is not None:
        out.append((DP_RANK_HEADER.encode("latin-1"), str(dp_rank).encode()))
    if tenant is not None:
        out.append((TENANT_HEADER.encode(), tenant.encode("utf-8")))
    return out


def utf8_headers(headers: Iterable[Tuple[bytes, bytes]]) -> bool:
    """True if every header value is UTF-8 (aiohttp sends values as UTF-8 text; others go
    through httpx, which sends the bytes as they are)."""
    try:
        for _, v in headers:
            if not v.isascii():  # ASCII, the usual case, is UTF-8: no decode
                v.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def no_cookies() -> http.cookiejar.CookieJar:
    """A cookie jar that stores nothing: a proxy must not carry one client's cookies (from
    an upstream Set-Cookie) to another client's requests."""
    return http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


class Transport(httpx.AsyncBaseTransport):
    """The proxy's transport: TCP through one pool, and per unix socket a pool of its own,
    chosen by the request's host (see `kvroute.serving.proxy.Proxy.base_url`)."""

    def __init__(self, tcp: httpx.AsyncHTTPTransport) -> None:
        self.tcp = tcp
        self._uds: Dict[str, httpx.AsyncHTTPTransport] = {}  # host -> transport
        self._hosts: Dict[str, str] = {}  # socket path -> host
        self._paths: Dict[str, str] = {}  # host -> socket path

    def uds_base(self, url: str) -> str:
        path = url[len(UDS_SCHEME):]
        if not path.startswith("/") or len(path) < 2:
            # InvalidURL: as a malformed http URL, the request fails over to another worker
            raise httpx.InvalidURL(f"a unix socket worker URL is unix:///absolute/path.sock, "
                                   f"got {url!r}")
        host = self._hosts.get(path)
        if host is None:
            import hashlib

            host = f"uds-{hashlib.sha256(path.encode()).hexdigest()[:16]}.kvroute.invalid"
            self._uds[host] = httpx.AsyncHTTPTransport(
                uds=path, limits=httpx.Limits(max_connections=None,
                                              max_keepalive_connections=64))
            self._hosts[path] = host
            self._paths[host] = path
        return f"http://{host}"

    def uds_path(self, host: str) -> Optional[str]:
        """The socket path behind a ``uds-<hash>.kvroute.invalid`` host, else None."""
        t = self._uds.get(host)
        return None if t is None else self._paths[host]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = self._uds.get(request.url.host)
        return await (t if t is not None else self.tcp).handle_async_request(request)

    async def aclose(self) -> None:
        for t in [self.tcp, *self._uds.values()]:
            await t.aclose()


class Outgoing:
    """A request for `Forwarder.send`: POST ``content`` to ``url`` with ``headers`` (raw
    byte pairs, sent in order)."""

    __slots__ = ("url", "content", "headers")

    def __init__(self, url: str, content: bytes, headers: List[Tuple[bytes, bytes]]) -> None:
        self.url = url
        self.content = content
        self.headers = headers


class RawHeaders:
    """Response header fields as received: ``raw`` (byte pairs, repeats kept) and a
    case-insensitive ``get`` of the first value (latin-1), as ``httpx.Headers`` offers them."""

    __slots__ = ("raw",)

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def get(self, name: str, default: Optional[str] = None) -> Optional[str]:
        key = name.lower().encode("latin-1")
        for k, v in self.raw:
            if k.lower() == key:
                return str(v.decode("latin-1"))
        return default


class AioResponse:
    """An upstream response from `Forwarder` with the part of ``httpx.Response`` the proxy
    reads: ``status_code``, ``headers`` (`RawHeaders`), ``aiter_raw()`` (the body as it
    arrives, transfer coding removed, content coding kept) and ``aclose()`` (the connection
    goes back to the pool when the body was read to its end, else it is closed, so the engine
    sees the client leave). aiohttp's errors are raised as the httpx ones
    `kvroute.serving.breaker.retryable` and the relay handle."""

    __slots__ = ("_resp", "status_code", "headers")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers = RawHeaders(resp.raw_headers)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise as_httpx(e, reading=True) from e

    async def aclose(self) -> None:
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


def as_httpx(e: BaseException, reading: bool = False) -> Exception:
    """An aiohttp error as the httpx exception of the same meaning (the proxy's retry and
    error paths are written against httpx's)."""
    msg = f"{type(e).__name__}: {e}"
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(msg)
    if isinstance(e, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return httpx.ReadTimeout(msg)
    if isinstance(e, aiohttp.ClientConnectorError):
        return httpx.ConnectError(msg)
    if isinstance(e, aiohttp.InvalidURL):
        return httpx.InvalidURL(msg)
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                      aiohttp.ClientResponseError)):
        return httpx.RemoteProtocolError(msg)
    if isinstance(e, aiohttp.ClientOSError):
        return httpx.ReadError(msg) if reading else httpx.WriteError(msg)
    return httpx.TransportError(msg)


# Seconds an idle upstream connection is kept: below uvicorn's default keep-alive timeout
# (5 s; vLLM and SGLang serve with uvicorn), so the proxy never reuses a connection the engine
# is closing.
_KEEPALIVE_S = 4.0


class Forwarder:
    """The proxy's request path to the workers, on aiohttp: one ``ClientSession`` whose
    ``TCPConnector`` keeps a pool of keep-alive connections per worker ``host:port``
    (unlimited connections, idle ones kept `_KEEPALIVE_S`), and one session per unix socket
    (the ``uds-<hash>.kvroute.invalid`` hosts of ``transport``). Measured against httpx's
    pooled transport, whose per-request cost grows with the pooled connections (it polls each
    one): see benchmarks/README.md, bench_proxy.py.

    Sessions send no cookies (``DummyCookieJar``), follow no redirects, decode no content
    coding and add no ``User-Agent`` / ``Accept`` / ``Accept-Encoding`` / ``Content-Type``.
    Header values go as UTF-8 text (aiohttp's encoding): a request with a header value that is
    not UTF-8 is sent through httpx instead (`utf8_headers`), so its bytes reach the worker as
    the client sent them."""

    def __init__(self, transport: Transport, connect_timeout_s: float,
                 read_timeout_s: float) -> None:
        self._transport = transport
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                              sock_read=read_timeout_s)
        self._tcp = self._session(aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S, ttl_dns_cache=10))
        self._uds: Dict[str, aiohttp.ClientSession] = {}

    def _session(self, connector: aiohttp.BaseConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))

    def _session_for(self, url: str) -> aiohttp.ClientSession:
        if ".kvroute.invalid" in url:
            host = url.split("://", 1)[-1].split("/", 1)[0]
            path = self._transport.uds_path(host)
            if path is not None:
                s = self._uds.get(host)
                if s is None:
                    s = self._uds[host] = self._session(aiohttp.UnixConnector(
                        path, limit=0, keepalive_timeout=_KEEPALIVE_S))
                return s
        return self._tcp

    async def send(self, req: Outgoing) -> AioResponse:
        """POSTs ``req``; returns once the response headers are in. Raises httpx's
        ConnectError / ConnectTimeout / ReadTimeout / RemoteProtocolError / WriteError /
        InvalidURL (see `_as_httpx`)."""
        headers = [(k.decode("latin-1"), _header_str(v)) for k, v in req.headers]
        try:
            resp = await self._session_for(req.url).post(
                req.url, data=req.content, headers=_CIMultiDict(headers),
                allow_redirects=False)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise as_httpx(e) from e
        except ValueError as e:  # yarl: a malformed URL
            raise httpx.InvalidURL(str(e)) from e
        return AioResponse(resp)

    async def aclose(self) -> None:
        for s in [self._tcp, *self._uds.values()]:
            await s.close()


def _header_str(v: bytes) -> str:
    """A header value as the ``str`` aiohttp encodes back to the same bytes (UTF-8), or its
    latin-1 reading when it is not UTF-8."""
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return v.decode("latin-1")
