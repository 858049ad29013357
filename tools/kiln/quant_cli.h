// Pieces `kiln calibrate` and `kiln quant-report` share: flags, the fp32/quantized split of a
// pipeline, sample inputs, and running a graph on the reference interpreter with extra outputs.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli.h"
#include "kiln/core/driver.h"

namespace kiln::cli {

struct QuantFlags {
  std::string model, pipeline_file, inputs_dir, output;
  std::optional<std::string> passes;
  std::vector<std::string> plugin_paths;
  int64_t random_samples = 0;  ///< --random-inputs N
  uint64_t seed = 0;
  std::map<std::string, int64_t> symbols;
};

/// Reads a flag both commands take; false when `flag` is not one of them.
bool quant_flag(const std::string& flag, Args& args, QuantFlags& f);

/// The model before quantization (the pipeline's passes before its first quantize-* or
/// convert-* pass) and, when `quantized` is given, after the last such pass. Later passes
/// (fusion, dce) leave the numbers alone and would hide layer outputs inside regions.
Status prepare_graphs(const QuantFlags& f, std::unique_ptr<Graph>* reference, std::unique_ptr<Graph>* quantized);

/// Input sets for `g`: one per sub-folder of --inputs DIR holding .npy files (or DIR itself),
/// files named NAME.npy or input_NAME.npy; or --random-inputs N seeded sets.
StatusOr<std::vector<std::vector<Tensor>>> sample_inputs(const Graph& g, const QuantFlags& f);

/// Runs `g` on the reference interpreter and returns its outputs followed by the values named
/// in `extra` (top-level values; a name that is not there is an error).
StatusOr<std::vector<Tensor>> run_with_values(const Graph& g, const std::vector<std::string>& extra,
                                              const std::vector<Tensor>& inputs);

}  // namespace kiln::cli
