// Micro-benchmark of kvroute::ApproxTree (cpp/scoring/approx_tree.h): Insert, Match and Peek
// on 8K-token prompts over 64 workers in trees of ~1M distinct tokens, and one EvictTo. Two
// prompt shapes (conversations, branchy); each query set is timed in 15 rounds of 2,000 and the
// median round is reported in us per call.
//
// Build (from the repository root) and run:
//   g++ -std=c++17 -O2 -Icpp cpp/scoring/approx_tree.cc benchmarks/bench_approx_tree.cc
//       -o /tmp/bench_approx_tree -lpthread
//   /tmp/bench_approx_tree
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "scoring/approx_tree.h"

using namespace kvroute;

namespace {

using Seq = std::vector<uint32_t>;

double Secs() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int Bench() {
  constexpr int kWorkers = 64;
  constexpr size_t kPrompt = 8192;
  std::mt19937_64 rng(42);
  auto tok = [&] { return static_cast<uint32_t>(rng() % 150000); };

  struct Scenario {
    const char* name;
    size_t min_new, max_new;  // new tokens per prompt after a shared prefix of an earlier one
  };
  const Scenario scenarios[] = {
      {"conversations: prompt = earlier prompt cut in its last 10% + new tail", 64, 820},
      {"branchy: prompt = earlier prompt cut uniformly + new tail", 1, kPrompt},
  };
  for (const Scenario& sc : scenarios) {
    ApproxTree t;
    std::vector<Seq> prompts;
    // 8 system prompts of 1K tokens, held by every worker.
    std::vector<Seq> sys(8);
    for (auto& s : sys) {
      s.resize(1024);
      for (auto& x : s) x = tok();
    }
    double now = 0;
    for (int w = 0; w < kWorkers; ++w) {
      for (const Seq& s : sys) t.Insert(static_cast<WorkerId>(w), s.data(), s.size(), ++now);
    }
    size_t distinct = 8 * 1024;
    double insert_s = 0;
    size_t inserts = 0;
    while (distinct < 1000000) {
      Seq p;
      if (prompts.empty() || rng() % 16 == 0) {
        p = sys[rng() % sys.size()];
      } else {
        p = prompts[rng() % prompts.size()];
        const size_t fresh =
            sc.min_new + rng() % (std::min(sc.max_new, p.size() - 1024) - sc.min_new + 1);
        p.resize(p.size() - fresh);
      }
      const size_t added = kPrompt - p.size();
      while (p.size() < kPrompt) p.push_back(tok());
      distinct += added;
      const double t0 = Secs();
      t.Insert(static_cast<WorkerId>(rng() % kWorkers), p.data(), p.size(), ++now);
      insert_s += Secs() - t0;
      ++inserts;
      prompts.push_back(std::move(p));
    }
    size_t held = 0;
    for (int w = 0; w < kWorkers; ++w) held += t.WorkerTokens(static_cast<WorkerId>(w));
    std::printf("%s\n  tree: %zu prompts of %zu tokens, ~%zu distinct tokens, %zu nodes, "
                "%zu (worker, token) pairs; insert %.2f us/prompt\n",
                sc.name, prompts.size(), kPrompt, distinct, t.NodeCount(), held,
                insert_s / static_cast<double>(inserts) * 1e6);

    // Queries: an existing prompt with its last 100 tokens changed (long match), and a fresh
    // prompt sharing only a system prompt.
    // Timed in 15 rounds; the median round is reported (the machine may be shared).
    constexpr int kRounds = 15, kPerRound = 2000;
    std::vector<Seq> hit(256), miss(64);
    for (auto& q : hit) {
      q = prompts[rng() % prompts.size()];
      for (size_t i = kPrompt - 100; i < kPrompt; ++i) q[i] = tok();
    }
    for (auto& q : miss) {
      q = sys[rng() % sys.size()];
      while (q.size() < kPrompt) q.push_back(tok());
    }
    const std::vector<Seq> hot(1, hit[0]);
    std::vector<uint32_t> out;
    auto median_us = [&](const std::vector<Seq>& set, bool peek, uint64_t* matched) {
      std::vector<double> rounds;
      size_t i = 0;
      for (int r = 0; r < kRounds; ++r) {
        const double t0 = Secs();
        for (int k = 0; k < kPerRound; ++k, ++i) {
          const Seq& q = set[i % set.size()];
          *matched += peek ? t.Peek(q.data(), q.size(), &out, kWorkers)
                           : t.Match(q.data(), q.size(), ++now, &out, kWorkers);
        }
        rounds.push_back((Secs() - t0) / kPerRound * 1e6);
      }
      std::sort(rounds.begin(), rounds.end());
      return rounds[rounds.size() / 2];
    };
    const std::pair<const char*, const std::vector<Seq>*> sets[] = {
        {"8K prompt, long match, 256 prompts round-robin (tree edges cold)", &hit},
        {"8K prompt, long match, same prompt repeated (warm)", &hot},
        {"8K prompt, only the 1K system prompt matches", &miss},
    };
    for (const auto& [label, set] : sets) {
      uint64_t matched = 0;
      const double match_us = median_us(*set, false, &matched);
      const double peek_us = median_us(*set, true, &matched);
      std::printf("  %s: Match %.2f us, Peek %.2f us (mean best match %.0f tokens)\n", label,
                  match_us, peek_us,
                  static_cast<double>(matched) / (2.0 * kRounds * kPerRound));
    }
    const double t0 = Secs();
    const size_t evicted = t.EvictTo(held / kWorkers / 2);
    std::printf("  EvictTo(%zu tokens per worker): %.2f ms, %zu evicted, %zu nodes left\n",
                held / kWorkers / 2, (Secs() - t0) * 1e3, evicted, t.NodeCount());
  }
  return 0;
}

}  // namespace

int main() { return Bench(); }
