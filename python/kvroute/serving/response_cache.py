"""Exact-match response cache of the proxy: in memory, LRU, with a TTL and a size bound.

A completions / chat request is cached when its answer is reproducible: by default only a
deterministic request (``temperature`` 0, or an integer ``seed``; vLLM's default temperature
is 1.0, so a request without either is not cached), ``n`` absent or 1. The key is the SHA-256
of the tenant name, the route and the body as canonical JSON (keys sorted, no whitespace), so
two tenants never share an entry and any body difference (``stream`` included) is another
entry. Only 200 answers are stored, with their header fields (kvroute's own removed) and body:
a non-streaming body whole, an SSE stream as the chunks relayed, once it ended without error
and the client read it to the end. A hit is answered from memory byte for byte (a stream as
the same chunks), with ``x-kvroute-cache: hit``; a cacheable miss carries
``x-kvroute-cache: miss``.

Semantic mode (`SemanticIndex`, in memory only): a request that misses is embedded through
a configured ``/v1/embeddings`` endpoint and served the stored answer of the most similar
request (cosine similarity >= ``threshold``) of the same tenant, route and other body fields,
with ``x-kvroute-cache: semantic_hit`` and ``x-kvroute-cache-similarity: <similarity>``.

Bounds: ``max_entries`` entries and ``max_bytes`` body bytes (least recently used dropped
first; a body larger than ``max_bytes`` is not stored); an entry older than ``ttl_s`` seconds
is a miss and is dropped. Thread-safety: one event loop (no locks).
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import logging
import time
from typing import Any, Callable, List, Mapping, NamedTuple, Optional, Tuple

__all__ = ["CachedResponse", "ResponseCache", "RedisResponseCache", "SemanticIndex",
           "CACHE_HEADER", "SIMILARITY_HEADER", "prompt_text"]

log = logging.getLogger("kvroute.serving.response_cache")

CACHE_HEADER = "x-kvroute-cache"
SIMILARITY_HEADER = "x-kvroute-cache-similarity"


class CachedResponse(NamedTuple):
    """A stored answer: ``status``, raw header pairs, body ``chunks`` (one for a
    non-streaming body), whether it is an SSE ``stream``, when it was stored (monotonic s)."""

    status: int
    headers: List[Tuple[bytes, bytes]]
    chunks: List[bytes]
    stream: bool
    stored_at: float

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)


class ResponseCache:
    """Parameters: ``max_entries`` (>= 1), ``max_bytes`` (body bytes, >= 1), ``ttl_s``
    (seconds, > 0), ``deterministic_only`` (False: every request with ``n`` <= 1 is cached,
    sampling included), ``clock`` (monotonic seconds). Raises ValueError for bad bounds."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 << 20, ttl_s: float = 300.0,
                 deterministic_only: bool = True,
                 clock: Callable[[], float] = time.monotonic, semantic: Any = None) -> None:
        for knob, v in (("max_entries", max_entries), ("max_bytes", max_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"response cache {knob} must be an int >= 1, got {v!r}")
        if not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise ValueError(f"response cache ttl_s must be > 0 seconds, got {ttl_s!r}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = float(ttl_s)
        self.deterministic_only = bool(deterministic_only)
        self._clock = clock
        self.semantic: Optional[SemanticIndex] = (
            SemanticIndex(**dict(semantic)) if isinstance(semantic, Mapping) else semantic)
        self._entries: collections.OrderedDict[str, CachedResponse] = collections.OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    @classmethod
    def from_options(cls, options: Any) -> Optional[ResponseCache]:
        """From a `ResponseCache`, a mapping of its keywords (with ``backend: "redis"`` and
        ``redis_url``: a `RedisResponseCache`), or ``None`` (off)."""
        if options is None or isinstance(options, ResponseCache):
            return options
        opts = dict(options)
        backend = opts.pop("backend", "memory")
        url = opts.pop("redis_url", None)
        if backend == "redis":
            if opts.get("semantic") is not None:
                raise ValueError("the semantic response cache is in memory only (backend "
                                 "memory)")
            opts.pop("semantic", None)
            if not url:
                raise ValueError("response cache backend redis needs redis_url")
            opts.pop("max_entries", None)  # Redis bounds memory itself (maxmemory)
            return RedisResponseCache(url, **opts)
        if backend != "memory":
            raise ValueError(f"response cache backend must be memory or redis, got {backend!r}")
        return cls(**opts)

    async def aget(self, key: str) -> Optional[CachedResponse]:
        """`get` for the proxy's event loop (a shared backend awaits the network)."""
        return self.get(key)

    async def aput(self, key: str, status: int, headers: List[Tuple[bytes, bytes]],
                   chunks: List[bytes], stream: bool) -> bool:
        """`put` for the proxy's event loop."""
        return self.put(key, status, headers, chunks, stream)

    async def aclose(self) -> None:
        """Releases backend connections (none in memory)."""

    def __len__(self) -> int:
        return len(self._entries)

    def cacheable(self, body: Mapping[str, Any]) -> bool:
        """Whether a request body's answer may be cached (see the module docstring)."""
        n = body.get("n", 1)
        if n not in (None, 1):
            return False
        if not self.deterministic_only:
            return True
        t = body.get("temperature")
        seed = body.get("seed")
        deterministic_t = isinstance(t, (int, float)) and not isinstance(t, bool) and t == 0
        return deterministic_t or (isinstance(seed, int) and not isinstance(seed, bool))

    @staticmethod
    def key(tenant: Optional[str], path: str, body: Mapping[str, Any]) -> str:
        """Hex SHA-256 of the tenant, the route and the canonical JSON of the body."""
        canon = json.dumps([tenant, path, body], sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()

    def get(self, key: str) -> Optional[CachedResponse]:
        """The live entry for ``key`` (made most recently used), else None (counted)."""
        e = self._entries.get(key)
        if e is not None and self._clock() - e.stored_at > self.ttl_s:
            self._drop(key)
            e = None
        if e is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return e

    def put(self, key: str, status: int, headers: List[Tuple[bytes, bytes]],
            chunks: List[bytes], stream: bool) -> bool:
        """Stores an answer (status 200 only, kvroute's header fields removed). Returns
        whether it was stored."""
        if status != 200:
            return False
        kept = [(k, v) for k, v in headers if not k.lower().startswith(b"x-kvroute-")]
        e = CachedResponse(status, kept, list(chunks), stream, self._clock())
        if e.nbytes > self.max_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        self._entries[key] = e
        self.nbytes += e.nbytes
        if self.semantic is not None:
            self.semantic.stored(key)
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def _drop(self, key: str) -> None:
        e = self._entries.pop(key)
        self.nbytes -= e.nbytes


class RedisResponseCache(ResponseCache):
    """The response cache in Redis, shared by every router instance using the same server
    and ``key_prefix`` (entries are keyed as in `ResponseCache.key`, so tenants stay apart).

    An entry is one Redis string ``<key_prefix><key>`` holding JSON ``[status, [[name,
    value], ...], [chunk, ...], stream]`` (names, values and chunks base64), set with ``PX``
    = ``ttl_s`` (Redis expires it); an answer larger than ``max_bytes`` is not stored.
    Eviction beyond that is the server's
    (``maxmemory`` / ``maxmemory-policy allkeys-lru``). Fail-open: a Redis error is logged
    and the request is served as a miss (and not stored). Needs the ``redis`` package
    (``redis.asyncio``); the connection pool is created on first use, on the running loop.
    """

    def __init__(self, url: str, max_bytes: int = 64 << 20, ttl_s: float = 300.0,
                 deterministic_only: bool = True, key_prefix: str = "kvroute:rc:") -> None:
        super().__init__(max_entries=1, max_bytes=max_bytes, ttl_s=ttl_s,
                         deterministic_only=deterministic_only)
        import redis.asyncio  # noqa: F401  (fail at construction when missing)

        self.url = url
        self.key_prefix = key_prefix
        self._redis: Any = None
        self.errors = 0

    def _client(self) -> Any:
        if self._redis is None:
            import redis.asyncio

            self._redis = redis.asyncio.from_url(self.url)
        return self._redis

    def get(self, key: str) -> Optional[CachedResponse]:
        raise TypeError("RedisResponseCache is used through aget / aput")

    def put(self, key: str, status: int, headers: List[Tuple[bytes, bytes]],
            chunks: List[bytes], stream: bool) -> bool:
        raise TypeError("RedisResponseCache is used through aget / aput")

    async def aget(self, key: str) -> Optional[CachedResponse]:
        try:
            raw = await self._client().get(self.key_prefix + key)
        except Exception as e:  # any Redis or connection error: serve as a miss
            self.errors += 1
            log.warning("response cache: Redis GET failed: %s: %s", type(e).__name__, e)
            raw = None
        if raw is None:
            self.misses += 1
            return None
        status, headers, chunks, stream = json.loads(raw)
        self.hits += 1
        return CachedResponse(status, [(_unb64(k), _unb64(v)) for k, v in headers],
                              [_unb64(c) for c in chunks], bool(stream), self._clock())

    async def aput(self, key: str, status: int, headers: List[Tuple[bytes, bytes]],
                   chunks: List[bytes], stream: bool) -> bool:
        if status != 200 or sum(len(c) for c in chunks) > self.max_bytes:
            return False
        kept = [[_b64(k), _b64(v)] for k, v in headers
                if not k.lower().startswith(b"x-kvroute-")]
        data = json.dumps([status, kept, [_b64(c) for c in chunks], stream])
        try:
            await self._client().set(self.key_prefix + key, data,
                                     px=max(1, int(self.ttl_s * 1000)))
        except Exception as e:
            self.errors += 1
            log.warning("response cache: Redis SET failed: %s: %s", type(e).__name__, e)
            return False
        return True

    async def aclose(self) -> None:
        client, self._redis = self._redis, None
        if client is not None:
            await client.aclose()


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


def prompt_text(path: str, body: Mapping[str, Any]) -> Optional[str]:
    """The text a semantic lookup embeds: a completions ``prompt`` string, or the chat
    ``messages`` as ``"<role>: <content>"`` lines (text parts joined); None for anything
    else (token-id prompts, batches)."""
    if "messages" in body:
        lines = []
        for m in body.get("messages") or []:
            if not isinstance(m, Mapping):
                return None
            c = m.get("content")
            if isinstance(c, list):
                c = "\n".join(p.get("text", "") for p in c
                              if isinstance(p, Mapping) and p.get("type") == "text")
            if not isinstance(c, str):
                return None
            lines.append(f"{m.get('role', '')}: {c}")
        return "\n".join(lines) or None
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    return p if isinstance(p, str) and p else None


class SemanticIndex:
    """The semantic mode of the in-memory response cache: a request that misses the exact
    cache is embedded (``POST <embeddings_url>`` with ``{"model", "input"}``, OpenAI /
    vLLM ``/v1/embeddings``; ``data[0].embedding`` read) and compared by cosine similarity
    with the embeddings of stored answers of the same tenant, route and other body fields
    (everything but ``prompt`` / ``messages``); the most similar one at or above
    ``threshold`` is served. At most ``max_entries`` embeddings (oldest dropped). An
    embedding failure is a miss (logged)."""

    def __init__(self, embeddings_url: str, model: Optional[str] = None,
                 threshold: float = 0.95, max_entries: int = 1024,
                 timeout_s: float = 5.0) -> None:
        if not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
            raise ValueError(f"semantic threshold must be in (0, 1], got {threshold!r}")
        self.embeddings_url = embeddings_url
        self.model = model
        self.threshold = float(threshold)
        self.max_entries = int(max_entries)
        self.timeout_s = float(timeout_s)
        # exact key -> (group key, unit vector)
        self._vectors: collections.OrderedDict[str, Tuple[str, Any]] = \
            collections.OrderedDict()
        self._pending: collections.OrderedDict[str, Tuple[str, Any]] = \
            collections.OrderedDict()

    @staticmethod
    def group(tenant: Optional[str], path: str, body: Mapping[str, Any]) -> str:
        rest = {k: v for k, v in body.items() if k not in ("prompt", "messages")}
        return ResponseCache.key(tenant, path, rest)

    async def embed(self, client: Any, text: str) -> Any:
        import numpy as np

        payload: dict = {"input": text}
        if self.model:
            payload["model"] = self.model
        r = await client.post(self.embeddings_url, json=payload, timeout=self.timeout_s)
        r.raise_for_status()
        v = np.asarray(r.json()["data"][0]["embedding"], dtype=np.float64)
        n = float(np.linalg.norm(v))
        if v.ndim != 1 or not n > 0:
            raise ValueError("the embedding is not a non-zero vector")
        return v / n

    def nearest(self, group: str, vec: Any) -> Tuple[Optional[str], float]:
        """The stored exact key most similar to ``vec`` in ``group`` and the similarity
        (``None``, -1.0 when the group is empty)."""
        best, best_sim = None, -1.0
        for key, (g, v) in self._vectors.items():
            if g == group and v.shape == vec.shape:
                sim = float(v @ vec)
                if sim > best_sim:
                    best, best_sim = key, sim
        return best, best_sim

    def remember(self, key: str, group: str, vec: Any) -> None:
        """Holds the embedding of a miss until its answer is stored (`stored`)."""
        self._pending[key] = (group, vec)
        while len(self._pending) > self.max_entries:
            self._pending.popitem(last=False)

    def stored(self, key: str) -> None:
        item = self._pending.pop(key, None)
        if item is None:
            return
        self._vectors[key] = item
        self._vectors.move_to_end(key)
        while len(self._vectors) > self.max_entries:
            self._vectors.popitem(last=False)


async def lookup_cached(cache: Any, client: Any, metrics: Any, tenant: Optional[str],
                        path: str, body: Mapping[str, Any]
                        ) -> Tuple[Optional[str], Any, str, Optional[float]]:
    """The pipeline's cache stage for one parsed request: ``(key, hit, result, similarity)``.
    ``key`` is None for a request the cache does not take (`ResponseCache.cacheable`), else
    where its answer is stored; ``hit`` the stored `CachedResponse` or None; ``result``
    ``"hit"``, ``"semantic_hit"`` or ``"miss"`` (counted in ``metrics.observe_cache``);
    ``similarity`` the nearest earlier prompt's (semantic lookups only). Fail-open: an
    embedding error is a miss."""
    if not cache.cacheable(body):
        return None, None, "miss", None
    key = cache.key(tenant, path, body)
    hit = await cache.aget(key)
    result, similarity = "hit", None
    if hit is None and cache.semantic is not None:
        hit, similarity = await _semantic_lookup(cache, client, metrics, tenant, path, body,
                                                 key)
        result = "semantic_hit"
    result = result if hit is not None else "miss"
    metrics.observe_cache(result)
    return key, hit, result, similarity


async def _semantic_lookup(cache: Any, client: Any, metrics: Any, tenant: Optional[str],
                           path: str, body: Mapping[str, Any], key: str
                           ) -> Tuple[Any, Optional[float]]:
    """(the stored answer of the most similar earlier request at or above the threshold, or
    None; that similarity, None when nothing was compared)."""
    import httpx

    sem = cache.semantic
    text = prompt_text(path, body)
    if sem is None or text is None:
        return None, None
    group = sem.group(tenant, path, body)
    try:
        vec = await sem.embed(client, text)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        log.warning("semantic cache: embedding failed: %s: %s", type(e).__name__, e)
        return None, None
    sem.remember(key, group, vec)
    best, sim = sem.nearest(group, vec)
    if best is None:
        return None, None
    metrics.observe_similarity(sim)
    if sim >= sem.threshold:
        hit = await cache.aget(best)
        if hit is not None:
            return hit, sim
    return None, sim
