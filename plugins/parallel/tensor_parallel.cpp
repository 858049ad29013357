// The tensor-parallel strategy (Megatron-style): contractions with constant weights alternate
// between column parallel (weight split on its output features) and row parallel (split on its
// input features, partial sums), so attention heads and MLP hidden units split across ranks and
// each block needs one all-reduce; sequence parallelism keeps the residual stream and the norms
// split along the sequence instead (reduce-scatter + all-gather in place of the all-reduce).
#include "kiln/plugin.h"
#include "partition.h"

namespace kiln::parallel {
namespace {

struct TensorParallelConfig {
  DeviceMesh mesh;
  std::string axis, data_axis;
  bool sequence_parallel = false;
  int64_t sequence_dim = 1, batch_dim = 0, min_size = 0;
  bool replicate_outputs = false;
  std::vector<std::string> inputs;
};

/// Column parallel for a replicated activation, row parallel for one already split along its
/// features: the choice Megatron makes for each projection pair.
std::optional<Sharding> megatron_layout(const WeightChoice& c, size_t axis, const TensorParallelConfig& cfg) {
  const Value* w = c.node.operand(c.weight_operand);
  const Value* x = c.node.operand(c.weight_operand == 1 ? 0 : 1);
  const bool is_weight = w->is_graph_input() || (w->producer() && w->producer()->op_name() == "constant");
  const bool conv = c.node.op_name() == "conv";
  if (!is_weight || (conv ? w->type().rank() < 3 : w->type().rank() != 2) ||
      num_elements(w->shape()) < std::max<int64_t>(cfg.min_size, 1))
    return std::nullopt;
  // linear's and conv's weights are [out, in, ...]; matmul's is [in, out].
  const bool out_first = c.node.op_name() == "linear" || conv;
  const int64_t out_dim = out_first ? 0 : 1, in_dim = out_first ? 1 : 0;
  const Placement act = c.activation[axis];
  Sharding s(static_cast<size_t>(cfg.mesh.rank()), Placement::replicate());
  const int64_t feature_dim = conv ? 1 : x->type().rank() - 1;  // where the activation's features are
  const bool split_features = act.is_shard() && act.dim == feature_dim;
  s[axis] = Placement::shard(split_features ? in_dim : out_dim);
  if (!check_sharding(s, cfg.mesh, w->type()).ok()) return std::nullopt;
  return s;
}

class TensorParallel final : public Pass {
 public:
  explicit TensorParallel(TensorParallelConfig cfg) : cfg_(std::move(cfg)) {}

  StatusOr<bool> run(Graph& g) override {
    const std::string who = "tensor-parallel";
    KILN_RETURN_IF_ERROR(start_strategy(g, cfg_.mesh, who));
    KILN_ASSIGN_OR_RETURN(int axis, strategy_axis(cfg_.mesh, cfg_.axis, -1, who));
    if (!cfg_.data_axis.empty()) {
      KILN_ASSIGN_OR_RETURN(int dp, strategy_axis(cfg_.mesh, cfg_.data_axis, 0, who));
      if (dp == axis) return invalid_argument(who + ": data-axis and axis are both '" + cfg_.data_axis + "'");
      KILN_RETURN_IF_ERROR(shard_batch_inputs(g, dp, cfg_.batch_dim, cfg_.inputs, who));
    }
    PartitionOptions opt;
    const TensorParallelConfig cfg = cfg_;
    opt.policy.weight_layout = [cfg, axis](const WeightChoice& c) {
      return megatron_layout(c, static_cast<size_t>(axis), cfg);
    };
    if (cfg_.sequence_parallel) opt.policy.shard_partial_sums_along = cfg_.sequence_dim;
    if (cfg_.replicate_outputs)
      for (int i = 0; i < g.num_outputs(); ++i) {
        Sharding s(static_cast<size_t>(cfg_.mesh.rank()), Placement::replicate());
        if (!cfg_.data_axis.empty() && g.output(i)->type().rank() > cfg_.batch_dim) {
          const int dp = cfg_.mesh.axis_index(cfg_.data_axis);
          s[static_cast<size_t>(dp)] = Placement::shard(cfg_.batch_dim);
          if (!check_sharding(s, cfg_.mesh, g.output(i)->type()).ok()) s[static_cast<size_t>(dp)] = Placement::replicate();
        }
        opt.output_layouts.push_back(s);
      }
    KILN_RETURN_IF_ERROR(partition(g, opt).status());
    return true;
  }

 private:
  TensorParallelConfig cfg_;
};

Status register_tensor_parallel(Registry& r) {
  ParallelInfo info;
  info.name = "tensor-parallel";
  info.version = "0.1.0";
  info.summary = "Megatron-style: projections alternate column/row parallel, one all-reduce per block";
  info.options = {
      {"mesh", OptionType::kString, std::string("tp=1"), "device mesh, e.g. \"tp=8\" or \"dp=2, tp=4\""},
      {"axis", OptionType::kString, std::string(""), "mesh axis the weights are split over (default: the last)"},
      {"sequence-parallel", OptionType::kBool, false,
       "keep the residual stream and norms split along sequence-dim (reduce-scatter + all-gather per block)"},
      {"sequence-dim", OptionType::kInt, int64_t{1}, "the activations' sequence dim, for sequence-parallel"},
      {"data-axis", OptionType::kString, std::string(""), "also split the batch over this mesh axis (data parallel)"},
      {"batch-dim", OptionType::kInt, int64_t{0}, "the inputs' batch dim, for data-axis"},
      {"inputs", OptionType::kStringList, std::vector<std::string>{},
       "inputs data-axis splits (default: every input whose batch dim is symbolic, else the first)"},
      {"min-size", OptionType::kInt, int64_t{0}, "smallest weight (elements) worth splitting"},
      {"replicate-outputs", OptionType::kBool, false,
       "gather every output whole on each rank (default: outputs stay split, the host assembles them)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    TensorParallelConfig cfg;
    KILN_ASSIGN_OR_RETURN(cfg.mesh, parse_mesh_option(o.get_string("mesh")));
    cfg.axis = o.get_string("axis");
    cfg.data_axis = o.get_string("data-axis");
    cfg.sequence_parallel = o.get_bool("sequence-parallel");
    cfg.sequence_dim = o.get_int("sequence-dim");
    cfg.batch_dim = o.get_int("batch-dim");
    cfg.min_size = o.get_int("min-size");
    cfg.replicate_outputs = o.get_bool("replicate-outputs");
    cfg.inputs = o.get_strings("inputs");
    if (cfg.sequence_dim < 0 || cfg.batch_dim < 0 || cfg.min_size < 0)
      return invalid_argument("tensor-parallel: sequence-dim, batch-dim and min-size must be >= 0");
    return std::unique_ptr<Pass>(new TensorParallel(std::move(cfg)));
  };
  return r.add_parallel(std::move(info));
}

}  // namespace
}  // namespace kiln::parallel

KILN_PLUGIN("kiln-parallel-tensor", "0.1.0", kiln::parallel::register_tensor_parallel)
