// Core loss ops: cross_entropy (logits and integer class targets) and mse_loss, each giving a
// scalar. The autodiff pass has their gradient rules; backends without a lowering run the
// reference kernels (cpu) or see them decomposed.
#include <cmath>
#include <limits>

#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

Status require_reduction(const InferContext& ctx) {
  const std::string r = ctx.node.get_string("reduction");
  if (r != "mean" && r != "sum") return ctx.error("attribute 'reduction' must be \"mean\" or \"sum\", got \"" + r + "\"");
  return ok_status();
}

/// logits [.., C] (classes last), target [..] of the same leading dims.
Status cross_entropy_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kFloatDTypes));
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 1, kSignedIntDTypes | kUnsignedIntDTypes));
  KILN_RETURN_IF_ERROR(require_reduction(ctx));
  const TensorType &logits = ctx.operand(0), &target = ctx.operand(1);
  if (logits.rank() < 1) return ctx.error("operand 'logits' must have rank >= 1 (classes last), got " + logits.str());
  bool ok = target.rank() + 1 == logits.rank();
  for (int64_t d = 0; ok && d < target.rank(); ++d) {
    const Dim &a = target.shape[static_cast<size_t>(d)], &b = logits.shape[static_cast<size_t>(d)];
    ok = !(a.is_static() && b.is_static() && a.value() != b.value());
  }
  if (!ok)
    return ctx.error("operand 'target' " + target.str() + " must have the shape of 'logits' " + logits.str() +
                     " without its last (class) dim");
  ctx.results = {TensorType{logits.dtype, {}}};
  return ok_status();
}

Status cross_entropy_kernel(KernelContext& ctx) {
  const Tensor &logits = ctx.input(0), &target = ctx.input(1);
  const int64_t classes = logits.shape().back();
  const int64_t rows = target.numel();
  const int64_t ignore = ctx.node.get_int("ignore_index");
  const std::vector<double> l = logits.to_f64();
  double total = 0;
  int64_t counted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = target.get_i64(r);
    if (t == ignore) continue;
    if (t < 0 || t >= classes)
      return ctx.error("target " + std::to_string(t) + " at position " + std::to_string(r) + " is out of range [0, " +
                       std::to_string(classes) + ")");
    const double* row = l.data() + r * classes;
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t c = 0; c < classes; ++c) mx = std::max(mx, row[c]);
    double sum = 0;
    for (int64_t c = 0; c < classes; ++c) sum += std::exp(row[c] - mx);
    total += mx + std::log(sum) - row[t];
    ++counted;
  }
  // Every target ignored: the mean is 0/0 = nan, as in PyTorch.
  const bool mean = ctx.node.get_string("reduction") == "mean";
  ctx.output().set_f64(0, mean ? total / static_cast<double>(counted) : total);
  return ok_status();
}

Status mse_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kFloatDTypes));
  KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 0, 1));
  KILN_RETURN_IF_ERROR(require_reduction(ctx));
  const TensorType &a = ctx.operand(0), &b = ctx.operand(1);
  bool ok = a.rank() == b.rank();
  for (int64_t d = 0; ok && d < a.rank(); ++d) {
    const Dim &x = a.shape[static_cast<size_t>(d)], &y = b.shape[static_cast<size_t>(d)];
    ok = !(x.is_static() && y.is_static() && x.value() != y.value());
  }
  if (!ok) return ctx.error("operands 'input' " + a.str() + " and 'target' " + b.str() + " must have the same shape");
  ctx.results = {TensorType{a.dtype, {}}};
  return ok_status();
}

Status mse_kernel(KernelContext& ctx) {
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  double total = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = a.get_f64(i) - b.get_f64(i);
    total += d * d;
  }
  const bool mean = ctx.node.get_string("reduction") == "mean";
  ctx.output().set_f64(0, mean ? total / static_cast<double>(a.numel()) : total);
  return ok_status();
}

AttrSpec reduction_attr() { return attr_default("reduction", Attribute("mean"), "\"mean\" or \"sum\" over the elements"); }

}  // namespace

void register_loss_ops(OpRegistry& r) {
  add_op_or_die(r, {.name = "cross_entropy",
                    .summary = "softmax cross-entropy of logits (classes last) against integer class targets",
                    .traits = kTraitReduction,
                    .inputs = {"logits", "target"},
                    .outputs = {"loss"},
                    .result_rule = "scalar [] of the dtype of logits; target has logits' shape without the last dim",
                    .attrs = {reduction_attr(),
                              attr_default("ignore_index", Attribute(int64_t{-100}),
                                           "targets equal to it count neither in the sum nor in the mean")},
                    .num_regions = 0,
                    .infer = cross_entropy_infer,
                    .reference = cross_entropy_kernel});
  add_op_or_die(r, {.name = "mse_loss",
                    .summary = "squared error (input - target)^2 summed or averaged over every element",
                    .traits = kTraitReduction,
                    .inputs = {"input", "target"},
                    .outputs = {"loss"},
                    .result_rule = "scalar [] of the dtype of input; target has input's shape and dtype",
                    .attrs = {reduction_attr()},
                    .num_regions = 0,
                    .infer = mse_infer,
                    .reference = mse_kernel});
}

}  // namespace kiln
