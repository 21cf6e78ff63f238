// HolderSet: the workers holding one block key, with their per-tier reference counts, and a
// signature of the set that lets a prefix match skip runs of blocks held by the same workers.
//
// Eight bytes (one word), so a block record (block_slab.h) is 16:
//   top byte 0   empty
//   top byte 1   one holder inline: worker (bits 0-31), GPU / CPU / disk counts (8 bits each)
//   top byte 3   two holders inline: workers (16 bits each, bits 0-31), counts (4 bits each,
//                bits 32-55); used while both ids are below 65,536 and counts below 16
//   top byte 2   heap array (pointer in bits 0-55): 16-byte header {signature, size, capacity}
//                and 8-byte Holders {worker, counts (8 bits each)}
// Most blocks live on one or two workers (a conversation and its replica); a block shared
// more widely (a system prompt on every worker) moves to the heap. A count is the number of
// the worker's engine hashes holding this key on that tier: 1 in practice, at most 255 here
// (AddRef refuses past that, and the Index then does not count the engine hash either).
//
// The signature is the XOR over holders of HolderSig(worker, tier mask): equal sets of
// (worker, tiers) always have equal signatures, unequal sets collide with probability 2^-64
// (a XOR of distinct fmix64 outputs). Index::FindMatches compares run keys (RunKey(): the
// word itself inline, the signature on the heap) of consecutive blocks and touches the holders
// only where the set changes (a 64-block system prompt on 60 workers: 60 holder updates, not
// 3,840).
//
// A HolderSet is a plain word: it is copied with the record it lives in and never frees on
// its own. The owner calls Release() before dropping a non-empty set (the Index drops records
// only once they are empty, which frees the heap array on the last DropRef).
//
// Thread safety: none (the Index's lock guards it).
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <new>

#include "common/block_key.h"
#include "common/types.h"

namespace kvroute {

// Tiers holding the block, one bit each: 1 GPU, 2 CPU, 4 disk (0: none).
template <typename T>
inline uint8_t TierMask(const std::array<T, kNumMedia>& r) {
  return static_cast<uint8_t>((r[0] ? 1 : 0) | (r[1] ? 2 : 0) | (r[2] ? 4 : 0));
}
inline uint64_t HolderSig(WorkerId w, uint8_t mask) {
  return Fmix64(((static_cast<uint64_t>(w) << 3) | mask) + 0x9E3779B97F4A7C15ull);
}

struct Holder {
  WorkerId worker;
  // How many of the worker's engine hashes hold this key on GPU, CPU, disk.
  std::array<uint8_t, kNumMedia> refs;
  uint8_t unused;
};

class HolderSet {
 public:
  static constexpr uint32_t kMaxRefs = 0xFF;  // per (holder, tier)

  uint32_t size() const {
    switch (tag()) {
      case kOne: return 1;
      case kTwo: return 2;
      case kHeap: return heap()->size;
      default: return 0;
    }
  }
  bool empty() const { return tag() == kEmpty; }

  // One more engine hash of `w` holds the key on `tier`. Returns false (and changes nothing)
  // if that count is at kMaxRefs. *new_holder: w was not a holder before. *heap_delta: heap
  // bytes added (negative if freed), for memory accounting.
  bool AddRef(WorkerId w, int tier, bool* new_holder, int64_t* heap_delta) {
    *new_holder = false;
    *heap_delta = 0;
    switch (tag()) {
      case kEmpty:
        bits_ = (uint64_t{kOne} << 56) | (uint64_t{1} << (32 + 8 * tier)) | w;
        *new_holder = true;
        return true;
      case kOne: {
        const Holder a = One();
        if (a.worker == w) {
          if (a.refs[tier] == kMaxRefs) return false;
          bits_ += uint64_t{1} << (32 + 8 * tier);
          return true;
        }
        Holder b{w, {0, 0, 0}, 0};
        b.refs[tier] = 1;
        *new_holder = true;
        if (FitsTwo(a) && FitsTwo(b)) {
          SetTwo(a, b);
        } else {
          *heap_delta = ToHeap({a, b}, 4);
        }
        return true;
      }
      case kTwo: {
        Holder h[2] = {TwoAt(0), TwoAt(1)};
        for (Holder& x : h) {
          if (x.worker != w) continue;
          ++x.refs[tier];
          if (FitsTwo(x)) {
            SetTwo(h[0], h[1]);
          } else {
            *heap_delta = ToHeap({h[0], h[1]}, 2);
          }
          return true;
        }
        Holder b{w, {0, 0, 0}, 0};
        b.refs[tier] = 1;
        *new_holder = true;
        *heap_delta = ToHeap({h[0], h[1], b}, 4);
        return true;
      }
      default: break;
    }
    Heap* hp = heap();
    Holder* x = FindIn(hp, w);
    if (x == nullptr) {
      if (hp->size == hp->cap) {
        *heap_delta += GrowHeap();
        hp = heap();
      }
      x = &hp->holders()[hp->size++];
      *x = Holder{w, {0, 0, 0}, 0};
      hp->sig ^= HolderSig(w, 0);
      *new_holder = true;
    }
    if (x->refs[tier] == kMaxRefs) return false;  // (a new holder starts at 0: never here)
    const uint8_t before = TierMask(x->refs);
    ++x->refs[tier];
    Retier(hp, w, before, TierMask(x->refs));
    return true;
  }

  // `n` fewer engine hashes of `w` hold the key on `tier` (floored at 0). Returns true if w
  // stopped being a holder (no tier left). *heap_delta: heap bytes freed (negative).
  bool DropRef(WorkerId w, int tier, uint32_t n, int64_t* heap_delta) {
    *heap_delta = 0;
    switch (tag()) {
      case kOne: {
        if (InlineWorker() != w) return false;
        const int shift = 32 + 8 * tier;
        const uint64_t c = (bits_ >> shift) & 0xFF;
        bits_ -= (c > n ? n : c) << shift;
        if (((bits_ >> 32) & 0xFFFFFF) != 0) return false;
        bits_ = 0;
        return true;
      }
      case kTwo: {
        Holder h[2] = {TwoAt(0), TwoAt(1)};
        for (int i = 0; i < 2; ++i) {
          if (h[i].worker != w) continue;
          h[i].refs[tier] = static_cast<uint8_t>(h[i].refs[tier] > n ? h[i].refs[tier] - n : 0);
          if (TierMask(h[i].refs) != 0) {
            SetTwo(h[0], h[1]);
            return false;
          }
          SetOne(h[1 - i]);
          return true;
        }
        return false;
      }
      case kHeap: break;
      default: return false;
    }
    Heap* hp = heap();
    Holder* x = FindIn(hp, w);
    if (x == nullptr) return false;
    const uint8_t before = TierMask(x->refs);
    x->refs[tier] = static_cast<uint8_t>(x->refs[tier] > n ? x->refs[tier] - n : 0);
    const uint8_t now = TierMask(x->refs);
    Retier(hp, w, before, now);
    if (now != 0) return false;
    hp->sig ^= HolderSig(w, 0);
    *x = hp->holders()[--hp->size];
    if (hp->size <= 1) {  // back inline: a lone holder always fits
      *heap_delta = -static_cast<int64_t>(HeapBytes());
      const bool one = hp->size == 1;
      const Holder last = one ? hp->holders()[0] : Holder{};
      std::free(hp);
      bits_ = 0;
      if (one) SetOne(last);
    }
    return true;
  }

  // XOR over holders of HolderSig(worker, tier mask); 0 for an empty set.
  uint64_t Signature() const {
    switch (tag()) {
      case kOne: return HolderSig(InlineWorker(), OneMask());
      case kTwo: {
        const Holder a = TwoAt(0), b = TwoAt(1);
        return HolderSig(a.worker, TierMask(a.refs)) ^ HolderSig(b.worker, TierMask(b.refs));
      }
      case kHeap: return heap()->sig;
      default: return 0;
    }
  }

  // What the prefix walk compares between consecutive blocks, cheaper than Signature(): the
  // word itself for the inline forms (equal words: equal holders and counts), the signature
  // for a heap array. Equal run keys mean equal sets of (worker, tier mask), but for a heap
  // signature equal to an inline word (probability 2^-64); unequal keys of equal sets (counts
  // differing, one set inline and one on the heap) only end a run early, which is exact.
  uint64_t RunKey() const { return tag() == kHeap ? heap()->sig : bits_; }

  // Starts the load of a heap array's header (what RunKey() reads); no-op inline.
  void PrefetchRunKey() const {
    if (tag() == kHeap) __builtin_prefetch(heap());
  }

  // Calls f(worker, tier mask) for each holder.
  template <typename F>
  void ForEach(F&& f) const {
    switch (tag()) {
      case kOne: f(InlineWorker(), OneMask()); return;
      case kTwo: {
        const Holder a = TwoAt(0), b = TwoAt(1);
        f(a.worker, TierMask(a.refs));
        f(b.worker, TierMask(b.refs));
        return;
      }
      case kHeap: {
        const Heap* h = heap();
        const Holder* x = h->holders();
        for (uint32_t i = 0; i < h->size; ++i) f(x[i].worker, TierMask(x[i].refs));
        return;
      }
      default: return;
    }
  }
  // True if pred(worker) holds for some holder.
  template <typename P>
  bool Any(P&& pred) const {
    switch (tag()) {
      case kOne: return pred(InlineWorker());
      case kTwo: return pred(static_cast<WorkerId>(bits_ & 0xFFFF)) ||
                        pred(static_cast<WorkerId>((bits_ >> 16) & 0xFFFF));
      case kHeap: {
        const Heap* h = heap();
        const Holder* x = h->holders();
        for (uint32_t i = 0; i < h->size; ++i) {
          if (pred(x[i].worker)) return true;
        }
        return false;
      }
      default: return false;
    }
  }

  uint64_t HeapBytes() const {
    return tag() == kHeap ? sizeof(Heap) + sizeof(Holder) * heap()->cap : 0;
  }
  // Frees the heap array, if any, and empties the set.
  void Release() {
    if (tag() == kHeap) std::free(heap());
    bits_ = 0;
  }

 private:
  static constexpr uint8_t kEmpty = 0, kOne = 1, kHeap = 2, kTwo = 3;
  struct Heap {
    uint64_t sig;
    uint32_t size;
    uint32_t cap;
    Holder* holders() { return reinterpret_cast<Holder*>(this + 1); }
    const Holder* holders() const { return reinterpret_cast<const Holder*>(this + 1); }
  };
  static_assert(sizeof(Heap) == 16 && sizeof(Holder) == 8, "heap layout");

  uint8_t tag() const { return static_cast<uint8_t>(bits_ >> 56); }
  WorkerId InlineWorker() const { return static_cast<WorkerId>(bits_); }
  uint8_t OneMask() const {
    return static_cast<uint8_t>(((bits_ >> 32) & 0xFF ? 1 : 0) | ((bits_ >> 40) & 0xFF ? 2 : 0) |
                                ((bits_ >> 48) & 0xFF ? 4 : 0));
  }
  Holder One() const {
    return Holder{InlineWorker(),
                  {static_cast<uint8_t>(bits_ >> 32), static_cast<uint8_t>(bits_ >> 40),
                   static_cast<uint8_t>(bits_ >> 48)},
                  0};
  }
  void SetOne(const Holder& h) {
    bits_ = (uint64_t{kOne} << 56) | (uint64_t{h.refs[0]} << 32) | (uint64_t{h.refs[1]} << 40) |
            (uint64_t{h.refs[2]} << 48) | h.worker;
  }
  static bool FitsTwo(const Holder& h) {
    return h.worker < 0x10000 && h.refs[0] < 16 && h.refs[1] < 16 && h.refs[2] < 16;
  }
  Holder TwoAt(int i) const {
    const uint64_t c = bits_ >> (32 + 12 * i);
    return Holder{static_cast<WorkerId>((bits_ >> (16 * i)) & 0xFFFF),
                  {static_cast<uint8_t>(c & 0xF), static_cast<uint8_t>((c >> 4) & 0xF),
                   static_cast<uint8_t>((c >> 8) & 0xF)},
                  0};
  }
  // REQUIRES: FitsTwo(a) && FitsTwo(b).
  void SetTwo(const Holder& a, const Holder& b) {
    auto counts = [](const Holder& h) {
      return uint64_t{h.refs[0]} | (uint64_t{h.refs[1]} << 4) | (uint64_t{h.refs[2]} << 8);
    };
    bits_ = (uint64_t{kTwo} << 56) | (counts(b) << 44) | (counts(a) << 32) |
            (uint64_t{b.worker} << 16) | a.worker;
  }
  Heap* heap() const {
    return reinterpret_cast<Heap*>(static_cast<uintptr_t>(bits_ & ((uint64_t{1} << 56) - 1)));
  }
  void SetHeap(Heap* h) { bits_ = (uint64_t{kHeap} << 56) | reinterpret_cast<uintptr_t>(h); }
  // Throws (changing nothing) if the allocation fails or its address needs the top byte (a
  // tagged heap, e.g. arm64 MTE), before any caller has touched its set.
  static Heap* NewHeap(uint32_t cap) {
    auto* h = static_cast<Heap*>(std::malloc(sizeof(Heap) + sizeof(Holder) * cap));
    if (h == nullptr) throw std::bad_alloc();
    if (reinterpret_cast<uintptr_t>(h) >> 56) {
      std::free(h);
      throw std::bad_alloc();
    }
    h->sig = 0;
    h->size = 0;
    h->cap = cap;
    return h;
  }
  static Holder* FindIn(Heap* h, WorkerId w) {
    Holder* x = h->holders();
    for (uint32_t i = 0; i < h->size; ++i) {
      if (x[i].worker == w) return &x[i];
    }
    return nullptr;
  }
  static void Retier(Heap* h, WorkerId w, uint8_t before, uint8_t now) {
    if (now != before) h->sig ^= HolderSig(w, before) ^ HolderSig(w, now);
  }
  // Moves these holders (the set's, plus one being added) to a heap array of `cap`.
  // Returns the heap bytes added.
  int64_t ToHeap(std::initializer_list<Holder> hs, uint32_t cap) {
    Heap* h = NewHeap(cap);
    for (const Holder& x : hs) {
      h->holders()[h->size++] = x;
      h->sig ^= HolderSig(x.worker, TierMask(x.refs));
    }
    SetHeap(h);
    return static_cast<int64_t>(sizeof(Heap) + sizeof(Holder) * cap);
  }
  int64_t GrowHeap() {
    Heap* old = heap();
    const uint32_t ncap = old->cap * 2;
    Heap* h = NewHeap(ncap);
    h->sig = old->sig;
    h->size = old->size;
    std::memcpy(h->holders(), old->holders(), sizeof(Holder) * old->size);
    const int64_t delta = static_cast<int64_t>(sizeof(Holder)) * (ncap - old->cap);
    std::free(old);
    SetHeap(h);
    return delta;
  }

  uint64_t bits_ = 0;
};

static_assert(sizeof(HolderSet) == 8, "HolderSet should stay one word");

}  // namespace kvroute
