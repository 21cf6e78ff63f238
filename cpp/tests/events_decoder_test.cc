// Tests of the decoder (cpp/events/decoder*.cc): DecodeBatch against hand-built payloads of
// every era and hash form of the wire format (shared/docs/kv-events.md), the token-id walk,
// its drop reasons and limits, and random mutations.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "events/decoder.h"
#include "tests/test_util.h"

using namespace kvroute;
using namespace kvroute_test;

namespace {

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

TEST(Decoder, array_era_u64_hashes) {
  const uint64_t big = 0xF000000000000001ull;  // >= 2^63: msgpack uint64
  auto d = Decode(Enc(Batch({StoredArr({big, 7}, std::nullopt, Range(0, 32), 16)}, 3)));
  EXPECT_TRUE(d.ok);
  EXPECT_EQ(TotalDrops(d.d), 0u);
  EXPECT_TRUE(d.b.has_dp_rank);
  EXPECT_EQ(d.b.dp_rank, 3);
  EXPECT_TRUE(d.b.ts == 1.5);
  EXPECT_EQ(d.b.events.size(), 1u);
  if (d.b.events.size() != 1) return;
  const Event& e = d.b.events[0];
  EXPECT_TRUE(e.type == EventType::kBlockStored);
  EXPECT_EQ(e.block_hashes.size(), 2u);
  EXPECT_TRUE(e.block_hashes[0] == IntHash(big));
  EXPECT_TRUE(e.block_hashes[0].IsInt());
  EXPECT_TRUE(e.block_hashes[1] == IntHash(7));
  EXPECT_TRUE(!e.has_parent);
  EXPECT_TRUE(std::vector<uint32_t>(e.token_ids.begin(), e.token_ids.end()) == Range(0, 32));
  EXPECT_EQ(e.block_size, 16);
  EXPECT_TRUE(!e.has_lora_id);
  EXPECT_TRUE(e.has_medium);
  EXPECT_TRUE(e.tier == Medium::kGpu);
  EXPECT_TRUE(e.medium_known);
}

TEST(Decoder, legacy_two_element_batch_and_int_ts) {
  V ev = A({S("BlockStored"), Hs({1}), U(99), Toks(Range(0, 16)), I(16), Nil()});  // 6 fields
  auto d = Decode(Enc(A({U(1700000000), A({ev, A({S("BlockRemoved"), Hs({1})})})})));
  EXPECT_TRUE(d.ok);
  EXPECT_TRUE(!d.b.has_dp_rank);
  EXPECT_TRUE(d.b.ts == 1700000000.0);
  EXPECT_EQ(d.b.events.size(), 2u);
  if (d.b.events.size() != 2) return;
  EXPECT_TRUE(d.b.events[0].has_parent);
  EXPECT_TRUE(d.b.events[0].parent_block_hash == IntHash(99));
  EXPECT_TRUE(!d.b.events[0].has_medium);
  EXPECT_TRUE(d.b.events[1].type == EventType::kBlockRemoved);
  EXPECT_TRUE(d.b.events[1].tier == Medium::kGpu);
  // Rank nil: readable, no rank.
  auto d2 = Decode(Enc(Batch({ClearedArr()}, std::nullopt)));
  EXPECT_TRUE(d2.ok);
  EXPECT_TRUE(!d2.b.has_dp_rank);
  EXPECT_EQ(d2.b.events.size(), 1u);
  // Extra trailing batch elements and trailing event fields are skipped.
  auto d3 = Decode(Enc(A({F(2), A({A({S("BlockRemoved"), Hs({5}), S("CPU"), I(0), S("x"), U(9)})}),
                          I(0), S("future")})));
  EXPECT_TRUE(d3.ok);
  EXPECT_EQ(d3.b.events.size(), 1u);
  if (!d3.b.events.empty()) {
    EXPECT_TRUE(d3.b.events[0].tier == Medium::kCpu);
  }
}

TEST(Decoder, array_full_era_fields) {
  V extra = A({Nil(), A({S("mm"), U(3)})});
  V ev = A({S("BlockStored"), Hs({1, 2}), U(77), Toks(Range(5, 32)), I(16), U(4), S("CPU"),
            S("adapter"), extra, I(2), S("full_attention"), Nil()});
  auto d = Decode(Enc(Batch({ev})));
  EXPECT_TRUE(d.ok);
  EXPECT_EQ(d.b.events.size(), 1u);
  if (d.b.events.empty()) return;
  const Event& e = d.b.events[0];
  EXPECT_TRUE(e.has_lora_id);
  EXPECT_EQ(e.lora_id, 4);
  EXPECT_TRUE(e.tier == Medium::kCpu);
  EXPECT_TRUE(e.lora_name == "adapter");
  EXPECT_EQ(e.extra_keys.size(), 2u);
  if (e.extra_keys.size() == 2) {
    EXPECT_TRUE(e.extra_keys[0].empty());
    EXPECT_TRUE(e.extra_keys[1] == Enc(A({S("mm"), U(3)})));
  }
  EXPECT_EQ(e.group_idx, 2);
  EXPECT_TRUE(e.kv_cache_spec_kind == "full_attention");
  EXPECT_TRUE(!e.has_sliding_window);
}

TEST(Decoder, map_era_any_key_order) {
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
  V rm = M({{S("block_hashes"), Hs({42})},
            {S("type"), S("BlockRemoved")},
            {S("token_ids"), S("ignored for removals")},
            {S("medium"), S("STORAGE")}});
  V clr = M({{S("type"), S("AllBlocksCleared")}, {S("junk"), U(1)}});
  auto d = Decode(Enc(Batch({ev, rm, clr})));
  EXPECT_TRUE(d.ok);
  EXPECT_EQ(TotalDrops(d.d), 0u);
  EXPECT_EQ(d.b.events.size(), 3u);
  if (d.b.events.size() != 3) return;
  EXPECT_TRUE(d.b.events[0].block_hashes.size() == 1 &&
              d.b.events[0].block_hashes[0] == IntHash(42));
  EXPECT_TRUE(d.b.events[0].tier == Medium::kCpu);
  EXPECT_TRUE(d.b.events[0].locality == "LOCAL");
  EXPECT_TRUE(d.b.events[0].has_sliding_window);
  EXPECT_EQ(d.b.events[0].sliding_window, 128);
  EXPECT_TRUE(d.b.events[1].type == EventType::kBlockRemoved);
  EXPECT_TRUE(d.b.events[1].tier == Medium::kDisk);
  EXPECT_TRUE(d.b.events[2].type == EventType::kAllBlocksCleared);

  // Map batch: {"ts", "events", "data_parallel_rank"} in any order; rank may be absent.
  auto m1 =
      Decode(Enc(M({{S("events"), A({ev})}, {S("data_parallel_rank"), I(2)}, {S("ts"), F(3.25)}})));
  EXPECT_TRUE(m1.ok);
  EXPECT_TRUE(m1.b.has_dp_rank);
  EXPECT_EQ(m1.b.dp_rank, 2);
  EXPECT_TRUE(m1.b.ts == 3.25);
  EXPECT_EQ(m1.b.events.size(), 1u);
  auto m2 = Decode(Enc(M({{S("ts"), F(1)}, {S("events"), A({})}})));
  EXPECT_TRUE(m2.ok);
  EXPECT_TRUE(!m2.b.has_dp_rank);
  auto m3 = Decode(Enc(M({{S("ts"), F(1)}})));  // no events
  EXPECT_TRUE(!m3.ok);
  EXPECT_EQ(m3.d.Get(DropReason::kWrongType), 1u);
}

// A map event with two "type" keys: the last one wins, as in the msgpack-c reference (the
// fuzz target found the fast path keeping a leading AllBlocksCleared over a later unknown tag).
TEST(Decoder, map_event_with_two_tags_takes_the_last) {
  V clr_then_bogus = M({{S("type"), S("AllBlocksCleared")}, {S("type"), S("Bogus")}});
  V bogus_then_clr =
      M({{S("type"), S("Bogus")}, {S("junk"), U(1)}, {S("type"), S("AllBlocksCleared")}});
  V stored_then_clr = M({{S("type"), S("BlockStored")},
                         {S("block_hashes"), Hs({1})},
                         {S("type"), S("AllBlocksCleared")}});
  // One batch each: an event the fast path gives up on sends its whole batch to the reference.
  auto d1 = Decode(Enc(Batch({clr_then_bogus})));
  EXPECT_TRUE(d1.ok);
  EXPECT_EQ(d1.d.Get(DropReason::kUnknownTag), 1u);
  EXPECT_EQ(d1.b.events.size(), 0u);
  for (const V& ev : {bogus_then_clr, stored_then_clr}) {
    auto d = Decode(Enc(Batch({ev})));
    EXPECT_TRUE(d.ok);
    EXPECT_EQ(TotalDrops(d.d), 0u);
    EXPECT_EQ(d.b.events.size(), 1u);
    if (d.b.events.size() == 1) {
      EXPECT_TRUE(d.b.events[0].type == EventType::kAllBlocksCleared);
    }
  }
}

// Token ids in every integer form, in lists long enough for the 64-byte windows, the paired
// walk's 240-byte ones (WalkPaired) and their tails, with few or many changes of form: the four
// common forms (fixint, uint8/16/32), then mixed with the others (uint64, int8-64 holding
// non-negative values); and one id out of range (-1, 2^32) anywhere in the list drops the event as
// the reference does.
TEST(Decoder, token_forms_at_random) {
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
        case 0:
          v = rng() % 128;
          list += static_cast<char>(v);
          break;  // fixint
        case 1:
          v = 128 + rng() % 128;
          list += '\xcc';
          be(&list, v, 1);
          break;  // uint8
        case 2:
          v = rng() % 65536;
          list += '\xcd';
          be(&list, v, 2);
          break;  // uint16
        case 3:
          v = static_cast<uint32_t>(rng());
          list += '\xce';
          be(&list, v, 4);
          break;
        case 4:
          v = static_cast<uint32_t>(rng());
          list += '\xcf';
          be(&list, v, 8);
          break;
        case 5:
          v = rng() % 128;
          list += '\xd0';
          be(&list, v, 1);
          break;  // int8
        case 6:
          v = rng() % 32768;
          list += '\xd1';
          be(&list, v, 2);
          break;  // int16
        case 7:
          v = rng() % 0x80000000u;
          list += '\xd2';
          be(&list, v, 4);
          break;  // int32
        default:
          v = static_cast<uint32_t>(rng());
          list += '\xd3';
          be(&list, v, 8);
          break;
      }
      want[j] = v;
    }
    // [ts, [["BlockStored", [hashes], nil, tokens, 16]]]
    const size_t nb = (n + 15) / 16;
    std::string ev =
        "\x95\xab"
        "BlockStored"
        "\xdc";  // then an array 16 of hashes
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
    EXPECT_EQ(d.ok, ref_ok);
    EXPECT_TRUE(d.d.n == ref_drops.n);
    if (bad >= 0) {
      EXPECT_EQ(d.d.Get(DropReason::kTokenOutOfRange), 1u);
      EXPECT_EQ(d.b.events.size(), 0u);
      continue;
    }
    EXPECT_TRUE(d.ok);
    EXPECT_EQ(TotalDrops(d.d), 0u);
    EXPECT_EQ(d.b.events.size(), 1u);
    if (d.b.events.size() == 1) {
      const TokenIds& got = d.b.events[0].token_ids;
      EXPECT_TRUE(std::vector<uint32_t>(got.begin(), got.end()) == want);
    }
  }
}

// The walk's AVX2 byte classifier against the SSSE3 one (the decode tests run whichever the
// CPU has): random bytes, mostly the forms of token ids, other forms among them, and runs of
// one form (the starts near the window's end reach past it).
TEST(Decoder, token_classifiers_agree) {
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
    EXPECT_TRUE(TokenClassifiersAgreeForTest(q));
  }
}

TEST(Decoder, hash_forms) {
  // Negative int64 (SGLang): reinterpreted as uint64, exact.
  // Bin 16: kept exactly (top bit of hi set). Bin 32: XXH3-128, top bit set.
  std::string b16(16, '\0'), b32(32, '\0');
  for (int i = 0; i < 16; ++i) b16[i] = static_cast<char>(0x10 + i);
  for (int i = 0; i < 32; ++i) b32[i] = static_cast<char>(0xA0 + i);
  std::string b16_low(16, '\0');
  b16_low[15] = 7;  // bin16 whose value is "7": must not alias the int 7
  V hashes = A({I(-5), I(INT64_MIN), Bin(b16), Bin(b32), Bin(b16_low), U(7), Bin("abc")});
  auto d = Decode(Enc(Batch({A({S("BlockRemoved"), hashes})})));
  EXPECT_TRUE(d.ok);
  EXPECT_EQ(d.b.events.size(), 1u);
  if (d.b.events.size() != 1) return;
  const auto& h = d.b.events[0].block_hashes;
  EXPECT_EQ(h.size(), 7u);
  if (h.size() != 7) return;
  EXPECT_TRUE(h[0] == IntHash(static_cast<uint64_t>(int64_t{-5})));
  EXPECT_TRUE(h[1] == IntHash(0x8000000000000000ull));
  EXPECT_EQ(h[2].hi, 0x1011121314151617ull | (1ull << 63));
  EXPECT_EQ(h[2].lo, 0x18191A1B1C1D1E1Full);
  XXH128_hash_t x = XXH3_128bits(b32.data(), b32.size());
  EXPECT_EQ(h[3].hi, x.high64 | (1ull << 63));
  EXPECT_EQ(h[3].lo, x.low64);
  EXPECT_TRUE(!h[4].IsInt());
  EXPECT_TRUE(h[4] != h[5]);
  EXPECT_TRUE(h[5] == IntHash(7));
  EXPECT_TRUE(!h[6].IsInt());  // other lengths: hashed too

  // The same 16 bytes in the bin8, bin16 and bin32 *formats* decode identically.
  auto with_bin_format = [&](unsigned char fmt) {
    std::string p = Enc(F(1)).insert(0, "\x93", 1);  // [ts, events, rank]
    p += "\x91\x92\xAC"
         "BlockRemoved"
         "\x91";  // [["BlockRemoved", [<bin>]]]
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
    EXPECT_TRUE(r.ok);
    EXPECT_EQ(TotalDrops(r.d), 0u);
    EXPECT_TRUE(r.b.events.size() == 1 && r.b.events[0].block_hashes.size() == 1 &&
                r.b.events[0].block_hashes[0] == h[2]);
  }
  // Empty bin: that event is dropped (wrong_type), the batch survives.
  auto e = Decode(Enc(Batch({A({S("BlockRemoved"), A({Bin("")})}), ClearedArr()})));
  EXPECT_TRUE(e.ok);
  EXPECT_EQ(e.b.events.size(), 1u);
  EXPECT_EQ(e.d.Get(DropReason::kWrongType), 1u);
}

TEST(Decoder, sglang_metadata_and_salt) {
  V ev = A({S("BlockStored"), A({I(-1), I(7)}), Nil(), Toks(Range(0, 32)), I(16), Nil(), S("GPU"),
            M({{S("cache_salt"), S("s")}, {S("other"), U(1)}})});
  auto d = Decode(Enc(Batch({ev}, std::nullopt)));
  EXPECT_TRUE(d.ok);
  EXPECT_EQ(d.b.events.size(), 1u);
  if (d.b.events.empty()) return;
  const std::string salt = Enc(A({S("s")}));
  EXPECT_TRUE(d.b.events[0].cache_salt == salt);
  EXPECT_EQ(d.b.events[0].extra_keys.size(), 1u);
  if (!d.b.events[0].extra_keys.empty()) {
    EXPECT_TRUE(d.b.events[0].extra_keys[0] == salt);
  }
  EXPECT_TRUE(d.b.events[0].lora_name.empty());
  // SGLang map era: cache_salt as a plain key; with a parent the salt is not re-applied.
  V evm = M({{S("type"), S("BlockStored")},
             {S("block_hashes"), A({I(-3)})},
             {S("parent_block_hash"), I(-1)},
             {S("token_ids"), Toks(Range(0, 16))},
             {S("block_size"), I(16)},
             {S("cache_salt"), S("s")},
             {S("session_id"), S("x")}});
  auto dm = Decode(Enc(Batch({evm}, std::nullopt)));
  EXPECT_TRUE(dm.ok);
  EXPECT_EQ(dm.b.events.size(), 1u);
  if (!dm.b.events.empty()) {
    EXPECT_TRUE(dm.b.events[0].cache_salt == salt);
    EXPECT_TRUE(dm.b.events[0].extra_keys.empty());
  }
}

TEST(Decoder, medium_strings) {
  struct Case {
    const char* s;
    Medium m;
    bool known;
  } cases[] = {{"GPU", Medium::kGpu, true},
               {"cuda", Medium::kGpu, true},
               {"CPU", Medium::kCpu, true},
               {"CPU_TIER1", Medium::kCpu, true},
               {"LocalCPUBackend", Medium::kCpu, true},
               {"STORAGE", Medium::kDisk, true},
               {"SSD", Medium::kDisk, true},
               {"tape", Medium::kDisk, false}};
  for (const Case& c : cases) {
    auto d = Decode(Enc(Batch({RemovedArr({1}, c.s)})));
    EXPECT_TRUE(d.ok && d.b.events.size() == 1);
    if (d.b.events.size() != 1) continue;
    EXPECT_TRUE(d.b.events[0].tier == c.m);
    EXPECT_TRUE(d.b.events[0].medium_known == c.known);
    EXPECT_TRUE(d.b.events[0].medium == c.s);
  }
}

TEST(Decoder, every_truncation_is_counted) {
  const std::vector<std::string> payloads = {
      Enc(Batch({StoredArr({1, 2}, 9, Range(0, 32), 16), RemovedArr({1}), ClearedArr()})),
      Enc(M({{S("ts"), F(1)},
             {S("events"), A({M({{S("type"), S("BlockStored")},
                                 {S("block_hashes"), Hs({1})},
                                 {S("token_ids"), Toks(Range(70000, 16))},
                                 {S("block_size"), I(16)}})})}})),
      Enc(Batch({A({S("BlockRemoved"), A({Bin(std::string(32, 'x')), I(-9)})})}))};
  for (const std::string& p : payloads) {
    EXPECT_TRUE(Decode(p).ok);
    DropCounts total;
    for (size_t n = 0; n < p.size(); ++n) {
      EventBatch b;
      const bool ok = DecodeBatch(p.data(), n, DecodeLimits(), &b, &total);
      EXPECT_TRUE(!ok);
      EXPECT_TRUE(b.events.empty());
    }
    EXPECT_EQ(total.Get(DropReason::kTruncated), p.size());
    EXPECT_EQ(TotalDrops(total), p.size());
  }
  // A null pointer with length 0 is a truncated (empty) payload, not a crash.
  EventBatch b;
  DropCounts dc;
  EXPECT_TRUE(!DecodeBatch(nullptr, 0, DecodeLimits(), &b, &dc));
  EXPECT_EQ(dc.Get(DropReason::kTruncated), 1u);
}

TEST(Decoder, batch_level_errors) {
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
      {std::string("\xc1", 1), DropReason::kParseError},  // never-used byte
      {std::string("\x92\xcb\x00\x00\x00\x00\x00\x00\xf0\x3f\x91\xc1", 12),
       DropReason::kParseError},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    auto d = Decode(cases[i].payload);
    EXPECT_TRUE(!d.ok);
    EXPECT_TRUE(d.b.events.empty());
    if (d.d.Get(cases[i].reason) != 1 || TotalDrops(d.d) != 1) {
      ADD_FAILURE() << "case " << i << ": expected one " << DropReasonName(cases[i].reason);
    }
  }
}

TEST(Decoder, event_level_errors_keep_the_batch) {
  struct Case {
    V ev;
    DropReason reason;
  };
  std::vector<Case> cases = {
      {U(3), DropReason::kWrongType},                // not array/map
      {A({}), DropReason::kWrongType},               // no tag
      {A({U(1), Hs({1})}), DropReason::kWrongType},  // tag not a str
      {A({S("BlockMoved"), Hs({1})}), DropReason::kUnknownTag},
      {M({{S("block_hashes"), Hs({1})}}), DropReason::kWrongType},  // no "type"
      {M({{S("type"), S("Nope")}}), DropReason::kUnknownTag},
      {A({S("BlockStored"), U(1)}), DropReason::kWrongType},         // hashes not array
      {A({S("BlockStored"), A({F(1.5)})}), DropReason::kWrongType},  // hash a float
      {A({S("BlockStored"), Hs({1}), Nil(), A({S("t")})}), DropReason::kWrongType},
      {A({S("BlockStored"), Hs({1}), Nil(), A({I(-1)})}), DropReason::kTokenOutOfRange},
      {A({S("BlockStored"), Hs({1}), Nil(), A({U(1ull << 32)})}), DropReason::kTokenOutOfRange},
      {A({S("BlockStored"), Hs({1}), Nil(), Toks({1}), U(1ull << 63)}), DropReason::kWrongType},
      {A({S("BlockStored"), Hs({1}), Nil(), Toks({1}), I(1), Nil(), U(1)}),
       DropReason::kWrongType},  // medium an int
      {A({S("BlockStored"), Hs({1}), Nil(), Toks({1}), I(1), Nil(), Nil(), U(3)}),
       DropReason::kWrongType},  // lora_name int
      {A({S("BlockStored"), Hs({1}), Nil(), Toks({1}), I(1), Nil(), Nil(), Nil(), U(1)}),
       DropReason::kWrongType},  // extra_keys
      {A({S("BlockRemoved"), Hs({1}), Bool(true)}), DropReason::kWrongType},
      {M({{S("type"), S("BlockRemoved")}, {S("medium"), A({})}}), DropReason::kWrongType},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    auto d = Decode(Enc(Batch({ClearedArr(), cases[i].ev, ClearedArr()})));
    EXPECT_TRUE(d.ok);
    EXPECT_EQ(d.b.events.size(), 2u);
    if (d.d.Get(cases[i].reason) != 1 || TotalDrops(d.d) != 1) {
      ADD_FAILURE() << "case " << i << ": expected one " << DropReasonName(cases[i].reason);
    }
  }
}

TEST(Decoder, limits) {
  DecodeLimits lim;
  lim.max_blocks_per_event = 4;
  auto d = Decode(Enc(Batch({RemovedArr({1, 2, 3, 4, 5}), RemovedArr({1, 2, 3, 4})})), lim);
  EXPECT_TRUE(d.ok);
  EXPECT_EQ(d.b.events.size(), 1u);
  EXPECT_EQ(d.d.Get(DropReason::kOversized), 1u);

  const std::string p = Enc(Batch({ClearedArr()}));
  DecodeLimits small;
  small.max_payload_bytes = p.size() - 1;
  auto o = Decode(p, small);
  EXPECT_TRUE(!o.ok);
  EXPECT_EQ(o.d.Get(DropReason::kOversized), 1u);

  DecodeLimits cont;
  cont.max_container = 3;
  auto c = Decode(Enc(Batch({RemovedArr({1, 2, 3, 4})})), cont);
  EXPECT_TRUE(!c.ok);
  EXPECT_EQ(c.d.Get(DropReason::kOversized), 1u);

  DecodeLimits str;
  str.max_string = 8;
  auto s = Decode(Enc(Batch({RemovedArr({1}, "a-long-medium-name")})), str);
  EXPECT_TRUE(!s.ok);
  EXPECT_EQ(s.d.Get(DropReason::kOversized), 1u);

  V deep = ClearedArr();
  for (int i = 0; i < 40; ++i) deep = A({deep});
  auto dp = Decode(Enc(Batch({deep})));
  EXPECT_TRUE(!dp.ok);
  EXPECT_EQ(dp.d.Get(DropReason::kOversized), 1u);

  // A 5-byte array32 header announcing 2^24-1 elements: refused or truncated, never a crash.
  const std::string hdr("\xdd\x00\xff\xff\xff", 5);
  auto h = Decode(hdr);
  EXPECT_TRUE(!h.ok);
  EXPECT_EQ(TotalDrops(h.d), 1u);
}

// A batch of n one-byte invalid events (positive fixints): [0.0, [1, 1, ...]].
std::string DenseInvalid(uint32_t n) {
  std::string p("\x92\xcb\0\0\0\0\0\0\0\0\xdd", 11);
  for (int s = 24; s >= 0; s -= 8) p.push_back(static_cast<char>((n >> s) & 0xff));
  p.append(n, '\x01');
  return p;
}

TEST(Decoder, dense_invalid_events_are_counted_one_by_one) {
  const uint32_t n = 200000;
  auto d = Decode(DenseInvalid(n));
  EXPECT_TRUE(d.ok);
  EXPECT_TRUE(d.b.events.empty());
  EXPECT_EQ(d.d.Get(DropReason::kWrongType), n);
  // Bad events between good ones: only the bad ones go.
  V junk = I(1);
  auto m = Decode(Enc(Batch({junk, RemovedArr({1}), A({}), A({S("Nope")}), ClearedArr(), junk})));
  EXPECT_TRUE(m.ok);
  EXPECT_EQ(m.b.events.size(), 2u);
  EXPECT_EQ(m.d.Get(DropReason::kWrongType), 3u);
  EXPECT_EQ(m.d.Get(DropReason::kUnknownTag), 1u);
}

TEST(Decoder, reference_tree_budget) {
  // Past max(len / 2, min_tree_elements) elements the reference decoder refuses the batch
  // before it builds a tree; the fast path is not bounded by it.
  DecodeLimits lim;
  lim.min_tree_elements = 1000;
  const std::string dense = DenseInvalid(5000);  // ~5,000 elements in ~5,000 bytes
  auto d = Decode(dense, lim);
  EXPECT_TRUE(!d.ok);
  EXPECT_EQ(d.d.Get(DropReason::kOversized), 1u);
  EXPECT_EQ(TotalDrops(d.d), 1u);
  DropCounts rd;
  EventBatch rb;
  EXPECT_TRUE(!DecodeBatchReference(dense.data(), dense.size(), lim, &rb, &rd));
  EXPECT_EQ(rd.Get(DropReason::kOversized), 1u);
  // Within the budget: decoded and counted per event.
  auto ok = Decode(DenseInvalid(900), lim);
  EXPECT_TRUE(ok.ok);
  EXPECT_EQ(ok.d.Get(DropReason::kWrongType), 900u);
  // A fast-path batch of many token ids (more elements than the budget) decodes.
  auto big = Decode(Enc(Batch({StoredArr({1}, 0, Range(0, 4000), 4000)})), lim);
  EXPECT_TRUE(big.ok);
  ASSERT_EQ(big.b.events.size(), 1u);
  EXPECT_EQ(big.b.events[0].token_ids.size(), 4000u);
}

TEST(Decoder, random_mutations_never_crash) {
  std::vector<std::string> seeds = {
      Enc(Batch({StoredArr({1, 2}, 9, Range(0, 32), 16), RemovedArr({1}, "CPU"), ClearedArr()})),
      Enc(M({{S("ts"), F(1)},
             {S("data_parallel_rank"), I(0)},
             {S("events"), A({M({{S("type"), S("BlockStored")},
                                 {S("block_hashes"), A({I(-4)})},
                                 {S("token_ids"), Toks(Range(0, 16))},
                                 {S("block_size"), I(16)},
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
        case 2:
          if (p.size() > 1) p.erase(rng() % p.size(), 1);
          break;
        default: p.resize(rng() % (p.size() + 1)); break;
      }
    }
    if (p.empty()) p = "\x90";
    auto d = Decode(p);
    if (d.ok) {
      ++ok;
    } else {
      ++bad;
      if (!d.b.events.empty() || TotalDrops(d.d) != 1) {
        ADD_FAILURE() << "iteration " << it << ": a refused payload must keep no events and "
                      << "count one drop";
      }
    }
  }
  EXPECT_TRUE(ok > 0);
  EXPECT_TRUE(bad > 0);
}

}  // namespace
