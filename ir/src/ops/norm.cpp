// Core normalization ops: layer_norm, rms_norm, batch_norm (inference form).
#include <cmath>

#include "ops/kernel_util.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

using Sizes = std::vector<int64_t>;

bool dims_conflict(const Dim& a, const Dim& b) {
  return a.is_static() && b.is_static() && a.value() != b.value();
}

/// Checks that every operand is float and has x's dtype.
Status require_float_operands(const InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kFloatDTypes));
  for (int i = 1; i < ctx.num_operands(); ++i) KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 0, i));
  return ok_status();
}

/// layer_norm / rms_norm: normalize over dims [axis, rank); the affine operands must
/// broadcast to those trailing dims.
Status infer_trailing_norm(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_float_operands(ctx));
  const TensorType& x = ctx.operand(0);
  if (x.rank() < 1) return ctx.error("operand 'x' must have rank >= 1, got " + x.str());
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalize_axis(ctx, ctx.node.get_int("axis", -1), x.rank()));
  const Shape trailing(x.shape.begin() + axis, x.shape.end());
  for (int i = 1; i < ctx.num_operands(); ++i) {
    const TensorType& p = ctx.operand(i);
    bool ok = p.rank() <= static_cast<int64_t>(trailing.size());
    for (size_t d = 0; ok && d < p.shape.size(); ++d) {
      const Dim& pd = p.shape[p.shape.size() - 1 - d];
      ok = (pd.is_static() && pd.value() == 1) ||
           !dims_conflict(pd, trailing[trailing.size() - 1 - d]);
    }
    if (!ok)
      return ctx.error("operand '" + operand_name(ctx, i) + "' " + p.str() +
                       " does not broadcast to the normalized dims " + shape_str(trailing));
  }
  if (!(ctx.node.get_float("epsilon") >= 0)) return ctx.error("attribute 'epsilon' must be >= 0");
  ctx.results = {x};
  return ok_status();
}

/// Flat offsets into each affine operand for every element of the trailing dims.
std::vector<Sizes> affine_offsets(const KernelContext& ctx, const Sizes& trailing) {
  std::vector<Sizes> in_shapes;
  for (int i = 1; i < ctx.num_inputs(); ++i) in_shapes.push_back(ctx.input(i).shape());
  std::vector<Sizes> offsets(in_shapes.size());
  BroadcastWalker w(trailing, in_shapes);
  for (int64_t j = 0, n = product(trailing); j < n; ++j, w.next())
    for (size_t k = 0; k < in_shapes.size(); ++k) offsets[k].push_back(w.offset(k));
  return offsets;
}

/// `rms`: y = x / sqrt(mean(x^2) + eps) * scale; else y = (x - mean) / sqrt(var + eps)
/// * scale + bias with the biased variance. Two passes in double.
Status trailing_norm_kernel(KernelContext& ctx, bool rms) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output();
  const int64_t axis = normalize_axis(ctx.node.get_int("axis", -1), x.rank()).value();
  const double eps = ctx.node.get_float("epsilon");
  const Sizes trailing(x.shape().begin() + axis, x.shape().end());
  const int64_t inner = product(trailing);
  if (inner == 0) return ok_status();
  const int64_t outer = x.numel() / inner;
  const std::vector<Sizes> off = affine_offsets(ctx, trailing);
  const std::vector<double> xv = x.to_f64();
  const std::vector<double> scale =
      ctx.num_inputs() > 1 ? ctx.input(1).to_f64() : std::vector<double>();
  const std::vector<double> bias =
      ctx.num_inputs() > 2 ? ctx.input(2).to_f64() : std::vector<double>();
  for (int64_t o = 0; o < outer; ++o) {
    const double* row = xv.data() + o * inner;
    double mean = 0;
    if (!rms) {
      for (int64_t j = 0; j < inner; ++j) mean += row[j];
      mean /= static_cast<double>(inner);
    }
    double sq = 0;
    for (int64_t j = 0; j < inner; ++j) sq += (row[j] - mean) * (row[j] - mean);
    const double inv = 1.0 / std::sqrt(sq / static_cast<double>(inner) + eps);
    for (int64_t j = 0; j < inner; ++j) {
      const size_t ju = static_cast<size_t>(j);
      double v = (row[j] - mean) * inv;
      if (!scale.empty()) v *= scale[static_cast<size_t>(off[0][ju])];
      if (!bias.empty()) v += bias[static_cast<size_t>(off[1][ju])];
      y.set_f64(o * inner + j, v);
    }
  }
  return ok_status();
}

Status infer_batch_norm(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_float_operands(ctx));
  const TensorType& x = ctx.operand(0);
  if (x.rank() < 2) return ctx.error("operand 'x' must be [N, C, ...], got " + x.str());
  for (int i = 1; i < ctx.num_operands(); ++i) {
    const TensorType& p = ctx.operand(i);
    if (p.rank() != 1 || dims_conflict(p.shape[0], x.shape[1]))
      return ctx.error("operand '" + operand_name(ctx, i) + "' must be [C] = [" + x.shape[1].str() +
                       "], got " + p.str());
  }
  if (!(ctx.node.get_float("epsilon") >= 0)) return ctx.error("attribute 'epsilon' must be >= 0");
  ctx.results = {x};
  return ok_status();
}

Status batch_norm_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const double eps = ctx.node.get_float("epsilon");
  const int64_t n = x.shape()[0], c = x.shape()[1];
  const int64_t plane = product(Sizes(x.shape().begin() + 2, x.shape().end()));
  const std::vector<double> xv = x.to_f64(), scale = ctx.input(1).to_f64(),
                            bias = ctx.input(2).to_f64(), mean = ctx.input(3).to_f64(),
                            var = ctx.input(4).to_f64();
  for (int64_t b = 0; b < n; ++b)
    for (int64_t ch = 0; ch < c; ++ch) {
      const size_t cu = static_cast<size_t>(ch);
      const double mul = scale[cu] / std::sqrt(var[cu] + eps);
      const int64_t base = (b * c + ch) * plane;
      for (int64_t j = 0; j < plane; ++j)
        ctx.output().set_f64(base + j,
                             (xv[static_cast<size_t>(base + j)] - mean[cu]) * mul + bias[cu]);
    }
  return ok_status();
}

Status layer_norm_reference(KernelContext& ctx) { return trailing_norm_kernel(ctx, false); }
Status rms_norm_reference(KernelContext& ctx) { return trailing_norm_kernel(ctx, true); }

}  // namespace

void register_norm_ops(OpRegistry& r) {
  const AttrSpec axis = attr_default("axis", int64_t{-1}, "first normalized dim");
  add_op_or_die(r, {.name = "layer_norm",
                    .summary = "normalizes dims [axis, rank) to mean 0, variance 1; scales, shifts",
                    .traits = kTraitReduction,
                    .inputs = {"x", "scale?", "bias?"},
                    .outputs = {"y"},
                    .result_rule = "same as x",
                    .attrs = {axis, attr_default("epsilon", 1e-5, "added to the variance")},
                    .num_regions = 0,
                    .infer = infer_trailing_norm,
                    .reference = layer_norm_reference});
  add_op_or_die(r, {.name = "rms_norm",
                    .summary = "x / sqrt(mean(x^2) + epsilon) * scale over dims [axis, rank)",
                    .traits = kTraitReduction,
                    .inputs = {"x", "scale?"},
                    .outputs = {"y"},
                    .result_rule = "same as x",
                    .attrs = {axis, attr_default("epsilon", 1e-6, "added to the mean square")},
                    .num_regions = 0,
                    .infer = infer_trailing_norm,
                    .reference = rms_norm_reference});
  add_op_or_die(r, {.name = "batch_norm",
                    .summary = "inference batch normalization over dim 1 with given mean, variance",
                    .traits = kTraitReduction,
                    .inputs = {"x", "scale", "bias", "mean", "var"},
                    .outputs = {"y"},
                    .result_rule = "same as x",
                    .attrs = {attr_default("epsilon", 1e-5, "added to the variance")},
                    .num_regions = 0,
                    .infer = infer_batch_norm,
                    .reference = batch_norm_kernel});
}

}  // namespace kiln
