// The fuse-rows pass: each row reduction (norms, softmax, trailing reduce_*) takes its
// elementwise prologue and epilogue into one `fused` node, one kernel on the CUDA backend.
#include <algorithm>
#include <unordered_map>
#include <vector>

#include "fusion.h"
#include "fusion_policy.h"

namespace kiln::fusion {
namespace {

class RowGrouper {
 public:
  RowGrouper(Graph& g, int64_t max_size) : max_size_(max_size) {
    for (Node* n : g.node_list()) {
      pos_[n] = static_cast<int>(order_.size());
      order_.push_back(n);
    }
  }

  /// Groups in graph order: each ungrouped anchor grows over producers and consumers that
  /// can_fuse allows, as long as no path leaves the group and comes back.
  std::vector<std::vector<Node*>> run() {
    std::vector<std::vector<Node*>> groups;
    for (Node* anchor : order_) {
      if (taken_.count(anchor)) continue;
      const std::optional<RowSpace> space = row_anchor(*anchor);
      if (!space) continue;
      std::vector<Node*> members = {anchor};
      for (bool grew = true; grew;) {
        grew = false;
        for (size_t i = 0; i < members.size(); ++i) {
          Node* m = members[i];
          for (Value* v : m->operands())
            if (Node* p = v->producer(); p && can_fuse(*p, *m, space)) grew |= try_add(members, p);
          for (Value* r : m->results())
            for (const Use& u : r->uses())
              if (u.user && can_fuse(*m, *u.user, space)) grew |= try_add(members, u.user);
        }
      }
      for (Node* m : members) taken_[m] = true;
      std::sort(members.begin(), members.end(), [&](Node* a, Node* b) { return pos_.at(a) < pos_.at(b); });
      groups.push_back(std::move(members));
    }
    return groups;
  }

 private:
  bool try_add(std::vector<Node*>& members, Node* n) {
    if (taken_.count(n) || std::find(members.begin(), members.end(), n) != members.end()) return false;
    if (static_cast<int64_t>(members.size()) >= max_size_) return false;
    members.push_back(n);
    if (!reenters(members)) return true;
    members.pop_back();
    return false;
  }

  /// Whether a node outside `members` is reachable from them and reaches back into them.
  bool reenters(const std::vector<Node*>& members) const {
    std::unordered_map<const Node*, bool> inside;
    int last = 0;
    for (const Node* m : members) {
      inside[m] = true;
      last = std::max(last, pos_.at(m));
    }
    std::vector<const Node*> work;
    std::unordered_map<const Node*, bool> seen;
    auto push_users = [&](const Node* n, bool outside) {
      for (const Value* r : n->results())
        for (const Use& u : r->uses()) {
          if (!u.user) continue;
          if (inside.count(u.user)) {
            if (outside) return true;
          } else if (pos_.at(u.user) < last && !seen[u.user]) {
            seen[u.user] = true;
            work.push_back(u.user);
          }
        }
      return false;
    };
    for (const Node* m : members) push_users(m, false);
    while (!work.empty()) {
      const Node* n = work.back();
      work.pop_back();
      if (push_users(n, true)) return true;
    }
    return false;
  }

  int64_t max_size_;
  std::vector<Node*> order_;
  std::unordered_map<const Node*, int> pos_;
  std::unordered_map<const Node*, bool> taken_;
};

class FuseRows final : public Pass {
 public:
  FuseRows(int64_t max_size, int64_t min_size) : max_size_(max_size), min_size_(min_size) {}

  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    // Each graph on its own; fused bodies are already one group.
    KILN_RETURN_IF_ERROR(walk_graphs(g, [&](Graph& sub) -> StatusOr<WalkAction> {
      if (is_fused_body(sub)) return WalkAction::kSkip;
      KILN_ASSIGN_OR_RETURN(bool fused_any,
                            fuse_groups(sub, RowGrouper(sub, max_size_).run(), min_size_));
      changed |= fused_any;
      return WalkAction::kAdvance;
    }));
    return changed;
  }

 private:
  int64_t max_size_, min_size_;
};

}  // namespace

PassInfo fuse_rows_pass_info() {
  PassInfo info;
  info.name = "fuse-rows";
  info.version = "0.1.0";
  info.summary = "fuse each row reduction with its elementwise prologue and epilogue, one kernel each";
  // A lone anchor is worth a group too: the row kernel is faster than the per-op one.
  info.options = {{"max-group-size", OptionType::kInt, int64_t{64}, "most nodes in one group"},
                  {"min-group-size", OptionType::kInt, int64_t{1}, "fewest nodes worth a fused node"}};
  info.create = [](const Options& opts) -> StatusOr<std::unique_ptr<Pass>> {
    const int64_t max_size = opts.get_int("max-group-size");
    const int64_t min_size = opts.get_int("min-group-size");
    for (const auto& [name, v] : {std::pair{"max-group-size", max_size}, std::pair{"min-group-size", min_size}})
      if (v < 1) return invalid_argument("fuse-rows: " + std::string(name) + " must be at least 1, got " + std::to_string(v));
    return std::unique_ptr<Pass>(std::make_unique<FuseRows>(max_size, min_size));
  };
  return info;
}

}  // namespace kiln::fusion
