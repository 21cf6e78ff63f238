"""From a configuration to a front: the mode switch, and what a mode refuses at start-up.

`build_front` is the only place that knows both modes. Everything a config asks for is either
honoured by the mode's front or refused here with one line naming the key
(`kvroute.config.ConfigError`); nothing is ignored. Worker URLs are validated here as
``POST /admin/workers`` validates them (`validate_worker_url`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple
from urllib.parse import urlsplit

from kvroute.serving import defaults as D
from kvroute.serving.auth import Auth

__all__ = ["Built", "build_front", "validate_worker_url", "PD_REFUSED"]

#: Config keys and options the prefill/decode front cannot honour, with the reason.
PD_REFUSED: Dict[str, str] = {
    "response_cache": "the response cache is not implemented for prefill/decode mode",
    "replicas": "replicas through Redis or NATS and bootstrap are not implemented for "
                "prefill/decode mode (kvroute serve --workers N shares its processes' load)",
    "scrape_metrics_interval_s": "load scraping is not implemented for prefill/decode mode",
    "adaptive_cache_weight": "the adaptive cache_weight tunes one pool",
}


def validate_worker_url(url: Any) -> str:
    """``url`` if it is a worker URL requests can be sent to: ``http://host[:port]`` or
    ``https://...`` with a host and a port in 1-65535, or ``unix:///absolute/path.sock``.
    Raises ValueError naming the URL otherwise (no scheme, another scheme, no host, a port
    out of range)."""
    if not isinstance(url, str):
        raise ValueError(f"a worker URL must be a string, got {url!r}")
    if url.startswith("unix://"):
        if not url[len("unix://"):].startswith("/") or len(url) <= len("unix:///"):
            raise ValueError(f"worker URL {url!r}: a unix socket URL is "
                             "unix:///absolute/path.sock")
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"worker URL {url!r}: the scheme must be http://, https:// or "
                         "unix://")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"worker URL {url!r}: the port must be in 1-65535") from None
    if not parts.hostname:
        raise ValueError(f"worker URL {url!r}: no host")
    if port is not None and port == 0:
        raise ValueError(f"worker URL {url!r}: the port must be in 1-65535")
    return url


def validate_worker_urls(urls: Iterable[str]) -> None:
    """`validate_worker_url` of each; the ConfigError names the first bad one."""
    from kvroute.config import ConfigError

    for u in urls:
        try:
            validate_worker_url(u)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class Built:
    """A built front: ``front`` (`kvroute.serving.pipeline.Front`), ``auth`` (always one, so
    a reload can introduce tenants), ``title``, ``close`` (run at shutdown), ``access``
    (`kvroute.serving.routes.install` keywords), ``state`` (app.state attributes)."""

    front: Any
    auth: Auth
    title: str
    close: Callable[[], Any]
    access: Dict[str, Any]
    state: Dict[str, Any] = field(default_factory=dict)


def _tokenizer(cfg: Any, tokenizer: Any) -> tuple:
    """(the tokenizer, whether this app owns it) from an argument or ``serving.tokenizer``."""
    if tokenizer is None:
        tokenizer = cfg.serving.tokenizer
    if not isinstance(tokenizer, (str, Path)):
        return tokenizer, False
    from kvroute.prompt import PromptTokenizer

    tok_dir = Path(tokenizer)
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {tok_dir}")
    return PromptTokenizer.from_dir(tok_dir, **cfg.serving.tokenizer_kwargs()), True


def _refuse_for_pd(cfg: Any, options: Mapping[str, Any]) -> None:
    from kvroute.config import ConfigError

    asked = {k for k in PD_REFUSED if options.get(k) not in (None, False)}
    given = options.get("replicas")
    if isinstance(given, Mapping) and given.get("local_dir") and not any(
            given.get(k) for k in ("redis_url", "nats_url", "bootstrap_from")):
        asked.discard("replicas")  # kvroute serve --workers N: the processes' directory
    if cfg.response_cache is not None:
        asked.add("response_cache")
    if cfg.replicas is not None:
        asked.add("replicas")
    if cfg.serving.scrape_metrics is not None:
        asked.add("scrape_metrics_interval_s")
    if cfg.adaptive_kwargs() is not None:
        asked.add("adaptive_cache_weight")
    if "orca" in cfg.serving.model_fields_set and cfg.serving.orca != "off":
        asked.add("orca")
    if asked:
        key = sorted(asked)[0]
        reason = PD_REFUSED.get(key, "ORCA load reports are not read in prefill/decode mode")
        raise ConfigError(f"{key}: {reason}; remove it from the config (or its flag)")


def build_front(cfg: Any, *, tokenizer: Any = None, model: Optional[str] = None,
                options: Optional[Mapping[str, Any]] = None) -> Built:
    """The front of ``cfg``'s mode (a loaded `kvroute.config.RouterConfig`) with its
    ``serving:`` section as the defaults of ``options`` (explicit ones win). Raises
    ConfigError for a bad worker URL or a feature the mode cannot honour, FileNotFoundError
    for a missing tokenizer directory, ValueError for bad options."""
    opts: Dict[str, Any] = {**cfg.serving.create_router_kwargs(), **(options or {})}
    # create_router_kwargs always gives these three; the defaults are for an options-only call.
    access = {"request_id_headers": (opts.pop("request_id_headers", None)
                                     or list(D.REQUEST_ID_HEADERS)),
              "access_log": opts.pop("access_log", D.ACCESS_LOG),
              "access_log_bodies": opts.pop("access_log_bodies", D.ACCESS_LOG_BODIES)}
    if model is None:
        model = cfg.serving.model
    if "health_check" not in opts and cfg.health_check is not None:
        opts["health_check"] = cfg.health_check.model_dump()
    auth = opts.pop("auth", None) or Auth.from_config(cfg) or Auth()
    if cfg.is_pd:
        _refuse_for_pd(cfg, options or {})
        urls = [w.url for pool in (cfg.mode.prefill, cfg.mode.decode) for w in pool]
        validate_worker_urls(urls)
        uds = [u for u in urls if u.startswith("unix://")]
        if uds:
            from kvroute.config import ConfigError

            raise ConfigError(f"prefill/decode mode does not take unix:// workers "
                              f"({', '.join(uds)}): the decode engine reaches the prefill "
                              "engine's KV cache over the network (SGLang's bootstrap_host is "
                              "the prefill URL's host); give http:// URLs")
        for k in ("orca", "scrape_metrics_interval_s", "scrape_timeout_s",
                  "scrape_stale_after_s", "response_cache"):
            opts.pop(k, None)  # refused above when asked for; the rest are defaults
        return _build_pd(cfg, tokenizer, model, opts, auth, access)
    validate_worker_urls(w.url for w in cfg.workers())
    if "replicas" not in opts and cfg.replicas is not None:
        opts["replicas"] = cfg.replicas.model_dump()
    if "response_cache" not in opts and cfg.response_cache is not None:
        opts["response_cache"] = cfg.response_cache.model_dump()
    return _build_proxy(cfg, tokenizer, model, opts, auth, access)


def _assemble(cfg: Any, tokenizer: Any, make_router: Callable[[], Any],
              make_front: Callable[[Any, Any], Tuple[Any, Dict[str, Any]]]
              ) -> Tuple[Any, Callable[[], Any], Dict[str, Any]]:
    """(front, close, app.state attributes): the tokenizer (loaded here when given as a
    directory, then owned), the router and the front, each closed again when a later one
    fails; ``close`` closes the router and an owned tokenizer at shutdown."""
    tokenizer, own_tokenizer = _tokenizer(cfg, tokenizer)
    router = None
    try:
        router = make_router()
        front, state = make_front(router, tokenizer)
    except BaseException:
        if router is not None:
            router.close()
        if own_tokenizer:
            tokenizer.close()
        raise

    async def close() -> None:
        router.close()
        if own_tokenizer:
            # close() waits for running tokenizations: not on the event loop.
            await asyncio.to_thread(tokenizer.close)

    return front, close, state


def _build_proxy(cfg: Any, tokenizer: Any, model: Optional[str], opts: Dict[str, Any],
                 auth: Auth, access: Dict[str, Any]) -> Built:
    from kvroute._router import Router
    from kvroute.serving.proxy import Proxy

    def make_front(router: Any, tok: Any) -> Tuple[Any, Dict[str, Any]]:
        proxy = Proxy(router, tokenizer=tok, model=model, **opts)
        adaptive = None
        adaptive_kw = cfg.adaptive_kwargs()
        if adaptive_kw is not None:
            from kvroute.adaptive import AdaptiveCacheWeight

            adaptive = AdaptiveCacheWeight(router, **adaptive_kw)  # logs each change
        return proxy, {"kvroute_router": router, "kvroute_proxy": proxy,
                       "kvroute_adaptive": adaptive}

    front, close, state = _assemble(
        cfg, tokenizer, lambda: Router(cfg.workers(), **cfg.router_kwargs()), make_front)
    return Built(front, auth, "kvroute", close, access, state)


def _build_pd(cfg: Any, tokenizer: Any, model: Optional[str], opts: Dict[str, Any],
              auth: Auth, access: Dict[str, Any]) -> Built:
    from kvroute.pd import PDRouter
    from kvroute.serving.pd import PDFront

    threshold = opts.pop("pd_uncached_token_threshold", None)

    def make_front(router: Any, tok: Any) -> Tuple[Any, Dict[str, Any]]:
        front = PDFront(router, {w.url: w.bootstrap_port for w in cfg.mode.prefill},
                        tokenizer=tok, model=model, **opts)
        return front, {"kvroute_pd_router": router, "kvroute_pd_front": front}

    front, close, state = _assemble(
        cfg, tokenizer,
        lambda: PDRouter.from_config(cfg, pd_uncached_token_threshold=threshold), make_front)
    return Built(front, auth, "kvroute (prefill/decode)", close, access, state)
