#include "epp/ext_proc_server.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "envoy/service/ext_proc/v3/external_processor.grpc.pb.h"

namespace kvroute::epp {

namespace pb = ::envoy::service::ext_proc::v3;
namespace core = ::envoy::config::core::v3;

namespace {

constexpr const char* kDestination = "x-gateway-destination-endpoint";
constexpr const char* kSubsetNamespace = "envoy.lb.subset_hint";
constexpr const char* kSubsetKey = "x-gateway-destination-endpoint-subset";
constexpr const char* kLbNamespace = "envoy.lb";
constexpr const char* kServedKey = "x-gateway-destination-endpoint-served";
constexpr const char* kExtProcAttributes = "envoy.filters.http.ext_proc";

const std::string& header_value(const core::HeaderValue& h) {
  return h.raw_value().empty() ? h.value() : h.raw_value();
}

void fill_mutation(pb::HeaderMutation* m, const HeaderList& set,
                   const std::vector<std::string>& remove) {
  for (const auto& [k, v] : set) {
    auto* o = m->add_set_headers();
    o->mutable_header()->set_key(k);
    o->mutable_header()->set_raw_value(v);
    o->set_append_action(core::HeaderValueOption::OVERWRITE_IF_EXISTS_OR_ADD);
  }
  for (const auto& r : remove) m->add_remove_headers(r);
}

// The subset hint of a request: 0 none, 1 given (into out), 2 malformed.
int subset_of(const pb::ProcessingRequest& req, std::vector<std::string>* out) {
  if (!req.has_metadata_context()) return 0;
  const auto& md = req.metadata_context().filter_metadata();
  auto ns = md.find(kSubsetNamespace);
  if (ns == md.end()) return 0;
  auto f = ns->second.fields().find(kSubsetKey);
  if (f == ns->second.fields().end()) return 0;
  if (!f->second.has_list_value()) return 2;
  for (const auto& v : f->second.list_value().values()) {
    if (v.kind_case() != google::protobuf::Value::kStringValue) return 2;
    out->push_back(v.string_value());
  }
  return 1;
}

std::string served_of(const pb::ProcessingRequest& req) {
  if (req.has_metadata_context()) {
    const auto& md = req.metadata_context().filter_metadata();
    auto ns = md.find(kLbNamespace);
    if (ns != md.end()) {
      auto f = ns->second.fields().find(kServedKey);
      if (f != ns->second.fields().end() && !f->second.string_value().empty())
        return f->second.string_value();
    }
  }
  auto a = req.attributes().find(kExtProcAttributes);
  if (a != req.attributes().end()) {
    auto f = a->second.fields().find("upstream.address");
    if (f != a->second.fields().end()) return f->second.string_value();
  }
  return {};
}

void set_immediate(pb::ProcessingResponse* r, int status, const std::string& body,
                   const HeaderList& headers, const std::string& details) {
  auto* im = r->mutable_immediate_response();
  im->mutable_status()->set_code(static_cast<::envoy::type::v3::StatusCode>(status));
  fill_mutation(im->mutable_headers(), headers, {});
  im->set_body(body);
  im->set_details(details);
}

enum class Op { kAccept, kRead, kWrite, kFinish, kDone };

}  // namespace

class ExtProcServer::Impl {
 public:
  class Call;

  // A completion-queue tag: the call and what completed.
  struct Tag {
    Call* call;
    Op op;
  };

  class Call {
   public:
    Call(Impl* impl, uint64_t id)
        : impl_(impl), id_(id), stream_(&ctx_),
          accept_{this, Op::kAccept}, read_{this, Op::kRead}, write_{this, Op::kWrite},
          finish_{this, Op::kFinish}, done_{this, Op::kDone} {
      ctx_.AsyncNotifyWhenDone(&done_);
      impl_->service_.RequestProcess(&ctx_, &stream_, impl_->cq_.get(), impl_->cq_.get(),
                                     &accept_);
    }

    uint64_t id() const { return id_; }

    // Runs on the server thread for each completion.
    void on(Op op, bool ok) {
      switch (op) {
        case Op::kAccept:
          if (!ok) {  // shutting down: never started
            accepted_ = false;
            break;
          }
          accepted_ = true;
          impl_->add(this);
          impl_->spawn();  // the next stream
          start_read();
          break;
        case Op::kRead:
          reading_ = false;
          if (!ok) {  // Envoy closed its side (the HTTP request is over) or cancelled
            std::lock_guard<std::mutex> g(mu_);
            read_closed_ = true;
            maybe_finish_locked();
            break;
          }
          impl_->in_.fetch_add(1, std::memory_order_relaxed);
          handle();
          req_.Clear();
          {
            std::lock_guard<std::mutex> g(mu_);
            if (!finish_started_) start_read();
          }
          break;
        case Op::kWrite: {
          impl_->out_.fetch_add(1, std::memory_order_relaxed);
          std::lock_guard<std::mutex> g(mu_);
          writing_ = false;
          if (!ok) {
            pending_.clear();
            write_failed_ = true;
          }
          if (!pending_.empty()) {
            write_next_locked();
          } else {
            maybe_finish_locked();
          }
          break;
        }
        case Op::kFinish: {
          std::lock_guard<std::mutex> g(mu_);
          finished_ = true;
          break;
        }
        case Op::kDone:
          done_fired_ = true;
          if (accepted_) {
            impl_->remove(id_);
            Event e;
            e.kind = EventKind::kDone;
            e.stream = id_;
            impl_->handler_(e);
          }
          break;
      }
      // Freed once gRPC holds none of its tags (a stream never accepted, at shutdown, is
      // left: its done tag may still come).
      if (accepted_ && done_fired_ && !reading_) {
        bool idle;
        {
          std::lock_guard<std::mutex> g(mu_);
          idle = !writing_ && (!finish_started_ || finished_);
        }
        if (idle) delete this;
      }
    }

    // Queues a response; written now unless a write is in flight. Any thread.
    void send(pb::ProcessingResponse&& r, bool close_after = false) {
      std::lock_guard<std::mutex> g(mu_);
      if (finish_started_ || write_failed_) return;
      if (close_after) close_after_write_ = true;
      pending_.push_back(std::move(r));
      if (!writing_) write_next_locked();
    }

    // The deferred decision's answer (any thread).
    void answer(Answer&& a) {
      pb::ProcessingResponse r;
      bool close = build(std::move(a), &r);
      send(std::move(r), close);
    }

   private:
    void start_read() {
      reading_ = true;
      stream_.Read(&req_, &read_);
    }

    void write_next_locked() {
      current_ = std::move(pending_.front());
      pending_.pop_front();
      writing_ = true;
      stream_.Write(current_, &write_);
    }

    // Finish once nothing is left to write and either Envoy closed its side or an immediate
    // response (which ends the request) went out.
    void maybe_finish_locked() {
      if (finish_started_ || writing_ || !pending_.empty()) return;
      if (!(read_closed_ || close_after_write_ || write_failed_)) return;
      finish_started_ = true;
      stream_.Finish(grpc::Status::OK, &finish_);
    }

    // The response to a decision; true if the stream ends with it (an immediate response).
    bool build(Answer&& a, pb::ProcessingResponse* r) {
      if (a.kind == Answer::kImmediate) {
        set_immediate(r, a.status, a.body, a.headers, a.details);
        return true;
      }
      {
        std::lock_guard<std::mutex> g(mu_);
        response_headers_ = std::move(a.response_headers);
        want_body_ = a.want_body;
      }
      pb::CommonResponse* common = phase_headers_
                                       ? r->mutable_request_headers()->mutable_response()
                                       : r->mutable_request_body()->mutable_response();
      HeaderList set;
      set.reserve(a.set_headers.size() + 1);
      set.emplace_back(kDestination, a.endpoints);
      for (auto& h : a.set_headers) set.push_back(std::move(h));
      fill_mutation(common->mutable_header_mutation(), set, a.remove_headers);
      auto& fields = *(*r->mutable_dynamic_metadata()->mutable_fields())[kLbNamespace]
                          .mutable_struct_value()
                          ->mutable_fields();
      fields[kDestination].set_string_value(a.endpoints);
      return false;
    }

    void decide(bool at_headers) {
      Event e;
      e.kind = EventKind::kDecide;
      e.stream = id_;
      e.headers = std::move(headers_);
      headers_.clear();
      e.body = std::move(body_);
      body_.clear();
      e.at_headers = at_headers;
      e.subset_state = subset_of(req_, &e.subset);
      phase_headers_ = at_headers;
      Answer a = impl_->handler_(e);
      if (a.kind == Answer::kDefer) {
        impl_->deferred_.fetch_add(1, std::memory_order_relaxed);
        return;  // answer() comes later
      }
      answer(std::move(a));
    }

    void immediate_error(int status, const char* details) {
      pb::ProcessingResponse r;
      std::string body = std::string("{\"error\": {\"message\": \"") + details +
                         "\", \"type\": \"InternalServerError\", \"param\": null, \"code\": " +
                         std::to_string(status) + "}}";
      set_immediate(&r, status, body, {{"content-type", "application/json"}}, details);
      send(std::move(r), true);
    }

    void handle() {
      switch (req_.request_case()) {
        case pb::ProcessingRequest::kRequestHeaders: {
          const auto& h = req_.request_headers();
          headers_.clear();
          headers_.reserve(h.headers().headers_size());
          for (const auto& hv : h.headers().headers())
            headers_.emplace_back(hv.key(), header_value(hv));
          if (h.end_of_stream()) {
            decide(true);
          } else {
            pb::ProcessingResponse r;
            r.mutable_request_headers();
            send(std::move(r));
          }
          return;
        }
        case pb::ProcessingRequest::kRequestBody: {
          const auto& b = req_.request_body();
          body_.append(b.body());
          if (b.end_of_stream()) {
            decide(false);
          } else {
            // STREAMED: the request headers went upstream already, so the destination can no
            // longer be set; the picker needs request_body_mode BUFFERED.
            immediate_error(500, "kvroute_epp_needs_buffered_request_body");
          }
          return;
        }
        case pb::ProcessingRequest::kResponseHeaders: {
          Event e;
          e.kind = EventKind::kResponse;
          e.stream = id_;
          for (const auto& hv : req_.response_headers().headers().headers()) {
            const std::string& k = hv.key();
            if (k == ":status") {
              e.status = std::atoi(header_value(hv).c_str());
            } else if (k == "content-type") {
              e.content_type = header_value(hv);
            } else if (k == "endpoint-load-metrics") {
              e.orca = header_value(hv);
            }
          }
          e.served = served_of(req_);
          impl_->handler_(e);
          pb::ProcessingResponse r;
          auto* common = r.mutable_response_headers()->mutable_response();
          {
            std::lock_guard<std::mutex> g(mu_);
            if (!response_headers_.empty())
              fill_mutation(common->mutable_header_mutation(), response_headers_, {});
          }
          send(std::move(r));
          return;
        }
        case pb::ProcessingRequest::kResponseBody: {
          bool want;
          {
            std::lock_guard<std::mutex> g(mu_);
            want = want_body_;
          }
          if (want && !req_.response_body().body().empty()) {
            Event e;
            e.kind = EventKind::kBody;
            e.stream = id_;
            e.body = req_.response_body().body();
            impl_->handler_(e);
          }
          pb::ProcessingResponse r;
          r.mutable_response_body();
          send(std::move(r));
          return;
        }
        case pb::ProcessingRequest::kRequestTrailers: {
          pb::ProcessingResponse r;
          r.mutable_request_trailers();
          send(std::move(r));
          return;
        }
        case pb::ProcessingRequest::kResponseTrailers: {
          pb::ProcessingResponse r;
          r.mutable_response_trailers();
          send(std::move(r));
          return;
        }
        default:
          immediate_error(500, "kvroute_epp_unknown_message");
          return;
      }
    }

    Impl* impl_;
    uint64_t id_;
    grpc::ServerContext ctx_;
    grpc::ServerAsyncReaderWriter<pb::ProcessingResponse, pb::ProcessingRequest> stream_;
    Tag accept_, read_, write_, finish_, done_;
    pb::ProcessingRequest req_;
    HeaderList headers_;
    std::string body_;
    bool phase_headers_ = false;
    // Server-thread state.
    bool accepted_ = false;
    bool reading_ = false;
    bool done_fired_ = false;
    // Shared with answer() callers: under mu_.
    std::mutex mu_;
    std::deque<pb::ProcessingResponse> pending_;
    pb::ProcessingResponse current_;
    bool writing_ = false;
    bool read_closed_ = false;
    bool close_after_write_ = false;
    bool write_failed_ = false;
    bool finish_started_ = false;
    bool finished_ = false;
    HeaderList response_headers_;
    bool want_body_ = false;
  };

  Impl(Handler handler) : handler_(std::move(handler)) {}

  void spawn() { new Call(this, next_id_.fetch_add(1, std::memory_order_relaxed)); }

  void add(Call* c) {
    std::lock_guard<std::mutex> g(mu_);
    calls_[c->id()] = c;
    opened_.fetch_add(1, std::memory_order_relaxed);
    open_.fetch_add(1, std::memory_order_relaxed);
  }

  void remove(uint64_t id) {
    std::lock_guard<std::mutex> g(mu_);
    if (calls_.erase(id)) open_.fetch_sub(1, std::memory_order_relaxed);
  }

  void run() {
    void* tag;
    bool ok;
    while (cq_->Next(&tag, &ok)) {
      auto* t = static_cast<Tag*>(tag);
      t->call->on(t->op, ok);
    }
  }

  Handler handler_;
  pb::ExternalProcessor::AsyncService service_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::unique_ptr<grpc::Server> server_;
  std::thread thread_;
  int port_ = 0;
  std::mutex mu_;  // calls_; answer() holds it while handing its response to the call
  std::unordered_map<uint64_t, Call*> calls_;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> opened_{0}, open_{0}, in_{0}, out_{0}, deferred_{0}, unknown_{0};
  bool stopped_ = false;
};

ExtProcServer::ExtProcServer(const std::string& address, int max_message_bytes,
                             Handler handler)
    : impl_(std::make_unique<Impl>(std::move(handler))) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder b;
  b.AddListeningPort(address, grpc::InsecureServerCredentials(), &impl_->port_);
  b.RegisterService(&impl_->service_);
  b.SetMaxReceiveMessageSize(max_message_bytes);
  b.SetMaxSendMessageSize(max_message_bytes);
  impl_->cq_ = b.AddCompletionQueue();
  impl_->server_ = b.BuildAndStart();
  if (!impl_->server_ || impl_->port_ == 0)
    throw std::runtime_error("cannot listen on " + address + " (gRPC)");
  impl_->spawn();
  impl_->thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "kvroute-epp");
    impl_->run();
  });
}

ExtProcServer::~ExtProcServer() { shutdown(0.0); }

int ExtProcServer::port() const { return impl_->port_; }

bool ExtProcServer::answer(uint64_t stream, Answer&& a) {
  // Under the map's lock, so the call cannot be freed meanwhile (it leaves the map on the
  // server thread, which takes the lock, before it can be deleted).
  std::lock_guard<std::mutex> g(impl_->mu_);
  auto it = impl_->calls_.find(stream);
  if (it == impl_->calls_.end()) {
    impl_->unknown_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  it->second->answer(std::move(a));
  return true;
}

void ExtProcServer::set_serving(const std::string& service, bool serving) {
  if (impl_->server_) {
    auto* h = impl_->server_->GetHealthCheckService();
    if (h != nullptr) h->SetServingStatus(service, serving);
  }
}

void ExtProcServer::shutdown(double grace_s) {
  if (impl_->stopped_) return;
  impl_->stopped_ = true;
  auto deadline = std::chrono::system_clock::now() +
                  std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
  impl_->server_->Shutdown(deadline);
  impl_->cq_->Shutdown();
  if (impl_->thread_.joinable()) impl_->thread_.join();
  impl_->server_.reset();
}

ExtProcServer::Stats ExtProcServer::stats() const {
  Stats s;
  s.streams_opened = impl_->opened_.load();
  s.streams_open = impl_->open_.load();
  s.messages_in = impl_->in_.load();
  s.messages_out = impl_->out_.load();
  s.deferred = impl_->deferred_.load();
  s.answered_unknown = impl_->unknown_.load();
  return s;
}

}  // namespace kvroute::epp
