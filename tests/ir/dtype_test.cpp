// DType names and exact narrow-float conversions; Tensor storage and element access.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "kiln/ir/dtype.h"
#include "kiln/ir/tensor.h"

using namespace kiln;

TEST_CASE("dtype names round-trip") {
  for (DType t : kAllDTypes) {
    auto parsed = parse_dtype(dtype_name(t));
    REQUIRE(parsed.has_value());
    CHECK(*parsed == t);
  }
  CHECK_FALSE(parse_dtype("f128").has_value());
  CHECK(dtype_storage_bytes(DType::kI4, 3) == 2);
  CHECK(dtype_storage_bytes(DType::kBF16, 3) == 6);
}

TEST_CASE("f16 conversions are exact and round to nearest even") {
  CHECK(f64_to_f16_bits(1.0) == 0x3C00);
  CHECK(f64_to_f16_bits(-2.0) == 0xC000);
  CHECK(f64_to_f16_bits(65504.0) == 0x7BFF);   // max finite
  CHECK(f64_to_f16_bits(65520.0) == 0x7C00);   // halfway above max rounds to inf
  CHECK(f64_to_f16_bits(std::ldexp(1.0, -24)) == 0x0001);  // smallest subnormal
  CHECK(f64_to_f16_bits(std::ldexp(1.0, -26)) == 0x0000);  // below half of it: zero
  // 1 + 2^-11 is halfway between 1 and 1+2^-10: ties to even (1.0).
  CHECK(f64_to_f16_bits(1.0 + std::ldexp(1.0, -11)) == 0x3C00);
  CHECK(f64_to_f16_bits(1.0 + 3 * std::ldexp(1.0, -11)) == 0x3C02);
  CHECK(f16_bits_to_f32(0x3555) == 0.333251953125f);
  CHECK(std::isnan(f16_bits_to_f32(f64_to_f16_bits(std::nan("")))));
  CHECK(f16_bits_to_f32(0x7C00) == std::numeric_limits<float>::infinity());
}

TEST_CASE("bf16 conversions") {
  CHECK(f64_to_bf16_bits(1.0) == 0x3F80);
  CHECK(f64_to_bf16_bits(-0.0) == 0x8000);
  CHECK(bf16_bits_to_f32(0x4049) == 3.140625f);
  CHECK(f64_to_bf16_bits(3.14159265) == 0x4049);
  // 1 + 2^-8 is a tie between 1.0 (even) and 1 + 2^-7.
  CHECK(f64_to_bf16_bits(1.0 + std::ldexp(1.0, -8)) == 0x3F80);
}

TEST_CASE("f8 e4m3fn: no infinities, saturates at 448") {
  CHECK(f8e4m3fn_bits_to_f32(0x7E) == 448.0f);
  CHECK(std::isnan(f8e4m3fn_bits_to_f32(0x7F)));
  CHECK(f64_to_f8e4m3fn_bits(448.0) == 0x7E);
  CHECK(f64_to_f8e4m3fn_bits(1000.0) == 0x7E);
  CHECK(f64_to_f8e4m3fn_bits(-1000.0) == 0xFE);
  CHECK(f64_to_f8e4m3fn_bits(1000.0, /*saturate=*/false) == 0x7F);
  CHECK(f64_to_f8e4m3fn_bits(1.0) == 0x38);
  CHECK(f8e4m3fn_bits_to_f32(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;  // NaN
    CHECK(f64_to_f8e4m3fn_bits(f8e4m3fn_bits_to_f32(static_cast<uint8_t>(b))) == b);
  }
}

TEST_CASE("f8 e5m2: IEEE-like with infinities") {
  CHECK(f8e5m2_bits_to_f32(0x7B) == 57344.0f);
  CHECK(f8e5m2_bits_to_f32(0x7C) == std::numeric_limits<float>::infinity());
  CHECK(f64_to_f8e5m2_bits(1e9) == 0x7B);
  CHECK(f64_to_f8e5m2_bits(1e9, false) == 0x7C);
  CHECK(f64_to_f8e5m2_bits(std::numeric_limits<double>::infinity()) == 0x7B);
  for (int b = 0; b < 256; ++b) {
    const float v = f8e5m2_bits_to_f32(static_cast<uint8_t>(b));
    if (std::isnan(v) || std::isinf(v)) continue;
    CHECK(f64_to_f8e5m2_bits(v) == b);
  }
}

TEST_CASE("tensor element access converts exactly") {
  Tensor t(DType::kBF16, {2, 2});
  t.set_f64(0, 1.5);
  t.set_f64(3, -2.25);
  CHECK(t.get_f64(0) == 1.5);
  CHECK(t.get_f64(3) == -2.25);
  CHECK(t.nbytes() == 8);

  Tensor i4(DType::kI4, {3});
  i4.set_i64(0, -8);
  i4.set_i64(1, 7);
  i4.set_i64(2, 9);  // wraps to -7
  CHECK(i4.get_i64(0) == -8);
  CHECK(i4.get_i64(1) == 7);
  CHECK(i4.get_i64(2) == -7);
  CHECK(i4.nbytes() == 2);
  CHECK(static_cast<uint8_t>(i4.data()[0]) == 0x78);  // element 0 in the low nibble

  Tensor i8(DType::kI8, {1});
  i8.set_i64(0, 200);
  CHECK(i8.get_i64(0) == -56);
  Tensor u8(DType::kU8, {1});
  u8.set_f64(0, std::nan(""));
  CHECK(u8.get_i64(0) == 0);
}

TEST_CASE("tensor copies share storage until written") {
  Tensor a = Tensor::from_f64(DType::kF32, {3}, std::vector<double>{1, 2, 3});
  Tensor b = a;
  b.set_f64(0, 9);
  CHECK(a.get_f64(0) == 1);
  CHECK(b.get_f64(0) == 9);
  CHECK_FALSE(a.identical(b));
  Tensor c = a.reshaped({3, 1});
  CHECK(c.shape() == std::vector<int64_t>{3, 1});
  CHECK(c.get_f64(2) == 3);
}

TEST_CASE("wrapped memory is never written in place") {
  static const float external[2] = {1.0f, 2.0f};
  Tensor t = Tensor::wrap(DType::kF32, {2}, reinterpret_cast<const std::byte*>(external), nullptr);
  t.set_f64(0, 5.0);
  CHECK(external[0] == 1.0f);
  CHECK(t.get_f64(0) == 5.0);
}
