// Router: the index, the ingestion threads, load accounting and a policy, behind one object.
//
// Thread safety: every public method may be called from any thread concurrently, including
// while ingestion threads apply events. Locks, outermost first:
//   workers_mu_ (shared for Select/Stats, exclusive for Add/Remove)
//   WorkerRuntime::mu (serialises the events of one worker: subscriber thread or Ingest())
//   Index's own lock (one event at a time), load_mu_ (decisions and load counters, short).
// Ingestion threads never touch Python (see events/subscriber.h).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "events/decoder.h"
#include "events/subscriber.h"
#include "index/index.h"
#include "scoring/approx_tree.h"
#include "scoring/policy.h"

namespace kvroute {

// Select was told to exclude every worker.
struct NoWorkerAvailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct WorkerConfig {
  std::string name;      // identity of the worker (its URL, plus "|dp=<r>" when ranked)
  std::string endpoint;  // KV-event endpoint; empty = no socket, events fed through Ingest()
  bool bind = false;     // bind the SUB socket instead of connecting
  int64_t dp_rank = -1;  // expected data-parallel rank of the batches; -1 = accept any
  std::string replay_endpoint;  // the engine's replay ROUTER socket; empty = no replay
};

// How far the index can be trusted for one worker.
//   kExact      : every batch since the worker joined was applied (or a restart cleared it).
//   kRecovering : a sequence gap is being filled from the worker's replay endpoint.
//   kDegraded   : batches were lost and could not be replayed; the worker's state was dropped
//                 and is rebuilt from new events. Back to exact on an AllBlocksCleared from
//                 the worker, or after RouterOptions::degraded_hold_s.
enum class WorkerState : uint8_t { kExact = 0, kRecovering = 1, kDegraded = 2 };
const char* WorkerStateName(WorkerState s);

struct RouterOptions {
  IndexOptions index;
  PolicyKind policy = PolicyKind::kKvAware;
  PolicyKind fallback = PolicyKind::kPowerOfTwo;  // see Decision::reason
  PolicyParams params;  // cache_weight, virtual_nodes, cost and cache_aware knobs
  double eviction_interval_s = 120;  // cache_aware: approximate-tree LRU eviction period
  uint64_t max_tree_size = 1ull << 26;  // cache_aware: tokens kept per worker in the tree
  double speculative_ttl_s = 2.0;
  uint64_t seed = 0;
  std::string topic;  // SUB prefix filter
  int ingest_threads = 1;
  int ingest_nice = 0;  // nice increment of the ingestion threads (Subscriber), 0-19
  DecodeLimits limits;
  double replay_timeout_s = 1.0;  // bound on one replay exchange (the ingestion thread waits)
  double degraded_hold_s = 60.0;  // how long a worker stays degraded after a reset
};

struct WorkerScore {
  std::string worker;
  uint32_t matched_blocks = 0;
  double weighted_matched_tokens = 0;
  ScoreTerms terms;
  double pending_prefill_tokens = 0;
  double requests = 0;
};

struct Decision {
  uint64_t request_id = 0;
  std::string worker;
  uint32_t matched_blocks = 0;
  uint64_t matched_tokens = 0;  // matched_blocks x block_size (tokens the worker can reuse)
  uint64_t prompt_tokens = 0;
  uint64_t prefill_tokens = 0;  // prompt_tokens - matched_tokens
  PolicyKind policy = PolicyKind::kKvAware;  // the policy that made the decision
  bool fallback = false;        // made by the fallback policy
  const char* reason = "policy";  // "policy", or why the fallback decided: "no_events",
                                  // "all_degraded", "controller_down"
  bool degraded = false;        // the chosen worker (or every worker) was degraded
  std::vector<WorkerScore> scores;  // filled when explain=true
};

struct WorkerMatch {
  std::string worker;
  uint32_t blocks = 0;
  uint64_t tokens = 0;
  double weighted_tokens = 0;
};

struct WorkerStats {
  WorkerConfig config;
  WorkerState state = WorkerState::kExact;
  uint64_t replays = 0;            // replay requests sent
  uint64_t batches_recovered = 0;  // batches applied from replay
  uint64_t replay_failures = 0;    // replays that timed out or could not cover the gap
  uint64_t resets = 0;             // worker state dropped (restart or unrecoverable gap)
  uint64_t joined_late = 0;        // first batch seen had seq > 0 (router started after it)
  bool seen_seq = false;
  uint64_t last_seq = 0;
  uint64_t gaps = 0;             // forward jumps in the sequence number
  uint64_t missing_batches = 0;  // batches skipped over by those jumps
  uint64_t backward_jumps = 0;   // sequence went backwards (engine restart)
  uint64_t batches = 0;          // batches decoded and applied
  uint64_t unsequenced = 0;      // two-frame messages (no sequence number)
  bool has_dp_rank = false;
  int64_t last_dp_rank = 0;
  double last_event_ts = 0;      // ts of the last batch (engine clock, epoch seconds)
  double last_recv_age_s = -1;   // seconds since the last message (-1: none yet)
  ApplyCounts apply;
  DropCounts drops;              // batches dropped (decoder, frames, rank)
  uint64_t indexed_blocks = 0;
  uint64_t evicted_by_cap = 0;
  int64_t inflight_requests = 0;
  int64_t pending_prefill_tokens = 0;
  double num_requests_waiting = 0;
  double kv_cache_usage_perc = -1;
};

class Router {
 public:
  Router(RouterOptions opts, const std::vector<WorkerConfig>& workers);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  const RouterOptions& options() const { return opts_; }

  // Throws std::invalid_argument on a duplicate name or a socket that cannot be set up.
  void AddWorker(const WorkerConfig& w) { AddWorker(w, /*rebuild_ring=*/true); }
  // Throws std::out_of_range for an unknown name. Returns after the worker's socket is
  // closed and everything it held is gone from the index.
  void RemoveWorker(const std::string& name);

  // REQUIRES: at least one worker (else std::logic_error). Tokens are token ids.
  // `now_s` is the clock for speculative entries (seconds); < 0 = steady clock. A caller
  // that passes its own clock (e.g. a simulator's virtual time) must always pass it.
  // `external`: lmcache_aware's per-worker numbers by worker name; null = the controller is
  // unreachable (the fallback policy decides, reason "controller_down").
  // `session_key` feeds the hashing policies (empty: a hash of the prompt's first 256 tokens).
  // `exclude`: worker names never to choose (unknown names are ignored); throws
  // NoWorkerAvailable when it covers every worker.
  // `dry_run`: decide without acting on it: no load accounted (request_id 0), no speculative
  // credit, nothing learned by cache_aware's tree, the round-robin position and the random
  // stream untouched. For explain endpoints and what-if tools.
  Decision Select(const uint32_t* tokens, size_t n, std::string_view lora_name,
                  const std::vector<std::string>* extra_keys, bool explain, double now_s = -1,
                  std::string_view session_key = {},
                  const std::unordered_map<std::string, double>* external = nullptr,
                  const std::vector<std::string>* exclude = nullptr, bool dry_run = false);
  std::vector<WorkerMatch> FindMatches(const uint32_t* tokens, size_t n,
                                       std::string_view lora_name,
                                       const std::vector<std::string>* extra_keys);
  // Releases a decision's load. Returns false if the id is unknown (already completed).
  bool Complete(uint64_t request_id);
  // Releases only the prefill part (first token arrived). Returns false if unknown.
  bool FirstToken(uint64_t request_id);
  // Throws std::out_of_range for an unknown worker. nullopt leaves a signal unchanged.
  void UpdateLoad(const std::string& name, std::optional<double> num_requests_waiting,
                  std::optional<double> kv_cache_usage_perc);
  // Forgets the engine-reported load of a worker (e.g. its scrape went stale): waiting 0,
  // KV usage unreported. Throws std::out_of_range for an unknown worker.
  void ClearLoad(const std::string& name);

  // Feeds one message as if it came from the worker's socket (same path as ingestion).
  // Throws std::out_of_range for an unknown worker. Returns false if the batch was dropped.
  bool Ingest(const std::string& name, bool has_seq, uint64_t seq, const char* payload,
              size_t len);

  std::vector<WorkerStats> Stats() const;
  // The worker's indexed blocks (see Index::WorkerEntries). Throws std::out_of_range.
  std::vector<Index::WorkerEntry> WorkerBlocks(const std::string& name) const;
  uint64_t EventsApplied() const { return events_applied_.load(); }
  const Index& index() const { return index_; }

  // Stops ingestion and joins its threads. Idempotent; the destructor calls it.
  void Close();

 private:
  struct WorkerRuntime;
  bool HandleMessage(WorkerRuntime& rt, const WireMessage& m);
  // REQUIRES: rt.mu held (for the next three).
  bool HandleMessageLocked(WorkerRuntime& rt, const WireMessage& m, bool allow_replay);
  bool ApplyPayload(WorkerRuntime& rt, const char* payload, size_t len);
  void Reset(WorkerRuntime& rt, bool degraded);
  // Recovery: StartRecovery (rt.mu held) hands the stream to a thread running RecoveryMain,
  // which replays through Exchange (rt.mu taken per applied batch) and then drains the live
  // messages that queued up meanwhile.
  struct RecoveryJob {
    enum Kind { kGap, kRestart, kFirstContact } kind;
    uint64_t from;
    uint64_t until;
    bool verify;            // kGap: the batch at `from` must be the one applied last
    uint64_t verify_hash;
    uint8_t prior_state;
  };
  void StartRecovery(WorkerRuntime& rt, RecoveryJob job, const WireMessage& live);
  enum ExchangeResult { kDone, kUncovered, kTimedOut, kRestarted };
  ExchangeResult Exchange(WorkerRuntime& rt, uint64_t from, uint64_t until, bool verify,
                          uint64_t verify_hash, bool first_contact);
  void RecoveryMain(WorkerRuntime& rt);
  WorkerState StateOf(WorkerRuntime& rt, double now) const;
  // The live worker of that name, or null. REQUIRES: workers_mu_ held (shared suffices).
  std::shared_ptr<WorkerRuntime> Find(const std::string& name) const;
  double Now() const;

  RouterOptions opts_;
  Index index_;
  zmq::context_t replay_ctx_{1};  // DEALER sockets for replay, owned by ingestion threads
  std::shared_ptr<Subscriber> subscriber_;  // guarded by workers_mu_ (+ close_mu_ to create)
  mutable std::shared_mutex workers_mu_;
  std::vector<std::shared_ptr<WorkerRuntime>> workers_;  // live workers, in insertion order
  // The same workers by name, for the calls that name one (ingest, update_load, ...): a scan
  // of workers_ cost one string comparison per worker per call (128 on average at 256
  // workers, for every event given to Ingest()).
  std::unordered_map<std::string, std::shared_ptr<WorkerRuntime>> by_name_;
  HashRing ring_;  // consistent_hash over workers_ (rebuilt on membership change)
  ApproxTree tree_;  // cache_aware: the router's own past decisions (own lock)
  std::atomic<double> last_tree_eviction_{-1e300};
  void RebuildRing();
  // rebuild_ring = false: the constructor builds the ring once, after all its workers.
  void AddWorker(const WorkerConfig& w, bool rebuild_ring);
  std::atomic<uint64_t> events_applied_{0};
  mutable std::mutex load_mu_;
  std::mt19937_64 rng_;
  uint64_t rr_counter_ = 0;
  uint64_t next_request_id_ = 1;
  struct Inflight {
    std::shared_ptr<WorkerRuntime> worker;
    int64_t prefill_tokens;
    int64_t blocks;
    bool prefill_done;
  };
  std::unordered_map<uint64_t, Inflight> inflight_;
  std::mutex close_mu_;
  bool closed_ = false;
  std::atomic<bool> closing_{false};  // recovery threads give up
};

}  // namespace kvroute
