// NCCL in the runtime: a model's communicators (the world's and one per mesh axis), its
// collective plan steps, and the watchdog that turns a stalled or failed collective into an
// error instead of a hang (non-blocking communicators, ncclCommAbort).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gemm.h"
#include "kiln/artifact_reader.h"
#include "kiln/distributed.h"
#include "status.h"

namespace kiln::rt {

using Deadline = std::chrono::steady_clock::time_point;

/// A model's NCCL communicators. All are non-blocking (ncclConfig_t blocking = 0), so no NCCL
/// call can hold a thread forever: a call that returns ncclInProgress is polled until it is
/// done, an error, or past its deadline, and then every communicator is aborted.
/// Thread-safety: one thread issues calls; abort() and async_error() may come from another.
class Communicators {
 public:
  /// Joins the world `launch` describes on `device` (rank 0 makes NCCL's unique id and hands
  /// it to the others over TCP, dist::exchange_unique_id), then makes one communicator per
  /// mesh axis with ncclCommSplit: color = the rank's coordinates on the other axes, key = its
  /// coordinate on the axis, so a rank's position in its group is that coordinate. An axis
  /// spanning every rank uses the world's communicator. Each stage waits at most `timeout`.
  static kiln_status* create(const dist::LaunchInfo& launch,
                             const std::vector<artifact::MeshAxis>& mesh, int device,
                             std::chrono::milliseconds timeout,
                             std::unique_ptr<Communicators>* out);
  ~Communicators();
  Communicators(const Communicators&) = delete;
  Communicators& operator=(const Communicators&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  ncclComm_t world() const { return world_; }
  /// The communicator of mesh axis `index`.
  ncclComm_t axis(size_t index) const { return axes_[index]; }

  /// Completes the NCCL call on `comm` that returned `issued`: polls while it is in progress.
  /// On an error, or when `deadline` passes, aborts every communicator and returns a
  /// COLLECTIVE_FAILED status saying what (`what`) failed and why.
  kiln_status* settle(ncclComm_t comm, ncclResult_t issued, Deadline deadline,
                      const std::string& what);
  /// The first asynchronous error of any communicator, as a message; "" while none (or after
  /// abort).
  std::string async_error();
  /// Aborts every communicator once (NCCL kernels waiting on them exit); later calls do nothing.
  void abort();
  bool aborted() const { return aborted_.load(); }

 private:
  Communicators() = default;
  /// The distinct communicators, axes first, the world last.
  std::vector<ncclComm_t> all() const;

  int rank_ = 0, world_size_ = 1;
  ncclComm_t world_ = nullptr;
  std::vector<ncclComm_t> axes_;
  std::atomic<bool> aborted_{false};
  std::mutex mu_;  // abort() against async_error() from the watchdog
};

/// One `step collective` of a plan, resolved at load: its communicator, buffers, NCCL type
/// and an event recorded right after it, which tells the watchdog whether a stalled run got
/// past it. Reductions use the buffers' NCCL type; the other ops move bytes.
class CollectiveStep {
 public:
  /// `index`: the step's position in the plan (for messages).
  static kiln_status* create(const artifact::PlanStep& step, size_t index,
                             const std::function<const DeviceBuffer*(int)>& buffer,
                             const Communicators& comms,
                             const std::vector<artifact::MeshAxis>& mesh,
                             std::unique_ptr<CollectiveStep>* out);
  ~CollectiveStep();
  CollectiveStep(const CollectiveStep&) = delete;
  CollectiveStep& operator=(const CollectiveStep&) = delete;

  /// Enqueues the collective and its event on `stream` (capturable in a CUDA graph). A call
  /// NCCL does not complete before `deadline` aborts the communicators.
  kiln_status* enqueue(Communicators& comms, cudaStream_t stream, Deadline deadline) const;
  /// "step 3 (plan line 21): all_reduce over mesh axis 'tp' of 1048576 f32"
  const std::string& label() const { return label_; }
  cudaEvent_t done() const { return done_; }

 private:
  CollectiveStep() = default;
  std::string op_, label_;
  ncclComm_t comm_ = nullptr;
  const void* x_ = nullptr;
  void* y_ = nullptr;
  size_t count_ = 0;        ///< elements for reductions; bytes per rank for the other ops
  size_t block_bytes_ = 0;  ///< all_to_all: bytes sent to each peer
  ncclDataType_t type_ = ncclUint8;
  ncclRedOp_t reduce_ = ncclSum;
  int root_ = 0;   ///< broadcast: group position; send, recv: the peer's rank
  int group_ = 1;  ///< ranks of the axis' group
  cudaEvent_t done_ = nullptr;
};

/// Watches the runs of a model with communicators. A thread polls, every few milliseconds
/// while a run is pending, the run's completion event and every communicator's asynchronous
/// error; when NCCL reports an error, or the run is not done `timeout` after it was armed, it
/// aborts the communicators (so the NCCL kernels exit) and records why, naming the first
/// collective step the run had not finished. wait() returns that failure instead of blocking.
class Watchdog {
 public:
  Watchdog(Communicators& comms, int device, std::chrono::milliseconds timeout);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Starts watching a run whose device work ends with `done`; `steps` are the plan's
  /// collective steps in order (they must outlive the run). `what` names the work when no
  /// step is found unfinished ("the host all-gather").
  void arm(cudaEvent_t done, const std::vector<const CollectiveStep*>* steps,
           const std::string& rank_text, const std::string& what = "a collective step");
  /// Waits for the armed run: nullptr when its device work completed; COLLECTIVE_FAILED when
  /// the watchdog aborted it (prefixed with `function`); a CUDA error from the device.
  kiln_status* wait(const std::string& function);
  /// Why the communicators were aborted ("" while they were not).
  std::string failure();
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  void loop(int device);

  Communicators& comms_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, armed_ = false;
  cudaEvent_t done_ = nullptr;
  const std::vector<const CollectiveStep*>* steps_ = nullptr;
  std::string rank_text_, what_;
  Deadline started_;
  std::string failure_;
  std::atomic<bool> failed_{false};
  std::thread thread_;
};

}  // namespace kiln::rt
