// Channels-last depthwise convs (the layout-nhwc pass with depthwise = true) as one generated
// kernel each: x [N, H, W, C], w [K, R, S, 1] with K = C * multiplier, y [N, P, Q, K]. A warp
// covers consecutive channels of one output pixel group, so every input and output access is
// coalesced along C; each thread computes V adjacent outputs of a row and keeps one kernel row's
// inputs in registers, so each load serves up to V * S multiply-adds. The bias and the pointwise
// ops after the conv (conv_tail.cpp) are applied before the store.
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

constexpr const char* kDepthwiseNhwcBody = R"(
  constexpr int NIN = (V - 1) * SW + (S - 1) * DW + 1;
  const long long idx = (long long)blockIdx.x * NTHR + threadIdx.x;
  if (idx >= TOTAL) return;
  const int c = (int)(idx % C);
  long long rest = idx / C;
  const int g = (int)(rest % QG);
  rest /= QG;
  const int p = (int)(rest % P);
  const int n = (int)(rest / P);
  const int q0 = g * V, cin = c / MULT;
  float acc[V];
#pragma unroll
  for (int u = 0; u < V; ++u) acc[u] = 0.f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int ih = p * SH - PT + r * DH;
    if (ih < 0 || ih >= H) continue;
    const auto* xr = x + ((long long)n * H + ih) * W * CIN + cin;
    float in[NIN];
#pragma unroll
    for (int j = 0; j < NIN; ++j) {
      const int iw = q0 * SW - PL + j;
      in[j] = iw >= 0 && iw < W ? PRO(LOAD(xr[(long long)iw * CIN])) : 0.f;
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const float wv = LOAD(w[TAPS_MAJOR ? (r * S + s) * C + c : (c * R + r) * S + s]);
#pragma unroll
      for (int u = 0; u < V; ++u) acc[u] = fmaf(in[u * SW + s * DW], wv, acc[u]);
    }
  }
  const float bias = HAS_BIAS ? LOAD(b[c]) : 0.f;
#pragma unroll
  for (int u = 0; u < V; ++u) {
    const int q = q0 + u;
    if (q >= Q) break;
    float v = ROUND(acc[u] + bias);
TAIL
    y[(((long long)n * P + p) * Q + q) * C + c] = STORE(v);
  }
)";

}  // namespace

StatusOr<bool> Lowerer::conv_depthwise_nhwc(const Node& n, const ConvPrologue* prologue) {
  if (opts_.depthwise != "kernel" || n.get_string("layout", "nchw") != "nhwc") return false;
  // With a prologue the kernel reads the pointwise node's input and applies it on each load
  // (zero padding stays zero: it pads the node's output).
  const Value* x = prologue != nullptr ? prologue->node->operand(0) : n.operand(0);
  const DType t = x->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return false;
  const Sizes xs = sizes_of(x), ws = sizes_of(n.operand(1)), ys = sizes_of(n.result());
  if (xs.size() != 3 && xs.size() != 4) return false;
  const int64_t cin = xs.back(), c = ys.back();
  const int64_t groups = n.get_int("groups", 1);
  if (groups <= 1 || groups != cin || c % groups != 0 || ws.back() != 1) return false;
  if (product(ys) == 0 || product(xs) == 0) return false;
  const bool two_d = xs.size() == 4;
  const Window win = window_of(n, xs.size() - 2);
  // A 1-D conv is a 2-D one of height 1.
  const int64_t h = two_d ? xs[1] : 1, w = xs[xs.size() - 2], p = two_d ? ys[1] : 1, q = ys[ys.size() - 2];
  const int64_t r = two_d ? ws[1] : 1, s = ws[ws.size() - 2];
  const int64_t sh = two_d ? win.strides[0] : 1, sw = win.strides.back();
  const int64_t dh = two_d ? win.dilations[0] : 1, dw = win.dilations.back();
  const int64_t pt = two_d ? win.pads[0] : 0, pl = two_d ? win.pads[1] : win.pads[0];
  // Index math in int within an image, kernels the registers hold unrolled.
  if (h * w * cin >= (int64_t{1} << 31) || p * q * c >= (int64_t{1} << 31) || r * s > 1024) return false;
  const int64_t v = std::min<int64_t>(sw == 1 ? 4 : sw == 2 ? 2 : 1, q);
  const int64_t qg = (q + v - 1) / v, total = xs[0] * p * qg * c;
  KILN_ASSIGN_OR_RETURN(const std::string st, storage(n, t));
  // Constant filters are transposed to [taps][K] at compile time, so that a warp's weight loads
  // (consecutive channels of one tap) are coalesced like its input loads; as stored, [K, taps],
  // lanes read addresses R * S elements apart (32 sectors a load). Others are read as stored.
  int w_buf = buf(n.operand(1));
  const std::optional<Tensor> filters = weight_tensor(w_buf);
  if (filters) {
    const int64_t taps = r * s;
    Tensor by_tap(t, {taps, c});
    for (int64_t o = 0; o < c; ++o)
      for (int64_t k = 0; k < taps; ++k) by_tap.set_f64(k * c + o, filters->get_f64(o * taps + k));
    w_buf = host_weight(by_tap);
  }
  const bool bias = n.num_operands() == 3;
  const int out = activation_for(n.result());
  KILN_ASSIGN_OR_RETURN(const ConvTail tail, conv_tail(n, out, two_d ? std::vector<std::string>{"n", "p", "q", "c"}
                                                                     : std::vector<std::string>{"n", "q", "c"}));
  auto I = [](int64_t val) { return std::to_string(val); };
  const std::string name = kernel_name("conv_depthwise_nhwc");
  std::string text = "extern \"C\" __global__ void __launch_bounds__(" + I(kBlock) + ") " + name + "(const " + st +
                     "* __restrict__ x, const " + st + "* __restrict__ w, const " + st + "* __restrict__ b" +
                     tail.params + ", " + st + "* __restrict__ y) {\n";
  text += "  constexpr int C = " + I(c) + ", CIN = " + I(cin) + ", MULT = " + I(c / cin) + ", H = " + I(h) + ", W = " +
          I(w) + ", P = " + I(p) + ", Q = " + I(q) + ", R = " + I(r) + ", S = " + I(s) + ";\n";
  text += "  constexpr int SH = " + I(sh) + ", SW = " + I(sw) + ", DH = " + I(dh) + ", DW = " + I(dw) + ", PT = " + I(pt) +
          ", PL = " + I(pl) + ", NTHR = " + I(kBlock) + ", V = " + I(v) + ", QG = " + I(qg) + ";\n";
  text += "  constexpr long long TOTAL = " + I(total) + "LL;\n";
  text += std::string("  constexpr bool HAS_BIAS = ") + (bias ? "true" : "false") + ", TAPS_MAJOR = " +
          (filters ? "true" : "false") + ";\n";
  if (prologue != nullptr) {
    text += prologue->code + "#undef PRO\n#define PRO(e) pro(e)\n";
    absorbed_.insert(prologue->node);
  } else {
    text += "#undef PRO\n#define PRO(e) (e)\n";
  }
  finish_depthwise(n, name, text, kDepthwiseNhwcBody, tail, out, (total + kBlock - 1) / kBlock, w_buf, buf(x));
  return true;
}

}  // namespace kiln::cuda::detail
