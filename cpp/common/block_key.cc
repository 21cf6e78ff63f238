#include "common/block_key.h"

#include <xxhash.h>

#include <string>

namespace kvroute {

uint64_t ChainRoot(std::string_view lora_name) {
  if (lora_name.empty()) return kRootSeed;
  return XXH3_64bits_withSeed(lora_name.data(), lora_name.size(), kRootSeed);
}

BlockKey NextBlockKey(uint64_t parent, const uint32_t* tokens, size_t n, std::string_view extra) {
  uint64_t seed = parent;
  if (!extra.empty()) seed = XXH3_64bits_withSeed(extra.data(), extra.size(), parent);
  // Deliberately hashes the in-memory uint32 array: all supported targets are little-endian.
  return XXH3_64bits_withSeed(tokens, n * sizeof(uint32_t), seed);
}

void ComputeBlockKeys(uint64_t root, const uint32_t* tokens, size_t num_tokens, size_t block_size,
                      const std::vector<std::string>* extras, std::vector<BlockKey>* out) {
  const size_t nblocks = block_size == 0 ? 0 : num_tokens / block_size;
  out->reserve(out->size() + nblocks);
  uint64_t parent = root;
  for (size_t i = 0; i < nblocks; ++i) {
    std::string_view extra;
    if (extras != nullptr && i < extras->size()) extra = (*extras)[i];
    parent = NextBlockKey(parent, tokens + i * block_size, block_size, extra);
    out->push_back(parent);
  }
}

}  // namespace kvroute
