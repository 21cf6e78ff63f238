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
  explicit LmcacheAware(const ParamValues& knobs) { Configure(knobs); }
  const char* name() const override { return "lmcache_aware"; }
  bool NeedsExternal() const override { return true; }
  void Configure(const ParamValues& k) override {
    knobs_.cache_weight = FloatParam(k, "cache_weight");
  }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    double max_ext = 0;
    for (const Candidate& x : c) max_ext = std::max(max_ext, x.external);
    const double f_ext = max_ext > 0 ? 1.0 / max_ext : 0.0;
    scoring::FillTerms(
        c, ctx, knobs_, [f_ext](const Candidate& x) { return x.external * f_ext; },
        [](const Candidate&, double m) { return m; }, terms);
    return scoring::ArgMaxScore(*terms, ctx.rng);
  }

 private:
  scoring::TermKnobs knobs_;  // its cache_weight; the cost term's default prefill_load_scale
};
}  // namespace

// The controller's URL, worker map, lookup mode and polling are kvroute.lmcache's (Python).
const PolicyDef& LmcacheAwareDef() {
  static const PolicyDef d{
      "lmcache_aware",
      {FloatKnob("cache_weight", scoring::TermKnobs{}.cache_weight, 0, 1,
                 "the controller's numbers against load: 1 = the numbers only, 0 = load only")},
      [](const ParamValues& k) -> std::unique_ptr<Policy> {
        return std::make_unique<LmcacheAware>(k);
      }};
  return d;
}

}  // namespace kvroute
