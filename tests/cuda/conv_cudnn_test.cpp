// Plan text of convs lowered to cuDNN conv steps: bias, relu and residual absorption (plain and
// fused groups), groups, 1-D/3-D, tf32, the fallbacks (asymmetric pads, option conv=gemm), and
// the TF32 stem kernel that takes RGB convs.
#include <doctest/doctest.h>

#include <sstream>
#include <tuple>

#include "kiln/core/options.h"
#include "kiln/cuda/backend.h"
#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

const char* kBiasRelu = R"(
graph @g(%x: f32[2, 4, 8, 8], %w: f32[6, 2, 3, 3], %b: f32[6]) -> (f32[2, 6, 4, 4]) {
  %c = conv(%x, %w, %b) {groups = 2, strides = [2, 2], pads = [1, 1, 1, 1], dilations = [1, 1]} : f32[2, 6, 4, 4]
  %y = relu(%c) : f32[2, 6, 4, 4]
  return %y
})";

TEST_CASE("conv with bias, groups and stride is one cudnn step that applies the relu") {
  const LoweredGraph l = lower_text(kBiasRelu);
  CHECK(l.kernels.empty());
  CHECK(plan_lines(l.plan, "step").size() == 1);
  CHECK(plan_lines(l.plan, "step conv")[0] ==
        "step conv x=b0 w=b1 y=b3 bias=b2 n=2 c=4 k=6 spatial=8,8 kernel=3,3 pad=1,1 stride=2,2 dilation=1,1 "
        "groups=2 dtype=f32 math=f32 activation=relu");
  // y is the graph output (named after the relu), and cuDNN gets the plan's workspace.
  CHECK(plan_lines(l.plan, "buffer 3")[0].find("kind=output dtype=f32 shape=2x6x4x4") != std::string::npos);
  CHECK(plan_lines(l.plan, "buffer 3")[0].find("name=y") != std::string::npos);
  CHECK(plan_lines(l.plan, "workspace")[0] == "workspace bytes=33554432");
}

TEST_CASE("allow_tf32_conv gives f32 convs math=tf32, half types keep math=f32") {
  LoweringOptions tf32;
  tf32.allow_tf32_conv = true;
  CHECK(plan_lines(lower_text(kBiasRelu, tf32).plan, "step conv")[0].find(" dtype=f32 math=tf32 ") != std::string::npos);
  tf32.conv1x1 = "cudnn";  // the 1x1 conv too
  const LoweredGraph h = lower_text(R"(
graph @g(%x: bf16[1, 4, 6, 6], %w: bf16[4, 4, 1, 1], %v: f16[1, 4, 6, 6], %u: f16[4, 4, 3, 3]) -> (bf16[1, 4, 6, 6], f16[1, 4, 6, 6]) {
  %c = conv(%x, %w) : bf16[1, 4, 6, 6]
  %d = conv(%v, %u) {pads = [1, 1, 1, 1]} : f16[1, 4, 6, 6]
  return %c, %d
})", tf32);
  const auto steps = plan_lines(h.plan, "step conv");
  REQUIRE(steps.size() == 2);
  CHECK(steps[0].find("kernel=1,1 pad=0,0 stride=1,1 dilation=1,1 groups=1 dtype=bf16 math=f32 activation=none") !=
        std::string::npos);
  CHECK(steps[1].find("dtype=f16 math=f32 activation=none") != std::string::npos);
}

TEST_CASE("a residual add and its relu fold into the conv as z") {
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[1, 4, 6, 6], %w: f32[4, 4, 3, 3], %b: f32[4]) -> (f32[1, 4, 6, 6]) {
  %c = conv(%x, %w, %b) {pads = [1, 1, 1, 1]} : f32[1, 4, 6, 6]
  %s = add(%c, %x) : f32[1, 4, 6, 6]
  %y = relu(%s) : f32[1, 4, 6, 6]
  return %y
})");
  CHECK(l.kernels.empty());
  REQUIRE(plan_lines(l.plan, "step").size() == 1);
  CHECK(plan_lines(l.plan, "step conv")[0].find("step conv x=b0 w=b1 y=b3 bias=b2 z=b0 ") == 0);
  CHECK(plan_lines(l.plan, "step conv")[0].find(" activation=relu") != std::string::npos);
  // Without a relu the add still folds; a relu before the add does not make it a residual.
  const LoweredGraph a = lower_text(R"(
graph @g(%x: f32[1, 4, 6, 6], %w: f32[4, 4, 3, 3]) -> (f32[1, 4, 6, 6], f32[1, 4, 6, 6]) {
  %c = conv(%x, %w) {pads = [1, 1, 1, 1]} : f32[1, 4, 6, 6]
  %s = add(%x, %c) : f32[1, 4, 6, 6]
  %d = conv(%x, %w) {pads = [1, 1, 1, 1]} : f32[1, 4, 6, 6]
  %r = relu(%d) : f32[1, 4, 6, 6]
  %t = add(%r, %x) : f32[1, 4, 6, 6]
  return %s, %t
})");
  const auto steps = plan_lines(a.plan, "step conv");
  REQUIRE(steps.size() == 2);
  CHECK(steps[0].find(" z=b0 ") != std::string::npos);
  CHECK(steps[0].find(" activation=none") != std::string::npos);
  CHECK(steps[1].find(" z=") == std::string::npos);
  CHECK(steps[1].find(" activation=relu") != std::string::npos);
  CHECK(a.kernels.size() == 1);  // the add after the relu
}

TEST_CASE("fuse-pointwise's add+relu group after a conv folds in, a later-computed residual waits for its conv") {
  // As in ResNet's downsampling block: conv2's residual (the 1x1 downsample conv) is computed
  // after it, so the downsample conv is the one that absorbs the group, with conv2 as its z.
  const LoweredGraph l = lower_text(R"(
graph @g(%x: f32[2, 4, 8, 8], %w: f32[8, 4, 3, 3], %b: f32[8], %v: f32[8, 4, 1, 1], %e: f32[8]) -> (f32[2, 8, 4, 4]) {
  %c = conv(%x, %w, %b) {strides = [2, 2], pads = [1, 1, 1, 1]} : f32[2, 8, 4, 4]
  %d = conv(%x, %v, %e) {strides = [2, 2]} : f32[2, 8, 4, 4]
  %y = fused(%c, %d) : f32[2, 8, 4, 4] {
    graph @fused(%p: f32[2, 8, 4, 4], %q: f32[2, 8, 4, 4]) -> (f32[2, 8, 4, 4]) {
      %s = add(%p, %q) : f32[2, 8, 4, 4]
      %r = relu(%s) : f32[2, 8, 4, 4]
      return %r
    }
  }
  return %y
})");
  CHECK(l.kernels.empty());
  const auto steps = plan_lines(l.plan, "step");
  REQUIRE(steps.size() == 2);
  CHECK(steps[0].find("step conv x=b0 w=b1 y=b5 bias=b2 n=2 ") == 0);
  CHECK(steps[0].find(" activation=none") != std::string::npos);
  CHECK(steps[1].find("step conv x=b0 w=b3 y=b6 bias=b4 z=b5 n=2 c=4 k=8 spatial=8,8 kernel=1,1 pad=0,0 stride=2,2 ") ==
        0);
  CHECK(steps[1].find(" activation=relu") != std::string::npos);
  CHECK(plan_lines(l.plan, "buffer 6")[0].find("kind=output") != std::string::npos);
}

TEST_CASE("1-D and 3-D convs are conv steps, asymmetric pads and conv=gemm keep the im2col path") {
  const std::string text = R"(
graph @g(%s: f16[2, 4, 10], %v: f16[3, 4, 3], %t: f32[1, 2, 4, 4, 4], %u: f32[3, 2, 2, 2, 2], %x: f32[1, 2, 5, 5], %w: f32[2, 2, 3, 3]) -> (f16[2, 3, 3], f32[1, 3, 3, 3, 3], f32[1, 2, 3, 4]) {
  %d = conv(%s, %v) {strides = [2], dilations = [2]} : f16[2, 3, 3]
  %e = conv(%t, %u) : f32[1, 3, 3, 3, 3]
  %f = conv(%x, %w) {pads = [0, 1, 0, 0]} : f32[1, 2, 3, 4]
  return %d, %e, %f
})";
  const LoweredGraph l = lower_text(text);
  const auto steps = plan_lines(l.plan, "step conv");
  REQUIRE(steps.size() == 2);
  CHECK(steps[0].find("n=2 c=4 k=3 spatial=10 kernel=3 pad=0 stride=2 dilation=2 groups=1 dtype=f16") != std::string::npos);
  CHECK(steps[1].find("n=1 c=2 k=3 spatial=4,4,4 kernel=2,2,2 pad=0,0,0 stride=1,1,1 dilation=1,1,1") != std::string::npos);
  CHECK(l.kernels == std::vector<std::string>{"k0_im2col"});
  CHECK(plan_lines(l.plan, "step gemm").size() == 1);

  const LoweredGraph g = lower_text(text, {.conv = "gemm"});
  CHECK(plan_lines(g.plan, "step conv").empty());
  CHECK(g.kernels == std::vector<std::string>{"k0_im2col", "k1_conv", "k2_im2col"});
  CHECK(plan_lines(lower_text(kBiasRelu, {.conv = "gemm"}).plan, "step gemm").size() == 2);
}

TEST_CASE("a channels-last conv is a cudnn step in NCHW terms with layout=nhwc; conv=gemm names the conflict") {
  const std::string text = R"(
graph @g(%x: f32[2, 6, 10, 8], %w: f32[12, 3, 3, 8], %b: f32[12]) -> (f32[2, 3, 5, 12]) {
  %c = conv(%x, %w, %b) {strides = [2, 2], pads = [1, 1, 1, 1], layout = "nhwc"} : f32[2, 3, 5, 12]
  %y = relu(%c) : f32[2, 3, 5, 12]
  return %y
})";
  const LoweredGraph l = lower_text(text);
  CHECK(plan_lines(l.plan, "step").size() == 1);
  CHECK(plan_lines(l.plan, "step conv")[0] ==
        "step conv x=b0 w=b1 y=b3 bias=b2 n=2 c=8 k=12 spatial=6,10 kernel=3,3 pad=1,1 stride=2,2 dilation=1,1 "
        "groups=1 dtype=f32 math=f32 activation=relu layout=nhwc");
  auto g = parse_graph(text);
  REQUIRE(g.ok());
  LoweringOptions gemm;
  gemm.conv = "gemm";
  auto bad = lower_graph(**g, gemm);
  REQUIRE_FALSE(bad.ok());
  CHECK(has(bad.status().message(), "layout=\"nhwc\" runs through cuDNN"));
  CHECK(has(bad.status().message(), "conv is 'gemm'"));
}

TEST_CASE("with tf32 an RGB stem conv is one implicit-GEMM tensor-core kernel that applies the relu") {
  const char* text = R"(
graph @g(%x: f32[2, 3, 37, 45], %w: f32[16, 3, 7, 7], %b: f32[16], %v: f32[8, 3, 1, 1], %u: f32[8, 5, 3, 3], %z: f32[2, 5, 9, 9], %s: f32[72, 3, 3, 3]) -> (f32[2, 16, 19, 23], f32[2, 8, 37, 45], f32[2, 8, 9, 9], f32[2, 72, 37, 45]) {
  %c = conv(%x, %w, %b) {strides = [2, 2], pads = [3, 3, 3, 3]} : f32[2, 16, 19, 23]
  %y = relu(%c) : f32[2, 16, 19, 23]
  %p = conv(%x, %v) : f32[2, 8, 37, 45]
  %q = conv(%z, %u) {pads = [1, 1, 1, 1]} : f32[2, 8, 9, 9]
  %t = conv(%x, %s) {pads = [1, 1, 1, 1]} : f32[2, 72, 37, 45]
  return %y, %p, %q, %t
})";
  const LoweredGraph l = lower_text(text, {.allow_tf32_conv = true});
  // The 7x7 stem: one kernel with bias and relu, and the 3x3 over RGB another (72 channels: one
  // pixel tile a warp), sharing their helpers; the 1x1 conv over RGB is a GEMM and the 5-channel
  // conv stays a cuDNN step.
  CHECK(l.kernels == std::vector<std::string>{"k0_conv_stem", "k1_conv_stem"});
  CHECK(l.source.find("#define KILN_STEM_HELPERS") == l.source.rfind("#define KILN_STEM_HELPERS"));
  const auto launches = plan_lines(l.plan, "step launch");
  REQUIRE(launches.size() == 2);
  CHECK(launches[0].find("block=128,1,1") != std::string::npos);
  CHECK(has(l.source, "constexpr int N = 2, C = 3, H = 37, W = 45, KO = 16, R = 7, S = 7, P = 19, Q = 23;"));
  CHECK(has(l.source, "constexpr bool HAS_BIAS = true, RELU = true;"));
  CHECK(has(l.source, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"));
  const auto convs = plan_lines(l.plan, "step conv");
  REQUIRE(convs.size() == 1);
  CHECK(convs[0].find(" c=5 k=8 spatial=9,9 kernel=3,3 ") != std::string::npos);
  CHECK(plan_lines(l.plan, "step gemm").size() == 1);
  CHECK(has(l.source, "constexpr bool HAS_BIAS = false, RELU = false;"));
  CHECK(has(l.source, "MT = 1, NTHR = 128;"));
  compiles_everywhere(l);
  // Without tf32 the stem stays a strict-f32 cuDNN conv.
  const LoweredGraph strict = lower_text(text);
  CHECK(strict.kernels.empty());
  CHECK(plan_lines(strict.plan, "step conv").size() == 3);
}

TEST_CASE("the backend's conv option takes cudnn or gemm and names a bad value") {
  Registry r;
  Capabilities caps;
  caps.plugin = "cuda-test";
  caps.targets = {"sm_90a"};
  REQUIRE(register_backend(r, caps).ok());
  auto info = r.backend("cuda-test");
  REQUIRE(info.ok());
  for (const char* value : {"cudnn", "gemm"}) {
    auto opts = resolve_options((*info)->options, {{"conv", std::string(value)}}, "cuda-test");
    REQUIRE(opts.ok());
    CHECK((*info)->create(*opts).ok());
  }
  auto bad = resolve_options((*info)->options, {{"conv", std::string("winograd")}}, "cuda-test");
  REQUIRE(bad.ok());
  auto b = (*info)->create(*bad);
  REQUIRE(!b.ok());
  CHECK(b.status().message() == "cuda-test: option conv='winograd' is not cudnn or gemm");
  for (const auto& [option, value, message] :
       {std::tuple{"depthwise", "gemm", "cuda-test: option depthwise='gemm' is not kernel or cudnn"},
        std::tuple{"conv1x1", "kernel", "cuda-test: option conv1x1='kernel' is not gemm or cudnn"}}) {
    auto o = resolve_options((*info)->options, {{option, std::string(value)}}, "cuda-test");
    REQUIRE(o.ok());
    auto made = (*info)->create(*o);
    REQUIRE(!made.ok());
    CHECK(made.status().message() == message);
  }
}

}  // namespace
}  // namespace kiln::cuda
