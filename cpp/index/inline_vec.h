// Small inline vector for the index's speculative credits (private to cpp/index/).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

#include "common/types.h"

namespace kvroute {

// A vector with one element stored inline: the Index keeps one per first block key of a
// speculative credit (Index::spec_first_), and most such keys start one credit. Elements
// must be trivially copyable and have a `worker` member. The heap array doubles when full
// (Push returns the bytes it added, for memory accounting). Movable, not copyable.
template <typename T>
class InlineVec {
 public:
  InlineVec() = default;
  InlineVec(const InlineVec&) = delete;
  InlineVec& operator=(const InlineVec&) = delete;
  InlineVec(InlineVec&& o) noexcept { MoveFrom(o); }
  InlineVec& operator=(InlineVec&& o) noexcept {
    if (this != &o) {
      Free();
      MoveFrom(o);
    }
    return *this;
  }
  ~InlineVec() { Free(); }

  uint32_t size() const { return size_; }
  T* data() { return cap_ <= 1 ? &inline_ : heap_; }
  const T* data() const { return cap_ <= 1 ? &inline_ : heap_; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }

  T* Find(WorkerId w) {
    for (T& h : *this) {
      if (h.worker == w) return &h;
    }
    return nullptr;
  }
  // Returns the heap bytes added (for memory accounting).
  int64_t Push(const T& h) {
    int64_t grown = 0;
    if (size_ == cap_) {
      const uint32_t ncap = cap_ * 2;
      auto* p = static_cast<T*>(std::malloc(sizeof(T) * ncap));
      if (p == nullptr) throw std::bad_alloc();
      std::memcpy(p, data(), sizeof(T) * size_);
      if (cap_ > 1) {
        std::free(heap_);
        grown -= static_cast<int64_t>(sizeof(T) * cap_);
      }
      heap_ = p;
      cap_ = ncap;
      grown += static_cast<int64_t>(sizeof(T) * ncap);
    }
    data()[size_++] = h;
    return grown;
  }
  void Erase(T* h) {
    *h = data()[size_ - 1];
    --size_;
  }
  uint64_t HeapBytes() const { return cap_ > 1 ? sizeof(T) * cap_ : 0; }

 private:
  void Free() {
    if (cap_ > 1) std::free(heap_);
    cap_ = 1;
    size_ = 0;
  }
  void MoveFrom(InlineVec& o) {
    size_ = o.size_;
    cap_ = o.cap_;
    if (cap_ > 1) {
      heap_ = o.heap_;
    } else {
      inline_ = o.inline_;
    }
    o.size_ = 0;
    o.cap_ = 1;
  }
  union {
    T inline_;
    T* heap_;
  };
  uint32_t size_ = 0;
  uint32_t cap_ = 1;
};


}  // namespace kvroute
