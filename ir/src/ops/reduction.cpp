// Reduction core ops: reduce_sum/mean/max/min/prod, argmax/argmin, softmax, log_softmax.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "ops/kernel_util.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

enum class ReduceKind { kSum, kMean, kMax, kMin, kProd };

/// The axes a reduce_* node reduces, sorted; absent or empty `axes` means all of them.
StatusOr<std::vector<int64_t>> reduced_axes(const InferContext& ctx, int64_t rank) {
  std::vector<int64_t> axes = ctx.node.get_ints("axes");
  if (axes.empty()) {
    for (int64_t d = 0; d < rank; ++d) axes.push_back(d);
    return axes;
  }
  return normalize_axes(ctx, axes, rank);
}

/// Same as reduced_axes for a kernel, whose node the shape rule has already checked.
std::vector<bool> kernel_reduced_mask(const Node& node, int64_t rank) {
  std::vector<int64_t> axes = node.get_ints("axes");
  std::vector<bool> mask(static_cast<size_t>(rank), axes.empty());
  for (int64_t a : axes) mask[static_cast<size_t>(a < 0 ? a + rank : a)] = true;
  return mask;
}

InferFn reduce_infer(ReduceKind kind) {
  return [kind](InferContext& ctx) -> Status {
    KILN_RETURN_IF_ERROR(
        require_dtype(ctx, 0, kind == ReduceKind::kMean ? kFloatDTypes : kNumericDTypes));
    KILN_RETURN_IF_ERROR(require_flag(ctx, "keepdims"));
    const TensorType& x = ctx.operand(0);
    KILN_ASSIGN_OR_RETURN(std::vector<int64_t> axes, reduced_axes(ctx, x.rank()));
    const bool keepdims = ctx.node.get_int("keepdims") != 0;
    Shape out;
    for (int64_t d = 0; d < x.rank(); ++d) {
      const Dim& dim = x.shape[static_cast<size_t>(d)];
      if (std::find(axes.begin(), axes.end(), d) == axes.end()) {
        out.push_back(dim);
        continue;
      }
      if ((kind == ReduceKind::kMax || kind == ReduceKind::kMin) && dim == Dim(0))
        return ctx.error("cannot reduce over axis " + std::to_string(d) +
                         " of size 0: the reduction has no identity");
      if (keepdims) out.push_back(Dim(1));
    }
    ctx.results = {TensorType{x.dtype, std::move(out)}};
    return ok_status();
  };
}

/// Folds `values` into one accumulator per output element: `fold(acc, v)`.
template <typename T, typename Fold>
std::vector<T> fold_reduce(const std::vector<T>& values, const Tensor& x, const Tensor& y,
                           const std::vector<bool>& mask, T init, Fold fold) {
  std::vector<int64_t> kept = x.shape();
  for (size_t d = 0; d < kept.size(); ++d)
    if (mask[d]) kept[d] = 1;
  std::vector<T> acc(static_cast<size_t>(y.numel()), init);
  // Walking the input while broadcasting the kept shape yields each element's output slot.
  BroadcastWalker w(x.shape(), {kept});
  for (int64_t i = 0, n = x.numel(); i < n; ++i, w.next())
    acc[static_cast<size_t>(w.offset(0))] =
        fold(acc[static_cast<size_t>(w.offset(0))], values[static_cast<size_t>(i)]);
  return acc;
}

Status reduce_kernel(KernelContext& ctx, ReduceKind kind) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  const std::vector<bool> mask = kernel_reduced_mask(ctx.node, x.rank());
  const int64_t count = y.numel() == 0 ? 0 : x.numel() / y.numel();
  if (count == 0 && y.numel() > 0 && (kind == ReduceKind::kMax || kind == ReduceKind::kMin))
    return ctx.error("cannot reduce over an empty axis: the reduction has no identity");
  const int64_t n = y.numel();
  if (is_float(x.dtype())) {
    const double inf = std::numeric_limits<double>::infinity();
    const std::vector<double> v = x.to_f64();
    std::vector<double> acc;
    switch (kind) {
      case ReduceKind::kSum:
      case ReduceKind::kMean:
        acc = fold_reduce(v, x, y, mask, 0.0, [](double a, double b) { return a + b; });
        break;
      case ReduceKind::kProd:
        acc = fold_reduce(v, x, y, mask, 1.0, [](double a, double b) { return a * b; });
        break;
      // Once the accumulator is nan, comparisons fail and it stays nan.
      case ReduceKind::kMax:
        acc = fold_reduce(v, x, y, mask, -inf,
                          [](double a, double b) { return std::isnan(b) || b > a ? b : a; });
        break;
      case ReduceKind::kMin:
        acc = fold_reduce(v, x, y, mask, inf,
                          [](double a, double b) { return std::isnan(b) || b < a ? b : a; });
        break;
    }
    for (int64_t i = 0; i < n; ++i) {
      double a = acc[static_cast<size_t>(i)];
      y.set_f64(i, kind == ReduceKind::kMean ? a / static_cast<double>(count) : a);
    }
    return ok_status();
  }
  const std::vector<int64_t> v = x.to_i64();
  std::vector<int64_t> acc;
  switch (kind) {
    case ReduceKind::kSum:
    case ReduceKind::kMean:  // rejected for integers by the shape rule
      acc = fold_reduce<int64_t>(v, x, y, mask, 0, wrap_add);
      break;
    case ReduceKind::kProd: acc = fold_reduce<int64_t>(v, x, y, mask, 1, wrap_mul); break;
    case ReduceKind::kMax:
      acc = fold_reduce(v, x, y, mask, std::numeric_limits<int64_t>::min(),
                        [](int64_t a, int64_t b) { return std::max(a, b); });
      break;
    case ReduceKind::kMin:
      acc = fold_reduce(v, x, y, mask, std::numeric_limits<int64_t>::max(),
                        [](int64_t a, int64_t b) { return std::min(a, b); });
      break;
  }
  for (int64_t i = 0; i < n; ++i) y.set_i64(i, acc[static_cast<size_t>(i)]);
  return ok_status();
}

void register_reduce(OpRegistry& r) {
  struct ReduceDef {
    const char* name;
    const char* summary;
    ReduceKind kind;
  };
  const ReduceDef defs[] = {
      {"reduce_sum", "sum over axes", ReduceKind::kSum},
      {"reduce_mean", "arithmetic mean over axes", ReduceKind::kMean},
      {"reduce_max", "maximum over axes; nan propagates", ReduceKind::kMax},
      {"reduce_min", "minimum over axes; nan propagates", ReduceKind::kMin},
      {"reduce_prod", "product over axes", ReduceKind::kProd},
  };
  for (const ReduceDef& d : defs) {
    const ReduceKind kind = d.kind;
    add_op_or_die(
        r, OpDef{.name = d.name,
                 .summary = d.summary,
                 .traits = kTraitReduction,
                 .inputs = {"x"},
                 .outputs = {"y"},
                 .result_rule = "dtype of x; x's shape without the reduced axes (1 each with keepdims)",
                 .attrs = {attr_optional("axes", AttrKind::kInts,
                                         "axes to reduce, negative from the end; absent or "
                                         "empty reduces all"),
                           attr_default("keepdims", 1, "1 keeps reduced axes with size 1")},
                 .infer = reduce_infer(kind),
                 .reference = [kind](KernelContext& ctx) { return reduce_kernel(ctx, kind); }});
  }
}

/// Splits a shape around `axis` into (product before, size of axis, product after).
struct AxisSplit {
  int64_t outer = 1, len = 1, inner = 1;
};

AxisSplit split_at(const std::vector<int64_t>& shape, int64_t axis) {
  AxisSplit s;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    const int64_t n = shape[static_cast<size_t>(d)];
    if (d < axis)
      s.outer *= n;
    else if (d == axis)
      s.len = n;
    else
      s.inner *= n;
  }
  return s;
}

/// Writes the index of the best value along the split axis. Nan counts as the most extreme
/// value for both argmax and argmin (numpy and torch agree); ties go to the first index
/// unless `last`.
template <typename T>
void arg_reduce(const std::vector<T>& v, Tensor& y, AxisSplit s, bool is_max, bool last) {
  auto better = [is_max](T c, T b) -> int {  // >0 when c beats b, 0 on a tie
    if constexpr (std::is_floating_point_v<T>) {
      if (std::isnan(c) || std::isnan(b)) return std::isnan(c) - std::isnan(b);
    }
    if (c == b) return 0;
    return (c > b) == is_max ? 1 : -1;
  };
  for (int64_t o = 0; o < s.outer; ++o)
    for (int64_t i = 0; i < s.inner; ++i) {
      auto at = [&](int64_t k) { return v[static_cast<size_t>((o * s.len + k) * s.inner + i)]; };
      int64_t best = 0;
      for (int64_t k = 1; k < s.len; ++k) {
        const int cmp = better(at(k), at(best));
        if (cmp > 0 || (cmp == 0 && last)) best = k;
      }
      y.set_i64(o * s.inner + i, best);
    }
}

/// The node's `axis` attribute mapped into [0, rank) (the shape rule has checked it).
int64_t kernel_axis(const Node& node, int64_t rank) {
  const int64_t axis = node.get_int("axis");
  return axis < 0 ? axis + rank : axis;
}

Status arg_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kNumericDTypes));
  KILN_RETURN_IF_ERROR(require_flag(ctx, "keepdims"));
  KILN_RETURN_IF_ERROR(require_flag(ctx, "select_last_index"));
  const TensorType& x = ctx.operand(0);
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalize_axis(ctx, ctx.node.get_int("axis"), x.rank()));
  Shape out = x.shape;
  if (out[static_cast<size_t>(axis)] == Dim(0))
    return ctx.error("cannot take " + ctx.node.op_name() + " over axis " + std::to_string(axis) +
                     " of size 0");
  if (ctx.node.get_int("keepdims") != 0)
    out[static_cast<size_t>(axis)] = Dim(1);
  else
    out.erase(out.begin() + axis);
  ctx.results = {TensorType{DType::kI64, std::move(out)}};
  return ok_status();
}

Status arg_kernel(KernelContext& ctx, bool is_max) {
  const Tensor& x = ctx.input(0);
  const AxisSplit s = split_at(x.shape(), kernel_axis(ctx.node, x.rank()));
  if (s.len == 0 && s.outer * s.inner > 0) return ctx.error("cannot search an axis of size 0");
  const bool last = ctx.node.get_int("select_last_index") != 0;
  if (is_float(x.dtype()))
    arg_reduce(x.to_f64(), ctx.output(0), s, is_max, last);
  else
    arg_reduce(x.to_i64(), ctx.output(0), s, is_max, last);
  return ok_status();
}

void register_arg(OpRegistry& r) {
  for (const bool is_max : {true, false}) {
    add_op_or_die(
        r, OpDef{.name = is_max ? "argmax" : "argmin",
                 .summary = std::string("index of the ") + (is_max ? "largest" : "smallest") +
                            " value along an axis",
                 .traits = kTraitReduction,
                 .inputs = {"x"},
                 .outputs = {"indices"},
                 .result_rule = "i64; x's shape without `axis` (1 with keepdims)",
                 .attrs = {attr_default("axis", 0, "the axis to search, negative from the end"),
                           attr_default("keepdims", 1, "1 keeps the axis with size 1"),
                           attr_default("select_last_index", 0,
                                        "1 returns the last of tied indices, 0 the first")},
                 .infer = arg_infer,
                 .reference = [is_max](KernelContext& ctx) { return arg_kernel(ctx, is_max); }});
  }
}

Status softmax_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kFloatDTypes));
  KILN_RETURN_IF_ERROR(
      normalize_axis(ctx, ctx.node.get_int("axis"), ctx.operand(0).rank()).status());
  ctx.results = {ctx.operand(0)};
  return ok_status();
}

Status softmax_kernel(KernelContext& ctx, bool log) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  const AxisSplit s = split_at(x.shape(), kernel_axis(ctx.node, x.rank()));
  const std::vector<double> v = x.to_f64();
  for (int64_t o = 0; o < s.outer; ++o)
    for (int64_t i = 0; i < s.inner; ++i) {
      auto idx = [&](int64_t k) { return (o * s.len + k) * s.inner + i; };
      auto at = [&](int64_t k) { return v[static_cast<size_t>(idx(k))]; };
      // Subtracting the max keeps exp from overflowing.
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t k = 0; k < s.len; ++k) m = std::max(m, at(k));
      double sum = 0;
      for (int64_t k = 0; k < s.len; ++k) sum += std::exp(at(k) - m);
      for (int64_t k = 0; k < s.len; ++k)
        y.set_f64(idx(k), log ? at(k) - m - std::log(sum) : std::exp(at(k) - m) / sum);
    }
  return ok_status();
}

void register_softmax(OpRegistry& r) {
  for (const bool log : {false, true}) {
    add_op_or_die(
        r, OpDef{.name = log ? "log_softmax" : "softmax",
                 .summary = log ? "log of softmax along an axis, x - max - log(sum(exp(x - max)))"
                                : "exp(x) / sum(exp(x)) along an axis",
                 .traits = kTraitReduction,
                 .inputs = {"x"},
                 .outputs = {"y"},
                 .result_rule = "same as x",
                 .attrs = {attr_default("axis", -1, "the normalized axis, negative from the end")},
                 .infer = softmax_infer,
                 .reference = [log](KernelContext& ctx) { return softmax_kernel(ctx, log); }});
  }
}

}  // namespace

void register_reduction_ops(OpRegistry& r) {
  register_reduce(r);
  register_arg(r);
  register_softmax(r);
}

}  // namespace kiln
