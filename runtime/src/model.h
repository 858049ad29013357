// The runtime and model objects behind the C API's opaque handles.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "allocator.h"
#include "comm.h"
#include "conv.h"
#include "device.h"
#include "gemm.h"
#include "kiln/artifact_reader.h"
#include "kiln/distributed.h"
#include "kiln/runtime.h"
#include "rank_layout.h"

/// One device and its caching allocator; shared by the models loaded on it (thread-safe).
/// Each model holds a reference, so the host may release runtime and models in any order.
struct kiln_runtime {
  kiln_runtime_options options{};
  kiln::rt::DeviceInfo device;
  std::unique_ptr<kiln::rt::CachingAllocator> allocator;
  std::atomic<int> references{1};

  /// Drops one reference; the last one deletes the runtime.
  void unref() {
    if (references.fetch_sub(1) == 1) delete this;
  }
};

/// A loaded artifact: device-resident weights, the arena, prepared steps and, with CUDA
/// graphs on, the captured plan. Runs one call at a time.
struct kiln_model {
  /// A plan step ready to enqueue: everything resolved at load.
  struct Step {
    kiln::artifact::PlanStep::Kind kind;
    // launch
    cudaKernel_t kernel = nullptr;
    dim3 grid, block;
    uint32_t smem = 0;
    std::vector<uint64_t> arg_values;  ///< one 8-byte slot per kernel parameter
    std::vector<void*> arg_ptrs;       ///< into arg_values, as cudaLaunchKernel wants
    // gemm
    std::unique_ptr<kiln::rt::GemmStep> gemm;
    // conv
    std::unique_ptr<kiln::rt::ConvStep> conv;
    // collective
    std::unique_ptr<kiln::rt::CollectiveStep> collective;
    // copy, memset
    void* dst = nullptr;
    const void* src = nullptr;
    uint64_t bytes = 0;
  };
  /// A graph input or output: its arena buffer and its slot in pinned staging.
  struct Binding {
    kiln_tensor_info info{};
    void* device = nullptr;
    uint64_t staging_offset = 0;
  };

  kiln_runtime* runtime = nullptr;
  std::unique_ptr<kiln::artifact::Artifact> artifact;
  std::string image_name;   ///< the chosen image, empty when the plan launches no kernels
  std::string image_bytes;  ///< NUL-terminated copy: PTX must be a C string
  cudaLibrary_t library = nullptr;
  void* weights = nullptr;
  void* arena = nullptr;
  void* workspace = nullptr;
  uint64_t workspace_bytes = 0;
  std::vector<kiln::rt::DeviceBuffer> buffers;  ///< by plan buffer id
  std::vector<Binding> inputs, outputs;
  std::vector<Binding> variables;  ///< the plan's variables: weight buffers it writes (copy steps or in place)
  /// Per variable: the index of the variable it is a low-precision copy of (the plan's
  /// copy_of), or -1. A copy follows its weight: see copy_variable.
  std::vector<int> copy_of;
  /// Per variable that is a copy, since its weight was last written: kCopyWritable (it may be
  /// written too), kCopyStale (it must be, before the next run); kCopyIdle otherwise.
  enum CopyState : uint8_t { kCopyIdle, kCopyWritable, kCopyStale };
  std::vector<CopyState> copy_state;
  unsigned char* staging = nullptr;  ///< pinned host memory for every input and output
  uint64_t staging_bytes = 0;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t cublas = nullptr;
  std::unique_ptr<kiln::rt::CudnnContext> cudnn;  ///< only when the plan has conv steps
  std::vector<Step> steps;
  cudaGraphExec_t graph = nullptr;  ///< with enable_timing: the steps only, copies apart
  cudaEvent_t steps_begin = nullptr, steps_end = nullptr;  ///< with enable_timing
  /// With enable_timing: the module of the two kernels below (model.cpp's kTimingPtx).
  cudaLibrary_t timing_library = nullptr;
  /// A one-thread kernel that waits lead_ns on the device before steps_begin (see launch in
  /// model.cpp); null when KILN_TIMING_LEAD_US=0.
  cudaKernel_t lead_kernel = nullptr;
  unsigned long long lead_ns = 0;
  /// With KILN_TIMING_FLUSH_L2=1: twice the L2's size, zeroed once and read by l2_sweep before
  /// each timed run, so the steps start with a cold L2 (none of their inputs left there by the
  /// copies) and no dirty lines.
  void* l2_flush = nullptr;
  unsigned long long l2_flush_bytes = 0;
  cudaKernel_t l2_sweep = nullptr;
  bool timed = false;  ///< a run bracketed by the events has completed
  /// The caller's output buffers of the run enqueued and not yet synchronized.
  std::vector<kiln_host_tensor> pending_outputs;
  bool pending = false;
  /// kiln_model_run_device: the steps alone as a CUDA graph (made on first use when `graph`
  /// holds the staging copies too), and the events ordering the model's stream after the
  /// caller's and the caller's after the run.
  cudaGraphExec_t steps_graph = nullptr;
  cudaEvent_t caller_ready = nullptr, device_done = nullptr;

  /// Per-rank plans (docs/artifact.md "mesh"): this process's rank, its coordinates on the
  /// mesh (empty for a single-device plan), and the weights it keeps on the device.
  int rank = 0, world_size = 1;
  std::vector<int64_t> coords;
  kiln::rt::WeightLayout weight_layout;
  uint64_t weights_bytes = 0;  ///< device bytes of `weights`
  /// Distributed loads: the communicators, the watchdog of every run, the event that ends a
  /// run, and the plan's collective steps in order (the watchdog names the one a run stalls in).
  std::unique_ptr<kiln::rt::Communicators> comms;
  std::unique_ptr<kiln::rt::Watchdog> watchdog;
  cudaEvent_t run_done = nullptr;
  std::vector<const kiln::rt::CollectiveStep*> collectives;
  std::chrono::milliseconds collective_timeout{0};
  std::string rank_text;  ///< "rank 1 of 2" for messages

  ~kiln_model();
};

namespace kiln::rt {

/// Restores the calling thread's current CUDA device on scope exit: the runtime switches to
/// its own device, the host's choice must survive the call.
class DeviceGuard {
 public:
  DeviceGuard() { saved_ = cudaGetDevice(&device_) == cudaSuccess; }
  ~DeviceGuard() {
    if (saved_) (void)cudaSetDevice(device_);
    (void)cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_ = 0;
  bool saved_ = false;
};

/// How a distributed load joins its run (see kiln_model_load_file_distributed).
struct DistributedSetup {
  dist::LaunchInfo launch;
  std::chrono::milliseconds collective_timeout{300'000}, bootstrap_timeout{300'000};
};

/// Who this process is for `plan`: from the launcher's environment or the options' fields,
/// checked against the plan's mesh (world size) and the runtime's device (the local rank's). An
/// artifact of per-rank programs (`name` in messages) is replaced by this rank's program.
kiln_status* distributed_setup(const kiln_runtime* runtime, std::unique_ptr<artifact::Artifact>& artifact,
                               const std::string& name, const kiln_distributed_options& options,
                               DistributedSetup* out);

/// Loads a validated artifact onto the runtime's device (see kiln_model_load_file); with
/// `dist`, as one rank of a distributed run (kiln_model_load_file_distributed).
kiln_status* load_model(kiln_runtime* runtime, std::unique_ptr<artifact::Artifact> artifact,
                        kiln_model** out, const DistributedSetup* dist = nullptr);
/// Waits for the work queued on the model's stream: under the watchdog when the model has
/// communicators (so a stalled collective fails instead of hanging), else by synchronizing.
kiln_status* finish_stream(kiln_model* model, const std::string& what);
/// See kiln_model_all_gather_host.
kiln_status* all_gather_host(kiln_model* model, const void* send, uint64_t bytes, void* recv);
/// Starts a run (see kiln_model_enqueue).
kiln_status* enqueue_model(kiln_model* model, const kiln_host_tensor* inputs, size_t num_inputs,
                           kiln_host_tensor* outputs, size_t num_outputs, const char* function);
/// Runs on device buffers in the order of `caller` (see kiln_model_run_device).
kiln_status* run_device(kiln_model* model, const kiln_device_tensor* inputs, size_t num_inputs,
                        const kiln_device_tensor* outputs, size_t num_outputs, cudaStream_t caller);
/// Copies variable `index` to or from host memory after the pending run (see
/// kiln_model_read_variable, kiln_model_write_variable). Writing a weight refreshes its bf16/f16
/// copies from the same bytes and marks other copies stale; a copy is written only after its
/// weight, and a run refuses stale copies (check_copies).
kiln_status* check_copies(kiln_model* model, const char* function);
kiln_status* copy_variable(kiln_model* model, size_t index, void* read_to, const void* write_from, uint64_t bytes,
                           const char* function);
/// Completes the pending run, if any (see kiln_model_synchronize).
kiln_status* synchronize_model(kiln_model* model, const char* function);
/// The device time of the last timed run (see kiln_model_device_time).
kiln_status* model_device_time(const kiln_model* model, double* out_ms);
/// Per-step device times (see kiln_model_profile_steps).
kiln_status* profile_steps(kiln_model* model, int iterations, double* out_step_ms, size_t capacity);
/// Maps a Kiln dtype name ("f32") to kiln_dtype; false when unknown.
bool dtype_from_name(const std::string& name, kiln_dtype* out);

}  // namespace kiln::rt
