"""``kvroute serve``'s command line over its configuration: one table, flags to config keys.

`SERVE_FLAGS` is that table. `add_serve_flags` declares its rows on the ``serve`` (and
``doctor``) argument parser; `serve_options` applies the rows given to the loaded config
(`apply_flags`: each flag wins over its key and is validated as the key is; a bad value is a
ValueError naming the flag and the key) and reads everything from the result. Every default
shown is `kvroute.serving.defaults`', the defaults of `kvroute.config.ServingConfig`.

============================= ==================================== =================
Flag                          Config key                           Value
============================= ==================================== =================
--host                        host                                 str
--port                        port                                 int
--log-level                   log_level                            a level name
--tokenizer DIR               serving.tokenizer                    str
--model                       serving.model                        str
--upstream-timeout-s          serving.upstream_timeout_s           float
--connect-timeout-s           serving.connect_timeout_s            float
--first-byte-timeout-s        serving.first_byte_timeout_s         float
--max-retries                 serving.max_retries                  int
--disable-retries             serving.max_retries                  0 (wins)
--retry-initial-backoff-ms    serving.retry.initial_backoff_ms     float
--retry-max-backoff-ms        serving.retry.max_backoff_ms         float
--retry-backoff-multiplier    serving.retry.backoff_multiplier     float
--retry-jitter-factor         serving.retry.jitter_factor          float
--retry-on KIND...            serving.retry.retry_on               [str]
--breaker-failures            serving.circuit_breaker.failures     int
--breaker-reset-s             serving.circuit_breaker.reset_s      float
--recovery-ramp-s             serving.recovery_ramp_s              float
--scrape-interval-s           serving.scrape_metrics.interval_s    float; on
--scrape-stale-after-s        serving.scrape_metrics.stale_after_s float; only if on
--orca                        serving.orca                         text|json|off
--max-body-bytes              serving.max_body_bytes               int
--max-prompt-tokens           serving.max_prompt_tokens            int|auto|none
--chars-per-token             serving.chars_per_token              float
--tokenizer-threads           serving.tokenizer_threads            int
--long-prompt-chars           serving.long_prompt_chars            int
--long-prompt-threads         serving.long_prompt_threads          int
--tokenizer-max-queued        serving.tokenizer_max_queued         int
--prefix-cache-tokens         serving.prefix_cache_tokens          int
--request-id-headers H...     serving.request_id_headers           [str]
--no-access-log               serving.access_log                   false
--access-log-bodies           serving.access_log_bodies            true
--access-log-file PATH        serving.access_log_file              str
--gc-threshold                serving.gc_threshold                 G0,G1,G2|python
--no-gc-freeze                serving.gc_freeze                    false
--health-check-interval-s     health_check.check_interval_s        float; on
--health-check-timeout-s      health_check.timeout_s               float; on
--health-failure-threshold    health_check.failure_threshold       int; on
--health-success-threshold    health_check.success_threshold       int; on
--health-check-endpoint       health_check.endpoint                str; on
--disable-health-check        health_check                         null (wins)
--pd-uncached-token-threshold pd_uncached_token_threshold          int
============================= ==================================== =================

Aliases: ``--upstream-timeout`` = ``--upstream-timeout-s``, ``--connect-timeout`` =
``--connect-timeout-s``, ``--first-byte-timeout`` = ``--first-byte-timeout-s``,
``--retry-max-retries`` = ``--max-retries``, ``--breaker-reset`` = ``--breaker-reset-s``,
``--recovery-ramp`` = ``--recovery-ramp-s``, ``--scrape-interval`` =
``--scrape-interval-s``, ``--scrape-stale-after`` = ``--scrape-stale-after-s``,
``--max-payload-size`` = ``--max-body-bytes``, ``--health-check-interval-secs`` =
``--health-check-interval-s``, ``--health-check-timeout-secs`` =
``--health-check-timeout-s``.

Values: ``none`` (``--max-prompt-tokens``) and ``python`` (``--gc-threshold``) are the key's
null; "on": the flag turns its section on (``serving.scrape_metrics`` and ``health_check`` are
off unless configured), with the section's other keys at their defaults; "only if on": the flag
does nothing while the section is off. Rows apply in this order, so ``--disable-retries`` and
``--disable-health-check`` win. A row's ``option`` also reports the value in
`serve_options`' ``options``.

``kvroute serve`` flags that name no config key (declared in `kvroute.cli`): ``--config``,
the worker flags (``--worker-urls``, ``--policy``, ``--vllm-pd-disaggregation``,
``--prefill``, ``--decode``, ``--intra-node-data-parallel-size``: they describe the config
itself, `_config_source`), ``--adaptive-cache-weight`` (``adaptive_cache_weight: true``,
applied by `kvroute.serving.process`), ``--no-doctor`` and ``--workers``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvroute.serving import defaults as D

if TYPE_CHECKING:
    from kvroute.config import RouterConfig

__all__ = ["SERVE_FLAGS", "ServeFlag", "add_serve_flags", "apply_flags", "serve_options"]


def _prompt_tokens_flag(v: str) -> Any:
    """``--max-prompt-tokens``: an int, ``auto`` or ``none`` (no limit)."""
    if v in ("auto", "none"):
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, auto or none, got {v!r}") from None


def _gc_threshold_flag(v: str) -> Any:
    """``--gc-threshold``: three ints ``G0,G1,G2`` or ``python`` (CPython's defaults)."""
    if v == "python":
        return v
    try:
        t = [int(x) for x in v.split(",")]
    except ValueError:
        t = []
    if len(t) != 3:
        raise argparse.ArgumentTypeError(f"expected G0,G1,G2 (three ints) or python, got {v!r}")
    return t


def _none_for(word: str) -> Callable[[Any], Any]:
    """The flag's ``word`` means the key's null."""
    return lambda v: None if v == word else v


_UNSET = object()


@dataclass(frozen=True)
class ServeFlag:
    """One row of `SERVE_FLAGS`: a flag and the config key it sets.

    ``names``: the option strings (the first is the documented one); ``key``: the config key
    path (``serving.retry.jitter_factor``; ``health_check`` for the whole section);
    ``dest``: the argparse destination; ``type``, ``nargs``, ``metavar``, ``choices``: how
    argparse reads the value; ``const``: a flag without a value sets the key to this
    (``stores``: what argparse stores for it, if not ``const``; True for a null);
    ``to_key``: the parsed value as the key's value (``none`` -> null); ``default``: the
    key's default (`kvroute.serving.defaults`; shown as ``{default}`` in ``help``, checked
    against the config by tests/test_serve_options.py); ``opens``: for a key inside a section
    that is off, whether the flag turns the section on; ``option``: the
    `kvroute.fastapi.create_router` keyword the key becomes, reported in `serve_options`'
    ``options`` when the flag is given."""

    names: Tuple[str, ...]
    key: str
    dest: str
    help: str
    type: Optional[Callable[[str], Any]] = None
    nargs: Optional[str] = None
    metavar: Optional[str] = None
    choices: Optional[Sequence[str]] = None
    const: Any = _UNSET
    stores: Any = _UNSET
    to_key: Optional[Callable[[Any], Any]] = None
    default: Any = _UNSET
    opens: bool = True
    option: Optional[str] = None

    @property
    def flag(self) -> str:
        return self.names[0]

    def shown_default(self) -> str:
        d = self.default
        if isinstance(d, float):
            return f"{d:g}"
        if isinstance(d, (list, tuple)):
            return ",".join(str(x) for x in d) if all(isinstance(x, int) for x in d) \
                else " ".join(str(x) for x in d)
        return str(d)


def _row(*names: str, key: str, dest: Optional[str] = None, **kw: Any) -> ServeFlag:
    return ServeFlag(tuple(names), key, dest or names[0][2:].replace("-", "_"), **kw)


#: The table: every ``kvroute serve`` flag that sets a config key (see the module docstring).
SERVE_FLAGS: Tuple[ServeFlag, ...] = (
    _row("--host", key="host", default=D.HOST,
         help="default: the config's host, else {default}"),
    _row("--port", key="port", type=int, default=D.PORT,
         help="default: the config's port, else {default}"),
    _row("--log-level", key="log_level", default=D.LOG_LEVEL,
         choices=["critical", "error", "warning", "info", "debug", "trace"],
         help="default: the config's log_level, else {default}"),
    _row("--tokenizer", key="serving.tokenizer", metavar="DIR", default=None,
         help="directory with tokenizer.json + tokenizer_config.json (the engines' model); "
              "without it only token-id prompts get a prefix match"),
    _row("--model", key="serving.model", default=None, help="the engines' served model name"),
    _row("--upstream-timeout-s", "--upstream-timeout", key="serving.upstream_timeout_s",
         type=float, default=D.UPSTREAM_TIMEOUT_S, option="upstream_timeout_s",
         help="seconds of silence allowed from a worker (default {default})"),
    _row("--connect-timeout-s", "--connect-timeout", key="serving.connect_timeout_s",
         type=float, default=D.CONNECT_TIMEOUT_S, option="connect_timeout_s",
         help="seconds (default {default})"),
    _row("--first-byte-timeout-s", "--first-byte-timeout", key="serving.first_byte_timeout_s",
         type=float, default=D.FIRST_BYTE_TIMEOUT_S,
         help="seconds one attempt waits for the response headers "
              "(serving.first_byte_timeout_s; default: no bound)"),
    _row("--max-retries", "--retry-max-retries", key="serving.max_retries", type=int,
         default=D.MAX_RETRIES, option="max_retries",
         help="next-best workers tried after a failure before any byte reached the client "
              f"(serving.max_retries, default {{default}}, at most {D.MAX_RETRIES_LIMIT})"),
    _row("--disable-retries", key="serving.max_retries", const=0, stores=True,
         option="max_retries",
         help="--max-retries 0"),
    _row("--retry-initial-backoff-ms", key="serving.retry.initial_backoff_ms", type=float,
         default=D.RETRY_INITIAL_BACKOFF_MS,
         help="wait before the first retry (serving.retry.initial_backoff_ms, default "
              "{default})"),
    _row("--retry-max-backoff-ms", key="serving.retry.max_backoff_ms", type=float,
         default=D.RETRY_MAX_BACKOFF_MS,
         help="cap on any wait (serving.retry.max_backoff_ms, default {default})"),
    _row("--retry-backoff-multiplier", key="serving.retry.backoff_multiplier", type=float,
         default=D.RETRY_BACKOFF_MULTIPLIER,
         help="growth of the wait per retry (default {default})"),
    _row("--retry-jitter-factor", key="serving.retry.jitter_factor", type=float,
         default=D.RETRY_JITTER_FACTOR,
         help="relative jitter of the wait, in [0, 1] (default {default})"),
    _row("--retry-on", key="serving.retry.retry_on", nargs="+", metavar="KIND",
         default=D.RETRY_ON,
         help="failures retried, of: {default} (default all)"),
    _row("--breaker-failures", key="serving.circuit_breaker.failures", type=int,
         default=D.BREAKER_FAILURES, option="breaker_failures",
         help="consecutive failures that open a worker's circuit (default {default})"),
    _row("--breaker-reset-s", "--breaker-reset", key="serving.circuit_breaker.reset_s",
         type=float, default=D.BREAKER_RESET_S, option="breaker_reset_s",
         help="seconds before an open circuit lets a probe through (default {default})"),
    _row("--recovery-ramp-s", "--recovery-ramp", key="serving.recovery_ramp_s", type=float,
         default=D.RECOVERY_RAMP_S,
         help=f"seconds over which a recovered worker's share grows from "
              f"{round(100 * D.RECOVERY_MIN_SHARE)} %% to all (default {{default}}; 0: no ramp)"),
    _row("--scrape-interval-s", "--scrape-interval", key="serving.scrape_metrics.interval_s",
         dest="scrape_interval_s", type=float, default=D.SCRAPE_INTERVAL_S,
         option="scrape_metrics_interval_s",
         help="scrape each worker's /metrics every this many seconds (default: off; "
              "serving.scrape_metrics' default {default})"),
    _row("--scrape-stale-after-s", "--scrape-stale-after",
         key="serving.scrape_metrics.stale_after_s", dest="scrape_stale_after_s", type=float,
         default=D.SCRAPE_STALE_AFTER_S, opens=False, option="scrape_stale_after_s",
         help="seconds after which scraped load is forgotten (default {default}; only "
              "with scraping on)"),
    _row("--orca", key="serving.orca", choices=["text", "json", "off"], default=D.ORCA,
         option="orca",
         help="ask workers for vLLM's ORCA load header in this format (default {default})"),
    _row("--max-body-bytes", "--max-payload-size", key="serving.max_body_bytes", type=int,
         default=D.MAX_BODY_BYTES,
         help=f"larger request bodies get 413 (serving.max_body_bytes, default "
              f"{D.MAX_BODY_BYTES >> 20} MiB)"),
    _row("--max-prompt-tokens", key="serving.max_prompt_tokens", type=_prompt_tokens_flag,
         metavar="N|auto|none", to_key=_none_for("none"), default=D.MAX_PROMPT_TOKENS,
         help="longer prompts get 400; auto (default): the workers' max_model_len"),
    _row("--chars-per-token", key="serving.chars_per_token", type=float,
         default=D.CHARS_PER_TOKEN,
         help="prompts over max-prompt-tokens times this many characters get 400 before "
              "tokenizing (default {default})"),
    _row("--tokenizer-threads", key="serving.tokenizer_threads", type=int, default=None,
         help="tokenizer threads for ordinary prompts (default: the CPU count)"),
    _row("--long-prompt-chars", key="serving.long_prompt_chars", type=int,
         default=D.LONG_PROMPT_CHARS,
         help="prompts over this many characters go to the long lane (default {default})"),
    _row("--long-prompt-threads", key="serving.long_prompt_threads", type=int, default=None,
         help="threads of the long lane (default: half the CPU count)"),
    _row("--tokenizer-max-queued", key="serving.tokenizer_max_queued", type=int, default=None,
         help=f"prompts waiting per lane before 503 (default {D.MAX_QUEUED} ordinary, "
              f"{D.LONG_MAX_QUEUED} long)"),
    _row("--prefix-cache-tokens", key="serving.prefix_cache_tokens", type=int,
         default=D.PREFIX_CACHE_TOKENS,
         help="token ids kept for chat turns that extend an earlier one (0: off; default "
              "{default})"),
    _row("--request-id-headers", key="serving.request_id_headers", nargs="+",
         metavar="HEADER", default=D.REQUEST_ID_HEADERS,
         help="header fields a client's request id is read from (default {default})"),
    _row("--no-access-log", key="serving.access_log", dest="access_log", const=False,
         default=D.ACCESS_LOG, help="no JSON access lines on the kvroute.access logger"),
    _row("--access-log-bodies", key="serving.access_log_bodies", const=True,
         default=D.ACCESS_LOG_BODIES,
         help="also log completion request bodies (a replay trace's source; the lines then "
              "hold your users' prompts)"),
    _row("--access-log-file", key="serving.access_log_file", metavar="PATH",
         default=D.ACCESS_LOG_FILE,
         help="append the JSON access lines to this file (default: stderr)"),
    _row("--gc-threshold", key="serving.gc_threshold", type=_gc_threshold_flag,
         metavar="G0,G1,G2|python", to_key=_none_for("python"), default=D.GC_THRESHOLD,
         help="the serving process's gc.set_threshold (default {default}; python: CPython's "
              "700,10,10)"),
    _row("--no-gc-freeze", key="serving.gc_freeze", dest="gc_freeze", const=False,
         default=D.GC_FREEZE, help="no gc.freeze() of the heap built before serving"),
    _row("--health-check-interval-s", "--health-check-interval-secs",
         key="health_check.check_interval_s", dest="health_check_interval_s", type=float,
         default=D.HEALTH_CHECK_INTERVAL_S,
         help="probe every worker's health endpoint this often (health_check."
              "check_interval_s, default {default}); any --health-* flag turns the health "
              "checks on"),
    _row("--health-check-timeout-s", "--health-check-timeout-secs", key="health_check.timeout_s",
         dest="health_timeout_s", type=float, default=D.HEALTH_TIMEOUT_S,
         help="bound of one probe, seconds (default {default})"),
    _row("--health-failure-threshold", key="health_check.failure_threshold", type=int,
         default=D.HEALTH_FAILURE_THRESHOLD,
         help="consecutive failed probes that take a worker out (default {default})"),
    _row("--health-success-threshold", key="health_check.success_threshold", type=int,
         default=D.HEALTH_SUCCESS_THRESHOLD,
         help="consecutive good probes that bring it back (default {default})"),
    _row("--health-check-endpoint", key="health_check.endpoint", dest="health_endpoint",
         default=D.HEALTH_ENDPOINT, help="path probed (default {default})"),
    _row("--disable-health-check", key="health_check", const=None,
         help="no health checks, whatever the config says"),
    _row("--pd-uncached-token-threshold", key="pd_uncached_token_threshold", type=int,
         default=None,
         help="prefill/decode: skip the prefill pool when the decode worker would prefill at "
              "most this many tokens (default: never skip)"),
)

def add_serve_flags(parser: argparse.ArgumentParser,
                    only: Optional[Sequence[str]] = None,
                    help_text: Optional[Dict[str, str]] = None) -> None:
    """Declares the rows of `SERVE_FLAGS` (``only``: those flags) on ``parser``, each with
    default None (not given: the config's key decides); ``help_text`` replaces a row's
    help."""
    for row in SERVE_FLAGS:
        if only is not None and row.flag not in only:
            continue
        text = (help_text or {}).get(row.flag, row.help)
        if row.default is not _UNSET and "{default}" in text:
            text = text.replace("{default}", row.shown_default())
        kw: Dict[str, Any] = {"dest": row.dest, "default": None, "help": text}
        if row.const is not _UNSET:
            stores = row.stores if row.stores is not _UNSET else row.const
            kw.update(action="store_const", const=True if stores is None else stores)
        else:
            for name in ("type", "nargs", "metavar", "choices"):
                if getattr(row, name) is not None:
                    kw[name] = getattr(row, name)
        parser.add_argument(*row.names, **kw)


def _given(args: argparse.Namespace) -> List[Tuple[ServeFlag, Any]]:
    """The rows given on the command line, with their values as the keys take them."""
    out = []
    for row in SERVE_FLAGS:
        v = getattr(args, row.dest, None)
        if v is None:
            continue
        if row.const is not _UNSET:
            v = row.const
        elif row.to_key is not None:
            v = row.to_key(v)
        out.append((row, v))
    return out


def _set(node: Dict[str, Any], model: Any, path: List[str], value: Any, opens: bool) -> bool:
    """Sets ``path`` in ``node`` (a section's keys as given) to ``value``; a subsection that
    is off in ``model`` (the loaded section) is turned on only if ``opens``. False: not set."""
    for p in path[:-1]:
        model = getattr(model, p, None) if model is not None else None
        if node.get(p) is None:
            if model is None and not opens:
                return False
            node[p] = {}
        node = node[p]
    node[path[-1]] = value
    return True


def apply_flags(cfg: RouterConfig, args: argparse.Namespace
                ) -> Tuple[RouterConfig, List[ServeFlag]]:
    """``cfg`` with the `SERVE_FLAGS` rows given in ``args`` applied (each given flag wins over
    its key; validated as the key is), and the rows that were applied. Raises ValueError
    naming the flag and its key."""
    from pydantic import TypeAdapter, ValidationError

    from kvroute.config import HealthCheckConfig, ServingConfig

    sections: Dict[str, Any] = {"serving": ServingConfig, "health_check": HealthCheckConfig}
    data: Dict[str, Any] = {}  # top-level key -> its new value (a section: its keys given)
    applied: List[ServeFlag] = []
    for row, value in _given(args):
        top, _, rest = row.key.partition(".")
        if top in sections and rest:
            cur = getattr(cfg, top)
            if top not in data:
                # Only the keys set, so the section still knows which keys were given.
                data[top] = cur.model_dump(exclude_unset=True) if cur is not None else None
            if data[top] is None:
                if not row.opens:
                    continue
                data[top] = {}
            if not _set(data[top], cur, rest.split("."), value, row.opens):
                continue
        else:  # a top-level key, or a whole section (on or off)
            data[top] = value
        applied.append(row)
    update: Dict[str, Any] = {}
    for top, value in data.items():
        try:
            if top in sections:
                update[top] = None if value is None else sections[top].model_validate(value)
            else:
                field = type(cfg).model_fields[top]
                ann: Any = field.annotation
                if field.metadata:  # the key's constraints (ge, le, min_length)
                    shape = (field.annotation, *field.metadata)
                    ann = Annotated[shape]
                update[top] = TypeAdapter(ann).validate_python(value)
        except ValidationError as e:
            bad = []
            for err in e.errors():
                key = ".".join([top] + [str(x) for x in err["loc"]]) if top in sections \
                    else top
                rows = [r for r in applied if key == r.key or key.startswith(r.key + ".")]
                flag = f"{rows[-1].flag} " if rows else ""
                bad.append(f"{flag}({key}): {err['msg']}")
            raise ValueError(f"bad flag value: {'; '.join(bad)}") from None
    return (cfg.model_copy(update=update) if update else cfg), applied


def serve_options(cfg: RouterConfig, args: argparse.Namespace) -> dict:
    """What ``kvroute serve`` runs with: the command line over the config (its ``serving:``
    section and the vLLM router's server keys) over the defaults (`kvroute.serving.defaults`).
    Keys: ``host``, ``port``, ``log_level``, ``metrics`` (``(host, port)`` or None),
    ``tokenizer``, ``model``, ``config`` (``cfg`` with the flags applied: `apply_flags`) and
    ``options`` (`kvroute.fastapi.create_router` keywords: the ``option`` of each flag given,
    and ``health_check`` when the checks are on)."""
    cfg, applied = apply_flags(cfg, args)
    options: Dict[str, Any] = {}
    if any(row.option for row in applied):
        kw = cfg.serving.create_router_kwargs()
        options = {row.option: kw[row.option] for row in applied if row.option}
    if cfg.health_check is not None:
        options["health_check"] = cfg.health_check.model_dump()
    tokenizer = cfg.serving.tokenizer
    if tokenizer is None and cfg.model_path is not None:
        tokenizer = _tokenizer_dir(cfg.model_path)
        if tokenizer is None:
            print(f"kvroute serve: model_path {cfg.model_path!r}: no tokenizer.json there nor "
                  "in the local Hugging Face cache; text prompts route without a prefix "
                  "match (pass --tokenizer DIR)", file=sys.stderr)
    metrics = (cfg.metrics.host, cfg.metrics.port) if cfg.metrics is not None else None
    return {
        "host": cfg.host or D.HOST,
        "port": cfg.port if cfg.port is not None else D.PORT,
        "log_level": cfg.log_level or D.LOG_LEVEL,
        "metrics": metrics,
        "tokenizer": tokenizer,
        "model": cfg.serving.model or cfg.model_path,
        "options": options,
        "config": cfg,
    }


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
