// The data-parallel strategy: every rank holds the whole model and a slice of the batch. Run
// on a training step's joint graph (after autodiff, before the optimizer), the weights'
// gradients come out all-reduced (or reduce-scattered, shard-optimizer-state) and the loss whole.
#include "kiln/plugin.h"
#include "partition.h"
#include "strategies.h"

namespace kiln::parallel {
namespace {

class DataParallel final : public Pass {
 public:
  explicit DataParallel(DataParallelConfig cfg) : cfg_(std::move(cfg)) {}
  StatusOr<bool> run(Graph& g) override {
    KILN_RETURN_IF_ERROR(apply_data_parallel(g, cfg_));
    return true;
  }

 private:
  DataParallelConfig cfg_;
};

Status register_data_parallel(Registry& r) {
  ParallelInfo info;
  info.name = "data-parallel";
  info.version = "0.1.0";
  info.summary = "every rank runs the whole model on its slice of the batch (inputs split along batch-dim)";
  info.options = {
      {"mesh", OptionType::kString, std::string("dp=1"), "device mesh, e.g. \"dp=8\" or \"dp=2, tp=4\""},
      {"axis", OptionType::kString, std::string(""), "mesh axis the batch is split over (default: the first)"},
      {"batch-dim", OptionType::kInt, int64_t{0}, "the inputs' batch dim"},
      {"inputs", OptionType::kStringList, std::vector<std::string>{},
       "inputs to split (default: every input whose batch dim is symbolic, else those whose batch dim is the first input's)"},
      {"shard-optimizer-state", OptionType::kBool, false,
       "training (ZeRO-1): reduce-scatter the gradients so each rank updates and keeps optimizer state for 1/N of "
       "every weight, then all-gather the weights (default: all-reduce, every rank updates everything)"},
      {"bucket-mb", OptionType::kFloat, 25.0,
       "training: all-reduce the gradients together in buckets of up to this many MiB, as PyTorch DDP's bucket_cap_mb "
       "(0: one all-reduce per gradient)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    DataParallelConfig cfg;
    KILN_ASSIGN_OR_RETURN(cfg.mesh, parse_mesh_option(o.get_string("mesh")));
    if (o.get_int("batch-dim") < 0) return invalid_argument("data-parallel: batch-dim must be >= 0");
    cfg.axis = o.get_string("axis");
    cfg.batch_dim = o.get_int("batch-dim");
    cfg.inputs = o.get_strings("inputs");
    cfg.shard_optimizer_state = o.get_bool("shard-optimizer-state");
    const double bucket_mb = o.get_float("bucket-mb");
    if (!(bucket_mb >= 0) || bucket_mb > 1e6) return invalid_argument("data-parallel: bucket-mb must be in [0, 1e6]");
    cfg.bucket_bytes = static_cast<int64_t>(bucket_mb * 1024 * 1024);
    return std::unique_ptr<Pass>(new DataParallel(std::move(cfg)));
  };
  return r.add_parallel(std::move(info));
}

}  // namespace
}  // namespace kiln::parallel

KILN_PLUGIN("kiln-parallel-data", "0.1.0", kiln::parallel::register_data_parallel)
