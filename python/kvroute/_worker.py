"""`Worker`: one engine instance the router sends requests to, and the checks of a worker
spec (`as_worker`, `z85_problem` for CurveZMQ keys). Below both `kvroute._router` and
`kvroute.config`, which build Workers; imports nothing of kvroute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

__all__ = ["Worker", "WorkerLike", "as_worker", "z85_problem"]


@dataclass(frozen=True)
class Worker:
    """One engine instance the router can send requests to.

    Parameters
    ----------
    url:
        Where requests go (e.g. ``"http://10.0.0.5:8000"``); the worker's identity.
    kv_endpoint:
        ZeroMQ endpoint of the engine's KV-event publisher, e.g. ``"tcp://10.0.0.5:5557"``
        (vLLM ``--kv-events-config`` ``endpoint``; data-parallel rank r publishes on port + r).
        ``None``: no socket; feed payloads with `Router.ingest`.
    dp_rank:
        Data-parallel rank this endpoint publishes for. When set, batches carrying another
        rank are dropped (counted as ``rank_mismatch``) and the rank is part of the name.
    bind:
        Bind the SUB socket instead of connecting (for publishers that connect).
    replay_endpoint:
        The engine's replay ROUTER socket (vLLM ``--kv-events-config`` ``replay_endpoint``,
        e.g. ``"tcp://10.0.0.5:5558"``). On a sequence gap the router asks it for the missing
        batches; without it a gap drops the worker's state and marks it degraded.
    curve_server_key:
        The publisher's CurveZMQ public key (ZeroMQ RFC 26), Z85 text of 40 characters (as
        ``zmq.curve_keypair()`` writes it), for a publisher whose PUB socket is a CURVE
        server (``curve_server = True`` with the matching secret key): the SUB socket
        connects as a CURVE client, so only the holder of that secret key can publish as this
        worker, and the events are encrypted. The router authenticates with its
        ``curve_secret_key`` (a `Router` keyword) or, without one, a key pair of its own.
        Connected workers only (``bind=False``, ``kv_endpoint`` set). ``None``: no CURVE.
        ValueError for a malformed key.
    """

    url: str
    kv_endpoint: Optional[str] = None
    dp_rank: Optional[int] = None
    bind: bool = False
    replay_endpoint: Optional[str] = None
    curve_server_key: Optional[str] = None

    @property
    def name(self) -> str:
        """Identity used in decisions and stats: ``url``, or ``url|dp=<rank>``."""
        return self.url if self.dp_rank is None else f"{self.url}|dp={self.dp_rank}"


WorkerLike = Union[Worker, str, Sequence[Any], Mapping[str, Any]]


def as_worker(w: WorkerLike) -> Worker:
    if isinstance(w, Worker):
        out = w
    elif isinstance(w, str):
        out = Worker(w)
    elif isinstance(w, Mapping):
        out = Worker(**w)
    elif isinstance(w, Sequence):
        out = Worker(*w)
    else:
        raise ValueError(
            f"expected a Worker, a URL, a (url, kv_endpoint) tuple or a dict, got {w!r}")
    if not isinstance(out.url, str) or not out.url:
        raise ValueError(f"worker url must be a non-empty string, got {out.url!r}")
    if out.dp_rank is not None and (not isinstance(out.dp_rank, int) or out.dp_rank < 0):
        raise ValueError(f"dp_rank must be a non-negative int or None, got {out.dp_rank!r}")
    if out.curve_server_key is not None:
        bad = z85_problem(out.curve_server_key)
        if bad:
            raise ValueError(f"worker {out.name}: curve_server_key {bad}")
        if out.bind or not out.kv_endpoint:
            raise ValueError(f"worker {out.name}: curve_server_key is for a connected "
                             "kv_endpoint (bind=False); a bound socket is a CURVE server with "
                             "the Router's curve_secret_key")
    return out


# ZeroMQ's Z85 alphabet (RFC 32): 5 characters per 4 bytes, big-endian base 85.
_Z85 = ("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        ".-:+=^!/*?&<>()[]{}@%$#")
_Z85_VALUE = {c: i for i, c in enumerate(_Z85)}


def z85_problem(key: Any) -> Optional[str]:
    """Why ``key`` is not a CurveZMQ key in Z85 (40 characters, 32 bytes), or None."""
    if not isinstance(key, str):
        return f"must be a str (a 40-character Z85 CurveZMQ key), got {key!r}"
    if len(key) != 40:
        return f"must be a 40-character Z85 CurveZMQ key, got {len(key)} characters"
    for i in range(0, 40, 5):
        v = 0
        for c in key[i:i + 5]:
            if c not in _Z85_VALUE:
                return f"must be a 40-character Z85 CurveZMQ key, got {c!r} in {key!r}"
            v = v * 85 + _Z85_VALUE[c]
        if v >= 2**32:
            return f"must be a 40-character Z85 CurveZMQ key, got {key!r} (not Z85: group " \
                   f"{key[i:i + 5]!r} is past 32 bits)"
    return None
