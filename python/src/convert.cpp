// Python arrays (NumPy, anything with DLPack) to Kiln tensors and back, without copies where
// the layouts allow.
#include <cstring>

#include "kiln/ir/dtype.h"
#include "kiln_py.h"

namespace kiln::py {

using nb::dlpack::dtype_code;

DType dtype_from_dlpack(nb::dlpack::dtype d, const std::string& what) {
  const auto code = static_cast<dtype_code>(d.code);
  if (d.lanes == 1) {
    if (code == dtype_code::Float && d.bits == 64) return DType::kF64;
    if (code == dtype_code::Float && d.bits == 32) return DType::kF32;
    if (code == dtype_code::Float && d.bits == 16) return DType::kF16;
    if (code == dtype_code::Bfloat && d.bits == 16) return DType::kBF16;
    if (code == dtype_code::Float8_E4M3FN && d.bits == 8) return DType::kF8E4M3FN;
    if (code == dtype_code::Float8_E5M2 && d.bits == 8) return DType::kF8E5M2;
    if (code == dtype_code::Int && d.bits == 64) return DType::kI64;
    if (code == dtype_code::Int && d.bits == 32) return DType::kI32;
    if (code == dtype_code::Int && d.bits == 16) return DType::kI16;
    if (code == dtype_code::Int && d.bits == 8) return DType::kI8;
    if (code == dtype_code::UInt && d.bits == 8) return DType::kU8;
    if (code == dtype_code::Bool && d.bits == 8) return DType::kBool;
  }
  throw KilnError(what + ": element type (DLPack code " + std::to_string(d.code) + ", " + std::to_string(d.bits) +
                  " bits) has no Kiln dtype");
}

nb::dlpack::dtype dlpack_from_dtype(DType t) {
  auto make = [](dtype_code c, int bits) {
    nb::dlpack::dtype d;
    d.code = static_cast<uint8_t>(c);
    d.bits = static_cast<uint8_t>(bits);
    d.lanes = 1;
    return d;
  };
  switch (t) {
    case DType::kF64: return make(dtype_code::Float, 64);
    case DType::kF32: return make(dtype_code::Float, 32);
    case DType::kF16: return make(dtype_code::Float, 16);
    case DType::kBF16: return make(dtype_code::Bfloat, 16);
    case DType::kF8E4M3FN: return make(dtype_code::Float8_E4M3FN, 8);
    case DType::kF8E5M2: return make(dtype_code::Float8_E5M2, 8);
    case DType::kI64: return make(dtype_code::Int, 64);
    case DType::kI32: return make(dtype_code::Int, 32);
    case DType::kI16: return make(dtype_code::Int, 16);
    case DType::kI8: return make(dtype_code::Int, 8);
    case DType::kU8: return make(dtype_code::UInt, 8);
    case DType::kBool: return make(dtype_code::Bool, 8);
    case DType::kI4: break;
  }
  throw KilnError("dtype " + std::string(dtype_name(t)) + " has no array equivalent");
}

namespace {

/// Keeps an array (and the Python object it views) alive from C++; drops it under the GIL:
/// Kiln may release a tensor on a thread that does not hold it, e.g. inside a compile that
/// released the GIL.
std::shared_ptr<const void> keep_alive(const nb::ndarray<nb::ro>& a) {
  auto* held = new nb::ndarray<nb::ro>(a);
  return std::shared_ptr<const void>(held, [](const void* p) {
    auto* array = static_cast<const nb::ndarray<nb::ro>*>(p);
    if (!Py_IsInitialized()) return;  // at exit: leak rather than touch a dead interpreter
    nb::gil_scoped_acquire gil;
    delete array;
  });
}

}  // namespace

std::shared_ptr<const void> keep_object_alive(nb::handle o) {
  PyObject* held = nb::borrow(o).release().ptr();
  return std::shared_ptr<const void>(held, [](const void* p) {
    if (!Py_IsInitialized()) return;  // as keep_alive
    nb::gil_scoped_acquire gil;
    Py_DECREF(static_cast<PyObject*>(const_cast<void*>(p)));
  });
}

Tensor tensor_from_array(const nb::ndarray<nb::ro>& a, const std::string& what) {
  if (a.device_type() != nb::device::cpu::value)
    throw KilnError(what + ": the array is not in host memory (DLPack device type " +
                    std::to_string(a.device_type()) + ")");
  const DType dt = dtype_from_dlpack(a.dtype(), what);
  std::vector<int64_t> shape(a.ndim());
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    shape[i] = static_cast<int64_t>(a.shape(i));
    if (shape[i] != 1 && a.stride(i) != expected)
      throw KilnError(what + ": the array is not C-contiguous; pass a contiguous copy");
    expected *= shape[i];
  }
  if (a.size() == 0) return Tensor(dt, shape);
  return Tensor::wrap(dt, shape, static_cast<const std::byte*>(a.data()), keep_alive(a));
}

nb::object array_from_buffer(std::unique_ptr<std::byte[]> bytes, DType t, const std::vector<int64_t>& shape,
                             bool torch_out) {
  std::vector<size_t> dims(shape.begin(), shape.end());
  std::byte* data = bytes.release();
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<std::byte*>(p); });
  if (torch_out)
    return nb::ndarray<nb::pytorch>(data, dims.size(), dims.data(), owner, nullptr, dlpack_from_dtype(t)).cast();
  return nb::ndarray<nb::numpy>(data, dims.size(), dims.data(), owner, nullptr, dlpack_from_dtype(t)).cast();
}

nb::object array_from_tensor(const Tensor& t, bool torch_out) {
  if (t.dtype() == DType::kI4) throw KilnError("an i4 tensor has no array equivalent");
  const bool widen = !torch_out && (t.dtype() == DType::kBF16 || t.dtype() == DType::kF8E4M3FN ||
                                    t.dtype() == DType::kF8E5M2);
  if (widen) {
    const int64_t n = t.numel();
    auto bytes = std::make_unique<std::byte[]>(static_cast<size_t>(n) * 4);
    auto* out = reinterpret_cast<float*>(bytes.get());
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(t.get_f64(i));
    return array_from_buffer(std::move(bytes), DType::kF32, t.shape(), false);
  }
  // A heap copy of the Tensor handle owns the storage for as long as the array lives.
  auto* keep = new Tensor(t);
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  std::vector<size_t> dims(t.shape().begin(), t.shape().end());
  void* data = const_cast<std::byte*>(t.data());
  if (torch_out)
    return nb::ndarray<nb::pytorch>(data, dims.size(), dims.data(), owner, nullptr, dlpack_from_dtype(t.dtype())).cast();
  return nb::ndarray<nb::numpy>(data, dims.size(), dims.data(), owner, nullptr, dlpack_from_dtype(t.dtype())).cast();
}

}  // namespace kiln::py
