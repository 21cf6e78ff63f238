// Tests of Index's lookups (cpp/index/index_match.cc): the prefix walk (record chains, its
// fast loop, credit ends, a lazily hashed key stream), partly against the per-block definition,
// and speculative credits (held, released, expired, capped).
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/block_key.h"
#include "index/index.h"
#include "tests/index_test_util.h"
#include "tests/test_util.h"

using namespace kvroute;
using namespace kvroute_test;

namespace {

// The prefix walk takes the record after the previous block's as the next block's when two
// blocks' records were adjacent (one event's records are allocated in order), checking the
// whole key and that the record is live. Records freed and reused by another chain, in
// reverse order, free records, and a chain that crosses a slab chunk must all give the same
// depths as the table.
TEST(Index, walk_guesses_the_next_record_exactly) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  ApplyCounts c;
  const auto x = Range(0, 8 * 16), y = Range(5000, 3 * 16);
  std::vector<uint64_t> xh, yh;
  for (uint64_t i = 0; i < 8; ++i) xh.push_back(100 + i);
  for (uint64_t i = 0; i < 3; ++i) yh.push_back(200 + i);
  ix.Apply(a, StoredEv(xh, std::nullopt, x), &c);
  EXPECT_EQ(Match(ix, Keys(x)).blocks[a], 8u);
  ix.Apply(a, RemovedEv({103, 104, 105}), &c);  // frees the records of blocks 3-5
  EXPECT_EQ(Match(ix, Keys(x)).blocks[a], 3u);
  ix.Apply(b, StoredEv(yh, std::nullopt, y), &c);  // reuses them, last freed first
  auto m = Match(ix, Keys(x));
  EXPECT_TRUE(m.blocks[a] == 3u && m.blocks[b] == 0u);
  m = Match(ix, Keys(y));
  EXPECT_TRUE(m.blocks[b] == 3u && m.blocks[a] == 0u);
  // a holds Y too: the record after X[2]'s is now live and held by a, so only the key
  // comparison keeps the walk from crediting a with X[3].
  ix.Apply(a, StoredEv({300, 301, 302}, std::nullopt, y), &c);
  m = Match(ix, Keys(y));
  EXPECT_TRUE(m.blocks[a] == 3u && m.blocks[b] == 3u);
  EXPECT_EQ(Match(ix, Keys(x)).blocks[a], 3u);
  ix.Apply(b, RemovedEv(yh), &c);
  ix.Apply(a, RemovedEv({302}), &c);  // Y[2]'s record (after X[2]'s) is free again
  m = Match(ix, Keys(y));
  EXPECT_TRUE(m.blocks[a] == 2u && m.blocks[b] == 0u);
  EXPECT_EQ(Match(ix, Keys(x)).blocks[a], 3u);
  // One chain across the end of the first slab chunk (131,072 records).
  const uint32_t n = static_cast<uint32_t>(kvroute::BlockSlab::kChunk) + 40;
  const auto big = Range(1u << 24, n * 16);
  std::vector<uint64_t> bh(n);
  for (uint32_t i = 0; i < n; ++i) bh[i] = 1000000 + i;
  ix.Apply(b, StoredEv(bh, std::nullopt, big), &c);
  m = Match(ix, Keys(big));
  EXPECT_TRUE(m.blocks[b] == n && m.blocks[a] == 0u);
  ix.Apply(b, RemovedEv({1000000 + n - 10}), &c);
  EXPECT_EQ(Match(ix, Keys(big)).blocks[b], n - 10);
}

// The walk's loop for the common case (a run open, the probe stage on a chain of records)
// must hand over to the general path wherever that case ends: the run's holders change in the
// middle of a chain, a chain's record is freed, or freed and reused by another block.
TEST(Index, walk_fast_loop_stops_where_it_must) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker(), c = ix.AddWorker();
  ApplyCounts cnt;
  const uint32_t n = 100;
  auto x = Range(7u << 20, n * 16);
  std::vector<uint64_t> ah, bh;
  for (uint32_t i = 0; i < n; ++i) ah.push_back(10000 + i);
  for (uint32_t i = 0; i < 60; ++i) bh.push_back(20000 + i);
  ix.Apply(a, StoredEv(ah, std::nullopt, x), &cnt);  // one chain of 100 records
  EXPECT_EQ(Match(ix, Keys(x)).blocks[a], n);
  ix.Apply(b, StoredEv(bh, std::nullopt, std::vector<uint32_t>(x.begin(), x.begin() + 60 * 16)),
           &cnt);  // the run's holders change at block 60, in the middle of the chain
  auto m = Match(ix, Keys(x));
  EXPECT_TRUE(m.blocks[a] == n && m.blocks[b] == 60u && m.blocks[c] == 0u);
  ix.Apply(a, RemovedEv({10000 + 80}), &cnt);  // block 80's record is freed
  m = Match(ix, Keys(x));
  EXPECT_TRUE(m.blocks[a] == 80u && m.blocks[b] == 60u);
  const auto y = Range(9u << 20, 16);
  ix.Apply(c, StoredEv({30000}, std::nullopt, y), &cnt);  // reuses that record for another key
  m = Match(ix, Keys(x));
  EXPECT_TRUE(m.blocks[a] == 80u && m.blocks[b] == 60u && m.blocks[c] == 0u);
  EXPECT_EQ(Match(ix, Keys(y)).blocks[c], 1u);
  auto longer = x;  // the prompt goes on past what anyone holds
  const auto tail = Range(11u << 20, 40 * 16);
  longer.insert(longer.end(), tail.begin(), tail.end());
  m = Match(ix, Keys(longer));
  EXPECT_TRUE(m.blocks[a] == 80u && m.blocks[b] == 60u);
  m = Match(ix, Keys(std::vector<uint32_t>(x.begin(), x.begin() + 70 * 16)));
  EXPECT_TRUE(m.blocks[a] == 70u && m.blocks[b] == 60u && m.max_blocks == 70u);
}

TEST(Index, held_credit_lasts_until_released_then_ttl) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  const auto keys = Keys(Range(0, 64));
  const uint64_t id = ix.AddSpeculative(a, keys.data(), 4, 1.0, 2.0, /*hold=*/true);
  ASSERT_NE(id, 0u);
  EXPECT_EQ(ix.SpeculativeHeld(), 1u);
  ix.ExpireSpeculative(100.0);  // far past the ttl: a held credit stays
  EXPECT_EQ(Match(ix, keys, 100).blocks[a], 4u);
  EXPECT_TRUE(ix.ReleaseSpeculative(id, 2.0));  // expires at 100 + 2
  EXPECT_FALSE(ix.ReleaseSpeculative(id, 2.0));
  EXPECT_EQ(ix.SpeculativeHeld(), 0u);
  EXPECT_EQ(Match(ix, keys, 101.5).blocks[a], 4u);
  EXPECT_EQ(Match(ix, keys, 102.5).blocks[a], 0u);
  ix.ExpireSpeculative(102.5);
  EXPECT_EQ(ix.SpeculativeEntries(), 0u);
  // A removed worker's held credits go with it; releasing one later is a no-op.
  const uint64_t held_b = ix.AddSpeculative(b, keys.data(), 3, 103.0, 2.0, true);
  EXPECT_EQ(ix.AddSpeculative(b, keys.data(), 0, 103.0, 2.0, true), 0u);
  ix.RemoveWorker(b);
  EXPECT_EQ(ix.SpeculativeHeld(), 0u);
  EXPECT_EQ(ix.SpeculativeEntries(), 0u);
  EXPECT_FALSE(ix.ReleaseSpeculative(held_b, 2.0));
}

TEST(Index, speculative) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  const auto keys = Keys(Range(0, 80));  // 5 blocks
  ApplyCounts c;
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32)), &c);
  ix.AddSpeculative(b, keys.data(), 3, 10.0, 2.0);      // b: blocks 0..2 until t=12
  ix.AddSpeculative(a, keys.data() + 2, 3, 10.0, 2.0);  // a: blocks 2..4 on top of real 0..1
  EXPECT_EQ(ix.SpeculativeEntries(), 6u);
  auto m = Match(ix, keys, 11.0);
  EXPECT_EQ(m.blocks[a], 5u);
  EXPECT_EQ(m.blocks[b], 3u);
  EXPECT_TRUE(m.weighted[b] == 3.0);
  EXPECT_EQ(m.max_blocks, 5u);
  // A prompt that diverges after block 1 matches only the common part of b's run.
  auto div = Range(0, 80);
  div[40] = 99999;
  m = Match(ix, Keys(div), 11.0);
  EXPECT_EQ(m.blocks[b], 2u);
  // now < 0: the latest clock value seen (10) is used.
  EXPECT_EQ(Match(ix, keys).blocks[b], 3u);
  // Expired at now >= expiry.
  m = Match(ix, keys, 12.0);
  EXPECT_EQ(m.blocks[b], 0u);
  EXPECT_EQ(m.blocks[a], 2u);
  ix.ExpireSpeculative(12.0);
  EXPECT_EQ(ix.SpeculativeEntries(), 0u);
  // ttl <= 0 or n == 0: nothing; unknown worker: nothing.
  ix.AddSpeculative(b, keys.data(), 3, 13.0, 0.0);
  ix.AddSpeculative(b, keys.data(), 0, 13.0, 1.0);
  ix.AddSpeculative(777, keys.data(), 3, 13.0, 1.0);
  EXPECT_EQ(ix.SpeculativeEntries(), 0u);
  // A real store of the same blocks keeps matching after the credit expires.
  ix.AddSpeculative(b, keys.data(), 1, 14.0, 1.0);
  ix.Apply(b, StoredEv({7}, std::nullopt, Range(0, 16)), &c);
  EXPECT_EQ(Match(ix, keys, 14.5).blocks[b], 1u);
  EXPECT_EQ(Match(ix, keys, 20.0).blocks[b], 1u);
  EXPECT_TRUE(ix.MemoryBytes() > 0);
  // Two credits of one worker from the same block: the longer one counts, whichever comes first.
  Index iy(IndexOptions{});
  const WorkerId x = iy.AddWorker();
  iy.AddSpeculative(x, keys.data(), 2, 1.0, 10.0);
  iy.AddSpeculative(x, keys.data(), 5, 1.0, 10.0);
  iy.AddSpeculative(x, keys.data(), 3, 1.0, 10.0);
  m = Match(iy, keys, 2.0);
  EXPECT_EQ(m.blocks[x], 5u);
  EXPECT_TRUE(m.weighted[x] == 5.0);
  // ... until it expires.
  iy.AddSpeculative(x, keys.data(), 4, 3.0, 0.5);  // expires at 3.5, the others at 11
  EXPECT_EQ(Match(iy, keys, 3.2).blocks[x], 5u);
  EXPECT_EQ(Match(iy, keys, 11.5).blocks[x], 0u);

  // The cap on live credited blocks: the oldest credits go first, counted; a longer credit
  // keeps its first blocks; 0 = none.
  IndexOptions capped;
  capped.max_speculative_blocks = 6;
  Index iz(capped);
  const WorkerId p = iz.AddWorker(), q = iz.AddWorker();
  const auto many = Keys(Range(0, 16 * 20));
  iz.AddSpeculative(p, many.data(), 3, 1.0, 10.0);      // p: 0..2
  iz.AddSpeculative(q, many.data() + 5, 3, 1.0, 10.0);  // q: 5..7
  EXPECT_EQ(iz.SpeculativeEntries(), 6u);
  iz.AddSpeculative(q, many.data() + 10, 2, 1.0, 10.0);  // p's credit leaves
  EXPECT_EQ(iz.SpeculativeEntries(), 5u);
  EXPECT_EQ(iz.SpeculativeDropped(), 1u);
  EXPECT_EQ(Match(iz, many, 2.0).blocks[p], 0u);
  iz.AddSpeculative(p, many.data(), 9, 1.0, 10.0);  // longer than the cap: 0..5, alone
  EXPECT_EQ(iz.SpeculativeEntries(), 6u);
  EXPECT_EQ(iz.SpeculativeDropped(), 3u);
  auto mz = Match(iz, many, 2.0);
  EXPECT_EQ(mz.blocks[p], 6u);
  EXPECT_EQ(mz.blocks[q], 0u);
  IndexOptions uncapped;
  uncapped.max_speculative_blocks = 0;
  Index iu(uncapped);
  const WorkerId u = iu.AddWorker();
  for (int k = 0; k < 10; ++k) iu.AddSpeculative(u, many.data(), 20, 1.0, 10.0);
  EXPECT_EQ(iu.SpeculativeEntries(), 200u);
  EXPECT_EQ(iu.SpeculativeDropped(), 0u);
}

// Past a credit, the walk goes on at the nearest credit's end (no worker is at depth i in
// between): real blocks and credits that start exactly where a credit ends still count, and
// the blocks in between do not.
TEST(Index, walk_jumps_to_the_nearest_credit_end) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker(), c = ix.AddWorker(), d = ix.AddWorker();
  const WorkerId e = ix.AddWorker();
  const auto keys = Keys(Range(0, 16 * 30));  // 30 blocks
  auto hashes = [](uint64_t first, size_t n) {
    std::vector<uint64_t> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = first + i;
    return h;
  };
  auto remove = [&](WorkerId w, uint64_t first, size_t n) {
    Event rm;
    rm.type = EventType::kBlockRemoved;
    for (size_t i = 0; i < n; ++i) rm.block_hashes.push_back(IntHash(first + i));
    ApplyCounts cnt;
    ix.Apply(w, rm, &cnt);
  };
  ApplyCounts cnt;
  ix.Apply(a, StoredEv(hashes(100, 10), std::nullopt, Range(0, 16 * 10)), &cnt);  // a: 0..9
  // b: real 0..3 and 12..15 (4..11 removed), credited 4..11.
  ix.Apply(b, StoredEv(hashes(200, 16), std::nullopt, Range(0, 16 * 16)), &cnt);
  remove(b, 204, 8);
  ix.AddSpeculative(b, keys.data() + 4, 8, 1.0, 5.0);
  // c: real 0..3 and 6..9 (4, 5 removed), credited 4..5: its real blocks go on at the credit's
  // end, inside b's credit.
  ix.Apply(c, StoredEv(hashes(300, 10), std::nullopt, Range(0, 16 * 10)), &cnt);
  remove(c, 304, 2);
  ix.AddSpeculative(c, keys.data() + 4, 2, 1.0, 5.0);
  // d: real 0..3, credited 4..7 and, by a later decision, 8..19.
  ix.Apply(d, StoredEv(hashes(400, 4), std::nullopt, Range(0, 16 * 4)), &cnt);
  ix.AddSpeculative(d, keys.data() + 4, 4, 1.0, 5.0);
  ix.AddSpeculative(d, keys.data() + 8, 12, 1.0, 5.0);
  // e: no real block; credited 0..29, to the prompt's end.
  ix.AddSpeculative(e, keys.data(), 30, 1.0, 5.0);
  auto m = Match(ix, keys, 2.0);
  EXPECT_EQ(m.blocks[a], 10u);
  EXPECT_EQ(m.blocks[b], 16u);
  EXPECT_TRUE(m.weighted[b] == 16.0);
  EXPECT_EQ(m.blocks[c], 10u);
  EXPECT_EQ(m.blocks[d], 20u);
  EXPECT_EQ(m.blocks[e], 30u);
  EXPECT_EQ(m.max_blocks, 30u);
  // A worker's blocks inside another's credit, past its own holes, do not count.
  ix.Apply(a, StoredEv(hashes(150, 4), std::optional<uint64_t>(109), Range(16 * 10, 16 * 4)),
           &cnt);     // a: 10..13 (a real run 0..13)
  remove(a, 105, 1);  // hole at 5: a stops at 5 although it holds 6..13
  m = Match(ix, keys, 2.0);
  EXPECT_EQ(m.blocks[a], 5u);
  EXPECT_EQ(m.blocks[b], 16u);
  EXPECT_EQ(m.blocks[c], 10u);

  // A credit that ends inside a run of blocks the credited worker holds: the run goes on
  // without a credit lookup at every block, but it is closed where the credit ends, and the
  // worker joins it there. x and y hold 0..9 with y's hole at 2; y is credited 2..4.
  Index iy(IndexOptions{});
  const WorkerId x = iy.AddWorker(), y = iy.AddWorker();
  ApplyCounts c2;
  iy.Apply(x, StoredEv(hashes(100, 10), std::nullopt, Range(0, 16 * 10)), &c2);
  iy.Apply(y, StoredEv(hashes(200, 10), std::nullopt, Range(0, 16 * 10)), &c2);
  Event rm;
  rm.type = EventType::kBlockRemoved;
  rm.block_hashes.push_back(IntHash(202));
  iy.Apply(y, rm, &c2);
  iy.AddSpeculative(y, keys.data() + 2, 3, 1.0, 5.0);
  m = Match(iy, keys, 2.0);
  EXPECT_EQ(m.blocks[x], 10u);
  EXPECT_EQ(m.blocks[y], 10u);  // 0..1 real, 2..4 credited, 5..9 real (the run of x and y)
  EXPECT_TRUE(m.weighted[y] == 10.0);
  // Its credit expired: y stops at its hole.
  EXPECT_EQ(Match(iy, keys, 6.0).blocks[y], 2u);
  // More credit ends in one walk than the walk keeps: 17 workers credited from block 0, to
  // block 4 and to blocks 11..26, then y's to 5 (the 18th end, past the 4th): runs are closed
  // at every block up to the deepest credit, the same match.
  iy.AddSpeculative(y, keys.data() + 2, 3, 7.0, 5.0);
  std::vector<WorkerId> many;
  for (uint32_t k = 0; k < 17; ++k) {
    many.push_back(iy.AddWorker());
    iy.AddSpeculative(many.back(), keys.data(), k == 0 ? 4 : k + 10, 7.0, 5.0);
  }
  m = Match(iy, keys, 8.0);
  EXPECT_EQ(m.blocks[x], 10u);
  EXPECT_EQ(m.blocks[y], 10u);
  EXPECT_TRUE(m.weighted[y] == 10.0);
  for (uint32_t k = 0; k < 17; ++k) EXPECT_EQ(m.blocks[many[k]], k == 0 ? 4u : k + 10);
}

// The walk against the per-block definition (tests/test_match_model.py's, at sizes it does not
// reach): 24 workers, prompts of up to 80 blocks that share prefixes, chains stored on random
// tiers with holes, and up to 96 credits (in some walks more ends than the walk keeps), some
// expired. Per worker: at block i, a worker holding it advances by one (credit: GPU, else the
// better of CPU and disk); else its longest unexpired credit whose first key is block i's
// advances it by the common prefix with the prompt (GPU); else it stops.
TEST(Index, walk_equals_per_block_definition_randomized) {
  std::mt19937_64 rng(2026);
  constexpr size_t kBs = 4;
  constexpr WorkerId kWorkers = 24;
  const double tier_w[3] = {1.0, 0.8, 0.25};
  // Prompts: a base of 80 blocks and variants that leave it at a random block.
  std::vector<uint32_t> base;
  for (size_t b = 0; b < 80; ++b) {
    for (size_t j = 0; j < kBs; ++j) base.push_back(static_cast<uint32_t>(1000 * (b + 1) + j));
  }
  auto variant = [&]() {
    std::vector<uint32_t> t(base.begin(), base.begin() + kBs * (rng() % 80 + 1));
    if (rng() % 3 != 0) {
      const size_t from = rng() % (t.size() / kBs);
      const uint32_t salt = static_cast<uint32_t>(rng() % 4 + 1);
      for (size_t k = from * kBs; k < t.size(); ++k) t[k] += 100000 * salt;
    }
    return t;
  };
  size_t credited_walks = 0, walks_past_kept_ends = 0;  // the cases the test must reach
  for (int round = 0; round < 40; ++round) {
    IndexOptions o;
    o.block_size = kBs;
    Index ix(o);
    for (WorkerId w = 0; w < kWorkers; ++w) ix.AddWorker();
    uint64_t next_hash = 1;
    ApplyCounts cnt;
    for (int s = 0; s < 60; ++s) {
      const WorkerId w = static_cast<WorkerId>(rng() % kWorkers);
      const auto toks = variant();
      const size_t nb = toks.size() / kBs;
      std::vector<uint64_t> hs(nb);
      for (auto& h : hs) h = next_hash++;
      const Medium tier = static_cast<Medium>(rng() % 3);
      ix.Apply(w, StoredEv(hs, std::nullopt, toks, kBs, tier), &cnt);
      if (rng() % 2) {  // a hole
        const uint64_t h = hs[rng() % nb];
        ix.Apply(w, RemovedEv({h}, tier), &cnt);
      }
    }
    // What each worker holds, by key: the mask of tiers with references.
    std::map<std::pair<WorkerId, BlockKey>, int> held;
    for (WorkerId w = 0; w < kWorkers; ++w) {
      for (const auto& e : ix.WorkerEntries(w)) {
        int mask = 0;
        for (int t = 0; t < 3; ++t) mask |= e.refs[t] > 0 ? 1 << t : 0;
        if (mask != 0) held[{w, e.key}] |= mask;
      }
    }
    struct Credit {
      WorkerId w;
      std::vector<BlockKey> keys;
      double expiry;
    };
    std::vector<Credit> credits;
    // The definition: blocks and weight w matches of `keys` at time `now`; `applied` counts
    // the credits that moved it.
    auto reference = [&](WorkerId w, const std::vector<BlockKey>& keys, double now,
                         size_t* applied) {
      size_t i = 0;
      double wt = 0;
      while (i < keys.size()) {
        auto h = held.find({w, keys[i]});
        if (h != held.end()) {
          const int m = h->second;
          wt +=
              (m & 1) ? tier_w[0] : std::max((m & 2) ? tier_w[1] : 0.0, (m & 4) ? tier_w[2] : 0.0);
          ++i;
          continue;
        }
        size_t best = 0;
        for (const Credit& c : credits) {
          if (c.w != w || c.expiry <= now || c.keys[0] != keys[i]) continue;
          size_t m = 0;
          while (m < c.keys.size() && i + m < keys.size() && c.keys[m] == keys[i + m]) ++m;
          best = std::max(best, m);
        }
        if (best == 0) break;
        i += best;
        wt += static_cast<double>(best);
        ++*applied;
      }
      return std::make_pair(i, wt);
    };
    // Credits as the router gives them (a prompt's blocks from the chosen worker's match on),
    // and a third from a random block.
    const int ncredits = static_cast<int>(rng() % 97);
    for (int c = 0; c < ncredits; ++c) {
      const auto keys = Keys(rng() % 2 ? base : variant(), kBs);
      const WorkerId w = static_cast<WorkerId>(rng() % kWorkers);
      size_t from = rng() % keys.size();
      if (rng() % 3 != 0) {
        size_t unused = 0;
        from = reference(w, keys, 1.0, &unused).first;
        if (from == keys.size()) continue;
      }
      const size_t len = 1 + rng() % (keys.size() - from);
      const double ttl = rng() % 4 == 0 ? 0.5 : 5.0;  // 0.5: expired at the probes' clock
      ix.AddSpeculative(w, keys.data() + from, len, 1.0, ttl);
      credits.push_back(
          {w, std::vector<BlockKey>(keys.begin() + from, keys.begin() + from + len), 1.0 + ttl});
    }
    for (int probe = 0; probe < 8; ++probe) {
      const auto keys = Keys(probe == 0 ? base : variant(), kBs);
      const MatchResult got = Match(ix, keys, 2.0);
      size_t applied = 0;  // credits that moved a worker in this walk
      for (WorkerId w = 0; w < kWorkers; ++w) {
        const auto [blocks, wt] = reference(w, keys, 2.0, &applied);
        EXPECT_EQ(got.blocks[w], blocks);
        EXPECT_TRUE(std::abs(got.weighted[w] - wt) < 1e-9);
      }
      credited_walks += applied > 0 ? 1 : 0;
      walks_past_kept_ends += applied > 16 ? 1 : 0;
    }
  }
  EXPECT_TRUE(credited_walks > 50);
  EXPECT_TRUE(walks_past_kept_ends > 0);
}

// The walk hashes lazily (BlockKeyStream): a walk over a stream equals the walk over all keys
// computed first (real entries with holes and tier changes, speculative credits longer than the
// look-ahead, prompts past the end of the match, a partial last block).
TEST(Index, walk_over_a_key_stream_equals_walk_over_keys) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker(), c = ix.AddWorker();
  const auto toks = Range(0, 16 * 300 + 7);
  const auto keys = Keys(toks);
  auto hashes = [](uint64_t first, size_t n) {
    std::vector<uint64_t> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = first + i;
    return h;
  };
  ApplyCounts cnt;
  ix.Apply(a, StoredEv(hashes(1000, 200), std::nullopt, Range(0, 16 * 200)), &cnt);
  ix.Apply(b, StoredEv(hashes(2000, 40), std::nullopt, Range(0, 16 * 40)), &cnt);
  ix.Apply(c, StoredEv(hashes(3000, 90), std::nullopt, Range(0, 16 * 90), 16, Medium::kCpu), &cnt);
  // a hole in a's blocks: a matches 0..119 only
  Event rm;
  rm.type = EventType::kBlockRemoved;
  rm.block_hashes.push_back(IntHash(1000 + 120));
  ix.Apply(a, rm, &cnt);
  ix.AddSpeculative(b, keys.data() + 40, 150, 1.0, 5.0);  // b: 40..189 ahead of its real blocks
  ix.AddSpeculative(c, keys.data() + 90, 3, 1.0, 5.0);
  for (size_t cut : {size_t{0}, size_t{1}, size_t{33}, size_t{100}, size_t{250}, keys.size()}) {
    MatchResult want, got;
    ix.FindMatches(keys.data(), cut, &want, 2.0);
    std::vector<BlockKey> buf;
    BlockKeyStream st(ChainRoot(""), toks.data(), cut * 16, 16, nullptr, &buf);
    ix.FindMatches(&st, &got, 2.0);
    EXPECT_TRUE(want.blocks == got.blocks);
    EXPECT_TRUE(want.weighted == got.weighted);
    EXPECT_EQ(want.max_blocks, got.max_blocks);
    for (size_t i = 0; i < st.ready(); ++i) EXPECT_EQ(buf[i], keys[i]);
    // The walk stops hashing soon after the deepest match (look-ahead of 32 blocks + a step).
    if (cut >= 250) {
      EXPECT_EQ(got.blocks[a], 120u);  // real 0..119 (block 120 removed)
      EXPECT_EQ(got.blocks[b], 190u);  // real 0..39, then its credit 40..189
      EXPECT_EQ(got.blocks[c], 93u);   // real 0..89 on CPU, then its credit 90..92
      EXPECT_TRUE(std::abs(got.weighted[c] - (90 * 0.8 + 3.0)) < 1e-9);
      EXPECT_TRUE(st.ready() < 190 + 48);
    }
  }
}

}  // namespace
