// lmcache_aware: an LMCache controller's view of the fleet (kvroute.lmcache fetches it):
//   argmax cache_weight·external_w / max external + (1−cache_weight)·(1−load_w)
// external = the controller's key count (occupancy) or matched tokens (prefix lookup) for the
// worker; ties go to the lower load, then to a seeded random choice. Without the controller's
// numbers (NeedsExternal) the router's fallback policy decides.
#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class LmcacheAware final : public Policy {
 public:
  const char* name() const override { return "lmcache_aware"; }
  bool NeedsExternal() const override { return true; }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    double max_ext = 0;
    for (const Candidate& x : c) max_ext = std::max(max_ext, x.external);
    const double f_ext = max_ext > 0 ? 1.0 / max_ext : 0.0;
    scoring::FillTerms(
        c, ctx, [f_ext](const Candidate& x) { return x.external * f_ext; },
        [](const Candidate&, double m) { return m; }, terms);
    return scoring::ArgMaxScore(*terms, ctx.rng);
  }
};
}  // namespace

std::unique_ptr<Policy> MakeLmcacheAware(const PolicyParams&) {
  return std::make_unique<LmcacheAware>();
}

}  // namespace kvroute
