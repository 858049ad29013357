// Graphs shared by the depthwise conv tests: the lowering test checks that each one takes the
// depthwise kernel and compiles for every target, the GPU test runs them against the reference.
#pragma once

#include <string>

namespace kiln::test {

inline std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

// T is replaced by the dtype.
inline const char* kDepthwiseCases[][2] = {
    {"convnext 7x7 pad 3, two row tiles per plane, bias",
     R"(graph @g(%x: T[2, 96, 56, 56], %w: T[96, 1, 7, 7], %b: T[96]) -> (T[2, 96, 56, 56]) {
  %c = conv(%x, %w, %b) {groups = 96, pads = [3, 3, 3, 3]} : T[2, 96, 56, 56]
  return %c })"},
    {"7x7 planes, 100 channels in blocks of 36, relu",
     R"(graph @g(%x: T[2, 100, 7, 7], %w: T[100, 1, 7, 7], %b: T[100]) -> (T[2, 100, 7, 7]) {
  %c = conv(%x, %w, %b) {groups = 100, pads = [3, 3, 3, 3]} : T[2, 100, 7, 7]
  %y = relu(%c) : T[2, 100, 7, 7]
  return %y })"},
    {"5x5 stride 2, batch norm, swish + residual group",
     R"(graph @g(%x: T[2, 24, 15, 15], %w: T[24, 1, 5, 5], %b: T[24], %s: T[24], %t: T[24], %m: T[24], %v: T[24], %r: T[2, 24, 8, 8]) -> (T[2, 24, 8, 8]) {
  %va = abs(%v) : T[24]
  %c = conv(%x, %w, %b) {groups = 24, strides = [2, 2], pads = [2, 2, 2, 2]} : T[2, 24, 8, 8]
  %n = batch_norm(%c, %s, %t, %m, %va) {epsilon = 0.001} : T[2, 24, 8, 8]
  %y = fused(%n, %r) : T[2, 24, 8, 8] {
    graph @body(%p: T[2, 24, 8, 8], %q: T[2, 24, 8, 8]) -> (T[2, 24, 8, 8]) {
      %a = silu(%p) : T[2, 24, 8, 8]
      %o = add(%a, %q) : T[2, 24, 8, 8]
      return %o
    }
  }
  return %y })"},
    {"mobilenet 3x3 stride 2 on 112x112, hardswish group",
     R"(graph @g(%x: T[2, 16, 112, 112], %w: T[16, 1, 3, 3], %b: T[16]) -> (T[2, 16, 56, 56]) {
  %c = conv(%x, %w, %b) {groups = 16, strides = [2, 2], pads = [1, 1, 1, 1]} : T[2, 16, 56, 56]
  %y = fused(%c) : T[2, 16, 56, 56] {
    graph @body(%p: T[2, 16, 56, 56]) -> (T[2, 16, 56, 56]) {
      %three = constant() {value = dense<T[]>[3.0]} : T[]
      %six = constant() {value = dense<T[]>[6.0]} : T[]
      %a = add(%p, %three) : T[2, 16, 56, 56]
      %k = clip(%a) {min = 0.0, max = 6.0} : T[2, 16, 56, 56]
      %m = mul(%p, %k) : T[2, 16, 56, 56]
      %o = div(%m, %six) : T[2, 16, 56, 56]
      return %o
    }
  }
  return %y })"},
    {"dilation 2, asymmetric pads, channel multiplier 2, per-channel scale",
     R"(graph @g(%x: T[2, 6, 11, 9], %w: T[12, 1, 3, 3], %k: T[12, 1, 1]) -> (T[2, 12, 8, 6]) {
  %c = conv(%x, %w) {groups = 6, dilations = [2, 2], pads = [1, 0, 0, 1]} : T[2, 12, 8, 6]
  %y = mul(%c, %k) : T[2, 12, 8, 6]
  return %y })"},
    {"wide rows in column tiles, stride 3",
     R"(graph @g(%x: T[1, 4, 7, 300], %w: T[4, 1, 3, 3], %u: T[4, 1, 3, 3]) -> (T[1, 4, 7, 300], T[1, 4, 3, 100]) {
  %c = conv(%x, %w) {groups = 4, pads = [1, 1, 1, 1]} : T[1, 4, 7, 300]
  %d = conv(%x, %u) {groups = 4, strides = [3, 3], pads = [1, 1, 1, 1]} : T[1, 4, 3, 100]
  return %c, %d })"},
    {"1-D stride 2 with bias",
     R"(graph @g(%x: T[3, 8, 41], %w: T[8, 1, 4], %b: T[8]) -> (T[3, 8, 20]) {
  %c = conv(%x, %w, %b) {groups = 8, strides = [2], pads = [1, 1]} : T[3, 8, 20]
  return %c })"},
};

// The channels-last form the layout-nhwc pass writes (conv_depthwise_nhwc.cpp): x [N, H, W, C],
// w [K, R, S, 1]; per-channel operands broadcast along the last dim.
inline const char* kDepthwiseNhwcCases[][2] = {
    {"nhwc convnext 7x7 pad 3, bias",
     R"(graph @g(%x: T[2, 56, 56, 96], %w: T[96, 7, 7, 1], %b: T[96]) -> (T[2, 56, 56, 96]) {
  %c = conv(%x, %w, %b) {groups = 96, pads = [3, 3, 3, 3], layout = "nhwc"} : T[2, 56, 56, 96]
  return %c })"},
    {"nhwc mobilenet 3x3 stride 2, hardswish group",
     R"(graph @g(%x: T[2, 112, 112, 16], %w: T[16, 3, 3, 1], %b: T[16]) -> (T[2, 56, 56, 16]) {
  %c = conv(%x, %w, %b) {groups = 16, strides = [2, 2], pads = [1, 1, 1, 1], layout = "nhwc"} : T[2, 56, 56, 16]
  %y = fused(%c) : T[2, 56, 56, 16] {
    graph @body(%p: T[2, 56, 56, 16]) -> (T[2, 56, 56, 16]) {
      %three = constant() {value = dense<T[]>[3.0]} : T[]
      %six = constant() {value = dense<T[]>[6.0]} : T[]
      %a = add(%p, %three) : T[2, 56, 56, 16]
      %k = clip(%a) {min = 0.0, max = 6.0} : T[2, 56, 56, 16]
      %m = mul(%p, %k) : T[2, 56, 56, 16]
      %o = div(%m, %six) : T[2, 56, 56, 16]
      return %o
    }
  }
  return %y })"},
    {"nhwc dilation 2, asymmetric pads, channel multiplier 2, per-channel scale",
     R"(graph @g(%x: T[2, 11, 9, 6], %w: T[12, 3, 3, 1], %k: T[12]) -> (T[2, 8, 6, 12]) {
  %c = conv(%x, %w) {groups = 6, dilations = [2, 2], pads = [1, 0, 0, 1], layout = "nhwc"} : T[2, 8, 6, 12]
  %y = mul(%c, %k) : T[2, 8, 6, 12]
  return %y })"},
    {"nhwc wide rows, stride 3, 5x5 stride 1 with a residual",
     R"(graph @g(%x: T[1, 7, 300, 4], %w: T[4, 3, 3, 1], %u: T[4, 5, 5, 1], %r: T[1, 7, 300, 4]) -> (T[1, 3, 100, 4], T[1, 7, 300, 4]) {
  %c = conv(%x, %w) {groups = 4, strides = [3, 3], pads = [1, 1, 1, 1], layout = "nhwc"} : T[1, 3, 100, 4]
  %d = conv(%x, %u) {groups = 4, pads = [2, 2, 2, 2], layout = "nhwc"} : T[1, 7, 300, 4]
  %e = add(%d, %r) : T[1, 7, 300, 4]
  return %c, %e })"},
    {"nhwc 1-D stride 2 with bias",
     R"(graph @g(%x: T[3, 41, 8], %w: T[8, 4, 1], %b: T[8]) -> (T[3, 20, 8]) {
  %c = conv(%x, %w, %b) {groups = 8, strides = [2], pads = [1, 1], layout = "nhwc"} : T[3, 20, 8]
  return %c })"},
    // The pointwise node before the conv is applied by the conv kernel to each input it loads.
    {"nhwc prologue: an expand GEMM's silu group, pads 1, relu after",
     R"(graph @g(%x: T[2, 15, 13, 24], %w: T[24, 3, 3, 1], %b: T[24]) -> (T[2, 15, 13, 24]) {
  %s = fused(%x) : T[2, 15, 13, 24] {
    graph @body(%p: T[2, 15, 13, 24]) -> (T[2, 15, 13, 24]) {
      %g = sigmoid(%p) : T[2, 15, 13, 24]
      %m = mul(%p, %g) : T[2, 15, 13, 24]
      return %m
    }
  }
  %c = conv(%s, %w, %b) {groups = 24, pads = [1, 1, 1, 1], layout = "nhwc"} : T[2, 15, 13, 24]
  %y = relu(%c) : T[2, 15, 13, 24]
  return %y })"},
    // sigmoid(0) = 0.5: the zero padding must stay zero, not become the prologue of zero.
    {"nhwc prologue: one sigmoid, 5x5 stride 2 pads 2",
     R"(graph @g(%x: T[2, 16, 16, 8], %w: T[8, 5, 5, 1]) -> (T[2, 8, 8, 8]) {
  %s = sigmoid(%x) : T[2, 16, 16, 8]
  %c = conv(%s, %w) {groups = 8, strides = [2, 2], pads = [2, 2, 2, 2], layout = "nhwc"} : T[2, 8, 8, 8]
  return %c })"},
    {"nhwc prologue: sigmoid, 3x3 stride 2 on 57x57, 72 channels, relu after",
     R"(graph @g(%x: T[2, 57, 57, 72], %w: T[72, 3, 3, 1]) -> (T[2, 29, 29, 72]) {
  %s = sigmoid(%x) : T[2, 57, 57, 72]
  %c = conv(%s, %w) {groups = 72, strides = [2, 2], pads = [1, 1, 1, 1], layout = "nhwc"} : T[2, 29, 29, 72]
  %y = relu(%c) : T[2, 29, 29, 72]
  return %y })"},
    // Tiles across rows and columns: the halo between tiles is staged (and the prologue applied)
    // by both; 240 channels are 7 blocks of 32 and a partial one; 4 rows per thread with a
    // partial last row group.
    {"nhwc prologue: EfficientNet's 5x5 on 28x28x240 after the expand GEMM's silu, batch 4",
     R"(graph @g(%x: T[4, 28, 28, 240], %w: T[240, 5, 5, 1], %b: T[240]) -> (T[4, 28, 28, 240]) {
  %s = silu(%x) : T[4, 28, 28, 240]
  %c = conv(%s, %w, %b) {groups = 240, pads = [2, 2, 2, 2], layout = "nhwc"} : T[4, 28, 28, 240]
  return %c })"},
    // A squeeze-excite block: the depthwise kernel also sums its outputs per channel and tile
    // for the global pool, which adds the tiles' sums; the excite reads the stored outputs.
    {"nhwc squeeze-excite: silu prologue and tail, global mean pool of the tiles' sums, excite; a sum pool",
     R"(graph @g(%x: T[2, 28, 28, 40], %w: T[40, 3, 3, 1], %b: T[40], %v: T[40, 3, 3, 1]) -> (T[2, 28, 28, 40], T[2, 40], T[2, 14, 14, 40]) {
  %s = silu(%x) : T[2, 28, 28, 40]
  %c = conv(%s, %w, %b) {groups = 40, pads = [1, 1, 1, 1], layout = "nhwc"} : T[2, 28, 28, 40]
  %a = silu(%c) : T[2, 28, 28, 40]
  %m = reduce_mean(%a) {axes = [1, 2], keepdims = 1} : T[2, 1, 1, 40]
  %g = sigmoid(%m) : T[2, 1, 1, 40]
  %y = mul(%a, %g) : T[2, 28, 28, 40]
  %d = conv(%x, %v) {groups = 40, strides = [2, 2], pads = [1, 1, 1, 1], layout = "nhwc"} : T[2, 14, 14, 40]
  %t = reduce_sum(%d) {axes = [2, 1], keepdims = 0} : T[2, 40]
  return %y, %t, %d })"},
    {"nhwc 7x7 on 14x14 in row and column tiles, 200 channels",
     R"(graph @g(%x: T[3, 14, 14, 200], %w: T[200, 7, 7, 1], %b: T[200]) -> (T[3, 14, 14, 200]) {
  %c = conv(%x, %w, %b) {groups = 200, pads = [3, 3, 3, 3], layout = "nhwc"} : T[3, 14, 14, 200]
  return %c })"},
};

/// `count` values in [-0.5, 0.5), multiples of 1/16 (exact in every float dtype), as a dense list.
inline std::string sixteenths(int count, int seed) {
  std::string s;
  for (int k = 0; k < count; ++k) s += (k ? ", " : "") + std::to_string(((k * 37 + seed * 11) % 17 - 8) / 16.0);
  return s;
}

/// Channels-last depthwise convs with constant weights [C, k..., 1] (layout-nhwc's form; the kernel
/// reads them transposed to [taps][C]) in dtype `t`: a 3x3 stride-2 conv with bias and a swish +
/// residual group, a 5x5 one with a relu, a 1-D one.
inline std::string depthwise_nhwc_constant_graph(const std::string& t) {
  return replace_all("graph @g(%x: T[2, 14, 13, 24], %b: T[24], %r: T[2, 7, 7, 24], %s: T[3, 21, 8]) -> (T[2, 7, 7, 24], "
         "T[2, 14, 13, 24], T[3, 11, 8]) {\n"
         "  %w = constant() {value = dense<T[24, 3, 3, 1]>[" + sixteenths(216, 1) + "]} : T[24, 3, 3, 1]\n"
         "  %c = conv(%x, %w, %b) {groups = 24, strides = [2, 2], pads = [1, 1, 1, 1], layout = \"nhwc\"} : T[2, 7, 7, 24]\n"
         "  %y = fused(%c, %r) : T[2, 7, 7, 24] {\n"
         "    graph @body(%p: T[2, 7, 7, 24], %q: T[2, 7, 7, 24]) -> (T[2, 7, 7, 24]) {\n"
         "      %a = silu(%p) : T[2, 7, 7, 24]\n"
         "      %o = add(%a, %q) : T[2, 7, 7, 24]\n"
         "      return %o\n"
         "    }\n"
         "  }\n"
         "  %v = constant() {value = dense<T[24, 5, 5, 1]>[" + sixteenths(600, 2) + "]} : T[24, 5, 5, 1]\n"
         "  %d = conv(%x, %v) {groups = 24, pads = [2, 2, 2, 2], layout = \"nhwc\"} : T[2, 14, 13, 24]\n"
         "  %e = relu(%d) : T[2, 14, 13, 24]\n"
         "  %u = constant() {value = dense<T[8, 4, 1]>[" + sixteenths(32, 3) + "]} : T[8, 4, 1]\n"
         "  %f = conv(%s, %u) {groups = 8, strides = [2], pads = [1, 2], layout = \"nhwc\"} : T[3, 11, 8]\n"
         "  return %y, %e, %f\n"
         "}\n", "T[", t + "[");
}

}  // namespace kiln::test
