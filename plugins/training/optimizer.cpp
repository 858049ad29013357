// The optimizer pass: turns a joint graph (autodiff's '<param>.grad' outputs) into one training
// step. Weights become `variable`s, the update is built from core elementwise ops, and every
// new value is `assign`ed, so the state (weights and optimizer state, named like PyTorch's:
// exp_avg, exp_avg_sq, momentum_buffer, step) persists from one run to the next.
//
// In a data-parallel program whose gradients arrive split over a mesh axis (reduce-scattered:
// the data-parallel strategy's shard-optimizer-state, ZeRO-1), each rank updates its block of
// every weight, keeps optimizer state for that block only, and all-gathers the new weight.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>

#include "autodiff.h"
#include "kiln/ir/interpreter.h"

namespace kiln::training {
namespace {

struct OptimizerConfig {
  std::string algorithm;  ///< "sgd" or "adamw"
  double lr = 1e-3, momentum = 0, weight_decay = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, max_grad_norm = 0;
  bool nesterov = false, keep_grads = false, low_precision_copies = false;
  double growth_factor = 2.0, backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

constexpr const char* kGradSuffix = ".grad";

/// A weight, its gradient and, when the gradient holds only this rank's block (split along
/// `dim` over mesh axis `axis`), where the block lies.
struct Param {
  Value* weight;
  Value* grad;
  std::optional<Sharding> split;  ///< the gradient's placement; nullopt: the whole gradient
  std::string axis;
  int64_t dim = 0;
};

/// The block the gradient of `w` holds, when it is `w` split along one dim over one mesh axis
/// of a per-rank program (a replicated weight); nullopt otherwise.
std::optional<std::pair<int, int64_t>> split_of(const Graph& g, const Value* w, const Value* grad) {
  const Sharding& s = grad->sharding();
  if (!g.is_per_rank() || g.mesh().empty() || !is_replicated(w->sharding()) || s.empty()) return std::nullopt;
  std::optional<std::pair<int, int64_t>> found;
  for (size_t a = 0; a < s.size(); ++a) {
    if (s[a].is_replicate()) continue;
    if (!s[a].is_shard() || found) return std::nullopt;
    found = std::make_pair(static_cast<int>(a), s[a].dim);
  }
  if (!found || global_shape(grad->shape(), s, g.mesh()) != w->shape()) return std::nullopt;
  return found;
}

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
  var->result()->set_sharding(p->sharding());
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
    std::vector<Param> pairs;
    std::vector<Value*> kept_outputs;
    std::vector<std::string> kept_names;
    const std::string suffix = kGradSuffix;
    for (int i = 0; i < g.num_outputs(); ++i) {
      const std::string& name = g.output_name(i);
      Value* p = nullptr;
      if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        p = find_named_value(g, name.substr(0, name.size() - suffix.size()));
      if (p != nullptr) pairs.push_back({p, g.output(i), std::nullopt, "", 0});
      if (p == nullptr || c_.keep_grads) {
        kept_outputs.push_back(g.output(i));
        kept_names.push_back(name);
      }
    }
    if (pairs.empty())
      return failed_precondition("optimizer: the graph has no '<param>.grad' outputs; run autodiff before it");
    for (Param& q : pairs) {
      if (q.weight->type() != q.grad->type()) {
        auto split = split_of(g, q.weight, q.grad);
        if (!split || q.weight->dtype() != q.grad->dtype())
          return invalid_argument("optimizer: gradient of '" + q.weight->name() + "' is " + q.grad->type().str() +
                                  ", the weight " + q.weight->type().str());
        q.split = q.grad->sharding();
        q.axis = g.mesh().axes[static_cast<size_t>(split->first)].name;
        q.dim = split->second;
      }
      KILN_ASSIGN_OR_RETURN(q.weight, as_variable(g, q.weight));
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
  /// A variable named `name`, zeros of `type` on the first run; `placement` says how a
  /// per-rank program's ranks hold it (each its block of optimizer state under ZeRO).
  Value* state(Builder& b, const std::string& name, const TensorType& type, const Sharding& placement = {}) {
    Tensor zeros(type.dtype, require_static(type.shape, "optimizer state '" + name + "'"));
    Value* v = b.op("variable", {}, {{"name", Attribute(name)}, {"init", Attribute(zeros)}}, name);
    v->set_sharding(placement);
    return v;
  }

  /// The sum over every parameter of the scalar term(gradient): the terms of gradients split
  /// over a mesh axis are all-reduced over it (each rank holds a different block).
  static Value* global_sum(Builder& b, const std::vector<Param>& pairs, const std::function<Value*(Value*)>& term) {
    Value* whole = nullptr;
    std::map<std::string, Value*> by_axis;
    for (const Param& q : pairs) {
      Value*& acc = q.split ? by_axis[q.axis] : whole;
      Value* t = term(q.grad);
      acc = acc ? b.add(acc, t) : t;
    }
    for (const auto& [axis, part] : by_axis) {
      Value* reduced = b.op("all_reduce", {part}, {{"axis", Attribute(axis)}, {"reduce", Attribute(std::string("sum"))}});
      whole = whole ? b.add(whole, reduced) : reduced;
    }
    return whole;
  }
  /// Gives variable `name` (now `old`) the value `v` for the next step; under dynamic loss
  /// scaling a step whose gradients hold inf or nan keeps `old`.
  Value* assign(Builder& b, const std::string& name, Value* old, Value* v) {
    if (skip_ != nullptr) v = b.where(skip_, old, v);
    b.op_n("assign", {v}, 0, {{"name", Attribute(name)}});
    return v;
  }

  /// torch.cuda.amp.GradScaler's unscale_ and update, in the graph: gradients are divided by the
  /// scale autodiff seeded the backward with; inf/nan in any of them skips the step and halves
  /// the scale; `growth-interval` good steps in a row double it.
  void unscale(Builder& b, Value* scale, std::vector<Param>& pairs) {
    Value* inv = b.unary("reciprocal", scale);
    for (Param& q : pairs) q.grad = b.mul(q.grad, b.cast(inv, q.grad->dtype()));
    Value* bad = global_sum(b, pairs, [&](Value* grad) {
      Value* nonfinite = b.op("or", {b.unary("isinf", grad), b.unary("isnan", grad)});
      return b.reduce("reduce_sum", b.cast(nonfinite, DType::kF32), {}, false);
    });
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

  void build_step(Builder& b, std::vector<Param>& pairs, std::vector<Value*> outs,
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
      Value* total = global_sum(b, pairs, [&](Value* grad) {
        return b.reduce("reduce_sum", b.mul(b.cast(grad, DType::kF32), b.cast(grad, DType::kF32)), {}, false);
      });
      Value* norm = b.unary("sqrt", total);
      norm->set_name("grad_norm");
      Value* coef = b.op("minimum", {b.div(b.scalar(c_.max_grad_norm, DType::kF32), b.add(norm, 1e-6)), b.scalar(1.0, DType::kF32)});
      for (Param& q : pairs) q.grad = b.mul(q.grad, b.cast(coef, q.grad->dtype()));
      outs.push_back(norm);
      names.push_back("grad_norm");
      g.set_outputs(outs, names);
    }
    Value* step = state(b, "optimizer.step", {DType::kF32, {}});
    Value* t = b.add(step, 1.0);
    assign(b, "optimizer.step", step, t);
    for (Param& q : pairs) {
      const std::string name = q.weight->name();
      // Under ZeRO the update (and its state) covers this rank's block of the weight only.
      Value* w = q.weight;
      if (q.split) {
        w = b.op("local_shard", {w}, {{"axis", Attribute(q.axis)}, {"dim", Attribute(q.dim)}}, name + ".shard");
        w->set_sharding(*q.split);
      }
      Value* updated = c_.algorithm == "sgd" ? sgd(b, name, w, q.grad) : adamw(b, name, w, q.grad, t);
      if (q.split) updated = b.op("all_gather", {updated}, {{"axis", Attribute(q.axis)}, {"dim", Attribute(q.dim)}});
      updated->set_name(name + ".next");
      Value* next = assign(b, name, q.weight, updated);
      if (c_.low_precision_copies) keep_low_precision_copies(b, q.weight, next);
    }
  }

  /// A plain rounding cast to bf16/f16 (what autocast builds): the copy's refresh recomputes
  /// exactly that.
  static std::optional<DType> low_cast(const Node* n) {
    if (n == nullptr || n->op_name() != "cast" || n->attrs().size() != 1) return std::nullopt;
    const DType to = n->result()->dtype();
    if (to != DType::kBF16 && to != DType::kF16) return std::nullopt;
    return to;
  }

  /// A data movement of the weight alone that every reader casts to one low dtype (the padded
  /// head weight of chunk-cross-entropy, a transposed weight): it moves the copy instead, the
  /// same bits (rounding commutes with moving values; padding adds zeros).
  static std::optional<DType> moved_then_cast(const Node* n) {
    if (n == nullptr || n->num_operands() != 1 || n->num_results() != 1) return std::nullopt;
    const std::string& op = n->op_name();
    if (op == "pad") {
      const std::string mode = n->get_string("mode", "constant");
      const Attribute* value = n->attr("value");
      if (mode == "constant" && value != nullptr && value->as_float() != 0.0) return std::nullopt;
    } else if (op != "transpose" && op != "reshape") {
      return std::nullopt;
    }
    std::optional<DType> to;
    for (const Use& u : n->result()->uses()) {
      std::optional<DType> t = low_cast(u.user);
      if (!t || (to && *t != *to)) return std::nullopt;
      to = t;
    }
    return to;
  }

  /// The forward's casts of weight `w` to bf16/f16 (autocast's) become reads of a variable
  /// `<w>.<dtype>` holding that cast, which the step assigns from the cast of `next`, the value
  /// `w` is assigned: the cast is computed where the update is (one kernel with it once fused)
  /// instead of from the master weight again at the start of the next step. Every read sees
  /// the same value as before, so the step's results do not change.
  void keep_low_precision_copies(Builder& b, Value* w, Value* next) {
    Graph& g = b.graph();
    std::map<DType, std::vector<Node*>> casts, moves;
    auto add = [](std::vector<Node*>& list, Node* n) {
      if (std::find(list.begin(), list.end(), n) == list.end()) list.push_back(n);
    };
    for (const Use& u : w->uses()) {
      if (std::optional<DType> to = low_cast(u.user)) add(casts[*to], u.user);
      else if (std::optional<DType> moved = moved_then_cast(u.user)) add(moves[*moved], u.user);
    }
    for (const auto& [to, nodes] : moves) casts[to];  // a copy for the moved weight too
    Node* master = w->producer();
    const std::string name = master->get_string("name");
    for (const auto& [to, nodes] : casts) {
      const std::string copy_name = name + "." + std::string(dtype_name(to));
      for (const auto& n : g.nodes())
        if (n->op_name() == "variable" && n->get_string("name") == copy_name)
          throw BuildError{invalid_argument("optimizer: low-precision-copies: the copy of weight '" + name +
                                            "' would be variable '" + copy_name + "', a name the graph uses already")};
      // The copy's init is the master's init as the cast computes it (complete_state_copies
      // runs the cast's reference kernel).
      std::map<std::string, Tensor> init = {{name, master->attr("init")->as_tensor()}};
      AttrMap attrs{{"name", Attribute(copy_name)},
                    {"init", Attribute(Tensor(to, init.at(name).shape()))},
                    {"copy_of", Attribute(name)}};
      b.set_insertion_point(master);
      Value* copy = b.op("variable", {}, attrs, copy_name);
      b.set_insertion_point(nullptr);
      copy->set_sharding(w->sharding());
      Status s = complete_state_copies(g, init, [](const std::string&) { return Tensor(); });
      if (!s.ok()) throw BuildError{s};
      copy->producer()->set_attr("init", Attribute(init.at(copy_name)));
      auto erase = [&](Node* n) {
        Status erased = g.erase_node(n);
        if (!erased.ok()) throw BuildError{erased};
      };
      for (Node* n : nodes) {
        n->result()->replace_all_uses_with(copy);
        erase(n);
      }
      for (Node* move : moves[to]) {
        b.set_insertion_point(move);
        TensorType t = move->result()->type();
        t.dtype = to;
        auto made = g.create_node(move->op_name(), {copy}, {t}, move->attrs(), move);
        if (!made.ok()) throw BuildError{made.status()};
        (*made)->set_loc(move->loc());
        for (const Use& u : std::vector<Use>(move->result()->uses().begin(), move->result()->uses().end())) {
          u.user->result()->replace_all_uses_with((*made)->result());
          erase(u.user);
        }
        erase(move);
      }
      b.set_insertion_point(nullptr);
      b.op_n("assign", {b.cast(next, to)}, 0, {{"name", Attribute(copy_name)}});
    }
  }

  Value* sgd(Builder& b, const std::string& name, Value* p, Value* grad) {
    // torch.optim.SGD with dampening 0: the buffer starts as the first gradient (0 * 0 + g).
    Value* d = c_.weight_decay != 0 ? b.add(grad, b.mul(p, c_.weight_decay)) : grad;
    if (c_.momentum != 0) {
      const std::string buf_name = name + ".momentum_buffer";
      Value* old = state(b, buf_name, p->type(), p->sharding());
      Value* buf = b.add(b.mul(old, c_.momentum), d);
      assign(b, buf_name, old, buf);
      d = c_.nesterov ? b.add(d, b.mul(buf, c_.momentum)) : buf;
    }
    return b.sub(p, b.mul(d, c_.lr));
  }

  Value* adamw(Builder& b, const std::string& name, Value* p, Value* grad, Value* t) {
    // torch.optim.AdamW (single-tensor path): decoupled decay, then bias-corrected Adam.
    const std::string m_name = name + ".exp_avg", v_name = name + ".exp_avg_sq";
    Value* m = state(b, m_name, p->type(), p->sharding());
    Value* v = state(b, v_name, p->type(), p->sharding());
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
      {"low-precision-copies", OptionType::kBool, false,
       "keep each weight's bf16/f16 cast the forward reads (autocast's) as a variable '<param>.<dtype>' that the "
       "update writes, instead of casting every master weight again each step"},
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
    c.low_precision_copies = o.get_bool("low-precision-copies");
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
