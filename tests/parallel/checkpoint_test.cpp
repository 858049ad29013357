// Checkpoints by logical tensor (plugins/parallel/checkpoint.h): weights saved from a tp=2 run
// load back whole and reshard to tp=4 and to one rank, and the model then gives the same outputs.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>

#include "checkpoint.h"
#include "mesh_helpers.h"
#include "kiln/core/driver.h"
#include "kiln/core/npy.h"
#include "kiln/ir/interpreter.h"
#include "kiln/ir/mesh_run.h"
#include "kiln/ir/text.h"
#include "strategies.h"

using namespace kiln;
using namespace kiln::parallel;
namespace fs = std::filesystem;

namespace {

/// `dense<f32[shape]>[...]` with distinct deterministic values.
std::string dense(const std::vector<int64_t>& shape, double seed) {
  int64_t n = 1;
  std::ostringstream dims, vals;
  for (size_t i = 0; i < shape.size(); ++i) dims << (i ? ", " : "") << shape[i], n *= shape[i];
  for (int64_t i = 0; i < n; ++i) vals << (i ? ", " : "") << std::sin(seed + 0.37 * static_cast<double>(i));
  return "dense<f32[" + dims.str() + "]>[" + vals.str() + "]";
}

/// x[8, 16] -> linear(32) + bias -> relu -> linear(16): weights as named constants.
std::unique_ptr<Graph> mlp(double seed) {
  const std::string text = "graph @mlp(%x: f32[8, 16]) -> (f32[8, 16]) {\n"
                           "  %w1 = constant() {value = " + dense({32, 16}, seed) + "} : f32[32, 16]\n"
                           "  %b1 = constant() {value = " + dense({32}, seed + 1) + "} : f32[32]\n"
                           "  %w2 = constant() {value = " + dense({16, 32}, seed + 2) + "} : f32[16, 32]\n"
                           "  %h = linear(%x, %w1, %b1) : f32[8, 32]\n"
                           "  %a = relu(%h) : f32[8, 32]\n"
                           "  %y = linear(%a, %w2) : f32[8, 16]\n"
                           "  return %y\n}\n";
  auto g = parse_graph(text, "mlp.kir");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(*g);
}

DeviceMesh tp(int64_t n) { return DeviceMesh{{{"tp", n}}}; }

std::unique_ptr<Graph> partitioned(const Graph& global, int64_t ranks) {
  auto g = global.clone();
  TensorParallelConfig cfg;
  cfg.mesh = tp(ranks);
  Status s = apply_tensor_parallel(*g, cfg);
  REQUIRE_MESSAGE(s.ok(), s.message());
  return g;
}

Tensor input() {
  Tensor x(DType::kF32, {8, 16});
  for (int64_t i = 0; i < x.numel(); ++i) x.set_f64(i, std::cos(0.11 * static_cast<double>(i)));
  return x;
}

Tensor run_sharded(const Graph& g) { return testing::run_sharded(g, {input()}); }

Tensor run_whole(const Graph& g) { return testing::run_whole(g, {input()}); }

void check_close(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const auto x = a.to_f64(), y = b.to_f64();
  for (size_t i = 0; i < x.size(); ++i) CHECK(std::abs(x[i] - y[i]) <= 1e-5 + 1e-4 * std::abs(y[i]));
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("kiln-ckpt-" + std::to_string(::getpid()) + "-" +
                                               std::to_string(reinterpret_cast<uintptr_t>(this)));
  ~TempDir() { fs::remove_all(path); }
};

const CheckpointTensor& find(const Checkpoint& c, const std::string& name) {
  for (const auto& t : c.tensors)
    if (t.name == name) return t;
  FAIL("no tensor " << name);
  return c.tensors.front();
}

}  // namespace

TEST_CASE("a checkpoint saved from tp=2 loads whole and runs on tp=4 and on one rank") {
  const auto trained = mlp(0.5);
  const Tensor want = run_whole(*trained);
  TempDir dir;
  {
    auto saved = checkpoint_from_program(*partitioned(*trained, 2));
    REQUIRE_MESSAGE(saved.ok(), saved.status().message());
    CHECK(sharding_str(find(*saved, "w1").placement) == "<S(0)>");  // column parallel
    CHECK(sharding_str(find(*saved, "b1").placement) == "<S(0)>");
    CHECK(sharding_str(find(*saved, "w2").placement) == "<S(1)>");  // row parallel
    CHECK(find(*saved, "w1").pieces[1].shape() == std::vector<int64_t>{16, 16});
    Status s = write_checkpoint(dir.path.string(), *saved);
    REQUIRE_MESSAGE(s.ok(), s.message());
  }
  CHECK(fs::exists(dir.path / "checkpoint.toml"));
  auto loaded = read_checkpoint(dir.path.string());
  REQUIRE_MESSAGE(loaded.ok(), loaded.status().message());
  CHECK(loaded->mesh == tp(2));
  auto weights = logical_tensors(*loaded);
  REQUIRE_MESSAGE(weights.ok(), weights.status().message());
  CHECK(weights->at("w1").identical(*constant_tensor(trained->node_list()[0]->result())));

  // A model of the same shape with other weights takes the checkpoint's.
  auto fresh = mlp(7.0);
  CHECK_FALSE(constant_tensor(fresh->node_list()[0]->result())->identical(weights->at("w1")));
  std::vector<std::string> missing;
  Status s = load_weights(*fresh, *weights, &missing);
  REQUIRE_MESSAGE(s.ok(), s.message());
  CHECK(missing.empty());
  check_close(run_whole(*fresh), want);
  for (int64_t ranks : {1, 4}) {
    INFO("tp=" << ranks);
    check_close(run_sharded(*partitioned(*fresh, ranks)), want);
  }
}

TEST_CASE("reshard lays a checkpoint out over another mesh by axis name") {
  auto saved = checkpoint_from_program(*partitioned(*mlp(0.5), 2));
  REQUIRE(saved.ok());
  auto whole = logical_tensors(*saved);
  REQUIRE(whole.ok());
  auto four = reshard(*saved, tp(4));
  REQUIRE_MESSAGE(four.ok(), four.status().message());
  CHECK(find(*four, "w1").pieces.size() == 4);
  CHECK(find(*four, "w1").pieces[3].shape() == std::vector<int64_t>{8, 16});
  CHECK(find(*four, "w2").pieces[0].shape() == std::vector<int64_t>{16, 8});
  auto back = logical_tensors(*four);
  REQUIRE(back.ok());
  CHECK(back->at("w2").identical(whole->at("w2")));
  // A mesh without a tp axis holds every tensor whole.
  auto one = reshard(*saved, DeviceMesh{{{"dp", 2}}});
  REQUIRE(one.ok());
  CHECK(sharding_str(find(*one, "w1").placement) == "<R>");
  CHECK(find(*one, "w1").pieces[1].shape() == std::vector<int64_t>{32, 16});
  // w1's 32 output features do not split 64 ways.
  auto bad = reshard(*saved, tp(64));
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("reshard: tensor 'w1' on mesh <tp = 64>") != std::string::npos);
}

TEST_CASE("bad checkpoints and mismatched weights fail clearly") {
  TempDir dir;
  auto missing = read_checkpoint(dir.path.string());
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().message().find("has no checkpoint.toml") != std::string::npos);

  auto saved = checkpoint_from_program(*partitioned(*mlp(0.5), 2));
  REQUIRE(saved.ok());
  REQUIRE(write_checkpoint(dir.path.string(), *saved).ok());
  // A piece of the wrong size.
  const CheckpointTensor& w1 = find(*saved, "w1");
  REQUIRE(write_npy((dir.path / "0-w1.tp1.npy").string(), w1.pieces[0].reshaped({8, 32})).ok());
  auto corrupt = read_checkpoint(dir.path.string());
  REQUIRE_FALSE(corrupt.ok());
  CHECK(corrupt.status().message().find("rank 1's piece is f32[8, 32]") != std::string::npos);

  // Weights of another shape, or for another model.
  auto g = mlp(1.0);
  std::map<std::string, Tensor> wrong = {{"w1", Tensor(DType::kF32, {16, 16})}};
  Status s = load_weights(*g, wrong);
  CHECK(s.message() == "weights: 'w1' is f32[16, 16], the model's %w1 is f32[32, 16]");
  std::map<std::string, Tensor> other = {{"wq", Tensor(DType::kF32, {16, 16})}};
  s = load_weights(*g, other);
  CHECK(s.message().find("'wq' names no constant of @mlp") != std::string::npos);
}
