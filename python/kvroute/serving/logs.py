"""The logging of a ``kvroute serve`` process: kvroute's own loggers and the access log.

`configure` is called once per process before the app is built:

- logger ``kvroute`` (every ``kvroute.*`` module): ``level`` (``--log-level`` / the config's
  ``log_level``), to stderr as ``LEVEL:     name: message`` (uvicorn's layout);
- logger ``kvroute.access``: one JSON object per line (`kvroute.serving.routes`), bare, to
  ``access_log_file`` (appended; ``serving.access_log_file``) or else to stderr, at INFO
  whatever ``level`` is, unless ``serving.access_log`` is false. `kvroute
  access-log-to-trace` reads these lines.

An embedding application (`kvroute.fastapi.create_app` under its own server) configures
logging itself; nothing here runs on import.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

__all__ = ["configure", "KVROUTE_FORMAT"]

KVROUTE_FORMAT = "%(levelname)s:     %(name)s: %(message)s"
_MARK = "_kvroute_serve_handler"


def configure(level: str = "info", access_log: bool = True,
              access_log_file: Optional[str] = None) -> None:
    """Sets up the ``kvroute`` and ``kvroute.access`` loggers as the module docstring says.
    Idempotent: handlers it added before are replaced. Raises ValueError for an unknown
    level name, OSError when the access log file cannot be opened."""
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger("kvroute")
    access = logging.getLogger("kvroute.access")
    for lg in (root, access):
        for h in [h for h in lg.handlers if getattr(h, _MARK, False)]:
            lg.removeHandler(h)
            h.close()
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(KVROUTE_FORMAT))
    # The access lines have a handler of their own.
    handler.addFilter(lambda r: not r.name.startswith("kvroute.access"))
    setattr(handler, _MARK, True)
    root.addHandler(handler)
    root.setLevel(lvl)
    if not access_log:
        access.setLevel(logging.WARNING)
        return
    out: logging.Handler = (logging.FileHandler(access_log_file, encoding="utf-8")
                            if access_log_file else logging.StreamHandler(sys.stderr))
    out.setFormatter(logging.Formatter("%(message)s"))
    setattr(out, _MARK, True)
    access.addHandler(out)
    access.setLevel(logging.INFO)
