// fuse-attention on the small exported models: one attention node per layer, outputs unchanged.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kiln/core/loader.h"
#include "kiln/core/pass_manager.h"
#include "kiln/ir/interpreter.h"

#include "onnx_test_util.h"

using namespace kiln;
using namespace kiln::onnx_test;

namespace {

int count_op(const Graph& g, const std::string& op) {
  int n = 0;
  for (const auto& node : g.nodes()) n += node->op_name() == op;
  return n;
}

/// Imports tests/models/NAME/model.onnx (batch 1, seq 16), runs `passes` and returns the graph.
std::unique_ptr<Graph> import_with(const std::string& name, const std::string& passes) {
  Registry& reg = registry();
  for (const char* lib : {"kiln-plugin-transforms.so", "kiln-plugin-fusion.so"}) {
    Status s = load_plugin(std::string(KILN_PLUGIN_DIR) + "/" + lib, reg);
    REQUIRE_MESSAGE(s.ok(), s.message());
  }
  auto g = import(std::string(KILN_SOURCE_DIR) + "/tests/models/" + name + "/model.onnx",
                  {{"dims", std::vector<std::string>{"batch=1", "seq=16"}}});
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto stages = parse_pass_list(passes, reg);
  REQUIRE_MESSAGE(stages.ok(), stages.status().message());
  PassManager pm(reg, PassManagerOptions{});
  Status s = pm.run(**g, *stages, passes);
  REQUIRE_MESSAGE(s.ok(), s.message());
  return std::move(g).value();
}

}  // namespace

TEST_CASE("fuse-attention: every layer of the small exported decoders becomes one attention node") {
  // The small models have 2 layers; GPT-2 has 4 heads, the Llama-style one 4 query heads over
  // 2 kv heads, so its repeat_kv must fold into the op.
  for (const char* name : {"gpt2-small-legacy", "gpt2-small-dynamo", "llama-small-legacy",
                           "llama-small-dynamo"}) {
    INFO(name);
    auto plain = import_with(name, "canonicalize,cse,dce");
    auto fused = import_with(name, "canonicalize,cse,fuse-attention{f32=true},dce");
    CHECK(count_op(*plain, "attention") == 0);
    CHECK(count_op(*fused, "attention") == 2);
    CHECK(count_op(*fused, "softmax") == 0);
    for (const auto& n : fused->nodes())
      if (n->op_name() == "attention") {
        CHECK(n->get_int("causal") == 1);
        CHECK(n->num_operands() == 3);
        CHECK(n->get_float("scale") == doctest::Approx(1 / std::sqrt(32.0)));
        const bool gqa = std::string(name).find("llama") == 0;
        CHECK(n->operand(1)->shape()[1] == Dim(gqa ? 2 : 4));
      }
    // Token ids 0..15: the same inputs through both graphs on the interpreter.
    std::vector<Tensor> ids = {Tensor(DType::kI64, {1, 16})};
    for (int64_t i = 0; i < 16; ++i) ids[0].set_i64(i, (i * 7) % 50);
    auto want = Interpreter().run(*plain, ids);
    auto got = Interpreter().run(*fused, ids);
    REQUIRE_MESSAGE(want.ok(), want.status().message());
    REQUIRE_MESSAGE(got.ok(), got.status().message());
    const std::vector<double> w = (*want)[0].to_f64(), o = (*got)[0].to_f64();
    REQUIRE(w.size() == o.size());
    for (size_t i = 0; i < w.size(); ++i)
      REQUIRE_MESSAGE(std::abs(w[i] - o[i]) <= 1e-5 + 1.3e-6 * std::abs(w[i]), "element " << i);
  }
}
