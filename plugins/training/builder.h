// Private to the kiln-training plugin: appends nodes to a graph with their types inferred, so
// gradient rules and optimizer updates read like the math they emit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/op.h"

namespace kiln::training {

/// Thrown by Builder when a node cannot be made (an op's shape rule refused it); the pass
/// entry points catch it and return its Status. Keeps each rule free of error plumbing.
struct BuildError {
  Status status;
};

/// Creates nodes at the end of one graph (or before `before`), each typed by its op's shape
/// rule. Every method throws BuildError instead of returning an invalid node.
class Builder {
 public:
  explicit Builder(Graph& g, Location loc = {}) : g_(g), loc_(std::move(loc)) {}

  Graph& graph() { return g_; }
  void set_loc(Location l) { loc_ = std::move(l); }
  /// Nodes go before `n` from now on (null: at the end).
  void set_insertion_point(Node* n) { before_ = n; }

  Value* op(const std::string& name, std::vector<Value*> operands, AttrMap attrs = {},
            const std::string& result_name = "");
  std::vector<Value*> op_n(const std::string& name, std::vector<Value*> operands, int num_results,
                           AttrMap attrs = {});

  Value* constant(Tensor t, const std::string& name = "");
  Value* scalar(double v, DType dtype);
  /// A zero-filled tensor of `like`'s (static) type.
  Value* zeros(const TensorType& like);

  Value* add(Value* a, Value* b) { return op("add", {a, b}); }
  Value* sub(Value* a, Value* b) { return op("sub", {a, b}); }
  Value* mul(Value* a, Value* b) { return op("mul", {a, b}); }
  Value* div(Value* a, Value* b) { return op("div", {a, b}); }
  Value* neg(Value* a) { return op("neg", {a}); }
  Value* mul(Value* a, double s) { return mul(a, scalar(s, a->dtype())); }
  Value* add(Value* a, double s) { return add(a, scalar(s, a->dtype())); }
  Value* unary(const std::string& name, Value* a) { return op(name, {a}); }
  Value* cast(Value* a, DType to);
  Value* where(Value* cond, Value* a, Value* b) { return op("where", {cond, a, b}); }
  Value* reshape(Value* a, const Shape& shape);
  Value* transpose(Value* a, std::vector<int64_t> perm);
  /// Swaps the last two dims.
  Value* transpose_last2(Value* a);
  Value* expand(Value* a, const Shape& shape);
  Value* reduce(const std::string& op, Value* a, std::vector<int64_t> axes, bool keepdims);
  Value* matmul(Value* a, Value* b) { return op("matmul", {a, b}); }
  /// Sums a broadcast gradient back to `shape` (the operand's shape before broadcasting).
  Value* sum_to(Value* g, const Shape& shape);

 private:
  Graph& g_;
  Location loc_;
  Node* before_ = nullptr;
};

/// Every dim of `s` as a static size; throws BuildError naming `what` when one is symbolic.
std::vector<int64_t> require_static(const Shape& s, const std::string& what);

}  // namespace kiln::training
