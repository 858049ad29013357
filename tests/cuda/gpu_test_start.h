// The start every CUDA GPU test binary shares: skip without a GPU, then load the plugins.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>

#include "kiln/core/driver.h"

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

}  // namespace kiln
