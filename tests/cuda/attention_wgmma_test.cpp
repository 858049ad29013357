// Hopper attention lowering: the warp-specialized wgmma kernel in cuda-sm90 plans (sm_90a image,
// mma.sync elsewhere),
// NVRTC for every target, and the [B, S, H, D] transposes around attention read and written in place.
#include <doctest/doctest.h>

#include <sstream>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

LoweredGraph lower(const std::string& text, const std::string& target) {
  LoweringOptions o;
  o.target = target;
  return lower_text(text, o);
}

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

/// hd 64 and 128, causal and not, bf16 and f16, GQA, a mask and an f32 node (CUDA-core path).
const char* kHopper = R"(
graph @g(%q1: bf16[1, 4, 300, 64], %k1: bf16[1, 2, 300, 64], %q2: f16[2, 2, 130, 128], %k2: f16[2, 2, 200, 128],
         %q3: bf16[1, 2, 77, 128], %m3: f32[77, 77], %q4: f16[1, 1, 40, 64], %q5: f32[1, 2, 33, 64]) ->
        (bf16[1, 4, 300, 64], f16[2, 2, 130, 128], bf16[1, 2, 77, 128], f16[1, 1, 40, 64], f32[1, 2, 33, 64]) {
  %a1 = attention(%q1, %k1, %k1) {scale = 0.125, causal = 1} : bf16[1, 4, 300, 64]
  %a2 = attention(%q2, %k2, %k2) {scale = 0.088} : f16[2, 2, 130, 128]
  %a3 = attention(%q3, %q3, %q3, %m3) {scale = 0.088, causal = 1} : bf16[1, 2, 77, 128]
  %a4 = attention(%q4, %q4, %q4) {scale = 0.125} : f16[1, 1, 40, 64]
  %a5 = attention(%q5, %q5, %q5) {scale = 0.125} : f32[1, 2, 33, 64]
  return %a1, %a2, %a3, %a4, %a5
}
)";

TEST_CASE("attention on cuda-sm90: wgmma kernel for sm_90a, the mma.sync kernel in the same plan elsewhere") {
  const LoweredGraph l = lower(kHopper, "cuda-sm90: target sm_90a");
  const auto steps = launches(l.plan);
  REQUIRE(steps.size() == 5);
  // A producer and 2 consumer warpgroups of 64 rows; Q plus double-buffered K and V tiles of 128
  // keys, +1024 to align the swizzle atoms, +72 for the 9 mbarriers.
  CHECK(steps[0].find("grid=3,4,1 block=384,1,1 smem=" + std::to_string((128 * 64 + 4 * 128 * 64) * 2 + 1024 + 72)) !=
        std::string::npos);
  CHECK(steps[1].find("grid=2,2,2 block=384,1,1 smem=" + std::to_string((128 * 128 + 4 * 128 * 128) * 2 + 1024 + 72)) !=
        std::string::npos);
  // f32 takes the register-tiled CUDA-core kernel: 64 rows per block.
  CHECK(steps[4].find("grid=1,2,1 block=256,1,1 smem=102400") != std::string::npos);
  CHECK(l.source.find("kiln_flash_attn_ws<__nv_bfloat16, 64, 128, true, false, float>") != std::string::npos);
  // Other images run the mma.sync kernel on the first 8 warps.
  CHECK(l.source.find("if (threadIdx.x >= 256) return;\n  kiln_flash_attn<__nv_bfloat16, 64, true, false, float, 1, 8>") !=
        std::string::npos);
  CHECK(l.source.find("kiln_flash_attn_ws<__half, 128, 128, false, false, float>") != std::string::npos);
  CHECK(l.source.find("kiln_flash_attn_ws<__nv_bfloat16, 128, 128, true, true, float>") != std::string::npos);
  // setmaxnreg takes effect only under a register cap at entry.
  CHECK(count(l.source, "__launch_bounds__(384, 1)") == 4);
  CHECK(l.source.find("kiln_attn_f32_tiled<64, 64, false, false, float>") != std::string::npos);
  // One wrapper per (form, width, type): S = Q·Kᵀ at n128, O += P·V at n = head dim.
  CHECK(count(l.source, "void kiln_wgmma_ss<128, __nv_bfloat16>(") == 1);
  CHECK(count(l.source, "void kiln_wgmma_ss<128, __half>(") == 1);
  CHECK(count(l.source, "void kiln_wgmma_rs<64, __nv_bfloat16>(") == 1);
  CHECK(count(l.source, "void kiln_wgmma_rs<128, __nv_bfloat16>(") == 1);
  CHECK(count(l.source, "void kiln_wgmma_rs<64, __half>(") == 1);
  CHECK(count(l.source, "void kiln_wgmma_rs<128, __half>(") == 1);
  for (const char* target : {"sm_90a", "sm_80", "sm_100a"}) {
    CAPTURE(target);
    auto cubin = compile_cuda(l.source, target, "test@0");
    REQUIRE_MESSAGE(cubin.ok(), cubin.status().message());
    CHECK(cubin->substr(0, 4) == "\x7f" "ELF");
  }
  // The sm_90a feature set gets the warpgroup MMA; plain compute_90 PTX only the mma.sync kernel.
  auto ptx_a = compile_cuda(l.source, "compute_90a", "test@0");
  REQUIRE_MESSAGE(ptx_a.ok(), ptx_a.status().message());
  CHECK(ptx_a->find("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") != std::string::npos);
  CHECK(ptx_a->find("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16") != std::string::npos);
  CHECK(ptx_a->find("fence.proxy.async.shared::cta") != std::string::npos);
  CHECK(ptx_a->find("setmaxnreg.inc.sync.aligned.u32 232") != std::string::npos);
  CHECK(ptx_a->find("cp.async.mbarrier.arrive.noinc.shared::cta.b64") != std::string::npos);
  CHECK(ptx_a->find("mbarrier.try_wait.parity.shared::cta.b64") != std::string::npos);
  auto ptx = compile_cuda(l.source, "compute_90", "test@0");
  REQUIRE_MESSAGE(ptx.ok(), ptx.status().message());
  CHECK(ptx->find("wgmma") == std::string::npos);
  CHECK(ptx->find("mma.sync.aligned.m16n8k16") != std::string::npos);
}

TEST_CASE("attention on other generations keeps the 4-warp mma.sync kernel") {
  const LoweredGraph l = lower(kHopper, "cuda-sm80: target sm_80");
  CHECK(l.source.find("kiln_flash_attn_ws") == std::string::npos);
  CHECK(l.source.find("kiln_flash_attn<__half, 128, false, false, float>") != std::string::npos);
  CHECK(launches(l.plan)[1].find("block=128,1,1") != std::string::npos);
}

/// The exporters' layout: q/k/v [B, S, H, D] transposed to [B, H, S, D] (v through Llama's
/// repeat_kv views with one repeat), the result transposed back and reshaped to [B, S, H·D].
/// k's transpose has a second user, so it stays a copy.
const char* kTransposed = R"(
graph @g(%q: bf16[2, 70, 4, 64], %k: bf16[2, 90, 2, 64], %v: bf16[2, 90, 2, 64]) -> (bf16[2, 70, 256], bf16[2, 2, 90, 64]) {
  %qt = transpose(%q) {perm = [0, 2, 1, 3]} : bf16[2, 4, 70, 64]
  %kt = transpose(%k) {perm = [0, 2, 1, 3]} : bf16[2, 2, 90, 64]
  %vt = transpose(%v) {perm = [0, 2, 1, 3]} : bf16[2, 2, 90, 64]
  %v5 = reshape(%vt) {shape = [2, 2, 1, 90, 64]} : bf16[2, 2, 1, 90, 64]
  %v4 = reshape(%v5) {shape = [2, 2, 90, 64]} : bf16[2, 2, 90, 64]
  %a = attention(%qt, %kt, %v4) {scale = 0.125, causal = 1} : bf16[2, 4, 70, 64]
  %at = transpose(%a) {perm = [0, 2, 1, 3]} : bf16[2, 70, 4, 64]
  %y = reshape(%at) {shape = [2, 70, 256]} : bf16[2, 70, 256]
  %k2 = neg(%kt) : bf16[2, 2, 90, 64]
  return %y, %k2
}
)";

TEST_CASE("attention reads [B, S, H, D] operands and writes its result through strides; no transpose copies") {
  for (const char* target : {"cuda-sm90: target sm_90a", "cuda"}) {
    CAPTURE(target);
    const LoweredGraph l = lower(kTransposed, target);
    const auto steps = launches(l.plan);
    // k's transpose (two users), the attention and neg: the q, v and output transposes are gone.
    REQUIRE(steps.size() == 3);
    CHECK(steps[1].find("_attention") != std::string::npos);
    // q: b 70·4·64, h 64, s 4·64; k (copied): contiguous; v: b 90·2·64, h 64, s 128; y: as q.
    CHECK(l.source.find("17920LL, 64LL, 256LL, 11520LL, 5760LL, 64LL, 11520LL, 64LL, 128LL, 17920LL, 64LL, 256LL}") !=
          std::string::npos);
    auto cubin = compile_cuda(l.source, "sm_90a", "test@0");
    REQUIRE_MESSAGE(cubin.ok(), cubin.status().message());
  }
}

}  // namespace
}  // namespace kiln::cuda

namespace kiln::cuda {
namespace {

TEST_CASE("a transpose that is also an output stays a copy; one reaching attention through unit-dim views is read in place") {
  const LoweredGraph l = lower(R"(
graph @g(%q: f16[1, 20, 2, 64]) -> (f16[1, 2, 20, 64], f16[1, 2, 20, 64]) {
  %qt = transpose(%q) {perm = [0, 2, 1, 3]} : f16[1, 2, 20, 64]
  %a = attention(%qt, %qt, %qt) {scale = 0.125} : f16[1, 2, 20, 64]
  %b = transpose(%q) {perm = [0, 2, 1, 3]} : f16[1, 2, 20, 64]
  %c = reshape(%b) {shape = [2, 1, 20, 64]} : f16[2, 1, 20, 64]
  %d = reshape(%c) {shape = [1, 2, 20, 64]} : f16[1, 2, 20, 64]
  %e = attention(%d, %d, %d) {scale = 0.125} : f16[1, 2, 20, 64]
  return %a, %qt
}
)", "cuda-sm90: target sm_90a");
  // %qt is also an output: copied. %b reaches attention through views (unit dims only): folded.
  const auto steps = launches(l.plan);
  REQUIRE(steps.size() == 3);
  CHECK(steps[0].find("_attention") == std::string::npos);
  CHECK(count(l.source, "2560LL, 64LL, 128LL, 2560LL, 64LL, 128LL, 2560LL, 64LL, 128LL, 2560LL, 1280LL, 64LL}") == 1);
}

}  // namespace
}  // namespace kiln::cuda
