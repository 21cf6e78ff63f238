// cache_aware: the approximate policy of the SGLang / vLLM routers: no KV events, a radix tree
// of the router's own past decisions (approx_tree.h). For a prompt of n tokens:
//   if max − min requests > balance_abs_threshold and max > balance_rel_threshold · min:
//     the worker with the fewest requests (imbalanced: balance first);
//   else the worker with the longest tree match, if that match / n > cache_threshold;
//   else the worker with the fewest requests (ties: seeded random).
// Every decision acted on is inserted in the tree; the tree is cut back to max_tree_size
// tokens per worker (LRU) at most once per eviction_interval_s of the decisions' clock.
// eviction_interval_s = 0: no eviction at all, as vllm-project/router and SGLang, which start
// their eviction thread only for an interval > 0 (the tree then grows without bound).
#include <atomic>

#include "scoring/approx_tree.h"
#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class CacheAware final : public Policy {
 public:
  explicit CacheAware(const ParamValues& knobs) { Configure(knobs); }
  const char* name() const override { return "cache_aware"; }

  void OnRemoveWorker(WorkerId w) override { tree_.RemoveWorker(w); }
  void Configure(const ParamValues& k) override {
    cache_threshold_ = FloatParam(k, "cache_threshold");
    balance_abs_threshold_ = static_cast<double>(IntParam(k, "balance_abs_threshold"));
    balance_rel_threshold_ = FloatParam(k, "balance_rel_threshold");
    eviction_interval_s_ = FloatParam(k, "eviction_interval_s");
    max_tree_size_ = static_cast<uint64_t>(IntParam(k, "max_tree_size"));
  }
  // Matches the prompt in the tree (refreshing the best matches' last access, as SGLang).
  void Prepare(const ChooseContext& ctx, size_t worker_id_limit) override {
    tree_.Match(ctx.tokens, ctx.num_tokens, ctx.now_s, &Matched(), worker_id_limit);
  }
  void Record(WorkerId chosen, const ChooseContext& ctx) override {
    tree_.Insert(chosen, ctx.tokens, ctx.num_tokens, ctx.now_s);
    if (eviction_interval_s_ <= 0) return;
    double last = last_eviction_.load();
    if (ctx.now_s - last >= eviction_interval_s_ &&
        last_eviction_.compare_exchange_strong(last, ctx.now_s)) {
      tree_.EvictTo(max_tree_size_);
    }
  }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    const std::vector<uint32_t>& matched = Matched();
    const double denom = ctx.num_tokens > 0 ? static_cast<double>(ctx.num_tokens) : 1.0;
    auto tree_match = [&](const Candidate& x) { return matched[x.id] / denom; };
    scoring::FillTerms(
        c, ctx, {}, [](const Candidate& x) { return x.match; },
        [&](const Candidate& x, double) { return tree_match(x); }, terms);
    const size_t n = c.size();
    double lo = c[0].requests, hi = c[0].requests;
    for (const Candidate& x : c) {
      lo = std::min(lo, x.requests);
      hi = std::max(hi, x.requests);
    }
    auto least_requests = [&] {
      return scoring::ArgMin(n, [&](size_t i) { return c[i].requests; }, ctx.rng);
    };
    if (hi - lo > balance_abs_threshold_ && hi > balance_rel_threshold_ * lo) {
      return least_requests();
    }
    size_t best = 0;
    for (size_t i = 1; i < n; ++i) {
      if (tree_match(c[i]) > tree_match(c[best])) best = i;
    }
    return tree_match(c[best]) > cache_threshold_ ? best : least_requests();
  }

 private:
  // The last Prepare's matches on this thread, by worker id (Prepare and Choose of one
  // decision run on the caller's thread).
  static std::vector<uint32_t>& Matched() {
    thread_local std::vector<uint32_t> m;
    return m;
  }
  // Set at construction and by Configure (under the router's exclusive membership lock, while
  // no decision runs), read by Choose and Record (under the shared one).
  double cache_threshold_;
  double balance_abs_threshold_;  // an int knob (requests), compared as a double
  double balance_rel_threshold_;
  double eviction_interval_s_;
  uint64_t max_tree_size_;
  ApproxTree tree_;  // own lock
  std::atomic<double> last_eviction_{-1e300};
};
}  // namespace

// Defaults: vllm-project/router src/main.rs.
const PolicyDef& CacheAwareDef() {
  static const PolicyDef d{
      "cache_aware",
      {FloatKnob("cache_threshold", 0.3, 0, 1,
                 "below this matched fraction of the prompt the least loaded worker takes it"),
       IntKnob("balance_abs_threshold", 64, 0, kIntMax,
               "imbalanced when max - min requests exceed this (and the relative threshold)"),
       FloatKnob("balance_rel_threshold", 1.5, 1, kNoUpperBound,
                 "imbalanced when max requests exceed this x min (and the absolute threshold)"),
       FloatKnob("eviction_interval_s", 120, 0, kNoUpperBound,
                 "seconds between tree evictions; 0 = no eviction"),
       IntKnob("max_tree_size", int64_t{1} << 26, 1, kIntMax,
               "tokens per worker the tree keeps")},
      [](const ParamValues& k) -> std::unique_ptr<Policy> {
        return std::make_unique<CacheAware>(k);
      }};
  return d;
}

}  // namespace kvroute
