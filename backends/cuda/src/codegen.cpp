// Spelling Kiln dtypes, literals and index arithmetic as CUDA C++.
#include "codegen.h"

#include <cmath>
#include <cstdio>
#include <limits>

namespace kiln::cuda {

std::optional<std::string> storage_type(DType t) {
  switch (t) {
    case DType::kF64: return "double";
    case DType::kF32: return "float";
    case DType::kF16: return "__half";
    case DType::kBF16: return "__nv_bfloat16";
    case DType::kF8E4M3FN:
    case DType::kF8E5M2:
    case DType::kU8: return "unsigned char";
    case DType::kI64: return "long long";
    case DType::kI32: return "int";
    case DType::kI16: return "short";
    case DType::kI8: return "signed char";
    case DType::kBool: return "bool";
    case DType::kI4: return std::nullopt;
  }
  return std::nullopt;
}

std::optional<std::string> reg_type(DType t) {
  switch (t) {
    case DType::kF64: return "double";
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16: return "float";
    case DType::kI64:
    case DType::kI32:
    case DType::kI16:
    case DType::kI8:
    case DType::kU8: return "long long";
    case DType::kBool: return "bool";
    default: return std::nullopt;
  }
}

std::string load_expr(DType t, const std::string& e) {
  if (t == DType::kF16) return "__half2float(" + e + ")";
  if (t == DType::kBF16) return "__bfloat162float(" + e + ")";
  if (is_integer(t)) return "(long long)(" + e + ")";
  return e;
}

std::string store_expr(DType t, const std::string& e) {
  if (t == DType::kF16) return "__float2half_rn(" + e + ")";
  // f8 (a quantize ending a fused group): saturating, as the quantize kernel; needs cuda_fp8.h.
  if (t == DType::kF8E4M3FN || t == DType::kF8E5M2)
    return "(unsigned char)__nv_cvt_float_to_fp8(" + e + ", __NV_SATFINITE, " +
           (t == DType::kF8E4M3FN ? "__NV_E4M3" : "__NV_E5M2") + ")";
  if (t == DType::kBF16) return "__float2bfloat16_rn(" + e + ")";
  return "(" + *storage_type(t) + ")(" + e + ")";
}

std::string round_expr(DType t, const std::string& e) {
  if (t == DType::kF16) return "__half2float(__float2half_rn(" + e + "))";
  if (t == DType::kBF16) return "__bfloat162float(__float2bfloat16_rn(" + e + "))";
  if (is_integer(t) && t != DType::kI64) return "(long long)(" + *storage_type(t) + ")(" + e + ")";
  return e;
}

std::string quantize_quotient(DType xt, const std::string& x, const std::string& scale) {
  return (xt == DType::kF64 ? "(float)(" + x + ")" : x) + " / " + scale;
}

std::string int_literal(int64_t v) {
  if (v == std::numeric_limits<int64_t>::min()) return "(-9223372036854775807LL - 1)";
  return std::to_string(v) + "LL";
}

std::string literal(DType t, double v) {
  if (t == DType::kBool) return v != 0 ? "true" : "false";
  if (is_integer(t)) return int_literal(static_cast<int64_t>(v));
  const bool dbl = t == DType::kF64;
  if (std::isnan(v)) return dbl ? "__longlong_as_double(0x7ff8000000000000LL)" : "__int_as_float(0x7fc00000)";
  if (std::isinf(v)) {
    const std::string inf = dbl ? "__longlong_as_double(0x7ff0000000000000LL)" : "__int_as_float(0x7f800000)";
    return v < 0 ? "(-" + inf + ")" : inf;
  }
  char buf[40];
  std::snprintf(buf, sizeof buf, dbl ? "%.17g" : "%.9g", v);
  std::string s = buf;
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return "(" + s + (dbl ? "" : "f") + ")";
}

std::string vector_type(int64_t bytes) {
  switch (bytes) {
    case 1: return "unsigned char";
    case 2: return "unsigned short";
    case 4: return "unsigned";
    case 8: return "uint2";
    default: return "uint4";
  }
}

int64_t product(const Sizes& s) {
  int64_t p = 1;
  for (int64_t v : s) p *= v;
  return p;
}

Sizes contiguous_strides(const Sizes& s) {
  Sizes st(s.size(), 1);
  for (size_t d = s.size(); d-- > 1;) st[d - 1] = st[d] * s[d];
  return st;
}

std::string dims_text(const Sizes& s) {
  if (s.empty()) return "scalar";
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "x" : "") + std::to_string(s[i]);
  return out;
}

std::string index_code(const std::string& idx, const Sizes& dims, const std::vector<Sizes>& strides,
                       const std::vector<std::string>& names, const Sizes& bases) {
  std::string code = "long long ";
  for (size_t k = 0; k < names.size(); ++k)
    code += (k ? ", " : "") + names[k] + " = " + int_literal(bases.empty() ? 0 : bases[k]);
  code += ";\n";
  // 64-bit division is emulated in dozens of instructions; 32-bit unsigned is a few, so
  // index spaces that fit take it (the offsets stay 64-bit).
  const bool narrow = product(dims) <= int64_t{0xffffffff};
  code += narrow ? "{ unsigned r_ = (unsigned)(" + idx + "), c_ = 0; (void)c_;\n"
                 : "{ long long r_ = " + idx + ", c_ = 0; (void)c_;\n";
  for (size_t d = dims.size(); d-- > 0;) {
    bool used = false;
    for (const Sizes& s : strides) used |= s[d] != 0;
    if (dims[d] == 1) continue;
    const std::string dim = narrow ? std::to_string(dims[d]) + "u" : int_literal(dims[d]);
    code += d == 0 ? "  c_ = r_;" : "  c_ = r_ % " + dim + "; r_ /= " + dim + ";";
    if (used)
      for (size_t k = 0; k < names.size(); ++k)
        if (strides[k][d] != 0) code += " " + names[k] + " += c_ * " + int_literal(strides[k][d]) + ";";
    code += "\n";
  }
  return code + "}\n";
}

Sizes broadcast_strides(const Sizes& in, const Sizes& out) {
  const Sizes cs = contiguous_strides(in);
  Sizes st(out.size(), 0);
  const size_t lead = out.size() - in.size();
  for (size_t d = 0; d < in.size(); ++d)
    st[lead + d] = (in[d] == 1 && out[lead + d] != 1) ? 0 : cs[d];
  return st;
}

std::string prelude(bool fp16, bool bf16) {
  std::string s = "// generated by kiln's cuda lowering; every kernel is extern \"C\"\n";
  if (fp16) s += "#include <cuda_fp16.h>\n";
  if (bf16) s += "#include <cuda_bf16.h>\n";
  s += R"(
// Float to int64 as the reference does: truncation, nan to 0, saturation at the range ends.
__device__ __forceinline__ long long kiln_f2i(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775808.0) return 9223372036854775807LL;
  if (v < -9223372036854775808.0) return -9223372036854775807LL - 1;
  return (long long)v;
}
__device__ __forceinline__ float kiln_pymod(float a, float b) {
  float r = fmodf(a, b);
  if (r == 0) return copysignf(0.0f, b);
  return ((r < 0) != (b < 0)) ? r + b : r;
}
__device__ __forceinline__ double kiln_pymod(double a, double b) {
  double r = fmod(a, b);
  if (r == 0) return copysign(0.0, b);
  return ((r < 0) != (b < 0)) ? r + b : r;
}
// Integer division and remainder cannot fail on the device: by zero they give 0.
__device__ __forceinline__ long long kiln_idiv(long long a, long long b) {
  if (b == 0) return 0;
  return b == -1 ? (long long)(0ULL - (unsigned long long)a) : a / b;
}
__device__ __forceinline__ long long kiln_imod(long long a, long long b, bool floor_mod) {
  if (b == 0) return 0;
  long long o = b == -1 ? 0 : a % b;
  if (floor_mod && o != 0 && ((o < 0) != (b < 0))) o += b;
  return o;
}
__device__ __forceinline__ long long kiln_ipow(long long a, long long b) {
  if (b < 0) return 0;
  unsigned long long o = 1, x = (unsigned long long)a;
  for (; b > 0; b >>= 1, x *= x)
    if (b & 1) o *= x;
  return (long long)o;
}
// Reduces one value per thread over the block (a multiple of 32 threads, at most 1024).
template <class T, class F>
__device__ __forceinline__ T kiln_block_reduce(T v, T identity, F f) {
  __shared__ T part[33];
  for (int o = 16; o > 0; o >>= 1) v = f(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? part[lane] : identity;
    for (int o = 16; o > 0; o >>= 1) v = f(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) part[32] = v;
  }
  __syncthreads();
  return part[32];
}
// Block-wide arg reduction: better(cv, ci, bv, bi) says whether (cv, ci) replaces (bv, bi);
// an index of -1 means "nothing yet".
template <class T, class B>
__device__ __forceinline__ void kiln_block_argreduce(T& v, long long& i, B better) {
  __shared__ T pv[33];
  __shared__ long long pi[33];
  for (int o = 16; o > 0; o >>= 1) {
    T ov = __shfl_xor_sync(0xffffffffu, v, o);
    long long oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) { v = ov; i = oi; }
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) { pv[warp] = v; pi[warp] = i; }
  __syncthreads();
  if (warp == 0) {
    v = pv[0]; i = -1;
    if (lane < (int)(blockDim.x >> 5)) { v = pv[lane]; i = pi[lane]; }
    for (int o = 16; o > 0; o >>= 1) {
      T ov = __shfl_xor_sync(0xffffffffu, v, o);
      long long oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    if (lane == 0) { pv[32] = v; pi[32] = i; }
  }
  __syncthreads();
  v = pv[32]; i = pi[32];
}
)";
  return s;
}

}  // namespace kiln::cuda
