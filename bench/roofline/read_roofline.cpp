// kiln-read-roofline: how fast this GPU can read N bytes once from cold memory, the floor under
// any weight-streaming kernel (an INT4 GEMM at small M must read its packed weights and scales at
// least once, and so must cuBLAS its bf16 weights).
//
//   kiln-read-roofline [--bytes N[,N...]] [--iters I] [--json FILE]
//   kiln-read-roofline --compile-only ARCH     (builds the kernels for e.g. sm_90; no GPU needed)
//
// For each size, sweeps a family of read-only kernels (grid-stride or one contiguous chunk per
// block; 1-8 independent 16-byte loads in flight per thread; plain, non-coherent, and
// non-coherent with the L2 256-byte prefetch hint; several grid and block sizes; on sm_90 and
// later also cp.async.bulk rings into shared memory, the "loads" column then being the ring's
// stages) and reports the fastest median and its shape. Each timed launch is preceded by the
// runtime's own timing kernels (runtime/src/timing_kernels.h), as in `kiln bench` with
// KILN_TIMING_FLUSH_L2=1: a sweep that reads twice the L2 size of other memory, then the 50 us
// device-side wait; CUDA events bracket the launch: device time from cold L2, no host dispatch. The read kernels are built with Kiln's
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
// Bulk copies (sm_90+): one thread streams the block's chunk into a ring of STAGES shared-memory
// buffers of STAGE_BYTES with cp.async.bulk, each completing on its own mbarrier; with CONSUME every
// thread then reads the stage and the block meets before the buffer is refilled (the shape of a
// weight stream feeding compute warps), without it thread 0 alone waits and touches one word
// (the copy engine's own rate).
__device__ __forceinline__ unsigned kiln_smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
template <int STAGES, int STAGE_BYTES, bool CONSUME>
__device__ __forceinline__ void kiln_read_bulk(const uint4* p, unsigned long long n, unsigned never, unsigned* out) {
#if __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint4 stage[];
  __shared__ __align__(8) unsigned long long full[STAGES];
  constexpr unsigned long long kTile = STAGE_BYTES / 16;
  const unsigned long long per = (n + gridDim.x - 1) / gridDim.x;
  const unsigned long long begin = per * blockIdx.x < n ? per * blockIdx.x : n;
  const unsigned long long end = begin + per < n ? begin + per : n;
  const int tiles = int((end - begin + kTile - 1) / kTile);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(kiln_smem_addr(&full[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (!CONSUME && threadIdx.x != 0) return;
  auto issue = [&](int t) {
    const int s = t % STAGES;
    const unsigned long long off = begin + (unsigned long long)t * kTile;
    const unsigned bytes = unsigned((end - off < kTile ? end - off : kTile) * 16);
    const unsigned bar = kiln_smem_addr(&full[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(kiln_smem_addr(stage + s * kTile)), "l"(p + off), "r"(bytes), "r"(bar) : "memory");
  };
  if (threadIdx.x == 0)
    for (int t = 0; t < STAGES && t < tiles; ++t) issue(t);
  unsigned acc = 0;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % STAGES;
    const unsigned bar = kiln_smem_addr(&full[s]), parity = unsigned(t / STAGES) & 1u;
    unsigned done = 0;
    while (!done)
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    if (CONSUME) {
      const unsigned long long off = begin + (unsigned long long)t * kTile;
      const unsigned cnt = unsigned(end - off < kTile ? end - off : kTile);
      for (unsigned i = threadIdx.x; i < cnt; i += blockDim.x) {
        const uint4 v = stage[s * kTile + i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
      __syncthreads();  // every thread is done with stage s before it is refilled
    } else {
      acc ^= stage[s * kTile].x;
    }
    if (threadIdx.x == 0 && t + STAGES < tiles) issue(t + STAGES);
  }
  if (acc == never) *out = acc;
#endif
}
#define KILN_READ_BULK(NAME, STAGES, STAGE_BYTES, CONSUME)                                       \
extern "C" __global__ void NAME(const uint4* p, unsigned long long n, unsigned never, unsigned* out) { \
  kiln_read_bulk<STAGES, STAGE_BYTES, CONSUME>(p, n, never, out);                                \
}
#define KILN_LOAD_FN(FN, INSTR)                                                                  \
__device__ __forceinline__ uint4 FN(const uint4* q) {                                            \
  uint4 v;                                                                                       \
  asm volatile(INSTR ".v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z),        \
               "=r"(v.w) : "l"(q));                                                              \
  return v;                                                                                      \
}
)";

// Bulk-copy rings (sm_90 and later): stages x bytes per stage, at most 192 KiB of shared memory.
struct BulkShape {
  int stages, stage_bytes;
};
constexpr BulkShape kBulkShapes[] = {{2, 16384}, {4, 8192}, {4, 16384}, {4, 32768}, {8, 8192}, {8, 16384}, {6, 32768}};
constexpr int kBulkThreads[] = {128, 256, 512};

std::string bulk_name(const BulkShape& b, bool consume) {
  return "read_bulk_s" + std::to_string(b.stages) + "_b" + std::to_string(b.stage_bytes) + (consume ? "_read" : "_copy");
}

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
  for (const BulkShape& b : kBulkShapes)
    for (bool consume : {true, false})
      s += "KILN_READ_BULK(" + bulk_name(b, consume) + ", " + std::to_string(b.stages) + ", " +
           std::to_string(b.stage_bytes) + ", " + (consume ? "true" : "false") + ")\n";
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
  auto time_cold = [&](const void* k, unsigned long long bytes, int blocks, int threads, int smem = 0) {
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
      check(cudaLaunchKernel(k, dim3(blocks), dim3(threads), args, smem, stream), "launch (read)");
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
    if (prop.major >= 9)
      for (const BulkShape& b : kBulkShapes)
        for (bool consume : {true, false}) {
          const void* k = kernel(bulk_name(b, consume));
          const int smem = b.stages * b.stage_bytes;
          if (smem > int(prop.sharedMemPerBlockOptin)) continue;
          check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                "cudaFuncSetAttribute (bulk ring)");
          const std::string mode = "bulk " + std::to_string(b.stages) + " x " + std::to_string(b.stage_bytes / 1024) + " KiB";
          for (int threads : consume ? std::vector<int>(std::begin(kBulkThreads), std::end(kBulkThreads)) : std::vector<int>{32})
            for (int per_sm : kBlocksPerSm) {
              // +1 KiB: the runtime's per-block reservation and the mbarriers.
              if (per_sm * threads > prop.maxThreadsPerMultiProcessor ||
                  per_sm * (smem + 1024) > int(prop.sharedMemPerMultiprocessor))
                continue;
              const int blocks = per_sm * prop.multiProcessorCount;
              results.push_back({time_cold(k, bytes, blocks, threads, smem), mode,
                                 consume ? "smem-read" : "copy-only", b.stages, threads, blocks});
            }
        }
    std::sort(results.begin(), results.end(), [](const Result& a, const Result& b) { return a.ms < b.ms; });
    const Result& best = results.front();
    std::printf("| %llu | %.4f | %.2f | %s, %d, %s, %d x %d |\n", bytes, best.ms, bytes / (best.ms * 1e-3) / 1e12,
                best.mode.c_str(), best.loads, best.hint.c_str(), best.threads, best.blocks);
    // The fastest of each family, so loads and bulk rings can be compared as well as ranked.
    for (const char* family : {"grid-stride", "chunk", "bulk"}) {
      auto it = std::find_if(results.begin(), results.end(),
                             [&](const Result& r) { return r.mode.rfind(family, 0) == 0; });
      if (it != results.end() && &*it != &best)
        std::printf("| %llu | %.4f | %.2f | fastest %s: %s, %d, %s, %d x %d |\n", bytes, it->ms,
                    bytes / (it->ms * 1e-3) / 1e12, family, it->mode.c_str(), it->loads, it->hint.c_str(),
                    it->threads, it->blocks);
    }
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
