// The fuse-attention pass: softmax(q·kᵀ·scale + mask)·v as exporters emit it becomes one attention node.
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fusion.h"
#include "kiln/ir/interpreter.h"

namespace kiln::fusion {
namespace {

/// Added to a score, at most this much makes its softmax weight exactly 0 in f64 and f32
/// (exp underflows long before), so such a mask entry means "masked out".
constexpr double kMaskedOut = -1e4;

std::optional<double> scalar_value(const Value* v) {
  if (!is_scalar_constant(v->producer())) return std::nullopt;
  return v->producer()->attr("value")->as_tensor().get_f64(0);
}

bool single_use(const Value* v) { return v->uses().size() == 1 && v->uses()[0].user; }

Node* producer_of(const Value* v, const char* op) {
  Node* p = v->producer();
  return p && p->op_name() == op ? p : nullptr;
}

/// What the walk from softmax's input back to q·kᵀ found.
struct Scores {
  Node* qk = nullptr;             ///< matmul(q, kᵀ)
  double scale = 1;
  Value* mask = nullptr;          ///< an additive mask, or null
  Node* where_fill = nullptr;     ///< where(cond, scores, fill): builds the mask from cond
  std::vector<Node*> chain;       ///< the nodes between qk and softmax, to erase once dead
};

/// Follows single-use mul/div by scalars, add of a mask and where(cond, x, -big) back to the
/// q·kᵀ matmul; nullopt if the chain holds anything else.
std::optional<Scores> match_scores(Value* v) {
  Scores s;
  while (true) {
    Node* n = v->producer();
    if (!n || !single_use(v)) return std::nullopt;
    const std::string& op = n->op_name();
    if (op == "matmul") {
      s.qk = n;
      return s;
    }
    if (op == "mul" || op == "div") {
      std::optional<double> c1 = scalar_value(n->operand(1));
      std::optional<double> c0 = op == "mul" ? scalar_value(n->operand(0)) : std::nullopt;
      if (c1 && *c1 != 0) {
        s.scale *= op == "mul" ? *c1 : 1 / *c1;
        v = n->operand(0);
      } else if (c0) {
        s.scale *= *c0;
        v = n->operand(1);
      } else {
        return std::nullopt;
      }
    } else if (op == "add") {
      if (s.mask || s.where_fill) return std::nullopt;
      // The mask is the operand that does not lead back to a matmul through the chain.
      const int chain_side = match_scores(n->operand(0)) ? 0 : 1;
      s.mask = n->operand(1 - chain_side);
      v = n->operand(chain_side);
    } else if (op == "cast") {
      // Scores widened for the softmax (bf16 matmul, then f32 scale, mask and softmax): the
      // fused kernel keeps them in f32 anyway.
      if (!is_float(n->operand(0)->dtype()) || !is_float(n->result()->dtype())) return std::nullopt;
      v = n->operand(0);
    } else if (op == "where") {
      std::optional<double> fill = scalar_value(n->operand(2));
      if (s.mask || s.where_fill || !fill || *fill > kMaskedOut) return std::nullopt;
      s.where_fill = n;
      v = n->operand(1);
    } else {
      return std::nullopt;
    }
    s.chain.push_back(n);
  }
}

/// Largest mask computed at compile time to check for the causal pattern (a [B, 1, S, S] f32
/// mask of batch 16 at seq 1024 is 64 MiB).
constexpr int64_t kMaskEvalLimitBytes = int64_t{64} << 20;

/// The value of `v` when it is computed from constants alone (no graph input, no state):
/// masks exporters build from ranges and comparisons, or expand to the batch, and that
/// canonicalize leaves unfolded because of their size. Evaluated with the reference
/// interpreter on a private copy of the subgraph; nullopt when it is not constant or too large.
std::optional<Tensor> constant_value(const Value* v) {
  std::vector<const Node*> order;  // producers before consumers
  std::vector<const Node*> stack = {v->producer()};
  std::vector<const Node*> seen;
  auto known = [&](const Node* n) { return std::find(seen.begin(), seen.end(), n) != seen.end(); };
  while (!stack.empty()) {
    const Node* n = stack.back();
    if (!n || n->op()->has(kTraitSideEffects) || seen.size() > 256) return std::nullopt;
    bool ready = true;
    for (const Value* o : n->operands())
      if (!known(o->producer())) {
        if (!o->producer()) return std::nullopt;  // a graph input
        stack.push_back(o->producer());
        ready = false;
      }
    if (!ready) continue;
    stack.pop_back();
    if (known(n)) continue;
    for (int i = 0; i < n->num_results(); ++i) {
      const TensorType& t = n->result(i)->type();
      if (!is_static(t.shape) || dtype_storage_bytes(t.dtype, num_elements(t.shape)) > kMaskEvalLimitBytes)
        return std::nullopt;
    }
    seen.push_back(n);
    order.push_back(n);
  }
  Graph tmp("mask");
  std::vector<std::pair<const Node*, Node*>> copies;
  auto copy_of = [&](const Value* o) -> Value* {
    for (auto& [orig, c] : copies)
      if (orig == o->producer()) return c->result(o->index());
    return nullptr;
  };
  for (const Node* n : order) {
    std::vector<Value*> ins;
    for (const Value* o : n->operands()) ins.push_back(copy_of(o));
    std::vector<TensorType> types;
    for (int i = 0; i < n->num_results(); ++i) types.push_back(n->result(i)->type());
    auto made = tmp.create_node(n->op_name(), ins, types, n->attrs());
    if (!made.ok()) return std::nullopt;
    copies.emplace_back(n, *made);
  }
  tmp.set_outputs({copy_of(v)});
  auto outs = Interpreter().run(tmp, {});
  if (!outs.ok()) return std::nullopt;
  return std::move((*outs)[0]);
}

/// Whether `mask` (additive, or boolean "may see" when `is_bool`) is computed from constants
/// and is exactly the causal pattern over [Sq, Skv] in every leading slice: key j visible to
/// query i iff j <= i + (Skv - Sq).
/// `seen` remembers the answer per mask: one mask usually serves every layer.
bool is_causal_constant(const Value* mask, int64_t sq, int64_t skv, bool is_bool, std::map<const Value*, bool>& seen) {
  const auto& dims = mask->shape();
  if (dims.size() < 2 || dims[dims.size() - 2] != Dim(sq) || dims.back() != Dim(skv)) return false;
  if (auto it = seen.find(mask); it != seen.end()) return it->second;
  bool& causal = seen[mask] = false;
  std::optional<Tensor> t = constant_value(mask);
  if (!t) return false;
  const int64_t slices = t->numel() / (sq * skv);
  for (int64_t b = 0; b < slices; ++b)
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t j = 0; j < skv; ++j) {
        const double x = t->get_f64((b * sq + i) * skv + j);
        const bool visible = j <= i + (skv - sq);
        if (is_bool ? (x != 0) != visible : (visible ? x != 0 : !(x <= kMaskedOut))) return false;
      }
  return causal = true;
}

/// Peels mul/div by scalar constants off an operand of q·kᵀ, folding them into `scale`.
Value* peel_scale(Value* v, double& scale) {
  while (Node* n = v->producer()) {
    std::optional<double> c = scalar_value(n->operand(n->num_operands() - 1));
    if (n->op_name() == "mul" && c) {
      scale *= *c;
    } else if (n->op_name() == "div" && c && *c != 0) {
      scale /= *c;
    } else {
      break;
    }
    v = n->operand(0);
  }
  return v;
}

class Rewriter {
 public:
  Rewriter(Graph& g, Node* before) : g_(g), before_(before) {}

  StatusOr<Value*> add(const std::string& op, std::vector<Value*> ins, TensorType t, AttrMap a) {
    KILN_ASSIGN_OR_RETURN(Node * n, g_.create_node(op, std::move(ins), {std::move(t)}, std::move(a),
                                                   before_));
    n->set_loc(before_->loc());
    return n->result();
  }

  /// k [B, H, Skv, D] from kᵀ [B, H, D, Skv]: undoes a transpose feeding it where it can.
  StatusOr<Value*> untranspose(Value* kt) {
    Value* src = kt;
    std::vector<int64_t> perm = {0, 1, 3, 2};
    if (Node* t = producer_of(kt, "transpose")) {
      const std::vector<int64_t> p = t->get_ints("perm");
      if (p.size() == 4) {
        perm = {p[0], p[1], p[3], p[2]};
        src = t->operand(0);
      }
    }
    if (perm == std::vector<int64_t>{0, 1, 2, 3}) return src;
    const Shape& s = src->shape();
    return add("transpose", {src}, TensorType{src->dtype(), {s[static_cast<size_t>(perm[0])],
                                                            s[static_cast<size_t>(perm[1])],
                                                            s[static_cast<size_t>(perm[2])],
                                                            s[static_cast<size_t>(perm[3])]}},
               {{"perm", perm}});
  }

  /// GQA as exporters write it: reshape(expand(unsqueeze(x [B, Hkv, S, D], axis 2) to
  /// [B, Hkv, rep, S, D]) to [B, Hkv·rep, S, D]); returns x, which the op indexes by h / rep.
  StatusOr<Value*> unrepeat(Value* v) {
    Node* r = producer_of(v, "reshape");
    Node* e = r ? producer_of(r->operand(0), "expand") : nullptr;
    if (!e) return v;
    const Shape& es = e->result()->shape();
    const Shape& in = e->operand(0)->shape();
    const Shape& rs = v->shape();
    for (const Dim& d : in)
      if (!d.is_static()) return v;
    if (es.size() != 5 || in.size() != 5 || in[2] != Dim(1) || in[0] != es[0] || in[1] != es[1] ||
        in[3] != es[3] || in[4] != es[4] || rs[0] != es[0] || rs[2] != es[3] || rs[3] != es[4])
      return v;
    Value* x = e->operand(0);
    if (Node* u = producer_of(x, "unsqueeze"); u && u->operand(0)->shape().size() == 4) return u->operand(0);
    const std::vector<int64_t> to = {in[0].value(), in[1].value(), in[3].value(), in[4].value()};
    return add("reshape", {x}, TensorType{x->dtype(), shape_of(to)}, {{"shape", to}});
  }

 private:
  Graph& g_;
  Node* before_;
};

bool rank4(const Value* v) { return v->shape().size() == 4; }

/// Tries to rewrite the attention ending in matmul `out` = matmul(softmax(...), v).
StatusOr<bool> fuse_one(Graph& g, Node* out, bool fuse_f32, std::map<const Value*, bool>& causal_masks) {
  std::vector<Node*> dead = {out};
  Value* p = out->operand(0);
  if (Node* c = producer_of(p, "cast"); c && single_use(p)) dead.push_back(c), p = c->operand(0);
  Node* sm = producer_of(p, "softmax");
  if (!sm || !single_use(p) || !rank4(p)) return false;
  const int64_t axis = sm->get_int("axis", -1);
  if (axis != -1 && axis != 3) return false;
  dead.push_back(sm);
  Value* x = sm->operand(0);
  if (Node* c = producer_of(x, "cast"); c && single_use(x)) dead.push_back(c), x = c->operand(0);
  std::optional<Scores> s = match_scores(x);
  if (!s || !single_use(s->qk->result())) return false;
  for (Node* n : s->chain) dead.push_back(n);
  dead.push_back(s->qk);
  Value* q = peel_scale(s->qk->operand(0), s->scale);
  Value* kt = peel_scale(s->qk->operand(1), s->scale);
  Value* v = out->operand(1);
  if (!rank4(q) || !rank4(kt) || !rank4(v) || has_unknown_dim(out->result()->shape())) return false;
  const DType dt = q->dtype();
  if (!is_float(dt) || kt->dtype() != dt || v->dtype() != dt || out->result()->dtype() != dt)
    return false;
  if (dt == DType::kF32 && !fuse_f32) return false;
  const Shape& qs = q->shape();
  const Shape& ks = kt->shape();
  if (!qs[2].is_static() || !ks[3].is_static()) return false;
  const int64_t sq = qs[2].value(), skv = ks[3].value();

  Rewriter rw(g, out);
  bool causal = false;
  Value* mask = s->mask;
  if (s->where_fill) {
    Value* cond = s->where_fill->operand(0);
    if (is_causal_constant(cond, sq, skv, /*is_bool=*/true, causal_masks)) {
      causal = true;
    } else {
      // where(cond, scores, fill) == scores + where(cond, 0, fill).
      const TensorType st{dt, {}};
      KILN_ASSIGN_OR_RETURN(Value * zero, rw.add("constant", {}, st,
                                                 {{"value", Tensor::scalar_f64(dt, 0)}}));
      KILN_ASSIGN_OR_RETURN(mask, rw.add("where", {cond, zero, s->where_fill->operand(2)},
                                         TensorType{dt, cond->shape()}, {}));
    }
  } else if (mask && is_causal_constant(mask, sq, skv, /*is_bool=*/false, causal_masks)) {
    causal = true;
    mask = nullptr;
  }
  KILN_ASSIGN_OR_RETURN(Value * k, rw.untranspose(kt));
  k = peel_scale(k, s->scale);  // a scale applied to k before its transpose
  KILN_ASSIGN_OR_RETURN(k, rw.unrepeat(k));
  KILN_ASSIGN_OR_RETURN(v, rw.unrepeat(v));
  std::vector<Value*> ins = {q, k, v};
  if (mask) ins.push_back(mask);
  KILN_ASSIGN_OR_RETURN(Value * y, rw.add("attention", ins, out->result()->type(),
                                          {{"scale", s->scale}, {"causal", causal ? 1 : 0}}));
  y->set_name(out->result()->name());
  out->result()->replace_all_uses_with(y);
  for (Node* n : dead)
    if (!n->result()->has_uses()) KILN_RETURN_IF_ERROR(g.erase_node(n));
  return true;
}

class FuseAttention : public Pass {
 public:
  explicit FuseAttention(bool fuse_f32) : fuse_f32_(fuse_f32) {}
  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    // Innermost graphs first, each on its own.
    auto fuse = [&](Graph& sub) -> Status {
      KILN_ASSIGN_OR_RETURN(bool c, fuse_graph(sub));
      changed |= c;
      return ok_status();
    };
    KILN_RETURN_IF_ERROR(walk_graphs(g, fuse, WalkOrder::kPostOrder));
    return changed;
  }

 private:
  /// Fuses the attention patterns of `g` itself (not those nested in its regions).
  StatusOr<bool> fuse_graph(Graph& g) {
    bool changed = false;
    std::vector<Node*> outs;
    for (Node* n : g.node_list())
      if (n->op_name() == "matmul" && n->num_operands() == 2) outs.push_back(n);
    std::map<const Value*, bool> causal_masks;
    for (Node* n : outs) {
      KILN_ASSIGN_OR_RETURN(bool f, fuse_one(g, n, fuse_f32_, causal_masks));
      changed |= f;
    }
    std::vector<Node*> masked;
    for (Node* n : g.node_list())
      if (n->op_name() == "attention" && n->num_operands() == 4 && n->get_int("causal", 0) == 0)
        masked.push_back(n);
    for (Node* n : masked) {
      KILN_ASSIGN_OR_RETURN(bool f, causal_from_mask(g, n, causal_masks));
      changed |= f;
    }
    return changed;
  }

  /// An attention node that already exists (a front end's, from PyTorch's
  /// scaled_dot_product_attention) with a constant causal mask: the same node with causal = 1
  /// and no mask, as fuse_one makes it, so the kernel skips the masked blocks instead of
  /// loading a mask for every score.
  static StatusOr<bool> causal_from_mask(Graph& g, Node* n, std::map<const Value*, bool>& causal_masks) {
    const Shape& qs = n->operand(0)->shape();
    const Shape& ks = n->operand(1)->shape();
    if (!qs[2].is_static() || !ks[2].is_static()) return false;
    if (!is_causal_constant(n->operand(3), qs[2].value(), ks[2].value(), /*is_bool=*/false, causal_masks))
      return false;
    Rewriter rw(g, n);
    KILN_ASSIGN_OR_RETURN(Value * y, rw.add("attention", {n->operand(0), n->operand(1), n->operand(2)},
                                            n->result()->type(),
                                            {{"scale", n->get_float("scale")}, {"causal", int64_t{1}}}));
    y->set_name(n->result()->name());
    n->result()->replace_all_uses_with(y);
    KILN_RETURN_IF_ERROR(g.erase_node(n));
    return true;
  }

  bool fuse_f32_;
};

}  // namespace

PassInfo fuse_attention_pass_info() {
  PassInfo info;
  info.name = "fuse-attention";
  info.version = "0.1.0";
  info.summary = "rewrite softmax(q·kᵀ·scale + mask)·v into one attention node (causal, GQA); a constant causal mask of an attention node becomes causal = 1";
  // f32 attention runs on CUDA cores (a register-tiled flash kernel); fused it is faster than two
  // f32 GEMMs plus a softmax and never materializes the score matrix. `f32 = false` keeps the
  // unfused form, e.g. to compare.
  info.options = {{"f32", OptionType::kBool, true,
                   "also fuse f32 attention (saves the score matrix's memory and its round trips)"}};
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    return std::unique_ptr<Pass>(std::make_unique<FuseAttention>(o.get_bool("f32")));
  };
  return info;
}

}  // namespace kiln::fusion
