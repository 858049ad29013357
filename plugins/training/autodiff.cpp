// The autodiff pass: appends the backward of a scalar loss to the forward graph (the joint
// graph), one gradient output per parameter. Reverse mode over the nodes in reverse order,
// each op's vector-Jacobian product taken from the rule table (grad_rules.cpp).
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "autodiff.h"

namespace kiln::training {
namespace {

bool is_f8(DType t) { return t == DType::kF8E4M3FN || t == DType::kF8E5M2; }

Status pass_error(const Location& loc, const std::string& message) {
  return error_at(loc, StatusCode::kInvalidArgument, "autodiff: " + message);
}

/// Replaces every top-level `fused` node by the nodes of its region, so that the gradient of a
/// fused group is the gradient of what it computes.
Status inline_fused(Graph& g) {
  for (Node* n : g.node_list()) {
    if (n->op_name() != "fused") continue;
    const Graph& body = n->region(0);
    std::unordered_map<const Value*, Value*> map;
    for (int i = 0; i < body.num_inputs(); ++i) map[body.input(i)] = n->operand(i);
    for (const auto& inner : body.nodes()) {
      std::vector<Value*> operands;
      for (Value* v : inner->operands()) operands.push_back(map.at(v));
      std::vector<TensorType> types;
      std::vector<std::string> names;
      for (int r = 0; r < inner->num_results(); ++r) {
        types.push_back(inner->result(r)->type());
        names.push_back(inner->result(r)->name());
      }
      KILN_ASSIGN_OR_RETURN(Node * copy, g.create_node(inner->op_name(), operands, types, inner->attrs(), n, names));
      copy->set_loc(inner->loc());
      for (int k = 0; k < inner->num_regions(); ++k) copy->add_region(inner->region(k).clone());
      for (int r = 0; r < inner->num_results(); ++r) map[inner->result(r)] = copy->result(r);
    }
    for (int r = 0; r < n->num_results(); ++r) n->result(r)->replace_all_uses_with(map.at(body.output(r)));
    KILN_RETURN_IF_ERROR(g.erase_node(n));
  }
  return ok_status();
}

/// Values the loss depends on through float values (gradients only flow through floats) and
/// FP8 scaling state's ops (a scale is not differentiated: the amax history it reads is no weight).
std::unordered_set<const Value*> reaching(const Graph& g, const Value* loss) {
  std::unordered_set<const Value*> reach{loss};
  for (auto it = g.nodes().rbegin(); it != g.nodes().rend(); ++it) {
    const Node& n = **it;
    bool hit = false;
    for (int r = 0; r < n.num_results(); ++r) hit |= reach.count(n.result(r)) != 0;
    if (!hit || n.op_name() == "delayed_scaling_step_scale") continue;
    for (const Value* v : n.operands())
      if (is_float(v->dtype())) reach.insert(v);
  }
  return reach;
}

StatusOr<Value*> find_loss(const Graph& g, const std::string& name) {
  std::string known;
  for (int i = 0; i < g.num_outputs(); ++i) {
    const std::string out = g.output_name(i).empty() ? g.output(i)->name() : g.output_name(i);
    if ((name.empty() && g.num_outputs() == 1) || out == name) return g.output(i);
    known += (i ? ", " : "") + out;
  }
  if (name.empty())
    return invalid_argument("autodiff: the graph has " + std::to_string(g.num_outputs()) +
                            " outputs; name the loss with option 'loss' (outputs: " + known + ")");
  return not_found("autodiff: the graph has no output '" + name + "' (option 'loss'); its outputs: " + known);
}

}  // namespace

Value* find_named_value(const Graph& g, const std::string& name) {
  for (Value* v : g.inputs())
    if (v->name() == name) return v;
  for (const auto& n : g.nodes())
    for (Value* v : n->results())
      if (v->name() == name) return v;
  return nullptr;
}

std::vector<Value*> trainable_weights(const Graph& g, const Value* loss) {
  const auto reach = reaching(g, loss);
  std::vector<Value*> out;
  for (const auto& n : g.nodes()) {
    if (n->op_name() != "constant" && n->op_name() != "variable") continue;
    Value* v = n->result();
    if (is_float(v->dtype()) && v->type().rank() >= 1 && reach.count(v)) out.push_back(v);
  }
  return out;
}

StatusOr<std::vector<Value*>> differentiate(Graph& g, const AutodiffConfig& config) {
  KILN_RETURN_IF_ERROR(inline_fused(g));
  KILN_ASSIGN_OR_RETURN(Value * loss, find_loss(g, config.loss));
  if (!is_float(loss->dtype()) || num_elements(loss->shape()) != 1)
    return invalid_argument("autodiff: the loss must be a float scalar, got " + loss->type().str());

  std::vector<Value*> params;
  if (config.params.empty()) {
    params = trainable_weights(g, loss);
    if (params.empty()) return invalid_argument("autodiff: the loss depends on no trainable weight (float constant or variable)");
  }
  for (const std::string& name : config.params) {
    Value* v = find_named_value(g, name);
    if (v == nullptr) return not_found("autodiff: no value named '" + name + "' (option 'params')");
    if (!is_float(v->dtype())) return invalid_argument("autodiff: parameter '" + name + "' is " + v->type().str() + ", not float");
    params.push_back(v);
  }
  int unnamed = 0;
  for (Value* p : params)
    if (p->name().empty()) p->set_name("param" + std::to_string(unnamed++));

  // Which values depend on a parameter: only their producers' operands need gradients.
  std::unordered_set<const Value*> depends(params.begin(), params.end());
  // The weights and what is computed from weights alone (chunk-cross-entropy's padded head
  // weight): their gradient contributions are weight gradients, summed as such (below).
  std::unordered_set<const Value*> weights(params.begin(), params.end());
  const std::vector<Node*> forward = g.node_list();
  for (Node* n : forward) {
    bool dep = false, from_weights = n->num_operands() > 0;
    for (Value* v : n->operands()) {
      dep |= depends.count(v) != 0;
      from_weights &= weights.count(v) != 0;
    }
    if (dep)
      for (Value* r : n->results())
        if (is_float(r->dtype())) depends.insert(r);
    if (from_weights)
      for (Value* r : n->results()) weights.insert(r);
  }

  Builder b(g);
  std::unordered_map<const Value*, Value*> grads;
  try {
    Tensor one(loss->dtype(), require_static(loss->shape(), "the loss"));
    one.set_f64(0, 1.0);
    grads[loss] = b.constant(one, loss->name().empty() ? "" : loss->name() + ".seed");
    if (config.init_loss_scale > 0) {
      Value* scale = b.op("variable", {},
                          {{"name", Attribute(kLossScaleVariable)},
                           {"init", Attribute(Tensor::scalar_f64(DType::kF32, config.init_loss_scale))}},
                          kLossScaleVariable);
      grads[loss] = b.mul(grads[loss], b.cast(scale, loss->dtype()));
    }
    for (auto it = forward.rbegin(); it != forward.rend(); ++it) {
      Node* n = *it;
      std::vector<Value*> result_grads;
      bool any_grad = false;
      for (Value* r : n->results()) {
        auto gi = grads.find(r);
        result_grads.push_back(gi == grads.end() ? nullptr : gi->second);
        any_grad |= gi != grads.end();
      }
      std::vector<bool> needs;
      bool any_need = false;
      for (Value* v : n->operands()) {
        needs.push_back(depends.count(v) != 0 && is_float(v->dtype()));
        any_need |= needs.back();
      }
      if (!any_grad || !any_need) continue;
      const RuleEntry& entry = rule_for(n->op_name());
      switch (entry.kind) {
        case RuleKind::kNonDifferentiable: continue;
        case RuleKind::kMissing:
          return pass_error(n->loc(), "no gradient rule for op '" + n->op_name() + "'");
        case RuleKind::kRefused:
          return pass_error(n->loc(), "cannot differentiate op '" + n->op_name() + "': " + entry.reason);
        case RuleKind::kRule: break;
      }
      b.set_loc(n->loc());
      GradContext ctx{b, *n, result_grads, needs};
      std::vector<Value*> operand_grads;
      try {
        operand_grads = entry.rule(ctx);
      } catch (const BuildError& e) {
        return pass_error(n->loc(), "gradient of '" + n->op_name() + "': " + e.status.message());
      }
      for (int i = 0; i < n->num_operands() && i < static_cast<int>(operand_grads.size()); ++i) {
        Value* gi = operand_grads[static_cast<size_t>(i)];
        if (gi == nullptr || !needs[static_cast<size_t>(i)]) continue;
        Value* x = n->operand(i);
        // An f8 value's gradient is the gradient of the real number it stands for, in f32.
        const TensorType want = is_f8(x->dtype()) ? TensorType{DType::kF32, x->shape()} : x->type();
        if (gi->type() != want)
          return internal_error("autodiff: the rule of '" + n->op_name() + "' gave " + gi->type().str() +
                                " for operand " + std::to_string(i) + " of type " + x->type().str());
        auto [slot, fresh] = grads.emplace(x, gi);
        // A weight used in several places (a tied embedding, a chunked head) sums its gradient
        // as each contribution comes: `_accumulate` keeps fusion from making one kernel of the
        // whole sum, which would hold every contribution until the last one exists.
        if (!fresh)
          slot->second = weights.count(x) ? b.op("add", {slot->second, gi}, {{"_accumulate", Attribute(int64_t{1})}})
                                          : b.add(slot->second, gi);
      }
    }
    std::vector<Value*> outs = g.outputs();
    std::vector<std::string> names = g.output_names();
    for (Value* p : params) {
      auto gi = grads.find(p);
      Value* grad = gi != grads.end() ? gi->second : b.zeros(p->type());
      const std::string name = p->name() + config.grad_suffix;
      for (const std::string& existing : names)
        if (existing == name) return invalid_argument("autodiff: the graph already has an output named '" + name + "'");
      outs.push_back(grad);
      names.push_back(name);
    }
    g.set_outputs(outs, names);
    // Ops that exist for their gradient (quantize_grad) are the identity in the forward.
    for (Node* n : forward)
      if (rule_for(n->op_name()).gradient_only) {
        n->result()->replace_all_uses_with(n->operand(0));
        KILN_RETURN_IF_ERROR(g.erase_node(n));
      }
  } catch (const BuildError& e) {
    return e.status.with_context("autodiff");
  }
  return params;
}

namespace {

class Autodiff final : public Pass {
 public:
  explicit Autodiff(AutodiffConfig c) : config_(std::move(c)) {}
  StatusOr<bool> run(Graph& g) override {
    KILN_RETURN_IF_ERROR(differentiate(g, config_).status());
    return true;
  }

 private:
  AutodiffConfig config_;
};

}  // namespace

PassInfo autodiff_pass_info() {
  PassInfo info;
  info.name = "autodiff";
  info.version = "0.2.0";
  info.summary = "append the backward of a scalar loss: one '<param>.grad' output per parameter (the joint graph)";
  info.options = {
      {"loss", OptionType::kString, std::string(), "the output differentiated; empty: the graph's only output"},
      {"params", OptionType::kStringList, std::vector<std::string>{},
       "values to differentiate with respect to (inputs, constants, variables); empty: every float constant or "
       "variable of rank >= 1 the loss depends on"},
      {"loss-scale", OptionType::kString, std::string("none"),
       "none, or dynamic: seed the backward with variable 'scaler.scale' (fp16 training; the optimizer unscales)"},
      {"init-scale", OptionType::kFloat, 65536.0, "the first dynamic loss scale (PyTorch GradScaler's 2^16)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    AutodiffConfig c;
    c.loss = o.get_string("loss");
    c.params = o.get_strings("params");
    const std::string scaling = o.get_string("loss-scale");
    if (scaling == "dynamic") c.init_loss_scale = o.get_float("init-scale");
    else if (scaling != "none") return invalid_argument("autodiff: option 'loss-scale' must be none or dynamic, got '" + scaling + "'");
    if (!(o.get_float("init-scale") > 0)) return invalid_argument("autodiff: option 'init-scale' must be > 0");
    return std::unique_ptr<Pass>(std::make_unique<Autodiff>(std::move(c)));
  };
  return info;
}

}  // namespace kiln::training
