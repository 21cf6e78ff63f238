// Tests of the index's data structures (cpp/index/): its hash table (RobinTable), holder sets
// and the mapping cache of its allocator, partly against reference models.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <array>
#include <cstdint>
#include <map>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

#include "index/holder_set.h"
#include "index/huge_page_allocator.h"
#include "index/robin_table.h"
#include "tests/test_util.h"

using namespace kvroute;
using namespace kvroute_test;

namespace {

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
      if (shape == 1) h = (h % 5) << 61 | (h & 7);   // 5 homes, long clusters
      if (shape == 2) h = ~uint64_t{0} - (h >> 50);  // all at the very top: the tail grows
      if (shape == 3) h = (k % 2) ? ~uint64_t{0} - (h >> 52) : (h >> 52);  // both ends
      keys.push_back({k, h});
      t.FindOrInsert(
          h, [k](const ClusteredSlot& x) { return x.key == k; },
          [k, h] {
            return ClusteredSlot{k, h};
          });
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
      if (mode == 1) h = center + (rng() >> (rng() % 64));                  // bunched anywhere
      if (mode == 2) h = (rng() % 3) * (~uint64_t{0} / 3) + (rng() >> 58);  // three homes
      if (mode == 3) h = ~uint64_t{0} - (rng() >> (4 + rng() % 8));  // at the top: into the tail
      t.FindOrInsert(
          h, [k](const ClusteredSlot& x) { return x.key == k; },
          [k, h] {
            return ClusteredSlot{k, h};
          });
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
    t.FindOrInsert(
        h, [k](const ClusteredSlot& x) { return x.key == k; },
        [k, h] {
          return ClusteredSlot{k, h};
        });
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
    for (uint32_t k = 0; k < kvroute::HolderSet::kMaxRefs; ++k)
      EXPECT_TRUE(s.AddRef(pool, 7, 1, &added, &d));
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
  MappingCache::Release();                          // (earlier tests' tables)
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

}  // namespace
