// Tests of the reduction core ops (reduce_*, argmax/argmin, softmax, log_softmax) against
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

/// run1 over a single operand.
Tensor run1(const std::string& op, const Tensor& x, AttrMap attrs = {}) {
  auto r = run_op(op, {x}, std::move(attrs));
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  return r.value()[0];
}

std::string run_error(const std::string& op, const Tensor& x, AttrMap attrs = {}) {
  auto r = run_op(op, {x}, std::move(attrs));
  REQUIRE_FALSE(r.ok());
  return r.status().message();
}

/// The result type the shape rule gives for an operand of `type` (symbolic dims allowed).
StatusOr<TensorType> infer1(const std::string& op, const TensorType& type, AttrMap attrs = {}) {
  KILN_ASSIGN_OR_RETURN(std::vector<TensorType> out, infer_op(op, {type}, std::move(attrs)));
  return out[0];
}



using Axes = std::vector<int64_t>;

// [[1, 2, 3], [4, 5, 6]]
const Tensor kX23 = Tensor::from_f64(DType::kF32, {2, 3}, std::vector<double>{1, 2, 3, 4, 5, 6});

}  // namespace

TEST_CASE("reduction: reduce_sum over axes with and without keepdims") {
  expect(run1("reduce_sum", kX23, {{"axes", Axes{1}}}), DType::kF32, {2, 1}, {6, 15});
  expect(run1("reduce_sum", kX23, {{"axes", Axes{1}}, {"keepdims", 0}}), DType::kF32, {2}, {6, 15});
  expect(run1("reduce_sum", kX23, {{"axes", Axes{0}}, {"keepdims", 0}}), DType::kF32, {3},
         {5, 7, 9});
  expect(run1("reduce_sum", kX23, {{"axes", Axes{-2}}}), DType::kF32, {1, 3}, {5, 7, 9});
  // Absent or empty axes reduce everything.
  expect(run1("reduce_sum", kX23), DType::kF32, {1, 1}, {21});
  expect(run1("reduce_sum", kX23, {{"axes", Axes{}}, {"keepdims", 0}}), DType::kF32, {}, {21});
  // Middle axis of a rank-3 tensor, and two non-adjacent axes.
  const Tensor x = tf(DType::kF64, {2, 2, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  expect(run1("reduce_sum", x, {{"axes", Axes{1}}, {"keepdims", 0}}), DType::kF64, {2, 2},
         {4, 6, 12, 14});
  expect(run1("reduce_sum", x, {{"axes", Axes{-1, 0}}}), DType::kF64, {1, 2, 1}, {14, 22});
}

TEST_CASE("reduction: reduce_mean reduce_max reduce_min reduce_prod") {
  expect(run1("reduce_mean", kX23, {{"axes", Axes{1}}, {"keepdims", 0}}), DType::kF32, {2}, {2, 5});
  expect(run1("reduce_mean", kX23), DType::kF32, {1, 1}, {3.5});
  expect(run1("reduce_max", kX23, {{"axes", Axes{0}}}), DType::kF32, {1, 3}, {4, 5, 6});
  expect(run1("reduce_min", kX23, {{"axes", Axes{-1}}, {"keepdims", 0}}), DType::kF32, {2}, {1, 4});
  expect(run1("reduce_prod", kX23, {{"axes", Axes{1}}, {"keepdims", 0}}), DType::kF32, {2},
         {6, 120});
  const Tensor nan = tf(DType::kF32, {2, 2}, {1, kNaN, -kInf, -kInf});
  expect(run1("reduce_max", nan, {{"axes", Axes{1}}, {"keepdims", 0}}), DType::kF32, {2},
         {kNaN, -kInf});
  expect(run1("reduce_min", nan, {{"axes", Axes{1}}, {"keepdims", 0}}), DType::kF32, {2},
         {kNaN, -kInf});
}

TEST_CASE("reduction: integer reductions accumulate in int64 and wrap on output") {
  const Tensor x = ti(DType::kI8, {3}, {100, 100, 27});
  expect(run1("reduce_sum", x, {{"keepdims", 0}}), DType::kI8, {}, {-29});  // 227 - 256
  expect(run1("reduce_prod", ti(DType::kI8, {2}, {16, 16}), {{"keepdims", 0}}), DType::kI8, {},
         {0});
  expect(run1("reduce_max", ti(DType::kU8, {3}, {3, 250, 7}), {{"keepdims", 0}}), DType::kU8, {},
         {250});
  expect(run1("reduce_min", ti(DType::kI32, {2, 2}, {5, -3, 2, 9}), {{"axes", Axes{0}}}),
         DType::kI32, {1, 2}, {2, -3});
  // In int64 the partial sum 2^62 + 2^62 wraps, then -2^62 - 2^62 wraps back: exact 0.
  const int64_t big = int64_t{1} << 62;
  expect(run1("reduce_sum", ti(DType::kI64, {4}, {big, big, -big, -big}), {{"keepdims", 0}}),
         DType::kI64, {}, {0});
}

TEST_CASE("reduction: float reductions accumulate in double and round once") {
  // In f16, 1 + 2^-11 rounds back to 1 (a tie to even), so summing step by step in f16 gives 1;
  // in double the sum is 1 + 2^-10, which f16 holds exactly.
  expect(run1("reduce_sum", tf(DType::kF16, {3}, {1, 0x1p-11, 0x1p-11}), {{"keepdims", 0}}),
         DType::kF16, {}, {1 + 0x1p-10});
  // Mean of bf16 [1, 2, 2] is 5/3 = 1.666..., nearest bf16 (step 2^-7) is 1.6640625.
  expect(run1("reduce_mean", tf(DType::kBF16, {3}, {1, 2, 2}), {{"keepdims", 0}}), DType::kBF16, {},
         {1.6640625});
}

TEST_CASE("reduction: empty reductions") {
  const Tensor empty = tf(DType::kF32, {2, 0}, {});
  expect(run1("reduce_sum", empty, {{"axes", Axes{1}}}), DType::kF32, {2, 1}, {0, 0});
  expect(run1("reduce_prod", empty, {{"axes", Axes{1}}, {"keepdims", 0}}), DType::kF32, {2},
         {1, 1});
  expect(run1("reduce_mean", empty, {{"axes", Axes{1}}, {"keepdims", 0}}), DType::kF32, {2},
         {kNaN, kNaN});
  // Reducing the non-empty axis leaves an empty result, which is fine even for max.
  expect(run1("reduce_max", empty, {{"axes", Axes{0}}, {"keepdims", 0}}), DType::kF32, {0}, {});
  CHECK(run_error("reduce_max", empty, {{"axes", Axes{1}}}) ==
        "reduce_max: cannot reduce over axis 1 of size 0: the reduction has no identity");
  CHECK(run_error("reduce_min", empty) ==
        "reduce_min: cannot reduce over axis 1 of size 0: the reduction has no identity");
}

TEST_CASE("reduction: reduce errors") {
  CHECK(run_error("reduce_sum", kX23, {{"axes", Axes{2}}}) ==
        "reduce_sum: axis 2 is out of range for rank 2");
  CHECK(run_error("reduce_sum", kX23, {{"axes", Axes{-3}}}) ==
        "reduce_sum: axis -3 is out of range for rank 2");
  CHECK(run_error("reduce_max", kX23, {{"axes", Axes{1, -1}}}) ==
        "reduce_max: axis -1 appears more than once (as axis 1)");
  CHECK(run_error("reduce_mean", ti(DType::kI32, {2}, {1, 2})) ==
        "reduce_mean: operand 'x' must be float, got i32");
  CHECK(run_error("reduce_sum", ti(DType::kBool, {2}, {1, 0})) ==
        "reduce_sum: operand 'x' must be float or integer, got bool");
  CHECK(run_error("reduce_prod", kX23, {{"keepdims", 2}}) ==
        "reduce_prod: attribute 'keepdims' must be 0 or 1, got 2");
  CHECK(run_error("reduce_sum", kX23, {{"axes", 1.5}}).find("attribute 'axes'") !=
        std::string::npos);
}

TEST_CASE("reduction: shape rules keep symbolic dims") {
  const TensorType x{DType::kF32, {Dim::symbol("B"), 4, Dim::symbol("S")}};
  auto r = infer1("reduce_sum", x, {{"axes", Axes{1}}, {"keepdims", 0}});
  REQUIRE(r.ok());
  CHECK(r->str() == "f32[B, S]");
  r = infer1("reduce_max", x, {{"axes", Axes{0, 2}}});
  REQUIRE(r.ok());
  CHECK(r->str() == "f32[1, 4, 1]");
  r = infer1("argmax", x, {{"axis", -1}, {"keepdims", 0}});
  REQUIRE(r.ok());
  CHECK(r->str() == "i64[B, 4]");
  r = infer1("softmax", x);
  REQUIRE(r.ok());
  CHECK(r->str() == "f32[B, 4, S]");
}

TEST_CASE("reduction: argmax and argmin") {
  const Tensor x = tf(DType::kF32, {2, 3}, {1, 9, 9, 7, 0, 7});
  expect(run1("argmax", x, {{"axis", 1}}), DType::kI64, {2, 1}, {1, 0});
  expect(run1("argmax", x, {{"axis", 1}, {"select_last_index", 1}}), DType::kI64, {2, 1}, {2, 2});
  expect(run1("argmax", x), DType::kI64, {1, 3}, {1, 0, 0});
  expect(run1("argmin", x, {{"axis", -1}, {"keepdims", 0}}), DType::kI64, {2}, {0, 1});
  expect(run1("argmin", x, {{"axis", 0}, {"keepdims", 0}}), DType::kI64, {3}, {0, 1, 1});
  expect(run1("argmin", ti(DType::kI32, {4}, {3, -1, 5, -1}), {{"select_last_index", 1}}),
         DType::kI64, {1}, {3});
  // Nan is the most extreme value for both, like numpy.
  const Tensor nan = tf(DType::kF64, {4}, {1, kNaN, 5, kNaN});
  expect(run1("argmax", nan, {{"keepdims", 0}}), DType::kI64, {}, {1});
  expect(run1("argmin", nan, {{"keepdims", 0}}), DType::kI64, {}, {1});
  expect(run1("argmax", nan, {{"keepdims", 0}, {"select_last_index", 1}}), DType::kI64, {}, {3});
  CHECK(run_error("argmax", x, {{"axis", 2}}) == "argmax: axis 2 is out of range for rank 2");
  CHECK(run_error("argmin", tf(DType::kF32, {2, 0}, {}), {{"axis", 1}}) ==
        "argmin: cannot take argmin over axis 1 of size 0");
  CHECK(run_error("argmax", ti(DType::kBool, {2}, {0, 1})) ==
        "argmax: operand 'x' must be float or integer, got bool");
  CHECK(run_error("argmax", x, {{"select_last_index", 5}}) ==
        "argmax: attribute 'select_last_index' must be 0 or 1, got 5");
}

TEST_CASE("reduction: softmax and log_softmax") {
  expect(run1("softmax", tf(DType::kF64, {3}, {1, 2, 3})), DType::kF64, {3},
         {0.09003057317038046, 0.24472847105479764, 0.6652409557748218}, 1e-15);
  expect(run1("log_softmax", tf(DType::kF64, {3}, {1, 2, 3})), DType::kF64, {3},
         {-2.4076059644443806, -1.4076059644443804, -0.4076059644443804}, 1e-15);
  // Large inputs must not overflow: the max is subtracted first.
  expect(run1("softmax", tf(DType::kF32, {2}, {1000, 1000})), DType::kF32, {2}, {0.5, 0.5});
  expect(run1("log_softmax", tf(DType::kF32, {2}, {-1000, -1000})), DType::kF32, {2},
         {-0.6931471805599453, -0.6931471805599453}, 1e-7);
  // Along axis 0 of [[0, 0], [ln 3, 0]]: columns [0, ln 3] and [0, 0].
  expect(run1("softmax", tf(DType::kF64, {2, 2}, {0, 0, std::log(3.0), 0}), {{"axis", 0}}),
         DType::kF64, {2, 2}, {0.25, 0.5, 0.75, 0.5}, 1e-15);
  expect(run1("softmax", tf(DType::kF64, {2, 2}, {0, 0, std::log(3.0), 0}), {{"axis", -2}}),
         DType::kF64, {2, 2}, {0.25, 0.5, 0.75, 0.5}, 1e-15);
  // 1/3 rounds once to f16: 0.333251953125.
  expect(run1("softmax", tf(DType::kF16, {3}, {0, 0, 0})), DType::kF16, {3},
         {0.333251953125, 0.333251953125, 0.333251953125});
  CHECK(run_error("softmax", ti(DType::kI32, {2}, {1, 2})) ==
        "softmax: operand 'x' must be float, got i32");
  CHECK(run_error("log_softmax", kX23, {{"axis", 2}}) ==
        "log_softmax: axis 2 is out of range for rank 2");
}

TEST_CASE("reduction: every op is registered as a reduction") {
  for (const char* name : {"reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod",
                           "argmax", "argmin", "softmax", "log_softmax"}) {
    INFO(name);
    const OpDef* d = OpRegistry::global().find(name);
    REQUIRE(d != nullptr);
    CHECK(d->has(kTraitReduction));
    CHECK_FALSE(d->summary.empty());
  }
}
