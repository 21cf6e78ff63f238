"""The Python face of the native router: `Router`, `Worker`, `block_keys`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import msgspec
import numpy as np

from kvroute import _core

Decision = _core.Decision
WorkerScore = _core.WorkerScore
NoWorkerAvailable = _core.NoWorkerAvailable

POLICIES = ("kv_aware", "cost", "cache_aware", "round_robin", "random", "power_of_two",
            "least_load", "consistent_hash", "rendezvous_hash", "lmcache_aware")
DEFAULT_TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.25}


@dataclass(frozen=True)
class Worker:
    """One engine instance the router can send requests to.

    Parameters
    ----------
    url:
        Where requests go (e.g. ``"http://10.0.0.5:8000"``); the worker's identity.
    kv_endpoint:
        ZeroMQ endpoint of the engine's KV-event publisher, e.g. ``"tcp://10.0.0.5:5557"``
        (vLLM ``--kv-events-config`` ``endpoint``; data-parallel rank r publishes on port + r).
        ``None``: no socket; feed payloads with `Router.ingest`.
    dp_rank:
        Data-parallel rank this endpoint publishes for. When set, batches carrying another
        rank are dropped (counted as ``rank_mismatch``) and the rank is part of the name.
    bind:
        Bind the SUB socket instead of connecting (for publishers that connect).
    replay_endpoint:
        The engine's replay ROUTER socket (vLLM ``--kv-events-config`` ``replay_endpoint``,
        e.g. ``"tcp://10.0.0.5:5558"``). On a sequence gap the router asks it for the missing
        batches; without it a gap drops the worker's state and marks it degraded.
    """

    url: str
    kv_endpoint: Optional[str] = None
    dp_rank: Optional[int] = None
    bind: bool = False
    replay_endpoint: Optional[str] = None

    @property
    def name(self) -> str:
        """Identity used in decisions and stats: ``url``, or ``url|dp=<rank>``."""
        return self.url if self.dp_rank is None else f"{self.url}|dp={self.dp_rank}"


WorkerLike = Union[Worker, str, Sequence[Any], Mapping[str, Any]]


class Match(NamedTuple):
    """Prefix match of one worker: contiguous blocks from the first, as tokens."""

    blocks: int
    tokens: int
    weighted_tokens: float  # tokens x tier weight of the best tier holding each block


_core._set_match_type(Match)


def _as_worker(w: WorkerLike) -> Worker:
    if isinstance(w, Worker):
        out = w
    elif isinstance(w, str):
        out = Worker(w)
    elif isinstance(w, Mapping):
        out = Worker(**w)
    elif isinstance(w, Sequence):
        out = Worker(*w)
    else:
        raise ValueError(f"expected a Worker, a URL, a (url, kv_endpoint) tuple or a dict, got {w!r}")
    if not isinstance(out.url, str) or not out.url:
        raise ValueError(f"worker url must be a non-empty string, got {out.url!r}")
    if out.dp_rank is not None and (not isinstance(out.dp_rank, int) or out.dp_rank < 0):
        raise ValueError(f"dp_rank must be a non-negative int or None, got {out.dp_rank!r}")
    return out


# Token containers the binding reads as they are (select_worker's one-argument path).
_PLAIN_TOKENS = (list, np.ndarray)


def _as_tokens(tokens: Any) -> Any:
    if type(tokens) is list:  # read item by item in C (cpp/bindings/convert.h)
        return tokens
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer token ids, got dtype {arr.dtype}")
    return arr


def _extras(
    cache_salt: Optional[str], extra_keys: Optional[Sequence[Optional[Sequence[Any]]]]
) -> Optional[list]:
    """Per-block extra keys as canonical msgpack bytes (the event path packs the same way)."""
    if cache_salt is None and extra_keys is None:
        return None
    out: list = [None if e is None else msgspec.msgpack.encode(list(e)) for e in (extra_keys or [])]
    if cache_salt is not None:
        salt = msgspec.msgpack.encode([cache_salt])
        if out:
            raise ValueError("pass cache_salt or extra_keys, not both")
        out = [salt]
    return out


def block_keys(
    tokens: Any,
    block_size: int = 16,
    *,
    lora_name: Optional[str] = None,
    cache_salt: Optional[str] = None,
    extra_keys: Optional[Sequence[Optional[Sequence[Any]]]] = None,
) -> np.ndarray:
    """kvroute's chained block keys of a prompt.

    Parameters
    ----------
    tokens:
        1-D token ids: a list of ints or an integer array (uint32/int32/int64...), values in
        ``[0, 2**32)``.
    block_size:
        Tokens per block (the engine's ``--block-size``). The trailing partial block has no key.
    lora_name, cache_salt, extra_keys:
        Change the keys, so adapters and salts never alias (see cpp/common/block_key.h).

    Returns
    -------
    numpy.ndarray
        ``uint64``, shape ``(len(tokens) // block_size,)``.

    Raises
    ------
    ValueError
        Non-integer or out-of-range token ids, ``block_size <= 0``.
    """
    return _core.block_keys(
        _as_tokens(tokens), int(block_size), lora_name or "", _extras(cache_salt, extra_keys)
    )


def decode_batch(payload: bytes) -> tuple[Optional[dict], dict]:
    """Decodes one KV-event payload (msgpack) as the ingestion threads do.

    Returns ``(batch, drops)``: ``batch`` is ``{"ts", "data_parallel_rank", "events"}`` or
    ``None`` if the whole payload was dropped; ``drops`` counts dropped parts by reason.
    Integer block hashes come back as unsigned 64-bit ints (a negative int64 from SGLang is
    reinterpreted); ``bin`` hashes as their 16-byte normalised form.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    return _core.decode_batch(bytes(payload))


def _options(**kw: Any) -> "_core.RouterOptions":
    """A typed `_core.RouterOptions` from the Router's validated arguments."""
    o = _core.RouterOptions()
    o.policy = kw["policy"]
    o.fallback = kw["fallback_policy"]
    ix = o.index
    ix.block_size = kw["block_size"]
    ix.tier_weights = list(kw["tier_weights"])
    ix.max_blocks_per_worker = kw["max_blocks_per_worker"]
    ix.max_blocks_total = kw["max_blocks_total"]
    ix.max_speculative_blocks = kw["max_speculative_blocks"]
    p = o.params
    for k in ("cache_weight", "virtual_nodes", "prefill_load_scale", "temperature",
              "cache_threshold", "balance_abs_threshold", "balance_rel_threshold",
              "eviction_interval_s", "max_tree_size"):
        setattr(p, k, kw[k])
    for k in ("speculative_ttl_s", "seed", "topic", "ingest_threads", "ingest_nice",
              "replay_timeout_s", "degraded_hold_s"):
        setattr(o, k, kw[k])
    o.limits.max_payload_bytes = kw["max_payload_bytes"]
    o.limits.max_blocks_per_event = kw["max_blocks_per_event"]
    return o


class Router:
    """KV-cache-aware router over a fleet of engine workers.

    Native threads subscribe to every worker's KV-event endpoint and keep an index of which
    worker holds which prefix blocks; `select_worker` answers from it on the caller's thread.

    Parameters
    ----------
    workers:
        Non-empty sequence of `Worker` (or a URL string, a ``(url, kv_endpoint)`` tuple, or a
        dict of `Worker` fields).
    policy:
        ``"kv_aware"`` (default), ``"cost"`` (NVIDIA Dynamo's cost), ``"cache_aware"`` (the
        SGLang / vLLM routers' approximate tree), ``"round_robin"``, ``"random"``,
        ``"power_of_two"``, ``"least_load"``, ``"consistent_hash"``, ``"rendezvous_hash"``.
        Formulas in ``cpp/scoring/policy.h``.
    block_size:
        Tokens per block; must equal the engines' ``--block-size`` (vLLM 16, SGLang often 64).
        Stores with another block size are dropped and counted (``block_size_mismatch``).
    cache_weight:
        In ``[0, 1]``. kv_aware score of worker w::

            score_w = cache_weight * match_w + (1 - cache_weight) * (1 - load_w)

        ``match_w`` = tier-weighted matched prefix tokens / prompt tokens. ``load_w`` = mean,
        over the load signals present, of: the router's pending prefill tokens on w / the
        fleet maximum; requests on w (router in-flight + reported ``num_requests_waiting``)
        / the fleet maximum; reported ``kv_cache_usage_perc`` (only if some worker reported
        one). Ties go to the lower load, then to a seeded random choice.
    tier_weights:
        Credit per matched block by its best tier, ``{"GPU": 1.0, "CPU": 0.8, "DISK": 0.25}``.
    speculative_ttl:
        Seconds a chosen worker is credited with the prompt's uncached blocks before its
        BlockStored arrives (so a burst with a new shared prefix lands together). 0 disables.
    fallback_policy:
        Policy used while no worker has delivered any event (decisions say ``fallback``).
    seed:
        Seeds the random choices (ties, power_of_two).
    topic:
        ZeroMQ SUB prefix filter on the topic frame (vLLM default ``""``).
    ingest_threads:
        Native threads servicing the SUB sockets (named ``kvroute-ingest``).
    ingest_nice:
        Nice increment (0-19, Linux) of those threads: with 5-10, the threads calling
        `select_worker` win the cores over ingestion when both want them, and ingestion runs
        in the idle time (on 2 vCPUs with 1M blocks/s arriving, p99 under ingestion 1.5-2.8x
        the quiet p99 at 0, 1.1-1.5x at 10: ``benchmarks/bench_mixed.py``). A saturated box
        then lets the index lag behind the engines. 0: the process's priority.
    max_payload_bytes, max_blocks_per_event:
        Larger payloads / events are dropped and counted (``oversized``).
    replay_timeout:
        Seconds one replay exchange may take (the worker's ingestion thread waits for it).
    degraded_hold:
        Seconds a worker stays ``degraded`` after its state was dropped (unless it sends
        AllBlocksCleared first). Decisions for a degraded worker say ``degraded``; when every
        worker is degraded, ``kv_aware`` decides with ``fallback_policy``.
    virtual_nodes:
        consistent_hash: ring points per worker.
    prefill_load_scale, temperature:
        cost: ``cost = prefill_load_scale * blocks to prefill (after tier credits) + active
        blocks``; temperature > 0 samples from a softmax over normalised costs.
    cache_threshold, balance_abs_threshold, balance_rel_threshold, eviction_interval_secs, max_tree_size:
        cache_aware, with the vLLM router's CLI defaults (0.3, 64, 1.5, 120 s, 2**26 tokens per
        worker).
    lmcache_controller_url, lmcache_worker_map, lookup_mode, poll_interval_secs, controller_timeout_ms:
        lmcache_aware: the LMCache controller, its instance ids -> worker names, ``occupancy``
        or ``prefix_lookup``, the occupancy poll period and the bound on every call (see
        `kvroute.lmcache`). Score = cache_weight * value / max value + (1 - cache_weight) *
        (1 - load); while the controller is unreachable the fallback policy decides.
    max_blocks_per_worker, max_blocks_total:
        Memory caps on indexed blocks (``None`` = no cap): past a cap the least recently
        stored blocks are dropped first and counted (``evicted_by_cap``). Defaults: 4Mi per
        worker (64Mi tokens at block size 16), 32Mi in total.
    max_speculative_blocks:
        Cap on the blocks of live speculative credits (``None`` = no cap; default 4Mi, 32 MiB of keys):
        past it the credits given longest ago are dropped first (``stats()
        ["speculative_dropped"]``), and a longer credit keeps its first blocks. Credits hold
        decisions x ``speculative_ttl`` x unmatched blocks.

    Raises
    ------
    ValueError
        Empty worker list, duplicate worker, bad cache_weight / policy / block_size, or an
        endpoint that cannot be connected or bound.
    """

    def __init__(
        self,
        workers: Sequence[WorkerLike],
        *,
        policy: str = "kv_aware",
        block_size: int = 16,
        cache_weight: float = 0.7,
        tier_weights: Optional[Mapping[str, float]] = None,
        speculative_ttl: float = 2.0,
        fallback_policy: str = "power_of_two",
        seed: int = 0,
        topic: str = "",
        ingest_threads: int = 1,
        ingest_nice: int = 0,
        max_payload_bytes: int = 64 << 20,
        max_blocks_per_event: int = 1 << 16,
        replay_timeout: float = 1.0,
        degraded_hold: float = 60.0,
        max_blocks_per_worker: Optional[int] = 1 << 22,
        max_blocks_total: Optional[int] = 1 << 25,
        max_speculative_blocks: Optional[int] = 1 << 22,
        virtual_nodes: int = 160,
        prefill_load_scale: float = 1.0,
        temperature: float = 0.0,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_secs: float = 120.0,
        max_tree_size: int = 1 << 26,
        lmcache_controller_url: Optional[str] = None,
        lmcache_worker_map: Optional[Mapping[str, str]] = None,
        lookup_mode: str = "occupancy",
        poll_interval_secs: float = 10.0,
        controller_timeout_ms: float = 2000.0,
    ) -> None:
        ws = [_as_worker(w) for w in (workers or [])]
        if not ws:
            raise ValueError("workers must be a non-empty sequence of Worker")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if fallback_policy not in POLICIES or fallback_policy in ("kv_aware", "cost"):
            raise ValueError(f"fallback_policy {fallback_policy!r} must be a policy that needs no "
                             f"KV events: one of {', '.join(p for p in POLICIES if p not in ('kv_aware', 'cost'))}")
        for knob, val, lo, hi in (("cache_threshold", cache_threshold, 0.0, 1.0),
                                  ("temperature", temperature, 0.0, float("inf")),
                                  ("prefill_load_scale", prefill_load_scale, 0.0, float("inf")),
                                  ("balance_abs_threshold", balance_abs_threshold, 0.0, float("inf")),
                                  ("balance_rel_threshold", balance_rel_threshold, 1.0, float("inf")),
                                  ("eviction_interval_secs", eviction_interval_secs, 0.0, float("inf"))):
            if not isinstance(val, (int, float)) or not lo <= float(val) <= hi:
                raise ValueError(f"{knob} must be a number in [{lo}, {hi}], got {val!r}")
        if not isinstance(virtual_nodes, int) or virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be a positive int, got {virtual_nodes!r}")
        if not isinstance(max_tree_size, int) or max_tree_size < 1:
            raise ValueError(f"max_tree_size must be a positive int, got {max_tree_size!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(cache_weight, (int, float)) or not 0.0 <= float(cache_weight) <= 1.0:
            raise ValueError(f"cache_weight must be a number in [0, 1], got {cache_weight!r}")
        tw = dict(DEFAULT_TIER_WEIGHTS)
        for k, v in (tier_weights or {}).items():
            if k.upper() not in tw:
                raise ValueError(f"unknown tier {k!r}: expected GPU, CPU or DISK")
            if not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"tier weight for {k} must be in [0, 1], got {v!r}")
            tw[k.upper()] = float(v)
        if speculative_ttl < 0:
            raise ValueError(f"speculative_ttl must be >= 0 seconds, got {speculative_ttl!r}")
        if replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be > 0 seconds, got {replay_timeout!r}")
        if degraded_hold < 0:
            raise ValueError(f"degraded_hold must be >= 0 seconds, got {degraded_hold!r}")
        for cap_name, cap in (("max_blocks_per_worker", max_blocks_per_worker),
                              ("max_blocks_total", max_blocks_total),
                              ("max_speculative_blocks", max_speculative_blocks)):
            if cap is not None and (not isinstance(cap, int) or cap <= 0):
                raise ValueError(f"{cap_name} must be a positive int or None, got {cap!r}")
        if ingest_threads < 1:
            raise ValueError(f"ingest_threads must be >= 1, got {ingest_threads!r}")
        if isinstance(ingest_nice, bool) or not isinstance(ingest_nice, int) or not 0 <= ingest_nice <= 19:
            raise ValueError(f"ingest_nice must be an int in [0, 19], got {ingest_nice!r}")
        self._lmcache = None
        if policy == "lmcache_aware":
            if not lmcache_controller_url or not lmcache_worker_map:
                raise ValueError("lmcache_aware needs lmcache_controller_url and lmcache_worker_map "
                                 "(LMCache instance id -> worker name)")
            from kvroute.lmcache import LMCacheSource

            self._lmcache = LMCacheSource(lmcache_controller_url, lmcache_worker_map,
                                          lookup_mode=lookup_mode,
                                          poll_interval_secs=poll_interval_secs,
                                          timeout_ms=controller_timeout_ms)
        names = [w.name for w in ws]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate workers in {names}")
        self._workers = {w.name: w for w in ws}
        self.block_size = block_size
        self.policy = policy
        self._core = core = _core.Router(
            [(w.name, w.kv_endpoint or "", w.bind, -1 if w.dp_rank is None else w.dp_rank,
              w.replay_endpoint or "") for w in ws],
            _options(policy=policy, fallback_policy=fallback_policy, block_size=block_size,
                     tier_weights=(tw["GPU"], tw["CPU"], tw["DISK"]),
                     max_blocks_per_worker=int(max_blocks_per_worker or 0),
                     max_blocks_total=int(max_blocks_total or 0),
                     max_speculative_blocks=int(max_speculative_blocks or 0),
                     cache_weight=float(cache_weight), virtual_nodes=int(virtual_nodes),
                     prefill_load_scale=float(prefill_load_scale), temperature=float(temperature),
                     cache_threshold=float(cache_threshold),
                     balance_abs_threshold=float(balance_abs_threshold),
                     balance_rel_threshold=float(balance_rel_threshold),
                     eviction_interval_s=float(eviction_interval_secs),
                     max_tree_size=int(max_tree_size), speculative_ttl_s=float(speculative_ttl),
                     seed=int(seed), topic=topic, ingest_threads=int(ingest_threads),
                     ingest_nice=int(ingest_nice), max_payload_bytes=int(max_payload_bytes),
                     max_blocks_per_event=int(max_blocks_per_event),
                     replay_timeout_s=float(replay_timeout), degraded_hold_s=float(degraded_hold)),
        )
        self._ingest = core.ingest

    @classmethod
    def from_config(cls, source: Any) -> "Router":
        """A Router from a YAML file path or a dict in the vLLM router's shape (see
        ``examples/router.yaml`` and `kvroute.config`). Raises `kvroute.config.ConfigError`
        (a ValueError) naming every bad key, type or value."""
        from kvroute.config import router_from_config

        return router_from_config(source)

    @property
    def cache_weight(self) -> float:
        """kv_aware / lmcache_aware: prefix reuse vs load, in ``[0, 1]``. Settable: the
        decisions from then on use the new value (ValueError outside ``[0, 1]``)."""
        return float(self._core.options.params.cache_weight)

    @cache_weight.setter
    def cache_weight(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"cache_weight must be a number in [0, 1], got {value!r}")
        self._core.set_cache_weight(float(value))

    # -- fleet -------------------------------------------------------------------------------
    @property
    def workers(self) -> list[Worker]:
        """The current workers, in the order they were added."""
        return list(self._workers.values())

    def add_worker(self, worker: WorkerLike) -> Worker:
        """Adds a worker and starts ingesting its events. Raises ValueError if it exists."""
        w = _as_worker(worker)
        if w.name in self._workers:
            raise ValueError(f"duplicate worker {w.name!r}")
        self._core.add_worker(w.name, w.kv_endpoint or "", w.bind,
                              -1 if w.dp_rank is None else w.dp_rank, w.replay_endpoint or "")
        self._workers[w.name] = w
        return w

    def remove_worker(self, worker: Union[Worker, str]) -> None:
        """Removes a worker: closes its socket and drops everything it held.

        Raises KeyError for an unknown worker.
        """
        name = worker.name if isinstance(worker, Worker) else worker
        if name not in self._workers:
            raise KeyError(f"unknown worker {name!r}; known: {list(self._workers)}")
        self._core.remove_worker(name)
        del self._workers[name]

    # -- routing -----------------------------------------------------------------------------
    def select_worker(
        self,
        tokens: Any,
        *,
        lora_name: Optional[str] = None,
        cache_salt: Optional[str] = None,
        extra_keys: Optional[Sequence[Optional[Sequence[Any]]]] = None,
        explain: bool = False,
        now: Optional[float] = None,
        session_key: Optional[str] = None,
        exclude: Optional[Iterable[Union[Worker, str]]] = None,
        dry_run: bool = False,
    ) -> Decision:
        """Chooses the worker for one request and accounts its load until `complete`.

        Parameters
        ----------
        tokens:
            Prompt token ids, 1-D: list of ints or integer numpy array, values in ``[0, 2**32)``.
        lora_name, cache_salt, extra_keys:
            As the engine will key the blocks (see `block_keys`).
        explain:
            Fill ``Decision.scores`` with every worker's terms (match, load, score).
        now:
            Clock for speculative entries, in seconds (a simulator's virtual time). Default:
            the monotonic clock. Pass it on every call or on none.
        session_key:
            For ``consistent_hash`` / ``rendezvous_hash`` (see `kvroute.session_key` to take it
            from request headers and body). Default: a hash of the prompt's first 256 tokens.
        exclude:
            Workers (or names) never to choose for this request, e.g. one that just refused
            the connection or whose circuit breaker is open. Scores and load normalisers are
            computed over the others; consistent_hash / rendezvous_hash move only the
            excluded workers' sessions. Unknown names are ignored.
        dry_run:
            Decide without acting on it: no load accounted (``request_id`` 0, nothing to
            `complete`), no speculative credit, nothing learned by ``cache_aware``, the
            round-robin position and random stream untouched. For explain endpoints.

        Returns
        -------
        Decision
            ``worker`` (name), ``matched_tokens`` / ``matched_blocks`` it can reuse,
            ``prefill_tokens``, ``policy`` (the one that decided), ``fallback``, ``reason``
            (``"policy"``, or ``"no_events"`` / ``"all_degraded"`` when the fallback decided),
            ``degraded``, ``request_id``, ``scores``.

        Raises
        ------
        ValueError
            Non-integer, negative or too large token ids; not 1-D.
        NoWorkerAvailable
            ``exclude`` covers every worker (a RuntimeError).
        """
        if (lora_name is None and cache_salt is None and extra_keys is None and not explain
                and now is None and session_key is None and exclude is None and not dry_run
                and self._lmcache is None and type(tokens) in _PLAIN_TOKENS):
            # The common call, tokens only: one C++ call that checks them as _as_tokens does
            # (cpp/bindings/convert.h), ~1.3 us less from Python than the general one.
            return self._core.select_plain(tokens)
        arr = _as_tokens(tokens)
        external = self._lmcache.scores(arr) if self._lmcache is not None else None
        excl = None
        if exclude is not None:
            excl = [w.name if isinstance(w, Worker) else str(w) for w in exclude]
        return self._core.select(
            arr, lora_name or "", _extras(cache_salt, extra_keys), bool(explain),
            -1.0 if now is None else float(now), session_key or "", external, excl,
            bool(dry_run),
        )

    @contextlib.contextmanager
    def route(self, tokens: Any, **kwargs: Any) -> Iterator[Decision]:
        """``with router.route(tokens) as d:`` selects a worker and completes on exit."""
        d = self.select_worker(tokens, **kwargs)
        try:
            yield d
        finally:
            self._core.complete(d.request_id)

    def find_matches(
        self,
        tokens: Any,
        *,
        lora_name: Optional[str] = None,
        cache_salt: Optional[str] = None,
        extra_keys: Optional[Sequence[Optional[Sequence[Any]]]] = None,
    ) -> dict[str, Match]:
        """For every worker, the longest contiguous prefix of ``tokens`` it holds."""
        # The values are already Match tuples (_core._set_match_type below).
        return self._core.find_matches(_as_tokens(tokens), lora_name or "", _extras(cache_salt, extra_keys))

    def complete(self, decision: Union[Decision, int]) -> bool:
        """Releases the load of a finished request. False if it was already released."""
        return self._core.complete(decision if isinstance(decision, int) else decision.request_id)

    def first_token(self, decision: Union[Decision, int]) -> bool:
        """Releases only the prefill part of a request's load (its first token arrived)."""
        return self._core.first_token(decision if isinstance(decision, int) else decision.request_id)

    def update_load(
        self,
        worker: Union[Worker, str],
        *,
        num_requests_waiting: Optional[float] = None,
        kv_cache_usage_perc: Optional[float] = None,
    ) -> None:
        """Records load reported by the engine (e.g. vLLM ``vllm:num_requests_waiting`` and
        ``vllm:kv_cache_usage_perc`` in ``[0, 1]``). ``None`` leaves a signal unchanged.

        Raises KeyError (unknown worker) or ValueError (out of range)."""
        name = worker.name if isinstance(worker, Worker) else worker
        self._core.update_load(name, num_requests_waiting, kv_cache_usage_perc)

    def clear_load(self, worker: Union[Worker, str]) -> None:
        """Forgets the engine-reported load of a worker (``num_requests_waiting`` back to 0,
        ``kv_cache_usage_perc`` unreported), e.g. when its metrics scrape went stale. The
        router's own in-flight accounting is kept. Raises KeyError for an unknown worker."""
        name = worker.name if isinstance(worker, Worker) else worker
        self._core.clear_load(name)

    # -- events ------------------------------------------------------------------------------
    def ingest(self, worker: Union[Worker, str], payload: bytes, seq: Optional[int] = None) -> bool:
        """Applies one KV-event payload as if it came from the worker's socket.

        For engines whose events reach you by another transport. Returns False if the batch
        was dropped (counted in `stats`). Raises KeyError for an unknown worker.
        """
        # Exact type checks first: this runs once per batch, and compare_dynamo.py times it.
        if worker.__class__ is not str:
            worker = worker.name if isinstance(worker, Worker) else worker
        if payload.__class__ is not bytes:
            payload = bytes(payload)
        return self._ingest(worker, payload, seq)

    def worker_blocks(self, worker: Union[Worker, str]) -> dict:
        """What the index holds for one worker: ``{engine hash: (block key, GPU refs, CPU
        refs, disk refs)}``. Integer engine hashes as `decode_batch` shows them; byte-string
        hashes (SGLang, sha256 variants) as the 64-bit digest the index keeps of them (an
        int). O(blocks of the worker); for tests, debugging and audits, not the request
        path."""
        name = worker.name if isinstance(worker, Worker) else worker
        return self._core.worker_blocks(name)

    def stats(self) -> dict:
        """Counters: per worker (sequence, gaps, events, blocks, drops by reason, load) and
        for the index (distinct block keys, entries, speculative entries, memory bytes)."""
        return self._core.stats()

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stops ingestion and joins its threads. Idempotent."""
        self._core.close()
        if getattr(self, "_lmcache", None) is not None:
            self._lmcache.close()

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.close()
