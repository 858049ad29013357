// Raw NCCL all-reduce and all-gather bus bandwidth, the baseline Kiln's collectives are held
// to (bench/parallel/run.py). One process per rank under a launcher (kiln launch, torchrun):
// rank 0 hands NCCL's id to the others with Kiln's own hand-off (kiln/distributed.h), then each
// size runs `--warmup` untimed and `--iterations` timed operations back to back on one stream,
// timed with CUDA events as nccl-tests does. Rank 0 prints one JSON object per line:
//   {"op": "all_reduce", "bytes": N, "ms": T, "algbw_gbs": A, "busbw_gbs": B, "ranks": R}
// all_reduce: bytes = the buffer each rank holds, busbw = algbw * 2 (R - 1) / R;
// all_gather: bytes = the gathered buffer, busbw = algbw * (R - 1) / R.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kiln/distributed.h"

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "kiln-nccl-bench: error: %s\n", msg.c_str());
  return 1;
}

#define CHECK_CUDA(call)                                             \
  do {                                                               \
    if (cudaError_t e_ = (call); e_ != cudaSuccess)                  \
      return fail(#call ": " + std::string(cudaGetErrorString(e_))); \
  } while (0)
#define CHECK_NCCL(call)                                             \
  do {                                                               \
    if (ncclResult_t r_ = (call); r_ != ncclSuccess)                 \
      return fail(#call ": " + std::string(ncclGetErrorString(r_))); \
  } while (0)

uint64_t number(const char* text) {
  uint64_t v = 0;
  std::from_chars(text, text + std::strlen(text), v);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t min_bytes = 1 << 20, max_bytes = uint64_t{1} << 30;
  int warmup = 5, iterations = 20;
  std::vector<std::string> ops = {"all_reduce", "all_gather"};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--min-bytes")
      min_bytes = number(argv[i + 1]);
    else if (flag == "--max-bytes")
      max_bytes = number(argv[i + 1]);
    else if (flag == "--warmup")
      warmup = static_cast<int>(number(argv[i + 1]));
    else if (flag == "--iterations")
      iterations = static_cast<int>(number(argv[i + 1]));
    else if (flag == "--op")
      ops = {argv[i + 1]};
    else
      return fail("unknown option '" + flag +
                  "' (--min-bytes, --max-bytes, --warmup, --iterations, --op)");
  }
  kiln::dist::LaunchInfo info;
  std::string error;
  if (kiln::dist::find_launch(&info, &error) == kiln::dist::LaunchFound::kError) return fail(error);
  const int device = kiln::dist::launch_device(&error);
  if (device < 0) return fail(error);
  CHECK_CUDA(cudaSetDevice(device));
  ncclUniqueId id{};
  if (info.rank == 0) CHECK_NCCL(ncclGetUniqueId(&id));
  kiln::dist::UniqueId bytes{};
  std::memcpy(bytes.data(), &id, sizeof id);
  if (!kiln::dist::exchange_unique_id(info, &bytes, std::chrono::seconds(120), &error))
    return fail(error);
  std::memcpy(&id, bytes.data(), sizeof id);
  ncclComm_t comm = nullptr;
  CHECK_NCCL(ncclCommInitRank(&comm, info.world_size, id, info.rank));
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  char* buf = nullptr;
  CHECK_CUDA(cudaMalloc(&buf, 2 * max_bytes));
  CHECK_CUDA(cudaMemset(buf, 0, 2 * max_bytes));
  cudaEvent_t start = nullptr, stop = nullptr;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  const double n = info.world_size;
  for (const std::string& op : ops) {
    if (op != "all_reduce" && op != "all_gather") return fail("unknown op '" + op + "'");
    for (uint64_t size = min_bytes; size <= max_bytes; size *= 2) {
      const uint64_t per_rank =
          op == "all_gather" ? size / static_cast<uint64_t>(info.world_size) : size;
      const size_t count = per_rank / sizeof(float);
      const auto issue = [&]() -> ncclResult_t {
        if (op == "all_reduce")
          return ncclAllReduce(buf, buf + max_bytes, count, ncclFloat32, ncclSum, comm, stream);
        return ncclAllGather(buf, buf + max_bytes, count, ncclFloat32, comm, stream);
      };
      for (int i = 0; i < warmup; ++i) CHECK_NCCL(issue());
      CHECK_CUDA(cudaEventRecord(start, stream));
      for (int i = 0; i < iterations; ++i) CHECK_NCCL(issue());
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float total = 0;
      CHECK_CUDA(cudaEventElapsedTime(&total, start, stop));
      const double ms = total / iterations;
      const double algbw = static_cast<double>(size) / (ms * 1e-3) / 1e9;
      const double busbw = algbw * (op == "all_reduce" ? 2 * (n - 1) / n : (n - 1) / n);
      if (info.rank == 0)
        std::printf(
            "{\"op\": \"%s\", \"bytes\": %llu, \"ms\": %.6f, \"algbw_gbs\": %.3f, \"busbw_gbs\": "
            "%.3f, "
            "\"ranks\": %d}\n",
            op.c_str(), static_cast<unsigned long long>(size), ms, algbw, busbw, info.world_size);
      std::fflush(stdout);
    }
  }
  (void)cudaFree(buf);
  (void)ncclCommDestroy(comm);
  return 0;
}
