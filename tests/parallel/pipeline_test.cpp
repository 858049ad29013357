// Pipeline stages (plugins/parallel/pipeline.h): a deep residual MLP cut into 2, 4 and 8 stages
// with and without microbatches gives the unsharded outputs; the cut balances the cost model's
// time per stage and splits the weights; bad requests fail with a clear error.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "kiln/core/driver.h"
#include "kiln/ir/text.h"
#include "mesh_helpers.h"
#include "pipeline.h"

using namespace kiln;
using namespace kiln::parallel;

namespace {

std::string dense(const std::vector<int64_t>& shape, double seed) {
  int64_t n = 1;
  std::ostringstream dims, vals;
  for (size_t i = 0; i < shape.size(); ++i) dims << (i ? ", " : "") << shape[i], n *= shape[i];
  for (int64_t i = 0; i < n; ++i) vals << (i ? ", " : "") << 0.3 * std::sin(seed + 0.37 * static_cast<double>(i));
  return "dense<f32[" + dims.str() + "]>[" + vals.str() + "]";
}

/// x[batch, 8] through `widths.size()` residual blocks x + W2 relu(W1 x) (W1 [width, 8]), weights
/// as constants.
std::string deep_mlp(const std::vector<int64_t>& widths, const std::string& batch = "8") {
  std::ostringstream t;
  t << "graph @deep(%x: f32[" << batch << ", 8]) -> (f32[" << batch << ", 8]) {\n";
  std::string prev = "%x";
  for (size_t i = 0; i < widths.size(); ++i) {
    const std::string w = std::to_string(widths[i]), k = std::to_string(i);
    t << "  %a" << k << " = constant() {value = " << dense({widths[i], 8}, static_cast<double>(i)) << "} : f32[" << w << ", 8]\n"
      << "  %b" << k << " = constant() {value = " << dense({8, widths[i]}, 0.5 + static_cast<double>(i)) << "} : f32[8, " << w << "]\n"
      << "  %u" << k << " = linear(" << prev << ", %a" << k << ") : f32[" << batch << ", " << w << "]\n"
      << "  %r" << k << " = relu(%u" << k << ") : f32[" << batch << ", " << w << "]\n"
      << "  %d" << k << " = linear(%r" << k << ", %b" << k << ") : f32[" << batch << ", 8]\n"
      << "  %h" << k << " = add(" << prev << ", %d" << k << ") : f32[" << batch << ", 8]\n";
    prev = "%h" + k;
  }
  t << "  return " << prev << "\n}\n";
  return t.str();
}

std::unique_ptr<Graph> parse(const std::string& text) {
  auto g = parse_graph(text, "deep.kir");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(*g);
}

PipelineConfig config(int64_t stages, int64_t micro = 0) {
  PipelineConfig cfg;
  cfg.mesh = DeviceMesh{{{"pp", stages}}};
  cfg.microbatches = micro;
  cfg.device = *device_preset("h200");
  return cfg;
}

Tensor input(int64_t rows = 8) {
  Tensor x(DType::kF32, {rows, 8});
  for (int64_t i = 0; i < x.numel(); ++i) x.set_f64(i, std::cos(0.11 * static_cast<double>(i)));
  return x;
}

Tensor run_whole(const Graph& g) { return testing::run_whole(g, {input()}); }

Tensor run_stages(const Graph& g) { return testing::run_sharded(g, {input()}); }

double max_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.type() == b.type());
  double d = 0;
  for (int64_t i = 0; i < a.numel(); ++i) d = std::max(d, std::abs(a.get_f64(i) - b.get_f64(i)));
  return d;
}

int count_op(const Graph& g, const std::string& op) {
  int n = 0;
  for (const auto& node : g.nodes()) {
    n += node->op_name() == op;
    for (int k = 0; k < node->num_regions(); ++k)
      for (const auto& m : node->region(k).nodes()) n += m->op_name() == op;
  }
  return n;
}

}  // namespace

TEST_CASE("pipeline: 2, 4 and 8 stages, with 1 to 8 microbatches, give the unsharded outputs") {
  const auto global = parse(deep_mlp(std::vector<int64_t>(10, 16)));
  const Tensor want = run_whole(*global);
  for (int64_t stages : {2, 4, 8})
    for (int64_t micro : {1, 2, 8}) {
      CAPTURE(stages);
      CAPTURE(micro);
      auto g = global->clone();
      auto split = apply_pipeline(*g, config(stages, micro));
      REQUIRE_MESSAGE(split.ok(), split.status().message());
      CHECK(split->stages == stages);
      CHECK(split->microbatches == micro);
      CHECK(g->is_per_rank());
      CHECK(count_op(*g, "pipeline_stage") == stages);
      // One activation per boundary and microbatch, each sent once and received once.
      CHECK(count_op(*g, "send") == (stages - 1) * micro);
      CHECK(count_op(*g, "recv") == (stages - 1) * micro);
      CHECK(max_diff(run_stages(*g), want) == 0);
    }
}

TEST_CASE("pipeline: default microbatches are as many as stages when the batch divides") {
  auto g = parse(deep_mlp(std::vector<int64_t>(6, 16), "6"));
  auto split = apply_pipeline(*g, config(4));
  REQUIRE_MESSAGE(split.ok(), split.status().message());
  CHECK(split->microbatches == 3);  // 6 rows: 4 does not divide, 3 does
}

TEST_CASE("pipeline: stages balance the cost model and split the weights") {
  // Four wide blocks then twelve narrow ones: equal node counts would load the first stage most.
  std::vector<int64_t> widths(4, 1024);
  widths.resize(16, 64);
  const auto global = parse(deep_mlp(widths, "4096"));
  auto g = global->clone();
  auto split = apply_pipeline(*g, config(4, 1));
  REQUIRE_MESSAGE(split.ok(), split.status().message());
  const auto [lo, hi] = std::minmax_element(split->stage_seconds.begin(), split->stage_seconds.end());
  CHECK(*hi < 2.0 * *lo);
  CHECK(split->stage_nodes[0] < split->stage_nodes[3]);  // the wide blocks share fewer nodes
  // Every weight is on exactly one stage; no stage holds them all.
  const int64_t total = std::accumulate(widths.begin(), widths.end(), int64_t{0}) * 8 * 2 * 4;
  CHECK(std::accumulate(split->stage_weight_bytes.begin(), split->stage_weight_bytes.end(), int64_t{0}) == total);
  CHECK(*std::max_element(split->stage_weight_bytes.begin(), split->stage_weight_bytes.end()) < total / 2);
  CHECK(split->boundary_bytes == std::vector<int64_t>(3, 4096 * 8 * 4));
  CHECK(split->step_seconds() == doctest::Approx(*hi * 4));
}

TEST_CASE("pipeline: clear errors") {
  auto shallow = parse(deep_mlp({16, 16}));
  auto too_many = apply_pipeline(*shallow->clone(), config(8));
  REQUIRE_FALSE(too_many.ok());
  CHECK(too_many.status().message().find("places to cut between layers") != std::string::npos);
  CHECK(too_many.status().message().find("8 stages need 7") != std::string::npos);

  auto g = parse(deep_mlp(std::vector<int64_t>(4, 16)));
  auto s = apply_pipeline(*g->clone(), config(2, 3));
  REQUIRE_FALSE(s.ok());
  CHECK(s.status().message().find("cannot cut the batch into 3 microbatches") != std::string::npos);

  auto symbolic = parse(deep_mlp(std::vector<int64_t>(4, 16), "B"));
  s = apply_pipeline(*symbolic->clone(), config(2));
  REQUIRE_FALSE(s.ok());
  CHECK(s.status().message().find("give the size of symbol 'B'") != std::string::npos);
  PipelineConfig bound = config(2);
  bound.dims = {{"B", 8}};
  s = apply_pipeline(*symbolic->clone(), bound);
  CHECK_MESSAGE(s.ok(), s.status().message());

  // A softmax over the batch mixes its rows: microbatches would change it.
  auto mixing = parse("graph @m(%x: f32[8, 8], %w: f32[8, 8]) -> (f32[8, 8]) {\n"
                      "  %a = linear(%x, %w) : f32[8, 8]\n"
                      "  %b = softmax(%a) {axis = 0} : f32[8, 8]\n"
                      "  %c = linear(%b, %w) : f32[8, 8]\n"
                      "  return %c\n}\n");
  s = apply_pipeline(*mixing->clone(), config(2, 2));
  REQUIRE_FALSE(s.ok());
  CHECK(s.status().message().find("mixes the rows of its batch") != std::string::npos);
  s = apply_pipeline(*mixing->clone(), config(2, 1));
  CHECK_MESSAGE(s.ok(), s.status().message());
}

namespace {

PipelineConfig mesh_config(std::vector<DeviceMesh::Axis> axes, int64_t micro = 0) {
  PipelineConfig cfg = config(1, micro);
  cfg.mesh = DeviceMesh{std::move(axes)};
  return cfg;
}

/// Output 0 of pipeline `g` with every rank running its own program (program_of_rank), as the
/// ranks of a CUDA run do.
Tensor run_rank_programs(const Graph& g) {
  const std::vector<Tensor> whole = {input()};
  auto pieces = split_inputs_by_rank(g, whole);
  REQUIRE_MESSAGE(pieces.ok(), pieces.status().message());
  std::vector<std::unique_ptr<Graph>> owned;
  std::vector<const Graph*> programs;
  for (int64_t r = 0; r < g.mesh().num_ranks(); ++r) {
    auto p = program_of_rank(g, r);
    REQUIRE_MESSAGE(p.ok(), p.status().message());
    programs.push_back(p->get());
    owned.push_back(std::move(*p));
  }
  auto by_rank = run_mesh(g.mesh(), programs, *pieces);
  REQUIRE_MESSAGE(by_rank.ok(), by_rank.status().message());
  auto outs = assemble_outputs(g, *by_rank);
  REQUIRE_MESSAGE(outs.ok(), outs.status().message());
  return (*outs)[0];
}

}  // namespace

TEST_CASE("pipeline: stages split further by data and tensor parallelism on a 2-D or 3-D mesh") {
  const auto global = parse(deep_mlp(std::vector<int64_t>(6, 16)));
  const Tensor want = run_whole(*global);
  struct Case {
    std::vector<DeviceMesh::Axis> axes;
    bool exact;  // a data split keeps every sum's order; a tensor split adds partial sums
  };
  for (const Case& c : {Case{{{"pp", 2}, {"dp", 2}}, true}, Case{{{"pp", 2}, {"tp", 2}}, false},
                        Case{{{"dp", 2}, {"pp", 2}}, true}, Case{{{"pp", 2}, {"dp", 2}, {"tp", 2}}, false},
                        Case{{{"pp", 4}, {"tp", 2}}, false}})
    for (int64_t micro : {1, 2}) {
      const DeviceMesh mesh{c.axes};
      CAPTURE(mesh.str());
      CAPTURE(micro);
      auto g = global->clone();
      auto split = apply_pipeline(*g, mesh_config(c.axes, micro));
      REQUIRE_MESSAGE(split.ok(), split.status().message());
      CHECK(g->mesh() == mesh);
      const int64_t stages = mesh.axes[static_cast<size_t>(mesh.axis_index("pp"))].size;
      CHECK(count_op(*g, "pipeline_stage") == stages);
      CHECK(count_op(*g, "send") == (stages - 1) * micro);
      // The tensor axis splits the weights (local_shard), the data axis the input.
      CHECK((count_op(*g, "local_shard") > 0) == (mesh.axis_index("tp") >= 0));
      CHECK((g->input(0)->sharding()[static_cast<size_t>(std::max(mesh.axis_index("dp"), 0))].is_shard()) ==
            (mesh.axis_index("dp") >= 0));
      const Tensor got = run_stages(*g);
      CHECK(max_diff(got, want) <= (c.exact ? 0.0 : 1e-5));
      CHECK(max_diff(run_rank_programs(*g), got) == 0);
      // The ranks of one stage run the same program; the stages differ.
      const std::string first = print_graph(**program_of_rank(*g, 0));
      const int64_t last_rank = g->mesh().num_ranks() - 1;
      CHECK(print_graph(**program_of_rank(*g, last_rank)) != first);
      for (int64_t r = 0; r < g->mesh().num_ranks(); ++r)
        if (g->mesh().coords(r)[static_cast<size_t>(mesh.axis_index("pp"))] == 0)
          CHECK(print_graph(**program_of_rank(*g, r)) == first);
    }
}

TEST_CASE("pipeline: a 2-D mesh's clear errors") {
  auto g = parse(deep_mlp(std::vector<int64_t>(4, 16)));
  auto message = [&](PipelineConfig cfg) {
    auto s = apply_pipeline(*g->clone(), cfg);
    REQUIRE_FALSE(s.ok());
    return s.status().message();
  };
  CHECK(message(mesh_config({{"pp", 2}, {"xp", 2}})) ==
        "pipeline: axis 'xp' of mesh <pp = 2, xp = 2> has no role: the stages run along 'pp'; another axis splits each "
        "stage's batch (data-axis, by default the axis named dp) or its weights (tensor-axis, by default tp)");
  PipelineConfig named = mesh_config({{"pp", 2}, {"dp", 2}});
  named.data_axis = "pp";
  CHECK(message(named) ==
        "pipeline: axis 'pp' of mesh <pp = 2, dp = 2> carries the stages; it cannot also split each stage's batch "
        "(data-axis)");
  named = mesh_config({{"pp", 2}, {"dp", 2}});
  named.stage_axis = "stages";
  CHECK(message(named) == "pipeline: stage-axis 'stages' is not an axis of mesh <pp = 2, dp = 2>");
  named = mesh_config({{"pp", 2}, {"dp", 2}});
  named.tensor_axis = "dp";
  CHECK(message(named) == "pipeline: data-axis and tensor-axis are both 'dp'");
  CHECK(message(mesh_config({{"pp", 2}, {"mb", 2}})).find("mesh axis name 'mb' is taken by the microbatches") !=
        std::string::npos);
  named = mesh_config({{"pp", 2}, {"dp", 2}});
  named.sequence_parallel = true;
  CHECK(message(named) ==
        "pipeline: sequence-parallel splits a tensor-parallel stage's residual stream; the mesh <pp = 2, dp = 2> has no "
        "tensor axis (tp)");
  // 8 rows over 4 data-parallel ranks and 4 microbatches: 2 rows a rank do not cut into 4.
  const std::string m = message(mesh_config({{"pp", 2}, {"dp", 4}}, 4));
  CHECK_MESSAGE(m.find("cannot cut the batch into 4 microbatches") != std::string::npos, m);
  CHECK_MESSAGE(m.find("does not split evenly over 16 ranks") != std::string::npos, m);
  // A tensor axis that does not divide the layers' widths keeps them whole: still correct.
  auto odd = parse(deep_mlp(std::vector<int64_t>(4, 6)));
  auto s = apply_pipeline(*odd, mesh_config({{"pp", 2}, {"tp", 4}}));
  CHECK_MESSAGE(s.ok(), s.status().message());
}
