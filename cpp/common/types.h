// kvroute vocabulary: block keys, engine block hashes, storage tiers, worker ids.
//
// Thread safety: everything here is a value type or a pure function; safe from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvroute {

// Our own chained 64-bit key of one full block (see block_key.h). Equal keys mean equal
// token prefix, LoRA adapter and extra keys, whatever the engine that stored the block.
using BlockKey = uint64_t;

// Dense id of a worker inside one Router/Index. Never reused while the Index lives.
using WorkerId = uint32_t;
constexpr WorkerId kNoWorker = 0xFFFFFFFFu;

// An engine's block hash, normalised to 128 bits without losing distinctness
// (docs/kv-events.md §5):
//  - msgpack ints (uint64, or negative int64 reinterpreted as its two's-complement uint64):
//    {hi = 0, lo = value}; exact.
//  - 16-byte bin: the 16 bytes themselves, big-endian, with the top bit of hi forced to 1
//    so that no bin aliases an int; exact up to that one bit.
//  - 32-byte bin (sha256 variants) or any other length: XXH3-128 of the bytes, top bit of hi
//    set; distinct with probability 1 - 2^-127 per pair.
// An engine hash is an opaque id of one block on one worker: kvroute never recomputes it.
struct EngineHash {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const EngineHash& o) const { return hi == o.hi && lo == o.lo; }
  bool operator!=(const EngineHash& o) const { return !(*this == o); }
  bool IsInt() const { return hi == 0; }
};

struct EngineHashHasher {
  size_t operator()(const EngineHash& h) const noexcept {
    // Engine hashes are already uniformly distributed digests; fold, then mix once.
    uint64_t x = h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return static_cast<size_t>(x);
  }
};

// Block keys are fmix64 outputs, already uniform: a cheap fold is a good enough hash.
struct BlockKeyHasher {
  size_t operator()(BlockKey k) const noexcept { return static_cast<size_t>(k ^ (k >> 29)); }
};

// Storage tier of a cached block ("medium" on the wire).
enum class Medium : uint8_t { kGpu = 0, kCpu = 1, kDisk = 2 };
constexpr int kNumMedia = 3;

// Maps the wire `medium` string to a tier (docs/kv-events.md §8). nil/absent -> GPU (the
// engine's own prefix cache; the caller's case). "GPU", "CUDA" -> GPU; anything containing
// "CPU" (vLLM offloading "CPU", SGLang "CPU_PINNED", "CPU_TIER1", "CPU_TIER2", LMCache
// "LocalCPUBackend") -> CPU; "STORAGE", "DISK", "SSD", "EXTERNAL" and anything else -> disk
// (lower-case gpu, cuda, cpu, disk, storage too). `known` is set false for strings not in
// this list (counted by the caller).
Medium ParseMedium(std::string_view s, bool* known);
const char* MediumName(Medium m);

}  // namespace kvroute
