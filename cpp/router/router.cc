#include "router/router.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <zmq_addon.hpp>

#include <xxhash.h>

#include <list>
#include <thread>

#include "common/block_key.h"
#include "events/replay.h"

namespace kvroute {

struct Router::WorkerRuntime {
  // What Select reads of every worker, in one cache line at the start (spread over the
  // struct, they cost 3-4 lines a worker: at 1,024 workers Select waited on them).
  // Readable without mu: the trust state and when it became degraded.
  alignas(64) std::atomic<double> degraded_since{0.0};
  std::atomic<uint8_t> state{static_cast<uint8_t>(WorkerState::kExact)};
  WorkerId id = kNoWorker;
  // Guarded by Router::load_mu_.
  int64_t inflight_requests = 0;
  int64_t pending_prefill = 0;
  int64_t active_blocks = 0;  // blocks of the requests in flight (cost policy's decode load)
  uint64_t name_hash = 0;
  double waiting = 0;
  double usage = -1;

  WorkerConfig cfg;
  uint64_t sub_id = 0;
  std::atomic<bool> removed{false};
  // Guarded by mu (held by the event path for a whole message, a replay included).
  mutable std::mutex mu;
  WorkerStats st;
  double last_recv_mono = -1;
  // A copy of st for readers, published by the event path at every step, so that Stats()
  // never waits for a replay in progress. Guarded by pub_mu.
  mutable std::mutex pub_mu;
  WorkerStats pub;
  double pub_last_recv = -1;
  // `st.config` stays empty and `pub.config` is set once: no string copies per message.
  void Publish() {
    std::lock_guard lock(pub_mu);
    WorkerConfig cfg = std::move(pub.config);
    pub = st;
    pub.config = std::move(cfg);
    pub_last_recv = last_recv_mono;
  }
  // Recovery (guarded by mu, except replay_sock: used only by the recovery thread, or by
  // whoever joined it).
  struct Pending {
    bool has_seq;
    uint64_t seq;
    std::string payload;
  };
  bool recovering = false;       // a recovery thread owns the stream; live messages queue up
  // Live messages received while recovering, in order. A list: empty, it allocates nothing
  // (a std::deque allocates ~600 bytes even empty, for every worker).
  std::list<Pending> pending;
  RecoveryJob job{};
  std::thread recovery;
  uint64_t last_payload_hash = 0;  // XXH3 of the last sequenced payload applied
  bool have_last_hash = false;
  std::unique_ptr<zmq::socket_t> replay_sock;  // DEALER to cfg.replay_endpoint, lazily
};

namespace {
double MonoSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
// Per-thread scratch of the request path, reached once per call (each access to a
// thread_local in a shared library costs a __tls_get_addr call). Not inlined: inlined, GCC
// recomputed the address at every use instead of keeping it in a register (one call per
// worker in Select's candidate loop: ~2.8k of ~59k instructions per select at 256 workers).
struct Scratch {
  MatchResult match;
  std::vector<BlockKey> keys;
  std::vector<Candidate> cands;
  std::vector<ScoreTerms> terms;
  std::vector<uint32_t> tree;
};
__attribute__((noinline)) Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}
}  // namespace

namespace {
constexpr size_t kMaxPending = 1u << 16;  // live messages kept while a worker recovers
constexpr size_t kSessionPrefixTokens = 256;  // session key fallback: hash of this prefix
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
  const PolicyParams& pp = opts_.params;
  if (!(pp.cache_weight >= 0.0 && pp.cache_weight <= 1.0)) {
    throw std::invalid_argument("cache_weight must be in [0, 1], got " +
                                std::to_string(pp.cache_weight));
  }
  if (pp.virtual_nodes < 1) throw std::invalid_argument("virtual_nodes must be >= 1");
  if (!(pp.temperature >= 0)) throw std::invalid_argument("temperature must be >= 0");
  if (!(pp.prefill_load_scale >= 0)) throw std::invalid_argument("prefill_load_scale must be >= 0");
  if (!(pp.cache_threshold >= 0 && pp.cache_threshold <= 1)) {
    throw std::invalid_argument("cache_threshold must be in [0, 1]");
  }
  if (!(pp.balance_rel_threshold >= 1)) {
    throw std::invalid_argument("balance_rel_threshold must be >= 1");
  }
  if (opts_.ingest_threads < 1) throw std::invalid_argument("ingest_threads must be >= 1");
  if (opts_.ingest_nice < 0 || opts_.ingest_nice > 19) {
    throw std::invalid_argument("ingest_nice must be in [0, 19]");
  }
  // The ring once for the initial workers, not once per worker (a sort of every point each
  // time: ~1.1G instructions for 256 workers).
  for (const auto& w : workers) AddWorker(w, /*rebuild_ring=*/false);
  std::unique_lock wl(workers_mu_);
  RebuildRing();
}

Router::~Router() { Close(); }

void Router::Close() {
  // Lock order everywhere: workers_mu_, then close_mu_.
  std::shared_ptr<Subscriber> sub;
  {
    std::unique_lock wl(workers_mu_);
    std::lock_guard lock(close_mu_);
    if (closed_) return;
    closed_ = true;
    sub = std::move(subscriber_);
  }
  if (sub) sub->Close();
  std::vector<std::shared_ptr<WorkerRuntime>> ws;
  {
    std::shared_lock wl(workers_mu_);
    ws = workers_;
  }
  closing_.store(true);
  for (auto& w : ws) {
    if (w->recovery.joinable()) w->recovery.join();
    std::lock_guard lock(w->mu);
    w->replay_sock.reset();
  }
}

std::shared_ptr<Router::WorkerRuntime> Router::Find(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

void Router::AddWorker(const WorkerConfig& cfg, bool rebuild_ring) {
  if (cfg.name.empty()) throw std::invalid_argument("worker name must not be empty");
  std::unique_lock wl(workers_mu_);
  if (Find(cfg.name) != nullptr) {
    throw std::invalid_argument("duplicate worker '" + cfg.name + "'");
  }
  auto rt = std::make_shared<WorkerRuntime>();
  rt->cfg = cfg;
  rt->pub.config = cfg;
  if (!cfg.endpoint.empty()) {
    std::lock_guard lock(close_mu_);
    if (closed_) throw std::logic_error("Router is closed");
  }
  rt->id = index_.AddWorker();
  rt->name_hash = XXH3_64bits(cfg.name.data(), cfg.name.size());
  if (!cfg.endpoint.empty()) {
    {
      std::lock_guard lock(close_mu_);
      if (closed_) throw std::logic_error("Router is closed");
      if (!subscriber_) subscriber_ = std::make_shared<Subscriber>(opts_.ingest_threads, opts_.ingest_nice);
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
  // Room first, so that the push_back cannot fail after the emplace (doubling, as push_back).
  if (workers_.size() == workers_.capacity()) workers_.reserve(2 * workers_.size() + 1);
  by_name_.emplace(cfg.name, rt);
  workers_.push_back(std::move(rt));
  if (rebuild_ring) RebuildRing();
}

void Router::RebuildRing() {
  // Only consistent_hash reads the ring (as the policy or the fallback, both fixed at
  // construction): 160 points of 16 bytes per worker, and a sort per AddWorker, otherwise.
  if (opts_.policy != PolicyKind::kConsistentHash &&
      opts_.fallback != PolicyKind::kConsistentHash) {
    return;
  }
  std::vector<uint64_t> hashes;
  hashes.reserve(workers_.size());
  for (const auto& w : workers_) hashes.push_back(w->name_hash);
  ring_.Build(hashes, opts_.params.virtual_nodes);
}

void Router::RemoveWorker(const std::string& name) {
  std::shared_ptr<WorkerRuntime> rt;
  {
    std::unique_lock wl(workers_mu_);
    rt = Find(name);
    if (rt == nullptr) throw std::out_of_range("unknown worker '" + name + "'");
    by_name_.erase(name);
    workers_.erase(std::find(workers_.begin(), workers_.end(), rt));
    RebuildRing();
    rt->removed.store(true);
  }
  std::shared_ptr<Subscriber> sub;
  {
    std::shared_lock wl(workers_mu_);
    sub = subscriber_;  // a copy: Close() may move the member out meanwhile
  }
  if (rt->sub_id != 0 && sub) sub->Remove(rt->sub_id);
  if (rt->recovery.joinable()) rt->recovery.join();  // it sees `removed` within 50 ms
  {
    std::lock_guard lock(rt->mu);  // waits for an Ingest() in progress
    index_.RemoveWorker(rt->id);
    tree_.RemoveWorker(rt->id);
    rt->replay_sock.reset();
    rt->pending.clear();
  }
  if (rt->recovery.joinable()) rt->recovery.join();  // started by a racing Ingest()
  std::lock_guard lock(load_mu_);
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    it = it->second.worker == rt ? inflight_.erase(it) : std::next(it);
  }
}

bool Router::HandleMessage(WorkerRuntime& rt, const WireMessage& m) {
  std::lock_guard lock(rt.mu);
  if (rt.removed.load()) return false;
  rt.last_recv_mono = MonoSeconds();
  bool ok = true;
  if (rt.recovering) {
    // The recovery thread owns the stream: keep the live message for after it, in order.
    // Past the cap, messages are dropped here and show up as a gap once recovery is done.
    if (m.bad_frames) {
      rt.st.drops.Add(DropReason::kBadFrames);
    } else if (rt.pending.size() < kMaxPending) {
      rt.pending.push_back({m.has_seq, m.seq, std::string(m.payload, m.payload_len)});
    }
  } else {
    ok = HandleMessageLocked(rt, m, /*allow_replay=*/true);
  }
  rt.Publish();
  return ok;
}

bool Router::HandleMessageLocked(WorkerRuntime& rt, const WireMessage& m, bool allow_replay) {
  WorkerStats& st = rt.st;
  if (m.bad_frames) {
    st.drops.Add(DropReason::kBadFrames);
    return false;
  }
  if (!m.has_seq) {
    ++st.unsequenced;
    return ApplyPayload(rt, m.payload, m.payload_len);
  }
  const bool can_replay = allow_replay && !rt.cfg.replay_endpoint.empty();
  using Job = RecoveryJob;
  if (!st.seen_seq) {
    st.seen_seq = true;
    if (m.seq > 0) {
      // The router started after the engine: recover what the replay buffer still has.
      // Deliberately not degraded: this is how every router joins a running fleet.
      ++st.joined_late;
      if (can_replay) {
        StartRecovery(rt, {Job::kFirstContact, 0, m.seq, false, 0, 0}, m);
        return true;
      }
    }
  } else if (m.seq == st.last_seq + 1) {
    // in order
  } else if (m.seq > st.last_seq + 1) {
    ++st.gaps;
    st.missing_batches += m.seq - st.last_seq - 1;
    if (can_replay) {
      // Ask from the last batch applied: if the engine's copy of it differs, the engine
      // restarted in the meantime (a restart can look like a forward gap).
      StartRecovery(rt, {Job::kGap, st.last_seq, m.seq, rt.have_last_hash, rt.last_payload_hash, 0},
                    m);
      return true;
    }
    Reset(rt, /*degraded=*/true);
  } else {
    // Sequence went backwards: the engine restarted, and its cache with it. The empty state
    // is exact unless the new process's first batches were missed and cannot be replayed.
    ++st.backward_jumps;
    Reset(rt, /*degraded=*/false);
    if (m.seq > 0) {
      if (can_replay) {
        StartRecovery(rt, {Job::kRestart, 0, m.seq, false, 0, 0}, m);
        return true;
      }
      Reset(rt, /*degraded=*/true);
    }
  }
  st.last_seq = m.seq;
  rt.last_payload_hash = XXH3_64bits(m.payload, m.payload_len);
  rt.have_last_hash = true;
  return ApplyPayload(rt, m.payload, m.payload_len);
}

void Router::StartRecovery(WorkerRuntime& rt, RecoveryJob job, const WireMessage& live) {
  if (rt.recovery.joinable()) rt.recovery.join();  // finished: it cleared `recovering`
  job.prior_state = rt.state.exchange(static_cast<uint8_t>(WorkerState::kRecovering));
  rt.job = job;
  rt.recovering = true;
  ++rt.st.replays;
  rt.pending.push_back({live.has_seq, live.seq, std::string(live.payload, live.payload_len)});
  // The exchange runs on its own thread so one slow engine never holds back the ingestion
  // thread it shares with other workers. Joined by the next recovery, RemoveWorker or Close.
  rt.recovery = std::thread([this, p = &rt] { RecoveryMain(*p); });
}

bool Router::ApplyPayload(WorkerRuntime& rt, const char* payload, size_t len) {
  WorkerStats& st = rt.st;
  // The decode buffer is the thread's, not the worker's: its vectors keep the capacity of the
  // largest event decoded (~6 KB for 64 blocks), once per ingestion thread instead of once
  // per worker. (Nothing under Apply decodes again.)
  thread_local EventBatch b;
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


Router::ExchangeResult Router::Exchange(WorkerRuntime& rt, uint64_t from, uint64_t until,
                                        bool verify, uint64_t verify_hash, bool first_contact) {
  try {
    if (!rt.replay_sock) {
      rt.replay_sock = std::make_unique<zmq::socket_t>(replay_ctx_, zmq::socket_type::dealer);
      rt.replay_sock->set(zmq::sockopt::linger, 0);
      rt.replay_sock->connect(rt.cfg.replay_endpoint);
    }
    zmq::socket_t& sock = *rt.replay_sock;
    SendReplayRequest(sock, from);
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(opts_.replay_timeout_s);
    uint64_t expect = from;
    bool started = false;
    std::vector<zmq::message_t> frames;
    while (!closing_.load() && !rt.removed.load()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return kTimedOut;
      zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::min(left, std::chrono::milliseconds(50))) <= 0) continue;
      frames.clear();
      if (!zmq::recv_multipart(sock, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
        continue;
      }
      ReplayReply reply;
      if (!ParseReplayReply(frames, &reply)) continue;
      const uint64_t seq = reply.seq;
      if (seq == kReplayEnd) return first_contact || expect >= until ? kDone : kUncovered;
      if (seq < expect || seq >= until) continue;  // applied already / will arrive live
      if (verify && seq == from) {
        // The batch we applied last, as the engine has it now.
        if (XXH3_64bits(reply.payload, reply.payload_len) != verify_hash) return kRestarted;
        expect = from + 1;
        started = true;
        continue;
      }
      if (seq > expect) {
        const bool unverifiable_but_contiguous = verify && !started && seq == from + 1;
        if (first_contact && !started) {
          expect = seq;  // first contact: start wherever the buffer starts
        } else if (!unverifiable_but_contiguous) {
          return kUncovered;  // the buffer no longer holds the gap
        }
      }
      started = true;
      std::lock_guard lock(rt.mu);
      if (rt.removed.load()) return kTimedOut;
      ApplyPayload(rt, reply.payload, reply.payload_len);
      rt.st.last_seq = seq;
      rt.last_payload_hash = XXH3_64bits(reply.payload, reply.payload_len);
      rt.have_last_hash = true;
      ++rt.st.batches_recovered;
      rt.Publish();
      expect = seq + 1;
    }
  } catch (const std::exception&) {
    // Deliberately swallowed: a broken replay endpoint degrades the worker, never throws.
  }
  return kTimedOut;
}

void Router::RecoveryMain(WorkerRuntime& rt) {
  RecoveryJob job;
  {
    std::lock_guard lock(rt.mu);
    job = rt.job;
  }
  while (true) {
    const bool first = job.kind == RecoveryJob::kFirstContact;
    ExchangeResult r = Exchange(rt, job.from, job.until, job.verify, job.verify_hash, first);
    if (r == kRestarted) {
      // The engine restarted since our last batch: drop the old state, replay the new process.
      {
        std::lock_guard lock(rt.mu);
        ++rt.st.backward_jumps;
        Reset(rt, /*degraded=*/false);
        rt.have_last_hash = false;
        job.prior_state = static_cast<uint8_t>(WorkerState::kExact);
        rt.Publish();
      }
      job.kind = RecoveryJob::kRestart;
      job.from = 0;
      rt.replay_sock.reset();  // the first exchange's remaining replies are still coming
      r = Exchange(rt, 0, job.until, false, 0, false);
    }
    if (r != kDone) rt.replay_sock.reset();  // stale replies must not reach the next replay
    std::lock_guard lock(rt.mu);
    if (rt.removed.load() || closing_.load()) {
      rt.recovering = false;
      return;
    }
    if (first) {
      // Joined late: whatever the buffer held is applied; what it no longer held is simply
      // older than us. Continue from the live message without calling the rest a gap.
      rt.state.store(job.prior_state);
      if (rt.st.last_seq + 1 < job.until || !rt.st.seen_seq) rt.st.last_seq = job.until - 1;
    } else if (r == kDone) {
      rt.state.store(job.prior_state);
    } else {
      // What replay could not restore is dropped: rebuild from the live stream.
      ++rt.st.replay_failures;
      Reset(rt, /*degraded=*/true);
      rt.have_last_hash = false;
      if (!rt.pending.empty() && rt.pending.front().has_seq) {
        rt.st.last_seq = rt.pending.front().seq - 1;
      }
    }
    // The live messages that queued up meanwhile, in order. A new gap or a restart among
    // them starts the next round of this loop (the rest stays queued behind it).
    bool again = false;
    while (!rt.pending.empty()) {
      WorkerRuntime::Pending& msg = rt.pending.front();
      WorkerStats& st = rt.st;
      if (msg.has_seq && st.seen_seq) {
        if ((r == kDone || first) && msg.seq <= st.last_seq && msg.seq >= job.from) {
          rt.pending.pop_front();  // applied already, from the replay
          continue;
        }
        if (msg.seq > st.last_seq + 1) {
          ++st.gaps;
          st.missing_batches += msg.seq - st.last_seq - 1;
          job = {RecoveryJob::kGap, st.last_seq, msg.seq, rt.have_last_hash,
                 rt.last_payload_hash, rt.state.load()};
          again = true;
        } else if (msg.seq <= st.last_seq) {
          ++st.backward_jumps;
          Reset(rt, /*degraded=*/false);
          rt.have_last_hash = false;
          if (msg.seq > 0) {
            job = {RecoveryJob::kRestart, 0, msg.seq, false, 0,
                   static_cast<uint8_t>(WorkerState::kExact)};
            again = true;
          } else {
            st.last_seq = msg.seq - 1;  // wraps; the next check sees it in order
            st.seen_seq = false;
          }
        }
        if (again) {
          ++st.replays;
          rt.state.store(static_cast<uint8_t>(WorkerState::kRecovering));
          break;
        }
      }
      WireMessage m;
      m.has_seq = msg.has_seq;
      m.seq = msg.seq;
      m.payload = msg.payload.data();
      m.payload_len = msg.payload.size();
      HandleMessageLocked(rt, m, /*allow_replay=*/false);
      rt.pending.pop_front();
    }
    rt.Publish();
    if (!again) {
      rt.recovering = false;
      return;
    }
    rt.job = job;
  }
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
  Scratch& sc = ThreadScratch();
  const size_t bs = static_cast<size_t>(opts_.index.block_size);
  BlockKeyStream keys(ChainRoot(lora_name), tokens, n, bs, extra_keys, &sc.keys);
  std::shared_lock wl(workers_mu_);
  index_.FindMatches(&keys, &sc.match);
  std::vector<WorkerMatch> out;
  out.reserve(workers_.size());
  for (const auto& w : workers_) {
    WorkerMatch m;
    m.worker = w->cfg.name;
    m.blocks = sc.match.blocks[w->id];
    m.tokens = static_cast<uint64_t>(m.blocks) * bs;
    m.weighted_tokens = sc.match.weighted[w->id] * static_cast<double>(bs);
    out.push_back(std::move(m));
  }
  return out;
}

Decision Router::Select(const uint32_t* tokens, size_t n, std::string_view lora_name,
                        const std::vector<std::string>* extra_keys, bool explain,
                        double now_s, std::string_view session_key,
                        const std::unordered_map<std::string, double>* external,
                        const std::vector<std::string>* exclude, bool dry_run) {
  Scratch& sc = ThreadScratch();
  const size_t bs = static_cast<size_t>(opts_.index.block_size);
  // Hashed by the prefix walk as it goes (the blocks past the match only if credited below).
  BlockKeyStream keys(ChainRoot(lora_name), tokens, n, bs, extra_keys, &sc.keys);
  const double now = now_s >= 0 ? now_s : Now();
  std::shared_lock wl(workers_mu_);
  if (workers_.empty()) throw std::logic_error("the router has no workers");
  index_.FindMatches(&keys, &sc.match, now);

  Decision d;
  d.prompt_tokens = n;
  d.policy = opts_.policy;
  bool all_degraded = true;
  const double mono = MonoSeconds();
  for (const auto& w : workers_) {
    all_degraded = all_degraded && StateOf(*w, mono) == WorkerState::kDegraded;
  }
  if (UsesIndex(d.policy)) {
    // Deliberately fail over to a policy that needs no index when the index cannot be
    // trusted at all: no worker has reported anything yet, or every worker lost events.
    if (events_applied_.load(std::memory_order_relaxed) == 0) {
      d.reason = "no_events";
      d.fallback = true;
    } else if (all_degraded) {
      d.reason = "all_degraded";
      d.fallback = true;
    }
    if (d.fallback) d.policy = opts_.fallback;
  }
  if (d.policy == PolicyKind::kLmcacheAware && external == nullptr) {
    // Deliberately fail over: without the controller this policy knows nothing.
    d.reason = "controller_down";
    d.policy = opts_.fallback;
    d.fallback = true;
  }
  d.degraded = all_degraded;
  // Only the hashing policies read the session hash (~1.1k instructions: hashed when needed).
  uint64_t session_hash = 0;
  if (d.policy == PolicyKind::kConsistentHash || d.policy == PolicyKind::kRendezvousHash) {
    session_hash =
        session_key.empty()
            ? XXH3_64bits(tokens, std::min<size_t>(n, kSessionPrefixTokens) * sizeof(uint32_t))
            : XXH3_64bits(session_key.data(), session_key.size());
  }
  const double denom = n > 0 ? static_cast<double>(n) : 1.0;
  const uint64_t prompt_blocks = bs > 0 ? n / bs : 0;
  const bool approx = d.policy == PolicyKind::kCacheAware;
  if (approx) tree_.Match(tokens, n, now, &sc.tree, index_.WorkerIdLimit());
  sc.cands.resize(workers_.size());
  const double match_scale = static_cast<double>(bs) / denom;  // weighted blocks -> match_w
  std::shared_ptr<WorkerRuntime> chosen;
  {
    std::lock_guard lock(load_mu_);
    size_t n_excluded = 0;
    const size_t nw = workers_.size();
    for (size_t i = 0; i < nw; ++i) {
      // The workers' lines (separate allocations) loaded ahead of their use.
      if (i + 8 < nw) __builtin_prefetch(workers_[i + 8].get());
      const WorkerRuntime& w = *workers_[i];
      Candidate& c = sc.cands[i];
      c.match = sc.match.weighted[w.id] * match_scale;
      c.weighted_blocks = sc.match.weighted[w.id];
      c.pending_prefill = static_cast<double>(w.pending_prefill);
      c.requests = static_cast<double>(w.inflight_requests) + w.waiting;
      c.kv_usage = w.usage;
      c.active_blocks = static_cast<double>(w.active_blocks);
      c.tree_match = approx ? sc.tree[w.id] / denom : 0.0;
      c.name_hash = w.name_hash;
      c.excluded = false;
      if (exclude != nullptr) {
        for (const std::string& x : *exclude) c.excluded = c.excluded || x == w.cfg.name;
        n_excluded += c.excluded ? 1 : 0;
      }
      c.external = 0.0;
      if (external != nullptr) {
        auto e = external->find(w.cfg.name);
        if (e != external->end() && e->second > 0) c.external = e->second;
      }
    }
    if (n_excluded == workers_.size()) {
      throw NoWorkerAvailable("every worker is excluded (" + std::to_string(n_excluded) +
                              " of " + std::to_string(workers_.size()) + ")");
    }
    ChooseContext ctx;
    ctx.params = &opts_.params;
    ctx.prompt_blocks = static_cast<double>(prompt_blocks);
    ctx.session_hash = session_hash;
    ctx.ring = &ring_;
    // A dry run draws from copies: the router's own random stream and round-robin position
    // stay where they were.
    // (A std::optional of the 2.5 KB engine cost ~300 instructions per select even unengaged.)
    std::unique_ptr<std::mt19937_64> rng_copy;  // dry runs only (312-word state)
    uint64_t rr_copy = rr_counter_;
    if (dry_run) rng_copy = std::make_unique<std::mt19937_64>(rng_);
    ctx.rng = dry_run ? rng_copy.get() : &rng_;
    ctx.rr_counter = dry_run ? &rr_copy : &rr_counter_;
    const size_t pick = Choose(d.policy, sc.cands, ctx, &sc.terms);
    chosen = workers_[pick];
    d.matched_blocks = sc.match.blocks[chosen->id];
    d.matched_tokens = std::min<uint64_t>(static_cast<uint64_t>(d.matched_blocks) * bs, n);
    d.prefill_tokens = n - d.matched_tokens;
    if (!dry_run) {
      d.request_id = next_request_id_++;
      const int64_t blocks = static_cast<int64_t>(bs > 0 ? (n + bs - 1) / bs : 0);
      chosen->inflight_requests += 1;
      chosen->pending_prefill += static_cast<int64_t>(d.prefill_tokens);
      chosen->active_blocks += blocks;
      inflight_.emplace(d.request_id,
                        Inflight{chosen, static_cast<int64_t>(d.prefill_tokens), blocks, false});
    }
    if (explain) {
      d.scores.resize(workers_.size());
      for (size_t i = 0; i < workers_.size(); ++i) {
        WorkerScore& s = d.scores[i];
        s.worker = workers_[i]->cfg.name;
        s.matched_blocks = sc.match.blocks[workers_[i]->id];
        s.weighted_matched_tokens = sc.match.weighted[workers_[i]->id] * static_cast<double>(bs);
        s.terms = sc.terms[i];
        s.pending_prefill_tokens = sc.cands[i].pending_prefill;
        s.requests = sc.cands[i].requests;
      }
    }
  }
  if (approx && !dry_run) {
    tree_.Insert(chosen->id, tokens, n, now);
    double last = last_tree_eviction_.load();
    if (now - last >= opts_.eviction_interval_s &&
        last_tree_eviction_.compare_exchange_strong(last, now)) {
      tree_.EvictTo(opts_.max_tree_size);  // LRU, every eviction_interval_secs
    }
  }
  d.worker = chosen->cfg.name;
  d.degraded = d.degraded || StateOf(*chosen, mono) == WorkerState::kDegraded;
  if (!dry_run && UsesIndex(d.policy) && d.matched_blocks < keys.size() &&
      opts_.speculative_ttl_s > 0) {
    keys.Need(keys.size());
    index_.AddSpeculative(chosen->id, sc.keys.data() + d.matched_blocks,
                          sc.keys.size() - d.matched_blocks, now, opts_.speculative_ttl_s);
  }
  return d;
}

bool Router::Complete(uint64_t request_id) {
  std::lock_guard lock(load_mu_);
  auto it = inflight_.find(request_id);
  if (it == inflight_.end()) return false;
  Inflight& f = it->second;
  f.worker->inflight_requests -= 1;
  f.worker->active_blocks -= f.blocks;
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

void Router::ClearLoad(const std::string& name) {
  std::shared_ptr<WorkerRuntime> rt;
  {
    std::shared_lock wl(workers_mu_);
    rt = Find(name);
  }
  if (!rt) throw std::out_of_range("unknown worker '" + name + "'");
  std::lock_guard lock(load_mu_);
  rt->waiting = 0;
  rt->usage = -1;
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
      std::lock_guard lock(w->pub_mu);
      out.push_back(w->pub);
      out.back().last_recv_age_s = w->pub_last_recv < 0 ? -1 : now - w->pub_last_recv;
    }
    out.back().state = StateOf(*w, now);
    out.back().indexed_blocks = index_.WorkerBlocks(w->id);
    out.back().evicted_by_cap = index_.WorkerEvictedByCap(w->id);
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
