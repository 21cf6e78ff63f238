"""``--core PATH`` for the benchmarks: measure a saved build of ``kvroute._core``.

An A/B run loads the .so measured "before" an optimisation instead of the installed one. It
must be loaded before ``import kvroute``; the Python package around it is the installed one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Optional


def preload_core(argv: list[str]) -> Optional[str]:
    """Loads the module given by ``--core PATH`` (or ``--core=PATH``) in `argv` as
    ``kvroute._core``; returns its resolved path, or None without the flag.

    Raises SystemExit if PATH is not a loadable extension module."""
    path = None
    for i, a in enumerate(argv):
        if a == "--core" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--core="):
            path = a.split("=", 1)[1]
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location("kvroute._core", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--core {path}: not a loadable extension module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvroute._core"] = mod
    spec.loader.exec_module(mod)
    return str(Path(path).resolve())
