// least_load: argmin load_w; ties broken by the seeded stream.
#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class LeastLoad final : public Policy {
 public:
  const char* name() const override { return "least_load"; }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    scoring::FillIndexTerms(c, ctx, terms);
    return scoring::ArgMin(c.size(), [&](size_t i) { return (*terms)[i].load; }, ctx.rng);
  }
};
}  // namespace

const PolicyDef& LeastLoadDef() {
  static const PolicyDef d{"least_load", {}, [](const ParamValues&) -> std::unique_ptr<Policy> {
                              return std::make_unique<LeastLoad>();
                            }};
  return d;
}

}  // namespace kvroute
