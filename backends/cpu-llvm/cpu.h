// Internals of the cpu backend shared by its files: the thread pool, the JIT and native kernels.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln::cpu {

using Sizes = std::vector<int64_t>;

/// A fixed set of worker threads that split index ranges. One parallel_for at a time (the
/// plan runs its steps in order); the calling thread takes a share of the work too. Idle
/// workers spin briefly before sleeping: a plan's steps come microseconds apart, and a
/// futex wake-up per step costs more than small steps take.
class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }
  /// Calls fn(begin, end) over disjoint chunks covering [0, n); chunks hold at least `grain`
  /// indices so that small loops stay on one thread.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker(int id);
  void run_chunks(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t chunks);
  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0, chunks_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<int> pending_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
};

/// One elementwise kernel: the JIT'd function computes rows [rb, re) of its collapsed
/// iteration space; `bufs` holds input pointers then output pointers.
using ElemFn = void (*)(void* const* bufs, int64_t rb, int64_t re);

/// An elementwise group to compile: a single elementwise node or the body of a `fused` node,
/// with the concrete shapes of its operands and (common) result shape.
struct ElemGroup {
  std::string name;                   ///< the function's symbol
  const Graph* body = nullptr;        ///< fused body (null for a single node)
  const Node* node = nullptr;         ///< the single node (null for fused)
  std::vector<DType> in_dtypes;
  std::vector<Sizes> in_shapes;
  std::vector<DType> out_dtypes;
  Sizes out_shape;
  int threads = 1;
  // Filled by add_group: the collapsed row count and elements per row.
  int64_t rows = 0, cols = 0;
};

/// Builds one LLVM module holding every elementwise group of a plan, optimizes it for the
/// host CPU, caches the object code in the kernel cache and loads it with ORC LLJIT.
class JitModule {
 public:
  JitModule();
  ~JitModule();
  /// Emits `g`'s function; false (with `why`) when something in it has no lowering, in which
  /// case the caller runs the group through the reference kernels.
  bool add_group(ElemGroup& g, std::string* why);
  /// Compiles (or loads from the cache) and resolves every added group.
  Status finish();
  /// The entry point of an added group (after finish).
  ElemFn lookup(const std::string& name) const;
  int num_functions() const;
  /// Whether finish() found the object code in the kernel cache.
  bool cache_hit() const;
  /// The module's IR text, before optimization (the cache key's source).
  const std::string& ir_text() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The host CPU's name and feature string, as LLVM sees them.
std::string host_cpu_description();

// Native kernels (f32 unless noted). Each returns false when its case is not handled, so
// the caller falls back to the reference kernel.
bool run_matmul(ThreadPool& tp, const Tensor& a, const Tensor& b, Tensor& y);
/// matmul_acc: y = c + a @ b with f32 c and y, f32 or bf16 2-D a and b (one sgemm, beta 1).
bool run_matmul_acc(ThreadPool& tp, const Tensor& a, const Tensor& b, const Tensor& c, Tensor& y);
bool run_linear(ThreadPool& tp, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y);
/// scaled_matmul (f8 a [.., k] and b [n, k], f32 scales, f32 or bf16 result): the f8 values
/// decoded to f32, one sgemm accumulating in f32, then the scales and bias (and one rounding).
bool run_scaled_matmul(ThreadPool& tp, std::span<const Tensor> in, Tensor& y);
/// quantize of f32 to f8, rounded exactly as the reference kernel rounds.
bool run_quantize(ThreadPool& tp, const Tensor& x, const Tensor& scale, Tensor& q);
/// requantize (x, q, q_scale, scale): q copied when the scales are equal, else run_quantize.
bool run_requantize(ThreadPool& tp, std::span<const Tensor> in, Tensor& q);
/// Memory a step's kernel keeps across runs: transformed constant weights, and the weights'
/// address they came from.
struct StepCache {
  const void* source = nullptr;
  std::vector<float> data;
};
/// `cache` (null unless the weights are a constant of the plan) keeps Winograd's weights;
/// `winograd` false computes 3x3 stride-1 convs by im2col too (the backend option winograd).
bool run_conv(ThreadPool& tp, const Node& n, const Tensor& x, const Tensor& w, const Tensor* bias,
              Tensor& y, StepCache* cache, bool winograd);
bool run_pool(ThreadPool& tp, const Node& n, const Tensor& x, Tensor& y, bool is_max);
bool run_softmax(ThreadPool& tp, const Node& n, const Tensor& x, Tensor& y, bool log);
/// Attention (f32): per (batch, head), scores through sgemm, masked softmax rows, then ·v.
bool run_attention(ThreadPool& tp, const Node& n, std::span<const Tensor> in, Tensor& y);
bool run_norm(ThreadPool& tp, const Node& n, std::span<const Tensor> in, Tensor& y, bool rms);
bool run_reduce(ThreadPool& tp, const Node& n, const Tensor& x, Tensor& y);
/// Data movement for any dtype of at least one byte: transpose, slice, expand, concat, split,
/// gather.
bool run_transpose(ThreadPool& tp, const Node& n, const Tensor& x, Tensor& y);
bool run_slice(ThreadPool& tp, const Node& n, const Tensor& x, Tensor& y);
bool run_expand(ThreadPool& tp, const Tensor& x, Tensor& y);
bool run_concat(ThreadPool& tp, const Node& n, std::span<const Tensor> in, Tensor& y);
bool run_split(ThreadPool& tp, const Node& n, const Tensor& x, std::span<Tensor> ys);
/// Gather; an out-of-range index is an error naming it.
StatusOr<bool> run_gather(ThreadPool& tp, const Node& n, const Tensor& data, const Tensor& idx,
                          Tensor& y);
/// The bytes of a step's result. Results live in the plan's arena, wrapped, so Tensor's
/// copy-on-write would copy them; the plan owns that memory and no one else sees it yet.
inline std::byte* out_bytes(Tensor& t) { return const_cast<std::byte*>(t.data()); }
template <typename T> T* out_as(Tensor& t) { return reinterpret_cast<T*>(out_bytes(t)); }

/// Whether OpenBLAS could be loaded (contractions run their reference kernels otherwise).
bool have_blas();
/// "OpenBLAS <kernel family>", for the profile's header.
std::string blas_description();

}  // namespace kiln::cpu
