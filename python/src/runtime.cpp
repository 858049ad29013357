// kiln.Runtime and kiln.Model: the runtime's C API (kiln/runtime.h) for Python. Host arrays
// go through kiln_model_run; outputs come back as new arrays.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

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
};

struct PyModel {
  std::shared_ptr<kiln_runtime> rt;  // outlives the model
  std::shared_ptr<kiln_model> m;
  std::vector<kiln_tensor_info> inputs, outputs;
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
  return {std::shared_ptr<kiln_runtime>(rt, kiln_runtime_release)};
}

PyModel finish_load(const PyRuntime& r, kiln_model* m) {
  PyModel pm{r.rt, std::shared_ptr<kiln_model>(m, kiln_model_release), {}, {}};
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
    bufs.push_back(std::make_unique<std::byte[]>(pm.outputs[i].bytes ? pm.outputs[i].bytes : 1));
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
