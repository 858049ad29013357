// kiln-read-roofline: how fast this GPU can read N bytes once from cold memory, the floor under
// any weight-streaming kernel (an INT4 GEMM at small M must read its packed weights and scales at
// least once, and so must cuBLAS its bf16 weights).
//
//   kiln-read-roofline [--bytes N[,N...]] [--iters I] [--json FILE]
//   kiln-read-roofline --compile-only ARCH     (builds the kernels for e.g. sm_90; no GPU needed)
//
// For each size, sweeps a family of read-only kernels (grid-stride or one contiguous chunk per
// block; 1-8 independent 16-byte loads in flight per thread; plain, non-coherent, and
// non-coherent with the L2 256-byte prefetch hint; several grid and block sizes) and reports the
// fastest median and its shape. Each timed launch is preceded by the runtime's own timing kernels
// (runtime/src/timing_kernels.h), as in `kiln bench` with KILN_TIMING_FLUSH_L2=1: a sweep that
// reads twice the L2 size of other memory, then the 50 us device-side wait; CUDA events bracket
// the launch: device time from cold L2, no host dispatch. The read kernels are built with Kiln's
// NVRTC driver (backends/cuda, through the kernel cache) for the device's own architecture.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kiln/cuda/nvrtc.h"
#include "timing_kernels.h"

namespace {

constexpr int kLoadsPerThread[] = {1, 2, 4, 8};
struct Hint {
  const char* name;
  const char* ptx;  // the load instruction, before its operand type
};
constexpr Hint kHints[] = {{"plain", "ld.global"}, {"nc", "ld.global.nc"}, {"nc-L2-256B", "ld.global.nc.L2::256B"}};
constexpr const char* kModes[] = {"grid-stride", "chunk"};
constexpr int kBlockThreads[] = {256, 512, 1024};
constexpr int kBlocksPerSm[] = {1, 2, 4, 8, 16};

// One kernel per (mode, loads in flight, hint): KILN_READ(NAME, CHUNK, U, LOAD). Every thread xors
// what it reads and stores only if the result equals `never` (never, for a zeroed buffer and
// never = 1), so nothing is written and the loads cannot be dropped.
constexpr const char* kSource = R"(
#define KILN_READ(NAME, CHUNK, U, LOAD)                                                          \
extern "C" __global__ void NAME(const uint4* p, unsigned long long n, unsigned never,           \
                                unsigned* out) {                                                 \
  unsigned long long begin = 0, end = n, i, stride;                                             \
  if (CHUNK) {                                                                                   \
    const unsigned long long per = (n + gridDim.x - 1) / gridDim.x;                             \
    begin = per * blockIdx.x;                                                                    \
    end = begin + per < n ? begin + per : n;                                                     \
    i = begin + threadIdx.x;                                                                     \
    stride = blockDim.x;                                                                         \
  } else {                                                                                       \
    i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;                              \
    stride = (unsigned long long)gridDim.x * blockDim.x;                                         \
  }                                                                                              \
  unsigned acc = 0;                                                                              \
  for (; i + (U - 1) * stride < end; i += U * stride) {                                          \
    uint4 v[U];                                                                                  \
    _Pragma("unroll") for (int u = 0; u < U; ++u) v[u] = LOAD(p + i + u * stride);               \
    _Pragma("unroll") for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;     \
  }                                                                                              \
  for (; i < end; i += stride) {                                                                 \
    const uint4 v = LOAD(p + i);                                                                 \
    acc ^= v.x ^ v.y ^ v.z ^ v.w;                                                                \
  }                                                                                              \
  if (acc == never) *out = acc;                                                                  \
}
#define KILN_LOAD_FN(FN, INSTR)                                                                  \
__device__ __forceinline__ uint4 FN(const uint4* q) {                                            \
  uint4 v;                                                                                       \
  asm volatile(INSTR ".v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z),        \
               "=r"(v.w) : "l"(q));                                                              \
  return v;                                                                                      \
}
)";

std::string kernel_name(int mode, int u, int hint) {
  return std::string("read_") + (mode ? "chunk" : "grid") + "_u" + std::to_string(u) + "_h" + std::to_string(hint);
}

std::string full_source() {
  std::string s = kSource;
  for (int h = 0; h < int(std::size(kHints)); ++h)
    s += "KILN_LOAD_FN(load_h" + std::to_string(h) + ", \"" + kHints[h].ptx + "\")\n";
  for (int mode = 0; mode < 2; ++mode)
    for (int u : kLoadsPerThread)
      for (int h = 0; h < int(std::size(kHints)); ++h)
        s += "KILN_READ(" + kernel_name(mode, u, h) + ", " + std::to_string(mode) + ", " + std::to_string(u) +
             ", load_h" + std::to_string(h) + ")\n";
  return s;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "kiln-read-roofline: %s\n", what.c_str());
  std::exit(1);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}

/// Builds the kernels for `arch` (e.g. "sm_90") and returns the CUBIN.
std::string compile(const std::string& arch) {
  kiln::StatusOr<std::string> cubin = kiln::cuda::compile_cuda(full_source(), arch, "kiln-read-roofline");
  if (!cubin.ok()) die("compiling the read kernels for " + arch + " failed: " + cubin.status().message());
  return std::move(cubin).value();
}

struct Result {
  double ms;
  std::string mode, hint;
  int loads, threads, blocks;
};

std::vector<unsigned long long> parse_sizes(const char* s) {
  std::vector<unsigned long long> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(p, &end, 10);
    if (end == p || v == 0 || v % 16 || (*end && *end != ','))
      die(std::string("--bytes wants positive multiples of 16, comma-separated; got '") + s + "'");
    out.push_back(v);
    p = *end ? end + 1 : end;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<unsigned long long> sizes = {34603008ull, 134217728ull};
  int iters = 100;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--bytes" && i + 1 < argc) sizes = parse_sizes(argv[++i]);
    else if (a == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
      if (iters < 1 || iters > 100000) die("--iters wants 1..100000");
    } else if (a == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (a == "--compile-only" && i + 1 < argc) {
      const std::string arch = argv[++i];
      std::printf("built %zu bytes of CUBIN for %s\n", compile(arch).size(), arch.c_str());
      return 0;
    } else {
      std::fprintf(stderr, "usage: kiln-read-roofline [--bytes N[,N...]] [--iters I] [--json FILE] | --compile-only ARCH\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) die("no CUDA GPU here: this tool measures one");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const std::string arch = "sm_" + std::to_string(prop.major) + std::to_string(prop.minor);
  const std::string cubin = compile(arch);
  cudaLibrary_t lib;
  check(cudaLibraryLoadData(&lib, cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0), "cudaLibraryLoadData");
  auto kernel = [&](const std::string& name) {
    cudaKernel_t k;
    check(cudaLibraryGetKernel(&k, lib, name.c_str()), "cudaLibraryGetKernel");
    return reinterpret_cast<const void*>(k);
  };
  cudaLibrary_t timing_lib;
  check(cudaLibraryLoadData(&timing_lib, kiln::rt::kTimingPtx, nullptr, nullptr, 0, nullptr, nullptr, 0),
        "cudaLibraryLoadData (the runtime's timing kernels)");
  cudaKernel_t sweep, wait;
  check(cudaLibraryGetKernel(&sweep, timing_lib, "kiln_l2_sweep"), "cudaLibraryGetKernel");
  check(cudaLibraryGetKernel(&wait, timing_lib, "kiln_timing_lead"), "cudaLibraryGetKernel");

  const unsigned long long max_bytes = *std::max_element(sizes.begin(), sizes.end());
  unsigned long long flush_bytes = kiln::rt::l2_sweep_bytes(prop.l2CacheSize);
  void *buf = nullptr, *flush = nullptr, *sink = nullptr;
  check(cudaMalloc(&buf, max_bytes), "cudaMalloc (buffer)");
  check(cudaMalloc(&flush, flush_bytes), "cudaMalloc (L2 flush)");
  check(cudaMalloc(&sink, 16), "cudaMalloc");
  check(cudaMemset(buf, 0, max_bytes), "cudaMemset");
  check(cudaMemset(flush, 0, flush_bytes), "cudaMemset");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  unsigned never = 1;
  unsigned long long wait_ns = kiln::rt::kTimingLeadNs;

  // Median device ms of `iters` cold launches of `k` over `bytes` of the buffer.
  auto time_cold = [&](const void* k, unsigned long long bytes, int blocks, int threads) {
    unsigned long long n = bytes / 16;
    void* args[] = {&buf, &n, &never, &sink};
    void* flush_args[] = {&flush, &flush_bytes, &never};
    void* wait_args[] = {&wait_ns};
    std::vector<float> t;
    for (int it = 0; it < iters + 3; ++it) {
      check(cudaLaunchKernel(reinterpret_cast<const void*>(sweep), dim3(kiln::rt::kL2SweepBlocks),
                             dim3(kiln::rt::kL2SweepThreads), flush_args, 0, stream), "launch (L2 sweep)");
      check(cudaLaunchKernel(reinterpret_cast<const void*>(wait), dim3(1), dim3(1), wait_args, 0, stream), "launch (wait)");
      check(cudaEventRecord(e0, stream), "cudaEventRecord");
      check(cudaLaunchKernel(k, dim3(blocks), dim3(threads), args, 0, stream), "launch (read)");
      check(cudaEventRecord(e1, stream), "cudaEventRecord");
      check(cudaEventSynchronize(e1), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
      if (it >= 3) t.push_back(ms);  // the first launches load the module
    }
    std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
    return double(t[t.size() / 2]);
  };

  std::string json = "{\"device\": \"" + std::string(prop.name) + "\", \"sms\": " +
                     std::to_string(prop.multiProcessorCount) + ", \"l2_bytes\": " + std::to_string(prop.l2CacheSize) +
                     ", \"iters\": " + std::to_string(iters) + ", \"sizes\": [";
  std::printf("%s, %d SMs, L2 %d MB; cold-L2 device time, median of %d\n\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, iters);
  std::printf("| bytes | fastest ms | TB/s | shape (mode, loads/thread, hint, threads x blocks) |\n|---|---:|---:|---|\n");
  for (size_t si = 0; si < sizes.size(); ++si) {
    const unsigned long long bytes = sizes[si];
    std::vector<Result> results;
    for (int mode = 0; mode < 2; ++mode)
      for (int u : kLoadsPerThread)
        for (int h = 0; h < int(std::size(kHints)); ++h) {
          const void* k = kernel(kernel_name(mode, u, h));
          for (int threads : kBlockThreads)
            for (int per_sm : kBlocksPerSm) {
              const int blocks = per_sm * prop.multiProcessorCount;
              if (per_sm * threads > prop.maxThreadsPerMultiProcessor) continue;  // would not be co-resident
              results.push_back({time_cold(k, bytes, blocks, threads), kModes[mode], kHints[h].name, u, threads, blocks});
            }
        }
    std::sort(results.begin(), results.end(), [](const Result& a, const Result& b) { return a.ms < b.ms; });
    const Result& best = results.front();
    std::printf("| %llu | %.4f | %.2f | %s, %d, %s, %d x %d |\n", bytes, best.ms, bytes / (best.ms * 1e-3) / 1e12,
                best.mode.c_str(), best.loads, best.hint.c_str(), best.threads, best.blocks);
    json += std::string(si ? ", " : "") + "{\"bytes\": " + std::to_string(bytes) + ", \"results\": [";
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      char line[256];
      std::snprintf(line, sizeof line,
                    "%s{\"ms\": %.5f, \"mode\": \"%s\", \"loads\": %d, \"hint\": \"%s\", \"threads\": %d, \"blocks\": %d}",
                    i ? ", " : "", r.ms, r.mode.c_str(), r.loads, r.hint.c_str(), r.threads, r.blocks);
      json += line;
    }
    json += "]}";
  }
  json += "]}\n";
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << json;
    if (!f) die("cannot write " + json_path);
  }
  cudaLibraryUnload(lib);
  cudaLibraryUnload(timing_lib);
  return 0;
}
