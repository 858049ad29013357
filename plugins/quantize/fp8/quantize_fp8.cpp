// The quantize-fp8 pass: linear/matmul with constant weights become quantize(activation) +
// scaled_matmul over weights quantized to E4M3 at compile time (per-tensor scales).
//
// Static mode reads the activations' calibrated max |x| from a scales file (`kiln calibrate`):
//   scale = amax / max_finite(format), q = saturate(round_to_nearest_even(x / scale))
// Weights get amax(w) / 448. The "fold into an FP8 GEMM" happens here: the pass emits one
// scaled_matmul node, which the CUDA lowering turns into one cuBLASLt FP8 GEMM with scale
// pointers; no separate fold pass is needed.
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fp8.h"

namespace kiln::fp8 {
namespace {

struct Config {
  DType act = DType::kF8E4M3FN;  ///< activations' format; weights are always e4m3
  std::map<std::string, double> amax;
  std::string scales_file;
  std::string fallback = "none";
  int64_t min_size = 0;
  std::vector<std::string> include, exclude;
};

double max_finite(DType t) { return t == DType::kF8E4M3FN ? 448.0 : 57344.0; }

/// The per-tensor scale for a tensor whose largest magnitude is `amax`; all-zero tensors get 1.
double scale_for(double amax, DType t) { return amax > 0 && std::isfinite(amax) ? amax / max_finite(t) : 1.0; }

class QuantizeFp8 : public Pass {
 public:
  explicit QuantizeFp8(Config c) : c_(std::move(c)) {}

  StatusOr<bool> run(Graph& g) override {
    quantized_.clear();
    bool changed = false;
    for (Node* n : g.node_list()) {
      for (int r = 0; r < n->num_regions(); ++r) {
        KILN_ASSIGN_OR_RETURN(bool sub, run(n->region(r)));
        changed |= sub;
      }
      KILN_ASSIGN_OR_RETURN(bool done, rewrite(g, *n));
      changed |= done;
    }
    return changed;
  }

 private:
  bool selected(const Node& n) const {
    auto matches = [&](const std::vector<std::string>& list) {
      for (const std::string& s : list)
        for (const Value* v : {n.operand(1), n.result()})
          if (!s.empty() && v->name().find(s) != std::string::npos) return true;
      return false;
    };
    return (c_.include.empty() || matches(c_.include)) && !matches(c_.exclude);
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
    auto it = c_.amax.find(x->name());
    if (it == c_.amax.end())
      return error_at(n.loc(), StatusCode::kNotFound,
                      "quantize-fp8: " + c_.scales_file + " has no amax for activation %" + x->name() +
                          " (input of " + n.op_name() + " %" + n.result()->name() + "); re-run kiln calibrate");
    if (std::isnan(it->second) || it->second < 0)
      return error_at(n.loc(), StatusCode::kInvalidArgument,
                      "quantize-fp8: amax of %" + x->name() + " in " + c_.scales_file + " is not a non-negative number");

    // Weights as [N, K] rows (a matmul's [K, N] is transposed): the layout FP8 GEMMs need.
    const std::vector<double> src = w->to_f64();
    double wmax = 0;
    for (double v : src) wmax = std::max(wmax, std::fabs(v));
    const double ws = scale_for(wmax, DType::kF8E4M3FN), xs = scale_for(it->second, c_.act);
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
      KILN_ASSIGN_OR_RETURN(xsv, constant(Tensor::scalar_f64(DType::kF32, xs), x->name() + ".scale"));
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

  Config c_;
  std::map<const Value*, std::pair<Value*, Value*>> quantized_;  // activation -> (quantized, scale)
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
      {"fallback", OptionType::kString, std::string("none"),
       "targets without FP8 (sm_80): none refuses, bf16 runs a GEMM on dequantized weights (bf16 for bf16 models)"},
      {"min-size", OptionType::kInt, int64_t{0}, "smallest weight (elements) worth quantizing"},
      {"include", OptionType::kStringList, std::vector<std::string>{},
       "only nodes whose weight or result name contains one of these (empty: all)"},
      {"exclude", OptionType::kStringList, std::vector<std::string>{},
       "skip nodes whose weight or result name contains one of these"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    Config c;
    const std::string& format = o.get_string("format");
    const std::string& mode = o.get_string("mode");
    c.fallback = o.get_string("fallback");
    c.min_size = o.get_int("min-size");
    c.include = o.get_strings("include");
    c.exclude = o.get_strings("exclude");
    c.scales_file = o.get_string("scales");
    if (format != "e4m3" && format != "e5m2")
      return invalid_argument("quantize-fp8: format must be e4m3 or e5m2, got '" + format + "'");
    c.act = format == "e4m3" ? DType::kF8E4M3FN : DType::kF8E5M2;
    if (c.fallback != "none" && c.fallback != "bf16")
      return invalid_argument("quantize-fp8: fallback must be none or bf16, got '" + c.fallback + "'");
    if (o.get_int("history") < 1 || o.get_int("interval") < 1)
      return invalid_argument("quantize-fp8: history and interval must be at least 1");
    if (mode == "delayed")
      return Status(StatusCode::kUnimplemented,
                    "quantize-fp8: mode=delayed is not implemented yet (it needs persistent amax-history "
                    "buffers in the plan); use mode=static with a scales file from kiln calibrate");
    if (mode != "static") return invalid_argument("quantize-fp8: mode must be static or delayed, got '" + mode + "'");
    if (c.scales_file.empty())
      return invalid_argument("quantize-fp8: mode=static needs scales=FILE (write one with kiln calibrate)");
    KILN_ASSIGN_OR_RETURN(c.amax, read_scales(c.scales_file));
    return std::unique_ptr<Pass>(std::make_unique<QuantizeFp8>(std::move(c)));
  };
  return info;
}

}  // namespace kiln::fp8
