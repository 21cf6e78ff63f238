#include "router/load_tracker.h"

#include <stdexcept>

namespace kvroute {

uint64_t LoadTracker::StartLocked(std::shared_ptr<WorkerLoad> w, int64_t prefill_tokens,
                                  int64_t blocks) {
  const uint64_t id = next_request_id_++;
  w->inflight_requests += 1;
  w->pending_prefill += prefill_tokens;
  w->active_blocks += blocks;
  inflight_.emplace(id, Inflight{std::move(w), prefill_tokens, blocks, false});
  return id;
}

bool LoadTracker::Complete(uint64_t request_id, uint64_t* credit) {
  std::lock_guard lock(mu_);
  auto it = inflight_.find(request_id);
  if (it == inflight_.end()) return false;
  Inflight& f = it->second;
  if (credit != nullptr) *credit = f.credit;
  f.worker->inflight_requests -= 1;
  f.worker->active_blocks -= f.blocks;
  if (!f.prefill_done) f.worker->pending_prefill -= f.prefill_tokens;
  inflight_.erase(it);
  return true;
}

bool LoadTracker::FirstToken(uint64_t request_id, uint64_t* credit) {
  std::lock_guard lock(mu_);
  auto it = inflight_.find(request_id);
  if (it == inflight_.end()) return false;
  Inflight& f = it->second;
  if (credit != nullptr) *credit = f.credit;
  f.credit = 0;
  if (!f.prefill_done) {
    f.worker->pending_prefill -= f.prefill_tokens;
    f.prefill_done = true;
  }
  return true;
}

bool LoadTracker::AttachCredit(uint64_t request_id, uint64_t credit) {
  std::lock_guard lock(mu_);
  auto it = inflight_.find(request_id);
  if (it == inflight_.end() || it->second.prefill_done) return false;
  it->second.credit = credit;
  return true;
}

void LoadTracker::Update(WorkerLoad& w, std::optional<double> waiting,
                         std::optional<double> usage) {
  if (waiting && !(*waiting >= 0)) {
    throw std::invalid_argument("num_requests_waiting must be >= 0");
  }
  if (usage && !(*usage >= 0 && *usage <= 1)) {
    throw std::invalid_argument("kv_cache_usage_perc must be in [0, 1]");
  }
  std::lock_guard lock(mu_);
  if (waiting) w.waiting = *waiting;
  if (usage) w.usage = *usage;
}

void LoadTracker::Clear(WorkerLoad& w) {
  std::lock_guard lock(mu_);
  w.waiting = 0;
  w.usage = -1;
}

void LoadTracker::SetPeer(WorkerLoad& w, int64_t inflight, int64_t prefill,
                          int64_t active_blocks) {
  if (inflight < 0 || prefill < 0 || active_blocks < 0) {
    throw std::invalid_argument("peer load counts must be >= 0");
  }
  std::lock_guard lock(mu_);
  w.peer_inflight = inflight;
  w.peer_prefill = prefill;
  w.peer_active_blocks = active_blocks;
}

void LoadTracker::Forget(const WorkerLoad* w) {
  std::lock_guard lock(mu_);
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    it = it->second.worker.get() == w ? inflight_.erase(it) : std::next(it);
  }
}

}  // namespace kvroute
