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
// without a Python-level call per worker (~60 us at 256 workers, ~4x less than one call each).
PyObject* g_match_type = nullptr;

py::object MakeMatch(uint32_t blocks, uint64_t tokens, double weighted) {
  py::tuple v = py::make_tuple(blocks, tokens, weighted);
  if (g_match_type == nullptr) return std::move(v);
  py::tuple args = py::make_tuple(v);
  PyObject* m = PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(g_match_type), args.ptr(), nullptr);
  if (m == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(m);
}

// Exceptions: NoWorkerAvailable, and unknown worker names as KeyError.
void RegisterErrors(py::module_& m) {
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
}

// Free functions: block keys, the decoder, the registries' names.
void RegisterFunctions(py::module_& m) {
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
  m.def(
      "policy_schema",
      [] {
        // {policy: [{name, type, default, min, max, doc}]}, in the registry's order.
        py::dict out;
        for (const PolicyDef* d : PolicyDefs()) {
          py::list knobs;
          for (const ParamSpec& k : d->knobs) {
            py::dict e;
            e["name"] = k.name;
            e["type"] = ParamTypeName(k.type);
            e["default"] = k.def;
            const bool ranged = k.type != ParamType::kBool;
            e["min"] = ranged ? py::cast(k.lo) : py::none();
            e["max"] = ranged ? py::cast(k.hi) : py::none();
            e["doc"] = k.doc;
            knobs.append(e);
          }
          out[d->name] = knobs;
        }
        return out;
      },
      "Each policy's own knobs, from its C++ file: {policy: [{name, type ('bool', 'int', "
      "'float'), default, min, max (inclusive; None for bool; an unbounded float's max is "
      "inf, an unbounded int's 2**63 - 1), doc}]}.");
  m.def("drop_reasons", [] {
    py::list l;
    for (int i = 0; i < kNumDropReasons; ++i) l.append(DropReasonName(static_cast<DropReason>(i)));
    return l;
  });

}

// The typed options a Router is built from; defaults as in C++.
void RegisterOptions(py::module_& m) {
  py::class_<IndexOptions>(m, "IndexOptions", "The index's options (cpp/index/index.h).")
      .def(py::init<>())
      .def_readwrite("block_size", &IndexOptions::block_size)
      .def_readwrite("tier_weights", &IndexOptions::tier_weights)
      .def_readwrite("max_blocks_per_worker", &IndexOptions::max_blocks_per_worker)
      .def_readwrite("max_blocks_total", &IndexOptions::max_blocks_total)
      .def_readwrite("max_speculative_blocks", &IndexOptions::max_speculative_blocks);
  py::class_<DecodeLimits>(m, "DecodeLimits", "The decoder's bounds (cpp/events/decoder.h).")
      .def(py::init<>())
      .def_readwrite("max_payload_bytes", &DecodeLimits::max_payload_bytes)
      .def_readwrite("max_blocks_per_event", &DecodeLimits::max_blocks_per_event);
  py::class_<RouterOptions>(m, "RouterOptions",
                            "The router's options (cpp/router/router.h); defaults as there.")
      .def(py::init<>())
      .def_readwrite("index", &RouterOptions::index)
      .def_property(
          "policy", [](const RouterOptions& o) { return o.policy; },
          [](RouterOptions& o, const std::string& v) { o.policy = PolicyNameOrThrow(v); })
      .def_property(
          "fallback", [](const RouterOptions& o) { return o.fallback; },
          [](RouterOptions& o, const std::string& v) { o.fallback = PolicyNameOrThrow(v); })
      .def_readwrite("policy_params", &RouterOptions::policy_params,
                     "The policy's knobs {name: value}: those given (the others take their "
                     "defaults); every knob on Router.options.")
      .def_readwrite("fallback_params", &RouterOptions::fallback_params,
                     "The fallback's knobs, as policy_params.")
      .def_readwrite("speculative_ttl_s", &RouterOptions::speculative_ttl_s)
      .def_readwrite("seed", &RouterOptions::seed)
      .def_readwrite("topic", &RouterOptions::topic)
      .def_readwrite("ingest_threads", &RouterOptions::ingest_threads)
      .def_readwrite("ingest_nice", &RouterOptions::ingest_nice)
      .def_readwrite("limits", &RouterOptions::limits)
      .def_readwrite("replay_timeout_s", &RouterOptions::replay_timeout_s)
      .def_readwrite("degraded_hold_s", &RouterOptions::degraded_hold_s)
      .def_readwrite("receive_hwm", &RouterOptions::receive_hwm)
      .def_readwrite("max_replay_queue_bytes", &RouterOptions::max_replay_queue_bytes)
      .def_readwrite("stale_after_s", &RouterOptions::stale_after_s)
      .def_readwrite("allowed_publisher_ips", &RouterOptions::allowed_publisher_ips)
      .def_readwrite("curve_secret_key", &RouterOptions::curve_secret_key)
      .def_readwrite("curve_allowed_publisher_keys",
                     &RouterOptions::curve_allowed_publisher_keys);

}

// A decision and its per-worker scores (picklable).
void RegisterDecision(py::module_& m) {
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
      .def(py::pickle(
          [](const WorkerScore& s) {
            return py::make_tuple(s.worker, s.matched_blocks, s.weighted_matched_tokens,
                                  s.terms.match, s.terms.load, s.terms.score, s.terms.cost,
                                  s.pending_prefill_tokens, s.requests);
          },
          [](const py::tuple& t) {
            if (t.size() != 9) throw std::runtime_error("WorkerScore: bad pickle state");
            WorkerScore s;
            s.worker = t[0].cast<std::string>();
            s.matched_blocks = t[1].cast<uint32_t>();
            s.weighted_matched_tokens = t[2].cast<double>();
            s.terms.match = t[3].cast<double>();
            s.terms.load = t[4].cast<double>();
            s.terms.score = t[5].cast<double>();
            s.terms.cost = t[6].cast<double>();
            s.pending_prefill_tokens = t[7].cast<double>();
            s.requests = t[8].cast<double>();
            return s;
          }))
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
      .def_readonly("available_blocks", &Decision::available_blocks)
      .def_readonly("available_tokens", &Decision::available_tokens)
      .def_property_readonly("policy", [](const Decision& d) { return std::string(d.policy); })
      .def_readonly("fallback", &Decision::fallback)
      .def_readonly("degraded", &Decision::degraded)
      .def_property_readonly("reason", [](const Decision& d) { return std::string(d.reason); })
      .def_readonly("scores", &Decision::scores)
      // Picklable (Ray Serve and multiprocessing hand decisions between processes).
      .def(py::pickle(
          [](const Decision& d) {
            return py::make_tuple(d.request_id, d.worker, d.matched_blocks, d.matched_tokens,
                                  d.prompt_tokens, d.prefill_tokens, std::string(d.policy),
                                  d.fallback, std::string(d.reason), d.degraded, d.scores,
                                  d.available_blocks, d.available_tokens);
          },
          [](const py::tuple& t) {
            if (t.size() != 13) throw std::runtime_error("Decision: bad pickle state");
            Decision d;
            d.request_id = t[0].cast<uint64_t>();
            d.worker = t[1].cast<std::string>();
            d.matched_blocks = t[2].cast<uint32_t>();
            d.matched_tokens = t[3].cast<uint64_t>();
            d.prompt_tokens = t[4].cast<uint64_t>();
            d.prefill_tokens = t[5].cast<uint64_t>();
            d.policy = PolicyNameOrThrow(t[6].cast<std::string>());
            d.fallback = t[7].cast<bool>();
            d.reason = DecisionReason(t[8].cast<std::string>());
            d.degraded = t[9].cast<bool>();
            d.scores = t[10].cast<std::vector<WorkerScore>>();
            d.available_blocks = t[11].cast<uint32_t>();
            d.available_tokens = t[12].cast<uint64_t>();
            return d;
          }))
      .def("__repr__", [](const Decision& d) {
        return "Decision(worker='" + d.worker + "', matched_tokens=" +
               std::to_string(d.matched_tokens) + "/" + std::to_string(d.prompt_tokens) +
               ", policy=" + d.policy + (d.fallback ? ", fallback" : "") +
               (d.degraded ? ", degraded" : "") +
               ", request_id=" + std::to_string(d.request_id) + ")";
      });

}

// The router.
void RegisterRouter(py::module_& m) {
  m.def(
      "curve_public_key",
      [](const std::string& secret) { return CurvePublicKey(secret); }, py::arg("secret_key"),
      "The CurveZMQ public key (Z85) of a secret key (Z85). ValueError if malformed or when "
      "libzmq has no CURVE.");
  m.def("curve_available", &CurveAvailable, "Whether libzmq has CURVE (zmq_has(\"curve\")).");
  py::class_<Router>(m, "Router")
      .def(py::init([](const std::vector<std::tuple<std::string, std::string, bool, int64_t,
                                                     std::string, std::string>>& ws,
                       const RouterOptions& o) {
             std::vector<WorkerConfig> cfgs;
             for (const auto& [name, ep, bind, rank, replay, curve] : ws) {
               cfgs.push_back({name, ep, bind, rank, replay, curve});
             }
             py::gil_scoped_release nogil;
             return std::make_unique<Router>(o, cfgs);
           }),
           py::arg("workers"), py::arg("options"),
           "workers: [(name, kv endpoint, bind, dp_rank or -1, replay endpoint, CURVE server "
           "key or '')]. Raises "
           "ValueError for an invalid option (std::invalid_argument).")
      .def_property_readonly(
          "options", [](const Router& r) { return RouterOptions(r.options()); },
          "A copy of the options the router runs with.")
      .def("set_policy", &Router::SetPolicy, py::arg("policy"), py::arg("policy_params"),
           py::arg("fallback"), py::arg("fallback_params"),
           py::call_guard<py::gil_scoped_release>(),
           "Replaces the policy and the fallback, each with its own knobs (see "
           "Router::SetPolicy). ValueError for an unknown name or knob, or a bad value.")
      .def("set_policy_param", &Router::SetPolicyParam, py::arg("knob"), py::arg("value"),
           py::call_guard<py::gil_scoped_release>(),
           "Changes one knob of the policy (not the fallback) for the decisions from now on. "
           "ValueError for a knob the policy does not have or a bad value.")
      .def("set_speculative_ttl", &Router::SetSpeculativeTtl, py::arg("speculative_ttl_s"),
           "Changes speculative_ttl_s (seconds) for the credits given or released from now "
           "on. ValueError below 0.")
      .def_property_readonly("speculative_ttl_s", &Router::speculative_ttl_s,
                             "The speculative credits' TTL in effect, seconds.")
      .def(
          "add_worker",
          [](Router& r, const std::string& name, const std::string& ep, bool bind, int64_t rank,
             const std::string& replay, const std::string& curve_server_key) {
            py::gil_scoped_release nogil;
            r.AddWorker({name, ep, bind, rank, replay, curve_server_key});
          },
          py::arg("name"), py::arg("endpoint"), py::arg("bind"), py::arg("dp_rank"),
          py::arg("replay_endpoint"), py::arg("curve_server_key") = "")
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
            SelectRequest req;
            req.tokens = tv.data();
            req.num_tokens = tv.size();
            req.lora_name = lora;
            req.extra_keys = extra_keys ? &extras : nullptr;
            req.explain = explain;
            req.now_s = now;
            req.session_key = session_key;
            req.external = external ? &*external : nullptr;
            req.exclude = exclude && !exclude->empty() ? &*exclude : nullptr;
            req.dry_run = dry_run;
            py::gil_scoped_release nogil;
            return r.Select(req);
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
            SelectRequest req;
            req.tokens = tv.data();
            req.num_tokens = tv.size();
            py::gil_scoped_release nogil;
            return r.Select(req);
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
      .def("set_peer_load", &Router::SetPeerLoad, py::arg("name"), py::arg("inflight"),
           py::arg("pending_prefill"), py::arg("active_blocks"),
           "Other replicas' load on the worker (Router::SetPeerLoad). KeyError, ValueError.")
      .def(
          "local_load",
          [](const Router& r) {
            std::vector<Router::OwnLoad> ls;
            {
              py::gil_scoped_release nogil;
              ls = r.LocalLoad();
            }
            py::list out;
            for (const auto& l : ls) {
              out.append(py::make_tuple(l.worker, l.inflight, l.pending_prefill, l.active_blocks));
            }
            return out;
          },
          "[(worker, inflight, pending_prefill, active_blocks)] of this router's own requests, "
          "workers with none left out (Router::LocalLoad).")
      .def(
          "add_speculative",
          [](Router& r, const std::string& name, const std::vector<uint64_t>& keys,
             double ttl_s) {
            py::gil_scoped_release nogil;
            r.AddSpeculative(name, keys.data(), keys.size(), ttl_s);
          },
          py::arg("name"), py::arg("keys"), py::arg("ttl_s"),
          "Credits the worker with block keys for ttl_s seconds (another replica's decision).")
      .def(
          "dump_worker",
          [](const Router& r, const std::string& name) {
            WorkerDump d;
            {
              py::gil_scoped_release nogil;
              d = r.DumpWorker(name);
            }
            std::string buf = PackEntries(d.entries);
            py::dict at;
            at["seen_seq"] = d.at.seen_seq;
            at["last_seq"] = d.at.last_seq;
            at["have_hash"] = d.at.have_hash;
            at["last_hash"] = d.at.last_hash;
            at["recovering"] = d.at.recovering;
            at["state"] = TrustStateName(d.state);
            at["entries"] = d.entries.size();
            return py::make_tuple(at, py::bytes(buf));
          },
          py::arg("name"),
          "(position dict, entries): the worker's entries packed kEntryBytes each (PackEntries) "
          "and the stream position they stand at.")
      .def(
          "restore_worker",
          [](Router& r, const std::string& name, const py::bytes& entries, uint64_t last_seq,
             bool have_hash, uint64_t last_hash) {
            std::string_view sv = entries;
            std::vector<Index::WorkerEntry> es;
            if (!UnpackEntries(sv, &es)) {
              throw py::value_error("entries: length " + std::to_string(sv.size()) +
                                    " is not a multiple of " + std::to_string(kEntryBytes));
            }
            StreamPosition at;
            at.seen_seq = true;
            at.last_seq = last_seq;
            at.have_hash = have_hash;
            at.last_hash = last_hash;
            py::gil_scoped_release nogil;
            return r.RestoreWorker(name, at, es);
          },
          py::arg("name"), py::arg("entries"), py::arg("last_seq"), py::arg("have_hash"),
          py::arg("last_hash"),
          "Restores the worker from a peer's dump_worker (Router::RestoreWorker); False if its "
          "stream has already seen a message.")
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

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "kvroute native core (private: use the `kvroute` package).";
  RegisterErrors(m);
  RegisterFunctions(m);
  RegisterOptions(m);
  RegisterDecision(m);
  RegisterRouter(m);
}
