"""KV-event ingestion (``kv_events``: topic, threads, replay, CurveZMQ) and the index's
``limits``.
"""

from __future__ import annotations

from typing import Annotated, List, Optional

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from kvroute._worker import z85_problem
from kvroute.config._base import _DEFAULTS, NonNegFloat, PosFloat, PosInt, _Model, _seconds


class KvEventsConfig(_Model):
    """KV-event ingestion (Router ``topic``, ``ingest_threads``, ``ingest_nice``,
    ``replay_timeout_s``, ``degraded_hold_s``, ``stale_after_s``, ``receive_hwm``,
    ``max_replay_queue_bytes``, ``allowed_publisher_ips``, ``curve_secret_key``,
    ``curve_allowed_publisher_keys``; the ``*_secs`` spellings are
    accepted too)."""

    topic: str = Field(_DEFAULTS.topic,
                       description='ZeroMQ SUB prefix filter on the topic frame (vLLM default "").')
    ingest_threads: PosInt = _DEFAULTS.ingest_threads
    ingest_nice: Annotated[int, Field(ge=0, le=19)] = Field(
        _DEFAULTS.ingest_nice, description="Nice increment of the ingestion threads (0-19; Linux).")
    replay_timeout_s: PosFloat = _seconds("replay_timeout", _DEFAULTS.replay_timeout_s)
    degraded_hold_s: NonNegFloat = _seconds("degraded_hold", _DEFAULTS.degraded_hold_s)
    stale_after_s: NonNegFloat = Field(
        _DEFAULTS.stale_after_s,
        description="A worker silent this long reads stale (decisions: as degraded); 0 = off.")
    receive_hwm: PosInt = Field(_DEFAULTS.receive_hwm,
                                description="Messages a SUB socket queues at most.")
    max_replay_queue_bytes: PosInt = Field(
        _DEFAULTS.max_replay_queue_bytes,
        description="Bytes of live messages kept per worker while it replays.")
    allowed_publisher_ips: Optional[List[str]] = Field(
        None, description="Bound SUB sockets accept publishers from these IP addresses only.")
    curve_secret_key: Optional[str] = Field(
        None, description="The router's CurveZMQ secret key (Z85): bound SUB sockets are CURVE "
                          "servers with it.")
    curve_allowed_publisher_keys: Optional[List[str]] = Field(
        None, description="Publisher public keys (Z85) bound CURVE sockets accept; needs "
                          "curve_secret_key.")

    @field_validator("curve_secret_key")
    @classmethod
    def _curve_secret(cls, v: Optional[str]) -> Optional[str]:
        why = None if v is None else z85_problem(v)
        if why:
            raise ValueError(f"curve_secret_key {why}")
        return v

    @field_validator("curve_allowed_publisher_keys")
    @classmethod
    def _curve_allowed(cls, v: Optional[List[str]]) -> Optional[List[str]]:
        for i, k in enumerate(v or ()):
            why = z85_problem(k)
            if why:
                raise ValueError(f"curve_allowed_publisher_keys[{i}] {why}")
        return v

    @model_validator(mode="after")
    def _curve_pair(self) -> KvEventsConfig:
        if self.curve_allowed_publisher_keys and self.curve_secret_key is None:
            raise ValueError("curve_allowed_publisher_keys needs curve_secret_key")
        return self


class LimitsConfig(_Model):
    """Memory caps on indexed blocks and on the blocks of live speculative credits (``null`` =
    no cap), and the largest accepted payload."""

    max_blocks_per_worker: Optional[PosInt] = _DEFAULTS.index.max_blocks_per_worker or None
    max_blocks_total: Optional[PosInt] = _DEFAULTS.index.max_blocks_total or None
    max_speculative_blocks: Optional[PosInt] = _DEFAULTS.index.max_speculative_blocks or None
    max_payload_bytes: PosInt = _DEFAULTS.limits.max_payload_bytes
