// NVRTC compilation of the lowering's output for every target the three plugins build.
#include <doctest/doctest.h>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

LoweredGraph lower_example(const std::string& name) {
  auto g = parse_graph_file(std::string(KILN_SOURCE_DIR) + "/examples/kir/" + name + ".kir");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  REQUIRE(bind_symbols(**g, {{"B", 2}, {"S", 8}}).ok());
  auto l = lower_graph(**g);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  return *l;
}

TEST_CASE("examples compile for sm_80, sm_90a and sm_100a (cubin) and compute_90 (ptx)") {
  for (const char* model : {"mlp", "attention", "convnet"}) {
    CAPTURE(model);
    const LoweredGraph l = lower_example(model);
    for (const char* target : {"sm_80", "sm_90a", "sm_100a"}) {
      CAPTURE(target);
      auto cubin = compile_cuda(l.source, target, "test@0");
      REQUIRE_MESSAGE(cubin.ok(), cubin.status().message());
      CHECK(cubin->size() > 0);
      CHECK(cubin->substr(0, 4) == "\x7f" "ELF");
    }
    auto ptx = compile_cuda(l.source, "compute_90", "test@0");
    REQUIRE_MESSAGE(ptx.ok(), ptx.status().message());
    for (const std::string& k : l.kernels) CHECK(ptx->find(".entry " + k) != std::string::npos);
  }
}

TEST_CASE("conv through gemms (im2col, bias broadcast) and the direct conv compile for every target") {
  auto g = parse_graph(R"(
graph @c(%x: f32[2, 4, 9, 9], %w: f32[6, 2, 3, 3], %b: f32[6], %h: bf16[2, 4, 9, 9], %hw: bf16[6, 4, 3, 3], %hb: bf16[6], %s: f16[2, 4, 10], %sw: f16[3, 4, 3], %t: f32[1, 2, 4, 4, 4], %tw: f32[3, 2, 2, 2, 2]) -> (f32[2, 6, 3, 4], bf16[2, 6, 9, 9], f16[2, 3, 3], f32[1, 3, 3, 3, 3]) {
  %c = conv(%x, %w, %b) {groups = 2, strides = [2, 2], pads = [1, 1, 0, 1], dilations = [2, 2]} : f32[2, 6, 3, 4]
  %r = relu(%c) : f32[2, 6, 3, 4]
  %d = conv(%h, %hw, %hb) {pads = [1, 1, 1, 1]} : bf16[2, 6, 9, 9]
  %e = conv(%s, %sw) {strides = [2], dilations = [2]} : f16[2, 3, 3]
  %f = conv(%t, %tw) : f32[1, 3, 3, 3, 3]
  return %r, %d, %e, %f
})");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto l = lower_graph(**g, {.conv = "gemm"});
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  CHECK(l->kernels == std::vector<std::string>{"k0_im2col", "k1_conv_bias", "k2_im2col", "k3_conv_bias", "k4_im2col",
                                               "k5_conv"});
  compiles_everywhere(*l);
  auto ptx = compile_cuda(l->source, "compute_90", "test@0");
  REQUIRE_MESSAGE(ptx.ok(), ptx.status().message());
  for (const std::string& k : l->kernels) CHECK(ptx->find(".entry " + k) != std::string::npos);
}

TEST_CASE("a second compile of the same source and target is a cache hit") {
  const std::string src = "extern \"C\" __global__ void k(float* y) { y[threadIdx.x] = 1.0f; }\n";
  bool hit = true;
  auto a = compile_cuda(src + "// unique " + __DATE__ __TIME__ "\n", "sm_80", "test@0", &hit);
  REQUIRE(a.ok());
  bool hit2 = false;
  auto b = compile_cuda(src + "// unique " + __DATE__ __TIME__ "\n", "sm_80", "test@0", &hit2);
  REQUIRE(b.ok());
  CHECK(hit2);
  CHECK(*a == *b);
}

TEST_CASE("a compile error names the target and carries the log") {
  auto r = compile_cuda("extern \"C\" __global__ void k() { undefined_thing(); }\n", "sm_90a", "test@0");
  REQUIRE(!r.ok());
  CHECK(r.status().message().find("nvrtc: compiling for sm_90a failed") == 0);
  CHECK(r.status().message().find("undefined_thing") != std::string::npos);
  auto t = compile_cuda("", "gfx90a", "test@0");
  CHECK(t.status().message() == "nvrtc: unknown target 'gfx90a' (expected sm_XX or compute_XX)");
}

TEST_CASE("every lowered op compiles, in f32, f16, bf16 and integer forms") {
  const std::string graphs[] = {R"(
graph @f(%x: f32[2, 3, 4], %y: f32[4], %i: i64[2]) -> (f32[2, 3, 4], bool[2, 3, 4], f32[3, 2, 4], f32[2, 1, 4], i64[2, 4], f32[2, 3, 4], f32[2, 3, 4], f32[2, 6, 4], f32[2, 3, 4], f32[2, 3, 2], f32[2, 2, 4], f32[2, 5, 4], f32[4, 3, 2]) {
  %a = add(%x, %y) : f32[2, 3, 4]
  %b = sub(%a, %y) : f32[2, 3, 4]
  %c = mul(%b, %x) : f32[2, 3, 4]
  %d = div(%c, %y) : f32[2, 3, 4]
  %e = pow(%d, %y) : f32[2, 3, 4]
  %f = maximum(%e, %x) : f32[2, 3, 4]
  %g = minimum(%f, %x) : f32[2, 3, 4]
  %h = mod(%g, %y) : f32[2, 3, 4]
  %u1 = sigmoid(%h) : f32[2, 3, 4]
  %u2 = silu(%u1) : f32[2, 3, 4]
  %u3 = softplus(%u2) : f32[2, 3, 4]
  %u4 = gelu(%u3) : f32[2, 3, 4]
  %u5 = leaky_relu(%u4) : f32[2, 3, 4]
  %u6 = round(%u5) : f32[2, 3, 4]
  %u7 = sign(%u6) : f32[2, 3, 4]
  %u8 = rsqrt(%u7) : f32[2, 3, 4]
  %u9 = reciprocal(%u8) : f32[2, 3, 4]
  %u10 = clip(%u9) {min = -1.0, max = 1.0} : f32[2, 3, 4]
  %n = isnan(%u10) : bool[2, 3, 4]
  %m = isinf(%u10) : bool[2, 3, 4]
  %o = or(%n, %m) : bool[2, 3, 4]
  %lt = less(%x, %y) : bool[2, 3, 4]
  %an = and(%o, %lt) : bool[2, 3, 4]
  %w = where(%an, %x, %u10) : f32[2, 3, 4]
  %t = transpose(%w) {perm = [1, 0, 2]} : f32[3, 2, 4]
  %r = reduce_sum(%w) {axes = [1]} : f32[2, 1, 4]
  %am = argmax(%w) {axis = 1, keepdims = 0} : i64[2, 4]
  %sm = softmax(%w) {axis = 1} : f32[2, 3, 4]
  %ln = layer_norm(%w, %y, %y) : f32[2, 3, 4]
  %cc = concat(%w, %ln) {axis = 1} : f32[2, 6, 4]
  %rn = rms_norm(%w, %y) : f32[2, 3, 4]
  %sl = slice(%w) {starts = [0], ends = [2], axes = [2]} : f32[2, 3, 2]
  %ga = gather(%w, %i) {axis = 1} : f32[2, 2, 4]
  %pd = pad(%w) {pads = [0, 1, 0, 0, 1, 0], mode = "reflect"} : f32[2, 5, 4]
  %tr = transpose(%w) : f32[4, 3, 2]
  return %w, %an, %t, %r, %am, %sm, %ln, %cc, %rn, %sl, %ga, %pd, %tr
})", R"(
graph @h(%x: f16[1, 2, 6, 6], %w: f16[4, 2, 3, 3], %b: f16[4], %s: bf16[2, 8], %v: bf16[8, 4]) -> (f16[1, 4, 4, 4], f16[1, 4, 2, 2], f16[1, 4, 2, 2], bf16[2, 4], f32[2, 8], f16[1, 2, 6, 6]) {
  %c = conv(%x, %w, %b) : f16[1, 4, 4, 4]
  %mp = max_pool(%c) {kernel_shape = [2, 2], strides = [2, 2]} : f16[1, 4, 2, 2]
  %ap = avg_pool(%c) {kernel_shape = [3, 3], strides = [2, 2], pads = [1, 1, 1, 1]} : f16[1, 4, 2, 2]
  %mm = matmul(%s, %v) : bf16[2, 4]
  %cs = cast(%s) {to = f32} : f32[2, 8]
  %sc = constant() {value = dense<f16[2]>[1, 2]} : f16[2]
  %bn = batch_norm(%x, %sc, %sc, %sc, %sc) : f16[1, 2, 6, 6]
  return %c, %mp, %ap, %mm, %cs, %bn
})", R"(
graph @i(%a: i32[4, 5], %b: i32[5], %q: u8[4, 5]) -> (i32[4, 5], i32[4, 1], i64[4, 5], u8[4, 10], i32[4, 5]) {
  %s = add(%a, %b) : i32[4, 5]
  %d = div(%s, %b) : i32[4, 5]
  %m = mod(%d, %b) : i32[4, 5]
  %p = pow(%m, %b) : i32[4, 5]
  %c = clip(%p) {min = -3, max = 3} : i32[4, 5]
  %r = reduce_max(%c) {axes = [1]} : i32[4, 1]
  %k = cast(%c) {to = i64} : i64[4, 5]
  %cc = concat(%q, %q) {axis = 1} : u8[4, 10]
  %e = expand(%b) {shape = [4, 5]} : i32[4, 5]
  return %c, %r, %k, %cc, %e
})"};
  for (const std::string& text : graphs) {
    auto g = parse_graph(text);
    REQUIRE_MESSAGE(g.ok(), g.status().message());
    auto l = lower_graph(**g);
    REQUIRE_MESSAGE(l.ok(), l.status().message());
    auto cubin = compile_cuda(l->source, "sm_90a", "test@0");
    REQUIRE_MESSAGE(cubin.ok(), std::string(cubin.status().message() + "\n" + l->source));
  }
}

}  // namespace
}  // namespace kiln::cuda
