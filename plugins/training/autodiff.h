// Private to the kiln-training plugin: reverse-mode differentiation of a graph (the autodiff
// pass) and the table of gradient rules it uses, one entry per op.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "builder.h"
#include "kiln/core/registry.h"

namespace kiln::training {

/// What the rule table says about an op.
enum class RuleKind {
  kMissing,           ///< nothing known: autodiff stops with "no gradient rule for op ..."
  kRule,              ///< a gradient rule (checked against finite differences)
  kNonDifferentiable, ///< results carry no gradient (integer/bool results, piecewise constant)
  kRefused,           ///< known but not differentiated here; the reason says why
};

/// What a rule sees: the forward node (its operands are values of the joint graph), the
/// gradient of each result (null where none reaches it) and which operands need one.
struct GradContext {
  Builder& b;
  const Node& node;
  std::vector<Value*> result_grads;
  std::vector<bool> needs;

  Value* x(int i) const { return node.operand(i); }
  Value* y(int i = 0) const { return node.result(i); }
  /// The gradient of result i, zeros where none reached it.
  Value* g(int i = 0);
  bool wants(int i) const { return i < static_cast<int>(needs.size()) && needs[static_cast<size_t>(i)]; }
};

/// Returns one gradient per operand (null: none, or not needed).
using GradRule = std::function<std::vector<Value*>(GradContext&)>;

struct RuleEntry {
  RuleKind kind = RuleKind::kMissing;
  GradRule rule;       ///< set for kRule
  std::string reason;  ///< set for kRefused and kNonDifferentiable
  /// The op is the identity in the forward and exists for its gradient (quantize_grad):
  /// autodiff replaces it by its first operand once the backward is built.
  bool gradient_only = false;
};

/// The entry for `op` (kMissing when the table has none).
const RuleEntry& rule_for(const std::string& op);
/// Ops the table names, with their entries (for the coverage test and docs).
const std::map<std::string, RuleEntry>& rule_table();

/// What the autodiff pass differentiates.
struct AutodiffConfig {
  std::string loss;                 ///< output name; "" = the graph's only output
  std::vector<std::string> params;  ///< value names; empty = every trainable weight
  std::string grad_suffix = ".grad";
  /// > 0: dynamic loss scaling (fp16): the backward is seeded with a variable `scaler.scale`
  /// (this its first value) instead of 1, so the '.grad' outputs are scaled; the optimizer pass
  /// unscales them, skips steps with inf/nan and grows or backs off the scale.
  double init_loss_scale = 0;
};

/// The variable holding the dynamic loss scale (autodiff creates it, optimizer updates it).
inline constexpr const char* kLossScaleVariable = "scaler.scale";

/// Adds to `g` the backward of output `loss` with respect to `params` and one output per
/// parameter, named parameter name + grad_suffix. Fused nodes are inlined first (their
/// gradients come from their regions). Returns the parameter values differentiated.
StatusOr<std::vector<Value*>> differentiate(Graph& g, const AutodiffConfig& config);

/// The top-level graph input or node result named `name`, or null.
Value* find_named_value(const Graph& g, const std::string& name);

/// The weights `params = []` means: float `constant`s of rank >= 1 and float `variable`s that
/// the loss depends on through float values, in graph order.
std::vector<Value*> trainable_weights(const Graph& g, const Value* loss);

PassInfo autocast_pass_info();
PassInfo autodiff_pass_info();
PassInfo optimizer_pass_info();
PassInfo remat_pass_info();
PassInfo decompose_losses_pass_info();
PassInfo chunk_cross_entropy_pass_info();
PassInfo fp8_training_pass_info();
PassInfo accumulate_gemm_pass_info();

}  // namespace kiln::training
