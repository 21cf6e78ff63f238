#include "scoring/policy.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kvroute {

namespace {
struct NamedPolicy {
  const char* name;
  PolicyKind kind;
};
constexpr NamedPolicy kPolicies[] = {
    {"kv_aware", PolicyKind::kKvAware},
    {"cost", PolicyKind::kCost},
    {"cache_aware", PolicyKind::kCacheAware},
    {"round_robin", PolicyKind::kRoundRobin},
    {"random", PolicyKind::kRandom},
    {"power_of_two", PolicyKind::kPowerOfTwo},
    {"least_load", PolicyKind::kLeastLoad},
    {"consistent_hash", PolicyKind::kConsistentHash},
    {"rendezvous_hash", PolicyKind::kRendezvousHash},
    {"lmcache_aware", PolicyKind::kLmcacheAware},
};
constexpr double kEps = 1e-9;

// Index of the minimum of `key` over candidates; exact ties broken uniformly (seeded).
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
}  // namespace

PolicyKind ParsePolicy(const std::string& name) {
  for (const auto& p : kPolicies) {
    if (name == p.name) return p.kind;
  }
  throw std::invalid_argument("unknown policy '" + name + "': expected one of " + PolicyNames());
}

const char* PolicyName(PolicyKind k) {
  for (const auto& p : kPolicies) {
    if (p.kind == k) return p.name;
  }
  return "?";
}

std::string PolicyNames() {
  std::string s;
  for (const auto& p : kPolicies) {
    if (!s.empty()) s += ", ";
    s += p.name;
  }
  return s;
}

bool UsesIndex(PolicyKind p) { return p == PolicyKind::kKvAware || p == PolicyKind::kCost; }

void HashRing::Build(const std::vector<uint64_t>& name_hashes, uint32_t virtual_nodes) {
  points_.clear();
  points_.reserve(name_hashes.size() * virtual_nodes);
  for (uint32_t c = 0; c < name_hashes.size(); ++c) {
    for (uint32_t v = 0; v < virtual_nodes; ++v) {
      points_.emplace_back(XXH3_64bits_withSeed(&v, sizeof(v), name_hashes[c]), c);
    }
  }
  std::sort(points_.begin(), points_.end());
}

size_t HashRing::Pick(uint64_t session_hash) const {
  auto it = std::lower_bound(points_.begin(), points_.end(),
                             std::make_pair(session_hash, uint32_t{0}));
  if (it == points_.end()) it = points_.begin();  // wrap around the ring
  return it->second;
}

size_t HashRing::Pick(uint64_t session_hash, const std::vector<Candidate>& c) const {
  auto it = std::lower_bound(points_.begin(), points_.end(),
                             std::make_pair(session_hash, uint32_t{0}));
  for (size_t step = 0; step < points_.size(); ++step, ++it) {
    if (it == points_.end()) it = points_.begin();  // wrap around the ring
    if (!c[it->second].excluded) return it->second;
  }
  return 0;  // unreachable while some candidate is not excluded
}

namespace {
size_t ChooseAmong(PolicyKind p, const std::vector<Candidate>& c, const ChooseContext& ctx,
                   std::vector<ScoreTerms>* terms);
}  // namespace

size_t Choose(PolicyKind p, const std::vector<Candidate>& c, const ChooseContext& ctx,
              std::vector<ScoreTerms>* terms) {
  size_t excluded = 0;
  for (const Candidate& x : c) excluded += x.excluded ? 1 : 0;
  if (excluded == 0) return ChooseAmong(p, c, ctx, terms);
  // Score the eligible candidates alone, then map back; the ring keeps its full membership
  // so that excluding a worker moves only its own sessions.
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
  ChooseContext sub_ctx = ctx;
  const size_t pick = ChooseAmong(p, sub, sub_ctx, &sub_terms);
  terms->assign(c.size(), ScoreTerms{});
  for (size_t j = 0; j < sub.size(); ++j) (*terms)[back[j]] = sub_terms[j];
  if (p == PolicyKind::kConsistentHash) return ctx.ring->Pick(ctx.session_hash, c);
  return back[pick];
}

namespace {
size_t ChooseAmong(PolicyKind p, const std::vector<Candidate>& c, const ChooseContext& ctx,
                   std::vector<ScoreTerms>* terms) {
  const size_t n = c.size();
  const PolicyParams& prm = *ctx.params;
  double max_prefill = 0, max_req = 0, max_ext = 0;
  bool any_usage = false;
  for (const Candidate& x : c) {
    max_prefill = std::max(max_prefill, x.pending_prefill);
    max_req = std::max(max_req, x.requests);
    max_ext = std::max(max_ext, x.external);
    any_usage = any_usage || x.kv_usage >= 0;
  }
  terms->resize(n);
  // The normalisers as factors: a worker costs multiplies, not three divisions (the terms
  // come within an ulp of the quotients; ties are compared within kEps).
  const double f_prefill = max_prefill > 0 ? 1.0 / max_prefill : 0.0;
  const double f_req = max_req > 0 ? 1.0 / max_req : 0.0;
  const double f_signals = 1.0 / (any_usage ? 3 : 2);
  const double f_ext = max_ext > 0 ? 1.0 / max_ext : 0.0;
  const double cw = prm.cache_weight;
  double max_cost = 0;
  // One loop per policy's match term (`match`: scored; `shown`: reported in the terms), so
  // the policy is not tested at every worker.
  auto score = [&](auto match, auto shown) {
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
      t[i].cost = prm.prefill_load_scale * std::max(0.0, ctx.prompt_blocks - x.weighted_blocks) +
                  x.active_blocks;
      max_cost = std::max(max_cost, t[i].cost);
    }
  };
  auto index_match = [](const Candidate& x) { return x.match; };
  auto as_scored = [](const Candidate&, double m) { return m; };
  if (p == PolicyKind::kLmcacheAware) {
    score([f_ext](const Candidate& x) { return x.external * f_ext; }, as_scored);
  } else if (p == PolicyKind::kCacheAware) {
    score(index_match, [](const Candidate& x, double) { return x.tree_match; });
  } else {
    score(index_match, as_scored);
  }
  std::mt19937_64* rng = ctx.rng;
  auto least_load = [&] { return ArgMin(n, [&](size_t i) { return (*terms)[i].load; }, rng); };
  switch (p) {
    case PolicyKind::kRoundRobin: return static_cast<size_t>((*ctx.rr_counter)++ % n);
    case PolicyKind::kRandom: return std::uniform_int_distribution<size_t>(0, n - 1)(*rng);
    case PolicyKind::kLeastLoad: return least_load();
    case PolicyKind::kPowerOfTwo: {
      if (n == 1) return 0;
      std::uniform_int_distribution<size_t> d(0, n - 1);
      size_t a = d(*rng);
      size_t b = d(*rng);
      while (b == a) b = d(*rng);
      return (*terms)[b].load < (*terms)[a].load ? b : a;
    }
    case PolicyKind::kConsistentHash: return ctx.ring->Pick(ctx.session_hash);
    case PolicyKind::kRendezvousHash: {
      size_t best = 0;
      uint64_t best_w = 0;
      for (size_t i = 0; i < n; ++i) {
        const uint64_t w = XXH3_64bits_withSeed(&ctx.session_hash, 8, c[i].name_hash);
        if (i == 0 || w > best_w) {
          best = i;
          best_w = w;
        }
      }
      return best;
    }
    case PolicyKind::kCost: {
      if (prm.temperature <= 0 || max_cost <= 0) {
        return ArgMin(n, [&](size_t i) { return (*terms)[i].cost; }, rng);
      }
      // Softmax over normalised costs: p_i ∝ exp(−cost_i / (max_cost · temperature)).
      std::vector<double> w(n);
      double m = -1e300;
      for (size_t i = 0; i < n; ++i) {
        w[i] = -(*terms)[i].cost / (max_cost * prm.temperature);
        m = std::max(m, w[i]);
      }
      for (double& x : w) x = std::exp(x - m);
      return std::discrete_distribution<size_t>(w.begin(), w.end())(*rng);
    }
    case PolicyKind::kCacheAware: {
      double lo = c[0].requests, hi = c[0].requests;
      for (const Candidate& x : c) {
        lo = std::min(lo, x.requests);
        hi = std::max(hi, x.requests);
      }
      auto least_requests = [&] {
        return ArgMin(n, [&](size_t i) { return c[i].requests; }, rng);
      };
      if (hi - lo > prm.balance_abs_threshold && hi > prm.balance_rel_threshold * lo) {
        return least_requests();  // imbalanced: balance first
      }
      size_t best = 0;
      for (size_t i = 1; i < n; ++i) {
        if (c[i].tree_match > c[best].tree_match) best = i;
      }
      return c[best].tree_match > prm.cache_threshold ? best : least_requests();
    }
    case PolicyKind::kKvAware:
    case PolicyKind::kLmcacheAware: break;  // both: argmax score below
  }
  // The best score, then the lower load; among the workers tied with it on both (within
  // kEps), one drawn uniformly with a single seeded draw (reservoir sampling's draw per tie
  // cost ~5k of ~59k instructions per select at 256 idle workers).
  size_t best = 0;
  size_t ties = 1;
  const ScoreTerms* t = terms->data();
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
  // The tied set is the one the scan counted: `best` and the later workers tied with it.
  const ScoreTerms b = (*terms)[best];
  size_t k = std::uniform_int_distribution<size_t>(0, ties - 1)(*rng);
  for (size_t i = best; i < n; ++i) {
    const ScoreTerms& t = (*terms)[i];
    if (std::fabs(t.score - b.score) <= kEps && std::fabs(t.load - b.load) <= kEps) {
      if (k == 0) return i;
      --k;
    }
  }
  return best;
}
}  // namespace

}  // namespace kvroute
