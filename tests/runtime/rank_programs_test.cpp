// Artifacts of per-rank programs (a pipeline's stages): one file, one program per distinct rank
// program, each rank picking its own by its rank number; checked without a GPU.
#include <doctest/doctest.h>

#include <memory>

#include "artifact_builder.h"
#include "kiln/artifact_reader.h"
#include "model.h"

using namespace kiln::artifact;
using kiln::test::build_artifact;
using kiln::test::make_artifact;
using kiln::test::TestSection;

namespace {

std::string stage_plan(const std::string& mesh, const std::string& step, const std::string& placement = "P(sum)") {
  return "kiln-plan 1\narena bytes=256\nworkspace bytes=0\nmesh " + mesh +
         "\nbuffer 0 kind=input dtype=f32 shape=4 bytes=16 offset=0 name=x\n"
         "buffer 1 kind=output dtype=f32 shape=4 bytes=16 offset=64 name=y\n"
         "input x buffer=0\noutput y buffer=1 placement=" + placement + "\n" +
         step + "\n";
}

const std::string kSend = stage_plan("pp=2", "step collective op=send peer=1 x=b0 count=4 dtype=f32 tag=0");
const std::string kRecv = stage_plan("pp=2", "step collective op=recv peer=0 y=b1 count=4 dtype=f32 tag=0");

std::string container(const std::string& rank_programs, const std::vector<std::string>& programs,
                      bool with_plan = false) {
  std::vector<TestSection> s = {
      {kSectionMeta, "meta", "kiln_version=0.1.0\nformat_version=1\ncreated_by=kiln compile\n" + rank_programs}};
  if (with_plan) s.push_back({kSectionPlan, "plan", kSend});
  for (size_t k = 0; k < programs.size(); ++k)
    s.push_back({kSectionProgram, "program." + std::to_string(k), programs[k]});
  return build_artifact(s);
}

std::string read_error(const std::string& bytes) {
  std::string error;
  CHECK(read_artifact(bytes, "pp.kiln", &error) == nullptr);
  return error;
}

}  // namespace

TEST_CASE("an artifact of per-rank programs gives each rank its own program") {
  const std::string send = make_artifact(kSend, {}, ""), recv = make_artifact(kRecv, {}, "");
  std::string error;
  auto a = read_artifact(container("rank_programs=0,1\n", {send, recv}), "pp.kiln", &error);
  REQUIRE_MESSAGE(a, error);
  CHECK(a->programs.size() == 2);
  CHECK(a->rank_programs == std::vector<int>{0, 1});
  CHECK(a->plan.steps.empty());
  for (int rank : {0, 1}) {
    auto p = rank_program(*a, rank, "pp.kiln", &error);
    REQUIRE_MESSAGE(p, error);
    REQUIRE(p->plan.steps.size() == 1);
    CHECK(p->plan.steps[0].attrs.at("op") == (rank == 0 ? "send" : "recv"));
  }
  CHECK(rank_program(*a, 2, "pp.kiln", &error) == nullptr);
  CHECK(error == "pp.kiln: rank 2 is not one of its 2 ranks");

  const std::string text = describe(*a, false);
  CHECK_MESSAGE(text.find("per-rank programs: 2 for 2 ranks") != std::string::npos, text);
  CHECK_MESSAGE(text.find("program.1 (rank 1):\n") != std::string::npos, text);
  CHECK_MESSAGE(text.find("  mesh: pp:2") != std::string::npos, text);
  const std::string json = describe(*a, true);
  CHECK_MESSAGE(json.find("\"rank_programs\": [0, 1], \"programs\": [{") != std::string::npos, json);

  // The ranks select: rank 1 of a world of 2 gets the receiving stage; a world of another size
  // is refused, naming both counts.
  auto mine = read_artifact(container("rank_programs=0,1\n", {send, recv}), "pp.kiln", &error);
  REQUIRE(select_rank_program(mine, 1, 2, "torchrun", "pp.kiln", &error));
  CHECK(mine->rank_programs.empty());
  CHECK(mine->plan.steps[0].attrs.at("op") == "recv");
  REQUIRE(select_rank_program(mine, 1, 2, "torchrun", "pp.kiln", &error));  // a plain artifact: kept
  auto wrong = read_artifact(container("rank_programs=0,1\n", {send, recv}), "pp.kiln", &error);
  CHECK_FALSE(select_rank_program(wrong, 0, 3, "torchrun", "pp.kiln", &error));
  CHECK(error ==
        "pp.kiln holds the programs of 2 ranks (each rank runs its own), but torchrun started 3 ranks: "
        "start exactly 2 processes (e.g. kiln launch -n 2 -- ...)");
}

TEST_CASE("ranks running the same program share one copy of it") {
  const std::string send = make_artifact(stage_plan("pp=2 dp=2", "step collective op=send peer=2 x=b0 count=4 dtype=f32", "P(sum),S(0)"), {}, "");
  const std::string recv = make_artifact(stage_plan("pp=2 dp=2", "step collective op=recv peer=0 y=b1 count=4 dtype=f32", "P(sum),S(0)"), {}, "");
  std::string error;
  auto a = read_artifact(container("rank_programs=0,0,1,1\n", {send, recv}), "pp.kiln", &error);
  REQUIRE_MESSAGE(a, error);
  auto p = rank_program(*a, 3, "pp.kiln", &error);
  REQUIRE_MESSAGE(p, error);
  CHECK(p->plan.steps[0].attrs.at("op") == "recv");
  CHECK(describe(*a, false).find("program.0 (ranks 0, 1):") != std::string::npos);
}

TEST_CASE("an artifact of per-rank programs is refused when inconsistent") {
  const std::string send = make_artifact(kSend, {}, ""), recv = make_artifact(kRecv, {}, "");
  CHECK(read_error(container("", {send, recv})) == "pp.kiln: holds per-rank programs but no meta 'rank_programs'");
  CHECK(read_error(container("rank_programs=0,2\n", {send, recv})) ==
        "pp.kiln: meta rank_programs '0,2': '2' is not a program (0..1)");
  CHECK(read_error(container("rank_programs=0,0\n", {send, recv})) == "pp.kiln: program.1 is no rank's program");
  CHECK(read_error(container("rank_programs=0,1\n", {send, recv}, true)) == "pp.kiln: holds both a plan and per-rank programs");
  // Three ranks listed, but the programs were built for a mesh of two.
  std::string error;
  auto a = read_artifact(container("rank_programs=0,1,1\n", {send, recv}), "pp.kiln", &error);
  REQUIRE_MESSAGE(a, error);
  CHECK(rank_program(*a, 2, "pp.kiln", &error) == nullptr);
  CHECK(error ==
        "pp.kiln (program.1, rank 2's): its plan runs on a mesh of 2 ranks (pp:2), but the artifact lists programs for 3");
  // A damaged program is named as such when a rank reads it.
  auto bad = read_artifact(container("rank_programs=0,1\n", {send, "not an artifact"}), "pp.kiln", &error);
  REQUIRE_MESSAGE(bad, error);
  CHECK(rank_program(*bad, 1, "pp.kiln", &error) == nullptr);
  CHECK(error == "pp.kiln (program.1, rank 1's): not a Kiln artifact (bad magic)");
}

TEST_CASE("a distributed load picks the rank's program before touching a device") {
  const std::string send = make_artifact(kSend, {}, ""), recv = make_artifact(kRecv, {}, "");
  kiln_runtime runtime;  // its device is never touched before the checks below
  kiln_distributed_options o;
  kiln_distributed_options_initialize(&o);
  o.from_environment = 0;
  o.rank = 1;
  o.world_size = 3;
  o.master_addr = "127.0.0.1";
  o.master_port = 29500;
  std::string error;
  auto a = read_artifact(container("rank_programs=0,1\n", {send, recv}), "pp.kiln", &error);
  REQUIRE_MESSAGE(a, error);
  kiln::rt::DistributedSetup setup;
  kiln_status* st = kiln::rt::distributed_setup(&runtime, a, "pp.kiln", o, &setup);
  REQUIRE(st != nullptr);
  CHECK(std::string(st->message) ==
        "pp.kiln holds the programs of 2 ranks (each rank runs its own), but the options started 3 ranks: "
        "start exactly 2 processes (e.g. kiln launch -n 2 -- ...)");
  kiln_status_release(st);
  // The right world: the artifact becomes rank 1's program (what follows needs a device).
  o.world_size = 2;
  kiln_status_release(kiln::rt::distributed_setup(&runtime, a, "pp.kiln", o, &setup));
  CHECK(a->rank_programs.empty());
  REQUIRE(a->plan.steps.size() == 1);
  CHECK(a->plan.steps[0].attrs.at("op") == "recv");
}
