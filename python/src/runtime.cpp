// kiln.Runtime and kiln.Model: the runtime's C API (kiln/runtime.h) for Python. Host arrays
// go through kiln_model_run; outputs come back as new arrays.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>

#include "kiln/runtime.h"
#include "kiln_py.h"

namespace kiln::py {

namespace {

/// Throws KilnError with the runtime's message, releasing the status.
void check_rt(kiln_status* st) {
  if (!st) return;
  std::string msg = kiln_status_get_message(st);
  kiln_status_release(st);
  throw KilnError(msg);
}

struct PyRuntime {
  std::shared_ptr<kiln_runtime> rt;
  int device = 0;
};

struct PyModel {
  std::shared_ptr<kiln_runtime> rt;  // outlives the model
  std::shared_ptr<kiln_model> m;
  int device = 0;
  std::vector<kiln_tensor_info> inputs, outputs;
  // For torch CUDA outputs, made on first use: each output's size and strides, the torch.device
  // and its index as an int (the argument of the current-stream lookup).
  std::vector<TorchLayout> torch_layouts;
  nb::object torch_device, device_index;
};

PyRuntime make_runtime(int device, bool cuda_graphs, uint64_t memory_limit) {
  kiln_runtime_options o;
  kiln_runtime_options_initialize(&o);
  o.device_ordinal = device;
  o.use_cuda_graphs = cuda_graphs ? 1 : 0;
  o.device_memory_limit = memory_limit;
  kiln_runtime* rt = nullptr;
  {
    nb::gil_scoped_release nogil;
    check_rt(kiln_runtime_create(&o, &rt));
  }
  return {std::shared_ptr<kiln_runtime>(rt, kiln_runtime_release), device};
}

PyModel finish_load(const PyRuntime& r, kiln_model* m) {
  PyModel pm{r.rt, std::shared_ptr<kiln_model>(m, kiln_model_release), r.device, {}, {}, {}, {}, {}};
  for (size_t i = 0; i < kiln_model_num_inputs(m); ++i) {
    kiln_tensor_info info;
    check_rt(kiln_model_input_info(m, i, &info));
    pm.inputs.push_back(info);
  }
  for (size_t i = 0; i < kiln_model_num_outputs(m); ++i) {
    kiln_tensor_info info;
    check_rt(kiln_model_output_info(m, i, &info));
    pm.outputs.push_back(info);
  }
  return pm;
}

const char* kDTypeNames[] = {"f64", "f32", "f16", "bf16", "f8e4m3fn", "f8e5m2", "i64", "i32", "i16", "i8", "u8", "i4", "bool"};

nb::list info_list(const std::vector<kiln_tensor_info>& infos) {
  nb::list out;
  for (const auto& t : infos) {
    nb::dict d;
    d["name"] = std::string(t.name);
    d["dtype"] = std::string(kDTypeNames[t.dtype]);
    nb::list shape;
    for (int i = 0; i < t.rank; ++i) shape.append(t.dims[i]);
    d["shape"] = shape;
    out.append(d);
  }
  return out;
}

/// Runs on host arrays: each input must have the model's dtype and shape (the package checks
/// and converts before calling); outputs are new arrays.
std::vector<nb::object> run_model(PyModel& pm, const std::vector<nb::ndarray<nb::ro>>& arrays, bool torch_out) {
  if (arrays.size() != pm.inputs.size())
    throw KilnError("the model takes " + std::to_string(pm.inputs.size()) + " inputs, got " + std::to_string(arrays.size()));
  std::vector<kiln_host_tensor> ins(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    const auto& a = arrays[i];
    const kiln_tensor_info& info = pm.inputs[i];
    auto what = [&] { return "input '" + std::string(info.name) + "'"; };  // for errors only: this runs per call
    if (a.device_type() != nb::device::cpu::value) throw KilnError(what() + ": not in host memory");
    const DType dt = dtype_from_dlpack(a.dtype(), "input");
    if (static_cast<int>(dt) != static_cast<int>(info.dtype))
      throw KilnError(what() + ": expected " + kDTypeNames[info.dtype] + ", got " + kDTypeNames[static_cast<int>(dt)]);
    bool same = static_cast<int>(a.ndim()) == info.rank;
    for (int d = 0; same && d < info.rank; ++d) same = static_cast<int64_t>(a.shape(static_cast<size_t>(d))) == info.dims[d];
    if (!same) throw KilnError(what() + ": shape differs from the model's");
    ins[i] = {const_cast<void*>(a.data()), info.bytes};
  }
  std::vector<std::unique_ptr<std::byte[]>> bufs;
  std::vector<kiln_host_tensor> outs(pm.outputs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    bufs.push_back(std::make_unique_for_overwrite<std::byte[]>(pm.outputs[i].bytes ? pm.outputs[i].bytes : 1));
    outs[i] = {bufs.back().get(), pm.outputs[i].bytes};
  }
  {
    nb::gil_scoped_release nogil;
    check_rt(kiln_model_run(pm.m.get(), ins.data(), ins.size(), outs.data(), outs.size()));
  }
  std::vector<nb::object> result;
  for (size_t i = 0; i < outs.size(); ++i) {
    const kiln_tensor_info& info = pm.outputs[i];
    std::vector<int64_t> shape(info.dims, info.dims + info.rank);
    result.push_back(array_from_buffer(std::move(bufs[i]), static_cast<DType>(info.dtype), shape, torch_out));
  }
  return result;
}

/// Runs on device memory in the order of the caller's CUDA stream (kiln_model_run_device): one
/// pointer per input and output, each to the model's bytes of it. The package checks dtypes,
/// shapes and devices before calling; plain integers keep the per-call conversions cheap.
void run_model_device(PyModel& pm, const std::vector<uintptr_t>& inputs, const std::vector<uintptr_t>& outputs,
                      uintptr_t stream) {
  if (inputs.size() != pm.inputs.size() || outputs.size() != pm.outputs.size())
    throw KilnError("the model takes " + std::to_string(pm.inputs.size()) + " inputs and " +
                    std::to_string(pm.outputs.size()) + " outputs, got " + std::to_string(inputs.size()) + " and " +
                    std::to_string(outputs.size()));
  std::vector<kiln_device_tensor> ins(inputs.size()), outs(outputs.size());
  for (size_t i = 0; i < ins.size(); ++i) ins[i] = {reinterpret_cast<void*>(inputs[i]), pm.inputs[i].bytes};
  for (size_t i = 0; i < outs.size(); ++i) outs[i] = {reinterpret_cast<void*>(outputs[i]), pm.outputs[i].bytes};
  nb::gil_scoped_release nogil;
  check_rt(kiln_model_run_device(pm.m.get(), ins.data(), ins.size(), outs.data(), outs.size(),
                                 reinterpret_cast<void*>(stream)));
}

/// A list holding `items` (moved in).
nb::object list_of(std::vector<nb::object>& items) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(items.size()));
  if (!list) throw nb::python_error();
  for (size_t i = 0; i < items.size(); ++i) PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), items[i].release().ptr());
  return nb::steal(list);
}

/// Model.run's fast path for torch tensors, all in host memory or all on the runtime's GPU,
/// each dense and of the model's dtype and shape: their pointers go straight to kiln_model_run
/// (outputs: new host tensors over buffers Kiln fills) or kiln_model_run_device on PyTorch's
/// current stream (outputs: torch.empty_strided), with no Python per input. None for anything else:
/// the package's general path then converts, copies, or raises naming the input.
nb::object run_model_torch(PyModel& pm, nb::handle xs) {
  const TorchApi* api = torch_api();
  if (!api || !PyList_CheckExact(xs.ptr())) return nb::none();
  const size_t n = static_cast<size_t>(PyList_GET_SIZE(xs.ptr()));
  if (n != pm.inputs.size() || n == 0) return nb::none();
  int device = 0;
  std::vector<void*> ptrs(n);
  for (size_t i = 0; i < n; ++i) {
    TorchTensorView v;
    if (!read_torch_tensor(*api, PyList_GET_ITEM(xs.ptr(), static_cast<Py_ssize_t>(i)), v, /*expect_cuda=*/true))
      return nb::none();
    const kiln_tensor_info& info = pm.inputs[i];
    if (static_cast<int>(v.dtype) != static_cast<int>(info.dtype) || v.rank != info.rank ||
        !std::equal(v.dims, v.dims + v.rank, info.dims))
      return nb::none();
    if (i == 0) device = v.device;
    if (v.device != device || (device >= 0 && device != pm.device)) return nb::none();
    ptrs[i] = v.data;
  }
  for (const kiln_tensor_info& o : pm.outputs)
    if (!api->dtypes[o.dtype] || o.bytes == 0) return nb::none();

  std::vector<nb::object> result(pm.outputs.size());
  if (device >= 0) {
    if (!api->raw_stream) return nb::none();
    if (pm.torch_layouts.empty()) {
      for (const kiln_tensor_info& o : pm.outputs) pm.torch_layouts.push_back(torch_layout(o.dims, o.rank));
      pm.torch_device = nb::module_::import_("torch").attr("device")("cuda", pm.device);
      pm.device_index = nb::int_(pm.device);
    }
    std::vector<kiln_device_tensor> ins(n), outs(result.size());
    for (size_t i = 0; i < n; ++i) ins[i] = {ptrs[i], pm.inputs[i].bytes};
    for (size_t i = 0; i < outs.size(); ++i) {
      result[i] = torch_empty(*api, pm.torch_layouts[i], static_cast<DType>(pm.outputs[i].dtype), pm.torch_device);
      outs[i] = {torch_data_ptr(*api, result[i]), pm.outputs[i].bytes};
    }
    PyObject* stream = PyObject_CallOneArg(api->raw_stream, pm.device_index.ptr());
    if (!stream) throw nb::python_error();
    void* raw = PyLong_AsVoidPtr(stream);
    Py_DECREF(stream);
    if (!raw && PyErr_Occurred()) throw nb::python_error();
    nb::gil_scoped_release nogil;
    check_rt(kiln_model_run_device(pm.m.get(), ins.data(), n, outs.data(), outs.size(), raw));
  } else {
    std::vector<kiln_host_tensor> ins(n), outs(result.size());
    std::vector<std::unique_ptr<std::byte[]>> bufs(result.size());
    for (size_t i = 0; i < n; ++i) ins[i] = {ptrs[i], pm.inputs[i].bytes};
    for (size_t i = 0; i < outs.size(); ++i) {
      bufs[i] = std::make_unique_for_overwrite<std::byte[]>(pm.outputs[i].bytes);
      outs[i] = {bufs[i].get(), pm.outputs[i].bytes};
    }
    {
      nb::gil_scoped_release nogil;
      check_rt(kiln_model_run(pm.m.get(), ins.data(), n, outs.data(), outs.size()));
    }
    for (size_t i = 0; i < outs.size(); ++i) {
      const kiln_tensor_info& o = pm.outputs[i];
      result[i] = torch_from_buffer(*api, std::move(bufs[i]), static_cast<DType>(o.dtype), o.dims, o.rank);
    }
  }
  return list_of(result);
}

}  // namespace

void bind_runtime(nb::module_& m) {
  nb::class_<PyRuntime>(m, "Runtime", "a GPU and Kiln's runtime on it (needs a GPU)")
      .def("__init__", [](PyRuntime* self, int device, bool cuda_graphs, uint64_t memory_limit) {
            new (self) PyRuntime(make_runtime(device, cuda_graphs, memory_limit));
          }, nb::arg("device") = 0, nb::arg("cuda_graphs") = true, nb::arg("memory_limit") = 0)
      .def_prop_ro("device_name", [](const PyRuntime& r) { return std::string(kiln_runtime_device_name(r.rt.get())); })
      .def("_load_bytes", [](const PyRuntime& r, nb::bytes b) {
            kiln_model* m = nullptr;
            check_rt(kiln_model_load_memory(r.rt.get(), b.c_str(), b.size(), &m));
            return finish_load(r, m);
          })
      .def("_load_file", [](const PyRuntime& r, const std::string& path) {
            kiln_model* m = nullptr;
            {
              nb::gil_scoped_release nogil;
              check_rt(kiln_model_load_file(r.rt.get(), path.c_str(), &m));
            }
            return finish_load(r, m);
          });

  nb::class_<PyModel>(m, "Model", "an artifact loaded on a GPU; runs one call at a time")
      .def_prop_ro("inputs", [](const PyModel& pm) { return info_list(pm.inputs); })
      .def_prop_ro("outputs", [](const PyModel& pm) { return info_list(pm.outputs); })
      .def("_run", &run_model, nb::arg("inputs"), nb::arg("torch_out") = false)
      .def("_run_torch", &run_model_torch, nb::arg("inputs"))
      .def("_run_device_pointers", &run_model_device, nb::arg("inputs"), nb::arg("outputs"), nb::arg("stream"))
      .def("memory_report", [](const PyModel& pm) {
            kiln_memory_report r{};
            r.struct_size = sizeof r;
            check_rt(kiln_model_memory_report(pm.m.get(), &r));
            nb::dict d;
            d["weights"] = r.weights;
            d["activations"] = r.activations;
            d["workspace"] = r.workspace;
            d["staging"] = r.staging;
            d["allocated"] = r.allocated;
            d["reserved"] = r.reserved;
            return d;
          });
}

}  // namespace kiln::py
