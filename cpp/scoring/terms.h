// The terms every policy reports (match, load, score, cost; see policy.h) and the two
// tie-breaking choices several policies share. Internal to cpp/scoring/.
//
// Thread safety: pure functions of their arguments, apart from the caller's Rng.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "scoring/policy.h"

namespace kvroute {
namespace scoring {

constexpr double kEps = 1e-9;  // scores, loads and costs within this are tied

// The knobs of the score and cost terms every policy reports: kv_aware's and lmcache_aware's
// cache_weight, cost's prefill_load_scale. A policy that owns one passes its own value; the
// others report with these, the owners' defaults (their schemas read them from here).
struct TermKnobs {
  double cache_weight = 0.7;
  double prefill_load_scale = 1.0;
};

// Fills load, score and cost of every candidate (score and cost with `knobs`); the score
// uses match(x) as its match term and terms[i].match = shown(x, match(x)). The cost is
// NVIDIA Dynamo's (cost.cc):
//   prefill_load_scale · max(0, (queued prefill + prompt tokens) / block_size
//                               − tier-weighted matched blocks) + active blocks.
// O(candidates).
template <typename Match, typename Shown>
void FillTerms(const std::vector<Candidate>& c, const ChooseContext& ctx, const TermKnobs& knobs,
               Match match, Shown shown, std::vector<ScoreTerms>* terms) {
  const size_t n = c.size();
  double max_prefill = 0, max_req = 0;
  bool any_usage = false;
  for (const Candidate& x : c) {
    max_prefill = std::max(max_prefill, x.pending_prefill);
    max_req = std::max(max_req, x.requests);
    any_usage = any_usage || x.kv_usage >= 0;
  }
  terms->resize(n);
  // The normalisers as factors: a worker costs multiplies, not three divisions (the terms
  // come within an ulp of the quotients; ties are compared within kEps).
  const double f_prefill = max_prefill > 0 ? 1.0 / max_prefill : 0.0;
  const double f_req = max_req > 0 ? 1.0 / max_req : 0.0;
  const double f_signals = 1.0 / (any_usage ? 3 : 2);
  const double cw = knobs.cache_weight;
  const double prompt = static_cast<double>(ctx.num_tokens);
  const double per_block = 1.0 / ctx.block_size;
  ScoreTerms* t = terms->data();
  for (size_t i = 0; i < n; ++i) {
    const Candidate& x = c[i];
    double load = x.pending_prefill * f_prefill + x.requests * f_req;
    if (any_usage) load += std::clamp(x.kv_usage, 0.0, 1.0);
    load *= f_signals;
    const double m = match(x);
    t[i].match = shown(x, m);
    t[i].load = load;
    t[i].score = cw * m + (1.0 - cw) * (1.0 - load);
    const double prefill_blocks = (x.pending_prefill + prompt) * per_block;
    t[i].cost = knobs.prefill_load_scale * std::max(0.0, prefill_blocks - x.weighted_blocks) +
                x.active_blocks;
  }
}

// FillTerms with the index's match_w, as scored.
inline void FillIndexTerms(const std::vector<Candidate>& c, const ChooseContext& ctx,
                           std::vector<ScoreTerms>* terms, const TermKnobs& knobs = {}) {
  FillTerms(
      c, ctx, knobs, [](const Candidate& x) { return x.match; },
      [](const Candidate&, double m) { return m; }, terms);
}

// Index of the minimum of key(i) over [0, n); exact ties (within kEps) broken uniformly by
// reservoir sampling on the seeded stream.
template <typename Key>
size_t ArgMin(size_t n, Key key, std::mt19937_64* rng) {
  size_t best = 0;
  size_t ties = 1;
  for (size_t i = 1; i < n; ++i) {
    const double k = key(i), b = key(best);
    if (k < b - kEps) {
      best = i;
      ties = 1;
    } else if (std::fabs(k - b) <= kEps) {
      ++ties;
      if (std::uniform_int_distribution<size_t>(0, ties - 1)(*rng) == 0) best = i;
    }
  }
  return best;
}

// The best score, then the lower load; among the candidates tied with it on both (within
// kEps), one drawn uniformly with a single seeded draw. REQUIRES: terms non-empty.
size_t ArgMaxScore(const std::vector<ScoreTerms>& terms, std::mt19937_64* rng);

}  // namespace scoring
}  // namespace kvroute
