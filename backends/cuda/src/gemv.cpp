// Small-M GEMMs (at most kGemvMaxRows rows of x) as one generated kernel instead of a cuBLASLt
// step: at batch 1 a linear layer is a weight read plus launch latency, and the kernel also
// applies the bias and a following relu/gelu.
#include <algorithm>

#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

/// Rows up to which the kernel beats cuBLASLt. Each weight element read feeds 2·M FLOPs of
/// CUDA-core FMA; an H200 streams ~4.8 TB/s against ~60 TFLOP/s of f32 FMA, so f32 stays
/// memory-bound to M ≈ 28 and f16/bf16 (half the bytes) to M ≈ 14. From M ≈ 16 on, one
/// tensor-core tile row of cuBLASLt does the same work without wasting lanes.
constexpr int64_t kGemvMaxRows = 16;
/// Below this many weight elements both paths are pure launch latency; those GEMMs keep the
/// cuBLASLt step (and its epilogues).
constexpr int64_t kGemvMinWeights = 1024;
/// Weights from which a grid too small to fill the GPU loses to cuBLASLt's split-K.
constexpr int64_t kGemvSplitKWeights = int64_t{1} << 20;
constexpr int64_t kGemvMinBlocks = 32;
/// Floats of x staged in shared memory per block (32 KiB), and the warps of one block.
constexpr int64_t kStageFloats = 8192;
constexpr int kWarps = 4;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

StatusOr<bool> Lowerer::small_m_gemm(const Node& n) {
  const DType t = n.result()->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return false;
  const bool lin = n.op_name() == "linear";
  const Value* x = n.operand(0);
  const Value* w = n.operand(1);
  const Sizes xs = sizes_of(x), ws = sizes_of(w), ys = sizes_of(n.result());
  int64_t k = 0, nn = 0;
  if (lin) {
    nn = ws[0];
    k = ws[1];
  } else {
    // matmul: w is [K, N] (or [K]) shared by every row, and x is not broadcast, so the batch
    // dims of x fold into M.
    if (xs.empty() || ws.empty()) return false;
    k = xs.back();
    nn = ws.size() == 1 ? 1 : ws.back();
    if (ws.size() > 2 && product(Sizes(ws.begin(), ws.end() - 2)) != 1) return false;
  }
  if (k <= 0 || nn <= 0) return false;
  const int64_t m = product(xs) / k;
  if (m < 1 || m > kGemvMaxRows || m * nn != product(ys) || k * nn < kGemvMinWeights) return false;
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));

  // 16-byte weight loads need rows (linear) or column groups (matmul) that stay 16-byte aligned.
  const int64_t elem = dtype_storage_bytes(t, 1);
  const int wid = buf(w);
  const bool aligned = bufs_[wid].kind != "alias" || bufs_[wid].offset % 16 == 0;
  const int64_t vec = 16 / elem;
  // matmul keeps M x V accumulators per thread, so it loads at most 4 elements at a time.
  const int64_t vmax = lin ? vec : std::min<int64_t>(vec, 4);
  const int64_t v = aligned && (lin ? k : nn) % vmax == 0 ? vmax : 1;
  const int64_t cols_per_warp = std::clamp<int64_t>(ceil_div(nn, kWarps * 264), 1, 4);
  const int64_t blocks = lin ? ceil_div(nn, kWarps * cols_per_warp) : ceil_div(nn, 8 * v);
  if (blocks > kMaxGrid || (blocks < kGemvMinBlocks && k * nn >= kGemvSplitKWeights)) return false;

  // The sole relu/gelu user is applied before the store, after rounding to the result dtype
  // as the unfused graph would.
  std::string act = "v";
  const Node* user = nullptr;
  if (const auto& uses = n.result()->uses(); uses.size() == 1 && uses[0].user != nullptr) {
    const Node& u = *uses[0].user;
    if ((u.op_name() == "relu" || u.op_name() == "gelu") && u.num_operands() == 1 && u.num_results() == 1 &&
        u.result()->dtype() == t) {
      KILN_ASSIGN_OR_RETURN(act, op_expr(u, {"v"}));
      user = &u;
    }
  }
  const bool bias = lin && n.num_operands() == 3;
  std::vector<int> args = {buf(x), wid};
  if (bias) args.push_back(buf(n.operand(2)));
  const int out = activation_for(n.result());
  args.push_back(out);
  if (user != nullptr) absorb_user(n.result(), out);

  const int64_t stage = std::max<int64_t>(kStageFloats / m / 256 * 256, 256);
  const int64_t kt = std::min(stage, (k + 3) / 4 * 4);
  const std::string M = std::to_string(m), K = int_literal(k), N = int_literal(nn), KT = std::to_string(kt),
                    V = std::to_string(v), ld = load_expr(t, "e[u]");
  const std::string name = kernel_name(lin ? "gemv" : "gemv_kn");
  const int block = lin ? 32 * kWarps : 256;
  std::string s = "extern \"C\" __global__ void __launch_bounds__(" + std::to_string(block) + ") " + name + "(const " +
                  st + "* __restrict__ x, const " + st + "* __restrict__ w, " +
                  (bias ? "const " + st + "* __restrict__ bias, " : "") + st + "* __restrict__ y) {\n";
  s += "  __shared__ __align__(16) float xs[" + M + " * " + KT + "];\n";
  // Each tile of x (all rows, KT columns) goes to shared memory as float; every warp reads it.
  // The row loop is unrolled so the M loads of a column are in flight together: with few blocks
  // (a squeeze-excite FC has N = 48 columns, 12 blocks) nothing else hides their latency, and
  // one load at a time made the staging, not the weights, the kernel's cost.
  const std::string stage_x =
      "    const int kt = (int)min((long long)" + KT + ", " + K + " - k0);\n"
      "    __syncthreads();\n"
      "    for (int c = threadIdx.x; c < kt; c += blockDim.x) {\n"
      "#pragma unroll\n"
      "      for (int r = 0; r < " + M + "; ++r)\n"
      "        xs[r * " + KT + " + c] = " + load_expr(t, "x[(long long)r * " + K + " + k0 + c]") + ";\n"
      "    }\n"
      "    __syncthreads();\n";
  // Loads V weights at `ptr` into e[0..V).
  const std::string vt = v * elem == 16 ? "uint4" : "uint2";
  const std::string load_w = v > 1 ? "const " + vt + " raw = __ldg(reinterpret_cast<const " + vt + "*>(PTR));\n"
                                     "          const " + st + "* e = reinterpret_cast<const " + st + "*>(&raw);\n"
                                   : "const " + st + " e[1] = {*(PTR)};\n";
  auto with_ptr = [&](const std::string& p) {
    std::string r = load_w;
    r.replace(r.find("PTR"), 3, p);
    return r;
  };
  auto epilogue = [&](const std::string& sum, const std::string& col, const std::string& row) {
    std::string e = "float v = " + round_expr(t, sum + (bias ? " + " + load_expr(t, "bias[" + col + "]") : "")) + ";\n";
    if (user != nullptr) e += "v = " + round_expr(t, act) + ";\n";
    return e + "y[(long long)" + row + " * " + N + " + " + col + "] = " + store_expr(t, "v") + ";\n";
  };
  if (lin) {
    // One warp per output column (cols_per_warp of them): lanes stride along the weight row
    // with 16-byte loads, then a shuffle reduction; lane r writes row r.
    const std::string R = std::to_string(cols_per_warp);
    s += "  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;\n"
         "  const long long n0 = ((long long)blockIdx.x * " + std::to_string(kWarps) + " + warp) * " + R + ";\n"
         "  float acc[" + R + "][" + M + "];\n"
         "#pragma unroll\n  for (int c = 0; c < " + R + "; ++c)\n"
         "#pragma unroll\n    for (int r = 0; r < " + M + "; ++r) acc[c][r] = 0.f;\n"
         "  for (long long k0 = 0; k0 < " + K + "; k0 += " + KT + ") {\n" + stage_x +
         "#pragma unroll\n    for (int c = 0; c < " + R + "; ++c) {\n"
         "      if (n0 + c >= " + N + ") continue;\n"
         "      const " + st + "* wr = w + (n0 + c) * " + K + " + k0;\n"
         "#pragma unroll 4\n"
         "      for (int kk = lane * " + V + "; kk < kt; kk += 32 * " + V + ") {\n"
         "        " + with_ptr("wr + kk") +
         "        float wf[" + V + "];\n"
         "#pragma unroll\n        for (int u = 0; u < " + V + "; ++u) wf[u] = " + ld + ";\n"
         "#pragma unroll\n        for (int r = 0; r < " + M + "; ++r) {\n"
         "          const float* xr = xs + r * " + KT + " + kk;\n";
    s += v > 1 ? "#pragma unroll\n          for (int u = 0; u < " + V + "; u += 4) {\n"
                 "            const float4 q = *reinterpret_cast<const float4*>(xr + u);\n"
                 "            acc[c][r] += q.x * wf[u] + q.y * wf[u + 1] + q.z * wf[u + 2] + q.w * wf[u + 3];\n"
                 "          }\n"
               : "          acc[c][r] += xr[0] * wf[0];\n";
    s += "        }\n      }\n    }\n  }\n"
         "#pragma unroll\n  for (int c = 0; c < " + R + "; ++c) {\n"
         "    const long long col = n0 + c;\n"
         "    if (col >= " + N + ") continue;\n"
         "#pragma unroll\n    for (int r = 0; r < " + M + "; ++r) {\n"
         "      float sum = acc[c][r];\n"
         "      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);\n"
         "      if (lane == r) {\n" + epilogue("sum", "col", "r") + "      }\n"
         "    }\n  }\n}\n";
  } else {
    // w is [K, N]: 8 threads of a block take V adjacent columns each, 32 groups split K, and
    // shared memory sums the groups one row at a time.
    s += "  __shared__ float red[32][8 * " + V + " + 1];\n"
         "  const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;\n"
         "  const long long c0 = ((long long)blockIdx.x * 8 + tx) * " + V + ";\n"
         "  float acc[" + M + "][" + V + "];\n"
         "#pragma unroll\n  for (int r = 0; r < " + M + "; ++r)\n"
         "#pragma unroll\n    for (int u = 0; u < " + V + "; ++u) acc[r][u] = 0.f;\n"
         "  for (long long k0 = 0; k0 < " + K + "; k0 += " + KT + ") {\n" + stage_x +
         "    if (c0 >= " + N + ") continue;\n"
         "#pragma unroll 4\n"
         "    for (int kk = ty; kk < kt; kk += 32) {\n"
         "      " + with_ptr("w + (k0 + kk) * " + N + " + c0") +
         "#pragma unroll\n      for (int u = 0; u < " + V + "; ++u) {\n"
         "        const float wf = " + ld + ";\n"
         "#pragma unroll\n        for (int r = 0; r < " + M + "; ++r) acc[r][u] += xs[r * " + KT + " + kk] * wf;\n"
         "      }\n    }\n  }\n"
         "#pragma unroll\n  for (int r = 0; r < " + M + "; ++r) {\n"
         "    __syncthreads();\n"
         "#pragma unroll\n    for (int u = 0; u < " + V + "; ++u) red[ty][tx * " + V + " + u] = acc[r][u];\n"
         "    __syncthreads();\n"
         "    if (threadIdx.x < 8 * " + V + ") {\n"
         "      const long long col = (long long)blockIdx.x * 8 * " + V + " + threadIdx.x;\n"
         "      float sum = 0.f;\n"
         "      for (int g = 0; g < 32; ++g) sum += red[g][threadIdx.x];\n"
         "      if (col < " + N + ") {\n" + epilogue("sum", "col", "r") + "      }\n"
         "    }\n  }\n}\n";
  }
  add_kernel_text(name, s);
  launch_grid(name, {blocks}, block, 0, args);
  return true;
}

}  // namespace kiln::cuda::detail
