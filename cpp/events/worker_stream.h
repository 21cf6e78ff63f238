// WorkerStream: one worker's KV-event stream, between its socket (or Ingest) and the index.
//
// It checks the sequence numbers (docs/kv-events.md, "Framing"), recovers lost batches from
// the engine's replay socket (events/replay.h) on a thread of its own, and keeps the trust
// state of the worker's part of the index:
//   kExact      : every batch since the worker joined was applied (or a restart cleared it).
//   kRecovering : a sequence gap is being filled from the worker's replay endpoint.
//   kDegraded   : batches were lost and could not be replayed; the worker's state was dropped
//                 and is rebuilt from new events. Back to exact on an AllBlocksCleared from
//                 the worker, or after StreamOptions::degraded_hold_s.
// What the stream decodes goes to its owner through two hooks: `apply` (a decoded batch) and
// `clear` (drop everything the worker holds). The stream never touches the index itself.
//
// Cases (seq = the message's sequence number, last = the last one applied):
//   first message, seq > 0   joined late: replay what the engine's buffer still holds
//   seq == last + 1          in order: apply
//   seq >  last + 1          gap: replay [last, seq) (checking that the engine's copy of
//                            `last` is the one applied; if not, the engine restarted), or
//                            without a replay endpoint clear and mark degraded
//   seq <= last              the engine restarted: clear (exact), replay [0, seq) if seq > 0
//   Restore(...)             a peer replica's snapshot of the worker at the peer's `last`:
//                            replay from there (see Restore)
// A restart the sequence numbers need not show (the new process idle, or its first batch seen
// numbered past the old last one) is seen on the connection: the subscriber calls
// Reconnected() when a publisher connection is made again after one was lost.
//   with a replay endpoint   ask the engine for the batch applied last: the same payload is
//                            the same engine (keep everything); another payload is a restart
//                            (clear, replay the new process); no answer or a buffer without
//                            it: treated as a restart
//   without one              treated as a restart
// Treated as a restart: clear the worker (exact: a new engine process holds nothing) and
// take the next message as a first contact. The same engine back after a network drop, when
// it cannot be verified, loses its indexed blocks until its events refill them: the index
// errs toward claiming less, never more.
// While a replay runs, live messages queue (up to 65,536 and StreamOptions::max_pending_bytes
// of payload) and are applied after it, in order.
//
// Thread safety: Handle may be called from any thread; one lock serialises a worker's
// messages (held for a whole message; a replay's batches take it one at a time). Snapshot
// never waits for a replay: it reads a copy published after every step, under its own lock.
// The trust cell is read without a lock (atomics). Hooks run under the stream's lock.
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <zmq.hpp>

#include "common/event.h"
#include "events/decoder.h"
#include "events/subscriber.h"

namespace kvroute {

// kStale is never stored in a TrustCell: the router reports an exact worker that has been
// silent for RouterOptions::stale_after_s as stale (Router::StateOf).
enum class TrustState : uint8_t { kExact = 0, kRecovering = 1, kDegraded = 2, kStale = 3 };
const char* TrustStateName(TrustState s);  // "exact", "recovering", "degraded", "stale"
// Decisions do not trust a degraded or stale worker's part of the index.
inline bool Untrusted(TrustState s) {
  return s == TrustState::kDegraded || s == TrustState::kStale;
}

// A worker's trust state, placed by the stream's owner where its request path reads it.
struct TrustCell {
  std::atomic<double> degraded_since{0.0};  // monotonic seconds
  std::atomic<uint8_t> state{static_cast<uint8_t>(TrustState::kExact)};
  // The state at `now` (monotonic seconds): degraded for hold_s or longer reads, and
  // becomes, exact.
  TrustState Read(double now, double hold_s);
};

struct StreamOptions {
  int64_t dp_rank = -1;           // batches of another data-parallel rank are dropped; -1: any
  std::string replay_endpoint;    // the engine's replay ROUTER socket; empty = no replay
  double replay_timeout_s = 1.0;  // bound on one replay exchange
  double degraded_hold_s = 60.0;  // how long a worker stays degraded after a reset
  DecodeLimits limits;
  // Bytes of payload kept in the live queue during a replay (and at most 65,536 messages).
  size_t max_pending_bytes = 64u << 20;
};

// Counters of one worker's stream.
struct StreamStats {
  uint64_t replays = 0;            // replay requests sent
  uint64_t batches_recovered = 0;  // batches applied from replay
  uint64_t replay_failures = 0;    // replays that timed out or could not cover the gap
  uint64_t resets = 0;             // worker state dropped (restart or unrecoverable gap)
  uint64_t joined_late = 0;        // first batch seen had seq > 0 (router started after it)
  uint64_t reconnects = 0;         // publisher connection made again after a loss
  uint64_t replay_queue_bytes = 0;    // payload bytes queued behind a replay now
  uint64_t replay_queue_dropped = 0;  // live messages dropped: the queue was full
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
};

// Where a worker's stream stands: the last batch applied and its payload's XXH3, as a
// snapshot of the index records it (Dump) and a restore starts from (Restore).
struct StreamPosition {
  bool seen_seq = false;   // a sequenced batch was applied (last_seq is meaningful)
  uint64_t last_seq = 0;
  bool have_hash = false;  // last_hash is the XXH3 of that batch's payload
  uint64_t last_hash = 0;
  bool recovering = false;  // a replay was running (the index holds the batches it applied)
};

class WorkerStream {
 public:
  using ApplyFn = std::function<void(const EventBatch&, ApplyCounts*)>;
  using ClearFn = std::function<void()>;
  // `replay_ctx` and `trust` must outlive the stream.
  WorkerStream(StreamOptions opts, zmq::context_t* replay_ctx, TrustCell* trust, ApplyFn apply,
               ClearFn clear);
  ~WorkerStream();  // Stop()
  WorkerStream(const WorkerStream&) = delete;
  WorkerStream& operator=(const WorkerStream&) = delete;

  // One message, from the socket or fed by the caller. Returns false if it was dropped (or
  // the stream is stopped); a message queued behind a replay counts as taken.
  bool Handle(const WireMessage& m);
  // The worker's publisher connection was made again after one was lost (Subscriber's
  // on_reconnect). Behind a replay in progress it waits its turn in the live queue.
  void Reconnected();

  // Asks a replay in progress to give up (it checks every 50 ms). Does not wait.
  void RequestStop();
  // RequestStop, then waits for the replay thread and for a Handle in progress; afterwards
  // no hook runs again. Idempotent.
  void Stop();

  // Runs `dump` (reading the worker's part of the index) under the stream's lock, so no
  // batch is applied meanwhile, and returns the position that part stands at.
  StreamPosition Dump(const std::function<void()>& dump);
  // Starts the stream at a peer's position: runs `load` (filling the worker's part of the
  // index from the peer's snapshot) under the stream's lock and takes `at` as the last batch
  // applied. Refused (false, nothing run) while a replay runs, when `at` has no sequence
  // number, or when the stream has seen messages and has no replay endpoint; a stream that
  // has seen messages (and can replay) first drops what they built. With a replay endpoint
  // it then asks the engine for everything after at.last_seq (a catch-up replay on the
  // recovery thread; the worker is recovering meanwhile, live messages queue): the engine's
  // copy of the batch at at.last_seq must hash to at.last_hash, else the engine restarted
  // after the snapshot was taken and the restored state is dropped (the new process is
  // replayed from 0). A buffer that no longer reaches back to at.last_seq leaves the worker
  // degraded. Without a replay endpoint the next live batch decides: seq = last + 1
  // applies, a gap degrades, seq <= last is a restart (cleared).
  bool Restore(const StreamPosition& at, const std::function<void()>& load);

  StreamStats Snapshot(double now_mono) const;
  // Monotonic seconds of the last message, or of the stream's creation before any. Lock-free.
  double LastMessageMono() const { return last_message_.load(std::memory_order_relaxed); }

 private:
  struct Pending {
    bool has_seq;
    uint64_t seq;
    std::string payload;
    bool reconnect = false;  // a Reconnected() call, in its place among the messages
  };
  struct RecoveryJob {
    enum Kind { kGap, kRestart, kFirstContact, kReconnect } kind;
    uint64_t from;
    uint64_t until;
    bool verify;  // kGap: the batch at `from` must be the one applied last
    uint64_t verify_hash;
    uint8_t prior_state;
    // Replay up to the end of the engine's buffer (until = max): a Restore's catch-up.
    bool open_end = false;
  };
  enum ExchangeResult { kDone, kUncovered, kTimedOut, kRestarted };

  // REQUIRES: mu_ held (for the next four).
  bool HandleLocked(const WireMessage& m, bool allow_replay);
  bool ApplyPayload(const char* payload, size_t len);
  void Reset(bool degraded);
  void ResetForReconnect();  // clear (exact); the next message is a first contact
  void StartRecovery(RecoveryJob job, const WireMessage* live);  // live: may be null
  void Publish();
  void PopPending();  // the front of pending_, its bytes uncounted
  // The recovery thread: replays through Exchange (mu_ taken per applied batch), then drains
  // the live messages that queued up meanwhile.
  void RecoveryMain();
  ExchangeResult Exchange(uint64_t from, uint64_t until, bool verify, uint64_t verify_hash,
                          bool first_contact, bool open_end);

  const StreamOptions opts_;
  zmq::context_t* const replay_ctx_;
  TrustCell* const trust_;
  const ApplyFn apply_;
  const ClearFn clear_;
  std::atomic<bool> stopping_{false};
  std::atomic<double> last_message_;  // LastMessageMono(); written by Handle

  mutable std::mutex mu_;  // the stream: everything below but the published copy
  bool stopped_ = false;
  StreamStats st_;
  double last_recv_mono_ = -1;
  bool recovering_ = false;  // the recovery thread owns the stream; live messages queue up
  // Live messages received while recovering, in order. A list: empty, it allocates nothing
  // (a std::deque allocates ~600 bytes even empty, for every worker).
  std::list<Pending> pending_;
  RecoveryJob job_{};
  std::thread recovery_;
  uint64_t last_payload_hash_ = 0;  // XXH3 of the last sequenced payload applied
  bool have_last_hash_ = false;
  std::unique_ptr<zmq::socket_t> replay_sock_;  // DEALER, lazily; the recovery thread's

  mutable std::mutex pub_mu_;  // the copy of st_ for readers
  StreamStats pub_;
  double pub_last_recv_ = -1;
};

}  // namespace kvroute
