// Weight-only INT4 ops: matmul_int4, a linear whose weights are packed 4-bit integers with
// one scale (and, asymmetric, one zero point) per group of input features.
//
// Layout (the contract between the quantize-int4 pass, this reference and the CUDA kernels):
//   w       u8 [N, K/2]   element (n, k) is byte (n, k/2); even k in the low nibble, odd k in
//                         the high nibble. Packed as u8 rather than the IR's i4 dtype so that the
//                         operand's shape is its byte layout and both nibble readings (signed,
//                         unsigned) use one storage type.
//   scales  f16|bf16 [N, K/G]   one scale per row and group of G consecutive k.
//   zeros   same dtype as scales, [N, K/G] (asymmetric only).
//   symmetric:  w(n, k) = q * scale        with q the nibble read as signed, -8..7
//   asymmetric: w(n, k) = (q - zero) * scale with q the nibble read as unsigned, 0..15
//   y[..., n] = sum_k x[..., k] * w(n, k) + bias[n], computed exactly, rounded once.
#include <cmath>
#include <string>
#include <vector>

#include "ops/kernel_util.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

/// Whether operand 3 holds zero points (asymmetric) rather than the bias.
bool asymmetric(const Node& n) { return n.get_int("asymmetric", 0) == 1; }

bool half_float(DType t) { return t == DType::kF16 || t == DType::kBF16; }

Status infer_matmul_int4(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_flag(ctx, "asymmetric"));
  const bool asym = asymmetric(ctx.node);
  const int64_t g = ctx.node.get_int("group_size");
  if (g != 32 && g != 64 && g != 128)
    return ctx.error("attribute 'group_size' must be 32, 64 or 128, got " + std::to_string(g));
  const TensorType& x = ctx.operand(0);
  const TensorType& w = ctx.operand(1);
  const TensorType& s = ctx.operand(2);
  if (x.dtype != DType::kF32 && !half_float(x.dtype))
    return ctx.error("operand 'x' must be f32, f16 or bf16, got " + x.str());
  if (x.rank() < 1) return ctx.error("operand 'x' must have rank >= 1, got " + x.str());
  if (w.dtype != DType::kU8 || w.rank() != 2)
    return ctx.error("operand 'w' must be u8[N, K/2] (two 4-bit values per byte), got " + w.str());
  if (!half_float(s.dtype) || s.rank() != 2)
    return ctx.error("operand 'scales' must be f16 or bf16 [N, K/group_size], got " + s.str());
  if (asym && ctx.num_operands() < 4)
    return ctx.error("asymmetric matmul_int4 needs operand 'zeros'");
  if (!asym && ctx.num_operands() > 4)
    return ctx.error("symmetric matmul_int4 takes no zeros: operands are x, w, scales and an optional bias");
  const int zeros_at = asym ? 3 : -1, bias_at = asym ? 4 : 3;
  const Dim& k = x.shape.back();
  const Dim& n = w.shape[0];
  auto conflict = [](const Dim& a, const Dim& b) { return a.is_static() && b.is_static() && a.value() != b.value(); };
  if (k.is_static()) {
    if (k.value() % g != 0)
      return ctx.error("in_features " + k.str() + " of x " + x.str() + " is not a multiple of group_size " +
                       std::to_string(g));
    if (conflict(w.shape[1], Dim(k.value() / 2)))
      return ctx.error("w " + w.str() + " must hold K/2 = " + std::to_string(k.value() / 2) +
                       " bytes per row for x " + x.str());
    if (conflict(s.shape[1], Dim(k.value() / g)))
      return ctx.error("scales " + s.str() + " must have K/group_size = " + std::to_string(k.value() / g) +
                       " columns for x " + x.str());
  }
  if (conflict(s.shape[0], n)) return ctx.error("scales " + s.str() + " must have one row per row of w " + w.str());
  if (zeros_at >= 0) {
    const TensorType& z = ctx.operand(zeros_at);
    if (z.dtype != s.dtype || z.shape != s.shape)
      return ctx.error("operand 'zeros' must match scales " + s.str() + ", got " + z.str());
  }
  if (ctx.num_operands() > bias_at) {
    const TensorType& b = ctx.operand(bias_at);
    if (b.dtype != x.dtype || b.rank() != 1 || conflict(b.shape[0], n))
      return ctx.error("operand 'bias' must be " + std::string(dtype_name(x.dtype)) + "[" + n.str() + "], got " +
                       b.str());
  }
  Shape out = x.shape;
  out.back() = n;
  ctx.results = {TensorType{x.dtype, out}};
  return ok_status();
}

/// The weights as f64 [N, K], dequantized exactly as the layout comment above says.
std::vector<double> dequantize(const KernelContext& ctx, int64_t n, int64_t k, int64_t g) {
  const bool asym = asymmetric(ctx.node);
  const uint8_t* w = ctx.input(1).data_as<uint8_t>();
  const std::vector<double> s = ctx.input(2).to_f64();
  const std::vector<double> z = asym ? ctx.input(3).to_f64() : std::vector<double>();
  std::vector<double> out(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const int nib = (w[r * (k / 2) + c / 2] >> (c % 2 * 4)) & 0xF;
      const size_t gi = static_cast<size_t>(r * (k / g) + c / g);
      const double q = asym ? nib - z[gi] : (nib >= 8 ? nib - 16 : nib);
      out[static_cast<size_t>(r * k + c)] = q * s[gi];
    }
  return out;
}

Status matmul_int4_reference(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const int64_t k = x.shape().back(), n = ctx.input(1).shape()[0];
  const int64_t rows = k == 0 ? 0 : x.numel() / k;
  const int bias_at = asymmetric(ctx.node) ? 4 : 3;
  const std::vector<double> w = dequantize(ctx, n, k, ctx.node.get_int("group_size"));
  const std::vector<double> xv = x.to_f64();
  const std::vector<double> b = ctx.num_inputs() > bias_at ? ctx.input(bias_at).to_f64() : std::vector<double>();
  if (k == 0) {
    for (int64_t i = 0; i < ctx.output().numel(); ++i) ctx.output().set_f64(i, b.empty() ? 0 : b[static_cast<size_t>(i % n)]);
    return ok_status();
  }
  ctx.output().mutable_data();  // copy on write happens here, once, not in the threads below
  parallel_ranges(rows, n * k, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t o = 0; o < n; ++o) {
        double acc = b.empty() ? 0 : b[static_cast<size_t>(o)];
        const double* wr = w.data() + o * k;
        const double* xr = xv.data() + r * k;
        for (int64_t i = 0; i < k; ++i) acc += xr[i] * wr[i];
        ctx.output().set_f64(r * n + o, acc);
      }
  });
  return ok_status();
}

}  // namespace

void register_int4_ops(OpRegistry& r) {
  add_op_or_die(
      r, {.name = "matmul_int4",
          .summary = "y = x @ dequant(w)^T + bias with w packed int4 [N, K/2] and per-group scales (zeros)",
          .traits = kTraitContraction,
          .inputs = {"x", "w", "scales", "zeros?", "bias?"},
          .outputs = {"y"},
          .result_rule = "[.., N] from x[.., K] and w[N, K/2], dtype of x",
          .attrs = {attr_required("group_size", AttrKind::kInt, "input features per scale: 32, 64 or 128"),
                    attr_default("asymmetric", int64_t{0},
                                 "1: nibbles are unsigned with zero points in operand 3 (bias is operand 4); "
                                 "0: nibbles are signed -8..7 and operand 3 is the bias")},
          .num_regions = 0,
          .infer = infer_matmul_int4,
          .reference = matmul_int4_reference});
}

}  // namespace kiln
