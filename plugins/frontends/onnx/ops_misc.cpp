// ONNX control flow (inlined/unrolled), losses, training-domain optimizers, windows, RNNs.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <numeric>

#include "op_util.h"

namespace kiln::onnx_fe {
namespace {

using Sizes = std::vector<int64_t>;

const onnx::GraphProto* graph_attr(const NodeCtx& c, const std::string& name) {
  const auto* a = c.attr(name);
  return a && a->has_g() ? &a->g() : nullptr;
}

// --- control flow: Kiln has no control-flow ops, so bodies are inlined at import -------

Status if_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Tensor cond, c.const_input(0, "cond"));
  if (cond.numel() != 1) return c.error("cond must hold one value");
  const onnx::GraphProto* body = graph_attr(c, cond.get_i64(0) != 0 ? "then_branch" : "else_branch");
  if (!body) return c.error("a branch is missing");
  KILN_ASSIGN_OR_RETURN(std::vector<Value*> outs, c.imp.inline_graph(*body, {}, c.depth + 1));
  if (static_cast<int>(outs.size()) != c.num_outputs())
    return c.error("branch returns " + std::to_string(outs.size()) + " values for " +
                   std::to_string(c.num_outputs()) + " outputs");
  for (size_t i = 0; i < outs.size(); ++i) KILN_RETURN_IF_ERROR(c.out(static_cast<int>(i), outs[i]));
  return ok_status();
}

/// Stacks per-iteration values along `axis` (reversed when `reverse`).
StatusOr<Value*> stack(NodeCtx& c, std::vector<Value*> parts, int64_t axis, bool reverse) {
  if (parts.empty()) return c.error("cannot stack the outputs of zero iterations");
  if (reverse) std::reverse(parts.begin(), parts.end());
  const int64_t rank = parts[0]->type().rank() + 1;
  KILN_ASSIGN_OR_RETURN(axis, norm_axis(c, axis, rank));
  for (Value*& p : parts) {
    KILN_ASSIGN_OR_RETURN(p, unsqueeze(c, p, {axis}));
  }
  if (parts.size() == 1) return parts[0];
  return c.op("concat", parts, {{"axis", Attribute(axis)}});
}

Status loop_op(NodeCtx& c) {
  const onnx::GraphProto* body = graph_attr(c, "body");
  if (!body) return c.error("body is missing");
  int64_t trips = std::numeric_limits<int64_t>::max();
  if (c.has_input(0)) {
    KILN_ASSIGN_OR_RETURN(Tensor m, c.const_input(0, "M"));
    trips = m.get_i64(0);
  }
  bool cond = true;
  if (c.has_input(1)) {
    KILN_ASSIGN_OR_RETURN(Tensor t, c.const_input(1, "cond"));
    cond = t.get_i64(0) != 0;
  }
  std::vector<Value*> carried;
  for (int i = 2; i < c.num_inputs(); ++i) carried.push_back(c.in(i));
  const size_t n_carried = carried.size();
  const int64_t limit = c.imp.options().limits.max_unroll;
  std::vector<std::vector<Value*>> scans;
  for (int64_t it = 0; it < trips && cond; ++it) {
    if (it >= limit)
      return c.error(StatusCode::kOutOfRange, "loop runs more than " + std::to_string(limit) +
                                                  " iterations, the unroll limit");
    std::vector<Value*> ins = {c.constant(Tensor::scalar_i64(DType::kI64, it)), c.scalar(DType::kBool, 1)};
    ins.insert(ins.end(), carried.begin(), carried.end());
    KILN_ASSIGN_OR_RETURN(std::vector<Value*> outs, c.imp.inline_graph(*body, ins, c.depth + 1));
    if (outs.size() < 1 + n_carried) return c.error("body returns too few values");
    const Tensor* k = NodeCtx::constant_of(outs[0]);
    if (!k) return c.error("the loop condition is computed at run time; kiln unrolls loops at import");
    cond = k->get_i64(0) != 0;
    std::copy(outs.begin() + 1, outs.begin() + 1 + static_cast<std::ptrdiff_t>(n_carried), carried.begin());
    scans.resize(outs.size() - 1 - n_carried);
    for (size_t s = 0; s < scans.size(); ++s) scans[s].push_back(outs[1 + n_carried + s]);
  }
  if (trips == std::numeric_limits<int64_t>::max() && cond) return c.error("loop has neither a trip count nor a condition");
  for (size_t i = 0; i < n_carried; ++i) KILN_RETURN_IF_ERROR(c.out(static_cast<int>(i), carried[i]));
  for (size_t s = 0; s < scans.size(); ++s) {
    KILN_ASSIGN_OR_RETURN(Value * v, stack(c, scans[s], 0, false));
    KILN_RETURN_IF_ERROR(c.out(static_cast<int>(n_carried + s), v));
  }
  return ok_status();
}

/// Runs a Scan body over time steps of `scans` (already without any batch axis).
Status scan_steps(NodeCtx& c, const onnx::GraphProto& body, std::vector<Value*>& states,
                  const std::vector<Value*>& scans, const Sizes& in_axes, const Sizes& in_dirs,
                  std::vector<std::vector<Value*>>& outs) {
  if (scans.empty()) return c.error("scan needs at least one scan input");
  const Dim& td = scans[0]->shape()[static_cast<size_t>(in_axes[0])];
  if (!td.is_static()) return c.error("scan needs a static sequence length");
  const int64_t steps = td.value();
  if (steps > c.imp.options().limits.max_unroll)
    return c.error(StatusCode::kOutOfRange, "scan of " + std::to_string(steps) + " steps exceeds the unroll limit");
  for (int64_t t = 0; t < steps; ++t) {
    std::vector<Value*> ins = states;
    for (size_t j = 0; j < scans.size(); ++j) {
      const int64_t idx = in_dirs[j] != 0 ? steps - 1 - t : t;
      KILN_ASSIGN_OR_RETURN(Value * x, slice_axis(c, scans[j], in_axes[j], idx, idx + 1));
      KILN_ASSIGN_OR_RETURN(x, squeeze(c, x, {in_axes[j]}));
      ins.push_back(x);
    }
    KILN_ASSIGN_OR_RETURN(std::vector<Value*> r, c.imp.inline_graph(body, ins, c.depth + 1));
    if (r.size() < states.size()) return c.error("scan body returns too few values");
    std::copy(r.begin(), r.begin() + static_cast<std::ptrdiff_t>(states.size()), states.begin());
    outs.resize(r.size() - states.size());
    for (size_t k = 0; k < outs.size(); ++k) outs[k].push_back(r[states.size() + k]);
  }
  return ok_status();
}

Status scan_op(NodeCtx& c) {
  const onnx::GraphProto* body = graph_attr(c, "body");
  if (!body) return c.error("body is missing");
  const int64_t m = c.attr_int("num_scan_inputs", 0);
  const int first = c.opset < 9 ? 1 : 0;  // opset 8 starts with sequence_lens
  if (c.opset < 9 && c.has_input(0)) return c.error(StatusCode::kUnimplemented, "Scan sequence_lens is not supported");
  if (m < 1 || m > c.num_inputs() - first) return c.error("num_scan_inputs does not match the inputs");
  const int n_states = c.num_inputs() - first - static_cast<int>(m);
  std::vector<Value*> states, scans;
  for (int i = 0; i < n_states; ++i) states.push_back(c.in(first + i));
  for (int i = 0; i < m; ++i) scans.push_back(c.in(first + n_states + i));
  Sizes in_axes = c.attr_ints("scan_input_axes"), in_dirs = c.attr_ints(c.opset < 9 ? "directions" : "scan_input_directions");
  Sizes out_axes = c.attr_ints("scan_output_axes"), out_dirs = c.attr_ints("scan_output_directions");
  if (in_axes.empty()) in_axes.assign(static_cast<size_t>(m), 0);
  if (in_dirs.empty()) in_dirs.assign(static_cast<size_t>(m), 0);
  for (size_t j = 0; j < scans.size(); ++j) {
    KILN_ASSIGN_OR_RETURN(in_axes[j], norm_axis(c, in_axes[j], scans[j]->type().rank()));
  }
  if (c.opset >= 9) {
    std::vector<std::vector<Value*>> outs;
    KILN_RETURN_IF_ERROR(scan_steps(c, *body, states, scans, in_axes, in_dirs, outs));
    for (int i = 0; i < n_states; ++i) KILN_RETURN_IF_ERROR(c.out(i, states[static_cast<size_t>(i)]));
    for (size_t k = 0; k < outs.size(); ++k) {
      const int64_t ax = k < out_axes.size() ? out_axes[k] : 0;
      const bool rev = k < out_dirs.size() && out_dirs[k] != 0;
      KILN_ASSIGN_OR_RETURN(Value * v, stack(c, outs[k], ax, rev));
      KILN_RETURN_IF_ERROR(c.out(n_states + static_cast<int>(k), v));
    }
    return ok_status();
  }
  // Opset 8: axis 0 of every input is a batch; each batch element is scanned on its own.
  const Dim& bd = scans[0]->shape()[0];
  if (!bd.is_static()) return c.error("scan needs a static batch size");
  std::vector<std::vector<Value*>> final_states(static_cast<size_t>(n_states)), stacked;
  for (int64_t b = 0; b < bd.value(); ++b) {
    std::vector<Value*> st, sc;
    for (Value* s : states) {
      KILN_ASSIGN_OR_RETURN(Value * v, slice_axis(c, s, 0, b, b + 1));
      KILN_ASSIGN_OR_RETURN(v, squeeze(c, v, {0}));
      st.push_back(v);
    }
    for (Value* s : scans) {
      KILN_ASSIGN_OR_RETURN(Value * v, slice_axis(c, s, 0, b, b + 1));
      KILN_ASSIGN_OR_RETURN(v, squeeze(c, v, {0}));
      sc.push_back(v);
    }
    std::vector<std::vector<Value*>> outs;
    KILN_RETURN_IF_ERROR(scan_steps(c, *body, st, sc, in_axes, in_dirs, outs));
    for (int i = 0; i < n_states; ++i) final_states[static_cast<size_t>(i)].push_back(st[static_cast<size_t>(i)]);
    stacked.resize(outs.size());
    for (size_t k = 0; k < outs.size(); ++k) {
      KILN_ASSIGN_OR_RETURN(Value * v, stack(c, outs[k], 0, false));
      stacked[k].push_back(v);
    }
  }
  for (int i = 0; i < n_states; ++i) {
    KILN_ASSIGN_OR_RETURN(Value * v, stack(c, final_states[static_cast<size_t>(i)], 0, false));
    KILN_RETURN_IF_ERROR(c.out(i, v));
  }
  for (size_t k = 0; k < stacked.size(); ++k) {
    KILN_ASSIGN_OR_RETURN(Value * v, stack(c, stacked[k], 0, false));
    KILN_RETURN_IF_ERROR(c.out(n_states + static_cast<int>(k), v));
  }
  return ok_status();
}

// --- losses ----------------------------------------------------------------------------

/// NegativeLogLikelihoodLoss on log-probabilities `input` [N, C, d...] and `target` [N, d...].
StatusOr<Value*> nll_loss(NodeCtx& c, Value* input, Value* target, Value* weight) {
  if (input->type().rank() < 2) return c.error("input must be [N, C, ...], got " + input->type().str());
  const std::string reduction = c.attr_string("reduction", "mean");
  if (reduction != "none" && reduction != "sum" && reduction != "mean")
    return c.error("unknown reduction '" + reduction + "'");
  KILN_ASSIGN_OR_RETURN(Value * t, cast_to(c, target, DType::kI64));
  Value* valid = nullptr;
  if (c.has_attr("ignore_index")) {
    const double ii = static_cast<double>(c.attr_int("ignore_index", 0));
    KILN_ASSIGN_OR_RETURN(valid, c.op("not_equal", {t, c.scalar(DType::kI64, ii)}));
    KILN_ASSIGN_OR_RETURN(t, c.op("where", {valid, t, c.scalar(DType::kI64, 0)}));
  }
  KILN_ASSIGN_OR_RETURN(Value * t1, unsqueeze(c, t, {1}));
  KILN_ASSIGN_OR_RETURN(Value * picked, gather_elements(c, input, t1, 1));
  KILN_ASSIGN_OR_RETURN(picked, squeeze(c, picked, {1}));
  KILN_ASSIGN_OR_RETURN(Value * loss, c.op("neg", {picked}));
  Value* w = nullptr;
  if (weight) {
    KILN_ASSIGN_OR_RETURN(w, c.op("gather", {weight, t}, {{"axis", Attribute(0)}}));
  }
  if (valid) {
    Value* one = scalar_like(c, input, 1);
    KILN_ASSIGN_OR_RETURN(w, c.op("where", {valid, w ? w : one, scalar_like(c, input, 0)}));
  }
  if (w) {
    KILN_ASSIGN_OR_RETURN(loss, c.op("mul", {loss, w}));
  }
  if (reduction == "none") return loss;
  KILN_ASSIGN_OR_RETURN(Value * sum, reduce(c, "reduce_sum", loss, {}, false));
  if (reduction == "sum") return sum;
  if (!w) return reduce(c, "reduce_mean", loss, {}, false);
  KILN_ASSIGN_OR_RETURN(Value * wsum, reduce(c, "reduce_sum", w, {}, false));
  return c.op("div", {sum, wsum});
}

Status nll_loss_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * y, nll_loss(c, c.in(0), c.in(1), c.in(2)));
  return c.out(0, y);
}

Status sce_loss_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * lp, c.op("log_softmax", {c.in(0)}, {{"axis", Attribute(1)}}));
  KILN_ASSIGN_OR_RETURN(Value * y, nll_loss(c, lp, c.in(1), c.in(2)));
  KILN_RETURN_IF_ERROR(c.out(0, y));
  return c.out(1, lp);
}

// --- training-domain optimizers (ai.onnx.preview.training) ------------------------------

/// The groups of a training op's variadic inputs after R and T: n tensors per group.
StatusOr<std::vector<std::vector<Value*>>> optimizer_groups(NodeCtx& c, int groups) {
  const int rest = c.num_inputs() - 2;
  if (rest <= 0 || rest % groups != 0) return c.error("inputs do not form " + std::to_string(groups) + " equal groups");
  const int n = rest / groups;
  std::vector<std::vector<Value*>> g(static_cast<size_t>(groups));
  for (int k = 0; k < groups; ++k)
    for (int i = 0; i < n; ++i) g[static_cast<size_t>(k)].push_back(c.in(2 + k * n + i));
  return g;
}

Status adagrad_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(auto g, optimizer_groups(c, 3));
  Value* r = c.in(0);
  KILN_ASSIGN_OR_RETURN(Value * t, cast_to(c, c.in(1), r->dtype()));
  const double decay = c.attr_float("decay_factor", 0), eps = c.attr_float("epsilon", 1e-6),
               norm = c.attr_float("norm_coefficient", 0);
  KILN_ASSIGN_OR_RETURN(Value * den, with_scalar(c, "mul", t, decay));
  KILN_ASSIGN_OR_RETURN(den, with_scalar(c, "add", den, 1));
  KILN_ASSIGN_OR_RETURN(Value * rate, c.op("div", {r, den}));
  const size_t n = g[0].size();
  for (size_t i = 0; i < n; ++i) {
    Value *x = g[0][i], *grad = g[1][i], *h = g[2][i];
    KILN_ASSIGN_OR_RETURN(Value * gr, with_scalar(c, "mul", x, norm));
    KILN_ASSIGN_OR_RETURN(gr, c.op("add", {gr, grad}));
    KILN_ASSIGN_OR_RETURN(Value * sq, c.op("mul", {gr, gr}));
    KILN_ASSIGN_OR_RETURN(Value * hn, c.op("add", {h, sq}));
    KILN_ASSIGN_OR_RETURN(Value * ha, c.op("sqrt", {hn}));
    KILN_ASSIGN_OR_RETURN(ha, with_scalar(c, "add", ha, eps));
    KILN_ASSIGN_OR_RETURN(Value * step, c.op("mul", {rate, gr}));
    KILN_ASSIGN_OR_RETURN(step, c.op("div", {step, ha}));
    KILN_ASSIGN_OR_RETURN(Value * xn, c.op("sub", {x, step}));
    KILN_RETURN_IF_ERROR(c.out(static_cast<int>(i), xn));
    KILN_RETURN_IF_ERROR(c.out(static_cast<int>(n + i), hn));
  }
  return ok_status();
}

Status adam_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(auto g, optimizer_groups(c, 4));
  Value* r = c.in(0);
  KILN_ASSIGN_OR_RETURN(Value * t, cast_to(c, c.in(1), r->dtype()));
  const double alpha = c.attr_float("alpha", 0.9), beta = c.attr_float("beta", 0.999),
               eps = c.attr_float("epsilon", 1e-6), norm = c.attr_float("norm_coefficient", 0),
               post = c.attr_float("norm_coefficient_post", 0);
  // r * sqrt(1 - beta^t) / (1 - alpha^t) once t > 0, else r.
  KILN_ASSIGN_OR_RETURN(Value * bt, c.op("pow", {scalar_like(c, t, beta), t}));
  KILN_ASSIGN_OR_RETURN(Value * at, c.op("pow", {scalar_like(c, t, alpha), t}));
  KILN_ASSIGN_OR_RETURN(Value * num, c.op("sub", {scalar_like(c, t, 1), bt}));
  KILN_ASSIGN_OR_RETURN(num, c.op("sqrt", {num}));
  KILN_ASSIGN_OR_RETURN(Value * den, c.op("sub", {scalar_like(c, t, 1), at}));
  KILN_ASSIGN_OR_RETURN(Value * adj, c.op("mul", {r, num}));
  KILN_ASSIGN_OR_RETURN(adj, c.op("div", {adj, den}));
  KILN_ASSIGN_OR_RETURN(Value * pos, with_scalar(c, "greater", t, 0));
  KILN_ASSIGN_OR_RETURN(Value * rate, c.op("where", {pos, adj, r}));
  const size_t n = g[0].size();
  for (size_t i = 0; i < n; ++i) {
    Value *x = g[0][i], *grad = g[1][i], *v = g[2][i], *h = g[3][i];
    KILN_ASSIGN_OR_RETURN(Value * gr, with_scalar(c, "mul", x, norm));
    KILN_ASSIGN_OR_RETURN(gr, c.op("add", {gr, grad}));
    KILN_ASSIGN_OR_RETURN(Value * va, with_scalar(c, "mul", v, alpha));
    KILN_ASSIGN_OR_RETURN(Value * vb, with_scalar(c, "mul", gr, 1 - alpha));
    KILN_ASSIGN_OR_RETURN(Value * vn, c.op("add", {va, vb}));
    KILN_ASSIGN_OR_RETURN(Value * sq, c.op("mul", {gr, gr}));
    KILN_ASSIGN_OR_RETURN(Value * ha, with_scalar(c, "mul", h, beta));
    KILN_ASSIGN_OR_RETURN(Value * hb, with_scalar(c, "mul", sq, 1 - beta));
    KILN_ASSIGN_OR_RETURN(Value * hn, c.op("add", {ha, hb}));
    KILN_ASSIGN_OR_RETURN(Value * hs, c.op("sqrt", {hn}));
    KILN_ASSIGN_OR_RETURN(hs, with_scalar(c, "add", hs, eps));
    KILN_ASSIGN_OR_RETURN(Value * step, c.op("div", {vn, hs}));
    KILN_ASSIGN_OR_RETURN(step, c.op("mul", {rate, step}));
    KILN_ASSIGN_OR_RETURN(Value * xn, c.op("sub", {x, step}));
    KILN_ASSIGN_OR_RETURN(xn, with_scalar(c, "mul", xn, 1 - post));
    KILN_RETURN_IF_ERROR(c.out(static_cast<int>(i), xn));
    KILN_RETURN_IF_ERROR(c.out(static_cast<int>(n + i), vn));
    KILN_RETURN_IF_ERROR(c.out(static_cast<int>(2 * n + i), hn));
  }
  return ok_status();
}

Status momentum_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(auto g, optimizer_groups(c, 3));
  Value* r = c.in(0);
  KILN_ASSIGN_OR_RETURN(Value * t, cast_to(c, c.in(1), r->dtype()));
  const double alpha = c.attr_float("alpha", 0), beta = c.attr_float("beta", 0),
               norm = c.attr_float("norm_coefficient", 0);
  const std::string mode = c.attr_string("mode", "standard");
  if (mode != "standard" && mode != "nesterov") return c.error("unknown mode '" + mode + "'");
  KILN_ASSIGN_OR_RETURN(Value * pos, with_scalar(c, "greater", t, 0));
  KILN_ASSIGN_OR_RETURN(Value * badj, c.op("where", {pos, scalar_like(c, t, beta), scalar_like(c, t, 1)}));
  const size_t n = g[0].size();
  for (size_t i = 0; i < n; ++i) {
    Value *x = g[0][i], *grad = g[1][i], *v = g[2][i];
    KILN_ASSIGN_OR_RETURN(Value * gr, with_scalar(c, "mul", x, norm));
    KILN_ASSIGN_OR_RETURN(gr, c.op("add", {gr, grad}));
    KILN_ASSIGN_OR_RETURN(Value * va, with_scalar(c, "mul", v, alpha));
    KILN_ASSIGN_OR_RETURN(Value * vb, c.op("mul", {badj, gr}));
    KILN_ASSIGN_OR_RETURN(Value * vn, c.op("add", {va, vb}));
    Value* step = vn;
    if (mode == "nesterov") {
      KILN_ASSIGN_OR_RETURN(Value * av, with_scalar(c, "mul", vn, alpha));
      KILN_ASSIGN_OR_RETURN(step, c.op("add", {gr, av}));
    }
    KILN_ASSIGN_OR_RETURN(step, c.op("mul", {r, step}));
    KILN_ASSIGN_OR_RETURN(Value * xn, c.op("sub", {x, step}));
    KILN_RETURN_IF_ERROR(c.out(static_cast<int>(i), xn));
    KILN_RETURN_IF_ERROR(c.out(static_cast<int>(n + i), vn));
  }
  return ok_status();
}

// --- window functions --------------------------------------------------------------------

Status window_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> sz, c.const_ints(0, "size"));
  if (sz.size() != 1 || sz[0] < 0) return c.error("size must be one non-negative value");
  KILN_RETURN_IF_ERROR(check_constant_size(c, "window", sz[0]));
  KILN_ASSIGN_OR_RETURN(DType dt, kiln_dtype(static_cast<int>(c.attr_int("output_datatype", 1)), "output_datatype"));
  const int64_t n = sz[0];
  const double den = static_cast<double>(c.attr_int("periodic", 1) != 0 ? n : n - 1);
  const std::string& op = c.proto.op_type();
  Tensor t(dt, {n});
  for (int64_t i = 0; i < n; ++i) {
    const double a = 2 * std::numbers::pi * static_cast<double>(i) / den;
    double v;
    if (op == "HannWindow") v = 0.5 - 0.5 * std::cos(a);
    else if (op == "HammingWindow") v = 25.0 / 46 - (1 - 25.0 / 46) * std::cos(a);
    else v = 0.42 - 0.5 * std::cos(a) + 0.08 * std::cos(2 * a);
    t.set_f64(i, v);
  }
  return c.out(0, c.constant(std::move(t)));
}

// --- signal processing -------------------------------------------------------------------

/// DFT of `x` [..., N, ..., 1 or 2] (last dim: real, or real and imaginary) along `axis`
/// with length `len` (zero-padded or truncated), as products with constant cos/sin matrices.
StatusOr<Value*> dft(NodeCtx& c, Value* x, int64_t axis, int64_t len, bool onesided, bool inverse) {
  const int64_t rank = x->type().rank();
  if (rank < 2 || axis < 0 || axis >= rank - 1) return c.error("signal " + x->type().str() + " has no axis " + std::to_string(axis));
  const Dim& last = x->shape().back();
  const Dim& nd = x->shape()[static_cast<size_t>(axis)];
  if (!last.is_static() || (last.value() != 1 && last.value() != 2) || !nd.is_static())
    return c.error("signal must end in a static dim of 1 (real) or 2 (complex), got " + x->type().str());
  const int64_t n = nd.value(), bins = onesided ? len / 2 + 1 : len;
  KILN_RETURN_IF_ERROR(check_constant_size(c, "dft matrix", bins, n));
  Tensor mc(DType::kF64, {bins, n}), ms(DType::kF64, {bins, n});
  for (int64_t k = 0; k < bins; ++k)
    for (int64_t j = 0; j < std::min(n, len); ++j) {
      const double a = 2 * std::numbers::pi * static_cast<double>((k * j) % len) / static_cast<double>(len);
      mc.set_f64(k * n + j, inverse ? std::cos(a) / static_cast<double>(len) : std::cos(a));
      ms.set_f64(k * n + j, inverse ? std::sin(a) / static_cast<double>(len) : std::sin(a));
    }
  KILN_ASSIGN_OR_RETURN(Value * re, slice_axis(c, x, rank - 1, 0, 1));
  KILN_ASSIGN_OR_RETURN(Value * rc, apply_along_axis(c, re, axis, mc));
  KILN_ASSIGN_OR_RETURN(Value * rs, apply_along_axis(c, re, axis, ms));
  // Forward: (re + i im)(cos - i sin); inverse: (re + i im)(cos + i sin).
  Value *out_re = rc, *out_im = nullptr;
  KILN_ASSIGN_OR_RETURN(out_im, inverse ? StatusOr<Value*>(rs) : c.op("neg", {rs}));
  if (last.value() == 2) {
    KILN_ASSIGN_OR_RETURN(Value * im, slice_axis(c, x, rank - 1, 1, 2));
    KILN_ASSIGN_OR_RETURN(Value * ic, apply_along_axis(c, im, axis, mc));
    KILN_ASSIGN_OR_RETURN(Value * is, apply_along_axis(c, im, axis, ms));
    KILN_ASSIGN_OR_RETURN(out_re, c.op(inverse ? "sub" : "add", {rc, is}));
    KILN_ASSIGN_OR_RETURN(out_im, c.op("add", {out_im, ic}));
  }
  return c.op("concat", {out_re, out_im}, {{"axis", Attribute(rank - 1)}});
}

Status dft_op(NodeCtx& c) {
  Value* x = c.in(0);
  const int64_t rank = x->type().rank();
  int64_t axis = c.attr_int("axis", 1);
  if (c.opset >= 20) {
    axis = -2;
    if (c.has_input(2)) {
      KILN_ASSIGN_OR_RETURN(Sizes a, c.const_ints(2, "axis"));
      if (a.size() != 1) return c.error("axis must hold one value");
      axis = a[0];
    }
  }
  // The trailing real/imaginary dim is not a signal axis.
  if (axis < -(rank - 1) || axis >= rank - 1) return c.error("axis " + std::to_string(axis) + " is out of range");
  if (axis < 0) axis += rank - 1;
  const Dim& nd = x->shape()[static_cast<size_t>(axis)];
  if (!nd.is_static()) return c.error("DFT needs a static signal length");
  int64_t len = nd.value();
  if (c.has_input(1)) {
    KILN_ASSIGN_OR_RETURN(Sizes l, c.const_ints(1, "dft_length"));
    if (l.size() != 1 || l[0] < 1) return c.error("dft_length must be one positive value");
    len = l[0];
  }
  KILN_ASSIGN_OR_RETURN(Value * y, dft(c, x, axis, len, c.attr_int("onesided", 0) != 0, c.attr_int("inverse", 0) != 0));
  return c.out(0, y);
}

Status stft_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Sizes s, c.static_shape(x, "signal"));
  if (s.size() != 3) return c.error("signal must be [batch, length, 1 or 2], got " + x->type().str());
  KILN_ASSIGN_OR_RETURN(Sizes step, c.const_ints(1, "frame_step"));
  int64_t frame = -1;
  if (c.has_input(3)) {
    KILN_ASSIGN_OR_RETURN(Sizes f, c.const_ints(3, "frame_length"));
    frame = f.empty() ? -1 : f[0];
  } else if (c.has_input(2)) {
    if (c.in(2)->type().rank() != 1) return c.error("window must be 1-D, got " + c.in(2)->type().str());
    const Dim& w = c.in(2)->shape()[0];
    frame = w.is_static() ? w.value() : -1;
  }
  if (step.size() != 1 || step[0] < 1 || frame < 1 || frame > s[1])
    return c.error("frame_step and frame_length (or a window) must be positive and fit the signal");
  const int64_t frames = (s[1] - frame) / step[0] + 1;
  KILN_RETURN_IF_ERROR(check_constant_size(c, "frame indices", frames, frame));
  Tensor idx(DType::kI64, {frames, frame});
  for (int64_t f = 0; f < frames; ++f)
    for (int64_t j = 0; j < frame; ++j) idx.set_i64(f * frame + j, f * step[0] + j);
  KILN_ASSIGN_OR_RETURN(Value * fr, c.op("gather", {x, c.constant(std::move(idx))}, {{"axis", Attribute(1)}}));
  if (c.has_input(2)) {
    KILN_ASSIGN_OR_RETURN(Value * w, reshape(c, c.in(2), {frame, 1}));
    KILN_ASSIGN_OR_RETURN(fr, c.op("mul", {fr, w}));
  }
  KILN_ASSIGN_OR_RETURN(Value * y, dft(c, fr, 2, frame, c.attr_int("onesided", 1) != 0, false));
  return c.out(0, y);
}

Status mel_weight_matrix_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Sizes bins, c.const_ints(0, "num_mel_bins"));
  KILN_ASSIGN_OR_RETURN(Sizes dft_len, c.const_ints(1, "dft_length"));
  KILN_ASSIGN_OR_RETURN(Sizes rate, c.const_ints(2, "sample_rate"));
  KILN_ASSIGN_OR_RETURN(std::vector<double> lo, c.const_floats(3, "lower_edge_hertz"));
  KILN_ASSIGN_OR_RETURN(std::vector<double> hi, c.const_floats(4, "upper_edge_hertz"));
  if (bins.size() != 1 || dft_len.size() != 1 || rate.size() != 1 || lo.size() != 1 || hi.size() != 1 ||
      bins[0] < 1 || dft_len[0] < 1 || rate[0] < 1 || bins[0] > (1 << 20) || dft_len[0] > (1 << 24))
    return c.error("inputs must be single positive values of sane size");
  KILN_ASSIGN_OR_RETURN(DType dt, kiln_dtype(static_cast<int>(c.attr_int("output_datatype", 1)), "output_datatype"));
  const int64_t nm = bins[0], spec = dft_len[0] / 2 + 1;
  KILN_RETURN_IF_ERROR(check_constant_size(c, "mel weight matrix", spec, nm));
  // Triangular filters between mel-spaced frequencies, as onnx's reference builds them.
  auto mel = [](double hz) { return 2595 * std::log10(1 + hz / 700); };
  const double low = mel(lo[0]), step = (mel(hi[0]) - low) / static_cast<double>(nm + 2);
  Sizes points;
  for (int64_t i = 0; i < nm + 2; ++i) {
    const double hz = 700 * (std::pow(10, (static_cast<double>(i) * step + low) / 2595) - 1);
    points.push_back(static_cast<int64_t>(std::floor(static_cast<double>(dft_len[0] + 1) * hz / static_cast<double>(rate[0]))));
  }
  Tensor t(dt, {spec, nm});
  auto set = [&](int64_t j, int64_t i, double v) {
    if (j >= 0 && j < spec) t.set_f64(j * nm + i, v);
  };
  for (int64_t i = 0; i < nm; ++i) {
    const int64_t l = points[static_cast<size_t>(i)], m = points[static_cast<size_t>(i + 1)], h = points[static_cast<size_t>(i + 2)];
    if (m == l) set(m, i, 1);
    else
      for (int64_t j = l; j <= m; ++j) set(j, i, static_cast<double>(j - l) / static_cast<double>(m - l));
    if (h > m)
      for (int64_t j = m; j < h; ++j) set(j, i, static_cast<double>(h - j) / static_cast<double>(h - m));
  }
  return c.out(0, c.constant(std::move(t)));
}

Status max_unpool_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Sizes xs, c.static_shape(x, "X"));
  if (xs.size() < 3) return c.error("X must be [N, C, spatial...], got " + x->type().str());
  const size_t n = xs.size() - 2;
  // I indexes the default output shape; a given output_shape pads that at the end.
  const Sizes kernel = c.attr_ints("kernel_shape");
  Sizes strides = c.attr_ints("strides"), pads = c.attr_ints("pads");
  if (strides.empty()) strides.assign(n, 1);
  if (pads.empty()) pads.assign(2 * n, 0);
  if (kernel.size() != n || strides.size() != n || pads.size() != 2 * n)
    return c.error("kernel_shape, strides and pads need one value per spatial dim");
  KILN_RETURN_IF_ERROR(check_range(c, "kernel_shape", kernel, 1, kMaxWindowAttr));
  KILN_RETURN_IF_ERROR(check_range(c, "strides", strides, 1, kMaxWindowAttr));
  KILN_RETURN_IF_ERROR(check_range(c, "pads", pads, 0, kMaxWindowAttr));
  Sizes out = {xs[0], xs[1]};
  for (size_t i = 0; i < n; ++i) out.push_back((xs[i + 2] - 1) * strides[i] - pads[i] - pads[i + n] + kernel[i]);
  Sizes given = out;
  if (c.has_input(2)) {
    KILN_ASSIGN_OR_RETURN(given, c.const_ints(2, "output_shape"));
  }
  if (given.size() != xs.size()) return c.error("output_shape must have the rank of X");

  // Zeros of the output's size, with X's values written at the flat positions I names.
  KILN_ASSIGN_OR_RETURN(int64_t total, checked_numel(out, c.where() + ": output_shape"));
  if (dtype_storage_bytes(x->dtype(), total) > c.imp.options().limits.max_tensor_bytes)
    return c.error(StatusCode::kOutOfRange, "output_shape exceeds the tensor limit");
  Value* zeros = c.constant(Tensor(x->dtype(), {total}));
  KILN_ASSIGN_OR_RETURN(Value * vals, reshape(c, x, {-1}));
  KILN_ASSIGN_OR_RETURN(Value * idx, reshape(c, c.in(1), {-1}));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("scatter_elements", {zeros, idx, vals}, {{"axis", Attribute(0)}}));
  KILN_ASSIGN_OR_RETURN(y, reshape(c, y, out));
  if (given != out) {
    Sizes p(2 * out.size(), 0);
    for (size_t d = 0; d < out.size(); ++d) p[out.size() + d] = given[d] - out[d];
    KILN_ASSIGN_OR_RETURN(y, c.op("pad", {y}, {{"pads", Attribute(p)}}));
  }
  return c.out(0, y);
}

// --- recurrent networks (unrolled over the static sequence length) ----------------------

StatusOr<Value*> activate(NodeCtx& c, const std::string& f, Value* x) {
  if (f == "Sigmoid") return c.op("sigmoid", {x});
  if (f == "Tanh") return c.op("tanh", {x});
  if (f == "Relu") return c.op("relu", {x});
  return c.error(StatusCode::kUnimplemented, "recurrent activation '" + f + "' is not supported");
}

/// Slice [k*h, (k+1)*h) of the last axis.
StatusOr<Value*> gate(NodeCtx& c, Value* v, int64_t k, int64_t h) {
  return slice_axis(c, v, v->type().rank() - 1, k * h, (k + 1) * h);
}

Status rnn_op(NodeCtx& c) {
  const std::string& op = c.proto.op_type();
  const int gates = op == "RNN" ? 1 : op == "GRU" ? 3 : 4;
  Value* x = c.in(0);
  const bool batch_first = c.attr_int("layout", 0) != 0;
  if (batch_first) {
    KILN_ASSIGN_OR_RETURN(x, transpose(c, x, {1, 0, 2}));
  }
  KILN_ASSIGN_OR_RETURN(Sizes xs, c.static_shape(x, "X"));
  KILN_ASSIGN_OR_RETURN(Sizes ws, c.static_shape(c.in(1), "W"));
  if (xs.size() != 3 || ws.size() != 3) return c.error("X and W must be 3-D");
  const int64_t steps = xs[0], batch = xs[1], hidden = c.attr_int("hidden_size", ws[1] / gates);
  KILN_RETURN_IF_ERROR(check_range(c, "hidden_size", {hidden}, 1, kMaxWindowAttr));
  const std::string direction = c.attr_string("direction", "forward");
  const int64_t dirs = direction == "bidirectional" ? 2 : 1;
  if (ws[0] != dirs || ws[1] != gates * hidden) return c.error("W " + c.in(1)->type().str() + " does not match hidden_size");
  if (c.attr_int("input_forget", 0) != 0) return c.error(StatusCode::kUnimplemented, "input_forget is not supported");
  std::vector<std::string> acts;
  if (const auto* a = c.attr("activations"))
    for (const auto& s : a->strings()) acts.push_back(s);
  const std::vector<std::string> defaults = op == "RNN" ? std::vector<std::string>{"Tanh"}
                                            : op == "GRU" ? std::vector<std::string>{"Sigmoid", "Tanh"}
                                                          : std::vector<std::string>{"Sigmoid", "Tanh", "Tanh"};
  if (acts.empty())
    for (int64_t d = 0; d < dirs; ++d) acts.insert(acts.end(), defaults.begin(), defaults.end());
  if (acts.size() != defaults.size() * static_cast<size_t>(dirs)) return c.error("wrong number of activations");
  const bool has_clip = c.has_attr("clip");
  const double clip = c.attr_float("clip", 0);
  const bool linear_before_reset = c.attr_int("linear_before_reset", 0) != 0;
  // Variable sequence lengths: masked steps keep the state and output zeros (forward only).
  Value* lens = nullptr;
  if (c.has_input(4)) {
    const Tensor* lt = NodeCtx::constant_of(c.in(4));
    bool all_full = lt != nullptr;
    for (int64_t i = 0; lt && i < lt->numel(); ++i) all_full &= lt->get_i64(i) == steps;
    if (!all_full) {
      KILN_ASSIGN_OR_RETURN(lens, cast_to(c, c.in(4), DType::kI64));
    }
    if (lens) {
      KILN_ASSIGN_OR_RETURN(lens, reshape(c, lens, {batch, 1}));
    }
    if (lens && direction != "forward")
      return c.error(StatusCode::kUnimplemented, "sequence_lens with reverse directions is not supported");
  }
  const DType dt = x->dtype();
  std::vector<Value*> ys, hs, cs;
  for (int64_t d = 0; d < dirs; ++d) {
    auto pick = [&](Value* v) -> StatusOr<Value*> {
      KILN_ASSIGN_OR_RETURN(Value * s, slice_axis(c, v, 0, d, d + 1));
      return squeeze(c, s, {0});
    };
    KILN_ASSIGN_OR_RETURN(Value * w, pick(c.in(1)));
    KILN_ASSIGN_OR_RETURN(Value * r, pick(c.in(2)));
    Value *wb = nullptr, *rb = nullptr;
    if (c.has_input(3)) {
      KILN_ASSIGN_OR_RETURN(Value * b, pick(c.in(3)));
      KILN_ASSIGN_OR_RETURN(wb, slice_axis(c, b, 0, 0, gates * hidden));
      KILN_ASSIGN_OR_RETURN(rb, slice_axis(c, b, 0, gates * hidden, 2 * gates * hidden));
    }
    Value* h = c.constant(Tensor(dt, {batch, hidden}));
    if (c.has_input(5)) {
      KILN_ASSIGN_OR_RETURN(h, pick(c.in(5)));
    }
    Value* cell = c.constant(Tensor(dt, {batch, hidden}));
    if (op == "LSTM" && c.has_input(6)) {
      KILN_ASSIGN_OR_RETURN(cell, pick(c.in(6)));
    }
    Value* peep = nullptr;
    if (op == "LSTM" && c.has_input(7)) {
      KILN_ASSIGN_OR_RETURN(peep, pick(c.in(7)));
    }
    // x @ W^T for every step at once, with W's bias (and R's, except GRU's h gate).
    KILN_ASSIGN_OR_RETURN(Value * xw, c.op("linear", {x, w}));
    if (wb) {
      KILN_ASSIGN_OR_RETURN(xw, c.op("add", {xw, wb}));
    }
    const size_t a0 = static_cast<size_t>(d) * defaults.size();
    std::vector<Value*> y_steps(static_cast<size_t>(steps));
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t t = d == 1 || direction == "reverse" ? steps - 1 - s : s;
      KILN_ASSIGN_OR_RETURN(Value * xt, slice_axis(c, xw, 0, t, t + 1));
      KILN_ASSIGN_OR_RETURN(xt, squeeze(c, xt, {0}));
      KILN_ASSIGN_OR_RETURN(Value * hr, c.op("linear", {h, r}));
      if (rb) {
        KILN_ASSIGN_OR_RETURN(hr, c.op("add", {hr, rb}));
      }
      auto pre = [&](Value* v) -> StatusOr<Value*> {
        if (!has_clip) return v;
        return c.op("clip", {v}, {{"min", Attribute(-clip)}, {"max", Attribute(clip)}});
      };
      Value *hn = nullptr, *cn = nullptr;
      if (op == "RNN") {
        KILN_ASSIGN_OR_RETURN(Value * z, c.op("add", {xt, hr}));
        KILN_ASSIGN_OR_RETURN(z, pre(z));
        KILN_ASSIGN_OR_RETURN(hn, activate(c, acts[a0], z));
      } else if (op == "GRU") {
        Value* g3[3];
        for (int k = 0; k < 2; ++k) {
          KILN_ASSIGN_OR_RETURN(Value * xk, gate(c, xt, k, hidden));
          KILN_ASSIGN_OR_RETURN(Value * hk, gate(c, hr, k, hidden));
          KILN_ASSIGN_OR_RETURN(Value * z, c.op("add", {xk, hk}));
          KILN_ASSIGN_OR_RETURN(z, pre(z));
          KILN_ASSIGN_OR_RETURN(g3[k], activate(c, acts[a0], z));
        }
        KILN_ASSIGN_OR_RETURN(Value * xh, gate(c, xt, 2, hidden));
        Value* hh = nullptr;
        if (linear_before_reset) {
          KILN_ASSIGN_OR_RETURN(hh, gate(c, hr, 2, hidden));
          KILN_ASSIGN_OR_RETURN(hh, c.op("mul", {g3[1], hh}));
        } else {
          KILN_ASSIGN_OR_RETURN(Value * rh, c.op("mul", {g3[1], h}));
          KILN_ASSIGN_OR_RETURN(Value * rrows, slice_axis(c, r, 0, 2 * hidden, 3 * hidden));
          KILN_ASSIGN_OR_RETURN(hh, c.op("linear", {rh, rrows}));
          if (rb) {
            KILN_ASSIGN_OR_RETURN(Value * rbh, slice_axis(c, rb, 0, 2 * hidden, 3 * hidden));
            KILN_ASSIGN_OR_RETURN(hh, c.op("add", {hh, rbh}));
          }
        }
        KILN_ASSIGN_OR_RETURN(Value * z, c.op("add", {xh, hh}));
        KILN_ASSIGN_OR_RETURN(z, pre(z));
        KILN_ASSIGN_OR_RETURN(Value * cand, activate(c, acts[a0 + 1], z));
        // h = (1 - z) * cand + z * h = cand + z * (h - cand)
        KILN_ASSIGN_OR_RETURN(Value * diff, c.op("sub", {h, cand}));
        KILN_ASSIGN_OR_RETURN(diff, c.op("mul", {g3[0], diff}));
        KILN_ASSIGN_OR_RETURN(hn, c.op("add", {cand, diff}));
      } else {
        KILN_ASSIGN_OR_RETURN(Value * z, c.op("add", {xt, hr}));
        Value* gi[4];
        for (int k = 0; k < 4; ++k) {  // i, o, f, c
          KILN_ASSIGN_OR_RETURN(gi[k], gate(c, z, k, hidden));
        }
        if (peep) {
          for (int k : {0, 2}) {
            KILN_ASSIGN_OR_RETURN(Value * pk, slice_axis(c, peep, 0, (k == 0 ? 0 : 2) * hidden, (k == 0 ? 1 : 3) * hidden));
            KILN_ASSIGN_OR_RETURN(pk, c.op("mul", {pk, cell}));
            KILN_ASSIGN_OR_RETURN(gi[k], c.op("add", {gi[k], pk}));
          }
        }
        for (int k = 0; k < 4; ++k) {
          KILN_ASSIGN_OR_RETURN(gi[k], pre(gi[k]));
        }
        KILN_ASSIGN_OR_RETURN(Value * ig, activate(c, acts[a0], gi[0]));
        KILN_ASSIGN_OR_RETURN(Value * fg, activate(c, acts[a0], gi[2]));
        KILN_ASSIGN_OR_RETURN(Value * cg, activate(c, acts[a0 + 1], gi[3]));
        KILN_ASSIGN_OR_RETURN(Value * fc, c.op("mul", {fg, cell}));
        KILN_ASSIGN_OR_RETURN(Value * ic, c.op("mul", {ig, cg}));
        KILN_ASSIGN_OR_RETURN(cn, c.op("add", {fc, ic}));
        Value* og = gi[1];
        if (peep) {
          KILN_ASSIGN_OR_RETURN(Value * po, slice_axis(c, peep, 0, hidden, 2 * hidden));
          KILN_ASSIGN_OR_RETURN(po, c.op("mul", {po, cn}));
          KILN_ASSIGN_OR_RETURN(og, c.op("add", {og, po}));
          KILN_ASSIGN_OR_RETURN(og, pre(og));
        }
        KILN_ASSIGN_OR_RETURN(og, activate(c, acts[a0], og));
        KILN_ASSIGN_OR_RETURN(Value * hc, activate(c, acts[a0 + 2], cn));
        KILN_ASSIGN_OR_RETURN(hn, c.op("mul", {og, hc}));
      }
      Value* yt = hn;
      if (lens) {
        KILN_ASSIGN_OR_RETURN(Value * live, c.op("less", {c.scalar(DType::kI64, static_cast<double>(t)), lens}));
        KILN_ASSIGN_OR_RETURN(yt, c.op("where", {live, hn, scalar_like(c, hn, 0)}));
        KILN_ASSIGN_OR_RETURN(hn, c.op("where", {live, hn, h}));
        if (cn) {
          KILN_ASSIGN_OR_RETURN(cn, c.op("where", {live, cn, cell}));
        }
      }
      h = hn;
      if (cn) cell = cn;
      y_steps[static_cast<size_t>(t)] = yt;
    }
    KILN_ASSIGN_OR_RETURN(Value * yd, stack(c, y_steps, 0, false));  // [T, B, H]
    ys.push_back(yd);
    hs.push_back(h);
    cs.push_back(cell);
  }
  KILN_ASSIGN_OR_RETURN(Value * y, stack(c, ys, 1, false));   // [T, D, B, H]
  KILN_ASSIGN_OR_RETURN(Value * yh, stack(c, hs, 0, false));  // [D, B, H]
  KILN_ASSIGN_OR_RETURN(Value * yc, stack(c, cs, 0, false));
  if (batch_first) {
    KILN_ASSIGN_OR_RETURN(y, transpose(c, y, {2, 0, 1, 3}));
    KILN_ASSIGN_OR_RETURN(yh, transpose(c, yh, {1, 0, 2}));
    KILN_ASSIGN_OR_RETURN(yc, transpose(c, yc, {1, 0, 2}));
  }
  KILN_RETURN_IF_ERROR(c.out(0, y));
  KILN_RETURN_IF_ERROR(c.out(1, yh));
  if (op == "LSTM") KILN_RETURN_IF_ERROR(c.out(2, yc));
  return ok_status();
}

}  // namespace

void register_misc_ops(HandlerTable& t) {
  t["If"] = if_op;
  t["Loop"] = loop_op;
  t["Scan"] = scan_op;
  t["NegativeLogLikelihoodLoss"] = nll_loss_op;
  t["SoftmaxCrossEntropyLoss"] = sce_loss_op;
  t["ai.onnx.preview.training/Adagrad"] = adagrad_op;
  t["ai.onnx.preview.training/Adam"] = adam_op;
  t["ai.onnx.preview.training/Momentum"] = momentum_op;
  t["HannWindow"] = window_op;
  t["HammingWindow"] = window_op;
  t["BlackmanWindow"] = window_op;
  t["DFT"] = dft_op;
  t["STFT"] = stft_op;
  t["MelWeightMatrix"] = mel_weight_matrix_op;
  t["MaxUnpool"] = max_unpool_op;
  t["RNN"] = rnn_op;
  t["GRU"] = rnn_op;
  t["LSTM"] = rnn_op;
}

}  // namespace kiln::onnx_fe
