// The fp8-training pass and the gradient rules of the FP8 ops: FP8 training with delayed
// scaling, Transformer Engine's recipe expressed in the graph.
//
// Before autodiff, each selected contraction y = linear(x, w, b) (or matmul(x, w) with a 2-D w)
// becomes
//   xq = quantize(x, x.fp8_scale) {e4m3}      wq = quantize(w, w.fp8_scale) {e4m3}
//   y  = scaled_matmul(xq, wq, x.fp8_scale, w.fp8_scale, b)       one FP8 GEMM
//   y' = quantize_grad(y, y.grad.fp8_scale) {e5m2}                 identity in the forward
// and autodiff then builds the backward GEMMs as FP8 GEMMs too: quantize_grad's rule quantizes
// the gradient dy to E5M2 with its own delayed scale, and scaled_matmul's rule computes
// dx = dy_q @ w_q and dw = dy_qᵀ @ x_q with scaled_matmul. Weights stay f32 (master weights):
// they are re-quantized from the f32 value every step.
//
// Every quantized tensor t has two variables: t.fp8_scale (the scale this step divides by) and
// t.amax_history (newest first), updated every step by quantize-fp8's delayed scaling
// (../quantize/delayed_scaling.h). Kiln's scale divides (q = x / scale), the reciprocal of
// Transformer Engine's scale. While a tensor's history is still empty (the first step) it is
// quantized with its own amax's scale (initial-scale=current), not with 1: at a realistic size
// the first step's gradients (1e-5 .. 1e-8) lie below E5M2's smallest subnormal (2^-16), and a
// flushed first gradient leaves Adam's first update of those weights at zero, a step behind.
//
// An f8 value's gradient is the gradient of the real number it stands for (q * its scale),
// carried in f32: quantize and dequantize pass gradients straight through.
#include <map>
#include <set>

#include "autodiff.h"
#include "fp8_training.h"

namespace kiln::training {
namespace {

bool is_f8(DType t) { return t == DType::kF8E4M3FN || t == DType::kF8E5M2; }

bool low_or_f32(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

DType format_of(const Node& n) {
  const Attribute* a = n.attr("dtype");
  return a != nullptr && a->kind() == AttrKind::kDType ? a->as_dtype() : DType::kF8E5M2;
}

}  // namespace

Value* delayed_scale_update(Builder& b, Value* x, Value* scale, const std::string& history_name,
                            const DelayedScaling& recipe, DType format) {
  MakeNode make = [&b](const std::string& op, std::vector<Value*> operands, AttrMap attrs,
                       const std::string& name) -> StatusOr<Value*> {
    try {
      const int results = OpRegistry::global().find(op)->fixed_outputs();
      std::vector<Value*> made = b.op_n(op, std::move(operands), results, std::move(attrs));
      if (results == 0) return static_cast<Value*>(nullptr);
      if (!name.empty()) made[0]->set_name(name);
      return made[0];
    } catch (const BuildError& e) {
      return e.status;
    }
  };
  auto next = build_delayed_scaling(make, x, scale, history_name, scale->producer()->get_string("name"), recipe, format);
  if (!next.ok()) throw BuildError{next.status()};
  return *next;
}

Value* delayed_quantize(Builder& b, Value* x, Value* delayed, Value* now, DType format, const std::string& name) {
  if (now == delayed) return b.op("quantize", {x, delayed}, {{"dtype", Attribute(format)}}, name);
  // The quantize with the delayed scale waits for no amax, so it can be stored by the kernel
  // that computes x; requantize redoes it with the just-in-time scale only where the two differ
  // (the first step), and is free on every later step.
  Value* q = b.op("quantize", {x, delayed}, {{"dtype", Attribute(format)}}, name + ".delayed");
  return b.op("requantize", {x, q, delayed, now}, {}, name);
}

// --- the quantize_grad op ----------------------------------------------------------------

Status register_fp8_training_ops() {
  OpRegistry& r = OpRegistry::global();
  if (r.find(kQuantizeGradOp) != nullptr) return ok_status();
  OpDef def{
      .name = kQuantizeGradOp,
      .summary = "identity in the forward; autodiff quantizes the gradient flowing back through it to f8 "
                 "(delayed per-tensor scaling, fp8-training)",
      .traits = kTraitNone,
      .inputs = {"x", "scale"},
      .outputs = {"y"},
      .result_rule = "same as x",
      .attrs = {AttrSpec{"dtype", AttrKind::kDType, false, Attribute(DType::kF8E5M2), "the gradient's f8 format"},
                AttrSpec{"state", AttrKind::kString, true, std::nullopt,
                         "the gradient's state name: variables <state>.amax_history (and the scale operand)"},
                AttrSpec{"history", AttrKind::kInt, false, Attribute(int64_t{16}), "amax history length"},
                AttrSpec{"algorithm", AttrKind::kString, false, Attribute("max"), "max or most_recent"},
                AttrSpec{"margin", AttrKind::kInt, false, Attribute(int64_t{0}), "scales leave 2^margin headroom"},
                AttrSpec{"current_until_history", AttrKind::kInt, false, Attribute(int64_t{0}),
                         "1: while the history is empty, quantize with the current amax's scale"}},
      .num_regions = 0,
      .infer = [](InferContext& c) -> Status {
        const TensorType& s = c.operand(1);
        if (!low_or_f32(c.operand(0).dtype))
          return c.error("operand 'x' must be f32, bf16 or f16, got " + c.operand(0).str());
        if (s.dtype != DType::kF32 || s.rank() != 0) return c.error("operand 'scale' must be f32[], got " + s.str());
        if (!is_f8(format_of(c.node)))
          return c.error("attribute 'dtype' must be f8e4m3fn or f8e5m2");
        c.results = {c.operand(0)};
        return ok_status();
      },
      .reference = [](KernelContext& c) -> Status {
        c.output() = c.input(0);
        return ok_status();
      }};
  def.library = "kiln-training";
  return r.add(std::move(def));
}

// --- gradient rules ----------------------------------------------------------------------

std::vector<Value*> quantize_grad_rule(GradContext& c) {
  Builder& b = c.b;
  const Node& n = c.node;
  DelayedScaling recipe;
  recipe.history = n.get_int("history", 16);
  recipe.algorithm = n.get_string("algorithm", "max");
  recipe.margin = n.get_int("margin", 0);
  const DType fmt = format_of(n);
  Value* g = c.g();
  recipe.current_until_history = n.get_int("current_until_history", 0) != 0;
  // This step's gradient is quantized with the scale from earlier steps' amaxes (delayed).
  Value* scale = delayed_scale_update(b, g, c.x(1), n.get_string("state") + ".amax_history", recipe, fmt);
  Value* q = delayed_quantize(b, g, c.x(1), scale, fmt, n.get_string("state") + ".fp8");
  Value* dq = b.op("dequantize", {q, scale}, {{"dtype", Attribute(g->dtype())}});
  return {dq, nullptr};
}

std::vector<Value*> quantize_rule(GradContext& c) { return {c.b.cast(c.g(), c.x(0)->dtype()), nullptr}; }

// Straight through to x alone: q is x quantized already, not a second path to it.
std::vector<Value*> requantize_rule(GradContext& c) {
  return {c.b.cast(c.g(), c.x(0)->dtype()), nullptr, nullptr, nullptr};
}

std::vector<Value*> dequantize_rule(GradContext& c) { return {c.b.cast(c.g(), DType::kF32), nullptr}; }

std::vector<Value*> scaled_matmul_rule(GradContext& c) {
  Builder& b = c.b;
  Value *a = c.x(0), *w = c.x(1), *sa = c.x(2), *sw = c.x(3), *g = c.g();
  require_static(a->shape(), "scaled_matmul's a");
  const int64_t n = static_sizes(w->shape())[0], k = static_sizes(w->shape())[1];
  const int64_t m = k == 0 ? 0 : num_elements(a->shape()) / k;
  // The gradient as f8 (with its scale) when quantize_grad's rule made it, so that both backward
  // GEMMs are FP8 GEMMs; otherwise they run on dequantized operands in the gradient's dtype.
  // (After autocast the GEMM's result is bf16 or f16, and its gradient that dequantized f32
  // gradient cast down.)
  const Node* dq = g->producer();
  if (dq != nullptr && dq->op_name() == "cast" && dq->operand(0)->producer() != nullptr &&
      dq->operand(0)->producer()->op_name() == "dequantize")
    dq = dq->operand(0)->producer();
  const bool fp8 = dq != nullptr && dq->op_name() == "dequantize" && dq->operand(0)->producer() != nullptr &&
                   (dq->operand(0)->producer()->op_name() == "quantize" ||
                    dq->operand(0)->producer()->op_name() == "requantize");
  Value* unquantized = fp8 ? dq->operand(0)->producer()->operand(0) : g;
  const DType t = g->dtype();
  auto deq = [&](Value* q, Value* s) { return b.op("dequantize", {q, s}, {{"dtype", Attribute(t)}}); };
  // Both backward GEMMs sum over long dims (dw over every token of the batch), so their running
  // sums are promoted to f32 rather than left in the tensor cores' fast FP8 accumulator, as
  // Transformer Engine does for dgrad and wgrad (its forward GEMM keeps the fast mode).
  auto f32_matmul = [&](Value* lhs, Value* rhs_nk, Value* ls, Value* rs, DType result = DType::kF32) {
    return b.op("scaled_matmul", {lhs, rhs_nk, ls, rs},
                {{"dtype", Attribute(result)}, {"fast_accumulation", Attribute(int64_t{0})}});
  };
  std::vector<Value*> out(static_cast<size_t>(c.node.num_operands()), nullptr);
  if (c.wants(0)) {  // da [.., K] = dy [.., N] @ w [N, K]
    // A forward GEMM in bf16 or f16 (autocast) has its input gradient written in that dtype too
    // (bf16 autocast's dgrad GEMMs are bf16) and read back as f32: half the bytes of an f32 one.
    out[0] = fp8 ? b.cast(f32_matmul(dq->operand(0), b.transpose(w, {1, 0}), dq->operand(1), sw, t), DType::kF32)
                 : b.cast(b.matmul(g, deq(w, sw)), DType::kF32);
  }
  if (c.wants(1)) {  // dw [N, K] = dy2ᵀ [N, M] @ a2 [M, K], every leading dim a row
    if (fp8) {
      Value* g2 = b.reshape(dq->operand(0), {Dim(m), Dim(n)});
      Value* a2 = b.reshape(a, {Dim(m), Dim(k)});
      out[1] = f32_matmul(b.transpose(g2, {1, 0}), b.transpose(a2, {1, 0}), dq->operand(1), sa);
    } else {
      Value* g2 = b.reshape(g, {Dim(m), Dim(n)});
      out[1] = b.cast(b.matmul(b.transpose(g2, {1, 0}), b.reshape(deq(a, sa), {Dim(m), Dim(k)})), DType::kF32);
    }
  }
  // The bias gradient from the gradient before quantization, as Transformer Engine's.
  if (c.node.num_operands() == 5 && c.wants(4)) out[4] = b.cast(b.sum_to(unquantized, c.x(4)->shape()), c.x(4)->dtype());
  return out;
}

// --- the pass ----------------------------------------------------------------------------

namespace {

struct Fp8Config {
  DelayedScaling recipe;
  DType forward = DType::kF8E4M3FN, backward = DType::kF8E5M2;
  std::vector<std::string> exclude;
};

class Fp8Training final : public Pass {
 public:
  explicit Fp8Training(Fp8Config c) : c_(std::move(c)) {}

  StatusOr<bool> run(Graph& g) override {
    // After autodiff the backward GEMMs would stay in high precision: refuse rather than half-do it.
    for (const std::string& out : g.output_names())
      if (out.size() > 5 && out.compare(out.size() - 5, 5, ".grad") == 0)
        return failed_precondition("fp8-training: the graph already has gradient output '" + out +
                                   "'; run fp8-training before autodiff");
    for (const auto& n : g.nodes())
      if (n->op_name() == "variable" && n->get_string("name") == "optimizer.step")
        return failed_precondition("fp8-training: the graph already holds an optimizer step; run fp8-training before "
                                   "autodiff and optimizer");
    KILN_RETURN_IF_ERROR(register_fp8_training_ops());
    names_.clear();
    quantized_.clear();
    for (const auto& n : g.nodes())
      if (n->op_name() == "variable") names_.insert(n->get_string("name"));
    bool changed = false;
    try {
      Builder b(g);
      for (Node* n : g.node_list()) changed |= rewrite(b, g, *n);
    } catch (const BuildError& e) {
      return e.status.with_context("fp8-training");
    }
    return changed;
  }

 private:
  bool selected(const Node& n) const {
    for (const std::string& s : c_.exclude)
      for (const Value* v : {n.operand(1), n.result()})
        if (!s.empty() && v->name().find(s) != std::string::npos) return false;
    return true;
  }

  /// `base`, or base.1, base.2, ... when a variable of that name exists.
  std::string fresh(const std::string& base) {
    std::string name = base;
    for (int i = 1; names_.count(name + ".fp8_scale"); ++i) name = base + "." + std::to_string(i);
    names_.insert(name + ".fp8_scale");
    names_.insert(name + ".amax_history");
    return name;
  }

  Value* scale_variable(Builder& b, const std::string& state) {
    return b.op("variable", {},
                {{"name", Attribute(state + ".fp8_scale")}, {"init", Attribute(Tensor::scalar_f64(DType::kF32, 1.0))}},
                state + ".fp8_scale");
  }

  /// x quantized to the forward format with its delayed scale (shared by every consumer of x).
  std::pair<Value*, Value*> quantized(Builder& b, Value* x, const std::string& fallback_name, bool transposed) {
    auto key = std::make_pair(static_cast<const Value*>(x), transposed);
    auto it = quantized_.find(key);
    if (it != quantized_.end()) return it->second;
    const std::string state = fresh(x->name().empty() ? fallback_name : x->name());
    Value* delayed = scale_variable(b, state);
    Value* scale = delayed_scale_update(b, x, delayed, state + ".amax_history", c_.recipe, c_.forward);
    Value* src = transposed ? b.transpose(x, {1, 0}) : x;
    Value* q = delayed_quantize(b, src, delayed, scale, c_.forward, state + ".fp8");
    return quantized_[key] = {q, scale};
  }

  bool rewrite(Builder& b, Graph& g, Node& n) {
    const bool linear = n.op_name() == "linear";
    if ((!linear && n.op_name() != "matmul") || n.num_results() != 1) return false;
    Value *x = n.operand(0), *w = n.operand(1), *y = n.result();
    const DType t = y->dtype();
    if (w->type().rank() != 2 || x->type().rank() < 1 || !low_or_f32(t) || x->dtype() != t || w->dtype() != t)
      return false;
    if (!is_static(x->shape()) || !is_static(w->shape()) || !selected(n)) return false;
    b.set_insertion_point(&n);
    b.set_loc(n.loc());
    const std::string yname = y->name().empty() ? "fp8." + std::to_string(count_++) : y->name();
    auto [xq, xs] = quantized(b, x, yname + ".input", false);
    // scaled_matmul takes the weight as [N, K]: a matmul's [K, N] weight is transposed first.
    auto [wq, ws] = quantized(b, w, yname + ".weight", !linear);
    std::vector<Value*> operands = {xq, wq, xs, ws};
    if (linear && n.num_operands() == 3) operands.push_back(n.operand(2));
    Value* mm = b.op("scaled_matmul", operands, {{"dtype", Attribute(t)}});
    const std::string gstate = fresh(yname + ".grad");
    Value* gs = scale_variable(b, gstate);
    Value* marked = b.op(kQuantizeGradOp, {mm, gs},
                         {{"dtype", Attribute(c_.backward)},
                          {"state", Attribute(gstate)},
                          {"history", Attribute(c_.recipe.history)},
                          {"algorithm", Attribute(c_.recipe.algorithm)},
                          {"margin", Attribute(c_.recipe.margin)},
                          {"current_until_history", Attribute(static_cast<int64_t>(c_.recipe.current_until_history))}});
    y->replace_all_uses_with(marked);
    marked->set_name(y->name());
    y->set_name("");
    mm->set_name(yname + ".fp8_gemm");
    (void)g.erase_node(&n);
    return true;
  }

  Fp8Config c_;
  std::set<std::string> names_;
  std::map<std::pair<const Value*, bool>, std::pair<Value*, Value*>> quantized_;
  int count_ = 0;
};

}  // namespace

PassInfo fp8_training_pass_info() {
  PassInfo info;
  info.name = "fp8-training";
  info.version = "0.1.0";
  info.summary =
      "FP8 training: linear/matmul run as FP8 GEMMs (E4M3 forward, E5M2 gradients) with delayed per-tensor scaling; "
      "run before autodiff";
  info.options = {
      {"format", OptionType::kString, std::string("hybrid"),
       "hybrid: e4m3 forward, e5m2 gradients (Transformer Engine's HYBRID); e4m3: e4m3 for both"},
      {"history", OptionType::kInt, int64_t{16}, "amax history length (steps)"},
      {"algorithm", OptionType::kString, std::string("max"),
       "max: the scale follows the largest amax in the history; most_recent: the last step's amax"},
      {"margin", OptionType::kInt, int64_t{0}, "scales leave 2^margin headroom: scale = amax * 2^margin / max_finite"},
      {"initial-scale", OptionType::kString, std::string("current"),
       "the scale of a tensor whose amax history is still empty (the first step): current: its own amax's (just in "
       "time, as torchao initializes); one: 1 (Transformer Engine's), which flushes gradients below 2^-16 to zero"},
      {"exclude", OptionType::kStringList, std::vector<std::string>{},
       "skip contractions whose weight or result name contains one of these (e.g. an lm_head)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    Fp8Config c;
    const std::string format = o.get_string("format");
    if (format == "e4m3") c.backward = DType::kF8E4M3FN;
    else if (format != "hybrid")
      return invalid_argument("fp8-training: option 'format' must be hybrid or e4m3, got '" + format + "'");
    c.recipe.history = o.get_int("history");
    if (c.recipe.history < 1 || c.recipe.history > 65536)
      return invalid_argument("fp8-training: option 'history' must be within [1, 65536], got " +
                              std::to_string(c.recipe.history));
    c.recipe.algorithm = o.get_string("algorithm");
    if (c.recipe.algorithm != "max" && c.recipe.algorithm != "most_recent")
      return invalid_argument("fp8-training: option 'algorithm' must be max or most_recent, got '" +
                              c.recipe.algorithm + "'");
    c.recipe.margin = o.get_int("margin");
    if (c.recipe.margin < -64 || c.recipe.margin > 64)
      return invalid_argument("fp8-training: option 'margin' must be within [-64, 64], got " +
                              std::to_string(c.recipe.margin));
    const std::string initial = o.get_string("initial-scale");
    if (initial != "current" && initial != "one")
      return invalid_argument("fp8-training: option 'initial-scale' must be current or one, got '" + initial + "'");
    c.recipe.current_until_history = initial == "current";
    c.exclude = o.get_strings("exclude");
    KILN_RETURN_IF_ERROR(register_fp8_training_ops());
    return std::unique_ptr<Pass>(std::make_unique<Fp8Training>(std::move(c)));
  };
  return info;
}

}  // namespace kiln::training
