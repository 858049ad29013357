// 1x1 convs lowered to strided-batched cuBLASLt GEMMs (conv_1x1.cpp): the bias as a shared C
// plane, the bias kernel when a residual comes too, a residual as C, relu as the epilogue; which
// convs take the path and which stay cuDNN steps.
#include <doctest/doctest.h>

#include "conv_1x1_graphs.h"
#include "conv_depthwise_graphs.h"
#include "kiln/cuda/lowering.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string lowered_case(int i, const char* t) { return test::replace_all(test::k1x1Cases[i][1], "T[", std::string(t) + "["); }

TEST_CASE("a 1x1 conv with a constant bias and a relu is one gemm step: C is the bias plane, shared by the images") {
  const LoweredGraph l = lower_text(lowered_case(0, "f32"), {.allow_tf32_conv = true});
  CHECK(l.kernels.empty());
  const auto st = steps(l.plan);
  REQUIRE(st.size() == 1);
  // W [16, 24] @ x[n] [24, 90] over 3 images; C is a [16, 90] weight read by every image.
  CHECK(st[0] == "step gemm a=b1 b=b0 d=b3 c=b4 ldc=90 stride_c=0 m=16 n=90 k=24 batch=3 trans_a=0 trans_b=0 lda=24 "
                 "ldb=90 ldd=90 stride_a=0 stride_b=2160 stride_d=1440 dtype=f32 compute=tf32 alpha=1 beta=1 "
                 "epilogue=relu");
  CHECK(has(plan_lines(l.plan, "buffer 4")[0], "kind=weight dtype=f32 shape=16x90 bytes=5760 "));
  CHECK(has(plan_lines(l.plan, "buffer 3")[0], "kind=output dtype=f32 shape=3x16x10x9"));
}

TEST_CASE("bias + residual: one kernel writes z + bias into y and the gemm accumulates onto it; a residual alone is C") {
  const LoweredGraph l = lower_text(lowered_case(1, "bf16"));
  CHECK(l.kernels == std::vector<std::string>{"k0_conv_bias"});
  const auto st = steps(l.plan);
  REQUIRE(st.size() == 2);
  CHECK(st[0] == "step launch kernel=k0_conv_bias grid=13,1,1 block=256,1,1 smem=0 args=b2,b3,b4");
  CHECK(has(l.source, "y[i] = __float2bfloat16_rn(__bfloat162float(b[(i / 49LL) % 32LL]) + __bfloat162float(z[i]));"));
  CHECK(st[1] == "step gemm a=b1 b=b0 d=b4 m=32 n=49 k=16 batch=2 trans_a=0 trans_b=0 lda=16 ldb=49 ldd=49 stride_a=0 "
                 "stride_b=784 stride_d=1568 dtype=bf16 compute=f32 alpha=1 beta=1 epilogue=relu");
  const LoweredGraph r = lower_text(lowered_case(2, "f16"));
  // The residual is C as it is; the input bias (no weight to build a plane from) goes through the kernel.
  CHECK(r.kernels == std::vector<std::string>{"k0_conv_bias"});
  const auto g = plan_lines(r.plan, "step gemm");
  REQUIRE(g.size() == 2);
  CHECK(has(g[0], " c=b2 ldc=30 m=12 n=30 k=8 batch=2 "));
  CHECK(has(g[0], " beta=1 epilogue=none"));
  CHECK(has(g[1], " m=12 n=30 k=8 batch=2 "));
  CHECK(has(g[1], " beta=1 epilogue=none"));
  CHECK(!has(g[1], " c="));
  compiles_everywhere(l);
  compiles_everywhere(r);
}

TEST_CASE("the GPU test's 1x1 graphs take gemm steps for every dtype, no conv step") {
  for (const char* t : {"f32", "f16", "bf16"})
    for (int i = 0; i < 4; ++i) {
      CAPTURE(i);
      CAPTURE(t);
      const LoweredGraph l = lower_text(lowered_case(i, t));
      CHECK(plan_lines(l.plan, "step conv").empty());
      CHECK(!plan_lines(l.plan, "step gemm").empty());
      for (const std::string& k : l.kernels) CHECK(has(k, "_conv_bias"));
      compiles_everywhere(l);
    }
}

TEST_CASE("what stays a cuDNN step: strides, padding, groups, larger kernels, option conv1x1=cudnn") {
  const char* text = R"(
graph @g(%x: f32[2, 8, 8, 8], %w: f32[8, 8, 1, 1], %g: f32[8, 4, 1, 1], %k: f32[8, 8, 3, 3]) -> (f32[2, 8, 4, 4], f32[2, 8, 10, 10], f32[2, 8, 8, 8], f32[2, 8, 6, 6], f32[2, 8, 8, 8]) {
  %a = conv(%x, %w) {strides = [2, 2]} : f32[2, 8, 4, 4]
  %b = conv(%x, %w) {pads = [1, 1, 1, 1]} : f32[2, 8, 10, 10]
  %c = conv(%x, %g) {groups = 2} : f32[2, 8, 8, 8]
  %d = conv(%x, %k) : f32[2, 8, 6, 6]
  %e = conv(%x, %w) : f32[2, 8, 8, 8]
  return %a, %b, %c, %d, %e
})";
  const LoweredGraph l = lower_text(text);
  CHECK(plan_lines(l.plan, "step conv").size() == 4);
  CHECK(plan_lines(l.plan, "step gemm").size() == 1);
  const LoweredGraph c = lower_text(text, {.conv1x1 = "cudnn"});
  CHECK(plan_lines(c.plan, "step conv").size() == 5);
  CHECK(plan_lines(c.plan, "step gemm").empty());
}

}  // namespace
}  // namespace kiln::cuda
