// Tests of the matmul_int4 lowering: which kernel each M gets, one launch per node up to M = 64,
// the dequantize + gemm path above, and NVRTC compilation of every variant for every target.
#include <doctest/doctest.h>

#include <sstream>
#include <string>
#include <vector>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"

namespace kiln::cuda {
namespace {

/// A one-node matmul_int4 graph: x dt[m, k], weights [n, k/2], scales st[n, k/g] (zeros when
/// asymmetric), optional bias.
std::string int4_graph(int64_t m, int64_t n, int64_t k, int64_t g, bool asym, const std::string& dt,
                       const std::string& st, bool bias) {
  const std::string M = std::to_string(m), N = std::to_string(n), K = std::to_string(k);
  const std::string sg = st + "[" + N + ", " + std::to_string(k / g) + "]";
  std::string args = "%x: " + dt + "[" + M + ", " + K + "], %w: u8[" + N + ", " + std::to_string(k / 2) + "], %s: " + sg;
  std::string ops = "%x, %w, %s";
  if (asym) args += ", %z: " + sg, ops += ", %z";
  if (bias) args += ", %b: " + dt + "[" + N + "]", ops += ", %b";
  const std::string yt = dt + "[" + M + ", " + N + "]";
  return "graph @g(" + args + ") -> (" + yt + ") {\n  %y = matmul_int4(" + ops + ") {group_size = " + std::to_string(g) +
         (asym ? ", asymmetric = 1" : "") + "} : " + yt + "\n  return %y\n}\n";
}

LoweredGraph lower(const std::string& text) {
  auto g = parse_graph(text);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto l = lower_graph(**g);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  return *l;
}

std::vector<std::string> steps(const std::string& plan) {
  std::vector<std::string> out;
  std::istringstream in(plan);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("step ", 0) == 0) out.push_back(line);
  return out;
}

TEST_CASE("matmul_int4: GEMV up to M = 8, mma up to M = 64 (one launch each), dequantize + gemm above") {
  struct Want {
    int64_t m;
    const char* kernel;
  };
  for (const Want& w : {Want{1, "matmul_int4_gemv"}, Want{8, "matmul_int4_gemv"}, Want{9, "matmul_int4_mma"},
                        Want{64, "matmul_int4_mma"}}) {
    CAPTURE(w.m);
    const LoweredGraph l = lower(int4_graph(w.m, 8192, 8192, 128, false, "bf16", "f16", false));
    const std::vector<std::string> s = steps(l.plan);
    REQUIRE(s.size() == 1);
    CHECK(s[0].find(std::string("kernel=k0_") + w.kernel) != std::string::npos);
    CHECK(l.kernels == std::vector<std::string>{std::string("k0_") + w.kernel});
  }
  // GEMV: 4 rows per warp, 8 warps per block at N = 8192 -> 256 blocks; x staged per 1024 k.
  CHECK(steps(lower(int4_graph(1, 8192, 8192, 128, false, "bf16", "f16", false)).plan)[0].find(
            "grid=256,1,1 block=256,1,1 smem=4608") != std::string::npos);
  // mma: 4 warps of one n8 tile -> 32 columns a block, 256 blocks at N = 8192.
  CHECK(steps(lower(int4_graph(16, 8192, 8192, 128, false, "bf16", "f16", false)).plan)[0].find(
            "grid=256,1,1 block=128,1,1 smem=0") != std::string::npos);
  const LoweredGraph big = lower(int4_graph(200, 64, 256, 64, true, "f16", "f16", true));
  const std::vector<std::string> s = steps(big.plan);
  REQUIRE(s.size() == 2);
  CHECK(s[0].find("kernel=k0_int4_dequantize") != std::string::npos);
  CHECK(s[1].find("step gemm") != std::string::npos);
  CHECK(s[1].find("m=200 n=64 k=256") != std::string::npos);
  CHECK(s[1].find("trans_b=1") != std::string::npos);
  CHECK(s[1].find("epilogue=bias") != std::string::npos);
}

TEST_CASE("matmul_int4: every kernel variant compiles for sm_80, sm_90a and sm_100a") {
  std::string text;
  // One graph holding all variants: GEMV / mma / dequantize, bf16 / f16 / f32 x, sym / asym,
  // bf16 / f16 scales, with and without bias, odd N.
  auto g = parse_graph(R"(graph @g(%x1: bf16[1, 256], %x2: f16[16, 256], %x3: f32[5, 256], %x4: bf16[100, 256], %w: u8[37, 128], %s: f16[37, 2], %z: f16[37, 4], %t: bf16[37, 8], %bb: bf16[37], %hb: f16[37]) -> (bf16[1, 37], f16[16, 37], f32[5, 37], bf16[100, 37], bf16[33, 37]) {
  %a = matmul_int4(%x1, %w, %s, %bb) {group_size = 128} : bf16[1, 37]
  %b = matmul_int4(%x2, %w, %z, %z, %hb) {group_size = 64, asymmetric = 1} : f16[16, 37]
  %c = matmul_int4(%x3, %w, %t) {group_size = 32} : f32[5, 37]
  %d = matmul_int4(%x4, %w, %t, %t) {group_size = 32, asymmetric = 1} : bf16[100, 37]
  %e = slice(%x4) {starts = [0], ends = [33], axes = [0]} : bf16[33, 256]
  %f = matmul_int4(%e, %w, %t, %bb) {group_size = 32} : bf16[33, 37]
  return %a, %b, %c, %d, %f
})");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto l = lower_graph(**g);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  CHECK(l->kernels.size() == 6);  // gemv, mma, gemv, dequantize, slice, mma
  for (const char* target : {"sm_80", "sm_90a", "sm_100a"}) {
    CAPTURE(target);
    auto cubin = compile_cuda(l->source, target, "test@0");
    REQUIRE_MESSAGE(cubin.ok(), std::string(cubin.status().message()));
    CHECK(cubin->substr(0, 4) == "\x7f" "ELF");
  }
}

TEST_CASE("matmul_int4: a graph with f16 only compiles (the helpers need both half headers)") {
  // A regression test: the shared helpers also spell bf16, so an f16-only source must still
  // include cuda_bf16.h.
  auto g = parse_graph(R"(graph @g(%x: f16[16, 256], %w: u8[37, 128], %s: f16[37, 2], %hb: f16[37]) -> (f16[16, 37]) {
  %y = matmul_int4(%x, %w, %s, %hb) {group_size = 128} : f16[16, 37]
  return %y
})");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto l = lower_graph(**g);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  auto cubin = compile_cuda(l->source, "sm_90a", "test@0");
  REQUIRE_MESSAGE(cubin.ok(), std::string(cubin.status().message()));
}

}  // namespace
}  // namespace kiln::cuda
