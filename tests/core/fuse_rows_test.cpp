// fuse-rows from its plugin: row reductions take their elementwise prologue and epilogue into one
// fused node; outputs stay bit-identical on the reference, in f32, f16 and bf16.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <string>

#include "kiln/core/loader.h"
#include "kiln/core/pass_manager.h"
#include "kiln/ir/text.h"

#include "plugin_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

Registry& rows_registry() {
  static Registry& reg = registry_with({"kiln-plugin-fusion.so", "kiln-plugin-transforms.so",
                                       "kiln-plugin-frontend-kir.so", "kiln-plugin-backend-reference.so"});
  return reg;
}

std::string with_dtype(std::string text, const std::string& dt) {
  for (size_t at = text.find("DT"); at != std::string::npos; at = text.find("DT", at)) text.replace(at, 2, dt);
  return text;
}

struct Rows {
  std::unique_ptr<Graph> graph;
  std::vector<const Node*> fused;  ///< the fused nodes, in graph order
};

/// Runs `passes` on a copy of the graph in `text`; outputs on random inputs must be bit-identical
/// (fusion only moves nodes into regions, the reference runs the same ops in the same order).
Rows fuse(const std::string& text, const std::string& passes = "fuse-rows") {
  auto g = parse_graph(text);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto after = (*g)->clone();
  auto stages = parse_pass_list(passes, rows_registry());
  REQUIRE_MESSAGE(stages.ok(), stages.status().message());
  PassManager pm(rows_registry(), PassManagerOptions{});
  Status s = pm.run(*after, *stages, passes);
  REQUIRE_MESSAGE(s.ok(), s.message());
  std::mt19937 rng(11);
  const std::vector<Tensor> inputs = random_inputs(**g, rng);
  const std::vector<Tensor> want = run_reference(rows_registry(), **g, inputs),
                            got = run_reference(rows_registry(), *after, inputs);
  REQUIRE(want.size() == got.size());
  for (size_t k = 0; k < want.size(); ++k) {
    INFO("output ", k);
    REQUIRE(want[k].type() == got[k].type());
    CHECK(std::memcmp(want[k].data(), got[k].data(), want[k].nbytes()) == 0);
  }
  Rows r;
  for (const auto& n : after->nodes())
    if (n->op_name() == "fused") r.fused.push_back(n.get());
  r.graph = std::move(after);
  return r;
}

std::vector<std::string> body_ops(const Node& fused) {
  std::vector<std::string> ops;
  for (const auto& n : fused.region(0).nodes())
    if (n->op_name() != "constant") ops.push_back(n->op_name());
  return ops;
}

}  // namespace

TEST_SUITE("fuse-rows") {
  TEST_CASE("rms_norm + residual: one fused node that also yields the residual sum") {
    for (const char* dt : {"f32", "f16", "bf16"}) {
      CAPTURE(dt);
      Rows r = fuse(with_dtype(R"(graph @g(%x: DT[4, 64], %res: DT[4, 64], %w: DT[64], %v: DT[64, 8]) -> (DT[4, 8], DT[4, 64]) {
  %h = add(%x, %res) : DT[4, 64]
  %n = rms_norm(%h, %w) : DT[4, 64]
  %m = matmul(%n, %v) : DT[4, 8]
  return %m, %h
})", dt));
      REQUIRE(r.fused.size() == 1);
      CHECK(body_ops(*r.fused[0]) == std::vector<std::string>{"add", "rms_norm"});
      REQUIRE(r.fused[0]->num_results() == 2);
      CHECK(r.fused[0]->result(0)->name() == "h");
      CHECK(r.fused[0]->result(1)->name() == "n");
      CHECK(r.graph->num_nodes() == 2);  // the fused node, the matmul
    }
  }

  TEST_CASE("layer_norm + residual with a cast epilogue, and softmax with scale and mask prologues") {
    for (const char* dt : {"f32", "f16", "bf16"}) {
      CAPTURE(dt);
      Rows ln = fuse(with_dtype(R"(graph @g(%x: DT[2, 3, 32], %res: DT[2, 3, 32], %w: DT[32], %b: DT[32]) -> (f32[2, 3, 32], DT[2, 3, 32]) {
  %h = add(%x, %res) : DT[2, 3, 32]
  %n = layer_norm(%h, %w, %b) {axis = 2} : DT[2, 3, 32]
  %y = cast(%n) {to = f32} : f32[2, 3, 32]
  return %y, %h
})", dt));
      REQUIRE(ln.fused.size() == 1);
      CHECK(body_ops(*ln.fused[0]) == std::vector<std::string>{"add", "layer_norm", "cast"});
      Rows sm = fuse(with_dtype(R"(graph @g(%s: DT[2, 4, 8, 8], %mask: DT[2, 1, 1, 8]) -> (DT[2, 4, 8, 8]) {
  %k = constant() {value = dense<DT[]>[0.125]} : DT[]
  %a = mul(%s, %k) : DT[2, 4, 8, 8]
  %b = add(%a, %mask) : DT[2, 4, 8, 8]
  %p = softmax(%b) {axis = -1} : DT[2, 4, 8, 8]
  return %p
})", dt));
      REQUIRE(sm.fused.size() == 1);
      CHECK(body_ops(*sm.fused[0]) == std::vector<std::string>{"mul", "add", "softmax"});
      CHECK(sm.fused[0]->num_operands() == 2);  // the scale constant moved inside
      CHECK(sm.graph->num_nodes() == 1);
    }
  }

  TEST_CASE("a decomposed rms norm (pow, reduce_mean, rsqrt, muls) is one group around its reduction") {
    Rows r = fuse(R"(graph @g(%x: bf16[4, 128], %w: bf16[128]) -> (bf16[4, 128]) {
  %two = constant() {value = dense<bf16[]>[2]} : bf16[]
  %eps = constant() {value = dense<bf16[]>[0.00001]} : bf16[]
  %sq = pow(%x, %two) : bf16[4, 128]
  %ms = reduce_mean(%sq) {axes = [-1]} : bf16[4, 1]
  %e = add(%ms, %eps) : bf16[4, 1]
  %rs = rsqrt(%e) : bf16[4, 1]
  %n = mul(%x, %rs) : bf16[4, 128]
  %y = mul(%n, %w) : bf16[4, 128]
  return %y
})");
    REQUIRE(r.fused.size() == 1);
    CHECK(body_ops(*r.fused[0]) == std::vector<std::string>{"pow", "reduce_mean", "add", "rsqrt", "mul", "mul"});
    CHECK(r.graph->num_nodes() == 1);
  }

  TEST_CASE("what stays out: leading-axis reductions, dropped reduced dims, other shapes, cycles") {
    // softmax over dim 0 and a reduction over a leading axis anchor nothing.
    Rows lead = fuse(R"(graph @g(%x: f32[4, 8]) -> (f32[4, 8], f32[1, 8]) {
  %e = exp(%x) : f32[4, 8]
  %s = softmax(%e) {axis = 0} : f32[4, 8]
  %m = reduce_max(%e) {axes = [0]} : f32[1, 8]
  return %s, %m
})");
    CHECK(lead.fused.empty());
    // keepdims = 0: the [4] sums would broadcast along the wrong dim, so the add stays out.
    Rows drop = fuse(R"(graph @g(%x: f32[4, 4], %b: f32[4]) -> (f32[4]) {
  %t = tanh(%x) : f32[4, 4]
  %s = reduce_sum(%t) {axes = [1], keepdims = 0} : f32[4]
  %y = add(%s, %b) : f32[4]
  return %y
})");
    REQUIRE(drop.fused.size() == 1);
    CHECK(body_ops(*drop.fused[0]) == std::vector<std::string>{"tanh", "reduce_sum"});
    // The epilogue mul also needs the matmul of the norm's output: joining would make a cycle.
    Rows cyc = fuse(R"(graph @g(%x: f32[4, 4], %w: f32[4, 4]) -> (f32[4, 4]) {
  %n = rms_norm(%x) : f32[4, 4]
  %m = matmul(%n, %w) : f32[4, 4]
  %y = mul(%n, %m) : f32[4, 4]
  return %y
})");
    REQUIRE(cyc.fused.size() == 1);
    CHECK(body_ops(*cyc.fused[0]) == std::vector<std::string>{"rms_norm"});
    // A broadcast op whose result is larger than the rows (here [2, 4, 4] from [4, 4]) stays out.
    Rows big = fuse(R"(graph @g(%x: f32[4, 4], %z: f32[2, 4, 4]) -> (f32[2, 4, 4]) {
  %n = softmax(%x) {axis = -1} : f32[4, 4]
  %y = add(%n, %z) : f32[2, 4, 4]
  return %y
})");
    REQUIRE(big.fused.size() == 1);
    CHECK(body_ops(*big.fused[0]) == std::vector<std::string>{"softmax"});
  }

  TEST_CASE("fuse-rows then fuse-pointwise: the row group first, the remaining chain after") {
    Rows r = fuse(R"(graph @g(%x: f32[4, 16], %w: f32[16, 16]) -> (f32[4, 16]) {
  %n = rms_norm(%x) : f32[4, 16]
  %m = matmul(%n, %w) : f32[4, 16]
  %a = sigmoid(%m) : f32[4, 16]
  %y = mul(%a, %m) : f32[4, 16]
  return %y
})", "fuse-rows,fuse-pointwise");
    REQUIRE(r.fused.size() == 2);
    CHECK(body_ops(*r.fused[0]) == std::vector<std::string>{"rms_norm"});
    CHECK(body_ops(*r.fused[1]) == std::vector<std::string>{"sigmoid", "mul"});
    // min-group-size 2 leaves a lone norm alone.
    CHECK(fuse("graph @g(%x: f32[4, 16]) -> (f32[4, 16]) {\n  %n = rms_norm(%x) : f32[4, 16]\n  return %n\n}",
               "fuse-rows{min-group-size=2}")
              .fused.empty());
  }

  TEST_CASE("rejects group sizes below one") {
    auto info = rows_registry().pass("fuse-rows");
    REQUIRE(info.ok());
    for (const char* name : {"max-group-size", "min-group-size"}) {
      auto opts = resolve_options((*info)->options, {{name, OptionValue(int64_t{0})}}, "fuse-rows");
      REQUIRE(opts.ok());
      auto pass = (*info)->create(*opts);
      REQUIRE_FALSE(pass.ok());
      CHECK(pass.status().message() == "fuse-rows: " + std::string(name) + " must be at least 1, got 0");
    }
  }
}
