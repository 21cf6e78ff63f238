// The fast path's token ids (FastTokenIds, decoder_reader.h): the bulk of a BlockStored's
// bytes. Token ids come as msgpack integers of four forms; a 64-byte window classified with
// SSE2 or a paired walk over 240-byte windows (SSSE3, AVX2 when the CPU has it) decodes them
// without a branch on the form, a branchy loop where the form seldom changes, a checked loop
// for the rest.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__SSE2__)
#include <emmintrin.h>
#include <immintrin.h>
#include <tmmintrin.h>
#endif

#include "events/decoder.h"
#include "events/decoder_reader.h"

namespace kvroute {
namespace decoder_internal {

namespace {

// One token id in any integer form, bounds checked: the fast loops' fallback.
bool CheckedToken(Reader& r, uint32_t* out) {
  if (!r.Has(1)) return false;
  const uint8_t b = *r.p;
  if (b <= 0x7f) {  // positive fixint
    *out = b;
    ++r.p;
    return true;
  }
  uint64_t u;
  bool neg;
  if (!r.Int(&u, &neg) || neg || u > 0xFFFFFFFFull) return false;
  *out = static_cast<uint32_t>(u);
  return true;
}

#if defined(__SSE2__)
// Per byte of the 64 at q, the size in bytes of a token id starting there: fixint 1, 0xcc 2,
// 0xcd 3, 0xce 5; 0 for any other form. Token ids use these four forms, and which one
// follows which is random (ids spread over the vocabulary): with the table, a token's start
// follows from the previous one's by one load and an add, with no branch on the form
// (TokenValue cuts the value out). SSE2: 16 bytes per step.
struct TokenTables {
  alignas(16) uint8_t len[64];
};
// For each of the 16 bytes of x, the size of a token id starting there (see TokenTables).
inline __m128i TokenLengths(__m128i x) {
  const __m128i cc = _mm_set1_epi8(static_cast<char>(0xcc));
  const __m128i cd = _mm_set1_epi8(static_cast<char>(0xcd));
  const __m128i ce = _mm_set1_epi8(static_cast<char>(0xce));
  return _mm_or_si128(
      _mm_or_si128(_mm_and_si128(_mm_cmpgt_epi8(x, _mm_set1_epi8(-1)), _mm_set1_epi8(1)),
                   _mm_and_si128(_mm_cmpeq_epi8(x, cc), _mm_set1_epi8(2))),
      _mm_or_si128(_mm_and_si128(_mm_cmpeq_epi8(x, cd), _mm_set1_epi8(3)),
                   _mm_and_si128(_mm_cmpeq_epi8(x, ce), _mm_set1_epi8(5))));
}
inline void ClassifyTokenBytes(const uint8_t* q, TokenTables* tt) {
  for (int k = 0; k < 64; k += 16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
    const __m128i len = TokenLengths(x);
    _mm_store_si128(reinterpret_cast<__m128i*>(tt->len + k), len);
  }
}
#endif
// The value of a token id of `len` bytes (1, 2, 3 or 5) at q, from the 8 bytes there read
// big-endian: past the form byte (none for a fixint), len - 1 bytes (1 for a fixint).
inline uint32_t TokenValue(const uint8_t* q, uint32_t len) {
  uint64_t w;
  std::memcpy(&w, q, 8);
  w = __builtin_bswap64(w);
  const uint32_t tagged = len > 1;
  return static_cast<uint32_t>((w << (tagged * 8)) >> (64 - ((len - tagged) << 3)));
}

#if defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__))
#define KVROUTE_PAIRED_WALK 1
// The walk, two tokens per step of its chain. In the walk above each token's start is the
// previous start plus a length loaded from the table: a load and an add per token, in
// series. Here the window's tables also give, for every byte, where the token after next
// starts (nxt2, built with SSSE3 byte shuffles), so the chain takes one load per two tokens
// and the second token's start is loaded off it; the value comes from a shift and a mask
// looked up by position (no computed shift amounts), and the windows are 240 bytes instead
// of 64 (a window's end costs a mispredicted branch). Needs SSSE3 (pshufb, CPUs from 2006
// on): HavePairedWalk() checks at run time; without it the walk above does the work.
// Bytes classified at a time, a multiple of 16. Starts are bytes (up to kPairWindow + 4) and
// 0xff marks another form, so kPairWindow + 4 < 255.
constexpr uint32_t kPairWindow = 240;
// The AVX2 classifier works on 32 bytes at a time: it reads and fills kPairRead bytes, and
// marks the starts from kPairWindow on as past the window (0xff), as the SSSE3 one does.
constexpr uint32_t kPairRead = 256;
static_assert(kPairRead >= kPairWindow + 8, "a window's last 8-byte read stays inside");
struct PairTables {
  alignas(32) uint8_t len[kPairRead];  // as TokenTables
  alignas(32) uint8_t sh[kPairRead];   // 64 - 8 * len: the value's shift (WalkPaired)
  alignas(32) uint8_t nxt[kPairRead];  // the next token's start (i + len); 0xff: other form
  // The start of the token after next; 0xff: another form on the way, or past the window.
  alignas(32) uint8_t nxt2[kPairRead];
};
bool HavePairedWalk() {
  static const bool have = __builtin_cpu_supports("ssse3");
  return have;
}
bool HaveAvx2Classifier() {
  static const bool have = __builtin_cpu_supports("avx2");
  return have;
}
__attribute__((target("ssse3"))) void ClassifyPairs(const uint8_t* q, PairTables* pt) {
  const __m128i minus1 = _mm_set1_epi8(-1);
  const __m128i iota = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  constexpr int kPieces = kPairWindow / 16;
  __m128i nxt[kPieces + 1];
  for (int k = 0; k < kPieces; ++k) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * k));
    const __m128i len = TokenLengths(x);
    _mm_store_si128(reinterpret_cast<__m128i*>(pt->len + 16 * k), len);
    _mm_store_si128(reinterpret_cast<__m128i*>(pt->sh + 16 * k),
                    _mm_sub_epi8(_mm_set1_epi8(64), _mm_slli_epi16(len, 3)));  // (len <= 5)
    const __m128i other = _mm_cmpeq_epi8(len, _mm_setzero_si128());
    nxt[k] = _mm_or_si128(
        _mm_add_epi8(_mm_add_epi8(iota, _mm_set1_epi8(static_cast<char>(16 * k))), len), other);
    _mm_store_si128(reinterpret_cast<__m128i*>(pt->nxt + 16 * k), nxt[k]);
  }
  nxt[kPieces] = minus1;  // past the window
  for (int k = 0; k < kPieces; ++k) {
    // nxt2 = nxt[nxt]: a valid next start is 1-5 bytes on, so in this 16-byte piece or the
    // next: pshufb each piece with the offsets that fall in it (an index with its top bit
    // set gives 0), OR the two. An 0xff start (another form) stays 0xff.
    const __m128i other = _mm_cmpeq_epi8(nxt[k], minus1);
    const __m128i rel = _mm_sub_epi8(nxt[k], _mm_set1_epi8(static_cast<char>(16 * k)));  // 1-20
    const __m128i lo =
        _mm_or_si128(_mm_or_si128(rel, _mm_cmpgt_epi8(rel, _mm_set1_epi8(15))), other);
    const __m128i hi =  // top bit set unless 16-20
        _mm_or_si128(_mm_sub_epi8(rel, _mm_set1_epi8(16)), other);
    const __m128i n2 = _mm_or_si128(
        _mm_or_si128(_mm_shuffle_epi8(nxt[k], lo), _mm_shuffle_epi8(nxt[k + 1], hi)), other);
    _mm_store_si128(reinterpret_cast<__m128i*>(pt->nxt2 + 16 * k), n2);
  }
}
// TokenLengths for 32 bytes (AVX2).
__attribute__((target("avx2"))) inline __m256i TokenLengths256(__m256i x) {
  const __m256i cc = _mm256_set1_epi8(static_cast<char>(0xcc));
  const __m256i cd = _mm256_set1_epi8(static_cast<char>(0xcd));
  const __m256i ce = _mm256_set1_epi8(static_cast<char>(0xce));
  return _mm256_or_si256(
      _mm256_or_si256(
          _mm256_and_si256(_mm256_cmpgt_epi8(x, _mm256_set1_epi8(-1)), _mm256_set1_epi8(1)),
          _mm256_and_si256(_mm256_cmpeq_epi8(x, cc), _mm256_set1_epi8(2))),
      _mm256_or_si256(_mm256_and_si256(_mm256_cmpeq_epi8(x, cd), _mm256_set1_epi8(3)),
                      _mm256_and_si256(_mm256_cmpeq_epi8(x, ce), _mm256_set1_epi8(5))));
}
// ClassifyPairs with 32 bytes per step (AVX2: Haswell, Zen and later; HaveAvx2Classifier()
// checks at run time), the same tables for the first kPairWindow bytes. vpshufb shuffles
// within 16-byte lanes, so nxt2's second source is the pair of pieces one lane on (a lane
// permute of this step's and the next step's nxt), and each lane subtracts its own base.
// Cost: 0.58x the instructions of the 16-byte steps (callgrind, compare_dynamo's store
// payloads: 137M against 238M), where those are ~12 of the walk's ~28 per token.
__attribute__((target("avx2"))) void ClassifyPairsAvx2(const uint8_t* q, PairTables* pt) {
  const __m256i minus1 = _mm256_set1_epi8(-1);
  const __m256i iota = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                        17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m256i lane_base =
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16,
                       16, 16, 16, 16, 16, 16, 16, 16, 16);
  constexpr int kSteps = kPairRead / 32;
  static_assert(kPairWindow == kPairRead - 16, "the last step's upper lane is past the window");
  __m256i nxt[kSteps + 1];
  for (int k = 0; k < kSteps; ++k) {
    const __m256i len =
        TokenLengths256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * k)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pt->len + 32 * k), len);
    _mm256_store_si256(reinterpret_cast<__m256i*>(pt->sh + 32 * k),
                       _mm256_sub_epi8(_mm256_set1_epi8(64), _mm256_slli_epi16(len, 3)));
    const __m256i other = _mm256_cmpeq_epi8(len, _mm256_setzero_si256());
    nxt[k] = _mm256_or_si256(
        _mm256_add_epi8(_mm256_add_epi8(iota, _mm256_set1_epi8(static_cast<char>(32 * k))), len),
        other);
  }
  // Starts from kPairWindow on (the last step's upper lane) are past the window.
  nxt[kSteps - 1] = _mm256_or_si256(
      nxt[kSteps - 1], _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_set1_epi8(-1), 1));
  nxt[kSteps] = minus1;
  for (int k = 0; k < kSteps; ++k) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(pt->nxt + 32 * k), nxt[k]);
    // Lanes (A, B) of this step and (B, C): a lane's next start is in it or in the next.
    const __m256i next = _mm256_permute2x128_si256(nxt[k], nxt[k + 1], 0x21);
    const __m256i other = _mm256_cmpeq_epi8(nxt[k], minus1);
    const __m256i rel = _mm256_sub_epi8(
        nxt[k], _mm256_add_epi8(lane_base, _mm256_set1_epi8(static_cast<char>(32 * k))));
    const __m256i lo =
        _mm256_or_si256(_mm256_or_si256(rel, _mm256_cmpgt_epi8(rel, _mm256_set1_epi8(15))), other);
    const __m256i hi = _mm256_or_si256(_mm256_sub_epi8(rel, _mm256_set1_epi8(16)), other);
    const __m256i n2 = _mm256_or_si256(
        _mm256_or_si256(_mm256_shuffle_epi8(nxt[k], lo), _mm256_shuffle_epi8(next, hi)), other);
    _mm256_store_si256(reinterpret_cast<__m256i*>(pt->nxt2 + 32 * k), n2);
  }
}
// Decodes token ids into t[*io, n) while kPairRead bytes are left (a token starting in the
// window's first kPairWindow - 4 bytes ends inside it, and its 8-byte read stays inside the
// bytes left); a token of another form through CheckedToken. False: CheckedToken failed.
__attribute__((target("ssse3"))) bool WalkPaired(Reader& r, uint32_t* t, uint32_t* io, uint32_t n) {
  // A token's value: the big-endian 8 bytes at its start, shifted right by sh, masked.
  static constexpr uint32_t kMask[8] = {0, 0xff, 0xff, 0xffff, 0, 0xffffffff, 0, 0};
  uint32_t i = *io;
  PairTables pt;
  constexpr uint32_t kStarts = kPairWindow - 4;  // a token starting before ends inside
  const bool avx2 = HaveAvx2Classifier();
  while (i < n && r.left() >= kPairRead) {
    const uint8_t* q = r.p;
    if (avx2) {
      ClassifyPairsAvx2(q, &pt);
    } else {
      ClassifyPairs(q, &pt);
    }
    auto emit = [&](uint32_t x) {
      uint64_t w;
      std::memcpy(&w, q + x, 8);
      t[i++] = static_cast<uint32_t>(__builtin_bswap64(w) >> pt.sh[x]) & kMask[pt.len[x]];
    };
    uint32_t p = 0;
    // Two tokens (at p and nxt[p]) while the one after them starts before kStarts: both are
    // then of a known form and end inside the window.
    while (i + 2 <= n) {
      const uint32_t p2 = pt.nxt2[p];
      if (p2 >= kStarts) break;
      const uint32_t p1 = pt.nxt[p];
      emit(p);
      emit(p1);
      p = p2;
    }
    bool other = false;
    while (p < kStarts && i < n) {
      const uint32_t len = pt.len[p];
      if (len == 0) {
        other = true;
        break;
      }
      emit(p);
      p += len;
    }
    r.p += p;
    if (other) {
      if (!CheckedToken(r, &t[i])) return false;
      ++i;
    }
  }
  *io = i;
  return true;
}
#endif

}  // namespace

bool FastTokenIds(Reader& r, uint32_t* t, uint32_t n) {
  uint32_t i = 0;
  // Token ids come in four msgpack forms (fixint, uint8, uint16, uint32; engines send no
  // other for ids below 2^32), and which form follows which is random: ids are spread
  // over the vocabulary. Any other form is decoded by CheckedToken, one token, and the
  // fast loops go on after it, so one odd id does not send the rest of its event to the
  // checked loop.
#if defined(__SSE2__)
  // 64 bytes at a time while 72 are left (ClassifyTokenBytes): a token starting in the
  // first 60 ends inside the window, and its 8-byte read stays inside the 72. This walk
  // costs the same whatever the forms; the branchy loop below is faster while the form
  // rarely changes from one token to the next (text in one script: mostly uint16) and
  // slower when it changes often (ids spread over the vocabulary; Mooncake pseudo-tokens
  // change form on half the tokens). The first windows count the changes and decide
  // which loop takes the rest: the walk from kWalkChanges % of tokens up. Measured on
  // compare_dynamo's payloads, each path forced: their pseudo-tokens 5.1-7.4 ns per
  // token branchy, 3.6-4.5 walked; the same events with MT-Bench text through Qwen3's
  // tokenizer (27 % changes) ~2.2 branchy, ~3.1 walked (benchmarks/README.md has
  // bench_decode.cc's numbers for the decided path).
  constexpr uint32_t kWalkChanges = 35;
  // Windows counted (~15 tokens each): with one, 9 % of compare_dynamo's events (50 %
  // changes) would take the branchy loop; with three, 1 %.
  constexpr int kSampleWindows = 3;
  TokenTables tt;
  // One window: decodes from r.p until 60 bytes on (or n), then a token of another form
  // through CheckedToken. Counts the form changes only when asked (the first windows).
  auto window = [&](auto count, uint32_t* changes) {
    ClassifyTokenBytes(r.p, &tt);
    const uint8_t* q = r.p;
    uint32_t pos = 0;
    [[maybe_unused]] uint32_t prev_len = 0;
    bool other = false;
    while (pos < 60 && i < n) {
      const uint32_t len = tt.len[pos];
      if (len == 0) {
        other = true;
        break;
      }
      t[i++] = TokenValue(q + pos, len);
      if constexpr (decltype(count)::value) {
        *changes += len != prev_len;
        prev_len = len;
      }
      pos += len;
    }
    r.p += pos;
    if (!other) return true;
    if (!CheckedToken(r, &t[i])) return false;
    ++i;
    return true;
  };
  bool walk = false;
  if (i < n && r.left() >= 72) {
    const uint32_t first = i;
    uint32_t changes = 0;
    for (int k = 0; k < kSampleWindows && i < n && r.left() >= 72; ++k) {
      if (!window(std::true_type{}, &changes)) return false;
    }
    walk = changes * 100 >= (i - first) * kWalkChanges;  // else the branchy loop is faster
  }
#if defined(KVROUTE_PAIRED_WALK)
  if (walk && HavePairedWalk()) {
    if (!WalkPaired(r, t, &i, n)) return false;
    walk = false;
  }
#endif
  while (walk && i < n && r.left() >= 72) {
    if (!window(std::false_type{}, nullptr)) return false;
  }
#endif
  // The rest, while the bytes left hold k tokens of the widest form (5 bytes, read
  // whole): no bounds check per token, and one branch per form, on purpose: when the
  // form seldom changes the branches are predicted and each token's start is known
  // before its form byte is read (a branch-free version waits for that byte: ~1 ns
  // per token slower on text).
  while (i < n) {
    const size_t k = std::min<size_t>(n - i, r.left() / 5);
    if (k == 0) break;
    const uint32_t stop = i + static_cast<uint32_t>(k);
    for (; i < stop; ++i) {
      const uint8_t* q = r.p;
      const uint8_t b = q[0];
      if (b <= 0x7f) {
        t[i] = b;
        r.p = q + 1;
      } else if (b == 0xcd) {
        uint16_t v;
        std::memcpy(&v, q + 1, 2);
        t[i] = __builtin_bswap16(v);
        r.p = q + 3;
      } else if (b == 0xce) {
        uint32_t v;
        std::memcpy(&v, q + 1, 4);
        t[i] = __builtin_bswap32(v);
        r.p = q + 5;
      } else if (b == 0xcc) {
        t[i] = q[1];
        r.p = q + 2;
      } else {
        break;
      }
    }
    if (i < stop) {  // another form
      if (!CheckedToken(r, &t[i])) return false;
      ++i;
    }
  }
  for (; i < n; ++i) {
    if (!CheckedToken(r, &t[i])) return false;
  }
  return true;
}

}  // namespace decoder_internal

using namespace decoder_internal;

bool TokenClassifiersAgreeForTest(const uint8_t* q) {
#if defined(KVROUTE_PAIRED_WALK)
  if (!HavePairedWalk() || !HaveAvx2Classifier()) return true;
  PairTables a, b;
  ClassifyPairsAvx2(q, &a);
  ClassifyPairs(q, &b);
  return std::memcmp(a.len, b.len, kPairWindow) == 0 && std::memcmp(a.sh, b.sh, kPairWindow) == 0 &&
         std::memcmp(a.nxt, b.nxt, kPairWindow) == 0 &&
         std::memcmp(a.nxt2, b.nxt2, kPairWindow) == 0;
#else
  (void)q;
  return true;
#endif
}

}  // namespace kvroute
