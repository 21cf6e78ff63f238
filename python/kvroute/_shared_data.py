"""Where the real data (tokenizers, traces, engine captures) is read from: a directory the
caller passes, else ``$KVROUTE_SHARED_DATA``. There is no default location: with neither,
`shared_data_dir` raises and says what to pass."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

SHARED_DATA_ENV = "KVROUTE_SHARED_DATA"
"""Environment variable naming the shared data directory."""

PathLike = Union[str, "os.PathLike[str]"]


def shared_data_dir(data_dir: Optional[PathLike] = None, *, arg: str = "data_dir") -> Path:
    """``data_dir`` if given, else ``$KVROUTE_SHARED_DATA`` (not checked for existence).

    ``arg`` names the caller's parameter in the error message.

    Raises
    ------
    FileNotFoundError
        Neither ``data_dir`` nor a non-empty ``KVROUTE_SHARED_DATA`` is given.
    """
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get(SHARED_DATA_ENV)
    if env:
        return Path(env)
    raise FileNotFoundError(
        f"no shared data directory: pass {arg} or set {SHARED_DATA_ENV} (the directory that "
        "holds tokenizers/, kvevents/ and the traces)")
