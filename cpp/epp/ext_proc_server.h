// The endpoint picker's ext_proc gRPC server (Envoy's external processing protocol, the Gateway
// API Inference Extension's endpoint picker protocol). See cpp/epp/README.md.
//
// gRPC's asynchronous API on one completion queue, polled by one thread that does the I/O and
// runs every stream's state machine: no hand-off between threads per message. The thread
// answers every message that needs no decision itself (request headers with a body to come,
// response headers and body, trailers) and calls the Handler for the rest: DECIDE (the
// request's headers, its buffered body and the subset hint) returns the answer at once, or
// kDefer, and then the answer comes later through route() / immediate() from any thread;
// RESPONSE (status, served endpoint), BODY (a response body chunk, when asked for) and DONE
// (the stream ended) are reports.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kvroute::epp {

using HeaderList = std::vector<std::pair<std::string, std::string>>;

enum class EventKind : int { kDecide = 0, kResponse = 1, kBody = 2, kDone = 3 };

// What a stream reports. Fields not used by a kind are empty.
struct Event {
  EventKind kind = EventKind::kDone;
  uint64_t stream = 0;
  // kDecide: the request headers (names lower-case, as Envoy sends them), the body (empty for
  // a request without one), whether the decision is at the headers (no body follows), the
  // subset hint: subset_state 0 none given, 1 given (subset holds it, possibly empty),
  // 2 malformed (not a list of strings).
  HeaderList headers;
  std::string body;
  bool at_headers = false;
  int subset_state = 0;
  std::vector<std::string> subset;
  // kResponse: :status (0 if absent), the endpoint that served ("" if the data plane did not
  // say), content-type, the ORCA load report header (endpoint-load-metrics, "" if absent).
  int status = 0;
  std::string served;
  std::string content_type;
  std::string orca;
};

// A DECIDE's answer.
struct Answer {
  enum Kind { kDefer = 0, kRoute = 1, kImmediate = 2 } kind = kDefer;
  // kRoute: x-gateway-destination-endpoint = endpoints (header and envoy.lb metadata),
  // set_headers set, remove_headers removed, response_headers added to the response (when
  // Envoy sends its headers), want_body: report the response body as BODY events.
  std::string endpoints;
  HeaderList set_headers;
  std::vector<std::string> remove_headers;
  HeaderList response_headers;
  bool want_body = false;
  // kImmediate: Envoy answers the client with status, headers and body.
  int status = 0;
  std::string body;
  HeaderList headers;
  std::string details;
};

// Called on the server's thread. For kDecide returns the answer (or kDefer); the return value
// of the other kinds is ignored. Must not throw.
using Handler = std::function<Answer(Event&)>;

class ExtProcServer {
 public:
  // Listens on `address` ("host:port", port 0: a free one). `max_message_bytes` bounds a
  // received message (a buffered body). Throws std::runtime_error if it cannot listen.
  ExtProcServer(const std::string& address, int max_message_bytes, Handler handler);
  ~ExtProcServer();
  ExtProcServer(const ExtProcServer&) = delete;
  ExtProcServer& operator=(const ExtProcServer&) = delete;

  int port() const;

  // The answer to a deferred DECIDE, from any thread. False if the stream is gone.
  bool answer(uint64_t stream, Answer&& a);

  // gRPC health: the status of `service` (grpc.health.v1).
  void set_serving(const std::string& service, bool serving);
  // Stops accepting streams, cancels open ones after `grace_s` seconds, joins the thread.
  void shutdown(double grace_s);

  struct Stats {
    uint64_t streams_opened = 0;
    uint64_t streams_open = 0;
    uint64_t messages_in = 0;
    uint64_t messages_out = 0;
    uint64_t deferred = 0;
    uint64_t answered_unknown = 0;  // answer() for a stream already gone
  };
  Stats stats() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvroute::epp
