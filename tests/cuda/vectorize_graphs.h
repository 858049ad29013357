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

}  // namespace kiln
