// The automatic parallelism planner: searches the ways to split a model over N devices (the
// dp x tp factorisations of N, with or without sequence parallelism, and which weights are worth
// splitting), partitions a copy of the graph for each with the strategies' own code, costs each
// per-rank program against a roofline and ring collectives, and ranks them for throughput or
// memory.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kiln/core/options.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"

namespace kiln::parallel {

/// What the cost model knows of a device and its links. Rates are sustained, not peak.
struct DeviceModel {
  std::string name;                 ///< "h200 preset", or the probe file it came from
  double bf16_flops = 0, f16_flops = 0, f32_flops = 0, fp8_flops = 0;  ///< matmul FLOP/s
  double hbm_bytes_per_s = 0;       ///< bytes read + written per second
  double link_bytes_per_s = 0;      ///< ring bus bandwidth per rank, one direction
  double link_latency_s = 0;        ///< per ring step
  bool link_measured = false;       ///< false: the link numbers are documented defaults
};

/// "h200" or "h100": sustained figures of an SXM part with NVLink 4 (documented in
/// docs/parallel.md).
StatusOr<DeviceModel> device_preset(const std::string& name);
/// Overrides `base` with what a probe TOML (bench/parallel/probe.py) measured.
StatusOr<DeviceModel> load_probe(const std::string& path, DeviceModel base);

enum class Objective { kThroughput, kMemory };

struct PlannerOptions {
  int64_t devices = 1;
  Objective objective = Objective::kThroughput;
  std::optional<int64_t> memory_limit;  ///< bytes per rank
  DeviceModel device;
  std::map<std::string, int64_t> dims;  ///< sizes of symbolic dims, for costing
  int64_t batch_dim = 0, sequence_dim = 1;
  std::vector<std::string> inputs;      ///< inputs a data-parallel axis splits (empty: as data-parallel picks)
};

/// One way to split the model, and what the cost model predicts for it.
struct Candidate {
  int64_t dp = 1, tp = 1, pp = 1;  ///< pp > 1: pipeline stages (the whole mesh; dp = tp = 1)
  bool sequence_parallel = false;
  int64_t min_size = 0;  ///< tensor parallelism splits weights of at least this many elements
  double compute_s = 0, comm_s = 0;
  double flops = 0;      ///< per rank
  int64_t weight_bytes = 0, activation_bytes = 0;  ///< per rank
  std::map<std::string, int> collectives;          ///< count per collective op
  bool splits_nothing = false;  ///< every rank computes the whole model (no input or weight split)
  double step_s() const { return compute_s + comm_s; }
  int64_t memory_bytes() const { return weight_bytes + activation_bytes; }
  /// "dp=2, tp=4"
  std::string mesh() const;
  /// "tensor-parallel{...}", "data-parallel{...}" or "pipeline{...}": the pass-list entry that builds it.
  std::string strategy() const;
};

struct Plan {
  Candidate chosen;
  std::vector<Candidate> ranked;       ///< every candidate that fits, best first
  std::vector<std::string> rejected;   ///< candidates the partitioner refused, and why
  int over_limit = 0;                  ///< candidates over the memory limit
  std::map<std::string, int64_t> symbols;  ///< the sizes used for costing
  std::vector<std::string> defaulted;  ///< symbols not given, costed at their default
  PlannerOptions options;
};

/// The options of the `auto` strategy (and `kiln plan`): devices, objective, memory-limit,
/// device, probe, dims, batch-dim, sequence-dim, inputs, print-plan.
std::vector<OptionSpec> planner_option_specs();
/// The `dims` option (["B=8", "T=2048"]) as sizes; `who` names the strategy in errors.
StatusOr<std::map<std::string, int64_t>> parse_dims_option(const std::vector<std::string>& entries, const std::string& who);
/// Planner options from resolved option values; checks them.
StatusOr<PlannerOptions> planner_options(const Options& o);

/// Searches and ranks every candidate (exhaustively: for N devices there are d(N) meshes, two
/// sequence-parallel settings and a handful of size thresholds). Fails when no candidate
/// partitions, or none fits the memory limit (naming the smallest footprint found).
StatusOr<Plan> make_plan(const Graph& global, const PlannerOptions& options);

/// Rewrites global-view `g` into `c`'s per-rank program.
Status apply_candidate(Graph& g, const Candidate& c, const PlannerOptions& options);

/// The plan as text: the choice, its predicted step time and memory per rank, the runners-up.
std::string format_plan(const Plan& plan, int runners_up = 4);
/// The plan as JSON (every ranked candidate), for scripts and tests.
std::string plan_json(const Plan& plan);

/// Predicted cost of one per-rank program on `device`, shapes static.
struct ProgramCost {
  double compute_s = 0, comm_s = 0, flops = 0;
  int64_t weight_bytes = 0, activation_bytes = 0;
  std::map<std::string, int> collectives;
  bool splits_nothing = false;  ///< no input is sharded and no value is cut by local_shard
};
StatusOr<ProgramCost> cost_program(const Graph& per_rank, const DeviceModel& device);

/// Compute time of one node on `device` (no collectives): max(FLOPs / rate, bytes / bandwidth);
/// views and constants are free; a node with a region other than `fused` costs its body.
double node_seconds(const Node& n, const DeviceModel& device);
/// Floating-point operations of one node (a multiply-add counts two; a region, its body's).
double node_flops(const Node& n);

/// Replaces every symbolic dim of `g` (regions included) by its size in `dims`, so a copy has
/// static shapes to cost or to pass between ranks. Symbols missing from `dims` take `fallback`
/// and are listed in `defaulted`; `used` receives every size bound.
void bind_symbol_sizes(Graph& g, const std::map<std::string, int64_t>& dims, int64_t fallback,
                       std::map<std::string, int64_t>& used, std::set<std::string>& defaulted);

/// "80GiB", "512 MiB", "16GB", "1e9" -> bytes.
StatusOr<int64_t> parse_bytes(const std::string& text);
/// "1.5 GiB"
std::string format_bytes(double bytes);

}  // namespace kiln::parallel
