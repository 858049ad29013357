// Helpers shared by the op tests: build a one-node graph, run it, compare with expected values.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"

namespace kiln::test {

inline Tensor f32(std::vector<int64_t> shape, std::vector<double> v) {
  return Tensor::from_f64(DType::kF32, std::move(shape), v);
}

/// Builds a graph holding one `op` node over `inputs`, takes the result types from the
/// shape rule, verifies it and runs it through the interpreter.
inline StatusOr<std::vector<Tensor>> run_op(const std::string& op, const std::vector<Tensor>& inputs,
                                     AttrMap attrs = {}, int num_results = 1) {
  Graph g;
  std::vector<Value*> operands;
  std::vector<TensorType> types;
  for (const Tensor& t : inputs) {
    operands.push_back(g.add_input("in" + std::to_string(operands.size()), t.type()));
    types.push_back(t.type());
  }
  KILN_ASSIGN_OR_RETURN(
      Node * n,
      g.create_node(op, operands, std::vector<TensorType>(static_cast<size_t>(num_results)),
                    std::move(attrs)));
  KILN_ASSIGN_OR_RETURN(auto result_types, infer_node_types(*n, types));
  for (int i = 0; i < num_results; ++i)
    n->result(i)->set_type(result_types[static_cast<size_t>(i)]);
  g.set_outputs(n->results());
  KILN_RETURN_IF_ERROR(verify(g));
  return Interpreter().run(g, inputs);
}

/// The shape rule's answer for one `op` node over operands of `types`.
inline StatusOr<std::vector<TensorType>> infer_op(const std::string& op, std::vector<TensorType> types,
                                           AttrMap attrs = {}, int num_results = 1) {
  Graph g;
  std::vector<Value*> operands;
  for (const TensorType& t : types)
    operands.push_back(g.add_input("in" + std::to_string(operands.size()), t));
  KILN_ASSIGN_OR_RETURN(
      Node * n,
      g.create_node(op, operands, std::vector<TensorType>(static_cast<size_t>(num_results)),
                    std::move(attrs)));
  return infer_node_types(*n, std::move(types));
}

/// Runs a one-result op and returns the result, failing the test on error.
inline Tensor run1(const std::string& op, const std::vector<Tensor>& inputs, AttrMap attrs = {}) {
  StatusOr<std::vector<Tensor>> r = run_op(op, inputs, std::move(attrs));
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  REQUIRE(r->size() == 1);
  return (*r)[0];
}

inline void check_values(const Tensor& t, const std::vector<int64_t>& shape,
                  const std::vector<double>& want, double tolerance = 1e-6) {
  REQUIRE(t.shape() == shape);
  const std::vector<double> got = t.to_f64();
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i)
    CHECK_MESSAGE(got[i] == doctest::Approx(want[i]).epsilon(tolerance), "at " << i);
}

template <typename T>
inline std::string error_of(const StatusOr<T>& r) {
  REQUIRE_FALSE(r.ok());
  return r.status().message();
}

inline Tensor tf(DType t, std::vector<int64_t> shape, std::vector<double> v) {
  return Tensor::from_f64(t, std::move(shape), v);
}
inline Tensor ti(DType t, std::vector<int64_t> shape, std::vector<int64_t> v) {
  return Tensor::from_i64(t, std::move(shape), v);
}

/// Checks dtype, shape and values; `eps` 0 means exact (nan matches nan).
inline void expect(const Tensor& t, DType dtype, std::vector<int64_t> shape, std::vector<double> want,
            double eps = 0) {
  CHECK(std::string(dtype_name(t.dtype())) == std::string(dtype_name(dtype)));
  CHECK(shape_str(shape_of(t.shape())) == shape_str(shape_of(shape)));
  const std::vector<double> got = t.to_f64();
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": got " << got[i] << ", want " << want[i]);
    if (std::isnan(want[i]))
      CHECK(std::isnan(got[i]));
    else if (eps == 0 || std::isinf(want[i]))
      CHECK((got[i] == want[i] && std::signbit(got[i]) == std::signbit(want[i])));
    else
      CHECK(got[i] == doctest::Approx(want[i]).epsilon(eps));
  }
}

}  // namespace kiln::test
