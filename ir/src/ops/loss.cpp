// Core loss ops: cross_entropy (logits and integer class targets) and mse_loss, each giving a
// scalar, and cross_entropy_grad, cross_entropy's gradient with respect to its logits (what the
// autodiff rule emits, so that a backend can lower the backward in one kernel). The autodiff
// pass has their gradient rules; backends without a lowering run the reference kernels (cpu) or
// see them decomposed (decompose-losses).
#include <cmath>
#include <limits>

#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

/// The `dtype` attribute when given (a float), else `fallback`: the loss ops' result dtype.
StatusOr<DType> result_dtype(const InferContext& ctx, DType fallback) {
  const Attribute* a = ctx.node.attr("dtype");
  if (!a) return fallback;
  if (!is_float(a->as_dtype()) || a->as_dtype() == DType::kF8E4M3FN || a->as_dtype() == DType::kF8E5M2)
    return ctx.error("attribute 'dtype' must be f64, f32, f16 or bf16, got " + std::string(dtype_name(a->as_dtype())));
  return a->as_dtype();
}

Status require_reduction(const InferContext& ctx) {
  const std::string r = ctx.node.get_string("reduction");
  if (r != "mean" && r != "sum") return ctx.error("attribute 'reduction' must be \"mean\" or \"sum\", got \"" + r + "\"");
  return ok_status();
}

/// logits [.., C] (classes last), target [..] of the same leading dims.
Status cross_entropy_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kFloatDTypes));
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 1, kSignedIntDTypes | kUnsignedIntDTypes));
  if (ctx.node.op_name() != "cross_entropy_grad") KILN_RETURN_IF_ERROR(require_reduction(ctx));
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
  KILN_ASSIGN_OR_RETURN(const DType dt, result_dtype(ctx, logits.dtype));
  ctx.results = {TensorType{dt, {}}};
  return ok_status();
}

/// cross_entropy_grad(logits, target, dloss): logits and target as cross_entropy's, dloss a
/// float scalar.
Status cross_entropy_grad_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(cross_entropy_infer(ctx));
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 2, kFloatDTypes));
  if (ctx.operand(2).rank() != 0)
    return ctx.error("operand 'dloss' must be a scalar (the gradient of the summed loss), got " + ctx.operand(2).str());
  KILN_ASSIGN_OR_RETURN(const DType dt, result_dtype(ctx, ctx.operand(0).dtype));
  ctx.results = {TensorType{dt, ctx.operand(0).shape}};
  return ok_status();
}

/// cross_entropy_with_grad: cross_entropy_grad's operands; the loss (reduction, dtype) and the
/// gradient (grad_dtype).
Status cross_entropy_with_grad_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(cross_entropy_grad_infer(ctx));
  KILN_RETURN_IF_ERROR(require_reduction(ctx));
  const TensorType grad = ctx.results[0];
  KILN_ASSIGN_OR_RETURN(const DType loss, result_dtype(ctx, ctx.operand(0).dtype));
  DType gt = ctx.operand(0).dtype;
  if (const Attribute* a = ctx.node.attr("grad_dtype")) {
    gt = a->as_dtype();
    if (!is_float(gt) || gt == DType::kF8E4M3FN || gt == DType::kF8E5M2)
      return ctx.error("attribute 'grad_dtype' must be f64, f32, f16 or bf16, got " + std::string(dtype_name(gt)));
  }
  ctx.results = {TensorType{loss, {}}, TensorType{gt, grad.shape}};
  return ok_status();
}

/// Visits the rows of a cross_entropy's logits that count (target != ignore_index) with the
/// row's logits and target, after checking every counted target is a class.
template <typename F>
Status for_each_counted_row(KernelContext& ctx, const std::vector<double>& l, F&& f) {
  const Tensor& target = ctx.input(1);
  const int64_t classes = ctx.input(0).shape().back();
  const int64_t ignore = ctx.node.get_int("ignore_index");
  for (int64_t r = 0; r < target.numel(); ++r) {
    const int64_t t = target.get_i64(r);
    if (t == ignore) continue;
    if (t < 0 || t >= classes)
      return ctx.error("target " + std::to_string(t) + " at position " + std::to_string(r) + " is out of range [0, " +
                       std::to_string(classes) + ")");
    f(r, l.data() + r * classes, t);
  }
  return ok_status();
}

/// log(sum(exp(row))) computed stably.
double log_sum_exp(const double* row, int64_t classes) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < classes; ++c) mx = std::max(mx, row[c]);
  double sum = 0;
  for (int64_t c = 0; c < classes; ++c) sum += std::exp(row[c] - mx);
  return mx + std::log(sum);
}

/// cross_entropy's value into output `out`.
Status cross_entropy_loss(KernelContext& ctx, const std::vector<double>& l, int out) {
  const int64_t classes = ctx.input(0).shape().back();
  double total = 0;
  int64_t counted = 0;
  KILN_RETURN_IF_ERROR(for_each_counted_row(ctx, l, [&](int64_t, const double* row, int64_t t) {
    total += log_sum_exp(row, classes) - row[t];
    ++counted;
  }));
  // Every target ignored: the mean is 0/0 = nan, as in PyTorch.
  const bool mean = ctx.node.get_string("reduction") == "mean";
  ctx.output(out).set_f64(0, mean ? total / static_cast<double>(counted) : total);
  return ok_status();
}

Status cross_entropy_kernel(KernelContext& ctx) { return cross_entropy_loss(ctx, ctx.input(0).to_f64(), 0); }

/// (softmax(row) - onehot(target)) * dloss into output `out`; rows whose target is ignored get 0.
Status cross_entropy_gradient(KernelContext& ctx, const std::vector<double>& l, int o) {
  const int64_t classes = ctx.input(0).shape().back();
  const double scale = ctx.input(2).get_f64(0);
  Tensor& out = ctx.output(o);
  for (int64_t i = 0; i < out.numel(); ++i) out.set_f64(i, 0.0);
  return for_each_counted_row(ctx, l, [&](int64_t r, const double* row, int64_t t) {
    const double lse = log_sum_exp(row, classes);
    for (int64_t c = 0; c < classes; ++c)
      out.set_f64(r * classes + c, (std::exp(row[c] - lse) - (c == t ? 1.0 : 0.0)) * scale);
  });
}

Status cross_entropy_grad_kernel(KernelContext& ctx) { return cross_entropy_gradient(ctx, ctx.input(0).to_f64(), 0); }

Status cross_entropy_with_grad_kernel(KernelContext& ctx) {
  const std::vector<double> l = ctx.input(0).to_f64();
  KILN_RETURN_IF_ERROR(cross_entropy_loss(ctx, l, 0));
  return cross_entropy_gradient(ctx, l, 1);
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

AttrSpec ignore_index_attr() {
  return attr_default("ignore_index", Attribute(int64_t{-100}), "targets equal to it count neither in the sum nor in the mean");
}

}  // namespace

void register_loss_ops(OpRegistry& r) {
  add_op_or_die(r, {.name = "cross_entropy",
                    .summary = "softmax cross-entropy of logits (classes last) against integer class targets",
                    .traits = kTraitReduction,
                    .inputs = {"logits", "target"},
                    .outputs = {"loss"},
                    .result_rule = "scalar [] of the dtype of logits; target has logits' shape without the last dim",
                    .attrs = {reduction_attr(), ignore_index_attr(),
                              attr_optional("dtype", AttrKind::kDType,
                                            "the loss's dtype (default: logits'); the math is f32 or wider either way")},
                    .num_regions = 0,
                    .infer = cross_entropy_infer,
                    .reference = cross_entropy_kernel});
  add_op_or_die(r, {.name = "cross_entropy_grad",
                    .summary = "the gradient of cross_entropy (reduction sum) with respect to its logits: "
                               "(softmax(logits) - onehot(target)) * dloss; rows whose target is ignored get 0",
                    .traits = kTraitReduction,
                    .inputs = {"logits", "target", "dloss"},
                    .outputs = {"grad"},
                    .result_rule = "logits' shape, in dtype (default: logits'); dloss is a float scalar",
                    .attrs = {ignore_index_attr(),
                              attr_optional("dtype", AttrKind::kDType, "the gradient's dtype (default: logits')")},
                    .num_regions = 0,
                    .infer = cross_entropy_grad_infer,
                    .reference = cross_entropy_grad_kernel});
  add_op_or_die(r, {.name = "cross_entropy_with_grad",
                    .summary = "cross_entropy and cross_entropy_grad of the same logits in one op, for a step whose "
                               "loss gradient does not depend on the loss (decompose-losses forms it): the logits are "
                               "read once and need not live on until the backward",
                    .traits = kTraitReduction,
                    .inputs = {"logits", "target", "dloss"},
                    .outputs = {"loss", "grad"},
                    .result_rule = "loss: scalar [] in dtype (default: logits'); grad: logits' shape in grad_dtype "
                                   "(default: logits'); dloss is a float scalar",
                    .attrs = {reduction_attr(), ignore_index_attr(),
                              attr_optional("dtype", AttrKind::kDType, "the loss's dtype (default: logits')"),
                              attr_optional("grad_dtype", AttrKind::kDType, "the gradient's dtype (default: logits')")},
                    .num_regions = 0,
                    .infer = cross_entropy_with_grad_infer,
                    .reference = cross_entropy_with_grad_kernel});
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
