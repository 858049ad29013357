// The bulk-copy INT4 kernel for few rows of x on sm_90 plans (symmetric group 128): a weight
// stream fed by the copy engine instead of per-lane loads. See int4_bulk.h.
#include "int4_bulk.h"

#include <algorithm>

namespace kiln::cuda::detail {

// One block per SM walks a contiguous run of row tiles (16 weight rows, all of K). One producer
// thread streams each tile's 16 rows (K/2 bytes each, contiguous in the packed layout) and its
// scales into a ring of S shared-memory stages with cp.async.bulk, completing on the stage's
// `full` mbarrier; W consumer warps each take every W-th pair of k-blocks of the stage and
// release it on the stage's `empty` mbarrier. The copies hold no registers, so S stages
// (~200 KB at K = 8192) stay in flight while the consumers compute.
//
// The mma is the streaming kernel's m16n8k16 with the tile's weights as A and x as B (columns
// n = lane / 4 < M; the rest zero): lane (g, t)'s A registers are weight rows g and g + 8's pairs
// of nibbles (j, j + 4) of word v, their 16 bytes at k-block kb being k = 128 kb + 32 t .. + 31,
// one 16-byte shared-memory read per row; x is reordered once to the same pairs (chunk
// x0 x4 x1 x5 x2 x6 x3 x7), so lane (g, t)'s B registers are words of x row g's chunk
// 16 kb + 4 t + v. The nibbles become the raw exponent-trick values p = BASE + 8 + q (one lop3
// per pair) and each k-block's sum loses (BASE + 8)·Σx once (Σx per row of x and k-block, summed
// when x is staged) before its scale multiplies it in f32 (FOLD of the streaming kernel). C's
// lane (g, t) holds weight rows g, g + 8 times x rows 2t, 2t + 1; the warps' sums of a tile meet
// in shared memory (red.shared) and the block writes y once at the end.
//
// Stage rows are K/2 + 16 bytes apart and x rows K·2 + 16, so the rows a warp reads at once start
// in different banks (the copy cannot swizzle; the 16-byte pad does the same job).
const char* kInt4Bulk = R"(
extern "C" __global__ void __launch_bounds__(($W + 1) * 32, 1) $NAME(const $XT* __restrict__ x, const unsigned char* __restrict__ w,
    const $ST* __restrict__ scales, const $ST* __restrict__ zeros, const $XT* __restrict__ bias, $XT* __restrict__ y,
    float* __restrict__ part) {
#if __CUDA_ARCH__ >= 900
  constexpr int M = $M, N = $N, K = $K, S = $S, W = $W, TPB = $TPB;
  constexpr int KB = K / 128, RSB = K / 2 + 16, STAGE = 16 * RSB + 32 * KB, XRS = K / 8 + 1;
  constexpr unsigned TX = 16 * (K / 2) + 32 * KB;  // bytes each stage's copies deliver
  constexpr int TILES = N / 16, NT = W * 32;
  typedef $XT E;
  extern __shared__ __align__(128) unsigned char kiln_i4b_smem[];
  // [S stages: 16 padded rows, then the 16 rows' scales] [x, M padded rows, reordered]
  // [corrections M x KB] [the block's sums, TPB tiles x 16 rows x M] [full[S], empty[S], x's]
  uint4* xs = reinterpret_cast<uint4*>(kiln_i4b_smem + S * STAGE);
  float* corr = reinterpret_cast<float*>(kiln_i4b_smem + S * STAGE + M * XRS * 16);
  float* outs = corr + M * KB;
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(
      kiln_i4b_smem + ((S * STAGE + M * XRS * 16 + (M * KB + TPB * 16 * M) * 4 + 7) / 8) * 8);
  const unsigned sbar = (unsigned)__cvta_generic_to_shared(bars);
  auto full = [&](int s) { return sbar + 8u * s; };
  auto empty = [&](int s) { return sbar + 8u * (S + s); };
  const unsigned xbar = sbar + 16u * S;
  auto wait = [](unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  };
  const int o0 = (int)((long long)blockIdx.x * TILES / gridDim.x), o1 = (int)((long long)(blockIdx.x + 1) * TILES / gridDim.x);
  const int nt = o1 - o0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(full(s)) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(empty(s)), "r"(W) : "memory");
    }
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(xbar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (warp == W) {  // the producer
    if (lane != 0) return;
    // x first, so that its copies do not queue behind the stages' (cold L2: they would land
    // after most of the weights, and the consumers would start late).
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(xbar), "r"(M * K * 2) : "memory");
    for (int m = 0; m < M; ++m)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                   :: "r"((unsigned)__cvta_generic_to_shared(xs + m * XRS)), "l"(x + (long long)m * K), "r"(K * 2), "r"(xbar)
                   : "memory");
    for (int i = 0; i < nt; ++i) {
      const int s = i % S;
      if (i >= S) wait(empty(s), (unsigned)(i / S - 1) & 1u);
      const unsigned st = (unsigned)__cvta_generic_to_shared(kiln_i4b_smem + s * STAGE);
      const long long row0 = (long long)(o0 + i) * 16;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(full(s)), "r"(TX) : "memory");
      #pragma unroll
      for (int r = 0; r < 16; ++r)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                     :: "r"(st + r * RSB), "l"(w + (row0 + r) * (K / 2)), "r"(K / 2), "r"(full(s)) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                   :: "r"(st + 16 * RSB), "l"(scales + row0 * KB), "r"(32 * KB), "r"(full(s)) : "memory");
    }
    return;
  }
  // Consumers: once x has landed, each 16-byte chunk reordered in place to x0 x4 x1 x5 x2 x6 x3 x7;
  // the sums zeroed; then each row of x's k-block sums for the corrections.
  wait(xbar, 0);
  for (int c = threadIdx.x; c < M * K / 8; c += NT) {
    uint4* p = xs + (c / (K / 8)) * XRS + c % (K / 8);
    const uint4 v = *p;
    *p = make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632), __byte_perm(v.y, v.w, 0x5410),
                    __byte_perm(v.y, v.w, 0x7632));
  }
  for (int i = threadIdx.x; i < TPB * 16 * M; i += NT) outs[i] = 0.f;
  asm volatile("bar.sync 1, %0;\n" :: "r"(NT) : "memory");
  for (int e = threadIdx.x; e < M * KB; e += NT) {
    float sum = 0.f;
    for (int c = 0; c < 16; ++c) {
      const uint4 v = xs[(e / KB) * XRS + (e % KB) * 16 + c];
      #pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float2 f = kiln_i4_f2(E(), (&v.x)[u]);
        sum += f.x + f.y;
      }
    }
    corr[e] = ($BASE + 8.f) * sum;
  }
  asm volatile("bar.sync 1, %0;\n" :: "r"(NT) : "memory");
  const bool has_x = g < M;                        // lanes whose B column is a row of x
  const bool out0 = 2 * t < M, out1 = 2 * t + 1 < M;  // lanes whose C columns are
  const uint4* xl = xs + (has_x ? g : 0) * XRS + 4 * t;
  for (int i = 0; i < nt; ++i) {
    const int s = i % S;
    wait(full(s), (unsigned)(i / S) & 1u);
    const unsigned char* st = kiln_i4b_smem + s * STAGE;
    const $ST* sc = reinterpret_cast<const $ST*>(st + 16 * RSB);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // Two adjacent k-blocks at a time (their scales one 4-byte read per row), each step of a
    // word into its own accumulators: four independent mma chains of four.
    for (int kb0 = 2 * warp; kb0 < KB; kb0 += 2 * W) {
      float c[2][2][4] = {};
      #pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int kb = kb0 + q;
        if (kb >= KB) break;  // warp-uniform
        const uint4 wa = *reinterpret_cast<const uint4*>(st + g * RSB + kb * 64 + 16 * t);
        const uint4 wb = *reinterpret_cast<const uint4*>(st + (g + 8) * RSB + kb * 64 + 16 * t);
        #pragma unroll
        for (int v = 0; v < 4; ++v) {
          const uint4 xv = has_x ? xl[kb * 16 + v] : make_uint4(0, 0, 0, 0);
          const unsigned ua = (&wa.x)[v], ub = (&wb.x)[v];
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            constexpr unsigned C = $EXP ^ ($FLIP & 0x00080008u);
            const unsigned a[4] = {kiln_i4_pair_bits(ua >> (8 * h), C), kiln_i4_pair_bits(ub >> (8 * h), C),
                                   kiln_i4_pair_bits(ua >> (8 * h + 4), C), kiln_i4_pair_bits(ub >> (8 * h + 4), C)};
            kiln_i4_mma(c[q][h], a, (&xv.x)[2 * h], (&xv.x)[2 * h + 1], E());
          }
        }
      }
      if (out0) {
        const bool two = kb0 + 1 < KB;
        $ST sa[2], sb[2];
        if (two) {  // (kb0 even, KB even: 4-byte aligned)
          const unsigned pa = *reinterpret_cast<const unsigned*>(sc + g * KB + kb0);
          const unsigned pb = *reinterpret_cast<const unsigned*>(sc + (g + 8) * KB + kb0);
          sa[0] = reinterpret_cast<const $ST*>(&pa)[0], sa[1] = reinterpret_cast<const $ST*>(&pa)[1];
          sb[0] = reinterpret_cast<const $ST*>(&pb)[0], sb[1] = reinterpret_cast<const $ST*>(&pb)[1];
        } else {
          sa[0] = sc[g * KB + kb0], sb[0] = sc[(g + 8) * KB + kb0];
        }
        #pragma unroll
        for (int q = 0; q < 2; ++q) {
          if (q == 1 && !two) break;
          const int kb = kb0 + q;
          const float fa = kiln_i4_f(sa[q]), fb = kiln_i4_f(sb[q]);
          const float c0 = corr[(2 * t) * KB + kb], c1 = out1 ? corr[(2 * t + 1) * KB + kb] : 0.f;
          acc[0] += fa * (c[q][0][0] + c[q][1][0] - c0);
          acc[1] += fa * (c[q][0][1] + c[q][1][1] - c1);
          acc[2] += fb * (c[q][0][2] + c[q][1][2] - c0);
          acc[3] += fb * (c[q][0][3] + c[q][1][3] - c1);
        }
      }
    }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(empty(s)) : "memory");
    if (out0) {
      atomicAdd(&outs[(i * 16 + g) * M + 2 * t], acc[0]);
      atomicAdd(&outs[(i * 16 + g + 8) * M + 2 * t], acc[2]);
    }
    if (out1) {
      atomicAdd(&outs[(i * 16 + g) * M + 2 * t + 1], acc[1]);
      atomicAdd(&outs[(i * 16 + g + 8) * M + 2 * t + 1], acc[3]);
    }
  }
  asm volatile("bar.sync 1, %0;\n" :: "r"(NT) : "memory");
  for (int e = threadIdx.x; e < nt * 16 * M; e += NT) {
    const int m = e % M, n = o0 * 16 + e / M;
    kiln_i4_st(y + (long long)m * N + n, outs[e] + $BIAS(n));
  }
#else
  asm volatile("trap;");  // sm_90 plans only: never a silent no-op on an older GPU
#endif
}
)";

Int4BulkPlan plan_int4_bulk(int64_t m, int64_t n, int64_t k, int64_t g, bool asym, int64_t scale_bytes,
                            bool scales_aligned, int64_t smem_limit) {
  Int4BulkPlan p;
  if (m < 1 || m > 8 || g != 128 || asym || scale_bytes != 2 || !scales_aligned || n % 16 != 0 || k % 256 != 0) return p;
  const int64_t kb = k / 128, stage = 16 * (k / 2 + 16) + 32 * kb, tiles = n / 16;
  p.blocks = std::min<int64_t>(132, tiles);
  p.per_block = (tiles + p.blocks - 1) / p.blocks;
  const int64_t rest = ((m * (k * 2 + 16) + (m * kb + p.per_block * 16 * m) * 4 + 7) / 8) * 8;
  p.stages = std::min<int64_t>(8, (smem_limit - rest - (2 * 8 + 1) * 8) / stage);
  if (p.stages < 2) return p;
  p.warps = 8;
  p.smem = p.stages * stage + rest + (2 * p.stages + 1) * 8;
  p.fits = p.smem <= smem_limit;
  return p;
}

}  // namespace kiln::cuda::detail
