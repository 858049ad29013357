// The CUDA backend object: an executable outlives the backend that compiled it.
#include <doctest/doctest.h>

#include "kiln/core/options.h"
#include "kiln/cuda/backend.h"
#include "kiln/ir/text.h"

namespace kiln::cuda {
namespace {

TEST_CASE("an executable runs after its backend is released (a clear error here when there is no GPU)") {
  Registry r;
  Capabilities caps;
  caps.plugin = "cuda-test";
  caps.targets = {"sm_90a"};
  caps.max_smem_per_block = 232448;
  REQUIRE(register_backend(r, caps).ok());
  auto info = r.backend("cuda-test");
  REQUIRE(info.ok());
  auto opts = resolve_options((*info)->options, {}, "cuda-test");
  REQUIRE(opts.ok());
  auto g = parse_graph("graph @g(%x: f32[4]) -> (f32[4]) {\n  %y = relu(%x) : f32[4]\n  return %y\n}\n");
  REQUIRE(g.ok());
  std::unique_ptr<Executable> exe;
  {
    auto backend = (*info)->create(*opts);
    REQUIRE(backend.ok());
    auto compiled = (*backend)->compile(**g);
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

}  // namespace
}  // namespace kiln::cuda
