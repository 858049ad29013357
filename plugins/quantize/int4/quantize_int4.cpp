// The kiln-quantize-int4 plugin: the quantize-int4 pass, which replaces linear and matmul nodes
// whose weights are constants by matmul_int4 with the weights quantized at compile time.
//
// Per row of the weight and group of `group-size` input features (round to nearest):
//   symmetric:  scale = r * max|w| / 7, q = clamp(round(w / scale), -8, 7)
//   asymmetric: scale = r * (max - min) / 15, zero = clamp(round(-r * min / scale), 0, 15),
//               q = clamp(round(w / scale) + zero, 0, 15)
// with the clip ratio r in 1, 0.96, ..., 0.6 that gives the group the least squared error.
// The scale is rounded to scale-dtype before q is computed, so q is chosen against the scale
// the kernel will use. The packed layout is the one ir/src/ops/int4.cpp documents.
#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kiln/ir/op.h"
#include "kiln/ir/walk.h"
#include "kiln/plugin.h"
#include "../output_layers.h"

namespace kiln {
namespace {

struct Config {
  int64_t group = 128;
  bool symmetric = true;
  DType scale_dtype = DType::kF16;
  int64_t min_size = 0;
  std::vector<std::string> exclude;
  bool keep_output_layers = false;
};

/// The quantized form of one [N, K] weight.
struct Quantized {
  Tensor w, scales, zeros;
};

/// Nibble of `v` for a group with `scale` (already rounded to the scale dtype) and `zero`.
int nibble(double v, double scale, double zero, bool symmetric) {
  const double x = scale > 0 ? std::nearbyint(v / scale) + zero : zero;
  return symmetric ? static_cast<int>(std::clamp(x, -8.0, 7.0)) & 0xF : static_cast<int>(std::clamp(x, 0.0, 15.0));
}

double dequant(int nib, double scale, double zero, bool symmetric) {
  return (symmetric ? (nib >= 8 ? nib - 16 : nib) : nib - zero) * scale;
}

/// Scale and zero of one group. The plain choice (the whole range on the grid) is only the
/// start: clipping the range a little trades a few saturated outliers for a finer step, and
/// the clip ratio with the least squared error over the group wins (the clip search of AWQ
/// and llama.cpp's quantizers).
std::pair<double, double> choose(const double* v, int64_t n, const Config& c) {
  double lo = v[0], hi = v[0];
  for (int64_t i = 1; i < n; ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
  const Tensor rounder(c.scale_dtype, {1});
  auto round_scale = [&](double s) {
    Tensor t = rounder;
    t.set_f64(0, s);
    return t.get_f64(0);
  };
  double best_err = -1, best_scale = 1, best_zero = 0;
  for (int step = 0; step <= 10; ++step) {
    const double ratio = 1.0 - 0.04 * step;
    double scale, zero = 0;
    if (c.symmetric) {
      scale = round_scale(std::max(std::fabs(lo), std::fabs(hi)) * ratio / 7);
    } else {
      // A constant group gets the scale |value| (or 1), so that it is represented exactly.
      const double range = (hi - lo) * ratio;
      scale = round_scale(range > 0 ? range / 15 : (hi != 0 ? std::fabs(hi) : 1.0));
      zero = scale > 0 ? std::clamp(std::nearbyint(-lo * ratio / scale), 0.0, 15.0) : 0;
    }
    double err = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double d = v[i] - dequant(nibble(v[i], scale, zero, c.symmetric), scale, zero, c.symmetric);
      err += d * d;
    }
    if (best_err < 0 || err < best_err) best_err = err, best_scale = scale, best_zero = zero;
  }
  return {best_scale, best_zero};
}

Quantized quantize(const std::vector<double>& w, int64_t n, int64_t k, const Config& c) {
  const int64_t groups = k / c.group;
  Quantized q{Tensor(DType::kU8, {n, k / 2}), Tensor(c.scale_dtype, {n, groups}),
              c.symmetric ? Tensor() : Tensor(c.scale_dtype, {n, groups})};
  uint8_t* packed = q.w.mutable_data_as<uint8_t>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const double* v = w.data() + r * k + gi * c.group;
      const auto [scale, zero] = choose(v, c.group, c);
      const int64_t at = r * groups + gi;
      q.scales.set_f64(at, scale);
      if (!c.symmetric) q.zeros.set_f64(at, zero);
      for (int64_t i = 0; i < c.group; ++i) {
        const int64_t e = gi * c.group + i;
        packed[r * (k / 2) + e / 2] |= static_cast<uint8_t>(nibble(v[i], scale, zero, c.symmetric) << (e % 2 * 4));
      }
    }
  return q;
}

class QuantizeInt4 : public Pass {
 public:
  explicit QuantizeInt4(Config c) : c_(std::move(c)) {}

  StatusOr<bool> run(Graph& g) override {
    if (c_.keep_output_layers && g.parent_node() == nullptr) kept_ = output_layers(g);
    bool changed = false;
    auto visit = [&](Node& n) -> Status {
      KILN_ASSIGN_OR_RETURN(bool done, rewrite(*n.graph(), n));
      changed |= done;
      return ok_status();
    };
    // Post-order: the nodes in a node's regions are rewritten before the node.
    KILN_RETURN_IF_ERROR(walk(g, visit, {.order = WalkOrder::kPostOrder}));
    return changed;
  }

 private:
  bool excluded(const Node& n) const {
    if (kept_.count(&n)) return true;
    for (const std::string& s : c_.exclude)
      for (const Value* v : {n.operand(1), n.result()})
        if (!s.empty() && v->name().find(s) != std::string::npos) return true;
    return false;
  }

  /// Replaces `n` when it is a linear (w [N, K]) or a matmul by a 2-D weight (b [K, N]) whose
  /// weight is a float constant and whose shapes the INT4 layout can hold.
  StatusOr<bool> rewrite(Graph& g, Node& n) {
    const bool linear = n.op_name() == "linear";
    if ((!linear && n.op_name() != "matmul") || n.num_results() != 1) return false;
    const Tensor* w = constant_tensor(n.operand(1));
    const DType xt = n.operand(0)->dtype();
    if (w == nullptr || w->rank() != 2 || n.operand(0)->shape().empty() || excluded(n)) return false;
    if (xt != DType::kF32 && xt != DType::kF16 && xt != DType::kBF16) return false;
    const int64_t nn = w->shape()[linear ? 0 : 1], k = w->shape()[linear ? 1 : 0];
    if (k == 0 || nn == 0 || k % c_.group != 0 || nn * k < c_.min_size) return false;
    // Weights as [N, K] rows: a matmul's [K, N] is transposed.
    const std::vector<double> src = w->to_f64();
    std::vector<double> rows(src.size());
    for (int64_t r = 0; r < nn; ++r)
      for (int64_t i = 0; i < k; ++i)
        rows[static_cast<size_t>(r * k + i)] = src[static_cast<size_t>(linear ? r * k + i : i * nn + r)];
    const Quantized q = quantize(rows, nn, k, c_);

    const std::string base = n.operand(1)->name().empty() ? n.result()->name() : n.operand(1)->name();
    auto constant = [&](const Tensor& t, const std::string& suffix) -> StatusOr<Value*> {
      KILN_ASSIGN_OR_RETURN(Node * cn, g.create_node("constant", {}, {t.type()}, {{"value", Attribute(t)}}, &n,
                                                     {base.empty() ? "" : base + suffix}));
      cn->set_loc(n.loc());
      return cn->result();
    };
    std::vector<Value*> operands = {n.operand(0)};
    KILN_ASSIGN_OR_RETURN(Value * qw, constant(q.w, ".int4"));
    KILN_ASSIGN_OR_RETURN(Value * qs, constant(q.scales, ".scales"));
    operands.push_back(qw);
    operands.push_back(qs);
    if (!c_.symmetric) {
      KILN_ASSIGN_OR_RETURN(Value * qz, constant(q.zeros, ".zeros"));
      operands.push_back(qz);
    }
    if (linear && n.num_operands() == 3) operands.push_back(n.operand(2));
    AttrMap attrs = {{"group_size", Attribute(c_.group)}};
    if (!c_.symmetric) attrs["asymmetric"] = Attribute(int64_t{1});
    KILN_ASSIGN_OR_RETURN(Node * m, g.create_node("matmul_int4", operands, {n.result()->type()}, std::move(attrs), &n,
                                                  {n.result()->name()}));
    m->set_loc(n.loc());
    std::vector<TensorType> types;
    for (const Value* v : operands) types.push_back(v->type());
    KILN_RETURN_IF_ERROR(infer_node_types(*m, std::move(types)).status());
    Value* old_w = n.operand(1);
    n.result()->replace_all_uses_with(m->result());
    KILN_RETURN_IF_ERROR(g.erase_node(&n));
    if (!old_w->has_uses() && old_w->producer() != nullptr) KILN_RETURN_IF_ERROR(g.erase_node(old_w->producer()));
    return true;
  }

  Config c_;
  std::set<const Node*> kept_;  // keep-output-layers: the top-level graph's output layers
};

PassInfo quantize_int4_pass_info() {
  PassInfo info;
  info.name = "quantize-int4";
  info.version = "0.1.0";
  info.summary = "replace linear/matmul with constant weights by matmul_int4 (weight-only int4, group scales)";
  info.options = {
      {"group-size", OptionType::kInt, int64_t{128}, "input features per scale: 32, 64 or 128"},
      {"symmetric", OptionType::kBool, true, "signed nibbles and scales only; false adds a zero point per group"},
      {"scale-dtype", OptionType::kString, std::string("f16"), "dtype of scales and zeros: f16 or bf16"},
      {"min-size", OptionType::kInt, int64_t{0}, "smallest weight (elements) worth quantizing"},
      {"exclude", OptionType::kStringList, std::vector<std::string>{},
       "skip nodes whose weight or result name contains one of these"},
      {"keep-output-layers", OptionType::kBool, false,
       "skip the contractions that compute a graph output (lm_head, a classifier's last layer)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    Config c;
    c.group = o.get_int("group-size");
    c.symmetric = o.get_bool("symmetric");
    c.min_size = o.get_int("min-size");
    c.exclude = o.get_strings("exclude");
    c.keep_output_layers = o.get_bool("keep-output-layers");
    const std::string& sd = o.get_string("scale-dtype");
    if (c.group != 32 && c.group != 64 && c.group != 128)
      return invalid_argument("quantize-int4: group-size must be 32, 64 or 128, got " + std::to_string(c.group));
    if (c.min_size < 0)
      return invalid_argument("quantize-int4: min-size must be at least 0, got " + std::to_string(c.min_size));
    if (sd != "f16" && sd != "bf16")
      return invalid_argument("quantize-int4: scale-dtype must be f16 or bf16, got '" + sd + "'");
    c.scale_dtype = sd == "f16" ? DType::kF16 : DType::kBF16;
    return std::unique_ptr<Pass>(std::make_unique<QuantizeInt4>(std::move(c)));
  };
  return info;
}

Status register_quantize_int4(Registry& r) { return r.add_pass(quantize_int4_pass_info()); }

}  // namespace
}  // namespace kiln

KILN_PLUGIN("kiln-quantize-int4", "0.1.0", kiln::register_quantize_int4)
