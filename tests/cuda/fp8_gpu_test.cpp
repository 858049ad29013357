// GPU check of the FP8 lowering on cuda-sm90: quantize/dequantize round trips and scaled_matmul
// (cuBLASLt FP8 GEMM with scale pointers: bf16/f16/f32 results, bias, e5m2 activations, and the
// dequantize fallback for shapes FP8 GEMMs cannot take) and quantize epilogues of fused groups,
// against the reference interpreter, by SQNR. Exits 77 (skip) without a GPU.
#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kiln/core/driver.h"
#include "kiln/ir/text.h"

namespace {

using namespace kiln;

/// quantize(x) and scaled_matmul by %w f8e4m3fn[n, k], returning y and the round-tripped x.
std::string case_text(const std::string& t, const std::string& act, int m, int n, int k, bool bias) {
  const std::string M = std::to_string(m), N = std::to_string(n), K = std::to_string(k);
  const std::string xt = t + "[" + M + ", " + K + "]", yt = t + "[" + M + ", " + N + "]";
  std::string args = "%x: " + xt + ", %w: f8e4m3fn[" + N + ", " + K + "], %sx: f32[], %sw: f32[]";
  std::string ops = "%xq, %w, %sx, %sw";
  if (bias) args += ", %b: " + t + "[" + N + "]", ops += ", %b";
  return "graph @g(" + args + ") -> (" + yt + ", " + xt + ") {\n"
         "  %xq = quantize(%x, %sx) {dtype = " + act + "} : " + act + "[" + M + ", " + K + "]\n"
         "  %y = scaled_matmul(" + ops + ") {dtype = " + t + "} : " + yt + "\n"
         "  %xd = dequantize(%xq, %sx) {dtype = " + t + "} : " + xt + "\n"
         "  return %y, %xd\n}\n";
}

}  // namespace

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (prop.major * 10 + prop.minor < 89) {
    std::printf("SKIP: FP8 GEMMs need sm_89 or newer, device is sm_%d%d\n", prop.major, prop.minor);
    return 77;
  }
  struct Case {
    const char* t;
    const char* act;
    int m, n, k;
    bool bias;
  };
  // Native FP8 GEMMs (k, n multiples of 16), then shapes that take the dequantize fallback.
  const Case cases[] = {{"bf16", "f8e4m3fn", 64, 128, 256, false}, {"bf16", "f8e4m3fn", 33, 64, 512, true},
                        {"f16", "f8e4m3fn", 16, 48, 64, true},     {"f32", "f8e4m3fn", 8, 32, 128, true},
                        {"bf16", "f8e5m2", 128, 256, 1024, false}, {"f32", "f8e4m3fn", 5, 24, 40, true},
                        {"bf16", "f8e4m3fn", 3, 17, 21, false}, {"f32", "f8e4m3fn", 64, 32, 64, false}};
  int failures = 0;
  for (const Case& c : cases) {
    const std::string name = std::string(c.t) + " " + c.act + " m=" + std::to_string(c.m) + " n=" +
                             std::to_string(c.n) + " k=" + std::to_string(c.k) + (c.bias ? " bias" : "");
    // Outputs y, then the round-tripped x. The GEMM differs from the reference only by
    // accumulation order and the result's rounding; quantize/dequantize should agree bit for bit.
    static constexpr double kFloor[2] = {35, 60};
    static constexpr const char* kWhat[2] = {"scaled_matmul", "quantize/dequantize"};
    double db[2] = {0, 0};
    int out = 0;
    auto check = [&](const Tensor& want, const Tensor& got) {
      const int i = out++;
      const test::Verdict v = test::sqnr_at_least(want, got, kFloor[i]);
      db[i] = v.measure;
      return v.ok() ? std::string() : std::string(kWhat[i]) + ": " + v.why;
    };
    // x in [-1, 1): amax 1; w in [-1, 1) as e4m3 values, scaled by 1/64.
    const std::string why = gpu_matches_reference(case_text(c.t, c.act, c.m, c.n, c.k, c.bias), "fp8", 7, check,
                                                  {{"sx", Tensor::scalar_f64(DType::kF32, 1.0 / 448)},
                                                   {"sw", Tensor::scalar_f64(DType::kF32, 1.0 / 64)}});
    std::printf("%s %s: y %.1f dB, q/dq %.1f dB%s%s\n", why.empty() ? "PASS" : "FAIL", name.c_str(), db[0], db[1],
                why.empty() ? "" : ": ", why.c_str());
    failures += !why.empty();
  }
  // Quantize and amax epilogues (fuse-rows / fuse-pointwise output): RMSNorm + residual and
  // SwiGLU groups that store f8 directly (e4m3 and e5m2, the SwiGLU scale small enough to
  // saturate e4m3) and reduce max |x| with an atomic. Each output must match the reference
  // interpreter's run of the same fused graph.
  {
    std::vector<double> dbs;
    std::string first_bad;
    // Every output's SQNR is listed; the first below the floor (or with a NaN) is named.
    std::string why = gpu_matches_reference(
        R"(graph @block(%x: bf16[64, 256], %d: bf16[64, 256], %g: bf16[256], %a: bf16[64, 512], %b: bf16[64, 512]) -> (bf16[64, 256], f8e4m3fn[64, 256], f8e4m3fn[64, 512], f8e5m2[64, 512], f32[], f32[]) {
  %r, %ah, %hq = fused(%x, %d, %g) : bf16[64, 256], f32[], f8e4m3fn[64, 256] {
    graph @fused(%x: bf16[64, 256], %d: bf16[64, 256], %g: bf16[256]) -> (bf16[64, 256], f32[], f8e4m3fn[64, 256]) {
      %s = constant() {value = dense<f32[]>[0.009999999776482582]} : f32[]
      %r = add(%x, %d) : bf16[64, 256]
      %h = rms_norm(%r, %g) {axis = -1, epsilon = 1e-05} : bf16[64, 256]
      %ah = amax(%h) : f32[]
      %hq = quantize(%h, %s) {dtype = f8e4m3fn} : f8e4m3fn[64, 256]
      return %r, %ah, %hq
    }
  }
  %ap, %pq, %pe = fused(%a, %b) : f32[], f8e4m3fn[64, 512], f8e5m2[64, 512] {
    graph @fused(%a: bf16[64, 512], %b: bf16[64, 512]) -> (f32[], f8e4m3fn[64, 512], f8e5m2[64, 512]) {
      %s2 = constant() {value = dense<f32[]>[0.0010000000474974513]} : f32[]
      %sa = silu(%a) : bf16[64, 512]
      %p = mul(%sa, %b) : bf16[64, 512]
      %ap = amax(%p) : f32[]
      %pq = quantize(%p, %s2) {dtype = f8e4m3fn} : f8e4m3fn[64, 512]
      %pe = quantize(%p, %s2) {dtype = f8e5m2} : f8e5m2[64, 512]
      return %ap, %pq, %pe
    }
  }
  return %r, %hq, %pq, %pe, %ah, %ap
})",
        "fp8-epilogues", 11, [&](const Tensor& want, const Tensor& got) {
          const test::Verdict v = test::sqnr_at_least(want, got, 60);
          dbs.push_back(v.measure);
          if (!v.ok() && first_bad.empty())
            first_bad = "output " + std::to_string(dbs.size() - 1) + ": " + v.why;
          return std::string();
        });
    if (why.empty()) why = first_bad;
    std::string list;
    for (double db : dbs) list += (list.empty() ? "" : ", ") + std::to_string(db).substr(0, 6) + " dB";
    std::printf("%s quantize + amax epilogues (rms_norm+residual, swiglu; e4m3, e5m2): %s%s%s\n", why.empty() ? "PASS" : "FAIL",
                list.c_str(), why.empty() ? "" : ": ", why.c_str());
    failures += !why.empty();
  }
  std::printf("%d of %zu cases failed\n", failures, std::size(cases) + 1);
  return failures == 0 ? 0 : 1;
}
