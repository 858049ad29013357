// The cuda-sm100 backend plugin: Blackwell's capability table on the shared CUDA lowering.
#include "kiln/cuda/backend.h"
#include "kiln/plugin.h"

namespace {

kiln::Status register_sm100(kiln::Registry& r) {
  kiln::cuda::Capabilities caps;
  caps.plugin = "cuda-sm100";
  caps.version = "0.1.0";
  caps.summary = "NVIDIA Blackwell (sm_100) through NVRTC kernels and cuBLASLt";
  caps.sm = 100;
  caps.targets = {"sm_100a", "compute_100"};
  caps.fp8 = true;
  caps.tensor_cores = "tcgen05";
  caps.max_smem_per_block = 232448;
  return kiln::cuda::register_backend(r, caps);
}

}  // namespace

KILN_PLUGIN("kiln-backend-cuda-sm100", "0.1.0", register_sm100)
