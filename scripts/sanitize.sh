#!/usr/bin/env bash
# Builds kvroute_core and the native tests (cpp/tests) with a sanitizer and runs them with
# ctest: the CMake presets of CMakePresets.json, which also set the sanitizer options.
#
#   scripts/sanitize.sh asan   # -fsanitize=address,undefined (build/asan)
#   scripts/sanitize.sh tsan   # -fsanitize=thread (build/tsan)
#
# Any sanitizer report fails the run: halt_on_error, and each test fails on a report in its
# output even if it exited 0. Environment:
#   KVROUTE_TEST_STRESS_S  seconds of the concurrent router stress (default 1.5)
#   KVROUTE_JOBS           parallel compile jobs (default: the number of CPUs)
#   CXX                    compiler, read on the first configure (default: cmake's, g++ on Debian)
#   extra arguments after the mode are passed to ctest (e.g. -R Decoder)
# Needs the Debian packages of scripts/setup.sh and pybind11 (pip); does not touch the Python
# package.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-}
shift || true
case "$MODE" in
  asan|tsan) ;;
  *) echo "usage: $0 {asan|tsan} [ctest arguments...]" >&2; exit 2 ;;
esac

t0=$(date +%s)
mkdir -p build
LOG=build/$MODE.configure.log
cmake --preset "$MODE" -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" >"$LOG" 2>&1 \
  || { cat "$LOG"; exit 1; }
cmake --build --preset "$MODE" -j "${KVROUTE_JOBS:-$(nproc)}"
t1=$(date +%s)
set +e
ctest --preset "$MODE" "$@"
rc=$?
set -e
t2=$(date +%s)
echo "sanitize.sh $MODE: build $((t1 - t0))s, run $((t2 - t1))s, exit $rc"
exit "$rc"
