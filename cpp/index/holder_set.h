// HolderSet: the workers holding one block key, with their per-tier reference counts, and a
// run key that lets a prefix match skip runs of blocks held by the same workers.
//
// Eight bytes (one word), so a block record (block_slab.h) is 16:
//   top byte 0   empty
//   top byte 1   one holder inline: worker (bits 0-31), GPU / CPU / disk counts (8 bits each)
//   top byte 3   two holders inline: workers (16 bits each, bits 0-31), counts (4 bits each,
//                bits 32-55); used while both ids are below 65,536 and counts below 16
//   top byte 2   a shared holder array (pointer in bits 0-55, HolderArray below): holders
//                sorted by worker, 8-byte Holders {worker, counts (8 bits each)}
// Most blocks live on one or two workers (a conversation and its replica); a block shared
// more widely (a system prompt on every worker) points to an array of its HolderPool. The
// pool interns arrays: every block with the same holders and counts points to one immutable
// array (a 64-block system prompt on 60 workers: one array, not 64), which an update replaces
// by the interned array of the new content (copy on write) and which is freed with its last
// reference. A count is the number of the worker's engine hashes holding this key on that
// tier: 1 in practice, at most 255 here (AddRef refuses past that, and the Index then does not
// count the engine hash either).
//
// Index::FindMatches compares run keys (RunKey(): the word itself, which interning makes equal
// for equal holders and counts in every form) of consecutive blocks and touches the holders
// only where the set changes (a 64-block system prompt on 60 workers: 60 holder updates, not
// 3,840).
//
// A HolderSet is a plain word: it is copied with the record it lives in and never frees on
// its own. The owner calls Release(pool) before dropping a non-empty set (the Index drops
// records only once they are empty, which releases the array on the last DropRef).
//
// Thread safety: none (the Index's lock guards sets and pool; arrays never change once
// interned, so readers under a shared lock see whole ones).
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <new>
#include <vector>

#include <tsl/robin_map.h>

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

// An interned holder array: holders sorted by worker (unused bytes 0, so equal contents are
// equal bytes), shared by `refs` HolderSets.
struct HolderArray {
  uint64_t hash;  // content hash (HolderPool's key)
  uint32_t size;
  uint32_t refs;
  bool pooled;  // false for the (2^-64) array whose content hash another content has
  Holder* holders() { return reinterpret_cast<Holder*>(reinterpret_cast<char*>(this) + kHeader); }
  const Holder* holders() const {
    return reinterpret_cast<const Holder*>(reinterpret_cast<const char*>(this) + kHeader);
  }
  uint64_t Bytes() const { return kHeader + sizeof(Holder) * size; }
  static constexpr size_t kHeader = 24;
};
static_assert(sizeof(HolderArray) <= HolderArray::kHeader, "holder array header");

// The interned holder arrays of one Index, by content hash. Interning a content that exists
// takes a reference to it; the last Unref frees it. Thread safety: none (the Index's lock).
class HolderPool {
 public:
  HolderPool() = default;
  HolderPool(const HolderPool&) = delete;
  HolderPool& operator=(const HolderPool&) = delete;
  ~HolderPool() {
    for (auto& [hash, a] : by_hash_) std::free(a);
  }

  // Content hash: kSeed ^ n ^ the XOR over holders of Hash(holder), so an update changes it
  // in O(1) (a set on 500 workers is not rehashed per reference).
  static constexpr uint64_t kSeed = 0x243F6A8885A308D3ull;
  static uint64_t Hash(const Holder& h) { return Fmix64(Pack(h)); }
  static uint64_t ContentHash(const Holder* hs, uint32_t n) {
    uint64_t hash = kSeed ^ n;
    for (uint32_t i = 0; i < n; ++i) hash ^= Hash(hs[i]);
    return hash;
  }

  // The array holding hs[0, n) (sorted by worker, n >= 2; `hash` = ContentHash of it), with
  // one more reference. *added: bytes allocated (0 if it existed). Throws std::bad_alloc,
  // changing nothing.
  HolderArray* Intern(const Holder* hs, uint32_t n, uint64_t hash, int64_t* added) {
    *added = 0;
    auto it = by_hash_.find(hash);
    if (it != by_hash_.end()) {
      HolderArray* a = it->second;
      if (a->size == n && std::memcmp(a->holders(), hs, sizeof(Holder) * n) == 0) {
        ++a->refs;
        return a;
      }
    }
    HolderArray* a = New(hs, n, hash);
    if (it == by_hash_.end()) {
      try {
        by_hash_.emplace(hash, a);
      } catch (...) {
        std::free(a);
        throw;
      }
      a->pooled = true;
    }
    *added = static_cast<int64_t>(a->Bytes());
    return a;
  }
  // One reference fewer; frees the array with the last. Returns the bytes freed.
  int64_t Unref(HolderArray* a) {
    if (--a->refs > 0) return 0;
    const int64_t bytes = static_cast<int64_t>(a->Bytes());
    if (a->pooled) by_hash_.erase(a->hash);
    std::free(a);
    return bytes;
  }
  size_t size() const { return by_hash_.size(); }
  // The pool's own table (the arrays are counted by their owners).
  uint64_t TableBytes() const { return by_hash_.bucket_count() * (sizeof(uint64_t) * 2 + 8); }

 private:
  static uint64_t Pack(const Holder& h) {
    return uint64_t{h.worker} | (uint64_t{h.refs[0]} << 32) | (uint64_t{h.refs[1]} << 40) |
           (uint64_t{h.refs[2]} << 48);
  }
  // Throws (freeing nothing) if the allocation fails or its address needs the top byte (a
  // tagged heap, e.g. arm64 MTE), before any caller has touched its set.
  static HolderArray* New(const Holder* hs, uint32_t n, uint64_t hash) {
    auto* a = static_cast<HolderArray*>(std::malloc(HolderArray::kHeader + sizeof(Holder) * n));
    if (a == nullptr) throw std::bad_alloc();
    if (reinterpret_cast<uintptr_t>(a) >> 56) {
      std::free(a);
      throw std::bad_alloc();
    }
    a->hash = hash;
    a->size = n;
    a->refs = 1;
    a->pooled = false;
    std::memcpy(a->holders(), hs, sizeof(Holder) * n);
    return a;
  }

  tsl::robin_map<uint64_t, HolderArray*> by_hash_;
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
  // if that count is at kMaxRefs. *new_holder: w was not a holder before. *heap_delta: bytes
  // of shared arrays allocated minus freed, for memory accounting. Throws std::bad_alloc,
  // changing nothing. Its common case (AddInline, most stores from empty tables) is inline:
  // with Index::AddEngineRef's and AddHolderRef's, that saves three calls per stored block.
  bool AddRef(HolderPool& pool, WorkerId w, int tier, bool* new_holder, int64_t* heap_delta) {
    if (AddInline(w, tier)) {
      *new_holder = true;
      *heap_delta = 0;
      return true;
    }
    return AddRefSlow(pool, w, tier, new_holder, heap_delta);
  }
  // A new holder that stays inline (the set was empty, or held one other worker and both fit
  // the two-holder form): true, and `w` holds it once on `tier`; false, and nothing changed,
  // otherwise.
  bool AddInline(WorkerId w, int tier) {
    if (tag() == kEmpty) {
      bits_ = (uint64_t{kOne} << 56) | (uint64_t{1} << (32 + 8 * tier)) | w;
      return true;
    }
    if (tag() != kOne || InlineWorker() == w) return false;
    const Holder a = One();
    Holder b{w, {0, 0, 0}, 0};
    b.refs[tier] = 1;
    if (!FitsTwo(a) || !FitsTwo(b)) return false;
    SetTwo(a, b);
    return true;
  }

  // `n` fewer engine hashes of `w` hold the key on `tier` (floored at 0). Returns true if w
  // stopped being a holder (no tier left). *heap_delta: bytes of shared arrays allocated
  // minus freed. Throws std::bad_alloc, changing nothing (only while a holder keeps tiers
  // on a set of three or more, which needs a new array).
  bool DropRef(HolderPool& pool, WorkerId w, int tier, uint32_t n, int64_t* heap_delta) {
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
    HolderArray* old = heap();
    std::vector<Holder>& next = Scratch();
    next.assign(old->holders(), old->holders() + old->size);
    Holder* x = FindIn(next, w);
    if (x == nullptr) return false;
    const uint64_t hash = old->hash ^ HolderPool::Hash(*x);
    const std::array<uint8_t, kNumMedia> before = x->refs;
    x->refs[tier] = static_cast<uint8_t>(x->refs[tier] > n ? x->refs[tier] - n : 0);
    if (TierMask(x->refs) != 0) {
      if (x->refs != before) *heap_delta = Replace(pool, next, hash ^ HolderPool::Hash(*x));
      return false;
    }
    next.erase(next.begin() + (x - next.data()));
    if (next.size() <= 1) {  // back inline: a lone holder always fits
      const bool one = next.size() == 1;
      const Holder last = one ? next[0] : Holder{};
      *heap_delta = -pool.Unref(old);
      bits_ = 0;
      if (one) SetOne(last);
      return true;
    }
    *heap_delta = Replace(pool, next, hash ^ old->size ^ (old->size - 1));
    return true;
  }

  // XOR over holders of HolderSig(worker, tier mask) (equal for equal sets of (worker, tiers);
  // unequal sets collide with probability 2^-64); 0 for an empty set. O(holders), for tests and
  // debugging: the prefix walk compares RunKey() instead.
  uint64_t Signature() const {
    uint64_t sig = 0;
    ForEach([&sig](WorkerId w, uint8_t mask) { sig ^= HolderSig(w, mask); });
    return sig;
  }

  // What the prefix walk compares between consecutive blocks: the word itself. Equal words
  // are equal holders with equal counts in every form (arrays are interned: one per content),
  // so equal run keys mean equal sets of (worker, tier mask); unequal keys of equal sets
  // (counts differing, one set inline and one in an array) only end a run early, which is
  // exact. Reads no memory.
  uint64_t RunKey() const { return bits_; }

  // Starts the load of a shared array's holders (read where a run changes); no-op inline.
  void PrefetchHolders() const {
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
        const HolderArray* h = heap();
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
        const HolderArray* h = heap();
        const Holder* x = h->holders();
        for (uint32_t i = 0; i < h->size; ++i) {
          if (pred(x[i].worker)) return true;
        }
        return false;
      }
      default: return false;
    }
  }

  // Bytes of the shared array this set points to (0 inline), whoever else shares it.
  uint64_t HeapBytes() const { return tag() == kHeap ? heap()->Bytes() : 0; }
  // Releases the shared array, if any, and empties the set. Returns the bytes freed.
  int64_t Release(HolderPool& pool) {
    const int64_t freed = tag() == kHeap ? pool.Unref(heap()) : 0;
    bits_ = 0;
    return freed;
  }

 private:
  // AddRef's other cases. REQUIRES: AddInline(w, tier) declined (so the set is not empty).
  __attribute__((noinline)) bool AddRefSlow(HolderPool& pool, WorkerId w, int tier,
                                            bool* new_holder, int64_t* heap_delta) {
    *new_holder = false;
    *heap_delta = 0;
    switch (tag()) {
      case kOne: {
        const Holder a = One();
        if (a.worker == w) {
          if (a.refs[tier] == kMaxRefs) return false;
          bits_ += uint64_t{1} << (32 + 8 * tier);
          return true;
        }
        // Another worker, and the two do not fit inline (AddInline).
        Holder b{w, {0, 0, 0}, 0};
        b.refs[tier] = 1;
        *new_holder = true;
        Holder hs[2] = {a, b};
        *heap_delta = ToArray(pool, hs, 2);
        return true;
      }
      case kTwo: {
        Holder h[3] = {TwoAt(0), TwoAt(1), Holder{w, {0, 0, 0}, 0}};
        for (int i = 0; i < 2; ++i) {
          if (h[i].worker != w) continue;
          ++h[i].refs[tier];
          if (FitsTwo(h[i])) {
            SetTwo(h[0], h[1]);
          } else {
            *heap_delta = ToArray(pool, h, 2);
          }
          return true;
        }
        h[2].refs[tier] = 1;
        *new_holder = true;
        *heap_delta = ToArray(pool, h, 3);
        return true;
      }
      default: break;
    }
    const HolderArray* old = heap();
    std::vector<Holder>& next = Scratch();
    next.assign(old->holders(), old->holders() + old->size);
    Holder* x = FindIn(next, w);
    uint64_t hash = old->hash;
    if (x == nullptr) {
      // Sorted insert of a new holder (counts 0 until the increment below).
      size_t at = 0;
      while (at < next.size() && next[at].worker < w) ++at;
      next.insert(next.begin() + static_cast<std::ptrdiff_t>(at), Holder{w, {0, 0, 0}, 0});
      x = &next[at];
      hash ^= old->size ^ (old->size + 1);
      *new_holder = true;
    } else {
      if (x->refs[tier] == kMaxRefs) return false;  // (a new holder starts at 0: never here)
      hash ^= HolderPool::Hash(*x);
    }
    ++x->refs[tier];
    hash ^= HolderPool::Hash(*x);
    *heap_delta = Replace(pool, next, hash);
    return true;
  }
  static constexpr uint8_t kEmpty = 0, kOne = 1, kHeap = 2, kTwo = 3;

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
  HolderArray* heap() const {
    return reinterpret_cast<HolderArray*>(
        static_cast<uintptr_t>(bits_ & ((uint64_t{1} << 56) - 1)));
  }
  void SetHeap(HolderArray* h) {
    bits_ = (uint64_t{kHeap} << 56) | reinterpret_cast<uintptr_t>(h);
  }
  // The new content of an array under construction (one per thread: the Index's lock
  // serialises updates, but several indexes may update at once).
  static std::vector<Holder>& Scratch() {
    thread_local std::vector<Holder> v;
    return v;
  }
  static Holder* FindIn(std::vector<Holder>& hs, WorkerId w) {
    for (Holder& x : hs) {
      if (x.worker == w) return &x;
    }
    return nullptr;
  }
  // Moves the inline holders hs[0, n) (two or three, the new one included) to their
  // interned array. Returns the bytes allocated.
  int64_t ToArray(HolderPool& pool, Holder* hs, uint32_t n) {
    std::sort(hs, hs + n, [](const Holder& a, const Holder& b) { return a.worker < b.worker; });
    int64_t added;
    SetHeap(pool.Intern(hs, n, HolderPool::ContentHash(hs, n), &added));
    return added;
  }
  // Points the set at the array of `next` (sorted, two or more holders; `hash` its content
  // hash), releasing the old. Returns the bytes allocated minus freed.
  int64_t Replace(HolderPool& pool, const std::vector<Holder>& next, uint64_t hash) {
    HolderArray* old = heap();
    int64_t added;
    HolderArray* a = pool.Intern(next.data(), static_cast<uint32_t>(next.size()), hash, &added);
    SetHeap(a);
    return added - pool.Unref(old);
  }

  uint64_t bits_ = 0;
};

static_assert(sizeof(HolderSet) == 8, "HolderSet should stay one word");

}  // namespace kvroute
