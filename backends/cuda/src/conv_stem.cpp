// A conv over few input channels — an image model's RGB stem, such as ResNet's 7x7 stride-2
// conv over 3 channels — as an implicit GEMM on TF32 tensor cores (mma.sync m16n8k8, sm_80 and
// later), when the pipeline allows TF32. cuDNN ran ResNet-18's stem at 16 TFLOP/s on the H200
// (its tensor-core kernels want more channels) and im2col + cuBLASLt writes 49 times the input
// before the GEMM reads it back; this kernel reads the input once per band of output rows.
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

// One block: a band of BP output rows of one image, every output channel; blocks loop over the
// bands. It stages the band's input rows (all channels, zero where the padding is, rounded to
// TF32) and, once, the weights reordered to [tap][channel] in shared memory by cp.async (every
// copy in flight at once). Taps are ordered (c, r, s) with s padded to a multiple of 8, so each
// k-step of 8 is one (c, r, s-octet): a lane's A operands are then its pixel's address in the
// band plus compile-time offsets, and the columns past S are selected to 0. Each warp multiplies
// pairs of 16-pixel tiles (MT = 2, or 1 above 64 channels) by all KO / 8 n-tiles, then adds the
// bias, applies the relu and stores NCHW directly.
constexpr const char* kStemSource = R"(
#define KILN_STEM_HELPERS
__device__ __forceinline__ float kiln_stem_tf32(float v) {
  unsigned u;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(u) : "f"(v));
  return __uint_as_float(u);
}
// A 4-byte cp.async, zero-filling when !ok: a band's copies are all in flight at once.
__device__ __forceinline__ void kiln_stem_cp4(float* s, const float* g, bool ok) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(a), "l"(__cvta_generic_to_global(g)),
               "r"(ok ? 4 : 0) : "memory");
}
__device__ __forceinline__ void kiln_stem_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}
__device__ __forceinline__ void kiln_stem_mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
)";

constexpr const char* kStemKernel = R"(
  constexpr int TILES = BP * QT, PAIRS = (TILES + MT - 1) / MT, KS = C * R * SO, NTL = KO / 8;
  constexpr int BAND = C * IR * IWP;  // floats of staged input
  extern __shared__ __align__(16) float kiln_stem_smem[];
  float* band = kiln_stem_smem;        // [C][IR][IWP]
  float* wsm = kiln_stem_smem + BAND;  // [KS * 8][NP]: tap-major, zero past S and past KO
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  for (int i = threadIdx.x; i < KS * 8 * NP; i += NTHR) wsm[i] = 0.f;
  __syncthreads();
  for (int i = threadIdx.x; i < KO * C * R * S; i += NTHR) {
    const int s = i % S, r = (i / S) % R, c = (i / (S * R)) % C, o = i / (S * R * C);
    kiln_stem_cp4(wsm + (((c * R + r) * SO + s / 8) * 8 + s % 8) * NP + o, w + i, true);
  }
  kiln_stem_wait_all();
  __syncthreads();
  for (int i = threadIdx.x; i < KS * 8 * NP; i += NTHR) wsm[i] = kiln_stem_tf32(wsm[i]);
  float bias[NTL][2];
#pragma unroll
  for (int j = 0; j < NTL; ++j) {
    bias[j][0] = HAS_BIAS ? b[j * 8 + 2 * t] : 0.f;
    bias[j][1] = HAS_BIAS ? b[j * 8 + 2 * t + 1] : 0.f;
  }
  for (int grp = blockIdx.x; grp < N * PB; grp += gridDim.x) {
    const int img = grp / PB, p0 = (grp % PB) * BP;
    __syncthreads();  // the previous band's readers are done (and the weights are written)
    const float* xi = x + (long long)img * (C * H * W);
    // Warp per band row, lane per column: copies in flight together, zeros where the padding is;
    // then each thread rounds what it copied to TF32.
    for (int row = warp; row < C * IR; row += NTHR / 32) {
      const int i = row % IR, c = row / IR, ih = p0 * SH - PT + i;
      const bool in_row = ih >= 0 && ih < H;
      const float* src = xi + (c * H + (in_row ? ih : 0)) * W;
      for (int j = lane; j < IWP; j += 32) {
        const int iw = j - PL;
        const bool ok = in_row && j < IW && iw >= 0 && iw < W;
        kiln_stem_cp4(band + row * IWP + j, ok ? src + iw : xi, ok);
      }
    }
    kiln_stem_wait_all();
    for (int row = warp; row < C * IR; row += NTHR / 32)
      for (int j = lane; j < IWP; j += 32) band[row * IWP + j] = kiln_stem_tf32(band[row * IWP + j]);
    __syncthreads();
    for (int pr = warp; pr < PAIRS; pr += NTHR / 32) {
      int base[MT][2];
      bool live[MT];
#pragma unroll
      for (int h = 0; h < MT; ++h) {
        const int tile = MT * pr + h < TILES ? MT * pr + h : TILES - 1;
        const int row = tile / QT, q0 = (tile % QT) * 16;
        live[h] = MT * pr + h < TILES && p0 + row < P;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int q = q0 + g + 8 * u < Q ? q0 + g + 8 * u : Q - 1;
          base[h][u] = row * SH * IWP + q * SW + t;
        }
      }
      float acc[MT][NTL][4];
#pragma unroll
      for (int h = 0; h < MT; ++h)
#pragma unroll
        for (int j = 0; j < NTL; ++j) acc[h][j][0] = acc[h][j][1] = acc[h][j][2] = acc[h][j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const int c = ks / (R * SO), r = (ks / SO) % R, s0 = (ks % SO) * 8;
        const int off = (c * IR + r) * IWP + s0;
        const bool lo = s0 + t < S, hi = s0 + t + 4 < S;  // columns s0 + t and s0 + t + 4 are taps
        unsigned a[MT][4];
#pragma unroll
        for (int h = 0; h < MT; ++h) {
          a[h][0] = lo ? __float_as_uint(band[base[h][0] + off]) : 0u;
          a[h][1] = lo ? __float_as_uint(band[base[h][1] + off]) : 0u;
          a[h][2] = hi ? __float_as_uint(band[base[h][0] + off + 4]) : 0u;
          a[h][3] = hi ? __float_as_uint(band[base[h][1] + off + 4]) : 0u;
        }
#pragma unroll
        for (int j = 0; j < NTL; ++j) {
          const unsigned b0 = __float_as_uint(wsm[(ks * 8 + t) * NP + j * 8 + g]);
          const unsigned b1 = __float_as_uint(wsm[(ks * 8 + t + 4) * NP + j * 8 + g]);
#pragma unroll
          for (int h = 0; h < MT; ++h) kiln_stem_mma(acc[h][j], a[h], b0, b1);
        }
      }
#pragma unroll
      for (int h = 0; h < MT; ++h) {
        if (!live[h]) continue;
        const int tile = MT * pr + h, p = p0 + tile / QT, q0 = (tile % QT) * 16;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int q = q0 + g + 8 * u;
          if (q >= Q) continue;
#pragma unroll
          for (int j = 0; j < NTL; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int o = j * 8 + 2 * t + e;
              float v = acc[h][j][2 * u + e] + bias[j][e];
              if (RELU) v = fmaxf(v, 0.f);
              y[(((long long)img * KO + o) * P + p) * Q + q] = v;
            }
        }
      }
    }
  }
)";

}  // namespace

StatusOr<bool> Lowerer::conv_stem(const Node& n) {
  const Value* x = n.operand(0);
  if (x->dtype() != DType::kF32 || !opts_.allow_tf32_conv) return false;
  const Sizes xs = sizes_of(x), ws = sizes_of(n.operand(1)), ys = sizes_of(n.result());
  if (xs.size() != 4 || n.get_int("groups", 1) != 1) return false;
  const Window win = window_of(n, 2);
  const Sizes &strides = win.strides, &pads = win.pads;
  for (int64_t d : win.dilations)
    if (d != 1) return false;
  const int64_t batch = xs[0], c = xs[1], h = xs[2], w = xs[3], ko = ws[0], r = ws[2], s = ws[3], p = ys[2], q = ys[3];
  // Few input channels and a real spatial kernel: the stems cuDNN's tensor-core kernels skip.
  if (c > 4 || r * s < 9 || ko % 8 != 0 || ko > 128 || product(ys) == 0 || product(xs) >= (int64_t{1} << 31) ||
      product(ys) >= (int64_t{1} << 40) || h * w * c >= (int64_t{1} << 31))
    return false;
  const int64_t so = (s + 7) / 8, ks = c * r * so;
  // Weights pitch: a multiple of 8 floats, 8 past a multiple of 32, so the B loads (lanes t * NP
  // + g) fall in 32 distinct banks.
  int64_t np = (ko + 7) / 8 * 8;
  while (np % 32 != 8) np += 8;
  const int64_t w_bytes = ks * 8 * np * 4;
  const int64_t iw = (q - 1) * strides[1] + s, iwp = (iw + 3) / 4 * 4;
  auto band_bytes = [&](int64_t bp) { return c * ((bp - 1) * strides[0] + r) * iwp * 4; };
  // A band of bp rows fits when it and the weights take at most 112 KB (two blocks per SM on
  // sm_90) and the target allows that much.
  const int64_t budget = std::min<int64_t>(smem_limit(), 112 * 1024);
  auto fits = [&](int64_t bp) { return band_bytes(bp) + w_bytes <= budget; };
  // The band: as many output rows as fit, at most 8 and at most P.
  int64_t bp = std::min<int64_t>(8, p);
  while (bp > 1 && !fits(bp)) --bp;
  if (!fits(bp)) return false;
  const int64_t smem = band_bytes(bp) + w_bytes;

  const bool bias = n.num_operands() == 3;
  const int out = activation_for(n.result());
  const bool relu = !sole_activation(n.result(), false).empty();
  if (relu) absorb_user(n.result(), out);
  const int64_t mt = ko <= 64 ? 2 : 1, qt = (q + 15) / 16, pb = (p + bp - 1) / bp, threads = 128;
  auto I = [](int64_t v) { return std::to_string(v); };
  const std::string name = kernel_name("conv_stem");
  // The helpers go into the source once, however many stems the graph has.
  if (source_.find("#define KILN_STEM_HELPERS") == std::string::npos) source_ += kStemSource;
  std::string text = "extern \"C\" __global__ void __launch_bounds__(" + I(threads) + ") " +
                     name + "(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b, "
                     "float* __restrict__ y) {\n";
  text += "  constexpr int N = " + I(batch) + ", C = " + I(c) + ", H = " + I(h) + ", W = " + I(w) + ", KO = " + I(ko) +
          ", R = " + I(r) + ", S = " + I(s) + ", P = " + I(p) + ", Q = " + I(q) + ";\n";
  text += "  constexpr int SH = " + I(strides[0]) + ", SW = " + I(strides[1]) + ", PT = " + I(pads[0]) + ", PL = " +
          I(pads[1]) + ", SO = " + I(so) + ", NP = " + I(np) + ";\n";
  text += "  constexpr int BP = " + I(bp) + ", PB = " + I(pb) + ", IR = " + I((bp - 1) * strides[0] + r) + ", IW = " +
          I(iw) + ", IWP = " + I(iwp) + ", QT = " + I(qt) + ", MT = " + I(mt) + ", NTHR = " + I(threads) + ";\n";
  text += std::string("  constexpr bool HAS_BIAS = ") + (bias ? "true" : "false") + ", RELU = " +
          (relu ? "true" : "false") + ";\n";
  text += std::string(kStemKernel) + "}\n";
  add_kernel_text(name, text);
  // Blocks loop over the bands, so the weights are staged once per block: two per SM of a
  // 132-SM part, or one per band when there are fewer.
  const int w_buf = buf(n.operand(1));
  launch_grid(name, {std::min<int64_t>(batch * pb, 264)}, threads, smem,
              {buf(x), w_buf, bias ? buf(n.operand(2)) : w_buf, out});
  return true;
}

}  // namespace kiln::cuda::detail
