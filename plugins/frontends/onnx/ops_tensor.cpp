// ONNX shape, data-movement and indexing ops: reshape, slice, gather, pad, tile, one-hot, ...
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>

#include "op_util.h"

namespace kiln::onnx_fe {
namespace {

using Sizes = std::vector<int64_t>;

Status reshape_op(NodeCtx& c) {
  Value* x = c.in(0);
  Sizes shape;
  if (c.opset < 5) shape = c.attr_ints("shape");
  else {
    KILN_ASSIGN_OR_RETURN(shape, c.const_ints(1, "shape"));
  }
  const bool allowzero = c.attr_int("allowzero", 0) != 0;
  if (allowzero && std::find(shape.begin(), shape.end(), 0) != shape.end()) {
    // A literal 0 dim: the result is empty, so its (absent) values need no computation.
    KILN_ASSIGN_OR_RETURN(Sizes in, c.static_shape(x, "data"));
    if (product_of(in) != 0 || std::find(shape.begin(), shape.end(), -1) != shape.end())
      return c.error("cannot reshape " + x->type().str() + " to " + shape_str(shape_of(shape)) +
                     " with allowzero");
    return c.out(0, c.constant(Tensor(x->dtype(), shape)));
  }
  Sizes sized;
  for (int64_t d : shape)
    if (d > 0) sized.push_back(d);
  auto n = checked_numel(sized, "reshape target");
  if (!n.ok()) return c.error(StatusCode::kOutOfRange, n.status().message());
  KILN_ASSIGN_OR_RETURN(Value * y, reshape(c, x, shape));
  return c.out(0, y);
}

Status flatten_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("flatten", {c.in(0)}, {{"axis", Attribute(c.attr_int("axis", 1))}}));
  return c.out(0, y);
}

Status transpose_op(NodeCtx& c) {
  AttrMap attrs;
  if (c.has_attr("perm")) attrs["perm"] = Attribute(c.attr_ints("perm"));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("transpose", {c.in(0)}, std::move(attrs)));
  return c.out(0, y);
}

/// Axes of Squeeze/Unsqueeze: an attribute before opset 13, an input from 13.
StatusOr<std::optional<Sizes>> sq_axes(NodeCtx& c) {
  if (c.opset < 13) {
    if (!c.has_attr("axes")) return std::optional<Sizes>();
    return std::optional<Sizes>(c.attr_ints("axes"));
  }
  if (!c.has_input(1)) return std::optional<Sizes>();
  KILN_ASSIGN_OR_RETURN(Sizes a, c.const_ints(1, "axes"));
  return std::optional<Sizes>(a);
}

Status squeeze_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(std::optional<Sizes> axes, sq_axes(c));
  AttrMap attrs;
  if (axes) attrs["axes"] = Attribute(*axes);
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("squeeze", {c.in(0)}, std::move(attrs)));
  return c.out(0, y);
}

Status unsqueeze_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(std::optional<Sizes> axes, sq_axes(c));
  if (!axes) return c.error("axes are required");
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("unsqueeze", {c.in(0)}, {{"axes", Attribute(*axes)}}));
  return c.out(0, y);
}

Status concat_op(NodeCtx& c) {
  std::vector<Value*> xs;
  for (int i = 0; i < c.num_inputs(); ++i)
    if (c.has_input(i)) xs.push_back(c.in(i));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("concat", xs, {{"axis", Attribute(c.attr_int("axis", 0))}}));
  return c.out(0, y);
}

Status split_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(int64_t axis, norm_axis(c, c.attr_int("axis", 0), x->type().rank()));
  Sizes sizes;
  if (c.opset >= 13 && c.has_input(1)) {
    KILN_ASSIGN_OR_RETURN(sizes, c.const_ints(1, "split"));
  } else if (c.opset < 13 && c.has_attr("split")) {
    sizes = c.attr_ints("split");
  } else {
    const Dim& d = x->shape()[static_cast<size_t>(axis)];
    if (!d.is_static()) return c.error("cannot split symbolic dim " + d.str() + " into equal parts");
    const int64_t n = c.has_attr("num_outputs") ? c.attr_int("num_outputs", 1) : c.num_outputs();
    if (n != c.num_outputs())
      return c.error("num_outputs " + std::to_string(n) + " differs from the node's " +
                     std::to_string(c.num_outputs()) + " outputs");
    if (n <= 0) return c.error("the number of outputs must be positive");
    // Equal parts; with num_outputs (opset 18) the last part may be smaller.
    const int64_t part = c.has_attr("num_outputs") ? (d.value() + n - 1) / n : d.value() / n;
    if (!c.has_attr("num_outputs") && part * n != d.value())
      return c.error("cannot split dim " + d.str() + " into " + std::to_string(n) + " equal parts");
    int64_t left = d.value();
    for (int64_t i = 0; i < n; ++i) {
      sizes.push_back(std::min(part, left));
      left -= sizes.back();
    }
  }
  if (static_cast<int>(sizes.size()) != c.num_outputs())
    return c.error("split into " + std::to_string(sizes.size()) + " parts but the node has " +
                   std::to_string(c.num_outputs()) + " outputs");
  KILN_ASSIGN_OR_RETURN(auto ys, c.op_n("split", {x}, {{"axis", Attribute(axis)}, {"sizes", Attribute(sizes)}},
                                        static_cast<int>(sizes.size())));
  for (size_t i = 0; i < ys.size(); ++i) KILN_RETURN_IF_ERROR(c.out(static_cast<int>(i), ys[i]));
  return ok_status();
}

Status slice_op(NodeCtx& c) {
  Sizes starts, ends, axes, steps;
  if (c.opset < 10) {
    starts = c.attr_ints("starts");
    ends = c.attr_ints("ends");
    axes = c.attr_ints("axes");
  } else {
    KILN_ASSIGN_OR_RETURN(starts, c.const_ints(1, "starts"));
    KILN_ASSIGN_OR_RETURN(ends, c.const_ints(2, "ends"));
    if (c.has_input(3)) {
      KILN_ASSIGN_OR_RETURN(axes, c.const_ints(3, "axes"));
    }
    if (c.has_input(4)) {
      KILN_ASSIGN_OR_RETURN(steps, c.const_ints(4, "steps"));
    }
  }
  AttrMap attrs{{"starts", Attribute(starts)}, {"ends", Attribute(ends)}};
  if (!axes.empty()) attrs["axes"] = Attribute(axes);
  if (!steps.empty()) attrs["steps"] = Attribute(steps);
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("slice", {c.in(0)}, std::move(attrs)));
  return c.out(0, y);
}

Status gather_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("gather", {c.in(0), c.in(1)}, {{"axis", Attribute(c.attr_int("axis", 0))}}));
  return c.out(0, y);
}

Status gather_elements_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(int64_t axis, norm_axis(c, c.attr_int("axis", 0), x->type().rank()));
  KILN_ASSIGN_OR_RETURN(Value * y, gather_elements(c, x, c.in(1), axis));
  return c.out(0, y);
}

Status gather_nd_op(NodeCtx& c) {
  Value* data = c.in(0);
  Value* indices = c.in(1);
  const int64_t b = c.attr_int("batch_dims", 0);
  KILN_ASSIGN_OR_RETURN(Sizes ds, c.static_shape(data, "data"));
  KILN_ASSIGN_OR_RETURN(Sizes is, c.static_shape(indices, "indices"));
  const int64_t r = static_cast<int64_t>(ds.size()), q = static_cast<int64_t>(is.size());
  if (q < 1 || b < 0 || b >= std::min(r, q)) return c.error("invalid batch_dims " + std::to_string(b));
  const int64_t k = is.back();
  if (k < 1 || b + k > r) return c.error("indices' last dim " + std::to_string(k) + " does not fit data " + data->type().str());
  // Flatten data's batch and indexed dims into one, and turn each index tuple into a row.
  int64_t batch = 1, block = 1;
  for (int64_t d = 0; d < b; ++d) batch *= ds[static_cast<size_t>(d)];
  Sizes dims, strides(static_cast<size_t>(k));
  for (int64_t j = 0; j < k; ++j) dims.push_back(ds[static_cast<size_t>(b + j)]);
  for (int64_t j = k - 1; j >= 0; --j) {
    strides[static_cast<size_t>(j)] = block;
    block *= dims[static_cast<size_t>(j)];
  }
  Sizes flat_shape{batch * block};
  flat_shape.insert(flat_shape.end(), ds.begin() + b + k, ds.end());
  KILN_ASSIGN_OR_RETURN(Value * flat, reshape(c, data, flat_shape));
  KILN_ASSIGN_OR_RETURN(Value * idx, cast_to(c, indices, DType::kI64));
  Value* dimv = c.ints(dims);
  KILN_ASSIGN_OR_RETURN(Value * neg, c.op("less", {idx, c.scalar(DType::kI64, 0)}));
  KILN_ASSIGN_OR_RETURN(Value * wrapped, c.op("add", {idx, dimv}));
  KILN_ASSIGN_OR_RETURN(idx, c.op("where", {neg, wrapped, idx}));
  KILN_ASSIGN_OR_RETURN(idx, c.op("mul", {idx, c.ints(strides)}));
  KILN_ASSIGN_OR_RETURN(Value * lin, reduce(c, "reduce_sum", idx, {q - 1}, false));
  if (b > 0) {
    Sizes off_shape(is.begin(), is.end() - 1);
    for (int64_t d = b; d < q - 1; ++d) off_shape[static_cast<size_t>(d)] = 1;
    Sizes offs(static_cast<size_t>(batch));
    for (int64_t i = 0; i < batch; ++i) offs[static_cast<size_t>(i)] = i * block;
    KILN_ASSIGN_OR_RETURN(lin, c.op("add", {lin, c.constant(Tensor::from_i64(DType::kI64, off_shape, offs))}));
  }
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("gather", {flat, lin}, {{"axis", Attribute(0)}}));
  return c.out(0, y);
}

Status expand_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Sizes shape, c.const_ints(1, "shape"));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("expand", {c.in(0)}, {{"shape", Attribute(shape)}}));
  return c.out(0, y);
}

Status pad_op(NodeCtx& c) {
  Value* x = c.in(0);
  const int64_t rank = x->type().rank();
  const std::string mode = c.attr_string("mode", "constant");
  if (mode != "constant" && mode != "reflect" && mode != "edge")
    return c.error(StatusCode::kUnimplemented, "pad mode '" + mode + "' is not supported");
  Sizes pads;
  double value = 0;
  if (c.opset < 11) {
    pads = c.attr_ints(c.opset < 2 ? "paddings" : "pads");
    value = c.attr_float("value", 0.0);
  } else {
    KILN_ASSIGN_OR_RETURN(pads, c.const_ints(1, "pads"));
    if (c.has_input(2)) {
      KILN_ASSIGN_OR_RETURN(Tensor v, c.const_input(2, "constant_value"));
      if (v.numel() != 1) return c.error("constant_value must hold one value");
      value = v.get_f64(0);
    }
    if (c.has_input(3)) {
      KILN_ASSIGN_OR_RETURN(Sizes axes, c.const_ints(3, "axes"));
      KILN_ASSIGN_OR_RETURN(Sizes norm, norm_axes(c, axes, rank));
      if (pads.size() != 2 * axes.size())
        return c.error("pads must have 2 values per axis, got " + std::to_string(pads.size()));
      Sizes full(static_cast<size_t>(2 * rank), 0);
      for (size_t i = 0; i < axes.size(); ++i) {
        int64_t a = axes[i] < 0 ? axes[i] + rank : axes[i];
        full[static_cast<size_t>(a)] = pads[i];
        full[static_cast<size_t>(a + rank)] = pads[i + axes.size()];
      }
      pads = full;
    }
  }
  KILN_RETURN_IF_ERROR(check_range(c, "pads", pads, -(int64_t{1} << 40), int64_t{1} << 40));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("pad", {x}, {{"pads", Attribute(pads)}, {"mode", Attribute(mode)},
                                                     {"value", Attribute(value)}}));
  return c.out(0, y);
}

Status identity_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("identity", {c.in(0)}));
  return c.out(0, y);
}

Status shape_op(NodeCtx& c) {
  Value* x = c.in(0);
  const int64_t rank = x->type().rank();
  int64_t start = c.attr_int("start", 0), end = c.attr_int("end", rank);
  if (start < 0) start += rank;
  if (end < 0) end += rank;
  start = std::clamp<int64_t>(start, 0, rank);
  end = std::clamp<int64_t>(end, 0, rank);
  Sizes dims;
  for (int64_t d = start; d < end; ++d) {
    const Dim& dim = x->shape()[static_cast<size_t>(d)];
    if (!dim.is_static())
      return c.error("shape of " + x->type().str() + " has symbolic dim " + dim.str() +
                     "; kiln folds Shape at import and needs static dims (the front end option "
                     "dims=" + dim.symbol_name() + "=SIZE gives one)");
    dims.push_back(dim.value());
  }
  return c.out(0, c.ints(dims));
}

Status size_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Sizes s, c.static_shape(c.in(0), "input"));
  return c.out(0, c.constant(Tensor::scalar_i64(DType::kI64, product_of(s))));
}

/// A tensor of `shape` filled with element 0 of `value`.
StatusOr<Tensor> filled(NodeCtx& c, const Sizes& shape, const Tensor& value) {
  KILN_ASSIGN_OR_RETURN(int64_t n, checked_numel(shape, c.where() + ": shape"));
  if (dtype_storage_bytes(value.dtype(), n) > c.imp.options().limits.max_tensor_bytes || n > (int64_t{1} << 40))
    return c.error(StatusCode::kOutOfRange, "shape " + shape_str(shape_of(shape)) + " exceeds the tensor limit");
  Tensor t(value.dtype(), shape);
  if (value.numel() != 1) return c.error("value must hold exactly one element");
  const bool fl = is_float(value.dtype());
  const double f = fl ? value.get_f64(0) : 0;
  const int64_t i = fl ? 0 : value.get_i64(0);
  for (int64_t k = 0; k < n; ++k) {
    if (fl) t.set_f64(k, f);
    else t.set_i64(k, i);
  }
  return t;
}

Status constant_of_shape_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Sizes shape, c.const_ints(0, "shape"));
  Tensor value = Tensor::scalar_f64(DType::kF32, 0);
  if (c.has_attr("value")) {
    KILN_ASSIGN_OR_RETURN(value, c.attr_tensor("value"));
  }
  KILN_ASSIGN_OR_RETURN(Tensor t, filled(c, shape, value));
  return c.out(0, c.constant(std::move(t)));
}

Status constant_op(NodeCtx& c) {
  Tensor t;
  if (c.has_attr("value")) {
    KILN_ASSIGN_OR_RETURN(t, c.attr_tensor("value"));
  } else if (c.has_attr("value_float")) {
    t = Tensor::scalar_f64(DType::kF32, c.attr_float("value_float", 0));
  } else if (c.has_attr("value_floats")) {
    const std::vector<double> v = c.attr_floats("value_floats");
    t = Tensor::from_f64(DType::kF32, {static_cast<int64_t>(v.size())}, v);
  } else if (c.has_attr("value_int")) {
    t = Tensor::scalar_i64(DType::kI64, c.attr_int("value_int", 0));
  } else if (c.has_attr("value_ints")) {
    const Sizes v = c.attr_ints("value_ints");
    t = Tensor::from_i64(DType::kI64, {static_cast<int64_t>(v.size())}, v);
  } else if (c.has_attr("sparse_value")) {
    return c.error(StatusCode::kUnimplemented, "sparse constants are not supported");
  } else {
    return c.error(StatusCode::kUnimplemented, "constant has no value kiln can read (strings are not supported)");
  }
  return c.out(0, c.constant(std::move(t)));
}

Status range_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Tensor start, c.const_input(0, "start"));
  KILN_ASSIGN_OR_RETURN(Tensor limit, c.const_input(1, "limit"));
  KILN_ASSIGN_OR_RETURN(Tensor delta, c.const_input(2, "delta"));
  const DType t = start.dtype();
  const double s = start.get_f64(0), l = limit.get_f64(0), d = delta.get_f64(0);
  if (d == 0) return c.error("delta must not be zero");
  const double count = std::max(std::ceil((l - s) / d), 0.0);
  if (!(count <= static_cast<double>(c.imp.options().limits.max_tensor_bytes)))
    return c.error(StatusCode::kOutOfRange, "range of " + std::to_string(count) + " elements exceeds the limit");
  const int64_t n = static_cast<int64_t>(count);
  // Onnx's reference accumulates start + i * delta in the element type.
  Tensor out(t, {n});
  for (int64_t i = 0; i < n; ++i) {
    if (is_float(t)) out.set_f64(i, s + static_cast<double>(i) * d);
    else  // wrapping arithmetic: the count bounds the values, int64 overflow stays defined
      out.set_i64(i, static_cast<int64_t>(static_cast<uint64_t>(start.get_i64(0)) +
                                          static_cast<uint64_t>(i) * static_cast<uint64_t>(delta.get_i64(0))));
  }
  return c.out(0, c.constant(std::move(out)));
}

Status tile_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Sizes reps, c.const_ints(1, "repeats"));
  KILN_ASSIGN_OR_RETURN(Sizes shape, c.static_shape(x, "input"));
  if (reps.size() != shape.size())
    return c.error("repeats has " + std::to_string(reps.size()) + " values for rank " + std::to_string(shape.size()));
  // [d0, d1] → [1, d0, 1, d1] → expand to [r0, d0, r1, d1] → [r0*d0, r1*d1].
  Sizes inter, expanded, out;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (reps[i] < 0) return c.error("repeats must not be negative");
    inter.insert(inter.end(), {1, shape[i]});
    expanded.insert(expanded.end(), {reps[i], shape[i]});
    KILN_ASSIGN_OR_RETURN(int64_t o, mul_checked(c, reps[i], shape[i]));
    out.push_back(o);
  }
  auto total = checked_numel(out, "tiled shape " + shape_str(shape_of(out)));
  if (!total.ok()) return c.error(StatusCode::kOutOfRange, total.status().message());
  KILN_ASSIGN_OR_RETURN(Value * y, reshape(c, x, inter));
  KILN_ASSIGN_OR_RETURN(y, c.op("expand", {y}, {{"shape", Attribute(expanded)}}));
  KILN_ASSIGN_OR_RETURN(y, reshape(c, y, out));
  return c.out(0, y);
}

Status eye_like_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Sizes s, c.static_shape(x, "input"));
  if (s.size() != 2) return c.error("input must be 2-D, got " + x->type().str());
  DType dt = x->dtype();
  if (c.has_attr("dtype")) {
    KILN_ASSIGN_OR_RETURN(dt, kiln_dtype(static_cast<int>(c.attr_int("dtype", 1)), "attribute 'dtype'"));
  }
  // Offsets beyond the matrix leave it all zeros (and keep i + k from overflowing).
  const int64_t k = std::clamp<int64_t>(c.attr_int("k", 0), -s[0], s[1]);
  Tensor t(dt, s);
  for (int64_t i = 0; i < s[0]; ++i)
    if (i + k >= 0 && i + k < s[1]) t.set_i64(i * s[1] + i + k, 1);
  return c.out(0, c.constant(std::move(t)));
}

Status trilu_op(NodeCtx& c) {
  Value* x = c.in(0);
  int64_t k = 0;
  if (c.has_input(1)) {
    KILN_ASSIGN_OR_RETURN(Sizes kv, c.const_ints(1, "k"));
    if (kv.size() != 1) return c.error("k must hold one value");
    k = kv[0];
  }
  const bool upper = c.attr_int("upper", 1) != 0;
  const Shape& sh = x->shape();
  if (sh.size() < 2 || !sh[sh.size() - 1].is_static() || !sh[sh.size() - 2].is_static())
    return c.error("input must have static last two dims, got " + x->type().str());
  const int64_t n = sh[sh.size() - 2].value(), m = sh[sh.size() - 1].value();
  KILN_RETURN_IF_ERROR(check_constant_size(c, "trilu mask", n, m));
  Tensor mask(DType::kBool, {n, m});
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) mask.set_i64(i * m + j, upper ? (j - i >= k) : (j - i <= k));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("where", {c.constant(std::move(mask)), x, scalar_like(c, x, 0)}));
  return c.out(0, y);
}

Status one_hot_op(NodeCtx& c) {
  Value* indices = c.in(0);
  KILN_ASSIGN_OR_RETURN(Tensor dt, c.const_input(1, "depth"));
  if (dt.numel() != 1) return c.error("depth must hold one value");
  const int64_t depth = static_cast<int64_t>(dt.get_f64(0));
  if (depth < 1) return c.error("depth must be positive, got " + std::to_string(depth));
  const int64_t rank = indices->type().rank() + 1;
  KILN_ASSIGN_OR_RETURN(int64_t axis, norm_axis(c, c.attr_int("axis", -1), rank));
  KILN_ASSIGN_OR_RETURN(Value * idx, cast_to(c, indices, DType::kI64));
  KILN_ASSIGN_OR_RETURN(Value * neg, c.op("less", {idx, c.scalar(DType::kI64, 0)}));
  KILN_ASSIGN_OR_RETURN(Value * wrapped, c.op("add", {idx, c.scalar(DType::kI64, static_cast<double>(depth))}));
  KILN_ASSIGN_OR_RETURN(idx, c.op("where", {neg, wrapped, idx}));
  KILN_ASSIGN_OR_RETURN(Value * mask, one_hot_mask(c, idx, depth, axis));
  Value* values = c.in(2);
  KILN_ASSIGN_OR_RETURN(Value * off, slice_axis(c, values, 0, 0, 1));
  KILN_ASSIGN_OR_RETURN(Value * on, slice_axis(c, values, 0, 1, 2));
  KILN_ASSIGN_OR_RETURN(off, reshape(c, off, {}));
  KILN_ASSIGN_OR_RETURN(on, reshape(c, on, {}));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("where", {mask, on, off}));
  return c.out(0, y);
}

Status depth_space_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Sizes s, c.static_shape(x, "input"));
  if (s.size() != 4) return c.error("input must be 4-D [N, C, H, W], got " + x->type().str());
  const int64_t b = c.attr_int("blocksize", 0);
  KILN_RETURN_IF_ERROR(check_range(c, "blocksize", {b}, 1, kMaxWindowAttr));
  const int64_t n = s[0], ch = s[1], h = s[2], w = s[3];
  Value* y = nullptr;
  if (c.proto.op_type() == "DepthToSpace") {
    if (ch % (b * b) != 0) return c.error("channels " + std::to_string(ch) + " are not divisible by blocksize^2");
    const bool crd = c.attr_string("mode", "DCR") == "CRD";
    KILN_ASSIGN_OR_RETURN(y, reshape(c, x, crd ? Sizes{n, ch / (b * b), b, b, h, w} : Sizes{n, b, b, ch / (b * b), h, w}));
    KILN_ASSIGN_OR_RETURN(y, transpose(c, y, crd ? Sizes{0, 1, 4, 2, 5, 3} : Sizes{0, 3, 4, 1, 5, 2}));
    KILN_ASSIGN_OR_RETURN(y, reshape(c, y, {n, ch / (b * b), h * b, w * b}));
  } else {
    if (h % b != 0 || w % b != 0) return c.error("spatial dims are not divisible by blocksize");
    KILN_ASSIGN_OR_RETURN(y, reshape(c, x, {n, ch, h / b, b, w / b, b}));
    KILN_ASSIGN_OR_RETURN(y, transpose(c, y, {0, 3, 5, 1, 2, 4}));
    KILN_ASSIGN_OR_RETURN(y, reshape(c, y, {n, ch * b * b, h / b, w / b}));
  }
  return c.out(0, y);
}

Status compress_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Tensor cond, c.const_input(1, "condition"));
  Sizes picked;
  for (int64_t i = 0; i < cond.numel(); ++i)
    if (cond.get_i64(i) != 0) picked.push_back(i);
  int64_t axis = 0;
  if (c.has_attr("axis")) {
    KILN_ASSIGN_OR_RETURN(axis, norm_axis(c, c.attr_int("axis", 0), x->type().rank()));
  } else {
    KILN_ASSIGN_OR_RETURN(x, reshape(c, x, {-1}));
  }
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("gather", {x, c.ints(picked)}, {{"axis", Attribute(axis)}}));
  return c.out(0, y);
}

Status cumsum_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Sizes av, c.const_ints(1, "axis"));
  if (av.size() != 1) return c.error("axis must hold one value");
  KILN_ASSIGN_OR_RETURN(int64_t axis, norm_axis(c, av[0], x->type().rank()));
  const Dim& d = x->shape()[static_cast<size_t>(axis)];
  if (!d.is_static()) return c.error("cumsum needs a static size on its axis");
  const int64_t n = d.value();
  KILN_RETURN_IF_ERROR(check_constant_size(c, "cumsum matrix", n, n));
  const bool excl = c.attr_int("exclusive", 0) != 0, rev = c.attr_int("reverse", 0) != 0;
  // y[o] = sum of x[i] over i <= o (i >= o when reversed; strict when exclusive).
  Tensor m(DType::kF64, {n, n});
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = 0; i < n; ++i) {
      const bool in = rev ? (excl ? i > o : i >= o) : (excl ? i < o : i <= o);
      m.set_f64(o * n + i, in ? 1 : 0);
    }
  KILN_ASSIGN_OR_RETURN(Value * y, apply_along_axis(c, x, axis, m));
  return c.out(0, y);
}

Status reverse_sequence_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Sizes s, c.static_shape(x, "input"));
  const int64_t rank = static_cast<int64_t>(s.size());
  KILN_ASSIGN_OR_RETURN(int64_t bax, norm_axis(c, c.attr_int("batch_axis", 1), rank));
  KILN_ASSIGN_OR_RETURN(int64_t tax, norm_axis(c, c.attr_int("time_axis", 0), rank));
  const int64_t t = s[static_cast<size_t>(tax)], b = s[static_cast<size_t>(bax)];
  // Source time index: len - 1 - t inside each sequence, t past its end.
  Sizes tshape(static_cast<size_t>(rank), 1), bshape(static_cast<size_t>(rank), 1);
  tshape[static_cast<size_t>(tax)] = t;
  bshape[static_cast<size_t>(bax)] = b;
  Sizes seq(static_cast<size_t>(t));
  std::iota(seq.begin(), seq.end(), 0);
  Value* tv = c.constant(Tensor::from_i64(DType::kI64, tshape, seq));
  KILN_ASSIGN_OR_RETURN(Value * len, cast_to(c, c.in(1), DType::kI64));
  KILN_ASSIGN_OR_RETURN(len, reshape(c, len, bshape));
  KILN_ASSIGN_OR_RETURN(Value * inside, c.op("less", {tv, len}));
  KILN_ASSIGN_OR_RETURN(Value * rev, c.op("sub", {len, tv}));
  KILN_ASSIGN_OR_RETURN(rev, with_scalar(c, "sub", rev, 1));
  KILN_ASSIGN_OR_RETURN(Value * idx, c.op("where", {inside, rev, tv}));
  KILN_ASSIGN_OR_RETURN(idx, c.op("expand", {idx}, {{"shape", Attribute(s)}}));
  KILN_ASSIGN_OR_RETURN(Value * y, gather_elements(c, x, idx, tax));
  return c.out(0, y);
}

Status scatter_op(NodeCtx& c) {
  const std::string& op = c.proto.op_type();
  AttrMap attrs{{"reduction", Attribute(c.attr_string("reduction", "none"))}};
  if (op != "ScatterND") attrs["axis"] = Attribute(c.attr_int("axis", 0));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op(op == "ScatterND" ? "scatter_nd" : "scatter_elements",
                                        {c.in(0), c.in(1), c.in(2)}, std::move(attrs)));
  return c.out(0, y);
}

Status top_k_op(NodeCtx& c) {
  Value* x = c.in(0);
  int64_t k = 0;
  if (c.opset < 10) {
    k = c.attr_int("k", 0);
  } else {
    KILN_ASSIGN_OR_RETURN(Sizes kv, c.const_ints(1, "k"));
    if (kv.size() != 1) return c.error("k must hold one value");
    k = kv[0];
  }
  KILN_ASSIGN_OR_RETURN(auto ys, c.op_n("top_k", {x},
                                        {{"k", Attribute(k)}, {"axis", Attribute(c.attr_int("axis", -1))},
                                         {"largest", Attribute(c.attr_int("largest", 1))},
                                         {"sorted", Attribute(c.attr_int("sorted", 1))}},
                                        2));
  KILN_RETURN_IF_ERROR(c.out(0, ys[0]));
  return c.out(1, ys[1]);
}

// --- einsum ----------------------------------------------------------------------------

/// Einsum as broadcast products and sums: each operand's letters are laid out in one global
/// order (missing letters become size-1 dims), the operands multiplied, and the letters not
/// in the output summed away. Repeated letters within an operand take its diagonal.
Status einsum_op(NodeCtx& c) {
  std::string eq;
  for (char ch : c.attr_string("equation", ""))
    if (ch != ' ') eq += ch;
  const size_t arrow = eq.find("->");
  const std::string lhs = eq.substr(0, arrow);
  std::vector<std::string> terms;
  for (size_t p = 0;;) {
    const size_t q = lhs.find(',', p);
    terms.push_back(lhs.substr(p, q == std::string::npos ? std::string::npos : q - p));
    if (q == std::string::npos) break;
    p = q + 1;
  }
  if (static_cast<int>(terms.size()) != c.num_inputs())
    return c.error("equation '" + eq + "' names " + std::to_string(terms.size()) + " operands, node has " +
                   std::to_string(c.num_inputs()));
  // Letters as ints; ellipsis dims become 256 + k (counted from the right of the ellipsis).
  int64_t ell_rank = 0;
  std::vector<std::vector<int>> labels;
  for (size_t t = 0; t < terms.size(); ++t) {
    const std::string& term = terms[t];
    const int64_t rank = c.in(static_cast<int>(t))->type().rank();
    std::vector<int> l;
    const size_t e = term.find("...");
    const int64_t named = static_cast<int64_t>(term.size()) - (e == std::string::npos ? 0 : 3);
    if (e == std::string::npos && named != rank)
      return c.error("term '" + term + "' does not match operand rank " + std::to_string(rank));
    const int64_t er = e == std::string::npos ? 0 : rank - named;
    if (er < 0) return c.error("term '" + term + "' has more letters than operand rank " + std::to_string(rank));
    ell_rank = std::max(ell_rank, er);
    for (size_t i = 0; i < term.size(); ++i) {
      if (i == e) {
        for (int64_t k = 0; k < er; ++k) l.push_back(static_cast<int>(256 + er - 1 - k));
        i += 2;
        continue;
      }
      if (!std::isalpha(static_cast<unsigned char>(term[i]))) return c.error("bad letter in equation '" + eq + "'");
      l.push_back(term[i]);
    }
    labels.push_back(l);
  }
  std::vector<int> out;
  if (arrow != std::string::npos) {
    const std::string rhs = eq.substr(arrow + 2);
    for (size_t i = 0; i < rhs.size(); ++i) {
      if (rhs.compare(i, 3, "...") == 0) {
        for (int64_t k = ell_rank - 1; k >= 0; --k) out.push_back(static_cast<int>(256 + k));
        i += 2;
      } else {
        out.push_back(rhs[i]);
      }
    }
  } else {
    // Implicit output: the ellipsis, then letters used once, alphabetically.
    std::map<int, int> count;
    for (const auto& l : labels)
      for (int x : l) ++count[x];
    for (int64_t k = ell_rank - 1; k >= 0; --k) out.push_back(static_cast<int>(256 + k));
    for (auto [x, n] : count)
      if (x < 256 && n == 1) out.push_back(x);
  }
  // Global order: output letters first, then the summed ones.
  std::vector<int> order = out;
  for (const auto& l : labels)
    for (int x : l)
      if (std::find(order.begin(), order.end(), x) == order.end()) order.push_back(x);
  Value* acc = nullptr;
  for (size_t t = 0; t < terms.size(); ++t) {
    Value* v = c.in(static_cast<int>(t));
    std::vector<int> l = labels[t];
    // Diagonals: multiply by an identity mask over the repeated pair, then sum one away.
    for (bool again = true; again;) {
      again = false;
      for (size_t i = 0; i < l.size() && !again; ++i)
        for (size_t j = i + 1; j < l.size() && !again; ++j) {
          if (l[i] != l[j]) continue;
          KILN_ASSIGN_OR_RETURN(Sizes s, c.static_shape(v, "operand"));
          const int64_t n = s[i];
          KILN_RETURN_IF_ERROR(check_constant_size(c, "diagonal mask", n, n));
          Sizes ms(l.size(), 1);
          ms[i] = n;
          ms[j] = n;
          Tensor eye(v->dtype(), ms);
          for (int64_t k = 0; k < n; ++k) eye.set_f64(k * n + k, 1);
          KILN_ASSIGN_OR_RETURN(v, c.op("mul", {v, c.constant(std::move(eye))}));
          KILN_ASSIGN_OR_RETURN(v, reduce(c, "reduce_sum", v, {static_cast<int64_t>(j)}, false));
          l.erase(l.begin() + static_cast<std::ptrdiff_t>(j));
          again = true;
        }
    }
    Sizes perm;
    std::vector<int> present;
    for (int x : order)
      for (size_t i = 0; i < l.size(); ++i)
        if (l[i] == x) {
          perm.push_back(static_cast<int64_t>(i));
          present.push_back(x);
        }
    KILN_ASSIGN_OR_RETURN(v, transpose(c, v, perm));
    Sizes missing;
    for (size_t k = 0; k < order.size(); ++k)
      if (std::find(l.begin(), l.end(), order[k]) == l.end()) missing.push_back(static_cast<int64_t>(k));
    KILN_ASSIGN_OR_RETURN(v, unsqueeze(c, v, missing));
    if (!acc) acc = v;
    else {
      KILN_ASSIGN_OR_RETURN(acc, c.op("mul", {acc, v}));
    }
  }
  Sizes summed;
  for (size_t k = out.size(); k < order.size(); ++k) summed.push_back(static_cast<int64_t>(k));
  if (!summed.empty()) {
    KILN_ASSIGN_OR_RETURN(acc, reduce(c, "reduce_sum", acc, summed, false));
  }
  return c.out(0, acc);
}

Status tfidf_op(NodeCtx& c) {
  if (c.has_attr("pool_strings")) return c.error(StatusCode::kUnimplemented, "string pools are not supported");
  const std::string mode = c.attr_string("mode", "TF");
  AttrMap attrs{{"mode", Attribute(mode)},
                {"min_gram_length", Attribute(c.attr_int("min_gram_length", 1))},
                {"max_gram_length", Attribute(c.attr_int("max_gram_length", 1))},
                {"max_skip_count", Attribute(c.attr_int("max_skip_count", 0))},
                {"ngram_counts", Attribute(c.attr_ints("ngram_counts"))},
                {"ngram_indexes", Attribute(c.attr_ints("ngram_indexes"))},
                {"pool_int64s", Attribute(c.attr_ints("pool_int64s"))}};
  if (c.has_attr("weights")) attrs["weights"] = Attribute(c.attr_floats("weights"));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("tfidf_vectorizer", {c.in(0)}, std::move(attrs)));
  return c.out(0, y);
}

}  // namespace

void register_tensor_ops(HandlerTable& t) {
  t["Reshape"] = reshape_op;
  t["Flatten"] = flatten_op;
  t["Transpose"] = transpose_op;
  t["Squeeze"] = squeeze_op;
  t["Unsqueeze"] = unsqueeze_op;
  t["Concat"] = concat_op;
  t["Split"] = split_op;
  t["Slice"] = slice_op;
  t["Gather"] = gather_op;
  t["GatherElements"] = gather_elements_op;
  t["GatherND"] = gather_nd_op;
  t["Expand"] = expand_op;
  t["Pad"] = pad_op;
  t["Identity"] = identity_op;
  t["Shape"] = shape_op;
  t["Size"] = size_op;
  t["ConstantOfShape"] = constant_of_shape_op;
  t["Constant"] = constant_op;
  t["Range"] = range_op;
  t["Tile"] = tile_op;
  t["EyeLike"] = eye_like_op;
  t["Trilu"] = trilu_op;
  t["OneHot"] = one_hot_op;
  t["DepthToSpace"] = depth_space_op;
  t["SpaceToDepth"] = depth_space_op;
  t["Compress"] = compress_op;
  t["CumSum"] = cumsum_op;
  t["ReverseSequence"] = reverse_sequence_op;
  t["Scatter"] = scatter_op;
  t["ScatterElements"] = scatter_op;
  t["ScatterND"] = scatter_op;
  t["TopK"] = top_k_op;
  t["Einsum"] = einsum_op;
  t["TfIdfVectorizer"] = tfidf_op;
}

}  // namespace kiln::onnx_fe
