#!/usr/bin/env bash
# Installs everything kvroute needs on a fresh Debian machine (root), then builds and installs
# the package in editable mode with its test extras. Idempotent: re-running only rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBS=(libzmq3-dev cppzmq-dev libmsgpack-cxx-dev robin-map-dev libxxhash-dev g++ cmake
      libgtest-dev              # GoogleTest: the native tests (cpp/tests, scripts/sanitize.sh)
      clang libclang-rt-14-dev  # clang + its runtimes: libFuzzer (scripts/fuzz.sh)
      wrk                       # HTTP load generator (benchmarks/bench_proxy.py)
      redis-server              # shared response cache and replicas' load (tests/test_operator.py, tests/test_replicas*.py)
      nats-server               # replicas' load through NATS (tests/test_replicas.py)
      libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc)  # kvroute._epp: the endpoint picker's native gRPC server
missing=()
for p in "${DEBS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

export PIP_ROOT_USER_ACTION=ignore
PY=${PYTHON:-python3}
# xds-protos before the build: CMake reads Envoy's ext_proc descriptors from it (cpp/epp).
$PY -m pip install -q --disable-pip-version-check "scikit-build-core>=0.10" "pybind11>=2.12" ninja \
    "xds-protos>=1.60"
$PY -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[test]"
