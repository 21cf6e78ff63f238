// Tests of the scoring layer (cpp/scoring/): kvroute::ApproxTree against a brute-force
// reference (per worker, the set of every token prefix it holds with that prefix's last
// access), hand-made cases, random runs, and a concurrent smoke run (for TSan). Its
// micro-benchmark is benchmarks/bench_approx_tree.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "scoring/approx_tree.h"

using namespace kvroute;

namespace {

__attribute__((format(printf, 1, 2))) std::string Fmt(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

// Stops the enclosing bool function at its first failure (one failure can cascade).
#define REQUIRE(cond, ...)                                                      \
  do {                                                                          \
    if (!(cond)) {                                                              \
      ADD_FAILURE() << "REQUIRE failed: " #cond ": " << Fmt(__VA_ARGS__);       \
      return false;                                                             \
    }                                                                           \
  } while (0)

using Seq = std::vector<uint32_t>;

void Ins(ApproxTree& t, WorkerId w, const Seq& s, double now) {
  t.Insert(w, s.data(), s.size(), now);
}
std::vector<uint32_t> Mat(ApproxTree& t, const Seq& s, double now, size_t num_workers) {
  std::vector<uint32_t> out{7, 7, 7};  // stale content must be overwritten
  t.Match(s.data(), s.size(), now, &out, num_workers);
  return out;
}
std::vector<uint32_t> Pk(const ApproxTree& t, const Seq& s, size_t num_workers) {
  std::vector<uint32_t> out;
  t.Peek(s.data(), s.size(), &out, num_workers);
  return out;
}
std::string Str(const std::vector<uint32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

// ---- brute-force reference -----------------------------------------------------------------

struct Ref {
  // held[w]: every non-empty prefix worker w holds -> its last access.
  std::vector<std::map<Seq, double>> held;

  explicit Ref(size_t workers) : held(workers) {}

  void Insert(WorkerId w, const Seq& s, double now) {
    Seq p;
    for (uint32_t x : s) {
      p.push_back(x);
      auto [it, fresh] = held[w].emplace(p, now);
      if (!fresh) it->second = std::max(it->second, now);
    }
  }
  uint32_t Len(WorkerId w, const Seq& q) const {
    Seq p;
    uint32_t n = 0;
    for (uint32_t x : q) {
      p.push_back(x);
      if (!held[w].count(p)) break;
      ++n;
    }
    return n;
  }
  // Expected Match output; applies the refresh of the best workers.
  std::vector<uint32_t> Match(const Seq& q, double now, size_t num_workers, bool touch) {
    std::vector<uint32_t> out(num_workers, 0);
    uint32_t best = 0;
    for (size_t w = 0; w < num_workers && w < held.size(); ++w) {
      out[w] = Len(static_cast<WorkerId>(w), q);
      best = std::max(best, out[w]);
    }
    if (touch && best > 0) {
      for (size_t w = 0; w < num_workers && w < held.size(); ++w) {
        if (out[w] != best) continue;
        Seq p;
        for (uint32_t i = 0; i < best; ++i) {
          p.push_back(q[i]);
          double& ts = held[w].at(p);
          ts = std::max(ts, now);
        }
      }
    }
    return out;
  }
};

// Full comparison of the tree with the reference: invariants, token counts, the exact set of
// held prefixes per worker and their last access (all tokens of one node share it).
bool Agrees(const ApproxTree& t, const Ref& ref) {
  const std::string inv = t.CheckInvariants();
  REQUIRE(inv.empty(), "%s", inv.c_str());
  std::set<Seq> nodes;
  for (size_t w = 0; w < ref.held.size(); ++w) {
    const auto& h = ref.held[w];
    REQUIRE(t.WorkerTokens(static_cast<WorkerId>(w)) == h.size(), "worker %zu tokens %zu vs %zu",
            w, t.WorkerTokens(static_cast<WorkerId>(w)), h.size());
    size_t covered = 0;
    for (const ApproxTree::HeldEdge& e : t.DebugEdges(static_cast<WorkerId>(w))) {
      nodes.insert(e.path);
      REQUIRE(e.edge_len > 0 && e.edge_len <= e.path.size(), "bad edge");
      for (size_t len = e.path.size() - e.edge_len + 1; len <= e.path.size(); ++len) {
        auto it = h.find(Seq(e.path.begin(), e.path.begin() + static_cast<ptrdiff_t>(len)));
        REQUIRE(it != h.end(), "worker %zu holds %s[:%zu] in the tree only", w,
                Str(e.path).c_str(), len);
        REQUIRE(it->second == e.last_access, "worker %zu %s[:%zu] ts %g vs tree %g", w,
                Str(e.path).c_str(), len, it->second, e.last_access);
        ++covered;
      }
    }
    REQUIRE(covered == h.size(), "worker %zu: tree covers %zu prefixes, reference %zu", w,
            covered, h.size());
  }
  REQUIRE(t.NodeCount() == nodes.size(), "NodeCount %zu vs %zu distinct held nodes",
          t.NodeCount(), nodes.size());
  return true;
}

struct EdgeKey {
  Seq path;
  uint32_t len;
  double ts;
  bool operator<(const EdgeKey& o) const {
    return std::tie(path, len, ts) < std::tie(o.path, o.len, o.ts);
  }
  bool operator==(const EdgeKey& o) const {
    return path == o.path && len == o.len && ts == o.ts;
  }
};

std::set<EdgeKey> Edges(const ApproxTree& t, WorkerId w) {
  std::set<EdgeKey> s;
  for (const auto& e : t.DebugEdges(w)) s.insert({e.path, e.edge_len, e.last_access});
  return s;
}

// Runs EvictTo(max) and checks it against the reference. exact: no two operations shared a
// timestamp, so the order is fully determined (oldest first; in a chain of equal stamps,
// deepest first) and the evicted set is predicted node by node. Otherwise checks the limit,
// that nothing evicted is newer than anything kept, and that eviction stopped in time.
bool CheckEvict(ApproxTree& t, Ref& ref, size_t max, bool exact) {
  const size_t workers = ref.held.size();
  std::vector<std::set<EdgeKey>> before, expect;
  before.resize(workers);
  expect.resize(workers);
  size_t expect_evicted = 0;
  for (size_t w = 0; w < workers; ++w) {
    before[w] = Edges(t, static_cast<WorkerId>(w));
    std::vector<EdgeKey> order(before[w].begin(), before[w].end());
    std::sort(order.begin(), order.end(), [](const EdgeKey& a, const EdgeKey& b) {
      if (a.ts != b.ts) return a.ts < b.ts;
      return a.path.size() > b.path.size();
    });
    size_t tokens = ref.held[w].size();
    expect[w] = before[w];
    for (const EdgeKey& e : order) {
      if (tokens <= max) break;
      tokens -= e.len;
      expect_evicted += e.len;
      expect[w].erase(e);
    }
  }
  const size_t evicted = t.EvictTo(max);
  size_t evicted_seen = 0;
  for (size_t w = 0; w < workers; ++w) {
    const std::set<EdgeKey> after = Edges(t, static_cast<WorkerId>(w));
    const size_t tokens = t.WorkerTokens(static_cast<WorkerId>(w));
    REQUIRE(tokens <= max, "worker %zu holds %zu > %zu after eviction", w, tokens, max);
    double newest_gone = -1e300, oldest_kept = 1e300;
    uint32_t longest_gone = 0;
    for (const EdgeKey& e : before[w]) {
      if (after.count(e)) {
        oldest_kept = std::min(oldest_kept, e.ts);
      } else {
        newest_gone = std::max(newest_gone, e.ts);
        longest_gone = std::max(longest_gone, e.len);
        evicted_seen += e.len;
        // Forget the node's prefixes in the reference.
        for (size_t len = e.path.size() - e.len + 1; len <= e.path.size(); ++len) {
          ref.held[w].erase(Seq(e.path.begin(), e.path.begin() + static_cast<ptrdiff_t>(len)));
        }
      }
    }
    for (const EdgeKey& e : after) REQUIRE(before[w].count(e), "eviction created an edge");
    REQUIRE(newest_gone <= oldest_kept, "worker %zu: evicted ts %g newer than kept ts %g", w,
            newest_gone, oldest_kept);
    if (longest_gone > 0) {
      REQUIRE(tokens + longest_gone > max, "worker %zu evicted too much (%zu left, max %zu)", w,
              tokens, max);
    }
    if (exact) REQUIRE(after == expect[w], "worker %zu: evicted set differs from LRU order", w);
  }
  REQUIRE(evicted == evicted_seen, "EvictTo returned %zu, %zu evicted", evicted, evicted_seen);
  if (exact) REQUIRE(evicted == expect_evicted, "evicted %zu vs %zu", evicted, expect_evicted);
  return Agrees(t, ref);
}

// ---- unit tests ----------------------------------------------------------------------------

TEST(ApproxTree, InsertAndMatch) {
  ApproxTree t;
  Ins(t, 0, {1, 2, 3, 4, 5}, 1);
  Ins(t, 1, {1, 2, 3, 9}, 2);
  EXPECT_EQ(t.NodeCount(), 3u);  // [1,2,3] -> {[4,5], [9]}
  EXPECT_EQ(t.WorkerTokens(0), 5u);
  EXPECT_EQ(t.WorkerTokens(1), 4u);
  EXPECT_EQ(t.WorkerTokens(7), 0u);
  EXPECT_TRUE(Mat(t, {1, 2, 3, 4, 7}, 3, 2) == (std::vector<uint32_t>{4, 3}));
  EXPECT_TRUE(Mat(t, {1, 2, 3, 9, 9}, 3, 3) == (std::vector<uint32_t>{3, 4, 0}));
  EXPECT_TRUE(Mat(t, {2, 2}, 3, 2) == (std::vector<uint32_t>{0, 0}));
  EXPECT_TRUE(Mat(t, {}, 3, 2) == (std::vector<uint32_t>{0, 0}));
  EXPECT_TRUE(Mat(t, {1, 2, 3, 4, 5, 6}, 3, 1) == (std::vector<uint32_t>{5}));
  // Worker 0 not reported: worker 1's 3 tokens are the best.
  std::vector<uint32_t> out;
  const Seq q{1, 2, 3, 4};
  EXPECT_EQ(t.Match(q.data(), q.size(), 4, &out, 0), 0u);
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(t.CheckInvariants().empty());
}

TEST(ApproxTree, InsertPrefixSplitsAtEnd) {
  ApproxTree t;
  Ins(t, 0, {1, 2, 3, 4, 5}, 1);
  Ins(t, 1, {1, 2}, 2);
  EXPECT_EQ(t.NodeCount(), 2u);
  EXPECT_EQ(t.WorkerTokens(0), 5u);
  EXPECT_EQ(t.WorkerTokens(1), 2u);
  EXPECT_TRUE(Pk(t, {1, 2, 3}, 2) == (std::vector<uint32_t>{3, 2}));
  Ins(t, 0, {1, 2, 3, 4, 5}, 4);  // same again: nothing new
  EXPECT_EQ(t.NodeCount(), 2u);
  EXPECT_TRUE(Mat(t, {1, 2, 3}, 5, 2) == (std::vector<uint32_t>{3, 2}));
  EXPECT_EQ(t.NodeCount(), 3u);  // the match ends inside [3,4,5]: split there
  EXPECT_EQ(t.WorkerTokens(0), 5u);
  EXPECT_EQ(t.WorkerTokens(0), 5u);
  Ins(t, 2, {}, 5);
  EXPECT_EQ(t.WorkerTokens(2), 0u);
  EXPECT_TRUE(t.CheckInvariants().empty());
}

TEST(ApproxTree, EvictLeastRecentlyUsed) {
  ApproxTree t;
  Ins(t, 0, {1, 1, 1}, 1);
  Ins(t, 0, {2, 2, 2}, 2);
  Ins(t, 0, {3, 3, 3}, 3);
  Ins(t, 1, {1, 1, 1}, 4);  // worker 1's use does not refresh worker 0's copy
  EXPECT_EQ(t.EvictTo(6), 3u);
  EXPECT_TRUE(Mat(t, {1, 1, 1}, 5, 2) == (std::vector<uint32_t>{0, 3}));
  EXPECT_TRUE(Mat(t, {2, 2, 2}, 6, 2) == (std::vector<uint32_t>{3, 0}));  // refreshes [2,2,2]
  EXPECT_EQ(t.EvictTo(3), 3u);
  EXPECT_TRUE(Pk(t, {2, 2, 2}, 2) == (std::vector<uint32_t>{3, 0}));
  EXPECT_TRUE(Pk(t, {3, 3, 3}, 2) == (std::vector<uint32_t>{0, 0}));
  EXPECT_EQ(t.EvictTo(3), 0u);  // nobody over
  EXPECT_EQ(t.EvictTo(0), 6u);
  EXPECT_EQ(t.NodeCount(), 0u);
  EXPECT_TRUE(t.CheckInvariants().empty());
}

TEST(ApproxTree, EvictLeavesBeforeParents) {
  ApproxTree t;
  // Shared stem [1,2] refreshed by every insert: its branches go first, the stem last.
  Ins(t, 0, {1, 2, 3, 3}, 1);
  Ins(t, 0, {1, 2, 4, 4}, 2);
  Ins(t, 0, {1, 2, 5, 5}, 3);
  EXPECT_EQ(t.WorkerTokens(0), 8u);
  EXPECT_EQ(t.EvictTo(5), 4u);  // [3,3] then [4,4]
  EXPECT_TRUE(Pk(t, {1, 2, 5, 5}, 1) == (std::vector<uint32_t>{4}));
  EXPECT_TRUE(Pk(t, {1, 2, 4, 4}, 1) == (std::vector<uint32_t>{2}));
  EXPECT_EQ(t.EvictTo(1), 4u);  // whole edges: [5,5] then [1,2]
  EXPECT_EQ(t.WorkerTokens(0), 0u);
  EXPECT_TRUE(t.CheckInvariants().empty());
}

TEST(ApproxTree, MatchRefreshesOnlyMatchedPart) {
  ApproxTree t;
  Ins(t, 0, {1, 2, 3, 4, 5, 6}, 1);
  Ins(t, 0, {9, 9, 9}, 2);
  EXPECT_TRUE(Pk(t, {1, 2, 3, 7}, 1) == (std::vector<uint32_t>{3}));
  EXPECT_EQ(t.NodeCount(), 2u);  // Peek neither splits nor refreshes
  EXPECT_TRUE(Mat(t, {1, 2, 3, 7}, 3, 1) == (std::vector<uint32_t>{3}));
  EXPECT_EQ(t.NodeCount(), 3u);  // [1,2,3] (t=3) -> [4,5,6] (t=1); [9,9,9] (t=2)
  EXPECT_EQ(t.EvictTo(6), 3u);   // [4,5,6] is the oldest
  EXPECT_TRUE(Pk(t, {1, 2, 3, 4}, 1) == (std::vector<uint32_t>{3}));
  EXPECT_TRUE(Pk(t, {9, 9, 9}, 1) == (std::vector<uint32_t>{3}));
  EXPECT_EQ(t.EvictTo(3), 3u);  // then [9,9,9]
  EXPECT_TRUE(Pk(t, {1, 2, 3}, 1) == (std::vector<uint32_t>{3}));
  EXPECT_TRUE(t.CheckInvariants().empty());
}

TEST(ApproxTree, MatchRefreshesAllTiedBestWorkers) {
  ApproxTree t;
  Ins(t, 0, {1, 2, 3}, 1);
  Ins(t, 1, {1, 2, 3}, 1);
  Ins(t, 2, {1, 2}, 1);
  Ins(t, 0, {5}, 2);
  Ins(t, 1, {5}, 2);
  Ins(t, 2, {5, 5}, 2);
  EXPECT_TRUE(Mat(t, {1, 2, 3}, 3, 3) == (std::vector<uint32_t>{3, 3, 2}));
  // Workers 0 and 1 refreshed [1,2,3]: their [5] goes. Worker 2 (not the best) did not: its
  // [1,2] goes.
  EXPECT_EQ(t.EvictTo(3), 4u);
  EXPECT_TRUE(Pk(t, {1, 2, 3}, 3) == (std::vector<uint32_t>{3, 3, 0}));
  EXPECT_TRUE(Pk(t, {5, 5}, 3) == (std::vector<uint32_t>{0, 0, 2}));
  EXPECT_TRUE(t.CheckInvariants().empty());
}

TEST(ApproxTree, RemoveWorker) {
  ApproxTree t;
  Ins(t, 0, {1, 2, 3}, 1);
  Ins(t, 1, {1, 2, 4}, 1);
  Ins(t, 1, {7, 7}, 1);
  EXPECT_EQ(t.NodeCount(), 4u);
  t.RemoveWorker(1);
  t.RemoveWorker(1);
  t.RemoveWorker(99);
  EXPECT_EQ(t.WorkerTokens(1), 0u);
  EXPECT_EQ(t.NodeCount(), 2u);  // [1,2] -> [3] stays split
  EXPECT_TRUE(Pk(t, {1, 2, 4}, 2) == (std::vector<uint32_t>{2, 0}));
  EXPECT_TRUE(Pk(t, {7, 7}, 2) == (std::vector<uint32_t>{0, 0}));
  t.RemoveWorker(0);
  EXPECT_EQ(t.NodeCount(), 0u);
  Ins(t, 0, {1, 2, 3}, 2);
  EXPECT_EQ(t.NodeCount(), 1u);
  EXPECT_TRUE(t.CheckInvariants().empty());
}

TEST(ApproxTree, ManyChildren) {
  ApproxTree t;  // root and one inner node past the small-vector size
  for (uint32_t i = 0; i < 100; ++i) Ins(t, i % 3, {i, 1000 + i}, i);
  for (uint32_t i = 0; i < 100; ++i) Ins(t, 3, {5000, i}, i);
  for (uint32_t i = 0; i < 100; ++i) {
    std::vector<uint32_t> want(4, 0);
    want[i % 3] = 2;
    EXPECT_TRUE(Pk(t, {i, 1000 + i, 1}, 4) == want);
    EXPECT_TRUE(Pk(t, {5000, i}, 4) == (std::vector<uint32_t>{0, 0, 0, 2}));
  }
  t.EvictTo(0);
  EXPECT_EQ(t.NodeCount(), 0u);
  EXPECT_TRUE(t.CheckInvariants().empty());
}

// ---- random runs against the reference ---------------------------------------------------

struct RandomConfig {
  int workers;
  uint32_t alphabet;
  size_t max_len;
  int ops;
  bool strict_time;  // every op at a new, increasing time (exact LRU check)
};

bool RandomRun(const RandomConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uni = [&](uint64_t lo, uint64_t hi) {  // inclusive
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  ApproxTree t;
  Ref ref(static_cast<size_t>(c.workers));
  std::vector<Seq> pool;
  double now = 0;
  auto random_seq = [&]() {
    Seq s;
    if (!pool.empty() && uni(0, 2) > 0) {
      const Seq& base = pool[uni(0, pool.size() - 1)];
      s.assign(base.begin(), base.begin() + static_cast<ptrdiff_t>(uni(0, base.size())));
    }
    const size_t len = uni(0, c.max_len);
    while (s.size() < len) s.push_back(static_cast<uint32_t>(uni(0, c.alphabet - 1)));
    return s;
  };
  for (int op = 0; op < c.ops; ++op) {
    if (c.strict_time) {
      now += 1.0 + static_cast<double>(uni(0, 3));
    } else {
      now = static_cast<double>(uni(0, 20));  // ties and a clock going backwards
    }
    const uint64_t kind = uni(0, 99);
    const WorkerId w = static_cast<WorkerId>(uni(0, static_cast<uint64_t>(c.workers - 1)));
    if (kind < 45) {
      const Seq s = random_seq();
      Ins(t, w, s, now);
      ref.Insert(w, s, now);
      if (!s.empty()) pool.push_back(s);
    } else if (kind < 80 || kind >= 93) {
      const Seq q = random_seq();
      const bool peek = kind >= 93;
      // Sometimes hide the highest worker ids from the match.
      size_t num = static_cast<size_t>(c.workers);
      if (uni(0, 4) == 0) num = uni(0, num);
      std::vector<uint32_t> got;
      const uint32_t best = peek ? t.Peek(q.data(), q.size(), &got, num)
                                 : t.Match(q.data(), q.size(), now, &got, num);
      const std::vector<uint32_t> want = ref.Match(q, now, num, !peek);
      REQUIRE(got == want, "seed %llu op %d %s %s: got %s want %s",
              static_cast<unsigned long long>(seed), op, peek ? "Peek" : "Match",
              Str(q).c_str(), Str(got).c_str(), Str(want).c_str());
      const uint32_t want_best = want.empty() ? 0 : *std::max_element(want.begin(), want.end());
      REQUIRE(best == want_best, "returned best %u vs %u", best, want_best);
    } else if (kind < 90) {
      size_t most = 0;
      for (const auto& h : ref.held) most = std::max(most, h.size());
      const size_t max = uni(0, most + 2);
      if (!CheckEvict(t, ref, max, c.strict_time)) {
        std::fprintf(stderr, "  (seed %llu op %d EvictTo(%zu))\n",
                     static_cast<unsigned long long>(seed), op, max);
        return false;
      }
    } else {
      t.RemoveWorker(w);
      ref.held[w].clear();
    }
    if (!Agrees(t, ref)) {
      std::fprintf(stderr, "  (seed %llu op %d kind %llu)\n",
                   static_cast<unsigned long long>(seed), op,
                   static_cast<unsigned long long>(kind));
      return false;
    }
  }
  return true;
}

void RandomRuns(bool strict_time, int seeds) {
  const RandomConfig configs[] = {
      {1, 2, 6, 300, strict_time},  {2, 2, 8, 400, strict_time},  {3, 3, 10, 400, strict_time},
      {5, 2, 12, 500, strict_time}, {4, 4, 12, 500, strict_time}, {3, 20, 6, 400, strict_time},
  };
  int runs = 0;
  for (const RandomConfig& c : configs) {
    for (int s = 0; s < seeds; ++s) {
      ++runs;
      if (!RandomRun(c, 1000003ull * static_cast<uint64_t>(s) + c.alphabet * 31 + c.workers)) {
        return;
      }
    }
  }
  std::printf("  %d random runs\n", runs);
}

TEST(ApproxTree, RandomAgainstReferenceExactLru) { RandomRuns(true, 60); }
TEST(ApproxTree, RandomAgainstReferenceTiedAndBackwardClock) { RandomRuns(false, 40); }

// Concurrent writers and readers: no crash, no race (run under TSan), consistent at the end.
TEST(ApproxTree, ConcurrentSmoke) {
  ApproxTree t;
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      std::mt19937_64 rng(static_cast<uint64_t>(i) + 7);
      std::vector<uint32_t> out;
      for (int op = 0; op < 3000; ++op) {
        Seq s(rng() % 40);
        for (auto& x : s) x = static_cast<uint32_t>(rng() % 3);
        const WorkerId w = static_cast<WorkerId>(rng() % 6);
        switch (rng() % 6) {
          case 0:
          case 1: t.Insert(w, s.data(), s.size(), op); break;
          case 2: t.Match(s.data(), s.size(), op, &out, 6); break;
          case 3: t.Peek(s.data(), s.size(), &out, 6); break;
          case 4: t.EvictTo(rng() % 60); break;
          default:
            if (rng() % 20 == 0) t.RemoveWorker(w);
            (void)t.WorkerTokens(w);
            (void)t.NodeCount();
        }
      }
      done++;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(done.load(), 4);
  EXPECT_TRUE(t.CheckInvariants().empty());
}

}  // namespace
