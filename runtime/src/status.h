// kiln_status internals: building statuses (code + message), from CUDA and cuBLASLt errors too.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kiln/runtime.h"

/// The status object behind the C API's opaque kiln_status.
struct kiln_status {
  kiln_status_code code;
  std::string message;
};

namespace kiln::rt {

/// A failure; nullptr is success. The caller owns the result.
kiln_status* make_status(kiln_status_code code, std::string message);

/// nullptr on cudaSuccess, else DEVICE_ERROR (OUT_OF_MEMORY for cudaErrorMemoryAllocation)
/// "NAME failed: cudaErrorX (description)", NAME being `call` up to its first '('. Clears the
/// thread's last error, which would otherwise resurface in an unrelated later check.
kiln_status* cuda_status(cudaError_t err, const char* call);
/// nullptr on CUBLAS_STATUS_SUCCESS, else DEVICE_ERROR "NAME failed: CUBLAS_STATUS_X (...)".
kiln_status* cublas_status(cublasStatus_t st, const char* call);

/// "1.50 GiB (1610612736 bytes)": readable and exact.
std::string format_bytes(uint64_t bytes);

}  // namespace kiln::rt

/// Returns the status of `expr` from the enclosing function when it is a failure.
#define KILN_RT_TRY(expr)                                                \
  do {                                                                   \
    if (kiln_status* kiln_rt_status_ = (expr)) return kiln_rt_status_;   \
  } while (0)
/// Runs a CUDA runtime call and returns a DEVICE_ERROR naming it when it fails.
#define KILN_CUDA_TRY(call) KILN_RT_TRY(::kiln::rt::cuda_status((call), #call))
/// Runs a cuBLASLt call and returns a DEVICE_ERROR naming it when it fails.
#define KILN_CUBLAS_TRY(call) KILN_RT_TRY(::kiln::rt::cublas_status((call), #call))
