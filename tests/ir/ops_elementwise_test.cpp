// Tests of the elementwise core ops (unary, binary, compare, logic, cast, where, clip) against
// hand-computed values, run through the reference interpreter.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"

#include "op_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();


std::string run_error(const std::string& op, const std::vector<Tensor>& inputs,
                      AttrMap attrs = {}) {
  auto r = run_op(op, inputs, std::move(attrs));
  REQUIRE_FALSE(r.ok());
  return r.status().message();
}

/// The result type the shape rule gives for operands of `types` (symbolic dims allowed).
/// The single result type the shape rule gives.
StatusOr<TensorType> infer1(const std::string& op, std::vector<TensorType> types, AttrMap attrs = {}) {
  KILN_ASSIGN_OR_RETURN(std::vector<TensorType> out, infer_op(op, std::move(types), std::move(attrs)));
  return out[0];
}



/// Runs a unary op on a 1-D f64 tensor and compares with hand values (to ~1 ulp of libm).
void unary_f64(const std::string& op, std::vector<double> x, std::vector<double> want,
               AttrMap attrs = {}) {
  INFO("op " << op);
  const int64_t n = static_cast<int64_t>(x.size());
  expect(run1(op, {tf(DType::kF64, {n}, x)}, std::move(attrs)), DType::kF64, {n}, want, 1e-15);
}

}  // namespace

TEST_CASE("elementwise: unary float ops match hand-computed values") {
  unary_f64("neg", {1.5, -2, 0}, {-1.5, 2, -0.0});
  unary_f64("abs", {-1.5, 2, -kInf}, {1.5, 2, kInf});
  unary_f64("exp", {0, 1, -kInf}, {1, 2.718281828459045, 0});
  unary_f64("log", {1, 2, 0, -1}, {0, 0.6931471805599453, -kInf, kNaN});
  unary_f64("sqrt", {4, 2, -1}, {2, 1.4142135623730951, kNaN});
  unary_f64("rsqrt", {4, 0.25, 0}, {0.5, 2, kInf});
  unary_f64("reciprocal", {4, -0.5, 0}, {0.25, -2, kInf});
  unary_f64("tanh", {0, 1, -kInf}, {0, 0.7615941559557649, -1});
  unary_f64("erf", {0, 1, -kInf}, {0, 0.8427007929497149, -1});
  unary_f64("sigmoid", {0, 1, -2, -1000}, {0.5, 0.7310585786300049, 0.11920292202211755, 0});
  unary_f64("relu", {-1, 0, 2.5, kNaN}, {0, 0, 2.5, kNaN});
  unary_f64("gelu", {1, -1, 0}, {0.8413447460685429, -0.15865525393145707, 0});
  unary_f64("gelu", {1, -1, 2}, {0.8411919906082768, -0.15880800939172324, 1.954597694087775},
            {{"approximate", "tanh"}});
  unary_f64("silu", {1, -1, 0}, {0.7310585786300049, -0.2689414213699951, 0});
  unary_f64("sin", {0, 1}, {0, 0.8414709848078965});
  unary_f64("cos", {0, 1}, {1, 0.5403023058681398});
  unary_f64("floor", {-1.5, 1.5, 2, -0.0}, {-2, 1, 2, -0.0});
  unary_f64("ceil", {-1.5, 1.5, 2}, {-1, 2, 2});
  unary_f64("sign", {-3, 2, kNaN}, {-1, 1, kNaN});
  unary_f64("leaky_relu", {-2, 3}, {-0.02, 3});
  unary_f64("leaky_relu", {-2, 3}, {-1, 3}, {{"alpha", 0.5}});
  unary_f64("softplus", {0, 1, -1, 1000, -1000},
            {0.6931471805599453, 1.3132616875182228, 0.31326168751822286, 1000, 0});
}

TEST_CASE("elementwise: round is half to even and sign keeps zero") {
  expect(run1("round", {tf(DType::kF32, {7}, {0.5, 1.5, 2.5, -0.5, -1.5, 2.4, 2.6})}), DType::kF32,
         {7}, {0, 2, 2, -0.0, -2, 2, 3});
  expect(run1("sign", {tf(DType::kF32, {2}, {0.0, -0.0})}), DType::kF32, {2}, {0.0, -0.0});
}

TEST_CASE("elementwise: unary results round once to f16 and bf16") {
  // exp(1) = 2.71828...: the nearest f16 (step 2^-9) and bf16 (step 2^-6) is 2.71875.
  expect(run1("exp", {tf(DType::kF16, {1}, {1})}), DType::kF16, {1}, {2.71875});
  expect(run1("exp", {tf(DType::kBF16, {1}, {1})}), DType::kBF16, {1}, {2.71875});
  // sqrt(2) = 1.41421...: 1448 / 1024 in f16, 181 / 128 in bf16, both 1.4140625.
  expect(run1("sqrt", {tf(DType::kF16, {1}, {2})}), DType::kF16, {1}, {1.4140625});
  expect(run1("sqrt", {tf(DType::kBF16, {1}, {2})}), DType::kBF16, {1}, {1.4140625});
  expect(run1("exp", {tf(DType::kF32, {1}, {1})}), DType::kF32, {1}, {2.7182817459106445});
}

TEST_CASE("elementwise: neg abs relu sign accept signed integers and wrap") {
  const Tensor x = ti(DType::kI8, {4}, {-128, -5, 0, 7});
  expect(run1("neg", {x}), DType::kI8, {4}, {-128, 5, 0, -7});
  expect(run1("abs", {x}), DType::kI8, {4}, {-128, 5, 0, 7});
  expect(run1("relu", {x}), DType::kI8, {4}, {0, 0, 0, 7});
  expect(run1("sign", {x}), DType::kI8, {4}, {-1, -1, 0, 1});
  expect(run1("neg", {ti(DType::kI4, {3}, {-8, 3, 7})}), DType::kI4, {3}, {-8, -3, -7});
  expect(run1("abs", {ti(DType::kI64, {1}, {std::numeric_limits<int64_t>::min()})}), DType::kI64,
         {1}, {-9223372036854775808.0});
}

TEST_CASE("elementwise: unary dtype and attribute errors") {
  CHECK(run_error("exp", {ti(DType::kI32, {1}, {1})}) == "exp: operand 'x' must be float, got i32");
  CHECK(run_error("neg", {ti(DType::kU8, {1}, {1})}) ==
        "neg: operand 'x' must be float or signed integer, got u8");
  CHECK(run_error("relu", {ti(DType::kBool, {1}, {1})}).find("got bool") != std::string::npos);
  CHECK(run_error("gelu", {tf(DType::kF32, {1}, {1})}, {{"approximate", "fast"}}) ==
        "gelu: attribute 'approximate' must be \"none\" or \"tanh\", got \"fast\"");
  CHECK(run_error("leaky_relu", {tf(DType::kF32, {1}, {1})}, {{"alpha", "big"}})
            .find("attribute 'alpha'") != std::string::npos);
}

TEST_CASE("elementwise: not isnan isinf give bool") {
  expect(run1("not", {ti(DType::kBool, {2}, {0, 1})}), DType::kBool, {2}, {1, 0});
  const Tensor x = tf(DType::kF16, {4}, {1, kNaN, kInf, -kInf});
  expect(run1("isnan", {x}), DType::kBool, {4}, {0, 1, 0, 0});
  expect(run1("isinf", {x}), DType::kBool, {4}, {0, 0, 1, 1});
  CHECK(run_error("not", {tf(DType::kF32, {1}, {0})}) == "not: operand 'x' must be bool, got f32");
  CHECK(run_error("isnan", {ti(DType::kI32, {1}, {0})}) ==
        "isnan: operand 'x' must be float, got i32");
}

TEST_CASE("elementwise: binary arithmetic broadcasts numpy-style") {
  const Tensor a = tf(DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6});
  const Tensor row = tf(DType::kF32, {3}, {10, 20, 30});
  expect(run1("add", {a, row}), DType::kF32, {2, 3}, {11, 22, 33, 14, 25, 36});
  expect(run1("sub", {row, a}), DType::kF32, {2, 3}, {9, 18, 27, 6, 15, 24});
  // [2, 1] against [1, 3] expands both.
  const Tensor col = tf(DType::kF32, {2, 1}, {1, 2});
  const Tensor r13 = tf(DType::kF32, {1, 3}, {1, 2, 3});
  expect(run1("mul", {col, r13}), DType::kF32, {2, 3}, {1, 2, 3, 2, 4, 6});
  expect(run1("div", {r13, col}), DType::kF32, {2, 3}, {1, 2, 3, 0.5, 1, 1.5});
  // A scalar broadcasts against anything.
  expect(run1("pow", {tf(DType::kF64, {3}, {2, 4, -8}), Tensor::scalar_f64(DType::kF64, 2)}),
         DType::kF64, {3}, {4, 16, 64});
  expect(run1("pow", {tf(DType::kF64, {2}, {4, 2}), tf(DType::kF64, {2}, {0.5, -1})}), DType::kF64,
         {2}, {2, 0.5});
  expect(run1("div", {tf(DType::kF32, {3}, {1, -1, 0}), tf(DType::kF32, {3}, {0, 0, 0})}),
         DType::kF32, {3}, {kInf, -kInf, kNaN});
  expect(run1("maximum", {tf(DType::kF32, {3}, {1, 5, kNaN}), tf(DType::kF32, {3}, {3, 2, 1})}),
         DType::kF32, {3}, {3, 5, kNaN});
  expect(run1("minimum", {tf(DType::kF32, {3}, {1, 5, 1}), tf(DType::kF32, {3}, {3, 2, kNaN})}),
         DType::kF32, {3}, {1, 2, kNaN});
}

TEST_CASE("elementwise: binary results round once to f16 and bf16") {
  // 1 + 2^-11 is halfway between f16 neighbours 1 and 1 + 2^-10: ties to even gives 1;
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: even is 1 + 2^-9.
  expect(run1("add", {tf(DType::kF16, {2}, {1, 1}), tf(DType::kF16, {2}, {0x1p-11, 0x3p-11})}),
         DType::kF16, {2}, {1, 1 + 0x1p-9});
  // Same in bf16 with steps of 2^-7 near 1.
  expect(run1("add", {tf(DType::kBF16, {2}, {1, 1}), tf(DType::kBF16, {2}, {0x1p-8, 0x3p-8})}),
         DType::kBF16, {2}, {1, 1 + 0x1p-6});
  // 3 * (1 + 2^-7) = 3 + 3 * 2^-7 rounds to 3 + 2^-5 (bf16 step 2^-6 in [2, 4)).
  expect(run1("mul", {tf(DType::kBF16, {1}, {3}), tf(DType::kBF16, {1}, {1 + 0x1p-7})}),
         DType::kBF16, {1}, {3 + 0x1p-5});
}

TEST_CASE("elementwise: integer arithmetic wraps to the dtype width") {
  expect(run1("add", {ti(DType::kI8, {2}, {100, -100}), ti(DType::kI8, {2}, {100, -100})}),
         DType::kI8, {2}, {-56, 56});
  expect(run1("add", {ti(DType::kU8, {1}, {200}), ti(DType::kU8, {1}, {100})}), DType::kU8, {1},
         {44});
  expect(run1("sub", {ti(DType::kU8, {1}, {1}), ti(DType::kU8, {1}, {2})}), DType::kU8, {1}, {255});
  expect(run1("mul", {ti(DType::kI32, {1}, {65536}), ti(DType::kI32, {1}, {65536})}), DType::kI32,
         {1}, {0});
  expect(run1("mul", {ti(DType::kI4, {2}, {7, -3}), ti(DType::kI4, {2}, {3, 3})}), DType::kI4, {2},
         {5, -9 + 16});
  // Integer division truncates toward zero.
  expect(run1("div", {ti(DType::kI32, {4}, {7, -7, 7, -7}), ti(DType::kI32, {4}, {2, 2, -2, -2})}),
         DType::kI32, {4}, {3, -3, -3, 3});
  expect(run1("div", {ti(DType::kI64, {1}, {std::numeric_limits<int64_t>::min()}),
                      ti(DType::kI64, {1}, {-1})}),
         DType::kI64, {1}, {-9223372036854775808.0});
  expect(run1("pow", {ti(DType::kI32, {3}, {3, -2, 5}), ti(DType::kI32, {3}, {4, 3, 0})}),
         DType::kI32, {3}, {81, -8, 1});
  expect(run1("pow", {ti(DType::kI8, {1}, {2}), ti(DType::kI8, {1}, {7})}), DType::kI8, {1},
         {-128});
  expect(run1("maximum", {ti(DType::kU8, {2}, {3, 250}), ti(DType::kU8, {2}, {4, 1})}), DType::kU8,
         {2}, {4, 250});
  expect(run1("minimum", {ti(DType::kI16, {2}, {3, -250}), ti(DType::kI16, {2}, {4, 1})}),
         DType::kI16, {2}, {3, -250});
}

TEST_CASE("elementwise: mod follows python by default and c fmod with fmod=1") {
  const Tensor a = ti(DType::kI32, {4}, {-7, 7, -7, 7});
  const Tensor b = ti(DType::kI32, {4}, {3, -3, -3, 3});
  expect(run1("mod", {a, b}), DType::kI32, {4}, {2, -2, -1, 1});
  expect(run1("mod", {a, b}, {{"fmod", 1}}), DType::kI32, {4}, {-1, 1, -1, 1});
  const Tensor fa = tf(DType::kF64, {4}, {-7.5, 7.5, 6, -6});
  const Tensor fb = tf(DType::kF64, {4}, {2, -2, 3, 3});
  expect(run1("mod", {fa, fb}), DType::kF64, {4}, {0.5, -0.5, 0, 0});
  expect(run1("mod", {fa, fb}, {{"fmod", 1}}), DType::kF64, {4}, {-1.5, 1.5, 0, -0.0});
  CHECK(run_error("mod", {a, b}, {{"fmod", 2}}) == "mod: attribute 'fmod' must be 0 or 1, got 2");
  CHECK(run_error("mod", {a, ti(DType::kI32, {1}, {0})}) == "mod: integer modulo by zero");
}

TEST_CASE("elementwise: binary errors name the operands") {
  const Tensor f = tf(DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6});
  CHECK(run_error("add", {f, ti(DType::kI32, {3}, {1, 2, 3})}) ==
        "add: operands 'a' and 'b' must have the same dtype, got f32 and i32");
  CHECK(run_error("mul", {f, tf(DType::kF32, {4}, {1, 2, 3, 4})}) ==
        "mul: operands 'a' f32[2, 3] and 'b' f32[4] do not broadcast");
  CHECK(run_error("add", {ti(DType::kBool, {1}, {1}), ti(DType::kBool, {1}, {1})}) ==
        "add: operand 'a' must be float or integer, got bool");
  CHECK(run_error("div", {ti(DType::kI32, {2}, {1, 2}), ti(DType::kI32, {2}, {1, 0})}) ==
        "div: integer division by zero");
  CHECK(run_error("pow", {ti(DType::kI32, {1}, {2}), ti(DType::kI32, {1}, {-1})}) ==
        "pow: negative exponent with integer operands");
}

TEST_CASE("elementwise: shape rules keep symbolic dims") {
  const TensorType bx1{DType::kF32, {Dim::symbol("B"), 1}};
  const TensorType r3{DType::kF32, {3}};
  auto t = infer1("add", {bx1, r3});
  REQUIRE(t.ok());
  CHECK(t->str() == "f32[B, 3]");
  auto c = infer1("less", {bx1, bx1});
  REQUIRE(c.ok());
  CHECK(c->str() == "bool[B, 1]");
  auto u = infer1("exp", {bx1});
  REQUIRE(u.ok());
  CHECK(u->str() == "f32[B, 1]");
  auto w = infer1("where", {TensorType{DType::kBool, {Dim::symbol("S")}}, bx1, r3});
  REQUIRE(w.ok());
  CHECK(w->str() == "f32[B, 3]");
}

TEST_CASE("elementwise: comparisons give bool and treat nan as unordered") {
  const Tensor a = tf(DType::kF32, {2, 2}, {1, 2, 3, kNaN});
  const Tensor b = tf(DType::kF32, {2}, {2, 2});
  expect(run1("equal", {a, b}), DType::kBool, {2, 2}, {0, 1, 0, 0});
  expect(run1("not_equal", {a, b}), DType::kBool, {2, 2}, {1, 0, 1, 1});
  expect(run1("less", {a, b}), DType::kBool, {2, 2}, {1, 0, 0, 0});
  expect(run1("less_equal", {a, b}), DType::kBool, {2, 2}, {1, 1, 0, 0});
  expect(run1("greater", {a, b}), DType::kBool, {2, 2}, {0, 0, 1, 0});
  expect(run1("greater_equal", {a, b}), DType::kBool, {2, 2}, {0, 1, 1, 0});
  // Integers compare exactly in int64, even beyond 2^53.
  const Tensor big = ti(DType::kI64, {1}, {(int64_t{1} << 60) + 1});
  expect(run1("greater", {big, ti(DType::kI64, {1}, {int64_t{1} << 60})}), DType::kBool, {1}, {1});
  expect(run1("equal", {ti(DType::kBool, {2}, {0, 1}), ti(DType::kBool, {1}, {1})}), DType::kBool,
         {2}, {0, 1});
  CHECK(run_error("less", {a, ti(DType::kI32, {2}, {1, 2})}) ==
        "less: operands 'a' and 'b' must have the same dtype, got f32 and i32");
}

TEST_CASE("elementwise: logical ops on bool") {
  const Tensor a = ti(DType::kBool, {2, 2}, {0, 0, 1, 1});
  const Tensor b = ti(DType::kBool, {2}, {0, 1});
  expect(run1("and", {a, b}), DType::kBool, {2, 2}, {0, 0, 0, 1});
  expect(run1("or", {a, b}), DType::kBool, {2, 2}, {0, 1, 1, 1});
  expect(run1("xor", {a, b}), DType::kBool, {2, 2}, {0, 1, 1, 0});
  CHECK(run_error("and", {ti(DType::kI8, {1}, {1}), ti(DType::kI8, {1}, {1})}) ==
        "and: operand 'a' must be bool, got i8");
}

TEST_CASE("elementwise: cast converts between every kind of dtype") {
  const Tensor f = tf(DType::kF32, {4}, {-1.7, 2.9, kNaN, 0.5});
  expect(run1("cast", {f}, {{"to", DType::kI32}}), DType::kI32, {4}, {-1, 2, 0, 0});
  expect(run1("cast", {f}, {{"to", DType::kBool}}), DType::kBool, {4}, {1, 1, 1, 1});
  expect(run1("cast", {tf(DType::kF32, {2}, {0, -0.0})}, {{"to", DType::kBool}}), DType::kBool, {2},
         {0, 0});
  expect(run1("cast", {ti(DType::kI32, {3}, {300, -1, 255})}, {{"to", DType::kU8}}), DType::kU8,
         {3}, {44, 255, 255});
  expect(run1("cast", {ti(DType::kI32, {2}, {9, -9})}, {{"to", DType::kI4}}), DType::kI4, {2},
         {-7, 7});
  expect(run1("cast", {ti(DType::kBool, {2}, {1, 0})}, {{"to", DType::kF16}}), DType::kF16, {2},
         {1, 0});
  expect(run1("cast", {ti(DType::kI64, {1}, {2049})}, {{"to", DType::kF16}}), DType::kF16, {1},
         {2048});
  // 2^60 + 2^36 + 1 lies just above the midpoint of f32 neighbours 2^60 and 2^60 + 2^37; via
  // a nearest-even double it would land on the midpoint and tie down to 2^60.
  const int64_t p60 = int64_t{1} << 60;
  expect(run1("cast", {ti(DType::kI64, {2}, {p60 + (int64_t{1} << 36) + 1, p60 + 1})},
              {{"to", DType::kF32}}),
         DType::kF32, {2}, {0x1p60 + 0x1p37, 0x1p60});
  expect(
      run1("cast", {ti(DType::kI64, {1}, {p60 + (int64_t{1} << 52) + 1})}, {{"to", DType::kBF16}}),
      DType::kBF16, {1}, {0x1p60 + 0x1p53});
  expect(run1("cast", {ti(DType::kI64, {2}, {std::numeric_limits<int64_t>::max(), -p60 - 1})},
              {{"to", DType::kF64}}),
         DType::kF64, {2}, {0x1p63, -0x1p60});
  // 1/3 in f64 rounds to the nearest f16, 0x3555 = 0.333251953125.
  expect(run1("cast", {tf(DType::kF64, {1}, {1.0 / 3})}, {{"to", DType::kF16}}), DType::kF16, {1},
         {0.333251953125});
  expect(run1("cast", {tf(DType::kF16, {1}, {65504})}, {{"to", DType::kF32}}), DType::kF32, {1},
         {65504});
}

TEST_CASE("elementwise: cast to f8 saturates unless told not to") {
  const Tensor x = tf(DType::kF32, {3}, {1000, -1000, 1.5});
  expect(run1("cast", {x}, {{"to", DType::kF8E4M3FN}}), DType::kF8E4M3FN, {3}, {448, -448, 1.5});
  expect(run1("cast", {x}, {{"to", DType::kF8E4M3FN}, {"saturate", 0}}), DType::kF8E4M3FN, {3},
         {kNaN, kNaN, 1.5});
  const Tensor y = tf(DType::kF32, {2}, {1e6, 3});
  expect(run1("cast", {y}, {{"to", DType::kF8E5M2}}), DType::kF8E5M2, {2}, {57344, 3});
  expect(run1("cast", {y}, {{"to", DType::kF8E5M2}, {"saturate", 0}}), DType::kF8E5M2, {2},
         {kInf, 3});
  CHECK(run_error("cast", {x}) == "cast: missing required attribute 'to'");
  CHECK(run_error("cast", {x}, {{"to", DType::kF16}, {"saturate", 3}}) ==
        "cast: attribute 'saturate' must be 0 or 1, got 3");
}

TEST_CASE("elementwise: where broadcasts three ways and copies exactly") {
  const Tensor cond = ti(DType::kBool, {2, 1}, {1, 0});
  const Tensor a = tf(DType::kF32, {1, 3}, {1, 2, 3});
  const Tensor b = Tensor::scalar_f64(DType::kF32, -1);
  expect(run1("where", {cond, a, b}), DType::kF32, {2, 3}, {1, 2, 3, -1, -1, -1});
  // i4 packs two values per byte; selection must keep the right nibbles.
  expect(run1("where", {ti(DType::kBool, {3}, {1, 0, 1}), ti(DType::kI4, {3}, {-8, 1, 7}),
                        ti(DType::kI4, {3}, {2, -3, 4})}),
         DType::kI4, {3}, {-8, -3, 7});
  CHECK(run_error("where", {ti(DType::kI8, {1}, {1}), a, a}) ==
        "where: operand 'cond' must be bool, got i8");
  CHECK(run_error("where", {cond, a, ti(DType::kI32, {1}, {1})}) ==
        "where: operands 'a' and 'b' must have the same dtype, got f32 and i32");
  CHECK(run_error("where", {ti(DType::kBool, {2}, {1, 0}), a, b}) ==
        "where: operands 'cond' bool[2], 'a' f32[1, 3] and 'b' f32[] do not broadcast");
}

TEST_CASE("elementwise: clip clamps floats and integers") {
  const Tensor f = tf(DType::kF32, {5}, {-5, -1, 0.5, 9, kNaN});
  expect(run1("clip", {f}, {{"min", -2.0}, {"max", 2.0}}), DType::kF32, {5},
         {-2, -1, 0.5, 2, kNaN});
  expect(run1("clip", {f}, {{"min", 0}}), DType::kF32, {5}, {0, 0, 0.5, 9, kNaN});
  expect(run1("clip", {f}), DType::kF32, {5}, {-5, -1, 0.5, 9, kNaN});
  // min > max: max wins, as numpy does.
  expect(run1("clip", {f}, {{"min", 3.0}, {"max", 1.0}}), DType::kF32, {5}, {1, 1, 1, 1, kNaN});
  // Integer bounds round inward: [-2.5, 2.5] admits -2..2.
  expect(run1("clip", {ti(DType::kI32, {3}, {-5, 0, 5})}, {{"min", -2.5}, {"max", 2.5}}),
         DType::kI32, {3}, {-2, 0, 2});
  // Bounds outside the dtype's range clamp to it instead of wrapping.
  expect(run1("clip", {ti(DType::kU8, {2}, {3, 200})}, {{"min", 300.0}}), DType::kU8, {2},
         {255, 255});
  expect(run1("clip", {ti(DType::kU8, {2}, {3, 200})}, {{"min", -10.0}, {"max", 100.0}}),
         DType::kU8, {2}, {3, 100});
  CHECK(run_error("clip", {ti(DType::kBool, {1}, {1})}) ==
        "clip: operand 'x' must be float or integer, got bool");
  CHECK(run_error("clip", {f}, {{"max", kNaN}}) == "clip: attribute 'max' must not be nan");
}

TEST_CASE("elementwise: every op is registered with its traits") {
  const OpRegistry& r = OpRegistry::global();
  for (const char* name : {"neg",  "abs",   "exp",     "log",   "sqrt", "rsqrt",      "reciprocal",
                           "tanh", "erf",   "sigmoid", "relu",  "gelu", "silu",       "sin",
                           "cos",  "floor", "ceil",    "round", "sign", "leaky_relu", "softplus",
                           "not",  "isnan", "isinf",   "cast",  "clip"}) {
    INFO(name);
    const OpDef* d = r.find(name);
    REQUIRE(d != nullptr);
    CHECK(d->has(kTraitElementwise));
    CHECK_FALSE(d->has(kTraitBroadcast));
    CHECK_FALSE(d->summary.empty());
  }
  for (const char* name :
       {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "mod", "equal", "not_equal",
        "less", "less_equal", "greater", "greater_equal", "and", "or", "xor", "where"}) {
    INFO(name);
    const OpDef* d = r.find(name);
    REQUIRE(d != nullptr);
    CHECK(d->has(kTraitElementwise));
    CHECK(d->has(kTraitBroadcast));
  }
  for (const char* name :
       {"add", "mul", "maximum", "minimum", "equal", "not_equal", "and", "or", "xor"})
    CHECK(r.find(name)->has(kTraitCommutative));
  for (const char* name : {"sub", "div", "pow", "mod", "less", "where"})
    CHECK_FALSE(r.find(name)->has(kTraitCommutative));
}
