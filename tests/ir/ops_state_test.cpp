// Tests of the persistent-state ops (variable, assign): schema, verifier, .kir round trip and
// the interpreter's state across runs.
#include <doctest/doctest.h>

#include <string>

#include "kiln/ir/text.h"
#include "op_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

/// A running sum: y = acc + x; acc takes y for the next run; n counts the runs.
constexpr const char* kAccumulator = R"(graph @acc(%x: f32[2]) -> (f32[2], i64[]) {
  %acc = variable() {init = dense<f32[2]>[10.0, 20.0], name = "acc"} : f32[2]
  %n = variable() {init = dense<i64[]>[0], name = "n"} : i64[]
  %one = constant() {value = dense<i64[]>[1]} : i64[]
  %n1 = add(%n, %one) : i64[]
  assign(%n1) {name = "n"}
  %y = add(%acc, %x) : f32[2]
  assign(%y) {name = "acc"}
  return %y, %n
}
)";

std::unique_ptr<Graph> parse_ok(const std::string& text) {
  auto g = parse_graph(text);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(g).value();
}

std::string parse_error(const std::string& text) {
  auto g = parse_graph(text, "s.kir");
  REQUIRE_FALSE(g.ok());
  return g.status().message();
}

}  // namespace

TEST_CASE("state: variable and assign are side-effecting core ops") {
  for (const char* name : {"variable", "assign"}) {
    const OpDef* def = OpRegistry::global().find(name);
    REQUIRE(def != nullptr);
    CHECK(def->has(kTraitSideEffects));
  }
  CHECK(OpRegistry::global().find("assign")->fixed_outputs() == 0);
  auto t = infer_op("variable", {}, {{"name", "v"}, {"init", Tensor(DType::kBF16, {3, 4})}});
  REQUIRE(t.ok());
  CHECK((*t)[0].str() == "bf16[3, 4]");
  CHECK(error_of(infer_op("variable", {}, {{"name", ""}, {"init", Tensor(DType::kF32, {1})}})) ==
        "variable: attribute 'name' must not be empty");
  CHECK(error_of(infer_op("variable", {}, {{"name", "v"}})) == "variable: missing required attribute 'init'");
  CHECK(error_of(infer_op("assign", {TensorType{DType::kF32, {}}}, {}, 0)) ==
        "assign: missing required attribute 'name'");
}

TEST_CASE("state: .kir round-trips variable and assign") {
  auto g = parse_ok(kAccumulator);
  CHECK(print_graph(*g) == kAccumulator);
}

TEST_CASE("state: the interpreter keeps variables across runs; reads see the value before the run") {
  auto g = parse_ok(kAccumulator);
  Interpreter interp;
  const Tensor x = f32({2}, {1, 2});
  for (int run = 0; run < 3; ++run) {
    auto out = interp.run(*g, {&x, 1});
    REQUIRE_MESSAGE(out.ok(), out.status().message());
    // acc starts at [10, 20] and gains x each run; n is read before its increment applies.
    check_values((*out)[0], {2}, {10.0 + (run + 1), 20.0 + 2 * (run + 1)});
    CHECK((*out)[1].get_i64(0) == run);
  }
  REQUIRE(interp.variable_value("acc") != nullptr);
  check_values(*interp.variable_value("acc"), {2}, {13, 26});

  // Another interpreter starts from the init values; reset_state forgets what was assigned.
  Interpreter fresh;
  check_values((*fresh.run(*g, {&x, 1}))[0], {2}, {11, 22});
  interp.reset_state();
  CHECK(interp.variable_value("acc") == nullptr);
  check_values((*interp.run(*g, {&x, 1}))[0], {2}, {11, 22});
}

TEST_CASE("state: a failed run changes no variable") {
  // The assign runs before the integer division by zero that fails the run.
  auto g = parse_ok(R"(graph @f(%d: i64[]) -> (i64[]) {
  %n = variable() {init = dense<i64[]>[5], name = "n"} : i64[]
  %one = constant() {value = dense<i64[]>[1]} : i64[]
  %n1 = add(%n, %one) : i64[]
  assign(%n1) {name = "n"}
  %q = div(%n, %d) : i64[]
  return %q
}
)");
  Interpreter interp;
  const Tensor one = ti(DType::kI64, {}, {1}), zero = ti(DType::kI64, {}, {0});
  CHECK((*interp.run(*g, {&one, 1}))[0].get_i64(0) == 5);
  CHECK_FALSE(interp.run(*g, {&zero, 1}).ok());
  CHECK(interp.variable_value("n")->get_i64(0) == 6);
  CHECK((*interp.run(*g, {&one, 1}))[0].get_i64(0) == 6);
}

TEST_CASE("state: the verifier checks names, types and placement") {
  const std::string head = "graph @s(%x: f32[2]) -> (f32[2]) {\n";
  const std::string var = "  %v = variable() {init = dense<f32[2]>[0, 0], name = \"v\"} : f32[2]\n";
  const std::string tail = "  return %x\n}\n";
  CHECK(parse_error(head + var + "  %w = variable() {init = dense<f32[]>[0], name = \"v\"} : f32[]\n" + tail) ==
        "s.kir:3:3: variable: name 'v' is used by another variable");
  CHECK(parse_error(head + var + "  assign(%x) {name = \"u\"}\n" + tail) == "s.kir:3:3: assign: no variable named 'u'");
  CHECK(parse_error(head + var + "  assign(%x) {name = \"v\"}\n  assign(%v) {name = \"v\"}\n" + tail) ==
        "s.kir:4:3: assign: variable 'v' is assigned more than once");
  CHECK(parse_error(head + var + "  %s = reduce_sum(%x) {keepdims = 0} : f32[]\n  assign(%s) {name = \"v\"}\n" +
                    tail) == "s.kir:4:3: assign: value is f32[] but variable 'v' is f32[2]");
  CHECK(parse_error(head + "  %y = fused(%x) : f32[2] {\n    graph @body(%a: f32[2]) -> (f32[2]) {\n" +
                    "      %c = variable() {init = dense<f32[2]>[0, 0], name = \"c\"} : f32[2]\n" +
                    "      return %c\n    }\n  }\n  return %y\n}\n") ==
        "s.kir:4:7: variable: 'c' must be in the top-level graph, not in region @body");
  // The same graph with one assign of the right type is fine.
  parse_ok(head + var + "  assign(%x) {name = \"v\"}\n" + tail);
}
