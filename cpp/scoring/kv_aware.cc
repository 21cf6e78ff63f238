// kv_aware: argmax over workers of score_w = cache_weight·match_w + (1−cache_weight)·(1−load_w)
// (terms in policy.h); ties go to the lower load, then to a seeded random choice.
#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class KvAware final : public Policy {
 public:
  const char* name() const override { return "kv_aware"; }
  bool UsesIndex() const override { return true; }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    scoring::FillIndexTerms(c, ctx, terms);
    return scoring::ArgMaxScore(*terms, ctx.rng);
  }
};
}  // namespace

std::unique_ptr<Policy> MakeKvAware(const PolicyParams&) { return std::make_unique<KvAware>(); }

}  // namespace kvroute
