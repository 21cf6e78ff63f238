#!/usr/bin/env bash
# Builds kvroute_core + cpp/tests/{core_test,approx_tree_test} with a sanitizer and runs them.
#
#   scripts/sanitize.sh asan   # -fsanitize=address,undefined
#   scripts/sanitize.sh tsan   # -fsanitize=thread
#
# Any sanitizer report fails the run (halt_on_error). Environment:
#   KVROUTE_SAN_BUILD   build directory (default build/san-<mode> in the checkout)
#   CXX                 compiler (default: cmake's choice, g++ on Debian)
#   KVROUTE_TEST_STRESS_S  seconds of the concurrent router stress (core_test default 1.5)
#   extra arguments after the mode are passed to core_test (test-name filters)
# Needs the Debian packages of scripts/setup.sh; does not touch the Python package.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

MODE=${1:-}
shift || true
case "$MODE" in
  asan) SAN="address,undefined" ;;
  tsan) SAN="thread" ;;
  *) echo "usage: $0 {asan|tsan} [test filters...]" >&2; exit 2 ;;
esac
BUILD=${KVROUTE_SAN_BUILD:-$ROOT/build/san-$MODE}
GEN=()
command -v ninja >/dev/null 2>&1 && ninja --version >/dev/null 2>&1 && GEN=(-G Ninja)
if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=${GEN[1]:-Unix Makefiles}$" "$BUILD/CMakeCache.txt"; then
  rm -rf "$BUILD"
fi

t0=$(date +%s)
# RelWithDebInfo: -O2 -g, for usable stacks. KVROUTE_SANITIZE is declared with option() (a
# BOOL) upstream; passing it typed as STRING keeps the value on every CMake version.
# -fno-sanitize-recover makes UBSan findings fatal even without UBSAN_OPTIONS.
EXTRA=""
[ "$MODE" = asan ] && EXTRA="-fno-sanitize-recover=undefined"
cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVROUTE_NATIVE_TESTS=ON \
  "-DKVROUTE_SANITIZE:STRING=$SAN" \
  "-DCMAKE_CXX_FLAGS=$EXTRA" \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" >"$BUILD.configure.log" 2>&1 \
  || { cat "$BUILD.configure.log"; exit 1; }
cmake --build "$BUILD" --target core_test approx_tree_test -j "$(nproc)"
t1=$(date +%s)

export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$ROOT/scripts/tsan.supp"
export KVROUTE_TEST_STRESS_S=${KVROUTE_TEST_STRESS_S:-1.5}

LOG="$BUILD/core_test.log"
set +e
"$BUILD/core_test" "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ $# -eq 0 ]; then
  "$BUILD/approx_tree_test" 2>&1 | tee -a "$LOG"
  rc2=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && rc=$rc2
fi
set -e
t2=$(date +%s)
# A report that did not halt (e.g. a recoverable check) still fails the run.
if grep -qE "ERROR: (Address|Leak|Thread|UndefinedBehavior)Sanitizer|WARNING: ThreadSanitizer|runtime error:" "$LOG"; then
  echo "sanitize.sh $MODE: sanitizer report in $LOG" >&2
  [ "$rc" -eq 0 ] && rc=1
fi
echo "sanitize.sh $MODE: build $((t1 - t0))s, run $((t2 - t1))s, exit $rc"
exit "$rc"
