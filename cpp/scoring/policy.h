// Routing policies: pick one worker from per-worker prefix-match and load terms.
//
// kv_aware (default):
//   match_w    = weighted_matched_tokens_w / prompt_tokens          in [0, 1]
//                (matched blocks x block_size, each block credited by its best tier weight)
//   load_w     = mean of the load signals available for the fleet, each normalised to [0, 1]:
//                  pending_prefill_tokens_w / max_v pending_prefill_tokens_v  (router's own)
//                  requests_w / max_v requests_v     (router in-flight + reported waiting)
//                  kv_cache_usage_perc_w             (reported; only if any worker reported)
//                a signal whose fleet maximum is 0 contributes 0.
//   score_w    = cache_weight x match_w + (1 - cache_weight) x (1 - load_w)
//   choice     = argmax score; ties (|diff| < 1e-9) -> lower load_w, then a seeded random pick.
// round_robin : workers in turn.
// power_of_two: two distinct workers drawn at random, the one with the lower load_w wins.
//
// Thread safety: Choose is pure apart from the caller-owned Rng / counter it is given.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace kvroute {

enum class PolicyKind : uint8_t { kKvAware = 0, kRoundRobin = 1, kPowerOfTwo = 2 };
// Throws std::invalid_argument listing the valid names.
PolicyKind ParsePolicy(const std::string& name);
const char* PolicyName(PolicyKind p);

struct Candidate {
  double match = 0.0;            // match_w in [0, 1]
  double pending_prefill = 0.0;  // tokens
  double requests = 0.0;         // in-flight + reported waiting
  double kv_usage = -1.0;        // [0, 1], or < 0 when not reported
};

struct ScoreTerms {
  double match = 0.0;
  double load = 0.0;  // load_w in [0, 1]
  double score = 0.0;
};

// Fills terms[i] for every candidate (kv_aware formula, whatever the policy) and returns the
// chosen index. REQUIRES: !c.empty().
size_t Choose(PolicyKind p, const std::vector<Candidate>& c, double cache_weight,
              std::mt19937_64* rng, uint64_t* rr_counter, std::vector<ScoreTerms>* terms);

}  // namespace kvroute
