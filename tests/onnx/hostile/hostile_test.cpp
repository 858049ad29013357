// Hostile onnx files: each must end in a clear error naming what is wrong, never a crash,
// a read outside the model's folder or an overflow.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstring>
#include <limits>

#include "onnx_test_util.h"

using namespace kiln;
using namespace kiln::onnx_test;

namespace {

constexpr int kFloat = onnx::TensorProto::FLOAT;
constexpr int kInt64 = onnx::TensorProto::INT64;

/// y = x + w, with w a [4] float initializer (filled by the caller).
ModelBuilder add_model() {
  ModelBuilder b;
  b.input("x", kFloat, {int64_t{4}}).output("y", kFloat, {int64_t{4}});
  b.node("Add", {"x", "w"}, {"y"}, "add1");
  return b;
}

/// A model whose initializer w comes from external data at `location`.
std::string external_model(const TempDir& dir, const std::string& location, int64_t offset = -1,
                           int64_t length = -1) {
  ModelBuilder b = add_model();
  set_external(b.initializer("w", {4}, {}), location, offset, length);
  const std::string path = dir.file("model.onnx");
  b.write(path);
  return path;
}

/// 16 bytes: the floats 1, 2, 3, 4.
std::string four_floats() {
  const float v[4] = {1, 2, 3, 4};
  return std::string(reinterpret_cast<const char*>(v), sizeof v);
}

std::string error_of(const std::string& path, const std::map<std::string, OptionValue>& opts = {}) {
  auto g = import(path, opts);
  return g.ok() ? std::string("(imported)") : g.status().message();
}

/// Runs `kiln import` on `path`; returns the exit code and stderr.
std::pair<int, std::string> cli_import(const TempDir& dir, const std::string& path) {
  const std::string err = dir.file("stderr.txt");
  const std::string cmd = std::string(KILN_BINARY_DIR) + "/bin/kiln import '" + path + "' -o '" +
                          dir.file("out.kir") + "' 2> '" + err + "' > /dev/null";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(err);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, text};
}

}  // namespace

TEST_CASE("a truncated model is refused") {
  TempDir dir;
  ModelBuilder b = add_model();
  b.initializer("w", {4}, {1, 2, 3, 4});
  std::string bytes;
  b.proto().SerializeToString(&bytes);
  const std::string path = dir.file("truncated.onnx");
  write_bytes(path, bytes.substr(0, bytes.size() - 7));
  CHECK(error_of(path) == "onnx model '" + path + "' cannot be parsed: truncated, corrupt or not an onnx file");
  auto [rc, err] = cli_import(dir, path);
  CHECK(rc == 1);
  CHECK(err.find("cannot be parsed: truncated, corrupt or not an onnx file") != std::string::npos);
}

TEST_CASE("garbage and empty files are refused") {
  TempDir dir;
  const std::string text = dir.file("text.onnx");
  write_bytes(text, "this is not an onnx model at all\n");
  CHECK(error_of(text) == "onnx model '" + text + "' cannot be parsed: truncated, corrupt or not an onnx file");
  // Bytes that happen to parse as a protobuf message, but hold no model.
  const std::string fields = dir.file("fields.onnx");
  write_bytes(fields, std::string("\x50\x01", 2));
  CHECK(error_of(fields) == "onnx model '" + fields + "' has no ir_version: not an onnx model");
  const std::string empty = dir.file("empty.onnx");
  write_bytes(empty, "");
  CHECK(error_of(empty) == "onnx model '" + empty + "' is empty");
  auto [rc, err] = cli_import(dir, text);
  CHECK(rc == 1);
  CHECK(err.find("cannot be parsed") != std::string::npos);
}

TEST_CASE("unsupported ir versions and opsets are refused") {
  TempDir dir;
  ModelBuilder b = add_model();
  b.initializer("w", {4}, {1, 2, 3, 4});
  b.proto().set_ir_version(11);
  const std::string path = dir.file("ir11.onnx");
  b.write(path);
  CHECK(error_of(path) == "onnx model '" + path + "' has ir_version 11; kiln reads 3 to 10");
  ModelBuilder c = add_model();
  c.initializer("w", {4}, {1, 2, 3, 4});
  c.proto().mutable_opset_import(0)->set_version(22);
  c.write(path);
  CHECK(error_of(path) == "onnx model imports opset 22 of the default domain; kiln supports up to 21");
}

TEST_CASE("a missing initializer names the node and the value") {
  TempDir dir;
  const std::string path = dir.file("missing.onnx");
  add_model().write(path);
  CHECK(error_of(path) ==
        "onnx node 'add1' (op Add, domain ai.onnx, opset 17): input 1 'w' is not defined (no initializer, "
        "graph input or earlier node produces it)");
  auto [rc, err] = cli_import(dir, path);
  CHECK(rc == 1);
  CHECK(err.find("input 1 'w' is not defined") != std::string::npos);
}

TEST_CASE("initializer data that does not match its shape is refused") {
  TempDir dir;
  const std::string path = dir.file("m.onnx");
  ModelBuilder b = add_model();
  b.initializer("w", {4}, {1, 2, 3});
  b.write(path);
  CHECK(error_of(path) == "initializer 'w' has 3 values, shape [4] needs 4");
  ModelBuilder r = add_model();
  auto& t = r.initializer("w", {4}, {});
  t.set_raw_data(std::string(8, '\0'));
  r.write(path);
  CHECK(error_of(path) == "initializer 'w': raw_data has 8 bytes, shape [4] of FLOAT needs 16");
}

TEST_CASE("external data: a valid file is mapped, two tensors share the mapping") {
  TempDir dir;
  write_bytes(dir.file("weights.bin"), four_floats() + four_floats());
  ModelBuilder b;
  b.input("x", kFloat, {int64_t{4}}).output("y", kFloat, {int64_t{4}});
  b.node("Add", {"x", "w1"}, {"s"}, "add1");
  b.node("Add", {"s", "w2"}, {"y"}, "add2");
  set_external(b.initializer("w1", {4}, {}), "weights.bin", 0, 16);
  set_external(b.initializer("w2", {4}, {}), "weights.bin", 16, 16);
  const std::string path = dir.file("model.onnx");
  b.write(path);
  auto g = import(path);
  REQUIRE(g.ok());
  const Tensor* w1 = nullptr;
  const Tensor* w2 = nullptr;
  for (const auto& n : (*g)->nodes()) {
    if (n->op_name() != "constant") continue;
    (n->result(0)->name() == "w1" ? w1 : w2) = &n->attr("value")->as_tensor();
  }
  REQUIRE(w1 != nullptr);
  REQUIRE(w2 != nullptr);
  CHECK(w1->to_f64() == std::vector<double>{1, 2, 3, 4});
  // Both wrap the one read-only mapping of weights.bin: no copy was made.
  CHECK(w2->data() - w1->data() == 16);
}

TEST_CASE("external data: absolute paths are refused") {
  TempDir dir;
  const std::string path = external_model(dir, "/etc/passwd");
  CHECK(error_of(path) == "initializer 'w': external data location '/etc/passwd' is an absolute path");
  auto [rc, err] = cli_import(dir, path);
  CHECK(rc == 1);
  CHECK(err.find("is an absolute path") != std::string::npos);
}

TEST_CASE("external data: '..' is refused, wherever it appears") {
  TempDir dir;
  CHECK(error_of(external_model(dir, "../weights.bin")) ==
        "initializer 'w': external data location '../weights.bin' contains '..'");
  CHECK(error_of(external_model(dir, "sub/../../weights.bin")) ==
        "initializer 'w': external data location 'sub/../../weights.bin' contains '..'");
  CHECK(error_of(external_model(dir, "sub\\..\\weights.bin")) ==
        "initializer 'w': external data location 'sub\\..\\weights.bin' contains '..'");
}

TEST_CASE("external data: a symbolic link leaving the model folder is refused") {
  TempDir dir, outside;
  write_bytes(outside.file("secret.bin"), four_floats());
  fs::create_symlink(outside.file("secret.bin"), dir.file("weights.bin"));
  const std::string path = external_model(dir, "weights.bin");
  const std::string target = fs::canonical(outside.file("secret.bin")).string();
  CHECK(error_of(path) == "initializer 'w': external data location 'weights.bin' resolves outside the model "
                          "folder (to '" + target + "')");
  // A folder link escaping the same way.
  fs::create_directory_symlink(outside.path(), dir.file("sub"));
  CHECK(error_of(external_model(dir, "sub/secret.bin")).find("resolves outside the model folder") != std::string::npos);
  auto [rc, err] = cli_import(dir, path);
  CHECK(rc == 1);
  CHECK(err.find("resolves outside the model folder") != std::string::npos);
}

TEST_CASE("external data: a symbolic link inside the model folder is fine") {
  TempDir dir;
  fs::create_directory(dir.file("data"));
  write_bytes(dir.file("data/real.bin"), four_floats());
  fs::create_symlink("data/real.bin", dir.file("weights.bin"));
  auto g = import(external_model(dir, "weights.bin"));
  CHECK(g.ok());
}

TEST_CASE("external data: hard-linked files are refused") {
  TempDir dir, outside;
  write_bytes(outside.file("secret.bin"), four_floats());
  std::error_code ec;
  fs::create_hard_link(outside.file("secret.bin"), dir.file("weights.bin"), ec);
  if (ec) return;  // the two temp folders may sit on different file systems
  const std::string path = external_model(dir, "weights.bin");
  const std::string file = fs::canonical(dir.file("weights.bin")).string();
  CHECK(error_of(path) == "initializer 'w': external data file '" + file +
                              "' has 2 hard links; kiln refuses hard-linked external data");
}

TEST_CASE("external data: offset and length must stay inside the file and match the tensor") {
  TempDir dir;
  write_bytes(dir.file("weights.bin"), four_floats());
  CHECK(error_of(external_model(dir, "weights.bin", 8, 16)) ==
        "initializer 'w': external data range [8, +16) runs past the end of 'weights.bin' (16 bytes)");
  CHECK(error_of(external_model(dir, "weights.bin", 100)) ==
        "initializer 'w': external data offset 100 is past the end of 'weights.bin' (16 bytes)");
  CHECK(error_of(external_model(dir, "weights.bin", 0, 12)) ==
        "initializer 'w': external data length 12 does not match the 16 bytes of shape [4]");
  CHECK(error_of(external_model(dir, "weights.bin", 4)) ==
        "initializer 'w': external data length 12 does not match the 16 bytes of shape [4]");
  // An offset that would overflow when added to the length.
  CHECK(error_of(external_model(dir, "weights.bin", 0, std::numeric_limits<int64_t>::max())) ==
        "initializer 'w': external data range [0, +9223372036854775807) runs past the end of 'weights.bin' (16 bytes)");
  CHECK(error_of(external_model(dir, "missing.bin")) ==
        "initializer 'w': external data location 'missing.bin' does not exist");
}

TEST_CASE("oversized dims are refused before anything is allocated") {
  TempDir dir;
  const std::string path = dir.file("m.onnx");
  ModelBuilder in;
  in.input("x", kFloat, {int64_t{1} << 40, int64_t{1} << 40}).output("x", kFloat);
  in.write(path);
  CHECK(error_of(path) == "graph input 'x': element count of shape [1099511627776, 1099511627776] overflows int64");
  ModelBuilder big;
  big.input("x", kFloat, {int64_t{1} << 31, int64_t{1} << 31}).output("x", kFloat);
  big.write(path);
  CHECK(error_of(path) == "graph input 'x' f32[2147483648, 2147483648] exceeds the tensor limit of 17179869184 bytes");
  ModelBuilder init = add_model();
  init.initializer("w", {int64_t{1} << 62, 4}, {});
  init.write(path);
  CHECK(error_of(path) == "initializer 'w': element count of shape [4611686018427387904, 4] overflows int64");
  ModelBuilder limited = add_model();
  limited.initializer("w", {4}, {1, 2, 3, 4});
  limited.write(path);
  CHECK(error_of(path, {{"max-tensor-bytes", int64_t{8}}}) ==
        "initializer 'w': 16 bytes exceed the tensor limit of 8");
  auto [rc, err] = cli_import(dir, path);
  CHECK(rc == 0);
}

TEST_CASE("int64 overflow in shape arithmetic is an error") {
  TempDir dir;
  const std::string path = dir.file("m.onnx");
  ModelBuilder tile;
  tile.input("x", kFloat, {int64_t{4}}).output("y", kFloat);
  tile.int_initializer("r", {1}, {int64_t{1} << 62});
  tile.node("Tile", {"x", "r"}, {"y"}, "tile1");
  tile.write(path);
  CHECK(error_of(path) == "onnx node 'tile1' (op Tile, domain ai.onnx, opset 17): 4611686018427387904 * 4 overflows int64");
  ModelBuilder reshape;
  reshape.input("x", kFloat, {int64_t{4}}).output("y", kFloat);
  reshape.int_initializer("s", {2}, {int64_t{1} << 62, 8});
  reshape.node("Reshape", {"x", "s"}, {"y"}, "reshape1");
  reshape.write(path);
  CHECK(error_of(path) == "onnx node 'reshape1' (op Reshape, domain ai.onnx, opset 17): reshape target: "
                          "element count of shape [4611686018427387904, 8] overflows int64");
  ModelBuilder cos;
  cos.output("y", kFloat);
  cos.int_initializer("s", {3}, {int64_t{1} << 20, int64_t{1} << 20, int64_t{1} << 10});
  cos.node("ConstantOfShape", {"s"}, {"y"}, "fill");
  cos.write(path);
  CHECK(error_of(path) == "onnx node 'fill' (op ConstantOfShape, domain ai.onnx, opset 17): shape "
                          "[1048576, 1048576, 1024] exceeds the tensor limit");
  ModelBuilder pool;
  pool.input("x", kFloat, {int64_t{1}, int64_t{1}, int64_t{8}}).output("y", kFloat);
  add_ints_attr(pool.node("MaxPool", {"x"}, {"y"}, "pool"), "kernel_shape", {int64_t{1} << 62});
  pool.write(path);
  CHECK(error_of(path) == "onnx node 'pool' (op MaxPool, domain ai.onnx, opset 17): 'kernel_shape' value "
                          "4611686018427387904 is outside [1, 1048576]");
}

TEST_CASE("rank, node count and nesting limits") {
  TempDir dir;
  const std::string path = dir.file("m.onnx");
  ModelBuilder rank;
  rank.input("x", kFloat, std::vector<DimSpec>(40, int64_t{1})).output("x", kFloat);
  rank.write(path);
  CHECK(error_of(path) == "graph input 'x' has rank 40, above the limit of 32");

  ModelBuilder nodes;
  nodes.input("x", kFloat, {int64_t{2}}).output("c", kFloat);
  nodes.node("Relu", {"x"}, {"a"});
  nodes.node("Relu", {"a"}, {"b"});
  nodes.node("Relu", {"b"}, {"c"});
  nodes.write(path);
  CHECK(error_of(path, {{"max-nodes", int64_t{2}}}) == "onnx model has more than 2 nodes (the node limit)");
  CHECK(error_of(path) == "(imported)");

  // If nodes nested 20 deep: each then-branch holds the next If.
  ModelBuilder nest;
  nest.output("y", kFloat);
  onnx::GraphProto* g = &nest.graph();
  std::string out = "y";
  for (int depth = 0; depth < 20; ++depth) {
    auto* n = g->add_node();
    n->set_op_type("If");
    n->add_input("cond");
    n->add_output(out);
    auto* a = n->add_attribute();
    a->set_name("then_branch");
    a->set_type(onnx::AttributeProto::GRAPH);
    g = a->mutable_g();
    g->set_name("level" + std::to_string(depth + 1));
    out = "y" + std::to_string(depth + 1);
    g->add_output()->set_name(out);
  }
  nest.write(path);
  CHECK(error_of(path) == "onnx graph 'level17' is nested 17 deep, above the limit of 16");
}

TEST_CASE("an op kiln cannot import names the op type, domain, opset and node") {
  TempDir dir;
  const std::string path = dir.file("m.onnx");
  ModelBuilder b;
  b.input("x", kFloat, {int64_t{2}}).output("y", kFloat);
  b.node("NotARealOp", {"x"}, {"y"}, "mystery");
  b.write(path);
  CHECK(error_of(path) ==
        "onnx node 'mystery' (op NotARealOp, domain ai.onnx, opset 17): op is not supported by kiln's onnx front end");
  ModelBuilder d;
  d.input("x", kFloat, {int64_t{2}}).output("y", kFloat);
  d.node("Gelu", {"x"}, {"y"}, "ms").set_domain("com.microsoft");
  d.write(path);
  CHECK(error_of(path) == "onnx node 'ms' (op Gelu, domain com.microsoft, opset none): domain 'com.microsoft' is not "
                          "in the model's opset_import");
  auto [rc, err] = cli_import(dir, dir.file("m.onnx"));
  CHECK(rc == 1);
  CHECK(err.find("domain 'com.microsoft'") != std::string::npos);
}
