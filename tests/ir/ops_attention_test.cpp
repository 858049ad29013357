// Tests of the core attention op against hand-computed values and its shape-rule errors.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kiln/ir/op.h"

#include "op_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

// q = k = identity rows and scale ln 3 give scores [[ln3, 0], [0, ln3]]: softmax rows
// [3/4, 1/4] and [1/4, 3/4]; with v = [4, 8] the rows are 5 and 7.
const double kLn3 = std::log(3.0);
Tensor eye() { return f32({1, 1, 2, 2}, {1, 0, 0, 1}); }
Tensor v48() { return f32({1, 1, 2, 1}, {4, 8}); }

}  // namespace

TEST_CASE("attention: non-causal, causal and an additive mask") {
  expect(run1("attention", {eye(), eye(), v48()}, {{"scale", kLn3}}), DType::kF32, {1, 1, 2, 1},
         {5, 7}, 1e-6);
  // Causal: row 0 sees key 0 only.
  expect(run1("attention", {eye(), eye(), v48()}, {{"scale", kLn3}, {"causal", 1}}), DType::kF32,
         {1, 1, 2, 1}, {4, 7}, 1e-6);
  // Mask [0, ln3] broadcast over rows: row 0 scores [ln3, ln3] -> 6; row 1 [0, 2 ln3] -> weights
  // [1/10, 9/10] -> 7.6.
  expect(run1("attention", {eye(), eye(), v48(), f32({2}, {0, kLn3})}, {{"scale", kLn3}}),
         DType::kF32, {1, 1, 2, 1}, {6, 7.6}, 1e-6);
}

TEST_CASE("attention: grouped-query heads share a kv head") {
  // Two query heads, one kv head; head 1 swaps the query rows.
  Tensor q = f32({1, 2, 2, 2}, {1, 0, 0, 1, 0, 1, 1, 0});
  expect(run1("attention", {q, eye(), v48()}, {{"scale", kLn3}}), DType::kF32, {1, 2, 2, 1},
         {5, 7, 7, 5}, 1e-6);
}

TEST_CASE("attention: causal offset aligns the last query with the last key") {
  // Sq 1, Skv 2: the only query sees both keys.
  expect(run1("attention", {f32({1, 1, 1, 2}, {1, 0}), eye(), v48()}, {{"scale", kLn3}, {"causal", 1}}),
         DType::kF32, {1, 1, 1, 1}, {5}, 1e-6);
  // Sq 2, Skv 1: query 0 sees no key (NaN, like softmax over all -inf); query 1 sees key 0.
  Tensor y = run1("attention", {eye(), f32({1, 1, 1, 2}, {1, 0}), f32({1, 1, 1, 1}, {4})},
                  {{"scale", 1.0}, {"causal", 1}});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  expect(y, DType::kF32, {1, 1, 2, 1}, {nan, 4});
}

TEST_CASE("attention: value head dim differs and narrow dtypes round once") {
  Tensor v = Tensor::from_f64(DType::kBF16, {1, 1, 2, 3}, std::vector<double>{4, 0, 1, 8, 2, 1});
  Tensor q = Tensor::from_f64(DType::kBF16, {1, 1, 2, 2}, std::vector<double>{1, 0, 0, 1});
  Tensor y = run1("attention", {q, q, v}, {{"scale", kLn3}});
  // Row 0: 3/4 [4,0,1] + 1/4 [8,2,1] = [5, 0.5, 1]; row 1: [7, 1.5, 1].
  expect(y, DType::kBF16, {1, 1, 2, 3}, {5, 0.5, 1, 7, 1.5, 1});
}

TEST_CASE("attention: shape rule errors name the operands") {
  const TensorType q{DType::kF32, {1, 4, 8, 16}}, k{DType::kF32, {1, 2, 8, 16}},
      v{DType::kF32, {1, 2, 8, 32}};
  AttrMap a = {{"scale", 0.25}};
  auto r = infer_op("attention", {q, k, v}, a);
  REQUIRE(r.ok());
  CHECK((*r)[0].str() == "f32[1, 4, 8, 32]");
  CHECK(error_of(infer_op("attention", {TensorType{DType::kF32, {4, 8, 16}}, k, v}, a)) ==
        "attention: operand 'q' must have rank 4 ([B, H, S, D]), got f32[4, 8, 16]");
  CHECK(error_of(infer_op("attention", {q, TensorType{DType::kF32, {1, 2, 8, 8}}, v}, a)) ==
        "attention: head dims of 'q' f32[1, 4, 8, 16] and 'k' f32[1, 2, 8, 8] differ");
  CHECK(error_of(infer_op("attention", {q, k, TensorType{DType::kF32, {1, 2, 9, 32}}}, a)) ==
        "attention: key lengths of 'k' f32[1, 2, 8, 16] and 'v' f32[1, 2, 9, 32] differ");
  CHECK(error_of(infer_op("attention", {q, TensorType{DType::kF32, {1, 3, 8, 16}},
                                        TensorType{DType::kF32, {1, 3, 8, 32}}},
                          a)) == "attention: query heads 4 are not a multiple of key/value heads 3");
  CHECK(error_of(infer_op("attention", {q, TensorType{DType::kF16, {1, 2, 8, 16}}, v}, a)) ==
        "attention: operands 'q' and 'k' must have the same dtype, got f32 and f16");
  CHECK(error_of(infer_op("attention", {q, k, v, TensorType{DType::kF32, {3, 8}}}, a)) ==
        "attention: operand 'mask' f32[3, 8] does not broadcast to the scores [1, 4, 8, 8]");
  CHECK(error_of(infer_op("attention", {q, k, v, TensorType{DType::kI32, {8, 8}}}, a)) ==
        "attention: operand 'mask' must be float, got i32");
  CHECK(error_of(infer_op("attention", {q, k, v}, {{"scale", 1.0}, {"causal", 2}})) ==
        "attention: attribute 'causal' must be 0 or 1, got 2");
  CHECK(error_of(infer_op("attention", {q, k, v})) ==
        "attention: missing required attribute 'scale'");
}
