// Core shape and view ops: reshape, transpose, slice, concat, split, gather, expand, pad,
// squeeze, unsqueeze, flatten, identity.
#include <algorithm>
#include <limits>
#include <set>

#include "ops/kernel_util.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

using Sizes = std::vector<int64_t>;

bool dims_conflict(const Dim& a, const Dim& b) {
  return a.is_static() && b.is_static() && a.value() != b.value();
}

/// Of two dims known to be equal at run time, the more informative one.
Dim merge_dims(const Dim& a, const Dim& b) { return a.is_static() || b.is_unknown() ? a : b; }

std::string ints_str(const Sizes& v) { return shape_str(shape_of(v)); }

/// The product of `dims` as a Dim: static when all are, the symbol itself when one symbol
/// is multiplied by static 1s, else unknown.
Dim product_dim(Shape::const_iterator begin, Shape::const_iterator end) {
  int64_t p = 1;
  const Dim* sym = nullptr;
  int symbols = 0;
  for (auto it = begin; it != end; ++it) {
    if (it->is_static())
      p *= it->value();
    else {
      sym = &*it;
      ++symbols;
    }
  }
  if (symbols == 0) return Dim(p);
  if (symbols == 1 && p == 1) return *sym;
  return Dim::unknown();
}

/// Copies elements of `src` into the (preallocated) `dst` of the same dtype:
/// dst[i] = src[source(i)] for every i, bit-exactly.
template <typename F>
void gather_elements(const Tensor& src, Tensor& dst, F&& source) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  const std::byte* s = src.data();
  std::byte* d = dst.mutable_data();
  for (int64_t i = 0; i < n; ++i) copy_element(src.dtype(), s, source(i), d, i);
}

/// Walks the row-major multi-index of `shape` and yields, for each element, the offset
/// `sum(index[d] * strides[d]) + base` (strides may be negative or zero).
class StridedWalker {
 public:
  StridedWalker(Sizes shape, Sizes strides, int64_t base)
      : shape_(std::move(shape)),
        strides_(std::move(strides)),
        index_(shape_.size(), 0),
        offset_(base) {}
  int64_t offset() const { return offset_; }
  void next() {
    for (size_t d = shape_.size(); d-- > 0;) {
      offset_ += strides_[d];
      if (++index_[d] < shape_[d]) return;
      offset_ -= strides_[d] * index_[d];
      index_[d] = 0;
    }
  }

 private:
  Sizes shape_, strides_, index_;
  int64_t offset_;
};

/// Fills `dst` from a strided view of `src` (transpose, slice).
void copy_strided(const Tensor& src, Tensor& dst, const Sizes& strides, int64_t base) {
  StridedWalker w(dst.shape(), strides, base);
  gather_elements(src, dst, [&](int64_t) {
    const int64_t off = w.offset();
    w.next();
    return off;
  });
}

/// Shares x's bytes under the result's shape (reshape-like views copy nothing).
Status alias_kernel(KernelContext& ctx) {
  ctx.output() = ctx.input(0).reshaped(ctx.output().shape());
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// reshape

/// Static product and symbol multiset of a shape; `opaque` when it holds an unknown dim,
/// which cannot be compared with anything.
struct Factors {
  int64_t product = 1;
  std::multiset<std::string> symbols;
  bool opaque = false;
};

Factors factor(const Shape& s, int64_t skip) {
  Factors f;
  for (size_t i = 0; i < s.size(); ++i) {
    if (static_cast<int64_t>(i) == skip) continue;
    if (s[i].is_static())
      f.product *= s[i].value();
    else if (s[i].is_unknown())
      f.opaque = true;
    else
      f.symbols.insert(s[i].symbol_name());
  }
  return f;
}

Status infer_reshape(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  const Sizes spec = ctx.node.get_ints("shape");
  Shape out;
  int64_t infer_at = -1;
  for (size_t i = 0; i < spec.size(); ++i) {
    const int64_t v = spec[i];
    if (v == 0) {
      if (i >= x.shape.size())
        return ctx.error("shape[" + std::to_string(i) + "] = 0 copies a dim that " + x.str() +
                         " does not have");
      out.push_back(x.shape[i]);
    } else if (v == -1) {
      if (infer_at >= 0) return ctx.error("shape " + ints_str(spec) + " has more than one -1");
      infer_at = static_cast<int64_t>(i);
      out.push_back(Dim::unknown());
    } else if (v < -1) {
      return ctx.error("shape " + ints_str(spec) + " has invalid size " + std::to_string(v));
    } else {
      out.push_back(v);
    }
  }
  // Cancel the symbols both sides share; what is left decides the -1 or the check.
  Factors in = factor(x.shape, -1), res = factor(out, infer_at);
  for (auto it = res.symbols.begin(); it != res.symbols.end();) {
    auto match = in.symbols.find(*it);
    if (match == in.symbols.end()) {
      ++it;
      continue;
    }
    in.symbols.erase(match);
    it = res.symbols.erase(it);
  }
  const std::string what = "cannot reshape " + x.str() + " to " + ints_str(spec);
  if (!in.opaque && !res.opaque && res.symbols.empty()) {
    if (infer_at >= 0 && in.symbols.empty()) {
      if (res.product == 0) return ctx.error(what + ": the -1 is ambiguous with a 0-sized dim");
      if (in.product % res.product != 0) return ctx.error(what);
      out[static_cast<size_t>(infer_at)] = in.product / res.product;
    } else if (infer_at >= 0 && in.symbols.size() == 1 && in.product == res.product &&
               res.product != 0) {
      out[static_cast<size_t>(infer_at)] = Dim::symbol(*in.symbols.begin());
    } else if (infer_at < 0 && in.symbols.empty() && in.product != res.product) {
      return ctx.error(what);
    }
  }
  ctx.results = {TensorType{x.dtype, out}};
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// transpose

StatusOr<Sizes> read_perm(const InferContext* ctx, const Node& node, int64_t rank) {
  Sizes perm = node.get_ints("perm");
  if (perm.empty() && rank > 0) {
    for (int64_t i = rank - 1; i >= 0; --i) perm.push_back(i);
    return perm;
  }
  Sizes sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  bool ok = static_cast<int64_t>(perm.size()) == rank;
  for (int64_t i = 0; ok && i < rank; ++i) ok = sorted[static_cast<size_t>(i)] == i;
  if (!ok) {
    const std::string m =
        "perm " + ints_str(perm) + " is not a permutation of the " + std::to_string(rank) + " dims";
    return ctx ? ctx->error(m) : invalid_argument(m);
  }
  return perm;
}

Status infer_transpose(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  KILN_ASSIGN_OR_RETURN(Sizes perm, read_perm(&ctx, ctx.node, x.rank()));
  Shape out;
  for (int64_t p : perm) out.push_back(x.shape[static_cast<size_t>(p)]);
  ctx.results = {TensorType{x.dtype, out}};
  return ok_status();
}

Status transpose_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  KILN_ASSIGN_OR_RETURN(Sizes perm, read_perm(nullptr, ctx.node, x.rank()));
  const Sizes in_strides = contiguous_strides(x.shape());
  Sizes strides;
  for (int64_t p : perm) strides.push_back(in_strides[static_cast<size_t>(p)]);
  copy_strided(x, ctx.output(), strides, 0);
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// slice

/// One sliced axis after ONNX clamping: first index, step and element count.
struct SliceAxis {
  int64_t start = 0, step = 1, count = 0;
};

SliceAxis clamp_slice(int64_t dim, int64_t start, int64_t end, int64_t step) {
  if (start < 0) start += dim;
  if (end < 0) end += dim;
  SliceAxis s;
  s.step = step;
  if (dim == 0) return s;
  // |step| as unsigned so that steps near INT64_MIN/MAX cannot overflow.
  const uint64_t abs_step =
      step > 0 ? static_cast<uint64_t>(step) : 0 - static_cast<uint64_t>(step);
  int64_t distance;
  if (step > 0) {
    s.start = std::clamp<int64_t>(start, 0, dim);
    distance = std::clamp<int64_t>(end, 0, dim) - s.start;
  } else {
    s.start = std::clamp<int64_t>(start, 0, dim - 1);
    distance = s.start - std::clamp<int64_t>(end, -1, dim - 1);
  }
  if (distance > 0)
    s.count = 1 + static_cast<int64_t>(static_cast<uint64_t>(distance - 1) / abs_step);
  return s;
}

/// The validated (normalized axis, start, end, step) lists of a slice node.
struct SliceSpec {
  Sizes axes, starts, ends, steps;
};

StatusOr<SliceSpec> read_slice(const Node& node, int64_t rank) {
  SliceSpec s{node.get_ints("axes"), node.get_ints("starts"), node.get_ints("ends"),
              node.get_ints("steps")};
  const size_t n = s.starts.size();
  if (!node.has_attr("axes"))
    for (size_t i = 0; i < n; ++i) s.axes.push_back(static_cast<int64_t>(i));
  if (!node.has_attr("steps")) s.steps.assign(n, 1);
  if (s.ends.size() != n || s.axes.size() != n || s.steps.size() != n)
    return invalid_argument("starts, ends, axes and steps must have the same length, got " +
                            std::to_string(n) + ", " + std::to_string(s.ends.size()) + ", " +
                            std::to_string(s.axes.size()) + ", " + std::to_string(s.steps.size()));
  Sizes seen;
  for (size_t i = 0; i < n; ++i) {
    StatusOr<int64_t> a = normalize_axis(s.axes[i], rank);
    if (!a.ok())
      return invalid_argument("axis " + std::to_string(s.axes[i]) + " is out of range for rank " +
                              std::to_string(rank));
    if (std::find(seen.begin(), seen.end(), *a) != seen.end())
      return invalid_argument("axis " + std::to_string(s.axes[i]) + " is sliced twice");
    seen.push_back(*a);
    s.axes[i] = *a;
    if (s.steps[i] == 0) return invalid_argument("step of axis " + std::to_string(*a) + " is 0");
  }
  return s;
}

Status infer_slice(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  StatusOr<SliceSpec> spec = read_slice(ctx.node, x.rank());
  if (!spec.ok()) return ctx.error(spec.status().message());
  Shape out = x.shape;
  for (size_t i = 0; i < spec->axes.size(); ++i) {
    Dim& d = out[static_cast<size_t>(spec->axes[i])];
    if (d.is_static()) {
      d = clamp_slice(d.value(), spec->starts[i], spec->ends[i], spec->steps[i]).count;
    } else {
      // Only "the whole axis" keeps a symbolic size; anything else depends on its value.
      const bool whole = spec->starts[i] == 0 && spec->steps[i] == 1 &&
                         spec->ends[i] >= std::numeric_limits<int32_t>::max();
      if (!whole) d = Dim::unknown();
    }
  }
  ctx.results = {TensorType{x.dtype, out}};
  return ok_status();
}

Status slice_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  KILN_ASSIGN_OR_RETURN(SliceSpec spec, read_slice(ctx.node, x.rank()));
  Sizes strides = contiguous_strides(x.shape());
  int64_t base = 0;
  for (size_t i = 0; i < spec.axes.size(); ++i) {
    const size_t a = static_cast<size_t>(spec.axes[i]);
    const SliceAxis s = clamp_slice(x.shape()[a], spec.starts[i], spec.ends[i], spec.steps[i]);
    base += s.start * strides[a];
    if (s.count > 1) strides[a] *= s.step;  // a single element never steps (and may not overflow)
  }
  copy_strided(x, ctx.output(), strides, base);
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// concat, split

Status infer_concat(InferContext& ctx) {
  if (ctx.num_operands() == 0) return ctx.error("needs at least one operand");
  const TensorType& first = ctx.operand(0);
  if (first.rank() == 0) return ctx.error("cannot concatenate scalars");
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalize_axis(ctx, ctx.node.get_int("axis"), first.rank()));
  Shape out = first.shape;
  std::vector<Dim> along = {first.shape[static_cast<size_t>(axis)]};
  for (int i = 1; i < ctx.num_operands(); ++i) {
    KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 0, i));
    const TensorType& t = ctx.operand(i);
    bool ok = t.rank() == first.rank();
    for (size_t d = 0; ok && d < out.size(); ++d) {
      if (static_cast<int64_t>(d) == axis) continue;
      ok = !dims_conflict(out[d], t.shape[d]);
      if (ok) out[d] = merge_dims(out[d], t.shape[d]);
    }
    if (!ok)
      return ctx.error("operand " + std::to_string(i) + " " + t.str() + " does not match " +
                       first.str() + " outside axis " + std::to_string(axis));
    along.push_back(t.shape[static_cast<size_t>(axis)]);
  }
  int64_t sum = 0;
  bool all_static = true;
  for (const Dim& d : along) {
    all_static &= d.is_static();
    if (d.is_static()) sum += d.value();
  }
  if (along.size() > 1) out[static_cast<size_t>(axis)] = all_static ? Dim(sum) : Dim::unknown();
  ctx.results = {TensorType{first.dtype, out}};
  return ok_status();
}

/// Splits dims around `axis`: elements before (outer) and after (inner) it.
void outer_inner(const Sizes& shape, int64_t axis, int64_t& outer, int64_t& inner) {
  outer = product(Sizes(shape.begin(), shape.begin() + axis));
  inner = product(Sizes(shape.begin() + axis + 1, shape.end()));
}

Status concat_kernel(KernelContext& ctx) {
  Tensor& y = ctx.output();
  const int64_t axis = normalize_axis(ctx.node.get_int("axis"), y.rank()).value();
  int64_t outer, inner;
  outer_inner(y.shape(), axis, outer, inner);
  const int64_t out_chunk = y.shape()[static_cast<size_t>(axis)] * inner;
  if (y.numel() == 0) return ok_status();
  std::byte* d = y.mutable_data();
  int64_t offset = 0;  // where this input's chunk starts inside each output chunk
  for (const Tensor& x : ctx.inputs) {
    const int64_t chunk = x.shape()[static_cast<size_t>(axis)] * inner;
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t j = 0; j < chunk; ++j)
        copy_element(x.dtype(), x.data(), o * chunk + j, d, o * out_chunk + offset + j);
    offset += chunk;
  }
  return ok_status();
}

Status infer_split(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  if (x.rank() == 0) return ctx.error("cannot split a scalar");
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalize_axis(ctx, ctx.node.get_int("axis", 0), x.rank()));
  const Sizes sizes = ctx.node.get_ints("sizes");
  if (static_cast<int>(sizes.size()) != ctx.num_results())
    return ctx.error("sizes " + ints_str(sizes) + " make " + std::to_string(sizes.size()) +
                     " pieces but the node has " + std::to_string(ctx.num_results()) + " results");
  int64_t total = 0;
  for (int64_t s : sizes) {
    if (s < 0) return ctx.error("sizes " + ints_str(sizes) + " has a negative size");
    total += s;
  }
  const Dim& d = x.shape[static_cast<size_t>(axis)];
  if (d.is_static() && d.value() != total)
    return ctx.error("sizes " + ints_str(sizes) + " add up to " + std::to_string(total) +
                     " but axis " + std::to_string(axis) + " of " + x.str() + " has " + d.str());
  ctx.results.clear();
  for (int64_t s : sizes) {
    TensorType t = x;
    t.shape[static_cast<size_t>(axis)] = s;
    ctx.results.push_back(t);
  }
  return ok_status();
}

Status split_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const int64_t axis = normalize_axis(ctx.node.get_int("axis", 0), x.rank()).value();
  int64_t outer, inner;
  outer_inner(x.shape(), axis, outer, inner);
  const int64_t in_chunk = x.shape()[static_cast<size_t>(axis)] * inner;
  int64_t offset = 0;
  for (Tensor& y : ctx.outputs) {
    const int64_t chunk = y.shape()[static_cast<size_t>(axis)] * inner;
    gather_elements(x, y, [&](int64_t i) { return (i / chunk) * in_chunk + offset + i % chunk; });
    offset += chunk;
  }
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// gather, scatter_add, expand

/// Gather's result type for the node's data and indices (scatter_add's updates have it too),
/// or why they do not fit.
StatusOr<TensorType> gathered_type(InferContext& ctx) {
  const TensorType& data = ctx.operand(0);
  const TensorType& idx = ctx.operand(1);
  if (idx.dtype != DType::kI32 && idx.dtype != DType::kI64)
    return ctx.error("operand 'indices' must be i32 or i64, got " + std::string(dtype_name(idx.dtype)));
  if (data.rank() == 0) return ctx.error("operand 'data' must have rank >= 1, got " + data.str());
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalize_axis(ctx, ctx.node.get_int("axis", 0), data.rank()));
  Shape out(data.shape.begin(), data.shape.begin() + axis);
  out.insert(out.end(), idx.shape.begin(), idx.shape.end());
  out.insert(out.end(), data.shape.begin() + axis + 1, data.shape.end());
  return TensorType{data.dtype, out};
}

/// Where element i of gather's result comes from in data (and where scatter_add adds element i
/// of its updates): data viewed as [outer, dim, inner], indices wrapped and checked.
struct GatherIndex {
  int64_t dim = 0, inner = 1;
  std::vector<int64_t> idx;
  int64_t source(int64_t i) const {
    const int64_t n = static_cast<int64_t>(idx.size());
    const int64_t o = i / (n * inner), j = (i / inner) % n, k = i % inner;
    return (o * dim + idx[static_cast<size_t>(j)]) * inner + k;
  }
};

StatusOr<GatherIndex> gather_index(KernelContext& ctx) {
  const Tensor& data = ctx.input(0);
  const int64_t axis = normalize_axis(ctx.node.get_int("axis", 0), data.rank()).value();
  GatherIndex g;
  g.dim = data.shape()[static_cast<size_t>(axis)];
  g.idx = ctx.input(1).to_i64();
  for (int64_t& i : g.idx) {
    if (i < -g.dim || i >= g.dim)
      return ctx.error("index " + std::to_string(i) + " is out of range for axis " + std::to_string(axis) +
                       " of size " + std::to_string(g.dim));
    if (i < 0) i += g.dim;
  }
  int64_t outer;
  outer_inner(data.shape(), axis, outer, g.inner);
  return g;
}

Status infer_gather(InferContext& ctx) {
  KILN_ASSIGN_OR_RETURN(TensorType out, gathered_type(ctx));
  ctx.results = {out};
  return ok_status();
}

Status gather_kernel(KernelContext& ctx) {
  KILN_ASSIGN_OR_RETURN(const GatherIndex g, gather_index(ctx));
  gather_elements(ctx.input(0), ctx.output(), [&](int64_t i) { return g.source(i); });
  return ok_status();
}

Status infer_scatter_add(InferContext& ctx) {
  KILN_ASSIGN_OR_RETURN(const TensorType expected, gathered_type(ctx));
  const TensorType& upd = ctx.operand(2);
  if (upd.dtype != expected.dtype || upd.shape != expected.shape)
    return ctx.error("operand 'updates' must be " + expected.str() + " (gather's result for these data and indices), got " +
                     upd.str());
  ctx.results = {ctx.operand(0)};
  return ok_status();
}

Status scatter_add_kernel(KernelContext& ctx) {
  KILN_ASSIGN_OR_RETURN(const GatherIndex g, gather_index(ctx));
  const Tensor& upd = ctx.input(2);
  Tensor& y = ctx.output();
  gather_elements(ctx.input(0), y, [](int64_t i) { return i; });
  const bool flt = is_float(y.dtype());
  for (int64_t i = 0; i < upd.numel(); ++i) {
    const int64_t dst = g.source(i);
    if (flt)
      y.set_f64(dst, y.get_f64(dst) + upd.get_f64(i));
    else
      y.set_i64(dst, y.get_i64(dst) + upd.get_i64(i));
  }
  return ok_status();
}

Status infer_expand(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  const Sizes target = ctx.node.get_ints("shape");
  for (int64_t s : target)
    if (s < 0) return ctx.error("shape " + ints_str(target) + " has a negative size");
  StatusOr<Shape> out = broadcast_shapes(x.shape, shape_of(target));
  if (!out.ok()) return ctx.error("cannot expand " + x.str() + " to " + ints_str(target));
  ctx.results = {TensorType{x.dtype, *out}};
  return ok_status();
}

Status expand_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  BroadcastWalker w(ctx.output().shape(), {x.shape()});
  gather_elements(x, ctx.output(), [&](int64_t) {
    const int64_t off = w.offset(0);
    w.next();
    return off;
  });
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// pad

enum class PadMode { kConstant, kReflect, kEdge };

StatusOr<PadMode> read_pad(const Node& node, int64_t rank, Sizes& pads) {
  pads = node.get_ints("pads");
  if (static_cast<int64_t>(pads.size()) != 2 * rank)
    return invalid_argument("pads must have 2 * rank = " + std::to_string(2 * rank) +
                            " values, got " + std::to_string(pads.size()));
  const std::string mode = node.get_string("mode", "constant");
  if (mode == "constant") return PadMode::kConstant;
  if (mode == "reflect") return PadMode::kReflect;
  if (mode == "edge") return PadMode::kEdge;
  return invalid_argument("mode must be \"constant\", \"reflect\" or \"edge\", got \"" + mode +
                          "\"");
}

Status infer_pad(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  Sizes pads;
  StatusOr<PadMode> mode = read_pad(ctx.node, x.rank(), pads);
  if (!mode.ok()) return ctx.error(mode.status().message());
  const size_t r = x.shape.size();
  Shape out = x.shape;
  for (size_t d = 0; d < r; ++d) {
    const int64_t b = pads[d], e = pads[r + d];
    if (!x.shape[d].is_static()) {
      if (b + e != 0) out[d] = Dim::unknown();
      continue;
    }
    const int64_t n = x.shape[d].value();
    if (n + b + e < 0)
      return ctx.error("pads " + ints_str(pads) + " crop more than dim " + std::to_string(d) +
                       " of " + x.str() + " holds");
    // Reflection mirrors without repeating the border, so it needs pads < size.
    if (*mode == PadMode::kReflect && (b >= n || e >= n) && (b > 0 || e > 0))
      return ctx.error("reflect pads of dim " + std::to_string(d) +
                       " must be smaller than its size " + std::to_string(n) + ", got " +
                       ints_str(pads));
    if (*mode == PadMode::kEdge && n == 0 && (b > 0 || e > 0))
      return ctx.error("edge mode cannot pad empty dim " + std::to_string(d) + " of " + x.str());
    out[d] = n + b + e;
  }
  ctx.results = {TensorType{x.dtype, out}};
  return ok_status();
}

Status pad_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output();
  Sizes pads;
  KILN_ASSIGN_OR_RETURN(PadMode mode, read_pad(ctx.node, x.rank(), pads));
  const double value = ctx.node.get_float("value", 0.0);
  const size_t r = static_cast<size_t>(x.rank());
  const Sizes in_strides = contiguous_strides(x.shape());
  // Source element of every output element, -1 for the constant fill.
  std::vector<int64_t> source(static_cast<size_t>(y.numel()));
  Sizes idx(r, 0);
  for (int64_t i = 0; i < y.numel(); ++i) {
    int64_t off = 0;
    for (size_t d = 0; d < r && off >= 0; ++d) {
      const int64_t n = x.shape()[d];
      int64_t s = idx[d] - pads[d];
      if (s < 0 || s >= n) {
        if (mode == PadMode::kConstant) {
          off = -1;
          break;
        }
        if (mode == PadMode::kEdge)
          s = std::clamp<int64_t>(s, 0, n - 1);
        else
          s = s < 0 ? -s : 2 * (n - 1) - s;
      }
      off += s * in_strides[d];
    }
    source[static_cast<size_t>(i)] = off;
    for (size_t d = r; d-- > 0;) {
      if (++idx[d] < y.shape()[d]) break;
      idx[d] = 0;
    }
  }
  if (y.numel() == 0) return ok_status();
  std::byte* d = y.mutable_data();
  for (int64_t i = 0; i < y.numel(); ++i) {
    const int64_t s = source[static_cast<size_t>(i)];
    if (s >= 0)
      copy_element(x.dtype(), x.data(), s, d, i);
    else
      y.set_f64(i, value);
  }
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// squeeze, unsqueeze, flatten, identity

Status infer_squeeze(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  Sizes axes;
  if (ctx.node.has_attr("axes")) {
    KILN_ASSIGN_OR_RETURN(axes, normalize_axes(ctx, ctx.node.get_ints("axes"), x.rank()));
    for (int64_t a : axes) {
      const Dim& d = x.shape[static_cast<size_t>(a)];
      if (d.is_static() && d.value() != 1)
        return ctx.error("cannot squeeze dim " + std::to_string(a) + " of " + x.str() +
                         ": its size is not 1");
    }
  } else {
    // Without axes, a symbolic dim might or might not be 1 at run time: the result rank
    // would be unknown, so the caller must say which dims go.
    for (size_t d = 0; d < x.shape.size(); ++d) {
      if (!x.shape[d].is_static())
        return ctx.error("cannot tell which dims of " + x.str() + " are 1; give axes");
      if (x.shape[d].value() == 1) axes.push_back(static_cast<int64_t>(d));
    }
  }
  Shape out;
  for (size_t d = 0; d < x.shape.size(); ++d)
    if (std::find(axes.begin(), axes.end(), static_cast<int64_t>(d)) == axes.end())
      out.push_back(x.shape[d]);
  ctx.results = {TensorType{x.dtype, out}};
  return ok_status();
}

Status infer_unsqueeze(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  const Sizes given = ctx.node.get_ints("axes");
  const int64_t rank = x.rank() + static_cast<int64_t>(given.size());
  KILN_ASSIGN_OR_RETURN(Sizes axes, normalize_axes(ctx, given, rank));
  Shape out;
  auto it = x.shape.begin();
  for (int64_t d = 0; d < rank; ++d)
    out.push_back(std::binary_search(axes.begin(), axes.end(), d) ? Dim(1) : *it++);
  ctx.results = {TensorType{x.dtype, out}};
  return ok_status();
}

Status infer_flatten(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  int64_t axis = ctx.node.get_int("axis", 1);
  if (axis < -x.rank() || axis > x.rank())
    return ctx.error("axis " + std::to_string(axis) + " is out of range for rank " +
                     std::to_string(x.rank()) + " (flatten allows [-rank, rank])");
  if (axis < 0) axis += x.rank();
  const auto mid = x.shape.begin() + axis;
  ctx.results = {
      TensorType{x.dtype, {product_dim(x.shape.begin(), mid), product_dim(mid, x.shape.end())}}};
  return ok_status();
}

Status infer_identity(InferContext& ctx) {
  ctx.results = {ctx.operand(0)};
  return ok_status();
}

}  // namespace

void register_shape_ops(OpRegistry& r) {
  using AK = AttrKind;
  // Every op here only moves data, so they share the View trait and a plain operand list.
  const auto view = [](std::string name, std::string summary, std::vector<std::string> inputs,
                       std::vector<std::string> outputs, std::string result_rule,
                       std::vector<AttrSpec> attrs, InferFn infer, ReferenceFn ref) {
    return OpDef{.name = std::move(name),
                 .summary = std::move(summary),
                 .traits = kTraitView,
                 .inputs = std::move(inputs),
                 .outputs = std::move(outputs),
                 .result_rule = std::move(result_rule),
                 .attrs = std::move(attrs),
                 .num_regions = 0,
                 .infer = std::move(infer),
                 .reference = std::move(ref)};
  };
  add_op_or_die(
      r,
      view("reshape", "same elements under a new shape (0 copies a dim, one -1 is inferred)", {"x"},
           {"y"}, "dtype of x, shape `shape` (0 and -1 resolved)",
           {attr_required("shape", AK::kInts, "new shape; 0 copies the input dim, -1 is inferred")},
           infer_reshape, alias_kernel));
  add_op_or_die(r, view("transpose", "permutes dims: y.shape[i] = x.shape[perm[i]]", {"x"}, {"y"},
                        "dtype of x, y.shape[i] = x.shape[perm[i]]",
                        {attr_optional("perm", AK::kInts, "dim order (default reversed)")},
                        infer_transpose, transpose_kernel));
  add_op_or_die(
      r, view("slice", "strided slice with ONNX clamping (negative steps allowed)", {"x"}, {"y"},
              "dtype of x; each sliced axis ceil((end - start) / step) after clamping",
              {attr_required("starts", AK::kInts, "first index per sliced axis"),
               attr_required("ends", AK::kInts, "end index (exclusive) per sliced axis"),
               attr_optional("axes", AK::kInts, "sliced axes (default 0..n-1)"),
               attr_optional("steps", AK::kInts, "step per sliced axis (default 1)")},
              infer_slice, slice_kernel));
  add_op_or_die(
      r, view("concat", "joins operands along an axis", {"xs..."}, {"y"},
              "dtype of the xs; their shape with `axis` the sum of theirs",
              {attr_required("axis", AK::kInt, "joined axis")}, infer_concat, concat_kernel));
  add_op_or_die(
      r, view("split", "cuts x along an axis into pieces of the given sizes", {"x"}, {"ys..."},
              "one result per entry of `sizes`: x's shape with `axis` that size",
              {attr_default("axis", int64_t{0}, "cut axis"),
               attr_required("sizes", AK::kInts, "size of each piece, one per result")},
              infer_split, split_kernel));
  add_op_or_die(
      r, view("gather", "picks slices of data along an axis by index (negative wraps)",
              {"data", "indices"}, {"y"},
              "data[:axis] + indices' shape + data[axis + 1:], dtype of data",
              {attr_default("axis", int64_t{0}, "indexed axis")}, infer_gather, gather_kernel));
  // Not a view (it adds), so not through `view`.
  add_op_or_die(r, OpDef{.name = "scatter_add",
                         .summary = "data with each updates slice added at its index along an axis (gather's transpose; "
                                    "repeated indices accumulate)",
                         .traits = kTraitNone,
                         .inputs = {"data", "indices", "updates"},
                         .outputs = {"y"},
                         .result_rule = "same as data; updates is gather's result for data and indices",
                         .attrs = {attr_default("axis", int64_t{0}, "indexed axis")},
                         .num_regions = 0,
                         .infer = infer_scatter_add,
                         .reference = scatter_add_kernel});
  add_op_or_die(r, view("expand", "broadcasts x numpy-style against a shape", {"x"}, {"y"},
                        "dtype of x, broadcast of x's shape and `shape`",
                        {attr_required("shape", AK::kInts, "shape to broadcast against")},
                        infer_expand, expand_kernel));
  add_op_or_die(r, view("pad", "pads (or crops, for negative pads) every dim", {"x"}, {"y"},
                        "dtype of x; each dim grows by its begin and end pads",
                        {attr_required("pads", AK::kInts, "all begin pads, then all end pads"),
                         attr_default("mode", "constant", "\"constant\", \"reflect\" or \"edge\""),
                         attr_default("value", 0.0, "fill value of constant mode")},
                        infer_pad, pad_kernel));
  add_op_or_die(r,
                view("squeeze", "removes size-1 dims", {"x"}, {"y"},
                     "dtype of x; x's shape without the size-1 `axes`",
                     {attr_optional("axes", AK::kInts, "dims to remove (default every static 1)")},
                     infer_squeeze, alias_kernel));
  add_op_or_die(r,
                view("unsqueeze", "inserts size-1 dims", {"x"}, {"y"},
                     "dtype of x; x's shape with size-1 dims at `axes`",
                     {attr_required("axes", AK::kInts, "positions of the new dims in the result")},
                     infer_unsqueeze, alias_kernel));
  add_op_or_die(r, view("flatten", "collapses dims [0, axis) and [axis, rank) into a 2-D result",
                        {"x"}, {"y"}, "dtype of x, [prod(x.shape[:axis]), prod(x.shape[axis:])]",
                        {attr_default("axis", int64_t{1}, "first dim of the second group")},
                        infer_flatten, alias_kernel));
  add_op_or_die(r, view("identity", "returns x unchanged", {"x"}, {"y"}, "same as x", {},
                        infer_identity, alias_kernel));
}

}  // namespace kiln
