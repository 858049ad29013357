// Host tensors: storage, element access with exact dtype conversion.
#include "kiln/ir/tensor.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace kiln {
namespace {

std::shared_ptr<std::byte[]> allocate_zeroed(size_t n) {
  // new T[n]() value-initializes (zeroes) the bytes.
  return std::shared_ptr<std::byte[]>(new std::byte[n == 0 ? 1 : n]());
}

int64_t wrap_to_width(int64_t v, DType t) {
  switch (t) {
    case DType::kI32: return static_cast<int32_t>(static_cast<uint32_t>(v));
    case DType::kI16: return static_cast<int16_t>(static_cast<uint16_t>(v));
    case DType::kI8: return static_cast<int8_t>(static_cast<uint8_t>(v));
    case DType::kU8: return static_cast<uint8_t>(v);
    case DType::kI4: {
      int64_t n = v & 0xF;
      return n >= 8 ? n - 16 : n;
    }
    case DType::kBool: return v != 0;
    default: return v;
  }
}

/// Truncates toward zero; NaN gives 0 and out-of-range values clamp to the int64 range
/// (float→int casts are undefined behaviour in C++ otherwise).
int64_t f64_to_i64(double v) {
  if (std::isnan(v)) return 0;
  if (v >= 9.2233720368547758e18) return std::numeric_limits<int64_t>::max();
  if (v <= -9.2233720368547758e18) return std::numeric_limits<int64_t>::min();
  return static_cast<int64_t>(v);
}

template <typename T>
T load(const std::byte* p, int64_t i) {
  T v;
  std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}

template <typename T>
void store(std::byte* p, int64_t i, T v) {
  std::memcpy(p + i * static_cast<int64_t>(sizeof(T)), &v, sizeof(T));
}

}  // namespace

Tensor::Tensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  int64_t n = 1;
  for (int64_t d : shape_) {
    if (d < 0) throw std::invalid_argument("negative tensor dimension");
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d)
      throw std::length_error("tensor element count overflows int64");
    n *= d;
  }
  auto bytes = allocate_zeroed(static_cast<size_t>(dtype_storage_bytes(dtype_, n)));
  data_ = bytes.get();
  storage_ = std::move(bytes);
  owns_bytes_ = true;
}

Tensor Tensor::wrap(DType dtype, std::vector<int64_t> shape, const std::byte* bytes,
                    std::shared_ptr<const void> owner) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.data_ = bytes;
  t.storage_ = std::move(owner);
  t.owns_bytes_ = false;
  return t;
}

Tensor Tensor::from_f64(DType dtype, std::vector<int64_t> shape, std::span<const double> values) {
  Tensor t(dtype, std::move(shape));
  if (static_cast<int64_t>(values.size()) != t.numel())
    throw std::invalid_argument("Tensor::from_f64: value count does not match shape");
  for (size_t i = 0; i < values.size(); ++i) t.set_f64(static_cast<int64_t>(i), values[i]);
  return t;
}

Tensor Tensor::from_i64(DType dtype, std::vector<int64_t> shape, std::span<const int64_t> values) {
  Tensor t(dtype, std::move(shape));
  if (static_cast<int64_t>(values.size()) != t.numel())
    throw std::invalid_argument("Tensor::from_i64: value count does not match shape");
  for (size_t i = 0; i < values.size(); ++i) t.set_i64(static_cast<int64_t>(i), values[i]);
  return t;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

std::byte* Tensor::mutable_data() {
  // Copy on write: never write through shared or borrowed (e.g. mmap'ed) storage.
  if (!owns_bytes_ || storage_.use_count() > 1) {
    const size_t n = nbytes();
    auto bytes = allocate_zeroed(n);
    if (n) std::memcpy(bytes.get(), data_, n);
    data_ = bytes.get();
    storage_ = std::move(bytes);
    owns_bytes_ = true;
  }
  return const_cast<std::byte*>(data_);
}

double Tensor::get_f64(int64_t i) const {
  switch (dtype_) {
    case DType::kF64: return load<double>(data_, i);
    case DType::kF32: return load<float>(data_, i);
    case DType::kF16: return f16_bits_to_f32(load<uint16_t>(data_, i));
    case DType::kBF16: return bf16_bits_to_f32(load<uint16_t>(data_, i));
    case DType::kF8E4M3FN: return f8e4m3fn_bits_to_f32(load<uint8_t>(data_, i));
    case DType::kF8E5M2: return f8e5m2_bits_to_f32(load<uint8_t>(data_, i));
    default: return static_cast<double>(get_i64(i));
  }
}

int64_t Tensor::get_i64(int64_t i) const {
  switch (dtype_) {
    case DType::kI64: return load<int64_t>(data_, i);
    case DType::kI32: return load<int32_t>(data_, i);
    case DType::kI16: return load<int16_t>(data_, i);
    case DType::kI8: return load<int8_t>(data_, i);
    case DType::kU8: return load<uint8_t>(data_, i);
    case DType::kBool: return load<uint8_t>(data_, i) != 0;
    case DType::kI4: {
      const uint8_t byte = load<uint8_t>(data_, i / 2);
      return wrap_to_width((i % 2 == 0) ? (byte & 0xF) : (byte >> 4), DType::kI4);
    }
    default: return f64_to_i64(get_f64(i));
  }
}

void Tensor::set_f64(int64_t i, double v) {
  std::byte* p = mutable_data();
  switch (dtype_) {
    case DType::kF64: store<double>(p, i, v); return;
    case DType::kF32: store<float>(p, i, static_cast<float>(v)); return;
    case DType::kF16: store<uint16_t>(p, i, f64_to_f16_bits(v)); return;
    case DType::kBF16: store<uint16_t>(p, i, f64_to_bf16_bits(v)); return;
    case DType::kF8E4M3FN: store<uint8_t>(p, i, f64_to_f8e4m3fn_bits(v)); return;
    case DType::kF8E5M2: store<uint8_t>(p, i, f64_to_f8e5m2_bits(v)); return;
    case DType::kBool: store<uint8_t>(p, i, v != 0 ? 1 : 0); return;
    default: set_i64(i, f64_to_i64(v)); return;
  }
}

void Tensor::set_i64(int64_t i, int64_t v) {
  std::byte* p = mutable_data();
  switch (dtype_) {
    case DType::kI64: store<int64_t>(p, i, v); return;
    case DType::kI32: store<int32_t>(p, i, static_cast<int32_t>(wrap_to_width(v, dtype_))); return;
    case DType::kI16: store<int16_t>(p, i, static_cast<int16_t>(wrap_to_width(v, dtype_))); return;
    case DType::kI8: store<int8_t>(p, i, static_cast<int8_t>(wrap_to_width(v, dtype_))); return;
    case DType::kU8: store<uint8_t>(p, i, static_cast<uint8_t>(wrap_to_width(v, dtype_))); return;
    case DType::kBool: store<uint8_t>(p, i, v != 0 ? 1 : 0); return;
    case DType::kI4: {
      uint8_t byte = load<uint8_t>(p, i / 2);
      const uint8_t nib = static_cast<uint8_t>(v & 0xF);
      byte = (i % 2 == 0) ? static_cast<uint8_t>((byte & 0xF0) | nib)
                          : static_cast<uint8_t>((byte & 0x0F) | (nib << 4));
      store<uint8_t>(p, i / 2, byte);
      return;
    }
    default: set_f64(i, static_cast<double>(v)); return;
  }
}

std::vector<double> Tensor::to_f64() const {
  std::vector<double> out(static_cast<size_t>(numel()));
  if (dtype_ == DType::kF32) {
    const float* f = data_as<float>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = f[i];
    return out;
  }
  for (size_t i = 0; i < out.size(); ++i) out[i] = get_f64(static_cast<int64_t>(i));
  return out;
}

std::vector<int64_t> Tensor::to_i64() const {
  std::vector<int64_t> out(static_cast<size_t>(numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = get_i64(static_cast<int64_t>(i));
  return out;
}

Tensor Tensor::reshaped(std::vector<int64_t> shape) const {
  Tensor t = *this;
  t.shape_ = std::move(shape);
  if (t.numel() != numel()) throw std::invalid_argument("Tensor::reshaped: element count differs");
  return t;
}

bool Tensor::identical(const Tensor& other) const {
  if (dtype_ != other.dtype_ || shape_ != other.shape_) return false;
  const size_t n = nbytes();
  return n == 0 || std::memcmp(data_, other.data_, n) == 0;
}

}  // namespace kiln
