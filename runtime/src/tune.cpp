// Autotuning plan steps at compile time (kiln_model_step_problem, kiln_model_tune_step): what a
// step's algorithm choice depends on, and timing the candidates on the device.
#include "tune.h"

#include <algorithm>
#include <vector>

#include "model.h"

namespace kiln::rt {

kiln_status* median_launch_ms(cudaStream_t stream, int iterations, const std::function<kiln_status*()>& launch,
                              double* out_ms) {
  std::vector<cudaEvent_t> events(2 * static_cast<size_t>(std::max(iterations, 1)), nullptr);
  kiln_status* st = nullptr;
  for (cudaEvent_t& e : events)
    if (!st) st = cuda_status(cudaEventCreate(&e), "cudaEventCreate");
  // Warm-up: first launches pay for lazy module loading and cache misses.
  for (int i = 0; i < 2 && !st; ++i) st = launch();
  for (size_t i = 0; i < events.size() && !st; i += 2) {
    st = cuda_status(cudaEventRecord(events[i], stream), "cudaEventRecord");
    if (!st) st = launch();
    if (!st) st = cuda_status(cudaEventRecord(events[i + 1], stream), "cudaEventRecord");
  }
  if (!st) st = cuda_status(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<double> ms;
  for (size_t i = 0; i < events.size() && !st; i += 2) {
    float t = 0;
    st = cuda_status(cudaEventElapsedTime(&t, events[i], events[i + 1]), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  for (cudaEvent_t e : events)
    if (e) (void)cudaEventDestroy(e);
  if (st) return st;
  std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
  *out_ms = ms[ms.size() / 2];
  return nullptr;
}

namespace {

kiln_status* check_step(const kiln_model* m, size_t step, const char* function) {
  if (step >= m->steps.size())
    return make_status(KILN_STATUS_INVALID_ARGUMENT, std::string(function) + ": step " + std::to_string(step) +
                                                         " out of range: the plan has " +
                                                         std::to_string(m->steps.size()) + " steps");
  return nullptr;
}

}  // namespace

kiln_status* step_problem(const kiln_model* m, size_t step, std::string* out) {
  KILN_RT_TRY(check_step(m, step, "kiln_model_step_problem"));
  const kiln_model::Step& s = m->steps[step];
  out->clear();
  if (!s.gemm && !s.conv) return nullptr;
  cudaDeviceProp prop{};
  KILN_CUDA_TRY(cudaGetDeviceProperties(&prop, m->runtime->device.ordinal));
  // The best algorithm differs between GPUs of one architecture (SM count, clocks) and
  // between library versions, so both belong to the problem.
  *out = (s.gemm ? s.gemm->problem() : s.conv->problem()) + " device=" + prop.name + " " + m->runtime->device.name +
         " sms=" + std::to_string(prop.multiProcessorCount) +
         (s.gemm ? " cublasLt=" + std::to_string(cublasLtGetVersion())
                 : " cudnn=" + std::to_string(m->cudnn->api().version));
  return nullptr;
}

kiln_status* tune_step(kiln_model* m, size_t step, int max_candidates, int iterations, TuneOutcome* out) {
  const char* fn = "kiln_model_tune_step";
  KILN_RT_TRY(check_step(m, step, fn));
  if (max_candidates < 1 || iterations < 1)
    return make_status(KILN_STATUS_INVALID_ARGUMENT, std::string(fn) + ": max_candidates and iterations must be at "
                                                                       "least 1, got " +
                                                         std::to_string(max_candidates) + " and " +
                                                         std::to_string(iterations));
  *out = {};
  kiln_model::Step& s = m->steps[step];
  if (!s.gemm && !s.conv) return nullptr;
  KILN_RT_TRY(synchronize_model(m, fn));
  KILN_CUDA_TRY(cudaSetDevice(m->runtime->device.ordinal));
  // Zeros rather than whatever the arena held: NaN or denormal garbage must not skew the timing.
  if (m->artifact->plan.arena_bytes)
    KILN_CUDA_TRY(cudaMemsetAsync(m->arena, 0, m->artifact->plan.arena_bytes, m->stream));
  kiln_status* st = s.gemm ? s.gemm->tune(m->cublas, m->workspace, m->workspace_bytes, m->stream, max_candidates,
                                          iterations, out)
                           : s.conv->tune(m->workspace, m->workspace_bytes, m->stream, max_candidates, iterations, out);
  if (st) st->message = std::string(fn) + ": plan:" + std::to_string(m->artifact->plan.steps[step].line) + ": " + st->message;
  return st;
}

}  // namespace kiln::rt
