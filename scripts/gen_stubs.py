"""Regenerates python/kvroute/_core.pyi from the built module (pybind11-stubgen).

    python scripts/gen_stubs.py           # write the stub
    python scripts/gen_stubs.py --check   # exit 1 if the committed stub has drifted
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

STUB = Path(__file__).resolve().parents[1] / "python" / "kvroute" / "_core.pyi"


def generate() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pybind11_stubgen", "kvroute._core", "-o", tmp],
            check=True, capture_output=True,
        )
        return (Path(tmp) / "kvroute" / "_core.pyi").read_text()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = generate()
    if args.check:
        if not STUB.exists() or STUB.read_text() != text:
            print(f"{STUB} is out of date: run python scripts/gen_stubs.py", file=sys.stderr)
            return 1
        return 0
    STUB.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
