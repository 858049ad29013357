// Tests of the quantize-fp8 and convert-bf16 passes: the rewrite on .kir graphs, options,
// filters and errors, and SQNR against the unquantized graph on the reference interpreter.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "../common/skip.h"
#include "quant_test_util.h"
#include "kiln/core/driver.h"
#include "kiln/ir/interpreter.h"
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
  // keep-output-layers: the linear computes the graph output (the walk through casts, views
  // and bias adds is tested with quantize-int4, which shares it).
  for (const char* opts : {",min-size=100000", ",exclude=[w]", ",include=[nothing]", ",keep-output-layers=true"}) {
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
  CHECK(error("quantize-fp8{mode=delayed,scales=" + good + "}").find("mode=delayed computes scales at run time") !=
        std::string::npos);
  CHECK(error("quantize-fp8{mode=delayed,margin=65}").find("margin must be within [-64, 64], got 65") !=
        std::string::npos);
  CHECK(error("quantize-fp8{mode=delayed,history=0}").find("history and interval must be at least 1") !=
        std::string::npos);
  CHECK(error("quantize-fp8{mode=delayed,min-size=-1}").find("min-size must be at least 0, got -1") !=
        std::string::npos);
  CHECK(error("quantize-fp8{mode=fast}").find("mode must be static or delayed, got 'fast'") != std::string::npos);
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

/// The value of the variable called `name` in `g` (null when there is none).
Value* variable(const Graph& g, const std::string& name) {
  for (const auto& n : g.nodes())
    if (n->op_name() == "variable" && n->get_string("name") == name) return n->result();
  return nullptr;
}

int count_ops(const Graph& g, const std::string& op) {
  int c = 0;
  for (const auto& n : g.nodes()) c += n->op_name() == op;
  return c;
}

/// x f32[rows, k] uniform in [-mag, mag] with max |x| exactly mag (element 0 is -mag).
Tensor input_with_amax(int64_t rows, int64_t k, double mag, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-mag, mag);
  Tensor x(DType::kF32, {rows, k});
  for (int64_t i = 0; i < x.numel(); ++i) x.set_f64(i, i == 0 ? -mag : u(rng));
  return x;
}

TEST_CASE("quantize-fp8 mode=delayed keeps an amax history and a scale per activation in graph state") {
  auto g = parse(gaussian_kir("linear", 4, 16, 32, 1));
  REQUIRE(run_passes(*g, "quantize-fp8{mode=delayed,history=4,interval=3}").ok());
  REQUIRE(verify(*g).ok());
  const Value* hist = variable(*g, "x.amax_history");
  const Value* scale = variable(*g, "x.scale");
  const Value* step = variable(*g, "fp8.step");
  REQUIRE(hist != nullptr);
  REQUIRE(scale != nullptr);
  REQUIRE(step != nullptr);
  CHECK(hist->type().str() == "f32[4]");
  CHECK(scale->producer()->attr("init")->as_tensor().get_f64(0) == 1.0);
  CHECK(step->type().str() == "i64[]");
  CHECK(count_ops(*g, "assign") == 3);
  CHECK(count_ops(*g, "amax") == 1);
  CHECK(find_op(*g, "quantize")->operand(1) == scale);
  CHECK(find_op(*g, "scaled_matmul")->operand(2) == scale);
  // Weights keep a static scale, computed from the weight here.
  CHECK(find_op(*g, "scaled_matmul")->operand(3)->producer()->op_name() == "constant");
  // The text form round-trips, state included.
  const std::string text = print_graph(*g);
  CHECK(print_graph(*parse(text)) == text);
  // interval=1 needs no step counter.
  auto g1 = parse(gaussian_kir("linear", 4, 16, 32, 1));
  REQUIRE(run_passes(*g1, "quantize-fp8{mode=delayed}").ok());
  CHECK(variable(*g1, "fp8.step") == nullptr);
  CHECK(variable(*g1, "x.amax_history")->type().str() == "f32[16]");
}

TEST_CASE("quantize-fp8 mode=delayed: the history rolls every run, the scale updates on interval boundaries") {
  auto g = parse(gaussian_kir("linear", 2, 16, 32, 7));
  REQUIRE(run_passes(*g, "quantize-fp8{mode=delayed,history=3,interval=2,margin=1}").ok());
  Value* scale = variable(*g, "x.scale");
  g->set_outputs({g->output(0), scale});  // also return the scale each run used
  REQUIRE(verify(*g).ok());
  const double f = 2.0 / 448;  // 2^margin / max_finite(e4m3)
  struct Expect {
    double amax;
    std::vector<double> history;
    double scale;  // after the run
  };
  // Steps 0, 2, 4, 6 are due (step % 2 == 0); the max is over the history including this run.
  const std::vector<Expect> steps = {
      {0, {0, 0, 0}, 1},                  // due, but max(history) = 0: the scale stays
      {1, {1, 0, 0}, 1},                  // not due
      {4, {4, 1, 0}, 4 * f},              // due
      {2, {2, 4, 1}, 4 * f},              // not due
      {0.5, {0.5, 2, 4}, 4 * f},          // due: 4 is still in the history
      {0.25, {0.25, 0.5, 2}, 4 * f},      // not due
      {0.25, {0.25, 0.25, 0.5}, 0.5 * f}, // due: 4 and 2 have rolled out
  };
  Interpreter interp;
  std::mt19937 rng(11);
  double used = 1;
  for (size_t t = 0; t < steps.size(); ++t) {
    CAPTURE(t);
    const Tensor x = input_with_amax(2, 32, steps[t].amax, rng);
    auto out = interp.run(*g, {&x, 1});
    REQUIRE_MESSAGE(out.ok(), out.status().message());
    CHECK((*out)[1].get_f64(0) == doctest::Approx(used).epsilon(1e-6));  // the scale of the run before
    const std::vector<double> hist = interp.variable_value("x.amax_history")->to_f64();
    CHECK(hist == steps[t].history);
    CHECK(interp.variable_value("x.scale")->get_f64(0) == doctest::Approx(steps[t].scale).epsilon(1e-6));
    CHECK(interp.variable_value("fp8.step")->get_i64(0) == static_cast<int64_t>(t + 1));
    used = steps[t].scale;
  }
}

TEST_CASE("quantize-fp8 mode=delayed: over steps the scale follows the amax history and SQNR holds") {
  const std::string text = gaussian_kir("linear", 8, 64, 128, 3);
  auto ref = parse(text);
  auto g = parse(text);
  REQUIRE(run_passes(*g, "quantize-fp8{mode=delayed,history=2}").ok());
  g->set_outputs({g->output(0), variable(*g, "x.scale")});
  REQUIRE(verify(*g).ok());
  // One executable for all steps: the reference backend keeps the state between runs.
  auto backend = (*reg().backend("reference"))->create(Options());
  REQUIRE(backend.ok());
  auto exe = (*backend)->compile(*g);
  REQUIRE_MESSAGE(exe.ok(), exe.status().message());
  const std::vector<double> mags = {1, 1, 1, 4, 4, 4, 0.5, 0.5, 0.5};
  std::mt19937 rng(5);
  std::vector<double> amax;
  for (size_t t = 0; t < mags.size(); ++t) {
    CAPTURE(t);
    const std::vector<Tensor> x = {input_with_amax(8, 128, mags[t], rng)};
    auto out = (*exe)->run(x);
    REQUIRE_MESSAGE(out.ok(), out.status().message());
    // The scale this step used: max of the two previous steps' amax over 448 (1 at first).
    double want = t == 0 ? 1.0 : amax.back() / 448;
    if (t >= 2) want = std::max(amax[t - 1], amax[t - 2]) / 448;
    CHECK((*out)[1].get_f64(0) == doctest::Approx(want).epsilon(1e-6));
    amax.push_back(mags[t]);
    const double db = sqnr_db(run_reference(reg(), *ref, x), {(*out)[0]});
    MESSAGE("step " << t << " (|x| <= " << mags[t] << "): " << db << " dB");
    // Once the history has seen this magnitude the scale fits it: E4M3's SQNR.
    if (t == 1 || t == 2 || t == 4 || t == 5 || t == 8) CHECK(db >= 26.0);
    // The step where the magnitude jumps still uses the old, small scale and saturates.
    if (t == 3) CHECK(db < 15.0);
  }
}

TEST_CASE("quantize-fp8 mode=delayed: cleanup, fusion and scheduling passes keep the state updates") {
  Registry& r = registry_with({"kiln-plugin-quantize-fp8.so", "kiln-plugin-backend-reference.so",
                               "kiln-plugin-transforms.so", "kiln-plugin-fusion.so", "kiln-plugin-schedule.so"});
  auto plain = parse(gaussian_kir("linear", 4, 16, 32, 9));
  REQUIRE(test::run_passes(*plain, "quantize-fp8{mode=delayed,history=3,interval=2}", r).ok());
  auto g = plain->clone();
  Status s = test::run_passes(*g, "canonicalize,cse,dce,fuse-pointwise,fuse-rows,schedule-memory", r);
  REQUIRE_MESSAGE(s.ok(), s.message());
  REQUIRE(verify(*g).ok());
  CHECK(count_ops(*g, "variable") == 3);
  CHECK(count_ops(*g, "assign") == 3);
  // Both graphs step through the same states: equal outputs on every run.
  Interpreter a, b;
  std::mt19937 rng(3);
  for (double mag : {1.0, 3.0, 0.5, 2.0}) {
    const Tensor x = input_with_amax(4, 32, mag, rng);
    auto ya = a.run(*plain, {&x, 1});
    auto yb = b.run(*g, {&x, 1});
    REQUIRE(ya.ok());
    REQUIRE_MESSAGE(yb.ok(), yb.status().message());
    CHECK((*ya)[0].identical((*yb)[0]));
  }
  CHECK(a.variable_value("x.scale")->identical(*b.variable_value("x.scale")));
  CHECK(a.variable_value("x.amax_history")->identical(*b.variable_value("x.amax_history")));
}

TEST_CASE("quantize-fp8 mode=delayed runs on the cpu backend step for step like the reference") {
  // Built when configure found LLVM 19 and OpenBLAS; then the plugin must load, else skip.
  if (!KILN_HAVE_CPU_BACKEND) {
    test::skip("the cpu backend plugin is not built (needs LLVM 19 and OpenBLAS: scripts/install-deps.sh)");
    return;
  }
  Registry& r = registry_with({"kiln-plugin-quantize-fp8.so", "kiln-plugin-backend-reference.so",
                               "kiln-plugin-backend-cpu.so"});
  auto g = parse(gaussian_kir("linear", 4, 16, 32, 12));
  REQUIRE(test::run_passes(*g, "quantize-fp8{mode=delayed,history=2,interval=2}", r).ok());
  g->set_outputs({g->output(0), variable(*g, "x.scale")});
  auto exe = [&](const char* name) {
    auto b = (*r.backend(name))->create(Options());
    REQUIRE(b.ok());
    auto e = (*b)->compile(*g);
    REQUIRE_MESSAGE(e.ok(), e.status().message());
    return std::move(e).value();
  };
  auto ref = exe("reference");
  auto cpu_exe = exe("cpu");
  std::mt19937 rng(8);
  for (double mag : {1.0, 3.0, 3.0, 0.5, 0.5, 2.0}) {
    CAPTURE(mag);
    const std::vector<Tensor> x = {input_with_amax(4, 32, mag, rng)};
    auto want = ref->run(x);
    auto got = cpu_exe->run(x);
    REQUIRE(want.ok());
    REQUIRE_MESSAGE(got.ok(), got.status().message());
    CHECK((*got)[1].identical((*want)[1]));  // the scale this step used
    CHECK(sqnr_db({(*want)[0]}, {(*got)[0]}) > 40.0);
  }
}

}  // namespace
}  // namespace kiln::test
