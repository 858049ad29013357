// Op definitions: one declaration per op carrying its schema, shape rule and reference kernel.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kiln/ir/attribute.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/shape.h"
#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln {

/// Properties passes and backends key on.
enum OpTrait : uint32_t {
  kTraitNone = 0,
  kTraitElementwise = 1u << 0,   ///< out[i] depends on in[i] only (after broadcasting)
  kTraitBroadcast = 1u << 1,     ///< operands broadcast numpy-style
  kTraitReduction = 1u << 2,     ///< reduces along axes (sum, softmax, norms)
  kTraitView = 1u << 3,          ///< moves data without arithmetic (reshape, transpose, slice)
  kTraitCommutative = 1u << 4,   ///< binary op with f(a, b) == f(b, a)
  kTraitContraction = 1u << 5,   ///< matmul-like (matmul, linear, conv)
  kTraitConstant = 1u << 6,      ///< no operands; value fixed at compile time
  kTraitHasRegions = 1u << 7,    ///< holds nested graphs
  kTraitSideEffects = 1u << 8,   ///< must not be removed, merged, folded or reordered (variable, assign)
};

/// One attribute an op accepts.
struct AttrSpec {
  std::string name;
  AttrKind kind;
  bool required = false;
  std::optional<Attribute> default_value;  ///< used by Node::get_* when absent
  std::string doc;
};

/// What an op's shape rule sees: the node (attributes, regions, location) and operand types
/// (which may be more concrete than the node's operand values' types, e.g. in the interpreter).
/// The rule fills `results` (one TensorType per result the node has) or returns an error.
struct InferContext {
  const Node& node;
  std::vector<TensorType> operands;
  std::vector<TensorType> results;

  /// A located error: "file:line:col: 'op': message".
  Status error(const std::string& message) const;
  const TensorType& operand(int i) const { return operands[static_cast<size_t>(i)]; }
  int num_operands() const { return static_cast<int>(operands.size()); }
  int num_results() const { return node.num_results(); }
};

class Interpreter;

/// What a reference kernel sees. Outputs are allocated by the interpreter from the shape
/// rule run on the concrete input shapes; the kernel fills them.
struct KernelContext {
  const Node& node;
  std::span<const Tensor> inputs;
  std::span<Tensor> outputs;
  Interpreter& interpreter;  ///< for ops with regions (fused): run a nested graph

  const Tensor& input(int i) const { return inputs[static_cast<size_t>(i)]; }
  Tensor& output(int i = 0) const { return outputs[static_cast<size_t>(i)]; }
  int num_inputs() const { return static_cast<int>(inputs.size()); }
  Status error(const std::string& message) const;
};

using InferFn = std::function<Status(InferContext&)>;
using ReferenceFn = std::function<Status(KernelContext&)>;

/// The single definition of an op. Every field marked required must be set; registration
/// refuses an incomplete definition, naming what is missing.
struct OpDef {
  std::string name;            ///< required; lowercase snake_case, e.g. "layer_norm"
  std::string summary;         ///< required; one line
  uint32_t traits = kTraitNone;
  /// Operand names, in order. "name?" is optional (may be absent at the end),
  /// "name..." is variadic (zero or more; only last).
  std::vector<std::string> inputs;
  /// Result names; "name..." means the node decides how many results (e.g. split).
  std::vector<std::string> outputs;
  /// required; the shape rule in one line, for people: "same as x", "broadcast of a and b",
  /// "[.., M, N] from a[.., M, K] x b[.., K, N]". Shown by `kiln ops` and docs/ops.md.
  std::string result_rule;
  std::vector<AttrSpec> attrs;
  int num_regions = 0;
  InferFn infer;               ///< required: verify operands/attributes, compute result types
  ReferenceFn reference;       ///< required: the CPU oracle
  /// The plugin library that registered the op ("" = Kiln's core set). Set by the registry;
  /// the initializer lets definitions leave it out without a missing-initializer warning.
  std::string library{};

  bool has(OpTrait t) const { return (traits & t) != 0; }
  const AttrSpec* find_attr(const std::string& n) const;
  /// Allowed operand count range; max = -1 means unbounded.
  int min_inputs() const;
  int max_inputs() const;
  /// Fixed number of results, or -1 when variadic.
  int fixed_outputs() const;
};

/// All known ops, core and plugin-defined. Thread-compatible: register at start-up.
class OpRegistry {
 public:
  /// The process-wide registry, with the core op set already registered.
  static OpRegistry& global();

  /// Adds an op; fails on a duplicate name or an incomplete definition.
  Status add(OpDef def);
  const OpDef* find(const std::string& name) const;
  std::vector<const OpDef*> all() const;  ///< sorted by name
  size_t size() const { return ops_.size(); }

  /// The library path stamped on ops added from now on ("" = core). Whoever loads a plugin
  /// library sets it around the library's register function.
  void set_current_library(std::string path) { current_library_ = std::move(path); }

 private:
  std::map<std::string, std::unique_ptr<OpDef>> ops_;
  std::string current_library_;
};

/// Registers Kiln's core op set into `r` (called once by OpRegistry::global()).
void register_core_ops(OpRegistry& r);

/// Checks a node's operand count, attributes against the schema (unknown names, kinds,
/// required ones), region count, then runs the shape rule and returns the result types.
/// Used by the verifier and the interpreter.
StatusOr<std::vector<TensorType>> infer_node_types(const Node& node,
                                                   std::vector<TensorType> operand_types);

/// Re-infers result types of every node in order and stores them (after a pass that
/// changed shapes). Fails like the verifier.
Status infer_types(Graph& g);

}  // namespace kiln
