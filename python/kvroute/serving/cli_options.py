"""``kvroute serve``'s command line over its configuration: one table from flags to config keys.

- `serve_options`: what a serving process runs with (the command line over the config's
  ``serving:`` section and the vLLM router's server keys over the defaults of
  `kvroute.config.ServingConfig`, each written there once);
- the flag tables: `_SERVING_FLAGS` (flag ``--x-y`` = key ``serving.x_y``), `_RETRY_FLAGS`
  (``--retry-<key>`` = ``serving.retry.<key>``), `_HEALTH_FLAGS` (``--health-<key>`` =
  ``health_check.<key>``); `serve_options` maps the rest (``--upstream-timeout-s`` ...);
- `_config_source`: ``--config``, or the config the vLLM router's worker flags describe.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from kvroute.config import RouterConfig

__all__ = ["serve_options"]


def _tokenizer_dir(model_path: Optional[str]) -> Optional[str]:
    """The tokenizer directory ``model_path`` names (the fork's key): the path itself when it
    holds ``tokenizer.json``, else for a Hugging Face id (``org/name``) its snapshot in the
    local Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``);
    nothing is downloaded. None when neither exists."""
    import os
    from pathlib import Path

    if not model_path:
        return None
    p = Path(model_path).expanduser()
    if (p / "tokenizer.json").is_file():
        return str(p)
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    repo = Path(hub) / ("models--" + model_path.replace("/", "--")) / "snapshots"
    for snap in sorted(repo.glob("*"), key=lambda d: d.stat().st_mtime, reverse=True):
        if (snap / "tokenizer.json").is_file():
            return str(snap)
    return None


def serve_options(cfg: RouterConfig, args: argparse.Namespace) -> dict:
    """What ``kvroute serve`` runs with: the command line over the config (its ``serving:``
    section and the vLLM router's server keys) over the defaults. Keys: ``host``, ``port``,
    ``log_level``, ``metrics`` (``(host, port)`` or None), ``tokenizer``, ``model``, and
    ``options`` (`kvroute.fastapi.create_router` keywords)."""
    flags = {"upstream_timeout_s": args.upstream_timeout_s,
             "connect_timeout_s": args.connect_timeout_s,
             "max_retries": args.max_retries, "breaker_failures": args.breaker_failures,
             "breaker_reset_s": args.breaker_reset_s,
             "scrape_metrics_interval_s": args.scrape_interval_s,
             "scrape_stale_after_s": args.scrape_stale_after_s,
             "orca": (None if args.orca is None
                      else False if args.orca == "off" else args.orca.upper())}
    if getattr(args, "disable_retries", False):
        flags["max_retries"] = 0
    options = {k: v for k, v in flags.items() if v is not None}
    cfg = _with_serving_flags(cfg, args)
    if cfg.health_check is not None:
        options["health_check"] = cfg.health_check.model_dump()
    tokenizer = args.tokenizer or cfg.serving.tokenizer
    if tokenizer is None and cfg.model_path is not None:
        tokenizer = _tokenizer_dir(cfg.model_path)
        if tokenizer is None:
            print(f"kvroute serve: model_path {cfg.model_path!r}: no tokenizer.json there nor "
                  "in the local Hugging Face cache; text prompts route without a prefix "
                  "match (pass --tokenizer DIR)", file=sys.stderr)
    metrics = (cfg.metrics.host, cfg.metrics.port) if cfg.metrics is not None else None
    return {
        "host": args.host or cfg.host or "127.0.0.1",
        "port": args.port if args.port is not None else cfg.port if cfg.port is not None
        else 8080,
        "log_level": args.log_level or cfg.log_level or "info",
        "metrics": metrics,
        "tokenizer": tokenizer,
        "model": args.model or cfg.serving.model or cfg.model_path,
        "options": options,
        "config": cfg,
    }


#: ``kvroute serve`` flags that set a key of the config's ``serving:`` section
#: (``dest`` = the key).
_SERVING_FLAGS = ("first_byte_timeout_s", "recovery_ramp_s", "max_body_bytes",
                  "max_prompt_tokens", "chars_per_token", "tokenizer_threads",
                  "long_prompt_chars", "long_prompt_threads", "tokenizer_max_queued",
                  "prefix_cache_tokens", "request_id_headers", "access_log",
                  "access_log_bodies", "gc_threshold", "gc_freeze")


#: ``--retry-<key>`` flags (``dest`` ``retry_<key>``): keys of ``serving.retry``.
_RETRY_FLAGS = ("initial_backoff_ms", "max_backoff_ms", "backoff_multiplier", "jitter_factor",
                "on")


#: ``--health-*`` flags: keys of the ``health_check`` section.
_HEALTH_FLAGS = ("failure_threshold", "success_threshold", "timeout_s", "check_interval_s",
                 "endpoint")


def _with_serving_flags(cfg: RouterConfig, args: argparse.Namespace) -> RouterConfig:
    """``cfg`` with the serve flags that mirror config keys applied (each given flag wins over
    its key; validated as the key is). A ``--health-*`` flag turns the health checks on (the
    section's other keys at their defaults unless the config sets them);
    ``--disable-health-check`` turns them off. Raises ValueError naming the flag's key."""
    from pydantic import ValidationError

    from kvroute.config import HealthCheckConfig, ServingConfig

    serving = {k: getattr(args, k) for k in _SERVING_FLAGS if getattr(args, k, None) is not None}
    if serving.get("max_prompt_tokens") == "none":
        serving["max_prompt_tokens"] = None
    if serving.get("gc_threshold") == "python":
        serving["gc_threshold"] = None
    retry = {"retry_on" if k == "on" else k: getattr(args, "retry_" + k) for k in _RETRY_FLAGS
             if getattr(args, "retry_" + k, None) is not None}
    health = {k: getattr(args, "health_" + k) for k in _HEALTH_FLAGS
              if getattr(args, "health_" + k, None) is not None}
    update: dict = {}
    try:
        if serving or retry:
            data = cfg.serving.model_dump()
            data.update(serving)
            data["retry"] = {**data["retry"], **retry}
            update["serving"] = ServingConfig.model_validate(data)
        if getattr(args, "disable_health_check", False):
            update["health_check"] = None
        elif health:
            base = cfg.health_check.model_dump() if cfg.health_check is not None else {}
            update["health_check"] = HealthCheckConfig.model_validate({**base, **health})
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"
                        for err in e.errors())
        raise ValueError(f"bad flag value: {bad}") from None
    return cfg.model_copy(update=update) if update else cfg


def _doctor_checks(cfg: RouterConfig, tokenizer: Any, model: Optional[str],
                   timeout_s: float) -> list:
    """`kvroute.doctor.run` over a regular-mode config's workers (``tokenizer``: a directory
    or None)."""
    from pathlib import Path

    from kvroute import doctor

    kw = cfg.router_kwargs()
    tok = None
    if tokenizer is not None:
        from kvroute.prompt import PromptTokenizer

        if not Path(tokenizer).is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {tokenizer}")
        tok = PromptTokenizer.from_dir(Path(tokenizer))
    try:
        return doctor.run(cfg.workers(), block_size=kw.get("block_size", 16),
                          topic=kw.get("topic", ""), model=model, tokenizer=tok,
                          timeout_s=timeout_s)
    finally:
        if tok is not None:
            tok.close()


def _config_source(args: argparse.Namespace) -> Any:
    """``--config`` as given, or the configuration the vLLM router's command-line flags
    describe (``--worker-urls``, ``--policy``, ``--vllm-pd-disaggregation`` / ``--pd-
    disaggregation`` with ``--prefill`` and ``--decode``, ``--intra-node-data-parallel-size``);
    the policies get their defaults (cache_aware: the vLLM router CLI's)."""
    if args.config is not None:
        if args.worker_urls or args.prefill or args.decode or args.pd:
            raise ValueError("give --config or the worker flags (--worker-urls, --prefill, "
                             "--decode), not both")
        return args.config
    policy = {"type": args.policy or "cache_aware"}
    if args.pd or args.prefill or args.decode:
        if not (args.prefill and args.decode):
            raise ValueError("prefill/decode disaggregation needs --prefill URL... and "
                             "--decode URL...")
        prefill = [[u, int(p) if p is not None else None] for u, p in args.prefill]
        mode = {"type": "vllm_prefill_decode", "prefill_urls": prefill,
                "decode_urls": list(args.decode)}
    elif args.worker_urls:
        mode = {"type": "regular", "worker_urls": list(args.worker_urls)}
    else:
        raise ValueError("give --config FILE, or the workers: --worker-urls URL... (or "
                         "--vllm-pd-disaggregation --prefill URL [BOOTSTRAP_PORT] --decode URL...)")
    out = {"mode": mode, "policy": policy}
    if args.intra_node_data_parallel_size is not None:
        out["intra_node_data_parallel_size"] = args.intra_node_data_parallel_size
    return out
