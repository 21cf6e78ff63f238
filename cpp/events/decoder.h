// Engine KV-event decoder: one msgpack payload (the last ZeroMQ frame) -> one EventBatch.
//
// A pure function over bytes, with no ZeroMQ and no index in it. It reads every variant in
// docs/kv-events.md §3-§4 (see events/README.md for the layout table):
//   batch  : [ts, events] | [ts, events, data_parallel_rank] | {"ts","events","data_parallel_rank"}
//   event  : tagged array ["BlockStored", f1, f2, ...] of any arity (trailing defaults omitted)
//            | tagged map {"type": "BlockStored", field: value, ...} in any key order
//   kinds  : BlockStored, BlockRemoved, AllBlocksCleared; unknown tags counted and skipped
//   SGLang : array BlockStored whose position 7 is a metadata map ({"cache_salt": ...})
//
// Errors never escape: a payload that is not msgpack, is truncated or has the wrong outer
// shape drops the whole batch; a malformed event drops that event only. Each drop is counted
// by reason in DropCounts. No exception is thrown on the drop path: a dropped event costs
// what reading its bytes costs.
//
// Thread safety: DecodeBatch is reentrant; callers own `out` and `drops`.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "common/event.h"
#include "common/types.h"

namespace kvroute {

struct DecodeLimits {
  size_t max_payload_bytes = 64u << 20;   // 64 MiB
  size_t max_blocks_per_event = 1u << 16;  // 65,536 blocks (1M tokens at block size 16)
  size_t max_container = 1u << 24;         // elements in any array/map
  size_t max_string = 1u << 20;            // bytes in any str/bin
  size_t max_depth = 32;
  // The reference decoder builds one msgpack-c object (24 bytes) per msgpack element; it
  // builds at most max(payload bytes / 2, min_tree_elements) of them, i.e. at most
  // max(12 x payload, 24 MiB) of tree. A payload with more elements than that is dropped
  // (oversized) unless the fast path decodes it (the fast path builds no tree).
  size_t min_tree_elements = 1u << 20;
};

// Decodes `payload` into `out` (cleared first). Returns true if the batch itself was readable
// (some events may still have been dropped and counted); false if the whole batch was
// dropped, with its reason counted in `drops`. Never throws.
bool DecodeBatch(const char* payload, size_t len, const DecodeLimits& limits, EventBatch* out,
                 DropCounts* drops) noexcept;

// The same decoder written over msgpack-c objects: the definition DecodeBatch's fast path
// must agree with (DecodeBatch falls back to it for anything unusual; the fuzz target
// compares the two on every input). They agree on every payload within the tree budget
// (DecodeLimits::min_tree_elements); past it the reference drops the batch (oversized)
// before building a tree, while the fast path still decodes a batch it can read.
bool DecodeBatchReference(const char* payload, size_t len, const DecodeLimits& limits,
                          EventBatch* out, DropCounts* drops) noexcept;

// For tests: whether the token walk's two byte classifiers (AVX2, 32 bytes a step; SSSE3, 16)
// build the same tables for the 256 bytes at q. True where the CPU has no AVX2 (one of them
// runs). The walk runs on x86-64 only; elsewhere this returns true.
bool TokenClassifiersAgreeForTest(const uint8_t* q);

}  // namespace kvroute
