// The events engines publish, as kvroute holds them once decoded: Event, EventBatch, and the
// counts kept about them (DropCounts by DropReason, ApplyCounts). Shared by the decoder
// (events/), the per-worker stream (events/worker_stream.h) and the index (index/). The wire
// format they come from: docs/kv-events.md.
//
// Thread safety: value types; callers own them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "common/types.h"

namespace kvroute {

// Why a batch or an event was dropped. Labels in DropReasonName(); keep in sync.
enum class DropReason : uint8_t {
  kTruncated = 0,      // msgpack ended early
  kParseError,         // bytes that are not msgpack
  kOversized,          // payload, array, map, string or block count above the limits
  kWrongType,          // a field of the wrong msgpack type, or a batch/event of the wrong shape
  kUnknownTag,         // event tag that is not one of the three kinds (skipped, not an error)
  kBadTokenCount,      // len(token_ids) != len(block_hashes) * block_size (at apply time)
  kTokenOutOfRange,    // token id negative or >= 2^32
  kTrailingBytes,      // bytes left after the batch object
  kBlockSizeMismatch,  // BlockStored.block_size differs from the router's block size
  kBadFrames,          // ZeroMQ message with other than 2 or 3 frames, or seq frame != 8 bytes
  kRankMismatch,       // batch rank differs from the worker's configured data-parallel rank
  kUnsupportedSpec,    // a KV-cache group not indexed: spec kind not full attention (sliding
                       // window, Mamba, unknown), its BlockStored and BlockRemoved events
  kCount
};
constexpr int kNumDropReasons = static_cast<int>(DropReason::kCount);
const char* DropReasonName(DropReason r);

struct DropCounts {
  std::array<uint64_t, kNumDropReasons> n{};
  void Add(DropReason r, uint64_t k = 1) { n[static_cast<int>(r)] += k; }
  uint64_t Get(DropReason r) const { return n[static_cast<int>(r)]; }
  void Merge(const DropCounts& o) {
    for (int i = 0; i < kNumDropReasons; ++i) n[i] += o.n[i];
  }
};

enum class EventType : uint8_t { kBlockStored = 0, kBlockRemoved = 1, kAllBlocksCleared = 2 };

// An allocator whose value-initialisation (resize, emplace_back()) leaves the element
// uninitialised: the decoder sizes an event's token ids and then writes every one, and a
// zero fill first would cost ~4 KB of memset per 64-block event (~5 % of the instructions of
// a store from empty, callgrind).
template <typename T>
struct NoFillAllocator : std::allocator<T> {
  using std::allocator<T>::allocator;
  template <typename U>
  struct rebind {
    using other = NoFillAllocator<U>;
  };
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using TokenIds = std::vector<uint32_t, NoFillAllocator<uint32_t>>;

// One decoded event. Field names follow vLLM's `vllm/distributed/kv_events.py`.
struct Event {
  EventType type = EventType::kAllBlocksCleared;
  std::vector<EngineHash> block_hashes;
  bool has_parent = false;        // false: parent_block_hash nil, the run starts at token 0
  EngineHash parent_block_hash;
  TokenIds token_ids;
  int64_t block_size = 0;
  bool has_lora_id = false;
  int64_t lora_id = 0;
  bool has_medium = false;        // false: medium nil/absent (= GPU)
  std::string medium;             // raw wire string
  Medium tier = Medium::kGpu;
  bool medium_known = true;       // false: a medium string ParseMedium() did not recognise
  std::string lora_name;          // empty = none
  // One canonical msgpack encoding per block (empty string = no extra keys for that block).
  // Empty vector = extra_keys nil/absent. SGLang's cache_salt s (metadata map at array
  // position 7, or a plain map key) becomes msgpack [s] on the first block when the run
  // starts at token 0.
  std::vector<std::string> extra_keys;
  int64_t group_idx = 0;
  std::string kv_cache_spec_kind;  // empty = absent (full attention)
  bool has_sliding_window = false;
  int64_t sliding_window = 0;
  std::string locality;            // empty = absent
  std::string cache_salt;          // SGLang salt, packed as msgpack [salt]; empty = none
};

// A decoded batch. Decoding into the same EventBatch again reuses the block hash and token
// buffers of the events it held (Clear() keeps them, Add() hands them out), so an ingestion
// thread that decodes into one batch allocates nothing per event once its buffers have
// grown to the largest event seen.
struct EventBatch {
  double ts = 0.0;  // seconds since the epoch, as sent by the engine
  bool has_dp_rank = false;
  int64_t dp_rank = 0;
  std::vector<Event> events;
  void Clear() {
    ts = 0.0;
    has_dp_rank = false;
    dp_rank = 0;
    for (Event& e : events) spare_.push_back(std::move(e));
    events.clear();
  }
  // A new default event at the back of `events` (with a spare event's buffers, emptied).
  Event& Add() {
    if (spare_.empty()) return events.emplace_back();
    Event& e = events.emplace_back();
    Event& old = spare_.back();
    e.block_hashes = std::move(old.block_hashes);
    e.token_ids = std::move(old.token_ids);
    e.block_hashes.clear();
    e.token_ids.clear();
    spare_.pop_back();
    return e;
  }
  // Drops the last event (a bad one), keeping its buffers.
  void DropLast() {
    spare_.push_back(std::move(events.back()));
    events.pop_back();
  }

 private:
  std::vector<Event> spare_;  // events whose buffers Add() reuses
};

// Outcome counts of applying events for one worker. Added to by Apply().
struct ApplyCounts {
  uint64_t events = 0;
  uint64_t blocks_stored = 0;
  uint64_t blocks_removed = 0;
  uint64_t clears = 0;
  uint64_t orphan_stores = 0;    // blocks whose parent engine hash was unknown (not guessed)
  uint64_t unknown_removes = 0;  // BlockRemoved of an engine hash this worker never stored
  uint64_t hash_rebound = 0;     // an engine hash stored again with other content
  uint64_t blocks_rereported = 0;  // blocks of a run from token 0 stored again as held
                                   // (vLLM kv_cache_report_mode "full"): no new reference
  uint64_t unknown_medium = 0;   // medium strings not recognised (credited as disk)
  DropCounts drops;              // events dropped at apply time (block size, spec kind)
};

}  // namespace kvroute
