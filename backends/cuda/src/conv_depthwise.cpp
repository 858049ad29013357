// Depthwise convs (groups == input channels: MobileNet, EfficientNet, ConvNeXt) as one generated
// kernel each, NCHW, f32/f16/bf16, any kernel size, stride, padding and dilation, with the bias and
// the pointwise ops after the conv (conv_tail.cpp) applied before the store. cuDNN's NCHW
// depthwise kernels took 87-150 us for ConvNeXt-tiny's 7x7 convs on the H200 where PyTorch's
// took ~23 us.
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

// One block: a tile of TP output rows x TQ output columns of CB consecutive channels of one image.
// It stages the tile's input rows with their halo (zeros where the padding is, as f32) and the
// CB filters in shared memory, coalesced along rows; then each thread computes V adjacent
// outputs of a row at a time, holding one kernel row's inputs in registers so that each input
// read from shared memory serves up to V * S multiply-adds.
constexpr const char* kDepthwiseBody = R"(
  constexpr int ITEMS = CB * TP * GQ, NIN = (V - 1) * SW + (S - 1) * DW + 1;
  __shared__ float xs[CB * IH * IWP];
  __shared__ float ws[CB * R * S];
  int blk = blockIdx.x;
  const int qt = blk % QT;
  blk /= QT;
  const int pt = blk % PTILES;
  blk /= PTILES;
  const int c0 = (blk % CT) * CB, n = blk / CT;
  const int p0 = pt * TP, q0 = qt * TQ, ih0 = p0 * SH - PT, iw0 = q0 * SW - PL;
  for (int e = threadIdx.x; e < CB * IH * IW; e += NTHR) {
    const int j = e % IW, i = (e / IW) % IH, cb = e / (IW * IH);
    const int c = c0 + cb, ih = ih0 + i, iw = iw0 + j;
    float v = 0.f;
    if (c < C && ih >= 0 && ih < H && iw >= 0 && iw < W) v = LOAD(x[((long long)n * CIN + c / MULT) * (H * W) + ih * W + iw]);
    xs[(cb * IH + i) * IWP + j] = v;
  }
  for (int e = threadIdx.x; e < CB * R * S; e += NTHR)
    ws[e] = c0 + e / (R * S) < C ? LOAD(w[(long long)c0 * (R * S) + e]) : 0.f;
  __syncthreads();
  for (int it = threadIdx.x; it < ITEMS; it += NTHR) {
    const int g = it % GQ, pl = (it / GQ) % TP, cb = it / (GQ * TP);
    const int c = c0 + cb, p = p0 + pl, qb = q0 + g * V;
    if (c >= C || p >= P || qb >= Q) continue;
    float acc[V];
#pragma unroll
    for (int u = 0; u < V; ++u) acc[u] = 0.f;
    const float* xr = xs + (cb * IH + pl * SH) * IWP + g * V * SW;
    const float* wr = ws + cb * (R * S);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float in[NIN];
#pragma unroll
      for (int j = 0; j < NIN; ++j) in[j] = xr[r * DH * IWP + j];
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const float wv = wr[r * S + s];
#pragma unroll
        for (int u = 0; u < V; ++u) acc[u] = fmaf(in[u * SW + s * DW], wv, acc[u]);
      }
    }
    const float bias = HAS_BIAS ? LOAD(b[c]) : 0.f;
#pragma unroll
    for (int u = 0; u < V; ++u) {
      const int q = qb + u;
      if (q >= Q) break;
      float v = ROUND(acc[u] + bias);
TAIL
      y[((long long)n * C + c) * (P * Q) + p * Q + q] = STORE(v);
    }
  }
)";

/// Output tiling of one depthwise conv: V outputs per thread along a row, GQ thread columns
/// (TQ = GQ * V output columns), TP rows and CB channels per block.
struct DepthwiseTiles {
  int64_t v = 1, gq = 1, tq = 1, qt = 1, tp = 1, ptiles = 1, cb = 1, ih = 1, iw = 1, iwp = 1;
  int64_t smem = 0;
};

DepthwiseTiles depthwise_tiles(int64_t c, int64_t p, int64_t q, int64_t r, int64_t s, int64_t sh, int64_t sw,
                               int64_t dh, int64_t dw) {
  // About two outputs groups per thread of a 256-thread block, and at most 40 KB of shared
  // memory, so that several blocks share an SM.
  constexpr int64_t kItems = 512, kSmem = 40 * 1024;
  DepthwiseTiles t;
  // V * SW = 4 columns apart per thread keeps a warp's shared-memory reads in distinct banks.
  t.v = std::min<int64_t>(sw == 1 ? 4 : sw == 2 ? 2 : 1, q);
  const int64_t groups = (q + t.v - 1) / t.v;
  t.gq = std::min<int64_t>(groups, 32);
  t.tq = t.gq * t.v;
  t.qt = (q + t.tq - 1) / t.tq;
  auto fill = [&] {
    t.ih = (t.tp - 1) * sh + (r - 1) * dh + 1;
    t.iw = (t.tq - 1) * sw + (s - 1) * dw + 1;
    t.iwp = t.iw | 1;  // an odd pitch spreads a warp's rows over the banks
    t.smem = 4 * t.cb * (t.ih * t.iwp + r * s);
  };
  // Rows: as many as make kItems, split evenly over the plane's row tiles.
  t.tp = std::clamp<int64_t>((kItems + t.gq - 1) / t.gq, 1, p);
  t.ptiles = (p + t.tp - 1) / t.tp;
  t.tp = (p + t.ptiles - 1) / t.ptiles;
  // A whole plane in one tile leaves room for more channels.
  t.cb = t.ptiles == 1 ? std::clamp<int64_t>(kItems / (t.tp * t.gq), 1, c) : 1;
  fill();
  while (t.smem > kSmem && t.cb > 1) {
    t.cb = (t.cb + 1) / 2;
    fill();
  }
  while (t.smem > kSmem && t.tp > 1) {
    t.ptiles = (p + t.tp / 2 - 1) / (t.tp / 2);
    t.tp = (p + t.ptiles - 1) / t.ptiles;
    fill();
  }
  return t;
}

}  // namespace

bool Lowerer::is_depthwise(const Node& n) {
  const DType t = n.operand(0)->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return false;
  const Sizes xs = sizes_of(n.operand(0)), ws = sizes_of(n.operand(1));
  if (xs.size() != 3 && xs.size() != 4) return false;
  const int64_t groups = n.get_int("groups", 1);
  return groups > 1 && groups == xs[1] && ws[0] % groups == 0 && ws[1] == 1;
}

StatusOr<bool> Lowerer::conv_depthwise(const Node& n) {
  if (opts_.depthwise != "kernel" || !is_depthwise(n)) return false;
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  const Sizes xs = sizes_of(x), ws = sizes_of(n.operand(1)), ys = sizes_of(n.result());
  const bool two_d = xs.size() == 4;
  const Window win = window_of(n, xs.size() - 2);
  // A 1-D conv is a 2-D one of height 1.
  const int64_t h = two_d ? xs[2] : 1, w = xs.back(), p = two_d ? ys[2] : 1, q = ys.back();
  const int64_t r = two_d ? ws[2] : 1, s = ws.back();
  const int64_t sh = two_d ? win.strides[0] : 1, sw = win.strides.back();
  const int64_t dh = two_d ? win.dilations[0] : 1, dw = win.dilations.back();
  const int64_t pt = two_d ? win.pads[0] : 0, pl = two_d ? win.pads[1] : win.pads[0];
  const int64_t batch = xs[0], cin = xs[1], c = ys[1];
  if (product(ys) == 0 || product(xs) == 0) return false;
  // 32-bit indices within a plane, kernels the registers hold unrolled.
  if (h * w >= (int64_t{1} << 31) || p * q >= (int64_t{1} << 31) || r * s > 1024) return false;
  const DepthwiseTiles tl = depthwise_tiles(c, p, q, r, s, sh, sw, dh, dw);
  if (tl.smem > 48 * 1024) return false;  // static shared memory: a kernel wider than the tiles allow
  KILN_ASSIGN_OR_RETURN(const std::string st, storage(n, t));
  const bool bias = n.num_operands() == 3;
  const int out = activation_for(n.result());
  KILN_ASSIGN_OR_RETURN(const ConvTail tail, conv_tail(n, out, two_d ? std::vector<std::string>{"n", "c", "p", "q"}
                                                                     : std::vector<std::string>{"n", "c", "q"}));
  const int64_t ct = (c + tl.cb - 1) / tl.cb, blocks = batch * ct * tl.ptiles * tl.qt;
  auto I = [](int64_t v) { return std::to_string(v); };
  const std::string name = kernel_name("conv_depthwise");
  std::string text = "extern \"C\" __global__ void __launch_bounds__(" + I(kBlock) + ") " + name + "(const " + st +
                     "* __restrict__ x, const " + st + "* __restrict__ w, const " + st + "* __restrict__ b" +
                     tail.params + ", " + st + "* __restrict__ y) {\n";
  text += "  constexpr int C = " + I(c) + ", CIN = " + I(cin) + ", MULT = " + I(c / cin) + ", H = " + I(h) + ", W = " +
          I(w) + ", P = " + I(p) + ", Q = " + I(q) + ", R = " + I(r) + ", S = " + I(s) + ";\n";
  text += "  constexpr int SH = " + I(sh) + ", SW = " + I(sw) + ", DH = " + I(dh) + ", DW = " + I(dw) + ", PT = " + I(pt) +
          ", PL = " + I(pl) + ", NTHR = " + I(kBlock) + ";\n";
  text += "  constexpr int V = " + I(tl.v) + ", GQ = " + I(tl.gq) + ", TQ = " + I(tl.tq) + ", QT = " + I(tl.qt) +
          ", TP = " + I(tl.tp) + ", PTILES = " + I(tl.ptiles) + ", CB = " + I(tl.cb) + ", CT = " + I(ct) + ", IH = " +
          I(tl.ih) + ", IW = " + I(tl.iw) + ", IWP = " + I(tl.iwp) + ";\n";
  text += std::string("  constexpr bool HAS_BIAS = ") + (bias ? "true" : "false") + ";\n";
  finish_depthwise(n, name, text, kDepthwiseBody, tail, out, blocks);
  return true;
}

void Lowerer::finish_depthwise(const Node& n, const std::string& name, std::string text, std::string body,
                               const ConvTail& tail, int out, int64_t blocks, int w_buf, int x_buf) {
  const DType t = n.operand(0)->dtype();
  body.replace(body.find("TAIL\n"), 5, tail.code);
  text += body + "}\n";
  // LOAD/STORE/ROUND of the storage type, as macros the body spells once.
  const std::string defs = "#define LOAD(e) " + load_expr(t, "(e)") + "\n#define STORE(e) " + store_expr(t, "(e)") +
                           "\n#define ROUND(e) " + round_expr(t, "(e)") + "\n";
  add_kernel_text(name, defs + text + "#undef LOAD\n#undef STORE\n#undef ROUND\n");
  note_dtype(t);
  if (w_buf < 0) w_buf = buf(n.operand(1));
  if (x_buf < 0) x_buf = buf(n.operand(0));
  std::vector<int> args = {x_buf, w_buf, n.num_operands() == 3 ? buf(n.operand(2)) : w_buf};
  args.insert(args.end(), tail.args.begin(), tail.args.end());
  args.push_back(out);
  launch_grid(name, {blocks}, kBlock, 0, args);
}

}  // namespace kiln::cuda::detail
