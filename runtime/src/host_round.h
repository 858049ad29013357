// Rounding f32 to bf16/f16 on the host exactly as the step's cast kernels do (round to nearest
// even; overflow to inf; nan stays nan): the runtime refreshes a weight's low-precision copy
// from the bytes a host writes into the weight.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kiln/runtime.h"

namespace kiln::rt {

inline uint16_t round_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // a quiet nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline uint16_t round_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // nan
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up round to inf
  if (a < 0x38800000u) {                        // below 2^-14: a subnormal half, 2^-24 units
    float v;
    std::memcpy(&v, &a, 4);
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(v * 16777216.0f)));
  }
  uint32_t r = a - 0x38000000u;  // rebias the exponent (127 -> 15)
  r += 0x0fffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

/// `src` (`bytes` of f32 in dtype `from`) rounded to `to` into `out`; false when the pair is not
/// f32 to bf16 or f16 (a copy the runtime cannot refresh by itself).
inline bool round_f32_copy(kiln_dtype from, kiln_dtype to, const void* src, uint64_t bytes, std::vector<uint16_t>* out) {
  if (from != KILN_DTYPE_F32 || (to != KILN_DTYPE_BF16 && to != KILN_DTYPE_F16)) return false;
  const size_t n = static_cast<size_t>(bytes / 4);
  out->resize(n);
  const float* f = static_cast<const float*>(src);
  for (size_t i = 0; i < n; ++i) (*out)[i] = to == KILN_DTYPE_BF16 ? round_to_bf16(f[i]) : round_to_f16(f[i]);
  return true;
}

}  // namespace kiln::rt
