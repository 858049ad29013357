// Sharding propagation and SPMD partitioning, shared by the parallel strategy plugins: from a
// global-view graph whose values carry a few placements, build the program every rank runs.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/placement.h"
#include "kiln/ir/status.h"

namespace kiln::parallel {

/// A contraction with a constant (or otherwise unannotated) weight, or an embedding lookup
/// (gather along dim 0 of a rank-2 table), as the partitioner reaches it: the strategy may pick
/// the weight's layout on each mesh axis.
struct WeightChoice {
  const Node& node;            ///< linear/matmul in the global graph
  int weight_operand;          ///< 1 for linear's w and matmul's b, 0 for gather's table
  const Sharding& activation;  ///< the layout the other operand arrives in (per-rank view)
};

/// Strategy hooks. Every hook may decline (nullopt): the partitioner then keeps the value
/// replicated on that axis. Correctness never depends on a hook: wherever an op needs its
/// operands laid out otherwise, the partitioner inserts the collectives.
struct PartitionPolicy {
  /// The layout a contraction's weight should take (one entry per mesh axis).
  std::function<std::optional<Sharding>(const WeightChoice&)> weight_layout;
  /// When a partial sum meets a replicated value in an elementwise op, reduce-scatter the sum
  /// along this dim and shard the result there (sequence parallelism: the residual stream
  /// becomes S(seq)); -1 all-reduces it. A partial sum meeting a sharded value is always
  /// reduce-scattered to that value's layout.
  int64_t shard_partial_sums_along = -1;
};

struct PartitionOptions {
  PartitionPolicy policy;
  /// The layout each graph output must end in; outputs without one keep what propagation gives,
  /// except that partial sums are always reduced.
  std::vector<Sharding> output_layouts;
};

/// Counts of what partition inserted, for reports and tests.
struct PartitionReport {
  int all_reduce = 0, all_gather = 0, reduce_scatter = 0, all_to_all = 0, local_shard = 0;
  int replicated_fallbacks = 0;  ///< nodes computed whole on every rank (no rule applied)
  int vocab_parallel = 0;        ///< embedding lookups whose table is split by vocabulary rows
  int vocab_parallel_losses = 0; ///< cross-entropies over logits split by classes (no gather)
  int split_softmaxes = 0;       ///< softmaxes over a split dim (max and sum all-reduced)
  int iota_blocks = 0;           ///< iota-built values (one-hot masks) made per block, not cut from the whole
};

/// Rewrites `g` (global view: mesh set, placements on some values, e.g. on inputs or weights)
/// into the per-rank program in place: placements propagate forward op by op, a placement
/// written on a value is honoured after it is computed, collectives go where an op needs its
/// operands laid out otherwise, and types and shape attributes become per-rank sizes. Ops
/// without a rule are computed whole on every rank. Every rewritten node is re-inferred and
/// must produce exactly the per-rank type its placement implies.
StatusOr<PartitionReport> partition(Graph& g, const PartitionOptions& options = {});

/// Parses "dp=2, tp=4" (the `mesh` option of a [parallel] section).
StatusOr<DeviceMesh> parse_mesh_option(const std::string& text);

/// The index of mesh axis `name`, or of the axis at `fallback_index` (negative counts from
/// the end) when `name` is empty; `who` names the strategy in errors.
StatusOr<int> strategy_axis(const DeviceMesh& mesh, const std::string& name, int fallback_index, const std::string& who);

/// The inputs a batch split cuts: `names` when given, else every input whose dim `batch_dim` is
/// symbolic (a batch), or when none is, those whose dim `batch_dim` equals the first input's,
/// or the first input.
std::vector<std::string> batch_input_names(const Graph& g, int64_t batch_dim, const std::vector<std::string>& names);

/// Places graph inputs' dim `batch_dim` on mesh axis `axis` (Shard), the data-parallel split:
/// the inputs named in `names`, or when empty every input whose dim `batch_dim` is symbolic
/// (a batch), or when none is, every input whose dim `batch_dim` equals the first input's
/// (static shapes: a training step's tokens and targets). Other inputs stay as they are.
Status shard_batch_inputs(Graph& g, int axis, int64_t batch_dim, const std::vector<std::string>& names,
                          const std::string& who);

/// Sets the mesh on a global-view graph, refusing one that is already a per-rank program.
Status start_strategy(Graph& g, const DeviceMesh& mesh, const std::string& who);

}  // namespace kiln::parallel
