// The GPU tests' comparisons (tensor_compare.h) on the CPU: a result tensor as the reference
// gives it passes each, and the same result with a NaN, a wrong infinity or a finite value where
// an infinity belongs injected fails each, for every dtype the GPU tests compare.
#include "tensor_compare.h"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace kiln;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

Tensor result(DType t) {
  return Tensor::from_f64(t, {2, 3}, std::vector<double>{0.5, -1.25, 3.0, 0.0, 7.5, -2.0});
}

Tensor with(Tensor t, int64_t at, double value) {
  t.set_f64(at, value);
  return t;
}

/// The checks the GPU tests make, in the forms they call them (gpu_test, gemv, vectorize:
/// assert_close; attention, conv, autotune: their own tolerance; fp8: an SQNR floor; int4: a
/// relative L2 error).
std::vector<test::Verdict> every_check(const Tensor& want, const Tensor& got) {
  return {test::assert_close(want, got), test::allclose(want, got, {1.6e-2, 1e-2}),
          test::sqnr_at_least(want, got, 35), test::rel_l2_within(want, got, 1e-2)};
}

}  // namespace

TEST_CASE("the GPU tests' checks pass the reference's own result in every float dtype") {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kF64}) {
    CAPTURE(dtype_name(t));
    for (const test::Verdict& v : every_check(result(t), result(t))) CHECK_MESSAGE(v.ok(), v.why);
  }
}

TEST_CASE("a NaN injected into a result fails each GPU check") {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    CAPTURE(dtype_name(t));
    for (const test::Verdict& v : every_check(result(t), with(result(t), 4, kNaN))) {
      CAPTURE(v.why);
      CHECK_FALSE(v.ok());
      CHECK(v.why.find("element 4: got nan, expected 7.5") != std::string::npos);
    }
  }
}

TEST_CASE(
    "an unexpected infinity, or a finite value where an infinity belongs, fails each GPU check") {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    CAPTURE(dtype_name(t));
    for (const test::Verdict& v : every_check(result(t), with(result(t), 1, -kInf))) {
      CAPTURE(v.why);
      CHECK(v.why.find("element 1: got -inf, expected -1.25") != std::string::npos);
    }
    const Tensor inf = with(result(t), 2, kInf);
    for (const test::Verdict& v : every_check(inf, result(t))) {
      CAPTURE(v.why);
      CHECK(v.why.find("element 2: got 3, expected inf") != std::string::npos);
    }
    for (const test::Verdict& v : every_check(inf, with(result(t), 2, -kInf))) {
      CAPTURE(v.why);
      CHECK(v.why.find("element 2: got -inf, expected inf") != std::string::npos);
    }
    for (const test::Verdict& v : every_check(inf, inf)) CHECK_MESSAGE(v.ok(), v.why);
  }
}

TEST_CASE("assert_close uses PyTorch's defaults per dtype and is exact for integers") {
  CHECK(test::assert_close_tolerance(DType::kF32).rtol == 1.3e-6);
  CHECK(test::assert_close_tolerance(DType::kF32).atol == 1e-5);
  CHECK(test::assert_close_tolerance(DType::kF16).rtol == 1e-3);
  CHECK(test::assert_close_tolerance(DType::kBF16).rtol == 1.6e-2);
  CHECK(test::assert_close_tolerance(DType::kF64).atol == 1e-7);
  CHECK(test::assert_close_tolerance(DType::kI32).atol == 0);
  const Tensor i = Tensor::from_f64(DType::kI32, {3}, std::vector<double>{1, 2, 3});
  CHECK(test::assert_close(i, i).ok());
  CHECK(test::assert_close(i, with(i, 1, 3)).why ==
        "1 of 3 elements differ; first element 1: got 3, expected 2, |diff| 1 > atol 0 + rtol 0 * "
        "|expected|");
  // f32 just outside: 7.5 + 2e-5 is beyond 1e-5 + 1.3e-6 * 7.5.
  CHECK_FALSE(
      test::assert_close(result(DType::kF32), with(result(DType::kF32), 4, 7.5 + 2e-5)).ok());
}

TEST_CASE("a result of another type fails naming both types") {
  CHECK(test::assert_close(result(DType::kF32), result(DType::kF16)).why ==
        "type f16[2, 3], expected f32[2, 3]");
  CHECK_FALSE(test::sqnr_at_least(result(DType::kF32),
                                  Tensor::from_f64(DType::kF32, {6}, std::vector<double>(6)), 0)
                  .ok());
}
