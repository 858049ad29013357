// The optimizer's low-precision-copies: the forward reads each weight's bf16/f16 cast from a
// variable the update writes, with the same results as casting the master weight every step,
// and every path that sets state keeps the copies their weights' (complete_state_copies).
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "autodiff.h"
#include "kiln/core/options.h"
#include "kiln/ir/interpreter.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

namespace kiln::training {
namespace {

std::string random_constant(const std::string& name, std::vector<int64_t> shape, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-0.5, 0.5);
  int64_t n = 1;
  std::string dims, values;
  for (int64_t d : shape) {
    n *= d;
    dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  }
  for (int64_t i = 0; i < n; ++i) values += (i ? ", " : "") + std::to_string(u(rng));
  return "  %" + name + " = constant() {value = dense<f32[" + dims + "]>[" + values + "]} : f32[" + dims + "]\n";
}

/// Two linear layers and an MSE loss; `w2` is read by two contractions (two casts of it).
std::string two_layers() {
  std::mt19937 rng(7);
  return "graph @g(%x: f32[4, 3], %t: f32[4, 2]) -> (%loss: f32[]) {\n" + random_constant("w1", {5, 3}, rng) +
         random_constant("b1", {5}, rng) + random_constant("w2", {2, 5}, rng) + R"(  %h = linear(%x, %w1, %b1) : f32[4, 5]
  %a = tanh(%h) : f32[4, 5]
  %o = linear(%a, %w2) : f32[4, 2]
  %p = linear(%a, %w2) : f32[4, 2]
  %q = add(%o, %p) : f32[4, 2]
  %loss = mse_loss(%q, %t) : f32[]
  return %loss
})";
}

void run_pass(Graph& g, const PassInfo& info, std::map<std::string, OptionValue> given) {
  auto o = resolve_options(info.options, given, "pass '" + info.name + "'");
  REQUIRE_MESSAGE(o.ok(), o.status().message());
  auto pass = info.create(*o);
  REQUIRE_MESSAGE(pass.ok(), pass.status().message());
  auto r = (*pass)->run(g);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
}

/// The training step: autocast to `low`, autodiff (dynamic loss scaling for f16), AdamW with
/// clipping, with or without the copies.
std::unique_ptr<Graph> step(const std::string& low, bool copies) {
  auto g = parse_graph(two_layers());
  REQUIRE(g.ok());
  run_pass(**g, autocast_pass_info(), {{"dtype", low}});
  AutodiffConfig c;
  if (low == "f16") c.init_loss_scale = 1024;
  REQUIRE(differentiate(**g, c).ok());
  run_pass(**g, optimizer_pass_info(),
           {{"lr", 0.05}, {"weight-decay", 0.01}, {"max-grad-norm", 1.0}, {"low-precision-copies", copies}});
  Status v = verify(**g);
  REQUIRE_MESSAGE(v.ok(), v.message());
  return std::move(*g);
}

std::vector<Tensor> batch(int k, bool overflow = false) {
  std::mt19937 rng(static_cast<unsigned>(100 + k));
  std::normal_distribution<double> n(0, 1);
  std::vector<double> x(12), t(8);
  for (double& v : x) v = n(rng);
  for (double& v : t) v = n(rng);
  // Step 3 of the f16 run overflows: the scaler skips it and backs off.
  if (overflow && k == 3) x[0] = 1e30;
  return {Tensor::from_f64(DType::kF32, {4, 3}, x), Tensor::from_f64(DType::kF32, {4, 2}, t)};
}

TEST_CASE("low-precision-copies: the forward reads copies the update writes, and every result is the same") {
  for (const std::string low : {"bf16", "f16"}) {
    CAPTURE(low);
    auto plain = step(low, false), copied = step(low, true);
    const DType t = low == "bf16" ? DType::kBF16 : DType::kF16;
    std::map<std::string, std::string> copies;
    for (const auto& n : copied->nodes()) {
      if (n->op_name() == "variable" && !state_copy_master(*n).empty())
        copies[n->get_string("name")] = state_copy_master(*n);
      // No cast of a master weight is left: the forward and backward read the copies.
      if (n->op_name() == "cast" && n->operand(0)->producer() && n->operand(0)->producer()->op_name() == "variable")
        CHECK(n->operand(0)->producer()->get_string("name") == "optimizer.step");
    }
    const std::string d(dtype_name(t));
    CHECK(copies == std::map<std::string, std::string>{{"b1." + d, "b1"}, {"w1." + d, "w1"}, {"w2." + d, "w2"}});
    Interpreter a, b;
    for (int k = 0; k < 6; ++k) {
      const std::vector<Tensor> in = batch(k, low == "f16");
      auto ra = a.run(*plain, in);
      auto rb = b.run(*copied, in);
      REQUIRE_MESSAGE(ra.ok(), ra.status().message());
      REQUIRE_MESSAGE(rb.ok(), rb.status().message());
      REQUIRE(ra->size() == rb->size());
      for (size_t i = 0; i < ra->size(); ++i) CHECK((*ra)[i].identical((*rb)[i]));
    }
    auto sa = a.state_of(*plain), sb = b.state_of(*copied);
    if (low == "f16") CHECK(sa[kLossScaleVariable].get_f64(0) < 1024);  // the overflowing step was skipped
    for (const auto& [name, value] : sa) CHECK(value.identical(sb.at(name)));
    // Each copy is its weight's cast after six steps (the skipped one included).
    for (const auto& [copy, master] : copies) {
      Tensor want = Tensor::from_f64(t, sb.at(master).shape(), sb.at(master).to_f64());
      CHECK(sb.at(copy).identical(want));
    }
  }
}

TEST_CASE("low-precision-copies: setting a weight refreshes its copy, setting a copy alone is refused") {
  auto plain = step("bf16", false), copied = step("bf16", true);
  Interpreter a, b;
  for (int k = 0; k < 2; ++k) {
    REQUIRE(a.run(*plain, batch(k)).ok());
    REQUIRE(b.run(*copied, batch(k)).ok());
  }
  // A checkpoint of the run without copies (an older one) sets the run with them: the copies
  // are computed from the weights, and the steps go on as the plain run's.
  Status s = b.set_state(*copied, a.state_of(*plain));
  REQUIRE_MESSAGE(s.ok(), s.message());
  // One weight by name: its copy follows.
  Tensor w1 = Tensor::from_f64(DType::kF32, {5, 3}, std::vector<double>(15, 0.3));
  REQUIRE(a.set_state(*plain, {{"w1", w1}}).ok());
  REQUIRE(b.set_state(*copied, {{"w1", w1}}).ok());
  CHECK(b.state_of(*copied).at("w1.bf16").get_f64(0) == Tensor::scalar_f64(DType::kBF16, 0.3).get_f64(0));
  for (int k = 2; k < 5; ++k) {
    auto ra = a.run(*plain, batch(k));
    auto rb = b.run(*copied, batch(k));
    REQUIRE(ra.ok());
    REQUIRE(rb.ok());
    CHECK((*ra)[0].identical((*rb)[0]));
  }
  // A copy without its weight would read other values than the weight's cast.
  Status alone = b.set_state(*copied, {{"w1.bf16", Tensor(DType::kBF16, {5, 3})}});
  REQUIRE_FALSE(alone.ok());
  CHECK(alone.message() ==
        "variable 'w1.bf16' is the bf16 copy of weight 'w1' that the training step keeps; set 'w1' and the copy follows");
  // A value given for the copy with its weight is replaced by the weight's cast.
  REQUIRE(b.set_state(*copied, {{"w1", w1}, {"w1.bf16", Tensor(DType::kBF16, {5, 3})}}).ok());
  CHECK(b.state_of(*copied).at("w1.bf16").get_f64(0) != 0);
}

TEST_CASE("the verifier checks what a copy of a weight names") {
  auto refused = [](const std::string& body) {
    // The parser verifies what it reads.
    auto g = parse_graph("graph @g() -> (f32[2]) {\n" + body + "}");
    REQUIRE_FALSE(g.ok());
    return g.status().message();
  };
  const std::string w = "  %w = variable() {name = \"w\", init = dense<f32[2]>[1.0, 2.0]} : f32[2]\n";
  CHECK(refused(w + "  %c = variable() {name = \"c\", init = dense<bf16[2]>[1.0, 2.0], copy_of = \"v\"} : bf16[2]\n"
                    "  return %w\n")
            .find("'c' is a copy of 'v', which is no other variable of the graph") != std::string::npos);
  CHECK(refused(w + "  %c = variable() {name = \"c\", init = dense<bf16[3]>[1.0, 2.0, 3.0], copy_of = \"w\"} : bf16[3]\n"
                    "  return %w\n")
            .find("'c' (bf16[3]) cannot be a copy of 'w' (f32[2])") != std::string::npos);
  CHECK(refused(w + "  %c = variable() {name = \"c\", init = dense<bf16[2]>[1.0, 2.0], copy_of = \"w\"} : bf16[2]\n"
                    "  %n = add(%w, %w) : f32[2]\n  assign(%n) {name = \"w\"}\n  return %w\n")
            .find("'c' is a copy of 'w', which is assigned while the copy is not") != std::string::npos);
}

}  // namespace
}  // namespace kiln::training
