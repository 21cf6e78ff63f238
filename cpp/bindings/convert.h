// Conversion glue between Python objects and the core's types (used by bindings.cc only).
// Everything here needs the GIL.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "events/decoder.h"
#include "router/router.h"

namespace kvroute {
namespace py = pybind11;

// Token ids as contiguous uint32, from what callers hand select_worker / block_keys (the
// costs: benchmarks/README.md, "The list path"):
// * a list of ints: read item by item in C; an exact int below 2^30 is read inline (on
//   CPython 3.12+ PyUnstable_Long_CompactValue, on 3.9-3.11 its one digit), any other item
//   through PyLong_AsUnsignedLongLong;
// * a numpy array: uint32, 1-D, C-contiguous is used in place (zero-copy); other integer
//   dtypes are range-checked and copied;
// * any other object with the buffer protocol (array.array('I'), memoryview, ...): 1-D; 4-byte
//   unsigned items (format 'I', or 'L' where it is 4 bytes) C-contiguous are used in place;
//   other integer formats (bBhHiIlLqQnN, native or little-endian) are range-checked and copied.
// Throws ValueError for a non-integer dtype, format or item, ndim != 1, or ids outside
// [0, 2^32). The view borrows the caller's list, array or buffer: keep it alive (and
// unchanged) while data() is read.
class TokenView {
 public:
  explicit TokenView(const py::handle& obj) {
    PyObject* o = obj.ptr();
    if (PyList_Check(o)) {
      FromList(o);
    } else if (py::isinstance<py::array>(obj)) {
      FromArray(py::reinterpret_borrow<py::array>(obj));
    } else if (PyObject_CheckBuffer(o) && !PyBytes_Check(o) && !PyByteArray_Check(o) &&
               FromBuffer(o)) {
      // read from the buffer (in place or copied)
    } else {
      FromArray(py::array::ensure(obj));
      if (!arr_) throw py::value_error("tokens must be a list of ints or an integer array");
    }
  }
  TokenView(const TokenView&) = delete;
  TokenView& operator=(const TokenView&) = delete;

 private:
  // Int objects prefetched this many items ahead: a list built over time points all over the
  // heap, and the loads of its ints are independent of each other.
  static constexpr Py_ssize_t kPrefetchAhead = 16;
  void FromList(PyObject* list) {
    const Py_ssize_t n = PyList_GET_SIZE(list);
    size_ = static_cast<size_t>(n);
    uint32_t* out = Alloc(size_);
    PyObject** items = PySequence_Fast_ITEMS(list);  // public API for lists and tuples
    Py_ssize_t i = 0;
    for (; i + 4 + kPrefetchAhead <= n; i += 4) {
      __builtin_prefetch(items[i + kPrefetchAhead]);
      __builtin_prefetch(items[i + kPrefetchAhead + 2]);
      if (!FourSmallInts(items + i, out + i)) {
        for (Py_ssize_t k = i; k < i + 4; ++k) out[k] = ListItem(items[k], k);
      }
    }
    for (; i < n; ++i) out[i] = ListItem(items[i], i);
    data_ = out;
  }
#if PY_VERSION_HEX < 0x030C0000 && PY_VERSION_HEX >= 0x03090000 && !defined(Py_LIMITED_API)
  // Four items at once when all four are exact ints of one 30-bit digit (3.9-3.11 layout, as
  // SmallInt below): the four checks combine into one branch, then each value is its
  // ob_digit[0]; a group that fails goes through the per-item path. Loads are the bound
  // (item, ob_type, ob_size, ob_digit[0]: benchmarks/README.md, "The list path").
  static bool FourSmallInts(PyObject* const* items, uint32_t* out) {
    const PyLongObject* l[4];
    bool ok = true;
    for (int k = 0; k < 4; ++k) {
      l[k] = reinterpret_cast<const PyLongObject*>(items[k]);
      ok &= (Py_TYPE(items[k]) == &PyLong_Type) & (Py_SIZE(items[k]) == 1);
    }
    if (!ok) return false;
    for (int k = 0; k < 4; ++k) out[k] = static_cast<uint32_t>(l[k]->ob_digit[0]);
    return true;
  }
#else
  static bool FourSmallInts(PyObject* const*, uint32_t*) { return false; }
#endif
  // One item: a small exact int inline; else PyLong_AsUnsignedLongLong, whose one result
  // compare covers every failure (an error returns (unsigned long long)-1), so the common
  // item costs a call and a compare (benchmarks/README.md, "The list path").
  static uint32_t ListItem(PyObject* item, Py_ssize_t i) {
    uint32_t fast;
    if (SmallInt(item, &fast)) return fast;
    const unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v <= 0xFFFFFFFFull) return static_cast<uint32_t>(v);
    BadItem(item, i);
  }
  // Why an item was refused: not an int (TypeError from CPython), negative or >= 2^64
  // (OverflowError), or >= 2^32; always a ValueError naming the position.
  [[noreturn]] __attribute__((noinline, cold)) static void BadItem(PyObject* item,
                                                                   Py_ssize_t i) {
    PyErr_Clear();
    if (!PyLong_Check(item)) {
      throw py::value_error("tokens must be integer token ids, got " +
                            std::string(Py_TYPE(item)->tp_name) + " at position " +
                            std::to_string(i));
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    Bad(static_cast<size_t>(i), overflow > 0 ? INT64_MAX : (overflow < 0 ? INT64_MIN : v));
  }
  // An exact non-negative int read without a call: CPython's compact form on 3.12+
  // (PyUnstable_Long_IsCompact / PyUnstable_Long_CompactValue), its single digit on 3.9-3.11.
  // Anything else (bool, subclasses, big or negative ints) goes through
  // PyLong_AsUnsignedLongLong.
  static bool SmallInt(PyObject* o, uint32_t* out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyLong_CheckExact(o)) return false;
    PyLongObject* l = reinterpret_cast<PyLongObject*>(o);
    if (!PyUnstable_Long_IsCompact(l)) return false;
    const Py_ssize_t v = PyUnstable_Long_CompactValue(l);
    if (v < 0 || static_cast<uint64_t>(v) > 0xFFFFFFFFull) return false;
    *out = static_cast<uint32_t>(v);
    return true;
#elif PY_VERSION_HEX >= 0x03090000 && !defined(Py_LIMITED_API)
    // 3.9-3.11: the int's digits, as CPython's own headers lay them out
    // (cpython/longintrepr.h, included by Python.h): ob_size = the signed digit count, digits
    // of PyLong_SHIFT bits, least significant first (what Cython's PyLong internals read).
    if (!PyLong_CheckExact(o)) return false;
    const PyLongObject* l = reinterpret_cast<const PyLongObject*>(o);
    const Py_ssize_t size = Py_SIZE(o);
    if (size == 1) {
      *out = static_cast<uint32_t>(l->ob_digit[0]);  // < 2^PyLong_SHIFT <= 2^30
      return true;
    }
    if (size == 0) {
      *out = 0;
      return true;
    }
    return false;
#else
    (void)o;
    (void)out;
    return false;
#endif
  }

  void FromArray(const py::array& a) {
    if (!a) return;
    arr_ = a;
    if (a.ndim() != 1) {
      throw py::value_error("tokens must be 1-D, got " + std::to_string(a.ndim()) + "-D");
    }
    const char kind = a.dtype().kind();
    const py::ssize_t n = a.shape(0);
    if (n == 0) {
      data_ = nullptr;
      size_ = 0;
      return;
    }
    if (kind != 'i' && kind != 'u') {
      throw py::value_error(std::string("tokens must be integers, got dtype kind '") + kind +
                            "'");
    }
    size_ = static_cast<size_t>(n);
    const bool contiguous = (a.flags() & py::array::c_style) != 0;
    if (kind == 'u' && a.itemsize() == 4 && contiguous) {
      data_ = static_cast<const uint32_t*>(a.data());
      return;
    }
    uint32_t* out = Alloc(size_);
    if (kind == 'u' && a.itemsize() == 8) {
      py::array_t<uint64_t, py::array::c_style | py::array::forcecast> u(a);
      const uint64_t* q = u.data();
      for (size_t i = 0; i < size_; ++i) {
        if (q[i] > 0xFFFFFFFFull) Bad(i, static_cast<int64_t>(q[i]));
        out[i] = static_cast<uint32_t>(q[i]);
      }
    } else {
      py::array_t<int64_t, py::array::c_style | py::array::forcecast> wide(a);
      const int64_t* p = wide.data();
      for (size_t i = 0; i < size_; ++i) {
        if (p[i] < 0 || p[i] > 0xFFFFFFFFll) Bad(i, p[i]);
        out[i] = static_cast<uint32_t>(p[i]);
      }
    }
    data_ = out;
  }

  // The buffer protocol (PEP 3118) for exporters other than numpy. False (no error set) if
  // the object does not export a strided buffer after all; the caller then tries numpy.
  bool FromBuffer(PyObject* o) {
    if (PyObject_GetBuffer(o, &buf_.view, PyBUF_RECORDS_RO) != 0) {
      PyErr_Clear();
      return false;
    }
    buf_.held = true;
    const Py_buffer& v = buf_.view;
    const std::string fmt = v.format != nullptr ? v.format : "B";
    if (v.ndim != 1) {
      throw py::value_error("tokens must be 1-D, got a " + std::to_string(v.ndim) +
                            "-D buffer (format '" + fmt + "')");
    }
    // One integer code, native ('@' or none) or little-endian ('=', '<') on a little-endian
    // machine; the item size is the buffer's own.
    size_t k = 0;
    if (!fmt.empty() && (fmt[0] == '@' || ((fmt[0] == '=' || fmt[0] == '<') && LittleEndian()))) {
      k = 1;
    }
    const char code = fmt.size() == k + 1 ? fmt[k] : '\0';
    const bool is_signed = code != '\0' && std::string("bhilqn").find(code) != std::string::npos;
    const bool is_unsigned = code != '\0' && std::string("BHILQN").find(code) != std::string::npos;
    const Py_ssize_t w = v.itemsize;
    if ((!is_signed && !is_unsigned) || (w != 1 && w != 2 && w != 4 && w != 8)) {
      throw py::value_error(
          "tokens in a buffer must be 1-D integers: format 'I' (or 'L') of 4-byte items, "
          "C-contiguous, is read in place; other integer formats (bBhHiIlLqQnN) are copied; "
          "got format '" + fmt + "' of " + std::to_string(w) + "-byte items");
    }
    size_ = static_cast<size_t>(v.shape[0]);
    if (size_ == 0) {
      data_ = nullptr;
      return true;
    }
    const Py_ssize_t stride = v.strides != nullptr ? v.strides[0] : w;
    if (is_unsigned && w == 4 && stride == 4) {
      data_ = static_cast<const uint32_t*>(v.buf);
      return true;
    }
    uint32_t* out = Alloc(size_);
    const char* p = static_cast<const char*>(v.buf);
    for (size_t i = 0; i < size_; ++i, p += stride) {
      int64_t x;
      if (is_unsigned) {
        uint64_t u = 0;
        switch (w) {
          case 1: u = *reinterpret_cast<const uint8_t*>(p); break;
          case 2: { uint16_t t; std::memcpy(&t, p, 2); u = t; break; }
          case 4: { uint32_t t; std::memcpy(&t, p, 4); u = t; break; }
          default: std::memcpy(&u, p, 8); break;
        }
        if (u > 0xFFFFFFFFull) Bad(i, static_cast<int64_t>(u));
        x = static_cast<int64_t>(u);
      } else {
        switch (w) {
          case 1: x = *reinterpret_cast<const int8_t*>(p); break;
          case 2: { int16_t t; std::memcpy(&t, p, 2); x = t; break; }
          case 4: { int32_t t; std::memcpy(&t, p, 4); x = t; break; }
          default: std::memcpy(&x, p, 8); break;
        }
        if (x < 0 || x > 0xFFFFFFFFll) Bad(i, x);
      }
      out[i] = static_cast<uint32_t>(x);
    }
    data_ = out;
    return true;
  }
  static bool LittleEndian() {
    const uint16_t one = 1;
    uint8_t b;
    std::memcpy(&b, &one, 1);
    return b == 1;
  }

  // The copy's storage, left uninitialised (every item is written before data() is read).
  uint32_t* Alloc(size_t n) {
    copy_.reset(new uint32_t[n]);
    return copy_.get();
  }

 public:
  const uint32_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  [[noreturn]] static void Bad(size_t i, int64_t v) {
    throw py::value_error("token ids must be in [0, 2**32), got " + std::to_string(v) +
                          " at position " + std::to_string(i));
  }
  // A Py_buffer held for the view's lifetime (released with the GIL held: the bindings
  // destroy a TokenView after their gil_scoped_release has ended).
  struct HeldBuffer {
    Py_buffer view{};
    bool held = false;
    HeldBuffer() = default;
    HeldBuffer(const HeldBuffer&) = delete;
    HeldBuffer& operator=(const HeldBuffer&) = delete;
    ~HeldBuffer() {
      if (held) PyBuffer_Release(&view);
    }
  };
  HeldBuffer buf_;
  py::array arr_;
  std::unique_ptr<uint32_t[]> copy_;
  const uint32_t* data_ = nullptr;
  size_t size_ = 0;
};

// The static string of a Decision::reason read back from a pickle.
inline const char* DecisionReason(const std::string& r) {
  for (const char* known : {"policy", "no_events", "all_degraded", "controller_down"}) {
    if (r == known) return known;
  }
  throw py::value_error("unknown decision reason '" + r + "'");
}

inline std::vector<std::string> ExtrasFrom(
    const std::optional<std::vector<std::optional<py::bytes>>>& e) {
  std::vector<std::string> out;
  if (!e) return out;
  out.reserve(e->size());
  for (const auto& x : *e) out.push_back(x ? std::string(*x) : std::string());
  return out;
}

inline py::object HashToPy(const EngineHash& h) {
  if (h.IsInt()) return py::int_(h.lo);
  char b[16];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(h.hi >> (56 - 8 * i));
  for (int i = 0; i < 8; ++i) b[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  return py::bytes(b, 16);
}

// A string field of an event as Python sees it: str when it is UTF-8, else the raw bytes
// (the wire carries msgpack str, which engines write as UTF-8; a publisher may not).
inline py::object TextOrBytes(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), nullptr);
  if (o != nullptr) return py::reinterpret_steal<py::object>(o);
  PyErr_Clear();
  return py::bytes(s);
}

inline py::dict EventToDict(const Event& e) {
  py::dict d;
  static const char* kNames[] = {"BlockStored", "BlockRemoved", "AllBlocksCleared"};
  d["type"] = kNames[static_cast<int>(e.type)];
  if (e.type == EventType::kAllBlocksCleared) return d;
  py::list hs;
  for (const auto& h : e.block_hashes) hs.append(HashToPy(h));
  d["block_hashes"] = hs;
  d["medium"] = e.has_medium ? TextOrBytes(e.medium) : py::object(py::none());
  d["tier"] = MediumName(e.tier);
  d["group_idx"] = e.group_idx;
  d["locality"] = e.locality.empty() ? py::object(py::none()) : TextOrBytes(e.locality);
  if (e.type == EventType::kBlockRemoved) return d;
  d["parent_block_hash"] = e.has_parent ? HashToPy(e.parent_block_hash) : py::object(py::none());
  d["token_ids"] = py::cast(e.token_ids);
  d["block_size"] = e.block_size;
  d["lora_id"] = e.has_lora_id ? py::object(py::int_(e.lora_id)) : py::object(py::none());
  d["lora_name"] =
      e.lora_name.empty() ? py::object(py::none()) : TextOrBytes(e.lora_name);
  if (e.extra_keys.empty()) {
    d["extra_keys"] = py::none();
  } else {
    py::list ek;
    for (const auto& x : e.extra_keys) {
      ek.append(x.empty() ? py::object(py::none()) : py::object(py::bytes(x)));
    }
    d["extra_keys"] = ek;
  }
  d["kv_cache_spec_kind"] = e.kv_cache_spec_kind.empty()
                                ? py::object(py::none())
                                : TextOrBytes(e.kv_cache_spec_kind);
  d["kv_cache_spec_sliding_window"] =
      e.has_sliding_window ? py::object(py::int_(e.sliding_window)) : py::object(py::none());
  return d;
}

inline py::dict BatchToDict(const EventBatch& b) {
  py::dict d;
  d["ts"] = b.ts;
  d["data_parallel_rank"] = b.has_dp_rank ? py::object(py::int_(b.dp_rank)) : py::object(py::none());
  py::list evs;
  for (const auto& e : b.events) evs.append(EventToDict(e));
  d["events"] = evs;
  return d;
}

inline py::dict DropsToDict(const DropCounts& c) {
  py::dict d;
  for (int i = 0; i < kNumDropReasons; ++i) {
    if (c.n[i] > 0) d[DropReasonName(static_cast<DropReason>(i))] = c.n[i];
  }
  return d;
}

// A worker's index entries in the snapshot format (python/kvroute/snapshot.py): per entry
// 24 bytes, little-endian: engine hash (u64; a byte-string hash as the index's 64-bit
// digest), block key (u64), GPU / CPU / disk reference counts (u16 each), 2 zero bytes.
constexpr size_t kEntryBytes = 24;
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the snapshot format is little-endian");
inline std::string PackEntries(const std::vector<Index::WorkerEntry>& es) {
  std::string out(es.size() * kEntryBytes, '\0');
  char* p = out.data();
  for (const auto& e : es) {
    const uint64_t h = e.hash.lo;  // WorkerEntries gives hi = 0
    std::memcpy(p, &h, 8);
    std::memcpy(p + 8, &e.key, 8);
    std::memcpy(p + 16, e.refs.data(), 6);
    p += kEntryBytes;
  }
  return out;
}
inline bool UnpackEntries(std::string_view in, std::vector<Index::WorkerEntry>* out) {
  if (in.size() % kEntryBytes != 0) return false;
  const size_t n = in.size() / kEntryBytes;
  out->resize(n);
  const char* p = in.data();
  for (size_t i = 0; i < n; ++i, p += kEntryBytes) {
    Index::WorkerEntry& e = (*out)[i];
    e.hash = EngineHash{0, 0};
    std::memcpy(&e.hash.lo, p, 8);
    std::memcpy(&e.key, p + 8, 8);
    std::memcpy(e.refs.data(), p + 16, 6);
  }
  return true;
}

inline py::dict StatsToDict(const Router& r, const std::vector<WorkerStats>& st) {
  py::dict out;
  py::dict workers;
  DropCounts total_drops;
  for (const auto& s : st) {
    py::dict w;
    w["endpoint"] = s.config.endpoint;
    w["replay_endpoint"] = s.config.replay_endpoint.empty()
                               ? py::object(py::none())
                               : py::object(py::str(s.config.replay_endpoint));
    w["state"] = TrustStateName(s.state);
    w["replays"] = s.replays;
    w["batches_recovered"] = s.batches_recovered;
    w["replay_failures"] = s.replay_failures;
    w["resets"] = s.resets;
    w["joined_late"] = s.joined_late;
    w["reconnects"] = s.reconnects;
    w["replay_queue_bytes"] = s.replay_queue_bytes;
    w["replay_queue_dropped"] = s.replay_queue_dropped;
    w["dp_rank"] = s.config.dp_rank >= 0 ? py::object(py::int_(s.config.dp_rank))
                                         : py::object(py::none());
    w["last_dp_rank"] =
        s.has_dp_rank ? py::object(py::int_(s.last_dp_rank)) : py::object(py::none());
    w["last_seq"] = s.seen_seq ? py::object(py::int_(s.last_seq)) : py::object(py::none());
    w["gaps"] = s.gaps;
    w["missing_batches"] = s.missing_batches;
    w["backward_jumps"] = s.backward_jumps;
    w["unsequenced_batches"] = s.unsequenced;
    w["batches"] = s.batches;
    w["events"] = s.apply.events;
    w["blocks_stored"] = s.apply.blocks_stored;
    w["blocks_removed"] = s.apply.blocks_removed;
    w["clears"] = s.apply.clears;
    w["orphan_stores"] = s.apply.orphan_stores;
    w["unknown_removes"] = s.apply.unknown_removes;
    w["hash_rebound"] = s.apply.hash_rebound;
    w["blocks_rereported"] = s.apply.blocks_rereported;
    w["unknown_medium"] = s.apply.unknown_medium;
    w["evicted_by_cap"] = s.evicted_by_cap;
    DropCounts d = s.drops;
    d.Merge(s.apply.drops);
    total_drops.Merge(d);
    w["dropped"] = DropsToDict(d);
    w["last_event_ts"] = s.batches > 0 ? py::object(py::float_(s.last_event_ts)) : py::object(py::none());
    w["last_recv_age_s"] =
        s.last_recv_age_s >= 0 ? py::object(py::float_(s.last_recv_age_s)) : py::object(py::none());
    w["indexed_blocks"] = s.indexed_blocks;
    w["inflight_requests"] = s.inflight_requests;
    w["pending_prefill_tokens"] = s.pending_prefill_tokens;
    w["num_requests_waiting"] = s.num_requests_waiting;
    w["kv_cache_usage_perc"] =
        s.kv_cache_usage_perc >= 0 ? py::object(py::float_(s.kv_cache_usage_perc)) : py::object(py::none());
    w["active_blocks"] = s.active_blocks;
    w["peer_inflight_requests"] = s.peer_inflight_requests;
    w["peer_pending_prefill_tokens"] = s.peer_pending_prefill_tokens;
    w["peer_active_blocks"] = s.peer_active_blocks;
    workers[py::str(s.config.name)] = w;
  }
  out["workers"] = workers;
  out["dropped"] = DropsToDict(total_drops);
  const Index& idx = r.index();
  out["events_applied"] = r.EventsApplied();
  out["distinct_block_keys"] = idx.DistinctKeys();
  out["indexed_entries"] = idx.Entries();
  out["speculative_entries"] = idx.SpeculativeEntries();
  out["speculative_dropped"] = idx.SpeculativeDropped();
  out["index_memory_bytes"] = idx.MemoryBytes();
  return out;
}

}  // namespace kvroute
