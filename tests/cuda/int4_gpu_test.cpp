// GPU test of matmul_int4 on cuda-sm90 against the reference interpreter: the streaming kernel
// at M = 1..64 across its boundaries (MN tiles 8/9, one or two row tiles per warp at 16/17),
// with and without the K split across blocks, N and K off the tiles, group sizes 32/64/128,
// symmetric (group 128 post-scaled or scaled per pair) and asymmetric (one fma or a subtraction
// per pair), bf16/f16, bias; f32 x (GEMV, dequantize + gemm) and M = 65, 200 (dequantize +
// gemm); on cuda-sm90 the cluster-pair K split at M = 5..64, the untested reads of x's last n8
// tile above M = 8 off a multiple of 8, the paired scale loads of group 128; with constant
// weights, scales and zeros, the scale-zero pairs packed at compile time and the weights
// reordered in place (and not, where two nodes read them); and the backend option
// int4-exact-zeros (the subtraction everywhere, nothing packed). KILN_TEST_SHARD=I/N runs a
// share of the cases, KILN_TEST_WITH=OPTION those run with that backend option set.
// Exits 77 (skip) without a GPU.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "kiln/core/driver.h"
#include "kiln/ir/text.h"
#include "gpu_test_util.h"
#include "int4_const_graph.h"

namespace {

using namespace kiln;

std::string graph(int64_t m, int64_t n, int64_t k, int64_t g, bool asym, const std::string& dt, bool bias) {
  const std::string M = std::to_string(m), N = std::to_string(n), K = std::to_string(k);
  // Scales and zeros are f16 or bf16 (the op's rule); f32 x takes f16 ones.
  const std::string sg = (dt == "f32" ? std::string("f16") : dt) + "[" + N + ", " + std::to_string(k / g) + "]";
  std::string args = "%x: " + dt + "[" + M + ", " + K + "], %w: u8[" + N + ", " + std::to_string(k / 2) + "], %s: " + sg;
  std::string ops = "%x, %w, %s";
  if (asym) args += ", %z: " + sg, ops += ", %z";
  if (bias) args += ", %b: " + dt + "[" + N + "]", ops += ", %b";
  const std::string yt = dt + "[" + M + ", " + N + "]";
  return "graph @g(" + args + ") -> (" + yt + ") {\n  %y = matmul_int4(" + ops + ") {group_size = " + std::to_string(g) +
         (asym ? ", asymmetric = 1" : "") + "} : " + yt + "\n  return %y\n}\n";
}

}  // namespace

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  // KILN_TEST_SHARD=I/N runs every N-th case from case I, so that N processes can share the
  // suite (each case checks against the CPU reference interpreter, seconds at K = 8064).
  int shard = 0, shards = 1;
  if (const char* e = std::getenv("KILN_TEST_SHARD")) {
    if (std::sscanf(e, "%d/%d", &shard, &shards) != 2 || shards < 1 || shard < 0 || shard >= shards) {
      std::printf("FAIL: KILN_TEST_SHARD='%s': expected I/N with 0 <= I < N\n", e);
      return 1;
    }
  }
  // KILN_TEST_WITH=OPTION runs only the cases the test runs with that cuda-sm90 option set (e.g.
  // int4-exact-zeros), to recheck one path without the rest.
  const char* with = std::getenv("KILN_TEST_WITH");
  int failures = 0, cases = 0, ran = 0;
  Options opts;  // the cuda-sm90 options of the cases that follow
  // consts: the weights, scales and zeros as constants (1; 2: two nodes read them).
  auto run = [&](int64_t m, int64_t n, int64_t k, int64_t g, bool asym, const std::string& dt, bool bias,
                 int consts = 0) {
    if (cases++ % shards != shard || (with != nullptr && !opts.has(with))) return;
    ++ran;
    const std::string name = "m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                             " g=" + std::to_string(g) + (asym ? " asym " : " sym ") + dt + (bias ? " bias" : "") +
                             (consts == 0 ? "" : consts == 1 ? " const" : " const shared");
    const double limit = dt == "bf16" ? 1e-2 : 2e-3;
    // Normwise relative error: the kernels round dequantized weights to x's dtype (bf16: 2^-9,
    // f16: 2^-12 relative), which elementwise tolerances would flag on cancelling sums.
    auto within = [&](const Tensor& want, const Tensor& got) {
      return test::rel_l2_within(want, got, limit).why;
    };
    const std::string text = consts == 0 ? graph(m, n, k, g, asym, dt, bias)
                                         : int4_const_graph(m, n, k, g, asym, dt, bias, 10 + cases, consts == 2);
    failures += report_case(name, gpu_matches_reference(text, "int4", static_cast<uint64_t>(10 + cases), within, {}, opts));
  };
  const int64_t ms[] = {1, 3, 4, 8, 9, 16, 17, 32, 33, 64, 65, 200};
  const int64_t gs[] = {32, 64, 128};
  for (size_t i = 0; i < std::size(ms); ++i)
    for (size_t j = 0; j < 3; ++j)
      for (bool asym : {false, true}) {
        const std::string dt = (i + j + asym) % 2 ? "f16" : "bf16";
        const bool bias = (i / 2 + j + asym) % 2 == 0;
        // Shape A: N = 257 (5 row blocks, the last one partial) and K = 1024 + 2 G, more than one
        // super-chunk, so K splits across blocks; shape B: N = 200 and K = 896 (7 k-blocks, a
        // partial super-chunk), one block in K up to M = 32 and two above.
        if ((i + j) % 2 == 0) run(ms[i], 257, 1024 + 2 * gs[j], gs[j], asym, dt, bias);
        else run(ms[i], 200, 896, gs[j], asym, dt, bias);
      }
  // N = 8500: 133 row blocks, never split; the last block holds 52 rows.
  for (int64_t m : {1, 16, 64}) {
    run(m, 8500, 512, 128, false, "bf16", m != 16);
    run(m, 8500, 512, 64, true, "f16", m == 16);
  }
  // N = 8000, K = 8064 at M = 13 / 16: on cuda-sm90 63 blocks of 128 rows, K split in two whose
  // halves meet as a cluster pair (the last block holds 64 rows, the last super-chunk is partial).
  run(13, 8000, 8064, 128, false, "bf16", true);
  run(16, 8000, 8064, 32, true, "f16", false);
  // Two shapes per M: N and K tails, group 128 bf16 and a smaller asymmetric f16 group, bias on
  // odd / even M.
  auto tails = [&](std::initializer_list<int64_t> ms) {
    for (int64_t m : ms) {
      run(m, 8000, 8064, 128, false, "bf16", m % 2 == 1);
      run(m, 257, 1280, m > 16 ? 32 : 64, true, "f16", m % 2 == 0);
    }
  };
  // x's last n8 tile read without a row test (M > 8 off a multiple of 8), and with it (M = 3).
  tails({3, 12, 13, 33});
  // A lane's two scales of a super-chunk as one 4-byte load (group 128, K whole super-chunks; N
  // off the row blocks) at 24 and 48 (two row tiles, the cluster pair).
  run(24, 1000, 2048, 128, false, "bf16", true);
  run(48, 1000, 2048, 128, false, "f16", false);
  // Constant weights: asymmetric scale-zero pairs packed at every plan (M = 1, the pairs at 12 / 16,
  // two row tiles above 16), the weights reordered above M = 16 (symmetric too, with the paired
  // scales at 48), and kept as stored where a second node reads them; the warpgroup path too.
  run(1, 257, 1280, 32, true, "f16", true, 1);
  run(12, 257, 1280, 64, true, "bf16", false, 1);
  run(16, 1000, 2048, 32, true, "f16", false, 1);
  run(17, 257, 1280, 128, true, "bf16", true, 1);
  run(33, 200, 896, 32, true, "f16", false, 1);
  run(64, 257, 1280, 64, true, "bf16", true, 1);
  run(64, 200, 896, 32, true, "f16", false, 1);
  run(17, 257, 1280, 128, false, "bf16", false, 1);
  run(48, 1000, 2048, 128, false, "f16", true, 1);
  run(64, 257, 1280, 32, false, "bf16", false, 1);
  run(33, 257, 1280, 32, true, "f16", true, 2);
  run(40, 257, 1280, 128, false, "bf16", false, 2);
  // int4-exact-zeros: asymmetric pairs as (q - zero)·scale where the default is the fma (M = 1,
  // 33, 64) or the packed pairs (constant zeros, M = 1, 12, 64; the weights still reordered at 64).
  opts.set("int4-exact-zeros", true);
  for (int64_t m : {1, 33, 64}) run(m, 257, 1280, 32, true, m == 33 ? "bf16" : "f16", m != 33);
  run(1, 257, 1280, 32, true, "f16", true, 1);
  run(12, 257, 1280, 64, true, "bf16", false, 1);
  run(64, 257, 1280, 64, true, "bf16", true, 1);
  opts = Options();
  // f32 x: GEMV up to M = 8, dequantize + gemm above.
  run(1, 257, 1088, 32, false, "f32", true);
  run(5, 200, 896, 128, true, "f32", false);
  run(9, 257, 512, 64, false, "f32", true);
  std::printf("%d of %d cases failed (shard %d/%d of %d cases)\n", failures, ran, shard, shards, cases);
  return failures == 0 ? 0 : 1;
}
