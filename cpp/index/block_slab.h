// BlockSlab: one 16-byte record per distinct block key (the key and its HolderSet), at a
// stable 28-bit index. The block table and every worker's engine table refer to a block by
// this index, so its 8-byte key is stored once, not once per table.
//
// Records live in 2 MiB chunks (131,072 records) that are never moved or returned before the
// slab dies: the first in ordinary pages (a small index stays small: only the pages touched
// count), the others in huge pages (a prefix match reads records at random once chains
// interleave; one TLB entry per 2 MiB instead of per 4 KiB). A freed record goes on a free
// list (linked through its key field) and is reused first. Records of one BlockStored event
// are allocated together, so while the free list is empty the blocks of a prompt's prefix
// sit side by side and a prefix match reads them in order (freed records are reused last in,
// first out, and scatter).
//
// Thread safety: none (the Index's lock guards it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/types.h"
#include "index/holder_set.h"
#include "index/huge_page_allocator.h"

namespace kvroute {

struct BlockRec {
  BlockKey key;        // on the free list: the index of the next free record
  HolderSet holders;   // empty on the free list
};
static_assert(sizeof(BlockRec) == 16, "a block record should stay 16 bytes");

class BlockSlab {
 public:
  // No record: record 0 is never handed out, so a zeroed slot of the tables that refer to
  // records is an empty one (fresh mmap'd tables need no initialising pass).
  static constexpr uint32_t kNone = 0;
  // Record indexes fit in 28 bits (268M distinct blocks, 4 GiB of records), so an engine
  // slot packs one with its tier bits in a word (index.h). Alloc throws past that.
  static constexpr uint32_t kIndexBits = 28;
  static constexpr size_t kChunkShift = 17;  // 131,072 records = 2 MiB per chunk
  static constexpr size_t kChunk = size_t{1} << kChunkShift;

  BlockSlab() = default;
  BlockSlab(const BlockSlab&) = delete;
  BlockSlab& operator=(const BlockSlab&) = delete;
  ~BlockSlab() {
    HugePageAllocator<BlockRec> alloc;
    for (BlockRec* c : chunks_) alloc.deallocate(c, kChunk);
  }

  BlockRec& operator[](uint32_t i) { return chunks_[i >> kChunkShift][i & (kChunk - 1)]; }
  const BlockRec& operator[](uint32_t i) const {
    return chunks_[i >> kChunkShift][i & (kChunk - 1)];
  }
  void Prefetch(uint32_t i) const { __builtin_prefetch(&(*this)[i]); }

  // A record for `key` with no holders.
  uint32_t Alloc(BlockKey key) {
    uint32_t i = free_;
    if (i != kNone) {
      free_ = static_cast<uint32_t>((*this)[i].key);
    } else {
      if (used_ >= chunks_.size() * kChunk) {
        if (used_ >= (size_t{1} << kIndexBits)) throw std::length_error("block slab: 2^28 records");
        chunks_.push_back(HugePageAllocator<BlockRec>().allocate(kChunk, !chunks_.empty()));
      }
      i = static_cast<uint32_t>(used_++);
    }
    (*this)[i] = BlockRec{key, HolderSet()};
    return i;
  }
  // Returns a record whose HolderSet is empty to the free list.
  void Free(uint32_t i) {
    (*this)[i].key = free_;
    free_ = i;
  }

  // Resident bytes, about: the first chunk as far as it is used, the others whole.
  size_t bytes() const {
    if (chunks_.empty()) return 0;
    const size_t first = std::min(used_, kChunk) * sizeof(BlockRec);
    return (first + 4095) / 4096 * 4096 + (chunks_.size() - 1) * kChunk * sizeof(BlockRec);
  }

  // Calls f(record) for every live record (O(records ever allocated)).
  template <typename F>
  void ForEachLive(F&& f) {
    for (size_t i = 1; i < used_; ++i) {
      BlockRec& r = (*this)[static_cast<uint32_t>(i)];
      if (!r.holders.empty()) f(r);
    }
  }

 private:
  std::vector<BlockRec*> chunks_;
  size_t used_ = 1;   // records handed out at least once (the free list reuses them); 0 = kNone
  uint32_t free_ = kNone;
};

}  // namespace kvroute
