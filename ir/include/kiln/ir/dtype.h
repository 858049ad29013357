// Element types and exact conversions between their storage and f64.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kiln {

enum class DType : uint8_t {
  kF64, kF32, kF16, kBF16, kF8E4M3FN, kF8E5M2,
  kI64, kI32, kI16, kI8, kU8, kI4, kBool,
};

/// Every dtype, in declaration order (for tests and tables).
inline constexpr DType kAllDTypes[] = {
    DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3FN, DType::kF8E5M2,
    DType::kI64, DType::kI32, DType::kI16, DType::kI8,   DType::kU8,       DType::kI4,
    DType::kBool};

/// Text name as written in .kir: "f32", "bf16", "f8e4m3fn", "i4", "bool", ...
std::string_view dtype_name(DType t);
std::optional<DType> parse_dtype(std::string_view name);

/// Storage size in bits per element (i4: 4, bool: 8).
int dtype_bits(DType t);
/// Bytes needed to store `numel` elements (i4 packs two per byte, rounding up).
int64_t dtype_storage_bytes(DType t, int64_t numel);

bool is_float(DType t);     ///< f64 f32 f16 bf16 f8*
bool is_integer(DType t);   ///< i64 i32 i16 i8 u8 i4 (not bool)
bool is_signed(DType t);

/// Exact conversions between narrow floats and f32/f64. Narrowing rounds to nearest even.
float f16_bits_to_f32(uint16_t bits);
uint16_t f64_to_f16_bits(double v);
float bf16_bits_to_f32(uint16_t bits);
uint16_t f64_to_bf16_bits(double v);
/// E4M3FN (no infinities, NaN = S.1111.111, max 448). Out-of-range values saturate to ±448
/// when `saturate`, else become NaN (ONNX Cast semantics); NaN stays NaN.
float f8e4m3fn_bits_to_f32(uint8_t bits);
uint8_t f64_to_f8e4m3fn_bits(double v, bool saturate = true);
/// E5M2 (IEEE-like, has ±inf, max 57344). When `saturate`, out-of-range values and ±inf
/// become ±57344; otherwise they become ±inf (ONNX Cast semantics).
float f8e5m2_bits_to_f32(uint8_t bits);
uint8_t f64_to_f8e5m2_bits(double v, bool saturate = true);
/// The largest finite value of an f8 format: 448 (f8e4m3fn), 57344 (f8e5m2, and any other).
double f8_max_finite(DType t);

}  // namespace kiln
