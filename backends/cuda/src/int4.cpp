// Lowering of matmul_int4 (packed 4-bit weights, group scales; layout in ir/src/ops/int4.cpp):
// a GEMV kernel for M <= 8, an mma.sync tensor-core kernel for M <= 64, and above that a
// dequantize kernel into a bf16/f16 scratch weight followed by the ordinary cuBLASLt gemm.
//
// Both fused kernels turn nibbles into numbers with the exponent trick: a nibble q OR'ed into
// 0x6400 (f16 1024) or 0x4300 (bf16 128) reads as 1024 + q or 128 + q, so one lop3 and one
// subtraction dequantize two values at once. Signed nibbles become offset binary (q + 8) by an
// XOR with 0x8 first.
#include <string>

#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

/// Replaces every `$KEY` in `text` by its value, in order (a key that prefixes a later one,
/// like $N and $NAME, must come after it).
std::string fill(std::string text, const std::vector<std::pair<std::string, std::string>>& subs) {
  for (const auto& [k, v] : subs)
    for (size_t at = text.find(k); at != std::string::npos; at = text.find(k, at + v.size())) text.replace(at, k.size(), v);
  return text;
}

/// Device helpers shared by every int4 kernel in one source (defined once).
const char* kHelpers = R"(
#ifndef KILN_INT4_HELPERS
#define KILN_INT4_HELPERS
__device__ __forceinline__ float kiln_i4_f(float v) { return v; }
__device__ __forceinline__ float kiln_i4_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float kiln_i4_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void kiln_i4_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void kiln_i4_st(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void kiln_i4_st(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
// Nibbles j and j+4 of w (offset binary) as f16 pairs 1024 + q.
__device__ __forceinline__ __half2 kiln_i4_pair(unsigned w, int j) {
  unsigned h = ((w >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
  return *reinterpret_cast<__half2*>(&h);
}
__device__ __forceinline__ unsigned kiln_i4_u32(__half2 h) { return *reinterpret_cast<unsigned*>(&h); }
__device__ __forceinline__ unsigned kiln_i4_u32(__nv_bfloat162 h) { return *reinterpret_cast<unsigned*>(&h); }
// The two 4-bit values of byte b (low nibble first) as a dequantized pair of the mma's dtype:
// (q - zero) * scale, q being offset binary for signed weights (zero 8 then).
__device__ __forceinline__ unsigned kiln_i4_deq(__half, unsigned b, __half2 zero, __half2 scale) {
  unsigned h = (b & 0xFu) | ((b & 0xF0u) << 12) | 0x64006400u;
  __half2 q = __hsub2(*reinterpret_cast<__half2*>(&h), __float2half2_rn(1024.0f));
  return kiln_i4_u32(__hmul2(__hsub2(q, zero), scale));
}
__device__ __forceinline__ unsigned kiln_i4_deq(__nv_bfloat16, unsigned b, __nv_bfloat162 zero, __nv_bfloat162 scale) {
  unsigned h = (b & 0xFu) | ((b & 0xF0u) << 12) | 0x43004300u;
  __nv_bfloat162 q = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&h), __float2bfloat162_rn(128.0f));
  return kiln_i4_u32(__hmul2(__hsub2(q, zero), scale));
}
__device__ __forceinline__ void kiln_i4_mma(float* c, const unsigned* a, unsigned b0, unsigned b1, __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void kiln_i4_mma(float* c, const unsigned* a, unsigned b0, unsigned b1, __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
)";

// GEMV, M <= 8. A warp owns R weight rows; its lane l reads 16 bytes (32 values) at k = c + 32 l
// of each row for chunks c of 1024, so a row's chunk is one coalesced 512-byte read and the R
// loads are in flight together. x is staged per chunk in shared memory as f32 with 4 floats of
// padding every 32, which makes the lanes' float4 reads conflict-free. The group scale is
// applied once per lane and chunk: 32 values lie in one group (G >= 32, aligned).
const char* kGemv = R"(
extern "C" __global__ void __launch_bounds__(256) $NAME(const $XT* __restrict__ x, const unsigned char* __restrict__ w,
    const $ST* __restrict__ scales, const $ST* __restrict__ zeros, const $XT* __restrict__ bias, $XT* __restrict__ y) {
  constexpr int M = $M, N = $N, K = $K, G = $G, R = $R, KC = 1024, PAD = KC + KC / 8;
  extern __shared__ __align__(16) float xs[];  // [M][PAD]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = (blockIdx.x * 8 + warp) * R;
  float acc[R][M];
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  for (int c = 0; c < K; c += KC) {
    __syncthreads();
    for (int i = threadIdx.x; i < M * KC; i += 256) {
      const int m = i / KC, k = i % KC;
      xs[m * PAD + k + (k >> 5) * 4] = c + k < K ? kiln_i4_f(x[(long long)m * K + c + k]) : 0.f;
    }
    __syncthreads();
    const int k = c + lane * 32;
    if (k >= K) continue;
    uint4 q[R];
    #pragma unroll
    for (int r = 0; r < R; ++r)
      q[r] = n0 + r < N ? __ldg(reinterpret_cast<const uint4*>(w + (long long)(n0 + r) * (K / 2) + k / 2)) : make_uint4(0, 0, 0, 0);
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      if (n0 + r >= N) break;
      const unsigned wd[4] = {q[r].x ^ $FLIP, q[r].y ^ $FLIP, q[r].z ^ $FLIP, q[r].w ^ $FLIP};
      float part[M], xsum[M];
      #pragma unroll
      for (int m = 0; m < M; ++m) part[m] = 0.f, xsum[m] = 0.f;
      #pragma unroll
      for (int v = 0; v < 4; ++v) {
        // Word v holds values 8v..8v+7; pair j gives values 8v+2j.. as (j, j+4) -> k offsets.
        float wv[8];
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __half22float2(__hsub2(kiln_i4_pair(wd[v], j), __float2half2_rn(1024.0f)));
          // nibble 2i is the low nibble of byte i: shift 4j of the word selects nibbles j and j+4.
          wv[j] = f.x, wv[j + 4] = f.y;
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          const float* xp = xs + m * PAD + lane * 36 + v * 8;
          const float4 a = *reinterpret_cast<const float4*>(xp), b = *reinterpret_cast<const float4*>(xp + 4);
          part[m] += a.x * wv[0] + a.y * wv[1] + a.z * wv[2] + a.w * wv[3] + b.x * wv[4] + b.y * wv[5] + b.z * wv[6] + b.w * wv[7];
          xsum[m] += a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w;
        }
      }
      const long long gi = (long long)(n0 + r) * (K / G) + k / G;
      const float s = kiln_i4_f(scales[gi]), z = $ZERO;
      #pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] += s * (part[m] - z * xsum[m]);
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = acc[r][m];
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && n0 + r < N) kiln_i4_st(y + (long long)m * N + n0 + r, v + $BIAS(n0 + r));
    }
}
)";

// Tensor cores, 8 < M <= 64: mma.sync m16n8k16 with A = x rows and B = dequantized weights.
// A warp owns 8 weight rows (one n8 tile) per T tiles; lane l holds row n = l / 4 of a tile and
// reads 16 bytes (32 values) at k = kb + 32 (l % 4) of each 128-wide k block. The sum over k
// is order-free, so the mma's k slots are permuted to match what each lane loaded: in step s of
// the block, slots 2t..2t+1 and 8+2t..8+2t+1 (t = l % 4) hold k = kb + 32t + 4s + 0..3, which
// is byte 2s and 2s+1 of the lane's 16 bytes; the A fragment then needs x[m][kb + 32t + 4s ..
// +3], 8 contiguous bytes that the lane reads from global memory (x is small and L1/L2
// resident). Scales and zeros apply in the dequantize, per lane and block (one group).
const char* kMma = R"(
extern "C" __global__ void __launch_bounds__(128) $NAME(const $XT* __restrict__ x, const unsigned char* __restrict__ w,
    const $ST* __restrict__ scales, const $ST* __restrict__ zeros, const $XT* __restrict__ bias, $XT* __restrict__ y) {
  constexpr int M = $M, N = $N, K = $K, G = $G, T = $T, MT = (M + 15) / 16;
  typedef $XT E;
  typedef $E2 E2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3, rn = lane >> 2;
  const int nb = (blockIdx.x * 4 + warp) * 8 * T;
  float c[MT][T][4];
  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < T; ++j) c[i][j][0] = c[i][j][1] = c[i][j][2] = c[i][j][3] = 0.f;
  for (int kb = 0; kb < K; kb += 128) {
    const int k = kb + 32 * t;
    const bool kin = k < K;
    uint4 q[T];
    E2 sc[T], zr[T];
    #pragma unroll
    for (int j = 0; j < T; ++j) {
      const int n = nb + 8 * j + rn;
      const bool ok = kin && n < N;
      q[j] = ok ? __ldg(reinterpret_cast<const uint4*>(w + (long long)n * (K / 2) + k / 2)) : make_uint4(0, 0, 0, 0);
      const long long gi = (long long)(ok ? n : 0) * (K / G) + (kin ? k : 0) / G;
      sc[j] = ok ? $CVT2(kiln_i4_f(scales[gi])) : $CVT2(0.f);
      zr[j] = $CVT2($ZERO);
      if ($FLIP) q[j].x ^= $FLIP, q[j].y ^= $FLIP, q[j].z ^= $FLIP, q[j].w ^= $FLIP;
    }
    #pragma unroll
    for (int s2 = 0; s2 < 4; ++s2) {
      // A: rows rn + 16 i (+8), 8 values (two mma steps) at k + 8 s2.
      uint4 a[MT][2];
      #pragma unroll
      for (int i = 0; i < MT; ++i)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = 16 * i + rn + 8 * h;
          a[i][h] = kin && m < M ? __ldg(reinterpret_cast<const uint4*>(x + (long long)m * K + k + 8 * s2)) : make_uint4(0, 0, 0, 0);
        }
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * s2 + h;  // bytes 2s, 2s+1 of the lane's 16
        #pragma unroll
        for (int j = 0; j < T; ++j) {
          const unsigned word = (&q[j].x)[s >> 1], sh = (s & 1) * 16;
          const unsigned b0 = kiln_i4_deq(E(), (word >> sh) & 0xFFu, zr[j], sc[j]);
          const unsigned b1 = kiln_i4_deq(E(), (word >> (sh + 8)) & 0xFFu, zr[j], sc[j]);
          #pragma unroll
          for (int i = 0; i < MT; ++i) {
            const unsigned lo = h ? a[i][0].z : a[i][0].x, hi = h ? a[i][0].w : a[i][0].y;
            const unsigned lo8 = h ? a[i][1].z : a[i][1].x, hi8 = h ? a[i][1].w : a[i][1].y;
            const unsigned af[4] = {lo, lo8, hi, hi8};
            kiln_i4_mma(c[i][j], af, b0, b1, E());
          }
        }
      }
    }
  }
  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < T; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = 16 * i + rn + 8 * (e >> 1), n = nb + 8 * j + 2 * t + (e & 1);
        if (m < M && n < N) kiln_i4_st(y + (long long)m * N + n, c[i][j][e] + $BIAS(n));
      }
}
)";

// Dequantize into a scratch weight [N, K] of x's dtype for the cuBLASLt path (M > 64).
const char* kDequant = R"(
extern "C" __global__ void __launch_bounds__(256) $NAME(const unsigned char* __restrict__ w, const $ST* __restrict__ scales,
    const $ST* __restrict__ zeros, $XT* __restrict__ out) {
  constexpr long long N = $N, K = $K, G = $G;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < N * K / 2; i += (long long)gridDim.x * blockDim.x) {
    const long long n = i / (K / 2), k = (i % (K / 2)) * 2, gi = n * (K / G) + k / G;
    const unsigned b = w[i] ^ ($FLIP & 0xFFu);
    const float s = kiln_i4_f(scales[gi]), z = $ZERO;
    kiln_i4_st(out + n * K + k, ((float)(b & 0xF) - z) * s);
    kiln_i4_st(out + n * K + k + 1, ((float)(b >> 4) - z) * s);
  }
}
)";

}  // namespace

Status Lowerer::matmul_int4(const Node& n) {
  const DType xt = n.operand(0)->dtype(), st = n.operand(2)->dtype();
  const bool asym = n.get_int("asymmetric", 0) == 1;
  const int bias_at = asym ? 4 : 3;
  const bool has_bias = n.num_operands() > bias_at;
  const Sizes ws = sizes_of(n.operand(1));
  const int64_t nn = ws[0], k = ws[1] * 2, g = n.get_int("group_size");
  const int64_t m = nn == 0 ? 0 : product(sizes_of(n.result())) / nn;
  const int out = activation_for(n.result());
  note_dtype(xt);
  note_dtype(st);
  note_dtype(DType::kF16);  // the nibble trick builds f16 pairs
  note_dtype(DType::kBF16);  // the shared helpers are written for both half types
  if (m * nn == 0) return ok_status();
  if (k == 0) {
    if (!has_bias) {
      steps_.push_back({"step memset dst=b" + std::to_string(out) + " bytes=" + std::to_string(bufs_[out].bytes), {out}});
      return ok_status();
    }
    return gather_view(n, buf(n.operand(bias_at)), out, {m, nn}, {0, 1}, 0);
  }
  if (source_.find("#define KILN_INT4_HELPERS") == std::string::npos) source_ += kHelpers;
  KILN_ASSIGN_OR_RETURN(std::string xs, storage(n, xt));
  KILN_ASSIGN_OR_RETURN(std::string ss, storage(n, st));
  const int x = buf(n.operand(0)), w = buf(n.operand(1)), s = buf(n.operand(2));
  // Absent zeros and bias are passed as the scales / x buffer and never read.
  const int z = asym ? buf(n.operand(3)) : s;
  const int b = has_bias ? buf(n.operand(bias_at)) : x;
  const std::string flip = asym ? "0u" : "0x88888888u";
  const std::string zero = asym ? "kiln_i4_f(zeros[gi])" : "8.f";
  std::vector<std::pair<std::string, std::string>> subs = {
      {"$XT", xs}, {"$ST", ss}, {"$M", std::to_string(m)}, {"$N", std::to_string(nn)}, {"$K", std::to_string(k)},
      {"$G", std::to_string(g)}, {"$FLIP", flip}, {"$ZERO", zero}};
  auto with_bias = [&](std::string text) {
    // $BIAS(expr) -> kiln_i4_f(bias[expr]) or (0.f)
    for (size_t at = text.find("$BIAS("); at != std::string::npos; at = text.find("$BIAS(", at)) {
      const size_t close = text.find(')', at);
      const std::string arg = text.substr(at + 6, close - at - 6);
      const std::string rep = has_bias ? "kiln_i4_f(bias[" + arg + "])" : "0.f";
      text.replace(at, close - at + 1, rep);
    }
    return text;
  };
  if (m <= 8) {
    // Rows per warp: 4 keeps four 16-byte loads in flight per lane when N leaves enough warps
    // for 132 SMs; fewer rows per warp for small N.
    const int64_t r = nn >= 132 * 8 * 4 ? 4 : (nn >= 132 * 8 * 2 ? 2 : 1);
    const std::string name = kernel_name("matmul_int4_gemv");
    subs.insert(subs.begin(), {"$NAME", name});
    subs.push_back({"$R", std::to_string(r)});
    add_kernel_text(name, with_bias(fill(kGemv, subs)));
    const int64_t smem = m * (1024 + 128) * 4;
    launch_grid(name, {(nn + 8 * r - 1) / (8 * r)}, 256, smem, {x, w, s, z, b, out});
    return ok_status();
  }
  if (m <= 64 && xt != DType::kF32) {
    // Tiles per warp: one n8 tile (32 columns a block, 256 blocks at N = 8192, two per SM);
    // two only once N leaves more than two blocks per SM that way.
    const int64_t t = nn > 132 * 32 * 2 * 2 ? 2 : 1;
    const std::string name = kernel_name("matmul_int4_mma");
    subs.insert(subs.begin(), {"$NAME", name});
    subs.push_back({"$T", std::to_string(t)});
    subs.push_back({"$E2", xt == DType::kBF16 ? "__nv_bfloat162" : "__half2"});
    subs.push_back({"$CVT2", xt == DType::kBF16 ? "__float2bfloat162_rn" : "__float2half2_rn"});
    add_kernel_text(name, with_bias(fill(kMma, subs)));
    launch_grid(name, {(nn + 32 * t - 1) / (32 * t)}, 128, 0, {x, w, s, z, b, out});
    return ok_status();
  }
  // Larger M (or f32 x): dequantize once, then the ordinary GEMM (y = x @ W^T + bias).
  const int scratch = add_buffer("activation", xt, {nn, k}, "");
  const std::string name = kernel_name("int4_dequantize");
  subs.insert(subs.begin(), {"$NAME", name});
  add_kernel_text(name, fill(kDequant, subs));
  launch_grid(name, {std::clamp<int64_t>((nn * k / 2 + 255) / 256, 1, kMaxGrid)}, 256, 0, {w, s, z, scratch});
  gemm_ = true;
  std::string text = "step gemm a=b" + std::to_string(x) + " b=b" + std::to_string(scratch) + " d=b" + std::to_string(out);
  std::vector<int> used = {x, scratch, out};
  if (has_bias) {
    text += " bias=b" + std::to_string(b);
    used.push_back(b);
  }
  const std::string compute = xt == DType::kF32 && opts_.allow_tf32 ? "tf32" : "f32";
  text += " m=" + std::to_string(m) + " n=" + std::to_string(nn) + " k=" + std::to_string(k) +
          " batch=1 trans_a=0 trans_b=1 lda=" + std::to_string(k) + " ldb=" + std::to_string(k) +
          " ldd=" + std::to_string(nn) + " stride_a=" + std::to_string(m * k) + " stride_b=0 stride_d=" +
          std::to_string(m * nn) + " dtype=" + dname(xt) + " compute=" + compute + " alpha=1 beta=0 epilogue=" +
          (has_bias ? "bias" : "none");
  steps_.push_back({text, used});
  return ok_status();
}

}  // namespace kiln::cuda::detail
