// The compile driver: the steps from a model file to outputs that `kiln` and the tests share.
//
//   KILN_RETURN_IF_ERROR(load_plugins_from({}, reg));
//   KILN_ASSIGN_OR_RETURN(Pipeline p, load_pipeline_with_plugins("p.toml", reg));
//   KILN_RETURN_IF_ERROR(resolve_pipeline_defaults(p, reg, "model.kir"));
//   KILN_ASSIGN_OR_RETURN(auto g, import_model("model.kir", p.frontend, reg));
//   KILN_RETURN_IF_ERROR(run_pipeline_passes(*g, p, reg, {}));
//   KILN_ASSIGN_OR_RETURN(auto outs, compile_and_run(*g, p.backend, reg, inputs));
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kiln/core/pass_manager.h"
#include "kiln/core/pipeline.h"
#include "kiln/core/registry.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/mesh_run.h"
#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln {

/// Loads the plugins of default_plugin_dirs() (unless `use_default_dirs` is false), then those
/// in `extra_dirs` (folders or plugin files), which must exist.
Status load_plugins_from(const std::vector<std::string>& extra_dirs, Registry& reg,
                         bool use_default_dirs = true);

/// Loads a pipeline file: first the plugins its `[plugins] paths` name, then the rest,
/// validated against the now complete registry.
StatusOr<Pipeline> load_pipeline_with_plugins(const std::string& path, Registry& reg);

/// Names what a pipeline may leave open: the front end by the model's file extension, and
/// (when `need_backend`) the backend, "reference". A backend that declares an int option
/// `threads` and leaves it at 0 takes the pipeline's `[runtime] threads`.
Status resolve_pipeline_defaults(Pipeline& p, const Registry& reg, const std::string& model_path,
                                 bool need_backend = true);

/// The passes `kiln compile` runs when neither a pipeline nor --passes names any: Kiln's
/// standard optimization order (clean-up, layout folding, fusion, dead code, memory-aware
/// scheduling), limited to the passes the loaded plugins register, each with its defaults.
std::vector<StageSpec> default_compile_passes(const Registry& reg);

/// Reads a model file with the named front end and verifies the result.
/// Hands `--sym NAME=SIZE` bindings to a front end that declares a string-list option `dims`
/// (e.g. onnx), so shape computations on those dims fold at import. Bindings the pipeline
/// already gives win. Front ends without the option are left alone (the symbols are bound
/// after import instead).
void forward_symbols_to_frontend(StageSpec& frontend, const std::map<std::string, int64_t>& symbols,
                                 const Registry& reg);

StatusOr<std::unique_ptr<Graph>> import_model(const std::string& path, const StageSpec& frontend,
                                              const Registry& reg);

/// Runs the pipeline's passes in order with a PassManager; `timings`, when given, receives
/// the per-pass times.
Status run_pipeline_passes(Graph& g, const Pipeline& p, const Registry& reg,
                           const PassManagerOptions& opts, std::vector<PassTiming>* timings = nullptr);

/// What a command asks of the pipeline: the model, a pipeline file or a pass list, overrides.
struct PipelineRequest {
  std::string model;
  std::string pipeline_file;               ///< "" = none
  std::optional<std::string> passes;       ///< a one-line pass list instead of a file
  std::string frontend, backend;           ///< "" = the pipeline's, else chosen by default
  std::map<std::string, int64_t> symbols;  ///< --sym bindings handed to the front end
  bool need_backend = true;
};

/// Fills `p` from `r`: the pipeline file (with the plugins it names) or pass list, the front-end
/// and backend overrides, then the defaults. A `p` filled before (a reproducer's) stays when
/// `r` names neither a file nor passes.
Status prepare_pipeline(const PipelineRequest& r, Registry& reg, Pipeline& p);

/// Logs the canonical pipeline ("pipeline: ..." on stderr), imports `model` with its front end
/// and runs its passes: what `kiln opt`, `kiln run` and `kiln train` share. `before_passes`, when
/// given, sees the imported graph first (`--weights` loads a checkpoint's weights there).
StatusOr<std::unique_ptr<Graph>> import_and_run_passes(const std::string& model, const Pipeline& p,
                                                       const Registry& reg, const PassManagerOptions& pm,
                                                       const std::function<Status(Graph&)>& before_passes = {});

/// Compiles `g` with the backend into an executable that runs many times (keeping the state
/// of its variables from one run to the next).
StatusOr<std::unique_ptr<Executable>> compile_graph(const Graph& g, const StageSpec& backend, const Registry& reg);

/// The type callers see for graph input or output `v`: for a per-rank program, the whole
/// value's (its pieces on every rank put together), else the value's own.
TensorType interface_type(const Graph& g, const Value* v);

// split_inputs_by_rank and assemble_outputs (per-rank programs' whole inputs and outputs) are
// in kiln/ir/mesh_run.h.
/// The program rank `rank` of per-rank program `g` runs by itself: a pipeline's stages of other
/// ranks dropped (their results, P(sum) terms, are zeros here) and its own stage inlined. A
/// program without pipeline_stage nodes comes back as a copy. CUDA backends compile this.
StatusOr<std::unique_ptr<Graph>> program_of_rank(const Graph& g, int64_t rank);

/// Whether rank `rank` of `mesh` runs pipeline_stage node `stage`: the rank named by its `rank`,
/// or with an `axis`, every rank at that coordinate along the axis (a stage of a mesh whose
/// other axes split each stage's work).
bool runs_stage(const Node& stage, const DeviceMesh& mesh, int64_t rank);

/// Compiles `g` with the backend and runs it on `inputs` (graph-input order). A per-rank
/// program of a mesh of several ranks takes and returns whole tensors and runs every rank in
/// this process on `reference`; other backends refuse it (each rank is its own process there).
StatusOr<std::vector<Tensor>> compile_and_run(const Graph& g, const StageSpec& backend,
                                              const Registry& reg, std::span<const Tensor> inputs);

/// How `bind_inputs` finds a tensor for each graph input.
struct InputBindings {
  std::map<std::string, Tensor> given;      ///< by graph input name
  bool random = false;                      ///< fill inputs not given with seeded random data
  uint64_t seed = 0;
  std::map<std::string, int64_t> symbols;   ///< sizes of symbolic dims (default 1)
};

/// The graph's inputs in order, from `b`. Given tensors must match the input types (dtype,
/// rank, static dims, one size per symbol). `notes` receives remarks such as defaulted symbols.
StatusOr<std::vector<Tensor>> bind_inputs(const Graph& g, const InputBindings& b,
                                          std::vector<std::string>* notes = nullptr);

/// A tensor of deterministic pseudo-random values: floats in [-1, 1), signed ints in [-8, 8),
/// u8 in [0, 16), bools 0/1. The same (dtype, shape, seed) gives the same bytes everywhere.
Tensor random_tensor(DType dtype, const std::vector<int64_t>& shape, uint64_t seed);

/// The name `kiln run` uses for graph input / output `i`: the value's name, else "input<i>" /
/// "output<i>".
std::string graph_input_name(const Graph& g, int i);
std::string graph_output_name(const Graph& g, int i);

/// NumPy-style text of a tensor's values; above `max_elements` only the first and last three
/// items of each dimension are shown, with "..." between.
std::string format_tensor(const Tensor& t, int64_t max_elements = 100);

}  // namespace kiln
