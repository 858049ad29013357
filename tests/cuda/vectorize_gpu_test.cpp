// GPU check of the vectorized memory-bound kernels (vectorize.cpp, pointwise(),
// indexed_pointwise) against the reference interpreter: f32/f16/bf16, element counts that are
// and are not multiples of the vector width, broadcast inputs, an unaligned view, transposes
// keeping and permuting the innermost dim (f8 ones too, at the Llama block's sizes), and RoPE-like
// indexed groups. Exits 77 without a GPU.
#include <cstdio>
#include <string>

#include "gpu_test_util.h"
#include "vectorize_graphs.h"

namespace {

using namespace kiln;

std::string swiglu(const std::string& t, int rows, int cols) {
  const std::string ty = t + "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
  return "graph @g(%g: " + ty + ", %u: " + ty + ") -> (" + ty + ") {\n  %y = fused(%g, %u) : " + ty +
         " {\n    graph @fused(%a: " + ty + ", %b: " + ty + ") -> (" + ty + ") {\n      %s = silu(%a) : " + ty +
         "\n      %y = mul(%s, %b) : " + ty + "\n      return %y\n    }\n  }\n  return %y\n}\n";
}

// RoPE as fuse-pointwise groups it (see pointwise_index_test.cpp), at head dim `d`.
std::string rope(const std::string& t, int d) {
  const std::string h = std::to_string(d / 2), D = std::to_string(d), W = std::to_string(4 * d);
  return "graph @g(%q: " + t + "[2, 8, " + W + "], %cos: " + t + "[1, 1, 8, " + D + "], %sin: " + t + "[1, 1, 8, " + D +
         "]) -> (" + t + "[2, 4, 8, " + D + "]) {\n  %y = fused(%q, %cos, %sin) : " + t + "[2, 4, 8, " + D +
         "] {\n    graph @fused(%x: " + t + "[2, 8, " + W + "], %c: " + t + "[1, 1, 8, " + D + "], %s: " + t + "[1, 1, 8, " + D +
         "]) -> (" + t + "[2, 4, 8, " + D + "]) {\n"
         "      %v = reshape(%x) {shape = [2, 8, 4, " + D + "]} : " + t + "[2, 8, 4, " + D + "]\n"
         "      %t = transpose(%v) {perm = [0, 2, 1, 3]} : " + t + "[2, 4, 8, " + D + "]\n"
         "      %lo = slice(%t) {axes = [3], starts = [0], ends = [" + h + "]} : " + t + "[2, 4, 8, " + h + "]\n"
         "      %hi = slice(%t) {axes = [3], starts = [" + h + "], ends = [" + D + "]} : " + t + "[2, 4, 8, " + h + "]\n"
         "      %n = neg(%hi) : " + t + "[2, 4, 8, " + h + "]\n"
         "      %rot = concat(%n, %lo) {axis = -1} : " + t + "[2, 4, 8, " + D + "]\n"
         "      %a = mul(%t, %c) : " + t + "[2, 4, 8, " + D + "]\n"
         "      %b = mul(%rot, %s) : " + t + "[2, 4, 8, " + D + "]\n"
         "      %y = add(%a, %b) : " + t + "[2, 4, 8, " + D + "]\n"
         "      return %y\n    }\n  }\n  return %y\n}\n";
}

/// assert_close's defaults per dtype; NaN and misplaced infinities fail (tensor_compare.h).
std::string compare(const Tensor& want, const Tensor& got) {
  return test::assert_close(want, got).why;
}

std::string one_op(const std::string& in, const std::string& op, const std::string& out) {
  return "graph @g(%x: " + in + ") -> (" + out + ") {\n  %y = " + op + " : " + out + "\n  return %y\n}\n";
}

}  // namespace

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  int failures = 0, cases = 0;
  auto run = [&](const std::string& name, const std::string& text) {
    failures += report_case(name, gpu_matches_reference(text, "vectorize", 7, compare));
    ++cases;
  };
  for (const char* t : {"f32", "f16", "bf16"}) {
    const std::string d = t;
    run("swiglu " + d + " 64x1024", swiglu(d, 64, 1024));
    run("swiglu " + d + " 3x5 (scalar)", swiglu(d, 3, 5));
    run("swiglu " + d + " 6x12", swiglu(d, 6, 12));
    run("transpose keeping the innermost dim " + d,
        one_op(d + "[1, 64, 4, 32]", "transpose(%x) {perm = [0, 2, 1, 3]}", d + "[1, 4, 64, 32]"));
    run("transpose of the innermost dim " + d, one_op(d + "[3, 40, 72]", "transpose(%x) {perm = [0, 2, 1]}", d + "[3, 72, 40]"));
    run("2-D transpose across tile edges " + d, one_op(d + "[33, 65]", "transpose(%x)", d + "[65, 33]"));
    run("transpose with rows of 6 " + d, one_op(d + "[5, 7, 6]", "transpose(%x) {perm = [1, 0, 2]}", d + "[7, 5, 6]"));
    run("rope " + d + " head dim 32", rope(d, 32));
    run("rope " + d + " head dim 12 (scalar)", rope(d, 12));
  }
  // f8 transposes, compared through an exact dequantize: 128x128 tiles of 16-byte chunks where
  // both dims are multiples of 16 (whole tiles, partial ones, batched; the Llama block's
  // weights, activations and gradients, scaled down), else 32x32 tiles of bytes.
  struct F8Transpose {
    const char *in, *out, *perm, *dtype;
  };
  for (const F8Transpose& c : {
           F8Transpose{"[256, 384]", "[384, 256]", "", "f8e4m3fn"},
           F8Transpose{"[2, 128, 192]", "[2, 192, 128]", " {perm = [0, 2, 1]}", "f8e4m3fn"},
           F8Transpose{"[48, 80]", "[80, 48]", "", "f8e5m2"},
           F8Transpose{"[3, 400, 144]", "[3, 144, 400]", " {perm = [0, 2, 1]}", "f8e5m2"},
           F8Transpose{"[256, 64]", "[64, 256]", "", "f8e4m3fn"},
           F8Transpose{"[40, 72]", "[72, 40]", "", "f8e4m3fn"},
           F8Transpose{"[2, 33, 48]", "[2, 48, 33]", " {perm = [0, 2, 1]}", "f8e5m2"},
           // The Llama block's shapes at a quarter of a dim (the reference interpreter checks
           // 4096 x 14336 too slowly): whole 128-byte tiles, thousands of blocks.
           F8Transpose{"[2048, 2048]", "[2048, 2048]", "", "f8e4m3fn"},
           F8Transpose{"[1024, 3584]", "[3584, 1024]", "", "f8e5m2"},
           F8Transpose{"[3584, 1024]", "[1024, 3584]", "", "f8e4m3fn"},
           F8Transpose{"[4096, 1024]", "[1024, 4096]", "", "f8e5m2"},
       }) {
    const std::string in = c.in, out = c.out, dt = c.dtype;
    run(dt + " transpose " + in, "graph @g(%x: f32" + in + ") -> (f32" + out + ") {\n"
        "  %s = constant() {value = dense<f32[]>[0.01]} : f32[]\n"
        "  %q = quantize(%x, %s) {dtype = " + dt + "} : " + dt + in + "\n"
        "  %t = transpose(%q)" + c.perm + " : " + dt + out + "\n"
        "  %y = dequantize(%t, %s) : f32" + out + "\n  return %y\n}\n");
  }
  run("bias row and scalar broadcast, bf16 -> f32", kBiasScalarBroadcast);
  run("column broadcast bf16", R"(
graph @g(%x: bf16[32, 48], %b: bf16[32, 1]) -> (bf16[32, 48]) {
  %y = add(%x, %b) : bf16[32, 48]
  return %y
})");
  run("unaligned and aligned views bf16", R"(
graph @g(%x: bf16[20]) -> (bf16[16], bf16[16], bf16[8]) {
  %p, %q = split(%x) {axis = 0, sizes = [4, 16]} : bf16[4], bf16[16]
  %r = slice(%x) {axes = [0], starts = [0], ends = [16]} : bf16[16]
  %s = slice(%x) {axes = [0], starts = [3], ends = [11]} : bf16[8]
  %y = exp(%q) : bf16[16]
  %z = exp(%r) : bf16[16]
  return %y, %z, %s
})");
  run("indexed group reading lanes strided f32", kStridedTransposeGroup);
  run("concat of rows bf16", R"(
graph @g(%x: bf16[4, 24], %y: bf16[4, 40]) -> (bf16[4, 64]) {
  %z = concat(%x, %y) {axis = 1} : bf16[4, 64]
  return %z
})");
  std::printf("%d of %d cases failed\n", failures, cases);
  return failures == 0 ? 0 : 1;
}
