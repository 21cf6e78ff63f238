// Router: the index, the workers' event streams, load accounting and a policy, behind one
// object. Its parts, each with one job:
//   Index          (index/index.h)           which worker holds which blocks; the prefix walk
//   WorkerStream   (events/worker_stream.h)  one worker's sequence checks, replay, trust state
//   Subscriber     (events/subscriber.h)     the ingestion threads and their SUB sockets
//   LoadTracker    (router/load_tracker.h)   load signals and the requests in flight
//   Policy         (scoring/policy.h)        the choice among candidates (+ the fallback)
// The Router itself keeps the membership (workers by name), builds the candidates of a
// decision and decides when the fallback policy decides instead.
//
// Thread safety: every public method may be called from any thread concurrently, including
// while ingestion threads apply events. Locks, outermost first:
//   workers_mu_ (shared for Select/Stats, exclusive for membership and SetPolicy*)
//   a WorkerStream's lock (serialises the events of one worker: subscriber thread or Ingest())
//   Index's own locks, LoadTracker's lock (decisions and load counters, short).
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

#include "common/event.h"
#include "events/decoder.h"
#include "events/subscriber.h"
#include "events/worker_stream.h"
#include "index/index.h"
#include "router/load_tracker.h"
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
  // The publisher's CurveZMQ public key (Z85, 40 characters): the connected SUB socket is a
  // CURVE client of it (SubscriptionSpec::curve_server_key). Empty: no CURVE. Connected
  // workers only.
  std::string curve_server_key;
};

struct RouterOptions {
  IndexOptions index;
  std::string policy = "kv_aware";       // a registered name (scoring/policy.h)
  std::string fallback = "power_of_two";  // decides when the policy cannot: Decision::reason
  // Each policy's own knobs (its schema: PolicyDef::knobs), those given; the others take
  // their defaults. Router::options() shows every knob, resolved.
  ParamValues policy_params;
  ParamValues fallback_params;
  // A decision credits its worker with the prompt's unmatched blocks until the request's
  // FirstToken / Complete, and speculative_ttl_s seconds after; 0 = no credits.
  double speculative_ttl_s = 2.0;
  uint64_t seed = 0;               // the random choices (ties, random, power_of_two)
  std::string topic;  // SUB prefix filter
  int ingest_threads = 1;
  int ingest_nice = 0;  // nice increment of the ingestion threads (Subscriber), 0-19
  DecodeLimits limits;
  double replay_timeout_s = 1.0;  // bound on one replay exchange (the ingestion thread waits)
  double degraded_hold_s = 60.0;  // how long a worker stays degraded after a reset
  // Messages queued per SUB socket (ZMQ_RCVHWM); each frame is at most
  // max(2 x limits.max_payload_bytes, 16 MiB) (ZMQ_MAXMSGSIZE), which bounds a socket's
  // queue at receive_hwm x that.
  int receive_hwm = 100000;
  // Bytes of live messages a worker keeps while a replay runs (also at most 65,536 of them);
  // past it they are dropped and become the next gap.
  size_t max_replay_queue_bytes = 64u << 20;
  // A worker whose last message (events or an empty batch) is older than this is "stale":
  // decisions treat it as degraded. 0: off.
  double stale_after_s = 0.0;
  // Peer IP addresses a bound SUB socket accepts (ZeroMQ ZAP); empty: any. Connected
  // sockets are not filtered.
  std::vector<std::string> allowed_publisher_ips;
  // CurveZMQ (events/subscriber.h CurveOptions), keys in Z85: the router's secret key (bound
  // SUB sockets are CURVE servers with it; connected CURVE sockets authenticate with it) and
  // the publisher public keys bound sockets accept (empty: any that knows the router's
  // public key). Empty secret key: bound sockets use the NULL mechanism.
  std::string curve_secret_key;
  std::vector<std::string> curve_allowed_publisher_keys;
};

// One decision's request. Only tokens are required.
struct SelectRequest {
  const uint32_t* tokens = nullptr;  // token ids
  size_t num_tokens = 0;
  std::string_view lora_name;
  const std::vector<std::string>* extra_keys = nullptr;  // per block, canonical msgpack
  bool explain = false;  // fill Decision::scores
  // The clock for speculative credits and cache_aware's tree, seconds; < 0 = steady clock.
  // A caller that passes its own clock (e.g. a simulator's virtual time) must always pass it.
  double now_s = -1;
  // Feeds the hashing policies (empty: a hash of the prompt's first 256 tokens).
  std::string_view session_key;
  // lmcache_aware's per-worker numbers by worker name; null = the controller is unreachable
  // (the fallback policy decides, reason "controller_down").
  const std::unordered_map<std::string, double>* external = nullptr;
  // Worker names never to choose (unknown names are ignored); Select throws NoWorkerAvailable
  // when it covers every worker.
  const std::vector<std::string>* exclude = nullptr;
  // Decide without acting on it: no load accounted (request_id 0), no speculative credit,
  // nothing learned by cache_aware's tree, the round-robin position and the random stream
  // untouched. For explain endpoints and what-if tools.
  bool dry_run = false;
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
  // The best prefix match of any worker (excluded ones too), as the index sees it when the
  // decision is made (speculative credits count): what the fleet could have reused.
  uint32_t available_blocks = 0;
  uint64_t available_tokens = 0;  // available_blocks x block_size, at most prompt_tokens
  uint64_t prompt_tokens = 0;
  uint64_t prefill_tokens = 0;  // prompt_tokens - matched_tokens
  const char* policy = "";      // the policy that made the decision (a registered name)
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

// A worker's counters: its stream's (StreamStats), its part of the index, its load.
struct WorkerStats : StreamStats {
  WorkerConfig config;
  TrustState state = TrustState::kExact;
  uint64_t indexed_blocks = 0;
  uint64_t evicted_by_cap = 0;
  int64_t inflight_requests = 0;
  int64_t pending_prefill_tokens = 0;
  double num_requests_waiting = 0;
  double kv_cache_usage_perc = -1;
  int64_t active_blocks = 0;           // prompt blocks of this router's requests in flight
  int64_t peer_inflight_requests = 0;  // SetPeerLoad's counts
  int64_t peer_pending_prefill_tokens = 0;
  int64_t peer_active_blocks = 0;
};

// One worker's part of the index with the stream position it stands at (DumpWorker), what
// a peer replica restores from (RestoreWorker).
struct WorkerDump {
  StreamPosition at;
  TrustState state = TrustState::kExact;
  std::vector<Index::WorkerEntry> entries;
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

  // REQUIRES: at least one worker (else std::logic_error). Throws NoWorkerAvailable when
  // request.exclude covers every worker.
  Decision Select(const SelectRequest& request);
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
  // The other router replicas' load on a worker: their requests in flight, pending prefill
  // tokens and active blocks, summed (replaces the previous counts; all 0 = none). Select
  // adds them to this router's own. Throws std::out_of_range (unknown worker),
  // std::invalid_argument (a negative count).
  void SetPeerLoad(const std::string& name, int64_t inflight, int64_t pending_prefill,
                   int64_t active_blocks);
  // This router's own load per worker, for other replicas (SetPeerLoad there): name,
  // requests in flight, pending prefill tokens, active blocks; workers with all three 0 are
  // left out. O(workers) under the load lock, no stream or index lock.
  struct OwnLoad {
    std::string worker;
    int64_t inflight = 0;
    int64_t pending_prefill = 0;
    int64_t active_blocks = 0;
  };
  std::vector<OwnLoad> LocalLoad() const;
  // A speculative credit made by another replica's decision: `keys` (the blocks it sent to
  // the worker, past its match) credited to the worker for ttl_s seconds from now (steady
  // clock). Throws std::out_of_range (unknown worker), std::invalid_argument (ttl_s < 0).
  void AddSpeculative(const std::string& name, const BlockKey* keys, size_t n, double ttl_s);

  // The worker's entries and the stream position they stand at, read under the stream's
  // lock (no batch applied meanwhile). O(blocks of the worker). Throws std::out_of_range.
  WorkerDump DumpWorker(const std::string& name) const;
  // Replaces the worker's part of the index with a peer's DumpWorker and continues its
  // stream from that position (WorkerStream::Restore: catch-up replay, restart fencing).
  // False (nothing changed) while the worker is recovering, or when it has seen messages
  // and has no replay endpoint. Throws std::out_of_range, std::logic_error after Close().
  bool RestoreWorker(const std::string& name, const StreamPosition& at,
                     const std::vector<Index::WorkerEntry>& entries);

  // Feeds one message as if it came from the worker's socket (same path as ingestion).
  // Throws std::out_of_range for an unknown worker. Returns false if the batch was dropped.
  bool Ingest(const std::string& name, bool has_seq, uint64_t seq, const char* payload,
              size_t len);

  std::vector<WorkerStats> Stats() const;
  // The worker's indexed blocks (see Index::WorkerEntries). Throws std::out_of_range.
  std::vector<Index::WorkerEntry> WorkerBlocks(const std::string& name) const;
  uint64_t EventsApplied() const { return events_applied_.load(); }
  const Index& index() const { return index_; }

  // Replaces the policy and the fallback, each with its own knobs (those given; the others
  // take their defaults), for the decisions from now on. The knobs are resolved here, once:
  // decisions read the policies' own members. A policy whose name is unchanged keeps its
  // state (cache_aware's tree) and is reconfigured; a new name starts afresh. Throws
  // std::invalid_argument (unknown name or knob, a knob of the wrong type or out of range, a
  // fallback that needs the index or an external source) and then changes nothing. Waits for
  // the decisions in progress (exclusive membership lock).
  void SetPolicy(const std::string& policy, const ParamValues& policy_params,
                 const std::string& fallback, const ParamValues& fallback_params);
  // Changes one knob of the policy (not the fallback), the others keep their values: e.g.
  // cache_weight (kvroute.adaptive). Throws std::invalid_argument as SetPolicy, and for a
  // knob the policy does not have.
  void SetPolicyParam(const std::string& knob, const ParamValue& value);
  // Changes speculative_ttl_s for the credits given or released from now on (the credits
  // already counting down keep their expiry). Throws std::invalid_argument below 0 or NaN.
  void SetSpeculativeTtl(double speculative_ttl_s);
  double speculative_ttl_s() const { return spec_ttl_s_.load(std::memory_order_relaxed); }

  // Stops ingestion (sockets, replays; Ingest() is dropped from then on) and joins its
  // threads. Idempotent; the destructor calls it.
  void Close();

 private:
  struct WorkerRuntime;
  // The live worker of that name, or null. REQUIRES: workers_mu_ held (shared suffices).
  std::shared_ptr<WorkerRuntime> Find(const std::string& name) const;
  // The live worker of that name. Throws std::out_of_range.
  std::shared_ptr<WorkerRuntime> Get(const std::string& name) const;
  // rebuild = false: the constructor announces membership once, after all its workers.
  void AddWorker(const WorkerConfig& w, bool announce);
  // Tells the policies the membership changed. REQUIRES: workers_mu_ held exclusively.
  void AnnounceMembership();
  void ApplyBatch(WorkerRuntime& rt, const EventBatch& b, ApplyCounts* c);
  // Select's steps. REQUIRES: workers_mu_ held (shared suffices).
  // The policy that decides (the fallback when the configured one lacks its input); fills
  // the decision's policy, fallback, reason and degraded.
  Policy* DecidingPolicy(const SelectRequest& req, double mono_s, Decision* d);
  // One candidate per worker, in order. Also REQUIRES load_.mu(). Throws NoWorkerAvailable.
  void BuildCandidates(const SelectRequest& req, const MatchResult& match, double block_size,
                       bool hashes, std::vector<Candidate>* out) const;
  void Explain(const MatchResult& match, const std::vector<Candidate>& cands,
               const std::vector<ScoreTerms>& terms, double block_size, Decision* d) const;

  RouterOptions opts_;
  Index index_;
  std::unique_ptr<Policy> policy_;
  std::unique_ptr<Policy> fallback_;
  zmq::context_t replay_ctx_{1};  // DEALER sockets for replay, owned by the streams' threads
  std::shared_ptr<Subscriber> subscriber_;  // guarded by workers_mu_ (+ close_mu_ to create)
  mutable std::shared_mutex workers_mu_;
  std::vector<std::shared_ptr<WorkerRuntime>> workers_;  // live workers, in insertion order
  // The same workers by name, for the calls that name one (ingest, update_load, ...).
  std::unordered_map<std::string, std::shared_ptr<WorkerRuntime>> by_name_;
  std::atomic<uint64_t> events_applied_{0};
  // opts_.speculative_ttl_s as the request path reads it (SetSpeculativeTtl changes both).
  std::atomic<double> spec_ttl_s_{0.0};
  LoadTracker load_;
  std::mt19937_64 rng_;     // guarded by load_.mu()
  uint64_t rr_counter_ = 0;  // guarded by load_.mu()
  std::mutex close_mu_;
  // Set once by Close (under close_mu_); read without it by the request path.
  std::atomic<bool> closed_{false};
  void ThrowIfClosed() const;
  void ValidateCurve() const;  // the CURVE options: std::invalid_argument if malformed
  // A worker's trust state as decisions and stats see it: TrustCell::Read, and stale when
  // exact but silent for stale_after_s (if set).
  TrustState StateOf(WorkerRuntime& w, double mono) const;
};

}  // namespace kvroute
