// Tests of GEMM epilogue fusion (gemm_epilogue.cpp): bias adds, activations and residual adds
// become fields of the one gemm step instead of kernels of their own.
#include <doctest/doctest.h>

#include <sstream>

#include "kiln/cuda/lowering.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

std::vector<std::string> gemm_steps(const LoweredGraph& l) {
  std::vector<std::string> out;
  std::istringstream in(l.plan);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("step gemm", 0) == 0) out.push_back(line);
  return out;
}

TEST_CASE("a residual add becomes C with beta 1, after the bias; no kernel is left") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: bf16[64, 32], %w: bf16[48, 32], %b: bf16[48], %r: bf16[64, 48]) -> (bf16[64, 48]) {
  %h = linear(%x, %w, %b) : bf16[64, 48]
  %y = add(%r, %h) : bf16[64, 48]
  return %y
})");
  CHECK(l.kernels.empty());
  const auto g = gemm_steps(l);
  REQUIRE(g.size() == 1);
  CHECK(g[0] == "step gemm a=b0 b=b1 d=b4 bias=b2 c=b3 ldc=48 m=64 n=48 k=32 batch=1 trans_a=0 trans_b=1 lda=32 "
               "ldb=32 ldd=48 stride_a=2048 stride_b=0 stride_d=3072 dtype=bf16 compute=f32 alpha=1 beta=1 "
               "epilogue=bias");
}

TEST_CASE("matmul + bias add + relu: the batch folds into M and the adds become the epilogue") {
  const LoweredGraph l = lower_text(R"(
graph @g(%a: f32[2, 3, 8], %w: f32[8, 5], %b: f32[5], %r: f32[2, 3, 5]) -> (f32[2, 3, 5], f32[2, 3, 5]) {
  %m = matmul(%a, %w) : f32[2, 3, 5]
  %s = add(%m, %b) : f32[2, 3, 5]
  %y = relu(%s) : f32[2, 3, 5]
  %n = matmul(%a, %w) : f32[2, 3, 5]
  %z = add(%n, %r) : f32[2, 3, 5]
  return %y, %z
})");
  CHECK(l.kernels.empty());
  const auto g = gemm_steps(l);
  REQUIRE(g.size() == 2);
  CHECK(g[0].find(" bias=b2 m=6 n=5 k=8 batch=1 ") != std::string::npos);
  CHECK(g[0].find(" epilogue=bias_relu") != std::string::npos);
  // Without a bias the batch folds too; the residual C is laid out as D.
  CHECK(g[1].find(" c=b3 ldc=5 m=6 n=5 k=8 batch=1 ") != std::string::npos);
  CHECK(g[1].find(" beta=1 epilogue=none") != std::string::npos);
}

TEST_CASE("a rank-4 matmul over [N, H, W, C] is one GEMM of N*H*W rows, with or without an epilogue") {
  // ConvNeXt's Linear layers act on channels-last activations; a batch of N*H GEMMs of W rows
  // each was several times slower than one GEMM.
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[2, 7, 7, 96], %w: f32[96, 384], %v: f32[384, 96]) -> (f32[2, 7, 7, 384], f32[2, 7, 7, 96]) {
  %h = matmul(%x, %w) : f32[2, 7, 7, 384]
  %g = gelu(%h) : f32[2, 7, 7, 384]
  %y = matmul(%g, %v) : f32[2, 7, 7, 96]
  return %h, %y
})");
  const auto g = gemm_steps(l);
  REQUIRE(g.size() == 2);
  CHECK(g[0].find(" m=98 n=384 k=96 batch=1 ") != std::string::npos);
  CHECK(g[1].find(" m=98 n=96 k=384 batch=1 ") != std::string::npos);
}

TEST_CASE("a 1x1 conv as layout-nhwc leaves it (rank-4 linear, bias, residual, relu) is one GEMM step") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[2, 6, 10, 8], %w: f32[16, 8], %b: f32[16], %r: f32[2, 6, 10, 16]) -> (f32[2, 6, 10, 16]) {
  %l = linear(%x, %w, %b) : f32[2, 6, 10, 16]
  %s = add(%l, %r) : f32[2, 6, 10, 16]
  %y = relu(%s) : f32[2, 6, 10, 16]
  return %y
})");
  const auto g = gemm_steps(l);
  REQUIRE(g.size() == 1);
  CHECK(g[0].find(" m=120 n=16 k=8 batch=1 ") != std::string::npos);
  CHECK(g[0].find(" bias=b2 c=b3 ") != std::string::npos);
  CAPTURE(l.plan);
  CHECK(g[0].find(" beta=1 epilogue=bias") != std::string::npos);
}

TEST_CASE("what stays a kernel: shared results, later residuals, broadcast addends, activations before adds") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[4, 8], %w: f32[6, 8], %r: f32[4, 6], %c: f32[4, 1]) -> (f32[4, 6], f32[4, 6], f32[4, 6], f32[4, 6]) {
  %h = linear(%x, %w) : f32[4, 6]
  %y = add(%h, %r) : f32[4, 6]
  %h2 = linear(%x, %w) : f32[4, 6]
  %t = tanh(%r) : f32[4, 6]
  %y2 = add(%h2, %t) : f32[4, 6]
  %h3 = linear(%x, %w) : f32[4, 6]
  %y3 = add(%h3, %c) : f32[4, 6]
  return %h, %y, %y2, %y3
})");
  // %h is also an output; %t is computed after %h2's gemm; %c broadcasts along rows.
  CHECK(l.kernels == std::vector<std::string>{"k0_add", "k1_tanh", "k2_add", "k3_add"});
  for (const std::string& g : gemm_steps(l)) CHECK(g.find(" beta=0 epilogue=none") != std::string::npos);
}

TEST_CASE("fuse-horizontal's form: one batched gemm with A broadcast, split pieces are views") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: bf16[2, 64, 32], %w: bf16[3, 32, 48]) -> (bf16[2, 64, 48]) {
  %rows = reshape(%x) {shape = [128, 32]} : bf16[128, 32]
  %s = matmul(%rows, %w) : bf16[3, 128, 48]
  %q, %k, %v = split(%s) {axis = 0, sizes = [1, 1, 1]} : bf16[1, 128, 48], bf16[1, 128, 48], bf16[1, 128, 48]
  %qr = reshape(%q) {shape = [2, 64, 48]} : bf16[2, 64, 48]
  %vr = reshape(%v) {shape = [2, 64, 48]} : bf16[2, 64, 48]
  %y = add(%qr, %vr) : bf16[2, 64, 48]
  return %y
})");
  const auto g = gemm_steps(l);
  REQUIRE(g.size() == 1);
  CHECK(g[0].find(" m=128 n=48 k=32 batch=3 ") != std::string::npos);
  CHECK(g[0].find(" stride_a=0 stride_b=1536 stride_d=6144 ") != std::string::npos);
  // Only the add is a kernel; it reads the first and the third slice of the gemm's result.
  CHECK(l.kernels == std::vector<std::string>{"k0_add"});
  CHECK(l.plan.find("kind=alias dtype=bf16 shape=1x128x48 bytes=12288 offset=24576 base=") != std::string::npos);
  CHECK(l.plan.find("kind=alias dtype=bf16 shape=2x64x48 bytes=12288 offset=24576 base=") != std::string::npos);
}

TEST_CASE("transposes of the last two dims read by matmuls become trans_a/trans_b, not copies") {
  const LoweredGraph l = lower_text(R"(
graph @g(%q: f32[2, 80, 16], %k: f32[2, 80, 16], %a: f32[32, 96], %b: f32[96, 24]) -> (f32[2, 80, 80], f32[96, 24], f32[2, 16, 80]) {
  %kt = transpose(%k) {perm = [0, 2, 1]} : f32[2, 16, 80]
  %s = matmul(%q, %kt) : f32[2, 80, 80]
  %at = transpose(%a) : f32[96, 32]
  %b2 = matmul(%at, %a) : f32[96, 96]
  %y = matmul(%b2, %b) : f32[96, 24]
  %k2 = transpose(%k) {perm = [0, 2, 1]} : f32[2, 16, 80]
  return %s, %y, %k2
})");
  const auto g = gemm_steps(l);
  REQUIRE(g.size() == 3);
  CHECK(g[0].find(" trans_a=0 trans_b=1 lda=16 ldb=16 ldd=80 ") != std::string::npos);
  CHECK(g[1].find(" m=96 n=96 k=32 batch=1 trans_a=1 trans_b=0 lda=96 ldb=96 ") != std::string::npos);
  // %k2 is a graph output: it is materialized.
  CHECK(l.kernels == std::vector<std::string>{"k0_transpose"});
}

TEST_CASE("matmul_acc: bf16 products into an f32 sum, one GEMM with beta 1 in the sum's buffer") {
  const LoweredGraph l = lower_text(R"(
graph @g(%g: bf16[96, 40], %x: bf16[96, 24], %s: f32[40, 24]) -> (f32[40, 24]) {
  %gt = transpose(%g) : bf16[40, 96]
  %e = exp(%s) : f32[40, 24]
  %a = matmul_acc(%gt, %x, %e) : f32[40, 24]
  return %a
})");
  CHECK(l.kernels == std::vector<std::string>{"k0_exp"});  // the transpose is read through trans_a
  const auto g = gemm_steps(l);
  REQUIRE(g.size() == 1);
  CHECK(g[0] == "step gemm a=b0 b=b1 d=b3 c=b3 ldc=24 m=40 n=24 k=96 batch=1 trans_a=1 trans_b=0 lda=40 ldb=24 "
               "ldd=24 stride_a=0 stride_b=0 stride_d=0 dtype=f32 a_dtype=bf16 b_dtype=bf16 compute=f32 alpha=1 "
               "beta=1 epilogue=none");
}

TEST_CASE("matmul_acc: a sum read elsewhere, an input or a returned value is not overwritten") {
  const LoweredGraph l = lower_text(R"(
graph @g(%h: f32[16, 24], %y: f32[24, 8], %t: f32[16, 8]) -> (f32[16, 8], f32[16, 8]) {
  %a2 = matmul_acc(%h, %y, %t) : f32[16, 8]
  %a3 = matmul_acc(%h, %y, %a2) : f32[16, 8]
  return %a2, %a3
})");
  const auto g = gemm_steps(l);
  REQUIRE(g.size() == 2);
  CHECK(g[0].find(" d=b3 c=b2 ") != std::string::npos);
  CHECK(g[1].find(" d=b4 c=b3 ") != std::string::npos);
  CHECK(g[1].find(" stride_d=0 dtype=f32 compute=") != std::string::npos);  // no a_dtype: one dtype
  CHECK(g[1].find(" beta=1 epilogue=none") != std::string::npos);
}

}  // namespace
}  // namespace kiln::cuda
