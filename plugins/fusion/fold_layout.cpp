// The fold-layout pass: transpose and reshape chains collapse into one op (or none), so the
// CUDA lowering sees at most one layout change, which it folds into views or GEMM flags.
#include <numeric>
#include <vector>

#include "fusion.h"

namespace kiln::fusion {

std::vector<int64_t> perm_of(const Node& t) {
  const int64_t rank = static_cast<int64_t>(t.operand(0)->shape().size());
  std::vector<int64_t> p = t.get_ints("perm");
  if (p.empty())
    for (int64_t d = rank; d-- > 0;) p.push_back(d);
  for (int64_t& a : p) a = a < 0 ? a + rank : a;
  return p;
}

namespace {

bool is_reshape_like(const Node& n) {
  const std::string& op = n.op_name();
  return (op == "reshape" || op == "flatten" || op == "squeeze" || op == "unsqueeze") && n.num_results() == 1;
}

bool static_shape(const Value* v) {
  for (const Dim& d : v->shape())
    if (!d.is_static()) return false;
  return true;
}

class FoldLayout final : public Pass {
 public:
  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    for (Node* n : g.node_list()) {
      Value* in = n->num_operands() > 0 ? n->operand(0) : nullptr;
      Node* p = in ? in->producer() : nullptr;
      if (n->op_name() == "transpose") {
        std::vector<int64_t> perm = perm_of(*n);
        // transpose(transpose(x, p1), p2) = transpose(x, p1[p2]).
        if (p && p->op_name() == "transpose") {
          const std::vector<int64_t> inner = perm_of(*p);
          for (int64_t& a : perm) a = inner[static_cast<size_t>(a)];
          n->set_operand(0, p->operand(0));
          n->set_attr("perm", perm);
          changed = true;
        }
        std::vector<int64_t> id(perm.size());
        std::iota(id.begin(), id.end(), 0);
        if (perm == id && n->operand(0)->type() == n->result()->type()) changed |= replace(g, n, n->operand(0));
        continue;
      }
      if (!is_reshape_like(*n) || !static_shape(n->result())) continue;
      // A chain of reshapes is one reshape of the first input; one to the same shape is none.
      Value* src = n->operand(0);
      while (src->producer() && is_reshape_like(*src->producer())) src = src->producer()->operand(0);
      if (src->type() == n->result()->type()) {
        changed |= replace(g, n, src);
        continue;
      }
      if (src == n->operand(0) && n->op_name() == "reshape") continue;
      std::vector<int64_t> shape;
      for (const Dim& d : n->result()->shape()) shape.push_back(d.value());
      KILN_ASSIGN_OR_RETURN(Node * r, g.create_node("reshape", {src}, {n->result()->type()}, {{"shape", shape}}, n));
      r->set_loc(n->loc());
      changed |= replace(g, n, r->result());
    }
    // Producers left without users (inner transposes and reshapes) go.
    for (bool again = true; again;) {
      again = false;
      for (Node* n : g.node_list())
        if ((n->op_name() == "transpose" || is_reshape_like(*n)) && !n->result()->has_uses()) {
          KILN_RETURN_IF_ERROR(g.erase_node(n));
          again = changed = true;
        }
    }
    return changed;
  }

 private:
  /// Makes `v` stand for `n`'s result (keeping the result's name when `v` is new) and drops `n`.
  static bool replace(Graph& g, Node* n, Value* v) {
    Value* r = n->result();
    const std::string name = r->name();
    const bool fresh = v->producer() && v->name().empty();
    r->replace_all_uses_with(v);
    if (!g.erase_node(n).ok()) return false;
    if (fresh) v->set_name(name);
    return true;
  }
};

}  // namespace

PassInfo fold_layout_pass_info() {
  PassInfo info;
  info.name = "fold-layout";
  info.version = "0.1.0";
  info.summary = "compose transpose chains, collapse reshape chains, drop identity layout changes";
  info.create = [](const Options&) -> StatusOr<std::unique_ptr<Pass>> {
    return std::unique_ptr<Pass>(std::make_unique<FoldLayout>());
  };
  return info;
}

}  // namespace kiln::fusion
