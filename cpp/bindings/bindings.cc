// The only file that includes pybind11: registers the core for Python as `kvroute._core`.
// Conversion glue lives in convert.h beside it. Every call that does real work releases the
// GIL after its arguments are converted; trivial getters keep it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/convert.h"
#include "common/block_key.h"
#include "events/decoder.h"
#include "router/router.h"

namespace py = pybind11;
using namespace kvroute;

namespace {
// kvroute.Match (a NamedTuple, so a tuple subtype), set once by kvroute._router at import and
// kept for the interpreter's life (never released: a static py::object would be destroyed
// after the interpreter). find_matches builds its values as tuple.__new__(Match, values),
// without a Python-level call per worker (256 workers: ~225 -> ~60 us).
PyObject* g_match_type = nullptr;

py::object MakeMatch(uint32_t blocks, uint64_t tokens, double weighted) {
  py::tuple v = py::make_tuple(blocks, tokens, weighted);
  if (g_match_type == nullptr) return std::move(v);
  py::tuple args = py::make_tuple(v);
  PyObject* m = PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(g_match_type), args.ptr(), nullptr);
  if (m == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(m);
}
}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "kvroute native core (private: use the `kvroute` package).";
  // Every worker excluded: kvroute.NoWorkerAvailable (a RuntimeError).
  py::register_exception<NoWorkerAvailable>(m, "NoWorkerAvailable", PyExc_RuntimeError);
  // Unknown worker names surface as KeyError (std::out_of_range would be IndexError).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::out_of_range& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  m.def(
      "_set_match_type",
      [](const py::type& t) {
        if (!PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(t.ptr()), &PyTuple_Type)) {
          throw py::type_error("the Match type must be a tuple subtype");
        }
        Py_INCREF(t.ptr());
        Py_XDECREF(g_match_type);
        g_match_type = t.ptr();
      },
      py::arg("match_type"));
  m.def(
      "block_keys",
      [](const py::object& tokens, int64_t block_size, const std::string& lora_name,
         const std::optional<std::vector<std::optional<py::bytes>>>& extra_keys) {
        if (block_size <= 0) throw py::value_error("block_size must be > 0");
        TokenView tv(tokens);
        std::vector<std::string> extras = ExtrasFrom(extra_keys);
        std::vector<BlockKey> keys;
        {
          py::gil_scoped_release nogil;
          ComputeBlockKeys(ChainRoot(lora_name), tv.data(), tv.size(),
                           static_cast<size_t>(block_size), extra_keys ? &extras : nullptr, &keys);
        }
        py::array_t<uint64_t> out(static_cast<py::ssize_t>(keys.size()));
        std::copy(keys.begin(), keys.end(), out.mutable_data());
        return out;
      },
      py::arg("tokens"), py::arg("block_size"), py::arg("lora_name") = "",
      py::arg("extra_keys") = py::none(),
      "Chained block keys (uint64, one per full block) of a 1-D integer token array.");

  m.def(
      "decode_batch",
      [](py::bytes payload) {
        std::string_view sv = payload;
        EventBatch batch;
        DropCounts drops;
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = DecodeBatch(sv.data(), sv.size(), DecodeLimits{}, &batch, &drops);
        }
        return py::make_tuple(ok ? BatchToDict(batch) : py::object(py::none()),
                              DropsToDict(drops));
      },
      py::arg("payload"),
      "Decodes one KV-event payload. Returns (batch dict or None, drops by reason).");

  m.def("policy_names", [] { return PolicyNames(); });
  m.def("drop_reasons", [] {
    py::list l;
    for (int i = 0; i < kNumDropReasons; ++i) l.append(DropReasonName(static_cast<DropReason>(i)));
    return l;
  });

  py::class_<WorkerScore>(m, "WorkerScore")
      .def_readonly("worker", &WorkerScore::worker)
      .def_readonly("matched_blocks", &WorkerScore::matched_blocks)
      .def_readonly("weighted_matched_tokens", &WorkerScore::weighted_matched_tokens)
      .def_property_readonly("match", [](const WorkerScore& s) { return s.terms.match; })
      .def_property_readonly("load", [](const WorkerScore& s) { return s.terms.load; })
      .def_property_readonly("score", [](const WorkerScore& s) { return s.terms.score; })
      .def_property_readonly("cost", [](const WorkerScore& s) { return s.terms.cost; })
      .def_readonly("pending_prefill_tokens", &WorkerScore::pending_prefill_tokens)
      .def_readonly("requests", &WorkerScore::requests)
      .def("__repr__", [](const WorkerScore& s) {
        return "WorkerScore(worker='" + s.worker + "', matched_blocks=" +
               std::to_string(s.matched_blocks) + ", match=" + std::to_string(s.terms.match) +
               ", load=" + std::to_string(s.terms.load) +
               ", score=" + std::to_string(s.terms.score) + ")";
      });

  py::class_<Decision>(m, "Decision")
      .def_readonly("request_id", &Decision::request_id)
      .def_readonly("worker", &Decision::worker)
      .def_readonly("matched_blocks", &Decision::matched_blocks)
      .def_readonly("matched_tokens", &Decision::matched_tokens)
      .def_readonly("prompt_tokens", &Decision::prompt_tokens)
      .def_readonly("prefill_tokens", &Decision::prefill_tokens)
      .def_property_readonly("policy", [](const Decision& d) { return PolicyName(d.policy); })
      .def_readonly("fallback", &Decision::fallback)
      .def_readonly("degraded", &Decision::degraded)
      .def_property_readonly("reason", [](const Decision& d) { return std::string(d.reason); })
      .def_readonly("scores", &Decision::scores)
      .def("__repr__", [](const Decision& d) {
        return "Decision(worker='" + d.worker + "', matched_tokens=" +
               std::to_string(d.matched_tokens) + "/" + std::to_string(d.prompt_tokens) +
               ", policy=" + PolicyName(d.policy) + (d.fallback ? ", fallback" : "") +
               (d.degraded ? ", degraded" : "") +
               ", request_id=" + std::to_string(d.request_id) + ")";
      });

  py::class_<Router>(m, "Router")
      .def(py::init([](const std::vector<std::tuple<std::string, std::string, bool, int64_t,
                                                     std::string>>& ws,
                       const py::dict& options) {
             RouterOptions o = OptionsFrom(options);
             std::vector<WorkerConfig> cfgs;
             for (const auto& [name, ep, bind, rank, replay] : ws) {
               cfgs.push_back({name, ep, bind, rank, replay});
             }
             py::gil_scoped_release nogil;
             return std::make_unique<Router>(o, cfgs);
           }),
           py::arg("workers"), py::arg("options"),
           "workers: [(name, kv endpoint, bind, dp_rank or -1, replay endpoint)]; options: see "
           "kvroute.Router.")
      .def(
          "add_worker",
          [](Router& r, const std::string& name, const std::string& ep, bool bind, int64_t rank,
             const std::string& replay) {
            py::gil_scoped_release nogil;
            r.AddWorker({name, ep, bind, rank, replay});
          },
          py::arg("name"), py::arg("endpoint"), py::arg("bind"), py::arg("dp_rank"),
          py::arg("replay_endpoint"))
      .def("remove_worker", &Router::RemoveWorker, py::arg("name"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "select",
          [](Router& r, const py::object& tokens, const std::string& lora,
             const std::optional<std::vector<std::optional<py::bytes>>>& extra_keys,
             bool explain, double now, const std::string& session_key,
             const std::optional<std::unordered_map<std::string, double>>& external,
             const std::optional<std::vector<std::string>>& exclude, bool dry_run) {
            TokenView tv(tokens);
            std::vector<std::string> extras = ExtrasFrom(extra_keys);
            py::gil_scoped_release nogil;
            return r.Select(tv.data(), tv.size(), lora, extra_keys ? &extras : nullptr, explain,
                            now, session_key, external ? &*external : nullptr,
                            exclude && !exclude->empty() ? &*exclude : nullptr, dry_run);
          },
          py::arg("tokens"), py::arg("lora_name"), py::arg("extra_keys"), py::arg("explain"),
          py::arg("now") = -1.0, py::arg("session_key") = "", py::arg("external") = py::none(),
          py::arg("exclude") = py::none(), py::arg("dry_run") = false)
      .def(
          "select_plain",
          // select() with its defaults, for the common call (select_worker(tokens)): one
          // argument to convert instead of nine.
          [](Router& r, const py::object& tokens) {
            TokenView tv(tokens);
            py::gil_scoped_release nogil;
            return r.Select(tv.data(), tv.size(), {}, nullptr, false);
          },
          py::arg("tokens"))
      .def(
          "find_matches",
          [](Router& r, const py::object& tokens, const std::string& lora,
             const std::optional<std::vector<std::optional<py::bytes>>>& extra_keys) {
            TokenView tv(tokens);
            std::vector<std::string> extras = ExtrasFrom(extra_keys);
            std::vector<WorkerMatch> ms;
            {
              py::gil_scoped_release nogil;
              ms = r.FindMatches(tv.data(), tv.size(), lora, extra_keys ? &extras : nullptr);
            }
            py::dict out;
            for (const auto& x : ms) {
              out[py::str(x.worker)] = MakeMatch(x.blocks, x.tokens, x.weighted_tokens);
            }
            return out;
          },
          py::arg("tokens"), py::arg("lora_name"), py::arg("extra_keys"))
      .def("complete", &Router::Complete, py::arg("request_id"))
      .def("first_token", &Router::FirstToken, py::arg("request_id"))
      .def("update_load", &Router::UpdateLoad, py::arg("name"), py::arg("num_requests_waiting"),
           py::arg("kv_cache_usage_perc"))
      .def("clear_load", &Router::ClearLoad, py::arg("name"))
      .def(
          "ingest",
          [](Router& r, const std::string& name, py::bytes payload, std::optional<uint64_t> seq) {
            std::string_view sv = payload;
            py::gil_scoped_release nogil;
            return r.Ingest(name, seq.has_value(), seq.value_or(0), sv.data(), sv.size());
          },
          py::arg("name"), py::arg("payload"), py::arg("seq") = py::none())
      .def("stats",
           [](const Router& r) {
             std::vector<WorkerStats> st;
             {
               py::gil_scoped_release nogil;
               st = r.Stats();
             }
             return StatsToDict(r, st);
           })
      .def(
          "worker_blocks",
          [](const Router& r, const std::string& name) {
            std::vector<Index::WorkerEntry> es;
            {
              py::gil_scoped_release nogil;
              es = r.WorkerBlocks(name);
            }
            py::dict out;
            for (const auto& e : es) {
              out[HashToPy(e.hash)] = py::make_tuple(e.key, e.refs[0], e.refs[1], e.refs[2]);
            }
            return out;
          },
          py::arg("name"),
          "{engine hash: (block key, GPU refs, CPU refs, disk refs)} held by the worker; byte-string "
          "engine hashes appear as the index's 64-bit digest of them (an int).")
      .def("events_applied", &Router::EventsApplied)
      .def("close", &Router::Close, py::call_guard<py::gil_scoped_release>());
}
