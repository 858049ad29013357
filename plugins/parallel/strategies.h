// The parallel strategies' policies as functions on a graph, shared by the strategy plugins and
// the planner (which applies each candidate strategy to a copy of the graph to cost it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/placement.h"
#include "kiln/ir/status.h"

namespace kiln::parallel {

/// Every rank holds the whole model and a slice of the batch.
struct DataParallelConfig {
  DeviceMesh mesh;
  std::string axis;        ///< the mesh axis the batch is split over ("": the first)
  int64_t batch_dim = 0;
  std::vector<std::string> inputs;  ///< inputs to split (empty: see shard_batch_inputs)
  /// ZeRO-1 for a training step (autodiff's '<weight>.grad' outputs): gradients leave
  /// reduce-scattered, each rank's block along the first dim the ranks divide, so the optimizer
  /// keeps state for that block and all-gathers the updated weight.
  bool shard_optimizer_state = false;
  /// Gradients all-reduced together in buckets of up to this many bytes (0: one all-reduce each).
  int64_t bucket_bytes = 0;
  /// The batch is also split over these axes, each block nested inside the previous axis'
  /// (a pipeline's microbatches: each rank's rows cut again).
  std::vector<std::string> extra_batch_axes;
};

/// Megatron-style tensor parallelism, optionally with a data-parallel axis and sequence
/// parallelism.
struct TensorParallelConfig {
  DeviceMesh mesh;
  std::string axis;       ///< the mesh axis weights are split over ("": the last)
  std::string data_axis;  ///< also split the batch over this axis ("": no data parallelism)
  bool sequence_parallel = false;
  bool vocab_parallel = true;  ///< split embedding tables by vocabulary rows (Megatron)
  int64_t sequence_dim = 1, batch_dim = 0;
  int64_t min_size = 0;   ///< smallest weight (elements) worth splitting
  bool replicate_outputs = false;
  std::vector<std::string> inputs;
  std::vector<std::string> extra_batch_axes;  ///< as DataParallelConfig's (after data_axis)
};

/// Rewrites global-view `g` into the per-rank program of each strategy.
Status apply_data_parallel(Graph& g, const DataParallelConfig& cfg, const std::string& who = "data-parallel");
Status apply_tensor_parallel(Graph& g, const TensorParallelConfig& cfg, const std::string& who = "tensor-parallel");

}  // namespace kiln::parallel
