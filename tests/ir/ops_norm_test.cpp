// Tests of the core normalization ops against hand-computed values.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"

#include "op_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {


}  // namespace

TEST_CASE("norm: ops are registered with the reduction trait") {
  for (const char* name : {"layer_norm", "rms_norm", "batch_norm"}) {
    const OpDef* def = OpRegistry::global().find(name);
    REQUIRE(def != nullptr);
    CHECK(def->has(kTraitReduction));
  }
}

TEST_CASE("norm: layer_norm over the last dim") {
  // Rows [1, 3] (mean 2, variance 1) and [2, 6] (mean 4, variance 4).
  Tensor x = f32({2, 2}, {1, 3, 2, 6});
  AttrMap no_eps = {{"epsilon", 0.0}};
  check_values(run1("layer_norm", {x}, no_eps), {2, 2}, {-1, 1, -1, 1});
  check_values(run1("layer_norm", {x, f32({2}, {2, 3}), f32({2}, {1, -1})}, no_eps), {2, 2},
               {-1, 2, -1, 2});
  // The default epsilon is 1e-5, added to the variance (checked in f64 to see it).
  const double xv[] = {1, 3, 2, 6};
  Tensor y = run1("layer_norm", {Tensor::from_f64(DType::kF64, {2, 2}, xv)});
  const double a = 1 / std::sqrt(1 + 1e-5), b = 2 / std::sqrt(4 + 1e-5);
  check_values(y, {2, 2}, {-a, a, -b, b}, 1e-12);
}

TEST_CASE("norm: layer_norm over several dims with a broadcast scale") {
  // axis 0 of [2, 2]: all four values [1, 3, 2, 6], mean 3, variance (4 + 0 + 1 + 9) / 4 = 3.5.
  Tensor x = f32({2, 2}, {1, 3, 2, 6});
  const double s = std::sqrt(3.5);
  check_values(run1("layer_norm", {x, f32({2}, {1, 2})}, {{"axis", 0}, {"epsilon", 0.0}}), {2, 2},
               {-2 / s, 0, -1 / s, 2 * 3 / s});
}

TEST_CASE("norm: layer_norm rounds once to a narrow dtype") {
  const double xv[] = {1, 3};
  Tensor y = run1("layer_norm", {Tensor::from_f64(DType::kBF16, {2}, xv)}, {{"epsilon", 0.0}});
  CHECK(y.dtype() == DType::kBF16);
  CHECK(y.to_f64() == std::vector<double>{-1, 1});
}

TEST_CASE("norm: rms_norm") {
  // mean(x^2) of [3, 4] is 12.5.
  const double r = std::sqrt(12.5);
  check_values(run1("rms_norm", {f32({1, 2}, {3, 4})}, {{"epsilon", 0.0}}), {1, 2}, {3 / r, 4 / r});
  check_values(run1("rms_norm", {f32({1, 2}, {3, 4}), f32({2}, {2, 0.5})}, {{"epsilon", 0.0}}),
               {1, 2}, {6 / r, 2 / r});
  // Rows are independent; the default epsilon is 1e-6.
  const double xv[] = {1, 1, 2, -2};
  Tensor y = run1("rms_norm", {Tensor::from_f64(DType::kF64, {2, 2}, xv)});
  const double a = 1 / std::sqrt(1 + 1e-6), b = 2 / std::sqrt(4 + 1e-6);
  check_values(y, {2, 2}, {a, a, b, -b}, 1e-12);
}

TEST_CASE("norm: batch_norm uses the given statistics per channel") {
  // Channel 0 = [1, 3]: (x - 2) / 1 * 1 + 0; channel 1 = [4, 8]: (x - 6) / 2 * 2 + 1.
  Tensor x = f32({1, 2, 1, 2}, {1, 3, 4, 8});
  check_values(run1("batch_norm",
                    {x, f32({2}, {1, 2}), f32({2}, {0, 1}), f32({2}, {2, 6}), f32({2}, {1, 4})},
                    {{"epsilon", 0.0}}),
               {1, 2, 1, 2}, {-1, 1, -1, 3});
  // Two images, no spatial dims, default epsilon 1e-5.
  Tensor x2 = f32({2, 1}, {5, 7});
  check_values(run1("batch_norm", {x2, f32({1}, {1}), f32({1}, {0}), f32({1}, {5}), f32({1}, {4})}),
               {2, 1}, {0, 2 / std::sqrt(4 + 1e-5)});
}

TEST_CASE("norm: shape rules keep symbolic dims") {
  auto r = infer_op("layer_norm",
                    {{DType::kF32, {Dim::symbol("B"), Dim::symbol("S"), 4}}, {DType::kF32, {4}}});
  REQUIRE(r.ok());
  CHECK((*r)[0].str() == "f32[B, S, 4]");
  auto bn = infer_op("batch_norm", {{DType::kF16, {Dim::symbol("N"), 3}},
                                    {DType::kF16, {3}},
                                    {DType::kF16, {3}},
                                    {DType::kF16, {3}},
                                    {DType::kF16, {3}}});
  REQUIRE(bn.ok());
  CHECK((*bn)[0].str() == "f16[N, 3]");
}

TEST_CASE("norm: errors") {
  CHECK(error_of(infer_op("layer_norm", {{DType::kI32, {2, 2}}}))
            .find("operand 'x' must be float, got i32") != std::string::npos);
  CHECK(error_of(infer_op("layer_norm", {{DType::kF32, {2, 4}}, {DType::kF32, {3}}}))
            .find("operand 'scale' f32[3] does not broadcast to the normalized dims [4]") !=
        std::string::npos);
  CHECK(
      error_of(infer_op("rms_norm", {{DType::kF32, {2, 4}}, {DType::kF32, {2, 4}}}, {{"axis", 1}}))
          .find("operand 'scale' f32[2, 4] does not broadcast to the normalized dims [4]") !=
      std::string::npos);
  CHECK(error_of(infer_op("layer_norm", {{DType::kF32, {2, 4}}}, {{"axis", 2}}))
            .find("axis 2 is out of range for rank 2") != std::string::npos);
  CHECK(error_of(infer_op("layer_norm", {{DType::kF32, {2, 4}}, {DType::kF16, {4}}}))
            .find("operands 'x' and 'scale' must have the same dtype, got f32 and f16") !=
        std::string::npos);
  CHECK(error_of(infer_op("batch_norm", {{DType::kF32, {1, 2, 3}},
                                         {DType::kF32, {2}},
                                         {DType::kF32, {2}},
                                         {DType::kF32, {3}},
                                         {DType::kF32, {2}}}))
            .find("operand 'mean' must be [C] = [2], got f32[3]") != std::string::npos);
  CHECK(error_of(infer_op("batch_norm", {{DType::kF32, {2}},
                                         {DType::kF32, {2}},
                                         {DType::kF32, {2}},
                                         {DType::kF32, {2}},
                                         {DType::kF32, {2}}}))
            .find("operand 'x' must be [N, C, ...], got f32[2]") != std::string::npos);
  CHECK(error_of(infer_op("rms_norm", {{DType::kF32, {2}}}, {{"epsilon", -1.0}}))
            .find("attribute 'epsilon' must be >= 0") != std::string::npos);
}
