// Pipelines as data: front end, ordered passes with options, backend, runtime settings.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/core/options.h"
#include "kiln/core/registry.h"
#include "kiln/ir/status.h"

namespace kiln {

/// One stage (front end, pass or backend) with its resolved options.
struct StageSpec {
  std::string name;
  Options options;
  Location loc;  ///< where it was written (TOML file or one-line text); unknown when built
  bool operator==(const StageSpec& o) const { return name == o.name && options == o.options; }
};

/// Settings the runtime reads (not part of compilation).
struct RuntimeSettings {
  int64_t threads = 0;        ///< 0 = all cores
  bool cuda_graphs = true;
  std::string device = "";    ///< "" = best available
  bool operator==(const RuntimeSettings&) const = default;
};

struct Pipeline {
  StageSpec frontend;          ///< name "" = pick by the model file's extension
  std::vector<StageSpec> passes;
  StageSpec backend;           ///< name "" = "reference"
  std::vector<std::string> targets;
  RuntimeSettings runtime;
  std::vector<std::string> plugin_paths;  ///< absolute, resolved against the TOML's folder

  /// One line: "kir | canonicalize{max-iterations=4},cse,dce | reference{...}".
  /// Targets appear as the backend option-like suffix "@sm_80,sm_90a"; runtime settings that
  /// differ from defaults as a fourth segment "runtime{threads=4}".
  std::string canonical(const Registry& reg) const;
  bool operator==(const Pipeline& o) const = default;
};

/// Reads only the `[plugins] paths` of a pipeline file, so the caller can load those plugins
/// before validating the rest.
StatusOr<std::vector<std::string>> read_pipeline_plugin_paths(const std::string& path);

/// Parses and validates a pipeline TOML against the options each plugin declares.
/// Unknown keys, wrong types and unknown plugins are errors with file:line:col.
StatusOr<Pipeline> load_pipeline_file(const std::string& path, const Registry& reg);
StatusOr<Pipeline> parse_pipeline_toml(std::string_view text, const std::string& filename,
                                       const Registry& reg);

/// Parses the canonical one-line form (also accepted: a bare pass list "a,b{k=v}" via
/// parse_pass_list). Errors give the column.
StatusOr<Pipeline> parse_pipeline_string(std::string_view text, const Registry& reg);
/// "canonicalize{max-iterations=2},cse" → resolved pass stages.
StatusOr<std::vector<StageSpec>> parse_pass_list(std::string_view text, const Registry& reg);

/// One option value in the one-line syntax, as option_value_str prints it: true, 3, 0.5,
/// text, "quoted text", [a, "b c"]. Errors give the column.
StatusOr<OptionValue> parse_option_value(std::string_view text);

}  // namespace kiln
