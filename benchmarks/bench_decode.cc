// Decoder throughput on token ids of two kinds: ns per token and per block of DecodeBatch
// (cpp/events/decoder.cc), best of 7 passes over 2,000 vLLM BlockStored batches (array era,
// one event of 64 blocks of 16 tokens each, msgpack written by msgpack-c's packer as vLLM's
// msgspec writes it: the smallest integer form per id).
//
//   uniform  ids uniform over Qwen3's 151,643 (the Mooncake pseudo-tokens of the replay and
//            of compare_dynamo.py): uint16 and uint32 forms at random, a form change on half
//            the tokens
//   file     ids from a file of little-endian uint32 (repeated to fill), e.g. real text:
//              python -c "import json,numpy as np; from tokenizers import Tokenizer; \
//                t=Tokenizer.from_file('../shared/data/tokenizers/qwen3/tokenizer.json'); \
//                ids=[i for l in open('../shared/data/mt_bench_question.jsonl') \
//                     for q in json.loads(l)['turns'] for i in t.encode(q).ids]; \
//                np.array(ids,dtype='<u4').tofile('/tmp/mtbench.u32')"
//
// --per-byte [RUNS]: instead, DecodeBatch's cost per payload byte on ~1 MiB payloads that are
// valid, invalid and adversarial (cases in PerByteCases below): best and median of RUNS runs
// (default 7), each run decoding the payload 3 times (16 MiB: once) into a reused batch.
//
// Build against the Release core of the editable install (scripts/setup.sh), or of a worktree
// (cmake --preset release; build/release/libkvroute_core.a):
//   g++ -O2 -std=c++17 -Icpp benchmarks/bench_decode.cc \
//       build/cp311-cp311-linux_x86_64/libkvroute_core.a -lxxhash -lzmq -o /tmp/bench_decode
//   /tmp/bench_decode [/tmp/mtbench.u32]
//   /tmp/bench_decode --per-byte [RUNS]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <msgpack.hpp>
#include <random>
#include <string>
#include <vector>

#include "events/decoder.h"

namespace {

std::vector<std::string> Batches(const std::vector<uint32_t>& ids, size_t count) {
  constexpr size_t kBlocks = 64, kBlockSize = 16;
  std::vector<std::string> out;
  size_t next = 0;
  for (size_t b = 0; b < count; ++b) {
    msgpack::sbuffer buf;
    msgpack::packer<msgpack::sbuffer> pk(buf);
    pk.pack_array(2);
    pk.pack_double(1.0);
    pk.pack_array(1);
    pk.pack_array(5);  // ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size]
    pk.pack(std::string("BlockStored"));
    pk.pack_array(kBlocks);
    for (size_t k = 0; k < kBlocks; ++k) pk.pack_uint64(0x9E3779B97F4A7C15ull * (b * kBlocks + k + 1));
    pk.pack_nil();
    pk.pack_array(kBlocks * kBlockSize);
    for (size_t k = 0; k < kBlocks * kBlockSize; ++k) pk.pack_uint32(ids[next++ % ids.size()]);
    pk.pack_uint32(kBlockSize);
    out.emplace_back(buf.data(), buf.size());
  }
  return out;
}

void Run(const char* name, const std::vector<uint32_t>& ids) {
  const auto batches = Batches(ids, 2000);
  size_t changes = 0;
  auto form = [](uint32_t v) { return v < 128 ? 0 : v < 256 ? 1 : v < 65536 ? 2 : 3; };
  for (size_t i = 1; i < ids.size(); ++i) changes += form(ids[i]) != form(ids[i - 1]);
  kvroute::DecodeLimits lim;
  kvroute::EventBatch out;
  kvroute::DropCounts drops;
  double best = 1e30;
  size_t tokens = 0, blocks = 0;
  for (int pass = 0; pass < 7; ++pass) {
    tokens = blocks = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& p : batches) {
      if (!kvroute::DecodeBatch(p.data(), p.size(), lim, &out, &drops)) std::abort();
      for (const auto& e : out.events) {
        tokens += e.token_ids.size();
        blocks += e.block_hashes.size();
      }
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("| %-8s | %5.1f %% | %6.2f | %6.1f |\n", name,
              100.0 * static_cast<double>(changes) / static_cast<double>(ids.size()),
              best * 1e9 / static_cast<double>(tokens), best * 1e9 / static_cast<double>(blocks));
}

// -- per byte --------------------------------------------------------------------------------

using Packer = msgpack::packer<msgpack::sbuffer>;
constexpr size_t kMiB = 1u << 20;

void Stored(Packer& pk, std::mt19937_64& rng, bool map, bool bad_last, bool extra_keys) {
  constexpr size_t kBlocks = 16, kBs = 16;
  auto hashes = [&] {
    pk.pack_array(kBlocks);
    for (size_t k = 0; k < kBlocks; ++k) pk.pack_uint64(rng());
  };
  auto tokens = [&] {
    pk.pack_array(kBlocks * kBs);
    for (size_t k = 0; k < kBlocks * kBs; ++k) {
      if (bad_last && k + 1 == kBlocks * kBs) {
        pk.pack_int32(-1);
      } else {
        pk.pack_uint32(static_cast<uint32_t>(rng() % 151643));
      }
    }
  };
  if (map) {
    pk.pack_map(extra_keys ? 6 : 5);
    pk.pack(std::string("type")); pk.pack(std::string("BlockStored"));
    pk.pack(std::string("block_hashes")); hashes();
    pk.pack(std::string("parent_block_hash")); pk.pack_nil();
    pk.pack(std::string("token_ids")); tokens();
    pk.pack(std::string("block_size")); pk.pack_uint32(kBs);
  } else {
    pk.pack_array(extra_keys ? 9 : 7);
    pk.pack(std::string("BlockStored"));
    hashes();
    pk.pack_nil();
    tokens();
    pk.pack_uint32(kBs);
    pk.pack_nil();
    pk.pack(std::string("GPU"));
    if (extra_keys) pk.pack_nil();
  }
  if (extra_keys) {  // real extra keys: the reference decoder reads the event
    if (map) pk.pack(std::string("extra_keys"));
    pk.pack_array(kBlocks);
    for (size_t k = 0; k < kBlocks; ++k) {
      pk.pack_array(2);
      pk.pack(std::string("mm"));
      pk.pack_uint64(k);
    }
  }
}

// A batch [ts, events] of about `size` bytes: `event` called n times, writing `per_call`
// events each time.
template <typename F>
std::string Batch(size_t size, size_t call_bytes, size_t per_call, F event) {
  const size_t n = std::max<size_t>(1, size / call_bytes);
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_array(2);
  pk.pack_double(1.0);
  pk.pack_array(static_cast<uint32_t>(n * per_call));
  for (size_t i = 0; i < n; ++i) event(pk, i);
  return std::string(buf.data(), buf.size());
}

template <typename F>
size_t EventBytes(F event) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  event(pk, 0);
  return buf.size();
}

struct Case {
  const char* name;
  const char* what;
  std::string payload;
};

std::vector<Case> PerByteCases() {
  std::vector<Case> out;
  // ~1 MiB, less a little: a payload of one-byte events stays within the reference
  // decoder's tree budget (2^20 elements), as in production below 2 MiB.
  auto add = [&](const char* name, const char* what, auto event, size_t per_call = 1) {
    const size_t one = EventBytes(event);
    out.push_back({name, what, Batch(kMiB - 64, one, per_call, event)});
  };
  std::mt19937_64 rng(7);
  add("valid", "BlockStored 16 blocks x 16 ids (array era): fast path",
      [&](Packer& pk, size_t) { Stored(pk, rng, false, false, false); });
  add("valid_map", "the same events as tagged maps (map era): fast path",
      [&](Packer& pk, size_t) { Stored(pk, rng, true, false, false); });
  add("valid_extra_keys", "array events with extra keys per block: the reference decoder",
      [&](Packer& pk, size_t) { Stored(pk, rng, false, false, true); });
  add("late_invalid", "each event's last token id negative (dropped after its bytes are read)",
      [&](Packer& pk, size_t) { Stored(pk, rng, false, true, false); });
  add("invalid", "~1M one-byte events (positive fixint), each dropped as wrong_type",
      [&](Packer& pk, size_t) { pk.pack_uint32(1); });
  add("mixed", "one valid event, then 64 one-byte invalid ones, repeated",
      [&](Packer& pk, size_t) {
        Stored(pk, rng, false, false, false);
        for (int k = 0; k < 64; ++k) pk.pack_uint32(1);
      },
      65);
  add("unknown_tags", "[\"BlockEvicted\", [h]] events: unknown tag, counted and skipped",
      [&](Packer& pk, size_t) {
        pk.pack_array(2);
        pk.pack(std::string("BlockEvicted"));
        pk.pack_array(1);
        pk.pack_uint64(rng());
      });
  add("deep", "events nested 28 arrays deep, each dropped as wrong_type (depth limit 32)",
      [&](Packer& pk, size_t) {
        for (int d = 0; d < 28; ++d) pk.pack_array(1);
        pk.pack_nil();
      });
  add("big_unknown_field", "BlockRemoved with a 64 KiB string in an unknown map key",
      [&](Packer& pk, size_t) {
        pk.pack_map(3);
        pk.pack(std::string("type")); pk.pack(std::string("BlockRemoved"));
        pk.pack(std::string("block_hashes")); pk.pack_array(1); pk.pack_uint64(rng());
        pk.pack(std::string("ownership")); pk.pack(std::string(64 << 10, 'x'));
      });
  add("bin_hashes", "BlockRemoved of 64 bin32 (sha256) hashes each: XXH3 per hash",
      [&](Packer& pk, size_t) {
        pk.pack_array(2);
        pk.pack(std::string("BlockRemoved"));
        pk.pack_array(64);
        for (int k = 0; k < 64; ++k) {
          char h[32];
          for (char& c : h) c = static_cast<char>(rng());
          pk.pack_bin(32);
          pk.pack_bin_body(h, 32);
        }
      });
  // The batch is one array32 header of one-byte events: past the reference's tree budget.
  {
    const size_t n = 16 * kMiB - 16;
    std::string p = "\x92\xcb";
    p.append(8, '\0');
    p.push_back('\xdd');
    for (int i = 3; i >= 0; --i) p.push_back(static_cast<char>(n >> (8 * i)));
    p.append(n, '\x01');
    out.push_back({"invalid_16m", "as invalid, 16 MiB: past the tree budget, dropped unread",
                   std::move(p)});
  }
  return out;
}

int PerByte(int runs) {
  const auto cases = PerByteCases();
  std::printf("| payload | bytes | events kept | drops | ns / byte best | median | what |\n"
              "|---|---|---|---|---|---|---|\n");
  kvroute::DecodeLimits lim;
  kvroute::EventBatch out;
  for (const Case& c : cases) {
    const int reps = c.payload.size() > 4 * kMiB ? 1 : 3;
    std::vector<double> ns;
    uint64_t drops_total = 0;
    for (int r = 0; r < runs; ++r) {
      kvroute::DropCounts drops;
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < reps; ++k) {
        kvroute::DecodeBatch(c.payload.data(), c.payload.size(), lim, &out, &drops);
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ns.push_back(s * 1e9 / static_cast<double>(reps * c.payload.size()));
      drops_total = 0;
      for (uint64_t d : drops.n) drops_total += d;
      drops_total /= static_cast<uint64_t>(reps);
    }
    std::sort(ns.begin(), ns.end());
    std::printf("| %s | %zu | %zu | %llu | %.2f | %.2f | %s |\n", c.name, c.payload.size(),
                out.events.size(), static_cast<unsigned long long>(drops_total), ns.front(),
                ns[ns.size() / 2], c.what);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--per-byte") == 0) {
    return PerByte(argc > 2 ? std::max(1, std::atoi(argv[2])) : 7);
  }
  std::printf("| ids      | form changes | ns / token | ns / block |\n|---|---|---|---|\n");
  std::mt19937_64 rng(1);
  std::vector<uint32_t> uniform(1 << 20);
  for (auto& v : uniform) v = static_cast<uint32_t>(rng() % 151643);
  Run("uniform", uniform);
  if (argc > 1) {
    std::ifstream f(argv[1], std::ios::binary);
    std::vector<uint32_t> ids;
    uint32_t v;
    while (f.read(reinterpret_cast<char*>(&v), 4)) ids.push_back(v);
    if (ids.empty()) {
      std::fprintf(stderr, "no ids in %s\n", argv[1]);
      return 1;
    }
    Run("file", ids);
  }
  return 0;
}
