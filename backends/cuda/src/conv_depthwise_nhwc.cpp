// Channels-last depthwise convs (the layout-nhwc pass with depthwise = true) as one generated
// kernel each (conv_depthwise.cpp's, channels last): x [N, H, W, C], w [K, R, S, 1] with
// K = C * multiplier, y [N, P, Q, K]. A block stages a tile of CB channels x rows x columns with
// its halo in shared memory, coalesced along C, applying the pointwise node before the conv (an
// expand GEMM's SiLU) once per staged input; the bias and the pointwise ops after the conv
// (conv_tail.cpp) are applied before the store.
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

/// The tiling with the least modelled time: global loads (and prologue evaluations) of the
/// staged inputs, halos included; shared-memory traffic of staging and of the multiply-adds;
/// a fixed cost per block; fewer blocks than about two per SM leave SMs idle.
DepthwiseTiles depthwise_nhwc_tiles(const DepthwiseGeometry& g, bool prologue) {
  // Static shared memory, less the block's pool sums (emit_depthwise's POOL).
  constexpr int64_t kSmem = 48 * 1024 - 4 * kBlock, kMinBlocks = 264;
  // Costs relative to one input element loaded from memory: a prologue (an expf and a division)
  // costs about as much again; a shared-memory access about a tenth (a warp's 32 words a cycle
  // against ~3 elements of DRAM bandwidth per SM and cycle).
  // A block's fixed cost (its loads' latency, the barrier) is about that of a thousand loads at
  // the six or so blocks an SM holds.
  const double kLoad = prologue ? 2.0 : 1.0, kShared = 0.1, kBlockCost = 1000;
  const int64_t v_max = std::min<int64_t>(g.sw == 1 ? 4 : g.sw == 2 ? 2 : 1, g.q);
  // U rows per thread reuse each input row read from shared memory across kernel rows; the
  // filter then stays in registers too, so fewer rows for larger kernels.
  const int64_t u_max = g.sh == 1 && g.r > 1 ? (g.r * g.s <= 25 ? 4 : g.r * g.s <= 64 ? 2 : 1) : 1;
  int64_t cb_max = 8;
  while (cb_max < std::min<int64_t>(g.c, 32)) cb_max *= 2;
  const int64_t wsp = (g.r * g.s) | 1;
  // In-bounds input rows (or columns) a tiling of `len` outputs in tiles of `tile` stages.
  auto staged = [](int64_t len, int64_t tile, int64_t stride, int64_t extent, int64_t in,
                   int64_t pad) {
    int64_t total = 0;
    for (int64_t o0 = 0; o0 < len; o0 += tile) {
      const int64_t lo = o0 * stride - pad, hi = lo + extent;
      total += std::max<int64_t>(0, std::min(hi, in) - std::max<int64_t>(lo, 0));
    }
    return total;
  };
  DepthwiseTiles best;
  double best_time = -1;
  for (int64_t cb = cb_max; cb >= 8; cb /= 2) {
    const int64_t ct = (g.c + cb - 1) / cb;
    // Channels of 16 or 8 put 2 or 4 output groups in a warp, whose reads may share banks.
    const double conflicts = 32.0 / static_cast<double>(cb);
    // V columns per thread: a V that divides a narrow plane's width wastes no staged column.
    for (int64_t v = v_max; v >= 1; v /= 2)
      for (int64_t u = u_max; u >= 1; u /= 2)
        for (int64_t pn = 1; pn <= (g.p + u - 1) / u; ++pn) {
          const int64_t tp = ((g.p + pn - 1) / pn + u - 1) / u * u, ptiles = (g.p + tp - 1) / tp;
          const int64_t ih = (tp - 1) * g.sh + (g.r - 1) * g.dh + 1;
          if (4 * cb * (ih * 1 + wsp) > kSmem) continue;
          const int64_t rows = staged(g.p, tp, g.sh, ih, g.h, g.pt);
          for (int64_t qn = 1; qn <= (g.q + v - 1) / v; ++qn) {
            const int64_t tq = ((g.q + qn - 1) / qn + v - 1) / v * v, qt = (g.q + tq - 1) / tq;
            if (qn > 1 && qt != qn) continue;  // the same tiling as a smaller qn
            const int64_t iw = (tq - 1) * g.sw + (g.s - 1) * g.dw + 1;
            const int64_t smem = 4 * cb * (ih * iw + wsp);
            if (smem > kSmem) continue;
            const int64_t blocks = g.batch * ct * ptiles * qt, gq = tq / v;
            const int64_t items = cb * (tp / u) * gq;
            const int64_t ir = (u - 1) * g.sh + (g.r - 1) * g.dh + 1,
                          nin = (v - 1) * g.sw + (g.s - 1) * g.dw + 1;
            // Per item: its input rows (the filter stays in registers); a block's items in
            // rounds of the block's threads.
            const double item = static_cast<double>(ir * nin) * conflicts * kShared;
            const double work =
                static_cast<double>(g.batch * g.c * rows * staged(g.q, tq, g.sw, iw, g.w, g.pl)) *
                    kLoad +
                static_cast<double>(blocks) *
                    (kBlockCost + static_cast<double>(cb * ih * iw) * kShared +
                     static_cast<double>((items + kBlock - 1) / kBlock * kBlock) * item);
            const double time = work / static_cast<double>(std::min(blocks, kMinBlocks));
            if (best_time < 0 || time < best_time) {
              best_time = time;
              best.v = v, best.u = u, best.gq = gq, best.tq = tq, best.qt = qt, best.tp = tp,
              best.ptiles = ptiles;
              best.cb = cb, best.ih = ih, best.iw = iw, best.iwp = iw, best.smem = smem;
            }
          }
        }
  }
  return best;
}

}  // namespace

StatusOr<bool> Lowerer::conv_depthwise_nhwc(const Node& n, const ConvPrologue* prologue) {
  if (opts_.depthwise != "kernel" || n.get_string("layout", "nchw") != "nhwc") return false;
  const Value* x = prologue != nullptr ? prologue->node->operand(0) : n.operand(0);
  const DType t = x->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return false;
  const Sizes xs = sizes_of(x), ws = sizes_of(n.operand(1)), ys = sizes_of(n.result());
  if (xs.size() != 3 && xs.size() != 4) return false;
  DepthwiseGeometry g;
  g.nhwc = true;
  g.two_d = xs.size() == 4;
  g.batch = xs[0], g.cin = xs.back(), g.c = ys.back();
  const int64_t groups = n.get_int("groups", 1);
  if (groups <= 1 || groups != g.cin || g.c % groups != 0 || ws.back() != 1) return false;
  if (product(ys) == 0 || product(xs) == 0) return false;
  const Window win = window_of(n, xs.size() - 2);
  g.h = g.two_d ? xs[1] : 1, g.w = xs[xs.size() - 2], g.p = g.two_d ? ys[1] : 1,
  g.q = ys[ys.size() - 2];
  g.r = g.two_d ? ws[1] : 1, g.s = ws[ws.size() - 2];
  g.sh = g.two_d ? win.strides[0] : 1, g.sw = win.strides.back();
  g.dh = g.two_d ? win.dilations[0] : 1, g.dw = win.dilations.back();
  g.pt = g.two_d ? win.pads[0] : 0, g.pl = g.two_d ? win.pads[1] : win.pads[0];
  // Index math in int within an image, kernels the registers hold unrolled.
  if (g.h * g.w * g.cin >= (int64_t{1} << 31) || g.p * g.q * g.c >= (int64_t{1} << 31) ||
      g.r * g.s > 1024)
    return false;
  const DepthwiseTiles tl = depthwise_nhwc_tiles(g, prologue != nullptr);
  if (tl.smem == 0) return false;  // no tile fits the static shared memory
  KILN_RETURN_IF_ERROR(emit_depthwise(n, g, tl, prologue));
  return true;
}

}  // namespace kiln::cuda::detail
