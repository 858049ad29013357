// Graphs both vectorize tests use: the lowering test checks the kernel's vector accesses, the
// GPU test checks its results against the reference.
#pragma once

namespace kiln {

/// A bf16 -> f32 cast feeding a fused add of a bias row and a multiply by a scalar: the vector
/// path with per-lane broadcast reads.
inline constexpr const char* kBiasScalarBroadcast = R"(
graph @g(%x: bf16[16, 64], %b: bf16[64], %s: f32[]) -> (f32[16, 64]) {
  %c = cast(%x) {to = f32} : f32[16, 64]
  %bb = cast(%b) {to = f32} : f32[64]
  %y = fused(%c, %bb, %s) : f32[16, 64] {
    graph @fused(%p: f32[16, 64], %q: f32[64], %r: f32[]) -> (f32[16, 64]) {
      %a = add(%p, %q) : f32[16, 64]
      %y = mul(%a, %r) : f32[16, 64]
      return %y
    }
  }
  return %y
})";

/// An indexed group whose transpose moves the vector lanes off the innermost input dim: the
/// transposed input is read strided, the other with 16-byte loads.
inline constexpr const char* kStridedTransposeGroup = R"(
graph @g(%x: f32[16, 8], %y: f32[8, 16]) -> (f32[8, 16]) {
  %z = fused(%x, %y) : f32[8, 16] {
    graph @fused(%a: f32[16, 8], %b: f32[8, 16]) -> (f32[8, 16]) {
      %t = transpose(%a) : f32[8, 16]
      %z = add(%t, %b) : f32[8, 16]
      return %z
    }
  }
  return %z
})";

}  // namespace kiln
