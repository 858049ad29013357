// Launcher environments and the TCP hand-off of NCCL's unique id (kiln/distributed.h).
#include "kiln/distributed.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>
#include <utility>
#include <vector>

namespace kiln::dist {
namespace {

using Clock = std::chrono::steady_clock;

const char* lookup(const EnvLookup& env, const char* name) {
  const char* v = env ? env(name) : std::getenv(name);
  return v && *v ? v : nullptr;
}

/// `text` as an integer in [min, max]; false otherwise.
bool parse_int(const char* text, long min, long max, int* out) {
  long v = 0;
  const char* end = text + std::strlen(text);
  auto [p, ec] = std::from_chars(text, end, v);
  if (ec != std::errc() || p != end || v < min || v > max) return false;
  *out = static_cast<int>(v);
  return true;
}

/// The variables each launcher sets, in the order they are tried.
struct Source {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local;
};
constexpr Source kSources[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
    {"srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

constexpr int kMaxRanks = 1 << 20;

int remaining_ms(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

/// Closes a socket on scope exit.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd = std::exchange(o.fd, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

bool set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  return flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

/// Sends all of `data` before `deadline`; false on error or time-out.
bool send_all(int fd, const void* data, size_t size, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (size) {
    const ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd{fd, POLLOUT, 0};
      if (::poll(&pfd, 1, remaining_ms(deadline)) <= 0) return false;
      continue;
    }
    return false;
  }
  return true;
}

/// Receives exactly `size` bytes before `deadline`. 1: done; 0: the peer closed; -1: error or
/// time-out (errno is ETIMEDOUT for the latter).
int recv_all(int fd, void* data, size_t size, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (size) {
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, remaining_ms(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      errno = ETIMEDOUT;
      return -1;
    }
    if (r < 0) return -1;
    const ssize_t n = ::recv(fd, p, size, 0);
    if (n == 0) return 0;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return -1;
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return 1;
}

void put_u32(char* at, uint32_t v) {
  for (int i = 0; i < 4; ++i) at[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t get_u32(const char* at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(at[i]);
  return v;
}

// The protocol: a rank sends kHello (8 bytes), its rank and the world size (u32 each, little
// endian). Rank 0 answers once every rank has arrived: u32 0 and the 128-byte id, or u32 1, a
// u32 length and a message saying why the run cannot start.
constexpr char kHello[8] = {'K', 'I', 'L', 'N', 'I', 'D', '0', '1'};
constexpr size_t kHelloBytes = 16;

/// A listening socket on `port` of every interface: IPv6 accepting IPv4 too, else IPv4.
Fd listen_on(int port, std::string* error) {
  for (const int family : {AF_INET6, AF_INET}) {
    Fd fd(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (fd.fd < 0) continue;
    const int one = 1, zero = 0;
    (void)::setsockopt(fd.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc;
    if (family == AF_INET6) {
      (void)::setsockopt(fd.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd.fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd.fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    if (rc != 0) {
      *error =
          "rank 0: cannot listen on port " + std::to_string(port) + ": " + std::strerror(errno) +
          (errno == EADDRINUSE
               ? " (choose another MASTER_PORT, or wait for the previous run's port to be freed)"
               : "");
      if (errno == EADDRINUSE) return Fd();
      continue;
    }
    if (::listen(fd.fd, 256) != 0 || !set_nonblocking(fd.fd)) {
      *error = std::string("rank 0: listen failed: ") + std::strerror(errno);
      return Fd();
    }
    error->clear();
    return fd;
  }
  if (error->empty()) *error = std::string("rank 0: cannot open a socket: ") + std::strerror(errno);
  return Fd();
}

/// A failure answer to a waiting rank (best effort: it may be gone).
void refuse(int fd, const std::string& why, Clock::time_point deadline) {
  char head[8];
  put_u32(head, 1);
  put_u32(head + 4, static_cast<uint32_t>(why.size()));
  if (send_all(fd, head, sizeof head, deadline))
    (void)send_all(fd, why.data(), why.size(), deadline);
}

bool serve_id(const LaunchInfo& info, const UniqueId& id, std::chrono::milliseconds timeout,
              std::string* error) {
  const auto deadline = Clock::now() + timeout;
  Fd listener = listen_on(info.master_port, error);
  if (listener.fd < 0) return false;
  struct Peer {
    Fd fd;
    std::string hello;
    int rank = -1;
  };
  std::vector<Peer> peers;
  std::map<int, size_t> by_rank;  // rank -> index in peers
  const auto fail = [&](const std::string& why) {
    *error = "rank 0: " + why;
    for (Peer& p : peers)
      if (p.fd.fd >= 0)
        refuse(p.fd.fd, "rank 0 refused the run: " + why, Clock::now() + std::chrono::seconds(1));
    return false;
  };
  while (static_cast<int>(by_rank.size()) < info.world_size - 1) {
    const int wait = remaining_ms(deadline);
    if (wait == 0) {
      std::string missing;
      int shown = 0;
      for (int r = 1; r < info.world_size && shown < 8; ++r)
        if (!by_rank.count(r)) missing += (shown++ ? ", " : "") + std::to_string(r);
      if (static_cast<int>(info.world_size - 1 - by_rank.size()) > shown) missing += ", ...";
      return fail("only " + std::to_string(by_rank.size()) + " of the other " +
                  std::to_string(info.world_size - 1) + " ranks connected to port " +
                  std::to_string(info.master_port) + " within " + seconds_text(timeout) +
                  " (missing: rank " + missing +
                  "); are they running, with MASTER_ADDR naming this host and the "
                  "same MASTER_PORT and WORLD_SIZE?");
    }
    std::vector<pollfd> fds = {{listener.fd, POLLIN, 0}};
    for (const Peer& p : peers)
      fds.push_back({p.fd.fd, static_cast<short>(p.rank < 0 && p.fd.fd >= 0 ? POLLIN : 0), 0});
    const int r = ::poll(fds.data(), fds.size(), std::min(wait, 1000));
    if (r < 0 && errno != EINTR) return fail(std::string("poll failed: ") + std::strerror(errno));
    if (r <= 0) continue;
    if (fds[0].revents & POLLIN) {
      for (;;) {
        const int c = ::accept4(listener.fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) break;
        peers.push_back({Fd(c), {}, -1});
      }
    }
    for (size_t i = 1; i < fds.size() && i - 1 < peers.size(); ++i) {
      Peer& p = peers[i - 1];
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR)) || p.rank >= 0 || p.fd.fd < 0) continue;
      char buf[kHelloBytes];
      const ssize_t n = ::recv(p.fd.fd, buf, kHelloBytes - p.hello.size(), 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n <= 0) {  // gone before saying who it is: not a rank of this run
        p.fd.reset();
        continue;
      }
      p.hello.append(buf, static_cast<size_t>(n));
      if (p.hello.size() < kHelloBytes) continue;
      if (std::memcmp(p.hello.data(), kHello, sizeof kHello) !=
          0) {  // something else knocked: ignore it
        p.fd.reset();
        continue;
      }
      const uint32_t rank = get_u32(p.hello.data() + 8), world = get_u32(p.hello.data() + 12);
      if (static_cast<int>(world) != info.world_size)
        return fail("rank " + std::to_string(rank) + " says the world has " +
                    std::to_string(world) + " ranks, rank 0 says " +
                    std::to_string(info.world_size) + " (WORLD_SIZE differs between ranks)");
      if (rank == 0 || static_cast<int>(rank) >= info.world_size)
        return fail("a process claims rank " + std::to_string(rank) + " of " +
                    std::to_string(info.world_size));
      if (by_rank.count(static_cast<int>(rank)))
        return fail("two processes claim rank " + std::to_string(rank) +
                    " (RANK must differ between processes)");
      p.rank = static_cast<int>(rank);
      by_rank[p.rank] = i - 1;
    }
  }
  char reply[4 + sizeof(UniqueId)];
  put_u32(reply, 0);
  std::memcpy(reply + 4, id.data(), id.size());
  for (const auto& [rank, index] : by_rank)
    if (!send_all(peers[index].fd.fd, reply, sizeof reply, deadline))
      return fail("could not send the id to rank " + std::to_string(rank) + ": " +
                  std::strerror(errno));
  return true;
}

/// One connection attempt to any address of `host`:`port` that answers before `deadline`.
Fd connect_once(const std::string& host, int port, Clock::time_point deadline,
                std::string* last_error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (gai != 0) {
    *last_error = "cannot resolve '" + host + "': " + gai_strerror(gai);
    return Fd();
  }
  Fd result;
  for (addrinfo* a = found; a && result.fd < 0; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.fd < 0) continue;
    if (::connect(fd.fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      *last_error = std::strerror(errno);
      continue;
    }
    pollfd pfd{fd.fd, POLLOUT, 0};
    if (::poll(&pfd, 1, std::min(remaining_ms(deadline), 1000)) <= 0) {
      *last_error = "connection attempt timed out";
      continue;
    }
    int err = 0;
    socklen_t len = sizeof err;
    (void)::getsockopt(fd.fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      *last_error = std::strerror(err);
      continue;
    }
    result = std::move(fd);
  }
  ::freeaddrinfo(found);
  return result;
}

bool fetch_id(const LaunchInfo& info, UniqueId* id, std::chrono::milliseconds timeout,
              std::string* error) {
  const auto deadline = Clock::now() + timeout;
  const std::string where = info.master_addr + ":" + std::to_string(info.master_port);
  const std::string me = "rank " + std::to_string(info.rank) + ": ";
  std::string last = "no attempt finished";
  Fd fd;
  while (fd.fd < 0) {
    fd = connect_once(info.master_addr, info.master_port, deadline, &last);
    if (fd.fd >= 0) break;
    if (remaining_ms(deadline) == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(100, remaining_ms(deadline))));
  }
  const std::string hint =
      "; is rank 0 running, and do MASTER_ADDR and MASTER_PORT name its host and a free port "
      "there on every rank?";
  if (fd.fd < 0) {
    *error = me + "no answer from rank 0 at " + where + " within " + seconds_text(timeout) +
             " (last attempt: " + last + ")" + hint;
    return false;
  }
  char hello[kHelloBytes];
  std::memcpy(hello, kHello, sizeof kHello);
  put_u32(hello + 8, static_cast<uint32_t>(info.rank));
  put_u32(hello + 12, static_cast<uint32_t>(info.world_size));
  if (!send_all(fd.fd, hello, sizeof hello, deadline)) {
    *error = me + "lost the connection to rank 0 at " + where + ": " + std::strerror(errno);
    return false;
  }
  char head[4];
  const int got = recv_all(fd.fd, head, sizeof head, deadline);
  if (got <= 0) {
    *error =
        me + (got == 0 ? "rank 0 at " + where + " closed the connection without sending the id"
              : errno == ETIMEDOUT
                  ? "rank 0 at " + where + " did not send the id within " + seconds_text(timeout) +
                        " (are all " + std::to_string(info.world_size) + " ranks running?)"
                  : "lost the connection to rank 0 at " + where + ": " + std::strerror(errno));
    return false;
  }
  if (get_u32(head) == 0) {
    if (recv_all(fd.fd, id->data(), id->size(), deadline) == 1) return true;
    *error = me + "rank 0 at " + where + " sent a truncated id";
    return false;
  }
  char len_bytes[4];
  std::string why = "no reason given";
  if (recv_all(fd.fd, len_bytes, sizeof len_bytes, deadline) == 1 && get_u32(len_bytes) < 4096) {
    std::string msg(get_u32(len_bytes), '\0');
    if (recv_all(fd.fd, msg.data(), msg.size(), deadline) == 1) why = msg;
  }
  *error = me + why;
  return false;
}

}  // namespace

std::string seconds_text(std::chrono::milliseconds ms) {
  char buf[32];
  if (ms.count() % 1000 == 0)
    std::snprintf(buf, sizeof buf, "%lld s", static_cast<long long>(ms.count() / 1000));
  else
    std::snprintf(buf, sizeof buf, "%.3g s", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

LaunchFound find_launch(LaunchInfo* out, std::string* error, const EnvLookup& env) {
  for (const Source& s : kSources) {
    const char* rank = lookup(env, s.rank);
    const char* size = lookup(env, s.size);
    if (!rank && !size) continue;
    LaunchInfo info;
    info.launcher = s.launcher;
    const std::string who = std::string(" (") + s.launcher + ")";
    if (!rank || !size) {
      *error = std::string(rank ? s.rank : s.size) + " is set but " + (rank ? s.size : s.rank) +
               " is not" + who;
      return LaunchFound::kError;
    }
    if (!parse_int(size, 1, kMaxRanks, &info.world_size)) {
      *error =
          std::string(s.size) + "='" + size + "' is not a world size (an integer from 1)" + who;
      return LaunchFound::kError;
    }
    if (!parse_int(rank, 0, info.world_size - 1, &info.rank)) {
      *error = std::string(s.rank) + "='" + rank + "' is not a rank of a world of " +
               std::to_string(info.world_size) + " (0 to " + std::to_string(info.world_size - 1) +
               ")" + who;
      return LaunchFound::kError;
    }
    const char* local_name = lookup(env, "LOCAL_RANK") ? "LOCAL_RANK" : s.local;
    const char* local = lookup(env, local_name);
    if (!local && info.world_size > 1) {
      *error = std::string("no local rank: ") + s.local +
               " is not set; set LOCAL_RANK to this process's index on "
               "its host (its CUDA device)";
      return LaunchFound::kError;
    }
    if (local && !parse_int(local, 0, info.world_size - 1, &info.local_rank)) {
      *error = std::string(local_name) + "='" + local + "' is not a local rank (0 to " +
               std::to_string(info.world_size - 1) + ")" + who;
      return LaunchFound::kError;
    }
    const char* addr = lookup(env, "MASTER_ADDR");
    const char* port = lookup(env, "MASTER_PORT");
    if (info.world_size > 1 && (!addr || !port)) {
      *error = std::string(addr ? "MASTER_PORT" : "MASTER_ADDR") + " is not set: a run of " +
               std::to_string(info.world_size) +
               " ranks needs MASTER_ADDR (rank 0's host) and MASTER_PORT (a free "
               "port there) on every rank" +
               (s.launcher == std::string("srun")
                    ? " (under srun, export them in the "
                      "batch script, e.g. MASTER_ADDR=$(scontrol show hostnames | head -n1))"
                    : "");
      return LaunchFound::kError;
    }
    if (addr) info.master_addr = addr;
    if (port && !parse_int(port, 1, 65535, &info.master_port)) {
      *error = std::string("MASTER_PORT='") + port + "' is not a port number (1 to 65535)";
      return LaunchFound::kError;
    }
    *out = info;
    return LaunchFound::kFound;
  }
  return LaunchFound::kNone;
}

int device_for_rank(const LaunchInfo& info, int device_count, std::string* error) {
  if (device_count == 1) return 0;  // each rank sees only its own device (CUDA_VISIBLE_DEVICES)
  if (info.local_rank < device_count) return info.local_rank;
  *error = "rank " + std::to_string(info.rank) + " has local rank " +
           std::to_string(info.local_rank) + " but sees " + std::to_string(device_count) +
           " CUDA device" + (device_count == 1 ? "" : "s") +
           " (start at most one rank per device on each host)";
  return -1;
}

bool exchange_unique_id(const LaunchInfo& info, UniqueId* id, std::chrono::milliseconds timeout,
                        std::string* error) {
  if (info.world_size <= 1) return true;
  if (info.master_addr.empty() || info.master_port <= 0) {
    *error = "rank " + std::to_string(info.rank) +
             ": MASTER_ADDR and MASTER_PORT are needed to start " +
             std::to_string(info.world_size) + " ranks";
    return false;
  }
  return info.rank == 0 ? serve_id(info, *id, timeout, error) : fetch_id(info, id, timeout, error);
}

}  // namespace kiln::dist
