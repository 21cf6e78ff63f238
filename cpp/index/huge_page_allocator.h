// Allocator for the index's big tables: allocations of 2 MiB and more are mapped with
// madvise(MADV_HUGEPAGE), so a prefix match over a table of tens of MiB takes one TLB entry
// per 2 MiB instead of per 4 KiB (a lookup is a random access: without it, most lookups pay a
// TLB miss on top of the cache miss). Allocations of 8 KiB and more are mapped on their own,
// returned to the system when freed or kept for the next table (MappingCache): from malloc's
// heap, the small tables a growing engine table leaves behind would stay resident in its free
// lists (~1 B of resident memory per indexed (block, worker) at 256 workers). Smaller ones use
// malloc. Linux only; elsewhere, or if madvise fails, the pages are ordinary.
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

// Faults in [p, p + len) for writing (madvise MADV_POPULATE_WRITE, Linux 5.14; best effort: a
// kernel without it returns EINVAL and the pages come on first touch).
inline void PopulateWrite(void* p, std::size_t len) noexcept {
#ifdef __linux__
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE (older headers lack the name)
  madvise(p, len, kPopulateWrite);
#else
  (void)p;
  (void)len;
#endif
}

// ThreadSanitizer does not intercept mremap, so the shadow state of a moved mapping would go
// stale (false reports between two indexes' growths on two threads): without the extension
// under TSan, a kept mapping only serves a table of its own length.
#if defined(__SANITIZE_THREAD__)
#define KVROUTE_NO_MREMAP 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVROUTE_NO_MREMAP 1
#endif
#endif
#if defined(MREMAP_MAYMOVE) && !defined(KVROUTE_NO_MREMAP)
#define KVROUTE_MREMAP_EXTENDS 1  // a shorter kept mapping can serve a longer table
#endif

// Freed mappings of 8 KiB up to kBelow, kept for the next tables. A growth needs a mapping 1.5x
// the size of the one it frees, and frees that one only once it has been read. When many
// workers' engine tables grow in step, each growth takes a mapping another growth freed: one
// of the same length if one is kept, else the longest shorter one, extended by mremap (the
// kernel moves its page table entries; only the added part is new memory). A fresh mapping
// costs a page fault per 4 KiB (1.4-2 µs each on the VM of benchmarks/README.md), a kept one a
// memset of the part it had; neither costs a munmap (which, with two threads of the process
// on two CPUs, is a TLB shootdown: the replay at two threads lost a quarter of its rate to
// these). Only a table about to be filled throughout (allocated with populate) takes a kept
// mapping, whose pages are all resident; the block slab's first chunk, which should take
// pages as it fills, does not. At most kSlots mappings, kMaxBytes in all, stay resident (the
// mapping kept longest ago goes back to the system first). Cost and gain, measured against
// keeping only 8-64 KiB mappings of the exact length: stores from empty 1.040-1.067 /
// 1.068-1.135 / 1.058-1.089x as fast at N = 8 / 64 / 256 workers (benchmarks/ab_ingest, four
// runs of 15 rounds), resident memory per (block, worker) the same.
// Thread safety: a mutex (growths are rare).
class MappingCache {
 public:
  static constexpr std::size_t kBelow = 1u << 20;     // only shorter mappings are kept
  static constexpr std::size_t kMaxBytes = 2u << 20;  // kept at most, in all
  static_assert(kBelow <= kMaxBytes, "Put's eviction needs room for any mapping it keeps");
#if defined(KVROUTE_MREMAP_EXTENDS)
  static constexpr bool kCanExtend = true;
#else
  static constexpr bool kCanExtend = false;
#endif
  // A mapping of `len` bytes made of a kept one, zeroed, its pages faulted in (the added part
  // by PopulateWrite), or null: none kept is as short, or the extension failed.
  static void* Take(std::size_t len) {
    Kept got{};
    {
      std::lock_guard lock(mu_);
      Kept* best = nullptr;
      for (Kept& k : slots_) {
        if (k.p == nullptr || k.len > len || (!kCanExtend && k.len != len)) continue;
        if (best == nullptr || k.len > best->len) best = &k;
      }
      if (best == nullptr) return nullptr;
      got = *best;
      *best = Kept{};
    }
    std::memset(got.p, 0, got.len);  // callers rely on fresh mappings being zero
    if (got.len == len) return got.p;
#if defined(KVROUTE_MREMAP_EXTENDS)
    void* q = mremap(got.p, got.len, len, MREMAP_MAYMOVE);  // the added pages are zero
    if (q != MAP_FAILED) {
      PopulateWrite(static_cast<char*>(q) + got.len, len - got.len);
      return q;
    }
#endif
    munmap(got.p, got.len);
    return nullptr;
  }
  // Keeps `p` (false: too long to keep, the caller unmaps it). The mappings kept longest ago
  // are unmapped until it fits (kMaxBytes, kSlots).
  static bool Put(void* p, std::size_t len) {
    if (len >= kBelow) return false;
    std::array<Kept, kSlots> evicted{};
    std::size_t n_evicted = 0;
    {
      std::lock_guard lock(mu_);
      for (;;) {
        Kept* room = nullptr;  // a free slot, else the oldest kept
        Kept* oldest = nullptr;
        std::size_t kept_bytes = 0;
        for (Kept& k : slots_) {
          if (k.p == nullptr) {
            if (room == nullptr) room = &k;
            continue;
          }
          kept_bytes += k.len;
          if (oldest == nullptr || k.when < oldest->when) oldest = &k;
        }
        if (room != nullptr && kept_bytes + len <= kMaxBytes) {
          *room = Kept{p, len, ++clock_};
          break;
        }
        evicted[n_evicted++] = *oldest;
        *oldest = Kept{};
      }
    }
    for (std::size_t i = 0; i < n_evicted; ++i) munmap(evicted[i].p, evicted[i].len);
    return true;
  }

  // Bytes kept now (for tests).
  static std::size_t kept_bytes() {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (const Kept& k : slots_) n += k.p != nullptr ? k.len : 0;
    return n;
  }
  // Unmaps every kept mapping (for tests: a known start).
  static void Release() {
    std::array<Kept, kSlots> all{};
    {
      std::lock_guard lock(mu_);
      all = slots_;
      slots_ = {};
    }
    for (const Kept& k : all) {
      if (k.p != nullptr) munmap(k.p, k.len);
    }
  }

 private:
  struct Kept {  // (zero: a free slot)
    void* p;
    std::size_t len;
    uint64_t when;  // order of Put
  };
  static constexpr std::size_t kSlots = 16;
  inline static std::mutex mu_;
  inline static std::array<Kept, kSlots> slots_{};
  inline static uint64_t clock_ = 0;
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
      if (populate) PopulateWrite(reinterpret_cast<void*>(start), len);
      return reinterpret_cast<T*>(start);
    }
    if (bytes >= kMapped) {
      // Mapped on their own too, so a table that grows returns its old slots to the system
      // (from malloc's heap they would stay resident as holes).
      if (populate) {  // (a kept mapping is resident throughout: only for a table to be filled)
        if (void* kept = MappingCache::Take(Len(bytes))) return static_cast<T*>(kept);
      }
      void* m = mmap(nullptr, Len(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
      if (m == MAP_FAILED) throw std::bad_alloc();
      if (populate) PopulateWrite(m, Len(bytes));
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
  template <typename U>
  bool operator!=(const HugePageAllocator<U>&) const noexcept { return false; }
};

}  // namespace kvroute
