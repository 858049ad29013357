// Elementwise core ops: unary math, binary arithmetic, comparisons, logic, cast, where, clip.
#include <algorithm>
#include <bit>
#include <cmath>
#include <compare>
#include <cstring>
#include <functional>
#include <limits>
#include <numbers>

#include "ops/kernel_util.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

/// Float to int64, truncating toward zero; NaN gives 0 and out-of-range values saturate.
int64_t trunc_to_i64(double v) {
  if (std::isnan(v)) return 0;
  if (v >= 9223372036854775808.0) return std::numeric_limits<int64_t>::max();
  if (v < -9223372036854775808.0) return std::numeric_limits<int64_t>::min();
  return static_cast<int64_t>(v);
}

double round_half_even(double x) {
  if (std::fabs(x - std::trunc(x)) == 0.5) return 2.0 * std::round(x / 2.0);
  return std::round(x);
}

/// int64 to double, rounding to odd: exact values stay, inexact ones take the neighbour whose
/// last mantissa bit is 1. Rounding that again to a float of at most 51 bits (f32, bf16, ...)
/// equals rounding `v` once, which plain nearest-even conversion would not guarantee.
double i64_to_f64_round_odd(int64_t v) {
  const double d = static_cast<double>(v);
  const bool top = d >= 0x1p63;  // v rounded up past int64's range
  const int64_t back = top ? 0 : static_cast<int64_t>(d);
  const int dir = top ? -1 : (v > back) - (v < back);
  if (dir == 0 || (std::bit_cast<uint64_t>(d) & 1) != 0) return d;
  return std::nextafter(d, dir > 0 ? HUGE_VAL : -HUGE_VAL);
}

// Zero (of either sign) and nan map to themselves.
double sign_f64(double x) {
  if (x > 0) return 1.0;
  return x < 0 ? -1.0 : x;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x / std::numbers::sqrt2)); }

double gelu_tanh(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

using F64Fn = std::function<double(double)>;
using I64Fn = std::function<int64_t(int64_t)>;
using CheckFn = std::function<Status(InferContext&)>;

/// Shape rule of ops whose result has the operand's type: checks the dtype, then `extra`.
InferFn same_type_infer(uint32_t classes, CheckFn extra = {}) {
  return [classes, extra](InferContext& ctx) -> Status {
    KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, classes));
    if (extra) KILN_RETURN_IF_ERROR(extra(ctx));
    ctx.results = {ctx.operand(0)};
    return ok_status();
  };
}

/// Applies `f` (float operands) or `fi` (integer operands) to every element.
Status apply_unary(KernelContext& ctx, const F64Fn& f, const I64Fn& fi) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  const int64_t n = x.numel();
  if (is_float(x.dtype())) {
    for (int64_t i = 0; i < n; ++i) y.set_f64(i, f(x.get_f64(i)));
  } else {
    if (!fi) return ctx.error("no integer kernel for " + std::string(dtype_name(x.dtype())));
    for (int64_t i = 0; i < n; ++i) y.set_i64(i, fi(x.get_i64(i)));
  }
  return ok_status();
}

struct UnaryDef {
  const char* name;
  const char* summary;
  double (*f)(double);
  int64_t (*fi)(int64_t);  ///< set when the op also accepts signed integers
};

const UnaryDef kUnaryOps[] = {
    {"neg", "negation, -x", [](double x) { return -x; }, wrap_neg},
    {"abs", "absolute value |x|", [](double x) { return std::fabs(x); },
     [](int64_t x) { return x < 0 ? wrap_neg(x) : x; }},
    {"exp", "exponential e^x", [](double x) { return std::exp(x); }, nullptr},
    {"log", "natural logarithm", [](double x) { return std::log(x); }, nullptr},
    {"sqrt", "square root", [](double x) { return std::sqrt(x); }, nullptr},
    {"rsqrt", "reciprocal square root, 1 / sqrt(x)", [](double x) { return 1.0 / std::sqrt(x); },
     nullptr},
    {"reciprocal", "reciprocal, 1 / x", [](double x) { return 1.0 / x; }, nullptr},
    {"tanh", "hyperbolic tangent", [](double x) { return std::tanh(x); }, nullptr},
    {"erf", "gauss error function", [](double x) { return std::erf(x); }, nullptr},
    {"sigmoid", "logistic sigmoid, 1 / (1 + e^-x)", sigmoid, nullptr},
    // x < 0 rather than max(x, 0) so that NaN propagates.
    {"relu", "rectified linear unit, max(x, 0)", [](double x) { return x < 0 ? 0.0 : x; },
     [](int64_t x) { return x < 0 ? int64_t{0} : x; }},
    {"silu", "sigmoid linear unit, x * sigmoid(x)", [](double x) { return x * sigmoid(x); },
     nullptr},
    {"sin", "sine", [](double x) { return std::sin(x); }, nullptr},
    {"cos", "cosine", [](double x) { return std::cos(x); }, nullptr},
    {"floor", "round toward negative infinity", [](double x) { return std::floor(x); }, nullptr},
    {"ceil", "round toward positive infinity", [](double x) { return std::ceil(x); }, nullptr},
    {"round", "round to nearest integer, halves to even", round_half_even, nullptr},
    {"sign", "sign of x: -1, 0 or 1", sign_f64,
     [](int64_t x) { return int64_t{x > 0} - int64_t{x < 0}; }},
    // Stable for large |x|: log(1 + e^x) = max(x, 0) + log1p(e^-|x|).
    {"softplus", "log(1 + e^x)",
     [](double x) { return std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x))); }, nullptr},
};

Status check_gelu_approximate(InferContext& ctx) {
  const std::string a = ctx.node.get_string("approximate");
  if (a == "none" || a == "tanh") return ok_status();
  return ctx.error("attribute 'approximate' must be \"none\" or \"tanh\", got \"" + a + "\"");
}

void register_unary(OpRegistry& r) {
  for (const UnaryDef& u : kUnaryOps) {
    const uint32_t classes = u.fi ? (kFloatDTypes | kSignedIntDTypes) : kFloatDTypes;
    F64Fn f = u.f;
    I64Fn fi = u.fi ? I64Fn(u.fi) : I64Fn();
    add_op_or_die(
        r, OpDef{.name = u.name,
                 .summary = u.summary,
                 .traits = kTraitElementwise,
                 .inputs = {"x"},
                 .outputs = {"y"},
                 .result_rule = "same as x",
                 .attrs = {},
                 .infer = same_type_infer(classes),
                 .reference = [f, fi](KernelContext& ctx) { return apply_unary(ctx, f, fi); }});
  }

  add_op_or_die(
      r, OpDef{.name = "gelu",
               .summary = "gaussian error linear unit, x * phi(x)",
               .traits = kTraitElementwise,
               .inputs = {"x"},
               .outputs = {"y"},
               .result_rule = "same as x",
               .attrs = {attr_default("approximate", "none",
                                      "\"none\": exact erf form; \"tanh\": tanh approximation")},
               .infer = same_type_infer(kFloatDTypes, check_gelu_approximate),
               .reference = [](KernelContext& ctx) {
                 bool t = ctx.node.get_string("approximate") == "tanh";
                 return apply_unary(ctx, t ? gelu_tanh : gelu_erf, {});
               }});

  add_op_or_die(r, OpDef{.name = "leaky_relu",
                         .summary = "leaky rectified linear unit, x < 0 ? alpha * x : x",
                         .traits = kTraitElementwise,
                         .inputs = {"x"},
                         .outputs = {"y"},
                         .result_rule = "same as x",
                         .attrs = {attr_default("alpha", 0.01, "slope for negative inputs")},
                         .infer = same_type_infer(kFloatDTypes),
                         .reference = [](KernelContext& ctx) {
                           double alpha = ctx.node.get_float("alpha");
                           return apply_unary(
                               ctx, [alpha](double x) { return x < 0 ? alpha * x : x; }, {});
                         }});
}

/// Shape rule of elementwise predicates: `classes` operand, bool result of the same shape.
InferFn predicate_infer(uint32_t classes) {
  return [classes](InferContext& ctx) -> Status {
    KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, classes));
    ctx.results = {TensorType{DType::kBool, ctx.operand(0).shape}};
    return ok_status();
  };
}

/// Elementwise predicate kernel: writes 0 or 1.
ReferenceFn predicate_kernel(bool (*p)(double)) {
  return [p](KernelContext& ctx) {
    const Tensor& x = ctx.input(0);
    Tensor& y = ctx.output(0);
    for (int64_t i = 0, n = x.numel(); i < n; ++i) y.set_i64(i, p(x.get_f64(i)) ? 1 : 0);
    return ok_status();
  };
}

void register_predicates(OpRegistry& r) {
  add_op_or_die(r, OpDef{.name = "not",
                         .summary = "logical negation",
                         .traits = kTraitElementwise,
                         .inputs = {"x"},
                         .outputs = {"y"},
                         .result_rule = "bool, shape of x",
                         .attrs = {},
                         .infer = predicate_infer(kBoolDType),
                         .reference = predicate_kernel([](double x) { return x == 0; })});
  add_op_or_die(r, OpDef{.name = "isnan",
                         .summary = "whether x is nan",
                         .traits = kTraitElementwise,
                         .inputs = {"x"},
                         .outputs = {"y"},
                         .result_rule = "bool, shape of x",
                         .attrs = {},
                         .infer = predicate_infer(kFloatDTypes),
                         .reference = predicate_kernel([](double x) { return std::isnan(x); })});
  add_op_or_die(r, OpDef{.name = "isinf",
                         .summary = "whether x is +inf or -inf",
                         .traits = kTraitElementwise,
                         .inputs = {"x"},
                         .outputs = {"y"},
                         .result_rule = "bool, shape of x",
                         .attrs = {},
                         .infer = predicate_infer(kFloatDTypes),
                         .reference = predicate_kernel([](double x) { return std::isinf(x); })});
}

/// Shape rule of binary broadcasting ops: equal dtypes in `classes`; result dtype `out`
/// (or the operands' dtype when unset) over the broadcast shape.
InferFn binary_infer(uint32_t classes, std::optional<DType> out = std::nullopt) {
  return [classes, out](InferContext& ctx) -> Status {
    KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 0, 1));
    KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, classes));
    KILN_ASSIGN_OR_RETURN(Shape shape, broadcast_operands(ctx, {0, 1}));
    ctx.results = {TensorType{out.value_or(ctx.operand(0).dtype), std::move(shape)}};
    return ok_status();
  };
}

/// Visits every output element with the broadcast offsets into both operands.
template <typename Fn>
void for_each_broadcast(const Tensor& a, const Tensor& b, const Tensor& y, Fn fn) {
  BroadcastWalker w(y.shape(), {a.shape(), b.shape()});
  for (int64_t i = 0, n = y.numel(); i < n; ++i, w.next()) fn(i, w.offset(0), w.offset(1));
}

using F2 = double (*)(double, double);
/// Integer binary function: stores the result in `out`, or returns an error text.
using I2 = const char* (*)(int64_t a, int64_t b, int64_t& out);

Status apply_binary(KernelContext& ctx, F2 f, I2 fi) {
  const Tensor& a = ctx.input(0);
  const Tensor& b = ctx.input(1);
  Tensor& y = ctx.output(0);
  if (is_float(y.dtype())) {
    const std::vector<double> av = a.to_f64(), bv = b.to_f64();
    for_each_broadcast(a, b, y,
                       [&](int64_t i, int64_t ia, int64_t ib) { y.set_f64(i, f(av[ia], bv[ib])); });
    return ok_status();
  }
  const std::vector<int64_t> av = a.to_i64(), bv = b.to_i64();
  const char* err = nullptr;
  for_each_broadcast(a, b, y, [&](int64_t i, int64_t ia, int64_t ib) {
    int64_t v = 0;
    if (err != nullptr) return;
    err = fi(av[ia], bv[ib], v);
    y.set_i64(i, v);
  });
  return err != nullptr ? ctx.error(err) : ok_status();
}

double py_fmod(double a, double b) {
  double r = std::fmod(a, b);
  if (r == 0) return std::copysign(0.0, b);
  return (r < 0) != (b < 0) ? r + b : r;
}

struct BinaryDef {
  const char* name;
  const char* summary;
  bool commutative;
  F2 f;
  I2 fi;
};

const BinaryDef kBinaryOps[] = {
    {"add", "a + b", true, [](double a, double b) { return a + b; },
     [](int64_t a, int64_t b, int64_t& o) -> const char* {
       o = wrap_add(a, b);
       return nullptr;
     }},
    {"sub", "a - b", false, [](double a, double b) { return a - b; },
     [](int64_t a, int64_t b, int64_t& o) -> const char* {
       o = wrap_sub(a, b);
       return nullptr;
     }},
    {"mul", "a * b", true, [](double a, double b) { return a * b; },
     [](int64_t a, int64_t b, int64_t& o) -> const char* {
       o = wrap_mul(a, b);
       return nullptr;
     }},
    {"div", "a / b; integers truncate toward zero", false, [](double a, double b) { return a / b; },
     [](int64_t a, int64_t b, int64_t& o) -> const char* {
       if (b == 0) return "integer division by zero";
       o = b == -1 ? wrap_neg(a) : a / b;  // int64 min / -1 overflows
       return nullptr;
     }},
    {"pow", "a raised to the power b", false, [](double a, double b) { return std::pow(a, b); },
     [](int64_t a, int64_t b, int64_t& o) -> const char* {
       if (b < 0) return "negative exponent with integer operands";
       o = 1;
       for (; b > 0; b >>= 1, a = wrap_mul(a, a))
         if (b & 1) o = wrap_mul(o, a);
       return nullptr;
     }},
    {"maximum", "elementwise maximum; nan propagates", true,
     [](double a, double b) { return std::isnan(a) || std::isnan(b) ? a + b : std::max(a, b); },
     [](int64_t a, int64_t b, int64_t& o) -> const char* {
       o = std::max(a, b);
       return nullptr;
     }},
    {"minimum", "elementwise minimum; nan propagates", true,
     [](double a, double b) { return std::isnan(a) || std::isnan(b) ? a + b : std::min(a, b); },
     [](int64_t a, int64_t b, int64_t& o) -> const char* {
       o = std::min(a, b);
       return nullptr;
     }},
};

/// Integer remainder; `floor_mod` gives the result the divisor's sign (Python), else the
/// dividend's (C fmod).
const char* int_mod(int64_t a, int64_t b, int64_t& o, bool floor_mod) {
  if (b == 0) return "integer modulo by zero";
  o = b == -1 ? 0 : a % b;  // int64 min % -1 overflows
  if (floor_mod && o != 0 && (o < 0) != (b < 0)) o += b;
  return nullptr;
}

void register_binary(OpRegistry& r) {
  for (const BinaryDef& d : kBinaryOps) {
    F2 f = d.f;
    I2 fi = d.fi;
    add_op_or_die(
        r, OpDef{.name = d.name,
                 .summary = d.summary,
                 .traits = kTraitElementwise | kTraitBroadcast |
                           (d.commutative ? kTraitCommutative : kTraitNone),
                 .inputs = {"a", "b"},
                 .outputs = {"y"},
                 .result_rule = "broadcast of a and b, dtype of a",
                 .attrs = {},
                 .infer = binary_infer(kNumericDTypes),
                 .reference = [f, fi](KernelContext& ctx) { return apply_binary(ctx, f, fi); }});
  }
  add_op_or_die(
      r,
      OpDef{.name = "mod",
            .summary = "remainder of a / b",
            .traits = kTraitElementwise | kTraitBroadcast,
            .inputs = {"a", "b"},
            .outputs = {"y"},
            .result_rule = "broadcast of a and b, dtype of a",
            .attrs = {attr_default("fmod", 0,
                                   "0: result has the divisor's sign (python %); 1: the "
                                   "dividend's (c fmod)")},
            .infer = [](InferContext& ctx) -> Status {
              KILN_RETURN_IF_ERROR(require_flag(ctx, "fmod"));
              return binary_infer(kNumericDTypes)(ctx);
            },
            .reference =
                [](KernelContext& ctx) {
                  if (ctx.node.get_int("fmod") != 0)
                    return apply_binary(
                        ctx, [](double a, double b) { return std::fmod(a, b); },
                        [](int64_t a, int64_t b, int64_t& o) { return int_mod(a, b, o, false); });
                  return apply_binary(ctx, py_fmod, [](int64_t a, int64_t b, int64_t& o) {
                    return int_mod(a, b, o, true);
                  });
                }});
}

using Cmp = bool (*)(std::partial_ordering);

/// Comparison kernel: integers compare exactly in int64, floats in double.
Status compare_kernel(KernelContext& ctx, Cmp c) {
  const Tensor& a = ctx.input(0);
  const Tensor& b = ctx.input(1);
  Tensor& y = ctx.output(0);
  if (is_float(a.dtype())) {
    const std::vector<double> av = a.to_f64(), bv = b.to_f64();
    for_each_broadcast(a, b, y, [&](int64_t i, int64_t ia, int64_t ib) {
      y.set_i64(i, c(av[ia] <=> bv[ib]) ? 1 : 0);
    });
  } else {
    const std::vector<int64_t> av = a.to_i64(), bv = b.to_i64();
    for_each_broadcast(a, b, y, [&](int64_t i, int64_t ia, int64_t ib) {
      y.set_i64(i, c(av[ia] <=> bv[ib]) ? 1 : 0);
    });
  }
  return ok_status();
}

Status logic_kernel(KernelContext& ctx, bool (*f)(bool, bool)) {
  const Tensor& a = ctx.input(0);
  const Tensor& b = ctx.input(1);
  Tensor& y = ctx.output(0);
  for_each_broadcast(a, b, y, [&](int64_t i, int64_t ia, int64_t ib) {
    y.set_i64(i, f(a.get_i64(ia) != 0, b.get_i64(ib) != 0) ? 1 : 0);
  });
  return ok_status();
}

void register_comparisons(OpRegistry& r) {
  struct CmpDef {
    const char* name;
    const char* summary;
    bool commutative;
    Cmp c;
  };
  // Unordered (nan) compares false for everything but not_equal, as IEEE says.
  const CmpDef defs[] = {
      {"equal", "a == b", true, [](std::partial_ordering o) { return o == 0; }},
      {"not_equal", "a != b", true, [](std::partial_ordering o) { return o != 0; }},
      {"less", "a < b", false, [](std::partial_ordering o) { return o < 0; }},
      {"less_equal", "a <= b", false, [](std::partial_ordering o) { return o <= 0; }},
      {"greater", "a > b", false, [](std::partial_ordering o) { return o > 0; }},
      {"greater_equal", "a >= b", false, [](std::partial_ordering o) { return o >= 0; }},
  };
  for (const CmpDef& d : defs) {
    Cmp c = d.c;
    add_op_or_die(r,
                  OpDef{.name = d.name,
                        .summary = d.summary,
                        .traits = kTraitElementwise | kTraitBroadcast |
                                  (d.commutative ? kTraitCommutative : kTraitNone),
                        .inputs = {"a", "b"},
                        .outputs = {"y"},
                        .result_rule = "bool, broadcast of a and b",
                        .attrs = {},
                        .infer = binary_infer(kAnyDType, DType::kBool),
                        .reference = [c](KernelContext& ctx) { return compare_kernel(ctx, c); }});
  }

  struct LogicDef {
    const char* name;
    const char* summary;
    bool (*f)(bool, bool);
  };
  const LogicDef logic[] = {
      {"and", "logical and", [](bool a, bool b) { return a && b; }},
      {"or", "logical or", [](bool a, bool b) { return a || b; }},
      {"xor", "logical exclusive or", [](bool a, bool b) { return a != b; }},
  };
  for (const LogicDef& d : logic) {
    bool (*f)(bool, bool) = d.f;
    add_op_or_die(r, OpDef{.name = d.name,
                           .summary = d.summary,
                           .traits = kTraitElementwise | kTraitBroadcast | kTraitCommutative,
                           .inputs = {"a", "b"},
                           .outputs = {"y"},
                           .result_rule = "bool, broadcast of a and b",
                           .attrs = {},
                           .infer = binary_infer(kBoolDType),
                           .reference = [f](KernelContext& ctx) { return logic_kernel(ctx, f); }});
  }
}

Status cast_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_flag(ctx, "saturate"));
  const Attribute* to = ctx.node.attr("to");
  if (to == nullptr) return ctx.error("missing required attribute 'to'");
  ctx.results = {TensorType{to->as_dtype(), ctx.operand(0).shape}};
  return ok_status();
}

Status cast_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  const DType from = x.dtype(), to = y.dtype();
  const bool saturate = ctx.node.get_int("saturate") != 0;
  const int64_t n = x.numel();
  // Integers reach narrower floats through round-to-odd so that they round only once.
  auto as_f64 = [&](int64_t i) {
    if (is_float(from)) return x.get_f64(i);
    const int64_t v = x.get_i64(i);
    return to == DType::kF64 ? static_cast<double>(v) : i64_to_f64_round_odd(v);
  };
  if (to == DType::kBool) {
    for (int64_t i = 0; i < n; ++i) y.set_i64(i, as_f64(i) != 0 ? 1 : 0);
  } else if (is_integer(to)) {
    for (int64_t i = 0; i < n; ++i)
      y.set_i64(i, is_float(from) ? trunc_to_i64(x.get_f64(i)) : x.get_i64(i));
  } else if (to == DType::kF8E4M3FN || to == DType::kF8E5M2) {
    // The saturate flag only matters for f8 targets, so these bypass set_f64.
    uint8_t* out = y.mutable_data_as<uint8_t>();
    for (int64_t i = 0; i < n; ++i)
      out[i] = to == DType::kF8E4M3FN ? f64_to_f8e4m3fn_bits(as_f64(i), saturate)
                                      : f64_to_f8e5m2_bits(as_f64(i), saturate);
  } else {
    for (int64_t i = 0; i < n; ++i) y.set_f64(i, as_f64(i));
  }
  return ok_status();
}

Status where_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(require_dtype(ctx, 0, kBoolDType));
  KILN_RETURN_IF_ERROR(require_same_dtype(ctx, 1, 2));
  KILN_ASSIGN_OR_RETURN(Shape shape, broadcast_operands(ctx, {0, 1, 2}));
  ctx.results = {TensorType{ctx.operand(1).dtype, std::move(shape)}};
  return ok_status();
}

Status where_kernel(KernelContext& ctx) {
  const Tensor& c = ctx.input(0);
  const Tensor& a = ctx.input(1);
  const Tensor& b = ctx.input(2);
  Tensor& y = ctx.output(0);
  std::byte* out = y.mutable_data();
  BroadcastWalker w(y.shape(), {c.shape(), a.shape(), b.shape()});
  for (int64_t i = 0, n = y.numel(); i < n; ++i, w.next()) {
    if (c.get_i64(w.offset(0)) != 0)
      copy_element(y.dtype(), a.data(), w.offset(1), out, i);
    else
      copy_element(y.dtype(), b.data(), w.offset(2), out, i);
  }
  return ok_status();
}

Status check_clip_bounds(InferContext& ctx) {
  for (const char* name : {"min", "max"}) {
    const Attribute* a = ctx.node.attr(name);
    if (a != nullptr && std::isnan(a->as_float()))
      return ctx.error("attribute '" + std::string(name) + "' must not be nan");
  }
  return ok_status();
}

Status clip_kernel(KernelContext& ctx) {
  const Attribute* lo_attr = ctx.node.attr("min");
  const Attribute* hi_attr = ctx.node.attr("max");
  const double inf = std::numeric_limits<double>::infinity();
  const double lo = lo_attr ? lo_attr->as_float() : -inf;
  const double hi = hi_attr ? hi_attr->as_float() : inf;
  const DType t = ctx.input(0).dtype();
  if (is_float(t)) {
    // Comparisons rather than std::clamp: nan passes through, and min > max gives max.
    return apply_unary(ctx,
                       [lo, hi](double x) {
                         if (x < lo) x = lo;
                         return x > hi ? hi : x;
                       },
                       {});
  }
  // Integer bounds: the integers inside [lo, hi], clamped to what the dtype holds.
  auto [tmin, tmax] = int_dtype_range(t);
  const int64_t ilo = std::clamp(trunc_to_i64(std::ceil(lo)), tmin, tmax);
  const int64_t ihi = std::clamp(trunc_to_i64(std::floor(hi)), tmin, tmax);
  return apply_unary(ctx, {}, [ilo, ihi](int64_t x) { return std::min(std::max(x, ilo), ihi); });
}

void register_misc(OpRegistry& r) {
  add_op_or_die(r, OpDef{.name = "cast",
                         .summary = "converts x to another dtype",
                         .traits = kTraitElementwise,
                         .inputs = {"x"},
                         .outputs = {"y"},
                         .result_rule = "dtype `to`, shape of x",
                         .attrs = {attr_required("to", AttrKind::kDType, "the result dtype"),
                                   attr_default("saturate", 1,
                                                "f8 results: 1 clamps out-of-range values to the "
                                                "largest finite value, 0 makes them nan (or inf "
                                                "for f8e5m2)")},
                         .infer = cast_infer,
                         .reference = cast_kernel});
  add_op_or_die(r, OpDef{.name = "where",
                         .summary = "cond ? a : b, broadcasting all three",
                         .traits = kTraitElementwise | kTraitBroadcast,
                         .inputs = {"cond", "a", "b"},
                         .outputs = {"y"},
                         .result_rule = "broadcast of cond, a and b, dtype of a",
                         .attrs = {},
                         .infer = where_infer,
                         .reference = where_kernel});
  add_op_or_die(r, OpDef{.name = "clip",
                         .summary = "clamps x to [min, max]; absent bounds do not clamp",
                         .traits = kTraitElementwise,
                         .inputs = {"x"},
                         .outputs = {"y"},
                         .result_rule = "same as x",
                         .attrs = {attr_optional("min", AttrKind::kFloat, "lower bound"),
                                   attr_optional("max", AttrKind::kFloat,
                                                 "upper bound; wins over min when min > max")},
                         .infer = same_type_infer(kNumericDTypes, check_clip_bounds),
                         .reference = clip_kernel});
}

}  // namespace

void register_elementwise_ops(OpRegistry& r) {
  register_unary(r);
  register_predicates(r);
  register_binary(r);
  register_comparisons(r);
  register_misc(r);
}

}  // namespace kiln
