// round_robin: the workers in turn (the router's counter, modulo the candidates).
#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class RoundRobin final : public Policy {
 public:
  const char* name() const override { return "round_robin"; }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    scoring::FillIndexTerms(c, ctx, terms);
    return static_cast<size_t>((*ctx.rr_counter)++ % c.size());
  }
};
}  // namespace

const PolicyDef& RoundRobinDef() {
  static const PolicyDef d{"round_robin", {}, [](const ParamValues&) -> std::unique_ptr<Policy> {
                              return std::make_unique<RoundRobin>();
                            }};
  return d;
}

}  // namespace kvroute
