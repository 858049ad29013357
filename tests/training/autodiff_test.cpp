// The autodiff pass: every gradient rule against f64 central finite differences on the
// reference interpreter (one table row per op), the rule table's coverage of the core op set,
// and the pass's errors.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "autodiff.h"
#include "kiln/ir/interpreter.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

namespace kiln::training {
namespace {

TensorType f64(std::vector<int64_t> shape) { return {DType::kF64, shape_of(shape)}; }

struct Input {
  TensorType type;
  double lo = -1, hi = 1;
  std::vector<int64_t> ints = {};  ///< values of an integer or bool input
};

struct Case {
  std::string name;  ///< the op, plus a variant after ':'
  std::vector<Input> inputs;
  AttrMap attrs = {};
  int results = 1;
  double h = 1e-6;     ///< finite-difference step
  double tol = 1e-6;   ///< |analytic - fd| <= tol * (1 + |fd|)
  std::string op() const { return name.substr(0, name.find(':')); }
};

Input ints(DType t, std::vector<int64_t> shape, std::vector<int64_t> values) {
  return {TensorType{t, shape_of(shape)}, 0, 0, std::move(values)};
}
Input pos(std::vector<int64_t> shape) { return {f64(shape), 0.5, 2.0}; }
Input in(std::vector<int64_t> shape, double lo = -1, double hi = 1) { return {f64(shape), lo, hi}; }

std::vector<Case> cases() {
  const Input a23{f64({2, 3})}, b23{f64({2, 3})}, b3{f64({3})}, b13{f64({1, 3})};
  std::vector<Case> c = {
      {"identity", {a23}}, {"neg", {a23}}, {"abs", {a23}}, {"exp", {a23}}, {"log", {pos({2, 3})}},
      {"sqrt", {pos({2, 3})}}, {"rsqrt", {pos({2, 3})}}, {"reciprocal", {pos({2, 3})}}, {"sin", {a23}},
      {"cos", {a23}}, {"tanh", {a23}}, {"sigmoid", {a23}}, {"softplus", {a23}}, {"erf", {a23}}, {"silu", {a23}},
      {"gelu", {a23}}, {"gelu:tanh", {a23}, {{"approximate", Attribute("tanh")}}}, {"relu", {a23}},
      {"leaky_relu", {a23}, {{"alpha", Attribute(0.2)}}},
      {"clip", {in({2, 3}, -2, 2)}, {{"min", Attribute(-0.5)}, {"max", Attribute(0.7)}}},
      {"clip:min", {in({2, 3}, -2, 2)}, {{"min", Attribute(-0.5)}}},
      {"cast", {a23}, {{"to", Attribute(DType::kF32)}}, 1, 1e-3, 1e-5},
      {"add", {a23, b3}}, {"add:bcast", {a23, b13}}, {"sub", {a23, b3}}, {"mul", {a23, b13}},
      {"div", {a23, in({3}, 0.5, 2)}}, {"pow", {pos({2, 3}), b3}},
      {"maximum", {a23, b3}}, {"minimum", {a23, b23}},
      {"mod", {in({2, 3}, 2, 3), in({3}, 0.7, 0.9)}}, {"mod:fmod", {in({2, 3}, -3, -2), in({3}, 0.7, 0.9)}, {{"fmod", Attribute(1)}}},
      {"where", {ints(DType::kBool, {2, 3}, {1, 0, 1, 0, 0, 1}), a23, b3}},
      {"reduce_sum", {in({2, 3, 4})}, {{"axes", Attribute(std::vector<int64_t>{1})}, {"keepdims", Attribute(0)}}},
      {"reduce_sum:all", {a23}},
      {"reduce_mean", {in({2, 3, 4})}, {{"axes", Attribute(std::vector<int64_t>{0, -1})}}},
      {"reduce_max", {in({2, 3, 4})}, {{"axes", Attribute(std::vector<int64_t>{2})}, {"keepdims", Attribute(0)}}},
      {"reduce_min", {in({2, 3, 4})}, {{"axes", Attribute(std::vector<int64_t>{1})}}},
      {"amax", {a23}, {}, 1, 1e-3, 1e-4},
      {"softmax", {in({2, 3, 4})}, {{"axis", Attribute(1)}}}, {"log_softmax", {in({2, 4})}},
      {"layer_norm", {in({2, 3, 4}), in({4}), in({4})}},
      {"layer_norm:axis1", {in({2, 3, 4}), in({3, 4})}, {{"axis", Attribute(1)}}},
      {"rms_norm", {in({2, 3, 4}), in({4})}},
      {"batch_norm", {in({2, 3, 2}), in({3}), in({3}), in({3}), pos({3})}},
      {"matmul", {in({2, 3, 4}), in({4, 5})}}, {"matmul:batch", {in({2, 1, 3, 4}), in({3, 4, 2})}},
      {"matmul:vec", {in({4}), in({2, 4, 3})}}, {"matmul:mat_vec", {in({3, 4}), in({4})}},
      {"matmul_acc", {in({3, 4}), in({4, 5}), in({3, 5})}},
      {"linear", {in({2, 3, 4}), in({5, 4}), in({5})}}, {"linear:nobias", {in({4}), in({5, 4})}},
      {"attention", {in({1, 2, 3, 4}), in({1, 2, 3, 4}), in({1, 2, 3, 2})}, {{"scale", Attribute(0.5)}}},
      {"attention:gqa_causal_mask",
       {in({1, 4, 3, 2}), in({1, 2, 5, 2}), in({1, 2, 5, 3}), in({3, 5})},
       {{"scale", Attribute(0.7)}, {"causal", Attribute(1)}}},
      {"conv", {in({2, 2, 5, 6}), in({3, 2, 3, 2}), in({3})},
       {{"strides", Attribute(std::vector<int64_t>{2, 1})}, {"pads", Attribute(std::vector<int64_t>{1, 0, 0, 1})},
        {"dilations", Attribute(std::vector<int64_t>{1, 2})}}},
      {"conv:groups_1d", {in({1, 4, 7}), in({6, 2, 3})},
       {{"groups", Attribute(2)}, {"strides", Attribute(std::vector<int64_t>{3})}, {"pads", Attribute(std::vector<int64_t>{2, 1})}}},
      {"conv:3d", {in({1, 1, 3, 4, 3}), in({2, 1, 2, 2, 2})}, {{"pads", Attribute(std::vector<int64_t>{0, 1, 0, 1, 0, 1})}}},
      {"avg_pool", {in({2, 3, 5, 6})}, {{"kernel_shape", Attribute(std::vector<int64_t>{2, 3})},
                                         {"strides", Attribute(std::vector<int64_t>{2, 1})}}},
      {"avg_pool:padded", {in({1, 2, 7})}, {{"kernel_shape", Attribute(std::vector<int64_t>{3})},
                                             {"strides", Attribute(std::vector<int64_t>{2})},
                                             {"pads", Attribute(std::vector<int64_t>{1, 1})},
                                             {"count_include_pad", Attribute(1)}}},
      {"reshape", {a23}, {{"shape", Attribute(std::vector<int64_t>{3, 2})}}},
      {"flatten", {in({2, 3, 2})}, {{"axis", Attribute(2)}}},
      {"squeeze", {in({2, 1, 3})}, {{"axes", Attribute(std::vector<int64_t>{1})}}},
      {"unsqueeze", {a23}, {{"axes", Attribute(std::vector<int64_t>{0, 3})}}},
      {"transpose", {in({2, 3, 4})}, {{"perm", Attribute(std::vector<int64_t>{2, 0, 1})}}},
      {"transpose:default", {a23}},
      {"expand", {b13}, {{"shape", Attribute(std::vector<int64_t>{2, 4, 3})}}},
      {"slice", {in({4, 5})}, {{"starts", Attribute(std::vector<int64_t>{1, -3})}, {"ends", Attribute(std::vector<int64_t>{3, 100})}}},
      {"concat", {a23, in({2, 2})}, {{"axis", Attribute(1)}}},
      {"split", {in({5, 2})}, {{"axis", Attribute(0)}, {"sizes", Attribute(std::vector<int64_t>{2, 3})}}, 2},
      {"gather", {in({5, 3}), ints(DType::kI64, {2, 2}, {0, 4, -1, 0})}},
      {"gather:axis1", {in({2, 4, 3}), ints(DType::kI32, {3}, {3, 1, 3})}, {{"axis", Attribute(1)}}},
      {"scatter_add", {in({5, 3}), ints(DType::kI64, {2, 2}, {0, 4, -1, 0}), in({2, 2, 3})}},
      {"scatter_add:axis1", {in({2, 4, 3}), ints(DType::kI32, {3}, {3, 1, 3}), in({2, 3, 3})}, {{"axis", Attribute(1)}}},
      {"pad", {a23}, {{"pads", Attribute(std::vector<int64_t>{1, 0, 0, 2})}}},
      {"pad:crop", {in({3, 4})}, {{"pads", Attribute(std::vector<int64_t>{-1, 1, 0, -2})}}},
      {"cross_entropy", {in({4, 5}), ints(DType::kI64, {4}, {1, 4, -100, 0})}},
      {"cross_entropy:sum_3d", {in({2, 2, 3}), ints(DType::kI32, {2, 2}, {2, 0, 1, 7})},
       {{"reduction", Attribute("sum")}, {"ignore_index", Attribute(7)}}},
      {"mse_loss", {a23, b23}},
      {"mse_loss:sum", {a23, b23}, {{"reduction", Attribute("sum")}}},
  };
  return c;
}

/// The forward graph of a case: its op applied to the inputs, then a scalar loss
/// sum_i sum(y_i * r_i) with fixed random weights r_i (a plain sum would hide transposes).
std::unique_ptr<Graph> forward_graph(const Case& c, std::mt19937& rng) {
  auto g = std::make_unique<Graph>("fd");
  std::vector<Value*> ins;
  for (size_t i = 0; i < c.inputs.size(); ++i) ins.push_back(g->add_input("in" + std::to_string(i), c.inputs[i].type));
  Builder b(*g);
  std::vector<Value*> ys;
  if (c.op() == "fused") {
    // A fused group exp(a) * b + a: its gradient comes from its region.
    Node* n = *g->create_node("fused", ins, {ins[0]->type()});
    Graph& body = n->add_region("body");
    Value *u = body.add_input("u", ins[0]->type()), *v = body.add_input("v", ins[1]->type());
    Builder rb(body);
    body.set_outputs({rb.add(rb.mul(rb.unary("exp", u), v), u)});
    ys = {n->result()};
  } else {
    ys = b.op_n(c.op(), ins, c.results, c.attrs);
  }
  std::uniform_real_distribution<double> real(-1, 1);
  Value* loss = nullptr;
  for (Value* y : ys) {
    Tensor r(DType::kF64, static_sizes(y->shape()));
    for (int64_t i = 0; i < r.numel(); ++i) r.set_f64(i, real(rng));
    Value* term = b.reduce("reduce_sum", b.mul(b.cast(y, DType::kF64), b.constant(r)), {}, false);
    loss = loss ? b.add(loss, term) : term;
  }
  g->set_outputs({loss}, {"loss"});
  return g;
}

std::vector<Tensor> case_inputs(const Case& c, std::mt19937& rng) {
  std::vector<Tensor> out;
  for (const Input& in : c.inputs) {
    Tensor t(in.type.dtype, static_sizes(in.type.shape));
    std::uniform_real_distribution<double> real(in.lo, in.hi);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (is_float(in.type.dtype)) t.set_f64(i, real(rng));
      else t.set_i64(i, in.ints.at(static_cast<size_t>(i)));
    }
    out.push_back(t);
  }
  return out;
}

double run_loss(const Graph& g, const std::vector<Tensor>& inputs) {
  auto out = Interpreter().run(g, inputs);
  REQUIRE_MESSAGE(out.ok(), out.status().message());
  return (*out)[0].get_f64(0);
}

/// Checks the analytic gradient of every float input of `c` against central differences.
void check_case(const Case& c) {
  CAPTURE(c.name);
  std::mt19937 rng(std::hash<std::string>()(c.name) & 0xffff);
  auto fwd = forward_graph(c, rng);
  REQUIRE_MESSAGE(verify(*fwd).ok(), std::string(verify(*fwd).message()));
  const std::vector<Tensor> inputs = case_inputs(c, rng);
  AutodiffConfig cfg;
  cfg.loss = "loss";
  for (int i = 0; i < fwd->num_inputs(); ++i)
    if (is_float(fwd->input(i)->dtype())) cfg.params.push_back(fwd->input(i)->name());
  auto joint = fwd->clone();
  auto params = differentiate(*joint, cfg);
  REQUIRE_MESSAGE(params.ok(), params.status().message());
  Status v = verify(*joint);
  REQUIRE_MESSAGE(v.ok(), std::string(v.message() + "\n" + print_graph(*joint)));
  auto out = Interpreter().run(*joint, inputs);
  REQUIRE_MESSAGE(out.ok(), std::string(out.status().message() + "\n" + print_graph(*joint)));
  CHECK((*out)[0].get_f64(0) == doctest::Approx(run_loss(*fwd, inputs)).epsilon(1e-12));
  size_t grad_out = 1;
  for (int i = 0; i < fwd->num_inputs(); ++i) {
    if (!is_float(fwd->input(i)->dtype())) continue;
    const Tensor& grad = (*out)[grad_out++];
    REQUIRE(grad.shape() == inputs[static_cast<size_t>(i)].shape());
    for (int64_t j = 0; j < grad.numel(); ++j) {
      std::vector<Tensor> plus = inputs, minus = inputs;
      Tensor &p = plus[static_cast<size_t>(i)], &m = minus[static_cast<size_t>(i)];
      p = Tensor(p.dtype(), p.shape());
      m = Tensor(m.dtype(), m.shape());
      for (int64_t k = 0; k < p.numel(); ++k) {
        const double x = inputs[static_cast<size_t>(i)].get_f64(k);
        p.set_f64(k, k == j ? x + c.h : x);
        m.set_f64(k, k == j ? x - c.h : x);
      }
      const double fd = (run_loss(*fwd, plus) - run_loss(*fwd, minus)) / (2 * c.h);
      const double an = grad.get_f64(j);
      CAPTURE(i);
      CAPTURE(j);
      CHECK_MESSAGE(std::abs(an - fd) <= c.tol * (1 + std::abs(fd)), "analytic " << an << " vs finite difference " << fd);
    }
  }
}

TEST_CASE("every gradient rule matches f64 central finite differences") {
  std::vector<Case> all = cases();
  all.push_back({"fused", {in({2, 3}), in({2, 3})}});
  for (const Case& c : all) check_case(c);
}

TEST_CASE("every op with a gradient rule has a finite-difference case") {
  std::set<std::string> tested;
  for (const Case& c : cases()) tested.insert(c.op());
  // The FP8 ops pass gradients straight through rounding, which finite differences cannot see:
  // fp8_training_test.cpp checks them against closed forms instead.
  for (const char* op : {"quantize", "requantize", "dequantize", "scaled_matmul", "quantize_grad"}) tested.insert(op);
  for (const auto& [op, entry] : rule_table())
    if (entry.kind == RuleKind::kRule) CHECK_MESSAGE(tested.count(op), "gradient rule of '" << op << "' has no finite-difference case");
}

TEST_CASE("every core op has a gradient rule, a non-differentiable mark or an explicit refusal") {
  for (const OpDef* def : OpRegistry::global().all()) {
    if (!def->library.empty()) continue;
    CHECK_MESSAGE(rule_for(def->name).kind != RuleKind::kMissing,
                  "core op '" << def->name << "' is missing from the autodiff rule table (grad_rules.cpp)");
  }
}

std::unique_ptr<Graph> parse(const std::string& text) {
  auto g = parse_graph(text);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(g).value();
}

AutodiffConfig cfg(std::string loss, std::vector<std::string> params) {
  AutodiffConfig c;
  c.loss = std::move(loss);
  c.params = std::move(params);
  return c;
}

std::string differentiate_error(const std::string& text, AutodiffConfig cfg) {
  auto g = parse(text);
  auto r = differentiate(*g, cfg);
  REQUIRE_FALSE(r.ok());
  return r.status().message();
}

const char* kMlp = R"(graph @mlp(%x: f32[4, 3], %t: i64[4]) -> (%loss: f32[]) {
  %w1 = constant() {value = dense<f32[2, 3]>[0.1, -0.2, 0.3, 0.4, 0.5, -0.6]} : f32[2, 3]
  %b1 = constant() {value = dense<f32[2]>[0.01, -0.02]} : f32[2]
  %h = linear(%x, %w1, %b1) : f32[4, 2]
  %a = tanh(%h) : f32[4, 2]
  %eps = constant() {value = dense<f32[]>[0.5]} : f32[]
  %s = mul(%a, %eps) : f32[4, 2]
  %loss = cross_entropy(%s, %t) : f32[]
  return %loss
})";

TEST_CASE("params = [] differentiates every float constant of rank >= 1 the loss depends on") {
  auto g = parse(kMlp);
  auto params = differentiate(*g, {});
  REQUIRE_MESSAGE(params.ok(), params.status().message());
  REQUIRE(params->size() == 2);
  CHECK((*params)[0]->name() == "w1");
  CHECK((*params)[1]->name() == "b1");
  REQUIRE(g->num_outputs() == 3);
  CHECK(g->output_name(0) == "loss");
  CHECK(g->output_name(1) == "w1.grad");
  CHECK(g->output_name(2) == "b1.grad");
  CHECK(verify(*g).ok());
}

TEST_CASE("autodiff errors name what is wrong") {
  CHECK(differentiate_error(kMlp, cfg("nope", {})) == "autodiff: the graph has no output 'nope' (option 'loss'); its outputs: loss");
  CHECK(differentiate_error(kMlp, cfg("", {"w9"})) == "autodiff: no value named 'w9' (option 'params')");
  CHECK(differentiate_error(kMlp, cfg("", {"t"})) == "autodiff: parameter 't' is i64[4], not float");
  const char* vector_loss = R"(graph @g(%x: f32[2]) -> (f32[2]) {
  %y = exp(%x) : f32[2]
  return %y
})";
  CHECK(differentiate_error(vector_loss, cfg("", {"x"})) == "autodiff: the loss must be a float scalar, got f32[2]");
  const char* conv = R"(graph @g(%x: f32[1, 1, 3, 3], %w: f32[1, 1, 2, 2]) -> (f32[]) {
  %y = max_pool(%x) {kernel_shape = [2, 2]} : f32[1, 1, 2, 2]
  %l = reduce_sum(%y) {keepdims = 0} : f32[]
  return %l
})";
  CHECK(differentiate_error(conv, cfg("", {"x"})).find(
            "autodiff: cannot differentiate op 'max_pool': no gradient rule yet") != std::string::npos);
  const char* strided = R"(graph @g(%x: f32[4]) -> (f32[]) {
  %y = slice(%x) {starts = [0], ends = [4], steps = [2]} : f32[2]
  %l = reduce_sum(%y) {keepdims = 0} : f32[]
  return %l
})";
  CHECK(differentiate_error(strided, cfg("", {"x"})).find(
            "gradient of 'slice': slice with step 2 has no gradient rule (only step 1)") != std::string::npos);
}

TEST_CASE("an op without any table entry is a clear error naming it") {
  OpDef def{.name = "autodiff_test_unknown",
            .summary = "test op",
            .inputs = {"x"},
            .outputs = {"y"},
            .result_rule = "same as x",
            .attrs = {},
            .num_regions = 0,
            .infer = [](InferContext& c) { c.results = {c.operand(0)}; return ok_status(); },
            .reference = [](KernelContext& c) { c.output() = c.input(0); return ok_status(); }};
  def.library = "test";
  if (!OpRegistry::global().find(def.name)) REQUIRE(OpRegistry::global().add(def).ok());
  const char* text = R"(graph @g(%x: f32[2]) -> (f32[]) {
  %y = autodiff_test_unknown(%x) : f32[2]
  %l = reduce_sum(%y) {keepdims = 0} : f32[]
  return %l
})";
  CHECK(differentiate_error(text, cfg("", {"x"})).find("autodiff: no gradient rule for op 'autodiff_test_unknown'") !=
        std::string::npos);
}

TEST_CASE("gradients flow through integer indices only into the float data") {
  // Non-differentiable ops (argmax, comparisons) stop the gradient without an error.
  const char* text = R"(graph @g(%x: f32[2, 3]) -> (f32[]) {
  %i = argmax(%x) {axis = 1} : i64[2, 1]
  %f = cast(%i) {to = f32} : f32[2, 1]
  %y = mul(%x, %f) : f32[2, 3]
  %l = reduce_sum(%y) {keepdims = 0} : f32[]
  return %l
})";
  auto g = parse(text);
  auto r = differentiate(*g, cfg("", {"x"}));
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  Tensor x = Tensor::from_f64(DType::kF32, {2, 3}, std::vector<double>{1, 5, 2, 7, 0, 3});
  auto out = Interpreter().run(*g, {&x, 1});
  REQUIRE(out.ok());
  // d/dx of x * argmax(x): the argmax index as a constant factor.
  CHECK((*out)[1].to_f64() == std::vector<double>{1, 1, 1, 0, 0, 0});
}

}  // namespace
}  // namespace kiln::training

namespace kiln::training {
namespace {

StatusOr<bool> run_optimizer(Graph& g, std::map<std::string, OptionValue> given) {
  const PassInfo info = optimizer_pass_info();
  KILN_ASSIGN_OR_RETURN(Options o, resolve_options(info.options, given, "pass 'optimizer'"));
  KILN_ASSIGN_OR_RETURN(auto pass, info.create(o));
  return pass->run(g);
}

TEST_CASE("optimizer turns weights into variables with PyTorch-named state") {
  auto g = parse(kMlp);
  REQUIRE(differentiate(*g, {}).ok());
  auto r = run_optimizer(*g, {{"max-grad-norm", 1.0}});
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  Status v = verify(*g);
  REQUIRE_MESSAGE(v.ok(), v.message());
  std::set<std::string> vars, assigned;
  for (const auto& n : g->nodes()) {
    if (n->op_name() == "variable") vars.insert(n->get_string("name"));
    if (n->op_name() == "assign") assigned.insert(n->get_string("name"));
  }
  const std::set<std::string> want{"b1", "b1.exp_avg", "b1.exp_avg_sq", "optimizer.step",
                                   "w1", "w1.exp_avg", "w1.exp_avg_sq"};
  CHECK(vars == want);
  CHECK(assigned == want);
  REQUIRE(g->num_outputs() == 2);  // the grads are consumed; clipping reports the norm
  CHECK(g->output_name(0) == "loss");
  CHECK(g->output_name(1) == "grad_norm");
}

TEST_CASE("sgd with momentum keeps a momentum_buffer per weight") {
  auto g = parse(kMlp);
  REQUIRE(differentiate(*g, cfg("", {"w1"})).ok());
  REQUIRE(run_optimizer(*g, {{"algorithm", std::string("sgd")}, {"momentum", 0.9}, {"keep-grads", true}}).ok());
  std::set<std::string> vars;
  for (const auto& n : g->nodes())
    if (n->op_name() == "variable") vars.insert(n->get_string("name"));
  CHECK(vars == std::set<std::string>{"optimizer.step", "w1", "w1.momentum_buffer"});
  CHECK(g->output_name(1) == "w1.grad");
}

TEST_CASE("optimizer errors name what is wrong") {
  auto g = parse(kMlp);
  auto r = run_optimizer(*g, {});
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == "optimizer: the graph has no '<param>.grad' outputs; run autodiff before it");
  const PassInfo info = optimizer_pass_info();
  auto bad = [&](std::map<std::string, OptionValue> given) {
    auto o = resolve_options(info.options, given, "pass 'optimizer'");
    REQUIRE(o.ok());
    auto p = info.create(*o);
    REQUIRE_FALSE(p.ok());
    return p.status().message();
  };
  CHECK(bad({{"algorithm", std::string("adam")}}) == "optimizer: option 'algorithm' must be \"sgd\" or \"adamw\", got \"adam\"");
  CHECK(bad({{"nesterov", true}}) == "optimizer: option 'nesterov' needs algorithm sgd with momentum > 0");
  CHECK(bad({{"beta2", 1.0}}) == "optimizer: options 'beta1' and 'beta2' must be in [0, 1)");
  // A weight given as a graph input cannot be updated in place.
  auto in = parse(R"(graph @g(%x: f32[2], %w: f32[2]) -> (%loss: f32[]) {
  %y = mul(%x, %w) : f32[2]
  %loss = reduce_sum(%y) {keepdims = 0} : f32[]
  return %loss
})");
  REQUIRE(differentiate(*in, cfg("", {"w"})).ok());
  auto e = run_optimizer(*in, {});
  REQUIRE_FALSE(e.ok());
  CHECK(e.status().message() ==
        "optimizer: parameter 'w' is a graph input; the weights a step updates must be constants or variables");
}

}  // namespace
}  // namespace kiln::training

namespace kiln::training {
namespace {

TEST_CASE("autocast runs contractions in bf16 and the rest in f32; gradients of f32 weights stay f32") {
  auto g = parse(kMlp);
  const PassInfo info = autocast_pass_info();
  auto o = resolve_options(info.options, {}, "pass 'autocast'");
  REQUIRE(o.ok());
  auto pass = info.create(*o);
  REQUIRE(pass.ok());
  auto changed = (*pass)->run(*g);
  REQUIRE_MESSAGE(changed.ok(), changed.status().message());
  CHECK(*changed);
  REQUIRE_MESSAGE(verify(*g).ok(), verify(*g).message());
  for (const auto& n : g->nodes()) {
    if (n->op_name() == "linear") CHECK(n->result()->dtype() == DType::kBF16);
    if (n->op_name() == "tanh" || n->op_name() == "cross_entropy") CHECK(n->result()->dtype() == DType::kF32);
  }
  auto params = differentiate(*g, {});
  REQUIRE_MESSAGE(params.ok(), params.status().message());
  CHECK(g->output(1)->dtype() == DType::kF32);  // w1.grad: the master weight's gradient
  CHECK(verify(*g).ok());
  auto bad = resolve_options(info.options, {{"dtype", std::string("f8")}}, "pass 'autocast'");
  REQUIRE(bad.ok());
  CHECK(info.create(*bad).status().message() == "autocast: option 'dtype' must be bf16 or f16, got 'f8'");
}

}  // namespace
}  // namespace kiln::training

namespace kiln::training {
namespace {

TEST_CASE("remat recomputes forward values in the backward and leaves the results unchanged") {
  // The split's pieces (data movement, like a GPT's q, k, v) are recomputed too: one clone of
  // the split serves both.
  const char* text = R"(graph @g(%x: f32[8, 16], %w: f32[16, 16]) -> (%loss: f32[]) {
  %h = linear(%x, %w) : f32[8, 16]
  %a = tanh(%h) : f32[8, 16]
  %b = mul(%a, %a) : f32[8, 16]
  %c = sigmoid(%b) : f32[8, 16]
  %y = linear(%c, %w) : f32[8, 16]
  %p, %q = split(%y) {axis = 1, sizes = [8, 8]} : f32[8, 8], f32[8, 8]
  %pq = mul(%p, %q) : f32[8, 8]
  %loss = reduce_mean(%pq) {keepdims = 0} : f32[]
  return %loss
})";
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> real(-1, 1);
  std::vector<Tensor> inputs;
  for (std::vector<int64_t> shape : {std::vector<int64_t>{8, 16}, std::vector<int64_t>{16, 16}}) {
    Tensor t(DType::kF32, shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, real(rng));
    inputs.push_back(t);
  }
  auto plain = parse(text);
  REQUIRE(differentiate(*plain, cfg("", {"w"})).ok());
  auto want = Interpreter().run(*plain, inputs);
  REQUIRE(want.ok());
  const PassInfo info = remat_pass_info();
  for (const char* policy : {"selective", "full"}) {
    CAPTURE(policy);
    auto g = plain->clone();
    auto o = resolve_options(info.options, {{"policy", std::string(policy)}}, "pass 'remat'");
    REQUIRE(o.ok());
    auto changed = (*info.create(*o))->run(*g);
    REQUIRE_MESSAGE(changed.ok(), changed.status().message());
    CHECK(*changed);
    REQUIRE_MESSAGE(verify(*g).ok(), verify(*g).message());
    std::set<std::string> recomputed;
    for (const auto& n : g->nodes())
      if (n->num_results() > 0 && n->result(0)->name().ends_with(".remat")) recomputed.insert(n->op_name());
    CHECK(recomputed.count("tanh"));
    CHECK(recomputed.count("split"));
    CHECK(recomputed.count("linear") == (std::string(policy) == "full" ? 1u : 0u));
    int splits = 0;
    for (const auto& n : g->nodes()) splits += n->op_name() == "split";
    CHECK(splits == 2);
    auto got = Interpreter().run(*g, inputs);
    REQUIRE(got.ok());
    for (size_t i = 0; i < got->size(); ++i) CHECK((*got)[i].identical((*want)[i]));
  }
  auto bad = resolve_options(info.options, {{"policy", std::string("some")}}, "pass 'remat'");
  REQUIRE(bad.ok());
  CHECK(info.create(*bad).status().message() == "remat: option 'policy' must be none, selective or full, got 'some'");
}

TEST_CASE("remat full keeps the block boundaries and recomputes each block from its own") {
  // Two residual blocks: the residual stream (h0, r1) alone carries the forward from one block
  // to the next. r2 and sq are cuts too, but no GEMM follows them: recomputing from r1 is as good.
  const char* text = R"(graph @g(%x: f32[8, 16], %w0: f32[16, 16], %w1: f32[16, 16], %w2: f32[16, 16]) -> (%loss: f32[]) {
  %h0 = linear(%x, %w0) : f32[8, 16]
  %t1 = tanh(%h0) : f32[8, 16]
  %u1 = linear(%t1, %w1) : f32[8, 16]
  %r1 = add(%h0, %u1) : f32[8, 16]
  %t2 = tanh(%r1) : f32[8, 16]
  %u2 = linear(%t2, %w2) : f32[8, 16]
  %r2 = add(%r1, %u2) : f32[8, 16]
  %sq = mul(%r2, %r2) : f32[8, 16]
  %loss = reduce_mean(%sq) {keepdims = 0} : f32[]
  return %loss
})";
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> real(-1, 1);
  std::vector<Tensor> inputs;
  for (int i = 0; i < 4; ++i) {
    Tensor t(DType::kF32, i == 0 ? std::vector<int64_t>{8, 16} : std::vector<int64_t>{16, 16});
    for (int64_t k = 0; k < t.numel(); ++k) t.set_f64(k, real(rng) * 0.5);
    inputs.push_back(t);
  }
  auto plain = parse(text);
  REQUIRE(differentiate(*plain, cfg("", {"w0", "w1", "w2"})).ok());
  auto want = Interpreter().run(*plain, inputs);
  REQUIRE(want.ok());
  const PassInfo info = remat_pass_info();
  auto recomputed_with = [&](std::vector<std::string> keep) {
    auto g = plain->clone();
    auto o = resolve_options(info.options, {{"policy", std::string("full")}, {"keep", keep}}, "pass 'remat'");
    REQUIRE(o.ok());
    auto changed = (*info.create(*o))->run(*g);
    REQUIRE_MESSAGE(changed.ok(), changed.status().message());
    REQUIRE_MESSAGE(verify(*g).ok(), verify(*g).message());
    std::set<std::string> names;
    int marked = 0;
    for (const auto& n : g->nodes()) {
      const std::string& name = n->num_results() > 0 ? n->result(0)->name() : "";
      if (name.ends_with(".remat")) names.insert(name);
      // The backward's own recomputations (tanh's derivative from its output) are marked too.
      else if (n->has_attr("_remat")) ++marked;
    }
    CHECK(marked > 0);
    auto got = Interpreter().run(*g, inputs);
    REQUIRE(got.ok());
    for (size_t i = 0; i < got->size(); ++i) CHECK((*got)[i].identical((*want)[i]));
    return names;
  };
  CHECK(recomputed_with({}) == std::set<std::string>{"t1.remat", "t2.remat", "u2.remat", "r2.remat"});
  // `keep` names the boundaries instead: without h0, block 1 recomputes from the input.
  CHECK(recomputed_with({"r1"}) == std::set<std::string>{"h0.remat", "t1.remat", "t2.remat", "u2.remat", "r2.remat"});
}

}  // namespace
}  // namespace kiln::training

namespace kiln::training {
namespace {

TEST_CASE("decompose-losses spells the loss ops in core ops with the same values") {
  const char* text = R"(graph @g(%l: f64[3, 2, 5], %t: i64[3, 2], %a: f64[4, 3], %b: f64[4, 3]) -> (f64[], f64[], f64[], f64[], f64[]) {
  %ce = cross_entropy(%l, %t) {ignore_index = 2} : f64[]
  %cs = cross_entropy(%l, %t) {reduction = "sum"} : f64[]
  %ms = mse_loss(%a, %b) : f64[]
  %d = reduce_sum(%a) {keepdims = 0} : f64[]
  %cg = cross_entropy_grad(%l, %t, %d) {ignore_index = 2} : f64[3, 2, 5]
  %cgs = reduce_sum(%cg) {keepdims = 0} : f64[]
  %cgw = mul(%cg, %l) : f64[3, 2, 5]
  %cgm = reduce_sum(%cgw) {keepdims = 0} : f64[]
  return %ce, %cs, %ms, %cgs, %cgm
})";
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> real(-2, 2);
  std::vector<Tensor> inputs;
  auto g = parse(text);
  for (int i = 0; i < g->num_inputs(); ++i) {
    Tensor t(g->input(i)->dtype(), static_sizes(g->input(i)->shape()));
    for (int64_t k = 0; k < t.numel(); ++k) {
      if (is_float(t.dtype())) t.set_f64(k, real(rng));
      else t.set_i64(k, k % 5);
    }
    inputs.push_back(t);
  }
  auto want = Interpreter().run(*g, inputs);
  REQUIRE(want.ok());
  auto changed = (*decompose_losses_pass_info().create({}))->run(*g);
  REQUIRE(changed.ok());
  REQUIRE(verify(*g).ok());
  for (const auto& n : g->nodes())
    CHECK((n->op_name() != "cross_entropy" && n->op_name() != "cross_entropy_grad" && n->op_name() != "mse_loss"));
  auto got = Interpreter().run(*g, inputs);
  REQUIRE(got.ok());
  for (size_t i = 0; i < got->size(); ++i) CHECK((*got)[i].get_f64(0) == doctest::Approx((*want)[i].get_f64(0)).epsilon(1e-12));
}

TEST_CASE("cross_entropy_grad's reference kernel: softmax - onehot times dloss, ignored rows and padded columns 0") {
  auto g = parse(R"(graph @g(%l: f32[3, 4], %t: i32[3], %d: f32[]) -> (f32[3, 4]) {
  %g = cross_entropy_grad(%l, %t, %d) {ignore_index = -1} : f32[3, 4]
  return %g
})");
  Tensor l(DType::kF32, {3, 4}), t(DType::kI32, {3}), d(DType::kF32, {});
  const double rows[3][4] = {{0.5, -1, 2, -1e30}, {1, 1, 1, -std::numeric_limits<double>::infinity()}, {3, 2, 1, 0}};
  for (int64_t i = 0; i < 12; ++i) l.set_f64(i, rows[i / 4][i % 4]);
  t.set_i64(0, 2);
  t.set_i64(1, 0);
  t.set_i64(2, -1);
  d.set_f64(0, 0.25);
  auto out = Interpreter().run(*g, std::vector<Tensor>{l, t, d});
  REQUIRE(out.ok());
  const Tensor& grad = (*out)[0];
  const double z0 = std::exp(0.5) + std::exp(-1.0) + std::exp(2.0);
  CHECK(grad.get_f64(0) == doctest::Approx(0.25 * std::exp(0.5) / z0));
  CHECK(grad.get_f64(2) == doctest::Approx(0.25 * (std::exp(2.0) / z0 - 1)));
  CHECK(grad.get_f64(3) == 0.0);  // a -1e30 padding column: exactly 0
  CHECK(grad.get_f64(4) == doctest::Approx(0.25 * (1.0 / 3 - 1)));
  CHECK(grad.get_f64(7) == 0.0);  // -inf
  for (int64_t c = 8; c < 12; ++c) CHECK(grad.get_f64(c) == 0.0);  // ignored row
}

TEST_CASE("cross_entropy_grad's shape rule: dloss must be a scalar, dtype a float") {
  CHECK(!parse_graph(R"(graph @g(%l: f32[3, 4], %t: i32[3], %d: f32[1]) -> (f32[3, 4]) {
  %g = cross_entropy_grad(%l, %t, %d) : f32[3, 4]
  return %g
})").ok());
  auto g = parse(R"(graph @g(%l: bf16[3, 4], %t: i32[3], %d: f32[]) -> (f32[], bf16[3, 4]) {
  %c = cross_entropy(%l, %t) {dtype = f32} : f32[]
  %g = cross_entropy_grad(%l, %t, %d) : bf16[3, 4]
  return %c, %g
})");
  CHECK(verify(*g).ok());
}

TEST_CASE("decompose-losses with ops = [mse_loss] keeps cross_entropy and reads the logits through autocast's cast") {
  // autocast's head: bf16 logits cast to f32 for the loss, the gradient cast back to bf16.
  const char* text = R"(graph @g(%l: bf16[4, 6], %t: i64[4], %d: f32[]) -> (f32[], bf16[4, 6]) {
  %up = cast(%l) {to = f32} : f32[4, 6]
  %ce = cross_entropy(%up, %t) {ignore_index = 3} : f32[]
  %cg = cross_entropy_grad(%up, %t, %d) {ignore_index = 3} : f32[4, 6]
  %down = cast(%cg) {to = bf16} : bf16[4, 6]
  return %ce, %down
})";
  auto g = parse(text);
  Tensor l(DType::kBF16, {4, 6}), t(DType::kI64, {4}), d(DType::kF32, {});
  for (int64_t i = 0; i < l.numel(); ++i) l.set_f64(i, std::sin(static_cast<double>(i)) * 3);
  for (int64_t i = 0; i < 4; ++i) t.set_i64(i, i + 1);
  d.set_f64(0, 0.5);
  auto want = Interpreter().run(*g, std::vector<Tensor>{l, t, d});
  REQUIRE(want.ok());
  const PassInfo info = decompose_losses_pass_info();
  auto with_ops = [&](std::vector<std::string> ops) {
    auto o = resolve_options(info.options, {{"ops", OptionValue(std::move(ops))}}, info.name);
    REQUIRE(o.ok());
    return info.create(*o);
  };
  auto pass = with_ops({"mse_loss"});
  REQUIRE(pass.ok());
  auto changed = (*pass)->run(*g);
  REQUIRE(changed.ok());
  CHECK(*changed);
  REQUIRE_MESSAGE(verify(*g).ok(), verify(*g).message());
  // The loss and its gradient (whose dloss is an input, not a function of the loss) are one op.
  int casts = 0, paired = 0, others = 0;
  for (const auto& n : g->nodes()) {
    casts += n->op_name() == "cast";
    others += n->op_name() == "cross_entropy" || n->op_name() == "cross_entropy_grad";
    if (n->op_name() == "cross_entropy_with_grad") {
      ++paired;
      CHECK(n->operand(0)->dtype() == DType::kBF16);
      CHECK(n->result(0)->dtype() == DType::kF32);
      CHECK(n->result(1)->dtype() == DType::kBF16);
    }
  }
  CHECK(casts == 0);
  CHECK(paired == 1);
  CHECK(others == 0);
  auto got = Interpreter().run(*g, std::vector<Tensor>{l, t, d});
  REQUIRE(got.ok());
  CHECK((*got)[0].dtype() == DType::kF32);
  CHECK((*got)[0].get_f64(0) == doctest::Approx((*want)[0].get_f64(0)).epsilon(1e-12));
  CHECK((*got)[1].dtype() == DType::kBF16);
  for (int64_t i = 0; i < 24; ++i) CHECK((*got)[1].get_f64(i) == (*want)[1].get_f64(i));
  CHECK(!with_ops({"softmax"}).ok());

  // A gradient scaled by the loss itself is not the step's: the two stay apart. The nodes dloss
  // needs that come after the loss (here a mul of two inputs) move before it when they pair.
  auto dependent = parse(R"(graph @g(%l: f32[4, 6], %t: i64[4], %d: f32[], %e: f32[]) -> (f32[], f32[4, 6], f32[], f32[4, 6]) {
  %ce = cross_entropy(%l, %t) : f32[]
  %s = mul(%ce, %d) : f32[]
  %cg = cross_entropy_grad(%l, %t, %s) : f32[4, 6]
  %ce2 = cross_entropy(%l, %t) {reduction = "sum", ignore_index = 1} : f32[]
  %late = mul(%d, %e) : f32[]
  %cg2 = cross_entropy_grad(%l, %t, %late) {ignore_index = 1} : f32[4, 6]
  return %ce, %cg, %ce2, %cg2
})");
  Tensor f(DType::kF32, {4, 6}), e(DType::kF32, {});
  for (int64_t i = 0; i < f.numel(); ++i) f.set_f64(i, std::cos(static_cast<double>(i)));
  e.set_f64(0, 3.0);
  const std::vector<Tensor> in2{f, t, d, e};
  auto want2 = Interpreter().run(*dependent, in2);
  REQUIRE(want2.ok());
  REQUIRE(*(*with_ops({"mse_loss"}))->run(*dependent));
  REQUIRE_MESSAGE(verify(*dependent).ok(), verify(*dependent).message());
  std::vector<std::string> ops;
  for (const auto& n : dependent->nodes())
    if (n->op_name().starts_with("cross_entropy")) ops.push_back(n->op_name());
  CHECK(ops == std::vector<std::string>{"cross_entropy", "cross_entropy_grad", "cross_entropy_with_grad"});
  auto got2 = Interpreter().run(*dependent, in2);
  REQUIRE(got2.ok());
  for (size_t i = 0; i < got2->size(); ++i) {
    const std::vector<double> a = (*want2)[i].to_f64(), c = (*got2)[i].to_f64();
    for (size_t k = 0; k < a.size(); ++k) CHECK(c[k] == doctest::Approx(a[k]).epsilon(1e-12));
  }
}

}  // namespace
}  // namespace kiln::training

namespace kiln::training {
namespace {

TEST_CASE("dynamic loss scaling: unscaled updates, inf skips the step and backs off, good steps grow the scale") {
  auto g = parse(R"(graph @g(%x: f32[2]) -> (%loss: f32[]) {
  %w = constant() {value = dense<f32[2]>[1.0, 2.0]} : f32[2]
  %y = mul(%x, %w) : f32[2]
  %loss = reduce_sum(%y) {keepdims = 0} : f32[]
  return %loss
})");
  AutodiffConfig c;
  c.init_loss_scale = 4;
  REQUIRE(differentiate(*g, c).ok());
  REQUIRE(run_optimizer(*g, {{"algorithm", std::string("sgd")}, {"lr", 0.5}, {"growth-interval", int64_t{2}}}).ok());
  REQUIRE_MESSAGE(verify(*g).ok(), verify(*g).message());
  CHECK(g->output_name(1) == "loss_scale");
  Interpreter interp;
  auto step = [&](double a, double b) {
    Tensor x = Tensor::from_f64(DType::kF32, {2}, std::vector<double>{a, b});
    auto out = interp.run(*g, {&x, 1});
    REQUIRE(out.ok());
    auto s = interp.state_of(*g);
    return std::make_tuple(s["w"].to_f64(), s[kLossScaleVariable].get_f64(0), s["optimizer.step"].get_f64(0),
                           (*out)[1].get_f64(0));
  };
  auto [w1, s1, t1, used1] = step(1, 1);  // grad of sum(x * w) is x: w -= 0.5 * x, unscaled
  CHECK(w1 == std::vector<double>{0.5, 1.5});
  CHECK(used1 == 4);
  CHECK(s1 == 4);
  auto [w2, s2, t2, used2] = step(2, 2);  // the second good step in a row: the scale doubles
  CHECK(w2 == std::vector<double>{-0.5, 0.5});
  CHECK(s2 == 8);
  CHECK(t2 == 2);
  auto [w3, s3, t3, used3] = step(std::numeric_limits<double>::infinity(), 1);  // skipped, halved
  CHECK(w3 == w2);
  CHECK(s3 == 4);
  CHECK(t3 == 2);
  CHECK(used3 == 8);
}

}  // namespace
}  // namespace kiln::training

namespace kiln::training {
namespace {

std::unique_ptr<Pass> chunk_pass(int64_t chunks, int64_t align = 64) {
  const PassInfo info = chunk_cross_entropy_pass_info();
  auto o = resolve_options(info.options, {{"chunks", chunks}, {"align", align}}, "pass 'chunk-cross-entropy'");
  REQUIRE(o.ok());
  auto pass = info.create(*o);
  REQUIRE(pass.ok());
  return std::move(*pass);
}

TEST_CASE("chunk-cross-entropy: the head in row chunks gives the loss and gradients of the whole one") {
  // Rows 2 x 3 = 6 in 4 chunks (2, 2, 1, 1); target 4 is ignored. The vocabulary of 5 is padded
  // to 8 (align 8: weight and bias padded once, the bias's padding masking each chunk's padded
  // logits), to 64 (the default), or left (align 0); with one chunk the head is only padded.
  const std::string head = R"(graph @g(%h: f64[2, 3, 4], %t: i64[2, 3], %w: f64[5, 4], %b: f64[5]) -> (%loss: f64[]) {
  %logits = linear(%h, %w, %b) : f64[2, 3, 5]
  %loss = cross_entropy(%logits, %t) {ignore_index = 4, reduction = "REDUCTION"} : f64[]
  return %loss
})";
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> real(-2, 2);
  for (const auto& [reduction, chunks, align] : std::vector<std::tuple<const char*, int64_t, int64_t>>{
           {"mean", 4, 8}, {"sum", 4, 8}, {"mean", 4, 0}, {"sum", 4, 64}, {"mean", 1, 8}}) {
    CAPTURE(reduction);
    CAPTURE(chunks);
    CAPTURE(align);
    std::string text = head;
    text.replace(text.find("REDUCTION"), 9, reduction);
    auto plain = parse(text);
    std::vector<Tensor> inputs;
    for (int i = 0; i < plain->num_inputs(); ++i) {
      Tensor t(plain->input(i)->dtype(), static_sizes(plain->input(i)->shape()));
      for (int64_t k = 0; k < t.numel(); ++k) {
        if (is_float(t.dtype())) t.set_f64(k, real(rng));
        else t.set_i64(k, (k * 3) % 5);
      }
      inputs.push_back(t);
    }
    auto chunked = plain->clone();
    auto changed = chunk_pass(chunks, align)->run(*chunked);
    REQUIRE_MESSAGE(changed.ok(), changed.status().message());
    CHECK(*changed);
    REQUIRE_MESSAGE(verify(*chunked).ok(), verify(*chunked).message());
    const int64_t padded = align == 0 ? 5 : align;
    int linears = 0, losses = 0, pads = 0, masked = 0;
    for (const auto& n : chunked->nodes()) {
      linears += n->op_name() == "linear";
      losses += n->op_name() == "cross_entropy";
      pads += n->op_name() == "pad";
      const Node* from = n->op_name() == "add" ? n->operand(0)->producer() : nullptr;
      masked += from != nullptr && from->op_name() == "linear";
      if (n->op_name() == "linear") {
        CHECK(n->result()->name().starts_with(chunks > 1 ? "logits.chunk" : "logits"));
        CHECK(n->result()->shape().back() == padded);
        CHECK(n->operand(1)->shape() == Shape{padded, 4});
      }
    }
    CHECK(linears == chunks);
    CHECK(losses == chunks);
    CHECK(pads == (padded == 5 ? 0 : 2));  // the weight and the bias, once
    // The linear head's padded bias is the mask: no chunk adds one.
    CHECK(masked == 0);
    for (const auto& n : chunked->nodes())
      if (n->op_name() == "pad" && n->result()->type().rank() == 1) CHECK(n->get_float("value") == -65504.0);
    CHECK(chunked->output_name(0) == "loss");
    for (Graph* g : {plain.get(), chunked.get()}) REQUIRE(differentiate(*g, cfg("", {"h", "w", "b"})).ok());
    // The chunks' weight-gradient GEMMs still accumulate into one sum, the padded weight's.
    auto acc = accumulate_gemm_pass_info().create(Options{});
    REQUIRE(acc.ok());
    REQUIRE((*acc)->run(*chunked).ok());
    int accumulated = 0;
    for (const auto& n : chunked->nodes())
      accumulated += n->op_name() == "matmul_acc" && n->result()->shape() == Shape{padded, 4};
    CHECK(accumulated == chunks - 1);
    auto want = Interpreter().run(*plain, inputs);
    auto got = Interpreter().run(*chunked, inputs);
    REQUIRE(want.ok());
    REQUIRE(got.ok());
    REQUIRE(got->size() == want->size());
    for (size_t i = 0; i < got->size(); ++i) {
      CAPTURE(i);
      const std::vector<double> a = (*want)[i].to_f64(), c = (*got)[i].to_f64();
      REQUIRE(a.size() == c.size());
      for (size_t k = 0; k < a.size(); ++k) CHECK(c[k] == doctest::Approx(a[k]).epsilon(1e-12));
    }
  }
}

TEST_CASE("chunk-cross-entropy: a bias-less linear head takes the padding mask as its bias, a matmul head adds it") {
  for (const char* op : {"linear", "matmul"}) {
    CAPTURE(op);
    const bool linear = std::string(op) == "linear";
    auto g = parse(linear ? R"(graph @g(%h: f32[6, 4], %t: i64[6], %w: f32[5, 4]) -> (%loss: f32[]) {
  %logits = linear(%h, %w) : f32[6, 5]
  %loss = cross_entropy(%logits, %t) : f32[]
  return %loss
})"
                          : R"(graph @g(%h: f32[6, 4], %t: i64[6], %w: f32[4, 5]) -> (%loss: f32[]) {
  %logits = matmul(%h, %w) : f32[6, 5]
  %loss = cross_entropy(%logits, %t) : f32[]
  return %loss
})");
    Tensor h(DType::kF32, {6, 4}), t(DType::kI64, {6}), w(DType::kF32, linear ? std::vector<int64_t>{5, 4} : std::vector<int64_t>{4, 5});
    for (int64_t k = 0; k < h.numel(); ++k) h.set_f64(k, std::cos(static_cast<double>(k)));
    for (int64_t k = 0; k < w.numel(); ++k) w.set_f64(k, std::sin(static_cast<double>(k)));
    for (int64_t k = 0; k < 6; ++k) t.set_i64(k, k % 5);
    const std::vector<Tensor> inputs{h, t, w};
    auto want = Interpreter().run(*g, inputs);
    REQUIRE(want.ok());
    REQUIRE(*chunk_pass(2, 8)->run(*g));
    REQUIRE_MESSAGE(verify(*g).ok(), verify(*g).message());
    int biased = 0, adds = 0;
    for (const auto& n : g->nodes()) {
      biased += n->op_name() == "linear" && n->num_operands() == 3;
      adds += n->op_name() == "add" && n->operand(0)->producer() && n->operand(0)->producer()->op_name() == op;
    }
    CHECK(biased == (linear ? 2 : 0));
    CHECK(adds == (linear ? 0 : 2));
    auto got = Interpreter().run(*g, inputs);
    REQUIRE(got.ok());
    CHECK((*got)[0].get_f64(0) == doctest::Approx((*want)[0].get_f64(0)).epsilon(1e-6));
  }
}

TEST_CASE("chunk-cross-entropy leaves heads it cannot chunk, and checks its option") {
  // The logits are also an output: they must exist whole.
  auto g = parse(R"(graph @g(%h: f32[4, 3], %t: i64[4], %w: f32[5, 3]) -> (%loss: f32[], %logits: f32[4, 5]) {
  %logits = linear(%h, %w) : f32[4, 5]
  %loss = cross_entropy(%logits, %t) : f32[]
  return %loss, %logits
})");
  auto changed = chunk_pass(2)->run(*g);
  REQUIRE(changed.ok());
  CHECK_FALSE(*changed);
  auto one = parse(R"(graph @g(%h: f32[4, 3], %t: i64[4], %w: f32[5, 3]) -> (%loss: f32[]) {
  %logits = linear(%h, %w) : f32[4, 5]
  %loss = cross_entropy(%logits, %t) : f32[]
  return %loss
})");
  changed = chunk_pass(1, 0)->run(*one);
  REQUIRE(changed.ok());
  CHECK_FALSE(*changed);
  changed = chunk_pass(1, 5)->run(*one);  // the vocabulary is aligned already
  REQUIRE(changed.ok());
  CHECK_FALSE(*changed);
  const PassInfo info = chunk_cross_entropy_pass_info();
  auto bad = resolve_options(info.options, {{"chunks", int64_t{0}}}, "pass 'chunk-cross-entropy'");
  REQUIRE(bad.ok());
  CHECK(info.create(*bad).status().message() == "chunk-cross-entropy: option 'chunks' must be in [1, 4096], got 0");
  bad = resolve_options(info.options, {{"align", int64_t{-1}}}, "pass 'chunk-cross-entropy'");
  REQUIRE(bad.ok());
  CHECK(info.create(*bad).status().message() == "chunk-cross-entropy: option 'align' must be in [0, 4096], got -1");
}

}  // namespace
}  // namespace kiln::training

namespace kiln::training {
namespace {

/// A tied weight: %w is the head of two row chunks and an embedding table, so its gradient is a
/// sum of two GEMM contributions and a scatter (what chunk-cross-entropy makes of a GPT's head).
const char* kTiedHead = R"(graph @g(%x1: f32[3, 4], %x2: f32[2, 4], %ids: i64[3]) -> (%loss: f32[]) {
  %w = constant() {value = dense<f32[5, 4]>[0.1, -0.2, 0.3, 0.4, 0.5, -0.6, 0.7, 0.05, -0.15, 0.25, 0.35, -0.45, 0.55, 0.65, -0.75, 0.2, 0.3, -0.1, 0.45, 0.6]} : f32[5, 4]
  %e = gather(%w, %ids) {axis = 0} : f32[3, 4]
  %x = add(%x1, %e) : f32[3, 4]
  %h1 = linear(%x, %w) : f32[3, 5]
  %h2 = linear(%x2, %w) : f32[2, 5]
  %s1 = mul(%h1, %h1) : f32[3, 5]
  %l1 = reduce_sum(%s1) {axes = [0, 1], keepdims = 0} : f32[]
  %t2 = tanh(%h2) : f32[2, 5]
  %l2 = reduce_sum(%t2) {axes = [0, 1], keepdims = 0} : f32[]
  %loss = add(%l1, %l2) : f32[]
  return %loss
})";

std::unique_ptr<Pass> make_pass(const PassInfo& info, std::map<std::string, OptionValue> options = {}) {
  auto o = resolve_options(info.options, options, "pass '" + info.name + "'");
  REQUIRE(o.ok());
  auto pass = info.create(*o);
  REQUIRE(pass.ok());
  return std::move(*pass);
}

/// The joint graph of kTiedHead (autocast to `autocast` first unless empty) with and without
/// accumulate-gemm, run on the same inputs: {plain, accumulated} outputs and the pass's graph.
std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::unique_ptr<Graph>> tied_head(const std::string& autocast) {
  auto plain = parse(kTiedHead);
  if (!autocast.empty()) REQUIRE(make_pass(autocast_pass_info(), {{"dtype", autocast}})->run(*plain).ok());
  REQUIRE(differentiate(*plain, {}).ok());
  auto acc = plain->clone();
  auto changed = make_pass(accumulate_gemm_pass_info())->run(*acc);
  REQUIRE_MESSAGE(changed.ok(), changed.status().message());
  CHECK(*changed);
  REQUIRE_MESSAGE(verify(*acc).ok(), verify(*acc).message());
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> real(-1, 1);
  std::vector<Tensor> inputs;
  for (int i = 0; i < plain->num_inputs(); ++i) {
    Tensor t(plain->input(i)->dtype(), static_sizes(plain->input(i)->shape()));
    for (int64_t k = 0; k < t.numel(); ++k) {
      if (is_float(t.dtype())) t.set_f64(k, real(rng));
      else t.set_i64(k, (k * 2 + 1) % 5);
    }
    inputs.push_back(t);
  }
  auto want = Interpreter().run(*plain, inputs);
  auto got = Interpreter().run(*acc, inputs);
  REQUIRE(want.ok());
  REQUIRE(got.ok());
  return {std::move(*want), std::move(*got), std::move(acc)};
}

TEST_CASE("accumulate-gemm: a tied weight's GEMM contributions accumulate into its f32 sum") {
  for (const char* autocast : {"", "bf16"}) {
    CAPTURE(autocast);
    auto [want, got, g] = tied_head(autocast);
    int acc = 0, casts_to_f32 = 0;
    for (const auto& n : g->nodes()) {
      if (n->op_name() != "matmul_acc") continue;
      ++acc;
      CHECK(n->result()->dtype() == DType::kF32);
      CHECK(n->operand(0)->dtype() == (*autocast ? DType::kBF16 : DType::kF32));
    }
    int gemms = 0;
    for (const auto& n : g->nodes())
      gemms += n->op_name() == "matmul" && n->result()->shape() == Shape{5, 4};
    // Two GEMM contributions and the embedding's scatter (no GEMM, an add): whichever starts
    // the sum, every other GEMM accumulates into it, and no [5, 4] product is cast to f32.
    CHECK(acc >= 1);
    CHECK(acc + gemms == 2);
    for (const auto& n : g->nodes())
      casts_to_f32 += n->op_name() == "cast" && n->result()->type() == TensorType{DType::kF32, {5, 4}};
    CHECK(casts_to_f32 == (*autocast && gemms ? 1 : 0));
    REQUIRE(got.size() == want.size());
    // f32 throughout: the same sums in another order. bf16: one rounding less than the plain
    // graph's bf16 product, within bf16's tolerance.
    const double tol = *autocast ? 1.6e-2 : 1e-5;
    for (size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      const std::vector<double> a = want[i].to_f64(), c = got[i].to_f64();
      REQUIRE(a.size() == c.size());
      for (size_t k = 0; k < a.size(); ++k) CHECK(std::abs(c[k] - a[k]) <= tol * (1e-3 + std::abs(a[k])) + 1e-5);
    }
  }
}

TEST_CASE("accumulate-gemm leaves a contribution read elsewhere and sums that are not a weight's") {
  // %p is read twice (its own output too): the GEMM must stay.
  auto g = parse(R"(graph @g(%a: f32[4, 3], %b: f32[3, 2], %c: f32[4, 2]) -> (f32[4, 2], f32[4, 2], f32[4, 2]) {
  %p = matmul(%a, %b) : f32[4, 2]
  %s = add(%c, %p) {_accumulate = 1} : f32[4, 2]
  %q = matmul(%a, %b) : f32[4, 2]
  %t = add(%c, %q) : f32[4, 2]
  return %s, %p, %t
})");
  auto changed = make_pass(accumulate_gemm_pass_info())->run(*g);
  REQUIRE(changed.ok());
  CHECK_FALSE(*changed);
}

}  // namespace
}  // namespace kiln::training
