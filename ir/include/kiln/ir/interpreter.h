// The reference interpreter: runs any verified graph on the CPU; the numeric oracle.
#pragma once

#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln {

struct MeshContext;  // kiln/ir/mesh_run.h

/// Runs graphs node by node with each op's reference kernel. Floating-point ops compute in
/// f64 and round once to the result dtype.
///
/// An instance holds the persistent state of `variable`/`assign` (by variable name), so one
/// instance per loaded model keeps that state across runs. An instance is not thread-safe;
/// graphs without variables leave it untouched, and a temporary one per run is fine for them.
class Interpreter {
 public:
  /// Checks that inputs match the graph's input types (dtype, rank, static dims, and the
  /// same size for every use of one symbol), then evaluates. Frees intermediates after
  /// their last use. For a top-level graph, the values assigned during the run become the
  /// variables' values once the whole run succeeded (a failed run changes no state).
  StatusOr<std::vector<Tensor>> run(const Graph& g, std::span<const Tensor> inputs);

  /// The value variable `name` holds, or null while it still has its `init`.
  const Tensor* variable_value(const std::string& name) const;
  /// What an `assign` gives variable `name` for the next run; takes effect at commit_assigns.
  void stage_assign(const std::string& name, Tensor value);
  /// Makes the staged values current. run() does this itself; an executor that calls the
  /// reference kernels directly (cpu-llvm) calls it after its last step.
  void commit_assigns();
  /// Drops staged values without applying them.
  void discard_assigns() { staged_.clear(); }
  /// The rank and exchange collective ops use while this interpreter runs one rank of a mesh
  /// (run_mesh sets it); null for a single-device run, where collectives are refused.
  void set_mesh_context(MeshContext* ctx) { mesh_ = ctx; }
  MeshContext* mesh_context() const { return mesh_; }
  /// Every top-level `variable` of `g` with the value it holds (its init until an assign).
  std::map<std::string, Tensor> state_of(const Graph& g) const;
  /// Sets variables of `g` from `values`; each name must be a variable of `g`, with its type.
  /// Copies of a weight (`copy_of`) follow their master: see complete_state_copies.
  Status set_state(const Graph& g, const std::map<std::string, Tensor>& values);
  /// Forgets every variable's value: the next run starts from the `init` values again.
  void reset_state() {
    state_.clear();
    staged_.clear();
  }

 private:
  StatusOr<std::vector<Tensor>> evaluate(const Graph& g, std::span<const Tensor> inputs);

  std::map<std::string, Tensor> state_, staged_;
  MeshContext* mesh_ = nullptr;
};

/// Completes `values`, the variables of `g` about to be set (a checkpoint, one weight by name),
/// with the copies their masters imply: every variable `copy_of` a master (or scale) in `values`
/// is recomputed from it, as the step computes it (cast, or quantize with its `copy_scale`,
/// read through `current` when `values` does not set it), replacing any value given for it; a
/// copy given without its master is refused, naming both. Every path that sets state calls
/// this, so a weight never runs with a stale copy.
Status complete_state_copies(const Graph& g, std::map<std::string, Tensor>& values,
                             const std::function<Tensor(const std::string&)>& current);

/// The variable a `variable` node is a copy of (`copy_of`), or "" for an ordinary one.
std::string state_copy_master(const Node& variable);

}  // namespace kiln
