#include "scoring/policy.h"

#include <stdexcept>

#include "scoring/terms.h"

namespace kvroute {

// One factory per policy, each defined in the policy's own file.
std::unique_ptr<Policy> MakeKvAware(const PolicyParams& p);
std::unique_ptr<Policy> MakeCost(const PolicyParams& p);
std::unique_ptr<Policy> MakeCacheAware(const PolicyParams& p);
std::unique_ptr<Policy> MakeRoundRobin(const PolicyParams& p);
std::unique_ptr<Policy> MakeRandom(const PolicyParams& p);
std::unique_ptr<Policy> MakePowerOfTwo(const PolicyParams& p);
std::unique_ptr<Policy> MakeLeastLoad(const PolicyParams& p);
std::unique_ptr<Policy> MakeConsistentHash(const PolicyParams& p);
std::unique_ptr<Policy> MakeRendezvousHash(const PolicyParams& p);
std::unique_ptr<Policy> MakeLmcacheAware(const PolicyParams& p);

namespace {
struct Registered {
  const char* name;
  std::unique_ptr<Policy> (*make)(const PolicyParams&);
};
constexpr Registered kRegistry[] = {
    {"kv_aware", MakeKvAware},
    {"cost", MakeCost},
    {"cache_aware", MakeCacheAware},
    {"round_robin", MakeRoundRobin},
    {"random", MakeRandom},
    {"power_of_two", MakePowerOfTwo},
    {"least_load", MakeLeastLoad},
    {"consistent_hash", MakeConsistentHash},
    {"rendezvous_hash", MakeRendezvousHash},
    {"lmcache_aware", MakeLmcacheAware},
};

const Registered& Lookup(const std::string& name) {
  for (const auto& r : kRegistry) {
    if (name == r.name) return r;
  }
  throw std::invalid_argument("unknown policy '" + name + "': expected one of " + PolicyNames());
}
}  // namespace

std::unique_ptr<Policy> MakePolicy(const std::string& name, const PolicyParams& params) {
  ValidatePolicyParams(params);
  return Lookup(name).make(params);
}

const char* PolicyNameOrThrow(const std::string& name) { return Lookup(name).name; }

std::string PolicyNames() {
  std::string s;
  for (const auto& r : kRegistry) {
    if (!s.empty()) s += ", ";
    s += r.name;
  }
  return s;
}

void ValidatePolicyParams(const PolicyParams& p) {
  if (!(p.cache_weight >= 0.0 && p.cache_weight <= 1.0)) {
    throw std::invalid_argument("cache_weight must be in [0, 1], got " +
                                std::to_string(p.cache_weight));
  }
  if (p.virtual_nodes < 1) throw std::invalid_argument("virtual_nodes must be >= 1");
  if (!(p.temperature >= 0)) throw std::invalid_argument("temperature must be >= 0");
  if (!(p.prefill_load_scale >= 0)) throw std::invalid_argument("prefill_load_scale must be >= 0");
  if (!(p.cache_threshold >= 0 && p.cache_threshold <= 1)) {
    throw std::invalid_argument("cache_threshold must be in [0, 1]");
  }
  if (!(p.balance_abs_threshold >= 0)) {
    throw std::invalid_argument("balance_abs_threshold must be >= 0");
  }
  if (!(p.balance_rel_threshold >= 1)) {
    throw std::invalid_argument("balance_rel_threshold must be >= 1");
  }
  if (!(p.eviction_interval_s >= 0)) throw std::invalid_argument("eviction_interval_s must be >= 0");
  if (p.max_tree_size < 1) throw std::invalid_argument("max_tree_size must be >= 1");
}

size_t Policy::Choose(const std::vector<Candidate>& c, const ChooseContext& ctx,
                      std::vector<ScoreTerms>* terms) {
  size_t excluded = 0;
  for (const Candidate& x : c) excluded += x.excluded ? 1 : 0;
  if (excluded == 0) return ChooseAmong(c, ctx, terms);
  // Score the eligible candidates alone, then map back.
  thread_local std::vector<Candidate> sub;
  thread_local std::vector<size_t> back;
  thread_local std::vector<ScoreTerms> sub_terms;
  sub.clear();
  back.clear();
  for (size_t i = 0; i < c.size(); ++i) {
    if (c[i].excluded) continue;
    sub.push_back(c[i]);
    back.push_back(i);
  }
  const size_t pick = ChooseAmong(sub, ctx, &sub_terms);
  terms->assign(c.size(), ScoreTerms{});
  for (size_t j = 0; j < sub.size(); ++j) (*terms)[back[j]] = sub_terms[j];
  return PickWithExclusions(pick, back, c, ctx);
}

namespace scoring {

size_t ArgMaxScore(const std::vector<ScoreTerms>& terms, std::mt19937_64* rng) {
  // One pass finds the best and counts the candidates tied with it; a single seeded draw
  // then picks among them (a draw per tie would cost one per idle worker).
  const size_t n = terms.size();
  const ScoreTerms* t = terms.data();
  size_t best = 0;
  size_t ties = 1;
  double best_score = t[0].score, best_load = t[0].load;
  for (size_t i = 1; i < n; ++i) {
    const double ds = t[i].score - best_score;
    if (ds > kEps || (std::fabs(ds) <= kEps && t[i].load < best_load - kEps)) {
      best = i;
      best_score = t[i].score;
      best_load = t[i].load;
      ties = 1;
    } else if (std::fabs(ds) <= kEps && std::fabs(t[i].load - best_load) <= kEps) {
      ++ties;
    }
  }
  if (ties == 1) return best;
  // The tied set is the one the scan counted: `best` and the later candidates tied with it.
  const ScoreTerms b = t[best];
  size_t k = std::uniform_int_distribution<size_t>(0, ties - 1)(*rng);
  for (size_t i = best; i < n; ++i) {
    if (std::fabs(t[i].score - b.score) <= kEps && std::fabs(t[i].load - b.load) <= kEps) {
      if (k == 0) return i;
      --k;
    }
  }
  return best;
}

}  // namespace scoring
}  // namespace kvroute
