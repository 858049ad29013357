// SSA values, nodes and graphs. A node may hold nested graphs (regions): fused groups,
// control flow. Regions are isolated: they see only their own inputs, never outer values.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "kiln/ir/attribute.h"
#include "kiln/ir/placement.h"
#include "kiln/ir/shape.h"
#include "kiln/ir/status.h"

namespace kiln {

class Graph;
class Node;
struct OpDef;

/// One use of a value: operand `index` of `user`, or graph output `index` when user is null.
struct Use {
  Node* user = nullptr;
  int index = 0;
  bool operator==(const Use& o) const { return user == o.user && index == o.index; }
};

/// An SSA value: a graph input or a node result. Owned by its graph or its node.
class Value {
 public:
  Value(Graph* graph, Node* producer, int index, TensorType type, std::string name)
      : graph_(graph), producer_(producer), index_(index), type_(std::move(type)),
        name_(std::move(name)) {}
  Value(const Value&) = delete;
  Value& operator=(const Value&) = delete;

  /// Name without the leading '%'; may be empty (the printer then invents one).
  const std::string& name() const { return name_; }
  void set_name(std::string n) { name_ = std::move(n); }
  const TensorType& type() const { return type_; }
  void set_type(TensorType t) { type_ = std::move(t); }
  DType dtype() const { return type_.dtype; }
  const Shape& shape() const { return type_.shape; }
  /// How the value is laid out over the graph's device mesh (empty: not annotated). Printed as
  /// part of the type (`f32[8, 64]<S(0), R>`); shape rules neither read nor set it.
  const Sharding& sharding() const { return sharding_; }
  void set_sharding(Sharding s) { sharding_ = std::move(s); }

  /// The node computing this value, or null for a graph input.
  Node* producer() const { return producer_; }
  bool is_graph_input() const { return producer_ == nullptr; }
  /// Result index within the producer, or input index within the graph.
  int index() const { return index_; }
  Graph* graph() const { return graph_; }

  const std::vector<Use>& uses() const { return uses_; }
  bool has_uses() const { return !uses_.empty(); }
  /// Points every use (node operands and graph outputs) at `other` instead.
  void replace_all_uses_with(Value* other);

 private:
  friend class Node;
  friend class Graph;
  Graph* graph_;
  Node* producer_;
  int index_;
  TensorType type_;
  std::string name_;
  Sharding sharding_;
  std::vector<Use> uses_;
};

/// One operation: an op name, operands, results, attributes and optional regions.
class Node {
 public:
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;
  ~Node();

  const std::string& op_name() const { return op_name_; }
  /// The op definition (never null for nodes built through Graph::create_node or the parser).
  const OpDef* op() const { return op_; }
  Graph* graph() const { return graph_; }

  int num_operands() const { return static_cast<int>(operands_.size()); }
  Value* operand(int i) const { return operands_[static_cast<size_t>(i)]; }
  const std::vector<Value*>& operands() const { return operands_; }
  void set_operand(int i, Value* v);
  void set_operands(std::vector<Value*> vs);

  int num_results() const { return static_cast<int>(results_.size()); }
  Value* result(int i = 0) const { return results_[static_cast<size_t>(i)].get(); }
  std::vector<Value*> results() const;

  const AttrMap& attrs() const { return attrs_; }
  bool has_attr(const std::string& name) const { return attrs_.count(name) != 0; }
  const Attribute* attr(const std::string& name) const;
  void set_attr(const std::string& name, Attribute a) { attrs_[name] = std::move(a); }
  void erase_attr(const std::string& name) { attrs_.erase(name); }
  /// Typed getters returning the attribute, else the op's declared default, else `fallback`.
  int64_t get_int(const std::string& name, int64_t fallback = 0) const;
  double get_float(const std::string& name, double fallback = 0.0) const;
  std::string get_string(const std::string& name, const std::string& fallback = "") const;
  std::vector<int64_t> get_ints(const std::string& name, std::vector<int64_t> fallback = {}) const;
  std::vector<double> get_floats(const std::string& name, std::vector<double> fallback = {}) const;

  int num_regions() const { return static_cast<int>(regions_.size()); }
  Graph& region(int i) const { return *regions_[static_cast<size_t>(i)]; }
  /// Adds an empty region owned by this node and returns it.
  Graph& add_region(std::string name = "");
  /// Takes ownership of an existing graph as a new region.
  Graph& add_region(std::unique_ptr<Graph> g);

  const Location& loc() const { return loc_; }
  void set_loc(Location l) { loc_ = std::move(l); }

 private:
  friend class Graph;
  Node(Graph* graph, const OpDef* op, std::string op_name);
  Graph* graph_;
  const OpDef* op_;
  std::string op_name_;
  std::vector<Value*> operands_;
  std::vector<std::unique_ptr<Value>> results_;
  AttrMap attrs_;
  std::vector<std::unique_ptr<Graph>> regions_;
  Location loc_;
  std::list<std::unique_ptr<Node>>::iterator self_;  // position in graph_->nodes_, for O(1) erase
};

/// A graph: inputs, nodes in a topological order, outputs. Owns its values and nodes.
class Graph {
 public:
  explicit Graph(std::string name = "main") : name_(std::move(name)) {}
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph();

  const std::string& name() const { return name_; }
  void set_name(std::string n) { name_ = std::move(n); }
  /// The node owning this graph as a region, or null for a top-level graph.
  Node* parent_node() const { return parent_; }

  /// The device mesh a parallel program runs on (empty for a single-device graph). Regions
  /// have none of their own: mesh() of a region is its top-level graph's.
  const DeviceMesh& mesh() const;
  void set_mesh(DeviceMesh m) { mesh_ = std::move(m); }
  /// True once the graph is the program of one rank: value types are per-rank (local) shapes,
  /// data moves between ranks only through collective ops, and each value's sharding says how
  /// its local piece sits in the global value. False for the global view, where types are
  /// whole-tensor shapes and shardings are what a partitioner is asked to produce.
  bool is_per_rank() const { return per_rank_; }
  void set_per_rank(bool v) { per_rank_ = v; }

  int num_inputs() const { return static_cast<int>(inputs_.size()); }
  Value* input(int i) const { return inputs_[static_cast<size_t>(i)].get(); }
  std::vector<Value*> inputs() const;
  Value* add_input(std::string name, TensorType type);
  /// Removes an input that has no uses; later inputs shift down.
  Status erase_input(int i);

  int num_outputs() const { return static_cast<int>(outputs_.size()); }
  Value* output(int i) const { return outputs_[static_cast<size_t>(i)]; }
  const std::vector<Value*>& outputs() const { return outputs_; }
  /// Replaces every output. Output i is named `names[i]` when given, else after its value.
  void set_outputs(std::vector<Value*> outs, std::vector<std::string> names = {});
  /// Points output i at `v`. The output keeps its name: callers bind outputs by name, so a
  /// pass that computes an output by another value must not rename it.
  void set_output(int i, Value* v);
  /// The name callers know output i by (may be empty for graphs built without names). It is
  /// part of the graph's interface, independent of the name of the value it returns.
  const std::string& output_name(int i) const { return output_names_[static_cast<size_t>(i)]; }
  const std::vector<std::string>& output_names() const { return output_names_; }
  void set_output_name(int i, std::string name) { output_names_[static_cast<size_t>(i)] = std::move(name); }

  /// Nodes in execution order. Iterators stay valid across insertions and other erasures.
  const std::list<std::unique_ptr<Node>>& nodes() const { return nodes_; }
  /// A snapshot of the node pointers, safe to iterate while mutating the graph.
  std::vector<Node*> node_list() const;
  int num_nodes() const { return static_cast<int>(nodes_.size()); }

  /// Creates a node of a registered op. Inserted before `before`, or at the end when null.
  /// Fails when the op name is not registered. Result types are taken as given; call
  /// infer_types / verify to check them.
  StatusOr<Node*> create_node(const std::string& op, std::vector<Value*> operands,
                              std::vector<TensorType> result_types, AttrMap attrs = {},
                              Node* before = nullptr, std::vector<std::string> result_names = {});
  /// Removes a node whose results have no uses (drops its operand uses).
  Status erase_node(Node* n);
  /// Moves `n` to just before `before` (or to the end when null).
  void move_node_before(Node* n, Node* before);

  /// Deep copy (values, nodes, attributes, regions). Tensor storage is shared.
  std::unique_ptr<Graph> clone() const;
  /// Replaces this graph's inputs, nodes, outputs, mesh and per-rank flag with `other`'s,
  /// leaving `other` empty; the name stays. For passes that rebuild a graph wholesale.
  void take_contents(Graph& other);

  /// Total number of nodes including those inside regions.
  int64_t total_node_count() const;

 private:
  friend class Node;
  std::string name_;
  Node* parent_ = nullptr;
  DeviceMesh mesh_;
  bool per_rank_ = false;
  std::vector<std::unique_ptr<Value>> inputs_;
  std::vector<Value*> outputs_;
  std::vector<std::string> output_names_;  // parallel to outputs_
  std::list<std::unique_ptr<Node>> nodes_;
};

/// The tensor of `v` when a `constant` node produces it; null otherwise (also for null `v`).
const Tensor* constant_tensor(const Value* v);

}  // namespace kiln
