// ONNX elementwise math, activations, comparisons, casts, reductions and softmax-like ops.
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include "op_util.h"

namespace kiln::onnx_fe {
namespace {

using Sizes = std::vector<int64_t>;

// --- unary ---------------------------------------------------------------------------

Status unary(NodeCtx& c) {
  static const std::map<std::string, std::string> direct = {
      {"Abs", "abs"},   {"Neg", "neg"},         {"Exp", "exp"},       {"Log", "log"},
      {"Sqrt", "sqrt"}, {"Reciprocal", "reciprocal"}, {"Tanh", "tanh"}, {"Erf", "erf"},
      {"Sigmoid", "sigmoid"}, {"Relu", "relu"}, {"Sin", "sin"},       {"Cos", "cos"},
      {"Floor", "floor"}, {"Ceil", "ceil"},     {"Round", "round"},   {"Sign", "sign"},
      {"Softplus", "softplus"}, {"Not", "not"}, {"IsNaN", "isnan"},   {"Asin", "asin"},
      {"Acos", "acos"}, {"Atan", "atan"}};
  Value* x = c.in(0);
  const std::string& op = c.proto.op_type();
  // Unsigned values are their own absolute value (and relu, sign of nonzero is 1).
  if (x->dtype() == DType::kU8 && (op == "Abs" || op == "Relu")) return c.out(0, x);
  KILN_ASSIGN_OR_RETURN(Value * y, c.op(direct.at(op), {x}));
  return c.out(0, y);
}

/// Unary math Kiln lacks, written with the ops it has.
Status unary_composite(NodeCtx& c) {
  Value* x = c.in(0);
  const std::string& op = c.proto.op_type();
  Value* y = nullptr;
  if (op == "Tan") {
    KILN_ASSIGN_OR_RETURN(Value * s, c.op("sin", {x}));
    KILN_ASSIGN_OR_RETURN(Value * k, c.op("cos", {x}));
    KILN_ASSIGN_OR_RETURN(y, c.op("div", {s, k}));
  } else if (op == "Sinh" || op == "Cosh") {
    KILN_ASSIGN_OR_RETURN(Value * e, c.op("exp", {x}));
    KILN_ASSIGN_OR_RETURN(Value * nx, c.op("neg", {x}));
    KILN_ASSIGN_OR_RETURN(Value * en, c.op("exp", {nx}));
    KILN_ASSIGN_OR_RETURN(Value * s, c.op(op == "Sinh" ? "sub" : "add", {e, en}));
    KILN_ASSIGN_OR_RETURN(y, with_scalar(c, "mul", s, 0.5));
  } else if (op == "Asinh" || op == "Acosh") {
    // log(x + sqrt(x^2 ± 1))
    KILN_ASSIGN_OR_RETURN(Value * sq, c.op("mul", {x, x}));
    KILN_ASSIGN_OR_RETURN(Value * r, with_scalar(c, op == "Asinh" ? "add" : "sub", sq, 1.0));
    KILN_ASSIGN_OR_RETURN(r, c.op("sqrt", {r}));
    KILN_ASSIGN_OR_RETURN(r, c.op("add", {x, r}));
    KILN_ASSIGN_OR_RETURN(y, c.op("log", {r}));
  } else if (op == "Atanh") {
    // 0.5 * log((1 + x) / (1 - x))
    Value* one = scalar_like(c, x, 1.0);
    KILN_ASSIGN_OR_RETURN(Value * a, c.op("add", {one, x}));
    KILN_ASSIGN_OR_RETURN(Value * b, c.op("sub", {one, x}));
    KILN_ASSIGN_OR_RETURN(Value * q, c.op("div", {a, b}));
    KILN_ASSIGN_OR_RETURN(q, c.op("log", {q}));
    KILN_ASSIGN_OR_RETURN(y, with_scalar(c, "mul", q, 0.5));
  } else if (op == "Softsign") {
    KILN_ASSIGN_OR_RETURN(Value * a, c.op("abs", {x}));
    KILN_ASSIGN_OR_RETURN(a, with_scalar(c, "add", a, 1.0));
    KILN_ASSIGN_OR_RETURN(y, c.op("div", {x, a}));
  } else if (op == "Mish") {
    KILN_ASSIGN_OR_RETURN(Value * s, c.op("softplus", {x}));
    KILN_ASSIGN_OR_RETURN(s, c.op("tanh", {s}));
    KILN_ASSIGN_OR_RETURN(y, c.op("mul", {x, s}));
  }
  return c.out(0, y);
}

Status is_inf(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("isinf", {x}));
  const bool pos = c.attr_int("detect_positive", 1) != 0, neg = c.attr_int("detect_negative", 1) != 0;
  if (pos != neg) {
    KILN_ASSIGN_OR_RETURN(Value * side, c.op(pos ? "greater" : "less", {x, scalar_like(c, x, 0)}));
    KILN_ASSIGN_OR_RETURN(y, c.op("and", {y, side}));
  } else if (!pos) {
    KILN_ASSIGN_OR_RETURN(y, c.op("and", {y, c.scalar(DType::kBool, 0)}));
  }
  return c.out(0, y);
}

// --- activations -----------------------------------------------------------------------

Status activation(NodeCtx& c) {
  Value* x = c.in(0);
  const std::string& op = c.proto.op_type();
  Value* zero = scalar_like(c, x, 0);
  Value* y = nullptr;
  if (op == "LeakyRelu") {
    KILN_ASSIGN_OR_RETURN(y, c.op("leaky_relu", {x}, {{"alpha", Attribute(c.attr_float("alpha", 0.01))}}));
  } else if (op == "Elu" || op == "Selu") {
    const double alpha = c.attr_float("alpha", op == "Elu" ? 1.0 : 1.67326319217681884765625);
    KILN_ASSIGN_OR_RETURN(Value * e, c.op("exp", {x}));
    KILN_ASSIGN_OR_RETURN(e, with_scalar(c, "sub", e, 1.0));
    KILN_ASSIGN_OR_RETURN(e, with_scalar(c, "mul", e, alpha));
    KILN_ASSIGN_OR_RETURN(Value * neg, c.op(op == "Elu" ? "less" : "less_equal", {x, zero}));
    KILN_ASSIGN_OR_RETURN(y, c.op("where", {neg, e, x}));
    if (op == "Selu") {
      KILN_ASSIGN_OR_RETURN(y, with_scalar(c, "mul", y, c.attr_float("gamma", 1.05070102214813232421875)));
    }
  } else if (op == "Celu") {
    const double alpha = c.attr_float("alpha", 1.0);
    KILN_ASSIGN_OR_RETURN(Value * e, with_scalar(c, "div", x, alpha));
    KILN_ASSIGN_OR_RETURN(e, c.op("exp", {e}));
    KILN_ASSIGN_OR_RETURN(e, with_scalar(c, "sub", e, 1.0));
    KILN_ASSIGN_OR_RETURN(e, with_scalar(c, "mul", e, alpha));
    KILN_ASSIGN_OR_RETURN(e, c.op("minimum", {e, zero}));
    KILN_ASSIGN_OR_RETURN(Value * p, c.op("maximum", {x, zero}));
    KILN_ASSIGN_OR_RETURN(y, c.op("add", {p, e}));
  } else if (op == "HardSigmoid" || op == "HardSwish") {
    const bool swish = op == "HardSwish";
    KILN_ASSIGN_OR_RETURN(Value * t, with_scalar(c, "mul", x, swish ? 1.0 / 6 : c.attr_float("alpha", 0.2)));
    KILN_ASSIGN_OR_RETURN(t, with_scalar(c, "add", t, swish ? 0.5 : c.attr_float("beta", 0.5)));
    KILN_ASSIGN_OR_RETURN(y, c.op("clip", {t}, {{"min", Attribute(0.0)}, {"max", Attribute(1.0)}}));
    if (swish) {
      KILN_ASSIGN_OR_RETURN(y, c.op("mul", {x, y}));
    }
  } else if (op == "ThresholdedRelu") {
    KILN_ASSIGN_OR_RETURN(Value * m, with_scalar(c, "greater", x, c.attr_float("alpha", 1.0)));
    KILN_ASSIGN_OR_RETURN(y, c.op("where", {m, x, zero}));
  } else if (op == "Shrink") {
    const double bias = c.attr_float("bias", 0.0), lambd = c.attr_float("lambd", 0.5);
    KILN_ASSIGN_OR_RETURN(Value * lo, with_scalar(c, "less", x, -lambd));
    KILN_ASSIGN_OR_RETURN(Value * hi, with_scalar(c, "greater", x, lambd));
    KILN_ASSIGN_OR_RETURN(Value * xp, with_scalar(c, "add", x, bias));
    KILN_ASSIGN_OR_RETURN(Value * xm, with_scalar(c, "sub", x, bias));
    KILN_ASSIGN_OR_RETURN(Value * inner, c.op("where", {hi, xm, zero}));
    KILN_ASSIGN_OR_RETURN(y, c.op("where", {lo, xp, inner}));
  } else if (op == "PRelu") {
    KILN_ASSIGN_OR_RETURN(Value * neg, c.op("less", {x, zero}));
    KILN_ASSIGN_OR_RETURN(Value * s, c.op("mul", {x, c.in(1)}));
    KILN_ASSIGN_OR_RETURN(y, c.op("where", {neg, s, x}));
  } else if (op == "Gelu") {
    const std::string approx = c.attr_string("approximate", "none");
    KILN_ASSIGN_OR_RETURN(y, c.op("gelu", {x}, {{"approximate", Attribute(approx)}}));
  }
  return c.out(0, y);
}

// --- binary ----------------------------------------------------------------------------

/// Opset < 7 spelled broadcasting out: `broadcast=1` aligns b with a starting at `axis`.
StatusOr<Value*> legacy_broadcast(NodeCtx& c, Value* a, Value* b) {
  if (c.opset >= 7 || c.attr_int("broadcast", 0) == 0 || !c.has_attr("axis")) return b;
  const int64_t ra = a->type().rank(), rb = b->type().rank();
  KILN_ASSIGN_OR_RETURN(int64_t axis, norm_axis(c, c.attr_int("axis", 0), ra));
  Sizes trailing;
  for (int64_t d = axis + rb; d < ra; ++d) trailing.push_back(d - axis);
  return unsqueeze(c, b, trailing);
}

Status binary(NodeCtx& c) {
  static const std::map<std::string, std::string> ops = {
      {"Add", "add"}, {"Sub", "sub"}, {"Mul", "mul"}, {"Div", "div"},
      {"And", "and"}, {"Or", "or"}, {"Xor", "xor"}, {"Equal", "equal"},
      {"Less", "less"}, {"Greater", "greater"}, {"LessOrEqual", "less_equal"},
      {"GreaterOrEqual", "greater_equal"}};
  Value* a = c.in(0);
  KILN_ASSIGN_OR_RETURN(Value * b, legacy_broadcast(c, a, c.in(1)));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op(ops.at(c.proto.op_type()), {a, b}));
  return c.out(0, y);
}

Status pow_op(NodeCtx& c) {
  Value* a = c.in(0);
  KILN_ASSIGN_OR_RETURN(Value * b, legacy_broadcast(c, a, c.in(1)));
  const DType out = a->dtype();
  Value* y = nullptr;
  if (!is_float(out) && is_float(b->dtype())) {
    // Integer base, float exponent: compute in f64 and truncate back, as onnxruntime does.
    KILN_ASSIGN_OR_RETURN(Value * af, cast_to(c, a, DType::kF64));
    KILN_ASSIGN_OR_RETURN(Value * bf, cast_to(c, b, DType::kF64));
    KILN_ASSIGN_OR_RETURN(y, c.op("pow", {af, bf}));
    KILN_ASSIGN_OR_RETURN(y, cast_to(c, y, out));
  } else {
    KILN_ASSIGN_OR_RETURN(b, cast_to(c, b, out));
    KILN_ASSIGN_OR_RETURN(y, c.op("pow", {a, b}));
  }
  return c.out(0, y);
}

Status mod_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("mod", {c.in(0), c.in(1)}, {{"fmod", Attribute(c.attr_int("fmod", 0))}}));
  return c.out(0, y);
}

Status bit_shift(NodeCtx& c) {
  Value* x = c.in(0);
  Value* s = c.in(1);
  const std::string dir = c.attr_string("direction", "");
  if (dir != "LEFT" && dir != "RIGHT") return c.error("attribute 'direction' must be LEFT or RIGHT, got '" + dir + "'");
  // x << s == x * 2^s and x >> s == x / 2^s for unsigned values (Kiln wraps on store).
  KILN_ASSIGN_OR_RETURN(Value * p, c.op("pow", {scalar_like(c, s, 2), s}));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op(dir == "LEFT" ? "mul" : "div", {x, p}));
  return c.out(0, y);
}

/// Max, Min, Sum, Mean: numpy-broadcasting folds over any number of inputs.
Status variadic(NodeCtx& c) {
  const std::string& op = c.proto.op_type();
  const std::string kop = op == "Max" ? "maximum" : op == "Min" ? "minimum" : "add";
  Value* acc = nullptr;
  int n = 0;
  for (int i = 0; i < c.num_inputs(); ++i) {
    if (!c.has_input(i)) continue;
    ++n;
    if (!acc) {
      acc = c.in(i);
      continue;
    }
    KILN_ASSIGN_OR_RETURN(acc, c.op(kop, {acc, c.in(i)}));
  }
  if (!acc) return c.error("needs at least one input");
  if (op == "Mean" && n > 1) {
    KILN_ASSIGN_OR_RETURN(acc, with_scalar(c, "div", acc, n));
  }
  return c.out(0, acc);
}

Status where_op(NodeCtx& c) {
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("where", {c.in(0), c.in(1), c.in(2)}));
  return c.out(0, y);
}

Status clip_op(NodeCtx& c) {
  Value* x = c.in(0);
  AttrMap attrs;
  Value* y = x;
  if (c.opset < 11) {
    if (c.has_attr("min")) attrs["min"] = Attribute(c.attr_float("min", 0));
    if (c.has_attr("max")) attrs["max"] = Attribute(c.attr_float("max", 0));
    KILN_ASSIGN_OR_RETURN(y, c.op("clip", {x}, std::move(attrs)));
    return c.out(0, y);
  }
  // Constant bounds become attributes; bounds computed at run time become maximum/minimum.
  for (int i : {1, 2}) {
    if (!c.has_input(i)) continue;
    const Tensor* t = NodeCtx::constant_of(c.in(i));
    if (t && t->numel() == 1) {
      attrs[i == 1 ? "min" : "max"] = Attribute(t->get_f64(0));
      continue;
    }
    KILN_ASSIGN_OR_RETURN(y, c.op(i == 1 ? "maximum" : "minimum", {y, c.in(i)}));
  }
  if (!attrs.empty() || y == x) {
    KILN_ASSIGN_OR_RETURN(y, c.op("clip", {y}, std::move(attrs)));
  }
  return c.out(0, y);
}

Status cast_op(NodeCtx& c) {
  DType to;
  if (c.proto.op_type() == "CastLike") {
    to = c.in(1)->dtype();
  } else {
    KILN_ASSIGN_OR_RETURN(to, kiln_dtype(static_cast<int>(c.attr_int("to", 0)), "attribute 'to'"));
  }
  Value* x = c.in(0);
  AttrMap attrs{{"to", Attribute(to)}};
  if (c.opset >= 19) attrs["saturate"] = Attribute(c.attr_int("saturate", 1));
  KILN_ASSIGN_OR_RETURN(Value * y, c.op("cast", {x}, std::move(attrs)));
  return c.out(0, y);
}

// --- reductions ----------------------------------------------------------------------

/// The reduced axes of a Reduce* node (attribute before opset 18, 13 for ReduceSum; input
/// after), or nullopt for "no reduction" (empty axes with noop_with_empty_axes).
StatusOr<std::optional<Sizes>> reduce_axes(NodeCtx& c, int64_t rank) {
  const bool from_input = c.opset >= (c.proto.op_type() == "ReduceSum" ? 13 : 18);
  Sizes axes;
  if (from_input) {
    if (c.has_input(1)) {
      KILN_ASSIGN_OR_RETURN(axes, c.const_ints(1, "axes"));
    }
  } else {
    axes = c.attr_ints("axes");
  }
  if (axes.empty()) {
    if (from_input && c.attr_int("noop_with_empty_axes", 0) != 0) return std::optional<Sizes>();
    for (int64_t d = 0; d < rank; ++d) axes.push_back(d);
  }
  KILN_ASSIGN_OR_RETURN(axes, norm_axes(c, axes, rank));
  return std::optional<Sizes>(axes);
}

Status reduce_op(NodeCtx& c) {
  const std::string& op = c.proto.op_type();
  Value* x = c.in(0);
  const int64_t rank = x->type().rank();
  KILN_ASSIGN_OR_RETURN(std::optional<Sizes> axes, reduce_axes(c, rank));
  const bool keep = c.attr_int("keepdims", 1) != 0;
  if (!axes) {
    // No reduction; the -Square/-L1/... variants still apply their elementwise part.
    Value* y = x;
    if (op == "ReduceL1") {
      KILN_ASSIGN_OR_RETURN(y, c.op("abs", {x}));
    } else if (op == "ReduceSumSquare") {
      KILN_ASSIGN_OR_RETURN(y, c.op("mul", {x, x}));
    } else if (op == "ReduceL2") {
      KILN_ASSIGN_OR_RETURN(y, c.op("abs", {x}));
    } else if (op == "ReduceLogSum") {
      KILN_ASSIGN_OR_RETURN(y, c.op("log", {x}));
    }
    return c.out(0, y);
  }
  const Sizes& ax = *axes;
  Value* y = nullptr;
  if (op == "ReduceSum" || op == "ReduceMax" || op == "ReduceMin" || op == "ReduceProd") {
    static const std::map<std::string, std::string> m = {{"ReduceSum", "reduce_sum"}, {"ReduceMax", "reduce_max"},
                                                         {"ReduceMin", "reduce_min"}, {"ReduceProd", "reduce_prod"}};
    KILN_ASSIGN_OR_RETURN(y, reduce(c, m.at(op), x, ax, keep));
  } else if (op == "ReduceMean") {
    if (is_float(x->dtype())) {
      KILN_ASSIGN_OR_RETURN(y, reduce(c, "reduce_mean", x, ax, keep));
    } else {
      KILN_ASSIGN_OR_RETURN(Sizes shape, c.static_shape(x, "data"));
      int64_t count = 1;
      for (int64_t a : ax) count *= shape[static_cast<size_t>(a)];
      KILN_ASSIGN_OR_RETURN(y, reduce(c, "reduce_sum", x, ax, keep));
      KILN_ASSIGN_OR_RETURN(y, with_scalar(c, "div", y, static_cast<double>(count)));
    }
  } else if (op == "ReduceL1") {
    KILN_ASSIGN_OR_RETURN(Value * a, c.op("abs", {x}));
    KILN_ASSIGN_OR_RETURN(y, reduce(c, "reduce_sum", a, ax, keep));
  } else if (op == "ReduceL2" || op == "ReduceSumSquare") {
    KILN_ASSIGN_OR_RETURN(Value * sq, c.op("mul", {x, x}));
    KILN_ASSIGN_OR_RETURN(y, reduce(c, "reduce_sum", sq, ax, keep));
    if (op == "ReduceL2") {
      if (is_float(y->dtype())) {
        KILN_ASSIGN_OR_RETURN(y, c.op("sqrt", {y}));
      } else {
        KILN_ASSIGN_OR_RETURN(Value * f, cast_to(c, y, DType::kF64));
        KILN_ASSIGN_OR_RETURN(f, c.op("sqrt", {f}));
        KILN_ASSIGN_OR_RETURN(y, cast_to(c, f, y->dtype()));
      }
    }
  } else if (op == "ReduceLogSum") {
    KILN_ASSIGN_OR_RETURN(y, reduce(c, "reduce_sum", x, ax, keep));
    KILN_ASSIGN_OR_RETURN(y, c.op("log", {y}));
  } else if (op == "ReduceLogSumExp") {
    // max + log(sum(exp(x - max))): exact for large inputs where exp overflows.
    KILN_ASSIGN_OR_RETURN(Value * m, reduce(c, "reduce_max", x, ax, true));
    KILN_ASSIGN_OR_RETURN(Value * d, c.op("sub", {x, m}));
    KILN_ASSIGN_OR_RETURN(d, c.op("exp", {d}));
    KILN_ASSIGN_OR_RETURN(Value * s, reduce(c, "reduce_sum", d, ax, true));
    KILN_ASSIGN_OR_RETURN(s, c.op("log", {s}));
    KILN_ASSIGN_OR_RETURN(y, c.op("add", {s, m}));
    if (!keep) {
      KILN_ASSIGN_OR_RETURN(y, squeeze(c, y, ax));
    }
  }
  return c.out(0, y);
}

Status arg_op(NodeCtx& c) {
  Value* x = c.in(0);
  KILN_ASSIGN_OR_RETURN(int64_t axis, norm_axis(c, c.attr_int("axis", 0), x->type().rank()));
  KILN_ASSIGN_OR_RETURN(
      Value * y, c.op(c.proto.op_type() == "ArgMax" ? "argmax" : "argmin", {x},
                      {{"axis", Attribute(axis)},
                       {"keepdims", Attribute(c.attr_int("keepdims", 1))},
                       {"select_last_index", Attribute(c.attr_int("select_last_index", 0))}}));
  return c.out(0, y);
}

/// Softmax, LogSoftmax and Hardmax along `axis` of `x` (the opset >= 13 meaning).
StatusOr<Value*> softmax_along(NodeCtx& c, Value* x, int64_t axis) {
  const std::string& op = c.proto.op_type();
  if (op == "Softmax") return c.op("softmax", {x}, {{"axis", Attribute(axis)}});
  if (op == "LogSoftmax") return c.op("log_softmax", {x}, {{"axis", Attribute(axis)}});
  KILN_ASSIGN_OR_RETURN(Value * am, c.op("argmax", {x}, {{"axis", Attribute(axis)}, {"keepdims", Attribute(1)}}));
  const Dim& n = x->shape()[static_cast<size_t>(axis)];
  if (!n.is_static()) return c.error("hardmax needs a static size on its axis");
  KILN_ASSIGN_OR_RETURN(Value * mask, one_hot_mask(c, am, n.value(), axis + 1));
  KILN_ASSIGN_OR_RETURN(mask, squeeze(c, mask, {axis}));
  return cast_to(c, mask, x->dtype());
}

Status softmax_op(NodeCtx& c) {
  Value* x = c.in(0);
  const int64_t rank = x->type().rank();
  Value* y = nullptr;
  if (c.opset >= 13) {
    KILN_ASSIGN_OR_RETURN(int64_t axis, norm_axis(c, c.attr_int("axis", -1), rank));
    KILN_ASSIGN_OR_RETURN(y, softmax_along(c, x, axis));
    return c.out(0, y);
  }
  // Before opset 13 the input is coerced to 2-D [prod(dims < axis), prod(dims >= axis)].
  KILN_ASSIGN_OR_RETURN(int64_t axis, norm_axis(c, c.attr_int("axis", 1), rank));
  if (axis == rank - 1) {
    KILN_ASSIGN_OR_RETURN(y, softmax_along(c, x, axis));
    return c.out(0, y);
  }
  KILN_ASSIGN_OR_RETURN(Sizes shape, c.static_shape(x, "input"));
  KILN_ASSIGN_OR_RETURN(Value * flat, c.op("flatten", {x}, {{"axis", Attribute(axis)}}));
  KILN_ASSIGN_OR_RETURN(y, softmax_along(c, flat, 1));
  KILN_ASSIGN_OR_RETURN(y, reshape(c, y, shape));
  return c.out(0, y);
}

}  // namespace

void register_math_ops(HandlerTable& t) {
  for (const char* op : {"Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Tanh", "Erf", "Sigmoid",
                         "Relu", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "Softplus", "Not",
                         "IsNaN", "Asin", "Acos", "Atan"})
    t[op] = unary;
  for (const char* op : {"Tan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Softsign", "Mish"})
    t[op] = unary_composite;
  t["IsInf"] = is_inf;
  for (const char* op : {"LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish",
                         "ThresholdedRelu", "Shrink", "PRelu", "Gelu"})
    t[op] = activation;
  for (const char* op : {"Add", "Sub", "Mul", "Div", "And", "Or", "Xor", "Equal", "Less", "Greater",
                         "LessOrEqual", "GreaterOrEqual"})
    t[op] = binary;
  t["Pow"] = pow_op;
  t["Mod"] = mod_op;
  t["BitShift"] = bit_shift;
  for (const char* op : {"Max", "Min", "Sum", "Mean"}) t[op] = variadic;
  t["Where"] = where_op;
  t["Clip"] = clip_op;
  t["Cast"] = cast_op;
  t["CastLike"] = cast_op;
  for (const char* op : {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                         "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"})
    t[op] = reduce_op;
  t["ArgMax"] = arg_op;
  t["ArgMin"] = arg_op;
  for (const char* op : {"Softmax", "LogSoftmax", "Hardmax"}) t[op] = softmax_op;
}

}  // namespace kiln::onnx_fe
