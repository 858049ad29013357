// layout-nhwc from its plugin: convolutions become channels last, the transposes between them
// cancel, and the reference gives the same values as the NCHW graph.
#include <doctest/doctest.h>

#include <memory>
#include <random>
#include <string>
#include <utility>

#include "kiln/core/pass_manager.h"
#include "kiln/ir/text.h"

#include "plugin_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

/// A ResNet-style stage: conv-relu-conv plus a residual from the (NCHW) input, relu, a 1x1
/// conv by a constant weight, a per-channel scale (broadcast [C, 1, 1]), a depthwise conv, a
/// spatial mean with and without keepdims.
std::string stage_kir() {
  std::string w3 = "dense<f32[8, 8, 1, 1]>[";
  for (int i = 0; i < 64; ++i) w3 += (i ? ", " : "") + std::to_string((i * 37 % 17 - 8) / 16.0);
  w3 += "]";
  return R"(graph @stage(%x: f32[2, 8, 6, 6], %w1: f32[8, 8, 3, 3], %b1: f32[8], %w2: f32[8, 8, 3, 3],
                   %s: f32[8, 1, 1], %wd: f32[8, 1, 3, 3]) -> (f32[2, 8], f32[2, 8, 1, 1], f32[2, 8, 6, 6]) {
  %c1 = conv(%x, %w1, %b1) {pads = [1, 1, 1, 1]} : f32[2, 8, 6, 6]
  %r1 = relu(%c1) : f32[2, 8, 6, 6]
  %c2 = conv(%r1, %w2) {pads = [1, 1, 1, 1]} : f32[2, 8, 6, 6]
  %a = add(%c2, %x) : f32[2, 8, 6, 6]
  %r2 = relu(%a) : f32[2, 8, 6, 6]
  %w3 = constant() {value = )" + w3 + R"(} : f32[8, 8, 1, 1]
  %c3 = conv(%r2, %w3) : f32[2, 8, 6, 6]
  %m = mul(%c3, %s) : f32[2, 8, 6, 6]
  %d = conv(%m, %wd) {groups = 8, pads = [1, 1, 1, 1]} : f32[2, 8, 6, 6]
  %p = reduce_mean(%d) {axes = [2, 3], keepdims = 0} : f32[2, 8]
  %q = reduce_max(%d) {axes = [2, 3], keepdims = 1} : f32[2, 8, 1, 1]
  return %p, %q, %d
})";
}

/// The stage graph and its copy after `passes`.
std::pair<std::unique_ptr<Graph>, std::unique_ptr<Graph>> stage_through(Registry& reg, const std::string& passes) {
  auto g = parse_graph(stage_kir());
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto after = (*g)->clone();
  auto stages = parse_pass_list(passes, reg);
  REQUIRE(stages.ok());
  PassManager pm(reg, PassManagerOptions{});
  REQUIRE(pm.run(*after, *stages, "layout-nhwc").ok());
  return {std::move(*g), std::move(after)};
}

/// `before` and `after` give the same values on the reference for seeded random inputs.
void same_values(Registry& reg, const Graph& before, const Graph& after, unsigned seed) {
  std::mt19937 rng(seed);
  const std::vector<Tensor> in = random_inputs(before, rng);
  const std::vector<Tensor> want = run_reference(reg, before, in), got = run_reference(reg, after, in);
  REQUIRE(want.size() == got.size());
  for (size_t k = 0; k < want.size(); ++k) {
    REQUIRE(want[k].type() == got[k].type());
    const std::vector<double> a = want[k].to_f64(), b = got[k].to_f64();
    for (size_t i = 0; i < a.size(); ++i) CHECK(b[i] == doctest::Approx(a[i]).epsilon(1e-5));
  }
}

int count(const Graph& g, const std::string& op) {
  int k = 0;
  for (const auto& n : g.nodes()) k += n->op_name() == op;
  return k;
}

}  // namespace

TEST_SUITE("layout-nhwc") {
  TEST_CASE("a conv stage runs channels last with the same values, transposes only at its edges") {
    Registry& reg = registry_with({"kiln-plugin-fusion.so", "kiln-plugin-frontend-kir.so",
                                   "kiln-plugin-backend-reference.so"});
    const auto [g, after] = stage_through(reg, "layout-nhwc{depthwise=true,pointwise-as-linear=false},fold-layout");
    int nhwc = 0;
    for (const auto& n : after->nodes())
      if (n->op_name() == "conv") {
        CHECK(n->get_string("layout") == "nhwc");
        ++nhwc;
      }
    CHECK(nhwc == 4);
    // x in; w1, w2 and wd permuted at run time (graph inputs); s permuted (small); %d out in
    // NCHW. %p needs none (the mean over the spatial dims leaves [N, C]); %q's keepdims result
    // goes back through one. The constant w3 is permuted at compile time, so no transpose.
    CHECK(count(*after, "transpose") == 7);
    same_values(reg, *g, *after, 5);
  }

  TEST_CASE("a 1x1 conv becomes a linear layer; depthwise = false leaves depthwise convs NCHW") {
    Registry& reg = registry_with({"kiln-plugin-fusion.so", "kiln-plugin-frontend-kir.so",
                                   "kiln-plugin-backend-reference.so"});
    const auto [g, after] = stage_through(reg, "layout-nhwc{depthwise=false},fold-layout");
    int nhwc = 0, nchw = 0;
    for (const auto& n : after->nodes())
      if (n->op_name() == "conv") (n->get_string("layout", "nchw") == "nhwc" ? nhwc : nchw) += 1;
    CHECK(nhwc == 2);
    CHECK(nchw == 1);  // the depthwise conv
    CHECK(count(*after, "linear") == 1);
    // x, w1, w2 and s in; the scaled tensor back to NCHW for the depthwise conv.
    CHECK(count(*after, "transpose") == 5);
    same_values(reg, *g, *after, 6);
  }

  TEST_CASE("a conv whose kernel equals its stride becomes a transpose gathering its patches and a linear layer") {
    Registry& reg = registry_with({"kiln-plugin-fusion.so", "kiln-plugin-frontend-kir.so",
                                   "kiln-plugin-backend-reference.so"});
    // ConvNeXt's downsampling (2x2 stride 2 with a bias, input from a graph input and a constant
    // weight) and a 3x2 patch embedding with a non-square stride; a padded one stays a conv.
    std::string wc = "dense<f32[16, 8, 2, 2]>[";
    for (int i = 0; i < 512; ++i) wc += (i ? ", " : "") + std::to_string((i * 37 % 17 - 8) / 16.0);
    wc += "]";
    const std::string text = R"(graph @g(%x: f32[2, 8, 6, 8], %b: f32[16], %w: f32[12, 16, 3, 2], %v: f32[4, 16, 2, 2]) -> (f32[2, 12, 1, 2], f32[2, 4, 2, 2]) {
  %wc = constant() {value = )" + wc + R"(} : f32[16, 8, 2, 2]
  %d = conv(%x, %wc, %b) {strides = [2, 2]} : f32[2, 16, 3, 4]
  %e = conv(%d, %w) {strides = [3, 2]} : f32[2, 12, 1, 2]
  %f = conv(%d, %v) {strides = [2, 2], pads = [1, 1, 0, 0]} : f32[2, 4, 2, 2]
  return %e, %f
})";
    auto g = parse_graph(text);
    REQUIRE_MESSAGE(g.ok(), g.status().message());
    auto after = (*g)->clone();
    auto stages = parse_pass_list("layout-nhwc,fold-layout", reg);
    REQUIRE(stages.ok());
    PassManager pm(reg, PassManagerOptions{});
    REQUIRE(pm.run(*after, *stages, "layout-nhwc").ok());
    CHECK(count(*after, "linear") == 2);
    CHECK(count(*after, "conv") == 1);  // the padded one, channels last
    same_values(reg, **g, *after, 7);
    // Off: both stay convs (channels last).
    auto kept = (*g)->clone();
    auto off = parse_pass_list("layout-nhwc{patches-as-linear=false}", reg);
    REQUIRE(off.ok());
    REQUIRE(pm.run(*kept, *off, "layout-nhwc").ok());
    CHECK(count(*kept, "linear") == 0);
    CHECK(count(*kept, "conv") == 3);
  }

  TEST_CASE("image stems and depthwise convs can stay NCHW") {
    Registry& reg = registry_with({"kiln-plugin-fusion.so", "kiln-plugin-frontend-kir.so"});
    auto g = parse_graph(R"(graph @g(%x: f32[1, 3, 8, 8], %w: f32[8, 3, 3, 3], %wd: f32[8, 1, 3, 3]) -> (f32[1, 8, 6, 6]) {
  %c = conv(%x, %w) : f32[1, 8, 6, 6]
  %d = conv(%c, %wd) {groups = 8, pads = [1, 1, 1, 1]} : f32[1, 8, 6, 6]
  return %d
})");
    REQUIRE(g.ok());
    auto stages = parse_pass_list("layout-nhwc{depthwise=false}", reg);
    REQUIRE(stages.ok());
    PassManager pm(reg, PassManagerOptions{});
    REQUIRE(pm.run(**g, *stages, "layout-nhwc").ok());
    CHECK(count(**g, "transpose") == 0);
    auto bad = parse_pass_list("layout-nhwc{min-channels=0}", reg);
    CHECK_FALSE((bad.ok() && pm.run(**g, *bad, "layout-nhwc").ok()));
  }
}
