"""A simulated vLLM engine: block pool, continuous-batching scheduler, service model, and a
KV-event publisher on a real ZeroMQ PUB socket.

Virtual time, driven from outside: `SimEngine.next_step_end` says when the running step ends
and `SimEngine.finish_step` completes it. Nothing here sleeps.

Service model (one engine step, all times in seconds)::

    step_time = step_overhead_s
              + prefill_tokens_in_step / prefill_tokens_per_s
              + decode_seqs_in_step * decode_s_per_seq

Scheduling per step (vLLM V1 style, chunked prefill): running decodes take one token each from
the token budget (``max_num_batched_tokens``); the rest goes to prefill chunks, first of
requests already prefilling, then of waiting requests admitted in FIFO order while
``max_num_seqs`` and free blocks allow. Admission finds the longest cached prefix (prefix
hit), takes those blocks, and allocates the rest of the prompt's blocks plus the blocks its
output will fill (evicting least recently freed cached blocks -> ``BlockRemoved``). As prefill
chunks complete, newly full prompt blocks are cached (-> ``BlockStored`` with parent, token
ids, medium "GPU"). TTFT = queueing + prefill (the end of the step that finishes the prompt);
E2E adds ``output_length`` decode steps. Output blocks are not cached: the trace does not
say which tokens the model generated.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from kvroute import wire
from kvroute.sim.block_pool import BlockPool


@dataclass(frozen=True)
class ServiceModel:
    """Per-engine constants; defaults and their source are in sim/README.md."""

    prefill_tokens_per_s: float = 1e6 / 17.25   # 17.25 us per uncached prefill token
    decode_s_per_seq: float = 6.0e-6           # per decoding sequence in the step
    step_overhead_s: float = 5.75e-3           # fixed cost of one step
    max_num_batched_tokens: int = 8192         # vLLM V1 online default on H100
    max_num_seqs: int = 1024                   # vLLM V1 default on H100

    def step_time(self, prefill_tokens: int, decode_seqs: int) -> float:
        return (self.step_overhead_s + prefill_tokens / self.prefill_tokens_per_s
                + decode_seqs * self.decode_s_per_seq)


@dataclass
class SimRequest:
    """One request inside an engine. Times in virtual seconds."""

    request_id: int
    tokens: np.ndarray
    output_length: int
    arrival_s: float
    tag: Any = None                      # caller's handle (e.g. the router's Decision)
    hashes: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    cached_tokens: int = 0               # prefix hit at admission
    computed: int = 0                    # prompt tokens computed (incl. the hit)
    stored_blocks: int = 0               # prompt blocks already cached/published
    first_token_s: Optional[float] = None
    finish_s: Optional[float] = None
    kv_received: bool = False            # PD decode: the prompt's KV arrived from a prefill worker


class SimEngine:
    """One simulated engine (a vLLM worker without a GPU).

    Parameters
    ----------
    name:
        Worker name (the router's identity for it).
    capacity_blocks:
        KV cache size in blocks.
    block_size:
        Tokens per block.
    model:
        Service model constants.
    publish:
        Called with each step's events (a list of `wire` events), in order; ``None`` to keep
        them in `outbox` instead.
    salt:
        Per-engine secret for block hashes.
    """

    def __init__(self, name: str, capacity_blocks: int, block_size: int, model: ServiceModel,
                 publish: Optional[Callable[[list], None]] = None, salt: bytes = b"") -> None:
        self.name = name
        self.block_size = block_size
        self.model = model
        self.pool = BlockPool(capacity_blocks, salt or name.encode())
        self.publish = publish
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[tuple[int, int, SimRequest]] = []  # heap (finish step, id, req)
        self.step_no = 0
        self.now = 0.0
        self.step_end: Optional[float] = None
        self._step_plan: list[tuple[SimRequest, int]] = []
        self._step_decodes = 0
        self._steps = 1      # engine steps the running step stands for (decode-only runs)
        self._dt = 0.0       # the duration of each of them
        self.prefill_tokens_computed = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.events_published = 0
        self.finished: list[SimRequest] = []
        # Called with the request at its first token / at its finish; return values are unused.
        self.on_first_token: Optional[Callable[[SimRequest], object]] = None
        self.on_finish: Optional[Callable[[SimRequest], object]] = None

    # -- driving -----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.step_end is not None

    def add_request(self, req: SimRequest, now: float) -> None:
        """Queues ``req`` at virtual time ``now`` (REQUIRES: every step ending at or before
        ``now`` has been finished); an idle engine starts a step at once, a busy one admits it
        when the running step ends."""
        self.waiting.append(req)
        if self.step_end is None:
            self.now = max(self.now, now)
            self._start_step()
        elif self._steps > 1:
            self._cut_decode_run(now)

    @property
    def next_step_end(self) -> Optional[float]:
        return self.step_end

    def finish_step(self) -> None:
        """Completes the running step at `next_step_end`, publishes its events, starts the
        next step if there is work."""
        assert self.step_end is not None
        self.now = self.step_end
        self.step_no += self._steps
        events: list = []
        removed = self.pool.drain_evicted()
        if removed:
            events.append(wire.removed(removed, "GPU"))
        for req, chunk in self._step_plan:
            req.computed += chunk
            self.prefill_tokens_computed += chunk
            self._cache_full_blocks(req, events)
            if req.computed >= len(req.tokens):
                self.prefilling.remove(req)
                req.first_token_s = self.now
                if self.on_first_token:
                    self.on_first_token(req)
                if req.output_length <= 1:
                    self._finish(req)
                else:
                    heapq.heappush(self.decoding,
                                   (self.step_no + req.output_length - 1, req.request_id, req))
        while self.decoding and self.decoding[0][0] <= self.step_no:
            self._finish(heapq.heappop(self.decoding)[2])
        if events and self.publish is not None:
            self.publish(events)
            self.events_published += len(events)
        self.step_end = None
        self._start_step()

    # -- internals ---------------------------------------------------------------------------
    def _finish(self, req: SimRequest) -> None:
        req.finish_s = self.now
        self.pool.free_blocks(req.blocks)
        self.finished.append(req)
        if self.on_finish:
            self.on_finish(req)

    def _cache_full_blocks(self, req: SimRequest, events: list) -> None:
        bs = self.block_size
        full = min(req.computed, len(req.tokens)) // bs
        if full <= req.stored_blocks:
            return
        start = req.stored_blocks
        new_hashes, parent = [], (req.hashes[start - 1] if start > 0 else None)
        for i in range(start, full):
            if self.pool.cache(req.blocks[i], req.hashes[i]):
                new_hashes.append(req.hashes[i])
            elif new_hashes:
                break  # an identical block is already cached: the run stops here
        if new_hashes:
            n = len(new_hashes)
            events.append(wire.stored(new_hashes, parent,
                                      req.tokens[start * bs:(start + n) * bs].tolist(), bs,
                                      medium="GPU"))
        req.stored_blocks = full

    def _admit(self, req: SimRequest) -> bool:
        bs = self.block_size
        if not req.hashes:
            req.hashes = self.pool.hash_blocks(req.tokens, bs)
        hit = self.pool.longest_cached_prefix(req.hashes)
        # Like vLLM, a fully cached prompt still recomputes its last token.
        if hit * bs >= len(req.tokens):
            hit = max(0, (len(req.tokens) - 1) // bs)
        total_blocks = -(-(len(req.tokens) + req.output_length) // bs)
        need = total_blocks - hit
        hit_ids = [self.pool.cached[h] for h in req.hashes[:hit]]
        reusable = sum(1 for b in hit_ids if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free - reusable:
            return False
        self.pool.touch(hit_ids)
        req.blocks = hit_ids + self.pool.allocate(need)
        req.cached_tokens = hit * bs
        req.computed = hit * bs
        if req.kv_received:
            # Disaggregated decode: the prompt's KV was transferred, only the last token runs.
            req.computed = max(req.computed, len(req.tokens) - 1)
        req.stored_blocks = hit
        self.prompt_tokens += len(req.tokens)
        self.cached_tokens += req.cached_tokens
        return True

    def _start_step(self) -> None:
        m = self.model
        budget = m.max_num_batched_tokens - len(self.decoding)
        plan: list[tuple[SimRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            chunk = min(budget, len(req.tokens) - req.computed)
            plan.append((req, chunk))
            budget -= chunk
        while (budget > 0 and self.waiting
               and len(self.prefilling) + len(self.decoding) < m.max_num_seqs):
            req = self.waiting[0]
            if not self._admit(req):
                break  # head-of-line: wait for blocks to be freed
            self.waiting.popleft()
            self.prefilling.append(req)
            chunk = min(budget, len(req.tokens) - req.computed)
            plan.append((req, chunk))
            budget -= chunk
        decodes = len(self.decoding)
        if not plan and not decodes:
            if self.waiting and not self.prefilling:
                head = self.waiting[0]
                raise RuntimeError(
                    f"{self.name}: request {head.request_id} needs more blocks than the KV cache "
                    f"holds ({-(-(len(head.tokens) + head.output_length) // self.block_size)} > "
                    f"{self.pool.num_blocks}); raise --kv-capacity-blocks")
            return
        self._step_plan = plan
        self._step_decodes = decodes
        dt = m.step_time(sum(c for _, c in plan), decodes)
        end = self.now + dt
        steps = 1
        if not plan:
            # Decode-only steps: nothing changes until the first decode finishes (or a request
            # arrives: `_cut_decode_run`), so they run as one: the same step ends, summed one
            # step at a time as the engine would, and no event between them.
            for _ in range(self.decoding[0][0] - self.step_no - 1):
                end += dt
                steps += 1
        self._steps = steps
        self._dt = dt
        self.step_end = end

    def _cut_decode_run(self, now: float) -> None:
        """A request arrived at ``now`` during a run of decode-only steps: the run ends with
        the step running at ``now``, so that the next step can admit it."""
        end, steps, dt = self.now + self._dt, 1, self._dt
        while end <= now and steps < self._steps:
            end += dt
            steps += 1
        self._steps = steps
        self.step_end = end
