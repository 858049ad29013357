// GPU check of the fused attention kernels against the reference interpreter: bf16/f16 on the
// tensor-core path (head dims 64 and 128), f32 and odd head dims on the CUDA-core path; causal
// and not, grouped-query heads, masks, odd sequence lengths and Sq != Skv. Exits 77 (skip)
// without a GPU.
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

struct Case {
  const char* dtype;
  int b, hq, hkv, sq, skv, d, dv;
  bool causal;
  const char* mask;  ///< mask shape ("" for none), e.g. "[1, 1, 77, 77]"
};

std::string dims(int a, int b, int c, int d) {
  return "[" + std::to_string(a) + ", " + std::to_string(b) + ", " + std::to_string(c) + ", " + std::to_string(d) + "]";
}

std::string case_text(const Case& c) {
  const std::string t = c.dtype, y = t + dims(c.b, c.hq, c.sq, c.dv);
  const bool mask = *c.mask != 0;
  return "graph @g(%q: " + t + dims(c.b, c.hq, c.sq, c.d) + ", %k: " + t + dims(c.b, c.hkv, c.skv, c.d) +
         ", %v: " + t + dims(c.b, c.hkv, c.skv, c.dv) + (mask ? ", %m: f32" + std::string(c.mask) : "") +
         ") -> (" + y + ") {\n  %a = attention(%q, %k, %v" + (mask ? ", %m" : "") + ") {scale = " +
         std::to_string(1.0 / std::sqrt(static_cast<double>(c.d))) + ", causal = " + (c.causal ? "1" : "0") +
         "} : " + y + "\n  return %a\n}\n";
}

/// The reference is exact and rounds once; the kernels round P to the input dtype before the
/// P·V product (as every flash kernel does) and accumulate in f32, which costs a few units in
/// the last place of the 16-bit types on outputs of size ~0.1: assert_close's rtol per dtype,
/// with atol raised to cover that rounding of P (f32: exp2f and f32 sums over ~200 keys).
void tolerances(DType t, double& rtol, double& atol) {
  rtol = 1e-5, atol = 1e-5;
  if (t == DType::kF16) rtol = 1e-3, atol = 1e-3;
  if (t == DType::kBF16) rtol = 1.6e-2, atol = 1e-2;
}

std::string compare(const Tensor& want, const Tensor& got) {
  if (want.type() != got.type()) return "type " + got.type().str() + ", expected " + want.type().str();
  double rtol, atol;
  tolerances(want.dtype(), rtol, atol);
  double worst = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double w = want.get_f64(i), g = got.get_f64(i);
    if (!(std::fabs(w - g) <= atol + rtol * std::fabs(w)))
      return "element " + std::to_string(i) + ": got " + std::to_string(g) + ", expected " + std::to_string(w);
    worst = std::max(worst, std::fabs(w - g));
  }
  std::printf("  max abs error %.3g\n", worst);
  return "";
}

}  // namespace

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  std::vector<Case> cases;
  for (const char* dt : {"bf16", "f16"})
    for (int d : {64, 128}) {
      cases.push_back({dt, 1, 4, 4, 77, 77, d, d, false, ""});
      cases.push_back({dt, 1, 4, 4, 130, 130, d, d, true, ""});
      cases.push_back({dt, 2, 4, 2, 77, 130, d, d, true, ""});        // GQA, causal offset
      cases.push_back({dt, 1, 4, 1, 130, 77, d, d, false, "[1, 1, 130, 77]"});
      cases.push_back({dt, 2, 2, 2, 200, 200, d, d, true, "[200]"});  // mask broadcast over rows
    }
  cases.push_back({"bf16", 1, 2, 1, 77, 77, 96, 96, true, ""});       // 16-bit, CUDA-core path
  cases.push_back({"f32", 1, 4, 4, 77, 77, 64, 64, false, ""});
  cases.push_back({"f32", 2, 4, 2, 130, 130, 64, 64, true, ""});
  cases.push_back({"f32", 1, 4, 4, 77, 130, 128, 128, true, "[1, 4, 77, 130]"});
  cases.push_back({"f32", 1, 2, 2, 33, 45, 48, 40, false, "[45]"});
  int failures = 0;
  for (const Case& c : cases) {
    const std::string text = case_text(c);
    char name[160];
    std::snprintf(name, sizeof name, "%s b=%d hq=%d hkv=%d sq=%d skv=%d d=%d dv=%d causal=%d mask=%s", c.dtype, c.b,
                  c.hq, c.hkv, c.sq, c.skv, c.d, c.dv, c.causal, *c.mask ? c.mask : "none");
    failures += report_case(name, gpu_matches_reference(text, "attention", 5, compare));
  }
  std::printf("%d of %zu cases failed\n", failures, cases.size());
  return failures == 0 ? 0 : 1;
}
