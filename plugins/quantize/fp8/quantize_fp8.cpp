// The quantize-fp8 pass: linear/matmul with constant weights become quantize(activation) +
// scaled_matmul over weights quantized to E4M3 at compile time (per-tensor scales).
//
// Static mode reads the activations' calibrated max |x| from a scales file (`kiln calibrate`):
//   scale = amax / max_finite(format), q = saturate(round_to_nearest_even(x / scale))
// Weights get amax(w) / 448. The "fold into an FP8 GEMM" happens here: the pass emits one
// scaled_matmul node, which the CUDA lowering turns into one cuBLASLt FP8 GEMM with scale
// pointers; no separate fold pass is needed.
//
// Delayed mode keeps each activation's scale in graph state (variable/assign) instead:
//   run t quantizes with <x>.scale; history = [amax(x), history[0 .. H-2]] (newest first);
//   on runs where step % interval == 0 (step counts from 0), when max(history) is finite and
//   positive, <x>.scale becomes max(history) * 2^margin / max_finite(format) for run t + 1.
// The update is delayed_scaling.h's (shared with fp8-training), plus a step counter for the
// interval. Weights keep static scales computed here.
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../delayed_scaling.h"
#include "../output_layers.h"
#include "fp8.h"
#include "kiln/ir/walk.h"

namespace kiln::fp8 {
namespace {

struct Config {
  DType act = DType::kF8E4M3FN;  ///< activations' format; weights are always e4m3
  std::map<std::string, double> amax;
  std::string scales_file;
  std::string fallback = "none";
  int64_t min_size = 0;
  std::vector<std::string> include, exclude;
  bool keep_output_layers = false;
  bool delayed = false;
  int64_t history = 16, interval = 1, margin = 0;
};

/// The per-tensor scale for a tensor whose largest magnitude is `amax`; all-zero tensors get 1.
double scale_for(double amax, DType t) { return amax > 0 && std::isfinite(amax) ? amax / f8_max_finite(t) : 1.0; }

class QuantizeFp8 : public Pass {
 public:
  explicit QuantizeFp8(Config c) : c_(std::move(c)) {}

  StatusOr<bool> run(Graph& g) override {
    if (c_.keep_output_layers && g.parent_node() == nullptr) kept_ = output_layers(g);
    bool changed = false;
    KILN_RETURN_IF_ERROR(walk_graphs(g, [&](Graph& sub) -> StatusOr<WalkAction> {
      KILN_ASSIGN_OR_RETURN(bool c, quantize_graph(sub));
      changed |= c;
      // State lives only in the top-level graph: delayed mode leaves regions alone.
      return c_.delayed ? WalkAction::kSkip : WalkAction::kAdvance;
    }));
    return changed;
  }

 private:
  /// Quantizes the nodes of `g` itself (not those nested in its regions).
  StatusOr<bool> quantize_graph(Graph& g) {
    quantized_.clear();
    step_ = nullptr;
    names_.clear();
    for (const auto& n : g.nodes())
      if (n->op_name() == "variable") names_.insert(n->get_string("name"));
    bool changed = false;
    for (Node* n : g.node_list()) {
      KILN_ASSIGN_OR_RETURN(bool done, rewrite(g, *n));
      changed |= done;
    }
    return changed;
  }

  bool selected(const Node& n) const {
    auto matches = [&](const std::vector<std::string>& list) {
      for (const std::string& s : list)
        for (const Value* v : {n.operand(1), n.result()})
          if (!s.empty() && v->name().find(s) != std::string::npos) return true;
      return false;
    };
    return !kept_.count(&n) && (c_.include.empty() || matches(c_.include)) && !matches(c_.exclude);
  }

  StatusOr<bool> rewrite(Graph& g, Node& n) {
    const bool linear = n.op_name() == "linear";
    if ((!linear && n.op_name() != "matmul") || n.num_results() != 1) return false;
    const Tensor* w = constant_tensor(n.operand(1));
    Value* x = n.operand(0);
    const DType xt = x->dtype();
    if (w == nullptr || w->rank() != 2 || x->shape().empty() || !selected(n)) return false;
    if (xt != DType::kF32 && xt != DType::kF16 && xt != DType::kBF16) return false;
    const int64_t nn = w->shape()[linear ? 0 : 1], k = w->shape()[linear ? 1 : 0];
    if (k == 0 || nn == 0 || nn * k < c_.min_size) return false;
    double xs = 1;
    if (!c_.delayed) {
      auto it = c_.amax.find(x->name());
      if (it == c_.amax.end())
        return error_at(n.loc(), StatusCode::kNotFound,
                        "quantize-fp8: " + c_.scales_file + " has no amax for activation %" + x->name() +
                            " (input of " + n.op_name() + " %" + n.result()->name() + "); re-run kiln calibrate");
      if (std::isnan(it->second) || it->second < 0)
        return error_at(n.loc(), StatusCode::kInvalidArgument,
                        "quantize-fp8: amax of %" + x->name() + " in " + c_.scales_file +
                            " is not a non-negative number");
      xs = scale_for(it->second, c_.act);
    }

    // Weights as [N, K] rows (a matmul's [K, N] is transposed): the layout FP8 GEMMs need.
    const std::vector<double> src = w->to_f64();
    double wmax = 0;
    for (double v : src) wmax = std::max(wmax, std::fabs(v));
    const double ws = scale_for(wmax, DType::kF8E4M3FN);
    Tensor wq(DType::kF8E4M3FN, {nn, k});
    for (int64_t r = 0; r < nn; ++r)
      for (int64_t i = 0; i < k; ++i)
        wq.set_f64(r * k + i, src[static_cast<size_t>(linear ? r * k + i : i * nn + r)] / ws);

    const std::string base = n.operand(1)->name().empty() ? n.result()->name() : n.operand(1)->name();
    auto constant = [&](const Tensor& t, const std::string& name) -> StatusOr<Value*> {
      KILN_ASSIGN_OR_RETURN(Node * cn, g.create_node("constant", {}, {t.type()}, {{"value", Attribute(t)}}, &n, {name}));
      cn->set_loc(n.loc());
      return cn->result();
    };
    // Consumers of one activation (q, k and v projections) share its quantize node.
    auto& [xq, xsv] = quantized_[x];
    if (xq == nullptr) {
      if (c_.delayed) {
        KILN_ASSIGN_OR_RETURN(xsv, delayed_scale(g, n, x));
      } else {
        KILN_ASSIGN_OR_RETURN(xsv, constant(Tensor::scalar_f64(DType::kF32, xs), x->name() + ".scale"));
      }
      KILN_ASSIGN_OR_RETURN(Node * q, g.create_node("quantize", {x, xsv}, {TensorType{c_.act, x->shape()}},
                                                    {{"dtype", Attribute(c_.act)}}, &n, {x->name() + ".fp8"}));
      q->set_loc(n.loc());
      xq = q->result();
    }
    KILN_ASSIGN_OR_RETURN(Value * wqv, constant(wq, base + ".fp8"));
    KILN_ASSIGN_OR_RETURN(Value * wsv, constant(Tensor::scalar_f64(DType::kF32, ws), base + ".scale"));
    std::vector<Value*> operands = {xq, wqv, xsv, wsv};
    if (linear && n.num_operands() == 3) operands.push_back(n.operand(2));
    AttrMap attrs = {{"dtype", Attribute(n.result()->dtype())}};
    if (c_.fallback != "none") attrs["fallback"] = Attribute(c_.fallback);
    KILN_ASSIGN_OR_RETURN(Node * m, g.create_node("scaled_matmul", operands, {n.result()->type()}, std::move(attrs),
                                                  &n, {n.result()->name()}));
    m->set_loc(n.loc());
    std::vector<TensorType> types;
    for (const Value* v : operands) types.push_back(v->type());
    KILN_ASSIGN_OR_RETURN(std::vector<TensorType> out, infer_node_types(*m, std::move(types)));
    m->result()->set_type(out[0]);
    Value* old_w = n.operand(1);
    n.result()->replace_all_uses_with(m->result());
    KILN_RETURN_IF_ERROR(g.erase_node(&n));
    if (!old_w->has_uses() && old_w->producer() != nullptr) KILN_RETURN_IF_ERROR(g.erase_node(old_w->producer()));
    return true;
  }

  /// A node of `op` before `at` whose result types come from the shape rule; returns its
  /// result (null for an op without results).
  static StatusOr<Value*> make(Graph& g, Node& at, const std::string& op, std::vector<Value*> operands, AttrMap attrs,
                               const std::string& name = "") {
    const int results = OpRegistry::global().find(op)->fixed_outputs();
    std::vector<TensorType> types;
    for (const Value* v : operands) types.push_back(v->type());
    std::vector<std::string> names(static_cast<size_t>(results));
    if (results > 0) names[0] = name;
    KILN_ASSIGN_OR_RETURN(Node * m, g.create_node(op, operands, std::vector<TensorType>(static_cast<size_t>(results)),
                                                  std::move(attrs), &at, names));
    m->set_loc(at.loc());
    KILN_ASSIGN_OR_RETURN(std::vector<TensorType> out, infer_node_types(*m, std::move(types)));
    if (results == 0) return static_cast<Value*>(nullptr);
    for (int i = 0; i < results; ++i) m->result(i)->set_type(out[static_cast<size_t>(i)]);
    return m->result();
  }

  static StatusOr<Value*> scalar(Graph& g, Node& at, DType t, double v) {
    return make(g, at, "constant", {}, {{"value", Attribute(Tensor::scalar_f64(t, v))}});
  }

  /// A variable name not yet taken in this graph: `base`, else base.1, base.2, ...
  std::string fresh_name(const std::string& base) {
    std::string name = base;
    for (int i = 1; names_.count(name); ++i) name = base + "." + std::to_string(i);
    names_.insert(name);
    return name;
  }

  /// The shared step counter (read before this run's increment), made on first use.
  StatusOr<Value*> step_counter(Graph& g, Node& at) {
    if (step_ != nullptr) return step_;
    const std::string name = fresh_name("fp8.step");
    KILN_ASSIGN_OR_RETURN(step_, make(g, at, "variable", {},
                                      {{"name", Attribute(name)}, {"init", Attribute(Tensor::scalar_i64(DType::kI64, 0))}},
                                      name));
    KILN_ASSIGN_OR_RETURN(Value * one, scalar(g, at, DType::kI64, 1));
    KILN_ASSIGN_OR_RETURN(Value * next, make(g, at, "add", {step_, one}, {}));
    KILN_RETURN_IF_ERROR(make(g, at, "assign", {next}, {{"name", Attribute(name)}}).status());
    return step_;
  }

  /// Delayed scaling of activation `x` (see the file comment): returns the scale this run uses
  /// and adds, before `at`, the nodes that roll the amax history and compute the next scale.
  StatusOr<Value*> delayed_scale(Graph& g, Node& at, Value* x) {
    const std::string base = x->name().empty() ? "fp8.act" : x->name();
    const std::string hist_name = fresh_name(base + ".amax_history"), scale_name = fresh_name(base + ".scale");
    KILN_ASSIGN_OR_RETURN(Value * scale, make(g, at, "variable", {},
                                              {{"name", Attribute(scale_name)},
                                               {"init", Attribute(Tensor::scalar_f64(DType::kF32, 1.0))}},
                                              scale_name));
    Value* due = nullptr;
    if (c_.interval > 1) {  // the scale changes on runs where step % interval == 0
      KILN_ASSIGN_OR_RETURN(Value * step, step_counter(g, at));
      KILN_ASSIGN_OR_RETURN(Value * every, scalar(g, at, DType::kI64, static_cast<double>(c_.interval)));
      KILN_ASSIGN_OR_RETURN(Value * izero, scalar(g, at, DType::kI64, 0));
      KILN_ASSIGN_OR_RETURN(Value * phase, make(g, at, "mod", {step, every}, {}));
      KILN_ASSIGN_OR_RETURN(due, make(g, at, "equal", {phase, izero}, {}));
    }
    DelayedScaling recipe;
    recipe.history = c_.history;
    recipe.margin = c_.margin;
    MakeNode here = [&](const std::string& op, std::vector<Value*> operands, AttrMap attrs, const std::string& name) {
      return make(g, at, op, std::move(operands), std::move(attrs), name);
    };
    KILN_RETURN_IF_ERROR(build_delayed_scaling(here, x, scale, hist_name, scale_name, recipe, c_.act, due).status());
    return scale;
  }

  Config c_;
  std::set<const Node*> kept_;  // keep-output-layers: the top-level graph's output layers
  std::map<const Value*, std::pair<Value*, Value*>> quantized_;  // activation -> (quantized, scale)
  Value* step_ = nullptr;           // delayed mode: the step counter's value in this graph
  std::set<std::string> names_;     // variable names taken in this graph
};

}  // namespace

StatusOr<std::map<std::string, double>> read_scales(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found("quantize-fp8: cannot open scales file '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  auto bad = [&](size_t at, const std::string& what) {
    return invalid_argument("quantize-fp8: " + path + ": offset " + std::to_string(at) + ": " + what);
  };
  size_t i = text.find("\"amax\"");
  if (i == std::string::npos) return bad(0, "no \"amax\" object (expected the format kiln calibrate writes)");
  i = text.find_first_not_of(" \t\r\n:", i + 6);
  if (i == std::string::npos || text[i] != '{') return bad(i, "\"amax\" must be an object");
  std::map<std::string, double> out;
  auto skip = [&] { i = text.find_first_not_of(" \t\r\n,", i); };
  for (++i, skip(); i != std::string::npos && text[i] != '}'; skip()) {
    if (text[i] != '"') return bad(i, "expected a quoted value name");
    std::string name;
    for (++i; i < text.size() && text[i] != '"'; ++i) {
      if (text[i] == '\\' && i + 1 < text.size()) ++i;
      name += text[i];
    }
    i = text.find_first_not_of(" \t\r\n", i + 1);
    if (i == std::string::npos || text[i] != ':') return bad(i, "expected ':' after \"" + name + "\"");
    const char* start = text.c_str() + i + 1;
    char* end = nullptr;
    const double v = std::strtod(start, &end);
    if (end == start) return bad(i + 1, "amax of \"" + name + "\" is not a number");
    out[name] = v;
    i = static_cast<size_t>(end - text.c_str());
  }
  if (i == std::string::npos) return bad(text.size(), "unterminated \"amax\" object");
  return out;
}

PassInfo quantize_fp8_pass_info() {
  PassInfo info;
  info.name = "quantize-fp8";
  info.version = "0.1.0";
  info.summary = "linear/matmul with constant weights -> quantize + scaled_matmul (FP8 E4M3, per-tensor scales)";
  info.options = {
      {"format", OptionType::kString, std::string("e4m3"), "activation format: e4m3 or e5m2 (weights are always e4m3)"},
      {"mode", OptionType::kString, std::string("static"), "static (calibrated scales file) or delayed (amax history)"},
      {"scales", OptionType::kString, std::string(""), "scales file written by `kiln calibrate` (static mode)"},
      {"history", OptionType::kInt, int64_t{16}, "delayed mode: amax history length"},
      {"interval", OptionType::kInt, int64_t{1}, "delayed mode: recompute scales every N steps"},
      {"margin", OptionType::kInt, int64_t{0},
       "delayed mode: scales leave 2^margin headroom (scale = max(history) * 2^margin / max_finite)"},
      {"fallback", OptionType::kString, std::string("none"),
       "targets without FP8 (sm_80): none refuses, bf16 runs a GEMM on dequantized weights (bf16 for bf16 models)"},
      {"min-size", OptionType::kInt, int64_t{0}, "smallest weight (elements) worth quantizing"},
      {"include", OptionType::kStringList, std::vector<std::string>{},
       "only nodes whose weight or result name contains one of these (empty: all)"},
      {"exclude", OptionType::kStringList, std::vector<std::string>{},
       "skip nodes whose weight or result name contains one of these"},
      {"keep-output-layers", OptionType::kBool, false,
       "skip the contractions that compute a graph output (lm_head, a classifier's last layer)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    Config c;
    const std::string& format = o.get_string("format");
    const std::string& mode = o.get_string("mode");
    c.fallback = o.get_string("fallback");
    c.min_size = o.get_int("min-size");
    c.include = o.get_strings("include");
    c.exclude = o.get_strings("exclude");
    c.keep_output_layers = o.get_bool("keep-output-layers");
    c.scales_file = o.get_string("scales");
    if (format != "e4m3" && format != "e5m2")
      return invalid_argument("quantize-fp8: format must be e4m3 or e5m2, got '" + format + "'");
    c.act = format == "e4m3" ? DType::kF8E4M3FN : DType::kF8E5M2;
    if (c.fallback != "none" && c.fallback != "bf16")
      return invalid_argument("quantize-fp8: fallback must be none or bf16, got '" + c.fallback + "'");
    if (c.min_size < 0)
      return invalid_argument("quantize-fp8: min-size must be at least 0, got " + std::to_string(c.min_size));
    if (o.get_int("history") < 1 || o.get_int("interval") < 1)
      return invalid_argument("quantize-fp8: history and interval must be at least 1");
    if (mode != "static" && mode != "delayed")
      return invalid_argument("quantize-fp8: mode must be static or delayed, got '" + mode + "'");
    c.history = o.get_int("history");
    c.interval = o.get_int("interval");
    c.margin = o.get_int("margin");
    if (c.margin < -64 || c.margin > 64)
      return invalid_argument("quantize-fp8: margin must be within [-64, 64], got " + std::to_string(c.margin));
    if (mode == "delayed") {
      if (!c.scales_file.empty())
        return invalid_argument("quantize-fp8: mode=delayed computes scales at run time; drop scales=" + c.scales_file);
      c.delayed = true;
      return std::unique_ptr<Pass>(std::make_unique<QuantizeFp8>(std::move(c)));
    }
    if (c.scales_file.empty())
      return invalid_argument("quantize-fp8: mode=static needs scales=FILE (write one with kiln calibrate)");
    KILN_ASSIGN_OR_RETURN(c.amax, read_scales(c.scales_file));
    return std::unique_ptr<Pass>(std::make_unique<QuantizeFp8>(std::move(c)));
  };
  return info;
}

}  // namespace kiln::fp8
