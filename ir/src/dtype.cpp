// DType names, sizes and exact conversions for the narrow float formats.
#include "kiln/ir/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace kiln {
namespace {

struct DTypeInfo {
  DType type;
  const char* name;
  int bits;
  bool is_float;
  bool is_integer;
  bool is_signed;
};

constexpr DTypeInfo kInfo[] = {
    {DType::kF64, "f64", 64, true, false, true},
    {DType::kF32, "f32", 32, true, false, true},
    {DType::kF16, "f16", 16, true, false, true},
    {DType::kBF16, "bf16", 16, true, false, true},
    {DType::kF8E4M3FN, "f8e4m3fn", 8, true, false, true},
    {DType::kF8E5M2, "f8e5m2", 8, true, false, true},
    {DType::kI64, "i64", 64, false, true, true},
    {DType::kI32, "i32", 32, false, true, true},
    {DType::kI16, "i16", 16, false, true, true},
    {DType::kI8, "i8", 8, false, true, true},
    {DType::kU8, "u8", 8, false, true, false},
    {DType::kI4, "i4", 4, false, true, true},
    {DType::kBool, "bool", 8, false, false, false},
};

const DTypeInfo& info(DType t) { return kInfo[static_cast<size_t>(t)]; }

/// A binary floating-point format with `ebits` exponent and `mbits` mantissa bits.
/// `ieee`: all-ones exponent means inf/NaN. Otherwise (the "FN" formats) only the all-ones
/// pattern is NaN and there are no infinities.
struct FloatFormat {
  int ebits;
  int mbits;
  bool ieee;

  int bias() const { return (1 << (ebits - 1)) - 1; }
  double max_finite() const {
    if (ieee) return std::ldexp(2.0 - std::ldexp(1.0, -mbits), bias());
    // FN: top exponent is usable, but its all-ones mantissa is NaN.
    return std::ldexp(2.0 - std::ldexp(1.0, 1 - mbits), (1 << ebits) - 1 - bias());
  }
  uint32_t nan_bits() const {
    return ieee ? ((((1u << ebits) - 1) << mbits) | (1u << (mbits - 1)))
                : ((1u << (ebits + mbits)) - 1);
  }
  uint32_t inf_bits() const { return ((1u << ebits) - 1) << mbits; }
};

constexpr FloatFormat kF16{5, 10, true};
constexpr FloatFormat kBF16{8, 7, true};
constexpr FloatFormat kE4M3FN{4, 3, false};
constexpr FloatFormat kE5M2{5, 2, true};

double decode(uint32_t bits, const FloatFormat& f) {
  const uint32_t sign = (bits >> (f.ebits + f.mbits)) & 1u;
  const uint32_t exp = (bits >> f.mbits) & ((1u << f.ebits) - 1);
  const uint32_t mant = bits & ((1u << f.mbits) - 1);
  const uint32_t exp_max = (1u << f.ebits) - 1;
  double v;
  if (f.ieee && exp == exp_max) {
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (!f.ieee && exp == exp_max && mant == (1u << f.mbits) - 1) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), 1 - f.bias() - f.mbits);
  } else {
    v = std::ldexp(static_cast<double>(mant + (1u << f.mbits)),
                   static_cast<int>(exp) - f.bias() - f.mbits);
  }
  return sign ? -v : v;
}

/// Rounds to nearest even. Overflow: `saturate` gives ±max, else ±inf (IEEE) or NaN (FN).
uint32_t encode(double v, const FloatFormat& f, bool saturate) {
  const uint32_t sign_bit = 1u << (f.ebits + f.mbits);
  if (std::isnan(v)) return f.nan_bits();
  const uint32_t sign = std::signbit(v) ? sign_bit : 0u;
  double a = std::fabs(v);
  const double max = f.max_finite();
  auto overflow = [&]() -> uint32_t {
    if (saturate) return sign | encode(max, f, false);
    return f.ieee ? (sign | f.inf_bits()) : f.nan_bits();
  };
  if (std::isinf(a)) return overflow();
  if (a == 0) return sign;
  int ex;
  std::frexp(a, &ex);  // a = m * 2^ex, m in [0.5, 1)
  const int min_normal_exp = 1 - f.bias();
  const int e = std::max(ex - 1, min_normal_exp);
  const double quantum = std::ldexp(1.0, e - f.mbits);
  const double r = std::nearbyint(a / quantum);  // default rounding mode: nearest even
  a = r * quantum;
  if (a > max) return overflow();
  if (a == 0) return sign;
  std::frexp(a, &ex);
  uint32_t exp_field, mant;
  if (ex - 1 < min_normal_exp) {
    exp_field = 0;
    mant = static_cast<uint32_t>(std::ldexp(a, f.bias() - 1 + f.mbits));
  } else {
    exp_field = static_cast<uint32_t>(ex - 1 + f.bias());
    mant = static_cast<uint32_t>(std::ldexp(a, f.mbits - (ex - 1))) - (1u << f.mbits);
  }
  return sign | (exp_field << f.mbits) | mant;
}

}  // namespace

std::string_view dtype_name(DType t) { return info(t).name; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& i : kInfo)
    if (name == i.name) return i.type;
  return std::nullopt;
}

int dtype_bits(DType t) { return info(t).bits; }

int64_t dtype_storage_bytes(DType t, int64_t numel) {
  if (t == DType::kI4) return (numel + 1) / 2;
  return numel * (info(t).bits / 8);
}

bool is_float(DType t) { return info(t).is_float; }
bool is_integer(DType t) { return info(t).is_integer; }
bool is_signed(DType t) { return info(t).is_signed; }

float f16_bits_to_f32(uint16_t bits) { return static_cast<float>(decode(bits, kF16)); }
uint16_t f64_to_f16_bits(double v) { return static_cast<uint16_t>(encode(v, kF16, false)); }
float bf16_bits_to_f32(uint16_t bits) { return static_cast<float>(decode(bits, kBF16)); }
uint16_t f64_to_bf16_bits(double v) { return static_cast<uint16_t>(encode(v, kBF16, false)); }
float f8e4m3fn_bits_to_f32(uint8_t bits) { return static_cast<float>(decode(bits, kE4M3FN)); }
uint8_t f64_to_f8e4m3fn_bits(double v, bool saturate) {
  return static_cast<uint8_t>(encode(v, kE4M3FN, saturate));
}
float f8e5m2_bits_to_f32(uint8_t bits) { return static_cast<float>(decode(bits, kE5M2)); }
double f8_max_finite(DType t) { return t == DType::kF8E4M3FN ? kE4M3FN.max_finite() : kE5M2.max_finite(); }
uint8_t f64_to_f8e5m2_bits(double v, bool saturate) {
  return static_cast<uint8_t>(encode(v, kE5M2, saturate));
}

}  // namespace kiln
