"""
kvroute native core (private: use the `kvroute` package).
"""
from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
import typing
__all__: list[str] = ['Decision', 'DecodeLimits', 'IndexOptions', 'NoWorkerAvailable', 'Router', 'RouterOptions', 'WorkerScore', 'block_keys', 'curve_available', 'curve_public_key', 'decode_batch', 'drop_reasons', 'policy_names', 'policy_schema']
class NoWorkerAvailable(RuntimeError):
    pass
class IndexOptions:
    """
    The index's options (cpp/index/index.h).
    """
    def __init__(self) -> None:
        ...
    @property
    def block_size(self) -> int:
        ...
    @block_size.setter
    def block_size(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def max_blocks_per_worker(self) -> int:
        ...
    @max_blocks_per_worker.setter
    def max_blocks_per_worker(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def max_blocks_total(self) -> int:
        ...
    @max_blocks_total.setter
    def max_blocks_total(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def max_speculative_blocks(self) -> int:
        ...
    @max_speculative_blocks.setter
    def max_speculative_blocks(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def tier_weights(self) -> typing.Annotated[list[float], "FixedSize(3)"]:
        ...
    @tier_weights.setter
    def tier_weights(self, arg0: typing.Annotated[collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex], "FixedSize(3)"]) -> None:
        ...
class DecodeLimits:
    """
    The decoder's bounds (cpp/events/decoder.h).
    """
    def __init__(self) -> None:
        ...
    @property
    def max_blocks_per_event(self) -> int:
        ...
    @max_blocks_per_event.setter
    def max_blocks_per_event(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def max_payload_bytes(self) -> int:
        ...
    @max_payload_bytes.setter
    def max_payload_bytes(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
class RouterOptions:
    """
    The router's options (cpp/router/router.h); defaults as there.
    """
    curve_secret_key: str
    fallback: str
    index: IndexOptions
    limits: DecodeLimits
    policy: str
    topic: str
    def __init__(self) -> None:
        ...
    @property
    def allowed_publisher_ips(self) -> list[str]:
        ...
    @allowed_publisher_ips.setter
    def allowed_publisher_ips(self, arg0: collections.abc.Sequence[str]) -> None:
        ...
    @property
    def curve_allowed_publisher_keys(self) -> list[str]:
        ...
    @curve_allowed_publisher_keys.setter
    def curve_allowed_publisher_keys(self, arg0: collections.abc.Sequence[str]) -> None:
        ...
    @property
    def degraded_hold_s(self) -> float:
        ...
    @degraded_hold_s.setter
    def degraded_hold_s(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def fallback_params(self) -> dict[str, bool | int | float]:
        """
        The fallback's knobs, as policy_params.
        """
    @fallback_params.setter
    def fallback_params(self, arg0: collections.abc.Mapping[str, bool | typing.SupportsInt | typing.SupportsIndex | typing.SupportsFloat | typing.SupportsIndex]) -> None:
        ...
    @property
    def ingest_nice(self) -> int:
        ...
    @ingest_nice.setter
    def ingest_nice(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def ingest_threads(self) -> int:
        ...
    @ingest_threads.setter
    def ingest_threads(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def max_replay_queue_bytes(self) -> int:
        ...
    @max_replay_queue_bytes.setter
    def max_replay_queue_bytes(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def policy_params(self) -> dict[str, bool | int | float]:
        """
        The policy's knobs {name: value}: those given (the others take their defaults); every knob on Router.options.
        """
    @policy_params.setter
    def policy_params(self, arg0: collections.abc.Mapping[str, bool | typing.SupportsInt | typing.SupportsIndex | typing.SupportsFloat | typing.SupportsIndex]) -> None:
        ...
    @property
    def receive_hwm(self) -> int:
        ...
    @receive_hwm.setter
    def receive_hwm(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def replay_timeout_s(self) -> float:
        ...
    @replay_timeout_s.setter
    def replay_timeout_s(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def seed(self) -> int:
        ...
    @seed.setter
    def seed(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def speculative_ttl_s(self) -> float:
        ...
    @speculative_ttl_s.setter
    def speculative_ttl_s(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def stale_after_s(self) -> float:
        ...
    @stale_after_s.setter
    def stale_after_s(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
class WorkerScore:
    def __getstate__(self) -> tuple[str, int, float, float, float, float, float, float, float]:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: tuple) -> None:
        ...
    @property
    def cost(self) -> float:
        ...
    @property
    def load(self) -> float:
        ...
    @property
    def match(self) -> float:
        ...
    @property
    def matched_blocks(self) -> int:
        ...
    @property
    def pending_prefill_tokens(self) -> float:
        ...
    @property
    def requests(self) -> float:
        ...
    @property
    def score(self) -> float:
        ...
    @property
    def weighted_matched_tokens(self) -> float:
        ...
    @property
    def worker(self) -> str:
        ...
class Decision:
    def __getstate__(self) -> tuple[int, str, int, int, int, int, str, bool, str, bool, list[WorkerScore], int, int]:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: tuple) -> None:
        ...
    @property
    def available_blocks(self) -> int:
        ...
    @property
    def available_tokens(self) -> int:
        ...
    @property
    def degraded(self) -> bool:
        ...
    @property
    def fallback(self) -> bool:
        ...
    @property
    def matched_blocks(self) -> int:
        ...
    @property
    def matched_tokens(self) -> int:
        ...
    @property
    def policy(self) -> str:
        ...
    @property
    def prefill_tokens(self) -> int:
        ...
    @property
    def prompt_tokens(self) -> int:
        ...
    @property
    def reason(self) -> str:
        ...
    @property
    def request_id(self) -> int:
        ...
    @property
    def scores(self) -> list[WorkerScore]:
        ...
    @property
    def worker(self) -> str:
        ...
class Router:
    def __init__(self, workers: collections.abc.Sequence[tuple[str, str, bool, typing.SupportsInt | typing.SupportsIndex, str, str]], options: RouterOptions) -> None:
        """
        workers: [(name, kv endpoint, bind, dp_rank or -1, replay endpoint, CURVE server key or '')]. Raises ValueError for an invalid option (std::invalid_argument).
        """
    def add_speculative(self, name: str, keys: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], ttl_s: typing.SupportsFloat | typing.SupportsIndex) -> None:
        """
        Credits the worker with block keys for ttl_s seconds (another replica's decision).
        """
    def add_worker(self, name: str, endpoint: str, bind: bool, dp_rank: typing.SupportsInt | typing.SupportsIndex, replay_endpoint: str, curve_server_key: str = '') -> None:
        ...
    def clear_load(self, name: str) -> None:
        ...
    def close(self) -> None:
        ...
    def complete(self, request_id: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def dump_worker(self, name: str) -> tuple[dict, bytes]:
        """
        (position dict, entries): the worker's entries packed kEntryBytes each (PackEntries) and the stream position they stand at.
        """
    def events_applied(self) -> int:
        ...
    def find_matches(self, tokens: typing.Any, lora_name: str, extra_keys: collections.abc.Sequence[bytes | None] | None) -> dict:
        ...
    def first_token(self, request_id: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def ingest(self, name: str, payload: bytes, seq: typing.SupportsInt | typing.SupportsIndex | None = None) -> bool:
        ...
    def local_load(self) -> list:
        """
        [(worker, inflight, pending_prefill, active_blocks)] of this router's own requests, workers with none left out (Router::LocalLoad).
        """
    def remove_worker(self, name: str) -> None:
        ...
    def restore_worker(self, name: str, entries: bytes, last_seq: typing.SupportsInt | typing.SupportsIndex, have_hash: bool, last_hash: typing.SupportsInt | typing.SupportsIndex) -> bool:
        """
        Restores the worker from a peer's dump_worker (Router::RestoreWorker); False if its stream has already seen a message.
        """
    def select(self, tokens: typing.Any, lora_name: str, extra_keys: collections.abc.Sequence[bytes | None] | None, explain: bool, now: typing.SupportsFloat | typing.SupportsIndex = -1.0, session_key: str = '', external: collections.abc.Mapping[str, typing.SupportsFloat | typing.SupportsIndex] | None = None, exclude: collections.abc.Sequence[str] | None = None, dry_run: bool = False) -> Decision:
        ...
    def select_plain(self, tokens: typing.Any) -> Decision:
        ...
    def set_peer_load(self, name: str, inflight: typing.SupportsInt | typing.SupportsIndex, pending_prefill: typing.SupportsInt | typing.SupportsIndex, active_blocks: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        Other replicas' load on the worker (Router::SetPeerLoad). KeyError, ValueError.
        """
    def set_policy(self, policy: str, policy_params: collections.abc.Mapping[str, bool | typing.SupportsInt | typing.SupportsIndex | typing.SupportsFloat | typing.SupportsIndex], fallback: str, fallback_params: collections.abc.Mapping[str, bool | typing.SupportsInt | typing.SupportsIndex | typing.SupportsFloat | typing.SupportsIndex]) -> None:
        """
        Replaces the policy and the fallback, each with its own knobs (see Router::SetPolicy). ValueError for an unknown name or knob, or a bad value.
        """
    def set_policy_param(self, knob: str, value: bool | typing.SupportsInt | typing.SupportsIndex | typing.SupportsFloat | typing.SupportsIndex) -> None:
        """
        Changes one knob of the policy (not the fallback) for the decisions from now on. ValueError for a knob the policy does not have or a bad value.
        """
    def set_speculative_ttl(self, speculative_ttl_s: typing.SupportsFloat | typing.SupportsIndex) -> None:
        """
        Changes speculative_ttl_s (seconds) for the credits given or released from now on. ValueError below 0.
        """
    def stats(self) -> dict:
        ...
    def update_load(self, name: str, num_requests_waiting: typing.SupportsFloat | typing.SupportsIndex | None, kv_cache_usage_perc: typing.SupportsFloat | typing.SupportsIndex | None) -> None:
        ...
    def worker_blocks(self, name: str) -> dict:
        """
        {engine hash: (block key, GPU refs, CPU refs, disk refs)} held by the worker; byte-string engine hashes appear as the index's 64-bit digest of them (an int).
        """
    @property
    def options(self) -> RouterOptions:
        """
        A copy of the options the router runs with.
        """
    @property
    def speculative_ttl_s(self) -> float:
        """
        The speculative credits' TTL in effect, seconds.
        """
def _set_match_type(match_type: type) -> None:
    ...
def block_keys(tokens: typing.Any, block_size: typing.SupportsInt | typing.SupportsIndex, lora_name: str = '', extra_keys: collections.abc.Sequence[bytes | None] | None = None) -> numpy.typing.NDArray[numpy.uint64]:
    """
    Chained block keys (uint64, one per full block) of a 1-D integer token array.
    """
def curve_available() -> bool:
    """
    Whether libzmq has CURVE (zmq_has("curve")).
    """
def curve_public_key(secret_key: str) -> str:
    """
    The CurveZMQ public key (Z85) of a secret key (Z85). ValueError if malformed or when libzmq has no CURVE.
    """
def decode_batch(payload: bytes) -> tuple[typing.Any, dict]:
    """
    Decodes one KV-event payload. Returns (batch dict or None, drops by reason).
    """
def drop_reasons() -> list:
    ...
def policy_names() -> str:
    ...
def policy_schema() -> dict:
    """
    Each policy's own knobs, from its C++ file: {policy: [{name, type ('bool', 'int', 'float'), default, min, max (inclusive; None for bool; an unbounded float's max is inf, an unbounded int's 2**63 - 1), doc}]}.
    """
