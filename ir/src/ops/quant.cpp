// FP8 quantization ops: quantize, requantize, dequantize, scaled_matmul (one node per FP8 GEMM),
// amax, delayed_scaling_update (one tensor's amax history and scale, one step on) and
// delayed_scaling_step_scale (the scale a step uses when an empty history takes the current amax's).
#include <cmath>
#include <limits>

#include "ops/kernel_util.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

bool is_f8(DType t) { return t == DType::kF8E4M3FN || t == DType::kF8E5M2; }

/// A per-tensor scale: one f32 element (rank 0 or [1]).
Status require_scale(const InferContext& ctx, int i) {
  const TensorType& s = ctx.operand(i);
  const bool one = s.rank() == 0 || (s.rank() == 1 && s.shape[0].is_static() && s.shape[0].value() == 1);
  if (s.dtype != DType::kF32 || !one)
    return ctx.error("operand '" + operand_name(ctx, i) + "' must be a per-tensor scale f32[] or f32[1], got " +
                     s.str());
  return ok_status();
}

Status require_f8(const InferContext& ctx, int i) {
  if (!is_f8(ctx.operand(i).dtype))
    return ctx.error("operand '" + operand_name(ctx, i) + "' must be f8e4m3fn or f8e5m2, got " +
                     ctx.operand(i).str());
  return ok_status();
}

/// The `dtype` attribute, checked against the allowed result dtypes.
StatusOr<DType> result_dtype(const InferContext& ctx, DType fallback, std::initializer_list<DType> allowed) {
  const Attribute* a = ctx.node.attr("dtype");
  const DType t = a ? a->as_dtype() : fallback;
  std::string names;
  for (DType d : allowed) {
    if (d == t) return t;
    names += (names.empty() ? "" : ", ") + std::string(dtype_name(d));
  }
  return ctx.error("attribute 'dtype' must be one of " + names + ", got " + std::string(dtype_name(t)));
}

/// Rounds to the f8 format, saturating finite overflow (and inf) to the largest finite value.
double to_f8(DType t, double v) {
  return t == DType::kF8E4M3FN ? f8e4m3fn_bits_to_f32(f64_to_f8e4m3fn_bits(v, true))
                               : f8e5m2_bits_to_f32(f64_to_f8e5m2_bits(v, true));
}

Status quantize_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kFloatDTypes));
  if (is_f8(ctx.operand(0).dtype)) return ctx.error("operand 'x' is already " + ctx.operand(0).str());
  KILN_RETURN_IF_ERROR(require_scale(ctx, 1));
  KILN_ASSIGN_OR_RETURN(DType t, result_dtype(ctx, DType::kF8E4M3FN, {DType::kF8E4M3FN, DType::kF8E5M2}));
  ctx.results = {TensorType{t, ctx.operand(0).shape}};
  return ok_status();
}

// The quotient is an f32 division, as on the GPU (and in PyTorch's (x / scale).to(f8)): a
// division in f64 rounds differently wherever x / scale lies within an f32 ulp of a tie
// between two f8 values, which "round" scales such as 0.01 make common (~1% of bf16 inputs).
Status quantize_into(const Tensor& x, const Tensor& scale_tensor, Tensor& y) {
  const float scale = static_cast<float>(scale_tensor.get_f64(0));
  for (int64_t i = 0; i < x.numel(); ++i)
    y.set_f64(i, to_f8(y.dtype(), static_cast<float>(x.get_f64(i)) / scale));
  return ok_status();
}

Status quantize_kernel(KernelContext& ctx) { return quantize_into(ctx.input(0), ctx.input(1), ctx.output()); }

Status requantize_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kFloatDTypes));
  if (is_f8(ctx.operand(0).dtype)) return ctx.error("operand 'x' is already " + ctx.operand(0).str());
  KILN_RETURN_IF_ERROR(require_f8(ctx, 1));
  KILN_RETURN_IF_ERROR(require_scale(ctx, 2));
  KILN_RETURN_IF_ERROR(require_scale(ctx, 3));
  if (ctx.operand(1).shape != ctx.operand(0).shape)
    return ctx.error("operand 'q' must have the shape of x " + ctx.operand(0).str() + ", got " + ctx.operand(1).str());
  ctx.results = {TensorType{ctx.operand(1).dtype, ctx.operand(0).shape}};
  return ok_status();
}

// quantize(x, scale) into q's dtype: q (quantize(x, q_scale)) only lets a backend skip the work
// when scale == q_scale, so the reference never reads it.
Status requantize_kernel(KernelContext& ctx) { return quantize_into(ctx.input(0), ctx.input(3), ctx.output()); }

Status dequantize_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_f8(ctx, 0));
  KILN_RETURN_IF_ERROR(require_scale(ctx, 1));
  KILN_ASSIGN_OR_RETURN(DType t, result_dtype(ctx, DType::kF32, {DType::kF32, DType::kBF16, DType::kF16}));
  ctx.results = {TensorType{t, ctx.operand(0).shape}};
  return ok_status();
}

Status dequantize_kernel(KernelContext& ctx) {
  const Tensor& q = ctx.input(0);
  // An f32 product, as on the GPU, then rounded to the result dtype.
  const float scale = static_cast<float>(ctx.input(1).get_f64(0));
  for (int64_t i = 0; i < q.numel(); ++i) ctx.output().set_f64(i, static_cast<float>(q.get_f64(i)) * scale);
  return ok_status();
}

Status scaled_matmul_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_f8(ctx, 0));
  KILN_RETURN_IF_ERROR(require_f8(ctx, 1));
  KILN_RETURN_IF_ERROR(require_scale(ctx, 2));
  KILN_RETURN_IF_ERROR(require_scale(ctx, 3));
  KILN_ASSIGN_OR_RETURN(DType t, result_dtype(ctx, DType::kF32, {DType::kF32, DType::kBF16, DType::kF16}));
  const int64_t fast = ctx.node.get_int("fast_accumulation", 1);
  if (fast != 0 && fast != 1) return ctx.error("attribute 'fast_accumulation' must be 0 or 1, got " + std::to_string(fast));
  const std::string fallback = ctx.node.get_string("fallback", "none");
  if (fallback != "none" && fallback != "bf16")
    return ctx.error("attribute 'fallback' must be none or bf16, got '" + fallback + "'");
  const TensorType& a = ctx.operand(0);
  const TensorType& b = ctx.operand(1);
  if (a.rank() < 1) return ctx.error("operand 'a' must have rank >= 1, got " + a.str());
  if (b.rank() != 2) return ctx.error("operand 'b' must be [n, k], got " + b.str());
  const Dim& ka = a.shape.back();
  if (ka.is_static() && b.shape[1].is_static() && ka.value() != b.shape[1].value())
    return ctx.error("contraction dims differ: a is " + a.str() + ", b is " + b.str());
  if (ctx.num_operands() == 5) {
    const TensorType& bias = ctx.operand(4);
    if (bias.dtype != t || bias.rank() != 1 ||
        (bias.shape[0].is_static() && b.shape[0].is_static() && bias.shape[0].value() != b.shape[0].value()))
      return ctx.error("operand 'bias' must be " + std::string(dtype_name(t)) + "[" + b.shape[0].str() + "], got " +
                       bias.str());
  }
  Shape out = a.shape;
  out.back() = b.shape[0];
  ctx.results = {TensorType{t, out}};
  return ok_status();
}

Status scaled_matmul_kernel(KernelContext& ctx) {
  const std::vector<double> av = ctx.input(0).to_f64(), bv = ctx.input(1).to_f64();
  const std::vector<double> bias = ctx.num_inputs() == 5 ? ctx.input(4).to_f64() : std::vector<double>();
  const double scale = ctx.input(2).get_f64(0) * ctx.input(3).get_f64(0);
  const int64_t n = ctx.input(1).shape()[0], k = ctx.input(1).shape()[1];
  const int64_t rows = n == 0 ? 0 : ctx.output().numel() / n;
  ctx.output().mutable_data();  // copy on write happens here, once, not in the threads below
  parallel_ranges(rows, n * k, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t o = 0; o < n; ++o) {
        double acc = 0;
        for (int64_t i = 0; i < k; ++i) acc += av[static_cast<size_t>(r * k + i)] * bv[static_cast<size_t>(o * k + i)];
        ctx.output().set_f64(r * n + o, acc * scale + (bias.empty() ? 0.0 : bias[static_cast<size_t>(o)]));
      }
  });
  return ok_status();
}

Status amax_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kFloatDTypes));
  ctx.results = {TensorType{DType::kF32, {}}};
  return ok_status();
}

Status amax_kernel(KernelContext& ctx) {
  double m = 0;
  const Tensor& x = ctx.input(0);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double v = std::fabs(x.get_f64(i));
    if (std::isnan(v)) {  // a nan must not hide behind the max: it poisons the scale visibly
      m = v;
      break;
    }
    m = std::max(m, v);
  }
  ctx.output().set_f64(0, m);
  return ok_status();
}

/// delayed scaling's f32 factor 2^margin / max_finite(dtype).
float scale_factor(const Node& n) {
  const DType f = n.attr("dtype") ? n.attr("dtype")->as_dtype() : DType::kF8E4M3FN;
  return static_cast<float>(std::ldexp(1.0, static_cast<int>(n.get_int("margin", 0))) /
                            f8_max_finite(f));
}

/// A max that a nan poisons, as reduce_max's.
float nan_max(float m, float v) { return std::isnan(m) ? m : ((std::isnan(v) || v > m) ? v : m); }

/// Operands amax, history and scale of the delayed-scaling ops.
Status check_delayed_scaling_operands(const InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_scale(ctx, 0));
  KILN_RETURN_IF_ERROR(require_scale(ctx, 2));
  const TensorType& h = ctx.operand(1);
  if (h.dtype != DType::kF32 || h.rank() != 1 || !h.shape[0].is_static() || h.shape[0].value() < 1)
    return ctx.error("operand 'history' must be f32[H] with a static H >= 1, got " + h.str());
  return ok_status();
}

Status check_format_and_margin(const InferContext& ctx) {
  const DType f = ctx.node.attr("dtype") ? ctx.node.attr("dtype")->as_dtype() : DType::kF8E4M3FN;
  if (!is_f8(f)) return ctx.error("attribute 'dtype' must be f8e4m3fn or f8e5m2, got " + std::string(dtype_name(f)));
  const int64_t margin = ctx.node.get_int("margin", 0);
  if (margin < -64 || margin > 64) return ctx.error("attribute 'margin' must be within [-64, 64], got " + std::to_string(margin));
  return ok_status();
}

Status delayed_scaling_update_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(check_delayed_scaling_operands(ctx));
  if (ctx.num_operands() == 4) {
    const TensorType& d = ctx.operand(3);
    if (d.dtype != DType::kBool || !is_static(d.shape) || num_elements(d.shape) != 1)
      return ctx.error("operand 'due' must be one bool, got " + d.str());
  }
  KILN_RETURN_IF_ERROR(check_format_and_margin(ctx));
  const std::string algo = ctx.node.get_string("algorithm", "max");
  if (algo != "max" && algo != "most_recent")
    return ctx.error("attribute 'algorithm' must be max or most_recent, got '" + algo + "'");
  ctx.results = {ctx.operand(1), ctx.operand(2)};
  return ok_status();
}

// Every step in f32, as the graph of core ops it stands for computes it (delayed_scaling.h):
// the f32 factor 2^margin / max_finite, an f32 product, a max that a nan poisons.
Status delayed_scaling_update_kernel(KernelContext& ctx) {
  const float amax = static_cast<float>(ctx.input(0).get_f64(0));
  const Tensor& hist = ctx.input(1);
  const float scale = static_cast<float>(ctx.input(2).get_f64(0));
  const int64_t h = hist.numel();
  Tensor& out = ctx.output(0);
  out.set_f64(0, amax);
  float m = amax;
  for (int64_t j = 1; j < h; ++j) {
    const float v = static_cast<float>(hist.get_f64(j - 1));
    out.set_f64(j, v);
    m = nan_max(m, v);
  }
  if (ctx.node.get_string("algorithm", "max") != "max") m = amax;
  const float factor = scale_factor(ctx.node);
  // A nan compares false: an all-zero or non-finite history leaves the scale as it was.
  bool update = m > 0.0f && m <= std::numeric_limits<float>::max();
  if (ctx.num_inputs() == 4) update = update && ctx.input(3).get_f64(0) != 0.0;
  ctx.output(1).set_f64(0, update ? m * factor : scale);
  return ok_status();
}

Status delayed_scaling_step_scale_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(check_delayed_scaling_operands(ctx));
  KILN_RETURN_IF_ERROR(check_format_and_margin(ctx));
  ctx.results = {ctx.operand(2)};
  return ok_status();
}

// where(max(history) > 0, scale, where(amax finite and > 0, amax * factor, scale)), in f32 with
// a max that a nan poisons (then the history counts as empty), as the core ops it stands for.
Status delayed_scaling_step_scale_kernel(KernelContext& ctx) {
  const float amax = static_cast<float>(ctx.input(0).get_f64(0));
  const Tensor& hist = ctx.input(1);
  const float scale = static_cast<float>(ctx.input(2).get_f64(0));
  float seen = static_cast<float>(hist.get_f64(0));
  for (int64_t j = 1; j < hist.numel(); ++j) seen = nan_max(seen, static_cast<float>(hist.get_f64(j)));
  const bool own_ok = amax > 0.0f && amax <= std::numeric_limits<float>::max();
  ctx.output().set_f64(0, seen > 0.0f ? scale : (own_ok ? amax * scale_factor(ctx.node) : scale));
  return ok_status();
}

}  // namespace

void register_quant_ops(OpRegistry& r) {
  add_op_or_die(r, {.name = "quantize",
                    .summary = "q = x / scale (an f32 division) rounded to nearest even into an f8 dtype, saturating",
                    .traits = kTraitNone,
                    .inputs = {"x", "scale"},
                    .outputs = {"q"},
                    .result_rule = "dtype `dtype`, shape of x",
                    .attrs = {attr_default("dtype", DType::kF8E4M3FN, "f8e4m3fn or f8e5m2")},
                    .num_regions = 0,
                    .infer = quantize_infer,
                    .reference = quantize_kernel});
  add_op_or_die(r, {.name = "requantize",
                    .summary = "quantize(x, scale) where q is quantize(x, q_scale): backends may return q when the "
                               "scales are equal (FP8 delayed scaling with a just-in-time first step)",
                    .traits = kTraitNone,
                    .inputs = {"x", "q", "q_scale", "scale"},
                    .outputs = {"y"},
                    .result_rule = "dtype of q, shape of x",
                    .attrs = {},
                    .num_regions = 0,
                    .infer = requantize_infer,
                    .reference = requantize_kernel});
  add_op_or_die(r, {.name = "dequantize",
                    .summary = "y = q * scale (an f32 product), from an f8 dtype to f32, bf16 or f16",
                    .traits = kTraitNone,
                    .inputs = {"q", "scale"},
                    .outputs = {"y"},
                    .result_rule = "dtype `dtype`, shape of q",
                    .attrs = {attr_default("dtype", DType::kF32, "f32, bf16 or f16")},
                    .num_regions = 0,
                    .infer = dequantize_infer,
                    .reference = dequantize_kernel});
  add_op_or_die(
      r, {.name = "scaled_matmul",
          .summary = "y = (a * a_scale) @ (b * b_scale)^T + bias with f8 a [.., k] and b [n, k] (one FP8 GEMM)",
          .traits = kTraitContraction,
          .inputs = {"a", "b", "a_scale", "b_scale", "bias?"},
          .outputs = {"y"},
          .result_rule = "[.., N] from a[.., K] and b[N, K], dtype `dtype`",
          .attrs = {attr_default("dtype", DType::kF32, "result dtype: f32, bf16 or f16"),
                    attr_default("fallback", "none",
                                 "on a target without FP8: none refuses, bf16 runs a GEMM in the result dtype on dequantized operands"),
                    attr_default("fast_accumulation", int64_t{1},
                                 "1: the tensor cores may keep the running sum in their reduced-precision FP8 accumulator "
                                 "(faster; Transformer Engine's forward GEMMs); 0: promote it to f32 as the sum goes (its "
                                 "backward GEMMs, whose long sums over tokens lose accuracy otherwise)")},
          .num_regions = 0,
          .infer = scaled_matmul_infer,
          .reference = scaled_matmul_kernel});
  add_op_or_die(r, {.name = "amax",
                    .summary = "max |x| over every element as f32[] (nan if any element is nan)",
                    .traits = kTraitReduction,
                    .inputs = {"x"},
                    .outputs = {"y"},
                    .result_rule = "f32[]",
                    .attrs = {},
                    .num_regions = 0,
                    .infer = amax_infer,
                    .reference = amax_kernel});
  add_op_or_die(
      r, {.name = "delayed_scaling_update",
          .summary = "one step of FP8 delayed scaling for one tensor: history' = [amax, history[0 .. H-2]] (newest "
                     "first); scale' = m * 2^margin / max_finite(dtype), m = max(history') (algorithm max) or amax "
                     "(most_recent), where m is finite and positive (and due holds), else scale",
          .traits = kTraitNone,
          .inputs = {"amax", "history", "scale", "due?"},
          .outputs = {"history_out", "scale_out"},
          .result_rule = "the types of history and scale",
          .attrs = {attr_default("dtype", DType::kF8E4M3FN, "the f8 format the scale serves: f8e4m3fn or f8e5m2"),
                    attr_default("algorithm", "max", "max or most_recent"),
                    attr_default("margin", int64_t{0}, "the scale leaves 2^margin headroom, within [-64, 64]")},
          .num_regions = 0,
          .infer = delayed_scaling_update_infer,
          .reference = delayed_scaling_update_kernel});
  add_op_or_die(
      r, {.name = "delayed_scaling_step_scale",
          .summary = "the scale a step of FP8 delayed scaling quantizes with when an empty history takes the current "
                     "amax's (just in time): scale once max(history) > 0, else amax * 2^margin / max_finite(dtype) "
                     "where amax is finite and positive, else scale",
          .traits = kTraitNone,
          .inputs = {"amax", "history", "scale"},
          .outputs = {"y"},
          .result_rule = "the type of scale",
          .attrs = {attr_default("dtype", DType::kF8E4M3FN, "the f8 format the scale serves: f8e4m3fn or f8e5m2"),
                    attr_default("margin", int64_t{0}, "the scale leaves 2^margin headroom, within [-64, 64]")},
          .num_regions = 0,
          .infer = delayed_scaling_step_scale_infer,
          .reference = delayed_scaling_step_scale_kernel});
}

}  // namespace kiln
