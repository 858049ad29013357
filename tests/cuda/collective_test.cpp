// Tests of the CUDA lowering of per-rank programs (no GPU): each collective op becomes the
// expected `step collective` (with packing kernels for inner dims), local_shard of a weight
// becomes one block per rank in the weights section, local_shard of an activation a copy
// through a rank-dependent view; the plan records the mesh and placements, and the runtime's
// parser reads every plan back.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kiln/artifact_reader.h"
#include "kiln/cuda/lowering.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

/// Lowers a per-rank program with one collective between `in` and `out` types.
LoweredGraph lower_op(const std::string& mesh, const std::string& in, const std::string& out,
                      const std::string& op) {
  return lower_text("graph @c(%x: " + in + ") -> (" + out + ") mesh<" + mesh +
                    "> per_rank {\n  %y = " + op + " : " + out + "\n  return %y\n}\n");
}

/// The runtime's parser accepts the plan; returns it.
artifact::Plan parsed(const LoweredGraph& l) {
  artifact::Plan p;
  std::string error;
  REQUIRE_MESSAGE(artifact::parse_plan(l.plan, &p, &error), std::string(error + "\n" + l.plan));
  return p;
}

std::vector<std::string> collectives(const std::string& plan) {
  return plan_lines(plan, "step collective");
}

}  // namespace

TEST_CASE("all_reduce and broadcast: one collective step; the plan records mesh and placements") {
  LoweredGraph l = lower_text(
      "graph @c(%x: f32[2, 4]<R, P(sum)>) -> (f32[2, 4]<R, R>) mesh<dp = 2, tp = 2> per_rank {\n"
      "  %y = all_reduce(%x) {axis = \"tp\"} : f32[2, 4]<R, R>\n  return %y\n}\n");
  CHECK(has(l.plan, "\nmesh dp=2 tp=2\n"));
  CHECK(has(l.plan, "\ninput x buffer=0 placement=R,P(sum)\n"));
  CHECK(has(l.plan, " placement=R,R\n"));
  const auto steps_all = steps(l.plan);
  REQUIRE(steps_all.size() == 1);
  CHECK(steps_all[0] ==
        "step collective op=all_reduce axis=tp x=b0 y=b1 count=8 dtype=f32 reduce=sum");
  const artifact::Plan p = parsed(l);
  CHECK(artifact::mesh_text(p) == "dp:2,tp:2");
  CHECK(artifact::placement_text(p.input_placements[0]) == "R,P(sum)");

  l = lower_op("tp = 4", "bf16[3]", "bf16[3]", "all_reduce(%x) {axis = \"tp\", reduce = \"max\"}");
  CHECK(collectives(l.plan) ==
        std::vector<std::string>{
            "step collective op=all_reduce axis=tp x=b0 y=b1 count=3 dtype=bf16 reduce=max"});
  l = lower_op("dp = 2, tp = 2", "i64[5]", "i64[5]", "broadcast(%x) {axis = \"dp\", root = 1}");
  CHECK(collectives(l.plan) ==
        std::vector<std::string>{
            "step collective op=broadcast axis=dp x=b0 y=b1 count=5 dtype=i64 root=1"});
  parsed(l);
}

TEST_CASE(
    "all_gather and reduce_scatter: the outermost dim moves as is, an inner one through a kernel") {
  LoweredGraph l =
      lower_op("tp = 2", "f32[2, 3]", "f32[4, 3]", "all_gather(%x) {axis = \"tp\", dim = 0}");
  CHECK(steps(l.plan) == std::vector<std::string>{
                             "step collective op=all_gather axis=tp x=b0 y=b1 count=6 dtype=f32"});
  parsed(l);
  // dim 1: gathered rank-major into a temporary, then each rank's block put in place.
  l = lower_op("tp = 2", "f32[2, 3]", "f32[2, 6]", "all_gather(%x) {axis = \"tp\", dim = 1}");
  auto all = steps(l.plan);
  REQUIRE(all.size() == 2);
  CHECK(all[0].rfind("step collective op=all_gather axis=tp x=b0 y=b2 count=6 dtype=f32", 0) == 0);
  CHECK(all[1].rfind("step launch", 0) == 0);
  CHECK(has(all[1], "args=b2,b1"));
  CHECK(has(l.plan, "buffer 2 kind=activation dtype=f32 shape=2x6 bytes=48"));
  parsed(l);
  compiles_everywhere(l);

  l = lower_op("tp = 2", "f32[4, 3]", "f32[2, 3]", "reduce_scatter(%x) {axis = \"tp\"}");
  CHECK(steps(l.plan) ==
        std::vector<std::string>{
            "step collective op=reduce_scatter axis=tp x=b0 y=b1 count=6 dtype=f32 reduce=sum"});
  parsed(l);
  l = lower_op("tp = 2", "f16[3, 4]", "f16[3, 2]",
               "reduce_scatter(%x) {axis = \"tp\", dim = 1, reduce = \"max\"}");
  all = steps(l.plan);
  REQUIRE(all.size() == 2);
  CHECK(all[0].rfind("step launch", 0) == 0);  // packed rank-major first
  CHECK(has(all[0], "args=b0,b2"));
  CHECK(all[1] ==
        "step collective op=reduce_scatter axis=tp x=b2 y=b1 count=6 dtype=f16 reduce=max");
  parsed(l);
  compiles_everywhere(l);
}

TEST_CASE(
    "all_to_all: blocks packed along split_dim and unpacked along concat_dim only when not "
    "outermost") {
  // split 0, concat 1: the send blocks are x itself; what arrives is unpacked into y.
  LoweredGraph l = lower_op("tp = 2", "f32[4, 3]", "f32[2, 6]",
                            "all_to_all(%x) {axis = \"tp\", split_dim = 0, concat_dim = 1}");
  auto all = steps(l.plan);
  REQUIRE(all.size() == 2);
  CHECK(all[0] == "step collective op=all_to_all axis=tp x=b0 y=b2 count=6 dtype=f32");
  CHECK(all[1].rfind("step launch", 0) == 0);
  parsed(l);
  // split 1, concat 0: packed first, received straight into y.
  l = lower_op("tp = 2", "f32[4, 2]", "f32[8, 1]",
               "all_to_all(%x) {axis = \"tp\", split_dim = 1, concat_dim = 0}");
  all = steps(l.plan);
  REQUIRE(all.size() == 2);
  CHECK(all[0].rfind("step launch", 0) == 0);
  CHECK(all[1] == "step collective op=all_to_all axis=tp x=b2 y=b1 count=4 dtype=f32");
  parsed(l);
  compiles_everywhere(l);
  // split 0, concat 0: no kernel at all (i8 moves as bytes).
  l = lower_op("tp = 4", "i8[8]", "i8[8]",
               "all_to_all(%x) {axis = \"tp\", split_dim = 0, concat_dim = 0}");
  CHECK(steps(l.plan) == std::vector<std::string>{
                             "step collective op=all_to_all axis=tp x=b0 y=b1 count=2 dtype=i8"});
}

TEST_CASE("send and recv: point to point by absolute rank and tag") {
  LoweredGraph l = lower_text(
      "graph @s0(%x: f32[2]) -> (f32[2]) mesh<pp = 2> per_rank {\n"
      "  %h = neg(%x) : f32[2]\n  send(%h) {peer = 1, tag = 3}\n"
      "  %r = recv() {dtype = f32, peer = 1, shape = [2], tag = 4} : f32[2]\n  return %r\n}\n");
  const auto c = collectives(l.plan);
  REQUIRE(c.size() == 2);
  CHECK(has(c[0], "op=send x=b1 count=2 dtype=f32 peer=1 tag=3"));
  CHECK(has(c[1], "op=recv y="));
  CHECK(has(c[1], " count=2 dtype=f32 peer=1 tag=4"));
  parsed(l);
}

TEST_CASE(
    "local_shard of a constant: one block per rank in the weights section, the whole weight "
    "dropped") {
  LoweredGraph l = lower_text(
      "graph @w(%x: f32[3, 4]) -> (f32[3, 2]) mesh<tp = 2> per_rank {\n"
      "  %w = constant() {value = dense<f32[4, 4]>[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, "
      "14, 15]} : f32[4, 4]\n"
      "  %s = local_shard(%w) {axis = \"tp\", dim = 0} : f32[2, 4]\n"
      "  %y = linear(%x, %s) : f32[3, 2]\n  return %y\n}\n");
  const artifact::Plan p = parsed(l);
  const artifact::PlanBuffer* block = nullptr;
  for (const auto& b : p.buffers)
    if (!b.rank_axis.empty()) block = &b;
  REQUIRE(block != nullptr);
  CHECK(block->kind == artifact::PlanBuffer::Kind::kWeight);
  CHECK(block->rank_axis == "tp");
  CHECK(block->rank_stride == 256);
  CHECK(block->bytes == 32);
  // The section holds the two blocks and nothing else: the whole weight no step reads is gone.
  CHECK(l.weights.size() == block->offset + 256 + 32);
  for (int r = 0; r < 2; ++r) {
    float v[8];
    std::memcpy(v, l.weights.data() + block->offset + static_cast<size_t>(r) * 256, sizeof v);
    for (int i = 0; i < 8; ++i) CHECK(v[i] == static_cast<float>(r * 8 + i));
  }
  CHECK(has(l.plan, "kind=weight dtype=f32 shape=0 bytes=0"));
  // The gemm reads the block in place: no copy, no fold.
  CHECK(plan_lines(l.plan, "step gemm").size() == 1);
  CHECK(plan_lines(l.plan, "step copy").empty());
}

TEST_CASE("local_shard of an activation: a rank-dependent view, copied out or read strided") {
  LoweredGraph l = lower_op("dp = 2, tp = 2", "f32[4, 3]", "f32[2, 3]",
                            "local_shard(%x) {axis = \"dp\", dim = 0}");
  CHECK(has(l.plan,
            "kind=alias dtype=f32 shape=6 bytes=24 offset=0 base=0 rank_axis=dp rank_stride=24"));
  CHECK(plan_lines(l.plan, "step copy").size() == 1);
  parsed(l);
  l = lower_op("tp = 2", "f32[3, 4]", "f32[3, 2]", "local_shard(%x) {axis = \"tp\", dim = 1}");
  CHECK(has(l.plan,
            "kind=alias dtype=f32 shape=10 bytes=40 offset=0 base=0 rank_axis=tp rank_stride=8"));
  REQUIRE(launches(l.plan).size() == 1);
  parsed(l);
  compiles_everywhere(l);
}

TEST_CASE("a tensor-parallel MLP lowers to GEMMs and one all_reduce") {
  LoweredGraph l = lower_text(
      "graph @mlp(%x: f32[3, 4]<R>, %w1: f32[4, 4]<S(0)>, %w2: f32[4, 4]<S(1)>) -> (f32[3, 4]<R>) "
      "mesh<tp = 2> "
      "per_rank {\n"
      "  %h = linear(%x, %w1) : f32[3, 4]<S(1)>\n  %a = relu(%h) : f32[3, 4]<S(1)>\n"
      "  %p = linear(%a, %w2) : f32[3, 4]<P(sum)>\n  %y = all_reduce(%p) {axis = \"tp\"} : f32[3, "
      "4]<R>\n"
      "  return %y\n}\n");
  const artifact::Plan p = parsed(l);
  CHECK(artifact::placement_text(p.input_placements[1]) == "S(0)");
  CHECK(artifact::placement_text(p.input_placements[2]) == "S(1)");
  CHECK(collectives(l.plan).size() == 1);
  CHECK(collectives(l.plan) == std::vector<std::string>{steps(l.plan).back()});
}

TEST_CASE("collectives are never folded, and need a per-rank program") {
  // all_reduce of a constant would fold to the constant on one device; here it stays a step.
  LoweredGraph l = lower_text(
      "graph @k() -> (f32[2]) mesh<tp = 2> per_rank {\n"
      "  %c = constant() {value = dense<f32[2]>[1, 2]} : f32[2]\n"
      "  %y = all_reduce(%c) {axis = \"tp\"} : f32[2]\n  return %y\n}\n");
  CHECK(collectives(l.plan).size() == 1);
  auto g = parse_graph(
      "graph @g(%x: f32[2]) -> (f32[2]) mesh<tp = 2> {\n"
      "  %y = all_reduce(%x) {axis = \"tp\"} : f32[2]\n  return %y\n}\n");
  REQUIRE(g.ok());
  auto lowered = lower_graph(**g);
  REQUIRE_FALSE(lowered.ok());
  CHECK(has(lowered.status().message(),
            "cuda: all_reduce: collective ops run only in a per-rank program (a graph over a mesh, "
            "marked per_rank)"));
  auto i16 = parse_graph(
      "graph @g(%x: i16[2]) -> (i16[2]) mesh<tp = 2> per_rank {\n"
      "  %y = all_reduce(%x) {axis = \"tp\"} : i16[2]\n  return %y\n}\n");
  REQUIRE(i16.ok());
  auto refused = lower_graph(**i16);
  REQUIRE_FALSE(refused.ok());
  CHECK(has(refused.status().message(), "cuda: all_reduce: NCCL cannot reduce i16"));
  // A single-device plan has no mesh line and no placements.
  l = lower_text("graph @s(%x: f32[2]) -> (f32[2]) {\n  %y = neg(%x) : f32[2]\n  return %y\n}\n");
  CHECK_FALSE(has(l.plan, "\nmesh"));
  CHECK_FALSE(has(l.plan, "placement="));
}

}  // namespace kiln::cuda
