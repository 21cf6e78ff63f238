// RobinTable: the index's hash tables, open addressing built for random misses and small
// slots.
//
//   BlockTable   : block key tag  -> block record index (block_slab.h)      8-byte slots
//   EngineTable  : engine hash    -> block record index, tier refs         12-byte slots
//                  (+ a 1-byte side array of cap stamps, once a worker nears a cap)
//
// Why not tsl::robin_map: a lookup of an 8K-token prompt probes ~500 random slots of a table
// far larger than the caches, and a BlockStored event inserts into two tables at random; the
// time goes to those misses. This table can say where a key lives before looking
// (`Prefetch`), so the prefix walk and Index::Apply start the loads of the next keys' slots
// while they work on the current ones; robin_map has no such call. And the slot is whatever
// the caller packs (Traits::Slot): no separate key, distance or padding, so the block table
// spends 8 bytes per block and the engine table 12 (robin_map buckets: 40).
//
// Layout: ordered linear probing (Amble and Knuth's ordered hash table; the same layout as
// Robin Hood hashing) with no wrap-around. A slot's home is the top bits of
// Traits::HomeHash(slot) scaled to the capacity (multiply-shift, so any capacity works, and
// homes never go down as the hash goes up). Every entry sits at or after its home with no
// empty slot between, and the whole array is sorted by HomeHash: a probe walks from the home
// while the slots hold smaller hashes, so it compares hashes and never computes a distance
// (a 128-bit multiply per slot passed, which would be ~12 % of the instructions of a store
// from empty, callgrind on compare_dynamo's stores at 64 workers). Clusters that
// run past the last home go on into a tail of spare slots after it (TailFor(): 32 to 1024
// slots, < 0.1 % of a large table), then a sentinel slot that is always empty, so every walk
// ends without a bounds test. The rare insert that would fill the sentinel first doubles the
// tail (GrowTail: by the linear-probing bound, a spill that long at 90 % load has
// probability about e^-7 at 32 slots and far less at 1024; hashes crafted to bunch at the
// top only make the tail grow). Since the
// array is sorted, a growth places the entries in one sequential pass (PlaceInOrder).
// Lookups pass the hash of the key they want and an `eq(slot)` predicate, so a slot need not
// hold the whole key (the block table keeps 32 bits of it and the record index; the record
// has the rest). Traits::Empty(slot) marks a free slot (Traits::kEmptyIsZero: an all-zero
// slot is empty, so a new table is zeroed memory and needs no initialising pass). Growth is
// set by Traits (kMaxLoadPercent, kGrowthPercent): see index.h for the values and what they
// cost. Slot pointers are valid until the next insert or erase.
//
// Side bytes (optional, `EnableSide`): one byte per slot in an array of its own that moves
// with the slots (insert, erase, growth), for data only some tables need: the engine tables
// keep the caps' store stamps there once a worker nears a cap, so tables far from a cap do
// not pay a byte per slot for them.
//
// Thread safety: none (the Index's lock guards it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

#include "index/huge_page_allocator.h"

namespace kvroute {

template <typename Traits>
class RobinTable {
 public:
  using Slot = typename Traits::Slot;
  static_assert(std::is_trivially_copyable<Slot>::value, "slots are moved by copying");

  RobinTable() { Allocate(kMinCapacity, TailFor(kMinCapacity)); }
  ~RobinTable() { Free(); }
  RobinTable(const RobinTable&) = delete;
  RobinTable& operator=(const RobinTable&) = delete;

  size_t size() const { return size_; }
  // Homes (the load is size / capacity).
  size_t capacity() const { return cap_; }
  // Positions that may hold an entry: the homes and the tail after them (sweeps go over
  // [0, slot_count())).
  size_t slot_count() const { return end_; }
  // Bytes of the slot and side arrays.
  size_t bytes() const { return (end_ + 1) * (sizeof(Slot) + (side_ != nullptr ? 1 : 0)); }
  bool has_side() const { return side_ != nullptr; }
  // Side byte of an occupied slot (REQUIRES: has_side()).
  uint8_t& Side(const Slot* s) { return side_[s - slots_]; }
  uint8_t Side(const Slot* s) const { return side_[s - slots_]; }
  // Gives every slot a side byte, `fill` for the occupied ones (no-op if they have one).
  void EnableSide(uint8_t fill) {
    if (side_ != nullptr) return;
    side_ = AllocSide(end_ + 1);
    for (size_t i = 0; i < end_; ++i) {
      if (!Traits::Empty(slots_[i])) side_[i] = fill;
    }
  }
  // Bytes of the side array (0 without one).
  size_t side_bytes() const { return side_ != nullptr ? end_ + 1 : 0; }
  bool empty() const { return size_ == 0; }

  // Hints the CPU to load the slot where a key of this hash starts its probe.
  void Prefetch(uint64_t hash) const { __builtin_prefetch(&slots_[Home(hash)]); }
  // Also the next three cache lines: where an insert's scan for the cluster's end goes on
  // (at 75-90 % load the end is ~8-50 slots on; with one line after the home, the scan's
  // loads past it are a quarter of Index::Apply's samples). Four lines against two: stores
  // from empty 1.047 / 1.035x as fast at N = 64 / 256 (ab_ingest, 15 rounds; three lines
  // 1.035 / 1.011).
  void PrefetchForInsert(uint64_t hash) const {
    const char* p = reinterpret_cast<const char*>(&slots_[Home(hash)]);
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
    __builtin_prefetch(p + 128);
    __builtin_prefetch(p + 192);
  }

  // The slot with HomeHash == hash for which eq(slot) holds, or null. REQUIRES: eq(slot)
  // implies HomeHash(slot) == hash (eq compares the key or bits of it that decide the home).
  template <typename Eq>
  const Slot* Find(uint64_t hash, Eq&& eq) const {
    for (size_t i = Home(hash);; ++i) {  // (the sentinel is empty: the walk ends)
      const Slot& s = slots_[i];
      if (Traits::Empty(s)) return nullptr;
      const uint64_t sh = Traits::HomeHash(s);
      if (sh > hash) return nullptr;  // sorted: the key would be before this slot
      if (sh == hash && eq(s)) return &s;
    }
  }
  template <typename Eq>
  Slot* Find(uint64_t hash, Eq&& eq) {
    return const_cast<Slot*>(static_cast<const RobinTable*>(this)->Find(hash, eq));
  }

  // The slot of the key (hash, eq) and whether it was inserted; an inserted slot holds
  // make(), whose HomeHash must be `hash`. One walk: it stops at the key, or where the key
  // would be, and inserts there (the rest of the cluster moves one slot on).
  template <typename Eq, typename Make>
  std::pair<Slot*, bool> FindOrInsert(uint64_t hash, Eq&& eq, Make&& make) {
    if (NeedsGrow(1)) Grow();  // (Index grows its tables before, off its write lock)
    for (;;) {
      size_t i = Home(hash);
      for (;; ++i) {
        const Slot& s = slots_[i];
        if (Traits::Empty(s)) break;
        const uint64_t sh = Traits::HomeHash(s);
        if (sh > hash) break;
        if (sh == hash && eq(s)) return {&slots_[i], false};
      }
      if (Slot* at = InsertAt(i)) {
        *at = make();
        return {at, true};
      }
      GrowTail();  // the cluster reached the sentinel (rare): look again in the larger tail
    }
  }

  // Removes the slot (which must be occupied) by shifting its followers back.
  void Erase(Slot* s) {
    size_t i = static_cast<size_t>(s - slots_);
    for (;;) {  // (the sentinel is empty: the shift ends)
      const size_t next = i + 1;
      const Slot& n = slots_[next];
      if (Traits::Empty(n) || Home(Traits::HomeHash(n)) == next) break;
      slots_[i] = n;
      if (side_ != nullptr) side_[i] = side_[next];
      i = next;
    }
    slots_[i] = Traits::EmptySlot();
    --size_;
  }

  // True if `extra` more entries would push the table past its maximum load.
  bool NeedsGrow(size_t extra) const {
    return (size_ + extra) * 100 > cap_ * Traits::kMaxLoadPercent;
  }
  // Fills `out` (replacing what it held) with this table's entries at a capacity grown in
  // Traits::kGrowthPercent steps until `extra` more entries fit; this table is only read, so
  // readers may use it meanwhile (Index grows its tables this way outside its write lock).
  // The new table's pages are faulted in at once (it is about to be filled throughout), and
  // the entries are placed in one sequential pass (PlaceInOrder).
  void GrowInto(size_t extra, RobinTable* out) const {
    size_t ncap = cap_;
    while ((size_ + extra) * 100 > ncap * Traits::kMaxLoadPercent) {
      const size_t next = ncap * Traits::kGrowthPercent / 100;
      ncap = next > ncap ? next : ncap + 1;
    }
    ncap = PageFilled(ncap);
    RebuildInto(ncap, TailFor(ncap), out);
  }
  void Swap(RobinTable& o) noexcept {
    std::swap(slots_, o.slots_);
    std::swap(side_, o.side_);
    std::swap(cap_, o.cap_);
    std::swap(end_, o.end_);
    std::swap(size_, o.size_);
  }

  // Drops every entry and shrinks back to the minimum capacity.
  void Clear() {
    Free();
    size_ = 0;
    Allocate(kMinCapacity, TailFor(kMinCapacity));
  }

  template <typename F>
  void ForEach(F&& f) const {
    for (size_t i = 0; i < end_; ++i) {
      if (!Traits::Empty(slots_[i])) f(slots_[i]);
    }
  }

  // The invariant, for tests: each entry sits at or after its home, every slot between is
  // occupied, the entries are in HomeHash order, the sentinel is empty, and size() counts
  // the occupied slots. O(slot_count()).
  bool Valid() const {
    size_t n = 0;
    bool have_prev = false;
    uint64_t prev = 0;
    for (size_t i = 0; i < end_; ++i) {
      if (Traits::Empty(slots_[i])) continue;
      ++n;
      const uint64_t h = Traits::HomeHash(slots_[i]);
      const size_t home = Home(h);
      if (home > i) return false;
      if (home < i && Traits::Empty(slots_[i - 1])) return false;  // a gap in its run
      if (have_prev && prev > h) return false;  // out of HomeHash order
      have_prev = true;
      prev = h;
    }
    return n == size_ && Traits::Empty(slots_[end_]);
  }

  // Positional access, for sweeps that erase as they go (Erase moves the next entry into
  // the erased position: look at the same position again). i < slot_count().
  Slot* At(size_t i) { return &slots_[i]; }

 private:
  static constexpr size_t kMinCapacity = 64;
  // The capacity whose slots (with the tail and sentinel) fill the pages that `cap`'s would
  // take: the last page's spare room becomes homes, so the table holds more before it grows
  // for the same resident memory (HugePageAllocator::usable).
  static size_t PageFilled(size_t cap) {
    const size_t usable = HugePageAllocator<Slot>::usable(cap + TailFor(cap) + 1);
    size_t c = usable - TailFor(cap) - 1;
    while (c > cap && c + TailFor(c) + 1 > usable) --c;  // (a larger cap may take a larger tail)
    return c;
  }
  // Spare slots after the last home for a table of `cap` homes (GrowTail doubles them if a
  // cluster ever needs more).
  static size_t TailFor(size_t cap) {
    const size_t t = cap >> 10;
    return t < 32 ? 32 : (t > 1024 ? 1024 : t);
  }

  // Home slot: the hash scaled to the capacity (Lemire's multiply-shift): the top bits of
  // the hash decide.
  size_t Home(uint64_t hash) const {
    return static_cast<size_t>((static_cast<unsigned __int128>(hash) * cap_) >> 64);
  }

  // Makes room for a new entry at position `i`, where a walk stopped (the first slot whose
  // entry has a larger HomeHash, or an empty one): the rest of the cluster moves one slot on
  // (one memmove up to the next empty slot; no per-slot distance computations, which make
  // swap-and-carry insertion 3x dearer at 90 % load). Returns the slot to fill (size counted,
  // side byte 0), or null if the cluster runs into the sentinel (nothing changed).
  Slot* InsertAt(size_t i) {
    size_t j = i;
    while (!Traits::Empty(slots_[j])) ++j;  // (the sentinel is empty)
    if (j == end_) return nullptr;
    if (j > i) {
      std::memmove(&slots_[i + 1], &slots_[i], (j - i) * sizeof(Slot));
      if (side_ != nullptr) std::memmove(&side_[i + 1], &side_[i], j - i);
    }
    if (side_ != nullptr) side_[i] = 0;
    ++size_;
    return &slots_[i];
  }
  // Same capacity, twice the tail (a cluster reached the sentinel).
  void GrowTail() {
    RobinTable t;
    RebuildInto(cap_, 2 * (end_ - cap_), &t);
    Swap(t);
  }
  // `out` := this table's entries at `ncap` homes and at least `tail` spare slots (doubled
  // until the entries fit). REQUIRES: ncap >= cap_.
  void RebuildInto(size_t ncap, size_t tail, RobinTable* out) const {
    for (;; tail *= 2) {
      out->Free();
      out->size_ = 0;
      out->Allocate(ncap, tail, /*populate=*/true);
      if (side_ != nullptr) out->side_ = AllocSide(out->end_ + 1);
      if (size_ == 0 || out->PlaceInOrder(*this)) return;
    }
  }
  // Growth in one pass. The source array is sorted by HomeHash, so read front to back it
  // gives its entries in the order of their homes here too (multiply-shift homes never go
  // down as the hash goes up); each goes to max(its home, the slot after the last one
  // placed): this table's layout, written front to back with no probing or shifting. The
  // loop has no branch on the slots' contents: an empty slot leaves `next` as it is and is
  // written to a scratch slot. False if the entries would run into the sentinel (this
  // table is then left partly filled: the caller frees it). REQUIRES: this table empty.
  bool PlaceInOrder(const RobinTable& src) {
    const Slot* old = src.slots_;
    const uint8_t* old_side = src.side_;
    Slot scratch;
    uint8_t scratch_side;
    size_t next = 0;
    auto place = [&](auto with_side) {
      for (size_t i = 0; i < src.end_; ++i) {
        const Slot v = old[i];
        const bool occupied = !Traits::Empty(v);
        const size_t h = Home(Traits::HomeHash(v));
        const size_t pos = h > next ? h : next;
        if (pos >= end_ && occupied) return false;
        *(occupied ? &slots_[pos] : &scratch) = v;
        if constexpr (decltype(with_side)::value) {
          *(occupied ? &side_[pos] : &scratch_side) = old_side[i];
        }
        next = occupied ? pos + 1 : next;
      }
      return true;
    };
    const bool ok = side_ != nullptr ? place(std::true_type{}) : place(std::false_type{});
    size_ = src.size_;
    return ok;
  }
  static uint8_t* AllocSide(size_t n) {
    void* p = std::calloc(n, 1);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<uint8_t*>(p);
  }

  // cap homes, then tail spare slots, then the sentinel. populate: fault every page in now
  // (a table about to be filled throughout).
  void Allocate(size_t cap, size_t tail, bool populate = false) {
    const size_t n = cap + tail + 1;
    HugePageAllocator<Slot> alloc;
    if constexpr (Traits::kEmptyIsZero) {
      slots_ = alloc.allocate_zeroed(n, populate);  // fresh pages: nothing to write
    } else {
      slots_ = alloc.allocate(n);
      const Slot empty = Traits::EmptySlot();
      for (size_t i = 0; i < n; ++i) slots_[i] = empty;
    }
    cap_ = cap;
    end_ = cap + tail;
  }
  void Free() {
    std::free(side_);
    side_ = nullptr;
    if (slots_ == nullptr) return;
    HugePageAllocator<Slot>().deallocate(slots_, end_ + 1);
    slots_ = nullptr;
  }
  void Grow() {
    RobinTable grown;
    GrowInto(1, &grown);
    Swap(grown);  // the old slots go with `grown`
  }

  Slot* slots_ = nullptr;
  uint8_t* side_ = nullptr;  // one byte per slot, or none (EnableSide)
  size_t cap_ = 0;   // homes
  size_t end_ = 0;   // cap_ + tail: the sentinel's position
  size_t size_ = 0;
};

}  // namespace kvroute
