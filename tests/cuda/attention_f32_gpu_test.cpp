// GPU check of the register-tiled f32 attention kernel (attention_f32.cpp), launched directly:
// head dims 32/64/128, causal and not, grouped-query heads, Sq != Skv (both ways), odd lengths,
// broadcast masks of each dtype, a fully masked row, [B, S, H, D] and packed [B, S, 3, H, D]
// inputs with a padded [B, S, H, Dv] output, against softmax(QKᵀ·scale + mask)·V in double.
// Then times GPT-2 small's attention (B 16, H 12, S 512, D 64, causal). Exits 77 without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../backends/cuda/src/attention_f32.h"
#include "gpu_test_util.h"
#include "kiln/cuda/nvrtc.h"

namespace {

using namespace kiln;

/// Kernel arguments passed as one struct (same layout on both sides): q, k, v, mask, y, sizes,
/// scale·log2 e and the 16 strides in the device function's order.
struct Args {
  const float* q;
  const float* k;
  const float* v;
  const void* m;
  float* y;
  int hq, hkv, sq, skv;
  float scale_log2;
  long long st[16];
};

const char* kArgs = R"(
struct KilnF32TestArgs {
  const float* q; const float* k; const float* v; const void* m; float* y;
  int hq, hkv, sq, skv; float scale_log2; long long st[16];
};
)";

enum class Layout { kBHSD, kBSHD, kPacked };  ///< packed: q, k, v interleaved as [B, S, 3, H, D]

struct Case {
  const char* name;
  int b, hq, hkv, sq, skv, d, dv;
  bool causal;
  Layout layout;
  const char* mt;        ///< mask element type ("" for none)
  int mb, mh, mi;        ///< mask dims over B, H, Sq (1 broadcasts); the last is Skv
  int masked_row = -1;   ///< a query row whose mask is -inf everywhere (NaN out)
};

std::string wrapper(const std::string& name, const Case& c) {
  const bool m = *c.mt != 0;
  const std::string mt = m ? c.mt : "float";
  std::string call = "kiln_attn_f32_tiled<" + std::to_string(c.d) + ", " + std::to_string(c.dv) + ", " +
                     (c.causal ? "true" : "false") + ", " + (m ? "true" : "false") + ", " + mt +
                     ">(a.q, a.k, a.v, (const " + mt + "*)a.m, a.y, a.hq, a.hkv, a.sq, a.skv, a.scale_log2";
  for (int i = 0; i < 16; ++i) call += ", a.st[" + std::to_string(i) + "]";
  return "extern \"C\" __global__ void __launch_bounds__(256) " + name + "(KilnF32TestArgs a) {\n  " + call + ");\n}\n";
}

/// Mask values (multiples of 1/16 in [-2, 2] or -inf) exactly representable in every mask type.
void put_mask(std::vector<unsigned char>& out, const std::string& mt, float x) {
  uint32_t f;
  std::memcpy(&f, &x, 4);
  auto push = [&](const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    out.insert(out.end(), c, c + n);
  };
  if (mt == "float") {
    push(&x, 4);
  } else if (mt == "double") {
    const double d = x;
    push(&d, 8);
  } else if (mt == "__nv_bfloat16") {
    const uint16_t h = static_cast<uint16_t>(f >> 16);
    push(&h, 2);
  } else {  // __half: rebias the exponent (exact for these values)
    const uint32_t e = (f >> 23) & 0xff, s = (f >> 31) << 15;
    const uint16_t h = static_cast<uint16_t>(x == 0.f ? s : std::isinf(x) ? s | 0x7c00 : s | (e - 112) << 10 | (f & 0x7fffff) >> 13);
    push(&h, 2);
  }
}

#define CUDA_OK(call)                                                              \
  do {                                                                             \
    if (cudaError_t err_ = (call); err_ != cudaSuccess)                            \
      return std::string(#call) + ": " + cudaGetErrorString(err_);                 \
  } while (0)

struct Problem {
  Case c;
  std::vector<float> in;  ///< q, k, v (separate or packed)
  size_t qo = 0, ko = 0, vo = 0;
  long long qs[3], ks[3], vs[3], ys[3], ms[4] = {0, 0, 0, 0};
  size_t ysize = 0;
  std::vector<float> mask;  ///< as f32, [mb, mh, mi, skv]
  std::vector<unsigned char> mask_bytes;
  double scale = 0;
};

Problem make_problem(const Case& c, uint64_t seed) {
  Problem p;
  p.c = c;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const long long B = c.b, hq = c.hq, hkv = c.hkv, sq = c.sq, skv = c.skv, d = c.d, dv = c.dv;
  if (c.layout == Layout::kPacked) {  // needs hq == hkv, sq == skv, d == dv
    p.in.resize(B * sq * 3 * hq * d);
    p.ko = hq * d;
    p.vo = 2 * hq * d;
    for (long long* s : {p.qs, p.ks, p.vs}) s[0] = sq * 3 * hq * d, s[1] = d, s[2] = 3 * hq * d;
  } else {
    const bool bshd = c.layout == Layout::kBSHD;
    auto set = [&](long long* s, long long h, long long n, long long w) {
      s[0] = h * n * w;
      s[1] = bshd ? w : n * w;
      s[2] = bshd ? h * w : w;
    };
    set(p.qs, hq, sq, d);
    set(p.ks, hkv, skv, d);
    set(p.vs, hkv, skv, dv);
    p.ko = B * hq * sq * d;
    p.vo = p.ko + B * hkv * skv * d;
    p.in.resize(p.vo + B * hkv * skv * dv);
  }
  for (float& x : p.in) x = u(rng);
  if (c.layout == Layout::kBHSD) {
    p.ys[0] = hq * sq * dv, p.ys[1] = sq * dv, p.ys[2] = dv;
  } else {  // [B, S, H, Dv] with each row padded by 4 floats the kernel must not touch
    p.ys[2] = hq * dv + 4, p.ys[1] = dv, p.ys[0] = sq * p.ys[2];
  }
  p.ysize = B * p.ys[0];
  if (*c.mt) {
    const long long n = c.mb * c.mh * c.mi * skv;
    p.ms[3] = 1;
    p.ms[2] = c.mi == 1 ? 0 : skv;
    p.ms[1] = c.mh == 1 ? 0 : c.mi * skv;
    p.ms[0] = c.mb == 1 ? 0 : c.mh * c.mi * skv;
    std::uniform_int_distribution<int> sixteenths(-32, 32);
    p.mask.resize(n);
    for (long long i = 0; i < n; ++i) {
      const long long row = (i / skv) % c.mi;
      p.mask[i] = row == c.masked_row ? -std::numeric_limits<float>::infinity() : sixteenths(rng) / 16.f;
    }
    for (float x : p.mask) put_mask(p.mask_bytes, c.mt, x);
  }
  p.scale = 1.0 / std::sqrt(static_cast<double>(d));
  return p;
}

/// softmax(QKᵀ·scale + mask)·V in double, [B, Hq, Sq, Dv]; NaN for a row that sees no key.
std::vector<double> reference(const Problem& p) {
  const Case& c = p.c;
  std::vector<double> out(static_cast<size_t>(c.b) * c.hq * c.sq * c.dv);
  std::vector<double> s(c.skv);
  const int off = c.skv - c.sq;
  for (int b = 0; b < c.b; ++b)
    for (int h = 0; h < c.hq; ++h) {
      const int hk = h / (c.hq / c.hkv);
      for (int i = 0; i < c.sq; ++i) {
        const float* qr = &p.in[p.qo + b * p.qs[0] + h * p.qs[1] + i * p.qs[2]];
        double mx = -INFINITY;
        for (int j = 0; j < c.skv; ++j) {
          const float* kr = &p.in[p.ko + b * p.ks[0] + hk * p.ks[1] + j * p.ks[2]];
          double x = 0;
          for (int t = 0; t < c.d; ++t) x += static_cast<double>(qr[t]) * kr[t];
          x *= p.scale;
          if (*c.mt) x += p.mask[b * p.ms[0] + h * p.ms[1] + i * p.ms[2] + j];
          if (c.causal && j > i + off) x = -INFINITY;
          s[j] = x;
          mx = std::max(mx, x);
        }
        double* o = &out[((static_cast<size_t>(b) * c.hq + h) * c.sq + i) * c.dv];
        if (mx == -INFINITY) {
          for (int t = 0; t < c.dv; ++t) o[t] = NAN;
          continue;
        }
        double sum = 0;
        for (int j = 0; j < c.skv; ++j) sum += s[j] = std::exp(s[j] - mx);
        for (int j = 0; j < c.skv; ++j) {
          const float* vr = &p.in[p.vo + b * p.vs[0] + hk * p.vs[1] + j * p.vs[2]];
          for (int t = 0; t < c.dv; ++t) o[t] += s[j] / sum * vr[t];
        }
      }
    }
  return out;
}

/// Device copies of a problem's inputs and output, and the kernel arguments pointing at them.
struct DeviceProblem {
  float* in = nullptr;
  float* y = nullptr;
  void* m = nullptr;
  Args a{};
  ~DeviceProblem() {
    cudaFree(in);
    cudaFree(y);
    cudaFree(m);
  }
};

constexpr float kSentinel = 12345.f;

std::string upload(const Problem& p, DeviceProblem& dp) {
  CUDA_OK(cudaMalloc(&dp.in, p.in.size() * 4));
  CUDA_OK(cudaMemcpy(dp.in, p.in.data(), p.in.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMalloc(&dp.y, p.ysize * 4));
  const std::vector<float> fill(p.ysize, kSentinel);
  CUDA_OK(cudaMemcpy(dp.y, fill.data(), p.ysize * 4, cudaMemcpyHostToDevice));
  if (!p.mask_bytes.empty()) {
    CUDA_OK(cudaMalloc(&dp.m, p.mask_bytes.size()));
    CUDA_OK(cudaMemcpy(dp.m, p.mask_bytes.data(), p.mask_bytes.size(), cudaMemcpyHostToDevice));
  }
  const Case& c = p.c;
  dp.a = Args{dp.in + p.qo, dp.in + p.ko, dp.in + p.vo, dp.m, dp.y, c.hq, c.hkv, c.sq, c.skv,
              static_cast<float>(p.scale * 1.4426950408889634), {}};
  const long long* groups[4] = {p.qs, p.ks, p.vs, p.ys};
  for (int g = 0; g < 4; ++g)
    for (int i = 0; i < 3; ++i) dp.a.st[3 * g + i] = groups[g][i];
  for (int i = 0; i < 4; ++i) dp.a.st[12 + i] = p.ms[i];
  return "";
}

std::string launch(cudaKernel_t k, const Case& c, Args& a, cudaStream_t stream = nullptr) {
  const int64_t rows = cuda::detail::kF32AttentionRows;
  const dim3 grid(static_cast<unsigned>((c.sq + rows - 1) / rows), c.hq, c.b);
  void* params[] = {&a};
  CUDA_OK(cudaLaunchKernel(reinterpret_cast<const void*>(k), grid, dim3(cuda::detail::kF32AttentionThreads), params,
                           cuda::detail::f32_attention_smem_bytes(c.d, c.dv), stream));
  return "";
}

/// Runs one case; "" when every output element is within tolerance and the padding untouched.
std::string run_case(cudaKernel_t k, const Case& c, uint64_t seed) {
  const Problem p = make_problem(c, seed);
  DeviceProblem dp;
  if (std::string e = upload(p, dp); !e.empty()) return e;
  if (std::string e = launch(k, c, dp.a); !e.empty()) return e;
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got(p.ysize);
  CUDA_OK(cudaMemcpy(got.data(), dp.y, p.ysize * 4, cudaMemcpyDeviceToHost));
  const std::vector<double> want = reference(p);
  // The kernel sums the D products and the Skv weighted values in another order than the
  // reference, with exp2f (2 ulp) and per-tile rescaling: errors grow like sqrt(n)·eps of the
  // summed magnitudes, not of the result, so PyTorch's same-order f32 defaults are too tight.
  // Rows with no visible key are NaN in the reference and must be NaN here (equal_nan).
  const test::Tolerance tol{1e-4, 1e-5};
  std::vector<char> written(p.ysize, 0);
  std::vector<float> dense(want.size());  // y in want's [B, H, Sq, Dv] order
  for (int b = 0; b < c.b; ++b)
    for (int h = 0; h < c.hq; ++h)
      for (int i = 0; i < c.sq; ++i)
        for (int t = 0; t < c.dv; ++t) {
          const size_t at = b * p.ys[0] + h * p.ys[1] + i * p.ys[2] + t;
          written[at] = 1;
          dense[((static_cast<size_t>(b) * c.hq + h) * c.sq + i) * c.dv + t] = got[at];
        }
  if (const test::Verdict v = test::allclose(want, dense, tol, /*equal_nan=*/true); !v.ok()) {
    const int64_t col = v.first % c.dv, row = v.first / c.dv % c.sq,
                  h = v.first / c.dv / c.sq % c.hq, b = v.first / c.dv / c.sq / c.hq;
    return "y[b " + std::to_string(b) + ", h " + std::to_string(h) + ", row " +
           std::to_string(row) + ", col " + std::to_string(col) + "]: " + v.why;
  }
  for (size_t i = 0; i < p.ysize; ++i)
    if (!written[i] && got[i] != kSentinel) return "wrote padding element " + std::to_string(i);
  return "";
}

/// GPT-2 small's attention per layer: q, k, v read from the packed c_attn output, y [B, S, H, D].
std::string time_case(cudaKernel_t k, const Case& c, double* tflops) {
  const Problem p = make_problem(c, 7);
  DeviceProblem dp;
  if (std::string e = upload(p, dp); !e.empty()) return e;
  for (int i = 0; i < 5; ++i)
    if (std::string e = launch(k, c, dp.a); !e.empty()) return e;
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  const int iters = 50;
  CUDA_OK(cudaEventRecord(start));
  for (int i = 0; i < iters; ++i)
    if (std::string e = launch(k, c, dp.a); !e.empty()) return e;
  CUDA_OK(cudaEventRecord(stop));
  CUDA_OK(cudaEventSynchronize(stop));
  float ms = 0;
  CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  ms /= iters;
  // 2 GEMMs of 2·Sq·Skv·D flops each; causal counts the visible half.
  const double flops = 4.0 * c.b * c.hq * c.sq * c.skv * c.d * (c.causal ? 0.5 : 1.0);
  *tflops = flops / (ms * 1e-3) / 1e12;
  std::printf("TIME %s: %.4f ms, %.1f TFLOP/s\n", c.name, ms, *tflops);
  return "";
}

}  // namespace

int main() {
  if (int rc = start_gpu_test(); rc != 0) return rc;
  const Layout bhsd = Layout::kBHSD, bshd = Layout::kBSHD, packed = Layout::kPacked;
  const std::vector<Case> cases = {
      {"d32 65x65", 2, 3, 3, 65, 65, 32, 32, false, bhsd, "", 1, 1, 1},
      {"d64 causal 130x130", 2, 4, 4, 130, 130, 64, 64, true, bhsd, "", 1, 1, 1},
      {"d128 causal gqa 63x63", 1, 8, 2, 63, 63, 128, 128, true, bhsd, "", 1, 1, 1},
      {"d128 1x130", 2, 2, 1, 1, 130, 128, 128, false, bshd, "", 1, 1, 1},
      {"d64 causal 1x1", 1, 1, 1, 1, 1, 64, 64, true, bhsd, "", 1, 1, 1},
      {"d64 causal 65x130 (offset)", 1, 2, 2, 65, 130, 64, 64, true, bshd, "", 1, 1, 1},
      {"d64 causal 130x65 (rows with no key: NaN)", 1, 2, 1, 130, 65, 64, 64, true, bhsd, "", 1, 1, 1},
      {"d64 f32 mask [1,1,63,65], row 3 fully masked", 2, 2, 2, 63, 65, 64, 64, false, bhsd, "float", 1, 1, 63, 3},
      {"d64 causal gqa f16 key-padding mask [B,1,1,130]", 2, 4, 2, 130, 130, 64, 64, true, bshd, "__half", 2, 1, 1},
      {"d128 causal bf16 mask [1,H,77,77]", 1, 3, 3, 77, 77, 128, 128, true, bhsd, "__nv_bfloat16", 1, 3, 77},
      {"d32 f64 mask [B,H,65,200]", 2, 2, 1, 65, 200, 32, 32, false, bshd, "double", 2, 2, 65},
      {"d64 dv32 65x200", 1, 2, 2, 65, 200, 64, 32, false, bshd, "", 1, 1, 1},
      {"d64 causal packed qkv 130", 2, 3, 3, 130, 130, 64, 64, true, packed, "", 1, 1, 1},
      {"d64 causal packed qkv 512", 1, 2, 2, 512, 512, 64, 64, true, packed, "", 1, 1, 1},
  };
  const std::vector<Case> timed = {
      {"gpt2 b16 h12 s512 d64 causal", 16, 12, 12, 512, 512, 64, 64, true, packed, "", 1, 1, 1},
      {"b16 h12 s512 d64 non-causal", 16, 12, 12, 512, 512, 64, 64, false, packed, "", 1, 1, 1},
      {"b8 h16 s1024 d128 causal", 8, 16, 16, 1024, 1024, 128, 128, true, packed, "", 1, 1, 1},
  };
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return report_case("device properties", "query failed");
  const std::string target = "sm_" + std::to_string(prop.major * 10 + prop.minor);
  std::string src = std::string(cuda::detail::f32_attention_source()) + kArgs;
  for (size_t i = 0; i < cases.size(); ++i) src += wrapper("c" + std::to_string(i), cases[i]);
  for (size_t i = 0; i < timed.size(); ++i) src += wrapper("t" + std::to_string(i), timed[i]);
  auto image = cuda::compile_cuda(src, target, "attention_f32_gpu_test");
  if (!image.ok()) return report_case("compile", image.status().message());
  cudaLibrary_t lib = nullptr;
  if (cudaError_t e = cudaLibraryLoadData(&lib, image->data(), nullptr, nullptr, 0, nullptr, nullptr, 0); e != cudaSuccess)
    return report_case("load", cudaGetErrorString(e));
  auto kernel = [&](const std::string& name, const Case& c, cudaKernel_t* k) -> std::string {
    CUDA_OK(cudaLibraryGetKernel(k, lib, name.c_str()));
    CUDA_OK(cudaFuncSetAttribute(reinterpret_cast<const void*>(*k), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(cuda::detail::f32_attention_smem_bytes(c.d, c.dv))));
    return "";
  };
  int failures = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    cudaKernel_t k = nullptr;
    std::string why = kernel("c" + std::to_string(i), cases[i], &k);
    if (why.empty()) why = run_case(k, cases[i], 100 + i);
    failures += report_case(cases[i].name, why);
  }
  for (size_t i = 0; i < timed.size(); ++i) {
    cudaKernel_t k = nullptr;
    double tflops = 0;
    std::string why = kernel("t" + std::to_string(i), timed[i], &k);
    if (why.empty()) why = time_case(k, timed[i], &tflops);
    failures += report_case(std::string("timing ") + timed[i].name, why);
  }
  cudaLibraryUnload(lib);
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
