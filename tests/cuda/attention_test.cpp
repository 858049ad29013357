// Lowering of attention: one launch per node, the kernel each variant picks, NVRTC for every target.
#include <doctest/doctest.h>

#include <sstream>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

/// Every variant: tensor-core bf16/f16 at head dims 64 and 128 (causal, GQA, mask), the
/// CUDA-core path for f32, an odd head dim and Dv != D.
const char* kVariants = R"(
graph @g(%q1: bf16[1, 4, 77, 64], %k1: bf16[1, 2, 77, 64], %v1: bf16[1, 2, 77, 64],
         %q2: f16[2, 2, 130, 128], %k2: f16[2, 2, 200, 128], %v2: f16[2, 2, 200, 128], %m2: f32[2, 1, 130, 200],
         %q3: f32[1, 2, 33, 64], %v3: f32[1, 2, 33, 40], %q4: bf16[1, 1, 9, 96], %m4: bf16[9]) ->
        (bf16[1, 4, 77, 64], f16[2, 2, 130, 128], f32[1, 2, 33, 40], bf16[1, 1, 9, 96]) {
  %a1 = attention(%q1, %k1, %v1) {scale = 0.125, causal = 1} : bf16[1, 4, 77, 64]
  %a2 = attention(%q2, %k2, %v2, %m2) {scale = 0.088} : f16[2, 2, 130, 128]
  %a3 = attention(%q3, %q3, %v3) {scale = 0.125, causal = 1} : f32[1, 2, 33, 40]
  %a4 = attention(%q4, %q4, %q4, %m4) {scale = 0.1} : bf16[1, 1, 9, 96]
  return %a1, %a2, %a3, %a4
}
)";

TEST_CASE("attention: one launch per node; mma.sync for 16-bit head dims 64/128, CUDA cores else") {
  auto g = parse_graph(kVariants);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto l = lower_graph(**g);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  CHECK(l->kernels == std::vector<std::string>{"k0_attention", "k1_attention", "k2_attention", "k3_attention"});
  const auto steps = launches(l->plan);
  REQUIRE(steps.size() == 4);
  // Tensor-core tiles are 128 query rows (4 warps): Q plus two K and two V tiles of 64 keys, rows padded by 8.
  CHECK(steps[0].find("grid=1,4,1 block=128,1,1 smem=" + std::to_string((128 + 4 * 64) * 72 * 2)) !=
        std::string::npos);
  CHECK(steps[1].find("grid=2,2,2 block=128,1,1 smem=" + std::to_string((128 + 4 * 64) * 136 * 2)) !=
        std::string::npos);
  CHECK(steps[2].find("grid=2,2,1 block=256,1,1 smem=" + std::to_string((32 * 64 + 32 * 65 + 32 * 40) * 4)) !=
        std::string::npos);
  CHECK(l->source.find("kiln_flash_attn<__nv_bfloat16, 64, true, false, float>") != std::string::npos);
  CHECK(l->source.find("kiln_flash_attn<__half, 128, false, true, float>") != std::string::npos);
  CHECK(l->source.find("kiln_attn_generic<float, 64, 40, true, false, float>") != std::string::npos);
  CHECK(l->source.find("kiln_attn_generic<__nv_bfloat16, 96, 96, false, true, __nv_bfloat16>") != std::string::npos);
  compiles_everywhere(*l);
}

TEST_CASE("attention: unsupported dtypes and head dims are clear errors") {
  auto f64 = parse_graph(R"(graph @g(%q: f64[1, 1, 4, 8]) -> (f64[1, 1, 4, 8]) {
  %a = attention(%q, %q, %q) {scale = 1.0} : f64[1, 1, 4, 8]
  return %a
})");
  REQUIRE(f64.ok());
  auto l = lower_graph(**f64);
  REQUIRE_FALSE(l.ok());
  CHECK(l.status().message().find("cuda: attention: dtype f64 is not supported") != std::string::npos);
  auto wide = parse_graph(R"(graph @g(%q: f32[1, 1, 4, 512]) -> (f32[1, 1, 4, 512]) {
  %a = attention(%q, %q, %q) {scale = 1.0} : f32[1, 1, 4, 512]
  return %a
})");
  REQUIRE(wide.ok());
  l = lower_graph(**wide);
  REQUIRE_FALSE(l.ok());
  CHECK(l.status().message().find("cuda: attention: head dims 512/512 (the CUDA-core path takes up to 256; "
                                  "the tensor-core path 64 and 128)") != std::string::npos);
}

}  // namespace
}  // namespace kiln::cuda
