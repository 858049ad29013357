// NCCL communicators, collective steps and the watchdog (comm.h).
#include "comm.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>

#include "rank_layout.h"

namespace kiln::rt {

using Clock = std::chrono::steady_clock;

namespace {

/// "ncclRemoteError (remote process exited or there was a network error): <NCCL's last error>"
std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  static const char* const kNames[] = {
      "ncclSuccess",         "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
      "ncclInvalidArgument", "ncclInvalidUsage",       "ncclRemoteError", "ncclInProgress"};
  std::string s =
      static_cast<size_t>(r) < std::size(kNames) ? kNames[r] : "NCCL error " + std::to_string(r);
  s += std::string(" (") + ncclGetErrorString(r) + ")";
  const char* last = ncclGetLastError(comm);
  if (last && *last) s += std::string(": ") + last;
  return s;
}

kiln_status* failed(std::string msg) {
  return make_status(KILN_STATUS_COLLECTIVE_FAILED, std::move(msg));
}

/// Spins briefly, then sleeps: short NCCL and device waits stay fast, long ones cost no core.
void back_off(int& round) {
  if (++round < 2000)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(round < 4000 ? 100 : 1000));
}

}  // namespace

// ---- Communicators -------------------------------------------------------------------------

kiln_status* Communicators::create(const dist::LaunchInfo& launch,
                                   const std::vector<artifact::MeshAxis>& mesh, int device,
                                   std::chrono::milliseconds timeout,
                                   std::unique_ptr<Communicators>* out) {
  std::unique_ptr<Communicators> c(new Communicators());
  c->rank_ = launch.rank;
  c->world_size_ = launch.world_size;
  const std::string me =
      "rank " + std::to_string(launch.rank) + " of " + std::to_string(launch.world_size);
  KILN_CUDA_TRY(cudaSetDevice(device));
  ncclUniqueId id{};
  static_assert(sizeof(ncclUniqueId) == sizeof(dist::UniqueId), "NCCL's unique id is 128 bytes");
  if (launch.rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      return failed(me + ": ncclGetUniqueId failed: " + nccl_text(r, nullptr));
  }
  dist::UniqueId bytes{};
  std::memcpy(bytes.data(), &id, sizeof id);
  std::string error;
  if (!dist::exchange_unique_id(launch, &bytes, timeout, &error)) return failed(error);
  std::memcpy(&id, bytes.data(), sizeof id);

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const Deadline deadline = Clock::now() + timeout;
  const std::string waiting = " (are all " + std::to_string(launch.world_size) +
                              " ranks running and able to reach " +
                              "each other? NCCL_DEBUG=INFO shows NCCL's own view)";
  ncclResult_t r = ncclCommInitRankConfig(&c->world_, launch.world_size, id, launch.rank, &config);
  if (!c->world_) return failed(me + ": ncclCommInitRankConfig failed: " + nccl_text(r, nullptr));
  KILN_RT_TRY(c->settle(c->world_, r, deadline, me + ": creating the NCCL communicator" + waiting));

  const std::vector<int64_t> coords = mesh_coords(mesh, launch.rank);
  for (size_t a = 0; a < mesh.size(); ++a) {
    if (mesh[a].size == launch.world_size) {
      c->axes_.push_back(c->world_);
      continue;
    }
    // The group of a rank along axis a: every rank with the same coordinates elsewhere.
    int64_t color = 0;
    for (size_t b = 0; b < mesh.size(); ++b)
      if (b != a) color = color * mesh[b].size + coords[b];
    ncclComm_t split = nullptr;
    r = ncclCommSplit(c->world_, static_cast<int>(color), static_cast<int>(coords[a]), &split,
                      &config);
    if (!split && r != ncclSuccess && r != ncclInProgress) {
      c->abort();
      return failed(me + ": ncclCommSplit for mesh axis '" + mesh[a].name +
                    "' failed: " + nccl_text(r, c->world_));
    }
    c->axes_.push_back(split);
    KILN_RT_TRY(
        c->settle(split ? split : c->world_, r, deadline,
                  me + ": making the communicator of mesh axis '" + mesh[a].name + "'" + waiting));
  }
  *out = std::move(c);
  return nullptr;
}

std::vector<ncclComm_t> Communicators::all() const {
  std::vector<ncclComm_t> v;
  for (ncclComm_t c : axes_)
    if (c && c != world_ && std::find(v.begin(), v.end(), c) == v.end()) v.push_back(c);
  if (world_) v.push_back(world_);
  return v;
}

Communicators::~Communicators() {
  if (aborted_) return;
  // Finalize flushes what is still queued; a peer that vanished could keep it in progress, so
  // it gets a bounded wait and then an abort.
  for (ncclComm_t c : all()) {
    ncclResult_t r = ncclCommFinalize(c);
    const Deadline deadline = Clock::now() + std::chrono::seconds(10);
    int round = 0;
    while (r == ncclInProgress && Clock::now() < deadline) {
      back_off(round);
      if (ncclCommGetAsyncError(c, &r) != ncclSuccess) break;
    }
    if (r == ncclSuccess)
      (void)ncclCommDestroy(c);
    else
      (void)ncclCommAbort(c);
  }
}

kiln_status* Communicators::settle(ncclComm_t comm, ncclResult_t issued, Deadline deadline,
                                   const std::string& what) {
  ncclResult_t r = issued;
  int round = 0;
  while (r == ncclInProgress) {
    if (Clock::now() > deadline) {
      abort();
      return failed(what + ": NCCL did not finish in time; the communicators were aborted");
    }
    back_off(round);
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    r = q != ncclSuccess ? q : state;
  }
  if (r == ncclSuccess) return nullptr;
  const std::string why = nccl_text(r, comm);
  abort();
  return failed(what + ": " + why + "; the communicators were aborted");
}

std::string Communicators::async_error() {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_) return "";
  for (ncclComm_t c : all()) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(c, &state);
    const ncclResult_t r = q != ncclSuccess ? q : state;
    if (r != ncclSuccess && r != ncclInProgress) return nccl_text(r, c);
  }
  return "";
}

void Communicators::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.exchange(true)) return;
  for (ncclComm_t c : all()) (void)ncclCommAbort(c);
}

// ---- CollectiveStep ------------------------------------------------------------------------

namespace {

/// The NCCL type NCCL reduces `dtype` as (the reader has allowed only these for reductions).
ncclDataType_t nccl_type(const std::string& dtype) {
  static const std::map<std::string, ncclDataType_t> kTypes = {
      {"f64", ncclFloat64},      {"f32", ncclFloat32}, {"f16", ncclFloat16},
      {"bf16", ncclBfloat16},    {"i64", ncclInt64},   {"i32", ncclInt32},
      {"i8", ncclInt8},          {"u8", ncclUint8},    {"f8e4m3fn", ncclFloat8e4m3},
      {"f8e5m2", ncclFloat8e5m2}};
  auto it = kTypes.find(dtype);
  return it == kTypes.end() ? ncclUint8 : it->second;
}

int buffer_id(const std::string& ref) { return std::atoi(ref.c_str() + 1); }

}  // namespace

kiln_status* CollectiveStep::create(const artifact::PlanStep& ps, size_t index,
                                    const std::function<const DeviceBuffer*(int)>& buffer,
                                    const Communicators& comms,
                                    const std::vector<artifact::MeshAxis>& mesh,
                                    std::unique_ptr<CollectiveStep>* out) {
  std::unique_ptr<CollectiveStep> s(new CollectiveStep());
  const auto& a = ps.attrs;
  s->op_ = a.at("op");
  const uint64_t count = std::strtoull(a.at("count").c_str(), nullptr, 10);
  const std::string& dtype = a.at("dtype");
  const uint64_t bytes = count * static_cast<uint64_t>(artifact::dtype_bits(dtype)) / 8;
  const bool reduces = s->op_ == "all_reduce" || s->op_ == "reduce_scatter";
  if (a.count("x")) s->x_ = buffer(buffer_id(a.at("x")))->ptr;
  if (a.count("y")) s->y_ = buffer(buffer_id(a.at("y")))->ptr;
  std::string where;
  if (a.count("axis")) {
    for (size_t i = 0; i < mesh.size(); ++i)
      if (mesh[i].name == a.at("axis")) {
        s->comm_ = comms.axis(i);
        s->group_ = static_cast<int>(mesh[i].size);
      }
    where = " over mesh axis '" + a.at("axis") + "'";
    // send/recv along an axis: peer is the position in the axis' communicator (its coordinate).
    if (s->op_ == "send" || s->op_ == "recv") {
      s->root_ = std::atoi(a.at("peer").c_str());
      where = (s->op_ == "send" ? " to position " : " from position ") + a.at("peer") + where;
    }
  } else {
    s->comm_ = comms.world();
    s->root_ = std::atoi(a.at("peer").c_str());
    where = (s->op_ == "send" ? " to rank " : " from rank ") + a.at("peer");
  }
  if (!s->comm_)
    return make_status(KILN_STATUS_INTERNAL,
                       "plan:" + std::to_string(ps.line) + ": no communicator");
  if (reduces) {
    s->type_ = nccl_type(dtype);
    s->count_ = count;
    s->reduce_ = a.at("reduce") == "max" ? ncclMax : ncclSum;
  } else {
    s->count_ = bytes;
  }
  s->block_bytes_ = bytes;
  if (s->op_ == "broadcast") s->root_ = std::atoi(a.at("root").c_str());
  s->label_ = "step " + std::to_string(index) + " (plan line " + std::to_string(ps.line) +
              "): " + s->op_ + where + " of " + a.at("count") + " " + dtype;
  KILN_CUDA_TRY(cudaEventCreateWithFlags(&s->done_, cudaEventDisableTiming));
  *out = std::move(s);
  return nullptr;
}

CollectiveStep::~CollectiveStep() {
  if (done_) (void)cudaEventDestroy(done_);
}

kiln_status* CollectiveStep::enqueue(Communicators& comms, cudaStream_t stream,
                                     Deadline deadline) const {
  if (comms.aborted())
    return failed(label_ + ": the communicators were aborted by an earlier failure");
  ncclResult_t r = ncclSuccess;
  if (op_ == "all_reduce") {
    r = ncclAllReduce(x_, y_, count_, type_, reduce_, comm_, stream);
  } else if (op_ == "reduce_scatter") {
    r = ncclReduceScatter(x_, y_, count_, type_, reduce_, comm_, stream);
  } else if (op_ == "all_gather") {
    r = ncclAllGather(x_, y_, count_, ncclUint8, comm_, stream);
  } else if (op_ == "broadcast") {
    r = ncclBroadcast(x_, y_, count_, ncclUint8, root_, comm_, stream);
  } else if (op_ == "send") {
    r = ncclSend(x_, count_, ncclUint8, root_, comm_, stream);
  } else if (op_ == "recv") {
    r = ncclRecv(y_, count_, ncclUint8, root_, comm_, stream);
  } else {  // all_to_all: NCCL has none; block k goes to group rank k in one group of sends and
            // receives
    r = ncclGroupStart();
    for (int k = 0; k < group_ && r == ncclSuccess; ++k) {
      r = ncclSend(static_cast<const char*>(x_) + static_cast<size_t>(k) * block_bytes_,
                   block_bytes_, ncclUint8, k, comm_, stream);
      if (r == ncclSuccess)
        r = ncclRecv(static_cast<char*>(y_) + static_cast<size_t>(k) * block_bytes_, block_bytes_,
                     ncclUint8, k, comm_, stream);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
  }
  KILN_RT_TRY(comms.settle(comm_, r, deadline, label_));
  // External: inside a captured plan the record is a node of the graph, re-recorded each replay,
  // so the watchdog sees how far a replay got. The flag is only legal while capturing
  // (cudaErrorIllegalState otherwise, seen on an H200): eager runs record plainly.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KILN_CUDA_TRY(cudaStreamIsCapturing(stream, &capture));
  if (capture == cudaStreamCaptureStatusActive) {
    KILN_CUDA_TRY(cudaEventRecordWithFlags(done_, stream, cudaEventRecordExternal));
  } else {
    KILN_CUDA_TRY(cudaEventRecord(done_, stream));
  }
  return nullptr;
}

// ---- Watchdog ------------------------------------------------------------------------------

Watchdog::Watchdog(Communicators& comms, int device, std::chrono::milliseconds timeout)
    : comms_(comms), timeout_(timeout), thread_([this, device] { loop(device); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watchdog::arm(cudaEvent_t done, const std::vector<const CollectiveStep*>* steps,
                   const std::string& rank_text, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  done_ = done;
  steps_ = steps;
  rank_text_ = rank_text;
  what_ = what;
  started_ = Clock::now();
  armed_ = true;
  cv_.notify_all();
}

std::string Watchdog::failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void Watchdog::loop(int device) {
  (void)cudaSetDevice(device);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::milliseconds(armed_ ? 5 : 200));
    if (stop_ || !armed_ || failed_) continue;
    const cudaError_t q = cudaEventQuery(done_);
    if (q != cudaErrorNotReady) {
      // Done, or a device fault that wait() reports.
      (void)cudaGetLastError();
      armed_ = false;
      continue;
    }
    const std::string nccl = comms_.async_error();
    const auto waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started_);
    if (nccl.empty() && waited < timeout_) continue;
    // The first collective step whose event has not completed is where the run waits.
    std::string where = what_;
    for (size_t i = 0; steps_ && i < steps_->size(); ++i)
      if (cudaEventQuery((*steps_)[i]->done()) == cudaErrorNotReady) {
        where = "collective " + (*steps_)[i]->label();
        break;
      }
    (void)cudaGetLastError();
    failure_ = rank_text_ + ": " + where +
               (nccl.empty() ? " did not finish within the collective timeout of " +
                                   dist::seconds_text(timeout_) +
                                   " (did another rank fail, stop, or not reach it?)"
                             : " failed: NCCL reported " + nccl) +
               "; the communicators were aborted and the model cannot run again (load it anew)";
    failed_ = true;
    armed_ = false;
    lock.unlock();
    comms_.abort();
    lock.lock();
    cv_.notify_all();
  }
}

kiln_status* Watchdog::wait(const std::string& function) {
  int round = 0;
  for (;;) {
    // A failure is checked before success: aborting lets the NCCL kernels exit, which also
    // completes the run's event.
    if (failed_) return failed(function + ": " + failure());
    const cudaError_t q = cudaEventQuery(done_);
    if (q == cudaSuccess) {
      if (failed_) return failed(function + ": " + failure());
      std::lock_guard<std::mutex> lock(mu_);
      armed_ = false;
      return nullptr;
    }
    if (q != cudaErrorNotReady) {
      std::lock_guard<std::mutex> lock(mu_);
      armed_ = false;
      kiln_status* st = cuda_status(q, "cudaEventQuery");
      st->message = function + ": " + st->message;
      return st;
    }
    back_off(round);
  }
}

}  // namespace kiln::rt
