// Depthwise convs (groups == input channels: MobileNet, EfficientNet, ConvNeXt) as one generated
// kernel each, NCHW, f32/f16/bf16, any kernel size, stride, padding and dilation, with the bias and
// the pointwise ops after the conv (conv_tail.cpp) applied before the store. cuDNN's NCHW
// depthwise kernels took 87-150 us for ConvNeXt-tiny's 7x7 convs on the H200 where PyTorch's
// took ~23 us.
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

// One block: a tile of TP output rows x TQ output columns of CB consecutive channels of one image,
// in either layout (NHWC). It stages the tile's input rows with their halo (zeros where the
// padding is, as f32) and the CB filters in shared memory, consecutive threads along the stored
// innermost dim so that the loads coalesce; PRO, the pointwise node before a channels-last conv,
// runs there, once per staged input. Then each thread computes U x V outputs (U rows of V
// adjacent columns) at a time from input rows it holds in registers: each input read from shared
// memory serves up to U * V * S multiply-adds. Channels last, a warp's threads take consecutive
// channels of one output group, so its shared-memory reads are conflict-free and its stores
// coalesce.
constexpr const char* kDepthwiseBody = R"(
  constexpr int NIN = (V - 1) * SW + (S - 1) * DW + 1, IR = (U - 1) * SH + (R - 1) * DH + 1;
  constexpr int RG = TP / U, ITEMS = CB * RG * GQ, WSP = (R * S) | 1;
  constexpr int XR = NHWC ? IWP * CB : IWP, XC = NHWC ? CB : 1;  // shared-memory strides of a row and a column
  constexpr bool CACHE_W = R * S <= 64;
  __shared__ float xs[CB * IH * IWP];
  __shared__ float ws[CB * WSP];
  __shared__ float pooled[POOL ? NTHR : 1];
  int blk = blockIdx.x;
  const int qt = blk % QT;
  blk /= QT;
  const int pt = blk % PTILES;
  blk /= PTILES;
  const int c0 = (blk % CT) * CB, n = blk / CT;
  const int p0 = pt * TP, q0 = qt * TQ, ih0 = p0 * SH - PT, iw0 = q0 * SW - PL;
#pragma unroll 4
  for (int e = threadIdx.x; e < CB * IH * IW; e += NTHR) {
    const int cb = NHWC ? e % CB : e / (IW * IH);
    const int j = NHWC ? (e / CB) % IW : e % IW;
    const int i = NHWC ? e / (CB * IW) : (e / IW) % IH;
    const int c = c0 + cb, ih = ih0 + i, iw = iw0 + j;
    float v = 0.f;
    if (c < C && ih >= 0 && ih < H && iw >= 0 && iw < W)
      v = PRO(LOAD(x[NHWC ? (((long long)n * H + ih) * W + iw) * CIN + c / MULT
                          : ((long long)n * CIN + c / MULT) * (H * W) + ih * W + iw]));
    xs[NHWC ? (i * IWP + j) * CB + cb : (cb * IH + i) * IWP + j] = v;
  }
  // Filters are [K, 1, R, S] or [K, R, S, 1]: the block's CB filters are contiguous either way.
  for (int e = threadIdx.x; e < CB * R * S; e += NTHR)
    ws[e / (R * S) * WSP + e % (R * S)] = c0 + e / (R * S) < C ? LOAD(w[(long long)c0 * (R * S) + e]) : 0.f;
  __syncthreads();
  // The filter in registers: channels last, a thread's channel is the same in all its items.
  float wk[CACHE_W ? R * S : 1];
  if constexpr (CACHE_W && NHWC) {
#pragma unroll
    for (int t = 0; t < R * S; ++t) wk[t] = ws[threadIdx.x % CB * WSP + t];
  }
  float pool_sum = 0.f;  // POOL: the sum of the thread's stored outputs (all of one channel)
  for (int it = threadIdx.x; it < ITEMS; it += NTHR) {
    const int cb = NHWC ? it % CB : it / (GQ * RG);
    const int g = NHWC ? (it / CB) % GQ : it % GQ;
    const int rg = NHWC ? it / (CB * GQ) : (it / GQ) % RG;
    const int c = c0 + cb, pb = p0 + rg * U, qb = q0 + g * V;
    if (c >= C || pb >= P || qb >= Q) continue;
    const float* xr = xs + (NHWC ? cb : cb * IH * IWP) + rg * U * SH * XR + g * V * SW * XC;
    const float* wr = ws + cb * WSP;
    if constexpr (CACHE_W && !NHWC) {
#pragma unroll
      for (int t = 0; t < R * S; ++t) wk[t] = wr[t];
    }
    float acc[U][V];
#pragma unroll
    for (int o = 0; o < U; ++o)
#pragma unroll
      for (int u = 0; u < V; ++u) acc[o][u] = 0.f;
    // Input row i of the item feeds output row o through kernel row r where i = o * SH + r * DH.
#pragma unroll
    for (int i = 0; i < IR; ++i) {
      bool used = false;
#pragma unroll
      for (int r = 0; r < R; ++r) used |= i >= r * DH && (i - r * DH) % SH == 0 && (i - r * DH) / SH < U;
      if (!used) continue;
      float in[NIN];
#pragma unroll
      for (int j = 0; j < NIN; ++j) in[j] = xr[i * XR + j * XC];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int d = i - r * DH, o = d / SH;
        if (d < 0 || d % SH != 0 || o >= U) continue;
#pragma unroll
        for (int s = 0; s < S; ++s) {
          const float wv = CACHE_W ? wk[CACHE_W ? r * S + s : 0] : wr[r * S + s];
#pragma unroll
          for (int u = 0; u < V; ++u) acc[o][u] = fmaf(in[u * SW + s * DW], wv, acc[o][u]);
        }
      }
    }
    const float bias = HAS_BIAS ? LOAD(b[c]) : 0.f;
#pragma unroll
    for (int o = 0; o < U; ++o) {
      const int p = pb + o;
      if (p >= P) break;
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const int q = qb + u;
        if (q >= Q) break;
        float v = ROUND(acc[o][u] + bias);
TAIL
        y[NHWC ? (((long long)n * P + p) * Q + q) * C + c : ((long long)n * C + c) * (P * Q) + p * Q + q] = STORE(v);
        if constexpr (POOL) pool_sum += v;
      }
    }
  }
  // The block's sum of each channel over its tile, in a fixed order: partial[tile][n][c].
  if constexpr (POOL) {
    pooled[threadIdx.x] = pool_sum;
    __syncthreads();
    if (threadIdx.x < CB && c0 + (int)threadIdx.x < C) {
      float sum = 0.f;
      for (int k = threadIdx.x; k < NTHR; k += CB) sum += pooled[k];
      partial[((long long)(pt * QT + qt) * BATCH + n) * C + c0 + threadIdx.x] = sum;
    }
  }
)";

DepthwiseTiles depthwise_tiles(int64_t c, int64_t p, int64_t q, int64_t r, int64_t s, int64_t sh,
                               int64_t sw, int64_t dh, int64_t dw) {
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
    t.smem = 4 * t.cb * (t.ih * t.iwp + ((r * s) | 1));
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
  const Sizes xs = sizes_of(n.operand(0)), ws = sizes_of(n.operand(1)), ys = sizes_of(n.result());
  if (product(ys) == 0 || product(xs) == 0) return false;
  DepthwiseGeometry g;
  g.two_d = xs.size() == 4;
  const Window win = window_of(n, xs.size() - 2);
  g.batch = xs[0], g.cin = xs[1], g.c = ys[1];
  g.h = g.two_d ? xs[2] : 1, g.w = xs.back(), g.p = g.two_d ? ys[2] : 1, g.q = ys.back();
  g.r = g.two_d ? ws[2] : 1, g.s = ws.back();
  g.sh = g.two_d ? win.strides[0] : 1, g.sw = win.strides.back();
  g.dh = g.two_d ? win.dilations[0] : 1, g.dw = win.dilations.back();
  g.pt = g.two_d ? win.pads[0] : 0, g.pl = g.two_d ? win.pads[1] : win.pads[0];
  // 32-bit indices within a plane, kernels the registers hold unrolled.
  if (g.h * g.w >= (int64_t{1} << 31) || g.p * g.q >= (int64_t{1} << 31) || g.r * g.s > 1024)
    return false;
  const DepthwiseTiles tl = depthwise_tiles(g.c, g.p, g.q, g.r, g.s, g.sh, g.sw, g.dh, g.dw);
  // Static shared memory (and the 4 bytes of the pool sums, unused here): a kernel wider than
  // the tiles allow.
  if (tl.smem + 4 > 48 * 1024) return false;
  KILN_RETURN_IF_ERROR(emit_depthwise(n, g, tl, nullptr));
  return true;
}

Status Lowerer::emit_depthwise(const Node& n, const DepthwiseGeometry& g, const DepthwiseTiles& tl,
                               const ConvPrologue* prologue) {
  // With a prologue the kernel reads the pointwise node's input and applies it to each staged
  // input (zero padding stays zero: it pads the node's output).
  const Value* x = prologue != nullptr ? prologue->node->operand(0) : n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(const std::string st, storage(n, t));
  const int out = activation_for(n.result());
  const std::vector<std::string> coords =
      g.nhwc ? (g.two_d ? std::vector<std::string>{"n", "p", "q", "c"}
                        : std::vector<std::string>{"n", "q", "c"})
             : (g.two_d ? std::vector<std::string>{"n", "c", "p", "q"}
                        : std::vector<std::string>{"n", "c", "q"});
  KILN_ASSIGN_OR_RETURN(const ConvTail tail, conv_tail(n, out, coords));
  const Node* pool = g.nhwc ? spatial_pool_of(tail.value) : nullptr;
  const bool bias = n.num_operands() == 3;
  const int64_t ct = (g.c + tl.cb - 1) / tl.cb, blocks = g.batch * ct * tl.ptiles * tl.qt;
  auto I = [](int64_t v) { return std::to_string(v); };
  const std::string name = kernel_name(g.nhwc ? "conv_depthwise_nhwc" : "conv_depthwise");
  std::string text = "extern \"C\" __global__ void __launch_bounds__(" + I(kBlock) + ") " + name +
                     "(const " + st + "* __restrict__ x, const " + st + "* __restrict__ w, const " +
                     st + "* __restrict__ b" + tail.params + ", " + st + "* __restrict__ y" +
                     (pool ? ", float* __restrict__ partial" : "") + ") {\n";
  text += "  constexpr int C = " + I(g.c) + ", CIN = " + I(g.cin) + ", MULT = " + I(g.c / g.cin) +
          ", H = " + I(g.h) + ", W = " + I(g.w) + ", P = " + I(g.p) + ", Q = " + I(g.q) +
          ", R = " + I(g.r) + ", S = " + I(g.s) + ";\n";
  text += "  constexpr int SH = " + I(g.sh) + ", SW = " + I(g.sw) + ", DH = " + I(g.dh) +
          ", DW = " + I(g.dw) + ", PT = " + I(g.pt) + ", PL = " + I(g.pl) +
          ", NTHR = " + I(kBlock) + ";\n";
  text += "  constexpr int V = " + I(tl.v) + ", GQ = " + I(tl.gq) + ", TQ = " + I(tl.tq) +
          ", QT = " + I(tl.qt) + ", TP = " + I(tl.tp) + ", PTILES = " + I(tl.ptiles) +
          ", CB = " + I(tl.cb) + ", CT = " + I(ct) + ", IH = " + I(tl.ih) + ", IW = " + I(tl.iw) +
          ", IWP = " + I(tl.iwp) + ";\n";
  text += "  constexpr int U = " + I(tl.u) + ", BATCH = " + I(g.batch) + ";\n";
  text += std::string("  constexpr bool HAS_BIAS = ") + (bias ? "true" : "false") + ", NHWC = " +
          (g.nhwc ? "true" : "false") + ", POOL = " + (pool ? "true" : "false") + ";\n";
  if (pool == nullptr) text += "  float* const partial = nullptr;  // read only by the pool's code, which is off\n";
  if (prologue != nullptr) {
    text += prologue->code + "#undef PRO\n#define PRO(e) pro(e)\n";
    absorbed_.insert(prologue->node);
  } else {
    text += "#undef PRO\n#define PRO(e) (e)\n";
  }
  std::string body = kDepthwiseBody;
  body.replace(body.find("TAIL\n"), 5, tail.code);
  text += body + "}\n";
  // LOAD/STORE/ROUND of the storage type, as macros the body spells once.
  const std::string defs = "#define LOAD(e) " + load_expr(t, "(e)") + "\n#define STORE(e) " +
                           store_expr(t, "(e)") + "\n#define ROUND(e) " + round_expr(t, "(e)") +
                           "\n";
  add_kernel_text(name, defs + text + "#undef LOAD\n#undef STORE\n#undef ROUND\n#undef PRO\n");
  note_dtype(t);
  const int w_buf = buf(n.operand(1));
  std::vector<int> args = {buf(x), w_buf, bias ? buf(n.operand(2)) : w_buf};
  args.insert(args.end(), tail.args.begin(), tail.args.end());
  args.push_back(out);
  if (pool == nullptr) {
    launch_grid(name, {blocks}, kBlock, 0, args);
    return ok_status();
  }
  // The pool: each block's per-channel sums, then one thread per (image, channel) adds its tiles'.
  const int64_t tiles = tl.ptiles * tl.qt, rows = g.batch * g.c;
  const int partial = add_buffer("activation", DType::kF32, {tiles, rows});
  args.push_back(partial);
  launch_grid(name, {blocks}, kBlock, 0, args);
  absorbed_.insert(pool);
  const int pooled = activation_for(pool->result());
  const std::string scale =
      pool->op_name() == "reduce_mean" ? " / " + literal(DType::kF32, static_cast<double>(g.p * g.q)) : "";
  launch_elementwise(kernel_name(pool->op_name() + "_tiles"),
                     "const float* __restrict__ partial, " + st + "* __restrict__ y", rows,
                     "    float sum = 0.f;\n    for (int t = 0; t < " + I(tiles) + "; ++t) sum += partial[t * " +
                         int_literal(rows) + " + i];\n    y[i] = " + store_expr(t, "sum" + scale) + ";\n",
                     {partial, pooled});
  return ok_status();
}

const Node* Lowerer::spatial_pool_of(const Value* v) const {
  const Sizes vs = sizes_of(v);
  std::set<int64_t> spatial;
  for (size_t d = 1; d + 1 < vs.size(); ++d) spatial.insert(static_cast<int64_t>(d));
  for (const Use& u : v->uses()) {
    const Node* r = u.user;
    if (r == nullptr || absorbed_.count(r) || (r->op_name() != "reduce_mean" && r->op_name() != "reduce_sum")) continue;
    if (r->num_operands() != 1 || r->num_results() != 1 || r->result()->dtype() != v->dtype()) continue;
    std::set<int64_t> axes;
    for (int64_t a : r->get_ints("axes")) axes.insert(norm_axis(a, static_cast<int64_t>(vs.size())));
    if (axes == spatial) return r;
  }
  return nullptr;
}

}  // namespace kiln::cuda::detail
