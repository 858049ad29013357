// kiln_status: construction helpers and the C accessors.
#include "status.h"

#include <cstdio>

namespace kiln::rt {

kiln_status* make_status(kiln_status_code code, std::string message) {
  return new kiln_status{code, std::move(message)};
}

namespace {
/// "cudaMemcpyAsync(dst, src, n, kind, s)" → "cudaMemcpyAsync": the macros pass the whole call.
std::string call_name(const char* call) {
  std::string s(call);
  return s.substr(0, s.find('('));
}
}  // namespace

kiln_status* cuda_status(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return nullptr;
  // Non-sticky errors stay as the thread's "last error" otherwise and would surface in an
  // unrelated later check.
  (void)cudaGetLastError();
  kiln_status_code code =
      err == cudaErrorMemoryAllocation ? KILN_STATUS_OUT_OF_MEMORY : KILN_STATUS_DEVICE_ERROR;
  return make_status(code, call_name(call) + " failed: " + cudaGetErrorName(err) + " (" +
                               cudaGetErrorString(err) + ")");
}

kiln_status* cublas_status(cublasStatus_t st, const char* call) {
  if (st == CUBLAS_STATUS_SUCCESS) return nullptr;
  kiln_status_code code =
      st == CUBLAS_STATUS_ALLOC_FAILED ? KILN_STATUS_OUT_OF_MEMORY : KILN_STATUS_DEVICE_ERROR;
  return make_status(code, call_name(call) + " failed: " + cublasLtGetStatusName(st) + " (" +
                               cublasLtGetStatusString(st) + ")");
}

std::string format_bytes(uint64_t bytes) {
  static const char* const kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 4) {
    v /= 1024.0;
    ++unit;
  }
  if (unit == 0) return std::to_string(bytes) + " bytes";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s (%llu bytes)", v, kUnits[unit],
                static_cast<unsigned long long>(bytes));
  return buf;
}

}  // namespace kiln::rt

extern "C" {

kiln_status_code kiln_status_get_code(const kiln_status* status) {
  return status ? status->code : KILN_STATUS_OK;
}

const char* kiln_status_get_message(const kiln_status* status) {
  return status ? status->message.c_str() : "ok";
}

void kiln_status_release(kiln_status* status) { delete status; }

}  // extern "C"
