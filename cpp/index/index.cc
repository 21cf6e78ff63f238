#include "index/index.h"

#include "index/inline_vec.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>

namespace kvroute {

Index::Index(IndexOptions opts)
    : opts_(opts),
      slab_(std::make_unique<BlockSlab>()),
      blocks_(std::make_unique<BlockTable>()),
      spec_first_(std::make_unique<tsl::robin_map<BlockKey, InlineVec<CreditRef>, BlockKeyHasher>>()) {
  if (opts_.block_size <= 0) throw std::invalid_argument("block_size must be > 0");
}

Index::~Index() {
  slab_->ForEachLive([this](BlockRec& r) { r.holders.Release(holder_pool_); });
}

WorkerId Index::AddWorker() {
  std::unique_lock lock(mu_);
  ++version_;
  workers_.push_back(std::make_unique<WorkerState>());
  {
    std::unique_lock spec(spec_mu_);
    spec_alive_.push_back(1);
  }
  return static_cast<WorkerId>(workers_.size() - 1);
}

Index::WorkerState* Index::State(WorkerId w) {
  if (w >= workers_.size()) return nullptr;
  WorkerState* s = workers_[w].get();
  return (s != nullptr && s->alive) ? s : nullptr;
}

uint32_t Index::FindBlock(BlockKey key) const {
  const uint32_t tag = Tag(key);
  const BlockSlot* s = blocks_->Find(TagHash(key), [&](const BlockSlot& x) {
    return x.tag == tag && (*slab_)[x.block].key == key;
  });
  return s == nullptr ? kNone : s->block;
}

uint32_t Index::FindOrAddBlock(BlockKey key) {
  const uint32_t tag = Tag(key);
  auto [s, inserted] = blocks_->FindOrInsert(
      TagHash(key),
      [&](const BlockSlot& x) { return x.tag == tag && (*slab_)[x.block].key == key; },
      [&] { return BlockSlot{tag, slab_->Alloc(key)}; });
  return s->block;
}

void Index::DropHolderRef(WorkerId w, uint32_t block, int tier, uint32_t n) {
  BlockRec& rec = (*slab_)[block];
  int64_t heap;
  if (rec.holders.DropRef(holder_pool_, w, tier, n, &heap)) --entries_;
  heap_holder_bytes_ += heap;
  if (!rec.holders.empty()) return;
  // No holder left: the block leaves the table and its record goes back to the slab.
  BlockSlot* s = blocks_->Find(TagHash(rec.key), [&](const BlockSlot& x) { return x.block == block; });
  if (s != nullptr) blocks_->Erase(s);
  slab_->Free(block);
}

// A holder's tier count is the number of the worker's engine hashes that hold the key on
// that tier (not the sum of their references), so the two levels can never drift apart: an
// engine reference is only counted if the holder's count could take it.
// An engine slot's count per tier is its tier bit (0 or 1), or, once some tier holds the
// engine hash twice (kRefsMany), the exact counts in WorkerState::overflow.
bool Index::AddEngineRefMore(WorkerId w, WorkerState* s, EngineSlot* e, int tier) {
  const uint32_t bit = kTierBit0 << tier;
  if (!(e->word & bit)) {  // (so kRefsMany: another tier holds it more than once)
    if (!AddHolderRef(w, e->block(), tier)) return false;
    e->word |= bit;
  }
  auto it = s->overflow.end();
  if (e->word & kRefsMany) {
    it = s->overflow.find(e->hash());
  } else {  // a second reference: the counts move to the side map
    std::array<uint32_t, kNumMedia> counts;
    for (int t = 0; t < kNumMedia; ++t) counts[t] = e->held(t) ? 1 : 0;
    it = s->overflow.emplace(e->hash(), counts).first;
    e->word |= kRefsMany;
  }
  uint32_t& n = it.value()[tier];
  if (n < 0xFFFFFFFFu) ++n;
  return true;
}

bool Index::DropEngineRef(WorkerState* s, EngineSlot* e, int tier) {
  const uint32_t bit = kTierBit0 << tier;
  if (!(e->word & kRefsMany)) {
    e->word &= ~bit;
    return true;
  }
  auto it = s->overflow.find(e->hash());
  std::array<uint32_t, kNumMedia>& counts = it.value();
  const bool last = --counts[tier] == 0;
  if (last) e->word &= ~bit;
  if (counts[0] <= 1 && counts[1] <= 1 && counts[2] <= 1) {  // back to the tier bits alone
    e->word &= ~kRefsMany;
    s->overflow.erase(it);
  }
  return last;
}

uint32_t Index::Refs(const WorkerState* s, const EngineSlot& e, int tier) {
  if (!(e.word & kRefsMany)) return e.held(tier) ? 1 : 0;
  return s->overflow.find(e.hash())->second[tier];
}

void Index::DropEngineEntry(WorkerId w, const EngineSlot& e) {
  for (int t = 0; t < kNumMedia; ++t) {
    if (e.held(t)) DropHolderRef(w, e.block(), t, 1);
  }
}

void Index::EraseEngineEntry(WorkerState* s, EngineSlot* e, bool stamped) {
  if (stamped && s->by_hash.has_side()) --(*s->live)[s->by_hash.Side(e)];
  if (e->word & kRefsMany) s->overflow.erase(e->hash());
  s->by_hash.Erase(e);
  --engine_entries_;
}

void Index::ClearLocked(WorkerId w) {
  WorkerState* s = State(w);
  if (s == nullptr) return;
  s->by_hash.ForEach([&](const EngineSlot& e) { DropEngineEntry(w, e); });
  engine_entries_ -= s->by_hash.size();
  s->by_hash.Clear();
  s->overflow.clear();
  s->live.reset();
  s->epoch_fill = 0;
  s->hand = 0;
  s->clamp_hand = 0;
  s->clamping = false;
}

void Index::ClearWorker(WorkerId w) {
  std::unique_lock lock(mu_);
  ++version_;
  ClearLocked(w);
}

void Index::RemoveWorker(WorkerId w) {
  std::unique_lock lock(mu_);
  ++version_;
  if (State(w) == nullptr) return;
  ClearLocked(w);
  {
    std::unique_lock spec(spec_mu_);
    spec_alive_[w] = 0;
    DropSpecLocked(w);
  }
  workers_[w]->alive = false;
  workers_[w].reset();
}

namespace {
// Apply's per-thread buffers, reached once per event through a call: each access to a
// thread_local in a shared library costs a __tls_get_addr call, and with the thread_locals
// named in Apply, GCC recomputed their address at 14 places in it (as router.cc's
// ThreadScratch explains).
struct ApplyBuffers {
  std::vector<BlockKey> keys;
  std::vector<uint64_t> ekeys;
  std::vector<std::string> extras;  // extra keys without vLLM's repeated adapter name
};
// The spec kinds whose blocks serve prefix hits as full attention does: vLLM's
// FullAttentionSpec and its subclasses MLAAttentionSpec and SinkFullAttentionSpec
// (vllm/v1/kv_cache_interface.py, get_kv_cache_spec_kind); empty = no kind (SGLang, older
// vLLM).
bool IsFullAttentionKind(const std::string& kind) {
  return kind.empty() || kind == "full_attention" || kind == "mla_attention" ||
         kind == "sink_full_attention";
}
__attribute__((noinline)) ApplyBuffers& ThreadApplyBuffers() {
  thread_local ApplyBuffers b;
  return b;
}
constexpr size_t kStoreAhead = 8;
// BlockRemoved's look-ahead (Apply): engine slot, then its record, then the block slot.
constexpr size_t kRemoveAhead = 8;
constexpr size_t kRemoveRecAhead = 4;
constexpr size_t kRemoveKeyAhead = 2;
}  // namespace

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
    if (!IsFullAttentionKind(ev.kv_cache_spec_kind)) {
      // Not indexed; the group is remembered so that its removes (which carry only the group
      // index) leave the full-attention groups' entries of the same engine hashes alone.
      c->drops.Add(DropReason::kUnsupportedSpec);
      if (ev.group_idx >= 0 && ev.group_idx < kMaxTrackedGroups) {
        std::unique_lock lock(mu_);
        if (WorkerState* s = State(w)) {
          if (s->other_groups.size() <= static_cast<size_t>(ev.group_idx)) {
            s->other_groups.resize(static_cast<size_t>(ev.group_idx) + 1);
          }
          s->other_groups[static_cast<size_t>(ev.group_idx)] = 1;
        }
      }
      return;
    }
  }
  const int tier = static_cast<int>(ev.tier);
  // The block hashes and engine keys need no index state: compute them before the lock.
  ApplyBuffers& tl = ThreadApplyBuffers();
  std::vector<BlockKey>& keys = tl.keys;
  std::vector<uint64_t>& ekeys = tl.ekeys;
  keys.clear();
  ekeys.resize(ev.block_hashes.size());
  for (size_t i = 0; i < ev.block_hashes.size(); ++i) ekeys[i] = EngineKey(ev.block_hashes[i]);
  if (ev.type == EventType::kBlockStored && !ev.token_ids.empty()) {
    const std::vector<std::string>* extras = ev.extra_keys.empty() ? nullptr : &ev.extra_keys;
    if (extras != nullptr && !ev.lora_name.empty() && ev.cache_salt.empty()) {
      // vLLM's adapter name, repeated as every block's first extra key: the root has it.
      tl.extras.resize(ev.extra_keys.size());
      for (size_t i = 0; i < ev.extra_keys.size(); ++i) {
        if (!StripLeadingExtraKey(ev.extra_keys[i], ev.lora_name, &tl.extras[i])) {
          tl.extras[i] = ev.extra_keys[i];
        }
      }
      extras = &tl.extras;
    }
    ComputeBlockHashes(ev.token_ids.data(), ev.token_ids.size(),
                       static_cast<size_t>(opts_.block_size), extras, &keys);
  }
  std::unique_lock lock(mu_);
  ++version_;
  WorkerState* s = State(w);
  if (s == nullptr) return;
  // Lets waiting lookups (or a table growth) in; false if the worker was removed meanwhile.
  // The caller serialises this worker's events, so only a RemoveWorker can change what
  // follows.
  auto relock = [&](bool grow, size_t room) {
    lock.unlock();
    if (grow) PrepareRoom(w, room);
    lock.lock();
    ++version_;
    s = State(w);
    return s != nullptr;
  };
  switch (ev.type) {
    case EventType::kAllBlocksCleared:
      ++c->clears;
      ClearLocked(w);
      return;
    case EventType::kBlockRemoved: {
      if (ev.group_idx >= 0 && static_cast<uint64_t>(ev.group_idx) < s->other_groups.size() &&
          s->other_groups[static_cast<size_t>(ev.group_idx)]) {
        c->drops.Add(DropReason::kUnsupportedSpec);  // a group that is not indexed
        return;
      }
      // Three dependent misses per block: its engine slot, the record that slot names, and
      // the block-table slot of the record's key (erased if the block loses its last
      // holder). Loaded as a pipeline: the engine slot kRemoveAhead blocks ahead, the record
      // kRemoveRecAhead ahead (the slot is in cache by then), the block slot
      // kRemoveKeyAhead ahead (the record is; its pointer kept from the record stage in
      // `ahead`). The look-ahead only reads: the block's own turn looks everything up again,
      // after the erases before it (they move table slots, not records).
      const size_t n = ekeys.size();
      const BlockRec* ahead[kRemoveRecAhead] = {};  // records of blocks i+1 .. i+kRemoveRecAhead
      for (size_t k = 0; k < std::min(n, kRemoveAhead); ++k) s->by_hash.Prefetch(ekeys[k]);
      for (size_t i = 0; i < n; ++i) {
        if (i > 0 && i % kApplyChunk == 0 && !relock(false, 0)) return;  // a chunk at a time
        if (i + kRemoveAhead < n) s->by_hash.Prefetch(ekeys[i + kRemoveAhead]);
        const BlockRec*& rec_ahead = ahead[(i + kRemoveRecAhead) % kRemoveRecAhead];
        rec_ahead = nullptr;
        if (i + kRemoveRecAhead < n) {
          if (const EngineSlot* a = FindEngine(s, ekeys[i + kRemoveRecAhead])) {
            rec_ahead = &(*slab_)[a->block()];
            __builtin_prefetch(rec_ahead);
          }
        }
        if (const BlockRec* rec = ahead[(i + kRemoveKeyAhead) % kRemoveRecAhead]) {
          blocks_->Prefetch(TagHash(rec->key));
        }
        EngineSlot* e = FindEngine(s, ekeys[i]);
        if (e == nullptr || !e->held(tier)) {
          ++c->unknown_removes;
          continue;
        }
        if (DropEngineRef(s, e, tier)) DropHolderRef(w, e->block(), tier, 1);
        ++c->blocks_removed;
        if (NoRefs(*e)) EraseEngineEntry(s, e);
      }
      return;
    }
    case EventType::kBlockStored: break;
  }
  if (ev.group_idx >= 0 && static_cast<uint64_t>(ev.group_idx) < s->other_groups.size()) {
    s->other_groups[static_cast<size_t>(ev.group_idx)] = 0;  // a group's kind: its last store's
  }
  if (ev.token_ids.empty() && ev.block_size == 0) {
    // CPU placeholder: a tier update of blocks already known by engine hash.
    for (const uint64_t h : ekeys) {
      EngineSlot* e = FindEngine(s, h);
      if (e == nullptr) {
        ++c->orphan_stores;
        continue;
      }
      if (!AddEngineRef(w, s, e, tier)) continue;  // not counted: saturated
      Touch(s, e, true);
      ++c->blocks_stored;
    }
    EnforceCaps(w);
    return;
  }
  uint64_t parent;
  if (ev.has_parent) {
    const EngineSlot* e = FindEngine(s, EngineKey(ev.parent_block_hash));
    if (e == nullptr) {
      // Deliberately not guessed: without the parent the chain key is unknowable.
      c->orphan_stores += ev.block_hashes.size();
      return;
    }
    parent = (*slab_)[e->block()].key;
  } else if (!ev.lora_name.empty()) {
    parent = ChainRoot(ev.lora_name);
  } else if (ev.has_lora_id) {
    parent = ChainRoot("#lora_id:" + std::to_string(ev.lora_id));
  } else {
    parent = kRootSeed;
  }
  ChainBlockKeys(parent, keys.data(), keys.size());
  const size_t n = ekeys.size();
  if (!ev.has_parent && HoldsAll(s, keys.data(), ekeys.data(), n, tier)) {
    // A run from token 0 that w already holds, every block with this content on this tier:
    // vLLM's kv_cache_report_mode "full" re-reporting a prefix-cache hit
    // (BlockPool.emit_cached_block_events), not new copies. No reference is added (one
    // BlockRemoved per block still removes it); the entries count as just stored for the caps.
    for (size_t i = 0; i < n; ++i) Touch(s, FindEngine(s, ekeys[i]), true);
    c->blocks_rereported += n;
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    if (i % kApplyChunk == 0) {
      // A long event never holds the lock for more than kApplyChunk blocks.
      if (i > 0 && !relock(false, 0)) return;
      // A table this chunk would overfill grows off the write lock (kApplyChunk); checked
      // here, under it, so the common chunk takes the lock once.
      const size_t room = std::min(n - i, kApplyChunk);
      if ((blocks_->NeedsGrow(room) || s->by_hash.NeedsGrow(room)) && !relock(true, room)) return;
      if (i == 0) {
        for (size_t k = 0; k < std::min(n, kStoreAhead); ++k) {
          blocks_->Prefetch(TagHash(keys[k]));
          s->by_hash.Prefetch(ekeys[k]);
        }
      }
    }
    // The tables' slots are random misses: load them kStoreAhead blocks ahead (a burst of a
    // whole chunk's 64 loads at its start left the first blocks waiting for all of them).
    if (i + kStoreAhead < n) {
      blocks_->PrefetchForInsert(TagHash(keys[i + kStoreAhead]));
      s->by_hash.PrefetchForInsert(ekeys[i + kStoreAhead]);
    }
    const uint64_t h = ekeys[i];
    const uint32_t block = FindOrAddBlock(keys[i]);
    const uint32_t h_lo = static_cast<uint32_t>(h), h_hi = static_cast<uint32_t>(h >> 32);
    auto [e, inserted] = s->by_hash.FindOrInsert(
        h, [h_lo, h_hi](const EngineSlot& x) { return x.hash_lo == h_lo && x.hash_hi == h_hi; },
        [&] { return EngineSlot::Make(h, block); });
    if (inserted) {
      ++engine_entries_;
    } else if (e->block() != block) {
      ++c->hash_rebound;
      DropEngineEntry(w, *e);  // the old block's references (may free its record)
      if (e->word & kRefsMany) s->overflow.erase(h);
      e->word = block;  // no tier held yet
    }
    // An engine entry must not point at a record without counting in it: if its reference
    // was not taken (the holder's count saturated) or the holder array could not be
    // allocated, the entry goes, and so does a record left without holders.
    bool keep = false;
    try {
      keep = AddEngineRef(w, s, e, tier) || !NoRefs(*e);
    } catch (...) {  // (AddEngineRef throws before it changes a count)
      if (NoRefs(*e)) EraseEngineEntry(s, e, !inserted);
      if ((*slab_)[block].holders.empty()) DropHolderRef(w, block, tier, 0);  // frees it
      throw;
    }
    if (!keep) {
      EraseEngineEntry(s, e, !inserted);
      continue;
    }
    Touch(s, e, !inserted);
    ++c->blocks_stored;
  }
  EnforceCaps(w);
}

uint64_t Index::RestoreEntries(WorkerId w, const WorkerEntry* entries, size_t n,
                               ApplyCounts* c) {
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

bool Index::HoldsAll(WorkerState* s, const BlockKey* keys, const uint64_t* ekeys, size_t n,
                     int tier) const {
  if (n == 0) return false;
  for (size_t i = 0; i < n; ++i) {
    const EngineSlot* e = FindEngine(s, ekeys[i]);
    if (e == nullptr || !e->held(tier) || (*slab_)[e->block()].key != keys[i]) return false;
  }
  return true;
}

void Index::PrepareRoom(WorkerId w, size_t extra) {
  // One grower at a time: two ingestion threads that both find the block table full would
  // otherwise both rehash it (the second copy thrown away), halving ingestion while it grows.
  std::lock_guard one_grower(grow_mu_);
  for (int attempt = 0; attempt < 3; ++attempt) {
    // Declared before the locks: the replaced tables are freed after the locks are gone.
    std::unique_ptr<BlockTable> blocks;
    std::unique_ptr<EngineTable> engine;
    uint64_t seen;
    {
      std::shared_lock read(mu_);
      WorkerState* s = State(w);
      const bool grow_blocks = blocks_->NeedsGrow(extra);
      const bool grow_engine = s != nullptr && s->by_hash.NeedsGrow(extra);
      if (!grow_blocks && !grow_engine) return;
      seen = version_;
      if (grow_blocks) {
        blocks = std::make_unique<BlockTable>();
        blocks_->GrowInto(extra, blocks.get());
      }
      if (grow_engine) {
        engine = std::make_unique<EngineTable>();
        s->by_hash.GrowInto(extra, engine.get());
      }
    }
    std::unique_lock write(mu_);
    if (version_ != seen) continue;  // a writer got in between: the copies are stale
    ++version_;
    if (blocks != nullptr) blocks_.swap(blocks);
    if (engine != nullptr) State(w)->by_hash.Swap(*engine);
    return;
  }
  // Writers kept getting in between: the chunk's inserts grow the tables under the lock.
}

void Index::StartStamps(WorkerState* s) {
  if (s->by_hash.has_side()) return;
  s->by_hash.EnableSide(static_cast<uint8_t>(s->epoch));
  if (!s->live) s->live = std::make_unique<std::array<uint32_t, 256>>();
  s->live->fill(0);
  (*s->live)[static_cast<uint8_t>(s->epoch)] = static_cast<uint32_t>(s->by_hash.size());
  s->epoch_fill = 0;
}

// Caps' approximate store order: stamp the entry with the current epoch.
void Index::TouchStamped(WorkerState* s, EngineSlot* e, bool existed) {
  const uint64_t per = opts_.max_blocks_per_worker, total = opts_.max_blocks_total;
  if (!s->by_hash.has_side()) {
    // The worker takes its stamps now (Touch found it near a cap: NearCapNoStamps; the order
    // only matters once a cap may evict): the entries stored so far share the oldest stamp,
    // this one included.
    StartStamps(s);
    existed = true;
  }
  uint8_t& stamp = s->by_hash.Side(e);
  std::array<uint32_t, 256>& live = *s->live;
  if (existed) --live[stamp];
  stamp = static_cast<uint8_t>(s->epoch);
  ++live[stamp];
  // ~200 epochs per table's worth of stores: an entry under cap pressure without re-stores
  // lives about `size` stores, so its age stays well below 256 epochs.
  const uint64_t len = std::max<uint64_t>(1, s->by_hash.size() / 192);
  // Stamps are 8 bits: an entry 256 epochs old would pass for a new one (many re-stores keep
  // entries alive that long). Once an entry reaches kClampAge (checked at each new epoch, once
  // the worker or the index is half-way to a cap), a
  // second hand walks the table kClampStep slots per store and moves entries older than
  // kClampAge to exactly kClampAge: a pass takes capacity / kClampStep stores, at most ~10
  // epochs at the tables' lowest load (60 %), so no entry gets past kClampAge + 20 < 256 (one
  // moved backwards across the hand by an erase waits one more pass). Entries that old share
  // the oldest stamp, and go first, instead of passing for new ones.
  constexpr size_t kClampStep = 32;
  constexpr uint32_t kClampAge = 224;
  if (++s->epoch_fill >= len) {
    ++s->epoch;
    s->epoch_fill = 0;
    // Only where a cap may evict soon (the order matters then): half-way to a cap.
    const bool near_cap = (per > 0 && s->by_hash.size() * 2 >= per) ||
                          (total > 0 && engine_entries_ * 2 >= total);
    s->clamping = false;
    for (uint32_t age = kClampAge; near_cap && age < 256 && !s->clamping; ++age) {
      s->clamping = live[static_cast<uint8_t>(s->epoch - age)] > 0;
    }
  }
  if (!s->clamping) return;
  const size_t cap = s->by_hash.slot_count();
  if (s->clamp_hand >= cap) s->clamp_hand = 0;
  for (size_t k = 0; k < kClampStep; ++k) {
    EngineSlot* x = s->by_hash.At(s->clamp_hand);
    if (!EngineTraits::Empty(*x)) {
      uint8_t& stamp = s->by_hash.Side(x);
      if (static_cast<uint8_t>(s->epoch - stamp) > kClampAge) {
        --live[stamp];
        stamp = static_cast<uint8_t>(s->epoch - kClampAge);
        ++live[stamp];
      }
    }
    if (++s->clamp_hand == cap) s->clamp_hand = 0;
  }
}

bool Index::EvictOldest(WorkerId w, WorkerState* s) {
  if (s->by_hash.empty()) return false;
  StartStamps(s);  // (a worker of the total cap's may have none yet: all entries equally old)
  // Eligible: the oldest stamps that together hold at least 1/256 of the entries (at least
  // one entry). The sweep takes the first eligible entry after the hand, so an eviction reads
  // ~256 slots however the entries spread over the stamps (one stamp for the oldest few
  // entries alone would make it read the whole table for each of them); the order is exact
  // to within that 1/256 of the entries, and exact for tables of fewer than 256 entries.
  const uint64_t want = std::max<uint64_t>(1, s->by_hash.size() / 256);
  uint64_t have = 0;
  uint32_t min_age = 256;
  for (uint32_t age = 255;; --age) {
    have += (*s->live)[static_cast<uint8_t>(s->epoch - age)];
    if (have >= want) {
      min_age = age;
      break;
    }
    if (age == 0) break;
  }
  if (min_age == 256) return false;  // (live counts say the table is empty)
  const size_t cap = s->by_hash.slot_count();
  if (s->hand >= cap) s->hand = 0;
  // At most kEvictScan slots per eviction (the lock is held): past that, the oldest entry the
  // sweep has seen goes instead.
  constexpr size_t kEvictScan = 4096;
  EngineSlot* victim = nullptr;
  uint32_t victim_age = 0;
  for (size_t scanned = 0; scanned < std::min(cap, kEvictScan); ++scanned) {
    EngineSlot* e = s->by_hash.At(s->hand);
    if (!EngineTraits::Empty(*e)) {
      const uint32_t age = static_cast<uint8_t>(s->epoch - s->by_hash.Side(e));
      if (age >= min_age) {
        victim = e;  // the next entry may move here on erase: the hand stays
        break;
      }
      if (victim == nullptr || age > victim_age) {
        victim = e;
        victim_age = age;
      }
    }
    if (++s->hand == cap) s->hand = 0;
  }
  if (victim == nullptr) return false;
  DropEngineEntry(w, *victim);
  EraseEngineEntry(s, victim);
  return true;
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
  BlockKeyStream stream(keys, n);
  FindMatches(&stream, out, now);
}

// The prefix walk of one FindMatches call: every worker's depth (contiguous matched blocks
// from the first) as the prompt's blocks go by, under the caller's shared locks.
//
// Run-length: consecutive blocks held by the same (worker, best tier) set (equal HolderSet run
// keys) form a run; the holders are touched once per run, when it ends (Flush), not once per
// block. A holder advances through a run iff it had matched every block before the run
// (depth == run start).
//
// Speculative credits move a worker's depth ahead, to the block where the credit ends. Inside
// a run only the run's members are at depth i, and they hold block i (real entries win over
// any credit starting there), so the run goes on without a credit lookup; the blocks where
// credits end are the exceptions (the credited worker may join or start a run there, or take
// a credit starting there), so the walk takes the general path at each. The ends are kept in
// ends_ (next_end_: the nearest past the block being walked); past kMaxEnds of them in one
// walk, runs are closed at every block up to the deepest credit (spec_horizon_).
//
// Look-ahead, in four stages, so that several blocks' misses are in flight while the walk
// inspects the current one: kSlotAhead blocks ahead, prefetch the block-table slot; kRecAhead
// ahead, probe it (by the 32-bit tag) and prefetch the record it names; kHeapAhead ahead,
// prefetch the shared holder array the record points to, if any (blocks of one run share it:
// a miss per run, not per block); at the block, check the record's whole key and walk.
//
// Record chains: the records of one BlockStored event are allocated in order (block_slab.h),
// so past two blocks whose records are adjacent, the next block's record is most likely the
// next one: its whole key is compared and the table probe skipped. Exact: a live record
// (holders not empty) is the only record of its key, and a free or unused one has no holders
// (the walk checks the key again at the block). While a chain holds, the table slots of the
// blocks ahead are not prefetched; when it breaks, those between the probe and the slot
// look-ahead are, at once.
class Index::PrefixWalk {
 public:
  PrefixWalk(const Index& ix, BlockKeyStream* stream, MatchResult* out, double now)
      : ix_(ix),
        stream_(stream),
        out_(out),
        n_(stream->size()),
        keys_(stream->data()),
        now_(now),
        table_(*ix.blocks_),
        slab_(*ix.slab_),
        any_spec_(!ix.spec_first_->empty()) {
    out->Reset(ix.workers_.size());
    depth_ = out->blocks.data();
    weighted_ = out->weighted.data();
    // Credit of a block by its holder's tier mask: GPU if held there, else the better of CPU
    // and disk.
    w_gpu_ = ix.opts_.tier_weights[0];
    for (int m = 0; m < 8; ++m) {
      tier_w_[m] = (m & 1) ? w_gpu_
                           : std::max((m & 2) ? ix.opts_.tier_weights[1] : 0.0,
                                      (m & 4) ? ix.opts_.tier_weights[2] : 0.0);
    }
  }

  void Run() {
    StartStages(0);
    size_t i = 0;
    for (; i < n_; ++i) {
      i = FollowChainedRun(i);
      AdvanceStages(i);
      const HolderSet* hs = HoldersOf(i);
      // Same holders as the previous block: the run goes on. A credit starting here could
      // not change the match: no credit ends here, so only the run's members are at depth i,
      // and they hold block i for real (real entries win).
      if (Quiet(i) && hs != nullptr && run_ != nullptr && hs->RunKey() == run_key_) continue;
      const InlineVec<CreditRef>* credits = CreditsStartingAt(i);
      Flush(i);  // depths are now exact up to block i
      if (hs != nullptr && hs->Any([&](WorkerId w) { return depth_[w] == i; })) {
        StartRun(hs, i);
        if (credits != nullptr) Flush(i + 1);  // exact depths at i + 1 before the credits
      }
      if (credits != nullptr) Credit(*credits, i);
      if (i >= next_end_) next_end_ = EndAfter(i);
      if (run_ == nullptr && !JumpToNextDepth(&i)) break;
    }
    Flush(i);
    out_->max_blocks = static_cast<uint32_t>(max_depth_);
  }

 private:
  static constexpr size_t kMaxEnds = 16;
  static constexpr size_t kSlotAhead = 32, kRecAhead = 16, kHeapAhead = 6, kRing = 32;
  static_assert(kHeapAhead < kRecAhead && kRecAhead < kSlotAhead && kRecAhead < kRing &&
                    (kRing & (kRing - 1)) == 0,
                "ring of candidates");

  // Whether block i is one no credit ends at (a run may go on through it).
  bool Quiet(size_t i) const { return ends_overflow_ ? i > spec_horizon_ : i < next_end_; }

  // The nearest credit end past block i (SIZE_MAX: none).
  size_t EndAfter(size_t i) const {
    size_t e = SIZE_MAX;
    for (size_t k = 0; k < num_ends_; ++k) {
      if (ends_[k] > i && ends_[k] < e) e = ends_[k];
    }
    return e;
  }

  // Keys hashed in the stream up to `upto` (it hashes while the loads are in flight).
  void Need(size_t upto) {
    if (upto > ready_ && ready_ < n_) {
      stream_->Need(upto);
      ready_ = stream_->ready();
    }
  }

  // The holders of the open run advance to end_block; the run closes.
  void Flush(size_t end_block) {
    if (run_ == nullptr) return;
    const double len = static_cast<double>(end_block - run_start_);
    run_->ForEach([&](WorkerId w, uint8_t mask) {
      if (depth_[w] != run_start_) return;
      depth_[w] = static_cast<uint32_t>(end_block);
      weighted_[w] += tier_w_[mask] * len;
      if (end_block > max_depth_) max_depth_ = end_block;
    });
    run_ = nullptr;
  }

  void StartRun(const HolderSet* hs, size_t i) {
    run_ = hs;
    run_key_ = hs->RunKey();
    run_start_ = i;
  }

  // The record after `rec` (slab index `idx`) if it is the record of `key`: in the same
  // chunk, live, with that key; then its lines two on are prefetched. Null otherwise.
  static const BlockRec* ChainNext(const BlockRec* rec, uint32_t idx, BlockKey key) {
    const BlockRec* r = rec + 1;
    if (((idx + 1) & (BlockSlab::kChunk - 1)) == 0 || r->key != key || r->holders.empty()) {
      return nullptr;
    }
    __builtin_prefetch(r + 8);
    return r;
  }

  // The probe stage for block j: the chain's next record, or a table probe by tag.
  void Probe(size_t j) {
    if (chained_) {
      if (const BlockRec* r = ChainNext(last_rec_, last_idx_, keys_[j])) {
        cand_[j & (kRing - 1)] = r;
        last_rec_ = r;
        ++last_idx_;
        return;
      }
      const size_t end = std::min(n_, j + (kSlotAhead - kRecAhead) + 1);  // (keys ready: Need)
      for (size_t k = j + 1; k < end; ++k) table_.Prefetch(TagHash(keys_[k]));
    }
    const uint32_t tag = Tag(keys_[j]);
    const BlockSlot* s =
        table_.Find(TagHash(keys_[j]), [tag](const BlockSlot& x) { return x.tag == tag; });
    const BlockRec* r = s == nullptr ? nullptr : &slab_[s->block];
    if (r != nullptr) __builtin_prefetch(r);
    cand_[j & (kRing - 1)] = r;
    chained_ = r != nullptr && last_rec_ != nullptr && last_idx_ + 1 == s->block;
    last_rec_ = r;
    last_idx_ = r == nullptr ? kNone : s->block;
  }

  void PrefetchHolders(size_t j) const {
    const BlockRec* r = cand_[j & (kRing - 1)];
    if (r != nullptr) r->holders.PrefetchHolders();
  }

  // Fills the look-ahead stages for a walk that (re)starts at block `from`.
  void StartStages(size_t from) {
    chained_ = false;
    last_rec_ = nullptr;
    last_idx_ = kNone;
    Need(from + kSlotAhead + 1);
    for (size_t k = from; k < std::min(from + kSlotAhead, n_); ++k) {
      table_.Prefetch(TagHash(keys_[k]));
    }
    for (size_t k = from; k < std::min(from + kRecAhead, n_); ++k) Probe(k);
    for (size_t k = from; k < std::min(from + kHeapAhead, n_); ++k) PrefetchHolders(k);
  }

  // Moves every look-ahead stage on by one block, for block i.
  void AdvanceStages(size_t i) {
    Need(i + kSlotAhead + 1);
    if (i + kSlotAhead < n_ && !chained_) table_.Prefetch(TagHash(keys_[i + kSlotAhead]));
    if (i + kRecAhead < n_) Probe(i + kRecAhead);
    if (i + kHeapAhead < n_) PrefetchHolders(i + kHeapAhead);
  }

  // The common case, in a loop of its own with its state in registers: a run is open past
  // every credit, the probe stage follows a chain of records and the block kRecAhead on is the
  // chain's next record, and block i's record has the run's key. Then only the probe stage
  // moves on (the same steps as Probe's chain branch) and the holder look-ahead; everything
  // else is what the general path would find. Returns the first block where any of that
  // fails (i itself if none applies), which the general path then takes.
  size_t FollowChainedRun(size_t i) {
    if (run_ == nullptr || !chained_ || !Quiet(i) || i + kSlotAhead >= ready_) return i;
    // Keys ready up to the slot look-ahead, and not past the nearest credit end.
    const size_t stop = std::min(ready_ - kSlotAhead, ends_overflow_ ? SIZE_MAX : next_end_);
    // Locals, not members: the stores into cand would otherwise reload every member.
    const BlockKey* const keys = keys_;
    const BlockRec** const cand = cand_;
    const uint64_t rk = run_key_;
    const BlockRec* lr = last_rec_;
    uint32_t li = last_idx_;
    size_t k = i;
    for (; k < stop; ++k) {
      const BlockRec* rec = cand[k & (kRing - 1)];
      if (rec == nullptr || rec->key != keys[k] || rec->holders.RunKey() != rk) break;
      const BlockRec* r = ChainNext(lr, li, keys[k + kRecAhead]);
      if (r == nullptr) break;
      cand[(k + kRecAhead) & (kRing - 1)] = r;
      lr = r;
      ++li;
      if (const BlockRec* h = cand[(k + kHeapAhead) & (kRing - 1)]) h->holders.PrefetchHolders();
    }
    last_rec_ = lr;
    last_idx_ = li;
    return k;  // < stop < n: the general path takes block k
  }

  // Block i's holders (null: no worker holds it), checking the whole key.
  const HolderSet* HoldersOf(size_t i) const {
    const BlockRec* rec = cand_[i & (kRing - 1)];
    if (rec != nullptr && rec->key != keys_[i]) {  // tags collided
      const uint32_t b = ix_.FindBlock(keys_[i]);
      rec = b == kNone ? nullptr : &slab_[b];
    }
    return rec == nullptr ? nullptr : &rec->holders;
  }

  const InlineVec<CreditRef>* CreditsStartingAt(size_t i) const {
    if (!any_spec_) return nullptr;
    auto it = ix_.spec_first_->find(keys_[i]);
    return it == ix_.spec_first_->end() ? nullptr : &it->second;
  }

  // Speculative blocks are about to be computed on the GPU: credited like GPU blocks, for as
  // long as the prompt's keys follow the credit's (not for workers that hold block i). A
  // worker with several credits starting at block i (equal first keys) gets the longest. Out
  // of line: the walk's loop stays as tight as without credits.
  __attribute__((noinline)) void Credit(const InlineVec<CreditRef>& runs, size_t i) {
    std::vector<std::pair<WorkerId, size_t>> credited;  // worker, blocks credited from i
    for (const CreditRef& r : runs) {
      if (r.run->expiry <= now_) continue;
      size_t prev = 0;
      for (const auto& c : credited) {
        if (c.first == r.worker) prev = c.second;
      }
      uint32_t& d = depth_[r.worker];
      if (d != i + prev) continue;
      const std::vector<BlockKey>& rk = r.run->keys;
      Need(i + rk.size());
      size_t m = 0;
      while (m < rk.size() && i + m < n_ && rk[m] == keys_[i + m]) ++m;
      if (m <= prev) continue;
      d += static_cast<uint32_t>(m - prev);
      weighted_[r.worker] += w_gpu_ * static_cast<double>(m - prev);
      max_depth_ = std::max(max_depth_, i + m);
      spec_horizon_ = std::max(spec_horizon_, i + m);
      if (num_ends_ < kMaxEnds) {
        ends_[num_ends_++] = static_cast<uint32_t>(i + m);
      } else {
        ends_overflow_ = true;
      }
      next_end_ = std::min(next_end_, i + m);
      if (prev == 0) {
        credited.emplace_back(r.worker, m);
      } else {
        for (auto& c : credited) {
          if (c.first == r.worker) c.second = m;
        }
      }
    }
  }

  // No run open after block *i. If no worker holds block *i, the match ends (false).
  // Otherwise only credits reach past it (a flush sets depths up to *i + 1 at most), and
  // nothing happens at a block no worker is at, so the walk goes on at the nearest depth
  // past *i, not through the credited blocks: *i becomes the block before it (or n).
  bool JumpToNextDepth(size_t* i) {
    if (max_depth_ <= *i) return false;
    size_t next = max_depth_;
    for (size_t w = 0; w < out_->blocks.size(); ++w) {
      if (depth_[w] > *i && depth_[w] < next) next = depth_[w];
    }
    if (next >= n_) {
      *i = n_;  // credited to the prompt's end
      return false;
    }
    if (next > *i + 1) {
      StartStages(next);
      *i = next - 1;
      next_end_ = EndAfter(*i);
    }
    return true;
  }

  const Index& ix_;
  BlockKeyStream* const stream_;
  MatchResult* const out_;
  const size_t n_;
  const BlockKey* const keys_;
  const double now_;
  const BlockTable& table_;
  const BlockSlab& slab_;
  const bool any_spec_;
  uint32_t* depth_ = nullptr;
  double* weighted_ = nullptr;
  double w_gpu_ = 1.0;
  double tier_w_[8];
  size_t max_depth_ = 0;  // deepest any worker has reached so far
  size_t ready_ = 0;      // keys ready in the stream
  // The open run: its holders (null = none), its first block's run key, its first block.
  const HolderSet* run_ = nullptr;
  uint64_t run_key_ = 0;
  size_t run_start_ = 0;
  // Where credits end (see the class comment).
  uint32_t ends_[kMaxEnds];
  size_t num_ends_ = 0;
  bool ends_overflow_ = false;
  size_t next_end_ = SIZE_MAX;
  size_t spec_horizon_ = 0;
  // The look-ahead: the record block j's tag names (null: none), by j mod kRing; the probe
  // stage's last record, its slab index, and whether it was the record after the one before.
  const BlockRec* cand_[kRing];
  const BlockRec* last_rec_ = nullptr;
  uint32_t last_idx_ = kNone;
  bool chained_ = false;
};

void Index::FindMatches(BlockKeyStream* stream, MatchResult* out, double now) const {
  std::shared_lock lock(mu_);
  std::shared_lock spec_lock(spec_mu_);
  PrefixWalk(*this, stream, out, now < 0 ? last_now_ : now).Run();
}

void Index::UnlinkCredit(const SpecCredit* run) {
  spec_entries_ -= run->keys.size();
  auto it = spec_first_->find(run->keys.front());
  if (it == spec_first_->end()) return;
  InlineVec<CreditRef>& refs = it.value();
  for (CreditRef& r : refs) {
    if (r.run == run) {
      refs.Erase(&r);
      break;
    }
  }
  if (refs.size() == 0) spec_first_->erase(it);
}

void Index::DropSpecLocked(WorkerId w) {
  for (auto& run : credits_) {
    if (run != nullptr && run->worker == w) {
      UnlinkCredit(run.get());
      run.reset();  // the deque slot is popped by PopOldestCredit
    }
  }
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second->worker == w) {
      UnlinkCredit(it->second.get());
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
}

bool Index::PopOldestCredit() {
  if (credits_.empty()) {  // only held credits left: the one held longest goes
    if (held_.empty()) return false;
    UnlinkCredit(held_.begin()->second.get());
    held_.erase(held_.begin());
    return true;
  }
  const SpecCredit* run = credits_.front().get();
  if (run != nullptr) UnlinkCredit(run);
  credits_.pop_front();
  return run != nullptr;
}

void Index::ExpireLocked(double now) {
  while (!credits_.empty() && (credits_.front() == nullptr || credits_.front()->expiry <= now)) {
    PopOldestCredit();
  }
}

uint64_t Index::AddSpeculative(WorkerId w, const BlockKey* keys, size_t n, double now,
                               double ttl, bool hold) {
  std::unique_lock lock(spec_mu_);  // not mu_: never waits for an event being applied
  if (now > last_now_) last_now_ = now;
  ExpireLocked(now);
  if (w >= spec_alive_.size() || !spec_alive_[w] || !(ttl > 0) || n == 0) return 0;
  if (const uint64_t cap = opts_.max_speculative_blocks; cap > 0) {
    n = static_cast<size_t>(std::min<uint64_t>(n, cap));
    // The oldest first: runs are in insertion order (with one ttl, the Router's, expiry
    // order); held credits only when no other is left.
    while (spec_entries_ + n > cap && (!credits_.empty() || !held_.empty())) {
      spec_dropped_ += PopOldestCredit();
    }
  }
  auto run = std::make_unique<SpecCredit>();
  run->worker = w;
  run->expiry = hold ? std::numeric_limits<double>::infinity() : now + ttl;
  run->keys.assign(keys, keys + n);
  (*spec_first_)[keys[0]].Push(CreditRef{w, run.get()});
  spec_entries_ += n;
  const uint64_t id = next_credit_id_++;
  if (hold) {
    held_.emplace(id, std::move(run));
  } else {
    credits_.push_back(std::move(run));
  }
  return id;
}

bool Index::ReleaseSpeculative(uint64_t id, double ttl) {
  std::unique_lock lock(spec_mu_);
  auto it = held_.find(id);
  if (it == held_.end()) return false;
  it->second->expiry = last_now_ + ttl;
  credits_.push_back(std::move(it->second));
  held_.erase(it);
  return true;
}

void Index::ExpireSpeculative(double now) {
  std::unique_lock lock(spec_mu_);
  if (now > last_now_) last_now_ = now;
  ExpireLocked(now);
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
    auto clamp = [&](int t) { return static_cast<uint16_t>(std::min<uint32_t>(Refs(s, e, t), 0xFFFF)); };
    out.push_back({EngineHash{0, Unfmix64(e.hash())}, (*slab_)[e.block()].key, {clamp(0), clamp(1), clamp(2)}});
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
  uint64_t bytes = blocks_->bytes() + slab_->bytes() +
                   static_cast<uint64_t>(heap_holder_bytes_) + holder_pool_.TableBytes();
  for (const auto& s : workers_) {
    if (s == nullptr) continue;
    bytes += sizeof(WorkerState) + s->by_hash.bytes();
    bytes += s->overflow.bucket_count() * (sizeof(std::pair<uint64_t, std::array<uint32_t, kNumMedia>>) + 8);
  }
  std::shared_lock spec(spec_mu_);
  bytes += spec_first_->bucket_count() * (sizeof(std::pair<BlockKey, InlineVec<CreditRef>>) + 8);
  bytes += spec_entries_ * sizeof(BlockKey) + (credits_.size() + held_.size()) * sizeof(SpecCredit);
  return bytes;
}

}  // namespace kvroute
