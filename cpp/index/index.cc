// Index (index.h), events in: construction, workers, the two levels of references (engine
// hash -> block record -> holders), Apply of one event, table growth off the write lock
// (PrepareRoom) and the memory caps' approximate store order and eviction. The lookups are in
// index_match.cc, the snapshot and counters in index_snapshot.cc.
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
      slab_(std::make_unique<BlockSlab>()),
      blocks_(std::make_unique<BlockTable>()),
      spec_first_(
          std::make_unique<tsl::robin_map<BlockKey, InlineVec<CreditRef>, BlockKeyHasher>>()) {
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
      [&] {
        return BlockSlot{tag, slab_->Alloc(key)};
      });
  return s->block;
}

void Index::DropHolderRef(WorkerId w, uint32_t block, int tier, uint32_t n) {
  BlockRec& rec = (*slab_)[block];
  int64_t heap;
  if (rec.holders.DropRef(holder_pool_, w, tier, n, &heap)) --entries_;
  heap_holder_bytes_ += heap;
  if (!rec.holders.empty()) return;
  // No holder left: the block leaves the table and its record goes back to the slab.
  BlockSlot* s =
      blocks_->Find(TagHash(rec.key), [&](const BlockSlot& x) { return x.block == block; });
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
    if (!placeholder &&
        ev.token_ids.size() != ev.block_hashes.size() * static_cast<uint64_t>(opts_.block_size)) {
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
    const bool near_cap =
        (per > 0 && s->by_hash.size() * 2 >= per) || (total > 0 && engine_entries_ * 2 >= total);
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

}  // namespace kvroute
