// Topology-independent weights: a checkpoint saved by logical tensor with its placement over the
// mesh it was saved from (each rank's piece in its own file), which loads back into whole
// tensors and reshards to any mesh, so a model saved from a tp=2 run runs on tp=4 or one GPU.
//
// On disk, a folder: `checkpoint.toml` (format, version, mesh, and per tensor its name, dtype,
// whole shape, placement and the .npy file of each rank's piece) and the .npy pieces; ranks
// holding the same piece share one file.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/placement.h"
#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln::parallel {

/// One logical tensor as the ranks of a mesh hold it.
struct CheckpointTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  ///< the whole tensor's
  Sharding placement;          ///< one per mesh axis
  std::vector<Tensor> pieces;  ///< one per rank, rank order
};

struct Checkpoint {
  DeviceMesh mesh;
  std::vector<CheckpointTensor> tensors;
};

/// The weights (named constants) of per-rank program `g`, each with the placement its rank
/// pieces take there (the layout `local_shard` gives it; replicated when used whole).
StatusOr<Checkpoint> checkpoint_from_program(const Graph& g);

/// Writes `c` into folder `dir` (created; existing checkpoint files are replaced).
Status write_checkpoint(const std::string& dir, const Checkpoint& c);
/// Reads a checkpoint folder, checking every piece against its tensor's dtype, shape and placement.
StatusOr<Checkpoint> read_checkpoint(const std::string& dir);

/// Every tensor put back together whole (shards joined, replicas checked to agree).
StatusOr<std::map<std::string, Tensor>> logical_tensors(const Checkpoint& c);

/// `c` laid out over `mesh`: each tensor keeps its placement on the axes `mesh` shares with
/// `c.mesh` (by name) and is replicated on the others; a split that does not divide fails.
StatusOr<Checkpoint> reshard(const Checkpoint& c, const DeviceMesh& mesh);

/// Replaces the value of every named constant of global-view `g` that `weights` holds; dtype
/// and shape must match. Fails when a tensor of `weights` names no constant of `g` (a checkpoint
/// for another model), and reports in `missing` the constants it did not cover.
Status load_weights(Graph& g, const std::map<std::string, Tensor>& weights, std::vector<std::string>* missing = nullptr);

}  // namespace kiln::parallel
