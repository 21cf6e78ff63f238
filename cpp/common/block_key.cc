#include "common/block_key.h"

// Inlined: the block hash of a fixed-size block compiles to straight-line code.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <string>

namespace kvroute {

uint64_t ChainRoot(std::string_view lora_name) {
  if (lora_name.empty()) return kRootSeed;
  return XXH3_64bits_withSeed(lora_name.data(), lora_name.size(), kRootSeed);
}

bool StripLeadingExtraKey(std::string_view extra, std::string_view name, std::string* out) {
  const auto* p = reinterpret_cast<const uint8_t*>(extra.data());
  const size_t n = extra.size();
  auto be = [p](size_t at, int bytes) {
    uint32_t v = 0;
    for (int k = 0; k < bytes; ++k) v = (v << 8) | p[at + k];
    return v;
  };
  if (n == 0) return false;
  uint32_t count;
  size_t pos;
  if ((p[0] & 0xf0) == 0x90) {
    count = p[0] & 0x0f, pos = 1;
  } else if (p[0] == 0xdc && n >= 3) {
    count = be(1, 2), pos = 3;
  } else if (p[0] == 0xdd && n >= 5) {
    count = be(1, 4), pos = 5;
  } else {
    return false;
  }
  if (count == 0 || pos >= n) return false;
  size_t len, hdr;
  const uint8_t t = p[pos];
  if ((t & 0xe0) == 0xa0) {
    len = t & 0x1f, hdr = 1;
  } else if (t == 0xd9 && pos + 2 <= n) {
    len = p[pos + 1], hdr = 2;
  } else if (t == 0xda && pos + 3 <= n) {
    len = be(pos + 1, 2), hdr = 3;
  } else if (t == 0xdb && pos + 5 <= n) {
    len = be(pos + 1, 4), hdr = 5;
  } else {
    return false;
  }
  if (pos + hdr + len > n || extra.substr(pos + hdr, len) != name) return false;
  out->clear();
  const uint32_t left = count - 1;
  if (left == 0) return true;
  if (left < 16) {
    out->push_back(static_cast<char>(0x90 | left));
  } else if (left < 65536) {
    out->push_back(static_cast<char>(0xdc));
    out->push_back(static_cast<char>(left >> 8));
    out->push_back(static_cast<char>(left & 0xff));
  } else {
    out->push_back(static_cast<char>(0xdd));
    for (int k = 3; k >= 0; --k) out->push_back(static_cast<char>((left >> (8 * k)) & 0xff));
  }
  out->append(extra.substr(pos + hdr + len));
  return true;
}

namespace {
inline uint64_t BlockHash(const uint32_t* tokens, size_t n, std::string_view extra) {
  // Deliberately hashes the in-memory uint32 array: all supported targets are little-endian.
  if (extra.empty()) return XXH3_64bits(tokens, n * sizeof(uint32_t));
  return XXH3_64bits_withSeed(tokens, n * sizeof(uint32_t),
                              XXH3_64bits(extra.data(), extra.size()));
}
}  // namespace

BlockKey NextBlockKey(uint64_t parent, const uint32_t* tokens, size_t n, std::string_view extra) {
  return Fmix64(parent ^ BlockHash(tokens, n, extra));
}

namespace {
// Hashes blocks [begin, end) of `tokens` into dst[begin, end).
void HashBlocks(const uint32_t* tokens, size_t block_size, const std::vector<std::string>* extras,
                size_t begin, size_t end, uint64_t* dst) {
  // The block hashes are independent: the CPU overlaps them.
  if (extras == nullptr || extras->size() <= begin) {
    // The engines' usual block sizes get XXH3 with a constant length: the same hash, without
    // its length dispatch (callgrind: ~12 of ~64 instructions per 16-token block).
    switch (block_size) {
      case 16:
        for (size_t i = begin; i < end; ++i) dst[i] = XXH3_64bits(tokens + i * 16, 16 * sizeof(uint32_t));
        return;
      case 32:
        for (size_t i = begin; i < end; ++i) dst[i] = XXH3_64bits(tokens + i * 32, 32 * sizeof(uint32_t));
        return;
      default:
        break;
    }
    for (size_t i = begin; i < end; ++i) dst[i] = BlockHash(tokens + i * block_size, block_size, {});
  } else {
    for (size_t i = begin; i < end; ++i) {
      std::string_view extra;
      if (i < extras->size()) extra = (*extras)[i];
      dst[i] = BlockHash(tokens + i * block_size, block_size, extra);
    }
  }
}

constexpr size_t kTokenAhead = 16;

// Keys of blocks [begin, end) of `kBs` tokens after `parent`, hashed and chained in one loop:
// the chain's fmix64 (a serial dependency: by instruction latencies ~12 cycles a block, not
// measured) runs while the next blocks' independent XXH3s execute. A separate chaining loop
// after them costs ~2.1k more instructions per 8K-token select (callgrind). Returns the last
// key.
template <size_t kBs>
uint64_t HashAndChain(const uint32_t* tokens, size_t begin, size_t end, uint64_t parent,
                      uint64_t* out) {
  for (size_t i = begin; i < end; ++i) {
    // A prompt's tokens are often not in cache (a new request's buffer): load them
    // kTokenAhead blocks ahead, across the 4 KiB pages where the hardware's stream
    // prefetcher stops. (A prefetch past the buffer's end does not fault.)
    __builtin_prefetch(tokens + (i + kTokenAhead) * kBs);
    parent = Fmix64(parent ^ XXH3_64bits(tokens + i * kBs, kBs * sizeof(uint32_t)));
    out[i] = parent;
  }
  return parent;
}
}  // namespace

BlockKeyStream::BlockKeyStream(uint64_t root, const uint32_t* tokens, size_t num_tokens,
                               size_t block_size, const std::vector<std::string>* extras,
                               std::vector<BlockKey>* buf)
    : keys_(nullptr),
      n_(block_size == 0 ? 0 : num_tokens / block_size),
      ready_(0),
      tokens_(tokens),
      block_size_(block_size),
      extras_(extras),
      parent_(root) {
  buf->resize(n_);
  out_ = buf->data();
  keys_ = out_;
}

void BlockKeyStream::Extend(size_t upto) {
  const size_t end = std::min(n_, std::max(upto, ready_ + kStep));
  if (end <= ready_) return;
  const bool plain = extras_ == nullptr || extras_->size() <= ready_;
  if (plain && (block_size_ == 16 || block_size_ == 32)) {
    parent_ = block_size_ == 16 ? HashAndChain<16>(tokens_, ready_, end, parent_, out_)
                                : HashAndChain<32>(tokens_, ready_, end, parent_, out_);
    ready_ = end;
    return;
  }
  HashBlocks(tokens_, block_size_, extras_, ready_, end, out_);
  ChainBlockKeys(parent_, out_ + ready_, end - ready_);
  parent_ = out_[end - 1];
  ready_ = end;
}

void ComputeBlockHashes(const uint32_t* tokens, size_t num_tokens, size_t block_size,
                        const std::vector<std::string>* extras, std::vector<uint64_t>* out) {
  const size_t nblocks = block_size == 0 ? 0 : num_tokens / block_size;
  const size_t base = out->size();
  out->resize(base + nblocks);
  HashBlocks(tokens, block_size, extras, 0, nblocks, out->data() + base);
}

void ChainBlockKeys(uint64_t root, uint64_t* hashes, size_t n) {
  uint64_t parent = root;
  for (size_t i = 0; i < n; ++i) {
    parent = Fmix64(parent ^ hashes[i]);
    hashes[i] = parent;
  }
}

void ComputeBlockKeys(uint64_t root, const uint32_t* tokens, size_t num_tokens, size_t block_size,
                      const std::vector<std::string>* extras, std::vector<BlockKey>* out) {
  const size_t base = out->size();
  ComputeBlockHashes(tokens, num_tokens, block_size, extras, out);
  ChainBlockKeys(root, out->data() + base, out->size() - base);
}

}  // namespace kvroute
