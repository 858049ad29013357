// The IR verifier: structure, SSA dominance, schemas and types.
#pragma once

#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"

namespace kiln {

/// Verifies `g` and every region in it: each operand is defined before use in the same
/// graph (regions are isolated), use lists are consistent, each node matches its op's
/// schema and its result types equal what the shape rule infers, outputs are set.
/// The first problem is returned, located at the offending node.
Status verify(const Graph& g);

}  // namespace kiln
