// The fields of the engines' KV events, shared by the two decoders (decoder_reference.cc
// over msgpack-c objects, decoder.cc's fast path over bytes): which position of an array-era
// event and which key of a map-era one sets which Event field, and the event tags. Private to
// events/ (not part of the decoder's contract: decoder.h).
#pragma once

#include <string_view>

#include "common/event.h"

namespace kvroute::decoder_internal {

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

// BlockRemoved: block_hashes, medium, group_idx (+ locality in the map era).
inline int RemovedArrayField(int pos) {
  switch (pos) {
    case 1: return kBlockHashes;
    case 2: return kMediumF;
    case 3: return kGroupIdx;
    default: return kUnknownField;
  }
}

inline int FieldByName(std::string_view k) {
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

inline bool TagType(std::string_view tag, EventType* t) {
  if (tag == "BlockStored")
    *t = EventType::kBlockStored;
  else if (tag == "BlockRemoved")
    *t = EventType::kBlockRemoved;
  else if (tag == "AllBlocksCleared")
    *t = EventType::kAllBlocksCleared;
  else
    return false;
  return true;
}

}  // namespace kvroute::decoder_internal
