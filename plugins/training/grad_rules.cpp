// Gradient rules, one per core op: each emits the vector-Jacobian product of its op from core
// ops. Every rule is checked against central finite differences in f64 (tests/training).
#include <cmath>
#include <map>
#include <numbers>

#include "autodiff.h"
#include "fp8_training.h"

namespace kiln::training {
namespace {

using Grads = std::vector<Value*>;

Value* zero_like(Builder& b, Value* v) { return b.scalar(0.0, v->dtype()); }

std::vector<int64_t> axes_attr(const Node& n, const std::string& name, int64_t rank) {
  std::vector<int64_t> axes = n.get_ints(name);
  if (axes.empty())
    for (int64_t d = 0; d < rank; ++d) axes.push_back(d);
  for (int64_t& a : axes)
    if (a < 0) a += rank;
  std::sort(axes.begin(), axes.end());
  return axes;
}

int64_t axis_attr(const Node& n, const std::string& name, int64_t rank, int64_t fallback) {
  int64_t a = n.get_int(name, fallback);
  return a < 0 ? a + rank : a;
}

std::vector<int64_t> range_from(int64_t first, int64_t end) {
  std::vector<int64_t> out;
  for (int64_t d = first; d < end; ++d) out.push_back(d);
  return out;
}

/// x's shape with size 1 at `axes`: a reduction's result with keepdims.
Shape kept_shape(const Shape& s, const std::vector<int64_t>& axes) {
  Shape out = s;
  for (int64_t a : axes) out[static_cast<size_t>(a)] = Dim(1);
  return out;
}

/// A reduction's gradient (or result) brought back to x's shape: keepdims restored, expanded.
Value* unreduce(Builder& b, Value* g, const Value* x, const std::vector<int64_t>& axes) {
  return b.expand(b.reshape(g, kept_shape(x->shape(), axes)), x->shape());
}

int64_t count_of(const Value* x, const std::vector<int64_t>& axes) {
  const std::vector<int64_t> sizes = require_static(x->shape(), "a reduced operand");
  int64_t n = 1;
  for (int64_t a : axes) n *= sizes[static_cast<size_t>(a)];
  return n;
}

/// The rule of an elementwise unary op from its derivative dy/dx.
GradRule unary(std::function<Value*(GradContext&)> dydx) {
  return [dydx](GradContext& c) -> Grads { return {c.b.mul(c.g(), dydx(c))}; };
}

/// The rule of a broadcasting binary op from the two partial products g*dy/da, g*dy/db.
GradRule binary(std::function<Value*(GradContext&)> ga, std::function<Value*(GradContext&)> gb) {
  return [ga, gb](GradContext& c) -> Grads {
    Grads out(2, nullptr);
    if (c.wants(0)) out[0] = c.b.sum_to(ga(c), c.x(0)->shape());
    if (c.wants(1)) out[1] = c.b.sum_to(gb(c), c.x(1)->shape());
    return out;
  };
}

/// Gradient passes only where `mask` holds (clip, relu, ...).
Value* masked(Builder& b, Value* mask, Value* g) { return b.where(mask, g, zero_like(b, g)); }

Value* gelu_derivative(GradContext& c) {
  Builder& b = c.b;
  Value* x = c.x(0);
  if (c.node.get_string("approximate") == "tanh") {
    const double k = std::sqrt(2.0 / std::numbers::pi), a = 0.044715;
    Value* x2 = b.mul(x, x);
    Value* inner = b.mul(b.add(x, b.mul(b.mul(x2, x), a)), k);
    Value* t = b.unary("tanh", inner);
    Value* dinner = b.mul(b.add(b.mul(x2, 3 * a), 1.0), k);
    Value* one_minus_t2 = b.add(b.neg(b.mul(t, t)), 1.0);
    return b.add(b.mul(b.add(t, 1.0), 0.5), b.mul(b.mul(b.mul(x, one_minus_t2), dinner), 0.5));
  }
  Value* cdf = b.mul(b.add(b.unary("erf", b.mul(x, 1 / std::numbers::sqrt2)), 1.0), 0.5);
  Value* pdf = b.mul(b.unary("exp", b.mul(b.mul(x, x), -0.5)), 1 / std::sqrt(2 * std::numbers::pi));
  return b.add(cdf, b.mul(x, pdf));
}

Grads matmul_rule(GradContext& c) {
  Builder& b = c.b;
  Value *a = c.x(0), *bm = c.x(1), *g = c.g();
  // 1-D operands become matrices ([K] -> [1, K] for a, [K, 1] for b) and g gets their unit dims.
  const bool a1 = a->type().rank() == 1, b1 = bm->type().rank() == 1;
  Value* A = a1 ? b.reshape(a, {Dim(1), a->shape()[0]}) : a;
  Value* B = b1 ? b.reshape(bm, {bm->shape()[0], Dim(1)}) : bm;
  Shape gs = g->shape();
  if (a1) gs.insert(gs.end() - (b1 ? 0 : 1), Dim(1));
  if (b1) gs.push_back(Dim(1));
  Value* G = b.reshape(g, gs);
  Grads out(2, nullptr);
  if (c.wants(0)) out[0] = b.reshape(b.sum_to(b.matmul(G, b.transpose_last2(B)), A->shape()), a->shape());
  if (c.wants(1)) out[1] = b.reshape(b.sum_to(b.matmul(b.transpose_last2(A), G), B->shape()), bm->shape());
  return out;
}

/// y = c + a @ b: c's gradient is g; a's and b's are matmul's, in their own dtype.
Grads matmul_acc_rule(GradContext& c) {
  Builder& b = c.b;
  Value *a = c.x(0), *bm = c.x(1);
  Value* g = c.g()->dtype() == a->dtype() ? c.g() : b.cast(c.g(), a->dtype());
  Grads out(3, nullptr);
  if (c.wants(0)) out[0] = b.matmul(g, b.transpose_last2(bm));
  if (c.wants(1)) out[1] = b.matmul(b.transpose_last2(a), g);
  if (c.wants(2)) out[2] = c.g();
  return out;
}

Grads linear_rule(GradContext& c) {
  Builder& b = c.b;
  Value *x = c.x(0), *w = c.x(1), *g = c.g();
  Grads out(3, nullptr);
  if (c.wants(0)) out[0] = b.matmul(g, w);
  if (c.wants(1)) {
    // Every leading dim is a row: gw = g2ᵀ · x2 with g2 [M, N], x2 [M, K].
    const std::vector<int64_t> xs = require_static(x->shape(), "linear's x");
    int64_t m = 1;
    for (size_t d = 0; d + 1 < xs.size(); ++d) m *= xs[d];
    Value* g2 = b.reshape(g, {Dim(m), w->shape()[0]});
    Value* x2 = b.reshape(x, {Dim(m), w->shape()[1]});
    out[1] = b.matmul(b.transpose_last2(g2), x2);
  }
  if (c.node.num_operands() > 2 && c.wants(2)) out[2] = b.sum_to(g, c.x(2)->shape());
  return out;
}

/// The normalized dims of layer_norm / rms_norm.
std::vector<int64_t> norm_axes(const Node& n, int64_t rank) { return range_from(axis_attr(n, "axis", rank, -1), rank); }

Grads trailing_norm_rule(GradContext& c, bool rms) {
  Builder& b = c.b;
  Value *x = c.x(0), *g = c.g();
  const std::vector<int64_t> axes = norm_axes(c.node, x->type().rank());
  const double eps = c.node.get_float("epsilon");
  Value* centered = rms ? x : b.sub(x, b.reduce("reduce_mean", x, axes, true));
  Value* rstd = b.unary("rsqrt", b.add(b.reduce("reduce_mean", b.mul(centered, centered), axes, true), eps));
  Value* xhat = b.mul(centered, rstd);
  const bool has_scale = c.node.num_operands() > 1;
  Value* gxhat = has_scale ? b.mul(g, c.x(1)) : g;
  Grads out(static_cast<size_t>(c.node.num_operands()), nullptr);
  if (c.wants(0)) {
    // dx = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat)); rms_norm has no mean term.
    Value* proj = b.mul(xhat, b.reduce("reduce_mean", b.mul(gxhat, xhat), axes, true));
    Value* inner = b.sub(gxhat, proj);
    if (!rms) inner = b.sub(inner, b.reduce("reduce_mean", gxhat, axes, true));
    out[0] = b.mul(rstd, inner);
  }
  if (has_scale && c.wants(1)) out[1] = b.sum_to(b.mul(g, xhat), c.x(1)->shape());
  if (!rms && c.node.num_operands() > 2 && c.wants(2)) out[2] = b.sum_to(g, c.x(2)->shape());
  return out;
}

Grads batch_norm_rule(GradContext& c) {
  Builder& b = c.b;
  Value *x = c.x(0), *g = c.g();
  // Per-channel operands [C] line up with dim 1 of x as [C, 1, ...].
  Shape cshape{x->shape()[1]};
  for (int64_t d = 2; d < x->type().rank(); ++d) cshape.push_back(Dim(1));
  auto per_channel = [&](Value* v) { return b.reshape(v, cshape); };
  auto reduce_to_c = [&](Value* v) { return b.reshape(b.sum_to(v, cshape), c.x(1)->shape()); };
  Value* rstd = b.unary("rsqrt", b.add(c.x(4), c.node.get_float("epsilon")));
  Value* centered = b.sub(x, per_channel(c.x(3)));
  Value* gs = b.mul(g, per_channel(c.x(1)));  // g * scale
  Grads out(5, nullptr);
  if (c.wants(0)) out[0] = b.mul(gs, per_channel(rstd));
  if (c.wants(1)) out[1] = b.mul(reduce_to_c(b.mul(g, centered)), rstd);
  if (c.wants(2)) out[2] = reduce_to_c(g);
  if (c.wants(3)) out[3] = b.neg(b.mul(reduce_to_c(gs), rstd));
  if (c.wants(4)) out[4] = b.mul(reduce_to_c(b.mul(gs, centered)), b.mul(b.mul(b.mul(rstd, rstd), rstd), -0.5));
  return out;
}

Grads reduce_rule(GradContext& c) {
  Builder& b = c.b;
  Value *x = c.x(0), *y = c.y(), *g = c.g();
  const std::string& op = c.node.op_name();
  const bool all = op == "amax";
  const std::vector<int64_t> axes = all ? range_from(0, x->type().rank()) : axes_attr(c.node, "axes", x->type().rank());
  if (op == "reduce_sum") return {unreduce(b, g, x, axes)};
  if (op == "reduce_mean") return {b.mul(unreduce(b, g, x, axes), 1.0 / static_cast<double>(count_of(x, axes)))};
  // max/min/amax: the gradient goes to the elements equal to the result, split evenly on ties.
  Value* probe = all ? b.unary("abs", x) : x;
  // amax's result is f32 whatever x is: recompute the maximum in x's dtype to find the hits.
  Value* yx = all ? b.expand(b.reduce("reduce_max", probe, axes, true), x->shape()) : unreduce(b, y, x, axes);
  Value* hit = b.cast(b.op("equal", {probe, yx}), x->dtype());
  Value* ties = unreduce(b, b.reduce("reduce_sum", hit, axes, true), x, axes);
  Value* share = b.div(b.mul(hit, unreduce(b, b.cast(g, x->dtype()), x, axes)), ties);
  return {all ? b.mul(share, b.unary("sign", x)) : share};
}

Grads gather_rule(GradContext& c) {
  Builder& b = c.b;
  Value *data = c.x(0), *idx = c.x(1);
  const int64_t axis = axis_attr(c.node, "axis", data->type().rank(), 0);
  // Each index's slice of g goes back to its row, repeated indices accumulating: a scatter-add
  // into zeros (an embedding's gradient), not a one-hot [indices, rows] product, which for a
  // 50257-token vocabulary and 4096 tokens is a 0.8 GB operand and a 4096-deep GEMM.
  return {b.op("scatter_add", {b.zeros(data->type()), idx, b.cast(c.g(), data->dtype())}, {{"axis", Attribute(axis)}}),
          nullptr};
}

Grads scatter_add_rule(GradContext& c) {
  Builder& b = c.b;
  const Value* data = c.x(0);
  const int64_t axis = axis_attr(c.node, "axis", data->type().rank(), 0);
  return {c.g(), nullptr, b.op("gather", {c.g(), c.x(1)}, {{"axis", Attribute(axis)}})};
}

Grads slice_rule(GradContext& c) {
  Builder& b = c.b;
  Value* x = c.x(0);
  const int64_t rank = x->type().rank();
  const std::vector<int64_t> xs = require_static(x->shape(), "slice's operand");
  const std::vector<int64_t> starts = c.node.get_ints("starts"), ends = c.node.get_ints("ends");
  std::vector<int64_t> axes = c.node.get_ints("axes"), steps = c.node.get_ints("steps");
  if (axes.empty()) axes = range_from(0, static_cast<int64_t>(starts.size()));
  std::vector<int64_t> pads(static_cast<size_t>(2 * rank), 0);
  for (size_t i = 0; i < axes.size(); ++i) {
    const int64_t step = steps.empty() ? 1 : steps[i];
    if (step != 1)
      throw BuildError{unimplemented("slice with step " + std::to_string(step) + " has no gradient rule (only step 1)")};
    const int64_t a = axes[i] < 0 ? axes[i] + rank : axes[i], dim = xs[static_cast<size_t>(a)];
    auto clamp = [dim](int64_t v) { return std::clamp(v < 0 ? v + dim : v, int64_t{0}, dim); };
    const int64_t s = clamp(starts[i]), e = std::max(clamp(ends[i]), s);
    pads[static_cast<size_t>(a)] = s;
    pads[static_cast<size_t>(a + rank)] = dim - e;
  }
  return {b.op("pad", {c.g()}, {{"pads", Attribute(pads)}})};
}

Grads concat_rule(GradContext& c) {
  Builder& b = c.b;
  const int64_t rank = c.y()->type().rank(), axis = axis_attr(c.node, "axis", rank, 0);
  Grads out;
  int64_t offset = 0;
  for (int i = 0; i < c.node.num_operands(); ++i) {
    const std::vector<int64_t> s = require_static(c.x(i)->shape(), "concat's operand");
    const int64_t len = s[static_cast<size_t>(axis)];
    out.push_back(c.wants(i) ? b.op("slice", {c.g()}, {{"starts", Attribute(std::vector<int64_t>{offset})},
                                                       {"ends", Attribute(std::vector<int64_t>{offset + len})},
                                                       {"axes", Attribute(std::vector<int64_t>{axis})}})
                             : nullptr);
    offset += len;
  }
  return out;
}

Grads split_rule(GradContext& c) {
  std::vector<Value*> parts;
  for (int i = 0; i < c.node.num_results(); ++i) parts.push_back(c.g(i));
  const int64_t axis = axis_attr(c.node, "axis", c.x(0)->type().rank(), 0);
  return {c.b.op("concat", parts, {{"axis", Attribute(axis)}})};
}

Grads softmax_rule(GradContext& c, bool log) {
  Builder& b = c.b;
  Value *y = c.y(), *g = c.g();
  const std::vector<int64_t> axes{axis_attr(c.node, "axis", y->type().rank(), -1)};
  if (log) return {b.sub(g, b.mul(b.unary("exp", y), b.reduce("reduce_sum", g, axes, true)))};
  return {b.mul(y, b.sub(g, b.reduce("reduce_sum", b.mul(g, y), axes, true)))};
}

/// scores = q·kᵀ·scale + mask (+ causal -inf); p = softmax(scores); y = p·v. Key/value heads
/// are repeated for grouped-query attention and their gradients summed back per group.
Grads attention_rule(GradContext& c) {
  Builder& b = c.b;
  Value *q = c.x(0), *k = c.x(1), *v = c.x(2), *g = c.g();
  const std::vector<int64_t> qs = require_static(q->shape(), "attention's q"), ks = require_static(k->shape(), "attention's k"),
                             vs = require_static(v->shape(), "attention's v");
  const int64_t B = qs[0], hq = qs[1], sq = qs[2], hkv = ks[1], skv = ks[2], groups = hq / hkv;
  auto repeat_heads = [&](Value* t, const std::vector<int64_t>& s) {
    if (groups == 1) return t;
    Value* e = b.expand(b.reshape(t, {Dim(B), Dim(hkv), Dim(1), Dim(s[2]), Dim(s[3])}),
                        {Dim(B), Dim(hkv), Dim(groups), Dim(s[2]), Dim(s[3])});
    return b.reshape(e, {Dim(B), Dim(hq), Dim(s[2]), Dim(s[3])});
  };
  auto sum_heads = [&](Value* t, const std::vector<int64_t>& s) {
    if (groups == 1) return t;
    Value* r = b.reshape(t, {Dim(B), Dim(hkv), Dim(groups), Dim(s[2]), Dim(s[3])});
    return b.reshape(b.reduce("reduce_sum", r, {2}, false), {Dim(B), Dim(hkv), Dim(s[2]), Dim(s[3])});
  };
  Value *kr = repeat_heads(k, ks), *vr = repeat_heads(v, vs);
  const double scale = c.node.get_float("scale");
  Value* scores = b.mul(b.matmul(q, b.transpose_last2(kr)), scale);
  if (c.node.num_operands() > 3) scores = b.add(scores, b.cast(c.x(3), scores->dtype()));
  if (c.node.get_int("causal") != 0) {
    Tensor mask(scores->dtype(), {sq, skv});
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t j = 0; j < skv; ++j)
        mask.set_f64(i * skv + j, j > i + (skv - sq) ? -std::numeric_limits<double>::infinity() : 0.0);
    scores = b.add(scores, b.constant(mask));
  }
  Value* p = b.op("softmax", {scores}, {{"axis", Attribute(-1)}});
  Value* gp = b.matmul(g, b.transpose_last2(vr));
  Value* gs = b.mul(p, b.sub(gp, b.reduce("reduce_sum", b.mul(gp, p), {3}, true)));
  Grads out(static_cast<size_t>(c.node.num_operands()), nullptr);
  if (c.wants(0)) out[0] = b.mul(b.matmul(gs, kr), scale);
  if (c.wants(1)) out[1] = sum_heads(b.mul(b.matmul(b.transpose_last2(gs), q), scale), ks);
  if (c.wants(2)) out[2] = sum_heads(b.matmul(b.transpose_last2(p), g), vs);
  if (c.node.num_operands() > 3 && c.wants(3)) out[3] = b.sum_to(gs, c.x(3)->shape());
  return out;
}

/// The gradient of conv's x: g with zeros between its strided elements, padded, convolved with
/// the flipped weight whose in/out channels swap within each group (a transposed convolution).
Value* conv_input_grad(Builder& b, Value* g, Value* w, const std::vector<int64_t>& xs, const std::vector<int64_t>& st,
                       const std::vector<int64_t>& pads, const std::vector<int64_t>& dil, int64_t groups) {
  const std::vector<int64_t> ws = require_static(w->shape(), "conv's w"), gs = require_static(g->shape(), "conv's result");
  const size_t nsp = xs.size() - 2;
  const int64_t cout = ws[0], cin = xs[1];
  std::vector<int64_t> spatial;
  for (size_t d = 0; d < nsp; ++d) spatial.push_back(static_cast<int64_t>(d + 2));
  Value* gd = g;
  bool strided = false;
  for (int64_t s : st) strided |= s > 1;
  std::vector<int64_t> dilated_len(nsp);
  for (size_t d = 0; d < nsp; ++d) dilated_len[d] = (gs[d + 2] - 1) * st[d] + 1;
  if (strided) {
    // Zeros between strided elements: [N, O, h, 1, w, 1] padded to [N, O, h, s, w, s], flattened, cut.
    Shape split{Dim(gs[0]), Dim(gs[1])}, full{Dim(gs[0]), Dim(gs[1])};
    std::vector<int64_t> zpads(2 * (2 + 2 * nsp), 0);
    for (size_t d = 0; d < nsp; ++d) {
      split.push_back(Dim(gs[d + 2]));
      split.push_back(Dim(1));
      full.push_back(Dim(gs[d + 2] * st[d]));
      zpads[(2 + 2 * nsp) + 3 + 2 * d] = st[d] - 1;
    }
    gd = b.reshape(b.op("pad", {b.reshape(g, split)}, {{"pads", Attribute(zpads)}}), full);
    std::vector<int64_t> zeros(nsp, 0);
    gd = b.op("slice", {gd}, {{"starts", Attribute(zeros)}, {"ends", Attribute(dilated_len)}, {"axes", Attribute(spatial)}});
  }
  std::vector<int64_t> tpads(2 * (nsp + 2), 0);
  for (size_t d = 0; d < nsp; ++d) {
    const int64_t reach = dil[d] * (ws[d + 2] - 1), left = reach - pads[d];
    tpads[d + 2] = left;
    tpads[nsp + 2 + d + 2] = xs[d + 2] + reach - left - dilated_len[d];
  }
  gd = b.op("pad", {gd}, {{"pads", Attribute(tpads)}});
  std::vector<int64_t> starts, ends, steps(nsp, -1);
  for (size_t d = 0; d < nsp; ++d) {
    starts.push_back(ws[d + 2] - 1);
    ends.push_back(-ws[d + 2] - 1);
  }
  Value* flipped = b.op("slice", {w}, {{"starts", Attribute(starts)}, {"ends", Attribute(ends)},
                                       {"axes", Attribute(spatial)}, {"steps", Attribute(steps)}});
  Shape grouped{Dim(groups), Dim(cout / groups), Dim(cin / groups)}, swapped{Dim(cin), Dim(cout / groups)};
  std::vector<int64_t> perm{0, 2, 1};
  for (size_t d = 0; d < nsp; ++d) {
    grouped.push_back(Dim(ws[d + 2]));
    swapped.push_back(Dim(ws[d + 2]));
    perm.push_back(static_cast<int64_t>(d + 3));
  }
  Value* wt = b.reshape(b.transpose(b.reshape(flipped, grouped), perm), swapped);
  return b.op("conv", {gd, wt}, {{"groups", Attribute(groups)}, {"dilations", Attribute(dil)}});
}

/// conv's gradients as convolutions: dx is the transposed convolution (conv_input_grad); dw correlates the padded x with g (batch as the channel dim, stride and
/// dilation trading places), one group at a time.
Grads conv_rule(GradContext& c) {
  Builder& b = c.b;
  const Node& n = c.node;
  if (n.get_string("layout") == "nhwc")
    throw BuildError{unimplemented("conv in layout nhwc has no gradient rule (run autodiff before layout-nhwc)")};
  Value *x = c.x(0), *w = c.x(1), *g = c.g();
  const std::vector<int64_t> xs = require_static(x->shape(), "conv's x"), ws = require_static(w->shape(), "conv's w");
  const size_t nsp = xs.size() - 2;
  auto attr = [&](const char* name, size_t len, int64_t fallback) {
    std::vector<int64_t> v = n.get_ints(name);
    if (v.empty()) v.assign(len, fallback);
    return v;
  };
  const std::vector<int64_t> st = attr("strides", nsp, 1), pads = attr("pads", 2 * nsp, 0), dil = attr("dilations", nsp, 1);
  const int64_t groups = n.get_int("groups", 1), cout = ws[0], cin = xs[1];
  std::vector<int64_t> spatial, perm01{1, 0};
  for (size_t d = 0; d < nsp; ++d) {
    spatial.push_back(static_cast<int64_t>(d + 2));
    perm01.push_back(static_cast<int64_t>(d + 2));
  }
  Grads out(static_cast<size_t>(n.num_operands()), nullptr);
  if (n.num_operands() > 2 && c.wants(2)) {
    std::vector<int64_t> axes{0};
    axes.insert(axes.end(), spatial.begin(), spatial.end());
    out[2] = b.reduce("reduce_sum", g, axes, false);
  }
  if (c.wants(0)) out[0] = conv_input_grad(b, g, w, xs, st, pads, dil, groups);
  if (c.wants(1)) {
    std::vector<int64_t> xpads(2 * (nsp + 2), 0);
    for (size_t d = 0; d < nsp; ++d) {
      xpads[d + 2] = pads[d];
      xpads[nsp + 2 + d + 2] = pads[nsp + d];
    }
    Value* xp = b.op("pad", {x}, {{"pads", Attribute(xpads)}});
    std::vector<Value*> parts;
    const int64_t ci = cin / groups, co = cout / groups;
    for (int64_t k = 0; k < groups; ++k) {
      auto channels = [&](Value* v, int64_t from, int64_t len) {
        return groups == 1 ? v
                           : b.op("slice", {v}, {{"starts", Attribute(std::vector<int64_t>{from})},
                                                 {"ends", Attribute(std::vector<int64_t>{from + len})},
                                                 {"axes", Attribute(std::vector<int64_t>{1})}});
      };
      Value* r = b.op("conv", {b.transpose(channels(xp, k * ci, ci), perm01), b.transpose(channels(g, k * co, co), perm01)},
                      {{"strides", Attribute(dil)}, {"dilations", Attribute(st)}});
      std::vector<int64_t> zeros(nsp, 0), kernel(ws.begin() + 2, ws.end());
      r = b.op("slice", {r}, {{"starts", Attribute(zeros)}, {"ends", Attribute(kernel)}, {"axes", Attribute(spatial)}});
      parts.push_back(b.transpose(r, perm01));
    }
    out[1] = parts.size() == 1 ? parts[0] : b.op("concat", parts, {{"axis", Attribute(0)}});
  }
  return out;
}

/// avg_pool whose every window divides by its full size (no padding, or count_include_pad) is a
/// depthwise convolution with weights 1/size: its gradient is that convolution's.
Grads avg_pool_rule(GradContext& c) {
  const Node& n = c.node;
  const std::vector<int64_t> xs = require_static(c.x(0)->shape(), "avg_pool's x");
  const size_t nsp = xs.size() - 2;
  const std::vector<int64_t> kernel = n.get_ints("kernel_shape");
  std::vector<int64_t> st = n.get_ints("strides"), pads = n.get_ints("pads");
  if (st.empty()) st.assign(nsp, 1);
  if (pads.empty()) pads.assign(2 * nsp, 0);
  bool padded = false;
  for (int64_t p : pads) padded |= p != 0;
  if (n.get_int("ceil_mode") != 0 || (padded && n.get_int("count_include_pad") == 0))
    throw BuildError{unimplemented("avg_pool with ceil_mode or with padding not counted has no gradient rule")};
  std::vector<int64_t> wshape{xs[1], 1};
  int64_t size = 1;
  for (int64_t k : kernel) {
    wshape.push_back(k);
    size *= k;
  }
  Tensor ones(c.x(0)->dtype(), wshape);
  for (int64_t i = 0; i < ones.numel(); ++i) ones.set_f64(i, 1.0 / static_cast<double>(size));
  return {conv_input_grad(c.b, c.g(), c.b.constant(ones), xs, st, pads, std::vector<int64_t>(nsp, 1), xs[1])};
}

/// One cross_entropy_grad node (softmax - onehot, ignored rows 0, times the loss's gradient): a
/// backend lowers it in one kernel, decompose-losses spells it in core ops where none does. The
/// mean's division stays outside, on the scalar, so the op is row-local (a row-split data-parallel
/// step computes it rank by rank, the count being the global one).
Grads cross_entropy_rule(GradContext& c) {
  Builder& b = c.b;
  Value *logits = c.x(0), *target = c.x(1);
  Value* dloss = c.g();
  if (c.node.get_string("reduction") == "mean") {
    Value* keep = b.cast(b.op("not_equal", {target, b.scalar(static_cast<double>(c.node.get_int("ignore_index")),
                                                              target->dtype())}),
                         dloss->dtype());
    dloss = b.div(dloss, b.reduce("reduce_sum", keep, {}, false));
  }
  return {b.op("cross_entropy_grad", {logits, target, dloss}, {{"ignore_index", Attribute(c.node.get_int("ignore_index"))}}),
          nullptr};
}

Grads mse_rule(GradContext& c) {
  Builder& b = c.b;
  Value *a = c.x(0), *t = c.x(1);
  double k = 2.0;
  if (c.node.get_string("reduction") == "mean") {
    int64_t n = 1;
    for (int64_t s : require_static(a->shape(), "mse_loss's input")) n *= s;
    k /= static_cast<double>(n);
  }
  Value* ga = b.mul(b.mul(b.sub(a, t), b.cast(c.g(), a->dtype())), k);
  return {c.wants(0) ? ga : nullptr, c.wants(1) ? b.neg(ga) : nullptr};
}

std::map<std::string, RuleEntry> build_table() {
  std::map<std::string, RuleEntry> t;
  auto rule = [&](const std::string& op, GradRule r) { t[op] = {RuleKind::kRule, std::move(r), ""}; };
  auto nondiff = [&](const std::string& op, const std::string& why) { t[op] = {RuleKind::kNonDifferentiable, nullptr, why}; };
  auto refuse = [&](const std::string& op, const std::string& why) { t[op] = {RuleKind::kRefused, nullptr, why}; };

  // Elementwise unary.
  rule("identity", [](GradContext& c) -> Grads { return {c.g()}; });
  rule("neg", [](GradContext& c) -> Grads { return {c.b.neg(c.g())}; });
  rule("abs", unary([](GradContext& c) { return c.b.unary("sign", c.x(0)); }));
  rule("exp", unary([](GradContext& c) { return c.y(); }));
  rule("log", [](GradContext& c) -> Grads { return {c.b.div(c.g(), c.x(0))}; });
  rule("sqrt", [](GradContext& c) -> Grads { return {c.b.div(c.g(), c.b.mul(c.y(), 2.0))}; });
  rule("rsqrt", unary([](GradContext& c) { return c.b.mul(c.b.mul(c.b.mul(c.y(), c.y()), c.y()), -0.5); }));
  rule("reciprocal", unary([](GradContext& c) { return c.b.neg(c.b.mul(c.y(), c.y())); }));
  rule("sin", unary([](GradContext& c) { return c.b.unary("cos", c.x(0)); }));
  rule("cos", unary([](GradContext& c) { return c.b.neg(c.b.unary("sin", c.x(0))); }));
  rule("tanh", unary([](GradContext& c) { return c.b.add(c.b.neg(c.b.mul(c.y(), c.y())), 1.0); }));
  rule("sigmoid", unary([](GradContext& c) { return c.b.mul(c.y(), c.b.add(c.b.neg(c.y()), 1.0)); }));
  rule("softplus", unary([](GradContext& c) { return c.b.unary("sigmoid", c.x(0)); }));
  rule("erf", unary([](GradContext& c) {
         return c.b.mul(c.b.unary("exp", c.b.neg(c.b.mul(c.x(0), c.x(0)))), 2 / std::sqrt(std::numbers::pi));
       }));
  rule("silu", unary([](GradContext& c) {
         Value* s = c.b.unary("sigmoid", c.x(0));
         return c.b.mul(s, c.b.add(c.b.mul(c.x(0), c.b.add(c.b.neg(s), 1.0)), 1.0));
       }));
  rule("gelu", unary(gelu_derivative));
  rule("relu", [](GradContext& c) -> Grads {
    return {masked(c.b, c.b.op("greater", {c.x(0), zero_like(c.b, c.x(0))}), c.g())};
  });
  rule("leaky_relu", [](GradContext& c) -> Grads {
    Value* pos = c.b.op("greater", {c.x(0), zero_like(c.b, c.x(0))});
    return {c.b.where(pos, c.g(), c.b.mul(c.g(), c.node.get_float("alpha")))};
  });
  rule("clip", [](GradContext& c) -> Grads {
    Builder& b = c.b;
    Value* x = c.x(0);
    Value* mask = nullptr;
    auto both = [&](Value* m) { mask = mask ? b.op("and", {mask, m}) : m; };
    if (c.node.has_attr("min")) both(b.op("greater_equal", {x, b.scalar(c.node.get_float("min"), x->dtype())}));
    if (c.node.has_attr("max")) both(b.op("less_equal", {x, b.scalar(c.node.get_float("max"), x->dtype())}));
    return {mask ? masked(b, mask, c.g()) : c.g()};
  });
  rule("cast", [](GradContext& c) -> Grads { return {c.b.cast(c.g(), c.x(0)->dtype())}; });

  // Elementwise binary (broadcasting).
  rule("add", binary([](GradContext& c) { return c.g(); }, [](GradContext& c) { return c.g(); }));
  rule("sub", binary([](GradContext& c) { return c.g(); }, [](GradContext& c) { return c.b.neg(c.g()); }));
  rule("mul", binary([](GradContext& c) { return c.b.mul(c.g(), c.x(1)); },
                     [](GradContext& c) { return c.b.mul(c.g(), c.x(0)); }));
  rule("div", binary([](GradContext& c) { return c.b.div(c.g(), c.x(1)); },
                     [](GradContext& c) { return c.b.neg(c.b.div(c.b.mul(c.g(), c.y()), c.x(1))); }));
  rule("pow", binary(
                  [](GradContext& c) {
                    Builder& b = c.b;
                    Value* e = b.cast(c.x(1), c.x(0)->dtype());
                    return b.mul(c.g(), b.mul(e, b.op("pow", {c.x(0), b.add(e, -1.0)})));
                  },
                  [](GradContext& c) {
                    // d/db a^b = a^b log a, taken as 0 where a <= 0 (PyTorch's choice at a = 0).
                    Builder& b = c.b;
                    Value* pos = b.op("greater", {c.x(0), zero_like(b, c.x(0))});
                    return masked(b, pos, b.mul(c.g(), b.mul(c.y(), b.unary("log", c.x(0)))));
                  }));
  auto extremum = [](const std::string& wins) {
    // The larger (maximum) or smaller (minimum) operand takes the gradient; ties split it.
    return [wins](int self) {
      return [wins, self](GradContext& c) {
        Builder& b = c.b;
        Value *me = c.x(self), *other = c.x(1 - self);
        Value* half = b.mul(c.g(), 0.5);
        return b.where(b.op(wins, {me, other}), c.g(), masked(b, b.op("equal", {me, other}), half));
      };
    };
  };
  rule("maximum", binary(extremum("greater")(0), extremum("greater")(1)));
  rule("minimum", binary(extremum("less")(0), extremum("less")(1)));
  rule("mod", binary([](GradContext& c) { return c.g(); },
                     [](GradContext& c) {
                       // a mod b = a - b * q with q = floor(a / b) (python) or trunc(a / b) (fmod).
                       Builder& b = c.b;
                       Value* ratio = b.div(c.x(0), c.x(1));
                       Value* q = c.node.get_int("fmod") != 0
                                      ? b.mul(b.unary("sign", ratio), b.unary("floor", b.unary("abs", ratio)))
                                      : b.unary("floor", ratio);
                       return b.neg(b.mul(c.g(), q));
                     }));
  rule("where", [](GradContext& c) -> Grads {
    Builder& b = c.b;
    Grads out(3, nullptr);
    if (c.wants(1)) out[1] = b.sum_to(masked(b, c.x(0), c.g()), c.x(1)->shape());
    if (c.wants(2)) out[2] = b.sum_to(b.where(c.x(0), zero_like(b, c.g()), c.g()), c.x(2)->shape());
    return out;
  });

  // Reductions and normalizations.
  for (const char* op : {"reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "amax"}) rule(op, reduce_rule);
  rule("softmax", [](GradContext& c) { return softmax_rule(c, false); });
  rule("log_softmax", [](GradContext& c) { return softmax_rule(c, true); });
  rule("layer_norm", [](GradContext& c) { return trailing_norm_rule(c, false); });
  rule("rms_norm", [](GradContext& c) { return trailing_norm_rule(c, true); });
  rule("batch_norm", batch_norm_rule);

  // Contractions.
  rule("matmul", matmul_rule);
  rule("linear", linear_rule);
  rule("matmul_acc", matmul_acc_rule);
  rule("attention", attention_rule);

  // Data movement.
  for (const char* op : {"reshape", "flatten", "squeeze", "unsqueeze"})
    rule(op, [](GradContext& c) -> Grads { return {c.b.reshape(c.g(), c.x(0)->shape())}; });
  rule("transpose", [](GradContext& c) -> Grads {
    const int64_t rank = c.x(0)->type().rank();
    std::vector<int64_t> perm = c.node.get_ints("perm");
    if (perm.empty())
      for (int64_t d = rank - 1; d >= 0; --d) perm.push_back(d);
    std::vector<int64_t> inverse(perm.size());
    for (size_t i = 0; i < perm.size(); ++i) inverse[static_cast<size_t>(perm[i] < 0 ? perm[i] + rank : perm[i])] = static_cast<int64_t>(i);
    return {c.b.transpose(c.g(), inverse)};
  });
  rule("expand", [](GradContext& c) -> Grads { return {c.b.sum_to(c.g(), c.x(0)->shape())}; });
  rule("slice", slice_rule);
  rule("concat", concat_rule);
  rule("split", split_rule);
  rule("gather", gather_rule);
  rule("scatter_add", scatter_add_rule);
  rule("pad", [](GradContext& c) -> Grads {
    if (c.node.get_string("mode") != "constant")
      throw BuildError{unimplemented("pad in mode '" + c.node.get_string("mode") + "' has no gradient rule (only constant)")};
    std::vector<int64_t> pads = c.node.get_ints("pads");
    for (int64_t& p : pads) p = -p;  // crop what was padded, pad back what was cropped
    return {c.b.op("pad", {c.g()}, {{"pads", Attribute(pads)}})};
  });

  // Losses.
  rule("cross_entropy", cross_entropy_rule);
  refuse("cross_entropy_grad", "no second derivative of cross_entropy yet");
  refuse("cross_entropy_with_grad", "formed after autodiff (decompose-losses); no second derivative of cross_entropy yet");
  rule("mse_loss", mse_rule);

  // No gradient flows: integer or bool results, or piecewise-constant functions (zero almost
  // everywhere, as in PyTorch), or leaves of the graph.
  for (const char* op : {"equal", "not_equal", "greater", "greater_equal", "less", "less_equal", "and", "or", "not",
                         "xor", "isinf", "isnan"})
    nondiff(op, "comparison or logical op: bool result");
  for (const char* op : {"argmax", "argmin"}) nondiff(op, "integer result");
  for (const char* op : {"ceil", "floor", "round", "sign"}) nondiff(op, "piecewise constant: zero gradient");
  for (const char* op : {"constant", "range", "variable"}) nondiff(op, "a leaf: no operands");
  nondiff("assign", "no results");
  for (const char* op : {"delayed_scaling_update", "delayed_scaling_step_scale"})
    nondiff(op, "FP8 scaling state: a scale is not differentiated");

  // Known, not differentiated here.
  refuse("fused", "fused nodes are inlined before differentiation");
  refuse("reduce_prod", "no gradient rule yet (zeros in the product need care)");
  rule("conv", conv_rule);
  rule("avg_pool", avg_pool_rule);
  refuse("max_pool", "no gradient rule yet (max pooling backward is not implemented)");
  // FP8 (fp8-training): an f8 value's gradient is that of the real number it stands for, in f32.
  rule("quantize", quantize_rule);
  rule("requantize", requantize_rule);
  rule("dequantize", dequantize_rule);
  rule("scaled_matmul", scaled_matmul_rule);
  rule(kQuantizeGradOp, quantize_grad_rule);
  t[kQuantizeGradOp].gradient_only = true;
  refuse("matmul_int4", "int4 weights are inference-only: run autodiff before quantize-int4 (fp8-training trains in FP8)");
  for (const char* op : {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv",
                         "local_shard", "pipeline_stage"})
    refuse(op, "collectives appear after a parallel strategy: run autodiff before it");
  return t;
}

}  // namespace

Value* GradContext::g(int i) {
  Value*& v = result_grads[static_cast<size_t>(i)];
  if (v == nullptr) v = b.zeros(node.result(i)->type());
  return v;
}

const std::map<std::string, RuleEntry>& rule_table() {
  static const std::map<std::string, RuleEntry> table = build_table();
  return table;
}

const RuleEntry& rule_for(const std::string& op) {
  static const RuleEntry missing;
  auto it = rule_table().find(op);
  return it == rule_table().end() ? missing : it->second;
}

}  // namespace kiln::training
