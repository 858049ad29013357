// CUDA lowering of attention: one flash-attention kernel per node (mma.sync for f16/bf16, CUDA cores else).
//
// Both kernels keep the running row max and sum of an online softmax in f32 and never write
// the score matrix: a block owns a tile of query rows of one (batch, head), walks the key
// blocks it can see (causal blocks past the diagonal are skipped), rescales its output
// accumulator when the max grows and divides by the sum once at the end. Scores are kept
// in the log2 domain (scale·log2 e folded into one multiplier) so exp is one exp2f.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>

#include "attention_f32.h"
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

/// Device helpers shared by every attention kernel in one source (defined once).
const char* kHelpers = R"(
#define KILN_ATTN_HELPERS
#define KILN_LOG2E 1.4426950408889634f
#define KILN_ATTN_INF __int_as_float(0x7f800000)
// Key blocks of BN keys that the query rows [q0, q0 + BM) see: all of them, or when causal those
// up to the diagonal of row q0 + BM - 1 (key j visible to row i iff j <= i + Skv - Sq); 0 if none.
template <bool CAUSAL>
__device__ __forceinline__ int kiln_attn_key_blocks(int q0, int BM, int BN, int Sq, int Skv) {
  const int all = (Skv + BN - 1) / BN;
  if (!CAUSAL) return all;
  const int last = q0 + BM - 1 + Skv - Sq;
  return min(all, last < 0 ? 0 : last / BN + 1);
}
// Sizes, the scale, mask strides and element strides of batch, head and sequence for q, k, v
// and y (the innermost dim is contiguous): transposes around attention are read through them.
struct KilnAttnArgs {
  int Hq, Hkv, Sq, Skv;
  float scale_log2;
  long long msb, msh, msi, msj;
  long long qb, qh, qs, kb, kh, ks, vb, vh, vs, yb, yh, ys;
};
__device__ __forceinline__ float kiln_attn_f(float x) { return x; }
__device__ __forceinline__ float kiln_attn_f(double x) { return (float)x; }
__device__ __forceinline__ float kiln_attn_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float kiln_attn_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void kiln_attn_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void kiln_attn_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void kiln_attn_store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ unsigned kiln_attn_pack(float a, float b, const __half*) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ unsigned kiln_attn_pack(float a, float b, const __nv_bfloat16*) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned*>(&v);
}
// D += A·B on one m16n8k16 tile; A, B 16-bit, D f32.
__device__ __forceinline__ void kiln_attn_mma(float* c, const unsigned* a, unsigned b0, unsigned b1, const __half*) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void kiln_attn_mma(float* c, const unsigned* a, unsigned b0, unsigned b1, const __nv_bfloat16*) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void kiln_attn_ldsm(unsigned* r, const void* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void kiln_attn_ldsm_t(unsigned* r, const void* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// 16 bytes global -> shared, zero-filled when !valid (rows past the sequence end).
__device__ __forceinline__ void kiln_attn_cp16(void* s, const void* g, bool valid) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(g), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void kiln_attn_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void kiln_attn_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Tensor-core flash attention (FlashAttention-2 layout): NW warps own 16·WM query rows each
// (by default 4 warps of two m16 tiles, so every K and V fragment read from shared memory
// feeds four mma, for a 128-row tile); K and V tiles of 64 keys are double-buffered through cp.async; Q is re-read from
// shared memory per k-step to leave registers to the accumulators; P stays in registers and
// feeds the P·V mma directly. Requires Dv == D, D % 16 == 0.
template <typename T, int D, bool CAUSAL, bool HAS_MASK, typename MT, int WM = 2, int NW = 4>
__device__ __forceinline__ void kiln_flash_attn(const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const MT* __restrict__ mask, T* __restrict__ y, const KilnAttnArgs& a) {
  constexpr int BM = NW * 16 * WM, BN = 64, NT = NW * 32, LD = D + 8, CH = D / 8;
  const int Sq = a.Sq, Skv = a.Skv;
  extern __shared__ __align__(16) unsigned char kiln_attn_smem[];
  T* sQ = reinterpret_cast<T*>(kiln_attn_smem);
  T* sK = sQ + BM * LD;
  T* sV = sK + 2 * BN * LD;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // Causal tiles near the end see the most keys: start them first.
  const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (a.Hq / a.Hkv);
  const T* qp = q + b * a.qb + h * a.qh;
  const T* kp = k + b * a.kb + hk * a.kh;
  const T* vp = v + b * a.vb + hk * a.vh;
  const int off = Skv - Sq;
  const int nblocks = kiln_attn_key_blocks<CAUSAL>(q0, BM, BN, Sq, Skv);
  for (int c = tid; c < BM * CH; c += NT) {
    const int r = c / CH, cc = c % CH;
    const bool ok = q0 + r < Sq;
    kiln_attn_cp16(sQ + r * LD + cc * 8, qp + (ok ? q0 + r : 0) * a.qs + cc * 8, ok);
  }
  auto load_kv = [&](int blk, int buf) {
    const int n0 = blk * BN;
    for (int c = tid; c < BN * CH; c += NT) {
      const int r = c / CH, cc = c % CH;
      const bool ok = n0 + r < Skv;
      const long long row = ok ? n0 + r : 0;
      kiln_attn_cp16(sK + (buf * BN + r) * LD + cc * 8, kp + row * a.ks + cc * 8, ok);
      kiln_attn_cp16(sV + (buf * BN + r) * LD + cc * 8, vp + row * a.vs + cc * 8, ok);
    }
  };
  if (nblocks > 0) load_kv(0, 0);
  kiln_attn_commit();
  float o[WM][D / 8][4];
#pragma unroll
  for (int m = 0; m < WM; ++m)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[m][i][0] = o[m][i][1] = o[m][i][2] = o[m][i][3] = 0.f;
  float mrow[WM][2], lrow[WM][2];
#pragma unroll
  for (int m = 0; m < WM; ++m) mrow[m][0] = mrow[m][1] = -KILN_ATTN_INF, lrow[m][0] = lrow[m][1] = 0.f;
  const int wrow = q0 + warp * 16 * WM;  // the warp's first query row
  const int mat = lane / 8;
  for (int it = 0; it < nblocks; ++it) {
    if (it + 1 < nblocks) {
      load_kv(it + 1, (it + 1) & 1);
      kiln_attn_commit();
      kiln_attn_wait<1>();
    } else {
      kiln_attn_wait<0>();
    }
    __syncthreads();
    const T* cK = sK + (it & 1) * BN * LD;
    const T* cV = sV + (it & 1) * BN * LD;
    const int n0 = it * BN;
    if (!CAUSAL || n0 <= wrow + 16 * WM - 1 + off) {  // else every key of this block is after the warp's rows
      float s[WM][BN / 8][4];
#pragma unroll
      for (int m = 0; m < WM; ++m)
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) s[m][j][0] = s[m][j][1] = s[m][j][2] = s[m][j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        unsigned qa[WM][4];
#pragma unroll
        for (int m = 0; m < WM; ++m)
          kiln_attn_ldsm(qa[m], sQ + (warp * 16 * WM + m * 16 + (lane % 8) + (mat % 2) * 8) * LD + kk * 16 + (mat / 2) * 8);
#pragma unroll
        for (int j = 0; j < BN / 8; j += 2) {
          unsigned bf[4];
          kiln_attn_ldsm(bf, cK + (j * 8 + (lane % 8) + (mat / 2) * 8) * LD + kk * 16 + (mat % 2) * 8);
#pragma unroll
          for (int m = 0; m < WM; ++m) {
            kiln_attn_mma(s[m][j], qa[m], bf[0], bf[1], q);
            kiln_attn_mma(s[m][j + 1], qa[m], bf[2], bf[3], q);
          }
        }
      }
      const bool edge = n0 + BN > Skv || (CAUSAL && n0 + BN - 1 > wrow + off);
#pragma unroll
      for (int m = 0; m < WM; ++m) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n0 + j * 8 + 2 * t + (e & 1), row = wrow + m * 16 + g + (e >> 1) * 8;
            float x = s[m][j][e] * a.scale_log2;
            if (HAS_MASK && row < Sq && col < Skv)
              x += kiln_attn_f(mask[b * a.msb + h * a.msh + row * a.msi + col * a.msj]) * KILN_LOG2E;
            if (edge && (col >= Skv || (CAUSAL && col > row + off))) x = -KILN_ATTN_INF;
            s[m][j][e] = x;
          }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = mrow[m][r];
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[m][j][2 * r], s[m][j][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
          // A row with nothing visible yet keeps max -inf; shifting by 0 keeps its exps at 0.
          const float base = mx == -KILN_ATTN_INF ? 0.f : mx;
          const float alpha = exp2f(mrow[m][r] - base);
          mrow[m][r] = mx;
          float rs = 0.f;
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            s[m][j][2 * r] = exp2f(s[m][j][2 * r] - base);
            s[m][j][2 * r + 1] = exp2f(s[m][j][2 * r + 1] - base);
            rs += s[m][j][2 * r] + s[m][j][2 * r + 1];
          }
          lrow[m][r] = lrow[m][r] * alpha + rs;
#pragma unroll
          for (int d = 0; d < D / 8; ++d) {
            o[m][d][2 * r] *= alpha;
            o[m][d][2 * r + 1] *= alpha;
          }
        }
      }
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned pa[WM][4];
#pragma unroll
        for (int m = 0; m < WM; ++m) {
          pa[m][0] = kiln_attn_pack(s[m][2 * kk][0], s[m][2 * kk][1], q);
          pa[m][1] = kiln_attn_pack(s[m][2 * kk][2], s[m][2 * kk][3], q);
          pa[m][2] = kiln_attn_pack(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1], q);
          pa[m][3] = kiln_attn_pack(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3], q);
        }
#pragma unroll
        for (int dn = 0; dn < D / 8; dn += 2) {
          unsigned bf[4];
          kiln_attn_ldsm_t(bf, cV + (kk * 16 + (lane % 8) + (mat % 2) * 8) * LD + dn * 8 + (mat / 2) * 8);
#pragma unroll
          for (int m = 0; m < WM; ++m) {
            kiln_attn_mma(o[m][dn], pa[m], bf[0], bf[1], q);
            kiln_attn_mma(o[m][dn + 1], pa[m], bf[2], bf[3], q);
          }
        }
      }
    }
    __syncthreads();
  }
  kiln_attn_wait<0>();
#pragma unroll
  for (int m = 0; m < WM; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = lrow[m][r];
      l += __shfl_xor_sync(0xffffffff, l, 1);
      l += __shfl_xor_sync(0xffffffff, l, 2);
      const float inv = 1.f / l;  // a row that saw no key: 0 * inf = NaN, as softmax over nothing
      const int row = wrow + m * 16 + g + r * 8;
      if (row >= Sq) continue;
      T* yp = y + b * a.yb + h * a.yh + row * a.ys + 2 * t;
#pragma unroll
      for (int d = 0; d < D / 8; ++d)
        *reinterpret_cast<unsigned*>(yp + d * 8) = kiln_attn_pack(o[m][d][2 * r] * inv, o[m][d][2 * r + 1] * inv, q);
    }
}

// CUDA-core flash attention for any float dtype and head dims up to 256: 8 warps own 4 query
// rows each of a 32-row tile; a lane scores one key of each 32-key tile, the output row is
// spread over the lanes. Q (pre-scaled), K and V tiles are staged in shared memory as f32.
template <typename T, int D, int DV, bool CAUSAL, bool HAS_MASK, typename MT>
__device__ __forceinline__ void kiln_attn_generic(const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const MT* __restrict__ mask, T* __restrict__ y, const KilnAttnArgs& a) {
  constexpr int BM = 32, BN = 32, NT = 256, RPW = BM / (NT / 32), VP = (DV + 31) / 32;
  const int Sq = a.Sq, Skv = a.Skv;
  extern __shared__ __align__(16) unsigned char kiln_attn_smem[];
  float* sQ = reinterpret_cast<float*>(kiln_attn_smem);  // [BM][D]
  float* sK = sQ + BM * D;                                // [BN][D + 1]: lanes read rows
  float* sV = sK + BN * (D + 1);                          // [BN][DV]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (a.Hq / a.Hkv);
  const T* qp = q + b * a.qb + h * a.qh;
  const T* kp = k + b * a.kb + hk * a.kh;
  const T* vp = v + b * a.vb + hk * a.vh;
  const int off = Skv - Sq;
  const int nblocks = kiln_attn_key_blocks<CAUSAL>(q0, BM, BN, Sq, Skv);
  for (int i = tid; i < BM * D; i += NT)
    sQ[i] = q0 + i / D < Sq ? kiln_attn_f(qp[(q0 + i / D) * a.qs + i % D]) * a.scale_log2 : 0.f;
  float o[RPW][VP], mrow[RPW], lrow[RPW];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    mrow[i] = -KILN_ATTN_INF;
    lrow[i] = 0.f;
#pragma unroll
    for (int c = 0; c < VP; ++c) o[i][c] = 0.f;
  }
  for (int it = 0; it < nblocks; ++it) {
    const int n0 = it * BN;
    __syncthreads();
    for (int i = tid; i < BN * D; i += NT) {
      const int r = i / D, c = i % D;
      sK[r * (D + 1) + c] = n0 + r < Skv ? kiln_attn_f(kp[(n0 + r) * a.ks + c]) : 0.f;
    }
    for (int i = tid; i < BN * DV; i += NT)
      sV[i] = n0 + i / DV < Skv ? kiln_attn_f(vp[(n0 + i / DV) * a.vs + i % DV]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      const int lr = warp * RPW + i, row = q0 + lr, col = n0 + lane;
      float x = 0.f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) x += sQ[lr * D + d] * sK[lane * (D + 1) + d];
      if (HAS_MASK && row < Sq && col < Skv)
        x += kiln_attn_f(mask[b * a.msb + h * a.msh + row * a.msi + col * a.msj]) * KILN_LOG2E;
      if (col >= Skv || (CAUSAL && col > row + off)) x = -KILN_ATTN_INF;
      float mx = x;
#pragma unroll
      for (int w = 16; w > 0; w /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, w));
      mx = fmaxf(mx, mrow[i]);
      const float base = mx == -KILN_ATTN_INF ? 0.f : mx;
      const float alpha = exp2f(mrow[i] - base), p = exp2f(x - base);
      mrow[i] = mx;
      float ps = p;
#pragma unroll
      for (int w = 16; w > 0; w /= 2) ps += __shfl_xor_sync(0xffffffff, ps, w);
      lrow[i] = lrow[i] * alpha + ps;
#pragma unroll
      for (int c = 0; c < VP; ++c) o[i][c] *= alpha;
      for (int j = 0; j < BN; ++j) {
        const float pj = __shfl_sync(0xffffffff, p, j);
#pragma unroll
        for (int c = 0; c < VP; ++c)
          if (lane + 32 * c < DV) o[i][c] += pj * sV[j * DV + lane + 32 * c];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int row = q0 + warp * RPW + i;
    if (row >= Sq) continue;
    const float inv = 1.f / lrow[i];
#pragma unroll
    for (int c = 0; c < VP; ++c)
      if (lane + 32 * c < DV)
        kiln_attn_store(y + b * a.yb + h * a.yh + row * a.ys + lane + 32 * c, o[i][c] * inv);
  }
}
)";

/// The Hopper warpgroup-MMA kernel (sm_90a only; other targets compile the mma.sync kernel in
/// its place). Its wgmma wrappers are specializations the lowering generates per tile width.
const char* kWgmma = R"(
#define KILN_ATTN_WGMMA
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

// Flash attention on Hopper's warpgroup MMA (FlashAttention-3's math without warp
// specialization): two warpgroups own 64 query rows each of a 128-row tile. Q, K and V tiles
// sit in shared memory in the 128B-swizzled layout wgmma reads; S = Q·Kᵀ is one SS wgmma
// chain per warpgroup into f32 registers, the online softmax runs on that fragment (per n8
// chunk the mma.sync C layout), and P, packed to 16 bits in registers, is the A operand of
// O += P·V with V read N-major. Software pipelined within the warpgroup: step j issues
// S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} together and runs the softmax of S_j while the P·V
// product is still in flight (O is rescaled once it lands). cp.async group j brings K_{j+1}
// and V_j, so K and V are each double-buffered.
template <typename T, int D, int BN, bool CAUSAL, bool HAS_MASK, typename MT>
__device__ __forceinline__ void kiln_flash_attn_wgmma(const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const MT* __restrict__ mask, T* __restrict__ y, const KilnAttnArgs& a) {
  constexpr int NWG = 2, BM = 64 * NWG, NT = 128 * NWG, CH = D / 8;
  extern __shared__ __align__(16) unsigned char kiln_attn_smem[];
  const unsigned raw = (unsigned)__cvta_generic_to_shared(kiln_attn_smem);
  const unsigned pad = ((raw + 1023u) & ~1023u) - raw;  // swizzle atoms need 1024-byte alignment
  T* sQ = reinterpret_cast<T*>(kiln_attn_smem + pad);
  T* sK = sQ + BM * D;
  T* sV = sK + 2 * BN * D;
  const unsigned aQ = raw + pad, aK = aQ + BM * D * 2, aV = aK + 2 * BN * D * 2;
  const int Sq = a.Sq, Skv = a.Skv;
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (a.Hq / a.Hkv);
  const T* qp = q + b * a.qb + h * a.qh;
  const T* kp = k + b * a.kb + hk * a.kh;
  const T* vp = v + b * a.vb + hk * a.vh;
  const int off = Skv - Sq;
  const int wgrow = q0 + wg * 64, wrow = wgrow + (tid % 128) / 32 * 16;
  // Key blocks the tile sees. A warpgroup computes them all: one that sees none of a block
  // (only when Skv - Sq is not a multiple of the tile) masks it whole, which keeps every wgmma
  // unconditional so that ptxas can keep them asynchronous.
  const int nblocks = kiln_attn_key_blocks<CAUSAL>(q0, BM, BN, Sq, Skv);
  for (int c = tid; c < BM * CH; c += NT) {
    const int r = c / CH, cc = c % CH;
    const bool ok = q0 + r < Sq;
    kiln_attn_cp16(sQ + kiln_wg_sw<BM>(r, cc), qp + (ok ? q0 + r : 0) * a.qs + cc * 8, ok);
  }
  auto load = [&](T* dst, const T* src, long long stride, int blk) {
    const int n0 = blk * BN;
    for (int c = tid; c < BN * CH; c += NT) {
      const int r = c / CH, cc = c % CH;
      const bool ok = n0 + r < Skv;
      kiln_attn_cp16(dst + kiln_wg_sw<BN>(r, cc), src + (ok ? n0 + r : 0) * stride + cc * 8, ok);
    }
  };
  // cp.async group j brings K_{j+1} and V_j (group -1: Q and K_0); waits for group j - 1.
  auto stage = [&](int j) {
    if (j < nblocks) {
      if (j + 1 < nblocks) load(sK + ((j + 1) & 1) * BN * D, kp, a.ks, j + 1);
      load(sV + (j & 1) * BN * D, vp, a.vs, j);
      kiln_attn_commit();
      kiln_attn_wait<1>();
    } else {
      kiln_attn_wait<0>();
    }
    // cp.async wrote through the generic proxy; wgmma reads through the async one.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
  };
  auto issue_s = [&](float* s, int j) {
    const unsigned kbuf = aK + (j & 1) * BN * D * 2;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // A k-step of 16 elements is 32 bytes into a 128-byte swizzled row of column block kk / 4.
      const unsigned ks = (kk % 4) * 32;
      const unsigned long long da = kiln_wg_desc(aQ + (kk / 4) * BM * 128 + wg * 64 * 128 + ks, 16, 1024);
      const unsigned long long db = kiln_wg_desc(kbuf + (kk / 4) * BN * 128 + ks, 16, 1024);
      kiln_wgmma_ss<BN, T>(s, da, db, kk > 0);
    }
    kiln_wg_commit();
  };
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  unsigned pa[BN / 16][4];  // P of the previous key block, the A operand of its P·V
  auto issue_pv = [&](int j) {
    const unsigned vbuf = aV + (j & 1) * BN * D * 2;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      // 16 keys are two 8-row groups (1024 bytes each); column blocks of 64 dims are BN·128 bytes apart.
      const unsigned long long db = kiln_wg_desc(vbuf + kk * 16 * 128, BN * 128, 1024);
      kiln_wgmma_rs<D, T>(o, pa[kk], db);
    }
    kiln_wg_commit();
  };
  float mrow[2] = {-KILN_ATTN_INF, -KILN_ATTN_INF}, lrow[2] = {0.f, 0.f};
  // Masks and exponentiates S_j in place, updates the row max and sum; alpha rescales O.
  auto softmax = [&](float* s, int j, float* alpha) {
    const int n0 = j * BN;
    const bool edge = n0 + BN > Skv || (CAUSAL && n0 + BN - 1 > wgrow + off);
#pragma unroll
    for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n0 + jj * 8 + 2 * t + (e & 1), row = wrow + g + (e >> 1) * 8;
        float x = s[jj * 4 + e] * a.scale_log2;
        if (HAS_MASK && row < Sq && col < Skv)
          x += kiln_attn_f(mask[b * a.msb + h * a.msh + row * a.msi + col * a.msj]) * KILN_LOG2E;
        if (edge && (col >= Skv || (CAUSAL && col > row + off))) x = -KILN_ATTN_INF;
        s[jj * 4 + e] = x;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = mrow[r];
#pragma unroll
      for (int jj = 0; jj < BN / 8; ++jj) mx = fmaxf(mx, fmaxf(s[jj * 4 + 2 * r], s[jj * 4 + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      // A row with nothing visible yet keeps max -inf; shifting by 0 keeps its exps at 0.
      const float base = mx == -KILN_ATTN_INF ? 0.f : mx;
      alpha[r] = exp2f(mrow[r] - base);
      mrow[r] = mx;
      float rs = 0.f;
#pragma unroll
      for (int jj = 0; jj < BN / 8; ++jj) {
        s[jj * 4 + 2 * r] = exp2f(s[jj * 4 + 2 * r] - base);
        s[jj * 4 + 2 * r + 1] = exp2f(s[jj * 4 + 2 * r + 1] - base);
        rs += s[jj * 4 + 2 * r] + s[jj * 4 + 2 * r + 1];
      }
      lrow[r] = lrow[r] * alpha[r] + rs;
    }
  };
  // Per k-step of 16 keys the m16n8k16 A fragment, from two n8 chunks of S.
  auto pack = [&](const float* s) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = kiln_attn_pack(s[8 * kk + 0], s[8 * kk + 1], q);
      pa[kk][1] = kiln_attn_pack(s[8 * kk + 2], s[8 * kk + 3], q);
      pa[kk][2] = kiln_attn_pack(s[8 * kk + 4], s[8 * kk + 5], q);
      pa[kk][3] = kiln_attn_pack(s[8 * kk + 6], s[8 * kk + 7], q);
    }
  };
  if (nblocks > 0) load(sK, kp, a.ks, 0);
  kiln_attn_commit();
  if (nblocks > 0) {
    // Step 0: S_0 and its softmax alone.
    stage(0);
    float s[BN / 2], alpha[2];
    kiln_wg_fence();
    issue_s(s, 0);
    kiln_wg_wait<0>();
    kiln_wg_pin<BN / 2>(s);
    softmax(s, 0, alpha);
    pack(s);
    __syncthreads();
  }
  // Step j: S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} in flight together; the softmax of S_j
  // overlaps the P·V product, and O takes its rescale once that lands.
  for (int j = 1; j < nblocks; ++j) {
    stage(j);
    float s[BN / 2], alpha[2];
    kiln_wg_pin<D / 2>(o);
    kiln_wg_fence();
    issue_s(s, j);
    issue_pv(j - 1);
    kiln_wg_wait<1>();
    kiln_wg_pin<BN / 2>(s);
    softmax(s, j, alpha);
    kiln_wg_wait<0>();
    kiln_wg_pin<D / 2>(o);
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      o[d * 4 + 0] *= alpha[0];
      o[d * 4 + 1] *= alpha[0];
      o[d * 4 + 2] *= alpha[1];
      o[d * 4 + 3] *= alpha[1];
    }
    pack(s);
    __syncthreads();
  }
  if (nblocks > 0) {
    stage(nblocks);
    kiln_wg_pin<D / 2>(o);
    kiln_wg_fence();
    issue_pv(nblocks - 1);
    kiln_wg_wait<0>();
    kiln_wg_pin<D / 2>(o);
  }
  kiln_attn_wait<0>();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = lrow[r];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const float inv = 1.f / l;  // a row that saw no key: 0 * inf = NaN, as softmax over nothing
    const int row = wrow + g + r * 8;
    if (row >= Sq) continue;
    T* yp = y + b * a.yb + h * a.yh + row * a.ys + 2 * t;
#pragma unroll
    for (int d = 0; d < D / 8; ++d)
      *reinterpret_cast<unsigned*>(yp + d * 8) = kiln_attn_pack(o[d * 4 + 2 * r] * inv, o[d * 4 + 2 * r + 1] * inv, q);
  }
}
#endif
)";

/// One wgmma wrapper specialization (sm_90a source): `rs` takes A from registers and B
/// N-major (O += P·V), else both from shared memory K-major with a zeroing flag (S = Q·Kᵀ).
/// The asm operand list has n/2 accumulators, which is why it is generated.
std::string wgmma_wrapper(bool rs, int64_t n, const std::string& st) {
  const std::string ab = st == "__half" ? "f16" : "bf16", m = std::to_string(n / 2);
  std::string text = "#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\ntemplate <> __device__ __forceinline__ void kiln_wgmma_" +
                     std::string(rs ? "rs" : "ss") + "<" + std::to_string(n) + ", " + st + ">(float* d, " +
                     (rs ? "const unsigned* a, unsigned long long db) {\n" :
                           "unsigned long long da, unsigned long long db, int sd) {\n") +
                     "  asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, %" + std::to_string(n / 2 + (rs ? 5 : 2)) +
                     ", 0;\\nwgmma.mma_async.sync.aligned.m64n" + std::to_string(n) + "k16.f32." + ab + "." + ab + " {";
  for (int64_t i = 0; i < n / 2; ++i) text += (i ? ", %" : "%") + std::to_string(i);
  const int64_t h = n / 2;
  if (rs)
    text += "}, {%" + std::to_string(h) + ", %" + std::to_string(h + 1) + ", %" + std::to_string(h + 2) + ", %" +
            std::to_string(h + 3) + "}, %" + std::to_string(h + 4) + ", p, 1, 1, 1;\\n}\\n\"\n      : ";
  else
    text += "}, %" + std::to_string(h) + ", %" + std::to_string(h + 1) + ", p, 1, 1, 0, 0;\\n}\\n\"\n      : ";
  for (int64_t i = 0; i < n / 2; ++i) text += (i ? ", \"+f\"(d[" : "\"+f\"(d[") + std::to_string(i) + "])";
  text += rs ? "\n      : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(db), \"r\"(1));\n}\n#endif\n"
             : "\n      : \"l\"(da), \"l\"(db), \"r\"(sd));\n}\n#endif\n";
  return text;
}

/// perm [0, 2, 1, 3]: [B, S, H, D] <-> [B, H, S, D].
bool swaps_seq_heads(const Node& t) {
  if (t.op_name() != "transpose" || t.result()->shape().size() != 4) return false;
  const Sizes perm = t.get_ints("perm");
  if (perm.size() != 4) return false;
  for (size_t d = 0; d < 4; ++d)
    if (norm_axis(perm[d], 4) != (d == 1 ? 2 : d == 2 ? 1 : static_cast<int64_t>(d))) return false;
  return true;
}

}  // namespace

bool Lowerer::fold_attention_transpose(const Node& n) {
  if (!swaps_seq_heads(n)) return false;
  const int src = buf(n.operand(0));
  if (bufs_[root(src)].kind == "weight") return false;  // a folded attention reads weights as stored
  // Every path from the result must reach an attention's q, k or v, possibly through views that
  // only add or drop unit dims (Llama's repeat_kv with one repeat: unsqueeze, expand-free reshape).
  const Sizes ts = sizes_of(n.result());
  auto squeezed = [](Sizes s) {
    s.erase(std::remove(s.begin(), s.end(), int64_t{1}), s.end());
    return s;
  };
  static const std::set<std::string> kViews = {"reshape", "flatten", "squeeze", "unsqueeze", "identity"};
  std::vector<const Value*> todo = {n.result()}, ends;
  while (!todo.empty()) {
    const Value* v = todo.back();
    todo.pop_back();
    if (v->uses().empty()) return false;
    for (const Use& u : v->uses()) {
      if (!u.user) return false;
      if (u.user->op_name() == "attention" && u.index <= 2 && sizes_of(v) == ts) {
        ends.push_back(v);
      } else if (kViews.count(u.user->op_name()) && squeezed(sizes_of(u.user->result())) == squeezed(ts)) {
        todo.push_back(u.user->result());
      } else {
        return false;
      }
    }
  }
  // The view [B, H, S, D] of x: [B, S, H, D], as element strides of b, h and s.
  const Sizes xs = sizes_of(n.operand(0));
  val_[n.result()] = src;
  for (const Value* v : ends) bhs_strides_[v] = {xs[1] * xs[2] * xs[3], xs[3], xs[2] * xs[3]};
  return true;
}

bool Lowerer::f32_tiled_fits(int64_t d, int64_t dv, const std::vector<Sizes>& qkvy, const std::vector<int>& bufs) const {
  // float4 / cp.async accesses: every row start 16-byte aligned; registers and shared memory
  // bound the head dims.
  if (d % 4 != 0 || d > 128 || (dv != 32 && dv != 64 && dv != 128)) return false;
  for (const Sizes& s : qkvy)
    for (int64_t x : s)
      if (x % 4 != 0) return false;
  const size_t n = bufs.size();
  for (int id : {bufs[0], bufs[1], bufs[2], bufs[n - 1]})
    if (!aligned16(id)) return false;
  return f32_attention_smem_bytes(d, dv) <= smem_limit();
}

Status Lowerer::attention(const Node& n) {
  for (const Value* v : n.operands()) KILN_RETURN_IF_ERROR(check_static(v));
  const DType t = n.operand(0)->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return unsupported_dtype(n, t);
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  const bool has_mask = n.num_operands() > 3;
  std::string mt = "float";
  if (has_mask) {
    const DType m = n.operand(3)->dtype();
    if (m != DType::kF32 && m != DType::kF16 && m != DType::kBF16 && m != DType::kF64)
      return unsupported(n, "mask dtype " + dname(m) + " is not supported");
    KILN_ASSIGN_OR_RETURN(mt, storage(n, m));
  }
  // The helpers name both 16-bit types whatever the graph holds.
  note_dtype(DType::kF16);
  note_dtype(DType::kBF16);
  const Sizes qs = sizes_of(n.operand(0)), ks = sizes_of(n.operand(1)), vs = sizes_of(n.operand(2));
  const int64_t B = qs[0], hq = qs[1], sq = qs[2], d = qs[3], hkv = ks[1], skv = ks[2], dv = vs[3];
  // A sole user transposing the result to [B, S, H, D] is absorbed: the kernel writes its layout.
  const Value* r = n.result();
  const Node* tr = r->uses().size() == 1 && r->uses()[0].user && swaps_seq_heads(*r->uses()[0].user)
                       ? r->uses()[0].user : nullptr;
  const int out = activation_for(tr ? tr->result() : r);
  Sizes ys = {hq * sq * dv, sq * dv, dv};
  if (tr) {
    absorbed_.insert(tr);
    val_[r] = out;
    ys = {sq * hq * dv, dv, hq * dv};
  }
  if (B * hq * sq * dv == 0) return ok_status();
  if (skv == 0) return unsupported(n, "no keys (Skv = 0)");
  if (hq > 65535 || B > 65535 || sq > (int64_t{1} << 30) || skv > (int64_t{1} << 30))
    return unsupported(n, "batch " + std::to_string(B) + ", heads " + std::to_string(hq) +
                              " or sequence lengths exceed the launch limits");
  const bool mma = t != DType::kF32 && d == dv && (d == 64 || d == 128);
  if (!mma && (d > 256 || dv > 256))
    return unsupported(n, "head dims " + std::to_string(d) + "/" + std::to_string(dv) +
                              " (the CUDA-core path takes up to 256; the tensor-core path 64 and 128)");
  // Mask element strides over [B, Hq, Sq, Skv]: right-aligned, 0 where it broadcasts.
  Sizes ms(4, 0);
  if (has_mask) {
    const Sizes m = sizes_of(n.operand(3));
    const Sizes cs = contiguous_strides(m);
    for (size_t i = 0; i < m.size(); ++i) ms[4 - m.size() + i] = m[i] == 1 ? 0 : cs[i];
  }
  const bool causal = n.get_int("causal") != 0;
  const float scale_log2 = static_cast<float>(n.get_float("scale") * 1.4426950408889634);
  auto strides = [&](const Value* v) {
    const auto it = bhs_strides_.find(v);
    if (it != bhs_strides_.end()) return it->second;
    const Sizes s = sizes_of(v);
    return Sizes{s[1] * s[2] * s[3], s[2] * s[3], s[3]};
  };
  const std::vector<Sizes> qkvy = {strides(n.operand(0)), strides(n.operand(1)), strides(n.operand(2)), ys};
  std::vector<int> bufs = {buf(n.operand(0)), buf(n.operand(1)), buf(n.operand(2))};
  if (has_mask) bufs.push_back(buf(n.operand(3)));
  bufs.push_back(out);
  if (t == DType::kF32 && f32_tiled_fits(d, dv, qkvy, bufs)) {
    if (source_.find("#define KILN_ATTN_F32_TILED") == std::string::npos) source_ += f32_attention_source();
    const std::string name = kernel_name("attention");
    std::string call = "kiln_attn_f32_tiled<" + std::to_string(d) + ", " + std::to_string(dv) + ", " +
                       (causal ? "true" : "false") + ", " + (has_mask ? "true" : "false") + ", " + mt +
                       ">(q, k, v, " + (has_mask ? "mask" : "(const float*)nullptr") + ", y, " +
                       std::to_string(hq) + ", " + std::to_string(hkv) + ", " + std::to_string(sq) + ", " +
                       std::to_string(skv) + ", " + literal(DType::kF32, scale_log2);
    for (const Sizes& s3 : qkvy)
      for (int64_t x : s3) call += ", " + int_literal(x);
    for (int64_t m : ms) call += ", " + int_literal(m);
    add_kernel_text(name, "extern \"C\" __global__ void __launch_bounds__(" + std::to_string(kF32AttentionThreads) +
                              ") " + name + "(const float* q, const float* k, const float* v, " +
                              (has_mask ? "const " + mt + "* mask, " : std::string()) + "float* y) {\n  " + call +
                              ");\n}\n");
    launch_grid(name, {(sq + kF32AttentionRows - 1) / kF32AttentionRows, hq, B}, kF32AttentionThreads,
                f32_attention_smem_bytes(d, dv), bufs);
    return ok_status();
  }
  if (source_.find("#define KILN_ATTN_HELPERS") == std::string::npos) source_ += kHelpers;
  // Hopper plans launch the wgmma kernel's shape (2 warpgroups, 128 rows); its sm_90a image runs
  // it, other images of the same plan (compute_90 PTX) the mma.sync kernel as 8 warps of 16 rows.
  const bool wgmma = mma && opts_.target.rfind("cuda-sm90", 0) == 0;
  // Keys per block of the wgmma kernel: 128 (K and V double-buffered: 164 KB of shared memory
  // at head dim 128, one block per SM). Measurement knob KILN_ATTN_BN="64[:2]" halves the K/V
  // tiles (104 KB) and optionally bounds registers for two blocks per SM, whose softmax and
  // MMAs can then overlap.
  const char* bn_env = std::getenv("KILN_ATTN_BN");
  const std::string bn_knob = bn_env ? bn_env : "";
  const int64_t bm = mma ? 128 : 32, bn = bn_knob.rfind("64", 0) == 0 ? 64 : 128;
  const int64_t min_blocks = bn == 64 && bn_knob == "64:2" ? 2 : 1;
  int64_t smem = mma ? (bm + 4 * 64) * (d + 8) * 2 : (bm * d + 32 * (d + 1) + 32 * dv) * 4;
  if (wgmma) smem = std::max(smem, (bm * d + 4 * bn * d) * 2 + 1024);
  const std::string name = kernel_name("attention");
  const std::string flags = std::string(causal ? "true" : "false") + ", " + (has_mask ? "true" : "false") + ", " + mt;
  const std::string call = "(q, k, v, " + std::string(has_mask ? "mask" : "(const float*)nullptr") + ", y, a);\n";
  std::string body;
  if (wgmma) {
    if (source_.find("#define KILN_ATTN_WGMMA") == std::string::npos) source_ += kWgmma;
    for (const auto& [rs, w] : {std::pair{false, bn}, std::pair{true, d}}) {
      const std::string key = std::string(rs ? "kiln_wgmma_rs<" : "kiln_wgmma_ss<") + std::to_string(w) + ", " + st + ">(";
      if (source_.find(key) == std::string::npos) source_ += wgmma_wrapper(rs, w, st);
    }
    body = "#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\n  kiln_flash_attn_wgmma<" + st + ", " + std::to_string(d) + ", " +
           std::to_string(bn) + ", " + flags + ">" + call + "#else\n  kiln_flash_attn<" + st + ", " +
           std::to_string(d) + ", " + flags + ", 1, 8>" + call + "#endif\n";
  } else {
    body = "  " + (mma ? "kiln_flash_attn<" + st + ", " + std::to_string(d)
                       : "kiln_attn_generic<" + st + ", " + std::to_string(d) + ", " + std::to_string(dv)) +
           ", " + flags + ">" + call;
  }
  std::string args = std::to_string(hq) + ", " + std::to_string(hkv) + ", " + std::to_string(sq) + ", " +
                     std::to_string(skv) + ", " + literal(DType::kF32, scale_log2);
  for (int64_t m : ms) args += ", " + int_literal(m);
  for (const Sizes& s3 : qkvy)
    for (int64_t x : s3) args += ", " + int_literal(x);
  const int64_t threads = wgmma ? 256 : mma ? 128 : 256;
  const std::string bounds = std::to_string(threads) + (min_blocks > 1 ? ", " + std::to_string(min_blocks) : "");
  const std::string text = "extern \"C\" __global__ void __launch_bounds__(" + bounds + ") " + name +
                           "(const " + st + "* q, const " + st + "* k, const " + st + "* v, " +
                           (has_mask ? "const " + mt + "* mask, " : std::string()) + st +
                           "* y) {\n  const KilnAttnArgs a = {" + args + "};\n" + body + "}\n";
  add_kernel_text(name, text);
  launch_grid(name, {(sq + bm - 1) / bm, hq, B}, threads, smem, bufs);
  return ok_status();
}

}  // namespace kiln::cuda::detail
