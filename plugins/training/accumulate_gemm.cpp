// The accumulate-gemm pass: where autodiff sums a weight's gradient contributions (the
// `add[_accumulate]` chain of a tied embedding's or a chunked head's weight), each contribution
// that is a GEMM (`cast(matmul(a, b))` to the sum's f32, or `matmul(a, b)`) accumulates into the
// running sum instead: `matmul_acc(a, b, sum)`, cuBLASLt's beta = 1 with an f32 C/D over bf16
// A/B. The bf16 product and its f32 copy are never stored, so a contribution's inputs (a head
// chunk's logits gradient) die at its GEMM, and the sum is rounded once instead of twice.
//
// The chain is also re-ordered: contributions are summed in the order they can exist, by their
// depth in the graph (longest path from the inputs), ties in the forward order of the uses.
// Autodiff adds them in reverse forward order, which suits a weight shared by successive layers
// (the last layer's gradient exists first) but not a chunked head, whose chunks' backwards are
// independent and run in forward order: in autodiff's order every chunk's logits gradient would
// wait for the last chunk's. Run it after autodiff.
#include <algorithm>
#include <unordered_map>

#include "autodiff.h"

namespace kiln::training {
namespace {

bool single_use(const Value* v) { return v->uses().size() == 1; }

bool is_accumulate(const Node* n) {
  return n != nullptr && n->op_name() == "add" && n->has_attr("_accumulate") && n->num_operands() == 2;
}

/// The 2-D matmul a contribution is (or widens to the sum's f32), when nothing else reads it.
Node* accumulable_gemm(const Value* contribution, DType sum_dtype) {
  const Value* v = contribution;
  if (!single_use(v)) return nullptr;
  if (const Node* c = v->producer(); c && c->op_name() == "cast") {
    const DType from = c->operand(0)->dtype();
    if (sum_dtype != DType::kF32 || (from != DType::kBF16 && from != DType::kF16)) return nullptr;
    v = c->operand(0);
    if (!single_use(v)) return nullptr;
  }
  Node* m = v->producer();
  if (m == nullptr || m->op_name() != "matmul" || m->num_operands() != 2) return nullptr;
  if (m->operand(0)->type().rank() != 2 || m->operand(1)->type().rank() != 2 || !is_float(m->result()->dtype()))
    return nullptr;
  return m;
}

class AccumulateGemm final : public Pass {
 public:
  StatusOr<bool> run(Graph& g) override {
    // Depth of every value: 1 + the deepest operand's (graph order is topological).
    std::unordered_map<const Value*, int64_t> depth;
    for (const auto& n : g.nodes()) {
      int64_t d = 0;
      for (const Value* v : n->operands())
        if (auto it = depth.find(v); it != depth.end()) d = std::max(d, it->second);
      for (const Value* r : n->results()) depth[r] = d + 1;
    }
    bool changed = false;
    for (Node* last : g.node_list()) {
      if (!is_accumulate(last) || chain_continues(last)) continue;
      KILN_ASSIGN_OR_RETURN(const bool done, rebuild(g, last, depth));
      changed |= done;
    }
    return changed;
  }

 private:
  /// Whether `n`'s sum is only the running sum of a longer chain (the next link owns it).
  static bool chain_continues(const Node* n) {
    const Value* r = n->result();
    return single_use(r) && is_accumulate(r->uses()[0].user) && r->uses()[0].index == 0;
  }

  struct Term {
    Value* value;
    Node* gemm;      // the accumulable matmul, or null
    size_t index;    // position in autodiff's chain
    int64_t depth;
  };

  StatusOr<bool> rebuild(Graph& g, Node* last, const std::unordered_map<const Value*, int64_t>& depth) {
    // The links, first to last: links[k] = add(links[k-1] or terms[0], terms[k]).
    std::vector<Node*> links{last};
    while (true) {
      Node* p = links.back()->operand(0)->producer();
      if (!is_accumulate(p) || !single_use(p->result())) break;
      links.push_back(p);
    }
    std::reverse(links.begin(), links.end());
    const DType t = last->result()->dtype();
    std::vector<Term> terms;
    auto add_term = [&](Value* v) {
      const auto it = depth.find(v);
      terms.push_back({v, accumulable_gemm(v, t), terms.size(), it == depth.end() ? 0 : it->second});
    };
    add_term(links.front()->operand(0));
    for (Node* l : links) add_term(l->operand(1));
    int gemms = 0;
    for (const Term& x : terms) gemms += x.gemm != nullptr;
    for (const Term& x : terms)
      if (x.value->type() != last->result()->type()) return false;
    if (gemms == 0 || (gemms == 1 && terms[0].gemm != nullptr)) return false;
    // Shallowest first; among equals (a chunked head's chunks), the forward order of the uses.
    std::vector<Term> order = terms;
    std::stable_sort(order.begin(), order.end(), [](const Term& a, const Term& b) {
      return a.depth != b.depth ? a.depth < b.depth : a.index > b.index;
    });
    // Each new link goes before the old link that consumed the latest term it needs, so the
    // graph stays in order (and in a sensible one for pipelines without schedule-memory).
    const std::string name = last->result()->name();
    last->result()->set_name("");
    Value* sum = order[0].value;
    size_t latest = order[0].index;
    for (size_t k = 1; k < order.size(); ++k) {
      const Term& x = order[k];
      latest = std::max(latest, x.index);
      Node* before = links[std::max<size_t>(latest, 1) - 1];
      const std::vector<std::string> names{k + 1 == order.size() ? name : ""};
      Node* n = nullptr;
      if (x.gemm) {
        KILN_ASSIGN_OR_RETURN(n, g.create_node("matmul_acc", {x.gemm->operand(0), x.gemm->operand(1), sum},
                                               {last->result()->type()}, {}, before, names));
      } else {
        KILN_ASSIGN_OR_RETURN(n, g.create_node("add", {sum, x.value}, {last->result()->type()},
                                               {{"_accumulate", Attribute(int64_t{1})}}, before, names));
      }
      n->set_loc(links[std::max<size_t>(x.index, 1) - 1]->loc());
      sum = n->result();
    }
    last->result()->replace_all_uses_with(sum);
    for (auto it = links.rbegin(); it != links.rend(); ++it) KILN_RETURN_IF_ERROR(g.erase_node(*it));
    for (size_t k = 1; k < order.size(); ++k) {
      const Term& x = order[k];
      if (!x.gemm) continue;
      if (Node* cast = x.value->producer(); cast != x.gemm) KILN_RETURN_IF_ERROR(g.erase_node(cast));
      KILN_RETURN_IF_ERROR(g.erase_node(x.gemm));
    }
    return true;
  }
};

}  // namespace

PassInfo accumulate_gemm_pass_info() {
  PassInfo info;
  info.name = "accumulate-gemm";
  info.version = "0.1.0";
  info.summary = "a weight gradient's GEMM contributions accumulate into its running sum (matmul_acc, beta = 1), "
                 "in the order they can exist";
  info.create = [](const Options&) -> StatusOr<std::unique_ptr<Pass>> {
    return std::unique_ptr<Pass>(std::make_unique<AccumulateGemm>());
  };
  return info;
}

}  // namespace kiln::training
