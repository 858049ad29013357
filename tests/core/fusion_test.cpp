// fuse-pointwise from its plugin: outputs are bit-identical before and after, and groups fit one
// kernel.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <string>

#include "kiln/core/loader.h"
#include "kiln/core/pass_manager.h"
#include "kiln/ir/op.h"
#include "kiln/ir/text.h"

#include "plugin_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

Registry& fusion_registry() {
  static Registry& reg = registry_with({"kiln-plugin-fusion.so", "kiln-plugin-transforms.so",
                                       "kiln-plugin-frontend-kir.so", "kiln-plugin-backend-reference.so"});
  return reg;
}


std::vector<Tensor> run_reference(const Graph& g, const std::vector<Tensor>& inputs) {
  return kiln::test::run_reference(fusion_registry(), g, inputs);
}

/// What the CUDA backend needs to lower a fused node as one kernel (its pure_pointwise rule):
/// all results of one shape, operands broadcasting to it, a body of elementwise ops and
/// one-element constants.
bool one_kernel(const Node& fused) {
  const Graph& body = fused.region(0);
  const Shape& s = fused.result(0)->shape();
  for (const Value* r : fused.results())
    if (r->shape() != s) return false;
  for (const Value* o : fused.operands()) {
    const Shape& os = o->shape();
    if (os.size() > s.size()) return false;
    for (size_t d = 0; d < os.size(); ++d)
      if (os[d] != Dim(1) && os[d] != s[s.size() - os.size() + d]) return false;
  }
  for (const auto& n : body.nodes()) {
    if (n->op_name() == "constant") {
      if (n->attr("value")->as_tensor().numel() != 1) return false;
    } else if (!n->op()->has(kTraitElementwise) && n->op_name() != "identity") {
      return false;
    }
  }
  return true;
}

struct Fused {
  std::unique_ptr<Graph> graph;
  int fused_nodes = 0;
  int fused_members = 0;  ///< nodes inside fused regions, constants excluded
};

/// Runs `passes` on a copy of `g`, checks outputs on three sets of random inputs are
/// bit-identical to the original's (fusion only moves nodes into regions, so the interpreter
/// runs the same ops in the same order), and counts what was fused.
Fused fuse_checked(const Graph& g, const std::string& passes = "fuse-pointwise") {
  auto after = g.clone();
  auto stages = parse_pass_list(passes, fusion_registry());
  REQUIRE_MESSAGE(stages.ok(), stages.status().message());
  PassManager pm(fusion_registry(), PassManagerOptions{});
  Status s = pm.run(*after, *stages, passes);
  REQUIRE_MESSAGE(s.ok(), s.message());
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3; ++trial) {
    const std::vector<Tensor> inputs = random_inputs(g, rng);
    const std::vector<Tensor> want = run_reference(g, inputs), got = run_reference(*after, inputs);
    REQUIRE(want.size() == got.size());
    for (size_t k = 0; k < want.size(); ++k) {
      INFO("output ", k);
      REQUIRE(want[k].type() == got[k].type());
      REQUIRE(want[k].nbytes() > 0);
      CHECK(std::memcmp(want[k].data(), got[k].data(), want[k].nbytes()) == 0);
    }
  }
  Fused f;
  for (const auto& n : after->nodes()) {
    if (n->op_name() != "fused") continue;
    ++f.fused_nodes;
    CHECK(one_kernel(*n));
    for (const auto& m : n->region(0).nodes()) f.fused_members += m->op_name() != "constant";
  }
  f.graph = std::move(after);
  return f;
}

std::unique_ptr<Graph> load_example(const std::string& name) {
  auto g = parse_graph_file(std::string(KILN_SOURCE_DIR) + "/examples/kir/" + name);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(g).value();
}

/// tanh-form GELU spelled out in primitive ops after a biased matmul, then a residual add.
const char* kGeluResidual =
    R"(graph @gelu_residual(%x: f32[B, 16], %w: f32[16, 16], %bias: f32[16]) -> (f32[B, 16]) {
  %h = matmul(%x, %w) : f32[B, 16]
  %hb = add(%h, %bias) : f32[B, 16]
  %c3 = constant() {value = dense<f32[]>[0.044715]} : f32[]
  %sq = mul(%hb, %hb) : f32[B, 16]
  %cu = mul(%sq, %hb) : f32[B, 16]
  %t1 = mul(%cu, %c3) : f32[B, 16]
  %t2 = add(%hb, %t1) : f32[B, 16]
  %k = constant() {value = dense<f32[]>[0.7978846]} : f32[]
  %t3 = mul(%t2, %k) : f32[B, 16]
  %th = tanh(%t3) : f32[B, 16]
  %one = constant() {value = dense<f32[]>[1]} : f32[]
  %t4 = add(%th, %one) : f32[B, 16]
  %half = constant() {value = dense<f32[]>[0.5]} : f32[]
  %t5 = mul(%hb, %half) : f32[B, 16]
  %g = mul(%t5, %t4) : f32[B, 16]
  %y = add(%g, %x) : f32[B, 16]
  return %y
})";

}  // namespace

TEST_SUITE("fuse-pointwise") {
  TEST_CASE("the example models give the same bits, fused where they have chains") {
    // mlp and convnet have only lone relus between matmuls, convs and pools: nothing to fuse.
    CHECK(fuse_checked(*load_example("mlp.kir")).fused_nodes == 0);
    CHECK(fuse_checked(*load_example("convnet.kir")).fused_nodes == 0);
    // attention's rsqrt(constant) and the mul scaling the scores form one group, the
    // constant copied inside; the residual add is alone after a linear.
    Fused attn = fuse_checked(*load_example("attention.kir"));
    CHECK(attn.fused_nodes == 1);
    CHECK(attn.fused_members == 2);
    // After the clean-up passes the scale is one folded constant and nothing is left to fuse.
    CHECK(fuse_checked(*load_example("attention.kir"), "canonicalize,cse,fuse-pointwise,dce")
              .fused_nodes == 0);
  }

  TEST_CASE("a GELU and residual chain becomes one fused node") {
    auto g = parse_graph(kGeluResidual, "gelu.kir");
    REQUIRE(g.ok());
    Fused f = fuse_checked(**g);
    CHECK(f.fused_nodes == 1);
    CHECK(f.fused_members == 11);  // hb, sq, cu, t1, t2, t3, th, t4, t5, g, y
    // matmul then the fused node; the four scalar constants all moved into the region.
    REQUIRE(f.graph->num_nodes() == 2);
    const Node& fused = *f.graph->nodes().back();
    CHECK(fused.op_name() == "fused");
    CHECK(fused.num_operands() == 3);  // %h, %bias, %x
    CHECK(fused.result(0)->name() == "y");
    CHECK(fused.region(0).num_nodes() == 15);
  }

  TEST_CASE("max-group-size splits a chain, still bit-exact") {
    auto g = parse_graph(kGeluResidual, "gelu.kir");
    REQUIRE(g.ok());
    Fused f = fuse_checked(**g, "fuse-pointwise{max-group-size=4}");
    CHECK(f.fused_nodes >= 3);
    CHECK(f.fused_members == 11);  // hb, sq, cu, t1, t2, t3, th, t4, t5, g, y
    Fused none = fuse_checked(**g, "fuse-pointwise{min-group-size=12}");
    CHECK(none.fused_nodes == 0);
  }

  TEST_CASE("rejects group sizes below one") {
    auto info = fusion_registry().pass("fuse-pointwise");
    REQUIRE(info.ok());
    for (const char* name : {"max-group-size", "min-group-size"}) {
      auto opts =
          resolve_options((*info)->options, {{name, OptionValue(int64_t{0})}}, "fuse-pointwise");
      REQUIRE(opts.ok());
      auto pass = (*info)->create(*opts);
      REQUIRE_FALSE(pass.ok());
      CHECK(pass.status().message() ==
            "fuse-pointwise: " + std::string(name) + " must be at least 1, got 0");
    }
  }
}
