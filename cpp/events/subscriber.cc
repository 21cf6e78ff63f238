#include "events/subscriber.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <stdexcept>
#include <zmq_addon.hpp>

#include <sys/socket.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#ifdef __linux__
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "events/replay.h"

namespace kvroute {

struct Subscriber::Op {
  enum Kind { kAdd, kRemove } kind;
  uint64_t id = 0;
  SubscriptionSpec spec;
  std::promise<std::string> done;  // empty string = ok, else the error
};

struct Subscriber::IngestLoop {
  std::mutex mu;
  std::vector<std::shared_ptr<Op>> pending;
  std::atomic<bool> has_pending{false};
};

namespace {
constexpr int kPollMs = 5;      // how soon a pending Add/Remove/Close is noticed when idle
constexpr int kMaxBurst = 256;  // at most this many messages from one socket per round...
// ...and no new one after this much handling time: one socket's slice of a round. A socket
// whose messages are slow to handle delays the others on its thread by one slice (plus the
// message in progress), never by its whole backlog.
constexpr auto kSlice = std::chrono::milliseconds(2);
// After this many payload bytes a thread that finds its sockets idle asks the allocator to
// hand free pages back to the system (glibc malloc_trim): a flood's buffers are freed by
// ZeroMQ, but glibc keeps the pages of its heap unless asked.
constexpr size_t kTrimAfterBytes = 64u << 20;

// What a subscription's socket monitor has seen of its publisher connections. ZeroMQ reports
// a failed handshake (ZMQ_EVENT_HANDSHAKE_FAILED_*) before that connection's
// ZMQ_EVENT_DISCONNECTED, so each failure pays for the next disconnect: what is left are
// losses of connections that had completed their handshake.
struct PeerWatch {
  bool joined = false;        // some connection completed its handshake
  bool lost = false;          // a handshaken connection was lost since the last handshake
  uint32_t failed_open = 0;   // failed handshakes whose disconnect has not been seen yet
  uint32_t live = 0;          // handshaken connections not yet seen disconnected
};

constexpr int kHandshakeFailed = ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                 ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                 ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
constexpr int kMonitorEvents =
    ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED | kHandshakeFailed;

struct Sub {
  uint64_t id;
  zmq::socket_t sock;
  SubscriptionSpec spec;  // the handler and what a replacement socket is opened with
  // The socket's monitor (kMonitorEvents), bound and connected sockets alike. A connected
  // socket is replaced by a new one when its connection drops and ZeroMQ has not made it
  // again by the time the events are read: ZeroMQ ends a connection
  // whose peer sent a frame past ZMQ_MAXMSGSIZE as a protocol error and never reconnects it
  // by itself. (Connecting the same socket again aborted libzmq 4.3.4 in zmq_msg_recv in
  // our tests.) A bound socket keeps listening; its publishers reconnect.
  zmq::socket_t monitor;
  PeerWatch peers;  // carried over to a replacement socket
};

// What a new SUB socket is opened with besides its spec: whether the ZAP handler runs, and
// the key pairs (32 bytes each; empty = none).
struct SocketKeys {
  bool zap = false;
  std::string server_secret, server_public;  // bound sockets: CURVE server
  std::string client_secret, client_public;  // connected sockets with a curve_server_key
};

// A SUB socket for `spec`, connected or bound, and its monitor. `serial` makes the monitor's
// inproc address unique. Throws zmq::error_t.
void OpenSub(zmq::context_t& ctx, const SubscriptionSpec& spec, uint64_t serial,
             const SocketKeys& keys, zmq::socket_t* sock, zmq::socket_t* monitor) {
  zmq::socket_t s(ctx, zmq::socket_type::sub);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::rcvhwm, spec.receive_hwm);
  s.set(zmq::sockopt::maxmsgsize, spec.max_message_bytes);
  s.set(zmq::sockopt::reconnect_ivl, 100);
  s.set(zmq::sockopt::reconnect_ivl_max, 5000);
  s.set(zmq::sockopt::subscribe, spec.topic);
  const std::string addr = "inproc://kvroute-sub-monitor-" + std::to_string(serial);
  if (zmq_socket_monitor(s.handle(), addr.c_str(), kMonitorEvents) != 0) throw zmq::error_t();
  zmq::socket_t mon(ctx, zmq::socket_type::pair);
  mon.set(zmq::sockopt::linger, 0);
  mon.connect(addr);
  if (spec.bind) {
    if (!keys.server_secret.empty()) {  // CURVE server: publishers need the router's public key
      s.set(zmq::sockopt::curve_server, true);
      s.set(zmq::sockopt::curve_secretkey, zmq::buffer(keys.server_secret));
      s.set(zmq::sockopt::curve_publickey, zmq::buffer(keys.server_public));
    }
    if (keys.zap) {  // the ZAP handler checks every peer (Subscriber's allowed_ips, keys)
      s.set(zmq::sockopt::zap_domain, "kvroute");  // NULL mechanism: ZAP runs when a domain is set
    }
    s.bind(spec.endpoint);
  } else {
    if (!spec.curve_server_key.empty()) {  // CURVE client of the publisher's key
      s.set(zmq::sockopt::curve_serverkey,
            zmq::buffer(CurveKeyBytes(spec.curve_server_key, "curve_server_key")));
      s.set(zmq::sockopt::curve_secretkey, zmq::buffer(keys.client_secret));
      s.set(zmq::sockopt::curve_publickey, zmq::buffer(keys.client_public));
    }
    s.connect(spec.endpoint);
  }
  *sock = std::move(s);
  *monitor = std::move(mon);
}

std::atomic<uint64_t> g_monitor_serial{0};

// The event id of a zmq_socket_monitor message (version 1: frame 0 is a uint16 event id and
// a uint32 value in host order, frame 1 the endpoint), or 0 for anything else.
uint16_t MonitorEventId(const std::vector<zmq::message_t>& frames) {
  uint16_t event = 0;
  if (frames.size() != 2 || frames[0].size() != sizeof(uint16_t) + sizeof(uint32_t)) return 0;
  std::memcpy(&event, frames[0].data(), sizeof(event));
  return event;
}

// Names the calling thread and lowers its priority by `nice` (a thread's nice value is its
// own on Linux: setpriority with the thread id). Lowering never needs a privilege; a failure
// leaves the thread at the process's priority, which is only slower for the callers.
void SetUpIngestThread(int nice) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), "kvroute-ingest");
  if (nice > 0) {
    const id_t tid = static_cast<id_t>(syscall(SYS_gettid));
    errno = 0;
    const int now = getpriority(PRIO_PROCESS, tid);
    if (errno == 0) setpriority(PRIO_PROCESS, tid, std::min(now + nice, 19));
  }
#else
  (void)nice;
#endif
}

}  // namespace

bool CurveAvailable() { return zmq_has("curve") != 0; }

std::string CurveKeyBytes(const std::string& key, const std::string& what) {
  if (key.size() != 40) {
    throw std::invalid_argument(what + " must be a CurveZMQ key in Z85 (40 characters), got " +
                                std::to_string(key.size()) + " characters");
  }
  std::string out(32, '\0');
  if (zmq_z85_decode(reinterpret_cast<uint8_t*>(out.data()), key.c_str()) == nullptr) {
    throw std::invalid_argument(what + " must be a CurveZMQ key in Z85 (40 characters of the "
                                "Z85 alphabet), got '" + key + "'");
  }
  return out;
}

std::string CurvePublicKey(const std::string& secret_key) {
  CurveKeyBytes(secret_key, "curve_secret_key");
  if (!CurveAvailable()) throw std::invalid_argument("CURVE is not available in this libzmq");
  char pub[41] = {};
  if (zmq_curve_public(pub, secret_key.c_str()) != 0) {
    throw std::invalid_argument("curve_secret_key: " + std::string(zmq_strerror(zmq_errno())));
  }
  return std::string(pub, 40);
}

void ValidateEndpoint(const std::string& endpoint, bool bind) {
  const std::string scheme = "tcp://";
  if (endpoint.compare(0, scheme.size(), scheme) != 0) return;
  std::string addr = endpoint.substr(scheme.size());
  const size_t semi = addr.rfind(';');  // "source;destination": the destination
  if (semi != std::string::npos) addr = addr.substr(semi + 1);
  const size_t colon = addr.rfind(':');
  auto bad = [&](const std::string& why) {
    return std::invalid_argument(std::string("cannot ") + (bind ? "bind" : "connect") + " to '" +
                                 endpoint + "': " + why);
  };
  if (colon == std::string::npos || colon == 0) throw bad("expected tcp://host:port");
  std::string host = addr.substr(0, colon);
  const std::string port = addr.substr(colon + 1);
  const bool wildcard = bind && (port == "*" || port == "0");
  if (!wildcard) {
    if (port.empty() || port.size() > 5 ||
        port.find_first_not_of("0123456789") != std::string::npos) {
      throw bad("port '" + port + "' is not a number in [1, 65535]");
    }
    const long p = std::stol(port);
    if (p < 1 || p > 65535) throw bad("port " + port + " is not in [1, 65535]");
  }
  if (host.empty()) throw bad("expected tcp://host:port");
  // Host names are not resolved here: ZeroMQ resolves them when it connects and retries, so
  // an engine whose DNS name appears after the router starts (a pod scheduled later) is
  // picked up, and a slow resolver never stalls the caller (AddWorker holds the membership
  // lock). A name that never resolves shows as a worker with no events.
}

Subscriber::Subscriber(int num_threads, int nice, std::vector<std::string> allowed_ips,
                       CurveOptions curve)
    : ctx_(1), nice_(nice), allowed_ips_(std::move(allowed_ips)) {
  // ZeroMQ caps a context at 1,023 sockets by default, and each subscription takes three
  // (the SUB, the PAIR zmq_socket_monitor opens inside it, our end of the monitor): ~340
  // workers. Raised to the library's limit (ZMQ_SOCKET_LIMIT, 65,535 with epoll), before any
  // socket exists; the process's file descriptors (~4 per worker) are then the bound.
  zmq_ctx_set(ctx_.handle(), ZMQ_MAX_SOCKETS, zmq_ctx_get(ctx_.handle(), ZMQ_SOCKET_LIMIT));
  if (num_threads < 1) throw std::invalid_argument("ingest_threads must be >= 1");
  if (nice < 0 || nice > 19) throw std::invalid_argument("ingest_nice must be in [0, 19]");
  if (!curve.allowed_publisher_keys.empty() && curve.secret_key.empty()) {
    throw std::invalid_argument(
        "curve_allowed_publisher_keys needs curve_secret_key (bound sockets are CURVE servers "
        "with it)");
  }
  if (!curve.secret_key.empty()) {
    server_secret_ = CurveKeyBytes(curve.secret_key, "curve_secret_key");
    server_public_ = CurveKeyBytes(CurvePublicKey(curve.secret_key), "curve public key");
    client_secret_ = server_secret_;
    client_public_ = server_public_;
  }
  for (size_t i = 0; i < curve.allowed_publisher_keys.size(); ++i) {
    allowed_keys_.push_back(CurveKeyBytes(curve.allowed_publisher_keys[i],
                                          "curve_allowed_publisher_keys[" + std::to_string(i) + "]"));
  }
  if (client_secret_.empty() && CurveAvailable()) {
    // The key pair connected CURVE sockets authenticate with when the router has none.
    char pub[41] = {}, sec[41] = {};
    if (zmq_curve_keypair(pub, sec) == 0) {
      client_public_ = CurveKeyBytes(std::string(pub, 40), "curve public key");
      client_secret_ = CurveKeyBytes(std::string(sec, 40), "curve secret key");
    }
  }
  if (!allowed_ips_.empty() || !allowed_keys_.empty()) {
    // Bound before any socket exists, so no handshake can run without it.
    zap_ = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::rep);
    zap_->set(zmq::sockopt::linger, 0);
    zap_->bind("inproc://zeromq.zap.01");
    zap_thread_ = std::thread([this] { ZapMain(zap_.get()); });
  }
  for (int i = 0; i < num_threads; ++i) loops_.push_back(std::make_unique<IngestLoop>());
  // Threads are created here and never touch Python: see the header's threading rule.
  for (auto& w : loops_) threads_.emplace_back([this, wp = w.get()] { Run(wp); });
}

Subscriber::~Subscriber() { Close(); }

void Subscriber::Submit(IngestLoop* w, std::shared_ptr<Op> op) {
  std::lock_guard lock(w->mu);
  w->pending.push_back(std::move(op));
  w->has_pending.store(true, std::memory_order_release);
}

uint64_t Subscriber::Add(SubscriptionSpec spec) {
  ValidateEndpoint(spec.endpoint, spec.bind);
  if (!spec.curve_server_key.empty()) {
    if (spec.bind) {
      throw std::invalid_argument("curve_server_key is for connected sockets; a bound socket is "
                                  "a CURVE server with the router's curve_secret_key");
    }
    CurveKeyBytes(spec.curve_server_key, "curve_server_key");
    if (client_secret_.empty()) {
      throw std::invalid_argument("curve_server_key: CURVE is not available in this libzmq");
    }
  }
  auto op = std::make_shared<Op>();
  op->kind = Op::kAdd;
  op->spec = std::move(spec);
  std::future<std::string> f = op->done.get_future();
  {
    std::lock_guard lock(mu_);
    if (closed_) throw std::logic_error("Subscriber is closed");
    op->id = next_id_++;
    // Least-loaded thread by subscription count.
    std::vector<size_t> count(loops_.size(), 0);
    for (auto& [id, w] : owner_) {
      for (size_t i = 0; i < loops_.size(); ++i) {
        if (loops_[i].get() == w) ++count[i];
      }
    }
    size_t best = 0;
    for (size_t i = 1; i < count.size(); ++i) {
      if (count[i] < count[best]) best = i;
    }
    owner_.emplace_back(op->id, loops_[best].get());
    Submit(loops_[best].get(), op);
  }
  std::string err = f.get();
  if (!err.empty()) {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < owner_.size(); ++i) {
      if (owner_[i].first == op->id) {
        owner_.erase(owner_.begin() + static_cast<long>(i));
        break;
      }
    }
    throw std::invalid_argument(err);
  }
  return op->id;
}

void Subscriber::Remove(uint64_t id) {
  IngestLoop* w = nullptr;
  auto op = std::make_shared<Op>();
  op->kind = Op::kRemove;
  op->id = id;
  std::future<std::string> f = op->done.get_future();
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    for (size_t i = 0; i < owner_.size(); ++i) {
      if (owner_[i].first == id) {
        w = owner_[i].second;
        owner_.erase(owner_.begin() + static_cast<long>(i));
        break;
      }
    }
    if (w == nullptr) return;
    Submit(w, op);  // under mu_, so Close() cannot slip in before the thread sees it
  }
  f.get();
}

void Subscriber::Close() {
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  stop_.store(true, std::memory_order_release);
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  if (zap_thread_.joinable()) zap_thread_.join();
  zap_.reset();
  ctx_.shutdown();
  ctx_.close();
}

// ZAP (ZeroMQ RFC 27): request [version "1.0", request id, domain, address, identity,
// mechanism, credentials...]; reply [version, request id, status code, status text, user id,
// metadata]. 200 lets the connection through, 400 refuses it. Checks the address against
// allowed_ips_ and, when allowed_keys_ is set, the CURVE client key against it.
void Subscriber::ZapMain(zmq::socket_t* handler) {
  std::vector<zmq::message_t> req;
  while (!stop_.load(std::memory_order_acquire)) {
    zmq::pollitem_t item{handler->handle(), 0, ZMQ_POLLIN, 0};
    try {
      if (zmq::poll(&item, 1, std::chrono::milliseconds(kPollMs)) <= 0) continue;
      req.clear();
      if (!zmq::recv_multipart(*handler, std::back_inserter(req), zmq::recv_flags::dontwait)) {
        continue;
      }
      // Frames: [3] the peer's address, [5] the mechanism, [6] CURVE: its 32-byte public key.
      bool ok = req.size() >= 6;
      if (ok && !allowed_ips_.empty()) {
        const std::string addr = req[3].to_string();
        ok = std::find(allowed_ips_.begin(), allowed_ips_.end(), addr) != allowed_ips_.end();
      }
      const char* why = "address not allowed";
      if (ok && !allowed_keys_.empty()) {
        ok = req.size() >= 7 && req[5].to_string_view() == "CURVE" &&
             std::find(allowed_keys_.begin(), allowed_keys_.end(), req[6].to_string()) !=
                 allowed_keys_.end();
        why = "key not allowed";
      }
      std::array<zmq::const_buffer, 6> reply = {
          zmq::str_buffer("1.0"),
          zmq::buffer(req.size() > 1 ? req[1].data() : nullptr, req.size() > 1 ? req[1].size() : 0),
          ok ? zmq::str_buffer("200") : zmq::str_buffer("400"),
          ok ? zmq::str_buffer("OK") : zmq::buffer(why, std::strlen(why)),
          zmq::str_buffer(""), zmq::str_buffer("")};
      zmq::send_multipart(*handler, reply);
    } catch (const zmq::error_t&) {
      // EINTR, or the context ending: the loop condition decides.
    }
  }
}

void Subscriber::Run(IngestLoop* w) {
  SetUpIngestThread(nice_);
  const SocketKeys keys{zap_ != nullptr, server_secret_, server_public_, client_secret_,
                        client_public_};
  std::vector<Sub> subs;
  std::vector<zmq::pollitem_t> items;
  std::vector<zmq::message_t> frames;
  frames.reserve(4);
  std::vector<zmq::message_t> event_frames;  // monitor events only (see the monitor loop)
  event_frames.reserve(2);
  size_t handled_bytes = 0;  // payload bytes since the last malloc_trim
  std::vector<size_t> monitored;  // items[subs.size() + j] is subs[monitored[j]]'s monitor
  auto rebuild = [&] {
    items.clear();
    monitored.clear();
    for (auto& s : subs) items.push_back({s.sock.handle(), 0, ZMQ_POLLIN, 0});
    for (size_t i = 0; i < subs.size(); ++i) {
      if (!subs[i].monitor) continue;
      items.push_back({subs[i].monitor.handle(), 0, ZMQ_POLLIN, 0});
      monitored.push_back(i);
    }
  };
  while (!stop_.load(std::memory_order_acquire)) {
    if (w->has_pending.load(std::memory_order_acquire)) {
      std::vector<std::shared_ptr<Op>> ops;
      {
        std::lock_guard lock(w->mu);
        ops.swap(w->pending);
        w->has_pending.store(false, std::memory_order_release);
      }
      for (auto& op : ops) {
        if (op->kind == Op::kAdd) {
          try {
            zmq::socket_t s, mon;
            OpenSub(ctx_, op->spec, g_monitor_serial.fetch_add(1), keys, &s, &mon);
            subs.push_back(Sub{op->id, std::move(s), std::move(op->spec), std::move(mon), PeerWatch{}});
            op->done.set_value("");
          } catch (const std::exception& e) {
            op->done.set_value("cannot " + std::string(op->spec.bind ? "bind" : "connect") +
                               " SUB socket to '" + op->spec.endpoint + "': " + e.what());
          }
        } else {
          for (size_t i = 0; i < subs.size(); ++i) {
            if (subs[i].id == op->id) {
              zmq_socket_monitor(subs[i].sock.handle(), nullptr, 0);
              subs.erase(subs.begin() + static_cast<long>(i));
              break;
            }
          }
          op->done.set_value("");
        }
      }
      rebuild();
    }
    if (items.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(kPollMs));
      continue;
    }
    int n = 0;
    try {
      n = zmq::poll(items.data(), items.size(), std::chrono::milliseconds(kPollMs));
    } catch (const zmq::error_t&) {
      continue;  // EINTR
    }
    if (n <= 0) {
#if defined(__GLIBC__)
      if (n == 0 && handled_bytes >= kTrimAfterBytes) {
        malloc_trim(0);
        handled_bytes = 0;
      }
#endif
      continue;
    }
    // Control requests (add, remove, close) are served between any two messages: a backlog
    // never holds them for longer than the message in progress.
    auto interrupted = [&] {
      return stop_.load(std::memory_order_acquire) ||
             w->has_pending.load(std::memory_order_acquire);
    };
    bool replaced = false;
    for (size_t j = 0; j < monitored.size(); ++j) {
      if ((items[subs.size() + j].revents & ZMQ_POLLIN) == 0) continue;
      Sub& s = subs[monitored[j]];
      PeerWatch& p = s.peers;
      bool disconnected = false;
      bool rejoined = false;
      try {
        while (true) {
          // Events go into a buffer of their own, emptied before every read: the message
          // loop below leaves the last message's frames in `frames` when a burst ends on
          // the slice or the burst cap, and an event appended after them would be read
          // from the message's topic frame (the real event lost).
          event_frames.clear();
          if (!zmq::recv_multipart(s.monitor, std::back_inserter(event_frames),
                                   zmq::recv_flags::dontwait)) {
            break;
          }
          switch (MonitorEventId(event_frames)) {
            case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
              // A connected socket holds one connection at a time: any handshake after its
              // first is a connection made again, whatever was seen of the old one's end. A
              // bound socket takes several publishers: a handshake counts after a loss only.
              rejoined = rejoined || (s.spec.bind ? p.lost : p.joined);
              p.lost = false;
              p.joined = true;
              ++p.live;
              break;
            case ZMQ_EVENT_DISCONNECTED:
              if (p.failed_open > 0) {
                // A connection that failed its handshake (a wrong CURVE key, a peer refused
                // by ZAP, not ZMTP): ZeroMQ retries it with its back-off; a new socket would
                // retry at once, over and over.
                --p.failed_open;
                break;
              }
              disconnected = true;
              if (p.live > 0) --p.live;
              if (p.joined) {
                // Another handshaken connection still live (bound sockets): a publisher that
                // came back quickly, whose new handshake was reported before the old
                // connection's end.
                if (p.live > 0 && s.spec.bind) {
                  rejoined = true;
                } else {
                  p.lost = true;
                }
              }
              break;
            case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
            case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
              ++p.failed_open;  // its disconnect follows
              break;
            default:
              break;  // not an event of kMonitorEvents, or not a monitor message
          }
        }
      } catch (...) {
        // EINTR or the context ending: what was read so far still counts.
      }
      event_frames.clear();
      try {
        if (rejoined && s.spec.on_reconnect) s.spec.on_reconnect();
      } catch (...) {
        // Deliberately swallowed (as handler exceptions): ingestion goes on.
      }
      if (disconnected && !s.spec.bind && p.live == 0) {
        try {
          // A new socket (a lost connection ZeroMQ would have retried anyway): what the old
          // one still queued is lost and shows up as a gap. Not when ZeroMQ has connected
          // the old one again already (its handshake read after the disconnect, e.g. on a
          // thread that was busy for longer than the reconnect interval): that connection is
          // the publisher's, and a new socket would make it again, a second reconnect.
          zmq::socket_t ns, nm;
          OpenSub(ctx_, s.spec, g_monitor_serial.fetch_add(1), keys, &ns, &nm);
          zmq_socket_monitor(s.sock.handle(), nullptr, 0);
          s.sock = std::move(ns);
          s.monitor = std::move(nm);
          p.failed_open = 0;  // the old socket's connections are gone with it
          p.live = 0;
          replaced = true;
        } catch (...) {
          // No new socket (out of file descriptors): the old one keeps reconnecting.
        }
      }
    }
    if (replaced) {
      rebuild();
      continue;  // items point at the new sockets from the next poll on
    }
    for (size_t i = 0; i < subs.size() && !interrupted(); ++i) {
      if ((items[i].revents & ZMQ_POLLIN) == 0) continue;
      Sub& s = subs[i];
      const auto slice_end = std::chrono::steady_clock::now() + kSlice;
      for (int k = 0; k < kMaxBurst; ++k) {
        if (k > 0 && (interrupted() || std::chrono::steady_clock::now() >= slice_end)) break;
        frames.clear();
        std::optional<size_t> got;
        try {
          got = zmq::recv_multipart(s.sock, std::back_inserter(frames), zmq::recv_flags::dontwait);
        } catch (const zmq::error_t&) {
          break;
        }
        if (!got) break;
        WireMessage m;
        if (frames.size() == 3 && frames[1].size() == 8) {
          m.topic = std::string_view(static_cast<const char*>(frames[0].data()), frames[0].size());
          m.has_seq = true;
          m.seq = ReadSeq(frames[1].data());
          m.payload = static_cast<const char*>(frames[2].data());
          m.payload_len = frames[2].size();
        } else if (frames.size() == 2) {
          m.topic = std::string_view(static_cast<const char*>(frames[0].data()), frames[0].size());
          m.payload = static_cast<const char*>(frames[1].data());
          m.payload_len = frames[1].size();
        } else {
          m.bad_frames = true;
        }
        for (const auto& f : frames) handled_bytes += f.size();
        // Deliberately swallow handler exceptions: a bad message must never kill ingestion.
        try {
          s.spec.handler(m);
        } catch (...) {
        }
      }
    }
  }
  subs.clear();
  // Fail any op that raced with Close so its caller does not wait forever.
  std::lock_guard lock(w->mu);
  for (auto& op : w->pending) op->done.set_value(op->kind == Op::kAdd ? "subscriber closed" : "");
  w->pending.clear();
}

}  // namespace kvroute
