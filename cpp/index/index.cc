#include "index/index.h"

#include "index/inline_vec.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace kvroute {

Index::Index(IndexOptions opts)
    : opts_(opts),
      blocks_(std::make_unique<BlockTable>()),
      spec_first_(std::make_unique<tsl::robin_map<BlockKey, InlineVec<SpecRef>, BlockKeyHasher>>()) {
  if (opts_.block_size <= 0) throw std::invalid_argument("block_size must be > 0");
}

Index::~Index() = default;

WorkerId Index::AddWorker() {
  std::unique_lock lock(mu_);
  workers_.push_back(std::make_unique<WorkerState>());
  return static_cast<WorkerId>(workers_.size() - 1);
}

Index::WorkerState* Index::State(WorkerId w) {
  if (w >= workers_.size()) return nullptr;
  WorkerState* s = workers_[w].get();
  return (s != nullptr && s->alive) ? s : nullptr;
}

void Index::AddRef(WorkerId w, BlockKey key, int tier) {
  Holders& hs = blocks_->FindOrInsert(key).first->value;
  Holder* h = hs.Find(w);
  if (h == nullptr) {
    if (hs.full()) return;  // 65,535 workers already hold this block
    heap_holder_bytes_ += hs.Add(w);
    h = hs.Find(w);
    ++entries_;
  }
  const uint8_t old_mask = TierMask(h->refs);
  if (h->refs[tier] < 0xFFFF) ++h->refs[tier];
  hs.Retier(h, old_mask);
}

void Index::DropRef(WorkerId w, BlockKey key, int tier, uint16_t n) {
  BlockTable::Slot* slot = blocks_->Find(key);
  if (slot == nullptr) return;
  Holders& hs = slot->value;
  Holder* h = hs.Find(w);
  if (h == nullptr) return;
  const uint8_t old_mask = TierMask(h->refs);
  h->refs[tier] = h->refs[tier] > n ? h->refs[tier] - n : 0;
  hs.Retier(h, old_mask);
  if (h->refs[0] == 0 && h->refs[1] == 0 && h->refs[2] == 0) {
    const uint64_t before = hs.HeapBytes();
    hs.Erase(h);
    --entries_;
    if (hs.size() == 0) {
      heap_holder_bytes_ -= before;
      blocks_->Erase(slot);
    }
  }
}

// A holder's tier count is the number of the worker's engine hashes that hold the key on
// that tier (not the sum of their references), so the two levels can never drift apart.
void Index::AddEngineRef(WorkerId w, EngineEntry* e, int tier) {
  if (e->refs[tier] == 0xFFFF) return;  // saturated: 65,535 stores of one engine hash
  if (e->refs[tier]++ == 0) AddRef(w, e->key, tier);
}

void Index::DropEngineEntry(WorkerId w, const EngineEntry& e) {
  for (int t = 0; t < kNumMedia; ++t) {
    if (e.refs[t] > 0) DropRef(w, e.key, t, 1);
  }
}

void Index::ClearLocked(WorkerId w) {
  WorkerState* s = State(w);
  if (s == nullptr) return;
  s->by_hash.ForEach([&](const EngineMap::Slot& e) { DropEngineEntry(w, e.value); });
  engine_entries_ -= s->by_hash.size();
  s->by_hash.Clear();
  std::deque<OrderSlot>().swap(s->order);
}

void Index::ClearWorker(WorkerId w) {
  std::unique_lock lock(mu_);
  ClearLocked(w);
}

void Index::RemoveWorker(WorkerId w) {
  std::unique_lock lock(mu_);
  if (State(w) == nullptr) return;
  ClearLocked(w);
  DropSpecLocked(w);
  workers_[w]->alive = false;
  workers_[w].reset();
}

void Index::Apply(WorkerId w, const Event& ev, ApplyCounts* c) {
  ++c->events;
  if (ev.type == EventType::kBlockStored) {
    if (!ev.medium_known) ++c->unknown_medium;
    const bool placeholder = ev.token_ids.empty() && ev.block_size == 0;
    if (!placeholder && ev.block_size != opts_.block_size) {
      c->drops.Add(DropReason::kBlockSizeMismatch);
      return;
    }
    if (!placeholder && ev.token_ids.size() != ev.block_hashes.size() *
                                                   static_cast<uint64_t>(opts_.block_size)) {
      c->drops.Add(DropReason::kBadTokenCount);
      return;
    }
    if (!ev.kv_cache_spec_kind.empty() && ev.kv_cache_spec_kind != "full_attention") {
      c->drops.Add(DropReason::kUnsupportedSpec);
      return;
    }
  }
  const int tier = static_cast<int>(ev.tier);
  // The block hashes need no index state: compute them before taking the lock.
  thread_local std::vector<BlockKey> keys;
  keys.clear();
  if (ev.type == EventType::kBlockStored && !ev.token_ids.empty()) {
    ComputeBlockHashes(ev.token_ids.data(), ev.token_ids.size(),
                       static_cast<size_t>(opts_.block_size),
                       ev.extra_keys.empty() ? nullptr : &ev.extra_keys, &keys);
  }
  std::unique_lock lock(mu_);
  WorkerState* s = State(w);
  if (s == nullptr) return;
  switch (ev.type) {
    case EventType::kAllBlocksCleared:
      ++c->clears;
      ClearLocked(w);
      return;
    case EventType::kBlockRemoved:
      for (size_t i = 0; i < ev.block_hashes.size(); ++i) {
        if (i > 0 && i % kApplyChunk == 0) {  // as for stores: lookups get in between chunks
          lock.unlock();
          lock.lock();
          s = State(w);
          if (s == nullptr) return;
        }
        const EngineHash& h = ev.block_hashes[i];
        EngineMap::Slot* it = s->by_hash.Find(h);
        if (it == nullptr || it->value.refs[tier] == 0) {
          ++c->unknown_removes;
          continue;
        }
        EngineEntry& e = it->value;
        if (--e.refs[tier] == 0) DropRef(w, e.key, tier, 1);
        ++c->blocks_removed;
        if (e.refs[0] == 0 && e.refs[1] == 0 && e.refs[2] == 0) {
          s->by_hash.Erase(it);
          --engine_entries_;
        }
      }
      return;
    case EventType::kBlockStored: break;
  }
  if (ev.token_ids.empty() && ev.block_size == 0) {
    // CPU placeholder: a tier update of blocks already known by engine hash.
    for (const EngineHash& h : ev.block_hashes) {
      EngineMap::Slot* it = s->by_hash.Find(h);
      if (it == nullptr) {
        ++c->orphan_stores;
        continue;
      }
      AddEngineRef(w, &it->value, tier);
      Touch(s, &it->value, h);
      ++c->blocks_stored;
    }
    return;
  }
  uint64_t parent;
  if (ev.has_parent) {
    const EngineMap::Slot* it = s->by_hash.Find(ev.parent_block_hash);
    if (it == nullptr) {
      // Deliberately not guessed: without the parent the chain key is unknowable.
      c->orphan_stores += ev.block_hashes.size();
      return;
    }
    parent = it->value.key;
  } else if (!ev.lora_name.empty()) {
    parent = ChainRoot(ev.lora_name);
  } else if (ev.has_lora_id) {
    parent = ChainRoot("#lora_id:" + std::to_string(ev.lora_id));
  } else {
    parent = kRootSeed;
  }
  ChainBlockKeys(parent, keys.data(), keys.size());
  const size_t n = ev.block_hashes.size();
  for (size_t i = 0; i < n; ++i) {
    if (i % kApplyChunk == 0) {
      if (i > 0) {
        // Let waiting lookups in between chunks: a long event never holds the lock for
        // more than kApplyChunk blocks. The caller serialises this worker's events, so
        // only a concurrent RemoveWorker can change what follows.
        lock.unlock();
        lock.lock();
        s = State(w);
        if (s == nullptr) return;
      }
      // The tables' slots for this chunk are random misses: start loading them now.
      const size_t end = std::min(n, i + kApplyChunk);
      for (size_t k = i; k < end; ++k) {
        blocks_->Prefetch(keys[k]);
        s->by_hash.Prefetch(ev.block_hashes[k]);
      }
    }
    const BlockKey key = keys[i];
    auto [it, inserted] = s->by_hash.FindOrInsert(ev.block_hashes[i]);
    if (inserted) {
      ++engine_entries_;
      it->value = EngineEntry{key, {0, 0, 0}};
    } else if (it->value.key != key) {
      ++c->hash_rebound;
      DropEngineEntry(w, it->value);
      it->value = EngineEntry{key, {0, 0, 0}};
    }
    AddEngineRef(w, &it->value, tier);
    Touch(s, &it->value, ev.block_hashes[i]);
    ++c->blocks_stored;
  }
  EnforceCaps(w);
}

void Index::Touch(WorkerState* s, EngineEntry* e, const EngineHash& h) {
  if (opts_.max_blocks_per_worker == 0 && opts_.max_blocks_total == 0) return;
  e->stamp = ++s->next_stamp;
  s->order.emplace_back(h, e->stamp);
  // Compact when stale slots dominate (amortised O(1) per store).
  if (s->order.size() > 2 * s->by_hash.size() + 64) {
    std::deque<OrderSlot> live;
    for (const OrderSlot& o : s->order) {
      const EngineHash hash = o.hash();
      const uint16_t stamp = o.stamp;
      const EngineMap::Slot* it = s->by_hash.Find(hash);
      if (it != nullptr && it->value.stamp == stamp) live.emplace_back(hash, stamp);
    }
    s->order.swap(live);
  }
}

bool Index::EvictOldest(WorkerId w, WorkerState* s) {
  while (!s->order.empty()) {
    const EngineHash hash = s->order.front().hash();
    const uint16_t stamp = s->order.front().stamp;
    s->order.pop_front();
    EngineMap::Slot* it = s->by_hash.Find(hash);
    if (it == nullptr || it->value.stamp != stamp) continue;  // stale slot
    DropEngineEntry(w, it->value);
    s->by_hash.Erase(it);
    --engine_entries_;
    return true;
  }
  return false;
}

void Index::EnforceCaps(WorkerId w) {
  WorkerState* s = State(w);
  if (s == nullptr) return;
  if (opts_.max_blocks_per_worker > 0) {
    while (s->by_hash.size() > opts_.max_blocks_per_worker && EvictOldest(w, s)) {
      ++s->evicted_by_cap;
    }
  }
  if (opts_.max_blocks_total > 0) {
    while (engine_entries_ > opts_.max_blocks_total) {
      // Deliberately evict from the largest worker: one flooding worker cannot push the
      // others' blocks out.
      WorkerId victim = w;
      size_t most = s->by_hash.size();
      for (WorkerId v = 0; v < workers_.size(); ++v) {
        const WorkerState* o = workers_[v].get();
        if (o != nullptr && o->alive && o->by_hash.size() > most) {
          most = o->by_hash.size();
          victim = v;
        }
      }
      if (!EvictOldest(victim, workers_[victim].get())) break;
      ++workers_[victim]->evicted_by_cap;
    }
  }
}

void Index::FindMatches(const BlockKey* keys, size_t n, MatchResult* out, double now) const {
  std::shared_lock lock(mu_);
  if (now < 0) now = last_now_;
  out->Reset(workers_.size());
  uint32_t* depth = out->blocks.data();
  double* weighted = out->weighted.data();
  // Credit of a block by its holder's tier mask: GPU if held there, else the better of CPU
  // and disk.
  const double w_gpu = opts_.tier_weights[0];
  double tier_w[8];
  for (int m = 0; m < 8; ++m) {
    tier_w[m] = (m & 1) ? w_gpu
                        : std::max((m & 2) ? opts_.tier_weights[1] : 0.0,
                                   (m & 4) ? opts_.tier_weights[2] : 0.0);
  }
  const bool any_spec = !spec_first_->empty();
  size_t max_depth = 0;  // deepest any worker has reached so far
  // Run-length walk: consecutive blocks held by the same (worker, best tier) set (equal
  // HolderSet signatures) form a run; the holders are touched once per run, when it ends
  // (`Flush`), not once per block. A holder advances through a run iff it had matched every
  // block before the run (depth == run start).
  const Holders* run = nullptr;  // holders of the current run; null = no run open
  uint64_t run_sig = 0;
  size_t run_start = 0;
  // A speculative credit moves a worker's depth ahead; up to the deepest such credit, runs are
  // closed at every block so that the worker rejoins exactly where its credit ends.
  size_t spec_horizon = 0;
  auto flush = [&](size_t end_block) {
    if (run == nullptr) return;
    const double len = static_cast<double>(end_block - run_start);
    for (const Holder& h : *run) {
      if (depth[h.worker] != run_start) continue;
      depth[h.worker] = static_cast<uint32_t>(end_block);
      weighted[h.worker] += tier_w[TierMask(h.refs)] * len;
      if (end_block > max_depth) max_depth = end_block;
    }
    run = nullptr;
  };
  // Lookups are random accesses into a large table: issue a chunk of independent finds first
  // so their cache misses overlap, then walk the blocks in order.
  // Prefetch the home slots of the blocks kAhead further on, so that several misses are in
  // flight while the walk inspects the current block.
  constexpr size_t kAhead = 12;
  for (size_t k = 0; k < std::min(kAhead, n); ++k) blocks_->Prefetch(keys[k]);
  const BlockTable::Slot* const end = nullptr;
  size_t i = 0;
  for (; i < n; ++i) {
    if (i + kAhead < n) blocks_->Prefetch(keys[i + kAhead]);
    const BlockTable::Slot* it = blocks_->Find(keys[i]);
    const InlineVec<SpecRef>* runs = nullptr;
    if (any_spec) {
      auto sit = spec_first_->find(keys[i]);
      if (sit != spec_first_->end()) runs = &sit->second;
    }
    if (runs == nullptr && i > spec_horizon && it != end && run != nullptr &&
        it->value.Signature() == run_sig) {
      continue;  // same holders as the previous block: the run goes on
    }
    flush(i);  // depths are now exact up to block i
    if (it != end) {
      const Holders& hs = it->value;
      bool advanced = false;
      for (const Holder& h : hs) advanced = advanced || depth[h.worker] == i;
      if (advanced) {
        run = &hs;
        run_sig = hs.Signature();
        run_start = i;
        if (runs != nullptr) flush(i + 1);  // exact depths at i + 1 before the credits below
      }
    }
    if (runs != nullptr) {
      // Speculative blocks are about to be computed on the GPU: credited like GPU blocks,
      // for as long as the prompt's keys follow the run's (not for workers that hold block i).
      for (const SpecRef& r : *runs) {
        uint32_t& d = depth[r.worker];
        if (d != i || r.run->expiry <= now) continue;
        const std::vector<BlockKey>& rk = r.run->keys;
        size_t m = 0;
        while (m < rk.size() && i + m < n && rk[m] == keys[i + m]) ++m;
        d += static_cast<uint32_t>(m);
        weighted[r.worker] += w_gpu * static_cast<double>(m);
        max_depth = std::max(max_depth, i + m);
        spec_horizon = std::max(spec_horizon, i + m);
      }
    }
    if (run == nullptr && max_depth <= i) break;  // no worker holds block i: the match ends
  }
  flush(i);
  out->max_blocks = static_cast<uint32_t>(max_depth);
}

void Index::UnlinkRun(const SpecRun* run) {
  auto it = spec_first_->find(run->keys.front());
  if (it == spec_first_->end()) return;
  InlineVec<SpecRef>& refs = it.value();
  for (SpecRef& r : refs) {
    if (r.run == run) {
      refs.Erase(&r);
      break;
    }
  }
  if (refs.size() == 0) spec_first_->erase(it);
}

void Index::DropSpecLocked(WorkerId w) {
  for (auto& run : spec_runs_) {
    if (run != nullptr && run->worker == w) {
      UnlinkRun(run.get());
      spec_entries_ -= run->keys.size();
      run.reset();  // the deque slot is popped by ExpireLocked
    }
  }
}

void Index::ExpireLocked(double now) {
  while (!spec_runs_.empty() && (spec_runs_.front() == nullptr || spec_runs_.front()->expiry <= now)) {
    if (spec_runs_.front() != nullptr) {
      UnlinkRun(spec_runs_.front().get());
      spec_entries_ -= spec_runs_.front()->keys.size();
    }
    spec_runs_.pop_front();
  }
}

void Index::AddSpeculative(WorkerId w, const BlockKey* keys, size_t n, double now, double ttl) {
  std::unique_lock lock(mu_);
  if (now > last_now_) last_now_ = now;
  ExpireLocked(now);
  if (State(w) == nullptr || ttl <= 0 || n == 0) return;
  auto run = std::make_unique<SpecRun>();
  run->worker = w;
  run->expiry = now + ttl;
  run->keys.assign(keys, keys + n);
  (*spec_first_)[keys[0]].Push(SpecRef{w, run.get()});
  spec_entries_ += n;
  spec_runs_.push_back(std::move(run));
}

void Index::ExpireSpeculative(double now) {
  std::unique_lock lock(mu_);
  if (now > last_now_) last_now_ = now;
  ExpireLocked(now);
}

std::vector<Index::WorkerEntry> Index::WorkerEntries(WorkerId w) const {
  std::shared_lock lock(mu_);
  std::vector<WorkerEntry> out;
  if (w >= workers_.size() || workers_[w] == nullptr) return out;
  out.reserve(workers_[w]->by_hash.size());
  workers_[w]->by_hash.ForEach([&](const EngineMap::Slot& e) {
    out.push_back({e.key, e.value.key, e.value.refs});
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
  std::shared_lock lock(mu_);
  return spec_entries_;
}

uint64_t Index::MemoryBytes() const {
  std::shared_lock lock(mu_);
  constexpr uint64_t kBlockBucket = BlockTable::slot_bytes();  // key + HolderSet, no overhead
  constexpr uint64_t kEngineBucket = EngineMap::slot_bytes();
  uint64_t bytes = blocks_->capacity() * kBlockBucket + heap_holder_bytes_;
  for (const auto& s : workers_) {
    if (s != nullptr) bytes += s->by_hash.capacity() * kEngineBucket;
  }
  bytes += spec_first_->bucket_count() * (sizeof(std::pair<BlockKey, InlineVec<SpecRef>>) + 8);
  bytes += spec_entries_ * sizeof(BlockKey) + spec_runs_.size() * sizeof(SpecRun);
  for (const auto& s : workers_) {
    if (s != nullptr) bytes += s->order.size() * sizeof(OrderSlot);  // the caps' store order
  }
  return bytes;
}

}  // namespace kvroute
