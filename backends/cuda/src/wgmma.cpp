// Hopper warpgroup-MMA (wgmma) device helpers for the kernels that issue it (attention's
// warp-specialized kernel). Everything here is sm_90a-only source:
// it compiles to nothing in the other images of a plan, whose kernels take their mma.sync
// paths there.
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

const char* kWgmmaCore = R"(
#define KILN_WGMMA_CORE
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (N/2 f32 per thread) = A·B (+ d when sd != 0); A and B from shared memory, both K-major.
template <int N, typename T> __device__ void kiln_wgmma_ss(float* d, unsigned long long da, unsigned long long db, int sd);
// d += A·B; A from registers (4 x b32 per thread), B from shared memory, MN-major.
template <int N, typename T> __device__ void kiln_wgmma_rs(float* d, const unsigned* a, unsigned long long db);
__device__ __forceinline__ void kiln_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void kiln_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void kiln_wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keeps the compiler from moving reads or writes of wgmma accumulators across the async MMA.
template <int N> __device__ __forceinline__ void kiln_wg_pin(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory writes of the generic proxy (st.shared, cp.async) made visible to wgmma's
// reads, which go through the async proxy.
__device__ __forceinline__ void kiln_wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Shared-memory matrix descriptor with the 128-byte swizzle: start, leading and stride byte
// offsets (each >> 4) in bits 0-13, 16-29, 32-45; layout 1 (128B) in bits 62-63.
__device__ __forceinline__ unsigned long long kiln_wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (unsigned long long)((lbo & 0x3FFFF) >> 4) << 16 |
         (unsigned long long)((sbo & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}
// Element offset of (row r, 16-byte chunk c) in a tile of R rows stored as D/64 column blocks
// of [R][64] with 128-byte rows whose chunks are XOR-swizzled by the row (the canonical
// 128B-swizzle layout; the block base must be 1024-byte aligned).
template <int R> __device__ __forceinline__ int kiln_wg_sw(int r, int c) {
  return (c / 8) * R * 64 + r * 64 + ((c % 8) ^ (r % 8)) * 8;
}
#endif
)";

/// The name a wrapper of `form` has in the source.
const char* wrapper_name(WgmmaForm form) {
  switch (form) {
    case WgmmaForm::kSharedShared: return "kiln_wgmma_ss";
    case WgmmaForm::kRegsMnMajorB: return "kiln_wgmma_rs";
  }
  return "";
}

/// One wrapper specialization (the asm operand list has n/2 accumulators, which is why it is
/// generated): m64nNk16 with f32 accumulators and st (__half or __nv_bfloat16) operands.
std::string wgmma_wrapper(WgmmaForm form, int64_t n, const std::string& st) {
  // The register form always accumulates; the shared-memory form takes a zeroing flag.
  const bool rs = form == WgmmaForm::kRegsMnMajorB, flag_arg = !rs;
  const std::string ab = st == "__half" ? "f16" : "bf16";
  const int64_t h = n / 2;
  std::string text = "#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\ntemplate <> __device__ __forceinline__ void " +
                     std::string(wrapper_name(form)) + "<" + std::to_string(n) + ", " + st + ">(float* d, " +
                     (rs ? "const unsigned* a, unsigned long long db" : "unsigned long long da, unsigned long long db") +
                     (flag_arg ? ", int sd) {\n" : ") {\n") + "  asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, %" +
                     std::to_string(h + (rs ? 5 : 2)) + ", 0;\\nwgmma.mma_async.sync.aligned.m64n" + std::to_string(n) +
                     "k16.f32." + ab + "." + ab + " {";
  for (int64_t i = 0; i < h; ++i) text += (i ? ", %" : "%") + std::to_string(i);
  if (rs)
    // scale-d, scale-a, scale-b, and B's transpose flag (1: MN-major).
    text += "}, {%" + std::to_string(h) + ", %" + std::to_string(h + 1) + ", %" +
            std::to_string(h + 2) + ", %" + std::to_string(h + 3) + "}, %" + std::to_string(h + 4) +
            ", p, 1, 1, 1;\\n}\\n\"\n      : ";
  else
    text += "}, %" + std::to_string(h) + ", %" + std::to_string(h + 1) + ", p, 1, 1, 0, 0;\\n}\\n\"\n      : ";
  for (int64_t i = 0; i < h; ++i) text += (i ? ", \"+f\"(d[" : "\"+f\"(d[") + std::to_string(i) + "])";
  const std::string flag = flag_arg ? "\"r\"(sd)" : "\"r\"(1)";
  text += rs ? "\n      : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(db), " + flag + ");\n}\n#endif\n"
             : "\n      : \"l\"(da), \"l\"(db), " + flag + ");\n}\n#endif\n";
  return text;
}

}  // namespace

void Lowerer::add_wgmma(WgmmaForm form, int64_t n, const std::string& st) {
  if (source_.find("#define KILN_WGMMA_CORE") == std::string::npos) source_ += kWgmmaCore;
  const std::string key = std::string(wrapper_name(form)) + "<" + std::to_string(n) + ", " + st + ">(";
  if (source_.find(key) == std::string::npos) source_ += wgmma_wrapper(form, n, st);
}

}  // namespace kiln::cuda::detail
