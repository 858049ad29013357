// The data-parallel strategy: every rank holds the whole model and a slice of the batch.
#include "kiln/plugin.h"
#include "partition.h"

namespace kiln::parallel {
namespace {

class DataParallel final : public Pass {
 public:
  DataParallel(DeviceMesh mesh, std::string axis, int64_t batch_dim, std::vector<std::string> inputs)
      : mesh_(std::move(mesh)), axis_(std::move(axis)), batch_dim_(batch_dim), inputs_(std::move(inputs)) {}

  StatusOr<bool> run(Graph& g) override {
    const std::string who = "data-parallel";
    KILN_RETURN_IF_ERROR(start_strategy(g, mesh_, who));
    KILN_ASSIGN_OR_RETURN(int axis, strategy_axis(mesh_, axis_, 0, who));
    KILN_RETURN_IF_ERROR(shard_batch_inputs(g, axis, batch_dim_, inputs_, who));
    KILN_RETURN_IF_ERROR(partition(g).status());
    return true;
  }

 private:
  DeviceMesh mesh_;
  std::string axis_;
  int64_t batch_dim_;
  std::vector<std::string> inputs_;
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
       "inputs to split (default: every input whose batch dim is symbolic, else the first input)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    KILN_ASSIGN_OR_RETURN(DeviceMesh mesh, parse_mesh_option(o.get_string("mesh")));
    if (o.get_int("batch-dim") < 0) return invalid_argument("data-parallel: batch-dim must be >= 0");
    return std::unique_ptr<Pass>(
        new DataParallel(std::move(mesh), o.get_string("axis"), o.get_int("batch-dim"), o.get_strings("inputs")));
  };
  return r.add_parallel(std::move(info));
}

}  // namespace
}  // namespace kiln::parallel

KILN_PLUGIN("kiln-parallel-data", "0.1.0", kiln::parallel::register_data_parallel)
