#include "scoring/policy.h"

#include <stdexcept>

#include "scoring/terms.h"

namespace kvroute {

// The registry: one line per policy, X(<Name>) for the `const PolicyDef& <Name>Def()` its
// own file defines. The order is the order of PolicyNames() and kvroute.POLICIES.
#define KVROUTE_POLICIES(X) \
  X(KvAware)                \
  X(Cost)                   \
  X(CacheAware)             \
  X(RoundRobin)             \
  X(Random)                 \
  X(PowerOfTwo)             \
  X(LeastLoad)              \
  X(ConsistentHash)         \
  X(RendezvousHash)         \
  X(LmcacheAware)

#define KVROUTE_DECLARE_DEF(Name) const PolicyDef& Name##Def();
KVROUTE_POLICIES(KVROUTE_DECLARE_DEF)
#undef KVROUTE_DECLARE_DEF

const std::vector<const PolicyDef*>& PolicyDefs() {
#define KVROUTE_DEF_ADDRESS(Name) &Name##Def(),
  static const std::vector<const PolicyDef*> defs = {KVROUTE_POLICIES(KVROUTE_DEF_ADDRESS)};
#undef KVROUTE_DEF_ADDRESS
  return defs;
}

const PolicyDef& FindPolicy(const std::string& name) {
  for (const PolicyDef* d : PolicyDefs()) {
    if (name == d->name) return *d;
  }
  throw std::invalid_argument("unknown policy '" + name + "': expected one of " + PolicyNames());
}

ParamValues ResolvePolicyParams(const std::string& name, const ParamValues& knobs) {
  const PolicyDef& d = FindPolicy(name);
  return ResolveParams(d.name, d.knobs, knobs);
}

std::unique_ptr<Policy> MakePolicy(const std::string& name, const ParamValues& knobs) {
  const PolicyDef& d = FindPolicy(name);
  return d.make(ResolveParams(d.name, d.knobs, knobs));
}

const char* PolicyNameOrThrow(const std::string& name) { return FindPolicy(name).name; }

std::string PolicyNames() {
  std::string s;
  for (const PolicyDef* d : PolicyDefs()) {
    if (!s.empty()) s += ", ";
    s += d->name;
  }
  return s;
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
