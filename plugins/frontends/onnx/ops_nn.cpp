// ONNX neural-network ops: convolutions, pooling, normalizations, Gemm/MatMul, resize.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include "op_util.h"

namespace kiln::onnx_fe {
namespace {

using Sizes = std::vector<int64_t>;

/// Spatial sizes (dims 2..) of an [N, C, spatial...] value; error when symbolic.
StatusOr<Sizes> spatial_of(NodeCtx& c, const Value* x, const std::string& role) {
  if (x->type().rank() < 3)
    return c.error("'" + role + "' must be [N, C, spatial...], got " + x->type().str());
  Sizes s;
  for (size_t d = 2; d < x->shape().size(); ++d) {
    const Dim& dim = x->shape()[d];
    if (!dim.is_static()) return c.error("'" + role + "' needs static spatial dims, got " + x->type().str());
    s.push_back(dim.value());
  }
  return s;
}

/// Explicit pads (all begins, then all ends) from `pads` or `auto_pad`.
StatusOr<Sizes> window_pads(NodeCtx& c, const Sizes& in, const Sizes& kernel, const Sizes& strides,
                            const Sizes& dilations) {
  const size_t n = in.size();
  KILN_RETURN_IF_ERROR(check_range(c, "kernel_shape", kernel, 1, kMaxWindowAttr));
  KILN_RETURN_IF_ERROR(check_range(c, "strides", strides, 1, kMaxWindowAttr));
  KILN_RETURN_IF_ERROR(check_range(c, "dilations", dilations, 1, kMaxWindowAttr));
  const std::string ap = c.attr_string("auto_pad", "NOTSET");
  Sizes pads = c.attr_ints("pads");
  KILN_RETURN_IF_ERROR(check_range(c, "pads", pads, 0, kMaxWindowAttr));
  if (ap == "NOTSET") {
    if (pads.empty()) pads.assign(2 * n, 0);
    if (pads.size() != 2 * n) return c.error("pads must have " + std::to_string(2 * n) + " values");
    return pads;
  }
  pads.assign(2 * n, 0);
  if (ap == "VALID") return pads;
  if (ap != "SAME_UPPER" && ap != "SAME_LOWER") return c.error("unknown auto_pad '" + ap + "'");
  for (size_t i = 0; i < n; ++i) {
    const int64_t eff = (kernel[i] - 1) * dilations[i] + 1;
    const int64_t out = (in[i] + strides[i] - 1) / strides[i];
    const int64_t total = std::max<int64_t>(0, (out - 1) * strides[i] + eff - in[i]);
    const int64_t small = total / 2, big = total - small;
    pads[i] = ap == "SAME_UPPER" ? small : big;
    pads[i + n] = ap == "SAME_UPPER" ? big : small;
  }
  return pads;
}

Sizes ints_or(NodeCtx& c, const std::string& name, size_t n, int64_t fallback) {
  Sizes v = c.attr_ints(name);
  if (v.empty()) v.assign(n, fallback);
  return v;
}

StatusOr<Value*> conv(NodeCtx& c, Value* x, Value* w, Value* b) {
  KILN_ASSIGN_OR_RETURN(Sizes in, spatial_of(c, x, "X"));
  KILN_ASSIGN_OR_RETURN(Sizes ws, c.static_shape(w, "W"));
  const size_t n = in.size();
  if (ws.size() != n + 2) return c.error("W " + w->type().str() + " does not match X " + x->type().str());
  const Sizes kernel(ws.begin() + 2, ws.end());
  const Sizes strides = ints_or(c, "strides", n, 1), dil = ints_or(c, "dilations", n, 1);
  if (strides.size() != n || dil.size() != n) return c.error("strides and dilations need one value per spatial dim");
  KILN_ASSIGN_OR_RETURN(Sizes pads, window_pads(c, in, kernel, strides, dil));
  std::vector<Value*> ops = {x, w};
  if (b) ops.push_back(b);
  return c.op("conv", ops, {{"strides", Attribute(strides)}, {"pads", Attribute(pads)},
                            {"dilations", Attribute(dil)}, {"groups", Attribute(c.attr_int("group", 1))}});
}

Status conv_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * y, conv(c, c.in(0), c.in(1), c.in(2)));
  return c.out(0, y);
}

/// ConvTranspose as a convolution: zeros are inserted between input elements (stride), the
/// result padded by kernel - 1 - pads, and convolved with the flipped, transposed kernel.
Status conv_transpose_op(NodeCtx& c) {
  Value* x = c.in(0);
  Value* w = c.in(1);
  KILN_ASSIGN_OR_RETURN(Sizes in, spatial_of(c, x, "X"));
  KILN_ASSIGN_OR_RETURN(Sizes ws, c.static_shape(w, "W"));
  const size_t n = in.size();
  const int64_t r = static_cast<int64_t>(n) + 2;
  if (static_cast<int64_t>(ws.size()) != r) return c.error("W " + w->type().str() + " does not match X");
  const int64_t g = c.attr_int("group", 1);
  const int64_t cin = ws[0], cout_g = ws[1];
  KILN_RETURN_IF_ERROR(check_range(c, "group", {g}, 1, kMaxWindowAttr));
  if (cin % g != 0) return c.error("group " + std::to_string(g) + " does not divide W's first dim");
  const Sizes kernel(ws.begin() + 2, ws.end());
  const Sizes strides = ints_or(c, "strides", n, 1), dil = ints_or(c, "dilations", n, 1);
  const Sizes opad = ints_or(c, "output_padding", n, 0);
  if (strides.size() != n || dil.size() != n || opad.size() != n)
    return c.error("strides, dilations and output_padding need one value per spatial dim");
  KILN_RETURN_IF_ERROR(check_range(c, "kernel_shape", kernel, 1, kMaxWindowAttr));
  KILN_RETURN_IF_ERROR(check_range(c, "strides", strides, 1, kMaxWindowAttr));
  KILN_RETURN_IF_ERROR(check_range(c, "dilations", dil, 1, kMaxWindowAttr));
  KILN_RETURN_IF_ERROR(check_range(c, "output_padding", opad, 0, kMaxWindowAttr));
  KILN_RETURN_IF_ERROR(check_range(c, "pads", c.attr_ints("pads"), -kMaxWindowAttr, kMaxWindowAttr));
  KILN_RETURN_IF_ERROR(check_range(c, "output_shape", c.attr_ints("output_shape"), 0, int64_t{1} << 40));
  Sizes pads = c.attr_ints("pads");
  if (pads.empty()) pads.assign(2 * n, 0);
  const std::string ap = c.attr_string("auto_pad", "NOTSET");
  Sizes out_shape = c.attr_ints("output_shape");
  if (out_shape.size() > n) out_shape.erase(out_shape.begin(), out_shape.end() - static_cast<std::ptrdiff_t>(n));
  if (out_shape.empty() && (ap == "SAME_UPPER" || ap == "SAME_LOWER"))
    for (size_t i = 0; i < n; ++i) out_shape.push_back(in[i] * strides[i]);
  if (!out_shape.empty()) {
    if (out_shape.size() != n) return c.error("output_shape needs one value per spatial dim");
    for (size_t i = 0; i < n; ++i) {
      const int64_t total = strides[i] * (in[i] - 1) + opad[i] + (kernel[i] - 1) * dil[i] + 1 - out_shape[i];
      const int64_t half = total >= 0 ? total / 2 : -((-total + 1) / 2);  // floor, as onnx's reference
      pads[i] = ap == "SAME_UPPER" ? half : total - half;
      pads[i + n] = ap == "SAME_UPPER" ? total - half : half;
    }
  } else if (ap == "VALID") {
    pads.assign(2 * n, 0);
  }
  if (pads.size() != 2 * n) return c.error("pads must have " + std::to_string(2 * n) + " values");

  // Insert stride - 1 zeros after every element of each strided spatial dim.
  Value* u = x;
  Sizes cur(x->shape().size());
  cur[0] = -1;
  cur[1] = x->shape()[1].is_static() ? x->shape()[1].value() : -1;
  if (cur[1] < 0) return c.error("X needs a static channel dim");
  for (size_t i = 0; i < n; ++i) cur[i + 2] = in[i];
  Sizes pad_full(static_cast<size_t>(2 * r), 0);
  for (size_t i = 0; i < n; ++i) {
    const int64_t d = static_cast<int64_t>(i) + 2, s = strides[i];
    if (s > 1) {
      KILN_ASSIGN_OR_RETURN(u, unsqueeze(c, u, {d + 1}));
      Sizes p(static_cast<size_t>(2 * (r + 1)), 0);
      p[static_cast<size_t>(r + 1 + d + 1)] = s - 1;
      KILN_ASSIGN_OR_RETURN(u, c.op("pad", {u}, {{"pads", Attribute(p)}}));
      cur[static_cast<size_t>(d)] *= s;
      KILN_ASSIGN_OR_RETURN(u, reshape(c, u, cur));
    }
    const int64_t eff = (kernel[i] - 1) * dil[i] + 1;
    pad_full[static_cast<size_t>(d)] = eff - 1 - pads[i];
    pad_full[static_cast<size_t>(r + d)] = eff - 1 - pads[i + n] + opad[i] - (s - 1);
  }
  KILN_ASSIGN_OR_RETURN(u, c.op("pad", {u}, {{"pads", Attribute(pad_full)}}));
  // W [Cin, Cout/g, k...] → [g, Cin/g, Cout/g, k...] → [g, Cout/g, Cin/g, k...] → [Cout, Cin/g, k...].
  Sizes grouped{g, cin / g, cout_g}, perm{0, 2, 1}, merged{g * cout_g, cin / g};
  for (size_t i = 0; i < n; ++i) {
    grouped.push_back(kernel[i]);
    perm.push_back(static_cast<int64_t>(i) + 3);
    merged.push_back(kernel[i]);
  }
  KILN_ASSIGN_OR_RETURN(Value * wt, reshape(c, w, grouped));
  KILN_ASSIGN_OR_RETURN(wt, transpose(c, wt, perm));
  KILN_ASSIGN_OR_RETURN(wt, reshape(c, wt, merged));
  Sizes axes, starts(n, -1), ends(n, std::numeric_limits<int64_t>::min()), steps(n, -1);
  for (size_t i = 0; i < n; ++i) axes.push_back(static_cast<int64_t>(i) + 2);
  KILN_ASSIGN_OR_RETURN(wt, c.op("slice", {wt}, {{"starts", Attribute(starts)}, {"ends", Attribute(ends)},
                                                 {"axes", Attribute(axes)}, {"steps", Attribute(steps)}}));
  std::vector<Value*> ops = {u, wt};
  if (c.has_input(2)) ops.push_back(c.in(2));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("conv", ops, {{"dilations", Attribute(dil)}, {"groups", Attribute(g)}}));
  return c.out(0, y);
}

/// Subtracts a zero point (scalar or per-channel along `axis`) after widening to i32.
StatusOr<Value*> minus_zero_point(NodeCtx& c, Value* x, Value* zp, int64_t axis) {
  KILN_ASSIGN_OR_RETURN(Value * xi, cast_to(c, x, DType::kI32));
  if (!zp) return xi;
  KILN_ASSIGN_OR_RETURN(Value * z, cast_to(c, zp, DType::kI32));
  if (z->type().rank() == 1 && x->type().rank() > 1) {
    Sizes s(static_cast<size_t>(x->type().rank() - axis), 1);
    s[0] = -1;
    KILN_ASSIGN_OR_RETURN(z, reshape(c, z, s));
  }
  return c.op("sub", {xi, z});
}

Status conv_integer_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * x, minus_zero_point(c, c.in(0), c.in(2), 1));
  KILN_ASSIGN_OR_RETURN(Value * w, minus_zero_point(c, c.in(1), c.in(3), 0));
  KILN_ASSIGN_OR_RETURN(Value * y, conv(c, x, w, nullptr));
  return c.out(0, y);
}

Status matmul_integer_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * a, minus_zero_point(c, c.in(0), c.in(2), c.in(0)->type().rank() - 2));
  Value* b = nullptr;
  KILN_ASSIGN_OR_RETURN(b, cast_to(c, c.in(1), DType::kI32));
  if (c.has_input(3)) {
    KILN_ASSIGN_OR_RETURN(Value * z, cast_to(c, c.in(3), DType::kI32));
    KILN_ASSIGN_OR_RETURN(b, c.op("sub", {b, z}));
  }
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("matmul", {a, b}));
  return c.out(0, y);
}

/// round(v) + zero point, saturated to the zero point's type (u8 when absent).
StatusOr<Value*> requantize(NodeCtx& c, Value* v, Value* zp) {
  const DType qt = zp ? zp->dtype() : DType::kU8;
  KILN_ASSIGN_OR_RETURN(Value * r, c.op("round", {v}));
  if (zp) {
    KILN_ASSIGN_OR_RETURN(Value * z, cast_to(c, zp, v->dtype()));
    KILN_ASSIGN_OR_RETURN(r, c.op("add", {r, z}));
  }
  double lo = 0, hi = 255;
  if (qt == DType::kI8) lo = -128, hi = 127;
  else if (qt == DType::kI32) lo = -2147483648.0, hi = 2147483647.0;
  else if (qt == DType::kI16) lo = -32768, hi = 32767;
  else if (qt != DType::kU8) return c.error("quantized type " + std::string(dtype_name(qt)) + " is not supported");
  KILN_ASSIGN_OR_RETURN(r, c.op("clip", {r}, {{"min", Attribute(lo)}, {"max", Attribute(hi)}}));
  return cast_to(c, r, qt);
}

/// A per-axis parameter (1-D, one value per slice along `axis` of a rank-`rank` value)
/// reshaped to broadcast; scalars pass through.
StatusOr<Value*> per_axis(NodeCtx& c, Value* p, int64_t axis, int64_t rank) {
  if (!p || p->type().rank() == 0 || rank == 0) return p;
  if (p->type().rank() != 1) return c.error("block quantization is not supported");
  Sizes s(static_cast<size_t>(rank - axis), 1);
  s[0] = -1;
  return reshape(c, p, s);
}

/// The axis of per-axis quantization parameters (only checked when they are 1-D).
StatusOr<int64_t> quant_axis(NodeCtx& c, int64_t rank) {
  const Value* scale = c.in(1);
  if (scale->type().rank() == 0) return 0;
  return norm_axis(c, c.attr_int("axis", 1), rank);
}

Status quantize_op(NodeCtx& c) {
  Value* x = c.in(0);
  const int64_t rank = x->type().rank();
  KILN_ASSIGN_OR_RETURN(int64_t axis, quant_axis(c, rank));
  KILN_ASSIGN_OR_RETURN(Value * scale, per_axis(c, c.in(1), axis, rank));
  KILN_ASSIGN_OR_RETURN(Value * zp, per_axis(c, c.in(2), axis, rank));
  KILN_ASSIGN_OR_RETURN(Value * xs, cast_to(c, x, scale->dtype()));
  KILN_ASSIGN_OR_RETURN(Value * q, c.op("div", {xs, scale}));
  KILN_ASSIGN_OR_RETURN(Value * y, requantize(c, q, zp));
  return c.out(0, y);
}

Status dequantize_op(NodeCtx& c) {
  Value* x = c.in(0);
  const int64_t rank = x->type().rank();
  KILN_ASSIGN_OR_RETURN(int64_t axis, quant_axis(c, rank));
  KILN_ASSIGN_OR_RETURN(Value * scale, per_axis(c, c.in(1), axis, rank));
  KILN_ASSIGN_OR_RETURN(Value * zp, per_axis(c, c.in(2), axis, rank));
  const DType ft = scale->dtype();
  KILN_ASSIGN_OR_RETURN(Value * v, cast_to(c, x, ft));
  if (zp) {
    KILN_ASSIGN_OR_RETURN(Value * z, cast_to(c, zp, ft));
    KILN_ASSIGN_OR_RETURN(v, c.op("sub", {v, z}));
  }
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("mul", {v, scale}));
  return c.out(0, y);
}

Status dynamic_quantize_op(NodeCtx& c) {
  Value* x = c.in(0);
  Value* zero = scalar_like(c, x, 0);
  KILN_ASSIGN_OR_RETURN(Value * mx, reduce(c, "reduce_max", x, {}, false));
  KILN_ASSIGN_OR_RETURN(Value * mn, reduce(c, "reduce_min", x, {}, false));
  KILN_ASSIGN_OR_RETURN(mx, c.op("maximum", {mx, zero}));
  KILN_ASSIGN_OR_RETURN(mn, c.op("minimum", {mn, zero}));
  KILN_ASSIGN_OR_RETURN(Value * scale, c.op("sub", {mx, mn}));
  KILN_ASSIGN_OR_RETURN(scale, with_scalar(c, "div", scale, 255.0));
  KILN_ASSIGN_OR_RETURN(Value * zf, c.op("sub", {zero, mn}));
  KILN_ASSIGN_OR_RETURN(zf, c.op("div", {zf, scale}));
  KILN_ASSIGN_OR_RETURN(Value * zp, requantize(c, zf, nullptr));
  KILN_ASSIGN_OR_RETURN(Value * q, c.op("div", {x, scale}));
  KILN_ASSIGN_OR_RETURN(Value * y, requantize(c, q, zp));
  KILN_RETURN_IF_ERROR(c.out(0, y));
  KILN_RETURN_IF_ERROR(c.out(1, scale));
  return c.out(2, zp);
}

Status qlinear_op(NodeCtx& c) {
  const bool is_conv = c.proto.op_type() == "QLinearConv";
  KILN_ASSIGN_OR_RETURN(Value * a, minus_zero_point(c, c.in(0), c.in(2), 1));
  Value* acc = nullptr;
  if (is_conv) {
    KILN_ASSIGN_OR_RETURN(Value * w, minus_zero_point(c, c.in(3), c.in(5), 0));
    KILN_ASSIGN_OR_RETURN(acc, conv(c, a, w, c.in(8)));
  } else {
    KILN_ASSIGN_OR_RETURN(Value * b, cast_to(c, c.in(3), DType::kI32));
    KILN_ASSIGN_OR_RETURN(Value * bz, cast_to(c, c.in(5), DType::kI32));
    KILN_ASSIGN_OR_RETURN(b, c.op("sub", {b, bz}));
    KILN_ASSIGN_OR_RETURN(acc, c.op("matmul", {a, b}));
  }
  Value* as = c.in(1);
  KILN_ASSIGN_OR_RETURN(Value * ws, is_conv ? per_axis(c, c.in(4), 1, acc->type().rank()) : StatusOr<Value*>(c.in(4)));
  KILN_ASSIGN_OR_RETURN(Value * m, c.op("mul", {as, ws}));
  KILN_ASSIGN_OR_RETURN(m, c.op("div", {m, c.in(6)}));
  KILN_ASSIGN_OR_RETURN(Value * f, cast_to(c, acc, m->dtype()));
  KILN_ASSIGN_OR_RETURN(f, c.op("mul", {f, m}));
  KILN_ASSIGN_OR_RETURN(Value * y, requantize(c, f, c.in(7)));
  return c.out(0, y);
}

// --- pooling ---------------------------------------------------------------------------

Status pool_op(NodeCtx& c) {
  Value* x = c.in(0);
  const bool is_max = c.proto.op_type() == "MaxPool";
  KILN_ASSIGN_OR_RETURN(Sizes in, spatial_of(c, x, "X"));
  const size_t n = in.size();
  const Sizes kernel = c.attr_ints("kernel_shape");
  if (kernel.size() != n) return c.error("kernel_shape needs one value per spatial dim");
  const Sizes strides = ints_or(c, "strides", n, 1), dil = ints_or(c, "dilations", n, 1);
  KILN_ASSIGN_OR_RETURN(Sizes pads, window_pads(c, in, kernel, strides, dil));
  AttrMap attrs{{"kernel_shape", Attribute(kernel)}, {"strides", Attribute(strides)}, {"pads", Attribute(pads)},
                {"ceil_mode", Attribute(c.attr_int("ceil_mode", 0))}};
  if (is_max) {
    attrs["dilations"] = Attribute(dil);
  } else {
    for (int64_t d : dil)
      if (d != 1) return c.error(StatusCode::kUnimplemented, "AveragePool with dilations is not supported");
    attrs["count_include_pad"] = Attribute(c.attr_int("count_include_pad", 0));
  }
  KILN_ASSIGN_OR_RETURN(Value * y, c.op(is_max ? "max_pool" : "avg_pool", {x}, attrs));
  KILN_RETURN_IF_ERROR(c.out(0, y));
  if (is_max && c.has_output(1)) {
    attrs["storage_order"] = Attribute(c.attr_int("storage_order", 0));
    KILN_ASSIGN_OR_RETURN(Value * idx, c.op("max_pool_indices", {x, y}, std::move(attrs)));
    KILN_RETURN_IF_ERROR(c.out(1, idx));
  }
  return ok_status();
}

Status lp_pool_op(NodeCtx& c) {
  Value* x = c.in(0);
  const double p = static_cast<double>(c.attr_int("p", 2));
  KILN_ASSIGN_OR_RETURN(Sizes in, spatial_of(c, x, "X"));
  const size_t n = in.size();
  const bool global = c.proto.op_type() == "GlobalLpPool";
  KILN_ASSIGN_OR_RETURN(Value * a, c.op("abs", {x}));
  KILN_ASSIGN_OR_RETURN(a, with_scalar(c, "pow", a, p));
  Value* s = nullptr;
  if (global) {
    Sizes axes;
    for (size_t i = 0; i < n; ++i) axes.push_back(static_cast<int64_t>(i) + 2);
    KILN_ASSIGN_OR_RETURN(s, reduce(c, "reduce_sum", a, axes, true));
  } else {
    const Sizes kernel = c.attr_ints("kernel_shape");
    if (kernel.size() != n) return c.error("kernel_shape needs one value per spatial dim");
    const Sizes strides = ints_or(c, "strides", n, 1), dil(n, 1);
    KILN_ASSIGN_OR_RETURN(Sizes pads, window_pads(c, in, kernel, strides, dil));
    KILN_ASSIGN_OR_RETURN(s, c.op("avg_pool", {a}, {{"kernel_shape", Attribute(kernel)}, {"strides", Attribute(strides)},
                                                   {"pads", Attribute(pads)}, {"count_include_pad", Attribute(1)},
                                                   {"ceil_mode", Attribute(c.attr_int("ceil_mode", 0))}}));
    KILN_ASSIGN_OR_RETURN(s, with_scalar(c, "mul", s, static_cast<double>(product_of(kernel))));
  }
  KILN_ASSIGN_OR_RETURN(Value * y, with_scalar(c, "pow", s, 1.0 / p));
  return c.out(0, y);
}

Status global_pool_op(NodeCtx& c) {
  Value* x = c.in(0);
  Sizes axes;
  for (int64_t d = 2; d < x->type().rank(); ++d) axes.push_back(d);
  KILN_ASSIGN_OR_RETURN(Value * y, reduce(c, c.proto.op_type() == "GlobalMaxPool" ? "reduce_max" : "reduce_mean", x, axes, true));
  return c.out(0, y);
}

// --- normalization ---------------------------------------------------------------------

/// `p` [C] reshaped to [C, 1, ...] to broadcast against [N, C, spatial...] of rank `rank`.
StatusOr<Value*> channel_param(NodeCtx& c, Value* p, int64_t rank) {
  Sizes s(static_cast<size_t>(rank - 1), 1);
  s[0] = -1;
  return reshape(c, p, s);
}

Status batch_norm_op(NodeCtx& c) {
  Value* x = c.in(0);
  const double eps = c.attr_float("epsilon", 1e-5);
  if (c.opset < 9 && c.attr_int("spatial", 1) == 0)
    return c.error(StatusCode::kUnimplemented, "BatchNormalization with spatial 0 is not supported");
  const bool training = (c.opset >= 14 && c.attr_int("training_mode", 0) != 0) ||
                        (c.opset < 14 && c.num_outputs() > 1 && c.has_output(1));
  if (!training) {
    KILN_ASSIGN_OR_RETURN(Value * y, c.op("batch_norm", {x, c.in(1), c.in(2), c.in(3), c.in(4)},
                                          {{"epsilon", Attribute(eps)}}));
    return c.out(0, y);
  }
  if (c.opset < 14) return c.error(StatusCode::kUnimplemented, "training-mode BatchNormalization before opset 14 is not supported");
  // Batch statistics (population variance), then running averages with momentum.
  const double mom = c.attr_float("momentum", 0.9);
  Sizes axes{0};
  for (int64_t d = 2; d < x->type().rank(); ++d) axes.push_back(d);
  KILN_ASSIGN_OR_RETURN(Value * mean, reduce(c, "reduce_mean", x, axes, false));
  KILN_ASSIGN_OR_RETURN(Value * mk, reduce(c, "reduce_mean", x, axes, true));
  KILN_ASSIGN_OR_RETURN(Value * d, c.op("sub", {x, mk}));
  KILN_ASSIGN_OR_RETURN(d, c.op("mul", {d, d}));
  KILN_ASSIGN_OR_RETURN(Value * var, reduce(c, "reduce_mean", d, axes, false));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("batch_norm", {x, c.in(1), c.in(2), mean, var}, {{"epsilon", Attribute(eps)}}));
  KILN_RETURN_IF_ERROR(c.out(0, y));
  for (int k : {1, 2}) {
    if (!c.has_output(k)) continue;
    KILN_ASSIGN_OR_RETURN(Value * old, with_scalar(c, "mul", c.in(k + 2), mom));
    KILN_ASSIGN_OR_RETURN(Value * cur, with_scalar(c, "mul", k == 1 ? mean : var, 1.0 - mom));
    KILN_ASSIGN_OR_RETURN(Value * run, c.op("add", {old, cur}));
    KILN_RETURN_IF_ERROR(c.out(k, run));
  }
  return ok_status();
}

Status instance_norm_op(NodeCtx& c) {
  Value* x = c.in(0);
  const int64_t rank = x->type().rank();
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("layer_norm", {x}, {{"axis", Attribute(2)},
                                                           {"epsilon", Attribute(c.attr_float("epsilon", 1e-5))}}));
  KILN_ASSIGN_OR_RETURN(Value * s, channel_param(c, c.in(1), rank));
  KILN_ASSIGN_OR_RETURN(Value * b, channel_param(c, c.in(2), rank));
  KILN_ASSIGN_OR_RETURN(y, c.op("mul", {y, s}));
  KILN_ASSIGN_OR_RETURN(y, c.op("add", {y, b}));
  return c.out(0, y);
}

Status layer_norm_op(NodeCtx& c) {
  Value* x = c.in(0);
  const int64_t rank = x->type().rank();
  KILN_ASSIGN_OR_RETURN(int64_t axis, norm_axis(c, c.attr_int("axis", -1), rank));
  const double eps = c.attr_float("epsilon", 1e-5);
  std::vector<Value*> ops = {x, c.in(1)};
  if (c.has_input(2)) ops.push_back(c.in(2));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("layer_norm", ops, {{"axis", Attribute(axis)}, {"epsilon", Attribute(eps)}}));
  KILN_RETURN_IF_ERROR(c.out(0, y));
  if (c.has_output(1) || c.has_output(2)) {
    Sizes axes;
    for (int64_t d = axis; d < rank; ++d) axes.push_back(d);
    KILN_ASSIGN_OR_RETURN(Value * mean, reduce(c, "reduce_mean", x, axes, true));
    KILN_ASSIGN_OR_RETURN(Value * d, c.op("sub", {x, mean}));
    KILN_ASSIGN_OR_RETURN(d, c.op("mul", {d, d}));
    KILN_ASSIGN_OR_RETURN(Value * var, reduce(c, "reduce_mean", d, axes, true));
    KILN_ASSIGN_OR_RETURN(var, with_scalar(c, "add", var, eps));
    KILN_ASSIGN_OR_RETURN(Value * inv, c.op("rsqrt", {var}));
    KILN_RETURN_IF_ERROR(c.out(1, mean));
    KILN_RETURN_IF_ERROR(c.out(2, inv));
  }
  return ok_status();
}

Status group_norm_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Sizes s, c.static_shape(x, "X"));
  if (s.size() < 2) return c.error("X must be [N, C, ...], got " + x->type().str());
  const int64_t g = c.attr_int("num_groups", 0), ch = s[1];
  if (g < 1 || ch % g != 0) return c.error("num_groups " + std::to_string(g) + " does not divide channels " + std::to_string(ch));
  KILN_ASSIGN_OR_RETURN(Value * y, reshape(c, x, {s[0], g, -1}));
  KILN_ASSIGN_OR_RETURN(y, c.op("layer_norm", {y}, {{"axis", Attribute(2)}, {"epsilon", Attribute(c.attr_float("epsilon", 1e-5))}}));
  KILN_ASSIGN_OR_RETURN(y, reshape(c, y, s));
  Value* scale = c.in(1);
  Value* bias = c.in(2);
  if (c.opset < 21) {
    // Opset 18 gives one scale and bias per group: repeat them over the group's channels.
    Sizes idx;
    for (int64_t k = 0; k < ch; ++k) idx.push_back(k / (ch / g));
    KILN_ASSIGN_OR_RETURN(scale, c.op("gather", {scale, c.ints(idx)}, {{"axis", Attribute(0)}}));
    KILN_ASSIGN_OR_RETURN(bias, c.op("gather", {bias, c.ints(idx)}, {{"axis", Attribute(0)}}));
  }
  const int64_t rank = static_cast<int64_t>(s.size());
  KILN_ASSIGN_OR_RETURN(scale, channel_param(c, scale, rank));
  KILN_ASSIGN_OR_RETURN(bias, channel_param(c, bias, rank));
  KILN_ASSIGN_OR_RETURN(y, c.op("mul", {y, scale}));
  KILN_ASSIGN_OR_RETURN(y, c.op("add", {y, bias}));
  return c.out(0, y);
}

Status lrn_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Sizes s, c.static_shape(x, "X"));
  if (s.size() < 3) return c.error("X must be [N, C, spatial...]");
  const int64_t size = c.attr_int("size", 0);
  KILN_RETURN_IF_ERROR(check_range(c, "size", {size}, 1, kMaxWindowAttr));
  const double alpha = c.attr_float("alpha", 1e-4), beta = c.attr_float("beta", 0.75), bias = c.attr_float("bias", 1.0);
  // Sum of squares over a channel window: a padded average pool over [N, 1, C, rest].
  const int64_t rest = product_of(Sizes(s.begin() + 2, s.end()));
  KILN_ASSIGN_OR_RETURN(Value * sq, c.op("mul", {x, x}));
  KILN_ASSIGN_OR_RETURN(sq, reshape(c, sq, {s[0], 1, s[1], rest}));
  const int64_t lo = (size - 1) / 2, hi = size - 1 - lo;
  KILN_ASSIGN_OR_RETURN(Value * sum, c.op("avg_pool", {sq}, {{"kernel_shape", Attribute(Sizes{size, 1})},
                                                             {"pads", Attribute(Sizes{lo, 0, hi, 0})},
                                                             {"count_include_pad", Attribute(1)}}));
  KILN_ASSIGN_OR_RETURN(sum, reshape(c, sum, s));
  KILN_ASSIGN_OR_RETURN(sum, with_scalar(c, "mul", sum, alpha));  // avg * size * alpha / size
  KILN_ASSIGN_OR_RETURN(sum, with_scalar(c, "add", sum, bias));
  KILN_ASSIGN_OR_RETURN(sum, with_scalar(c, "pow", sum, beta));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("div", {x, sum}));
  return c.out(0, y);
}

Status mvn_op(NodeCtx& c) {
  Value* x = c.in(0);
  Sizes axes = c.has_attr("axes") ? c.attr_ints("axes") : Sizes{0, 2, 3};
  KILN_ASSIGN_OR_RETURN(axes, norm_axes(c, axes, x->type().rank()));
  KILN_ASSIGN_OR_RETURN(Value * mean, reduce(c, "reduce_mean", x, axes, true));
  KILN_ASSIGN_OR_RETURN(Value * d, c.op("sub", {x, mean}));
  KILN_ASSIGN_OR_RETURN(Value * sq, c.op("mul", {d, d}));
  KILN_ASSIGN_OR_RETURN(Value * var, reduce(c, "reduce_mean", sq, axes, true));
  KILN_ASSIGN_OR_RETURN(Value * sd, c.op("sqrt", {var}));
  KILN_ASSIGN_OR_RETURN(sd, with_scalar(c, "add", sd, 1e-9));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("div", {d, sd}));
  return c.out(0, y);
}

Status lp_norm_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(int64_t axis, norm_axis(c, c.attr_int("axis", -1), x->type().rank()));
  const int64_t p = c.attr_int("p", 2);
  if (p != 1 && p != 2) return c.error("p must be 1 or 2, got " + std::to_string(p));
  Value* n = nullptr;
  if (p == 1) {
    KILN_ASSIGN_OR_RETURN(Value * a, c.op("abs", {x}));
    KILN_ASSIGN_OR_RETURN(n, reduce(c, "reduce_sum", a, {axis}, true));
  } else {
    KILN_ASSIGN_OR_RETURN(Value * sq, c.op("mul", {x, x}));
    KILN_ASSIGN_OR_RETURN(n, reduce(c, "reduce_sum", sq, {axis}, true));
    KILN_ASSIGN_OR_RETURN(n, c.op("sqrt", {n}));
  }
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("div", {x, n}));
  return c.out(0, y);
}

Status dropout_op(NodeCtx& c) {
  Value* x = c.in(0);
  double ratio = c.attr_float("ratio", 0.5);
  bool training = c.opset < 7 && c.attr_int("is_test", 0) == 0;
  if (c.opset >= 12) {
    ratio = 0.5;
    if (c.has_input(1)) {
      KILN_ASSIGN_OR_RETURN(std::vector<double> r, c.const_floats(1, "ratio"));
      ratio = r.empty() ? 0.5 : r[0];
    }
    training = false;
    if (c.has_input(2)) {
      KILN_ASSIGN_OR_RETURN(Tensor t, c.const_input(2, "training_mode"));
      training = t.numel() == 1 && t.get_i64(0) != 0;
    }
  }
  if (training && ratio != 0)
    return c.error(StatusCode::kUnimplemented,
                   "training-mode dropout draws random numbers, which kiln does not support");
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("identity", {x}));
  KILN_RETURN_IF_ERROR(c.out(0, y));
  if (c.has_output(1)) {
    KILN_ASSIGN_OR_RETURN(Sizes s, c.static_shape(x, "data"));
    Tensor mask(DType::kBool, s);
    for (int64_t i = 0; i < mask.numel(); ++i) mask.set_i64(i, 1);
    KILN_RETURN_IF_ERROR(c.out(1, c.constant(std::move(mask))));
  }
  return ok_status();
}

// --- matrix products -------------------------------------------------------------------

Status gemm_op(NodeCtx& c) {
  Value* a = c.in(0);
  Value* b = c.in(1);
  if (c.attr_int("transA", 0) != 0) {
    KILN_ASSIGN_OR_RETURN(a, transpose(c, a, {1, 0}));
  }
  Value* y = nullptr;
  if (c.attr_int("transB", 0) != 0) {
    KILN_ASSIGN_OR_RETURN(y, c.op("linear", {a, b}));
  } else {
    KILN_ASSIGN_OR_RETURN(y, c.op("matmul", {a, b}));
  }
  const double alpha = c.attr_float("alpha", 1.0), beta = c.attr_float("beta", 1.0);
  // When alpha or the bias follow, the product gets a name of its own (the output's, plus
  // ".product"), so tools that match layers by name (kiln quant-report) find this one.
  if (c.has_output(0) && y->name().empty() && (alpha != 1.0 || (c.has_input(2) && beta != 0.0)))
    y->set_name(c.proto.output(0) + ".product");
  if (alpha != 1.0) {
    KILN_ASSIGN_OR_RETURN(y, with_scalar(c, "mul", y, alpha));
  }
  if (c.has_input(2) && beta != 0.0) {
    Value* cc = c.in(2);
    if (beta != 1.0) {
      KILN_ASSIGN_OR_RETURN(cc, with_scalar(c, "mul", cc, beta));
    }
    KILN_ASSIGN_OR_RETURN(y, c.op("add", {y, cc}));
  }
  return c.out(0, y);
}

Status matmul_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("matmul", {c.in(0), c.in(1)}));
  return c.out(0, y);
}

// --- resize ----------------------------------------------------------------------------

struct ResizeSpec {
  std::string mode = "nearest", coord = "half_pixel", nearest = "round_prefer_floor";
  double cubic_a = -0.75, extrapolation = 0;
  bool exclude_outside = false;
};

/// Source coordinate of output index `o` on one axis.
double source_coord(const ResizeSpec& r, int64_t o, int64_t in, double out, double scale,
                    double roi_start, double roi_end) {
  // `out` is in * scale, not rounded: onnx's reference uses it unrounded in the transforms.
  const double x = static_cast<double>(o);
  if (r.coord == "half_pixel") return (x + 0.5) / scale - 0.5;
  if (r.coord == "tf_half_pixel_for_nn") return (x + 0.5) / scale;
  if (r.coord == "half_pixel_symmetric") {
    const double adj = std::floor(out) / (static_cast<double>(in) * scale);
    const double center = static_cast<double>(in) / 2;
    return center * (1 - adj) + (x + 0.5) / scale - 0.5;
  }
  if (r.coord == "pytorch_half_pixel") return out > 1 ? (x + 0.5) / scale - 0.5 : 0;
  if (r.coord == "align_corners")
    return out == 1 ? 0 : x * static_cast<double>(in - 1) / (out - 1);
  if (r.coord == "tf_crop_and_resize")
    return out > 1 ? roi_start * static_cast<double>(in - 1) +
                         x * (roi_end - roi_start) * static_cast<double>(in - 1) / (out - 1)
                   : 0.5 * (roi_start + roi_end) * static_cast<double>(in - 1);
  return x / scale;  // asymmetric
}

/// The interpolation weights of one axis as a matrix [out, in], plus a per-output offset
/// (the extrapolation value where tf_crop_and_resize samples outside the input).
void resize_matrix(const ResizeSpec& r, int64_t in, int64_t out, double scale, double rs, double re,
                   Tensor& m, std::vector<double>& offset) {
  m = Tensor(DType::kF64, {out, in});
  offset.assign(static_cast<size_t>(out), 0.0);
  for (int64_t o = 0; o < out; ++o) {
    const double x = source_coord(r, o, in, static_cast<double>(in) * scale, scale, rs, re);
    if (r.coord == "tf_crop_and_resize" && (x < 0 || x > static_cast<double>(in - 1))) {
      offset[static_cast<size_t>(o)] = r.extrapolation;
      continue;
    }
    const double fl = std::floor(x);
    const double ratio = x == fl ? 1.0 : x - fl;
    std::vector<double> coeffs;
    int64_t first = 0;
    if (r.mode == "nearest") {
      const bool right = x == fl ? true
                         : r.nearest == "round_prefer_floor" ? ratio > 0.5
                         : r.nearest == "round_prefer_ceil"  ? ratio >= 0.5
                         : r.nearest == "ceil";
      coeffs = {right ? 0.0 : 1.0, right ? 1.0 : 0.0};
      first = static_cast<int64_t>(x == fl ? fl - 1 : fl);
    } else if (r.mode == "linear") {
      coeffs = {1 - ratio, ratio};
      first = static_cast<int64_t>(x == fl ? fl - 1 : fl);
    } else {
      const double a = r.cubic_a, t = ratio, u = 1 - ratio;
      coeffs = {((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
                ((a + 2) * t - (a + 3)) * t * t + 1, ((a + 2) * u - (a + 3)) * u * u + 1,
                ((a * (u + 1) - 5 * a) * (u + 1) + 8 * a) * (u + 1) - 4 * a};
      first = static_cast<int64_t>(x == fl ? fl - 2 : fl - 1);
    }
    double total = 0;
    for (size_t k = 0; k < coeffs.size(); ++k) {
      const int64_t idx = first + static_cast<int64_t>(k);
      if (r.exclude_outside && (idx < 0 || idx >= in)) coeffs[k] = 0;
      total += coeffs[k];
    }
    for (size_t k = 0; k < coeffs.size(); ++k) {
      const int64_t idx = std::clamp<int64_t>(first + static_cast<int64_t>(k), 0, in - 1);
      const double w = r.exclude_outside ? coeffs[k] / total : coeffs[k];
      m.set_f64(o * in + idx, m.get_f64(o * in + idx) + w);
    }
  }
}

/// Resizes `x` to `out` with per-axis `scales`; one separable pass per changed axis.
StatusOr<Value*> resize(NodeCtx& c, Value* x, const ResizeSpec& r, const Sizes& out,
                        const std::vector<double>& scales, const std::vector<double>& roi) {
  KILN_ASSIGN_OR_RETURN(Sizes in, c.static_shape(x, "X"));
  const size_t rank = in.size();
  Value* y = x;
  for (size_t d = 0; d < rank; ++d) {
    const double rs = roi.empty() ? 0 : roi[d], re = roi.empty() ? 1 : roi[d + rank];
    const bool crop = r.coord == "tf_crop_and_resize" && (rs != 0 || re != 1);
    if (out[d] == in[d] && scales[d] == 1.0 && !crop) continue;
    if (in[d] == 0 || out[d] == 0) return c.error("cannot resize an empty dim");
    KILN_RETURN_IF_ERROR(check_constant_size(c, "resize matrix", out[d], in[d]));
    Tensor m;
    std::vector<double> offset;
    resize_matrix(r, in[d], out[d], scales[d], rs, re, m, offset);
    if (r.mode == "nearest" && !crop) {
      // One source per output: a gather, exact for every value (inf and nan included).
      Sizes idx;
      for (int64_t o = 0; o < out[d]; ++o)
        for (int64_t i = 0; i < in[d]; ++i)
          if (m.get_f64(o * in[d] + i) != 0) idx.push_back(i);
      KILN_ASSIGN_OR_RETURN(y, c.op("gather", {y, c.ints(idx)}, {{"axis", Attribute(static_cast<int64_t>(d))}}));
      continue;
    }
    KILN_ASSIGN_OR_RETURN(y, apply_along_axis(c, y, static_cast<int64_t>(d), m));
    if (std::any_of(offset.begin(), offset.end(), [](double v) { return v != 0; })) {
      Sizes os(rank, 1);
      os[d] = out[d];
      KILN_ASSIGN_OR_RETURN(y, c.op("add", {y, c.constant(Tensor::from_f64(y->dtype(), os, offset))}));
    }
  }
  return y;
}

Status resize_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Sizes in, c.static_shape(x, "X"));
  const size_t rank = in.size();
  ResizeSpec r;
  std::vector<double> scales, roi;
  Sizes sizes;
  const bool upsample = c.proto.op_type() == "Upsample";
  r.mode = c.attr_string("mode", "nearest");
  if (upsample || c.opset < 11) {
    // Upsample and Resize-10: asymmetric coordinates, nearest rounds down.
    r.coord = "asymmetric";
    r.nearest = "floor";
    if (upsample && c.opset < 9) scales = c.attr_floats("scales");
    else {
      KILN_ASSIGN_OR_RETURN(scales, c.const_floats(1, "scales"));
    }
  } else {
    r.coord = c.attr_string("coordinate_transformation_mode", "half_pixel");
    r.nearest = c.attr_string("nearest_mode", "round_prefer_floor");
    r.cubic_a = c.attr_float("cubic_coeff_a", -0.75);
    r.exclude_outside = c.attr_int("exclude_outside", 0) != 0;
    r.extrapolation = c.attr_float("extrapolation_value", 0.0);
    if (c.attr_int("antialias", 0) != 0) return c.error(StatusCode::kUnimplemented, "antialias is not supported");
    if (c.attr_string("keep_aspect_ratio_policy", "stretch") != "stretch")
      return c.error(StatusCode::kUnimplemented, "keep_aspect_ratio_policy other than stretch is not supported");
    if (c.has_input(1)) {
      KILN_ASSIGN_OR_RETURN(roi, c.const_floats(1, "roi"));
    }
    if (c.has_input(2)) {
      KILN_ASSIGN_OR_RETURN(scales, c.const_floats(2, "scales"));
    }
    if (c.has_input(3)) {
      KILN_ASSIGN_OR_RETURN(sizes, c.const_ints(3, "sizes"));
    }
    // Opset 18 may name a subset of axes; spread the values over all dims.
    if (c.has_attr("axes")) {
      KILN_ASSIGN_OR_RETURN(Sizes axes, norm_axes(c, c.attr_ints("axes"), static_cast<int64_t>(rank)));
      auto spread = [&](auto& v, auto fill) {
        if (v.empty()) return;
        std::remove_reference_t<decltype(v)> full(rank, fill);
        for (size_t i = 0; i < axes.size() && i < v.size(); ++i) full[static_cast<size_t>(axes[i])] = v[i];
        v = full;
      };
      if (!roi.empty()) {
        std::vector<double> lo(roi.begin(), roi.begin() + static_cast<std::ptrdiff_t>(roi.size() / 2));
        std::vector<double> hi(roi.begin() + static_cast<std::ptrdiff_t>(roi.size() / 2), roi.end());
        spread(lo, 0.0);
        spread(hi, 1.0);
        roi = lo;
        roi.insert(roi.end(), hi.begin(), hi.end());
      }
      spread(scales, 1.0);
      Sizes full_sizes(in);
      for (size_t i = 0; i < axes.size() && i < sizes.size(); ++i) full_sizes[static_cast<size_t>(axes[i])] = sizes[i];
      if (!sizes.empty()) sizes = full_sizes;
    }
  }
  if (r.mode != "nearest" && r.mode != "linear" && r.mode != "cubic")
    return c.error("unknown mode '" + r.mode + "'");
  if (r.mode == "bilinear") r.mode = "linear";
  if (!roi.empty() && roi.size() != 2 * rank) roi.clear();
  Sizes out(rank);
  if (!sizes.empty()) {
    if (sizes.size() != rank) return c.error("sizes needs one value per dim");
    scales.resize(rank);
    for (size_t d = 0; d < rank; ++d) {
      if (sizes[d] < 0) return c.error("sizes must not be negative");
      out[d] = sizes[d];
      scales[d] = in[d] == 0 ? 1.0 : static_cast<double>(sizes[d]) / static_cast<double>(in[d]);
    }
  } else {
    if (scales.size() != rank) return c.error("scales needs one value per dim, got " + std::to_string(scales.size()));
    for (size_t d = 0; d < rank; ++d) {
      if (!(scales[d] > 0)) return c.error("scales must be positive");
      const double o = std::floor(static_cast<double>(in[d]) * scales[d]);
      if (o > static_cast<double>(c.imp.options().limits.max_tensor_bytes))
        return c.error(StatusCode::kOutOfRange, "resized dim is too large");
      out[d] = static_cast<int64_t>(o);
    }
  }
  KILN_ASSIGN_OR_RETURN(Value * y, resize(c, x, r, out, scales, roi));
  return c.out(0, y);
}

Status det_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("det", {c.in(0)}));
  return c.out(0, y);
}

Status grid_sample_op(NodeCtx& c) {
  // Opset 20 renamed the modes (and made linear the default name).
  std::string mode = c.attr_string("mode", c.opset >= 20 ? "linear" : "bilinear");
  if (mode == "linear") mode = "bilinear";
  if (mode == "cubic") mode = "bicubic";
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("grid_sample", {c.in(0), c.in(1)},
                                        {{"mode", Attribute(mode)},
                                         {"padding_mode", Attribute(c.attr_string("padding_mode", "zeros"))},
                                         {"align_corners", Attribute(c.attr_int("align_corners", 0))}}));
  return c.out(0, y);
}

Status roi_align_op(NodeCtx& c) {
  KILN_RETURN_IF_ERROR(check_range(c, "sampling_ratio", {c.attr_int("sampling_ratio", 0)}, 0, 1024));
  const std::string ctm = c.opset >= 16 ? c.attr_string("coordinate_transformation_mode", "half_pixel") : "output_half_pixel";
  KILN_ASSIGN_OR_RETURN(Value * idx, cast_to(c, c.in(2), DType::kI64));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("roi_align", {c.in(0), c.in(1), idx},
                                        {{"mode", Attribute(c.attr_string("mode", "avg"))},
                                         {"output_height", Attribute(c.attr_int("output_height", 1))},
                                         {"output_width", Attribute(c.attr_int("output_width", 1))},
                                         {"sampling_ratio", Attribute(c.attr_int("sampling_ratio", 0))},
                                         {"spatial_scale", Attribute(c.attr_float("spatial_scale", 1.0))},
                                         {"half_pixel", Attribute(ctm == "half_pixel" ? 1 : 0)}}));
  return c.out(0, y);
}

}  // namespace

void register_nn_ops(HandlerTable& t) {
  t["Conv"] = conv_op;
  t["ConvTranspose"] = conv_transpose_op;
  t["ConvInteger"] = conv_integer_op;
  t["MatMulInteger"] = matmul_integer_op;
  t["QuantizeLinear"] = quantize_op;
  t["DequantizeLinear"] = dequantize_op;
  t["DynamicQuantizeLinear"] = dynamic_quantize_op;
  t["QLinearMatMul"] = qlinear_op;
  t["QLinearConv"] = qlinear_op;
  t["MaxPool"] = pool_op;
  t["AveragePool"] = pool_op;
  t["LpPool"] = lp_pool_op;
  t["GlobalLpPool"] = lp_pool_op;
  t["GlobalAveragePool"] = global_pool_op;
  t["GlobalMaxPool"] = global_pool_op;
  t["BatchNormalization"] = batch_norm_op;
  t["InstanceNormalization"] = instance_norm_op;
  t["LayerNormalization"] = layer_norm_op;
  t["GroupNormalization"] = group_norm_op;
  t["LRN"] = lrn_op;
  t["MeanVarianceNormalization"] = mvn_op;
  t["LpNormalization"] = lp_norm_op;
  t["Dropout"] = dropout_op;
  t["Gemm"] = gemm_op;
  t["MatMul"] = matmul_op;
  t["Resize"] = resize_op;
  t["Det"] = det_op;
  t["GridSample"] = grid_sample_op;
  t["RoiAlign"] = roi_align_op;
  t["Upsample"] = resize_op;
}

}  // namespace kiln::onnx_fe
