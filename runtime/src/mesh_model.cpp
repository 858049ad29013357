// The distributed side of a model: who this process is for a per-rank plan (launcher or
// options, checked against the mesh and the device), and the host all-gather.
#include <cmath>
#include <cstring>

#include "model.h"

namespace kiln::rt {
namespace {

kiln_status* invalid(std::string msg) {
  return make_status(KILN_STATUS_INVALID_ARGUMENT, std::move(msg));
}

/// Seconds as milliseconds; false unless finite and positive (at most a day).
bool timeout_ms(double s, std::chrono::milliseconds* out) {
  if (!std::isfinite(s) || s <= 0 || s > 86400) return false;
  *out = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(s * 1000.0)));
  return true;
}

}  // namespace

kiln_status* distributed_setup(const kiln_runtime* runtime, std::unique_ptr<artifact::Artifact>& artifact,
                               const std::string& name, const kiln_distributed_options& o, DistributedSetup* out) {
  DistributedSetup d;
  // An artifact of per-rank programs (a pipeline): the rank picks its own once it knows who it is.
  const bool per_rank_programs = !artifact->rank_programs.empty();
  const artifact::Plan& outer = artifact->plan;
  const int64_t ranks = per_rank_programs ? static_cast<int64_t>(artifact->rank_programs.size())
                                          : artifact::mesh_ranks(outer);
  const std::string mesh = per_rank_programs ? std::to_string(ranks) + " ranks (one artifact holding each rank's program)"
                           : outer.mesh.empty() ? std::string("a single device")
                                                : "a mesh of " + std::to_string(ranks) + " rank" +
                                                      (ranks == 1 ? "" : "s") + " (" +
                                                      artifact::mesh_text(outer) + ")";
  if (!timeout_ms(o.collective_timeout_s, &d.collective_timeout))
    return invalid("collective_timeout_s must be a positive number of seconds up to 86400, got " +
                   std::to_string(o.collective_timeout_s));
  if (!timeout_ms(o.bootstrap_timeout_s, &d.bootstrap_timeout))
    return invalid("bootstrap_timeout_s must be a positive number of seconds up to 86400, got " +
                   std::to_string(o.bootstrap_timeout_s));
  std::string source;
  if (o.from_environment) {
    std::string error;
    switch (dist::find_launch(&d.launch, &error)) {
      case dist::LaunchFound::kError: return invalid(error);
      case dist::LaunchFound::kFound: source = " (" + d.launch.launcher + ")"; break;
      case dist::LaunchFound::kNone:
        if (ranks > 1)
          return invalid("the plan runs on " + mesh +
                         ", but no launcher started this process as one of its ranks: "
                         "start one process per rank, e.g. `kiln launch -n " +
                         std::to_string(ranks) +
                         " -- kiln run ...` on one host, or torchrun --nproc-per-node " +
                         std::to_string(ranks) + ", srun -n " + std::to_string(ranks) +
                         ", mpirun -n " + std::to_string(ranks) +
                         " (each process needs RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
                         "MASTER_PORT, or its "
                         "launcher's own variables)");
        d.launch = dist::LaunchInfo{};  // one rank, alone
        break;
    }
  } else {
    dist::LaunchInfo& l = d.launch;
    l.rank = o.rank;
    l.world_size = o.world_size;
    l.local_rank = o.local_rank;
    l.master_addr = o.master_addr ? o.master_addr : "";
    l.master_port = o.master_port;
    l.launcher = "options";
    source = " (the options)";
    if (l.world_size < 1 || l.rank < 0 || l.rank >= l.world_size || l.local_rank < 0)
      return invalid("rank " + std::to_string(l.rank) + ", world size " +
                     std::to_string(l.world_size) + ", local rank " + std::to_string(l.local_rank) +
                     " do not describe a rank of a world");
    if (l.world_size > 1 && (l.master_addr.empty() || l.master_port < 1 || l.master_port > 65535))
      return invalid("a world of " + std::to_string(l.world_size) +
                     " ranks needs master_addr and a master_port from 1 "
                     "to 65535 (rank 0's host and a free port there)");
  }
  if (per_rank_programs) {
    std::string error;
    const std::string& l = d.launch.launcher;
    if (!artifact::select_rank_program(artifact, d.launch.rank, d.launch.world_size,
                                       l == "options" ? "the options" : l, name, &error))
      return invalid(error);
  }
  if (d.launch.world_size != ranks)
    return invalid("the plan runs on " + mesh + ", but this run has " +
                   std::to_string(d.launch.world_size) + " rank" +
                   (d.launch.world_size == 1 ? "" : "s") + source + ": start exactly " +
                   std::to_string(ranks) + " process" + (ranks == 1 ? "" : "es"));
  if (d.launch.world_size > 1) {
    int count = 0;
    KILN_CUDA_TRY(cudaGetDeviceCount(&count));
    std::string error;
    const int want = dist::device_for_rank(d.launch, count, &error);
    if (want < 0) return invalid(error);
    if (want != runtime->device.ordinal)
      return invalid(
          "rank " + std::to_string(d.launch.rank) + " (local rank " +
          std::to_string(d.launch.local_rank) + ") runs on CUDA device " + std::to_string(want) +
          ", but the runtime was created for device " + std::to_string(runtime->device.ordinal) +
          ": create it with kiln_runtime_options.device_ordinal = " + std::to_string(want));
  }
  *out = std::move(d);
  return nullptr;
}

kiln_status* all_gather_host(kiln_model* m, const void* send, uint64_t bytes, void* recv) {
  const std::string fn = "kiln_model_all_gather_host";
  KILN_RT_TRY(synchronize_model(m, fn.c_str()));
  if (bytes == 0) return nullptr;
  if (!m->comms) {  // a world of one rank
    std::memcpy(recv, send, bytes);
    return nullptr;
  }
  if (!m->watchdog->failure().empty())
    return make_status(KILN_STATUS_COLLECTIVE_FAILED, fn + ": " + m->watchdog->failure());
  const uint64_t total = bytes * static_cast<uint64_t>(m->world_size);
  KILN_CUDA_TRY(cudaSetDevice(m->runtime->device.ordinal));
  char* device = nullptr;
  char* host = nullptr;
  KILN_CUDA_TRY(cudaMalloc(&device, total + bytes));
  if (kiln_status* st =
          cuda_status(cudaHostAlloc(&host, total + bytes, cudaHostAllocDefault), "cudaHostAlloc")) {
    (void)cudaFree(device);
    return st;
  }
  std::memcpy(host + total, send, bytes);
  kiln_status* st = cuda_status(
      cudaMemcpyAsync(device + total, host + total, bytes, cudaMemcpyHostToDevice, m->stream),
      "cudaMemcpyAsync");
  if (!st)
    st = m->comms->settle(
        m->comms->world(),
        ncclAllGather(device + total, device, bytes, ncclUint8, m->comms->world(), m->stream),
        std::chrono::steady_clock::now() + m->collective_timeout, m->rank_text + ": " + fn);
  if (!st)
    st = cuda_status(cudaMemcpyAsync(host, device, total, cudaMemcpyDeviceToHost, m->stream),
                     "cudaMemcpyAsync");
  if (!st) {
    st = cuda_status(cudaEventRecord(m->run_done, m->stream), "cudaEventRecord");
    if (!st) {
      m->watchdog->arm(m->run_done, nullptr, m->rank_text,
                       "the host all-gather (" + std::to_string(bytes) + " bytes)");
      st = m->watchdog->wait(fn);
    }
  }
  if (st && m->comms->aborted())
    return st;  // the device may still hold the buffers: left to the process's exit
  if (!st) std::memcpy(recv, host, total);
  (void)cudaFreeHost(host);
  (void)cudaFree(device);
  return st;
}

}  // namespace kiln::rt

namespace kiln::dist {

int launch_device(std::string* error) {
  LaunchInfo info;
  switch (find_launch(&info, error)) {
    case LaunchFound::kError: return -1;
    case LaunchFound::kNone: return 0;
    case LaunchFound::kFound: break;
  }
  if (info.world_size == 1) return 0;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return info.local_rank;  // no device: the runtime reports that when it starts
  }
  return device_for_rank(info, count, error);
}

}  // namespace kiln::dist
