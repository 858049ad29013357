// The layout-nhwc pass: convolutions run channels last (`conv {layout = "nhwc"}`), the layout
// cuDNN's tensor-core kernels and GEMM-shaped 1x1 convolutions read fastest, while the graph's
// inputs and outputs keep their NCHW shapes.
//
// Each eligible conv gets a transpose to channels-last before it and one back after it (a 1x1
// conv becomes a linear layer over [N, H, W, C], one GEMM with epilogues; a conv whose kernel
// equals its stride becomes one over its patches). Walking
// in graph order, the transpose back then sinks through elementwise ops (add, relu, mul by a
// per-channel scale, ...) and spatial reductions, and meets the next conv's transpose to
// channels-last, where the pair cancels: a ResNet or ConvNeXt body is left with one transpose at
// its entry and one before its head. Constant weights are permuted at compile time.
#include <algorithm>
#include <string>
#include <vector>

#include "fusion.h"

namespace kiln::fusion {
namespace {

using Perm = std::vector<int64_t>;

Perm channels_last_perm(int64_t rank) {  // [N, C, sp...] -> [N, sp..., C]
  Perm p = {0};
  for (int64_t d = 2; d < rank; ++d) p.push_back(d);
  p.push_back(1);
  return p;
}

bool is_identity(const Perm& p) {
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != static_cast<int64_t>(i)) return false;
  return true;
}

Perm inverse(const Perm& p) {
  Perm inv(p.size());
  for (size_t i = 0; i < p.size(); ++i) inv[static_cast<size_t>(p[i])] = static_cast<int64_t>(i);
  return inv;
}

template <typename S>
S permuted(const S& s, const Perm& p) {
  S r;
  for (int64_t a : p) r.push_back(s[static_cast<size_t>(a)]);
  return r;
}

TensorType permuted_type(const TensorType& t, const Perm& p) { return TensorType{t.dtype, permuted(t.shape, p)}; }

/// The bytes of `t` permuted by `p` (out dim i is in dim p[i]); i4 has no byte per element.
std::optional<Tensor> permute_tensor(const Tensor& t, const Perm& p) {
  if (t.dtype() == DType::kI4) return std::nullopt;
  const size_t esize = t.numel() ? t.nbytes() / static_cast<size_t>(t.numel()) : 1;
  const std::vector<int64_t>& in = t.shape();
  std::vector<int64_t> in_strides(in.size(), 1);
  for (size_t d = in.size(); d-- > 1;) in_strides[d - 1] = in_strides[d] * in[d];
  Tensor out(t.dtype(), permuted(in, p));
  const std::vector<int64_t>& os = out.shape();
  std::byte* dst = out.mutable_data();
  std::vector<int64_t> idx(os.size(), 0);
  for (int64_t i = 0; i < out.numel(); ++i) {
    int64_t src = 0;
    for (size_t d = 0; d < os.size(); ++d) src += idx[d] * in_strides[static_cast<size_t>(p[d])];
    std::copy_n(t.data() + static_cast<size_t>(src) * esize, esize, dst + static_cast<size_t>(i) * esize);
    for (size_t d = os.size(); d-- > 0;) {
      if (++idx[d] < os[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

class LayoutNhwc final : public Pass {
 public:
  LayoutNhwc(int64_t min_channels, bool depthwise, bool pointwise_as_linear, bool patches_as_linear)
      : min_channels_(min_channels),
        depthwise_(depthwise),
        pointwise_as_linear_(pointwise_as_linear),
        patches_as_linear_(patches_as_linear) {}

  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    for (Node* n : g.node_list()) {
      if (n->num_regions() != 0 || has_side_effects(*n)) continue;
      bool c = false;
      if (n->op_name() == "conv") {
        KILN_ASSIGN_OR_RETURN(c, to_channels_last(g, n));
      } else if (n->op() && n->op()->has(kTraitElementwise)) {
        KILN_ASSIGN_OR_RETURN(c, sink_through_elementwise(g, n));
      } else if (n->op_name().rfind("reduce_", 0) == 0) {
        KILN_ASSIGN_OR_RETURN(c, sink_through_reduce(g, n));
      }
      changed |= c;
    }
    // Transposes left without users (the ones that cancelled or sank) go.
    for (bool again = true; again;) {
      again = false;
      for (Node* n : g.node_list())
        if (n->op_name() == "transpose" && !n->result()->has_uses()) {
          KILN_RETURN_IF_ERROR(g.erase_node(n));
          again = true;
        }
    }
    return changed;
  }

 private:
  /// `v` permuted by `p`, inserted before `before`: an inverse transpose is cancelled, a
  /// constant permuted in place of a node.
  StatusOr<Value*> transposed(Graph& g, Value* v, const Perm& p, Node* before) {
    if (Node* t = v->producer(); t && t->op_name() == "transpose") {
      if (is_identity(permuted(perm_of(*t), p))) return t->operand(0);
    }
    // One transpose of a value serves every user (a residual branch read by two blocks).
    for (const auto& use : v->uses()) {
      Node* t = use.user;
      if (t && t->op_name() == "transpose" && t->graph() == &g && perm_of(*t) == p && comes_before(g, t, before))
        return t->result();
    }
    if (const Tensor* c = constant_tensor(v)) {
      if (std::optional<Tensor> pt = permute_tensor(*c, p)) {
        KILN_ASSIGN_OR_RETURN(Node * k, g.create_node("constant", {}, {pt->type()}, {{"value", *pt}}, before,
                                                      {v->name().empty() ? "" : v->name() + ".nhwc"}));
        k->set_loc(v->producer()->loc());
        return k->result();
      }
    }
    KILN_ASSIGN_OR_RETURN(Node * t, g.create_node("transpose", {v}, {permuted_type(v->type(), p)}, {{"perm", p}}, before));
    if (v->producer()) t->set_loc(v->producer()->loc());
    return t->result();
  }

  static bool comes_before(const Graph& g, const Node* a, const Node* b) {
    for (const Node* n : g.node_list()) {
      if (n == b) return false;
      if (n == a) return true;
    }
    return false;
  }

  /// Replaces `old`'s uses by `v` permuted back by `p` (a transpose after the new node).
  Status route_back(Graph& g, Node* old, Value* v, const Perm& p) {
    Node* next = nullptr;
    {
      auto nodes = g.node_list();
      auto it = std::find(nodes.begin(), nodes.end(), old);
      if (it != nodes.end() && ++it != nodes.end()) next = *it;
    }
    Value* r = old->result();
    KILN_ASSIGN_OR_RETURN(Node * t, g.create_node("transpose", {v}, {r->type()}, {{"perm", p}}, next));
    t->set_loc(old->loc());
    return take_over(g, old, t->result());
  }

  /// `v` replaces `old`'s result for every user, under its name, and `old` goes.
  static Status take_over(Graph& g, Node* old, Value* v) {
    Value* r = old->result();
    const std::string name = r->name();
    r->set_name("");
    r->replace_all_uses_with(v);
    v->set_name(name);
    return g.erase_node(old);
  }

  StatusOr<bool> to_channels_last(Graph& g, Node* n) {
    if (n->get_string("layout", "nchw") != "nchw") return false;
    Value* x = n->operand(0);
    const Shape& xs = x->shape();
    const int64_t rank = static_cast<int64_t>(xs.size());
    if (rank < 3 || !xs[1].is_static() || !n->operand(1)->shape()[1].is_static()) return false;
    const int64_t groups = n->get_int("groups", 1);
    // Few input channels (an image stem): NCHW's own kernels read these better.
    if (xs[1].value() < min_channels_) return false;
    if (groups > 1 && groups == xs[1].value() && !depthwise_) return false;
    // Asymmetric padding (ONNX's SAME_UPPER) has no channels-last kernel on the GPU backends.
    const std::vector<int64_t> pads = n->get_ints("pads");
    for (size_t d = 0; 2 * d < pads.size(); ++d)
      if (pads[d] != pads[pads.size() / 2 + d]) return false;
    const Perm last = channels_last_perm(rank), first = inverse(last);
    KILN_ASSIGN_OR_RETURN(Value * xt, transposed(g, x, last, n));
    const TensorType out = permuted_type(n->result()->type(), last);
    Node* c = nullptr;
    if (pointwise_as_linear_ && is_pointwise(*n)) {
      // A 1x1 conv channels last is a linear layer over [N, H, W, C]: one GEMM of N*H*W rows,
      // with its bias, activation and residual as GEMM epilogues.
      // [K, C, 1..] holds the same bytes as [K, 1.., C]: no permutation needed.
      const Shape& ws = n->operand(1)->shape();
      KILN_ASSIGN_OR_RETURN(Value * w2, reshaped(g, n->operand(1), {ws[0].value(), ws[1].value()}, n, ".kc"));
      std::vector<Value*> operands = {xt, w2};
      if (n->num_operands() == 3) operands.push_back(n->operand(2));
      KILN_ASSIGN_OR_RETURN(c, g.create_node("linear", operands, {out}, {}, n));
    } else if (patches_as_linear_ && is_patchify(*n)) {
      // Kernel k = stride, no padding (ConvNeXt's 2x2 stride-2 downsampling, a ViT's patch
      // embedding): each output pixel is a dot product over one k x k x C patch. Channels last,
      // [N, H, W, C] is [N, P, kh, Q, kw, C]; one transpose gathers the patches as
      // [N, P, Q, kh * kw * C] rows and the conv is a linear layer over them, one GEMM with its
      // epilogues, where cuDNN's strided conv kernels were several times slower.
      const Shape& ws = n->operand(1)->shape();
      const int64_t batch = xs[0].value(), c_in = xs[1].value(), kh = ws[2].value(), kw = ws[3].value();
      const int64_t p = xs[2].value() / kh, q = xs[3].value() / kw;
      KILN_ASSIGN_OR_RETURN(Value * split, reshaped(g, xt, {batch, p, kh, q, kw, c_in}, n));
      const Perm gather = {0, 1, 3, 2, 4, 5};
      KILN_ASSIGN_OR_RETURN(Node * t, g.create_node("transpose", {split}, {permuted_type(split->type(), gather)},
                                                    {{"perm", gather}}, n));
      t->set_loc(n->loc());
      KILN_ASSIGN_OR_RETURN(Value * patches, reshaped(g, t->result(), {batch, p, q, kh * kw * c_in}, n));
      // [K, C, kh, kw] channels last is [K, kh, kw, C]: rows of the patches' order.
      KILN_ASSIGN_OR_RETURN(Value * wt, transposed(g, n->operand(1), last, n));
      KILN_ASSIGN_OR_RETURN(Value * w2, reshaped(g, wt, {ws[0].value(), kh * kw * c_in}, n));
      std::vector<Value*> operands = {patches, w2};
      if (n->num_operands() == 3) operands.push_back(n->operand(2));
      KILN_ASSIGN_OR_RETURN(c, g.create_node("linear", operands, {out}, {}, n));
    } else {
      KILN_ASSIGN_OR_RETURN(Value * wt, transposed(g, n->operand(1), last, n));
      std::vector<Value*> operands = {xt, wt};
      if (n->num_operands() == 3) operands.push_back(n->operand(2));
      AttrMap attrs = n->attrs();
      attrs["layout"] = std::string("nhwc");
      KILN_ASSIGN_OR_RETURN(c, g.create_node("conv", operands, {out}, attrs, n));
    }
    c->set_loc(n->loc());
    KILN_RETURN_IF_ERROR(route_back(g, n, c->result(), first));
    return true;
  }

  /// Kernel 1, stride 1, no padding, one group: every output pixel is a dot product over C.
  static bool is_pointwise(const Node& n) {
    if (n.get_int("groups", 1) != 1) return false;
    const Shape& w = n.operand(1)->shape();
    for (size_t d = 2; d < w.size(); ++d)
      if (!w[d].is_static() || w[d].value() != 1) return false;
    for (const char* attr : {"strides", "dilations"})
      for (int64_t v : n.get_ints(attr))
        if (v != 1) return false;
    for (int64_t v : n.get_ints("pads"))
      if (v != 0) return false;
    return true;
  }

  /// A 2-D conv with one group whose kernel equals its strides, no padding or dilation, over
  /// static sizes that the kernel divides: its patches tile the input.
  static bool is_patchify(const Node& n) {
    const Shape& x = n.operand(0)->shape();
    const Shape& w = n.operand(1)->shape();
    if (n.get_int("groups", 1) != 1 || x.size() != 4 || w.size() != 4) return false;
    for (const Shape* s : {&x, &w})
      for (const Dim& d : *s)
        if (!d.is_static()) return false;
    const std::vector<int64_t> strides = n.get_ints("strides");
    if (strides.size() != 2 || strides[0] != w[2].value() || strides[1] != w[3].value()) return false;
    if (w[2].value() * w[3].value() == 1) return false;  // a 1x1 conv: is_pointwise's
    for (int64_t v : n.get_ints("dilations"))
      if (v != 1) return false;
    for (int64_t v : n.get_ints("pads"))
      if (v != 0) return false;
    return x[2].value() % w[2].value() == 0 && x[3].value() % w[3].value() == 0;
  }

  /// `v` viewed with `dims` (same elements in the same order): a constant is reshaped in place,
  /// named after `v` with `suffix`.
  StatusOr<Value*> reshaped(Graph& g, Value* v, const std::vector<int64_t>& dims, Node* before,
                            const std::string& suffix = ".rows") {
    Shape shape;
    for (int64_t d : dims) shape.push_back(Dim(d));
    const TensorType t{v->dtype(), shape};
    if (const Tensor* c = constant_tensor(v)) {
      KILN_ASSIGN_OR_RETURN(Node * k, g.create_node("constant", {}, {t}, {{"value", c->reshaped(dims)}}, before,
                                                    {v->name().empty() ? "" : v->name() + suffix}));
      return k->result();
    }
    KILN_ASSIGN_OR_RETURN(Node * r, g.create_node("reshape", {v}, {t}, {{"shape", dims}}, before));
    if (v->producer()) r->set_loc(v->producer()->loc());
    return r->result();
  }

  /// The permutation `v` arrives through when a transpose makes it, else nullopt.
  static std::optional<Perm> arriving_perm(const Value* v) {
    const Node* p = v->producer();
    if (!p || p->op_name() != "transpose") return std::nullopt;
    return perm_of(*p);
  }

  /// Small enough to permute alongside (a per-channel scale or bias, a scalar).
  static bool small(const Value* v) {
    int64_t elems = 1;
    for (const Dim& d : v->shape()) {
      if (!d.is_static()) return false;
      elems *= d.value();
    }
    return elems <= 65536;
  }

  /// op(transpose(a, P), transpose(b, P), small c) -> transpose(op(a, b, c'), P): the transpose
  /// moves below the op, where it can meet the next conv.
  StatusOr<bool> sink_through_elementwise(Graph& g, Node* n) {
    if (n->num_results() != 1 || n->num_operands() == 0) return false;
    // Ops that name a dim (a per-channel quantize's axis) would need it renumbered: left alone.
    if (n->has_attr("axis") || n->has_attr("axes")) return false;
    const size_t rank = n->result()->shape().size();
    std::optional<Perm> p;
    for (const Value* v : n->operands()) {
      std::optional<Perm> q = arriving_perm(v);
      if (!q || v->shape().size() != rank) continue;
      if (p && *p != *q) return false;
      p = q;
    }
    if (!p || !is_channels_first(*p)) return false;
    const Perm undo = inverse(*p);
    std::vector<Value*> operands;
    for (Value* v : n->operands()) {
      if (arriving_perm(v) == p && v->shape().size() == rank) {
        operands.push_back(v->producer()->operand(0));
        continue;
      }
      // A full-size operand in NCHW (a residual branch from before the first conv) is
      // transposed too: the op's result then stays channels last for the convs after it.
      if (!small(v) && v->shape().size() != rank) return false;
      Value* full = v;
      if (v->shape().size() < rank) {
        // Numpy broadcasting aligns trailing dims: leading 1s make the ranks equal first.
        std::vector<int64_t> shape(rank - v->shape().size(), 1);
        for (const Dim& d : v->shape()) shape.push_back(d.value());
        Shape s;
        for (int64_t d : shape) s.push_back(Dim(d));
        KILN_ASSIGN_OR_RETURN(Node * r, g.create_node("reshape", {v}, {TensorType{v->dtype(), s}}, {{"shape", shape}}, n));
        full = r->result();
      }
      KILN_ASSIGN_OR_RETURN(Value * t, transposed(g, full, undo, n));
      operands.push_back(t);
    }
    KILN_ASSIGN_OR_RETURN(Node * e, g.create_node(n->op_name(), operands, {permuted_type(n->result()->type(), undo)},
                                                  n->attrs(), n));
    e->set_loc(n->loc());
    KILN_RETURN_IF_ERROR(route_back(g, n, e->result(), *p));
    return true;
  }

  /// reduce(transpose(a, P), axes) -> transpose(reduce(a, P[axes]), P'): a global average pool
  /// reads the channels-last tensor directly; without keepdims over the spatial dims no
  /// transpose is left at all.
  StatusOr<bool> sink_through_reduce(Graph& g, Node* n) {
    if (n->num_operands() != 1 || n->num_results() != 1) return false;
    std::optional<Perm> p = arriving_perm(n->operand(0));
    if (!p || !is_channels_first(*p)) return false;
    const int64_t rank = static_cast<int64_t>(p->size());
    std::vector<int64_t> axes = n->get_ints("axes");
    if (axes.empty()) return false;  // all of them: nothing left to permute
    std::vector<bool> reduced(static_cast<size_t>(rank), false);
    for (int64_t a : axes) {
      if (a < -rank || a >= rank) return false;
      reduced[static_cast<size_t>(a < 0 ? a + rank : a)] = true;
    }
    std::vector<int64_t> inner_axes;
    for (int64_t d = 0; d < rank; ++d)
      if (reduced[static_cast<size_t>(d)]) inner_axes.push_back((*p)[static_cast<size_t>(d)]);
    std::sort(inner_axes.begin(), inner_axes.end());
    const bool keepdims = n->get_int("keepdims", 1) != 0;
    // The kept dims of the inner result, in its order, and the permutation back to n's order.
    Perm back;
    if (keepdims) {
      back = *p;
    } else {
      std::vector<int64_t> kept_inner;  // inner dims that survive, in inner order
      for (int64_t d = 0; d < rank; ++d)
        if (!std::count(inner_axes.begin(), inner_axes.end(), d)) kept_inner.push_back(d);
      for (int64_t d = 0; d < rank; ++d) {
        if (reduced[static_cast<size_t>(d)]) continue;
        const int64_t src = (*p)[static_cast<size_t>(d)];
        back.push_back(std::find(kept_inner.begin(), kept_inner.end(), src) - kept_inner.begin());
      }
    }
    Value* a = n->operand(0)->producer()->operand(0);
    AttrMap attrs = n->attrs();
    attrs["axes"] = inner_axes;
    TensorType inner{n->result()->dtype(), {}};
    for (int64_t d = 0; d < rank; ++d) {
      const bool red = std::count(inner_axes.begin(), inner_axes.end(), d) != 0;
      if (!red) inner.shape.push_back(a->shape()[static_cast<size_t>(d)]);
      else if (keepdims) inner.shape.push_back(Dim(1));
    }
    KILN_ASSIGN_OR_RETURN(Node * r, g.create_node(n->op_name(), {a}, {inner}, attrs, n));
    r->set_loc(n->loc());
    KILN_RETURN_IF_ERROR(is_identity(back) ? take_over(g, n, r->result()) : route_back(g, n, r->result(), back));
    return true;
  }

  /// Whether `p` moves the last dim to position 1: the transpose after a channels-last conv.
  static bool is_channels_first(const Perm& p) { return p == inverse(channels_last_perm(static_cast<int64_t>(p.size()))); }

  int64_t min_channels_;
  bool depthwise_;
  bool pointwise_as_linear_;
  bool patches_as_linear_;
};

}  // namespace

PassInfo layout_nhwc_pass_info() {
  PassInfo info;
  info.name = "layout-nhwc";
  info.version = "0.1.0";
  info.summary = "run convolutions channels last (layout = \"nhwc\"), moving transposes to the graph's edges";
  info.options = {
      {"min-channels", OptionType::kInt, int64_t{8},
       "convs with fewer input channels (an image stem) stay NCHW"},
      {"depthwise", OptionType::kBool, true,
       "also depthwise convs (groups == channels), which the CUDA backend runs with its "
       "channels-last depthwise kernel; off: they stay NCHW, with transposes around them"},
      {"pointwise-as-linear", OptionType::kBool, true,
       "1x1 convs (stride 1, no padding, one group) become linear layers over [N, H, W, C]"},
      {"patches-as-linear", OptionType::kBool, true,
       "2-D convs whose kernel equals their strides (no padding, one group: patch embeddings, "
       "ConvNeXt's downsampling) become a transpose gathering the patches and a linear layer"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    const int64_t min_channels = o.get_int("min-channels");
    if (min_channels < 1)
      return invalid_argument("layout-nhwc: min-channels must be at least 1, got " + std::to_string(min_channels));
    return std::unique_ptr<Pass>(
        std::make_unique<LayoutNhwc>(min_channels, o.get_bool("depthwise"), o.get_bool("pointwise-as-linear"),
                                     o.get_bool("patches-as-linear")));
  };
  return info;
}

}  // namespace kiln::fusion
