// Pipeline parallelism: a deep model's layer sequence cut into stages balanced by the cost model,
// one stage per rank, activations passed with send/recv, microbatches run GPipe-style.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/placement.h"
#include "kiln/ir/status.h"
#include "planner.h"

namespace kiln::parallel {

struct PipelineConfig {
  /// The stages' axis (e.g. pp=4), and optionally a data-parallel and a tensor-parallel axis
  /// that split each stage's work over the ranks of the stage (e.g. "pp=2, dp=2").
  DeviceMesh mesh;
  std::string stage_axis;               ///< "": the axis named pp, else the first
  std::string data_axis;                ///< "": the axis named dp, if any
  std::string tensor_axis;              ///< "": the axis named tp, if any
  bool sequence_parallel = false;       ///< with a tensor axis: norms and residual stream split along sequence_dim
  int64_t sequence_dim = 1;
  int64_t microbatches = 0;             ///< 0: as many as stages, or the most below that the batch divides into
  int64_t batch_dim = 0;
  std::vector<std::string> inputs;      ///< inputs cut into microbatches (empty: as data-parallel picks)
  std::map<std::string, int64_t> dims;  ///< sizes of symbolic dims (send/recv move static shapes)
  DeviceModel device;                   ///< the cost model that balances the stages
  bool print = false;                   ///< print the stages on stderr
};

/// How the layer sequence was cut.
struct PipelineSplit {
  int64_t stages = 1, microbatches = 1;
  int cut_points = 0;                      ///< places where at most one activation crosses
  std::vector<double> stage_seconds;       ///< predicted compute of one microbatch per stage, plus its send
  std::vector<double> stage_send_seconds;  ///< of which sending the activation on
  std::vector<double> stage_flops;         ///< of one microbatch
  int64_t activation_bytes = 0;            ///< peak of live activations of one microbatch's whole model (an upper bound per stage)
  std::vector<int64_t> stage_weight_bytes; ///< the constants each stage keeps
  std::vector<int64_t> boundary_bytes;     ///< bytes sent between stage s and s+1 per microbatch
  std::vector<int> stage_nodes;            ///< top-level nodes of the global graph each stage runs
  /// GPipe's step for `microbatches` m over s stages: (m + s - 1) slots of the slowest stage.
  double step_seconds() const;
  std::string str() const;
};

/// Rewrites global-view `g` into a pipeline-parallel per-rank program over `cfg.mesh`: one
/// pipeline_stage node per rank, each holding that rank's layers for every microbatch. Fails
/// clearly when the model has fewer cut points than the stages need, when a microbatch split
/// would mix rows of the batch, or when a symbol is unbound.
StatusOr<PipelineSplit> apply_pipeline(Graph& g, const PipelineConfig& cfg, const std::string& who = "pipeline");

}  // namespace kiln::parallel
