// Tests of the index (cpp/index/): its hash table (RobinTable), holder sets, the mapping cache
// of its allocator, and Index itself (stores, removals, tiers, caps, speculative credits, the
// prefix walk), partly against reference models.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/block_key.h"
#include "events/decoder.h"
#include "index/huge_page_allocator.h"
#include "index/index.h"
#include "index/robin_table.h"
#include "tests/test_util.h"

using namespace kvroute;
using namespace kvroute_test;

namespace {

// Index events as the decoder gives them (integer engine hashes).
Event StoredEv(std::vector<uint64_t> hashes, std::optional<uint64_t> parent,
               std::vector<uint32_t> toks, int64_t bs = 16, Medium tier = Medium::kGpu) {
  Event e;
  e.type = EventType::kBlockStored;
  for (uint64_t h : hashes) e.block_hashes.push_back(IntHash(h));
  if (parent) {
    e.has_parent = true;
    e.parent_block_hash = IntHash(*parent);
  }
  e.token_ids.assign(toks.begin(), toks.end());
  e.block_size = bs;
  e.tier = tier;
  return e;
}
Event RemovedEv(std::vector<uint64_t> hashes, Medium tier = Medium::kGpu) {
  Event e;
  e.type = EventType::kBlockRemoved;
  for (uint64_t h : hashes) e.block_hashes.push_back(IntHash(h));
  e.tier = tier;
  return e;
}
std::vector<uint32_t> Cat(std::vector<uint32_t> a, const std::vector<uint32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
Event ClearedEv() {
  Event e;
  e.type = EventType::kAllBlocksCleared;
  return e;
}

MatchResult Match(const Index& ix, const std::vector<BlockKey>& keys, double now = -1) {
  MatchResult m;
  ix.FindMatches(keys.data(), keys.size(), &m, now);
  return m;
}


// RobinTable against std::unordered_map, with a hash that clusters every key into a few home
// slots (long probe runs, clusters into the tail after the last home, backward-shift deletes).
struct ClusteredSlot {
  uint64_t key;  // 0 = empty
  uint64_t value;
};
struct ClusteredTraits {
  using Slot = ClusteredSlot;
  static constexpr size_t kMaxLoadPercent = 90;
  static constexpr size_t kGrowthPercent = 150;
  static constexpr bool kEmptyIsZero = false;  // (it is; the filling path is tested here)
  static uint64_t Hash(uint64_t k) { return (k % 7) * 0x2492492492492492ull + (k % 3); }
  static bool Empty(const Slot& s) { return s.key == 0; }
  static Slot EmptySlot() { return Slot{0, 0}; }
  static uint64_t HomeHash(const Slot& s) { return Hash(s.key); }
};

TEST(RobinTable, matches_a_map_under_clustering) {
  kvroute::RobinTable<ClusteredTraits> t;
  std::unordered_map<uint64_t, uint64_t> ref;
  std::mt19937_64 rng(7);
  auto eq = [](uint64_t k) { return [k](const ClusteredSlot& s) { return s.key == k; }; };
  for (int step = 0; step < 60000; ++step) {
    const uint64_t k = 1 + rng() % 3000;
    const uint64_t h = ClusteredTraits::Hash(k);
    const int op = static_cast<int>(rng() % 10);
    if (op < 6) {
      auto [slot, inserted] = t.FindOrInsert(h, eq(k), [k] { return ClusteredSlot{k, 0}; });
      EXPECT_EQ(inserted, ref.find(k) == ref.end());
      EXPECT_EQ(slot->key, k);
      slot->value = step;
      ref[k] = static_cast<uint64_t>(step);
    } else if (op < 9) {
      auto* slot = t.Find(h, eq(k));
      EXPECT_EQ(slot != nullptr, ref.count(k) == 1);
      if (slot != nullptr) {
        t.Erase(slot);
        ref.erase(k);
      }
    } else {
      const auto* slot = t.Find(h, eq(k));
      EXPECT_EQ(slot != nullptr, ref.count(k) == 1);
      if (slot != nullptr) {
        EXPECT_EQ(slot->value, ref[k]);
      }
    }
    EXPECT_EQ(t.size(), ref.size());
  }
  size_t seen = 0;
  t.ForEach([&](const ClusteredSlot& s) {
    ++seen;
    EXPECT_TRUE(ref.count(s.key) == 1 && ref[s.key] == s.value);
  });
  EXPECT_EQ(seen, ref.size());
  t.Clear();
  EXPECT_EQ(t.size(), size_t{0});
  EXPECT_TRUE(t.Find(ClusteredTraits::Hash(5), eq(5)) == nullptr);
}

// Inserts, erases and growths keep the table's invariant (RobinTable::Valid) and every key,
// for spread hashes, clustered ones, and hashes bunched at the top of the range (clusters that
// run into the tail past the last home, and make it grow: GrowTail).
struct SpreadTraits {
  using Slot = ClusteredSlot;
  static constexpr size_t kMaxLoadPercent = 90;
  static constexpr size_t kGrowthPercent = 150;
  static constexpr bool kEmptyIsZero = true;
  static bool Empty(const Slot& s) { return s.key == 0; }
  static Slot EmptySlot() { return Slot{0, 0}; }
  static uint64_t HomeHash(const Slot& s) { return s.value; }  // the test picks the hash
};

TEST(RobinTable, growth_keeps_order_and_keys) {
  std::mt19937_64 rng(3);
  for (int shape = 0; shape < 4; ++shape) {
    kvroute::RobinTable<SpreadTraits> t;
    std::vector<std::pair<uint64_t, uint64_t>> keys;  // (key, hash)
    for (uint64_t k = 1; k <= 20000; ++k) {
      uint64_t h = rng();
      if (shape == 1) h = (h % 5) << 61 | (h & 7);            // 5 homes, long clusters
      if (shape == 2) h = ~uint64_t{0} - (h >> 50);           // all at the very top: the tail grows
      if (shape == 3) h = (k % 2) ? ~uint64_t{0} - (h >> 52) : (h >> 52);  // both ends
      keys.push_back({k, h});
      t.FindOrInsert(h, [k](const ClusteredSlot& x) { return x.key == k; },
                     [k, h] { return ClusteredSlot{k, h}; });
      if (k % 997 == 0 || t.size() * 100 > t.capacity() * 89) {
        EXPECT_TRUE(t.Valid());
      }
      if (k % 3 == 0) {  // erase some, so that growths see holes
        const auto [ek, eh] = keys[static_cast<size_t>(rng() % keys.size())];
        auto* slot = t.Find(eh, [ek = ek](const ClusteredSlot& x) { return x.key == ek; });
        if (slot != nullptr) t.Erase(slot);
      }
    }
    EXPECT_TRUE(t.Valid());
    kvroute::RobinTable<SpreadTraits> big;
    t.GrowInto(t.size() * 3, &big);  // several steps at once
    EXPECT_TRUE(big.Valid());
    EXPECT_EQ(big.size(), t.size());
    size_t found = 0;
    t.ForEach([&](const ClusteredSlot& e) {
      const uint64_t k = e.key;
      found += big.Find(e.value, [k](const ClusteredSlot& x) { return x.key == k; }) != nullptr;
    });
    EXPECT_EQ(found, t.size());
  }
}

// Growth places the entries in one ordered pass (RobinTable::PlaceInOrder), which relies on
// the array being sorted by hash and doubles the tail when the entries would run past it.
// Small tables make the edge cases common: clusters into the tail, many keys on one home,
// hashes bunched at the top, at the same capacity and several steps up.
TEST(RobinTable, one_pass_growth_of_small_tables) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20000; ++trial) {
    kvroute::RobinTable<SpreadTraits> t;
    const int n = 1 + static_cast<int>(rng() % 57);  // up to 90 % of the first 64 slots
    const int mode = static_cast<int>(rng() % 4);
    const uint64_t center = rng();
    for (uint64_t k = 1; k <= static_cast<uint64_t>(n); ++k) {
      uint64_t h = rng();
      if (mode == 1) h = center + (rng() >> (rng() % 64));           // bunched anywhere
      if (mode == 2) h = (rng() % 3) * (~uint64_t{0} / 3) + (rng() >> 58);  // three homes
      if (mode == 3) h = ~uint64_t{0} - (rng() >> (4 + rng() % 8));  // at the top: into the tail
      t.FindOrInsert(h, [k](const ClusteredSlot& x) { return x.key == k; },
                     [k, h] { return ClusteredSlot{k, h}; });
    }
    EXPECT_TRUE(t.Valid());
    for (size_t extra : {size_t{1}, size_t{7}, size_t{40}, size_t{400}}) {
      kvroute::RobinTable<SpreadTraits> big;
      t.GrowInto(extra, &big);
      EXPECT_TRUE(big.Valid());
      EXPECT_EQ(big.size(), t.size());
      EXPECT_TRUE(big.capacity() >= t.capacity());
      size_t found = 0;
      t.ForEach([&](const ClusteredSlot& e) {
        const uint64_t k = e.key;
        found += big.Find(e.value, [k](const ClusteredSlot& x) { return x.key == k; }) != nullptr;
      });
      EXPECT_EQ(found, t.size());
    }
  }
}

// Side bytes (RobinTable::EnableSide) move with their slots through inserts, backward-shift
// erases, clusters into the tail and growth; the engine tables keep the caps'
// stamps there. Enabled part-way, as the index does when a worker nears a cap.
template <typename Traits, typename HashOf>
void CheckSideBytes(HashOf hash_of, uint64_t seed) {
  kvroute::RobinTable<Traits> t;
  std::unordered_map<uint64_t, uint8_t> ref;  // key -> expected side byte
  std::mt19937_64 rng(seed);
  auto eq = [](uint64_t k) { return [k](const ClusteredSlot& s) { return s.key == k; }; };
  for (int step = 0; step < 40000; ++step) {
    if (step == 15000) {
      EXPECT_TRUE(!t.has_side());
      t.EnableSide(0xAB);
      for (auto& [k, b] : ref) b = 0xAB;
    }
    const uint64_t k = 1 + rng() % 3000;
    const uint64_t h = hash_of(k);
    const int op = static_cast<int>(rng() % 10);
    if (op < 6) {
      auto [slot, inserted] = t.FindOrInsert(h, eq(k), [k, h] { return ClusteredSlot{k, h}; });
      EXPECT_EQ(inserted, ref.find(k) == ref.end());
      if (t.has_side()) {
        if (inserted) {
          EXPECT_EQ(int{t.Side(slot)}, 0);  // a new slot's byte starts at 0
        }
        t.Side(slot) = static_cast<uint8_t>(step);
      }
      ref[k] = static_cast<uint8_t>(step);
    } else if (op < 8) {
      auto* slot = t.Find(h, eq(k));
      EXPECT_EQ(slot != nullptr, ref.count(k) == 1);
      if (slot != nullptr) {
        t.Erase(slot);
        ref.erase(k);
      }
    } else if (t.has_side()) {
      const auto* slot = t.Find(h, eq(k));
      EXPECT_EQ(slot != nullptr, ref.count(k) == 1);
      if (slot != nullptr) {
        EXPECT_EQ(int{t.Side(slot)}, int{ref[k]});
      }
    }
  }
  EXPECT_TRUE(t.Valid());
  EXPECT_EQ(t.side_bytes(), t.slot_count() + 1);
  size_t checked = 0;
  for (const auto& [k, b] : ref) {
    const auto* slot = t.Find(hash_of(k), eq(k));
    EXPECT_TRUE(slot != nullptr);
    if (slot != nullptr) checked += t.Side(slot) == b;
  }
  EXPECT_EQ(checked, ref.size());
  kvroute::RobinTable<Traits> big;
  t.GrowInto(t.size() * 3, &big);
  EXPECT_TRUE(big.has_side());
  checked = 0;
  for (const auto& [k, b] : ref) {
    const auto* slot = big.Find(hash_of(k), eq(k));
    if (slot != nullptr) checked += big.Side(slot) == b;
  }
  EXPECT_EQ(checked, ref.size());
  big.Clear();
  EXPECT_TRUE(!big.has_side() && big.side_bytes() == 0);
}

// A grown table's slots fill the pages of its mapping (RobinTable::PageFilled): the last
// page's spare room is homes, not slack, so the table holds more before its next growth.
TEST(RobinTable, growth_fills_its_pages) {
  kvroute::RobinTable<SpreadTraits> t;
  size_t last_cap = t.capacity(), mapped_growths = 0;
  for (uint64_t k = 1; k <= 200000; ++k) {
    const uint64_t h = Fmix64(k);
    t.FindOrInsert(h, [k](const ClusteredSlot& x) { return x.key == k; },
                   [k, h] { return ClusteredSlot{k, h}; });
    if (t.capacity() == last_cap) continue;
    last_cap = t.capacity();
    using Alloc = kvroute::HugePageAllocator<ClusteredSlot>;
    const size_t bytes = t.bytes();
    if (bytes < Alloc::kMapped) continue;  // malloc'd: no pages of its own
    ++mapped_growths;
    EXPECT_TRUE(Alloc::Len(bytes) - bytes < 2 * sizeof(ClusteredSlot));
    EXPECT_TRUE(t.size() * 100 <= t.capacity() * 90);
  }
  EXPECT_TRUE(mapped_growths >= 10);
  EXPECT_TRUE(t.Valid());
}

TEST(RobinTable, side_bytes_follow_their_slots) {
  // Clustered homes (long runs and shifts) and hashes bunched at the top
  // of the range (clusters into the tail).
  CheckSideBytes<SpreadTraits>([](uint64_t k) { return ClusteredTraits::Hash(k); }, 11);
  CheckSideBytes<SpreadTraits>([](uint64_t k) { return ~uint64_t{0} - (Fmix64(k) >> 54); }, 12);
  CheckSideBytes<SpreadTraits>([](uint64_t k) { return Fmix64(k); }, 13);
}

// HolderSet against a plain map of (worker -> per-tier counts): holders, the moves between its
// forms (one inline, two inline, heap; back when holders leave; a count past an inline
// field), saturation at kMaxRefs, and the signature, which must stay the XOR of
// HolderSig(worker, tier mask) over the holders (the prefix walk trusts it).
TEST(HolderSet, matches_a_map_and_keeps_its_signature) {
  kvroute::HolderPool pool;
  kvroute::HolderSet hs;
  std::map<kvroute::WorkerId, std::array<uint32_t, 3>> ref;
  std::mt19937_64 rng(11);
  int64_t heap = 0;
  const kvroute::WorkerId big = 70000;  // too large for the two-inline form
  for (int step = 0; step < 20000; ++step) {
    // Phases: two workers (inline forms), three (to the heap and back), many, large ids.
    const int phase = (step / 1000) % 4;
    const kvroute::WorkerId n = phase == 0 ? 2 : phase == 1 ? 3 : phase == 2 ? 40 : 2;
    const kvroute::WorkerId w = static_cast<kvroute::WorkerId>(rng() % n) + (phase == 3 ? big : 0);
    const int tier = static_cast<int>(rng() % 3);
    const int op = static_cast<int>(rng() % 8);
    int64_t d = 0;
    if (op < 4) {
      const uint32_t times = op == 0 ? 20 : 1;  // pushes a two-inline count past 15
      for (uint32_t k = 0; k < times; ++k) {
        bool added_holder = false;
        const bool room = ref.count(w) == 0 || ref[w][tier] < kvroute::HolderSet::kMaxRefs;
        // Half the time through AddInline first (the Index's store fast path): it takes only
        // a new holder that stays inline, and AddRef the rest.
        const bool inline_first = (step + k) % 2 == 0;
        if (inline_first && hs.AddInline(w, tier)) {
          EXPECT_TRUE(ref.count(w) == 0 && ref.size() <= 1);
          d = 0;
          added_holder = true;
        } else {
          EXPECT_EQ(hs.AddRef(pool, w, tier, &added_holder, &d), room);
        }
        heap += d;
        EXPECT_EQ(added_holder, ref.count(w) == 0);
        if (room) ++ref[w][tier];
      }
    } else {
      const uint32_t n_drop = op == 4 ? 20 : 1;
      const bool gone = hs.DropRef(pool, w, tier, n_drop, &d);
      heap += d;
      bool want_gone = false;
      auto it = ref.find(w);
      if (it != ref.end()) {
        it->second[tier] = it->second[tier] > n_drop ? it->second[tier] - n_drop : 0;
        if (it->second == std::array<uint32_t, 3>{0, 0, 0}) {
          ref.erase(it);
          want_gone = true;
        }
      }
      EXPECT_EQ(gone, want_gone);
    }
    EXPECT_EQ(hs.size(), static_cast<uint32_t>(ref.size()));
    EXPECT_EQ(hs.empty(), ref.empty());
    uint64_t sig = 0;
    for (const auto& [rw, refs] : ref) sig ^= kvroute::HolderSig(rw, kvroute::TierMask(refs));
    EXPECT_EQ(hs.Signature(), sig);
    std::map<kvroute::WorkerId, uint8_t> seen;
    hs.ForEach([&](kvroute::WorkerId x, uint8_t mask) { seen[x] = mask; });
    EXPECT_EQ(seen.size(), ref.size());
    for (const auto& [rw, refs] : ref) {
      EXPECT_EQ(seen[rw], kvroute::TierMask(refs));
      EXPECT_TRUE(hs.Any([rw = rw](kvroute::WorkerId x) { return x == rw; }));
    }
    EXPECT_TRUE(!hs.Any([](kvroute::WorkerId x) { return x == 12345; }));
    EXPECT_EQ(static_cast<uint64_t>(heap), hs.HeapBytes());
    if (ref.size() <= 1) {
      EXPECT_EQ(hs.HeapBytes(), uint64_t{0});  // a lone holder is inline
    }
    EXPECT_EQ(pool.size(), hs.HeapBytes() > 0 ? size_t{1} : size_t{0});  // old arrays freed
    if (step % 50 == 0 && ref.size() >= 3) {
      // The same holders built afresh, in another order: the same interned array (the
      // content hash kept up by each update equals the one computed from scratch).
      kvroute::HolderSet fresh;
      bool a = false;
      int64_t dd = 0;
      for (auto it = ref.rbegin(); it != ref.rend(); ++it) {
        for (int t = 0; t < 3; ++t) {
          for (uint32_t k = 0; k < it->second[t]; ++k) fresh.AddRef(pool, it->first, t, &a, &dd);
        }
      }
      EXPECT_EQ(fresh.RunKey(), hs.RunKey());
      EXPECT_EQ(pool.size(), size_t{1});
      fresh.Release(pool);
    }
  }
  hs.Release(pool);
  EXPECT_TRUE(hs.empty());
  EXPECT_EQ(pool.size(), size_t{0});
  // Saturation, inline and on the heap: kMaxRefs references are taken, the next is refused.
  for (const kvroute::WorkerId others : {0u, 2u}) {
    kvroute::HolderSet s;
    bool added = false;
    int64_t d = 0;
    for (kvroute::WorkerId o = 0; o < others; ++o) s.AddRef(pool, 100 + o, 0, &added, &d);
    for (uint32_t k = 0; k < kvroute::HolderSet::kMaxRefs; ++k) EXPECT_TRUE(s.AddRef(pool, 7, 1, &added, &d));
    EXPECT_TRUE(!s.AddRef(pool, 7, 1, &added, &d));
    EXPECT_TRUE(s.AddRef(pool, 7, 2, &added, &d));  // another tier has room
    EXPECT_TRUE(!s.DropRef(pool, 7, 1, kvroute::HolderSet::kMaxRefs, &d));
    EXPECT_TRUE(s.DropRef(pool, 7, 2, 1, &d));
    EXPECT_EQ(s.size(), others);
    s.Release(pool);
  }
}

// Sets with the same holders and counts share one interned array (the run key is the word,
// so they compare equal without reading it); an update copies on write and leaves the others
// alone; the last release frees the array.
TEST(HolderSet, sets_with_equal_holders_share_one_array) {
  kvroute::HolderPool pool;
  std::vector<kvroute::HolderSet> sets(50);
  bool added = false;
  int64_t bytes = 0, d = 0;
  for (auto& s : sets) {
    for (const kvroute::WorkerId w : {9u, 3u, 70000u, 5u}) {  // order differs from sorted
      EXPECT_TRUE(s.AddRef(pool, w, 0, &added, &d));
      bytes += d;
    }
  }
  EXPECT_EQ(pool.size(), size_t{1});
  EXPECT_EQ(static_cast<uint64_t>(bytes), sets[0].HeapBytes());
  for (const auto& s : sets) EXPECT_EQ(s.RunKey(), sets[0].RunKey());
  // Another order of the same adds: the same array.
  kvroute::HolderSet other;
  for (const kvroute::WorkerId w : {5u, 70000u, 9u, 3u}) {
    other.AddRef(pool, w, 0, &added, &d);
    bytes += d;
  }
  EXPECT_EQ(other.RunKey(), sets[0].RunKey());
  // A CPU copy on one set: a second array for it alone; the signature follows.
  EXPECT_TRUE(sets[7].AddRef(pool, 3, 1, &added, &d));
  bytes += d;
  EXPECT_TRUE(!added);
  EXPECT_EQ(pool.size(), size_t{2});
  EXPECT_TRUE(sets[7].RunKey() != sets[0].RunKey());
  EXPECT_EQ(sets[7].Signature() ^ sets[0].Signature(),
           kvroute::HolderSig(3, 1) ^ kvroute::HolderSig(3, 3));
  // Dropping it again comes back to the shared array, and the private one is freed.
  EXPECT_TRUE(!sets[7].DropRef(pool, 3, 1, 1, &d));
  bytes += d;
  EXPECT_EQ(sets[7].RunKey(), sets[0].RunKey());
  EXPECT_EQ(pool.size(), size_t{1});
  EXPECT_EQ(static_cast<uint64_t>(bytes), sets[0].HeapBytes());
  // Holders leave one set down to one (inline): the others keep theirs.
  for (const kvroute::WorkerId w : {9u, 70000u, 5u}) {
    sets[0].DropRef(pool, w, 0, 1, &d);
    bytes += d;
  }
  EXPECT_EQ(sets[0].size(), 1u);
  EXPECT_EQ(sets[0].HeapBytes(), uint64_t{0});
  EXPECT_EQ(sets[1].size(), 4u);
  for (size_t i = 1; i < sets.size(); ++i) bytes -= sets[i].Release(pool);
  bytes -= other.Release(pool);
  sets[0].Release(pool);
  EXPECT_EQ(pool.size(), size_t{0});
  EXPECT_EQ(bytes, int64_t{0});
}

// A freed table's mapping is kept for the next table (MappingCache), which must get it back as
// zeroes like a fresh mapping (an all-zero slot is an empty one): at its own length, or
// extended to a longer one by mremap. What is kept stays within MappingCache::kMaxBytes, the
// mapping kept longest ago going first.
TEST(MappingCache, a_kept_mapping_comes_back_zeroed) {
  using kvroute::MappingCache;
  kvroute::HugePageAllocator<uint64_t> alloc;
  MappingCache::Release();  // (earlier tests' tables)
  const size_t n = (12u << 10) / sizeof(uint64_t);  // 12 KiB: mapped, and kept when freed
  auto scribble = [](uint64_t* p, size_t len) {
    for (size_t i = 0; i < len; ++i) p[i] = i * 2654435761u + 1;
  };
  auto all_zero = [](const uint64_t* p, size_t len) {
    for (size_t i = 0; i < len; ++i) {
      if (p[i] != 0) return false;
    }
    return true;
  };
  // Tables take kept mappings only when they are allocated to be filled (populate).
  auto table = [&](size_t len) { return alloc.allocate(len, true, /*populate=*/true); };
  auto mapped = [](const void* p, size_t bytes) {  // every page of the range is mapped
    std::vector<unsigned char> pages((bytes + 4095) / 4096);
    return mincore(const_cast<void*>(p), bytes, pages.data()) == 0;
  };
  uint64_t* a = table(n);
  EXPECT_TRUE(all_zero(a, n));
  scribble(a, n);
  alloc.deallocate(a, n);
  EXPECT_EQ(MappingCache::kept_bytes(), size_t{12} << 10);
  // A mapping that should take pages as it fills (the block slab's first chunk) leaves it.
  uint64_t* lazy = alloc.allocate(n + 3 * 512, /*huge=*/false);
  EXPECT_EQ(MappingCache::kept_bytes(), size_t{12} << 10);
  alloc.deallocate(lazy, n + 3 * 512);
  MappingCache::Release();
  a = table(n);
  scribble(a, n);
  alloc.deallocate(a, n);
  uint64_t* b = table(n);
  EXPECT_TRUE(b == a);  // the kept mapping, not a fresh one
  EXPECT_EQ(MappingCache::kept_bytes(), size_t{0});
  EXPECT_TRUE(all_zero(b, n));
  scribble(b, n);
  alloc.deallocate(b, n);
  // A longer table takes it, extended (mremap; not under TSan, which cannot follow a moved
  // mapping): zero throughout, every page mapped and writable.
  const size_t longer = n + 3 * 512;  // 24 KiB
#if defined(__linux__) && !defined(KVROUTE_NO_MREMAP)
  EXPECT_TRUE(MappingCache::kCanExtend);  // (the extension is not lost to a preprocessor slip)
#endif
  uint64_t* c = table(longer);
  EXPECT_EQ(MappingCache::kept_bytes(),
           kvroute::MappingCache::kCanExtend ? size_t{0} : size_t{12} << 10);
  EXPECT_TRUE(mapped(c, longer * sizeof(uint64_t)));
  EXPECT_TRUE(all_zero(c, longer));
  scribble(c, longer);
  alloc.deallocate(c, longer);
  MappingCache::Release();
  alloc.deallocate(table(longer), longer);
  // A shorter one is not served from it.
  uint64_t* d = table(n);
  EXPECT_EQ(MappingCache::kept_bytes(), size_t{24} << 10);
  EXPECT_TRUE(all_zero(d, n));
  alloc.deallocate(d, n);
  MappingCache::Release();
  EXPECT_EQ(MappingCache::kept_bytes(), size_t{0});
  // Past the budget the oldest goes: three 768 KiB mappings keep the last two.
  const size_t big = (768u << 10) / sizeof(uint64_t);
  static_assert((768u << 10) < MappingCache::kBelow && 3 * (768u << 10) > MappingCache::kMaxBytes &&
                    2 * (768u << 10) <= MappingCache::kMaxBytes,
                "the case needs room for two 768 KiB mappings, not three");
  uint64_t* m[3];
  for (auto& p : m) p = table(big);
  for (auto* p : m) alloc.deallocate(p, big);
  EXPECT_EQ(MappingCache::kept_bytes(), size_t{1536} << 10);
  uint64_t* e = table(big);
  uint64_t* f = table(big);
  EXPECT_TRUE((e == m[1] && f == m[2]) || (e == m[2] && f == m[1]));
  EXPECT_EQ(MappingCache::kept_bytes(), size_t{0});
  alloc.deallocate(e, big);
  alloc.deallocate(f, big);
  MappingCache::Release();
}


// Two workers store long chains at once while a third thread looks up: the tables grow many
// times (outside the write lock, swapped in under it), and every chain must end up whole.
TEST(Index, grows_its_tables_while_two_workers_store_and_one_reads) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  const uint32_t kChains = 40, kBlocks = 300;  // 24,000 blocks: ~17 growths of each table
  std::atomic<bool> done{false};
  std::atomic<uint64_t> lookups{0};
  std::thread reader([&] {
    const auto probe = Range(7, kBlocks * 16);
    const auto keys = Keys(probe);
    MatchResult m;
    while (!done.load()) {
      ix.FindMatches(keys.data(), keys.size(), &m);
      lookups.fetch_add(1);
    }
  });
  auto store = [&](WorkerId w, uint32_t base) {
    ApplyCounts c;
    for (uint32_t k = 0; k < kChains; ++k) {
      const uint32_t first = base + k * kBlocks * 16;
      std::vector<uint64_t> hashes(kBlocks);
      for (uint32_t i = 0; i < kBlocks; ++i) hashes[i] = uint64_t{base} * 1000 + k * kBlocks + i + 1;
      ix.Apply(w, StoredEv(hashes, std::nullopt, Range(first, kBlocks * 16)), &c);
    }
    EXPECT_EQ(c.blocks_stored, uint64_t{kChains} * kBlocks);
  };
  // The writers start once the reader is reading (on a loaded machine the stores, ~3 ms, could
  // otherwise end before the reader thread first runs).
  while (lookups.load() == 0) std::this_thread::yield();
  std::thread ta([&] { store(a, 1000); });
  std::thread tb([&] { store(b, 50000000); });
  ta.join();
  tb.join();
  done.store(true);
  reader.join();
  EXPECT_TRUE(lookups.load() > 0);
  EXPECT_EQ(ix.DistinctKeys(), uint64_t{2} * kChains * kBlocks);
  EXPECT_EQ(ix.Entries(), uint64_t{2} * kChains * kBlocks);
  EXPECT_EQ(ix.WorkerBlocks(a), uint64_t{kChains} * kBlocks);
  for (const auto& [w, base] : {std::pair{a, 1000u}, std::pair{b, 50000000u}}) {
    for (uint32_t k = 0; k < kChains; k += 7) {
      const auto m = Match(ix, Keys(Range(base + k * kBlocks * 16, kBlocks * 16)));
      EXPECT_EQ(m.blocks[w], kBlocks);
    }
  }
}

TEST(Index, store_chain_and_match) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  EXPECT_EQ(a, 0u);
  EXPECT_EQ(b, 1u);
  const auto toks = Range(100, 64);  // 4 blocks
  const auto keys = Keys(toks);
  ApplyCounts ca, cb;
  ix.Apply(a, StoredEv({11, 12, 13}, std::nullopt, Range(100, 48)), &ca);
  ix.Apply(b, StoredEv({21, 22}, std::nullopt, Range(100, 32)), &cb);
  EXPECT_EQ(ca.blocks_stored, 3u);
  EXPECT_EQ(ca.events, 1u);
  auto m = Match(ix, keys);
  EXPECT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.blocks[a], 3u);
  EXPECT_EQ(m.blocks[b], 2u);
  EXPECT_TRUE(m.weighted[a] == 3.0);
  EXPECT_EQ(m.max_blocks, 3u);
  // Continue a's chain from its last engine hash.
  ix.Apply(a, StoredEv({14}, 13, Range(148, 16)), &ca);
  m = Match(ix, keys);
  EXPECT_EQ(m.blocks[a], 4u);
  EXPECT_EQ(ix.DistinctKeys(), 4u);
  EXPECT_EQ(ix.Entries(), 6u);
  EXPECT_EQ(ix.WorkerBlocks(a), 4u);
  EXPECT_EQ(ix.WorkerBlocks(b), 2u);
  // A different first block matches nothing, even if later blocks are equal.
  auto other = Range(100, 64);
  other[0] = 5;
  m = Match(ix, Keys(other));
  EXPECT_EQ(m.max_blocks, 0u);
  // Removing a middle block ends a's prefix there.
  ix.Apply(a, RemovedEv({12}), &ca);
  EXPECT_EQ(ca.blocks_removed, 1u);
  m = Match(ix, keys);
  EXPECT_EQ(m.blocks[a], 1u);
  EXPECT_EQ(m.blocks[b], 2u);
  EXPECT_EQ(m.max_blocks, 2u);
  // WorkerEntries: 3 hashes left on a, each one GPU ref.
  auto ents = ix.WorkerEntries(a);
  EXPECT_EQ(ents.size(), 3u);
  for (const auto& e : ents) EXPECT_TRUE(e.refs[0] == 1 && e.refs[1] == 0 && e.refs[2] == 0);
}

TEST(Index, orphans_and_apply_time_drops) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  ix.Apply(a, StoredEv({1, 2}, 999, Range(0, 32)), &c);  // parent unknown
  EXPECT_EQ(c.orphan_stores, 2u);
  EXPECT_EQ(ix.WorkerBlocks(a), 0u);
  ix.Apply(a, StoredEv({1}, std::nullopt, Range(0, 32), 32), &c);  // block size 32 != 16
  EXPECT_EQ(c.drops.Get(DropReason::kBlockSizeMismatch), 1u);
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 31)), &c);  // 31 tokens for 2 blocks
  EXPECT_EQ(c.drops.Get(DropReason::kBadTokenCount), 1u);
  Event sw = StoredEv({1}, std::nullopt, Range(0, 16));
  sw.kv_cache_spec_kind = "sliding_window";
  ix.Apply(a, sw, &c);
  EXPECT_EQ(c.drops.Get(DropReason::kUnsupportedSpec), 1u);
  Event fa = StoredEv({1}, std::nullopt, Range(0, 16));
  fa.kv_cache_spec_kind = "full_attention";
  fa.medium_known = false;
  ix.Apply(a, fa, &c);
  EXPECT_EQ(c.unknown_medium, 1u);
  EXPECT_EQ(ix.WorkerBlocks(a), 1u);
  EXPECT_EQ(c.events, 5u);
  ix.Apply(a, RemovedEv({777}), &c);
  EXPECT_EQ(c.unknown_removes, 1u);
}

TEST(Index, refcounts_and_tiers) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  const auto keys = Keys(Range(0, 16));
  ApplyCounts c;
  // A block filled twice at once (vLLM does not de-duplicate two copies): two removes.
  ix.Apply(a, StoredEv({4}, std::nullopt, Range(100, 16)), &c);
  ix.Apply(a, StoredEv({5}, 4, Range(0, 16)), &c);
  ix.Apply(a, StoredEv({5}, 4, Range(0, 16)), &c);
  const auto keys2 = Keys(Cat(Range(100, 16), Range(0, 16)));
  ix.Apply(a, RemovedEv({5}), &c);
  EXPECT_EQ(Match(ix, keys2).blocks[a], 2u);
  ix.Apply(a, RemovedEv({5}), &c);
  EXPECT_EQ(Match(ix, keys2).blocks[a], 1u);
  ix.Apply(a, RemovedEv({5}), &c);
  EXPECT_EQ(c.unknown_removes, 1u);
  ix.Apply(a, RemovedEv({4}), &c);
  EXPECT_EQ(ix.Entries(), 0u);
  EXPECT_EQ(ix.DistinctKeys(), 0u);

  // GPU + CPU copies; the best tier is credited.
  ix.Apply(a, StoredEv({6}, std::nullopt, Range(0, 16)), &c);
  Event cpu = StoredEv({6}, std::nullopt, {}, 0, Medium::kCpu);  // CPU placeholder
  ix.Apply(a, cpu, &c);
  auto m = Match(ix, keys);
  EXPECT_TRUE(m.weighted[a] == 1.0);
  ix.Apply(a, RemovedEv({6}, Medium::kGpu), &c);
  m = Match(ix, keys);
  EXPECT_EQ(m.blocks[a], 1u);
  EXPECT_TRUE(std::fabs(m.weighted[a] - 0.8) < 1e-12);
  auto ents = ix.WorkerEntries(a);
  EXPECT_TRUE(ents.size() == 1 && ents[0].refs[0] == 0 && ents[0].refs[1] == 1);
  ix.Apply(a, StoredEv({6}, std::nullopt, Range(0, 16), 16, Medium::kDisk), &c);
  ix.Apply(a, RemovedEv({6}, Medium::kCpu), &c);
  m = Match(ix, keys);
  EXPECT_TRUE(std::fabs(m.weighted[a] - 0.25) < 1e-12);
  ix.Apply(a, RemovedEv({6}, Medium::kDisk), &c);
  EXPECT_EQ(Match(ix, keys).blocks[a], 0u);
  EXPECT_EQ(ix.WorkerBlocks(a), 0u);
  // Placeholder for an unknown hash: an orphan, nothing indexed.
  const uint64_t before = c.orphan_stores;
  ix.Apply(a, cpu, &c);
  EXPECT_EQ(c.orphan_stores, before + 1);
  EXPECT_EQ(ix.Entries(), 0u);
}

// Reference counts per (engine hash, tier) against a model, through the engine slot's two
// forms: one tier bit per tier, and exact counts in the side map once a tier holds the same
// engine hash twice (kRefsMany), and back.
TEST(Index, refcounts_match_a_model) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  const Medium tiers[kNumMedia] = {Medium::kGpu, Medium::kCpu, Medium::kDisk};
  constexpr uint64_t kHashes = 6;
  std::array<std::array<uint32_t, kNumMedia>, kHashes> model{};
  std::mt19937_64 rng(21);
  ApplyCounts c;
  uint64_t unknown = 0;
  ix.Apply(a, StoredEv({99}, std::nullopt, Range(5000, 16)), &c);
  for (int step = 0; step < 20000; ++step) {
    const uint64_t h = rng() % kHashes;
    const int t = static_cast<int>(rng() % kNumMedia);
    if (rng() % 100 < 52) {  // slightly more stores than removes: counts reach 3-5
      // Continuations of a root block (a run from token 0 the worker holds is a re-report).
      ix.Apply(a, StoredEv({100 + h}, 99, Range(static_cast<uint32_t>(h) * 16, 16), 16,
                           tiers[t]), &c);
      ++model[h][t];
    } else {
      ix.Apply(a, RemovedEv({100 + h}, tiers[t]), &c);
      if (model[h][t] == 0) {
        ++unknown;
      } else {
        --model[h][t];
      }
    }
    if (step % 7 != 0) continue;
    EXPECT_EQ(c.unknown_removes, unknown);
    uint64_t held = 0;
    for (const auto& m : model) held += (m[0] + m[1] + m[2]) > 0;
    EXPECT_EQ(ix.Entries(), held + 1);  // + the root
    EXPECT_EQ(ix.WorkerBlocks(a), held + 1);
    for (const auto& e : ix.WorkerEntries(a)) {
      if (e.hash.lo == 99) continue;
      const uint64_t i = e.hash.lo - 100;
      EXPECT_TRUE(i < kHashes);
      if (i >= kHashes) continue;
      for (int k = 0; k < kNumMedia; ++k) EXPECT_EQ(uint32_t{e.refs[k]}, model[i][k]);
    }
    // The match credits the best tier that holds the block.
    const uint64_t i = rng() % kHashes;
    const auto m = Match(ix, Keys(Cat(Range(5000, 16), Range(static_cast<uint32_t>(i) * 16, 16))));
    const double want = model[i][0] > 0 ? 1.0 : model[i][1] > 0 ? 0.8 : model[i][2] > 0 ? 0.25 : 0.0;
    EXPECT_TRUE(std::fabs(m.weighted[a] - 1.0 - want) < 1e-12);  // the root: 1.0
  }
}

// The total cap evicts from the largest worker even if that worker has no store stamps yet
// (it stored only before the index was half-way to the cap): its entries count as equally old.
TEST(Index, total_cap_evicts_a_worker_without_stamps) {
  IndexOptions o;
  o.max_blocks_total = 100;
  o.order_from_start_below = 0;  // stamps only from half-way, as under the default caps
  Index ix(o);
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker(), d = ix.AddWorker();
  ApplyCounts c;
  auto store = [&](WorkerId w, uint64_t first, uint32_t n) {
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t tok = static_cast<uint32_t>(first + i) * 16;
      ix.Apply(w, StoredEv({first + i}, std::nullopt, Range(tok, 16)), &c);
    }
  };
  store(a, 1000, 49);  // under half of the cap: a never gets stamps from its own stores
  store(b, 2000, 30);
  store(d, 3000, 30);  // 109 entries: 9 go, from a, the largest
  EXPECT_EQ(ix.Entries(), 100u);
  EXPECT_EQ(ix.WorkerBlocks(a), 40u);
  EXPECT_EQ(ix.WorkerEvictedByCap(a), 9u);
  EXPECT_EQ(ix.WorkerBlocks(b), 30u);
  EXPECT_EQ(ix.WorkerBlocks(d), 30u);
  EXPECT_EQ(ix.WorkerEvictedByCap(b) + ix.WorkerEvictedByCap(d), 0u);
}

// The prefix walk takes the record after the previous block's as the next block's when two
// blocks' records were adjacent (one event's records are allocated in order), checking the
// whole key and that the record is live. Records freed and reused by another chain, in
// reverse order, free records, and a chain that crosses a slab chunk must all give the same
// depths as the table.
TEST(Index, walk_guesses_the_next_record_exactly) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  ApplyCounts c;
  const auto x = Range(0, 8 * 16), y = Range(5000, 3 * 16);
  std::vector<uint64_t> xh, yh;
  for (uint64_t i = 0; i < 8; ++i) xh.push_back(100 + i);
  for (uint64_t i = 0; i < 3; ++i) yh.push_back(200 + i);
  ix.Apply(a, StoredEv(xh, std::nullopt, x), &c);
  EXPECT_EQ(Match(ix, Keys(x)).blocks[a], 8u);
  ix.Apply(a, RemovedEv({103, 104, 105}), &c);  // frees the records of blocks 3-5
  EXPECT_EQ(Match(ix, Keys(x)).blocks[a], 3u);
  ix.Apply(b, StoredEv(yh, std::nullopt, y), &c);  // reuses them, last freed first
  auto m = Match(ix, Keys(x));
  EXPECT_TRUE(m.blocks[a] == 3u && m.blocks[b] == 0u);
  m = Match(ix, Keys(y));
  EXPECT_TRUE(m.blocks[b] == 3u && m.blocks[a] == 0u);
  // a holds Y too: the record after X[2]'s is now live and held by a, so only the key
  // comparison keeps the walk from crediting a with X[3].
  ix.Apply(a, StoredEv({300, 301, 302}, std::nullopt, y), &c);
  m = Match(ix, Keys(y));
  EXPECT_TRUE(m.blocks[a] == 3u && m.blocks[b] == 3u);
  EXPECT_EQ(Match(ix, Keys(x)).blocks[a], 3u);
  ix.Apply(b, RemovedEv(yh), &c);
  ix.Apply(a, RemovedEv({302}), &c);  // Y[2]'s record (after X[2]'s) is free again
  m = Match(ix, Keys(y));
  EXPECT_TRUE(m.blocks[a] == 2u && m.blocks[b] == 0u);
  EXPECT_EQ(Match(ix, Keys(x)).blocks[a], 3u);
  // One chain across the end of the first slab chunk (131,072 records).
  const uint32_t n = static_cast<uint32_t>(kvroute::BlockSlab::kChunk) + 40;
  const auto big = Range(1u << 24, n * 16);
  std::vector<uint64_t> bh(n);
  for (uint32_t i = 0; i < n; ++i) bh[i] = 1000000 + i;
  ix.Apply(b, StoredEv(bh, std::nullopt, big), &c);
  m = Match(ix, Keys(big));
  EXPECT_TRUE(m.blocks[b] == n && m.blocks[a] == 0u);
  ix.Apply(b, RemovedEv({1000000 + n - 10}), &c);
  EXPECT_EQ(Match(ix, Keys(big)).blocks[b], n - 10);
}

// The walk's loop for the common case (a run open, the probe stage on a chain of records)
// must hand over to the general path wherever that case ends: the run's holders change in the
// middle of a chain, a chain's record is freed, or freed and reused by another block.
TEST(Index, walk_fast_loop_stops_where_it_must) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker(), c = ix.AddWorker();
  ApplyCounts cnt;
  const uint32_t n = 100;
  auto x = Range(7u << 20, n * 16);
  std::vector<uint64_t> ah, bh;
  for (uint32_t i = 0; i < n; ++i) ah.push_back(10000 + i);
  for (uint32_t i = 0; i < 60; ++i) bh.push_back(20000 + i);
  ix.Apply(a, StoredEv(ah, std::nullopt, x), &cnt);  // one chain of 100 records
  EXPECT_EQ(Match(ix, Keys(x)).blocks[a], n);
  ix.Apply(b, StoredEv(bh, std::nullopt, std::vector<uint32_t>(x.begin(), x.begin() + 60 * 16)),
           &cnt);  // the run's holders change at block 60, in the middle of the chain
  auto m = Match(ix, Keys(x));
  EXPECT_TRUE(m.blocks[a] == n && m.blocks[b] == 60u && m.blocks[c] == 0u);
  ix.Apply(a, RemovedEv({10000 + 80}), &cnt);  // block 80's record is freed
  m = Match(ix, Keys(x));
  EXPECT_TRUE(m.blocks[a] == 80u && m.blocks[b] == 60u);
  const auto y = Range(9u << 20, 16);
  ix.Apply(c, StoredEv({30000}, std::nullopt, y), &cnt);  // reuses that record for another key
  m = Match(ix, Keys(x));
  EXPECT_TRUE(m.blocks[a] == 80u && m.blocks[b] == 60u && m.blocks[c] == 0u);
  EXPECT_EQ(Match(ix, Keys(y)).blocks[c], 1u);
  auto longer = x;  // the prompt goes on past what anyone holds
  const auto tail = Range(11u << 20, 40 * 16);
  longer.insert(longer.end(), tail.begin(), tail.end());
  m = Match(ix, Keys(longer));
  EXPECT_TRUE(m.blocks[a] == 80u && m.blocks[b] == 60u);
  m = Match(ix, Keys(std::vector<uint32_t>(x.begin(), x.begin() + 70 * 16)));
  EXPECT_TRUE(m.blocks[a] == 70u && m.blocks[b] == 60u && m.max_blocks == 70u);
}

TEST(Index, hash_rebound) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  ix.Apply(a, StoredEv({5}, std::nullopt, Range(0, 16)), &c);
  ix.Apply(a, StoredEv({5}, std::nullopt, Range(1000, 16)), &c);
  EXPECT_EQ(c.hash_rebound, 1u);
  EXPECT_EQ(Match(ix, Keys(Range(0, 16))).blocks[a], 0u);
  EXPECT_EQ(Match(ix, Keys(Range(1000, 16))).blocks[a], 1u);
  EXPECT_EQ(ix.DistinctKeys(), 1u);
  ix.Apply(a, RemovedEv({5}), &c);
  EXPECT_EQ(ix.DistinctKeys(), 0u);
}

TEST(Index, lora_and_extra_keys) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  Event e = StoredEv({1}, std::nullopt, Range(0, 16));
  e.lora_name = "adapter";
  ix.Apply(a, e, &c);
  Event li = StoredEv({2}, std::nullopt, Range(0, 16));
  li.has_lora_id = true;
  li.lora_id = 3;
  ix.Apply(a, li, &c);
  EXPECT_EQ(Match(ix, Keys(Range(0, 16))).max_blocks, 0u);
  EXPECT_EQ(Match(ix, Keys(Range(0, 16), 16, "adapter")).blocks[a], 1u);
  EXPECT_EQ(Match(ix, Keys(Range(0, 16), 16, "#lora_id:3")).blocks[a], 1u);
  Event x = StoredEv({3, 4}, std::nullopt, Range(0, 32));
  const std::string salt = Enc(A({S("s")}));
  x.extra_keys = {salt};
  ix.Apply(a, x, &c);
  const std::vector<std::string> extras = {salt};
  EXPECT_EQ(Match(ix, Keys(Range(0, 32), 16, {}, &extras)).blocks[a], 2u);
  EXPECT_EQ(Match(ix, Keys(Range(0, 32))).blocks[a], 0u);
}

TEST(Index, held_credit_lasts_until_released_then_ttl) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  const auto keys = Keys(Range(0, 64));
  const uint64_t id = ix.AddSpeculative(a, keys.data(), 4, 1.0, 2.0, /*hold=*/true);
  ASSERT_NE(id, 0u);
  EXPECT_EQ(ix.SpeculativeHeld(), 1u);
  ix.ExpireSpeculative(100.0);  // far past the ttl: a held credit stays
  EXPECT_EQ(Match(ix, keys, 100).blocks[a], 4u);
  EXPECT_TRUE(ix.ReleaseSpeculative(id, 2.0));  // expires at 100 + 2
  EXPECT_FALSE(ix.ReleaseSpeculative(id, 2.0));
  EXPECT_EQ(ix.SpeculativeHeld(), 0u);
  EXPECT_EQ(Match(ix, keys, 101.5).blocks[a], 4u);
  EXPECT_EQ(Match(ix, keys, 102.5).blocks[a], 0u);
  ix.ExpireSpeculative(102.5);
  EXPECT_EQ(ix.SpeculativeEntries(), 0u);
  // A removed worker's held credits go with it; releasing one later is a no-op.
  const uint64_t held_b = ix.AddSpeculative(b, keys.data(), 3, 103.0, 2.0, true);
  EXPECT_EQ(ix.AddSpeculative(b, keys.data(), 0, 103.0, 2.0, true), 0u);
  ix.RemoveWorker(b);
  EXPECT_EQ(ix.SpeculativeHeld(), 0u);
  EXPECT_EQ(ix.SpeculativeEntries(), 0u);
  EXPECT_FALSE(ix.ReleaseSpeculative(held_b, 2.0));
}

TEST(Index, clear_and_remove_worker) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  const auto keys = Keys(Range(0, 64));
  ApplyCounts ca, cb;
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32)), &ca);
  ix.Apply(b, StoredEv({1, 2, 3}, std::nullopt, Range(0, 48)), &cb);
  ix.AddSpeculative(a, keys.data() + 2, 2, 10.0, 5.0);
  EXPECT_EQ(Match(ix, keys, 11).blocks[a], 4u);
  ix.ClearWorker(a);
  EXPECT_EQ(ix.WorkerBlocks(a), 0u);
  auto m = Match(ix, keys, 11);
  EXPECT_EQ(m.blocks[a], 0u);  // the speculative credit starts at block 2: unreachable now
  EXPECT_EQ(m.blocks[b], 3u);
  EXPECT_EQ(ix.SpeculativeEntries(), 2u);  // kept until expiry
  // AllBlocksCleared through Apply.
  ix.Apply(b, ClearedEv(), &cb);
  EXPECT_EQ(cb.clears, 1u);
  EXPECT_EQ(ix.WorkerBlocks(b), 0u);
  EXPECT_EQ(ix.Entries(), 0u);
  // RemoveWorker: speculative credits go too; events for it are ignored; ids not reused.
  ix.Apply(a, StoredEv({1}, std::nullopt, Range(0, 16)), &ca);
  ix.RemoveWorker(a);
  EXPECT_EQ(ix.SpeculativeEntries(), 0u);
  EXPECT_EQ(ix.WorkerBlocks(a), 0u);
  EXPECT_EQ(ix.Entries(), 0u);
  ix.Apply(a, StoredEv({9}, std::nullopt, Range(0, 16)), &ca);
  EXPECT_EQ(ix.Entries(), 0u);
  EXPECT_TRUE(ix.WorkerEntries(a).empty());
  ix.RemoveWorker(a);       // twice: no-op
  ix.RemoveWorker(12345);   // unknown: no-op
  ix.ClearWorker(12345);
  const WorkerId c = ix.AddWorker();
  EXPECT_EQ(c, 2u);
  EXPECT_EQ(ix.WorkerIdLimit(), 3u);
  m = Match(ix, keys);
  EXPECT_EQ(m.blocks.size(), 3u);
}

TEST(Index, speculative) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker();
  const auto keys = Keys(Range(0, 80));  // 5 blocks
  ApplyCounts c;
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32)), &c);
  ix.AddSpeculative(b, keys.data(), 3, 10.0, 2.0);      // b: blocks 0..2 until t=12
  ix.AddSpeculative(a, keys.data() + 2, 3, 10.0, 2.0);  // a: blocks 2..4 on top of real 0..1
  EXPECT_EQ(ix.SpeculativeEntries(), 6u);
  auto m = Match(ix, keys, 11.0);
  EXPECT_EQ(m.blocks[a], 5u);
  EXPECT_EQ(m.blocks[b], 3u);
  EXPECT_TRUE(m.weighted[b] == 3.0);
  EXPECT_EQ(m.max_blocks, 5u);
  // A prompt that diverges after block 1 matches only the common part of b's run.
  auto div = Range(0, 80);
  div[40] = 99999;
  m = Match(ix, Keys(div), 11.0);
  EXPECT_EQ(m.blocks[b], 2u);
  // now < 0: the latest clock value seen (10) is used.
  EXPECT_EQ(Match(ix, keys).blocks[b], 3u);
  // Expired at now >= expiry.
  m = Match(ix, keys, 12.0);
  EXPECT_EQ(m.blocks[b], 0u);
  EXPECT_EQ(m.blocks[a], 2u);
  ix.ExpireSpeculative(12.0);
  EXPECT_EQ(ix.SpeculativeEntries(), 0u);
  // ttl <= 0 or n == 0: nothing; unknown worker: nothing.
  ix.AddSpeculative(b, keys.data(), 3, 13.0, 0.0);
  ix.AddSpeculative(b, keys.data(), 0, 13.0, 1.0);
  ix.AddSpeculative(777, keys.data(), 3, 13.0, 1.0);
  EXPECT_EQ(ix.SpeculativeEntries(), 0u);
  // A real store of the same blocks keeps matching after the credit expires.
  ix.AddSpeculative(b, keys.data(), 1, 14.0, 1.0);
  ix.Apply(b, StoredEv({7}, std::nullopt, Range(0, 16)), &c);
  EXPECT_EQ(Match(ix, keys, 14.5).blocks[b], 1u);
  EXPECT_EQ(Match(ix, keys, 20.0).blocks[b], 1u);
  EXPECT_TRUE(ix.MemoryBytes() > 0);
  // Two credits of one worker from the same block: the longer one counts, whichever comes first.
  Index iy(IndexOptions{});
  const WorkerId x = iy.AddWorker();
  iy.AddSpeculative(x, keys.data(), 2, 1.0, 10.0);
  iy.AddSpeculative(x, keys.data(), 5, 1.0, 10.0);
  iy.AddSpeculative(x, keys.data(), 3, 1.0, 10.0);
  m = Match(iy, keys, 2.0);
  EXPECT_EQ(m.blocks[x], 5u);
  EXPECT_TRUE(m.weighted[x] == 5.0);
  // ... until it expires.
  iy.AddSpeculative(x, keys.data(), 4, 3.0, 0.5);  // expires at 3.5, the others at 11
  EXPECT_EQ(Match(iy, keys, 3.2).blocks[x], 5u);
  EXPECT_EQ(Match(iy, keys, 11.5).blocks[x], 0u);

  // The cap on live credited blocks: the oldest credits go first, counted; a longer credit
  // keeps its first blocks; 0 = none.
  IndexOptions capped;
  capped.max_speculative_blocks = 6;
  Index iz(capped);
  const WorkerId p = iz.AddWorker(), q = iz.AddWorker();
  const auto many = Keys(Range(0, 16 * 20));
  iz.AddSpeculative(p, many.data(), 3, 1.0, 10.0);       // p: 0..2
  iz.AddSpeculative(q, many.data() + 5, 3, 1.0, 10.0);   // q: 5..7
  EXPECT_EQ(iz.SpeculativeEntries(), 6u);
  iz.AddSpeculative(q, many.data() + 10, 2, 1.0, 10.0);  // p's credit leaves
  EXPECT_EQ(iz.SpeculativeEntries(), 5u);
  EXPECT_EQ(iz.SpeculativeDropped(), 1u);
  EXPECT_EQ(Match(iz, many, 2.0).blocks[p], 0u);
  iz.AddSpeculative(p, many.data(), 9, 1.0, 10.0);  // longer than the cap: 0..5, alone
  EXPECT_EQ(iz.SpeculativeEntries(), 6u);
  EXPECT_EQ(iz.SpeculativeDropped(), 3u);
  auto mz = Match(iz, many, 2.0);
  EXPECT_EQ(mz.blocks[p], 6u);
  EXPECT_EQ(mz.blocks[q], 0u);
  IndexOptions uncapped;
  uncapped.max_speculative_blocks = 0;
  Index iu(uncapped);
  const WorkerId u = iu.AddWorker();
  for (int k = 0; k < 10; ++k) iu.AddSpeculative(u, many.data(), 20, 1.0, 10.0);
  EXPECT_EQ(iu.SpeculativeEntries(), 200u);
  EXPECT_EQ(iu.SpeculativeDropped(), 0u);
}

// Past a credit, the walk goes on at the nearest credit's end (no worker is at depth i in
// between): real blocks and credits that start exactly where a credit ends still count, and
// the blocks in between do not.
TEST(Index, walk_jumps_to_the_nearest_credit_end) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker(), c = ix.AddWorker(), d = ix.AddWorker();
  const WorkerId e = ix.AddWorker();
  const auto keys = Keys(Range(0, 16 * 30));  // 30 blocks
  auto hashes = [](uint64_t first, size_t n) {
    std::vector<uint64_t> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = first + i;
    return h;
  };
  auto remove = [&](WorkerId w, uint64_t first, size_t n) {
    Event rm;
    rm.type = EventType::kBlockRemoved;
    for (size_t i = 0; i < n; ++i) rm.block_hashes.push_back(IntHash(first + i));
    ApplyCounts cnt;
    ix.Apply(w, rm, &cnt);
  };
  ApplyCounts cnt;
  ix.Apply(a, StoredEv(hashes(100, 10), std::nullopt, Range(0, 16 * 10)), &cnt);  // a: 0..9
  // b: real 0..3 and 12..15 (4..11 removed), credited 4..11.
  ix.Apply(b, StoredEv(hashes(200, 16), std::nullopt, Range(0, 16 * 16)), &cnt);
  remove(b, 204, 8);
  ix.AddSpeculative(b, keys.data() + 4, 8, 1.0, 5.0);
  // c: real 0..3 and 6..9 (4, 5 removed), credited 4..5: its real blocks go on at the credit's
  // end, inside b's credit.
  ix.Apply(c, StoredEv(hashes(300, 10), std::nullopt, Range(0, 16 * 10)), &cnt);
  remove(c, 304, 2);
  ix.AddSpeculative(c, keys.data() + 4, 2, 1.0, 5.0);
  // d: real 0..3, credited 4..7 and, by a later decision, 8..19.
  ix.Apply(d, StoredEv(hashes(400, 4), std::nullopt, Range(0, 16 * 4)), &cnt);
  ix.AddSpeculative(d, keys.data() + 4, 4, 1.0, 5.0);
  ix.AddSpeculative(d, keys.data() + 8, 12, 1.0, 5.0);
  // e: no real block; credited 0..29, to the prompt's end.
  ix.AddSpeculative(e, keys.data(), 30, 1.0, 5.0);
  auto m = Match(ix, keys, 2.0);
  EXPECT_EQ(m.blocks[a], 10u);
  EXPECT_EQ(m.blocks[b], 16u);
  EXPECT_TRUE(m.weighted[b] == 16.0);
  EXPECT_EQ(m.blocks[c], 10u);
  EXPECT_EQ(m.blocks[d], 20u);
  EXPECT_EQ(m.blocks[e], 30u);
  EXPECT_EQ(m.max_blocks, 30u);
  // A worker's blocks inside another's credit, past its own holes, do not count.
  ix.Apply(a, StoredEv(hashes(150, 4), std::optional<uint64_t>(109), Range(16 * 10, 16 * 4)),
           &cnt);  // a: 10..13 (a real run 0..13)
  remove(a, 105, 1);  // hole at 5: a stops at 5 although it holds 6..13
  m = Match(ix, keys, 2.0);
  EXPECT_EQ(m.blocks[a], 5u);
  EXPECT_EQ(m.blocks[b], 16u);
  EXPECT_EQ(m.blocks[c], 10u);

  // A credit that ends inside a run of blocks the credited worker holds: the run goes on
  // without a credit lookup at every block, but it is closed where the credit ends, and the
  // worker joins it there. x and y hold 0..9 with y's hole at 2; y is credited 2..4.
  Index iy(IndexOptions{});
  const WorkerId x = iy.AddWorker(), y = iy.AddWorker();
  ApplyCounts c2;
  iy.Apply(x, StoredEv(hashes(100, 10), std::nullopt, Range(0, 16 * 10)), &c2);
  iy.Apply(y, StoredEv(hashes(200, 10), std::nullopt, Range(0, 16 * 10)), &c2);
  Event rm;
  rm.type = EventType::kBlockRemoved;
  rm.block_hashes.push_back(IntHash(202));
  iy.Apply(y, rm, &c2);
  iy.AddSpeculative(y, keys.data() + 2, 3, 1.0, 5.0);
  m = Match(iy, keys, 2.0);
  EXPECT_EQ(m.blocks[x], 10u);
  EXPECT_EQ(m.blocks[y], 10u);  // 0..1 real, 2..4 credited, 5..9 real (the run of x and y)
  EXPECT_TRUE(m.weighted[y] == 10.0);
  // Its credit expired: y stops at its hole.
  EXPECT_EQ(Match(iy, keys, 6.0).blocks[y], 2u);
  // More credit ends in one walk than the walk keeps: 17 workers credited from block 0, to
  // block 4 and to blocks 11..26, then y's to 5 (the 18th end, past the 4th): runs are closed
  // at every block up to the deepest credit, the same match.
  iy.AddSpeculative(y, keys.data() + 2, 3, 7.0, 5.0);
  std::vector<WorkerId> many;
  for (uint32_t k = 0; k < 17; ++k) {
    many.push_back(iy.AddWorker());
    iy.AddSpeculative(many.back(), keys.data(), k == 0 ? 4 : k + 10, 7.0, 5.0);
  }
  m = Match(iy, keys, 8.0);
  EXPECT_EQ(m.blocks[x], 10u);
  EXPECT_EQ(m.blocks[y], 10u);
  EXPECT_TRUE(m.weighted[y] == 10.0);
  for (uint32_t k = 0; k < 17; ++k) EXPECT_EQ(m.blocks[many[k]], k == 0 ? 4u : k + 10);
}

// The walk against the per-block definition (tests/test_match_model.py's, at sizes it does not
// reach): 24 workers, prompts of up to 80 blocks that share prefixes, chains stored on random
// tiers with holes, and up to 96 credits (in some walks more ends than the walk keeps), some
// expired. Per worker: at block i, a worker holding it advances by one (credit: GPU, else the
// better of CPU and disk); else its longest unexpired credit whose first key is block i's
// advances it by the common prefix with the prompt (GPU); else it stops.
TEST(Index, walk_equals_per_block_definition_randomized) {
  std::mt19937_64 rng(2026);
  constexpr size_t kBs = 4;
  constexpr WorkerId kWorkers = 24;
  const double tier_w[3] = {1.0, 0.8, 0.25};
  // Prompts: a base of 80 blocks and variants that leave it at a random block.
  std::vector<uint32_t> base;
  for (size_t b = 0; b < 80; ++b) {
    for (size_t j = 0; j < kBs; ++j) base.push_back(static_cast<uint32_t>(1000 * (b + 1) + j));
  }
  auto variant = [&]() {
    std::vector<uint32_t> t(base.begin(), base.begin() + kBs * (rng() % 80 + 1));
    if (rng() % 3 != 0) {
      const size_t from = rng() % (t.size() / kBs);
      const uint32_t salt = static_cast<uint32_t>(rng() % 4 + 1);
      for (size_t k = from * kBs; k < t.size(); ++k) t[k] += 100000 * salt;
    }
    return t;
  };
  size_t credited_walks = 0, walks_past_kept_ends = 0;  // the cases the test must reach
  for (int round = 0; round < 40; ++round) {
    IndexOptions o;
    o.block_size = kBs;
    Index ix(o);
    for (WorkerId w = 0; w < kWorkers; ++w) ix.AddWorker();
    uint64_t next_hash = 1;
    ApplyCounts cnt;
    for (int s = 0; s < 60; ++s) {
      const WorkerId w = static_cast<WorkerId>(rng() % kWorkers);
      const auto toks = variant();
      const size_t nb = toks.size() / kBs;
      std::vector<uint64_t> hs(nb);
      for (auto& h : hs) h = next_hash++;
      const Medium tier = static_cast<Medium>(rng() % 3);
      ix.Apply(w, StoredEv(hs, std::nullopt, toks, kBs, tier), &cnt);
      if (rng() % 2) {  // a hole
        const uint64_t h = hs[rng() % nb];
        ix.Apply(w, RemovedEv({h}, tier), &cnt);
      }
    }
    // What each worker holds, by key: the mask of tiers with references.
    std::map<std::pair<WorkerId, BlockKey>, int> held;
    for (WorkerId w = 0; w < kWorkers; ++w) {
      for (const auto& e : ix.WorkerEntries(w)) {
        int mask = 0;
        for (int t = 0; t < 3; ++t) mask |= e.refs[t] > 0 ? 1 << t : 0;
        if (mask != 0) held[{w, e.key}] |= mask;
      }
    }
    struct Credit {
      WorkerId w;
      std::vector<BlockKey> keys;
      double expiry;
    };
    std::vector<Credit> credits;
    // The definition: blocks and weight w matches of `keys` at time `now`; `applied` counts
    // the credits that moved it.
    auto reference = [&](WorkerId w, const std::vector<BlockKey>& keys, double now,
                         size_t* applied) {
      size_t i = 0;
      double wt = 0;
      while (i < keys.size()) {
        auto h = held.find({w, keys[i]});
        if (h != held.end()) {
          const int m = h->second;
          wt += (m & 1) ? tier_w[0]
                        : std::max((m & 2) ? tier_w[1] : 0.0, (m & 4) ? tier_w[2] : 0.0);
          ++i;
          continue;
        }
        size_t best = 0;
        for (const Credit& c : credits) {
          if (c.w != w || c.expiry <= now || c.keys[0] != keys[i]) continue;
          size_t m = 0;
          while (m < c.keys.size() && i + m < keys.size() && c.keys[m] == keys[i + m]) ++m;
          best = std::max(best, m);
        }
        if (best == 0) break;
        i += best;
        wt += static_cast<double>(best);
        ++*applied;
      }
      return std::make_pair(i, wt);
    };
    // Credits as the router gives them (a prompt's blocks from the chosen worker's match on),
    // and a third from a random block.
    const int ncredits = static_cast<int>(rng() % 97);
    for (int c = 0; c < ncredits; ++c) {
      const auto keys = Keys(rng() % 2 ? base : variant(), kBs);
      const WorkerId w = static_cast<WorkerId>(rng() % kWorkers);
      size_t from = rng() % keys.size();
      if (rng() % 3 != 0) {
        size_t unused = 0;
        from = reference(w, keys, 1.0, &unused).first;
        if (from == keys.size()) continue;
      }
      const size_t len = 1 + rng() % (keys.size() - from);
      const double ttl = rng() % 4 == 0 ? 0.5 : 5.0;  // 0.5: expired at the probes' clock
      ix.AddSpeculative(w, keys.data() + from, len, 1.0, ttl);
      credits.push_back({w, std::vector<BlockKey>(keys.begin() + from, keys.begin() + from + len),
                         1.0 + ttl});
    }
    for (int probe = 0; probe < 8; ++probe) {
      const auto keys = Keys(probe == 0 ? base : variant(), kBs);
      const MatchResult got = Match(ix, keys, 2.0);
      size_t applied = 0;  // credits that moved a worker in this walk
      for (WorkerId w = 0; w < kWorkers; ++w) {
        const auto [blocks, wt] = reference(w, keys, 2.0, &applied);
        EXPECT_EQ(got.blocks[w], blocks);
        EXPECT_TRUE(std::abs(got.weighted[w] - wt) < 1e-9);
      }
      credited_walks += applied > 0 ? 1 : 0;
      walks_past_kept_ends += applied > 16 ? 1 : 0;
    }
  }
  EXPECT_TRUE(credited_walks > 50);
  EXPECT_TRUE(walks_past_kept_ends > 0);
}

// The walk hashes lazily (BlockKeyStream): a walk over a stream equals the walk over all keys
// computed first (real entries with holes and tier changes, speculative credits longer than the
// look-ahead, prompts past the end of the match, a partial last block).
TEST(Index, walk_over_a_key_stream_equals_walk_over_keys) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker(), b = ix.AddWorker(), c = ix.AddWorker();
  const auto toks = Range(0, 16 * 300 + 7);
  const auto keys = Keys(toks);
  auto hashes = [](uint64_t first, size_t n) {
    std::vector<uint64_t> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = first + i;
    return h;
  };
  ApplyCounts cnt;
  ix.Apply(a, StoredEv(hashes(1000, 200), std::nullopt, Range(0, 16 * 200)), &cnt);
  ix.Apply(b, StoredEv(hashes(2000, 40), std::nullopt, Range(0, 16 * 40)), &cnt);
  ix.Apply(c, StoredEv(hashes(3000, 90), std::nullopt, Range(0, 16 * 90), 16, Medium::kCpu),
           &cnt);
  // a hole in a's blocks: a matches 0..119 only
  Event rm;
  rm.type = EventType::kBlockRemoved;
  rm.block_hashes.push_back(IntHash(1000 + 120));
  ix.Apply(a, rm, &cnt);
  ix.AddSpeculative(b, keys.data() + 40, 150, 1.0, 5.0);  // b: 40..189 ahead of its real blocks
  ix.AddSpeculative(c, keys.data() + 90, 3, 1.0, 5.0);
  for (size_t cut : {size_t{0}, size_t{1}, size_t{33}, size_t{100}, size_t{250}, keys.size()}) {
    MatchResult want, got;
    ix.FindMatches(keys.data(), cut, &want, 2.0);
    std::vector<BlockKey> buf;
    BlockKeyStream st(ChainRoot(""), toks.data(), cut * 16, 16, nullptr, &buf);
    ix.FindMatches(&st, &got, 2.0);
    EXPECT_TRUE(want.blocks == got.blocks);
    EXPECT_TRUE(want.weighted == got.weighted);
    EXPECT_EQ(want.max_blocks, got.max_blocks);
    for (size_t i = 0; i < st.ready(); ++i) EXPECT_EQ(buf[i], keys[i]);
    // The walk stops hashing soon after the deepest match (look-ahead of 32 blocks + a step).
    if (cut >= 250) {
      EXPECT_EQ(got.blocks[a], 120u);  // real 0..119 (block 120 removed)
      EXPECT_EQ(got.blocks[b], 190u);  // real 0..39, then its credit 40..189
      EXPECT_EQ(got.blocks[c], 93u);   // real 0..89 on CPU, then its credit 90..92
      EXPECT_TRUE(std::abs(got.weighted[c] - (90 * 0.8 + 3.0)) < 1e-9);
      EXPECT_TRUE(st.ready() < 190 + 48);
    }
  }
}

// vLLM names a LoRA adapter in lora_name and as the first extra key of every block
// (to_event_extra_keys); the block keys leave that entry out, so a request for the adapter
// (root ChainRoot(name), its own extra keys only) matches. SGLang's salt-only extra keys and a
// name that is not the adapter's stay in.
TEST(Index, vllm_lora_name_in_extra_keys_is_left_out) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  const auto toks = Range(0, 48);
  Event e = StoredEv({1, 2, 3}, std::nullopt, toks);
  e.lora_name = "sql";
  e.extra_keys = {Enc(A({S("sql"), S("tenant")})), Enc(A({S("sql")})),
                  Enc(A({S("sql"), A({S("img"), I(-4)})}))};
  ix.Apply(a, e, &c);
  const std::vector<std::string> want = {Enc(A({S("tenant")})), "", Enc(A({A({S("img"), I(-4)})}))};
  EXPECT_EQ(Match(ix, Keys(toks, 16, "sql", &want)).blocks[a], 3u);
  EXPECT_EQ(Match(ix, Keys(toks, 16, "", &want)).blocks[a], 0u);
  // A first extra key that is not the adapter's name is kept.
  Event other = StoredEv({4}, std::nullopt, Range(100, 16));
  other.lora_name = "sql";
  other.extra_keys = {Enc(A({S("tenant")}))};
  ix.Apply(a, other, &c);
  const std::vector<std::string> salt = {Enc(A({S("tenant")}))};
  EXPECT_EQ(Match(ix, Keys(Range(100, 16), 16, "sql", &salt)).blocks[a], 1u);
}

TEST(Index, mla_and_sink_kinds_are_full_attention_unknown_kinds_dropped) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  const char* kinds[] = {"full_attention", "mla_attention", "sink_full_attention"};
  for (uint32_t k = 0; k < 3; ++k) {
    Event e = StoredEv({10 + k}, std::nullopt, Range(1000 * k, 16));
    e.kv_cache_spec_kind = kinds[k];
    ix.Apply(a, e, &c);
    EXPECT_EQ(Match(ix, Keys(Range(1000 * k, 16))).blocks[a], 1u) << kinds[k];
  }
  for (const char* kind : {"sliding_window", "mamba", "chunked_local_attention", "future_kind"}) {
    Event e = StoredEv({20}, std::nullopt, Range(5000, 16));
    e.kv_cache_spec_kind = kind;
    ix.Apply(a, e, &c);
    EXPECT_EQ(Match(ix, Keys(Range(5000, 16))).blocks[a], 0u) << kind;
  }
  EXPECT_EQ(c.drops.Get(DropReason::kUnsupportedSpec), 4u);
  EXPECT_EQ(ix.WorkerBlocks(a), 3u);
}

// A hybrid model publishes the same block hashes in each KV-cache group, told apart by
// group_idx; only the full-attention groups are indexed, and a remove in another group (known
// from its stores' spec kind) leaves the full-attention entry. Either group order.
TEST(Index, hybrid_other_group_removes_leave_full_attention) {
  for (const int64_t full : {0, 1}) {
    Index ix(IndexOptions{});
    const WorkerId a = ix.AddWorker();
    ApplyCounts c;
    const auto toks = Range(0, 64);
    Event fa = StoredEv({1, 2, 3, 4}, std::nullopt, toks);
    fa.group_idx = full;
    fa.kv_cache_spec_kind = "full_attention";
    Event sw = fa;
    sw.group_idx = 1 - full;
    sw.kv_cache_spec_kind = "sliding_window";
    sw.has_sliding_window = true;
    sw.sliding_window = 32;
    ix.Apply(a, fa, &c);
    ix.Apply(a, sw, &c);
    Event rm = RemovedEv({1, 2, 3, 4});
    rm.group_idx = 1 - full;
    ix.Apply(a, rm, &c);
    EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 4u);
    EXPECT_EQ(c.unknown_removes, 0u);
    EXPECT_EQ(c.drops.Get(DropReason::kUnsupportedSpec), 2u);  // the group's store and remove
    Event rm_fa = RemovedEv({3, 4});
    rm_fa.group_idx = full;
    ix.Apply(a, rm_fa, &c);
    EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 2u);
    // The group stays known across a clear (a property of the model).
    ix.Apply(a, ClearedEv(), &c);
    ix.Apply(a, fa, &c);
    ix.Apply(a, rm, &c);
    EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 4u);
  }
}

// vLLM's kv_cache_report_mode "full" re-sends a prefix hit as a store from token 0 of blocks
// the worker holds: no reference is added, so one remove per block evicts it. A run from token
// 0 with a block not yet held (or held on another tier) adds references as before.
TEST(Index, rereported_run_adds_no_reference) {
  Index ix(IndexOptions{});
  const WorkerId a = ix.AddWorker();
  ApplyCounts c;
  const auto toks = Range(0, 48);
  ix.Apply(a, StoredEv({1, 2, 3}, std::nullopt, toks), &c);
  ix.Apply(a, StoredEv({1, 2, 3}, std::nullopt, toks), &c);
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32)), &c);
  EXPECT_EQ(c.blocks_rereported, 5u);
  EXPECT_EQ(c.blocks_stored, 3u);
  ix.Apply(a, RemovedEv({3}), &c);
  EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 2u);
  ix.Apply(a, RemovedEv({1, 2}), &c);
  EXPECT_EQ(ix.WorkerBlocks(a), 0u);
  EXPECT_EQ(c.unknown_removes, 0u);
  // Not a re-report: block 2 is new, so block 1 gets a second reference.
  ix.Apply(a, StoredEv({1}, std::nullopt, Range(0, 16)), &c);
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32)), &c);
  ix.Apply(a, RemovedEv({1}), &c);
  EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 2u);
  // Another tier of a held run: a new reference on that tier.
  ix.Apply(a, StoredEv({1, 2}, std::nullopt, Range(0, 32), 16, Medium::kCpu), &c);
  ix.Apply(a, RemovedEv({1, 2}, Medium::kGpu), &c);
  EXPECT_EQ(Match(ix, Keys(toks)).blocks[a], 2u);
}

}  // namespace
