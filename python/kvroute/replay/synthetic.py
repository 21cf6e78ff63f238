"""Synthetic traces: made-up token ids and arrivals with a chosen sharing structure.

* `synthetic_conversations` — multi-turn chats over a few shared system prompts.
* `synthetic_bursts` — bursts of requests sharing a new long prefix.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from kvroute.replay.trace_types import QWEN3_REGULAR_VOCAB, Trace, _finish

__all__ = ["synthetic_bursts", "synthetic_conversations"]


def synthetic_conversations(
    *,
    n_conversations: int = 200,
    turns: Tuple[int, int] = (2, 6),
    n_system_prompts: int = 4,
    system_tokens: Tuple[int, int] = (500, 2000),
    user_tokens: Tuple[int, int] = (50, 400),
    output_tokens: Tuple[int, int] = (50, 400),
    think_time_s: Tuple[float, float] = (2.0, 20.0),
    arrival_rate_per_s: float = 2.0,
    seed: int = 0,
) -> Trace:
    """Deterministic multi-turn chats sharing a few system prompts.

    Turn ``k`` of a conversation sends ``system + user_1 + out_1 + ... + out_{k-1} + user_k``
    (random token ids from the regular Qwen3 vocabulary) and asks for ``len(out_k)`` tokens;
    the outputs are generated up front, so turn ``k+1``'s prompt begins with exactly turn
    ``k``'s prompt followed by turn ``k``'s output. Integer ranges are inclusive.

    Parameters
    ----------
    n_conversations:
        Number of conversations.
    turns:
        Inclusive range of turns per conversation.
    n_system_prompts:
        Number of distinct system prompts; each conversation picks one uniformly.
    system_tokens, user_tokens, output_tokens:
        Inclusive length ranges, in tokens, of system prompts, user messages and outputs.
    think_time_s:
        Range, in seconds, of the gap between a turn's arrival and the next turn's arrival.
    arrival_rate_per_s:
        Rate of the Poisson process of conversation starts, per second (the first starts at
        t = 0).
    seed:
        Seed of the generator; equal arguments give identical traces.

    Returns
    -------
    Trace
        ``name="synthetic-conversations"``, ``synthetic=True``, sessions ``"synth-<i>"``.
        The defaults give ~800 requests with prompts up to ~7k tokens over ~2 minutes.
    """
    if n_conversations < 0 or n_system_prompts < 1:
        raise ValueError("n_conversations must be >= 0 and n_system_prompts >= 1")
    if arrival_rate_per_s <= 0:
        raise ValueError(f"arrival_rate_per_s must be > 0, got {arrival_rate_per_s}")
    for nm, (lo, hi) in (("turns", turns), ("system_tokens", system_tokens),
                         ("user_tokens", user_tokens), ("output_tokens", output_tokens),
                         ("think_time_s", think_time_s)):
        if not 0 <= lo <= hi:
            raise ValueError(f"{nm} must be a range (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")
    if turns[0] < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")

    rng = np.random.default_rng(seed)

    def rand_tokens(rng_range: Tuple[int, int]) -> np.ndarray:
        n = int(rng.integers(rng_range[0], rng_range[1] + 1))
        return rng.integers(0, QWEN3_REGULAR_VOCAB, size=n, dtype=np.uint32)

    systems = [rand_tokens(system_tokens) for _ in range(n_system_prompts)]
    gaps = rng.exponential(1.0 / arrival_rate_per_s, size=n_conversations)
    starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n_conversations else gaps
    reqs: List[Tuple[float, np.ndarray, int, str]] = []
    for c in range(n_conversations):
        sys_idx = int(rng.integers(0, n_system_prompts))
        n_turns = int(rng.integers(turns[0], turns[1] + 1))
        history = systems[sys_idx]
        t = float(starts[c])
        for k in range(n_turns):
            if k:
                t += float(rng.uniform(think_time_s[0], think_time_s[1]))
            prompt = np.concatenate([history, rand_tokens(user_tokens)])
            out = rand_tokens(output_tokens)
            reqs.append((t, prompt, len(out), f"synth-{c}"))
            history = np.concatenate([prompt, out])
    desc = (
        f"SYNTHETIC multi-turn conversations (made-up token ids and arrivals; seed {seed}): "
        f"{n_conversations} conversations of {turns[0]}-{turns[1]} turns starting as a Poisson "
        f"process at {arrival_rate_per_s:g}/s, over {n_system_prompts} shared system prompts "
        f"of {system_tokens[0]}-{system_tokens[1]} tokens; each turn's prompt is the previous "
        f"prompt + its {output_tokens[0]}-{output_tokens[1]}-token stand-in output + a new "
        f"{user_tokens[0]}-{user_tokens[1]}-token user message; think time "
        f"{think_time_s[0]:g}-{think_time_s[1]:g} s between turn arrivals."
    )
    return Trace(name="synthetic-conversations", requests=_finish(reqs), synthetic=True,
                 description=desc)


def synthetic_bursts(
    *,
    n_groups: int = 60,
    group_size: int = 8,
    document_tokens: int = 6000,
    question_tokens: Tuple[int, int] = (50, 200),
    output_tokens: Tuple[int, int] = (50, 200),
    burst_window_s: float = 1.0,
    group_gap_s: float = 1.5,
    seed: int = 0,
) -> Trace:
    """Deterministic bursts of requests that share a new long prefix (a document asked
    several questions at once, a batch job, a fan-out agent step).

    Each group is a fresh ``document_tokens``-token prefix followed by ``group_size``
    different questions, arriving uniformly within ``burst_window_s``; groups start every
    ``group_gap_s``. This is the workload where a router that waits for BlockStored events
    spreads a burst over the fleet, and speculative insert keeps it together.

    Returns
    -------
    Trace
        ``name="synthetic-bursts"``, ``synthetic=True``, sessions ``"burst-<group>"``.
    """
    if n_groups < 0 or group_size < 1 or document_tokens < 0:
        raise ValueError("n_groups >= 0, group_size >= 1 and document_tokens >= 0 required")
    rng = np.random.default_rng(seed)
    reqs: List[Tuple[float, np.ndarray, int, str]] = []
    for g in range(n_groups):
        doc = rng.integers(0, QWEN3_REGULAR_VOCAB, size=document_tokens, dtype=np.uint32)
        start = g * group_gap_s
        for t in np.sort(rng.uniform(0.0, burst_window_s, size=group_size)):
            q = rng.integers(0, QWEN3_REGULAR_VOCAB,
                             size=int(rng.integers(question_tokens[0], question_tokens[1] + 1)),
                             dtype=np.uint32)
            out = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
            reqs.append((start + float(t), np.concatenate([doc, q]), out, f"burst-{g}"))
    desc = (f"SYNTHETIC bursts (made-up token ids and arrivals; seed {seed}): {n_groups} groups "
            f"of {group_size} requests sharing a new {document_tokens}-token prefix, each group "
            f"arriving within {burst_window_s:g} s, one group every {group_gap_s:g} s.")
    return Trace(name="synthetic-bursts", requests=_finish(reqs), synthetic=True,
                 description=desc)
