// fold-layout from its plugin: composed transposes and collapsed reshapes give the same bits on
// the reference, with fewer layout ops.
#include <doctest/doctest.h>

#include <cstring>
#include <random>

#include "kiln/core/pass_manager.h"
#include "kiln/ir/text.h"

#include "plugin_test_util.h"

using namespace kiln;
using namespace kiln::test;

TEST_SUITE("fold-layout") {
  TEST_CASE("transpose and reshape chains fold; outputs are bit-identical") {
    Registry& reg = registry_with({"kiln-plugin-fusion.so", "kiln-plugin-frontend-kir.so",
                                   "kiln-plugin-backend-reference.so"});
    auto g = parse_graph(R"(graph @g(%x: bf16[2, 3, 4, 5]) -> (bf16[5, 2, 4, 3], bf16[2, 3, 4, 5], bf16[6, 20], bf16[3, 40]) {
  %a = transpose(%x) {perm = [0, 2, 1, 3]} : bf16[2, 4, 3, 5]
  %b = transpose(%a) {perm = [3, 0, 1, 2]} : bf16[5, 2, 4, 3]
  %c = transpose(%x) {perm = [1, 0, 3, 2]} : bf16[3, 2, 5, 4]
  %d = transpose(%c) {perm = [1, 0, 3, 2]} : bf16[2, 3, 4, 5]
  %e = flatten(%x) {axis = 2} : bf16[6, 20]
  %f = reshape(%e) {shape = [120]} : bf16[120]
  %h = reshape(%f) {shape = [3, 40]} : bf16[3, 40]
  return %b, %d, %e, %h
})");
    REQUIRE_MESSAGE(g.ok(), g.status().message());
    auto after = (*g)->clone();
    auto stages = parse_pass_list("fold-layout", reg);
    REQUIRE(stages.ok());
    PassManager pm(reg, PassManagerOptions{});
    REQUIRE(pm.run(*after, *stages, "fold-layout").ok());
    int transposes = 0, reshapes = 0;
    for (const auto& n : after->nodes()) {
      transposes += n->op_name() == "transpose";
      reshapes += n->op_name() == "reshape" || n->op_name() == "flatten";
    }
    CHECK(transposes == 1);  // %b as one transpose of %x; %d is %x
    CHECK(reshapes == 2);    // %e, and %h as one reshape of %x
    std::mt19937 rng(3);
    const std::vector<Tensor> in = random_inputs(**g, rng);
    const std::vector<Tensor> want = run_reference(reg, **g, in), got = run_reference(reg, *after, in);
    REQUIRE(want.size() == got.size());
    for (size_t k = 0; k < want.size(); ++k) {
      REQUIRE(want[k].type() == got[k].type());
      CHECK(std::memcmp(want[k].data(), got[k].data(), want[k].nbytes()) == 0);
    }
  }
}
