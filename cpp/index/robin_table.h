// RobinTable: the index's two hash tables, open addressing built for random misses.
//
//   BlockTable  : block key   -> HolderSet    24-byte slots (tsl::robin_map bucket: 40)
//   EngineTable : engine hash -> EngineEntry  32-byte slots (tsl::robin_map bucket: 40)
//
// Why not tsl::robin_map: a lookup of an 8K-token prompt probes ~500 random slots of a table
// far larger than the caches, and a BlockStored event inserts into both tables at random; the
// time goes to those misses. This table can say where a key lives before looking
// (`Prefetch`), so the prefix walk and Index::Apply start the loads of the next keys' slots
// while they work on the current ones; robin_map has no such call. No per-slot distance or
// padding is stored either.
//
// Layout: linear probing with Robin Hood ordering and backward-shift deletion. A key's home
// slot is the top bits of Traits::Hash(key); its probe distance is recomputed from the key.
// Traits::kEmpty marks an empty slot (a value no real key takes, or one Traits::Norm maps
// away). Traits set the growth (kMaxLoadPercent, kGrowthPercent); both tables double past
// 80 % load (40-80 % full). Measured alternatives (callgrind, 200k ingested blocks; index
// estimate at 1M blocks, 8 workers): x2 past 80 %: 273M instructions, 135 B per (block,
// worker); x1.5 past 80 %: 335M, 111 B; x1.5 past 85 %: 376M, 111 B. Robin Hood inserts
// displace more entries as the load rises and x1.5 rehashes more often: ~20 % less memory
// for 23-38 % more ingestion work, so doubling it is. Slot pointers are valid until the
// next insert or erase.
//
// Thread safety: none (the Index's lock guards it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <utility>

#include "common/types.h"
#include "index/holder_set.h"
#include "index/huge_page_allocator.h"

namespace kvroute {

template <typename Traits>
class RobinTable {
 public:
  using Key = typename Traits::Key;
  using Value = typename Traits::Value;
  struct Slot {
    Key key;
    Value value;
  };

  RobinTable() { Allocate(kMinCapacity); }
  ~RobinTable() { Free(); }
  RobinTable(const RobinTable&) = delete;
  RobinTable& operator=(const RobinTable&) = delete;

  size_t size() const { return size_; }
  size_t capacity() const { return cap_; }
  bool empty() const { return size_ == 0; }
  static constexpr size_t slot_bytes() { return sizeof(Slot); }

  // Hints the CPU to load the slot where `key`'s probe starts.
  void Prefetch(const Key& key) const {
    __builtin_prefetch(&slots_[Home(Traits::Hash(Traits::Norm(key)))]);
  }

  const Slot* Find(const Key& k) const {
    const Key key = Traits::Norm(k);
    size_t i = Home(Traits::Hash(key));
    for (size_t d = 0;; ++d, i = Next(i)) {
      const Slot& s = slots_[i];
      if (s.key == key) return &s;
      if (IsEmpty(s.key) || Dist(s.key, i) < d) return nullptr;  // Robin Hood: it'd be here
    }
  }
  Slot* Find(const Key& key) {
    return const_cast<Slot*>(static_cast<const RobinTable*>(this)->Find(key));
  }

  // The slot of `key` and whether it was inserted (with a default Value). One probe walk:
  // it stops at the key, or where the key would be, and inserts there.
  std::pair<Slot*, bool> FindOrInsert(const Key& k) {
    const Key key = Traits::Norm(k);
    if ((size_ + 1) * 100 > capacity() * Traits::kMaxLoadPercent) Grow();
    size_t i = Home(Traits::Hash(key));
    for (size_t d = 0;; ++d, i = Next(i)) {
      Slot& s = slots_[i];
      if (s.key == key) return {&s, false};
      if (IsEmpty(s.key)) {
        s.key = key;
        s.value = Value();
        ++size_;
        return {&s, true};
      }
      if (Dist(s.key, i) < d) return {InsertAt(i, d, key), true};  // absent: it goes here
    }
  }

  // Removes the slot (which must hold a key) by shifting its followers back.
  void Erase(Slot* s) {
    size_t i = static_cast<size_t>(s - slots_);
    for (;;) {
      const size_t next = Next(i);
      Slot& n = slots_[next];
      if (IsEmpty(n.key) || Dist(n.key, next) == 0) break;
      slots_[i].key = n.key;
      slots_[i].value = std::move(n.value);
      i = next;
    }
    slots_[i].key = Traits::kEmpty;
    slots_[i].value = Value();
    --size_;
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
      if (!IsEmpty(slots_[i].key)) f(slots_[i]);
    }
  }

 private:
  static constexpr size_t kMinCapacity = 64;

  static bool IsEmpty(const Key& k) { return k == Traits::kEmpty; }
  // Home slot: the hash scaled to the capacity (Lemire's multiply-shift), so any capacity
  // works and the top bits of the hash decide.
  size_t Home(uint64_t hash) const {
    return static_cast<size_t>((static_cast<unsigned __int128>(hash) * cap_) >> 64);
  }
  size_t Next(size_t i) const { return i + 1 == cap_ ? 0 : i + 1; }
  size_t Dist(const Key& k, size_t at) const {
    const size_t home = Home(Traits::Hash(k));
    return at >= home ? at - home : at + cap_ - home;
  }

  // REQUIRES: key absent, load below the limit. Returns the slot that ends up holding it.
  Slot* InsertNew(const Key& key, Value&& v) {
    return InsertAt(Home(Traits::Hash(key)), 0, key, std::move(v));
  }
  // Robin Hood insertion of an absent key from slot `i`, where it already has probe
  // distance `d`.
  Slot* InsertAt(size_t i, size_t d0, const Key& key, Value&& v = Value()) {
    Slot* placed = nullptr;
    Key k = key;
    Value h = std::move(v);
    for (size_t d = d0;; ++d, i = Next(i)) {
      Slot& s = slots_[i];
      if (IsEmpty(s.key)) {
        s.key = k;
        s.value = std::move(h);
        ++size_;
        return placed != nullptr ? placed : &s;
      }
      const size_t sd = Dist(s.key, i);
      if (sd < d) {  // take from the rich: swap and carry the displaced entry on
        std::swap(s.key, k);
        std::swap(s.value, h);
        if (placed == nullptr) placed = &s;
        d = sd;
      }
    }
  }

  void Allocate(size_t cap) {
    HugePageAllocator<Slot> alloc;
    slots_ = alloc.allocate(cap);
    for (size_t i = 0; i < cap; ++i) new (&slots_[i]) Slot{Traits::kEmpty, Value()};
    cap_ = cap;
  }
  void Free() {
    if (slots_ == nullptr) return;
    for (size_t i = 0; i < cap_; ++i) slots_[i].~Slot();
    HugePageAllocator<Slot>().deallocate(slots_, cap_);
    slots_ = nullptr;
  }
  void Grow() {
    Slot* old = slots_;
    const size_t old_cap = cap_;
    Allocate(old_cap * Traits::kGrowthPercent / 100);
    size_ = 0;
    for (size_t i = 0; i < old_cap; ++i) {
      if (!IsEmpty(old[i].key)) InsertNew(old[i].key, std::move(old[i].value));
      old[i].~Slot();
    }
    HugePageAllocator<Slot>().deallocate(old, old_cap);
  }

  Slot* slots_ = nullptr;
  size_t cap_ = 0;
  size_t size_ = 0;
};

static_assert(sizeof(HolderSet) == 16, "HolderSet should stay 16 bytes");

// Block keys are fmix64 outputs: their own top bits are the hash. Key 0 marks an empty slot; a
// block key of 0 is stored as 1 (probability 2^-64 per block; the two would share holders).
struct BlockKeyTraits {
  using Key = BlockKey;
  using Value = HolderSet;
  static constexpr BlockKey kEmpty = 0;
  static constexpr size_t kMaxLoadPercent = 80;
  static constexpr size_t kGrowthPercent = 200;
  static uint64_t Hash(BlockKey k) { return k; }
  static BlockKey Norm(BlockKey k) { return k == 0 ? 1 : k; }
};
using BlockTable = RobinTable<BlockKeyTraits>;

}  // namespace kvroute
