#!/usr/bin/env bash
# What state the machine is in, one line per round: the same three probes each time, so that a
# benchmark run beside it can be read against the machine's speed at that moment.
#
#   benchmarks/vm_probe.sh [rounds]          (default 10; ~2 s per round)
#
# Columns: dependent random load in 64 MiB (ns, memory_probe.cc: memory latency), independent
# loads with prefetch 16 ahead (ns), faulting in a 4 KiB page of a 256 KiB mapping
# (MADV_POPULATE_WRITE, µs, page_probe.cc), and decoding uniform token ids (ns per token,
# bench_decode.cc: compute only, everything in cache). On the 2-vCPU VM of benchmarks/README.md
# the decode column moved 2.5 <-> 3.9 ns per token within seconds while the memory latency
# stayed at 180-185 ns: the slow spells are the CPU itself running ~1.5x slower.
# The decode column runs the current decoder: compare it across builds with care (issue 7's
# thirteenth round, the AVX2 classifier, made uniform ids ~1.1x faster to decode).
# Needs scripts/setup.sh's build (build/cp311-*/libkvroute_core.a) for bench_decode.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-10}
OUT=${KVROUTE_PROBE_DIR:-/tmp/kvroute_probe}
mkdir -p "$OUT"
LIB=$(ls build/cp311-*/libkvroute_core.a build/*/libkvroute_core.a 2>/dev/null | head -1)
[ -n "$LIB" ] || { echo "no libkvroute_core.a under build/: run scripts/setup.sh" >&2; exit 1; }
g++ -O2 -std=c++17 benchmarks/memory_probe.cc -o "$OUT/memory_probe"
g++ -O2 -std=c++17 benchmarks/page_probe.cc -o "$OUT/page_probe"
g++ -O2 -std=c++17 -Icpp -DMSGPACK_NO_BOOST=1 benchmarks/bench_decode.cc "$LIB" -lxxhash -lzmq \
  -o "$OUT/bench_decode"
echo "time      dep-load ns  prefetched ns  fault µs/4KiB  decode ns/token"
for _ in $(seq "$ROUNDS"); do
  mp=$("$OUT/memory_probe" 64)
  dep=$(echo "$mp" | awk '/dependent/ {print $3}')
  ind=$(echo "$mp" | awk '/distance 16:/ {print $6}')
  flt=$("$OUT/page_probe" | awk '$1 == 256 && $2 == "KiB" {print $4}')
  dec=$("$OUT/bench_decode" | awk -F'|' '/uniform/ {gsub(/ /, "", $4); print $4}')
  printf "%s  %11s  %13s  %13s  %15s\n" "$(date +%H:%M:%S)" "$dep" "$ind" "$flt" "$dec"
done
