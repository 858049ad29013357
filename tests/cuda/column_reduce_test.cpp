// Tests of column sums (column_reduce.cpp): sums and means over every dim but the last of a float
// tensor are one 16-byte-vector kernel, with a second kernel adding row chunks in a fixed order
// when the column tiles alone are few; what does not fit the vectors keeps the general kernels.
#include <doctest/doctest.h>

#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

std::vector<std::string> kernel_names(const LoweredGraph& l) {
  std::vector<std::string> out;
  for (const std::string& k : l.kernels) out.push_back(k.substr(k.find('_') + 1));
  return out;
}

TEST_CASE("a layer norm's weight gradient over 4096 rows: vector loads, row chunks, a fixed-order second pass") {
  const LoweredGraph l = lower_text(R"(
graph @g(%gx: f32[8, 512, 768], %g: bf16[8, 512, 768], %w: f16[4096, 3072]) -> (f32[1, 1, 768], bf16[768], f16[3072]) {
  %a = reduce_sum(%gx) {axes = [0, 1], keepdims = 1} : f32[1, 1, 768]
  %b = reduce_sum(%g) {axes = [0, 1], keepdims = 0} : bf16[768]
  %c = reduce_mean(%w) {axes = [0], keepdims = 0} : f16[3072]
  return %a, %b, %c
})");
  CHECK(kernel_names(l) == std::vector<std::string>{"column_sum", "column_sum_splits", "column_sum", "column_sum_splits",
                                                     "column_mean", "column_mean_splits"});
  const auto ls = launches(l.plan);
  REQUIRE(ls.size() == 6);
  // f32: 192 vectors of 4 in 6 tiles of 32, 64 chunks of 64 rows; the partials [64, 768].
  CHECK(ls[0].find(" grid=384,1,1 ") != std::string::npos);
  CHECK(ls[1].find(" grid=24,1,1 ") != std::string::npos);
  CHECK(l.plan.find("dtype=f32 shape=64x768 ") != std::string::npos);
  // bf16: 96 vectors of 8 in 3 tiles; f16 3072 columns: 12 tiles, 44 chunks.
  CHECK(ls[2].find(" grid=192,1,1 ") != std::string::npos);
  CHECK(ls[4].find(" grid=528,1,1 ") != std::string::npos);
  CHECK(l.plan.find("dtype=f32 shape=44x3072 ") != std::string::npos);
  CHECK(l.source.find("uint4 q = *reinterpret_cast<const uint4*>") != std::string::npos);
  compiles_everywhere(l);
}

TEST_CASE("column tiles enough to fill the GPU need no second pass; fewer than 64 rows take a thread per column") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[128, 3072, 128], %p: f32[8, 512, 768]) -> (f32[1, 3072, 128], f32[1, 512, 768]) {
  %s = reduce_sum(%x) {axes = [0], keepdims = 1} : f32[1, 3072, 128]
  %e = reduce_sum(%p) {axes = [0], keepdims = 1} : f32[1, 512, 768]
  return %s, %e
})");
  CHECK(kernel_names(l) == std::vector<std::string>{"column_sum", "reduce_sum"});
  const auto ls = launches(l.plan);
  REQUIRE(ls.size() == 2);
  CHECK(ls[0].find(" grid=3072,1,1 ") != std::string::npos);
  CHECK(l.kernels.size() == 2);
}

TEST_CASE("what keeps the general kernels: odd columns, kept dims before, max, integers, prologues") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: bf16[4096, 90], %y: f32[4, 512, 64], %z: f32[4096, 64], %i: i32[4096, 64], %p: f32[4096, 64], %q: f32[4096, 64]) -> (bf16[90], f32[4, 64], f32[64], i32[64], f32[64]) {
  %a = reduce_sum(%x) {axes = [0], keepdims = 0} : bf16[90]
  %b = reduce_sum(%y) {axes = [1], keepdims = 0} : f32[4, 64]
  %c = reduce_max(%z) {axes = [0], keepdims = 0} : f32[64]
  %d = reduce_sum(%i) {axes = [0], keepdims = 0} : i32[64]
  %pq = mul(%p, %q) : f32[4096, 64]
  %e = reduce_sum(%pq) {axes = [0], keepdims = 0} : f32[64]
  return %a, %b, %c, %d, %e
})");
  CHECK(l.source.find("uint4 q = *reinterpret_cast<const uint4*>") == std::string::npos);
  for (const std::string& k : l.kernels) CHECK(k.find("column") == std::string::npos);
}

}  // namespace
}  // namespace kiln::cuda
