// BlockTable: block key -> HolderSet, an open-addressing table built for the prefix match.
//
// Why not tsl::robin_map: a lookup of an 8K-token prompt probes ~500 random slots of a table
// far larger than the caches, and the time goes to those misses. This table can say where a
// key lives before looking (`Prefetch`), so FindMatches issues the loads of the next blocks'
// slots while it walks the current ones; robin_map has no such call. Slots are 24 bytes
// (key + a 16-byte HolderSet), against robin_map's 40-byte buckets for the same pair.
//
// Layout: linear probing with Robin Hood ordering and backward-shift deletion. A key's home
// slot is its top bits (block keys are fmix64 outputs: uniform); its probe distance is
// recomputed from the key, so no distance is stored. Key 0 marks an empty slot; a block key
// of 0 is stored as 1 (probability 2^-64 per block; the two would share holders). Grows x2
// past 80 % load. Pointers into the table are valid until the next insert or erase.
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

static_assert(sizeof(HolderSet) == 16, "HolderSet should stay 16 bytes");

class BlockTable {
 public:
  struct Slot {
    BlockKey key;  // 0 = empty
    HolderSet holders;
  };

  BlockTable() { Allocate(kMinCapacity); }
  ~BlockTable() { Free(); }
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;

  size_t size() const { return size_; }
  size_t capacity() const { return mask_ + 1; }
  bool empty() const { return size_ == 0; }
  static constexpr size_t slot_bytes() { return sizeof(Slot); }

  static BlockKey Norm(BlockKey k) { return k == 0 ? 1 : k; }

  // Hints the CPU to load the slot where `key`'s probe starts.
  void Prefetch(BlockKey key) const { __builtin_prefetch(&slots_[Home(Norm(key))]); }

  const Slot* Find(BlockKey key) const {
    key = Norm(key);
    size_t i = Home(key);
    for (size_t d = 0;; ++d, i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return &s;
      if (s.key == 0 || Dist(s.key, i) < d) return nullptr;  // Robin Hood: it would be here
    }
  }
  Slot* Find(BlockKey key) {
    return const_cast<Slot*>(static_cast<const BlockTable*>(this)->Find(key));
  }

  // The slot of `key`, inserted with an empty HolderSet if absent.
  Slot* FindOrInsert(BlockKey key) {
    key = Norm(key);
    if (Slot* s = Find(key)) return s;
    if ((size_ + 1) * 5 > capacity() * 4) Grow();
    return InsertNew(key, HolderSet());
  }

  // Removes the slot (which must hold a key) by shifting its followers back.
  void Erase(Slot* s) {
    size_t i = static_cast<size_t>(s - slots_);
    for (;;) {
      const size_t next = (i + 1) & mask_;
      Slot& n = slots_[next];
      if (n.key == 0 || Dist(n.key, next) == 0) break;
      slots_[i].key = n.key;
      slots_[i].holders = std::move(n.holders);
      i = next;
    }
    slots_[i].key = 0;
    slots_[i].holders = HolderSet();
    --size_;
  }

  template <typename F>
  void ForEach(F&& f) const {
    for (size_t i = 0; i <= mask_; ++i) {
      if (slots_[i].key != 0) f(slots_[i]);
    }
  }

 private:
  static constexpr size_t kMinCapacity = 1024;

  size_t Home(BlockKey k) const { return static_cast<size_t>(k >> shift_); }
  size_t Dist(BlockKey k, size_t at) const { return (at - Home(k)) & mask_; }

  // REQUIRES: key absent, load below the limit. Returns the slot that ends up holding it.
  Slot* InsertNew(BlockKey key, HolderSet&& hs) {
    size_t i = Home(key);
    Slot* placed = nullptr;
    BlockKey k = key;
    HolderSet h = std::move(hs);
    for (size_t d = 0;; ++d, i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == 0) {
        s.key = k;
        s.holders = std::move(h);
        ++size_;
        return placed != nullptr ? placed : &s;
      }
      const size_t sd = Dist(s.key, i);
      if (sd < d) {  // take from the rich: swap and carry the displaced entry on
        std::swap(s.key, k);
        std::swap(s.holders, h);
        if (placed == nullptr) placed = &s;
        d = sd;
      }
    }
  }

  void Allocate(size_t cap) {
    HugePageAllocator<Slot> alloc;
    slots_ = alloc.allocate(cap);
    for (size_t i = 0; i < cap; ++i) new (&slots_[i]) Slot{0, HolderSet()};
    mask_ = cap - 1;
    int bits = 0;
    while ((size_t{1} << bits) < cap) ++bits;
    shift_ = 64 - bits;
  }
  void Free() {
    if (slots_ == nullptr) return;
    for (size_t i = 0; i <= mask_; ++i) slots_[i].~Slot();
    HugePageAllocator<Slot>().deallocate(slots_, mask_ + 1);
    slots_ = nullptr;
  }
  void Grow() {
    Slot* old = slots_;
    const size_t old_cap = mask_ + 1;
    Allocate(old_cap * 2);
    size_ = 0;
    for (size_t i = 0; i < old_cap; ++i) {
      if (old[i].key != 0) InsertNew(old[i].key, std::move(old[i].holders));
      old[i].~Slot();
    }
    HugePageAllocator<Slot>().deallocate(old, old_cap);
  }

  Slot* slots_ = nullptr;
  size_t mask_ = 0;
  int shift_ = 64;
  size_t size_ = 0;
};

}  // namespace kvroute
