// Tests of the creation core ops (constant, range) against hand-computed values, run through
// the reference interpreter.
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

/// Builds a graph of one operand-less `op` node, verifies it and runs it.
StatusOr<Tensor> run_op(const std::string& op, AttrMap attrs) {
  Graph g;
  KILN_ASSIGN_OR_RETURN(Node * n, g.create_node(op, {}, {TensorType{}}, std::move(attrs)));
  KILN_ASSIGN_OR_RETURN(std::vector<TensorType> out, infer_node_types(*n, {}));
  n->result()->set_type(out[0]);
  g.set_outputs({n->result()});
  KILN_RETURN_IF_ERROR(verify(g));
  KILN_ASSIGN_OR_RETURN(std::vector<Tensor> results, Interpreter().run(g, {}));
  return results[0];
}

Tensor run1(const std::string& op, AttrMap attrs) {
  auto r = run_op(op, std::move(attrs));
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  return r.value();
}

std::string run_error(const std::string& op, AttrMap attrs) {
  auto r = run_op(op, std::move(attrs));
  REQUIRE_FALSE(r.ok());
  return r.status().message();
}

AttrMap range_attrs(double start, double limit, double delta) {
  return {{"start", start}, {"limit", limit}, {"delta", delta}};
}

AttrMap range_attrs(double start, double limit, double delta, DType t) {
  AttrMap a = range_attrs(start, limit, delta);
  a["dtype"] = t;
  return a;
}

}  // namespace

TEST_CASE("creation: constant produces its tensor") {
  const std::vector<double> v{1.5, -2, 0.25, 8};
  const Tensor value = Tensor::from_f64(DType::kBF16, {2, 2}, v);
  const Tensor out = run1("constant", {{"value", value}});
  CHECK(out.identical(value));
  expect(out, DType::kBF16, {2, 2}, v);
  const std::vector<int64_t> nibbles{-8, 7, 3};
  const Tensor i4 = Tensor::from_i64(DType::kI4, {3}, nibbles);
  CHECK(run1("constant", {{"value", i4}}).identical(i4));
  expect(run1("constant", {{"value", Tensor::scalar_i64(DType::kBool, 1)}}), DType::kBool, {}, {1});

  const OpDef* def = OpRegistry::global().find("constant");
  REQUIRE(def != nullptr);
  CHECK(def->has(kTraitConstant));
  CHECK(def->max_inputs() == 0);
}

TEST_CASE("creation: constant errors") {
  CHECK(run_error("constant", {}) == "constant: missing required attribute 'value'");
  CHECK(run_error("constant", {{"value", 3}}) ==
        "constant: attribute 'value' must be tensor, got int");
}

TEST_CASE("creation: integer range") {
  expect(run1("range", range_attrs(0, 5, 1)), DType::kI64, {5}, {0, 1, 2, 3, 4});
  expect(run1("range", range_attrs(5, 0, -2)), DType::kI64, {3}, {5, 3, 1});
  expect(run1("range", range_attrs(-3, 3, 2, DType::kI8)), DType::kI8, {3}, {-3, -1, 1});
  expect(run1("range", range_attrs(0, 10, 3, DType::kU8)), DType::kU8, {4}, {0, 3, 6, 9});
  // Empty when the step points away from the limit.
  expect(run1("range", range_attrs(3, 1, 1)), DType::kI64, {0}, {});
  expect(run1("range", range_attrs(1, 1, 1, DType::kI32)), DType::kI32, {0}, {});
  // Exact beyond 2^53, where doubles could not count.
  const double base = 0x1p60;
  const Tensor big = run1("range", range_attrs(base, base + 1024, 512));
  REQUIRE(big.numel() == 2);
  CHECK(big.get_i64(1) == (int64_t{1} << 60) + 512);
}

TEST_CASE("creation: float range rounds each value once") {
  expect(run1("range", range_attrs(0, 1, 0.25, DType::kF32)), DType::kF32, {4},
         {0, 0.25, 0.5, 0.75});
  // ceil((1 - 0) / 0.3) = 4 values, computed as start + i * delta.
  expect(run1("range", range_attrs(0, 1, 0.3, DType::kF64)), DType::kF64, {4},
         {0, 0.3, 0.6, 0.8999999999999999}, 1e-15);
  // (0.3 - 0) / 0.1 is 2.9999999999999996 in double, so three values; f16 rounds 0.1 to
  // 0.0999755859375 and 0.2 to 0.199951171875.
  expect(run1("range", range_attrs(0, 0.3, 0.1, DType::kF16)), DType::kF16, {3},
         {0, 0.0999755859375, 0.199951171875});
  expect(run1("range", range_attrs(1, -1, -0.5, DType::kBF16)), DType::kBF16, {4},
         {1, 0.5, 0, -0.5});
}

TEST_CASE("creation: range errors") {
  CHECK(run_error("range", range_attrs(0, 5, 0)) == "range: attribute 'delta' must not be zero");
  CHECK(run_error("range", range_attrs(0.5, 5, 1, DType::kI32)) ==
        "range: attribute 'start' must be an integer for dtype i32, got 0.5");
  CHECK(run_error("range", range_attrs(0, 5, 1, DType::kBool)) ==
        "range: dtype must be float or integer, got bool");
  CHECK(run_error("range", range_attrs(0, 300, 1, DType::kU8)) ==
        "range: value 299 does not fit dtype u8");
  CHECK(
      run_error("range", range_attrs(0, std::numeric_limits<double>::infinity(), 1, DType::kF32)) ==
      "range: attribute 'limit' must be finite, got inf");
  CHECK(run_error("range", range_attrs(0, 1e300, 1e-300, DType::kF32)) ==
        "range: length inf is too large");
  CHECK(run_error("range", {{"start", 0}, {"limit", 3}}) ==
        "range: missing required attribute 'delta'");
}
