// Structure-aware libFuzzer target: the fuzz input is not a payload but the choices of a
// generator that writes msgpack event batches as engines do (docs/kv-events.md §3-§5):
//   batch  : [ts, events] | [ts, events, rank] | [ts, events, nil] | {"ts","events",
//            "data_parallel_rank"} in any key order, extra trailing positions
//   events : tagged arrays of any arity (vLLM array era), tagged maps in any key order (vLLM
//            map era, SGLang map era), SGLang arrays with the metadata map at position 7;
//            BlockStored / BlockRemoved / AllBlocksCleared, unknown tags, non-events
//   hashes : uint64 in every msgpack int width, negative int64 (SGLang), bin16, bin32, bins of
//            other lengths; token ids in every width (minimal and not)
// Near-valid batches come from a small rate of deliberate faults (a field of the wrong type,
// a token id out of range, a miscounted container, a cut, a flipped byte, trailing bytes).
// Batches reach any size up to the target's payload limit (4 KiB to 1 MiB, picked per input;
// a few bytes past it to check the limit): a short input picks a few event templates and a
// repeat count, so a 30-byte input can describe a 1 MiB batch of one-byte invalid events.
//
// Checks, per input: DecodeBatch (into a batch that held events before, as an ingestion
// thread's does) equals DecodeBatchReference (fresh) on the result, the drop counts and every
// field, except where the reference's tree budget is documented to refuse a batch the fast
// path reads; a batch with no fault decodes to exactly the events generated (kind, hashes,
// parent, tokens, block size, medium, LoRA name, group) with one drop per generated unknown
// tag or non-event and none else; a batch past the payload limit is dropped as oversized;
// then ApplyAndCheck (fuzz_check.h) on the index. Built by scripts/fuzz.sh; every crash
// reproduces from its artifact alone:  ./fuzz_structured crash-<sha1>
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "events/decoder.h"
#include "fuzz/fuzz_check.h"

using namespace kvroute;
using namespace kvroute::fuzz;

namespace {

// msgpack writer. Integers, strings, arrays and maps in a chosen width: the minimal one
// (what msgspec writes) or any wider one that holds the value (also valid msgpack).
struct Writer {
  std::string b;
  void Byte(uint8_t x) { b.push_back(static_cast<char>(x)); }
  void Be(uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) Byte(static_cast<uint8_t>(v >> (8 * i)));
  }
  // widen: 0 = minimal, k > 0 = k steps wider where possible
  void UInt(uint64_t v, int widen = 0) {
    int w = v < 128 ? 0 : v < 256 ? 1 : v < 65536 ? 2 : v < (1ull << 32) ? 3 : 4;
    w = std::min(4, w + widen);
    switch (w) {
      case 0: Byte(static_cast<uint8_t>(v)); break;
      case 1: Byte(0xcc); Be(v, 1); break;
      case 2: Byte(0xcd); Be(v, 2); break;
      case 3: Byte(0xce); Be(v, 4); break;
      default: Byte(0xcf); Be(v, 8); break;
    }
  }
  void Int(int64_t v, int widen = 0) {
    if (v >= 0) return UInt(static_cast<uint64_t>(v), widen);
    int w = v >= -32 ? 0 : v >= -128 ? 1 : v >= -32768 ? 2 : v >= -2147483648LL ? 3 : 4;
    w = std::min(4, w + widen);
    const uint64_t u = static_cast<uint64_t>(v);
    switch (w) {
      case 0: Byte(static_cast<uint8_t>(u)); break;
      case 1: Byte(0xd0); Be(u, 1); break;
      case 2: Byte(0xd1); Be(u, 2); break;
      case 3: Byte(0xd2); Be(u, 4); break;
      default: Byte(0xd3); Be(u, 8); break;
    }
  }
  void Nil() { Byte(0xc0); }
  void F64(double d) {
    uint64_t u;
    std::memcpy(&u, &d, 8);
    Byte(0xcb);
    Be(u, 8);
  }
  void Header(uint64_t n, uint8_t fix, uint8_t fix_max, uint8_t c8, uint8_t c16, uint8_t c32,
              int widen) {
    int w = n <= fix_max ? 0 : n < 256 && c8 ? 1 : n < 65536 ? 2 : 3;
    w = std::min(3, w + widen);
    if (w == 1 && !c8) w = 2;
    switch (w) {
      case 0: Byte(static_cast<uint8_t>(fix | n)); break;
      case 1: Byte(c8); Be(n, 1); break;
      case 2: Byte(c16); Be(n, 2); break;
      default: Byte(c32); Be(n, 4); break;
    }
  }
  void Arr(uint64_t n, int widen = 0) { Header(n, 0x90, 15, 0, 0xdc, 0xdd, widen); }
  void Map(uint64_t n, int widen = 0) { Header(n, 0x80, 15, 0, 0xde, 0xdf, widen); }
  void Str(const std::string& s, int widen = 0) {
    Header(s.size(), 0xa0, 31, 0xd9, 0xda, 0xdb, widen);
    b += s;
  }
  void Bin(const std::string& s) {
    Header(s.size(), 0, 0, 0xc4, 0xc5, 0xc6, 1);
    b += s;
  }
};

const char* const kMedia[] = {"GPU", "CPU", "CPU_TIER1", "CPU_TIER2", "STORAGE", "cuda",
                              "LocalCPUBackend", "\xff\xfe"};
const char* const kTags[] = {"BlockStored", "BlockRemoved", "AllBlocksCleared"};

// What the generator expects of one event.
enum class Expect : uint8_t { kKept, kDropped };

struct Want {
  Expect expect = Expect::kKept;
  EventType type = EventType::kAllBlocksCleared;
  std::vector<EngineHash> hashes;  // checked where `hashes_known`
  bool hashes_known = true;
  size_t n_hashes = 0;
  bool has_parent = false;
  EngineHash parent;
  bool parent_known = true;
  std::vector<uint32_t> tokens;
  int64_t block_size = 0;
  bool has_medium = false;
  std::string medium;
  std::string lora_name;  // array era position 7 or map key (not SGLang)
  int64_t group_idx = 0;
};

class Gen {
 public:
  explicit Gen(FuzzedDataProvider* in) : in_(in) {}

  bool Fault() {  // a deliberate fault, about 1 in 64 choices when faults are on
    if (!faults_on_) return false;
    if (in_->ConsumeIntegral<uint8_t>() >= 4) return false;
    faulted_ = true;
    return true;
  }
  bool faulted() const { return faulted_; }
  void set_faults(bool on) { faults_on_ = on; }
  FuzzedDataProvider& in() { return *in_; }

  // One engine hash in the event's form; its normalised EngineHash in *h when known.
  void Hash(Writer* w, int form, EngineHash* h, bool* known) {
    const uint64_t v = in_->ConsumeIntegral<uint64_t>();
    switch (form) {
      case 0:  // vLLM: unsigned 64-bit, any width that holds it
        w->UInt(v, in_->ConsumeIntegral<uint8_t>() % 3);
        *h = EngineHash{0, v};
        break;
      case 1: {  // SGLang / builtin hash: signed 64-bit
        const int64_t s = static_cast<int64_t>(v);
        w->Int(s);
        *h = EngineHash{0, static_cast<uint64_t>(s)};
        break;
      }
      case 2: {  // bin16: exact, tag bit
        std::string s(16, '\0');
        for (int i = 0; i < 16; ++i) s[i] = static_cast<char>(in_->ConsumeIntegral<uint8_t>());
        w->Bin(s);
        uint64_t hi = 0, lo = 0;
        for (int i = 0; i < 8; ++i) hi = (hi << 8) | static_cast<uint8_t>(s[i]);
        for (int i = 8; i < 16; ++i) lo = (lo << 8) | static_cast<uint8_t>(s[i]);
        *h = EngineHash{hi | (1ull << 63), lo};
        break;
      }
      default: {  // bin32 (sha256) or another length: XXH3-128, not recomputed here
        const size_t n = form == 3 ? 32 : in_->ConsumeIntegralInRange<size_t>(1, 40);  // empty: wrong type
        std::string s(n, '\0');
        for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(v >> (8 * (i % 8)) ^ i);
        w->Bin(s);
        *known = false;
        break;
      }
    }
  }

  // A hash written as the shifted value: keep the expectation in step.
  void HashExact(Writer* w, int form, EngineHash* h, bool* known) {
    if (form != 0) return Hash(w, form, h, known);
    const uint64_t v = in_->ConsumeIntegral<uint64_t>() >> (in_->ConsumeIntegral<uint8_t>() % 64);
    w->UInt(v, in_->ConsumeIntegral<uint8_t>() % 3);
    *h = EngineHash{0, v};
  }

  void WrongValue(Writer* w) {  // a value of some type a field may not take
    switch (in_->ConsumeIntegral<uint8_t>() % 6) {
      case 0: w->Str("x"); break;
      case 1: w->F64(1.5); break;
      case 2: w->Map(0); break;
      case 3: w->Byte(0xc3); break;  // true
      case 4: w->Byte(0xd4); w->Byte(1); w->Byte(0); break;  // fixext1
      default: w->Arr(1); w->Str("y"); break;
    }
  }

  // BlockStored / BlockRemoved / AllBlocksCleared in one of three encodings.
  void Event(Writer* w, Want* want) {
    const uint8_t k = in_->ConsumeIntegral<uint8_t>();
    if (k >= 250) {  // not an event, or an unknown tag: one drop
      want->expect = Expect::kDropped;
      switch (k) {
        case 250: w->UInt(k & 1); break;
        case 251: w->Nil(); break;
        case 252: w->Arr(0); break;
        case 253: w->Arr(2); w->Str("BlockEvicted"); w->Arr(0); break;
        case 254: w->Map(1); w->Str("type"); w->Str("Ownership"); break;
        default: w->Map(1); w->Str("block_hashes"); w->Arr(0); break;  // no "type"
      }
      return;
    }
    const EventType type = static_cast<EventType>(k % 3);
    want->type = type;
    const int enc = (k / 3) % 3;  // 0 array, 1 map, 2 SGLang array (metadata at 7)
    const int form = in_->ConsumeIntegral<uint8_t>() % 5;
    // fields, encoded separately, then laid out by the encoding
    struct F {
      const char* name;
      std::string bytes;
    };
    std::vector<F> fields;
    auto add = [&](const char* name, Writer&& fw) { fields.push_back({name, std::move(fw.b)}); };

    if (type == EventType::kAllBlocksCleared) {
      // no fields
    } else {
      // block_hashes
      const uint8_t nb_class = in_->ConsumeIntegral<uint8_t>();
      size_t nb = nb_class % 5;
      if (nb_class >= 240) nb = in_->ConsumeIntegralInRange<size_t>(0, 300);
      want->n_hashes = nb;
      Writer hw;
      const bool miscount = Fault();
      hw.Arr(nb + (miscount ? 1 : 0), in_->ConsumeIntegral<uint8_t>() % 3 == 0);
      for (size_t i = 0; i < nb; ++i) {
        EngineHash h;
        bool known = true;
        if (Fault()) {
          WrongValue(&hw);
        } else {
          HashExact(&hw, form, &h, &known);
        }
        want->hashes.push_back(h);
        if (!known) want->hashes_known = false;
      }
      add("block_hashes", std::move(hw));
      if (type == EventType::kBlockStored) {
        Writer pw;
        if (in_->ConsumeBool()) {
          pw.Nil();
        } else {
          want->has_parent = true;
          if (Fault()) {
            WrongValue(&pw);
          } else {
            HashExact(&pw, form, &want->parent, &want->parent_known);
          }
        }
        add("parent_block_hash", std::move(pw));
        // token_ids: block_size per block (a fault may miscount: that is an apply-time drop)
        static const int64_t kSizes[] = {16, 16, 64, 1, 2, 4, 32, 0};
        int64_t bs = kSizes[in_->ConsumeIntegral<uint8_t>() % 8];
        want->block_size = bs;
        size_t nt = nb * static_cast<size_t>(bs);
        if (in_->ConsumeIntegral<uint8_t>() == 0) nt = in_->ConsumeIntegralInRange<size_t>(0, 64);
        const uint8_t tok_mode = in_->ConsumeIntegral<uint8_t>();
        Writer tw;
        tw.Arr(nt);
        uint64_t seed = in_->ConsumeIntegral<uint64_t>() | 1;
        for (size_t i = 0; i < nt; ++i) {
          seed ^= seed << 13;
          seed ^= seed >> 7;
          seed ^= seed << 17;
          uint32_t t;
          switch (tok_mode % 4) {
            case 0: t = static_cast<uint32_t>(seed % 151936); break;  // uniform over a vocabulary
            case 1: t = 1000 + static_cast<uint32_t>(seed % 3000); break;  // text in one script
            case 2: t = static_cast<uint32_t>(seed); break;  // any uint32
            default: t = static_cast<uint32_t>(seed % 128); break;  // fixints
          }
          if (i + 1 == nt && Fault()) {  // out of range: negative or >= 2^32
            if (seed & 1) tw.Int(-1 - static_cast<int64_t>(seed % 1000)); else tw.UInt((1ull << 32) + t);
          } else {
            tw.UInt(t, (tok_mode >> 4) % 5 == 0 ? static_cast<int>(seed >> 60) % 3 : 0);
          }
          want->tokens.push_back(t);
        }
        add("token_ids", std::move(tw));
        Writer bw;
        if (Fault()) WrongValue(&bw); else bw.Int(bs);
        add("block_size", std::move(bw));
        Writer lw;
        lw.Nil();
        add("lora_id", std::move(lw));
      }
      // medium
      Writer mw;
      const uint8_t m = in_->ConsumeIntegral<uint8_t>() % 10;
      if (m >= 8) {
        mw.Nil();
      } else {
        want->has_medium = true;
        want->medium = kMedia[m];
        mw.Str(want->medium, m & 1);
      }
      add("medium", std::move(mw));
      if (type == EventType::kBlockStored) {
        Writer nw;
        if (enc == 2) {  // SGLang metadata map
          nw.Map(1);
          nw.Str("cache_salt");
          nw.Str("salt");
        } else if (in_->ConsumeBool()) {
          want->lora_name = "adapter-" + std::to_string(in_->ConsumeIntegral<uint8_t>());
          nw.Str(want->lora_name);
        } else {
          nw.Nil();
        }
        add(enc == 2 ? "metadata" : "lora_name", std::move(nw));
        Writer ew;
        if (in_->ConsumeBool() || nb == 0) {
          ew.Nil();
        } else {
          ew.Arr(nb);
          for (size_t i = 0; i < nb; ++i) {
            if (in_->ConsumeBool()) {
              ew.Nil();
            } else {
              ew.Arr(2);
              ew.Str("mm");
              ew.UInt(i);
            }
          }
        }
        add("extra_keys", std::move(ew));
      }
      Writer gw;
      want->group_idx = in_->ConsumeIntegral<uint8_t>() % 3;
      gw.Int(want->group_idx);
      add("group_idx", std::move(gw));
      if (type == EventType::kBlockStored) {
        Writer sk;
        sk.Str("full_attention");
        add("kv_cache_spec_kind", std::move(sk));
        Writer sw;
        sw.Nil();
        add("kv_cache_spec_sliding_window", std::move(sw));
      }
    }

    if (enc == 1) {
      // tagged map: fields in any order, "type" anywhere, an unknown key sometimes
      const size_t keep = fields.size() - in_->ConsumeIntegralInRange<size_t>(0, fields.size());
      std::vector<F> kept;
      for (size_t i = 0; i < fields.size(); ++i) {
        // absent fields take their defaults: only the trailing optional ones go
        if (i < keep || i < 4) kept.push_back(std::move(fields[i]));
      }
      if (kept.size() < fields.size()) DefaultsFrom(kept.size(), type, want);
      const bool unknown_key = in_->ConsumeBool();
      const size_t n = kept.size() + 1 + (unknown_key ? 1 : 0);
      const size_t type_at = in_->ConsumeIntegralInRange<size_t>(0, kept.size());
      // a few shuffles
      for (int s = 0, ns = in_->ConsumeIntegral<uint8_t>() % 4; s < ns && kept.size() > 1; ++s) {
        std::swap(kept[in_->ConsumeIntegralInRange<size_t>(0, kept.size() - 1)],
                  kept[in_->ConsumeIntegralInRange<size_t>(0, kept.size() - 1)]);
      }
      w->Map(n);
      for (size_t i = 0; i <= kept.size(); ++i) {
        if (i == type_at) {
          w->Str("type");
          w->Str(kTags[static_cast<int>(type)]);
        }
        if (i < kept.size()) {
          w->Str(kept[i].name);
          w->b += kept[i].bytes;
        }
      }
      if (unknown_key) {
        w->Str("ownership");
        w->Arr(1);
        w->Nil();
      }
    } else {
      // tagged array: trailing fields omitted (their defaults), or extra positions
      size_t arity = fields.size();
      const uint8_t a = in_->ConsumeIntegral<uint8_t>();
      if (a < 64 && arity > 4) arity = 4 + a % (arity - 4);
      if (enc == 2 && arity < 7 && fields.size() >= 7) arity = 7;  // SGLang: metadata present
      if (arity < fields.size()) DefaultsFrom(arity, type, want);
      const size_t extra = a >= 240 ? a % 3 + 1 : 0;
      w->Arr(1 + arity + extra, a % 7 == 0);
      w->Str(kTags[static_cast<int>(type)]);
      for (size_t i = 0; i < arity; ++i) w->b += fields[i].bytes;
      for (size_t i = 0; i < extra; ++i) w->Nil();
    }
  }

 private:
  // Fields from position `from` (0-based among the fields) take their defaults.
  static void DefaultsFrom(size_t from, EventType type, Want* want) {
    if (type == EventType::kBlockStored) {
      // 0 hashes, 1 parent, 2 tokens, 3 block_size, 4 lora_id, 5 medium, 6 lora_name,
      // 7 extra_keys, 8 group_idx, ...
      if (from <= 5) {
        want->has_medium = false;
        want->medium.clear();
      }
      if (from <= 6) want->lora_name.clear();
      if (from <= 8) want->group_idx = 0;
    } else if (type == EventType::kBlockRemoved) {
      // 0 hashes, 1 medium, 2 group_idx
      if (from <= 1) {
        want->has_medium = false;
        want->medium.clear();
      }
      if (from <= 2) want->group_idx = 0;
    }
  }

  FuzzedDataProvider* in_;
  bool faults_on_ = false;
  bool faulted_ = false;
};

void CheckAgainstWant(const kvroute::Event& e, const Want& w) {
  FUZZ_ASSERT(e.type == w.type);
  if (w.type == EventType::kAllBlocksCleared) return;
  FUZZ_ASSERT(e.block_hashes.size() == w.n_hashes);
  if (w.hashes_known) {
    for (size_t i = 0; i < w.n_hashes; ++i) FUZZ_ASSERT(e.block_hashes[i] == w.hashes[i]);
  } else {
    for (size_t i = 0; i < w.n_hashes; ++i) FUZZ_ASSERT(!e.block_hashes[i].IsInt());
  }
  FUZZ_ASSERT(e.has_medium == w.has_medium);
  FUZZ_ASSERT(e.medium == w.medium);
  FUZZ_ASSERT(e.group_idx == w.group_idx);
  if (w.type == EventType::kBlockRemoved) return;
  FUZZ_ASSERT(e.has_parent == w.has_parent);
  if (w.has_parent && w.parent_known) FUZZ_ASSERT(e.parent_block_hash == w.parent);
  FUZZ_ASSERT(e.token_ids.size() == w.tokens.size());
  FUZZ_ASSERT(std::equal(w.tokens.begin(), w.tokens.end(), e.token_ids.begin()));
  FUZZ_ASSERT(e.block_size == w.block_size);
  FUZZ_ASSERT(e.lora_name == w.lora_name);
}

// A batch that held events before: DecodeBatch must reuse its buffers cleanly (an ingestion
// thread decodes every payload into one batch). Per input, so that libFuzzer's leak check
// sees every allocation freed.
void Prefill(EventBatch* b) {
  Writer w;
  w.Arr(3);
  w.F64(1.0);
  w.Arr(2);
  for (int e = 0; e < 2; ++e) {
    w.Arr(5);
    w.Str("BlockStored");
    w.Arr(3);
    for (int i = 0; i < 3; ++i) w.UInt(1000 + 10 * e + i);
    w.Nil();
    w.Arr(48);
    for (int i = 0; i < 48; ++i) w.UInt(70000 + i);
    w.UInt(16);
  }
  w.UInt(0);
  DropCounts d;
  FUZZ_ASSERT(DecodeBatch(w.b.data(), w.b.size(), DecodeLimits{}, b, &d));
  FUZZ_ASSERT(b->events.size() == 2 && Drops(d) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Gen gen(&in);

  // Limits: a payload limit of 4 KiB, 64 KiB or 1 MiB (the decoder is one code path at any
  // size; the default 64 MiB would only slow each execution down); the reference's tree
  // budget either low (2^10 elements: a batch denser than one element per 2 bytes is refused
  // by the reference only, from 2 KiB up) or out of reach.
  static const size_t kLimits[] = {4096, 4096, 4096, 4096, 65536, 65536, 65536, 1u << 20};
  const uint8_t lim_pick = in.ConsumeIntegral<uint8_t>();
  DecodeLimits limits;
  limits.max_payload_bytes = kLimits[lim_pick % 8];
  const bool tree_budget = (lim_pick & 8) != 0;
  limits.min_tree_elements = tree_budget ? 1024 : limits.max_payload_bytes;
  gen.set_faults((lim_pick & 16) != 0);
  // Target size: most inputs small; one in four up to the limit (and sometimes just past).
  const uint8_t size_pick = in.ConsumeIntegral<uint8_t>();
  size_t target = 0;
  if (size_pick >= 252) {
    target = in.ConsumeIntegralInRange<size_t>(0, limits.max_payload_bytes);
    if (size_pick == 255) target = limits.max_payload_bytes + in.ConsumeIntegralInRange<size_t>(0, 64);
  } else if (size_pick >= 224) {
    target = in.ConsumeIntegralInRange<size_t>(0, 4096);
  }

  // Event templates, then a layout: each template once, then the templates again in turn
  // until the target size is reached.
  const size_t n_templates = in.ConsumeIntegralInRange<size_t>(0, 12);
  std::vector<std::string> tpl(n_templates);
  std::vector<Want> wants(n_templates);
  for (size_t i = 0; i < n_templates; ++i) {
    Writer w;
    gen.Event(&w, &wants[i]);
    tpl[i] = std::move(w.b);
  }
  size_t tpl_bytes = 0;
  for (const auto& t : tpl) tpl_bytes += t.size();
  size_t rounds = 1;
  if (target > tpl_bytes && tpl_bytes > 0) rounds = target / tpl_bytes;
  const size_t n_events = n_templates * rounds;

  // The batch.
  Writer w;
  const uint8_t form = in.ConsumeIntegral<uint8_t>() % 6;
  const double ts = 1.7e9 + in.ConsumeIntegral<uint16_t>();
  const bool miscount = gen.Fault();  // events header one more than follows (or one less)
  const size_t header_n = miscount ? (n_events > 0 && (lim_pick & 32) ? n_events - 1 : n_events + 1)
                                   : n_events;
  // form 0 [ts, events]; 1 [ts, events, rank]; 2 [ts, events, nil]; 3 [int ts, events, nil];
  // 4 {"ts", "data_parallel_rank", "events"} with ts first or second; 5 [ts, events, rank, str]
  if (form != 4) {
    w.Arr(form == 0 ? 2 : form == 5 ? 4 : 3);
    if (gen.Fault()) gen.WrongValue(&w); else if (form == 3) w.UInt(1700000000); else w.F64(ts);
    w.Arr(header_n, in.ConsumeIntegral<uint8_t>() % 4 == 0);
  } else {
    // "events" last so that the layout below closes the map
    w.Map(3);
    const bool ts_first = in.ConsumeBool();
    if (ts_first) { w.Str("ts"); w.F64(ts); }
    w.Str("data_parallel_rank");
    w.UInt(0);
    if (!ts_first) { w.Str("ts"); w.F64(ts); }
    w.Str("events");
    w.Arr(header_n);
  }
  for (size_t r = 0; r < rounds; ++r) {
    for (const auto& t : tpl) w.b += t;
  }
  if (form == 1 || form == 5) w.UInt(in.ConsumeIntegral<uint8_t>() % 4);  // rank
  if (form == 2 || form == 3) w.Nil();
  if (form == 5) w.Str("future");
  // Byte faults on the finished payload: a cut, a flipped byte, trailing bytes.
  if (!w.b.empty() && gen.Fault()) w.b.resize(in.ConsumeIntegralInRange<size_t>(0, w.b.size() - 1));
  if (!w.b.empty() && gen.Fault()) {
    w.b[in.ConsumeIntegralInRange<size_t>(0, w.b.size() - 1)] ^=
        static_cast<char>(1 + in.ConsumeIntegral<uint8_t>() % 255);
  }
  if (gen.Fault()) w.b += in.ConsumeBytesAsString(4);
  const std::string& payload = w.b;

  // KVROUTE_FUZZ_DEBUG=1: the payload in hex on stderr (to read an artifact).
  static const bool debug = std::getenv("KVROUTE_FUZZ_DEBUG") != nullptr;
  if (debug) {
    std::fprintf(stderr, "payload %zu bytes, limit %zu, faults %d, templates %zu x %zu rounds:",
                 payload.size(), limits.max_payload_bytes, gen.faulted(), n_templates, rounds);
    for (size_t i = 0; i < payload.size() && i < 512; ++i) {
      std::fprintf(stderr, " %02x", static_cast<uint8_t>(payload[i]));
    }
    std::fprintf(stderr, "\n");
  }
  // Decode both ways.
  EventBatch g_batch;
  Prefill(&g_batch);
  DropCounts drops, ref_drops;
  EventBatch ref;
  const bool ok = DecodeBatch(payload.data(), payload.size(), limits, &g_batch, &drops);
  const bool ref_ok = DecodeBatchReference(payload.data(), payload.size(), limits, &ref, &ref_drops);
  // Past the tree budget the reference refuses (oversized) a batch the fast path reads.
  const bool past_budget = tree_budget && ok && !ref_ok &&
                           ref_drops.Get(DropReason::kOversized) == 1 && Drops(ref_drops) == 1;
  if (!past_budget) {
    FUZZ_ASSERT(ok == ref_ok);
    FUZZ_ASSERT(drops.n == ref_drops.n);
    FUZZ_ASSERT(SameBatch(g_batch, ref));
  }
  if (debug) {
    std::fprintf(stderr, "ok %d ref_ok %d, %zu events, drops:", ok, ref_ok, g_batch.events.size());
    for (int i = 0; i < kNumDropReasons; ++i) {
      if (drops.n[i] > 0) {
        std::fprintf(stderr, " %s=%llu", DropReasonName(static_cast<DropReason>(i)),
                     static_cast<unsigned long long>(drops.n[i]));
      }
    }
    std::fprintf(stderr, "\n");
  }
  if (payload.size() > limits.max_payload_bytes) {
    FUZZ_ASSERT(!ok);
    FUZZ_ASSERT(drops.Get(DropReason::kOversized) == 1);
  }
  if (!ok) {
    FUZZ_ASSERT(g_batch.events.empty());
    FUZZ_ASSERT(Drops(drops) == 1);
    return 0;
  }

  // A batch with no fault, within the limit, decodes to what was generated.
  if (!gen.faulted() && !past_budget) {
    size_t kept = 0, dropped = 0;
    for (const Want& x : wants) {
      if (x.expect == Expect::kKept) ++kept;
      if (x.expect == Expect::kDropped) ++dropped;
    }
    FUZZ_ASSERT(g_batch.events.size() == kept * rounds);
    FUZZ_ASSERT(Drops(drops) == dropped * rounds);
    // the first two rounds, event by event
    size_t j = 0;
    for (size_t r = 0; r < rounds && r < 2; ++r) {
      for (const Want& x : wants) {
        if (x.expect == Expect::kKept) CheckAgainstWant(g_batch.events[j++], x);
      }
    }
    FUZZ_ASSERT(g_batch.has_dp_rank == (form == 1 || form == 4 || form == 5));
  }

  ApplyAndCheck(g_batch, lim_pick >> 6);
  return 0;
}
