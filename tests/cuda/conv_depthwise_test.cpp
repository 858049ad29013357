// Depthwise convs lowered to the generated kernel (conv_depthwise.cpp) with the ops after them
// applied in its store (conv_tail.cpp): which convs take it, what it absorbs, its tiling, and
// that its source compiles for every target.
#include <doctest/doctest.h>

#include <algorithm>

#include "conv_depthwise_graphs.h"
#include "kiln/cuda/lowering.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST_CASE(
    "a depthwise conv with bias, batch norm and a fused silu + residual group is one kernel") {
  // EfficientNet's shape of block: 5x5 stride-2 depthwise conv, batch norm, then swish and a
  // residual add, grouped by fuse-pointwise.
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[2, 24, 15, 15], %w: f32[24, 1, 5, 5], %b: f32[24], %s: f32[24], %t: f32[24], %m: f32[24], %v: f32[24], %r: f32[2, 24, 8, 8]) -> (f32[2, 24, 8, 8]) {
  %c = conv(%x, %w, %b) {groups = 24, strides = [2, 2], pads = [2, 2, 2, 2]} : f32[2, 24, 8, 8]
  %n = batch_norm(%c, %s, %t, %m, %v) {epsilon = 0.001} : f32[2, 24, 8, 8]
  %y = fused(%n, %r) : f32[2, 24, 8, 8] {
    graph @body(%p: f32[2, 24, 8, 8], %q: f32[2, 24, 8, 8]) -> (f32[2, 24, 8, 8]) {
      %a = silu(%p) : f32[2, 24, 8, 8]
      %o = add(%a, %q) : f32[2, 24, 8, 8]
      return %o
    }
  }
  return %y
})");
  CHECK(l.kernels == std::vector<std::string>{"k0_conv_depthwise"});
  const auto st = steps(l.plan);
  REQUIRE(st.size() == 1);
  // x, w, b, the batch norm's four vectors, the residual, then y (the graph output, named after
  // it).
  CHECK(has(st[0], "step launch kernel=k0_conv_depthwise grid="));
  CHECK(has(st[0], " block=256,1,1 smem=0 args=b0,b1,b2,b3,b4,b5,b6,b7,b8"));
  CHECK(plan_lines(l.plan, "buffer 8")[0].find("kind=output dtype=f32 shape=2x24x8x8") !=
        std::string::npos);
  CHECK(plan_lines(l.plan, "buffer 8")[0].find("name=y") != std::string::npos);
  // The per-channel vectors are read at c, the residual at the output's own index.
  CHECK(has(l.source, "tail0[(long long)c * 1LL]"));
  CHECK(has(l.source,
            "tail4[(long long)n * 1536LL + (long long)c * 64LL + (long long)p * 8LL + (long long)q "
            "* 1LL]"));
  CHECK(has(l.source, "constexpr int SH = 2, SW = 2, DH = 1, DW = 1, PT = 2, PL = 2"));
  compiles_everywhere(l);
}

TEST_CASE(
    "ConvNeXt's 7x7 depthwise convs: one kernel each, tiles of rows or of whole planes and "
    "channels") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[8, 96, 56, 56], %w: f32[96, 1, 7, 7], %b: f32[96], %u: f32[8, 768, 7, 7], %v: f32[768, 1, 7, 7], %e: f32[768]) -> (f32[8, 96, 56, 56], f32[8, 768, 7, 7]) {
  %c = conv(%x, %w, %b) {groups = 96, pads = [3, 3, 3, 3]} : f32[8, 96, 56, 56]
  %d = conv(%u, %v, %e) {groups = 768, pads = [3, 3, 3, 3]} : f32[8, 768, 7, 7]
  return %c, %d
})");
  CHECK(l.kernels == std::vector<std::string>{"k0_conv_depthwise", "k1_conv_depthwise"});
  // 56x56: 4 outputs per thread, 14 thread columns, two tiles of 28 rows per plane.
  CHECK(has(l.source,
            "constexpr int V = 4, GQ = 14, TQ = 56, QT = 1, TP = 28, PTILES = 2, CB = 1, CT = 96, "
            "IH = 34, "
            "IW = 62, IWP = 63;"));
  // 7x7: whole planes, 36 channels per block.
  CHECK(has(
      l.source,
      "constexpr int V = 4, GQ = 2, TQ = 8, QT = 1, TP = 7, PTILES = 1, CB = 36, CT = 22, IH = 13, "
      "IW = 14, IWP = 15;"));
  const auto st = steps(l.plan);
  REQUIRE(st.size() == 2);
  CHECK(has(st[0], "grid=1536,1,1 "));
  CHECK(has(st[1], "grid=176,1,1 "));
  compiles_everywhere(l);
}

TEST_CASE("half types, dilation, asymmetric pads, a channel multiplier and 1-D depthwise convs") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: bf16[2, 6, 11, 9], %w: bf16[12, 1, 3, 3], %h: f16[1, 8, 20], %k: f16[8, 1, 4], %kb: f16[8]) -> (bf16[2, 12, 8, 6], f16[1, 8, 10]) {
  %c = conv(%x, %w) {groups = 6, dilations = [2, 2], pads = [1, 0, 0, 1]} : bf16[2, 12, 8, 6]
  %y = relu(%c) : bf16[2, 12, 8, 6]
  %d = conv(%h, %k, %kb) {groups = 8, strides = [2], pads = [1, 1]} : f16[1, 8, 10]
  %z = fused(%d) : f16[1, 8, 10] {
    graph @body(%p: f16[1, 8, 10]) -> (f16[1, 8, 10]) {
      %a = constant() {value = dense<f16[]>[3.0]} : f16[]
      %s = add(%p, %a) : f16[1, 8, 10]
      %o = clip(%s) {min = 0.0, max = 6.0} : f16[1, 8, 10]
      return %o
    }
  }
  return %y, %z
})");
  CHECK(l.kernels == std::vector<std::string>{"k0_conv_depthwise", "k1_conv_depthwise"});
  CHECK(steps(l.plan).size() == 2);
  CHECK(has(l.source,
            "constexpr int C = 12, CIN = 6, MULT = 2, H = 11, W = 9, P = 8, Q = 6, R = 3, S = 3;"));
  CHECK(has(l.source, "constexpr int SH = 1, SW = 1, DH = 2, DW = 2, PT = 1, PL = 0,"));
  CHECK(has(l.source,
            "constexpr int C = 8, CIN = 8, MULT = 1, H = 1, W = 20, P = 1, Q = 10, R = 1, S = 4;"));
  CHECK(has(l.source, "__float2bfloat16_rn"));
  compiles_everywhere(l);
}

TEST_CASE(
    "what the depthwise kernel leaves alone: groups below the channels, option depthwise=cudnn, "
    "shared results") {
  const char* text = R"(
graph @g(%x: f32[2, 8, 10, 10], %w: f32[8, 1, 3, 3], %g: f32[8, 2, 3, 3]) -> (f32[2, 8, 10, 10], f32[2, 8, 10, 10], f32[2, 8, 10, 10]) {
  %c = conv(%x, %w) {groups = 8, pads = [1, 1, 1, 1]} : f32[2, 8, 10, 10]
  %y = relu(%c) : f32[2, 8, 10, 10]
  %d = conv(%x, %g) {groups = 4, pads = [1, 1, 1, 1]} : f32[2, 8, 10, 10]
  return %c, %y, %d
})";
  const LoweredGraph l = lower_text(text);
  // %c is an output as well as the relu's operand: the relu stays a kernel of its own.
  CHECK(l.kernels == std::vector<std::string>{"k0_conv_depthwise", "k1_relu"});
  CHECK(plan_lines(l.plan, "step conv").size() == 1);
  CHECK(has(plan_lines(l.plan, "step conv")[0], " groups=4 "));
  LoweringOptions cudnn;
  cudnn.depthwise = "cudnn";
  const LoweredGraph c = lower_text(text, cudnn);
  CHECK(c.kernels == std::vector<std::string>{"k0_relu"});
  CHECK(plan_lines(c.plan, "step conv").size() == 2);
}

TEST_CASE(
    "the GPU test's graphs take the depthwise kernel for every dtype and compile for every "
    "target") {
  for (const char* t : {"f32", "f16", "bf16"})
    for (const auto& c : test::kDepthwiseCases) {
      CAPTURE(c[0]);
      CAPTURE(t);
      const LoweredGraph l = lower_text(test::replace_all(c[1], "T[", std::string(t) + "["));
      CHECK(plan_lines(l.plan, "step conv").empty());
      for (const std::string& k : l.kernels) CHECK((has(k, "_conv_depthwise") || has(k, "_abs")));
      compiles_everywhere(l);
    }
}

TEST_CASE(
    "channels-last depthwise convs take their own kernel, with the ops after them, for every "
    "dtype") {
  for (const char* t : {"f32", "f16", "bf16"})
    for (const auto& c : test::kDepthwiseNhwcCases) {
      CAPTURE(c[0]);
      CAPTURE(t);
      const LoweredGraph l = lower_text(test::replace_all(c[1], "T[", std::string(t) + "["));
      CHECK(plan_lines(l.plan, "step conv").empty());
      CHECK_FALSE(l.kernels.empty());
      // Besides the conv kernels: a pool's sum of the tiles and the excite of a squeeze-excite block.
      for (const std::string& k : l.kernels)
        CHECK((has(k, "_conv_depthwise_nhwc") || has(k, "_tiles") || has(k, "_sigmoid") || has(k, "_mul")));
      compiles_everywhere(l);
    }
  // With depthwise = cudnn they are cuDNN conv steps (channels last).
  LoweringOptions o;
  o.depthwise = "cudnn";
  const LoweredGraph l =
      lower_text(test::replace_all(test::kDepthwiseNhwcCases[0][1], "T[", "f32["), o);
  REQUIRE(plan_lines(l.plan, "step conv").size() == 1);
  CHECK(has(plan_lines(l.plan, "step conv")[0], " layout=nhwc"));
}

TEST_CASE("the pointwise node before a channels-last depthwise conv runs on the conv's loads") {
  const std::string prologue = test::kDepthwiseNhwcCases[5][1],
                    single = test::kDepthwiseNhwcCases[6][1];
  for (const std::string& text : {prologue, single}) {
    const LoweredGraph l = lower_text(test::replace_all(text, "T[", "f32["));
    CHECK(l.kernels == std::vector<std::string>{"k0_conv_depthwise_nhwc"});
    CHECK(has(l.source, "#define PRO(e) pro(e)"));
    // The kernel reads the graph input %x itself: no activation buffer for the pointwise result.
    CHECK(plan_lines(l.plan, "kind=activation").empty());
  }
  // Not deferred: the pointwise result has another user, or the conv goes to cuDNN.
  const LoweredGraph shared = lower_text(R"(
graph @g(%x: f32[2, 16, 16, 8], %w: f32[8, 3, 3, 1]) -> (f32[2, 16, 16, 8], f32[2, 16, 16, 8]) {
  %s = sigmoid(%x) : f32[2, 16, 16, 8]
  %c = conv(%s, %w) {groups = 8, pads = [1, 1, 1, 1], layout = "nhwc"} : f32[2, 16, 16, 8]
  return %c, %s
})");
  REQUIRE(shared.kernels.size() == 2);
  CHECK(has(shared.kernels[0], "_sigmoid"));
  CHECK(has(shared.source, "#define PRO(e) (e)"));
  LoweringOptions o;
  o.depthwise = "cudnn";
  const LoweredGraph cudnn = lower_text(test::replace_all(single, "T[", "f32["), o);
  REQUIRE(cudnn.kernels.size() == 1);
  CHECK(has(cudnn.kernels[0], "_sigmoid"));
  CHECK(plan_lines(cudnn.plan, "step conv").size() == 1);
}

TEST_CASE("constant channels-last filters are read as stored: a block's filters are contiguous") {
  for (const char* t : {"f32", "f16", "bf16"}) {
    CAPTURE(t);
    const LoweredGraph l = lower_text(test::depthwise_nhwc_constant_graph(t));
    CHECK(l.kernels == std::vector<std::string>{"k0_conv_depthwise_nhwc", "k1_conv_depthwise_nhwc",
                                                "k2_conv_depthwise_nhwc"});
    CHECK(plan_lines(l.plan, "step conv").empty());
    compiles_everywhere(l);
  }
  const LoweredGraph l = lower_text(test::depthwise_nhwc_constant_graph("f32"));
  CHECK(has(l.plan, "kind=weight dtype=f32 shape=24x3x3x1 bytes=864 "));
  CHECK_FALSE(has(l.plan, "shape=9x24"));
  // The residual of the swish group is read at [n, p, q, c].
  CHECK(has(l.source,
            "tail0[(long long)n * 1176LL + (long long)p * 168LL + (long long)q * 24LL + (long "
            "long)c * 1LL]"));
}

TEST_CASE("a global pool of a channels-last depthwise conv's output is summed by the conv kernel") {
  const char* const* se = nullptr;
  for (const auto& c : test::kDepthwiseNhwcCases)
    if (std::string(c[0]).rfind("nhwc squeeze-excite", 0) == 0) se = c;
  REQUIRE(se != nullptr);
  const LoweredGraph l = lower_text(test::replace_all(se[1], "T[", "f32["));
  // Each conv writes its output and per-tile channel sums; a small kernel adds the tiles' sums.
  // No reduction reads the conv outputs again.
  CHECK(l.kernels == std::vector<std::string>{"k0_conv_depthwise_nhwc", "k1_reduce_mean_tiles", "k2_sigmoid", "k3_mul",
                                              "k4_conv_depthwise_nhwc", "k5_reduce_sum_tiles"});
  CHECK(has(l.source, "POOL = true;"));
  CHECK(has(l.source, "float* __restrict__ y, float* __restrict__ partial)"));
  // The mean divides by the 28 * 28 outputs of a plane.
  CHECK(has(l.source, "sum / (784.0f)"));
  compiles_everywhere(l);
  // Not over the spatial dims (here the channels too): a reduction kernel of its own.
  const LoweredGraph other = lower_text(R"(
graph @g(%x: f32[2, 8, 8, 16], %w: f32[16, 3, 3, 1]) -> (f32[2, 1, 1, 1], f32[2, 8, 8, 16]) {
  %c = conv(%x, %w) {groups = 16, pads = [1, 1, 1, 1], layout = "nhwc"} : f32[2, 8, 8, 16]
  %m = reduce_mean(%c) {axes = [1, 2, 3], keepdims = 1} : f32[2, 1, 1, 1]
  return %m, %c
})");
  CHECK(other.kernels == std::vector<std::string>{"k0_conv_depthwise_nhwc", "k1_reduce_mean"});
  CHECK(has(other.source, "POOL = false;"));
  // EfficientNet-B0's largest squeeze-excite conv: the tile, the filters and the pool's sums fit
  // the static shared memory on every target.
  const LoweredGraph big = lower_text(R"(
graph @g(%x: f32[16, 56, 56, 144], %w: f32[144, 3, 3, 1], %b: f32[144]) -> (f32[16, 56, 56, 144], f32[16, 1, 1, 144]) {
  %s = silu(%x) : f32[16, 56, 56, 144]
  %c = conv(%s, %w, %b) {groups = 144, pads = [1, 1, 1, 1], layout = "nhwc"} : f32[16, 56, 56, 144]
  %a = silu(%c) : f32[16, 56, 56, 144]
  %m = reduce_mean(%a) {axes = [1, 2], keepdims = 1} : f32[16, 1, 1, 144]
  return %a, %m
})");
  CHECK(big.kernels == std::vector<std::string>{"k0_conv_depthwise_nhwc", "k1_reduce_mean_tiles"});
  compiles_everywhere(big);
}

/// The value of `constexpr int ... NAME = value` in a kernel's source (the first kernel that has
/// it).
int64_t constant(const std::string& source, const std::string& name) {
  for (const std::string sep : {" ", ","})
    if (size_t at = source.find(sep + name + " = "); at != std::string::npos)
      return std::stoll(source.substr(at + sep.size() + name.size() + 3));
  FAIL("no constant " << name);
  return 0;
}

/// In-bounds inputs along one dim that tiles of `tile` of `len` outputs stage (halos included).
int64_t staged(int64_t len, int64_t tile, int64_t stride, int64_t extent, int64_t in, int64_t pad) {
  int64_t total = 0;
  for (int64_t o0 = 0; o0 < len; o0 += tile)
    total += std::max<int64_t>(
        0, std::min(o0 * stride - pad + extent, in) - std::max<int64_t>(o0 * stride - pad, 0));
  return total;
}

TEST_CASE(
    "a channels-last depthwise conv evaluates its prologue once per staged input, few inputs "
    "twice") {
  // EfficientNet-B0's depthwise convs at batch 16, each after its expand GEMM's SiLU: {H = W, C, k,
  // stride}.
  const int64_t shapes[][4] = {{112, 96, 3, 2}, {56, 144, 3, 1}, {56, 144, 5, 2}, {28, 240, 5, 1},
                               {28, 240, 3, 2}, {14, 480, 3, 1}, {14, 480, 5, 1}, {14, 672, 5, 1},
                               {14, 672, 5, 2}, {7, 1152, 5, 1}, {7, 1152, 3, 1}};
  double staged_total = 0, inputs_total = 0;
  for (const auto& [hw, c, k, stride] : shapes) {
    const int64_t pad = k / 2, out = (hw + 2 * pad - k) / stride + 1;
    auto I = [](int64_t v) { return std::to_string(v); };
    const std::string x = "f32[16, " + I(hw) + ", " + I(hw) + ", " + I(c) + "]";
    const std::string y = "f32[16, " + I(out) + ", " + I(out) + ", " + I(c) + "]";
    const LoweredGraph l = lower_text(
        "graph @g(%x: " + x + ", %w: f32[" + I(c) + ", " + I(k) + ", " + I(k) + ", 1]) -> (" + y +
        ") {\n  %s = silu(%x) : " + x + "\n  %c = conv(%s, %w) {groups = " + I(c) +
        ", strides = [" + I(stride) + ", " + I(stride) + "], pads = [" + I(pad) + ", " + I(pad) +
        ", " + I(pad) + ", " + I(pad) + "], layout = \"nhwc\"} : " + y + "\n  return %c\n}");
    CAPTURE(x);
    CAPTURE(k);
    CAPTURE(stride);
    REQUIRE(l.kernels == std::vector<std::string>{"k0_conv_depthwise_nhwc"});
    // The prologue runs where inputs are staged, nowhere else.
    size_t calls = 0;
    for (size_t at = l.source.find("PRO("); at != std::string::npos;
         at = l.source.find("PRO(", at + 1))
      ++calls;
    CHECK(calls == 2);  // the macro's definition and its one use
    CHECK(has(l.source, "v = PRO(LOAD(x["));
    const int64_t rows =
        staged(out, constant(l.source, "TP"), stride, constant(l.source, "IH"), hw, pad);
    const int64_t cols =
        staged(out, constant(l.source, "TQ"), stride, constant(l.source, "IW"), hw, pad);
    const double ratio = static_cast<double>(rows * cols) / static_cast<double>(hw * hw);
    MESSAGE(x << " k" << k << " s" << stride << ": " << ratio << " evaluations per input, TP "
              << constant(l.source, "TP") << " TQ " << constant(l.source, "TQ") << " CB "
              << constant(l.source, "CB") << " U " << constant(l.source, "U"));
    CHECK(ratio <= 1.35);
    if (hw <= 14 && stride == 1) CHECK(ratio == 1.0);  // whole planes: the halo is only padding
    staged_total += static_cast<double>(rows * cols * c),
        inputs_total += static_cast<double>(hw * hw * c);
  }
  CHECK(staged_total / inputs_total <= 1.2);
}

}  // namespace
}  // namespace kiln::cuda
