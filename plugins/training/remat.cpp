// The remat pass (activation checkpointing) on a joint graph: forward values the backward uses
// are recomputed in the backward, right before their first use there, instead of being kept
// alive from the forward. `selective` recomputes elementwise ops and data movement (views, slices,
// splits), keeping contraction, norm and softmax outputs (cheap to redo, the bulk of the saved
// bytes); `full` recomputes every forward value except the block boundaries: the ones `keep`
// names or, without `keep`, the values found to separate the forward into blocks (the residual
// stream of a transformer), so each block's forward is redone right before its own backward.
// It reports the activation peak before and after and the FLOPs added.
#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "autodiff.h"
#include "kiln/core/memory_estimate.h"

namespace kiln::training {
namespace {

bool has_side_effects_op(const Node& n) { return n.op() == nullptr || n.op()->has(kTraitSideEffects); }

bool is_view(const Node& n) { return n.op() && n.op()->has(kTraitView) && n.num_regions() == 0; }

int64_t static_dim(const Shape& s, size_t from_back) {
  return s.size() < from_back || !s[s.size() - from_back].is_static() ? 0 : s[s.size() - from_back].value();
}

/// Floating-point work of one node: 2·M·N·K for contractions, 4·T·S·D per attention head (the
/// score and value products), one per result element otherwise.
int64_t node_flops(const Node& n) {
  const int64_t out = std::max<int64_t>(num_elements(n.result()->shape()), 0);
  if (n.op_name() == "matmul" || n.op_name() == "linear") return 2 * out * static_dim(n.operand(0)->shape(), 1);
  if (n.op_name() == "attention" && n.num_operands() >= 2) return 4 * out * static_dim(n.operand(1)->shape(), 2);
  return is_view(n) ? 0 : out;
}

/// What a value is computed from: the weights (constants, variables, the graph inputs autodiff
/// differentiates: those with a `.grad` output), the data (the other graph inputs), and whether
/// the gradient of the loss reaches it (a value of the backward proper, not a recomputation).
struct Dependence {
  bool weights = false, data = false, gradient = false;
};

std::unordered_map<const Value*, Dependence> dependences(const Graph& g,
                                                         const std::unordered_set<const Node*>& forward) {
  std::unordered_set<std::string> outputs;
  for (int i = 0; i < g.num_outputs(); ++i) outputs.insert(g.output_name(i));
  std::unordered_map<const Value*, Dependence> dep;
  for (int i = 0; i < g.num_inputs(); ++i) {
    const Value* in = g.input(i);
    (outputs.count(in->name() + ".grad") ? dep[in].weights : dep[in].data) = true;
  }
  for (const Node* n : g.node_list()) {
    Dependence d;
    d.weights = n->op() != nullptr && (n->op()->has(kTraitConstant) || n->op_name() == "variable");
    // What autodiff seeds the backward with (1, or the dynamic loss scale) carries the gradient.
    d.gradient = !forward.count(n) && n->num_results() == 1 &&
                 (n->result()->name().ends_with(".seed") || n->result()->name() == kLossScaleVariable);
    for (const Value* o : n->operands()) {
      const Dependence od = dep[o];
      d.weights |= od.weights;
      d.data |= od.data;
      d.gradient |= od.gradient;
    }
    for (const Value* r : n->results()) dep[r] = d;
  }
  return dep;
}

/// The block boundaries of `full` without `keep`: values of the forward that alone carry the
/// computation from one part of the network to the next. Walking the forward in node order, a
/// value is a cut where it is the only activation (a float value computed from both data and
/// weights) that a later forward node still reads: in a transformer, the residual stream after
/// each attention and each MLP. Of consecutive cuts with no contraction between them (a norm, a
/// reshape) only the last is kept: recomputing from it redoes no GEMM, and keeping the others
/// would hold more bytes for nothing.
std::unordered_set<const Value*> block_boundaries(const Graph& g, const std::unordered_set<const Node*>& forward,
                                                  const std::unordered_map<const Value*, Dependence>& dep) {
  std::vector<const Node*> order;
  std::unordered_map<const Value*, int> last_read;
  for (const Node* n : g.node_list()) {
    if (!forward.count(n)) continue;
    for (const Value* o : n->operands()) last_read[o] = static_cast<int>(order.size());
    order.push_back(n);
  }
  auto activation = [&](const Value* v) {
    const Dependence& d = dep.at(v);
    return d.weights && d.data && is_float(v->dtype());
  };
  // The cuts in forward order, with the position of the node after which each was found alone.
  std::vector<std::pair<const Value*, int>> cuts;
  std::set<const Value*> live;
  for (int pos = 0; pos < static_cast<int>(order.size()); ++pos) {
    const Node* n = order[static_cast<size_t>(pos)];
    for (const Value* o : n->operands())
      if (last_read[o] == pos) live.erase(o);
    for (const Value* r : n->results()) {
      auto it = last_read.find(r);
      if (it != last_read.end() && it->second > pos && activation(r)) live.insert(r);
    }
    if (live.size() == 1 && (cuts.empty() || cuts.back().first != *live.begin())) cuts.emplace_back(*live.begin(), pos);
  }
  std::unordered_set<const Value*> kept;
  for (size_t i = 0; i < cuts.size(); ++i) {
    const int end = i + 1 < cuts.size() ? cuts[i + 1].second : static_cast<int>(order.size()) - 1;
    for (int pos = cuts[i].second + 1; pos <= end; ++pos) {
      const Node* n = order[static_cast<size_t>(pos)];
      if (n->op() != nullptr && n->op()->has(kTraitContraction)) {
        kept.insert(cuts[i].first);
        break;
      }
    }
  }
  return kept;
}

class Remat final : public Pass {
 public:
  Remat(std::string policy, std::string loss, std::set<std::string> keep)
      : policy_(std::move(policy)), loss_(std::move(loss)), keep_(std::move(keep)) {}

  StatusOr<bool> run(Graph& g) override {
    if (policy_ == "none") return false;
    Value* loss = nullptr;
    for (int i = 0; i < g.num_outputs(); ++i)
      if (g.output_name(i) == loss_) loss = g.output(i);
    if (loss == nullptr) return not_found("remat: the graph has no output '" + loss_ + "' (option 'loss')");
    // The forward: every node the loss depends on.
    std::unordered_set<const Node*> forward;
    std::vector<const Value*> work{loss};
    while (!work.empty()) {
      const Value* v = work.back();
      work.pop_back();
      const Node* p = v->producer();
      if (p == nullptr || !forward.insert(p).second) continue;
      for (const Value* o : p->operands()) work.push_back(o);
    }
    const auto dep = dependences(g, forward);
    kept_.clear();
    if (policy_ == "full" && keep_.empty()) kept_ = block_boundaries(g, forward, dep);
    // The backward's own recomputations (a norm's gradient recomputes its mean and deviation from
    // the input): nodes of the backward computed from the forward's activations alone. Marked
    // `_remat` like ours, fusion does not pull them into the forward's kernels, which would
    // compute them there and keep their results alive until the backward.
    for (Node* n : g.node_list()) {
      if (policy_ != "full" || forward.count(n) || n->num_results() == 0 || n->has_attr("_remat")) continue;
      const Dependence& d = dep.at(n->result(0));
      if (d.data && !d.gradient && !has_side_effects_op(*n)) n->set_attr("_remat", Attribute(int64_t{1}));
    }
    const int64_t before = peak_activation_bytes(g);
    std::unordered_map<const Value*, Value*> clones;
    int64_t flops = 0, count = 0;
    try {
      Builder b(g);
      for (Node* n : g.node_list()) {
        if (forward.count(n)) continue;
        for (int i = 0; i < n->num_operands(); ++i) {
          b.set_insertion_point(n);
          Value* r = recompute(b, n->operand(i), forward, clones, flops, count);
          if (r != n->operand(i)) n->set_operand(i, r);
        }
      }
    } catch (const BuildError& e) {
      return e.status.with_context("remat");
    }
    const int64_t after = peak_activation_bytes(g);
    const std::string boundaries =
        kept_.empty() ? "" : " from " + std::to_string(kept_.size()) + (kept_.size() == 1 ? " block boundary" : " block boundaries");
    std::fprintf(stderr,
                 "remat: %s: %lld values recomputed%s (+%.3f MFLOP per step); activation peak %lld -> %lld bytes "
                 "(in the current node order)\n",
                 policy_.c_str(), static_cast<long long>(count), boundaries.c_str(), static_cast<double>(flops) / 1e6,
                 static_cast<long long>(before), static_cast<long long>(after));
    return count > 0;
  }

 private:
  bool recomputable(const Node& n) const {
    if (n.op() == nullptr || n.op()->has(kTraitSideEffects) || n.op()->has(kTraitConstant) || n.num_regions() > 0 ||
        n.num_results() == 0 || n.op_name() == "variable")
      return false;
    for (const Value* r : n.results())
      if (keep_.count(r->name()) || kept_.count(r)) return false;
    if (policy_ == "full") return true;
    // Elementwise ops and data movement (views, slices, a split into pieces): cheap to redo.
    return (n.op()->has(kTraitElementwise) && n.num_results() == 1) || is_view(n);
  }

  /// `v` as the backward should read it: a clone computed from kept values when its producer is
  /// a recomputable forward node, else `v` itself. A node of several results (split) is cloned
  /// once, for all of them.
  Value* recompute(Builder& b, Value* v, const std::unordered_set<const Node*>& forward,
                   std::unordered_map<const Value*, Value*>& clones, int64_t& flops, int64_t& count) {
    Node* p = v->producer();
    if (p == nullptr || !forward.count(p) || !recomputable(*p)) return v;
    auto it = clones.find(v);
    if (it != clones.end()) return it->second;
    std::vector<Value*> operands;
    for (Value* o : p->operands()) operands.push_back(recompute(b, o, forward, clones, flops, count));
    b.set_loc(p->loc());
    // The `_remat` annotation keeps cse (which runs after remat in the usual pipelines) from
    // merging the recomputation back into the forward value it duplicates.
    AttrMap attrs = p->attrs();
    attrs.insert_or_assign("_remat", Attribute(int64_t{1}));
    std::vector<Value*> results;
    if (p->num_results() == 1) {
      results.push_back(b.op(p->op_name(), operands, attrs, v->name().empty() ? "" : v->name() + ".remat"));
    } else {
      results = b.op_n(p->op_name(), operands, p->num_results(), attrs);
      for (int i = 0; i < p->num_results(); ++i)
        if (!p->result(i)->name().empty()) results[static_cast<size_t>(i)]->set_name(p->result(i)->name() + ".remat");
    }
    flops += node_flops(*p);
    ++count;
    for (int i = 0; i < p->num_results(); ++i) clones[p->result(i)] = results[static_cast<size_t>(i)];
    return clones.at(v);
  }

  std::string policy_, loss_;
  std::set<std::string> keep_;
  std::unordered_set<const Value*> kept_;  ///< `full` without `keep`: the block boundaries found
};

}  // namespace

PassInfo remat_pass_info() {
  PassInfo info;
  info.name = "remat";
  info.version = "0.1.0";
  info.summary = "activation checkpointing: the backward recomputes forward values instead of keeping them";
  info.options = {
      {"policy", OptionType::kString, std::string("selective"),
       "none; selective: recompute elementwise ops and data movement (views, slices, splits); full: recompute every forward value but `keep`"},
      {"loss", OptionType::kString, std::string("loss"), "the output whose ancestors are the forward"},
      {"keep", OptionType::kStringList, std::vector<std::string>{},
       "values never recomputed (full: the block boundaries to checkpoint)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    const std::string policy = o.get_string("policy");
    if (policy != "none" && policy != "selective" && policy != "full")
      return invalid_argument("remat: option 'policy' must be none, selective or full, got '" + policy + "'");
    const auto& keep = o.get_strings("keep");
    return std::unique_ptr<Pass>(
        std::make_unique<Remat>(policy, o.get_string("loss"), std::set<std::string>(keep.begin(), keep.end())));
  };
  return info;
}

}  // namespace kiln::training
