// The register-tiled f32 attention source (attention_f32.cpp): NVRTC for every target, its
// include guard, the head-dim check, and the shared-memory size the launch must request.
#include <doctest/doctest.h>

#include <string>

#include "../../backends/cuda/src/attention_f32.h"
#include "kiln/cuda/nvrtc.h"

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

}  // namespace
}  // namespace kiln::cuda
