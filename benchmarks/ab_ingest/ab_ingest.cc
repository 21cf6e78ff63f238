// In-process A/B of stores from empty: two builds of the core linked into one binary (the
// second with `kvroute` renamed, ab_ingest.sh), run in alternation on the same payloads, so
// that the VM's slow and fast spells (±20-30 % from one process to the next here) fall on
// both. Prints each round's rate (M blocks/s of DecodeBatch + Index::Apply) and the median
// of the per-round ratios B / A.
//   ab_ingest store_64.bin [rounds] [decode]     (decode: DecodeBatch alone)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "payloads.h"

double RunA(const std::vector<Payload>& ps, uint32_t workers, bool decode_only, uint64_t* blocks);
double RunB(const std::vector<Payload>& ps, uint32_t workers, bool decode_only, uint64_t* blocks);

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s store_N.bin [rounds]\n", argv[0]);
    return 2;
  }
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  const bool decode_only = argc > 3 && std::string(argv[3]) == "decode";
  std::ifstream f(argv[1], std::ios::binary);
  uint32_t workers = 0, n = 0;
  f.read(reinterpret_cast<char*>(&workers), 4);
  f.read(reinterpret_cast<char*>(&n), 4);
  std::vector<Payload> ps(n);
  for (Payload& p : ps) {
    uint32_t len = 0;
    f.read(reinterpret_cast<char*>(&p.worker), 4);
    f.read(reinterpret_cast<char*>(&len), 4);
    p.bytes.resize(len);
    f.read(p.bytes.data(), len);
  }
  if (!f || rounds < 1) {
    std::fprintf(stderr, "%s: unreadable workload\n", argv[1]);
    return 1;
  }
  std::vector<double> a, b, q;
  for (int r = 0; r < rounds; ++r) {
    uint64_t na = 0, nb = 0;
    const double ta = RunA(ps, workers, decode_only, &na);
    const double tb = RunB(ps, workers, decode_only, &nb);
    a.push_back(na / ta / 1e6);
    b.push_back(nb / tb / 1e6);
    q.push_back(b.back() / a.back());
    std::printf("round %d: A %.2f  B %.2f M blocks/s  B/A %.3f\n", r, a.back(), b.back(), q.back());
    std::fflush(stdout);
  }
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  std::sort(q.begin(), q.end());
  std::printf("%sN = %u, %d rounds: median A %.2f  B %.2f M blocks/s; B/A median %.3f (min %.3f, max %.3f)\n",
              decode_only ? "decode only, " : "", workers, rounds, a[rounds / 2], b[rounds / 2], q[rounds / 2], q[0], q[rounds - 1]);
}
