// cuBLASLt gemm steps: attribute checks, descriptors, heuristic algorithm, launch.
#include "gemm.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace kiln::rt {
namespace {

/// Reads a gemm step's attributes; every error names the plan line.
struct Attrs {
  const artifact::PlanStep& step;

  kiln_status* fail(const std::string& msg) const {
    return make_status(KILN_STATUS_INVALID_ARGUMENT,
                       "plan:" + std::to_string(step.line) + ": gemm: " + msg);
  }
  const std::string* find(const char* key) const {
    auto it = step.attrs.find(key);
    return it == step.attrs.end() ? nullptr : &it->second;
  }
  kiln_status* integer(const char* key, const int64_t* fallback, int64_t* out) const {
    const std::string* v = find(key);
    if (!v) {
      if (!fallback) return fail(std::string("missing attribute '") + key + "'");
      *out = *fallback;
      return nullptr;
    }
    auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), *out);
    if (ec != std::errc() || end != v->data() + v->size() || *out < 0)
      return fail(std::string("attribute ") + key + "='" + *v + "' is not a count");
    return nullptr;
  }
  kiln_status* number(const char* key, float fallback, float* out) const {
    const std::string* v = find(key);
    *out = fallback;
    if (!v) return nullptr;
    char* end = nullptr;
    *out = std::strtof(v->c_str(), &end);
    if (v->empty() || *end != '\0')
      return fail(std::string("attribute ") + key + "='" + *v + "' is not a number");
    return nullptr;
  }
  /// Buffer ids are written "bID"; -1 when absent and optional.
  kiln_status* buffer(const char* key, bool required, int* out) const {
    const std::string* v = find(key);
    *out = -1;
    if (!v) return required ? fail(std::string("missing attribute '") + key + "'") : nullptr;
    std::string_view s = *v;
    if (!s.empty() && s[0] == 'b') s.remove_prefix(1);
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
    if (ec != std::errc() || end != s.data() + s.size() || *out < 0)
      return fail(std::string("attribute ") + key + "='" + *v + "' is not a buffer");
    return nullptr;
  }
};

uint64_t pointer_alignment(const void* p, int64_t stride_bytes) {
  uint64_t a = reinterpret_cast<uintptr_t>(p) | 256;
  if (stride_bytes > 0) a |= static_cast<uint64_t>(stride_bytes);
  return a & (~a + 1);  // lowest set bit
}

static_assert(2 * sizeof(cublasLtMatmulAlgo_t) == artifact::kGemmAlgoHexDigits);

/// A tuned algorithm as plan text: its 64 bytes in lowercase hex.
std::string algo_hex(const cublasLtMatmulAlgo_t& algo) {
  static const char* digits = "0123456789abcdef";
  const auto* bytes = reinterpret_cast<const unsigned char*>(&algo);
  std::string out;
  for (size_t i = 0; i < sizeof algo; ++i) out += {digits[bytes[i] >> 4], digits[bytes[i] & 15]};
  return out;
}

/// The reader has checked the form (2 * sizeof(cublasLtMatmulAlgo_t) hex digits).
cublasLtMatmulAlgo_t algo_from_hex(const std::string& hex) {
  cublasLtMatmulAlgo_t algo{};
  auto* bytes = reinterpret_cast<unsigned char*>(&algo);
  auto digit = [](char c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; };
  for (size_t i = 0; i < sizeof algo && 2 * i + 1 < hex.size(); ++i)
    bytes[i] = static_cast<unsigned char>(digit(hex[2 * i]) << 4 | digit(hex[2 * i + 1]));
  return algo;
}

}  // namespace

GemmStep::~GemmStep() {
  if (ones_) cudaFree(ones_);
  if (pref_) cublasLtMatmulPreferenceDestroy(pref_);
  if (desc_) cublasLtMatmulDescDestroy(desc_);
  for (cublasLtMatrixLayout_t l : {layout_a_, layout_b_, layout_c_, layout_d_})
    if (l) cublasLtMatrixLayoutDestroy(l);
}

kiln_status* GemmStep::create(const artifact::PlanStep& step,
                              const std::function<const DeviceBuffer*(int)>& buffer_of,
                              cublasLtHandle_t handle, uint64_t workspace_bytes,
                              std::unique_ptr<GemmStep>* out) {
  Attrs at{step};
  int ia, ib, id, ic, ibias;
  KILN_RT_TRY(at.buffer("a", true, &ia));
  KILN_RT_TRY(at.buffer("b", true, &ib));
  KILN_RT_TRY(at.buffer("d", true, &id));
  KILN_RT_TRY(at.buffer("c", false, &ic));
  KILN_RT_TRY(at.buffer("bias", false, &ibias));
  int64_t m, n, k, batch, ta, tb, lda, ldb, ldd, ldc, sa, sb, sd, sc;
  const int64_t one = 1, zero = 0;
  KILN_RT_TRY(at.integer("m", nullptr, &m));
  KILN_RT_TRY(at.integer("n", nullptr, &n));
  KILN_RT_TRY(at.integer("k", nullptr, &k));
  KILN_RT_TRY(at.integer("batch", &one, &batch));
  KILN_RT_TRY(at.integer("trans_a", &zero, &ta));
  KILN_RT_TRY(at.integer("trans_b", &zero, &tb));
  if (m == 0 || n == 0 || k == 0 || batch == 0) return at.fail("m, n, k and batch must be positive");
  if (ta > 1 || tb > 1) return at.fail("trans_a and trans_b must be 0 or 1");
  // Row-major shapes of the stored matrices.
  int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
  KILN_RT_TRY(at.integer("lda", &a_cols, &lda));
  KILN_RT_TRY(at.integer("ldb", &b_cols, &ldb));
  KILN_RT_TRY(at.integer("ldd", &n, &ldd));
  KILN_RT_TRY(at.integer("ldc", &ldd, &ldc));
  KILN_RT_TRY(at.integer("stride_a", &zero, &sa));
  KILN_RT_TRY(at.integer("stride_b", &zero, &sb));
  KILN_RT_TRY(at.integer("stride_d", &zero, &sd));
  KILN_RT_TRY(at.integer("stride_c", &sd, &sc));
  const std::string* dtype = at.find("dtype");
  const std::string* compute = at.find("compute");
  const std::string* epilogue = at.find("epilogue");
  std::string dt = dtype ? *dtype : "f32", ct = compute ? *compute : "f32",
              ep = epilogue ? *epilogue : "none";
  cudaDataType_t data_type;
  int64_t es;
  if (dt == "f32") data_type = CUDA_R_32F, es = 4;
  else if (dt == "f16") data_type = CUDA_R_16F, es = 2;
  else if (dt == "bf16") data_type = CUDA_R_16BF, es = 2;
  else return at.fail("dtype '" + dt + "' is not f32, f16 or bf16");
  // FP8 operands: a_dtype/b_dtype name them (default: dtype); d, c and bias keep dtype.
  const std::string* adt = at.find("a_dtype");
  const std::string* bdt = at.find("b_dtype");
  const std::string a_dt = adt ? *adt : dt, b_dt = bdt ? *bdt : dt;
  auto operand_type = [&](const std::string& name, cudaDataType_t* type, int64_t* size) -> kiln_status* {
    if (name == dt) *type = data_type, *size = es;
    else if (name == "f8e4m3fn") *type = CUDA_R_8F_E4M3, *size = 1;
    else if (name == "f8e5m2") *type = CUDA_R_8F_E5M2, *size = 1;
    // bf16/f16 products into an f32 c and d (CUBLAS_COMPUTE_32F): an f32 gradient sum.
    else if (name == "bf16" && dt == "f32") *type = CUDA_R_16BF, *size = 2;
    else if (name == "f16" && dt == "f32") *type = CUDA_R_16F, *size = 2;
    else return at.fail("operand dtype '" + name + "' is not " + dt + ", f8e4m3fn or f8e5m2 (or bf16/f16 into f32)");
    return nullptr;
  };
  cudaDataType_t a_type, b_type;
  int64_t a_es, b_es;
  KILN_RT_TRY(operand_type(a_dt, &a_type, &a_es));
  KILN_RT_TRY(operand_type(b_dt, &b_type, &b_es));
  const bool fp8 = a_es == 1 || b_es == 1;
  if (!fp8 && a_type != b_type) return at.fail("a_dtype and b_dtype differ (" + a_dt + ", " + b_dt + ")");
  if (!fp8 && a_type != data_type && (ep != "none" || ct != "f32"))
    return at.fail("bf16/f16 operands into an f32 d take compute f32 and no epilogue");
  int ia_scale, ib_scale, iamax;
  KILN_RT_TRY(at.buffer("a_scale", false, &ia_scale));
  KILN_RT_TRY(at.buffer("b_scale", false, &ib_scale));
  KILN_RT_TRY(at.buffer("amax_d", false, &iamax));
  if (fp8 && (ia_scale < 0 || ib_scale < 0)) return at.fail("fp8 operands need a_scale and b_scale");
  if (!fp8 && (ia_scale >= 0 || ib_scale >= 0 || iamax >= 0)) return at.fail("scales are only for fp8 operands");
  if (fp8 && (ta != 0 || tb != 1)) return at.fail("fp8 needs trans_a=0 trans_b=1 (cuBLASLt's TN layout)");
  cublasComputeType_t compute_type;
  if (ct == "f32") compute_type = CUBLAS_COMPUTE_32F;
  else if (ct == "tf32" && dt == "f32") compute_type = CUBLAS_COMPUTE_32F_FAST_TF32;
  else return at.fail("compute '" + ct + "' is not valid for dtype " + dt);
  cublasLtEpilogue_t epi;
  if (ep == "none") epi = CUBLASLT_EPILOGUE_DEFAULT;
  else if (ep == "relu") epi = CUBLASLT_EPILOGUE_RELU;
  else if (ep == "gelu") epi = CUBLASLT_EPILOGUE_GELU;  // tanh approximation
  else if (ep == "bias") epi = CUBLASLT_EPILOGUE_BIAS;
  else if (ep == "bias_relu") epi = CUBLASLT_EPILOGUE_RELU_BIAS;
  else if (ep == "bias_gelu") epi = CUBLASLT_EPILOGUE_GELU_BIAS;
  // Bias gradients, named by the plan's operand they sum over k; the plan's A is cuBLAS's B.
  else if (ep == "bgrad_a") epi = CUBLASLT_EPILOGUE_BGRADB;
  else if (ep == "bgrad_b") epi = CUBLASLT_EPILOGUE_BGRADA;
  else return at.fail("unknown epilogue '" + ep + "'");
  const bool bgrad = ep.rfind("bgrad", 0) == 0;
  bool wants_bias = ep.rfind("bias", 0) == 0 || bgrad;
  if (bgrad && (batch != 1 || fp8 || a_type != data_type))
    return at.fail("epilogue " + ep + " needs batch 1 and operands of d's dtype");
  if (wants_bias != (ibias >= 0))
    return at.fail(wants_bias ? "epilogue " + ep + " needs a bias buffer"
                              : "a bias buffer needs a bias epilogue");

  const int64_t es_d = es;
  auto g = std::unique_ptr<GemmStep>(new GemmStep());
  KILN_RT_TRY(at.number("alpha", 1.0f, &g->alpha_));
  KILN_RT_TRY(at.number("beta", 0.0f, &g->beta_));
  if (g->beta_ != 0 && ic < 0) ic = id;  // beta without c accumulates into d
  if (ic < 0) ldc = ldd, sc = sd;

  // Every operand must lie inside its buffer: a bad plan must not read or write past it.
  auto check = [&](int bid, const char* what, int64_t rows, int64_t cols, int64_t ld,
                   int64_t stride, const DeviceBuffer** out_buf) -> kiln_status* {
    const DeviceBuffer* buf = buffer_of(bid);
    if (!buf) return at.fail(std::string(what) + " refers to undefined buffer b" + std::to_string(bid));
    const std::string& want = what[0] == 'a' && what[1] == 0 ? a_dt : what[0] == 'b' && what[1] == 0 ? b_dt : dt;
    const int64_t es = what[0] == 'a' && what[1] == 0 ? a_es : what[0] == 'b' && what[1] == 0 ? b_es : es_d;
    if (buf->dtype != want)
      return at.fail(std::string(what) + " buffer b" + std::to_string(bid) + " is " + buf->dtype +
                     ", the gemm's " + what + " dtype is " + want);
    if (ld < cols) return at.fail(std::string("leading dimension of ") + what + " is " +
                                  std::to_string(ld) + ", less than its " + std::to_string(cols) + " columns");
    uint64_t extent = static_cast<uint64_t>((batch - 1) * stride + (rows - 1) * ld + cols) * es;
    if (extent > buf->bytes)
      return at.fail(std::string(what) + " needs " + std::to_string(extent) + " bytes, buffer b" +
                     std::to_string(bid) + " has " + std::to_string(buf->bytes));
    *out_buf = buf;
    return nullptr;
  };
  const DeviceBuffer *A, *B, *C, *D, *bias = nullptr;
  KILN_RT_TRY(check(ia, "a", a_rows, a_cols, lda, sa, &A));
  KILN_RT_TRY(check(ib, "b", b_rows, b_cols, ldb, sb, &B));
  KILN_RT_TRY(check(id, "d", m, n, ldd, sd, &D));
  KILN_RT_TRY(check(ic < 0 ? id : ic, "c", m, n, ldc, sc, &C));
  // A bias has d's n columns; a bias gradient one element per row of the operand it sums.
  const int64_t bias_len = ep == "bgrad_a" ? m : n;
  if (ibias >= 0) KILN_RT_TRY(check(ibias, "bias", 1, bias_len, bias_len, 0, &bias));
  g->a_ = B->ptr;
  g->b_ = A->ptr;
  g->c_ = C->ptr;
  g->d_ = D->ptr;

  // Column-major view: a row-major R x C matrix with leading dimension ld is a column-major
  // C x R one; D^T[n,m] = op(B)^T[n,k] @ op(A)^T[k,m].
  auto layout = [&](cublasLtMatrixLayout_t* l, int64_t rows, int64_t cols, int64_t ld,
                    int64_t stride, cudaDataType_t type) -> kiln_status* {
    KILN_CUBLAS_TRY(cublasLtMatrixLayoutCreate(l, type, static_cast<uint64_t>(cols),
                                               static_cast<uint64_t>(rows), ld));
    int32_t count = static_cast<int32_t>(batch);
    KILN_CUBLAS_TRY(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                     &count, sizeof count));
    KILN_CUBLAS_TRY(cublasLtMatrixLayoutSetAttribute(
        *l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
    return nullptr;
  };
  KILN_RT_TRY(layout(&g->layout_a_, b_rows, b_cols, ldb, sb, b_type));
  KILN_RT_TRY(layout(&g->layout_b_, a_rows, a_cols, lda, sa, a_type));
  KILN_RT_TRY(layout(&g->layout_c_, m, n, ldc, sc, data_type));
  KILN_RT_TRY(layout(&g->layout_d_, m, n, ldd, sd, data_type));

  KILN_CUBLAS_TRY(cublasLtMatmulDescCreate(&g->desc_, compute_type, CUDA_R_32F));
  cublasOperation_t op_a = tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  KILN_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(g->desc_, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
  KILN_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(g->desc_, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
  KILN_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(g->desc_, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
  if (fp8) {
    // The plan's A is cuBLAS's B and vice versa (the column-major view above).
    auto scale_ptr = [&](int bid, const char* what, cublasLtMatmulDescAttributes_t attr) -> kiln_status* {
      const DeviceBuffer* s = buffer_of(bid);
      if (!s) return at.fail(std::string(what) + " refers to undefined buffer b" + std::to_string(bid));
      if (s->dtype != "f32" || s->bytes < 4) return at.fail(std::string(what) + " buffer b" + std::to_string(bid) + " must hold an f32");
      const void* p = s->ptr;
      KILN_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(g->desc_, attr, &p, sizeof p));
      return nullptr;
    };
    KILN_RT_TRY(scale_ptr(ib_scale, "b_scale", CUBLASLT_MATMUL_DESC_A_SCALE_POINTER));
    KILN_RT_TRY(scale_ptr(ia_scale, "a_scale", CUBLASLT_MATMUL_DESC_B_SCALE_POINTER));
    if (iamax >= 0) KILN_RT_TRY(scale_ptr(iamax, "amax_d", CUBLASLT_MATMUL_DESC_AMAX_D_POINTER));
    // fast_accum=1 (the default) keeps the sum in the tensor cores' fast FP8 accumulator, as
    // Transformer Engine's forward GEMMs do; 0 promotes it to f32 (its dgrad and wgrad GEMMs).
    int64_t fast_accum;
    KILN_RT_TRY(at.integer("fast_accum", &one, &fast_accum));
    if (fast_accum != 0 && fast_accum != 1) return at.fail("fast_accum must be 0 or 1");
    const int8_t fast = static_cast<int8_t>(fast_accum);
    KILN_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(g->desc_, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    if (bias && dt == "f32") return at.fail("fp8 with an f32 d takes no bias (cuBLASLt wants a bf16 one)");
  }
  if (bias) {
    const void* bias_ptr = bias->ptr;
    KILN_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(g->desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                   &bias_ptr, sizeof bias_ptr));
  }

  KILN_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&g->pref_));
  cublasLtMatmulPreference_t pref = g->pref_;
  KILN_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof workspace_bytes));
  // The pointers are fixed at load, so the heuristic may count on their real alignment.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, static_cast<uint32_t>(pointer_alignment(g->a_, sb * b_es))},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, static_cast<uint32_t>(pointer_alignment(g->b_, sa * a_es))},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, static_cast<uint32_t>(pointer_alignment(g->c_, sc * es))},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, static_cast<uint32_t>(pointer_alignment(g->d_, sd * es))}};
  for (const auto& [attr, value] : aligns)
    KILN_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value));
  const auto str = [](int64_t v) { return std::to_string(v); };
  g->problem_ = "gemm " + str(m) + "x" + str(n) + "x" + str(k) + (batch > 1 ? " batch " + str(batch) : "") + " " +
                (fp8 ? a_dt + "*" + b_dt + "->" : "") + dt + (ep == "none" ? "" : " " + ep) + " | m=" + str(m) +
                " n=" + str(n) + " k=" + str(k) + " batch=" + str(batch) + " trans=" + str(ta) + str(tb) +
                " ld=" + str(lda) + "," + str(ldb) + "," + str(ldc) + "," + str(ldd) + " stride=" + str(sa) + "," +
                str(sb) + "," + str(sc) + "," + str(sd) + " dtype=" + dt + "," + a_dt + "," + b_dt + " compute=" + ct +
                " epilogue=" + ep + " beta=" + (g->beta_ != 0 ? "1" : "0") + " amax=" + (iamax >= 0 ? "1" : "0") +
                " align=";
  for (const auto& [attr, value] : aligns) g->problem_ += str(value) + (attr == aligns[3].first ? "" : ",");
  g->problem_ += " workspace=" + std::to_string(workspace_bytes);
  if (auto it = step.attrs.find("algo"); it != step.attrs.end()) {
    // A tuned choice applies only where cuBLASLt confirms it fits these descriptors and the
    // workspace (another cuBLASLt version or GPU may not have it): otherwise the heuristic's.
    const cublasLtMatmulAlgo_t algo = algo_from_hex(it->second);
    cublasLtMatmulHeuristicResult_t check{};
    const cublasStatus_t st = cublasLtMatmulAlgoCheck(handle, g->desc_, g->layout_a_, g->layout_b_, g->layout_c_,
                                                      g->layout_d_, &algo, &check);
    if (st == CUBLAS_STATUS_SUCCESS && check.workspaceSize <= workspace_bytes) {
      g->algo_ = algo;
      *out = std::move(g);
      return nullptr;
    }
    static std::atomic<bool> noted{false};
    if (!noted.exchange(true))
      std::fprintf(stderr, "kiln: note: plan:%d: gemm: the tuned algo= does not fit this GPU and cuBLASLt (%s); "
                   "using cuBLASLt's heuristic (noted once)\n", step.line,
                   st != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusName(st)
                                               : ("needs " + format_bytes(check.workspaceSize) + " of workspace").c_str());
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  // KILN_GEMM_BGRAD_SEPARATE=1 takes the path below as if cuBLASLt had no bias-gradient kernel (tests).
  const char* separate = std::getenv("KILN_GEMM_BGRAD_SEPARATE");
  cublasStatus_t heuristic = CUBLAS_STATUS_NOT_SUPPORTED;
  if (!(bgrad && separate && std::string(separate) == "1"))
    heuristic = cublasLtMatmulAlgoGetHeuristic(handle, g->desc_, g->layout_a_, g->layout_b_, g->layout_c_,
                                               g->layout_d_, pref, 1, &result, &found);
  if (!bgrad) KILN_CUBLAS_TRY(heuristic);
  if (bgrad && (heuristic != CUBLAS_STATUS_SUCCESS || found == 0)) {
    found = 0;
    static std::atomic<bool> noted{false};
    if (!noted.exchange(true))
      std::fprintf(stderr, "kiln: note: plan:%d: gemm: cuBLASLt has no %s kernel for %s (%s); the bias gradient "
                   "is a GEMM of its own (noted once)\n", step.line, ep.c_str(), g->problem_.c_str(),
                   heuristic == CUBLAS_STATUS_SUCCESS ? "no algorithm" : cublasLtGetStatusName(heuristic));
    // No kernel carries the epilogue for this problem here: the GEMM without it, then the bias
    // gradient as a GEMM of its own, ones[1, k] @ the summed operand as [k, len].
    const cublasLtEpilogue_t plain = CUBLASLT_EPILOGUE_DEFAULT;
    KILN_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(g->desc_, CUBLASLT_MATMUL_DESC_EPILOGUE, &plain, sizeof plain));
    KILN_RT_TRY(g->separate_bias_grad(step, buffer_of, handle, workspace_bytes, ep == "bgrad_a" ? ia : ib,
                                      ep == "bgrad_a" ? 1 - ta : tb, ep == "bgrad_a" ? lda : ldb, ibias, bias_len, k, dt,
                                      es, ct));
    KILN_CUBLAS_TRY(cublasLtMatmulAlgoGetHeuristic(handle, g->desc_, g->layout_a_, g->layout_b_,
                                                   g->layout_c_, g->layout_d_, pref, 1, &result, &found));
  }
  if (found == 0)
    return make_status(KILN_STATUS_UNSUPPORTED,
                       "plan:" + std::to_string(step.line) + ": gemm: cuBLASLt has no algorithm for " +
                           dt + " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" +
                           std::to_string(k) + " epilogue=" + ep);
  g->algo_ = result.algo;
  *out = std::move(g);
  return nullptr;
}

kiln_status* GemmStep::separate_bias_grad(const artifact::PlanStep& step,
                                          const std::function<const DeviceBuffer*(int)>& buffer_of,
                                          cublasLtHandle_t handle, uint64_t workspace_bytes, int summed,
                                          int64_t trans, int64_t ld, int bias, int64_t len, int64_t k,
                                          const std::string& dtype, int64_t elem_bytes, const std::string& compute) {
  // k ones of the dtype: f32 1.0, or the 16-bit pattern of f16's or bf16's 1.0.
  std::vector<unsigned char> host(static_cast<size_t>(k * elem_bytes));
  for (int64_t i = 0; i < k; ++i) {
    unsigned char* e = host.data() + i * elem_bytes;
    if (elem_bytes == 4) {
      const float one = 1.0f;
      std::memcpy(e, &one, sizeof one);
    } else {
      const uint16_t one = dtype == "bf16" ? 0x3F80 : 0x3C00;
      std::memcpy(e, &one, sizeof one);
    }
  }
  if (cudaMalloc(&ones_, host.size()) != cudaSuccess || cudaMemcpy(ones_, host.data(), host.size(), cudaMemcpyHostToDevice) != cudaSuccess)
    return make_status(KILN_STATUS_OUT_OF_MEMORY, "plan:" + std::to_string(step.line) + ": gemm: no device memory for " +
                                                      std::to_string(k) + " ones of a separate bias gradient");
  ones_buffer_ = std::make_unique<DeviceBuffer>(DeviceBuffer{ones_, host.size(), dtype});
  // The ones take a buffer id no plan uses.
  constexpr int kOnes = std::numeric_limits<int>::max();
  artifact::PlanStep s;
  s.line = step.line;
  s.attrs = {{"a", "b" + std::to_string(kOnes)}, {"b", "b" + std::to_string(summed)}, {"d", "b" + std::to_string(bias)},
             {"m", "1"}, {"n", std::to_string(len)}, {"k", std::to_string(k)}, {"trans_a", "0"},
             {"trans_b", std::to_string(trans)}, {"ldb", std::to_string(ld)}, {"dtype", dtype}, {"compute", compute}};
  const DeviceBuffer* ones = ones_buffer_.get();
  return create(s, [&](int id) { return id == kOnes ? ones : buffer_of(id); }, handle, workspace_bytes, &bias_step_);
}

kiln_status* GemmStep::run(cublasLtHandle_t handle, void* workspace, uint64_t workspace_bytes,
                           cudaStream_t stream) const {
  KILN_RT_TRY(enqueue(handle, algo_, workspace, workspace_bytes, stream));
  return bias_step_ ? bias_step_->run(handle, workspace, workspace_bytes, stream) : nullptr;
}

kiln_status* GemmStep::enqueue(cublasLtHandle_t handle, const cublasLtMatmulAlgo_t& algo, void* workspace,
                               uint64_t workspace_bytes, cudaStream_t stream) const {
  KILN_CUBLAS_TRY(cublasLtMatmul(handle, desc_, &alpha_, a_, layout_a_, b_, layout_b_, &beta_, c_,
                                 layout_c_, d_, layout_d_, &algo, workspace, workspace_bytes,
                                 stream));
  return nullptr;
}

kiln_status* GemmStep::tune(cublasLtHandle_t handle, void* workspace, uint64_t workspace_bytes, cudaStream_t stream,
                            int max_candidates, int iterations, TuneOutcome* out) const {
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(std::max(max_candidates, 1)));
  int found = 0;
  KILN_CUBLAS_TRY(cublasLtMatmulAlgoGetHeuristic(handle, desc_, layout_a_, layout_b_, layout_c_, layout_d_, pref_,
                                                 static_cast<int>(results.size()), results.data(), &found));
  *out = {};
  double best = 0;
  for (int i = 0; i < found; ++i) {
    const cublasLtMatmulHeuristicResult_t& r = results[static_cast<size_t>(i)];
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > workspace_bytes) continue;
    double ms = 0;
    // A candidate cuBLASLt lists but cannot launch here is skipped, not an error.
    if (kiln_status* st = median_launch_ms(stream, iterations, [&] {
          return enqueue(handle, r.algo, workspace, workspace_bytes, stream);
        }, &ms)) {
      kiln_status_release(st);
      (void)cudaStreamSynchronize(stream);
      (void)cudaGetLastError();
      continue;
    }
    if (i == 0) out->heuristic_ms = ms;
    if (out->candidates++ == 0 || ms < best) {
      best = ms;
      out->choice = "algo=" + algo_hex(r.algo);
    }
  }
  out->best_ms = best;
  if (out->heuristic_ms == 0) out->heuristic_ms = best;  // the first result failed: no baseline
  return nullptr;
}

}  // namespace kiln::rt
