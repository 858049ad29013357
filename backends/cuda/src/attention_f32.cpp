// The register-tiled f32 flash-attention kernel on CUDA cores (fp32 models such as GPT-2).
//
// A block owns 64 query rows of one (batch, head) and walks 64-key tiles. Its 256 threads form
// a 16 x 16 grid: thread (ty, tx) owns rows 4ty..4ty+3 of S = Q·Kᵀ at keys tx + 16j (interleaved,
// so with rows padded by 4 floats the 8 threads of a quarter warp read K rows from 8 different
// bank groups) and the same rows of O at columns 4tx + 64c (2tx when Dv = 32). A row's 16
// threads share a warp, so row maxima reduce with 4 xor-shuffles; the row sums stay per thread
// (every thread of a row rescales by the same factor) and reduce once at the end. P goes
// through shared memory transposed ([key][row]) so P·V reads one float4 of 4 rows per key.
// K and V tiles are double-buffered with cp.async (zero-filled past Skv) so the next tile loads
// while this one computes. Q is scaled by scale·log2 e while staged, so exp is one exp2f.
#include "attention_f32.h"

namespace kiln::cuda::detail {
namespace {

const char* kSource = R"(
#ifndef KILN_ATTN_F32_TILED
#define KILN_ATTN_F32_TILED
#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ __forceinline__ float kiln_af32_f(float x) { return x; }
__device__ __forceinline__ float kiln_af32_f(double x) { return (float)x; }
__device__ __forceinline__ float kiln_af32_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float kiln_af32_f(__nv_bfloat16 x) { return __bfloat162float(x); }
// 16 bytes global -> shared without a register round trip; nothing is read and zeros are
// written when !valid (the tail of the last key tile).
__device__ __forceinline__ void kiln_af32_cp16(float* dst, const float* src, bool valid) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(__cvta_generic_to_global(src)),
               "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void kiln_af32_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void kiln_af32_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// softmax(Q·Kᵀ·scale + mask)·V for 64 query rows of (batch blockIdx.z, head blockIdx.y); grid
// (ceil(Sq / 64), Hq, B), 256 threads, f32_attention_smem_bytes(D, DV) of dynamic shared memory.
// Strides are in elements (the head dim is contiguous); D a multiple of 4 up to 128, DV 32, 64
// or 128 (shared memory and registers bound both), all strides multiples of 4 and q, k, v, y
// 16-byte aligned (float4 and cp.async). scale_log2 is scale·log2 e; the mask is added times
// log2 e. A row that sees no key is 0/0 = NaN.
template <int D, int DV, bool CAUSAL, bool HAS_MASK, typename MT>
__device__ __forceinline__ void kiln_attn_f32_tiled(const float* __restrict__ q, const float* __restrict__ k,
    const float* __restrict__ v, const MT* __restrict__ mask, float* __restrict__ y, int Hq, int Hkv, int Sq,
    int Skv, float scale_log2, long long qsb, long long qsh, long long qss, long long ksb, long long ksh,
    long long kss, long long vsb, long long vsh, long long vss, long long ysb, long long ysh, long long yss,
    long long msb, long long msh, long long msi, long long msj) {
  constexpr int BM = 64, BN = 64, NT = 256, LQ = D + 4, LP = BM + 4;
  constexpr int VC = DV / 16, W = VC < 4 ? VC : 4, NCH = VC / W;  // O columns per thread, as NCH chunks of W
  static_assert(D % 4 == 0 && D <= 128 && (DV == 32 || DV == 64 || DV == 128), "kiln_attn_f32_tiled: head dims");
  extern __shared__ __align__(16) unsigned char kiln_af32_smem[];
  float* sQ = reinterpret_cast<float*>(kiln_af32_smem);  // [BM][LQ], pre-scaled
  float* sK = sQ + BM * LQ;                               // 2 x [BN][LQ]
  float* sV = sK + 2 * BN * LQ;                           // 2 x [BN][DV]
  float* sP = sV + 2 * BN * DV;                           // [BN][LP]: P transposed
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;  // heavy causal blocks first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (Hq / Hkv);
  const float* qp = q + b * qsb + h * qsh;
  const float* kp = k + b * ksb + hk * ksh;
  const float* vp = v + b * vsb + hk * vsh;
  const int off = Skv - Sq;
  int nblocks = (Skv + BN - 1) / BN;
  if (CAUSAL) {
    const int last = q0 + BM - 1 + off;
    nblocks = min(nblocks, last < 0 ? 0 : last / BN + 1);
  }
  auto load_kv = [&](int it) {
    const int n0 = it * BN, buf = it & 1;
    for (int i = tid; i < BN * D / 4; i += NT) {
      const int r = i / (D / 4), c = i % (D / 4);
      const bool ok = n0 + r < Skv;
      kiln_af32_cp16(sK + buf * BN * LQ + r * LQ + 4 * c, ok ? kp + (n0 + r) * kss + 4 * c : kp, ok);
    }
    for (int i = tid; i < BN * DV / 4; i += NT) {
      const int r = i / (DV / 4), c = i % (DV / 4);
      const bool ok = n0 + r < Skv;
      kiln_af32_cp16(sV + buf * BN * DV + r * DV + 4 * c, ok ? vp + (n0 + r) * vss + 4 * c : vp, ok);
    }
    kiln_af32_commit();
  };
  if (nblocks > 0) load_kv(0);
  for (int i = tid; i < BM * D / 4; i += NT) {
    const int r = i / (D / 4), c = i % (D / 4);
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (q0 + r < Sq) {
      x = *reinterpret_cast<const float4*>(qp + (q0 + r) * qss + 4 * c);
      x.x *= scale_log2; x.y *= scale_log2; x.z *= scale_log2; x.w *= scale_log2;
    }
    *reinterpret_cast<float4*>(sQ + r * LQ + 4 * c) = x;
  }
  float o[4][VC], mrow[4], lrow[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    mrow[i] = -__int_as_float(0x7f800000);
    lrow[i] = 0.f;
#pragma unroll
    for (int c = 0; c < VC; ++c) o[i][c] = 0.f;
  }
  for (int it = 0; it < nblocks; ++it) {
    const int n0 = it * BN, buf = it & 1;
    if (it + 1 < nblocks) {
      load_kv(it + 1);  // its buffer was last read in iteration it - 1, which ended with a barrier
      kiln_af32_wait<1>();
    } else {
      kiln_af32_wait<0>();
    }
    __syncthreads();
    const float* kt = sK + buf * BN * LQ;
    const float* vt = sV + buf * BN * DV;
    float s[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) s[i][j] = 0.f;
#pragma unroll
    for (int d = 0; d < D; d += 4) {
      float4 a[4], bk[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<const float4*>(sQ + (4 * ty + i) * LQ + d);
#pragma unroll
      for (int j = 0; j < 4; ++j) bk[j] = *reinterpret_cast<const float4*>(kt + (tx + 16 * j) * LQ + d);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          s[i][j] = fmaf(a[i].x, bk[j].x, s[i][j]);
          s[i][j] = fmaf(a[i].y, bk[j].y, s[i][j]);
          s[i][j] = fmaf(a[i].z, bk[j].z, s[i][j]);
          s[i][j] = fmaf(a[i].w, bk[j].w, s[i][j]);
        }
    }
    // Only the last tile and, when causal, tiles crossing the diagonal have hidden keys.
    const bool edge = n0 + BN > Skv || (CAUSAL && n0 + BN - 1 > q0 + off);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = q0 + 4 * ty + i;
      float mx = -__int_as_float(0x7f800000);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = n0 + tx + 16 * j;
        if (HAS_MASK && row < Sq && col < Skv)
          s[i][j] += kiln_af32_f(mask[b * msb + h * msh + row * msi + col * msj]) * 1.4426950408889634f;
        if (edge && (col >= Skv || (CAUSAL && col > row + off))) s[i][j] = -__int_as_float(0x7f800000);
        mx = fmaxf(mx, s[i][j]);
      }
#pragma unroll
      for (int w = 1; w < 16; w *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, w));
      mx = fmaxf(mx, mrow[i]);
      const float base = mx == -__int_as_float(0x7f800000) ? 0.f : mx;  // no key seen yet: keep 0s
      const float alpha = exp2f(mrow[i] - base);
      mrow[i] = mx;
      float l = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[i][j] = exp2f(s[i][j] - base);
        l += s[i][j];
      }
      lrow[i] = lrow[i] * alpha + l;
#pragma unroll
      for (int c = 0; c < VC; ++c) o[i][c] *= alpha;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *reinterpret_cast<float4*>(sP + (tx + 16 * j) * LP + 4 * ty) = make_float4(s[0][j], s[1][j], s[2][j], s[3][j]);
    __syncthreads();
#pragma unroll 8
    for (int n = 0; n < BN; ++n) {
      const float4 p = *reinterpret_cast<const float4*>(sP + n * LP + 4 * ty);
      const float pr[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int c = 0; c < NCH; ++c) {
        float vv[W];
        if constexpr (W == 4) {
          const float4 t = *reinterpret_cast<const float4*>(vt + n * DV + 4 * tx + 64 * c);
          vv[0] = t.x; vv[1] = t.y; vv[2] = t.z; vv[3] = t.w;
        } else {
          const float2 t = *reinterpret_cast<const float2*>(vt + n * DV + 2 * tx);
          vv[0] = t.x; vv[1] = t.y;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int e = 0; e < W; ++e) o[i][c * W + e] = fmaf(pr[i], vv[e], o[i][c * W + e]);
      }
    }
    __syncthreads();  // sP and this tile's buffers are rewritten next iteration
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float l = lrow[i];
#pragma unroll
    for (int w = 1; w < 16; w *= 2) l += __shfl_xor_sync(0xffffffff, l, w);
    const int row = q0 + 4 * ty + i;
    if (row >= Sq) continue;
    const float inv = 1.f / l;  // a row that saw no key: 0 * inf = NaN, as softmax over nothing
    float* yp = y + b * ysb + h * ysh + row * yss;
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
      if constexpr (W == 4)
        *reinterpret_cast<float4*>(yp + 4 * tx + 64 * c) =
            make_float4(o[i][4 * c] * inv, o[i][4 * c + 1] * inv, o[i][4 * c + 2] * inv, o[i][4 * c + 3] * inv);
      else
        *reinterpret_cast<float2*>(yp + 2 * tx) = make_float2(o[i][0] * inv, o[i][1] * inv);
    }
  }
}
#endif
)";

}  // namespace

const char* f32_attention_source() { return kSource; }

int64_t f32_attention_smem_bytes(int64_t d, int64_t dv) {
  const int64_t bm = kF32AttentionRows, bn = 64;
  return 4 * (bm * (d + 4) + 2 * bn * (d + 4) + 2 * bn * dv + bn * (bm + 4));
}

}  // namespace kiln::cuda::detail
