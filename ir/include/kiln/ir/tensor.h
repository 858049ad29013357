// Host tensors: the values the reference interpreter computes with and constants hold.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kiln/ir/dtype.h"
#include "kiln/ir/shape.h"

namespace kiln {

/// A dense, row-major host tensor with static shape.
///
/// Storage is shared (copying a Tensor is cheap and aliases the bytes); `mutable_data()`
/// copies first when the storage is shared, so writers never see each other. Storage can
/// wrap external memory (an mmap'ed weight file) without a copy.
/// i4 packs two elements per byte, element 2k in the low nibble of byte k.
/// bool is one byte per element holding 0 or 1.
class Tensor {
 public:
  Tensor() = default;
  /// Zero-filled tensor. Throws std::length_error when the size overflows (callers that
  /// take sizes from untrusted input check first).
  Tensor(DType dtype, std::vector<int64_t> shape);
  /// Wraps `bytes` (at least dtype_storage_bytes(dtype, numel) long) without copying;
  /// `owner` keeps the memory alive.
  static Tensor wrap(DType dtype, std::vector<int64_t> shape, const std::byte* bytes,
                     std::shared_ptr<const void> owner);

  /// Scalar or 1-D helpers for tests and constants.
  static Tensor from_f64(DType dtype, std::vector<int64_t> shape, std::span<const double> values);
  static Tensor from_i64(DType dtype, std::vector<int64_t> shape, std::span<const int64_t> values);
  static Tensor scalar_f64(DType dtype, double v) { return from_f64(dtype, {}, {&v, 1}); }
  static Tensor scalar_i64(DType dtype, int64_t v) { return from_i64(dtype, {}, {&v, 1}); }

  bool defined() const { return storage_ != nullptr || numel() == 0; }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t rank() const { return static_cast<int64_t>(shape_.size()); }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(dtype_storage_bytes(dtype_, numel())); }
  TensorType type() const { return TensorType{dtype_, shape_of(shape_)}; }

  const std::byte* data() const { return data_; }
  std::byte* mutable_data();
  template <typename T> const T* data_as() const { return reinterpret_cast<const T*>(data_); }
  template <typename T> T* mutable_data_as() { return reinterpret_cast<T*>(mutable_data()); }

  /// Element access by flat (row-major) index, converting exactly where the type allows.
  double get_f64(int64_t i) const;
  int64_t get_i64(int64_t i) const;  ///< floats truncate toward zero
  void set_f64(int64_t i, double v);  ///< rounds to nearest even for narrow floats; ints truncate
  void set_i64(int64_t i, int64_t v); ///< wraps to the integer width

  /// All elements as f64 / i64 (convenient for reference kernels).
  std::vector<double> to_f64() const;
  std::vector<int64_t> to_i64() const;

  /// Same bytes, new shape with the same numel.
  Tensor reshaped(std::vector<int64_t> shape) const;
  /// Bitwise equality of dtype, shape and bytes.
  bool identical(const Tensor& other) const;

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  std::shared_ptr<const void> storage_;  // owner of the bytes
  const std::byte* data_ = nullptr;
  bool owns_bytes_ = false;  // false for wrapped memory: written only after a copy
};

}  // namespace kiln
