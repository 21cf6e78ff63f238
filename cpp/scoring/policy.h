// Routing policies: one interface, one file per policy (cpp/scoring/<name>.cc), one registry.
// Each policy owns its knobs: its file defines them (a schema of ParamSpec, params.h), reads
// them into its own members (Configure) and exports them in its PolicyDef; the registry
// (policy.cc) lists the PolicyDefs.
//
// The router builds one Candidate per worker and asks its Policy to choose among them. Terms
// every policy fills (scoring/terms.h), for candidate worker w:
//   match_w = tier-weighted matched prefix tokens / prompt tokens, in [0, 1]
//   load_w  = mean of the load signals present, each normalised to [0, 1]:
//               pending_prefill_tokens_w / fleet max   (router's own accounting)
//               requests_w / fleet max                  (in flight + reported waiting)
//               kv_cache_usage_perc_w                   (reported; if any worker reported)
//             a signal whose fleet maximum is 0 contributes 0.
//   score_w = cache_weight·match_w + (1−cache_weight)·(1−load_w)   (lmcache_aware, and
//             kv_aware while some worker has no queued prefill; kv_aware.cc weighs in its
//             size-aware terms as every worker's queue fills)
//   cost_w  = prefill_load_scale·max(0, (queued prefill tokens_w + prompt tokens) / block_size
//             − tier-weighted matched blocks_w) + active_blocks_w   (NVIDIA Dynamo's, cost.cc)
//
// Policies (names as in the vLLM / SGLang routers and NVIDIA Dynamo; formulas in each file):
//   kv_aware, cost                  read the KV-event index (UsesIndex)
//   lmcache_aware                   reads an LMCache controller's numbers (NeedsExternal)
//   cache_aware                     the SGLang / vLLM routers' approximate tree (own state)
//   round_robin, random, power_of_two, least_load, consistent_hash, rendezvous_hash
//
// A policy that does not own cache_weight or prefill_load_scale reports its score and cost
// terms with their defaults (terms.h TermKnobs).
//
// Thread safety: the router calls Prepare, Choose and Record under its membership lock held
// shared (Choose also under its load lock, which serialises the Rng and round-robin counter
// in ChooseContext) and OnRemoveWorker under its membership lock held shared, OnMembership
// and Configure under it held exclusively. A policy's own state beyond that (cache_aware's
// tree) has its own lock.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/types.h"
#include "scoring/params.h"

namespace kvroute {

// What a policy may read of one worker.
struct Candidate {
  WorkerId id = kNoWorker;       // the index's worker id (cache_aware's tree is keyed by it)
  uint64_t name_hash = 0;        // xxh3 of the worker's name (hashing policies)
  double match = 0.0;            // match_w in [0, 1]
  double weighted_blocks = 0.0;  // tier-weighted matched blocks
  double pending_prefill = 0.0;  // tokens
  double requests = 0.0;         // in-flight + reported waiting
  double kv_usage = -1.0;        // [0, 1], or < 0 when not reported
  double active_blocks = 0.0;    // blocks of the requests in flight on the worker
  double external = 0.0;         // lmcache_aware: the controller's number (key count or matched
                                 // tokens) for this worker; 0 when it reported none
  bool excluded = false;         // never chosen (the caller's exclude list: failed upstream,
                                 // open circuit breaker); left out of every normaliser
};

struct ScoreTerms {
  double match = 0.0;  // the match term the policy scored (cache_aware: its tree's)
  double load = 0.0;   // load_w in [0, 1]
  double score = 0.0;  // kv_aware / lmcache_aware score (higher is better)
  double cost = 0.0;   // cost policy (lower is better)
};

// One decision's inputs besides the candidates.
struct ChooseContext {
  const uint32_t* tokens = nullptr;  // the prompt (cache_aware)
  size_t num_tokens = 0;
  double now_s = 0;                  // the decision's clock, seconds (cache_aware's LRU)
  double prompt_blocks = 0;          // full blocks in the prompt
  double block_size = 16;            // tokens per block (the index's)
  uint64_t session_hash = 0;         // hashing policies
  std::mt19937_64* rng = nullptr;    // the router's seeded stream (a copy on dry runs)
  uint64_t* rr_counter = nullptr;    // the router's round-robin position (a copy on dry runs)
};

class Policy {
 public:
  virtual ~Policy() = default;
  virtual const char* name() const = 0;  // a static string: the registry's name
  // Reads the KV-event index: the router falls back while the index cannot be trusted.
  virtual bool UsesIndex() const { return false; }
  // Needs the caller's per-worker numbers (Candidate::external); without them it falls back.
  virtual bool NeedsExternal() const { return false; }
  // Reads ChooseContext::session_hash (computed only for these).
  virtual bool HashesSession() const { return false; }

  // Its knobs, every one of its schema's (ResolveParams' output): at construction and when
  // Router::SetPolicy changes them (the policy keeps its state). Must not throw: the values
  // are validated before. Policies without knobs need nothing here.
  virtual void Configure(const ParamValues& /*knobs*/) {}
  // Membership changed: the workers' name hashes, in candidate order.
  virtual void OnMembership(const std::vector<uint64_t>& /*name_hashes*/) {}
  virtual void OnRemoveWorker(WorkerId /*w*/) {}
  // Before a decision's candidates are built (cache_aware matches its tree here).
  virtual void Prepare(const ChooseContext& /*ctx*/, size_t /*worker_id_limit*/) {}
  // After a decision that is acted on (not a dry run). ChooseContext::rng is not valid here.
  virtual void Record(WorkerId /*chosen*/, const ChooseContext& /*ctx*/) {}

  // Fills terms[i] for every candidate and returns the chosen index. Excluded candidates are
  // never chosen and get zero terms; the others are scored as if the excluded were absent.
  // REQUIRES: some candidate is not excluded.
  size_t Choose(const std::vector<Candidate>& c, const ChooseContext& ctx,
                std::vector<ScoreTerms>* terms);

 protected:
  // Choose over candidates none of which is excluded (at least one).
  virtual size_t ChooseAmong(const std::vector<Candidate>& c, const ChooseContext& ctx,
                             std::vector<ScoreTerms>* terms) = 0;
  // The pick among all candidates when some are excluded, given the pick among the others
  // (`back` maps theirs to ours). consistent_hash overrides it: its ring keeps every worker,
  // so that excluding one moves only that worker's sessions.
  virtual size_t PickWithExclusions(size_t sub_pick, const std::vector<size_t>& back,
                                    const std::vector<Candidate>& /*c*/,
                                    const ChooseContext& /*ctx*/) {
    return back[sub_pick];
  }
};

// What the registry knows of a policy, defined in the policy's own file (<name>.cc:
// `const PolicyDef& <Name>Def()`).
struct PolicyDef {
  const char* name;               // the registry name (Policy::name())
  std::vector<ParamSpec> knobs;   // its own knobs (params.h); empty for none
  // Builds it from every knob of `knobs` (ResolveParams' output).
  std::unique_ptr<Policy> (*make)(const ParamValues& resolved);
};

// The registry, in its order (policy.cc).
const std::vector<const PolicyDef*>& PolicyDefs();
// Throws std::invalid_argument listing the names.
const PolicyDef& FindPolicy(const std::string& name);
// The policy `name` with the knobs given (the others: their defaults). Throws
// std::invalid_argument for an unknown name (listing the names) or knob (listing the
// policy's), a value of the wrong type or out of range.
std::unique_ptr<Policy> MakePolicy(const std::string& name, const ParamValues& knobs = {});
// Every knob of `name`: `knobs` over its defaults; throws as MakePolicy.
ParamValues ResolvePolicyParams(const std::string& name, const ParamValues& knobs);
// The registry's static string for `name`; throws std::invalid_argument listing the names.
const char* PolicyNameOrThrow(const std::string& name);
std::string PolicyNames();  // "kv_aware, cost, ..." for messages

}  // namespace kvroute
