// canonicalize, cse and dce from their plugin: outputs on random inputs match before and after.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <string>

#include "kiln/core/loader.h"
#include "kiln/core/pass_manager.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

#include "plugin_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

/// The global registry with the in-tree plugins loaded.
Registry& registry() {
  static Registry& reg = registry_with({"kiln-plugin-transforms.so", "kiln-plugin-frontend-kir.so",
                                       "kiln-plugin-backend-reference.so", "kiln-plugin-backend-null.so"});
  return reg;
}

std::unique_ptr<Graph> parse(const std::string& text) {
  auto g = parse_graph(text, "test.kir");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(g).value();
}


std::vector<Tensor> run_reference(const Graph& g, const std::vector<Tensor>& inputs) {
  return kiln::test::run_reference(registry(), g, inputs);
}

void check_close(const std::vector<Tensor>& want, const std::vector<Tensor>& got) {
  REQUIRE(want.size() == got.size());
  for (size_t k = 0; k < want.size(); ++k) {
    REQUIRE(want[k].type() == got[k].type());
    REQUIRE(want[k].numel() > 0);
    for (int64_t i = 0; i < want[k].numel(); ++i) {
      const double a = want[k].get_f64(i), b = got[k].get_f64(i);
      if (std::isnan(a)) {
        CHECK(std::isnan(b));
        continue;
      }
      INFO("output ", k, " element ", i);
      CHECK(std::fabs(a - b) <= 1e-6 * (1.0 + std::fabs(a)));
    }
  }
}

struct Result {
  std::unique_ptr<Graph> graph;
  bool changed = false;
};

/// Runs `passes` (a pass list such as "canonicalize{max-iterations=1},dce") on `text`, checks
/// the outputs on three sets of random inputs against the unchanged graph, and returns the
/// rewritten graph.
Result run_checked(const std::string& text, const std::string& passes) {
  auto before = parse(text);
  auto after = before->clone();
  auto stages = parse_pass_list(passes, registry());
  REQUIRE_MESSAGE(stages.ok(), stages.status().message());
  PassManager pm(registry(), PassManagerOptions{});
  Status s = pm.run(*after, *stages, passes);
  REQUIRE_MESSAGE(s.ok(), s.message());
  std::mt19937 rng(42);
  for (int trial = 0; trial < 3; ++trial) {
    const std::vector<Tensor> inputs = random_inputs(*before, rng);
    check_close(run_reference(*before, inputs), run_reference(*after, inputs));
  }
  bool changed = false;
  for (const PassTiming& t : pm.timings()) changed |= t.changed;
  return {std::move(after), changed};
}

/// The op names of a graph's top-level nodes, in order: "constant,mul".
std::string ops(const Graph& g) {
  std::string s;
  for (const auto& n : g.nodes()) s += (s.empty() ? "" : ",") + n->op_name();
  return s;
}

}  // namespace

TEST_SUITE("canonicalize") {
  TEST_CASE("folds nodes whose operands are all constants") {
    Result r = run_checked(R"(graph @g(%x: f32[2, 3]) -> (f32[2, 3]) {
  %a = constant() {value = dense<f32[2, 3]>[1, 2, 3, 4, 5, 6]} : f32[2, 3]
  %b = constant() {value = dense<f32[3]>[0.5, -1, 2]} : f32[3]
  %s = add(%a, %b) : f32[2, 3]
  %e = exp(%s) : f32[2, 3]
  %y = mul(%x, %e) : f32[2, 3]
  return %y
})", "canonicalize");
    CHECK(r.changed);
    CHECK(ops(*r.graph) == "constant,mul");
    const Node& c = *r.graph->nodes().front();
    CHECK(c.result()->name() == "e");  // the folded value keeps its name
    const Tensor& t = c.attr("value")->as_tensor();
    CHECK(t.get_f64(0) == doctest::Approx(std::exp(1.5)));
    CHECK(t.get_f64(5) == doctest::Approx(std::exp(8.0)));
  }

  TEST_CASE("leaves results above fold-limit-bytes alone") {
    const std::string text = R"(graph @g() -> (f32[2, 3]) {
  %a = constant() {value = dense<f32[2, 3]>[1, 2, 3, 4, 5, 6]} : f32[2, 3]
  %y = neg(%a) : f32[2, 3]
  return %y
})";
    Result small = run_checked(text, "canonicalize{fold-limit-bytes=20}");  // needs 24
    CHECK_FALSE(small.changed);
    CHECK(ops(*small.graph) == "constant,neg");
    Result fits = run_checked(text, "canonicalize{fold-limit-bytes=24}");
    CHECK(ops(*fits.graph) == "constant");
  }

  TEST_CASE("removes additive and multiplicative identities") {
    Result r = run_checked(R"(graph @g(%x: f32[2, 3]) -> (f32[2, 3]) {
  %z = constant() {value = dense<f32[]>[0]} : f32[]
  %o = constant() {value = dense<f32[3]>[1, 1, 1]} : f32[3]
  %a = add(%x, %z) : f32[2, 3]
  %b = add(%z, %a) : f32[2, 3]
  %c = sub(%b, %z) : f32[2, 3]
  %d = mul(%c, %o) : f32[2, 3]
  %e = mul(%o, %d) : f32[2, 3]
  %f = div(%e, %o) : f32[2, 3]
  return %f
})", "canonicalize");
    CHECK(r.graph->num_nodes() == 0);
    CHECK(r.graph->output(0) == r.graph->input(0));
  }

  TEST_CASE("keeps identities that would change the type, and x*0 on floats") {
    Result r = run_checked(R"(graph @g(%x: f32[3], %w: i32[3]) -> (f32[2, 3], f32[3], i32[3], f32[3]) {
  %z = constant() {value = dense<f32[2, 3]>[0, 0, 0, 0, 0, 0]} : f32[2, 3]
  %a = add(%x, %z) : f32[2, 3]
  %z1 = constant() {value = dense<f32[]>[0]} : f32[]
  %b = mul(%x, %z1) : f32[3]
  %one = constant() {value = dense<i32[]>[1]} : i32[]
  %c = sub(%one, %w) : i32[3]
  %h = constant() {value = dense<f32[3]>[1, 0, 1]} : f32[3]
  %d = mul(%x, %h) : f32[3]
  return %a, %b, %c, %d
})", "canonicalize");
    CHECK_FALSE(r.changed);
    CHECK(r.graph->num_nodes() == 8);
  }

  TEST_CASE("integer identities fold too") {
    Result r = run_checked(R"(graph @g(%w: i32[4]) -> (i32[4]) {
  %one = constant() {value = dense<i32[]>[1]} : i32[]
  %a = div(%w, %one) : i32[4]
  return %a
})", "canonicalize");
    CHECK(r.graph->num_nodes() == 0);
  }

  TEST_CASE("cancels double negation and no-op casts, reshapes and identities") {
    Result r = run_checked(R"(graph @g(%x: f32[2, 3]) -> (f32[2, 3], f32[2, 3]) {
  %a = neg(%x) : f32[2, 3]
  %b = neg(%a) : f32[2, 3]
  %c = cast(%b) {to = f32} : f32[2, 3]
  %d = reshape(%c) {shape = [2, 3]} : f32[2, 3]
  %e = identity(%d) : f32[2, 3]
  %f = neg(%e) : f32[2, 3]
  return %e, %f
})", "canonicalize");
    CHECK(ops(*r.graph) == "neg");
    CHECK(r.graph->output(0) == r.graph->input(0));
  }

  TEST_CASE("removes reshapes between equal symbolic types, keeps real casts and reshapes") {
    Result r = run_checked(R"(graph @g(%x: f32[B, 4]) -> (f32[B, 4], f32[B, 2, 2], f16[B, 4]) {
  %a = reshape(%x) {shape = [0, 4]} : f32[B, 4]
  %b = reshape(%a) {shape = [0, 2, 2]} : f32[B, 2, 2]
  %c = cast(%a) {to = f16} : f16[B, 4]
  return %a, %b, %c
})", "canonicalize");
    CHECK(ops(*r.graph) == "reshape,cast");
    CHECK(r.graph->output(0) == r.graph->input(0));
  }

  TEST_CASE("merges transpose pairs and removes identity permutations") {
    Result r = run_checked(R"(graph @g(%x: f32[2, 3, 4]) -> (f32[4, 2, 3], f32[2, 3, 4]) {
  %a = transpose(%x) {perm = [1, 2, 0]} : f32[3, 4, 2]
  %b = transpose(%a) {perm = [1, 2, 0]} : f32[4, 2, 3]
  %c = transpose(%x) : f32[4, 3, 2]
  %d = transpose(%c) : f32[2, 3, 4]
  return %b, %d
})", "canonicalize");
    CHECK(ops(*r.graph) == "transpose");
    CHECK(r.graph->nodes().front()->get_ints("perm") == std::vector<int64_t>{2, 0, 1});
    CHECK(r.graph->output(1) == r.graph->input(0));
  }

  TEST_CASE("merges reshape chains; a full fixed point needs two sweeps here") {
    // %b's 0 copies %a's dim 0 (6); merged onto %x it must not copy x's dim 0 (2).
    const std::string text = R"(graph @g(%x: f32[2, 3, 4]) -> (f32[6, 2, 2], f32[2, 3, 4]) {
  %a = reshape(%x) {shape = [6, 4]} : f32[6, 4]
  %b = reshape(%a) {shape = [0, 2, -1]} : f32[6, 2, 2]
  %c = reshape(%x) {shape = [24]} : f32[24]
  %d = reshape(%c) {shape = [2, 3, 4]} : f32[2, 3, 4]
  return %b, %d
})";
    Result r = run_checked(text, "canonicalize");
    CHECK(ops(*r.graph) == "reshape");
    CHECK(r.graph->nodes().front()->get_ints("shape") == std::vector<int64_t>{6, 2, 2});
    CHECK(r.graph->output(1) == r.graph->input(0));
    // One sweep merges %d into reshape(%x) to x's own shape; removing it takes another.
    Result once = run_checked(text, "canonicalize{max-iterations=1}");
    CHECK(ops(*once.graph) == "reshape,reshape");
  }

  TEST_CASE("rewrites inside the regions of fused nodes") {
    Result r = run_checked(R"(graph @g(%x: f32[4]) -> (f32[4]) {
  %y = fused(%x) : f32[4] {
    graph @body(%a: f32[4]) -> (f32[4]) {
      %one = constant() {value = dense<f32[]>[1]} : f32[]
      %two = add(%one, %one) : f32[]
      %m = mul(%a, %one) : f32[4]
      %n = mul(%m, %two) : f32[4]
      return %n
    }
  }
  return %y
})", "canonicalize");
    CHECK(r.changed);
    CHECK(ops(r.graph->nodes().front()->region(0)) == "constant,mul");
  }

  TEST_CASE("option values are checked when the pass is created") {
    auto stages = parse_pass_list("canonicalize{max-iterations=0}", registry());
    REQUIRE(stages.ok());
    auto g = parse("graph @g(%x: f32[1]) -> (f32[1]) {\n  return %x\n}\n");
    Status s = PassManager(registry(), {}).run(*g, *stages, "canonicalize{max-iterations=0}");
    // Located at the stage in the pass list.
    CHECK(s.message() == "<pipeline>:1:1: canonicalize: max-iterations must be at least 1, got 0");
    auto neg = parse_pass_list("canonicalize{fold-limit-bytes=-1}", registry());
    REQUIRE(neg.ok());
    s = PassManager(registry(), {}).run(*g, *neg, "canonicalize{fold-limit-bytes=-1}");
    CHECK(s.message() == "<pipeline>:1:1: canonicalize: fold-limit-bytes must not be negative, got -1");
  }
}

TEST_SUITE("cse") {
  TEST_CASE("merges equal nodes and equal constants, chains in one walk") {
    Result r = run_checked(R"(graph @g(%x: f32[2, 3], %w: f32[3, 3]) -> (f32[2, 3]) {
  %a = matmul(%x, %w) : f32[2, 3]
  %b = matmul(%x, %w) : f32[2, 3]
  %ra = relu(%a) : f32[2, 3]
  %rb = relu(%b) : f32[2, 3]
  %c1 = constant() {value = dense<f32[]>[2]} : f32[]
  %c2 = constant() {value = dense<f32[]>[2]} : f32[]
  %sa = mul(%ra, %c1) : f32[2, 3]
  %sb = mul(%rb, %c2) : f32[2, 3]
  %y = add(%sa, %sb) : f32[2, 3]
  return %y
})", "cse");
    CHECK(r.changed);
    CHECK(ops(*r.graph) == "matmul,relu,constant,mul,add");
  }

  TEST_CASE("keeps nodes that differ in attributes, operand order or constant value") {
    Result r = run_checked(R"(graph @g(%x: f32[2, 3], %z: f32[2, 3]) -> (f32[3, 2], f32[2, 3], f32[2, 3], f32[2, 3], f32[2, 3], f32[2, 3]) {
  %t1 = transpose(%x) {perm = [1, 0]} : f32[3, 2]
  %t2 = transpose(%x) : f32[3, 2]
  %s1 = sub(%x, %z) : f32[2, 3]
  %s2 = sub(%z, %x) : f32[2, 3]
  %c1 = constant() {value = dense<f32[]>[2]} : f32[]
  %c2 = constant() {value = dense<f32[]>[3]} : f32[]
  %m1 = mul(%x, %c1) : f32[2, 3]
  %m2 = mul(%x, %c2) : f32[2, 3]
  return %t1, %s1, %s2, %m1, %m2, %m2
})", "cse");
    CHECK_FALSE(r.changed);
    CHECK(r.graph->num_nodes() == 8);
  }

  TEST_CASE("works inside each region separately") {
    Result r = run_checked(R"(graph @g(%x: f32[4]) -> (f32[4], f32[4]) {
  %p = fused(%x) : f32[4] {
    graph @body(%a: f32[4]) -> (f32[4]) {
      %e1 = exp(%a) : f32[4]
      %e2 = exp(%a) : f32[4]
      %s = add(%e1, %e2) : f32[4]
      return %s
    }
  }
  %q = fused(%x) : f32[4] {
    graph @body(%a: f32[4]) -> (f32[4]) {
      %e1 = exp(%a) : f32[4]
      %e2 = exp(%a) : f32[4]
      %s = add(%e1, %e2) : f32[4]
      return %s
    }
  }
  return %p, %q
})", "cse");
    // Fused nodes themselves are not merged; their bodies are deduplicated.
    CHECK(ops(*r.graph) == "fused,fused");
    for (const auto& n : r.graph->nodes()) CHECK(ops(n->region(0)) == "exp,add");
  }
}

TEST_SUITE("dce") {
  TEST_CASE("removes dead chains but keeps graph inputs") {
    Result r = run_checked(R"(graph @g(%x: f32[4], %unused: f32[4]) -> (f32[4]) {
  %a = exp(%x) : f32[4]
  %b = neg(%a) : f32[4]
  %c = tanh(%b) : f32[4]
  %y = relu(%x) : f32[4]
  return %y
})", "dce");
    CHECK(r.changed);
    CHECK(ops(*r.graph) == "relu");
    CHECK(r.graph->num_inputs() == 2);
  }

  TEST_CASE("removes dead nodes inside live regions, and dead fused nodes whole") {
    Result r = run_checked(R"(graph @g(%x: f32[4]) -> (f32[4]) {
  %p = fused(%x) : f32[4] {
    graph @body(%a: f32[4]) -> (f32[4]) {
      %dead = exp(%a) : f32[4]
      %s = relu(%a) : f32[4]
      return %s
    }
  }
  %q = fused(%x) : f32[4] {
    graph @body(%a: f32[4]) -> (f32[4]) {
      %s = relu(%a) : f32[4]
      return %s
    }
  }
  return %p
})", "dce");
    CHECK(ops(*r.graph) == "fused");
    CHECK(ops(r.graph->nodes().front()->region(0)) == "relu");
  }

  TEST_CASE("a clean graph is left unchanged") {
    Result r = run_checked("graph @g(%x: f32[4]) -> (f32[4]) {\n  %y = relu(%x) : f32[4]\n  return %y\n}\n",
                           "dce");
    CHECK_FALSE(r.changed);
    CHECK(ops(*r.graph) == "relu");
  }
}

TEST_SUITE("pipelines") {
  TEST_CASE("canonicalize, cse and dce keep the example models' outputs") {
    // Only attention has work for them: rsqrt of its constant head size folds.
    const std::pair<std::string, int> examples[] = {
        {"mlp.kir", 6}, {"attention.kir", 19}, {"convnet.kir", 8}};
    for (const auto& [name, nodes_after] : examples) {
      INFO(name);
      const std::string path = KILN_SOURCE_DIR "/examples/kir/" + name;
      auto g = parse_graph_file(path);
      REQUIRE_MESSAGE(g.ok(), g.status().message());
      const std::string text = print_graph(**g);
      Result r = run_checked(text, "canonicalize,cse,dce");
      CHECK(r.graph->num_nodes() == nodes_after);
      CHECK(verify(*r.graph).ok());
    }
  }

  TEST_CASE("the in-tree plugins register what they promise") {
    Registry& reg = registry();
    for (const char* pass : {"canonicalize", "cse", "dce"}) {
      auto info = reg.pass(pass);
      REQUIRE_MESSAGE(info.ok(), info.status().message());
      CHECK((*info)->library.find("kiln-plugin-transforms.so") != std::string::npos);
    }
    auto kir = reg.frontend_for_path("model.kir");
    REQUIRE(kir.ok());
    CHECK((*kir)->name == "kir");
    auto ref = reg.backend("reference");
    REQUIRE(ref.ok());
    CHECK((*ref)->targets == std::vector<std::string>{"cpu"});

    // The reference backend refuses graphs that do not verify.
    auto bad = parse("graph @g(%x: f32[2]) -> (f32[2]) {\n  %y = relu(%x) : f32[2]\n  return %y\n}\n");
    bad->nodes().front()->result()->set_type(TensorType{DType::kF64, {2}});
    auto backend = (*ref)->create(Options());
    REQUIRE(backend.ok());
    auto exe = (*backend)->compile(*bad);
    REQUIRE_FALSE(exe.ok());
    CHECK(exe.status().message().rfind("reference: ", 0) == 0);

    // The null backend compiles nothing and says so.
    auto null = reg.backend("null");
    REQUIRE(null.ok());
    auto nb = (*null)->create(Options());
    REQUIRE(nb.ok());
    auto none = (*nb)->compile(*parse("graph @g(%x: f32[2]) -> (f32[2]) {\n  return %x\n}\n"));
    CHECK(none.status().code() == StatusCode::kUnimplemented);
    CHECK(none.status().message() == "null backend: compile is unimplemented");
  }
}
