// The fast path's pull reader over msgpack bytes (decoder.cc, decoder_tokens.cc): reads the
// common, well-formed forms straight from the payload, bounds checked against DecodeLimits,
// and answers false on anything else (the reference decoder then decodes and counts). Private
// to events/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "events/decoder.h"

// The fast path reads big-endian msgpack fields with memcpy + byteswap: little-endian hosts
// only (as block hashing, common/block_key.cc).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kvroute assumes a little-endian host");

namespace kvroute::decoder_internal {

// The deepest nesting Reader::Skip reads (deeper values: the reference decoder's).
constexpr int kMaxDepth = 8;

struct Reader {
  const uint8_t* p;
  const uint8_t* end;
  const DecodeLimits* lim;

  size_t left() const { return static_cast<size_t>(end - p); }
  bool Has(size_t n) const { return left() >= n; }
  uint8_t Peek() const { return *p; }

  template <typename T>
  bool Be(T* v) {
    static_assert(std::is_unsigned<T>::value, "big-endian unsigned field");
    if (!Has(sizeof(T))) return false;
    T x;
    std::memcpy(&x, p, sizeof(T));
    if constexpr (sizeof(T) == 2) x = __builtin_bswap16(x);
    if constexpr (sizeof(T) == 4) x = __builtin_bswap32(x);
    if constexpr (sizeof(T) == 8) x = __builtin_bswap64(x);
    p += sizeof(T);
    *v = x;
    return true;
  }

  bool Nil() {
    if (Has(1) && *p == 0xc0) {
      ++p;
      return true;
    }
    return false;
  }

  // msgpack-c's integer objects: non-negative values of any int format are "positive".
  // Returns false if not an int. *neg set for negative values (then *u holds the int64 bits).
  bool Int(uint64_t* u, bool* neg) {
    if (!Has(1)) return false;
    const uint8_t b = *p;
    *neg = false;
    if (b <= 0x7f) {
      *u = b;
      ++p;
      return true;
    }
    if (b >= 0xe0) {
      *u = static_cast<uint64_t>(static_cast<int64_t>(static_cast<int8_t>(b)));
      *neg = true;
      ++p;
      return true;
    }
    ++p;
    switch (b) {
      case 0xcc: {
        uint8_t v;
        if (!Be(&v)) return false;
        *u = v;
        return true;
      }
      case 0xcd: {
        uint16_t v;
        if (!Be(&v)) return false;
        *u = v;
        return true;
      }
      case 0xce: {
        uint32_t v;
        if (!Be(&v)) return false;
        *u = v;
        return true;
      }
      case 0xcf: {
        uint64_t v;
        if (!Be(&v)) return false;
        *u = v;
        return true;
      }
      case 0xd0: {
        uint8_t v;
        if (!Be(&v)) return false;
        return Signed(static_cast<int8_t>(v), u, neg);
      }
      case 0xd1: {
        uint16_t v;
        if (!Be(&v)) return false;
        return Signed(static_cast<int16_t>(v), u, neg);
      }
      case 0xd2: {
        uint32_t v;
        if (!Be(&v)) return false;
        return Signed(static_cast<int32_t>(v), u, neg);
      }
      case 0xd3: {
        uint64_t v;
        if (!Be(&v)) return false;
        return Signed(static_cast<int64_t>(v), u, neg);
      }
      default: --p; return false;
    }
  }
  static bool Signed(int64_t v, uint64_t* u, bool* neg) {
    *u = static_cast<uint64_t>(v);
    *neg = v < 0;
    return true;
  }
  // An int64 as the reference's Int(): positive values above INT64_MAX are refused.
  bool I64(int64_t* v) {
    uint64_t u;
    bool neg;
    if (!Int(&u, &neg)) return false;
    if (!neg && u > static_cast<uint64_t>(INT64_MAX)) return false;
    *v = static_cast<int64_t>(u);
    return true;
  }
  bool F64(double* v) {
    if (!Has(1)) return false;
    const uint8_t b = *p;
    if (b == 0xcb) {
      ++p;
      uint64_t bits;
      if (!Be(&bits)) return false;
      std::memcpy(v, &bits, 8);
      return true;
    }
    if (b == 0xca) {
      ++p;
      uint32_t bits;
      if (!Be(&bits)) return false;
      float f;
      std::memcpy(&f, &bits, 4);
      *v = f;
      return true;
    }
    uint64_t u;
    bool neg;
    if (!Int(&u, &neg)) return false;
    *v = neg ? static_cast<double>(static_cast<int64_t>(u)) : static_cast<double>(u);
    return true;
  }
  bool Str(std::string_view* s) {
    if (!Has(1)) return false;
    const uint8_t b = *p;
    size_t n;
    if ((b & 0xe0) == 0xa0) {
      n = b & 0x1f;
      ++p;
    } else if (b == 0xd9) {
      ++p;
      uint8_t v;
      if (!Be(&v)) return false;
      n = v;
    } else if (b == 0xda) {
      ++p;
      uint16_t v;
      if (!Be(&v)) return false;
      n = v;
    } else if (b == 0xdb) {
      ++p;
      uint32_t v;
      if (!Be(&v)) return false;
      n = v;
    } else {
      return false;
    }
    if (n > lim->max_string || !Has(n)) return false;
    *s = std::string_view(reinterpret_cast<const char*>(p), n);
    p += n;
    return true;
  }
  bool Bin(const uint8_t** d, size_t* n) {
    if (!Has(1)) return false;
    const uint8_t b = *p;
    if (b == 0xc4) {
      ++p;
      uint8_t v;
      if (!Be(&v)) return false;
      *n = v;
    } else if (b == 0xc5) {
      ++p;
      uint16_t v;
      if (!Be(&v)) return false;
      *n = v;
    } else if (b == 0xc6) {
      ++p;
      uint32_t v;
      if (!Be(&v)) return false;
      *n = v;
    } else {
      return false;
    }
    if (*n > lim->max_string || !Has(*n)) return false;
    *d = p;
    p += *n;
    return true;
  }
  // Container headers; the count must be plausible (each element takes at least a byte).
  bool Array(uint32_t* n) {
    if (!Has(1)) return false;
    const uint8_t b = *p;
    if ((b & 0xf0) == 0x90) {
      *n = b & 0x0f;
      ++p;
    } else if (b == 0xdc) {
      ++p;
      uint16_t v;
      if (!Be(&v)) return false;
      *n = v;
    } else if (b == 0xdd) {
      ++p;
      if (!Be(n)) return false;
    } else {
      return false;
    }
    return *n <= left() && *n <= lim->max_container;
  }
  bool Map(uint32_t* n) {
    if (!Has(1)) return false;
    const uint8_t b = *p;
    if ((b & 0xf0) == 0x80) {
      *n = b & 0x0f;
      ++p;
    } else if (b == 0xde) {
      ++p;
      uint16_t v;
      if (!Be(&v)) return false;
      *n = v;
    } else if (b == 0xdf) {
      ++p;
      if (!Be(n)) return false;
    } else {
      return false;
    }
    return *n <= left() / 2 && *n <= lim->max_container;
  }
  bool IsStr() const { return Has(1) && ((*p & 0xe0) == 0xa0 || (*p >= 0xd9 && *p <= 0xdb)); }
  bool IsArray() const { return Has(1) && ((*p & 0xf0) == 0x90 || *p == 0xdc || *p == 0xdd); }
  bool IsMap() const { return Has(1) && ((*p & 0xf0) == 0x80 || *p == 0xde || *p == 0xdf); }

  // Skips one value of any kind but extension types.
  bool Skip(int depth) {
    if (!Has(1) || depth > kMaxDepth) return false;
    const uint8_t b = *p;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
      ++p;
      return true;
    }
    uint64_t u;
    bool neg;
    double d;
    std::string_view s;
    const uint8_t* bin;
    size_t bn;
    uint32_t n;
    if ((b >= 0xcc && b <= 0xcf) || (b >= 0xd0 && b <= 0xd3)) return Int(&u, &neg);
    if (b == 0xca || b == 0xcb) return F64(&d);
    if ((b & 0xe0) == 0xa0 || (b >= 0xd9 && b <= 0xdb)) return Str(&s);
    if (b >= 0xc4 && b <= 0xc6) return Bin(&bin, &bn);
    if (IsArray()) {
      if (!Array(&n)) return false;
      for (uint32_t i = 0; i < n; ++i) {
        if (!Has(1)) return false;
        const uint8_t e = *p;  // token ids: fixint / uint16 / uint32, inline
        if (e <= 0x7f) {
          ++p;
        } else if (e == 0xcd && Has(3)) {
          p += 3;
        } else if (e == 0xce && Has(5)) {
          p += 5;
        } else if (!Skip(depth + 1)) {
          return false;
        }
      }
      return true;
    }
    if (IsMap()) {
      if (!Map(&n)) return false;
      for (uint32_t i = 0; i < 2 * n; ++i) {
        if (!Skip(depth + 1)) return false;
      }
      return true;
    }
    return false;  // ext types, 0xc1
  }
};

// Decodes the n token ids of an array whose header r has read into t[0, n) (decoder_tokens.cc).
// False if one is not an integer in [0, 2^32) or the bytes run out.
bool FastTokenIds(Reader& r, uint32_t* t, uint32_t n);

}  // namespace kvroute::decoder_internal
