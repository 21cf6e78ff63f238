// Router::Ingest without Python: compare_dynamo.py's store payloads (--dump-store, as
// ab_ingest uses them) fed one event per call into a fresh Router per round, as
// `Router.ingest` does from Python, so that the two can be run back to back and Python's
// share read off (benchmarks/README.md, "Issue 7, tenth round").
//
//   g++ -O3 -DNDEBUG -DMSGPACK_NO_BOOST=1 -std=c++17 -Icpp benchmarks/router_ingest.cc \
//       build/cp311-cp311-linux_x86_64/libkvroute_core.a -lxxhash -lzmq -lpthread \
//       -o /tmp/router_ingest
//   /tmp/router_ingest /tmp/kvroute_ab/store_64.bin [rounds]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "router/router.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s store_N.bin [rounds]\n", argv[0]);
    return 2;
  }
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  std::ifstream f(argv[1], std::ios::binary);
  uint32_t workers = 0, n = 0;
  f.read(reinterpret_cast<char*>(&workers), 4);
  f.read(reinterpret_cast<char*>(&n), 4);
  std::vector<uint32_t> ws(n);
  std::vector<std::string> ps(n);
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t len = 0;
    f.read(reinterpret_cast<char*>(&ws[i]), 4);
    f.read(reinterpret_cast<char*>(&len), 4);
    ps[i].resize(len);
    f.read(ps[i].data(), len);
  }
  if (!f || rounds < 1) {
    std::fprintf(stderr, "%s: unreadable workload\n", argv[1]);
    return 1;
  }
  std::vector<std::string> names;
  std::vector<kvroute::WorkerConfig> cfg;
  for (uint32_t i = 0; i < workers; ++i) {
    names.push_back("w" + std::to_string(i));
    kvroute::WorkerConfig c;
    c.name = names.back();
    cfg.push_back(c);
  }
  for (int r = 0; r < rounds; ++r) {
    kvroute::RouterOptions o;  // as compare_dynamo's kvroute.Router(names, block_size=16,
    o.index.block_size = 16;   // speculative_ttl=0), with the Python Router's default caps
    o.index.max_blocks_per_worker = uint64_t{1} << 22;
    o.index.max_blocks_total = uint64_t{1} << 25;
    o.speculative_ttl_s = 0;
    kvroute::Router router(o, cfg);
    const auto t0 = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < n; ++i) {
      router.Ingest(names[ws[i]], false, 0, ps[i].data(), ps[i].size());
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    uint64_t blocks = 0;
    for (const auto& st : router.Stats()) blocks += st.apply.blocks_stored;
    std::printf("round %d: %.2f M blocks/s (%.0f ms)\n", r, blocks / s / 1e6, s * 1e3);
  }
}
