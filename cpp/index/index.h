// KV block index: which worker holds which block key, on which storage tier.
//
// Thread safety: every public method may be called from any thread at any time. One
// reader-writer lock guards the index's tables. Readers (FindMatches) hold it shared for one
// lookup. Writers hold it exclusively for ONE event (Apply), never for a whole batch, so
// ingestion cannot stall a lookup for longer than the largest event takes to apply (bounded
// by DecodeLimits::max_blocks_per_event). Speculative credits have a lock of their own
// (AddSpeculative never waits for an event). The caller serialises the events of one worker
// (the ingestion thread that owns that worker's socket does so by construction);
// events of different workers may be applied concurrently.
//
// Data layout (README.md has the sizes):
//   slab_        : record index -> {block key, HolderSet (worker + per-tier counts)}  16 B
//   blocks_      : block key -> record index                                           8 B slots
//   workers_[w]  : engine block hash -> {record index, tiers held}                    12 B slots
//                  (+ 1 B per slot of cap stamps once the worker nears a cap)
//   spec_first_  : first block key of a speculative credit -> runs (worker, expiry, keys)
// The engine tables resolve parent_block_hash and BlockRemoved; the block table answers
// prefix matches. Both refer to a block by its record, so its key is stored once. Reference counts are kept per (worker, engine hash, tier) because engines
// may store the same block twice and GPU/CPU tiers report separately (docs/kv-events.md §6).
#pragma once

#include <tsl/robin_map.h>

#include <array>
#include <deque>
#include <map>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "common/block_key.h"
#include "common/types.h"
#include "common/event.h"
#include "index/block_slab.h"
#include "index/holder_set.h"
#include "index/robin_table.h"
#include "index/inline_vec.h"

namespace kvroute {

struct IndexOptions {
  int64_t block_size = 16;
  // Credit of one matched block by the best tier that holds it (GPU, CPU, disk).
  std::array<double, kNumMedia> tier_weights{1.0, 0.8, 0.25};
  // Caps on indexed engine hashes (0 = none). Past a cap the least recently stored entries
  // are dropped first, approximately (README.md: "Memory caps"; of this worker; for the total
  // cap, of the largest worker), counted per worker (WorkerEvictedByCap).
  uint64_t max_blocks_per_worker = uint64_t{1} << 22;  // 64Mi tokens at block size 16
  uint64_t max_blocks_total = uint64_t{1} << 25;
  // A cap of at most this many entries orders entries from their first store; a larger one
  // only from half-way to it (the entries stored before then leave first, in table order
  // among themselves), so a worker far from a large cap spends no byte per entry on order.
  uint64_t order_from_start_below = uint64_t{1} << 20;
  // Cap on the blocks of live speculative credits (0 = none): past it, the credits given
  // longest ago (the nearest to expiry) are dropped first, and a credit longer than the cap
  // keeps its first max_speculative_blocks blocks. Bounds the credits' memory (8 B of key a
  // block, plus ~100 B a credit by its structures' sizes) when decisions x speculative_ttl x unmatched blocks grow large.
  uint64_t max_speculative_blocks = uint64_t{1} << 22;
};

// Per-worker result of a prefix match, indexed by WorkerId (size = Index::WorkerIdLimit()).
struct MatchResult {
  std::vector<uint32_t> blocks;    // contiguous matched blocks from the first block
  std::vector<double> weighted;    // sum of tier weights over those blocks
  uint32_t max_blocks = 0;         // max over workers of blocks
  void Reset(size_t n) {
    blocks.assign(n, 0);
    weighted.assign(n, 0.0);
    max_blocks = 0;
  }
};

class Index {
 public:
  // BlockStored and BlockRemoved events are applied in chunks of this many blocks, the lock
  // released between them, so a lookup usually waits for at most one chunk. A table that the
  // next chunk would push past its load limit is grown before the chunk, under the shared
  // lock (lookups go on reading the old table; writers wait), and swapped in under the
  // exclusive lock in O(1) (growing the tables of 1.45M blocks takes ~58 ms, which lookups
  // would otherwise wait for). Still whole under the exclusive lock, and rare:
  // AllBlocksCleared / a reset / RemoveWorker (every block of that worker).
  static constexpr size_t kApplyChunk = 32;
  // KV-cache group indices an index tells apart (WorkerState::other_groups); a group at or
  // past it is treated as full attention.
  static constexpr int64_t kMaxTrackedGroups = 1024;

  explicit Index(IndexOptions opts);
  ~Index();
  Index(const Index&) = delete;
  Index& operator=(const Index&) = delete;

  const IndexOptions& options() const { return opts_; }

  // Registers a worker and returns its id (never reused).
  WorkerId AddWorker();
  // Drops everything the worker holds, speculative credits included. Unknown id: no-op.
  void RemoveWorker(WorkerId w);
  // AllBlocksCleared: drops every block of `w` (speculative credits are kept until expiry).
  void ClearWorker(WorkerId w);

  // Applies one decoded event of worker `w`. Bad or unresolvable parts are counted in `c`.
  void Apply(WorkerId w, const Event& ev, ApplyCounts* c);

  // For each worker, the longest contiguous prefix of `keys` it holds (speculative credits
  // unexpired at `now` count as GPU blocks; now < 0: the latest clock value seen). Stops at
  // the first block no worker can extend. O(matched blocks x holders per block), shared lock.
  void FindMatches(const BlockKey* keys, size_t n, MatchResult* out, double now = -1) const;
  // The same over keys computed as the walk reaches them: on return, `keys` holds at least
  // the blocks walked plus the look-ahead (Need(size()) for the rest).
  void FindMatches(BlockKeyStream* keys, MatchResult* out, double now = -1) const;

  // Credits `w` with `keys` (the blocks it is about to compute) until `now + ttl` seconds.
  // O(1) table work plus a copy of `keys`. A BlockStored of the same blocks on `w` makes them
  // permanent (real entries win the match); credits past their expiry stop counting at once
  // and are dropped on the next call. REQUIRES: one clock, non-decreasing.
  // With `hold`, the credit does not expire until ReleaseSpeculative(returned id) starts its
  // ttl (a request queued on its worker has not computed its blocks yet, however long it
  // waits); returns the credit's id (0: no credit, for n = 0, ttl <= 0 or a removed worker).
  // O(log held credits) more.
  uint64_t AddSpeculative(WorkerId w, const BlockKey* keys, size_t n, double now, double ttl,
                          bool hold = false);
  // Starts the ttl of a held credit at the latest clock value AddSpeculative or
  // ExpireSpeculative saw: it expires at that + `ttl`. Unknown
  // or already released id (dropped by the cap, removed worker): no-op, false.
  bool ReleaseSpeculative(uint64_t id, double ttl);
  void ExpireSpeculative(double now);

  // Every engine hash the worker holds, with its block key and per-tier reference counts
  // (GPU, CPU, disk). For tests and debugging: O(blocks of the worker), shared lock.
  struct WorkerEntry {
    EngineHash hash;
    BlockKey key;
    std::array<uint16_t, kNumMedia> refs;
  };
  std::vector<WorkerEntry> WorkerEntries(WorkerId w) const;
  // Adds entries as WorkerEntries lists them (a peer's snapshot of the worker): each engine
  // hash bound to its block key with refs[t] references on tier t, as if stored by events.
  // An engine hash already held with another key is rebound (hash_rebound). Takes the lock
  // exclusively per kRestoreChunk entries; caps apply. Unknown worker: no-op. Returns the
  // entries added (those with at least one reference counted).
  static constexpr size_t kRestoreChunk = 4096;
  uint64_t RestoreEntries(WorkerId w, const WorkerEntry* entries, size_t n, ApplyCounts* c);

  // Ids handed out so far (an upper bound for MatchResult indexing).
  WorkerId WorkerIdLimit() const;
  // Engine hashes held by the worker (0 for an unknown worker).
  uint64_t WorkerBlocks(WorkerId w) const;
  // Entries of the worker dropped to keep under a memory cap (0 for an unknown worker).
  uint64_t WorkerEvictedByCap(WorkerId w) const;
  uint64_t DistinctKeys() const;     // distinct block keys indexed (any worker)
  uint64_t Entries() const;          // (block key, worker) pairs indexed
  uint64_t SpeculativeEntries() const;
  uint64_t SpeculativeHeld() const;     // held credits not yet released
  uint64_t SpeculativeDropped() const;  // credits dropped before expiry by the cap
  uint64_t MemoryBytes() const;      // estimated bytes held by the tables

 private:
  class PrefixWalk;  // FindMatches' walk (index_match.cc)
  // A speculative credit: the run of blocks one decision is about to compute on `worker`
  // (the prompt's keys from the worker's matched depth on), kept whole so a decision costs
  // one table insert, whatever the prompt's length.
  struct SpecCredit {
    WorkerId worker;
    double expiry;  // seconds, on the caller's clock (+inf while held)
    std::vector<BlockKey> keys;
  };
  struct CreditRef {
    WorkerId worker;
    SpecCredit* run;
  };
  static constexpr uint32_t kNone = BlockSlab::kNone;
  // What both tables share: grown x1.5 past 90 % load (60-90 % full: README.md has what the
  // load costs in memory and insert work), and a slot whose record index is kNone (0) is
  // empty, so an all-zero slot is.
  struct TableTraits {
    static constexpr size_t kMaxLoadPercent = 90;
    static constexpr size_t kGrowthPercent = 150;
    static constexpr bool kEmptyIsZero = true;
    template <typename Slot>
    static bool Empty(const Slot& s) { return s.block == kNone; }
    template <typename Slot>
    static Slot EmptySlot() { return Slot{}; }
  };

  // Block table slot: the top 32 bits of the block key (its home and a filter) and the
  // index of its record in slab_, which has the whole key. Empty: block == kNone.
  struct BlockSlot {
    uint32_t tag;
    uint32_t block;
  };
  struct BlockTraits : TableTraits {
    using Slot = BlockSlot;
    static bool Empty(const Slot& s) { return TableTraits::Empty(s); }
    static Slot EmptySlot() { return TableTraits::EmptySlot<Slot>(); }
    static uint64_t HomeHash(const Slot& s) { return uint64_t{s.tag} << 32; }
  };
  using BlockTable = RobinTable<BlockTraits>;
  static uint32_t Tag(BlockKey k) { return static_cast<uint32_t>(k >> 32); }
  static uint64_t TagHash(BlockKey k) { return k & 0xFFFFFFFF00000000ull; }

  // Engine table slot, one per engine hash a worker holds: 12 bytes, 4-byte aligned (the
  // 64-bit key in two halves). `hash` is EngineKey() of the engine hash: fmix64 of the int,
  // or of a 64-bit fold of a bin (bins are kept as 64-bit digests: two of one worker's bins
  // collide with probability 2^-64 per pair), so its top bits are the home. `word`: the
  // record in slab_ (low kRecBits bits; kNone = empty slot), one bit per tier (GPU, CPU,
  // disk) that the worker stored it on and has not removed, and kRefsMany: some tier holds
  // it more than once (the same engine hash stored twice without a remove, as two requests
  // that filled the same block at once make vLLM do), its exact counts then in
  // WorkerState::overflow. The caps' store stamps live in the table's side bytes.
  struct EngineSlot {
    uint32_t hash_lo, hash_hi;
    uint32_t word;
    uint64_t hash() const { return uint64_t{hash_hi} << 32 | hash_lo; }
    uint32_t block() const { return word & kRecMask; }
    void set_block(uint32_t b) { word = (word & ~kRecMask) | b; }
    bool held(int tier) const { return (word >> (kRecBits + tier)) & 1u; }
    static EngineSlot Make(uint64_t h, uint32_t b) {
      return EngineSlot{static_cast<uint32_t>(h), static_cast<uint32_t>(h >> 32), b};
    }
  };
  static constexpr uint32_t kRecBits = BlockSlab::kIndexBits;  // 28
  static constexpr uint32_t kRecMask = (1u << kRecBits) - 1;
  static constexpr uint32_t kTierBit0 = 1u << kRecBits;       // GPU; CPU, disk above it
  static constexpr uint32_t kTierBits = 7u << kRecBits;
  static constexpr uint32_t kRefsMany = 1u << 31;
  static_assert(kRecBits + kNumMedia + 1 == 32, "record, tier bits and kRefsMany fill a word");
  static_assert(sizeof(EngineSlot) == 12, "an engine slot should stay 12 bytes");
  struct EngineTraits : TableTraits {
    using Slot = EngineSlot;
    static bool Empty(const Slot& s) { return (s.word & kRecMask) == kNone; }
    static Slot EmptySlot() { return Slot{}; }
    static uint64_t HomeHash(const Slot& s) { return s.hash(); }
  };
  using EngineTable = RobinTable<EngineTraits>;
  static uint64_t EngineKey(const EngineHash& h) {
    return Fmix64(h.hi == 0 ? h.lo : h.lo ^ Fmix64(h.hi));
  }

  struct WorkerState {
    EngineTable by_hash;
    bool alive = true;
    uint64_t evicted_by_cap = 0;
    // Caps' store order, approximate and queue-free: each store stamps its entry with the
    // current epoch (mod 256); an epoch lasts max(1, size / 192) stores; `live` counts
    // entries per stamp; eviction takes an entry among the oldest stamps, found by a sweep
    // of the table from `hand`; `clamp_hand` keeps every entry younger than 256 epochs
    // (README.md: "Memory caps"). The stamps are by_hash's side bytes, taken once the worker
    // or the index is half-way to a cap (StartStamps): the entries stored before all get the
    // oldest stamp, so until then the order costs no memory.
    uint32_t epoch = 0;
    uint64_t epoch_fill = 0;
    size_t hand = 0;
    size_t clamp_hand = 0;
    bool clamping = false;  // some entry is kClampAge epochs old (Touch)
    // Allocated by StartStamps (1 KB a worker otherwise spent by every worker far from caps).
    std::unique_ptr<std::array<uint32_t, 256>> live;
    // other_groups[g] != 0: KV-cache group g published a spec kind that is not indexed (a
    // hybrid model's sliding-window or Mamba group): its BlockRemoved events are not applied.
    // Set and reset by the group's stores (a group has one kind: its last store's); group
    // indices below kMaxTrackedGroups; kept across clears (a property of the model).
    std::vector<uint8_t> other_groups;
    // Exact per-tier counts of the engine hashes flagged kRefsMany, by engine key.
    tsl::robin_map<uint64_t, std::array<uint32_t, kNumMedia>> overflow;
  };

  bool caps() const { return opts_.max_blocks_per_worker > 0 || opts_.max_blocks_total > 0; }
  uint32_t FindBlock(BlockKey key) const;
  static EngineSlot* FindEngine(WorkerState* s, uint64_t engine_key) {
    const uint32_t lo = static_cast<uint32_t>(engine_key), hi = static_cast<uint32_t>(engine_key >> 32);
    return s->by_hash.Find(engine_key, [lo, hi](const EngineSlot& x) { return x.hash_lo == lo && x.hash_hi == hi; });
  }
  uint32_t FindOrAddBlock(BlockKey key);
  // Whether s holds every engine key ekeys[i] on `tier`, bound to block key keys[i].
  bool HoldsAll(WorkerState* s, const BlockKey* keys, const uint64_t* ekeys, size_t n,
                int tier) const;
  // Inline, as are AddEngineRef's first case and HolderSet::AddRef's common one: a store
  // from empty tables then makes no call (three calls per block cost ~10 % of such stores).
  bool AddHolderRef(WorkerId w, uint32_t block, int tier) {
    bool new_holder;
    int64_t heap;
    const bool ok = (*slab_)[block].holders.AddRef(holder_pool_, w, tier, &new_holder, &heap);
    heap_holder_bytes_ += heap;
    if (new_holder) ++entries_;
    return ok;
  }
  void DropHolderRef(WorkerId w, uint32_t block, int tier, uint32_t n);
  static uint32_t Refs(const WorkerState* s, const EngineSlot& e, int tier);
  static bool NoRefs(const EngineSlot& e) { return (e.word & kTierBits) == 0; }
  // False if not counted (the holder's count is saturated).
  bool AddEngineRef(WorkerId w, WorkerState* s, EngineSlot* e, int tier) {
    const uint32_t bit = kTierBit0 << tier;
    if (e->word & (bit | kRefsMany)) return AddEngineRefMore(w, s, e, tier);
    if (!AddHolderRef(w, e->block(), tier)) return false;  // the first reference on `tier`
    e->word |= bit;
    return true;
  }
  // AddEngineRef once the tier is held or some tier holds the engine hash more than once.
  bool AddEngineRefMore(WorkerId w, WorkerState* s, EngineSlot* e, int tier);
  // One reference fewer on `tier` (REQUIRES: one left); true if it was the last.
  static bool DropEngineRef(WorkerState* s, EngineSlot* e, int tier);
  void DropEngineEntry(WorkerId w, const EngineSlot& e);
  // Erases the slot; `stamped`: its stamp is counted in the caps' live counts (it was
  // Touch()ed).
  void EraseEngineEntry(WorkerState* s, EngineSlot* e, bool stamped = true);
  void ClearLocked(WorkerId w);
  // Makes room for `extra` more entries in the block table and w's engine table, rehashing
  // under the shared lock (see kApplyChunk). Call without holding mu_.
  void PrepareRoom(WorkerId w, size_t extra);
  void Touch(WorkerState* s, EngineSlot* e, bool existed) {
    if (!caps() || (!s->by_hash.has_side() && !NearCapNoStamps(s))) return;  // (most stores)
    TouchStamped(s, e, existed);
  }
  // Touch() once the entry gets a stamp: the worker has stamps, or it takes them now.
  void TouchStamped(WorkerState* s, EngineSlot* e, bool existed);
  // Whether a worker without stamps takes them (Touch): half-way to a cap, or under small
  // caps (IndexOptions::order_from_start_below) from the first store (their side bytes are
  // small, and every entry's order stays as exact as the stamps make it).
  bool NearCapNoStamps(const WorkerState* s) const {
    const uint64_t per = opts_.max_blocks_per_worker, total = opts_.max_blocks_total;
    const uint64_t small = opts_.order_from_start_below;
    return (per > 0 && (per <= small || s->by_hash.size() * 2 >= per)) ||
           (total > 0 && (total <= small || engine_entries_ * 2 >= total));
  }
  // Gives the worker's entries stamps (all the current epoch, the oldest from now on) if it
  // has none.
  static void StartStamps(WorkerState* s);
  bool EvictOldest(WorkerId w, WorkerState* s);
  void EnforceCaps(WorkerId w);
  void DropSpecLocked(WorkerId w);
  void ExpireLocked(double now);
  // Takes `run` out of spec_first_ and its blocks out of spec_entries_.
  void UnlinkCredit(const SpecCredit* run);
  // Pops credits_'s oldest slot (REQUIRES: not empty), unlinking its run unless
  // DropSpecLocked did; true if it held one.
  bool PopOldestCredit();
  WorkerState* State(WorkerId w);

  IndexOptions opts_;
  mutable std::shared_mutex mu_;
  // Bumped by every exclusive section that may change the tables (PrepareRoom checks that
  // nothing changed between its rehash under the shared lock and its swap).
  uint64_t version_ = 0;
  std::mutex grow_mu_;  // PrepareRoom: one grower at a time (taken before mu_, never inside it)
  std::unique_ptr<BlockSlab> slab_;
  std::unique_ptr<BlockTable> blocks_;
  // Speculative credits, apart from blocks_: small and hot, so a decision's inserts and their
  // expiry never miss the cache of the big map.
  // Speculative credits in insertion (= expiry) order, and their first key -> runs. FindMatches
  // ignores runs past their expiry; AddSpeculative pops them.
  // Guarded by spec_mu_, a lock of their own, so that a decision's credit never waits for an
  // event being applied (mu_ is taken exclusively between the ingestion thread's chunks; a
  // credit under mu_ put select p90 at 34.0-47.8 µs while 1M blocks/s streamed in, against
  // 20.6-22.2 under its own lock: bench_mixed.py --speculative-ttl 2, benchmarks/README.md).
  // Order: mu_ before spec_mu_ (FindMatches, RemoveWorker); AddSpeculative takes spec_mu_
  // alone, and knows live workers from spec_alive_ (one byte per id handed out).
  mutable std::shared_mutex spec_mu_;
  std::vector<uint8_t> spec_alive_;
  std::deque<std::unique_ptr<SpecCredit>> credits_;
  // Held credits (AddSpeculative with hold) by id, ids in issue order; released ones move to
  // the back of credits_ with expiry last_now_ + ttl (so credits_ stays in expiry order for
  // one ttl).
  std::map<uint64_t, std::unique_ptr<SpecCredit>> held_;
  uint64_t next_credit_id_ = 1;
  std::unique_ptr<tsl::robin_map<BlockKey, InlineVec<CreditRef>, BlockKeyHasher>> spec_first_;
  double last_now_ = -1e300;  // latest clock value seen (FindMatches compares against it)
  std::vector<std::unique_ptr<WorkerState>> workers_;
  uint64_t entries_ = 0;
  uint64_t engine_entries_ = 0;  // sum of by_hash sizes
  uint64_t spec_entries_ = 0;
  uint64_t spec_dropped_ = 0;  // credits dropped by max_speculative_blocks
  int64_t heap_holder_bytes_ = 0;  // shared holder arrays (holder_pool_'s), each once
  HolderPool holder_pool_;
};

}  // namespace kvroute
