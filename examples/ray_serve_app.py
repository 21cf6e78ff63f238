"""Ray Serve app: CPU stand-in LLM replicas behind kvroute's request router.

    OpenAI-style HTTP  ->  Ingress (FastAPI)  --handle.remote(body)-->  StandinLLM x N
                             KvRouteRequestRouter (in the ingress replica) picks the replica
                             whose engine holds the longest prefix, from its KV events

Each ``StandinLLM`` replica runs `kvroute.sim.server.StandinEngine` (Qwen3 tokenizer and chat
template, a vLLM-like prefix cache, real vLLM-format KV events on its own ZeroMQ socket; no
model: the answer is deterministic words) and reports its KV-event endpoint and load to Ray
(``record_replica_metadata`` / ``record_routing_stats``). The ingress replica's handle to it
routes with `kvroute.integrations.ray_serve.KvRouteRequestRouter`, which tokenizes each chat
request as vLLM would and asks a `kvroute.Router` over the replicas.

Run it::

    python examples/ray_serve_app.py                 # starts Ray, runs a 2-conversation demo, exits
    python examples/ray_serve_app.py --serve         # ... and keeps serving until Ctrl-C
    serve run examples.ray_serve_app:app             # from the repo root, on a running/new Ray

then::

    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}'
    curl -s localhost:8000/kvroute/workers           # the router's view: per replica stats

Needs ``ray[serve]`` and the Qwen3 tokenizer in ``$KVROUTE_SHARED_DATA/tokenizers/qwen3``
(default ``../shared/data`` next to the repository).
"""

# No `from __future__ import annotations` here: FastAPI must see the ingress methods' real
# `Request` annotation, and Ray ships this module's classes by value.
import argparse
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Dict

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from kvroute.integrations.ray_serve import KvRouteRequestRouter, live_routers
from kvroute.sim.ray_replica import StandinLLMServer

SHARED_DATA = Path(os.environ.get("KVROUTE_SHARED_DATA",
                                  Path(__file__).resolve().parents[1].parent / "shared" / "data"))
TOKENIZER_DIR = str(SHARED_DATA / "tokenizers" / "qwen3")
MODEL = "Qwen/Qwen3-0.6B"

api = FastAPI(title="kvroute on Ray Serve (stand-in engines)")


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    """OpenAI-style front: forwards the JSON body to the LLM deployment's handle (whose
    request router is kvroute) and shapes the answer like vLLM's (non-streaming)."""

    def __init__(self, llm: DeploymentHandle) -> None:
        self.llm = llm

    async def _forward(self, request: Request, chat: bool) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise HTTPException(400, "the body must be a JSON object")
        try:
            out = await self.llm.remote(body)
        except ValueError as e:  # the replica rejected the body (ValueError inside)
            raise HTTPException(400, str(e)) from None
        rid = uuid.uuid4().hex
        usage = {"prompt_tokens": out["prompt_tokens"], "completion_tokens": len(out["token_ids"]),
                 "total_tokens": out["prompt_tokens"] + len(out["token_ids"]),
                 "prompt_tokens_details": {"cached_tokens": out["cached_tokens"]}}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out["text"]},
                      "finish_reason": out["finish_reason"]}
            resp = {"id": f"chatcmpl-{rid}", "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": out["text"], "finish_reason": out["finish_reason"]}
            resp = {"id": f"cmpl-{rid}", "object": "text_completion"}
        resp.update(created=int(time.time()), model=MODEL, choices=[choice], usage=usage)
        return JSONResponse(resp, headers={"x-kvroute-replica": out["replica"]})

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> JSONResponse:
        return await self._forward(request, chat=True)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> JSONResponse:
        return await self._forward(request, chat=False)

    @api.get("/kvroute/workers")
    async def workers(self) -> Dict[str, Any]:
        """Per replica, what this ingress's kvroute router sees (state, events, blocks,
        in-flight load, reported load), and how its requests were routed."""
        out: Dict[str, Any] = {}
        for r in live_routers():
            kv = r.kvroute_router
            out[r.app_name] = {"routing": r.routing_counts(),
                               "workers": kv.stats()["workers"] if kv is not None else {}}
        return out


def build_app(num_replicas: int = 3, tokenizer_dir: str = TOKENIZER_DIR,
              cache_weight: float = 0.7) -> Any:
    """The application: ``Ingress`` -> ``StandinLLM`` x ``num_replicas`` with kvroute routing."""
    llm = serve.deployment(
        StandinLLMServer, name="StandinLLM", num_replicas=num_replicas,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class=KvRouteRequestRouter,
            request_router_kwargs={"tokenizer_dir": tokenizer_dir, "block_size": 16,
                                   "cache_weight": cache_weight},
            request_routing_stats_period_s=2.0))
    return Ingress.bind(llm.bind(tokenizer_dir, model=MODEL, token_delay_s=0.005))


app = build_app()  # for `serve run examples.ray_serve_app:app`


def _demo(port: int, conversations: int) -> None:
    import httpx

    with open(SHARED_DATA / "mt_bench_question.jsonl", encoding="utf-8") as f:
        questions = [json.loads(line) for line in f][::10][:conversations]
    print(f"{'conv':>4} {'turn':>4} {'replica':<36} {'prompt':>6} {'cached':>6}")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        for i, q in enumerate(questions):
            messages: list = []
            for turn, text in enumerate(q["turns"], 1):
                messages.append({"role": "user", "content": text})
                r = client.post("/v1/chat/completions",
                                json={"messages": messages, "max_tokens": 16})
                if r.status_code != 200:
                    raise SystemExit(f"HTTP {r.status_code}: {r.text}")
                body = r.json()
                messages.append(body["choices"][0]["message"])
                u = body["usage"]
                print(f"{i:>4} {turn:>4} {r.headers['x-kvroute-replica']:<36} "
                      f"{u['prompt_tokens']:>6} {u['prompt_tokens_details']['cached_tokens']:>6}")
        routing = client.get("/kvroute/workers").json()
    for name, view in routing.items():
        print(f"\nrouter of app {name!r}: {view['routing']}")
        for w, s in view["workers"].items():
            print(f"  {w:<36} endpoint={s['endpoint']} blocks={s['indexed_blocks']} "
                  f"events={s['events']} inflight={s['inflight_requests']} "
                  f"kv_usage={s['kv_cache_usage_perc']}")


def main() -> None:
    import ray

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--port", type=int, default=8000, help="HTTP port of Serve's proxy")
    p.add_argument("--conversations", type=int, default=2, help="MT-Bench conversations in the demo")
    p.add_argument("--cache-weight", type=float, default=0.7)
    p.add_argument("--serve", action="store_true", help="keep serving after the demo")
    a = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        serve.run(build_app(a.replicas, cache_weight=a.cache_weight), name="kvroute-demo",
                  route_prefix="/")
        _demo(a.port, a.conversations)
        if a.serve:
            print(f"\nserving on http://127.0.0.1:{a.port} (Ctrl-C to stop)")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
