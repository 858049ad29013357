// The CUDA backend object: an executable outlives the backend that compiled it.
#include <doctest/doctest.h>

#include "kiln/core/options.h"
#include "kiln/cuda/backend.h"
#include "kiln/ir/text.h"

namespace kiln::cuda {
namespace {

/// A backend "cuda-test" for sm_90a with default options.
std::unique_ptr<Backend> sm90_backend(Registry& r) {
  Capabilities caps;
  caps.plugin = "cuda-test";
  caps.targets = {"sm_90a"};
  caps.max_smem_per_block = 232448;
  REQUIRE(register_backend(r, caps).ok());
  auto info = r.backend("cuda-test");
  REQUIRE(info.ok());
  auto opts = resolve_options((*info)->options, {}, "cuda-test");
  REQUIRE(opts.ok());
  auto backend = (*info)->create(*opts);
  REQUIRE(backend.ok());
  return std::move(*backend);
}

TEST_CASE("an executable runs after its backend is released (a clear error here when there is no GPU)") {
  Registry r;
  auto g = parse_graph("graph @g(%x: f32[4]) -> (f32[4]) {\n  %y = relu(%x) : f32[4]\n  return %y\n}\n");
  REQUIRE(g.ok());
  std::unique_ptr<Executable> exe;
  {
    auto compiled = sm90_backend(r)->compile(**g);
    REQUIRE(compiled.ok());
    exe = std::move(*compiled);
  }  // the backend is gone; the executable builds its artifact on first run from its own copy
  const Tensor x = Tensor::from_f64(DType::kF32, {4}, std::vector<double>{-1, 2, -3, 4});
  auto y = exe->run({&x, 1});
  if (y.ok()) {
    CHECK((*y)[0].get_f64(1) == 2);
    CHECK((*y)[0].get_f64(0) == 0);
  } else {
    // Without a GPU the artifact still builds (NVRTC); loading it names the missing device.
    CHECK(y.status().message().find("cuda-test: no CUDA device") == 0);
  }
}

TEST_CASE("option images picks the kernel images an executable builds; a target the plugin lacks is refused by name") {
  Registry r;
  Capabilities caps;
  caps.plugin = "cuda-test";
  caps.targets = {"sm_90a", "compute_90"};
  REQUIRE(register_backend(r, caps).ok());
  auto info = r.backend("cuda-test");
  REQUIRE(info.ok());
  auto bad = resolve_options((*info)->options, {{"images", std::vector<std::string>{"compute_90", "sm_75"}}}, "cuda-test");
  REQUIRE(bad.ok());
  auto refused = (*info)->create(*bad);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message() ==
        "cuda-test: option images names 'sm_75', not one of its targets (sm_90a, compute_90)");
  auto ptx = resolve_options((*info)->options, {{"images", std::vector<std::string>{"compute_90"}}}, "cuda-test");
  REQUIRE(ptx.ok());
  auto backend = (*info)->create(*ptx);
  REQUIRE(backend.ok());
  auto g = parse_graph("graph @g(%x: f32[4]) -> (f32[4]) {\n  %y = relu(%x) : f32[4]\n  return %y\n}\n");
  REQUIRE(g.ok());
  auto exe = (*backend)->compile(**g);
  REQUIRE(exe.ok());
  const Tensor x = Tensor::from_f64(DType::kF32, {4}, std::vector<double>{-1, 2, -3, 4});
  auto y = (*exe)->run({&x, 1});
  if (y.ok()) CHECK((*y)[0].get_f64(1) == 2);  // the GPU ran the PTX image
  else CHECK(y.status().message().find("cuda-test: no CUDA device") == 0);
}

TEST_CASE("variable state: inits before any run, written values checked and kept, the device's after runs") {
  Registry r;
  // Each run returns the counter plus x and adds x to it.
  auto g = parse_graph(R"(graph @g(%x: f32[2]) -> (f32[2]) {
  %c = variable() {init = dense<f32[2]>[1.0, 2.0], name = "counter"} : f32[2]
  %y = add(%c, %x) : f32[2]
  assign(%y) {name = "counter"}
  return %y
}
)");
  REQUIRE(g.ok());
  auto exe = sm90_backend(r)->compile(**g);
  REQUIRE(exe.ok());
  auto before = (*exe)->read_state();
  REQUIRE_MESSAGE(before.ok(), before.status().message());
  REQUIRE(before->size() == 1);
  CHECK(before->at("counter").get_f64(1) == 2);

  CHECK((*exe)->write_state({{"count", Tensor::from_f64(DType::kF32, {2}, std::vector<double>{0, 0})}}).message() ==
        "cuda-test: the graph has no variable 'count'");
  CHECK((*exe)->write_state({{"counter", Tensor::from_f64(DType::kF32, {3}, std::vector<double>{0, 0, 0})}}).message() ==
        "cuda-test: variable 'counter' is f32[2], the value given is f32[3]");
  REQUIRE((*exe)->write_state({{"counter", Tensor::from_f64(DType::kF32, {2}, std::vector<double>{10, 20})}}).ok());
  auto written = (*exe)->read_state();
  REQUIRE(written.ok());
  CHECK(written->at("counter").get_f64(0) == 10);  // kept for the model the first run builds

  const Tensor x = Tensor::from_f64(DType::kF32, {2}, std::vector<double>{1, 1});
  auto y = (*exe)->run({&x, 1});
  if (!y.ok()) {
    CHECK(y.status().message().find("cuda-test: no CUDA device") == 0);
    return;
  }
  CHECK((*y)[0].get_f64(0) == 11);  // the first run started from the written state
  REQUIRE((*exe)->run({&x, 1}).ok());
  auto after = (*exe)->read_state();
  REQUIRE_MESSAGE(after.ok(), after.status().message());
  CHECK(after->at("counter").get_f64(0) == 12);  // read from the device
  CHECK(after->at("counter").get_f64(1) == 22);
  // A write after runs lands in the loaded model's device memory.
  REQUIRE((*exe)->write_state({{"counter", Tensor::from_f64(DType::kF32, {2}, std::vector<double>{-5, 5})}}).ok());
  auto z = (*exe)->run({&x, 1});
  REQUIRE(z.ok());
  CHECK((*z)[0].get_f64(0) == -4);
  CHECK((*z)[0].get_f64(1) == 6);
}

TEST_CASE("a weight's low-precision copy follows the weight through write_state, before and after runs") {
  Registry r;
  // Each run returns the bf16 copy and adds x to the weight; the copy is assigned its cast.
  auto g = parse_graph(R"(graph @g(%x: f32[2]) -> (f32[2]) {
  %c = variable() {init = dense<bf16[2]>[1.0, 2.0], name = "w.bf16", copy_of = "w"} : bf16[2]
  %w = variable() {init = dense<f32[2]>[1.0, 2.0], name = "w"} : f32[2]
  %y = cast(%c) {to = f32} : f32[2]
  %n = add(%w, %x) : f32[2]
  %nc = cast(%n) {to = bf16} : bf16[2]
  assign(%n) {name = "w"}
  assign(%nc) {name = "w.bf16"}
  return %y
}
)");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto exe = sm90_backend(r)->compile(**g);
  REQUIRE(exe.ok());
  CHECK((*exe)->write_state({{"w.bf16", Tensor::from_f64(DType::kBF16, {2}, std::vector<double>{0, 0})}}).message() ==
        "cuda-test: variable 'w.bf16' is the bf16 copy of weight 'w' that the training step keeps; set 'w' and the "
        "copy follows");
  // 1 + 2^-9 rounds to 1 in bf16: the copy is the weight's cast, not its value.
  REQUIRE((*exe)->write_state({{"w", Tensor::from_f64(DType::kF32, {2}, std::vector<double>{1 + 0x1p-9, 3})}}).ok());
  auto state = (*exe)->read_state();
  REQUIRE(state.ok());
  CHECK(state->at("w.bf16").get_f64(0) == 1);
  CHECK(state->at("w.bf16").get_f64(1) == 3);
  const Tensor x = Tensor::from_f64(DType::kF32, {2}, std::vector<double>{1, 1});
  auto y = (*exe)->run({&x, 1});
  if (!y.ok()) {
    CHECK(y.status().message().find("cuda-test: no CUDA device") == 0);
    return;
  }
  CHECK((*y)[0].get_f64(1) == 3);  // the first run read the refreshed copy
  // A write after runs refreshes the loaded model's copy too (the runtime rounds it on the host).
  REQUIRE((*exe)->write_state({{"w", Tensor::from_f64(DType::kF32, {2}, std::vector<double>{-5, 5})}}).ok());
  auto z = (*exe)->run({&x, 1});
  REQUIRE(z.ok());
  CHECK((*z)[0].get_f64(0) == -5);
  CHECK((*z)[0].get_f64(1) == 5);
  auto after = (*exe)->read_state();
  REQUIRE(after.ok());
  CHECK(after->at("w.bf16").get_f64(0) == -4);  // the step's own assign of the copy
}

}  // namespace
}  // namespace kiln::cuda
