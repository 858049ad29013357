// CUDA lowering of attention: one flash-attention kernel per node (mma.sync for f16/bf16, CUDA cores else).
//
// Both kernels keep the running row max and sum of an online softmax in f32 and never write
// the score matrix: a block owns a tile of query rows of one (batch, head), walks the key
// blocks it can see (causal blocks past the diagonal are skipped), rescales its output
// accumulator when the max grows and divides by the sum once at the end. Scores are kept
// in the log2 domain (scale·log2 e folded into one multiplier) so exp is one exp2f.
#include <cmath>

#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

/// Device helpers shared by every attention kernel in one source (defined once).
const char* kHelpers = R"(
#define KILN_ATTN_HELPERS
#define KILN_LOG2E 1.4426950408889634f
#define KILN_ATTN_INF __int_as_float(0x7f800000)
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

// Tensor-core flash attention (FlashAttention-2 layout): 4 warps own 32 query rows each (two
// m16 tiles, so every K and V fragment read from shared memory feeds four mma) of a 128-row
// tile; K and V tiles of 64 keys are double-buffered through cp.async; Q is re-read from
// shared memory per k-step to leave registers to the accumulators; P stays in registers and
// feeds the P·V mma directly. Requires Dv == D, D % 16 == 0.
template <typename T, int D, bool CAUSAL, bool HAS_MASK, typename MT>
__device__ __forceinline__ void kiln_flash_attn(const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const MT* __restrict__ mask, T* __restrict__ y, int Hq, int Hkv, int Sq,
    int Skv, float scale_log2, long long msb, long long msh, long long msi, long long msj) {
  constexpr int WM = 2, NW = 4, BM = NW * 16 * WM, BN = 64, NT = NW * 32, LD = D + 8, CH = D / 8;
  extern __shared__ __align__(16) unsigned char kiln_attn_smem[];
  T* sQ = reinterpret_cast<T*>(kiln_attn_smem);
  T* sK = sQ + BM * LD;
  T* sV = sK + 2 * BN * LD;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // Causal tiles near the end see the most keys: start them first.
  const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (Hq / Hkv);
  const T* qp = q + (long long)(b * Hq + h) * Sq * D;
  const T* kp = k + (long long)(b * Hkv + hk) * Skv * D;
  const T* vp = v + (long long)(b * Hkv + hk) * Skv * D;
  const int off = Skv - Sq;
  int nblocks = (Skv + BN - 1) / BN;
  if (CAUSAL) {
    const int last = q0 + BM - 1 + off;
    nblocks = min(nblocks, last < 0 ? 0 : last / BN + 1);
  }
  for (int c = tid; c < BM * CH; c += NT) {
    const int r = c / CH, cc = c % CH;
    const bool ok = q0 + r < Sq;
    kiln_attn_cp16(sQ + r * LD + cc * 8, qp + (long long)(ok ? q0 + r : 0) * D + cc * 8, ok);
  }
  auto load_kv = [&](int blk, int buf) {
    const int n0 = blk * BN;
    for (int c = tid; c < BN * CH; c += NT) {
      const int r = c / CH, cc = c % CH;
      const bool ok = n0 + r < Skv;
      const long long row = ok ? n0 + r : 0;
      kiln_attn_cp16(sK + (buf * BN + r) * LD + cc * 8, kp + row * D + cc * 8, ok);
      kiln_attn_cp16(sV + (buf * BN + r) * LD + cc * 8, vp + row * D + cc * 8, ok);
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
            float x = s[m][j][e] * scale_log2;
            if (HAS_MASK && row < Sq && col < Skv)
              x += kiln_attn_f(mask[b * msb + h * msh + row * msi + col * msj]) * KILN_LOG2E;
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
      T* yp = y + ((long long)(b * Hq + h) * Sq + row) * D + 2 * t;
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
    const T* __restrict__ v, const MT* __restrict__ mask, T* __restrict__ y, int Hq, int Hkv, int Sq,
    int Skv, float scale_log2, long long msb, long long msh, long long msi, long long msj) {
  constexpr int BM = 32, BN = 32, NT = 256, RPW = BM / (NT / 32), VP = (DV + 31) / 32;
  extern __shared__ __align__(16) unsigned char kiln_attn_smem[];
  float* sQ = reinterpret_cast<float*>(kiln_attn_smem);  // [BM][D]
  float* sK = sQ + BM * D;                                // [BN][D + 1]: lanes read rows
  float* sV = sK + BN * (D + 1);                          // [BN][DV]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (Hq / Hkv);
  const T* qp = q + (long long)(b * Hq + h) * Sq * D;
  const T* kp = k + (long long)(b * Hkv + hk) * Skv * D;
  const T* vp = v + (long long)(b * Hkv + hk) * Skv * DV;
  const int off = Skv - Sq;
  int nblocks = (Skv + BN - 1) / BN;
  if (CAUSAL) {
    const int last = q0 + BM - 1 + off;
    nblocks = min(nblocks, last < 0 ? 0 : last / BN + 1);
  }
  for (int i = tid; i < BM * D; i += NT)
    sQ[i] = q0 + i / D < Sq ? kiln_attn_f(qp[(long long)q0 * D + i]) * scale_log2 : 0.f;
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
      sK[r * (D + 1) + c] = n0 + r < Skv ? kiln_attn_f(kp[(long long)(n0 + r) * D + c]) : 0.f;
    }
    for (int i = tid; i < BN * DV; i += NT)
      sV[i] = n0 + i / DV < Skv ? kiln_attn_f(vp[(long long)n0 * DV + i]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      const int lr = warp * RPW + i, row = q0 + lr, col = n0 + lane;
      float x = 0.f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) x += sQ[lr * D + d] * sK[lane * (D + 1) + d];
      if (HAS_MASK && row < Sq && col < Skv)
        x += kiln_attn_f(mask[b * msb + h * msh + row * msi + col * msj]) * KILN_LOG2E;
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
        kiln_attn_store(y + ((long long)(b * Hq + h) * Sq + row) * DV + lane + 32 * c, o[i][c] * inv);
  }
}
)";

}  // namespace

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
  const int out = activation_for(n.result());
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
  if (source_.find("#define KILN_ATTN_HELPERS") == std::string::npos) source_ += kHelpers;
  const bool causal = n.get_int("causal") != 0;
  const float scale_log2 = static_cast<float>(n.get_float("scale") * 1.4426950408889634);
  const int64_t bm = mma ? 128 : 32;
  const int64_t smem = mma ? (bm + 4 * 64) * (d + 8) * 2 : (bm * d + 32 * (d + 1) + 32 * dv) * 4;
  const std::string name = kernel_name("attention");
  const std::string tmpl =
      mma ? "kiln_flash_attn<" + st + ", " + std::to_string(d)
          : "kiln_attn_generic<" + st + ", " + std::to_string(d) + ", " + std::to_string(dv);
  const int64_t threads = mma ? 128 : 256;
  std::string text = "extern \"C\" __global__ void __launch_bounds__(" + std::to_string(threads) + ") " + name + "(const " + st +
                     "* q, const " + st + "* k, const " + st + "* v, " +
                     (has_mask ? "const " + mt + "* mask, " : std::string()) + st + "* y) {\n  " + tmpl +
                     ", " + (causal ? "true" : "false") + ", " + (has_mask ? "true" : "false") + ", " + mt +
                     ">(q, k, v, " + (has_mask ? "mask" : "(const float*)nullptr") + ", y, " +
                     std::to_string(hq) + ", " + std::to_string(hkv) + ", " + std::to_string(sq) + ", " +
                     std::to_string(skv) + ", " + literal(DType::kF32, scale_log2) + ", " +
                     int_literal(ms[0]) + ", " + int_literal(ms[1]) + ", " + int_literal(ms[2]) + ", " +
                     int_literal(ms[3]) + ");\n}\n";
  add_kernel_text(name, text);
  std::vector<int> args = {buf(n.operand(0)), buf(n.operand(1)), buf(n.operand(2))};
  if (has_mask) args.push_back(buf(n.operand(3)));
  args.push_back(out);
  launch_grid(name, {(sq + bm - 1) / bm, hq, B}, threads, smem, args);
  return ok_status();
}

}  // namespace kiln::cuda::detail
