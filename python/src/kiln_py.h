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

/// Keeps a Python object alive from C++; drops it under the GIL (see keep_alive in convert.cpp).
std::shared_ptr<const void> keep_object_alive(nb::handle o);

// ---- torch tensors without DLPack exports (torch_tensors.cpp) ----

inline constexpr int kNumDTypes = 13;      ///< Kiln's dtypes, DType::kF64 .. DType::kBool
inline constexpr int kMaxTorchRank = 8;  ///< the runtime's KILN_MAX_RANK; more takes the general path

/// PyTorch's objects the torch fast paths use, looked up once. Its references are never released.
struct TorchApi {
  PyTypeObject* tensor = nullptr;     ///< torch.Tensor
  PyTypeObject* parameter = nullptr;  ///< torch.nn.Parameter
  PyObject* dtypes[kNumDTypes] = {};  ///< the torch dtype of each Kiln dtype (null: none)
  PyObject* empty_strided = nullptr;  ///< torch.empty_strided
  PyObject* from_dlpack = nullptr;    ///< torch._C._from_dlpack (takes a capsule)
  PyObject* raw_stream = nullptr;     ///< torch._C._cuda_getCurrentRawStream; null without CUDA
  PyObject* empty_kwnames = nullptr;  ///< ("dtype", "device")
  PyObject* cpu = nullptr;            ///< torch.device("cpu")
  PyObject *s_dtype = nullptr, *s_shape = nullptr, *s_is_cpu = nullptr, *s_is_cuda = nullptr,
           *s_get_device = nullptr, *s_is_contiguous = nullptr, *s_data_ptr = nullptr,
           *s_version = nullptr;
};
/// The API, or null while torch is not loaded (then no argument can be a torch tensor).
const TorchApi* torch_api();

/// What a dense torch tensor holds, read through its attributes.
struct TorchTensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int device = -1;  ///< -1: host memory; otherwise the CUDA device's index
  int rank = 0;
  int64_t dims[kMaxTorchRank] = {};
};
/// Fills `out` for a torch.Tensor (or Parameter) of a Kiln dtype, C-contiguous, on the CPU or a
/// CUDA device, of rank <= 8; false for anything else (the caller's general path then converts,
/// copies or explains). `expect_cuda`: CUDA tensors are the likely ones (asked about first).
bool read_torch_tensor(const TorchApi& api, PyObject* o, TorchTensorView& out, bool expect_cuda = false);
/// A host torch tensor viewing `t`'s bytes and keeping them alive (zero-copy); throws for i4.
nb::object torch_from_tensor(const TorchApi& api, Tensor t);
/// A host torch tensor owning `bytes`, of dtype `t` and shape dims[0..rank).
nb::object torch_from_buffer(const TorchApi& api, std::unique_ptr<std::byte[]> bytes, DType t, const int64_t* dims,
                             int rank);
/// A row-major tensor's size and strides as tuples, for torch_empty.
struct TorchLayout {
  nb::object size, stride;
};
TorchLayout torch_layout(const int64_t* dims, int rank);
/// A new row-major tensor: torch.empty_strided(size, stride, dtype=t, device=device).
nb::object torch_empty(const TorchApi& api, const TorchLayout& layout, DType t, nb::handle device);
/// tensor.data_ptr().
void* torch_data_ptr(const TorchApi& api, nb::handle tensor);

void bind_graph(nb::module_& m);
void bind_runtime(nb::module_& m);
void bind_torch(nb::module_& m);

}  // namespace kiln::py
