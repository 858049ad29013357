// 1x1 convs with unit strides and no padding (groups 1) as one cuBLASLt GEMM per plan step: in
// NCHW each image is y[n] = W[C_out, C_in] @ x[n][C_in, H*W], a strided batch over the images
// with W shared (stride 0). cuDNN's NCHW kernels took 60-190 us for ResNet-50's 1x1 convs on the
// H200 where PyTorch's TF32 GEMMs took 14-17 us.
//
// cuBLASLt's bias epilogue adds along the contiguous dim of D, which in NCHW is the pixel, not the
// channel. So a constant bias becomes C instead: a [C_out, H*W] plane of the broadcast bias in the
// weights, shared by every image (stride_c 0) and added with beta 1 in the GEMM's own rounding.
// With a residual add as well, one kernel first writes z + bias into y and the GEMM accumulates
// onto it. A relu after it all is the GEMM's epilogue.
#include "lowerer.h"

namespace kiln::cuda::detail {

/// Largest bias plane a 1x1 conv adds to the weights; larger ones use the bias kernel.
constexpr int64_t kBiasPlaneLimitBytes = int64_t{8} << 20;

bool Lowerer::is_pointwise_conv(const Node& n) {
  const DType t = n.operand(0)->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return false;
  const Sizes xs = sizes_of(n.operand(0)), ws = sizes_of(n.operand(1)), ys = sizes_of(n.result());
  if (xs.size() < 3 || n.get_int("groups", 1) != 1 || product(ys) == 0 || xs[1] == 0) return false;
  const size_t nsp = xs.size() - 2;
  const Window win = window_of(n, nsp);
  for (size_t d = 0; d < nsp; ++d)
    if (ws[2 + d] != 1 || win.strides[d] != 1 || win.pads[d] != 0 || win.pads[nsp + d] != 0) return false;
  return true;
}

StatusOr<bool> Lowerer::conv_1x1(const Node& n) {
  if (opts_.conv1x1 != "gemm" || !is_pointwise_conv(n)) return false;
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(const std::string st, storage(n, t));
  const Sizes xs = sizes_of(x), ys = sizes_of(n.result());
  const int64_t batch = xs[0], cin = xs[1], cout = ys[1], plane = product(Sizes(xs.begin() + 2, xs.end()));
  const int out = activation_for(n.result());
  const bool bias = n.num_operands() == 3;
  // relu(conv + z + bias): a residual add as the sole user, then a relu.
  const Value* v = n.result();
  auto same_shape = [](const Value* v, const Value* r) { return sizes_of(r) == sizes_of(v); };
  const Value* z = sole_add_operand(v, same_shape);
  if (z) {
    const Value* sum = v->uses()[0].user->result();
    absorb_user(v, out);
    v = sum;
  }
  const std::string act = sole_activation(v, false);
  if (!act.empty()) absorb_user(v, out);

  std::string c_fields;
  std::vector<int> used;
  double beta = 0;
  const std::optional<Tensor> b = bias ? weight_tensor(buf(n.operand(2))) : std::nullopt;
  if (bias && !z && b && dtype_storage_bytes(t, cout * plane) <= kBiasPlaneLimitBytes) {
    Tensor bias_plane(t, {cout, plane});
    for (int64_t o = 0; o < cout; ++o) {
      const double value = b->get_f64(o);
      for (int64_t p = 0; p < plane; ++p) bias_plane.set_f64(o * plane + p, value);
    }
    const int c = host_weight(bias_plane);
    c_fields = " c=b" + std::to_string(c) + " ldc=" + std::to_string(plane) + " stride_c=0";
    used.push_back(c);
    beta = 1;
  } else if (bias) {
    // y = bias (+ z), then the GEMM accumulates onto y.
    std::string body = "    y[i] = " + store_expr(t, load_expr(t, "b[(i / " + int_literal(plane) + ") % " +
                                                                    int_literal(cout) + "]") +
                                                         (z ? " + " + load_expr(t, "z[i]") : std::string())) +
                       ";\n";
    std::string params = "const " + st + "* __restrict__ b, ";
    std::vector<int> args = {buf(n.operand(2))};
    if (z) {
      params += "const " + st + "* __restrict__ z, ";
      args.push_back(buf(z));
    }
    args.push_back(out);
    launch_elementwise(kernel_name("conv_bias"), params + st + "* __restrict__ y", product(ys), body, args);
    beta = 1;
  } else if (z) {
    c_fields = " c=b" + std::to_string(buf(z)) + " ldc=" + std::to_string(plane);
    used.push_back(buf(z));
    beta = 1;
  }
  gemm_ = true;
  note_dtype(t);
  const int w = buf(n.operand(1));
  used.insert(used.begin(), {w, buf(x), out});
  const std::string compute = t == DType::kF32 && opts_.allow_tf32_conv ? "tf32" : "f32";
  steps_.push_back({"step gemm a=b" + std::to_string(w) + " b=b" + std::to_string(buf(x)) + " d=b" +
                        std::to_string(out) + c_fields + " m=" + std::to_string(cout) + " n=" +
                        std::to_string(plane) + " k=" + std::to_string(cin) + " batch=" + std::to_string(batch) +
                        " trans_a=0 trans_b=0 lda=" + std::to_string(cin) + " ldb=" + std::to_string(plane) +
                        " ldd=" + std::to_string(plane) + " stride_a=0 stride_b=" + std::to_string(cin * plane) +
                        " stride_d=" + std::to_string(cout * plane) + " dtype=" + dname(t) + " compute=" + compute +
                        " alpha=1 beta=" + (beta != 0 ? "1" : "0") + " epilogue=" + (act.empty() ? "none" : act),
                    used});
  return true;
}

}  // namespace kiln::cuda::detail
