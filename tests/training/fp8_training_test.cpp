// fp8-training: the joint graph it leads to (FP8 GEMMs forward and backward, no quantize_grad
// left), the straight-through gradient rules of the FP8 ops, the quantization error of the first
// and a warm step against f64 (SQNR floors), and the pass's errors.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "autodiff.h"
#include "fp8_training.h"
#include "kiln/core/options.h"
#include "kiln/ir/interpreter.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

namespace kiln::training {
namespace {

constexpr int64_t kK = 64, kN = 48;

/// A constant of `shape` filled with `v` in .kir text (dense literals list every element).
std::string filled(const std::string& name, std::vector<int64_t> shape, double v) {
  int64_t n = 1;
  std::string dims;
  for (int64_t d : shape) {
    n *= d;
    dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  }
  std::string values;
  for (int64_t i = 0; i < n; ++i) values += (i ? ", " : "") + std::to_string(v);
  return "  %" + name + " = constant() {value = dense<f32[" + dims + "]>[" + values + "]} : f32[" + dims + "]\n";
}

/// loss = sum(linear(x, w, b) * r): dy = r, so the gradients have closed forms.
const std::string kLinear = "graph @g(%x: f32[4, 8, 64], %r: f32[4, 8, 48]) -> (%loss: f32[]) {\n" +
                            filled("w", {kN, kK}, 0) + filled("b", {kN}, 0) + R"(  %y = linear(%x, %w, %b) : f32[4, 8, 48]
  %p = mul(%y, %r) : f32[4, 8, 48]
  %loss = reduce_sum(%p) {keepdims = 0} : f32[]
  return %loss
})";

std::unique_ptr<Graph> parse(const std::string& text) {
  auto g = parse_graph(text);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(g).value();
}

StatusOr<std::unique_ptr<Pass>> make_fp8(std::map<std::string, OptionValue> given) {
  const PassInfo info = fp8_training_pass_info();
  KILN_ASSIGN_OR_RETURN(Options o, resolve_options(info.options, given, "pass 'fp8-training'"));
  return info.create(o);
}

Tensor random(std::vector<int64_t> shape, double sd, std::mt19937& rng) {
  Tensor t(DType::kF32, shape);
  std::normal_distribution<double> d(0, sd);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, d(rng));
  return t;
}

void run_pass(Graph& g, StatusOr<std::unique_ptr<Pass>> pass) {
  REQUIRE_MESSAGE(pass.ok(), pass.status().message());
  auto changed = (*pass)->run(g);
  REQUIRE_MESSAGE(changed.ok(), changed.status().message());
  CHECK(*changed);
}

/// The linear graph with weight w and bias b, through fp8-training (if `fp8`), autocast to bf16
/// (if `autocast`) and autodiff.
std::unique_ptr<Graph> joint(const Tensor& w, const Tensor& b, bool fp8, std::map<std::string, OptionValue> opts = {},
                             bool autocast = false) {
  auto g = parse(kLinear);
  for (const auto& n : g->nodes())
    if (n->op_name() == "constant") n->set_attr("value", Attribute(n->result()->name() == "w" ? w : b));
  if (fp8) run_pass(*g, make_fp8(std::move(opts)));
  if (autocast) {
    const PassInfo info = autocast_pass_info();
    auto o = resolve_options(info.options, {}, "pass 'autocast'");
    REQUIRE(o.ok());
    run_pass(*g, info.create(*o));
  }
  AutodiffConfig c;
  c.params = {"x", "w", "b"};
  auto params = differentiate(*g, c);
  REQUIRE_MESSAGE(params.ok(), params.status().message());
  Status v = verify(*g);
  REQUIRE_MESSAGE(v.ok(), std::string(v.message() + "\n" + print_graph(*g)));
  return g;
}

int count_ops(const Graph& g, const std::string& op, std::optional<DType> result = std::nullopt) {
  int n = 0;
  for (const auto& node : g.nodes())
    if (node->op_name() == op && (!result || node->result()->dtype() == *result)) ++n;
  return n;
}

/// 10 log10(|ref|^2 / |ref - got|^2) in dB.
double sqnr(const Tensor& ref, const Tensor& got) {
  double s = 0, e = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    s += ref.get_f64(i) * ref.get_f64(i);
    e += (ref.get_f64(i) - got.get_f64(i)) * (ref.get_f64(i) - got.get_f64(i));
  }
  return 10 * std::log10(s / e);
}

TEST_CASE("fp8-training: forward and both backward GEMMs are FP8 GEMMs, gradients e5m2, no quantize_grad left") {
  std::mt19937 rng(1);
  auto g = joint(random({kN, kK}, 0.05, rng), random({kN}, 0.1, rng), true);
  CHECK(count_ops(*g, "scaled_matmul") == 3);
  CHECK(count_ops(*g, kQuantizeGradOp) == 0);
  CHECK(count_ops(*g, "quantize", DType::kF8E4M3FN) == 2);  // x and w
  CHECK(count_ops(*g, "quantize", DType::kF8E5M2) == 1);    // dy
  // Each quantized with its delayed scale, then requantized with the just-in-time scale of the
  // first step (a no-op on the GPU on later steps); with initial-scale=one the quantize alone.
  CHECK(count_ops(*g, "requantize") == 3);
  std::mt19937 rng1(1);
  const Tensor w1 = random({kN, kK}, 0.05, rng1), b1 = random({kN}, 0.1, rng1);
  CHECK(count_ops(*joint(w1, b1, true, {{"initial-scale", std::string("one")}}), "requantize") == 0);
  CHECK(count_ops(*g, "matmul") == 0);
  CHECK(count_ops(*g, "linear") == 0);
  // The forward GEMM may accumulate in the tensor cores' fast mode; dx and dw (sums over the
  // output features and over every token) promote their sums to f32, as Transformer Engine's.
  int fast = 0, precise = 0;
  for (const auto& n : g->nodes())
    if (n->op_name() == "scaled_matmul") ++(n->get_int("fast_accumulation", 1) ? fast : precise);
  CHECK(fast == 1);
  CHECK(precise == 2);
  // State: a scale and an amax history for x, w and dy, each assigned once.
  std::map<std::string, int> assigned;
  for (const auto& n : g->nodes())
    if (n->op_name() == "assign") ++assigned[n->get_string("name")];
  for (const char* t : {"x", "w", "y.grad"}) {
    CAPTURE(t);
    CHECK(assigned[std::string(t) + ".fp8_scale"] == 1);
    CHECK(assigned[std::string(t) + ".amax_history"] == 1);
  }
}

TEST_CASE("fp8-training: the first and a warm step's output and gradients against f64 (SQNR floors)") {
  std::mt19937 rng(2);
  const Tensor w = random({kN, kK}, 0.05, rng), b = random({kN}, 0.1, rng);
  // dy ~ 1e-6 lies below e5m2's smallest subnormal (2^-16): only a scale makes it representable.
  const Tensor x = random({4, 8, kK}, 1.0, rng), r = random({4, 8, kN}, 1e-6, rng);
  std::vector<Tensor> in = {x, r};
  auto exact = joint(w, b, false);
  auto got = joint(w, b, true);
  auto unit = joint(w, b, true, {{"initial-scale", std::string("one")}});
  Interpreter ref, fp8, fp8_unit;
  auto want = ref.run(*exact, in);
  REQUIRE(want.ok());
  // The first step has no amax history: it quantizes with its own amaxes' scales (just in time);
  // the second with the delayed scales; with initial-scale=one the first uses 1.
  auto cold = fp8.run(*got, in);
  REQUIRE_MESSAGE(cold.ok(), cold.status().message());
  auto warm = fp8.run(*got, in);
  REQUIRE(warm.ok());
  auto cold_unit = fp8_unit.run(*unit, in);
  REQUIRE(cold_unit.ok());
  const std::string names[] = {"loss", "x.grad", "w.grad"};
  // e4m3 keeps 3 mantissa bits (~31 dB for one operand), e5m2 2 bits (~25 dB).
  const double floors[] = {30, 20, 20};
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(names[i]);
    const double s = sqnr((*want)[i], (*warm)[i]), s1 = sqnr((*want)[i], (*cold)[i]),
                 s1_unit = sqnr((*want)[i], (*cold_unit)[i]);
    MESSAGE(names[i] << " SQNR " << s << " dB (first step " << s1 << " dB, with scales 1: " << s1_unit << " dB)");
    CHECK(s >= floors[i]);
    CHECK(s1 >= floors[i]);
    CHECK(s < 100);  // quantized: not the f32 computation
    if (i > 0) CHECK(s1_unit < 3);  // the unscaled gradient flushed to zero
  }
  // The bias gradient comes from dy before quantization (as Transformer Engine's): f32's own.
  CHECK((*warm)[3].to_f64() == (*want)[3].to_f64());
  // Scales after two steps: amax / max_finite.
  CHECK(fp8.variable_value("w.fp8_scale")->get_f64(0) ==
        doctest::Approx(fp8.variable_value("w.amax_history")->get_f64(0) / 448).epsilon(1e-6));
  CHECK(fp8.variable_value("y.grad.fp8_scale")->get_f64(0) ==
        doctest::Approx(fp8.variable_value("y.grad.amax_history")->get_f64(0) / 57344).epsilon(1e-6));
}

TEST_CASE("fp8-training then autocast: the FP8 GEMMs write bf16 (dw f32), both backward ones stay FP8, close to f64") {
  std::mt19937 rng(3);
  const Tensor w = random({kN, kK}, 0.05, rng), b = random({kN}, 0.1, rng);
  auto g = joint(w, b, true, {}, true);
  // The forward GEMM and dx write bf16 (half an f32 result's bytes, as bf16 autocast's GEMMs);
  // dw, the master weight's gradient, stays f32. No operand was cast: f8 in, f32 scales.
  CHECK(count_ops(*g, "scaled_matmul") == 3);
  CHECK(count_ops(*g, "scaled_matmul", DType::kBF16) == 2);
  CHECK(count_ops(*g, "quantize", DType::kF8E5M2) == 1);
  CHECK(count_ops(*g, "matmul") == 0);
  for (const auto& n : g->nodes())
    if (n->op_name() == "scaled_matmul") {
      CHECK((n->operand(0)->dtype() == DType::kF8E4M3FN || n->operand(0)->dtype() == DType::kF8E5M2));
      CHECK(n->operand(2)->dtype() == DType::kF32);
      CHECK(n->operand(3)->dtype() == DType::kF32);
      if (n->num_operands() == 5) CHECK(n->operand(4)->dtype() == DType::kBF16);  // the bias
    }
  CHECK(g->output(1)->dtype() == DType::kF32);  // x.grad
  CHECK(g->output(2)->dtype() == DType::kF32);  // w.grad
  const Tensor x = random({4, 8, kK}, 1.0, rng), r = random({4, 8, kN}, 1e-6, rng);
  const std::vector<Tensor> in = {x, r};
  auto exact = joint(w, b, false);
  Interpreter ref, fp8;
  auto want = ref.run(*exact, in);
  REQUIRE(want.ok());
  for (int step = 0; step < 2; ++step) {  // the just-in-time first step and a warm one
    auto got = fp8.run(*g, in);
    REQUIRE_MESSAGE(got.ok(), got.status().message());
    const double floors[] = {30, 20, 20};
    for (size_t i = 0; i < 3; ++i) {
      CAPTURE(step);
      CAPTURE(i);
      CHECK(sqnr((*want)[i], (*got)[i]) >= floors[i]);
    }
  }
}

TEST_CASE("scaled_matmul's rule without quantize_grad: straight-through gradients of the dequantized operands") {
  // d/da sum(r * (a sa)(w sw)^T) is r (w sw) as the gradient of the real value a sa, in f32.
  const char* text = R"(graph @g(%x: f32[2, 16], %w: f32[3, 16], %r: f32[2, 3]) -> (%loss: f32[]) {
  %sx = constant() {value = dense<f32[]>[0.01]} : f32[]
  %sw = constant() {value = dense<f32[]>[0.002]} : f32[]
  %xq = quantize(%x, %sx) : f8e4m3fn[2, 16]
  %wq = quantize(%w, %sw) : f8e4m3fn[3, 16]
  %y = scaled_matmul(%xq, %wq, %sx, %sw) : f32[2, 3]
  %p = mul(%y, %r) : f32[2, 3]
  %loss = reduce_sum(%p) {keepdims = 0} : f32[]
  return %loss
})";
  auto g = parse(text);
  AutodiffConfig c;
  c.params = {"x", "w"};
  auto params = differentiate(*g, c);
  REQUIRE_MESSAGE(params.ok(), params.status().message());
  REQUIRE(verify(*g).ok());
  std::mt19937 rng(3);
  std::vector<Tensor> in = {random({2, 16}, 1, rng), random({3, 16}, 0.2, rng), random({2, 3}, 1, rng)};
  auto out = Interpreter().run(*g, in);
  REQUIRE_MESSAGE(out.ok(), out.status().message());
  auto deq = [](const Tensor& t, double s, int64_t i) {
    return static_cast<double>(f8e4m3fn_bits_to_f32(f64_to_f8e4m3fn_bits(static_cast<float>(t.get_f64(i)) / static_cast<float>(s), true))) *
           static_cast<float>(s);
  };
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t k = 0; k < 16; ++k) {
      double gx = 0;
      for (int64_t n = 0; n < 3; ++n) gx += in[2].get_f64(i * 3 + n) * deq(in[1], 0.002, n * 16 + k);
      CHECK((*out)[1].get_f64(i * 16 + k) == doctest::Approx(gx).epsilon(1e-5));
    }
  for (int64_t n = 0; n < 3; ++n)
    for (int64_t k = 0; k < 16; ++k) {
      double gw = 0;
      for (int64_t i = 0; i < 2; ++i) gw += in[2].get_f64(i * 3 + n) * deq(in[0], 0.01, i * 16 + k);
      CHECK((*out)[2].get_f64(n * 16 + k) == doctest::Approx(gw).epsilon(1e-5));
    }
}

TEST_CASE("fp8-training: exclude keeps a contraction in f32 and a matmul weight is transposed to N x K") {
  const std::string text = "graph @g(%x: f32[4, 16], %t: i64[4]) -> (%loss: f32[]) {\n" + filled("w1", {16, 32}, 0.01) +
                           filled("w2", {8, 32}, 0.02) + R"(  %h = matmul(%x, %w1) : f32[4, 32]
  %logits = linear(%h, %w2) : f32[4, 8]
  %loss = cross_entropy(%logits, %t) : f32[]
  return %loss
})";
  auto g = parse(text);
  auto pass = make_fp8({{"exclude", std::vector<std::string>{"logits"}}});
  REQUIRE(pass.ok());
  REQUIRE((*pass)->run(*g).ok());
  CHECK(count_ops(*g, "scaled_matmul") == 1);
  CHECK(count_ops(*g, "linear") == 1);
  CHECK(count_ops(*g, "transpose") == 1);
  REQUIRE(verify(*g).ok());
  REQUIRE(differentiate(*g, {}).ok());
  REQUIRE(verify(*g).ok());
  // The forward GEMM and w1's gradient; x is no parameter, so no GEMM computes its gradient.
  CHECK(count_ops(*g, "scaled_matmul") == 2);
}

TEST_CASE("fp8-training errors name what is wrong") {
  CHECK(make_fp8({{"algorithm", std::string("mean")}}).status().message() ==
        "fp8-training: option 'algorithm' must be max or most_recent, got 'mean'");
  CHECK(make_fp8({{"format", std::string("e5m2")}}).status().message() ==
        "fp8-training: option 'format' must be hybrid or e4m3, got 'e5m2'");
  CHECK(make_fp8({{"history", int64_t{0}}}).status().message() ==
        "fp8-training: option 'history' must be within [1, 65536], got 0");
  CHECK(make_fp8({{"margin", int64_t{99}}}).status().message() ==
        "fp8-training: option 'margin' must be within [-64, 64], got 99");
  CHECK(make_fp8({{"initial-scale", std::string("zero")}}).status().message() ==
        "fp8-training: option 'initial-scale' must be current or one, got 'zero'");
  CHECK(make_fp8({{"histroy", int64_t{4}}}).status().message().find("unknown option 'histroy'") != std::string::npos);
  // After autodiff the backward GEMMs would stay high precision: refused.
  auto g = parse(kLinear);
  REQUIRE(differentiate(*g, {}).ok());
  auto pass = make_fp8({});
  REQUIRE(pass.ok());
  CHECK((*pass)->run(*g).status().message() ==
        "fp8-training: the graph already has gradient output 'w.grad'; run fp8-training before autodiff");
}

}  // namespace
}  // namespace kiln::training
