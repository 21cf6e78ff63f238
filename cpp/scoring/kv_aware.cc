// kv_aware: argmax over workers of, in tokens of prefill (P = prompt tokens),
//   score_w = cache_weight·credit_w·match_w + (1−cache_weight)·(1−load_w)
//   match_w  = tier-weighted matched prefix tokens / P (policy.h)
//   s        = (min over workers of pending_prefill / fleet max of pending_prefill)^6,
//              in [0, 1]: the saturation weight (1 with size_aware)
//   credit_w = 1 / (1 + s·(pending_prefill_w − min over workers of pending_prefill) / P)
//   load_w   = mean of the signals present, each in [0, 1]:
//                projected_w / fleet max of projected, projected_w = pending_prefill_w
//                    + s·P·(1 − match_w) (at s = 1: the prefill the worker computes before
//                    this request's first token)
//                requests_w / fleet max (in flight + reported waiting)
//                kv_cache_usage_perc_w (if any worker reported one)
// ties go to the lower load, then to a seeded random choice.
//
// At s = 0 (some worker has no queued prefill) this is the plain score of policy.h:
// credit_w = 1 and projected_w = pending_prefill_w. The plain load term divides queued prefill
// by its fleet maximum; past saturation every worker's queue is long and the term lives in
// [min / max, 1], so a small difference in match outweighs seconds of queueing. s grows with
// min / max and turns on the two size-aware terms, both NVIDIA Dynamo's (ai-dynamo/dynamo,
// lib/kv-router/src/scheduling/selector/default.rs, DefaultWorkerScorer::worker_logit):
// projected_w at s = 1 is its raw prefill (queued prefill tokens + prompt) minus the overlap
// credit, and credit_w at s = 1 its overlap_score_credit_decay = 1 (Dynamo's default 0 turns
// it off): a match on a worker whose queue holds k prompts' worth more prefill than the least
// loaded worker's counts 1/(1+k), since it saves at most one prompt's prefill and costs k of
// waiting. The exponent 6 is measured (kvroute replay, Mooncake, 8 workers; the ablation is
// in python/kvroute/replay/README.md): at 12x the trace's rate the weighted terms keep mean
// and p90 TTFT below cache_aware's, at 1x they leave the plain score's results as they are
// and at 10x within the seed-to-seed spread; the terms at full weight (size_aware) raise
// TTFT at 10x.
// O(candidates).
#include <algorithm>

#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class KvAware final : public Policy {
 public:
  explicit KvAware(const ParamValues& knobs) { Configure(knobs); }
  const char* name() const override { return "kv_aware"; }
  bool UsesIndex() const override { return true; }
  void Configure(const ParamValues& knobs) override {
    cache_weight_ = FloatParam(knobs, "cache_weight");
    size_aware_ = BoolParam(knobs, "size_aware");
  }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    double min_pending = c[0].pending_prefill, max_pending = 0;
    for (const Candidate& x : c) {
      min_pending = std::min(min_pending, x.pending_prefill);
      max_pending = std::max(max_pending, x.pending_prefill);
    }
    double s = 1.0;
    if (!size_aware_) {
      const double q = max_pending > 0 ? min_pending / max_pending : 0.0;
      const double q2 = q * q;
      s = q2 * q2 * q2;
    }
    if (s <= 0) {  // some worker has no queued prefill: the plain score
      scoring::FillIndexTerms(c, ctx, terms, {cache_weight_, kReported.prefill_load_scale});
      return scoring::ArgMaxScore(*terms, ctx.rng);
    }
    const double prompt = static_cast<double>(ctx.num_tokens);
    const double s_prompt = s * prompt;
    double max_projected = 0, max_req = 0;
    bool any_usage = false;
    for (const Candidate& x : c) {
      max_projected = std::max(max_projected, x.pending_prefill + s_prompt * (1.0 - x.match));
      max_req = std::max(max_req, x.requests);
      any_usage = any_usage || x.kv_usage >= 0;
    }
    const double f_projected = max_projected > 0 ? 1.0 / max_projected : 0.0;
    const double f_req = max_req > 0 ? 1.0 / max_req : 0.0;
    const double f_signals = 1.0 / (any_usage ? 3 : 2);
    const double f_prompt = prompt > 0 ? 1.0 / prompt : 0.0;
    const double cw = cache_weight_;
    const double per_block = 1.0 / ctx.block_size;
    terms->resize(c.size());
    ScoreTerms* t = terms->data();
    for (size_t i = 0; i < c.size(); ++i) {
      const Candidate& x = c[i];
      double load =
          (x.pending_prefill + s_prompt * (1.0 - x.match)) * f_projected + x.requests * f_req;
      if (any_usage) load += std::clamp(x.kv_usage, 0.0, 1.0);
      load *= f_signals;
      const double m = x.match / (1.0 + s * (x.pending_prefill - min_pending) * f_prompt);
      t[i].match = m;
      t[i].load = load;
      t[i].score = cw * m + (1.0 - cw) * (1.0 - load);
      // The cost term, as every policy reports it (terms.h FillTerms).
      const double prefill_blocks = (x.pending_prefill + prompt) * per_block;
      t[i].cost = kReported.prefill_load_scale * std::max(0.0, prefill_blocks - x.weighted_blocks) +
                  x.active_blocks;
    }
    return scoring::ArgMaxScore(*terms, ctx.rng);
  }

 private:
  static constexpr scoring::TermKnobs kReported{};  // the cost term it reports
  double cache_weight_;
  bool size_aware_;
};
}  // namespace

const PolicyDef& KvAwareDef() {
  static const PolicyDef d{
      "kv_aware",
      {FloatKnob("cache_weight", scoring::TermKnobs{}.cache_weight, 0, 1,
                 "prefix reuse against load: 1 = pure prefix affinity, 0 = pure load"),
       BoolKnob("size_aware", false,
                "NVIDIA Dynamo's size-aware terms at full weight at every load (off: weighted "
                "by the fleet's saturation, (min / max queued prefill)^6)")},
      [](const ParamValues& k) -> std::unique_ptr<Policy> { return std::make_unique<KvAware>(k); }};
  return d;
}

}  // namespace kvroute
