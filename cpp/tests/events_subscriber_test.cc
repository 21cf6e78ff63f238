// Tests of the ZeroMQ Subscriber (cpp/events/subscriber.cc): delivery, close and remove,
// reconnects to lost and replaced publishers, and CurveZMQ keys.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "events/subscriber.h"
#include "tests/test_util.h"

using namespace kvroute;
using namespace kvroute_test;

namespace {

TEST(Subscriber, direct) {
  zmq::context_t ctx(1);
  zmq::socket_t pub(ctx, zmq::socket_type::pub);
  const std::string ep = BindPub(pub);
  Subscriber sub(2);
  EXPECT_EQ(sub.num_threads(), 2);
  std::atomic<int> got{0}, seq_ok{0};
  SubscriptionSpec spec;
  spec.endpoint = ep;
  spec.handler = [&](const WireMessage& m) {
    got.fetch_add(1);
    if (m.has_seq && m.seq == 0x0102030405060708ull && m.payload_len == 3) seq_ok.fetch_add(1);
  };
  const uint64_t id = sub.Add(spec);
  EXPECT_TRUE(id != 0);
  EXPECT_TRUE(WaitFor(
      [&] {
        SendFrames(pub, {"t", std::string("\x01\x02\x03\x04\x05\x06\x07\x08", 8), "abc"});
        return seq_ok.load() > 0;
      },
      10.0));
  sub.Remove(id);
  const int n = got.load();
  SendFrames(pub, {"t", "x"});
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(got.load(), n);  // nothing after Remove() returned
  sub.Remove(id);            // unknown: no-op
  SubscriptionSpec bad;
  bad.endpoint = "tcp://";
  bad.handler = [](const WireMessage&) {};
  EXPECT_THROW(sub.Add(bad), std::invalid_argument);
  sub.Close();
  sub.Close();
  EXPECT_THROW(sub.Add(spec), std::logic_error);
}

TEST(Subscriber, close_and_remove_wait_for_one_message_not_the_backlog) {
  zmq::context_t ctx(1);
  zmq::socket_t slow_pub(ctx, zmq::socket_type::pub), fast_pub(ctx, zmq::socket_type::pub);
  slow_pub.set(zmq::sockopt::sndhwm, 0);
  const std::string slow_ep = BindPub(slow_pub), fast_ep = BindPub(fast_pub);
  Subscriber sub(1);  // one thread: both sockets share it
  std::atomic<int> slow_got{0}, fast_got{0};
  SubscriptionSpec slow;
  slow.endpoint = slow_ep;
  slow.handler = [&](const WireMessage&) {
    slow_got.fetch_add(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a slow message
  };
  SubscriptionSpec fast;
  fast.endpoint = fast_ep;
  fast.handler = [&](const WireMessage&) { fast_got.fetch_add(1); };
  sub.Add(slow);
  const uint64_t fast_id = sub.Add(fast);
  EXPECT_TRUE(WaitFor(
      [&] {
        SendFrames(slow_pub, {"t", "x"});
        return slow_got.load() > 0;
      },
      10.0));
  EXPECT_TRUE(WaitFor(
      [&] {
        SendFrames(fast_pub, {"t", "x"});
        return fast_got.load() > 0;
      },
      10.0));
  const int kBacklog = 200;  // 4 s of handling
  for (int i = 0; i < kBacklog; ++i) SendFrames(slow_pub, {"t", "x"});
  EXPECT_TRUE(WaitFor([&] { return slow_got.load() > 5; }, 10.0));
  using Clock = std::chrono::steady_clock;
  auto ms = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  // Another socket's message waits one slice (plus the message in progress), not the backlog.
  const int f0 = fast_got.load();
  auto t0 = Clock::now();
  SendFrames(fast_pub, {"t", "x"});
  EXPECT_TRUE(WaitFor([&] { return fast_got.load() > f0; }, 10.0));
  EXPECT_LT(ms(t0), 1000.0);
  t0 = Clock::now();
  sub.Remove(fast_id);
  EXPECT_LT(ms(t0), 1000.0);
  t0 = Clock::now();
  sub.Close();
  EXPECT_LT(ms(t0), 1000.0);
  EXPECT_LT(slow_got.load(), kBacklog);
}

// A new PUB bound to `ep`, a port a closed one held (retried while that close completes).
std::unique_ptr<zmq::socket_t> RebindPub(zmq::context_t& ctx, const std::string& ep) {
  auto pub = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::pub);
  pub->set(zmq::sockopt::linger, 0);
  EXPECT_TRUE(WaitFor(
      [&] {
        try {
          pub->bind(ep);
          return true;
        } catch (const zmq::error_t&) {
          return false;
        }
      },
      10.0))
      << "cannot bind " << ep;
  return pub;
}

// on_reconnect fires when a publisher connection is made again after one was lost, for a
// connected socket (the engine binds) and a bound one (the engine connects); a peer that
// fails its handshake (refused by the allowlist) counts neither as lost nor as joined.
TEST(Subscriber, reconnect_after_a_lost_connection) {
  zmq::context_t ctx(1);
  Subscriber sub(1, 0, {"127.0.0.1"});
  std::atomic<int> got{0}, reconnects{0};
  auto spec_for = [&](const std::string& ep, bool bind) {
    SubscriptionSpec spec;
    spec.endpoint = ep;
    spec.bind = bind;
    spec.handler = [&](const WireMessage&) { got.fetch_add(1); };
    spec.on_reconnect = [&] { reconnects.fetch_add(1); };
    return spec;
  };
  auto delivered = [&](zmq::socket_t& pub) {
    const int n = got.load();
    return WaitFor(
        [&] {
          SendFrames(pub, {"t", "x"});
          return got.load() > n;
        },
        10.0);
  };
  {  // connected: the publisher's process goes away and a new one binds the same port
    auto pub = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::pub);
    const std::string ep = BindPub(*pub);
    const uint64_t id = sub.Add(spec_for(ep, false));
    EXPECT_TRUE(delivered(*pub));
    EXPECT_EQ(reconnects.load(), 0);
    pub.reset();
    pub = RebindPub(ctx, ep);
    EXPECT_TRUE(WaitFor([&] { return reconnects.load() == 1; }, 10.0));
    EXPECT_TRUE(delivered(*pub));
    sub.Remove(id);
  }
  reconnects.store(0);
  {  // bound: the publisher connects, leaves, a refused peer knocks, the publisher is back
    zmq::socket_t probe(ctx, zmq::socket_type::sub);
    probe.bind("tcp://127.0.0.1:*");  // a free port for the subscription to bind
    const std::string ep = probe.get(zmq::sockopt::last_endpoint);
    probe.close();
    const uint64_t id = sub.Add(spec_for(ep, true));
    auto connect_pub = [&](const std::string& to) {
      auto p = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::pub);
      p->set(zmq::sockopt::linger, 0);
      p->connect(to);
      return p;
    };
    auto pub = connect_pub(ep);
    EXPECT_TRUE(delivered(*pub));
    auto refused = connect_pub("tcp://127.0.0.2:0;" + ep.substr(6));
    for (int i = 0; i < 20; ++i) {
      SendFrames(*refused, {"t", "x"});
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    refused.reset();
    EXPECT_EQ(reconnects.load(), 0);
    pub.reset();
    pub = connect_pub(ep);
    EXPECT_TRUE(WaitFor([&] { return reconnects.load() == 1; }, 10.0));
    EXPECT_TRUE(delivered(*pub));
    sub.Remove(id);
  }
  sub.Close();
}

// A plain TCP listener on the port of `ep` (not ZeroMQ) that accepts connections and closes
// them at once, `n` times or until `timeout_s`: each is a handshake that fails (ZeroMQ's
// HANDSHAKE_FAILED_NO_DETAIL, then that connection's DISCONNECTED). Returns the number closed.
int AcceptAndClose(const std::string& ep, int n, double timeout_s) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(ep.substr(ep.rfind(':') + 1))));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool bound = WaitFor(
      [&] { return ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0; }, 10.0);
  int closed = 0;
  if (bound && ::listen(fd, 16) == 0) {
    const double end = Secs() + timeout_s;
    while (closed < n && Secs() < end) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int c = ::accept(fd, nullptr, nullptr);
      if (c >= 0) {
        ::close(c);
        ++closed;
      }
    }
  }
  ::close(fd);
  return closed;
}

// A publisher the subscriber connects to (`spec`), its messages and reconnects counted.
struct WatchedPub {
  std::unique_ptr<zmq::socket_t> pub;
  std::string ep;
  std::atomic<int> got{0}, reconnects{0};
  SubscriptionSpec spec;
  explicit WatchedPub(zmq::context_t& ctx)
      : pub(std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::pub)), ep(BindPub(*pub)) {
    spec.endpoint = ep;
    spec.handler = [this](const WireMessage&) { got.fetch_add(1); };
    spec.on_reconnect = [this] { reconnects.fetch_add(1); };
  }
  // Sends (pausing `pause_ms` between sends) until one more message has arrived.
  bool Delivered(double timeout_s = 10.0, int pause_ms = 0) {
    const int n = got.load();
    return WaitFor(
        [&] {
          SendFrames(*pub, {"kv-events", Seq8(0), "x"});
          if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
          return got.load() > n;
        },
        timeout_s);
  }
};

// Another subscription for the same ingestion thread whose handler takes `handle` per
// message; Feed() sends it one message every `every` from a thread of its own until Stop().
struct BusyNeighbour {
  zmq::socket_t pub;
  std::atomic<int> got{0}, sent{0};
  std::atomic<bool> done{false};
  std::thread feeder;
  SubscriptionSpec spec;
  BusyNeighbour(zmq::context_t& ctx, std::chrono::milliseconds handle)
      : pub(ctx, zmq::socket_type::pub) {
    pub.set(zmq::sockopt::sndhwm, 0);
    spec.endpoint = BindPub(pub);
    spec.handler = [this, handle](const WireMessage&) {
      got.fetch_add(1);
      std::this_thread::sleep_for(handle);
    };
  }
  void Feed(std::chrono::milliseconds every) {
    feeder = std::thread([this, every] {
      while (!done.load()) {
        SendFrames(pub, {"kv-events", Seq8(1), "x"});
        sent.fetch_add(1);
        std::this_thread::sleep_for(every);
      }
    });
  }
  void Stop() {
    done.store(true);
    if (feeder.joinable()) feeder.join();
  }
  ~BusyNeighbour() { Stop(); }
};

// An engine process replaced by a new one on the same port, in the sequences ZeroMQ reports
// for it: bound again at once (the subscriber may reach the old listener while it closes: a
// failed handshake and its disconnect), after the subscriber's reconnect back-off has grown,
// and after a listener that is not ZeroMQ accepted and closed its connections (failed
// handshakes, each with its disconnect). Each is a reconnect, seen before the new publisher
// sends anything; the failed handshakes are not.
TEST(Subscriber, reconnect_to_a_new_publisher_on_the_same_port) {
  zmq::context_t ctx(1);
  Subscriber sub(1);
  for (const std::string how : {"fast", "slow", "failed handshakes"}) {
    SCOPED_TRACE(how);
    WatchedPub w(ctx);
    const uint64_t id = sub.Add(w.spec);
    EXPECT_TRUE(w.Delivered());
    w.pub.reset();
    if (how == "slow") std::this_thread::sleep_for(std::chrono::milliseconds(700));
    if (how == "failed handshakes") {
      EXPECT_EQ(AcceptAndClose(w.ep, 3, 10.0), 3);
    }
    w.pub = RebindPub(ctx, w.ep);
    EXPECT_TRUE(WaitFor([&] { return w.reconnects.load() >= 1; }, 10.0));
    if (how != "fast") {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      EXPECT_EQ(w.reconnects.load(), 1);
    }
    EXPECT_TRUE(w.Delivered());
    sub.Remove(id);
  }
  sub.Close();
}

// One ingestion thread, two subscriptions. `busy` always has a backlog of messages that take
// longer than a slice, so every poll ends its burst with a message in hand; the other's
// publisher is replaced by a new one on the same port meanwhile. Each monitor event read in
// those polls must be read as itself: the reconnect is seen.
TEST(Subscriber, reconnect_seen_while_another_subscription_has_a_backlog) {
  zmq::context_t ctx(1);
  BusyNeighbour busy(ctx, std::chrono::milliseconds(3));  // longer than a slice
  Subscriber sub(1);
  sub.Add(busy.spec);
  ASSERT_TRUE(WaitFor(
      [&] {
        SendFrames(busy.pub, {"kv-events", Seq8(0), "x"});
        return busy.got.load() > 0;
      },
      10.0));
  busy.Feed(std::chrono::milliseconds(1));  // faster than `busy` is handled
  auto backlog = [&] { return busy.sent.load() - busy.got.load(); };
  WatchedPub w(ctx);
  sub.Add(w.spec);
  EXPECT_TRUE(w.Delivered());
  EXPECT_EQ(w.reconnects.load(), 0);
  EXPECT_TRUE(WaitFor([&] { return backlog() >= 100; }, 10.0));  // 300 ms of handling
  w.pub.reset();
  w.pub = RebindPub(ctx, w.ep);
  EXPECT_TRUE(WaitFor([&] { return w.reconnects.load() >= 1; }, 10.0));
  EXPECT_GT(backlog(), 0);  // still there when the reconnect was seen
  EXPECT_TRUE(w.Delivered());
  busy.Stop();
  sub.Close();
}

// The thread reads a connected socket's events late (its other subscription's messages take
// 1 s each), so ZeroMQ has usually connected the socket again by then: the disconnect and the
// new handshake come in one read. That is one reconnect; the socket, connected again, is
// kept (a new one would connect once more: a second reconnect).
TEST(Subscriber, reconnect_counted_once_when_zeromq_reconnected_before_the_events_were_read) {
  zmq::context_t ctx(1);
  BusyNeighbour busy(ctx, std::chrono::seconds(1));
  Subscriber sub(1);
  WatchedPub w(ctx);
  sub.Add(w.spec);
  EXPECT_TRUE(w.Delivered(20.0, 20));
  sub.Add(busy.spec);
  busy.Feed(std::chrono::milliseconds(200));  // `busy` always has the next message
  EXPECT_TRUE(WaitFor([&] { return busy.got.load() > 0; }, 10.0));
  w.pub.reset();
  w.pub = RebindPub(ctx, w.ep);
  EXPECT_TRUE(WaitFor([&] { return w.reconnects.load() >= 1; }, 20.0));
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // two more reads at least
  EXPECT_EQ(w.reconnects.load(), 1);
  EXPECT_TRUE(w.Delivered(20.0, 20));
  EXPECT_EQ(w.reconnects.load(), 1);
  busy.Stop();
  sub.Close();
}

}  // namespace

// CurveZMQ: keys are checked (Z85, 40 characters), allowed keys need a secret key, a bound
// socket takes no curve_server_key; a connected socket with the publisher's key gets its
// messages, one with another key gets none.
TEST(Subscriber, curve_keys) {
  if (!CurveAvailable()) GTEST_SKIP() << "libzmq without CURVE";
  char pub_key[41], sec_key[41], other_pub[41], other_sec[41];
  ASSERT_EQ(zmq_curve_keypair(pub_key, sec_key), 0);
  ASSERT_EQ(zmq_curve_keypair(other_pub, other_sec), 0);
  EXPECT_EQ(CurvePublicKey(sec_key), std::string(pub_key));
  EXPECT_THROW(CurveKeyBytes("short", "k"), std::invalid_argument);
  EXPECT_THROW(CurveKeyBytes(std::string(40, '~'), "k"), std::invalid_argument);
  EXPECT_EQ(CurveKeyBytes(pub_key, "k").size(), 32u);
  EXPECT_THROW(Subscriber(1, 0, {}, CurveOptions{"", {pub_key}}), std::invalid_argument);
  EXPECT_THROW(Subscriber(1, 0, {}, CurveOptions{"bad", {}}), std::invalid_argument);

  zmq::context_t ctx(1);
  zmq::socket_t pub(ctx, zmq::socket_type::pub);
  pub.set(zmq::sockopt::curve_server, true);
  pub.set(zmq::sockopt::curve_secretkey, std::string(sec_key));
  const std::string ep = BindPub(pub);
  Subscriber sub(1);
  std::atomic<int> right{0}, wrong{0};
  SubscriptionSpec bound;
  bound.endpoint = "tcp://127.0.0.1:*";
  bound.bind = true;
  bound.curve_server_key = pub_key;
  bound.handler = [](const WireMessage&) {};
  EXPECT_THROW(sub.Add(bound), std::invalid_argument);
  SubscriptionSpec a, b;
  a.endpoint = b.endpoint = ep;
  a.curve_server_key = pub_key;
  b.curve_server_key = other_pub;
  a.handler = [&](const WireMessage&) { right.fetch_add(1); };
  b.handler = [&](const WireMessage&) { wrong.fetch_add(1); };
  sub.Add(a);
  sub.Add(b);
  EXPECT_TRUE(WaitFor(
      [&] {
        SendFrames(pub, {"t", "x"});
        return right.load() > 0;
      },
      10.0));
  for (int i = 0; i < 20; ++i) {
    SendFrames(pub, {"t", "x"});
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(wrong.load(), 0);
  sub.Close();
}
