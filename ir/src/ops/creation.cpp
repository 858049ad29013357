// Creation core ops: constant (a tensor held in an attribute) and range.
#include <cmath>
#include <cstdio>
#include <string>

#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

/// Short form of a number for diagnostics: "0.5", "3", "1e-07", "inf".
std::string num_str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

/// Checks range's attributes and returns its length.
StatusOr<int64_t> range_length(const InferContext& ctx) {
  const DType t = ctx.node.attr("dtype") ? ctx.node.attr("dtype")->as_dtype() : DType::kI64;
  if (t == DType::kBool) return ctx.error("dtype must be float or integer, got bool");
  const double start = ctx.node.get_float("start"), limit = ctx.node.get_float("limit"),
               delta = ctx.node.get_float("delta");
  for (auto [name, v] : {std::pair{"start", start}, {"limit", limit}, {"delta", delta}}) {
    if (!std::isfinite(v))
      return ctx.error("attribute '" + std::string(name) + "' must be finite, got " + num_str(v));
    // 2^61 keeps limit - start well within int64.
    if (is_integer(t) && (v != std::trunc(v) || std::fabs(v) > 0x1p61))
      return ctx.error("attribute '" + std::string(name) + "' must be an integer for dtype " +
                       std::string(dtype_name(t)) + ", got " + num_str(v));
  }
  if (delta == 0) return ctx.error("attribute 'delta' must not be zero");
  if (is_float(t)) {
    const double len = std::ceil((limit - start) / delta);
    if (len > 0x1p53) return ctx.error("length " + num_str(len) + " is too large");
    return len > 0 ? static_cast<int64_t>(len) : 0;
  }
  // Exact ceiling division in int64 for integer dtypes.
  const int64_t s = static_cast<int64_t>(start), l = static_cast<int64_t>(limit),
                d = static_cast<int64_t>(delta);
  const int64_t span = l - s;
  if (span == 0 || (span > 0) != (d > 0)) return int64_t{0};
  const int64_t len = span / d + (span % d != 0 ? 1 : 0);
  const auto [lo, hi] = int_dtype_range(t);
  const int64_t last = s + (len - 1) * d;
  for (int64_t v : {s, last})
    if (v < lo || v > hi)
      return ctx.error("value " + std::to_string(v) + " does not fit dtype " +
                       std::string(dtype_name(t)));
  return len;
}

}  // namespace

void register_creation_ops(OpRegistry& r) {
  add_op_or_die(r,
                OpDef{.name = "constant",
                      .summary = "a tensor fixed at compile time",
                      .traits = kTraitConstant,
                      .inputs = {},
                      .outputs = {"y"},
                      .result_rule = "the type of `value`",
                      .attrs = {attr_required("value", AttrKind::kTensor, "the tensor to produce")},
                      .infer = [](InferContext& ctx) -> Status {
                        const Attribute* value = ctx.node.attr("value");
                        if (value == nullptr)
                          return ctx.error("missing required attribute 'value'");
                        ctx.results = {value->as_tensor().type()};
                        return ok_status();
                      },
                      // Tensor storage is shared, so this hands out the constant without copying.
                      .reference =
                          [](KernelContext& ctx) {
                            ctx.output(0) = ctx.node.attr("value")->as_tensor();
                            return ok_status();
                          }});

  add_op_or_die(r, OpDef{.name = "range",
                         .summary = "start, start + delta, ... up to but excluding limit",
                         .traits = kTraitNone,
                         .inputs = {},
                         .outputs = {"y"},
                         .result_rule = "[max(0, ceil((limit - start) / delta))] of `dtype`",
                         .attrs = {attr_required("start", AttrKind::kFloat, "first value"),
                                   attr_required("limit", AttrKind::kFloat, "exclusive bound"),
                                   attr_required("delta", AttrKind::kFloat, "step, not zero"),
                                   attr_default("dtype", DType::kI64, "element type")},
                         .infer = [](InferContext& ctx) -> Status {
                           KILN_ASSIGN_OR_RETURN(int64_t len, range_length(ctx));
                           const Attribute* t = ctx.node.attr("dtype");
                           ctx.results = {TensorType{t ? t->as_dtype() : DType::kI64, {Dim(len)}}};
                           return ok_status();
                         },
                         .reference =
                             [](KernelContext& ctx) {
                               Tensor& y = ctx.output(0);
                               const double start = ctx.node.get_float("start"),
                                            delta = ctx.node.get_float("delta");
                               if (is_float(y.dtype())) {
                                 for (int64_t i = 0; i < y.numel(); ++i)
                                   y.set_f64(i, start + static_cast<double>(i) * delta);
                               } else {
                                 const int64_t s = static_cast<int64_t>(start),
                                               d = static_cast<int64_t>(delta);
                                 for (int64_t i = 0; i < y.numel(); ++i) y.set_i64(i, s + i * d);
                               }
                               return ok_status();
                             }});
}

}  // namespace kiln
