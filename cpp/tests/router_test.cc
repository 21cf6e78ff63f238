// Tests of the router (cpp/router/): ingestion, selection and request bookkeeping without
// sockets, sequence numbers, a concurrent ingest/select/stats stress (for TSan), and ZeroMQ
// ingestion end to end (worker removal and Close while messages flow).
//
// Environment: KVROUTE_TEST_STRESS_S = seconds of the concurrent stress (default 1.5).
#include <gtest/gtest.h>
#include <unistd.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "router/router.h"
#include "tests/test_util.h"

using namespace kvroute;
using namespace kvroute_test;

namespace {
// Router::Select on a whole prompt.
kvroute::Decision SelectIn(kvroute::Router& r, const std::vector<uint32_t>& prompt, bool explain,
                           double now_s) {
  kvroute::SelectRequest req;
  req.tokens = prompt.data();
  req.num_tokens = prompt.size();
  req.explain = explain;
  req.now_s = now_s;
  return r.Select(req);
}
}  // namespace

namespace {

RouterOptions Opts(int threads = 1) {
  RouterOptions o;
  o.ingest_threads = threads;
  o.seed = 7;
  return o;
}
WorkerConfig Wc(std::string name, std::string endpoint = "", int64_t rank = -1) {
  WorkerConfig w;
  w.name = std::move(name);
  w.endpoint = std::move(endpoint);
  w.dp_rank = rank;
  return w;
}
const WorkerStats* StatsOf(const std::vector<WorkerStats>& all, const std::string& name) {
  for (const auto& s : all) {
    if (s.config.name == name) return &s;
  }
  return nullptr;
}

TEST(Router, ingest_select_complete) {
  Router r(Opts(), {Wc("a"), Wc("b"), Wc("c", "", 1)});
  EXPECT_THROW(r.AddWorker(Wc("a")), std::invalid_argument);
  EXPECT_THROW(r.AddWorker(Wc("")), std::invalid_argument);
  const auto prompt = Range(0, 64);
  Decision d0 = SelectIn(r, prompt, false, 1.0);
  EXPECT_TRUE(d0.fallback);  // nothing ingested yet
  EXPECT_TRUE(r.Complete(d0.request_id));
  EXPECT_TRUE(!r.Complete(d0.request_id));

  const std::string p = Enc(Batch({StoredArr({1, 2, 3}, std::nullopt, Range(0, 48), 16)}));
  EXPECT_TRUE(r.Ingest("b", false, 0, p.data(), p.size()));
  EXPECT_EQ(r.EventsApplied(), 1u);
  EXPECT_THROW(r.Ingest("zz", false, 0, p.data(), p.size()), std::out_of_range);
  // Rank mismatch on c (expects rank 1, batch says 0).
  EXPECT_TRUE(!r.Ingest("c", false, 0, p.data(), p.size()));
  const std::string bad = "\xc1";
  EXPECT_TRUE(!r.Ingest("a", false, 0, bad.data(), bad.size()));

  auto matches = r.FindMatches(prompt.data(), prompt.size(), {}, nullptr);
  EXPECT_EQ(matches.size(), 3u);
  for (const auto& m : matches) {
    EXPECT_EQ(m.blocks, m.worker == "b" ? 3u : 0u);
    if (m.worker == "b") {
      EXPECT_EQ(m.tokens, 48u);
    }
  }
  Decision d = SelectIn(r, prompt, true, 2.0);
  EXPECT_TRUE(!d.fallback);
  EXPECT_TRUE(d.worker == "b");
  EXPECT_EQ(d.matched_blocks, 3u);
  EXPECT_EQ(d.matched_tokens, 48u);
  EXPECT_EQ(d.prompt_tokens, 64u);
  EXPECT_EQ(d.prefill_tokens, 16u);
  EXPECT_EQ(d.available_blocks, 3u);
  EXPECT_EQ(d.available_tokens, 48u);
  EXPECT_EQ(d.scores.size(), 3u);
  auto st = r.Stats();
  EXPECT_EQ(st.size(), 3u);
  const WorkerStats* sb = StatsOf(st, "b");
  const WorkerStats* sc = StatsOf(st, "c");
  const WorkerStats* sa = StatsOf(st, "a");
  EXPECT_TRUE(sb && sc && sa);
  if (sb && sc && sa) {
    EXPECT_EQ(sb->batches, 1u);
    EXPECT_EQ(sb->unsequenced, 1u);
    EXPECT_EQ(sb->indexed_blocks, 3u);
    EXPECT_EQ(sb->inflight_requests, 1);
    EXPECT_EQ(sb->pending_prefill_tokens, 16);
    EXPECT_EQ(sc->drops.Get(DropReason::kRankMismatch), 1u);
    EXPECT_EQ(sa->drops.Get(DropReason::kParseError), 1u);
  }
  EXPECT_TRUE(r.FirstToken(d.request_id));
  EXPECT_TRUE(r.FirstToken(d.request_id));  // idempotent
  st = r.Stats();
  if (StatsOf(st, "b")) {
    EXPECT_EQ(StatsOf(st, "b")->pending_prefill_tokens, 0);
  }
  EXPECT_TRUE(r.Complete(d.request_id));
  EXPECT_TRUE(!r.FirstToken(d.request_id));
  st = r.Stats();
  if (StatsOf(st, "b")) {
    EXPECT_EQ(StatsOf(st, "b")->inflight_requests, 0);
  }

  r.UpdateLoad("a", 3.0, 0.5);
  EXPECT_THROW(r.UpdateLoad("a", -1.0, std::nullopt), std::invalid_argument);
  EXPECT_THROW(r.UpdateLoad("a", std::nullopt, 1.5), std::invalid_argument);
  EXPECT_THROW(r.UpdateLoad("nope", 1.0, std::nullopt), std::out_of_range);
  st = r.Stats();
  if (StatsOf(st, "a")) {
    EXPECT_TRUE(StatsOf(st, "a")->num_requests_waiting == 3.0);
    EXPECT_TRUE(StatsOf(st, "a")->kv_cache_usage_perc == 0.5);
  }
  EXPECT_EQ(r.WorkerBlocks("b").size(), 3u);
  EXPECT_THROW(r.WorkerBlocks("nope"), std::out_of_range);

  // Removing a worker drops its blocks and its in-flight decisions.
  Decision d2 = SelectIn(r, prompt, false, 3.0);
  EXPECT_TRUE(d2.worker == "b");
  r.RemoveWorker("b");
  EXPECT_TRUE(!r.Complete(d2.request_id));
  EXPECT_THROW(r.RemoveWorker("b"), std::out_of_range);
  EXPECT_THROW(r.WorkerBlocks("b"), std::out_of_range);
  EXPECT_EQ(r.index().Entries(), 0u);
  r.RemoveWorker("a");
  r.RemoveWorker("c");
  EXPECT_THROW(SelectIn(r, prompt, false, 4.0),
               std::logic_error);
  r.AddWorker(Wc("b"));  // a name can come back (with a new id)
  EXPECT_TRUE(SelectIn(r, prompt, false, 5.0).worker == "b");
  r.Close();
  r.Close();
}

TEST(Router, sequence_numbers) {
  Router r(Opts(), {Wc("a")});
  const std::string p = Enc(Batch({}));
  for (uint64_t s : {0, 1, 2}) EXPECT_TRUE(r.Ingest("a", true, s, p.data(), p.size()));
  auto st = r.Stats();
  EXPECT_TRUE(st.size() == 1 && st[0].seen_seq && st[0].last_seq == 2 && st[0].gaps == 0 &&
        st[0].backward_jumps == 0 && st[0].batches == 3);
  r.Ingest("a", true, 10, p.data(), p.size());  // gap of 7
  st = r.Stats();
  EXPECT_TRUE(st.size() == 1 && st[0].gaps == 1 && st[0].missing_batches == 7);
  r.Ingest("a", true, 0, p.data(), p.size());  // restart
  st = r.Stats();
  EXPECT_TRUE(st.size() == 1 && st[0].backward_jumps == 1 && st[0].last_seq == 0);
}

// Other replicas' load (SetPeerLoad) counts in the candidates as if it were this router's.
TEST(Router, peer_load_steers_the_choice) {
  Router r(Opts(), {Wc("a"), Wc("b")});
  const std::string p = Enc(Batch({StoredArr({1}, std::nullopt, Range(0, 16), 16)}));
  r.Ingest("a", false, 0, p.data(), p.size());  // events seen: kv_aware decides
  const auto prompt = Range(1000, 64);  // matched nowhere: load decides
  r.SetPeerLoad("a", 4, 256, 4);
  Decision d = SelectIn(r, prompt, true, 1.0);
  EXPECT_EQ(d.worker, "b");
  ASSERT_EQ(d.scores.size(), 2u);
  EXPECT_EQ(d.scores[0].requests, 4.0);
  EXPECT_EQ(d.scores[0].pending_prefill_tokens, 256.0);
  auto st = r.Stats();
  ASSERT_NE(StatsOf(st, "a"), nullptr);
  EXPECT_EQ(StatsOf(st, "a")->peer_inflight_requests, 4);
  EXPECT_EQ(StatsOf(st, "a")->peer_pending_prefill_tokens, 256);
  EXPECT_EQ(StatsOf(st, "a")->inflight_requests, 0);  // only this router's own
  EXPECT_EQ(StatsOf(st, "b")->active_blocks, 4);      // one request of 4 blocks
  const auto own = r.LocalLoad();  // this router's own, for its peers: b alone
  ASSERT_EQ(own.size(), 1u);
  EXPECT_EQ(own[0].worker, "b");
  EXPECT_EQ(own[0].inflight, 1);
  EXPECT_EQ(own[0].pending_prefill, 64);
  EXPECT_EQ(own[0].active_blocks, 4);
  EXPECT_THROW(r.SetPeerLoad("a", -1, 0, 0), std::invalid_argument);
  EXPECT_THROW(r.SetPeerLoad("nope", 1, 0, 0), std::out_of_range);
  r.SetPeerLoad("a", 0, 0, 0);
}

// A peer's dump restores block for block; the stream continues from its position, and a
// sequence number at or below it (an engine restart) clears the restored state.
TEST(Router, dump_restore_and_fencing) {
  Router src(Opts(), {Wc("a")});
  const std::string p0 = Enc(Batch({StoredArr({1, 2, 3}, std::nullopt, Range(0, 48), 16)}));
  const std::string p1 = Enc(Batch({StoredArr({4}, std::optional<uint64_t>(3), Range(48, 16), 16)}));
  src.Ingest("a", true, 0, p0.data(), p0.size());
  src.Ingest("a", true, 1, p1.data(), p1.size());
  WorkerDump d = src.DumpWorker("a");
  EXPECT_TRUE(d.at.seen_seq && d.at.have_hash && !d.at.recovering);
  EXPECT_EQ(d.at.last_seq, 1u);
  EXPECT_EQ(d.entries.size(), 4u);

  Router dst(Opts(), {Wc("a")});
  EXPECT_TRUE(dst.RestoreWorker("a", d.at, d.entries));
  EXPECT_FALSE(dst.RestoreWorker("a", d.at, d.entries));  // the stream has a position now
  auto key_of = [](const std::vector<Index::WorkerEntry>& es) {
    std::set<std::pair<uint64_t, uint64_t>> out;
    for (const auto& e : es) out.insert({e.hash.lo, e.key});
    return out;
  };
  EXPECT_EQ(key_of(dst.WorkerBlocks("a")), key_of(src.WorkerBlocks("a")));
  const auto prompt = Range(0, 64);
  EXPECT_EQ(dst.FindMatches(prompt.data(), prompt.size(), {}, nullptr)[0].blocks, 4u);
  // The next batch chains onto a restored parent (engine hash 4).
  const std::string p2 = Enc(Batch({StoredArr({5}, std::optional<uint64_t>(4), Range(64, 16), 16)}));
  EXPECT_TRUE(dst.Ingest("a", true, 2, p2.data(), p2.size()));
  EXPECT_EQ(dst.WorkerBlocks("a").size(), 5u);
  auto st = dst.Stats();
  EXPECT_EQ(st[0].last_seq, 2u);
  EXPECT_EQ(st[0].gaps, 0u);
  // Restart: seq 0 again. The restored blocks go.
  const std::string q = Enc(Batch({StoredArr({9}, std::nullopt, Range(500, 16), 16)}));
  dst.Ingest("a", true, 0, q.data(), q.size());
  EXPECT_EQ(dst.WorkerBlocks("a").size(), 1u);
  st = dst.Stats();
  EXPECT_EQ(st[0].backward_jumps, 1u);

  // A stream that has seen a message and has no replay endpoint refuses a restore.
  Router busy(Opts(), {Wc("a")});
  busy.Ingest("a", true, 0, p0.data(), p0.size());
  EXPECT_FALSE(busy.RestoreWorker("a", d.at, d.entries));
  EXPECT_EQ(busy.WorkerBlocks("a").size(), 3u);
}

// An engine's replay ROUTER socket on loopback serving a batch buffer that a test can swap
// (an engine restart): [id, "", seq] in, [id, "", seq, payload]... then the end marker out.
class FakeReplay {
 public:
  FakeReplay() : sock_(ctx_, zmq::socket_type::router) {
    sock_.set(zmq::sockopt::linger, 0);
    sock_.bind("tcp://127.0.0.1:*");
    endpoint_ = sock_.get(zmq::sockopt::last_endpoint);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeReplay() {
    stop_ = true;
    thread_.join();
  }
  const std::string& endpoint() const { return endpoint_; }
  void Set(std::vector<std::pair<uint64_t, std::string>> batches) {
    std::lock_guard lock(mu_);
    batches_ = std::move(batches);
  }

 private:
  static std::string Seq8(uint64_t s) {
    std::string out(8, '\0');
    for (int i = 7; i >= 0; --i, s >>= 8) out[static_cast<size_t>(i)] = static_cast<char>(s & 0xFF);
    return out;
  }
  void Serve() {
    while (!stop_) {
      zmq::pollitem_t item{sock_.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::chrono::milliseconds(10)) <= 0) continue;
      std::vector<zmq::message_t> f;
      if (!zmq::recv_multipart(sock_, std::back_inserter(f))) continue;
      if (f.size() != 3 || f[2].size() != 8) continue;
      uint64_t start = 0;
      for (size_t i = 0; i < 8; ++i) start = start << 8 | static_cast<uint8_t>(f[2].data<char>()[i]);
      const std::string id = f[0].to_string();
      auto send = [&](uint64_t seq, const std::string& payload) {
        const std::string seq8 = Seq8(seq);  // alive until the send below
        std::vector<zmq::const_buffer> out = {zmq::buffer(id), zmq::str_buffer(""),
                                              zmq::buffer(seq8), zmq::buffer(payload)};
        zmq::send_multipart(sock_, out);
      };
      std::lock_guard lock(mu_);
      for (const auto& [seq, payload] : batches_) {
        if (seq >= start) send(seq, payload);
      }
      send(0xFFFFFFFFFFFFFFFFull, "");
    }
  }
  zmq::context_t ctx_{1};
  zmq::socket_t sock_;
  std::string endpoint_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<std::pair<uint64_t, std::string>> batches_;
  std::thread thread_;
};

// A restore catches up from the engine's replay; a snapshot older than an engine restart is
// fenced off by the hash of its last batch (dropped, the new process replayed from 0).
TEST(Router, restore_catches_up_and_fences_a_restart_with_replay) {
  const std::string p0 = Enc(Batch({StoredArr({1, 2, 3}, std::nullopt, Range(0, 48), 16)}));
  const std::string p1 = Enc(Batch({StoredArr({4}, std::optional<uint64_t>(3), Range(48, 16), 16)}));
  const std::string p2 = Enc(Batch({StoredArr({5}, std::optional<uint64_t>(4), Range(64, 16), 16)}));
  Router src(Opts(), {Wc("a")});
  src.Ingest("a", true, 0, p0.data(), p0.size());
  src.Ingest("a", true, 1, p1.data(), p1.size());
  const WorkerDump d = src.DumpWorker("a");

  FakeReplay engine;
  engine.Set({{0, p0}, {1, p1}, {2, p2}});
  WorkerConfig w = Wc("a");
  w.replay_endpoint = engine.endpoint();
  auto settled = [](Router& r, uint64_t seq) {
    for (int i = 0; i < 500; ++i) {
      auto st = r.Stats();
      if (st[0].state == TrustState::kExact && st[0].last_seq == seq) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  };
  {
    Router dst(Opts(), {w});
    EXPECT_TRUE(dst.RestoreWorker("a", d.at, d.entries));
    EXPECT_TRUE(settled(dst, 2));
    EXPECT_EQ(dst.WorkerBlocks("a").size(), 5u);  // 4 restored, 1 replayed
    EXPECT_EQ(dst.Stats()[0].batches_recovered, 1u);
    EXPECT_EQ(dst.Stats()[0].backward_jumps, 0u);
  }
  // The engine restarted: its batch 1 is another one now.
  const std::string q0 = Enc(Batch({StoredArr({70}, std::nullopt, Range(700, 16), 16)}));
  const std::string q1 = Enc(Batch({StoredArr({71}, std::optional<uint64_t>(70), Range(716, 16), 16)}));
  engine.Set({{0, q0}, {1, q1}});
  Router late(Opts(), {w});
  EXPECT_TRUE(late.RestoreWorker("a", d.at, d.entries));
  EXPECT_TRUE(settled(late, 1));
  std::set<uint64_t> held;
  for (const auto& e : late.WorkerBlocks("a")) held.insert(e.hash.lo);
  EXPECT_EQ(held, (std::set<uint64_t>{70, 71}));
  EXPECT_EQ(late.Stats()[0].backward_jumps, 1u);
}

TEST(Router, lora_and_extra_keys) {
  Router r(Opts(), {Wc("a"), Wc("b")});
  V ev = A({S("BlockStored"), Hs({1}), Nil(), Toks(Range(0, 16)), I(16), Nil(), S("GPU"),
            S("adapter")});
  const std::string p = Enc(Batch({ev}));
  EXPECT_TRUE(r.Ingest("a", false, 0, p.data(), p.size()));
  const auto t = Range(0, 16);
  auto m = r.FindMatches(t.data(), t.size(), "adapter", nullptr);
  EXPECT_TRUE(m.size() == 2 && m[0].worker == "a" && m[0].blocks == 1 && m[1].blocks == 0);
  m = r.FindMatches(t.data(), t.size(), {}, nullptr);
  EXPECT_TRUE(m.size() == 2 && m[0].blocks == 0);
}

// ==== router under concurrency =================================================================

// 4 ingest threads (each owns one worker, plus every 8th batch for its neighbour) against
// 4 threads calling Select / Complete / FirstToken / Stats / FindMatches / UpdateLoad /
// WorkerBlocks, plus one transient worker added and removed while it runs. Assertions are
// invariants only; the point is to give TSan every shared structure under contention.
TEST(Router, concurrent_ingest_select_stats) {
  const char* env = std::getenv("KVROUTE_TEST_STRESS_S");
  const double dur = env ? std::atof(env) : 1.5;
  RouterOptions o = Opts();
  o.speculative_ttl_s = 0.05;
  Router r(o, {Wc("w0"), Wc("w1"), Wc("w2"), Wc("w3")});
  const int kPrompts = 8;
  std::vector<std::vector<uint32_t>> prompts;
  for (int i = 0; i < kPrompts; ++i) prompts.push_back(Range(static_cast<uint32_t>(i) * 1000, 128));

  // Pre-encode each worker's stream: store a prompt's chain, remove some, clear now and then.
  std::vector<std::vector<std::string>> streams(4);
  for (int w = 0; w < 4; ++w) {
    for (int k = 0; k < 64; ++k) {
      const auto& pr = prompts[(w + k) % kPrompts];
      const uint64_t base = (static_cast<uint64_t>(w) << 40) + static_cast<uint64_t>(k) * 100;
      std::vector<V> evs;
      evs.push_back(StoredArr({base + 1, base + 2, base + 3, base + 4}, std::nullopt,
                              std::vector<uint32_t>(pr.begin(), pr.begin() + 64), 16));
      evs.push_back(StoredArr({base + 5, base + 6}, base + 4,
                              std::vector<uint32_t>(pr.begin() + 64, pr.begin() + 96), 16,
                              k % 3 == 0 ? "CPU" : "GPU"));
      if (k % 4 == 1) evs.push_back(RemovedArr({base + 6, base + 5}));
      if (k % 16 == 15) evs.push_back(ClearedArr());
      if (k % 8 == 7) evs.push_back(A({S("Unknown")}));
      streams[w].push_back(Enc(Batch(std::move(evs), 0, 1.0 + k)));
    }
  }

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> ingested{0}, selects{0}, stats_calls{0}, bad{0};
  std::vector<std::thread> ts;
  const std::set<std::string> known = {"w0", "w1", "w2", "w3", "tmp"};
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&, t] {
      const std::string mine = "w" + std::to_string(t);
      const std::string next = "w" + std::to_string((t + 1) % 4);
      uint64_t seq = 0;
      size_t k = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        const std::string& p = streams[t][k % streams[t].size()];
        // Mostly in order; every 50th a gap, every 97th a restart (seq back to 0).
        if (k % 97 == 96) seq = 0;
        else if (k % 50 == 49) seq += 3;
        else if (k > 0) ++seq;
        r.Ingest(mine, true, seq, p.data(), p.size());
        if (k % 8 == 0) r.Ingest(next, false, 0, p.data(), p.size());
        ingested.fetch_add(1, std::memory_order_relaxed);
        ++k;
      }
    });
  }
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<uint64_t>(t) + 100);
      std::vector<uint64_t> open;
      std::vector<std::string> extras = {Enc(A({S("salt")}))};
      uint64_t it = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        ++it;
        const auto& pr = prompts[rng() % kPrompts];
        switch (t) {
          case 0:
          case 1: {
            Decision d = SelectIn(r, pr, t == 1, -1);
            if (!known.count(d.worker)) bad.fetch_add(1);
            if (d.matched_tokens > d.prompt_tokens) bad.fetch_add(1);
            open.push_back(d.request_id);
            if (open.size() > 4) {
              if (rng() % 2) r.FirstToken(open.front());
              r.Complete(open.front());
              open.erase(open.begin());
            }
            selects.fetch_add(1, std::memory_order_relaxed);
            break;
          }
          case 2: {
            auto st = r.Stats();
            if (st.size() < 4 || st.size() > 5) bad.fetch_add(1);
            auto m = r.FindMatches(pr.data(), pr.size(), "lora", &extras);
            for (const auto& x : m) {
              if (x.blocks > pr.size() / 16) bad.fetch_add(1);
            }
            r.WorkerBlocks("w" + std::to_string(it % 4));
            (void)r.index().Entries();
            (void)r.index().MemoryBytes();
            stats_calls.fetch_add(1, std::memory_order_relaxed);
            break;
          }
          default: {
            r.UpdateLoad("w" + std::to_string(it % 4), static_cast<double>(it % 5),
                         static_cast<double>(it % 10) / 10.0);
            if (it % 20 == 0) {
              r.AddWorker(Wc("tmp"));
              const std::string& p = streams[0][it % 64];
              r.Ingest("tmp", false, 0, p.data(), p.size());
              Decision d = SelectIn(r, pr, false, -1);
              if (!known.count(d.worker)) bad.fetch_add(1);
              r.RemoveWorker("tmp");
              r.Complete(d.request_id);  // may be gone with "tmp": either way fine
            }
            break;
          }
        }
      }
      for (uint64_t id : open) r.Complete(id);
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(dur));
  stop.store(true);
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_TRUE(ingested.load() > 0);
  EXPECT_TRUE(selects.load() > 0);
  EXPECT_TRUE(stats_calls.load() > 0);
  EXPECT_TRUE(r.EventsApplied() > 0);
  auto st = r.Stats();
  EXPECT_EQ(st.size(), 4u);
  for (const auto& s : st) {
    EXPECT_EQ(s.inflight_requests, 0);
    EXPECT_EQ(s.pending_prefill_tokens, 0);
    EXPECT_TRUE(s.batches > 0);
  }
  std::fprintf(stderr, "  stress %.1fs: %llu batches ingested, %llu selects, %llu stats\n", dur,
               static_cast<unsigned long long>(ingested.load()),
               static_cast<unsigned long long>(selects.load()),
               static_cast<unsigned long long>(stats_calls.load()));
}

TEST(RouterZmq, round_trip_remove_and_close_while_flowing) {
  zmq::context_t ctx(1);
  zmq::socket_t pub_z(ctx, zmq::socket_type::pub), pub_y(ctx, zmq::socket_type::pub);
  const std::string ep_z = BindPub(pub_z), ep_y = BindPub(pub_y);
  EXPECT_TRUE(ep_z.rfind("tcp://127.0.0.1:", 0) == 0);
  RouterOptions o = Opts(2);
  o.topic = "kv";
  Router r(o, {Wc("z", ep_z), Wc("y", ep_y)});

  // Bad endpoints: rejected, and the name stays free.
  EXPECT_THROW(r.AddWorker(Wc("bad", "nonsense://x")), std::invalid_argument);
  r.AddWorker(Wc("bad"));
  r.RemoveWorker("bad");

  // Slow joiner: probe with unsequenced (2-frame) empty batches until one arrives.
  const std::string empty = Enc(Batch({}));
  auto probe_until_seen = [&](zmq::socket_t& pub, const std::string& name) {
    return WaitFor(
        [&] {
          SendFrames(pub, {"kv", empty});
          auto st = r.Stats();
          const WorkerStats* s = StatsOf(st, name);
          return s != nullptr && s->unsequenced > 0;
        },
        10.0);
  };
  EXPECT_TRUE(probe_until_seen(pub_z, "z"));
  EXPECT_TRUE(probe_until_seen(pub_y, "y"));

  // 3-frame messages, seq from 0: stores of one prompt's chain on z.
  const int kN = 40;
  for (int i = 0; i < kN; ++i) {
    const uint64_t h = 1000 + static_cast<uint64_t>(i);
    std::optional<uint64_t> parent;
    if (i > 0) parent = h - 1;
    std::string p = Enc(Batch({StoredArr({h}, parent, Range(static_cast<uint32_t>(i) * 16, 16), 16)}));
    SendFrames(pub_z, {"kv-events", Seq8(static_cast<uint64_t>(i)), p});
  }
  SendFrames(pub_z, {"other-topic", Seq8(999), empty});  // filtered by the SUB prefix
  SendFrames(pub_z, {"kv", Seq8(kN), empty, "extra"});    // 4 frames
  SendFrames(pub_z, {"kv"});                              // 1 frame
  SendFrames(pub_z, {"kv", "1234567", empty});            // seq frame of 7 bytes
  auto z_done = [&] {
    auto st = r.Stats();
    const WorkerStats* s = StatsOf(st, "z");
    return s != nullptr && s->last_seq == kN - 1 && s->drops.Get(DropReason::kBadFrames) == 3;
  };
  EXPECT_TRUE(WaitFor(z_done, 10.0));
  {
    auto st = r.Stats();
    const WorkerStats* s = StatsOf(st, "z");
    EXPECT_TRUE(s != nullptr);
    if (s != nullptr) {
      EXPECT_EQ(s->gaps, 0u);
      EXPECT_EQ(s->backward_jumps, 0u);
      EXPECT_EQ(s->indexed_blocks, static_cast<uint64_t>(kN));
      EXPECT_EQ(s->apply.blocks_stored, static_cast<uint64_t>(kN));
      EXPECT_TRUE(s->last_recv_age_s >= 0);
    }
  }
  const auto prompt = Range(0, kN * 16);
  Decision d = SelectIn(r, prompt, false, -1);
  EXPECT_TRUE(d.worker == "z");
  EXPECT_EQ(d.matched_blocks, static_cast<uint32_t>(kN));
  r.Complete(d.request_id);

  // Bind mode: the SUB binds an ipc endpoint, a PUB connects to it.
  const std::string ipc = "ipc:///tmp/kvroute-core-test-" + std::to_string(getpid()) + ".ipc";
  WorkerConfig wb = Wc("bound", ipc);
  wb.bind = true;
  r.AddWorker(wb);
  zmq::socket_t pub_b(ctx, zmq::socket_type::pub);
  pub_b.set(zmq::sockopt::linger, 0);
  pub_b.connect(ipc);
  EXPECT_TRUE(probe_until_seen(pub_b, "bound"));
  r.RemoveWorker("bound");
  std::remove(ipc.c_str() + 6);

  // Messages keep flowing on both sockets while z is removed and the router closed.
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> sent{0};
  std::thread publisher([&] {
    uint64_t seq_z = kN, seq_y = 0;
    uint64_t h = 5000;
    while (!stop.load()) {
      std::string pz = Enc(Batch({StoredArr({h}, std::nullopt, Range(static_cast<uint32_t>(h), 16), 16)}));
      std::string py = Enc(Batch({StoredArr({h}, std::nullopt, Range(static_cast<uint32_t>(h), 16), 16),
                                  RemovedArr({h})}));
      SendFrames(pub_z, {"kv", Seq8(seq_z++), pz});
      SendFrames(pub_y, {"kv", Seq8(seq_y++), py});
      ++h;
      sent.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  auto y_batches = [&] {
    auto st = r.Stats();
    const WorkerStats* s = StatsOf(st, "y");
    return s ? s->batches : 0;
  };
  const uint64_t y0 = y_batches();
  EXPECT_TRUE(WaitFor([&] { return y_batches() > y0 + 5; }, 10.0));
  r.RemoveWorker("z");
  EXPECT_THROW(r.WorkerBlocks("z"), std::out_of_range);
  EXPECT_TRUE(StatsOf(r.Stats(), "z") == nullptr);
  EXPECT_EQ(r.index().WorkerBlocks(0), 0u);  // z was the first worker added (id 0)
  const uint64_t entries_after_remove = r.index().Entries();
  const uint64_t y1 = y_batches();
  EXPECT_TRUE(WaitFor([&] { return y_batches() > y1 + 5; }, 10.0));  // y still flows
  EXPECT_EQ(r.index().WorkerBlocks(0), 0u);  // nothing of z came back
  EXPECT_TRUE(r.index().Entries() <= entries_after_remove + 1);
  r.Close();
  const uint64_t applied = r.EventsApplied();
  const uint64_t y2 = y_batches();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(r.EventsApplied(), applied);  // no ingestion after Close() returned
  EXPECT_EQ(y_batches(), y2);
  EXPECT_THROW(r.AddWorker(Wc("late", ep_z)), std::logic_error);
  r.Close();
  // A closed router refuses the request path and membership changes.
  EXPECT_THROW(SelectIn(r, prompt, false, -1), std::logic_error);
  EXPECT_THROW(r.RemoveWorker("y"), std::logic_error);
  EXPECT_THROW(r.Ingest("y", false, 0, empty.data(), empty.size()), std::logic_error);
  stop.store(true);
  publisher.join();
  EXPECT_TRUE(sent.load() > 0);
}

}  // namespace

TEST(Router, set_policy_switches_or_changes_nothing) {
  Router r(Opts(), {Wc("a"), Wc("b")});
  const std::vector<uint32_t> prompt(64, 7);
  EXPECT_THROW(r.SetPolicy("kv_aware", {}, "cost", {}), std::invalid_argument);  // needs events
  EXPECT_THROW(r.SetPolicy("no_such_policy", {}, "random", {}), std::invalid_argument);
  EXPECT_THROW(r.SetPolicy("kv_aware", {{"cache_weight", 2.0}}, "random", {}),
               std::invalid_argument);
  // a knob of the policy given to the fallback: not the fallback's
  EXPECT_THROW(r.SetPolicy("kv_aware", {}, "random", {{"cache_weight", 0.5}}),
               std::invalid_argument);
  EXPECT_EQ(r.options().policy, "kv_aware");
  EXPECT_EQ(r.options().fallback, "power_of_two");
  EXPECT_EQ(r.options().policy_params.at("cache_weight"), ParamValue(0.7));
  r.SetPolicy("round_robin", {}, "random", {});
  EXPECT_EQ(std::string(SelectIn(r, prompt, false, 1.0).policy), "round_robin");
  EXPECT_EQ(SelectIn(r, prompt, false, 1.0).worker, "b");  // the counter went on: a, then b
}

// A policy and its fallback each hold their own knobs, even of the same name: here two
// consistent_hash rings of 1 and 400 points a worker, and kv_aware's cache_weight beside
// cache_aware's knobs. SetPolicyParam changes the policy's alone.
TEST(Router, policy_and_fallback_keep_their_own_knobs) {
  RouterOptions o = Opts();
  o.policy = "consistent_hash";
  o.policy_params = {{"virtual_nodes", int64_t{1}}};
  o.fallback = "consistent_hash";
  o.fallback_params = {{"virtual_nodes", int64_t{400}}};
  Router r(o, {Wc("a"), Wc("b")});
  EXPECT_EQ(r.options().policy_params.at("virtual_nodes"), ParamValue(int64_t{1}));
  EXPECT_EQ(r.options().fallback_params.at("virtual_nodes"), ParamValue(int64_t{400}));
  r.SetPolicy("kv_aware", {{"cache_weight", 0.9}}, "cache_aware",
              {{"cache_threshold", 0.5}, {"max_tree_size", int64_t{1000}}});
  EXPECT_EQ(r.options().policy_params.at("cache_weight"), ParamValue(0.9));
  EXPECT_EQ(r.options().policy_params.count("cache_threshold"), 0u);
  EXPECT_EQ(r.options().fallback_params.at("cache_threshold"), ParamValue(0.5));
  EXPECT_EQ(r.options().fallback_params.at("max_tree_size"), ParamValue(int64_t{1000}));
  EXPECT_EQ(r.options().fallback_params.at("eviction_interval_s"), ParamValue(120.0));
  r.SetPolicyParam("cache_weight", 0.25);
  EXPECT_EQ(r.options().policy_params.at("cache_weight"), ParamValue(0.25));
  EXPECT_EQ(r.options().fallback_params.at("cache_threshold"), ParamValue(0.5));
  EXPECT_THROW(r.SetPolicyParam("cache_threshold", 0.1), std::invalid_argument);  // fallback's
  EXPECT_THROW(r.SetPolicyParam("cache_weight", 1.5), std::invalid_argument);
  EXPECT_EQ(r.options().policy_params.at("cache_weight"), ParamValue(0.25));
}
