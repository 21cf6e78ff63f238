// Tests of the policies (cpp/scoring/policy.h): the registry, what each policy chooses on
// hand-made candidates, and the exclusion contract (excluded candidates never chosen, scored
// as if absent; consistent_hash moves only the excluded workers' sessions).
#include <gtest/gtest.h>

#include <xxhash.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "scoring/policy.h"

using namespace kvroute;

namespace {

struct Fixture {
  ParamValues params;  // the knobs given to MakePolicy
  std::mt19937_64 rng{7};
  uint64_t rr = 0;
  ChooseContext Ctx(double prompt_blocks = 4, uint64_t session = 0) {
    ChooseContext c;
    c.prompt_blocks = prompt_blocks;
    c.session_hash = session;
    c.rng = &rng;
    c.rr_counter = &rr;
    return c;
  }
};

std::vector<Candidate> Idle(size_t n) {
  std::vector<Candidate> c(n);
  for (size_t i = 0; i < n; ++i) {
    c[i].id = static_cast<WorkerId>(i);
    const std::string name = "w" + std::to_string(i);
    c[i].name_hash = XXH3_64bits(name.data(), name.size());
  }
  return c;
}

}  // namespace

TEST(PolicyRegistry, every_name_builds_its_policy) {
  const std::string names = PolicyNames();
  size_t start = 0;
  int count = 0;
  while (start < names.size()) {
    size_t end = names.find(", ", start);
    if (end == std::string::npos) end = names.size();
    const std::string name = names.substr(start, end - start);
    auto p = MakePolicy(name);
    EXPECT_EQ(std::string(p->name()), name);
    EXPECT_EQ(std::string(PolicyNameOrThrow(name)), name);
    ++count;
    start = end + 2;
  }
  EXPECT_EQ(count, 10);
}

TEST(PolicyRegistry, unknown_name_and_bad_params_throw) {
  EXPECT_THROW(MakePolicy("longest_prefix"), std::invalid_argument);
  EXPECT_THROW(MakePolicy("kv_aware", {{"cache_weight", 1.5}}), std::invalid_argument);
  EXPECT_THROW(MakePolicy("cache_aware", {{"balance_rel_threshold", 0.5}}), std::invalid_argument);
}

// Each policy owns its knobs: another policy's knob is unknown to it, and every message
// names the policy, the knob and what was expected.
TEST(PolicyRegistry, knobs_are_each_policys_own) {
  auto message = [](const std::string& name, const ParamValues& knobs) -> std::string {
    try {
      MakePolicy(name, knobs);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(message("round_robin", {{"cache_weight", 0.5}}),
            "round_robin: unknown parameter cache_weight; its parameters: none");
  EXPECT_EQ(message("kv_aware", {{"virtual_nodes", int64_t{8}}}),
            "kv_aware: unknown parameter virtual_nodes; its parameters: cache_weight, size_aware");
  EXPECT_EQ(message("kv_aware", {{"cache_weight", 1.5}}),
            "kv_aware: cache_weight must be a number in [0, 1], got 1.5");
  EXPECT_EQ(message("consistent_hash", {{"virtual_nodes", int64_t{0}}}),
            "consistent_hash: virtual_nodes must be an int in [1, 4294967295], got 0");
  EXPECT_EQ(message("consistent_hash", {{"virtual_nodes", 1.5}}),
            "consistent_hash: virtual_nodes must be an int in [1, 4294967295], got 1.5");
  EXPECT_EQ(message("cache_aware", {{"max_tree_size", int64_t{0}}}),
            "cache_aware: max_tree_size must be an int >= 1, got 0");
  EXPECT_EQ(message("kv_aware", {{"size_aware", int64_t{1}}}),
            "kv_aware: size_aware must be true or false, got 1");
  EXPECT_EQ(message("cost", {{"temperature", int64_t{2}}}), "");  // an int for a float knob
  // Every knob of every schema resolves to its default, of its type.
  for (const PolicyDef* d : PolicyDefs()) {
    const ParamValues all = ResolvePolicyParams(d->name, {});
    EXPECT_EQ(all.size(), d->knobs.size()) << d->name;
    for (const ParamSpec& k : d->knobs) {
      EXPECT_EQ(all.at(k.name), k.def) << d->name << "." << k.name;
      EXPECT_EQ(k.def.index(), static_cast<size_t>(k.type)) << d->name << "." << k.name;
    }
    EXPECT_EQ(std::string(MakePolicy(d->name)->name()), d->name);  // Configure reads them all
  }
}

TEST(PolicyRegistry, inputs_each_policy_declares) {
  EXPECT_TRUE(MakePolicy("kv_aware", {})->UsesIndex());
  EXPECT_TRUE(MakePolicy("cost", {})->UsesIndex());
  EXPECT_FALSE(MakePolicy("power_of_two", {})->UsesIndex());
  EXPECT_TRUE(MakePolicy("lmcache_aware", {})->NeedsExternal());
  EXPECT_TRUE(MakePolicy("consistent_hash", {})->HashesSession());
  EXPECT_TRUE(MakePolicy("rendezvous_hash", {})->HashesSession());
  EXPECT_FALSE(MakePolicy("kv_aware", {})->HashesSession());
}

TEST(KvAware, match_against_load_follows_cache_weight) {
  Fixture f;
  auto c = Idle(2);
  c[0].match = 1.0;          // holds the whole prompt
  c[0].requests = 10;        // but is busy
  c[1].match = 0.0;
  c[1].requests = 0;
  auto p = MakePolicy("kv_aware", {{"cache_weight", 1.0}});
  std::vector<ScoreTerms> t;
  EXPECT_EQ(p->Choose(c, f.Ctx(), &t), 0u);
  EXPECT_DOUBLE_EQ(t[0].match, 1.0);
  p->Configure(ResolvePolicyParams("kv_aware", {{"cache_weight", 0.0}}));
  EXPECT_EQ(p->Choose(c, f.Ctx(), &t), 1u);
  EXPECT_DOUBLE_EQ(t[0].load, 0.5);  // requests 10/10 over two signals, prefill 0
}

TEST(KvAware, match_credit_decays_with_the_excess_prefill_queue) {
  Fixture f;
  auto c = Idle(2);
  c[0].match = 0.8;             // holds 64 of the 80 prompt tokens
  c[0].pending_prefill = 1600;  // but queues 20 prompts' worth more prefill than worker 1
  f.params["size_aware"] = true;
  auto p = MakePolicy("kv_aware", f.params);
  std::vector<ScoreTerms> t;
  ChooseContext ctx = f.Ctx(5);
  ctx.num_tokens = 80;
  EXPECT_EQ(p->Choose(c, ctx, &t), 1u);
  EXPECT_DOUBLE_EQ(t[0].match, 0.8 / 21);  // credit 1 / (1 + 1600 / 80)
  EXPECT_DOUBLE_EQ(t[1].match, 0.0);
  // projected prefill: 1600 + 16 on worker 0, 80 on worker 1; requests all 0
  EXPECT_NEAR(t[0].load, 0.5, 1e-12);
  EXPECT_NEAR(t[1].load, 80.0 / 1616 / 2, 1e-12);
  // Empty queues: the match counts in full and the projected prefill favours it too.
  c[0].pending_prefill = 0;
  EXPECT_EQ(p->Choose(c, ctx, &t), 0u);
  EXPECT_DOUBLE_EQ(t[0].match, 0.8);
  EXPECT_NEAR(t[0].load, (16.0 / 80) / 2, 1e-12);
  EXPECT_NEAR(t[1].load, 0.5, 1e-12);
}

TEST(KvAware, size_aware_terms_weigh_in_as_every_queue_fills) {
  Fixture f;
  auto c = Idle(2);
  c[0].match = 0.8;  // holds 64 of the 80 prompt tokens, behind the longer queue
  c[0].pending_prefill = 16000;
  c[0].requests = 10;
  c[1].pending_prefill = 0;  // an idle worker: saturation weight 0, the plain score
  c[1].requests = 5;
  auto p = MakePolicy("kv_aware", f.params);  // size_aware off
  std::vector<ScoreTerms> t;
  ChooseContext ctx = f.Ctx(5);
  ctx.num_tokens = 80;
  EXPECT_EQ(p->Choose(c, ctx, &t), 0u);
  EXPECT_DOUBLE_EQ(t[0].match, 0.8);
  EXPECT_DOUBLE_EQ(t[0].load, 1.0);   // (16000/16000 + 10/10) / 2
  EXPECT_DOUBLE_EQ(t[1].load, 0.25);  // (0 + 5/10) / 2
  // Every queue long: min / max = 0.9, s = 0.9^6, and the 1,600 tokens of extra queue
  // (20 prompts' worth) discount the match.
  c[1].pending_prefill = 14400;
  const double s = std::pow(0.9, 6);
  EXPECT_EQ(p->Choose(c, ctx, &t), 1u);
  EXPECT_NEAR(t[0].match, 0.8 / (1 + s * 1600 / 80), 1e-12);
  EXPECT_DOUBLE_EQ(t[1].match, 0.0);
  const double proj0 = 16000 + s * 80 * 0.2, proj1 = 14400 + s * 80;
  EXPECT_NEAR(t[0].load, 1.0, 1e-12);
  EXPECT_NEAR(t[1].load, (proj1 / proj0 + 0.5) / 2, 1e-12);
}

TEST(Cost, lowest_prefill_plus_active_blocks) {
  Fixture f;
  auto c = Idle(3);
  c[0].weighted_blocks = 4;  // nothing to prefill, but busy decoding 10 blocks
  c[0].active_blocks = 10;
  c[1].weighted_blocks = 2;  // 2 blocks to prefill, 1 active
  c[1].active_blocks = 1;
  c[2].weighted_blocks = 0;  // 4 to prefill
  auto p = MakePolicy("cost", f.params);
  std::vector<ScoreTerms> t;
  ChooseContext ctx = f.Ctx(4);
  ctx.num_tokens = 64;  // 4 blocks of 16
  EXPECT_EQ(p->Choose(c, ctx, &t), 1u);
  EXPECT_DOUBLE_EQ(t[0].cost, 10);
  EXPECT_DOUBLE_EQ(t[1].cost, 3);
  EXPECT_DOUBLE_EQ(t[2].cost, 4);
}

TEST(Exclusion, excluded_never_chosen_and_scored_as_absent) {
  Fixture f;
  auto c = Idle(3);
  c[0].match = 1.0;
  c[0].requests = 100;  // excluded below: must not set the others' load normaliser
  c[1].requests = 2;
  c[2].requests = 4;
  c[0].excluded = true;
  f.params["cache_weight"] = 0.0;
  auto p = MakePolicy("kv_aware", f.params);
  std::vector<ScoreTerms> t;
  EXPECT_EQ(p->Choose(c, f.Ctx(), &t), 1u);
  EXPECT_DOUBLE_EQ(t[0].score, 0.0);         // zero terms for the excluded
  EXPECT_DOUBLE_EQ(t[2].load, 0.5);          // 4 / 4 (not 4 / 100), over two signals
}

TEST(ConsistentHash, exclusion_moves_only_the_excluded_workers_sessions) {
  Fixture f;
  auto c = Idle(5);
  auto p = MakePolicy("consistent_hash", f.params);
  std::vector<uint64_t> hashes;
  for (const auto& x : c) hashes.push_back(x.name_hash);
  p->OnMembership(hashes);
  std::vector<ScoreTerms> t;
  std::vector<size_t> before;
  for (uint64_t s = 0; s < 400; ++s) before.push_back(p->Choose(c, f.Ctx(4, s * 0x9E3779B97F4A7C15ull), &t));
  c[2].excluded = true;
  size_t moved = 0;
  for (uint64_t s = 0; s < 400; ++s) {
    const size_t now = p->Choose(c, f.Ctx(4, s * 0x9E3779B97F4A7C15ull), &t);
    EXPECT_NE(now, 2u);
    if (before[s] != 2) {
      EXPECT_EQ(now, before[s]);
    } else {
      ++moved;
    }
  }
  EXPECT_GT(moved, 0u);  // worker 2 had sessions, and they moved
}

TEST(RoundRobin, workers_in_turn) {
  Fixture f;
  auto c = Idle(3);
  auto p = MakePolicy("round_robin", f.params);
  std::vector<ScoreTerms> t;
  std::vector<size_t> picks;
  for (int i = 0; i < 6; ++i) picks.push_back(p->Choose(c, f.Ctx(), &t));
  EXPECT_EQ(picks, (std::vector<size_t>{0, 1, 2, 0, 1, 2}));
}

// eviction_interval_s = 0 turns eviction off (vllm-project/router and SGLang start no eviction
// thread for 0); any interval > 0 cuts the tree back to max_tree_size tokens per worker.
TEST(CacheAware, eviction_interval_zero_never_evicts) {
  std::vector<uint32_t> prompt(16);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<uint32_t>(100 + i);
  auto chosen_after_one_decision = [&](double interval) {
    Fixture f;
    f.params["eviction_interval_s"] = interval;
    f.params["max_tree_size"] = int64_t{4};  // tokens per worker
    auto p = MakePolicy("cache_aware", f.params);
    auto c = Idle(2);
    c[0].requests = 1;  // worker 1 is the least loaded: it wins unless the tree match decides
    ChooseContext ctx = f.Ctx();
    ctx.tokens = prompt.data();
    ctx.num_tokens = prompt.size();
    ctx.now_s = 1000.0;
    p->Record(0, ctx);  // worker 0 served the prompt
    ctx.now_s = 2000.0;
    p->Prepare(ctx, c.size());
    std::vector<ScoreTerms> t;
    const size_t chosen = p->Choose(c, ctx, &t);
    return std::make_pair(chosen, t[0].match);  // match: the tree's ratio
  };
  const auto off = chosen_after_one_decision(0.0);
  EXPECT_EQ(off.first, 0u);  // the whole prompt is still in the tree
  EXPECT_DOUBLE_EQ(off.second, 1.0);
  const auto on = chosen_after_one_decision(120.0);
  EXPECT_EQ(on.first, 1u);  // cut back to 4 of 16 tokens: below cache_threshold 0.3
  EXPECT_LE(on.second, 4.0 / 16.0);
}

// Dynamo's prefill term counts the worker's queued prefill: a worker mid-prefill of 1,024
// tokens loses to one that is only decoding (ai-dynamo/dynamo raw_prefill_blocks).
TEST(Cost, queued_prefill_counts_in_the_prefill_term) {
  Fixture f;
  auto c = Idle(2);
  c[0].pending_prefill = 1024;  // 64 blocks still to prefill
  c[0].active_blocks = 64;
  c[1].active_blocks = 70;      // decoding only
  auto p = MakePolicy("cost", f.params);
  std::vector<ScoreTerms> t;
  ChooseContext ctx = f.Ctx(4);
  ctx.num_tokens = 64;
  EXPECT_EQ(p->Choose(c, ctx, &t), 1u);
  EXPECT_DOUBLE_EQ(t[0].cost, (1024.0 + 64.0) / 16.0 + 64.0);
  EXPECT_DOUBLE_EQ(t[1].cost, 64.0 / 16.0 + 70.0);
}

// Dynamo normalises the softmax over the cost range: the same load added to every worker
// changes no probability, so the same seeded stream draws the same workers.
TEST(Cost, softmax_over_the_cost_range_is_shift_invariant) {
  auto draws = [](double extra_active) {
    Fixture f;
    f.params["temperature"] = 0.5;
    auto c = Idle(3);
    c[0].weighted_blocks = 4;
    c[1].weighted_blocks = 2;
    for (auto& x : c) x.active_blocks += extra_active;
    auto p = MakePolicy("cost", f.params);
    std::vector<ScoreTerms> t;
    ChooseContext ctx = f.Ctx(4);
    ctx.num_tokens = 64;
    std::vector<size_t> out;
    for (int i = 0; i < 200; ++i) out.push_back(p->Choose(c, ctx, &t));
    return out;
  };
  const auto base = draws(0);
  EXPECT_EQ(base, draws(8));
  EXPECT_EQ(base, draws(1000));
  size_t firsts = 0;
  for (size_t w : base) firsts += w == 0 ? 1 : 0;
  EXPECT_GT(firsts, 100u);  // p = 1 / (1 + e^-1 + e^-2) = 0.665 for the cheapest
}
