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
  explicit CacheAware(const PolicyParams& p)
      : eviction_interval_s_(p.eviction_interval_s), max_tree_size_(p.max_tree_size) {}
  const char* name() const override { return "cache_aware"; }

  void OnRemoveWorker(WorkerId w) override { tree_.RemoveWorker(w); }
  void OnParams(const PolicyParams& p) override {
    eviction_interval_s_ = p.eviction_interval_s;
    max_tree_size_ = p.max_tree_size;
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
        c, ctx, [](const Candidate& x) { return x.match; },
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
    const PolicyParams& prm = *ctx.params;
    if (hi - lo > prm.balance_abs_threshold && hi > prm.balance_rel_threshold * lo) {
      return least_requests();
    }
    size_t best = 0;
    for (size_t i = 1; i < n; ++i) {
      if (tree_match(c[i]) > tree_match(c[best])) best = i;
    }
    return tree_match(c[best]) > prm.cache_threshold ? best : least_requests();
  }

 private:
  // The last Prepare's matches on this thread, by worker id (Prepare and Choose of one
  // decision run on the caller's thread).
  static std::vector<uint32_t>& Matched() {
    thread_local std::vector<uint32_t> m;
    return m;
  }
  // Set at construction and by OnParams (under the router's exclusive membership lock, while
  // no decision runs), read by Record (under the shared one).
  double eviction_interval_s_;
  uint64_t max_tree_size_;
  ApproxTree tree_;  // own lock
  std::atomic<double> last_eviction_{-1e300};
};
}  // namespace

std::unique_ptr<Policy> MakeCacheAware(const PolicyParams& p) {
  return std::make_unique<CacheAware>(p);
}

}  // namespace kvroute
