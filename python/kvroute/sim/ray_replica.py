"""A Ray Serve replica around the engine stand-in, for tests and examples: `StandinLLMServer`
reports its KV-event endpoints and load the way `kvroute.integrations.ray_serve` expects
(`kv_event_metadata`, `kv_routing_stats`), so `KvRouteRequestRouter` can route to it.

Needs ``ray[serve]`` (the ``ray`` extra) and a Qwen3 tokenizer directory.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Dict, List, Mapping, Optional

from kvroute.integrations.ray_serve import (
    KV_EVENT_METADATA_KEY,
    kv_event_metadata,
    kv_routing_stats,
)
from kvroute.sim.standin_engine import StandinEngine

__all__ = ["StandinLLMServer"]


class StandinLLMServer:
    """A CPU stand-in LLM server replica for Ray Serve: `kvroute.sim.server.StandinEngine`
    (real Qwen3 tokenizer and chat template, vLLM-like prefix cache, real vLLM-format KV
    events over ZeroMQ; no model: deterministic words) behind a handle-callable deployment.

    Wrap it yourself: ``serve.deployment(StandinLLMServer, num_replicas=3,
    request_router_config=RequestRouterConfig(request_router_class=KvRouteRequestRouter))``
    (`kvroute.integrations.ray_serve.KvRouteRequestRouter`).

    Parameters
    ----------
    tokenizer_dir:
        Directory with ``tokenizer.json`` and ``tokenizer_config.json``.
    model, block_size, capacity_blocks, token_delay_s, seed:
        As `kvroute.sim.server.StandinEngine`.
    kv_host:
        Address the KV-event PUB (and replay ROUTER) sockets bind, on OS-picked ports. Default:
        the node's IP (``ray.util.get_node_ip_address()``), reachable from other nodes.
    replay:
        Serve a replay socket (vLLM ``replay_endpoint``) for gap recovery.
    min_kv_subscribers:
        Stand-in only: hold each request until this many SUB sockets have subscribed to the
        KV-event socket (at most ``subscriber_timeout_s`` seconds), so a test's first events
        are not lost to ZeroMQ's slow joiner. 0 (default): do not wait, as vLLM does not.

    Calling a replica (``handle.remote(body)``): ``body`` is an OpenAI-style dict, a completions
    request (``prompt``: text or token ids, or ``prompt_token_ids``) or a chat request
    (``messages``, ``tools``, ``add_generation_prompt``, ``chat_template_kwargs``), with
    ``max_tokens`` (default 16). Returns ``{"replica": str (replica_id.to_full_id_str()),
    "prompt_tokens": int, "cached_tokens": int (prefix-cache hit, tokens), "token_ids":
    list[int], "text": str, "finish_reason": str, "kv_seq": int (sequence number of the
    next KV-event batch)}``. Raises ValueError on a malformed body.
    """

    def __init__(
        self,
        tokenizer_dir: str,
        *,
        model: str = "Qwen/Qwen3-0.6B",
        block_size: int = 16,
        capacity_blocks: int = 4096,
        token_delay_s: float = 0.0,
        seed: int = 0,
        kv_host: Optional[str] = None,
        replay: bool = True,
        min_kv_subscribers: int = 0,
        subscriber_timeout_s: float = 10.0,
    ) -> None:
        import ray.util
        from ray import serve

        node_ip = ray.util.get_node_ip_address()
        host = kv_host or node_ip
        self.engine = StandinEngine(
            model=model, tokenizer_dir=tokenizer_dir, block_size=block_size,
            capacity_blocks=capacity_blocks, kv_endpoint=f"tcp://{host}:*",
            replay_endpoint=f"tcp://{host}:*" if replay else None, seed=seed,
            token_delay_s=token_delay_s)
        self.replica = serve.get_replica_context().replica_id.to_full_id_str()
        self.metadata = kv_event_metadata(self.engine.kv_endpoint,
                                          replay_endpoint=self.engine.replay_endpoint,
                                          block_size=block_size, node_ip=node_ip)
        self.min_kv_subscribers = int(min_kv_subscribers)
        self.subscriber_timeout_s = float(subscriber_timeout_s)

    def _token_ids(self, body: Mapping[str, Any]) -> List[int]:
        if not isinstance(body, Mapping):
            raise ValueError(f"expected an OpenAI-style request dict, got {type(body).__name__}")
        if body.get("prompt_token_ids") is not None:
            return self.engine.tokenize_completion(body["prompt_token_ids"])
        if "messages" in body:
            return self.engine.tokenize_chat(
                body["messages"], add_generation_prompt=body.get("add_generation_prompt", True),
                tools=body.get("tools"), chat_template_kwargs=body.get("chat_template_kwargs"))
        if "prompt" in body:
            return self.engine.tokenize_completion(body["prompt"])
        raise ValueError("request needs 'prompt', 'prompt_token_ids' or 'messages'")

    async def _wait_subscribers(self) -> None:
        if self.min_kv_subscribers <= 0:
            return
        end = time.monotonic() + self.subscriber_timeout_s
        while (self.engine.stats().get("kv_subscriptions", 0) < self.min_kv_subscribers
               and time.monotonic() < end):
            await asyncio.sleep(0.01)

    async def __call__(self, body: Mapping[str, Any]) -> Dict[str, Any]:
        ids = self._token_ids(body)
        max_tokens = body.get("max_tokens", 16)
        await self._wait_subscribers()
        gen = self.engine.generate(ids, max_tokens)
        out = [t async for t in gen]
        return {"replica": self.replica, "prompt_tokens": gen.prompt_tokens,
                "cached_tokens": gen.cached_tokens, "token_ids": out,
                "text": self.engine.detokenize(out), "finish_reason": gen.finish_reason,
                "kv_seq": self.engine.stats().get("kv_seq")}

    def record_replica_metadata(self) -> Dict[str, Any]:
        """Ray Serve hook, called once when the replica is ready: the KV-event endpoints."""
        return {KV_EVENT_METADATA_KEY: dict(self.metadata)}

    def record_routing_stats(self) -> Dict[str, Any]:
        """Ray Serve hook, polled every ``request_routing_stats_period_s``: endpoints + load."""
        s = self.engine.stats()
        return kv_routing_stats(self.metadata, num_requests_waiting=s["waiting"],
                                kv_cache_usage_perc=s["kv_cache_usage_perc"])

    def stats(self) -> Dict[str, Any]:
        """The engine's counters (`StandinEngine.stats`) and this replica's name."""
        return {"replica": self.replica, **self.engine.stats()}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
