// The tensor-parallel strategy (Megatron-style): contractions with constant weights alternate
// between column parallel (weight split on its output features) and row parallel (split on its
// input features, partial sums), so attention heads and MLP hidden units split across ranks and
// each block needs one all-reduce; sequence parallelism keeps the residual stream and the norms
// split along the sequence instead (reduce-scatter + all-gather in place of the all-reduce).
#include "kiln/plugin.h"
#include "partition.h"
#include "strategies.h"

namespace kiln::parallel {
namespace {

class TensorParallel final : public Pass {
 public:
  explicit TensorParallel(TensorParallelConfig cfg) : cfg_(std::move(cfg)) {}
  StatusOr<bool> run(Graph& g) override {
    KILN_RETURN_IF_ERROR(apply_tensor_parallel(g, cfg_));
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
      {"vocab-parallel", OptionType::kBool, true,
       "split embedding tables (gather of a [vocab, dim] weight) by vocabulary rows: each rank looks up its "
       "rows, one all-reduce (reduce-scatter under sequence-parallel) sums them"},
      {"sequence-dim", OptionType::kInt, int64_t{1}, "the activations' sequence dim, for sequence-parallel"},
      {"data-axis", OptionType::kString, std::string(""), "also split the batch over this mesh axis (data parallel)"},
      {"batch-dim", OptionType::kInt, int64_t{0}, "the inputs' batch dim, for data-axis"},
      {"inputs", OptionType::kStringList, std::vector<std::string>{},
       "inputs data-axis splits (default: every input whose batch dim is symbolic, else those whose batch dim is the first input's)"},
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
    cfg.vocab_parallel = o.get_bool("vocab-parallel");
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
