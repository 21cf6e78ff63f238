// cost: NVIDIA Dynamo's KV-router cost and sampling (ai-dynamo/dynamo, lib/kv-router
// scheduling: DefaultWorkerScorer::worker_logit and softmax_sample_index; KvRouterConfig
// defaults overlap_score_credit 1.0, prefill_load_scale 1.0, decode_active_request_weight 0,
// overlap_score_credit_decay 0, router_temperature 0, host / disk credits 0.75 / 0.25):
//   cost_w = prefill_load_scale · max(0, raw_prefill_blocks_w − overlap_credit_blocks_w)
//            + decode_blocks_w
//   raw_prefill_blocks_w   = (queued prefill tokens on w + prompt tokens) / block_size
//   overlap_credit_blocks_w = matched prefix blocks, each credited by its best tier
//                             (the Router's tier_weights: GPU 1.0, CPU 0.8, DISK 0.25 by
//                             default; Dynamo credits host-pinned blocks 0.75: pass
//                             tier_weights={"CPU": 0.75} for Dynamo's credits)
//   decode_blocks_w        = blocks of the requests in flight on w (each request counted on
//                             its own: Dynamo without router_assume_kv_reuse). The request's
//                             own blocks, which Dynamo adds too, are the same on every worker
//                             and change neither the choice nor the probabilities.
// The prompt's partial last block counts as a fraction, as Dynamo's isl_tokens / block_size.
// Lowest cost wins (temperature 0; ties: seeded random). With temperature T > 0, a draw from
//   p_w ∝ exp(−(cost_w − min cost) / ((max cost − min cost) · T)),
// uniform when every cost is equal: Dynamo's normalisation over the cost range, so adding the
// same load to every worker changes nothing.
#include <cmath>
#include <limits>

#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {

class Cost final : public Policy {
 public:
  explicit Cost(const ParamValues& knobs) { Configure(knobs); }
  const char* name() const override { return "cost"; }
  bool UsesIndex() const override { return true; }
  void Configure(const ParamValues& knobs) override {
    knobs_.prefill_load_scale = FloatParam(knobs, "prefill_load_scale");
    temperature_ = FloatParam(knobs, "temperature");
  }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    scoring::FillIndexTerms(c, ctx, terms, knobs_);  // the cost term is the formula above
    const size_t n = c.size();
    double lo = std::numeric_limits<double>::infinity();
    double hi = -lo;
    for (const ScoreTerms& t : *terms) {
      lo = std::min(lo, t.cost);
      hi = std::max(hi, t.cost);
    }
    const double temperature = temperature_;
    if (temperature <= 0) {
      return scoring::ArgMin(n, [&](size_t i) { return (*terms)[i].cost; }, ctx.rng);
    }
    std::vector<double> w(n, 1.0);  // equal costs: uniform
    if (hi > lo) {
      const double denom = (hi - lo) * temperature;
      for (size_t i = 0; i < n; ++i) w[i] = std::exp(-((*terms)[i].cost - lo) / denom);
    }
    return std::discrete_distribution<size_t>(w.begin(), w.end())(*ctx.rng);
  }

 private:
  scoring::TermKnobs knobs_;  // its prefill_load_scale; the score term's default cache_weight
  double temperature_;
};
}  // namespace

const PolicyDef& CostDef() {
  static const PolicyDef d{
      "cost",
      {FloatKnob("prefill_load_scale", scoring::TermKnobs{}.prefill_load_scale, 0,
                 kNoUpperBound, "weight of the blocks still to prefill"),
       FloatKnob("temperature", 0.0, 0, kNoUpperBound,
                 "softmax temperature over the cost range (Dynamo's router_temperature); "
                 "0 = lowest cost")},
      [](const ParamValues& k) -> std::unique_ptr<Policy> { return std::make_unique<Cost>(k); }};
  return d;
}

}  // namespace kvroute
