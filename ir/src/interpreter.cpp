// The reference interpreter: evaluates a graph node by node with each op's reference kernel.
#include "kiln/ir/interpreter.h"

#include <exception>
#include <limits>
#include <map>
#include <unordered_map>

#include "kiln/ir/op.h"

namespace kiln {
namespace {

/// Largest tensor the interpreter will allocate (bytes); beyond this a graph is refused
/// rather than exhausting host memory.
constexpr int64_t kMaxTensorBytes = int64_t{1} << 36;

Status check_inputs(const Graph& g, std::span<const Tensor> inputs) {
  if (static_cast<int>(inputs.size()) != g.num_inputs())
    return invalid_argument("graph @" + g.name() + " takes " + std::to_string(g.num_inputs()) +
                            " inputs, got " + std::to_string(inputs.size()));
  std::map<std::string, int64_t> symbols;
  for (int i = 0; i < g.num_inputs(); ++i) {
    const Value* in = g.input(i);
    const Tensor& t = inputs[static_cast<size_t>(i)];
    const std::string what = "input %" + in->name();
    if (t.dtype() != in->dtype())
      return invalid_argument(what + " must be " + std::string(dtype_name(in->dtype())) + ", got " +
                              std::string(dtype_name(t.dtype())));
    if (t.rank() != in->type().rank())
      return invalid_argument(what + " must have shape " + shape_str(in->shape()) + ", got " +
                              shape_str(shape_of(t.shape())));
    for (size_t d = 0; d < t.shape().size(); ++d) {
      const Dim& dim = in->shape()[d];
      const int64_t actual = t.shape()[d];
      if (dim.is_static() && dim.value() != actual)
        return invalid_argument(what + " must have shape " + shape_str(in->shape()) + ", got " +
                                shape_str(shape_of(t.shape())));
      if (!dim.is_static() && !dim.is_unknown()) {
        auto [it, inserted] = symbols.emplace(dim.symbol_name(), actual);
        if (!inserted && it->second != actual)
          return invalid_argument(what + ": dim " + dim.symbol_name() + " is " +
                                  std::to_string(actual) + " here but " +
                                  std::to_string(it->second) + " in another input");
      }
    }
  }
  return ok_status();
}

StatusOr<Tensor> allocate(const Node& n, const TensorType& type, int result) {
  if (!is_static(type.shape))
    return error_at(n.loc(), StatusCode::kInvalidArgument,
                    n.op_name() + ": result " + std::to_string(result) +
                        " has no static shape at run time: " + type.str());
  int64_t numel = 1;
  for (const Dim& d : type.shape) {
    if (d.value() < 0)
      return error_at(n.loc(), StatusCode::kInvalidArgument,
                      n.op_name() + ": negative dimension in " + type.str());
    if (d.value() != 0 && numel > kMaxTensorBytes / d.value())
      return error_at(n.loc(), StatusCode::kOutOfRange,
                      n.op_name() + ": result " + type.str() + " is too large");
    numel *= d.value();
  }
  if (dtype_storage_bytes(type.dtype, numel) > kMaxTensorBytes)
    return error_at(n.loc(), StatusCode::kOutOfRange,
                    n.op_name() + ": result " + type.str() + " is too large");
  return Tensor(type.dtype, static_sizes(type.shape));
}

}  // namespace

const Tensor* Interpreter::variable_value(const std::string& name) const {
  auto it = state_.find(name);
  return it == state_.end() ? nullptr : &it->second;
}

void Interpreter::stage_assign(const std::string& name, Tensor value) { staged_[name] = std::move(value); }

void Interpreter::commit_assigns() {
  for (auto& [name, t] : staged_) state_[name] = std::move(t);
  staged_.clear();
}

std::map<std::string, Tensor> Interpreter::state_of(const Graph& g) const {
  std::map<std::string, Tensor> out;
  for (const auto& n : g.nodes()) {
    if (n->op_name() != "variable") continue;
    const std::string name = n->get_string("name");
    const Tensor* held = variable_value(name);
    out[name] = held ? *held : n->attr("init")->as_tensor();
  }
  return out;
}

Status Interpreter::set_state(const Graph& g, const std::map<std::string, Tensor>& given) {
  std::map<std::string, TensorType> vars;
  std::map<std::string, const Node*> nodes;
  for (const auto& n : g.nodes())
    if (n->op_name() == "variable") {
      vars[n->get_string("name")] = n->result()->type();
      nodes[n->get_string("name")] = n.get();
    }
  for (const auto& [name, t] : given) {
    auto it = vars.find(name);
    if (it == vars.end()) return not_found("graph @" + g.name() + " has no variable '" + name + "'");
    if (t.type() != it->second)
      return invalid_argument("variable '" + name + "' is " + it->second.str() + ", the value given is " + t.type().str());
  }
  std::map<std::string, Tensor> values = given;
  KILN_RETURN_IF_ERROR(complete_state_copies(g, values, [&](const std::string& name) {
    const Tensor* held = variable_value(name);
    return held ? *held : nodes.at(name)->attr("init")->as_tensor();
  }));
  for (const auto& [name, t] : values) state_[name] = t;
  return ok_status();
}

StatusOr<std::vector<Tensor>> Interpreter::run(const Graph& g, std::span<const Tensor> inputs) {
  // Regions (fused bodies run by their node's kernel) hold no state: only a top-level run
  // starts and ends a step.
  if (g.parent_node() != nullptr) return evaluate(g, inputs);
  staged_.clear();
  StatusOr<std::vector<Tensor>> out = evaluate(g, inputs);
  if (out.ok())
    commit_assigns();
  else
    staged_.clear();
  return out;
}

StatusOr<std::vector<Tensor>> Interpreter::evaluate(const Graph& g, std::span<const Tensor> inputs) {
  KILN_RETURN_IF_ERROR(check_inputs(g, inputs));
  std::unordered_map<const Value*, Tensor> env;
  std::unordered_map<const Value*, int64_t> remaining_uses;
  for (int i = 0; i < g.num_inputs(); ++i) env[g.input(i)] = inputs[static_cast<size_t>(i)];
  for (const auto& n : g.nodes())
    for (Value* v : n->operands()) ++remaining_uses[v];

  for (const auto& node_ptr : g.nodes()) {
    const Node& n = *node_ptr;
    std::vector<Tensor> in;
    std::vector<TensorType> in_types;
    in.reserve(static_cast<size_t>(n.num_operands()));
    for (Value* v : n.operands()) {
      auto it = env.find(v);
      if (it == env.end())
        return internal_error(n.op_name() + ": operand %" + v->name() + " has no value");
      in.push_back(it->second);
      in_types.push_back(it->second.type());
    }
    KILN_ASSIGN_OR_RETURN(auto out_types, infer_node_types(n, std::move(in_types)));
    std::vector<Tensor> out;
    for (size_t r = 0; r < out_types.size(); ++r) {
      KILN_ASSIGN_OR_RETURN(Tensor t, allocate(n, out_types[r], static_cast<int>(r)));
      out.push_back(std::move(t));
    }
    KernelContext ctx{n, in, out, *this};
    try {
      KILN_RETURN_IF_ERROR(n.op()->reference(ctx));
    } catch (const std::bad_alloc&) {
      return error_at(n.loc(), StatusCode::kOutOfRange, n.op_name() + ": out of host memory");
    } catch (const std::exception& e) {
      return error_at(n.loc(), StatusCode::kInternal,
                      n.op_name() + ": reference kernel failed: " + e.what());
    }
    for (size_t r = 0; r < out.size(); ++r) {
      if (out[r].dtype() != out_types[r].dtype || shape_of(out[r].shape()) != out_types[r].shape)
        return internal_error(n.op_name() + ": reference kernel produced " + out[r].type().str() +
                              " for result " + std::to_string(r) + " of type " + out_types[r].str());
      env[n.result(static_cast<int>(r))] = std::move(out[r]);
    }
    // Free operands after their last use; graph outputs are never counted as uses here.
    for (Value* v : n.operands())
      if (--remaining_uses[v] == 0 && !v->is_graph_input()) {
        bool is_output = false;
        for (const Value* o : g.outputs()) is_output |= (o == v);
        if (!is_output) env.erase(v);
      }
  }
  std::vector<Tensor> results;
  for (const Value* o : g.outputs()) {
    auto it = env.find(o);
    if (it == env.end()) return internal_error("graph output %" + o->name() + " has no value");
    results.push_back(it->second);
  }
  return results;
}

}  // namespace kiln
