#!/usr/bin/env bash
# Every test: the Python suite (pytest), then the native checks — the core's C++ test drivers
# under ASan+UBSan and under TSan, and a short libFuzzer run of decode+apply. Needs what
# scripts/setup.sh installs. Long fuzz runs: bash scripts/fuzz.sh SECONDS.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q tests/
bash scripts/sanitize.sh asan
bash scripts/sanitize.sh tsan
bash scripts/fuzz.sh "${KVROUTE_FUZZ_SMOKE_S:-30}"
