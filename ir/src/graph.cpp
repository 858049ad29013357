// Values, nodes and graphs: construction, use lists, mutation and cloning.
#include "kiln/ir/graph.h"

#include <algorithm>
#include <unordered_map>

#include "kiln/ir/op.h"

namespace kiln {
namespace {

void remove_use(Value* v, Use u) {
  auto& uses = v->uses();
  auto& mutable_uses = const_cast<std::vector<Use>&>(uses);
  auto it = std::find(mutable_uses.begin(), mutable_uses.end(), u);
  if (it != mutable_uses.end()) mutable_uses.erase(it);
}

}  // namespace

// ---- Value -------------------------------------------------------------------------------

void Value::replace_all_uses_with(Value* other) {
  if (other == this) return;
  const std::vector<Use> uses = uses_;
  for (const Use& u : uses) {
    if (u.user) u.user->set_operand(u.index, other);
    else graph_->set_output(u.index, other);
  }
}

// ---- Node --------------------------------------------------------------------------------

Node::Node(Graph* graph, const OpDef* op, std::string op_name)
    : graph_(graph), op_(op), op_name_(std::move(op_name)) {}

Node::~Node() = default;

void Node::set_operand(int i, Value* v) {
  Value*& slot = operands_[static_cast<size_t>(i)];
  if (slot) remove_use(slot, Use{this, i});
  slot = v;
  if (v) v->uses_.push_back(Use{this, i});
}

void Node::set_operands(std::vector<Value*> vs) {
  for (int i = 0; i < num_operands(); ++i)
    if (operands_[static_cast<size_t>(i)]) remove_use(operands_[static_cast<size_t>(i)], Use{this, i});
  operands_.assign(vs.size(), nullptr);
  for (size_t i = 0; i < vs.size(); ++i) set_operand(static_cast<int>(i), vs[i]);
}

std::vector<Value*> Node::results() const {
  std::vector<Value*> out;
  for (const auto& r : results_) out.push_back(r.get());
  return out;
}

const Attribute* Node::attr(const std::string& name) const {
  auto it = attrs_.find(name);
  return it == attrs_.end() ? nullptr : &it->second;
}

namespace {
const Attribute* attr_or_default(const Node& n, const std::string& name) {
  if (const Attribute* a = n.attr(name)) return a;
  if (n.op())
    if (const AttrSpec* s = n.op()->find_attr(name))
      if (s->default_value) return &*s->default_value;
  return nullptr;
}
}  // namespace

int64_t Node::get_int(const std::string& name, int64_t fallback) const {
  const Attribute* a = attr_or_default(*this, name);
  return a && a->kind() == AttrKind::kInt ? a->as_int() : fallback;
}

double Node::get_float(const std::string& name, double fallback) const {
  const Attribute* a = attr_or_default(*this, name);
  return a && a->convertible_to(AttrKind::kFloat) ? a->as_float() : fallback;
}

std::string Node::get_string(const std::string& name, const std::string& fallback) const {
  const Attribute* a = attr_or_default(*this, name);
  return a && a->kind() == AttrKind::kString ? a->as_string() : fallback;
}

std::vector<int64_t> Node::get_ints(const std::string& name, std::vector<int64_t> fallback) const {
  const Attribute* a = attr_or_default(*this, name);
  if (!a) return fallback;
  if (a->kind() == AttrKind::kInts) return a->as_ints();
  if (a->convertible_to(AttrKind::kInts)) return {};
  return fallback;
}

std::vector<double> Node::get_floats(const std::string& name, std::vector<double> fallback) const {
  const Attribute* a = attr_or_default(*this, name);
  return a && a->convertible_to(AttrKind::kFloats) ? a->converted_to(AttrKind::kFloats).as_floats()
                                                   : fallback;
}

Graph& Node::add_region(std::string name) {
  return add_region(std::make_unique<Graph>(name.empty() ? "region" + std::to_string(regions_.size())
                                                         : std::move(name)));
}

Graph& Node::add_region(std::unique_ptr<Graph> g) {
  g->parent_ = this;
  regions_.push_back(std::move(g));
  return *regions_.back();
}

// ---- Graph -------------------------------------------------------------------------------

const DeviceMesh& Graph::mesh() const {
  const Graph* g = this;
  while (g->parent_ && g->parent_->graph_) g = g->parent_->graph_;
  return g->mesh_;
}

Graph::~Graph() {
  // Drop nodes last-to-first so no node outlives the values it uses.
  outputs_.clear();
  while (!nodes_.empty()) nodes_.pop_back();
}

std::vector<Value*> Graph::inputs() const {
  std::vector<Value*> out;
  for (const auto& v : inputs_) out.push_back(v.get());
  return out;
}

Value* Graph::add_input(std::string name, TensorType type) {
  inputs_.push_back(std::make_unique<Value>(this, nullptr, num_inputs(), std::move(type),
                                            std::move(name)));
  return inputs_.back().get();
}

Status Graph::erase_input(int i) {
  if (i < 0 || i >= num_inputs()) return out_of_range("graph input index out of range");
  if (input(i)->has_uses())
    return failed_precondition("cannot erase graph input %" + input(i)->name() + ": it has uses");
  inputs_.erase(inputs_.begin() + i);
  for (int k = i; k < num_inputs(); ++k) inputs_[static_cast<size_t>(k)]->index_ = k;
  return ok_status();
}

void Graph::set_outputs(std::vector<Value*> outs, std::vector<std::string> names) {
  for (int i = 0; i < num_outputs(); ++i)
    if (outputs_[static_cast<size_t>(i)]) remove_use(outputs_[static_cast<size_t>(i)], Use{nullptr, i});
  outputs_.assign(outs.size(), nullptr);
  names.resize(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    if (names[i].empty() && outs[i]) names[i] = outs[i]->name();
    set_output(static_cast<int>(i), outs[i]);
  }
  output_names_ = std::move(names);
}

void Graph::set_output(int i, Value* v) {
  Value*& slot = outputs_[static_cast<size_t>(i)];
  if (slot) remove_use(slot, Use{nullptr, i});
  slot = v;
  if (v) v->uses_.push_back(Use{nullptr, i});
}

std::vector<Node*> Graph::node_list() const {
  std::vector<Node*> out;
  out.reserve(nodes_.size());
  for (const auto& n : nodes_) out.push_back(n.get());
  return out;
}

StatusOr<Node*> Graph::create_node(const std::string& op, std::vector<Value*> operands,
                                   std::vector<TensorType> result_types, AttrMap attrs,
                                   Node* before, std::vector<std::string> result_names) {
  const OpDef* def = OpRegistry::global().find(op);
  if (!def) return not_found("unknown op '" + op + "'");
  for (size_t i = 0; i < operands.size(); ++i) {
    if (!operands[i]) return invalid_argument(op + ": operand " + std::to_string(i) + " is null");
    if (operands[i]->graph() != this)
      return invalid_argument(op + ": operand " + std::to_string(i) +
                              " belongs to another graph (regions are isolated)");
  }
  std::unique_ptr<Node> node(new Node(this, def, op));
  node->attrs_ = std::move(attrs);
  for (size_t i = 0; i < result_types.size(); ++i) {
    std::string name = i < result_names.size() ? result_names[i] : std::string();
    node->results_.push_back(std::make_unique<Value>(this, node.get(), static_cast<int>(i),
                                                     std::move(result_types[i]), std::move(name)));
  }
  node->set_operands(std::move(operands));
  Node* raw = node.get();
  auto pos = (before && before->graph_ == this) ? before->self_ : nodes_.end();
  raw->self_ = nodes_.insert(pos, std::move(node));
  return raw;
}

Status Graph::erase_node(Node* n) {
  for (int i = 0; i < n->num_results(); ++i)
    if (n->result(i)->has_uses())
      return failed_precondition("cannot erase '" + n->op_name() + "': result " +
                                 std::to_string(i) + " still has uses");
  if (n->graph_ != this) return not_found("node is not in this graph");
  for (int i = 0; i < n->num_operands(); ++i) n->set_operand(i, nullptr);
  nodes_.erase(n->self_);
  return ok_status();
}

void Graph::move_node_before(Node* n, Node* before) {
  if (n->graph_ != this || n == before) return;
  auto pos = (before && before->graph_ == this) ? before->self_ : nodes_.end();
  nodes_.splice(pos, nodes_, n->self_);  // splice keeps iterators valid
}

std::unique_ptr<Graph> Graph::clone() const {
  auto g = std::make_unique<Graph>(name_);
  g->mesh_ = mesh_;
  g->per_rank_ = per_rank_;
  std::unordered_map<const Value*, Value*> map;
  for (const auto& in : inputs_) {
    map[in.get()] = g->add_input(in->name(), in->type());
    map[in.get()]->set_sharding(in->sharding());
  }
  for (const auto& n : nodes_) {
    std::unique_ptr<Node> copy(new Node(g.get(), n->op_, n->op_name_));
    copy->attrs_ = n->attrs_;
    copy->loc_ = n->loc_;
    for (const auto& r : n->results_) {
      copy->results_.push_back(
          std::make_unique<Value>(g.get(), copy.get(), r->index(), r->type(), r->name()));
      copy->results_.back()->sharding_ = r->sharding_;
      map[r.get()] = copy->results_.back().get();
    }
    std::vector<Value*> ops;
    for (Value* v : n->operands_) ops.push_back(v ? map.at(v) : nullptr);
    copy->set_operands(std::move(ops));
    for (const auto& region : n->regions_) copy->add_region(region->clone());
    Node* raw = copy.get();
    raw->self_ = g->nodes_.insert(g->nodes_.end(), std::move(copy));
  }
  std::vector<Value*> outs;
  for (Value* v : outputs_) outs.push_back(v ? map.at(v) : nullptr);
  g->set_outputs(std::move(outs), output_names_);
  return g;
}

void Graph::take_contents(Graph& other) {
  if (&other == this) return;
  set_outputs({});
  while (!nodes_.empty()) nodes_.pop_back();
  inputs_ = std::move(other.inputs_);
  nodes_ = std::move(other.nodes_);  // list iterators (Node::self_) stay valid
  outputs_ = std::move(other.outputs_);
  output_names_ = std::move(other.output_names_);
  mesh_ = std::move(other.mesh_);
  per_rank_ = other.per_rank_;
  other.inputs_.clear();
  other.nodes_.clear();
  other.outputs_.clear();
  other.output_names_.clear();
  for (auto& in : inputs_) in->graph_ = this;
  for (auto& n : nodes_) {
    n->graph_ = this;
    for (auto& r : n->results_) r->graph_ = this;
  }
}

int64_t Graph::total_node_count() const {
  int64_t n = 0;
  for (const auto& node : nodes_) {
    ++n;
    for (int i = 0; i < node->num_regions(); ++i) n += node->region(i).total_node_count();
  }
  return n;
}

const Tensor* constant_tensor(const Value* v) {
  const Node* p = v ? v->producer() : nullptr;
  if (p == nullptr || p->op_name() != "constant") return nullptr;
  const Attribute* a = p->attr("value");
  return a && a->kind() == AttrKind::kTensor ? &a->as_tensor() : nullptr;
}

}  // namespace kiln
