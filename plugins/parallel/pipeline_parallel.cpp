// The pipeline strategy: a deep model's layer sequence cut into one stage per rank, balanced by
// the cost model, activations passed with send/recv, microbatches run GPipe-style.
#include "kiln/plugin.h"
#include "partition.h"
#include "pipeline.h"

namespace kiln::parallel {
namespace {

class PipelineParallel final : public Pass {
 public:
  explicit PipelineParallel(PipelineConfig cfg) : cfg_(std::move(cfg)) {}
  StatusOr<bool> run(Graph& g) override {
    KILN_RETURN_IF_ERROR(apply_pipeline(g, cfg_).status());
    return true;
  }

 private:
  PipelineConfig cfg_;
};

Status register_pipeline(Registry& r) {
  ParallelInfo info;
  info.name = "pipeline";
  info.version = "0.1.0";
  info.summary = "one stage of the layer sequence per rank, balanced by the cost model; send/recv between stages, "
                 "GPipe microbatches";
  info.options = {
      {"mesh", OptionType::kString, std::string("pp=1"),
       "device mesh: the stages' axis, e.g. \"pp=4\", and optionally axes splitting each stage, e.g. \"pp=2, dp=2\" "
       "(data parallel) or \"pp=2, tp=2\" (tensor parallel)"},
      {"stage-axis", OptionType::kString, std::string(""), "the mesh axis of the stages (default: the axis named pp, else the first)"},
      {"data-axis", OptionType::kString, std::string(""),
       "the mesh axis splitting each stage's batch (default: the axis named dp, if any)"},
      {"tensor-axis", OptionType::kString, std::string(""),
       "the mesh axis splitting each stage's weights, Megatron-style (default: the axis named tp, if any)"},
      {"sequence-parallel", OptionType::kBool, false,
       "with a tensor axis: keep each stage's residual stream and norms split along sequence-dim (Megatron)"},
      {"sequence-dim", OptionType::kInt, int64_t{1}, "the sequence dim of the residual stream"},
      {"microbatches", OptionType::kInt, int64_t{0},
       "microbatches each stage runs in turn (0: as many as stages, or the most below that the batch divides into)"},
      {"schedule", OptionType::kString, std::string("gpipe"), "microbatch schedule: gpipe (every forward in order)"},
      {"batch-dim", OptionType::kInt, int64_t{0}, "the inputs' batch dim, cut into microbatches"},
      {"inputs", OptionType::kStringList, std::vector<std::string>{},
       "inputs cut into microbatches (default: every input whose batch dim is symbolic, else the first)"},
      {"dims", OptionType::kStringList, std::vector<std::string>{},
       "sizes of symbolic dims, e.g. [\"B=8\"]: stages pass activations of static shape"},
      {"device", OptionType::kString, std::string("h200"), "device preset of the cost model that balances the stages"},
      {"probe", OptionType::kString, std::string(""), "TOML from bench/parallel/probe.py: measured rates replacing the preset's"},
      {"print-stages", OptionType::kBool, true, "print the stages (nodes, predicted time, weights, bytes sent) on stderr"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    PipelineConfig cfg;
    KILN_ASSIGN_OR_RETURN(cfg.mesh, parse_mesh_option(o.get_string("mesh")));
    cfg.microbatches = o.get_int("microbatches");
    cfg.batch_dim = o.get_int("batch-dim");
    cfg.inputs = o.get_strings("inputs");
    cfg.print = o.get_bool("print-stages");
    if (cfg.microbatches < 0) return invalid_argument("pipeline: microbatches must be >= 0 (0: as many as stages)");
    if (cfg.batch_dim < 0) return invalid_argument("pipeline: batch-dim must be >= 0");
    if (o.get_string("schedule") != "gpipe")
      return invalid_argument("pipeline: schedule \"" + o.get_string("schedule") +
                              "\" is not known; \"gpipe\" is (a forward-only run has no 1F1B to interleave)");
    cfg.stage_axis = o.get_string("stage-axis");
    cfg.data_axis = o.get_string("data-axis");
    cfg.tensor_axis = o.get_string("tensor-axis");
    cfg.sequence_parallel = o.get_bool("sequence-parallel");
    cfg.sequence_dim = o.get_int("sequence-dim");
    KILN_ASSIGN_OR_RETURN(cfg.dims, parse_dims_option(o.get_strings("dims"), "pipeline"));
    KILN_ASSIGN_OR_RETURN(cfg.device, device_preset(o.get_string("device")));
    if (!o.get_string("probe").empty()) {
      KILN_ASSIGN_OR_RETURN(cfg.device, load_probe(o.get_string("probe"), cfg.device));
    }
    return std::unique_ptr<Pass>(new PipelineParallel(std::move(cfg)));
  };
  return r.add_parallel(std::move(info));
}

}  // namespace
}  // namespace kiln::parallel

KILN_PLUGIN("kiln-parallel-pipeline", "0.1.0", kiln::parallel::register_pipeline)
