"""Prefill/decode disaggregation: a prefill pool and a decode pool, each with its own policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Union

from kvroute._router import Decision, Router, WorkerLike
from kvroute.delivered import HitRateTracker
from kvroute.policies import ConsistentHash, KvAware, Policy


@dataclass(frozen=True)
class PDDecision:
    """Where one request goes in a disaggregated fleet.

    ``prefill`` is None when the prefill pool was skipped: the decode worker already holds all
    but at most ``pd_uncached_token_threshold`` tokens of the prompt, so it prefills the rest
    itself.
    """

    prefill: Optional[Decision]
    decode: Decision

    @property
    def skipped_prefill(self) -> bool:
        return self.prefill is None


class PDRouter:
    """Two `Router` s: prefill workers (default ``kv_aware``: reuse the prompt's KV cache) and
    decode workers (default ``consistent_hash``: keep a session's decode KV on one worker).

    Parameters
    ----------
    prefill_workers, decode_workers:
        Non-empty sequences of `Worker` (or what `Router` accepts).
    prefill_policy, decode_policy:
        `kvroute.policies` objects or policy names (see `kvroute.POLICIES`); defaults
        ``KvAware()`` and ``ConsistentHash()``.
    pd_uncached_token_threshold:
        When the decode worker chosen for a request would have to prefill at most this many
        tokens (prompt tokens − its prefix match), skip the prefill pool. Default None: never
        skip (no threshold is assumed; 256 in examples is only an example value).
    prefill_options, decode_options:
        Extra `Router` keyword arguments for one pool; ``**common`` go to both.

    Raises
    ------
    ValueError
        As `Router`, or a negative threshold.
    """

    def __init__(self, prefill_workers: Sequence[WorkerLike], decode_workers: Sequence[WorkerLike],
                 *, prefill_policy: Union[Policy, str] = KvAware.name,
                 decode_policy: Union[Policy, str] = ConsistentHash.name,
                 pd_uncached_token_threshold: Optional[int] = None,
                 prefill_options: Optional[Mapping[str, Any]] = None,
                 decode_options: Optional[Mapping[str, Any]] = None, **common: Any) -> None:
        if pd_uncached_token_threshold is not None and (
                not isinstance(pd_uncached_token_threshold, int)
                or pd_uncached_token_threshold < 0):
            raise ValueError("pd_uncached_token_threshold must be a non-negative int or None, "
                             f"got {pd_uncached_token_threshold!r}")
        self.threshold = pd_uncached_token_threshold
        self.prefill = Router(prefill_workers, policy=prefill_policy,
                              **{**common, **(prefill_options or {})})
        try:
            self.decode = Router(decode_workers, policy=decode_policy,
                                 **{**common, **(decode_options or {})})
        except Exception:
            self.prefill.close()
            raise

    @classmethod
    def from_config(cls, source: Any, *,
                    pd_uncached_token_threshold: Optional[int] = None) -> PDRouter:
        """From a ``mode: {type: pd_disaggregation, ...}`` configuration (`kvroute.config`).
        ``pd_uncached_token_threshold`` given here wins over the config's key of that name."""
        from kvroute.config import load_config

        cfg = load_config(source)
        if pd_uncached_token_threshold is None:
            pd_uncached_token_threshold = cfg.pd_uncached_token_threshold
        pk, dk = cfg.prefill_router_kwargs(), cfg.decode_router_kwargs()
        pp, dp = pk.pop("policy"), dk.pop("policy")
        return cls(cfg.prefill_workers(), cfg.decode_workers(), prefill_policy=pp,
                   decode_policy=dp, pd_uncached_token_threshold=pd_uncached_token_threshold,
                   prefill_options=pk, decode_options=dk)

    def select_pair(self, tokens: Any, *, exclude_prefill: Any = None,
                    exclude_decode: Any = None, **kwargs: Any) -> PDDecision:
        """Chooses the decode worker, then (unless skipped) the prefill worker.

        ``kwargs`` are `Router.select_worker`'s (lora_name, cache_salt, session_key, ...);
        ``exclude_prefill`` / ``exclude_decode``: that call's ``exclude`` for one pool
        (workers or names of that pool). Both decisions hold load until `complete`.

        Raises
        ------
        kvroute.NoWorkerAvailable
            Every worker of the pool asked is excluded (nothing is held then).
        """
        d = self.decode.select_worker(tokens, exclude=exclude_decode, **kwargs)
        if self.threshold is not None and d.prefill_tokens <= self.threshold:
            return PDDecision(None, d)
        try:
            p = self.prefill.select_worker(tokens, exclude=exclude_prefill, **kwargs)
        except BaseException:
            self.decode.complete(d)
            raise
        return PDDecision(p, d)

    def first_token(self, pd: PDDecision) -> None:
        """The prefill is done: release the prefill worker's load and the decode worker's
        prefill part."""
        if pd.prefill is not None:
            self.prefill.complete(pd.prefill)
        self.decode.first_token(pd.decode)

    def complete(self, pd: PDDecision) -> None:
        if pd.prefill is not None:
            self.prefill.complete(pd.prefill)
        self.decode.complete(pd.decode)

    def stats(self) -> dict:
        return {"prefill": self.prefill.stats(), "decode": self.decode.stats()}

    @property
    def hit_rate(self) -> Dict[str, HitRateTracker]:
        """``{"prefill": ..., "decode": ...}``: each pool's `Router.hit_rate` (available /
        captured / delivered prompt tokens of the requests reported to that pool with
        `Router.report_delivered`; `kvroute.serving.pd` reports the prefill worker's answers
        to the prefill pool, and the decode worker's only when the prefill pool was
        skipped)."""
        return {"prefill": self.prefill.hit_rate, "decode": self.decode.hit_rate}

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    def __enter__(self) -> PDRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
