"""Workers and the ``mode`` they are grouped in: `WorkerConfig` (``url``, ``kv_events``,
``replay``, ``dp_rank``, CurveZMQ key), the vLLM router's ``worker_urls`` / ``prefill_urls``
shorthands, and the modes `RegularMode` / `PdMode` (``MODE_TYPES``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Dict, List, Literal, Optional, Union

from pydantic import (
    AliasChoices,
    Field,
    field_validator,
    model_validator,
)

from kvroute import policies as P
from kvroute._worker import z85_problem
from kvroute.config._base import _check_endpoint, _Model
from kvroute.config.policy import Policy, _as_policy_dict

# -- workers -----------------------------------------------------------------------------------

class WorkerConfig(_Model):
    """One engine: where requests go and, optionally, where its KV events come from.

    Also accepted in a worker list as a bare URL string (no KV events).
    """

    url: str = Field(min_length=1, description="Where requests go; the worker's identity.")
    kv_events: Optional[str] = Field(
        None, validation_alias=AliasChoices("kv_events", "kv_endpoint"),
        description="The engine's KV-event publisher (vLLM --kv-events-config endpoint).")
    replay: Optional[str] = Field(
        None, validation_alias=AliasChoices("replay", "replay_endpoint"),
        description="The engine's replay socket (vLLM --kv-events-config replay_endpoint).")
    dp_rank: Optional[Annotated[int, Field(ge=0)]] = Field(
        None, description="Data-parallel rank this endpoint publishes for.")
    bind: bool = Field(False, description="Bind the SUB socket instead of connecting.")
    curve_server_key: Optional[str] = Field(
        None, description="The publisher's CurveZMQ public key (Z85, 40 characters): the SUB "
                          "socket connects as a CURVE client (connected workers only).")
    bootstrap_port: Optional[Annotated[int, Field(ge=1, le=65535)]] = Field(
        None, description="PD prefill workers: the bootstrap port of the vLLM / SGLang routers' "
                          "prefill_urls entries. Kept for the proxy; not used for routing.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.strip() or any(c.isspace() for c in v):
            raise ValueError(f"url must be a non-empty string without spaces, got {v!r}")
        return v

    @field_validator("kv_events")
    @classmethod
    def _kv(cls, v: Optional[str]) -> Optional[str]:
        return _check_endpoint(v, "kv_events")

    @field_validator("replay")
    @classmethod
    def _replay(cls, v: Optional[str]) -> Optional[str]:
        return _check_endpoint(v, "replay")

    @field_validator("curve_server_key")
    @classmethod
    def _curve(cls, v: Optional[str]) -> Optional[str]:
        why = None if v is None else z85_problem(v)
        if why:
            raise ValueError(f"curve_server_key {why}")
        return v

    @model_validator(mode="after")
    def _curve_connected(self) -> WorkerConfig:
        if self.curve_server_key is not None and (self.bind or self.kv_events is None):
            raise ValueError("curve_server_key is for a connected kv_events endpoint (bind: "
                             "false); a bound socket is a CURVE server with "
                             "kv_events.curve_secret_key")
        return self

    @property
    def name(self) -> str:
        """As `kvroute.Worker.name`: ``url`` or ``url|dp=<rank>``."""
        return self.url if self.dp_rank is None else f"{self.url}|dp={self.dp_rank}"


def _worker_entries(value: Any) -> Any:
    """A worker list entry may be a bare URL string."""
    if isinstance(value, list):
        return [{"url": w} if isinstance(w, str) else w for w in value]
    return value


def _url_entries(value: Any, key: str, allow_port: bool) -> List[Any]:
    """``worker_urls`` / ``decode_urls``: URL strings; ``prefill_urls`` also ``[url, port]``."""
    if not isinstance(value, list):
        raise ValueError(f"{key} must be a list of URL strings, got {type(value).__name__}")
    out: List[Any] = []
    for i, u in enumerate(value):
        if isinstance(u, str):
            out.append({"url": u})
        elif allow_port and isinstance(u, (list, tuple)) and len(u) == 2 and isinstance(u[0], str):
            out.append({"url": u[0], "bootstrap_port": u[1]})
        else:
            form = "a URL string or [url, bootstrap_port]" if allow_port else "a URL string"
            raise ValueError(f"{key}[{i}] must be {form}, got {u!r}")
    return out


def _unique(workers: List[WorkerConfig], where: str) -> List[WorkerConfig]:
    if not workers:
        raise ValueError(f"{where} needs at least one worker")
    seen: Dict[str, int] = {}
    for i, w in enumerate(workers):
        if w.name in seen:
            raise ValueError(f"{where}: worker {w.name!r} appears twice "
                             f"(entries {seen[w.name]} and {i})")
        seen[w.name] = i
    return workers



# -- modes -------------------------------------------------------------------------------------

class ModeKvEventsConfig(_Model):
    """``mode.kv_events`` of the vLLM router fork (v0.12): ``topic_filter`` is the ZeroMQ SUB
    prefix filter (overrides the top-level ``kv_events.topic``); ``default_port``: a worker
    without its own ``kv_events`` endpoint, in a pool whose policy reads KV events
    (``kv_aware``, ``cost``), publishes on ``tcp://<host of its url>:<default_port>`` (data-
    parallel rank r on ``default_port + r``)."""

    topic_filter: Optional[str] = None
    default_port: Optional[Annotated[int, Field(ge=1, le=65535)]] = None


class RegularMode(_Model):
    """One pool of workers. ``workers`` (with KV endpoints) or the vLLM router's
    ``worker_urls`` (URLs only), not both."""

    type: Literal["regular"]
    workers: List[WorkerConfig]
    kv_events: Optional[ModeKvEventsConfig] = None
    _shorthand_keys: ClassVar[tuple] = ("worker_urls",)

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        if "worker_urls" in data:
            if "workers" in data:
                raise ValueError("give either workers or worker_urls, not both")
            data["workers"] = _url_entries(data.pop("worker_urls"), "worker_urls", False)
        elif "workers" not in data:
            raise ValueError("regular mode needs workers (or worker_urls)")
        else:
            data["workers"] = _worker_entries(data["workers"])
        return data

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: List[WorkerConfig]) -> List[WorkerConfig]:
        return _unique(v, "workers")


class PdMode(_Model):
    """Prefill/decode disaggregation: separate prefill and decode pools, each routed by its own
    policy. ``prefill`` / ``decode`` worker lists, or the vLLM / SGLang routers'
    ``prefill_urls`` (URL or ``[url, bootstrap_port]``) / ``decode_urls``. ``prefill_policy``
    / ``decode_policy`` may sit here (as in the vLLM router) or at the top level."""

    type: Literal["pd_disaggregation", "prefill_decode", "vllm_prefill_decode"]
    prefill: List[WorkerConfig]
    decode: List[WorkerConfig]
    prefill_policy: Optional[Policy] = None
    decode_policy: Optional[Policy] = None
    kv_events: Optional[ModeKvEventsConfig] = None
    _shorthand_keys: ClassVar[tuple] = ("prefill_urls", "decode_urls")

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        for pool in ("prefill", "decode"):
            short = f"{pool}_urls"
            if short in data:
                if pool in data:
                    raise ValueError(f"give either {pool} or {short}, not both")
                data[pool] = _url_entries(data.pop(short), short, pool == "prefill")
            elif pool not in data:
                raise ValueError(f"{data.get('type', 'pd')} mode needs {pool} (or {short})")
            else:
                data[pool] = _worker_entries(data[pool])
            key = f"{pool}_policy"
            if key in data:
                data[key] = _as_policy_dict(data[key], P.DEFAULT_POLICY)
        return data

    @field_validator("type")
    @classmethod
    def _canonical(cls, v: str) -> str:
        return "pd_disaggregation"

    @field_validator("prefill")
    @classmethod
    def _prefill(cls, v: List[WorkerConfig]) -> List[WorkerConfig]:
        return _unique(v, "prefill")

    @field_validator("decode")
    @classmethod
    def _decode(cls, v: List[WorkerConfig]) -> List[WorkerConfig]:
        return _unique(v, "decode")


Mode = Annotated[Union[RegularMode, PdMode], Field(discriminator="type")]
MODE_TYPES = ("regular", "pd_disaggregation", "prefill_decode", "vllm_prefill_decode")
