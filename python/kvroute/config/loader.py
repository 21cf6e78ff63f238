"""`load_config`: YAML (duplicate keys refused) or a dict to a `RouterConfig`, every problem
at every level reported in one `ConfigError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple, Union

import yaml
from pydantic import (
    ValidationError,
)

from kvroute._worker import Worker
from kvroute.config._base import ConfigError
from kvroute.config.policy import POLICY_TYPES
from kvroute.config.router_config import RouterConfig
from kvroute.config.workers import MODE_TYPES

# -- loading -----------------------------------------------------------------------------------

class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that rejects a key given twice in one mapping (PyYAML keeps the last)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: Dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1} "
                              f"(first at line {seen[key] + 1})")
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

#: Top-level keys of the vLLM router's ``RouterConfig`` (vllm-project/router
#: src/config/types.rs) that kvroute has no counterpart for: a config naming any of them is
#: refused with one problem listing them all (kvroute's own equivalents, where it has one:
#: ``serving.upstream_timeout_s``, ``serving.max_retries``, ``serving.circuit_breaker``,
#: ``limits.max_payload_bytes`` for KV-event payloads).
VLLM_ROUTER_KEYS_NOT_HONOURED = (
    "connection_mode", "request_timeout_secs",
    "worker_startup_timeout_secs", "worker_startup_check_interval_secs", "api_key",
    "api_key_validation_urls", "discovery", "log_dir",
    "max_concurrent_requests", "queue_size", "queue_timeout_secs",
    "rate_limit_tokens_per_second", "cors_allowed_origins", "circuit_breaker",
    "disable_circuit_breaker", "enable_igw", "history_backend",
    "enable_profiling", "profile_timeout_secs", "kv_connector", "program_scheduling",
)

_UNION_FIELDS = {"mode", "policy", "prefill_policy", "decode_policy", "fallback_policy"}
_TAGS = set(POLICY_TYPES) | set(MODE_TYPES)


def _path(loc: tuple) -> str:
    out = ""
    prev: Any = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif prev in _UNION_FIELDS and part in _TAGS:
            pass  # the union member pydantic entered, not a key
        else:
            out += f".{part}" if out else str(part)
        prev = part
    return out or "(top level)"


def _message(err: Mapping[str, Any]) -> str:
    kind, msg, ctx = err["type"], err["msg"], err.get("ctx") or {}
    if kind == "union_tag_invalid":
        allowed = ctx.get("expected_tags", "").replace("'", "")
        return f"unknown type {ctx.get('tag')!r}; allowed: {allowed}"
    if kind == "union_tag_not_found":
        return "missing 'type'"
    if kind == "missing":
        return "required key is missing"
    if kind == "extra_forbidden":
        allowed = getattr(err.get("input"), "allowed", None)
        key = err["loc"][-1] if err.get("loc") else "?"
        return f"unknown key {key!r}" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    if msg.startswith("Value error, "):
        return msg[len("Value error, "):]
    value = err.get("input")
    if isinstance(value, list):
        msg += " (got a list)"
    elif not isinstance(value, Mapping):
        msg += f" (got {value!r})"
    return msg


def _format(e: ValidationError, source: str) -> ConfigError:
    problems: List[tuple] = []
    unknown: Dict[str, tuple] = {}  # the unknown keys of one mapping make one problem
    for err in e.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden" and loc:
            where = _path(loc[:-1])
            if where not in unknown:
                unknown[where] = ([], getattr(err.get("input"), "allowed", None))
                problems.append((where, None))
            unknown[where][0].append(loc[-1])
        else:
            problems.append((_path(loc), _message(err)))
    for i, (where, msg) in enumerate(problems):
        if msg is None:
            keys, allowed = unknown[where]
            what = ", ".join(repr(k) for k in keys)
            msg = f"unknown key{'s' if len(keys) > 1 else ''} {what}"
            problems[i] = (where, msg + (f"; allowed: {', '.join(allowed)}" if allowed else ""))
    lines = "\n".join(f"  {p}: {m}" for p, m in problems)
    return ConfigError(f"invalid kvroute config{source}:\n{lines}", problems)


def load_config(source: Union[str, Path, Mapping[str, Any], RouterConfig]) -> RouterConfig:
    """Reads and validates a configuration.

    Parameters
    ----------
    source:
        Path of a YAML file (``str`` or `Path`), or the configuration as a mapping (e.g. from
        JSON), or an already built `RouterConfig` (returned as is).

    Raises
    ------
    ConfigError
        (a ValueError) naming every bad key with what is allowed, or a YAML syntax error.
    FileNotFoundError
        No such file.
    """
    if isinstance(source, RouterConfig):
        return source
    where = ""
    if isinstance(source, (str, Path)):
        path = Path(source)
        where = f" ({path})"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"kvroute config file not found: {path}") from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        except ConfigError as e:
            raise ConfigError(f"invalid kvroute config{where}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"invalid kvroute config{where}: not valid YAML: {e}") from None
    elif isinstance(source, Mapping):
        data = source
    else:
        raise TypeError(f"load_config takes a YAML path or a mapping, got {type(source).__name__}")
    if data is None:
        raise ConfigError(f"invalid kvroute config{where}: it is empty (mode is required)")
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid kvroute config{where}: the top level must be a mapping, "
                          f"got {type(data).__name__}")
    data = dict(data)
    foreign = [k for k in data if k in VLLM_ROUTER_KEYS_NOT_HONOURED]
    foreign_problem = (
        "(top level)",
        f"vLLM router key{'s' if len(foreign) > 1 else ''} kvroute cannot honour: "
        f"{', '.join(foreign)} (remove them; see kvroute.config.VLLM_ROUTER_KEYS_NOT_HONOURED)")
    for k in foreign:
        del data[k]
    try:
        cfg = RouterConfig.model_validate(data)
    except ValidationError as e:
        err = _format(e, where)
        if not foreign:
            raise err from None
        problems = [foreign_problem, *err.problems]
    else:
        if not foreign:
            return cfg
        problems = [foreign_problem]
    lines = "\n".join(f"  {p}: {m}" for p, m in problems)
    raise ConfigError(f"invalid kvroute config{where}:\n{lines}", problems)


def regular_router_args(
        source: Union[str, Path, Mapping[str, Any], RouterConfig]) -> Tuple[List[Worker],
                                                                            Dict[str, Any]]:
    """``(workers, router_kwargs)`` of a regular-mode configuration, for
    ``Router(workers, **router_kwargs)`` (`router_from_config`, `kvroute.Router.from_config`).

    Raises
    ------
    ConfigError
        As `load_config`; a ``pd_disaggregation`` config (two pools: build one Router per
        pool from `load_config`'s result).
    """
    cfg = load_config(source)
    if cfg.is_pd:
        raise ConfigError(
            "router_from_config builds one router, but this config is pd_disaggregation "
            "(two pools): load it with load_config() and build Router(cfg.prefill_workers(), "
            "**cfg.prefill_router_kwargs()) and Router(cfg.decode_workers(), "
            "**cfg.decode_router_kwargs())")
    return cfg.workers(), cfg.router_kwargs()
