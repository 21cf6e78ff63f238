// libFuzzer target: wire bytes -> DecodeBatch -> Index::Apply (2 workers, alternating) ->
// FindMatches on keys derived from the decoded token ids -> speculative credits -> clear and
// remove. Checks the index's bookkeeping invariants and traps (a crash for libFuzzer) when one
// breaks. Built by scripts/fuzz.sh (-DKVROUTE_FUZZ=ON, clang, ASan + UBSan).
//
// Each input is one payload, decoded with default limits (container count capped at
// the input size, see below); the Index is fresh per input, so
// every crash reproduces from its artifact alone:  ./fuzz_decode_apply crash-<sha1>
#include <cstddef>
#include <cstdint>

#include "events/decoder.h"
#include "fuzz/fuzz_check.h"

using namespace kvroute;
using namespace kvroute::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* p = reinterpret_cast<const char*>(data);
  EventBatch batch;
  DropCounts drops;
  // Container limit capped at the payload length (every element takes at least one byte, so
  // only the drop reason of an impossible header changes: oversized instead of truncated).
  // With the default limit, msgpack-c allocates count x 24 (48 for maps) bytes as soon as it
  // reads an array32/map32 header: harmless untouched memory in a release build, but ASan maps
  // and poisons it, and a 160-byte input of 32 nested headers takes ~35 s (90 s with maps).
  DecodeLimits limits;
  if (limits.max_container > size) limits.max_container = size;
  const bool ok = DecodeBatch(p, size, limits, &batch, &drops);
  {
    // The fast path must decode exactly what the msgpack-c reference decodes.
    EventBatch ref;
    DropCounts ref_drops;
    const bool ref_ok = DecodeBatchReference(p, size, limits, &ref, &ref_drops);
    FUZZ_ASSERT(ok == ref_ok);
    FUZZ_ASSERT(drops.n == ref_drops.n);
    FUZZ_ASSERT(SameBatch(batch, ref));
  }
  if (!ok) {
    FUZZ_ASSERT(batch.events.empty());
    FUZZ_ASSERT(Drops(drops) == 1);
    return 0;
  }
  FUZZ_ASSERT(Drops(drops) <= 0xFFFFFFFFull);

  ApplyAndCheck(batch, size);
  return 0;
}
