// GPU check of the fused attention kernels against the reference interpreter: bf16/f16 on the
// tensor-core path (head dims 64 and 128; on the H200 the wgmma kernel), f32 and odd head dims
// on the CUDA-core path; causal and not, grouped-query heads, masks, odd sequence lengths,
// Sq != Skv, several Q blocks and KV tiles, and q/k/v read from and the result written to
// [B, S, H, D] through the transposes the lowering absorbs; on the H200 also the plan's
// portable compute_90 image, which runs the mma.sync kernel. Exits 77 (skip) without a GPU.
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

/// q, k, v given as [B, S, H, D] and transposed for attention (`in`), the result transposed back
/// and reshaped to [B, S, H·D] (`out`): the layouts exporters produce.
std::string transposed_text(const Case& c, bool in, bool out) {
  const std::string t = c.dtype;
  auto bshd = [&](int h, int s, int d) { return t + dims(c.b, s, h, d); };
  auto bhsd = [&](int h, int s, int d) { return t + dims(c.b, h, s, d); };
  std::string g = "graph @g(%q: " + (in ? bshd(c.hq, c.sq, c.d) : bhsd(c.hq, c.sq, c.d)) + ", %k: " +
                  (in ? bshd(c.hkv, c.skv, c.d) : bhsd(c.hkv, c.skv, c.d)) + ", %v: " +
                  (in ? bshd(c.hkv, c.skv, c.dv) : bhsd(c.hkv, c.skv, c.dv)) + ") -> (" +
                  (out ? t + "[" + std::to_string(c.b) + ", " + std::to_string(c.sq) + ", " + std::to_string(c.hq * c.dv) + "]"
                       : bhsd(c.hq, c.sq, c.dv)) + ") {\n";
  const char* names[3] = {"q", "k", "v"};
  const int heads[3] = {c.hq, c.hkv, c.hkv}, seqs[3] = {c.sq, c.skv, c.skv}, hds[3] = {c.d, c.d, c.dv};
  for (int i = 0; i < 3 && in; ++i)
    g += std::string("  %") + names[i] + "t = transpose(%" + names[i] + ") {perm = [0, 2, 1, 3]} : " +
         bhsd(heads[i], seqs[i], hds[i]) + "\n";
  // v as Llama's repeat_kv leaves it with one repeat: views through a unit dim.
  if (in)
    g += "  %v5 = reshape(%vt) {shape = [" + std::to_string(c.b) + ", " + std::to_string(c.hkv) + ", 1, " +
         std::to_string(c.skv) + ", " + std::to_string(c.dv) + "]} : " + t + "[" + std::to_string(c.b) + ", " +
         std::to_string(c.hkv) + ", 1, " + std::to_string(c.skv) + ", " + std::to_string(c.dv) + "]\n  %v4 = reshape(%v5) {shape = " +
         dims(c.b, c.hkv, c.skv, c.dv) + "} : " + bhsd(c.hkv, c.skv, c.dv) + "\n";
  g += std::string("  %a = attention(") + (in ? "%qt, %kt, %v4" : "%q, %k, %v") + ") {scale = " +
       std::to_string(1.0 / std::sqrt(static_cast<double>(c.d))) + ", causal = " + (c.causal ? "1" : "0") +
       "} : " + bhsd(c.hq, c.sq, c.dv) + "\n";
  if (out)
    g += "  %at = transpose(%a) {perm = [0, 2, 1, 3]} : " + bshd(c.hq, c.sq, c.dv) + "\n  %y = reshape(%at) {shape = [" +
         std::to_string(c.b) + ", " + std::to_string(c.sq) + ", " + std::to_string(c.hq * c.dv) + "]} : " + t + "[" +
         std::to_string(c.b) + ", " + std::to_string(c.sq) + ", " + std::to_string(c.hq * c.dv) + "]\n  return %y\n}\n";
  else
    g += "  return %a\n}\n";
  return g;
}

/// The reference is exact and rounds once; the kernels round P to the input dtype before the
/// P·V product (as every flash kernel does) and accumulate in f32, which costs a few units in
/// the last place of the 16-bit types on outputs of size ~0.1: assert_close's rtol per dtype,
/// with atol raised to cover that rounding of P (f32: exp2f and f32 sums over ~200 keys).
test::Tolerance tolerance(DType t) {
  if (t == DType::kF16) return {1e-3, 1e-3};
  if (t == DType::kBF16) return {1.6e-2, 1e-2};
  return {1e-5, 1e-5};
}

/// Within tolerance(), NaN and misplaced infinities failing (tensor_compare.h); prints the
/// largest difference.
std::string compare(const Tensor& want, const Tensor& got) {
  const test::Verdict v = test::allclose(want, got, tolerance(want.dtype()));
  if (v.ok()) std::printf("  max abs error %.3g\n", v.measure);
  return v.why;
}

}  // namespace

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  std::vector<Case> cases;
  // The tensor-core kernel from its simplest case on: one key (softmax is 1, so only the P·V
  // product and V's layout matter), one 128-row Q block against one full 128-key tile (adds
  // S = Q·Kᵀ), then several Q blocks and KV tiles with odd lengths, GQA and Sq != Skv.
  for (const char* dt : {"bf16", "f16"})
    for (int d : {64, 128}) {
      cases.push_back({dt, 1, 1, 1, 64, 1, d, d, false, ""});
      cases.push_back({dt, 1, 1, 1, 128, 128, d, d, false, ""});
      cases.push_back({dt, 1, 1, 1, 128, 128, d, d, true, ""});
      cases.push_back({dt, 1, 2, 1, 1030, 1030, d, d, true, ""});
      cases.push_back({dt, 1, 2, 2, 1000, 1300, d, d, true, ""});
      cases.push_back({dt, 2, 2, 2, 1100, 1100, d, d, false, ""});
    }
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
  // Strided operands and result: in only, out only, both (tensor-core and CUDA-core paths).
  const Case strided[] = {{"bf16", 2, 4, 2, 300, 300, 128, 128, true, ""}, {"f16", 1, 4, 4, 200, 333, 64, 64, false, ""},
                          {"f32", 2, 2, 1, 77, 77, 64, 64, true, ""}};
  int total = static_cast<int>(cases.size());
  for (const Case& c : strided)
    for (int form = 1; form <= 3; ++form) {
      const bool in = form & 1, out = form & 2;
      char name[200];
      std::snprintf(name, sizeof name, "%s b=%d hq=%d hkv=%d sq=%d skv=%d d=%d causal=%d [B,S,H,D]%s%s", c.dtype, c.b,
                    c.hq, c.hkv, c.sq, c.skv, c.d, c.causal, in ? " in" : "", out ? " out" : "");
      failures += report_case(name, gpu_matches_reference(transposed_text(c, in, out), "attention", 7, compare));
      ++total;
    }
  // The same plan's portable image (compute_90 PTX, JIT-compiled here) runs the mma.sync kernel,
  // which sm80 and sm100 plans use too.
  Options ptx;
  ptx.set("images", std::vector<std::string>{"compute_90"});
  const Case portable[] = {{"bf16", 1, 2, 1, 1030, 1030, 128, 128, true, ""}, {"f16", 1, 2, 2, 1000, 1300, 64, 64, true, ""},
                           {"bf16", 2, 4, 2, 77, 130, 64, 64, true, ""}, {"f16", 1, 4, 1, 130, 77, 128, 128, false, "[1, 1, 130, 77]"},
                           {"bf16", 2, 2, 2, 200, 200, 128, 128, true, "[200]"}};
  for (const Case& c : portable) {
    char name[180];
    std::snprintf(name, sizeof name, "compute_90 image: %s b=%d hq=%d hkv=%d sq=%d skv=%d d=%d causal=%d mask=%s", c.dtype,
                  c.b, c.hq, c.hkv, c.sq, c.skv, c.d, c.causal, *c.mask ? c.mask : "none");
    failures += report_case(name, gpu_matches_reference(case_text(c), "attention", 9, compare, {}, ptx));
    ++total;
  }
  std::printf("%d of %d cases failed\n", failures, total);
  return failures == 0 ? 0 : 1;
}
