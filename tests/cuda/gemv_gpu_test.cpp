// GPU check of the small-M GEMV kernels: linear (with and without bias, relu, tanh and exact
// gelu) and matmul at M = 1, 3, 16 in f32/f16/bf16, with odd N and K, K not a multiple of the
// vector width and K longer than one shared-memory tile, against the reference interpreter.
// Exits 77 (skip) without a GPU.
#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kiln/core/driver.h"
#include "kiln/ir/text.h"
#include "gpu_test_util.h"

namespace {

using namespace kiln;

/// One graph per (dtype, M, N, K): every epilogue variant of linear and two matmuls.
std::string case_text(const std::string& t, int m, int n, int k) {
  auto ty = [&](int a, int b) { return t + "[" + std::to_string(a) + ", " + std::to_string(b) + "]"; };
  const std::string y = ty(m, n);
  return "graph @g(%x: " + ty(m, k) + ", %w: " + ty(n, k) + ", %b: " + t + "[" + std::to_string(n) + "], %q: " +
         ty(k, n) + ") -> (" + y + ", " + y + ", " + y + ", " + y + ", " + y + ", " + y + ", " + y + ") {\n"
         "  %l0 = linear(%x, %w) : " + y + "\n"
         "  %l1 = linear(%x, %w, %b) : " + y + "\n"
         "  %h2 = linear(%x, %w, %b) : " + y + "\n"
         "  %l2 = relu(%h2) : " + y + "\n"
         "  %h3 = linear(%x, %w) : " + y + "\n"
         "  %l3 = gelu(%h3) {approximate = \"tanh\"} : " + y + "\n"
         "  %h4 = linear(%x, %w, %b) : " + y + "\n"
         "  %l4 = gelu(%h4) : " + y + "\n"
         "  %m0 = matmul(%x, %q) : " + y + "\n"
         "  %h5 = matmul(%x, %q) : " + y + "\n"
         "  %m1 = relu(%h5) : " + y + "\n"
         "  return %l0, %l1, %l2, %l3, %l4, %m0, %m1\n}\n";
}

/// assert_close's defaults per dtype; NaN and misplaced infinities fail (tensor_compare.h).
std::string compare(const Tensor& want, const Tensor& got) {
  return test::assert_close(want, got).why;
}

}  // namespace

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  // (N, K): odd both ways, K % 8 == 0 (16-byte loads for every dtype), and K over the 512
  // columns of x that one block stages at M = 16.
  const int shapes[][2] = {{77, 130}, {130, 77}, {96, 128}, {64, 1100}};
  int failures = 0, cases = 0;
  for (const char* dt : {"f32", "f16", "bf16"})
    for (int m : {1, 3, 16})
      for (const auto& nk : shapes) {
        const std::string name = std::string(dt) + " m=" + std::to_string(m) + " n=" + std::to_string(nk[0]) +
                                 " k=" + std::to_string(nk[1]);
        failures += report_case(name, gpu_matches_reference(case_text(dt, m, nk[0], nk[1]), "gemv", 11, compare));
        ++cases;
      }
  std::printf("%d of %d cases failed\n", failures, cases);
  return failures == 0 ? 0 : 1;
}
