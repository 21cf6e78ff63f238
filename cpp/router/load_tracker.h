// LoadTracker: the load signals of every worker, and the requests the router has in flight.
//
// Per worker (WorkerLoad, owned by the router inside its worker record, read by Select):
//   inflight_requests   decisions not yet completed
//   pending_prefill     their prompt tokens not matched in the cache, until the first token
//   active_blocks       their prompt blocks (the cost policy's decode load)
//   waiting, usage      the engine's own num_requests_waiting and kv_cache_usage_perc
//                       (UpdateLoad; usage < 0 = never reported)
//   peer_*              the same three counts of the other router replicas (SetPeerLoad),
//                       added to this router's own by Select; 0 when running alone
//
// Thread safety: one mutex (mu()) guards every WorkerLoad and the in-flight table; every
// method takes it except the *Locked ones, which require it held. Held for O(1) work, except
// Select's candidate loop (O(workers)) and Forget (O(requests in flight)).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace kvroute {

struct WorkerLoad {
  int64_t inflight_requests = 0;
  int64_t pending_prefill = 0;
  int64_t active_blocks = 0;
  double waiting = 0;
  double usage = -1;
  // Other replicas' in-flight requests, pending prefill tokens and active blocks on this
  // worker (the sum of their last published counts). Past the first cache line of the
  // worker record: Select prefetches both lines.
  int64_t peer_inflight = 0;
  int64_t peer_prefill = 0;
  int64_t peer_active_blocks = 0;
};

class LoadTracker {
 public:
  std::mutex& mu() const { return mu_; }

  // Accounts a new request on `w` and returns its id (never 0). REQUIRES: mu() held.
  uint64_t StartLocked(std::shared_ptr<WorkerLoad> w, int64_t prefill_tokens, int64_t blocks);
  // Releases a request's load. False if the id is unknown (already completed). `*credit`
  // (if given): the speculative credit to release now (0: none; see AttachCredit).
  bool Complete(uint64_t request_id, uint64_t* credit = nullptr);
  // Releases only the prefill part (first token arrived). False if the id is unknown.
  // `*credit` as for Complete.
  bool FirstToken(uint64_t request_id, uint64_t* credit = nullptr);
  // Ties a held speculative credit (Index::AddSpeculative with hold) to a request: the first
  // of FirstToken / Complete hands it back for release. False (the caller releases it at
  // once) if the request has completed or has its first token already.
  bool AttachCredit(uint64_t request_id, uint64_t credit);
  // The engine-reported signals; nullopt leaves one unchanged. Throws std::invalid_argument
  // for waiting < 0 or usage outside [0, 1].
  void Update(WorkerLoad& w, std::optional<double> waiting, std::optional<double> usage);
  // Forgets the engine-reported signals (waiting 0, usage unreported).
  void Clear(WorkerLoad& w);
  // Replaces the other replicas' counts (all 0: none). Throws std::invalid_argument for a
  // negative count.
  void SetPeer(WorkerLoad& w, int64_t inflight, int64_t prefill, int64_t active_blocks);
  // Drops the requests in flight on a removed worker.
  void Forget(const WorkerLoad* w);

 private:
  struct Inflight {
    std::shared_ptr<WorkerLoad> worker;
    int64_t prefill_tokens;
    int64_t blocks;
    bool prefill_done;
    uint64_t credit = 0;  // held speculative credit, until the first token
  };
  mutable std::mutex mu_;
  uint64_t next_request_id_ = 1;
  std::unordered_map<uint64_t, Inflight> inflight_;
};

}  // namespace kvroute
