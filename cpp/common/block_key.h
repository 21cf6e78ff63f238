// Block keys: kvroute's own chained 64-bit key per full block of `block_size` tokens.
//
//   root          = XXH3_64(lora_name bytes, seed = kRootSeed)   if a LoRA name is given
//                 = kRootSeed                                     otherwise
//   seed_i        = key_{i-1}                     (key_{-1} = root)
//                 = XXH3_64(extra_i, seed = key_{i-1})   if block i has extra keys
//   key_i         = XXH3_64(tokens of block i as little-endian uint32, seed = seed_i)
//
// The same function runs on the request path (prompt token ids) and on the event path (the
// `token_ids` carried by BlockStored); that is the correctness invariant of the index.
// `extra_i` is the canonical msgpack encoding of block i's extra keys (cache_salt,
// multimodal identifiers, ...): msgspec and msgpack-c both emit the smallest encoding.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "common/types.h"

namespace kvroute {

constexpr uint64_t kRootSeed = 0x6B76726F75746521ull;  // "kvroute!"

// Root of the chain for an adapter; empty name = base model.
uint64_t ChainRoot(std::string_view lora_name);

// Key of one block given its parent's key. `tokens` has `n` entries (= block size).
// `extra` may be empty (no extra keys).
BlockKey NextBlockKey(uint64_t parent, const uint32_t* tokens, size_t n, std::string_view extra);

// Keys of every full block of `tokens` (trailing partial block ignored), appended to `out`.
// `extras`, when non-null, holds one entry per block (empty = none); missing entries = none.
void ComputeBlockKeys(uint64_t root, const uint32_t* tokens, size_t num_tokens, size_t block_size,
                      const std::vector<std::string>* extras, std::vector<BlockKey>* out);

}  // namespace kvroute
