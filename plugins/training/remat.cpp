// The remat pass (activation checkpointing) on a joint graph: forward values the backward uses
// are recomputed in the backward, right before their first use there, instead of being kept
// alive from the forward. `selective` recomputes elementwise ops and data movement (views, slices,
// splits), keeping contraction, norm and softmax outputs (cheap to redo, the bulk of the saved
// bytes); `full` recomputes every forward value except the ones `keep` names (the block
// boundaries, e.g. the residual stream).
// It reports the activation peak before and after and the FLOPs added.
#include <cstdio>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "autodiff.h"
#include "kiln/core/memory_estimate.h"

namespace kiln::training {
namespace {

bool is_view(const Node& n) { return n.op() && n.op()->has(kTraitView) && n.num_regions() == 0; }

/// Floating-point work of one node: 2·M·N·K for contractions, one per result element otherwise.
int64_t node_flops(const Node& n) {
  const int64_t out = std::max<int64_t>(num_elements(n.result()->shape()), 0);
  if (n.op_name() == "matmul" || n.op_name() == "linear") {
    const Shape& a = n.operand(0)->shape();
    const int64_t k = a.empty() || !a.back().is_static() ? 0 : a.back().value();
    return 2 * out * k;
  }
  return is_view(n) ? 0 : out;
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
    std::fprintf(stderr,
                 "remat: %s: %lld values recomputed (+%.3f MFLOP per step); activation peak %lld -> %lld bytes "
                 "(in the current node order)\n",
                 policy_.c_str(), static_cast<long long>(count), static_cast<double>(flops) / 1e6,
                 static_cast<long long>(before), static_cast<long long>(after));
    return count > 0;
  }

 private:
  bool recomputable(const Node& n) const {
    if (n.op() == nullptr || n.op()->has(kTraitSideEffects) || n.op()->has(kTraitConstant) || n.num_regions() > 0 ||
        n.num_results() == 0 || n.op_name() == "variable")
      return false;
    for (const Value* r : n.results())
      if (keep_.count(r->name())) return false;
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
