// Shared pieces of the `kiln._kiln` extension module: the exception type, status handling
// and the conversions between Python arrays and Kiln tensors.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln::py {

namespace nb = nanobind;

/// Raised for every Kiln failure; Python sees it as `kiln.KilnError` with Kiln's message.
struct KilnError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Throws KilnError for a failed status.
inline void check(const Status& s) {
  if (!s.ok()) throw KilnError(s.message());
}
template <typename T>
T take(StatusOr<T> s) {
  if (!s.ok()) throw KilnError(s.status().message());
  return std::move(*s);
}

/// Kiln's dtype for a DLPack one; throws KilnError naming `what` for a dtype Kiln lacks.
DType dtype_from_dlpack(nb::dlpack::dtype d, const std::string& what);
/// The DLPack dtype of Kiln's `t`; throws for i4, f8 (no DLPack spelling frameworks share).
nb::dlpack::dtype dlpack_from_dtype(DType t);

/// Wraps a C-contiguous host array without copying; the tensor keeps the Python object alive.
Tensor tensor_from_array(const nb::ndarray<nb::ro>& a, const std::string& what);
/// A NumPy array (`torch_out`: a torch tensor) viewing `t`'s bytes, which it keeps alive.
/// NumPy has no bf16: those widen to f32 unless `torch_out`.
nb::object array_from_tensor(const Tensor& t, bool torch_out);
/// A NumPy or torch array owning `bytes` (moved in), of Kiln dtype `t` and shape `shape`.
nb::object array_from_buffer(std::unique_ptr<std::byte[]> bytes, DType t, const std::vector<int64_t>& shape,
                             bool torch_out);

void bind_graph(nb::module_& m);
void bind_runtime(nb::module_& m);

}  // namespace kiln::py
