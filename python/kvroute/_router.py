"""The Python face of the native router: `Router`.

`Worker` (`kvroute._worker`), `block_keys` / `decode_batch` (`kvroute._blocks`) and the
keyword checks (`kvroute._router_options`) live in modules of their own, below this one and
below `kvroute.config`; their public names are importable from here as before.
"""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import weakref
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

from kvroute import _core
from kvroute._blocks import _PLAIN_TOKENS, _as_tokens, _extras, block_keys, decode_batch
from kvroute._router_options import (
    _DEFAULTS,
    _POLICY_KEYWORDS,
    _TIERS,
    RENAMED_KEYWORDS,
    _build_policies,
    _cap,
    _check_options,
    _check_worker_map,
    _renamed,
)
from kvroute._worker import Worker, WorkerLike, as_worker
from kvroute.delivered import DeliveredReport, HitRateTracker
from kvroute.policies import POLICIES, KvAware, LmcacheAware, Policy, as_policy

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "POLICIES",
    "RENAMED_KEYWORDS",
    "ROUTER_KEYWORDS",
    "Decision",
    "Match",
    "NoWorkerAvailable",
    "Router",
    "Worker",
    "WorkerLike",
    "WorkerScore",
    "block_keys",
    "decode_batch",
]

Decision = _core.Decision
WorkerScore = _core.WorkerScore
NoWorkerAvailable = _core.NoWorkerAvailable

#: Credit per matched block by its best tier (the native IndexOptions default).
DEFAULT_TIER_WEIGHTS = dict(zip(("GPU", "CPU", "DISK"), _core.RouterOptions().index.tier_weights))


class Match(NamedTuple):
    """Prefix match of one worker: contiguous blocks from the first, as tokens."""

    blocks: int
    tokens: int
    weighted_tokens: float  # tokens x tier weight of the best tier holding each block


_core._set_match_type(Match)


class Router:
    """KV-cache-aware router over a fleet of engine workers.

    Native threads subscribe to every worker's KV-event endpoint and keep an index of which
    worker holds which prefix blocks; `select_worker` answers from it on the caller's thread.

    Every default below is the native default (``cpp/router/router.h`` ``RouterOptions``;
    each policy's knobs: its ``cpp/scoring/<name>.cc``, `kvroute.policies.SCHEMA`), read from
    `kvroute._core`.

    Parameters
    ----------
    workers:
        Non-empty sequence of `Worker` (or a URL string, a ``(url, kv_endpoint)`` tuple, or a
        dict of `Worker` fields).
    policy:
        A `kvroute.policies` object (``KvAware(cache_weight=0.7)``, ``Cost(...)``,
        ``CacheAware(...)``, ``RoundRobin()``, ``Random()``, ``PowerOfTwo()``, ``LeastLoad()``,
        ``ConsistentHash(...)``, ``RendezvousHash()``, ``LmcacheAware(...)``), or its name
        (``"kv_aware"``, the default, ...; see `kvroute.POLICIES`) with its parameters as
        keywords (``**policy_params``). Formulas in ``cpp/scoring/policy.h``.

        kv_aware score of worker w::

            score_w = cache_weight * match_w + (1 - cache_weight) * (1 - load_w)

        ``match_w`` = tier-weighted matched prefix tokens / prompt tokens. ``load_w`` = mean,
        over the load signals present, of: the router's pending prefill tokens on w / the
        fleet maximum; requests on w (router in-flight + reported ``num_requests_waiting``)
        / the fleet maximum; reported ``kv_cache_usage_perc`` (only if some worker reported
        one). Ties go to the lower load, then to a seeded random choice. Once every worker
        queues prefill, the match is multiplied by ``credit_w = 1 / (1 + s * (pending_w -
        min pending) / P)`` and the pending-prefill signal is the projected prefill
        ``pending_w + s * P * (1 - match_w)`` (P = prompt tokens; NVIDIA Dynamo's size-aware
        terms, ``cpp/scoring/kv_aware.cc``), weighted by ``s = (min pending / max
        pending) ** 6`` over the workers (0 while some worker has no pending prefill; 1 with
        ``KvAware(size_aware=True)``); ``explain=True`` shows ``credit_w * match_w`` as the
        match term.
    fallback:
        Policy (object or name) deciding while no worker has delivered any event, every
        worker is degraded, or the LMCache controller is down (decisions say ``fallback``):
        one that needs neither KV events nor a controller (`kvroute.policies.FALLBACK_POLICIES`).
        Default ``power_of_two``. The policy and its fallback each keep their own parameters,
        also those of the same name (``policy=ConsistentHash(virtual_nodes=50),
        fallback=ConsistentHash(virtual_nodes=400)``).
    block_size:
        Tokens per block; must equal the engines' ``--block-size`` (vLLM 16, SGLang often 64).
        Stores with another block size are dropped and counted (``block_size_mismatch``).
    tier_weights:
        Credit per matched block by its best tier, ``{"GPU": 1.0, "CPU": 0.8, "DISK": 0.25}``
        (`DEFAULT_TIER_WEIGHTS`); each in ``[0, 1]``; tiers not given keep their default.
    speculative_ttl_s:
        A chosen worker is credited with the prompt's uncached blocks (so a burst with a new
        shared prefix lands together) until the request's first token (`first_token`, or
        `complete`), however long it queues, and ``speculative_ttl_s`` seconds after (while
        its BlockStored events travel). 0 disables.
    seed:
        Seeds the random choices (ties, random, power_of_two, cost's sampling); an int in
        ``[0, 2**64)``.
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
        Larger payloads / events are dropped and counted (``oversized``). ``max_payload_bytes``
        (default 64 MiB) is also each SUB socket's ``ZMQ_MAXMSGSIZE``: a publisher that sends
        a larger frame is disconnected before the frame is buffered (ZeroMQ reconnects).
    receive_hwm:
        Messages each SUB socket queues (``ZMQ_RCVHWM``, default 100,000) before ZeroMQ stops
        reading from the publisher (a PUB then drops, and the loss shows up as a gap). The
        bytes a socket queues are at most ``receive_hwm * max_payload_bytes``: to bound the
        receive queues in bytes, size the two together (e.g. 1,000 x 4 MiB = 4 GiB per
        socket).
    max_replay_queue_bytes:
        Payload bytes of live messages a worker keeps while a replay fills its gap (default
        64 MiB; also at most 65,536 messages). Past it live messages are dropped (counted in
        ``stats()`` ``replay_queue_dropped``) and become the next gap.
    stale_after_s:
        Seconds of silence (no message at all: no events, no empty batch) after which an
        ``exact`` worker shows as ``"stale"`` in ``stats()``; counted from the worker's join.
        Decisions treat a stale worker as degraded: choosing it sets ``Decision.degraded``,
        and when every worker is degraded or stale ``kv_aware`` decides with the fallback
        (reason ``"all_degraded"``). Its indexed blocks are kept. Default 0: off (an idle
        engine publishes nothing, so the limit must exceed the fleet's idle gaps).
    allowed_publisher_ips:
        IP addresses (e.g. ``["10.0.0.5", "::1"]``) from which a bound SUB socket
        (``Worker(bind=True)``) accepts publishers; others are refused during ZeroMQ's
        handshake (a ZAP handler). Default ``None``: any. Connected sockets are not filtered:
        the router chose their endpoint. ValueError for a string that is not an IP address.
    curve_secret_key:
        The router's CurveZMQ secret key (Z85, 40 characters; ``zmq.curve_keypair()``). Every
        bound SUB socket is then a CURVE server with it: a publisher connects with
        `curve_public_key` as its ``curve_serverkey`` (and a key pair of its own), its events
        are encrypted, and a publisher without it cannot complete the handshake. Connected
        workers with a ``curve_server_key`` authenticate with it. Default ``None``: bound
        sockets use ZeroMQ's NULL mechanism (no authentication).
    curve_allowed_publisher_keys:
        Publisher public keys (Z85) a bound CURVE socket accepts, checked during the handshake
        (the ZAP handler, with ``allowed_publisher_ips`` when both are set). Needs
        ``curve_secret_key``. Default ``None``: any publisher that knows the router's public
        key.
    replay_timeout_s:
        Seconds one replay exchange may take (the worker's ingestion thread waits for it).
    degraded_hold_s:
        Seconds a worker stays ``degraded`` after its state was dropped (unless it sends
        AllBlocksCleared first). Decisions for a degraded worker say ``degraded``; when every
        worker is degraded, ``kv_aware`` decides with the fallback.
    max_blocks_per_worker, max_blocks_total:
        Memory caps on indexed blocks (``None`` = no cap): past a cap the least recently
        stored blocks are dropped first and counted (``evicted_by_cap``). Defaults: 4Mi per
        worker (64Mi tokens at block size 16), 32Mi in total.
    max_speculative_blocks:
        Cap on the blocks of live speculative credits (``None`` = no cap; default 4Mi, 32 MiB
        of keys): past it the credits given longest ago are dropped first (``stats()
        ["speculative_dropped"]``), and a longer credit keeps its first blocks. Credits hold
        (decisions waiting for their first token + decisions x ``speculative_ttl_s``) x unmatched
        blocks.
    **policy_params:
        With ``policy`` / ``fallback`` given by name: their parameters, under the field names
        of the `kvroute.policies` classes (``cache_weight``, ``virtual_nodes``,
        ``prefill_load_scale``, ``temperature``, ``cache_threshold``,
        ``balance_abs_threshold``, ``balance_rel_threshold``, ``eviction_interval_s``,
        ``max_tree_size``, ``lookup_mode``, ``poll_interval_s``, ``controller_timeout_ms``),
        and ``lmcache_controller_url`` / ``lmcache_worker_map`` for `LmcacheAware`'s
        ``controller_url`` / ``worker_map``. A parameter of neither policy is checked and
        unused. Deprecated aliases (DeprecationWarning): ``speculative_ttl``,
        ``replay_timeout``, ``degraded_hold``, ``eviction_interval_secs``,
        ``poll_interval_secs``, ``fallback_policy`` (see `RENAMED_KEYWORDS`).

    Raises
    ------
    ValueError
        Empty worker list, duplicate worker, unknown policy, a fallback that needs KV events
        or a controller, an `LmcacheAware` ``worker_map`` value naming no worker, bad
        parameter or option values (one message naming each and what was expected; the
        config loader applies the same rules to the same keys), a parameter given
        both as a keyword and in a policy object, or an endpoint that cannot be connected or
        bound.
    TypeError
        A keyword the Router does not know.
    """

    def __init__(
        self,
        workers: Sequence[WorkerLike],
        *,
        policy: Union[Policy, str, None] = None,
        fallback: Union[Policy, str, None] = None,
        block_size: int = _DEFAULTS.index.block_size,
        tier_weights: Optional[Mapping[str, float]] = None,
        speculative_ttl_s: float = _DEFAULTS.speculative_ttl_s,
        seed: int = _DEFAULTS.seed,
        topic: str = _DEFAULTS.topic,
        ingest_threads: int = _DEFAULTS.ingest_threads,
        ingest_nice: int = _DEFAULTS.ingest_nice,
        max_payload_bytes: int = _DEFAULTS.limits.max_payload_bytes,
        max_blocks_per_event: int = _DEFAULTS.limits.max_blocks_per_event,
        replay_timeout_s: float = _DEFAULTS.replay_timeout_s,
        degraded_hold_s: float = _DEFAULTS.degraded_hold_s,
        receive_hwm: int = _DEFAULTS.receive_hwm,
        max_replay_queue_bytes: int = _DEFAULTS.max_replay_queue_bytes,
        stale_after_s: float = _DEFAULTS.stale_after_s,
        allowed_publisher_ips: Optional[Sequence[str]] = None,
        curve_secret_key: Optional[str] = None,
        curve_allowed_publisher_keys: Optional[Sequence[str]] = None,
        max_blocks_per_worker: Optional[int] = _cap(_DEFAULTS.index.max_blocks_per_worker),
        max_blocks_total: Optional[int] = _cap(_DEFAULTS.index.max_blocks_total),
        max_speculative_blocks: Optional[int] = _cap(_DEFAULTS.index.max_speculative_blocks),
        **policy_params: Any,
    ) -> None:
        kw = _renamed(policy_params, stacklevel=2)
        if "fallback" in kw:
            if fallback is not None:
                raise TypeError("give fallback or its deprecated alias fallback_policy, not both")
            fallback = kw.pop("fallback")
        explicit = {"speculative_ttl_s": speculative_ttl_s, "replay_timeout_s": replay_timeout_s,
                    "degraded_hold_s": degraded_hold_s}
        for name, value in explicit.items():  # a deprecated alias of an explicit keyword
            if name in kw and value != getattr(_DEFAULTS, name):
                raise TypeError(f"give {name} or its deprecated alias, not both")
            explicit[name] = kw.pop(name, value)
        speculative_ttl_s, replay_timeout_s, degraded_hold_s = explicit.values()
        unknown = sorted(set(kw) - set(_POLICY_KEYWORDS))
        if unknown:
            plural = "s" if len(unknown) > 1 else ""
            raise TypeError(f"Router() got unexpected keyword argument{plural} "
                            f"{', '.join(repr(k) for k in unknown)}")
        ws = [as_worker(w) for w in (workers or [])]
        if not ws:
            raise ValueError("workers must be a non-empty sequence of Worker")
        pol, fb, other = _build_policies(policy, fallback,
                                  {_POLICY_KEYWORDS[k]: v for k, v in kw.items()})
        _check_worker_map(pol, ws)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        tw = dict(DEFAULT_TIER_WEIGHTS)
        for k, v in (tier_weights or {}).items():
            if k.upper() not in tw:
                raise ValueError(f"unknown tier {k!r}: expected GPU, CPU or DISK")
            if not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"tier weight for {k} must be in [0, 1], got {v!r}")
            tw[k.upper()] = float(v)
        _check_options(speculative_ttl_s=speculative_ttl_s, replay_timeout_s=replay_timeout_s,
                       degraded_hold_s=degraded_hold_s, seed=seed, topic=topic,
                       ingest_threads=ingest_threads, ingest_nice=ingest_nice,
                       max_payload_bytes=max_payload_bytes,
                       max_blocks_per_event=max_blocks_per_event,
                       max_blocks_per_worker=max_blocks_per_worker,
                       max_blocks_total=max_blocks_total,
                       max_speculative_blocks=max_speculative_blocks,
                       stale_after_s=stale_after_s, receive_hwm=receive_hwm,
                       max_replay_queue_bytes=max_replay_queue_bytes,
                       curve_secret_key=curve_secret_key,
                       curve_allowed_publisher_keys=curve_allowed_publisher_keys)
        if curve_allowed_publisher_keys and curve_secret_key is None:
            raise ValueError("curve_allowed_publisher_keys needs curve_secret_key (bound sockets "
                             "are CURVE servers with it)")
        uses_curve = curve_secret_key is not None or any(w.curve_server_key for w in ws)
        if uses_curve and not _core.curve_available():
            raise ValueError("CURVE keys given, but this libzmq has no CURVE (built without "
                             "libsodium)")
        allowed_ips = []
        for ip in allowed_publisher_ips or ():
            try:
                allowed_ips.append(str(ipaddress.ip_address(ip)))
            except ValueError:
                raise ValueError(f"allowed_publisher_ips: {ip!r} is not an IP address") from None
        names = [w.name for w in ws]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate workers in {names}")

        o = _core.RouterOptions()
        fb.write(o, as_fallback=True)
        pol.write(o)
        # Flat keywords of neither policy: checked, unused; cache_weight reads them back.
        self._other_knobs = dict(other)
        ix = o.index
        ix.block_size = block_size
        ix.tier_weights = [tw[t] for t in _TIERS]
        ix.max_blocks_per_worker = int(max_blocks_per_worker or 0)
        ix.max_blocks_total = int(max_blocks_total or 0)
        ix.max_speculative_blocks = int(max_speculative_blocks or 0)
        o.speculative_ttl_s = float(speculative_ttl_s)
        o.seed = int(seed)
        o.topic = topic
        o.ingest_threads = int(ingest_threads)
        o.ingest_nice = int(ingest_nice)
        o.replay_timeout_s = float(replay_timeout_s)
        o.degraded_hold_s = float(degraded_hold_s)
        o.receive_hwm = receive_hwm
        o.max_replay_queue_bytes = max_replay_queue_bytes
        o.stale_after_s = float(stale_after_s)
        o.allowed_publisher_ips = allowed_ips
        o.curve_secret_key = curve_secret_key or ""
        o.curve_allowed_publisher_keys = list(curve_allowed_publisher_keys or ())
        o.limits.max_payload_bytes = int(max_payload_bytes)
        o.limits.max_blocks_per_event = int(max_blocks_per_event)

        self._lmcache = None
        if isinstance(pol, LmcacheAware):
            from kvroute.lmcache import LMCacheSource  # httpx, only for this policy

            self._lmcache = LMCacheSource.from_policy(pol)
        self._workers = {w.name: w for w in ws}
        self.block_size = block_size
        self.policy = pol.name
        try:
            self._core = core = _core.Router(
                [(w.name, w.kv_endpoint or "", w.bind, -1 if w.dp_rank is None else w.dp_rank,
                  w.replay_endpoint or "", w.curve_server_key or "") for w in ws], o)
        except BaseException:
            if self._lmcache is not None:
                self._lmcache.close()
            raise
        self._ingest = core.ingest
        me = weakref.ref(self)  # no cycle: dropping the last reference closes the router

        def stats() -> dict:
            r = me()
            return r.stats() if r is not None else {}

        self._hits = HitRateTracker(block_size, worker_stats=stats)

    @classmethod
    def from_config(cls, source: Any) -> Router:
        """A Router from a YAML file path or a dict in the vLLM router's shape (see
        ``examples/router.yaml`` and `kvroute.config`). Raises `kvroute.config.ConfigError`
        (a ValueError) naming every bad key, type or value."""
        # The loader only: kvroute.config.build (router_from_config) imports this module.
        from kvroute.config.loader import regular_router_args

        workers, kwargs = regular_router_args(source)
        return cls(workers, **kwargs)

    def set_policy(self, policy: Union[Policy, str],
                   fallback: Union[Policy, str, None] = None) -> None:
        """Replaces the policy (and the fallback, when given) for the decisions from then on,
        e.g. on a configuration reload; requests in flight keep their load.

        A policy of the same name keeps its state (cache_aware's tree of past decisions); a
        new name starts afresh. The policy (and the fallback, when given) takes the knobs of
        its object (a name alone means that policy's defaults); a fallback not given keeps
        its own.
        ``lmcache_aware`` cannot be switched to or from at run time (its controller client
        is built with the router).

        Raises ValueError for an unknown name, a knob out of range, a fallback that needs the
        KV-event index or a controller, or a switch to or from ``lmcache_aware``; nothing
        changes then."""
        pol = as_policy(policy)
        fb = None if fallback is None else as_policy(fallback, "fallback")
        if isinstance(pol, LmcacheAware) != (self._lmcache is not None):
            raise ValueError("lmcache_aware cannot be switched to or from at run time: "
                             "build a new Router")
        o = self._core.options
        if fb is not None:
            fb.write(o, as_fallback=True)
        pol.write(o)
        self._core.set_policy(o.policy, o.policy_params, o.fallback, o.fallback_params)
        self.policy = pol.name

    @property
    def cache_weight(self) -> float:
        """kv_aware / lmcache_aware: prefix reuse vs load, in ``[0, 1]``. Settable: the
        decisions from then on use the new value (ValueError outside ``[0, 1]``). For a
        policy without the knob: the value last given (unused), else kv_aware's default."""
        knobs = self._core.options.policy_params
        if "cache_weight" in knobs:
            return float(knobs["cache_weight"])
        return float(getattr(self, "_other_knobs", {}).get("cache_weight", KvAware.cache_weight))

    @cache_weight.setter
    def cache_weight(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0.0 <= value <= 1.0:
            raise ValueError(f"cache_weight must be a number in [0, 1], got {value!r}")
        if "cache_weight" in self._core.options.policy_params:
            self._core.set_policy_param("cache_weight", float(value))
        else:
            self.__dict__.setdefault("_other_knobs", {})["cache_weight"] = float(value)

    @property
    def speculative_ttl_s(self) -> float:
        """Seconds a speculative credit lives after its request's first token (or completion);
        0 = no credits. Settable: credits given or released from then on use the new value
        (the ones already counting down keep their expiry); ValueError below 0."""
        return float(self._core.speculative_ttl_s)

    @speculative_ttl_s.setter
    def speculative_ttl_s(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"speculative_ttl_s must be a number >= 0, got {value!r}")
        self._core.set_speculative_ttl(float(value))

    @property
    def curve_public_key(self) -> Optional[str]:
        """The router's CurveZMQ public key (Z85, 40 characters) from ``curve_secret_key``:
        what publishers of bound workers set as their ``curve_serverkey``. None without a
        ``curve_secret_key``."""
        secret = self._core.options.curve_secret_key
        return _core.curve_public_key(secret) if secret else None

    # -- fleet -------------------------------------------------------------------------------
    @property
    def workers(self) -> list[Worker]:
        """The current workers, in the order they were added."""
        return list(self._workers.values())

    def add_worker(self, worker: WorkerLike) -> Worker:
        """Adds a worker and starts ingesting its events. Raises ValueError if it exists."""
        w = as_worker(worker)
        if w.name in self._workers:
            raise ValueError(f"duplicate worker {w.name!r}")
        self._core.add_worker(w.name, w.kv_endpoint or "", w.bind,
                              -1 if w.dp_rank is None else w.dp_rank, w.replay_endpoint or "",
                              w.curve_server_key or "")
        self._workers[w.name] = w
        return w

    def remove_worker(self, worker: Union[Worker, str]) -> None:
        """Removes a worker: closes its socket and drops everything it held.

        Raises KeyError for an unknown worker, RuntimeError ``"router is closed"`` after
        `close`.
        """
        name = worker.name if isinstance(worker, Worker) else worker
        if name not in self._workers:
            raise KeyError(f"unknown worker {name!r}; known: {list(self._workers)}")
        self._core.remove_worker(name)
        del self._workers[name]
        self._hits.forget_worker(name)

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
            Prompt token ids, 1-D, values in ``[0, 2**32)``: a list of ints (on CPython 3.11
            1.68 ns per token more than an array, median, see `block_keys`), or, read in place, a
            C-contiguous ``uint32`` numpy array, ``array.array('I')`` or buffer of 4-byte
            unsigned items; other integer dtypes and formats are copied. See `block_keys`
            for every container.
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
            ``available_tokens`` / ``available_blocks`` (the best match of any worker,
            excluded ones too: what the fleet could have reused),
            ``prefill_tokens``, ``policy`` (the one that decided), ``fallback``, ``reason``
            (``"policy"``, or ``"no_events"`` / ``"all_degraded"`` when the fallback decided),
            ``degraded``, ``request_id``, ``scores``.

        Raises
        ------
        ValueError
            Non-integer, negative or too large token ids; not 1-D; a buffer of a non-integer
            format.
        NoWorkerAvailable
            ``exclude`` covers every worker (a RuntimeError).
        RuntimeError
            ``"router is closed"``: `close` was called.
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
        return self._core.find_matches(_as_tokens(tokens), lora_name or "",
                                       _extras(cache_salt, extra_keys))

    def complete(self, decision: Union[Decision, int]) -> bool:
        """Releases the load of a finished request. False if it was already released."""
        return self._core.complete(decision if isinstance(decision, int) else decision.request_id)

    def first_token(self, decision: Union[Decision, int]) -> bool:
        """Releases only the prefill part of a request's load (its first token arrived)."""
        rid = decision if isinstance(decision, int) else decision.request_id
        return self._core.first_token(rid)

    def report_delivered(self, decision: Decision, cached_tokens: Optional[int], *,
                         prompt_tokens: Optional[int] = None) -> DeliveredReport:
        """Reports what the engine reused for a routed request, closing the loop between
        what the router predicted and what was delivered (`kvroute.delivered`).

        Counts the request's available (``decision.available_tokens``), captured
        (``decision.matched_tokens``) and delivered (``cached_tokens``) prompt tokens in
        `hit_rate`, the prediction error ``(captured - delivered) / prompt_tokens`` of its
        worker, and logs a warning (logger ``kvroute.delivered``, at most once a minute per
        worker) naming the likely cause when captured and delivered stay apart over the
        worker's recent requests.

        Parameters
        ----------
        decision:
            The request's `Decision`.
        cached_tokens:
            The engine's count of prompt tokens served from its prefix cache: vLLM / SGLang
            ``usage.prompt_tokens_details.cached_tokens`` (`kvroute.delivered.parse_usage`
            reads it from a response), or ``None`` when the response had none.
        prompt_tokens:
            The engine's ``usage.prompt_tokens``, when known: a length different from
            ``decision.prompt_tokens`` points at a tokenization or chat-template mismatch,
            and a response with usage but no count reads as 0 cached tokens once the worker
            has reported a count before (both engines leave a zero count out).

        Returns
        -------
        kvroute.delivered.DeliveredReport
            The three numbers as counted (``delivered_tokens`` None: not counted).

        Raises
        ------
        ValueError
            A negative or non-integer count.
        """
        return self._hits.record(decision, cached_tokens, prompt_tokens)

    @property
    def hit_rate(self) -> HitRateTracker:
        """The sums of available / captured / delivered prompt tokens over the requests
        reported with `report_delivered`, per worker and in total
        (`kvroute.delivered.HitRateTracker.snapshot`)."""
        return self._hits

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

    def set_peer_load(self, worker: Union[Worker, str], inflight: int, pending_prefill: int,
                      active_blocks: int) -> None:
        """The other router replicas' load on a worker (`kvroute.serving.shared_load`): their
        requests in flight, pending prefill tokens and active prompt blocks, summed. Replaces
        the previous counts (all 0: none); decisions add them to this router's own.
        ``stats()`` shows them as ``peer_inflight_requests``, ``peer_pending_prefill_tokens``,
        ``peer_active_blocks``. Raises KeyError (unknown worker), ValueError (negative)."""
        name = worker.name if isinstance(worker, Worker) else worker
        self._core.set_peer_load(name, int(inflight), int(pending_prefill), int(active_blocks))

    def local_load(self) -> list:
        """This router's own load, for its peer replicas: ``[(worker name, requests in
        flight, pending prefill tokens, active prompt blocks)]``, workers with all three 0
        left out. O(workers), no index or stream lock (cheaper than `stats`: 1,000 workers
        in well under a millisecond)."""
        return self._core.local_load()

    def add_speculative(self, worker: Union[Worker, str], keys: Any, ttl_s: float) -> None:
        """Credits a worker with block keys (`block_keys` values, ``uint64``) for ``ttl_s``
        seconds from now, as if a decision of this router had sent them there: another
        replica's speculative credit. Raises KeyError (unknown worker), ValueError
        (``ttl_s < 0``)."""
        name = worker.name if isinstance(worker, Worker) else worker
        self._core.add_speculative(name, np.asarray(keys, dtype=np.uint64).tolist(),
                                   float(ttl_s))

    def dump_worker(self, worker: Union[Worker, str]) -> tuple:
        """``(position, entries)``: the worker's part of the index as `kvroute.snapshot`
        packs it (``entries``: bytes, 24 per engine hash) and the stream position it stands
        at (``position``: ``seen_seq``, ``last_seq``, ``have_hash``, ``last_hash`` = XXH3-64
        of the last batch's payload, ``recovering``, ``state``, ``entries``), read under the
        worker's stream lock. O(blocks of the worker). Raises KeyError."""
        name = worker.name if isinstance(worker, Worker) else worker
        return self._core.dump_worker(name)

    def restore_worker(self, worker: Union[Worker, str], entries: bytes, last_seq: int,
                       last_hash: Optional[int] = None) -> bool:
        """Replaces the worker's part of the index with a peer's `dump_worker` and continues
        its event stream from ``last_seq``: with a replay endpoint the engine is asked for
        every batch after it, and its copy of batch ``last_seq`` must hash to ``last_hash``
        (else the engine restarted since: the restored state is dropped and the new process
        replayed). False, nothing changed, while the worker is recovering, or when it has
        seen events and has no replay endpoint. Raises KeyError, ValueError (``entries`` not
        a multiple of 24 bytes), RuntimeError after `close`."""
        name = worker.name if isinstance(worker, Worker) else worker
        return self._core.restore_worker(name, bytes(entries), int(last_seq),
                                         last_hash is not None, int(last_hash or 0))

    # -- events ------------------------------------------------------------------------------
    def ingest(self, worker: Union[Worker, str], payload: bytes, seq: Optional[int] = None) -> bool:
        """Applies one KV-event payload as if it came from the worker's socket.

        For engines whose events reach you by another transport. Returns False if the batch
        was dropped (counted in `stats`). Raises KeyError for an unknown worker,
        RuntimeError ``"router is closed"`` after `close`.
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
        """Stops ingestion and joins its threads. Idempotent. Afterwards `select_worker`,
        `ingest`, `add_worker` and `remove_worker` raise RuntimeError ("router is closed");
        `stats` still answers. Returns after the message each ingestion thread is handling,
        not after the queued backlog (cpp/events/README.md, "Subscriber")."""
        self._core.close()
        lmcache = getattr(self, "_lmcache", None)
        if lmcache is not None:
            lmcache.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.close()


#: Every keyword `Router` accepts besides ``workers``: its named keywords, the flat policy
#: keywords and the deprecated aliases.
ROUTER_KEYWORDS = frozenset(
    (set(inspect.signature(Router.__init__).parameters) - {"self", "workers", "policy_params"})
    | set(_POLICY_KEYWORDS) | set(RENAMED_KEYWORDS))
