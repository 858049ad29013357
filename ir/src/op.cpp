// The op registry, schema checks shared by the verifier and interpreter, and type inference.
#include "kiln/ir/op.h"

#include <cstdlib>
#include <iostream>

#include "kiln/ir/walk.h"
#include "ops/ops.h"

namespace kiln {

Status InferContext::error(const std::string& message) const {
  return error_at(node.loc(), StatusCode::kInvalidArgument, node.op_name() + ": " + message);
}

Status KernelContext::error(const std::string& message) const {
  return error_at(node.loc(), StatusCode::kInvalidArgument, node.op_name() + ": " + message);
}

const AttrSpec* OpDef::find_attr(const std::string& n) const {
  for (const AttrSpec& a : attrs)
    if (a.name == n) return &a;
  return nullptr;
}

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

int OpDef::min_inputs() const {
  int n = 0;
  for (const auto& in : inputs)
    if (!ends_with(in, "?") && !ends_with(in, "...")) ++n;
  return n;
}

int OpDef::max_inputs() const {
  if (!inputs.empty() && ends_with(inputs.back(), "...")) return -1;
  return static_cast<int>(inputs.size());
}

int OpDef::fixed_outputs() const {
  for (const auto& out : outputs)
    if (ends_with(out, "...")) return -1;
  return static_cast<int>(outputs.size());
}

OpRegistry& OpRegistry::global() {
  static OpRegistry* registry = [] {
    auto* r = new OpRegistry();  // never destroyed: ops outlive every graph
    register_core_ops(*r);
    return r;
  }();
  return *registry;
}

Status OpRegistry::add(OpDef def) {
  std::string missing;
  if (def.name.empty()) missing += " name";
  if (def.summary.empty()) missing += " summary";
  if (def.result_rule.empty()) missing += " result_rule";
  if (!def.infer) missing += " infer";
  if (!def.reference) missing += " reference";
  if (!missing.empty())
    return invalid_argument("op '" + def.name + "' is incomplete; missing:" + missing);
  for (size_t i = 0; i < def.inputs.size(); ++i) {
    const std::string& in = def.inputs[i];
    if (ends_with(in, "...") && i + 1 != def.inputs.size())
      return invalid_argument("op '" + def.name + "': variadic input '" + in + "' must be last");
    if (!ends_with(in, "?") && !ends_with(in, "...") && i > 0 && ends_with(def.inputs[i - 1], "?"))
      return invalid_argument("op '" + def.name + "': required input '" + in +
                              "' follows an optional one");
  }
  if (ops_.count(def.name)) return already_exists("op '" + def.name + "' is already registered");
  def.library = current_library_;
  std::string name = def.name;
  ops_.emplace(std::move(name), std::make_unique<OpDef>(std::move(def)));
  return ok_status();
}

const OpDef* OpRegistry::find(const std::string& name) const {
  auto it = ops_.find(name);
  return it == ops_.end() ? nullptr : it->second.get();
}

std::vector<const OpDef*> OpRegistry::all() const {
  std::vector<const OpDef*> out;
  for (const auto& [name, def] : ops_) out.push_back(def.get());
  return out;
}

void register_core_ops(OpRegistry& r) {
  register_elementwise_ops(r);
  register_reduction_ops(r);
  register_creation_ops(r);
  register_linalg_ops(r);
  register_norm_ops(r);
  register_shape_ops(r);
  register_structural_ops(r);
  register_attention_ops(r);
  register_int4_ops(r);
  register_quant_ops(r);
  register_state_ops(r);
  register_collective_ops(r);
  register_loss_ops(r);
}

StatusOr<std::vector<TensorType>> infer_node_types(const Node& node,
                                                   std::vector<TensorType> operand_types) {
  const OpDef* def = node.op();
  auto fail = [&](const std::string& m) {
    return error_at(node.loc(), StatusCode::kInvalidArgument, node.op_name() + ": " + m);
  };
  if (!def) return fail("unknown op");
  const int n = static_cast<int>(operand_types.size());
  if (n < def->min_inputs() || (def->max_inputs() >= 0 && n > def->max_inputs())) {
    std::string expected = def->max_inputs() < 0
                               ? "at least " + std::to_string(def->min_inputs())
                               : (def->min_inputs() == def->max_inputs()
                                      ? std::to_string(def->min_inputs())
                                      : std::to_string(def->min_inputs()) + " to " +
                                            std::to_string(def->max_inputs()));
    return fail("expected " + expected + " operands, got " + std::to_string(n));
  }
  if (def->fixed_outputs() >= 0 && node.num_results() != def->fixed_outputs())
    return fail("expected " + std::to_string(def->fixed_outputs()) + " results, got " +
                std::to_string(node.num_results()));
  if (node.num_regions() != def->num_regions)
    return fail("expected " + std::to_string(def->num_regions) + " regions, got " +
                std::to_string(node.num_regions()));
  for (const auto& [name, value] : node.attrs()) {
    const AttrSpec* spec = def->find_attr(name);
    if (!spec && is_annotation(name)) continue;
    if (!spec) return fail("unknown attribute '" + name + "'");
    if (!value.convertible_to(spec->kind))
      return fail("attribute '" + name + "' must be " + attr_kind_name(spec->kind) + ", got " +
                  attr_kind_name(value.kind()));
  }
  for (const AttrSpec& spec : def->attrs)
    if (spec.required && !node.has_attr(spec.name))
      return fail("missing required attribute '" + spec.name + "'");
  InferContext ctx{node, std::move(operand_types), {}};
  KILN_RETURN_IF_ERROR(def->infer(ctx));
  if (static_cast<int>(ctx.results.size()) != node.num_results())
    return fail("shape rule produced " + std::to_string(ctx.results.size()) + " types for " +
                std::to_string(node.num_results()) + " results");
  return std::move(ctx.results);
}

Status infer_types(Graph& g) {
  auto infer = [](Node& n) -> Status {
    std::vector<TensorType> ops;
    for (Value* v : n.operands()) ops.push_back(v->type());
    KILN_ASSIGN_OR_RETURN(auto types, infer_node_types(n, std::move(ops)));
    for (int i = 0; i < n.num_results(); ++i) n.result(i)->set_type(types[static_cast<size_t>(i)]);
    return ok_status();
  };
  // Post-order: a fused node's shape rule reads the types its region's nodes were given.
  return walk(g, infer, {.order = WalkOrder::kPostOrder});
}

}  // namespace kiln
