// ZeroMQ SUB ingestion on native threads.
//
// One SUB socket per worker endpoint (connect by default, bind on request), spread over a
// fixed pool of ingestion threads; each socket is owned by exactly one thread for its whole
// life (ZeroMQ sockets are not thread-safe). A thread polls its sockets, receives multipart
// messages and hands each one to the subscription's handler on that same thread.
//
// Threading rule: ingestion threads never call into Python and never need the GIL. Handlers
// must be plain C++. Python only starts, stops (joining with the GIL released) and reads
// stats.
//
// Thread safety: Add/Remove/Close may be called from any thread. Remove() returns only after
// the owning thread has closed the socket: no handler call for that subscription starts
// after it returns. Close() is idempotent and joins every thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>
#include <zmq.hpp>

namespace kvroute {

// One received ZeroMQ message, already split into its frames (docs/kv-events.md §2.1).
struct WireMessage {
  std::string_view topic;
  bool has_seq = false;  // false: two-frame [topic, payload] producer
  uint64_t seq = 0;      // frame 1, 8 bytes big-endian
  const char* payload = nullptr;
  size_t payload_len = 0;
  bool bad_frames = false;  // frame count not 2 or 3, or seq frame not 8 bytes
};

struct SubscriptionSpec {
  std::string endpoint;  // e.g. "tcp://127.0.0.1:5557"
  bool bind = false;     // bind instead of connect
  std::string topic;     // SUB prefix filter; empty = everything
  // ZMQ_MAXMSGSIZE: a peer that sends a frame larger than this is disconnected before the
  // frame is buffered (ZeroMQ reconnects, as after any disconnect). -1: no limit.
  int64_t max_message_bytes = -1;
  // ZMQ_RCVHWM: messages queued for this socket before ZeroMQ stops reading from the peer
  // (a PUB peer then drops what it cannot send). Bytes queued <= receive_hwm x
  // max_message_bytes per connection.
  int receive_hwm = 100000;
  // The publisher's CurveZMQ public key (Z85, 40 characters) for a connected socket: the
  // socket is a CURVE client that only completes its handshake with the holder of the
  // matching secret key, and the traffic is encrypted. Empty: the NULL mechanism (no
  // authentication). Not for bound sockets (they use the Subscriber's CurveOptions).
  std::string curve_server_key;
  std::function<void(const WireMessage&)> handler;
  // Optional. Called on the owning ingestion thread when a publisher connection completes its
  // ZMTP handshake after an earlier one of this subscription was lost: the process behind the
  // endpoint may be a new one (an engine restart that its sequence numbers need not show).
  // Connections that fail their handshake (refused by the ZAP handler, not ZMTP) neither
  // count as lost nor as joined.
  std::function<void()> on_reconnect;
};

// CurveZMQ (ZeroMQ RFC 26) for the SUB sockets; keys are Z85 text (40 characters, 32
// bytes), as zmq_curve_keypair, pyzmq's zmq.curve_keypair() and vLLM-side tooling write them.
struct CurveOptions {
  // The router's secret key. When set, every bound socket is a CURVE server with it: a
  // publisher connects with the matching public key as its server key, and a NULL-mechanism
  // peer cannot complete its handshake. Connected CURVE sockets (SubscriptionSpec::
  // curve_server_key) authenticate as the matching key pair. Empty: bound sockets use the
  // NULL mechanism, and connected CURVE sockets use a key pair made by the Subscriber.
  std::string secret_key;
  // Publisher public keys a bound CURVE socket accepts (the ZAP handler checks each
  // handshake's client key). Empty: any publisher that knows the router's public key.
  // Needs `secret_key`.
  std::vector<std::string> allowed_publisher_keys;
};

// Whether this libzmq has CURVE (built with libsodium or its own tweetnacl).
bool CurveAvailable();
// Throws std::invalid_argument, naming `what`, unless `key` is a 40-character Z85 key.
// Returns its 32 bytes.
std::string CurveKeyBytes(const std::string& key, const std::string& what);
// The public key (Z85) of a secret key (Z85). Throws std::invalid_argument as CurveKeyBytes.
std::string CurvePublicKey(const std::string& secret_key);

// Checks what ZeroMQ would only find out later, after an asynchronous connect: for a tcp://
// endpoint, a host and a port in [1, 65535] (a bound one may also be "*" or 0). Host names
// are left to ZeroMQ, which resolves them when it connects and retries. Other transports
// pass. Throws std::invalid_argument naming the endpoint.
void ValidateEndpoint(const std::string& endpoint, bool bind);

class Subscriber {
 public:
  // `nice`: the threads lower their own scheduling priority by this nice increment (0-19;
  // Linux, setpriority on the thread), so that on a small machine the callers' decisions win
  // the cores and ingestion takes the idle time (README.md, "Thread priority"). Threads are
  // named "kvroute-ingest".
  //
  // `allowed_ips`: when not empty, a bound socket accepts connections only from these peer
  // IP addresses (exact strings as ZeroMQ reports them, e.g. "10.0.0.5", "::1"): a ZAP
  // handler (ZeroMQ's authentication protocol, inproc://zeromq.zap.01 in this context) on a
  // thread of its own refuses the others during the handshake. Connected sockets are not
  // filtered (the router chose their endpoint).
  //
  // `curve`: CurveZMQ keys (CurveOptions). With allowed publisher keys, the same ZAP handler
  // checks each CURVE client's public key (and its address, when `allowed_ips` is set too).
  // Throws std::invalid_argument for a malformed key, allowed keys without a secret key, or
  // CURVE options on a libzmq without CURVE.
  explicit Subscriber(int num_threads, int nice = 0, std::vector<std::string> allowed_ips = {},
                      CurveOptions curve = {});
  ~Subscriber();
  Subscriber(const Subscriber&) = delete;
  Subscriber& operator=(const Subscriber&) = delete;

  // Starts receiving for `spec`; returns a subscription id. Throws std::invalid_argument
  // (bad endpoint, a malformed curve_server_key, or one on a bound socket) or std::runtime_error if the socket cannot connect/bind; throws
  // std::logic_error after Close().
  uint64_t Add(SubscriptionSpec spec);
  // Stops and closes the subscription's socket. Unknown id: no-op.
  void Remove(uint64_t id);
  void Close();
  int num_threads() const { return static_cast<int>(loops_.size()); }

 private:
  struct Op;
  struct IngestLoop;
  void Run(IngestLoop* t);
  void Submit(IngestLoop* t, std::shared_ptr<Op> op);
  void ZapMain(zmq::socket_t* handler);

  zmq::context_t ctx_;
  int nice_ = 0;
  std::vector<std::unique_ptr<IngestLoop>> loops_;  // one per thread
  std::vector<std::thread> threads_;
  std::vector<std::string> allowed_ips_;
  std::vector<std::string> allowed_keys_;  // CURVE public keys, 32 bytes each
  // Key pairs, 32 bytes each: the router's (bound CURVE servers; empty = NULL mechanism) and
  // the one connected CURVE clients use (the router's, or one made here).
  std::string server_secret_, server_public_;
  std::string client_secret_, client_public_;
  std::unique_ptr<zmq::socket_t> zap_;  // the ZAP handler's REP socket (a filter is set)
  std::thread zap_thread_;
  std::mutex mu_;
  std::atomic<bool> stop_{false};
  bool closed_ = false;
  uint64_t next_id_ = 1;
  std::vector<std::pair<uint64_t, IngestLoop*>> owner_;  // subscription id -> owning thread
};

}  // namespace kvroute
