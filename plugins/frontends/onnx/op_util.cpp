// Small helpers shared by the ONNX op importers: casts, scalars, axes, common decompositions.
#include "op_util.h"

#include <algorithm>
#include <numeric>

namespace kiln::onnx_fe {

int64_t product_of(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

StatusOr<Value*> cast_to(NodeCtx& c, Value* v, DType t) {
  if (v->dtype() == t) return v;
  return c.op("cast", {v}, {{"to", Attribute(t)}});
}

Value* scalar_like(NodeCtx& c, const Value* like, double v) { return c.scalar(like->dtype(), v); }

StatusOr<Value*> with_scalar(NodeCtx& c, const std::string& op, Value* x, double s) {
  return c.op(op, {x, scalar_like(c, x, s)});
}

StatusOr<Value*> reshape(NodeCtx& c, Value* v, const std::vector<int64_t>& shape) {
  return c.op("reshape", {v}, {{"shape", Attribute(shape)}});
}

StatusOr<Value*> transpose(NodeCtx& c, Value* v, const std::vector<int64_t>& perm) {
  bool identity = true;
  for (size_t i = 0; i < perm.size(); ++i) identity &= perm[i] == static_cast<int64_t>(i);
  if (identity) return v;
  return c.op("transpose", {v}, {{"perm", Attribute(perm)}});
}

StatusOr<Value*> unsqueeze(NodeCtx& c, Value* v, const std::vector<int64_t>& axes) {
  if (axes.empty()) return v;
  return c.op("unsqueeze", {v}, {{"axes", Attribute(axes)}});
}

StatusOr<Value*> squeeze(NodeCtx& c, Value* v, const std::vector<int64_t>& axes) {
  if (axes.empty()) return v;
  return c.op("squeeze", {v}, {{"axes", Attribute(axes)}});
}

StatusOr<Value*> slice_axis(NodeCtx& c, Value* v, int64_t axis, int64_t start, int64_t end,
                            int64_t step) {
  return c.op("slice", {v},
              {{"starts", Attribute(std::vector<int64_t>{start})},
               {"ends", Attribute(std::vector<int64_t>{end})},
               {"axes", Attribute(std::vector<int64_t>{axis})},
               {"steps", Attribute(std::vector<int64_t>{step})}});
}

StatusOr<Value*> reduce(NodeCtx& c, const std::string& op, Value* v,
                        const std::vector<int64_t>& axes, bool keepdims) {
  AttrMap attrs{{"keepdims", Attribute(keepdims ? 1 : 0)}};
  if (!axes.empty()) attrs["axes"] = Attribute(axes);
  return c.op(op, {v}, std::move(attrs));
}

StatusOr<int64_t> mul_checked(const NodeCtx& c, int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    return c.error(StatusCode::kOutOfRange, std::to_string(a) + " * " + std::to_string(b) + " overflows int64");
  return r;
}

Status check_range(const NodeCtx& c, const std::string& name, const std::vector<int64_t>& v,
                   int64_t lo, int64_t hi) {
  for (int64_t x : v)
    if (x < lo || x > hi)
      return c.error(StatusCode::kOutOfRange, "'" + name + "' value " + std::to_string(x) + " is outside [" +
                                                  std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return ok_status();
}

Status check_constant_size(const NodeCtx& c, const std::string& what, int64_t rows, int64_t cols) {
  int64_t n = 0;
  const int64_t limit = std::min<int64_t>(c.imp.options().limits.max_tensor_bytes, int64_t{1} << 32) / 8;
  if (rows < 0 || cols < 0 || __builtin_mul_overflow(rows, cols, &n) || n > limit)
    return c.error(StatusCode::kOutOfRange, what + " of " + std::to_string(rows) + " x " + std::to_string(cols) +
                                                " elements exceeds the tensor limit");
  return ok_status();
}

StatusOr<int64_t> norm_axis(const NodeCtx& c, int64_t axis, int64_t rank) {
  if (axis < -rank || axis >= rank)
    return c.error("axis " + std::to_string(axis) + " is out of range for rank " + std::to_string(rank));
  return axis < 0 ? axis + rank : axis;
}

StatusOr<std::vector<int64_t>> norm_axes(const NodeCtx& c, std::vector<int64_t> axes, int64_t rank) {
  for (int64_t& a : axes) {
    KILN_ASSIGN_OR_RETURN(a, norm_axis(c, a, rank));
  }
  std::sort(axes.begin(), axes.end());
  if (std::adjacent_find(axes.begin(), axes.end()) != axes.end())
    return c.error("axes repeat an axis");
  return axes;
}

StatusOr<Value*> one_hot_mask(NodeCtx& c, Value* indices, int64_t depth, int64_t axis) {
  const int64_t rank = indices->type().rank() + 1;
  KILN_RETURN_IF_ERROR(check_constant_size(c, "one-hot depth", depth));
  KILN_ASSIGN_OR_RETURN(Value * idx, cast_to(c, indices, DType::kI64));
  KILN_ASSIGN_OR_RETURN(idx, unsqueeze(c, idx, {axis}));
  std::vector<int64_t> shape(static_cast<size_t>(rank), 1);
  shape[static_cast<size_t>(axis)] = depth;
  std::vector<int64_t> seq(static_cast<size_t>(depth));
  std::iota(seq.begin(), seq.end(), 0);
  Value* range = c.constant(Tensor::from_i64(DType::kI64, shape, seq));
  return c.op("equal", {idx, range});
}

StatusOr<Value*> gather_elements(NodeCtx& c, Value* data, Value* indices, int64_t axis) {
  const int64_t rank = data->type().rank();
  if (axis < 0 || axis >= rank) return c.error("axis " + std::to_string(axis) + " is out of range for rank " + std::to_string(rank));
  if (indices->type().rank() != rank)
    return c.error("indices must have the rank of data (" + std::to_string(rank) + "), got " +
                   indices->type().str());
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> ds, c.static_shape(data, "data"));
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> is, c.static_shape(indices, "indices"));
  // Indices may cover less than data on the other axes: cut data down to them.
  for (int64_t d = 0; d < rank; ++d) {
    if (d == axis || is[static_cast<size_t>(d)] == ds[static_cast<size_t>(d)]) continue;
    if (is[static_cast<size_t>(d)] > ds[static_cast<size_t>(d)])
      return c.error("indices " + indices->type().str() + " exceed data " + data->type().str() +
                     " on axis " + std::to_string(d));
    KILN_ASSIGN_OR_RETURN(data, slice_axis(c, data, d, 0, is[static_cast<size_t>(d)]));
  }
  const int64_t n = ds[static_cast<size_t>(axis)];
  KILN_ASSIGN_OR_RETURN(Value * idx, cast_to(c, indices, DType::kI64));
  KILN_ASSIGN_OR_RETURN(Value * neg, c.op("less", {idx, c.scalar(DType::kI64, 0)}));
  KILN_ASSIGN_OR_RETURN(Value * wrapped, c.op("add", {idx, c.scalar(DType::kI64, static_cast<double>(n))}));
  KILN_ASSIGN_OR_RETURN(idx, c.op("where", {neg, wrapped, idx}));
  KILN_ASSIGN_OR_RETURN(Value * mask, one_hot_mask(c, idx, n, axis + 1));
  const DType dt = data->dtype();
  const DType work = dt == DType::kBool ? DType::kI32 : dt;
  KILN_ASSIGN_OR_RETURN(Value * d, cast_to(c, data, work));
  KILN_ASSIGN_OR_RETURN(d, unsqueeze(c, d, {axis}));
  KILN_ASSIGN_OR_RETURN(Value * picked, c.op("where", {mask, d, c.scalar(work, 0)}));
  KILN_ASSIGN_OR_RETURN(Value * sum, reduce(c, "reduce_sum", picked, {axis + 1}, false));
  return cast_to(c, sum, dt);
}

StatusOr<Value*> apply_along_axis(NodeCtx& c, Value* x, int64_t axis, const Tensor& m) {
  if (axis < 0 || axis >= x->type().rank()) return c.error("axis " + std::to_string(axis) + " is out of range");
  const int64_t rank = x->type().rank();
  std::vector<int64_t> perm(static_cast<size_t>(rank));
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[static_cast<size_t>(axis)], perm.back());
  KILN_ASSIGN_OR_RETURN(Value * xt, transpose(c, x, perm));
  Tensor w(x->dtype(), m.shape());
  for (int64_t i = 0; i < m.numel(); ++i) w.set_f64(i, m.get_f64(i));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("linear", {xt, c.constant(std::move(w))}));
  return transpose(c, y, perm);
}

}  // namespace kiln::onnx_fe
