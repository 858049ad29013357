// Plan `gemm` steps on cuBLASLt: descriptors and algorithm chosen once at load, run per call.
#pragma once

#include <cublasLt.h>

#include <functional>
#include <memory>

#include "kiln/artifact_reader.h"
#include "status.h"
#include "tune.h"

namespace kiln::rt {

/// A device buffer of the plan, resolved at load.
struct DeviceBuffer {
  void* ptr = nullptr;
  uint64_t bytes = 0;
  std::string dtype;
};

/// One prepared gemm: row-major D = alpha * op(A) @ op(B) + beta * C (+ bias, activation),
/// run as the column-major D^T = op(B)^T @ op(A)^T so that no data moves.
class GemmStep {
 public:
  ~GemmStep();
  /// Validates the step's attributes and buffer extents, builds the descriptors and takes the
  /// step's tuned `algo=` when cuBLASLt confirms it fits them and `workspace_bytes` (else notes
  /// once on stderr that it falls back), or asks cuBLASLt's heuristic for an algorithm.
  static kiln_status* create(const artifact::PlanStep& step,
                             const std::function<const DeviceBuffer*(int)>& buffer,
                             cublasLtHandle_t handle, uint64_t workspace_bytes,
                             std::unique_ptr<GemmStep>* out);
  /// Enqueues the matmul on `stream` (capturable in a CUDA graph).
  kiln_status* run(cublasLtHandle_t handle, void* workspace, uint64_t workspace_bytes,
                   cudaStream_t stream) const;
  /// What the algorithm choice depends on, device and library aside (see kiln_model_step_problem).
  const std::string& problem() const { return problem_; }
  /// Times up to `max_candidates` of the heuristic's algorithms (see kiln_model_tune_step).
  kiln_status* tune(cublasLtHandle_t handle, void* workspace, uint64_t workspace_bytes, cudaStream_t stream,
                    int max_candidates, int iterations, TuneOutcome* out) const;

 private:
  GemmStep() = default;
  kiln_status* enqueue(cublasLtHandle_t handle, const cublasLtMatmulAlgo_t& algo, void* workspace,
                       uint64_t workspace_bytes, cudaStream_t stream) const;
  /// Where cuBLASLt has no kernel with a bias-gradient epilogue for the problem: bias_step_
  /// computes buffer `bias` (len elements) as ones[1, k] @ buffer `summed` read as [k, len]
  /// (transposed when `trans`, leading dimension `ld`), after the GEMM.
  kiln_status* separate_bias_grad(const artifact::PlanStep& step, const std::function<const DeviceBuffer*(int)>& buffer_of,
                                  cublasLtHandle_t handle, uint64_t workspace_bytes, int summed, int64_t trans,
                                  int64_t ld, int bias, int64_t len, int64_t k, const std::string& dtype,
                                  int64_t elem_bytes, const std::string& compute);
  cublasLtMatmulPreference_t pref_ = nullptr;  ///< workspace and alignments, for the heuristic
  std::string problem_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t layout_a_ = nullptr, layout_b_ = nullptr, layout_c_ = nullptr,
                         layout_d_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  const void* a_ = nullptr;  ///< cuBLAS's A: the plan's B
  const void* b_ = nullptr;  ///< cuBLAS's B: the plan's A
  const void* c_ = nullptr;
  void* d_ = nullptr;
  float alpha_ = 1, beta_ = 0;
  void* ones_ = nullptr;  ///< the separate bias gradient's ones (device memory this step owns)
  std::unique_ptr<DeviceBuffer> ones_buffer_;
  std::unique_ptr<GemmStep> bias_step_;
};

}  // namespace kiln::rt
