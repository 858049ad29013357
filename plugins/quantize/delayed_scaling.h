// Shared by quantize-fp8 (mode=delayed) and fp8-training: Transformer Engine's delayed per-tensor
// scaling, built into a graph from core ops with its state in variables.
//
// Each run, for a tensor x quantized with the variable `scale`:
//   history = [amax(x), history[0 .. H-2]]                     (newest first)
//   amax    = max(history) (algorithm max) or amax(x) (most_recent)
//   scale   = amax * 2^margin / max_finite(format) for the next run, when amax is finite and
//             positive (and `due` holds, if given); otherwise the scale stays.
// With `current_until_history`, a run whose history holds no positive amax yet (the first) quantizes
// with the scale its own amax gives (just in time) instead of the initial scale 1: torchao's
// initialization of delayed scaling. Without it an E5M2 gradient of 1e-6 (below its smallest
// subnormal, 2^-16) flushes to zero on the first step.
// Only core ops (amax, delayed_scaling_update and delayed_scaling_step_scale), so every backend
// that runs those and variable/assign runs delayed scaling.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/op.h"

namespace kiln {

/// One tensor's recipe (Transformer Engine's names: amax_history_len, amax_compute_algo, margin).
struct DelayedScaling {
  int64_t history = 16;
  std::string algorithm = "max";  ///< max or most_recent
  int64_t margin = 0;
  /// Until the history holds a positive amax, quantize with the current amax's scale (see above).
  bool current_until_history = false;
};


/// Makes a node of `op` where the caller wants it, typed by the op's shape rule, its result named
/// `name` (may be empty); returns the result (null for an op without results).
using MakeNode = std::function<StatusOr<Value*>(const std::string& op, std::vector<Value*> operands, AttrMap attrs,
                                                const std::string& name)>;

/// Adds the update of x's delayed scale: creates variable `history_name`, rolls amax(x) into it
/// and assigns the next scale to the variable `scale` reads (`scale_name`). `due` (a bool
/// scalar, may be null) limits the scale's update to some runs. Returns the scale this run
/// quantizes with: `scale`, or with recipe.current_until_history the current amax's scale while
/// the history is empty.
inline StatusOr<Value*> build_delayed_scaling(const MakeNode& make, Value* x, Value* scale,
                                              const std::string& history_name, const std::string& scale_name,
                                              const DelayedScaling& recipe, DType format, Value* due = nullptr) {
  const int64_t h = recipe.history;
  KILN_ASSIGN_OR_RETURN(Value * hist, make("variable", {},
                                           {{"name", Attribute(history_name)}, {"init", Attribute(Tensor(DType::kF32, {h}))}},
                                           history_name));
  KILN_ASSIGN_OR_RETURN(Value * amax, make("amax", {x}, {}, x->name().empty() ? "" : x->name() + ".amax"));
  // The roll and the next scale are one node per tensor, which a backend may run for every
  // tensor of the graph at once (the CUDA backend: one kernel, in place, at the end of the step).
  std::vector<Value*> operands = {amax, hist, scale};
  if (due != nullptr) operands.push_back(due);
  KILN_ASSIGN_OR_RETURN(Value * history_out,
                        make("delayed_scaling_update", operands,
                             {{"dtype", Attribute(format)},
                              {"algorithm", Attribute(recipe.algorithm)},
                              {"margin", Attribute(recipe.margin)}},
                             ""));
  Value* next = history_out->producer()->result(1);
  Value* now = scale;
  if (recipe.current_until_history) {
    // A node without a gradient reads the history: autodiff does not take it for a weight.
    KILN_ASSIGN_OR_RETURN(now, make("delayed_scaling_step_scale", {amax, hist, scale},
                                    {{"dtype", Attribute(format)}, {"margin", Attribute(recipe.margin)}}, ""));
  }
  KILN_RETURN_IF_ERROR(make("assign", {history_out}, {{"name", Attribute(history_name)}}, "").status());
  KILN_RETURN_IF_ERROR(make("assign", {next}, {{"name", Attribute(scale_name)}}, "").status());
  return now;
}

}  // namespace kiln
