#!/usr/bin/env bash
# In-process A/B of stores from empty (ab_ingest.cc): A = the core at git revision BASE,
# B = the working tree, both built -O3 into one binary (B's `kvroute` renamed), run in
# alternation on compare_dynamo.py's store workloads.
#
#   benchmarks/ab_ingest/ab_ingest.sh BASE [rounds] [N ...]     (default: 7 rounds, N = 64 256)
#   AB_DECODE=1 benchmarks/ab_ingest/ab_ingest.sh BASE ...      (DecodeBatch alone)
#
# Needs scripts/setup.sh's packages and the Mooncake trace (compare_dynamo.py --dump-store).
# Work files in ${KVROUTE_AB_DIR:-/tmp/kvroute_ab}.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BASE=${1:?usage: $0 BASE [rounds] [N ...]}
ROUNDS=${2:-7}
shift $(( $# >= 2 ? 2 : 1 ))
NS=("$@")
[ ${#NS[@]} -eq 0 ] && NS=(64 256)
W=${KVROUTE_AB_DIR:-/tmp/kvroute_ab}
rm -rf "$W/a" "$W/b" "$W/obj"
mkdir -p "$W/a" "$W/b" "$W/obj"
git archive "$BASE" cpp | tar -x -C "$W/a"
cp -r cpp "$W/b/"
FL=(-O3 -DNDEBUG -std=c++17)
for v in a b; do
  ns=kvroute_ab_$v
  # The decoder and the index as each revision splits them into files.
  SRCS=(common/types.cc common/block_key.cc
        $(cd "$W/$v/cpp" && ls events/decoder*.cc index/index*.cc))
  for s in "${SRCS[@]}"; do
    extra=()
    case $s in events/decoder*.cc) extra=(-falign-loops=32) ;; esac  # as CMakeLists.txt builds it
    g++ "${FL[@]}" "${extra[@]}" -Dkvroute=$ns -I"$W/$v/cpp" -c "$W/$v/cpp/$s" \
      -o "$W/obj/${v}_$(basename "$s" .cc).o" &
  done
  g++ "${FL[@]}" -Dkvroute=$ns -DAB_NS=$ns -DAB_RUN=Run${v^^} -I"$W/$v/cpp" -I"$ROOT/benchmarks/ab_ingest" \
    -c "$ROOT/benchmarks/ab_ingest/run_variant.cc" -o "$W/obj/${v}_run.o" &
done
wait
g++ "${FL[@]}" -I"$ROOT/benchmarks/ab_ingest" benchmarks/ab_ingest/ab_ingest.cc "$W"/obj/*.o -lxxhash -o "$W/ab_ingest"
for n in "${NS[@]}"; do
  [ -f "$W/store_$n.bin" ] || python benchmarks/compare_dynamo.py --workers "$n" --dump-store "$W" >/dev/null
  "$W/ab_ingest" "$W/store_$n.bin" "$ROUNDS" ${AB_DECODE:+decode} | tail -1
done
