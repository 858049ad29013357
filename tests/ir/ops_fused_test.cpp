// Tests of the fused op: type inference through its region and running it.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"

#include "op_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {




Tensor iota3() { return f32({3}, {0, 1, 2}); }

const TensorType kB2x2{DType::kF32, {2, 2}};

/// A graph with inputs x (`outer_x`) and b f32[2, 2] and one fused node whose region
/// declares its first input as `region_a` and computes h = matmul(a, b), t = transpose(h),
/// returning (t, h). The node's result types come from its shape rule.
StatusOr<std::unique_ptr<Graph>> build_fused(const TensorType& outer_x, const TensorType& region_a,
                                             int num_results = 2) {
  auto g = std::make_unique<Graph>();
  Value* x = g->add_input("x", outer_x);
  Value* b = g->add_input("b", kB2x2);
  KILN_ASSIGN_OR_RETURN(
      Node * fused,
      g->create_node("fused", {x, b}, std::vector<TensorType>(static_cast<size_t>(num_results))));
  Graph& body = fused->add_region("body");
  Value* a = body.add_input("a", region_a);
  Value* bb = body.add_input("b", kB2x2);
  const Dim rows = region_a.shape[0];
  KILN_ASSIGN_OR_RETURN(Node * h,
                        body.create_node("matmul", {a, bb}, {TensorType{DType::kF32, {rows, 2}}}));
  KILN_ASSIGN_OR_RETURN(
      Node * t, body.create_node("transpose", {h->result()}, {TensorType{DType::kF32, {2, rows}}}));
  body.set_outputs({t->result(), h->result()});
  std::vector<TensorType> operand_types = {outer_x, kB2x2};
  KILN_ASSIGN_OR_RETURN(auto types, infer_node_types(*fused, operand_types));
  for (int i = 0; i < fused->num_results(); ++i)
    fused->result(i)->set_type(types[static_cast<size_t>(i)]);
  g->set_outputs(fused->results());
  KILN_RETURN_IF_ERROR(verify(*g));
  return g;
}

/// x = [[1, 2], [3, 4], [5, 6]], b = [[1, 0], [1, 1]]: h = [[3, 2], [7, 4], [11, 6]].
void check_fused_run(const Graph& g) {
  const std::vector<Tensor> inputs = {f32({3, 2}, {1, 2, 3, 4, 5, 6}), f32({2, 2}, {1, 0, 1, 1})};
  StatusOr<std::vector<Tensor>> r = Interpreter().run(g, inputs);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  REQUIRE(r->size() == 2);
  check_values((*r)[0], {2, 3}, {3, 7, 11, 2, 4, 6});
  check_values((*r)[1], {3, 2}, {3, 2, 7, 4, 11, 6});
}

}  // namespace

TEST_CASE("fused: op is registered with one region") {
  const OpDef* def = OpRegistry::global().find("fused");
  REQUIRE(def != nullptr);
  CHECK(def->has(kTraitHasRegions));
  CHECK(def->num_regions == 1);
  CHECK(def->fixed_outputs() == -1);
}

TEST_CASE("fused: a symbolic region over static operands gives static results") {
  auto g = build_fused({DType::kF32, {3, 2}}, {DType::kF32, {Dim::symbol("B"), 2}});
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  const Node& n = *(*g)->nodes().front();
  CHECK(n.result(0)->type().str() == "f32[2, 3]");
  CHECK(n.result(1)->type().str() == "f32[3, 2]");
  check_fused_run(**g);
}

TEST_CASE("fused: matching symbolic operands take the region's output types") {
  auto g = build_fused({DType::kF32, {Dim::symbol("B"), 2}}, {DType::kF32, {Dim::symbol("B"), 2}});
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  const Node& n = *(*g)->nodes().front();
  CHECK(n.result(0)->type().str() == "f32[2, B]");
  CHECK(n.result(1)->type().str() == "f32[B, 2]");
  check_fused_run(**g);
}

TEST_CASE("fused: outer symbol names replace the region's") {
  auto r = build_fused({DType::kF32, {Dim::symbol("N"), 2}}, {DType::kF32, {Dim::symbol("B"), 2}});
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  const Node& n = *(*r)->nodes().front();
  CHECK(n.result(0)->type().str() == "f32[2, N]");
  // A static region dim makes a symbolic operand dim concrete.
  auto s = build_fused({DType::kF32, {Dim::symbol("N"), 2}}, {DType::kF32, {3, 2}});
  REQUIRE_MESSAGE(s.ok(), s.status().message());
  CHECK((*s)->nodes().front()->result(1)->type().str() == "f32[3, 2]");
}

TEST_CASE("fused: errors") {
  const TensorType region_a{DType::kF32, {Dim::symbol("B"), 2}};
  CHECK(error_of(build_fused({DType::kF32, {3, 3}}, region_a))
            .find("fused: operand 0 f32[3, 3] does not match region input %a f32[B, 2]") !=
        std::string::npos);
  CHECK(error_of(build_fused({DType::kF16, {3, 2}}, region_a))
            .find("operand 0 f16[3, 2] does not match region input %a f32[B, 2]") !=
        std::string::npos);
  CHECK(error_of(build_fused({DType::kF32, {3, 2}}, region_a, 3))
            .find("region @body returns 2 values but the node has 3 results") != std::string::npos);
  Graph g;
  Value* x = g.add_input("x", {DType::kF32, {3}});
  auto n = g.create_node("fused", {x}, {TensorType{DType::kF32, {3}}});
  REQUIRE(n.ok());
  (*n)->add_region("body");
  CHECK(error_of(infer_node_types(**n, {x->type()}))
            .find("region @body takes 0 inputs but the node has 1 operands") != std::string::npos);
}

TEST_CASE("fused: a kernel error inside the region names the region") {
  Graph g;
  Value* data = g.add_input("data", {DType::kF32, {3}});
  Value* idx = g.add_input("idx", {DType::kI64, {1}});
  auto fused = g.create_node("fused", {data, idx}, {TensorType{DType::kF32, {1}}});
  REQUIRE(fused.ok());
  Graph& body = (*fused)->add_region("body");
  Value* d = body.add_input("d", {DType::kF32, {3}});
  Value* i = body.add_input("i", {DType::kI64, {1}});
  auto gather = body.create_node("gather", {d, i}, {TensorType{DType::kF32, {1}}});
  REQUIRE(gather.ok());
  body.set_outputs({(*gather)->result()});
  g.set_outputs({(*fused)->result()});
  REQUIRE(verify(g).ok());
  const int64_t ok_index[] = {-1}, bad_index[] = {5};
  auto good = Interpreter().run(
      g, std::vector<Tensor>{iota3(), Tensor::from_i64(DType::kI64, {1}, ok_index)});
  REQUIRE_MESSAGE(good.ok(), good.status().message());
  check_values((*good)[0], {1}, {2});
  auto bad = Interpreter().run(
      g, std::vector<Tensor>{iota3(), Tensor::from_i64(DType::kI64, {1}, bad_index)});
  CHECK(error_of(bad).find(
            "fused: in region @body: gather: index 5 is out of range for axis 0 of size 3") !=
        std::string::npos);
}
