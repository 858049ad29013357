// Small helpers shared by the ONNX op importers: casts, scalars, axes, common decompositions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "importer.h"

namespace kiln::onnx_fe {

/// Product of sizes (1 for an empty list).
int64_t product_of(const std::vector<int64_t>& v);

/// `v` converted to `t` (no node when it already is).
StatusOr<Value*> cast_to(NodeCtx& c, Value* v, DType t);
/// A scalar constant of `like`'s dtype.
Value* scalar_like(NodeCtx& c, const Value* like, double v);
/// A binary op whose second operand is a scalar of the first's dtype: x `op` s.
StatusOr<Value*> with_scalar(NodeCtx& c, const std::string& op, Value* x, double s);

StatusOr<Value*> reshape(NodeCtx& c, Value* v, const std::vector<int64_t>& shape);
StatusOr<Value*> transpose(NodeCtx& c, Value* v, const std::vector<int64_t>& perm);
StatusOr<Value*> unsqueeze(NodeCtx& c, Value* v, const std::vector<int64_t>& axes);
StatusOr<Value*> squeeze(NodeCtx& c, Value* v, const std::vector<int64_t>& axes);
/// Slice of one axis [start, end) with step.
StatusOr<Value*> slice_axis(NodeCtx& c, Value* v, int64_t axis, int64_t start, int64_t end,
                            int64_t step = 1);
StatusOr<Value*> reduce(NodeCtx& c, const std::string& op, Value* v,
                        const std::vector<int64_t>& axes, bool keepdims);

/// a * b, or an error naming the node when the product overflows int64.
StatusOr<int64_t> mul_checked(const NodeCtx& c, int64_t a, int64_t b);
/// Fails unless every value of attribute (or input) `name` lies in [lo, hi]; window sizes,
/// strides and block sizes are capped this way so that shape arithmetic cannot overflow.
Status check_range(const NodeCtx& c, const std::string& name, const std::vector<int64_t>& v,
                   int64_t lo, int64_t hi);
/// Fails when a constant of `elements` elements (of up to 8 bytes) that the importer is
/// about to build would pass the tensor limit; `what` names it.
Status check_constant_size(const NodeCtx& c, const std::string& what, int64_t rows, int64_t cols = 1);
/// The cap check_range applies to window attributes (kernel, strides, dilations, pads).
inline constexpr int64_t kMaxWindowAttr = int64_t{1} << 20;

/// Maps `axis` into [0, rank) or fails naming the node.
StatusOr<int64_t> norm_axis(const NodeCtx& c, int64_t axis, int64_t rank);
StatusOr<std::vector<int64_t>> norm_axes(const NodeCtx& c, std::vector<int64_t> axes, int64_t rank);

/// Picks elements of `data` along `axis` by per-position `indices` (GatherElements): built
/// from a one-hot comparison, a select and a sum, so it runs on every backend.
StatusOr<Value*> gather_elements(NodeCtx& c, Value* data, Value* indices, int64_t axis);

/// The one-hot mask equal(indices[..., None], arange(depth)) inserted at `axis` of the result.
StatusOr<Value*> one_hot_mask(NodeCtx& c, Value* indices, int64_t depth, int64_t axis);

/// Numpy-style matmul of `x` along `axis` with a constant matrix m [out, in]:
/// y[..., o, ...] = sum_i m[o, i] * x[..., i, ...].
StatusOr<Value*> apply_along_axis(NodeCtx& c, Value* x, int64_t axis, const Tensor& m);

}  // namespace kiln::onnx_fe
