// Native kernels of the cpu backend: the thread pool, OpenBLAS contractions (matmul, linear,
// im2col conv), pooling, row kernels (softmax, norms, reductions) and data movement.
#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>

#include "cpu.h"
#include "kiln/ir/op.h"

#if defined(__x86_64__) && defined(__GNUC__)
/// Compiled for AVX-512, AVX2 and the baseline, picked at load time (the plugin is built
/// for the baseline ISA so that it runs anywhere).
#define KILN_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KILN_CPU_CLONES
#endif

namespace kiln::cpu {
namespace {

int64_t product(const Sizes& v, size_t from = 0, size_t to = SIZE_MAX) {
  int64_t p = 1;
  for (size_t i = from; i < std::min(to, v.size()); ++i) p *= v[i];
  return p;
}

Sizes contiguous_strides(const Sizes& s) {
  Sizes st(s.size(), 1);
  for (size_t i = s.size(); i-- > 1;) st[i - 1] = st[i] * s[i];
  return st;
}

bool is_f32(const Tensor& t) { return t.dtype() == DType::kF32; }

/// Bytes per element, or 0 for i4 (packed: the reference kernel handles it).
size_t elem_size(DType t) { return dtype_bits(t) % 8 == 0 ? static_cast<size_t>(dtype_bits(t) / 8) : 0; }

int64_t norm_axis(int64_t axis, int64_t rank) { return axis < 0 ? axis + rank : axis; }

/// dst[i] = src[base + sum(index_d(i) * strides[d])] over the row-major index of `shape`
/// (strides in elements, may be zero or negative). Rows of the last dim are split across
/// threads; unit-stride rows are one memcpy.
void strided_copy(ThreadPool& tp, size_t es, const std::byte* src, std::byte* dst, Sizes shape,
                  Sizes strides, int64_t base) {
  // Merge dims that walk the source contiguously with their inner neighbour.
  Sizes s, st;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    if (!s.empty() && st.back() == strides[d] * shape[d]) {
      s.back() *= shape[d];
      st.back() = strides[d];
    } else {
      s.push_back(shape[d]);
      st.push_back(strides[d]);
    }
  }
  if (s.empty()) s = {1}, st = {1};
  const int64_t cols = s.back(), inner = st.back();
  const int64_t rows = product(s) / std::max<int64_t>(cols, 1);
  if (cols == 0 || rows == 0) return;
  tp.parallel_for(rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      int64_t off = base, rem = r;
      for (size_t d = s.size() - 1; d-- > 0;) {
        off += (rem % s[d]) * st[d];
        rem /= s[d];
      }
      std::byte* out = dst + static_cast<size_t>(r * cols) * es;
      const std::byte* in = src + off * static_cast<int64_t>(es);
      if (inner == 1) {
        std::memcpy(out, in, static_cast<size_t>(cols) * es);
        continue;
      }
      const int64_t step = inner * static_cast<int64_t>(es);
      switch (es) {
        case 1: for (int64_t c = 0; c < cols; ++c) out[c] = in[c * step]; break;
        case 2: for (int64_t c = 0; c < cols; ++c) std::memcpy(out + 2 * c, in + c * step, 2); break;
        case 4: for (int64_t c = 0; c < cols; ++c) std::memcpy(out + 4 * c, in + c * step, 4); break;
        default:
          for (int64_t c = 0; c < cols; ++c) std::memcpy(out + es * static_cast<size_t>(c), in + c * step, es);
      }
    }
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------
// thread pool

namespace {

/// Spin-wait hint; ~100 cycles on recent x86.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/// How long an idle worker polls for the next job before sleeping (~0.1 ms).
constexpr int kSpinRounds = 2000;

}  // namespace

ThreadPool::ThreadPool(int threads) : threads_(std::max(1, threads)) {
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run_chunks(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t chunks) {
  for (int64_t c; (c = next_.fetch_add(1, std::memory_order_relaxed)) < chunks;)
    fn(n * c / chunks, n * (c + 1) / chunks);
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t chunks =
      std::min<int64_t>((n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1),
                        static_cast<int64_t>(threads_) * 4);
  if (threads_ == 1 || chunks <= 1) {
    fn(0, n);
    return;
  }
  {
    // Published under the lock so that a worker about to sleep sees the new generation.
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    n_ = n;
    chunks_ = chunks;
    next_.store(0, std::memory_order_relaxed);
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  run_chunks(fn, n, chunks);
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < kSpinRounds) cpu_relax();
    else std::this_thread::yield();  // a worker lost its core: let it run
  }
  job_ = nullptr;
}

void ThreadPool::worker(int) {
  uint64_t seen = 0;
  for (;;) {
    for (int i = 0; i < kSpinRounds && generation_.load(std::memory_order_acquire) == seen && !stop_; ++i)
      cpu_relax();
    if (generation_.load(std::memory_order_acquire) == seen && !stop_) {
      std::unique_lock<std::mutex> lk(mu_);
      wake_.wait(lk, [&] { return stop_ || generation_.load(std::memory_order_acquire) != seen; });
    }
    if (stop_) return;
    seen = generation_.load(std::memory_order_acquire);
    run_chunks(*job_, n_, chunks_);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

// ---------------------------------------------------------------------------------------
// OpenBLAS, loaded at run time

namespace {

/// The OpenBLAS entry points the kernels use, resolved with dlsym.
struct Blas {
  decltype(&cblas_sgemm) sgemm = nullptr;
  decltype(&cblas_sgemv) sgemv = nullptr;
  void (*set_threads)(int) = nullptr;
  char* (*corename)() = nullptr;
};

/// The OpenBLAS kernel family for the host when OpenBLAS's own detection may not know it.
/// OpenBLAS 0.3.21 (Debian 12) sees a Sapphire Rapids guest ("Intel Xeon Processor") as a
/// Prescott and runs SSE3 kernels, ~10x slower than its AVX-512 ones.
const char* host_coretype() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return nullptr;
}

const Blas& blas() {
  static Blas b;
  static std::once_flag once;
  std::call_once(once, [] {
    // OpenBLAS picks its kernels once, in its library constructor, from $OPENBLAS_CORETYPE
    // or CPUID; hence it is loaded here rather than linked. A user's setting wins.
    const char* names[] = {KILN_OPENBLAS_PATH, "libopenblas.so.0"};
    void* h = nullptr;
    for (const char* n : names)
      if ((h = dlopen(n, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD))) break;
    if (!h) {
      if (const char* ct = host_coretype()) setenv("OPENBLAS_CORETYPE", ct, 0);
      for (const char* n : names)
        if ((h = dlopen(n, RTLD_NOW | RTLD_LOCAL))) break;
    }
    if (!h) return;
    b.sgemm = reinterpret_cast<decltype(b.sgemm)>(dlsym(h, "cblas_sgemm"));
    b.sgemv = reinterpret_cast<decltype(b.sgemv)>(dlsym(h, "cblas_sgemv"));
    b.set_threads = reinterpret_cast<decltype(b.set_threads)>(dlsym(h, "openblas_set_num_threads"));
    b.corename = reinterpret_cast<decltype(b.corename)>(dlsym(h, "openblas_get_corename"));
    if (!b.sgemv || !b.set_threads) b.sgemm = nullptr;
    // The pool splits contractions itself (one single-threaded call per worker): OpenBLAS's
    // own threads spin after each call and would compete with the pool's next step.
    if (b.sgemm) b.set_threads(1);
  });
  return b;
}

/// y[m, n] = a[m, k] · op(b) + beta · y, where op(b) is b[k, n] or (trans_b) b[n, k]ᵀ, split
/// over the pool along n (or m when n is narrow); each worker makes one single-threaded call.
void gemm(ThreadPool& tp, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* y, int64_t ldy) {
  const Blas& bl = blas();
  auto call = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    const float* bp = b + (trans_b ? n0 * ldb : n0);
    if (m1 - m0 == 1)  // a vector times a matrix: gemv streams the weights once
      bl.sgemv(CblasRowMajor, trans_b ? CblasNoTrans : CblasTrans, static_cast<int>(trans_b ? n1 - n0 : k),
               static_cast<int>(trans_b ? k : n1 - n0), 1.0f, bp, static_cast<int>(ldb), a + m0 * lda, 1,
               beta, y + m0 * ldy + n0, 1);
    else
      bl.sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m1 - m0),
               static_cast<int>(n1 - n0), static_cast<int>(k), 1.0f, a + m0 * lda, static_cast<int>(lda), bp,
               static_cast<int>(ldb), beta, y + m0 * ldy + n0, static_cast<int>(ldy));
  };
  const int64_t t = tp.threads();
  // Below ~64k multiply-adds the wake-up of a worker costs more than it saves. (Row vectors
  // too: splitting the MLP's 512x512 gemv halves its time, each core streaming half the weights.)
  if (t == 1 || m * n * k < (int64_t{1} << 16)) return call(0, m, 0, n);
  if (n >= 16 * t || n >= m) {
    const int64_t blocks = (n + 15) / 16;  // whole 16-column panels per worker
    tp.parallel_for(blocks, std::max<int64_t>(1, blocks / t), [&](int64_t b0, int64_t b1) {
      call(0, m, b0 * 16, std::min(n, b1 * 16));
    });
  } else {
    tp.parallel_for(m, std::max<int64_t>(1, m / t), [&](int64_t m0, int64_t m1) { call(m0, m1, 0, n); });
  }
}

}  // namespace

bool have_blas() { return blas().sgemm != nullptr; }

std::string blas_description() {
  const Blas& b = blas();
  return b.sgemm ? std::string("OpenBLAS ") + (b.corename ? b.corename() : "") : "none (OpenBLAS not found)";
}

// ---------------------------------------------------------------------------------------
// contractions

namespace {

/// A bf16 tensor's values as f32 (exact).
Tensor bf16_to_f32(ThreadPool& tp, const Tensor& t) {
  Tensor f(DType::kF32, t.shape());
  const auto* src = t.data_as<uint16_t>();
  auto* dst = f.mutable_data_as<uint32_t>();
  tp.parallel_for(t.numel(), 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = static_cast<uint32_t>(src[i]) << 16;
  });
  return f;
}

/// f32 results rounded to nearest even into the bf16 result (inf past bf16's range, as a cast).
void f32_to_bf16(ThreadPool& tp, const Tensor& f, Tensor& y) {
  const auto* src = f.data_as<uint32_t>();
  auto* dst = out_as<uint16_t>(y);
  tp.parallel_for(f.numel(), 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const uint32_t u = src[i];
      dst[i] = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)  // quiet nan
                                               : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  });
}

bool is_bf16(const Tensor& t) { return t.dtype() == DType::kBF16; }

}  // namespace

bool run_matmul_acc(ThreadPool& tp, const Tensor& a, const Tensor& b, const Tensor& c, Tensor& y) {
  // c + a @ b into an f32 sum (accumulate-gemm's gradient sums): bf16 operands widen exactly.
  if (!is_f32(c) || !is_f32(y) || !have_blas()) return false;
  if (is_bf16(a) && is_bf16(b)) return run_matmul_acc(tp, bf16_to_f32(tp, a), bf16_to_f32(tp, b), c, y);
  if (!is_f32(a) || !is_f32(b) || a.shape().size() != 2 || b.shape().size() != 2) return false;
  const int64_t m = a.shape()[0], k = a.shape()[1], n = b.shape()[1];
  float* yp = out_as<float>(y);
  std::memmove(yp, c.data_as<float>(), static_cast<size_t>(m * n) * sizeof(float));
  if (m * n > 0 && k > 0) gemm(tp, false, m, n, k, a.data_as<float>(), k, b.data_as<float>(), n, 1.0f, yp, n);
  return true;
}

bool run_matmul(ThreadPool& tp, const Tensor& a, const Tensor& b, Tensor& y) {
  // bf16 (autocast's contractions): f32 products and sums as on a tensor core, one rounding.
  if (is_bf16(a) && is_bf16(b) && is_bf16(y) && have_blas()) {
    Tensor f(DType::kF32, y.shape());
    if (!run_matmul(tp, bf16_to_f32(tp, a), bf16_to_f32(tp, b), f)) return false;
    f32_to_bf16(tp, f, y);
    return true;
  }
  if (!is_f32(a) || !is_f32(b) || !have_blas()) return false;
  Sizes as = a.shape(), bs = b.shape();
  if (as.size() == 1) as.insert(as.begin(), 1);
  if (bs.size() == 1) bs.push_back(1);
  const int64_t m = as[as.size() - 2], k = as.back(), n = bs.back();
  const Sizes ab(as.begin(), as.end() - 2), bb(bs.begin(), bs.end() - 2);
  const float* ap = a.data_as<float>();
  const float* bp = b.data_as<float>();
  float* yp = out_as<float>(y);
  if (m == 0 || n == 0) return true;
  if (k == 0) {
    std::fill(yp, yp + y.numel(), 0.0f);
    return true;
  }
  const int64_t batches = y.numel() / (m * n);
  // A shared 'b': every batch of 'a' is one tall matrix.
  if (product(bb) == 1 && product(ab) == batches) {
    gemm(tp, false, batches * m, n, k, ap, k, bp, n, 0.0f, yp, n);
    return true;
  }
  // Broadcast batch dims: walk the output batch index and map it into each operand.
  const size_t rank = std::max(ab.size(), bb.size());
  Sizes ob(rank), sa(rank, 0), sb(rank, 0);
  const Sizes ca = contiguous_strides(ab), cb = contiguous_strides(bb);
  for (size_t d = 0; d < rank; ++d) {
    const int64_t da = d + ab.size() >= rank ? ab[d + ab.size() - rank] : 1;
    const int64_t db = d + bb.size() >= rank ? bb[d + bb.size() - rank] : 1;
    ob[d] = std::max(da, db);
    if (da != 1) sa[d] = ca[d + ab.size() - rank];
    if (db != 1) sb[d] = cb[d + bb.size() - rank];
  }
  auto offsets = [&](int64_t bi) {
    int64_t oa = 0, obb = 0, rem = bi;
    for (size_t d = rank; d-- > 0;) {
      const int64_t i = rem % ob[d];
      rem /= ob[d];
      oa += i * sa[d];
      obb += i * sb[d];
    }
    return std::pair{ap + oa * m * k, bp + obb * k * n};
  };
  // Many small products (attention heads): whole products per worker; else split each one.
  if (batches >= tp.threads() && m * n * k < (int64_t{1} << 24)) {
    tp.parallel_for(batches, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t bi = b0; bi < b1; ++bi) {
        const auto [pa, pb] = offsets(bi);
        blas().sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                     static_cast<int>(k), 1.0f, pa, static_cast<int>(k), pb, static_cast<int>(n), 0.0f,
                     yp + bi * m * n, static_cast<int>(n));
      }
    });
  } else {
    for (int64_t bi = 0; bi < batches; ++bi) {
      const auto [pa, pb] = offsets(bi);
      gemm(tp, false, m, n, k, pa, k, pb, n, 0.0f, yp + bi * m * n, n);
    }
  }
  return true;
}

bool run_linear(ThreadPool& tp, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  if (is_bf16(x) && is_bf16(w) && is_bf16(y) && (!bias || is_bf16(*bias)) && have_blas()) {
    Tensor f(DType::kF32, y.shape());
    const Tensor fb = bias ? bf16_to_f32(tp, *bias) : Tensor();
    if (!run_linear(tp, bf16_to_f32(tp, x), bf16_to_f32(tp, w), bias ? &fb : nullptr, f)) return false;
    f32_to_bf16(tp, f, y);
    return true;
  }
  if (!is_f32(x) || !is_f32(w) || (bias && !is_f32(*bias)) || !have_blas()) return false;
  const int64_t in = w.shape()[1], out = w.shape()[0];
  const int64_t rows = in == 0 ? y.numel() / std::max<int64_t>(out, 1) : x.numel() / in;
  float* yp = out_as<float>(y);
  if (rows == 0 || out == 0) return true;
  if (bias)
    for (int64_t r = 0; r < rows; ++r) std::memcpy(yp + r * out, bias->data_as<float>(), static_cast<size_t>(out) * 4);
  else
    std::fill(yp, yp + rows * out, 0.0f);
  if (in == 0) return true;
  gemm(tp, true, rows, out, in, x.data_as<float>(), in, w.data_as<float>(), in, 1.0f, yp, out);
  return true;
}

namespace {

bool is_f8(DType t) { return t == DType::kF8E4M3FN || t == DType::kF8E5M2; }

/// Every f8 bit pattern's value as f32 (exact), for one format.
const std::vector<float>& f8_values(DType t) {
  static const auto table = [](bool e4m3) {
    std::vector<float> v(256);
    for (int i = 0; i < 256; ++i)
      v[static_cast<size_t>(i)] = e4m3 ? f8e4m3fn_bits_to_f32(static_cast<uint8_t>(i))
                                      : f8e5m2_bits_to_f32(static_cast<uint8_t>(i));
    return v;
  };
  static const std::vector<float> e4m3 = table(true), e5m2 = table(false);
  return t == DType::kF8E4M3FN ? e4m3 : e5m2;
}

/// The f8 operand decoded to f32 (exact: f8 values are f32 values).
std::vector<float> decode_f8(ThreadPool& tp, const Tensor& q) {
  const std::vector<float>& table = f8_values(q.dtype());
  const auto* src = reinterpret_cast<const uint8_t*>(q.data());
  std::vector<float> out(static_cast<size_t>(q.numel()));
  tp.parallel_for(q.numel(), 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[static_cast<size_t>(i)] = table[src[i]];
  });
  return out;
}

}  // namespace

namespace {

/// y [rows, n] f32 = (a * sa) @ (b * sb)^T + bias: f8 products are exact in f32, and the sum
/// accumulates in f32 as on an FP8 tensor core; the scales apply once to the sum, as the
/// reference's and cuBLASLt's alpha.
void scaled_matmul_f32(ThreadPool& tp, const Tensor& a, const Tensor& b, float scale, const float* bp, float* yp,
                       int64_t rows) {
  const int64_t n = b.shape()[0], k = b.shape()[1];
  if (rows == 0 || n == 0) return;
  if (k == 0) {
    std::fill(yp, yp + rows * n, 0.0f);
  } else {
    const std::vector<float> af = decode_f8(tp, a), bf = decode_f8(tp, b);
    gemm(tp, true, rows, n, k, af.data(), k, bf.data(), k, 0.0f, yp, n);
  }
  tp.parallel_for(rows, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t o = 0; o < n; ++o) yp[r * n + o] = yp[r * n + o] * scale + (bp ? bp[o] : 0.0f);
  });
}

}  // namespace

bool run_scaled_matmul(ThreadPool& tp, std::span<const Tensor> in, Tensor& y) {
  const Tensor &a = in[0], &b = in[1];
  const Tensor* bias = in.size() > 4 ? &in[4] : nullptr;
  if (!is_f8(a.dtype()) || !is_f8(b.dtype()) || !is_f32(in[2]) || !is_f32(in[3]) || !have_blas()) return false;
  const float scale = in[2].data_as<float>()[0] * in[3].data_as<float>()[0];
  const int64_t n = b.shape()[0], rows = n == 0 ? 0 : y.numel() / n;
  if (is_f32(y) && (!bias || is_f32(*bias))) {
    scaled_matmul_f32(tp, a, b, scale, bias ? bias->data_as<float>() : nullptr, out_as<float>(y), rows);
    return true;
  }
  // A bf16 result (autocast's FP8 GEMMs): the f32 result rounded once, as cuBLASLt's epilogue.
  if (!is_bf16(y) || (bias && !is_bf16(*bias))) return false;
  Tensor f(DType::kF32, y.shape());
  const Tensor fb = bias ? bf16_to_f32(tp, *bias) : Tensor();
  scaled_matmul_f32(tp, a, b, scale, bias ? fb.data_as<float>() : nullptr, f.mutable_data_as<float>(), rows);
  f32_to_bf16(tp, f, y);
  return true;
}

bool run_quantize(ThreadPool& tp, const Tensor& x, const Tensor& s, Tensor& q) {
  if (!is_f32(x) || !is_f32(s) || !is_f8(q.dtype())) return false;
  // The reference's rounding, element by element: an f32 quotient, nearest even, saturating.
  const float scale = s.data_as<float>()[0];
  const float* xp = x.data_as<float>();
  uint8_t* qp = out_as<uint8_t>(q);
  const bool e4m3 = q.dtype() == DType::kF8E4M3FN;
  tp.parallel_for(x.numel(), 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float v = xp[i] / scale;
      qp[i] = e4m3 ? f64_to_f8e4m3fn_bits(v, true) : f64_to_f8e5m2_bits(v, true);
    }
  });
  return true;
}

bool run_requantize(ThreadPool& tp, std::span<const Tensor> in, Tensor& q) {
  const Tensor &x = in[0], &qd = in[1], &qd_scale = in[2], &scale = in[3];
  if (!is_f32(qd_scale) || !is_f32(scale) || qd.dtype() != q.dtype()) return false;
  // q already holds x quantized with this scale (every step after a just-in-time first one).
  if (std::memcmp(qd_scale.data(), scale.data(), sizeof(float)) == 0) {
    std::memcpy(out_as<uint8_t>(q), qd.data(), q.nbytes());
    return true;
  }
  return run_quantize(tp, x, scale, q);
}

namespace {

/// Window attributes of a 2-D conv or pool, with defaults.
struct Window2 {
  int64_t kh, kw, sh = 1, sw = 1, ph0 = 0, pw0 = 0, ph1 = 0, pw1 = 0, dh = 1, dw = 1;
};

bool read_window2(const Node& n, int64_t kh, int64_t kw, Window2& w) {
  w.kh = kh;
  w.kw = kw;
  const Sizes s = n.get_ints("strides"), p = n.get_ints("pads"), d = n.get_ints("dilations");
  if ((!s.empty() && s.size() != 2) || (!p.empty() && p.size() != 4) || (!d.empty() && d.size() != 2))
    return false;
  if (!s.empty()) w.sh = s[0], w.sw = s[1];
  if (!p.empty()) w.ph0 = p[0], w.pw0 = p[1], w.ph1 = p[2], w.pw1 = p[3];
  if (!d.empty()) w.dh = d[0], w.dw = d[1];
  return true;
}

}  // namespace

namespace {

/// 3x3 convolution, stride 1, padding 1, one image, by Winograd F(2x2, 3x3): each 4x4 input
/// tile and 3x3 filter go to a 4x4 transform domain where the product is elementwise, so the
/// contraction is 16 GEMMs [c_out, c_in] x [c_in, tiles] with 2.25x fewer multiply-adds than
/// im2col's and a 4x (not 9x) expanded input. Transformed constant weights are kept in `cache`.
void conv3x3_winograd(ThreadPool& tp, const float* x, int64_t c_in, int64_t h, int64_t wd,
                      const float* w, const float* bias, int64_t c_out, float* y, StepCache* cache) {
  const int64_t th = (h + 1) / 2, tw = (wd + 1) / 2, tiles = th * tw, kc = c_out * c_in;
  const Blas& bl = blas();
  std::vector<float> local;
  std::vector<float>& u = cache ? cache->data : local;
  if (!cache || cache->source != w || u.size() != static_cast<size_t>(16 * kc)) {
    u.resize(static_cast<size_t>(16 * kc));
    float* up = u.data();
    tp.parallel_for(kc, 256, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float* g = w + i * 9;
        float t[4][3];  // G·g
        for (int c = 0; c < 3; ++c) {
          const float g0 = g[c], g1 = g[3 + c], g2 = g[6 + c];
          t[0][c] = g0, t[1][c] = 0.5f * (g0 + g1 + g2), t[2][c] = 0.5f * (g0 - g1 + g2), t[3][c] = g2;
        }
        for (int r = 0; r < 4; ++r) {  // (G·g)·Gᵀ
          const float a = t[r][0], b1 = t[r][1], c2 = t[r][2];
          const float v[4] = {a, 0.5f * (a + b1 + c2), 0.5f * (a - b1 + c2), c2};
          for (int c = 0; c < 4; ++c) up[(r * 4 + c) * kc + i] = v[c];
        }
      }
    });
    if (cache) cache->source = w;
  }
  // The 16 transform planes, padded apart: at a multiple of 4 KiB (e.g. 64 x 784 floats) the
  // 16 streams of a tile's values would fight over one L1 set.
  const int64_t vstep = c_in * tiles + 48, mstep = c_out * tiles + 48;
  thread_local std::vector<float> vbuf, mbuf;
  if (vbuf.size() < static_cast<size_t>(16 * vstep)) vbuf.resize(static_cast<size_t>(16 * vstep));
  if (mbuf.size() < static_cast<size_t>(16 * mstep)) mbuf.resize(static_cast<size_t>(16 * mstep));
  float* const vp = vbuf.data();  // [16][c_in][tiles]
  float* const mp = mbuf.data();  // [16][c_out][tiles]
  tp.parallel_for(c_in * th, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t ic = r / th, ty = r % th;
      const float* in = x + ic * h * wd;
      for (int64_t tx = 0; tx < tw; ++tx) {
        float d[4][4];
        const int64_t y0 = 2 * ty - 1, x0 = 2 * tx - 1;
        if (y0 >= 0 && y0 + 4 <= h && x0 >= 0 && x0 + 4 <= wd) {
          for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) d[i][j] = in[(y0 + i) * wd + x0 + j];
        } else {  // a border tile: zero padding
          for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) {
              const int64_t iy = y0 + i, ix = x0 + j;
              d[i][j] = iy < 0 || iy >= h || ix < 0 || ix >= wd ? 0.0f : in[iy * wd + ix];
            }
        }
        float t[4][4];  // Bᵀ·d
        for (int j = 0; j < 4; ++j) {
          t[0][j] = d[0][j] - d[2][j], t[1][j] = d[1][j] + d[2][j];
          t[2][j] = d[2][j] - d[1][j], t[3][j] = d[1][j] - d[3][j];
        }
        float* o = vp + ic * tiles + ty * tw + tx;
        const int64_t step = vstep;
        for (int i = 0; i < 4; ++i) {  // (Bᵀ·d)·B
          o[(i * 4 + 0) * step] = t[i][0] - t[i][2];
          o[(i * 4 + 1) * step] = t[i][1] + t[i][2];
          o[(i * 4 + 2) * step] = t[i][2] - t[i][1];
          o[(i * 4 + 3) * step] = t[i][1] - t[i][3];
        }
      }
    }
  });
  const float* up = u.data();
  tp.parallel_for(16, 1, [&](int64_t b, int64_t e) {
    for (int64_t xi = b; xi < e; ++xi)
      bl.sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(c_out), static_cast<int>(tiles),
               static_cast<int>(c_in), 1.0f, up + xi * kc, static_cast<int>(c_in), vp + xi * vstep,
               static_cast<int>(tiles), 0.0f, mp + xi * mstep, static_cast<int>(tiles));
  });
  tp.parallel_for(c_out * th, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t oc = r / th, ty = r % th;
      const float bv = bias ? bias[oc] : 0.0f;
      float* out = y + oc * h * wd;
      const int64_t step = mstep;
      for (int64_t tx = 0; tx < tw; ++tx) {
        const float* m = mp + oc * tiles + ty * tw + tx;
        float t[2][4];  // Aᵀ·m
        for (int j = 0; j < 4; ++j) {
          const float m0 = m[j * step], m1 = m[(4 + j) * step], m2 = m[(8 + j) * step], m3 = m[(12 + j) * step];
          t[0][j] = m0 + m1 + m2, t[1][j] = m1 - m2 - m3;
        }
        for (int i = 0; i < 2; ++i) {  // (Aᵀ·m)·A
          const int64_t oy = 2 * ty + i;
          if (oy >= h) break;
          const float v0 = t[i][0] + t[i][1] + t[i][2] + bv, v1 = t[i][1] - t[i][2] - t[i][3] + bv;
          out[oy * wd + 2 * tx] = v0;
          if (2 * tx + 1 < wd) out[oy * wd + 2 * tx + 1] = v1;
        }
      }
    }
  });
}

}  // namespace

bool run_conv(ThreadPool& tp, const Node& node, const Tensor& x, const Tensor& w,
              const Tensor* bias, Tensor& y, StepCache* cache, bool winograd) {
  // Channels-last convs (layout-nhwc) run on the reference kernel.
  if (!is_f32(x) || !is_f32(w) || (bias && !is_f32(*bias)) || x.rank() != 4 || !have_blas() ||
      node.get_string("layout", "nchw") != "nchw")
    return false;
  Window2 win;
  if (!read_window2(node, w.shape()[2], w.shape()[3], win)) return false;
  const int64_t groups = node.get_int("groups", 1);
  const int64_t nb = x.shape()[0], c_in = x.shape()[1], h = x.shape()[2], wd = x.shape()[3];
  const int64_t c_out = y.shape()[1], oh = y.shape()[2], ow = y.shape()[3];
  const int64_t cg_in = c_in / groups, cg_out = c_out / groups;
  const int64_t kk = cg_in * win.kh * win.kw, plane = oh * ow;
  float* yp = out_as<float>(y);
  if (y.numel() == 0) return true;
  // Winograd where it pays: 3x3, stride 1, "same" padding, enough channels and tiles.
  const bool wino = groups == 1 && win.kh == 3 && win.kw == 3 && win.sh == 1 && win.sw == 1 &&
                    win.dh == 1 && win.dw == 1 && win.ph0 == 1 && win.pw0 == 1 && win.ph1 == 1 &&
                    win.pw1 == 1 && oh == h && ow == wd && c_in >= 16 && c_out >= 16 &&
                    h * wd >= 196 && winograd;
  if (wino) {
    for (int64_t b = 0; b < nb; ++b)
      conv3x3_winograd(tp, x.data_as<float>() + b * c_in * h * wd, c_in, h, wd, w.data_as<float>(),
                       bias ? bias->data_as<float>() : nullptr, c_out, yp + b * c_out * h * wd, cache);
    return true;
  }
  const bool direct = win.kh == 1 && win.kw == 1 && win.sh == 1 && win.sw == 1 && win.ph0 == 0 &&
                      win.pw0 == 0 && win.ph1 == 0 && win.pw1 == 0;
  // The im2col matrix: reused across calls and never zeroed (every element is written).
  thread_local std::vector<float> col;
  if (!direct && col.size() < static_cast<size_t>(kk * plane)) col.resize(static_cast<size_t>(kk * plane));
  float* const colp = col.data();  // the workers filling it see their own `col`
  const float* xp = x.data_as<float>();
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = xp + (b * c_in + g * cg_in) * h * wd;
      float* yg = yp + (b * c_out + g * cg_out) * plane;
      for (int64_t oc = 0; oc < cg_out; ++oc)
        std::fill(yg + oc * plane, yg + (oc + 1) * plane, bias ? bias->data_as<float>()[g * cg_out + oc] : 0.0f);
      const float* src = xg;
      if (!direct) {
        // im2col: row (ic, ky, kx) holds the input under that tap for every output position.
        tp.parallel_for(kk, 8, [&](int64_t rb, int64_t re) {
          for (int64_t r = rb; r < re; ++r) {
            const int64_t ic = r / (win.kh * win.kw), ky = (r / win.kw) % win.kh, kx = r % win.kw;
            float* out = colp + r * plane;
            const float* in = xg + ic * h * wd;
            // Output columns whose tap lands inside the row: [ox0, ox1).
            const int64_t off = kx * win.dw - win.pw0;
            const int64_t ox0 = std::clamp<int64_t>(off >= 0 ? 0 : (-off + win.sw - 1) / win.sw, 0, ow);
            const int64_t ox1 = std::clamp<int64_t>(wd - off <= 0 ? 0 : (wd - off + win.sw - 1) / win.sw, ox0, ow);
            for (int64_t oy = 0; oy < oh; ++oy) {
              const int64_t iy = oy * win.sh - win.ph0 + ky * win.dh;
              float* orow = out + oy * ow;
              if (iy < 0 || iy >= h) {
                std::fill(orow, orow + ow, 0.0f);
                continue;
              }
              const float* irow = in + iy * wd + off;
              std::fill(orow, orow + ox0, 0.0f);
              if (win.sw == 1) {
                std::memcpy(orow + ox0, irow + ox0, static_cast<size_t>(ox1 - ox0) * 4);
              } else {
                for (int64_t ox = ox0; ox < ox1; ++ox) orow[ox] = irow[ox * win.sw];
              }
              std::fill(orow + ox1, orow + ow, 0.0f);
            }
          }
        });
        src = colp;
      }
      gemm(tp, false, cg_out, plane, kk, w.data_as<float>() + g * cg_out * kk, kk, src, plane, 1.0f, yg, plane);
    }
  return true;
}

namespace {

/// max(a, b) where a NaN in either wins; a select, so that loops of it vectorize.
inline float nan_max(float a, float b) { return b > a || b != b ? b : a; }

/// One plane of an undilated max pool; `col` holds `w` floats of scratch. A window that
/// covers no input gives -inf, as the reference.
KILN_CPU_CLONES void max_pool_plane(const float* in, float* out, float* col, int64_t h, int64_t w,
                                    int64_t oh, int64_t ow, int64_t kh, int64_t kw, int64_t sh,
                                    int64_t sw, int64_t ph, int64_t pw) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t oy = 0; oy < oh; ++oy) {
    const int64_t y0 = oy * sh - ph;
    const int64_t ya = std::max<int64_t>(y0, 0), yb = std::min(y0 + kh, h);
    for (int64_t x = 0; x < w; ++x) col[x] = ninf;
    for (int64_t iy = ya; iy < yb; ++iy) {
      const float* row = in + iy * w;
      for (int64_t x = 0; x < w; ++x) col[x] = nan_max(col[x], row[x]);
    }
    for (int64_t ox = 0; ox < ow; ++ox) {
      const int64_t x0 = ox * sw - pw;
      const int64_t xa = std::max<int64_t>(x0, 0), xb = std::min(x0 + kw, w);
      // maxss and a NaN flag: a compare-and-branch here mispredicts on real data.
      float m = ninf;
      bool nan = false;
      for (int64_t x = xa; x < xb; ++x) {
        m = std::max(m, col[x]);
        nan |= col[x] != col[x];
      }
      out[oy * ow + ox] = nan ? std::numeric_limits<float>::quiet_NaN() : m;
    }
  }
}

}  // namespace

bool run_pool(ThreadPool& tp, const Node& node, const Tensor& x, Tensor& y, bool is_max) {
  if (!is_f32(x) || x.rank() != 4) return false;
  const Sizes k = node.get_ints("kernel_shape");
  if (k.size() != 2) return false;
  Window2 win;
  if (!read_window2(node, k[0], k[1], win)) return false;
  if (!is_max) win.dh = win.dw = 1;
  const bool include_pad = !is_max && node.get_int("count_include_pad", 0) == 1;
  const int64_t planes = x.shape()[0] * x.shape()[1], h = x.shape()[2], wd = x.shape()[3];
  const int64_t oh = y.shape()[2], ow = y.shape()[3];
  const float* xp = x.data_as<float>();
  float* yp = out_as<float>(y);
  if (is_max && win.dh == 1 && win.dw == 1) {
    // Undilated max, separable: the max over the window's rows for every column (contiguous,
    // vectorized), then over the window's columns.
    tp.parallel_for(planes, 1, [&](int64_t pb, int64_t pe) {
      std::vector<float> col(static_cast<size_t>(wd));
      for (int64_t p = pb; p < pe; ++p)
        max_pool_plane(xp + p * h * wd, yp + p * oh * ow, col.data(), h, wd, oh, ow, win.kh, win.kw,
                       win.sh, win.sw, win.ph0, win.pw0);
    });
    return true;
  }
  tp.parallel_for(planes, 1, [&](int64_t pb, int64_t pe) {
    for (int64_t p = pb; p < pe; ++p) {
      const float* in = xp + p * h * wd;
      float* out = yp + p * oh * ow;
      for (int64_t oy = 0; oy < oh; ++oy)
        for (int64_t ox = 0; ox < ow; ++ox) {
          const int64_t y0 = oy * win.sh - win.ph0, x0 = ox * win.sw - win.pw0;
          float m = 0;
          double sum = 0;
          int64_t count = 0;
          for (int64_t ky = 0; ky < win.kh; ++ky) {
            const int64_t iy = y0 + ky * win.dh;
            if (iy < 0 || iy >= h) continue;
            for (int64_t kx = 0; kx < win.kw; ++kx) {
              const int64_t ix = x0 + kx * win.dw;
              if (ix < 0 || ix >= wd) continue;
              const float v = in[iy * wd + ix];
              if (count++ == 0 || v > m || v != v) m = v;
              sum += v;
            }
          }
          if (is_max) {
            out[oy * ow + ox] = count == 0 ? -std::numeric_limits<float>::infinity() : m;
          } else {
            int64_t div = count;
            if (include_pad)
              div = (std::min(y0 + win.kh, h + win.ph1) - y0) * (std::min(x0 + win.kw, wd + win.pw1) - x0);
            out[oy * ow + ox] = static_cast<float>(sum / static_cast<double>(div));
          }
        }
    }
  });
  return true;
}

// ---------------------------------------------------------------------------------------
// row kernels

namespace {

/// e^x in f32 that vectorizes: Cody-Waite reduction by ln 2 and a degree-7 Taylor polynomial
/// on [-ln2/2, ln2/2] (a few ulps off expf), scaled by 2^n in two halves so that results
/// underflow gradually and overflow to +inf as expf does; NaN stays NaN.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -104.0f), 88.8f);  // NaN passes both
  const float t = x * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23 rounds to an integer
  const float n = t - 12582912.0f;
  const int32_t ni = std::bit_cast<int32_t>(t) - 0x4B400000;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t h = ni >> 1;
  return p * std::bit_cast<float>(static_cast<uint32_t>(h + 127) << 23) *
         std::bit_cast<float>(static_cast<uint32_t>(ni - h + 127) << 23);
}

/// Softmax (or log-softmax) of one contiguous row; `out` may be `in`.
KILN_CPU_CLONES void softmax_row(const float* in, float* out, int64_t len, bool log) {
  // Reductions in independent lanes, so that they vectorize without reassociation flags
  // (one running max or sum is a chain of dependent scalar ops).
  constexpr int kLanes = 16;
  float mx[kLanes];
  double acc[kLanes] = {};
  std::fill(mx, mx + kLanes, -std::numeric_limits<float>::infinity());
  const int64_t body = len / kLanes * kLanes;
  for (int64_t i = 0; i < body; i += kLanes)
    for (int j = 0; j < kLanes; ++j) mx[j] = std::max(mx[j], in[i + j]);
  for (int64_t i = body; i < len; ++i) mx[0] = std::max(mx[0], in[i]);
  float m = mx[0];
  for (int j = 1; j < kLanes; ++j) m = std::max(m, mx[j]);
  for (int64_t i = 0; i < len; ++i) out[i] = fast_exp(in[i] - m);
  for (int64_t i = 0; i < body; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += out[i + j];
  for (int64_t i = body; i < len; ++i) acc[0] += out[i];
  double sum = 0;
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  if (log) {
    const float sub = m + static_cast<float>(std::log(sum));
    for (int64_t i = 0; i < len; ++i) out[i] = in[i] - sub;
  } else {
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t i = 0; i < len; ++i) out[i] *= inv;
  }
}

}  // namespace

bool run_softmax(ThreadPool& tp, const Node& node, const Tensor& x, Tensor& y, bool log) {
  if (!is_f32(x) || x.rank() == 0) return false;
  const int64_t axis = norm_axis(node.get_int("axis", -1), x.rank());
  const int64_t len = x.shape()[static_cast<size_t>(axis)];
  const int64_t inner = product(x.shape(), static_cast<size_t>(axis) + 1);
  const int64_t outer = product(x.shape(), 0, static_cast<size_t>(axis));
  if (len == 0 || x.numel() == 0) return true;
  const float* xp = x.data_as<float>();
  float* yp = out_as<float>(y);
  if (inner == 1) {
    tp.parallel_for(outer, std::max<int64_t>(1, 4096 / len), [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) softmax_row(xp + r * len, yp + r * len, len, log);
    });
    return true;
  }
  tp.parallel_for(outer * inner, std::max<int64_t>(1, 4096 / len), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float* in = xp + (r / inner) * len * inner + r % inner;
      float* out = yp + (r / inner) * len * inner + r % inner;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < len; ++i) m = std::max(m, in[i * inner]);
      double sum = 0;
      for (int64_t i = 0; i < len; ++i) {
        const float e = std::exp(in[i * inner] - m);
        sum += e;
        if (!log) out[i * inner] = e;
      }
      if (log) {
        const float ls = static_cast<float>(std::log(sum));
        for (int64_t i = 0; i < len; ++i) out[i * inner] = in[i * inner] - m - ls;
      } else {
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t i = 0; i < len; ++i) out[i * inner] *= inv;
      }
    }
  });
  return true;
}

bool run_attention(ThreadPool& tp, const Node& node, std::span<const Tensor> in, Tensor& y) {
  const Tensor &q = in[0], &k = in[1], &v = in[2];
  const Tensor* mask = in.size() > 3 ? &in[3] : nullptr;
  if (!is_f32(q) || !is_f32(k) || !is_f32(v) || (mask && !is_f32(*mask)) || !have_blas()) return false;
  const int64_t B = q.shape()[0], Hq = q.shape()[1], Sq = q.shape()[2], D = q.shape()[3];
  const int64_t Hkv = k.shape()[1], Skv = k.shape()[2], Dv = v.shape()[3];
  if (Hkv == 0 || Hq % Hkv != 0 || (mask && mask->rank() > 4)) return false;
  if (y.numel() == 0) return true;
  const float scale = static_cast<float>(node.get_float("scale"));
  const bool causal = node.get_int("causal") != 0;
  // Mask strides over [B, Hq, Sq, Skv]: right-aligned, 0 where the mask broadcasts.
  Sizes ms(4, 0);
  if (mask) {
    const Sizes cs = contiguous_strides(mask->shape());
    const size_t lead = 4 - mask->shape().size();
    for (size_t d = 0; d < mask->shape().size(); ++d) ms[lead + d] = mask->shape()[d] == 1 ? 0 : cs[d];
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  const float* qp = q.data_as<float>();
  const float* kp = k.data_as<float>();
  const float* vp = v.data_as<float>();
  const float* mp = mask ? mask->data_as<float>() : nullptr;
  float* yp = out_as<float>(y);
  const Blas& bl = blas();
  // One (batch, head) per task: scores = q·kᵀ·scale (+ mask, causal), softmax rows, ·v.
  tp.parallel_for(B * Hq, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> scores;
    if (scores.size() < static_cast<size_t>(Sq * Skv)) scores.resize(static_cast<size_t>(Sq * Skv));
    float* sp = scores.data();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / Hq, h = t % Hq, hk = h / (Hq / Hkv);
      const float* kb = kp + (b * Hkv + hk) * Skv * D;
      const float* vb = vp + (b * Hkv + hk) * Skv * Dv;
      if (D > 0)
        bl.sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(Sq), static_cast<int>(Skv),
                 static_cast<int>(D), scale, qp + t * Sq * D, static_cast<int>(D), kb, static_cast<int>(D),
                 0.0f, sp, static_cast<int>(Skv));
      else
        std::fill(sp, sp + Sq * Skv, 0.0f);
      for (int64_t i = 0; i < Sq; ++i) {
        float* row = sp + i * Skv;
        if (mp)
          for (int64_t j = 0; j < Skv; ++j) row[j] += mp[b * ms[0] + h * ms[1] + i * ms[2] + j * ms[3]];
        if (causal)
          for (int64_t j = std::max<int64_t>(0, i + (Skv - Sq) + 1); j < Skv; ++j) row[j] = ninf;
        softmax_row(row, row, Skv, false);  // a row that sees no key becomes NaN, as the reference
      }
      float* yb = yp + t * Sq * Dv;
      if (Skv > 0)
        bl.sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(Sq), static_cast<int>(Dv),
                 static_cast<int>(Skv), 1.0f, sp, static_cast<int>(Skv), vb, static_cast<int>(Dv), 0.0f,
                 yb, static_cast<int>(Dv));
      else
        std::fill(yb, yb + Sq * Dv, std::numeric_limits<float>::quiet_NaN());
    }
  });
  return true;
}

namespace {

/// Layer norm (or RMS norm: no mean) of one contiguous row, statistics in f64 lanes.
KILN_CPU_CLONES void norm_row(const float* __restrict row, float* __restrict out, int64_t len,
                              const float* sc, const float* bi, double eps, bool rms) {
  constexpr int kLanes = 8;
  const int64_t body = len / kLanes * kLanes;
  double mean = 0;
  if (!rms) {
    double acc[kLanes] = {};
    for (int64_t i = 0; i < body; i += kLanes)
      for (int j = 0; j < kLanes; ++j) acc[j] += row[i + j];
    for (int64_t i = body; i < len; ++i) acc[0] += row[i];
    for (int j = 0; j < kLanes; ++j) mean += acc[j];
    mean /= static_cast<double>(len);
  }
  double sq[kLanes] = {};
  for (int64_t i = 0; i < body; i += kLanes)
    for (int j = 0; j < kLanes; ++j) sq[j] += (row[i + j] - mean) * (row[i + j] - mean);
  for (int64_t i = body; i < len; ++i) sq[0] += (row[i] - mean) * (row[i] - mean);
  double var = 0;
  for (int j = 0; j < kLanes; ++j) var += sq[j];
  const float inv = static_cast<float>(1.0 / std::sqrt(var / static_cast<double>(len) + eps));
  const float mf = static_cast<float>(mean);
  if (sc && bi)
    for (int64_t j = 0; j < len; ++j) out[j] = (row[j] - mf) * inv * sc[j] + bi[j];
  else if (sc)
    for (int64_t j = 0; j < len; ++j) out[j] = (row[j] - mf) * inv * sc[j];
  else
    for (int64_t j = 0; j < len; ++j) out[j] = (row[j] - mf) * inv;
}

}  // namespace

bool run_norm(ThreadPool& tp, const Node& node, std::span<const Tensor> in, Tensor& y, bool rms) {
  const Tensor& x = in[0];
  if (!is_f32(x) || x.rank() == 0) return false;
  const int64_t axis = norm_axis(node.get_int("axis", -1), x.rank());
  const int64_t len = product(x.shape(), static_cast<size_t>(axis));
  // Affine operands must cover the normalized dims exactly (broadcast ones take the reference).
  for (size_t i = 1; i < in.size(); ++i)
    if (!is_f32(in[i]) || in[i].numel() != len) return false;
  if (len == 0) return true;
  const double eps = node.get_float("epsilon");
  const float* sc = in.size() > 1 ? in[1].data_as<float>() : nullptr;
  const float* bi = in.size() > 2 ? in[2].data_as<float>() : nullptr;
  const float* xp = x.data_as<float>();
  float* yp = out_as<float>(y);
  tp.parallel_for(x.numel() / len, std::max<int64_t>(1, 4096 / len), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) norm_row(xp + r * len, yp + r * len, len, sc, bi, eps, rms);
  });
  return true;
}

bool run_reduce(ThreadPool& tp, const Node& node, const Tensor& x, Tensor& y) {
  if (!is_f32(x) || x.rank() == 0) return false;
  Sizes axes = node.get_ints("axes");
  if (axes.empty())
    for (int64_t d = 0; d < x.rank(); ++d) axes.push_back(d);
  for (int64_t& a : axes) a = norm_axis(a, x.rank());
  std::sort(axes.begin(), axes.end());
  // Only one contiguous run of reduced axes (the common case): [outer, len, inner].
  for (size_t i = 1; i < axes.size(); ++i)
    if (axes[i] != axes[i - 1] + 1) return false;
  const size_t a0 = static_cast<size_t>(axes.front()), a1 = static_cast<size_t>(axes.back()) + 1;
  const int64_t outer = product(x.shape(), 0, a0), len = product(x.shape(), a0, a1),
                inner = product(x.shape(), a1);
  const std::string& op = node.op_name();
  const float* xp = x.data_as<float>();
  float* yp = out_as<float>(y);
  const float inf = std::numeric_limits<float>::infinity();
  tp.parallel_for(outer * inner, std::max<int64_t>(1, 4096 / std::max<int64_t>(len, 1)),
                  [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float* in = xp + (r / inner) * len * inner + r % inner;
      double acc = op == "reduce_prod" ? 1.0 : op == "reduce_max" ? -inf : op == "reduce_min" ? inf : 0.0;
      for (int64_t i = 0; i < len; ++i) {
        const double v = in[i * inner];
        if (op == "reduce_max") acc = std::isnan(v) || v > acc ? v : acc;
        else if (op == "reduce_min") acc = std::isnan(v) || v < acc ? v : acc;
        else if (op == "reduce_prod") acc *= v;
        else acc += v;
      }
      if (op == "reduce_mean") acc /= static_cast<double>(len);
      yp[r] = static_cast<float>(acc);
    }
  });
  return true;
}

// ---------------------------------------------------------------------------------------
// data movement

bool run_transpose(ThreadPool& tp, const Node& node, const Tensor& x, Tensor& y) {
  const size_t es = elem_size(x.dtype());
  if (es == 0) return false;
  Sizes perm = node.get_ints("perm");
  if (perm.empty())
    for (int64_t d = x.rank() - 1; d >= 0; --d) perm.push_back(d);
  const Sizes cs = contiguous_strides(x.shape());
  Sizes st;
  for (int64_t p : perm) st.push_back(cs[static_cast<size_t>(p)]);
  strided_copy(tp, es, x.data(), out_bytes(y), y.shape(), st, 0);
  return true;
}

bool run_slice(ThreadPool& tp, const Node& node, const Tensor& x, Tensor& y) {
  const size_t es = elem_size(x.dtype());
  if (es == 0 || y.numel() == 0) return es != 0;
  const Sizes starts = node.get_ints("starts"), ends = node.get_ints("ends");
  Sizes axes = node.get_ints("axes"), steps = node.get_ints("steps");
  if (axes.empty())
    for (size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<int64_t>(i));
  if (steps.empty()) steps.assign(starts.size(), 1);
  if (axes.size() != starts.size() || steps.size() != starts.size()) return false;
  Sizes st = contiguous_strides(x.shape());
  int64_t base = 0;
  for (size_t i = 0; i < axes.size(); ++i) {
    const size_t a = static_cast<size_t>(norm_axis(axes[i], x.rank()));
    const int64_t dim = x.shape()[a], step = steps[i];
    int64_t s = starts[i];
    if (step == 0 || s == std::numeric_limits<int64_t>::min()) return false;
    if (s < 0) s += dim;
    s = step > 0 ? std::clamp<int64_t>(s, 0, dim) : std::clamp<int64_t>(s, 0, dim - 1);
    base += s * st[a];
    if (y.shape()[a] > 1) st[a] *= step;
  }
  strided_copy(tp, es, x.data(), out_bytes(y), y.shape(), st, base);
  return true;
}

bool run_expand(ThreadPool& tp, const Tensor& x, Tensor& y) {
  const size_t es = elem_size(x.dtype());
  if (es == 0) return false;
  const Sizes cs = contiguous_strides(x.shape());
  Sizes st(y.shape().size(), 0);
  const size_t lead = y.shape().size() - x.shape().size();
  for (size_t d = 0; d < x.shape().size(); ++d)
    st[lead + d] = x.shape()[d] == 1 ? 0 : cs[d];
  strided_copy(tp, es, x.data(), out_bytes(y), y.shape(), st, 0);
  return true;
}

bool run_concat(ThreadPool& tp, const Node& node, std::span<const Tensor> in, Tensor& y) {
  const size_t es = elem_size(y.dtype());
  if (es == 0) return false;
  const int64_t axis = norm_axis(node.get_int("axis"), y.rank());
  const int64_t outer = product(y.shape(), 0, static_cast<size_t>(axis));
  const int64_t row = product(y.shape(), static_cast<size_t>(axis)) * static_cast<int64_t>(es);
  std::byte* out = out_bytes(y);
  tp.parallel_for(outer, 64, [&](int64_t ob, int64_t oe) {
    for (int64_t o = ob; o < oe; ++o) {
      int64_t at = 0;
      for (const Tensor& t : in) {
        const int64_t part = product(t.shape(), static_cast<size_t>(axis)) * static_cast<int64_t>(es);
        if (part) std::memcpy(out + o * row + at, t.data() + o * part, static_cast<size_t>(part));
        at += part;
      }
    }
  });
  return true;
}

bool run_split(ThreadPool& tp, const Node& node, const Tensor& x, std::span<Tensor> ys) {
  const size_t es = elem_size(x.dtype());
  if (es == 0) return false;
  const int64_t axis = norm_axis(node.get_int("axis", 0), x.rank());
  const int64_t outer = product(x.shape(), 0, static_cast<size_t>(axis));
  const int64_t row = product(x.shape(), static_cast<size_t>(axis)) * static_cast<int64_t>(es);
  std::vector<std::byte*> outs;
  for (Tensor& t : ys) outs.push_back(out_bytes(t));
  tp.parallel_for(outer, 64, [&](int64_t ob, int64_t oe) {
    for (int64_t o = ob; o < oe; ++o) {
      int64_t at = 0;
      for (size_t k = 0; k < ys.size(); ++k) {
        const int64_t part = product(ys[k].shape(), static_cast<size_t>(axis)) * static_cast<int64_t>(es);
        if (part) std::memcpy(outs[k] + o * part, x.data() + o * row + at, static_cast<size_t>(part));
        at += part;
      }
    }
  });
  return true;
}

StatusOr<bool> run_gather(ThreadPool& tp, const Node& node, const Tensor& data, const Tensor& idx,
                          Tensor& y) {
  const size_t es = elem_size(data.dtype());
  if (es == 0 || (idx.dtype() != DType::kI64 && idx.dtype() != DType::kI32)) return false;
  const int64_t axis = norm_axis(node.get_int("axis", 0), data.rank());
  const int64_t dim = data.shape()[static_cast<size_t>(axis)];
  const int64_t outer = product(data.shape(), 0, static_cast<size_t>(axis));
  const int64_t inner = product(data.shape(), static_cast<size_t>(axis) + 1) * static_cast<int64_t>(es);
  const int64_t n = idx.numel();
  std::vector<int64_t> ix(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = idx.dtype() == DType::kI64 ? idx.data_as<int64_t>()[i] : idx.data_as<int32_t>()[i];
    if (v < -dim || v >= dim)
      return invalid_argument("cpu: 'gather': index " + std::to_string(v) +
                              " is out of range for axis " + std::to_string(axis) + " of size " +
                              std::to_string(dim));
    ix[static_cast<size_t>(i)] = v < 0 ? v + dim : v;
  }
  std::byte* out = out_bytes(y);
  tp.parallel_for(outer * n, std::max<int64_t>(1, 65536 / std::max<int64_t>(inner, 1)),
                  [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const int64_t o = r / n, j = r % n;
      if (inner)
        std::memcpy(out + r * inner, data.data() + (o * dim + ix[static_cast<size_t>(j)]) * inner,
                    static_cast<size_t>(inner));
    }
  });
  return true;
}

}  // namespace kiln::cpu
