#include "events/decoder.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <msgpack.hpp>
#include <new>
#include <string_view>

namespace kvroute {

const char* DropReasonName(DropReason r) {
  switch (r) {
    case DropReason::kTruncated: return "truncated";
    case DropReason::kParseError: return "parse_error";
    case DropReason::kOversized: return "oversized";
    case DropReason::kWrongType: return "wrong_type";
    case DropReason::kUnknownTag: return "unknown_tag";
    case DropReason::kBadTokenCount: return "bad_token_count";
    case DropReason::kTokenOutOfRange: return "token_out_of_range";
    case DropReason::kTrailingBytes: return "trailing_bytes";
    case DropReason::kBlockSizeMismatch: return "block_size_mismatch";
    case DropReason::kBadFrames: return "bad_frames";
    case DropReason::kRankMismatch: return "rank_mismatch";
    case DropReason::kUnsupportedSpec: return "unsupported_spec";
    case DropReason::kCount: break;
  }
  return "?";
}

namespace {

using msgpack::object;
namespace mt = msgpack::type;

// Thrown inside this file only, caught in DecodeBatch / DecodeEvent.
struct Bad {
  DropReason reason;
};

[[noreturn]] void Fail(DropReason r) { throw Bad{r}; }

bool IsNil(const object& o) { return o.type == mt::NIL; }

std::string_view Str(const object& o) {
  if (o.type != mt::STR) Fail(DropReason::kWrongType);
  return {o.via.str.ptr, o.via.str.size};
}

int64_t Int(const object& o) {
  if (o.type == mt::POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<uint64_t>(INT64_MAX)) Fail(DropReason::kWrongType);
    return static_cast<int64_t>(o.via.u64);
  }
  if (o.type == mt::NEGATIVE_INTEGER) return o.via.i64;
  Fail(DropReason::kWrongType);
}

double Float(const object& o) {
  if (o.type == mt::FLOAT64 || o.type == mt::FLOAT32) return o.via.f64;
  if (o.type == mt::POSITIVE_INTEGER) return static_cast<double>(o.via.u64);
  if (o.type == mt::NEGATIVE_INTEGER) return static_cast<double>(o.via.i64);
  Fail(DropReason::kWrongType);
}

EngineHash Hash(const object& o) {
  EngineHash h;
  switch (o.type) {
    case mt::POSITIVE_INTEGER: h.lo = o.via.u64; return h;
    case mt::NEGATIVE_INTEGER: h.lo = static_cast<uint64_t>(o.via.i64); return h;
    case mt::BIN: {
      const auto* p = reinterpret_cast<const unsigned char*>(o.via.bin.ptr);
      const size_t n = o.via.bin.size;
      if (n == 0) Fail(DropReason::kWrongType);
      if (n == 16) {
        for (int i = 0; i < 8; ++i) h.hi = (h.hi << 8) | p[i];
        for (int i = 8; i < 16; ++i) h.lo = (h.lo << 8) | p[i];
      } else {
        XXH128_hash_t d = XXH3_128bits(p, n);
        h.hi = d.high64;
        h.lo = d.low64;
      }
      h.hi |= 1ull << 63;
      return h;
    }
    default: Fail(DropReason::kWrongType);
  }
}

void Hashes(const object& o, const DecodeLimits& lim, std::vector<EngineHash>* out) {
  if (o.type != mt::ARRAY) Fail(DropReason::kWrongType);
  if (o.via.array.size > lim.max_blocks_per_event) Fail(DropReason::kOversized);
  out->clear();  // a repeated map key replaces, as for every other field
  out->reserve(o.via.array.size);
  for (uint32_t i = 0; i < o.via.array.size; ++i) out->push_back(Hash(o.via.array.ptr[i]));
}

void Tokens(const object& o, std::vector<uint32_t>* out) {
  if (o.type != mt::ARRAY) Fail(DropReason::kWrongType);
  const uint32_t n = o.via.array.size;
  out->resize(n);
  const object* p = o.via.array.ptr;
  for (uint32_t i = 0; i < n; ++i) {
    if (p[i].type == mt::POSITIVE_INTEGER) {
      if (p[i].via.u64 > 0xFFFFFFFFull) Fail(DropReason::kTokenOutOfRange);
      (*out)[i] = static_cast<uint32_t>(p[i].via.u64);
    } else if (p[i].type == mt::NEGATIVE_INTEGER) {
      Fail(DropReason::kTokenOutOfRange);
    } else {
      Fail(DropReason::kWrongType);
    }
  }
}

std::string Pack(const object& o) {
  msgpack::sbuffer buf;
  msgpack::pack(buf, o);
  return std::string(buf.data(), buf.size());
}

void ExtraKeys(const object& o, Event* ev) {
  if (IsNil(o)) return;
  if (o.type != mt::ARRAY) Fail(DropReason::kWrongType);
  ev->extra_keys.resize(o.via.array.size);
  for (uint32_t i = 0; i < o.via.array.size; ++i) {
    const object& e = o.via.array.ptr[i];
    if (!IsNil(e)) ev->extra_keys[i] = Pack(e);
  }
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

void Medium_(const object& o, Event* ev, bool* unknown_medium) {
  if (IsNil(o)) return;
  std::string_view s = Str(o);
  ev->has_medium = true;
  ev->medium.assign(s.data(), s.size());
  bool known = true;
  ev->tier = ParseMedium(s, &known);
  if (!known) {
    *unknown_medium = true;
    ev->medium_known = false;
  }
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

void SetStoredField(int f, const object& v, const DecodeLimits& lim, Event* ev,
                    bool* unknown_medium) {
  switch (f) {
    case kBlockHashes: Hashes(v, lim, &ev->block_hashes); break;
    case kParent:
      if (!IsNil(v)) {
        ev->has_parent = true;
        ev->parent_block_hash = Hash(v);
      }
      break;
    case kTokenIds: Tokens(v, &ev->token_ids); break;
    case kBlockSize: ev->block_size = Int(v); break;
    case kLoraId:
      if (!IsNil(v)) {
        ev->has_lora_id = true;
        ev->lora_id = Int(v);
      }
      break;
    case kMediumF: Medium_(v, ev, unknown_medium); break;
    case kLoraName:
      if (v.type == mt::MAP) {
        SglangMetadata(v, ev);
      } else if (!IsNil(v)) {
        std::string_view s = Str(v);
        ev->lora_name.assign(s.data(), s.size());
      }
      break;
    case kExtraKeys: ExtraKeys(v, ev); break;
    case kGroupIdx:
      if (!IsNil(v)) ev->group_idx = Int(v);
      break;
    case kSpecKind:
      if (!IsNil(v)) {
        std::string_view s = Str(v);
        ev->kv_cache_spec_kind.assign(s.data(), s.size());
      }
      break;
    case kSlidingWindow:
      if (!IsNil(v)) {
        ev->has_sliding_window = true;
        ev->sliding_window = Int(v);
      }
      break;
    case kLocality:
      if (!IsNil(v)) {
        std::string_view s = Str(v);
        ev->locality.assign(s.data(), s.size());
      }
      break;
    case kCacheSalt:
      if (!IsNil(v)) ev->cache_salt = PackSalt(v);
      break;
    case kMetadata:
      if (v.type == mt::MAP) SglangMetadata(v, ev);
      break;
    default: break;  // unknown fields and trailing positions are skipped
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

// Returns false (and counts) when the event is dropped.
bool DecodeEvent(const object& o, const DecodeLimits& lim, Event* ev, DropCounts* drops) {
  try {
    bool unknown_medium = false;
    if (o.type == mt::ARRAY) {
      if (o.via.array.size == 0) Fail(DropReason::kWrongType);
      if (!TagType(Str(o.via.array.ptr[0]), &ev->type)) Fail(DropReason::kUnknownTag);
      for (uint32_t i = 1; i < o.via.array.size; ++i) {
        int f = kUnknownField;
        if (ev->type == EventType::kBlockStored) {
          f = i <= kSlidingWindow ? static_cast<int>(i) : kUnknownField;
        } else if (ev->type == EventType::kBlockRemoved) {
          f = RemovedArrayField(static_cast<int>(i));
        }
        SetStoredField(f, o.via.array.ptr[i], lim, ev, &unknown_medium);
      }
    } else if (o.type == mt::MAP) {
      const object* tag = nullptr;
      for (uint32_t i = 0; i < o.via.map.size; ++i) {
        const object& k = o.via.map.ptr[i].key;
        if (k.type == mt::STR && std::string_view(k.via.str.ptr, k.via.str.size) == "type") {
          tag = &o.via.map.ptr[i].val;
        }
      }
      if (tag == nullptr) Fail(DropReason::kWrongType);
      if (!TagType(Str(*tag), &ev->type)) Fail(DropReason::kUnknownTag);
      if (ev->type != EventType::kAllBlocksCleared) {
        for (uint32_t i = 0; i < o.via.map.size; ++i) {
          const object& k = o.via.map.ptr[i].key;
          if (k.type != mt::STR) continue;  // unknown, non-string keys are skipped
          int f = FieldByName(std::string_view(k.via.str.ptr, k.via.str.size));
          if (ev->type == EventType::kBlockRemoved && f != kBlockHashes && f != kMediumF &&
              f != kGroupIdx && f != kLocality) {
            f = kUnknownField;
          }
          SetStoredField(f, o.via.map.ptr[i].val, lim, ev, &unknown_medium);
        }
      }
    } else {
      Fail(DropReason::kWrongType);
    }
    // The salt keys the first block of a request only: a run from token 0 carries it; a run
    // with a parent inherits it through the parent's key.
    if (!ev->cache_salt.empty() && !ev->has_parent && !ev->block_hashes.empty()) {
      if (ev->extra_keys.empty()) ev->extra_keys.resize(1);
      if (ev->extra_keys[0].empty()) ev->extra_keys[0] = ev->cache_salt;
    }
    return true;
  } catch (const Bad& b) {
    drops->Add(b.reason);
  } catch (const std::bad_alloc&) {
    drops->Add(DropReason::kOversized);
  } catch (...) {
    drops->Add(DropReason::kWrongType);
  }
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

}  // namespace

bool DecodeBatch(const char* payload, size_t len, const DecodeLimits& lim, EventBatch* out,
                 DropCounts* drops) noexcept {
  out->Clear();
  if (len > lim.max_payload_bytes) {
    drops->Add(DropReason::kOversized);
    return false;
  }
  try {
    std::size_t off = 0;
    // msgpack-c reserves count x sizeof(object) as soon as it reads an array/map header:
    // a count can never honestly exceed the payload's length, so cap it there.
    const size_t containers = std::min(lim.max_container, len);
    msgpack::unpack_limit ul(containers, containers, lim.max_string, lim.max_string,
                             lim.max_string, lim.max_depth);
    msgpack::object_handle oh = msgpack::unpack(payload, len, off, ZeroCopy, nullptr, ul);
    if (off != len) Fail(DropReason::kTrailingBytes);
    const object& b = oh.get();
    const object* events = nullptr;
    const object* rank = nullptr;
    if (b.type == mt::ARRAY) {
      if (b.via.array.size < 2) Fail(DropReason::kWrongType);
      out->ts = Float(b.via.array.ptr[0]);
      events = &b.via.array.ptr[1];
      if (b.via.array.size >= 3) rank = &b.via.array.ptr[2];
    } else if (b.type == mt::MAP) {
      const object* ts = MapGet(b, "ts");
      events = MapGet(b, "events");
      rank = MapGet(b, "data_parallel_rank");
      if (ts == nullptr || events == nullptr) Fail(DropReason::kWrongType);
      out->ts = Float(*ts);
    } else {
      Fail(DropReason::kWrongType);
    }
    if (rank != nullptr && !IsNil(*rank)) {
      out->has_dp_rank = true;
      out->dp_rank = Int(*rank);
    }
    if (events->type != mt::ARRAY) Fail(DropReason::kWrongType);
    out->events.reserve(events->via.array.size);
    for (uint32_t i = 0; i < events->via.array.size; ++i) {
      out->events.emplace_back();
      if (!DecodeEvent(events->via.array.ptr[i], lim, &out->events.back(), drops)) {
        out->events.pop_back();
      }
    }
    return true;
  } catch (const Bad& b) {
    drops->Add(b.reason);
  } catch (const msgpack::insufficient_bytes&) {
    drops->Add(DropReason::kTruncated);
  } catch (const msgpack::size_overflow& e) {
    // Past our cap at the payload length, an array/map header promises more elements than
    // there are bytes left: the payload is cut short (or lying about it).
    const bool count = dynamic_cast<const msgpack::array_size_overflow*>(&e) != nullptr ||
                       dynamic_cast<const msgpack::map_size_overflow*>(&e) != nullptr;
    drops->Add(count && len < lim.max_container ? DropReason::kTruncated
                                                 : DropReason::kOversized);
  } catch (const std::bad_alloc&) {
    drops->Add(DropReason::kOversized);
  } catch (...) {
    drops->Add(DropReason::kParseError);
  }
  out->Clear();
  return false;
}

}  // namespace kvroute
