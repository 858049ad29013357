// The pass manager: runs a pipeline's passes with verification, timing, IR printing and
// crash reproducers.
#pragma once

#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "kiln/core/pipeline.h"
#include "kiln/core/registry.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"

namespace kiln {

struct PassManagerOptions {
  bool verify_each = true;            ///< run the verifier after every pass
  bool timing = false;                ///< print a per-pass time table after the run
  bool print_ir_after_all = false;
  bool print_ir_after_change = false;  ///< only after passes that report a change
  std::ostream* log = nullptr;        ///< where printing and timing go (null = std::cerr)
  /// Folder for reproducers written when a pass or the verifier fails ("" = current folder).
  std::string reproducer_dir;
  /// Plugin folders and files a reproducer records; unset = plugin_paths_used(), those this
  /// process loaded plugins from.
  std::optional<std::vector<std::string>> reproducer_plugin_paths;
};

struct PassTiming {
  std::string pass;
  double seconds = 0;
  bool changed = false;
};

/// What the header of a reproducer records (the format is in docs/reproducers.md).
struct Reproducer {
  std::string pipeline;                   ///< the canonical one-line pipeline
  std::vector<std::string> plugin_paths;  ///< absolute plugin folders and files, in load order
  std::string failure;                    ///< "<pass>: <first line of the error>"
};

/// Reads the header of a reproducer the pass manager wrote; the .kir below it is left to the
/// kir front end. Keys it does not know are skipped, so newer headers still read.
StatusOr<Reproducer> read_reproducer(const std::string& path);

class PassManager {
 public:
  PassManager(const Registry& reg, PassManagerOptions opts);

  /// Runs `passes` in order on `g`. On failure the returned Status names the pass, and a
  /// reproducer (the IR that entered the pipeline, headed by the canonical pipeline and the
  /// plugin paths) is written; its path is in the message.
  Status run(Graph& g, const std::vector<StageSpec>& passes, const std::string& canonical_pipeline);

  const std::vector<PassTiming>& timings() const { return timings_; }

 private:
  const Registry& reg_;
  PassManagerOptions opts_;
  std::vector<PassTiming> timings_;
};

}  // namespace kiln
