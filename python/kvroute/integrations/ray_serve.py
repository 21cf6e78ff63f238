"""Ray Serve integration: a request router that sends each request to the replica whose
engine holds the longest prefix of its prompt, routed on the engines' real KV events.

Two sides, one convention.

Replica side (the deployment that runs an engine)
-------------------------------------------------
Each replica publishes KV events on its own ZeroMQ endpoint (vLLM ``--kv-events-config``) and
tells the routers where, under the key Ray Serve LLM uses for the same purpose
(``ray/llm/_internal/serve/routing_policies/kv_aware/vllm/kv_events.py``
``get_kv_event_routing_stats``)::

    {"kv_event_metadata": {"endpoint": "tcp://10.0.0.5:5557",     # node-routable, not "*"
                           "replay_endpoint": "tcp://10.0.0.5:6557",  # or None
                           "dp_rank": 0, "block_size": 16}}

from ``record_replica_metadata()`` (Ray Serve 2.60 has it: captured once when the replica
is ready, so routers know the endpoint before its first request) and/or from
``record_routing_stats()`` (polled by the controller every ``request_routing_stats_period_s``,
default 10 s). ``record_routing_stats()`` also carries the engine's load, with vLLM's metric
names and units, and the wall-clock time it was measured::

    {"num_requests_waiting": 3.0, "kv_cache_usage_perc": 0.42, "load_ts": 1718000000.0}

`kv_routing_stats` and `kv_event_metadata` build these dicts;
`kvroute.sim.ray_replica.StandinLLMServer` is a complete replica for tests and examples (the
CPU engine stand-in of `kvroute.sim.server`).

Router side (every process holding a handle to the deployment)
--------------------------------------------------------------
`KvRouteRequestRouter` is a ``ray.serve.request_router.RequestRouter``; select it with
``@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=
KvRouteRequestRouter, request_router_kwargs={...}))``. Ray builds one per deployment handle
(in each ingress replica, in the proxy for an ingress deployment, in a driver), so each owns
a `kvroute.Router` whose workers are the replicas (worker name =
``replica_id.to_full_id_str()``), subscribes to every replica's endpoint on native threads,
and keeps its own in-flight accounting.

Which prompt is routed on (`prompt_of`): the handle call's keyword argument
``prompt_token_ids``, else the call's first positional argument (or ``request=``) read as an
OpenAI-style request body (a mapping, or an object with ``model_dump()`` such as Ray Serve
LLM's ``CompletionRequest`` / ``ChatCompletionRequest``): its ``prompt_token_ids``, a
``prompt`` given as token ids, or, with a tokenizer configured, a text ``prompt``
(``/v1/completions`` rules) or ``messages`` (``/v1/chat/completions`` rules: the model's chat
template, as vLLM renders it; `kvroute.prompt.PromptTokenizer`). Anything else
(an HTTP request object, a batch of prompts, no tokenizer for a text prompt) is routed by
Ray's power of two choices: deliberately fail-open, a request is never refused for routing.

Ray-facing behaviour, as Ray Serve 2.60 calls a request router
(``ray/serve/_private/request_router/request_router.py``, ``ray/serve/_private/router.py``):

* ``choose_replicas`` returns singleton ranks ``[[best], [second], ...]`` in kvroute's score
  order (the chosen worker first); Ray tries them in order and moves on when a replica's
  queue is full (``max_ongoing_requests``). It sets ``should_backoff`` so a fleet that is full
  everywhere backs off instead of spinning.
* While kvroute has no events from any replica (or every replica is degraded), it returns a
  random pair ``[[a, b]]``: Ray picks the one with the shorter queue, which is Ray's own power
  of two choices. Same for requests with no prompt to route on.
* Deliberately not ``FIFOMixin``: that mixin hands a chosen replica to whichever request is
  first in the queue, which would give one prompt's cache to another.
* Load: the decision's in-flight load is released in ``on_request_completed``, which Ray
  calls once per dispatched request when its response finishes or fails (a stream at its
  end); Ray has it since ray-project/ray#60845 (2.60 does), older Ray gets no in-flight
  accounting. Ray has no first-token hook, so the prefill part is released at the end too.
  When Ray sends the request to another replica than kvroute chose (the chosen one was full),
  ``on_request_routed`` moves the accounting to the replica that took it. A request whose
  completion never comes is released after ``decision_ttl_s``.
* Replica set changes (``update_replicas``, ``on_replica_actor_died``) add and remove kvroute
  workers; a replica that has not reported an endpoint yet is a worker without events (it is
  balanced on load) until it does.
* Ray pickles a custom router's module by value (``RequestRouterConfig``:
  ``cloudpickle.register_pickle_by_value``), so the router's methods see a per-process copy of
  this module's globals; shared state lives in the imported module (`live_routers`).

Thread-safety: Ray calls every hook of a request router on one event loop (the handle's router
loop), so the Python state here is not locked. `kvroute.Router` calls are thread-safe; other
threads may read `KvRouteRequestRouter.kvroute_router` ``.stats()`` (see `live_routers`).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import logging
import random
import time
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvroute import _core
from kvroute._router import ROUTER_KEYWORDS, Decision, Router, Worker
from kvroute.session import session_key

__all__ = [
    "KV_EVENT_METADATA_KEY",
    "KvRouteRequestRouter",
    "kv_event_metadata",
    "kv_routing_stats",
    "live_routers",
    "prompt_of",
    "worker_name",
]

log = logging.getLogger("kvroute.integrations.ray_serve")

KV_EVENT_METADATA_KEY = "kv_event_metadata"
"""Key of the KV-event endpoint dict in a replica's routing stats / replica metadata (the key
Ray Serve LLM's ``LLMServer.record_routing_stats`` uses)."""

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
_ROUTER_OPTIONS = ("tokenizer_dir", "tokenizer", "tokenizer_kwargs", "decision_ttl_s",
                   "load_stale_s")
_LIVE: weakref.WeakSet[KvRouteRequestRouter] = weakref.WeakSet()


# --------------------------------------------------------------------------------------------
# Replica side
# --------------------------------------------------------------------------------------------

def _routable(endpoint: Optional[str], node_ip: Optional[str]) -> Optional[str]:
    """``endpoint`` with a wildcard host (``*``, ``0.0.0.0``, ``::``) replaced by the node's
    IP, which is what a router on another node must connect to."""
    if endpoint is None:
        return None
    if (not isinstance(endpoint, str) or "://" not in endpoint
            or ":" not in endpoint.split("://", 1)[1]):
        raise ValueError(f"expected a ZeroMQ tcp endpoint like 'tcp://HOST:PORT', got {endpoint!r}")
    scheme, rest = endpoint.split("://", 1)
    host, port = rest.rsplit(":", 1)
    if port == "*":
        raise ValueError(f"endpoint {endpoint!r} has no port yet: report the bound endpoint")
    if host in _WILDCARD_HOSTS:
        if node_ip is None:
            import ray.util

            node_ip = ray.util.get_node_ip_address()
        host = node_ip
    return f"{scheme}://{host}:{port}"


def kv_event_metadata(
    endpoint: str,
    *,
    replay_endpoint: Optional[str] = None,
    dp_rank: Optional[int] = None,
    block_size: int = 16,
    node_ip: Optional[str] = None,
) -> Dict[str, Any]:
    """The ``kv_event_metadata`` dict a replica reports (see the module docstring).

    Parameters
    ----------
    endpoint:
        Where the engine's KV-event PUB socket is bound (``"tcp://HOST:PORT"``); a wildcard
        host is replaced by ``node_ip``.
    replay_endpoint:
        The engine's replay ROUTER socket (vLLM ``replay_endpoint``), or ``None``.
    dp_rank:
        Data-parallel rank the endpoint publishes for, or ``None``.
    block_size:
        The engine's ``--block-size`` (tokens per KV block).
    node_ip:
        Default: ``ray.util.get_node_ip_address()`` (only asked for when a host is a wildcard).

    Returns
    -------
    dict
        ``{"endpoint": str, "replay_endpoint": Optional[str], "dp_rank": Optional[int],
        "block_size": int}``.

    Raises
    ------
    ValueError
        An endpoint that is not ``tcp://HOST:PORT`` (or still has port ``*``), a bad
        ``block_size`` / ``dp_rank``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)
                                or dp_rank < 0):
        raise ValueError(f"dp_rank must be a non-negative int or None, got {dp_rank!r}")
    return {"endpoint": _routable(endpoint, node_ip),
            "replay_endpoint": _routable(replay_endpoint, node_ip),
            "dp_rank": dp_rank, "block_size": block_size}


def kv_routing_stats(
    metadata: Optional[Mapping[str, Any]] = None,
    *,
    num_requests_waiting: Optional[float] = None,
    kv_cache_usage_perc: Optional[float] = None,
) -> Dict[str, Any]:
    """What a replica's ``record_routing_stats()`` returns for `KvRouteRequestRouter`.

    Parameters
    ----------
    metadata:
        `kv_event_metadata` of the replica (also readable from ``record_replica_metadata``;
        repeating it here serves Ray versions without that hook), or ``None``.
    num_requests_waiting:
        Requests queued in the engine (vLLM ``vllm:num_requests_waiting``), >= 0.
    kv_cache_usage_perc:
        Fraction of the KV cache in use (vLLM ``vllm:kv_cache_usage_perc``), in ``[0, 1]``.

    Returns
    -------
    dict
        ``{"kv_event_metadata": ..., "num_requests_waiting": float, "kv_cache_usage_perc":
        float, "load_ts": float}`` (keys with ``None`` left out; ``load_ts`` = ``time.time()``
        in seconds, present with any load signal).

    Raises
    ------
    ValueError
        A negative queue or a usage outside ``[0, 1]``.
    """
    out: Dict[str, Any] = {}
    if metadata is not None:
        out[KV_EVENT_METADATA_KEY] = dict(metadata)
    if num_requests_waiting is not None:
        if not float(num_requests_waiting) >= 0:
            raise ValueError(f"num_requests_waiting must be >= 0, got {num_requests_waiting!r}")
        out["num_requests_waiting"] = float(num_requests_waiting)
    if kv_cache_usage_perc is not None:
        if not 0.0 <= float(kv_cache_usage_perc) <= 1.0:
            raise ValueError(f"kv_cache_usage_perc must be in [0, 1], got {kv_cache_usage_perc!r}")
        out["kv_cache_usage_perc"] = float(kv_cache_usage_perc)
    if len(out) > (1 if metadata is not None else 0):
        out["load_ts"] = time.time()
    return out


# --------------------------------------------------------------------------------------------
# Router side
# --------------------------------------------------------------------------------------------

def worker_name(replica_id: ReplicaID) -> str:
    """The kvroute worker name of a replica: ``replica_id.to_full_id_str()``."""
    return replica_id.to_full_id_str()


def _as_body(obj: Any) -> Optional[Mapping[str, Any]]:
    if isinstance(obj, Mapping):
        return obj
    dump = getattr(obj, "model_dump", None)  # pydantic v2 models (Ray Serve LLM's requests)
    if callable(dump):
        try:
            out = dump()
        except Exception:  # noqa: BLE001 - not a request model after all
            return None
        return out if isinstance(out, Mapping) else None
    return None


def _id_list(x: Any) -> Optional[np.ndarray]:
    """Token ids given as ids: a list of ints (or a one-element list of one) or a 1-D integer
    array; None if ``x`` is not that shape. Raises ValueError for ids out of [0, 2**32)."""
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, (list, tuple)) and x:
        if len(x) == 1 and isinstance(x[0], (list, tuple, np.ndarray)):
            return _id_list(x[0])
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x):
            return None
        arr = np.asarray(x, dtype=np.int64)
    else:
        return None
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        return None
    if int(arr.min()) < 0 or int(arr.max()) >= 1 << 32:
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype(np.uint32, copy=False)


def prompt_of(args: Sequence[Any], kwargs: Mapping[str, Any]
              ) -> Tuple[Optional[np.ndarray], Optional[str], Optional[Mapping[str, Any]]]:
    """What a handle call routes on (the convention in the module docstring).

    Parameters
    ----------
    args, kwargs:
        The call's positional and keyword arguments (``PendingRequest.args`` / ``.kwargs``).

    Returns
    -------
    (tokens, path, body)
        ``tokens``: ``uint32`` array of shape ``(prompt tokens,)`` when the call carries token
        ids, else ``None``. ``path``: ``"/v1/chat/completions"`` or ``"/v1/completions"``
        when ``body`` must be tokenized (``tokens`` is then ``None``), else ``None``.
        ``body``: the request body mapping, or ``None`` when there is none.

    Raises
    ------
    ValueError
        Token ids outside ``[0, 2**32)``.
    """
    ids = _id_list(kwargs.get("prompt_token_ids")) if "prompt_token_ids" in kwargs else None
    raw = args[0] if args else kwargs.get("request")
    body = _as_body(raw) if raw is not None else None
    if ids is not None:
        return ids, None, body
    if body is None:
        return None, None, None
    for key in ("prompt_token_ids", "prompt"):
        ids = _id_list(body.get(key))
        if ids is not None:
            return ids, None, body
    if body.get("messages") is not None:
        return None, CHAT_COMPLETIONS_PATH, body
    if isinstance(body.get("prompt"), str) or (
            isinstance(body.get("prompt"), list) and len(body["prompt"]) == 1
            and isinstance(body["prompt"][0], str)):
        return None, COMPLETIONS_PATH, body
    return None, None, body


@dataclasses.dataclass
class _Inflight:
    """One request between choose_replicas and on_request_completed."""

    tokens: np.ndarray
    decision: Optional[Decision]  # None: routed by Ray's power of two, not yet accounted
    created: float
    routed_to: Optional[str] = None
    future: Any = None  # the PendingRequest's future when this entry was made
    # Completions still to come from attempts Ray dispatched and a full replica refused (Ray
    # cancels them and resets the request's future): they must not release this request.
    stale: int = 0


class KvRouteRequestRouter(RequestRouter):
    """A Ray Serve request router backed by `kvroute.Router` (see the module docstring).

    Configure it with ``RequestRouterConfig(request_router_class=KvRouteRequestRouter,
    request_router_kwargs={...})``; the kwargs (JSON values) reach `initialize_state`.
    """

    # -- configuration -----------------------------------------------------------------------
    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Ray Serve with ``request_router_kwargs``.

        Parameters
        ----------
        tokenizer_dir:
            Directory with the model's ``tokenizer.json`` and ``tokenizer_config.json``: text
            prompts and chat messages are tokenized as vLLM does
            (`kvroute.prompt.PromptTokenizer`). ``None`` (default): only requests
            carrying token ids are routed on their prefix.
        tokenizer:
            Instead of ``tokenizer_dir``: ``"module:attr"``, a factory called with
            ``tokenizer_kwargs`` that returns an object with ``async aencode_request(path,
            body) -> numpy uint32 array`` (raising ValueError for bodies it cannot tokenize).
        tokenizer_kwargs:
            Keyword arguments of the tokenizer (``PromptTokenizer`` options such as
            ``default_chat_template_kwargs``, or the factory's).
        decision_ttl_s:
            Seconds after which a decision whose completion never arrived is released
            (default 3600).
        load_stale_s:
            Engine-reported load older than this many seconds (``load_ts``) is forgotten
            (`kvroute.Router.clear_load`); default 60.
        **router_kwargs:
            Any keyword of `kvroute.Router` (``policy``, ``block_size``, ``cache_weight``,
            ``speculative_ttl_s``, ...).

        Raises
        ------
        ValueError
            An unknown keyword (the message lists the accepted ones), a bad value, or a
            tokenizer that cannot be loaded.
        """
        allowed = set(ROUTER_KEYWORDS)
        unknown = set(kwargs) - allowed - set(_ROUTER_OPTIONS)
        if unknown:
            raise ValueError(f"unknown KvRouteRequestRouter option(s) {sorted(unknown)}: "
                             f"expected {sorted(_ROUTER_OPTIONS)} or kvroute.Router keywords "
                             f"{sorted(allowed)}")
        self._router_kwargs = {k: v for k, v in kwargs.items() if k in allowed}
        if "policy" in self._router_kwargs and self._router_kwargs["policy"] == "lmcache_aware":
            raise ValueError("policy 'lmcache_aware' needs static worker names; use kv_aware")
        # Validate the router options now, on a throwaway router, so a bad config fails at
        # deployment time rather than on the first request.
        Router([Worker("validate")], **self._router_kwargs).close()
        self.decision_ttl_s = float(kwargs.get("decision_ttl_s", 3600.0))
        self.load_stale_s = float(kwargs.get("load_stale_s", 60.0))
        if not self.decision_ttl_s > 0 or not self.load_stale_s > 0:
            raise ValueError("decision_ttl_s and load_stale_s must be > 0 seconds")
        self.tokenizer = _load_tokenizer(kwargs.get("tokenizer_dir"), kwargs.get("tokenizer"),
                                         kwargs.get("tokenizer_kwargs") or {})
        self._router: Optional[Router] = None
        self._names: Dict[ReplicaID, str] = {}         # replica -> kvroute worker name
        self._replica_of: Dict[str, ReplicaID] = {}    # worker name -> replica
        self._meta: Dict[str, Optional[Tuple]] = {}    # worker name -> (endpoint, replay, rank)
        self._load_ts: Dict[str, float] = {}
        self._inflight: Dict[str, _Inflight] = {}
        self._last_sweep = time.monotonic()
        self.counts: collections.Counter = collections.Counter()
        # Ray calls on_request_completed since ray-project/ray#60845 (2.60 has it). Without
        # it, deliberately account no in-flight load (it could never be released): kvroute
        # then balances on the replicas' reported load, Ray on its queue lengths.
        self._completion_hook = callable(getattr(RequestRouter, "on_request_completed", None))
        # Ray Serve pickles a custom router's module by value (RequestRouterConfig
        # ._serialize_request_router_cls: cloudpickle.register_pickle_by_value), so this
        # method's globals are a copy: register in the imported module, which live_routers reads.
        from kvroute.integrations import ray_serve as home

        home._LIVE.add(self)

    # -- introspection -----------------------------------------------------------------------
    @property
    def kvroute_router(self) -> Optional[Router]:
        """The `kvroute.Router` over the replicas (``None`` until the first replica is known).
        Its ``stats()`` may be read from any thread."""
        return self._router

    def worker_of(self, replica_id: ReplicaID) -> Optional[str]:
        """The kvroute worker name of a replica this router knows, else None."""
        return self._names.get(replica_id)

    def routing_counts(self) -> Dict[str, int]:
        """How requests were routed: ``kvroute`` (by the kvroute policy), ``power_of_two_*``
        (Ray's power of two, by reason: ``no_router``, ``no_prompt``, ``no_tokenizer``,
        ``tokenize_error``, ``no_events``, ``all_degraded``, ``select_error``, ``error``),
        ``reaccounted``
        (Ray sent a request elsewhere than kvroute chose), ``released`` (completions seen),
        ``expired`` (released by ``decision_ttl_s``)."""
        return dict(self.counts)

    def inflight(self) -> int:
        """Requests chosen for and not yet completed."""
        return len(self._inflight)

    # -- replica set -------------------------------------------------------------------------
    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        try:
            self._sync_workers(replicas)
        except Exception:  # noqa: BLE001 - deliberately never break Ray's routing loop
            log.exception("kvroute: failed to update workers from the replica set")

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        name = self._names.get(replica_id)
        if name is not None:
            self._drop_worker(name)

    @staticmethod
    def _endpoint_of(
            replica: RunningReplica) -> Optional[Tuple[str, Optional[str], Optional[int], int]]:
        meta = None
        for source in ("replica_metadata", "routing_stats"):
            try:
                d = getattr(replica, source)
            except AttributeError:  # Ray without record_replica_metadata
                continue
            if isinstance(d, Mapping) and isinstance(d.get(KV_EVENT_METADATA_KEY), Mapping):
                meta = d[KV_EVENT_METADATA_KEY]
                break
        if meta is None or not isinstance(meta.get("endpoint"), str):
            return None
        rank = meta.get("dp_rank")
        return (meta["endpoint"], meta.get("replay_endpoint") or None,
                rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
                int(meta.get("block_size") or 0))

    def _sync_workers(self, replicas: List[RunningReplica]) -> None:
        seen = set()
        for r in replicas:
            name = worker_name(r.replica_id)
            seen.add(name)
            ep = self._endpoint_of(r)
            key = ep[:3] if ep is not None else None
            if name not in self._meta or self._meta[name] != key:
                if name in self._meta:
                    self._drop_worker(name)
                self._add_worker(r.replica_id, name, ep)
            self._apply_load(name, r.routing_stats)
        for name in [n for n in self._meta if n not in seen]:
            self._drop_worker(name)

    def _add_worker(self, replica_id: ReplicaID, name: str,
                    ep: Optional[Tuple[str, Optional[str], Optional[int], int]]) -> None:
        bs = self._router_kwargs.get("block_size", _core.RouterOptions().index.block_size)
        if ep is not None and ep[3] and ep[3] != bs:
            log.error("kvroute: replica %s reports block size %d but the router uses %d; its "
                      "events will be dropped (block_size_mismatch)", name, ep[3], bs)
        # The Worker's url is the replica's name; dp_rank stays out of the name so it maps
        # back to the replica (the rank still filters the events, see kvroute.Worker).
        worker = Worker(name, kv_endpoint=ep[0] if ep else None,
                        replay_endpoint=ep[1] if ep else None)
        try:
            self._add(worker)
        except ValueError as e:
            # Deliberately fail-open: a replica whose endpoint cannot be connected is still a
            # worker (balanced on load, never matched) rather than left out.
            log.warning("kvroute: cannot subscribe to replica %s at %s (%s); routing it on "
                        "load only", name, ep[0] if ep else None, e)
            self._add(Worker(name))
        self._meta[name] = ep[:3] if ep is not None else None
        self._names[replica_id] = name
        self._replica_of[name] = replica_id

    def _add(self, worker: Worker) -> None:
        if self._router is None:
            self._router = Router([worker], **self._router_kwargs)
        else:
            self._router.add_worker(worker)

    def _drop_worker(self, name: str) -> None:
        self._meta.pop(name, None)
        self._load_ts.pop(name, None)
        rid = self._replica_of.pop(name, None)
        if rid is not None:
            self._names.pop(rid, None)
        if self._router is not None and any(w.name == name for w in self._router.workers):
            self._router.remove_worker(name)

    def _apply_load(self, name: str, stats: Mapping[str, Any]) -> None:
        if not isinstance(stats, Mapping) or self._router is None:
            return
        ts = stats.get("load_ts")
        if not isinstance(ts, (int, float)) or ts == self._load_ts.get(name):
            return
        if time.time() - float(ts) > self.load_stale_s:  # already stale: don't steer with it
            return
        waiting, usage = stats.get("num_requests_waiting"), stats.get("kv_cache_usage_perc")
        try:
            self._router.update_load(
                name,
                num_requests_waiting=float(waiting) if isinstance(waiting, (int, float)) else None,
                kv_cache_usage_perc=float(usage) if isinstance(usage, (int, float)) else None)
            self._load_ts[name] = float(ts)
        except (KeyError, ValueError) as e:
            log.warning("kvroute: ignoring load reported by %s: %s", name, e)

    def _housekeeping(self) -> None:
        """Releases expired decisions and forgets stale load; at most once a second."""
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        for iid in [i for i, e in self._inflight.items() if now - e.created > self.decision_ttl_s]:
            self._release(self._inflight.pop(iid))
            self.counts["expired"] += 1
        # Cancelled while queued (the client gave up before Ray dispatched it): no completion
        # hook will fire for it.
        for iid in [i for i, e in self._inflight.items()
                    if e.routed_to is None and e.future is not None and e.future.cancelled()]:
            self._release(self._inflight.pop(iid))
            self.counts["cancelled"] += 1
        wall = time.time()
        for name, ts in list(self._load_ts.items()):
            if wall - ts > self.load_stale_s and self._router is not None:
                try:
                    self._router.clear_load(name)
                except KeyError:
                    pass
                del self._load_ts[name]

    # -- routing -----------------------------------------------------------------------------
    def _power_of_two(self, candidates: List[RunningReplica], reason: str
                      ) -> List[List[RunningReplica]]:
        """Ray's power of two choices: a random pair, Ray takes the shorter queue."""
        self.counts[f"power_of_two_{reason}"] += 1
        if len(candidates) <= 2:
            return [random.sample(candidates, len(candidates))]
        return [random.sample(candidates, 2)]

    async def _tokens(self, pending_request: PendingRequest) -> Tuple[Optional[np.ndarray], str]:
        try:
            ids, path, body = prompt_of(pending_request.args, pending_request.kwargs)
        except ValueError:
            return None, "no_prompt"
        if ids is not None:
            return ids, ""
        if path is None:
            return None, "no_prompt"
        if self.tokenizer is None:
            return None, "no_tokenizer"
        try:
            ids = await self.tokenizer.aencode_request(path, body)
        except ValueError as e:
            log.debug("kvroute: cannot tokenize request %s: %s",
                      pending_request.metadata.request_id, e)
            return None, "tokenize_error"
        return np.asarray(ids, dtype=np.uint32), ""

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        """Ranks the candidates for one request: ``[[chosen], [next best], ...]``, or Ray's
        power of two choices when kvroute cannot decide (see the module docstring)."""
        if pending_request is not None:
            # Back off between full passes when every replica is full (Ray tight-loops
            # otherwise).
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        try:
            return await self._choose(candidate_replicas, pending_request)
        except Exception:  # noqa: BLE001 - deliberately fail-open: Ray's routing task would die
            log.exception("kvroute: choose_replicas failed; power of two decides")
            return self._power_of_two(candidate_replicas, "error")

    async def _choose(self, candidate_replicas: List[RunningReplica],
                      pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        self._housekeeping()
        if pending_request is None or self._router is None:
            return self._power_of_two(candidate_replicas, "no_router")
        iid = pending_request.metadata.internal_request_id
        future = getattr(pending_request, "future", None)
        previous = self._inflight.pop(iid, None)
        stale = 0
        tokens: Optional[np.ndarray]
        if previous is not None:  # a retry: Ray found no room in the earlier ranking
            self._release(previous)
            tokens, why = previous.tokens, ""
            # A reset future means an attempt was dispatched and refused: its (late)
            # on_request_completed belongs to that attempt, not to this one.
            stale = previous.stale + (1 if previous.future is not future else 0)
        else:
            tokens, why = await self._tokens(pending_request)
        if tokens is None or tokens.size == 0:
            return self._power_of_two(candidate_replicas, why or "no_prompt")
        by_name = {self._names[r.replica_id]: r for r in candidate_replicas
                   if r.replica_id in self._names}
        if not by_name:
            return self._power_of_two(candidate_replicas, "no_router")
        exclude = [w.name for w in self._router.workers if w.name not in by_name]
        body = pending_request.args[0] if pending_request.args else None
        skey = session_key(None, body if isinstance(body, Mapping) else None, tokens)
        try:
            d = self._router.select_worker(tokens, explain=True, exclude=exclude or None,
                                           session_key=skey)
        except (ValueError, RuntimeError) as e:
            log.warning("kvroute: select_worker failed (%s); power of two decides", e)
            return self._power_of_two(candidate_replicas, "select_error")
        if d.fallback:  # Ray's power of two decides instead; the load is accounted when routed
            self._router.complete(d)
            if self._completion_hook:
                self._inflight[iid] = _Inflight(tokens, None, time.monotonic(), future=future,
                                                stale=stale)
            return self._power_of_two(candidate_replicas, d.reason)
        self.counts["kvroute"] += 1
        if self._completion_hook:
            self._inflight[iid] = _Inflight(tokens, d, time.monotonic(), future=future,
                                            stale=stale)
        else:
            self._router.complete(d)
        order = sorted((s for s in d.scores if s.worker in by_name and s.worker != d.worker),
                       key=lambda s: -s.score)
        ranked = [by_name[d.worker]] + [by_name[s.worker] for s in order]
        ranked += [r for r in candidate_replicas if r not in ranked]
        return [[r] for r in ranked]

    # -- lifecycle of one request ------------------------------------------------------------
    def _release(self, entry: _Inflight) -> None:
        if entry.decision is not None and self._router is not None:
            self._router.complete(entry.decision)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        """Ray accepted the request on ``replica_id``: move the load there if kvroute chose
        another replica (or Ray's power of two decided)."""
        entry = self._inflight.get(pending_request.metadata.internal_request_id)
        name = self._names.get(replica_id)
        if entry is None or name is None or self._router is None:
            return
        entry.routed_to = name
        if entry.decision is not None and entry.decision.worker == name:
            return
        try:
            self._release(entry)
            # Only `name` is left to choose: the decision's load (and speculative blocks) lands
            # on the replica that took the request.
            others = [w.name for w in self._router.workers if w.name != name]
            entry.decision = self._router.select_worker(entry.tokens, exclude=others or None)
            self.counts["reaccounted"] += 1
        except Exception:  # noqa: BLE001 - never break Ray's send path over accounting
            log.exception("kvroute: could not move the load of a request to %s", name)
            entry.decision = None

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Releases the request's load. A late completion of an attempt Ray retried elsewhere
        (its replica refused it) is ignored."""
        entry = self._inflight.get(internal_request_id)
        if entry is None:
            return
        name = self._names.get(replica_id)
        if entry.routed_to is not None and name is not None and entry.routed_to != name:
            return
        if entry.routed_to is None and entry.stale > 0:  # a refused attempt's completion
            entry.stale -= 1
            self.counts["stale_completions"] += 1
            return
        del self._inflight[internal_request_id]
        try:
            self._release(entry)
        except Exception:  # noqa: BLE001 - runs in Ray's completion callback
            log.exception("kvroute: could not release request %s", internal_request_id)
        self.counts["released"] += 1


def _load_tokenizer(tokenizer_dir: Optional[str], factory: Optional[str],
                    kwargs: Mapping[str, Any]) -> Any:
    if tokenizer_dir is not None and factory is not None:
        raise ValueError("pass tokenizer_dir or tokenizer, not both")
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"tokenizer_kwargs must be an object, got {type(kwargs).__name__}")
    if tokenizer_dir is not None:
        from kvroute.prompt import PromptTokenizer

        return PromptTokenizer.from_dir(tokenizer_dir, **kwargs)
    if factory is None:
        return None
    if not isinstance(factory, str) or ":" not in factory:
        raise ValueError(f"tokenizer must be 'module:attr', got {factory!r}")
    mod, _, attr = factory.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import tokenizer factory {factory!r}: {e}") from e
    tok = obj(**kwargs) if callable(obj) else obj
    if not callable(getattr(tok, "aencode_request", None)):
        raise ValueError(f"{factory} did not give an object with async aencode_request(path, "
                         f"body), got {type(tok).__name__}")
    return tok


def live_routers() -> List[KvRouteRequestRouter]:
    """The `KvRouteRequestRouter` instances alive in this process (one per deployment handle
    whose deployment uses it), e.g. to read ``kvroute_router.stats()`` in an ingress or a test."""
    return list(_LIVE)
