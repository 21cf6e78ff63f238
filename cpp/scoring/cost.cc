// cost: NVIDIA Dynamo's KV router cost (docs.nvidia.com/dynamo, components/router: "Routing
// Concepts" and "Configuration and Tuning", v1.2.1: prefill cost after device / lower-tier
// credits, scaled by --router-prefill-load-scale, plus decode cost from active blocks;
// --router-temperature softmax):
//   cost_w = prefill_load_scale · prefill_blocks_w + active_blocks_w
// prefill_blocks_w = prompt blocks − tier-weighted matched blocks (a block on CPU / disk is
// credited by its tier weight); active_blocks_w = blocks of the requests the worker is already
// serving. Lowest cost wins (ties: seeded random); with temperature > 0, a draw from
// softmax(−cost / (max cost · temperature)).
#include <cmath>

#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class Cost final : public Policy {
 public:
  const char* name() const override { return "cost"; }
  bool UsesIndex() const override { return true; }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    const double max_cost = scoring::FillIndexTerms(c, ctx, terms);
    const size_t n = c.size();
    const double temperature = ctx.params->temperature;
    if (temperature <= 0 || max_cost <= 0) {
      return scoring::ArgMin(n, [&](size_t i) { return (*terms)[i].cost; }, ctx.rng);
    }
    // p_i ∝ exp(−cost_i / (max_cost · temperature)), shifted by the max for range.
    std::vector<double> w(n);
    double m = -1e300;
    for (size_t i = 0; i < n; ++i) {
      w[i] = -(*terms)[i].cost / (max_cost * temperature);
      m = std::max(m, w[i]);
    }
    for (double& x : w) x = std::exp(x - m);
    return std::discrete_distribution<size_t>(w.begin(), w.end())(*ctx.rng);
  }
};
}  // namespace

std::unique_ptr<Policy> MakeCost(const PolicyParams&) { return std::make_unique<Cost>(); }

}  // namespace kvroute
