// The register-tiled f32 attention source (attention_f32.cpp): NVRTC for every target, its
// include guard, the head-dim check, and the shared-memory size the launch must request.
#include <doctest/doctest.h>

#include <sstream>
#include <string>
#include <vector>

#include "../../backends/cuda/src/attention_f32.h"
#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

/// A __global__ wrapper named `name` calling kiln_attn_f32_tiled<d, dv, causal, mask?, mt>.
std::string wrapper(const std::string& name, int d, int dv, bool causal, const std::string& mt) {
  const bool has_mask = !mt.empty();
  return "extern \"C\" __global__ void __launch_bounds__(256) " + name +
         "(const float* q, const float* k, const float* v, const " + (has_mask ? mt : "float") +
         "* m, float* y) {\n  kiln_attn_f32_tiled<" + std::to_string(d) + ", " + std::to_string(dv) + ", " +
         (causal ? "true" : "false") + ", " + (has_mask ? "true" : "false") + ", " + (has_mask ? mt : "float") +
         ">(q, k, v, m, y, 12, 4, 77, 99, 0.18f, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 0, 99, 1);\n}\n";
}

TEST_CASE("f32 tiled attention compiles for sm_80, sm_90a and sm_100a with every head dim and mask type") {
  // Appended twice, as when two attention nodes share one source: the guard keeps one copy.
  const std::string base = std::string(detail::f32_attention_source()) + detail::f32_attention_source();
  const std::string gpt2 = wrapper("a64", 64, 64, true, "float");
  // Every variant for the H200's target; GPT-2's shape elsewhere (keeps the suite fast).
  const std::string all = gpt2 + wrapper("a32", 32, 32, true, "double") +
                          wrapper("a128", 128, 128, false, "__nv_bfloat16") + wrapper("a64x32", 64, 32, false, "__half");
  for (const char* target : {"sm_80", "sm_90a", "sm_100a"}) {
    CAPTURE(target);
    auto cubin = compile_cuda(base + (std::string(target) == "sm_90a" ? all : gpt2), target, "attention_f32_test");
    REQUIRE_MESSAGE(cubin.ok(), cubin.status().message());
    CHECK(cubin->substr(0, 4) == "\x7f" "ELF");
  }
}

TEST_CASE("f32 tiled attention rejects head dims it has no layout for") {
  const std::string src = std::string(detail::f32_attention_source()) + wrapper("bad", 64, 96, false, "");
  auto cubin = compile_cuda(src, "sm_90a", "attention_f32_test");
  REQUIRE_FALSE(cubin.ok());
  CHECK(cubin.status().message().find("nvrtc: compiling for sm_90a failed") == 0);
  CHECK(cubin.status().message().find("kiln_attn_f32_tiled: head dims") != std::string::npos);
}

TEST_CASE("f32 tiled attention shared memory: Q, two K and V buffers, P") {
  // Q and K rows are padded by 4 floats, P is [64 keys][64 + 4 rows], V unpadded.
  CHECK(detail::f32_attention_smem_bytes(64, 64) == 4 * (64 * 68 * 3 + 2 * 64 * 64 + 64 * 68));
  CHECK(detail::f32_attention_smem_bytes(64, 64) == 102400);  // two blocks fit an H200 SM (228 KiB)
  CHECK(detail::f32_attention_smem_bytes(128, 128) == 184320);  // under the 227 KiB block limit
  CHECK(detail::f32_attention_smem_bytes(32, 32) == 61440);
  CHECK(detail::kF32AttentionRows == 64);
  CHECK(detail::kF32AttentionThreads == 256);
}

TEST_CASE("f32 attention lowers to the tiled kernel where its head dims, alignment and shared memory allow") {
  // GPT-2's shape (D 64), D 128 with a mask, Dv 32, and Dv 40 (no tiled layout: the generic kernel).
  auto g = parse_graph(R"(
graph @g(%q: f32[2, 12, 100, 64], %q2: f32[1, 4, 77, 128], %m2: f16[77, 130], %k2: f32[1, 2, 130, 128],
         %q3: f32[1, 2, 33, 32], %v4: f32[1, 2, 33, 40]) ->
        (f32[2, 12, 100, 64], f32[1, 4, 77, 128], f32[1, 2, 33, 32], f32[1, 2, 33, 40]) {
  %a1 = attention(%q, %q, %q) {scale = 0.125, causal = 1} : f32[2, 12, 100, 64]
  %a2 = attention(%q2, %k2, %k2, %m2) {scale = 0.088} : f32[1, 4, 77, 128]
  %a3 = attention(%q3, %q3, %q3) {scale = 0.17} : f32[1, 2, 33, 32]
  %a4 = attention(%q3, %q3, %v4) {scale = 0.17} : f32[1, 2, 33, 40]
  return %a1, %a2, %a3, %a4
}
)");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  LoweringOptions hopper;
  hopper.max_smem_per_block = 232448;
  auto l = lower_graph(**g, hopper);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  auto steps = launches(l->plan);
  REQUIRE(steps.size() == 4);
  CHECK(steps[0].find("grid=2,12,2 block=256,1,1 smem=102400") != std::string::npos);
  CHECK(steps[1].find("grid=2,4,1 block=256,1,1 smem=184320") != std::string::npos);
  CHECK(steps[2].find("grid=1,2,1 block=256,1,1 smem=" + std::to_string(detail::f32_attention_smem_bytes(32, 32))) !=
        std::string::npos);
  CHECK(l->source.find("kiln_attn_f32_tiled<64, 64, true, false, float>(q, k, v, (const float*)nullptr, y, 12, 12, "
                       "100, 100, ") != std::string::npos);
  // The mask [77, 130] broadcasts over batch and heads: strides 0, 0, 130, 1 after q, k, v, y's.
  CHECK(l->source.find("kiln_attn_f32_tiled<128, 128, false, true, __half>(q, k, v, mask, y, 4, 2, 77, 130") !=
        std::string::npos);
  CHECK(l->source.find(", 0LL, 0LL, 130LL, 1LL);") != std::string::npos);
  CHECK(l->source.find("kiln_attn_f32_tiled<32, 32, false, false, float>") != std::string::npos);
  CHECK(l->source.find("kiln_attn_generic<float, 32, 40, false, false, float>") != std::string::npos);
  auto cubin = compile_cuda(l->source, "sm_90a", "attention_f32_test");
  REQUIRE_MESSAGE(cubin.ok(), cubin.status().message());

  // An A100 block cannot hold D 128's 180 KiB: that node takes the generic kernel there.
  LoweringOptions ampere;
  ampere.max_smem_per_block = 166912;
  l = lower_graph(**g, ampere);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  CHECK(l->source.find("kiln_attn_f32_tiled<128, 128") == std::string::npos);
  CHECK(l->source.find("kiln_attn_generic<float, 128, 128, false, true, __half>") != std::string::npos);
  CHECK(l->source.find("kiln_attn_f32_tiled<64, 64, true, false, float>") != std::string::npos);
}

}  // namespace
}  // namespace kiln::cuda
