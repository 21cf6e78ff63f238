#include "scoring/policy.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kvroute {

PolicyKind ParsePolicy(const std::string& name) {
  if (name == "kv_aware") return PolicyKind::kKvAware;
  if (name == "round_robin") return PolicyKind::kRoundRobin;
  if (name == "power_of_two") return PolicyKind::kPowerOfTwo;
  throw std::invalid_argument("unknown policy '" + name +
                              "': expected one of kv_aware, round_robin, power_of_two");
}

const char* PolicyName(PolicyKind p) {
  switch (p) {
    case PolicyKind::kKvAware: return "kv_aware";
    case PolicyKind::kRoundRobin: return "round_robin";
    case PolicyKind::kPowerOfTwo: return "power_of_two";
  }
  return "?";
}

size_t Choose(PolicyKind p, const std::vector<Candidate>& c, double cache_weight,
              std::mt19937_64* rng, uint64_t* rr_counter, std::vector<ScoreTerms>* terms) {
  const size_t n = c.size();
  double max_prefill = 0, max_req = 0;
  bool any_usage = false;
  for (const Candidate& x : c) {
    max_prefill = std::max(max_prefill, x.pending_prefill);
    max_req = std::max(max_req, x.requests);
    any_usage = any_usage || x.kv_usage >= 0;
  }
  const int nsignals = 2 + (any_usage ? 1 : 0);
  terms->resize(n);
  for (size_t i = 0; i < n; ++i) {
    double load = 0;
    if (max_prefill > 0) load += c[i].pending_prefill / max_prefill;
    if (max_req > 0) load += c[i].requests / max_req;
    if (any_usage) load += std::clamp(c[i].kv_usage, 0.0, 1.0);
    load /= nsignals;
    ScoreTerms& t = (*terms)[i];
    t.match = c[i].match;
    t.load = load;
    t.score = cache_weight * c[i].match + (1.0 - cache_weight) * (1.0 - load);
  }
  switch (p) {
    case PolicyKind::kRoundRobin: return static_cast<size_t>((*rr_counter)++ % n);
    case PolicyKind::kPowerOfTwo: {
      if (n == 1) return 0;
      std::uniform_int_distribution<size_t> d(0, n - 1);
      size_t a = d(*rng);
      size_t b = d(*rng);
      while (b == a) b = d(*rng);
      return (*terms)[b].load < (*terms)[a].load ? b : a;
    }
    case PolicyKind::kKvAware: break;
  }
  constexpr double kEps = 1e-9;
  size_t best = 0;
  size_t ties = 1;
  for (size_t i = 1; i < n; ++i) {
    const ScoreTerms& t = (*terms)[i];
    const ScoreTerms& b = (*terms)[best];
    if (t.score > b.score + kEps || (std::fabs(t.score - b.score) <= kEps && t.load < b.load - kEps)) {
      best = i;
      ties = 1;
    } else if (std::fabs(t.score - b.score) <= kEps && std::fabs(t.load - b.load) <= kEps) {
      // Reservoir sampling over exact ties: each tied worker equally likely, seeded.
      ++ties;
      if (std::uniform_int_distribution<size_t>(0, ties - 1)(*rng) == 0) best = i;
    }
  }
  return best;
}

}  // namespace kvroute
