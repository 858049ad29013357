// Graph construction, use lists, mutation, cloning, verification and interpreter input checks.
#include <doctest/doctest.h>

#include "kiln/ir/graph.h"
#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"

using namespace kiln;

namespace {
TensorType f32(Shape s) { return TensorType{DType::kF32, std::move(s)}; }

Node* must(StatusOr<Node*> n) {
  REQUIRE_MESSAGE(n.ok(), n.status().message());
  return *n;
}
}  // namespace

TEST_CASE("use lists follow operand and output changes") {
  Graph g;
  Value* x = g.add_input("x", f32({2}));
  Value* y = g.add_input("y", f32({2}));
  Node* add = must(g.create_node("add", {x, y}, {f32({2})}));
  Node* relu = must(g.create_node("relu", {add->result()}, {f32({2})}));
  g.set_outputs({relu->result()});
  CHECK(x->uses().size() == 1);
  CHECK(add->result()->uses().size() == 1);
  CHECK(relu->result()->uses() == std::vector<Use>{Use{nullptr, 0}});

  add->result()->replace_all_uses_with(x);
  CHECK(relu->operand(0) == x);
  CHECK_FALSE(add->result()->has_uses());
  CHECK(g.erase_node(add).ok());
  CHECK(g.num_nodes() == 1);
  CHECK(y->uses().empty());
  CHECK(g.erase_input(1).ok());
  CHECK(verify(g).ok());
}

TEST_CASE("graph outputs keep their names when other values compute them") {
  Graph g;
  Value* x = g.add_input("x", f32({2}));
  Node* neg = must(g.create_node("neg", {x}, {f32({2})}, {}, nullptr, {"n"}));
  Node* relu = must(g.create_node("relu", {neg->result()}, {f32({2})}, {}, nullptr, {"r"}));
  g.set_outputs({relu->result(), neg->result()}, {"", "logits"});
  CHECK(g.output_name(0) == "r");  // unnamed: taken from the value
  CHECK(g.output_name(1) == "logits");

  relu->result()->replace_all_uses_with(x);  // output 0 now returns the input itself
  neg->result()->set_name("renamed");
  CHECK(g.output(0) == x);
  CHECK(g.output_name(0) == "r");
  CHECK(g.output_name(1) == "logits");
  g.set_output(1, x);
  CHECK(g.output_name(1) == "logits");

  auto copy = g.clone();
  CHECK(copy->output_names() == std::vector<std::string>{"r", "logits"});
  copy->set_output_name(0, "y");
  CHECK(copy->output_name(0) == "y");
  CHECK(g.output_name(0) == "r");
}

TEST_CASE("erasing a used node or input is refused") {
  Graph g;
  Value* x = g.add_input("x", f32({2}));
  Node* relu = must(g.create_node("relu", {x}, {f32({2})}));
  g.set_outputs({relu->result()});
  Status s = g.erase_node(relu);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message().find("still has uses") != std::string::npos);
  CHECK(g.erase_input(0).code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("create_node refuses unknown ops and values of other graphs") {
  Graph g, other;
  Value* x = g.add_input("x", f32({2}));
  Value* z = other.add_input("z", f32({2}));
  auto unknown = g.create_node("frobnicate", {x}, {f32({2})});
  CHECK(unknown.status().message() == "unknown op 'frobnicate'");
  auto foreign = g.create_node("relu", {z}, {f32({2})});
  CHECK(foreign.status().message().find("belongs to another graph") != std::string::npos);
}

TEST_CASE("verifier reports wrong result types at the node's location") {
  Graph g;
  Value* x = g.add_input("x", f32({2, 3}));
  Node* relu = must(g.create_node("relu", {x}, {f32({3, 2})}));
  relu->set_loc(Location{"m.kir", 4, 3});
  g.set_outputs({relu->result()});
  Status s = verify(g);
  CHECK(s.message() == "m.kir:4:3: relu: result 0 is declared f32[3, 2] but the op produces f32[2, 3]");
}

TEST_CASE("verifier checks operand order and counts") {
  Graph g;
  Value* x = g.add_input("x", f32({2}));
  Node* a = must(g.create_node("relu", {x}, {f32({2})}));
  Node* b = must(g.create_node("relu", {a->result()}, {f32({2})}));
  g.move_node_before(b, a);  // now b uses a's result before a runs
  g.set_outputs({b->result()});
  CHECK(verify(g).message().find("used before it is defined") != std::string::npos);

  Graph h;
  Value* hx = h.add_input("x", f32({2}));
  Node* bad = must(h.create_node("add", {hx}, {f32({2})}));
  h.set_outputs({bad->result()});
  CHECK(verify(h).message() == "add: expected 2 operands, got 1");
}

TEST_CASE("verifier checks attributes against the schema") {
  Graph g;
  Value* x = g.add_input("x", f32({2}));
  Node* n = must(g.create_node("relu", {x}, {f32({2})}, {{"axis", Attribute(int64_t{1})}}));
  g.set_outputs({n->result()});
  CHECK(verify(g).message() == "relu: unknown attribute 'axis'");
}

TEST_CASE("symbolic dims flow through and bind consistently at run time") {
  Graph g;
  Value* x = g.add_input("x", f32({Dim::symbol("B"), 2}));
  Value* y = g.add_input("y", f32({Dim::symbol("B"), 2}));
  Node* add = must(g.create_node("add", {x, y}, {f32({Dim::symbol("B"), 2})}));
  g.set_outputs({add->result()});
  REQUIRE(verify(g).ok());

  Interpreter interp;
  Tensor a = Tensor::from_f64(DType::kF32, {3, 2}, std::vector<double>{1, 2, 3, 4, 5, 6});
  Tensor b = Tensor::from_f64(DType::kF32, {3, 2}, std::vector<double>{1, 1, 1, 1, 1, 1});
  auto out = interp.run(g, std::vector<Tensor>{a, b});
  REQUIRE(out.ok());
  CHECK((*out)[0].shape() == std::vector<int64_t>{3, 2});
  CHECK((*out)[0].get_f64(5) == 7);

  Tensor c = Tensor::from_f64(DType::kF32, {2, 2}, std::vector<double>{1, 1, 1, 1});
  auto mismatch = interp.run(g, std::vector<Tensor>{a, c});
  CHECK(mismatch.status().message() == "input %y: dim B is 2 here but 3 in another input");
  auto wrong_dtype = interp.run(g, std::vector<Tensor>{a, Tensor(DType::kF16, {3, 2})});
  CHECK(wrong_dtype.status().message() == "input %y must be f32, got f16");
  auto wrong_count = interp.run(g, std::vector<Tensor>{a});
  CHECK(wrong_count.status().message() == "graph @main takes 2 inputs, got 1");
}

TEST_CASE("clone copies nodes, regions and names but not identity") {
  Graph g;
  Value* x = g.add_input("x", f32({2}));
  Node* f = must(g.create_node("fused", {x}, {f32({2})}));
  Graph& body = f->add_region("body");
  Value* p = body.add_input("p", f32({2}));
  Node* inner = must(body.create_node("relu", {p}, {f32({2})}));
  body.set_outputs({inner->result()});
  g.set_outputs({f->result()});
  REQUIRE(verify(g).ok());

  auto copy = g.clone();
  CHECK(verify(*copy).ok());
  CHECK(copy->total_node_count() == 2);
  CHECK(copy->input(0) != x);
  CHECK(copy->input(0)->name() == "x");
  const Node* cf = copy->nodes().front().get();
  CHECK(cf->region(0).parent_node() == cf);
  CHECK(cf->region(0).name() == "body");
}

TEST_CASE("every core op is complete") {
  const auto ops = OpRegistry::global().all();
  CHECK(ops.size() >= 70);
  for (const OpDef* op : ops) {
    CAPTURE(op->name);
    CHECK_FALSE(op->summary.empty());
    CHECK_FALSE(op->result_rule.empty());
    CHECK(op->library.empty());
    CHECK(static_cast<bool>(op->infer));
    CHECK(static_cast<bool>(op->reference));
  }
  for (const char* name :
       {"add", "sub", "mul", "div", "pow", "equal", "less", "where", "cast", "exp", "log", "sqrt",
        "rsqrt", "tanh", "erf", "sigmoid", "relu", "gelu", "silu", "neg", "abs", "reciprocal",
        "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod", "argmax",
        "softmax", "log_softmax", "matmul", "linear", "conv", "max_pool", "avg_pool",
        "layer_norm", "rms_norm", "reshape", "transpose", "slice", "concat", "split", "gather",
        "expand", "pad", "constant", "range", "fused"})
    CHECK_MESSAGE(OpRegistry::global().find(name) != nullptr, name);
}

TEST_CASE("an incomplete op definition is refused by name") {
  OpRegistry r;
  OpDef def;
  def.name = "half_done";
  def.summary = "missing its kernels";
  Status s = r.add(def);
  CHECK(s.message() == "op 'half_done' is incomplete; missing: result_rule infer reference");
}

TEST_CASE("ops added while a library is current are stamped with it") {
  OpRegistry r;
  auto def = [](const char* name) {
    return OpDef{.name = name,
                 .summary = "test op",
                 .inputs = {},
                 .outputs = {"y"},
                 .result_rule = "f32[]",
                 .attrs = {},
                 .infer = [](InferContext&) { return ok_status(); },
                 .reference = [](KernelContext&) { return ok_status(); }};
  };
  REQUIRE(r.add(def("before")).ok());
  r.set_current_library("/plugins/kiln-plugin-x.so");
  REQUIRE(r.add(def("during")).ok());
  r.set_current_library("");
  REQUIRE(r.add(def("after")).ok());
  CHECK(r.find("before")->library.empty());
  CHECK(r.find("during")->library == "/plugins/kiln-plugin-x.so");
  CHECK(r.find("after")->library.empty());
}
