// What the machine's memory allows a hash-table walk: ns per random 8-byte load in an array of
// N MiB (huge pages when THP allows), independent loads with a software prefetch D loads ahead
// (D = 0: none), then a dependent pointer chase (the latency). Best of 5 passes of 1M loads.
//
//   g++ -O2 -o /tmp/memory_probe benchmarks/memory_probe.cc && /tmp/memory_probe 12
//
// The prefix walk needs one random block-table slot per block: the independent rate bounds it.
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
int main(int argc, char** argv) {
  size_t mb = argc > 1 ? atoi(argv[1]) : 12;
  size_t bytes = mb << 20;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, bytes, MADV_HUGEPAGE);
  uint64_t* a = (uint64_t*)p;
  size_t n = bytes / 8;
  for (size_t i = 0; i < n; ++i) a[i] = i * 0x9E3779B97F4A7C15ull;
  const size_t K = 1 << 20;
  std::vector<uint32_t> idx(K);
  uint64_t s = 88172645463325252ull;
  for (auto& x : idx) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; x = s % n; }
  for (int D : {0, 4, 8, 16, 32, 64}) {
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      uint64_t sum = 0;
      for (size_t i = 0; i < K; ++i) {
        if (D && i + D < K) __builtin_prefetch(&a[idx[i + D]]);
        sum += a[idx[i]];
      }
      auto t1 = std::chrono::steady_clock::now();
      double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / K;
      if (ns < best) best = ns;
      if (sum == 42) puts("");
    }
    printf("%zu MB  prefetch distance %2d: %.1f ns/access\n", mb, D, best);
  }
  // latency: pointer chase
  size_t cur = 0; auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < K; ++i) cur = (a[cur] ^ idx[i]) % n;
  auto t1 = std::chrono::steady_clock::now();
  printf("dependent chase: %.1f ns/access (%zu)\n", std::chrono::duration<double, std::nano>(t1 - t0).count() / K, cur % 2);
}
