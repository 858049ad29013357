// Tests of the small-M GEMV lowering: which GEMMs take it, what it absorbs, and that the
// generated kernels compile for every target.
#include <doctest/doctest.h>

#include <sstream>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

std::vector<std::string> steps(const std::string& plan, const std::string& kind) {
  std::vector<std::string> out;
  std::istringstream in(plan);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("step " + kind, 0) == 0) out.push_back(line);
  return out;
}

/// The batch-1 MLP of the CUDA goal: `layers` x (linear(width) + relu), weights as inputs.
std::string mlp(int layers, int width, int batch, const std::string& dtype) {
  const std::string act = dtype + "[" + std::to_string(batch) + ", " + std::to_string(width) + "]";
  const std::string wt = dtype + "[" + std::to_string(width) + ", " + std::to_string(width) + "]";
  std::string head = "graph @mlp(%x: " + act, body;
  std::string prev = "%x";
  for (int i = 0; i < layers; ++i) {
    const std::string s = std::to_string(i);
    head += ", %w" + s + ": " + wt + ", %b" + s + ": " + dtype + "[" + std::to_string(width) + "]";
    body += "  %h" + s + " = linear(" + prev + ", %w" + s + ", %b" + s + ") : " + act + "\n";
    body += "  %a" + s + " = relu(%h" + s + ") : " + act + "\n";
    prev = "%a" + s;
  }
  return head + ") -> (" + act + ") {\n" + body + "  return " + prev + "\n}\n";
}

TEST_CASE("gemv: the batch-1 MLP lowers to one kernel launch per layer, relu included, no gemm steps") {
  const LoweredGraph l = lower_text(mlp(8, 512, 1, "f32"));
  CHECK(steps(l.plan, "gemm").empty());
  const auto launches = steps(l.plan, "launch");
  REQUIRE(launches.size() == 8);
  CHECK(l.kernels.size() == 8);
  CHECK(l.kernels[0] == "k0_gemv");
  // 512 columns, 4 warps of one column per block: 128 blocks of 128 threads; x, w, b -> y.
  CHECK(launches[0] == "step launch kernel=k0_gemv grid=128,1,1 block=128,1,1 smem=0 args=b0,b1,b2,b17");
  CHECK(l.source.find("v = (v < 0 ? (0.0f) : v);") != std::string::npos);
  CHECK(l.source.find("reinterpret_cast<const uint4*>") != std::string::npos);
  CHECK(l.plan.find("output a7 buffer=") != std::string::npos);
  // No cuBLASLt step, so no workspace.
  CHECK(l.plan.find("workspace bytes=0\n") != std::string::npos);
}

TEST_CASE("gemv: above 16 rows and for tiny weights the gemm step stays") {
  CHECK(steps(lower_text(mlp(1, 512, 16, "f32")).plan, "gemm").empty());
  CHECK(steps(lower_text(mlp(1, 512, 17, "f32")).plan, "gemm").size() == 1);
  CHECK(steps(lower_text(mlp(1, 16, 1, "f32")).plan, "gemm").size() == 1);
  // A large weight that would give too few blocks goes to cuBLASLt's split-K.
  CHECK(steps(lower_text(R"(
graph @g(%x: f32[1, 65536], %w: f32[16, 65536]) -> (f32[1, 16]) {
  %y = linear(%x, %w) : f32[1, 16]
  return %y
})").plan, "gemm").size() == 1);
}

TEST_CASE("gemv: batch dims fold into M; odd K loads scalars; gelu and exact gelu are absorbed") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: bf16[3, 1, 130], %w: bf16[77, 130], %b: bf16[77]) -> (bf16[3, 1, 77]) {
  %h = linear(%x, %w, %b) : bf16[3, 1, 77]
  %y = gelu(%h) : bf16[3, 1, 77]
  return %y
})");
  CHECK(steps(l.plan, "gemm").empty());
  CHECK(l.kernels == std::vector<std::string>{"k0_gemv"});
  CHECK(l.source.find("float acc[1][3];") != std::string::npos);
  CHECK(l.source.find("uint4") == std::string::npos);
  CHECK(l.source.find("erff") != std::string::npos);
}

TEST_CASE("gemv: matmul against a [K, N] weight, with broadcast batch rows; batched weights use cuBLASLt") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f16[2, 3, 128], %w: f16[128, 96], %v: f16[4, 128, 96]) -> (f16[2, 3, 96], f16[4, 1, 96]) {
  %y = matmul(%x, %w) : f16[2, 3, 96]
  %r = relu(%y) : f16[2, 3, 96]
  %s = slice(%x) {starts = [0, 0], ends = [1, 1], axes = [0, 1]} : f16[1, 1, 128]
  %z = matmul(%s, %v) : f16[4, 1, 96]
  return %r, %z
})");
  CHECK(l.kernels[0] == "k0_gemv_kn");
  const auto launches = steps(l.plan, "launch");
  // 96 columns, 8 threads of 4 columns per block: 3 blocks.
  CHECK(launches[0].find("kernel=k0_gemv_kn grid=3,1,1 block=256,1,1 ") != std::string::npos);
  CHECK(l.source.find("float acc[6][4];") != std::string::npos);
  CHECK(l.source.find("uint2") != std::string::npos);
  CHECK(steps(l.plan, "gemm").size() == 1);
}

TEST_CASE("gemv: kernels compile for sm_80, sm_90a and sm_100a in f32, f16 and bf16") {
  for (const char* dt : {"f32", "f16", "bf16"}) {
    CAPTURE(dt);
    const std::string t = dt;
    const LoweredGraph l = lower_text("graph @g(%x: " + t + "[16, 130], %w: " + t + "[77, 130], %b: " + t + "[77], %u: " + t +
                                 "[5, 128], %v: " + t + "[128, 96], %k: " + t + "[77, 128], %q: " + t +
                                 "[130, 77]) -> (" + t + "[16, 77], " + t + "[5, 96], " + t + "[5, 77], " + t +
                                 "[16, 77]) {\n"
                                 "  %h = linear(%x, %w, %b) : " + t + "[16, 77]\n"
                                 "  %y = relu(%h) : " + t + "[16, 77]\n"
                                 "  %m = matmul(%u, %v) : " + t + "[5, 96]\n"
                                 "  %n = linear(%u, %k) : " + t + "[5, 77]\n"
                                 "  %g = gelu(%n) {approximate = \"tanh\"} : " + t + "[5, 77]\n"
                                 "  %o = matmul(%x, %q) : " + t + "[16, 77]\n"
                                 "  return %y, %m, %g, %o\n}\n");
    CHECK(steps(l.plan, "gemm").empty());
    CHECK(l.kernels == std::vector<std::string>{"k0_gemv", "k1_gemv_kn", "k2_gemv", "k3_gemv_kn"});
    compiles_everywhere(l);
  }
}

}  // namespace
}  // namespace kiln::cuda
