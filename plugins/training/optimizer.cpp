// The optimizer pass: turns a joint graph (autodiff's '<param>.grad' outputs) into one training
// step. Weights become `variable`s, the update is built from core elementwise ops, and every
// new value is `assign`ed, so the state (weights and optimizer state, named like PyTorch's:
// exp_avg, exp_avg_sq, momentum_buffer, step) persists from one run to the next.
#include <cmath>

#include "autodiff.h"

namespace kiln::training {
namespace {

struct OptimizerConfig {
  std::string algorithm;  ///< "sgd" or "adamw"
  double lr = 1e-3, momentum = 0, weight_decay = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, max_grad_norm = 0;
  bool nesterov = false, keep_grads = false;
  double growth_factor = 2.0, backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

constexpr const char* kGradSuffix = ".grad";

/// The weight as a variable: a constant becomes a variable holding it as its init.
StatusOr<Value*> as_variable(Graph& g, Value* p) {
  Node* n = p->producer();
  if (n != nullptr && n->op_name() == "variable") return p;
  if (n == nullptr || n->op_name() != "constant")
    return invalid_argument("optimizer: parameter '" + p->name() + "' is " +
                            (n ? "computed by '" + n->op_name() + "'" : std::string("a graph input")) +
                            "; the weights a step updates must be constants or variables");
  AttrMap attrs{{"name", Attribute(p->name())}, {"init", *n->attr("value")}};
  KILN_ASSIGN_OR_RETURN(Node * var, g.create_node("variable", {}, {p->type()}, attrs, n, {p->name()}));
  var->set_loc(n->loc());
  p->replace_all_uses_with(var->result());
  p->set_name("");
  KILN_RETURN_IF_ERROR(g.erase_node(n));
  return var->result();
}

class Optimizer final : public Pass {
 public:
  explicit Optimizer(OptimizerConfig c) : c_(std::move(c)) {}

  StatusOr<bool> run(Graph& g) override {
    // The parameters: outputs named '<value>.grad' whose value exists.
    std::vector<std::pair<Value*, Value*>> pairs;  // param, grad
    std::vector<Value*> kept_outputs;
    std::vector<std::string> kept_names;
    const std::string suffix = kGradSuffix;
    for (int i = 0; i < g.num_outputs(); ++i) {
      const std::string& name = g.output_name(i);
      Value* p = nullptr;
      if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        p = find_named_value(g, name.substr(0, name.size() - suffix.size()));
      if (p != nullptr) pairs.push_back({p, g.output(i)});
      if (p == nullptr || c_.keep_grads) {
        kept_outputs.push_back(g.output(i));
        kept_names.push_back(name);
      }
    }
    if (pairs.empty())
      return failed_precondition("optimizer: the graph has no '<param>.grad' outputs; run autodiff before it");
    for (auto& [p, grad] : pairs) {
      if (p->type() != grad->type())
        return invalid_argument("optimizer: gradient of '" + p->name() + "' is " + grad->type().str() + ", the weight " +
                                p->type().str());
      KILN_ASSIGN_OR_RETURN(p, as_variable(g, p));
    }
    g.set_outputs(kept_outputs, kept_names);
    try {
      Builder b(g);
      build_step(b, pairs, kept_outputs, kept_names);
    } catch (const BuildError& e) {
      return e.status.with_context("optimizer");
    }
    return true;
  }

 private:
  /// A variable named `name`, zeros of `type` on the first run.
  Value* state(Builder& b, const std::string& name, const TensorType& type) {
    Tensor zeros(type.dtype, require_static(type.shape, "optimizer state '" + name + "'"));
    return b.op("variable", {}, {{"name", Attribute(name)}, {"init", Attribute(zeros)}}, name);
  }
  /// Gives variable `name` (now `old`) the value `v` for the next step; under dynamic loss
  /// scaling a step whose gradients hold inf or nan keeps `old`.
  void assign(Builder& b, const std::string& name, Value* old, Value* v) {
    if (skip_ != nullptr) v = b.where(skip_, old, v);
    b.op_n("assign", {v}, 0, {{"name", Attribute(name)}});
  }

  /// torch.cuda.amp.GradScaler's unscale_ and update, in the graph: gradients are divided by the
  /// scale autodiff seeded the backward with; inf/nan in any of them skips the step and halves
  /// the scale; `growth-interval` good steps in a row double it.
  void unscale(Builder& b, Value* scale, std::vector<std::pair<Value*, Value*>>& pairs) {
    Value* inv = b.unary("reciprocal", scale);
    Value* bad = nullptr;
    for (auto& [p, grad] : pairs) {
      grad = b.mul(grad, b.cast(inv, grad->dtype()));
      Value* nonfinite = b.op("or", {b.unary("isinf", grad), b.unary("isnan", grad)});
      Value* n = b.reduce("reduce_sum", b.cast(nonfinite, DType::kF32), {}, false);
      bad = bad ? b.add(bad, n) : n;
    }
    skip_ = b.op("greater", {bad, b.scalar(0, DType::kF32)});
    Value* tracker = state(b, "scaler.growth_tracker", {DType::kF32, {}});
    Value* good = b.add(tracker, 1.0);
    Value* grow = b.op("greater_equal", {good, b.scalar(static_cast<double>(c_.growth_interval), DType::kF32)});
    Value* zero = b.scalar(0, DType::kF32);
    Value* next_scale = b.where(skip_, b.mul(scale, c_.backoff_factor), b.where(grow, b.mul(scale, c_.growth_factor), scale));
    Value* next_tracker = b.where(skip_, zero, b.where(grow, zero, good));
    b.op_n("assign", {next_scale}, 0, {{"name", Attribute(kLossScaleVariable)}});
    b.op_n("assign", {next_tracker}, 0, {{"name", Attribute("scaler.growth_tracker")}});
  }

  void build_step(Builder& b, std::vector<std::pair<Value*, Value*>>& pairs, std::vector<Value*> outs,
                  std::vector<std::string> names) {
    Graph& g = b.graph();
    for (const auto& n : g.nodes())
      if (n->op_name() == "variable" && n->get_string("name") == kLossScaleVariable) {
        Value* scale = n->result();
        unscale(b, scale, pairs);
        outs.push_back(scale);
        names.push_back("loss_scale");
        g.set_outputs(outs, names);
        break;
      }
    if (c_.max_grad_norm > 0) {
      // torch.nn.utils.clip_grad_norm_: scale every gradient by min(1, max / (norm + 1e-6)).
      Value* total = nullptr;
      for (auto& [p, grad] : pairs) {
        Value* sq = b.reduce("reduce_sum", b.mul(b.cast(grad, DType::kF32), b.cast(grad, DType::kF32)), {}, false);
        total = total ? b.add(total, sq) : sq;
      }
      Value* norm = b.unary("sqrt", total);
      norm->set_name("grad_norm");
      Value* coef = b.op("minimum", {b.div(b.scalar(c_.max_grad_norm, DType::kF32), b.add(norm, 1e-6)), b.scalar(1.0, DType::kF32)});
      for (auto& [p, grad] : pairs) grad = b.mul(grad, b.cast(coef, grad->dtype()));
      outs.push_back(norm);
      names.push_back("grad_norm");
      g.set_outputs(outs, names);
    }
    Value* step = state(b, "optimizer.step", {DType::kF32, {}});
    Value* t = b.add(step, 1.0);
    assign(b, "optimizer.step", step, t);
    for (auto& [p, grad] : pairs) {
      const std::string name = p->name();
      Value* updated = c_.algorithm == "sgd" ? sgd(b, p, grad) : adamw(b, p, grad, t);
      updated->set_name(name + ".next");
      assign(b, name, p, updated);
    }
  }

  Value* sgd(Builder& b, Value* p, Value* grad) {
    // torch.optim.SGD with dampening 0: the buffer starts as the first gradient (0 * 0 + g).
    Value* d = c_.weight_decay != 0 ? b.add(grad, b.mul(p, c_.weight_decay)) : grad;
    if (c_.momentum != 0) {
      const std::string buf_name = p->name() + ".momentum_buffer";
      Value* old = state(b, buf_name, p->type());
      Value* buf = b.add(b.mul(old, c_.momentum), d);
      assign(b, buf_name, old, buf);
      d = c_.nesterov ? b.add(d, b.mul(buf, c_.momentum)) : buf;
    }
    return b.sub(p, b.mul(d, c_.lr));
  }

  Value* adamw(Builder& b, Value* p, Value* grad, Value* t) {
    // torch.optim.AdamW (single-tensor path): decoupled decay, then bias-corrected Adam.
    const std::string m_name = p->name() + ".exp_avg", v_name = p->name() + ".exp_avg_sq";
    Value* m = state(b, m_name, p->type());
    Value* v = state(b, v_name, p->type());
    Value* m_next = b.add(m, b.mul(b.sub(grad, m), 1 - c_.beta1));
    Value* v_next = b.add(b.mul(v, c_.beta2), b.mul(b.mul(grad, grad), 1 - c_.beta2));
    assign(b, m_name, m, m_next);
    assign(b, v_name, v, v_next);
    auto correction = [&](double beta) {  // 1 - beta^t, a scalar in the weight's dtype
      return b.cast(b.add(b.neg(b.op("pow", {b.scalar(beta, DType::kF32), t})), 1.0), p->dtype());
    };
    Value* step_size = b.div(b.scalar(c_.lr, p->dtype()), correction(c_.beta1));
    Value* denom = b.add(b.div(b.unary("sqrt", v_next), b.unary("sqrt", correction(c_.beta2))), c_.eps);
    Value* decayed = c_.weight_decay != 0 ? b.mul(p, 1 - c_.lr * c_.weight_decay) : p;
    return b.sub(decayed, b.mul(b.div(m_next, denom), step_size));
  }

  OptimizerConfig c_;
  Value* skip_ = nullptr;  ///< bool[]: this step's gradients are not finite (dynamic loss scaling)
};

}  // namespace

PassInfo optimizer_pass_info() {
  PassInfo info;
  info.name = "optimizer";
  info.version = "0.1.0";
  info.summary = "one training step: weights become variables updated by sgd or adamw from autodiff's gradients";
  info.options = {
      {"algorithm", OptionType::kString, std::string("adamw"), "\"sgd\" or \"adamw\""},
      {"lr", OptionType::kFloat, 1e-3, "learning rate"},
      {"momentum", OptionType::kFloat, 0.0, "sgd: momentum (0: none)"},
      {"nesterov", OptionType::kBool, false, "sgd: nesterov momentum"},
      {"weight-decay", OptionType::kFloat, 0.0, "sgd: L2 added to the gradient; adamw: decoupled decay (PyTorch's default is 0.01)"},
      {"beta1", OptionType::kFloat, 0.9, "adamw: decay of the first moment"},
      {"beta2", OptionType::kFloat, 0.999, "adamw: decay of the second moment"},
      {"eps", OptionType::kFloat, 1e-8, "adamw: added to the denominator"},
      {"max-grad-norm", OptionType::kFloat, 0.0, "clip gradients to this global L2 norm (0: no clipping); adds a grad_norm output"},
      {"keep-grads", OptionType::kBool, false, "keep the '<param>.grad' outputs"},
      {"growth-factor", OptionType::kFloat, 2.0, "dynamic loss scaling: the scale's growth after growth-interval good steps"},
      {"backoff-factor", OptionType::kFloat, 0.5, "dynamic loss scaling: the scale's factor after a step with inf/nan"},
      {"growth-interval", OptionType::kInt, int64_t{2000}, "dynamic loss scaling: good steps before the scale grows"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    OptimizerConfig c;
    c.algorithm = o.get_string("algorithm");
    c.lr = o.get_float("lr");
    c.momentum = o.get_float("momentum");
    c.nesterov = o.get_bool("nesterov");
    c.weight_decay = o.get_float("weight-decay");
    c.beta1 = o.get_float("beta1");
    c.beta2 = o.get_float("beta2");
    c.eps = o.get_float("eps");
    c.max_grad_norm = o.get_float("max-grad-norm");
    c.keep_grads = o.get_bool("keep-grads");
    c.growth_factor = o.get_float("growth-factor");
    c.backoff_factor = o.get_float("backoff-factor");
    c.growth_interval = o.get_int("growth-interval");
    if (!(c.growth_factor >= 1) || !(c.backoff_factor > 0 && c.backoff_factor <= 1) || c.growth_interval < 1)
      return invalid_argument("optimizer: loss scaling needs growth-factor >= 1, backoff-factor in (0, 1] and growth-interval >= 1");
    if (c.algorithm != "sgd" && c.algorithm != "adamw")
      return invalid_argument("optimizer: option 'algorithm' must be \"sgd\" or \"adamw\", got \"" + c.algorithm + "\"");
    if (!(c.lr >= 0)) return invalid_argument("optimizer: option 'lr' must be >= 0");
    if (!(c.momentum >= 0)) return invalid_argument("optimizer: option 'momentum' must be >= 0");
    if (c.nesterov && (c.algorithm != "sgd" || c.momentum <= 0))
      return invalid_argument("optimizer: option 'nesterov' needs algorithm sgd with momentum > 0");
    if (!(c.beta1 >= 0 && c.beta1 < 1) || !(c.beta2 >= 0 && c.beta2 < 1))
      return invalid_argument("optimizer: options 'beta1' and 'beta2' must be in [0, 1)");
    if (!(c.max_grad_norm >= 0)) return invalid_argument("optimizer: option 'max-grad-norm' must be >= 0");
    return std::unique_ptr<Pass>(std::make_unique<Optimizer>(std::move(c)));
  };
  return info;
}

}  // namespace kiln::training
