// The registry: every front end, pass, backend and parallel strategy, keyed by (kind, name).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kiln/core/options.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln {

enum class PluginKind { kFrontend, kPass, kBackend, kParallel };
/// "frontend", "pass", "backend", "parallel"
const char* plugin_kind_name(PluginKind k);

/// What every registered entry carries.
struct PluginEntry {
  std::string name;       ///< kebab-case, unique within its kind
  std::string version;    ///< the plugin's own version, e.g. "0.1.0"
  std::string summary;    ///< one line
  std::vector<OptionSpec> options;
  std::string library;    ///< the shared library that registered it (set by the registry)
};

/// A graph-to-graph transformation. Returns whether it changed the graph.
class Pass {
 public:
  virtual ~Pass() = default;
  virtual StatusOr<bool> run(Graph& g) = 0;
};

struct PassInfo : PluginEntry {
  std::function<StatusOr<std::unique_ptr<Pass>>(const Options&)> create;
};

/// Reads a model file into Kiln IR.
struct FrontendInfo : PluginEntry {
  std::vector<std::string> extensions;  ///< e.g. {".kir"}; used to pick a front end by file name
  std::function<StatusOr<std::unique_ptr<Graph>>(const std::string& path, const Options&)> import;
};

/// A compiled graph, ready to run.
class Executable {
 public:
  virtual ~Executable() = default;
  /// Inputs in graph-input order; returns outputs in graph-output order.
  virtual StatusOr<std::vector<Tensor>> run(std::span<const Tensor> inputs) = 0;
  /// Every `variable` of the graph with the value it holds now (its init before any assign),
  /// by name: what a training checkpoint saves. Backends that keep no host state refuse.
  virtual StatusOr<std::map<std::string, Tensor>> read_state() {
    return Status(StatusCode::kUnimplemented, "this backend cannot read variable state");
  }
  /// Gives variables the values in `values` (a checkpoint being restored): each name must be a
  /// variable of the graph, with its type.
  virtual Status write_state(const std::map<std::string, Tensor>& values) {
    return Status(StatusCode::kUnimplemented, "this backend cannot write variable state");
  }
};

struct ArtifactContents;

/// Lowers graphs for one kind of device.
class Backend {
 public:
  virtual ~Backend() = default;
  /// Compiles for this process's use (e.g. `kiln run`).
  virtual StatusOr<std::unique_ptr<Executable>> compile(const Graph& g) = 0;
  /// Adds this backend's part of a .kiln artifact for `targets` (each one this backend lists).
  /// The first backend asked fills the plan and weights; later ones (other generations of the
  /// same family) add images built from the same lowering. Backends that make no artifacts
  /// keep this default.
  virtual Status build_artifact(const Graph& g, const std::vector<std::string>& targets,
                                ArtifactContents& out) {
    return Status(StatusCode::kUnimplemented, "this backend does not produce .kiln artifacts");
  }
};

struct BackendInfo : PluginEntry {
  std::vector<std::string> targets;  ///< targets it can build for ("cpu", "sm_90a", ...)
  std::function<StatusOr<std::unique_ptr<Backend>>(const Options&)> create;
};

/// A parallelism strategy: a pass that sets value placements and inserts collectives.
struct ParallelInfo : PluginEntry {
  std::function<StatusOr<std::unique_ptr<Pass>>(const Options&)> create;
};

/// One row of `kiln plugins`.
struct RegistryRow {
  PluginKind kind;
  const PluginEntry* entry;
};

/// The process-wide table of plugins. Not thread-safe; fill it at start-up.
class Registry {
 public:
  static Registry& global();

  /// Adds an entry; a second entry of the same (kind, name) is refused, naming both libraries.
  Status add_frontend(FrontendInfo info);
  Status add_pass(PassInfo info);
  Status add_backend(BackendInfo info);
  Status add_parallel(ParallelInfo info);

  /// Lookups. An unknown name's error suggests a close registered name, lists what is
  /// registered of that kind and says how to load a plugin that may provide it (kPluginHint).
  StatusOr<const FrontendInfo*> frontend(const std::string& name) const;
  StatusOr<const PassInfo*> pass(const std::string& name) const;
  StatusOr<const BackendInfo*> backend(const std::string& name) const;
  StatusOr<const ParallelInfo*> parallel(const std::string& name) const;
  /// The front end whose extensions match the file name's.
  StatusOr<const FrontendInfo*> frontend_for_path(const std::string& path) const;
  /// Options declared by (kind, name); error when unknown.
  StatusOr<const PluginEntry*> find(PluginKind kind, const std::string& name) const;

  /// Every entry, sorted by kind then name.
  std::vector<RegistryRow> rows() const;

  /// The library path stamped on entries added from now on ("" = built in). Set by the loader.
  void set_current_library(std::string path) { current_library_ = std::move(path); }

 private:
  std::map<std::string, FrontendInfo> frontends_;
  std::map<std::string, PassInfo> passes_;
  std::map<std::string, BackendInfo> backends_;
  std::map<std::string, ParallelInfo> parallels_;
  std::string current_library_;
};

}  // namespace kiln
