// BlockSlab: one 16-byte record per distinct block key (the key and its HolderSet), at a
// stable 32-bit index. The block table and every worker's engine table refer to a block by
// this index, so its 8-byte key is stored once, not once per table.
//
// Records live in 256 KiB chunks (16,384 records: a small index stays small) that are never
// moved or returned before the slab dies; a freed record goes on a free list (linked through its
// key field) and is reused first. Records of one BlockStored event are allocated together, so
// while the free list is empty the blocks of a prompt's prefix sit side by side and a prefix
// match reads them in order (freed records are reused last in, first out, and scatter).
//
// Thread safety: none (the Index's lock guards it).
#pragma once

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
  static constexpr size_t kChunkShift = 14;  // 16,384 records = 256 KiB per chunk
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
        if (used_ >= 0xFFFFFFFFu - kChunk) throw std::length_error("block slab: 2^32 records");
        chunks_.push_back(HugePageAllocator<BlockRec>().allocate(kChunk));
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

  size_t bytes() const { return chunks_.size() * kChunk * sizeof(BlockRec); }

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
