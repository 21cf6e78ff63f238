"""
kvroute native core (private: use the `kvroute` package).
"""
from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
import typing
__all__: list[str] = ['Decision', 'NoWorkerAvailable', 'Router', 'WorkerScore', 'block_keys', 'decode_batch', 'drop_reasons', 'policy_names']
class NoWorkerAvailable(RuntimeError):
    pass
class WorkerScore:
    def __repr__(self) -> str:
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
    def __repr__(self) -> str:
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
    def __init__(self, workers: collections.abc.Sequence[tuple[str, str, bool, typing.SupportsInt | typing.SupportsIndex, str]], options: dict) -> None:
        """
        workers: [(name, kv endpoint, bind, dp_rank or -1, replay endpoint)]; options: see kvroute.Router.
        """
    def add_worker(self, name: str, endpoint: str, bind: bool, dp_rank: typing.SupportsInt | typing.SupportsIndex, replay_endpoint: str) -> None:
        ...
    def clear_load(self, name: str) -> None:
        ...
    def close(self) -> None:
        ...
    def complete(self, request_id: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def events_applied(self) -> int:
        ...
    def find_matches(self, tokens: typing.Any, lora_name: str, extra_keys: collections.abc.Sequence[bytes | None] | None) -> dict:
        ...
    def first_token(self, request_id: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def ingest(self, name: str, payload: bytes, seq: typing.SupportsInt | typing.SupportsIndex | None = None) -> bool:
        ...
    def remove_worker(self, name: str) -> None:
        ...
    def select(self, tokens: typing.Any, lora_name: str, extra_keys: collections.abc.Sequence[bytes | None] | None, explain: bool, now: typing.SupportsFloat | typing.SupportsIndex = -1.0, session_key: str = '', external: collections.abc.Mapping[str, typing.SupportsFloat | typing.SupportsIndex] | None = None, exclude: collections.abc.Sequence[str] | None = None, dry_run: bool = False) -> Decision:
        ...
    def stats(self) -> dict:
        ...
    def update_load(self, name: str, num_requests_waiting: typing.SupportsFloat | typing.SupportsIndex | None, kv_cache_usage_perc: typing.SupportsFloat | typing.SupportsIndex | None) -> None:
        ...
    def worker_blocks(self, name: str) -> dict:
        """
        {engine hash: (block key, GPU refs, CPU refs, disk refs)} held by the worker; byte-string engine hashes appear as the index's 64-bit digest of them (an int).
        """
def _set_match_type(match_type: type) -> None:
    ...
def block_keys(tokens: typing.Any, block_size: typing.SupportsInt | typing.SupportsIndex, lora_name: str = '', extra_keys: collections.abc.Sequence[bytes | None] | None = None) -> numpy.typing.NDArray[numpy.uint64]:
    """
    Chained block keys (uint64, one per full block) of a 1-D integer token array.
    """
def decode_batch(payload: bytes) -> tuple[typing.Any, dict]:
    """
    Decodes one KV-event payload. Returns (batch dict or None, drops by reason).
    """
def drop_reasons() -> list:
    ...
def policy_names() -> str:
    ...
