"""LiteLLM integration: kvroute picks the deployment of a LiteLLM ``Router`` model group.

LiteLLM's ``Router`` (``litellm/router.py``) lets a caller replace its deployment choice with
``Router.set_custom_routing_strategy(strategy)``, where ``strategy`` subclasses
``litellm.types.router.CustomRoutingStrategyBase`` and implements
``async_get_available_deployment(model, messages, input, specific_deployment, request_kwargs)``
(and the sync ``get_available_deployment``). `KvRouteRoutingStrategy` is such a strategy:

1. It asks LiteLLM for the group's healthy deployments
   (``Router.async_get_healthy_deployments``: cooldowns, tags, ``order``, pre-call checks are
   applied exactly as for LiteLLM's own strategies).
2. It tokenizes the request as the engine will (chat ``messages`` through the model's chat
   template, ``prompt`` / ``input`` as text or token ids) and asks a `kvroute.Router` whose
   workers are the deployments' ``api_base`` URLs, each subscribed to its engine's KV events,
   which of the healthy ones to use (``exclude`` = the others, and on a retry the workers
   this request already failed on, unless that leaves none).
3. A LiteLLM callback (``CustomLogger``) releases the decision's in-flight load when the call
   ends: the attempt failed, the response arrived, or a stream was read to its end.

LiteLLM's newer ``Router(plugins=[...])`` routing plugins (``RoutingPlugin.run(context)``) can
only narrow ``candidate_models`` by ``litellm_params.model``, which is the same for every
engine of a model group, so they cannot choose among a group's deployments; the custom
strategy is the hook that can.

Which deployments kvroute routes
--------------------------------
A model group is routed by kvroute when at least one of its deployments names its engine's
KV-event endpoint in ``model_info``::

    model_list:
      - model_name: qwen3
        litellm_params:
          model: openai/Qwen/Qwen3-0.6B         # vLLM's OpenAI-compatible server
          api_base: http://10.0.0.5:8000/v1     # the kvroute worker's identity
          api_key: none
        model_info:
          kv_events: tcp://10.0.0.5:5557        # vLLM --kv-events-config "endpoint"
          kv_replay: tcp://10.0.0.5:5558        # optional: "replay_endpoint"
          kv_block_size: 16                     # optional: the engine's --block-size (default 16)
          tokenizer: /models/Qwen3-0.6B         # optional: tokenizer.json + tokenizer_config.json

Keys go in ``model_info``, not ``litellm_params``: LiteLLM forwards unknown ``litellm_params``
to the provider call. Every deployment of a group must agree on ``kv_block_size`` and
``tokenizer``. Other groups (hosted APIs, engines without events) keep LiteLLM's
``simple-shuffle`` choice (``weight`` / ``rpm`` / ``tpm`` weighted random).

Setup
-----
::

    llm_router = litellm.Router(model_list=model_list, num_retries=2)
    strategy = KvRouteRoutingStrategy(llm_router, tokenizer="/models/Qwen3-0.6B")
    strategy.install()       # set_custom_routing_strategy + the release callback
    ...
    strategy.close()         # uninstalls, closes the kvroute routers

or `kvroute_litellm_router` from a LiteLLM-proxy-shaped YAML / dict.

Thread safety: routing runs on the caller's event loop (or thread, for the sync API); the
release callback may run on LiteLLM's logging threads. The table of open decisions is guarded
by a lock; `kvroute.Router` itself is thread-safe.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

try:
    import litellm
    from litellm.integrations.custom_logger import CustomLogger
    from litellm.types.router import CustomRoutingStrategyBase
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvroute.integrations.litellm needs LiteLLM: pip install 'kvroute[litellm]' "
        "(or pip install litellm)"
    ) from e

import kvroute
from kvroute._router import NoWorkerAvailable
from kvroute.prompt import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, PromptTokenizer

__all__ = [
    "METADATA_MATCHED_TOKENS",
    "METADATA_REQUEST_ID",
    "METADATA_TRIED",
    "METADATA_WORKER",
    "KvRouteRoutingStrategy",
    "kvroute_litellm_router",
    "strategy_for",
]

#: Metadata key (in the request's ``metadata`` / ``litellm_metadata``) holding the id of the
#: open kvroute decision of the current attempt; the release callback reads it back.
METADATA_REQUEST_ID = "kvroute_request_id"
#: Metadata key with the chosen worker (the deployment's ``api_base``).
METADATA_WORKER = "kvroute_worker"
#: Metadata key with the prompt tokens the chosen worker already holds
#: (``Decision.matched_tokens``).
METADATA_MATCHED_TOKENS = "kvroute_matched_tokens"
#: Workers already tried by earlier attempts of the same request (retries exclude them).
METADATA_TRIED = "kvroute_tried_workers"
METADATA_TRACE = "kvroute_trace_id"


_STRATEGIES: weakref.WeakKeyDictionary[Any, KvRouteRoutingStrategy] = weakref.WeakKeyDictionary()


def strategy_for(llm_router: Any) -> Optional[KvRouteRoutingStrategy]:
    """The installed `KvRouteRoutingStrategy` of a ``litellm.Router``, or ``None``."""
    return _STRATEGIES.get(llm_router)


# -- tokenization -----------------------------------------------------------------------------
_TOKENIZERS: Dict[str, PromptTokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()

# Request fields vLLM reads when it tokenizes (kvroute.prompt.PromptTokenizer.
# encode_request); LiteLLM hands them over as keyword arguments or inside ``extra_body``.
_CHAT_FIELDS: Tuple[str, ...] = (
    "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "add_special_tokens", "chat_template")
_COMPLETION_FIELDS: Tuple[str, ...] = ("add_special_tokens",)


def _tokenizer_at(path: Union[str, os.PathLike]) -> PromptTokenizer:
    """One shared `PromptTokenizer` per tokenizer directory."""
    key = str(Path(path).resolve())
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            tok = _TOKENIZERS[key] = PromptTokenizer.from_dir(key)
        return tok


# -- open decisions ----------------------------------------------------------------------------
@dataclass
class _Group:
    """One kvroute-routed model group: its kvroute Router and deployments by worker name."""

    name: str
    router: kvroute.Router
    tokenizer: Optional[PromptTokenizer]
    tokenizer_path: Optional[str]
    deployments: Dict[str, List[str]]  # worker name (api_base) -> deployment ids


@dataclass
class _Open:
    group: _Group
    decision: Any
    started: float


@dataclass
class _Counters:
    routed: int = 0
    released_success: int = 0
    released_failure: int = 0
    released_retry: int = 0
    expired: int = 0
    shuffled: int = 0
    tokenize_errors: int = 0
    by_worker: Dict[str, int] = field(default_factory=dict)


def _api_base(deployment: Mapping[str, Any]) -> Optional[str]:
    base = (deployment.get("litellm_params") or {}).get("api_base")
    return str(base) if base else None


def _model_info(deployment: Mapping[str, Any]) -> Mapping[str, Any]:
    return deployment.get("model_info") or {}


def _deployment_id(deployment: Mapping[str, Any]) -> str:
    return str(_model_info(deployment).get("id"))


def _metadata_key(request_kwargs: Mapping[str, Any]) -> str:
    # LiteLLM keeps router metadata in "litellm_metadata" for some endpoints (batches, files,
    # responses) and in "metadata" otherwise (get_router_metadata_variable_name).
    if "litellm_metadata" in request_kwargs and "metadata" not in request_kwargs:
        return "litellm_metadata"
    return "metadata"


def _request_param(request_kwargs: Mapping[str, Any], name: str) -> Any:
    if name in request_kwargs:
        return request_kwargs[name]
    extra = request_kwargs.get("extra_body")
    if isinstance(extra, Mapping):
        return extra.get(name)
    return None


def _called_for_text_completion() -> bool:
    """True when the routing call comes from ``Router.(a)text_completion``.

    Deliberately read from the caller's frame: LiteLLM routes a text completion with
    ``messages=[{"role": "user", "content": prompt}]`` and no other trace of the prompt in
    ``request_kwargs``, which would otherwise be indistinguishable from a one-message chat
    (whose tokens differ by the chat template)."""
    import sys

    f: Optional[FrameType] = sys._getframe(2)
    for _ in range(6):
        if f is None:
            break
        name = f.f_code.co_name
        if name in ("_atext_completion", "text_completion", "atext_completion"):
            return True
        if name in ("_acompletion", "_completion", "acompletion", "completion"):
            return False
        f = f.f_back
    return False


class KvRouteRoutingStrategy(CustomRoutingStrategyBase):
    """A LiteLLM custom routing strategy that chooses deployments with kvroute.

    Parameters
    ----------
    llm_router:
        The ``litellm.Router`` whose ``model_list`` defines the groups. Deployments are read
        once, here; call `refresh` after changing the model list.
    tokenizer:
        Default tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``) for groups
        whose deployments give no ``model_info.tokenizer``. A kvroute group with neither is
        routed on load alone (every prompt looks empty), and `stats` says so.
    block_size:
        Default for ``model_info.kv_block_size`` (vLLM's default ``--block-size`` 16).
    router_kwargs:
        Passed to every `kvroute.Router` (``policy``, ``cache_weight``, ``speculative_ttl_s``...).
    max_request_age:
        Seconds after which an open decision whose end LiteLLM never reported (a stream the
        client dropped without reading to the end) is released anyway. Default 600.
    seed:
        Seeds the ``simple-shuffle`` choice for groups kvroute does not route.

    Raises
    ------
    ValueError
        A kvroute group with a deployment lacking ``api_base``, a bad or conflicting
        ``kv_block_size`` / ``tokenizer`` within a group, a tokenizer directory without
        ``tokenizer.json``, bad ``router_kwargs`` or an endpoint that cannot be connected (from
        `kvroute.Router`).
    """

    def __init__(
        self,
        llm_router: litellm.Router,
        *,
        tokenizer: Optional[Union[str, os.PathLike, PromptTokenizer]] = None,
        block_size: int = 16,
        router_kwargs: Optional[Mapping[str, Any]] = None,
        max_request_age: float = 600.0,
        seed: Optional[int] = None,
    ) -> None:
        if max_request_age <= 0:
            raise ValueError(f"max_request_age must be > 0 seconds, got {max_request_age!r}")
        self._llm_router = llm_router
        self._default_tokenizer = tokenizer
        self._default_block_size = block_size
        self._router_kwargs = dict(router_kwargs or {})
        self._max_request_age = float(max_request_age)
        self._rng = random.Random(seed)
        self._uid = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self._counters = _Counters()
        self._groups: Dict[str, _Group] = {}
        self._callback = _ReleaseCallback(self)
        self._installed = False
        self.refresh()

    # -- setup -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """(Re)builds one `kvroute.Router` per kvroute group from ``llm_router.model_list``.

        A group whose workers are unchanged keeps its router (and its index); changed groups
        get a new one (decisions still open on the old one are released with it)."""
        by_group: Dict[str, List[Mapping[str, Any]]] = {}
        # Deployment dicts (litellm's descriptor leaves model_list's type opaque to mypy).
        model_list: List[Mapping[str, Any]] = self._llm_router.model_list or []
        for d in model_list:
            by_group.setdefault(d["model_name"], []).append(d)
        new: Dict[str, _Group] = {}
        for name, deps in by_group.items():
            if not any(_model_info(d).get("kv_events") for d in deps):
                continue
            workers: Dict[str, kvroute.Worker] = {}
            ids: Dict[str, List[str]] = {}
            block_sizes, tokenizers = set(), set()
            for d in deps:
                base = _api_base(d)
                if base is None:
                    raise ValueError(f"model group {name!r}: deployment {_deployment_id(d)} has no "
                                     "litellm_params.api_base; kvroute needs one URL per engine")
                info = _model_info(d)
                bs = info.get("kv_block_size", self._default_block_size)
                if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
                    raise ValueError(f"model group {name!r}: model_info.kv_block_size must be a "
                                     f"positive int, got {bs!r}")
                block_sizes.add(bs)
                if info.get("tokenizer"):
                    tokenizers.add(str(info["tokenizer"]))
                w = kvroute.Worker(base, kv_endpoint=info.get("kv_events") or None,
                                   replay_endpoint=info.get("kv_replay") or None,
                                   dp_rank=info.get("kv_dp_rank"))
                if w.name in workers and workers[w.name] != w:
                    raise ValueError(f"model group {name!r}: deployments with api_base {base} name "
                                     "different KV-event endpoints")
                workers[w.name] = w
                ids.setdefault(w.name, []).append(_deployment_id(d))
            if len(block_sizes) > 1:
                raise ValueError(f"model group {name!r}: deployments disagree on kv_block_size "
                                 f"{sorted(block_sizes)}")
            if len(tokenizers) > 1:
                raise ValueError(f"model group {name!r}: deployments disagree on tokenizer "
                                 f"{sorted(tokenizers)}")
            tok_src: Any = next(iter(tokenizers), None) or self._default_tokenizer
            if tok_src is None or isinstance(tok_src, PromptTokenizer):
                tok, tok_path = tok_src, (None if tok_src is None else "<PromptTokenizer>")
            else:
                tok, tok_path = _tokenizer_at(tok_src), str(tok_src)
            old = self._groups.get(name)
            block_size = block_sizes.pop()
            if (old is not None and set(old.router.workers) == set(workers.values())
                    and old.router.block_size == block_size):
                old.deployments, old.tokenizer, old.tokenizer_path = ids, tok, tok_path
                new[name] = old
                continue
            router = kvroute.Router(list(workers.values()), block_size=block_size,
                                    **self._router_kwargs)
            new[name] = _Group(name, router, tok, tok_path, ids)
        stale = [g for n, g in self._groups.items() if new.get(n) is not g]
        with self._lock:
            self._groups = new
            for rid in [rid for rid, o in self._open.items() if o.group in stale]:
                self._open.pop(rid)
        for g in stale:
            g.router.close()

    def install(self) -> KvRouteRoutingStrategy:
        """Makes this the router's deployment choice and registers the release callback.

        Returns self. The callback joins ``litellm.callbacks`` (LiteLLM's callbacks are
        process-wide; it only acts on decisions of this strategy)."""
        # Deliberately leaves Router.routing_strategy as it is: LiteLLM validates it against its
        # built-in names, and nothing reads it once both selection methods are replaced.
        self._llm_router.set_custom_routing_strategy(self)
        if self._callback not in litellm.callbacks:
            litellm.logging_callback_manager.add_litellm_callback(self._callback)
        _STRATEGIES[self._llm_router] = self
        self._installed = True
        return self

    def close(self) -> None:
        """Uninstalls (LiteLLM's own strategy comes back), unregisters the callback and
        closes the kvroute routers (their ingestion threads). Open decisions are dropped.
        Idempotent."""
        if self._installed:
            for attr in ("get_available_deployment", "async_get_available_deployment"):
                self._llm_router.__dict__.pop(attr, None)
            _STRATEGIES.pop(self._llm_router, None)
            self._installed = False
        for lst in ("callbacks", "success_callback", "failure_callback",
                    "_async_success_callback", "_async_failure_callback"):
            cbs = getattr(litellm, lst, None)
            if isinstance(cbs, list):
                cbs[:] = [c for c in cbs if c is not self._callback]
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
            self._open.clear()
        for g in groups:
            g.router.close()

    def __enter__(self) -> KvRouteRoutingStrategy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- introspection ---------------------------------------------------------------------
    @property
    def callback(self) -> CustomLogger:
        """The ``CustomLogger`` that releases decisions (registered by `install`)."""
        return self._callback

    def kv_router(self, model_group: str) -> kvroute.Router:
        """The `kvroute.Router` of a model group.

        Raises KeyError for a group kvroute does not route."""
        group = self._groups.get(model_group)
        if group is None:
            raise KeyError(f"model group {model_group!r} is not routed by kvroute; routed: "
                           f"{sorted(self._groups)}")
        return group.router

    def open_requests(self) -> int:
        """Decisions routed and not yet released."""
        with self._lock:
            return len(self._open)

    def stats(self) -> Dict[str, Any]:
        """Counters of this strategy and each group's `kvroute.Router.stats`.

        Returns ``{"open": n, "routed", "released": {"success", "failure", "retry"},
        "expired", "shuffled" (non-kvroute groups), "tokenize_errors",
        "by_worker": {worker: n}, "groups": {model_group: {"tokenizer": path or None,
        "block_size", "router": kvroute stats}}}``."""
        with self._lock:
            c = self._counters
            out: Dict[str, Any] = {
                "open": len(self._open), "routed": c.routed,
                "released": {"success": c.released_success, "failure": c.released_failure,
                             "retry": c.released_retry},
                "expired": c.expired, "shuffled": c.shuffled,
                "tokenize_errors": c.tokenize_errors, "by_worker": dict(c.by_worker),
            }
            groups = dict(self._groups)
        out["groups"] = {
            n: {"tokenizer": g.tokenizer_path,
                "block_size": g.router.block_size, "router": g.router.stats()}
            for n, g in groups.items()
        }
        return out

    # -- LiteLLM's routing hooks -----------------------------------------------------------
    # CustomRoutingStrategyBase annotates both hooks "-> None", yet LiteLLM's Router calls the
    # deployment they return: hence the override ignores.
    async def async_get_available_deployment(  # type: ignore[override]
        self,
        model: str,
        messages: Optional[List[Dict[str, Any]]] = None,
        input: Optional[Union[str, List]] = None,
        specific_deployment: Optional[bool] = False,
        request_kwargs: Optional[Dict] = None,
    ) -> Dict[str, Any]:
        """LiteLLM's async hook: the deployment dict (an element of ``model_list``) to call.

        Raises what LiteLLM raises when no deployment is healthy (``RouterRateLimitError``
        etc.), so LiteLLM's fallbacks still apply."""
        request_kwargs = request_kwargs if request_kwargs is not None else {}
        text_completion = _called_for_text_completion()
        healthy = await self._llm_router.async_get_healthy_deployments(
            model=model, request_kwargs=request_kwargs, messages=messages, input=input,
            specific_deployment=specific_deployment,
        )
        if isinstance(healthy, dict):  # specific_deployment=True: the caller chose
            return healthy
        if not healthy:
            from litellm.router_utils.handle_error import async_raise_no_deployment_exception

            # litellm's renamed_router_param declares its TypeVar Final, which mypy cannot
            # resolve: the decorated function is not callable to it.
            raise await async_raise_no_deployment_exception(  # type: ignore[misc]
                litellm_router_instance=self._llm_router, model=model, parent_otel_span=None)
        group = self._groups.get(healthy[0]["model_name"])
        tokens: Any = []
        if group is not None and group.tokenizer is not None:
            req = _engine_request(messages, input, request_kwargs, text_completion)
            if req is not None:  # short prompts inline, long ones on the tokenizer's pool
                tokens = await self._atokens(group.tokenizer, *req)
        return self._choose(group, healthy, tokens, request_kwargs)

    def get_available_deployment(  # type: ignore[override]
        self,
        model: str,
        messages: Optional[List[Dict[str, Any]]] = None,
        input: Optional[Union[str, List]] = None,
        specific_deployment: Optional[bool] = False,
        request_kwargs: Optional[Dict] = None,
    ) -> Dict[str, Any]:
        """LiteLLM's sync hook (``Router.completion`` etc.): as the async one, with LiteLLM's
        sync filters (deployment resolution and cooldowns)."""
        from litellm.router_utils.cooldown_handlers import get_cooldown_deployments

        request_kwargs = request_kwargs if request_kwargs is not None else {}
        text_completion = _called_for_text_completion()
        r = self._llm_router
        model, healthy = r._common_checks_available_deployment(
            model=model, messages=messages, input=input, specific_deployment=specific_deployment,
            request_kwargs=request_kwargs)
        if isinstance(healthy, dict):
            return healthy
        # litellm's renamed_router_param declares its TypeVar Final, which mypy cannot
        # resolve: the decorated function is not callable to it.
        cooling = get_cooldown_deployments(  # type: ignore[misc]
            litellm_router_instance=r, parent_otel_span=None)
        healthy = r._filter_cooldown_deployments(healthy_deployments=healthy,
                                                 cooldown_deployments=cooling)
        if not healthy:
            from litellm.types.router import RouterRateLimitError

            raise RouterRateLimitError(model=model, cooldown_time=0, enable_pre_call_checks=False,
                                       cooldown_list=list(cooling),
                                       model_ids=r.get_model_ids(model_name=model))
        group = self._groups.get(healthy[0]["model_name"])
        tokens: Any = []
        if group is not None and group.tokenizer is not None:
            req = _engine_request(messages, input, request_kwargs, text_completion)
            if req is not None:
                tokens = self._tokens(group.tokenizer, *req)
        return self._choose(group, healthy, tokens, request_kwargs)

    # -- internals -------------------------------------------------------------------------
    def _tokens(self, tok: PromptTokenizer, path: str, body: Mapping[str, Any]) -> Any:
        try:
            return tok.encode_request(path, body)
        except Exception:  # noqa: BLE001
            return self._tokenize_failed()

    async def _atokens(self, tok: PromptTokenizer, path: str, body: Mapping[str, Any]) -> Any:
        try:
            return await tok.aencode_request(path, body)
        except Exception:  # noqa: BLE001
            return self._tokenize_failed()

    def _tokenize_failed(self) -> Any:
        # Deliberately fail open: a request kvroute cannot tokenize (multimodal parts, a
        # request chat_template, a template that raises) is still served, routed on load
        # alone; the engine reports the error if it has one.
        with self._lock:
            self._counters.tokenize_errors += 1
        return []

    def _choose(self, group: Optional[_Group], healthy: List[Dict[str, Any]], tokens: Any,
                request_kwargs: Dict[str, Any]) -> Dict[str, Any]:
        self._expire()
        if group is None:
            from litellm.router_strategy.simple_shuffle import simple_shuffle

            with self._lock:
                self._counters.shuffled += 1
            return simple_shuffle(resolve_model_alias=self._llm_router.get_model_from_alias,
                                  healthy_deployments=healthy, model=healthy[0]["model_name"],
                                  request_kwargs=request_kwargs)
        key = _metadata_key(request_kwargs)
        meta = request_kwargs.get(key)
        if not isinstance(meta, dict):
            meta = request_kwargs[key] = {}
        # Deliberately in place: LiteLLM shares one metadata dict across the attempts of a
        # request (retries read the failed attempt's deployment from it), so what we write here
        # is what the next attempt, the callbacks and the caller see. Hence the documented
        # rule: one metadata dict per request; two requests in flight with the same dict
        # object would read each other's decision id.
        # LiteLLM gives each request one litellm_trace_id (Router._update_kwargs_before_fallbacks);
        # the same id here means a retry or fallback of the request, a new one means a caller
        # reusing its metadata dict for another request.
        trace = request_kwargs.get("litellm_trace_id")
        retry = trace is not None and meta.get(METADATA_TRACE) == trace
        tried = list(meta.get(METADATA_TRIED) or []) if retry else []
        previous = meta.pop(METADATA_REQUEST_ID, None)
        if retry and previous is not None:
            # The previous attempt is over (LiteLLM retries only after a failure), whether or
            # not a callback has released it yet.
            self._release(previous, "retry")
            if meta.get(METADATA_WORKER):
                tried.append(meta[METADATA_WORKER])

        healthy_by_worker: Dict[str, Dict[str, Any]] = {}
        for d in healthy:
            base = _api_base(d)
            if base is not None and base in group.deployments:
                healthy_by_worker.setdefault(base, d)
        if not healthy_by_worker:  # only deployments added after setup: refresh() knows them
            with self._lock:
                self._counters.shuffled += 1
            return self._rng.choice(healthy)
        exclude = [w for w in group.deployments if w not in healthy_by_worker]
        retry_exclude = [w for w in tried if w in healthy_by_worker and w not in exclude]
        if len(set(exclude) | set(retry_exclude)) < len(group.deployments):
            exclude += retry_exclude  # else every healthy one was tried: try them again
        try:
            decision = group.router.select_worker(
                tokens, exclude=exclude,
                cache_salt=_request_param(request_kwargs, "cache_salt"),
            )
        except NoWorkerAvailable:  # pragma: no cover - exclude never covers healthy workers
            return self._rng.choice(healthy)
        rid = f"{self._uid}-{next(self._ids)}"
        with self._lock:
            self._open[rid] = _Open(group, decision, time.monotonic())
            c = self._counters
            c.routed += 1
            c.by_worker[decision.worker] = c.by_worker.get(decision.worker, 0) + 1
        meta[METADATA_REQUEST_ID] = rid
        meta[METADATA_WORKER] = decision.worker
        meta[METADATA_MATCHED_TOKENS] = decision.matched_tokens
        meta[METADATA_TRIED] = tried
        meta[METADATA_TRACE] = trace
        return healthy_by_worker[decision.worker]

    def _release(self, rid: Any, how: str) -> bool:
        with self._lock:
            o = self._open.pop(rid, None) if isinstance(rid, str) else None
            if o is None:
                return False
            c = self._counters
            if how == "success":
                c.released_success += 1
            elif how == "failure":
                c.released_failure += 1
            elif how == "retry":
                c.released_retry += 1
            else:
                c.expired += 1
        o.group.router.complete(o.decision)
        return True

    def _expire(self) -> None:
        deadline = time.monotonic() - self._max_request_age
        expired: List[str] = []
        with self._lock:
            for rid, o in self._open.items():  # insertion order = start order
                if o.started > deadline:
                    break
                expired.append(rid)
        for rid in expired:
            self._release(rid, "expired")


def _engine_request(messages: Any, input: Any, request_kwargs: Mapping[str, Any],
                    text_completion: bool) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The OpenAI request body the engine will see, with its path (for `PromptTokenizer`)."""
    if text_completion and messages and len(messages) == 1 and isinstance(messages[0], Mapping):
        path, fields = COMPLETIONS_PATH, _COMPLETION_FIELDS
        body: Dict[str, Any] = {"prompt": messages[0].get("content")}
    elif messages is not None:
        path, body, fields = CHAT_COMPLETIONS_PATH, {"messages": messages}, _CHAT_FIELDS
    elif input is not None:
        path, body, fields = COMPLETIONS_PATH, {"prompt": input}, _COMPLETION_FIELDS
    else:
        return None
    for name in fields:
        v = _request_param(request_kwargs, name)
        if v is not None:
            body[name] = v
    return path, body


def _request_id_from(kwargs: Mapping[str, Any]) -> Any:
    """The kvroute request id LiteLLM hands back to a callback (its ``litellm_params``'
    ``metadata`` / ``litellm_metadata``, which are the request's metadata)."""
    params = kwargs.get("litellm_params") or {}
    for src in (params.get("metadata"), params.get("litellm_metadata"),
                kwargs.get("metadata"), kwargs.get("litellm_metadata")):
        if isinstance(src, Mapping) and METADATA_REQUEST_ID in src:
            return src[METADATA_REQUEST_ID]
    return None


class _ReleaseCallback(CustomLogger):
    """Releases a kvroute decision when LiteLLM reports the end of its attempt.

    Hooks (``litellm/integrations/custom_logger.py``): the per-attempt
    ``async_post_call_failure_deployment_hook`` (awaited on the attempt's exception path, before
    LiteLLM retries), and the per-request ``(async_)log_success_event`` (for a stream: once it
    has been read to the end) and ``(async_)log_failure_event``. Releasing is idempotent, so a
    decision reported twice is released once. LiteLLM calls its per-chunk streaming hook only
    for the last chunk, so a stream's prefill load is released with the rest, at its end."""

    def __init__(self, strategy: KvRouteRoutingStrategy) -> None:
        super().__init__()
        self._strategy = weakref.ref(strategy)

    def _release(self, kwargs: Mapping[str, Any], how: str) -> None:
        s = self._strategy()
        rid = _request_id_from(kwargs)
        if s is not None and rid is not None:
            s._release(rid, how)

    def log_success_event(self, kwargs, response_obj, start_time, end_time):  # noqa: D102
        self._release(kwargs, "success")

    def log_failure_event(self, kwargs, response_obj, start_time, end_time):  # noqa: D102
        self._release(kwargs, "failure")

    async def async_log_success_event(  # noqa: D102
        self, kwargs, response_obj, start_time, end_time
    ):
        self._release(kwargs, "success")

    async def async_log_failure_event(  # noqa: D102
        self, kwargs, response_obj, start_time, end_time
    ):
        self._release(kwargs, "failure")

    async def async_post_call_failure_deployment_hook(  # noqa: D102
        self, request_data, exception, call_type, fallback_depth=None
    ):
        self._release(request_data, "failure")


# -- one-call setup ----------------------------------------------------------------------------
def kvroute_litellm_router(config: Union[str, os.PathLike, Mapping[str, Any]]) -> litellm.Router:
    """A ``litellm.Router`` with `KvRouteRoutingStrategy` installed, from a LiteLLM-proxy-shaped
    configuration (see ``examples/litellm_config.yaml``).

    Parameters
    ----------
    config:
        Path to a YAML file or a dict with ``model_list`` (LiteLLM's; ``model_info`` carries
        ``kv_events`` etc., see the module docstring), optional ``router_settings`` (keyword
        arguments of ``litellm.Router``: ``num_retries``, ``allowed_fails``,
        ``cooldown_time``...; ``routing_strategy`` is ignored) and optional
        ``kvroute_settings``: ``tokenizer``, ``block_size``, ``max_request_age``, ``seed`` and
        ``router`` (keyword arguments of `kvroute.Router`: ``policy``, ``cache_weight``...).

    Returns
    -------
    litellm.Router
        Its strategy: `strategy_for` (call ``strategy_for(r).close()`` when done).

    Raises
    ------
    ValueError
        No ``model_list``, unknown ``kvroute_settings`` keys, or what `KvRouteRoutingStrategy`
        raises.
    """
    if isinstance(config, (str, os.PathLike)):
        import yaml

        with open(config) as f:
            config = yaml.safe_load(f) or {}
    if not isinstance(config, Mapping) or not isinstance(config.get("model_list"), list):
        raise ValueError("LiteLLM config must be a mapping with a model_list (a list of "
                         "deployments)")
    router_settings = dict(config.get("router_settings") or {})
    router_settings.pop("routing_strategy", None)
    ks = dict(config.get("kvroute_settings") or {})
    unknown = set(ks) - {"tokenizer", "block_size", "max_request_age", "seed", "router"}
    if unknown:
        raise ValueError(f"unknown kvroute_settings keys {sorted(unknown)}: expected tokenizer, "
                         "block_size, max_request_age, seed, router")
    llm_router = litellm.Router(model_list=list(config["model_list"]), **router_settings)
    strategy = KvRouteRoutingStrategy(
        llm_router, tokenizer=ks.get("tokenizer"), block_size=int(ks.get("block_size", 16)),
        router_kwargs=ks.get("router") or {},
        max_request_age=float(ks.get("max_request_age", 600.0)),
        seed=ks.get("seed"),
    )
    strategy.install()
    return llm_router
