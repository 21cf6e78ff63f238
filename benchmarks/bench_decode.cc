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
// Build against the Release core of the editable install (scripts/setup.sh):
//   g++ -O2 -std=c++17 -Icpp benchmarks/bench_decode.cc \
//       build/cp311-cp311-linux_x86_64/libkvroute_core.a -lxxhash -lzmq -o /tmp/bench_decode
//   /tmp/bench_decode [/tmp/mtbench.u32]
#include <chrono>
#include <cstdint>
#include <cstdio>
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

}  // namespace

int main(int argc, char** argv) {
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
