// The cuda-sm80 backend plugin: Ampere's capability table on the shared CUDA lowering.
#include "kiln/cuda/backend.h"
#include "kiln/plugin.h"

namespace {

kiln::Status register_sm80(kiln::Registry& r) {
  kiln::cuda::Capabilities caps;
  caps.plugin = "cuda-sm80";
  caps.version = "0.1.0";
  caps.summary = "NVIDIA Ampere (sm_80) through NVRTC kernels and cuBLASLt";
  caps.sm = 80;
  caps.targets = {"sm_80", "compute_80"};
  caps.fp8 = false;
  caps.tensor_cores = "mma.sync";
  caps.max_smem_per_block = 166912;
  return kiln::cuda::register_backend(r, caps);
}

}  // namespace

KILN_PLUGIN("kiln-backend-cuda-sm80", "0.1.0", register_sm80)
