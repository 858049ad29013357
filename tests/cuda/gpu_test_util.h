// What the CUDA GPU test binaries share: skipping without a GPU, loading the plugins, running a
// graph on the reference and cuda-sm90 backends side by side, reporting each case; the
// comparisons themselves are tensor_compare.h's (one comparator for every GPU test).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <functional>
#include <map>
#include <string>

#include "kiln/core/driver.h"
#include "kiln/ir/text.h"
#include "tensor_compare.h"

namespace kiln {

/// 77 (ctest's skip code) with a message when there is no GPU, 1 when the plugins in
/// KILN_PLUGIN_DIR do not load, 0 when the test can run. Without a driver
/// cudaGetDeviceCount reports cudaErrorInsufficientDriver, not cudaErrorNoDevice.
inline int start_gpu_test() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || (e == cudaSuccess && devices == 0)) {
    std::printf("SKIP: no GPU (cudaGetDeviceCount: %s)\n", e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
    return 77;
  }
  if (Status s = load_plugins_from({KILN_PLUGIN_DIR}, Registry::global(), false); !s.ok()) {
    std::printf("FAIL: loading plugins: %s\n", s.message().c_str());
    return 1;
  }
  return 0;
}

/// Checks one output against the reference's: "" when it passes, else why not.
using OutputCheck = std::function<std::string(const Tensor& want, const Tensor& got)>;

/// Runs the .kir graph `text` on `reference` and on `cuda-sm90` (with `cuda_options`, e.g. the
/// images it builds) with the `given` inputs and random ones drawn with `seed` for the rest, and
/// checks every output with `check`; "" when all pass, else why not.
inline std::string gpu_matches_reference(const std::string& text, const std::string& source, uint64_t seed,
                                         const OutputCheck& check, std::map<std::string, Tensor> given = {},
                                         Options cuda_options = {}) {
  auto g = parse_graph(text, source);
  if (!g.ok()) return g.status().message();
  InputBindings b;
  b.given = std::move(given);
  b.random = true;
  b.seed = seed;
  auto inputs = bind_inputs(**g, b);
  if (!inputs.ok()) return inputs.status().message();
  const Registry& reg = Registry::global();
  auto want = compile_and_run(**g, StageSpec{"reference", {}, {}}, reg, *inputs);
  if (!want.ok()) return "reference: " + want.status().message();
  auto got = compile_and_run(**g, StageSpec{"cuda-sm90", std::move(cuda_options), {}}, reg, *inputs);
  if (!got.ok()) return got.status().message();
  for (size_t i = 0; i < want->size(); ++i)
    if (std::string why = check((*want)[i], (*got)[i]); !why.empty()) return "output " + std::to_string(i) + ": " + why;
  return "";
}

/// Prints "PASS name" or "FAIL name: why"; returns 1 for a failure, 0 for a pass.
inline int report_case(const std::string& name, const std::string& why) {
  std::printf("%s %s%s%s\n", why.empty() ? "PASS" : "FAIL", name.c_str(), why.empty() ? "" : ": ", why.c_str());
  return why.empty() ? 0 : 1;
}

}  // namespace kiln
