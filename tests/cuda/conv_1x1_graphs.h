// Graphs shared by the 1x1 conv tests: the lowering test checks that each one takes the GEMM path
// and compiles for every target, the GPU test runs them against the reference. T stands for the
// dtype (conv_depthwise_graphs.h's replace_all fills it in).
#pragma once

namespace kiln::test {

inline const char* k1x1Cases[][2] = {
    {"constant bias as a shared C plane, relu epilogue",
     R"(graph @g(%x: T[3, 24, 10, 9], %w: T[16, 24, 1, 1]) -> (T[3, 16, 10, 9]) {
  %b = constant() {value = dense<T[16]>[0.5, -0.25, 0.125, 1.0, -1.0, 0.75, 0.0, -0.5, 0.3, -0.3, 0.2, -0.2, 0.1, -0.1, 0.9, -0.9]} : T[16]
  %c = conv(%x, %w, %b) : T[3, 16, 10, 9]
  %y = relu(%c) : T[3, 16, 10, 9]
  return %y })"},
    {"bias and residual through the bias kernel, relu epilogue",
     R"(graph @g(%x: T[2, 16, 7, 7], %w: T[32, 16, 1, 1], %b: T[32], %r: T[2, 32, 7, 7]) -> (T[2, 32, 7, 7]) {
  %c = conv(%x, %w, %b) : T[2, 32, 7, 7]
  %s = add(%c, %r) : T[2, 32, 7, 7]
  %y = relu(%s) : T[2, 32, 7, 7]
  return %y })"},
    {"residual as C without a bias; a bias from an input",
     R"(graph @g(%x: T[2, 8, 6, 5], %w: T[12, 8, 1, 1], %r: T[2, 12, 6, 5], %b: T[12]) -> (T[2, 12, 6, 5], T[2, 12, 6, 5]) {
  %c = conv(%x, %w) : T[2, 12, 6, 5]
  %s = add(%r, %c) : T[2, 12, 6, 5]
  %d = conv(%x, %w, %b) : T[2, 12, 6, 5]
  return %s, %d })"},
    {"1-D and 3-D, ResNet-sized channels",
     R"(graph @g(%s: T[2, 64, 50], %v: T[128, 64, 1], %t: T[1, 8, 3, 4, 5], %u: T[6, 8, 1, 1, 1]) -> (T[2, 128, 50], T[1, 6, 3, 4, 5]) {
  %d = conv(%s, %v) : T[2, 128, 50]
  %e = conv(%t, %u) : T[1, 6, 3, 4, 5]
  return %d, %e })"},
};

}  // namespace kiln::test
