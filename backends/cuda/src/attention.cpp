// CUDA lowering of attention: one flash-attention kernel per node (mma.sync for f16/bf16, CUDA cores else).
//
// Both kernels keep the running row max and sum of an online softmax in f32 and never write
// the score matrix: a block owns a tile of query rows of one (batch, head), walks the key
// blocks it can see (causal blocks past the diagonal are skipped), rescales its output
// accumulator when the max grows and divides by the sum once at the end. Scores are kept
// in the log2 domain (scale·log2 e folded into one multiplier) so exp is one exp2f; the
// tensor-core kernels use the approximate ex2 (one MUFU op; their P is rounded to 16 bits
// anyway) and, without a mask and with a positive scale, fold the scale into the FFMA that
// subtracts the row max.
#include <algorithm>
#include <cmath>
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
// 2^x in one MUFU op (exp2f adds a range fix-up around it); 2^-inf = 0.
__device__ __forceinline__ float kiln_attn_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// The softmax of the 16-bit kernels works on pre·s (+ mask·log2 e) and exponentiates
// post·x - post·max: without a mask and with a positive scale pre = 1 and post = scale·log2 e
// (the max of the raw scores is the max of the scaled ones), else pre = scale·log2 e, post = 1.
// The scale is a literal of the kernel, so the choice and the multiplies by 1 fold away.
template <bool HAS_MASK>
__device__ __forceinline__ void kiln_attn_scales(float scale_log2, float& pre, float& post) {
  const bool fold = !HAS_MASK && scale_log2 > 0.f;
  pre = fold ? 1.f : scale_log2;
  post = fold ? scale_log2 : 1.f;
}
// Scales one warp's 16 rows of S over BN keys by pre and adds the mask (times log2 e), then sets
// keys past the sequence end or the causal diagonal to -inf. s is the m16n8 accumulator layout:
// chunk j, element e is key n0 + 8j + 2t + (e & 1) of row row0 + g + 8(e >> 1). Only blocks that
// cross the end or the diagonal are masked, behind one branch rather than a select per score.
template <int BN, bool CAUSAL, bool HAS_MASK, typename MT>
__device__ __forceinline__ void kiln_attn_mask_fragment(float* s, int n0, int row0, float pre, const MT* mask,
                                                        long long mask_base, const KilnAttnArgs& a) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, off = a.Skv - a.Sq;
  if (HAS_MASK || pre != 1.f) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n0 + j * 8 + 2 * t + (e & 1), row = row0 + g + (e >> 1) * 8;
        float x = s[j * 4 + e] * pre;
        if (HAS_MASK && row < a.Sq && col < a.Skv)
          x += kiln_attn_f(mask[mask_base + row * a.msi + col * a.msj]) * KILN_LOG2E;
        s[j * 4 + e] = x;
      }
  }
  if (n0 + BN > a.Skv || (CAUSAL && n0 + BN - 1 > row0 + off)) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n0 + j * 8 + 2 * t + (e & 1), row = row0 + g + (e >> 1) * 8;
        if (col >= a.Skv || (CAUSAL && col > row + off)) s[j * 4 + e] = -KILN_ATTN_INF;
      }
  }
}
// The online-softmax step on one warp's 16-row fragment of S (layout as above) after masking:
// per row half r (rows g and g + 8, over the lane quad) the new running max mrow[r], alpha[r]
// that rescales the old sum and output, s exponentiated in place (2^(post·s - post·max)), and
// the running sum lrow[r].
template <int BN>
__device__ __forceinline__ void kiln_attn_softmax_fragment(float* s, float* mrow, float* lrow, float post, float* alpha) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = mrow[r];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j * 4 + 2 * r], s[j * 4 + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    // A row with nothing visible yet keeps max -inf; shifting by 0 keeps its exps at 0.
    const float base = mx == -KILN_ATTN_INF ? 0.f : mx * post;
    alpha[r] = kiln_attn_ex2(fmaf(mrow[r], post, -base));
    mrow[r] = mx;
    float rs = 0.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      s[j * 4 + 2 * r] = kiln_attn_ex2(fmaf(s[j * 4 + 2 * r], post, -base));
      s[j * 4 + 2 * r + 1] = kiln_attn_ex2(fmaf(s[j * 4 + 2 * r + 1], post, -base));
      rs += s[j * 4 + 2 * r] + s[j * 4 + 2 * r + 1];
    }
    lrow[r] = lrow[r] * alpha[r] + rs;
  }
}
// Copies a tile of R rows x D columns (16-bit) into shared memory with NT threads: thread tid
// (of 0..NT-1) always takes the 16-byte column chunk tid % (D / 8) of rows tid / (D / 8) + i·(NT / (D / 8)),
// so its shared and global addresses advance by constants (SW(r, c) gives the shared element
// offset of row r, chunk c, and must satisfy SW(r + step, c) = SW(r, c) + SW(step, 0)). Rows
// at or past `rows` are zero-filled.
template <int R, int D, int NT, typename T, typename SW>
__device__ __forceinline__ void kiln_attn_load_tile(T* dst, const T* src, long long stride, int r0, int rows, SW sw,
                                                    int tid = threadIdx.x) {
  constexpr int CH = D / 8, STEP = NT / CH;
  static_assert(NT % CH == 0 && R % STEP == 0, "tile rows must split evenly over the threads");
  const int lr = tid / CH, lc = tid % CH;
  T* d = dst + sw(lr, lc);
  const T* g = src + (long long)(r0 + lr) * stride + lc * 8;
  const int step = sw(STEP, 0);
  if (r0 + R <= rows) {
#pragma unroll
    for (int i = 0; i < R / STEP; ++i) kiln_attn_cp16(d + i * step, g + i * STEP * stride, true);
  } else {
#pragma unroll
    for (int i = 0; i < R / STEP; ++i) {
      const bool ok = r0 + lr + i * STEP < rows;
      kiln_attn_cp16(d + i * step, ok ? g + i * STEP * stride : src, ok);
    }
  }
}

// Tensor-core flash attention (FlashAttention-2 layout): NW warps own 16·WM query rows each
// (by default 4 warps of two m16 tiles, so every K and V fragment read from shared memory
// feeds four mma, for a 128-row tile); K and V tiles of 64 keys are double-buffered through cp.async; Q is re-read from
// shared memory per k-step to leave registers to the accumulators; P stays in registers and
// feeds the P·V mma directly. Requires Dv == D, D % 16 == 0.
template <typename T, int D, bool CAUSAL, bool HAS_MASK, typename MT, int WM = 2, int NW = 4>
__device__ __forceinline__ void kiln_flash_attn(const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const MT* __restrict__ mask, T* __restrict__ y, const KilnAttnArgs& a) {
  constexpr int BM = NW * 16 * WM, BN = 64, NT = NW * 32, LD = D + 8;
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
  auto padded = [](int r, int c) { return r * LD + c * 8; };
  kiln_attn_load_tile<BM, D, NT>(sQ, qp, a.qs, q0, Sq, padded);
  auto load_kv = [&](int blk, int buf) {
    kiln_attn_load_tile<BN, D, NT>(sK + buf * BN * LD, kp, a.ks, blk * BN, Skv, padded);
    kiln_attn_load_tile<BN, D, NT>(sV + buf * BN * LD, vp, a.vs, blk * BN, Skv, padded);
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
  float pre, post;
  kiln_attn_scales<HAS_MASK>(a.scale_log2, pre, post);
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
#pragma unroll
      for (int m = 0; m < WM; ++m)
        kiln_attn_mask_fragment<BN, CAUSAL, HAS_MASK>(&s[m][0][0], n0, wrow + m * 16, pre, mask, b * a.msb + h * a.msh, a);
#pragma unroll
      for (int m = 0; m < WM; ++m) {
        float alpha[2];
        kiln_attn_softmax_fragment<BN>(&s[m][0][0], mrow[m], lrow[m], post, alpha);
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
          o[m][d][0] *= alpha[0];
          o[m][d][1] *= alpha[0];
          o[m][d][2] *= alpha[1];
          o[m][d][3] *= alpha[1];
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

/// The Hopper warpgroup-MMA kernel (sm_90a only; other images compile the mma.sync kernel in
/// its place). Its wgmma wrappers are specializations the lowering generates per tile width.
const char* kWgmma = R"(
#define KILN_ATTN_WGMMA
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The warp-specialized kernel's mbarriers, 8 bytes each from `base` (shared::cta): Q full, then
// per stage K full, V full, K empty, V empty.
struct KilnWsBarriers {
  unsigned base;
  __device__ unsigned q_full() const { return base; }
  __device__ unsigned k_full(int st) const { return base + 8 + 8 * st; }
  __device__ unsigned v_full(int st) const { return base + 24 + 8 * st; }
  __device__ unsigned k_empty(int st) const { return base + 40 + 8 * st; }
  __device__ unsigned v_empty(int st) const { return base + 56 + 8 * st; }
};
// mbarrier helpers (shared::cta addresses).
__device__ __forceinline__ void kiln_mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void kiln_mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives once every cp.async this thread issued so far has landed.
__device__ __forceinline__ void kiln_mbar_arrive_cp_async(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void kiln_mbar_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n.reg .pred p;\nKILN_MBAR_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               "@!p bra KILN_MBAR_WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// Flash attention on Hopper's warpgroup MMA, warp-specialized (FlashAttention-3's schedule,
// with cp.async in place of the tensor-memory copies). 384 threads, 128 query rows per block:
// - warpgroup 0, the producer, streams K and V tiles of BN keys into two-stage buffers; each
//   stage has a "full" mbarrier (arrived when the producer's copies land) and an "empty" one
//   (arrived by the consumers once their MMAs have read it). It hands most of its registers to
//   the consumers (setmaxnreg).
// - warpgroups 1 and 2, the consumers, own 64 query rows each. Q, K and V sit in shared memory
//   in the 128B-swizzled layout wgmma reads; S = Q·Kᵀ is one SS wgmma chain into f32
//   registers, the online softmax runs on that fragment (per n8 chunk the mma.sync C layout),
//   and P, packed to 16 bits in registers, is the A operand of O += P·V with V read N-major.
//   Step j issues S_j and O += P_{j-1}·V_{j-1} together and runs the softmax of S_j while the
//   P·V product is in flight (O is rescaled once it lands). The two consumers take turns
//   issuing their MMAs (named barriers 1 and 2), so one's softmax overlaps the other's MMAs.
// A consumer computes every key block the tile sees: one that sees none of a block (only when
// Skv - Sq is not a multiple of the tile) masks it whole, which keeps every wgmma unconditional
// so that ptxas can keep them asynchronous.
template <typename T, int D, int BN, bool CAUSAL, bool HAS_MASK, typename MT>
__device__ __forceinline__ void kiln_flash_attn_ws_consumer(const T* __restrict__ q, const MT* __restrict__ mask,
    T* __restrict__ y, const KilnAttnArgs& a, int q0, int nblocks, unsigned aQ, unsigned aK, unsigned aV, unsigned aB);
template <typename T, int D, int BN, bool CAUSAL, bool HAS_MASK, typename MT>
__device__ __forceinline__ void kiln_flash_attn_ws(const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const MT* __restrict__ mask, T* __restrict__ y, const KilnAttnArgs& a) {
  constexpr int BM = 128;
  extern __shared__ __align__(16) unsigned char kiln_attn_smem[];
  const unsigned raw = (unsigned)__cvta_generic_to_shared(kiln_attn_smem);
  const unsigned pad = ((raw + 1023u) & ~1023u) - raw;  // swizzle atoms need 1024-byte alignment
  T* sQ = reinterpret_cast<T*>(kiln_attn_smem + pad);
  T* sK = sQ + BM * D;
  T* sV = sK + 2 * BN * D;
  const unsigned aQ = raw + pad, aK = aQ + BM * D * 2, aV = aK + 2 * BN * D * 2, aB = aV + 2 * BN * D * 2;
  const KilnWsBarriers bars{aB};
  const int Sq = a.Sq, Skv = a.Skv;
  const int tid = threadIdx.x;
  const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (a.Hq / a.Hkv);
  const int nblocks = kiln_attn_key_blocks<CAUSAL>(q0, BM, BN, Sq, Skv);
  if (tid == 0) {
    kiln_mbar_init(bars.q_full(), 128);
    for (int st = 0; st < 2; ++st) {
      kiln_mbar_init(bars.k_full(st), 128);
      kiln_mbar_init(bars.v_full(st), 128);
      kiln_mbar_init(bars.k_empty(st), 256);
      kiln_mbar_init(bars.v_empty(st), 256);
    }
  }
  __syncthreads();
  if (tid < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    const T* qp = q + b * a.qb + h * a.qh;
    const T* kp = k + b * a.kb + hk * a.kh;
    const T* vp = v + b * a.vb + hk * a.vh;
    // Tile rows step by multiples of 8 between passes, which keeps each row's swizzle.
    auto swq = [](int r, int c) { return kiln_wg_sw<BM>(r, c); };
    auto swkv = [](int r, int c) { return kiln_wg_sw<BN>(r, c); };
    kiln_attn_load_tile<BM, D, 128>(sQ, qp, a.qs, q0, Sq, swq, tid);
    kiln_mbar_arrive_cp_async(bars.q_full());
    for (int j = 0; j < nblocks; ++j) {
      const int st = j & 1;
      const unsigned reuse = ((j >> 1) - 1) & 1;  // phase of the stage's previous use
      if (j >= 2) kiln_mbar_wait(bars.k_empty(st), reuse);
      kiln_attn_load_tile<BN, D, 128>(sK + st * BN * D, kp, a.ks, j * BN, Skv, swkv, tid);
      kiln_mbar_arrive_cp_async(bars.k_full(st));
      if (j >= 2) kiln_mbar_wait(bars.v_empty(st), reuse);
      kiln_attn_load_tile<BN, D, 128>(sV + st * BN * D, vp, a.vs, j * BN, Skv, swkv, tid);
      kiln_mbar_arrive_cp_async(bars.v_full(st));
    }
    kiln_attn_wait<0>();
    return;  // the producer ends here (ptxas keeps the consumers' larger budget only then)
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    kiln_flash_attn_ws_consumer<T, D, BN, CAUSAL, HAS_MASK>(q, mask, y, a, q0, nblocks, aQ, aK, aV, aB);
  }
}
// The consumer warpgroups of kiln_flash_attn_ws.
template <typename T, int D, int BN, bool CAUSAL, bool HAS_MASK, typename MT>
__device__ __forceinline__ void kiln_flash_attn_ws_consumer(const T* __restrict__ q, const MT* __restrict__ mask,
    T* __restrict__ y, const KilnAttnArgs& a, int q0, int nblocks, unsigned aQ, unsigned aK, unsigned aV, unsigned aB) {
  constexpr int BM = 128;
  const KilnWsBarriers bars{aB};
  const int Sq = a.Sq;
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z;
  const int cw = wg - 1;  // consumer warpgroup 0 or 1
  const int wgrow = q0 + cw * 64, wrow = wgrow + (tid % 128) / 32 * 16;
  // Turns: consumer c waits on named barrier 1 + c before issuing, then lets the other go.
  auto my_turn = [&] { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + cw) : "memory"); };
  auto their_turn = [&] { asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - cw) : "memory"); };
  auto ready = [&](unsigned bar, int j) {
    kiln_mbar_wait(bar, (j >> 1) & 1);
    kiln_wg_proxy_fence();  // cp.async wrote through the generic proxy
  };
  auto issue_s = [&](float* s, int j) {
    const unsigned kbuf = aK + (j & 1) * BN * D * 2;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // A k-step of 16 elements is 32 bytes into a 128-byte swizzled row of column block kk / 4.
      const unsigned ks = (kk % 4) * 32;
      const unsigned long long da = kiln_wg_desc(aQ + (kk / 4) * BM * 128 + cw * 64 * 128 + ks, 16, 1024);
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
  float pre, post;
  kiln_attn_scales<HAS_MASK>(a.scale_log2, pre, post);
  // Masks and exponentiates S_j in place, updates the row max and sum; alpha rescales O.
  auto softmax = [&](float* s, int j, float* alpha) {
    const int n0 = j * BN;
    kiln_attn_mask_fragment<BN, CAUSAL, HAS_MASK>(s, n0, wrow, pre, mask, b * a.msb + h * a.msh, a);
    kiln_attn_softmax_fragment<BN>(s, mrow, lrow, post, alpha);
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
  if (cw == 1) their_turn();  // consumer 0 issues first
  kiln_mbar_wait(bars.q_full(), 0);
  if (nblocks > 0) {
    // Step 0: S_0 and its softmax alone.
    ready(bars.k_full(0), 0);
    float s[BN / 2], alpha[2];
    my_turn();
    kiln_wg_fence();
    issue_s(s, 0);
    their_turn();
    kiln_wg_wait<0>();
    kiln_wg_pin<BN / 2>(s);
    kiln_mbar_arrive(bars.k_empty(0));
    softmax(s, 0, alpha);
    pack(s);
  }
  // Step j: S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} in flight together; the softmax of S_j
  // overlaps the P·V product, and O takes its rescale once that lands.
  for (int j = 1; j < nblocks; ++j) {
    ready(bars.k_full(j & 1), j);
    ready(bars.v_full((j - 1) & 1), j - 1);
    float s[BN / 2], alpha[2];
    my_turn();
    kiln_wg_pin<D / 2>(o);
    kiln_wg_fence();
    issue_s(s, j);
    issue_pv(j - 1);
    their_turn();
    kiln_wg_wait<1>();
    kiln_wg_pin<BN / 2>(s);
    kiln_mbar_arrive(bars.k_empty(j & 1));
    softmax(s, j, alpha);
    kiln_wg_wait<0>();
    kiln_wg_pin<D / 2>(o);
    kiln_mbar_arrive(bars.v_empty((j - 1) & 1));
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      o[d * 4 + 0] *= alpha[0];
      o[d * 4 + 1] *= alpha[0];
      o[d * 4 + 2] *= alpha[1];
      o[d * 4 + 3] *= alpha[1];
    }
    pack(s);
  }
  if (nblocks > 0) {
    ready(bars.v_full((nblocks - 1) & 1), nblocks - 1);
    my_turn();
    kiln_wg_pin<D / 2>(o);
    kiln_wg_fence();
    issue_pv(nblocks - 1);
    their_turn();
    kiln_wg_wait<0>();
    kiln_wg_pin<D / 2>(o);
  }
  if (cw == 0) my_turn();  // takes consumer 1's last hand-over, so no barrier is left pending
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

/// Shared-memory bytes of the warp-specialized kernel's mbarriers (9 of 8 bytes).
constexpr int64_t kWsBarrierBytes = 72;

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
  // Hopper plans launch the warp-specialized wgmma kernel's shape (3 warpgroups, 128 rows); its
  // sm_90a image runs it, other images of the same plan (compute_90 PTX) the mma.sync kernel on
  // the first 8 warps, 16 rows each.
  const bool wgmma = mma && hopper_plan();
  // Keys per block of the wgmma kernel: 128, K and V double-buffered (164 KB of shared memory at
  // head dim 128 with the 1 KB alignment slack and the mbarriers: one block per SM).
  const int64_t bm = mma ? 128 : 32, bn = 128;
  int64_t smem = mma ? (bm + 4 * 64) * (d + 8) * 2 : (bm * d + 32 * (d + 1) + 32 * dv) * 4;
  if (wgmma) smem = std::max(smem, (bm * d + 4 * bn * d) * 2 + 1024 + kWsBarrierBytes);
  const std::string name = kernel_name("attention");
  const std::string flags = std::string(causal ? "true" : "false") + ", " + (has_mask ? "true" : "false") + ", " + mt;
  const std::string call = "(q, k, v, " + std::string(has_mask ? "mask" : "(const float*)nullptr") + ", y, a);\n";
  std::string body;
  if (wgmma) {
    add_wgmma(WgmmaForm::kSharedShared, bn, st);
    add_wgmma(WgmmaForm::kRegsMnMajorB, d, st);
    if (source_.find("#define KILN_ATTN_WGMMA") == std::string::npos) source_ += kWgmma;
    // Threads that exit do not hold up the mma.sync kernel's barriers.
    body = "#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\n  kiln_flash_attn_ws<" + st + ", " + std::to_string(d) + ", " +
           std::to_string(bn) + ", " + flags + ">" + call + "#else\n  if (threadIdx.x >= 256) return;\n  kiln_flash_attn<" +
           st + ", " + std::to_string(d) + ", " + flags + ", 1, 8>" + call + "#endif\n";
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
  const int64_t threads = wgmma ? 384 : mma ? 128 : 256;
  // setmaxnreg needs a register cap at entry: the explicit one block per SM.
  const std::string bounds = std::to_string(threads) + (wgmma ? ", 1" : "");
  const std::string text = "extern \"C\" __global__ void __launch_bounds__(" + bounds + ") " + name +
                           "(const " + st + "* q, const " + st + "* k, const " + st + "* v, " +
                           (has_mask ? "const " + mt + "* mask, " : std::string()) + st +
                           "* y) {\n  const KilnAttnArgs a = {" + args + "};\n" + body + "}\n";
  add_kernel_text(name, text);
  launch_grid(name, {(sq + bm - 1) / bm, hq, B}, threads, smem, bufs);
  return ok_status();
}

}  // namespace kiln::cuda::detail
