// GPU check of 1x1 convs as strided-batched cuBLASLt GEMMs (conv_1x1.cpp) against the reference
// interpreter: f32 (strict and tf32), f16 and bf16; a constant bias as the shared C plane, bias +
// residual through the bias kernel, a residual as C, relu epilogues, 1-D and 3-D. Exits 77 without
// a GPU.
#include <cstdio>
#include <string>

#include "conv_1x1_graphs.h"
#include "conv_depthwise_graphs.h"
#include "gpu_test_util.h"
#include "kiln/core/options.h"

using namespace kiln;

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  auto info = Registry::global().backend("cuda-sm90");
  if (!info.ok()) {
    std::printf("FAIL: %s\n", info.status().message().c_str());
    return 1;
  }
  int failures = 0, cases = 0;
  struct Config { const char* dtype; bool tf32; };
  for (const Config& cfg : {Config{"f32", false}, Config{"f32", true}, Config{"f16", false}, Config{"bf16", false}})
    for (const auto& c : test::k1x1Cases) {
      const test::Tolerance tol = test::fused_conv_tolerance(*parse_dtype(cfg.dtype), cfg.tf32);
      auto opts = resolve_options((*info)->options, {{"allow-tf32", cfg.tf32}}, "cuda-sm90");
      const std::string name = std::string(c[0]) + " " + cfg.dtype + (cfg.tf32 ? " tf32" : "");
      const std::string text = test::replace_all(c[1], "T[", std::string(cfg.dtype) + "[");
      failures += report_case(
          name, !opts.ok() ? opts.status().message()
                           : gpu_matches_reference(
                                 text, "conv_1x1", 13,
                                 [&](const Tensor& want, const Tensor& got) { return test::allclose(want, got, tol).why; },
                                 {}, *opts));
      ++cases;
    }
  std::printf("%d of %d cases failed\n", failures, cases);
  return failures == 0 ? 0 : 1;
}
