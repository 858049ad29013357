// Persistent state core ops: variable (a value kept across runs) and assign (its next value),
// plus the graph-wide checks the verifier runs on them.
//
// Semantics: every read of a variable in one run sees the value it had before the run (its
// `init` on the first run); an assign takes effect after the run, for the next one. So the
// position of an assign among the readers of its variable does not matter, and a backend may
// apply all assigns at the very end of its plan.
#include <cstring>
#include <map>
#include <string>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/walk.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

/// The `name` attribute, required non-empty.
StatusOr<std::string> state_name(const InferContext& ctx) {
  const std::string name = ctx.node.get_string("name");
  if (name.empty()) return ctx.error("attribute 'name' must not be empty");
  return name;
}

Status variable_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(state_name(ctx).status());
  const Attribute* init = ctx.node.attr("init");
  if (init == nullptr) return ctx.error("missing required attribute 'init'");
  ctx.results = {init->as_tensor().type()};
  return ok_status();
}

Status variable_kernel(KernelContext& ctx) {
  const std::string name = ctx.node.get_string("name");
  const Tensor& init = ctx.node.attr("init")->as_tensor();
  const Tensor* held = ctx.interpreter.variable_value(name);
  if (held == nullptr) {
    ctx.output() = init;  // storage is shared: no copy
    return ok_status();
  }
  if (held->type() != init.type())
    return ctx.error("state '" + name + "' holds " + held->type().str() + " but the variable is " +
                     init.type().str());
  ctx.output() = *held;
  return ok_status();
}

Status assign_infer(InferContext& ctx) {
  KILN_RETURN_IF_ERROR(state_name(ctx).status());
  ctx.results = {};
  return ok_status();
}

Status assign_kernel(KernelContext& ctx) {
  const std::string name = ctx.node.get_string("name");
  const Tensor* held = ctx.interpreter.variable_value(name);
  if (held != nullptr && held->type() != ctx.input(0).type())
    return ctx.error("value is " + ctx.input(0).type().str() + " but state '" + name + "' holds " +
                     held->type().str());
  // An owned copy: an executor may hand kernels views of buffers it reuses (cpu-llvm's arena).
  const Tensor& x = ctx.input(0);
  Tensor value(x.dtype(), x.shape());
  if (x.nbytes() > 0) std::memcpy(value.mutable_data(), x.data(), x.nbytes());
  ctx.interpreter.stage_assign(name, std::move(value));
  return ok_status();
}

Status state_error(const Node& n, const std::string& message) {
  return error_at(n.loc(), StatusCode::kInvalidArgument, n.op_name() + ": " + message);
}

/// Refuses variable/assign nested in a region of `g`: fused bodies and the like are pure.
Status no_state_in_regions(const Graph& g) {
  return walk(g, [&](const Node& n) -> Status {
    if (n.graph() != &g && (n.op_name() == "variable" || n.op_name() == "assign"))
      return state_error(n, "'" + n.get_string("name") + "' must be in the top-level graph, not in region @" +
                                n.graph()->name());
    return ok_status();
  });
}

}  // namespace

Status verify_state(const Graph& g) {
  std::map<std::string, const Node*> vars, assigns;
  KILN_RETURN_IF_ERROR(no_state_in_regions(g));
  for (const auto& n : g.nodes())
    if (n->op_name() == "variable" && !vars.emplace(n->get_string("name"), n.get()).second)
      return state_error(*n, "name '" + n->get_string("name") + "' is used by another variable");
  for (const auto& n : g.nodes()) {
    if (n->op_name() != "assign") continue;
    const std::string name = n->get_string("name");
    auto v = vars.find(name);
    if (v == vars.end()) return state_error(*n, "no variable named '" + name + "'");
    if (!assigns.emplace(name, n.get()).second)
      return state_error(*n, "variable '" + name + "' is assigned more than once");
    const TensorType& want = v->second->result()->type();
    if (n->operand(0)->type() != want)
      return state_error(*n, "value is " + n->operand(0)->type().str() + " but variable '" + name + "' is " +
                                 want.str());
  }
  return ok_status();
}

void register_state_ops(OpRegistry& r) {
  add_op_or_die(r, {.name = "variable",
                    .summary = "a value kept across runs: init on the first run, then what assign gave it",
                    .traits = kTraitSideEffects,
                    .inputs = {},
                    .outputs = {"y"},
                    .result_rule = "the type of `init`",
                    .attrs = {attr_required("name", AttrKind::kString, "unique per graph; assign refers to it"),
                              attr_required("init", AttrKind::kTensor, "value on the first run (fixes dtype and shape)")},
                    .num_regions = 0,
                    .infer = variable_infer,
                    .reference = variable_kernel});
  add_op_or_die(r, {.name = "assign",
                    .summary = "gives variable `name` the value x for the next run (reads in this run see the old one)",
                    .traits = kTraitSideEffects,
                    .inputs = {"x"},
                    .outputs = {},
                    .result_rule = "no results",
                    .attrs = {attr_required("name", AttrKind::kString, "the variable assigned")},
                    .num_regions = 0,
                    .infer = assign_infer,
                    .reference = assign_kernel});
}

}  // namespace kiln
