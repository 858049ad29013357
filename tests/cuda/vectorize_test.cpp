// Tests that memory-bound kernels take their vector paths (vectorize.cpp, pointwise(),
// indexed_pointwise): 16-byte loads and stores where the sizes and alignment allow, the scalar
// fallback where they do not, and NVRTC for every target.
#include <doctest/doctest.h>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"
#include "vectorize_graphs.h"

namespace kiln::cuda {
namespace {

bool has(const LoweredGraph& l, const std::string& what) { return l.source.find(what) != std::string::npos; }

std::string swiglu(const std::string& t, int rows, int cols) {
  const std::string ty = t + "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
  return "graph @g(%g: " + ty + ", %u: " + ty + ") -> (" + ty + ") {\n  %y = fused(%g, %u) : " + ty +
         " {\n    graph @fused(%a: " + ty + ", %b: " + ty + ") -> (" + ty + ") {\n      %s = silu(%a) : " + ty +
         "\n      %y = mul(%s, %b) : " + ty + "\n      return %y\n    }\n  }\n  return %y\n}\n";
}

TEST_CASE("a contiguous bf16 SwiGLU moves 8 elements per 16-byte load and store") {
  const LoweredGraph l = lower_text(swiglu("bf16", 64, 1024));
  CAPTURE(l.source);
  CHECK(has(l, "*reinterpret_cast<uint4*>(a0) = reinterpret_cast<const uint4*>(in0)[q];"));
  CHECK(has(l, "reinterpret_cast<uint4*>(out0)[q] = *reinterpret_cast<uint4*>(s0);"));
  CHECK(has(l, "for (int e = 0; e < 8; ++e)"));
  CHECK(has(l, "for (unsigned q = "));  // 32-bit indices
  CHECK(l.plan.find("grid=32,1,1") != std::string::npos);  // 65536 elements / 8 per thread / 256 per block
  compiles_everywhere(l);
}

TEST_CASE("f32 takes 4 elements per vector; an odd element count stays scalar") {
  CHECK(has(lower_text(swiglu("f32", 6, 10)), "for (int e = 0; e < 4; ++e)"));
  const LoweredGraph odd = lower_text(swiglu("bf16", 3, 5));
  CHECK_FALSE(has(odd, "uint4"));
  CHECK(has(odd, "out0[i] = "));
  compiles_everywhere(odd);
}

TEST_CASE("mixed dtypes size the vector by the widest; broadcast inputs are read per lane") {
  const LoweredGraph l = lower_text(kBiasScalarBroadcast);
  CAPTURE(l.source);
  // The bf16 -> f32 cast: 4 lanes, 8-byte loads and 16-byte stores.
  CHECK(has(l, "reinterpret_cast<const uint2*>(in0)[q]"));
  CHECK(has(l, "reinterpret_cast<uint4*>(out0)[q]"));
  // The bias row is read at the vector's first offset plus the lane, the scalar at 0.
  CHECK(has(l, "in1[o1 + e]"));
  CHECK(has(l, "in2[0]"));
  compiles_everywhere(l);
}

TEST_CASE("a view 8 bytes into its buffer is not 16-byte aligned: scalar kernel") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: bf16[20]) -> (bf16[16], bf16[16]) {
  %p, %q = split(%x) {axis = 0, sizes = [4, 16]} : bf16[4], bf16[16]
  %r = slice(%x) {axes = [0], starts = [0], ends = [16]} : bf16[16]
  %y = exp(%q) : bf16[16]
  %z = exp(%r) : bf16[16]
  return %y, %z
})");
  CAPTURE(l.source);
  // The split piece is a view (no copy) at element 4; the slice at 0 is copied with vectors.
  const size_t at = l.source.find("k1_exp("), end = l.source.find("k2_exp(");
  REQUIRE(end != std::string::npos);
  CHECK(l.source.substr(at, end - at).find("uint4") == std::string::npos);
  CHECK(l.source.substr(end).find("uint4") != std::string::npos);
  CHECK(has(l, "reinterpret_cast<uint4*>(y)[dst] = reinterpret_cast<const uint4*>(x)[src];"));
  compiles_everywhere(l);
}

TEST_CASE("a transpose keeping the innermost dim copies 16-byte rows; permuting it tiles through shared memory") {
  const LoweredGraph keep = lower_text(R"(
graph @g(%x: bf16[1, 64, 4, 32]) -> (bf16[1, 4, 64, 32]) {
  %y = transpose(%x) {perm = [0, 2, 1, 3]} : bf16[1, 4, 64, 32]
  return %y
})");
  CAPTURE(keep.source);
  CHECK(has(keep, "reinterpret_cast<uint4*>(y)[dst] = reinterpret_cast<const uint4*>(x)[src];"));
  CHECK_FALSE(has(keep, "tile["));
  compiles_everywhere(keep);

  const LoweredGraph swap = lower_text(R"(
graph @g(%x: f32[3, 40, 72]) -> (f32[3, 72, 40]) {
  %y = transpose(%x) {perm = [0, 2, 1]} : f32[3, 72, 40]
  return %y
})");
  CAPTURE(swap.source);
  CHECK(has(swap, "__shared__ unsigned tile[32][33];"));
  CHECK(swap.plan.find("grid=18,1,1 block=256,1,1") != std::string::npos);  // 3 * ceil(40/32) * ceil(72/32) tiles
  compiles_everywhere(swap);

  // A row of 6 bf16 cannot be split into 16- or 8-byte pieces at every offset: 4-byte pieces.
  const LoweredGraph odd = lower_text(R"(
graph @g(%x: bf16[5, 7, 6]) -> (bf16[7, 5, 6]) {
  %y = transpose(%x) {perm = [1, 0, 2]} : bf16[7, 5, 6]
  return %y
})");
  CHECK(has(odd, "reinterpret_cast<unsigned*>(y)[dst]"));
  compiles_everywhere(odd);
}

std::string f8_transpose(const std::string& in, const std::string& out, const std::string& perm = "") {
  return "graph @g(%x: f8e4m3fn" + in + ") -> (f8e4m3fn" + out + ") {\n  %y = transpose(%x)" + perm +
         " : f8e4m3fn" + out + "\n  return %y\n}\n";
}

TEST_CASE("an f8 transpose moves 16 bytes a thread through a 128x128 tile; unaligned shapes take the byte tile") {
  // Whole tiles: no bounds checks; 16-byte loads and stores, 4x4 byte transposes in registers.
  const LoweredGraph whole = lower_text(f8_transpose("[256, 384]", "[384, 256]"));
  CAPTURE(whole.source);
  CHECK(has(whole, "__shared__ uint4 tile[128][8];"));
  CHECK(has(whole, "v = *reinterpret_cast<const uint4*>(x + src + p0 + 16 * c + (l0 + 4 * q + i) * 384LL);"));
  CHECK(has(whole, "__byte_perm(w[0][m], w[1][m], 0x5140u)"));
  CHECK(has(whole, "words[(16u * c + 4u * m + j) * 32u + 4u * ((q >> 2) ^ c) + (q & 3u)] = col[j];"));
  CHECK(has(whole, "*reinterpret_cast<uint4*>(y + dst + (p0 + pr) * 256LL + l0 + 16 * c) = tile[pr][c ^ (pr >> 4)];"));
  CHECK_FALSE(has(whole, "if (l0"));
  CHECK_FALSE(has(whole, "if (p0"));
  CHECK(whole.plan.find("grid=6,1,1 block=256,1,1") != std::string::npos);  // (256/128) * (384/128) tiles
  compiles_everywhere(whole);

  // Batched (the last two dims of a 3-D tensor), 192 = 1.5 tiles along the input's rows' dim:
  // chunks past it are skipped.
  const LoweredGraph batched = lower_text(f8_transpose("[2, 128, 192]", "[2, 192, 128]", " {perm = [0, 2, 1]}"));
  CAPTURE(batched.source);
  CHECK(has(batched, "if (p0 + 16 * c < 192LL) v = "));
  CHECK(has(batched, "if (p0 + pr < 192LL) *reinterpret_cast<uint4*>"));
  CHECK(has(batched, "src += c_ * 24576LL; dst += c_ * 24576LL;"));
  CHECK(batched.plan.find("grid=4,1,1 block=256,1,1") != std::string::npos);  // 2 * 1 * 2 tiles
  compiles_everywhere(batched);

  // Multiples of 16 but not of 128 along both dims.
  const LoweredGraph partial = lower_text(f8_transpose("[48, 80]", "[80, 48]"));
  CAPTURE(partial.source);
  CHECK(has(partial, "if (l0 + 4 * q < 48LL && p0 + 16 * c < 80LL) v = "));
  CHECK(has(partial, "if (p0 + pr < 80LL && l0 + 16 * c < 48LL) *reinterpret_cast<uint4*>"));
  compiles_everywhere(partial);

  // 72 is not a multiple of 16: the 32x32 tile of single bytes.
  const LoweredGraph bytes = lower_text(f8_transpose("[40, 72]", "[72, 40]"));
  CHECK(has(bytes, "__shared__ unsigned char tile[32][33];"));
  CHECK_FALSE(has(bytes, "uint4"));
  CHECK(bytes.plan.find("grid=6,1,1 block=256,1,1") != std::string::npos);  // ceil(40/32) * ceil(72/32) tiles
  compiles_everywhere(bytes);
}

// RoPE as fuse-pointwise groups it (see pointwise_index_test.cpp), at head dim `d`.
std::string rope(int d) {
  const std::string h = std::to_string(d / 2), D = std::to_string(d), W = std::to_string(4 * d);
  return "graph @g(%q: bf16[2, 8, " + W + "], %cos: bf16[1, 1, 8, " + D + "], %sin: bf16[1, 1, 8, " + D +
         "]) -> (bf16[2, 4, 8, " + D + "]) {\n  %y = fused(%q, %cos, %sin) : bf16[2, 4, 8, " + D +
         "] {\n    graph @fused(%x: bf16[2, 8, " + W + "], %c: bf16[1, 1, 8, " + D + "], %s: bf16[1, 1, 8, " + D +
         "]) -> (bf16[2, 4, 8, " + D + "]) {\n"
         "      %v = reshape(%x) {shape = [2, 8, 4, " + D + "]} : bf16[2, 8, 4, " + D + "]\n"
         "      %t = transpose(%v) {perm = [0, 2, 1, 3]} : bf16[2, 4, 8, " + D + "]\n"
         "      %lo = slice(%t) {axes = [3], starts = [0], ends = [" + h + "]} : bf16[2, 4, 8, " + h + "]\n"
         "      %hi = slice(%t) {axes = [3], starts = [" + h + "], ends = [" + D + "]} : bf16[2, 4, 8, " + h + "]\n"
         "      %n = neg(%hi) : bf16[2, 4, 8, " + h + "]\n"
         "      %rot = concat(%n, %lo) {axis = -1} : bf16[2, 4, 8, " + D + "]\n"
         "      %a = mul(%t, %c) : bf16[2, 4, 8, " + D + "]\n"
         "      %b = mul(%rot, %s) : bf16[2, 4, 8, " + D + "]\n"
         "      %y = add(%a, %b) : bf16[2, 4, 8, " + D + "]\n"
         "      return %y\n    }\n  }\n  return %y\n}\n";
}

TEST_CASE("an indexed RoPE group loads and stores 8 consecutive bf16 per thread") {
  const LoweredGraph l = lower_text(rope(32));
  CAPTURE(l.source);
  CHECK(has(l, "*reinterpret_cast<const uint4*>(&in0["));
  CHECK(has(l, "*reinterpret_cast<const uint4*>(&in1["));
  CHECK(has(l, "*reinterpret_cast<uint4*>(&out0[i])"));
  CHECK(has(l, "for (unsigned q = "));
  compiles_everywhere(l);
}

TEST_CASE("an indexed group whose halves are not a multiple of the width keeps one element per thread") {
  // Head dim 12: the rows are 8-aligned nowhere; 4 lanes would split at the concat (6).
  const LoweredGraph l = lower_text(rope(12));
  CAPTURE(l.source);
  CHECK_FALSE(has(l, "reinterpret_cast"));
  CHECK(has(l, "out0[i] = "));
  compiles_everywhere(l);
}

TEST_CASE("an indexed group whose transpose moves the lanes off the innermost input dim reads them strided") {
  const LoweredGraph l = lower_text(kStridedTransposeGroup);
  CAPTURE(l.source);
  CHECK(has(l, "v0[e] = in0[c1 * 8u + c0 + e * 8u];"));
  CHECK(has(l, "*reinterpret_cast<const uint4*>(&in1["));
  compiles_everywhere(l);
}

}  // namespace
}  // namespace kiln::cuda
