#!/usr/bin/env python
"""Cost of tokenizing chat requests as the router does (`kvroute.serving.PromptTokenizer`).

For chat prompts of about ``--sizes`` tokens (default 1K / 8K / 32K) built from the real
MT-Bench questions (``../shared/data/mt_bench_question.jsonl``) and rendered with the real
Qwen3 chat template + tokenizer (``../shared/data/tokenizers/qwen3``), in two shapes:

* ``turns``: a multi-turn conversation (user turns are MT-Bench questions, assistant turns a
  deterministic stand-in text), i.e. many short messages;
* ``document``: a system prompt and one long user message (RAG-style).

it times, per call (``time.perf_counter``, ``--runs`` calls after one warm-up):

* ``render``: `PromptTokenizer.render_chat` (vLLM message normalisation + Jinja template);
* ``encode``: encoding the rendered text the way the tokenizer does (``encode_batch_fast``,
  which releases the GIL);
* ``total``: `PromptTokenizer.encode_request` on the request body (render + encode + array);
* ``encode(GIL)``: ``tokenizers.Tokenizer.encode`` on the same text, for comparison;
* ``loop stall``: the longest gap seen by a 1 ms asyncio ticker while awaiting
  `PromptTokenizer.aencode_request` (thread pool), with the tokenizer's GIL-releasing encode
  and, for comparison, with ``Tokenizer.encode`` swapped in (max over ``--stall-runs``).

Run ``python benchmarks/bench_tokenize.py`` (about 2.5 min on a busy 2-core machine) or
``--quick`` (about 1 min).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from kvroute.prompt import CHAT_COMPLETIONS_PATH, PromptTokenizer  # noqa: E402

DEFAULT_DATA = Path(os.environ.get("KVROUTE_SHARED_DATA",
                                   Path(__file__).resolve().parents[2] / "shared" / "data"))


def questions(data: Path) -> list:
    with (data / "mt_bench_question.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_turns(tok: PromptTokenizer, qs: list, target: int) -> list:
    """A conversation of MT-Bench turns grown until its rendering reaches ``target`` tokens."""
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    i = 0
    while True:
        q = qs[i % len(qs)]
        for turn in q["turns"]:
            answer = f"(Stand-in answer {i}.) " + " ".join(reversed(turn.split()))
            msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        i += 1
        body = msgs + [{"role": "user", "content": "Summarise the conversation."}]
        if len(tok.encode_chat(body)) >= target:
            return body


def build_document(tok: PromptTokenizer, qs: list, target: int) -> list:
    """A system prompt and one user message of MT-Bench text reaching ``target`` tokens."""
    paragraphs, i = [], 0
    while True:
        paragraphs.append(" ".join(qs[i % len(qs)]["turns"]))
        i += 1
        if i % 8 == 0:
            body = [{"role": "system", "content": "Answer from the document."},
                    {"role": "user", "content": "\n\n".join(paragraphs) + "\n\nQuestion: why?"}]
            if len(tok.encode_chat(body)) >= target:
                return body


def pct(xs: list, q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def time_calls(fn, runs: int) -> list:
    fn()  # warm-up
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


async def loop_stall(tok: PromptTokenizer, body: dict) -> float:
    """Longest gap between ticks of a 1 ms ticker while one aencode_request is awaited."""
    ticks, stop = [], asyncio.Event()

    async def ticker():
        while not stop.is_set():
            await asyncio.sleep(0.001)
            ticks.append(time.perf_counter())

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0.005)
    start = time.perf_counter()
    await tok.aencode_request(CHAT_COMPLETIONS_PATH, body)
    end = time.perf_counter()
    stop.set()
    await t
    inside = [start] + [x for x in ticks if x > start] + [max(end, ticks[-1])]
    return float(np.max(np.diff(inside)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--sizes", default="1024,8192,32768", help="target prompt tokens")
    ap.add_argument("--runs", type=int, default=50, help="timed calls per row")
    ap.add_argument("--stall-runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="--runs 10 --stall-runs 2")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.stall_runs = 10, 2
    tdir = args.data_dir / "tokenizers" / "qwen3"
    if not tdir.is_dir():
        raise SystemExit(f"Qwen3 tokenizer not found in {tdir} (set --data-dir or "
                         "KVROUTE_SHARED_DATA)")
    tok = PromptTokenizer.from_dir(tdir)
    raw = tok._tok  # the tokenizers.Tokenizer, for the GIL-holding comparison
    qs = questions(args.data_dir)

    header = ("| shape | target | prompt tokens | messages | render p50 / p99 ms | "
              "encode p50 / p99 ms | total p50 / p99 ms | encode(GIL) p50 ms | "
              "loop stall max ms (pool / GIL encode) |")
    print(f"runs per row: {args.runs} (p99 of {args.runs} calls is close to the max)\n")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for size in [int(s) for s in args.sizes.split(",")]:
        for shape, build in (("turns", build_turns), ("document", build_document)):
            msgs = build(tok, qs, size)
            body = {"model": "Qwen/Qwen3-0.6B", "messages": msgs}
            text = tok.render_chat(msgs)
            n = len(tok.encode_request(CHAT_COMPLETIONS_PATH, body))
            render = time_calls(lambda msgs=msgs: tok.render_chat(msgs), args.runs)
            encode = time_calls(lambda text=text: tok._encode_text(text, False), args.runs)
            total = time_calls(lambda body=body: tok.encode_request(CHAT_COMPLETIONS_PATH, body),
                               args.runs)
            gil = time_calls(lambda text=text: raw.encode(text, add_special_tokens=False),
                             args.runs)
            stall_pool = max(asyncio.run(loop_stall(tok, body)) for _ in range(args.stall_runs))
            native = tok._encode_batch
            tok._encode_batch = lambda texts, add_special_tokens: [
                raw.encode(texts[0], add_special_tokens=add_special_tokens)]
            try:
                stall_gil = max(asyncio.run(loop_stall(tok, body))
                                for _ in range(args.stall_runs))
            finally:
                tok._encode_batch = native
            print(f"| {shape} | {size} | {n} | {len(msgs)} | "
                  f"{pct(render, 50):.2f} / {pct(render, 99):.2f} | "
                  f"{pct(encode, 50):.2f} / {pct(encode, 99):.2f} | "
                  f"{pct(total, 50):.2f} / {pct(total, 99):.2f} | {pct(gil, 50):.2f} | "
                  f"{stall_pool * 1e3:.1f} / {stall_gil * 1e3:.1f} |", flush=True)
    tok.close()


if __name__ == "__main__":
    main()
