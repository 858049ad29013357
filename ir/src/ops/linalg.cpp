// Core contraction and windowed ops: matmul, linear, conv, max_pool, avg_pool.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "ops/kernel_util.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

using Sizes = std::vector<int64_t>;

bool dims_conflict(const Dim& a, const Dim& b) {
  return a.is_static() && b.is_static() && a.value() != b.value();
}

/// Accumulator arithmetic: floats in double, integers in int64 with two's-complement wrap
/// (so overflow is defined and matches what integer hardware does).
template <typename T>
std::vector<T> elements(const Tensor& t) {
  if constexpr (std::is_same_v<T, double>)
    return t.to_f64();
  else
    return t.to_i64();
}
inline double mul_add(double acc, double x, double y) { return acc + x * y; }
inline int64_t mul_add(int64_t acc, int64_t x, int64_t y) {
  return static_cast<int64_t>(static_cast<uint64_t>(acc) +
                              static_cast<uint64_t>(x) * static_cast<uint64_t>(y));
}
inline void store(Tensor& t, int64_t i, double v) { t.set_f64(i, v); }
inline void store(Tensor& t, int64_t i, int64_t v) { t.set_i64(i, v); }

/// Calls `f(double{})` for float dtypes and `f(int64_t{})` for integer ones; `f` picks its
/// accumulator type from the argument.
template <typename F>
Status dispatch_acc(DType t, F&& f) {
  return is_float(t) ? f(double{}) : f(int64_t{});
}

/// The identity of max: -inf for floats, the dtype's minimum for integers.
template <typename T>
T lowest(DType t) {
  if constexpr (std::is_same_v<T, double>)
    return -std::numeric_limits<double>::infinity();
  else
    return is_signed(t) ? std::numeric_limits<int64_t>::min() >> (64 - dtype_bits(t)) : 0;
}

/// Advances `idx` over `dims` in row-major order; false once every index was visited.
bool next_index(Sizes& idx, const Sizes& dims) {
  for (size_t d = dims.size(); d-- > 0;) {
    if (++idx[d] < dims[d]) return true;
    idx[d] = 0;
  }
  return false;
}

/// Every multi-index of `dims` in row-major order (kernel windows are small).
std::vector<Sizes> all_indices(const Sizes& dims) {
  std::vector<Sizes> out;
  if (product(dims) == 0) return out;
  Sizes idx(dims.size(), 0);
  do out.push_back(idx);
  while (next_index(idx, dims));
  return out;
}

// ---------------------------------------------------------------------------------------
// matmul

Status infer_matmul(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 0, 1));
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kNumericDTypes));
  const TensorType& a = ctx.operand(0);
  const TensorType& b = ctx.operand(1);
  if (a.rank() < 1 || b.rank() < 1)
    return ctx.error("operands must have rank >= 1, got " + a.str() + " and " + b.str());
  // numpy promotes a 1-D 'a' to a row [1, K] and a 1-D 'b' to a column [K, 1], then drops
  // the added dim from the result.
  Shape as = a.shape, bs = b.shape;
  if (a.rank() == 1) as.insert(as.begin(), Dim(1));
  if (b.rank() == 1) bs.push_back(Dim(1));
  if (dims_conflict(as.back(), bs[bs.size() - 2]))
    return ctx.error("contraction dims differ: " + a.str() + " @ " + b.str());
  StatusOr<Shape> batch =
      broadcast_shapes(Shape(as.begin(), as.end() - 2), Shape(bs.begin(), bs.end() - 2));
  if (!batch.ok())
    return ctx.error("batch dims of " + a.str() + " and " + b.str() + " do not broadcast");
  Shape out = *batch;
  if (a.rank() > 1) out.push_back(as[as.size() - 2]);
  if (b.rank() > 1) out.push_back(bs.back());
  ctx.results = {TensorType{a.dtype, out}};
  return ok_status();
}

template <typename T>
Status matmul_kernel(KernelContext& ctx) {
  const Tensor& a = ctx.input(0);
  const Tensor& b = ctx.input(1);
  Tensor& y = ctx.output();
  Sizes as = a.shape(), bs = b.shape();
  if (as.size() == 1) as.insert(as.begin(), 1);
  if (bs.size() == 1) bs.push_back(1);
  const int64_t m = as[as.size() - 2], k = as.back(), n = bs.back();
  const Sizes abatch(as.begin(), as.end() - 2), bbatch(bs.begin(), bs.end() - 2);
  // The result's leading dims are the broadcast batch dims.
  const size_t kept = (a.rank() > 1 ? 1 : 0) + (b.rank() > 1 ? 1 : 0);
  const Sizes obatch(y.shape().begin(), y.shape().end() - static_cast<std::ptrdiff_t>(kept));
  const std::vector<T> av = elements<T>(a), bv = elements<T>(b);
  BroadcastWalker w(obatch, {abatch, bbatch});
  y.mutable_data();  // copy on write happens here, once, not in the threads below
  const int64_t batches = product(obatch);
  for (int64_t bi = 0; bi < batches; ++bi, w.next()) {
    const T* ap = av.data() + w.offset(0) * m * k;
    const T* bp = bv.data() + w.offset(1) * k * n;
    const int64_t base = bi * m * n;
    // Row i's n sums advance together over p, so b is read along its rows (contiguous);
    // each sum still adds its k products in order p = 0, 1, ..., as a dot product would.
    parallel_ranges(m, n * k, [&](int64_t begin, int64_t end) {
      std::vector<T> acc(static_cast<size_t>(n));
      for (int64_t i = begin; i < end; ++i) {
        std::fill(acc.begin(), acc.end(), T(0));
        for (int64_t p = 0; p < k; ++p) {
          const T a_ip = ap[i * k + p];
          const T* b_row = bp + p * n;
          for (int64_t j = 0; j < n; ++j) acc[static_cast<size_t>(j)] = mul_add(acc[static_cast<size_t>(j)], a_ip, b_row[j]);
        }
        for (int64_t j = 0; j < n; ++j) store(y, base + i * n + j, acc[static_cast<size_t>(j)]);
      }
    });
  }
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// matmul_acc

Status infer_matmul_acc(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 0, 1));
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kFloatDTypes));
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 2, kFloatDTypes));
  const TensorType &a = ctx.operand(0), &b = ctx.operand(1), &c = ctx.operand(2);
  if (c.dtype != a.dtype && c.dtype != DType::kF32)
    return ctx.error("operand 'c' must be " + std::string(dtype_name(a.dtype)) + " (the dtype of a and b) or f32, got " +
                     c.str());  // only reached for a non-f32 a
  if (a.rank() != 2 || b.rank() != 2)
    return ctx.error("operands 'a' and 'b' must be matrices, got " + a.str() + " and " + b.str());
  if (dims_conflict(a.shape[1], b.shape[0])) return ctx.error("contraction dims differ: " + a.str() + " @ " + b.str());
  if (c.rank() != 2 || dims_conflict(c.shape[0], a.shape[0]) || dims_conflict(c.shape[1], b.shape[1]))
    return ctx.error("operand 'c' must be [" + a.shape[0].str() + ", " + b.shape[1].str() + "], got " + c.str());
  ctx.results = {c};
  return ok_status();
}

/// c + a @ b: each sum of products in f64, then c added and the result rounded once (as a GEMM
/// with beta = 1 does in its f32 accumulator).
Status matmul_acc_reference(KernelContext& ctx) {
  const Tensor &a = ctx.input(0), &b = ctx.input(1), &c = ctx.input(2);
  const int64_t m = a.shape()[0], k = a.shape()[1], n = b.shape()[1];
  if (b.shape()[0] != k) return invalid_argument("matmul_acc: contraction dims differ at run time");
  const std::vector<double> av = a.to_f64(), bv = b.to_f64(), cv = c.to_f64();
  Tensor& y = ctx.output();
  y.mutable_data();  // copy on write happens here, once, not in the threads below
  parallel_ranges(m, n * k, [&](int64_t begin, int64_t end) {
    std::vector<double> acc(static_cast<size_t>(n));
    for (int64_t i = begin; i < end; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t p = 0; p < k; ++p) {
        const double a_ip = av[static_cast<size_t>(i * k + p)];
        const double* b_row = bv.data() + p * n;
        for (int64_t j = 0; j < n; ++j) acc[static_cast<size_t>(j)] += a_ip * b_row[j];
      }
      for (int64_t j = 0; j < n; ++j) y.set_f64(i * n + j, cv[static_cast<size_t>(i * n + j)] + acc[static_cast<size_t>(j)]);
    }
  });
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// linear

Status infer_linear(InferContext& ctx) {
  for (int i = 1; i < ctx.num_operands(); ++i) KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 0, i));
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kNumericDTypes));
  const TensorType& x = ctx.operand(0);
  const TensorType& w = ctx.operand(1);
  if (x.rank() < 1) return ctx.error("operand 'x' must have rank >= 1, got " + x.str());
  if (w.rank() != 2)
    return ctx.error("operand 'w' must be [out_features, in_features], got " + w.str());
  if (dims_conflict(x.shape.back(), w.shape[1]))
    return ctx.error("in_features differ: x is " + x.str() + ", w is " + w.str());
  if (ctx.num_operands() == 3) {
    const TensorType& bias = ctx.operand(2);
    if (bias.rank() != 1 || dims_conflict(bias.shape[0], w.shape[0]))
      return ctx.error("operand 'bias' must be [out_features] = [" + w.shape[0].str() + "], got " +
                       bias.str());
  }
  Shape out = x.shape;
  out.back() = w.shape[0];
  ctx.results = {TensorType{x.dtype, out}};
  return ok_status();
}

template <typename T>
Status linear_kernel(KernelContext& ctx) {
  const std::vector<T> xv = elements<T>(ctx.input(0)), wv = elements<T>(ctx.input(1));
  const std::vector<T> bv = ctx.num_inputs() == 3 ? elements<T>(ctx.input(2)) : std::vector<T>();
  const int64_t in = ctx.input(1).shape()[1], out = ctx.input(1).shape()[0];
  const Sizes& xs = ctx.input(0).shape();
  const int64_t rows = product(Sizes(xs.begin(), xs.end() - 1));
  ctx.output().mutable_data();  // copy on write happens here, once, not in the threads below
  parallel_ranges(rows, out * in, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t o = 0; o < out; ++o) {
        T acc = bv.empty() ? T(0) : bv[static_cast<size_t>(o)];
        for (int64_t i = 0; i < in; ++i) acc = mul_add(acc, xv[r * in + i], wv[o * in + i]);
        store(ctx.output(), r * out + o, acc);
      }
  });
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// Windowed ops (conv, pooling): shared attribute handling.

/// Strides, pads (begins then ends), dilations and kernel sizes of a windowed op.
struct Window {
  Sizes kernel, strides, pads, dilations;
  bool ceil_mode = false;
};

/// Reads the window attributes of `node` for `nsp` spatial dims, filling defaults and
/// checking lengths and ranges. `kernel` must already be set for pooling; conv leaves it
/// empty and takes sizes from w.
Status read_window(const Node& node, size_t nsp, bool has_dilations, Window& w) {
  auto read = [&](const char* name, size_t len, int64_t fallback, int64_t min,
                  Sizes& out) -> Status {
    out = node.get_ints(name);
    if (out.empty()) out.assign(len, fallback);
    if (out.size() != len)
      return invalid_argument("attribute '" + std::string(name) + "' must have " +
                              std::to_string(len) + " values, got " + std::to_string(out.size()));
    for (int64_t v : out)
      if (v < min)
        return invalid_argument("attribute '" + std::string(name) + "' values must be >= " +
                                std::to_string(min) + ", got " + std::to_string(v));
    return ok_status();
  };
  KILN_RETURN_IF_ERROR(read("strides", nsp, 1, 1, w.strides));
  KILN_RETURN_IF_ERROR(read("pads", 2 * nsp, 0, 0, w.pads));
  if (has_dilations)
    KILN_RETURN_IF_ERROR(read("dilations", nsp, 1, 1, w.dilations));
  else
    w.dilations.assign(nsp, 1);
  return ok_status();
}

/// Output size of one spatial dim. ceil_mode follows ONNX Runtime and PyTorch: a last
/// window that would start past the input and its begin padding is dropped.
StatusOr<int64_t> window_out(int64_t in, int64_t kernel, int64_t stride, int64_t dilation,
                             int64_t pad_begin, int64_t pad_end, bool ceil_mode) {
  const int64_t span = in + pad_begin + pad_end - (dilation * (kernel - 1) + 1);
  if (span < 0)
    return invalid_argument("window of size " + std::to_string(dilation * (kernel - 1) + 1) +
                            " is larger than the padded input of size " +
                            std::to_string(in + pad_begin + pad_end));
  int64_t out = (ceil_mode ? (span + stride - 1) / stride : span / stride) + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad_begin) --out;
  return out;
}

/// Output spatial dims of a windowed op; unknown where the input dim is symbolic.
StatusOr<Shape> window_shape(const InferContext& ctx, const Shape& in_spatial, const Shape& kernel,
                             const Window& w) {
  const size_t nsp = in_spatial.size();
  Shape out;
  for (size_t d = 0; d < nsp; ++d) {
    if (!in_spatial[d].is_static() || !kernel[d].is_static()) {
      out.push_back(Dim::unknown());
      continue;
    }
    StatusOr<int64_t> o = window_out(in_spatial[d].value(), kernel[d].value(), w.strides[d],
                                     w.dilations[d], w.pads[d], w.pads[nsp + d], w.ceil_mode);
    if (!o.ok()) return ctx.error("spatial dim " + std::to_string(d) + ": " + o.status().message());
    out.push_back(*o);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// conv

/// Whether a conv is channels-last (`layout = "nhwc"`): x [N, spatial..., C], w [C_out, k...,
/// C/groups], y [N, out..., C_out], the layout cuDNN and tensor-core kernels read fastest.
StatusOr<bool> conv_channels_last(const Node& node) {
  const std::string layout = node.get_string("layout", "nchw");
  if (layout != "nchw" && layout != "nhwc")
    return invalid_argument("attribute 'layout' must be \"nchw\" or \"nhwc\", got \"" + layout + "\"");
  return layout == "nhwc";
}

/// `s` with its last dim moved to position 1 ([N, sp..., C] -> [N, C, sp...]), or back.
template <typename S>
S channels_to_front(const S& s) {
  S r = {s[0], s.back()};
  r.insert(r.end(), s.begin() + 1, s.end() - 1);
  return r;
}
template <typename S>
S channels_to_back(const S& s) {
  S r = {s[0]};
  r.insert(r.end(), s.begin() + 2, s.end());
  r.push_back(s[1]);
  return r;
}

Status infer_conv(InferContext& ctx) {
  for (int i = 1; i < ctx.num_operands(); ++i) KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 0, i));
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kNumericDTypes));
  StatusOr<bool> cl = conv_channels_last(ctx.node);
  if (!cl.ok()) return ctx.error(cl.status().message());
  // Checked in the [N, C, spatial...] order; a channels-last conv is permuted there and back.
  TensorType x = ctx.operand(0);
  TensorType wt = ctx.operand(1);
  const char* x_form = *cl ? "[N, spatial..., C]" : "[N, C, spatial...]";
  const char* w_form = *cl ? "[C_out, k..., C_in/groups]" : "[C_out, C_in/groups, k...]";
  if (x.rank() < 3 || x.rank() > 5)
    return ctx.error(std::string("operand 'x' must be ") + x_form + " with 1 to 3 spatial dims, got " + x.str());
  if (wt.rank() != x.rank())
    return ctx.error(std::string("operand 'w' must be ") + w_form + " of rank " + std::to_string(x.rank()) +
                     ", got " + wt.str());
  if (*cl) x.shape = channels_to_front(x.shape), wt.shape = channels_to_front(wt.shape);
  const size_t nsp = static_cast<size_t>(x.rank() - 2);
  Window w;
  Status s = read_window(ctx.node, nsp, true, w);
  if (!s.ok()) return ctx.error(s.message());
  const int64_t groups = ctx.node.get_int("groups", 1);
  if (groups < 1)
    return ctx.error("attribute 'groups' must be >= 1, got " + std::to_string(groups));
  const Dim& c = x.shape[1];
  const Dim& c_out = wt.shape[0];
  const std::string g = std::to_string(groups);
  if (c.is_static() && c.value() % groups != 0)
    return ctx.error("input channels " + c.str() + " are not divisible by groups " + g);
  if (c_out.is_static() && c_out.value() % groups != 0)
    return ctx.error("output channels " + c_out.str() + " are not divisible by groups " + g);
  if (c.is_static() && wt.shape[1].is_static() && wt.shape[1].value() * groups != c.value())
    return ctx.error("w " + ctx.operand(1).str() + " expects " + std::to_string(wt.shape[1].value() * groups) +
                     " input channels with groups " + g + ", x " + ctx.operand(0).str() + " has " + c.str());
  if (ctx.num_operands() == 3) {
    const TensorType& bias = ctx.operand(2);
    if (bias.rank() != 1 || dims_conflict(bias.shape[0], c_out))
      return ctx.error("operand 'bias' must be [C_out] = [" + c_out.str() + "], got " + bias.str());
  }
  KILN_ASSIGN_OR_RETURN(Shape spatial,
                        window_shape(ctx, Shape(x.shape.begin() + 2, x.shape.end()),
                                     Shape(wt.shape.begin() + 2, wt.shape.end()), w));
  Shape out = {x.shape[0], c_out};
  out.insert(out.end(), spatial.begin(), spatial.end());
  ctx.results = {TensorType{x.dtype, *cl ? channels_to_back(out) : out}};
  return ok_status();
}

template <typename T>
Status conv_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const Tensor& wt = ctx.input(1);
  Tensor& y = ctx.output();
  KILN_ASSIGN_OR_RETURN(const bool cl, conv_channels_last(ctx.node));
  const Sizes xs = cl ? channels_to_front(x.shape()) : x.shape();
  const Sizes ws = cl ? channels_to_front(wt.shape()) : wt.shape();
  const Sizes ys = cl ? channels_to_front(y.shape()) : y.shape();
  const size_t nsp = xs.size() - 2;
  Window w;
  KILN_RETURN_IF_ERROR(read_window(ctx.node, nsp, true, w));
  const int64_t groups = ctx.node.get_int("groups", 1);
  const int64_t n_batch = xs[0], c_in = xs[1], c_out = ws[0];
  const int64_t cg_in = c_in / groups, cg_out = c_out / groups;
  const Sizes in_sp(xs.begin() + 2, xs.end());
  const Sizes k_sp(ws.begin() + 2, ws.end());
  const Sizes out_sp(ys.begin() + 2, ys.end());
  const int64_t in_plane = product(in_sp), k_plane = product(k_sp), out_plane = product(out_sp);
  // Element strides of a channel and of a spatial position in x, w and y, for either layout.
  const int64_t x_ch = cl ? 1 : in_plane, x_pos = cl ? c_in : 1;
  const int64_t w_ch = cl ? 1 : k_plane, w_tap = cl ? cg_in : 1;
  const int64_t y_ch = cl ? 1 : out_plane, y_pos = cl ? c_out : 1;
  const Sizes in_strides = contiguous_strides(in_sp);
  const std::vector<Sizes> taps = all_indices(k_sp);
  const std::vector<T> xv = elements<T>(x), wv = elements<T>(wt);
  const std::vector<T> bv = ctx.num_inputs() == 3 ? elements<T>(ctx.input(2)) : std::vector<T>();

  Sizes o(nsp, 0);
  for (int64_t op = 0; op < out_plane; ++op, next_index(o, out_sp)) {
    // Input offsets of each kernel tap at this output position (-1: in the padding).
    std::vector<int64_t> tap_off(taps.size());
    for (size_t t = 0; t < taps.size(); ++t) {
      int64_t off = 0;
      for (size_t d = 0; d < nsp && off >= 0; ++d) {
        const int64_t pos = o[d] * w.strides[d] - w.pads[d] + taps[t][d] * w.dilations[d];
        off = (pos < 0 || pos >= in_sp[d]) ? -1 : off + pos * in_strides[d];
      }
      tap_off[t] = off < 0 ? -1 : off * x_pos;
    }
    for (int64_t n = 0; n < n_batch; ++n)
      for (int64_t oc = 0; oc < c_out; ++oc) {
        const int64_t g = oc / cg_out;
        T acc = bv.empty() ? T(0) : bv[static_cast<size_t>(oc)];
        for (int64_t ic = 0; ic < cg_in; ++ic) {
          const T* xp = xv.data() + n * c_in * in_plane + (g * cg_in + ic) * x_ch;
          const T* wp = wv.data() + oc * cg_in * k_plane + ic * w_ch;
          for (size_t t = 0; t < taps.size(); ++t)
            if (tap_off[t] >= 0) acc = mul_add(acc, xp[tap_off[t]], wp[static_cast<int64_t>(t) * w_tap]);
        }
        store(y, n * c_out * out_plane + oc * y_ch + op * y_pos, acc);
      }
  }
  return ok_status();
}

// ---------------------------------------------------------------------------------------
// max_pool, avg_pool

/// Reads a pooling op's window for an input of rank `rank`, checking ONNX's constraints.
Status read_pool_window(const Node& node, int64_t rank, bool is_max, Window& w) {
  const size_t nsp = static_cast<size_t>(rank - 2);
  w.kernel = node.get_ints("kernel_shape");
  if (w.kernel.size() != nsp)
    return invalid_argument("attribute 'kernel_shape' must have " + std::to_string(nsp) +
                            " values, got " + std::to_string(w.kernel.size()));
  for (int64_t k : w.kernel)
    if (k < 1)
      return invalid_argument("attribute 'kernel_shape' values must be >= 1, got " +
                              std::to_string(k));
  KILN_RETURN_IF_ERROR(read_window(node, nsp, is_max, w));
  for (size_t d = 0; d < nsp; ++d) {
    // A window lying entirely in the padding has no defined value (ONNX Runtime refuses it).
    const int64_t eff = w.dilations[d] * (w.kernel[d] - 1) + 1;
    if (w.pads[d] >= eff || w.pads[nsp + d] >= eff)
      return invalid_argument("pads of spatial dim " + std::to_string(d) +
                              " must be smaller than the window size " + std::to_string(eff));
  }
  const int64_t ceil = node.get_int("ceil_mode", 0);
  if (ceil != 0 && ceil != 1)
    return invalid_argument("attribute 'ceil_mode' must be 0 or 1, got " + std::to_string(ceil));
  w.ceil_mode = ceil == 1;
  return ok_status();
}

Status infer_pool(InferContext& ctx, bool is_max) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, is_max ? kNumericDTypes : kFloatDTypes));
  const TensorType& x = ctx.operand(0);
  if (x.rank() < 3) return ctx.error("operand 'x' must be [N, C, spatial...], got " + x.str());
  if (!is_max) KILN_RETURN_IF_ERROR(require_flag(ctx, "count_include_pad"));
  Window w;
  Status s = read_pool_window(ctx.node, x.rank(), is_max, w);
  if (!s.ok()) return ctx.error(s.message());
  KILN_ASSIGN_OR_RETURN(Shape spatial, window_shape(ctx, Shape(x.shape.begin() + 2, x.shape.end()),
                                                    shape_of(w.kernel), w));
  Shape out = {x.shape[0], x.shape[1]};
  out.insert(out.end(), spatial.begin(), spatial.end());
  ctx.results = {TensorType{x.dtype, out}};
  return ok_status();
}

/// Pools every (N, C) plane; max when kMax, else average.
template <typename T, bool kMax>
Status pool_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output();
  Window w;
  KILN_RETURN_IF_ERROR(read_pool_window(ctx.node, x.rank(), kMax, w));
  const bool include_pad = ctx.node.get_int("count_include_pad", 0) == 1;
  const size_t nsp = static_cast<size_t>(x.rank() - 2);
  const Sizes in_sp(x.shape().begin() + 2, x.shape().end());
  const Sizes out_sp(y.shape().begin() + 2, y.shape().end());
  const int64_t in_plane = product(in_sp), out_plane = product(out_sp);
  const int64_t planes = x.shape()[0] * x.shape()[1];
  const Sizes in_strides = contiguous_strides(in_sp);
  const std::vector<Sizes> taps = all_indices(w.kernel);
  const std::vector<T> xv = elements<T>(x);

  Sizes o(nsp, 0);
  for (int64_t op = 0; op < out_plane; ++op, next_index(o, out_sp)) {
    std::vector<int64_t> tap_off;
    for (const Sizes& tap : taps) {
      int64_t off = 0;
      for (size_t d = 0; d < nsp && off >= 0; ++d) {
        const int64_t pos = o[d] * w.strides[d] - w.pads[d] + tap[d] * w.dilations[d];
        off = (pos < 0 || pos >= in_sp[d]) ? -1 : off + pos * in_strides[d];
      }
      if (off >= 0) tap_off.push_back(off);
    }
    // count_include_pad counts the window clipped to the padded input (not the part a
    // ceil_mode window hangs past the end padding), as ONNX Runtime and PyTorch do.
    int64_t padded = 1;
    for (size_t d = 0; d < nsp; ++d) {
      const int64_t start = o[d] * w.strides[d] - w.pads[d];
      padded *= std::min(start + w.kernel[d], in_sp[d] + w.pads[nsp + d]) - start;
    }
    for (int64_t p = 0; p < planes; ++p) {
      const T* xp = xv.data() + p * in_plane;
      if constexpr (kMax) {
        // NaN propagates (as in PyTorch): a NaN in the window makes the result NaN. A window
        // lying wholly in the padding (possible with dilation) gives the dtype's lowest value.
        T m = tap_off.empty() ? lowest<T>(y.dtype()) : xp[tap_off.front()];
        for (int64_t off : tap_off)
          if (xp[off] > m || xp[off] != xp[off]) m = xp[off];
        store(y, p * out_plane + op, m);
      } else {
        double sum = 0;
        for (int64_t off : tap_off) sum += static_cast<double>(xp[off]);
        const int64_t count = include_pad ? padded : static_cast<int64_t>(tap_off.size());
        store(y, p * out_plane + op, sum / static_cast<double>(count));
      }
    }
  }
  return ok_status();
}

Status matmul_reference(KernelContext& ctx) {
  return dispatch_acc(ctx.input(0).dtype(),
                      [&](auto acc) { return matmul_kernel<decltype(acc)>(ctx); });
}
Status linear_reference(KernelContext& ctx) {
  return dispatch_acc(ctx.input(0).dtype(),
                      [&](auto acc) { return linear_kernel<decltype(acc)>(ctx); });
}
Status conv_reference(KernelContext& ctx) {
  return dispatch_acc(ctx.input(0).dtype(),
                      [&](auto acc) { return conv_kernel<decltype(acc)>(ctx); });
}
Status max_pool_reference(KernelContext& ctx) {
  return dispatch_acc(ctx.input(0).dtype(),
                      [&](auto acc) { return pool_kernel<decltype(acc), true>(ctx); });
}
Status avg_pool_reference(KernelContext& ctx) { return pool_kernel<double, false>(ctx); }

}  // namespace

void register_linalg_ops(OpRegistry& r) {
  using AK = AttrKind;
  const AttrSpec strides =
      attr_optional("strides", AK::kInts, "stride per spatial dim (default 1)");
  const AttrSpec pads =
      attr_optional("pads", AK::kInts, "all begin pads, then all end pads (default 0)");
  const AttrSpec dilations =
      attr_optional("dilations", AK::kInts, "dilation per spatial dim (default 1)");
  const AttrSpec kernel_shape =
      attr_required("kernel_shape", AK::kInts, "window size per spatial dim");
  const AttrSpec ceil_mode = attr_default("ceil_mode", int64_t{0}, "round the output size up");

  add_op_or_die(r, {.name = "matmul",
                    .summary = "matrix product, numpy semantics (1-D promotion, batch broadcast)",
                    .traits = kTraitContraction,
                    .inputs = {"a", "b"},
                    .outputs = {"y"},
                    .result_rule = "[.., M, N] from a[.., M, K] x b[.., K, N] (batch dims "
                                   "broadcast; a 1-D operand's dim is dropped), dtype of a",
                    .attrs = {},
                    .num_regions = 0,
                    .infer = infer_matmul,
                    .reference = matmul_reference});
  add_op_or_die(r, {.name = "matmul_acc",
                    .summary = "y = c + a @ b, a GEMM accumulating into c (beta = 1): a gradient summed in f32 "
                               "from bf16/f16 products without a rounded product in between",
                    .traits = kTraitContraction,
                    .inputs = {"a", "b", "c"},
                    .outputs = {"y"},
                    .result_rule = "type of c[M, N], from a[M, K] and b[K, N] of one float dtype; c of that dtype or f32",
                    .attrs = {},
                    .num_regions = 0,
                    .infer = infer_matmul_acc,
                    .reference = matmul_acc_reference});
  add_op_or_die(r, {.name = "linear",
                    .summary = "y = x @ w^T + bias with w of shape [out_features, in_features]",
                    .traits = kTraitContraction,
                    .inputs = {"x", "w", "bias?"},
                    .outputs = {"y"},
                    .result_rule = "[.., N] from x[.., K] and w[N, K], dtype of x",
                    .attrs = {},
                    .num_regions = 0,
                    .infer = infer_linear,
                    .reference = linear_reference});
  add_op_or_die(
      r, {.name = "conv",
          .summary = "N-d grouped convolution of [N, C, spatial...] by [C_out, C/groups, k...] "
                     "(channels last with layout = \"nhwc\")",
          .traits = kTraitContraction,
          .inputs = {"x", "w", "bias?"},
          .outputs = {"y"},
          .result_rule = "[N, C_out, out...] from x[N, C, in...] and w[C_out, C/groups, k...]; out "
                         "= (in + pads - dilation * (k - 1) - 1) / stride + 1, rounded down",
          .attrs = {strides, pads, dilations, attr_default("groups", int64_t{1}, "channel groups"),
                    attr_default("layout", Attribute(std::string("nchw")),
                                 "nchw, or nhwc: x [N, spatial..., C], w [C_out, k..., C/groups], "
                                 "y [N, out..., C_out]")},
          .num_regions = 0,
          .infer = infer_conv,
          .reference = conv_reference});
  add_op_or_die(r,
                {.name = "max_pool",
                 .summary = "N-d max pooling of [N, C, spatial...] (ONNX MaxPool without indices)",
                 .traits = kTraitReduction,
                 .inputs = {"x"},
                 .outputs = {"y"},
                 .result_rule = "[N, C, out...] from x[N, C, in...]; out = (in + pads - dilation * "
                                "(k - 1) - 1) / stride + 1, rounded down (up with ceil_mode)",
                 .attrs = {kernel_shape, strides, pads, dilations, ceil_mode},
                 .num_regions = 0,
                 .infer = [](InferContext& ctx) { return infer_pool(ctx, true); },
                 .reference = max_pool_reference});
  add_op_or_die(r, {.name = "avg_pool",
                    .summary = "N-d average pooling of [N, C, spatial...] (ONNX AveragePool)",
                    .traits = kTraitReduction,
                    .inputs = {"x"},
                    .outputs = {"y"},
                    .result_rule = "[N, C, out...] from x[N, C, in...]; out = (in + pads - k) / "
                                   "stride + 1, rounded down (up with ceil_mode)",
                    .attrs = {kernel_shape, strides, pads, ceil_mode,
                              attr_default("count_include_pad", int64_t{0},
                                           "divide by the window size including padding")},
                    .num_regions = 0,
                    .infer = [](InferContext& ctx) { return infer_pool(ctx, false); },
                    .reference = avg_pool_reference});
}

}  // namespace kiln
