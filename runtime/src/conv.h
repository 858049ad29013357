// Plan `conv` steps on cuDNN 9's legacy convolution API, loaded with dlopen only when a plan
// has conv steps, so that the runtime loads and runs every other artifact without cuDNN.
#pragma once

#include <cudnn.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "gemm.h"
#include "kiln/artifact_reader.h"
#include "status.h"
#include "tune.h"

namespace kiln::rt {

/// The cuDNN functions the conv steps call, resolved with dlsym.
#define KILN_CUDNN_FUNCTIONS(X)                                                                         \
  X(cudnnGetVersion) X(cudnnGetErrorString) X(cudnnCreate) X(cudnnDestroy) X(cudnnSetStream)            \
  X(cudnnCreateTensorDescriptor) X(cudnnSetTensorNdDescriptor) X(cudnnDestroyTensorDescriptor)          \
  X(cudnnCreateFilterDescriptor) X(cudnnSetFilterNdDescriptor) X(cudnnDestroyFilterDescriptor)          \
  X(cudnnCreateConvolutionDescriptor) X(cudnnSetConvolutionNdDescriptor)                                \
  X(cudnnSetConvolutionGroupCount) X(cudnnSetConvolutionMathType) X(cudnnDestroyConvolutionDescriptor)  \
  X(cudnnCreateActivationDescriptor) X(cudnnSetActivationDescriptor)                                    \
  X(cudnnDestroyActivationDescriptor) X(cudnnFindConvolutionForwardAlgorithmEx)                         \
  X(cudnnConvolutionForward) X(cudnnConvolutionBiasActivationForward) X(cudnnAddTensor)                 \
  X(cudnnActivationForward) X(cudnnGetConvolutionForwardWorkspaceSize)

struct CudnnApi {
#define KILN_CUDNN_POINTER(f) decltype(&::f) f = nullptr;
  KILN_CUDNN_FUNCTIONS(KILN_CUDNN_POINTER)
#undef KILN_CUDNN_POINTER
  size_t version = 0;  ///< cudnnGetVersion(): major * 10000 + minor * 100 + patch
};

/// The library conv steps load: $KILN_CUDNN_LIBRARY when set (tests use it to simulate a
/// machine without cuDNN), else "libcudnn.so.9".
std::string cudnn_library_name();

/// Loads cuDNN once per library name and process (never unloaded; thread-safe). On failure
/// returns nullptr and sets `error` (dlerror's text, a missing symbol, or a version that is not 9).
const CudnnApi* load_cudnn(std::string* error);

/// A cuDNN handle bound to a model's stream.
class CudnnContext {
 public:
  ~CudnnContext();
  /// Loads cuDNN for the plan's first conv `step`; without it the status reads
  /// "plan:LINE: conv needs cuDNN 9 (libcudnn.so.9): <why>".
  static kiln_status* create(const artifact::PlanStep& step, cudaStream_t stream,
                             std::unique_ptr<CudnnContext>* out);
  const CudnnApi& api() const { return *api_; }
  cudnnHandle_t handle() const { return handle_; }

 private:
  CudnnContext() = default;
  const CudnnApi* api_ = nullptr;
  cudnnHandle_t handle_ = nullptr;
};

/// One prepared convolution: y = act(conv(x, w) + z + bias), NCHW (1 to 3 spatial dims).
class ConvStep {
 public:
  ~ConvStep();
  /// Builds the descriptors and takes the step's tuned algo= and algo_math= when cuDNN can run
  /// them in `workspace_bytes` (else notes once on stderr that it falls back), or picks the
  /// fastest algorithm that fits by timing them on the real buffers (this writes y; load time only). With relu and a bias the
  /// step uses cuDNN's fused conv-bias-activation when cuDNN accepts it, else separate calls.
  static kiln_status* create(const artifact::PlanStep& step,
                             const std::function<const DeviceBuffer*(int)>& buffer,
                             const CudnnContext& cudnn, void* workspace, uint64_t workspace_bytes,
                             std::unique_ptr<ConvStep>* out);
  /// Enqueues the convolution on the context's stream (capturable in a CUDA graph).
  kiln_status* run(void* workspace, uint64_t workspace_bytes) const;
  /// What the algorithm choice depends on, device and library aside (see kiln_model_step_problem).
  const std::string& problem() const { return problem_; }
  /// Times each algorithm cuDNN can run here, as run() enqueues it (see kiln_model_tune_step);
  /// the step keeps its own algorithm.
  kiln_status* tune(void* workspace, uint64_t workspace_bytes, cudaStream_t stream, int max_candidates,
                    int iterations, TuneOutcome* out) {
    return time_candidates(workspace, workspace_bytes, stream, max_candidates, iterations, out, false);
  }
  /// Whether the algorithm came from the plan's algo= (autotuned at compile time).
  bool algorithm_from_plan() const { return from_plan_; }
  /// Re-times the first `max_candidates` algorithms of cuDNN's search with warmed-up median
  /// launches and keeps the fastest: cuDNN's search runs each algorithm once, and a first launch
  /// that pays for lazy module loading can rank a slow algorithm first. Load time only (writes y).
  kiln_status* settle(void* workspace, uint64_t workspace_bytes, cudaStream_t stream, int max_candidates,
                      int iterations) {
    TuneOutcome unused;
    return time_candidates(workspace, workspace_bytes, stream, max_candidates, iterations, &unused, true);
  }
  /// The algorithm and math type in use, to share between steps of one problem.
  std::pair<cudnnConvolutionFwdAlgo_t, cudnnMathType_t> algorithm() const { return {algo_, math_}; }
  /// Uses `algo` with `math` (as another step of the same problem settled on).
  kiln_status* use_algorithm(std::pair<cudnnConvolutionFwdAlgo_t, cudnnMathType_t> choice);

 private:
  ConvStep() = default;
  kiln_status* enqueue(bool fused, void* workspace, uint64_t workspace_bytes) const;
  /// tune() and settle(): times candidates; `keep` keeps the fastest, else the step's own algorithm.
  kiln_status* time_candidates(void* workspace, uint64_t workspace_bytes, cudaStream_t stream, int max_candidates,
                               int iterations, TuneOutcome* out, bool keep);
  const CudnnContext* cudnn_ = nullptr;
  cudnnTensorDescriptor_t x_desc_ = nullptr, y_desc_ = nullptr, bias_desc_ = nullptr;
  cudnnFilterDescriptor_t w_desc_ = nullptr;
  cudnnConvolutionDescriptor_t conv_desc_ = nullptr;
  cudnnActivationDescriptor_t act_desc_ = nullptr;
  cudnnConvolutionFwdAlgo_t algo_{};
  cudnnMathType_t math_{};
  bool strict_f32_ = false;  ///< f32 without tf32: FMA math, no FFT or Winograd
  std::string problem_;
  const void *x_ = nullptr, *w_ = nullptr, *z_ = nullptr, *bias_ = nullptr;
  void* y_ = nullptr;
  bool relu_ = false, fused_ = false, from_plan_ = false;
  int line_ = 0;
};

}  // namespace kiln::rt
