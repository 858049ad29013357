// `kiln launch`: start one process per rank on this host, as torchrun does, with the
// environment Kiln's runtime reads (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT);
// forward their output line by line with a rank prefix; stop every rank when one fails.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "cli.h"

namespace kiln::cli {

namespace {

constexpr std::string_view kLaunch =
    R"(usage: kiln launch -n N [--master-port P] [--stop-after S] -- COMMAND [ARG]...

Start N processes of COMMAND on this host, one per rank, as torchrun --nproc-per-node N does:
rank k gets RANK=k, LOCAL_RANK=k (its CUDA device), WORLD_SIZE=N, LOCAL_WORLD_SIZE=N,
MASTER_ADDR=127.0.0.1 and MASTER_PORT. Their standard output and error are forwarded line by
line, each line prefixed with "[rank k] ". When a rank fails (a non-zero exit or a signal), the
others get SIGTERM, then SIGKILL S seconds later, and launch exits with the failing rank's status
(128 + the signal for a signal). COMMAND `kiln` runs this kiln binary.

  -n, --nproc N         ranks to start (1 to 1024)
  --master-port P       the port rank 0 listens on for NCCL's id hand-off (default: a free port)
  --stop-after S        seconds between SIGTERM and SIGKILL for the other ranks (default 5)

Example: kiln launch -n 2 -- kiln run tp.kir --backend cuda-sm90 --random-inputs
Several hosts: use torchrun, srun or mpirun, which the runtime reads the same way.
)";

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal = sig; }

int to_int(const std::string& text, const std::string& flag, int min, int max) {
  int v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size() || v < min || v > max)
    throw UsageError{"launch: " + flag + " expects an integer from " + std::to_string(min) +
                     " to " + std::to_string(max) + ", got '" + text + "'"};
  return v;
}

/// A port nobody listens on now: the kernel's pick for port 0.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 29500;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 29500;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

/// This kiln binary, for COMMAND `kiln`.
std::string self_path() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "kiln";
}

/// One rank's process and what is left of its output lines.
struct Rank {
  pid_t pid = -1;
  int out = -1, err = -1;  // read ends
  std::string out_line, err_line;
  bool running = true;
  int status = 0;
};

/// Writes every complete line of `pending` (after appending `data`) with the prefix.
void forward(std::string& pending, const char* data, size_t n, const std::string& prefix,
             std::ostream& to, bool flush_rest) {
  pending.append(data, n);
  size_t start = 0;
  for (size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1)
    to << prefix << std::string_view(pending).substr(start, nl - start) << "\n";
  pending.erase(0, start);
  if (flush_rest && !pending.empty()) {
    to << prefix << pending << "\n";
    pending.clear();
  }
  to.flush();
}

/// The exit status a rank's wait status stands for: its code, or 128 + its signal.
int exit_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe(int status) {
  if (WIFSIGNALED(status))
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  return "exited with status " + std::to_string(exit_status(status));
}

}  // namespace

std::string launch_usage_text() { return std::string(kLaunch); }

int cmd_launch(Args& args) {
  int n = 0, port = 0, stop_after = 5;
  std::vector<std::string> command;
  while (!args.done()) {
    if (!args.at_option())
      throw UsageError{"launch: put the command after '--' (kiln launch -n N -- COMMAND ...)"};
    const std::string flag = args.option();
    if (flag == "--") {
      while (!args.done()) command.push_back(args.positional());
      break;
    }
    if (flag == "-n" || flag == "--nproc")
      n = to_int(args.value(flag), flag, 1, 1024);
    else if (flag == "--master-port")
      port = to_int(args.value(flag), flag, 1, 65535);
    else if (flag == "--stop-after")
      stop_after = to_int(args.value(flag), flag, 0, 3600);
    else
      args.unknown(flag);
  }
  if (n == 0) throw UsageError{"launch: give the number of ranks with -n N"};
  if (command.empty()) throw UsageError{"launch: no command given after '--'"};
  if (command[0] == "kiln") command[0] = self_path();
  if (port == 0) port = free_port();

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  std::vector<Rank> ranks(static_cast<size_t>(n));
  std::cout.flush();
  std::cerr.flush();
  for (int r = 0; r < n; ++r) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
      return report(io_error(std::string("launch: pipe failed: ") + std::strerror(errno)));
    const pid_t pid = ::fork();
    if (pid < 0)
      return report(io_error(std::string("launch: fork failed: ") + std::strerror(errno)));
    if (pid == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      const auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
      set("RANK", std::to_string(r));
      set("LOCAL_RANK", std::to_string(r));
      set("WORLD_SIZE", std::to_string(n));
      set("LOCAL_WORLD_SIZE", std::to_string(n));
      set("MASTER_ADDR", "127.0.0.1");
      set("MASTER_PORT", std::to_string(port));
      std::vector<char*> argv;
      for (std::string& a : command) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      const std::string msg =
          "kiln: error: launch: cannot run '" + command[0] + "': " + std::strerror(errno) + "\n";
      (void)!::write(STDERR_FILENO, msg.data(), msg.size());
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    ranks[static_cast<size_t>(r)] = {pid, out[0], err[0], {}, {}, true, 0};
  }

  int failed = -1;  // the first rank that failed
  bool stopping = false;
  std::chrono::steady_clock::time_point kill_at;
  const auto stop_others = [&](int sig) {
    for (Rank& k : ranks)
      if (k.running) ::kill(k.pid, sig);
  };
  for (;;) {
    // Output first, so a failing rank's last words come before launch's own message.
    std::vector<pollfd> fds;
    std::vector<std::pair<size_t, bool>> owner;  // rank, is stderr
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (ranks[r].out >= 0) fds.push_back({ranks[r].out, POLLIN, 0}), owner.push_back({r, false});
      if (ranks[r].err >= 0) fds.push_back({ranks[r].err, POLLIN, 0}), owner.push_back({r, true});
    }
    bool any_running = false;
    for (const Rank& k : ranks) any_running |= k.running;
    if (fds.empty() && !any_running) break;
    if (!fds.empty()) {
      const int ready = ::poll(fds.data(), fds.size(), 50);
      for (size_t i = 0; ready > 0 && i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        Rank& k = ranks[owner[i].first];
        const bool is_err = owner[i].second;
        char buf[65536];
        const ssize_t got = ::read(fds[i].fd, buf, sizeof buf);
        if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        const std::string prefix = "[rank " + std::to_string(owner[i].first) + "] ";
        forward(is_err ? k.err_line : k.out_line, buf, got > 0 ? static_cast<size_t>(got) : 0,
                prefix, is_err ? std::cerr : std::cout, got <= 0);
        if (got <= 0) {
          ::close(fds[i].fd);
          (is_err ? k.err : k.out) = -1;
        }
      }
    } else {
      ::usleep(50 * 1000);
    }
    for (int status = 0;;) {
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (size_t r = 0; r < ranks.size(); ++r) {
        if (ranks[r].pid != pid) continue;
        ranks[r].running = false;
        ranks[r].status = status;
        if (exit_status(status) != 0 && failed < 0 && !stopping) {
          failed = static_cast<int>(r);
          stopping = true;
          kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(stop_after);
          stop_others(SIGTERM);
        }
      }
    }
    if (g_signal && !stopping) {
      stopping = true;
      kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(stop_after);
      stop_others(SIGTERM);
    }
    if (stopping && std::chrono::steady_clock::now() >= kill_at) stop_others(SIGKILL);
  }
  if (failed >= 0) {
    const Rank& k = ranks[static_cast<size_t>(failed)];
    // The others: stopped by launch (a signal), or failed on their own meanwhile.
    std::string stopped, also;
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (static_cast<int>(r) == failed || exit_status(ranks[r].status) == 0) continue;
      std::string& list = WIFSIGNALED(ranks[r].status) ? stopped : also;
      list += (list.empty() ? "" : ", ") + std::to_string(r);
    }
    report(
        failed_precondition("launch: rank " + std::to_string(failed) + " " + describe(k.status) +
                            (stopped.empty() ? "" : "; stopped the others (rank " + stopped + ")") +
                            (also.empty() ? "" : "; also failed: rank " + also)));
    return exit_status(k.status);
  }
  if (g_signal) return 128 + g_signal;
  return kExitOk;
}

}  // namespace kiln::cli
