// Routing policies: pick one worker from per-worker terms the router computes.
//
// Terms per candidate worker w (the router fills them; see router.cc):
//   match_w    = tier-weighted matched prefix tokens / prompt tokens, in [0, 1]
//   load_w     = mean of the load signals present, each normalised to [0, 1]:
//                  pending_prefill_tokens_w / fleet max   (router's own accounting)
//                  requests_w / fleet max                  (in flight + reported waiting)
//                  kv_cache_usage_perc_w                   (reported; if any worker reported)
//                a signal whose fleet maximum is 0 contributes 0.
//
// Policies (names as in the vLLM / SGLang routers and NVIDIA Dynamo):
//   kv_aware        argmax cache_weight·match + (1−cache_weight)·(1−load); ties → lower load →
//                   seeded random.
//   cost            NVIDIA Dynamo's KV router cost (docs.nvidia.com/dynamo, components/router:
//                   "Routing Concepts" and "Configuration and Tuning", v1.2.1: prefill cost
//                   after device / lower-tier credits, scaled by --router-prefill-load-scale,
//                   plus decode cost from active blocks; --router-temperature softmax):
//                   cost_w = prefill_load_scale · prefill_blocks_w + active_blocks_w, where
//                   prefill_blocks_w = prompt blocks − tier-weighted matched blocks (a block on
//                   CPU / disk is credited by its tier weight) and active_blocks_w = blocks of
//                   the requests the worker is already serving. Lowest cost wins; with
//                   temperature > 0, sample from softmax(−cost / (max cost · temperature)).
//   cache_aware     the approximate policy of the SGLang / vLLM routers (scoring from a radix
//                   tree of the router's own decisions, no events): if load is imbalanced
//                   (max − min requests > balance_abs_threshold and max > balance_rel_threshold
//                   · min) → least loaded; else the best tree match if its match ratio >
//                   cache_threshold; else least loaded.
//   lmcache_aware   an LMCache controller's view: argmax cache_weight·external_w / max external
//                   + (1−cache_weight)·(1−load_w), external = key count (occupancy) or matched
//                   tokens (prefix lookup); ties → lower load → seeded random.
//   round_robin     workers in turn.
//   random          uniform, seeded.
//   power_of_two    two distinct random workers, the lower load_w wins.
//   least_load      argmin load_w; ties → seeded random.
//   consistent_hash ring with `virtual_nodes` points per worker over xxh3 of its name; the
//                   session key's hash picks the first point clockwise.
//   rendezvous_hash highest random weight: argmax over workers of xxh3(session, seed = worker);
//                   removing a worker moves only its own sessions.
//
// Thread safety: Choose is pure apart from the caller-owned Rng / counter it is given;
// HashRing is immutable once built.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace kvroute {

enum class PolicyKind : uint8_t {
  kKvAware = 0,
  kRoundRobin,
  kPowerOfTwo,
  kRandom,
  kLeastLoad,
  kConsistentHash,
  kRendezvousHash,
  kCost,
  kCacheAware,
  kLmcacheAware,
};
// Throws std::invalid_argument listing the valid names.
PolicyKind ParsePolicy(const std::string& name);
const char* PolicyName(PolicyKind p);
std::string PolicyNames();  // "kv_aware, cost, ..." for messages
// Policies that read the KV-event index (and fall back while it is empty or untrusted).
bool UsesIndex(PolicyKind p);

struct PolicyParams {
  double cache_weight = 0.7;
  uint32_t virtual_nodes = 160;
  double prefill_load_scale = 1.0;
  double temperature = 0.0;
  double cache_threshold = 0.3;
  double balance_abs_threshold = 64;
  double balance_rel_threshold = 1.5;
};

struct Candidate {
  double match = 0.0;            // match_w in [0, 1]
  double weighted_blocks = 0.0;  // tier-weighted matched blocks
  double pending_prefill = 0.0;  // tokens
  double requests = 0.0;         // in-flight + reported waiting
  double kv_usage = -1.0;        // [0, 1], or < 0 when not reported
  double active_blocks = 0.0;    // blocks of the requests in flight on the worker
  double tree_match = 0.0;       // cache_aware: approximate-tree matched tokens / prompt tokens
  uint64_t name_hash = 0;        // xxh3 of the worker's name
  double external = 0.0;         // lmcache_aware: the controller's number (key count or matched
                                 // tokens) for this worker; 0 when it reported none
  bool excluded = false;         // never chosen (the caller's exclude list: failed upstream,
                                 // open circuit breaker); left out of every normaliser
};

struct ScoreTerms {
  double match = 0.0;
  double load = 0.0;   // load_w in [0, 1]
  double score = 0.0;  // kv_aware score (higher is better)
  double cost = 0.0;   // cost policy (lower is better)
};

// Consistent-hash ring over the candidates, in candidate order. Build on membership change.
class HashRing {
 public:
  void Build(const std::vector<uint64_t>& name_hashes, uint32_t virtual_nodes);
  // Candidate index for a session hash. REQUIRES: built over at least one candidate.
  size_t Pick(uint64_t session_hash) const;
  // The first point at or after the session hash whose candidate is not excluded (so only the
  // sessions of excluded candidates move). REQUIRES: some candidate is not excluded.
  size_t Pick(uint64_t session_hash, const std::vector<Candidate>& c) const;
  bool empty() const { return points_.empty(); }

 private:
  std::vector<std::pair<uint64_t, uint32_t>> points_;  // sorted (point, candidate)
};

struct ChooseContext {
  const PolicyParams* params = nullptr;
  double prompt_blocks = 0;      // full blocks in the prompt
  uint64_t session_hash = 0;     // hashing policies
  const HashRing* ring = nullptr;
  std::mt19937_64* rng = nullptr;
  uint64_t* rr_counter = nullptr;
};

// Fills terms[i] for every candidate and returns the chosen index. Excluded candidates are
// never chosen and get zero terms; the others are scored as if the excluded were absent.
// REQUIRES: some candidate is not excluded.
size_t Choose(PolicyKind p, const std::vector<Candidate>& c, const ChooseContext& ctx,
              std::vector<ScoreTerms>* terms);

}  // namespace kvroute
