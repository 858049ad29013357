// Core op attention: softmax(q·kᵀ·scale + mask)·v with causal masking and grouped-query heads.
#include <cmath>
#include <limits>

#include "ops/kernel_util.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

using Sizes = std::vector<int64_t>;

bool dims_conflict(const Dim& a, const Dim& b) {
  return a.is_static() && b.is_static() && a.value() != b.value();
}

/// q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv], mask? broadcastable to
/// [B, Hq, Sq, Skv]; result [B, Hq, Sq, Dv] in q's dtype.
Status infer_attention(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kFloatDTypes));
  KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 0, 1));
  KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 0, 2));
  for (int i = 0; i < 3; ++i)
    if (ctx.operand(i).rank() != 4)
      return ctx.error("operand '" + operand_name(ctx, i) + "' must have rank 4 ([B, H, S, D]), got " +
                       ctx.operand(i).str());
  const Shape& q = ctx.operand(0).shape;
  const Shape& k = ctx.operand(1).shape;
  const Shape& v = ctx.operand(2).shape;
  auto mismatch = [&](const char* what, int i, int j) {
    return ctx.error(std::string(what) + " of '" + operand_name(ctx, i) + "' " +
                     ctx.operand(i).str() + " and '" + operand_name(ctx, j) + "' " +
                     ctx.operand(j).str() + " differ");
  };
  if (dims_conflict(q[0], k[0]) || dims_conflict(q[0], v[0])) return mismatch("batch dims", 0, 1);
  if (dims_conflict(k[1], v[1])) return mismatch("head counts", 1, 2);
  if (dims_conflict(k[2], v[2])) return mismatch("key lengths", 1, 2);
  if (dims_conflict(q[3], k[3])) return mismatch("head dims", 0, 1);
  if (q[1].is_static() && k[1].is_static() &&
      (k[1].value() == 0 || q[1].value() % k[1].value() != 0))
    return ctx.error("query heads " + q[1].str() + " are not a multiple of key/value heads " +
                     k[1].str());
  KILN_RETURN_IF_ERROR(require_flag(ctx, "causal"));
  const double scale = ctx.node.get_float("scale");
  if (!std::isfinite(scale)) return ctx.error("attribute 'scale' must be finite");
  if (ctx.num_operands() > 3) {
    KILN_RETURN_IF_ERROR(require_dtype(ctx, 3, kFloatDTypes));
    const TensorType& m = ctx.operand(3);
    const Shape full = {q[0], q[1], q[2], k[2]};
    bool ok = m.rank() <= 4;
    for (size_t d = 0; ok && d < m.shape.size(); ++d) {
      const Dim& md = m.shape[m.shape.size() - 1 - d];
      ok = (md.is_static() && md.value() == 1) || !dims_conflict(md, full[3 - d]);
    }
    if (!ok)
      return ctx.error("operand 'mask' " + m.str() + " does not broadcast to the scores " +
                       shape_str(full));
  }
  ctx.results = {TensorType{ctx.operand(0).dtype, {q[0], q[1], q[2], v[3]}}};
  return ok_status();
}

/// Exact softmax in f64 per query row; a row that sees no key is NaN, as the decomposed
/// softmax over all -inf scores is.
Status attention_reference(KernelContext& ctx) {
  const Sizes& qs = ctx.input(0).shape();
  const Sizes& ks = ctx.input(1).shape();
  const Sizes& vs = ctx.input(2).shape();
  const int64_t B = qs[0], Hq = qs[1], Sq = qs[2], D = qs[3];
  const int64_t Hkv = ks[1], Skv = ks[2], Dv = vs[3];
  if (Hkv == 0 || Hq % Hkv != 0)
    return ctx.error("query heads " + std::to_string(Hq) + " are not a multiple of key/value heads " +
                     std::to_string(Hkv));
  const double scale = ctx.node.get_float("scale");
  const bool causal = ctx.node.get_int("causal") != 0;
  const std::vector<double> q = ctx.input(0).to_f64(), k = ctx.input(1).to_f64(),
                            v = ctx.input(2).to_f64();
  const bool has_mask = ctx.num_inputs() > 3;
  const std::vector<double> mask = has_mask ? ctx.input(3).to_f64() : std::vector<double>();
  // Mask strides over [B, Hq, Sq, Skv]: right-aligned, 0 where the mask broadcasts.
  Sizes ms(4, 0);
  if (has_mask) {
    const Sizes& mshape = ctx.input(3).shape();
    const Sizes cs = contiguous_strides(mshape);
    const size_t lead = 4 - mshape.size();
    for (size_t d = 0; d < mshape.size(); ++d) ms[lead + d] = mshape[d] == 1 ? 0 : cs[d];
  }
  const double ninf = -std::numeric_limits<double>::infinity();
  std::vector<double> s(static_cast<size_t>(Skv)), acc(static_cast<size_t>(Dv));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / (Hq / Hkv);
      const double* kb = k.data() + (b * Hkv + hk) * Skv * D;
      const double* vb = v.data() + (b * Hkv + hk) * Skv * Dv;
      for (int64_t i = 0; i < Sq; ++i) {
        const double* qr = q.data() + ((b * Hq + h) * Sq + i) * D;
        double mx = ninf;
        for (int64_t j = 0; j < Skv; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kb[j * D + d];
          double x = dot * scale;
          if (has_mask) x += mask[static_cast<size_t>(b * ms[0] + h * ms[1] + i * ms[2] + j * ms[3])];
          if (causal && j > i + (Skv - Sq)) x = ninf;
          s[static_cast<size_t>(j)] = x;
          mx = std::max(mx, x);
        }
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - mx));
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < Skv; ++j)
          for (int64_t d = 0; d < Dv; ++d)
            acc[static_cast<size_t>(d)] += s[static_cast<size_t>(j)] * vb[j * Dv + d];
        const int64_t base = ((b * Hq + h) * Sq + i) * Dv;
        for (int64_t d = 0; d < Dv; ++d)
          ctx.output().set_f64(base + d, acc[static_cast<size_t>(d)] / sum);
      }
    }
  return ok_status();
}

}  // namespace

void register_attention_ops(OpRegistry& r) {
  add_op_or_die(r, {.name = "attention",
                    .summary = "softmax(q·kᵀ·scale + mask)·v over the last axis; causal and "
                               "grouped-query heads",
                    .traits = kTraitContraction | kTraitReduction,
                    .inputs = {"q", "k", "v", "mask?"},
                    .outputs = {"y"},
                    .result_rule = "[B, Hq, Sq, Dv] from q[B, Hq, Sq, D], k[B, Hkv, Skv, D], "
                                   "v[B, Hkv, Skv, Dv]; dtype of q",
                    .attrs = {attr_required("scale", AttrKind::kFloat, "multiplies q·kᵀ"),
                              attr_default("causal", int64_t{0},
                                           "1: query i sees keys j <= i + (Skv - Sq)")},
                    .num_regions = 0,
                    .infer = infer_attention,
                    .reference = attention_reference});
}

}  // namespace kiln
