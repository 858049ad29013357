// Persistent state core ops: variable (a value kept across runs) and assign (its next value),
// plus the graph-wide checks the verifier runs on them.
//
// Semantics: every read of a variable in one run sees the value it had before the run (its
// `init` on the first run); an assign takes effect after the run, for the next one. So the
// position of an assign among the readers of its variable does not matter, and a backend may
// apply all assigns at the very end of its plan.
//
// A variable may be a copy of another (`copy_of`): the low-precision weight an optimizer keeps
// next to its f32 master, assigned from the same update, so that the next step's forward reads
// it instead of converting the master again. Its value is a function of the master's (and of a
// scale variable's, for f8), so whoever sets state sets the master and the copies follow
// (complete_state_copies).
#include <cstring>
#include <functional>
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

bool is_f8(DType t) { return t == DType::kF8E4M3FN || t == DType::kF8E5M2; }

/// A copy's master and scale must be variables of the graph, of the copy's shape, not copies
/// themselves; assigned masters must have assigned copies (else the copy goes stale each step).
Status verify_copy(const Node& copy, const std::map<std::string, const Node*>& vars,
                   const std::map<std::string, const Node*>& assigns) {
  const std::string master = copy.get_string("copy_of"), scale = copy.get_string("copy_scale");
  const std::string name = copy.get_string("name");
  if (master.empty()) {
    if (!scale.empty()) return state_error(copy, "'" + name + "' has copy_scale without copy_of");
    return ok_status();
  }
  auto m = vars.find(master);
  if (m == vars.end() || master == name)
    return state_error(copy, "'" + name + "' is a copy of '" + master + "', which is no other variable of the graph");
  if (!m->second->get_string("copy_of").empty())
    return state_error(copy, "'" + name + "' is a copy of '" + master + "', itself a copy");
  const TensorType &t = copy.result()->type(), &mt = m->second->result()->type();
  if (t.shape != mt.shape || !is_float(mt.dtype) || is_f8(mt.dtype))
    return state_error(copy, "'" + name + "' (" + t.str() + ") cannot be a copy of '" + master + "' (" + mt.str() + ")");
  if (is_f8(t.dtype) != !scale.empty())
    return state_error(copy, "'" + name + "': an f8 copy takes its scale from a variable (copy_scale), other copies none");
  if (!scale.empty()) {
    auto s = vars.find(scale);
    if (s == vars.end() || s->second->result()->type() != TensorType{DType::kF32, {}})
      return state_error(copy, "'" + name + "': copy_scale '" + scale + "' is no f32[] variable of the graph");
  } else if (!is_float(t.dtype)) {
    return state_error(copy, "'" + name + "' (" + t.str() + ") cannot be a copy of '" + master + "': not a float");
  }
  if (assigns.count(master) && !assigns.count(name))
    return state_error(copy, "'" + name + "' is a copy of '" + master + "', which is assigned while the copy is not");
  return ok_status();
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
  for (const auto& [name, v] : vars) KILN_RETURN_IF_ERROR(verify_copy(*v, vars, assigns));
  return ok_status();
}

std::string state_copy_master(const Node& variable) { return variable.get_string("copy_of"); }

Status complete_state_copies(const Graph& g, std::map<std::string, Tensor>& values,
                             const std::function<Tensor(const std::string&)>& current) {
  for (const auto& n : g.nodes()) {
    if (n->op_name() != "variable" || n->get_string("copy_of").empty()) continue;
    const std::string name = n->get_string("name"), master = n->get_string("copy_of");
    const std::string scale = n->get_string("copy_scale");
    auto m = values.find(master);
    const bool scale_set = !scale.empty() && values.count(scale);
    if (m == values.end() && !scale_set) {
      if (values.count(name))
        return failed_precondition("variable '" + name + "' is the " + std::string(dtype_name(n->result()->dtype())) +
                                   " copy of weight '" + master + "' that the training step keeps; set '" + master +
                                   "' and the copy follows");
      continue;
    }
    // The copy as the step computes it: the same op's reference kernel on the master's value.
    const Tensor w = m != values.end() ? m->second : current(master);
    Graph derive("copy");
    Value* in = derive.add_input(master, w.type());
    std::vector<Value*> operands = {in};
    AttrMap attrs;
    if (!scale.empty()) {
      operands.push_back(derive.add_input(scale, TensorType{DType::kF32, {}}));
      attrs["dtype"] = Attribute(n->result()->dtype());
    } else {
      attrs["to"] = Attribute(n->result()->dtype());
    }
    KILN_ASSIGN_OR_RETURN(Node * op, derive.create_node(scale.empty() ? "cast" : "quantize", operands,
                                                        {n->result()->type()}, attrs));
    derive.set_outputs({op->result()});
    std::vector<Tensor> inputs = {w};
    if (!scale.empty()) inputs.push_back(scale_set ? values.at(scale) : current(scale));
    Interpreter interp;
    auto out = interp.run(derive, inputs);
    if (!out.ok()) return out.status().with_context("refreshing variable '" + name + "' from '" + master + "'");
    values[name] = std::move((*out)[0]);
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
                              attr_required("init", AttrKind::kTensor, "value on the first run (fixes dtype and shape)"),
                              attr_optional("copy_of", AttrKind::kString,
                                            "the variable this one is a copy of: always its cast to this dtype "
                                            "(with copy_scale: its quantize)"),
                              attr_optional("copy_scale", AttrKind::kString,
                                            "an f8 copy: the f32[] variable holding the scale it is quantized with")},
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
