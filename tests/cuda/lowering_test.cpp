// Tests of the CUDA lowering: plan text, memory plan, GEMM steps, fusion and diagnostics.
#include <doctest/doctest.h>

#include <cstring>
#include <sstream>

#include "kiln/core/options.h"
#include "kiln/cuda/backend.h"
#include "kiln/cuda/lowering.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

Status lower_error(const std::string& text) {
  auto g = parse_graph(text);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto l = lower_graph(**g);
  REQUIRE(!l.ok());
  return l.status();
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST_CASE("linear + relu: buffers, inputs, outputs and one gemm step with the relu as its epilogue") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[4, 8], %w: f32[16, 8], %b: f32[16]) -> (f32[4, 16]) {
  %h = linear(%x, %w, %b) : f32[4, 16]
  %y = relu(%h) : f32[4, 16]
  return %y
})");
  const std::string expected =
      "kiln-plan 1\n"
      "arena bytes=1280\n"
      "workspace bytes=33554432\n"
      "buffer 0 kind=input dtype=f32 shape=4x8 bytes=128 offset=0 name=x\n"
      "buffer 1 kind=input dtype=f32 shape=16x8 bytes=512 offset=256 name=w\n"
      "buffer 2 kind=input dtype=f32 shape=16 bytes=64 offset=768 name=b\n"
      // The gemm writes y itself (named after the relu), while the inputs are live.
      "buffer 3 kind=output dtype=f32 shape=4x16 bytes=256 offset=1024 name=y\n"
      "input x buffer=0\ninput w buffer=1\ninput b buffer=2\noutput y buffer=3\n"
      "step gemm a=b0 b=b1 d=b3 bias=b2 m=4 n=16 k=8 batch=1 trans_a=0 trans_b=1 lda=8 ldb=8 ldd=16 "
      "stride_a=32 stride_b=0 stride_d=64 dtype=f32 compute=f32 alpha=1 beta=0 epilogue=bias_relu\n";
  CHECK(l.plan == expected);
  CHECK(count(l.source, "__global__") == 0);
  CHECK(l.kernels.empty());
}

TEST_CASE("gemm epilogues: tanh gelu and relu fuse, exact gelu and shared results do not") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: bf16[4, 8], %w: bf16[16, 8], %b: bf16[16], %v: bf16[16, 8]) -> (bf16[4, 16], bf16[4, 8], bf16[4, 16]) {
  %h = linear(%x, %w, %b) : bf16[4, 16]
  %y = gelu(%h) {approximate = "tanh"} : bf16[4, 16]
  %m = matmul(%y, %v) : bf16[4, 8]
  %r = relu(%m) : bf16[4, 8]
  %e = linear(%x, %w) : bf16[4, 16]
  %eg = gelu(%e) : bf16[4, 16]
  return %y, %r, %eg
})");
  const auto g = plan_lines(l.plan, "step gemm");
  REQUIRE(g.size() == 3);
  CHECK(g[0].find("bias=b2 ") != std::string::npos);
  CHECK(g[0].find(" epilogue=bias_gelu") != std::string::npos);
  CHECK(g[1].find(" epilogue=relu") != std::string::npos);
  CHECK(g[2].find(" epilogue=none") != std::string::npos);
  // Exact (erf) gelu stays a kernel of its own: cuBLASLt's GELU is the tanh form.
  CHECK(l.kernels == std::vector<std::string>{"k0_gelu"});
  CHECK(plan_lines(l.plan, "output y")[0] == "output y buffer=4");
  CHECK(g[0].find(" d=b4 ") != std::string::npos);

  // A result with a second use (here a graph output) keeps its own relu kernel.
  const LoweredGraph s = lower_text(R"(
graph @g(%x: f32[4, 8], %w: f32[16, 8]) -> (f32[4, 16], f32[4, 16]) {
  %h = linear(%x, %w) : f32[4, 16]
  %y = relu(%h) : f32[4, 16]
  return %h, %y
})");
  CHECK(plan_lines(s.plan, "step gemm")[0].find(" epilogue=none") != std::string::npos);
  CHECK(s.kernels == std::vector<std::string>{"k0_relu"});
}

TEST_CASE("conv: im2col, a bias broadcast and one batched gemm per group, relu as the epilogue") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[2, 4, 8, 8], %w: f32[6, 2, 3, 3], %b: f32[6]) -> (f32[2, 6, 3, 3]) {
  %c = conv(%x, %w, %b) {groups = 2, strides = [2, 2], pads = [1, 1, 0, 1], dilations = [2, 2]} : f32[2, 6, 3, 3]
  %y = relu(%c) : f32[2, 6, 3, 3]
  return %y
})", {.conv = "gemm"});
  // Output dims: (8 + 1 + 0 - (2 * 2 + 1)) / 2 + 1 = 3 and (8 + 1 + 1 - 5) / 2 + 1 = 3; K = 2 * 9 = 18 rows per group, P = 9.
  CHECK(l.kernels == std::vector<std::string>{"k0_im2col", "k1_conv_bias"});
  const auto launches = plan_lines(l.plan, "step launch");
  REQUIRE(launches.size() == 2);
  // col is [2, 36, 9]: 648 elements.
  CHECK(launches[0] == "step launch kernel=k0_im2col grid=3,1,1 block=256,1,1 smem=0 args=b0,b4");
  CHECK(launches[1] == "step launch kernel=k1_conv_bias grid=1,1,1 block=256,1,1 smem=0 args=b2,b3");
  CHECK(plan_lines(l.plan, "buffer 3")[0] == "buffer 3 kind=output dtype=f32 shape=2x6x3x3 bytes=432 offset=0 name=y");
  CHECK(plan_lines(l.plan, "buffer 4")[0].find("buffer 4 kind=activation dtype=f32 shape=2x36x9 bytes=2592 ") == 0);
  // Group 1 views: W rows 3.. (3 * 18 floats in), col rows 18.. and y channels 3.. of sample 0.
  CHECK(plan_lines(l.plan, "buffer 8")[0] == "buffer 8 kind=alias dtype=f32 shape=54 bytes=216 offset=216 base=1");
  CHECK(plan_lines(l.plan, "buffer 9")[0] == "buffer 9 kind=alias dtype=f32 shape=486 bytes=1944 offset=648 base=4");
  CHECK(plan_lines(l.plan, "buffer 10")[0] == "buffer 10 kind=alias dtype=f32 shape=81 bytes=324 offset=108 base=3");
  const auto g = plan_lines(l.plan, "step gemm");
  REQUIRE(g.size() == 2);
  CHECK(g[1] ==
        "step gemm a=b8 b=b9 d=b10 m=3 n=9 k=18 batch=2 trans_a=0 trans_b=0 lda=18 ldb=9 ldd=9 stride_a=0 "
        "stride_b=324 stride_d=54 dtype=f32 compute=f32 alpha=1 beta=1 epilogue=relu");
  // The im2col index math: stride 2, pad 1 begin, dilation 2.
  CHECK(l.source.find("const long long p0 = o0 * 2LL - 1LL + k0 * 2LL;") != std::string::npos);
  // x, w, b take 2048 + 256-aligned 512 + 256 bytes and col 2816 more; y reuses x's space once
  // im2col has read it.
  CHECK(plan_lines(l.plan, "arena")[0] == "arena bytes=5632");
}

TEST_CASE("conv: 1x1 reads x as its columns; 1-D and bf16 convs use gemms, 3-D convs the direct kernel") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: bf16[2, 4, 5, 5], %w: bf16[8, 4, 1, 1], %s: bf16[2, 4, 10], %v: bf16[3, 4, 3], %t: f32[1, 2, 4, 4, 4], %u: f32[3, 2, 2, 2, 2]) -> (bf16[2, 8, 5, 5], bf16[2, 3, 8], f32[1, 3, 3, 3, 3]) {
  %c = conv(%x, %w) : bf16[2, 8, 5, 5]
  %d = conv(%s, %v) : bf16[2, 3, 8]
  %e = conv(%t, %u) : f32[1, 3, 3, 3, 3]
  return %c, %d, %e
})", {.conv = "gemm"});
  CHECK(l.kernels == std::vector<std::string>{"k0_im2col", "k1_conv"});
  const auto g = plan_lines(l.plan, "step gemm");
  REQUIRE(g.size() == 2);
  CHECK(g[0] ==
        "step gemm a=b1 b=b0 d=b6 m=8 n=25 k=4 batch=2 trans_a=0 trans_b=0 lda=4 ldb=25 ldd=25 stride_a=0 "
        "stride_b=100 stride_d=200 dtype=bf16 compute=f32 alpha=1 beta=0 epilogue=none");
  CHECK(g[1].find("m=3 n=8 k=12 batch=2 ") != std::string::npos);
  CHECK(g[1].find("stride_b=96 stride_d=24 dtype=bf16 compute=f32 alpha=1 beta=0 epilogue=none") != std::string::npos);
}

TEST_CASE("allow-tf32 switches f32 gemms to tf32 compute") {
  LoweringOptions o;
  o.allow_tf32 = true;
  const LoweredGraph l = lower_text(R"(
graph @g(%a: f32[2, 3], %b: f32[3, 5]) -> (f32[2, 5]) {
  %y = matmul(%a, %b) : f32[2, 5]
  return %y
})", o);
  CHECK(l.plan.find("compute=tf32") != std::string::npos);
}

TEST_CASE("tf32 for matmuls and for convolutions are separate options, as PyTorch's flags are") {
  const char* text = R"(
graph @g(%a: f32[2, 3], %b: f32[3, 5], %x: f32[1, 4, 8, 8], %w: f32[6, 4, 3, 3]) -> (f32[2, 5], f32[1, 6, 8, 8]) {
  %y = matmul(%a, %b) : f32[2, 5]
  %c = conv(%x, %w) {pads = [1, 1, 1, 1]} : f32[1, 6, 8, 8]
  return %y, %c
})";
  Capabilities caps;
  caps.plugin = "cuda-test";
  caps.targets = {"sm_90a"};
  Registry reg;
  REQUIRE(register_backend(reg, caps).ok());
  const BackendInfo* info = *reg.backend("cuda-test");
  auto math = [&](const std::map<std::string, OptionValue>& given) {
    auto opts = resolve_options(info->options, given, "cuda-test");
    REQUIRE_MESSAGE(opts.ok(), opts.status().message());
    const LoweredGraph l = lower_text(text, lowering_options(caps, *opts));
    const std::string gemm = plan_lines(l.plan, "step gemm").at(0), conv = plan_lines(l.plan, "step conv").at(0);
    return std::string(gemm.find("compute=tf32") != std::string::npos ? "tf32" : "f32") + "/" +
           (conv.find("math=tf32") != std::string::npos ? "tf32" : "f32");
  };
  CHECK(math({}) == "f32/f32");
  CHECK(math({{"allow-tf32-matmul", true}}) == "tf32/f32");
  CHECK(math({{"allow-tf32-conv", true}}) == "f32/tf32");  // PyTorch's defaults
  CHECK(math({{"allow-tf32", true}}) == "tf32/tf32");
}

TEST_CASE("matmul: shared B folds the batch into M, broadcast A by stride 0, materialized partial broadcast") {
  const LoweredGraph l = lower_text(R"(
graph @g(%a: f16[2, 3, 4, 5], %b: f16[5, 6]) -> (f16[2, 3, 4, 6]) {
  %y = matmul(%a, %b) : f16[2, 3, 4, 6]
  return %y
})");
  const auto steps = plan_lines(l.plan, "step gemm");
  REQUIRE(steps.size() == 1);
  CHECK(steps[0] ==
        "step gemm a=b0 b=b1 d=b2 m=24 n=6 k=5 batch=1 trans_a=0 trans_b=0 lda=5 ldb=6 ldd=6 stride_a=20 "
        "stride_b=0 stride_d=24 dtype=f16 compute=f32 alpha=1 beta=0 epilogue=none");

  // A shared by every batch of B cannot fold (B's batches are different columns): stride 0.
  const LoweredGraph s = lower_text(R"(
graph @g(%a: f16[4, 5], %b: f16[3, 5, 6]) -> (f16[3, 4, 6]) {
  %y = matmul(%a, %b) : f16[3, 4, 6]
  return %y
})");
  const auto sg = plan_lines(s.plan, "step gemm");
  REQUIRE(sg.size() == 1);
  CHECK(sg[0].find(" m=4 n=6 k=5 batch=3 ") != std::string::npos);
  CHECK(sg[0].find(" stride_a=0 stride_b=30 stride_d=24 ") != std::string::npos);

  // [2, 1] batch against [1, 3]: cuBLASLt has one stride per operand, so both are expanded.
  const LoweredGraph p = lower_text(R"(
graph @g(%a: bf16[2, 1, 4, 5], %b: bf16[1, 3, 5, 6]) -> (bf16[2, 3, 4, 6]) {
  %y = matmul(%a, %b) : bf16[2, 3, 4, 6]
  return %y
})");
  CHECK(plan_lines(p.plan, "step launch").size() == 2);
  const auto g = plan_lines(p.plan, "step gemm");
  REQUIRE(g.size() == 1);
  CHECK(g[0].find("batch=6") != std::string::npos);
  CHECK(g[0].find("stride_a=20 stride_b=30") != std::string::npos);
  CHECK(g[0].find("dtype=bf16") != std::string::npos);
}

TEST_CASE("memory plan: a chain of four ops fits in two arena slots") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[1024]) -> (f32[1024]) {
  %a = exp(%x) : f32[1024]
  %b = neg(%a) : f32[1024]
  %c = tanh(%b) : f32[1024]
  %d = abs(%c) : f32[1024]
  return %d
})");
  CHECK(plan_lines(l.plan, "arena")[0] == "arena bytes=8192");
  CHECK(plan_lines(l.plan, "buffer 4")[0] ==
        "buffer 4 kind=output dtype=f32 shape=1024 bytes=4096 offset=0 name=d");
  CHECK(plan_lines(l.plan, "step launch").size() == 4);
}

TEST_CASE("views alias their base; an output that is a view or an input is copied") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[2, 3]) -> (f32[6], f32[2, 3]) {
  %e = exp(%x) : f32[2, 3]
  %f = reshape(%e) {shape = [6]} : f32[6]
  return %f, %x
})");
  CHECK(plan_lines(l.plan, "buffer 2")[0] ==
        "buffer 2 kind=alias dtype=f32 shape=6 bytes=24 offset=0 base=1 name=f");
  const auto copies = plan_lines(l.plan, "step copy");
  REQUIRE(copies.size() == 2);
  CHECK(copies[0] == "step copy src=b2 dst=b3 bytes=24");
  CHECK(copies[1] == "step copy src=b0 dst=b4 bytes=24");
  CHECK(plan_lines(l.plan, "output")[1] == "output x buffer=4");
}

TEST_CASE("constants go to the weights section, 256-byte aligned; all-constant ops fold; unread ones are left out") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[3]) -> (f32[3]) {
  %c = constant() {value = dense<f32[3]>[1, 2, 3]} : f32[3]
  %d = constant() {value = dense<f32[]>[4]} : f32[]
  %r = rsqrt(%d) : f32[]
  %s = add(%x, %c) : f32[3]
  %y = mul(%s, %r) : f32[3]
  return %y
})");
  CHECK(plan_lines(l.plan, "buffer 1")[0] == "buffer 1 kind=weight dtype=f32 shape=3 bytes=12 offset=0 name=c");
  // d is read only by the fold: empty in the plan, left out of the section.
  CHECK(plan_lines(l.plan, "buffer 2")[0] == "buffer 2 kind=weight dtype=f32 shape=0 bytes=0 offset=0 name=d");
  CHECK(plan_lines(l.plan, "buffer 3")[0] == "buffer 3 kind=weight dtype=f32 shape=scalar bytes=4 offset=256 name=r");
  REQUIRE(l.weights.size() == 260);
  float r = 0;
  std::memcpy(&r, l.weights.data() + 256, 4);
  CHECK(r == doctest::Approx(0.5));
  CHECK(plan_lines(l.plan, "step launch").size() == 2);
}

TEST_CASE("a fused elementwise group becomes exactly one kernel") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[8, 16], %b: f32[16]) -> (f32[8, 16]) {
  %y = fused(%x, %b) : f32[8, 16] {
    graph @body(%a: f32[8, 16], %c: f32[16]) -> (f32[8, 16]) {
      %two = constant() {value = dense<f32[]>[2]} : f32[]
      %s = add(%a, %c) : f32[8, 16]
      %m = mul(%s, %two) : f32[8, 16]
      %t = tanh(%m) : f32[8, 16]
      %g = gelu(%t) {approximate = "tanh"} : f32[8, 16]
      return %g
    }
  }
  return %y
})");
  CHECK(plan_lines(l.plan, "step launch").size() == 1);
  CHECK(plan_lines(l.plan, "kernel").size() == 1);
  CHECK(count(l.source, "__global__") == 1);
  CHECK(l.kernels[0] == "k0_fused");
  // The bias is read through broadcast index math (stride 0 on dim 0).
  CHECK(l.source.find("o1 += c_ * 1LL") != std::string::npos);
}

TEST_CASE("a fused group holding a row reduction is one row kernel (fused_rows_test.cpp has more)") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[4, 8]) -> (f32[4, 8]) {
  %y = fused(%x) : f32[4, 8] {
    graph @body(%a: f32[4, 8]) -> (f32[4, 8]) {
      %e = exp(%a) : f32[4, 8]
      %s = softmax(%e) {axis = -1} : f32[4, 8]
      return %s
    }
  }
  return %y
})");
  CHECK(l.kernels == std::vector<std::string>{"k0_fused_softmax"});
}

TEST_CASE("errors: symbolic dims, unsupported dtypes and ops name what is at fault") {
  Status s = lower_error(R"(
graph @g(%x: f32[B, 4]) -> (f32[B, 4]) {
  %y = exp(%x) : f32[B, 4]
  return %y
})");
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message() ==
        "cuda: value %x has symbolic dim 0 ('B'); artifacts need static shapes (bind it with --sym B=N)");

  s = lower_error(R"(
graph @g(%a: i64[2, 3], %b: i64[3, 2]) -> (i64[2, 2]) {
  %y = matmul(%a, %b) : i64[2, 2]
  return %y
})");
  CHECK(s.code() == StatusCode::kUnimplemented);
  CHECK(s.message().find("cuda: matmul: dtype i64 is not supported") != std::string::npos);

  s = lower_error(R"(
graph @g(%a: f8e4m3fn[4], %b: f8e4m3fn[4]) -> (f8e4m3fn[4]) {
  %y = add(%a, %b) : f8e4m3fn[4]
  return %y
})");
  CHECK(s.code() == StatusCode::kUnimplemented);
  CHECK(s.message().find("cuda: add: dtype f8e4m3fn is not supported") != std::string::npos);
}

TEST_CASE("bind_symbols fixes symbolic input dims and re-infers; a missing symbol is named") {
  auto g = parse_graph(R"(
graph @g(%x: f32[B, 4]) -> (f32[B, 4]) {
  %y = exp(%x) : f32[B, 4]
  return %y
})");
  REQUIRE(g.ok());
  Status s = bind_symbols(**g, {});
  CHECK(s.message() == "symbol 'B' of input %x has no size; bind it with --sym B=N");
  REQUIRE(bind_symbols(**g, {{"B", 3}}).ok());
  CHECK((*g)->output(0)->type().str() == "f32[3, 4]");
}

}  // namespace
}  // namespace kiln::cuda

namespace kiln::cuda {
TEST_CASE("scatter_add into zeros clears its output with a memset; the zeros get no buffer") {
  const LoweredGraph l = lower_text(R"(
graph @g(%i: i64[4096], %gy: f32[4096, 768], %d: f32[50257, 768]) -> (f32[50257, 768], f32[50257, 768]) {
  %c = constant() {value = dense<f32[]>[0.0]} : f32[]
  %z = expand(%c) {shape = [50257, 768]} : f32[50257, 768]
  %s = scatter_add(%z, %i, %gy) : f32[50257, 768]
  %t = scatter_add(%d, %i, %gy) : f32[50257, 768]
  return %s, %t
})");
  // %s: a memset and the atomic kernel; %t: a device copy of %d, then the atomic kernel. No expand.
  REQUIRE(l.kernels.size() == 2);
  CHECK(l.plan.find("step memset") != std::string::npos);
  CHECK(l.plan.find("step copy") != std::string::npos);
  CHECK(l.source.find("atomicAdd(&y[dst], u[i])") != std::string::npos);
  CHECK(l.source.find("expand") == std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("few long reductions split across blocks (a global norm's sum of squares)") {
  const LoweredGraph l = lower_text(R"(
graph @g(%w: f32[50257, 768], %x: f32[3, 70000], %y: f32[300, 500]) -> (f32[], f32[3], f32[300]) {
  %s = reduce_sum(%w) {keepdims = 0} : f32[]
  %r = reduce_max(%x) {axes = [1], keepdims = 0} : f32[3]
  %m = reduce_mean(%y) {axes = [1], keepdims = 0} : f32[300]
  return %s, %r, %m
})");
  REQUIRE(l.kernels.size() == 5);
  // One row of 38.6M elements: 528 blocks of f32 partials, then one combining thread; 3 rows of
  // 70000: 17 chunks of at least 4096 each; 300 rows already fill the GPU, a block each.
  CHECK(l.plan.find("kernel=" + l.kernels[0] + " grid=528,1,1") != std::string::npos);
  CHECK(l.source.find("#pragma unroll 4") != std::string::npos);
  CHECK(l.plan.find("kernel=" + l.kernels[1] + " grid=1,1,1") != std::string::npos);
  CHECK(l.plan.find("kernel=" + l.kernels[2] + " grid=51,1,1") != std::string::npos);
  CHECK(l.plan.find("kernel=" + l.kernels[4] + " grid=300,1,1") != std::string::npos);
  CHECK(l.source.find("float* __restrict__ partial") != std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("a reduction over middle dims reads along the kept trailing dims (channels-last pools)") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[16, 56, 56, 96], %y: f32[4, 300]) -> (f32[16, 96], f32[1, 300]) {
  %m = reduce_mean(%x) {axes = [1, 2], keepdims = 0} : f32[16, 96]
  %n = reduce_max(%y) {axes = [0]} : f32[1, 300]
  return %m, %n
})");
  REQUIRE(l.kernels.size() == 3);
  // 16 images x 3 tiles of 32 channels = 48 blocks would leave most SMs idle: the 3136 rows
  // split 5 ways (240 blocks) into f32 partials, which a second kernel combines (1536 outputs);
  // a 4-row max takes a thread per output (300 threads).
  CHECK(l.plan.find("kernel=" + l.kernels[0] + " grid=240,1,1") != std::string::npos);
  CHECK(l.source.find("part[wrp][lane]") != std::string::npos);
  CHECK(l.plan.find("kernel=" + l.kernels[1] + " grid=6,1,1") != std::string::npos);
  CHECK(l.source.find("float* __restrict__ partial") != std::string::npos);
  CHECK(l.plan.find("kernel=" + l.kernels[2] + " grid=2,1,1") != std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("a reduction over interleaved dims with a kept last dim reads along it (RoPE's table gradient)") {
  const LoweredGraph l = lower_text(R"(
graph @g(%dy: f32[8, 512, 32, 128], %r: f32[8, 512, 32, 128]) -> (f32[1, 512, 1, 128]) {
  %p = mul(%dy, %r) : f32[8, 512, 32, 128]
  %g = reduce_sum(%p) {axes = [0, 2], keepdims = 1} : f32[1, 512, 1, 128]
  return %g
})");
  INFO(l.source);
  REQUIRE(l.kernels.size() == 1);
  // 512 positions x 4 tiles of 32 lanes, each warp reading 32 neighbouring floats of a head,
  // not 65536 blocks each gathering 256 floats 512 bytes apart.
  CHECK(l.plan.find("kernel=" + l.kernels[0] + " grid=2048,1,1") != std::string::npos);
  CHECK(l.source.find("part[wrp][lane]") != std::string::npos);
  CHECK(l.source.find("p0[base + off + i] * p1[base + off + i]") != std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("short reductions take a thread per output (a GQA key gradient summed over its repeat dim)") {
  const LoweredGraph l = lower_text(R"(
graph @g(%k: bf16[8, 8, 4, 512, 128], %x: f32[1000, 7]) -> (bf16[8, 8, 512, 128], f32[1000]) {
  %g = reduce_sum(%k) {axes = [2], keepdims = 0} : bf16[8, 8, 512, 128]
  %m = reduce_mean(%x) {axes = [1], keepdims = 0} : f32[1000]
  return %g, %m
})");
  REQUIRE(l.kernels.size() == 2);
  // 4.2M outputs of 4 elements each: 16384 blocks of 256 threads, each thread summing 4 elements
  // 65536 apart (neighbouring threads read neighbouring elements), not 4.2M block reductions.
  CHECK(l.plan.find("kernel=" + l.kernels[0] + " grid=16384,1,1") != std::string::npos);
  CHECK(l.plan.find("kernel=" + l.kernels[1] + " grid=4,1,1") != std::string::npos);
  CHECK(l.source.find("kiln_block_reduce(acc") == std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("an elementwise node only a reduction reads is computed on the reduction's loads (a sum of squares)") {
  const LoweredGraph l = lower_text(R"(
graph @g(%w: f32[4096, 1024], %h: bf16[300, 7], %x: f32[8, 64, 96], %s: f32[]) -> (f32[], bf16[300], f32[8, 96], f32[8, 64, 96]) {
  %sq = mul(%w, %w) : f32[4096, 1024]
  %n = reduce_sum(%sq) {keepdims = 0} : f32[]
  %a = abs(%h) : bf16[300, 7]
  %m = reduce_max(%a) {axes = [1], keepdims = 0} : bf16[300]
  %xs = mul(%x, %s) : f32[8, 64, 96]
  %p = reduce_mean(%xs) {axes = [1], keepdims = 0} : f32[8, 96]
  %e = exp(%x) : f32[8, 64, 96]
  %q = reduce_sum(%e) {axes = [1], keepdims = 0} : f32[8, 96]
  return %n, %m, %p, %e
}
)");
  INFO(l.source);
  // The square, the abs and the scaling have no kernels and no buffers of their own; exp, also
  // an output, keeps its kernel and %q reads its result.
  for (const std::string& k : l.kernels) {
    CAPTURE(k);
    CHECK(k.find("_mul") == std::string::npos);
    CHECK(k.find("_abs") == std::string::npos);
  }
  CHECK(count(l.plan, "_exp ") == 1);
  CHECK(l.source.find("(p0[base + off] * p1[base + off])") != std::string::npos);
  CHECK(l.source.find("fabsf(__bfloat162float(p0[base + off]))") != std::string::npos);
  CHECK(l.source.find("p1[0]") != std::string::npos);
  CHECK(l.plan.find("name=sq") == std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("a fused pointwise node only a reduction reads is computed on its loads (a bf16 gradient's sum of squares)") {
  const LoweredGraph l = lower_text(R"(
graph @g(%g16: bf16[4096, 1024], %h: f32[300, 7]) -> (f32[], f32[300]) {
  %sq = fused(%g16) : f32[4096, 1024] {
    graph @fused(%a: bf16[4096, 1024]) -> (f32[4096, 1024]) {
      %g = cast(%a) {to = f32} : f32[4096, 1024]
      %q = mul(%g, %g) : f32[4096, 1024]
      return %q
    }
  }
  %n = reduce_sum(%sq) {keepdims = 0} : f32[]
  %ah = fused(%h) : f32[300, 7] {
    graph @fused(%b: f32[300, 7]) -> (f32[300, 7]) {
      %two = constant() {value = dense<f32[]>[2.0]} : f32[]
      %t = mul(%b, %two) : f32[300, 7]
      %u = abs(%t) : f32[300, 7]
      return %u
    }
  }
  %m = reduce_max(%ah) {axes = [1], keepdims = 0} : f32[300]
  return %n, %m
}
)");
  INFO(l.source);
  // No kernel writes the f32 squares or the scaled magnitudes: the reductions read the bf16
  // gradient and h themselves.
  for (const std::string& k : l.kernels) {
    CAPTURE(k);
    CHECK(k.find("fused") == std::string::npos);
  }
  CHECK(l.source.find("const __nv_bfloat16* __restrict__ p0, float* __restrict__ partial") != std::string::npos);
  CHECK(l.source.find("__bfloat162float(p0[base + off])") != std::string::npos);
  CHECK(l.source.find("fabsf(((float)(p0[base + off] * ((float)(2.0f)))))") != std::string::npos);
  CHECK(l.plan.find("shape=4096x1024 bytes=16777216") == std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("cross_entropy and cross_entropy_grad: a row kernel each reading bf16 logits, the loss summed in one block") {
  // autocast's head as decompose-losses leaves it: bf16 logits, an f32 loss, a bf16 gradient.
  const LoweredGraph l = lower_text(R"(
graph @g(%x: bf16[8, 50304], %t: i64[8], %d: f32[]) -> (f32[], bf16[8, 50304]) {
  %c = cross_entropy(%x, %t) {dtype = f32, reduction = "sum"} : f32[]
  %g = cross_entropy_grad(%x, %t, %d) : bf16[8, 50304]
  return %c, %g
})", hopper_lowering());
  CHECK(l.kernels == std::vector<std::string>{"k0_cross_entropy_rows", "k1_cross_entropy_sum", "k2_cross_entropy_grad"});
  const auto ls = launches(l.plan);
  REQUIRE(ls.size() == 3);
  CHECK(ls[0].find("grid=8,1,1") != std::string::npos);
  CHECK(ls[1].find("grid=1,1,1") != std::string::npos);
  CHECK(ls[2].find("grid=8,1,1") != std::string::npos);
  // 16-byte loads of 8 bf16 logits, and 16-byte stores of the gradient; f32 math.
  CHECK(count(l.source, "reinterpret_cast<const uint4*>(x + base)") == 3);  // the loss, the gradient twice
  CHECK(count(l.source, "reinterpret_cast<uint4*>(g + base)") == 1);
  CHECK(count(l.source, "typedef float acc") == 3);
  compiles_everywhere(l);

  // Rows 16-byte loads do not tile, f64 logits (f64 math), an f16 loss gradient.
  const LoweredGraph o = lower_text(R"(
graph @g(%x: f32[2, 3, 1001], %t: i32[2, 3], %y: f64[4, 6], %u: i64[4], %d: f16[]) -> (f32[], f32[2, 3, 1001], f64[], f64[4, 6]) {
  %c = cross_entropy(%x, %t) {ignore_index = 2} : f32[]
  %g = cross_entropy_grad(%x, %t, %d) {ignore_index = 2} : f32[2, 3, 1001]
  %c2 = cross_entropy(%y, %u) : f64[]
  %g2 = cross_entropy_grad(%y, %u, %d) : f64[4, 6]
  return %c, %g, %c2, %g2
})");
  CHECK(count(l.source, "uint4") > 0);
  CHECK(count(o.source, "x[base + j]") == 3);
  CHECK(count(o.source, "typedef double acc") == 3);
  compiles_everywhere(o);
}

TEST_CASE("cross_entropy_with_grad: the loss and the gradient from one read of each row") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: bf16[8, 50304], %t: i64[8], %d: f32[]) -> (f32[], bf16[8, 50304]) {
  %c, %g = cross_entropy_with_grad(%x, %t, %d) {dtype = f32, grad_dtype = bf16} : f32[], bf16[8, 50304]
  return %c, %g
})", hopper_lowering());
  CHECK(l.kernels == std::vector<std::string>{"k0_cross_entropy_with_grad", "k1_cross_entropy_sum"});
  CHECK(count(l.source, "row_loss[row] = is_class") == 1);
  CHECK(count(l.source, "reinterpret_cast<uint4*>(g + base)") == 1);
  compiles_everywhere(l);
}

TEST_CASE("cross_entropy_grad refuses f8 logits by name") {
  const Status s = lower_error(R"(
graph @g(%x: f8e4m3fn[2, 4], %t: i64[2], %d: f32[]) -> (f32[2, 4]) {
  %g = cross_entropy_grad(%x, %t, %d) {dtype = f32} : f32[2, 4]
  return %g
})");
  CHECK(s.message().find("cross_entropy_grad") != std::string::npos);
}

}  // namespace kiln::cuda
