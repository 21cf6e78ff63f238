#include "events/worker_stream.h"

#include <xxhash.h>

#include <chrono>
#include <zmq_addon.hpp>

#include "events/replay.h"

namespace kvroute {

namespace {
constexpr size_t kMaxPending = 1u << 16;  // live messages kept while a worker recovers

double MonoSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

const char* TrustStateName(TrustState s) {
  switch (s) {
    case TrustState::kExact: return "exact";
    case TrustState::kRecovering: return "recovering";
    case TrustState::kDegraded: return "degraded";
    case TrustState::kStale: return "stale";
  }
  return "?";
}

TrustState TrustCell::Read(double now, double hold_s) {
  auto s = static_cast<TrustState>(state.load(std::memory_order_acquire));
  if (s == TrustState::kDegraded && now - degraded_since.load() >= hold_s) {
    uint8_t expected = static_cast<uint8_t>(TrustState::kDegraded);
    state.compare_exchange_strong(expected, static_cast<uint8_t>(TrustState::kExact));
    return static_cast<TrustState>(state.load());
  }
  return s;
}

WorkerStream::WorkerStream(StreamOptions opts, zmq::context_t* replay_ctx, TrustCell* trust,
                           ApplyFn apply, ClearFn clear)
    : opts_(std::move(opts)),
      replay_ctx_(replay_ctx),
      trust_(trust),
      apply_(std::move(apply)),
      clear_(std::move(clear)),
      last_message_(MonoSeconds()) {}

WorkerStream::~WorkerStream() { Stop(); }

void WorkerStream::RequestStop() { stopping_.store(true); }

void WorkerStream::Stop() {
  RequestStop();
  std::thread t;
  {
    std::lock_guard lock(mu_);  // waits for a Handle in progress
    stopped_ = true;
    t = std::move(recovery_);
  }
  if (t.joinable()) t.join();  // it sees stopping_ within 50 ms
  std::lock_guard lock(mu_);
  replay_sock_.reset();
  pending_.clear();
  st_.replay_queue_bytes = 0;
}

void WorkerStream::PopPending() {
  st_.replay_queue_bytes -= pending_.front().payload.size();
  pending_.pop_front();
}

StreamStats WorkerStream::Snapshot(double now_mono) const {
  std::lock_guard lock(pub_mu_);
  StreamStats s = pub_;
  s.last_recv_age_s = pub_last_recv_ < 0 ? -1 : now_mono - pub_last_recv_;
  return s;
}

void WorkerStream::Publish() {
  std::lock_guard lock(pub_mu_);
  pub_ = st_;
  pub_last_recv_ = last_recv_mono_;
}

bool WorkerStream::Handle(const WireMessage& m) {
  std::lock_guard lock(mu_);
  if (stopped_) return false;
  last_recv_mono_ = MonoSeconds();
  last_message_.store(last_recv_mono_, std::memory_order_relaxed);
  bool ok = true;
  if (recovering_) {
    // The recovery thread owns the stream: keep the live message for after it, in order.
    // Past the cap, messages are dropped here and show up as a gap once recovery is done.
    if (m.bad_frames) {
      st_.drops.Add(DropReason::kBadFrames);
    } else if (pending_.size() < kMaxPending &&
               st_.replay_queue_bytes + m.payload_len <= opts_.max_pending_bytes) {
      pending_.push_back({m.has_seq, m.seq, std::string(m.payload, m.payload_len)});
      st_.replay_queue_bytes += m.payload_len;
    } else {
      ++st_.replay_queue_dropped;
    }
  } else {
    ok = HandleLocked(m, /*allow_replay=*/true);
  }
  Publish();
  return ok;
}

void WorkerStream::Reconnected() {
  std::lock_guard lock(mu_);
  if (stopped_) return;
  ++st_.reconnects;
  if (recovering_) {
    pending_.push_back({false, 0, std::string(), /*reconnect=*/true});
  } else if (!opts_.replay_endpoint.empty() && st_.seen_seq && have_last_hash_) {
    StartRecovery({RecoveryJob::kReconnect, st_.last_seq, st_.last_seq + 1, true,
                   last_payload_hash_, 0},
                  nullptr);
  } else {
    ResetForReconnect();
  }
  Publish();
}

void WorkerStream::ResetForReconnect() {
  Reset(/*degraded=*/false);
  have_last_hash_ = false;
  st_.seen_seq = false;
}

bool WorkerStream::HandleLocked(const WireMessage& m, bool allow_replay) {
  StreamStats& st = st_;
  if (m.bad_frames) {
    st.drops.Add(DropReason::kBadFrames);
    return false;
  }
  if (!m.has_seq) {
    ++st.unsequenced;
    return ApplyPayload(m.payload, m.payload_len);
  }
  const bool can_replay = allow_replay && !opts_.replay_endpoint.empty();
  using Job = RecoveryJob;
  if (!st.seen_seq) {
    st.seen_seq = true;
    if (m.seq > 0) {
      // The router started after the engine: recover what the replay buffer still has.
      // Deliberately not degraded: this is how every router joins a running fleet.
      ++st.joined_late;
      if (can_replay) {
        StartRecovery({Job::kFirstContact, 0, m.seq, false, 0, 0}, &m);
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
      StartRecovery({Job::kGap, st.last_seq, m.seq, have_last_hash_, last_payload_hash_, 0}, &m);
      return true;
    }
    Reset(/*degraded=*/true);
  } else {
    // Sequence went backwards: the engine restarted, and its cache with it. The empty state
    // is exact unless the new process's first batches were missed and cannot be replayed.
    ++st.backward_jumps;
    Reset(/*degraded=*/false);
    if (m.seq > 0) {
      if (can_replay) {
        StartRecovery({Job::kRestart, 0, m.seq, false, 0, 0}, &m);
        return true;
      }
      Reset(/*degraded=*/true);
    }
  }
  st.last_seq = m.seq;
  last_payload_hash_ = XXH3_64bits(m.payload, m.payload_len);
  have_last_hash_ = true;
  return ApplyPayload(m.payload, m.payload_len);
}

void WorkerStream::StartRecovery(RecoveryJob job, const WireMessage* live) {
  if (recovery_.joinable()) recovery_.join();  // finished: it cleared `recovering_`
  job.prior_state = trust_->state.exchange(static_cast<uint8_t>(TrustState::kRecovering));
  job_ = job;
  recovering_ = true;
  ++st_.replays;
  if (live != nullptr) {
    // The message that started it is kept whatever its size (at most max_payload_bytes).
    pending_.push_back({live->has_seq, live->seq, std::string(live->payload, live->payload_len)});
    st_.replay_queue_bytes += live->payload_len;
  }
  // The exchange runs on its own thread so one slow engine never holds back the ingestion
  // thread it shares with other workers. Joined by the next recovery or by Stop.
  recovery_ = std::thread([this] { RecoveryMain(); });
}

StreamPosition WorkerStream::Dump(const std::function<void()>& dump) {
  std::lock_guard lock(mu_);
  dump();
  StreamPosition p;
  p.seen_seq = st_.seen_seq;
  p.last_seq = st_.last_seq;
  p.have_hash = have_last_hash_;
  p.last_hash = last_payload_hash_;
  p.recovering = recovering_;
  return p;
}

bool WorkerStream::Restore(const StreamPosition& at, const std::function<void()>& load) {
  std::lock_guard lock(mu_);
  const bool fresh = !st_.seen_seq && st_.batches == 0 && st_.unsequenced == 0;
  const bool can_replay = !opts_.replay_endpoint.empty();
  if (stopped_ || stopping_.load() || !at.seen_seq || recovering_ || (!fresh && !can_replay)) {
    return false;
  }
  if (!fresh) {
    clear_();  // what live batches built since the join is replaced by the peer's state
    ++st_.resets;
  }
  load();
  st_.seen_seq = true;
  st_.last_seq = at.last_seq;
  have_last_hash_ = at.have_hash;
  last_payload_hash_ = at.last_hash;
  trust_->state.store(static_cast<uint8_t>(TrustState::kExact));
  if (can_replay) {
    RecoveryJob job{RecoveryJob::kGap, at.last_seq, kReplayEnd, at.have_hash, at.last_hash, 0};
    job.open_end = true;
    StartRecovery(job, nullptr);
  }
  Publish();
  return true;
}

bool WorkerStream::ApplyPayload(const char* payload, size_t len) {
  StreamStats& st = st_;
  // The decode buffer is the thread's, not the worker's: its vectors keep the capacity of the
  // largest event decoded (~6 KB for 64 blocks), once per ingestion thread instead of once
  // per worker. (Nothing under apply_ decodes again.)
  thread_local EventBatch b;
  if (!DecodeBatch(payload, len, opts_.limits, &b, &st.drops)) return false;
  if (b.has_dp_rank) {
    if (opts_.dp_rank >= 0 && b.dp_rank != opts_.dp_rank) {
      st.drops.Add(DropReason::kRankMismatch);
      return false;
    }
    st.has_dp_rank = true;
    st.last_dp_rank = b.dp_rank;
  }
  ++st.batches;
  st.last_event_ts = b.ts;
  apply_(b, &st.apply);
  bool cleared = false;
  for (const Event& ev : b.events) cleared = cleared || ev.type == EventType::kAllBlocksCleared;
  if (cleared) {
    // The engine says it holds nothing: from here on the index is exact again.
    uint8_t expected = static_cast<uint8_t>(TrustState::kDegraded);
    trust_->state.compare_exchange_strong(expected, static_cast<uint8_t>(TrustState::kExact));
  }
  return true;
}

void WorkerStream::Reset(bool degraded) {
  clear_();
  ++st_.resets;
  if (degraded) {
    trust_->degraded_since.store(MonoSeconds());
    trust_->state.store(static_cast<uint8_t>(TrustState::kDegraded));
  } else {
    trust_->state.store(static_cast<uint8_t>(TrustState::kExact));
  }
}

WorkerStream::ExchangeResult WorkerStream::Exchange(uint64_t from, uint64_t until, bool verify,
                                                    uint64_t verify_hash, bool first_contact,
                                                    bool open_end) {
  try {
    if (!replay_sock_) {
      replay_sock_ = std::make_unique<zmq::socket_t>(*replay_ctx_, zmq::socket_type::dealer);
      replay_sock_->set(zmq::sockopt::linger, 0);
      replay_sock_->connect(opts_.replay_endpoint);
    }
    zmq::socket_t& sock = *replay_sock_;
    SendReplayRequest(sock, from);
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(opts_.replay_timeout_s);
    uint64_t expect = from;
    bool started = false;
    std::vector<zmq::message_t> frames;
    while (!stopping_.load()) {
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
      if (seq == kReplayEnd) {
        // An open end (a Restore's catch-up) is done once the buffer's end is reached, if
        // the batch it started from was there to verify.
        if (open_end) return started || !verify ? kDone : kUncovered;
        return first_contact || expect >= until ? kDone : kUncovered;
      }
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
      std::lock_guard lock(mu_);
      if (stopping_.load()) return kTimedOut;
      ApplyPayload(reply.payload, reply.payload_len);
      st_.last_seq = seq;
      last_payload_hash_ = XXH3_64bits(reply.payload, reply.payload_len);
      have_last_hash_ = true;
      ++st_.batches_recovered;
      Publish();
      expect = seq + 1;
    }
  } catch (const std::exception&) {
    // Deliberately swallowed: a broken replay endpoint degrades the worker, never throws.
  }
  return kTimedOut;
}

void WorkerStream::RecoveryMain() {
  RecoveryJob job;
  {
    std::lock_guard lock(mu_);
    job = job_;
  }
  while (true) {
    const bool first = job.kind == RecoveryJob::kFirstContact;
    ExchangeResult r =
        Exchange(job.from, job.until, job.verify, job.verify_hash, first, job.open_end);
    if (r == kRestarted && job.kind != RecoveryJob::kReconnect) {
      // The engine restarted since our last batch: drop the old state, replay the new process.
      {
        std::lock_guard lock(mu_);
        ++st_.backward_jumps;
        // Reset without its trust state: recovering until the new process is replayed.
        clear_();
        ++st_.resets;
        have_last_hash_ = false;
        job.prior_state = static_cast<uint8_t>(TrustState::kExact);
        Publish();
      }
      job.kind = RecoveryJob::kRestart;
      job.from = 0;
      replay_sock_.reset();  // the first exchange's remaining replies are still coming
      r = Exchange(0, job.until, false, 0, false, job.open_end);
    }
    if (r != kDone) replay_sock_.reset();  // stale replies must not reach the next replay
    std::lock_guard lock(mu_);
    if (stopping_.load()) {
      recovering_ = false;
      return;
    }
    StreamStats& st = st_;
    if (first) {
      // Joined late: whatever the buffer held is applied; what it no longer held is simply
      // older than us. Continue from the live message without calling the rest a gap.
      trust_->state.store(job.prior_state);
      if (st.last_seq + 1 < job.until || !st.seen_seq) st.last_seq = job.until - 1;
    } else if (r == kDone) {
      trust_->state.store(job.prior_state);
    } else if (job.kind == RecoveryJob::kReconnect) {
      // Another payload at our last seq (a restart), or none (not verified the same
      // process): treated as a restart; the next message is a first contact.
      if (r == kRestarted) ++st.backward_jumps;
      ResetForReconnect();
    } else {
      // What replay could not restore is dropped: rebuild from the live stream.
      ++st.replay_failures;
      Reset(/*degraded=*/true);
      have_last_hash_ = false;
      if (!pending_.empty() && pending_.front().has_seq) st.last_seq = pending_.front().seq - 1;
    }
    // The live messages that queued up meanwhile, in order. A new gap or a restart among
    // them starts the next round of this loop (the rest stays queued behind it).
    bool again = false;
    while (!pending_.empty()) {
      if (stopping_.load()) {  // Stop() waits for mu_: one message at most, not the queue
        recovering_ = false;
        return;
      }
      Pending& msg = pending_.front();
      if (msg.reconnect) {
        ResetForReconnect();
        PopPending();
        continue;
      }
      if (msg.has_seq && st.seen_seq) {
        if ((r == kDone || first) && msg.seq <= st.last_seq && msg.seq >= job.from) {
          PopPending();  // applied already, from the replay
          continue;
        }
        if (msg.seq > st.last_seq + 1) {
          ++st.gaps;
          st.missing_batches += msg.seq - st.last_seq - 1;
          job = {RecoveryJob::kGap, st.last_seq, msg.seq, have_last_hash_, last_payload_hash_,
                 trust_->state.load()};
          again = true;
        } else if (msg.seq <= st.last_seq) {
          ++st.backward_jumps;
          Reset(/*degraded=*/false);
          have_last_hash_ = false;
          if (msg.seq > 0) {
            job = {RecoveryJob::kRestart, 0, msg.seq, false, 0,
                   static_cast<uint8_t>(TrustState::kExact)};
            again = true;
          } else {
            st.last_seq = msg.seq - 1;  // wraps; the next check sees it in order
            st.seen_seq = false;
          }
        }
        if (again) {
          ++st.replays;
          trust_->state.store(static_cast<uint8_t>(TrustState::kRecovering));
          break;
        }
      } else if (msg.has_seq && msg.seq > 0 && !opts_.replay_endpoint.empty()) {
        // The first message after a reconnect treated as a restart: a first contact, so
        // replay what the engine's buffer holds before it.
        st.seen_seq = true;
        ++st.joined_late;
        job = {RecoveryJob::kFirstContact, 0, msg.seq, false, 0, trust_->state.load()};
        again = true;
        ++st.replays;
        trust_->state.store(static_cast<uint8_t>(TrustState::kRecovering));
        break;
      }
      WireMessage m;
      m.has_seq = msg.has_seq;
      m.seq = msg.seq;
      m.payload = msg.payload.data();
      m.payload_len = msg.payload.size();
      HandleLocked(m, /*allow_replay=*/false);
      PopPending();
    }
    Publish();
    if (!again) {
      recovering_ = false;
      return;
    }
    job_ = job;
  }
}

}  // namespace kvroute
