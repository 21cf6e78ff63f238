"""The committed type stub of the native module matches the built module."""

import subprocess
import sys
from pathlib import Path

from _util import require

ROOT = Path(__file__).resolve().parents[1]


def test_core_stub_has_not_drifted():
    require("pybind11_stubgen")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_stubs.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
