#include "router/router.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "common/block_key.h"

namespace kvroute {

struct Router::WorkerRuntime {
  // What Select reads of every worker, in one cache line at the start: the trust state, the
  // index id and the load (guarded by load_.mu()).
  alignas(64) TrustCell trust;
  WorkerId id = kNoWorker;
  WorkerLoad load;
  uint64_t name_hash = 0;  // xxh3 of cfg.name (the hashing policies)
  WorkerConfig cfg;
  uint64_t sub_id = 0;  // the subscription, 0 = none
  std::unique_ptr<WorkerStream> stream;
};

namespace {
double MonoSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
// Per-thread scratch of the request path, reached once per call (each access to a
// thread_local in a shared library costs a __tls_get_addr call). Not inlined: inlined, GCC
// recomputes the address at every use instead of keeping it in a register.
struct Scratch {
  MatchResult match;
  std::vector<BlockKey> keys;
  std::vector<Candidate> cands;
  std::vector<ScoreTerms> terms;
};
__attribute__((noinline)) Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}
constexpr size_t kSessionPrefixTokens = 256;  // session key fallback: hash of this prefix
}  // namespace

Router::Router(RouterOptions opts, const std::vector<WorkerConfig>& workers)
    : opts_(std::move(opts)), index_(opts_.index), rng_(opts_.seed) {
  opts_.policy_params = ResolvePolicyParams(opts_.policy, opts_.policy_params);
  opts_.fallback_params = ResolvePolicyParams(opts_.fallback, opts_.fallback_params);
  policy_ = FindPolicy(opts_.policy).make(opts_.policy_params);
  fallback_ = FindPolicy(opts_.fallback).make(opts_.fallback_params);
  if (fallback_->UsesIndex() || fallback_->NeedsExternal()) {
    throw std::invalid_argument("fallback policy '" + opts_.fallback +
                                "' must need neither KV events nor an external source");
  }
  if (opts_.ingest_threads < 1) throw std::invalid_argument("ingest_threads must be >= 1");
  if (opts_.ingest_nice < 0 || opts_.ingest_nice > 19) {
    throw std::invalid_argument("ingest_nice must be in [0, 19]");
  }
  if (!(opts_.speculative_ttl_s >= 0)) {
    throw std::invalid_argument("speculative_ttl_s must be >= 0");
  }
  spec_ttl_s_.store(opts_.speculative_ttl_s, std::memory_order_relaxed);
  if (!(opts_.replay_timeout_s > 0)) throw std::invalid_argument("replay_timeout_s must be > 0");
  if (!(opts_.degraded_hold_s >= 0)) throw std::invalid_argument("degraded_hold_s must be >= 0");
  if (opts_.receive_hwm < 1) throw std::invalid_argument("receive_hwm must be >= 1");
  if (!(opts_.stale_after_s >= 0)) throw std::invalid_argument("stale_after_s must be >= 0");
  if (opts_.max_replay_queue_bytes < 1) {
    throw std::invalid_argument("max_replay_queue_bytes must be >= 1");
  }
  ValidateCurve();
  // Membership announced once for the initial workers, not once per worker (the ring sorts
  // every point each time).
  for (const auto& w : workers) AddWorker(w, /*announce=*/false);
  std::unique_lock wl(workers_mu_);
  AnnounceMembership();
}

Router::~Router() { Close(); }

void Router::ValidateCurve() const {
  const bool any = !opts_.curve_secret_key.empty() || !opts_.curve_allowed_publisher_keys.empty();
  if (!opts_.curve_secret_key.empty()) CurveKeyBytes(opts_.curve_secret_key, "curve_secret_key");
  for (size_t i = 0; i < opts_.curve_allowed_publisher_keys.size(); ++i) {
    CurveKeyBytes(opts_.curve_allowed_publisher_keys[i],
                  "curve_allowed_publisher_keys[" + std::to_string(i) + "]");
  }
  if (!opts_.curve_allowed_publisher_keys.empty() && opts_.curve_secret_key.empty()) {
    throw std::invalid_argument(
        "curve_allowed_publisher_keys needs curve_secret_key (bound sockets are CURVE servers "
        "with it)");
  }
  if (any && !CurveAvailable()) {
    throw std::invalid_argument("CURVE keys given, but this libzmq has no CURVE (libsodium)");
  }
}

void Router::Close() {
  // Lock order everywhere: workers_mu_, then close_mu_.
  std::shared_ptr<Subscriber> sub;
  {
    std::unique_lock wl(workers_mu_);
    std::lock_guard lock(close_mu_);
    if (closed_.exchange(true, std::memory_order_acq_rel)) return;
    sub = std::move(subscriber_);
  }
  if (sub) sub->Close();
  std::vector<std::shared_ptr<WorkerRuntime>> ws;
  {
    std::shared_lock wl(workers_mu_);
    ws = workers_;
  }
  for (auto& w : ws) w->stream->RequestStop();  // every replay gives up at once
  for (auto& w : ws) w->stream->Stop();
}

std::shared_ptr<Router::WorkerRuntime> Router::Find(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::shared_ptr<Router::WorkerRuntime> Router::Get(const std::string& name) const {
  std::shared_ptr<WorkerRuntime> rt;
  {
    std::shared_lock wl(workers_mu_);
    rt = Find(name);
  }
  if (!rt) throw std::out_of_range("unknown worker '" + name + "'");
  return rt;
}

void Router::ApplyBatch(WorkerRuntime& rt, const EventBatch& b, ApplyCounts* c) {
  const uint64_t before = c->events;
  for (const Event& ev : b.events) index_.Apply(rt.id, ev, c);
  events_applied_.fetch_add(c->events - before, std::memory_order_relaxed);
}

void Router::AddWorker(const WorkerConfig& cfg, bool announce) {
  if (cfg.name.empty()) throw std::invalid_argument("worker name must not be empty");
  std::unique_lock wl(workers_mu_);
  if (Find(cfg.name) != nullptr) {
    throw std::invalid_argument("duplicate worker '" + cfg.name + "'");
  }
  {
    std::lock_guard lock(close_mu_);
    if (closed_) throw std::logic_error("router is closed");
  }
  if (!cfg.replay_endpoint.empty()) ValidateEndpoint(cfg.replay_endpoint, /*bind=*/false);
  if (!cfg.curve_server_key.empty()) {
    CurveKeyBytes(cfg.curve_server_key, "curve_server_key of worker '" + cfg.name + "'");
    if (cfg.bind || cfg.endpoint.empty()) {
      throw std::invalid_argument("curve_server_key of worker '" + cfg.name +
                                  "' is for a connected endpoint; a bound socket is a CURVE "
                                  "server with the router's curve_secret_key");
    }
    if (!CurveAvailable()) {
      throw std::invalid_argument("curve_server_key given, but this libzmq has no CURVE");
    }
  }
  auto rt = std::make_shared<WorkerRuntime>();
  rt->cfg = cfg;
  rt->id = index_.AddWorker();
  rt->name_hash = XXH3_64bits(cfg.name.data(), cfg.name.size());
  StreamOptions so;
  so.dp_rank = cfg.dp_rank;
  so.replay_endpoint = cfg.replay_endpoint;
  so.replay_timeout_s = opts_.replay_timeout_s;
  so.degraded_hold_s = opts_.degraded_hold_s;
  so.limits = opts_.limits;
  so.max_pending_bytes = opts_.max_replay_queue_bytes;
  WorkerRuntime* raw = rt.get();  // the stream lives and dies inside its worker record
  rt->stream = std::make_unique<WorkerStream>(
      std::move(so), &replay_ctx_, &rt->trust,
      [this, raw](const EventBatch& b, ApplyCounts* c) { ApplyBatch(*raw, b, c); },
      [this, raw] { index_.ClearWorker(raw->id); });
  if (!cfg.endpoint.empty()) {
    {
      std::lock_guard lock(close_mu_);
      if (!subscriber_) {
        subscriber_ = std::make_shared<Subscriber>(
            opts_.ingest_threads, opts_.ingest_nice, opts_.allowed_publisher_ips,
            CurveOptions{opts_.curve_secret_key, opts_.curve_allowed_publisher_keys});
      }
    }
    SubscriptionSpec spec;
    spec.endpoint = cfg.endpoint;
    spec.bind = cfg.bind;
    spec.topic = opts_.topic;
    // ZeroMQ refuses a frame past max(2 x max_payload_bytes, 16 MiB) before it buffers it
    // and drops that connection (the subscriber opens a new socket; what was lost is a
    // gap). Payloads between the two limits reach the decoder and are counted oversized, so
    // an engine's slightly too large batch costs one batch, not a reconnect.
    spec.max_message_bytes = static_cast<int64_t>(std::min<size_t>(
        std::max<size_t>(2 * opts_.limits.max_payload_bytes, 16u << 20),
        static_cast<size_t>(INT64_MAX)));
    spec.receive_hwm = opts_.receive_hwm;
    spec.curve_server_key = cfg.curve_server_key;
    std::weak_ptr<WorkerRuntime> weak = rt;
    spec.handler = [weak](const WireMessage& m) {
      if (auto p = weak.lock()) p->stream->Handle(m);
    };
    spec.on_reconnect = [weak] {
      if (auto p = weak.lock()) p->stream->Reconnected();
    };
    try {
      rt->sub_id = subscriber_->Add(std::move(spec));
    } catch (...) {
      index_.RemoveWorker(rt->id);
      throw;
    }
  }
  // Room first, so that the push_back cannot fail after the emplace (doubling, as push_back).
  if (workers_.size() == workers_.capacity()) workers_.reserve(2 * workers_.size() + 1);
  by_name_.emplace(cfg.name, rt);
  workers_.push_back(std::move(rt));
  if (announce) AnnounceMembership();
}

void Router::AnnounceMembership() {
  std::vector<uint64_t> hashes;
  hashes.reserve(workers_.size());
  for (const auto& w : workers_) hashes.push_back(w->name_hash);
  policy_->OnMembership(hashes);
  fallback_->OnMembership(hashes);
}

void Router::ThrowIfClosed() const {
  if (closed_.load(std::memory_order_acquire)) throw std::logic_error("router is closed");
}

TrustState Router::StateOf(WorkerRuntime& w, double mono) const {
  const TrustState s = w.trust.Read(mono, opts_.degraded_hold_s);
  if (s == TrustState::kExact && opts_.stale_after_s > 0 &&
      mono - w.stream->LastMessageMono() > opts_.stale_after_s) {
    return TrustState::kStale;
  }
  return s;
}

void Router::RemoveWorker(const std::string& name) {
  ThrowIfClosed();
  std::shared_ptr<WorkerRuntime> rt;
  std::shared_ptr<Subscriber> sub;
  {
    std::unique_lock wl(workers_mu_);
    rt = Find(name);
    if (rt == nullptr) throw std::out_of_range("unknown worker '" + name + "'");
    by_name_.erase(name);
    workers_.erase(std::find(workers_.begin(), workers_.end(), rt));
    AnnounceMembership();
    sub = subscriber_;  // a copy: Close() may move the member out meanwhile
  }
  if (rt->sub_id != 0 && sub) sub->Remove(rt->sub_id);
  rt->stream->Stop();  // no event of the worker is applied after this
  index_.RemoveWorker(rt->id);
  {
    std::shared_lock wl(workers_mu_);  // SetPolicy may replace the policies
    policy_->OnRemoveWorker(rt->id);
    fallback_->OnRemoveWorker(rt->id);
  }
  load_.Forget(&rt->load);
}

void Router::SetPolicy(const std::string& policy, const ParamValues& policy_params,
                       const std::string& fallback, const ParamValues& fallback_params) {
  // Everything that can throw first: on an error nothing has changed.
  const PolicyDef& pd = FindPolicy(policy);
  const PolicyDef& fd = FindPolicy(fallback);
  ParamValues pk = ResolveParams(pd.name, pd.knobs, policy_params);
  ParamValues fk = ResolveParams(fd.name, fd.knobs, fallback_params);
  std::unique_lock wl(workers_mu_);
  std::unique_ptr<Policy> np = policy == opts_.policy ? nullptr : pd.make(pk);
  std::unique_ptr<Policy> nf = fallback == opts_.fallback ? nullptr : fd.make(fk);
  if (nf != nullptr && (nf->UsesIndex() || nf->NeedsExternal())) {
    throw std::invalid_argument("fallback policy '" + fallback +
                                "' must need neither KV events nor an external source");
  }
  if (np != nullptr) {
    policy_ = std::move(np);
  } else {
    policy_->Configure(pk);  // the same policy: keeps its state, takes the new knobs
  }
  if (nf != nullptr) {
    fallback_ = std::move(nf);
  } else {
    fallback_->Configure(fk);
  }
  opts_.policy = pd.name;
  opts_.fallback = fd.name;
  opts_.policy_params = std::move(pk);
  opts_.fallback_params = std::move(fk);
  AnnounceMembership();
}

void Router::SetPolicyParam(const std::string& knob, const ParamValue& value) {
  std::unique_lock wl(workers_mu_);
  const PolicyDef& pd = FindPolicy(opts_.policy);
  ParamValues given = opts_.policy_params;
  given[knob] = value;
  ParamValues pk = ResolveParams(pd.name, pd.knobs, given);
  policy_->Configure(pk);
  opts_.policy_params = std::move(pk);
}

void Router::SetSpeculativeTtl(double speculative_ttl_s) {
  if (!(speculative_ttl_s >= 0)) throw std::invalid_argument("speculative_ttl_s must be >= 0");
  std::unique_lock wl(workers_mu_);
  opts_.speculative_ttl_s = speculative_ttl_s;
  spec_ttl_s_.store(speculative_ttl_s, std::memory_order_relaxed);
}

bool Router::Ingest(const std::string& name, bool has_seq, uint64_t seq, const char* payload,
                    size_t len) {
  ThrowIfClosed();
  std::shared_ptr<WorkerRuntime> rt = Get(name);
  WireMessage m;
  m.has_seq = has_seq;
  m.seq = seq;
  m.payload = payload;
  m.payload_len = len;
  return rt->stream->Handle(m);
}

std::vector<WorkerMatch> Router::FindMatches(const uint32_t* tokens, size_t n,
                                             std::string_view lora_name,
                                             const std::vector<std::string>* extra_keys) {
  Scratch& sc = ThreadScratch();
  const size_t bs = static_cast<size_t>(opts_.index.block_size);
  BlockKeyStream keys(ChainRoot(lora_name), tokens, n, bs, extra_keys, &sc.keys);
  std::shared_lock wl(workers_mu_);
  index_.FindMatches(&keys, &sc.match);
  std::vector<WorkerMatch> out;
  out.reserve(workers_.size());
  for (const auto& w : workers_) {
    WorkerMatch m;
    m.worker = w->cfg.name;
    m.blocks = sc.match.blocks[w->id];
    m.tokens = static_cast<uint64_t>(m.blocks) * bs;
    m.weighted_tokens = sc.match.weighted[w->id] * static_cast<double>(bs);
    out.push_back(std::move(m));
  }
  return out;
}

Decision Router::Select(const SelectRequest& req) {
  ThrowIfClosed();
  Scratch& sc = ThreadScratch();
  const uint32_t* tokens = req.tokens;
  const size_t n = req.num_tokens;
  const size_t bs = static_cast<size_t>(opts_.index.block_size);
  // Hashed by the prefix walk as it goes (the blocks past the match only if credited below).
  BlockKeyStream keys(ChainRoot(req.lora_name), tokens, n, bs, req.extra_keys, &sc.keys);
  const double now = req.now_s >= 0 ? req.now_s : MonoSeconds();
  std::shared_lock wl(workers_mu_);
  if (workers_.empty()) throw std::logic_error("the router has no workers");
  index_.FindMatches(&keys, &sc.match, now);

  Decision d;
  d.prompt_tokens = n;
  const double mono = MonoSeconds();
  Policy* policy = DecidingPolicy(req, mono, &d);

  ChooseContext ctx;
  ctx.tokens = tokens;
  ctx.num_tokens = n;
  ctx.now_s = now;
  ctx.prompt_blocks = static_cast<double>(bs > 0 ? n / bs : 0);
  ctx.block_size = static_cast<double>(bs);
  if (policy->HashesSession()) {
    ctx.session_hash =
        req.session_key.empty()
            ? XXH3_64bits(tokens, std::min<size_t>(n, kSessionPrefixTokens) * sizeof(uint32_t))
            : XXH3_64bits(req.session_key.data(), req.session_key.size());
  }
  policy->Prepare(ctx, index_.WorkerIdLimit());

  std::shared_ptr<WorkerRuntime> chosen;
  {
    std::lock_guard lock(load_.mu());
    BuildCandidates(req, sc.match, static_cast<double>(bs), policy->HashesSession(), &sc.cands);
    // A dry run draws from copies: the router's own random stream and round-robin position
    // stay where they were. (The engine is 2.5 KB: copied only for dry runs.)
    std::unique_ptr<std::mt19937_64> rng_copy;
    uint64_t rr_copy = rr_counter_;
    if (req.dry_run) rng_copy = std::make_unique<std::mt19937_64>(rng_);
    ctx.rng = req.dry_run ? rng_copy.get() : &rng_;
    ctx.rr_counter = req.dry_run ? &rr_copy : &rr_counter_;
    const size_t pick = policy->Choose(sc.cands, ctx, &sc.terms);
    chosen = workers_[pick];
    d.matched_blocks = sc.match.blocks[chosen->id];
    d.matched_tokens = std::min<uint64_t>(static_cast<uint64_t>(d.matched_blocks) * bs, n);
    d.prefill_tokens = n - d.matched_tokens;
    d.available_blocks = sc.match.max_blocks;
    d.available_tokens = std::min<uint64_t>(static_cast<uint64_t>(d.available_blocks) * bs, n);
    if (!req.dry_run) {
      const int64_t blocks = static_cast<int64_t>(bs > 0 ? (n + bs - 1) / bs : 0);
      d.request_id = load_.StartLocked(std::shared_ptr<WorkerLoad>(chosen, &chosen->load),
                                       static_cast<int64_t>(d.prefill_tokens), blocks);
    }
    if (req.explain) Explain(sc.match, sc.cands, sc.terms, static_cast<double>(bs), &d);
  }
  if (!req.dry_run) policy->Record(chosen->id, ctx);  // cache_aware: its own lock
  d.worker = chosen->cfg.name;
  d.degraded = d.degraded || Untrusted(StateOf(*chosen, mono));
  const double ttl = spec_ttl_s_.load(std::memory_order_relaxed);
  if (!req.dry_run && policy->UsesIndex() && d.matched_blocks < keys.size() && ttl > 0) {
    keys.Need(keys.size());
    // Held until the request's first token (or completion), then speculative_ttl_s more: a
    // request queued behind others computes its blocks only when its prefill runs.
    const uint64_t credit =
        index_.AddSpeculative(chosen->id, sc.keys.data() + d.matched_blocks,
                              sc.keys.size() - d.matched_blocks, now, ttl,
                              /*hold=*/true);
    if (credit != 0 && !load_.AttachCredit(d.request_id, credit)) {
      index_.ReleaseSpeculative(credit, ttl);
    }
  }
  return d;
}

Policy* Router::DecidingPolicy(const SelectRequest& req, double mono, Decision* d) {
  bool all_degraded = true;
  for (const auto& w : workers_) {
    all_degraded = all_degraded && Untrusted(StateOf(*w, mono));
  }
  d->degraded = all_degraded;
  if (policy_->UsesIndex()) {
    // Deliberately fail over to a policy that needs no index when the index cannot be
    // trusted at all: no worker has reported anything yet, or every worker lost events.
    if (events_applied_.load(std::memory_order_relaxed) == 0) {
      d->reason = "no_events";
    } else if (all_degraded) {
      d->reason = "all_degraded";
    }
  } else if (policy_->NeedsExternal() && req.external == nullptr) {
    d->reason = "controller_down";  // without the controller this policy knows nothing
  }
  d->fallback = d->reason != std::string_view("policy");
  Policy* p = d->fallback ? fallback_.get() : policy_.get();
  d->policy = p->name();
  return p;
}

void Router::BuildCandidates(const SelectRequest& req, const MatchResult& match,
                             double block_size, bool hashes, std::vector<Candidate>* out) const {
  const double denom = req.num_tokens > 0 ? static_cast<double>(req.num_tokens) : 1.0;
  const double match_scale = block_size / denom;  // weighted blocks -> match_w
  const size_t nw = workers_.size();
  out->resize(nw);
  size_t n_excluded = 0;
  for (size_t i = 0; i < nw; ++i) {
    // The workers' lines (separate allocations) loaded ahead of their use.
    if (i + 8 < nw) {
      __builtin_prefetch(workers_[i + 8].get());
      __builtin_prefetch(reinterpret_cast<const char*>(workers_[i + 8].get()) + 64);
    }
    const WorkerRuntime& w = *workers_[i];
    Candidate& c = (*out)[i];
    c.id = w.id;
    c.match = match.weighted[w.id] * match_scale;
    c.weighted_blocks = match.weighted[w.id];
    c.pending_prefill = static_cast<double>(w.load.pending_prefill + w.load.peer_prefill);
    c.requests =
        static_cast<double>(w.load.inflight_requests + w.load.peer_inflight) + w.load.waiting;
    c.kv_usage = w.load.usage;
    c.active_blocks = static_cast<double>(w.load.active_blocks + w.load.peer_active_blocks);
    c.name_hash = hashes ? w.name_hash : 0;
    c.excluded = false;
    if (req.exclude != nullptr) {
      for (const std::string& x : *req.exclude) c.excluded = c.excluded || x == w.cfg.name;
      n_excluded += c.excluded ? 1 : 0;
    }
    c.external = 0.0;
    if (req.external != nullptr) {
      auto e = req.external->find(w.cfg.name);
      if (e != req.external->end() && e->second > 0) c.external = e->second;
    }
  }
  if (n_excluded == nw) {
    throw NoWorkerAvailable("every worker is excluded (" + std::to_string(n_excluded) + " of " +
                            std::to_string(nw) + ")");
  }
}

void Router::Explain(const MatchResult& match, const std::vector<Candidate>& cands,
                     const std::vector<ScoreTerms>& terms, double block_size,
                     Decision* d) const {
  d->scores.resize(workers_.size());
  for (size_t i = 0; i < workers_.size(); ++i) {
    WorkerScore& s = d->scores[i];
    s.worker = workers_[i]->cfg.name;
    s.matched_blocks = match.blocks[workers_[i]->id];
    s.weighted_matched_tokens = match.weighted[workers_[i]->id] * block_size;
    s.terms = terms[i];
    s.pending_prefill_tokens = cands[i].pending_prefill;
    s.requests = cands[i].requests;
  }
}

bool Router::Complete(uint64_t request_id) {
  uint64_t credit = 0;
  const bool known = load_.Complete(request_id, &credit);
  if (credit != 0) index_.ReleaseSpeculative(credit, speculative_ttl_s());
  return known;
}

bool Router::FirstToken(uint64_t request_id) {
  uint64_t credit = 0;
  const bool known = load_.FirstToken(request_id, &credit);
  if (credit != 0) index_.ReleaseSpeculative(credit, speculative_ttl_s());
  return known;
}

void Router::UpdateLoad(const std::string& name, std::optional<double> waiting,
                        std::optional<double> usage) {
  std::shared_ptr<WorkerRuntime> rt = Get(name);
  load_.Update(rt->load, waiting, usage);
}

void Router::ClearLoad(const std::string& name) {
  std::shared_ptr<WorkerRuntime> rt = Get(name);
  load_.Clear(rt->load);
}

void Router::SetPeerLoad(const std::string& name, int64_t inflight, int64_t pending_prefill,
                         int64_t active_blocks) {
  std::shared_ptr<WorkerRuntime> rt = Get(name);
  load_.SetPeer(rt->load, inflight, pending_prefill, active_blocks);
}

void Router::AddSpeculative(const std::string& name, const BlockKey* keys, size_t n,
                            double ttl_s) {
  if (!(ttl_s >= 0)) throw std::invalid_argument("ttl_s must be >= 0");
  std::shared_ptr<WorkerRuntime> rt = Get(name);
  if (n == 0 || ttl_s == 0) return;
  index_.AddSpeculative(rt->id, keys, n, MonoSeconds(), ttl_s);
}

std::vector<Router::OwnLoad> Router::LocalLoad() const {
  std::vector<OwnLoad> out;
  std::shared_lock wl(workers_mu_);
  std::lock_guard lock(load_.mu());
  for (const auto& w : workers_) {
    const WorkerLoad& l = w->load;
    if (l.inflight_requests == 0 && l.pending_prefill == 0 && l.active_blocks == 0) continue;
    out.push_back({w->cfg.name, l.inflight_requests, l.pending_prefill, l.active_blocks});
  }
  return out;
}

WorkerDump Router::DumpWorker(const std::string& name) const {
  std::shared_ptr<WorkerRuntime> rt = Get(name);
  WorkerDump d;
  d.at = rt->stream->Dump([&] { d.entries = index_.WorkerEntries(rt->id); });
  d.state = StateOf(*rt, MonoSeconds());
  return d;
}

bool Router::RestoreWorker(const std::string& name, const StreamPosition& at,
                           const std::vector<Index::WorkerEntry>& entries) {
  ThrowIfClosed();
  std::shared_ptr<WorkerRuntime> rt = Get(name);
  return rt->stream->Restore(at, [&] {
    ApplyCounts c;
    index_.RestoreEntries(rt->id, entries.data(), entries.size(), &c);
  });
}

std::vector<Index::WorkerEntry> Router::WorkerBlocks(const std::string& name) const {
  return index_.WorkerEntries(Get(name)->id);
}

std::vector<WorkerStats> Router::Stats() const {
  std::vector<std::shared_ptr<WorkerRuntime>> ws;
  {
    std::shared_lock wl(workers_mu_);
    ws = workers_;
  }
  const double now = MonoSeconds();
  std::vector<WorkerStats> out(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    WorkerRuntime& w = *ws[i];
    static_cast<StreamStats&>(out[i]) = w.stream->Snapshot(now);
    out[i].config = w.cfg;
    out[i].state = StateOf(w, now);
    out[i].indexed_blocks = index_.WorkerBlocks(w.id);
    out[i].evicted_by_cap = index_.WorkerEvictedByCap(w.id);
  }
  std::lock_guard lock(load_.mu());
  for (size_t i = 0; i < ws.size(); ++i) {
    const WorkerLoad& l = ws[i]->load;
    out[i].inflight_requests = l.inflight_requests;
    out[i].pending_prefill_tokens = l.pending_prefill;
    out[i].num_requests_waiting = l.waiting;
    out[i].kv_cache_usage_perc = l.usage;
    out[i].active_blocks = l.active_blocks;
    out[i].peer_inflight_requests = l.peer_inflight;
    out[i].peer_pending_prefill_tokens = l.peer_prefill;
    out[i].peer_active_blocks = l.peer_active_blocks;
  }
  return out;
}

}  // namespace kvroute
