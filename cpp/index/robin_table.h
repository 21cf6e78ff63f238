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
// Layout: linear probing with Robin Hood ordering and backward-shift deletion. A slot's home
// is the top bits of Traits::HomeHash(slot) scaled to the capacity (multiply-shift, so any
// capacity works); its probe distance is recomputed from the slot. The entries of one home
// are kept in HomeHash order, so a cluster is sorted by HomeHash and a growth can place the
// entries in one sequential pass (PlaceInOrder). Lookups pass the hash of
// the key they want and an `eq(slot)` predicate, so a slot need not hold the whole key (the
// block table keeps 32 bits of it and the record index; the record has the rest).
// Traits::Empty(slot) marks a free slot (Traits::kEmptyIsZero: an all-zero slot is empty, so
// a new table is zeroed memory and needs no initialising pass). Growth is set by Traits (kMaxLoadPercent,
// kGrowthPercent): see index.h for the values and what they cost. Slot pointers are valid
// until the next insert or erase.
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

  RobinTable() { Allocate(kMinCapacity); }
  ~RobinTable() { Free(); }
  RobinTable(const RobinTable&) = delete;
  RobinTable& operator=(const RobinTable&) = delete;

  size_t size() const { return size_; }
  size_t capacity() const { return cap_; }
  bool has_side() const { return side_ != nullptr; }
  // Side byte of an occupied slot (REQUIRES: has_side()).
  uint8_t& Side(const Slot* s) { return side_[s - slots_]; }
  uint8_t Side(const Slot* s) const { return side_[s - slots_]; }
  // Gives every slot a side byte, `fill` for the occupied ones (no-op if they have one).
  void EnableSide(uint8_t fill) {
    if (side_ != nullptr) return;
    side_ = AllocSide(cap_);
    for (size_t i = 0; i < cap_; ++i) {
      if (!Traits::Empty(slots_[i])) side_[i] = fill;
    }
  }
  // Bytes of the side array (0 without one).
  size_t side_bytes() const { return side_ != nullptr ? cap_ : 0; }
  bool empty() const { return size_ == 0; }
  static constexpr size_t slot_bytes() { return sizeof(Slot); }

  // Hints the CPU to load the slot where a key of this hash starts its probe.
  void Prefetch(uint64_t hash) const { __builtin_prefetch(&slots_[Home(hash)]); }
  // Also the next cache line: where an insert's scan for the cluster's end goes on.
  void PrefetchForInsert(uint64_t hash) const {
    const char* p = reinterpret_cast<const char*>(&slots_[Home(hash)]);
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
  }

  // The slot with HomeHash == hash for which eq(slot) holds, or null. REQUIRES: eq(slot)
  // implies HomeHash(slot) == hash (eq compares the key or bits of it that decide the home).
  template <typename Eq>
  const Slot* Find(uint64_t hash, Eq&& eq) const {
    size_t i = Home(hash);
    for (size_t d = 0;; ++d, i = Next(i)) {
      const Slot& s = slots_[i];
      if (Traits::Empty(s)) return nullptr;
      if (eq(s)) return &s;  // (eq implies the same home: no distance to compute)
      if (Dist(s, i) < d) return nullptr;  // Robin Hood: the key would be here
    }
  }
  template <typename Eq>
  Slot* Find(uint64_t hash, Eq&& eq) {
    return const_cast<Slot*>(static_cast<const RobinTable*>(this)->Find(hash, eq));
  }

  // The slot of the key (hash, eq) and whether it was inserted; an inserted slot holds
  // make(), whose HomeHash must be `hash`. One probe walk: it stops at the key, or where the
  // key would be, and inserts there.
  template <typename Eq, typename Make>
  std::pair<Slot*, bool> FindOrInsert(uint64_t hash, Eq&& eq, Make&& make) {
    if (NeedsGrow(1)) Grow();  // (Index grows its tables before, off its write lock)
    size_t i = Home(hash);
    for (size_t d = 0;; ++d, i = Next(i)) {
      Slot& s = slots_[i];
      if (Traits::Empty(s)) {
        s = make();
        if (side_ != nullptr) side_[i] = 0;
        ++size_;
        return {&s, true};
      }
      const size_t sd = Dist(s, i);
      if (sd < d) return {InsertAt(i, make()), true};  // absent: it goes here
      if (sd == d) {
        const uint64_t sh = Traits::HomeHash(s);
        if (sh == hash && eq(s)) return {&s, false};
        if (sh > hash) return {InsertAt(i, make()), true};  // (clusters sorted by hash)
      }
    }
  }

  // Removes the slot (which must be occupied) by shifting its followers back.
  void Erase(Slot* s) {
    size_t i = static_cast<size_t>(s - slots_);
    for (;;) {
      const size_t next = Next(i);
      const Slot& n = slots_[next];
      if (Traits::Empty(n) || Dist(n, next) == 0) break;
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
    out->Free();
    out->size_ = 0;
    out->Allocate(ncap, /*populate=*/true);
    if (side_ != nullptr) out->side_ = AllocSide(ncap);
    if (size_ != 0) out->PlaceInOrder(*this);
  }
  void Swap(RobinTable& o) noexcept {
    std::swap(slots_, o.slots_);
    std::swap(side_, o.side_);
    std::swap(cap_, o.cap_);
    std::swap(size_, o.size_);
  }

  // Drops every entry and shrinks back to the minimum capacity.
  void Clear() {
    Free();
    size_ = 0;
    Allocate(kMinCapacity);
  }

  template <typename F>
  void ForEach(F&& f) const {
    for (size_t i = 0; i < cap_; ++i) {
      if (!Traits::Empty(slots_[i])) f(slots_[i]);
    }
  }

  // The Robin Hood invariant, for tests: each entry sits at or after its home, every slot
  // between is occupied, a cluster's homes never go back (distance grows by at most one
  // from a slot to the next), and one home's entries are in HomeHash order; size() counts
  // the occupied slots. O(capacity).
  bool Valid() const {
    size_t n = 0;
    for (size_t i = 0; i < cap_; ++i) {
      if (Traits::Empty(slots_[i])) continue;
      ++n;
      const size_t d = Dist(slots_[i], i);
      if (d >= cap_) return false;
      const size_t prev = i == 0 ? cap_ - 1 : i - 1;
      if (d > 0 && (Traits::Empty(slots_[prev]) || Dist(slots_[prev], prev) + 1 < d)) return false;
      if (d > 0 && Dist(slots_[prev], prev) + 1 == d &&
          Traits::HomeHash(slots_[prev]) > Traits::HomeHash(slots_[i])) {
        return false;  // one home's entries out of HomeHash order
      }
    }
    return n == size_;
  }

  // Positional access, for sweeps that erase as they go (Erase moves the next entry into
  // the erased position: look at the same position again).
  Slot* At(size_t i) { return &slots_[i]; }

 private:
  static constexpr size_t kMinCapacity = 64;

  // Home slot: the hash scaled to the capacity (Lemire's multiply-shift): the top bits of
  // the hash decide.
  size_t Home(uint64_t hash) const {
    return static_cast<size_t>((static_cast<unsigned __int128>(hash) * cap_) >> 64);
  }
  size_t Next(size_t i) const { return i + 1 == cap_ ? 0 : i + 1; }
  size_t Dist(const Slot& s, size_t at) const {
    const size_t home = Home(Traits::HomeHash(s));
    return at >= home ? at - home : at + cap_ - home;
  }

  // Robin Hood insertion of an absent key's slot `v` at position `i`, where its probe
  // stopped (the first slot whose occupant's home lies after v's). A cluster is sorted by
  // home, so inserting there means shifting the rest of the cluster one slot on: find the
  // next empty slot, move the run with memmove (no per-slot distance computations, which made
  // swap-and-carry insertion 3x dearer at 90 % load). Returns the slot that holds v.
  Slot* InsertAt(size_t i, Slot v) {
    size_t j = i;
    while (j < cap_ && !Traits::Empty(slots_[j])) ++j;  // no wrap test per slot
    if (j == cap_) {
      j = 0;
      while (!Traits::Empty(slots_[j])) ++j;
    }
    if (j >= i) {
      std::memmove(&slots_[i + 1], &slots_[i], (j - i) * sizeof(Slot));
      if (side_ != nullptr) std::memmove(&side_[i + 1], &side_[i], j - i);
    } else {  // the run wraps around the end of the table
      std::memmove(&slots_[1], &slots_[0], j * sizeof(Slot));
      slots_[0] = slots_[cap_ - 1];
      std::memmove(&slots_[i + 1], &slots_[i], (cap_ - 1 - i) * sizeof(Slot));
      if (side_ != nullptr) {
        std::memmove(&side_[1], &side_[0], j);
        side_[0] = side_[cap_ - 1];
        std::memmove(&side_[i + 1], &side_[i], cap_ - 1 - i);
      }
    }
    slots_[i] = v;
    if (side_ != nullptr) side_[i] = 0;
    ++size_;
    return &slots_[i];
  }
  // Growth in one pass. Homes are multiply-shift and clusters are sorted by HomeHash, so
  // read from the slot after an empty one, `src` gives its entries in the order of their
  // homes here too, with one wrap past the end. Each goes to max(its home, the slot after the
  // last one placed): the Robin Hood layout, written front to back with no probing or
  // shifting. Positions count on past the end (`wrap`) once the homes wrap, and never reach
  // the first entry again: an entry j positions before the end of src's walk sits, in src,
  // at most (cap - 1 - its src home) slots from its src home; here its home is no nearer the
  // first entry's than that in proportion, and cap_ >= src.cap_, so with the floors counted
  // the last position is < first + cap_. The loop has no branch on the slots' contents: an
  // empty slot leaves `next` and `prev` as they are and is written to a scratch slot.
  // REQUIRES: this table empty, src not, cap_ >= src.cap_.
  void PlaceInOrder(const RobinTable& src) {
    const Slot* old = src.slots_;
    const uint8_t* old_side = src.side_;
    const size_t ocap = src.cap_;
    size_t start = 0;
    while (!Traits::Empty(old[start])) ++start;  // src is below 100 % load
    size_t f = start;
    do {
      f = src.Next(f);
    } while (Traits::Empty(old[f]));
    const size_t first = Home(Traits::HomeHash(old[f]));
    size_t next = first, prev = first, wrap = 0;
    Slot scratch;
    uint8_t scratch_side;
    auto place = [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        const Slot v = old[i];
        const bool occupied = !Traits::Empty(v);
        size_t h = Home(Traits::HomeHash(v));
        h = occupied ? h : prev;
        wrap = h < prev ? cap_ : wrap;  // the homes went past the end (once)
        prev = h;
        const size_t want = h + wrap;
        const size_t pos = want > next ? want : next;
        const size_t at = pos >= cap_ ? pos - cap_ : pos;
        *(occupied ? &slots_[at] : &scratch) = v;
        if (side_ != nullptr) *(occupied ? &side_[at] : &scratch_side) = old_side[i];
        next = pos + occupied;
      }
    };
    place(start + 1, ocap);
    place(0, start);
    size_ = src.size_;
  }
  static uint8_t* AllocSide(size_t n) {
    void* p = std::calloc(n, 1);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<uint8_t*>(p);
  }

  // populate: fault every page in now (a table about to be filled throughout).
  void Allocate(size_t cap, bool populate = false) {
    HugePageAllocator<Slot> alloc;
    if constexpr (Traits::kEmptyIsZero) {
      slots_ = alloc.allocate_zeroed(cap, populate);  // fresh pages: nothing to write
    } else {
      slots_ = alloc.allocate(cap);
      const Slot empty = Traits::EmptySlot();
      for (size_t i = 0; i < cap; ++i) slots_[i] = empty;
    }
    cap_ = cap;
  }
  void Free() {
    std::free(side_);
    side_ = nullptr;
    if (slots_ == nullptr) return;
    HugePageAllocator<Slot>().deallocate(slots_, cap_);
    slots_ = nullptr;
  }
  void Grow() {
    RobinTable grown;
    GrowInto(1, &grown);
    Swap(grown);  // the old slots go with `grown`
  }

  Slot* slots_ = nullptr;
  uint8_t* side_ = nullptr;  // one byte per slot, or none (EnableSide)
  size_t cap_ = 0;
  size_t size_ = 0;
};

}  // namespace kvroute
