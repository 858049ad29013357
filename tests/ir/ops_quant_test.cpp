// Tests of the FP8 ops (quantize, dequantize, scaled_matmul, amax) against hand-computed values.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "op_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

Tensor scale(double s) { return Tensor::scalar_f64(DType::kF32, s); }

Tensor f8(DType t, std::vector<int64_t> shape, std::vector<double> v) {
  return Tensor::from_f64(t, std::move(shape), v);
}

}  // namespace

TEST_CASE("quant: quantize divides by the scale, rounds to nearest even and saturates") {
  const double inf = std::numeric_limits<double>::infinity();
  Tensor q = run1("quantize", {f32({8}, {1.0, 2.25, 1.0625, 1.1875, 1000, -1000, inf, -0.0}), scale(0.5)});
  CHECK(q.dtype() == DType::kF8E4M3FN);
  // Steps are 0.25 in [2, 4): 2.125 ties between 2.0 (even) and 2.25 -> 2.0; 2.375 ties between
  // 2.25 and 2.5 (even) -> 2.5; overflow and inf saturate to 448.
  check_values(q, {8}, {2, 4.5, 2, 2.5, 448, -448, 448, 0});
  CHECK(q.data_as<uint8_t>()[7] == 0x80);  // negative zero keeps its sign
  Tensor nan = run1("quantize", {f32({1}, {std::nan("")}), scale(1)});
  CHECK(std::isnan(nan.get_f64(0)));
  CHECK(nan.data_as<uint8_t>()[0] == 0x7f);

  Tensor e5 = run1("quantize", {f32({3}, {1e6, -inf, 3.5}), scale(1)}, {{"dtype", DType::kF8E5M2}});
  CHECK(e5.dtype() == DType::kF8E5M2);
  check_values(e5, {3}, {57344, -57344, 3.5});
}

TEST_CASE("quant: quantize divides in f32, as the GPU kernels and PyTorch do") {
  // 0.5 / 0.01f is 50.0000011 in f64 (rounds up to 52 in e4m3's steps of 4 on [32, 64)) but
  // exactly 50 in f32, a tie that rounds to the even 48. Scale 0.01 makes such ties common.
  check_values(run1("quantize", {f32({2}, {0.5, -0.5}), scale(0.01)}), {2}, {48, -48});
}

TEST_CASE("quant: dequantize multiplies by the scale into f32, bf16 or f16") {
  Tensor q = f8(DType::kF8E4M3FN, {3}, {448, -0.5, 0.015625});
  check_values(run1("dequantize", {q, scale(0.25)}), {3}, {112, -0.125, 0.00390625});
  Tensor bf = run1("dequantize", {q, scale(3)}, {{"dtype", DType::kBF16}});
  CHECK(bf.dtype() == DType::kBF16);
  check_values(bf, {3}, {1344, -1.5, 0.046875});
  Tensor round_trip = run1("dequantize", {run1("quantize", {f32({2}, {0.3, -7}), scale(0.02)}), scale(0.02)});
  check_values(round_trip, {2}, {0.3, -7}, 0.07);  // e4m3 keeps 3 mantissa bits: within 2^-4
}

TEST_CASE("quant: scaled_matmul is (a * sa) @ (b * sb)^T + bias") {
  Tensor a = f8(DType::kF8E4M3FN, {2, 2}, {1, 2, 3, 4});
  Tensor b = f8(DType::kF8E4M3FN, {3, 2}, {1, 0, 0, 1, 1, 1});
  check_values(run1("scaled_matmul", {a, b, scale(2), scale(0.5)}), {2, 3}, {1, 2, 3, 3, 4, 7});
  Tensor bias = f32({3}, {10, 20, 30});
  check_values(run1("scaled_matmul", {a, b, scale(2), scale(0.5), bias}), {2, 3}, {11, 22, 33, 13, 24, 37});
  // Leading dims of a are kept; an e5m2 operand mixes with e4m3.
  Tensor a3 = f8(DType::kF8E5M2, {1, 2, 2}, {1, 2, 3, 4});
  Tensor y = run1("scaled_matmul", {a3, b, scale(1), scale(1)}, {{"dtype", DType::kBF16}});
  CHECK(y.dtype() == DType::kBF16);
  check_values(y, {1, 2, 3}, {1, 2, 3, 3, 4, 7});
}

TEST_CASE("quant: amax is the largest magnitude, nan when any element is nan") {
  check_values(run1("amax", {f32({4}, {1, -7.5, 3, 0})}), {}, {7.5});
  CHECK(std::isnan(run1("amax", {f32({3}, {1, std::nan(""), 2})}).get_f64(0)));
}

TEST_CASE("quant: ill-typed operands are refused naming the operand") {
  Tensor a = f8(DType::kF8E4M3FN, {2, 2}, {1, 2, 3, 4});
  CHECK(error_of(run_op("quantize", {f32({2}, {1, 2}), f32({2}, {1, 1})}))
            .find("operand 'scale' must be a per-tensor scale f32[] or f32[1], got f32[2]") != std::string::npos);
  CHECK(error_of(run_op("quantize", {f32({1}, {1}), scale(1)}, {{"dtype", DType::kBF16}}))
            .find("attribute 'dtype' must be one of f8e4m3fn, f8e5m2, got bf16") != std::string::npos);
  CHECK(error_of(run_op("dequantize", {f32({1}, {1}), scale(1)}))
            .find("operand 'q' must be f8e4m3fn or f8e5m2, got f32[1]") != std::string::npos);
  CHECK(error_of(run_op("scaled_matmul", {a, f8(DType::kF8E4M3FN, {2, 3}, {1, 2, 3, 4, 5, 6}), scale(1), scale(1)}))
            .find("contraction dims differ") != std::string::npos);
  CHECK(error_of(run_op("scaled_matmul", {a, a, scale(1), scale(1), f32({3}, {1, 2, 3})}))
            .find("operand 'bias' must be f32[2], got f32[3]") != std::string::npos);
  CHECK(error_of(run_op("scaled_matmul", {a, a, scale(1), scale(1)}, {{"fallback", "int8"}}))
            .find("attribute 'fallback' must be none or bf16, got 'int8'") != std::string::npos);
  CHECK(error_of(run_op("scaled_matmul", {a, a, scale(1), scale(1)}, {{"fast_accumulation", int64_t{2}}}))
            .find("attribute 'fast_accumulation' must be 0 or 1, got 2") != std::string::npos);
}
