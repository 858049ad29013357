// Per-rank plans without a GPU: the mesh line, placements, rank-dependent buffers and
// collective steps in the plan parser; the weights a rank keeps; where a rank's piece lies.
#include <doctest/doctest.h>

#include "artifact_builder.h"
#include "kiln/artifact_reader.h"
#include "rank_layout.h"

using namespace kiln::artifact;
using kiln::test::build_artifact;
using kiln::test::TestSection;

namespace {

const std::string kHead = "kiln-plan 1\narena bytes=4096\nworkspace bytes=0\n";
const std::string kMesh = "mesh dp=2 tp=2\n";
const std::string kBufs =
    "buffer 0 kind=input dtype=f32 shape=4x8 bytes=128 offset=0 name=x\n"
    "buffer 1 kind=activation dtype=f32 shape=4x8 bytes=128 offset=256\n"
    "buffer 2 kind=output dtype=f32 shape=8x8 bytes=256 offset=512 name=y\n"
    "buffer 3 kind=weight dtype=f32 shape=8 bytes=32 offset=0 rank_axis=tp rank_stride=256 name=w\n"
    "buffer 4 kind=alias dtype=f32 shape=2x8 bytes=64 offset=0 base=0 rank_axis=tp rank_stride=64\n"
    "buffer 5 kind=activation dtype=i16 shape=64 bytes=128 offset=1024\n";

/// Every collective op, with what each needs.
const std::string kPlan =
    kHead + kMesh + kBufs +
    "input x buffer=0 placement=S(0),R\n"
    "output y buffer=2 placement=R,S(0)\n"
    "step collective op=all_reduce axis=tp x=b0 y=b1 count=32 dtype=f32 reduce=sum\n"
    "step collective op=all_gather axis=tp x=b0 y=b2 count=32 dtype=f32\n"
    "step collective op=reduce_scatter axis=dp x=b2 y=b1 count=32 dtype=f32 reduce=max\n"
    "step collective op=all_to_all axis=tp x=b5 y=b5 count=32 dtype=i16\n"
    "step collective op=broadcast axis=dp x=b0 y=b1 count=32 dtype=f32 root=1\n"
    "step collective op=send peer=3 x=b0 count=32 dtype=f32 tag=7\n"
    "step collective op=recv peer=0 y=b1 count=32 dtype=f32\n"
    "step collective op=send peer=1 x=b0 count=32 dtype=f32 tag=3 axis=dp\n";

std::string plan_error(const std::string& text) {
  Plan p;
  std::string error;
  CHECK(!parse_plan(text, &p, &error));
  return error;
}

std::string read_error(const std::string& plan, const std::string& weights) {
  std::string error;
  const std::string bytes = build_artifact({{kSectionMeta, "meta", "kiln_version=0.1.0\n"},
                                            {kSectionPlan, "plan", plan},
                                            {kSectionWeights, "weights", weights}});
  CHECK(read_artifact(bytes, "m.kiln", &error) == nullptr);
  return error;
}

}  // namespace

TEST_CASE(
    "parse_plan reads a per-rank plan: mesh, placements, rank-dependent buffers, collectives") {
  Plan p;
  std::string error;
  REQUIRE_MESSAGE(parse_plan(kPlan, &p, &error), error);
  CHECK(mesh_text(p) == "dp:2,tp:2");
  CHECK(mesh_ranks(p) == 4);
  CHECK(placement_text(p.input_placements[0]) == "S(0),R");
  CHECK(placement_text(p.output_placements[0]) == "R,S(0)");
  CHECK(p.buffers[3].rank_axis == "tp");
  CHECK(p.buffers[3].rank_stride == 256);
  CHECK(p.buffers[4].rank_stride == 64);
  REQUIRE(p.steps.size() == 8);
  for (const PlanStep& s : p.steps) CHECK(s.kind == PlanStep::Kind::kCollective);
  CHECK(p.steps[0].attrs.at("op") == "all_reduce");
  CHECK(p.steps[3].attrs.at("dtype") == "i16");  // moving bytes needs no NCCL type
  CHECK(p.steps[5].attrs.at("tag") == "7");
  CHECK(p.steps[7].attrs.at("axis") == "dp");  // peer 1 along dp: this rank's tp coordinate kept
  // A single-device plan has no mesh and unannotated inputs.
  Plan single;
  REQUIRE(parse_plan(
      kHead + "buffer 0 kind=input dtype=f32 shape=2 bytes=8 offset=0\ninput x buffer=0\n", &single,
      &error));
  CHECK(single.mesh.empty());
  CHECK(mesh_ranks(single) == 1);
  REQUIRE(single.input_placements.size() == 1);
  CHECK(single.input_placements[0].empty());
}

TEST_CASE("parse_plan refuses malformed per-rank lines and collective steps, naming the problem") {
  const std::string head = kHead + kMesh + kBufs;
  const std::string step =
      "step collective op=all_reduce axis=tp x=b0 y=b1 count=32 dtype=f32 reduce=sum\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {kHead + "mesh tp=2 tp=2\n", "plan:4: mesh: axis 'tp' is named twice"},
      {kHead + "mesh tp=0\n",
       "plan:4: mesh: expected AXIS=SIZE with an identifier and a size >= 1, got 'tp=0'"},
      {kHead + "mesh 2tp=2\n",
       "plan:4: mesh: expected AXIS=SIZE with an identifier and a size >= 1, got '2tp=2'"},
      {kHead + kBufs.substr(0, kBufs.find('\n') + 1) + kMesh,
       "plan:5: 'mesh' out of order (lines go: kiln-plan, arena, workspace, [mesh], buffer, input, "
       "output, [variable], kernel, step)"},
      {kHead + kBufs.substr(0, kBufs.find('\n') + 1) + step,
       "plan:5: collective all_reduce: a collective step needs a 'mesh' line"},
      {head + "step collective op=all_sum axis=tp x=b0 y=b1 count=32 dtype=f32\n",
       "plan:11: collective: unknown op 'all_sum' (all_reduce, all_gather, reduce_scatter, "
       "all_to_all, broadcast, send or recv)"},
      {head + "step collective op=all_reduce axis=pp x=b0 y=b1 count=32 dtype=f32 reduce=sum\n",
       "plan:11: collective all_reduce: the plan's mesh dp:2,tp:2 has no axis 'pp'"},
      {head + "step collective op=all_reduce axis=tp x=b0 y=b1 count=32 dtype=f32\n",
       "plan:11: collective all_reduce needs reduce="},
      {head +
           "step collective op=all_reduce axis=tp x=b0 y=b1 count=32 dtype=f32 reduce=sum root=0\n",
       "plan:11: collective all_reduce: attribute 'root' does not apply"},
      {head + "step collective op=all_reduce axis=tp x=b5 y=b5 count=64 dtype=i16 reduce=sum\n",
       "plan:11: collective all_reduce: NCCL cannot reduce i16 (f64, f32, f16, bf16, f8e4m3fn, "
       "f8e5m2, i64, i32, i8 or u8)"},
      {head + "step collective op=all_reduce axis=tp x=b0 y=b1 count=32 dtype=f32 reduce=min\n",
       "plan:11: collective all_reduce: reduce='min' is not sum or max"},
      {head + "step collective op=all_gather axis=tp x=b0 y=b1 count=32 dtype=f32\n",
       "plan:11: collective all_gather: y (buffer 1, 128 bytes) cannot hold 2 x 32 f32"},
      {head + "step collective op=reduce_scatter axis=tp x=b0 y=b1 count=32 dtype=f32 reduce=sum\n",
       "plan:11: collective reduce_scatter: x (buffer 0, 128 bytes) cannot hold 2 x 32 f32"},
      {head + "step collective op=broadcast axis=tp x=b0 y=b1 count=32 dtype=f32 root=2\n",
       "plan:11: collective broadcast: root 2 is outside a group of 2"},
      {head + "step collective op=send peer=4 x=b0 count=32 dtype=f32\n",
       "plan:11: collective send: peer 4 is not a rank of mesh dp:2,tp:2"},
      {head + "step collective op=recv peer=0 x=b1 count=32 dtype=f32\n",
       "plan:11: collective recv needs y="},
      // Along an axis (a pipeline whose stages are split over the other axes), peer is a position.
      {head + "step collective op=send peer=2 x=b0 count=32 dtype=f32 axis=dp\n",
       "plan:11: collective send: peer 2 is not a position along mesh axis 'dp' of 2"},
      {head + "step collective op=recv peer=1 y=b1 count=32 dtype=f32 axis=pp\n",
       "plan:11: collective recv: the plan's mesh dp:2,tp:2 has no axis 'pp'"},
      {head + "step collective op=all_gather axis=tp x=b0 y=b2 count=3 dtype=i4\n",
       "plan:11: collective all_gather: count 3 of i4 is not a whole number of bytes"},
      {head + "input x buffer=0 placement=S(0)\n",
       "plan:11: input 'x': placement 'S(0)' has 1 entries for a mesh of 2 axes"},
      {head + "input x buffer=0 placement=S(2),R\n",
       "plan:11: input 'x': placement S(2) names a dim outside rank 2"},
      {head + "input x buffer=0 placement=Q,R\n",
       "plan:11: input 'x': expected placement R, S(dim) or P(sum|max), got 'Q'"},
      {kHead +
           "buffer 0 kind=input dtype=f32 shape=2 bytes=8 offset=0\ninput x buffer=0 placement=R\n",
       "plan:5: input 'x': placement= needs a 'mesh' line"},
      {kHead + kMesh +
           "buffer 0 kind=activation dtype=f32 shape=2 bytes=8 offset=0 rank_axis=tp "
           "rank_stride=8\n",
       "plan:5: buffer 0: rank_axis= is only for kind=weight or kind=alias"},
      {kHead + kMesh +
           "buffer 0 kind=weight dtype=f32 shape=2 bytes=8 offset=0 rank_axis=pp rank_stride=256\n",
       "plan:5: buffer 0: rank_axis 'pp' is not an axis of the plan's mesh (dp:2,tp:2)"},
      {kHead + kMesh + "buffer 0 kind=weight dtype=f32 shape=2 bytes=8 offset=0 rank_axis=tp\n",
       "plan:5: buffer 0: rank_axis= and rank_stride= go together"},
      {kHead + kMesh +
           "buffer 0 kind=input dtype=f32 shape=8 bytes=32 offset=0\n"
           "buffer 1 kind=alias dtype=f32 shape=4 bytes=16 offset=8 base=0 rank_axis=tp "
           "rank_stride=16\n",
       "plan:6: buffer 1: the last rank's bytes [24, +16) lie outside its base buffer 0 of 32 "
       "bytes"},
  };
  for (const auto& [text, want] : cases) {
    INFO(text);
    CHECK(plan_error(text) == want);
  }
}

TEST_CASE("read_artifact checks a rank-dependent weight's blocks against the weights section") {
  const std::string head = kHead + "mesh tp=2\n";
  const std::string ok =
      head +
      "buffer 0 kind=weight dtype=f32 shape=8 bytes=32 offset=0 rank_axis=tp rank_stride=256\n";
  std::string error;
  const std::string good = build_artifact({{kSectionMeta, "meta", "kiln_version=0.1.0\n"},
                                           {kSectionPlan, "plan", ok},
                                           {kSectionWeights, "weights", std::string(288, 'w')}});
  auto a = read_artifact(good, "m.kiln", &error);
  REQUIRE_MESSAGE(a, error);
  CHECK(describe(*a, false).find("mesh: tp:2 (2 ranks") != std::string::npos);
  CHECK(describe(*a, true).find("\"mesh\": \"tp:2\"") != std::string::npos);
  CHECK(read_error(ok, std::string(287, 'w')) ==
        "m.kiln: plan: buffer 0: the last rank's bytes [256, +32) lie outside the weights section "
        "of 287 bytes");
  CHECK(read_error(head + "buffer 0 kind=weight dtype=f32 shape=8 bytes=32 offset=0 rank_axis=tp "
                          "rank_stride=32\n",
                   std::string(512, 'w')) ==
        "m.kiln: plan: buffer 0: rank_stride 32 is not a multiple of 256 holding its 32 bytes");
}

TEST_CASE("a rank keeps only its own block of a rank-dependent weight, and offsets follow") {
  // w0: 100 plain bytes at 0; w1: 200 bytes per tp rank at 256 and 512; w2: 10 plain bytes at 768.
  Plan p;
  std::string error;
  REQUIRE(parse_plan(kHead + "mesh tp=2\n"
                             "buffer 0 kind=weight dtype=u8 shape=100 bytes=100 offset=0\n"
                             "buffer 1 kind=weight dtype=u8 shape=200 bytes=200 offset=256 "
                             "rank_axis=tp rank_stride=256\n"
                             "buffer 2 kind=weight dtype=u8 shape=10 bytes=10 offset=768\n",
                     &p, &error));
  kiln::rt::WeightLayout second;
  REQUIRE(kiln::rt::WeightLayout::build(p, 778, {1}, &second, &error));
  CHECK(second.device_bytes() == 522);  // 778 less rank 0's block (rounded to 256)
  CHECK(kiln::rt::rank_offset(p.buffers[1], p.mesh, {1}) == 512);
  CHECK(second.device_offset(512) == 256);
  CHECK(second.device_offset(768) == 512);
  CHECK(second.section_offset(256) == 512);
  CHECK(second.kept() == std::vector<std::pair<uint64_t, uint64_t>>{{0, 256}, {512, 266}});
  kiln::rt::WeightLayout first;
  REQUIRE(kiln::rt::WeightLayout::build(p, 778, {0}, &first, &error));
  CHECK(first.device_bytes() == 522);
  CHECK(first.device_offset(256) == 256);
  CHECK(first.device_offset(768) == 512);
  CHECK(first.section_offset(512) == 768);
  // Without rank-dependent weights the device holds the whole section.
  Plan plain;
  REQUIRE(parse_plan(kHead + "buffer 0 kind=weight dtype=u8 shape=100 bytes=100 offset=0\n", &plain,
                     &error));
  kiln::rt::WeightLayout all;
  REQUIRE(kiln::rt::WeightLayout::build(plain, 100, {}, &all, &error));
  CHECK(all.device_bytes() == 100);
  CHECK(all.kept() == std::vector<std::pair<uint64_t, uint64_t>>{{0, 100}});
  // A weight reaching into another rank's block would be missing on the device.
  REQUIRE(parse_plan(kHead +
                         "mesh tp=2\n"
                         "buffer 0 kind=weight dtype=u8 shape=200 bytes=200 offset=0 rank_axis=tp "
                         "rank_stride=256\n"
                         "buffer 1 kind=weight dtype=u8 shape=8 bytes=8 offset=256 name=stray\n",
                     &p, &error));
  CHECK_FALSE(kiln::rt::WeightLayout::build(p, 456, {0}, &all, &error));
  CHECK(error ==
        "plan: weight buffer 1 (stray) overlaps another rank's block of a rank-dependent weight");
}

TEST_CASE("a rank's piece: coordinates are row-major, axes sharding one dim split it outer first") {
  const std::vector<MeshAxis> mesh = {{"dp", 2}, {"tp", 2}};
  CHECK(kiln::rt::mesh_coords(mesh, 2) == std::vector<int64_t>{1, 0});
  CHECK(kiln::rt::mesh_coords(mesh, 3) == std::vector<int64_t>{1, 1});
  using K = PlanPlacement::Kind;
  const PlanPlacement s0{K::kShard, 0, ""}, s1{K::kShard, 1, ""}, r{}, psum{K::kPartial, 0, "sum"};
  kiln::rt::Piece p = kiln::rt::piece_of({2, 3}, {s0, s0}, mesh, {1, 0});
  CHECK(p.global_dims == std::vector<int64_t>{8, 3});
  CHECK(p.offsets == std::vector<int64_t>{4, 0});
  CHECK_FALSE(p.partial);
  p = kiln::rt::piece_of({2, 3}, {r, s1}, mesh, {0, 1});
  CHECK(p.global_dims == std::vector<int64_t>{2, 6});
  CHECK(p.offsets == std::vector<int64_t>{0, 3});
  p = kiln::rt::piece_of({2, 3}, {psum, r}, mesh, {1, 1});
  CHECK(p.global_dims == std::vector<int64_t>{2, 3});
  CHECK(p.partial);
  p = kiln::rt::piece_of({5}, {}, mesh, {1, 1});  // not annotated: replicated
  CHECK(p.global_dims == std::vector<int64_t>{5});
  CHECK(p.offsets == std::vector<int64_t>{0});
}
