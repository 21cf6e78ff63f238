"""kvroute: KV-cache-aware request routing for fleets of LLM inference engines.

Engines (vLLM, SGLang) publish KV-cache events over ZeroMQ; `Router` subscribes to every
worker on native threads, indexes which worker holds which prefix blocks, and answers
`Router.select_worker(tokens)` in microseconds. Policies are `kvroute.policies` objects
(``Router(workers, policy=KvAware(cache_weight=0.7))``), also exported here.
"""

from kvroute import policies
from kvroute._router import (
    DEFAULT_TIER_WEIGHTS,
    POLICIES,
    Decision,
    Match,
    NoWorkerAvailable,
    Router,
    Worker,
    WorkerScore,
    block_keys,
    decode_batch,
)
from kvroute.pd import PDDecision, PDRouter
from kvroute.policies import (
    CacheAware,
    ConsistentHash,
    Cost,
    KvAware,
    LeastLoad,
    LmcacheAware,
    Policy,
    PowerOfTwo,
    Random,
    RendezvousHash,
    RoundRobin,
)
from kvroute.session import session_key

__all__ = [
    "CacheAware",
    "ConsistentHash",
    "Cost",
    "DEFAULT_TIER_WEIGHTS",
    "KvAware",
    "LeastLoad",
    "LmcacheAware",
    "POLICIES",
    "Policy",
    "PowerOfTwo",
    "Random",
    "RendezvousHash",
    "RoundRobin",
    "Decision",
    "Match",
    "NoWorkerAvailable",
    "PDDecision",
    "PDRouter",
    "Router",
    "Worker",
    "WorkerScore",
    "block_keys",
    "decode_batch",
    "policies",
    "session_key",
]
__version__ = "0.1.0"
