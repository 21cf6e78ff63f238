// Approximate prefix tree of the `cache_aware` policy: a multi-worker radix tree over token
// ids, built only from the router's own routing decisions (no KV events).
//
// Thread safety: every public method may be called from any thread at any time. One
// std::shared_mutex guards the tree. Insert, Match, EvictTo and RemoveWorker hold it
// exclusively: Match refreshes last-access times (as SGLang's prefix_match does) and may split
// an edge, so it writes; matches are a few µs and every routed request also takes the lock
// exclusively for its Insert, so sharing Match would buy little. Peek (a Match that writes
// nothing), WorkerTokens, NodeCount, DebugEdges and CheckInvariants hold it shared. Nothing
// calls back into the caller under the lock.
//
// Semantics (after sgl-project/sglang sgl-router/src/tree.rs and vllm-project/router
// src/tree.rs, src/policies/cache_aware.rs, on token ids instead of characters):
//   - A node owns one edge (a non-empty token span) and a list of (worker, last access) tenants.
//     A worker holds a node's tokens all or nothing. What a worker holds is prefix-closed: if it
//     holds a node it holds every ancestor. Every node but the root has at least one tenant.
//   - Insert(w, tokens) walks/creates the path of `tokens`, splitting an edge where the prompt
//     leaves it or ends inside it, attaches w to every node on the path and sets their last
//     access for w to max(last access, now_s).
//   - Match reports, per worker, the longest prefix of the prompt it holds (a match may end
//     inside an edge). It then refreshes, to max(last access, now_s), the last access of the
//     matched path for the worker(s) with the longest match: all of them when tied (SGLang
//     refreshes one arbitrary tenant of the deepest matched node, i.e. one of those). Where the
//     best match ends inside an edge, Match splits that edge there and refreshes only the
//     matched part (SGLang refreshes the whole partially matched node); the Insert that follows
//     a routing decision would split at the same place. So every refresh covers a path from the
//     root to a node boundary, and all tokens of one node share their last access: LRU is exact
//     at token level, applied one node at a time. Peek reports the same without refreshing or
//     splitting.
//   - A worker's size is the sum of the edge lengths of the nodes it holds (SGLang's
//     tenant_char_count, in tokens). EvictTo(max) repeatedly removes the worker from its least
//     recently accessed leaf (a node it holds none of whose children it holds) while its size is
//     > max; a node left without tenants is deleted. Whole edges go, so a worker may end below
//     max by up to one edge. Since a refresh always covers a path from the root, a node's last
//     access is never older than its descendants', so this evicts in last-access order (ties:
//     deeper first). vLLM's router differs: it stamps only the end node of an insert (and one
//     match in 8), with a global counter instead of a clock.
//   - Nodes are never merged back after eviction (neither are SGLang's).
//
// Costs (n = prompt tokens, d = nodes on the prompt's path, t = tenants per node, b = workers
// tied for the best match). Tenant lists are sorted by worker id.
//   Insert O(n + d·t) (t for inserting a new tenant in order; a lookup is O(log t)).
//   Peek O(n + d + num_workers + Σ t over the path nodes whose tenant set differs from their
//     child's); Match adds the refresh, O(d·b·log t) (O(d·t) where the best are all tenants),
//     and at most one edge split. A node's tenants are a superset of its child's, so a node
//     with as many tenants as its child on the path is skipped.
//   RemoveWorker(w) O(nodes of w · t). EvictTo O(all (node, worker) pairs + E·log E) for E
//     evicted entries; only an O(workers) check when no worker is over the limit. Run it
//     periodically (the SGLang/vLLM routers do so from a background thread), not per request.
// Memory: ~120 bytes per node plus 4 bytes per edge token and 16 bytes per (node, worker).
// Measured (benchmarks/bench_approx_tree.cc, 64 workers, ~1M distinct tokens in the tree, 8K-token
// prompts matching ~8.1K tokens): Match 2-5 µs, Peek 2-3.5 µs, Insert ~5 µs.
#pragma once

#include <tsl/robin_map.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/types.h"

namespace kvroute {

class ApproxTree {
 public:
  ApproxTree();
  ~ApproxTree();
  ApproxTree(const ApproxTree&) = delete;
  ApproxTree& operator=(const ApproxTree&) = delete;

  // Records that `tokens[0, n)` were routed to worker w at time now_s (seconds, caller's clock;
  // only the order of times matters). n == 0 does nothing.
  void Insert(WorkerId w, const uint32_t* tokens, size_t n, double now_s);

  // out is resized to num_workers (index = WorkerId); (*out)[w] = length in tokens of the
  // longest prefix of tokens[0, n) that worker w holds, 0 if none. Workers with an id
  // >= num_workers are neither reported nor refreshed. Refreshes the last access of the
  // matched path of the best worker(s) to now_s (see the header comment). Returns the longest
  // match over the reported workers.
  uint32_t Match(const uint32_t* tokens, size_t n, double now_s, std::vector<uint32_t>* out,
                 size_t num_workers);
  // Match without refreshing anything (shared lock).
  uint32_t Peek(const uint32_t* tokens, size_t n, std::vector<uint32_t>* out,
                size_t num_workers) const;

  // Evicts each worker's least recently accessed leaf nodes until it holds
  // <= max_tokens_per_worker tokens. Returns the number of (worker, token) pairs evicted.
  size_t EvictTo(size_t max_tokens_per_worker);

  // Drops every node held by w (and the nodes no other worker holds).
  void RemoveWorker(WorkerId w);

  // Tokens held by w: the sum of the edge lengths of its nodes.
  size_t WorkerTokens(WorkerId w) const;
  // Nodes in the tree, root excluded.
  size_t NodeCount() const;

  // ---- for tests; O(tree) ----
  struct HeldEdge {
    std::vector<uint32_t> path;  // tokens from the root to the end of the edge
    uint32_t edge_len = 0;       // the edge is path[path.size() - edge_len, path.size())
    double last_access = 0.0;
  };
  // The nodes w holds, in depth-first order.
  std::vector<HeldEdge> DebugEdges(WorkerId w) const;
  // Empty if every structural invariant holds, else a description of the first violation.
  std::string CheckInvariants() const;

 private:
  struct Tenant {
    WorkerId worker;
    uint32_t child_refs;  // children of this node that this worker also holds
    double last_access;
  };

  struct TokenHash {
    size_t operator()(uint32_t t) const noexcept {
      return static_cast<size_t>((uint64_t{t} * 0x9E3779B97F4A7C15ull) >> 32);
    }
  };

  // Children keyed by the first token of their edge: a short unsorted vector, a hash map past
  // kSmall entries.
  class Children {
   public:
    uint32_t Find(uint32_t token) const;  // kNil if absent
    void Set(uint32_t token, uint32_t node);
    void Erase(uint32_t token);
    size_t size() const { return big_ ? big_->size() : small_.size(); }
    template <typename F>
    void ForEach(F&& f) const {
      if (big_) {
        for (const auto& kv : *big_) f(kv.first, kv.second);
      } else {
        for (const auto& kv : small_) f(kv.first, kv.second);
      }
    }
    void Clear();

   private:
    static constexpr size_t kSmall = 8;
    std::vector<std::pair<uint32_t, uint32_t>> small_;
    std::unique_ptr<tsl::robin_map<uint32_t, uint32_t, TokenHash>> big_;
  };

  struct Node {
    uint32_t parent = kNil;
    bool live = false;
    std::vector<uint32_t> edge;
    Children children;
    std::vector<Tenant> tenants;  // sorted by worker

    size_t LowerBound(WorkerId w) const;
    Tenant* FindTenant(WorkerId w);
    const Tenant* FindTenant(WorkerId w) const;
  };

  struct PathStep {
    uint32_t node;
    uint32_t matched_end;  // prompt tokens matched once this node is walked (may end mid-edge)
  };

  static constexpr uint32_t kNil = 0xFFFFFFFFu;
  static constexpr uint32_t kRoot = 0;

  uint32_t NewNode();
  void FreeNode(uint32_t id);
  // Walks the prompt down the tree; fills `path` (one step per node entered).
  void Walk(const uint32_t* tokens, size_t n, std::vector<PathStep>* path) const;
  struct Reported {
    uint32_t best = 0;  // longest match over reported workers (0: none)
    size_t step = 0;    // path index of the node where the best match ends
  };
  // Fills out (see Match); appends the best workers, sorted, to best_workers if not null.
  Reported Report(const std::vector<PathStep>& path, std::vector<uint32_t>* out,
                  size_t num_workers, std::vector<WorkerId>* best_workers) const;
  // Splits node c after k edge tokens (0 < k < edge length); returns the new upper node.
  uint32_t Split(uint32_t c, size_t k);
  // Attaches w to node (non-root) or refreshes its last access.
  void Touch(uint32_t node, WorkerId w, double now_s);
  // Removes w from node (a leaf for w); deletes the node if no tenant is left.
  void Detach(uint32_t node, WorkerId w);
  size_t& TokensOf(WorkerId w);

  mutable std::shared_mutex mu_;
  std::vector<Node> nodes_;           // nodes_[kRoot] is the root (empty edge, no tenants)
  std::vector<uint32_t> free_;        // ids of dead nodes, reused first
  size_t live_nodes_ = 0;             // root excluded
  std::vector<size_t> worker_tokens_;  // by WorkerId
};

}  // namespace kvroute
