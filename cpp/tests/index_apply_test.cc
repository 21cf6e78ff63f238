// Tests of Index's events in (cpp/index/index.cc): stores, removals, reference counts and
// tiers, caps, clears and removed workers, LoRA and extra keys, spec kinds and KV-cache groups,
// and table growth while workers store and a reader looks up.
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

// Two workers store long chains at once while a third thread looks up: the tables grow many
// times (outside the write lock, swapped in under it), and every chain must end up whole.
TEST(Index, grows_its_tables_while_two_workers_store_and_one_reads) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  const uint32_t kChains = 40, kBlocks = 300;  // 24,000 blocks: ~17 growths of each table
  std::atomic<bool> done{false};
  std::atomic<uint64_t> lookups{0};
  std::thread reader([&] {
    const auto probe = Range(7, kBlocks * 16);
    const auto keys = Keys(probe);
    MatchResult m;
    while (!done.load()) {
      ix.FindMatches(keys.data(), keys.size(), &m);
      lookups.fetch_add(1);
    }
  });
  auto store = [&](WorkerId w, uint32_t base) {
    ApplyCounts c;
    for (uint32_t k = 0; k < kChains; ++k) {
      const uint32_t first = base + k * kBlocks * 16;
      std::vector<uint64_t> hashes(kBlocks);
      for (uint32_t i = 0; i < kBlocks; ++i)
        hashes[i] = uint64_t{base} * 1000 + k * kBlocks + i + 1;
      ix.Apply(w, StoredEv(hashes, std::nullopt, Range(first, kBlocks * 16)), &c);
    }
    EXPECT_EQ(c.blocks_stored, uint64_t{kChains} * kBlocks);
  };
  // The writers start once the reader is reading (on a loaded machine the stores, ~3 ms, could
  // otherwise end before the reader thread first runs).
  while (lookups.load() == 0) std::this_thread::yield();
  std::thread ta([&] { store(a, 1000); });
  std::thread tb([&] { store(b, 50000000); });
  ta.join();
  tb.join();
  done.store(true);
  reader.join();
  EXPECT_TRUE(lookups.load() > 0);
  EXPECT_EQ(ix.DistinctKeys(), uint64_t{2} * kChains * kBlocks);
  EXPECT_EQ(ix.Entries(), uint64_t{2} * kChains * kBlocks);
  EXPECT_EQ(ix.WorkerBlocks(a), uint64_t{kChains} * kBlocks);
  for (const auto& [w, base] : {std::pair{a, 1000u}, std::pair{b, 50000000u}}) {
    for (uint32_t k = 0; k < kChains; k += 7) {
      const auto m = Match(ix, Keys(Range(base + k * kBlocks * 16, kBlocks * 16)));
      EXPECT_EQ(m.blocks[w], kBlocks);
    }
  }
}

TEST(Index, store_chain_and_match) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  EXPECT_EQ(a, 0u);
  EXPECT_EQ(b, 1u);
  const auto toks = Range(100, 64);  // 4 blocks
  const auto keys = Keys(toks);
  ApplyCounts ca, cb;
  ix.Apply(a, StoredEv({11, 12, 13}, std::nullopt, Range(100, 48)), &ca);
  ix.Apply(b, StoredEv({21, 22}, std::nullopt, Range(100, 32)), &cb);
  EXPECT_EQ(ca.blocks_stored, 3u);
  EXPECT_EQ(ca.events, 1u);
  auto m = Match(ix, keys);
  EXPECT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.blocks[a], 3u);
  EXPECT_EQ(m.blocks[b], 2u);
  EXPECT_TRUE(m.weighted[a] == 3.0);
  EXPECT_EQ(m.max_blocks, 3u);
  // Continue a's chain from its last engine hash.
  ix.Apply(a, StoredEv({14}, 13, Range(148, 16)), &ca);
  m = Match(ix, keys);
  EXPECT_EQ(m.blocks[a], 4u);
  EXPECT_EQ(ix.DistinctKeys(), 4u);
  EXPECT_EQ(ix.Entries(), 6u);
  EXPECT_EQ(ix.WorkerBlocks(a), 4u);
  EXPECT_EQ(ix.WorkerBlocks(b), 2u);
  // A different first block matches nothing, even if later blocks are equal.
  auto other = Range(100, 64);
  other[0] = 5;
  m = Match(ix, Keys(other));
  EXPECT_EQ(m.max_blocks, 0u);
  // Removing a middle block ends a's prefix there.
  ix.Apply(a, RemovedEv({12}), &ca);
  EXPECT_EQ(ca.blocks_removed, 1u);
  m = Match(ix, keys);
  EXPECT_EQ(m.blocks[a], 1u);
  EXPECT_EQ(m.blocks[b], 2u);
  EXPECT_EQ(m.max_blocks, 2u);
  // WorkerEntries: 3 hashes left on a, each one GPU ref.
  auto ents = ix.WorkerEntries(a);
  EXPECT_EQ(ents.size(), 3u);
  for (const auto& e : ents) EXPECT_TRUE(e.refs[0] == 1 && e.refs[1] == 0 && e.refs[2] == 0);
}

TEST(Index, orphans_and_apply_time_drops) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  ix.Apply(a, StoredEv({1, 2}, 999, Range(0, 32)), &c);  // parent unknown
  EXPECT_EQ(c.orphan_stores, 2u);
  EXPECT_EQ(ix.WorkerBlocks(a), 0u);
  ix.Apply(a, StoredEv({1}, std::nullopt, Range(0, 32), 32), &c);  // block size 32 != 16
  EXPECT_EQ(c.drops.Get(DropReason::kBlockSizeMismatch), 1u);
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 31)), &c);  // 31 tokens for 2 blocks
  EXPECT_EQ(c.drops.Get(DropReason::kBadTokenCount), 1u);
  Event sw = StoredEv({1}, std::nullopt, Range(0, 16));
  sw.kv_cache_spec_kind = "sliding_window";
  ix.Apply(a, sw, &c);
  EXPECT_EQ(c.drops.Get(DropReason::kUnsupportedSpec), 1u);
  Event fa = StoredEv({1}, std::nullopt, Range(0, 16));
  fa.kv_cache_spec_kind = "full_attention";
  fa.medium_known = false;
  ix.Apply(a, fa, &c);
  EXPECT_EQ(c.unknown_medium, 1u);
  EXPECT_EQ(ix.WorkerBlocks(a), 1u);
  EXPECT_EQ(c.events, 5u);
  ix.Apply(a, RemovedEv({777}), &c);
  EXPECT_EQ(c.unknown_removes, 1u);
}

TEST(Index, refcounts_and_tiers) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  const auto keys = Keys(Range(0, 16));
  ApplyCounts c;
  // A block filled twice at once (vLLM does not de-duplicate two copies): two removes.
  ix.Apply(a, StoredEv({4}, std::nullopt, Range(100, 16)), &c);
  ix.Apply(a, StoredEv({5}, 4, Range(0, 16)), &c);
  ix.Apply(a, StoredEv({5}, 4, Range(0, 16)), &c);
  const auto keys2 = Keys(Cat(Range(100, 16), Range(0, 16)));
  ix.Apply(a, RemovedEv({5}), &c);
  EXPECT_EQ(Match(ix, keys2).blocks[a], 2u);
  ix.Apply(a, RemovedEv({5}), &c);
  EXPECT_EQ(Match(ix, keys2).blocks[a], 1u);
  ix.Apply(a, RemovedEv({5}), &c);
  EXPECT_EQ(c.unknown_removes, 1u);
  ix.Apply(a, RemovedEv({4}), &c);
  EXPECT_EQ(ix.Entries(), 0u);
  EXPECT_EQ(ix.DistinctKeys(), 0u);

  // GPU + CPU copies; the best tier is credited.
  ix.Apply(a, StoredEv({6}, std::nullopt, Range(0, 16)), &c);
  Event cpu = StoredEv({6}, std::nullopt, {}, 0, Medium::kCpu);  // CPU placeholder
  ix.Apply(a, cpu, &c);
  auto m = Match(ix, keys);
  EXPECT_TRUE(m.weighted[a] == 1.0);
  ix.Apply(a, RemovedEv({6}, Medium::kGpu), &c);
  m = Match(ix, keys);
  EXPECT_EQ(m.blocks[a], 1u);
  EXPECT_TRUE(std::fabs(m.weighted[a] - 0.8) < 1e-12);
  auto ents = ix.WorkerEntries(a);
  EXPECT_TRUE(ents.size() == 1 && ents[0].refs[0] == 0 && ents[0].refs[1] == 1);
  ix.Apply(a, StoredEv({6}, std::nullopt, Range(0, 16), 16, Medium::kDisk), &c);
  ix.Apply(a, RemovedEv({6}, Medium::kCpu), &c);
  m = Match(ix, keys);
  EXPECT_TRUE(std::fabs(m.weighted[a] - 0.25) < 1e-12);
  ix.Apply(a, RemovedEv({6}, Medium::kDisk), &c);
  EXPECT_EQ(Match(ix, keys).blocks[a], 0u);
  EXPECT_EQ(ix.WorkerBlocks(a), 0u);
  // Placeholder for an unknown hash: an orphan, nothing indexed.
  const uint64_t before = c.orphan_stores;
  ix.Apply(a, cpu, &c);
  EXPECT_EQ(c.orphan_stores, before + 1);
  EXPECT_EQ(ix.Entries(), 0u);
}

// Reference counts per (engine hash, tier) against a model, through the engine slot's two
// forms: one tier bit per tier, and exact counts in the side map once a tier holds the same
// engine hash twice (kRefsMany), and back.
TEST(Index, refcounts_match_a_model) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  const Medium tiers[kNumMedia] = {Medium::kGpu, Medium::kCpu, Medium::kDisk};
  constexpr uint64_t kHashes = 6;
  std::array<std::array<uint32_t, kNumMedia>, kHashes> model{};
  std::mt19937_64 rng(21);
  ApplyCounts c;
  uint64_t unknown = 0;
  ix.Apply(a, StoredEv({99}, std::nullopt, Range(5000, 16)), &c);
  for (int step = 0; step < 20000; ++step) {
    const uint64_t h = rng() % kHashes;
    const int t = static_cast<int>(rng() % kNumMedia);
    if (rng() % 100 < 52) {  // slightly more stores than removes: counts reach 3-5
      // Continuations of a root block (a run from token 0 the worker holds is a re-report).
      ix.Apply(a, StoredEv({100 + h}, 99, Range(static_cast<uint32_t>(h) * 16, 16), 16, tiers[t]),
               &c);
      ++model[h][t];
    } else {
      ix.Apply(a, RemovedEv({100 + h}, tiers[t]), &c);
      if (model[h][t] == 0) {
        ++unknown;
      } else {
        --model[h][t];
      }
    }
    if (step % 7 != 0) continue;
    EXPECT_EQ(c.unknown_removes, unknown);
    uint64_t held = 0;
    for (const auto& m : model) held += (m[0] + m[1] + m[2]) > 0;
    EXPECT_EQ(ix.Entries(), held + 1);  // + the root
    EXPECT_EQ(ix.WorkerBlocks(a), held + 1);
    for (const auto& e : ix.WorkerEntries(a)) {
      if (e.hash.lo == 99) continue;
      const uint64_t i = e.hash.lo - 100;
      EXPECT_TRUE(i < kHashes);
      if (i >= kHashes) continue;
      for (int k = 0; k < kNumMedia; ++k) EXPECT_EQ(uint32_t{e.refs[k]}, model[i][k]);
    }
    // The match credits the best tier that holds the block.
    const uint64_t i = rng() % kHashes;
    const auto m = Match(ix, Keys(Cat(Range(5000, 16), Range(static_cast<uint32_t>(i) * 16, 16))));
    const double want = model[i][0] > 0   ? 1.0
                        : model[i][1] > 0 ? 0.8
                        : model[i][2] > 0 ? 0.25
                                          : 0.0;
    EXPECT_TRUE(std::fabs(m.weighted[a] - 1.0 - want) < 1e-12);  // the root: 1.0
  }
}

// The total cap evicts from the largest worker even if that worker has no store stamps yet
// (it stored only before the index was half-way to the cap): its entries count as equally old.
TEST(Index, total_cap_evicts_a_worker_without_stamps) {
  IndexOptions o;
  o.max_blocks_total = 100;
  o.order_from_start_below = 0;  // stamps only from half-way, as under the default caps
  Index ix(o);
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker(), d = ix.AddWorker();
  ApplyCounts c;
  auto store = [&](WorkerId w, uint64_t first, uint32_t n) {
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t tok = static_cast<uint32_t>(first + i) * 16;
      ix.Apply(w, StoredEv({first + i}, std::nullopt, Range(tok, 16)), &c);
    }
  };
  store(a, 1000, 49);  // under half of the cap: a never gets stamps from its own stores
  store(b, 2000, 30);
  store(d, 3000, 30);  // 109 entries: 9 go, from a, the largest
  EXPECT_EQ(ix.Entries(), 100u);
  EXPECT_EQ(ix.WorkerBlocks(a), 40u);
  EXPECT_EQ(ix.WorkerEvictedByCap(a), 9u);
  EXPECT_EQ(ix.WorkerBlocks(b), 30u);
  EXPECT_EQ(ix.WorkerBlocks(d), 30u);
  EXPECT_EQ(ix.WorkerEvictedByCap(b) + ix.WorkerEvictedByCap(d), 0u);
}

TEST(Index, hash_rebound) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  ix.Apply(a, StoredEv({5}, std::nullopt, Range(0, 16)), &c);
  ix.Apply(a, StoredEv({5}, std::nullopt, Range(1000, 16)), &c);
  EXPECT_EQ(c.hash_rebound, 1u);
  EXPECT_EQ(Match(ix, Keys(Range(0, 16))).blocks[a], 0u);
  EXPECT_EQ(Match(ix, Keys(Range(1000, 16))).blocks[a], 1u);
  EXPECT_EQ(ix.DistinctKeys(), 1u);
  ix.Apply(a, RemovedEv({5}), &c);
  EXPECT_EQ(ix.DistinctKeys(), 0u);
}

TEST(Index, lora_and_extra_keys) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  Event e = StoredEv({1}, std::nullopt, Range(0, 16));
  e.lora_name = "adapter";
  ix.Apply(a, e, &c);
  Event li = StoredEv({2}, std::nullopt, Range(0, 16));
  li.has_lora_id = true;
  li.lora_id = 3;
  ix.Apply(a, li, &c);
  EXPECT_EQ(Match(ix, Keys(Range(0, 16))).max_blocks, 0u);
  EXPECT_EQ(Match(ix, Keys(Range(0, 16), 16, "adapter")).blocks[a], 1u);
  EXPECT_EQ(Match(ix, Keys(Range(0, 16), 16, "#lora_id:3")).blocks[a], 1u);
  Event x = StoredEv({3, 4}, std::nullopt, Range(0, 32));
  const std::string salt = Enc(A({S("s")}));
  x.extra_keys = {salt};
  ix.Apply(a, x, &c);
  const std::vector<std::string> extras = {salt};
  EXPECT_EQ(Match(ix, Keys(Range(0, 32), 16, {}, &extras)).blocks[a], 2u);
  EXPECT_EQ(Match(ix, Keys(Range(0, 32))).blocks[a], 0u);
}

TEST(Index, clear_and_remove_worker) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  const auto keys = Keys(Range(0, 64));
  ApplyCounts ca, cb;
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32)), &ca);
  ix.Apply(b, StoredEv({1, 2, 3}, std::nullopt, Range(0, 48)), &cb);
  ix.AddSpeculative(a, keys.data() + 2, 2, 10.0, 5.0);
  EXPECT_EQ(Match(ix, keys, 11).blocks[a], 4u);
  ix.ClearWorker(a);
  EXPECT_EQ(ix.WorkerBlocks(a), 0u);
  auto m = Match(ix, keys, 11);
  EXPECT_EQ(m.blocks[a], 0u);  // the speculative credit starts at block 2: unreachable now
  EXPECT_EQ(m.blocks[b], 3u);
  EXPECT_EQ(ix.SpeculativeEntries(), 2u);  // kept until expiry
  // AllBlocksCleared through Apply.
  ix.Apply(b, ClearedEv(), &cb);
  EXPECT_EQ(cb.clears, 1u);
  EXPECT_EQ(ix.WorkerBlocks(b), 0u);
  EXPECT_EQ(ix.Entries(), 0u);
  // RemoveWorker: speculative credits go too; events for it are ignored; ids not reused.
  ix.Apply(a, StoredEv({1}, std::nullopt, Range(0, 16)), &ca);
  ix.RemoveWorker(a);
  EXPECT_EQ(ix.SpeculativeEntries(), 0u);
  EXPECT_EQ(ix.WorkerBlocks(a), 0u);
  EXPECT_EQ(ix.Entries(), 0u);
  ix.Apply(a, StoredEv({9}, std::nullopt, Range(0, 16)), &ca);
  EXPECT_EQ(ix.Entries(), 0u);
  EXPECT_TRUE(ix.WorkerEntries(a).empty());
  ix.RemoveWorker(a);      // twice: no-op
  ix.RemoveWorker(12345);  // unknown: no-op
  ix.ClearWorker(12345);
  const WorkerId c = ix.AddWorker();
  EXPECT_EQ(c, 2u);
  EXPECT_EQ(ix.WorkerIdLimit(), 3u);
  m = Match(ix, keys);
  EXPECT_EQ(m.blocks.size(), 3u);
}

// vLLM names a LoRA adapter in lora_name and as the first extra key of every block
// (to_event_extra_keys); the block keys leave that entry out, so a request for the adapter
// (root ChainRoot(name), its own extra keys only) matches. SGLang's salt-only extra keys and a
// name that is not the adapter's stay in.
TEST(Index, vllm_lora_name_in_extra_keys_is_left_out) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  const auto toks = Range(0, 48);
  Event e = StoredEv({1, 2, 3}, std::nullopt, toks);
  e.lora_name = "sql";
  e.extra_keys = {Enc(A({S("sql"), S("tenant")})), Enc(A({S("sql")})),
                  Enc(A({S("sql"), A({S("img"), I(-4)})}))};
  ix.Apply(a, e, &c);
  const std::vector<std::string> want = {Enc(A({S("tenant")})), "", Enc(A({A({S("img"), I(-4)})}))};
  EXPECT_EQ(Match(ix, Keys(toks, 16, "sql", &want)).blocks[a], 3u);
  EXPECT_EQ(Match(ix, Keys(toks, 16, "", &want)).blocks[a], 0u);
  // A first extra key that is not the adapter's name is kept.
  Event other = StoredEv({4}, std::nullopt, Range(100, 16));
  other.lora_name = "sql";
  other.extra_keys = {Enc(A({S("tenant")}))};
  ix.Apply(a, other, &c);
  const std::vector<std::string> salt = {Enc(A({S("tenant")}))};
  EXPECT_EQ(Match(ix, Keys(Range(100, 16), 16, "sql", &salt)).blocks[a], 1u);
}

TEST(Index, mla_and_sink_kinds_are_full_attention_unknown_kinds_dropped) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  const char* kinds[] = {"full_attention", "mla_attention", "sink_full_attention"};
  for (uint32_t k = 0; k < 3; ++k) {
    Event e = StoredEv({10 + k}, std::nullopt, Range(1000 * k, 16));
    e.kv_cache_spec_kind = kinds[k];
    ix.Apply(a, e, &c);
    EXPECT_EQ(Match(ix, Keys(Range(1000 * k, 16))).blocks[a], 1u) << kinds[k];
  }
  for (const char* kind : {"sliding_window", "mamba", "chunked_local_attention", "future_kind"}) {
    Event e = StoredEv({20}, std::nullopt, Range(5000, 16));
    e.kv_cache_spec_kind = kind;
    ix.Apply(a, e, &c);
    EXPECT_EQ(Match(ix, Keys(Range(5000, 16))).blocks[a], 0u) << kind;
  }
  EXPECT_EQ(c.drops.Get(DropReason::kUnsupportedSpec), 4u);
  EXPECT_EQ(ix.WorkerBlocks(a), 3u);
}

// A hybrid model publishes the same block hashes in each KV-cache group, told apart by
// group_idx; only the full-attention groups are indexed, and a remove in another group (known
// from its stores' spec kind) leaves the full-attention entry. Either group order.
TEST(Index, hybrid_other_group_removes_leave_full_attention) {
  for (const int64_t full : {0, 1}) {
    Index ix(IndexOptions{});
    const WorkerId a = ix.AddWorker();
    ApplyCounts c;
    const auto toks = Range(0, 64);
    Event fa = StoredEv({1, 2, 3, 4}, std::nullopt, toks);
    fa.group_idx = full;
    fa.kv_cache_spec_kind = "full_attention";
    Event sw = fa;
    sw.group_idx = 1 - full;
    sw.kv_cache_spec_kind = "sliding_window";
    sw.has_sliding_window = true;
    sw.sliding_window = 32;
    ix.Apply(a, fa, &c);
    ix.Apply(a, sw, &c);
    Event rm = RemovedEv({1, 2, 3, 4});
    rm.group_idx = 1 - full;
    ix.Apply(a, rm, &c);
    EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 4u);
    EXPECT_EQ(c.unknown_removes, 0u);
    EXPECT_EQ(c.drops.Get(DropReason::kUnsupportedSpec), 2u);  // the group's store and remove
    Event rm_fa = RemovedEv({3, 4});
    rm_fa.group_idx = full;
    ix.Apply(a, rm_fa, &c);
    EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 2u);
    // The group stays known across a clear (a property of the model).
    ix.Apply(a, ClearedEv(), &c);
    ix.Apply(a, fa, &c);
    ix.Apply(a, rm, &c);
    EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 4u);
  }
}

// vLLM's kv_cache_report_mode "full" re-sends a prefix hit as a store from token 0 of blocks
// the worker holds: no reference is added, so one remove per block evicts it. A run from token
// 0 with a block not yet held (or held on another tier) adds references as before.
TEST(Index, rereported_run_adds_no_reference) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  const auto toks = Range(0, 48);
  ix.Apply(a, StoredEv({1, 2, 3}, std::nullopt, toks), &c);
  ix.Apply(a, StoredEv({1, 2, 3}, std::nullopt, toks), &c);
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32)), &c);
  EXPECT_EQ(c.blocks_rereported, 5u);
  EXPECT_EQ(c.blocks_stored, 3u);
  ix.Apply(a, RemovedEv({3}), &c);
  EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 2u);
  ix.Apply(a, RemovedEv({1, 2}), &c);
  EXPECT_EQ(ix.WorkerBlocks(a), 0u);
  EXPECT_EQ(c.unknown_removes, 0u);
  // Not a re-report: block 2 is new, so block 1 gets a second reference.
  ix.Apply(a, StoredEv({1}, std::nullopt, Range(0, 16)), &c);
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32)), &c);
  ix.Apply(a, RemovedEv({1}), &c);
  EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 2u);
  // Another tier of a held run: a new reference on that tier.
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32), 16, Medium::kCpu), &c);
  ix.Apply(a, RemovedEv({1, 2}, Medium::kGpu), &c);
  EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 2u);
}

}  // namespace
