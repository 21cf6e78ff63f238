// Helpers of the Index tests (cpp/tests/index_*_test.cc): events as the decoder gives them and
// a prefix match over a key list.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "common/block_key.h"
#include "common/event.h"
#include "common/types.h"
#include "index/index.h"
#include "tests/test_util.h"

namespace kvroute_test {

using kvroute::Event;
using kvroute::EventType;
using kvroute::Index;
using kvroute::MatchResult;
using kvroute::Medium;

// Index events as the decoder gives them (integer engine hashes).
inline Event StoredEv(std::vector<uint64_t> hashes, std::optional<uint64_t> parent,
                      std::vector<uint32_t> toks, int64_t bs = 16, Medium tier = Medium::kGpu) {
  Event e;
  e.type = EventType::kBlockStored;
  for (uint64_t h : hashes) e.block_hashes.push_back(IntHash(h));
  if (parent) {
    e.has_parent = true;
    e.parent_block_hash = IntHash(*parent);
  }
  e.token_ids.assign(toks.begin(), toks.end());
  e.block_size = bs;
  e.tier = tier;
  return e;
}
inline Event RemovedEv(std::vector<uint64_t> hashes, Medium tier = Medium::kGpu) {
  Event e;
  e.type = EventType::kBlockRemoved;
  for (uint64_t h : hashes) e.block_hashes.push_back(IntHash(h));
  e.tier = tier;
  return e;
}
inline std::vector<uint32_t> Cat(std::vector<uint32_t> a, const std::vector<uint32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
inline Event ClearedEv() {
  Event e;
  e.type = EventType::kAllBlocksCleared;
  return e;
}

inline MatchResult Match(const Index& ix, const std::vector<BlockKey>& keys, double now = -1) {
  MatchResult m;
  ix.FindMatches(keys.data(), keys.size(), &m, now);
  return m;
}

}  // namespace kvroute_test
