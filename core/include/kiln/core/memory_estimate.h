// Peak activation memory of a graph in a given node order: the liveness model that the
// schedule-memory pass minimizes and that `kiln compile` reports.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>

#include "kiln/ir/graph.h"

namespace kiln {

/// What a symbolic dim counts as when sizing a value (shapes are bound only after the passes).
constexpr int64_t kSymbolicDimEstimate = 64;

/// Bytes of `v`'s storage; symbolic dims count as kSymbolicDimEstimate.
int64_t value_bytes(const Value& v);

/// Whether `op` only renames its first operand's storage (reshape, flatten, squeeze,
/// unsqueeze, identity): its result costs nothing and keeps the operand alive.
bool is_view_op(const std::string& op);

/// How the estimator sees a graph's storage. A value's root is the value whose storage it
/// reads (itself, or the base of a chain of views). Roots computed only from constants are
/// free: constants live in the weights section and all-constant nodes fold into it.
struct StorageMap {
  std::unordered_map<const Value*, const Value*> root;
  std::unordered_map<const Value*, bool> free;

  explicit StorageMap(const Graph& g);
  const Value* root_of(const Value* v) const { return root.at(v); }
  bool is_free(const Value* v) const { return free.at(root_of(v)); }
};

/// Largest sum of live activation bytes over the steps of running `g`'s top-level nodes in
/// their current order. Graph inputs are live from the start to their last use, a result from
/// its node to its last use (through views), graph outputs to the end; a node's operands and
/// results are live together while it runs. Nodes inside regions count as their parent.
int64_t peak_activation_bytes(const Graph& g);
/// The same with the top-level nodes taken in `order` (a permutation of g's nodes).
int64_t peak_activation_bytes(const Graph& g, std::span<const Node* const> order);

}  // namespace kiln
