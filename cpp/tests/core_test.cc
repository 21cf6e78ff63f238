// Native test driver for the kvroute core (no framework): decoder, index, router, ZeroMQ
// ingestion. Built with -DKVROUTE_NATIVE_TESTS=ON; run under ASan/UBSan and TSan by
// scripts/sanitize.sh. Uses public headers only.
//
//   core_test                      run every test; last line "N passed, M failed"
//   core_test NAME...              run the tests whose name contains one of the NAMEs
//   core_test --repro-remove-close reproduce Router::RemoveWorker racing Router::Close
//   core_test --repro-add-close    reproduce the AddWorker / Close lock-order deadlock
//
// Environment: KVROUTE_TEST_STRESS_S = seconds of the concurrent router stress (default 1.5).
#include <msgpack.hpp>
#include <xxhash.h>
#include <zmq.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <unordered_map>
#include <vector>

#include "common/block_key.h"
#include "common/types.h"
#include "events/decoder.h"
#include "events/subscriber.h"
#include "index/index.h"
#include "index/huge_page_allocator.h"
#include "index/robin_table.h"
#include "router/router.h"

#include "tests/harness.h"

using namespace kvroute;

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

using kvroute_test::Secs;
using kvroute_test::g_checks_failed_in_test;

// Polls `pred` every 2 ms until it holds or `timeout_s` passes.
bool WaitFor(const std::function<bool()>& pred, double timeout_s) {
  const double end = Secs() + timeout_s;
  while (Secs() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

// ---- msgpack value builder --------------------------------------------------------------------

struct V {
  enum Kind { kNil, kUint, kInt, kFloat, kStr, kBin, kBool, kArr, kMap } k = kNil;
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<V> a;
  std::vector<std::pair<V, V>> m;
};
V Nil() { return V{}; }
V U(uint64_t x) { V v; v.k = V::kUint; v.u = x; return v; }
V I(int64_t x) { V v; v.k = V::kInt; v.i = x; return v; }
V F(double x) { V v; v.k = V::kFloat; v.f = x; return v; }
V S(std::string x) { V v; v.k = V::kStr; v.s = std::move(x); return v; }
V Bin(std::string x) { V v; v.k = V::kBin; v.s = std::move(x); return v; }
V Bool(bool b) { V v; v.k = V::kBool; v.u = b; return v; }
V A(std::vector<V> xs) { V v; v.k = V::kArr; v.a = std::move(xs); return v; }
V M(std::vector<std::pair<V, V>> xs) { V v; v.k = V::kMap; v.m = std::move(xs); return v; }
V Toks(const std::vector<uint32_t>& t) {
  std::vector<V> xs;
  for (uint32_t x : t) xs.push_back(U(x));
  return A(std::move(xs));
}
V Hs(const std::vector<uint64_t>& hs) {
  std::vector<V> xs;
  for (uint64_t h : hs) xs.push_back(U(h));
  return A(std::move(xs));
}

void Pack(msgpack::packer<msgpack::sbuffer>& pk, const V& v) {
  switch (v.k) {
    case V::kNil: pk.pack_nil(); break;
    case V::kUint: pk.pack_uint64(v.u); break;
    case V::kInt: pk.pack_int64(v.i); break;
    case V::kFloat: pk.pack_double(v.f); break;
    case V::kStr: pk.pack_str(static_cast<uint32_t>(v.s.size())); pk.pack_str_body(v.s.data(), static_cast<uint32_t>(v.s.size())); break;
    case V::kBin: pk.pack_bin(static_cast<uint32_t>(v.s.size())); pk.pack_bin_body(v.s.data(), static_cast<uint32_t>(v.s.size())); break;
    case V::kBool: v.u ? pk.pack_true() : pk.pack_false(); break;
    case V::kArr:
      pk.pack_array(static_cast<uint32_t>(v.a.size()));
      for (const V& x : v.a) Pack(pk, x);
      break;
    case V::kMap:
      pk.pack_map(static_cast<uint32_t>(v.m.size()));
      for (const auto& [k, x] : v.m) {
        Pack(pk, k);
        Pack(pk, x);
      }
      break;
  }
}
std::string Enc(const V& v) {
  msgpack::sbuffer sb;
  msgpack::packer<msgpack::sbuffer> pk(sb);
  Pack(pk, v);
  return std::string(sb.data(), sb.size());
}

std::vector<uint32_t> Range(uint32_t from, uint32_t n) {
  std::vector<uint32_t> t(n);
  for (uint32_t i = 0; i < n; ++i) t[i] = from + i;
  return t;
}

// vLLM array-era BlockStored (#19737: 7 elements).
V StoredArr(const std::vector<uint64_t>& hashes, std::optional<uint64_t> parent,
            const std::vector<uint32_t>& toks, int64_t bs, const char* medium = "GPU") {
  return A({S("BlockStored"), Hs(hashes), parent ? U(*parent) : Nil(), Toks(toks), I(bs), Nil(),
            medium ? S(medium) : Nil()});
}
V RemovedArr(const std::vector<uint64_t>& hashes, const char* medium = "GPU") {
  return A({S("BlockRemoved"), Hs(hashes), medium ? S(medium) : Nil()});
}
V ClearedArr() { return A({S("AllBlocksCleared")}); }
V Batch(std::vector<V> events, std::optional<int64_t> rank = 0, double ts = 1.5) {
  return A({F(ts), A(std::move(events)), rank ? I(*rank) : Nil()});
}

struct Decoded {
  bool ok = false;
  EventBatch b;
  DropCounts d;
};
Decoded Decode(const std::string& p, const DecodeLimits& lim = DecodeLimits()) {
  Decoded r;
  r.ok = DecodeBatch(p.data(), p.size(), lim, &r.b, &r.d);
  return r;
}
uint64_t TotalDrops(const DropCounts& d) {
  uint64_t t = 0;
  for (uint64_t x : d.n) t += x;
  return t;
}
EngineHash IntHash(uint64_t v) { return EngineHash{0, v}; }

std::vector<BlockKey> Keys(const std::vector<uint32_t>& toks, size_t bs = 16,
                           std::string_view lora = {},
                           const std::vector<std::string>* extras = nullptr) {
  std::vector<BlockKey> k;
  ComputeBlockKeys(ChainRoot(lora), toks.data(), toks.size(), bs, extras, &k);
  return k;
}

// ==== decoder ==================================================================================

TEST(decode_array_era_u64_hashes) {
  const uint64_t big = 0xF000000000000001ull;  // >= 2^63: msgpack uint64
  auto d = Decode(Enc(Batch({StoredArr({big, 7}, std::nullopt, Range(0, 32), 16)}, 3)));
  CHECK(d.ok);
  CHECK_EQ(TotalDrops(d.d), 0u);
  CHECK(d.b.has_dp_rank);
  CHECK_EQ(d.b.dp_rank, 3);
  CHECK(d.b.ts == 1.5);
  CHECK_EQ(d.b.events.size(), 1u);
  if (d.b.events.size() != 1) return;
  const Event& e = d.b.events[0];
  CHECK(e.type == EventType::kBlockStored);
  CHECK_EQ(e.block_hashes.size(), 2u);
  CHECK(e.block_hashes[0] == IntHash(big));
  CHECK(e.block_hashes[0].IsInt());
  CHECK(e.block_hashes[1] == IntHash(7));
  CHECK(!e.has_parent);
  CHECK(std::vector<uint32_t>(e.token_ids.begin(), e.token_ids.end()) == Range(0, 32));
  CHECK_EQ(e.block_size, 16);
  CHECK(!e.has_lora_id);
  CHECK(e.has_medium);
  CHECK(e.tier == Medium::kGpu);
  CHECK(e.medium_known);
}

TEST(decode_legacy_two_element_batch_and_int_ts) {
  V ev = A({S("BlockStored"), Hs({1}), U(99), Toks(Range(0, 16)), I(16), Nil()});  // 6 fields
  auto d = Decode(Enc(A({U(1700000000), A({ev, A({S("BlockRemoved"), Hs({1})})})})));
  CHECK(d.ok);
  CHECK(!d.b.has_dp_rank);
  CHECK(d.b.ts == 1700000000.0);
  CHECK_EQ(d.b.events.size(), 2u);
  if (d.b.events.size() != 2) return;
  CHECK(d.b.events[0].has_parent);
  CHECK(d.b.events[0].parent_block_hash == IntHash(99));
  CHECK(!d.b.events[0].has_medium);
  CHECK(d.b.events[1].type == EventType::kBlockRemoved);
  CHECK(d.b.events[1].tier == Medium::kGpu);
  // Rank nil: readable, no rank.
  auto d2 = Decode(Enc(Batch({ClearedArr()}, std::nullopt)));
  CHECK(d2.ok);
  CHECK(!d2.b.has_dp_rank);
  CHECK_EQ(d2.b.events.size(), 1u);
  // Extra trailing batch elements and trailing event fields are skipped.
  auto d3 = Decode(Enc(A({F(2), A({A({S("BlockRemoved"), Hs({5}), S("CPU"), I(0), S("x"),
                                      U(9)})}),
                          I(0), S("future")})));
  CHECK(d3.ok);
  CHECK_EQ(d3.b.events.size(), 1u);
  if (!d3.b.events.empty()) CHECK(d3.b.events[0].tier == Medium::kCpu);
}

TEST(decode_array_full_era_fields) {
  V extra = A({Nil(), A({S("mm"), U(3)})});
  V ev = A({S("BlockStored"), Hs({1, 2}), U(77), Toks(Range(5, 32)), I(16), U(4), S("CPU"),
            S("adapter"), extra, I(2), S("full_attention"), Nil()});
  auto d = Decode(Enc(Batch({ev})));
  CHECK(d.ok);
  CHECK_EQ(d.b.events.size(), 1u);
  if (d.b.events.empty()) return;
  const Event& e = d.b.events[0];
  CHECK(e.has_lora_id);
  CHECK_EQ(e.lora_id, 4);
  CHECK(e.tier == Medium::kCpu);
  CHECK(e.lora_name == "adapter");
  CHECK_EQ(e.extra_keys.size(), 2u);
  if (e.extra_keys.size() == 2) {
    CHECK(e.extra_keys[0].empty());
    CHECK(e.extra_keys[1] == Enc(A({S("mm"), U(3)})));
  }
  CHECK_EQ(e.group_idx, 2);
  CHECK(e.kv_cache_spec_kind == "full_attention");
  CHECK(!e.has_sliding_window);
}

TEST(decode_map_era_any_key_order) {
  // "type" last, unknown keys (string and non-string) in between.
  V ev = M({{S("token_ids"), Toks(Range(0, 16))},
            {U(5), S("non-string key")},
            {S("medium"), S("CPU_TIER2")},
            {S("block_size"), I(16)},
            {S("ownership"), S("future field")},
            {S("parent_block_hash"), Nil()},
            {S("locality"), S("LOCAL")},
            {S("block_hashes"), Hs({42})},
            {S("kv_cache_spec_sliding_window"), I(128)},
            {S("type"), S("BlockStored")}});
  V rm = M({{S("block_hashes"), Hs({42})}, {S("type"), S("BlockRemoved")},
            {S("token_ids"), S("ignored for removals")}, {S("medium"), S("STORAGE")}});
  V clr = M({{S("type"), S("AllBlocksCleared")}, {S("junk"), U(1)}});
  auto d = Decode(Enc(Batch({ev, rm, clr})));
  CHECK(d.ok);
  CHECK_EQ(TotalDrops(d.d), 0u);
  CHECK_EQ(d.b.events.size(), 3u);
  if (d.b.events.size() != 3) return;
  CHECK(d.b.events[0].block_hashes.size() == 1 && d.b.events[0].block_hashes[0] == IntHash(42));
  CHECK(d.b.events[0].tier == Medium::kCpu);
  CHECK(d.b.events[0].locality == "LOCAL");
  CHECK(d.b.events[0].has_sliding_window);
  CHECK_EQ(d.b.events[0].sliding_window, 128);
  CHECK(d.b.events[1].type == EventType::kBlockRemoved);
  CHECK(d.b.events[1].tier == Medium::kDisk);
  CHECK(d.b.events[2].type == EventType::kAllBlocksCleared);

  // Map batch: {"ts", "events", "data_parallel_rank"} in any order; rank may be absent.
  auto m1 = Decode(Enc(M({{S("events"), A({ev})}, {S("data_parallel_rank"), I(2)},
                          {S("ts"), F(3.25)}})));
  CHECK(m1.ok);
  CHECK(m1.b.has_dp_rank);
  CHECK_EQ(m1.b.dp_rank, 2);
  CHECK(m1.b.ts == 3.25);
  CHECK_EQ(m1.b.events.size(), 1u);
  auto m2 = Decode(Enc(M({{S("ts"), F(1)}, {S("events"), A({})}})));
  CHECK(m2.ok);
  CHECK(!m2.b.has_dp_rank);
  auto m3 = Decode(Enc(M({{S("ts"), F(1)}})));  // no events
  CHECK(!m3.ok);
  CHECK_EQ(m3.d.Get(DropReason::kWrongType), 1u);
}

// A map event with two "type" keys: the last one wins, as in the msgpack-c reference (the
// fuzz target found the fast path keeping a leading AllBlocksCleared over a later unknown tag).
TEST(decode_map_event_with_two_tags_takes_the_last) {
  V clr_then_bogus = M({{S("type"), S("AllBlocksCleared")}, {S("type"), S("Bogus")}});
  V bogus_then_clr = M({{S("type"), S("Bogus")}, {S("junk"), U(1)}, {S("type"), S("AllBlocksCleared")}});
  V stored_then_clr = M({{S("type"), S("BlockStored")}, {S("block_hashes"), Hs({1})},
                         {S("type"), S("AllBlocksCleared")}});
  // One batch each: an event the fast path gives up on sends its whole batch to the reference.
  auto d1 = Decode(Enc(Batch({clr_then_bogus})));
  CHECK(d1.ok);
  CHECK_EQ(d1.d.Get(DropReason::kUnknownTag), 1u);
  CHECK_EQ(d1.b.events.size(), 0u);
  for (const V& ev : {bogus_then_clr, stored_then_clr}) {
    auto d = Decode(Enc(Batch({ev})));
    CHECK(d.ok);
    CHECK_EQ(TotalDrops(d.d), 0u);
    CHECK_EQ(d.b.events.size(), 1u);
    if (d.b.events.size() == 1) CHECK(d.b.events[0].type == EventType::kAllBlocksCleared);
  }
}

// Token ids in every integer form, in lists long enough for the 64-byte windows, the paired
// walk's 240-byte ones (WalkPaired) and their tails, with few or many changes of form: the four common forms (fixint, uint8/16/32), then mixed with the
// others (uint64, int8-64 holding non-negative values); and one id out of range (-1, 2^32)
// anywhere in the list drops the event as the reference does.
TEST(decode_token_forms_at_random) {
  std::mt19937_64 rng(17);
  auto be = [](std::string* out, uint64_t v, int bytes) {
    for (int s = 8 * (bytes - 1); s >= 0; s -= 8) out->push_back(static_cast<char>(v >> s));
  };
  for (int round = 0; round < 300; ++round) {
    const size_t n = 1 + rng() % 1200;
    const int forms = round % 3 == 0 ? 9 : 4;
    const int bad = round % 5 == 4 ? static_cast<int>(rng() % n) : -1;
    std::vector<uint32_t> want(n);
    std::string list = "\xdd";  // array 32
    be(&list, n, 4);
    for (size_t j = 0; j < n; ++j) {
      uint32_t v = 0;
      if (static_cast<int>(j) == bad) {
        if (rng() % 2) {
          list += '\xff';  // -1
        } else {
          list += '\xcf';
          be(&list, uint64_t{1} << 32, 8);
        }
        continue;
      }
      // Every other round mostly uint16, as text is: few form changes, so after the first
      // window the decoder takes its branchy loop; otherwise the form changes often.
      const bool text_like = round % 2 == 1 && rng() % 10 != 0;
      switch (text_like ? 2 : static_cast<int>(rng() % forms)) {
        case 0: v = rng() % 128; list += static_cast<char>(v); break;                // fixint
        case 1: v = 128 + rng() % 128; list += '\xcc'; be(&list, v, 1); break;       // uint8
        case 2: v = rng() % 65536; list += '\xcd'; be(&list, v, 2); break;           // uint16
        case 3: v = static_cast<uint32_t>(rng()); list += '\xce'; be(&list, v, 4); break;
        case 4: v = static_cast<uint32_t>(rng()); list += '\xcf'; be(&list, v, 8); break;
        case 5: v = rng() % 128; list += '\xd0'; be(&list, v, 1); break;             // int8
        case 6: v = rng() % 32768; list += '\xd1'; be(&list, v, 2); break;           // int16
        case 7: v = rng() % 0x80000000u; list += '\xd2'; be(&list, v, 4); break;     // int32
        default: v = static_cast<uint32_t>(rng()); list += '\xd3'; be(&list, v, 8); break;
      }
      want[j] = v;
    }
    // [ts, [["BlockStored", [hashes], nil, tokens, 16]]]
    const size_t nb = (n + 15) / 16;
    std::string ev = "\x95\xab" "BlockStored" "\xdc";  // then an array 16 of hashes
    be(&ev, nb, 2);
    for (size_t k = 0; k < nb; ++k) ev += static_cast<char>(k % 128);
    ev += '\xc0';
    ev += list;
    ev += '\x10';
    const std::string batch = std::string("\x92\xcb") + std::string(8, '\0') + "\x91" + ev;
    const auto d = Decode(batch);
    EventBatch ref;
    DropCounts ref_drops;
    const bool ref_ok =
        DecodeBatchReference(batch.data(), batch.size(), DecodeLimits(), &ref, &ref_drops);
    CHECK_EQ(d.ok, ref_ok);
    CHECK(d.d.n == ref_drops.n);
    if (bad >= 0) {
      CHECK_EQ(d.d.Get(DropReason::kTokenOutOfRange), 1u);
      CHECK_EQ(d.b.events.size(), 0u);
      continue;
    }
    CHECK(d.ok);
    CHECK_EQ(TotalDrops(d.d), 0u);
    CHECK_EQ(d.b.events.size(), 1u);
    if (d.b.events.size() == 1) {
      const TokenIds& got = d.b.events[0].token_ids;
      CHECK(std::vector<uint32_t>(got.begin(), got.end()) == want);
    }
  }
}

// The walk's AVX2 byte classifier against the SSSE3 one (the decode tests run whichever the
// CPU has): random bytes, mostly the forms of token ids, other forms among them, and runs of
// one form (the starts near the window's end reach past it).
TEST(decode_token_classifiers_agree) {
  std::mt19937_64 rng(23);
  const uint8_t forms[] = {0x05, 0x7f, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd2, 0xff, 0x80};
  alignas(32) uint8_t q[256];
  for (int round = 0; round < 20000; ++round) {
    const int mode = round % 4;
    for (int j = 0; j < 256; ++j) {
      if (mode == 0) {
        q[j] = static_cast<uint8_t>(rng());
      } else if (mode == 1) {
        q[j] = forms[rng() % sizeof(forms)];
      } else {
        const uint8_t one = mode == 2 ? 0xce : 0xcd;  // one form, with the odd other byte
        q[j] = rng() % 16 == 0 ? forms[rng() % sizeof(forms)] : one;
      }
    }
    CHECK(TokenClassifiersAgreeForTest(q));
  }
}

TEST(decode_hash_forms) {
  // Negative int64 (SGLang): reinterpreted as uint64, exact.
  // Bin 16: kept exactly (top bit of hi set). Bin 32: XXH3-128, top bit set.
  std::string b16(16, '\0'), b32(32, '\0');
  for (int i = 0; i < 16; ++i) b16[i] = static_cast<char>(0x10 + i);
  for (int i = 0; i < 32; ++i) b32[i] = static_cast<char>(0xA0 + i);
  std::string b16_low(16, '\0');
  b16_low[15] = 7;  // bin16 whose value is "7": must not alias the int 7
  V hashes = A({I(-5), I(INT64_MIN), Bin(b16), Bin(b32), Bin(b16_low), U(7), Bin("abc")});
  auto d = Decode(Enc(Batch({A({S("BlockRemoved"), hashes})})));
  CHECK(d.ok);
  CHECK_EQ(d.b.events.size(), 1u);
  if (d.b.events.size() != 1) return;
  const auto& h = d.b.events[0].block_hashes;
  CHECK_EQ(h.size(), 7u);
  if (h.size() != 7) return;
  CHECK(h[0] == IntHash(static_cast<uint64_t>(int64_t{-5})));
  CHECK(h[1] == IntHash(0x8000000000000000ull));
  CHECK_EQ(h[2].hi, 0x1011121314151617ull | (1ull << 63));
  CHECK_EQ(h[2].lo, 0x18191A1B1C1D1E1Full);
  XXH128_hash_t x = XXH3_128bits(b32.data(), b32.size());
  CHECK_EQ(h[3].hi, x.high64 | (1ull << 63));
  CHECK_EQ(h[3].lo, x.low64);
  CHECK(!h[4].IsInt());
  CHECK(h[4] != h[5]);
  CHECK(h[5] == IntHash(7));
  CHECK(!h[6].IsInt());  // other lengths: hashed too

  // The same 16 bytes in the bin8, bin16 and bin32 *formats* decode identically.
  auto with_bin_format = [&](unsigned char fmt) {
    std::string p = Enc(F(1)).insert(0, "\x93", 1);  // [ts, events, rank]
    p += "\x91\x92\xAC" "BlockRemoved" "\x91";               // [["BlockRemoved", [<bin>]]]
    p += static_cast<char>(fmt);
    if (fmt == 0xc4) p += '\x10';
    if (fmt == 0xc5) p += std::string("\x00\x10", 2);
    if (fmt == 0xc6) p += std::string("\x00\x00\x00\x10", 4);
    p += b16;
    p += '\x00';  // rank 0
    return Decode(p);
  };
  for (unsigned char fmt : {0xc4, 0xc5, 0xc6}) {
    auto r = with_bin_format(fmt);
    CHECK(r.ok);
    CHECK_EQ(TotalDrops(r.d), 0u);
    CHECK(r.b.events.size() == 1 && r.b.events[0].block_hashes.size() == 1 &&
          r.b.events[0].block_hashes[0] == h[2]);
  }
  // Empty bin: that event is dropped (wrong_type), the batch survives.
  auto e = Decode(Enc(Batch({A({S("BlockRemoved"), A({Bin("")})}), ClearedArr()})));
  CHECK(e.ok);
  CHECK_EQ(e.b.events.size(), 1u);
  CHECK_EQ(e.d.Get(DropReason::kWrongType), 1u);
}

TEST(decode_sglang_metadata_and_salt) {
  V ev = A({S("BlockStored"), A({I(-1), I(7)}), Nil(), Toks(Range(0, 32)), I(16), Nil(), S("GPU"),
            M({{S("cache_salt"), S("s")}, {S("other"), U(1)}})});
  auto d = Decode(Enc(Batch({ev}, std::nullopt)));
  CHECK(d.ok);
  CHECK_EQ(d.b.events.size(), 1u);
  if (d.b.events.empty()) return;
  const std::string salt = Enc(A({S("s")}));
  CHECK(d.b.events[0].cache_salt == salt);
  CHECK_EQ(d.b.events[0].extra_keys.size(), 1u);
  if (!d.b.events[0].extra_keys.empty()) CHECK(d.b.events[0].extra_keys[0] == salt);
  CHECK(d.b.events[0].lora_name.empty());
  // SGLang map era: cache_salt as a plain key; with a parent the salt is not re-applied.
  V evm = M({{S("type"), S("BlockStored")}, {S("block_hashes"), A({I(-3)})},
             {S("parent_block_hash"), I(-1)}, {S("token_ids"), Toks(Range(0, 16))},
             {S("block_size"), I(16)}, {S("cache_salt"), S("s")}, {S("session_id"), S("x")}});
  auto dm = Decode(Enc(Batch({evm}, std::nullopt)));
  CHECK(dm.ok);
  CHECK_EQ(dm.b.events.size(), 1u);
  if (!dm.b.events.empty()) {
    CHECK(dm.b.events[0].cache_salt == salt);
    CHECK(dm.b.events[0].extra_keys.empty());
  }
}

TEST(decode_medium_strings) {
  struct Case {
    const char* s;
    Medium m;
    bool known;
  } cases[] = {{"GPU", Medium::kGpu, true},          {"cuda", Medium::kGpu, true},
               {"CPU", Medium::kCpu, true},          {"CPU_TIER1", Medium::kCpu, true},
               {"LocalCPUBackend", Medium::kCpu, true}, {"STORAGE", Medium::kDisk, true},
               {"SSD", Medium::kDisk, true},         {"tape", Medium::kDisk, false}};
  for (const Case& c : cases) {
    auto d = Decode(Enc(Batch({RemovedArr({1}, c.s)})));
    CHECK(d.ok && d.b.events.size() == 1);
    if (d.b.events.size() != 1) continue;
    CHECK(d.b.events[0].tier == c.m);
    CHECK(d.b.events[0].medium_known == c.known);
    CHECK(d.b.events[0].medium == c.s);
  }
}

TEST(decode_every_truncation_is_counted) {
  const std::vector<std::string> payloads = {
      Enc(Batch({StoredArr({1, 2}, 9, Range(0, 32), 16), RemovedArr({1}), ClearedArr()})),
      Enc(M({{S("ts"), F(1)},
             {S("events"), A({M({{S("type"), S("BlockStored")}, {S("block_hashes"), Hs({1})},
                                 {S("token_ids"), Toks(Range(70000, 16))},
                                 {S("block_size"), I(16)}})})}})),
      Enc(Batch({A({S("BlockRemoved"), A({Bin(std::string(32, 'x')), I(-9)})})}))};
  for (const std::string& p : payloads) {
    CHECK(Decode(p).ok);
    DropCounts total;
    for (size_t n = 0; n < p.size(); ++n) {
      EventBatch b;
      const bool ok = DecodeBatch(p.data(), n, DecodeLimits(), &b, &total);
      CHECK(!ok);
      CHECK(b.events.empty());
    }
    CHECK_EQ(total.Get(DropReason::kTruncated), p.size());
    CHECK_EQ(TotalDrops(total), p.size());
  }
  // A null pointer with length 0 is a truncated (empty) payload, not a crash.
  EventBatch b;
  DropCounts dc;
  CHECK(!DecodeBatch(nullptr, 0, DecodeLimits(), &b, &dc));
  CHECK_EQ(dc.Get(DropReason::kTruncated), 1u);
}

TEST(decode_batch_level_errors) {
  struct Case {
    std::string payload;
    DropReason reason;
  };
  const std::string good = Enc(Batch({ClearedArr()}));
  std::vector<Case> cases = {
      {Enc(U(5)), DropReason::kWrongType},                             // not an array/map
      {Enc(A({F(1)})), DropReason::kWrongType},                        // array of 1
      {Enc(A({S("x"), A({})})), DropReason::kWrongType},               // ts not a number
      {Enc(A({F(1), M({})})), DropReason::kWrongType},                 // events not an array
      {Enc(A({F(1), A({}), S("0")})), DropReason::kWrongType},         // rank not an int
      {Enc(A({F(1), A({}), U(1ull << 63)})), DropReason::kWrongType},  // rank > INT64_MAX
      {good + std::string("\xc0", 1), DropReason::kTrailingBytes},
      {std::string("\xc1", 1), DropReason::kParseError},              // never-used byte
      {std::string("\x92\xcb\x00\x00\x00\x00\x00\x00\xf0\x3f\x91\xc1", 12),
       DropReason::kParseError},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    auto d = Decode(cases[i].payload);
    CHECK(!d.ok);
    CHECK(d.b.events.empty());
    if (d.d.Get(cases[i].reason) != 1 || TotalDrops(d.d) != 1) {
      std::fprintf(stderr, "  case %zu: expected one %s\n", i, DropReasonName(cases[i].reason));
      ++g_checks_failed_in_test;
    }
  }
}

TEST(decode_event_level_errors_keep_the_batch) {
  struct Case {
    V ev;
    DropReason reason;
  };
  std::vector<Case> cases = {
      {U(3), DropReason::kWrongType},                                          // not array/map
      {A({}), DropReason::kWrongType},                                         // no tag
      {A({U(1), Hs({1})}), DropReason::kWrongType},                            // tag not a str
      {A({S("BlockMoved"), Hs({1})}), DropReason::kUnknownTag},
      {M({{S("block_hashes"), Hs({1})}}), DropReason::kWrongType},            // no "type"
      {M({{S("type"), S("Nope")}}), DropReason::kUnknownTag},
      {A({S("BlockStored"), U(1)}), DropReason::kWrongType},                   // hashes not array
      {A({S("BlockStored"), A({F(1.5)})}), DropReason::kWrongType},            // hash a float
      {A({S("BlockStored"), Hs({1}), Nil(), A({S("t")})}), DropReason::kWrongType},
      {A({S("BlockStored"), Hs({1}), Nil(), A({I(-1)})}), DropReason::kTokenOutOfRange},
      {A({S("BlockStored"), Hs({1}), Nil(), A({U(1ull << 32)})}),
       DropReason::kTokenOutOfRange},
      {A({S("BlockStored"), Hs({1}), Nil(), Toks({1}), U(1ull << 63)}), DropReason::kWrongType},
      {A({S("BlockStored"), Hs({1}), Nil(), Toks({1}), I(1), Nil(), U(1)}),
       DropReason::kWrongType},                                                // medium an int
      {A({S("BlockStored"), Hs({1}), Nil(), Toks({1}), I(1), Nil(), Nil(), U(3)}),
       DropReason::kWrongType},                                                // lora_name int
      {A({S("BlockStored"), Hs({1}), Nil(), Toks({1}), I(1), Nil(), Nil(), Nil(), U(1)}),
       DropReason::kWrongType},                                                // extra_keys
      {A({S("BlockRemoved"), Hs({1}), Bool(true)}), DropReason::kWrongType},
      {M({{S("type"), S("BlockRemoved")}, {S("medium"), A({})}}), DropReason::kWrongType},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    auto d = Decode(Enc(Batch({ClearedArr(), cases[i].ev, ClearedArr()})));
    CHECK(d.ok);
    CHECK_EQ(d.b.events.size(), 2u);
    if (d.d.Get(cases[i].reason) != 1 || TotalDrops(d.d) != 1) {
      std::fprintf(stderr, "  case %zu: expected one %s\n", i, DropReasonName(cases[i].reason));
      ++g_checks_failed_in_test;
    }
  }
}

TEST(decode_limits) {
  DecodeLimits lim;
  lim.max_blocks_per_event = 4;
  auto d = Decode(Enc(Batch({RemovedArr({1, 2, 3, 4, 5}), RemovedArr({1, 2, 3, 4})})), lim);
  CHECK(d.ok);
  CHECK_EQ(d.b.events.size(), 1u);
  CHECK_EQ(d.d.Get(DropReason::kOversized), 1u);

  const std::string p = Enc(Batch({ClearedArr()}));
  DecodeLimits small;
  small.max_payload_bytes = p.size() - 1;
  auto o = Decode(p, small);
  CHECK(!o.ok);
  CHECK_EQ(o.d.Get(DropReason::kOversized), 1u);

  DecodeLimits cont;
  cont.max_container = 3;
  auto c = Decode(Enc(Batch({RemovedArr({1, 2, 3, 4})})), cont);
  CHECK(!c.ok);
  CHECK_EQ(c.d.Get(DropReason::kOversized), 1u);

  DecodeLimits str;
  str.max_string = 8;
  auto s = Decode(Enc(Batch({RemovedArr({1}, "a-long-medium-name")})), str);
  CHECK(!s.ok);
  CHECK_EQ(s.d.Get(DropReason::kOversized), 1u);

  V deep = ClearedArr();
  for (int i = 0; i < 40; ++i) deep = A({deep});
  auto dp = Decode(Enc(Batch({deep})));
  CHECK(!dp.ok);
  CHECK_EQ(dp.d.Get(DropReason::kOversized), 1u);

  // A 5-byte array32 header announcing 2^24-1 elements: refused or truncated, never a crash.
  const std::string hdr("\xdd\x00\xff\xff\xff", 5);
  auto h = Decode(hdr);
  CHECK(!h.ok);
  CHECK_EQ(TotalDrops(h.d), 1u);
}

TEST(decode_random_mutations_never_crash) {
  std::vector<std::string> seeds = {
      Enc(Batch({StoredArr({1, 2}, 9, Range(0, 32), 16), RemovedArr({1}, "CPU"), ClearedArr()})),
      Enc(M({{S("ts"), F(1)}, {S("data_parallel_rank"), I(0)},
             {S("events"), A({M({{S("type"), S("BlockStored")}, {S("block_hashes"), A({I(-4)})},
                                 {S("token_ids"), Toks(Range(0, 16))}, {S("block_size"), I(16)},
                                 {S("extra_keys"), A({A({S("salt")})})}})})}})),
  };
  std::mt19937_64 rng(12345);
  uint64_t ok = 0, bad = 0;
  for (int it = 0; it < 20000; ++it) {
    std::string p = seeds[it % seeds.size()];
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      if (p.empty()) break;
      switch (rng() % 4) {
        case 0: p[rng() % p.size()] = static_cast<char>(rng()); break;
        case 1: p.insert(rng() % (p.size() + 1), 1, static_cast<char>(rng())); break;
        case 2: if (p.size() > 1) p.erase(rng() % p.size(), 1); break;
        default: p.resize(rng() % (p.size() + 1)); break;
      }
    }
    if (p.empty()) p = "\x90";
    auto d = Decode(p);
    if (d.ok) {
      ++ok;
    } else {
      ++bad;
      if (!d.b.events.empty() || TotalDrops(d.d) != 1) ++g_checks_failed_in_test;
    }
  }
  CHECK(ok > 0);
  CHECK(bad > 0);
}

// ==== index ====================================================================================

Event StoredEv(std::vector<uint64_t> hashes, std::optional<uint64_t> parent,
               std::vector<uint32_t> toks, int64_t bs = 16, Medium tier = Medium::kGpu) {
  Event e;
  e.type = EventType::kBlockStored;
  for (uint64_t h : hashes) e.block_hashes.push_back(IntHash(h));
  if (parent) {
    e.has_parent = true;
    e.parent_block_hash = IntHash(*parent);
  }
  e.token_ids.assign(toks.begin(), toks.end());
  e.block_size = bs;
  e.tier = tier;
  return e;
}
Event RemovedEv(std::vector<uint64_t> hashes, Medium tier = Medium::kGpu) {
  Event e;
  e.type = EventType::kBlockRemoved;
  for (uint64_t h : hashes) e.block_hashes.push_back(IntHash(h));
  e.tier = tier;
  return e;
}
Event ClearedEv() {
  Event e;
  e.type = EventType::kAllBlocksCleared;
  return e;
}

MatchResult Match(const Index& ix, const std::vector<BlockKey>& keys, double now = -1) {
  MatchResult m;
  ix.FindMatches(keys.data(), keys.size(), &m, now);
  return m;
}

// RobinTable against std::unordered_map, with a hash that clusters every key into a few home
// slots (long probe runs, clusters into the tail after the last home, backward-shift deletes).
struct ClusteredSlot {
  uint64_t key;  // 0 = empty
  uint64_t value;
};
struct ClusteredTraits {
  using Slot = ClusteredSlot;
  static constexpr size_t kMaxLoadPercent = 90;
  static constexpr size_t kGrowthPercent = 150;
  static constexpr bool kEmptyIsZero = false;  // (it is; the filling path is tested here)
  static uint64_t Hash(uint64_t k) { return (k % 7) * 0x2492492492492492ull + (k % 3); }
  static bool Empty(const Slot& s) { return s.key == 0; }
  static Slot EmptySlot() { return Slot{0, 0}; }
  static uint64_t HomeHash(const Slot& s) { return Hash(s.key); }
};

TEST(robin_table_matches_a_map_under_clustering) {
  kvroute::RobinTable<ClusteredTraits> t;
  std::unordered_map<uint64_t, uint64_t> ref;
  std::mt19937_64 rng(7);
  auto eq = [](uint64_t k) { return [k](const ClusteredSlot& s) { return s.key == k; }; };
  for (int step = 0; step < 60000; ++step) {
    const uint64_t k = 1 + rng() % 3000;
    const uint64_t h = ClusteredTraits::Hash(k);
    const int op = static_cast<int>(rng() % 10);
    if (op < 6) {
      auto [slot, inserted] = t.FindOrInsert(h, eq(k), [k] { return ClusteredSlot{k, 0}; });
      CHECK_EQ(inserted, ref.find(k) == ref.end());
      CHECK_EQ(slot->key, k);
      slot->value = step;
      ref[k] = static_cast<uint64_t>(step);
    } else if (op < 9) {
      auto* slot = t.Find(h, eq(k));
      CHECK_EQ(slot != nullptr, ref.count(k) == 1);
      if (slot != nullptr) {
        t.Erase(slot);
        ref.erase(k);
      }
    } else {
      const auto* slot = t.Find(h, eq(k));
      CHECK_EQ(slot != nullptr, ref.count(k) == 1);
      if (slot != nullptr) CHECK_EQ(slot->value, ref[k]);
    }
    CHECK_EQ(t.size(), ref.size());
  }
  size_t seen = 0;
  t.ForEach([&](const ClusteredSlot& s) {
    ++seen;
    CHECK(ref.count(s.key) == 1 && ref[s.key] == s.value);
  });
  CHECK_EQ(seen, ref.size());
  t.Clear();
  CHECK_EQ(t.size(), size_t{0});
  CHECK(t.Find(ClusteredTraits::Hash(5), eq(5)) == nullptr);
}

// Inserts, erases and growths keep the table's invariant (RobinTable::Valid) and every key,
// for spread hashes, clustered ones, and hashes bunched at the top of the range (clusters that
// run into the tail past the last home, and make it grow: GrowTail).
struct SpreadTraits {
  using Slot = ClusteredSlot;
  static constexpr size_t kMaxLoadPercent = 90;
  static constexpr size_t kGrowthPercent = 150;
  static constexpr bool kEmptyIsZero = true;
  static bool Empty(const Slot& s) { return s.key == 0; }
  static Slot EmptySlot() { return Slot{0, 0}; }
  static uint64_t HomeHash(const Slot& s) { return s.value; }  // the test picks the hash
};

TEST(robin_table_growth_keeps_order_and_keys) {
  std::mt19937_64 rng(3);
  for (int shape = 0; shape < 4; ++shape) {
    kvroute::RobinTable<SpreadTraits> t;
    std::vector<std::pair<uint64_t, uint64_t>> keys;  // (key, hash)
    for (uint64_t k = 1; k <= 20000; ++k) {
      uint64_t h = rng();
      if (shape == 1) h = (h % 5) << 61 | (h & 7);            // 5 homes, long clusters
      if (shape == 2) h = ~uint64_t{0} - (h >> 50);           // all at the very top: the tail grows
      if (shape == 3) h = (k % 2) ? ~uint64_t{0} - (h >> 52) : (h >> 52);  // both ends
      keys.push_back({k, h});
      t.FindOrInsert(h, [k](const ClusteredSlot& x) { return x.key == k; },
                     [k, h] { return ClusteredSlot{k, h}; });
      if (k % 997 == 0 || t.size() * 100 > t.capacity() * 89) CHECK(t.Valid());
      if (k % 3 == 0) {  // erase some, so that growths see holes
        const auto [ek, eh] = keys[static_cast<size_t>(rng() % keys.size())];
        auto* slot = t.Find(eh, [ek = ek](const ClusteredSlot& x) { return x.key == ek; });
        if (slot != nullptr) t.Erase(slot);
      }
    }
    CHECK(t.Valid());
    kvroute::RobinTable<SpreadTraits> big;
    t.GrowInto(t.size() * 3, &big);  // several steps at once
    CHECK(big.Valid());
    CHECK_EQ(big.size(), t.size());
    size_t found = 0;
    t.ForEach([&](const ClusteredSlot& e) {
      const uint64_t k = e.key;
      found += big.Find(e.value, [k](const ClusteredSlot& x) { return x.key == k; }) != nullptr;
    });
    CHECK_EQ(found, t.size());
  }
}

// Growth places the entries in one ordered pass (RobinTable::PlaceInOrder), which relies on
// the array being sorted by hash and doubles the tail when the entries would run past it.
// Small tables make the edge cases common: clusters into the tail, many keys on one home,
// hashes bunched at the top, at the same capacity and several steps up.
TEST(robin_table_one_pass_growth_of_small_tables) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20000; ++trial) {
    kvroute::RobinTable<SpreadTraits> t;
    const int n = 1 + static_cast<int>(rng() % 57);  // up to 90 % of the first 64 slots
    const int mode = static_cast<int>(rng() % 4);
    const uint64_t center = rng();
    for (uint64_t k = 1; k <= static_cast<uint64_t>(n); ++k) {
      uint64_t h = rng();
      if (mode == 1) h = center + (rng() >> (rng() % 64));           // bunched anywhere
      if (mode == 2) h = (rng() % 3) * (~uint64_t{0} / 3) + (rng() >> 58);  // three homes
      if (mode == 3) h = ~uint64_t{0} - (rng() >> (4 + rng() % 8));  // at the top: into the tail
      t.FindOrInsert(h, [k](const ClusteredSlot& x) { return x.key == k; },
                     [k, h] { return ClusteredSlot{k, h}; });
    }
    CHECK(t.Valid());
    for (size_t extra : {size_t{1}, size_t{7}, size_t{40}, size_t{400}}) {
      kvroute::RobinTable<SpreadTraits> big;
      t.GrowInto(extra, &big);
      CHECK(big.Valid());
      CHECK_EQ(big.size(), t.size());
      CHECK(big.capacity() >= t.capacity());
      size_t found = 0;
      t.ForEach([&](const ClusteredSlot& e) {
        const uint64_t k = e.key;
        found += big.Find(e.value, [k](const ClusteredSlot& x) { return x.key == k; }) != nullptr;
      });
      CHECK_EQ(found, t.size());
    }
  }
}

// Side bytes (RobinTable::EnableSide) move with their slots through inserts, backward-shift
// erases, clusters into the tail and growth; the engine tables keep the caps'
// stamps there. Enabled part-way, as the index does when a worker nears a cap.
template <typename Traits, typename HashOf>
void CheckSideBytes(HashOf hash_of, uint64_t seed) {
  kvroute::RobinTable<Traits> t;
  std::unordered_map<uint64_t, uint8_t> ref;  // key -> expected side byte
  std::mt19937_64 rng(seed);
  auto eq = [](uint64_t k) { return [k](const ClusteredSlot& s) { return s.key == k; }; };
  for (int step = 0; step < 40000; ++step) {
    if (step == 15000) {
      CHECK(!t.has_side());
      t.EnableSide(0xAB);
      for (auto& [k, b] : ref) b = 0xAB;
    }
    const uint64_t k = 1 + rng() % 3000;
    const uint64_t h = hash_of(k);
    const int op = static_cast<int>(rng() % 10);
    if (op < 6) {
      auto [slot, inserted] = t.FindOrInsert(h, eq(k), [k, h] { return ClusteredSlot{k, h}; });
      CHECK_EQ(inserted, ref.find(k) == ref.end());
      if (t.has_side()) {
        if (inserted) CHECK_EQ(int{t.Side(slot)}, 0);  // a new slot's byte starts at 0
        t.Side(slot) = static_cast<uint8_t>(step);
      }
      ref[k] = static_cast<uint8_t>(step);
    } else if (op < 8) {
      auto* slot = t.Find(h, eq(k));
      CHECK_EQ(slot != nullptr, ref.count(k) == 1);
      if (slot != nullptr) {
        t.Erase(slot);
        ref.erase(k);
      }
    } else if (t.has_side()) {
      const auto* slot = t.Find(h, eq(k));
      CHECK_EQ(slot != nullptr, ref.count(k) == 1);
      if (slot != nullptr) CHECK_EQ(int{t.Side(slot)}, int{ref[k]});
    }
  }
  CHECK(t.Valid());
  CHECK_EQ(t.side_bytes(), t.slot_count() + 1);
  size_t checked = 0;
  for (const auto& [k, b] : ref) {
    const auto* slot = t.Find(hash_of(k), eq(k));
    CHECK(slot != nullptr);
    if (slot != nullptr) checked += t.Side(slot) == b;
  }
  CHECK_EQ(checked, ref.size());
  kvroute::RobinTable<Traits> big;
  t.GrowInto(t.size() * 3, &big);
  CHECK(big.has_side());
  checked = 0;
  for (const auto& [k, b] : ref) {
    const auto* slot = big.Find(hash_of(k), eq(k));
    if (slot != nullptr) checked += big.Side(slot) == b;
  }
  CHECK_EQ(checked, ref.size());
  big.Clear();
  CHECK(!big.has_side() && big.side_bytes() == 0);
}

// A grown table's slots fill the pages of its mapping (RobinTable::PageFilled): the last
// page's spare room is homes, not slack, so the table holds more before its next growth.
TEST(robin_table_growth_fills_its_pages) {
  kvroute::RobinTable<SpreadTraits> t;
  size_t last_cap = t.capacity(), mapped_growths = 0;
  for (uint64_t k = 1; k <= 200000; ++k) {
    const uint64_t h = Fmix64(k);
    t.FindOrInsert(h, [k](const ClusteredSlot& x) { return x.key == k; },
                   [k, h] { return ClusteredSlot{k, h}; });
    if (t.capacity() == last_cap) continue;
    last_cap = t.capacity();
    using Alloc = kvroute::HugePageAllocator<ClusteredSlot>;
    const size_t bytes = t.bytes();
    if (bytes < Alloc::kMapped) continue;  // malloc'd: no pages of its own
    ++mapped_growths;
    CHECK(Alloc::Len(bytes) - bytes < 2 * sizeof(ClusteredSlot));
    CHECK(t.size() * 100 <= t.capacity() * 90);
  }
  CHECK(mapped_growths >= 10);
  CHECK(t.Valid());
}

TEST(robin_table_side_bytes_follow_their_slots) {
  // Clustered homes (long runs and shifts) and hashes bunched at the top
  // of the range (clusters into the tail).
  CheckSideBytes<SpreadTraits>([](uint64_t k) { return ClusteredTraits::Hash(k); }, 11);
  CheckSideBytes<SpreadTraits>([](uint64_t k) { return ~uint64_t{0} - (Fmix64(k) >> 54); }, 12);
  CheckSideBytes<SpreadTraits>([](uint64_t k) { return Fmix64(k); }, 13);
}

// HolderSet against a plain map of (worker -> per-tier counts): holders, the moves between its
// forms (one inline, two inline, heap; back when holders leave; a count past an inline
// field), saturation at kMaxRefs, and the signature, which must stay the XOR of
// HolderSig(worker, tier mask) over the holders (the prefix walk trusts it).
TEST(holder_set_matches_a_map_and_keeps_its_signature) {
  kvroute::HolderPool pool;
  kvroute::HolderSet hs;
  std::map<kvroute::WorkerId, std::array<uint32_t, 3>> ref;
  std::mt19937_64 rng(11);
  int64_t heap = 0;
  const kvroute::WorkerId big = 70000;  // too large for the two-inline form
  for (int step = 0; step < 20000; ++step) {
    // Phases: two workers (inline forms), three (to the heap and back), many, large ids.
    const int phase = (step / 1000) % 4;
    const kvroute::WorkerId n = phase == 0 ? 2 : phase == 1 ? 3 : phase == 2 ? 40 : 2;
    const kvroute::WorkerId w = static_cast<kvroute::WorkerId>(rng() % n) + (phase == 3 ? big : 0);
    const int tier = static_cast<int>(rng() % 3);
    const int op = static_cast<int>(rng() % 8);
    int64_t d = 0;
    if (op < 4) {
      const uint32_t times = op == 0 ? 20 : 1;  // pushes a two-inline count past 15
      for (uint32_t k = 0; k < times; ++k) {
        bool added_holder = false;
        const bool room = ref.count(w) == 0 || ref[w][tier] < kvroute::HolderSet::kMaxRefs;
        // Half the time through AddInline first (the Index's store fast path): it takes only
        // a new holder that stays inline, and AddRef the rest.
        const bool inline_first = (step + k) % 2 == 0;
        if (inline_first && hs.AddInline(w, tier)) {
          CHECK(ref.count(w) == 0 && ref.size() <= 1);
          d = 0;
          added_holder = true;
        } else {
          CHECK_EQ(hs.AddRef(pool, w, tier, &added_holder, &d), room);
        }
        heap += d;
        CHECK_EQ(added_holder, ref.count(w) == 0);
        if (room) ++ref[w][tier];
      }
    } else {
      const uint32_t n_drop = op == 4 ? 20 : 1;
      const bool gone = hs.DropRef(pool, w, tier, n_drop, &d);
      heap += d;
      bool want_gone = false;
      auto it = ref.find(w);
      if (it != ref.end()) {
        it->second[tier] = it->second[tier] > n_drop ? it->second[tier] - n_drop : 0;
        if (it->second == std::array<uint32_t, 3>{0, 0, 0}) {
          ref.erase(it);
          want_gone = true;
        }
      }
      CHECK_EQ(gone, want_gone);
    }
    CHECK_EQ(hs.size(), static_cast<uint32_t>(ref.size()));
    CHECK_EQ(hs.empty(), ref.empty());
    uint64_t sig = 0;
    for (const auto& [rw, refs] : ref) sig ^= kvroute::HolderSig(rw, kvroute::TierMask(refs));
    CHECK_EQ(hs.Signature(), sig);
    std::map<kvroute::WorkerId, uint8_t> seen;
    hs.ForEach([&](kvroute::WorkerId x, uint8_t mask) { seen[x] = mask; });
    CHECK_EQ(seen.size(), ref.size());
    for (const auto& [rw, refs] : ref) {
      CHECK_EQ(seen[rw], kvroute::TierMask(refs));
      CHECK(hs.Any([rw = rw](kvroute::WorkerId x) { return x == rw; }));
    }
    CHECK(!hs.Any([](kvroute::WorkerId x) { return x == 12345; }));
    CHECK_EQ(static_cast<uint64_t>(heap), hs.HeapBytes());
    if (ref.size() <= 1) CHECK_EQ(hs.HeapBytes(), uint64_t{0});  // a lone holder is inline
    CHECK_EQ(pool.size(), hs.HeapBytes() > 0 ? size_t{1} : size_t{0});  // old arrays freed
    if (step % 50 == 0 && ref.size() >= 3) {
      // The same holders built afresh, in another order: the same interned array (the
      // content hash kept up by each update equals the one computed from scratch).
      kvroute::HolderSet fresh;
      bool a = false;
      int64_t dd = 0;
      for (auto it = ref.rbegin(); it != ref.rend(); ++it) {
        for (int t = 0; t < 3; ++t) {
          for (uint32_t k = 0; k < it->second[t]; ++k) fresh.AddRef(pool, it->first, t, &a, &dd);
        }
      }
      CHECK_EQ(fresh.RunKey(), hs.RunKey());
      CHECK_EQ(pool.size(), size_t{1});
      fresh.Release(pool);
    }
  }
  hs.Release(pool);
  CHECK(hs.empty());
  CHECK_EQ(pool.size(), size_t{0});
  // Saturation, inline and on the heap: kMaxRefs references are taken, the next is refused.
  for (const kvroute::WorkerId others : {0u, 2u}) {
    kvroute::HolderSet s;
    bool added = false;
    int64_t d = 0;
    for (kvroute::WorkerId o = 0; o < others; ++o) s.AddRef(pool, 100 + o, 0, &added, &d);
    for (uint32_t k = 0; k < kvroute::HolderSet::kMaxRefs; ++k) CHECK(s.AddRef(pool, 7, 1, &added, &d));
    CHECK(!s.AddRef(pool, 7, 1, &added, &d));
    CHECK(s.AddRef(pool, 7, 2, &added, &d));  // another tier has room
    CHECK(!s.DropRef(pool, 7, 1, kvroute::HolderSet::kMaxRefs, &d));
    CHECK(s.DropRef(pool, 7, 2, 1, &d));
    CHECK_EQ(s.size(), others);
    s.Release(pool);
  }
}

// Sets with the same holders and counts share one interned array (the run key is the word,
// so they compare equal without reading it); an update copies on write and leaves the others
// alone; the last release frees the array.
TEST(holder_sets_with_equal_holders_share_one_array) {
  kvroute::HolderPool pool;
  std::vector<kvroute::HolderSet> sets(50);
  bool added = false;
  int64_t bytes = 0, d = 0;
  for (auto& s : sets) {
    for (const kvroute::WorkerId w : {9u, 3u, 70000u, 5u}) {  // order differs from sorted
      CHECK(s.AddRef(pool, w, 0, &added, &d));
      bytes += d;
    }
  }
  CHECK_EQ(pool.size(), size_t{1});
  CHECK_EQ(static_cast<uint64_t>(bytes), sets[0].HeapBytes());
  for (const auto& s : sets) CHECK_EQ(s.RunKey(), sets[0].RunKey());
  // Another order of the same adds: the same array.
  kvroute::HolderSet other;
  for (const kvroute::WorkerId w : {5u, 70000u, 9u, 3u}) {
    other.AddRef(pool, w, 0, &added, &d);
    bytes += d;
  }
  CHECK_EQ(other.RunKey(), sets[0].RunKey());
  // A CPU copy on one set: a second array for it alone; the signature follows.
  CHECK(sets[7].AddRef(pool, 3, 1, &added, &d));
  bytes += d;
  CHECK(!added);
  CHECK_EQ(pool.size(), size_t{2});
  CHECK(sets[7].RunKey() != sets[0].RunKey());
  CHECK_EQ(sets[7].Signature() ^ sets[0].Signature(),
           kvroute::HolderSig(3, 1) ^ kvroute::HolderSig(3, 3));
  // Dropping it again comes back to the shared array, and the private one is freed.
  CHECK(!sets[7].DropRef(pool, 3, 1, 1, &d));
  bytes += d;
  CHECK_EQ(sets[7].RunKey(), sets[0].RunKey());
  CHECK_EQ(pool.size(), size_t{1});
  CHECK_EQ(static_cast<uint64_t>(bytes), sets[0].HeapBytes());
  // Holders leave one set down to one (inline): the others keep theirs.
  for (const kvroute::WorkerId w : {9u, 70000u, 5u}) {
    sets[0].DropRef(pool, w, 0, 1, &d);
    bytes += d;
  }
  CHECK_EQ(sets[0].size(), 1u);
  CHECK_EQ(sets[0].HeapBytes(), uint64_t{0});
  CHECK_EQ(sets[1].size(), 4u);
  for (size_t i = 1; i < sets.size(); ++i) bytes -= sets[i].Release(pool);
  bytes -= other.Release(pool);
  sets[0].Release(pool);
  CHECK_EQ(pool.size(), size_t{0});
  CHECK_EQ(bytes, int64_t{0});
}

// A freed table's mapping is kept for the next table (MappingCache), which must get it back as
// zeroes like a fresh mapping (an all-zero slot is an empty one): at its own length, or
// extended to a longer one by mremap. What is kept stays within MappingCache::kMaxBytes, the
// mapping kept longest ago going first.
TEST(a_kept_mapping_comes_back_zeroed) {
  using kvroute::MappingCache;
  kvroute::HugePageAllocator<uint64_t> alloc;
  MappingCache::Release();  // (earlier tests' tables)
  const size_t n = (12u << 10) / sizeof(uint64_t);  // 12 KiB: mapped, and kept when freed
  auto scribble = [](uint64_t* p, size_t len) {
    for (size_t i = 0; i < len; ++i) p[i] = i * 2654435761u + 1;
  };
  auto all_zero = [](const uint64_t* p, size_t len) {
    for (size_t i = 0; i < len; ++i) {
      if (p[i] != 0) return false;
    }
    return true;
  };
  // Tables take kept mappings only when they are allocated to be filled (populate).
  auto table = [&](size_t len) { return alloc.allocate(len, true, /*populate=*/true); };
  auto mapped = [](const void* p, size_t bytes) {  // every page of the range is mapped
    std::vector<unsigned char> pages((bytes + 4095) / 4096);
    return mincore(const_cast<void*>(p), bytes, pages.data()) == 0;
  };
  uint64_t* a = table(n);
  CHECK(all_zero(a, n));
  scribble(a, n);
  alloc.deallocate(a, n);
  CHECK_EQ(MappingCache::kept_bytes(), size_t{12} << 10);
  // A mapping that should take pages as it fills (the block slab's first chunk) leaves it.
  uint64_t* lazy = alloc.allocate(n + 3 * 512, /*huge=*/false);
  CHECK_EQ(MappingCache::kept_bytes(), size_t{12} << 10);
  alloc.deallocate(lazy, n + 3 * 512);
  MappingCache::Release();
  a = table(n);
  scribble(a, n);
  alloc.deallocate(a, n);
  uint64_t* b = table(n);
  CHECK(b == a);  // the kept mapping, not a fresh one
  CHECK_EQ(MappingCache::kept_bytes(), size_t{0});
  CHECK(all_zero(b, n));
  scribble(b, n);
  alloc.deallocate(b, n);
  // A longer table takes it, extended (mremap; not under TSan, which cannot follow a moved
  // mapping): zero throughout, every page mapped and writable.
  const size_t longer = n + 3 * 512;  // 24 KiB
#if defined(__linux__) && !defined(KVROUTE_NO_MREMAP)
  CHECK(MappingCache::kCanExtend);  // (the extension is not lost to a preprocessor slip)
#endif
  uint64_t* c = table(longer);
  CHECK_EQ(MappingCache::kept_bytes(),
           kvroute::MappingCache::kCanExtend ? size_t{0} : size_t{12} << 10);
  CHECK(mapped(c, longer * sizeof(uint64_t)));
  CHECK(all_zero(c, longer));
  scribble(c, longer);
  alloc.deallocate(c, longer);
  MappingCache::Release();
  alloc.deallocate(table(longer), longer);
  // A shorter one is not served from it.
  uint64_t* d = table(n);
  CHECK_EQ(MappingCache::kept_bytes(), size_t{24} << 10);
  CHECK(all_zero(d, n));
  alloc.deallocate(d, n);
  MappingCache::Release();
  CHECK_EQ(MappingCache::kept_bytes(), size_t{0});
  // Past the budget the oldest goes: three 768 KiB mappings keep the last two.
  const size_t big = (768u << 10) / sizeof(uint64_t);
  static_assert((768u << 10) < MappingCache::kBelow && 3 * (768u << 10) > MappingCache::kMaxBytes &&
                    2 * (768u << 10) <= MappingCache::kMaxBytes,
                "the case needs room for two 768 KiB mappings, not three");
  uint64_t* m[3];
  for (auto& p : m) p = table(big);
  for (auto* p : m) alloc.deallocate(p, big);
  CHECK_EQ(MappingCache::kept_bytes(), size_t{1536} << 10);
  uint64_t* e = table(big);
  uint64_t* f = table(big);
  CHECK((e == m[1] && f == m[2]) || (e == m[2] && f == m[1]));
  CHECK_EQ(MappingCache::kept_bytes(), size_t{0});
  alloc.deallocate(e, big);
  alloc.deallocate(f, big);
  MappingCache::Release();
}

// Two workers store long chains at once while a third thread looks up: the tables grow many
// times (outside the write lock, swapped in under it), and every chain must end up whole.
TEST(index_grows_its_tables_while_two_workers_store_and_one_reads) {
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
      for (uint32_t i = 0; i < kBlocks; ++i) hashes[i] = uint64_t{base} * 1000 + k * kBlocks + i + 1;
      ix.Apply(w, StoredEv(hashes, std::nullopt, Range(first, kBlocks * 16)), &c);
    }
    CHECK_EQ(c.blocks_stored, uint64_t{kChains} * kBlocks);
  };
  std::thread ta([&] { store(a, 1000); });
  std::thread tb([&] { store(b, 50000000); });
  ta.join();
  tb.join();
  done.store(true);
  reader.join();
  CHECK(lookups.load() > 0);
  CHECK_EQ(ix.DistinctKeys(), uint64_t{2} * kChains * kBlocks);
  CHECK_EQ(ix.Entries(), uint64_t{2} * kChains * kBlocks);
  CHECK_EQ(ix.WorkerBlocks(a), uint64_t{kChains} * kBlocks);
  for (const auto& [w, base] : {std::pair{a, 1000u}, std::pair{b, 50000000u}}) {
    for (uint32_t k = 0; k < kChains; k += 7) {
      const auto m = Match(ix, Keys(Range(base + k * kBlocks * 16, kBlocks * 16)));
      CHECK_EQ(m.blocks[w], kBlocks);
    }
  }
}

TEST(index_store_chain_and_match) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  CHECK_EQ(a, 0u);
  CHECK_EQ(b, 1u);
  const auto toks = Range(100, 64);  // 4 blocks
  const auto keys = Keys(toks);
  ApplyCounts ca, cb;
  ix.Apply(a, StoredEv({11, 12, 13}, std::nullopt, Range(100, 48)), &ca);
  ix.Apply(b, StoredEv({21, 22}, std::nullopt, Range(100, 32)), &cb);
  CHECK_EQ(ca.blocks_stored, 3u);
  CHECK_EQ(ca.events, 1u);
  auto m = Match(ix, keys);
  CHECK_EQ(m.blocks.size(), 2u);
  CHECK_EQ(m.blocks[a], 3u);
  CHECK_EQ(m.blocks[b], 2u);
  CHECK(m.weighted[a] == 3.0);
  CHECK_EQ(m.max_blocks, 3u);
  // Continue a's chain from its last engine hash.
  ix.Apply(a, StoredEv({14}, 13, Range(148, 16)), &ca);
  m = Match(ix, keys);
  CHECK_EQ(m.blocks[a], 4u);
  CHECK_EQ(ix.DistinctKeys(), 4u);
  CHECK_EQ(ix.Entries(), 6u);
  CHECK_EQ(ix.WorkerBlocks(a), 4u);
  CHECK_EQ(ix.WorkerBlocks(b), 2u);
  // A different first block matches nothing, even if later blocks are equal.
  auto other = Range(100, 64);
  other[0] = 5;
  m = Match(ix, Keys(other));
  CHECK_EQ(m.max_blocks, 0u);
  // Removing a middle block ends a's prefix there.
  ix.Apply(a, RemovedEv({12}), &ca);
  CHECK_EQ(ca.blocks_removed, 1u);
  m = Match(ix, keys);
  CHECK_EQ(m.blocks[a], 1u);
  CHECK_EQ(m.blocks[b], 2u);
  CHECK_EQ(m.max_blocks, 2u);
  // WorkerEntries: 3 hashes left on a, each one GPU ref.
  auto ents = ix.WorkerEntries(a);
  CHECK_EQ(ents.size(), 3u);
  for (const auto& e : ents) CHECK(e.refs[0] == 1 && e.refs[1] == 0 && e.refs[2] == 0);
}

TEST(index_orphans_and_apply_time_drops) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  ix.Apply(a, StoredEv({1, 2}, 999, Range(0, 32)), &c);  // parent unknown
  CHECK_EQ(c.orphan_stores, 2u);
  CHECK_EQ(ix.WorkerBlocks(a), 0u);
  ix.Apply(a, StoredEv({1}, std::nullopt, Range(0, 32), 32), &c);  // block size 32 != 16
  CHECK_EQ(c.drops.Get(DropReason::kBlockSizeMismatch), 1u);
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 31)), &c);  // 31 tokens for 2 blocks
  CHECK_EQ(c.drops.Get(DropReason::kBadTokenCount), 1u);
  Event sw = StoredEv({1}, std::nullopt, Range(0, 16));
  sw.kv_cache_spec_kind = "sliding_window";
  ix.Apply(a, sw, &c);
  CHECK_EQ(c.drops.Get(DropReason::kUnsupportedSpec), 1u);
  Event fa = StoredEv({1}, std::nullopt, Range(0, 16));
  fa.kv_cache_spec_kind = "full_attention";
  fa.medium_known = false;
  ix.Apply(a, fa, &c);
  CHECK_EQ(c.unknown_medium, 1u);
  CHECK_EQ(ix.WorkerBlocks(a), 1u);
  CHECK_EQ(c.events, 5u);
  ix.Apply(a, RemovedEv({777}), &c);
  CHECK_EQ(c.unknown_removes, 1u);
}

TEST(index_refcounts_and_tiers) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  const auto keys = Keys(Range(0, 16));
  ApplyCounts c;
  // Stored twice (vLLM does not de-duplicate): needs two removes.
  ix.Apply(a, StoredEv({5}, std::nullopt, Range(0, 16)), &c);
  ix.Apply(a, StoredEv({5}, std::nullopt, Range(0, 16)), &c);
  ix.Apply(a, RemovedEv({5}), &c);
  CHECK_EQ(Match(ix, keys).blocks[a], 1u);
  ix.Apply(a, RemovedEv({5}), &c);
  CHECK_EQ(Match(ix, keys).blocks[a], 0u);
  ix.Apply(a, RemovedEv({5}), &c);
  CHECK_EQ(c.unknown_removes, 1u);
  CHECK_EQ(ix.Entries(), 0u);
  CHECK_EQ(ix.DistinctKeys(), 0u);

  // GPU + CPU copies; the best tier is credited.
  ix.Apply(a, StoredEv({6}, std::nullopt, Range(0, 16)), &c);
  Event cpu = StoredEv({6}, std::nullopt, {}, 0, Medium::kCpu);  // CPU placeholder
  ix.Apply(a, cpu, &c);
  auto m = Match(ix, keys);
  CHECK(m.weighted[a] == 1.0);
  ix.Apply(a, RemovedEv({6}, Medium::kGpu), &c);
  m = Match(ix, keys);
  CHECK_EQ(m.blocks[a], 1u);
  CHECK(std::fabs(m.weighted[a] - 0.8) < 1e-12);
  auto ents = ix.WorkerEntries(a);
  CHECK(ents.size() == 1 && ents[0].refs[0] == 0 && ents[0].refs[1] == 1);
  ix.Apply(a, StoredEv({6}, std::nullopt, Range(0, 16), 16, Medium::kDisk), &c);
  ix.Apply(a, RemovedEv({6}, Medium::kCpu), &c);
  m = Match(ix, keys);
  CHECK(std::fabs(m.weighted[a] - 0.25) < 1e-12);
  ix.Apply(a, RemovedEv({6}, Medium::kDisk), &c);
  CHECK_EQ(Match(ix, keys).blocks[a], 0u);
  CHECK_EQ(ix.WorkerBlocks(a), 0u);
  // Placeholder for an unknown hash: an orphan, nothing indexed.
  const uint64_t before = c.orphan_stores;
  ix.Apply(a, cpu, &c);
  CHECK_EQ(c.orphan_stores, before + 1);
  CHECK_EQ(ix.Entries(), 0u);
}

// Reference counts per (engine hash, tier) against a model, through the engine slot's two
// forms: one tier bit per tier, and exact counts in the side map once a tier holds the same
// engine hash twice (kRefsMany), and back.
TEST(index_refcounts_match_a_model) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  const Medium tiers[kNumMedia] = {Medium::kGpu, Medium::kCpu, Medium::kDisk};
  constexpr uint64_t kHashes = 6;
  std::array<std::array<uint32_t, kNumMedia>, kHashes> model{};
  std::mt19937_64 rng(21);
  ApplyCounts c;
  uint64_t unknown = 0;
  for (int step = 0; step < 20000; ++step) {
    const uint64_t h = rng() % kHashes;
    const int t = static_cast<int>(rng() % kNumMedia);
    if (rng() % 100 < 52) {  // slightly more stores than removes: counts reach 3-5
      ix.Apply(a, StoredEv({100 + h}, std::nullopt, Range(static_cast<uint32_t>(h) * 16, 16), 16,
                           tiers[t]), &c);
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
    CHECK_EQ(c.unknown_removes, unknown);
    uint64_t held = 0;
    for (const auto& m : model) held += (m[0] + m[1] + m[2]) > 0;
    CHECK_EQ(ix.Entries(), held);
    CHECK_EQ(ix.WorkerBlocks(a), held);
    for (const auto& e : ix.WorkerEntries(a)) {
      const uint64_t i = e.hash.lo - 100;
      CHECK(i < kHashes);
      if (i >= kHashes) continue;
      for (int k = 0; k < kNumMedia; ++k) CHECK_EQ(uint32_t{e.refs[k]}, model[i][k]);
    }
    // The match credits the best tier that holds the block.
    const uint64_t i = rng() % kHashes;
    const auto m = Match(ix, Keys(Range(static_cast<uint32_t>(i) * 16, 16)));
    const double want = model[i][0] > 0 ? 1.0 : model[i][1] > 0 ? 0.8 : model[i][2] > 0 ? 0.25 : 0.0;
    CHECK(std::fabs(m.weighted[a] - want) < 1e-12);
  }
}

// The total cap evicts from the largest worker even if that worker has no store stamps yet
// (it stored only before the index was half-way to the cap): its entries count as equally old.
TEST(index_total_cap_evicts_a_worker_without_stamps) {
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
  CHECK_EQ(ix.Entries(), 100u);
  CHECK_EQ(ix.WorkerBlocks(a), 40u);
  CHECK_EQ(ix.WorkerEvictedByCap(a), 9u);
  CHECK_EQ(ix.WorkerBlocks(b), 30u);
  CHECK_EQ(ix.WorkerBlocks(d), 30u);
  CHECK_EQ(ix.WorkerEvictedByCap(b) + ix.WorkerEvictedByCap(d), 0u);
}

// The prefix walk takes the record after the previous block's as the next block's when two
// blocks' records were adjacent (one event's records are allocated in order), checking the
// whole key and that the record is live. Records freed and reused by another chain, in
// reverse order, free records, and a chain that crosses a slab chunk must all give the same
// depths as the table.
TEST(index_walk_guesses_the_next_record_exactly) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  ApplyCounts c;
  const auto x = Range(0, 8 * 16), y = Range(5000, 3 * 16);
  std::vector<uint64_t> xh, yh;
  for (uint64_t i = 0; i < 8; ++i) xh.push_back(100 + i);
  for (uint64_t i = 0; i < 3; ++i) yh.push_back(200 + i);
  ix.Apply(a, StoredEv(xh, std::nullopt, x), &c);
  CHECK_EQ(Match(ix, Keys(x)).blocks[a], 8u);
  ix.Apply(a, RemovedEv({103, 104, 105}), &c);  // frees the records of blocks 3-5
  CHECK_EQ(Match(ix, Keys(x)).blocks[a], 3u);
  ix.Apply(b, StoredEv(yh, std::nullopt, y), &c);  // reuses them, last freed first
  auto m = Match(ix, Keys(x));
  CHECK(m.blocks[a] == 3u && m.blocks[b] == 0u);
  m = Match(ix, Keys(y));
  CHECK(m.blocks[b] == 3u && m.blocks[a] == 0u);
  // a holds Y too: the record after X[2]'s is now live and held by a, so only the key
  // comparison keeps the walk from crediting a with X[3].
  ix.Apply(a, StoredEv({300, 301, 302}, std::nullopt, y), &c);
  m = Match(ix, Keys(y));
  CHECK(m.blocks[a] == 3u && m.blocks[b] == 3u);
  CHECK_EQ(Match(ix, Keys(x)).blocks[a], 3u);
  ix.Apply(b, RemovedEv(yh), &c);
  ix.Apply(a, RemovedEv({302}), &c);  // Y[2]'s record (after X[2]'s) is free again
  m = Match(ix, Keys(y));
  CHECK(m.blocks[a] == 2u && m.blocks[b] == 0u);
  CHECK_EQ(Match(ix, Keys(x)).blocks[a], 3u);
  // One chain across the end of the first slab chunk (131,072 records).
  const uint32_t n = static_cast<uint32_t>(kvroute::BlockSlab::kChunk) + 40;
  const auto big = Range(1u << 24, n * 16);
  std::vector<uint64_t> bh(n);
  for (uint32_t i = 0; i < n; ++i) bh[i] = 1000000 + i;
  ix.Apply(b, StoredEv(bh, std::nullopt, big), &c);
  m = Match(ix, Keys(big));
  CHECK(m.blocks[b] == n && m.blocks[a] == 0u);
  ix.Apply(b, RemovedEv({1000000 + n - 10}), &c);
  CHECK_EQ(Match(ix, Keys(big)).blocks[b], n - 10);
}

// The walk's loop for the common case (a run open, the probe stage on a chain of records)
// must hand over to the general path wherever that case ends: the run's holders change in the
// middle of a chain, a chain's record is freed, or freed and reused by another block.
TEST(index_walk_fast_loop_stops_where_it_must) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker(), c = ix.AddWorker();
  ApplyCounts cnt;
  const uint32_t n = 100;
  auto x = Range(7u << 20, n * 16);
  std::vector<uint64_t> ah, bh;
  for (uint32_t i = 0; i < n; ++i) ah.push_back(10000 + i);
  for (uint32_t i = 0; i < 60; ++i) bh.push_back(20000 + i);
  ix.Apply(a, StoredEv(ah, std::nullopt, x), &cnt);  // one chain of 100 records
  CHECK_EQ(Match(ix, Keys(x)).blocks[a], n);
  ix.Apply(b, StoredEv(bh, std::nullopt, std::vector<uint32_t>(x.begin(), x.begin() + 60 * 16)),
           &cnt);  // the run's holders change at block 60, in the middle of the chain
  auto m = Match(ix, Keys(x));
  CHECK(m.blocks[a] == n && m.blocks[b] == 60u && m.blocks[c] == 0u);
  ix.Apply(a, RemovedEv({10000 + 80}), &cnt);  // block 80's record is freed
  m = Match(ix, Keys(x));
  CHECK(m.blocks[a] == 80u && m.blocks[b] == 60u);
  const auto y = Range(9u << 20, 16);
  ix.Apply(c, StoredEv({30000}, std::nullopt, y), &cnt);  // reuses that record for another key
  m = Match(ix, Keys(x));
  CHECK(m.blocks[a] == 80u && m.blocks[b] == 60u && m.blocks[c] == 0u);
  CHECK_EQ(Match(ix, Keys(y)).blocks[c], 1u);
  auto longer = x;  // the prompt goes on past what anyone holds
  const auto tail = Range(11u << 20, 40 * 16);
  longer.insert(longer.end(), tail.begin(), tail.end());
  m = Match(ix, Keys(longer));
  CHECK(m.blocks[a] == 80u && m.blocks[b] == 60u);
  m = Match(ix, Keys(std::vector<uint32_t>(x.begin(), x.begin() + 70 * 16)));
  CHECK(m.blocks[a] == 70u && m.blocks[b] == 60u && m.max_blocks == 70u);
}

TEST(index_hash_rebound) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  ix.Apply(a, StoredEv({5}, std::nullopt, Range(0, 16)), &c);
  ix.Apply(a, StoredEv({5}, std::nullopt, Range(1000, 16)), &c);
  CHECK_EQ(c.hash_rebound, 1u);
  CHECK_EQ(Match(ix, Keys(Range(0, 16))).blocks[a], 0u);
  CHECK_EQ(Match(ix, Keys(Range(1000, 16))).blocks[a], 1u);
  CHECK_EQ(ix.DistinctKeys(), 1u);
  ix.Apply(a, RemovedEv({5}), &c);
  CHECK_EQ(ix.DistinctKeys(), 0u);
}

TEST(index_lora_and_extra_keys) {
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
  CHECK_EQ(Match(ix, Keys(Range(0, 16))).max_blocks, 0u);
  CHECK_EQ(Match(ix, Keys(Range(0, 16), 16, "adapter")).blocks[a], 1u);
  CHECK_EQ(Match(ix, Keys(Range(0, 16), 16, "#lora_id:3")).blocks[a], 1u);
  Event x = StoredEv({3, 4}, std::nullopt, Range(0, 32));
  const std::string salt = Enc(A({S("s")}));
  x.extra_keys = {salt};
  ix.Apply(a, x, &c);
  const std::vector<std::string> extras = {salt};
  CHECK_EQ(Match(ix, Keys(Range(0, 32), 16, {}, &extras)).blocks[a], 2u);
  CHECK_EQ(Match(ix, Keys(Range(0, 32))).blocks[a], 0u);
}

TEST(index_clear_and_remove_worker) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  const auto keys = Keys(Range(0, 64));
  ApplyCounts ca, cb;
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32)), &ca);
  ix.Apply(b, StoredEv({1, 2, 3}, std::nullopt, Range(0, 48)), &cb);
  ix.AddSpeculative(a, keys.data() + 2, 2, 10.0, 5.0);
  CHECK_EQ(Match(ix, keys, 11).blocks[a], 4u);
  ix.ClearWorker(a);
  CHECK_EQ(ix.WorkerBlocks(a), 0u);
  auto m = Match(ix, keys, 11);
  CHECK_EQ(m.blocks[a], 0u);  // the speculative run starts at block 2: unreachable now
  CHECK_EQ(m.blocks[b], 3u);
  CHECK_EQ(ix.SpeculativeEntries(), 2u);  // kept until expiry
  // AllBlocksCleared through Apply.
  ix.Apply(b, ClearedEv(), &cb);
  CHECK_EQ(cb.clears, 1u);
  CHECK_EQ(ix.WorkerBlocks(b), 0u);
  CHECK_EQ(ix.Entries(), 0u);
  // RemoveWorker: speculative entries go too; events for it are ignored; ids not reused.
  ix.Apply(a, StoredEv({1}, std::nullopt, Range(0, 16)), &ca);
  ix.RemoveWorker(a);
  CHECK_EQ(ix.SpeculativeEntries(), 0u);
  CHECK_EQ(ix.WorkerBlocks(a), 0u);
  CHECK_EQ(ix.Entries(), 0u);
  ix.Apply(a, StoredEv({9}, std::nullopt, Range(0, 16)), &ca);
  CHECK_EQ(ix.Entries(), 0u);
  CHECK(ix.WorkerEntries(a).empty());
  ix.RemoveWorker(a);       // twice: no-op
  ix.RemoveWorker(12345);   // unknown: no-op
  ix.ClearWorker(12345);
  const WorkerId c = ix.AddWorker();
  CHECK_EQ(c, 2u);
  CHECK_EQ(ix.WorkerIdLimit(), 3u);
  m = Match(ix, keys);
  CHECK_EQ(m.blocks.size(), 3u);
}

TEST(index_speculative) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  const auto keys = Keys(Range(0, 80));  // 5 blocks
  ApplyCounts c;
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32)), &c);
  ix.AddSpeculative(b, keys.data(), 3, 10.0, 2.0);      // b: blocks 0..2 until t=12
  ix.AddSpeculative(a, keys.data() + 2, 3, 10.0, 2.0);  // a: blocks 2..4 on top of real 0..1
  CHECK_EQ(ix.SpeculativeEntries(), 6u);
  auto m = Match(ix, keys, 11.0);
  CHECK_EQ(m.blocks[a], 5u);
  CHECK_EQ(m.blocks[b], 3u);
  CHECK(m.weighted[b] == 3.0);
  CHECK_EQ(m.max_blocks, 5u);
  // A prompt that diverges after block 1 matches only the common part of b's run.
  auto div = Range(0, 80);
  div[40] = 99999;
  m = Match(ix, Keys(div), 11.0);
  CHECK_EQ(m.blocks[b], 2u);
  // now < 0: the latest clock value seen (10) is used.
  CHECK_EQ(Match(ix, keys).blocks[b], 3u);
  // Expired at now >= expiry.
  m = Match(ix, keys, 12.0);
  CHECK_EQ(m.blocks[b], 0u);
  CHECK_EQ(m.blocks[a], 2u);
  ix.ExpireSpeculative(12.0);
  CHECK_EQ(ix.SpeculativeEntries(), 0u);
  // ttl <= 0 or n == 0: nothing; unknown worker: nothing.
  ix.AddSpeculative(b, keys.data(), 3, 13.0, 0.0);
  ix.AddSpeculative(b, keys.data(), 0, 13.0, 1.0);
  ix.AddSpeculative(777, keys.data(), 3, 13.0, 1.0);
  CHECK_EQ(ix.SpeculativeEntries(), 0u);
  // A real store of the same blocks keeps matching after the credit expires.
  ix.AddSpeculative(b, keys.data(), 1, 14.0, 1.0);
  ix.Apply(b, StoredEv({7}, std::nullopt, Range(0, 16)), &c);
  CHECK_EQ(Match(ix, keys, 14.5).blocks[b], 1u);
  CHECK_EQ(Match(ix, keys, 20.0).blocks[b], 1u);
  CHECK(ix.MemoryBytes() > 0);
  // Two credits of one worker from the same block: the longer one counts, whichever comes first.
  Index iy(IndexOptions{});
  const WorkerId x = iy.AddWorker();
  iy.AddSpeculative(x, keys.data(), 2, 1.0, 10.0);
  iy.AddSpeculative(x, keys.data(), 5, 1.0, 10.0);
  iy.AddSpeculative(x, keys.data(), 3, 1.0, 10.0);
  m = Match(iy, keys, 2.0);
  CHECK_EQ(m.blocks[x], 5u);
  CHECK(m.weighted[x] == 5.0);
  // ... until it expires.
  iy.AddSpeculative(x, keys.data(), 4, 3.0, 0.5);  // expires at 3.5, the others at 11
  CHECK_EQ(Match(iy, keys, 3.2).blocks[x], 5u);
  CHECK_EQ(Match(iy, keys, 11.5).blocks[x], 0u);

  // The cap on live credited blocks: the oldest credits go first, counted; a longer credit
  // keeps its first blocks; 0 = none.
  IndexOptions capped;
  capped.max_speculative_blocks = 6;
  Index iz(capped);
  const WorkerId p = iz.AddWorker(), q = iz.AddWorker();
  const auto many = Keys(Range(0, 16 * 20));
  iz.AddSpeculative(p, many.data(), 3, 1.0, 10.0);       // p: 0..2
  iz.AddSpeculative(q, many.data() + 5, 3, 1.0, 10.0);   // q: 5..7
  CHECK_EQ(iz.SpeculativeEntries(), 6u);
  iz.AddSpeculative(q, many.data() + 10, 2, 1.0, 10.0);  // p's credit leaves
  CHECK_EQ(iz.SpeculativeEntries(), 5u);
  CHECK_EQ(iz.SpeculativeDropped(), 1u);
  CHECK_EQ(Match(iz, many, 2.0).blocks[p], 0u);
  iz.AddSpeculative(p, many.data(), 9, 1.0, 10.0);  // longer than the cap: 0..5, alone
  CHECK_EQ(iz.SpeculativeEntries(), 6u);
  CHECK_EQ(iz.SpeculativeDropped(), 3u);
  auto mz = Match(iz, many, 2.0);
  CHECK_EQ(mz.blocks[p], 6u);
  CHECK_EQ(mz.blocks[q], 0u);
  IndexOptions uncapped;
  uncapped.max_speculative_blocks = 0;
  Index iu(uncapped);
  const WorkerId u = iu.AddWorker();
  for (int k = 0; k < 10; ++k) iu.AddSpeculative(u, many.data(), 20, 1.0, 10.0);
  CHECK_EQ(iu.SpeculativeEntries(), 200u);
  CHECK_EQ(iu.SpeculativeDropped(), 0u);
}

// Past a credit, the walk goes on at the nearest credit's end (no worker is at depth i in
// between): real blocks and credits that start exactly where a credit ends still count, and
// the blocks in between do not.
TEST(index_walk_jumps_to_the_nearest_credit_end) {
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
  CHECK_EQ(m.blocks[a], 10u);
  CHECK_EQ(m.blocks[b], 16u);
  CHECK(m.weighted[b] == 16.0);
  CHECK_EQ(m.blocks[c], 10u);
  CHECK_EQ(m.blocks[d], 20u);
  CHECK_EQ(m.blocks[e], 30u);
  CHECK_EQ(m.max_blocks, 30u);
  // A worker's blocks inside another's credit, past its own holes, do not count.
  ix.Apply(a, StoredEv(hashes(150, 4), std::optional<uint64_t>(109), Range(16 * 10, 16 * 4)),
           &cnt);  // a: 10..13 (a real run 0..13)
  remove(a, 105, 1);  // hole at 5: a stops at 5 although it holds 6..13
  m = Match(ix, keys, 2.0);
  CHECK_EQ(m.blocks[a], 5u);
  CHECK_EQ(m.blocks[b], 16u);
  CHECK_EQ(m.blocks[c], 10u);

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
  CHECK_EQ(m.blocks[x], 10u);
  CHECK_EQ(m.blocks[y], 10u);  // 0..1 real, 2..4 credited, 5..9 real (the run of x and y)
  CHECK(m.weighted[y] == 10.0);
  // Its credit expired: y stops at its hole.
  CHECK_EQ(Match(iy, keys, 6.0).blocks[y], 2u);
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
  CHECK_EQ(m.blocks[x], 10u);
  CHECK_EQ(m.blocks[y], 10u);
  CHECK(m.weighted[y] == 10.0);
  for (uint32_t k = 0; k < 17; ++k) CHECK_EQ(m.blocks[many[k]], k == 0 ? 4u : k + 10);
}

// The walk against the per-block definition (tests/test_match_model.py's, at sizes it does not
// reach): 24 workers, prompts of up to 80 blocks that share prefixes, chains stored on random
// tiers with holes, and up to 96 credits (in some walks more ends than the walk keeps), some
// expired. Per worker: at block i, a worker holding it advances by one (credit: GPU, else the
// better of CPU and disk); else its longest unexpired credit whose first key is block i's
// advances it by the common prefix with the prompt (GPU); else it stops.
TEST(index_walk_equals_per_block_definition_randomized) {
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
          wt += (m & 1) ? tier_w[0]
                        : std::max((m & 2) ? tier_w[1] : 0.0, (m & 4) ? tier_w[2] : 0.0);
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
      credits.push_back({w, std::vector<BlockKey>(keys.begin() + from, keys.begin() + from + len),
                         1.0 + ttl});
    }
    for (int probe = 0; probe < 8; ++probe) {
      const auto keys = Keys(probe == 0 ? base : variant(), kBs);
      const MatchResult got = Match(ix, keys, 2.0);
      size_t applied = 0;  // credits that moved a worker in this walk
      for (WorkerId w = 0; w < kWorkers; ++w) {
        const auto [blocks, wt] = reference(w, keys, 2.0, &applied);
        CHECK_EQ(got.blocks[w], blocks);
        CHECK(std::abs(got.weighted[w] - wt) < 1e-9);
      }
      credited_walks += applied > 0 ? 1 : 0;
      walks_past_kept_ends += applied > 16 ? 1 : 0;
    }
  }
  CHECK(credited_walks > 50);
  CHECK(walks_past_kept_ends > 0);
}

// The walk hashes lazily (BlockKeyStream): the keys it produces, in any order of Need calls,
// are ComputeBlockKeys', and a walk over a stream equals the walk over all keys computed first
// (real entries with holes and tier changes, speculative runs longer than the look-ahead,
// prompts past the end of the match, a partial last block).
TEST(key_stream_equals_precomputed_keys_and_walk) {
  std::mt19937_64 rng(11);
  // Extra keys on blocks well past the stream's first step (kStep = 8), some missing at the end.
  std::vector<std::string> extras(100);
  for (size_t b = 0; b < extras.size(); ++b) {
    if (b % 3 != 1) extras[b] = "x" + std::to_string(b);
  }
  for (int round = 0; round < 40; ++round) {
    const size_t ntok = static_cast<size_t>(rng() % 3000);
    std::vector<uint32_t> toks(ntok);
    for (auto& t : toks) t = static_cast<uint32_t>(rng() % 50);
    const std::vector<std::string>* ex = round % 3 == 0 ? &extras : nullptr;
    const auto all = Keys(toks, 16, round % 2 ? "lora" : "", ex);
    std::vector<BlockKey> buf;
    BlockKeyStream st(ChainRoot(round % 2 ? "lora" : ""), toks.data(), toks.size(), 16, ex, &buf);
    CHECK_EQ(st.size(), all.size());
    while (st.ready() < st.size()) {
      const size_t upto = st.ready() + 1 + static_cast<size_t>(rng() % 40);
      st.Need(upto);
      CHECK(st.ready() >= std::min(upto, st.size()));
      for (size_t i = 0; i < st.ready(); ++i) CHECK_EQ(st.data()[i], all[i]);
    }
    st.Need(st.size() + 5);  // past the end: nothing more
    CHECK_EQ(st.ready(), all.size());
  }
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
  ix.Apply(c, StoredEv(hashes(3000, 90), std::nullopt, Range(0, 16 * 90), 16, Medium::kCpu),
           &cnt);
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
    CHECK(want.blocks == got.blocks);
    CHECK(want.weighted == got.weighted);
    CHECK_EQ(want.max_blocks, got.max_blocks);
    for (size_t i = 0; i < st.ready(); ++i) CHECK_EQ(buf[i], keys[i]);
    // The walk stops hashing soon after the deepest match (look-ahead of 32 blocks + a step).
    if (cut >= 250) {
      CHECK_EQ(got.blocks[a], 120u);  // real 0..119 (block 120 removed)
      CHECK_EQ(got.blocks[b], 190u);  // real 0..39, then its credit 40..189
      CHECK_EQ(got.blocks[c], 93u);   // real 0..89 on CPU, then its credit 90..92
      CHECK(std::abs(got.weighted[c] - (90 * 0.8 + 3.0)) < 1e-9);
      CHECK(st.ready() < 190 + 48);
    }
  }
}

// ==== router (no sockets) =======================================================================

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

TEST(router_ingest_select_complete) {
  Router r(Opts(), {Wc("a"), Wc("b"), Wc("c", "", 1)});
  CHECK_THROWS(r.AddWorker(Wc("a")), std::invalid_argument);
  CHECK_THROWS(r.AddWorker(Wc("")), std::invalid_argument);
  const auto prompt = Range(0, 64);
  Decision d0 = SelectIn(r, prompt, false, 1.0);
  CHECK(d0.fallback);  // nothing ingested yet
  CHECK(r.Complete(d0.request_id));
  CHECK(!r.Complete(d0.request_id));

  const std::string p = Enc(Batch({StoredArr({1, 2, 3}, std::nullopt, Range(0, 48), 16)}));
  CHECK(r.Ingest("b", false, 0, p.data(), p.size()));
  CHECK_EQ(r.EventsApplied(), 1u);
  CHECK_THROWS(r.Ingest("zz", false, 0, p.data(), p.size()), std::out_of_range);
  // Rank mismatch on c (expects rank 1, batch says 0).
  CHECK(!r.Ingest("c", false, 0, p.data(), p.size()));
  const std::string bad = "\xc1";
  CHECK(!r.Ingest("a", false, 0, bad.data(), bad.size()));

  auto matches = r.FindMatches(prompt.data(), prompt.size(), {}, nullptr);
  CHECK_EQ(matches.size(), 3u);
  for (const auto& m : matches) {
    CHECK_EQ(m.blocks, m.worker == "b" ? 3u : 0u);
    if (m.worker == "b") CHECK_EQ(m.tokens, 48u);
  }
  Decision d = SelectIn(r, prompt, true, 2.0);
  CHECK(!d.fallback);
  CHECK(d.worker == "b");
  CHECK_EQ(d.matched_blocks, 3u);
  CHECK_EQ(d.matched_tokens, 48u);
  CHECK_EQ(d.prompt_tokens, 64u);
  CHECK_EQ(d.prefill_tokens, 16u);
  CHECK_EQ(d.scores.size(), 3u);
  auto st = r.Stats();
  CHECK_EQ(st.size(), 3u);
  const WorkerStats* sb = StatsOf(st, "b");
  const WorkerStats* sc = StatsOf(st, "c");
  const WorkerStats* sa = StatsOf(st, "a");
  CHECK(sb && sc && sa);
  if (sb && sc && sa) {
    CHECK_EQ(sb->batches, 1u);
    CHECK_EQ(sb->unsequenced, 1u);
    CHECK_EQ(sb->indexed_blocks, 3u);
    CHECK_EQ(sb->inflight_requests, 1);
    CHECK_EQ(sb->pending_prefill_tokens, 16);
    CHECK_EQ(sc->drops.Get(DropReason::kRankMismatch), 1u);
    CHECK_EQ(sa->drops.Get(DropReason::kParseError), 1u);
  }
  CHECK(r.FirstToken(d.request_id));
  CHECK(r.FirstToken(d.request_id));  // idempotent
  st = r.Stats();
  if (StatsOf(st, "b")) CHECK_EQ(StatsOf(st, "b")->pending_prefill_tokens, 0);
  CHECK(r.Complete(d.request_id));
  CHECK(!r.FirstToken(d.request_id));
  st = r.Stats();
  if (StatsOf(st, "b")) CHECK_EQ(StatsOf(st, "b")->inflight_requests, 0);

  r.UpdateLoad("a", 3.0, 0.5);
  CHECK_THROWS(r.UpdateLoad("a", -1.0, std::nullopt), std::invalid_argument);
  CHECK_THROWS(r.UpdateLoad("a", std::nullopt, 1.5), std::invalid_argument);
  CHECK_THROWS(r.UpdateLoad("nope", 1.0, std::nullopt), std::out_of_range);
  st = r.Stats();
  if (StatsOf(st, "a")) {
    CHECK(StatsOf(st, "a")->num_requests_waiting == 3.0);
    CHECK(StatsOf(st, "a")->kv_cache_usage_perc == 0.5);
  }
  CHECK_EQ(r.WorkerBlocks("b").size(), 3u);
  CHECK_THROWS(r.WorkerBlocks("nope"), std::out_of_range);

  // Removing a worker drops its blocks and its in-flight decisions.
  Decision d2 = SelectIn(r, prompt, false, 3.0);
  CHECK(d2.worker == "b");
  r.RemoveWorker("b");
  CHECK(!r.Complete(d2.request_id));
  CHECK_THROWS(r.RemoveWorker("b"), std::out_of_range);
  CHECK_THROWS(r.WorkerBlocks("b"), std::out_of_range);
  CHECK_EQ(r.index().Entries(), 0u);
  r.RemoveWorker("a");
  r.RemoveWorker("c");
  CHECK_THROWS(SelectIn(r, prompt, false, 4.0),
               std::logic_error);
  r.AddWorker(Wc("b"));  // a name can come back (with a new id)
  CHECK(SelectIn(r, prompt, false, 5.0).worker == "b");
  r.Close();
  r.Close();
}

TEST(router_sequence_numbers) {
  Router r(Opts(), {Wc("a")});
  const std::string p = Enc(Batch({}));
  for (uint64_t s : {0, 1, 2}) CHECK(r.Ingest("a", true, s, p.data(), p.size()));
  auto st = r.Stats();
  CHECK(st.size() == 1 && st[0].seen_seq && st[0].last_seq == 2 && st[0].gaps == 0 &&
        st[0].backward_jumps == 0 && st[0].batches == 3);
  r.Ingest("a", true, 10, p.data(), p.size());  // gap of 7
  st = r.Stats();
  CHECK(st.size() == 1 && st[0].gaps == 1 && st[0].missing_batches == 7);
  r.Ingest("a", true, 0, p.data(), p.size());  // restart
  st = r.Stats();
  CHECK(st.size() == 1 && st[0].backward_jumps == 1 && st[0].last_seq == 0);
}

TEST(router_lora_and_extra_keys) {
  Router r(Opts(), {Wc("a"), Wc("b")});
  V ev = A({S("BlockStored"), Hs({1}), Nil(), Toks(Range(0, 16)), I(16), Nil(), S("GPU"),
            S("adapter")});
  const std::string p = Enc(Batch({ev}));
  CHECK(r.Ingest("a", false, 0, p.data(), p.size()));
  const auto t = Range(0, 16);
  auto m = r.FindMatches(t.data(), t.size(), "adapter", nullptr);
  CHECK(m.size() == 2 && m[0].worker == "a" && m[0].blocks == 1 && m[1].blocks == 0);
  m = r.FindMatches(t.data(), t.size(), {}, nullptr);
  CHECK(m.size() == 2 && m[0].blocks == 0);
}

// ==== router under concurrency =================================================================

// 4 ingest threads (each owns one worker, plus every 8th batch for its neighbour) against
// 4 threads calling Select / Complete / FirstToken / Stats / FindMatches / UpdateLoad /
// WorkerBlocks, plus one transient worker added and removed while it runs. Assertions are
// invariants only; the point is to give TSan every shared structure under contention.
TEST(router_concurrent_ingest_select_stats) {
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
  CHECK_EQ(bad.load(), 0u);
  CHECK(ingested.load() > 0);
  CHECK(selects.load() > 0);
  CHECK(stats_calls.load() > 0);
  CHECK(r.EventsApplied() > 0);
  auto st = r.Stats();
  CHECK_EQ(st.size(), 4u);
  for (const auto& s : st) {
    CHECK_EQ(s.inflight_requests, 0);
    CHECK_EQ(s.pending_prefill_tokens, 0);
    CHECK(s.batches > 0);
  }
  std::fprintf(stderr, "  stress %.1fs: %llu batches ingested, %llu selects, %llu stats\n", dur,
               static_cast<unsigned long long>(ingested.load()),
               static_cast<unsigned long long>(selects.load()),
               static_cast<unsigned long long>(stats_calls.load()));
}

// ==== ZeroMQ ====================================================================================

std::string BindPub(zmq::socket_t& pub) {
  pub.set(zmq::sockopt::linger, 0);
  pub.bind("tcp://127.0.0.1:*");
  return pub.get(zmq::sockopt::last_endpoint);
}
void SendFrames(zmq::socket_t& s, const std::vector<std::string>& frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    s.send(zmq::buffer(frames[i]),
           i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
}
std::string Seq8(uint64_t s) {
  std::string b(8, '\0');
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(s >> (56 - 8 * i));
  return b;
}

TEST(zmq_round_trip_remove_and_close_while_flowing) {
  zmq::context_t ctx(1);
  zmq::socket_t pub_z(ctx, zmq::socket_type::pub), pub_y(ctx, zmq::socket_type::pub);
  const std::string ep_z = BindPub(pub_z), ep_y = BindPub(pub_y);
  CHECK(ep_z.rfind("tcp://127.0.0.1:", 0) == 0);
  RouterOptions o = Opts(2);
  o.topic = "kv";
  Router r(o, {Wc("z", ep_z), Wc("y", ep_y)});

  // Bad endpoints: rejected, and the name stays free.
  CHECK_THROWS(r.AddWorker(Wc("bad", "nonsense://x")), std::invalid_argument);
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
  CHECK(probe_until_seen(pub_z, "z"));
  CHECK(probe_until_seen(pub_y, "y"));

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
  CHECK(WaitFor(z_done, 10.0));
  {
    auto st = r.Stats();
    const WorkerStats* s = StatsOf(st, "z");
    CHECK(s != nullptr);
    if (s != nullptr) {
      CHECK_EQ(s->gaps, 0u);
      CHECK_EQ(s->backward_jumps, 0u);
      CHECK_EQ(s->indexed_blocks, static_cast<uint64_t>(kN));
      CHECK_EQ(s->apply.blocks_stored, static_cast<uint64_t>(kN));
      CHECK(s->last_recv_age_s >= 0);
    }
  }
  const auto prompt = Range(0, kN * 16);
  Decision d = SelectIn(r, prompt, false, -1);
  CHECK(d.worker == "z");
  CHECK_EQ(d.matched_blocks, static_cast<uint32_t>(kN));
  r.Complete(d.request_id);

  // Bind mode: the SUB binds an ipc endpoint, a PUB connects to it.
  const std::string ipc = "ipc:///tmp/kvroute-core-test-" + std::to_string(getpid()) + ".ipc";
  WorkerConfig wb = Wc("bound", ipc);
  wb.bind = true;
  r.AddWorker(wb);
  zmq::socket_t pub_b(ctx, zmq::socket_type::pub);
  pub_b.set(zmq::sockopt::linger, 0);
  pub_b.connect(ipc);
  CHECK(probe_until_seen(pub_b, "bound"));
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
  CHECK(WaitFor([&] { return y_batches() > y0 + 5; }, 10.0));
  r.RemoveWorker("z");
  CHECK_THROWS(r.WorkerBlocks("z"), std::out_of_range);
  CHECK(StatsOf(r.Stats(), "z") == nullptr);
  CHECK_EQ(r.index().WorkerBlocks(0), 0u);  // z was the first worker added (id 0)
  const uint64_t entries_after_remove = r.index().Entries();
  const uint64_t y1 = y_batches();
  CHECK(WaitFor([&] { return y_batches() > y1 + 5; }, 10.0));  // y still flows
  CHECK_EQ(r.index().WorkerBlocks(0), 0u);  // nothing of z came back
  CHECK(r.index().Entries() <= entries_after_remove + 1);
  r.Close();
  const uint64_t applied = r.EventsApplied();
  const uint64_t y2 = y_batches();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_EQ(r.EventsApplied(), applied);  // no ingestion after Close() returned
  CHECK_EQ(y_batches(), y2);
  CHECK_THROWS(r.AddWorker(Wc("late", ep_z)), std::logic_error);
  r.Close();
  CHECK(SelectIn(r, prompt, false, -1).worker.size() > 0);
  stop.store(true);
  publisher.join();
  CHECK(sent.load() > 0);
}

TEST(subscriber_direct) {
  zmq::context_t ctx(1);
  zmq::socket_t pub(ctx, zmq::socket_type::pub);
  const std::string ep = BindPub(pub);
  Subscriber sub(2);
  CHECK_EQ(sub.num_threads(), 2);
  std::atomic<int> got{0}, seq_ok{0};
  SubscriptionSpec spec;
  spec.endpoint = ep;
  spec.handler = [&](const WireMessage& m) {
    got.fetch_add(1);
    if (m.has_seq && m.seq == 0x0102030405060708ull && m.payload_len == 3) seq_ok.fetch_add(1);
  };
  const uint64_t id = sub.Add(spec);
  CHECK(id != 0);
  CHECK(WaitFor([&] {
    SendFrames(pub, {"t", std::string("\x01\x02\x03\x04\x05\x06\x07\x08", 8), "abc"});
    return seq_ok.load() > 0;
  }, 10.0));
  sub.Remove(id);
  const int n = got.load();
  SendFrames(pub, {"t", "x"});
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  CHECK_EQ(got.load(), n);  // nothing after Remove() returned
  sub.Remove(id);           // unknown: no-op
  SubscriptionSpec bad;
  bad.endpoint = "tcp://";
  bad.handler = [](const WireMessage&) {};
  CHECK_THROWS(sub.Add(bad), std::invalid_argument);
  sub.Close();
  sub.Close();
  CHECK_THROWS(sub.Add(spec), std::logic_error);
}

// ==== repro (not run by default) ===============================================================

// Router::RemoveWorker reads `subscriber_` without a lock while Router::Close() moves it out
// and destroys the Subscriber. Run under TSan (data race) or ASan (use-after-free, rarely).
int ReproRemoveClose() {
  zmq::context_t ctx(1);
  zmq::socket_t pub(ctx, zmq::socket_type::pub);
  const std::string ep = BindPub(pub);
  for (int i = 0; i < 50; ++i) {
    Router r(Opts(), {Wc("z", ep)});
    std::atomic<int> ready{0};
    std::thread t1([&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      r.RemoveWorker("z");
    });
    std::thread t2([&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      r.Close();
    });
    t1.join();
    t2.join();
  }
  std::printf("repro finished without a sanitizer report\n");
  return 0;
}

// Router::AddWorker (endpoint set) locks workers_mu_ then close_mu_; Router::Close locks
// close_mu_ then workers_mu_. Concurrent calls can deadlock: a watchdog reports it.
int ReproAddClose() {
  zmq::context_t ctx(1);
  zmq::socket_t pub(ctx, zmq::socket_type::pub);
  const std::string ep = BindPub(pub);
  std::atomic<int> done_iters{0};
  std::thread watchdog([&] {
    int last = -1;
    while (done_iters.load() < 2000) {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      const int now = done_iters.load();
      if (now == last && now < 2000) {
        std::printf("DEADLOCK: AddWorker/Close stuck at iteration %d\n", now);
        std::fflush(stdout);
        std::_Exit(3);
      }
      last = now;
    }
  });
  for (int i = 0; i < 2000; ++i) {
    Router r(Opts(), {});
    std::atomic<int> ready{0};
    std::thread t1([&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      try {
        r.AddWorker(Wc("z", ep));
      } catch (const std::logic_error&) {
      }
    });
    std::thread t2([&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      r.Close();
    });
    t1.join();
    t2.join();
    done_iters.fetch_add(1);
  }
  watchdog.join();
  std::printf("repro finished: no deadlock in 2000 iterations\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return kvroute_test::RunTests(
      argc, argv,
      {{"--repro-remove-close", &ReproRemoveClose}, {"--repro-add-close", &ReproAddClose}});
}
