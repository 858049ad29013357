// Tests of the quantize-int4 pass: the rewrite on .kir graphs, its options and filters, and the
// signal-to-quantization-noise ratio against the unquantized graph on the reference interpreter
// (random Gaussian weights, and the small GPT-2 and Llama-style models end to end).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "quant_test_util.h"
#include "kiln/core/driver.h"
#include "kiln/core/npy.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

namespace kiln::test {
namespace {

Registry& reg() {
  return registry_with({"kiln-plugin-quantize-int4.so", "kiln-plugin-backend-reference.so",
                        "kiln-plugin-frontend-onnx.so"});
}

/// Runs `passes` (one-line form, e.g. "quantize-int4{group-size=64}") on `g`.
Status run_passes(Graph& g, const std::string& passes) {
  return test::run_passes(g, passes, reg());
}

/// `count` Gaussian values as .kir dense text.
std::string gaussian_values(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.02);
  std::string vals;
  for (int64_t i = 0; i < count; ++i) vals += (i ? ", " : "") + std::to_string(normal(rng));
  return vals;
}

/// A graph of `op` ("linear" or "matmul") of x f32[rows, k] by a constant Gaussian weight
/// (linear: [n, k], matmul: [k, n]), written as .kir text.
std::string gaussian_kir(const std::string& op, int64_t rows, int64_t n, int64_t k, uint32_t seed,
                         const std::string& weight_name = "w") {
  const std::string ws = op == "linear" ? std::to_string(n) + ", " + std::to_string(k)
                                        : std::to_string(k) + ", " + std::to_string(n);
  const std::string vals = gaussian_values(n * k, seed);
  const std::string xt = "f32[" + std::to_string(rows) + ", " + std::to_string(k) + "]";
  const std::string yt = "f32[" + std::to_string(rows) + ", " + std::to_string(n) + "]";
  return "graph @g(%x: " + xt + ") -> (" + yt + ") {\n  %" + weight_name + " = constant() {value = dense<f32[" + ws +
         "]>[" + vals + "]} : f32[" + ws + "]\n  %y = " + op + "(%x, %" + weight_name + ") : " + yt +
         "\n  return %y\n}\n";
}

/// SQNR of `passes` on the graph `text` over seeded random inputs.
double graph_sqnr(const std::string& text, const std::string& passes) {
  return test::graph_sqnr(reg(), text, passes, 11);
}

TEST_CASE("quantize-int4 replaces a constant-weight linear by matmul_int4 and drops the float weight") {
  auto g = parse(gaussian_kir("linear", 2, 3, 256, 1));
  REQUIRE(run_passes(*g, "quantize-int4").ok());
  CHECK(op_names(*g) == std::vector<std::string>{"constant", "constant", "matmul_int4"});
  const Node& m = *g->nodes().back();
  CHECK(m.get_int("group_size") == 128);
  CHECK(!m.has_attr("asymmetric"));
  CHECK(m.operand(1)->type().str() == "u8[3, 128]");
  CHECK(m.operand(1)->name() == "w.int4");
  CHECK(m.operand(2)->type().str() == "f16[3, 2]");
  CHECK(m.result()->type().str() == "f32[2, 3]");
  CHECK(verify(*g).ok());
}

TEST_CASE("quantize-int4: matmul by a [K, N] constant is transposed; asymmetric adds zeros; bias is kept") {
  auto g = parse(gaussian_kir("matmul", 2, 5, 64, 2));
  REQUIRE(run_passes(*g, "quantize-int4{group-size=32,symmetric=false,scale-dtype=bf16}").ok());
  const Node& m = *g->nodes().back();
  REQUIRE(m.op_name() == "matmul_int4");
  CHECK(m.get_int("asymmetric") == 1);
  CHECK(m.operand(1)->type().str() == "u8[5, 32]");
  CHECK(m.operand(2)->type().str() == "bf16[5, 2]");
  CHECK(m.operand(3)->type().str() == "bf16[5, 2]");
  CHECK(m.operand(3)->name() == "w.zeros");

  auto b = parse(R"(graph @g(%x: f32[1, 32], %b: f32[2]) -> (f32[1, 2]) {
  %w = constant() {value = dense<f32[2, 32]>[1.0, -1.5, 2.25, 0.5, 1.0, -1.5, 2.25, 0.5, 1.0, -1.5, 2.25, 0.5, 1.0, -1.5, 2.25, 0.5, 1.0, -1.5, 2.25, 0.5, 1.0, -1.5, 2.25, 0.5, 1.0, -1.5, 2.25, 0.5, 1.0, -1.5, 2.25, 0.5, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0]} : f32[2, 32]
  %y = linear(%x, %w, %b) : f32[1, 2]
  return %y
})");
  std::mt19937 rng(3);
  const std::vector<Tensor> inputs = random_inputs(*b, rng);
  const std::vector<Tensor> ref = run_reference(reg(), *b, inputs);
  REQUIRE(run_passes(*b, "quantize-int4{group-size=32,symmetric=false}").ok());
  const Node& q = *b->nodes().back();
  REQUIRE(q.op_name() == "matmul_int4");
  CHECK(q.num_operands() == 5);
  CHECK(q.operand(4)->name() == "b");
  // Values on the grid (1, -1.5, 2.25, 0.5 span 15 steps of 0.25; a constant row) come back exactly.
  const std::vector<Tensor> got = run_reference(reg(), *b, inputs);
  CHECK(got[0].get_f64(0) == doctest::Approx(ref[0].get_f64(0)).epsilon(1e-6));
  CHECK(got[0].get_f64(1) == doctest::Approx(ref[0].get_f64(1)).epsilon(1e-6));
}

TEST_CASE("quantize-int4 leaves alone what it cannot or was told not to quantize") {
  // Weight not a constant; K not a multiple of the group; too small; excluded by name.
  auto input_w = parse(R"(graph @g(%x: f32[2, 128], %w: f32[4, 128]) -> (f32[2, 4]) {
  %y = linear(%x, %w) : f32[2, 4]
  return %y
})");
  REQUIRE(run_passes(*input_w, "quantize-int4").ok());
  CHECK(op_names(*input_w) == std::vector<std::string>{"linear"});
  for (const char* passes : {"quantize-int4{group-size=128}", "quantize-int4{group-size=32,min-size=4097}",
                             "quantize-int4{group-size=32,exclude=[lm_head]}"}) {
    CAPTURE(passes);
    auto g = parse(gaussian_kir("linear", 1, 64, 64, 4, "lm_head.weight"));
    REQUIRE(run_passes(*g, passes).ok());
    CHECK(op_names(*g) == std::vector<std::string>{"constant", "linear"});
  }
  auto g = parse(gaussian_kir("linear", 1, 64, 64, 4, "lm_head.weight"));
  REQUIRE(run_passes(*g, "quantize-int4{group-size=32,min-size=4096,exclude=[attn]}").ok());
  CHECK(op_names(*g).back() == "matmul_int4");
}

TEST_CASE("quantize-int4 keep-output-layers leaves the layers that compute graph outputs in float") {
  // %logits: linear -> bias add -> reshape -> cast -> output (an lm_head / classifier shape);
  // %hidden: linear + residual -> output (a hidden state, not an output layer).
  const std::string w = "dense<f32[64, 64]>[";
  const std::string text = "graph @g(%x: f32[2, 64]) -> (bf16[1, 2, 64], f32[2, 64]) {\n"
                           "  %w1 = constant() {value = " + w + gaussian_values(64 * 64, 1) + "]} : f32[64, 64]\n"
                           "  %w2 = constant() {value = " + w + gaussian_values(64 * 64, 2) + "]} : f32[64, 64]\n"
                           "  %w3 = constant() {value = " + w + gaussian_values(64 * 64, 3) + "]} : f32[64, 64]\n"
                           "  %b = constant() {value = dense<f32[64]>[" + gaussian_values(64, 4) + "]} : f32[64]\n"
                           "  %h = linear(%x, %w1) : f32[2, 64]\n"
                           "  %a = relu(%h) : f32[2, 64]\n"
                           "  %l = linear(%a, %w2) : f32[2, 64]\n"
                           "  %lb = add(%l, %b) : f32[2, 64]\n"
                           "  %lr = reshape(%lb) {shape = [1, 2, 64]} : f32[1, 2, 64]\n"
                           "  %logits = cast(%lr) {to = bf16} : bf16[1, 2, 64]\n"
                           "  %m = linear(%a, %w3) : f32[2, 64]\n"
                           "  %hidden = add(%m, %x) : f32[2, 64]\n"
                           "  return %logits, %hidden\n}\n";
  auto count_int4 = [](const Graph& g) {
    int n = 0;
    for (const std::string& op : op_names(g)) n += op == "matmul_int4";
    return n;
  };
  auto all = parse(text);
  REQUIRE(run_passes(*all, "quantize-int4{group-size=32}").ok());
  CHECK(count_int4(*all) == 3);
  auto kept = parse(text);
  REQUIRE(run_passes(*kept, "quantize-int4{group-size=32,keep-output-layers=true}").ok());
  CHECK(count_int4(*kept) == 2);
  bool lm_head_float = false;
  for (const auto& n : kept->nodes())
    if (n->op_name() == "linear") lm_head_float = n->result()->name() == "l";
  CHECK(lm_head_float);
}

TEST_CASE("quantize-int4 refuses bad options, naming them") {
  auto bad_group = parse_pass_list("quantize-int4{group-size=48}", reg());
  REQUIRE(bad_group.ok());
  auto g = parse(gaussian_kir("linear", 1, 2, 64, 5));
  Pipeline p;
  p.passes = *bad_group;
  Status s = run_pipeline_passes(*g, p, reg(), {});
  CHECK(s.message().find("quantize-int4: group-size must be 32, 64 or 128, got 48") != std::string::npos);
  auto bad_dtype = parse_pass_list("quantize-int4{scale-dtype=f32}", reg());
  REQUIRE(bad_dtype.ok());
  p.passes = *bad_dtype;
  s = run_pipeline_passes(*g, p, reg(), {});
  CHECK(s.message().find("quantize-int4: scale-dtype must be f16 or bf16, got 'f32'") != std::string::npos);
  auto bad_min = parse_pass_list("quantize-int4{min-size=-5}", reg());
  REQUIRE(bad_min.ok());
  p.passes = *bad_min;
  s = run_pipeline_passes(*g, p, reg(), {});
  CHECK(s.message().find("quantize-int4: min-size must be at least 0, got -5") != std::string::npos);
}

// Gaussian weights, group 128: the absmax of 128 samples is about 2.6 sigma, so the plain
// symmetric step is 2.6/7 = 0.37 sigma and the rounding noise (step^2 / 12) sits about 19 dB
// under the weight power; the clip search gains about 1 dB more (measured: 20.1-20.5 dB at group
// 128, 22.4 at group 32). A dot product over independent errors keeps that ratio. The floor of
// 19 dB leaves room for the seed; smaller groups must do better (smaller absmax per group).
TEST_CASE("quantize-int4: SQNR on Gaussian weights per group size, symmetric and asymmetric") {
  const std::string lin = gaussian_kir("linear", 8, 64, 512, 6);
  double last = 0;
  for (int64_t group : {128, 64, 32}) {
    for (const char* sym : {"true", "false"}) {
      for (const char* sd : {"f16", "bf16"}) {
        const std::string passes = "quantize-int4{group-size=" + std::to_string(group) + ",symmetric=" + sym +
                                   ",scale-dtype=" + sd + "}";
        const double db = graph_sqnr(lin, passes);
        MESSAGE(passes << ": " << db << " dB");
        CHECK(db >= 19.0);
        if (std::string(sym) == "true" && std::string(sd) == "f16") {
          CHECK(db > last);
          last = db;
        }
      }
    }
  }
}

/// End-to-end SQNR of the model in tests/models/NAME on its saved input, quantized by `passes`.
double model_sqnr(const std::string& name, const std::string& passes) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/tests/models/" + name;
  StageSpec fe{"onnx", {}, {}};
  auto info = reg().frontend("onnx");
  REQUIRE_MESSAGE(info.ok(), info.status().message());
  auto resolved = resolve_options((*info)->options, {}, "onnx");
  REQUIRE(resolved.ok());
  fe.options = *resolved;
  forward_symbols_to_frontend(fe, {{"batch", 1}, {"seq", 16}}, reg());
  auto g = import_model(dir + "/model.onnx", fe, reg());
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto ids = read_npy(dir + "/input_input_ids.npy");
  REQUIRE_MESSAGE(ids.ok(), ids.status().message());
  const std::vector<Tensor> inputs = {*ids};
  const std::vector<Tensor> ref = run_reference(reg(), **g, inputs);
  Status s = run_passes(**g, passes);
  REQUIRE_MESSAGE(s.ok(), s.message());
  int quantized = 0;
  for (const auto& n : (*g)->nodes()) quantized += n->op_name() == "matmul_int4";
  CHECK(quantized > 0);
  const double db = sqnr_db(ref, run_reference(reg(), **g, inputs));
  MESSAGE(name << " " << passes << ": " << quantized << " matmul_int4 nodes, " << db << " dB");
  return db;
}

// Measured on these random-weight models (group 128, reference interpreter, logits): GPT-2
// 15.0 dB symmetric / 15.7 asymmetric, Llama-style 14.0 / 14.2. Errors of 9 and 13 quantized
// layers add up through untrained weights; the floor guards those numbers against regressions.
TEST_CASE("quantize-int4: end-to-end SQNR of the small GPT-2 and Llama-style models, group 128") {
  for (const char* model : {"gpt2-small-legacy", "llama-small-legacy"}) {
    CAPTURE(model);
    CHECK(model_sqnr(model, "quantize-int4") >= 13.5);
    CHECK(model_sqnr(model, "quantize-int4{symmetric=false}") >= 13.5);
  }
}

}  // namespace
}  // namespace kiln::test
