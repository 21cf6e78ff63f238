// kvroute._epp: the native ext_proc server (cpp/epp) for kvroute.epp.native. Thin: types
// converted, the Python handler called with the GIL held on the server's thread.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "epp/ext_proc_server.h"

namespace py = pybind11;
using kvroute::epp::Answer;
using kvroute::epp::Event;
using kvroute::epp::EventKind;
using kvroute::epp::ExtProcServer;
using kvroute::epp::HeaderList;

namespace {

py::str utf8(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

py::tuple to_python(Event& e) {
  switch (e.kind) {
    case EventKind::kDecide: {
      py::dict h;
      for (auto& [k, v] : e.headers) h[utf8(k)] = utf8(v);
      py::object subset = py::none();
      if (e.subset_state == 1) {
        py::list l;
        for (auto& s : e.subset) l.append(utf8(s));
        subset = std::move(l);
      } else if (e.subset_state == 2) {
        subset = py::bool_(false);  // malformed
      }
      py::object body = e.at_headers ? py::object(py::none()) : py::object(py::bytes(e.body));
      return py::make_tuple(0, e.stream, std::move(h), std::move(body), std::move(subset));
    }
    case EventKind::kResponse:
      return py::make_tuple(1, e.stream, e.status, utf8(e.served), utf8(e.content_type),
                            utf8(e.orca));
    case EventKind::kBody:
      return py::make_tuple(2, e.stream, py::bytes(e.body));
    case EventKind::kDone:
    default:
      return py::make_tuple(3, e.stream);
  }
}

// A Python answer: None (deferred), (endpoints, set_headers, remove_headers, response_headers,
// want_body) or (status, body, headers).
Answer to_answer(const py::handle& r) {
  Answer a;
  if (r.is_none()) return a;
  auto t = r.cast<py::tuple>();
  if (t.size() == 3) {
    a.kind = Answer::kImmediate;
    a.status = t[0].cast<int>();
    a.body = t[1].cast<std::string>();
    a.headers = t[2].cast<HeaderList>();
    a.details = "kvroute_epp_" + std::to_string(a.status);
    return a;
  }
  a.kind = Answer::kRoute;
  a.endpoints = t[0].cast<std::string>();
  a.set_headers = t[1].cast<HeaderList>();
  a.remove_headers = t[2].cast<std::vector<std::string>>();
  a.response_headers = t[3].cast<HeaderList>();
  a.want_body = t[4].cast<bool>();
  return a;
}

Answer failed(const char* what) {
  Answer a;
  a.kind = Answer::kImmediate;
  a.status = 500;
  a.body = std::string("{\"error\": {\"message\": \"the endpoint picker failed: ") + what +
           "\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}";
  a.headers = {{"content-type", "application/json"}};
  a.details = "kvroute_epp_500";
  return a;
}

// The GIL for the server's thread, keeping its Python thread state from call to call (a
// gil_scoped_acquire on a thread Python does not know creates and destroys one every time,
// and with it the thread's Python-side state). The first use registers the thread and
// releases the GIL at once; the state lives as long as the thread.
class ThreadGil {
 public:
  ThreadGil() {
    thread_local bool known = false;
    if (!known) {
      PyGILState_Ensure();  // never released: keeps the thread state
      PyEval_SaveThread();
      known = true;
    }
    state_ = PyGILState_Ensure();
  }
  ~ThreadGil() { PyGILState_Release(state_); }
  ThreadGil(const ThreadGil&) = delete;
  ThreadGil& operator=(const ThreadGil&) = delete;

 private:
  PyGILState_STATE state_;
};

// Deletes a server: its thread stopped without the GIL (the thread may be waiting for it in the
// handler), then the server freed with the GIL (the handler holds a Python object).
struct Delete {
  void operator()(ExtProcServer* s) const {
    {
      py::gil_scoped_release nogil;
      s->shutdown(0.0);
    }
    delete s;
  }
};
using Holder = std::unique_ptr<ExtProcServer, Delete>;

Holder make(const std::string& address, int max_message_bytes, py::object handler) {
  auto h = std::make_shared<py::object>(std::move(handler));
  auto call = [h](Event& e) -> Answer {
    ThreadGil gil;
    try {
      py::object r = (*h)(to_python(e));
      if (e.kind != EventKind::kDecide) return Answer{};
      return to_answer(r);
    } catch (py::error_already_set& err) {
      err.restore();
      PyErr_WriteUnraisable(h->ptr());  // the traceback on stderr, once per failure
      return e.kind == EventKind::kDecide ? failed("handler raised") : Answer{};
    } catch (const std::exception&) {
      return e.kind == EventKind::kDecide ? failed("bad answer") : Answer{};
    }
  };
  py::gil_scoped_release nogil;
  return Holder(new ExtProcServer(address, max_message_bytes, std::move(call)));
}

}  // namespace

PYBIND11_MODULE(_epp, m) {
  m.doc() = "The endpoint picker's native ext_proc gRPC server (kvroute.epp.native).";
  py::class_<ExtProcServer, Holder>(m, "ExtProcServer")
      .def(py::init(&make), py::arg("address"), py::arg("max_message_bytes"),
           py::arg("handler"))
      .def_property_readonly("port", &ExtProcServer::port)
      .def("answer",
           [](ExtProcServer& s, uint64_t stream, const py::object& answer) {
             Answer a = to_answer(answer);
             py::gil_scoped_release nogil;
             return s.answer(stream, std::move(a));
           },
           py::arg("stream"), py::arg("answer"))
      .def("set_serving", &ExtProcServer::set_serving, py::arg("service"), py::arg("serving"))
      .def("shutdown", &ExtProcServer::shutdown, py::arg("grace_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const ExtProcServer& s) {
        auto st = s.stats();
        py::dict d;
        d["streams_opened"] = st.streams_opened;
        d["streams_open"] = st.streams_open;
        d["messages_in"] = st.messages_in;
        d["messages_out"] = st.messages_out;
        d["deferred"] = st.deferred;
        d["answered_unknown"] = st.answered_unknown;
        return d;
      });
}
