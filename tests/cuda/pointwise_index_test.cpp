// Tests of fused pointwise groups holding data-movement ops (pointwise_index.cpp): one launch
// per group, index arithmetic instead of copies, the fallback, and NVRTC for every target.
#include <doctest/doctest.h>

#include <sstream>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

size_t launches(const LoweredGraph& l) {
  size_t n = 0;
  std::istringstream in(l.plan);
  for (std::string line; std::getline(in, line);) n += line.rfind("step launch", 0) == 0;
  return n;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Llama RoPE as fuse-pointwise groups it: q = linear(h) viewed as [b, s, h, d], transposed to
// [b, h, s, d], rotated half with a neg and a concat, times cos and sin.
const char* kRope = R"(
graph @g(%q: bf16[2, 8, 64], %cos: bf16[1, 1, 8, 16], %sin: bf16[1, 1, 8, 16]) -> (bf16[2, 4, 8, 16]) {
  %y = fused(%q, %cos, %sin) : bf16[2, 4, 8, 16] {
    graph @fused(%x: bf16[2, 8, 64], %c: bf16[1, 1, 8, 16], %s: bf16[1, 1, 8, 16]) -> (bf16[2, 4, 8, 16]) {
      %v = reshape(%x) {shape = [2, 8, 4, 16]} : bf16[2, 8, 4, 16]
      %t = transpose(%v) {perm = [0, 2, 1, 3]} : bf16[2, 4, 8, 16]
      %lo = slice(%t) {axes = [3], starts = [0], ends = [8]} : bf16[2, 4, 8, 8]
      %hi = slice(%t) {axes = [3], starts = [8], ends = [9223372036854775807]} : bf16[2, 4, 8, 8]
      %n = neg(%hi) : bf16[2, 4, 8, 8]
      %rot = concat(%n, %lo) {axis = -1} : bf16[2, 4, 8, 16]
      %a = mul(%t, %c) : bf16[2, 4, 8, 16]
      %b = mul(%rot, %s) : bf16[2, 4, 8, 16]
      %y = add(%a, %b) : bf16[2, 4, 8, 16]
      return %y
    }
  }
  return %y
})";

TEST_CASE("a fused RoPE (view, transpose, slices, neg, concat, mul/add) is exactly one launch") {
  const LoweredGraph l = lower_text(kRope);
  CHECK(launches(l) == 1);
  REQUIRE(l.kernels.size() == 1);
  CHECK(l.kernels[0] == "k0_fused");
  // q is read once at the output index (for q * cos) and once in each concat branch.
  const std::string kernel = l.source.substr(l.source.find("k0_fused"));
  CHECK(count(kernel, "in0[") == 3);
  CHECK(count(kernel, "if (") == 1);
  // Index math fits in 32 bits: unsigned coordinates, no 64-bit division.
  CHECK(l.source.find("const unsigned c3 = r_ % 16u;") != std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("transpose+add, a concat of computed values, slice steps, expand and reshape in one kernel") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[3, 4], %y: f32[4, 3], %z: f32[4, 6], %b: f32[4, 1], %r: f32[12]) -> (f32[4, 3], f32[4, 3]) {
  %o1, %o2 = fused(%x, %y, %z, %b, %r) : f32[4, 3], f32[4, 3] {
    graph @fused(%x: f32[3, 4], %y: f32[4, 3], %z: f32[4, 6], %b: f32[4, 1], %r: f32[12]) -> (f32[4, 3], f32[4, 3]) {
      %t = transpose(%x) : f32[4, 3]
      %s = add(%t, %y) : f32[4, 3]
      %e = exp(%y) : f32[4, 3]
      %two = constant() {value = dense<f32[]>[2]} : f32[]
      %m = mul(%t, %two) : f32[4, 3]
      %c = concat(%e, %m) {axis = 1} : f32[4, 6]
      %st = slice(%c) {axes = [1], starts = [5], ends = [-7], steps = [-2]} : f32[4, 3]
      %zs = slice(%z) {axes = [1], starts = [0], ends = [6], steps = [2]} : f32[4, 3]
      %x2 = expand(%b) {shape = [4, 3]} : f32[4, 3]
      %rr = reshape(%r) {shape = [4, 3]} : f32[4, 3]
      %u = add(%st, %zs) : f32[4, 3]
      %w = mul(%x2, %rr) : f32[4, 3]
      %o1 = add(%u, %w) : f32[4, 3]
      %o2 = sub(%s, %o1) : f32[4, 3]
      return %o1, %o2
    }
  }
  return %o1, %o2
})");
  CHECK(launches(l) == 1);
  CHECK(count(l.source, "__global__") == 1);
  // The step -2 slice walks its input backwards.
  CHECK(l.source.find("(5u - c1 * 2u)") != std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("a movement group whose outputs differ in shape falls back to node-by-node kernels") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[2, 3]) -> (f32[3, 2], f32[2, 3]) {
  %t, %e = fused(%x) : f32[3, 2], f32[2, 3] {
    graph @fused(%a: f32[2, 3]) -> (f32[3, 2], f32[2, 3]) {
      %e = exp(%a) : f32[2, 3]
      %t = transpose(%e) : f32[3, 2]
      return %t, %e
    }
  }
  return %t, %e
})");
  CHECK(launches(l) == 2);
  CHECK(l.kernels[0] == "k0_exp");
  CHECK(l.kernels[1] == "k1_transpose");
}

}  // namespace
}  // namespace kiln::cuda
