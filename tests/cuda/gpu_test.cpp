// GPU conformance: small graphs covering every lowered op run on `reference` and `cuda-sm90`
// and must agree within PyTorch's assert_close tolerances. Exits 77 (skip) without a GPU.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kiln/core/driver.h"
#include "kiln/ir/text.h"
#include "gpu_test_util.h"

namespace {

using namespace kiln;

struct Case {
  const char* name;
  const char* text;
};

const Case kCases[] = {
    {"unary", R"(graph @g(%x: f32[3, 5]) -> (f32[3, 5], f32[3, 5], f32[3, 5], f32[3, 5], f32[3, 5], f32[3, 5]) {
  %a = exp(%x) : f32[3, 5]
  %b = tanh(%x) : f32[3, 5]
  %c = gelu(%x) : f32[3, 5]
  %d = silu(%x) : f32[3, 5]
  %e = softplus(%x) : f32[3, 5]
  %f = clip(%x) {min = -0.5, max = 0.5} : f32[3, 5]
  return %a, %b, %c, %d, %e, %f })"},
    {"binary-broadcast", R"(graph @g(%x: f32[2, 3, 4], %y: f32[3, 1]) -> (f32[2, 3, 4], f32[2, 3, 4], bool[2, 3, 4], f32[2, 3, 4]) {
  %a = add(%x, %y) : f32[2, 3, 4]
  %b = maximum(%x, %y) : f32[2, 3, 4]
  %c = less(%x, %y) : bool[2, 3, 4]
  %d = where(%c, %a, %b) : f32[2, 3, 4]
  return %a, %b, %c, %d })"},
    {"fused", R"(graph @g(%x: f16[8, 16], %b: f16[16]) -> (f16[8, 16]) {
  %y = fused(%x, %b) : f16[8, 16] {
    graph @body(%a: f16[8, 16], %c: f16[16]) -> (f16[8, 16]) {
      %s = add(%a, %c) : f16[8, 16]
      %g = gelu(%s) {approximate = "tanh"} : f16[8, 16]
      return %g
    }
  }
  return %y })"},
    {"integers", R"(graph @g(%a: i32[4, 5], %b: i32[5]) -> (i32[4, 5], i64[4, 1], f32[4, 5]) {
  %s = mul(%a, %b) : i32[4, 5]
  %r = reduce_sum(%s) {axes = [1]} : i32[4, 1]
  %k = cast(%r) {to = i64} : i64[4, 1]
  %f = cast(%s) {to = f32} : f32[4, 5]
  return %s, %k, %f })"},
    {"reductions", R"(graph @g(%x: f32[4, 300]) -> (f32[4, 1], f32[1, 300], i64[4], f32[4, 300], f32[4, 300], f32[4, 300], f32[4, 300]) {
  %m = reduce_mean(%x) {axes = [1]} : f32[4, 1]
  %n = reduce_max(%x) {axes = [0]} : f32[1, 300]
  %a = argmin(%x) {axis = 1, keepdims = 0} : i64[4]
  %s = softmax(%x) {axis = -1} : f32[4, 300]
  %l = log_softmax(%x) {axis = -1} : f32[4, 300]
  %ln = layer_norm(%x) : f32[4, 300]
  %rn = rms_norm(%x) : f32[4, 300]
  return %m, %n, %a, %s, %l, %ln, %rn })"},
    // Softmax over a vocabulary-long row (online max and sum), with -inf elements (log of 0).
    {"long-row softmax", R"(graph @g(%x: f32[3, 50257], %h: bf16[2, 50257]) -> (f32[3, 50257], f32[3, 50257], bf16[2, 50257], f32[3, 50257]) {
  %s = softmax(%x) {axis = -1} : f32[3, 50257]
  %l = log_softmax(%x) {axis = 1} : f32[3, 50257]
  %hs = softmax(%h) {axis = -1} : bf16[2, 50257]
  %z = relu(%x) : f32[3, 50257]
  %lz = log(%z) : f32[3, 50257]
  %ms = softmax(%lz) {axis = -1} : f32[3, 50257]
  return %s, %l, %hs, %ms })"},
    // Reductions over middle dims with kept dims after them (a channels-last global pool):
    // the warp-along-I kernel, with a partial last tile of 32; %z's 1600 rows over 4 tiles split
    // across blocks (partials, then a combining kernel).
    {"channels-last pools", R"(graph @g(%x: f32[3, 9, 11, 40], %h: bf16[2, 20, 20, 70], %z: f32[2, 40, 40, 36]) -> (f32[3, 1, 1, 40], f32[3, 40], bf16[2, 70], f32[9, 40], f32[2, 36], f32[2, 1, 1, 36], bf16[2, 70]) {
  %m = reduce_mean(%x) {axes = [1, 2], keepdims = 1} : f32[3, 1, 1, 40]
  %n = reduce_max(%x) {axes = [1, 2], keepdims = 0} : f32[3, 40]
  %s = reduce_sum(%h) {axes = [1, 2], keepdims = 0} : bf16[2, 70]
  %t = reduce_min(%x) {axes = [0, 2], keepdims = 0} : f32[9, 40]
  %zm = reduce_mean(%z) {axes = [1, 2], keepdims = 0} : f32[2, 36]
  %zx = reduce_max(%z) {axes = [1, 2], keepdims = 1} : f32[2, 1, 1, 36]
  %hm = reduce_mean(%h) {axes = [1, 2], keepdims = 0} : bf16[2, 70]
  return %m, %n, %s, %t, %zm, %zx, %hm })"},
    // Reduced dims between kept ones and a kept last dim (RoPE's table gradient over batch and
    // heads), with the product on the loads; %h's 6 x 9 tiles split its rows across blocks.
    {"interleaved reductions", R"(graph @g(%dy: f32[8, 20, 10, 288], %r: f32[8, 20, 10, 288], %h: bf16[16, 6, 8, 7, 40]) -> (f32[1, 20, 1, 288], bf16[6, 7, 40], f32[20, 288]) {
  %p = mul(%dy, %r) : f32[8, 20, 10, 288]
  %g = reduce_sum(%p) {axes = [0, 2], keepdims = 1} : f32[1, 20, 1, 288]
  %s = reduce_max(%h) {axes = [0, 2], keepdims = 0} : bf16[6, 7, 40]
  %u = reduce_mean(%dy) {axes = [0, 2], keepdims = 0} : f32[20, 288]
  return %g, %s, %u })"},
    // Few long rows split into chunks, a block each, then a combining kernel: a global norm's
    // sum over a whole tensor, 3 rows of 70000, kept dims between reduced ones. abs() keeps the f32
    // sums free of cancellation, so f32 accumulation in any order stays within assert_close.
    {"long reductions split across blocks", R"(graph @g(%x: f32[3, 70000], %h: bf16[300, 1100], %z: f32[40, 3, 3000]) -> (f32[3], bf16[], f32[1, 3, 1], f32[3], f32[], f32[]) {
  %ax = abs(%x) : f32[3, 70000]
  %s = reduce_sum(%ax) {axes = [1], keepdims = 0} : f32[3]
  %hs = reduce_sum(%h) {keepdims = 0} : bf16[]
  %az = abs(%z) : f32[40, 3, 3000]
  %zm = reduce_mean(%az) {axes = [0, 2], keepdims = 1} : f32[1, 3, 1]
  %zx = reduce_max(%z) {axes = [0, 2], keepdims = 0} : f32[3]
  %xn = reduce_min(%x) {keepdims = 0} : f32[]
  %xs = reduce_sum(%ax) {keepdims = 0} : f32[]
  return %s, %hs, %zm, %zx, %xn, %xs })"},
    // Short reductions, a thread per output: a GQA key gradient summed over its repeat dim
    // ([B, kv, rep, T, hd]), a short last dim over many rows, and outer dims kept around it.
    {"short reductions", R"(graph @g(%k: bf16[2, 2, 4, 33, 64], %x: f32[5000, 7], %z: f32[3, 5, 4, 70]) -> (bf16[2, 2, 33, 64], f32[5000], f32[5000, 1], f32[3, 70], f32[5, 4, 70]) {
  %g = reduce_sum(%k) {axes = [2], keepdims = 0} : bf16[2, 2, 33, 64]
  %m = reduce_mean(%x) {axes = [1], keepdims = 0} : f32[5000]
  %n = reduce_max(%x) {axes = [-1], keepdims = 1} : f32[5000, 1]
  %az = abs(%z) : f32[3, 5, 4, 70]
  %s = reduce_sum(%az) {axes = [1, 2], keepdims = 0} : f32[3, 70]
  %t = reduce_min(%z) {axes = [0], keepdims = 0} : f32[5, 4, 70]
  return %g, %m, %n, %s, %t })"},
    // Elementwise nodes only a reduction reads, computed on its loads: a global norm's sum of
    // squares (split across blocks), an abs before a short max, a scaling before a middle-dim mean.
    {"reduction prologues", R"(graph @g(%w: f32[600, 700], %h: bf16[300, 7], %x: f32[8, 64, 96], %s: f32[]) -> (f32[], bf16[300], f32[8, 96]) {
  %sq = mul(%w, %w) : f32[600, 700]
  %n = reduce_sum(%sq) {keepdims = 0} : f32[]
  %a = abs(%h) : bf16[300, 7]
  %m = reduce_max(%a) {axes = [1], keepdims = 0} : bf16[300]
  %xs = mul(%x, %s) : f32[8, 64, 96]
  %p = reduce_mean(%xs) {axes = [1], keepdims = 0} : f32[8, 96]
  return %n, %m, %p })"},
    // Fused pointwise nodes only a reduction reads, computed on its loads: a bf16 gradient widened
    // and squared before a split sum, a scaled exponential plus a constant before a middle mean.
    {"fused reduction prologues", R"(graph @g(%g16: bf16[600, 700], %x: f32[8, 64, 96], %s: f32[]) -> (f32[], f32[8, 96]) {
  %sq = fused(%g16) : f32[600, 700] {
    graph @fused(%a: bf16[600, 700]) -> (f32[600, 700]) {
      %g = cast(%a) {to = f32} : f32[600, 700]
      %q = mul(%g, %g) : f32[600, 700]
      return %q
    }
  }
  %n = reduce_sum(%sq) {keepdims = 0} : f32[]
  %xs = fused(%x, %s) : f32[8, 64, 96] {
    graph @fused(%b: f32[8, 64, 96], %c: f32[]) -> (f32[8, 64, 96]) {
      %h = constant() {value = dense<f32[]>[0.5]} : f32[]
      %e = exp(%b) : f32[8, 64, 96]
      %m = mul(%e, %c) : f32[8, 64, 96]
      %r = add(%m, %h) : f32[8, 64, 96]
      return %r
    }
  }
  %p = reduce_mean(%xs) {axes = [1], keepdims = 0} : f32[8, 96]
  return %n, %p })"},
    // Gather's transpose (an embedding's gradient): repeated and negative indices accumulate
    // through atomics; into zeros the output is cleared by a memset, not copied from a buffer.
    {"scatter-add", R"(graph @g(%gy: f32[4, 3, 8], %d: f32[6, 8], %h: bf16[2, 3, 5], %hd: bf16[2, 4, 5]) -> (f32[6, 8], f32[6, 8], bf16[2, 4, 5]) {
  %i = constant() {value = dense<i64[4, 3]>[0, 5, -1, 2, 2, 2, 0, 1, 3, 5, 5, 0]} : i64[4, 3]
  %c = constant() {value = dense<f32[]>[0.0]} : f32[]
  %z = expand(%c) {shape = [6, 8]} : f32[6, 8]
  %s = scatter_add(%z, %i, %gy) : f32[6, 8]
  %t = scatter_add(%d, %i, %gy) : f32[6, 8]
  %j = constant() {value = dense<i32[3]>[3, 1, 3]} : i32[3]
  %u = scatter_add(%hd, %j, %h) {axis = 1} : bf16[2, 4, 5]
  return %s, %t, %u })"},
    {"gemm", R"(graph @g(%a: f32[2, 3, 8], %b: f32[8, 5], %w: f32[6, 8], %bias: f32[6]) -> (f32[2, 3, 5], f32[2, 3, 6]) {
  %m = matmul(%a, %b) : f32[2, 3, 5]
  %l = linear(%a, %w, %bias) : f32[2, 3, 6]
  return %m, %l })"},
    {"gemm-bf16", R"(graph @g(%a: bf16[4, 16], %b: bf16[2, 16, 8]) -> (bf16[2, 4, 8]) {
  %m = matmul(%a, %b) : bf16[2, 4, 8]
  return %m })"},
    {"conv-pool", R"(graph @g(%x: f32[2, 3, 9, 9], %w: f32[4, 3, 3, 3], %b: f32[4]) -> (f32[2, 4, 4, 4], f32[2, 4, 2, 2], f32[2, 4, 2, 2]) {
  %c = conv(%x, %w, %b) {strides = [2, 2], pads = [1, 1, 1, 1]} : f32[2, 4, 5, 5]
  %r = relu(%c) : f32[2, 4, 5, 5]
  %p = max_pool(%r) {kernel_shape = [2, 2], strides = [1, 1]} : f32[2, 4, 4, 4]
  %q = avg_pool(%r) {kernel_shape = [3, 3], strides = [2, 2]} : f32[2, 4, 2, 2]
  %s = avg_pool(%r) {kernel_shape = [2, 2], strides = [2, 2], pads = [0, 0, 1, 1], count_include_pad = 1} : f32[2, 4, 3, 3]
  %t = slice(%s) {starts = [0, 0], ends = [2, 2], axes = [2, 3]} : f32[2, 4, 2, 2]
  return %p, %q, %t })"},
    // Conv through im2col + cuBLASLt: groups, strides, asymmetric pads, dilations, bias with the
    // relu as the GEMM epilogue, and a 1x1 conv that reads x as its columns.
    {"conv-gemm-f32", R"(graph @g(%x: f32[2, 4, 9, 9], %w: f32[6, 2, 3, 3], %b: f32[6], %v: f32[5, 4, 1, 1], %c: f32[5]) -> (f32[2, 6, 3, 4], f32[2, 5, 9, 9], f32[2, 6, 3, 4]) {
  %k = conv(%x, %w, %b) {groups = 2, strides = [2, 2], pads = [1, 1, 0, 1], dilations = [2, 2]} : f32[2, 6, 3, 4]
  %r = relu(%k) : f32[2, 6, 3, 4]
  %p = conv(%x, %v, %c) : f32[2, 5, 9, 9]
  %n = conv(%x, %w) {groups = 2, strides = [2, 2], pads = [1, 1, 0, 1], dilations = [2, 2]} : f32[2, 6, 3, 4]
  return %r, %p, %n })"},
    // bf16 accumulates in f32 and rounds once: the bias is in the GEMM's C, not added after.
    {"conv-gemm-bf16", R"(graph @g(%x: bf16[2, 4, 9, 9], %w: bf16[6, 2, 3, 3], %b: bf16[6], %s: bf16[2, 4, 12], %sw: bf16[3, 4, 3], %sb: bf16[3]) -> (bf16[2, 6, 3, 4], bf16[2, 3, 5], bf16[2, 6, 3, 4]) {
  %k = conv(%x, %w, %b) {groups = 2, strides = [2, 2], pads = [1, 1, 0, 1], dilations = [2, 2]} : bf16[2, 6, 3, 4]
  %r = relu(%k) : bf16[2, 6, 3, 4]
  %d = conv(%s, %sw, %sb) {strides = [2], pads = [1, 0], dilations = [2]} : bf16[2, 3, 5]
  %e = conv(%x, %w, %b) {groups = 2, strides = [2, 2], pads = [1, 1, 0, 1], dilations = [2, 2]} : bf16[2, 6, 3, 4]
  return %r, %d, %e })"},
    {"linear-relu", R"(graph @g(%x: f32[6, 16], %w: f32[12, 16], %b: f32[12], %v: f32[12, 5]) -> (f32[6, 12], f32[6, 5]) {
  %h = linear(%x, %w, %b) : f32[6, 12]
  %y = relu(%h) : f32[6, 12]
  %m = matmul(%y, %v) : f32[6, 5]
  %r = relu(%m) : f32[6, 5]
  return %y, %r })"},
    {"linear-gelu-tanh", R"(graph @g(%x: f32[6, 16], %w: f32[12, 16], %b: f32[12]) -> (f32[6, 12], f32[6, 12]) {
  %h = linear(%x, %w, %b) : f32[6, 12]
  %y = gelu(%h) {approximate = "tanh"} : f32[6, 12]
  %n = linear(%x, %w) : f32[6, 12]
  %z = gelu(%n) {approximate = "tanh"} : f32[6, 12]
  return %y, %z })"},
    {"data-movement", R"(graph @g(%x: f32[2, 3, 4]) -> (f32[4, 3, 2], f32[2, 3, 2], f32[2, 6, 4], f32[2, 3, 4], f32[2, 3, 3], f32[2, 5, 6], f32[2, 3, 4], f32[12, 2]) {
  // Constant indices: random ones would fall outside the axis, which is an error.
  %i = constant() {value = dense<i64[3]>[2, -1, 0]} : i64[3]
  %t = transpose(%x) : f32[4, 3, 2]
  %s = slice(%x) {starts = [3], ends = [0], steps = [-2], axes = [2]} : f32[2, 3, 2]
  %c = concat(%x, %x) {axis = 1} : f32[2, 6, 4]
  %sp0, %sp1 = split(%x) {axis = 2, sizes = [1, 3]} : f32[2, 3, 1], f32[2, 3, 3]
  %g = gather(%x, %i) {axis = 1} : f32[2, 3, 4]
  %p = pad(%x) {pads = [0, 1, 1, 0, 1, 1], mode = "edge"} : f32[2, 5, 6]
  %e = expand(%sp0) {shape = [2, 3, 4]} : f32[2, 3, 4]
  %r = reshape(%t) {shape = [12, 2]} : f32[12, 2]
  return %t, %s, %c, %e, %sp1, %p, %g, %r })"},
    // Row groups from fuse-rows, one kernel each (fused_rows.cpp): block per row with 16-byte
    // vectors, lanes sharing a block for short rows, scalar loads for odd rows, general broadcasts.
    {"rows-rms-residual-bf16", R"(graph @g(%x: bf16[33, 4096], %r: bf16[33, 4096], %w: bf16[4096]) -> (bf16[33, 4096], bf16[33, 4096]) {
  %y, %h = fused(%x, %r, %w) : bf16[33, 4096], bf16[33, 4096] {
    graph @body(%a: bf16[33, 4096], %b: bf16[33, 4096], %c: bf16[4096]) -> (bf16[33, 4096], bf16[33, 4096]) {
      %h = add(%a, %b) : bf16[33, 4096]
      %y = rms_norm(%h, %c) {epsilon = 1e-5} : bf16[33, 4096]
      return %y, %h
    }
  }
  return %y, %h })"},
    {"rows-layer-norm-residual-f16", R"(graph @g(%x: f16[37, 96], %r: f16[37, 96], %w: f16[96], %b: f16[96]) -> (f16[37, 96], f16[37, 96]) {
  %y, %h = fused(%x, %r, %w, %b) : f16[37, 96], f16[37, 96] {
    graph @body(%a: f16[37, 96], %c: f16[37, 96], %d: f16[96], %e: f16[96]) -> (f16[37, 96], f16[37, 96]) {
      %h = add(%a, %c) : f16[37, 96]
      %y = layer_norm(%h, %d, %e) : f16[37, 96]
      return %y, %h
    }
  }
  return %y, %h })"},
    {"rows-softmax-scale-mask", R"(graph @g(%s: f32[2, 3, 5, 40], %m: f32[2, 1, 1, 40]) -> (f16[2, 3, 5, 40], f32[2, 3, 5, 40]) {
  %p, %l = fused(%s, %m) : f16[2, 3, 5, 40], f32[2, 3, 5, 40] {
    graph @body(%a: f32[2, 3, 5, 40], %b: f32[2, 1, 1, 40]) -> (f16[2, 3, 5, 40], f32[2, 3, 5, 40]) {
      %k = constant() {value = dense<f32[]>[0.125]} : f32[]
      %t = mul(%a, %k) : f32[2, 3, 5, 40]
      %u = add(%t, %b) : f32[2, 3, 5, 40]
      %q = softmax(%u) {axis = -1} : f32[2, 3, 5, 40]
      %p = cast(%q) {to = f16} : f16[2, 3, 5, 40]
      %l = log_softmax(%u) {axis = 3} : f32[2, 3, 5, 40]
      return %p, %l
    }
  }
  return %p, %l })"},
    {"rows-decomposed-odd-general", R"(graph @g(%x: f32[6, 256], %w: f32[256], %o: f16[5, 7], %z: f32[3, 10, 48], %v: f32[48]) -> (f32[6, 256], f32[6], f16[5, 7], f32[3, 10, 48]) {
  %y, %ms = fused(%x, %w) : f32[6, 256], f32[6] {
    graph @body(%a: f32[6, 256], %c: f32[256]) -> (f32[6, 256], f32[6]) {
      %two = constant() {value = dense<f32[]>[2]} : f32[]
      %eps = constant() {value = dense<f32[]>[1e-6]} : f32[]
      %sq = pow(%a, %two) : f32[6, 256]
      %ms = reduce_mean(%sq) {axes = [-1], keepdims = 0} : f32[6]
      %mk = reduce_mean(%sq) {axes = [-1]} : f32[6, 1]
      %e = add(%mk, %eps) : f32[6, 1]
      %rs = rsqrt(%e) : f32[6, 1]
      %n = mul(%a, %rs) : f32[6, 256]
      %y = mul(%n, %c) : f32[6, 256]
      return %y, %ms
    }
  }
  %ls = fused(%o) : f16[5, 7] {
    graph @body(%a: f16[5, 7]) -> (f16[5, 7]) {
      %ls = log_softmax(%a) {axis = 1} : f16[5, 7]
      return %ls
    }
  }
  %rn = fused(%z, %v) : f32[3, 10, 48] {
    graph @body(%a: f32[3, 10, 48], %b: f32[48]) -> (f32[3, 10, 48]) {
      %rn = rms_norm(%a, %b) {axis = 1} : f32[3, 10, 48]
      return %rn
    }
  }
  return %y, %ms, %ls, %rn })"},
    // GEMM epilogues (gemm_epilogue.cpp): residual add as C with beta 1 after the bias, and a
    // batched matmul + bias add + tanh gelu folded into one GEMM with the bias epilogue. (f32
    // only: the fused GEMM rounds once where the reference rounds the product and then the sum,
    // which in bf16 can differ by more than the tolerance where the sum cancels.)
    {"gemm-residual-epilogues", R"(graph @g(%x: f32[64, 32], %w: f32[48, 32], %b: f32[48], %r: f32[64, 48], %a: f32[2, 40, 32], %v: f32[32, 24], %c: f32[24]) -> (f32[64, 48], f32[2, 40, 24]) {
  %h = linear(%x, %w, %b) : f32[64, 48]
  %y = add(%r, %h) : f32[64, 48]
  %m = matmul(%a, %v) : f32[2, 40, 24]
  %s = add(%m, %c) : f32[2, 40, 24]
  %g = gelu(%s) {approximate = "tanh"} : f32[2, 40, 24]
  return %y, %g })"},
    // fuse-horizontal's form: one batched GEMM (A broadcast), split pieces as views.
    {"horizontal-split-views", R"(graph @g(%x: f32[2, 40, 32], %w: f32[3, 32, 24]) -> (f32[2, 40, 24], f32[2, 40, 24]) {
  %rows = reshape(%x) {shape = [80, 32]} : f32[80, 32]
  %s = matmul(%rows, %w) : f32[3, 80, 24]
  %q, %k, %v = split(%s) {axis = 0, sizes = [1, 1, 1]} : f32[1, 80, 24], f32[1, 80, 24], f32[1, 80, 24]
  %kr = reshape(%k) {shape = [2, 40, 24]} : f32[2, 40, 24]
  %vr = reshape(%v) {shape = [2, 40, 24]} : f32[2, 40, 24]
  %y = mul(%kr, %vr) : f32[2, 40, 24]
  return %y, %vr })"},
    // Transposes folded into trans_a/trans_b of the gemm (fold_transpose).
    {"gemm-transposed-operands", R"(graph @g(%q: f32[2, 80, 16], %k: f32[2, 80, 16], %a: f32[32, 96]) -> (f32[2, 80, 80], f32[96, 96]) {
  %kt = transpose(%k) {perm = [0, 2, 1]} : f32[2, 16, 80]
  %s = matmul(%q, %kt) : f32[2, 80, 80]
  %at = transpose(%a) : f32[96, 32]
  %b2 = matmul(%at, %a) : f32[96, 96]
  return %s, %b2 })"},
    // matmul_acc: bf16 products summed into an f32 c (a transposed a read in place, c
    // overwritten in place), an f32 one into an input c and into a returned sum (new buffers).
    {"gemm-accumulate", R"(graph @g(%g: bf16[96, 40], %x: bf16[96, 24], %s: f32[40, 24], %h: f32[16, 24], %y: f32[24, 8], %t: f32[16, 8]) -> (f32[40, 24], f32[16, 8], f32[16, 8]) {
  %gt = transpose(%g) : bf16[40, 96]
  %e = exp(%s) : f32[40, 24]
  %a1 = matmul_acc(%gt, %x, %e) : f32[40, 24]
  %a2 = matmul_acc(%h, %y, %t) : f32[16, 8]
  %a3 = matmul_acc(%h, %y, %a2) : f32[16, 8]
  return %a1, %a2, %a3 })"},
    // Pointwise groups holding data-movement ops, one kernel each (pointwise_index.cpp): the
    // Llama RoPE (view, head transpose, rotate-half slices, neg, concat, cos/sin mul/add).
    {"fused-rope-bf16", R"(graph @g(%q: bf16[2, 16, 128], %cos: bf16[1, 1, 16, 32], %sin: bf16[1, 1, 16, 32]) -> (bf16[2, 4, 16, 32]) {
  %y = fused(%q, %cos, %sin) : bf16[2, 4, 16, 32] {
    graph @body(%x: bf16[2, 16, 128], %c: bf16[1, 1, 16, 32], %s: bf16[1, 1, 16, 32]) -> (bf16[2, 4, 16, 32]) {
      %v = reshape(%x) {shape = [2, 16, 4, 32]} : bf16[2, 16, 4, 32]
      %t = transpose(%v) {perm = [0, 2, 1, 3]} : bf16[2, 4, 16, 32]
      %lo = slice(%t) {axes = [3], starts = [0], ends = [16]} : bf16[2, 4, 16, 16]
      %hi = slice(%t) {axes = [3], starts = [16], ends = [9223372036854775807]} : bf16[2, 4, 16, 16]
      %n = neg(%hi) : bf16[2, 4, 16, 16]
      %rot = concat(%n, %lo) {axis = -1} : bf16[2, 4, 16, 32]
      %a = mul(%t, %c) : bf16[2, 4, 16, 32]
      %b = mul(%rot, %s) : bf16[2, 4, 16, 32]
      %y = add(%a, %b) : bf16[2, 4, 16, 32]
      return %y
    }
  }
  return %y })"},
    {"fused-rope-f32", R"(graph @g(%q: f32[1, 8, 64], %cos: f32[8, 16], %sin: f32[8, 16]) -> (f32[1, 4, 8, 16]) {
  %y = fused(%q, %cos, %sin) : f32[1, 4, 8, 16] {
    graph @body(%x: f32[1, 8, 64], %c: f32[8, 16], %s: f32[8, 16]) -> (f32[1, 4, 8, 16]) {
      %v = reshape(%x) {shape = [1, 8, 4, 16]} : f32[1, 8, 4, 16]
      %t = transpose(%v) {perm = [0, 2, 1, 3]} : f32[1, 4, 8, 16]
      %lo = slice(%t) {axes = [3], starts = [0], ends = [8]} : f32[1, 4, 8, 8]
      %hi = slice(%t) {axes = [3], starts = [8], ends = [16]} : f32[1, 4, 8, 8]
      %n = neg(%hi) : f32[1, 4, 8, 8]
      %rot = concat(%n, %lo) {axis = 3} : f32[1, 4, 8, 16]
      %c4 = unsqueeze(%c) {axes = [0, 1]} : f32[1, 1, 8, 16]
      %s4 = unsqueeze(%s) {axes = [0, 1]} : f32[1, 1, 8, 16]
      %a = mul(%t, %c4) : f32[1, 4, 8, 16]
      %b = mul(%rot, %s4) : f32[1, 4, 8, 16]
      %y = add(%a, %b) : f32[1, 4, 8, 16]
      return %y
    }
  }
  return %y })"},
    // Transpose + add, a concat of computed values, slices with steps 2 and -2, an expand and a
    // reshape that merges dims, in one group with two outputs.
    {"fused-movement-mix", R"(graph @g(%x: f32[3, 4], %y: f32[4, 3], %z: f32[4, 6], %b: f32[4, 1], %r: f32[2, 6]) -> (f32[4, 3], f32[4, 3]) {
  %o1, %o2 = fused(%x, %y, %z, %b, %r) : f32[4, 3], f32[4, 3] {
    graph @body(%x: f32[3, 4], %y: f32[4, 3], %z: f32[4, 6], %b: f32[4, 1], %r: f32[2, 6]) -> (f32[4, 3], f32[4, 3]) {
      %t = transpose(%x) : f32[4, 3]
      %s = add(%t, %y) : f32[4, 3]
      %e = exp(%y) : f32[4, 3]
      %two = constant() {value = dense<f32[]>[2]} : f32[]
      %m = mul(%t, %two) : f32[4, 3]
      %c = concat(%e, %m) {axis = 1} : f32[4, 6]
      %st = slice(%c) {axes = [1], starts = [5], ends = [-7], steps = [-2]} : f32[4, 3]
      %zs = slice(%z) {axes = [1], starts = [0], ends = [6], steps = [2]} : f32[4, 3]
      %x2 = expand(%b) {shape = [4, 3]} : f32[4, 3]
      %rr = reshape(%r) {shape = [4, 3]} : f32[4, 3]
      %u = add(%st, %zs) : f32[4, 3]
      %w = mul(%x2, %rr) : f32[4, 3]
      %o1 = add(%u, %w) : f32[4, 3]
      %o2 = sub(%s, %o1) : f32[4, 3]
      return %o1, %o2
    }
  }
  return %o1, %o2 })"},
    {"batch-norm", R"(graph @g(%x: f32[2, 3, 4], %s: f32[3], %b: f32[3], %m: f32[3], %v: f32[3]) -> (f32[2, 3, 4]) {
  %av = abs(%v) : f32[3]
  %y = batch_norm(%x, %s, %b, %m, %av) : f32[2, 3, 4]
  return %y })"},
};

/// The padding mask chunk-cross-entropy adds to a head padded from 50257 to 50304 columns:
/// 0 for the vocabulary, `pad` (-1e30 or -inf) for the padding, in `dt`.
std::string padding_mask(const std::string& dt, const std::string& pad) {
  return "  %col = range() {start = 0.0, limit = 50304.0, delta = 1.0, dtype = i64} : i64[50304]\n"
         "  %vocab = constant() {value = dense<i64[]>[50257]} : i64[]\n"
         "  %real = less(%col, %vocab) : bool[50304]\n"
         "  %zero = constant() {value = dense<" + dt + "[]>[0.0]} : " + dt + "[]\n"
         "  %pad = constant() {value = dense<" + dt + "[]>[" + pad + "]} : " + dt + "[]\n"
         "  %mask = where(%real, %zero, %pad) : " + dt + "[50304]\n";
}

/// cross_entropy and cross_entropy_grad (cross_entropy.cpp) against the reference: rows of the
/// GPT-2 head's padded width, f32 and bf16 logits, ignored rows, -1e30 and -inf padding (whose
/// columns must get gradient exactly 0), the upstream gradient's scale. The targets are given
/// (classes at both ends of the vocabulary and ignored rows).
struct LossCase {
  std::string name, text;
  kiln::Tensor targets;
};

std::vector<LossCase> loss_cases() {
  auto targets = [](kiln::DType t, std::vector<int64_t> v, std::vector<int64_t> shape = {}) {
    if (shape.empty()) shape = {static_cast<int64_t>(v.size())};
    return kiln::Tensor::from_i64(t, shape, v);
  };
  std::vector<LossCase> cases;
  cases.push_back({"cross-entropy-f32-padded-1e30",
                   "graph @g(%x: f32[6, 50304], %t: i64[6], %d: f32[]) -> (f32[], f32[], f32[6, 50304], f32[], f32[6, 50304]) {\n" +
                       padding_mask("f32", "-1e30") +
                       "  %l = add(%x, %mask) : f32[6, 50304]\n"
                       "  %cm = cross_entropy(%l, %t) : f32[]\n"
                       "  %cs = cross_entropy(%l, %t) {reduction = \"sum\"} : f32[]\n"
                       "  %g = cross_entropy_grad(%l, %t, %d) : f32[6, 50304]\n"
                       "  %cw, %gw = cross_entropy_with_grad(%l, %t, %d) : f32[], f32[6, 50304]\n"
                       "  return %cm, %cs, %g, %cw, %gw }",
                   targets(kiln::DType::kI64, {0, 50256, -100, 17, -100, 31337})});
  cases.push_back({"cross-entropy-bf16-padded-inf",
                   "graph @g(%x: bf16[5, 50304], %t: i32[5], %d: f32[]) -> (f32[], bf16[5, 50304], f32[5, 50304], f32[], bf16[5, 50304]) {\n" +
                       padding_mask("bf16", "-inf") +
                       "  %l = add(%x, %mask) : bf16[5, 50304]\n"
                       "  %c = cross_entropy(%l, %t) {dtype = f32, ignore_index = 5} : f32[]\n"
                       "  %g = cross_entropy_grad(%l, %t, %d) {ignore_index = 5} : bf16[5, 50304]\n"
                       "  %gf = cross_entropy_grad(%l, %t, %d) {ignore_index = 5, dtype = f32} : f32[5, 50304]\n"
                       "  %cw, %gw = cross_entropy_with_grad(%l, %t, %d) {dtype = f32, grad_dtype = bf16, ignore_index = 5} : "
                       "f32[], bf16[5, 50304]\n"
                       "  return %c, %g, %gf, %cw, %gw }",
                   targets(kiln::DType::kI32, {5, 50256, 1, 5, 0})});
  // Rows that 16-byte loads do not tile (1001 classes) and logits with two leading dims.
  cases.push_back({"cross-entropy-odd-rows",
                   "graph @g(%x: f32[2, 3, 1001], %t: i64[2, 3], %d: f32[]) -> (f32[], f32[2, 3, 1001]) {\n"
                   "  %c = cross_entropy(%x, %t) {ignore_index = 2} : f32[]\n"
                   "  %g = cross_entropy_grad(%x, %t, %d) {ignore_index = 2} : f32[2, 3, 1001]\n"
                   "  return %c, %g }",
                   targets(kiln::DType::kI64, {1000, 2, 0, 999, 2, 500}, {2, 3})});
  return cases;
}

/// Every padding column of `grad` ([rows, 50304] from column 50257 on) is exactly 0.
std::string padding_is_zero(const kiln::Tensor& grad) {
  const int64_t cols = grad.shape().back(), rows = grad.numel() / cols;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 50257; c < cols; ++c)
      if (grad.get_f64(r * cols + c) != 0.0)
        return "padding column " + std::to_string(c) + " of row " + std::to_string(r) + " has gradient " +
               std::to_string(grad.get_f64(r * cols + c));
  return "";
}

/// assert_close's defaults per dtype (exact for integers and bools); NaN and misplaced
/// infinities fail (tensor_compare.h).
std::string compare(const Tensor& want, const Tensor& got) {
  return test::assert_close(want, got).why;
}

/// A linear's backward as autodiff leaves it: dW = dyᵀ·x (or xᵀ·dy when `x_first`) over the
/// rows [rows, n] and [rows, k], and db = Σ_rows dy (keepdims), which the GEMM computes as its
/// bias-gradient epilogue where cuBLASLt's kernels take the sizes (bias_grad.cpp); `cast_first`
/// reads db before the GEMM, which then runs early. Odd sizes keep the reduction kernel.
std::string linear_backward(int64_t rows, int64_t n, int64_t k, const std::string& t, bool x_first, bool cast_first) {
  const std::string R = std::to_string(rows), N = std::to_string(n), K = std::to_string(k);
  const std::string w = x_first ? "[" + K + ", " + N + "]" : "[" + N + ", " + K + "]";
  const std::string cast = "  %dbf = cast(%db) {to = f32} : f32[1, " + N + "]\n";
  std::string text = "graph @g(%dy: " + t + "[" + R + ", " + N + "], %x: " + t + "[" + R + ", " + K + "]) -> (" + t + w +
                     ", f32[1, " + N + "]) {\n  %db = reduce_sum(%dy) {axes = [0], keepdims = 1} : " + t + "[1, " + N + "]\n";
  if (cast_first) text += cast;
  text += x_first ? "  %xt = transpose(%x) : " + t + "[" + K + ", " + R + "]\n  %dw = matmul(%xt, %dy) : " + t + w + "\n"
                  : "  %dt = transpose(%dy) : " + t + "[" + N + ", " + R + "]\n  %dw = matmul(%dt, %x) : " + t + w + "\n";
  if (!cast_first) text += cast;
  return text + "  return %dw, %dbf\n}";
}

struct LongSumCase {
  const char* name;
  int64_t rows, n, k;
  const char* dtype;
  bool x_first, cast_first, separate;  // separate: KILN_GEMM_BGRAD_SEPARATE=1 (no epilogue kernel)
};

// GPT-2 small's weight and bias gradients over B*T = 4096 rows (proj/out, qkv, fc), f32, the xᵀ·dy
// form, the early GEMM, sizes that keep the reduction kernel, and the runtime's separate bias
// GEMM for when cuBLASLt has no kernel with the epilogue.
const LongSumCase kLongSumCases[] = {
    {"bgrad 4096x768x768 bf16", 4096, 768, 768, "bf16", false, false, false},
    {"bgrad 4096x2304x768 bf16", 4096, 2304, 768, "bf16", false, true, false},
    {"bgrad 4096x3072x768 bf16", 4096, 3072, 768, "bf16", false, false, false},
    {"bgrad 4096x768x3072 bf16", 4096, 768, 3072, "bf16", false, true, false},
    {"bgrad 1024x256x128 f32", 1024, 256, 128, "f32", false, false, false},
    {"bgrad xT.dy 2048x384x256 bf16", 2048, 384, 256, "bf16", true, false, false},
    {"bgrad xT.dy 512x96x160 f32", 512, 96, 160, "f32", true, true, false},
    {"bgrad odd 1000x90x36 bf16 (reduction kernel)", 1000, 90, 36, "bf16", false, false, false},
    {"bgrad odd 777x200x72 f32 (reduction kernel)", 777, 200, 72, "f32", true, false, false},
    {"bgrad separate 2048x768x256 bf16", 2048, 768, 256, "bf16", false, false, true},
    {"bgrad separate xT.dy 1024x256x128 f32", 1024, 256, 128, "f32", true, true, true},
};

/// Column sums (column_reduce.cpp) over `rows` rows: a layer norm's weight and bias gradients
/// over GPT-2's 4096 rows (f32, bf16, with row-chunk partials), an f16 mean, column tiles that
/// need no second pass, and odd columns and short sums on the general kernels.
struct ColumnCase {
  const char* name;
  const char* text;
  int64_t rows;
};
const ColumnCase kColumnCases[] = {
    {"column sums 4096 rows", R"(graph @g(%gx: f32[8, 512, 768], %g: bf16[8, 512, 768], %w: f16[4096, 3072]) -> (f32[1, 1, 768], bf16[768], f16[3072]) {
  %a = reduce_sum(%gx) {axes = [0, 1], keepdims = 1} : f32[1, 1, 768]
  %b = reduce_sum(%g) {axes = [0, 1], keepdims = 0} : bf16[768]
  %c = reduce_mean(%w) {axes = [0], keepdims = 0} : f16[3072]
  return %a, %b, %c })", 4096},
    {"column sums wide, odd, short", R"(graph @g(%x: f32[128, 3072, 128], %h: bf16[3000, 90], %p: f32[8, 512, 768], %b: bf16[200, 8200]) -> (f32[1, 3072, 128], bf16[90], f32[1, 512, 768], bf16[8200]) {
  %s = reduce_sum(%x) {axes = [0], keepdims = 1} : f32[1, 3072, 128]
  %t = reduce_sum(%h) {axes = [0], keepdims = 0} : bf16[90]
  %e = reduce_sum(%p) {axes = [0], keepdims = 1} : f32[1, 512, 768]
  %u = reduce_sum(%b) {axes = [0], keepdims = 0} : bf16[8200]
  return %s, %t, %e, %u })", 3000},
};

/// assert_close's rtol with an atol for sums of `k` products of [-1, 1) values accumulated in f32
/// in another order than the reference's: partial sums reach ~sqrt(k), each of k additions may
/// round by 2^-24 of that.
std::string compare_long_sum(const Tensor& want, const Tensor& got, int64_t k) {
  test::Tolerance tol = test::assert_close_tolerance(want.dtype());
  tol.atol = std::max(tol.atol, static_cast<double>(k) * std::sqrt(static_cast<double>(k)) * 0x1p-24);
  return test::allclose(want, got, tol).why;
}

}  // namespace

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  int failures = 0;
  for (const Case& c : kCases) failures += report_case(c.name, gpu_matches_reference(c.text, c.name, 7, compare));
  const std::vector<LossCase> losses = loss_cases();
  for (const LossCase& c : losses) {
    auto check = [](const Tensor& want, const Tensor& got) {
      std::string why = compare(want, got);
      if (why.empty() && got.shape().size() == 2 && got.shape().back() == 50304) why = padding_is_zero(got);
      return why;
    };
    failures += report_case(c.name, gpu_matches_reference(c.text, c.name, 11, check, {{"t", c.targets}}));
  }
  for (const LongSumCase& c : kLongSumCases) {
    if (c.separate) setenv("KILN_GEMM_BGRAD_SEPARATE", "1", 1);
    const std::string text = linear_backward(c.rows, c.n, c.k, c.dtype, c.x_first, c.cast_first);
    failures += report_case(c.name, gpu_matches_reference(text, c.name, 7, [&](const Tensor& want, const Tensor& got) {
                              return compare_long_sum(want, got, c.rows);
                            }));
    unsetenv("KILN_GEMM_BGRAD_SEPARATE");
  }
  for (const ColumnCase& c : kColumnCases)
    failures += report_case(c.name, gpu_matches_reference(c.text, c.name, 7, [&](const Tensor& want, const Tensor& got) {
                              return compare_long_sum(want, got, c.rows);
                            }));
  const size_t total = sizeof(kCases) / sizeof(kCases[0]) + losses.size() + sizeof(kLongSumCases) / sizeof(kLongSumCases[0]) +
                       sizeof(kColumnCases) / sizeof(kColumnCases[0]);
  std::printf("%d of %zu cases failed\n", failures, total);
  return failures == 0 ? 0 : 1;
}
