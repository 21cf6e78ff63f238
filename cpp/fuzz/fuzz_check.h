// Shared by the libFuzzer targets (fuzz_decode_apply.cc, fuzz_structured.cc): FUZZ_ASSERT,
// batch equality (fast path against the reference decoder), and ApplyAndCheck, which applies
// a decoded batch to a fresh Index (2 workers, alternating) and checks the index's
// bookkeeping invariants: match counts within bounds, speculative credits, and nothing left
// in the block table after a clear and a remove. A broken invariant traps (a crash for
// libFuzzer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/block_key.h"
#include "common/event.h"
#include "index/index.h"

namespace kvroute::fuzz {


// IndexOptions caps (max_blocks_per_worker / max_blocks_total) are set when the header has
// them, so the target builds against index.h with or without the cap feature.
template <typename T, typename = void>
struct HasCaps : std::false_type {};
template <typename T>
struct HasCaps<T, std::void_t<decltype(std::declval<T&>().max_blocks_per_worker),
                              decltype(std::declval<T&>().max_blocks_total)>> : std::true_type {};

template <typename T>
inline void SetCaps(T* o, uint64_t per_worker, uint64_t total) {
  if constexpr (HasCaps<T>::value) {
    o->max_blocks_per_worker = per_worker;
    o->max_blocks_total = total;
  } else {
    (void)o;
    (void)per_worker;
    (void)total;
  }
}

#define FUZZ_ASSERT(cond)                                                        \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::fprintf(stderr, "invariant failed at %s:%d: %s\n", __FILE__, __LINE__, \
                   #cond);                                                       \
      __builtin_trap();                                                          \
    }                                                                            \
  } while (0)

inline uint64_t Drops(const DropCounts& d) {
  uint64_t t = 0;
  for (uint64_t x : d.n) t += x;
  return t;
}

inline void CheckMatch(const MatchResult& m, size_t n_keys, WorkerId limit) {
  FUZZ_ASSERT(m.blocks.size() == limit && m.weighted.size() == limit);
  uint32_t mx = 0;
  for (size_t w = 0; w < m.blocks.size(); ++w) {
    FUZZ_ASSERT(m.blocks[w] <= n_keys);
    FUZZ_ASSERT(m.weighted[w] >= 0.0 && m.weighted[w] <= static_cast<double>(m.blocks[w]) + 1e-9);
    if (m.blocks[w] > mx) mx = m.blocks[w];
  }
  FUZZ_ASSERT(m.max_blocks == mx);
}

inline bool SameHash(const EngineHash& a, const EngineHash& b) { return a == b; }

inline bool SameEvent(const Event& a, const Event& b) {
  if (a.type != b.type || a.block_hashes.size() != b.block_hashes.size()) return false;
  for (size_t i = 0; i < a.block_hashes.size(); ++i) {
    if (!SameHash(a.block_hashes[i], b.block_hashes[i])) return false;
  }
  return a.has_parent == b.has_parent &&
         (!a.has_parent || SameHash(a.parent_block_hash, b.parent_block_hash)) &&
         a.token_ids == b.token_ids && a.block_size == b.block_size &&
         a.has_lora_id == b.has_lora_id && (!a.has_lora_id || a.lora_id == b.lora_id) &&
         a.has_medium == b.has_medium && a.medium == b.medium && a.tier == b.tier &&
         a.medium_known == b.medium_known && a.lora_name == b.lora_name &&
         a.extra_keys == b.extra_keys && a.group_idx == b.group_idx &&
         a.kv_cache_spec_kind == b.kv_cache_spec_kind &&
         a.has_sliding_window == b.has_sliding_window &&
         (!a.has_sliding_window || a.sliding_window == b.sliding_window) &&
         a.locality == b.locality && a.cache_salt == b.cache_salt;
}

inline bool SameBatch(const EventBatch& a, const EventBatch& b) {
  if (a.events.size() != b.events.size() || a.has_dp_rank != b.has_dp_rank) return false;
  if (a.has_dp_rank && a.dp_rank != b.dp_rank) return false;
  // ts: bitwise, so that NaN equals NaN
  if (std::memcmp(&a.ts, &b.ts, sizeof(double)) != 0) return false;
  for (size_t i = 0; i < a.events.size(); ++i) {
    if (!SameEvent(a.events[i], b.events[i])) return false;
  }
  return true;
}


// Applies `batch` to a fresh Index and checks its invariants. `variant` % 3 picks the caps:
// none, 3 blocks per worker, or 5 blocks in total.
inline void ApplyAndCheck(const EventBatch& batch, size_t variant) {
  // Block size: the first BlockStored's, when plausible, so small inputs get past the size check.
  int64_t bs = 16;
  for (const Event& ev : batch.events) {
    if (ev.type == EventType::kBlockStored && ev.block_size >= 1 && ev.block_size <= 256) {
      bs = ev.block_size;
      break;
    }
  }
  IndexOptions opts;
  opts.block_size = bs;
  // One input in three runs with tight caps (when the index has them).
  switch (variant % 3) {
    case 1: SetCaps(&opts, 3, 0); break;
    case 2: SetCaps(&opts, 0, 5); break;
    default: break;
  }
  Index ix(opts);
  const WorkerId w[2] = {ix.AddWorker(), ix.AddWorker()};
  ApplyCounts counts[2];
  for (size_t i = 0; i < batch.events.size(); ++i) {
    ix.Apply(w[i % 2], batch.events[i], &counts[i % 2]);
    if constexpr (HasCaps<IndexOptions>::value) {
      if (opts.max_blocks_per_worker > 0) {
        FUZZ_ASSERT(ix.WorkerBlocks(w[i % 2]) <= opts.max_blocks_per_worker);
      }
      if (opts.max_blocks_total > 0) {
        FUZZ_ASSERT(ix.WorkerBlocks(w[0]) + ix.WorkerBlocks(w[1]) <= opts.max_blocks_total);
      }
    }
  }
  FUZZ_ASSERT(counts[0].events + counts[1].events == batch.events.size());

  // Keys from every BlockStored's tokens (its own LoRA root and extra keys), and from all
  // tokens concatenated.
  std::vector<std::vector<BlockKey>> key_sets;
  std::vector<uint32_t> all_tokens;
  for (const Event& ev : batch.events) {
    if (ev.type != EventType::kBlockStored || ev.token_ids.empty()) continue;
    std::vector<BlockKey> keys;
    ComputeBlockKeys(ChainRoot(ev.lora_name), ev.token_ids.data(), ev.token_ids.size(),
                     static_cast<size_t>(bs), &ev.extra_keys, &keys);
    FUZZ_ASSERT(keys.size() == ev.token_ids.size() / static_cast<size_t>(bs));
    key_sets.push_back(std::move(keys));
    all_tokens.insert(all_tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
  }
  {
    std::vector<BlockKey> keys;
    ComputeBlockKeys(kRootSeed, all_tokens.data(), all_tokens.size(), static_cast<size_t>(bs),
                     nullptr, &keys);
    key_sets.push_back(std::move(keys));
  }

  MatchResult m;
  const WorkerId limit = ix.WorkerIdLimit();
  for (const auto& keys : key_sets) {
    ix.FindMatches(keys.data(), keys.size(), &m);
    CheckMatch(m, keys.size(), limit);
  }
  // Speculative credits on worker 1 for the first key set, then matches before and after expiry.
  const auto& spec = key_sets.front();
  if (!spec.empty()) {
    ix.AddSpeculative(w[1], spec.data(), spec.size(), 10.0, 1.0);
    ix.FindMatches(spec.data(), spec.size(), &m, 10.5);
    CheckMatch(m, spec.size(), limit);
    FUZZ_ASSERT(m.blocks[w[1]] >= 1);  // its run starts at block 0
    ix.FindMatches(spec.data(), spec.size(), &m, 11.0);
    CheckMatch(m, spec.size(), limit);
  }
  (void)ix.MemoryBytes();
  for (WorkerId x : w) {
    FUZZ_ASSERT(ix.WorkerEntries(x).size() == ix.WorkerBlocks(x));
  }

  // Clear worker 0, remove worker 1: nothing may be left behind in the block table.
  ix.ClearWorker(w[0]);
  FUZZ_ASSERT(ix.WorkerBlocks(w[0]) == 0);
  ix.RemoveWorker(w[1]);
  FUZZ_ASSERT(ix.WorkerBlocks(w[1]) == 0);
  FUZZ_ASSERT(ix.Entries() == 0);
  FUZZ_ASSERT(ix.DistinctKeys() == 0);
  FUZZ_ASSERT(ix.SpeculativeEntries() == 0);
  for (const auto& keys : key_sets) {
    ix.FindMatches(keys.data(), keys.size(), &m, 100.0);
    FUZZ_ASSERT(m.max_blocks == 0);
  }
}

}  // namespace kvroute::fuzz
