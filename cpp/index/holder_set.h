// HolderSet: the workers holding one block key, with their per-tier reference counts, and a
// signature of the set that lets a prefix match skip runs of blocks held by the same workers.
//
// One holder is stored inline (most blocks live on one worker); more go to one heap array
// preceded by a 16-byte header that keeps the signature. The signature is the XOR over
// holders of HolderSig(worker, tiers): equal sets of (worker, tiers) always have equal
// signatures, unequal sets collide with probability 2^-64 (a XOR of distinct fmix64 outputs).
// Index::FindMatches compares signatures of consecutive blocks and touches the holders only
// where the set changes (a 64-block system prompt on 60 workers: 60 holder updates, not 3,840).
//
// Thread safety: none (the Index's lock guards it). Not copyable; movable.
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "common/block_key.h"
#include "common/types.h"

namespace kvroute {

struct Holder {
  WorkerId worker;
  // How many of the worker's engine hashes hold this key on GPU, CPU, disk.
  std::array<uint16_t, kNumMedia> refs;
};

// Tiers holding the block, one bit each: 1 GPU, 2 CPU, 4 disk (0: none).
inline uint8_t TierMask(const std::array<uint16_t, kNumMedia>& r) {
  return static_cast<uint8_t>((r[0] ? 1 : 0) | (r[1] ? 2 : 0) | (r[2] ? 4 : 0));
}
inline uint64_t HolderSig(WorkerId w, uint8_t mask) {
  return Fmix64(((static_cast<uint64_t>(w) << 3) | mask) + 0x9E3779B97F4A7C15ull);
}

class HolderSet {
 public:
  HolderSet() = default;
  HolderSet(const HolderSet&) = delete;
  HolderSet& operator=(const HolderSet&) = delete;
  HolderSet(HolderSet&& o) noexcept { MoveFrom(o); }
  HolderSet& operator=(HolderSet&& o) noexcept {
    if (this != &o) {
      Free();
      MoveFrom(o);
    }
    return *this;
  }
  ~HolderSet() { Free(); }

  uint32_t size() const { return size_; }
  bool full() const { return size_ == kMaxSize; }
  const Holder* begin() const { return data(); }
  const Holder* end() const { return data() + size_; }

  Holder* Find(WorkerId w) {
    Holder* d = data();
    for (uint32_t i = 0; i < size_; ++i) {
      if (d[i].worker == w) return &d[i];
    }
    return nullptr;
  }

  // Adds worker `w` with no references (tier mask 0). REQUIRES: w not present, !full().
  // Returns the heap bytes added (for memory accounting).
  int64_t Add(WorkerId w) {
    int64_t grown = 0;
    const Holder h{w, {0, 0, 0}};
    if (size_ == cap_) {
      const uint32_t ncap = cap_ >= kMaxSize / 2 ? kMaxSize : cap_ * 2u;
      char* p = static_cast<char*>(std::malloc(kHeader + sizeof(Holder) * ncap));
      if (p == nullptr) throw std::bad_alloc();
      uint64_t sig = Signature();
      std::memcpy(p + kHeader, data(), sizeof(Holder) * size_);
      if (cap_ > 1) {
        std::free(heap());
        grown -= static_cast<int64_t>(kHeader + sizeof(Holder) * cap_);
      }
      set_heap(p);
      cap_ = static_cast<uint16_t>(ncap);
      std::memcpy(p, &sig, sizeof(sig));
      grown += static_cast<int64_t>(kHeader + sizeof(Holder) * ncap);
    }
    data()[size_++] = h;
    XorSig(HolderSig(w, 0));
    return grown;
  }

  // Call after changing h->refs, with the tier mask it had before.
  void Retier(const Holder* h, uint8_t old_mask) {
    if (cap_ <= 1) return;  // inline: the signature is computed on demand
    const uint8_t now = TierMask(h->refs);
    if (now != old_mask) XorSig(HolderSig(h->worker, old_mask) ^ HolderSig(h->worker, now));
  }

  // Removes h (order not kept).
  void Erase(Holder* h) {
    XorSig(HolderSig(h->worker, TierMask(h->refs)));
    *h = data()[size_ - 1];
    --size_;
  }

  // XOR over holders of HolderSig(worker, tier mask); 0 for an empty set.
  uint64_t Signature() const {
    if (cap_ <= 1) return size_ == 0 ? 0 : HolderSig(inline_.worker, TierMask(inline_.refs));
    uint64_t s;
    std::memcpy(&s, heap(), sizeof(s));
    return s;
  }

  uint64_t HeapBytes() const { return cap_ > 1 ? kHeader + sizeof(Holder) * cap_ : 0; }

 private:
  static constexpr uint32_t kMaxSize = 0xFFFF;  // holders per block
  static constexpr size_t kHeader = 16;  // signature + padding (keeps holders 8-aligned)
  char* heap() const {
    char* p;
    std::memcpy(&p, &inline_, sizeof(p));
    return p;
  }
  void set_heap(char* p) { std::memcpy(&inline_, &p, sizeof(p)); }
  Holder* data() { return cap_ <= 1 ? &inline_ : reinterpret_cast<Holder*>(heap() + kHeader); }
  const Holder* data() const {
    return cap_ <= 1 ? &inline_ : reinterpret_cast<const Holder*>(heap() + kHeader);
  }
  void XorSig(uint64_t x) {
    if (cap_ <= 1) return;  // inline: computed on demand
    char* h = heap();
    uint64_t s;
    std::memcpy(&s, h, sizeof(s));
    s ^= x;
    std::memcpy(h, &s, sizeof(s));
  }
  void Free() {
    if (cap_ > 1) std::free(heap());
    cap_ = 1;
    size_ = 0;
  }
  void MoveFrom(HolderSet& o) {
    size_ = o.size_;
    cap_ = o.cap_;
    inline_ = o.inline_;  // the holder, or the heap pointer in its first bytes
    o.size_ = 0;
    o.cap_ = 1;
  }
  // One holder inline; with cap_ > 1 its first 8 bytes hold the heap pointer instead (no
  // union with a pointer member, so the set is 4-byte aligned and 16 bytes long).
  Holder inline_{};
  uint16_t size_ = 0;  // 16-bit counts keep the set at 16 bytes (a BlockTable slot at 24)
  uint16_t cap_ = 1;
};

}  // namespace kvroute
