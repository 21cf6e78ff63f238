// What a page costs the index's tables on this machine: µs per 4 KiB page to fault in a fresh
// anonymous mapping (madvise MADV_POPULATE_WRITE, as HugePageAllocator::Populate does; by write
// faults; with MAP_POPULATE), to unmap it, and to zero it with memset; and per 4 KiB with
// transparent huge pages (a 2 MiB-aligned mapping with MADV_HUGEPAGE). A table that grows by
// 1.5x maps its new size whole and unmaps the old one, so these costs bound what a store from
// empty tables pays for growth (benchmarks/README.md, issue 7, ninth round).
//
//   g++ -O2 -std=c++17 benchmarks/page_probe.cc -o /tmp/page_probe && /tmp/page_probe
//
// Linux only. Prints one table: mappings of 256 KiB (a mid-size engine table) and 64 MiB.
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE (Linux 5.14; older headers lack it)
constexpr size_t kPage = 4096;
constexpr size_t kHuge = 2u << 20;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

char* Map(size_t len, int extra_flags = 0) {
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | extra_flags,
                 -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  return static_cast<char*>(p);
}

// A 2 MiB-aligned mapping of len bytes (a multiple of 2 MiB) with MADV_HUGEPAGE.
char* MapHuge(size_t len) {
  char* m = Map(len + kHuge);
  const uintptr_t base = reinterpret_cast<uintptr_t>(m);
  const uintptr_t start = (base + kHuge - 1) / kHuge * kHuge;
  if (start > base) munmap(m, start - base);
  const uintptr_t end = base + len + kHuge;
  if (end > start + len) munmap(reinterpret_cast<void*>(start + len), end - (start + len));
  madvise(reinterpret_cast<void*>(start), len, MADV_HUGEPAGE);
  return reinterpret_cast<char*>(start);
}

struct Row {
  double populate = 0, faults = 0, map_populate = 0, munmap_us = 0, memset_us = 0, huge = 0;
};

Row Measure(size_t len, int reps) {
  Row r;
  for (int i = 0; i < reps; ++i) {
    char* p = Map(len);
    madvise(p, len, MADV_NOHUGEPAGE);
    double t0 = Now();
    madvise(p, len, kPopulateWrite);
    r.populate += Now() - t0;
    t0 = Now();
    std::memset(p, 0, len);  // pages present: zeroing alone
    r.memset_us += Now() - t0;
    t0 = Now();
    munmap(p, len);
    r.munmap_us += Now() - t0;

    p = Map(len);
    madvise(p, len, MADV_NOHUGEPAGE);
    t0 = Now();
    for (size_t o = 0; o < len; o += kPage) p[o] = 1;
    r.faults += Now() - t0;
    munmap(p, len);

    t0 = Now();
    p = Map(len, MAP_POPULATE);
    r.map_populate += Now() - t0;
    munmap(p, len);

    const size_t hlen = (len + kHuge - 1) / kHuge * kHuge;
    p = MapHuge(hlen);
    t0 = Now();
    madvise(p, hlen, kPopulateWrite);
    r.huge += (Now() - t0) * static_cast<double>(len) / static_cast<double>(hlen);
    munmap(p, hlen);
  }
  const double pages = static_cast<double>(reps) * static_cast<double>(len / kPage) / 1e6;
  r.populate /= pages;
  r.faults /= pages;
  r.map_populate /= pages;
  r.munmap_us /= pages;
  r.memset_us /= pages;
  r.huge /= pages;
  return r;
}

}  // namespace

int main() {
  std::printf("µs per 4 KiB page (mean over the mappings)\n");
  std::printf("%10s %6s %16s %12s %13s %8s %8s %14s\n", "mapping", "reps", "POPULATE_WRITE",
              "write faults", "MAP_POPULATE", "munmap", "memset", "THP populate");
  const struct {
    size_t len;
    int reps;
  } cases[] = {{256u << 10, 256}, {64u << 20, 4}};
  for (const auto& c : cases) {
    const Row r = Measure(c.len, c.reps);
    std::printf("%7zu KiB %6d %16.2f %12.2f %13.2f %8.2f %8.2f %14.2f\n", c.len >> 10, c.reps,
                r.populate, r.faults, r.map_populate, r.munmap_us, r.memset_us, r.huge);
  }
  return 0;
}
