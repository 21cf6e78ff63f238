// Index (index.h), the request path: FindMatches' prefix walk (Index::PrefixWalk) and the
// speculative credits it counts (AddSpeculative, ReleaseSpeculative, their expiry and cap).
#include "index/index.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>
#include <vector>

#include "index/inline_vec.h"

namespace kvroute {

void Index::FindMatches(const BlockKey* keys, size_t n, MatchResult* out, double now) const {
  BlockKeyStream stream(keys, n);
  FindMatches(&stream, out, now);
}

// The prefix walk of one FindMatches call: every worker's depth (contiguous matched blocks
// from the first) as the prompt's blocks go by, under the caller's shared locks.
//
// Run-length: consecutive blocks held by the same (worker, best tier) set (equal HolderSet run
// keys) form a run; the holders are touched once per run, when it ends (Flush), not once per
// block. A holder advances through a run iff it had matched every block before the run
// (depth == run start).
//
// Speculative credits move a worker's depth ahead, to the block where the credit ends. Inside
// a run only the run's members are at depth i, and they hold block i (real entries win over
// any credit starting there), so the run goes on without a credit lookup; the blocks where
// credits end are the exceptions (the credited worker may join or start a run there, or take
// a credit starting there), so the walk takes the general path at each. The ends are kept in
// ends_ (next_end_: the nearest past the block being walked); past kMaxEnds of them in one
// walk, runs are closed at every block up to the deepest credit (spec_horizon_).
//
// Look-ahead, in four stages, so that several blocks' misses are in flight while the walk
// inspects the current one: kSlotAhead blocks ahead, prefetch the block-table slot; kRecAhead
// ahead, probe it (by the 32-bit tag) and prefetch the record it names; kHeapAhead ahead,
// prefetch the shared holder array the record points to, if any (blocks of one run share it:
// a miss per run, not per block); at the block, check the record's whole key and walk.
//
// Record chains: the records of one BlockStored event are allocated in order (block_slab.h),
// so past two blocks whose records are adjacent, the next block's record is most likely the
// next one: its whole key is compared and the table probe skipped. Exact: a live record
// (holders not empty) is the only record of its key, and a free or unused one has no holders
// (the walk checks the key again at the block). While a chain holds, the table slots of the
// blocks ahead are not prefetched; when it breaks, those between the probe and the slot
// look-ahead are, at once.
class Index::PrefixWalk {
 public:
  PrefixWalk(const Index& ix, BlockKeyStream* stream, MatchResult* out, double now)
      : ix_(ix),
        stream_(stream),
        out_(out),
        n_(stream->size()),
        keys_(stream->data()),
        now_(now),
        table_(*ix.blocks_),
        slab_(*ix.slab_),
        any_spec_(!ix.spec_first_->empty()) {
    out->Reset(ix.workers_.size());
    depth_ = out->blocks.data();
    weighted_ = out->weighted.data();
    // Credit of a block by its holder's tier mask: GPU if held there, else the better of CPU
    // and disk.
    w_gpu_ = ix.opts_.tier_weights[0];
    for (int m = 0; m < 8; ++m) {
      tier_w_[m] = (m & 1) ? w_gpu_
                           : std::max((m & 2) ? ix.opts_.tier_weights[1] : 0.0,
                                      (m & 4) ? ix.opts_.tier_weights[2] : 0.0);
    }
  }

  void Run() {
    StartStages(0);
    size_t i = 0;
    for (; i < n_; ++i) {
      i = FollowChainedRun(i);
      AdvanceStages(i);
      const HolderSet* hs = HoldersOf(i);
      // Same holders as the previous block: the run goes on. A credit starting here could
      // not change the match: no credit ends here, so only the run's members are at depth i,
      // and they hold block i for real (real entries win).
      if (Quiet(i) && hs != nullptr && run_ != nullptr && hs->RunKey() == run_key_) continue;
      const InlineVec<CreditRef>* credits = CreditsStartingAt(i);
      Flush(i);  // depths are now exact up to block i
      if (hs != nullptr && hs->Any([&](WorkerId w) { return depth_[w] == i; })) {
        StartRun(hs, i);
        if (credits != nullptr) Flush(i + 1);  // exact depths at i + 1 before the credits
      }
      if (credits != nullptr) Credit(*credits, i);
      if (i >= next_end_) next_end_ = EndAfter(i);
      if (run_ == nullptr && !JumpToNextDepth(&i)) break;
    }
    Flush(i);
    out_->max_blocks = static_cast<uint32_t>(max_depth_);
  }

 private:
  static constexpr size_t kMaxEnds = 16;
  static constexpr size_t kSlotAhead = 32, kRecAhead = 16, kHeapAhead = 6, kRing = 32;
  static_assert(kHeapAhead < kRecAhead && kRecAhead < kSlotAhead && kRecAhead < kRing &&
                    (kRing & (kRing - 1)) == 0,
                "ring of candidates");

  // Whether block i is one no credit ends at (a run may go on through it).
  bool Quiet(size_t i) const { return ends_overflow_ ? i > spec_horizon_ : i < next_end_; }

  // The nearest credit end past block i (SIZE_MAX: none).
  size_t EndAfter(size_t i) const {
    size_t e = SIZE_MAX;
    for (size_t k = 0; k < num_ends_; ++k) {
      if (ends_[k] > i && ends_[k] < e) e = ends_[k];
    }
    return e;
  }

  // Keys hashed in the stream up to `upto` (it hashes while the loads are in flight).
  void Need(size_t upto) {
    if (upto > ready_ && ready_ < n_) {
      stream_->Need(upto);
      ready_ = stream_->ready();
    }
  }

  // The holders of the open run advance to end_block; the run closes.
  void Flush(size_t end_block) {
    if (run_ == nullptr) return;
    const double len = static_cast<double>(end_block - run_start_);
    run_->ForEach([&](WorkerId w, uint8_t mask) {
      if (depth_[w] != run_start_) return;
      depth_[w] = static_cast<uint32_t>(end_block);
      weighted_[w] += tier_w_[mask] * len;
      if (end_block > max_depth_) max_depth_ = end_block;
    });
    run_ = nullptr;
  }

  void StartRun(const HolderSet* hs, size_t i) {
    run_ = hs;
    run_key_ = hs->RunKey();
    run_start_ = i;
  }

  // The record after `rec` (slab index `idx`) if it is the record of `key`: in the same
  // chunk, live, with that key; then its lines two on are prefetched. Null otherwise.
  static const BlockRec* ChainNext(const BlockRec* rec, uint32_t idx, BlockKey key) {
    const BlockRec* r = rec + 1;
    if (((idx + 1) & (BlockSlab::kChunk - 1)) == 0 || r->key != key || r->holders.empty()) {
      return nullptr;
    }
    __builtin_prefetch(r + 8);
    return r;
  }

  // The probe stage for block j: the chain's next record, or a table probe by tag.
  void Probe(size_t j) {
    if (chained_) {
      if (const BlockRec* r = ChainNext(last_rec_, last_idx_, keys_[j])) {
        cand_[j & (kRing - 1)] = r;
        last_rec_ = r;
        ++last_idx_;
        return;
      }
      const size_t end = std::min(n_, j + (kSlotAhead - kRecAhead) + 1);  // (keys ready: Need)
      for (size_t k = j + 1; k < end; ++k) table_.Prefetch(TagHash(keys_[k]));
    }
    const uint32_t tag = Tag(keys_[j]);
    const BlockSlot* s =
        table_.Find(TagHash(keys_[j]), [tag](const BlockSlot& x) { return x.tag == tag; });
    const BlockRec* r = s == nullptr ? nullptr : &slab_[s->block];
    if (r != nullptr) __builtin_prefetch(r);
    cand_[j & (kRing - 1)] = r;
    chained_ = r != nullptr && last_rec_ != nullptr && last_idx_ + 1 == s->block;
    last_rec_ = r;
    last_idx_ = r == nullptr ? kNone : s->block;
  }

  void PrefetchHolders(size_t j) const {
    const BlockRec* r = cand_[j & (kRing - 1)];
    if (r != nullptr) r->holders.PrefetchHolders();
  }

  // Fills the look-ahead stages for a walk that (re)starts at block `from`.
  void StartStages(size_t from) {
    chained_ = false;
    last_rec_ = nullptr;
    last_idx_ = kNone;
    Need(from + kSlotAhead + 1);
    for (size_t k = from; k < std::min(from + kSlotAhead, n_); ++k) {
      table_.Prefetch(TagHash(keys_[k]));
    }
    for (size_t k = from; k < std::min(from + kRecAhead, n_); ++k) Probe(k);
    for (size_t k = from; k < std::min(from + kHeapAhead, n_); ++k) PrefetchHolders(k);
  }

  // Moves every look-ahead stage on by one block, for block i.
  void AdvanceStages(size_t i) {
    Need(i + kSlotAhead + 1);
    if (i + kSlotAhead < n_ && !chained_) table_.Prefetch(TagHash(keys_[i + kSlotAhead]));
    if (i + kRecAhead < n_) Probe(i + kRecAhead);
    if (i + kHeapAhead < n_) PrefetchHolders(i + kHeapAhead);
  }

  // The common case, in a loop of its own with its state in registers: a run is open past
  // every credit, the probe stage follows a chain of records and the block kRecAhead on is the
  // chain's next record, and block i's record has the run's key. Then only the probe stage
  // moves on (the same steps as Probe's chain branch) and the holder look-ahead; everything
  // else is what the general path would find. Returns the first block where any of that
  // fails (i itself if none applies), which the general path then takes.
  size_t FollowChainedRun(size_t i) {
    if (run_ == nullptr || !chained_ || !Quiet(i) || i + kSlotAhead >= ready_) return i;
    // Keys ready up to the slot look-ahead, and not past the nearest credit end.
    const size_t stop = std::min(ready_ - kSlotAhead, ends_overflow_ ? SIZE_MAX : next_end_);
    // Locals, not members: the stores into cand would otherwise reload every member.
    const BlockKey* const keys = keys_;
    const BlockRec** const cand = cand_;
    const uint64_t rk = run_key_;
    const BlockRec* lr = last_rec_;
    uint32_t li = last_idx_;
    size_t k = i;
    for (; k < stop; ++k) {
      const BlockRec* rec = cand[k & (kRing - 1)];
      if (rec == nullptr || rec->key != keys[k] || rec->holders.RunKey() != rk) break;
      const BlockRec* r = ChainNext(lr, li, keys[k + kRecAhead]);
      if (r == nullptr) break;
      cand[(k + kRecAhead) & (kRing - 1)] = r;
      lr = r;
      ++li;
      if (const BlockRec* h = cand[(k + kHeapAhead) & (kRing - 1)]) h->holders.PrefetchHolders();
    }
    last_rec_ = lr;
    last_idx_ = li;
    return k;  // < stop < n: the general path takes block k
  }

  // Block i's holders (null: no worker holds it), checking the whole key.
  const HolderSet* HoldersOf(size_t i) const {
    const BlockRec* rec = cand_[i & (kRing - 1)];
    if (rec != nullptr && rec->key != keys_[i]) {  // tags collided
      const uint32_t b = ix_.FindBlock(keys_[i]);
      rec = b == kNone ? nullptr : &slab_[b];
    }
    return rec == nullptr ? nullptr : &rec->holders;
  }

  const InlineVec<CreditRef>* CreditsStartingAt(size_t i) const {
    if (!any_spec_) return nullptr;
    auto it = ix_.spec_first_->find(keys_[i]);
    return it == ix_.spec_first_->end() ? nullptr : &it->second;
  }

  // Speculative blocks are about to be computed on the GPU: credited like GPU blocks, for as
  // long as the prompt's keys follow the credit's (not for workers that hold block i). A
  // worker with several credits starting at block i (equal first keys) gets the longest. Out
  // of line: the walk's loop stays as tight as without credits.
  __attribute__((noinline)) void Credit(const InlineVec<CreditRef>& runs, size_t i) {
    std::vector<std::pair<WorkerId, size_t>> credited;  // worker, blocks credited from i
    for (const CreditRef& r : runs) {
      if (r.run->expiry <= now_) continue;
      size_t prev = 0;
      for (const auto& c : credited) {
        if (c.first == r.worker) prev = c.second;
      }
      uint32_t& d = depth_[r.worker];
      if (d != i + prev) continue;
      const std::vector<BlockKey>& rk = r.run->keys;
      Need(i + rk.size());
      size_t m = 0;
      while (m < rk.size() && i + m < n_ && rk[m] == keys_[i + m]) ++m;
      if (m <= prev) continue;
      d += static_cast<uint32_t>(m - prev);
      weighted_[r.worker] += w_gpu_ * static_cast<double>(m - prev);
      max_depth_ = std::max(max_depth_, i + m);
      spec_horizon_ = std::max(spec_horizon_, i + m);
      if (num_ends_ < kMaxEnds) {
        ends_[num_ends_++] = static_cast<uint32_t>(i + m);
      } else {
        ends_overflow_ = true;
      }
      next_end_ = std::min(next_end_, i + m);
      if (prev == 0) {
        credited.emplace_back(r.worker, m);
      } else {
        for (auto& c : credited) {
          if (c.first == r.worker) c.second = m;
        }
      }
    }
  }

  // No run open after block *i. If no worker holds block *i, the match ends (false).
  // Otherwise only credits reach past it (a flush sets depths up to *i + 1 at most), and
  // nothing happens at a block no worker is at, so the walk goes on at the nearest depth
  // past *i, not through the credited blocks: *i becomes the block before it (or n).
  bool JumpToNextDepth(size_t* i) {
    if (max_depth_ <= *i) return false;
    size_t next = max_depth_;
    for (size_t w = 0; w < out_->blocks.size(); ++w) {
      if (depth_[w] > *i && depth_[w] < next) next = depth_[w];
    }
    if (next >= n_) {
      *i = n_;  // credited to the prompt's end
      return false;
    }
    if (next > *i + 1) {
      StartStages(next);
      *i = next - 1;
      next_end_ = EndAfter(*i);
    }
    return true;
  }

  const Index& ix_;
  BlockKeyStream* const stream_;
  MatchResult* const out_;
  const size_t n_;
  const BlockKey* const keys_;
  const double now_;
  const BlockTable& table_;
  const BlockSlab& slab_;
  const bool any_spec_;
  uint32_t* depth_ = nullptr;
  double* weighted_ = nullptr;
  double w_gpu_ = 1.0;
  double tier_w_[8];
  size_t max_depth_ = 0;  // deepest any worker has reached so far
  size_t ready_ = 0;      // keys ready in the stream
  // The open run: its holders (null = none), its first block's run key, its first block.
  const HolderSet* run_ = nullptr;
  uint64_t run_key_ = 0;
  size_t run_start_ = 0;
  // Where credits end (see the class comment).
  uint32_t ends_[kMaxEnds];
  size_t num_ends_ = 0;
  bool ends_overflow_ = false;
  size_t next_end_ = SIZE_MAX;
  size_t spec_horizon_ = 0;
  // The look-ahead: the record block j's tag names (null: none), by j mod kRing; the probe
  // stage's last record, its slab index, and whether it was the record after the one before.
  const BlockRec* cand_[kRing];
  const BlockRec* last_rec_ = nullptr;
  uint32_t last_idx_ = kNone;
  bool chained_ = false;
};

void Index::FindMatches(BlockKeyStream* stream, MatchResult* out, double now) const {
  std::shared_lock lock(mu_);
  std::shared_lock spec_lock(spec_mu_);
  PrefixWalk(*this, stream, out, now < 0 ? last_now_ : now).Run();
}

void Index::UnlinkCredit(const SpecCredit* run) {
  spec_entries_ -= run->keys.size();
  auto it = spec_first_->find(run->keys.front());
  if (it == spec_first_->end()) return;
  InlineVec<CreditRef>& refs = it.value();
  for (CreditRef& r : refs) {
    if (r.run == run) {
      refs.Erase(&r);
      break;
    }
  }
  if (refs.size() == 0) spec_first_->erase(it);
}

void Index::DropSpecLocked(WorkerId w) {
  for (auto& run : credits_) {
    if (run != nullptr && run->worker == w) {
      UnlinkCredit(run.get());
      run.reset();  // the deque slot is popped by PopOldestCredit
    }
  }
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second->worker == w) {
      UnlinkCredit(it->second.get());
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
}

bool Index::PopOldestCredit() {
  if (credits_.empty()) {  // only held credits left: the one held longest goes
    if (held_.empty()) return false;
    UnlinkCredit(held_.begin()->second.get());
    held_.erase(held_.begin());
    return true;
  }
  const SpecCredit* run = credits_.front().get();
  if (run != nullptr) UnlinkCredit(run);
  credits_.pop_front();
  return run != nullptr;
}

void Index::ExpireLocked(double now) {
  while (!credits_.empty() && (credits_.front() == nullptr || credits_.front()->expiry <= now)) {
    PopOldestCredit();
  }
}

uint64_t Index::AddSpeculative(WorkerId w, const BlockKey* keys, size_t n, double now, double ttl,
                               bool hold) {
  std::unique_lock lock(spec_mu_);  // not mu_: never waits for an event being applied
  if (now > last_now_) last_now_ = now;
  ExpireLocked(now);
  if (w >= spec_alive_.size() || !spec_alive_[w] || !(ttl > 0) || n == 0) return 0;
  if (const uint64_t cap = opts_.max_speculative_blocks; cap > 0) {
    n = static_cast<size_t>(std::min<uint64_t>(n, cap));
    // The oldest first: runs are in insertion order (with one ttl, the Router's, expiry
    // order); held credits only when no other is left.
    while (spec_entries_ + n > cap && (!credits_.empty() || !held_.empty())) {
      spec_dropped_ += PopOldestCredit();
    }
  }
  auto run = std::make_unique<SpecCredit>();
  run->worker = w;
  run->expiry = hold ? std::numeric_limits<double>::infinity() : now + ttl;
  run->keys.assign(keys, keys + n);
  (*spec_first_)[keys[0]].Push(CreditRef{w, run.get()});
  spec_entries_ += n;
  const uint64_t id = next_credit_id_++;
  if (hold) {
    held_.emplace(id, std::move(run));
  } else {
    credits_.push_back(std::move(run));
  }
  return id;
}

bool Index::ReleaseSpeculative(uint64_t id, double ttl) {
  std::unique_lock lock(spec_mu_);
  auto it = held_.find(id);
  if (it == held_.end()) return false;
  it->second->expiry = last_now_ + ttl;
  credits_.push_back(std::move(it->second));
  held_.erase(it);
  return true;
}

void Index::ExpireSpeculative(double now) {
  std::unique_lock lock(spec_mu_);
  if (now > last_now_) last_now_ = now;
  ExpireLocked(now);
}

}  // namespace kvroute
