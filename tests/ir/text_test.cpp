// The .kir printer and parser: byte-identical round trips, side files, names, diagnostics.
#include <doctest/doctest.h>

#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "kiln/ir/graph.h"
#include "kiln/ir/op.h"
#include "kiln/ir/spelling.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

/// An op taking one attribute of every kind (no core op has float or string lists).
void register_attr_test_op() {
  if (OpRegistry::global().find("text_test_attrs")) return;
  auto spec = [](const char* name, AttrKind kind) {
    AttrSpec a;
    a.name = name;
    a.kind = kind;
    return a;
  };
  Status s = OpRegistry::global().add(OpDef{
      .name = "text_test_attrs",
      .summary = "identity with one attribute of every kind (text tests)",
      .inputs = {"x"},
      .outputs = {"y"},
      .attrs = {spec("i", AttrKind::kInt), spec("f", AttrKind::kFloat),
                spec("s", AttrKind::kString), spec("is", AttrKind::kInts),
                spec("fs", AttrKind::kFloats), spec("ss", AttrKind::kStrings),
                spec("t", AttrKind::kTensor), spec("d", AttrKind::kDType)},
      .infer = [](InferContext& ctx) {
        ctx.results = {ctx.operand(0)};
        return ok_status();
      },
      .reference = [](KernelContext& ctx) {
        ctx.output() = ctx.input(0);
        return ok_status();
      },
  });
  REQUIRE_MESSAGE(s.ok(), s.message());
  s = OpRegistry::global().add(OpDef{
      .name = "text_test_sink",
      .summary = "consumes x and produces nothing (text tests of result-less nodes)",
      .inputs = {"x"},
      .outputs = {},
      .attrs = {spec("graph", AttrKind::kInt)},
      .infer = [](InferContext& ctx) { return ok_status(); },
      .reference = [](KernelContext& ctx) { return ok_status(); },
  });
  REQUIRE_MESSAGE(s.ok(), s.message());
}

std::unique_ptr<Graph> parse_ok(const std::string& text, const std::string& file = "t.kir") {
  auto g = parse_graph(text, file);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(g).value();
}

/// The parse error message for `text` ("<ok>" when it parses).
std::string parse_error(const std::string& text, const std::string& file = "t.kir") {
  auto g = parse_graph(text, file);
  return g.ok() ? "<ok>" : g.status().message();
}

/// Parses canonical text and checks that printing gives the same bytes back.
std::unique_ptr<Graph> check_round_trip(const std::string& text) {
  auto g = parse_ok(text);
  const std::string printed = print_graph(*g);
  CHECK(printed == text);
  CHECK(print_graph(*parse_ok(printed)) == printed);
  return g;
}

const Tensor& constant_of(const Graph& g, int node_index) {
  return g.node_list()[static_cast<size_t>(node_index)]->attr("value")->as_tensor();
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const fs::path& p, const std::string& data) {
  std::ofstream out(p, std::ios::binary);
  out << data;
}

/// A fresh temporary folder, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kiln_text_XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

const char* const kMlp = R"(graph @mlp(%x: f32[B, 784], %w1: f32[256, 784], %b1: f32[256]) -> (f32[B, 128], f32[2]) {
  %c = constant() {value = dense<f32[2]>[1.0, 2.5]} : f32[2]
  %h = linear(%x, %w1, %b1) : f32[B, 256]
  %a = relu(%h) : f32[B, 256]
  %p, %q = split(%a) {axis = 1, sizes = [128, 128]} : f32[B, 128], f32[B, 128]
  %f = fused(%p, %q) : f32[B, 128] {
    graph @body(%u: f32[B, 128], %v: f32[B, 128]) -> (f32[B, 128]) {
      %s = add(%u, %v) : f32[B, 128]
      return %s
    }
  }
  return %f, %c
}
)";

}  // namespace

TEST_CASE("kir text: the documented example round-trips byte for byte") {
  auto g = check_round_trip(kMlp);
  CHECK(g->name() == "mlp");
  REQUIRE(g->num_inputs() == 3);
  CHECK(g->input(0)->name() == "x");
  CHECK(g->input(0)->type().shape == Shape{Dim::symbol("B"), 784});
  REQUIRE(g->num_nodes() == 5);
  const Node* split = g->node_list()[3];
  CHECK(split->num_results() == 2);
  CHECK(split->result(1)->name() == "q");
  CHECK(split->attr("sizes")->as_ints() == std::vector<int64_t>{128, 128});
  const Node* fused = g->node_list()[4];
  REQUIRE(fused->num_regions() == 1);
  CHECK(fused->region(0).name() == "body");
  CHECK(fused->region(0).parent_node() == fused);
  CHECK(fused->loc().str() == "t.kir:6:3");
  CHECK(fused->region(0).node_list()[0]->loc().str() == "t.kir:8:7");
  CHECK(constant_of(*g, 0).to_f64() == std::vector<double>{1.0, 2.5});
}

TEST_CASE("kir text: layout, comments and whitespace are free; printing canonicalizes") {
  auto g = parse_ok(
      "// leading comment\n"
      "graph @g(%x:f32[2]) -> (f32[2]) { %y=relu(%x):f32[2] // trailing\n"
      "return %y }");
  CHECK(print_graph(*g) ==
        "graph @g(%x: f32[2]) -> (f32[2]) {\n"
        "  %y = relu(%x) : f32[2]\n"
        "  return %y\n"
        "}\n");
}

TEST_CASE("kir text: every attribute kind round-trips and is normalized to the schema") {
  register_attr_test_op();
  auto g = check_round_trip(
      "graph @attrs(%x: f32[2]) -> (f32[2]) {\n"
      "  %y = text_test_attrs(%x) {d = bf16, f = 1e-05, fs = [1.0, -2.5, inf, -inf, nan], i = -1, "
      "is = [1, -9223372036854775808, 9223372036854775807], s = \"a \\\"q\\\" \\\\ \\n\\t\\x01 \xc3\xa9\", "
      "ss = [\"a\", \"\"], t = dense<i32[2, 2]>[1, 2, 3, 4]} : f32[2]\n"
      "  %z = text_test_attrs(%y) {f = 3.0, fs = [], is = [], ss = []} : f32[2]\n"
      "  %w = text_test_attrs(%z) {f = 2.0, fs = [1.0, 2.0]} : f32[2]\n"
      "  return %w\n"
      "}\n");
  const Node* n = g->node_list()[0];
  CHECK(n->attr("d")->as_dtype() == DType::kBF16);
  CHECK(n->attr("f")->as_float() == 1e-05);
  const std::vector<double> fs = n->attr("fs")->as_floats();
  CHECK(fs[1] == -2.5);
  CHECK(fs[3] == -std::numeric_limits<double>::infinity());
  CHECK(std::isnan(fs[4]));
  CHECK(n->attr("i")->as_int() == -1);
  CHECK(n->attr("is")->as_ints()[1] == std::numeric_limits<int64_t>::min());
  CHECK(n->attr("s")->as_string() == "a \"q\" \\ \n\t\x01 \xc3\xa9");
  CHECK(n->attr("ss")->as_strings() == std::vector<std::string>{"a", ""});
  CHECK(n->attr("t")->as_tensor().to_i64() == std::vector<int64_t>{1, 2, 3, 4});
  // Empty lists take the declared list kind; ints are read as floats where floats are declared.
  const Node* z = g->node_list()[1];
  CHECK(z->attr("fs")->kind() == AttrKind::kFloats);
  CHECK(z->attr("ss")->kind() == AttrKind::kStrings);
  auto ints = parse_ok(
      "graph @g(%x: f32[2]) -> (f32[2]) {\n"
      "  %y = text_test_attrs(%x) {f = 3, fs = [1, 2], i = true} : f32[2]\n"
      "  return %y\n"
      "}\n");
  const Node* y = ints->node_list()[0];
  CHECK(y->attr("f")->kind() == AttrKind::kFloat);
  CHECK(y->attr("f")->as_float() == 3.0);
  CHECK(y->attr("fs")->kind() == AttrKind::kFloats);
  CHECK(y->attr("i")->as_int() == 1);
  CHECK(print_graph(*ints).find("{f = 3.0, fs = [1.0, 2.0], i = 1}") != std::string::npos);
}

TEST_CASE("kir text: floats print in shortest round-trip form and always look like floats") {
  register_attr_test_op();
  Graph g("g");
  Value* x = g.add_input("x", TensorType{DType::kF32, {1}});
  Value* v = x;
  const double values[] = {1.0, 0.1, -0.0, 1e21, 5e-324, 123456789.0, 1.0 / 3.0};
  for (double d : values) {
    auto n = g.create_node("text_test_attrs", {v}, {v->type()}, {{"f", d}});
    REQUIRE(n.ok());
    v = (*n)->result();
  }
  g.set_outputs({v});
  const std::string text = print_graph(g);
  for (const char* s : {"{f = 1.0}", "{f = 0.1}", "{f = -0.0}", "{f = 1e+21}", "{f = 5e-324}",
                        "{f = 123456789.0}", "{f = 0.3333333333333333}"})
    CHECK_MESSAGE(text.find(s) != std::string::npos, s);
  auto back = parse_ok(text);
  int i = 0;
  for (const Node* n : back->node_list()) {
    const double d = n->attr("f")->as_float();
    CHECK(std::memcmp(&d, &values[i++], sizeof d) == 0);
  }
}

TEST_CASE("kir text: every dtype in types and inline tensors, bit-exact") {
  const std::string text =
      "graph @dtypes(%a: f64[], %b: f32[1], %c: f16[1, 2], %d: bf16[?], %e: f8e4m3fn[N], "
      "%f: f8e5m2[N], %g: i64[0], %h: i32[1], %i: i16[1], %j: i8[1], %k: u8[1], %l: i4[3], "
      "%m: bool[2]) -> (f64[]) {\n"
      "  %0 = constant() {value = dense<f64[]>[0.1]} : f64[]\n"
      "  %1 = constant() {value = dense<f32[6]>[0.10000000149011612, -0.0, inf, -inf, nan, 1.401298464324817e-45]} : f32[6]\n"
      "  %2 = constant() {value = dense<f16[1, 2]>[65504.0, 5.960464477539063e-08]} : f16[1, 2]\n"
      "  %3 = constant() {value = dense<bf16[2]>[0.10009765625, -3.3895313892515355e+38]} : bf16[2]\n"
      "  %4 = constant() {value = dense<f8e4m3fn[2]>[448.0, -0.001953125]} : f8e4m3fn[2]\n"
      "  %5 = constant() {value = dense<f8e5m2[2]>[57344.0, -inf]} : f8e5m2[2]\n"
      "  %6 = constant() {value = dense<i64[2]>[-9223372036854775808, 9223372036854775807]} : i64[2]\n"
      "  %7 = constant() {value = dense<i32[2]>[-2147483648, 2147483647]} : i32[2]\n"
      "  %8 = constant() {value = dense<i16[2]>[-32768, 32767]} : i16[2]\n"
      "  %9 = constant() {value = dense<i8[2]>[-128, 127]} : i8[2]\n"
      "  %10 = constant() {value = dense<u8[2]>[0, 255]} : u8[2]\n"
      "  %11 = constant() {value = dense<i4[3]>[-8, 7, -1]} : i4[3]\n"
      "  %12 = constant() {value = dense<bool[2]>[true, false]} : bool[2]\n"
      "  %13 = constant() {value = dense<f32[0, 3]>[]} : f32[0, 3]\n"
      "  %14 = constant() {value = dense<f16[2]>[-nan, nan]} : f16[2]\n"
      "  %15 = constant() {value = dense<f8e4m3fn[2]>[-nan, 1.0]} : f8e4m3fn[2]\n"
      "  return %0\n"
      "}\n";
  auto g = check_round_trip(text);
  for (int i = 0; i < g->num_inputs(); ++i)
    CHECK(g->input(i)->dtype() == kAllDTypes[i]);
  CHECK(g->input(3)->shape()[0].is_unknown());
  const float f32_expected[] = {0.1f, -0.0f, INFINITY, -INFINITY, NAN, 1e-45f};
  const Tensor& t1 = constant_of(*g, 1);
  CHECK(std::memcmp(t1.data(), f32_expected, 16) == 0);  // up to the nan
  CHECK(std::isnan(t1.data_as<float>()[4]));
  CHECK(t1.data_as<float>()[5] == 1e-45f);
  CHECK(constant_of(*g, 2).data_as<uint16_t>()[0] == 0x7bff);  // f16 max
  CHECK(constant_of(*g, 2).data_as<uint16_t>()[1] == 0x0001);  // smallest subnormal
  CHECK(constant_of(*g, 3).data_as<uint16_t>()[1] == 0xff7f);  // bf16 lowest
  CHECK(constant_of(*g, 4).data_as<uint8_t>()[0] == 0x7e);     // e4m3fn 448
  CHECK(constant_of(*g, 4).data_as<uint8_t>()[1] == 0x81);     // smallest negative subnormal
  CHECK(constant_of(*g, 5).data_as<uint8_t>()[1] == 0xfc);     // e5m2 -inf
  CHECK(constant_of(*g, 6).to_i64() == std::vector<int64_t>{INT64_MIN, INT64_MAX});
  CHECK(constant_of(*g, 10).data_as<uint8_t>()[1] == 255);
  CHECK(constant_of(*g, 11).data_as<uint8_t>()[0] == 0x78);  // -8 low nibble, 7 high
  CHECK(constant_of(*g, 11).data_as<uint8_t>()[1] == 0x0f);
  CHECK(constant_of(*g, 12).to_i64() == std::vector<int64_t>{1, 0});
  CHECK(constant_of(*g, 13).numel() == 0);
  // The sign of NaN survives even where the dtype conversion would drop it.
  CHECK((constant_of(*g, 14).data_as<uint16_t>()[0] & 0x8000) != 0);
  CHECK((constant_of(*g, 14).data_as<uint16_t>()[1] & 0x8000) == 0);
  CHECK(constant_of(*g, 15).data_as<uint8_t>()[0] == 0xff);
}

TEST_CASE("kir text: symbolic dims, quoted names and multi-result nodes") {
  auto g = check_round_trip(
      "graph @\"my graph\"(%\"input:0\": f32[B, ?, \"seq len\"], %x.1: f32[B, ?, \"seq len\"]) -> "
      "(f32[B, ?, \"seq len\"], f32[B, ?, 1]) {\n"
      "  %\"a b\" = add(%\"input:0\", %x.1) : f32[B, ?, \"seq len\"]\n"
      "  %0, %1 = split(%\"a b\") {axis = 2, sizes = [3, 1]} : f32[B, ?, 3], f32[B, ?, 1]\n"
      "  return %\"a b\", %1\n"
      "}\n");
  CHECK(g->name() == "my graph");
  CHECK(g->input(0)->name() == "input:0");
  CHECK(g->input(0)->shape()[2] == Dim::symbol("seq len"));
  CHECK(g->node_list()[1]->result(0)->name() == "0");
}

TEST_CASE("kir text: nested regions and nodes with several regions print indented") {
  auto g = check_round_trip(
      "graph @outer(%x: f32[4]) -> (f32[4]) {\n"
      "  %y = fused(%x) : f32[4] {\n"
      "    graph @mid(%a: f32[4]) -> (f32[4]) {\n"
      "      %b = fused(%a) : f32[4] {\n"
      "        graph @inner(%c: f32[4]) -> (f32[4]) {\n"
      "          %d = relu(%c) : f32[4]\n"
      "          return %d\n"
      "        }\n"
      "      }\n"
      "      return %b\n"
      "    }\n"
      "  }\n"
      "  return %y\n"
      "}\n");
  CHECK(g->total_node_count() == 3);
  const Graph& inner = g->node_list()[0]->region(0).node_list()[0]->region(0);
  CHECK(inner.name() == "inner");
  CHECK(inner.node_list()[0]->loc().str() == "t.kir:6:11");
}

TEST_CASE("kir text: nodes without results, and an attribute named like the region keyword") {
  register_attr_test_op();
  auto g = check_round_trip(
      "graph @g(%x: f32[2]) -> (f32[2]) {\n"
      "  text_test_sink(%x) {graph = 1}\n"
      "  text_test_sink(%x)\n"
      "  return %x\n"
      "}\n");
  CHECK(g->num_nodes() == 2);
  CHECK(g->node_list()[0]->get_int("graph") == 1);
  CHECK(g->node_list()[1]->loc().str() == "t.kir:3:3");
  CHECK(parse_error("graph @g(%x: f32[2]) -> (f32[2]) {\n  text_test_sink(%x) : f32[2]\n  return %x\n}\n") ==
        "t.kir:2:22: expected 0 result types, got 1");
}

TEST_CASE("kir text: unnamed and clashing values get fresh numbered names") {
  Graph g("g");
  Value* x = g.add_input("x", TensorType{DType::kF32, {2}});
  Value* anon = g.add_input("", TensorType{DType::kF32, {2}});
  auto relu = g.create_node("relu", {x}, {x->type()});               // unnamed
  auto named = g.create_node("relu", {anon}, {x->type()}, {}, nullptr, {"1"});
  auto dup = g.create_node("add", {(*relu)->result(), (*named)->result()}, {x->type()}, {},
                           nullptr, {"x"});  // clashes with the input
  REQUIRE(dup.ok());
  g.set_outputs({(*dup)->result()});
  const std::string text = print_graph(g);
  CHECK(text ==
        "graph @g(%x: f32[2], %0: f32[2]) -> (%x: f32[2]) {\n"
        "  %2 = relu(%x) : f32[2]\n"
        "  %1 = relu(%0) : f32[2]\n"
        "  %3 = add(%2, %1) : f32[2]\n"
        "  return %3\n"
        "}\n");
  auto back = parse_ok(text);
  CHECK(print_graph(*back) == text);
  CHECK(back->input(1)->name() == "0");
  CHECK(back->output_name(0) == "x");  // the output keeps the clashing value's name
}

TEST_CASE("kir text: output names in the signature") {
  // Named where they differ from the returned value's; unnamed outputs take the value's name.
  const std::string text =
      "graph @g(%x: f32[2]) -> (%logits: f32[2], f32[2], %\"out:0\": f32[2]) {\n"
      "  %r = relu(%x) : f32[2]\n"
      "  return %x, %r, %r\n"
      "}\n";
  auto g = parse_ok(text);
  CHECK(g->output_names() == std::vector<std::string>{"logits", "r", "out:0"});
  CHECK(print_graph(*g) == text);
  // A name equal to the returned value's is not repeated.
  auto same = parse_ok("graph @g(%x: f32[2]) -> (%r: f32[2]) {\n  %r = relu(%x) : f32[2]\n  return %r\n}\n");
  CHECK(print_graph(*same) == "graph @g(%x: f32[2]) -> (f32[2]) {\n  %r = relu(%x) : f32[2]\n  return %r\n}\n");
  CHECK(parse_error("graph @g(%x: f32[2]) -> (%y: f32[2], %y: f32[2]) {\n  return %x, %x\n}\n") ==
        "t.kir:1:38: output name '%y' is used twice");
  CHECK(parse_error("graph @g(%x: f32[2]) -> (%y f32[2]) {\n  return %x\n}\n") ==
        "t.kir:1:29: expected ':' after the output name, got 'f32'");
}

TEST_CASE("kir text: print_node prints one line with regions, eliding huge tensors") {
  auto g = parse_ok(kMlp);
  CHECK(print_node(*g->node_list()[3]) ==
        "%p, %q = split(%a) {axis = 1, sizes = [128, 128]} : f32[B, 128], f32[B, 128]");
  CHECK(print_node(*g->node_list()[4]) ==
        "%f = fused(%p, %q) : f32[B, 128] { graph @body(%u: f32[B, 128], %v: f32[B, 128]) -> "
        "(f32[B, 128]) { %s = add(%u, %v) : f32[B, 128] return %s } }");
  Graph big("big");
  auto c = big.create_node("constant", {}, {TensorType{DType::kF32, {1024}}},
                           {{"value", Tensor(DType::kF32, {1024})}});
  REQUIRE(c.ok());
  CHECK(print_node(**c) == "%0 = constant() {value = dense<f32[1024]>[...]} : f32[1024]");
}

TEST_CASE("kir text: large inline tensors parse back exactly") {
  const int64_t n = 1 << 16;
  Tensor t(DType::kF32, {n});
  for (int64_t i = 0; i < n; ++i) t.set_f64(i, static_cast<double>(i) * 0.37 - 1000.0);
  Graph g("g");
  auto c = g.create_node("constant", {}, {t.type()}, {{"value", t}});
  REQUIRE(c.ok());
  g.set_outputs({(*c)->result()});
  const std::string text = print_graph(g);
  auto back = parse_ok(text);
  CHECK(constant_of(*back, 0).identical(t));
  CHECK(print_graph(*back) == text);
}

TEST_CASE("kir text: side files hold large constants, aligned, shared and mapped back") {
  TempDir dir;
  fs::create_directories(dir.path / "data");
  Tensor big(DType::kF32, {3, 7});  // 84 bytes
  for (int64_t i = 0; i < big.numel(); ++i) big.set_f64(i, static_cast<double>(i) * 1.5 - 3.0);
  Tensor half(DType::kBF16, {40});  // 80 bytes
  for (int64_t i = 0; i < half.numel(); ++i) half.set_f64(i, static_cast<double>(i) - 20.0);
  Tensor small = Tensor::from_f64(DType::kF32, {2}, std::vector<double>{1.0, 2.0});
  Graph g("w");
  std::vector<Value*> outs;
  for (const Tensor* t : {&big, &half, &big, &small}) {
    auto c = g.create_node("constant", {}, {t->type()}, {{"value", *t}});
    REQUIRE(c.ok());
    outs.push_back((*c)->result());
  }
  g.set_outputs(outs);
  PrintOptions opts;
  opts.inline_limit_bytes = 16;
  opts.side_file = (dir.path / "data" / "w.bin").string();
  const fs::path kir = dir.path / "m.kir";
  Status s = print_graph_to_file(g, kir.string(), opts);
  REQUIRE_MESSAGE(s.ok(), s.message());

  const std::string text = read_file(kir);
  CHECK(text ==
        "graph @w() -> (f32[3, 7], bf16[40], f32[3, 7], f32[2]) {\n"
        "  %0 = constant() {value = dense<f32[3, 7]>(file \"data/w.bin\", offset 0)} : f32[3, 7]\n"
        "  %1 = constant() {value = dense<bf16[40]>(file \"data/w.bin\", offset 128)} : bf16[40]\n"
        "  %2 = constant() {value = dense<f32[3, 7]>(file \"data/w.bin\", offset 0)} : f32[3, 7]\n"
        "  %3 = constant() {value = dense<f32[2]>[1.0, 2.0]} : f32[2]\n"
        "  return %0, %1, %2, %3\n"
        "}\n");
  const std::string bin = read_file(opts.side_file);
  REQUIRE(bin.size() == 128 + 80);
  CHECK(std::memcmp(bin.data(), big.data(), 84) == 0);
  CHECK(bin.substr(84, 44) == std::string(44, '\0'));
  CHECK(std::memcmp(bin.data() + 128, half.data(), 80) == 0);

  auto back = parse_graph_file(kir.string());
  REQUIRE_MESSAGE(back.ok(), back.status().message());
  CHECK(constant_of(**back, 0).identical(big));
  CHECK(constant_of(**back, 1).identical(half));
  CHECK(constant_of(**back, 3).identical(small));
  CHECK(constant_of(**back, 0).data() == constant_of(**back, 2).data());  // one mapping
  CHECK(print_graph(**back).find("file") == std::string::npos);

  // Printing the parsed graph again gives the same .kir and side file bytes.
  TempDir dir2;
  fs::create_directories(dir2.path / "data");
  PrintOptions opts2 = opts;
  opts2.side_file = (dir2.path / "data" / "w.bin").string();
  REQUIRE(print_graph_to_file(**back, (dir2.path / "m.kir").string(), opts2).ok());
  CHECK(read_file(dir2.path / "m.kir") == text);
  CHECK(read_file(opts2.side_file) == bin);

  // Overwriting the files the graph is mapped from leaves its tensors intact.
  REQUIRE(print_graph_to_file(**back, kir.string(), opts).ok());
  CHECK(constant_of(**back, 0).identical(big));
  CHECK(read_file(opts.side_file) == bin);
}

TEST_CASE("kir text: side file placement rules when printing") {
  TempDir dir;
  Graph g("g");
  auto c = g.create_node("constant", {}, {TensorType{DType::kF32, {1}}},
                         {{"value", Tensor(DType::kF32, {1})}});
  REQUIRE(c.ok());
  g.set_outputs({(*c)->result()});
  PrintOptions opts;
  opts.side_file = (dir.path.parent_path() / "elsewhere.bin").string();
  const std::string kir = (dir.path / "m.kir").string();
  CHECK(print_graph_to_file(g, kir, opts).message() ==
        "side file '" + opts.side_file + "' must be in the folder of '" + kir + "' or below");
  // Nothing above the limit: everything inline and no side file written.
  opts.side_file = (dir.path / "w.bin").string();
  REQUIRE(print_graph_to_file(g, kir, opts).ok());
  CHECK_FALSE(fs::exists(opts.side_file));
  CHECK(read_file(kir).find("dense<f32[1]>[0.0]") != std::string::npos);
}

namespace {
/// A one-constant graph whose tensor is `dense<f32[4]>(file <ref>, offset <offset>)`; the path
/// string starts at column 47 and the offset at column 56 + len(ref).
std::string side_ref_graph(const std::string& ref, const std::string& offset = "0") {
  return "graph @g() -> (f32[4]) {\n"
         "  %0 = constant() {value = dense<f32[4]>(file " + ref + ", offset " + offset +
         ")} : f32[4]\n"
         "  return %0\n"
         "}\n";
}
}  // namespace

TEST_CASE("kir text: side file references are checked") {
  TempDir dir;
  const std::string file = (dir.path / "t.kir").string();
  const float values[5] = {9.0f, 1.0f, 2.0f, 3.0f, 4.0f};
  write_file(dir.path / "w.bin", std::string(reinterpret_cast<const char*>(values), 20));

  // An unaligned offset is fine (the bytes are copied).
  auto g = parse_ok(side_ref_graph("\"w.bin\"", "4"), file);
  CHECK(constant_of(*g, 0).to_f64() == std::vector<double>{1.0, 2.0, 3.0, 4.0});

  CHECK(parse_error(side_ref_graph("\"nope.bin\""), file) ==
        file + ":2:47: cannot open side file 'nope.bin': No such file or directory");
  CHECK(parse_error(side_ref_graph("\"w.bin\"", "8"), file) ==
        file + ":2:63: side file 'w.bin': 16 bytes at offset 8 exceed its size of 20 bytes");
  CHECK(parse_error(side_ref_graph("\"w.bin\"", "4096"), file) ==
        file + ":2:63: side file 'w.bin': 16 bytes at offset 4096 exceed its size of 20 bytes");
  CHECK(parse_error(side_ref_graph("\"/etc/passwd\"")) ==
        "t.kir:2:47: expected relative side file path, got '/etc/passwd'");
  CHECK(parse_error(side_ref_graph("\"sub/../../w.bin\"")) ==
        "t.kir:2:47: expected side file path without '..', got 'sub/../../w.bin'");
  CHECK(parse_error(side_ref_graph("\"\"")) == "t.kir:2:47: expected side file path, got empty string");
  CHECK(parse_error(side_ref_graph("\"w.bin\"", "-1"), file) ==
        file + ":2:63: expected offset (an integer >= 0), got '-'");
}

namespace {
/// A graph around one statement on line 2: `%x` is an f32[2] input, `%y` must be returned.
std::string body(const std::string& line) {
  return "graph @g(%x: f32[2]) -> (f32[2]) {\n" + line + "\n  return %y\n}\n";
}
}  // namespace

TEST_CASE("kir text: error on a bad token") {
  CHECK(parse_error(body("  %y = relu(%x) $ : f32[2]")) == "t.kir:2:17: expected a token, got '$'");
  CHECK(parse_error(body("  %y = relu(%x) : f32[2]]")) ==
        "t.kir:2:25: expected '%name', op name or 'return', got ']'");
  CHECK(parse_error(body("  %y = relu(%x) : f32[2] 12abc")) ==
        "t.kir:2:28: expected separator after digits in number, got 'a'");
  CHECK(parse_error(body("  %1x = relu(%x) : f32[2]")) ==
        "t.kir:2:5: expected only digits in numeric value name, got 'x'");
  CHECK(parse_error(body("  % = relu(%x) : f32[2]")) ==
        "t.kir:2:3: expected value name after '%', got ' '");
  CHECK(parse_error(kMlp + std::string("graph")) == "t.kir:14:1: expected end of input, got 'graph'");
}

TEST_CASE("kir text: error on an unknown op") {
  // Ops may come from plugins, so the message says how to load one; a close name is suggested.
  CHECK(parse_error(body("  %y = frobnicate(%x) : f32[2]")) ==
        "t.kir:2:8: unknown op 'frobnicate'; a plugin may provide it: load plugins with "
        "--plugin-path DIR, KILN_PLUGIN_PATH=DIR1:DIR2 or [plugins] paths in the pipeline");
  CHECK(parse_error(body("  %y = sofmax(%x) {axis = 0} : f32[2]")) ==
        "t.kir:2:8: unknown op 'sofmax' (did you mean 'softmax'?); " + std::string(kPluginHint));
}

TEST_CASE("kir text: error on an unknown or duplicate attribute") {
  CHECK(parse_error(body("  %y = relu(%x) {axis = 1} : f32[2]")) ==
        "t.kir:2:18: relu: unknown attribute 'axis'");
  CHECK(parse_error(body("  %y = gelu(%x) {approximate = \"tanh\", approximate = \"none\"} : f32[2]")) ==
        "t.kir:2:40: duplicate attribute 'approximate'");
}

TEST_CASE("kir text: error on an attribute of the wrong kind") {
  CHECK(parse_error(body("  %p, %q = split(%x) {axis = \"one\", sizes = [1, 1]} : f32[1], f32[1]")) ==
        "t.kir:2:23: split: expected int for attribute 'axis', got string");
  CHECK(parse_error(body("  %y = cast(%x) {to = 1.5} : f32[2]")) ==
        "t.kir:2:18: cast: expected dtype for attribute 'to', got float");
  CHECK(parse_error(body("  %y = leaky_relu(%x) {alpha = [1, \"a\"]} : f32[2]")) ==
        "t.kir:2:36: expected number, got string \"a\"");
  CHECK(parse_error(body("  %y = leaky_relu(%x) {alpha = foo} : f32[2]")) ==
        "t.kir:2:32: expected attribute value, got 'foo'");
}

TEST_CASE("kir text: error on an undefined value") {
  CHECK(parse_error(body("  %y = relu(%z) : f32[2]")) == "t.kir:2:13: use of undefined value %z");
  // Regions are isolated: the outer %x is not visible inside.
  CHECK(parse_error(body("  %y = fused(%x) : f32[2] {\n"
                         "    graph @r(%a: f32[2]) -> (f32[2]) {\n"
                         "      %b = add(%a, %x) : f32[2]\n"
                         "      return %b\n"
                         "    }\n"
                         "  }")) == "t.kir:4:20: use of undefined value %x");
  CHECK(parse_error("graph @g(%x: f32[2]) -> (f32[2]) {\n  return %w\n}\n") ==
        "t.kir:2:10: use of undefined value %w");
}

TEST_CASE("kir text: error on a redefined value") {
  CHECK(parse_error(body("  %x = relu(%x) : f32[2]")) == "t.kir:2:3: redefinition of value %x");
  CHECK(parse_error(body("  %y, %y = split(%x) {sizes = [1, 1]} : f32[1], f32[1]")) ==
        "t.kir:2:7: redefinition of value %y");
  CHECK(parse_error("graph @g(%x: f32[2], %x: f32[2]) -> () {\n  return\n}\n") ==
        "t.kir:1:22: redefinition of value %x");
}

TEST_CASE("kir text: error on a wrong result type comes from the verifier") {
  CHECK(parse_error(body("  %y = relu(%x) : f32[3]")) ==
        "t.kir:2:3: relu: result 0 is declared f32[3] but the op produces f32[2]");
  CHECK(parse_error(body("  %y = relu(%x) : f32[2], f32[2]")) ==
        "t.kir:2:17: expected 1 result types, got 2");
  CHECK(parse_error(body("  %y = relu(%x)")) ==
        "t.kir:3:3: expected ':' and the result types, got 'return'");
  CHECK(parse_error("graph @g(%x: f32[2]) -> (f32[3]) {\n  return %x\n}\n") ==
        "t.kir:2:10: expected return value of type f32[3], got %x of type f32[2]");
  CHECK(parse_error("graph @g(%x: f32[2]) -> (f32[2], f32[2]) {\n  return %x\n}\n") ==
        "t.kir:2:3: expected 2 return values to match the signature, got 1");
}

TEST_CASE("kir text: error on a bad dtype or dim") {
  CHECK(parse_error("graph @g(%x: f33[2]) -> () {\n  return\n}\n") ==
        "t.kir:1:14: expected dtype, got 'f33'");
  CHECK(parse_error("graph @g(%x: f32[-1]) -> () {\n  return\n}\n") ==
        "t.kir:1:18: expected dim >= 0, got -1");
  CHECK(parse_error("graph @g(%x: f32[99999999999999999999]) -> () {\n  return\n}\n") ==
        "t.kir:1:18: expected dim in the int64 range, got 99999999999999999999");
  CHECK(parse_error("graph @g(%x: f32[4294967296, 4294967296]) -> () {\n  return\n}\n") ==
        "t.kir:1:14: expected at most 2^59 elements, got f32[4294967296, 4294967296]");
  CHECK(parse_error("graph @g(%x: f32[2 3]) -> () {\n  return\n}\n") ==
        "t.kir:1:20: expected ',' or ']', got '3'");
}

TEST_CASE("kir text: error on a tensor literal of the wrong size or values") {
  CHECK(parse_error(body("  %y = constant() {value = dense<f32[2, 2]>[1.0, 2.0, 3.0]} : f32[2, 2]")) ==
        "t.kir:2:44: expected 4 elements for f32[2, 2], got 3");
  CHECK(parse_error(body("  %y = constant() {value = dense<f32[2]>[1.0, 2.0, 3.0]} : f32[2]")) ==
        "t.kir:2:41: expected 2 elements for f32[2], got 3");
  CHECK(parse_error(body("  %y = constant() {value = dense<u8[2]>[1, 256]} : u8[2]")) ==
        "t.kir:2:44: expected u8 element in [0, 255], got 256");
  CHECK(parse_error(body("  %y = constant() {value = dense<i32[2]>[1, 2.5]} : i32[2]")) ==
        "t.kir:2:45: expected integer element for i32, got float");
  CHECK(parse_error(body("  %y = constant() {value = dense<f32[B]>[1.0]} : f32[1]")) ==
        "t.kir:2:34: expected static shape in dense<...>, got f32[B]");
  CHECK(parse_error(body("  %y = constant() {value = dense<f32[1]>[1e999]} : f32[1]")) ==
        "t.kir:2:42: expected float in the f64 range, got 1e999");
}

TEST_CASE("kir text: error on integer overflow in literals") {
  CHECK(parse_error(body("  %y = softmax(%x) {axis = 9223372036854775808} : f32[2]")) ==
        "t.kir:2:28: expected integer in the int64 range, got 9223372036854775808");
  CHECK(parse_error(body("  %y = softmax(%x) {axis = -9223372036854775809} : f32[2]")) ==
        "t.kir:2:28: expected integer in the int64 range, got -9223372036854775809");
}

TEST_CASE("kir text: error on an unterminated string") {
  register_attr_test_op();
  CHECK(parse_error(body("  %y = text_test_attrs(%x) {s = \"abc} : f32[2]")) ==
        "t.kir:2:33: expected closing '\"' of string, got end of line");
  CHECK(parse_error("graph @g(%x: f32[2]) -> (f32[2]) {\n  %y = text_test_attrs(%x) {s = \"ab") ==
        "t.kir:2:33: expected closing '\"' of string, got end of input");
  CHECK(parse_error(body("  %y = text_test_attrs(%x) {s = \"a\\q\"} : f32[2]")) ==
        "t.kir:2:35: expected escape sequence (\\n, \\t, \\r, \\\", \\\\ or \\xHH), got '\\q'");
}

TEST_CASE("kir text: error on unexpected end of input") {
  CHECK(parse_error("") == "t.kir:1:1: expected 'graph', got end of input");
  CHECK(parse_error("graph @g(%x: f32[2]) -> (f32[2]) {\n  %y = relu(%x) : f32[2]\n") ==
        "t.kir:3:1: expected '%name', op name or 'return', got end of input");
  CHECK(parse_error("graph @g(%x: f32[") ==
        "t.kir:1:18: expected dim (integer, symbol or '?'), got end of input");
  CHECK(parse_error("graph @g() -> () {\n  return\n") ==
        "t.kir:3:1: expected '}' after the return values, got end of input");
}

namespace {
/// A graph with `depth` fused regions nested inside each other.
std::string nested(int depth) {
  std::string text = "graph @g0(%x: f32[1]) -> (f32[1]) {\n";
  for (int i = 1; i <= depth; ++i)
    text += "%y = fused(%x) : f32[1] {\ngraph @g" + std::to_string(i) +
            "(%x: f32[1]) -> (f32[1]) {\n";
  text += "return %x\n}\n";
  for (int i = 1; i <= depth; ++i) text += "}\nreturn %y\n}\n";
  return text;
}
}  // namespace

TEST_CASE("kir text: region nesting is limited to 64 levels") {
  CHECK(parse_graph(nested(64)).ok());
  CHECK(parse_error(nested(65)) == "t.kir:131:1: expected at most 64 nested regions, got more");
}

TEST_CASE("kir text: no input crashes the parser (prefixes and byte edits of valid text)") {
  register_attr_test_op();
  const std::string valid =
      std::string(kMlp) +
      "";
  int failures = 0;
  for (size_t n = 0; n < valid.size(); ++n) failures += parse_graph(valid.substr(0, n)).ok() ? 0 : 1;
  // Every proper prefix fails, except those that only drop the final newline.
  CHECK(failures == static_cast<int>(valid.size()) - 1);
  const char replacements[] = {'\0', '"', '%', '@', '-', '9', '[', '{', '}', 'z', '\xff'};
  for (size_t i = 0; i < valid.size(); ++i)
    for (char c : replacements) {
      std::string edited = valid;
      edited[i] = c;
      auto g = parse_graph(edited);
      if (g.ok()) CHECK(print_graph(*parse_ok(print_graph(**g))) == print_graph(**g));
    }
}

TEST_CASE("kir text: the fuzz seed corpus replays as documented") {
  // valid_*.kir parse and round-trip; invalid_*.kir start with "// error: line:col: message".
  register_attr_test_op();
  int seen = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(KILN_SOURCE_DIR) / "tests/corpus/kir")) {
    const std::string path = entry.path().string();
    const std::string name = entry.path().filename().string();
    if (entry.path().extension() != ".kir") continue;
    ++seen;
    auto g = parse_graph_file(path);
    if (name.rfind("valid_", 0) == 0) {
      CHECK_MESSAGE(g.ok(), g.status().message());
      if (g.ok()) CHECK(print_graph(*parse_ok(print_graph(**g))) == print_graph(**g));
      continue;
    }
    const std::string text = read_file(entry.path());
    const std::string marker = "// error: ";
    REQUIRE_MESSAGE(text.rfind(marker, 0) == 0, name);
    const std::string expected = path + ":" + text.substr(marker.size(), text.find('\n') - marker.size());
    CHECK_FALSE(g.ok());
    CHECK(g.status().message() == expected);
  }
  CHECK(seen >= 10);
}
