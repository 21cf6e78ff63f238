// DecodeBatch (decoder.h): the fast path, a pull reader over the payload bytes
// (decoder_reader.h) that decodes the common, well-formed batch straight into an EventBatch,
// and the fall back to the reference decoder (decoder_reference.cc) for everything else.
#include "events/decoder.h"

#include <xxhash.h>

#include <string>
#include <string_view>

#include "events/decoder_fields.h"
#include "events/decoder_reader.h"

namespace kvroute {

using namespace decoder_internal;

namespace {

// ---- Fast path -------------------------------------------------------------------------
// A pull reader over the payload bytes that decodes the common, well-formed batch straight
// into an EventBatch, without building a msgpack object per token id. It accepts only what it
// can decode exactly as the reference decoder does; on anything else (an error of any kind,
// an unknown tag, extension types, extra keys or a salt, nesting deeper than kMaxDepth) it
// gives up and the reference decoder (msgpack-c objects, decoder_reference.cc) decodes and
// counts. The fuzz target checks that both agree on every input the fast path accepts.

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
      return FastTokenIds(r, ev->token_ids.data(), n);
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

}  // namespace kvroute
