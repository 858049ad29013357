// torch tensors in and out of Kiln without DLPack exports or per-input Python: a plain dense
// tensor's pointer, dtype, shape and device are read through its attributes, host outputs
// become torch tensors through one DLPack capsule made here, and CUDA outputs come from
// torch.empty_strided (PyTorch's allocator, ordered on its stream).
#include <nanobind/stl/vector.h>

#include <cstring>

#include "kiln_py.h"

namespace kiln::py {

namespace {

/// A reference that is never released: the API lives as long as the interpreter.
PyObject* leak(nb::object o) { return o.release().ptr(); }

/// torch's dtype name for each Kiln dtype, in DType order (i4: none).
constexpr const char* kTorchDTypeNames[kNumDTypes] = {
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint8", nullptr, "bool"};

TorchApi make_torch_api(nb::handle torch) {
  TorchApi api;
  api.tensor = reinterpret_cast<PyTypeObject*>(leak(torch.attr("Tensor")));
  api.parameter = reinterpret_cast<PyTypeObject*>(leak(torch.attr("nn").attr("Parameter")));
  for (int i = 0; i < kNumDTypes; ++i)
    if (kTorchDTypeNames[i] && nb::hasattr(torch, kTorchDTypeNames[i]))
      api.dtypes[i] = leak(torch.attr(kTorchDTypeNames[i]));
  // empty_strided parses its arguments faster than empty, which has more overloads (0.8 against
  // 1.2 us for a host tensor on the development machine).
  api.empty_strided = leak(torch.attr("empty_strided"));
  nb::object c = torch.attr("_C");
  api.from_dlpack = leak(c.attr("_from_dlpack"));
  // What torch.cuda.current_stream(i).cuda_stream is, without making a Stream; CPU-only builds lack it.
  if (nb::hasattr(c, "_cuda_getCurrentRawStream")) api.raw_stream = leak(c.attr("_cuda_getCurrentRawStream"));
  api.empty_kwnames = leak(nb::make_tuple("dtype", "device"));
  api.cpu = leak(torch.attr("device")("cpu"));
  api.s_dtype = leak(nb::str("dtype"));
  api.s_shape = leak(nb::str("shape"));
  api.s_is_cpu = leak(nb::str("is_cpu"));
  api.s_is_cuda = leak(nb::str("is_cuda"));
  api.s_get_device = leak(nb::str("get_device"));
  api.s_is_contiguous = leak(nb::str("is_contiguous"));
  api.s_data_ptr = leak(nb::str("data_ptr"));
  api.s_version = leak(nb::str("_version"));
  return api;
}

/// `o.name()` as a new reference; null (error cleared) when it raises.
PyObject* call_method(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(o, name);
  if (!r) PyErr_Clear();
  return r;
}

/// `o.name` as a new reference; null (error cleared) when it raises.
PyObject* get_attr(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_GetAttr(o, name);
  if (!r) PyErr_Clear();
  return r;
}

/// Whether `o.name` is True (false when it raises).
bool attr_is_true(PyObject* o, PyObject* name) {
  PyObject* r = get_attr(o, name);
  Py_XDECREF(r);  // only compared with True, which outlives it
  return r == Py_True;
}

/// An unversioned DLPack tensor (what every torch version imports) owning its shape and the
/// bytes it views (a Kiln tensor's storage or a buffer of ours).
struct ManagedTensor {
  nb::dlpack::dltensor dl;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
  int64_t shape[kMaxTorchRank];
  Tensor tensor;
  std::unique_ptr<std::byte[]> bytes;
};

void delete_managed(ManagedTensor* m) { delete m; }

/// torch._C._from_dlpack on a capsule holding `m`; the capsule frees it unless torch took it.
nb::object import_managed(const TorchApi& api, std::unique_ptr<ManagedTensor> m) {
  m->dl.shape = m->shape;
  m->dl.strides = nullptr;  // row-major
  m->dl.device = {nb::device::cpu::value, 0};
  m->deleter = delete_managed;
  PyObject* capsule = PyCapsule_New(m.get(), "dltensor", [](PyObject* c) {
    // A consumer renames the capsule "used_dltensor" and frees the tensor itself.
    if (PyCapsule_IsValid(c, "dltensor"))
      delete static_cast<ManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
  });
  if (!capsule) throw nb::python_error();
  m.release();
  nb::object owner = nb::steal(capsule);
  PyObject* t = PyObject_CallOneArg(api.from_dlpack, capsule);
  if (!t) throw nb::python_error();
  return nb::steal(t);
}

}  // namespace

const TorchApi* torch_api() {
  static TorchApi api;
  static bool ready = false;
  if (ready) return &api;
  // Only a loaded torch can have made a tensor: never import it here.
  PyObject* torch = PyDict_GetItemString(PySys_GetObject("modules"), "torch");
  if (!torch) return nullptr;
  try {
    api = make_torch_api(nb::handle(torch));
  } catch (const nb::python_error&) {
    return nullptr;  // torch still being imported: the general paths serve until it is whole
  }
  ready = true;
  return &api;
}

bool read_torch_tensor(const TorchApi& api, PyObject* o, TorchTensorView& out, bool expect_cuda) {
  PyTypeObject* type = Py_TYPE(o);
  if (type != api.tensor && type != api.parameter) return false;  // subclasses may override anything
  nb::object dtype = nb::steal(get_attr(o, api.s_dtype));
  int found = -1;
  for (int i = 0; i < kNumDTypes && dtype.is_valid(); ++i)
    if (api.dtypes[i] == dtype.ptr()) found = i;
  if (found < 0) return false;
  out.dtype = static_cast<DType>(found);

  nb::object shape = nb::steal(get_attr(o, api.s_shape));
  if (!shape.is_valid() || !PyTuple_Check(shape.ptr())) return false;
  const Py_ssize_t rank = PyTuple_GET_SIZE(shape.ptr());
  if (rank > kMaxTorchRank) return false;
  out.rank = static_cast<int>(rank);
  for (Py_ssize_t i = 0; i < rank; ++i) {
    out.dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), i));
    if (out.dims[i] == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  }

  // The device the caller expects is asked first: one attribute less per input on its device.
  const bool on_cuda = expect_cuda ? attr_is_true(o, api.s_is_cuda) : !attr_is_true(o, api.s_is_cpu);
  if (on_cuda) {
    if (!expect_cuda && !attr_is_true(o, api.s_is_cuda)) return false;  // meta, lazy, other accelerators
    nb::object index = nb::steal(call_method(o, api.s_get_device));
    if (!index.is_valid()) return false;
    out.device = static_cast<int>(PyLong_AsLong(index.ptr()));
    if (out.device < 0) {
      PyErr_Clear();
      return false;
    }
  } else {
    if (expect_cuda && !attr_is_true(o, api.s_is_cpu)) return false;
    out.device = -1;
  }

  nb::object contiguous = nb::steal(call_method(o, api.s_is_contiguous));
  if (contiguous.ptr() != Py_True) return false;
  nb::object ptr = nb::steal(call_method(o, api.s_data_ptr));  // raises for tensors without storage
  if (!ptr.is_valid()) return false;
  out.data = PyLong_AsVoidPtr(ptr.ptr());
  if (!out.data && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

nb::object torch_from_tensor(const TorchApi& api, Tensor t) {
  if (t.dtype() == DType::kI4) throw KilnError("an i4 tensor has no array equivalent");
  auto m = std::make_unique<ManagedTensor>();
  const auto& shape = t.shape();
  if (shape.size() > kMaxTorchRank) throw KilnError("an output of rank " + std::to_string(shape.size()) +
                                                    " has no torch equivalent here (at most 8 dimensions)");
  std::copy(shape.begin(), shape.end(), m->shape);
  m->dl.ndim = static_cast<int32_t>(shape.size());
  m->dl.dtype = dlpack_from_dtype(t.dtype());
  m->dl.data = const_cast<std::byte*>(t.data());
  m->tensor = std::move(t);
  return import_managed(api, std::move(m));
}

nb::object torch_from_buffer(const TorchApi& api, std::unique_ptr<std::byte[]> bytes, DType t, const int64_t* dims,
                             int rank) {
  auto m = std::make_unique<ManagedTensor>();
  std::copy(dims, dims + rank, m->shape);
  m->dl.ndim = rank;
  m->dl.dtype = dlpack_from_dtype(t);
  m->dl.data = bytes.get();
  m->bytes = std::move(bytes);
  return import_managed(api, std::move(m));
}

namespace {

nb::object int_tuple(const int64_t* values, int n) {
  nb::object t = nb::steal(PyTuple_New(n));
  if (!t.is_valid()) throw nb::python_error();
  for (int i = 0; i < n; ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (!v) throw nb::python_error();
    PyTuple_SET_ITEM(t.ptr(), i, v);
  }
  return t;
}

}  // namespace

TorchLayout torch_layout(const int64_t* dims, int rank) {
  int64_t strides[kMaxTorchRank];
  int64_t stride = 1;
  for (int i = rank; i-- > 0;) {
    strides[i] = stride;
    stride *= dims[i] > 1 ? dims[i] : 1;
  }
  return {int_tuple(dims, rank), int_tuple(strides, rank)};
}

nb::object torch_empty(const TorchApi& api, const TorchLayout& layout, DType t, nb::handle device) {
  PyObject* args[] = {nullptr, layout.size.ptr(), layout.stride.ptr(), api.dtypes[static_cast<int>(t)], device.ptr()};
  PyObject* r = PyObject_Vectorcall(api.empty_strided, args + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, api.empty_kwnames);
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

void* torch_data_ptr(const TorchApi& api, nb::handle tensor) {
  PyObject* r = PyObject_CallMethodNoArgs(tensor.ptr(), api.s_data_ptr);
  if (!r) throw nb::python_error();
  void* p = PyLong_AsVoidPtr(r);
  Py_DECREF(r);
  if (!p && PyErr_Occurred()) throw nb::python_error();
  return p;
}

namespace {

/// The weights a compiled part froze into Kiln constants, and what each was when frozen: the
/// object, its data pointer and its version counter (which every in-place op on it or on a view
/// of it bumps). unchanged() says, per call and without Python per weight, whether the part may
/// still run: a weight swapped for another tensor, moved to other memory (`p.data = t`) or
/// written in place since makes it false, and the caller rebuilds or runs PyTorch's graph.
/// Writes through `p.data` are not seen: `.data` is a tensor with a version counter of its own.
///
/// Per weight and call: an identity check; the version read from a detached alias (a plain
/// tensor sharing the parameter's counter) and the data pointer, each through TensorBase's own
/// getter and method (about 0.1 us a weight on the development machine).
class WeightWatch {
 public:
  /// tensors[k] is what the call's argument list holds at positions[k] (-1: the tensor is not
  /// passed; it is checked as held).
  WeightWatch(nb::list tensors, std::vector<Py_ssize_t> positions) : positions_(std::move(positions)) {
    if (positions_.size() != tensors.size()) throw KilnError("WeightWatch: one position per tensor");
    const TorchApi* api = torch_api();
    if (!api) throw KilnError("WeightWatch: torch is not loaded");
    // TensorBase's own `_version` getter and `data_ptr` method, called without looking them up
    // on each tensor's type (what an attribute read or a method call does first).
    nb::object base = nb::module_::import_("torch").attr("_C").attr("TensorBase");
    PyObject* base_dict = reinterpret_cast<PyTypeObject*>(base.ptr())->tp_dict;
    PyObject* version = base_dict ? PyDict_GetItemString(base_dict, "_version") : nullptr;
    PyObject* data_ptr = base_dict ? PyDict_GetItemString(base_dict, "data_ptr") : nullptr;
    if (version && Py_TYPE(version)->tp_descr_get && data_ptr && PyCallable_Check(data_ptr)) {
      version_getter_ = nb::borrow(version);
      data_ptr_method_ = nb::borrow(data_ptr);
    }
    for (nb::handle t : tensors) {
      void* data = nullptr;
      if (!read_data_ptr(*api, t.ptr(), data)) throw KilnError("WeightWatch: a weight is not a tensor with storage");
      nb::object alias = t.attr("detach")();
      long long version = 0;
      if (!read_version(*api, alias.ptr(), version)) throw KilnError("WeightWatch: a weight has no version counter");
      seen_.push_back({nb::borrow(t), std::move(alias), data, version});
    }
  }

  bool unchanged(nb::handle args) const {
    const TorchApi* api = torch_api();
    PyObject* a = args.ptr();
    const bool is_list = PyList_CheckExact(a), is_tuple = PyTuple_CheckExact(a);
    if (!api || (!is_list && !is_tuple)) return false;
    const Py_ssize_t n = is_list ? PyList_GET_SIZE(a) : PyTuple_GET_SIZE(a);
    for (size_t k = 0; k < seen_.size(); ++k) {
      const Py_ssize_t at = positions_[k];
      if (at >= 0 && (at >= n || (is_list ? PyList_GET_ITEM(a, at) : PyTuple_GET_ITEM(a, at)) != seen_[k].tensor.ptr()))
        return false;
      long long version = 0;
      if (!read_version(*api, seen_[k].alias.ptr(), version) || version != seen_[k].version) return false;
    }
    for (const Seen& s : seen_) {
      void* data = nullptr;
      if (!read_data_ptr(*api, s.tensor.ptr(), data) || data != s.data) return false;
    }
    return true;
  }

  size_t size() const { return seen_.size(); }

 private:
  struct Seen {
    nb::object tensor, alias;  // the weight, and a detached tensor sharing its version counter
    void* data;
    long long version;
  };

  bool read_version(const TorchApi& api, PyObject* t, long long& version) const {
    PyObject* v = version_getter_.is_valid()
                      ? Py_TYPE(version_getter_.ptr())->tp_descr_get(version_getter_.ptr(), t, nullptr)
                      : PyObject_GetAttr(t, api.s_version);
    if (!v) {
      PyErr_Clear();
      return false;
    }
    version = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (version == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }

  bool read_data_ptr(const TorchApi& api, PyObject* t, void*& data) const {
    PyObject* p = data_ptr_method_.is_valid() ? PyObject_Vectorcall(data_ptr_method_.ptr(), &t, 1, nullptr)
                                              : PyObject_CallMethodNoArgs(t, api.s_data_ptr);
    if (!p) {
      PyErr_Clear();
      return false;
    }
    data = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }

  std::vector<Py_ssize_t> positions_;
  std::vector<Seen> seen_;
  nb::object version_getter_, data_ptr_method_;  // TensorBase's; unset: looked up per tensor
};

}  // namespace

void bind_torch(nb::module_& m) {
  nb::class_<WeightWatch>(m, "_WeightWatch", "frozen weights, and whether they are as they were when frozen")
      .def(nb::init<nb::list, std::vector<Py_ssize_t>>(), nb::arg("tensors"), nb::arg("positions"))
      .def("unchanged", &WeightWatch::unchanged, nb::arg("args").none(),
           "whether every weight is the same tensor, at the same address, unwritten since")
      .def("__len__", &WeightWatch::size);
}

}  // namespace kiln::py
