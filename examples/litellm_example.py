"""LiteLLM's Router with kvroute choosing the engine: a two-turn chat over three engine stand-ins.

    python examples/litellm_example.py [--tokenizer-dir ../shared/data/tokenizers/qwen3]

Starts three `kvroute.sim.server` engine stand-ins (real HTTP servers speaking vLLM's OpenAI
API and publishing vLLM-format KV events over ZeroMQ; no model), points
``examples/litellm_config.yaml`` at them, and sends a conversation through
``litellm.Router.acompletion``: the second turn goes to the engine that holds the first turn's
KV blocks, which reports them as ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from pathlib import Path

import yaml

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of LiteLLM's price map

from kvroute.integrations.litellm import kvroute_litellm_router, strategy_for  # noqa: E402
from kvroute.sim.server import EngineServerProcess  # noqa: E402

HERE = Path(__file__).resolve().parent
SHARED_DATA = Path(os.environ.get("KVROUTE_SHARED_DATA", HERE.parent.parent / "shared" / "data"))
DEFAULT_TOKENIZER = SHARED_DATA / "tokenizers" / "qwen3"


async def conversation(router, engines) -> None:
    names = {e.url + "/v1": f"engine {i}" for i, e in enumerate(engines)}
    messages = [{"role": "system", "content": "You are a concise travel writer."},
                {"role": "user", "content": "Plan three days in Kyoto for a first-time visitor."}]
    for turn, follow_up in enumerate(["Now make it a rainy-day plan.", None], start=1):
        meta: dict = {}
        resp = await router.acompletion(model="qwen3", messages=messages, max_tokens=24,
                                        metadata=meta)
        print(f"turn {turn}: {names[meta['kvroute_worker']]}, prompt "
              f"{resp.usage.prompt_tokens} tokens, cached "
              f"{resp.usage.prompt_tokens_details.cached_tokens} (kvroute matched "
              f"{meta['kvroute_matched_tokens']})")
        if follow_up is None:
            break
        messages += [{"role": "assistant", "content": resp.choices[0].message.content},
                     {"role": "user", "content": follow_up}]
        await asyncio.sleep(0.2)  # the engine's BlockStored events reach kvroute meanwhile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer-dir", default=str(DEFAULT_TOKENIZER))
    a = p.parse_args()

    engines = [EngineServerProcess(tokenizer_dir=a.tokenizer_dir) for _ in range(3)]
    threads = [threading.Thread(target=e.start) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        cfg = yaml.safe_load((HERE / "litellm_config.yaml").read_text())
        for dep, e in zip(cfg["model_list"], engines):
            dep["litellm_params"]["api_base"] = e.url + "/v1"
            dep["model_info"].update(kv_events=e.kv_endpoint, kv_replay=e.replay_endpoint)
        cfg["kvroute_settings"]["tokenizer"] = a.tokenizer_dir
        router = kvroute_litellm_router(cfg)
        asyncio.run(asyncio.sleep(0.5))  # let the KV-event subscriptions join
        asyncio.run(conversation(router, engines))
        stats = strategy_for(router).stats()
        print({k: stats[k] for k in ("routed", "released", "open", "by_worker")})
        strategy_for(router).close()
    finally:
        for e in engines:
            e.stop()


if __name__ == "__main__":
    main()
