// Allocator for the index's big tables: allocations of 2 MiB and more are mapped with
// madvise(MADV_HUGEPAGE), so a prefix match over a table of tens of MiB takes one TLB entry
// per 2 MiB instead of per 4 KiB (a lookup is a random access: without it, most lookups pay a
// TLB miss on top of the cache miss). Allocations of 8 KiB and more are mapped on their own
// (returned to the system when freed; from 64 KiB before: the small tables a growing engine
// table leaves behind stayed in malloc's free lists, ~1 B of resident memory per indexed
// (block, worker) at 256 workers); smaller ones use malloc. Linux only; elsewhere, or if
// madvise fails, the pages are ordinary.
#pragma once

#include <sys/mman.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <new>

namespace kvroute {

// One freed mapping per length (8 to 64 KiB), kept for the next table of that length. Tables
// of one kind grow through the same capacities, so when many workers' engine tables grow in
// step, each growth takes the mapping freed by the one before it: no munmap (which, with two
// threads of the process on two CPUs, costs a TLB shootdown: the replay at two threads lost a
// quarter of its rate to these) and no fresh page faults. At most kSlots mappings (< 512 KiB)
// stay resident. Thread safety: a mutex (growths are rare).
class MappingCache {
 public:
  static constexpr std::size_t kBelow = 64u << 10;  // only smaller mappings are kept
  // A kept mapping of exactly `len` bytes (zeroed), or null.
  static void* Take(std::size_t len) {
    std::lock_guard lock(mu_);
    for (auto& [l, p] : slots_) {
      if (p != nullptr && l == len) {
        void* out = p;
        p = nullptr;
        std::memset(out, 0, len);  // callers rely on fresh mappings being zero
        return out;
      }
    }
    return nullptr;
  }
  // Keeps `p` if no mapping of its length is kept and a slot is free; false: unmap it.
  static bool Put(void* p, std::size_t len) {
    if (len >= kBelow) return false;
    std::lock_guard lock(mu_);
    std::pair<std::size_t, void*>* free_slot = nullptr;
    for (auto& s : slots_) {
      if (s.second != nullptr && s.first == len) return false;
      if (s.second == nullptr && free_slot == nullptr) free_slot = &s;
    }
    if (free_slot == nullptr) return false;
    *free_slot = {len, p};
    return true;
  }

 private:
  static constexpr std::size_t kSlots = 8;
  inline static std::mutex mu_;
  inline static std::array<std::pair<std::size_t, void*>, kSlots> slots_{};
};

template <typename T>
class HugePageAllocator {
 public:
  using value_type = T;
  static constexpr std::size_t kHuge = 2u << 20;
  static constexpr std::size_t kPage = 4096;
  static constexpr std::size_t kMapped = 8u << 10;  // mmap from here on
  static std::size_t Len(std::size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

  HugePageAllocator() noexcept = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}  // NOLINT(runtime/explicit)

  // huge = false: the same mapping without huge pages (resident memory follows the pages
  // actually touched, 4 KiB at a time). populate = true: a new mapping's pages are faulted in
  // at once, writable (madvise MADV_POPULATE_WRITE, Linux 5.14; best effort), for a table that
  // is about to be filled throughout: one call instead of a fault per page, and no read
  // fault on the shared zero page before each write fault (a growth reads a slot before it
  // writes it).
  T* allocate(std::size_t n, bool huge = true, bool populate = false) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes >= kHuge && huge) {
      // Map 2 MiB more than needed, keep a 2 MiB-aligned window of the size rounded up to
      // 4 KiB, and unmap the rest: the whole 2 MiB pieces get huge pages, the tail ordinary
      // ones, so resident memory follows the table's size instead of rounding it up to 2 MiB.
      const std::size_t len = Len(bytes);
      void* m = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
      if (m == MAP_FAILED) throw std::bad_alloc();
      const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(m);
      const std::uintptr_t start = (base + kHuge - 1) / kHuge * kHuge;
      if (start > base) munmap(m, start - base);
      const std::uintptr_t end = base + len + kHuge;
      if (end > start + len) munmap(reinterpret_cast<void*>(start + len), end - (start + len));
#ifdef MADV_HUGEPAGE
      madvise(reinterpret_cast<void*>(start), len, MADV_HUGEPAGE);  // best effort
#endif
      if (populate) Populate(reinterpret_cast<void*>(start), len);
      return reinterpret_cast<T*>(start);
    }
    if (bytes >= kMapped) {
      // Mapped on their own too, so a table that grows returns its old slots to the system
      // (from malloc's heap they would stay resident as holes).
      if (void* kept = MappingCache::Take(Len(bytes))) return static_cast<T*>(kept);
      void* m = mmap(nullptr, Len(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
      if (m == MAP_FAILED) throw std::bad_alloc();
      if (populate) Populate(m, Len(bytes));
      return static_cast<T*>(m);
    }
    void* p = std::malloc(bytes == 0 ? 1 : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }

  // As allocate(), but zeroed (mappings are zero pages already; smaller blocks use calloc).
  T* allocate_zeroed(std::size_t n, bool populate = false) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes >= kMapped) return allocate(n, true, populate);
    void* p = std::calloc(bytes == 0 ? 1 : bytes, 1);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }

  // Elements that fit in the memory an allocation of n elements takes: a mapping's pages are
  // whole (4 KiB), so its last one has room to spare; n for smaller (malloc'd) blocks.
  static std::size_t usable(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    return bytes >= kMapped ? Len(bytes) / sizeof(T) : n;
  }

  void deallocate(T* p, std::size_t n) noexcept {
    const std::size_t bytes = n * sizeof(T);
    if (bytes >= kMapped) {
      if (!MappingCache::Put(p, Len(bytes))) munmap(p, Len(bytes));
    } else {
      std::free(p);
    }
  }

  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const noexcept { return true; }
  // Faults in [p, p + len) for writing; a kernel without MADV_POPULATE_WRITE (before 5.14)
  // returns EINVAL and the pages come on first touch as before.
  static void Populate(void* p, std::size_t len) noexcept {
#ifdef __linux__
    constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE (older headers lack the name)
    madvise(p, len, kPopulateWrite);
#else
    (void)p;
    (void)len;
#endif
  }
  template <typename U>
  bool operator!=(const HugePageAllocator<U>&) const noexcept { return false; }
};

}  // namespace kvroute
