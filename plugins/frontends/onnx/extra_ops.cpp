// Ops this plugin adds for ONNX ops Kiln's core set cannot express: inverse trigonometry,
// scatters and top-k. Each has a shape rule and a reference kernel like a core op.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "importer.h"
#include "kiln/ir/op.h"

namespace kiln::onnx_fe {
namespace {

using Sizes = std::vector<int64_t>;

Status float_unary_infer(InferContext& ctx) {
  if (!is_float(ctx.operand(0).dtype))
    return ctx.error("operand 'x' must be float, got " + std::string(dtype_name(ctx.operand(0).dtype)));
  ctx.results = {ctx.operand(0)};
  return ok_status();
}

OpDef float_unary(const char* name, const char* summary, double (*f)(double)) {
  return OpDef{.name = name,
               .summary = summary,
               .traits = kTraitElementwise,
               .inputs = {"x"},
               .outputs = {"y"},
               .result_rule = "same as x",
               .attrs = {},
               .infer = float_unary_infer,
               .reference = [f](KernelContext& ctx) {
                 const Tensor& x = ctx.input(0);
                 for (int64_t i = 0; i < x.numel(); ++i) ctx.output().set_f64(i, f(x.get_f64(i)));
                 return ok_status();
               }};
}

/// Applies a scatter reduction to element `i` of `y`.
Status combine(Tensor& y, int64_t i, const Tensor& u, int64_t j, const std::string& red) {
  if (is_float(y.dtype())) {
    const double a = y.get_f64(i), b = u.get_f64(j);
    y.set_f64(i, red == "add" ? a + b : red == "mul" ? a * b : red == "max" ? std::max(a, b)
                 : red == "min" ? std::min(a, b) : b);
  } else {
    const int64_t a = y.get_i64(i), b = u.get_i64(j);
    y.set_i64(i, red == "add" ? a + b : red == "mul" ? a * b : red == "max" ? std::max(a, b)
                 : red == "min" ? std::min(a, b) : b);
  }
  return ok_status();
}

Status check_reduction(const InferContext& ctx) {
  const std::string r = ctx.node.get_string("reduction", "none");
  if (r != "none" && r != "add" && r != "mul" && r != "max" && r != "min")
    return ctx.error("attribute 'reduction' must be none, add, mul, max or min, got '" + r + "'");
  return ok_status();
}

Status infer_scatter_elements(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(check_reduction(ctx));
  const TensorType &d = ctx.operand(0), &idx = ctx.operand(1), &u = ctx.operand(2);
  if (idx.dtype != DType::kI32 && idx.dtype != DType::kI64)
    return ctx.error("operand 'indices' must be i32 or i64, got " + idx.str());
  if (u.dtype != d.dtype) return ctx.error("operand 'updates' " + u.str() + " must have data's dtype " + d.str());
  if (idx.rank() != d.rank() || idx.shape != u.shape)
    return ctx.error("indices " + idx.str() + " and updates " + u.str() + " must match and have data's rank");
  const int64_t axis = ctx.node.get_int("axis", 0);
  if (axis < -d.rank() || axis >= d.rank()) return ctx.error("axis " + std::to_string(axis) + " is out of range");
  ctx.results = {d};
  return ok_status();
}

Status scatter_elements_kernel(KernelContext& ctx) {
  const Tensor &d = ctx.input(0), &idx = ctx.input(1), &u = ctx.input(2);
  Tensor& y = ctx.output();
  for (int64_t i = 0; i < d.numel(); ++i) is_float(d.dtype()) ? y.set_f64(i, d.get_f64(i)) : y.set_i64(i, d.get_i64(i));
  const int64_t rank = d.rank();
  int64_t axis = ctx.node.get_int("axis", 0);
  if (axis < 0) axis += rank;
  const std::string red = ctx.node.get_string("reduction", "none");
  Sizes pos(static_cast<size_t>(rank), 0);
  for (int64_t j = 0; j < idx.numel(); ++j) {
    int64_t off = 0, rem = j;
    for (int64_t a = rank - 1; a >= 0; --a) {
      pos[static_cast<size_t>(a)] = rem % idx.shape()[static_cast<size_t>(a)];
      rem /= idx.shape()[static_cast<size_t>(a)];
    }
    const int64_t dim = d.shape()[static_cast<size_t>(axis)];
    int64_t k = idx.get_i64(j);
    if (k < -dim || k >= dim) return ctx.error("index " + std::to_string(k) + " is out of range for size " + std::to_string(dim));
    pos[static_cast<size_t>(axis)] = k < 0 ? k + dim : k;
    for (int64_t a = 0; a < rank; ++a) off = off * d.shape()[static_cast<size_t>(a)] + pos[static_cast<size_t>(a)];
    KILN_RETURN_IF_ERROR(combine(y, off, u, j, red));
  }
  return ok_status();
}

Status infer_scatter_nd(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(check_reduction(ctx));
  const TensorType &d = ctx.operand(0), &idx = ctx.operand(1), &u = ctx.operand(2);
  if (idx.dtype != DType::kI64 && idx.dtype != DType::kI32) return ctx.error("operand 'indices' must be i64, got " + idx.str());
  if (u.dtype != d.dtype) return ctx.error("operand 'updates' " + u.str() + " must have data's dtype " + d.str());
  if (idx.rank() < 1 || !idx.shape.back().is_static()) return ctx.error("indices need a static last dim");
  const int64_t k = idx.shape.back().value();
  if (k > d.rank()) return ctx.error("indices' last dim " + std::to_string(k) + " exceeds data's rank");
  Shape want(idx.shape.begin(), idx.shape.end() - 1);
  want.insert(want.end(), d.shape.begin() + k, d.shape.end());
  if (want.size() != u.shape.size()) return ctx.error("updates must have shape " + shape_str(want) + ", got " + u.str());
  ctx.results = {d};
  return ok_status();
}

Status scatter_nd_kernel(KernelContext& ctx) {
  const Tensor &d = ctx.input(0), &idx = ctx.input(1), &u = ctx.input(2);
  Tensor& y = ctx.output();
  for (int64_t i = 0; i < d.numel(); ++i) is_float(d.dtype()) ? y.set_f64(i, d.get_f64(i)) : y.set_i64(i, d.get_i64(i));
  const int64_t k = idx.shape().back(), n = idx.numel() / std::max<int64_t>(k, 1);
  int64_t slice = 1;
  for (size_t a = static_cast<size_t>(k); a < d.shape().size(); ++a) slice *= d.shape()[a];
  const std::string red = ctx.node.get_string("reduction", "none");
  for (int64_t t = 0; t < n; ++t) {
    int64_t off = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t dim = d.shape()[static_cast<size_t>(j)];
      int64_t v = idx.get_i64(t * k + j);
      if (v < -dim || v >= dim) return ctx.error("index " + std::to_string(v) + " is out of range for size " + std::to_string(dim));
      off = off * dim + (v < 0 ? v + dim : v);
    }
    for (int64_t e = 0; e < slice; ++e) KILN_RETURN_IF_ERROR(combine(y, off * slice + e, u, t * slice + e, red));
  }
  return ok_status();
}

Status infer_top_k(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  if (x.rank() < 1) return ctx.error("operand 'x' must have rank >= 1");
  int64_t axis = ctx.node.get_int("axis", -1);
  if (axis < -x.rank() || axis >= x.rank()) return ctx.error("axis " + std::to_string(axis) + " is out of range");
  if (axis < 0) axis += x.rank();
  const int64_t k = ctx.node.get_int("k", 0);
  const Dim& dim = x.shape[static_cast<size_t>(axis)];
  if (k < 0 || (dim.is_static() && k > dim.value()))
    return ctx.error("k " + std::to_string(k) + " is out of range for axis of size " + dim.str());
  Shape out = x.shape;
  out[static_cast<size_t>(axis)] = k;
  ctx.results = {TensorType{x.dtype, out}, TensorType{DType::kI64, out}};
  return ok_status();
}

Status top_k_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  int64_t axis = ctx.node.get_int("axis", -1);
  if (axis < 0) axis += x.rank();
  const int64_t k = ctx.node.get_int("k", 0);
  const bool largest = ctx.node.get_int("largest", 1) != 0;
  const Sizes& s = x.shape();
  int64_t outer = 1, inner = 1;
  for (int64_t a = 0; a < axis; ++a) outer *= s[static_cast<size_t>(a)];
  for (size_t a = static_cast<size_t>(axis) + 1; a < s.size(); ++a) inner *= s[a];
  const int64_t n = s[static_cast<size_t>(axis)];
  const std::vector<double> v = x.to_f64();
  Sizes order(static_cast<size_t>(n));
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      auto at = [&](int64_t j) { return v[static_cast<size_t>((o * n + j) * inner + i)]; };
      std::iota(order.begin(), order.end(), 0);
      // Ties keep the lower index first, as onnx asks.
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return largest ? at(a) > at(b) : at(a) < at(b);
      });
      for (int64_t j = 0; j < k; ++j) {
        const int64_t src = (o * n + order[static_cast<size_t>(j)]) * inner + i, dst = (o * k + j) * inner + i;
        if (is_float(x.dtype())) ctx.output(0).set_f64(dst, x.get_f64(src));
        else ctx.output(0).set_i64(dst, x.get_i64(src));
        ctx.output(1).set_i64(dst, order[static_cast<size_t>(j)]);
      }
    }
  return ok_status();
}

// --- max_pool_indices ----------------------------------------------------------------

/// Row-major multi-index of flat position `i` in `dims`.
Sizes unflatten(int64_t i, const Sizes& dims) {
  Sizes idx(dims.size());
  for (size_t d = dims.size(); d-- > 0;) {
    idx[d] = dims[d] == 0 ? 0 : i % dims[d];
    i = dims[d] == 0 ? 0 : i / dims[d];
  }
  return idx;
}

Status infer_max_pool_indices(InferContext& ctx) {
  const TensorType &x = ctx.operand(0), &y = ctx.operand(1);
  if (x.rank() < 3 || y.rank() != x.rank()) return ctx.error("operands must be [N, C, spatial...] of one rank");
  const size_t n = static_cast<size_t>(x.rank() - 2);
  const Sizes kernel = ctx.node.get_ints("kernel_shape"), strides = ctx.node.get_ints("strides"),
              pads = ctx.node.get_ints("pads"), dil = ctx.node.get_ints("dilations");
  auto in_range = [](const Sizes& v, int64_t lo) {
    return std::all_of(v.begin(), v.end(), [lo](int64_t x) { return x >= lo && x <= (int64_t{1} << 20); });
  };
  if (kernel.size() != n || !in_range(kernel, 1)) return ctx.error("kernel_shape needs one value in [1, 2^20] per spatial dim");
  if ((!strides.empty() && strides.size() != n) || !in_range(strides, 1) || (!dil.empty() && dil.size() != n) ||
      !in_range(dil, 1) || (!pads.empty() && pads.size() != 2 * n) || !in_range(pads, 0))
    return ctx.error("strides, dilations (in [1, 2^20]) and pads (in [0, 2^20]) must match the spatial rank");
  ctx.results = {TensorType{DType::kI64, y.shape}};
  return ok_status();
}

Status max_pool_indices_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& out = ctx.output();
  const Sizes& xs = x.shape();
  const Sizes& ys = out.shape();
  const size_t n = xs.size() - 2;
  const Sizes kernel = ctx.node.get_ints("kernel_shape");
  Sizes strides = ctx.node.get_ints("strides"), pads = ctx.node.get_ints("pads"), dil = ctx.node.get_ints("dilations");
  if (strides.empty()) strides.assign(n, 1);
  if (pads.empty()) pads.assign(2 * n, 0);
  if (dil.empty()) dil.assign(n, 1);
  const bool col_major = ctx.node.get_int("storage_order", 0) != 0;
  const std::vector<double> v = x.to_f64();
  const Sizes in_sp(xs.begin() + 2, xs.end());
  int64_t plane = 1, taps = 1;
  for (int64_t d : in_sp) plane *= d;
  for (int64_t k : kernel) taps *= k;
  for (int64_t i = 0; i < out.numel(); ++i) {
    const Sizes o = unflatten(i, ys);
    const int64_t base = (o[0] * xs[1] + o[1]) * plane;
    int64_t best = -1, best_idx = 0;
    for (int64_t t = 0; t < taps; ++t) {
      const Sizes tap = unflatten(t, kernel);
      int64_t off = 0, cm = 0;
      bool inside = true;
      for (size_t d = 0; d < n && inside; ++d) {
        const int64_t p = o[d + 2] * strides[d] - pads[d] + tap[d] * dil[d];
        inside = p >= 0 && p < in_sp[d];
        off = off * in_sp[d] + p;
      }
      if (!inside) continue;
      const double val = v[static_cast<size_t>(base + off)];
      if (best < 0 || val > v[static_cast<size_t>(best)] || (std::isnan(val) && !std::isnan(v[static_cast<size_t>(best)]))) {
        best = base + off;
        // Column-major numbering reverses the order of the spatial dims.
        const Sizes pos = unflatten(off, in_sp);
        for (size_t d = n; d-- > 0;) cm = cm * in_sp[d] + pos[d];
        best_idx = base + (col_major ? cm : off);
      }
    }
    out.set_i64(i, best_idx);
  }
  return ok_status();
}

// --- det ---------------------------------------------------------------------------------

Status infer_det(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  if (!is_float(x.dtype)) return ctx.error("operand 'x' must be float, got " + x.str());
  if (x.rank() < 2 || x.shape[x.shape.size() - 1] != x.shape[x.shape.size() - 2])
    return ctx.error("operand 'x' must be [..., n, n], got " + x.str());
  ctx.results = {TensorType{x.dtype, Shape(x.shape.begin(), x.shape.end() - 2)}};
  return ok_status();
}

Status det_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const int64_t n = x.shape().back(), count = ctx.output().numel();
  const std::vector<double> v = x.to_f64();
  for (int64_t b = 0; b < count; ++b) {
    std::vector<double> a(v.begin() + b * n * n, v.begin() + (b + 1) * n * n);
    double det = 1;
    // LU decomposition with partial pivoting.
    for (int64_t col = 0; col < n; ++col) {
      int64_t piv = col;
      for (int64_t r = col + 1; r < n; ++r)
        if (std::fabs(a[static_cast<size_t>(r * n + col)]) > std::fabs(a[static_cast<size_t>(piv * n + col)])) piv = r;
      if (piv != col) {
        for (int64_t k = 0; k < n; ++k) std::swap(a[static_cast<size_t>(piv * n + k)], a[static_cast<size_t>(col * n + k)]);
        det = -det;
      }
      const double p = a[static_cast<size_t>(col * n + col)];
      det *= p;
      if (p == 0) break;
      for (int64_t r = col + 1; r < n; ++r) {
        const double f = a[static_cast<size_t>(r * n + col)] / p;
        for (int64_t k = col; k < n; ++k) a[static_cast<size_t>(r * n + k)] -= f * a[static_cast<size_t>(col * n + k)];
      }
    }
    ctx.output().set_f64(b, det);
  }
  return ok_status();
}

// --- grid_sample (PyTorch's grid_sample semantics, which onnx adopted) ---------------------

Status infer_grid_sample(InferContext& ctx) {
  const TensorType &x = ctx.operand(0), &g = ctx.operand(1);
  if (!is_float(x.dtype) || g.dtype != x.dtype) return ctx.error("operands must be float of one dtype");
  if (x.rank() != 4 || g.rank() != 4 || g.shape[3] != Dim(2))
    return ctx.error("needs X [N, C, H, W] and grid [N, H_out, W_out, 2], got " + x.str() + " and " + g.str());
  const std::string mode = ctx.node.get_string("mode", "bilinear"), pad = ctx.node.get_string("padding_mode", "zeros");
  if (mode != "bilinear" && mode != "nearest" && mode != "bicubic") return ctx.error("unknown mode '" + mode + "'");
  if (pad != "zeros" && pad != "border" && pad != "reflection") return ctx.error("unknown padding_mode '" + pad + "'");
  ctx.results = {TensorType{x.dtype, {x.shape[0], x.shape[1], g.shape[1], g.shape[2]}}};
  return ok_status();
}

double reflect(double in, double twice_low, double twice_high) {
  if (twice_low == twice_high) return 0;
  const double lo = twice_low / 2, span = (twice_high - twice_low) / 2;
  in = std::fabs(in - lo);
  const double extra = std::fmod(in, span);
  const int64_t flips = static_cast<int64_t>(std::floor(in / span));
  return flips % 2 == 0 ? extra + lo : span - extra + lo;
}

/// Applies the padding mode to a source coordinate.
double pad_coord(double c, int64_t size, const std::string& pad, bool align) {
  if (pad == "border") return std::clamp(c, 0.0, static_cast<double>(size - 1));
  if (pad == "reflection") {
    c = align ? reflect(c, 0, 2.0 * static_cast<double>(size - 1)) : reflect(c, -1, 2.0 * static_cast<double>(size) - 1);
    return std::clamp(c, 0.0, static_cast<double>(size - 1));
  }
  return c;
}

double cubic(double x0, double x1, double x2, double x3, double t) {
  const double a = -0.75;
  auto c1 = [a](double x) { return ((a + 2) * x - (a + 3)) * x * x + 1; };
  auto c2 = [a](double x) { return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a; };
  return x0 * c2(t + 1) + x1 * c1(t) + x2 * c1(1 - t) + x3 * c2(2 - t);
}

Status grid_sample_kernel(KernelContext& ctx) {
  const Tensor &x = ctx.input(0), &g = ctx.input(1);
  Tensor& out = ctx.output();
  const int64_t nb = x.shape()[0], ch = x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  const int64_t ho = g.shape()[1], wo = g.shape()[2];
  const std::string mode = ctx.node.get_string("mode", "bilinear"), pad = ctx.node.get_string("padding_mode", "zeros");
  const bool align = ctx.node.get_int("align_corners", 0) != 0;
  const std::vector<double> xv = x.to_f64(), gv = g.to_f64();
  auto unnorm = [align](double c, int64_t size) {
    return align ? (c + 1) / 2 * static_cast<double>(size - 1) : ((c + 1) * static_cast<double>(size) - 1) / 2;
  };
  for (int64_t n = 0; n < nb; ++n)
    for (int64_t c = 0; c < ch; ++c) {
      const double* img = xv.data() + (n * ch + c) * h * w;
      auto at = [&](int64_t yy, int64_t xx) {
        return (yy >= 0 && yy < h && xx >= 0 && xx < w) ? img[yy * w + xx] : 0.0;
      };
      for (int64_t oy = 0; oy < ho; ++oy)
        for (int64_t ox = 0; ox < wo; ++ox) {
          const double* gp = gv.data() + ((n * ho + oy) * wo + ox) * 2;
          double ix = unnorm(gp[0], w), iy = unnorm(gp[1], h), val = 0;
          if (mode == "bicubic") {
            // Each tap gets the padding mode on its own.
            auto tap = [&](double yy, double xx) {
              xx = pad_coord(xx, w, pad, align);
              yy = pad_coord(yy, h, pad, align);
              return at(static_cast<int64_t>(yy), static_cast<int64_t>(xx));
            };
            const double fx = std::floor(ix), fy = std::floor(iy), tx = ix - fx, ty = iy - fy;
            double rows[4];
            for (int i = 0; i < 4; ++i)
              rows[i] = cubic(tap(fy - 1 + i, fx - 1), tap(fy - 1 + i, fx), tap(fy - 1 + i, fx + 1), tap(fy - 1 + i, fx + 2), tx);
            val = cubic(rows[0], rows[1], rows[2], rows[3], ty);
          } else {
            ix = pad_coord(ix, w, pad, align);
            iy = pad_coord(iy, h, pad, align);
            if (mode == "nearest") {
              val = at(static_cast<int64_t>(std::nearbyint(iy)), static_cast<int64_t>(std::nearbyint(ix)));
            } else {
              const double fx = std::floor(ix), fy = std::floor(iy), tx = ix - fx, ty = iy - fy;
              const int64_t x0 = static_cast<int64_t>(fx), y0 = static_cast<int64_t>(fy);
              val = at(y0, x0) * (1 - tx) * (1 - ty) + at(y0, x0 + 1) * tx * (1 - ty) +
                    at(y0 + 1, x0) * (1 - tx) * ty + at(y0 + 1, x0 + 1) * tx * ty;
            }
          }
          out.set_f64(((n * ch + c) * ho + oy) * wo + ox, val);
        }
    }
  return ok_status();
}

// --- roi_align ---------------------------------------------------------------------------

Status infer_roi_align(InferContext& ctx) {
  const TensorType &x = ctx.operand(0), &rois = ctx.operand(1), &idx = ctx.operand(2);
  if (!is_float(x.dtype) || rois.dtype != x.dtype) return ctx.error("X and rois must be float of one dtype");
  if (x.rank() != 4 || rois.rank() != 2 || rois.shape[1] != Dim(4) || idx.rank() != 1 || idx.dtype != DType::kI64)
    return ctx.error("needs X [N, C, H, W], rois [R, 4] and batch_indices i64[R]");
  const std::string mode = ctx.node.get_string("mode", "avg");
  if (mode != "avg" && mode != "max") return ctx.error("unknown mode '" + mode + "'");
  const int64_t oh = ctx.node.get_int("output_height", 1), ow = ctx.node.get_int("output_width", 1);
  if (oh < 1 || ow < 1) return ctx.error("output sizes must be positive");
  const int64_t ratio = ctx.node.get_int("sampling_ratio", 0);
  if (ratio < 0 || ratio > 1024) return ctx.error("sampling_ratio must be in [0, 1024], got " + std::to_string(ratio));
  if (!std::isfinite(ctx.node.get_float("spatial_scale", 1.0))) return ctx.error("spatial_scale must be finite");
  ctx.results = {TensorType{x.dtype, {rois.shape[0], x.shape[1], Dim(oh), Dim(ow)}}};
  return ok_status();
}

Status roi_align_kernel(KernelContext& ctx) {
  const Tensor &x = ctx.input(0), &rois = ctx.input(1), &bidx = ctx.input(2);
  Tensor& out = ctx.output();
  const int64_t nb = x.shape()[0], ch = x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  const int64_t nr = rois.shape()[0], oh = out.shape()[2], ow = out.shape()[3];
  const bool half = ctx.node.get_int("half_pixel", 1) != 0, is_max = ctx.node.get_string("mode", "avg") == "max";
  const double scale = ctx.node.get_float("spatial_scale", 1.0), off = half ? 0.5 : 0.0;
  const int64_t ratio = ctx.node.get_int("sampling_ratio", 0);
  const std::vector<double> xv = x.to_f64(), rv = rois.to_f64();
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t b = bidx.get_i64(r);
    if (b < 0 || b >= nb) return ctx.error("batch index " + std::to_string(b) + " is out of range");
    const double* roi = rv.data() + r * 4;
    const double sw = roi[0] * scale - off, sh = roi[1] * scale - off;
    double rw = roi[2] * scale - off - sw, rh = roi[3] * scale - off - sh;
    if (!half) {
      rw = std::max(rw, 1.0);
      rh = std::max(rh, 1.0);
    }
    const double bh = rh / static_cast<double>(oh), bw = rw / static_cast<double>(ow);
    const int64_t gh = ratio > 0 ? ratio : static_cast<int64_t>(std::ceil(rh / static_cast<double>(oh)));
    const int64_t gw = ratio > 0 ? ratio : static_cast<int64_t>(std::ceil(rw / static_cast<double>(ow)));
    const double count = static_cast<double>(std::max<int64_t>(gh * gw, 1));
    for (int64_t c = 0; c < ch; ++c) {
      const double* img = xv.data() + (b * ch + c) * h * w;
      for (int64_t ph = 0; ph < oh; ++ph)
        for (int64_t pw = 0; pw < ow; ++pw) {
          double acc = is_max ? -std::numeric_limits<double>::infinity() : 0;
          bool any = false;
          for (int64_t iy = 0; iy < gh; ++iy)
            for (int64_t ix = 0; ix < gw; ++ix) {
              double y = sh + static_cast<double>(ph) * bh + (static_cast<double>(iy) + 0.5) * bh / static_cast<double>(gh);
              double xx = sw + static_cast<double>(pw) * bw + (static_cast<double>(ix) + 0.5) * bw / static_cast<double>(gw);
              double v[4] = {0, 0, 0, 0}, wt[4] = {0, 0, 0, 0};
              if (!(y < -1.0 || y > static_cast<double>(h) || xx < -1.0 || xx > static_cast<double>(w))) {
                y = std::max(y, 0.0);
                xx = std::max(xx, 0.0);
                int64_t y0 = static_cast<int64_t>(y), x0 = static_cast<int64_t>(xx), y1, x1;
                if (y0 >= h - 1) { y1 = y0 = h - 1; y = static_cast<double>(y0); } else { y1 = y0 + 1; }
                if (x0 >= w - 1) { x1 = x0 = w - 1; xx = static_cast<double>(x0); } else { x1 = x0 + 1; }
                const double ly = y - static_cast<double>(y0), lx = xx - static_cast<double>(x0), hy = 1 - ly, hx = 1 - lx;
                wt[0] = hy * hx; wt[1] = hy * lx; wt[2] = ly * hx; wt[3] = ly * lx;
                v[0] = img[y0 * w + x0]; v[1] = img[y0 * w + x1]; v[2] = img[y1 * w + x0]; v[3] = img[y1 * w + x1];
              }
              if (is_max) {
                // Onnxruntime's max mode: the largest weighted corner of each sample.
                for (int k = 0; k < 4; ++k) acc = std::max(acc, wt[k] * v[k]);
                any = true;
              } else {
                for (int k = 0; k < 4; ++k) acc += wt[k] * v[k];
              }
            }
          out.set_f64(((r * ch + c) * oh + ph) * ow + pw, is_max ? (any ? acc : 0) : acc / count);
        }
    }
  }
  return ok_status();
}

// --- tfidf_vectorizer ----------------------------------------------------------------------

Status infer_tfidf(InferContext& ctx) {
  const TensorType& x = ctx.operand(0);
  if (x.dtype != DType::kI32 && x.dtype != DType::kI64) return ctx.error("operand 'x' must be i32 or i64, got " + x.str());
  if (x.rank() != 1 && x.rank() != 2) return ctx.error("operand 'x' must be [N] or [B, N], got " + x.str());
  const Sizes idx = ctx.node.get_ints("ngram_indexes"), counts = ctx.node.get_ints("ngram_counts");
  const int64_t mn = ctx.node.get_int("min_gram_length", 1), mx = ctx.node.get_int("max_gram_length", 1);
  if (idx.empty() || mn < 1 || mx < mn || static_cast<int64_t>(counts.size()) < mx)
    return ctx.error("ngram_indexes, ngram_counts and gram lengths are inconsistent");
  const std::string mode = ctx.node.get_string("mode", "TF");
  if (mode != "TF" && mode != "IDF" && mode != "TFIDF") return ctx.error("unknown mode '" + mode + "'");
  const Sizes pool = ctx.node.get_ints("pool_int64s");
  for (size_t i = 0; i < counts.size(); ++i)
    if (counts[i] < 0 || counts[i] > static_cast<int64_t>(pool.size()) || (i > 0 && counts[i] < counts[i - 1]))
      return ctx.error("ngram_counts must be non-decreasing offsets into the pool");
  if (ctx.node.get_int("max_skip_count", 0) < 0) return ctx.error("max_skip_count must not be negative");
  for (int64_t i : idx)
    if (i < 0) return ctx.error("ngram_indexes must not be negative");
  const int64_t width = *std::max_element(idx.begin(), idx.end()) + 1;
  Shape out = x.rank() == 2 ? Shape{x.shape[0], Dim(width)} : Shape{Dim(width)};
  ctx.results = {TensorType{DType::kF32, out}};
  return ok_status();
}

Status tfidf_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& out = ctx.output();
  const Sizes pool = ctx.node.get_ints("pool_int64s"), counts = ctx.node.get_ints("ngram_counts"),
              idx = ctx.node.get_ints("ngram_indexes");
  const std::vector<double> weights = ctx.node.get_floats("weights");
  const int64_t mn = ctx.node.get_int("min_gram_length", 1), mx = ctx.node.get_int("max_gram_length", 1),
                skips = ctx.node.get_int("max_skip_count", 0);
  const std::string mode = ctx.node.get_string("mode", "TF");
  const int64_t rows = x.rank() == 2 ? x.shape()[0] : 1, len = x.shape().back(), width = out.shape().back();
  // n-grams of length n occupy pool[counts[n-1] .. counts[n]); the k-th n-gram overall maps
  // to output column idx[k].
  auto lookup = [&](const Sizes& gram) -> int64_t {
    const int64_t n = static_cast<int64_t>(gram.size());
    const int64_t begin = counts[static_cast<size_t>(n - 1)];
    const int64_t end = n < static_cast<int64_t>(counts.size()) ? counts[static_cast<size_t>(n)] : static_cast<int64_t>(pool.size());
    int64_t k = 0;
    for (int64_t m = 1; m < n; ++m) {
      const int64_t b = counts[static_cast<size_t>(m - 1)];
      const int64_t e = m < static_cast<int64_t>(counts.size()) ? counts[static_cast<size_t>(m)] : static_cast<int64_t>(pool.size());
      k += (e - b) / m;
    }
    for (int64_t p = begin; p + n <= end; p += n, ++k)
      if (std::equal(gram.begin(), gram.end(), pool.begin() + p))
        return k >= 0 && k < static_cast<int64_t>(idx.size()) ? idx[static_cast<size_t>(k)] : -1;
    return -1;
  };
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> tf(static_cast<size_t>(width), 0.0);
    for (int64_t s = 0; s < len; ++s)
      for (int64_t n = mn; n <= mx; ++n)
        // A skip of len or more leaves room for one item only: no n-gram of n >= 2 fits.
        for (int64_t sk = 0; sk <= (n == 1 ? 0 : std::min(skips, len)); ++sk) {
          Sizes gram;
          for (int64_t j = 0; j < n && s + j * (sk + 1) < len; ++j) gram.push_back(x.get_i64(r * len + s + j * (sk + 1)));
          if (static_cast<int64_t>(gram.size()) != n) continue;
          const int64_t col = lookup(gram);
          if (col >= 0 && col < width) tf[static_cast<size_t>(col)] += 1;
        }
    for (int64_t j = 0; j < width; ++j) {
      const double wgt = static_cast<size_t>(j) < weights.size() ? weights[static_cast<size_t>(j)] : 1.0;
      const double t = tf[static_cast<size_t>(j)];
      out.set_f64(r * width + j, mode == "TF" ? t : mode == "IDF" ? (t > 0 ? wgt : 0) : t * wgt);
    }
  }
  return ok_status();
}

}  // namespace

Status register_extra_ops() {
  OpRegistry& r = OpRegistry::global();
  std::vector<OpDef> defs;
  defs.push_back(float_unary("asin", "arcsine", [](double x) { return std::asin(x); }));
  defs.push_back(float_unary("acos", "arccosine", [](double x) { return std::acos(x); }));
  defs.push_back(float_unary("atan", "arctangent", [](double x) { return std::atan(x); }));
  const std::string red_doc = "how updates combine with data: none, add, mul, max or min";
  defs.push_back(OpDef{.name = "scatter_elements",
                       .summary = "copies data, then writes updates at per-element indices along an axis",
                       .traits = kTraitNone,
                       .inputs = {"data", "indices", "updates"},
                       .outputs = {"y"},
                       .result_rule = "same as data",
                       .attrs = {AttrSpec{"axis", AttrKind::kInt, false, Attribute(0), "indexed axis"},
                                 AttrSpec{"reduction", AttrKind::kString, false, Attribute("none"), red_doc}},
                       .infer = infer_scatter_elements,
                       .reference = scatter_elements_kernel});
  defs.push_back(OpDef{.name = "scatter_nd",
                       .summary = "copies data, then writes update slices at index tuples",
                       .traits = kTraitNone,
                       .inputs = {"data", "indices", "updates"},
                       .outputs = {"y"},
                       .result_rule = "same as data",
                       .attrs = {AttrSpec{"reduction", AttrKind::kString, false, Attribute("none"), red_doc}},
                       .infer = infer_scatter_nd,
                       .reference = scatter_nd_kernel});
  defs.push_back(OpDef{.name = "top_k",
                       .summary = "the k largest (or smallest) values along an axis and their indices",
                       .traits = kTraitReduction,
                       .inputs = {"x"},
                       .outputs = {"values", "indices"},
                       .result_rule = "values: x's shape with `axis` of size k, dtype of x; indices: that shape, i64",
                       .attrs = {AttrSpec{"k", AttrKind::kInt, true, std::nullopt, "how many values"},
                                 AttrSpec{"axis", AttrKind::kInt, false, Attribute(-1), "searched axis"},
                                 AttrSpec{"largest", AttrKind::kInt, false, Attribute(1), "1: largest, 0: smallest"},
                                 AttrSpec{"sorted", AttrKind::kInt, false, Attribute(1), "results are always sorted"}},
                       .infer = infer_top_k,
                       .reference = top_k_kernel});
  defs.push_back(OpDef{.name = "max_pool_indices",
                       .summary = "flat input index of each max_pool maximum (onnx MaxPool's Indices)",
                       .traits = kTraitReduction,
                       .inputs = {"x", "pooled"},
                       .outputs = {"indices"},
                       .result_rule = "i64, shape of pooled",
                       .attrs = {AttrSpec{"kernel_shape", AttrKind::kInts, true, std::nullopt, "window size"},
                                 AttrSpec{"strides", AttrKind::kInts, false, std::nullopt, "strides"},
                                 AttrSpec{"pads", AttrKind::kInts, false, std::nullopt, "begin pads, then end pads"},
                                 AttrSpec{"dilations", AttrKind::kInts, false, std::nullopt, "dilations"},
                                 AttrSpec{"ceil_mode", AttrKind::kInt, false, Attribute(0), "as max_pool"},
                                 AttrSpec{"storage_order", AttrKind::kInt, false, Attribute(0), "1: column-major spatial numbering"}},
                       .infer = infer_max_pool_indices,
                       .reference = max_pool_indices_kernel});
  defs.push_back(OpDef{.name = "det",
                       .summary = "determinant of each square matrix in the last two dims",
                       .traits = kTraitNone,
                       .inputs = {"x"},
                       .outputs = {"y"},
                       .result_rule = "x's shape without its last two dims, dtype of x",
                       .attrs = {},
                       .infer = infer_det,
                       .reference = det_kernel});
  defs.push_back(OpDef{.name = "grid_sample",
                       .summary = "samples X at the normalized grid positions (bilinear, nearest or bicubic)",
                       .traits = kTraitNone,
                       .inputs = {"x", "grid"},
                       .outputs = {"y"},
                       .result_rule = "[N, C, H_out, W_out] from x[N, C, H, W] and grid[N, H_out, W_out, 2], dtype of x",
                       .attrs = {AttrSpec{"mode", AttrKind::kString, false, Attribute("bilinear"), "interpolation"},
                                 AttrSpec{"padding_mode", AttrKind::kString, false, Attribute("zeros"), "zeros, border or reflection"},
                                 AttrSpec{"align_corners", AttrKind::kInt, false, Attribute(0), "-1 and 1 are pixel centers"}},
                       .infer = infer_grid_sample,
                       .reference = grid_sample_kernel});
  defs.push_back(OpDef{.name = "roi_align",
                       .summary = "average- or max-pooled bilinear samples of regions of interest",
                       .traits = kTraitNone,
                       .inputs = {"x", "rois", "batch_indices"},
                       .outputs = {"y"},
                       .result_rule = "[num_rois, C, output_height, output_width], dtype of x",
                       .attrs = {AttrSpec{"mode", AttrKind::kString, false, Attribute("avg"), "avg or max"},
                                 AttrSpec{"output_height", AttrKind::kInt, false, Attribute(1), "pooled height"},
                                 AttrSpec{"output_width", AttrKind::kInt, false, Attribute(1), "pooled width"},
                                 AttrSpec{"sampling_ratio", AttrKind::kInt, false, Attribute(0), "samples per bin (0: adaptive)"},
                                 AttrSpec{"spatial_scale", AttrKind::kFloat, false, Attribute(1.0), "roi to input scale"},
                                 AttrSpec{"half_pixel", AttrKind::kInt, false, Attribute(1), "shift roi by half a pixel"}},
                       .infer = infer_roi_align,
                       .reference = roi_align_kernel});
  defs.push_back(OpDef{.name = "tfidf_vectorizer",
                       .summary = "n-gram (with skips) term frequencies of integer sequences, optionally weighted",
                       .traits = kTraitNone,
                       .inputs = {"x"},
                       .outputs = {"y"},
                       .result_rule = "f32 [max(ngram_indexes) + 1], with x's batch dim first when x is [B, N]",
                       .attrs = {AttrSpec{"mode", AttrKind::kString, false, Attribute("TF"), "TF, IDF or TFIDF"},
                                 AttrSpec{"min_gram_length", AttrKind::kInt, false, Attribute(1), "shortest n-gram"},
                                 AttrSpec{"max_gram_length", AttrKind::kInt, false, Attribute(1), "longest n-gram"},
                                 AttrSpec{"max_skip_count", AttrKind::kInt, false, Attribute(0), "most items skipped between n-gram items"},
                                 AttrSpec{"ngram_counts", AttrKind::kInts, true, std::nullopt, "start of each n-gram length in the pool"},
                                 AttrSpec{"ngram_indexes", AttrKind::kInts, true, std::nullopt, "output column of each pooled n-gram"},
                                 AttrSpec{"pool_int64s", AttrKind::kInts, true, std::nullopt, "the n-grams, shortest first"},
                                 AttrSpec{"weights", AttrKind::kFloats, false, std::nullopt, "per-column weights"}},
                       .infer = infer_tfidf,
                       .reference = tfidf_kernel});
  for (OpDef& d : defs) {
    if (r.find(d.name) != nullptr) continue;  // already added (or now part of Kiln's core set)
    KILN_RETURN_IF_ERROR(r.add(std::move(d)));
  }
  return ok_status();
}

}  // namespace kiln::onnx_fe
