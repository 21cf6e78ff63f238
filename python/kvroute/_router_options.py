"""The checks behind `kvroute.Router`'s keywords: the native defaults, deprecated keyword
names, the flat policy keywords turned into `kvroute.policies` objects (`_build_policies`),
the rules of the scalar options (`_check_options`, the same rules `kvroute.config` applies
to the keys that set them) and the LMCache worker map."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

from kvroute import _core
from kvroute._worker import Worker, z85_problem
from kvroute.policies import (
    DEFAULT_FALLBACK,
    DEFAULT_POLICY,
    FALLBACK_POLICIES,
    POLICIES,
    REGISTRY,
    LmcacheAware,
    Policy,
    policy_class,
)

__all__ = ["RENAMED_KEYWORDS"]

# The C++ defaults (cpp/router/router.h RouterOptions): the Router's keyword defaults below.
_DEFAULTS = _core.RouterOptions()
_TIERS = ("GPU", "CPU", "DISK")


def _cap(blocks: int) -> Optional[int]:
    """A native cap (0 = no cap) as the Router keyword's value (None = no cap)."""
    return int(blocks) or None


# Router keywords that set a parameter of a policy named by a string: keyword -> the field of
# the `kvroute.policies` class (each field under its own name; LmcacheAware's controller
# fields with the ``lmcache_`` prefix).
_POLICY_KEYWORDS = {
    ("lmcache_" + f.name if f.name in ("controller_url", "worker_map") else f.name): f.name
    for c in REGISTRY.values() for f in dataclasses.fields(c)
}
# Deprecated Router keywords -> the keyword that replaces them (DeprecationWarning).
RENAMED_KEYWORDS = {
    "speculative_ttl": "speculative_ttl_s", "replay_timeout": "replay_timeout_s",
    "degraded_hold": "degraded_hold_s", "eviction_interval_secs": "eviction_interval_s",
    "poll_interval_secs": "poll_interval_s", "fallback_policy": "fallback",
}


def _renamed(kw: dict, stacklevel: int) -> dict:
    """``kw`` with deprecated keywords renamed, warning once per keyword."""
    out = dict(kw)
    for old, new in RENAMED_KEYWORDS.items():
        if old in out:
            warnings.warn(f"Router keyword {old!r} is deprecated; use {new!r}",
                          DeprecationWarning, stacklevel=stacklevel + 1)
            if new in out:
                raise TypeError(f"give {new} or its deprecated alias {old}, not both")
            out[new] = out.pop(old)
    return out


def _field_names(p: Union[Policy, type]) -> set:
    return {f.name for f in dataclasses.fields(p)}


def _build_policies(policy: Any, fallback: Any, params: Mapping[str, Any]) -> tuple:
    """``(policy, fallback, other)`` from `Router`'s ``policy``, ``fallback`` and flat policy
    keywords (``params``: field name -> value): the two `Policy` objects, and the checked
    flat keywords of neither (a knob of another policy: unused, kept so that e.g.
    `Router.cache_weight` reads it back). A flat keyword sets the knob of that name of the
    policy and of the fallback, each of which keeps its own value from then on."""
    objects = isinstance(policy, Policy) or isinstance(fallback, Policy)
    built = []
    used: set = set()
    for role, spec, default in (("policy", policy, DEFAULT_POLICY),
                                ("fallback", fallback, DEFAULT_FALLBACK)):
        if isinstance(spec, Policy):
            given = sorted(set(params) & _field_names(spec))
            if given:
                raise ValueError(f"{', '.join(given)} given both as a keyword and in "
                                 f"{role}={spec!r}; give it in the policy object only")
            built.append(spec)
            continue
        if spec is None:
            spec = default
        if not isinstance(spec, str):
            raise ValueError(f"{role} must be a kvroute.policies.Policy (e.g. KvAware()) or "
                             f"one of {', '.join(POLICIES)}, got {spec!r}")
        cls = policy_class(spec)
        if role == "fallback" and (cls.uses_index or cls.needs_controller):
            raise ValueError(f"fallback {spec!r} must be a policy that needs no KV events and no "
                             f"controller: one of {', '.join(FALLBACK_POLICIES)}")
        own = {k: v for k, v in params.items() if k in _field_names(cls)}
        used |= set(own)
        built.append(cls(**own))
    pol, fb = built
    other = {}
    for key in sorted(set(params) - used - _field_names(pol) - _field_names(fb)):
        if objects:
            raise ValueError(f"{key} is not a parameter of policy {pol.name} or fallback "
                             f"{fb.name}; give it in the policy object it belongs to")
        # A parameter of another policy: checked as before, then unused.
        owner = next((c for c in REGISTRY.values() if not c.needs_controller
                      and key in _field_names(c)), None)
        if owner is not None:
            other[key] = getattr(owner(**{key: params[key]}), key)
    return pol, fb, other


# Router keyword -> (kind, low, high): "s" seconds (a finite real; low inclusive, or exclusive
# when marked "gt"), "int" an integer, "cap" a positive integer or None, "z85" a CurveZMQ key
# (40 Z85 characters) or None, "z85s" a list of them or None. The rules the config
# loader (`kvroute.config`) applies to the same settings.
_OPTION_RULES = {
    "speculative_ttl_s": ("s", 0.0, None), "replay_timeout_s": ("s gt", 0.0, None),
    "degraded_hold_s": ("s", 0.0, None), "seed": ("int", 0, 2**64 - 1),
    "ingest_threads": ("int", 1, None), "ingest_nice": ("int", 0, 19),
    "max_payload_bytes": ("int", 1, 2**63 - 1), "max_blocks_per_event": ("int", 1, 2**63 - 1),
    "max_blocks_per_worker": ("cap", 1, 2**63 - 1), "max_blocks_total": ("cap", 1, 2**63 - 1),
    "max_speculative_blocks": ("cap", 1, 2**63 - 1),
    "stale_after_s": ("s", 0.0, None), "receive_hwm": ("int", 1, 2**31 - 1),
    "max_replay_queue_bytes": ("int", 1, 2**63 - 1),
    "curve_secret_key": ("z85", 0, None), "curve_allowed_publisher_keys": ("z85s", 0, None),
}


def _check_options(**values: Any) -> None:
    """Checks Router keywords by `_OPTION_RULES` (and ``topic``, a str): every bad one in one
    ValueError (TypeError when ``topic`` is not a str), each named with what was expected."""
    bad = []
    for name, v in values.items():
        if name == "topic":
            if not isinstance(v, str):
                raise TypeError(f"topic must be a str (a ZeroMQ SUB prefix), got {v!r}")
            continue
        kind, lo, hi = _OPTION_RULES[name]
        if kind in ("cap", "z85", "z85s") and v is None:
            continue
        if kind == "z85":
            why = z85_problem(v)
            if why:
                bad.append(f"{name} {why}")
            continue
        if kind == "z85s":
            if isinstance(v, str) or not isinstance(v, (list, tuple)):
                bad.append(f"{name} must be a list of 40-character Z85 CurveZMQ keys, got {v!r}")
                continue
            bad += [f"{name}[{i}] {why}" for i, k in enumerate(v) if (why := z85_problem(k))]
            continue
        if kind.startswith("s"):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
                and (v > lo if kind.endswith("gt") else v >= lo)
            want = f"a number of seconds {'>' if kind.endswith('gt') else '>='} {lo:g}"
        else:
            ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= (hi or v)
            want = (f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}") + \
                (" or None" if kind == "cap" else "")
        if not ok:
            bad.append(f"{name} must be {want}, got {v!r}")
    if bad:
        raise ValueError("; ".join(bad))


def _check_worker_map(policy: Policy, workers: Sequence[Worker]) -> None:
    """ValueError when an `LmcacheAware` ``worker_map`` value names none of ``workers`` (by
    name or URL): the controller's numbers for it could never reach a decision."""
    if not isinstance(policy, LmcacheAware):
        return
    known = {w.name for w in workers} | {w.url for w in workers}
    stray = sorted(v for v in (policy.worker_map or {}).values() if v not in known)
    if stray:
        raise ValueError(f"lmcache_worker_map names no configured worker: {', '.join(stray)} "
                         f"(workers: {', '.join(w.name for w in workers)})")
