// CUDA lowering of the FP8 ops: quantize/dequantize as elementwise kernels (cuda_fp8.h
// conversions; a quantize also reduces a standalone amax of its input, and requantize works in
// place, returning at once when its scales agree), scaled_matmul as one cuBLASLt FP8 GEMM step with scale pointers, or, on a
// target without FP8 that the graph allows to fall back, a GEMM on dequantized operands.
#include <cstring>

#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

std::string interp(DType t) { return t == DType::kF8E4M3FN ? "__NV_E4M3" : "__NV_E5M2"; }


std::string num(int64_t v) { return std::to_string(v); }

bool is_f8(DType t) { return t == DType::kF8E4M3FN || t == DType::kF8E5M2; }

}  // namespace

void Lowerer::need_fp8() {
  if (fp8_) return;
  fp8_ = true;
  // cuda_fp8.h brings cuda_fp16.h and cuda_bf16.h along; NVRTC finds them on the include path.
  source_ += R"(
#include <cuda_fp8.h>
__device__ __forceinline__ float kiln_f8_to_f32(unsigned char q, __nv_fp8_interpretation_t k) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q, k)));
}
)";
}

int Lowerer::host_weight(const Tensor& t) {
  weights_.resize(static_cast<size_t>(align_up(static_cast<int64_t>(weights_.size()))), '\0');
  const int id = add_buffer("weight", t.dtype(), t.shape());
  bufs_[id].offset = static_cast<int64_t>(weights_.size());
  weights_.append(reinterpret_cast<const char*>(t.data()), t.nbytes());
  return id;
}

std::optional<Tensor> Lowerer::weight_tensor(int id) const {
  const int r = root(id);
  if (bufs_[r].kind != "weight") return std::nullopt;
  const int64_t off = bufs_[r].offset + (id == r ? 0 : bufs_[id].offset);
  Tensor t(bufs_[id].dtype, bufs_[id].shape);
  std::memcpy(t.mutable_data(), weights_.data() + off, t.nbytes());
  return t;
}

StatusOr<int> Lowerer::dequant_kernel(const Node& n, int q, DType qt, int scale, DType out_t, const Sizes& shape,
                                      int out) {
  need_fp8();
  note_dtype(out_t);
  if (out < 0) out = add_buffer("activation", out_t, shape);
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, out_t));
  const std::string body = "    y[i] = " + store_expr(out_t, "kiln_f8_to_f32(q[i], " + interp(qt) + ") * s[0]") + ";\n";
  if (product(shape) > 0)
    launch_elementwise(kernel_name("dequantize"),
                       "const unsigned char* __restrict__ q, const float* __restrict__ s, " + st + "* __restrict__ y",
                       product(shape), body, {q, scale, out});
  return out;
}

Status Lowerer::quantize_kernel(const Node& n, const QuantizeKernel& k) {
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, k.xt));
  need_fp8();
  if (k.amax >= 0) steps_.push_back({"step memset dst=b" + std::to_string(k.amax) + " bytes=4", {k.amax}});
  if (k.count == 0) return ok_status();
  std::string params = "const " + st + "* __restrict__ x, const float* __restrict__ s, unsigned char* __restrict__ q";
  std::vector<int> args = {k.x, k.scale, k.q};
  std::string prologue, epilogue;
  int64_t max_blocks = 0;
  if (k.amax >= 0) {  // max |x| folded in as x goes by (state.cpp's amax): one atomic per block
    params += ", unsigned* __restrict__ amax";
    args.push_back(k.amax);
    prologue = "  unsigned m = 0u;\n";
    epilogue = amax_combine("m", "amax");
    max_blocks = 1024;
  }
  // The scale divided by: s[0], or the step's scale this kernel computes (stored by block 0
  // for the GEMM and dequantize that read it after this kernel).
  std::string scale = "s[0]";
  if (k.step_scale >= 0) {
    need_delayed_scaling();
    params += ", const float* __restrict__ step_amax, const float* __restrict__ step_history, float* __restrict__ "
              "step_scale";
    args.insert(args.end(), {k.step_amax, k.step_history, k.step_scale});
    const std::string factor = literal(DType::kF32, k.factor);
    prologue += "  const float s_step = kiln_step_scale(step_amax, step_history, " + std::to_string(k.history) +
                ", s, " + factor + ");\n"
                "  if (blockIdx.x == 0 && threadIdx.x == 0) step_scale[0] = s_step;\n";
    scale = "s_step";
  }
  if (k.unless_scale >= 0) {  // requantize: nothing to do while q already has this scale
    params += ", const float* __restrict__ unless";
    args.push_back(k.unless_scale);
    prologue += "  if (__float_as_uint(unless[0]) == __float_as_uint(" + scale + ")) return;\n";
    max_blocks = 1024;  // so that the usual early exit costs few blocks
  }
  const std::string fold = k.amax >= 0 ? "      " + amax_fold("m", "v[j]") + "\n" : "";
  // An f32 division, not a reciprocal multiply: the reference divides in f32, and so must this
  // (store_expr: the saturating conversion a fused group's quantize epilogue stores with too).
  auto cvt = [&](const std::string& v) { return store_expr(k.qt, quantize_quotient(k.xt, v, scale)); };
  // Eight elements a thread with 16-byte loads and an 8-byte store where sizes and alignment
  // allow: this is a pure bandwidth kernel, and one element a thread reaches a third of it.
  const int64_t es = dtype_storage_bytes(k.xt, 1);
  if (k.count % 8 == 0 && aligned16(k.x) && (es == 2 || k.xt == DType::kF32)) {
    std::string body = k.xt == DType::kF32
        ? "    const float4 a0 = reinterpret_cast<const float4*>(x)[2 * i], a1 = reinterpret_cast<const float4*>(x)[2 * i + 1];\n"
          "    const float v[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};\n"
        : "    const uint4 raw = reinterpret_cast<const uint4*>(x)[i];\n"
          "    const " + st + "* h = reinterpret_cast<const " + st + "*>(&raw);\n"
          "    float v[8];\n"
          "    for (int j = 0; j < 8; ++j) v[j] = " + load_expr(k.xt, "h[j]") + ";\n";
    body += "    unsigned long long o = 0;\n"
            "    for (int j = 0; j < 8; ++j) {\n      o |= (unsigned long long)" + cvt("v[j]") + " << (8 * j);\n" + fold +
            "    }\n"
            "    reinterpret_cast<unsigned long long*>(q)[i] = o;\n";
    launch_elementwise(kernel_name(k.name), params, k.count / 8, body, args, prologue, epilogue, max_blocks);
    return ok_status();
  }
  std::string body = "    q[i] = " + cvt(load_expr(k.xt, "x[i]")) + ";\n";
  if (k.amax >= 0) body += "    " + amax_fold("m", load_expr(k.xt, "x[i]")) + "\n";
  launch_elementwise(kernel_name(k.name), params, k.count, body, args, prologue, epilogue, max_blocks);
  return ok_status();
}

const Node* Lowerer::standalone_partner(const Node& n, const std::string& op) const {
  const Value* x = n.operand(0);
  for (const Use& u : x->uses()) {
    const Node* m = u.user;
    if (m == nullptr || m == &n || m->op_name() != op || u.index != 0 || val_.count(m->result()) ||
        absorbed_.count(m) || m->graph() != n.graph() || bufs_[root(buf(x))].kind == "weight")
      continue;
    if (op == "quantize" && (m->num_operands() != 2 || !val_.count(m->operand(1)))) continue;  // its scale not yet made
    return m;
  }
  return nullptr;
}

Status Lowerer::quantize(const Node& n) {
  // A standalone amax of the same tensor (a weight's, FP8 delayed scaling) is folded in: one
  // read of x instead of two.
  if (const Node* a = standalone_partner(n, "amax"); a != nullptr && !is_f8(n.operand(0)->dtype())) {
    absorbed_.insert(a);
    return quantize_with_amax(n, *a);
  }
  return quantize_kernel(n, quantize_of(n));
}

Lowerer::QuantizeKernel Lowerer::quantize_of(const Node& q) {
  QuantizeKernel k;
  k.xt = q.operand(0)->dtype();
  k.qt = q.result()->dtype();
  k.x = buf(q.operand(0));
  k.scale = buf(q.operand(1));
  k.q = activation_for(q.result());
  k.count = product(sizes_of(q.result()));
  return k;
}

Status Lowerer::quantize_with_amax(const Node& q, const Node& a) {
  QuantizeKernel k = quantize_of(q);
  k.name = "quantize_amax";
  k.amax = activation_for(a.result());
  return quantize_kernel(q, k);
}

Status Lowerer::requantize(const Node& n) {
  const Value* qd = n.operand(1);
  QuantizeKernel k;
  k.name = "requantize";
  k.xt = n.operand(0)->dtype();
  k.qt = n.result()->dtype();
  k.x = buf(n.operand(0));
  k.scale = buf(n.operand(3));
  k.count = product(sizes_of(n.result()));
  if (const Node* p = n.operand(3)->producer(); p != nullptr && step_scales_in_requantize_.count(p)) {
    k.step_scale = k.scale;  // written here, from the delayed scale
    k.scale = buf(p->operand(2));
    k.step_amax = buf(p->operand(0));
    k.step_history = buf(p->operand(1));
    k.history = product(sizes_of(p->operand(1)));
    k.factor = delayed_scale_factor(*p);
  }
  const int from = buf(qd);
  // In place over q when nothing else reads it: then the usual step (scale == q_scale) is one
  // launch that returns at once, and only a just-in-time first step quantizes again.
  if (qd->uses().size() == 1 && bufs_[root(from)].kind == "activation" && whole_root(from)) {
    k.q = add_buffer("alias", k.qt, sizes_of(n.result()), n.result()->name());
    bufs_[k.q].base = root(from);
    val_[n.result()] = k.q;
    k.unless_scale = buf(n.operand(2));
    return quantize_kernel(n, k);
  }
  // Otherwise a plain quantize with the scale the step uses.
  k.q = activation_for(n.result());
  return quantize_kernel(n, k);
}

Status Lowerer::dequantize(const Node& n) {
  const DType t = n.result()->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return unsupported_dtype(n, t);
  return dequant_kernel(n, buf(n.operand(0)), n.operand(0)->dtype(), buf(n.operand(1)), t, sizes_of(n.result()),
                        activation_for(n.result()))
      .status();
}

Status Lowerer::scaled_matmul(const Node& n) {
  const DType t = n.result()->dtype(), at = n.operand(0)->dtype(), bt = n.operand(1)->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return unsupported_dtype(n, t);
  const Sizes ws = sizes_of(n.operand(1));
  const int64_t nn = ws[0], k = ws[1];
  const int64_t m = nn == 0 ? 0 : product(sizes_of(n.result())) / nn;
  const bool bias = n.num_operands() == 5;
  if (!opts_.fp8 && n.get_string("fallback", "none") != "bf16")
    return error_at(n.loc(), StatusCode::kFailedPrecondition,
                    opts_.target + " has no FP8 tensor cores; scaled_matmul " + value_label(n.result()) +
                        " needs them (quantize with fallback=bf16 to run a GEMM on dequantized weights there)");
  const int out = activation_for(n.result());
  note_dtype(t);
  if (m * nn == 0) return ok_status();
  if (k == 0) return unsupported(n, "k = 0 is not supported");
  const int sa = buf(n.operand(2)), sb = buf(n.operand(3));
  int a = buf(n.operand(0)), b = buf(n.operand(1));
  // cuBLASLt's FP8 kernels want 16-byte multiples for k and n, and no e5m2 x e5m2. Elsewhere
  // (and on targets without FP8) both operands are dequantized to the result dtype and an
  // ordinary GEMM runs instead: bf16 for a bf16 model, f32 for an f32 one.
  const bool native = opts_.fp8 && k % 16 == 0 && nn % 16 == 0 && !(at == DType::kF8E5M2 && bt == DType::kF8E5M2);
  if (!native) {
    need_fp8();
    std::optional<Tensor> wq = weight_tensor(b), ws_t = weight_tensor(sb);
    if (wq && ws_t) {  // constant weights dequantize at compile time
      Tensor w(t, {nn, k});
      const double s = ws_t->get_f64(0);
      for (int64_t i = 0; i < w.numel(); ++i) w.set_f64(i, wq->get_f64(i) * s);
      b = host_weight(w);
    } else {
      KILN_ASSIGN_OR_RETURN(b, dequant_kernel(n, b, bt, sb, t, {nn, k}, -1));
    }
    KILN_ASSIGN_OR_RETURN(a, dequant_kernel(n, a, at, sa, t, {m, k}, -1));
  }
  gemm_ = true;
  // An f32 FP8 GEMM takes only a bf16 bias in cuBLASLt: the f32 bias is added by a kernel after.
  const bool bias_kernel = bias && native && t == DType::kF32;
  const std::string act = bias_kernel ? "" : sole_activation(n.result(), true);
  if (!act.empty()) absorb_user(n.result(), out);
  const bool bias_epi = bias && !bias_kernel;
  const std::string epilogue = bias_epi ? (act.empty() ? "bias" : "bias_" + act) : (act.empty() ? "none" : act);
  std::string text = "step gemm a=b" + num(a) + " b=b" + num(b) + " d=b" + num(out);
  std::vector<int> used = {a, b, out};
  if (bias_epi) {
    text += " bias=b" + num(buf(n.operand(4)));
    used.push_back(buf(n.operand(4)));
  }
  const std::string compute = !native && t == DType::kF32 && opts_.allow_tf32 ? "tf32" : "f32";
  text += " m=" + num(m) + " n=" + num(nn) + " k=" + num(k) + " batch=1 trans_a=0 trans_b=1 lda=" + num(k) +
          " ldb=" + num(k) + " ldd=" + num(nn) + " stride_a=" + num(m * k) + " stride_b=0 stride_d=" + num(m * nn) +
          " dtype=" + dname(t) + " compute=" + compute + " alpha=1 beta=0 epilogue=" + epilogue;
  if (native) {
    text += " a_dtype=" + dname(at) + " b_dtype=" + dname(bt) + " a_scale=b" + num(sa) + " b_scale=b" + num(sb) +
            " fast_accum=" + num(n.get_int("fast_accumulation", 1));
    used.push_back(sa);
    used.push_back(sb);
  }
  steps_.push_back({text, used});
  if (bias_kernel) {
    const int bb = buf(n.operand(4));
    launch_elementwise(kernel_name("bias_add"), "float* __restrict__ y, const float* __restrict__ bias",
                       m * nn, "    y[i] += bias[i % " + int_literal(nn) + "];\n", {out, bb});
  }
  return ok_status();
}

}  // namespace kiln::cuda::detail
