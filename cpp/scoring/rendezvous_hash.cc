// rendezvous_hash: highest random weight, argmax over workers of xxh3(session hash, seed =
// the worker's name hash); removing a worker moves only its own sessions.
#include <xxhash.h>

#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class RendezvousHash final : public Policy {
 public:
  const char* name() const override { return "rendezvous_hash"; }
  bool HashesSession() const override { return true; }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    scoring::FillIndexTerms(c, ctx, terms);
    size_t best = 0;
    uint64_t best_w = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      const uint64_t w = XXH3_64bits_withSeed(&ctx.session_hash, 8, c[i].name_hash);
      if (i == 0 || w > best_w) {
        best = i;
        best_w = w;
      }
    }
    return best;
  }
};
}  // namespace

const PolicyDef& RendezvousHashDef() {
  static const PolicyDef d{"rendezvous_hash", {}, [](const ParamValues&) -> std::unique_ptr<Policy> {
                              return std::make_unique<RendezvousHash>();
                            }};
  return d;
}

}  // namespace kvroute
