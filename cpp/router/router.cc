#include "router/router.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <zmq_addon.hpp>

#include "common/block_key.h"

namespace kvroute {

struct Router::WorkerRuntime {
  WorkerConfig cfg;
  WorkerId id = kNoWorker;
  uint64_t sub_id = 0;
  std::atomic<bool> removed{false};
  // Guarded by mu: event stream state and stats.
  mutable std::mutex mu;
  WorkerStats st;
  double last_recv_mono = -1;
  EventBatch batch;  // reused decode buffer
  std::unique_ptr<zmq::socket_t> replay_sock;  // DEALER to cfg.replay_endpoint, lazily
  // Readable without mu (Select reads them): the trust state and when it became degraded.
  std::atomic<uint8_t> state{static_cast<uint8_t>(WorkerState::kExact)};
  std::atomic<double> degraded_since{0.0};
  // Guarded by Router::load_mu_.
  int64_t inflight_requests = 0;
  int64_t pending_prefill = 0;
  double waiting = 0;
  double usage = -1;
};

namespace {
double MonoSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
thread_local MatchResult tl_match;
thread_local std::vector<BlockKey> tl_keys;
thread_local std::vector<Candidate> tl_cands;
thread_local std::vector<ScoreTerms> tl_terms;
}  // namespace

double Router::Now() const { return MonoSeconds(); }

const char* WorkerStateName(WorkerState s) {
  switch (s) {
    case WorkerState::kExact: return "exact";
    case WorkerState::kRecovering: return "recovering";
    case WorkerState::kDegraded: return "degraded";
  }
  return "?";
}

WorkerState Router::StateOf(WorkerRuntime& rt, double now) const {
  auto s = static_cast<WorkerState>(rt.state.load(std::memory_order_acquire));
  if (s == WorkerState::kDegraded && now - rt.degraded_since.load() >= opts_.degraded_hold_s) {
    uint8_t expected = static_cast<uint8_t>(WorkerState::kDegraded);
    rt.state.compare_exchange_strong(expected, static_cast<uint8_t>(WorkerState::kExact));
    return static_cast<WorkerState>(rt.state.load());
  }
  return s;
}

Router::Router(RouterOptions opts, const std::vector<WorkerConfig>& workers)
    : opts_(std::move(opts)), index_(opts_.index), rng_(opts_.seed) {
  if (!(opts_.cache_weight >= 0.0 && opts_.cache_weight <= 1.0)) {
    throw std::invalid_argument("cache_weight must be in [0, 1], got " +
                                std::to_string(opts_.cache_weight));
  }
  if (opts_.ingest_threads < 1) throw std::invalid_argument("ingest_threads must be >= 1");
  for (const auto& w : workers) AddWorker(w);
}

Router::~Router() { Close(); }

void Router::Close() {
  std::unique_ptr<Subscriber> sub;
  {
    std::lock_guard lock(close_mu_);
    if (closed_) return;
    closed_ = true;
    std::unique_lock wl(workers_mu_);
    sub = std::move(subscriber_);
  }
  if (sub) sub->Close();
  std::vector<std::shared_ptr<WorkerRuntime>> ws;
  {
    std::shared_lock wl(workers_mu_);
    ws = workers_;
  }
  for (auto& w : ws) {
    std::lock_guard lock(w->mu);
    w->replay_sock.reset();
  }
}

std::shared_ptr<Router::WorkerRuntime> Router::Find(const std::string& name) const {
  for (const auto& w : workers_) {
    if (w->cfg.name == name) return w;
  }
  return nullptr;
}

void Router::AddWorker(const WorkerConfig& cfg) {
  if (cfg.name.empty()) throw std::invalid_argument("worker name must not be empty");
  std::unique_lock wl(workers_mu_);
  if (Find(cfg.name) != nullptr) {
    throw std::invalid_argument("duplicate worker '" + cfg.name + "'");
  }
  auto rt = std::make_shared<WorkerRuntime>();
  rt->cfg = cfg;
  rt->st.config = cfg;
  rt->id = index_.AddWorker();
  if (!cfg.endpoint.empty()) {
    {
      std::lock_guard lock(close_mu_);
      if (closed_) throw std::logic_error("Router is closed");
      if (!subscriber_) subscriber_ = std::make_unique<Subscriber>(opts_.ingest_threads);
    }
    SubscriptionSpec spec;
    spec.endpoint = cfg.endpoint;
    spec.bind = cfg.bind;
    spec.topic = opts_.topic;
    std::weak_ptr<WorkerRuntime> weak = rt;
    spec.handler = [this, weak](const WireMessage& m) {
      if (auto p = weak.lock()) HandleMessage(*p, m);
    };
    try {
      rt->sub_id = subscriber_->Add(std::move(spec));
    } catch (...) {
      index_.RemoveWorker(rt->id);
      throw;
    }
  }
  workers_.push_back(std::move(rt));
}

void Router::RemoveWorker(const std::string& name) {
  std::shared_ptr<WorkerRuntime> rt;
  {
    std::unique_lock wl(workers_mu_);
    auto it = std::find_if(workers_.begin(), workers_.end(),
                           [&](const auto& w) { return w->cfg.name == name; });
    if (it == workers_.end()) throw std::out_of_range("unknown worker '" + name + "'");
    rt = *it;
    workers_.erase(it);
    rt->removed.store(true);
  }
  if (rt->sub_id != 0 && subscriber_) subscriber_->Remove(rt->sub_id);
  {
    std::lock_guard lock(rt->mu);  // waits for an Ingest() in progress
    index_.RemoveWorker(rt->id);
    rt->replay_sock.reset();
  }
  std::lock_guard lock(load_mu_);
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    it = it->second.worker == rt ? inflight_.erase(it) : std::next(it);
  }
}

bool Router::HandleMessage(WorkerRuntime& rt, const WireMessage& m) {
  std::lock_guard lock(rt.mu);
  if (rt.removed.load()) return false;
  WorkerStats& st = rt.st;
  rt.last_recv_mono = MonoSeconds();
  if (m.bad_frames) {
    st.drops.Add(DropReason::kBadFrames);
    return false;
  }
  if (!m.has_seq) {
    ++st.unsequenced;
    return ApplyPayload(rt, m.payload, m.payload_len);
  }
  if (!st.seen_seq) {
    st.seen_seq = true;
    if (m.seq > 0) {
      // The router started after the engine: recover what the replay buffer still has.
      // Deliberately not degraded: this is how every router joins a running fleet.
      ++st.joined_late;
      Replay(rt, 0, m.seq, /*first_contact=*/true);
    }
  } else if (m.seq == st.last_seq + 1) {
    // in order
  } else if (m.seq > st.last_seq + 1) {
    ++st.gaps;
    st.missing_batches += m.seq - st.last_seq - 1;
    if (!Replay(rt, st.last_seq + 1, m.seq, false)) Reset(rt, /*degraded=*/true);
  } else {
    // Sequence went backwards: the engine restarted, and its cache with it. The empty state
    // is exact unless the new process's first batches were missed and cannot be replayed.
    ++st.backward_jumps;
    Reset(rt, /*degraded=*/false);
    if (m.seq > 0 && !Replay(rt, 0, m.seq, false)) Reset(rt, /*degraded=*/true);
  }
  st.last_seq = m.seq;
  return ApplyPayload(rt, m.payload, m.payload_len);
}

bool Router::ApplyPayload(WorkerRuntime& rt, const char* payload, size_t len) {
  WorkerStats& st = rt.st;
  EventBatch& b = rt.batch;
  if (!DecodeBatch(payload, len, opts_.limits, &b, &st.drops)) return false;
  if (b.has_dp_rank) {
    if (rt.cfg.dp_rank >= 0 && b.dp_rank != rt.cfg.dp_rank) {
      st.drops.Add(DropReason::kRankMismatch);
      return false;
    }
    st.has_dp_rank = true;
    st.last_dp_rank = b.dp_rank;
  }
  ++st.batches;
  st.last_event_ts = b.ts;
  const uint64_t before = st.apply.events;
  bool cleared = false;
  for (const Event& ev : b.events) {
    index_.Apply(rt.id, ev, &st.apply);
    cleared = cleared || ev.type == EventType::kAllBlocksCleared;
  }
  if (cleared) {
    // The engine says it holds nothing: from here on the index is exact again.
    uint8_t expected = static_cast<uint8_t>(WorkerState::kDegraded);
    rt.state.compare_exchange_strong(expected, static_cast<uint8_t>(WorkerState::kExact));
  }
  events_applied_.fetch_add(st.apply.events - before, std::memory_order_relaxed);
  return true;
}

void Router::Reset(WorkerRuntime& rt, bool degraded) {
  index_.ClearWorker(rt.id);
  ++rt.st.resets;
  if (degraded) {
    rt.degraded_since.store(MonoSeconds());
    rt.state.store(static_cast<uint8_t>(WorkerState::kDegraded));
  } else {
    rt.state.store(static_cast<uint8_t>(WorkerState::kExact));
  }
}

namespace {
constexpr uint64_t kReplayEnd = 0xFFFFFFFFFFFFFFFFull;
uint64_t Be64(const zmq::message_t& f) {
  const auto* b = static_cast<const unsigned char*>(f.data());
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | b[i];
  return v;
}
}  // namespace

bool Router::Replay(WorkerRuntime& rt, uint64_t from, uint64_t until, bool first_contact) {
  if (rt.cfg.replay_endpoint.empty()) return false;
  WorkerStats& st = rt.st;
  ++st.replays;
  const uint8_t prior = rt.state.exchange(static_cast<uint8_t>(WorkerState::kRecovering));
  bool ok = false;
  try {
    if (!rt.replay_sock) {
      rt.replay_sock = std::make_unique<zmq::socket_t>(replay_ctx_, zmq::socket_type::dealer);
      rt.replay_sock->set(zmq::sockopt::linger, 0);
      rt.replay_sock->connect(rt.cfg.replay_endpoint);
    }
    zmq::socket_t& sock = *rt.replay_sock;
    unsigned char req[8];
    for (int i = 0; i < 8; ++i) req[i] = static_cast<unsigned char>(from >> (56 - 8 * i));
    sock.send(zmq::message_t(), zmq::send_flags::sndmore);  // empty delimiter (DEALER -> ROUTER)
    sock.send(zmq::message_t(req, 8), zmq::send_flags::none);
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(opts_.replay_timeout_s);
    uint64_t expect = from;
    bool started = false;
    std::vector<zmq::message_t> frames;
    while (true) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;  // timed out
      zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, left) <= 0) continue;
      frames.clear();
      if (!zmq::recv_multipart(sock, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
        continue;
      }
      // After the delimiter: [seq, payload] (older vLLM, SGLang) or [topic, seq, payload].
      if (frames.size() < 3 || frames[0].size() != 0) continue;
      const size_t n = frames.size() - 1;
      if (n != 2 && n != 3) continue;
      const zmq::message_t& seq_f = frames[n == 2 ? 1 : 2];
      const zmq::message_t& payload = frames[n == 2 ? 2 : 3];
      if (seq_f.size() != 8) continue;
      const uint64_t seq = Be64(seq_f);
      if (seq == kReplayEnd) {
        ok = first_contact || expect >= until;
        break;
      }
      if (seq < expect || seq >= until) continue;  // applied already / will arrive live
      if (seq > expect) {
        if (!(first_contact && !started)) break;  // the buffer no longer holds the gap
        expect = seq;  // first contact: start wherever the buffer starts
      }
      started = true;
      ApplyPayload(rt, static_cast<const char*>(payload.data()), payload.size());
      ++st.batches_recovered;
      expect = seq + 1;
    }
  } catch (const std::exception&) {
    ok = false;  // Deliberately swallowed: a broken replay endpoint degrades, never throws.
  }
  if (!ok) {
    ++st.replay_failures;
    rt.replay_sock.reset();  // stale replies must not reach the next replay
  }
  rt.state.store(prior);
  return ok || first_contact;
}

bool Router::Ingest(const std::string& name, bool has_seq, uint64_t seq, const char* payload,
                    size_t len) {
  std::shared_ptr<WorkerRuntime> rt;
  {
    std::shared_lock wl(workers_mu_);
    rt = Find(name);
  }
  if (!rt) throw std::out_of_range("unknown worker '" + name + "'");
  WireMessage m;
  m.has_seq = has_seq;
  m.seq = seq;
  m.payload = payload;
  m.payload_len = len;
  return HandleMessage(*rt, m);
}

std::vector<WorkerMatch> Router::FindMatches(const uint32_t* tokens, size_t n,
                                             std::string_view lora_name,
                                             const std::vector<std::string>* extra_keys) {
  const size_t bs = static_cast<size_t>(opts_.index.block_size);
  tl_keys.clear();
  ComputeBlockKeys(ChainRoot(lora_name), tokens, n, bs, extra_keys, &tl_keys);
  std::shared_lock wl(workers_mu_);
  index_.FindMatches(tl_keys.data(), tl_keys.size(), &tl_match);
  std::vector<WorkerMatch> out;
  out.reserve(workers_.size());
  for (const auto& w : workers_) {
    WorkerMatch m;
    m.worker = w->cfg.name;
    m.blocks = tl_match.blocks[w->id];
    m.tokens = static_cast<uint64_t>(m.blocks) * bs;
    m.weighted_tokens = tl_match.weighted[w->id] * static_cast<double>(bs);
    out.push_back(std::move(m));
  }
  return out;
}

Decision Router::Select(const uint32_t* tokens, size_t n, std::string_view lora_name,
                        const std::vector<std::string>* extra_keys, bool explain,
                        double now_s) {
  const size_t bs = static_cast<size_t>(opts_.index.block_size);
  tl_keys.clear();
  ComputeBlockKeys(ChainRoot(lora_name), tokens, n, bs, extra_keys, &tl_keys);
  const double now = now_s >= 0 ? now_s : Now();
  std::shared_lock wl(workers_mu_);
  if (workers_.empty()) throw std::logic_error("the router has no workers");
  index_.FindMatches(tl_keys.data(), tl_keys.size(), &tl_match, now);

  Decision d;
  d.prompt_tokens = n;
  d.policy = opts_.policy;
  bool all_degraded = true;
  for (const auto& w : workers_) {
    all_degraded = all_degraded && StateOf(*w, MonoSeconds()) == WorkerState::kDegraded;
  }
  if (d.policy == PolicyKind::kKvAware &&
      (all_degraded || events_applied_.load(std::memory_order_relaxed) == 0)) {
    d.policy = opts_.fallback;
    d.fallback = true;
  }
  d.degraded = all_degraded;
  const double denom = n > 0 ? static_cast<double>(n) : 1.0;
  tl_cands.resize(workers_.size());
  std::shared_ptr<WorkerRuntime> chosen;
  {
    std::lock_guard lock(load_mu_);
    for (size_t i = 0; i < workers_.size(); ++i) {
      const WorkerRuntime& w = *workers_[i];
      Candidate& c = tl_cands[i];
      c.match = tl_match.weighted[w.id] * static_cast<double>(bs) / denom;
      c.pending_prefill = static_cast<double>(w.pending_prefill);
      c.requests = static_cast<double>(w.inflight_requests) + w.waiting;
      c.kv_usage = w.usage;
    }
    const size_t pick =
        Choose(d.policy, tl_cands, opts_.cache_weight, &rng_, &rr_counter_, &tl_terms);
    chosen = workers_[pick];
    d.matched_blocks = tl_match.blocks[chosen->id];
    d.matched_tokens = std::min<uint64_t>(static_cast<uint64_t>(d.matched_blocks) * bs, n);
    d.prefill_tokens = n - d.matched_tokens;
    d.request_id = next_request_id_++;
    chosen->inflight_requests += 1;
    chosen->pending_prefill += static_cast<int64_t>(d.prefill_tokens);
    inflight_.emplace(d.request_id,
                      Inflight{chosen, static_cast<int64_t>(d.prefill_tokens), false});
    if (explain) {
      d.scores.resize(workers_.size());
      for (size_t i = 0; i < workers_.size(); ++i) {
        WorkerScore& s = d.scores[i];
        s.worker = workers_[i]->cfg.name;
        s.matched_blocks = tl_match.blocks[workers_[i]->id];
        s.weighted_matched_tokens = tl_match.weighted[workers_[i]->id] * static_cast<double>(bs);
        s.terms = tl_terms[i];
        s.pending_prefill_tokens = tl_cands[i].pending_prefill;
        s.requests = tl_cands[i].requests;
      }
    }
  }
  d.worker = chosen->cfg.name;
  d.degraded = d.degraded || StateOf(*chosen, MonoSeconds()) == WorkerState::kDegraded;
  if (d.policy == PolicyKind::kKvAware && d.matched_blocks < tl_keys.size()) {
    index_.AddSpeculative(chosen->id, tl_keys.data() + d.matched_blocks,
                          tl_keys.size() - d.matched_blocks, now, opts_.speculative_ttl_s);
  }
  return d;
}

bool Router::Complete(uint64_t request_id) {
  std::lock_guard lock(load_mu_);
  auto it = inflight_.find(request_id);
  if (it == inflight_.end()) return false;
  Inflight& f = it->second;
  f.worker->inflight_requests -= 1;
  if (!f.prefill_done) f.worker->pending_prefill -= f.prefill_tokens;
  inflight_.erase(it);
  return true;
}

bool Router::FirstToken(uint64_t request_id) {
  std::lock_guard lock(load_mu_);
  auto it = inflight_.find(request_id);
  if (it == inflight_.end()) return false;
  Inflight& f = it->second;
  if (!f.prefill_done) {
    f.worker->pending_prefill -= f.prefill_tokens;
    f.prefill_done = true;
  }
  return true;
}

void Router::UpdateLoad(const std::string& name, std::optional<double> waiting,
                        std::optional<double> usage) {
  std::shared_ptr<WorkerRuntime> rt;
  {
    std::shared_lock wl(workers_mu_);
    rt = Find(name);
  }
  if (!rt) throw std::out_of_range("unknown worker '" + name + "'");
  if (waiting && !(*waiting >= 0)) {
    throw std::invalid_argument("num_requests_waiting must be >= 0");
  }
  if (usage && !(*usage >= 0 && *usage <= 1)) {
    throw std::invalid_argument("kv_cache_usage_perc must be in [0, 1]");
  }
  std::lock_guard lock(load_mu_);
  if (waiting) rt->waiting = *waiting;
  if (usage) rt->usage = *usage;
}

std::vector<Index::WorkerEntry> Router::WorkerBlocks(const std::string& name) const {
  std::shared_ptr<WorkerRuntime> rt;
  {
    std::shared_lock wl(workers_mu_);
    rt = Find(name);
  }
  if (!rt) throw std::out_of_range("unknown worker '" + name + "'");
  return index_.WorkerEntries(rt->id);
}

std::vector<WorkerStats> Router::Stats() const {
  std::vector<std::shared_ptr<WorkerRuntime>> ws;
  {
    std::shared_lock wl(workers_mu_);
    ws = workers_;
  }
  const double now = MonoSeconds();
  std::vector<WorkerStats> out;
  out.reserve(ws.size());
  for (const auto& w : ws) {
    {
      std::lock_guard lock(w->mu);
      out.push_back(w->st);
      out.back().last_recv_age_s = w->last_recv_mono < 0 ? -1 : now - w->last_recv_mono;
      out.back().state = StateOf(*w, now);
    }
    out.back().indexed_blocks = index_.WorkerBlocks(w->id);
  }
  std::lock_guard lock(load_mu_);
  for (size_t i = 0; i < ws.size(); ++i) {
    out[i].inflight_requests = ws[i]->inflight_requests;
    out[i].pending_prefill_tokens = ws[i]->pending_prefill;
    out[i].num_requests_waiting = ws[i]->waiting;
    out[i].kv_cache_usage_perc = ws[i]->usage;
  }
  return out;
}

}  // namespace kvroute
