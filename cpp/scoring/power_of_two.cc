// power_of_two: two distinct workers drawn from the seeded stream; the lower load_w wins.
#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class PowerOfTwo final : public Policy {
 public:
  const char* name() const override { return "power_of_two"; }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    scoring::FillIndexTerms(c, ctx, terms);
    const size_t n = c.size();
    if (n == 1) return 0;
    std::uniform_int_distribution<size_t> d(0, n - 1);
    const size_t a = d(*ctx.rng);
    size_t b = d(*ctx.rng);
    while (b == a) b = d(*ctx.rng);
    return (*terms)[b].load < (*terms)[a].load ? b : a;
  }
};
}  // namespace

const PolicyDef& PowerOfTwoDef() {
  static const PolicyDef d{"power_of_two", {}, [](const ParamValues&) -> std::unique_ptr<Policy> {
                              return std::make_unique<PowerOfTwo>();
                            }};
  return d;
}

}  // namespace kvroute
