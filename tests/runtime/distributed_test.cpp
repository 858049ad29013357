// Launching without a GPU: rank discovery from each launcher's environment, the TCP hand-off
// of NCCL's unique id between processes over loopback, its time-outs, and the distributed
// load's checks that come before any device work.
#include <doctest/doctest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>

#include "kiln/distributed.h"
#include "model.h"

using namespace kiln::dist;

namespace {

/// An environment made of `vars` only.
EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

LaunchInfo found(std::map<std::string, std::string> vars) {
  LaunchInfo info;
  std::string error;
  REQUIRE_MESSAGE(find_launch(&info, &error, env_of(std::move(vars))) == LaunchFound::kFound,
                  error);
  return info;
}

std::string launch_error(std::map<std::string, std::string> vars) {
  LaunchInfo info;
  std::string error;
  CHECK(find_launch(&info, &error, env_of(std::move(vars))) == LaunchFound::kError);
  return error;
}

/// A port nobody listens on right now (the kernel's choice for port 0, then closed).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

UniqueId test_id() {
  UniqueId id;
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>(i * 7 + 3);
  return id;
}

LaunchInfo rank_of(int rank, int world, int port) {
  LaunchInfo info;
  info.rank = rank;
  info.world_size = world;
  info.local_rank = rank;
  info.master_addr = "127.0.0.1";
  info.master_port = port;
  return info;
}

/// Runs rank `rank` of `world` in a child process: exit 0 when it received test_id(), 1 when
/// it received something else, 2 when the hand-off failed with an error containing `expect`.
pid_t spawn_rank(int rank, int world, int port, std::chrono::milliseconds timeout,
                 const std::string& expect = "") {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    UniqueId id{};
    std::string error;
    if (!exchange_unique_id(rank_of(rank, world, port), &id, timeout, &error))
      std::_Exit(!expect.empty() && error.find(expect) != std::string::npos ? 2 : 3);
    std::_Exit(id == test_id() ? 0 : 1);
  }
  return pid;
}

int exit_code(pid_t pid) {
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

TEST_CASE("find_launch reads torchrun, mpirun, PMI and srun environments") {
  LaunchInfo t = found({{"RANK", "1"},
                        {"WORLD_SIZE", "4"},
                        {"LOCAL_RANK", "1"},
                        {"MASTER_ADDR", "node0"},
                        {"MASTER_PORT", "29500"}});
  CHECK(t.launcher == "torchrun");
  CHECK(t.rank == 1);
  CHECK(t.world_size == 4);
  CHECK(t.local_rank == 1);
  CHECK(t.master_addr == "node0");
  CHECK(t.master_port == 29500);
  LaunchInfo o = found({{"OMPI_COMM_WORLD_RANK", "3"},
                        {"OMPI_COMM_WORLD_SIZE", "4"},
                        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                        {"MASTER_ADDR", "10.0.0.1"},
                        {"MASTER_PORT", "6000"}});
  CHECK(o.launcher == "mpirun");
  CHECK(o.rank == 3);
  CHECK(o.local_rank == 1);
  LaunchInfo p = found({{"PMI_RANK", "2"},
                        {"PMI_SIZE", "3"},
                        {"MPI_LOCALRANKID", "0"},
                        {"MASTER_ADDR", "h"},
                        {"MASTER_PORT", "7000"}});
  CHECK(p.launcher == "pmi");
  CHECK(p.rank == 2);
  LaunchInfo s = found({{"SLURM_PROCID", "5"},
                        {"SLURM_NTASKS", "8"},
                        {"SLURM_LOCALID", "1"},
                        {"MASTER_ADDR", "h"},
                        {"MASTER_PORT", "7000"}});
  CHECK(s.launcher == "srun");
  CHECK(s.rank == 5);
  CHECK(s.world_size == 8);
  CHECK(s.local_rank == 1);
  // torchrun inside an srun allocation: torchrun's variables describe this process.
  LaunchInfo nested = found({{"RANK", "0"},
                             {"WORLD_SIZE", "2"},
                             {"LOCAL_RANK", "0"},
                             {"SLURM_PROCID", "0"},
                             {"SLURM_NTASKS", "1"},
                             {"MASTER_ADDR", "h"},
                             {"MASTER_PORT", "1"}});
  CHECK(nested.launcher == "torchrun");
  CHECK(nested.world_size == 2);
  // LOCAL_RANK overrides the launcher's own local rank.
  CHECK(found({{"SLURM_PROCID", "1"},
               {"SLURM_NTASKS", "2"},
               {"SLURM_LOCALID", "0"},
               {"LOCAL_RANK", "1"},
               {"MASTER_ADDR", "h"},
               {"MASTER_PORT", "1"}})
            .local_rank == 1);
  // One rank needs no rank 0 to talk to.
  LaunchInfo alone = found({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  CHECK(alone.world_size == 1);
  CHECK(alone.master_port == 0);
  LaunchInfo none;
  std::string error;
  CHECK(find_launch(&none, &error, env_of({{"PATH", "/bin"}})) == LaunchFound::kNone);
}

TEST_CASE("find_launch names the variable that is missing or wrong") {
  CHECK(launch_error({{"RANK", "0"}}) == "RANK is set but WORLD_SIZE is not (torchrun)");
  CHECK(launch_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}}) ==
        "RANK='2' is not a rank of a world of 2 (0 to 1) (torchrun)");
  CHECK(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "zero"}}) ==
        "WORLD_SIZE='zero' is not a world size (an integer from 1) (torchrun)");
  CHECK(launch_error(
            {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_PORT", "1"}}) ==
        "MASTER_ADDR is not set: a run of 2 ranks needs MASTER_ADDR (rank 0's host) and "
        "MASTER_PORT (a free port "
        "there) on every rank");
  CHECK(launch_error({{"RANK", "0"},
                      {"WORLD_SIZE", "2"},
                      {"LOCAL_RANK", "0"},
                      {"MASTER_ADDR", "h"},
                      {"MASTER_PORT", "70000"}}) ==
        "MASTER_PORT='70000' is not a port number (1 to 65535)");
  CHECK(launch_error(
            {{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}) ==
        "no local rank: MPI_LOCALRANKID is not set; set LOCAL_RANK to this process's index on its "
        "host (its CUDA "
        "device)");
  CHECK(launch_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}})
            .find("(under srun, export them in the batch script") != std::string::npos);
}

TEST_CASE("device_for_rank: the local rank's device, or the only one the process sees") {
  std::string error;
  LaunchInfo info = rank_of(1, 2, 1);
  CHECK(device_for_rank(info, 2, &error) == 1);
  CHECK(device_for_rank(info, 1, &error) == 0);
  info.local_rank = 3;
  CHECK(device_for_rank(info, 2, &error) == -1);
  CHECK(error ==
        "rank 1 has local rank 3 but sees 2 CUDA devices (start at most one rank per device on "
        "each host)");
}

TEST_CASE("exchange_unique_id hands rank 0's id to the other processes over loopback") {
  const int port = free_port();
  // The other ranks start first and retry until rank 0 listens.
  const pid_t one = spawn_rank(1, 3, port, std::chrono::seconds(20));
  const pid_t two = spawn_rank(2, 3, port, std::chrono::seconds(20));
  ::usleep(200 * 1000);
  UniqueId id = test_id();
  std::string error;
  CHECK_MESSAGE(exchange_unique_id(rank_of(0, 3, port), &id, std::chrono::seconds(20), &error),
                error);
  CHECK(exit_code(one) == 0);
  CHECK(exit_code(two) == 0);
  // A world of one rank needs no hand-off.
  CHECK(exchange_unique_id(rank_of(0, 1, 0), &id, std::chrono::milliseconds(1), &error));
}

TEST_CASE("exchange_unique_id fails in time when a rank is missing or disagrees, never hangs") {
  using clock = std::chrono::steady_clock;
  SUBCASE("rank 0 never shows up") {
    const int port = free_port();
    UniqueId id{};
    std::string error;
    const auto t0 = clock::now();
    CHECK_FALSE(
        exchange_unique_id(rank_of(1, 2, port), &id, std::chrono::milliseconds(500), &error));
    CHECK(clock::now() - t0 < std::chrono::seconds(5));
    CHECK(error.find("rank 1: no answer from rank 0 at 127.0.0.1:" + std::to_string(port) +
                     " within 0.5 s") == 0);
    CHECK(error.find("is rank 0 running, and do MASTER_ADDR and MASTER_PORT name its host") !=
          std::string::npos);
  }
  SUBCASE("a rank never shows up") {
    const int port = free_port();
    const pid_t one = spawn_rank(1, 3, port, std::chrono::seconds(5),
                                 "rank 0 refused the run: only 1 of the other 2");
    UniqueId id = test_id();
    std::string error;
    const auto t0 = clock::now();
    CHECK_FALSE(
        exchange_unique_id(rank_of(0, 3, port), &id, std::chrono::milliseconds(1500), &error));
    CHECK(clock::now() - t0 < std::chrono::seconds(6));
    CHECK(error.find("rank 0: only 1 of the other 2 ranks connected to port " +
                     std::to_string(port) + " within 1.5 s (missing: rank 2)") == 0);
    CHECK(exit_code(one) == 2);  // the waiting rank heard why
  }
  SUBCASE("the ranks disagree on the world size") {
    const int port = free_port();
    const pid_t one =
        spawn_rank(1, 3, port, std::chrono::seconds(5), "WORLD_SIZE differs between ranks");
    UniqueId id = test_id();
    std::string error;
    CHECK_FALSE(exchange_unique_id(rank_of(0, 2, port), &id, std::chrono::seconds(5), &error));
    CHECK(error ==
          "rank 0: rank 1 says the world has 3 ranks, rank 0 says 2 (WORLD_SIZE differs between "
          "ranks)");
    CHECK(exit_code(one) == 2);
  }
}

TEST_CASE("a distributed load checks the world against the plan's mesh before touching a device") {
  for (const char* v :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS"})
    ::unsetenv(v);
  auto artifact = std::make_unique<kiln::artifact::Artifact>();
  std::string error;
  REQUIRE(kiln::artifact::parse_plan("kiln-plan 1\narena bytes=0\nworkspace bytes=0\nmesh tp=2\n",
                                     &artifact->plan, &error));
  kiln_runtime runtime;  // its device is never touched by these checks
  kiln_distributed_options o;
  kiln_distributed_options_initialize(&o);
  CHECK(o.from_environment == 1);
  CHECK(o.collective_timeout_s == 300);
  kiln::rt::DistributedSetup setup;
  auto message = [&](const kiln_distributed_options& opts) {
    kiln_status* st = kiln::rt::distributed_setup(&runtime, artifact, "m.kiln", opts, &setup);
    std::string m = st ? st->message : "";
    kiln_status_release(st);
    return m;
  };
  CHECK(message(o).find(
            "the plan runs on a mesh of 2 ranks (tp:2), but no launcher started this process as "
            "one of "
            "its ranks: start one process per rank, e.g. `kiln launch -n 2 -- kiln run ...`") == 0);
  o.from_environment = 0;
  o.world_size = 4;
  o.rank = 1;
  o.master_addr = "127.0.0.1";
  o.master_port = 29500;
  CHECK(message(o) ==
        "the plan runs on a mesh of 2 ranks (tp:2), but this run has 4 ranks (the options): start "
        "exactly 2 processes");
  o.world_size = 2;
  o.master_addr = nullptr;
  CHECK(
      message(o) ==
      "a world of 2 ranks needs master_addr and a master_port from 1 to 65535 (rank 0's host and a "
      "free port there)");
  o.collective_timeout_s = 0;
  CHECK(message(o) ==
        "collective_timeout_s must be a positive number of seconds up to 86400, got 0.000000");
  // A mesh of one rank runs alone without a launcher.
  REQUIRE(kiln::artifact::parse_plan("kiln-plan 1\narena bytes=0\nworkspace bytes=0\nmesh tp=1\n",
                                     &artifact->plan, &error));
  kiln_distributed_options_initialize(&o);
  CHECK(message(o).empty());
  CHECK(setup.launch.world_size == 1);
  CHECK(setup.collective_timeout == std::chrono::seconds(300));
}

TEST_CASE("the version-5 table appends the distributed functions, which check their arguments") {
  CHECK(KILN_RUNTIME_API_VERSION >= 5);
  const kiln_api* v5 = kiln_get_api(5);
  REQUIRE(v5 != nullptr);
  CHECK((v5->model_tune_step == &kiln_model_tune_step));
  CHECK((v5->distributed_options_initialize == &kiln_distributed_options_initialize));
  CHECK((v5->model_load_file_distributed == &kiln_model_load_file_distributed));
  CHECK((v5->model_all_gather_host == &kiln_model_all_gather_host));
  kiln_model* m = nullptr;
  kiln_status* st = kiln_model_load_file_distributed(nullptr, "x.kiln", nullptr, &m);
  REQUIRE(st != nullptr);
  CHECK(std::string(kiln_status_get_message(st)) ==
        "kiln_model_load_file_distributed: runtime is NULL");
  kiln_status_release(st);
  kiln_tensor_placement p{};
  st = kiln_model_input_placement(nullptr, 0, &p);
  CHECK(std::string(kiln_status_get_message(st)) == "kiln_model_input_placement: model is NULL");
  kiln_status_release(st);
}
