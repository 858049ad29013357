// One process per rank: who this process is, from a launcher's environment (torchrun, srun,
// mpirun, `kiln launch`), and the hand-off of NCCL's 128-byte unique id from rank 0 to the
// other ranks over one TCP port. C++ without CUDA or NCCL: the runtime's distributed load, the
// kiln command line and tests use it. NCCL's own bootstrap does everything after the hand-off.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace kiln::dist {

/// Where this process sits in a run of one process per rank.
struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;       ///< the rank's index on its host: the CUDA device it runs on
  std::string master_addr;  ///< rank 0's host name or address ("" when not given)
  int master_port = 0;      ///< the port rank 0 listens on for the id hand-off (0: not given)
  std::string launcher;     ///< "torchrun", "srun", "mpirun" (Open MPI), "pmi" (MPICH, Intel MPI)
};

/// Reads an environment variable: nullptr when it is unset. Tests pass their own tables.
using EnvLookup = std::function<const char*(const char*)>;

enum class LaunchFound { kNone, kFound, kError };

/// Finds this process's rank, world size and local rank in the environment, trying in order:
/// RANK, WORLD_SIZE, LOCAL_RANK (torchrun, `kiln launch`); OMPI_COMM_WORLD_RANK, _SIZE,
/// _LOCAL_RANK (Open MPI's mpirun); PMI_RANK, PMI_SIZE with MPI_LOCALRANKID or LOCAL_RANK
/// (MPICH, Intel MPI); SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (srun). A later launcher
/// inside an earlier one's allocation (torchrun under srun) wins by that order. LOCAL_RANK,
/// when set, overrides the launcher's local rank. MASTER_ADDR and MASTER_PORT name rank 0's
/// host and a free port on it; a world of more than one rank needs both. kNone when no launcher
/// variable is set; kError, with `error` saying which variable is wrong, when one is malformed
/// or inconsistent. `env` defaults to the process environment.
LaunchFound find_launch(LaunchInfo* out, std::string* error, const EnvLookup& env = {});

/// The CUDA device of a rank: its local rank, or device 0 when the process sees one device
/// (each rank restricted by CUDA_VISIBLE_DEVICES). -1, with `error` set, when it sees fewer.
int device_for_rank(const LaunchInfo& info, int device_count, std::string* error);

/// The CUDA device this process runs on: device_for_rank of the launcher's rank on this
/// machine's devices, or 0 without a launcher. -1, with `error` set, when the launcher's
/// variables are malformed or the rank has no device. (Implemented with the CUDA runtime.)
int launch_device(std::string* error);

/// The hand-off of NCCL's unique id (ncclUniqueId is 128 bytes).
using UniqueId = std::array<char, 128>;

/// Rank 0 listens on info.master_port (every interface), waits for the other world_size - 1
/// ranks to connect and say who they are, checks that each names a distinct rank of the same
/// world size, then sends each one `*id`. Every other rank connects to master_addr:master_port,
/// retrying while rank 0 is not listening yet, says who it is and receives the id into `*id`.
/// Gives up after `timeout` with an error naming the address, the port and what was missing
/// ("rank 1: no answer from rank 0 at 10.0.0.1:29500 within 30 s ..."). A world of one rank
/// needs no hand-off and returns at once. False on failure.
bool exchange_unique_id(const LaunchInfo& info, UniqueId* id, std::chrono::milliseconds timeout,
                        std::string* error);

/// "2 s", "0.5 s": a time-out as messages write it.
std::string seconds_text(std::chrono::milliseconds ms);

}  // namespace kiln::dist
