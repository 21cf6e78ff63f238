// Block keys: kvroute's own chained 64-bit key per full block of `block_size` tokens.
//
//   root          = XXH3_64(lora_name bytes, seed = kRootSeed)   if a LoRA name is given
//                 = kRootSeed                                     otherwise
//   h_i           = XXH3_64(tokens of block i as little-endian uint32)
//                 = XXH3_64(tokens, seed = XXH3_64(extra_i))     if block i has extra keys
//   key_i         = fmix64(key_{i-1} XOR h_i)                     (key_{-1} = root)
//
// fmix64 is MurmurHash3's 64-bit finalizer, a bijection: two prefixes that differ only in
// their parent never collide, and siblings collide only if their block hashes do. The block
// hashes do not depend on each other, so the CPU computes several at once; only the cheap
// fmix64 (~13 instructions a block) is chained, where an XXH3 seeded with the parent's key
// would make every block wait for the one before (README.md has the costs).
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

// vLLM publishes a LoRA request's adapter name twice: in BlockStored.lora_name and as the
// first of every block's extra keys (vllm/v1/core/kv_cache_utils.py, to_event_extra_keys:
// `(name,)`, `(name, cache_salt)` on a salted request's first block, `(name, [mm_hash,
// offset], ...)`). The chain root already carries the name (ChainRoot), so a block's key
// leaves that entry out, as the request side (select_worker(lora_name=...)) never has it.
// `extra` is one block's canonical msgpack array of extra keys. Returns true and sets *out to
// the array without its first element (empty string when none is left) iff `extra` is an
// array whose first element is the string `name`; false otherwise (*out untouched).
bool StripLeadingExtraKey(std::string_view extra, std::string_view name, std::string* out);

// MurmurHash3 fmix64 (Austin Appleby, public domain): a bijective 64-bit mixer.
inline uint64_t Fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// Key of one block given its parent's key. `tokens` has `n` entries (= block size).
// `extra` may be empty (no extra keys).
BlockKey NextBlockKey(uint64_t parent, const uint32_t* tokens, size_t n, std::string_view extra);

// The two halves of ComputeBlockKeys, for callers that hash outside a lock:
// the independent per-block hashes h_i (appended to `out`), then the chain over them in place
// (key_i = fmix64(key_{i-1} XOR h_i), key_{-1} = root).
void ComputeBlockHashes(const uint32_t* tokens, size_t num_tokens, size_t block_size,
                        const std::vector<std::string>* extras, std::vector<uint64_t>* out);
void ChainBlockKeys(uint64_t root, uint64_t* hashes, size_t n);

// Keys of the full blocks of a prompt, computed as a reader asks for them: the prefix walk
// (Index::FindMatches) hashes a block only when its look-ahead reaches it, so the hashing of
// the next blocks runs while the table loads of the current ones are in flight, and the blocks
// past the end of the match are hashed only if a caller asks for them (speculative credit).
// Can also wrap keys computed beforehand (all ready).
//
// Thread safety: none (one per call, on the caller's stack).
class BlockKeyStream {
 public:
  // Keys already computed: `n` of them at `keys`.
  BlockKeyStream(const BlockKey* keys, size_t n) : keys_(keys), n_(n), ready_(n) {}
  // Keys of the full blocks of `tokens` (trailing partial block ignored), written into `buf`
  // (resized to the block count; its entries past ready() are not keys yet). `tokens`,
  // `extras` and `buf` must outlive the stream.
  BlockKeyStream(uint64_t root, const uint32_t* tokens, size_t num_tokens, size_t block_size,
                 const std::vector<std::string>* extras, std::vector<BlockKey>* buf);

  size_t size() const { return n_; }
  const BlockKey* data() const { return keys_; }
  size_t ready() const { return ready_; }
  // Makes keys [0, min(upto, size())) ready.
  void Need(size_t upto) {
    if (upto > ready_ && ready_ < n_) Extend(upto);
  }

 private:
  // Blocks hashed per step at least: the call and the chain's setup are paid once per step.
  static constexpr size_t kStep = 8;
  void Extend(size_t upto);

  const BlockKey* keys_;
  size_t n_;
  size_t ready_;
  BlockKey* out_ = nullptr;
  const uint32_t* tokens_ = nullptr;
  size_t block_size_ = 0;
  const std::vector<std::string>* extras_ = nullptr;
  uint64_t parent_ = 0;
};

// Keys of every full block of `tokens` (trailing partial block ignored), appended to `out`.
// `extras`, when non-null, holds one entry per block (empty = none); missing entries = none.
void ComputeBlockKeys(uint64_t root, const uint32_t* tokens, size_t num_tokens, size_t block_size,
                      const std::vector<std::string>* extras, std::vector<BlockKey>* out);

}  // namespace kvroute
