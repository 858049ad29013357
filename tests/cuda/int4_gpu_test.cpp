// GPU test of matmul_int4 on cuda-sm90 against the reference interpreter: M = 1, 5, 16, 33, 64,
// 200 (GEMV, mma and dequantize + gemm), group sizes 32/64/128, symmetric and asymmetric,
// bf16/f16, odd N. Exits 77 (skip) without a GPU.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kiln/core/driver.h"
#include "kiln/ir/text.h"
#include "gpu_test_util.h"

namespace {

using namespace kiln;

std::string graph(int64_t m, int64_t n, int64_t k, int64_t g, bool asym, const std::string& dt, bool bias) {
  const std::string M = std::to_string(m), N = std::to_string(n), K = std::to_string(k);
  const std::string sg = dt + "[" + N + ", " + std::to_string(k / g) + "]";
  std::string args = "%x: " + dt + "[" + M + ", " + K + "], %w: u8[" + N + ", " + std::to_string(k / 2) + "], %s: " + sg;
  std::string ops = "%x, %w, %s";
  if (asym) args += ", %z: " + sg, ops += ", %z";
  if (bias) args += ", %b: " + dt + "[" + N + "]", ops += ", %b";
  const std::string yt = dt + "[" + M + ", " + N + "]";
  return "graph @g(" + args + ") -> (" + yt + ") {\n  %y = matmul_int4(" + ops + ") {group_size = " + std::to_string(g) +
         (asym ? ", asymmetric = 1" : "") + "} : " + yt + "\n  return %y\n}\n";
}

/// Normwise relative error: the kernels round dequantized weights to x's dtype (bf16: 2^-9,
/// f16: 2^-12 relative), which elementwise tolerances would flag on cancelling sums.
double rel_error(const Tensor& want, const Tensor& got) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = want.get_f64(i) - got.get_f64(i);
    num += d * d;
    den += want.get_f64(i) * want.get_f64(i);
  }
  return std::sqrt(num / den);
}

}  // namespace

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  int failures = 0, cases = 0;
  const int64_t ms[] = {1, 5, 16, 33, 64, 200};
  const int64_t gs[] = {32, 64, 128};
  for (size_t i = 0; i < 6; ++i)
    for (size_t j = 0; j < 3; ++j)
      for (bool asym : {false, true}) {
        const std::string dt = (i + j + asym) % 2 ? "f16" : "bf16";
        const int64_t m = ms[i], g = gs[j], n = 257, k = 1024 + 2 * g;
        const bool bias = (i + j) % 2 == 0;
        const std::string name = "m=" + std::to_string(m) + " g=" + std::to_string(g) + (asym ? " asym " : " sym ") + dt +
                                 (bias ? " bias" : "");
        const double limit = dt == "bf16" ? 1e-2 : 2e-3;
        auto within = [&](const Tensor& want, const Tensor& got) -> std::string {
          const double err = rel_error(want, got);
          return err <= limit ? "" : "relative error " + std::to_string(err) + " > " + std::to_string(limit);
        };
        failures += report_case(name, gpu_matches_reference(graph(m, n, k, g, asym, dt, bias), "int4",
                                                            static_cast<uint64_t>(11 + cases), within));
        ++cases;
      }
  std::printf("%d of %d cases failed\n", failures, cases);
  return failures == 0 ? 0 : 1;
}
