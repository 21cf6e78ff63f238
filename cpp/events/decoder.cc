#include "events/decoder.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <msgpack.hpp>
#include <new>
#include <string_view>
#if defined(__SSE2__)
#include <emmintrin.h>
#include <immintrin.h>
#include <tmmintrin.h>
#endif

// The fast path reads big-endian msgpack fields with memcpy + byteswap: little-endian hosts
// only (as block hashing, common/block_key.cc).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kvroute assumes a little-endian host");

namespace kvroute {

namespace {

using msgpack::object;
namespace mt = msgpack::type;

// The reference decoder reports a dropped event or batch by returning its reason: no
// exception on the drop path (a throw costs microseconds; a payload of one-byte invalid
// events would cost that per byte). kOk: decoded.
constexpr DropReason kOk = DropReason::kCount;
#define KV_TRY(expr)                     \
  do {                                   \
    const DropReason r_ = (expr);        \
    if (r_ != kOk) return r_;            \
  } while (0)

bool IsNil(const object& o) { return o.type == mt::NIL; }

DropReason Str(const object& o, std::string_view* s) {
  if (o.type != mt::STR) return DropReason::kWrongType;
  *s = {o.via.str.ptr, o.via.str.size};
  return kOk;
}

DropReason Int(const object& o, int64_t* v) {
  if (o.type == mt::POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<uint64_t>(INT64_MAX)) return DropReason::kWrongType;
    *v = static_cast<int64_t>(o.via.u64);
    return kOk;
  }
  if (o.type == mt::NEGATIVE_INTEGER) {
    *v = o.via.i64;
    return kOk;
  }
  return DropReason::kWrongType;
}

DropReason Float(const object& o, double* v) {
  if (o.type == mt::FLOAT64 || o.type == mt::FLOAT32) *v = o.via.f64;
  else if (o.type == mt::POSITIVE_INTEGER) *v = static_cast<double>(o.via.u64);
  else if (o.type == mt::NEGATIVE_INTEGER) *v = static_cast<double>(o.via.i64);
  else return DropReason::kWrongType;
  return kOk;
}

DropReason Hash(const object& o, EngineHash* out) {
  EngineHash h;
  switch (o.type) {
    case mt::POSITIVE_INTEGER: h.lo = o.via.u64; break;
    case mt::NEGATIVE_INTEGER: h.lo = static_cast<uint64_t>(o.via.i64); break;
    case mt::BIN: {
      const auto* p = reinterpret_cast<const unsigned char*>(o.via.bin.ptr);
      const size_t n = o.via.bin.size;
      if (n == 0) return DropReason::kWrongType;
      if (n == 16) {
        for (int i = 0; i < 8; ++i) h.hi = (h.hi << 8) | p[i];
        for (int i = 8; i < 16; ++i) h.lo = (h.lo << 8) | p[i];
      } else {
        XXH128_hash_t d = XXH3_128bits(p, n);
        h.hi = d.high64;
        h.lo = d.low64;
      }
      h.hi |= 1ull << 63;
      break;
    }
    default: return DropReason::kWrongType;
  }
  *out = h;
  return kOk;
}

DropReason Hashes(const object& o, const DecodeLimits& lim, std::vector<EngineHash>* out) {
  if (o.type != mt::ARRAY) return DropReason::kWrongType;
  if (o.via.array.size > lim.max_blocks_per_event) return DropReason::kOversized;
  out->clear();  // a repeated map key replaces, as for every other field
  out->resize(o.via.array.size);
  for (uint32_t i = 0; i < o.via.array.size; ++i) KV_TRY(Hash(o.via.array.ptr[i], &(*out)[i]));
  return kOk;
}

DropReason Tokens(const object& o, TokenIds* out) {
  if (o.type != mt::ARRAY) return DropReason::kWrongType;
  const uint32_t n = o.via.array.size;
  out->resize(n);
  const object* p = o.via.array.ptr;
  for (uint32_t i = 0; i < n; ++i) {
    if (p[i].type == mt::POSITIVE_INTEGER) {
      if (p[i].via.u64 > 0xFFFFFFFFull) return DropReason::kTokenOutOfRange;
      (*out)[i] = static_cast<uint32_t>(p[i].via.u64);
    } else if (p[i].type == mt::NEGATIVE_INTEGER) {
      return DropReason::kTokenOutOfRange;
    } else {
      return DropReason::kWrongType;
    }
  }
  return kOk;
}

std::string Pack(const object& o) {
  msgpack::sbuffer buf;
  msgpack::pack(buf, o);
  return std::string(buf.data(), buf.size());
}

DropReason ExtraKeys(const object& o, Event* ev) {
  if (IsNil(o)) return kOk;
  if (o.type != mt::ARRAY) return DropReason::kWrongType;
  ev->extra_keys.resize(o.via.array.size);
  for (uint32_t i = 0; i < o.via.array.size; ++i) {
    const object& e = o.via.array.ptr[i];
    if (!IsNil(e)) ev->extra_keys[i] = Pack(e);
  }
  return kOk;
}

// Canonical form of a cache salt: the msgpack of the one-element array [salt], i.e. what
// the request path encodes for `cache_salt=`.
std::string PackSalt(const object& v) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_array(1);
  pk.pack(v);
  return std::string(buf.data(), buf.size());
}

// SGLang's metadata map at array position 7: {"cache_salt": s, ...}; other keys ignored.
void SglangMetadata(const object& o, Event* ev) {
  for (uint32_t i = 0; i < o.via.map.size; ++i) {
    const object& k = o.via.map.ptr[i].key;
    if (k.type == mt::STR && std::string_view(k.via.str.ptr, k.via.str.size) == "cache_salt") {
      const object& v = o.via.map.ptr[i].val;
      if (!IsNil(v)) ev->cache_salt = PackSalt(v);
    }
  }
}

DropReason Medium_(const object& o, Event* ev, bool* unknown_medium) {
  if (IsNil(o)) return kOk;
  std::string_view s;
  KV_TRY(Str(o, &s));
  ev->has_medium = true;
  ev->medium.assign(s.data(), s.size());
  bool known = true;
  ev->tier = ParseMedium(s, &known);
  if (!known) {
    *unknown_medium = true;
    ev->medium_known = false;
  }
  return kOk;
}

// An optional string field: nil leaves it as it is.
DropReason OptStr(const object& v, std::string* out) {
  if (IsNil(v)) return kOk;
  std::string_view s;
  KV_TRY(Str(v, &s));
  out->assign(s.data(), s.size());
  return kOk;
}

// Field setters shared by the array and map encodings. `pos` is the 1-based position after
// the tag in the array encoding; the map encoding looks positions up by field name.
enum Field : int {
  kBlockHashes = 1,
  kParent,
  kTokenIds,
  kBlockSize,
  kLoraId,
  kMediumF,
  kLoraName,
  kExtraKeys,
  kGroupIdx,
  kSpecKind,
  kSlidingWindow,
  kLocality,   // map era only
  kCacheSalt,  // SGLang map era: a plain key
  kMetadata,   // SGLang: {"cache_salt": ...}
  kUnknownField
};

DropReason SetStoredField(int f, const object& v, const DecodeLimits& lim, Event* ev,
                          bool* unknown_medium) {
  switch (f) {
    case kBlockHashes: return Hashes(v, lim, &ev->block_hashes);
    case kParent:
      if (IsNil(v)) return kOk;
      ev->has_parent = true;
      return Hash(v, &ev->parent_block_hash);
    case kTokenIds: return Tokens(v, &ev->token_ids);
    case kBlockSize: return Int(v, &ev->block_size);
    case kLoraId:
      if (IsNil(v)) return kOk;
      ev->has_lora_id = true;
      return Int(v, &ev->lora_id);
    case kMediumF: return Medium_(v, ev, unknown_medium);
    case kLoraName:
      if (v.type == mt::MAP) {
        SglangMetadata(v, ev);
        return kOk;
      }
      return OptStr(v, &ev->lora_name);
    case kExtraKeys: return ExtraKeys(v, ev);
    case kGroupIdx:
      if (IsNil(v)) return kOk;
      return Int(v, &ev->group_idx);
    case kSpecKind: return OptStr(v, &ev->kv_cache_spec_kind);
    case kSlidingWindow:
      if (IsNil(v)) return kOk;
      ev->has_sliding_window = true;
      return Int(v, &ev->sliding_window);
    case kLocality: return OptStr(v, &ev->locality);
    case kCacheSalt:
      if (!IsNil(v)) ev->cache_salt = PackSalt(v);
      return kOk;
    case kMetadata:
      if (v.type == mt::MAP) SglangMetadata(v, ev);
      return kOk;
    default: return kOk;  // unknown fields and trailing positions are skipped
  }
}

// BlockRemoved: block_hashes, medium, group_idx (+ locality in the map era).
int RemovedArrayField(int pos) {
  switch (pos) {
    case 1: return kBlockHashes;
    case 2: return kMediumF;
    case 3: return kGroupIdx;
    default: return kUnknownField;
  }
}

int FieldByName(std::string_view k) {
  if (k == "block_hashes") return kBlockHashes;
  if (k == "parent_block_hash") return kParent;
  if (k == "token_ids") return kTokenIds;
  if (k == "block_size") return kBlockSize;
  if (k == "lora_id") return kLoraId;
  if (k == "medium") return kMediumF;
  if (k == "lora_name") return kLoraName;
  if (k == "extra_keys") return kExtraKeys;
  if (k == "group_idx") return kGroupIdx;
  if (k == "kv_cache_spec_kind") return kSpecKind;
  if (k == "kv_cache_spec_sliding_window") return kSlidingWindow;
  if (k == "locality") return kLocality;
  if (k == "cache_salt") return kCacheSalt;
  if (k == "metadata") return kMetadata;
  return kUnknownField;
}

bool TagType(std::string_view tag, EventType* t) {
  if (tag == "BlockStored") *t = EventType::kBlockStored;
  else if (tag == "BlockRemoved") *t = EventType::kBlockRemoved;
  else if (tag == "AllBlocksCleared") *t = EventType::kAllBlocksCleared;
  else return false;
  return true;
}

// The event's tag: a string naming one of the three kinds.
DropReason Tag(const object& o, EventType* t) {
  std::string_view tag;
  KV_TRY(Str(o, &tag));
  return TagType(tag, t) ? kOk : DropReason::kUnknownTag;
}

// The event's kind, from its tag (array: position 0; map: the last "type" key). Checked
// before an Event is taken from the batch, so that a dropped event costs only its bytes.
DropReason EventKind(const object& o, EventType* t) {
  if (o.type == mt::ARRAY) {
    if (o.via.array.size == 0) return DropReason::kWrongType;
    return Tag(o.via.array.ptr[0], t);
  }
  if (o.type != mt::MAP) return DropReason::kWrongType;
  const object* tag = nullptr;
  for (uint32_t i = 0; i < o.via.map.size; ++i) {
    const object& k = o.via.map.ptr[i].key;
    if (k.type == mt::STR && std::string_view(k.via.str.ptr, k.via.str.size) == "type") {
      tag = &o.via.map.ptr[i].val;
    }
  }
  if (tag == nullptr) return DropReason::kWrongType;
  return Tag(*tag, t);
}

DropReason DecodeEventFields(const object& o, const DecodeLimits& lim, Event* ev) {
  bool unknown_medium = false;
  KV_TRY(EventKind(o, &ev->type));
  if (o.type == mt::ARRAY) {
    for (uint32_t i = 1; i < o.via.array.size; ++i) {
      int f = kUnknownField;
      if (ev->type == EventType::kBlockStored) {
        f = i <= kSlidingWindow ? static_cast<int>(i) : kUnknownField;
      } else if (ev->type == EventType::kBlockRemoved) {
        f = RemovedArrayField(static_cast<int>(i));
      }
      KV_TRY(SetStoredField(f, o.via.array.ptr[i], lim, ev, &unknown_medium));
    }
  } else {  // a map (EventKind checked)
    if (ev->type != EventType::kAllBlocksCleared) {
      for (uint32_t i = 0; i < o.via.map.size; ++i) {
        const object& k = o.via.map.ptr[i].key;
        if (k.type != mt::STR) continue;  // unknown, non-string keys are skipped
        int f = FieldByName(std::string_view(k.via.str.ptr, k.via.str.size));
        if (ev->type == EventType::kBlockRemoved && f != kBlockHashes && f != kMediumF &&
            f != kGroupIdx && f != kLocality) {
          f = kUnknownField;
        }
        KV_TRY(SetStoredField(f, o.via.map.ptr[i].val, lim, ev, &unknown_medium));
      }
    }
  }
  // The salt keys the first block of a request only: a run from token 0 carries it; a run
  // with a parent inherits it through the parent's key.
  if (!ev->cache_salt.empty() && !ev->has_parent && !ev->block_hashes.empty()) {
    if (ev->extra_keys.empty()) ev->extra_keys.resize(1);
    if (ev->extra_keys[0].empty()) ev->extra_keys[0] = ev->cache_salt;
  }
  return kOk;
}

// Returns false (and counts) when the event is dropped. The only exception left is an
// allocation failure (std::bad_alloc), counted as oversized.
bool DecodeEvent(const object& o, const DecodeLimits& lim, Event* ev, DropCounts* drops) {
  DropReason r;
  try {
    r = DecodeEventFields(o, lim, ev);
  } catch (const std::bad_alloc&) {
    r = DropReason::kOversized;
  } catch (...) {
    r = DropReason::kWrongType;
  }
  if (r == kOk) return true;
  drops->Add(r);
  return false;
}

const object* MapGet(const object& m, std::string_view key) {
  for (uint32_t i = 0; i < m.via.map.size; ++i) {
    const object& k = m.via.map.ptr[i].key;
    if (k.type == mt::STR && std::string_view(k.via.str.ptr, k.via.str.size) == key) {
      return &m.via.map.ptr[i].val;
    }
  }
  return nullptr;
}

bool ZeroCopy(mt::object_type, std::size_t, void*) { return true; }

// The number of objects msgpack-c's unpack builds for the first value in p[0, len): a linear
// scan with no allocation, which stops once the count passes `stop`. On a malformed or cut
// short payload it counts what comes before the fault (unpack fails there). A map entry
// counts two (msgpack-c's object_kv is two objects).
size_t TreeElements(const char* payload, size_t len, size_t stop) {
  const auto* p = reinterpret_cast<const uint8_t*>(payload);
  const uint8_t* const end = p + len;
  auto be = [&](int k, uint64_t* v) {
    if (end - p < k) return false;
    uint64_t x = 0;
    for (int i = 0; i < k; ++i) x = (x << 8) | p[i];
    p += k;
    *v = x;
    return true;
  };
  uint64_t pending = 1;
  size_t count = 0;
  while (pending > 0 && p < end && count <= stop) {
    --pending;
    ++count;
    const uint8_t b = *p++;
    uint64_t skip = 0;  // bytes after the header
    uint64_t kids = 0;
    uint64_t v = 0;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
      // one byte
    } else if ((b & 0xf0) == 0x90) {
      kids = b & 0x0f;
    } else if ((b & 0xf0) == 0x80) {
      kids = 2u * (b & 0x0f);
    } else if ((b & 0xe0) == 0xa0) {
      skip = b & 0x1f;
    } else {
      switch (b) {
        case 0xc4: case 0xd9: if (!be(1, &v)) return count; skip = v; break;
        case 0xc5: case 0xda: if (!be(2, &v)) return count; skip = v; break;
        case 0xc6: case 0xdb: if (!be(4, &v)) return count; skip = v; break;
        case 0xc7: if (!be(1, &v)) return count; skip = v + 1; break;  // ext: size, type, data
        case 0xc8: if (!be(2, &v)) return count; skip = v + 1; break;
        case 0xc9: if (!be(4, &v)) return count; skip = v + 1; break;
        case 0xcc: case 0xd0: skip = 1; break;
        case 0xcd: case 0xd1: skip = 2; break;
        case 0xca: case 0xce: case 0xd2: skip = 4; break;
        case 0xcb: case 0xcf: case 0xd3: skip = 8; break;
        case 0xd4: skip = 2; break;  // fixext: type + 1, 2, 4, 8, 16 bytes
        case 0xd5: skip = 3; break;
        case 0xd6: skip = 5; break;
        case 0xd7: skip = 9; break;
        case 0xd8: skip = 17; break;
        case 0xdc: if (!be(2, &v)) return count; kids = v; break;
        case 0xdd: if (!be(4, &v)) return count; kids = v; break;
        case 0xde: if (!be(2, &v)) return count; kids = 2 * v; break;
        case 0xdf: if (!be(4, &v)) return count; kids = 2 * v; break;
        default: return count;  // 0xc1: never used
      }
    }
    if (skip > static_cast<uint64_t>(end - p)) return count;
    p += skip;
    pending += kids;
  }
  return count;
}

// Objects the reference decoder may build for a payload of `len` bytes (README.md, "Bounds").
size_t ReferenceElementBudget(size_t len, const DecodeLimits& lim) {
  return std::max(len / 2, lim.min_tree_elements);
}

// The batch's outer shape (array or map form) and its events, over the parsed tree.
DropReason DecodeTree(const object& b, const DecodeLimits& lim, EventBatch* out,
                      DropCounts* drops) {
  const object* events = nullptr;
  const object* rank = nullptr;
  if (b.type == mt::ARRAY) {
    if (b.via.array.size < 2) return DropReason::kWrongType;
    KV_TRY(Float(b.via.array.ptr[0], &out->ts));
    events = &b.via.array.ptr[1];
    if (b.via.array.size >= 3) rank = &b.via.array.ptr[2];
  } else if (b.type == mt::MAP) {
    const object* ts = MapGet(b, "ts");
    events = MapGet(b, "events");
    rank = MapGet(b, "data_parallel_rank");
    if (ts == nullptr || events == nullptr) return DropReason::kWrongType;
    KV_TRY(Float(*ts, &out->ts));
  } else {
    return DropReason::kWrongType;
  }
  if (rank != nullptr && !IsNil(*rank)) {
    out->has_dp_rank = true;
    KV_TRY(Int(*rank, &out->dp_rank));
  }
  if (events->type != mt::ARRAY) return DropReason::kWrongType;
  out->events.reserve(std::min<size_t>(events->via.array.size, 1024));
  for (uint32_t i = 0; i < events->via.array.size; ++i) {
    const object& e = events->via.array.ptr[i];
    EventType kind;
    const DropReason r = EventKind(e, &kind);
    if (r != kOk) {
      drops->Add(r);
      continue;
    }
    if (!DecodeEvent(e, lim, &out->Add(), drops)) out->DropLast();
  }
  return kOk;
}

}  // namespace

bool DecodeBatchReference(const char* payload, size_t len, const DecodeLimits& lim,
                          EventBatch* out, DropCounts* drops) noexcept {
  out->Clear();
  if (len > lim.max_payload_bytes) {
    drops->Add(DropReason::kOversized);
    return false;
  }
  DropReason r = kOk;
  // msgpack-c's unpack reports errors by exception: at most one per batch.
  try {
    // msgpack-c builds one object (24 bytes) per element: past the tree budget the batch is
    // dropped before a byte of it is allocated.
    const size_t budget = ReferenceElementBudget(len, lim);
    if (TreeElements(payload, len, budget) > budget) {
      r = DropReason::kOversized;
    } else {
      std::size_t off = 0;
      // msgpack-c reserves count x sizeof(object) as soon as it reads an array/map header:
      // a count can never honestly exceed the payload's length, so cap it there.
      const size_t containers = std::min(lim.max_container, len);
      msgpack::unpack_limit ul(containers, containers, lim.max_string, lim.max_string,
                               lim.max_string, lim.max_depth);
      msgpack::object_handle oh = msgpack::unpack(payload, len, off, ZeroCopy, nullptr, ul);
      r = off != len ? DropReason::kTrailingBytes : DecodeTree(oh.get(), lim, out, drops);
    }
  } catch (const msgpack::insufficient_bytes&) {
    r = DropReason::kTruncated;
  } catch (const msgpack::size_overflow& e) {
    // Past our cap at the payload length, an array/map header promises more elements than
    // there are bytes left: the payload is cut short (or lying about it).
    const bool count = dynamic_cast<const msgpack::array_size_overflow*>(&e) != nullptr ||
                       dynamic_cast<const msgpack::map_size_overflow*>(&e) != nullptr;
    r = count && len < lim.max_container ? DropReason::kTruncated : DropReason::kOversized;
  } catch (const std::bad_alloc&) {
    r = DropReason::kOversized;
  } catch (...) {
    r = DropReason::kParseError;
  }
  if (r == kOk) return true;
  drops->Add(r);
  out->Clear();
  return false;
}
#undef KV_TRY

namespace {

// ---- Fast path -------------------------------------------------------------------------
// A pull reader over the payload bytes that decodes the common, well-formed batch straight
// into an EventBatch, without building a msgpack object per token id. It accepts only what it
// can decode exactly as the reference decoder does; on anything else (an error of any kind,
// an unknown tag, extension types, extra keys or a salt, nesting deeper than kMaxDepth) it
// gives up and the reference decoder (msgpack-c objects, above) decodes and counts. The fuzz
// target checks that both agree on every input the fast path accepts.

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
      case 0xcc: { uint8_t v; if (!Be(&v)) return false; *u = v; return true; }
      case 0xcd: { uint16_t v; if (!Be(&v)) return false; *u = v; return true; }
      case 0xce: { uint32_t v; if (!Be(&v)) return false; *u = v; return true; }
      case 0xcf: { uint64_t v; if (!Be(&v)) return false; *u = v; return true; }
      case 0xd0: { uint8_t v; if (!Be(&v)) return false; return Signed(static_cast<int8_t>(v), u, neg); }
      case 0xd1: { uint16_t v; if (!Be(&v)) return false; return Signed(static_cast<int16_t>(v), u, neg); }
      case 0xd2: { uint32_t v; if (!Be(&v)) return false; return Signed(static_cast<int32_t>(v), u, neg); }
      case 0xd3: { uint64_t v; if (!Be(&v)) return false; return Signed(static_cast<int64_t>(v), u, neg); }
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

bool FastHash(Reader& r, EngineHash* h) {
  *h = EngineHash{};
  uint64_t u;
  bool neg;
  if (r.Int(&u, &neg)) {
    h->lo = u;
    return true;
  }
  const uint8_t* d;
  size_t n;
  if (!r.Bin(&d, &n) || n == 0) return false;
  if (n == 16) {
    for (int i = 0; i < 8; ++i) h->hi = (h->hi << 8) | d[i];
    for (int i = 8; i < 16; ++i) h->lo = (h->lo << 8) | d[i];
  } else {
    XXH128_hash_t x = XXH3_128bits(d, n);
    h->hi = x.high64;
    h->lo = x.low64;
  }
  h->hi |= 1ull << 63;
  return true;
}

bool FastString(Reader& r, std::string* out) {
  if (r.Nil()) return true;
  std::string_view s;
  if (!r.Str(&s)) return false;
  out->assign(s.data(), s.size());
  return true;
}

// SGLang metadata map: decoded here only when it carries no (or a nil) cache_salt.
bool FastMetadata(Reader& r) {
  uint32_t m;
  if (!r.Map(&m)) return false;
  for (uint32_t j = 0; j < m; ++j) {
    if (r.IsStr()) {
      std::string_view k;
      if (!r.Str(&k)) return false;
      if (k == "cache_salt") {
        if (!r.Nil()) return false;
        continue;
      }
    } else if (!r.Skip(4)) {
      return false;
    }
    if (!r.Skip(4)) return false;
  }
  return true;
}

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
  const __m256i iota = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                        16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
                                        30, 31);
  const __m256i lane_base = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
                                             16, 16, 16, 16);
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
    const __m256i lo = _mm256_or_si256(
        _mm256_or_si256(rel, _mm256_cmpgt_epi8(rel, _mm256_set1_epi8(15))), other);
    const __m256i hi = _mm256_or_si256(_mm256_sub_epi8(rel, _mm256_set1_epi8(16)), other);
    const __m256i n2 = _mm256_or_si256(
        _mm256_or_si256(_mm256_shuffle_epi8(nxt[k], lo), _mm256_shuffle_epi8(next, hi)), other);
    _mm256_store_si256(reinterpret_cast<__m256i*>(pt->nxt2 + 32 * k), n2);
  }
}
// Decodes token ids into t[*io, n) while kPairRead bytes are left (a token starting in the
// window's first kPairWindow - 4 bytes ends inside it, and its 8-byte read stays inside the
// bytes left); a token of another form through CheckedToken. False: CheckedToken failed.
__attribute__((target("ssse3"))) bool WalkPaired(Reader& r, uint32_t* t, uint32_t* io,
                                                 uint32_t n) {
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

bool FastField(Reader& r, int f, Event* ev) {
  switch (f) {
    case kBlockHashes: {
      uint32_t n;
      if (!r.Array(&n) || n > r.lim->max_blocks_per_event) return false;
      ev->block_hashes.resize(n);
      for (uint32_t i = 0; i < n; ++i) {
        if (!FastHash(r, &ev->block_hashes[i])) return false;
      }
      return true;
    }
    case kParent:
      if (r.Nil()) return true;  // as the reference: nil leaves an earlier value
      ev->has_parent = true;
      return FastHash(r, &ev->parent_block_hash);
    case kTokenIds: {
      uint32_t n;
      if (!r.Array(&n)) return false;
      ev->token_ids.resize(n);
      uint32_t* t = ev->token_ids.data();
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
    case kBlockSize: return r.I64(&ev->block_size);
    case kLoraId:
      if (r.Nil()) return true;
      ev->has_lora_id = true;
      return r.I64(&ev->lora_id);
    case kMediumF: {
      if (r.Nil()) return true;  // as the reference: nil leaves the medium unchanged
      std::string_view s;
      if (!r.Str(&s)) return false;
      ev->has_medium = true;
      ev->medium.assign(s.data(), s.size());
      bool known = true;
      ev->tier = ParseMedium(s, &known);
      if (!known) ev->medium_known = false;
      return true;
    }
    case kLoraName:
      if (r.IsMap()) return FastMetadata(r);
      return FastString(r, &ev->lora_name);
    case kExtraKeys: {
      if (r.Nil()) return true;
      uint32_t n;
      if (!r.Array(&n)) return false;
      ev->extra_keys.assign(n, std::string());
      for (uint32_t i = 0; i < n; ++i) {
        if (!r.Nil()) return false;  // real extra keys: the reference packs them canonically
      }
      return true;
    }
    case kGroupIdx:
      if (r.Nil()) return true;
      return r.I64(&ev->group_idx);
    case kSpecKind: return FastString(r, &ev->kv_cache_spec_kind);
    case kSlidingWindow:
      if (r.Nil()) return true;
      ev->has_sliding_window = true;
      return r.I64(&ev->sliding_window);
    case kLocality: return FastString(r, &ev->locality);
    case kCacheSalt: return r.Nil();
    case kMetadata: return r.Skip(3);  // no cache_salt read here: give up if it matters
    default: return r.Skip(3);
  }
}



bool FastEvent(Reader& r, Event* ev) {
  if (r.IsArray()) {
    uint32_t n;
    if (!r.Array(&n) || n == 0) return false;
    std::string_view tag;
    if (!r.Str(&tag) || !TagType(tag, &ev->type)) return false;
    for (uint32_t i = 1; i < n; ++i) {
      int f = kUnknownField;
      if (ev->type == EventType::kBlockStored) {
        f = i <= kSlidingWindow ? static_cast<int>(i) : kUnknownField;
      } else if (ev->type == EventType::kBlockRemoved) {
        f = RemovedArrayField(static_cast<int>(i));
      }
      if (!FastField(r, f, ev)) return false;
    }
    return true;
  }
  uint32_t n;
  if (!r.Map(&n)) return false;
  const uint8_t* start = r.p;
  uint32_t first = 0;  // map entries already consumed when the fields are decoded
  std::string_view k;
  if (n > 0 && r.IsStr() && r.Str(&k) && k == "type") {
    // msgspec writes the tag first (vLLM's tagged structs): one pass.
    std::string_view tag;
    if (!r.Str(&tag) || !TagType(tag, &ev->type)) return false;
    first = 1;
  } else {
    // The tag comes later: find it (the last "type" key wins, as in the reference), then
    // decode the fields from the start.
    r.p = start;
    bool have_tag = false;
    for (uint32_t i = 0; i < n; ++i) {
      if (r.IsStr()) {
        if (!r.Str(&k)) return false;
        if (k == "type") {
          std::string_view tag;
          if (!r.Str(&tag) || !TagType(tag, &ev->type)) return false;
          have_tag = true;
          continue;
        }
      } else if (!r.Skip(3)) {
        return false;
      }
      if (!r.Skip(3)) return false;
    }
    if (!have_tag) return false;
    r.p = start;
  }
  if (ev->type == EventType::kAllBlocksCleared) {
    for (uint32_t i = first; i < n; ++i) {
      if (first == 1 && r.IsStr()) {
        if (!r.Str(&k)) return false;
        if (k == "type") return false;  // a second tag: the last one wins, the reference decides
      } else if (!r.Skip(3)) {
        return false;
      }
      if (!r.Skip(3)) return false;
    }
    return true;
  }
  for (uint32_t i = first; i < n; ++i) {
    if (!r.IsStr()) {
      if (!r.Skip(3) || !r.Skip(3)) return false;  // non-string keys are skipped
      continue;
    }
    if (!r.Str(&k)) return false;
    if (k == "type") {
      if (first == 1) return false;  // a second tag after a leading one: the reference decides
      if (!r.Skip(3)) return false;
      continue;
    }
    int f = FieldByName(k);
    if (ev->type == EventType::kBlockRemoved && f != kBlockHashes && f != kMediumF &&
        f != kGroupIdx && f != kLocality) {
      f = kUnknownField;
    }
    if (f == kMetadata) {
      if (!FastMetadata(r)) return false;
      continue;
    }
    if (!FastField(r, f, ev)) return false;
  }
  return true;
}

bool FastDecode(const char* payload, size_t len, const DecodeLimits& lim, EventBatch* out) {
  // The fast path nests up to kMaxDepth + 4 levels; a tighter configured limit is the
  // reference decoder's to enforce.
  if (lim.max_depth < static_cast<size_t>(kMaxDepth) + 4) return false;
  Reader r{reinterpret_cast<const uint8_t*>(payload),
           reinterpret_cast<const uint8_t*>(payload) + len, &lim};
  uint32_t n;
  if (r.IsArray()) {
    if (!r.Array(&n) || n < 2) return false;
    if (!r.F64(&out->ts)) return false;
    uint32_t ne;
    if (!r.Array(&ne)) return false;
    for (uint32_t i = 0; i < ne; ++i) {  // no reserve: a header may promise what is not there
      if (!FastEvent(r, &out->Add())) return false;
    }
    if (n >= 3) {
      if (!r.Nil()) {
        out->has_dp_rank = true;
        if (!r.I64(&out->dp_rank)) return false;
      }
      for (uint32_t i = 3; i < n; ++i) {
        if (!r.Skip(1)) return false;
      }
    }
    return r.p == r.end;
  }
  return false;  // map batches: the reference decoder
}

}  // namespace

bool DecodeBatch(const char* payload, size_t len, const DecodeLimits& lim, EventBatch* out,
                 DropCounts* drops) noexcept {
  if (len <= lim.max_payload_bytes) {
    out->Clear();
    try {
      if (FastDecode(payload, len, lim, out)) return true;
    } catch (...) {  // std::bad_alloc: let the reference decoder count it
    }
  }
  return DecodeBatchReference(payload, len, lim, out, drops);
}

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
