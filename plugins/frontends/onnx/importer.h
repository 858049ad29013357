// The ONNX importer: builds a Kiln graph from a ModelProto, node by node, folding constants.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <onnx/onnx_pb.h>

#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"
#include "onnx_tensor.h"

namespace kiln::onnx_fe {

class Importer;

/// One ONNX node being imported: its operands and attributes, and helpers that emit Kiln
/// nodes on its behalf. Errors made through it name the node, its op, domain and opset.
class NodeCtx {
 public:
  NodeCtx(Importer& imp, const onnx::NodeProto& proto, int opset, int depth)
      : imp(imp), proto(proto), opset(opset), depth(depth) {}

  Importer& imp;
  const onnx::NodeProto& proto;
  const int opset;  ///< the version of the node's domain the model imports
  const int depth;  ///< subgraph nesting depth of this node

  // --- operands and results
  int num_inputs() const { return proto.input_size(); }
  /// Input `i` is given (present and not the empty name).
  bool has_input(int i) const { return i < proto.input_size() && !proto.input(i).empty(); }
  /// The value of input `i`, or null when absent.
  Value* in(int i) const;
  int num_outputs() const { return proto.output_size(); }
  bool has_output(int i) const { return i < proto.output_size() && !proto.output(i).empty(); }
  /// Binds output `i` to `v` (ignored when the output is absent).
  Status out(int i, Value* v);

  // --- attributes
  const onnx::AttributeProto* attr(const std::string& name) const;
  bool has_attr(const std::string& name) const { return attr(name) != nullptr; }
  int64_t attr_int(const std::string& name, int64_t fallback) const;
  double attr_float(const std::string& name, double fallback) const;
  std::string attr_string(const std::string& name, const std::string& fallback) const;
  std::vector<int64_t> attr_ints(const std::string& name) const;
  std::vector<double> attr_floats(const std::string& name) const;
  StatusOr<Tensor> attr_tensor(const std::string& name) const;

  // --- constants known at import
  /// The tensor of a value produced by a `constant` node, else null.
  static const Tensor* constant_of(const Value* v);
  /// Input `i` as a constant; an error naming `role` when it is computed at run time.
  StatusOr<Tensor> const_input(int i, const std::string& role) const;
  StatusOr<std::vector<int64_t>> const_ints(int i, const std::string& role) const;
  StatusOr<std::vector<double>> const_floats(int i, const std::string& role) const;
  /// The all-static sizes of `v`; an error naming `role` when a dim is symbolic.
  StatusOr<std::vector<int64_t>> static_shape(const Value* v, const std::string& role) const;

  // --- emission
  /// Emits one Kiln node and returns its result; folds it when every operand is constant.
  StatusOr<Value*> op(const std::string& name, std::vector<Value*> operands, AttrMap attrs = {});
  /// Same, for ops with `n` results.
  StatusOr<std::vector<Value*>> op_n(const std::string& name, std::vector<Value*> operands,
                                     AttrMap attrs, int n);
  Value* constant(Tensor t);
  Value* scalar(DType t, double v);
  Value* ints(const std::vector<int64_t>& v);  ///< a 1-D i64 constant

  /// "onnx node 'name' (op Reshape, domain ai.onnx, opset 14): message".
  Status error(const std::string& message) const;
  Status error(StatusCode code, const std::string& message) const;
  std::string where() const;
};

/// Imports one ONNX node; registered per op type (see register_*_ops).
using OpHandler = Status (*)(NodeCtx&);

/// op type ("Add") or "domain/OpType" for other domains → handler.
using HandlerTable = std::unordered_map<std::string, OpHandler>;

void register_math_ops(HandlerTable& t);
void register_tensor_ops(HandlerTable& t);
void register_nn_ops(HandlerTable& t);
void register_misc_ops(HandlerTable& t);
/// Registers the ops this plugin defines for ONNX ops Kiln's core set lacks (idempotent).
Status register_extra_ops();

/// Whether input `index` of an ONNX op must be known at import (a shape, axes, a count).
bool needs_constant_input(const std::string& op_type, int opset, int index);

/// What `import` may be given beyond the file.
struct ImportOptions {
  ImportLimits limits;
  /// Values for graph inputs by name; an input whose value kiln needs at import (it reaches
  /// an operand that must be constant: a shape, axes, a count) is replaced by this constant,
  /// the others stay inputs.
  std::map<std::string, Tensor> input_values;
  /// Static sizes for named dims (dim_param): those inputs get static shapes, which lets
  /// shape computations on them fold.
  std::map<std::string, int64_t> dim_values;
  int64_t fold_limit_bytes = int64_t{1} << 28;  ///< largest constant made by folding
};

/// Builds Kiln graphs from ONNX models.
class Importer {
 public:
  Importer(std::shared_ptr<const onnx::ModelProto> model, std::string path, ImportOptions opts);

  /// Imports the whole model into a verified graph.
  StatusOr<std::unique_ptr<Graph>> run();

  /// Imports `body` inline: its inputs are bound to `inputs`, outer names stay visible, and
  /// the values of its outputs are returned (If branches, unrolled Loop/Scan iterations).
  StatusOr<std::vector<Value*>> inline_graph(const onnx::GraphProto& body,
                                             const std::vector<Value*>& inputs, int depth);

  Graph& graph() { return *graph_; }
  const ImportOptions& options() const { return opts_; }
  int opset(const std::string& domain) const;
  /// Emits a node (see NodeCtx::op_n).
  StatusOr<std::vector<Value*>> emit(const std::string& op, std::vector<Value*> operands,
                                     AttrMap attrs, int n);
  Value* make_constant(Tensor t);
  Value* lookup(const std::string& name) const;
  void bind(const std::string& name, Value* v);
  /// Converts a TensorProto found in the model (initializer, Constant, attribute).
  StatusOr<Tensor> tensor(const onnx::TensorProto& t, const std::string& what);

 private:
  struct Scope {
    std::unordered_map<std::string, Value*> values;
  };
  Status import_nodes(const onnx::GraphProto& g, int depth);
  Status import_node(const onnx::NodeProto& n, int depth);
  Status add_inputs(const onnx::GraphProto& g);
  Status set_outputs(const onnx::GraphProto& g);
  Status check_sizes(const onnx::GraphProto& g, int depth, int64_t& nodes) const;
  std::set<std::string> names_needed_constant(const onnx::GraphProto& g) const;

  std::shared_ptr<const onnx::ModelProto> model_;
  std::string path_;
  ImportOptions opts_;
  TensorSource src_;
  MappedFiles mapped_;
  std::map<std::string, int> opsets_;
  std::unique_ptr<Graph> graph_;
  std::vector<Scope> scopes_;
  int64_t node_index_ = 0;
};

/// Imports the model file at `path`.
StatusOr<std::unique_ptr<Graph>> import_onnx(const std::string& path, const ImportOptions& opts);

}  // namespace kiln::onnx_fe
