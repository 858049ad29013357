// Index arithmetic shared by reference kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace kiln {

/// Row-major strides (in elements) of a contiguous tensor.
inline std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i)
    strides[static_cast<size_t>(i)] = strides[static_cast<size_t>(i + 1)] * shape[static_cast<size_t>(i + 1)];
  return strides;
}

/// Calls body(begin, end) on disjoint ranges covering [0, n), on several threads when the
/// work (n * cost_per_item, e.g. multiply-adds per output row) is large enough to pay for
/// them. Each index is handled by exactly one call in the same way, so results do not depend
/// on the thread count: the reference stays exact while whole models run in reasonable time.
template <typename F>
void parallel_ranges(int64_t n, int64_t cost_per_item, F&& body) {
  constexpr int64_t kWorkPerThread = int64_t{1} << 24;
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads = std::min({cores, int64_t{32}, n, n * std::max<int64_t>(cost_per_item, 1) / kWorkPerThread});
  if (threads <= 1) {
    if (n > 0) body(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  const int64_t chunk = (n + threads - 1) / threads;
  for (int64_t begin = chunk; begin < n; begin += chunk) {
    const int64_t end = std::min(n, begin + chunk);
    try {
      pool.emplace_back([&body, begin, end] { body(begin, end); });
    } catch (const std::system_error&) {
      body(begin, end);  // no thread to be had (a process limit): this range runs here
    }
  }
  body(int64_t{0}, std::min(n, chunk));
  for (std::thread& t : pool) t.join();
}

inline int64_t product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

/// Walks every element of `out_shape` in row-major order and tracks, for each input, the flat
/// offset that numpy broadcasting maps it to (inputs are right-aligned; size-1 dims repeat).
///
///   BroadcastWalker w(out, {a.shape(), b.shape()});
///   for (int64_t i = 0; i < numel; ++i, w.next()) out[i] = a[w.offset(0)] + b[w.offset(1)];
class BroadcastWalker {
 public:
  BroadcastWalker(const std::vector<int64_t>& out_shape,
                  const std::vector<std::vector<int64_t>>& in_shapes)
      : out_(out_shape), index_(out_shape.size(), 0), offsets_(in_shapes.size(), 0) {
    const size_t rank = out_shape.size();
    strides_.resize(in_shapes.size());
    for (size_t k = 0; k < in_shapes.size(); ++k) {
      const auto& s = in_shapes[k];
      std::vector<int64_t> full(rank, 0);
      std::vector<int64_t> cs = contiguous_strides(s);
      const size_t lead = rank - s.size();
      for (size_t d = 0; d < s.size(); ++d) full[lead + d] = (s[d] == 1) ? 0 : cs[d];
      strides_[k] = std::move(full);
    }
  }
  int64_t offset(size_t input) const { return offsets_[input]; }
  const std::vector<int64_t>& index() const { return index_; }

  void next() {
    for (int64_t d = static_cast<int64_t>(out_.size()) - 1; d >= 0; --d) {
      const size_t du = static_cast<size_t>(d);
      ++index_[du];
      for (size_t k = 0; k < offsets_.size(); ++k) offsets_[k] += strides_[k][du];
      if (index_[du] < out_[du]) return;
      for (size_t k = 0; k < offsets_.size(); ++k) offsets_[k] -= strides_[k][du] * index_[du];
      index_[du] = 0;
    }
  }

 private:
  std::vector<int64_t> out_;
  std::vector<int64_t> index_;
  std::vector<int64_t> offsets_;
  std::vector<std::vector<int64_t>> strides_;
};

}  // namespace kiln
