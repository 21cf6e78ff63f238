// Helpers shared by the native tests (cpp/tests/*_test.cc, GoogleTest): a msgpack value builder
// for KV-event payloads in the engines' wire format (shared/docs/kv-events.md), the vLLM
// array-era event and batch shapes, block keys of a token list, and ZeroMQ publisher helpers.
#pragma once

#include <msgpack.hpp>
#include <zmq.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/block_key.h"
#include "common/types.h"

namespace kvroute_test {

using kvroute::BlockKey;
using kvroute::EngineHash;

// Seconds on the steady clock.
inline double Secs() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Polls `pred` every 2 ms until it holds or `timeout_s` passes.
inline bool WaitFor(const std::function<bool()>& pred, double timeout_s) {
  const double end = Secs() + timeout_s;
  while (Secs() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

// ---- msgpack value builder --------------------------------------------------------------------

struct V {
  enum Kind { kNil, kUint, kInt, kFloat, kStr, kBin, kBool, kArr, kMap } k = kNil;
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<V> a;
  std::vector<std::pair<V, V>> m;
};
inline V Nil() { return V{}; }
inline V U(uint64_t x) { V v; v.k = V::kUint; v.u = x; return v; }
inline V I(int64_t x) { V v; v.k = V::kInt; v.i = x; return v; }
inline V F(double x) { V v; v.k = V::kFloat; v.f = x; return v; }
inline V S(std::string x) { V v; v.k = V::kStr; v.s = std::move(x); return v; }
inline V Bin(std::string x) { V v; v.k = V::kBin; v.s = std::move(x); return v; }
inline V Bool(bool b) { V v; v.k = V::kBool; v.u = b; return v; }
inline V A(std::vector<V> xs) { V v; v.k = V::kArr; v.a = std::move(xs); return v; }
inline V M(std::vector<std::pair<V, V>> xs) { V v; v.k = V::kMap; v.m = std::move(xs); return v; }
inline V Toks(const std::vector<uint32_t>& t) {
  std::vector<V> xs;
  for (uint32_t x : t) xs.push_back(U(x));
  return A(std::move(xs));
}
inline V Hs(const std::vector<uint64_t>& hs) {
  std::vector<V> xs;
  for (uint64_t h : hs) xs.push_back(U(h));
  return A(std::move(xs));
}

inline void Pack(msgpack::packer<msgpack::sbuffer>& pk, const V& v) {
  switch (v.k) {
    case V::kNil: pk.pack_nil(); break;
    case V::kUint: pk.pack_uint64(v.u); break;
    case V::kInt: pk.pack_int64(v.i); break;
    case V::kFloat: pk.pack_double(v.f); break;
    case V::kStr: pk.pack_str(static_cast<uint32_t>(v.s.size())); pk.pack_str_body(v.s.data(), static_cast<uint32_t>(v.s.size())); break;
    case V::kBin: pk.pack_bin(static_cast<uint32_t>(v.s.size())); pk.pack_bin_body(v.s.data(), static_cast<uint32_t>(v.s.size())); break;
    case V::kBool: v.u ? pk.pack_true() : pk.pack_false(); break;
    case V::kArr:
      pk.pack_array(static_cast<uint32_t>(v.a.size()));
      for (const V& x : v.a) Pack(pk, x);
      break;
    case V::kMap:
      pk.pack_map(static_cast<uint32_t>(v.m.size()));
      for (const auto& [k, x] : v.m) {
        Pack(pk, k);
        Pack(pk, x);
      }
      break;
  }
}
inline std::string Enc(const V& v) {
  msgpack::sbuffer sb;
  msgpack::packer<msgpack::sbuffer> pk(sb);
  Pack(pk, v);
  return std::string(sb.data(), sb.size());
}

// Token ids from, from + 1, ..., from + n - 1.
inline std::vector<uint32_t> Range(uint32_t from, uint32_t n) {
  std::vector<uint32_t> t(n);
  for (uint32_t i = 0; i < n; ++i) t[i] = from + i;
  return t;
}

// vLLM array-era BlockStored (#19737: 7 elements).
inline V StoredArr(const std::vector<uint64_t>& hashes, std::optional<uint64_t> parent,
                   const std::vector<uint32_t>& toks, int64_t bs, const char* medium = "GPU") {
  return A({S("BlockStored"), Hs(hashes), parent ? U(*parent) : Nil(), Toks(toks), I(bs), Nil(),
            medium ? S(medium) : Nil()});
}
// vLLM array-era BlockRemoved and AllBlocksCleared.
inline V RemovedArr(const std::vector<uint64_t>& hashes, const char* medium = "GPU") {
  return A({S("BlockRemoved"), Hs(hashes), medium ? S(medium) : Nil()});
}
inline V ClearedArr() { return A({S("AllBlocksCleared")}); }
// vLLM batch [ts, events, data_parallel_rank] (rank nil when absent).
inline V Batch(std::vector<V> events, std::optional<int64_t> rank = 0, double ts = 1.5) {
  return A({F(ts), A(std::move(events)), rank ? I(*rank) : Nil()});
}

// The engine hash of an integer block hash (vLLM's uint64, SGLang's int64 reinterpreted).
inline EngineHash IntHash(uint64_t v) { return EngineHash{0, v}; }

// The block keys of `toks` in blocks of `bs` tokens (full blocks only), chained from the
// root of `lora`, with per-block extra keys when given.
inline std::vector<BlockKey> Keys(const std::vector<uint32_t>& toks, size_t bs = 16,
                                  std::string_view lora = {},
                                  const std::vector<std::string>* extras = nullptr) {
  std::vector<BlockKey> k;
  kvroute::ComputeBlockKeys(kvroute::ChainRoot(lora), toks.data(), toks.size(), bs, extras, &k);
  return k;
}

// ---- ZeroMQ -------------------------------------------------------------------------------------

// Binds `pub` to a free loopback TCP port (port 0) and returns its endpoint.
inline std::string BindPub(zmq::socket_t& pub) {
  pub.set(zmq::sockopt::linger, 0);
  pub.bind("tcp://127.0.0.1:*");
  return pub.get(zmq::sockopt::last_endpoint);
}
// Sends `frames` as one multipart message.
inline void SendFrames(zmq::socket_t& s, const std::vector<std::string>& frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    s.send(zmq::buffer(frames[i]),
           i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
}
// A sequence number as the engines' 8-byte big-endian frame.
inline std::string Seq8(uint64_t s) {
  std::string b(8, '\0');
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(s >> (56 - 8 * i));
  return b;
}

}  // namespace kvroute_test
