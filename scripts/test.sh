#!/usr/bin/env bash
# Every test (what CI runs): the static checks (ruff, mypy), the Python suite (pytest, slow
# tests included, real vLLM engines among them: scripts/setup_vllm.sh installs vLLM's CPU
# build into an environment of its own first), then the native checks: the C++ tests (ctest) under ASan+UBSan and under
# TSan, and a short libFuzzer run of decode+apply. Needs what scripts/setup.sh installs.
#   fast inner loop while developing:  python3 -m pytest -q -m "not slow"
#   long fuzz runs:                    bash scripts/fuzz.sh SECONDS
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/lint.sh
bash scripts/setup_vllm.sh
KVROUTE_REQUIRE_VLLM=1 python3 -m pytest -q tests/
bash scripts/sanitize.sh asan
bash scripts/sanitize.sh tsan
bash scripts/fuzz.sh "${KVROUTE_FUZZ_SMOKE_S:-30}"
