// The cuda-sm90 backend plugin: Hopper's capability table on the shared CUDA lowering.
#include "kiln/cuda/backend.h"
#include "kiln/plugin.h"

namespace {

kiln::Status register_sm90(kiln::Registry& r) {
  kiln::cuda::Capabilities caps;
  caps.plugin = "cuda-sm90";
  caps.version = "0.1.0";
  caps.summary = "NVIDIA Hopper (sm_90) through NVRTC kernels and cuBLASLt";
  caps.sm = 90;
  caps.targets = {"sm_90a", "compute_90"};
  caps.fp8 = true;
  caps.tensor_cores = "wgmma";
  caps.max_smem_per_block = 232448;
  return kiln::cuda::register_backend(r, caps);
}

}  // namespace

KILN_PLUGIN("kiln-backend-cuda-sm90", "0.1.0", register_sm90)
