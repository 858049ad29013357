// fuse-horizontal from its plugin: projections sharing an activation become one batched matmul
// whose slices are the old results; outputs match the reference before and after.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>

#include "kiln/core/pass_manager.h"
#include "kiln/ir/text.h"

#include "plugin_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

Registry& horizontal_registry() {
  static Registry& reg = registry_with({"kiln-plugin-fusion.so", "kiln-plugin-frontend-kir.so",
                                       "kiln-plugin-backend-reference.so"});
  return reg;
}

std::string weights(const std::string& dt, int64_t rows, int64_t cols, int seed) {
  std::string s = "dense<" + dt + "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]>[";
  for (int64_t i = 0; i < rows * cols; ++i) s += (i ? ", " : "") + std::to_string(((i * 7 + seed) % 11 - 5) / 4.0);
  return s + "]";
}

/// Q/K/V-like projections: two linears ([N, K] weights) and a matmul ([K, N]) of one input,
/// plus an output projection of another width.
std::string qkv(const std::string& dt, int64_t batch, int64_t seq) {
  const std::string x = dt + "[" + std::to_string(batch) + ", " + std::to_string(seq) + ", 4]";
  const std::string y = dt + "[" + std::to_string(batch) + ", " + std::to_string(seq) + ", 8]";
  const std::string o = dt + "[" + std::to_string(batch) + ", " + std::to_string(seq) + ", 6]";
  return "graph @g(%x: " + x + ") -> (" + y + ", " + y + ", " + y + ", " + o + ") {\n" +
         "  %wq = constant() {value = " + weights(dt, 8, 4, 1) + "} : " + dt + "[8, 4]\n" +
         "  %wk = constant() {value = " + weights(dt, 8, 4, 2) + "} : " + dt + "[8, 4]\n" +
         "  %wv = constant() {value = " + weights(dt, 4, 8, 3) + "} : " + dt + "[4, 8]\n" +
         "  %wo = constant() {value = " + weights(dt, 6, 4, 4) + "} : " + dt + "[6, 4]\n" +
         "  %q = linear(%x, %wq) : " + y + "\n  %k = linear(%x, %wk) : " + y + "\n" +
         "  %v = matmul(%x, %wv) : " + y + "\n  %o = linear(%x, %wo) : " + o + "\n  return %q, %k, %v, %o\n}\n";
}

/// nn.Linear as PyTorch's front end gives it: linears with biases (one a constant, one an
/// input) beside a matmul without, all of one input.
std::string qkv_biased(const std::string& dt) {
  const std::string y = dt + "[2, 64, 8]";
  return "graph @g(%x: " + dt + "[2, 64, 4], %bk: " + dt + "[8]) -> (" + y + ", " + y + ", " + y + ") {\n" +
         "  %wq = constant() {value = " + weights(dt, 8, 4, 1) + "} : " + dt + "[8, 4]\n" +
         "  %bq = constant() {value = " + weights(dt, 1, 8, 5) + "} : " + dt + "[1, 8]\n" +
         "  %bq1 = reshape(%bq) {shape = [8]} : " + dt + "[8]\n" +
         "  %wk = constant() {value = " + weights(dt, 8, 4, 2) + "} : " + dt + "[8, 4]\n" +
         "  %wv = constant() {value = " + weights(dt, 4, 8, 3) + "} : " + dt + "[4, 8]\n" +
         "  %q = linear(%x, %wq, %bq1) : " + y + "\n  %k = linear(%x, %wk, %bk) : " + y + "\n" +
         "  %v = matmul(%x, %wv) : " + y + "\n  return %q, %k, %v\n}\n";
}

int count_ops(const Graph& g, const std::string& op) {
  int n = 0;
  for (const auto& node : g.nodes()) n += node->op_name() == op;
  return n;
}

std::unique_ptr<Graph> run_pass(const Graph& g, const std::string& passes) {
  auto after = g.clone();
  auto stages = parse_pass_list(passes, horizontal_registry());
  REQUIRE_MESSAGE(stages.ok(), stages.status().message());
  PassManager pm(horizontal_registry(), PassManagerOptions{});
  Status s = pm.run(*after, *stages, passes);
  REQUIRE_MESSAGE(s.ok(), s.message());
  return after;
}

}  // namespace

TEST_SUITE("fuse-horizontal") {
  TEST_CASE("Q/K/V projections become one matmul whose slices match the reference") {
    for (const char* dt : {"f32", "f16", "bf16"}) {
      CAPTURE(dt);
      auto g = parse_graph(qkv(dt, 2, 64));
      REQUIRE_MESSAGE(g.ok(), g.status().message());
      auto after = run_pass(**g, "fuse-horizontal");
      CHECK(count_ops(*after, "matmul") == 1);
      CHECK(count_ops(*after, "linear") == 1);  // the [6, 4] projection
      CHECK(count_ops(*after, "split") == 1);
      CHECK(count_ops(*after, "constant") == 2);  // stacked weights and %wo
      std::mt19937 rng(5);
      const std::vector<Tensor> in = random_inputs(**g, rng);
      const std::vector<Tensor> want = run_reference(horizontal_registry(), **g, in),
                                got = run_reference(horizontal_registry(), *after, in);
      REQUIRE(want.size() == got.size());
      for (size_t k = 0; k < want.size(); ++k) {
        REQUIRE(want[k].type() == got[k].type());
        for (int64_t i = 0; i < want[k].numel(); ++i)
          REQUIRE(std::fabs(want[k].get_f64(i) - got[k].get_f64(i)) <= 1e-5 + 1e-5 * std::fabs(want[k].get_f64(i)));
      }
    }
  }

  TEST_CASE("linears with biases join the matmul; each bias is added to its slice") {
    for (const char* dt : {"f32", "bf16"}) {
      CAPTURE(dt);
      auto g = parse_graph(qkv_biased(dt));
      REQUIRE_MESSAGE(g.ok(), g.status().message());
      auto after = run_pass(**g, "fuse-horizontal");
      CHECK(count_ops(*after, "matmul") == 1);
      CHECK(count_ops(*after, "linear") == 0);
      CHECK(count_ops(*after, "add") == 2);
      std::mt19937 rng(7);
      const std::vector<Tensor> in = random_inputs(**g, rng);
      const std::vector<Tensor> want = run_reference(horizontal_registry(), **g, in),
                                got = run_reference(horizontal_registry(), *after, in);
      REQUIRE(want.size() == got.size());
      // bf16: the product is rounded before its bias is added (as ONNX's matmul + add is), not once.
      const double tol = std::string(dt) == "bf16" ? 1e-2 : 1e-5;
      for (size_t k = 0; k < want.size(); ++k) {
        REQUIRE(want[k].type() == got[k].type());
        for (int64_t i = 0; i < want[k].numel(); ++i)
          REQUIRE(std::fabs(want[k].get_f64(i) - got[k].get_f64(i)) <= tol + tol * std::fabs(want[k].get_f64(i)));
      }
    }
  }

  TEST_CASE("few rows (GEMV territory), other inputs and a group limit") {
    auto small = parse_graph(qkv("f32", 1, 8));
    REQUIRE(small.ok());
    CHECK(count_ops(*run_pass(**small, "fuse-horizontal"), "matmul") == 1);  // untouched: the [4, 8] one
    CHECK(count_ops(*run_pass(**small, "fuse-horizontal{min-rows=8}"), "split") == 1);
    auto g = parse_graph(qkv("f32", 2, 64));
    REQUIRE(g.ok());
    auto two = run_pass(**g, "fuse-horizontal{max-group-size=2}");
    CHECK(count_ops(*two, "split") == 1);  // q and k; v alone is left as it was
    CHECK(count_ops(*two, "matmul") == 2);
    auto info = horizontal_registry().pass("fuse-horizontal");
    REQUIRE(info.ok());
    auto opts = resolve_options((*info)->options, {{"max-group-size", OptionValue(int64_t{1})}}, "fuse-horizontal");
    REQUIRE(opts.ok());
    auto pass = (*info)->create(*opts);
    REQUIRE_FALSE(pass.ok());
    CHECK(pass.status().message() == "fuse-horizontal: max-group-size must be at least 2, got 1");
  }
}
