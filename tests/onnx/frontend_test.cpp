// Tests for the onnx front end: import of small models, checked against hand-computed values.
#include <doctest/doctest.h>

#include <cmath>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"
#include "onnx_tensor.h"
#include "onnx_test_util.h"

using namespace kiln;
using namespace kiln::onnx_test;

namespace {

constexpr int kFloat = onnx::TensorProto::FLOAT;
constexpr int kInt64 = onnx::TensorProto::INT64;

Tensor f32(std::vector<int64_t> shape, std::vector<double> v) { return Tensor::from_f64(DType::kF32, shape, v); }

/// Imports `b` and runs it on `inputs`; returns output 0's values.
std::vector<double> run(ModelBuilder& b, std::vector<Tensor> inputs,
                        const std::map<std::string, OptionValue>& opts = {}) {
  TempDir dir;
  const std::string path = dir.file("model.onnx");
  b.write(path);
  auto g = import(path, opts);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  REQUIRE(verify(**g).ok());
  auto outs = Interpreter().run(**g, inputs);
  REQUIRE_MESSAGE(outs.ok(), outs.status().message());
  return (*outs)[0].to_f64();
}

std::string import_error(ModelBuilder& b, const std::map<std::string, OptionValue>& opts = {}) {
  TempDir dir;
  const std::string path = dir.file("model.onnx");
  b.write(path);
  auto g = import(path, opts);
  return g.ok() ? "(imported)" : g.status().message();
}

}  // namespace

TEST_CASE("the front end registers as 'onnx' for .onnx files") {
  auto fe = registry().frontend_for_path("model.onnx");
  REQUIRE(fe.ok());
  CHECK((*fe)->name == "onnx");
}

TEST_CASE("elementwise ops and initializers") {
  ModelBuilder b;
  b.input("x", kFloat, {int64_t{4}}).output("y", kFloat, {int64_t{4}});
  b.initializer("w", {4}, {1, -2, 3, -4});
  b.node("Mul", {"x", "w"}, {"m"});
  b.node("Relu", {"m"}, {"y"});
  CHECK(run(b, {f32({4}, {1, 1, 2, 2})}) == std::vector<double>{1, 0, 6, 0});
}

TEST_CASE("dim_param becomes a symbolic dim") {
  TempDir dir;
  ModelBuilder b;
  b.input("x", kFloat, {std::string("batch"), int64_t{3}}).output("y", kFloat);
  b.node("Relu", {"x"}, {"y"});
  b.write(dir.file("m.onnx"));
  auto g = import(dir.file("m.onnx"));
  REQUIRE(g.ok());
  CHECK((*g)->input(0)->type().str() == "f32[batch, 3]");
  CHECK((*g)->output(0)->type().str() == "f32[batch, 3]");
}

TEST_CASE("Gemm with transB, alpha and beta") {
  // y = 2 * a @ b^T + 0.5 * c, a = [[1, 2]], b = [[1, 0], [0, 1], [1, 1]], c = [2, 2, 2]
  ModelBuilder b;
  b.input("a", kFloat, {int64_t{1}, int64_t{2}}).output("y", kFloat);
  b.initializer("b", {3, 2}, {1, 0, 0, 1, 1, 1});
  b.initializer("c", {3}, {2, 2, 2});
  auto& n = b.node("Gemm", {"a", "b", "c"}, {"y"});
  add_int_attr(n, "transB", 1);
  add_float_attr(n, "alpha", 2);
  add_float_attr(n, "beta", 0.5);
  CHECK(run(b, {f32({1, 2}, {1, 2})}) == std::vector<double>{3, 5, 7});
}

TEST_CASE("Gemm with a bias names its product after the output, for per-layer reports") {
  TempDir dir;
  ModelBuilder b;
  b.input("a", kFloat, {int64_t{1}, int64_t{2}}).output("y", kFloat);
  b.initializer("b", {2, 3}, {1, 0, 1, 0, 1, 1});
  b.initializer("c", {3}, {2, 2, 2});
  b.node("Gemm", {"a", "b", "c"}, {"y"});
  b.write(dir.file("m.onnx"));
  auto g = import(dir.file("m.onnx"));
  REQUIRE(g.ok());
  const Node* product = nullptr;
  for (const auto& n : (*g)->nodes())
    if (n->op_name() == "matmul") product = n.get();
  REQUIRE(product != nullptr);
  CHECK(product->result()->name() == "y.product");
  CHECK((*g)->output(0)->name() == "y");
}

TEST_CASE("Softmax means different things before and after opset 13") {
  // x [1, 2, 2] = [[[0, ln 3], [0, ln 3]]]
  const double l3 = std::log(3.0);
  auto model = [](int64_t opset) {
    ModelBuilder b(opset);
    b.input("x", kFloat, {int64_t{1}, int64_t{2}, int64_t{2}}).output("y", kFloat);
    b.node("Softmax", {"x"}, {"y"});
    return b;
  };
  ModelBuilder old = model(11), now = model(13);
  // Opset 13: along the last axis, each row is [1/4, 3/4].
  const std::vector<double> a = run(now, {f32({1, 2, 2}, {0, l3, 0, l3})});
  CHECK(a[0] == doctest::Approx(0.25));
  CHECK(a[1] == doctest::Approx(0.75));
  // Opset 11: axis 1 flattens [2, 2] into one row of 4: weights 1, 3, 1, 3 over 8.
  const std::vector<double> b = run(old, {f32({1, 2, 2}, {0, l3, 0, l3})});
  CHECK(b[0] == doctest::Approx(0.125));
  CHECK(b[1] == doctest::Approx(0.375));
}

TEST_CASE("ReduceSum takes axes from an attribute before opset 13, from an input after") {
  ModelBuilder old(11);
  old.input("x", kFloat, {int64_t{2}, int64_t{2}}).output("y", kFloat);
  auto& n = old.node("ReduceSum", {"x"}, {"y"});
  add_ints_attr(n, "axes", {1});
  add_int_attr(n, "keepdims", 0);
  CHECK(run(old, {f32({2, 2}, {1, 2, 3, 4})}) == std::vector<double>{3, 7});
  ModelBuilder now(13);
  now.input("x", kFloat, {int64_t{2}, int64_t{2}}).output("y", kFloat);
  now.int_initializer("axes", {1}, {0});
  add_int_attr(now.node("ReduceSum", {"x", "axes"}, {"y"}), "keepdims", 0);
  CHECK(run(now, {f32({2, 2}, {1, 2, 3, 4})}) == std::vector<double>{4, 6});
}

TEST_CASE("shape computations fold at import") {
  // y = Reshape(x, Concat(Shape(x)[1:], [-1])): [2, 3] -> [3, 2]
  ModelBuilder b;
  b.input("x", kFloat, {int64_t{2}, int64_t{3}}).output("y", kFloat);
  b.int_initializer("one", {1}, {1});
  b.int_initializer("two", {1}, {2});
  b.int_initializer("m1", {1}, {-1});
  b.node("Shape", {"x"}, {"s"});
  b.node("Slice", {"s", "one", "two"}, {"d"});
  add_int_attr(b.node("Concat", {"d", "m1"}, {"shape"}), "axis", 0);
  b.node("Reshape", {"x", "shape"}, {"y"});
  TempDir dir;
  b.write(dir.file("m.onnx"));
  auto g = import(dir.file("m.onnx"));
  REQUIRE(g.ok());
  CHECK((*g)->output(0)->type().str() == "f32[3, 2]");
  int non_constant = 0;
  for (const auto& n : (*g)->nodes()) non_constant += n->op_name() != "constant";
  CHECK(non_constant == 1);  // the reshape; Shape, Slice and Concat became a constant
}

TEST_CASE("an operand that must be constant but is not names the node and the input") {
  ModelBuilder b;
  b.input("x", kFloat, {int64_t{6}}).input("shape", kInt64, {int64_t{2}}).output("y", kFloat);
  b.node("Reshape", {"x", "shape"}, {"y"}, "r1");
  CHECK(import_error(b) == "onnx node 'r1' (op Reshape, domain ai.onnx, opset 17): input 1 ('shape', value 'shape') "
                           "must be a constant at import, but it is computed at run time");
}

TEST_CASE("input-values freezes only the inputs that decide shapes") {
  TempDir dir;
  const std::string shape_file = dir.file("shape.pb");
  onnx::TensorProto t;
  t.set_data_type(kInt64);
  t.add_dims(2);
  t.add_int64_data(3);
  t.add_int64_data(2);
  write_bytes(shape_file, t.SerializeAsString());
  ModelBuilder b;
  b.input("x", kFloat, {int64_t{6}}).input("shape", kInt64, {int64_t{2}}).output("y", kFloat);
  b.node("Reshape", {"x", "shape"}, {"y"}, "r1");
  b.write(dir.file("m.onnx"));
  auto g = import(dir.file("m.onnx"), {{"input-values", std::vector<std::string>{"shape=" + shape_file}}});
  REQUIRE(g.ok());
  REQUIRE((*g)->num_inputs() == 1);
  CHECK((*g)->input(0)->name() == "x");
  CHECK((*g)->output(0)->type().str() == "f32[3, 2]");
}

TEST_CASE("If with a constant condition inlines the chosen branch") {
  ModelBuilder b(13);
  b.input("x", kFloat, {int64_t{2}}).output("y", kFloat);
  auto* c = b.graph().add_initializer();
  c->set_name("cond");
  c->set_data_type(onnx::TensorProto::BOOL);
  c->add_int32_data(0);
  auto& n = b.node("If", {"cond"}, {"y"});
  for (const char* branch : {"then_branch", "else_branch"}) {
    auto* a = n.add_attribute();
    a->set_name(branch);
    a->set_type(onnx::AttributeProto::GRAPH);
    auto* g = a->mutable_g();
    auto* body = g->add_node();
    body->set_op_type(std::string(branch) == "then_branch" ? "Neg" : "Abs");
    body->add_input("x");  // an outer value, visible inside the branch
    body->add_output("r");
    g->add_output()->set_name("r");
  }
  CHECK(run(b, {f32({2}, {-1, 2})}) == std::vector<double>{1, 2});
}

TEST_CASE("Loop with a constant trip count unrolls") {
  // acc = x; 3 times: acc = acc + acc  ->  8 * x
  ModelBuilder b(13);
  b.input("x", kFloat, {int64_t{2}}).output("y", kFloat);
  b.int_initializer("n", {}, {3});
  auto& n = b.node("Loop", {"n", "", "x"}, {"y"});
  auto* a = n.add_attribute();
  a->set_name("body");
  a->set_type(onnx::AttributeProto::GRAPH);
  auto* g = a->mutable_g();
  for (const char* in : {"i", "c", "acc"}) g->add_input()->set_name(in);
  auto* keep = g->add_node();
  keep->set_op_type("Identity");
  keep->add_input("c");
  keep->add_output("c_out");
  auto* add = g->add_node();
  add->set_op_type("Add");
  add->add_input("acc");
  add->add_input("acc");
  add->add_output("acc_out");
  g->add_output()->set_name("c_out");
  g->add_output()->set_name("acc_out");
  CHECK(run(b, {f32({2}, {1, -2})}) == std::vector<double>{8, -16});
}

TEST_CASE("unsigned types Kiln lacks are widened") {
  ModelBuilder b;
  b.input("x", onnx::TensorProto::UINT32, {int64_t{2}}).output("y", onnx::TensorProto::UINT32);
  b.node("Add", {"x", "x"}, {"y"});
  TempDir dir;
  b.write(dir.file("m.onnx"));
  auto g = import(dir.file("m.onnx"));
  REQUIRE(g.ok());
  CHECK((*g)->input(0)->type().str() == "i64[2]");
  auto outs = Interpreter().run(**g, std::vector<Tensor>{Tensor::from_i64(DType::kI64, {2}, std::vector<int64_t>{4000000000, 1})});
  REQUIRE(outs.ok());
  CHECK((*outs)[0].to_i64() == std::vector<int64_t>{8000000000, 2});
}

TEST_CASE("tensor protos: typed fields, raw data and widened types") {
  onnx::TensorProto t;
  t.set_data_type(onnx::TensorProto::UINT16);
  t.add_dims(2);
  const uint16_t raw[2] = {65535, 7};
  t.set_raw_data(std::string(reinterpret_cast<const char*>(raw), sizeof raw));
  auto w = onnx_fe::tensor_from_proto(t, onnx_fe::TensorSource{}, "t");
  REQUIRE(w.ok());
  CHECK(w->dtype() == DType::kI32);
  CHECK(w->to_i64() == std::vector<int64_t>{65535, 7});
  onnx::TensorProto s;
  s.set_data_type(onnx::TensorProto::STRING);
  CHECK(onnx_fe::tensor_from_proto(s, onnx_fe::TensorSource{}, "t").status().message() ==
        "t has element type STRING, which kiln does not support");
  onnx::TensorProto u;
  u.set_data_type(onnx::TensorProto::UINT64);
  u.add_dims(1);
  u.add_uint64_data(uint64_t{1} << 63);
  CHECK(onnx_fe::tensor_from_proto(u, onnx_fe::TensorSource{}, "t").status().message() ==
        "t: uint64 value 9223372036854775808 does not fit kiln's i64");
}

TEST_CASE("kiln import writes .kir that parses back; kiln run reads .onnx by extension") {
  TempDir dir;
  ModelBuilder b;
  b.input("x", kFloat, {int64_t{2}}).output("y", kFloat);
  b.initializer("w", {2}, {10, 20});
  b.node("Add", {"x", "w"}, {"y"});
  const std::string model = dir.file("m.onnx"), kir = dir.file("m.kir");
  b.write(model);
  const std::string kiln = std::string(KILN_BINARY_DIR) + "/bin/kiln";
  REQUIRE(std::system((kiln + " import '" + model + "' -o '" + kir + "'").c_str()) == 0);
  auto g = parse_graph_file(kir);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto outs = Interpreter().run(**g, std::vector<Tensor>{f32({2}, {1, 2})});
  REQUIRE(outs.ok());
  CHECK((*outs)[0].to_f64() == std::vector<double>{11, 22});
  const std::string out = dir.file("run.txt");
  REQUIRE(std::system((kiln + " run '" + model + "' --random-inputs > '" + out + "' 2>&1").c_str()) == 0);
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text.find("pipeline: onnx | | reference") != std::string::npos);
  CHECK(text.find("y: f32[2]") != std::string::npos);
}

TEST_CASE("dims gives symbolic input dims static sizes, so Shape folds") {
  ModelBuilder b;
  b.input("x", kFloat, {std::string("batch"), int64_t{3}}).output("s", kInt64);
  b.node("Shape", {"x"}, {"s"}, "shape1");
  CHECK(import_error(b) == "onnx node 'shape1' (op Shape, domain ai.onnx, opset 17): shape of f32[batch, 3] has "
                           "symbolic dim batch; kiln folds Shape at import and needs static dims (the front end "
                           "option dims=batch=SIZE gives one)");
  TempDir dir;
  b.write(dir.file("m.onnx"));
  auto g = import(dir.file("m.onnx"), {{"dims", std::vector<std::string>{"batch=2"}}});
  REQUIRE(g.ok());
  CHECK((*g)->input(0)->type().str() == "f32[2, 3]");
  const Tensor* s = nullptr;
  for (const auto& n : (*g)->nodes())
    if (n->result(0) == (*g)->output(0)) s = &n->attr("value")->as_tensor();
  REQUIRE(s != nullptr);
  CHECK(s->to_i64() == std::vector<int64_t>{2, 3});
  CHECK(import_error(b, {{"dims", std::vector<std::string>{"batch"}}}) ==
        "onnx: dims entry 'batch' is not NAME=SIZE with a size >= 0");
}

TEST_CASE("opset 18-20 forms: ReduceMean axes input, Split num_outputs, LayerNormalization, Gelu") {
  ModelBuilder r(18);
  r.input("x", kFloat, {int64_t{2}, int64_t{2}}).output("y", kFloat);
  r.int_initializer("axes", {1}, {1});
  add_int_attr(r.node("ReduceMean", {"x", "axes"}, {"y"}), "keepdims", 0);
  CHECK(run(r, {f32({2, 2}, {1, 3, 5, 9})}) == std::vector<double>{2, 7});

  // 5 elements in 2 parts: ceil(5 / 2) = 3, then 2.
  ModelBuilder s(18);
  s.input("x", kFloat, {int64_t{5}}).output("a", kFloat).output("b", kFloat);
  add_int_attr(s.node("Split", {"x"}, {"a", "b"}), "num_outputs", 2);
  TempDir dir;
  s.write(dir.file("s.onnx"));
  auto g = import(dir.file("s.onnx"));
  REQUIRE(g.ok());
  CHECK((*g)->output(0)->type().str() == "f32[3]");
  CHECK((*g)->output(1)->type().str() == "f32[2]");

  // [1, 3] normalized: mean 2, variance 1 -> [-1, 1] (epsilon 0), then * 2 + 1.
  ModelBuilder ln(17);
  ln.input("x", kFloat, {int64_t{1}, int64_t{2}}).output("y", kFloat);
  ln.initializer("scale", {2}, {2, 2});
  ln.initializer("bias", {2}, {1, 1});
  add_float_attr(ln.node("LayerNormalization", {"x", "scale", "bias"}, {"y"}), "epsilon", 0);
  CHECK(run(ln, {f32({1, 2}, {1, 3})}) == std::vector<double>{-1, 3});

  // gelu(0) = 0, gelu(x) -> x for large x.
  ModelBuilder ge(20);
  ge.input("x", kFloat, {int64_t{2}}).output("y", kFloat);
  ge.node("Gelu", {"x"}, {"y"});
  const std::vector<double> y = run(ge, {f32({2}, {0, 10})});
  CHECK(y[0] == 0);
  CHECK(y[1] == doctest::Approx(10));
  ModelBuilder old(17);
  old.input("x", kFloat, {int64_t{2}}).output("y", kFloat);
  old.node("Gelu", {"x"}, {"y"}, "g");
  CHECK(import_error(old) == "onnx node 'g' (op Gelu, domain ai.onnx, opset 17): op does not exist at this opset");
}
