// The reference decoder (DecodeBatchReference, decoder.h): the wire format read over the
// msgpack-c object tree, field by field. It defines what every payload means, drops included;
// the fast path (decoder.cc) falls back to it for anything unusual and must agree with it.
#include "events/decoder.h"

#include <xxhash.h>

#include <algorithm>
#include <msgpack.hpp>
#include <new>
#include <string_view>

#include "events/decoder_fields.h"

namespace kvroute {

using namespace decoder_internal;

namespace {

using msgpack::object;
namespace mt = msgpack::type;

// The reference decoder reports a dropped event or batch by returning its reason: no
// exception on the drop path (a throw costs microseconds; a payload of one-byte invalid
// events would cost that per byte). kOk: decoded.
constexpr DropReason kOk = DropReason::kCount;
#define KV_TRY(expr)              \
  do {                            \
    const DropReason r_ = (expr); \
    if (r_ != kOk) return r_;     \
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
  if (o.type == mt::FLOAT64 || o.type == mt::FLOAT32)
    *v = o.via.f64;
  else if (o.type == mt::POSITIVE_INTEGER)
    *v = static_cast<double>(o.via.u64);
  else if (o.type == mt::NEGATIVE_INTEGER)
    *v = static_cast<double>(o.via.i64);
  else
    return DropReason::kWrongType;
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
        case 0xc4:
        case 0xd9:
          if (!be(1, &v)) return count;
          skip = v;
          break;
        case 0xc5:
        case 0xda:
          if (!be(2, &v)) return count;
          skip = v;
          break;
        case 0xc6:
        case 0xdb:
          if (!be(4, &v)) return count;
          skip = v;
          break;
        case 0xc7:
          if (!be(1, &v)) return count;
          skip = v + 1;
          break;  // ext: size, type, data
        case 0xc8:
          if (!be(2, &v)) return count;
          skip = v + 1;
          break;
        case 0xc9:
          if (!be(4, &v)) return count;
          skip = v + 1;
          break;
        case 0xcc:
        case 0xd0: skip = 1; break;
        case 0xcd:
        case 0xd1: skip = 2; break;
        case 0xca:
        case 0xce:
        case 0xd2: skip = 4; break;
        case 0xcb:
        case 0xcf:
        case 0xd3: skip = 8; break;
        case 0xd4: skip = 2; break;  // fixext: type + 1, 2, 4, 8, 16 bytes
        case 0xd5: skip = 3; break;
        case 0xd6: skip = 5; break;
        case 0xd7: skip = 9; break;
        case 0xd8: skip = 17; break;
        case 0xdc:
          if (!be(2, &v)) return count;
          kids = v;
          break;
        case 0xdd:
          if (!be(4, &v)) return count;
          kids = v;
          break;
        case 0xde:
          if (!be(2, &v)) return count;
          kids = 2 * v;
          break;
        case 0xdf:
          if (!be(4, &v)) return count;
          kids = 2 * v;
          break;
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

bool DecodeBatchReference(const char* payload, size_t len, const DecodeLimits& lim, EventBatch* out,
                          DropCounts* drops) noexcept {
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

}  // namespace kvroute
