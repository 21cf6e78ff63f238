#!/usr/bin/env bash
# Static checks of the Python package: ruff (lint rules and import order) and mypy (types), both
# configured in pyproject.toml. Needs the test extra (ruff, mypy, the yaml/tqdm stubs). Exits
# non-zero on any finding; runs both checks either way.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
status=0
echo "== ruff check python/kvroute"
"$PY" -m ruff check python/kvroute || status=1
echo "== mypy (files = python/kvroute)"
"$PY" -m mypy || status=1
exit "$status"
