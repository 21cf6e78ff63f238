#include "scoring/approx_tree.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <queue>
#include <sstream>

namespace kvroute {

namespace {

// Prompts longer than this are truncated (matched lengths are reported as uint32_t).
constexpr size_t kMaxPromptTokens = 0xFFFFFFFFu;

// Length of the common prefix of a[0, len) and b[0, len). memcmp runs over 64-token chunks
// (vectorised by libc); the first differing chunk is scanned.
size_t CommonPrefix(const uint32_t* a, const uint32_t* b, size_t len) {
  constexpr size_t kChunk = 64;
  size_t i = 0;
  while (i + kChunk <= len && std::memcmp(a + i, b + i, kChunk * sizeof(uint32_t)) == 0) {
    i += kChunk;
  }
  while (i < len && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

// ---- Children -------------------------------------------------------------------------------

uint32_t ApproxTree::Children::Find(uint32_t token) const {
  if (big_) {
    auto it = big_->find(token);
    return it == big_->end() ? kNil : it->second;
  }
  for (const auto& kv : small_) {
    if (kv.first == token) return kv.second;
  }
  return kNil;
}

void ApproxTree::Children::Set(uint32_t token, uint32_t node) {
  if (big_) {
    (*big_)[token] = node;
    return;
  }
  for (auto& kv : small_) {
    if (kv.first == token) {
      kv.second = node;
      return;
    }
  }
  if (small_.size() < kSmall) {
    small_.emplace_back(token, node);
    return;
  }
  big_ = std::make_unique<tsl::robin_map<uint32_t, uint32_t, TokenHash>>();
  big_->reserve(2 * kSmall);
  for (const auto& kv : small_) big_->emplace(kv.first, kv.second);
  std::vector<std::pair<uint32_t, uint32_t>>().swap(small_);
  (*big_)[token] = node;
}

void ApproxTree::Children::Erase(uint32_t token) {
  if (big_) {
    big_->erase(token);
    return;
  }
  for (size_t i = 0; i < small_.size(); ++i) {
    if (small_[i].first == token) {
      small_[i] = small_.back();
      small_.pop_back();
      return;
    }
  }
}

void ApproxTree::Children::Clear() {
  std::vector<std::pair<uint32_t, uint32_t>>().swap(small_);
  big_.reset();
}

// ---- Node -----------------------------------------------------------------------------------

size_t ApproxTree::Node::LowerBound(WorkerId w) const {
  size_t lo = 0, hi = tenants.size();
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (tenants[mid].worker < w) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

ApproxTree::Tenant* ApproxTree::Node::FindTenant(WorkerId w) {
  const size_t i = LowerBound(w);
  return i < tenants.size() && tenants[i].worker == w ? &tenants[i] : nullptr;
}

const ApproxTree::Tenant* ApproxTree::Node::FindTenant(WorkerId w) const {
  const size_t i = LowerBound(w);
  return i < tenants.size() && tenants[i].worker == w ? &tenants[i] : nullptr;
}

// ---- ApproxTree -----------------------------------------------------------------------------

ApproxTree::ApproxTree() {
  nodes_.emplace_back();
  nodes_[kRoot].live = true;
}

ApproxTree::~ApproxTree() = default;

uint32_t ApproxTree::NewNode() {
  uint32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {
    id = static_cast<uint32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  nodes_[id].live = true;
  nodes_[id].parent = kNil;
  ++live_nodes_;
  return id;
}

void ApproxTree::FreeNode(uint32_t id) {
  Node& x = nodes_[id];
  x.live = false;
  x.parent = kNil;
  std::vector<uint32_t>().swap(x.edge);
  x.children.Clear();
  std::vector<Tenant>().swap(x.tenants);
  free_.push_back(id);
  --live_nodes_;
}

size_t& ApproxTree::TokensOf(WorkerId w) {
  if (w >= worker_tokens_.size()) worker_tokens_.resize(size_t{w} + 1, 0);
  return worker_tokens_[w];
}

void ApproxTree::Walk(const uint32_t* tokens, size_t n, std::vector<PathStep>* path) const {
  path->clear();
  uint32_t cur = kRoot;
  size_t pos = 0;
  while (pos < n) {
    const uint32_t c = nodes_[cur].children.Find(tokens[pos]);
    if (c == kNil) break;
    const std::vector<uint32_t>& e = nodes_[c].edge;
    const size_t k = CommonPrefix(e.data(), tokens + pos, std::min(e.size(), n - pos));
    pos += k;
    path->push_back({c, static_cast<uint32_t>(pos)});
    if (k < e.size()) break;
    cur = c;
  }
}

ApproxTree::Reported ApproxTree::Report(const std::vector<PathStep>& path,
                                        std::vector<uint32_t>* out, size_t num_workers,
                                        std::vector<WorkerId>* best_workers) const {
  out->assign(num_workers, 0);
  Reported r;
  // From the deepest node up. Tenants of a node are a superset of those of its child on the
  // path, so a node with as many tenants as that child has exactly the same ones, all already
  // written: skip it. Otherwise write the workers not written yet (matched_end >= 1, so 0
  // means "not written"). The first node that writes anything holds the best workers.
  size_t deeper_size = 0;
  for (size_t i = path.size(); i-- > 0;) {
    const std::vector<Tenant>& ts = nodes_[path[i].node].tenants;
    if (ts.size() == deeper_size) continue;
    deeper_size = ts.size();
    const uint32_t end = path[i].matched_end;
    const bool first = r.best == 0;
    for (const Tenant& t : ts) {
      if (t.worker >= num_workers || (*out)[t.worker] != 0) continue;
      (*out)[t.worker] = end;
      if (first) {
        r.best = end;
        r.step = i;
        if (best_workers != nullptr) best_workers->push_back(t.worker);
      }
    }
  }
  return r;
}

uint32_t ApproxTree::Split(uint32_t c, size_t k) {
  const uint32_t p = NewNode();  // may reallocate nodes_: take references after
  Node& up = nodes_[p];
  Node& low = nodes_[c];
  up.parent = low.parent;
  up.edge.assign(low.edge.begin(), low.edge.begin() + static_cast<ptrdiff_t>(k));
  low.edge.erase(low.edge.begin(), low.edge.begin() + static_cast<ptrdiff_t>(k));
  up.tenants = low.tenants;
  for (Tenant& t : up.tenants) t.child_refs = 1;  // `low` is its only child, held by all
  up.children.Set(low.edge[0], c);
  nodes_[up.parent].children.Set(up.edge[0], p);
  low.parent = p;
  return p;
}

void ApproxTree::Touch(uint32_t node, WorkerId w, double now_s) {
  Node& x = nodes_[node];
  if (Tenant* t = x.FindTenant(w)) {
    t->last_access = std::max(t->last_access, now_s);
    return;
  }
  x.tenants.insert(x.tenants.begin() + static_cast<ptrdiff_t>(x.LowerBound(w)),
                   Tenant{w, 0, now_s});
  TokensOf(w) += x.edge.size();
  if (x.parent != kRoot) {
    // Insert attaches top-down, so the parent already holds w.
    nodes_[x.parent].FindTenant(w)->child_refs++;
  }
}

void ApproxTree::Detach(uint32_t node, WorkerId w) {
  Node& x = nodes_[node];
  const size_t i = x.LowerBound(w);
  if (i == x.tenants.size() || x.tenants[i].worker != w) return;
  x.tenants.erase(x.tenants.begin() + static_cast<ptrdiff_t>(i));
  worker_tokens_[w] -= x.edge.size();
  const uint32_t p = x.parent;
  if (p != kRoot) {
    if (Tenant* pt = nodes_[p].FindTenant(w)) pt->child_refs--;
  }
  if (x.tenants.empty()) {
    // Children's tenants are a subset of ours: no tenant left means no child left.
    nodes_[p].children.Erase(x.edge[0]);
    FreeNode(node);
  }
}

void ApproxTree::Insert(WorkerId w, const uint32_t* tokens, size_t n, double now_s) {
  n = std::min(n, kMaxPromptTokens);
  if (n == 0) return;
  std::unique_lock<std::shared_mutex> lock(mu_);
  TokensOf(w);
  uint32_t cur = kRoot;
  size_t pos = 0;
  while (pos < n) {
    uint32_t c = nodes_[cur].children.Find(tokens[pos]);
    if (c == kNil) {
      const uint32_t leaf = NewNode();
      nodes_[leaf].parent = cur;
      nodes_[leaf].edge.assign(tokens + pos, tokens + n);
      nodes_[cur].children.Set(tokens[pos], leaf);
      Touch(leaf, w, now_s);
      return;
    }
    const std::vector<uint32_t>& e = nodes_[c].edge;
    const size_t edge_len = e.size();
    const size_t k = CommonPrefix(e.data(), tokens + pos, std::min(edge_len, n - pos));
    if (k < edge_len) c = Split(c, k);
    Touch(c, w, now_s);
    pos += k;
    cur = c;
  }
}

uint32_t ApproxTree::Match(const uint32_t* tokens, size_t n, double now_s,
                           std::vector<uint32_t>* out, size_t num_workers) {
  thread_local std::vector<PathStep> path;
  thread_local std::vector<WorkerId> best_workers;
  n = std::min(n, kMaxPromptTokens);
  std::unique_lock<std::shared_mutex> lock(mu_);
  Walk(tokens, n, &path);
  best_workers.clear();
  const Reported r = Report(path, out, num_workers, &best_workers);
  if (r.best == 0) return 0;
  // The match may end inside the edge of path[r.step]: split it there so that only the
  // matched tokens are refreshed (an Insert of this prompt would split at the same place).
  const uint32_t start = r.step > 0 ? path[r.step - 1].matched_end : 0;
  const size_t k = r.best - start;
  if (k < nodes_[path[r.step].node].edge.size()) {
    path[r.step].node = Split(path[r.step].node, k);
  }
  // The best workers hold every node of path[0, r.step] (prefix-closed). best_workers is
  // sorted: when it is a node's whole tenant list, no search is needed.
  for (size_t i = 0; i <= r.step; ++i) {
    std::vector<Tenant>& ts = nodes_[path[i].node].tenants;
    if (ts.size() == best_workers.size()) {
      for (Tenant& t : ts) t.last_access = std::max(t.last_access, now_s);
      continue;
    }
    for (WorkerId w : best_workers) {
      Tenant* t = nodes_[path[i].node].FindTenant(w);
      t->last_access = std::max(t->last_access, now_s);
    }
  }
  return r.best;
}

uint32_t ApproxTree::Peek(const uint32_t* tokens, size_t n, std::vector<uint32_t>* out,
                          size_t num_workers) const {
  thread_local std::vector<PathStep> path;
  n = std::min(n, kMaxPromptTokens);
  std::shared_lock<std::shared_mutex> lock(mu_);
  Walk(tokens, n, &path);
  return Report(path, out, num_workers, nullptr).best;
}

size_t ApproxTree::EvictTo(size_t max_tokens_per_worker) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  const auto over = [&](WorkerId w) {
    return w < worker_tokens_.size() && worker_tokens_[w] > max_tokens_per_worker;
  };
  bool any = false;
  for (size_t w = 0; w < worker_tokens_.size() && !any; ++w) any = over(static_cast<WorkerId>(w));
  if (!any) return 0;

  struct Item {
    double last_access;
    uint32_t node;
    WorkerId worker;
    bool operator>(const Item& o) const {
      if (last_access != o.last_access) return last_access > o.last_access;
      if (node != o.node) return node > o.node;
      return worker > o.worker;
    }
  };
  std::vector<Item> items;
  for (uint32_t id = 1; id < nodes_.size(); ++id) {
    const Node& x = nodes_[id];
    if (!x.live) continue;
    for (const Tenant& t : x.tenants) {
      if (t.child_refs == 0 && over(t.worker)) items.push_back({t.last_access, id, t.worker});
    }
  }
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap(std::greater<Item>(),
                                                                        std::move(items));
  size_t evicted = 0;
  while (!heap.empty()) {
    const Item it = heap.top();
    heap.pop();
    if (!over(it.worker)) continue;
    const Node& x = nodes_[it.node];
    const Tenant* t = x.live ? x.FindTenant(it.worker) : nullptr;
    if (t == nullptr || t->child_refs != 0) continue;  // not expected: no node is created here
    const uint32_t parent = x.parent;
    evicted += x.edge.size();
    Detach(it.node, it.worker);
    if (parent != kRoot) {
      const Tenant* pt = nodes_[parent].FindTenant(it.worker);
      if (pt != nullptr && pt->child_refs == 0) {
        heap.push({pt->last_access, parent, it.worker});
      }
    }
  }
  return evicted;
}

void ApproxTree::RemoveWorker(WorkerId w) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (w >= worker_tokens_.size()) return;
  // Pre-order over the nodes w holds (prefix-closed: stop at children it does not hold), then
  // detach in reverse so that every node is a leaf for w when detached.
  std::vector<uint32_t> order;
  std::vector<uint32_t> stack{kRoot};
  while (!stack.empty()) {
    const uint32_t id = stack.back();
    stack.pop_back();
    if (id != kRoot) order.push_back(id);
    nodes_[id].children.ForEach([&](uint32_t, uint32_t c) {
      if (nodes_[c].FindTenant(w) != nullptr) stack.push_back(c);
    });
  }
  for (size_t i = order.size(); i-- > 0;) Detach(order[i], w);
  worker_tokens_[w] = 0;
}

size_t ApproxTree::WorkerTokens(WorkerId w) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return w < worker_tokens_.size() ? worker_tokens_[w] : 0;
}

size_t ApproxTree::NodeCount() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return live_nodes_;
}

std::vector<ApproxTree::HeldEdge> ApproxTree::DebugEdges(WorkerId w) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  std::vector<HeldEdge> out;
  std::vector<uint32_t> path;
  std::vector<std::pair<uint32_t, size_t>> stack{{kRoot, 0}};  // (node, tokens above it)
  while (!stack.empty()) {
    const auto [id, above] = stack.back();
    stack.pop_back();
    const Node& x = nodes_[id];
    path.resize(above);
    path.insert(path.end(), x.edge.begin(), x.edge.end());
    if (id != kRoot) {
      const Tenant* t = x.FindTenant(w);
      if (t == nullptr) continue;
      out.push_back({path, static_cast<uint32_t>(x.edge.size()), t->last_access});
    }
    const size_t below = path.size();
    x.children.ForEach([&](uint32_t, uint32_t c) { stack.emplace_back(c, below); });
  }
  return out;
}

std::string ApproxTree::CheckInvariants() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  std::ostringstream err;
  const Node& root = nodes_[kRoot];
  if (!root.live || !root.edge.empty() || !root.tenants.empty() || root.parent != kNil) {
    return "bad root";
  }
  std::vector<size_t> tokens(worker_tokens_.size(), 0);
  size_t live = 0;
  for (uint32_t id = 0; id < nodes_.size(); ++id) {
    const Node& x = nodes_[id];
    if (!x.live) continue;
    bool bad_child = false;
    x.children.ForEach([&](uint32_t tok, uint32_t c) {
      if (c >= nodes_.size() || !nodes_[c].live || nodes_[c].parent != id ||
          nodes_[c].edge.empty() || nodes_[c].edge[0] != tok) {
        bad_child = true;
      }
    });
    if (bad_child) {
      err << "node " << id << ": bad child link";
      return err.str();
    }
    if (id == kRoot) continue;
    ++live;
    if (x.edge.empty()) {
      err << "node " << id << ": empty edge";
      return err.str();
    }
    if (x.parent >= nodes_.size() || !nodes_[x.parent].live ||
        nodes_[x.parent].children.Find(x.edge[0]) != id) {
      err << "node " << id << ": bad parent link";
      return err.str();
    }
    if (x.tenants.empty()) {
      err << "node " << id << ": no tenant";
      return err.str();
    }
    for (size_t i = 0; i < x.tenants.size(); ++i) {
      const Tenant& t = x.tenants[i];
      if (i > 0 && x.tenants[i - 1].worker >= t.worker) {
        err << "node " << id << ": tenants not sorted or duplicate " << t.worker;
        return err.str();
      }
      if (t.worker >= tokens.size()) {
        err << "node " << id << ": tenant " << t.worker << " has no token count";
        return err.str();
      }
      tokens[t.worker] += x.edge.size();
      if (x.parent != kRoot) {
        const Tenant* pt = nodes_[x.parent].FindTenant(t.worker);
        if (pt == nullptr) {
          err << "node " << id << ": tenant " << t.worker << " missing from parent";
          return err.str();
        }
        if (pt->last_access < t.last_access) {
          err << "node " << id << ": tenant " << t.worker << " newer than in parent";
          return err.str();
        }
      }
      uint32_t refs = 0;
      x.children.ForEach([&](uint32_t, uint32_t c) {
        if (nodes_[c].FindTenant(t.worker) != nullptr) ++refs;
      });
      if (refs != t.child_refs) {
        err << "node " << id << ": tenant " << t.worker << " child_refs " << t.child_refs
            << " != " << refs;
        return err.str();
      }
    }
  }
  if (live != live_nodes_) {
    err << "live nodes " << live << " != " << live_nodes_;
    return err.str();
  }
  if (live + 1 + free_.size() != nodes_.size()) return "free list size mismatch";
  for (uint32_t id : free_) {
    if (nodes_[id].live) return "live node on the free list";
  }
  for (size_t w = 0; w < tokens.size(); ++w) {
    if (tokens[w] != worker_tokens_[w]) {
      err << "worker " << w << ": tokens " << worker_tokens_[w] << " != " << tokens[w];
      return err.str();
    }
  }
  return {};
}

}  // namespace kvroute
