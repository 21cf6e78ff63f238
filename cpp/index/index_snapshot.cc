// Index (index.h), what it tells: a worker's entries (WorkerEntries) and their restore from a
// peer's snapshot (RestoreEntries), and the counters.
#include "index/index.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <utility>
#include <vector>

#include "index/inline_vec.h"

namespace kvroute {

uint64_t Index::RestoreEntries(WorkerId w, const WorkerEntry* entries, size_t n, ApplyCounts* c) {
  uint64_t added = 0;
  // Room for all of them first: a dump lists a worker's entries in its table's order (sorted
  // by engine key), and sorted keys inserted into a table sized for a fraction of them all
  // land in one cluster at its start (1M entries of 8 workers: 12.1 s grown per chunk, 0.08 s
  // grown first; bench_snapshot.py, 2-3 runs each).
  PrepareRoom(w, n);
  for (size_t start = 0; start < n; start += kRestoreChunk) {
    const size_t room = std::min(n - start, kRestoreChunk);
    PrepareRoom(w, room);  // grown off the write lock, as Apply's chunks are
    std::unique_lock lock(mu_);
    ++version_;
    WorkerState* s = State(w);
    if (s == nullptr) return added;
    for (size_t i = start; i < start + room; ++i) {
      const WorkerEntry& x = entries[i];
      if (x.refs[0] == 0 && x.refs[1] == 0 && x.refs[2] == 0) continue;
      const uint64_t h = EngineKey(x.hash);
      const uint32_t block = FindOrAddBlock(x.key);
      const uint32_t h_lo = static_cast<uint32_t>(h), h_hi = static_cast<uint32_t>(h >> 32);
      auto [e, inserted] = s->by_hash.FindOrInsert(
          h, [h_lo, h_hi](const EngineSlot& y) { return y.hash_lo == h_lo && y.hash_hi == h_hi; },
          [&] { return EngineSlot::Make(h, block); });
      if (inserted) {
        ++engine_entries_;
      } else if (e->block() != block) {
        ++c->hash_rebound;
        DropEngineEntry(w, *e);
        if (e->word & kRefsMany) s->overflow.erase(h);
        e->word = block;
      }
      for (int t = 0; t < kNumMedia; ++t) {
        for (uint32_t k = 0; k < x.refs[t]; ++k) {
          if (!AddEngineRef(w, s, e, t)) break;  // saturated: the rest is not counted
        }
      }
      if (NoRefs(*e)) {
        EraseEngineEntry(s, e, !inserted);
        if ((*slab_)[block].holders.empty()) DropHolderRef(w, block, 0, 0);  // frees it
        continue;
      }
      Touch(s, e, !inserted);
      c->blocks_stored += 1;
      ++added;
    }
    EnforceCaps(w);
  }
  return added;
}

namespace {
// Inverse of Fmix64 (each step of it is invertible: x ^= x >> 33 is its own inverse, and the
// multipliers are odd, so they have inverses mod 2^64).
uint64_t Unfmix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0x9cb4b2f8129337dbull;  // inverse of 0xc4ceb9fe1a85ec53
  x ^= x >> 33;
  x *= 0x4f74430c22a54005ull;  // inverse of 0xff51afd7ed558ccd
  x ^= x >> 33;
  return x;
}
}  // namespace

std::vector<Index::WorkerEntry> Index::WorkerEntries(WorkerId w) const {
  std::shared_lock lock(mu_);
  std::vector<WorkerEntry> out;
  if (w >= workers_.size() || workers_[w] == nullptr) return out;
  out.reserve(workers_[w]->by_hash.size());
  workers_[w]->by_hash.ForEach([&](const EngineSlot& e) {
    const WorkerState* s = workers_[w].get();
    auto clamp = [&](int t) {
      return static_cast<uint16_t>(std::min<uint32_t>(Refs(s, e, t), 0xFFFF));
    };
    out.push_back({EngineHash{0, Unfmix64(e.hash())},
                   (*slab_)[e.block()].key,
                   {clamp(0), clamp(1), clamp(2)}});
  });
  return out;
}

WorkerId Index::WorkerIdLimit() const {
  std::shared_lock lock(mu_);
  return static_cast<WorkerId>(workers_.size());
}

uint64_t Index::WorkerBlocks(WorkerId w) const {
  std::shared_lock lock(mu_);
  if (w >= workers_.size() || workers_[w] == nullptr) return 0;
  return workers_[w]->by_hash.size();
}

uint64_t Index::WorkerEvictedByCap(WorkerId w) const {
  std::shared_lock lock(mu_);
  if (w >= workers_.size() || workers_[w] == nullptr) return 0;
  return workers_[w]->evicted_by_cap;
}

uint64_t Index::DistinctKeys() const {
  std::shared_lock lock(mu_);
  return blocks_->size();
}

uint64_t Index::Entries() const {
  std::shared_lock lock(mu_);
  return entries_;
}

uint64_t Index::SpeculativeEntries() const {
  std::shared_lock lock(spec_mu_);
  return spec_entries_;
}

uint64_t Index::SpeculativeHeld() const {
  std::shared_lock lock(spec_mu_);
  return held_.size();
}

uint64_t Index::SpeculativeDropped() const {
  std::shared_lock lock(spec_mu_);
  return spec_dropped_;
}

uint64_t Index::MemoryBytes() const {
  std::shared_lock lock(mu_);
  uint64_t bytes = blocks_->bytes() + slab_->bytes() + static_cast<uint64_t>(heap_holder_bytes_) +
                   holder_pool_.TableBytes();
  for (const auto& s : workers_) {
    if (s == nullptr) continue;
    bytes += sizeof(WorkerState) + s->by_hash.bytes();
    bytes += s->overflow.bucket_count() *
             (sizeof(std::pair<uint64_t, std::array<uint32_t, kNumMedia>>) + 8);
  }
  std::shared_lock spec(spec_mu_);
  bytes += spec_first_->bucket_count() * (sizeof(std::pair<BlockKey, InlineVec<CreditRef>>) + 8);
  bytes += spec_entries_ * sizeof(BlockKey) + (credits_.size() + held_.size()) * sizeof(SpecCredit);
  return bytes;
}

}  // namespace kvroute
