// Tests of the quantize-fp8 and convert-bf16 passes: the rewrite on .kir graphs, options,
// filters and errors, and SQNR against the unquantized graph on the reference interpreter.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "quant_test_util.h"
#include "kiln/core/driver.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

namespace kiln::test {
namespace {

Registry& reg() {
  return registry_with({"kiln-plugin-quantize-fp8.so", "kiln-plugin-backend-reference.so"});
}

Status run_passes(Graph& g, const std::string& passes) {
  return test::run_passes(g, passes, reg());
}

/// A scales file (the format `kiln calibrate` writes) in a fresh temporary path.
std::string scales_file(const std::string& body) {
  static int counter = 0;
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kiln-fp8-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + ".json"))
                               .string();
  std::ofstream(path) << body;
  return path;
}

/// x f32[rows, k] times a constant Gaussian weight (linear: [n, k] with bias, matmul: [k, n]).
std::string gaussian_kir(const std::string& op, int64_t rows, int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.02);
  const std::string ws = op == "linear" ? std::to_string(n) + ", " + std::to_string(k)
                                        : std::to_string(k) + ", " + std::to_string(n);
  std::string vals, bias;
  for (int64_t i = 0; i < n * k; ++i) vals += (i ? ", " : "") + std::to_string(normal(rng));
  for (int64_t i = 0; i < n; ++i) bias += (i ? ", " : "") + std::to_string(normal(rng));
  const std::string xt = "f32[" + std::to_string(rows) + ", " + std::to_string(k) + "]";
  const std::string yt = "f32[" + std::to_string(rows) + ", " + std::to_string(n) + "]";
  const bool lin = op == "linear";
  return "graph @g(%x: " + xt + ") -> (" + yt + ") {\n  %w = constant() {value = dense<f32[" + ws + "]>[" + vals +
         "]} : f32[" + ws + "]\n" +
         (lin ? "  %b = constant() {value = dense<f32[" + std::to_string(n) + "]>[" + bias + "]} : f32[" +
                    std::to_string(n) + "]\n"
              : "") +
         "  %y = " + op + "(%x, %w" + (lin ? ", %b" : "") + ") : " + yt + "\n  return %y\n}\n";
}

/// SQNR of `passes` on `text` over random inputs in [-2, 2] (amax 2 calibrates them).
double graph_sqnr(const std::string& text, const std::string& passes) {
  return test::graph_sqnr(reg(), text, passes, 5);
}

TEST_CASE("quantize-fp8 rewrites a constant-weight linear into quantize + scaled_matmul") {
  const std::string scales = scales_file(R"({"kiln_fp8_scales": 1, "amax": {"x": 2.0}})");
  auto g = parse(gaussian_kir("linear", 4, 16, 32, 1));
  double wmax = 0;
  for (double v : find_op(*g, "constant")->attr("value")->as_tensor().to_f64()) wmax = std::max(wmax, std::fabs(v));
  REQUIRE(run_passes(*g, "quantize-fp8{scales=" + scales + "}").ok());
  CHECK(op_names(*g) == std::vector<std::string>{"constant", "constant", "quantize", "constant", "constant",
                                                 "scaled_matmul"});
  const Node* q = find_op(*g, "quantize");
  const Node* m = find_op(*g, "scaled_matmul");
  CHECK(q->result()->dtype() == DType::kF8E4M3FN);
  CHECK(q->operand(1)->producer()->attr("value")->as_tensor().get_f64(0) == doctest::Approx(2.0 / 448));
  CHECK(m->result()->name() == "y");  // the report matches layers by name
  CHECK(m->operand(1)->type().str() == "f8e4m3fn[16, 32]");
  CHECK(m->operand(3)->producer()->attr("value")->as_tensor().get_f64(0) == doctest::Approx(wmax / 448).epsilon(1e-6));
  CHECK(m->operand(4)->name() == "b");
  CHECK(m->get_string("fallback") == "none");
  CHECK(verify(*g).ok());
}

TEST_CASE("quantize-fp8: consumers of one activation share one quantize") {
  const std::string scales = scales_file(R"({"amax": {"x": 1}})");
  std::string w;
  for (int i = 0; i < 256; ++i) w += (i ? ", " : "") + std::to_string(i % 5 - 2);
  auto g = parse(
      "graph @g(%x: f32[2, 16]) -> (f32[2, 16], f32[2, 16]) {\n"
      "  %w = constant() {value = dense<f32[16, 16]>[" + w + "]} : f32[16, 16]\n"
      "  %a = linear(%x, %w) : f32[2, 16]\n  %b = linear(%x, %w) : f32[2, 16]\n  return %a, %b\n}\n");
  REQUIRE(run_passes(*g, "quantize-fp8{scales=" + scales + "}").ok());
  int quantizes = 0, gemms = 0;
  for (const auto& n : g->nodes()) quantizes += n->op_name() == "quantize", gemms += n->op_name() == "scaled_matmul";
  CHECK(quantizes == 1);
  CHECK(gemms == 2);
  CHECK(verify(*g).ok());
}

TEST_CASE("quantize-fp8: matmul weights are transposed to [n, k]; fallback and e5m2 are recorded") {
  const std::string scales = scales_file(R"({"amax": {"x": 1}})");
  auto g = parse(gaussian_kir("matmul", 2, 16, 48, 2));
  REQUIRE(run_passes(*g, "quantize-fp8{scales=" + scales + ",fallback=bf16,format=e5m2}").ok());
  const Node* m = find_op(*g, "scaled_matmul");
  REQUIRE(m != nullptr);
  CHECK(m->operand(0)->dtype() == DType::kF8E5M2);
  CHECK(m->operand(1)->type().str() == "f8e4m3fn[16, 48]");
  CHECK(m->get_string("fallback") == "bf16");
}

TEST_CASE("quantize-fp8: single-layer SQNR on Gaussian weights is that of E4M3 (about 29 dB)") {
  const std::string scales = scales_file(R"({"amax": {"x": 2}})");
  for (const char* op : {"linear", "matmul"}) {
    CAPTURE(op);
    const double db = graph_sqnr(gaussian_kir(op, 8, 64, 128, 3), "quantize-fp8{scales=" + scales + "}");
    MESSAGE(std::string(op) << ": " << db << " dB");
    CHECK(db >= 26.0);
    CHECK(db <= 35.0);  // far above would mean nothing was quantized
  }
  // A scale calibrated too small saturates half the activations: the loss must show.
  const std::string low = scales_file(R"({"amax": {"x": 1}})");
  CHECK(graph_sqnr(gaussian_kir("linear", 8, 64, 128, 3), "quantize-fp8{scales=" + low + "}") < 15.0);
}

TEST_CASE("quantize-fp8 leaves alone what it was told not to quantize") {
  const std::string scales = scales_file(R"({"amax": {"x": 1}})");
  for (const char* opts : {",min-size=100000", ",exclude=[w]", ",include=[nothing]"}) {
    CAPTURE(opts);
    auto g = parse(gaussian_kir("linear", 2, 16, 32, 4));
    REQUIRE(run_passes(*g, "quantize-fp8{scales=" + scales + opts + "}").ok());
    CHECK(find_op(*g, "scaled_matmul") == nullptr);
  }
  auto g = parse(gaussian_kir("linear", 2, 16, 32, 4));
  REQUIRE(run_passes(*g, "quantize-fp8{scales=" + scales + ",include=[y]}").ok());
  CHECK(find_op(*g, "scaled_matmul") != nullptr);
}

TEST_CASE("quantize-fp8 refuses bad options and scales files, naming them") {
  auto error = [](const std::string& passes) {
    auto g = parse(gaussian_kir("linear", 2, 16, 32, 4));
    Status s = run_passes(*g, passes);
    REQUIRE_FALSE(s.ok());
    return s.message();
  };
  const std::string good = scales_file(R"({"amax": {"x": 1}})");
  CHECK(error("quantize-fp8{scales=" + good + ",format=e3m4}").find("format must be e4m3 or e5m2, got 'e3m4'") !=
        std::string::npos);
  CHECK(error("quantize-fp8{scales=" + good + ",fallback=f32}").find("fallback must be none or bf16, got 'f32'") !=
        std::string::npos);
  CHECK(error("quantize-fp8").find("mode=static needs scales=FILE") != std::string::npos);
  CHECK(error("quantize-fp8{mode=delayed}").find("mode=delayed is not implemented yet") != std::string::npos);
  CHECK(error("quantize-fp8{scales=/does/not/exist.json}").find("cannot open scales file '/does/not/exist.json'") !=
        std::string::npos);
  CHECK(error("quantize-fp8{scales=" + scales_file(R"({"amax": {"x": true}})") + "}")
            .find("amax of \"x\" is not a number") != std::string::npos);
  CHECK(error("quantize-fp8{scales=" + scales_file(R"({"other": 1})") + "}").find("no \"amax\" object") !=
        std::string::npos);
  CHECK(error("quantize-fp8{scales=" + scales_file(R"({"amax": {"z": 1}})") + "}")
            .find("has no amax for activation %x (input of linear %y); re-run kiln calibrate") != std::string::npos);
}

TEST_CASE("convert-bf16 computes in bf16 behind an unchanged f32 signature") {
  const std::string text = gaussian_kir("linear", 4, 16, 32, 6);
  auto g = parse(text);
  REQUIRE(run_passes(*g, "convert-bf16").ok());
  CHECK(g->input(0)->dtype() == DType::kF32);
  CHECK(g->output(0)->dtype() == DType::kF32);
  CHECK(g->output(0)->name() == "y");
  CHECK(find_op(*g, "linear")->result()->dtype() == DType::kBF16);
  CHECK(find_op(*g, "constant")->attr("value")->as_tensor().dtype() == DType::kBF16);
  const double db = graph_sqnr(text, "convert-bf16");
  MESSAGE("convert-bf16 linear: " << db << " dB");
  CHECK(db >= 40.0);  // bf16 keeps 8 significant bits: about 50 dB per rounding
}

}  // namespace
}  // namespace kiln::test
