// consistent_hash: a ring with `virtual_nodes` points per worker, each point xxh3 of the point
// number seeded with the worker's name hash; the session hash picks the first point clockwise.
// The ring keeps every worker when some are excluded from a decision, so only the excluded
// workers' sessions move (to the next point clockwise whose worker is not excluded).
#include <xxhash.h>

#include <algorithm>
#include <utility>

#include "scoring/policy.h"
#include "scoring/terms.h"

namespace kvroute {
namespace {
class ConsistentHash final : public Policy {
 public:
  explicit ConsistentHash(const ParamValues& knobs) { Configure(knobs); }
  const char* name() const override { return "consistent_hash"; }
  bool HashesSession() const override { return true; }

  // The ring is rebuilt by the OnMembership that follows (Router::SetPolicy calls it).
  void Configure(const ParamValues& k) override {
    virtual_nodes_ = static_cast<uint32_t>(IntParam(k, "virtual_nodes"));
  }

  // O(workers · virtual_nodes · log) : a sort of every point.
  void OnMembership(const std::vector<uint64_t>& name_hashes) override {
    points_.clear();
    points_.reserve(name_hashes.size() * virtual_nodes_);
    for (uint32_t c = 0; c < name_hashes.size(); ++c) {
      for (uint32_t v = 0; v < virtual_nodes_; ++v) {
        points_.emplace_back(XXH3_64bits_withSeed(&v, sizeof(v), name_hashes[c]), c);
      }
    }
    std::sort(points_.begin(), points_.end());
  }

 protected:
  size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                     std::vector<ScoreTerms>* terms) override {
    scoring::FillIndexTerms(c, ctx, terms);
    auto it = First(ctx.session_hash);
    return it == points_.end() ? 0 : it->second;
  }
  size_t PickWithExclusions(size_t, const std::vector<size_t>&, const std::vector<Candidate>& c,
                            const ChooseContext& ctx) override {
    auto it = First(ctx.session_hash);
    for (size_t step = 0; step < points_.size(); ++step, ++it) {
      if (it == points_.end()) it = points_.begin();  // wrap around the ring
      if (!c[it->second].excluded) return it->second;
    }
    return 0;  // unreachable while some candidate is not excluded
  }

 private:
  using Point = std::pair<uint64_t, uint32_t>;  // (point, candidate)
  // The first point at or after the hash, wrapping around; end() only for an empty ring.
  std::vector<Point>::const_iterator First(uint64_t session_hash) const {
    auto it = std::lower_bound(points_.begin(), points_.end(), Point{session_hash, 0});
    return it == points_.end() ? points_.begin() : it;
  }
  uint32_t virtual_nodes_;
  std::vector<Point> points_;  // sorted
};
}  // namespace

const PolicyDef& ConsistentHashDef() {
  static const PolicyDef d{
      "consistent_hash",
      {IntKnob("virtual_nodes", 160, 1, 0xffffffff,
               "ring points per worker (vllm-project/router VIRTUAL_NODES_PER_WORKER)")},
      [](const ParamValues& k) -> std::unique_ptr<Policy> {
        return std::make_unique<ConsistentHash>(k);
      }};
  return d;
}

}  // namespace kvroute
