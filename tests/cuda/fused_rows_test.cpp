// Tests of the fused row kernels (fused_rows.cpp): one launch per group, vector widths, thread
// layouts, fallbacks, and NVRTC compilation for every target.
#include <doctest/doctest.h>

#include <sstream>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

std::vector<std::string> launches(const LoweredGraph& l) {
  std::vector<std::string> out;
  std::istringstream in(l.plan);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("step launch", 0) == 0) out.push_back(line);
  return out;
}

// RMSNorm + residual as fuse-rows writes it: h = x + r is a second result.
const char* kRmsResidual = R"(
graph @g(%x: bf16[64, 4096], %r: bf16[64, 4096], %w: bf16[4096]) -> (bf16[64, 4096], bf16[64, 4096]) {
  %y, %h = fused(%x, %r, %w) : bf16[64, 4096], bf16[64, 4096] {
    graph @body(%a: bf16[64, 4096], %b: bf16[64, 4096], %c: bf16[4096]) -> (bf16[64, 4096], bf16[64, 4096]) {
      %h = add(%a, %b) : bf16[64, 4096]
      %y = rms_norm(%h, %c) {epsilon = 1e-5} : bf16[64, 4096]
      return %y, %h
    }
  }
  return %y, %h
})";

TEST_CASE("rms_norm + residual: one launch, a block per row, 16-byte loads and stores") {
  const LoweredGraph l = lower_text(kRmsResidual);
  REQUIRE(l.kernels == std::vector<std::string>{"k0_fused_rms_norm"});
  const auto ls = launches(l);
  REQUIRE(ls.size() == 1);
  // 4096 bf16 = 512 vectors of 8; 256 threads hold two each; one block per row.
  CHECK(ls[0] == "step launch kernel=k0_fused_rms_norm grid=64,1,1 block=256,1,1 smem=0 args=b0,b1,b2,b3,b4");
  CHECK(l.source.find("struct alignas(16) V0 { __nv_bfloat16 v[8]; }") != std::string::npos);
  CHECK(l.source.find("struct alignas(16) W1 { __nv_bfloat16 v[8]; }") != std::string::npos);
  CHECK(l.source.find("__launch_bounds__(256) k0_fused_rms_norm") != std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("short rows share a block, a few lanes each; odd rows fall back to scalar loads") {
  // 48 f32 = 12 vectors of 4: 16 lanes per row, 16 rows per 256-thread block.
  const LoweredGraph s = lower_text(R"(
graph @g(%x: f32[3, 10, 48], %m: f32[3, 1, 48]) -> (f32[3, 10, 48]) {
  %y = fused(%x, %m) : f32[3, 10, 48] {
    graph @body(%a: f32[3, 10, 48], %b: f32[3, 1, 48]) -> (f32[3, 10, 48]) {
      %k = constant() {value = dense<f32[]>[0.125]} : f32[]
      %s = mul(%a, %k) : f32[3, 10, 48]
      %t = add(%s, %b) : f32[3, 10, 48]
      %y = softmax(%t) {axis = -1} : f32[3, 10, 48]
      return %y
    }
  }
  return %y
})");
  REQUIRE(launches(s).size() == 1);
  CHECK(launches(s)[0] == "step launch kernel=k0_fused_softmax grid=2,1,1 block=256,1,1 smem=0 args=b0,b1,b2");
  // The mask broadcasts over dim 1 but is contiguous along the row: vector loads too.
  CHECK(s.source.find("struct alignas(16) V0 { float v[4]; }") != std::string::npos);
  CHECK(s.source.find("struct alignas(16) V1 { float v[4]; }") != std::string::npos);
  compiles_everywhere(s);

  // A [48] scale against rows of [10, 48] strides 0 along dim 1: element-wise index math.
  const LoweredGraph g = lower_text(R"(
graph @g(%x: f32[3, 10, 48], %w: f32[48]) -> (f32[3, 10, 48]) {
  %y = fused(%x, %w) : f32[3, 10, 48] {
    graph @body(%a: f32[3, 10, 48], %b: f32[48]) -> (f32[3, 10, 48]) {
      %y = rms_norm(%a, %b) {axis = 1} : f32[3, 10, 48]
      return %y
    }
  }
  return %y
})");
  CHECK(g.source.find("V1") == std::string::npos);
  CHECK(g.source.find("co += c_ * 1LL") != std::string::npos);
  compiles_everywhere(g);

  const LoweredGraph o = lower_text(R"(
graph @g(%x: f16[5, 7]) -> (f16[5, 7]) {
  %y = fused(%x) : f16[5, 7] {
    graph @body(%a: f16[5, 7]) -> (f16[5, 7]) {
      %y = log_softmax(%a) {axis = 1} : f16[5, 7]
      return %y
    }
  }
  return %y
})");
  CHECK(o.source.find("struct alignas(2) V0 { __half v[1]; }") != std::string::npos);
  CHECK(launches(o).size() == 1);
  compiles_everywhere(o);
}

TEST_CASE("layer_norm + residual with a cast epilogue, and a decomposed rms norm, are one kernel each") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f16[8, 2, 768], %r: f16[8, 2, 768], %w: f16[768], %b: f16[768]) -> (f32[8, 2, 768], f16[8, 2, 768]) {
  %y, %h = fused(%x, %r, %w, %b) : f32[8, 2, 768], f16[8, 2, 768] {
    graph @body(%a: f16[8, 2, 768], %c: f16[8, 2, 768], %d: f16[768], %e: f16[768]) -> (f32[8, 2, 768], f16[8, 2, 768]) {
      %h = add(%a, %c) : f16[8, 2, 768]
      %n = layer_norm(%h, %d, %e) {axis = 2} : f16[8, 2, 768]
      %y = cast(%n) {to = f32} : f32[8, 2, 768]
      return %y, %h
    }
  }
  return %y, %h
})");
  CHECK(l.kernels == std::vector<std::string>{"k0_fused_layer_norm"});
  // f32 output: 4-wide vectors for every row value; 192 vectors over 64 lanes.
  CHECK(launches(l)[0] == "step launch kernel=k0_fused_layer_norm grid=16,1,1 block=64,1,1 smem=0 args=b0,b1,b2,b3,b4,b5");
  compiles_everywhere(l);

  const LoweredGraph d = lower_text(R"(
graph @g(%x: f32[4, 256], %w: f32[256]) -> (f32[4, 256], f32[4, 1]) {
  %y, %ms = fused(%x, %w) : f32[4, 256], f32[4, 1] {
    graph @body(%a: f32[4, 256], %c: f32[256]) -> (f32[4, 256], f32[4, 1]) {
      %two = constant() {value = dense<f32[]>[2]} : f32[]
      %eps = constant() {value = dense<f32[]>[1e-6]} : f32[]
      %sq = pow(%a, %two) : f32[4, 256]
      %ms = reduce_mean(%sq) {axes = [-1]} : f32[4, 1]
      %e = add(%ms, %eps) : f32[4, 1]
      %rs = rsqrt(%e) : f32[4, 1]
      %n = mul(%a, %rs) : f32[4, 256]
      %y = mul(%n, %c) : f32[4, 256]
      return %y, %ms
    }
  }
  return %y, %ms
})");
  CHECK(d.kernels == std::vector<std::string>{"k0_fused_reduce_mean"});
  CHECK(d.source.find("if (live && t_ == 0) out1[row]") != std::string::npos);
  compiles_everywhere(d);
}

TEST_CASE("groups the row kernel cannot hold are lowered node by node") {
  // softmax over a leading axis: not a row of the group's layout.
  const LoweredGraph a = lower_text(R"(
graph @g(%x: f32[4, 8]) -> (f32[4, 8]) {
  %y = fused(%x) : f32[4, 8] {
    graph @body(%a: f32[4, 8]) -> (f32[4, 8]) {
      %e = exp(%a) : f32[4, 8]
      %s = softmax(%e) {axis = 0} : f32[4, 8]
      return %s
    }
  }
  return %y
})");
  CHECK(a.kernels == std::vector<std::string>{"k0_exp", "k1_softmax"});
  // Rows longer than 32 elements per lane at 1024 lanes.
  const LoweredGraph b = lower_text(R"(
graph @g(%x: f32[2, 40000]) -> (f32[2, 40000]) {
  %y = fused(%x) : f32[2, 40000] {
    graph @body(%a: f32[2, 40000]) -> (f32[2, 40000]) {
      %s = softmax(%a) {axis = -1} : f32[2, 40000]
      return %s
    }
  }
  return %y
})");
  CHECK(b.kernels == std::vector<std::string>{"k0_softmax"});
}

}  // namespace
}  // namespace kiln::cuda
