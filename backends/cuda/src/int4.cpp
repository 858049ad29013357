// Lowering of matmul_int4 (packed 4-bit weights, group scales; layout in ir/src/ops/int4.cpp):
// a streaming mma.sync kernel for f16/bf16 x with M <= 64 (split-K across blocks when N is
// small), a GEMV kernel for f32 x with M <= 8, and otherwise a dequantize kernel into a
// bf16/f16/f32 scratch weight followed by the ordinary cuBLASLt gemm.
//
// The fused kernels turn nibbles into numbers with the exponent trick: a nibble q OR'ed into
// 0x6400 (f16 1024) or 0x4300 (bf16 128) reads as 1024 + q or 128 + q, so one lop3 and one
// subtraction dequantize two values at once. Signed nibbles become offset binary (q + 8) by an
// XOR with 0x8 first.
#include <cstdint>
#include <cstring>
#include <optional>
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
// (v & 0x000F000F) ^ c in one lop3 (the compiler splits two immediates into two).
__device__ __forceinline__ unsigned kiln_i4_pair_bits(unsigned v, unsigned c) {
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;\n" : "=r"(r) : "r"(v), "r"(0x000F000Fu), "r"(c));
  return r;
}
// Both values of a packed half pair as floats.
__device__ __forceinline__ float2 kiln_i4_f2(__half, unsigned u) { return __half22float2(*reinterpret_cast<__half2*>(&u)); }
__device__ __forceinline__ float2 kiln_i4_f2(__nv_bfloat16, unsigned u) { return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xFFFF0000u)); }
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
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void kiln_i4_mma(float* c, const unsigned* a, unsigned b0, unsigned b1, __nv_bfloat16) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Plain (coherent) global loads in volatile asm: ptxas keeps them above a following barrier,
// where it sinks read-only (.nc) loads below it and below a cp.async wait.
__device__ __forceinline__ uint4 kiln_i4_ld16_pinned(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
template <class T> __device__ __forceinline__ T kiln_i4_ld_pinned(const T* p) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "16- or 32-bit scales");
  if constexpr (sizeof(T) == 2) {
    unsigned short u;
    asm volatile("ld.global.u16 %0, [%1];\n" : "=h"(u) : "l"(p));
    return *reinterpret_cast<const T*>(&u);
  } else {
    unsigned u;
    asm volatile("ld.global.u32 %0, [%1];\n" : "=r"(u) : "l"(p));
    return *reinterpret_cast<const T*>(&u);
  }
}
__device__ __forceinline__ void kiln_i4_cp16(void* s, const void* g, bool ok) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(g), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void kiln_i4_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's cp.async groups are pending.
template <int N> __device__ __forceinline__ void kiln_i4_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// Thread-block clusters (sm_90 on; the lowering only asks for them in sm_90 plans, and the
// older images of a plan trap if they ever get here). Every thread of both blocks takes part in
// each arrive / wait.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KILN_I4_CLUSTER_PTX(...) asm volatile(__VA_ARGS__)
#define KILN_I4_PAIR_DIMS __cluster_dims__(1, 2, 1)
#else
#define KILN_I4_CLUSTER_PTX(...) __trap()
#define KILN_I4_PAIR_DIMS
#endif
__device__ __forceinline__ void kiln_i4_cluster_arrive_relaxed() { KILN_I4_CLUSTER_PTX("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void kiln_i4_cluster_arrive() { KILN_I4_CLUSTER_PTX("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void kiln_i4_cluster_wait() { KILN_I4_CLUSTER_PTX("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ unsigned kiln_i4_cluster_rank() {
  unsigned r = 0;
  KILN_I4_CLUSTER_PTX("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// *p = v in the shared memory of cluster block `rank` (p: the same variable in this block).
__device__ __forceinline__ void kiln_i4_st_peer(float* p, unsigned rank, float v) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  KILN_I4_CLUSTER_PTX("{\n.reg .b32 r;\nmapa.shared::cluster.u32 r, %0, %1;\nst.shared::cluster.f32 [r], %2;\n}\n" ::"r"(a),
                      "r"(rank), "f"(v) : "memory");
}
#endif
)";

// GEMV, f32 x and M <= 8 (or a view of w the streaming kernel cannot read). A warp owns R weight rows; its lane l reads 16 bytes (32 values) at k = c + 32 l
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

// Tensor cores, every M <= 64 with f16/bf16 x: one streaming kernel, built to read the packed
// weights once at full HBM bandwidth. mma.sync m16n8k16 with A = dequantized weights (16 rows
// of N) and B = x^T (8 rows of M per n8 tile), so M = 1..8 pads only to 8, not 16.
//
// Block: 32·NW·KW threads = NW N-warps x KW K-warps (see the lowering: 4 x 4 up to M = 16, 8 x 2
// at M = 5..16 on sm_90, 4 x 2 above), 16·MT·NW weight rows (grid.x = N / (16 MT NW); MT = 2
// row tiles per warp above M = 16, else 1). The block walks its K range in super-chunks of
// KW·KC; K-warp wk takes KC of each (D = KC / 128 k-blocks), and the KW parts are summed
// through shared memory at the end. grid.y splits K across blocks when N gives too few blocks
// for the SMs; the partial sums then meet by atomicAdd in an f32 scratch and a second kernel adds
// the bias and rounds (the lowering zeroes the scratch), or, split in two on sm_90, in the first
// block of a cluster pair (PAIR).
// Memory parallelism: a warp loads all D k-blocks of the super-chunk PF ahead (2 x 16 B per lane
// and k-block: 4 KB per warp at D = 4, 32 KB per SM and super-chunk with one block of 8 warps,
// 256 B contiguous per row) into registers before it computes the current one; x for the next
// super-chunk goes to the next of PF + 1 shared buffers with cp.async, so neither waits on the
// other.
//
// Fragments: lane (g = l / 4, t = l % 4) loads 16 bytes (32 values) of rows g and g + 8 at
// k = kb + 32 t of each 128-wide k-block. The sum over k is order-free, so the mma's k slots
// follow the nibbles: word v of the 16 bytes holds values 8v..8v+7, and one lop3 of
// (w >> 4j) & 0x000F000F (with the sign flip and exponent bits folded into its constant) turns
// nibbles j and j + 4 into a half pair (exponent trick). Step (v, h) puts pairs 2h / 2h+1 in
// slots 2t, 2t+1 / 2t+8, 2t+9, so the B fragment needs x[m][8v + 2h, +4] and
// x[m][8v + 2h + 1, +5]. Once a super-chunk of x has landed, each 16-byte chunk is reordered in
// place to x0 x4 x1 x5 x2 x6 x3 x7, so one 16-byte read gives both steps' B fragments. That is
// up to M = 16; above, a pair is the two nibbles of one byte instead (NAT in the kernel), so x
// is read as stored.
// x sits in shared memory as [buffer][wk][M][KC + 16]: the 16-byte chunk c of a row is stored
// at c ^ ((c >> 3) & 1) and rows are 32 mod 128 bytes apart, which makes each quarter-warp's
// 16-byte reads (rows g, g+1, chunks 4t + v) hit 8 distinct bank groups.
//
// Scales: with group 128, symmetric weights and one row tile per warp a k-block is one group, so
// (POST, the lowering's choice by M) the mma can run on exact integers and each k-block's sum be
// scaled in f32. Then (FOLD) the integers are the raw exponent-trick values p = BASE + 8 + q,
// and the k-block's sum loses (BASE + 8)·Σx (Σx per column, summed once in shared memory when x
// is reordered), so the dequantize is the lop3 alone. Otherwise (groups 32/64, zeros, two row
// tiles, or not chosen) the dequantize applies (q - zero) * scale per pair, a lane's 32 values
// being one group.
const char* kStream = R"(
extern "C" __global__ void $CLUSTER__launch_bounds__($NW * $KW * 32, 1) $NAME(const $XT* __restrict__ x, const unsigned char* __restrict__ w,
    const $ST* __restrict__ scales, const $ST* __restrict__ zeros, const $XT* __restrict__ bias, $XT* __restrict__ y,
    float* __restrict__ part) {
  constexpr int M = $M, N = $N, K = $K, G = $G, MN = (M + 7) / 8, KC = $KC, D = KC / 128, RS = KC + 16;
  // m16 row tiles per warp, N-warps (16·MT rows each), K-warps, rows per block, threads, k per
  // super-chunk. MT = 2 reuses each x fragment read from shared memory for two row tiles.
  constexpr int MT = $MT, NW = $NW, KW = $KW, RB = 16 * MT * NW, NT = 32 * NW * KW, SCK = KW * KC;
  constexpr int NSC = (K + SCK - 1) / SCK, PER = $PER, SPLIT = $SPLIT;
  // PF super-chunks of weights in flight; PF + 1 register groups and x buffers in rotation.
  // XALL: all of the block's x (PER super-chunks) is staged (and reordered) once before the loop,
  // which then needs no block-wide barrier: each warp streams its weights at its own pace.
  constexpr bool XALL = $XALL;
  constexpr int PF = $PF, NB = XALL ? PER : PF + 1;
  constexpr bool POST = $POST, ASYM = $ASYM, AZFMA = $AZFMA;
  // PAIR (SPLIT = 2): the two halves of K run as one cluster of two blocks; the second hands its
  // sums to the first through distributed shared memory, and the first adds them and stores y
  // (no f32 scratch, no second kernel).
  constexpr bool PAIR = $PAIR;
  if (PAIR) kiln_i4_cluster_arrive_relaxed();  // waited for before the hand-over: both blocks run
  // Two pairings of a weight word's nibbles with x (the lowering's choice by M):
  // PERM (M <= 16): a step's A fragment pairs nibbles j, j + 4 (one shift and a lop3 per pair);
  //   x chunks are reordered once in shared memory to match.
  // NAT (otherwise): it pairs the two nibbles of one byte (values 2p, 2p + 1 of a word; a byte
  //   permute more per pair), so x's B fragments are its natural 32-bit words: read as stored,
  //   no reordering pass, which costs more than the permutes it saves when many n8 tiles read x.
  constexpr bool PERM = $PERM, NAT = !PERM;
  // FOLD (POST; one n8 tile of x, or x staged once): the mma runs on the raw exponent-trick
  // values p = BASE + 8 + q and each k-block's sum loses (BASE + 8)·Σx once, Σx per column being
  // summed when x is reordered; when x is reordered per super-chunk above M = 8, that sum costs
  // more than the per-pair subtraction it saves.
  constexpr bool FOLD = POST && (MN == 1 || XALL);
  constexpr bool KFULL = K % SCK == 0, NFULL = N % RB == 0, MFULL = M % 8 == 0;
  // XROWS (M > 8, off a multiple of 8): the last n8 tile reads all 8 rows of x without a test.
  // Rows past M hold whatever follows in shared memory (the lowering adds slack past the end);
  // they only reach output columns past M, which are never stored.
  constexpr bool XROWS = $XROWS;
  // SPAIR (symmetric group 128 with two k-blocks per K-warp and K whole super-chunks; the
  // lowering's choice by M): a lane's two scales of a super-chunk are adjacent entries, read as
  // one 4-byte load.
  constexpr bool SPAIR = $SPAIR;
  static_assert(!SPAIR || (G == 128 && D == 2 && !ASYM), "paired scales are a lane's two k-blocks' of a super-chunk");
  // SZP (asymmetric, constant scales and zeros; the lowering's choice): `zeros` holds each
  // group's (scale, -zero·scale) in x's half type, packed at compile time, read as one 4-byte
  // load with nothing to convert; the pair is then one fma as with AZFMA.
  constexpr bool SZP = $SZP;
  static_assert(!SZP || (ASYM && !POST && !SPAIR), "packed scale pairs are asymmetric, scaled before the mma");
  // WPRE (constant weights read by this kernel alone; the lowering's choice, NAT only): each
  // 32-bit word's nibbles were reordered at compile time to values 0 2 4 6 1 3 5 7, so a byte's
  // pair (values 2p, 2p + 1) is nibbles p, p + 4: one shift and the lop3, no byte permute.
  constexpr bool WPRE = $WPRE;
  static_assert(!WPRE || NAT, "pre-reordered weights pair with x as stored");
  typedef $XT E;
  typedef $E2 E2;
  extern __shared__ __align__(16) unsigned char kiln_i4_smem[];
  E* xs = reinterpret_cast<E*>(kiln_i4_smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wn = warp % NW, wk = warp / NW, g = lane >> 2, t = lane & 3;
  // Row tile u of this warp holds rows ra + 16u and rb + 16u.
  const int n0 = blockIdx.x * RB + wn * 16 * MT, ra = n0 + g, rb = n0 + g + 8;
  const int sc0 = blockIdx.y * PER, sc1 = min(sc0 + PER, NSC);
  // This lane's weight bytes and scale/zero entries at super-chunk 0 in tile 0; super-chunk sc
  // adds sc·SCK/2 bytes and sc·SCK/G entries, tile u 16u rows (rows past N are clamped and never
  // used: tile u's rows are past N whenever tile 0's are).
  const long long rowa = min(ra, N - 1), rowb = min(rb, N - 1);
  const int kl = wk * KC + 32 * t, gl = (wk * KC + (POST ? 0 : 32 * t)) / G;
  const unsigned char* wpa = w + rowa * (K / 2) + kl / 2;
  const unsigned char* wpb = w + rowb * (K / 2) + kl / 2;
  const $ST* spa = scales + rowa * (K / G) + gl;
  const $ST* spb = scales + rowb * (K / G) + gl;
  const $ST* zpa = zeros + rowa * (K / G) + gl;
  const $ST* zpb = zeros + rowb * (K / G) + gl;
  const unsigned* ppa = reinterpret_cast<const unsigned*>(zeros) + rowa * (K / G) + gl;
  const unsigned* ppb = reinterpret_cast<const unsigned*>(zeros) + rowb * (K / G) + gl;
  struct Group {
    uint4 a[MT][D], b[MT][D];
    // Scales and zeros as stored: converted where used, so nothing waits on a load just issued.
    $ST sa[MT][D], sb[MT][D], za[MT][D], zb[MT][D];
    unsigned pa[MT][D], pb[MT][D];  // SZP's packed pairs
  };
  // The weights, scales and zeros of super-chunk sc for this lane (zeros past K or N).
  // Whether k-block d of super-chunk sc holds this lane's k (K may end inside a super-chunk).
  auto k_in = [&](int sc, int d) { return KFULL || sc * SCK + kl + d * 128 < K; };
  // (pinned: loads ptxas keeps in program order, for XALL's prologue below)
  auto load = [&](int sc, Group& q, bool pinned = false) {
    auto w16 = [&](const unsigned char* p) {
      return pinned ? kiln_i4_ld16_pinned(p) : __ldg(reinterpret_cast<const uint4*>(p));
    };
    auto entry = [&](const $ST* p) { return pinned ? kiln_i4_ld_pinned(p) : *p; };
    auto entry2 = [&](const $ST* p, $ST& e0, $ST& e1) {
      const unsigned* q2 = reinterpret_cast<const unsigned*>(p);
      const unsigned v = pinned ? kiln_i4_ld_pinned(q2) : *q2;
      e0 = *reinterpret_cast<const $ST*>(&v);
      e1 = reinterpret_cast<const $ST*>(&v)[1];
    };
    #pragma unroll
    for (int u = 0; u < MT; ++u)
      #pragma unroll
      for (int d = 0; d < D; ++d) {
        // (Offsets and tests written per load rather than as per-tile arrays: ptxas scheduled the
        // M = 1 kernel's loads worse with the arrays, 0.0155 -> 0.0160 ms.)
        const bool kin = sc < sc1 && k_in(sc, d), oka = kin && (NFULL || ra + 16 * u < N), okb = kin && (NFULL || rb + 16 * u < N);
        const int wo = sc * (SCK / 2) + d * 64 + u * 16 * (K / 2), so = sc * (SCK / G) + d * 128 / G + u * 16 * (K / G);
        q.a[u][d] = oka ? w16(wpa + wo) : make_uint4(0, 0, 0, 0);
        q.b[u][d] = okb ? w16(wpb + wo) : make_uint4(0, 0, 0, 0);
        if (SPAIR) {
          if (d == 1) continue;  // read with d = 0
          if (oka) entry2(spa + so, q.sa[u][0], q.sa[u][1]);
          else q.sa[u][0] = q.sa[u][1] = $ST{};
          if (okb) entry2(spb + so, q.sb[u][0], q.sb[u][1]);
          else q.sb[u][0] = q.sb[u][1] = $ST{};
          continue;
        }
        if (SZP) {
          q.pa[u][d] = oka ? (pinned ? kiln_i4_ld_pinned(ppa + so) : ppa[so]) : 0u;
          q.pb[u][d] = okb ? (pinned ? kiln_i4_ld_pinned(ppb + so) : ppb[so]) : 0u;
          continue;
        }
        q.sa[u][d] = oka ? entry(spa + so) : $ST{};
        q.sb[u][d] = okb ? entry(spb + so) : $ST{};
        q.za[u][d] = ASYM && oka ? entry(zpa + so) : $ST{};
        q.zb[u][d] = ASYM && okb ? entry(zpb + so) : $ST{};
      }
  };
  // The 16-byte chunks of x this thread copies (and reorders) in every super-chunk: chunk i =
  // threadIdx.x + r·NT of the M·SCK/8 is row m, chunk c of the super-chunk (part h = c / (KC/8)
  // of the KW, chunk cc within it). Their offsets are the same in every super-chunk, so they are
  // computed once here rather than by divisions per copy (M·SCK/8 is a multiple of 64, so a
  // warp's lanes are all in or all out).
  constexpr int XC = M * (SCK / 8), XR = (XC + NT - 1) / NT;
  int xsrc[XR], xdst[XR], xcol[XR];
  #pragma unroll
  for (int r = 0; r < XR; ++r) {
    const int i = threadIdx.x + r * NT, m = i / (SCK / 8), c = i % (SCK / 8), h = c / (KC / 8), cc = c % (KC / 8);
    xsrc[r] = m * K + c * 8;  // element offset in x at super-chunk 0
    xdst[r] = (h * M + m) * RS + (cc ^ ((cc >> 3) & 1)) * 8;  // in a buffer
    xcol[r] = c;
  }
  auto mine = [&](int r) { return XC % NT == 0 || threadIdx.x + r * NT < XC; };
  // x[:, super-chunk sc] into buffer buf with cp.async (zero past K; K % 32 == 0).
  auto stage = [&](int sc, int buf) {
    #pragma unroll
    for (int r = 0; r < XR; ++r) {
      if (!mine(r)) continue;
      const bool in = KFULL || sc * SCK + xcol[r] * 8 < K;
      kiln_i4_cp16(xs + buf * KW * M * RS + xdst[r], x + (in ? sc * SCK + xsrc[r] : 0), in);
    }
  };
  // FOLD's per-k-block corrections (BASE + 8)·Σx for each column of each k-block of each x
  // buffer, written by prep() after the buffers (MP pads M to a whole n8 tile).
  constexpr int MP = MN * 8, KBS = SCK / 128;
  float* corr = reinterpret_cast<float*>(kiln_i4_smem + NB * KW * M * RS * (int)sizeof(E));
  // x[:, sc] landed in buffer buf (this thread's own cp.async copies): reorder each 16-byte chunk
  // to x0 x4 x1 x5 x2 x6 x3 x7, the B fragments of a word's two mma steps (the 4 N-warps then
  // read them without byte permutes), and for FOLD sum each k-block's 128 values per column (the
  // 16 chunks of a k-block and column sit on 16 consecutive lanes).
  auto prep = [&](int buf) {
    if (!PERM) return;
    #pragma unroll
    for (int r = 0; r < XR; ++r) {
      if (!mine(r)) continue;
      uint4* p = reinterpret_cast<uint4*>(xs + buf * KW * M * RS + xdst[r]);
      const uint4 v = *p;
      if (FOLD) {
        float s = 0.f;
        #pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float2 f = kiln_i4_f2(E(), (&v.x)[u]);
          s += f.x + f.y;
        }
        #pragma unroll
        for (int o = 1; o < 16; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const int i = threadIdx.x + r * NT;
        if ((xcol[r] & 15) == 0) corr[(buf * KBS + xcol[r] / 16) * MP + i / (SCK / 8)] = ($BASE + 8.f) * s;
      }
      *p = make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632), __byte_perm(v.y, v.w, 0x5410),
                      __byte_perm(v.y, v.w, 0x7632));
    }
  };
  // This lane's x reads: row g of its K-warp's part, chunks d·16 + 4t + v stored at
  // d·16 + 4t + (v ^ sw) (the swizzle above with sw = t / 2), i.e. +sw for even v, -sw for odd.
  const int sw = t >> 1;
  const E* xla = xs + (wk * M + g) * RS + (4 * t + sw) * 8;
  const E* xlb = xs + (wk * M + g) * RS + (4 * t - sw) * 8;
  float acc[MT][MN][4];
  // Two accumulator sets (the word's two mma steps) break the mma dependency chain when there
  // are few n8 tiles; with more tiles the tiles themselves are independent.
  constexpr int NA = MN <= 2 ? 2 : 1;
  float acc2[NA][MT][MN][4];
  #pragma unroll
  for (int u = 0; u < MT; ++u)
    #pragma unroll
    for (int j = 0; j < MN; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[u][j][e] = 0.f;
        #pragma unroll
        for (int a = 0; a < NA; ++a) acc2[a][u][j][e] = 0.f;
      }
  const E2 base2 = $CVT2($BASE), off2 = $CVT2($BASE + 8.f);
  // This lane's A fragment of step 2v + h of k-block d (row g pair 2h, row g+8 pair 2h, row g
  // pair 2h+1, row g+8 pair 2h+1), dequantized as FOLD / POST / ASYM ask. One lop3 per pair (NAT:
  // after a byte permute): the nibbles, the sign flip of signed weights and the exponent bits.
  auto dequant = [&](const Group& use, int u, int d, int v, int h, unsigned (&af)[4]) {
    const float sa = kiln_i4_f(use.sa[u][d]), sb = kiln_i4_f(use.sb[u][d]);
    const E2 sa2 = $CVT2(sa), sb2 = $CVT2(sb);
    const E2 za2 = $CVT2(kiln_i4_f(use.za[u][d])), zb2 = $CVT2(kiln_i4_f(use.zb[u][d]));
    // AZFMA (asymmetric; the lowering's choice by M and group): the pair is q·scale +
    // (-zero·scale), one fma with -zero·scale rounded once per group from f32, instead of
    // (q - zero)·scale.
    const E2 nza2 = $CVT2(-kiln_i4_f(use.za[u][d]) * sa), nzb2 = $CVT2(-kiln_i4_f(use.zb[u][d]) * sb);
    // SZP: the pair's halves broadcast (scale in the low half, -zero·scale in the high).
    auto half_of = [](unsigned v, unsigned sel) {
      const unsigned b = __byte_perm(v, v, sel);
      return *reinterpret_cast<const E2*>(&b);
    };
    const E2 psa2 = half_of(use.pa[u][d], 0x1010), psb2 = half_of(use.pb[u][d], 0x1010);
    const E2 pza2 = half_of(use.pa[u][d], 0x3232), pzb2 = half_of(use.pb[u][d], 0x3232);
    const unsigned wa = (&use.a[u][d].x)[v], wb = (&use.b[u][d].x)[v];
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
      const unsigned wr = (r & 1) ? wb : wa;
      const int pr = 2 * h + (r >> 1);  // the pair: NAT byte pr of the word, else nibbles pr, pr + 4
      const unsigned sel = pr | (pr << 4) | ((4 + pr) << 8) | ((4 + pr) << 12);  // bytes 0, 2: wr's and (wr >> 4)'s byte pr
      const unsigned bits = kiln_i4_pair_bits(NAT && !WPRE ? __byte_perm(wr, wr >> 4, sel) : wr >> (4 * pr), $EXP ^ ($FLIP & 0x00080008u));
      const E2 p = *reinterpret_cast<const E2*>(&bits);
      E2 q;
      if (FOLD) q = p;
      else if (POST) q = __hsub2(p, off2);
      else if (SZP) q = __hfma2(__hsub2(p, base2), (r & 1) ? psb2 : psa2, (r & 1) ? pzb2 : pza2);
      else if (ASYM && AZFMA) q = __hfma2(__hsub2(p, base2), (r & 1) ? sb2 : sa2, (r & 1) ? nzb2 : nza2);
      else if (ASYM) q = __hmul2(__hsub2(__hsub2(p, base2), (r & 1) ? zb2 : za2), (r & 1) ? sb2 : sa2);
      else q = __hmul2(__hsub2(p, off2), (r & 1) ? sb2 : sa2);
      af[r] = kiln_i4_u32(q);
    }
  };
  // POST: acc[u] += each row's scale (sa: row g, sb: row g+8) · (a k-block's unscaled sums s0
  // (+ s1 when two sets were used) - FOLD's corrections at corr + co).
  auto post_scale = [&](int u, float sa, float sb, int co, const float (&s0)[MN][4], const float (&s1)[MN][4], bool two) {
    #pragma unroll
    for (int j = 0; j < MN; ++j) {
      float2 cr = make_float2(0.f, 0.f);
      if (FOLD) cr = *reinterpret_cast<const float2*>(corr + co + 8 * j + 2 * t);
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s0[j][e] - ((e & 1) ? cr.y : cr.x);
        if (two) v += s1[j][e];
        acc[u][j][e] += (e < 2 ? sa : sb) * v;
      }
    }
  };
  // One super-chunk: prefetch the weights of sc + PF into `fill` and x of sc + 1 into the next
  // buffer (buf is a constant: the loop below is unrolled by PF + 1), then compute on `use`.
  auto step = [&](int sc, const Group& use, Group& fill, int buf) {
    load(sc + PF, fill);  // in flight while this super-chunk (and PF - 1 more) is computed
    if (XALL) {
      buf = sc - sc0;
    } else {
      if (sc + 1 < sc1) stage(sc + 1, (buf + 1) % NB);
      kiln_i4_commit();
      kiln_i4_wait<1>();
      prep(buf);
      __syncthreads();
    }
    #pragma unroll
    for (int d = 0; d < D; ++d) {
      float tmp[NA][MT][MN][4];  // POST: this k-block's unscaled sums
      #pragma unroll
      for (int a = 0; a < NA; ++a)
        #pragma unroll
        for (int u = 0; u < MT; ++u)
          #pragma unroll
          for (int j = 0; j < MN; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) tmp[a][u][j][e] = 0.f;
      #pragma unroll
      for (int v = 0; v < 4; ++v) {
        uint4 xv[MN];
        #pragma unroll
        for (int j = 0; j < MN; ++j) {
          const E* xp = ((v & 1) ? xlb : xla) + (buf * KW * M + 8 * j) * RS + (d * 16 + v) * 8;
          xv[j] = MFULL || XROWS || 8 * j + g < M ? *reinterpret_cast<const uint4*>(xp) : make_uint4(0, 0, 0, 0);
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h)
          #pragma unroll
          for (int u = 0; u < MT; ++u) {
            unsigned af[4];
            dequant(use, u, d, v, h, af);
            #pragma unroll
            for (int j = 0; j < MN; ++j)
              kiln_i4_mma(POST ? tmp[h % NA][u][j] : acc2[h % NA][u][j], af, h ? xv[j].z : xv[j].x, h ? xv[j].w : xv[j].y, E());
          }
      }
      if (POST)
        #pragma unroll
        for (int u = 0; u < MT; ++u)
          post_scale(u, kiln_i4_f(use.sa[u][d]), kiln_i4_f(use.sb[u][d]), (buf * KBS + wk * D + d) * MP, tmp[0][u], tmp[NA - 1][u], NA > 1);
    }
    // The buffer is refilled PF + 1 super-chunks on.
    if (!XALL) __syncthreads();
  };
  // XALL: x's copies go out before the first weights, so they do not queue behind the weights'
  // requests in the memory system (with a cold L2 the wait for x was the top stall at M = 1,
  // ncu: 17% of warp samples). Pinned plain loads and the barrier after them keep ptxas from
  // sinking the weight loads below the wait for x. H200, 8192², cold L2: M = 1 0.0165 -> 0.0156
  // ms, M = 8 0.0177 -> 0.0164 (bench/results/2026-12-02-gpu-run10.md).
  if (XALL) {
    for (int sc = sc0; sc < sc1; ++sc) stage(sc, sc - sc0);
    kiln_i4_commit();
  }
  Group gq[PF + 1];
  #pragma unroll
  for (int p = 0; p < PF; ++p) load(sc0 + p, gq[p], XALL);
  if (XALL) {
    __syncthreads();
    kiln_i4_wait<0>();
    for (int sc = sc0; sc < sc1; ++sc) prep(sc - sc0);
    __syncthreads();
  } else {
    stage(sc0, 0);
    kiln_i4_commit();
  }
  for (int sc = sc0; sc < sc1; sc += PF + 1) {
    #pragma unroll
    for (int u = 0; u <= PF; ++u)
      if (sc + u < sc1) step(sc + u, gq[u], gq[(u + PF) % (PF + 1)], u);
  }
  if (!POST)
    #pragma unroll
    for (int u = 0; u < MT; ++u)
      #pragma unroll
      for (int j = 0; j < MN; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
          #pragma unroll
          for (int a = 0; a < NA; ++a) acc[u][j][e] += acc2[a][u][j][e];
  // K-warps 1..KW-1 hand their sums to K-warp 0 (the x buffers are free once every warp is done:
  // with XALL, warps leave the loop at their own pace). Tile (u, j) of a warp is its slot
  // wn·MT·MN + u·MN + j of a K-warp's sums.
  if (XALL) __syncthreads();
  float* red = reinterpret_cast<float*>(kiln_i4_smem);
  if (wk > 0)
    #pragma unroll
    for (int u = 0; u < MT; ++u)
      #pragma unroll
      for (int j = 0; j < MN; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) red[(((((wk - 1) * NW + wn) * MT + u) * MN + j) * 4 + e) * 32 + lane] = acc[u][j][e];
  __syncthreads();
  if (wk == 0)
    #pragma unroll
    for (int u = 0; u < MT; ++u)
      #pragma unroll
      for (int j = 0; j < MN; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
          #pragma unroll
          for (int o = 1; o < KW; ++o) acc[u][j][e] += red[(((((o - 1) * NW + wn) * MT + u) * MN + j) * 4 + e) * 32 + lane];
  float* peer = reinterpret_cast<float*>(kiln_i4_smem + $PAIROFF);  // PAIR: the second block's sums
  bool last = true;  // whether this block writes y (or the split-K scratch)
  if (PAIR) {
    kiln_i4_cluster_wait();
    last = kiln_i4_cluster_rank() == 0;
    if (wk == 0 && !last)
      #pragma unroll
      for (int u = 0; u < MT; ++u)
        #pragma unroll
        for (int j = 0; j < MN; ++j)
          #pragma unroll
          for (int e = 0; e < 4; ++e)
            kiln_i4_st_peer(peer + (((wn * MT + u) * MN + j) * 4 + e) * 32 + lane, 0, acc[u][j][e]);
    kiln_i4_cluster_arrive();
    kiln_i4_cluster_wait();
  }
  if (wk == 0 && last)
    #pragma unroll
    for (int u = 0; u < MT; ++u)
      #pragma unroll
      for (int j = 0; j < MN; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int n = n0 + 16 * u + g + 8 * (e >> 1), m = 8 * j + 2 * t + (e & 1);
          const float v = acc[u][j][e] + (PAIR ? peer[(((wn * MT + u) * MN + j) * 4 + e) * 32 + lane] : 0.f);
          if (m < M && n < N) {
            if (SPLIT > 1 && !PAIR) atomicAdd(part + (long long)m * N + n, v);
            else kiln_i4_st(y + (long long)m * N + n, v + $BIAS(n));
          }
        }
}
)";

// Split-K tail: y = the f32 partial sums + bias, rounded once.
const char* kSplitSum = R"(
extern "C" __global__ void __launch_bounds__(256) $NAME(const float* __restrict__ part, const $XT* __restrict__ bias, $XT* __restrict__ y) {
  constexpr long long M = $M, N = $N;
  for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < M * N; i += (long long)gridDim.x * 256)
    kiln_i4_st(y + i, part[i] + $BIAS(i % N));
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

/// What the lowering knows of one matmul_int4 when it plans the streaming kernel.
struct StreamInputs {
  int64_t m, n, k, g;  // rows of x, output features, input features, group size
  bool asym;
  int64_t scale_bytes;  // 2 (f16 / bf16) or 4 (f32)
  bool scales_aligned;  // the scales start on a 16-byte boundary
  bool hopper;          // a cuda-sm90 plan (clusters, the sm_90 shapes)
  int64_t smem_limit;   // shared memory one block may use
  bool const_zeros;     // asymmetric with constant scales and zeros (they can be packed)
  bool own_weights;     // the weights are a constant this node alone reads (they can be reordered)
  bool exact_zeros;     // option int4-exact-zeros: (q - zero)·scale, never the fma form
};

/// The streaming kernel's launch shape and code paths (each a $KEY of kStream; see there).
struct StreamPlan {
  // Launch shape: k per K-warp and super-chunk, K-warps, N-warps, 16-row tiles per warp,
  // super-chunks of weights in flight.
  int64_t kc, kw, nw, mt, pf;
  // Row blocks (grid.x), super-chunks per block, and blocks per row block along K (grid.y).
  int64_t tiles, per, split;
  bool post, spair, xall, xrows, pair, perm, azfma, szp, wpre;
  int64_t smem;      // shared memory per block
  int64_t pair_off;  // where the cluster pair's hand-over starts in it
};

/// Chooses the plan by M, group and architecture, from the H200 measurements cited below.
StreamPlan plan_stream(const StreamInputs& in) {
  const int64_t m = in.m, nn = in.n, k = in.k, g = in.g;
  const bool asym = in.asym;
  // Launch shape by M, from the H200 sweep (bench/results/2026-12-01-int4-sweep.md): up to
  // M = 16 four K-warps (16 warps per SM hide each other's latency) with KC 256, and up to
  // M = 8 two super-chunks of weights in flight; above, the accumulators need the registers.
  // sm_90 plans differ at M = 5..16 and above M = 16 (below). No other launch shape measured
  // faster (bench/results/2026-12-02-gpu-run10.md, call B; 2026-12-02-gpu-run11.md, call A).
  // Above M = 16 on sm_90 each warp takes two m16 row tiles, so every x fragment it reads from
  // shared memory feeds both: half the shared-memory reads per weight. H200, 8192², cold L2
  // (bench/results/2026-12-02-gpu-run10.md), one tile at KC 512 / 256 -> two at 256: M = 32
  // 0.0292 -> 0.0278 ms, M = 48 0.0364 -> 0.0326, M = 64 0.0413 -> 0.0369 (cuBLAS bf16 0.0382).
  // sm_80 plans keep one tile: with twice the rows per block N = 8192 needs the K split, which
  // there goes through the scratch and a second kernel (no cluster pair), unmeasured.
  const int64_t mt = m > 16 && in.hopper ? 2 : 1;
  int64_t kc = m > 32 || m <= 16 || mt == 2 ? 256 : 512, blocks = 132, kw = m <= 16 ? 4 : 2,
          pf = m <= 8 ? 2 : 1, nw = 4;
  // M = 5..16 on sm_90: blocks of 128 rows (8 N-warps x 2 K-warps) and K split in two, so
  // each block stages its half of x once (at M = 9..16 no barriers in the loop then) and the
  // halves meet as a cluster pair (below); x's L2 traffic halves as well. H200, 8192²:
  // M = 16 0.0286 -> 0.0248 ms, M = 8 0.0217 -> 0.0195 ms (2026-12-01-int4-weight-paths.md).
  if (in.hopper && m > 4 && m <= 16) kw = 2, nw = 8, blocks = 128;
  // nb x buffers (super-chunks) of KC by w K-warps and their per-k-block corrections (rows
  // padded to whole n8 tiles); the final hand-over of w - 1 K-warps' sums (v N-warps of mt row
  // tiles each) reuses them.
  const int64_t mp = (m + 7) / 8 * 8;
  auto smem_for = [&](int64_t c, int64_t w, int64_t nb, int64_t v) {
    return std::max<int64_t>(nb * w * m * (c + 16) * 2 + nb * (w * c / 128) * mp * 4,
                             (w - 1) * v * mt * 512 * ((m + 7) / 8));
  };
  const int64_t rows = 16 * mt * nw;
  const int64_t nsc = (k + kw * kc - 1) / (kw * kc), tiles = (nn + rows - 1) / rows;
  const int64_t want = std::clamp<int64_t>(blocks / tiles, 1, nsc);
  const int64_t per = (nsc + want - 1) / want, split = (nsc + per - 1) / per;
  // Post-scaling keeps each k-block's unscaled sums beside the accumulators: with two row
  // tiles those spill (M = 64: 600 bytes), so the pairs are scaled before the mma instead. The
  // sm_90 plans at M = 9..16 (two n8 tiles of x, staged once) scale before the mma as well: the
  // k-block sums, Σx and the corrections cost more than the per-pair multiply. H200, 8192²,
  // cold L2 (bench/results/2026-12-02-gpu-run12.md, call D, two runs each): M = 9 0.0195 ->
  // 0.0184 ms, M = 12 0.0199 -> 0.0186, M = 16 0.0208 -> 0.0191; up to M = 8 post-scaling stays
  // faster (M = 8 0.0167 vs 0.0173).
  const bool post = g == 128 && !asym && mt == 1 && !(in.hopper && m > 8);
  // SPAIR in the kernel: symmetric group 128 with KC 256 reads a lane's two scales of a
  // super-chunk (one per k-block, adjacent entries) as one 4-byte load, where K is a whole
  // number of super-chunks (no entry past a row's end) and the scales are 2-byte entries,
  // 16-byte aligned. The sm_90 plans above M = 16 up to 48 take it. H200, 8192², cold L2
  // (2026-12-02-gpu-run12.md, call E, two runs each): M = 24 0.0253 -> 0.0250 ms, M = 32
  // 0.0272 -> 0.0266, M = 48 0.0319 -> 0.0308; M = 64 0.0360 -> 0.0363, M = 9..16 (scaled before
  // the mma) 0.0187 -> 0.0191 at M = 12, up to M = 8 (two super-chunks in flight) M = 1 0.0157
  // -> 0.0168 (2026-12-02-gpu-run11.md). sm_80 plans unmeasured.
  const bool spair_fits = g == 128 && !asym && in.scale_bytes == 2 && kc == 256 && k % (kw * kc) == 0 && (k / g) % 2 == 0 && in.scales_aligned;
  const bool spair = spair_fits && in.hopper && m > 16 && m <= 48;
  // Up to M = 16 a block's whole x (per super-chunks) is staged once when it fits, so the loop
  // runs without block-wide barriers.
  const bool xall = m <= 16 && smem_for(kc, kw, per, nw) <= in.smem_limit;
  // (Warpgroup MMAs in place of mma.sync measured no faster at M = 9..16 and slower at M = 32
  // and 64: bench/results/2026-12-02-gpu-run8.md, 2026-12-02-gpu-run9.md.)
  int64_t smem = smem_for(kc, kw, xall ? per : pf + 1, nw);
  // XROWS in the kernel (M > 8 off a multiple of 8): the last buffer's last tile reads up to
  // mp - m rows past the buffers. Below M = 8 the one tile's row test is cheaper than the rows
  // it would read. H200, 8192², cold L2 (bench/results/2026-12-02-gpu-run11.md): M = 12 0.0221
  // -> 0.0211 ms, M = 13 0.0224 -> 0.0212, M = 33 0.0337 -> 0.0331; M = 3 0.0163 -> 0.0168,
  // M = 5 0.0163 -> 0.0170.
  const int64_t xrows_slack = (mp - m) * (kc + 16) * 2;
  const bool xrows = m > 8 && m % 8 != 0 && smem + xrows_slack <= in.smem_limit;
  if (xrows) smem += xrows_slack;
  // K split in two on sm_90: the halves run as a cluster pair and meet in shared memory, in
  // place of the f32 scratch and a second kernel.
  const int64_t pair_off = (smem + 15) / 16 * 16, pair_end = pair_off + nw * mt * ((m + 7) / 8) * 512;
  const bool pair = split == 2 && in.hopper && pair_end <= in.smem_limit;
  if (pair) smem = pair_end;
  // Up to M = 16 x is reordered in shared memory once per super-chunk (PERM) for the cheaper
  // nibble pairs j, j + 4; above, x is read as stored and each A fragment pairs a byte's two
  // nibbles. H200, 8192², cold L2 (bench/results/2026-12-02-gpu-run10.md): adjacent pairs
  // M = 32 0.0320 -> 0.0293 ms, M = 64 0.0490 -> 0.0413; at M = 1..8 they were 5-10% slower.
  const bool perm = m <= 16;
  // Asymmetric pairs as (q)·scale + (-zero·scale), one fma, in place of (q - zero)·scale: one
  // half op per pair fewer. H200, 8192², cold L2, groups 32 / 64
  // (bench/results/2026-12-02-gpu-run12.md, call B, two runs each): g32 M = 1 0.0198 -> 0.0189
  // ms, M = 4 0.0208 -> 0.0200, M = 32 0.0306 -> 0.0290, M = 64 0.0429 -> 0.0419; but the
  // sm_90 plans at M = 9..16 lose (g32 M = 16 0.0224 -> 0.0232), and so does group 64 above
  // M = 32 (M = 64 0.0417 -> 0.0428: the kernel spills 16 bytes with the fma, none without):
  // those keep the subtraction, and so does group 128 there (unmeasured; ptxas shows the same
  // spill at M = 64). The option int4-exact-zeros keeps the subtraction everywhere.
  const bool azfma_loses = in.hopper && ((m > 8 && m <= 16) || (m > 32 && g >= 64));
  const bool azfma = asym && !azfma_loses && !in.exact_zeros;
  // SZP: constant asymmetric scales and zeros packed at compile time as (scale, -zero·scale)
  // pairs in x's half type (the values AZFMA rounds in the kernel, so the same results): one
  // 4-byte load per group and row in place of two 2-byte ones and their conversions. H200,
  // 8192², cold L2, constant weights (bench/results/2026-12-03-gpu-run15.md, call A, with WPRE):
  // g32 M = 64 0.0416 -> 0.0365 ms, M = 16 0.0220 -> 0.0200, M = 1 0.0189 -> 0.0176. The stored
  // scales and zeros leave the artifact unless another step reads them (drop_unread_weights).
  // Like AZFMA, not under int4-exact-zeros.
  const bool szp = asym && in.const_zeros && !post && !spair && !in.exact_zeros;
  // WPRE (x as stored, above M = 16): a constant weight this node alone reads is reordered in
  // place at compile time so each byte's pair needs no byte permute in the kernel (run 15, call
  // A: g128 M = 32 0.0271 -> 0.0258 ms, M = 64 0.0362 -> 0.0357).
  const bool wpre = !perm && in.own_weights;
  return StreamPlan{kc,   kw,    nw,   mt,   pf,    tiles, per,  split, post,    spair,
                    xall, xrows, pair, perm, azfma, szp,   wpre, smem,  pair_off};
}

}  // namespace

void Lowerer::reorder_int4_words(int id) {
  if (!reordered_int4_.insert(id).second) return;
  unsigned char* p = reinterpret_cast<unsigned char*>(weights_.data()) + bufs_[id].offset;
  for (int64_t i = 0; i + 4 <= bufs_[id].bytes; i += 4) {
    uint32_t word = 0, out = 0;
    std::memcpy(&word, p + i, 4);  // nibble j = value j (low nibble first, little-endian)
    for (int j = 0; j < 4; ++j) {
      out |= ((word >> (8 * j)) & 0xFu) << (4 * j);             // value 2j -> nibble j
      out |= ((word >> (8 * j + 4)) & 0xFu) << (4 * (j + 4));   // value 2j + 1 -> nibble j + 4
    }
    std::memcpy(p + i, &out, 4);
  }
}

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
  const bool bf = xt == DType::kBF16;
  std::vector<std::pair<std::string, std::string>> subs = {
      {"$XT", xs}, {"$ST", ss}, {"$M", std::to_string(m)}, {"$N", std::to_string(nn)}, {"$K", std::to_string(k)},
      {"$G", std::to_string(g)}, {"$FLIP", flip}, {"$ZERO", zero},
      // The exponent trick of the fused kernels in x's half type: bits and the value they add.
      {"$BASE", bf ? "128.f" : "1024.f"}, {"$EXP", bf ? "0x43004300u" : "0x64006400u"}};
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
  // Which kernel (measure-free reasoning for an H200, 132 SMs, N = K = 8192):
  //  - f16/bf16 x, M <= 64: the streaming mma kernel for every M. At M = 1 its tensor-core and
  //    dequantize work (~2 and ~4 us over the SMs) hides under the ~10 us weight stream, so a
  //    separate CUDA-core path would not be faster; above, mma keeps the math off the bound.
  //    The launch shape (KC, K-warps, prefetch depth) depends on M (plan_stream); every shape's
  //    shared memory stays within 163 KB (sm_80). grid.y splits K only when N / 64 blocks leave
  //    SMs idle.
  //  - f32 x, M <= 8: the GEMV kernel (exact f32 products); it and the streaming kernel read w
  //    (and x) 16 bytes at a time, so a view off 16-byte alignment takes the last path.
  //  - otherwise: dequantize + cuBLASLt.
  auto aligned = [&](int id) { return root(id) == id || bufs_[id].offset % 16 == 0; };
  // (x offsets are 32-bit in the kernel.)
  if (m <= 64 && xt != DType::kF32 && aligned(x) && aligned(w) && m * k < (int64_t{1} << 31)) {
    // Constant scales and zeros (asymmetric) can be packed, and a constant weight no other node
    // or view reads can be reordered in place (weights_ holds it until the artifact is written).
    const std::optional<Tensor> st_t = asym ? weight_tensor(s) : std::nullopt, zt_t = asym ? weight_tensor(z) : std::nullopt;
    const Value* wv = n.operand(1);
    const bool own_w = root(w) == w && bufs_[w].kind == "weight" && wv->producer() != nullptr &&
                       wv->producer()->op_name() == "constant" && wv->uses().size() == 1 &&
                       wv->uses()[0].user == &n;
    const StreamPlan p = plan_stream(
        StreamInputs{m, nn, k, g, asym, dtype_bits(st) / 8, aligned(s), hopper_plan(), smem_limit(),
                     st_t.has_value() && zt_t.has_value(), own_w, opts_.int4_exact_zeros});
    int zarg = z;
    if (p.szp) {
      // Per group: (scale, -zero·scale) in x's half type, the f32 product rounded once, as the
      // kernel's AZFMA form computes it.
      Tensor packed(xt, {nn, 2 * (k / g)});
      for (int64_t i = 0; i < nn * (k / g); ++i) {
        const float sv = static_cast<float>(st_t->get_f64(i)), zv = static_cast<float>(zt_t->get_f64(i));
        packed.set_f64(2 * i, sv);
        packed.set_f64(2 * i + 1, -zv * sv);
      }
      zarg = host_weight(packed);
    }
    // SZP never reads the scales as stored: the packed pairs go in their place too, so a scale
    // buffer no other step reads is left out of the artifact (drop_unread_weights).
    const int sarg = p.szp ? zarg : s;
    if (p.wpre) reorder_int4_words(w);
    const std::string name = kernel_name("matmul_int4_stream");
    auto flag = [](bool v) -> std::string { return v ? "true" : "false"; };
    // (Keys that prefix later ones come after them: fill() replaces in order.)
    subs.insert(subs.begin(), {{"$NAME", name},
                               {"$KC", std::to_string(p.kc)},
                               {"$KW", std::to_string(p.kw)},
                               {"$NW", std::to_string(p.nw)},
                               {"$MT", std::to_string(p.mt)},
                               {"$PF", std::to_string(p.pf)},
                               {"$XALL", flag(p.xall)},
                               {"$PERM", flag(p.perm)},
                               {"$CLUSTER", p.pair ? "KILN_I4_PAIR_DIMS " : ""},
                               {"$PAIROFF", std::to_string(p.pair_off)},
                               {"$PAIR", flag(p.pair)},
                               {"$XROWS", flag(p.xrows)},
                               {"$SPAIR", flag(p.spair)}});
    subs.insert(subs.end(), {{"$PER", std::to_string(p.per)},
                             {"$SPLIT", std::to_string(p.split)},
                             {"$POST", flag(p.post)},
                             {"$ASYM", flag(asym)},
                             {"$AZFMA", flag(p.azfma)},
                             {"$SZP", flag(p.szp)},
                             {"$WPRE", flag(p.wpre)},
                             {"$E2", bf ? "__nv_bfloat162" : "__half2"},
                             {"$CVT2", bf ? "__float2bfloat162_rn" : "__float2half2_rn"}});
    add_kernel_text(name, with_bias(fill(kStream, subs)));
    if (p.split == 1 || p.pair) {
      launch_grid(name, {p.tiles, p.split}, 32 * p.nw * p.kw, p.smem, {x, w, sarg, zarg, b, out, out});
      return ok_status();
    }
    const int part = add_buffer("activation", DType::kF32, {m, nn}, "");
    steps_.push_back({"step memset dst=b" + std::to_string(part) + " bytes=" + std::to_string(bufs_[part].bytes), {part}});
    launch_grid(name, {p.tiles, p.split}, 32 * p.nw * p.kw, p.smem, {x, w, sarg, zarg, b, out, part});
    const std::string sum = kernel_name("matmul_int4_splitk_sum");
    add_kernel_text(sum, with_bias(fill(kSplitSum, {{"$NAME", sum}, {"$XT", xs}, {"$M", std::to_string(m)},
                                                     {"$N", std::to_string(nn)}})));
    launch_grid(sum, {std::clamp<int64_t>((m * nn + 255) / 256, 1, 132 * 8)}, 256, 0, {part, b, out});
    return ok_status();
  }
  if (m <= 8 && aligned(w)) {
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
