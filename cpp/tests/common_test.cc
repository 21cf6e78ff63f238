// Tests of the block keys (cpp/common/block_key.h): BlockKeyStream against ComputeBlockKeys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/block_key.h"
#include "tests/test_util.h"

using namespace kvroute;
using namespace kvroute_test;

namespace {

// BlockKeyStream hashes lazily: the keys it produces, in any order of Need calls, are
// ComputeBlockKeys' (with and without a LoRA root and extra keys).
TEST(BlockKeyStream, equals_precomputed_keys) {
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
    EXPECT_EQ(st.size(), all.size());
    while (st.ready() < st.size()) {
      const size_t upto = st.ready() + 1 + static_cast<size_t>(rng() % 40);
      st.Need(upto);
      EXPECT_TRUE(st.ready() >= std::min(upto, st.size()));
      for (size_t i = 0; i < st.ready(); ++i) EXPECT_EQ(st.data()[i], all[i]);
    }
    st.Need(st.size() + 5);  // past the end: nothing more
    EXPECT_EQ(st.ready(), all.size());
  }
}

// vLLM's adapter name as the first extra key of a block: left out, the array re-headed in its
// smallest form; anything else untouched.
TEST(StripLeadingExtraKey, strips_the_name_only) {
  std::string out = "untouched";
  EXPECT_TRUE(StripLeadingExtraKey(Enc(A({S("sql")})), "sql", &out));
  EXPECT_EQ(out, "");
  EXPECT_TRUE(StripLeadingExtraKey(Enc(A({S("sql"), S("salt")})), "sql", &out));
  EXPECT_EQ(out, Enc(A({S("salt")})));
  EXPECT_TRUE(StripLeadingExtraKey(Enc(A({S("sql"), A({S("img"), I(-12)}), S("salt")})), "sql",
                                   &out));
  EXPECT_EQ(out, Enc(A({A({S("img"), I(-12)}), S("salt")})));
  // array16 of 17 -> fixarray of 16; a name of 40 bytes (str8).
  const std::string name(40, 'n');
  std::vector<V> xs = {S(name)};
  for (int i = 0; i < 16; ++i) xs.push_back(U(i));
  std::vector<V> rest(xs.begin() + 1, xs.end());
  EXPECT_TRUE(StripLeadingExtraKey(Enc(A(xs)), name, &out));
  EXPECT_EQ(out, Enc(A(rest)));
  out = "untouched";
  EXPECT_FALSE(StripLeadingExtraKey(Enc(A({S("salt")})), "sql", &out));
  EXPECT_FALSE(StripLeadingExtraKey(Enc(A({S("sqlx")})), "sql", &out));
  EXPECT_FALSE(StripLeadingExtraKey(Enc(A({})), "sql", &out));
  EXPECT_FALSE(StripLeadingExtraKey(Enc(S("sql")), "sql", &out));
  EXPECT_FALSE(StripLeadingExtraKey("", "sql", &out));
  EXPECT_FALSE(StripLeadingExtraKey(std::string("\x92\xa3sq", 4), "sql", &out));  // truncated
  EXPECT_EQ(out, "untouched");
}

}  // namespace
