// The reference interpreter: runs any verified graph on the CPU; the numeric oracle.
#pragma once

#include <span>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln {

/// Runs graphs node by node with each op's reference kernel. Floating-point ops compute in
/// f64 and round once to the result dtype. Stateless; safe to use from several threads on
/// different graphs.
class Interpreter {
 public:
  /// Checks that inputs match the graph's input types (dtype, rank, static dims, and the
  /// same size for every use of one symbol), then evaluates. Frees intermediates after
  /// their last use.
  StatusOr<std::vector<Tensor>> run(const Graph& g, std::span<const Tensor> inputs);
};

}  // namespace kiln
