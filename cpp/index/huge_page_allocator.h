// Allocator for the index's big tables: allocations of 2 MiB and more are mapped with
// madvise(MADV_HUGEPAGE), so a prefix match over a table of tens of MiB takes one TLB entry
// per 2 MiB instead of per 4 KiB (a lookup is a random access: without it, most lookups pay a
// TLB miss on top of the cache miss). Smaller allocations use malloc. Linux only; elsewhere,
// or if madvise fails, the pages are ordinary.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <new>

namespace kvroute {

template <typename T>
class HugePageAllocator {
 public:
  using value_type = T;
  static constexpr std::size_t kHuge = 2u << 20;

  HugePageAllocator() noexcept = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}  // NOLINT(runtime/explicit)

  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes >= kHuge) {
      const std::size_t len = (bytes + kHuge - 1) / kHuge * kHuge;
      void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
      madvise(p, len, MADV_HUGEPAGE);  // best effort
#endif
      return static_cast<T*>(p);
    }
    void* p = std::malloc(bytes == 0 ? 1 : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }

  void deallocate(T* p, std::size_t n) noexcept {
    const std::size_t bytes = n * sizeof(T);
    if (bytes >= kHuge) {
      munmap(p, (bytes + kHuge - 1) / kHuge * kHuge);
    } else {
      std::free(p);
    }
  }

  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const HugePageAllocator<U>&) const noexcept { return false; }
};

}  // namespace kvroute
