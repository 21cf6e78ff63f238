#!/usr/bin/env bash
# Static checks of the Python code: ruff (lint rules and import order) over the package, the
# tests and the benchmarks, and mypy (types) over the package, both configured in
# pyproject.toml. Needs the test extra (ruff, mypy, the yaml/tqdm stubs). Exits
# non-zero on any finding; runs both checks either way.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
status=0
echo "== ruff check python/kvroute tests benchmarks"
"$PY" -m ruff check python/kvroute tests benchmarks || status=1
echo "== mypy (files = python/kvroute)"
"$PY" -m mypy || status=1
exit "$status"
