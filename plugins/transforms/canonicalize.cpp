// The canonicalize pass: constant folding and local algebraic simplification to a fixed point.
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/ir/interpreter.h"
#include "transforms.h"

namespace kiln::transforms {
namespace {

/// A node whose value is fixed at compile time: no operands, no regions, the constant trait.
bool is_constant_like(const Node* n) {
  return n && n->op() && n->op()->has(kTraitConstant) && n->num_operands() == 0 &&
         n->num_regions() == 0 && !has_side_effects(*n);
}

/// The permutation a transpose applies; an absent perm reverses the axes (numpy's default).
std::vector<int64_t> transpose_perm(const Node& n) {
  std::vector<int64_t> perm = n.get_ints("perm");
  if (perm.empty())
    for (int64_t i = n.operand(0)->type().rank() - 1; i >= 0; --i) perm.push_back(i);
  return perm;
}

bool is_identity_perm(const std::vector<int64_t>& perm) {
  for (size_t i = 0; i < perm.size(); ++i)
    if (perm[i] != static_cast<int64_t>(i)) return false;
  return true;
}

bool has_unknown_dim(const TensorType& t) {
  for (const Dim& d : t.shape)
    if (d.is_unknown()) return true;
  return false;
}

/// Whether every element of `t` equals `v` (and there is at least one).
bool all_equal(const Tensor& t, double v) {
  if (t.numel() == 0) return false;
  for (int64_t i = 0; i < t.numel(); ++i)
    if (t.get_f64(i) != v) return false;
  return true;
}

class Canonicalize final : public Pass {
 public:
  Canonicalize(int64_t max_iterations, int64_t fold_limit_bytes)
      : max_iterations_(max_iterations), fold_limit_bytes_(fold_limit_bytes) {}

  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    for (int64_t i = 0; i < max_iterations_; ++i) {
      KILN_ASSIGN_OR_RETURN(bool swept, sweep(g));
      if (!swept) break;
      changed = true;
    }
    return changed;
  }

 private:
  /// One walk over `g` and every region nested in it; true when anything was rewritten.
  StatusOr<bool> sweep(Graph& g) {
    bool changed = false;
    KILN_RETURN_IF_ERROR(walk_graphs(g, [&](Graph& sub) -> Status {
      KILN_ASSIGN_OR_RETURN(bool c, sweep_graph(sub));
      changed |= c;
      return ok_status();
    }));
    return changed;
  }

  /// One walk over the nodes of `g` itself (its regions are swept on their own).
  StatusOr<bool> sweep_graph(Graph& g) {
    bool changed = false;
    // Rewrites erase only the node at hand and producers before it, never a later node in
    // this snapshot.
    for (Node* n : g.node_list()) {
      if (n->num_regions() > 0 || !n->op() || has_side_effects(*n)) continue;
      KILN_ASSIGN_OR_RETURN(bool c, simplify(n));
      if (!c) {
        KILN_ASSIGN_OR_RETURN(c, fold(n));
      }
      changed |= c;
    }
    return changed;
  }

  /// Points every use of `n`'s only result at `v` and erases `n`.
  static StatusOr<bool> forward(Node* n, Value* v) {
    n->result(0)->replace_all_uses_with(v);
    KILN_RETURN_IF_ERROR(erase_with_dead_producers(n));
    return true;
  }

  /// forward(n, p's result), which also takes over n's result name (the printed IR keeps it).
  static StatusOr<bool> replace_by(Node* n, Node* p) {
    const std::string name = n->result(0)->name();
    n->result(0)->set_name("");
    p->result(0)->set_name(name);
    return forward(n, p->result(0));
  }

  /// The value of a constant-like node's result, when `v` has one.
  std::optional<Tensor> constant_value(const Value* v) const {
    const Node* p = v->producer();
    if (!is_constant_like(p)) return std::nullopt;
    if (p->op_name() == "constant") return p->attr("value")->as_tensor();
    auto outs = evaluate({p}, {});
    if (!outs) return std::nullopt;
    return (*outs)[static_cast<size_t>(v->index())];
  }

  /// Runs `nodes` (constant producers, then at most one consumer) on a private graph with
  /// the reference interpreter and returns the last node's results; nullopt when the
  /// interpreter refuses (the error then surfaces when the graph really runs).
  static std::optional<std::vector<Tensor>> evaluate(const std::vector<const Node*>& nodes,
                                                     const std::vector<Value*>& operands) {
    Graph tmp("fold");
    std::vector<std::pair<const Node*, Node*>> copies;
    Node* last = nullptr;
    for (const Node* n : nodes) {
      std::vector<Value*> ins;
      if (n == nodes.back()) {
        for (Value* v : operands) {
          for (auto& [orig, copy] : copies)
            if (orig == v->producer()) ins.push_back(copy->result(v->index()));
        }
      }
      std::vector<TensorType> types;
      for (int i = 0; i < n->num_results(); ++i) types.push_back(n->result(i)->type());
      auto made = tmp.create_node(n->op_name(), ins, types, n->attrs());
      if (!made.ok()) return std::nullopt;
      copies.emplace_back(n, *made);
      last = *made;
    }
    tmp.set_outputs(last->results());
    auto outs = Interpreter().run(tmp, {});
    if (!outs.ok()) return std::nullopt;
    return std::move(outs).value();
  }

  /// Replaces a node whose operands are all constants by constants holding its results.
  /// Nodes without operands (range) qualify too; constants themselves are left as they are.
  StatusOr<bool> fold(Node* n) {
    if (n->op()->has(kTraitConstant)) return false;
    std::vector<const Node*> producers;
    for (Value* v : n->operands()) {
      if (!is_constant_like(v->producer())) return false;
      if (std::find(producers.begin(), producers.end(), v->producer()) == producers.end())
        producers.push_back(v->producer());
    }
    int64_t bytes = 0;
    for (int i = 0; i < n->num_results(); ++i) {
      const TensorType& t = n->result(i)->type();
      if (!is_static(t.shape)) return false;
      bytes += dtype_storage_bytes(t.dtype, num_elements(t.shape));
    }
    if (bytes > fold_limit_bytes_) return false;

    producers.push_back(n);
    auto outs = evaluate(producers, n->operands());
    if (!outs) return false;
    for (int i = 0; i < n->num_results(); ++i)
      if ((*outs)[static_cast<size_t>(i)].type() != n->result(i)->type()) return false;

    for (int i = 0; i < n->num_results(); ++i) {
      Value* old = n->result(i);
      // The constant takes over the folded value's name, so the printed IR stays readable.
      std::string name = old->name();
      old->set_name("");
      KILN_ASSIGN_OR_RETURN(Node * c, n->graph()->create_node(
                                          "constant", {}, {old->type()},
                                          {{"value", (*outs)[static_cast<size_t>(i)]}},
                                          n, {name}));
      c->set_loc(n->loc());
      old->replace_all_uses_with(c->result());
    }
    KILN_RETURN_IF_ERROR(erase_with_dead_producers(n));
    return true;
  }

  /// The local rewrites; true when `n` was replaced or changed.
  StatusOr<bool> simplify(Node* n) {
    const std::string& op = n->op_name();
    if (n->num_results() != 1 || n->num_operands() == 0) return false;
    Value* x = n->operand(0);
    const TensorType& type = n->result(0)->type();
    Node* inner = x->producer();

    // Ops that return their operand unchanged. Equal symbols are equal sizes, so a reshape
    // between equal types is a no-op unless a dim is unknown ("?" may differ from "?").
    if ((op == "identity" || op == "cast" || (op == "reshape" && !has_unknown_dim(type))) &&
        x->type() == type)
      return forward(n, x);

    if (op == "neg" && inner && inner->op_name() == "neg" && inner->operand(0)->type() == type)
      return forward(n, inner->operand(0));

    // transpose(transpose(x, p1), p2) reads x at p1[p2[j]]: one transpose, or none.
    if (op == "transpose" && inner && inner->op_name() == "transpose") {
      const std::vector<int64_t> p1 = transpose_perm(*inner), p2 = transpose_perm(*n);
      if (p1.size() != p2.size()) return false;
      std::vector<int64_t> perm;
      for (int64_t j : p2) perm.push_back(p1[static_cast<size_t>(j)]);
      Value* src = inner->operand(0);
      if (is_identity_perm(perm) && src->type() == type) return forward(n, src);
      n->set_operand(0, src);
      n->set_attr("perm", perm);
      if (!has_used_results(*inner)) KILN_RETURN_IF_ERROR(erase_with_dead_producers(inner));
      return true;
    }

    // reshape(reshape(x)) is one reshape to the outer (static) target. The target is
    // spelled out, since a 0 in it ("copy the input dim") would now copy one of x's dims.
    if (op == "reshape" && inner && inner->op_name() == "reshape" && is_static(type.shape)) {
      n->set_operand(0, inner->operand(0));
      n->set_attr("shape", static_sizes(type.shape));
      if (!has_used_results(*inner)) KILN_RETURN_IF_ERROR(erase_with_dead_producers(inner));
      return true;
    }

    // reshape(linear(reshape(x [.., K], [M, K]), w), [.., N]) is linear(x, w): PyTorch's
    // decomposition flattens nn.Linear's leading dims around a 2-D GEMM, as ONNX's MatMul of
    // [.., K] does not. One op on x keeps the output a GEMM's own (no copy of a view into it).
    if (op == "reshape" && inner && (inner->op_name() == "linear" || inner->op_name() == "matmul") &&
        inner->operand(1)->shape().size() == 2 && inner->result(0)->uses().size() == 1)
      if (Value* flat = leading_dims_source(inner->operand(0), type.shape)) return unflatten_projection(n, inner, flat);

    // x+0, 0+x, x-0, x*1, 1*x, x/1. The identity operand may be any all-equal constant, but
    // only when broadcasting it does not change x's type. x*0 is left alone: NaN*0 is NaN.
    // x+0 may turn -0.0 into +0.0, which is accepted, as under fast-math "no signed zeros".
    if (n->num_operands() == 2 && (op == "add" || op == "sub" || op == "mul" || op == "div")) {
      const double unit = (op == "add" || op == "sub") ? 0.0 : 1.0;
      const bool commutes = op == "add" || op == "mul";
      for (int side = 1; side >= (commutes ? 0 : 1); --side) {
        Value* keep = n->operand(1 - side);
        if (keep->type() != type) continue;
        auto c = constant_value(n->operand(side));
        if (c && all_equal(*c, unit)) return forward(n, keep);
      }
    }
    // linear(x, w, 0) is linear(x, w): a zero bias (nn.Linear's at initialization, as PyTorch's
    // front end gives it) then reads as ONNX's matmul + add of zeros does once x+0 is gone, and
    // fuse-horizontal finds the projection as it finds the matmul.
    if (op == "linear" && n->num_operands() == 3) {
      auto c = constant_value(n->operand(2));
      if (c && all_equal(*c, 0.0)) {
        KILN_ASSIGN_OR_RETURN(Node * unbiased, n->graph()->create_node("linear", {x, n->operand(1)}, {type},
                                                                       n->attrs(), n));
        unbiased->set_loc(n->loc());
        return replace_by(n, unbiased);
      }
    }
    std::string approximate;
    if (Value* src = gelu_source(n, &approximate)) return raise_gelu(n, src, approximate);
    if (n->num_operands() == 1 && n->op()->has(kTraitElementwise)) return sink_reshape(n);
    return false;
  }

  /// Whether `v` is a one-element constant equal to `expect` up to its dtype's rounding.
  bool is_scalar(const Value* v, double expect) const {
    auto c = constant_value(v);
    if (!c || c->numel() != 1) return false;
    const double tol = c->dtype() == DType::kF16 ? 1e-3 : c->dtype() == DType::kBF16 ? 8e-3 : 1e-6;
    return std::abs(c->get_f64(0) - expect) <= tol * std::abs(expect);
  }

  /// The non-constant operand of a binary `op` node whose other operand is the scalar `c`.
  Value* with_scalar(const Value* v, const std::string& op, double c) const {
    const Node* p = v->producer();
    if (!p || p->op_name() != op || p->num_operands() != 2) return nullptr;
    for (int side = 0; side < 2; ++side)
      if (is_scalar(p->operand(side), c)) return p->operand(1 - side);
    return nullptr;
  }

  /// The x of x·x·x (either association), else null.
  static Value* cube_of(const Value* v) {
    const Node* p = v->producer();
    if (!p || p->op_name() != "mul" || p->num_operands() != 2) return nullptr;
    for (int side = 0; side < 2; ++side) {
      const Node* sq = p->operand(side)->producer();
      Value* x = p->operand(1 - side);
      if (sq && sq->op_name() == "mul" && sq->operand(0) == x && sq->num_operands() == 2 && sq->operand(1) == x)
        return x;
    }
    return nullptr;
  }

  /// For GELU spelled out as exporters emit it, the x it applies to (and whether it is the
  /// tanh approximation): 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) or 0.5·x·(1 + erf(x/√2)),
  /// the 0.5 on either product. A backend then sees one op (a GEMM epilogue can apply it).
  Value* gelu_source(const Node* n, std::string* approximate) const {
    if (n->op_name() != "mul" || n->num_operands() != 2) return nullptr;
    const TensorType& type = n->result(0)->type();
    for (int side = 0; side < 2; ++side) {
      const Value* a = n->operand(side);
      const Value* b = n->operand(1 - side);
      Value* x = with_scalar(a, "mul", 0.5);  // (0.5·x)·(1 + f)
      const Value* one_plus = b;
      if (!x) {  // (x·(1 + f))·0.5
        if (!is_scalar(b, 0.5) || !a->producer() || a->producer()->op_name() != "mul") continue;
        const Node* p = a->producer();
        for (int s = 0; s < 2 && !x; ++s)
          if (p->operand(s)->producer() && p->operand(s)->producer()->op_name() == "add") {
            x = p->operand(1 - s);
            one_plus = p->operand(s);
          }
        if (!x) continue;
      }
      if (x->type() != type) continue;
      const Value* f = with_scalar(one_plus, "add", 1.0);
      const Node* fn = f ? f->producer() : nullptr;
      if (!fn || fn->num_operands() != 1) continue;
      if (fn->op_name() == "erf") {
        const Value* arg = fn->operand(0);
        if (with_scalar(arg, "div", std::sqrt(2.0)) == x || with_scalar(arg, "mul", std::sqrt(0.5)) == x) {
          *approximate = "none";
          return x;
        }
        continue;
      }
      if (fn->op_name() != "tanh") continue;
      const Value* inner = with_scalar(fn->operand(0), "mul", std::sqrt(2.0 / 3.141592653589793));
      const Node* sum = inner ? inner->producer() : nullptr;
      if (!sum || sum->op_name() != "add" || sum->num_operands() != 2) continue;
      for (int s = 0; s < 2; ++s) {
        if (sum->operand(s) != x) continue;
        const Value* cubed = with_scalar(sum->operand(1 - s), "mul", 0.044715);
        if (!cubed) continue;
        const Node* c = cubed->producer();
        const bool is_cube = (c && c->op_name() == "pow" && c->operand(0) == x && is_scalar(c->operand(1), 3.0)) ||
                             cube_of(cubed) == x;
        if (is_cube) {
          *approximate = "tanh";
          return x;
        }
      }
    }
    return nullptr;
  }

  /// The source x of `flat` = reshape(x) to [M, K] when the projection's result [M, N] is
  /// reshaped to `out` = [d.., N] with M the product of the static d..: the reshapes only
  /// flattened and restored the leading dims a projection keeps.
  static Value* leading_dims_source(Value* flat, const Shape& out) {
    const Node* r = flat->producer();
    if (!r || r->op_name() != "reshape" || flat->shape().size() != 2 || out.size() < 2 || !is_static(out) ||
        !is_static(flat->shape()))
      return nullptr;
    int64_t m = 1;
    for (size_t d = 0; d + 1 < out.size(); ++d) m *= out[d].value();
    return m == flat->shape()[0].value() ? r->operand(0) : nullptr;
  }

  /// reshape `n` of projection `proj` (linear or matmul of a flattened `x`) as one projection
  /// of x viewed as [d.., K].
  static StatusOr<bool> unflatten_projection(Node* n, Node* proj, Value* x) {
    const Shape& out = n->result(0)->shape();
    Shape rows(out.begin(), out.end() - 1);
    rows.push_back(proj->operand(0)->shape()[1]);
    if (x->shape() != rows) {
      // The view takes the flattened value's name (tools such as kiln calibrate name a GEMM's
      // input), which that value gives up when the projection was its only reader.
      Value* flat = proj->operand(0);
      std::string name = flat->name();
      if (flat->uses().size() == 1)
        flat->set_name("");
      else if (!name.empty())
        name += ".rows";
      KILN_ASSIGN_OR_RETURN(Node * r, n->graph()->create_node("reshape", {x}, {TensorType{x->dtype(), rows}},
                                                              {{"shape", static_sizes(rows)}}, n, {name}));
      r->set_loc(proj->loc());
      x = r->result(0);
    }
    std::vector<Value*> operands = proj->operands();
    operands[0] = x;
    KILN_ASSIGN_OR_RETURN(Node * p, n->graph()->create_node(proj->op_name(), operands, {n->result(0)->type()},
                                                            proj->attrs(), n));
    p->set_loc(proj->loc());
    // The projection keeps the GEMM's name, by which kiln quant-report lists layers.
    if (!proj->result(0)->name().empty()) {
      const std::string name = proj->result(0)->name();
      proj->result(0)->set_name("");
      p->result(0)->set_name(name);
      return forward(n, p->result(0));
    }
    return replace_by(n, p);
  }

  static StatusOr<bool> raise_gelu(Node* n, Value* x, const std::string& approximate) {
    KILN_ASSIGN_OR_RETURN(Node * g, n->graph()->create_node("gelu", {x}, {n->result(0)->type()},
                                                            {{"approximate", approximate}}, n));
    g->set_loc(n->loc());
    return replace_by(n, g);
  }

  /// u(reshape(x)) -> reshape(u(x)) for a unary elementwise u and a reshape used only there:
  /// the op then sits right after x's producer, where a GEMM epilogue can absorb it, and the
  /// reshape meets the next one.
  static StatusOr<bool> sink_reshape(Node* n) {
    Node* r = n->operand(0)->producer();
    if (!r || r->op_name() != "reshape" || r->num_operands() != 1 || n->operand(0)->uses().size() != 1) return false;
    Value* x = r->operand(0);
    const TensorType& out = n->result(0)->type();
    if (has_unknown_dim(out) || has_unknown_dim(x->type())) return false;
    KILN_ASSIGN_OR_RETURN(Node * u, n->graph()->create_node(n->op_name(), {x}, {TensorType{out.dtype, x->shape()}},
                                                            n->attrs(), n));
    u->set_loc(n->loc());
    KILN_ASSIGN_OR_RETURN(Node * view, n->graph()->create_node("reshape", {u->result(0)}, {out}, r->attrs(), n));
    view->set_loc(r->loc());
    // The view keeps the op's name (callers may know it: a graph output); the op's new result
    // takes the dead reshape's name, since calibration and reports name values.
    const std::string name = n->result(0)->name(), view_name = r->result(0)->name();
    n->result(0)->set_name("");
    r->result(0)->set_name("");
    u->result(0)->set_name(view_name.empty() ? name + ".pre" : view_name);
    view->result(0)->set_name(name);
    return forward(n, view->result(0));
  }

  int64_t max_iterations_;
  int64_t fold_limit_bytes_;
};

}  // namespace

PassInfo canonicalize_pass_info() {
  PassInfo info;
  info.name = "canonicalize";
  info.version = "0.1.0";
  info.summary = "fold constants and simplify local patterns (x+0, neg(neg x), transpose pairs)";
  info.options = {
      {"max-iterations", OptionType::kInt, int64_t{10},
       "most sweeps over the graph before stopping short of a fixed point"},
      {"fold-limit-bytes", OptionType::kInt, int64_t{1} << 20,
       "largest folded result (bytes) materialized as a constant; 0 disables folding"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    const int64_t iterations = o.get_int("max-iterations");
    const int64_t limit = o.get_int("fold-limit-bytes");
    if (iterations < 1)
      return invalid_argument("canonicalize: max-iterations must be at least 1, got " +
                              std::to_string(iterations));
    if (limit < 0)
      return invalid_argument("canonicalize: fold-limit-bytes must not be negative, got " +
                              std::to_string(limit));
    return std::unique_ptr<Pass>(std::make_unique<Canonicalize>(iterations, limit));
  };
  return info;
}

}  // namespace kiln::transforms
