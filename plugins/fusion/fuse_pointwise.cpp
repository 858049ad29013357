// The fuse-pointwise pass: groups connected elementwise nodes into `fused` nodes, one kernel each.
#include <algorithm>
#include <optional>
#include <queue>
#include <string>
#include <unordered_map>
#include <vector>

#include "fusion.h"
#include "fusion_policy.h"

namespace kiln::fusion {

/// Whether `n` or anything nested in it must not be moved or merged.
bool has_side_effects(const Node& n) {
  return walk(n, [](const Node& m) {
    return m.op() && m.op()->has(kTraitSideEffects) ? WalkAction::kInterrupt : WalkAction::kAdvance;
  });
}

bool has_unknown_dim(const Shape& s) {
  return std::any_of(s.begin(), s.end(), [](const Dim& d) { return d.is_unknown(); });
}

/// Numpy broadcasting of `a` and `b`, strict about symbols: a dim joins only an equal dim or a
/// static 1. The IR's rule also lets a symbol meet a static size (assuming the symbol is 1 at
/// run time); a group built on that guess could not be checked here, so it is refused.
std::optional<Shape> strict_join(const Shape& a, const Shape& b) {
  const Shape& big = a.size() >= b.size() ? a : b;
  const Shape& small = a.size() >= b.size() ? b : a;
  Shape out = big;
  const size_t lead = big.size() - small.size();
  for (size_t d = 0; d < small.size(); ++d) {
    const Dim& x = big[lead + d];
    const Dim& y = small[d];
    if (x == y || y == Dim(1)) continue;
    if (x == Dim(1))
      out[lead + d] = y;
    else
      return std::nullopt;
  }
  return out;
}

/// Whether `from` broadcasts to exactly `to`.
bool broadcasts_into(const Shape& from, const Shape& to) {
  std::optional<Shape> j = strict_join(from, to);
  return j && *j == to;
}

/// A constant the CUDA backend inlines as a literal in a pointwise kernel: exactly one element.
/// Groups copy these into their region instead of taking them as inputs.
bool is_scalar_constant(const Node* n) {
  if (!n || n->op_name() != "constant" || n->num_results() != 1) return false;
  const Attribute* v = n->attr("value");
  return v && v->kind() == AttrKind::kTensor && v->as_tensor().numel() == 1;
}

namespace {

/// Whether `n` may be a group member: what the CUDA backend accepts in a one-kernel fused
/// region (elementwise ops and identity, one result each), with shapes whose broadcasting can
/// be checked here.
bool is_member_candidate(const Node& n) {
  if (is_epilogue_only(n)) return true;
  if (!n.op() || n.num_results() != 1 || n.num_regions() > 0 || has_side_effects(n)) return false;
  if (!n.op()->has(kTraitElementwise) && n.op_name() != "identity") return false;
  const Shape& out = n.result()->shape();
  if (has_unknown_dim(out)) return false;
  for (const Value* v : n.operands())
    if (has_unknown_dim(v->shape()) || !broadcasts_into(v->shape(), out)) return false;
  return true;
}

class Grouper {
 public:
  Grouper(Graph& g, int64_t max_size) : max_size_(max_size) {
    for (Node* n : g.node_list()) {
      pos_[n] = static_cast<int>(order_.size());
      order_.push_back(n);
    }
    group_of_.assign(order_.size(), -1);
    movement_.assign(order_.size(), 0);
    for (size_t i = 0; i < order_.size(); ++i)
      movement_[i] = !is_member_candidate(*order_[i]) && is_movement_member(*order_[i]);
    mark_.assign(order_.size(), 0);
    seen_.assign(order_.size(), 0);
  }

  /// Greedy grouping in topological order: each candidate joins its producers' groups, one
  /// after another, as long as each union stays valid; otherwise it starts a group of its own.
  std::vector<std::vector<int>> run() {
    for (int i = 0; i < static_cast<int>(order_.size()); ++i) {
      if (!is_member_candidate(*order_[static_cast<size_t>(i)])) continue;
      int mine = -1;
      const Node& node = *order_[static_cast<size_t>(i)];
      for (const Value* v : node.operands()) {
        if (v->producer() && is_running_sum_edge(*v->producer(), node)) continue;
        // An f8 value or an amax only leaves its group: nothing joins through it.
        if (v->dtype() == DType::kF8E4M3FN || v->dtype() == DType::kF8E5M2) continue;
        if (v->producer() && is_amax_epilogue(*v->producer())) continue;
        const int gid = v->producer() ? group_of_[static_cast<size_t>(pos_.at(v->producer()))] : -1;
        if (gid < 0 || gid == mine) continue;
        std::vector<int> merged = groups_[static_cast<size_t>(gid)];
        if (mine < 0)
          merged.push_back(i);
        else
          merged.insert(merged.end(), groups_[static_cast<size_t>(mine)].begin(),
                        groups_[static_cast<size_t>(mine)].end());
        if (!valid(merged)) continue;
        if (mine < 0) {
          mine = gid;
        } else {
          for (int m : groups_[static_cast<size_t>(gid)]) group_of_[static_cast<size_t>(m)] = mine;
          groups_[static_cast<size_t>(gid)].clear();
        }
        std::sort(merged.begin(), merged.end());
        groups_[static_cast<size_t>(mine)] = std::move(merged);
      }
      if (mine < 0) {
        mine = static_cast<int>(groups_.size());
        groups_.push_back({i});
      }
      group_of_[static_cast<size_t>(i)] = mine;
    }
    // A copy fed by other copies (the heads of q, k or v cut from one fused QKV projection and
    // transposed) becomes one kernel: such a copy seeds a group that absorb() grows upwards.
    for (int i = 0; i < static_cast<int>(order_.size()); ++i)
      if (movement_[static_cast<size_t>(i)] && group_of_[static_cast<size_t>(i)] < 0 &&
          is_copy(*order_[static_cast<size_t>(i)]) && copies_input(*order_[static_cast<size_t>(i)])) {
        group_of_[static_cast<size_t>(i)] = static_cast<int>(groups_.size());
        groups_.push_back({i});
      }
    absorb();
    // Groups without arithmetic are only worth a kernel when they merge two copies or more.
    for (std::vector<int>& members : groups_) {
      const bool computes = std::any_of(members.begin(), members.end(), [&](int m) {
        return order_[static_cast<size_t>(m)]->op()->has(kTraitElementwise);
      });
      const auto copies = std::count_if(members.begin(), members.end(),
                                        [&](int m) { return is_copy(*order_[static_cast<size_t>(m)]); });
      if (!computes && copies < 2) {
        for (int m : members) group_of_[static_cast<size_t>(m)] = -1;
        members.clear();
      }
    }
    return groups_;
  }

  const std::vector<Node*>& order() const { return order_; }

 private:
  /// A member set is valid when it fits the size limit, its result shapes broadcast to one
  /// shape S that every value leaving the group has exactly (one kernel writes every output over
  /// S), and no path leaves the group and comes back (the fused node could not be placed).
  bool valid(const std::vector<int>& members) {
    if (static_cast<int64_t>(members.size()) > max_size_) return false;
    for (int m : members) mark_[static_cast<size_t>(m)] = 1;
    const bool ok = shapes_agree(members) && !reenters(members);
    for (int m : members) mark_[static_cast<size_t>(m)] = 0;
    return ok;
  }

  bool inside(const Node* n) const { return n && mark_[static_cast<size_t>(pos_.at(n))]; }

  /// Movement ops that move bytes when they run alone (the others are views of their input).
  static bool is_copy(const Node& n) {
    const std::string& op = n.op_name();
    return op == "transpose" || op == "slice" || op == "concat" || op == "expand";
  }

  /// Whether `n`'s input comes, through views, from another copy used nowhere else.
  bool copies_input(const Node& n) const {
    const Node* p = n.operand(0)->producer();
    while (p && p->num_results() == 1 && p->result()->uses().size() == 1 &&
           movement_[static_cast<size_t>(pos_.at(p))]) {
      if (is_copy(*p)) return true;
      p = p->operand(0)->producer();
    }
    return false;
  }

  /// Pulls into each group the producers whose every use is in the group: data-movement ops
  /// (which the CUDA lowering turns into index arithmetic of the group's kernel) and, through
  /// them, elementwise groups the greedy pass could not reach. A movement op used anywhere
  /// else stays out: a transpose feeding a matmul is fold-layout's (gemm trans flags), and a
  /// view that escapes would be materialized. Groups are seeded by elementwise ops, or by a copy
  /// fed by copies (see run()).
  void absorb() {
    for (size_t gid = groups_.size(); gid-- > 0;) {
      // A group of identities alone would only wrap the movement ops in a kernel of their own.
      const bool computes = std::any_of(groups_[gid].begin(), groups_[gid].end(), [&](int m) {
        return order_[static_cast<size_t>(m)]->op()->has(kTraitElementwise);
      });
      const bool seeded_by_copy = groups_[gid].size() == 1 && movement_[static_cast<size_t>(groups_[gid][0])];
      for (bool grew = computes || seeded_by_copy; grew && !groups_[gid].empty();) {
        grew = false;
        std::vector<int> candidates;
        for (int m : groups_[gid]) mark_[static_cast<size_t>(m)] = 1;
        for (int m : groups_[gid])
          for (const Value* v : order_[static_cast<size_t>(m)]->operands()) {
            const Node* p = v->producer();
            if (!p || inside(p) || is_running_sum_edge(*p, *order_[static_cast<size_t>(m)])) continue;
            const int q = pos_.at(p);
            if (!movement_[static_cast<size_t>(q)] && group_of_[static_cast<size_t>(q)] < 0) continue;
            const auto& uses = p->result()->uses();
            if (std::all_of(uses.begin(), uses.end(), [&](const Use& u) { return inside(u.user); }))
              candidates.push_back(q);
          }
        for (int m : groups_[gid]) mark_[static_cast<size_t>(m)] = 0;
        for (int q : candidates) {
          const int other = group_of_[static_cast<size_t>(q)];
          if (other == static_cast<int>(gid)) continue;
          std::vector<int> merged = groups_[gid];
          if (other < 0)
            merged.push_back(q);
          else
            merged.insert(merged.end(), groups_[static_cast<size_t>(other)].begin(),
                          groups_[static_cast<size_t>(other)].end());
          if (!valid(merged)) continue;
          if (other >= 0) groups_[static_cast<size_t>(other)].clear();
          std::sort(merged.begin(), merged.end());
          for (int m : merged) group_of_[static_cast<size_t>(m)] = static_cast<int>(gid);
          groups_[gid] = std::move(merged);
          grew = true;
          break;
        }
      }
    }
  }

  /// Elementwise-only sets need their result shapes to broadcast to one shape (the plain
  /// pointwise kernel indexes every value by the output's index); with movement ops each value
  /// is computed at its own index, so only the values leaving the group must share one shape.
  bool shapes_agree(const std::vector<int>& members) const {
    if (std::any_of(members.begin(), members.end(), [&](int m) { return movement_[static_cast<size_t>(m)]; })) {
      const Shape* first = nullptr;
      for (int m : members) {
        if (is_amax_epilogue(*order_[static_cast<size_t>(m)])) continue;
        const Value* v = order_[static_cast<size_t>(m)]->result();
        const bool escapes = std::any_of(v->uses().begin(), v->uses().end(),
                                         [&](const Use& u) { return !inside(u.user); });
        if (!escapes) continue;
        if (first && v->shape() != *first) return false;
        first = &v->shape();
      }
      return true;
    }
    std::optional<Shape> s = Shape{};
    for (int m : members) {
      s = strict_join(*s, order_[static_cast<size_t>(m)]->result()->shape());
      if (!s) return false;
    }
    for (int m : members) {
      const Node& n = *order_[static_cast<size_t>(m)];
      if (is_amax_epilogue(n)) continue;  // its one value leaves by an atomic, not per element
      const Value* v = n.result();
      const bool escapes = std::any_of(v->uses().begin(), v->uses().end(),
                                       [&](const Use& u) { return !inside(u.user); });
      if (escapes && v->shape() != *s) return false;
    }
    return true;
  }

  /// Whether some node outside the set is reachable from the set and reaches back into it.
  /// Only nodes before the set's last member can lead back, which bounds the walk.
  bool reenters(const std::vector<int>& members) {
    const int last = *std::max_element(members.begin(), members.end());
    ++stamp_;
    std::vector<int> work;
    bool from_outside = false;
    // Pushes the outside users of `n`; true when `n` is outside and one of its users is a member.
    auto visit = [&](const Node* n) {
      for (const Value* r : n->results())
        for (const Use& u : r->uses()) {
          if (!u.user) continue;
          const int p = pos_.at(u.user);
          if (mark_[static_cast<size_t>(p)]) {
            if (from_outside) return true;
          } else if (p < last && seen_[static_cast<size_t>(p)] != stamp_) {
            seen_[static_cast<size_t>(p)] = stamp_;
            work.push_back(p);
          }
        }
      return false;
    };
    for (int m : members) visit(order_[static_cast<size_t>(m)]);
    from_outside = true;
    while (!work.empty()) {
      const int p = work.back();
      work.pop_back();
      if (visit(order_[static_cast<size_t>(p)])) return true;
    }
    return false;
  }

  int64_t max_size_;
  std::vector<Node*> order_;
  std::unordered_map<const Node*, int> pos_;
  std::vector<int> group_of_;
  std::vector<char> movement_;  // data-movement ops, members only through absorb()
  std::vector<std::vector<int>> groups_;
  std::vector<char> mark_;
  std::vector<int> seen_;
  int stamp_ = 0;
};

}  // namespace

/// Replaces `members` (in graph order) with one fused node. Returns false, changing nothing,
/// when no member's value is used after the group (a dead group is left to dce).
StatusOr<bool> build_fused(Graph& g, const std::vector<Node*>& members) {
  std::unordered_map<const Node*, bool> is_member;
  for (Node* n : members) is_member[n] = true;
  auto body = std::make_unique<Graph>("fused");
  std::unordered_map<const Value*, Value*> map;
  std::vector<Value*> operands;
  for (Node* n : members)
    for (Value* v : n->operands()) {
      if (map.count(v) || (v->producer() && is_member.count(v->producer()))) continue;
      if (is_scalar_constant(v->producer())) {
        const Node* c = v->producer();
        KILN_ASSIGN_OR_RETURN(Node * copy, body->create_node("constant", {}, {v->type()},
                                                             c->attrs(), nullptr, {v->name()}));
        copy->set_loc(c->loc());
        map[v] = copy->result();
      } else {
        map[v] = body->add_input(v->name(), v->type());
        operands.push_back(v);
      }
    }
  std::vector<Value*> escaping;
  for (Node* n : members) {
    std::vector<Value*> ins;
    for (Value* v : n->operands()) ins.push_back(map.at(v));
    KILN_ASSIGN_OR_RETURN(Node * copy,
                          body->create_node(n->op_name(), ins, {n->result()->type()}, n->attrs(),
                                            nullptr, {n->result()->name()}));
    copy->set_loc(n->loc());
    map[n->result()] = copy->result();
    const auto& uses = n->result()->uses();
    if (std::any_of(uses.begin(), uses.end(),
                    [&](const Use& u) { return !u.user || !is_member.count(u.user); }))
      escaping.push_back(n->result());
  }
  if (escaping.empty()) return false;
  std::vector<Value*> outs;
  std::vector<TensorType> types;
  std::vector<std::string> names;
  for (Value* v : escaping) {
    outs.push_back(map.at(v));
    types.push_back(v->type());
    names.push_back(v->name());
  }
  body->set_outputs(outs);
  KILN_ASSIGN_OR_RETURN(Node * fused,
                        g.create_node("fused", operands, types, {}, members.back(), names));
  fused->set_loc(members.front()->loc());
  fused->add_region(std::move(body));
  for (size_t k = 0; k < escaping.size(); ++k)
    escaping[k]->replace_all_uses_with(fused->result(static_cast<int>(k)));
  for (auto it = members.rbegin(); it != members.rend(); ++it)
    KILN_RETURN_IF_ERROR(g.erase_node(*it));
  return true;
}

/// Restores a topological order, keeping the current order where it already is one. Needed
/// because a fused node sits at its last member's place, while a consumer of an earlier
/// member's value may have come before that.
void reorder(Graph& g) {
  const std::vector<Node*> nodes = g.node_list();
  std::unordered_map<const Node*, int> pos, pending;
  for (size_t i = 0; i < nodes.size(); ++i) pos[nodes[i]] = static_cast<int>(i);
  std::priority_queue<int, std::vector<int>, std::greater<>> ready;
  for (Node* n : nodes) {
    int deps = 0;
    for (const Value* v : n->operands()) deps += v->producer() ? 1 : 0;
    pending[n] = deps;
    if (deps == 0) ready.push(pos[n]);
  }
  while (!ready.empty()) {
    Node* n = nodes[static_cast<size_t>(ready.top())];
    ready.pop();
    g.move_node_before(n, nullptr);
    for (const Value* r : n->results())
      for (const Use& u : r->uses())
        if (u.user && --pending[u.user] == 0) ready.push(pos[u.user]);
  }
}

StatusOr<bool> fuse_groups(Graph& g, const std::vector<std::vector<Node*>>& groups, int64_t min_size) {
  std::vector<Node*> scalar_constants;
  for (Node* n : g.node_list())
    if (is_scalar_constant(n) && n->result()->has_uses()) scalar_constants.push_back(n);
  bool fused_any = false;
  for (const std::vector<Node*>& members : groups) {
    if (members.empty() || static_cast<int64_t>(members.size()) < min_size) continue;
    KILN_ASSIGN_OR_RETURN(bool f, build_fused(g, members));
    fused_any |= f;
  }
  if (!fused_any) return false;
  // Constants now copied into every region that used them.
  for (Node* c : scalar_constants)
    if (!c->result()->has_uses()) KILN_RETURN_IF_ERROR(g.erase_node(c));
  reorder(g);
  return true;
}

namespace {

/// Replaces each static `split` whose pieces all feed movement ops by one `slice` per piece, so
/// the grouper can merge each piece's copy with the copies that follow it.
StatusOr<bool> split_to_slices(Graph& g) {
  bool changed = false;
  for (Node* n : g.node_list()) {
    if (n->op_name() != "split" || n->num_operands() != 1 || has_side_effects(*n)) continue;
    const Shape& in = n->operand(0)->shape();
    if (has_unknown_dim(in) || !std::all_of(in.begin(), in.end(), [](const Dim& d) { return d.is_static(); })) continue;
    bool movement_users = true;
    for (const Value* r : n->results()) {
      movement_users &= r->has_uses();
      for (const Use& u : r->uses()) movement_users &= u.user && is_movement_member(*u.user);
    }
    if (!movement_users) continue;
    const int64_t rank = static_cast<int64_t>(in.size());
    int64_t axis = n->get_int("axis");
    if (axis < 0) axis += rank;
    int64_t start = 0;
    for (int i = 0; i < n->num_results(); ++i) {
      Value* piece = n->result(i);
      const int64_t size = piece->shape()[static_cast<size_t>(axis)].value();
      const std::string name = piece->name();
      piece->set_name("");
      KILN_ASSIGN_OR_RETURN(Node * slice, g.create_node("slice", {n->operand(0)}, {piece->type()},
                                                        {{"starts", std::vector<int64_t>{start}},
                                                         {"ends", std::vector<int64_t>{start + size}},
                                                         {"axes", std::vector<int64_t>{axis}}},
                                                        n, {name}));
      slice->set_loc(n->loc());
      piece->replace_all_uses_with(slice->result());
      start += size;
    }
    KILN_RETURN_IF_ERROR(g.erase_node(n));
    changed = true;
  }
  return changed;
}

/// Gives the users of a widening cast (a bf16 weight gradient widened to f32, which the global
/// norm's sum of squares and the optimizer's update both read) that sit in other groups than
/// the cast a cast of their own: each group then reads the narrow value and widens it in
/// registers, and the wide copy is never written and read back. `group_of` maps the nodes of
/// a first grouping to their group. Casts whose wide value is stored anyway (a graph output, a
/// non-elementwise user, a user of another shape) are left alone.
StatusOr<bool> widening_cast_per_group(Graph& g, const std::unordered_map<const Node*, int>& group_of) {
  auto group = [&](const Node* n) {
    auto it = group_of.find(n);
    return it == group_of.end() ? -1 : it->second;
  };
  bool changed = false;
  for (Node* n : g.node_list()) {
    if (n->op_name() != "cast" || !is_member_candidate(*n)) continue;
    const DType from = n->operand(0)->dtype(), to = n->result()->dtype();
    if (from == DType::kF8E4M3FN || from == DType::kF8E5M2 || dtype_bits(from) >= dtype_bits(to)) continue;
    const int mine = group(n);
    std::vector<Node*> outside;
    bool stored = false, inside = false;
    for (const Use& u : n->result()->uses()) {
      if (!u.user || !is_member_candidate(*u.user) || u.user->result()->shape() != n->result()->shape()) stored = true;
      else if (mine >= 0 && group(u.user) == mine) inside = true;
      else if (std::find(outside.begin(), outside.end(), u.user) == outside.end()) outside.push_back(u.user);
    }
    // A cast no user shares a group with keeps its first user.
    const size_t first = inside ? 0 : 1;
    if (stored || outside.size() <= first) continue;
    for (size_t k = first; k < outside.size(); ++k) {
      KILN_ASSIGN_OR_RETURN(Node * copy, g.create_node("cast", {n->operand(0)}, {n->result()->type()}, n->attrs(), n));
      copy->set_loc(n->loc());
      for (int i = 0; i < outside[k]->num_operands(); ++i)
        if (outside[k]->operand(i) == n->result()) outside[k]->set_operand(i, copy->result());
      changed = true;
    }
  }
  return changed;
}

class FusePointwise final : public Pass {
 public:
  FusePointwise(int64_t max_size, int64_t min_size) : max_size_(max_size), min_size_(min_size) {}

  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    // Regions of other nodes are graphs of their own; fused bodies are already one group.
    KILN_RETURN_IF_ERROR(walk_graphs(g, [&](Graph& sub) -> StatusOr<WalkAction> {
      if (is_fused_body(sub)) return WalkAction::kSkip;
      KILN_ASSIGN_OR_RETURN(bool c, fuse_graph(sub));
      changed |= c;
      return WalkAction::kAdvance;
    }));
    return changed;
  }

 private:
  /// Fuses the nodes of `g` itself (not those nested in its regions).
  StatusOr<bool> fuse_graph(Graph& g) {
    KILN_ASSIGN_OR_RETURN(bool changed, split_to_slices(g));
    std::vector<std::vector<Node*>> groups = group_nodes(g);
    std::unordered_map<const Node*, int> group_of;
    for (size_t gid = 0; gid < groups.size(); ++gid)
      for (const Node* n : groups[gid]) group_of[n] = static_cast<int>(gid);
    KILN_ASSIGN_OR_RETURN(bool recast, widening_cast_per_group(g, group_of));
    if (recast) groups = group_nodes(g);  // each new cast joins its user's group
    changed |= recast;
    KILN_ASSIGN_OR_RETURN(bool fused_any, fuse_groups(g, groups, min_size_));
    return changed || fused_any;
  }

  std::vector<std::vector<Node*>> group_nodes(Graph& g) const {
    Grouper grouper(g, max_size_);
    std::vector<std::vector<Node*>> groups;
    for (const std::vector<int>& group : grouper.run()) {
      if (group.empty()) continue;
      groups.emplace_back();
      for (int i : group) groups.back().push_back(grouper.order()[static_cast<size_t>(i)]);
    }
    return groups;
  }

  int64_t max_size_, min_size_;
};

}  // namespace

PassInfo fuse_pointwise_pass_info() {
  PassInfo info;
  info.name = "fuse-pointwise";
  info.version = "0.1.0";
  info.summary = "group connected elementwise nodes into fused nodes, one kernel each";
  info.options = {
      {"max-group-size", OptionType::kInt, int64_t{64}, "most nodes in one group"},
      {"min-group-size", OptionType::kInt, int64_t{2}, "fewest nodes worth a fused node"},
  };
  info.create = [](const Options& opts) -> StatusOr<std::unique_ptr<Pass>> {
    const int64_t max_size = opts.get_int("max-group-size");
    const int64_t min_size = opts.get_int("min-group-size");
    if (max_size < 1)
      return invalid_argument("fuse-pointwise: max-group-size must be at least 1, got " +
                              std::to_string(max_size));
    if (min_size < 1)
      return invalid_argument("fuse-pointwise: min-group-size must be at least 1, got " +
                              std::to_string(min_size));
    return std::unique_ptr<Pass>(std::make_unique<FusePointwise>(max_size, min_size));
  };
  return info;
}

}  // namespace kiln::fusion
