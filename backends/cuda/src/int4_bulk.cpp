// The bulk-copy INT4 kernel for few rows of x on sm_90 plans (symmetric group 128): a weight
// stream fed by the copy engine instead of per-lane loads. See int4_bulk.h.
#include "int4_bulk.h"

#include <algorithm>

namespace kiln::cuda::detail {

// One block (or a cluster pair splitting K in halves) per SM walks a contiguous run of row tiles
// (16 weight rows). Each of its W warps owns a fixed run of NKB k-blocks (128 k each) of the
// block's K and holds x's mma fragments for them in registers for the whole kernel, so the only
// shared-memory reads per tile are the weights. The tiles stream in slices, a slice being the
// k-blocks of SQ warps for 16 rows (+ the tile's scales, 16 rows x K / 128, one contiguous copy),
// into a ring of S stages with cp.async.bulk, each completing on its stage's `full` mbarrier.
// There is no producer warp (its registers would cap everyone's at 168, which x's fragments
// need more than): thread 0 fills the ring, and the last of a stage's SQ warps to finish with it
// (a shared counter) refills it with the slice S ahead.
//
// The mma is m16n8k16 with the tile's weights as A and x as B (columns n = lane / 4 + 8u < M;
// the rest zero): lane (g, t)'s A registers are weight rows g and g + 8's pairs of nibbles
// (j, j + 4) of word v, their 16 bytes at k-block kb being k = 128 kb + 32 t .. + 31, one 16-byte
// shared-memory read per row; x is reordered once to the same pairs (chunk x0 x4 x1 x5 x2 x6 x3
// x7), so lane (g, t)'s B registers are words of x row g + 8u's chunk 16 kb + 4 t + v. The
// nibbles become the raw exponent-trick values p = BASE + 8 + q (one lop3 per pair) and each
// k-block's sum loses (BASE + 8)·Σx once before its scale multiplies it in f32 (FOLD of the
// streaming kernel). C's lane (g, t) holds weight rows g, g + 8 times x rows 8u + 2t, + 1; the
// warps' sums of a tile meet in shared memory (red.shared), a pair's in the first block's shared
// memory, and y is written once at the end.
//
// Stage rows are padded by 64 bytes, so a quarter-warp's 16-byte reads (rows g, g + 1 at the
// same offset) fall in different banks (the copy cannot swizzle).
const char* kInt4Bulk = R"(
extern "C" __global__ void $CLUSTER__launch_bounds__($W * 32, 1) $NAME(const $XT* __restrict__ x, const unsigned char* __restrict__ w,
    const $ST* __restrict__ scales, const $ST* __restrict__ zeros, const $XT* __restrict__ bias, $XT* __restrict__ y,
    float* __restrict__ part) {
#if __CUDA_ARCH__ >= 900
  constexpr int M = $M, N = $N, K = $K, S = $S, W = $W, TPB = $TPB, C = $C, NKB = $NKB, SQ = $SQ, NT8 = $NT8;
  constexpr int KB = K / 128, KBB = KB / C;  // k-blocks of a row, of a block's part of it
  constexpr int SKB = SQ * NKB, Q = W / SQ;   // k-blocks of a slice, slices per tile
  constexpr int RSB = SKB * 64 + 64, STAGE = 16 * RSB + 32 * KB;
  constexpr unsigned TX = 16 * SKB * 64 + 32 * KB;  // bytes each stage's copies deliver
  constexpr int TILES = N / 16, NT = W * 32;
  typedef $XT E;
  extern __shared__ __align__(128) unsigned char kiln_i4b_smem[];
  // [S stages: 16 padded rows of the slice, then the tile's scales] [corrections M x KBB]
  // [the block's sums, TPB tiles x 16 rows x M] [C = 2: the second block's] [full[S]] [count[S]]
  float* corr = reinterpret_cast<float*>(kiln_i4b_smem + S * STAGE);
  float* outs = corr + M * KBB;
  float* peer = outs + TPB * 16 * M;
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(
      kiln_i4b_smem + ((S * STAGE + (M * KBB + TPB * 16 * M * C) * 4 + 7) / 8) * 8);
  unsigned* done = reinterpret_cast<unsigned*>(bars + S);  // warps done with each stage, all passes
  const unsigned sbar = (unsigned)__cvta_generic_to_shared(bars);
  auto full = [&](int s) { return sbar + 8u * s; };
  const int o0 = (int)((long long)blockIdx.x * TILES / gridDim.x), o1 = (int)((long long)(blockIdx.x + 1) * TILES / gridDim.x);
  const int nt = o1 - o0, rank = C == 2 ? (int)blockIdx.y : 0, kb0 = rank * KBB;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // Slice j (tile j / Q, slice j % Q) into stage j % S.
  auto fill = [&](int j) {
    const int s = j % S, q = j % Q;
    const unsigned st = (unsigned)__cvta_generic_to_shared(kiln_i4b_smem + s * STAGE);
    const long long row0 = (long long)(o0 + j / Q) * 16;
    const int kq = kb0 + q * SKB;  // the slice's first k-block
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(full(s)), "r"(TX) : "memory");
    #pragma unroll
    for (int r = 0; r < 16; ++r)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                   :: "r"(st + r * RSB), "l"(w + (row0 + r) * (K / 2) + kq * 64), "r"(SKB * 64), "r"(full(s)) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(st + 16 * RSB), "l"(scales + row0 * KB), "r"(32 * KB), "r"(full(s)) : "memory");
  };
  // Warp `warp` takes k-blocks lb .. lb + NKB - 1 of its block's part of K: those of slice qw,
  // the sub-th run of NKB in it, and holds x's fragments for them. Their loads go out before the
  // ring's copies, which would otherwise queue ahead of them (~200 KB per SM from a cold L2)
  // and hold every warp's first tile back (pinned loads: ptxas would sink plain ones).
  const int qw = warp / SQ, sub = warp % SQ, lb = qw * SKB + sub * NKB;
  uint4 xr[NKB][NT8][4];
  #pragma unroll
  for (int jj = 0; jj < NKB; ++jj)
    #pragma unroll
    for (int u = 0; u < NT8; ++u)
      #pragma unroll
      for (int v = 0; v < 4; ++v)
        xr[jj][u][v] = g + 8 * u < M ? kiln_i4_ld16_pinned(x + (long long)(g + 8 * u) * K + (kb0 + lb + jj) * 128 + (4 * t + v) * 8)
                                     : make_uint4(0u, 0u, 0u, 0u);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(full(s)) : "memory");
      done[s] = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int j = 0; j < S && j < nt * Q; ++j) fill(j);
  }
  // Each 16-byte chunk of x reordered to x0 x4 x1 x5 x2 x6 x3 x7, and each row's k-block sums for
  // the corrections (a row's 4 lanes meet by shuffles).
  #pragma unroll
  for (int jj = 0; jj < NKB; ++jj)
    #pragma unroll
    for (int u = 0; u < NT8; ++u) {
      const int r = g + 8 * u;
      float sum = 0.f;
      #pragma unroll
      for (int v = 0; v < 4; ++v) {
        uint4& c = xr[jj][u][v];
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = kiln_i4_f2(E(), (&c.x)[e]);
          sum += f.x + f.y;
        }
        c = make_uint4(__byte_perm(c.x, c.z, 0x5410), __byte_perm(c.x, c.z, 0x7632), __byte_perm(c.y, c.w, 0x5410),
                       __byte_perm(c.y, c.w, 0x7632));
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (t == 0 && r < M) corr[r * KBB + lb + jj] = ($BASE + 8.f) * sum;
    }
  for (int i = threadIdx.x; i < TPB * 16 * M; i += NT) outs[i] = 0.f;
  __syncthreads();
  if (C == 2) kiln_i4_cluster_arrive_relaxed();  // the pair's hand-over waits for both to start
  for (int i = 0; i < nt; ++i) {
    const int j = i * Q + qw, s = j % S;
    {
      unsigned ready = 0;
      while (!ready)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ready) : "r"(full(s)), "r"((unsigned)(j / S) & 1u) : "memory");
    }
    const unsigned char* st = kiln_i4b_smem + s * STAGE;
    const $ST* sc = reinterpret_cast<const $ST*>(st + 16 * RSB) + kb0 + lb;
    float acc[NT8][4] = {};
    #pragma unroll
    for (int jj = 0; jj < NKB; ++jj) {
      const int kl = sub * NKB + jj;  // the k-block within the slice
      const uint4 wa = *reinterpret_cast<const uint4*>(st + g * RSB + kl * 64 + 16 * t);
      const uint4 wb = *reinterpret_cast<const uint4*>(st + (g + 8) * RSB + kl * 64 + 16 * t);
      float c[NT8][2][4] = {};
      #pragma unroll
      for (int v = 0; v < 4; ++v) {
        const unsigned ua = (&wa.x)[v], ub = (&wb.x)[v];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          constexpr unsigned CB = $EXP ^ ($FLIP & 0x00080008u);
          const unsigned a[4] = {kiln_i4_pair_bits(ua >> (8 * h), CB), kiln_i4_pair_bits(ub >> (8 * h), CB),
                                 kiln_i4_pair_bits(ua >> (8 * h + 4), CB), kiln_i4_pair_bits(ub >> (8 * h + 4), CB)};
          #pragma unroll
          for (int u = 0; u < NT8; ++u) kiln_i4_mma(c[u][h], a, (&xr[jj][u][v].x)[2 * h], (&xr[jj][u][v].x)[2 * h + 1], E());
        }
      }
      const float fa = kiln_i4_f(sc[g * KB + jj]), fb = kiln_i4_f(sc[(g + 8) * KB + jj]);
      #pragma unroll
      for (int u = 0; u < NT8; ++u) {
        const int m0 = 8 * u + 2 * t;
        const float c0 = m0 < M ? corr[m0 * KBB + lb + jj] : 0.f, c1 = m0 + 1 < M ? corr[(m0 + 1) * KBB + lb + jj] : 0.f;
        acc[u][0] += fa * (c[u][0][0] + c[u][1][0] - c0);
        acc[u][1] += fa * (c[u][0][1] + c[u][1][1] - c1);
        acc[u][2] += fb * (c[u][0][2] + c[u][1][2] - c0);
        acc[u][3] += fb * (c[u][0][3] + c[u][1][3] - c1);
      }
    }
    // Done with the stage: the last of its SQ warps (every pass adds SQ) refills it. The
    // acq_rel count orders the other warps' reads before the refill's copies.
    __syncwarp();
    if (lane == 0) {
      unsigned before;
      asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;\n" : "=r"(before) : "r"((unsigned)__cvta_generic_to_shared(done + s)) : "memory");
      if (before + 1 == (unsigned)SQ * (j / S + 1) && j + S < nt * Q) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        fill(j + S);
      }
    }
    #pragma unroll
    for (int u = 0; u < NT8; ++u) {
      const int m0 = 8 * u + 2 * t;
      if (m0 < M) {
        atomicAdd(&outs[(i * 16 + g) * M + m0], acc[u][0]);
        atomicAdd(&outs[(i * 16 + g + 8) * M + m0], acc[u][2]);
      }
      if (m0 + 1 < M) {
        atomicAdd(&outs[(i * 16 + g) * M + m0 + 1], acc[u][1]);
        atomicAdd(&outs[(i * 16 + g + 8) * M + m0 + 1], acc[u][3]);
      }
    }
  }
  __syncthreads();
  if (C == 2) {  // the second block's sums into the first's shared memory
    kiln_i4_cluster_wait();
    if (rank == 1)
      for (int e = threadIdx.x; e < nt * 16 * M; e += NT) kiln_i4_st_peer(peer + e, 0, outs[e]);
    kiln_i4_cluster_arrive();
    kiln_i4_cluster_wait();
    if (rank == 1) return;
  }
  for (int e = threadIdx.x; e < nt * 16 * M; e += NT) {
    const int m = e % M, n = o0 * 16 + e / M;
    kiln_i4_st(y + (long long)m * N + n, outs[e] + (C == 2 ? peer[e] : 0.f) + $BIAS(n));
  }
#else
  asm volatile("trap;");  // sm_90 plans only: never a silent no-op on an older GPU
#endif
}
)";

Int4BulkPlan plan_int4_bulk(int64_t m, int64_t n, int64_t k, int64_t g, bool asym, int64_t scale_bytes,
                            bool scales_aligned, int64_t smem_limit, int64_t split, int64_t slice_kb) {
  Int4BulkPlan p;
  if (m < 1 || m > 16 || g != 128 || asym || scale_bytes != 2 || !scales_aligned || n % 16 != 0 || k % 1024 != 0) return p;
  p.nt8 = m > 8 ? 2 : 1;
  const int64_t kb = k / 128;
  // x's fragments take NKB · NT8 · 16 registers per lane: at most 128, so larger K or M = 9..16
  // split K across a cluster pair.
  p.split = split != 0 ? split : (kb / p.warps) * p.nt8 <= 8 ? 1 : 2;
  if (kb % (p.split * p.warps) != 0) return p;
  p.nkb = kb / (p.split * p.warps);
  if (p.nkb * p.nt8 > 8) return p;
  // Slices of at least `slice_kb` k-blocks (16 by default: 16 KB of a 16-row tile) where the
  // block's warps allow.
  const int64_t want = slice_kb > 0 ? slice_kb : 16;
  for (p.sq = 1; p.sq < p.warps && p.sq * p.nkb < want; p.sq *= 2) {
  }
  const int64_t skb = p.sq * p.nkb, stage = 16 * (skb * 64 + 64) + 32 * kb, tiles = n / 16;
  // (Pairs: 64 of them, every cluster resident at once.)
  p.blocks = std::min<int64_t>(p.split == 1 ? 132 : 64, tiles);
  p.per_block = (tiles + p.blocks - 1) / p.blocks;
  const int64_t rest = ((m * (kb / p.split) + p.per_block * 16 * m * p.split) * 4 + 7) / 8 * 8;
  p.stages = std::min<int64_t>(16, (smem_limit - rest - 16 * 12) / stage);
  if (p.stages < 2) return p;
  p.smem = p.stages * stage + rest + p.stages * 12;  // + full barriers and counts
  p.fits = p.smem <= smem_limit;
  return p;
}

}  // namespace kiln::cuda::detail
