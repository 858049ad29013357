// Tests of bias gradients as GEMM epilogues (bias_grad.cpp): the sum over the rows of a linear's
// output gradient becomes the bgrad_a/bgrad_b epilogue of the weight gradient's GEMM step, with
// no reduction kernel, where the layout and sizes allow; otherwise the reduction stays a kernel.
#include <doctest/doctest.h>

#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

/// `graph` with a linear's backward: dy [2, 64, N] and x [2, 64, K] give dW = dyᵀ·x [N, K] and
/// db = Σ dy [1, 1, N] (keepdims, as autodiff's sum_to); `cast_first` puts db's f32 cast before
/// the GEMM, as schedule-memory may.
std::string linear_backward(int64_t n, int64_t k, const std::string& t, bool cast_first) {
  const std::string N = std::to_string(n), K = std::to_string(k);
  const std::string cast = "  %dbf = cast(%db) {to = f32} : f32[1, 1, " + N + "]\n";
  return "graph @g(%dy: " + t + "[2, 64, " + N + "], %x: " + t + "[2, 64, " + K + "]) -> (" + t + "[" + N + ", " + K +
         "], f32[1, 1, " + N + "]) {\n"
         "  %db = reduce_sum(%dy) {axes = [0, 1], keepdims = 1} : " + t + "[1, 1, " + N + "]\n" +
         (cast_first ? cast : "") +
         "  %d2 = reshape(%dy) {shape = [128, " + N + "]} : " + t + "[128, " + N + "]\n"
         "  %dt = transpose(%d2) {perm = [1, 0]} : " + t + "[" + N + ", 128]\n"
         "  %x2 = reshape(%x) {shape = [128, " + K + "]} : " + t + "[128, " + K + "]\n"
         "  %dw = matmul(%dt, %x2) : " + t + "[" + N + ", " + K + "]\n" +
         (cast_first ? "" : cast) + "  return %dw, %dbf\n}";
}

std::vector<std::string> gemms(const LoweredGraph& l) { return plan_lines(l.plan, "step gemm"); }

/// A kernel sums dy's columns: the general reduction or the column-sum kernel.
bool has_reduction(const LoweredGraph& l) {
  for (const std::string& k : l.kernels)
    if (k.find("reduce_sum") != std::string::npos || k.find("column_sum") != std::string::npos) return true;
  return false;
}

TEST_CASE("a linear's bias gradient is the bgrad_a epilogue of its weight gradient's GEMM") {
  for (const bool cast_first : {false, true}) {
    CAPTURE(cast_first);
    const LoweredGraph l = lower_text(linear_backward(96, 32, "bf16", cast_first), hopper_lowering());
    CHECK_FALSE(has_reduction(l));
    const auto g = gemms(l);
    REQUIRE(g.size() == 1);
    // dyᵀ read in place (trans_a=1), the sum of A over k (the 128 rows) is 96 long.
    CHECK(g[0].find(" m=96 n=32 k=128 batch=1 trans_a=1 trans_b=0 ") != std::string::npos);
    CHECK(g[0].find(" beta=0 epilogue=bgrad_a") != std::string::npos);
    const size_t at = g[0].find(" bias=b");
    REQUIRE(at != std::string::npos);
    // The bias buffer is bf16[1, 1, 96] and the cast kernel reads it after the GEMM.
    const std::string bias = g[0].substr(at + 6, g[0].find(' ', at + 1) - at - 6);
    CHECK(l.plan.find("buffer " + bias.substr(1) + " kind=activation dtype=bf16 shape=1x1x96 ") != std::string::npos);
    const auto all = steps(l.plan);
    size_t gemm_at = all.size(), cast_at = all.size();
    for (size_t i = 0; i < all.size(); ++i) {
      if (all[i].rfind("step gemm", 0) == 0) gemm_at = i;
      if (all[i].find("_cast ") != std::string::npos && all[i].find("args=" + bias + ",") != std::string::npos) cast_at = i;
    }
    CHECK(gemm_at < cast_at);
    CHECK(cast_at < all.size());
    compiles_everywhere(l);
  }
}

TEST_CASE("xᵀ·dy (matmul and bias add): the bias gradient is B's sum, bgrad_b; f32 too") {
  const LoweredGraph l = lower_text(R"(
graph @g(%dy: f32[4, 32, 48], %x: f32[4, 32, 80]) -> (f32[80, 48], f32[48]) {
  %db = reduce_sum(%dy) {axes = [0, 1], keepdims = 0} : f32[48]
  %d2 = reshape(%dy) {shape = [128, 48]} : f32[128, 48]
  %x2 = reshape(%x) {shape = [128, 80]} : f32[128, 80]
  %xt = transpose(%x2) : f32[80, 128]
  %dw = matmul(%xt, %d2) : f32[80, 48]
  return %dw, %db
})");
  CHECK_FALSE(has_reduction(l));
  const auto g = gemms(l);
  REQUIRE(g.size() == 1);
  CHECK(g[0].find(" m=80 n=48 k=128 batch=1 trans_a=1 trans_b=0 ") != std::string::npos);
  CHECK(g[0].find(" dtype=f32 ") != std::string::npos);
  CHECK(g[0].find(" epilogue=bgrad_b") != std::string::npos);
}

TEST_CASE("what keeps its reduction kernel: odd sizes, few rows, another epilogue, other sums") {
  SUBCASE("a column count that is not a multiple of 8 bf16 elements") {
    const LoweredGraph l = lower_text(linear_backward(90, 32, "bf16", false));
    CHECK(has_reduction(l));
    for (const std::string& g : gemms(l)) CHECK(g.find(" epilogue=none") != std::string::npos);
  }
  SUBCASE("an inner dimension that is not a multiple of 8") {
    const LoweredGraph l = lower_text(linear_backward(96, 36, "bf16", true));
    CHECK(has_reduction(l));
  }
  SUBCASE("16 output rows go to the GEMV kernel") {
    const LoweredGraph l = lower_text(R"(
graph @g(%dy: bf16[256, 16], %x: bf16[256, 64]) -> (bf16[16, 64], bf16[16]) {
  %db = reduce_sum(%dy) {axes = [0], keepdims = 0} : bf16[16]
  %dt = transpose(%dy) : bf16[16, 256]
  %dw = matmul(%dt, %x) : bf16[16, 64]
  return %dw, %db
})");
    CHECK(has_reduction(l));
    CHECK(gemms(l).empty());
  }
  SUBCASE("the GEMM already has an epilogue (a residual add as C)") {
    const LoweredGraph l = lower_text(R"(
graph @g(%dy: bf16[256, 64], %x: bf16[256, 32], %r: bf16[64, 32]) -> (bf16[64, 32], bf16[64]) {
  %db = reduce_sum(%dy) {axes = [0], keepdims = 0} : bf16[64]
  %dt = transpose(%dy) : bf16[64, 256]
  %dw = matmul(%dt, %x) : bf16[64, 32]
  %s = add(%dw, %r) : bf16[64, 32]
  return %s, %db
})");
    CHECK(has_reduction(l));
    const auto g = gemms(l);
    REQUIRE(g.size() == 1);
    CHECK(g[0].find(" beta=1 epilogue=none") != std::string::npos);
  }
  SUBCASE("a sum over the last dim, or over rows the GEMM does not reduce") {
    const LoweredGraph l = lower_text(R"(
graph @g(%dy: bf16[256, 64], %x: bf16[256, 32]) -> (bf16[64, 32], bf16[256], bf16[64, 32], bf16[64]) {
  %rs = reduce_sum(%dy) {axes = [1], keepdims = 0} : bf16[256]
  %dt = transpose(%dy) : bf16[64, 256]
  %dw = matmul(%dt, %x) : bf16[64, 32]
  %h = slice(%dy) {starts = [0], ends = [128], axes = [0]} : bf16[128, 64]
  %hs = reduce_sum(%h) {axes = [0], keepdims = 0} : bf16[64]
  %ht = transpose(%h) : bf16[64, 128]
  %x1 = slice(%x) {starts = [0], ends = [128], axes = [0]} : bf16[128, 32]
  %hw = matmul(%ht, %x1) : bf16[64, 32]
  return %dw, %rs, %hw, %hs
})");
    // %hs sums the slice, which the GEMM reads as its A: that one fuses; %rs does not.
    int reductions = 0;
    for (const std::string& k : l.kernels) reductions += k.find("reduce_sum") != std::string::npos;
    CHECK(reductions == 1);
    const auto g = gemms(l);
    REQUIRE(g.size() == 2);
    CHECK(g[0].find(" epilogue=none") != std::string::npos);
    CHECK(g[1].find(" epilogue=bgrad_a") != std::string::npos);
  }
  SUBCASE("the sum is read before the GEMM's other operand exists") {
    const LoweredGraph l = lower_text(R"(
graph @g(%dy: bf16[256, 64], %x: bf16[256, 32]) -> (bf16[64, 32], bf16[64]) {
  %db = reduce_sum(%dy) {axes = [0], keepdims = 0} : bf16[64]
  %e = exp(%db) : bf16[64]
  %xe = exp(%x) : bf16[256, 32]
  %dt = transpose(%dy) : bf16[64, 256]
  %dw = matmul(%dt, %xe) : bf16[64, 32]
  return %dw, %e
})");
    CHECK(has_reduction(l));
  }
}

}  // namespace
}  // namespace kiln::cuda
