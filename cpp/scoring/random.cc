// random: a uniform draw from the router's seeded stream.
#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class Random final : public Policy {
 public:
  const char* name() const override { return "random"; }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    scoring::FillIndexTerms(c, ctx, terms);
    return std::uniform_int_distribution<size_t>(0, c.size() - 1)(*ctx.rng);
  }
};
}  // namespace

const PolicyDef& RandomDef() {
  static const PolicyDef d{"random", {}, [](const ParamValues&) -> std::unique_ptr<Policy> {
                              return std::make_unique<Random>();
                            }};
  return d;
}

}  // namespace kvroute
