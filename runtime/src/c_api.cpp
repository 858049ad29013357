// The C API (include/kiln/runtime.h): argument checks, exception barriers, the function table.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>

#include "model.h"

namespace {

using kiln::rt::make_status;

kiln_status* null_argument(const char* function, const char* argument) {
  return make_status(KILN_STATUS_INVALID_ARGUMENT, std::string(function) + ": " + argument + " is NULL");
}

/// No C++ exception may cross the C boundary: host allocation failures become statuses.
template <typename F>
kiln_status* guarded(const char* function, F&& body) {
  try {
    kiln::rt::DeviceGuard device;
    return body();
  } catch (const std::bad_alloc&) {
    return make_status(KILN_STATUS_OUT_OF_MEMORY, std::string(function) + ": host out of memory");
  } catch (const std::exception& e) {
    return make_status(KILN_STATUS_INTERNAL, std::string(function) + ": " + e.what());
  }
}

kiln_status* tensor_info(const std::vector<kiln_model::Binding>& binds, size_t index,
                         const char* function, kiln_tensor_info* out) {
  if (!out) return null_argument(function, "out_info");
  if (index >= binds.size())
    return make_status(KILN_STATUS_INVALID_ARGUMENT, std::string(function) + ": index " +
                                                         std::to_string(index) + " out of range: the model has " +
                                                         std::to_string(binds.size()));
  *out = binds[index].info;
  return nullptr;
}

}  // namespace

extern "C" {

void kiln_runtime_options_initialize(kiln_runtime_options* options) {
  if (!options) return;
  *options = {};
  options->struct_size = sizeof(kiln_runtime_options);
  options->device_ordinal = 0;
  options->use_cuda_graphs = 1;
  options->device_memory_limit = 0;
  options->enable_timing = 0;
}

kiln_status* kiln_runtime_create(const kiln_runtime_options* options, kiln_runtime** out_runtime) {
  return guarded("kiln_runtime_create", [&]() -> kiln_status* {
    if (!out_runtime) return null_argument("kiln_runtime_create", "out_runtime");
    *out_runtime = nullptr;
    kiln_runtime_options opts;
    kiln_runtime_options_initialize(&opts);
    if (options) {
      if (options->struct_size < sizeof(uint32_t))
        return make_status(KILN_STATUS_INVALID_ARGUMENT,
                           "kiln_runtime_create: options.struct_size is " + std::to_string(options->struct_size) +
                               "; fill the options with kiln_runtime_options_initialize first");
      // An older host's shorter struct keeps our defaults for the fields it lacks.
      std::memcpy(&opts, options, std::min<size_t>(options->struct_size, sizeof opts));
      opts.struct_size = sizeof opts;
    }
    auto rt = std::make_unique<kiln_runtime>();
    rt->options = opts;
    KILN_RT_TRY(kiln::rt::query_device(opts.device_ordinal, &rt->device));
    rt->allocator = std::make_unique<kiln::rt::CachingAllocator>(
        kiln::rt::cuda_memory_ops(rt->device.ordinal), opts.device_memory_limit);
    *out_runtime = rt.release();
    return nullptr;
  });
}

void kiln_runtime_release(kiln_runtime* runtime) {
  kiln::rt::DeviceGuard device;
  if (runtime) runtime->unref();
}

const char* kiln_runtime_device_name(const kiln_runtime* runtime) {
  return runtime ? runtime->device.name.c_str() : "";
}

kiln_status* kiln_model_load_memory(kiln_runtime* runtime, const void* data, size_t size,
                                    kiln_model** out_model) {
  return guarded("kiln_model_load_memory", [&]() -> kiln_status* {
    if (!out_model) return null_argument("kiln_model_load_memory", "out_model");
    *out_model = nullptr;
    if (!runtime) return null_argument("kiln_model_load_memory", "runtime");
    if (!data && size) return null_argument("kiln_model_load_memory", "data");
    std::string error;
    auto artifact = kiln::artifact::read_artifact(
        std::string(static_cast<const char*>(data), size), "<memory>", &error);
    if (!artifact) return make_status(KILN_STATUS_INVALID_ARGUMENT, error);
    return kiln::rt::load_model(runtime, std::move(artifact), out_model);
  });
}

kiln_status* kiln_model_load_file(kiln_runtime* runtime, const char* path, kiln_model** out_model) {
  return guarded("kiln_model_load_file", [&]() -> kiln_status* {
    if (!out_model) return null_argument("kiln_model_load_file", "out_model");
    *out_model = nullptr;
    if (!runtime) return null_argument("kiln_model_load_file", "runtime");
    if (!path) return null_argument("kiln_model_load_file", "path");
    std::FILE* f = std::fopen(path, "rb");
    if (!f)
      return make_status(errno == ENOENT ? KILN_STATUS_NOT_FOUND : KILN_STATUS_INVALID_ARGUMENT,
                         std::string("cannot open '") + path + "': " + std::strerror(errno));
    std::string bytes;
    char chunk[1 << 16];
    size_t n;
    while ((n = std::fread(chunk, 1, sizeof chunk, f)) > 0) bytes.append(chunk, n);
    bool failed = std::ferror(f);
    std::fclose(f);
    if (failed) return make_status(KILN_STATUS_INVALID_ARGUMENT, std::string("cannot read '") + path + "'");
    std::string error;
    auto artifact = kiln::artifact::read_artifact(std::move(bytes), path, &error);
    if (!artifact) return make_status(KILN_STATUS_INVALID_ARGUMENT, error);
    return kiln::rt::load_model(runtime, std::move(artifact), out_model);
  });
}

void kiln_model_release(kiln_model* model) {
  kiln::rt::DeviceGuard device;
  delete model;
}

size_t kiln_model_num_inputs(const kiln_model* model) { return model ? model->inputs.size() : 0; }
size_t kiln_model_num_outputs(const kiln_model* model) { return model ? model->outputs.size() : 0; }

kiln_status* kiln_model_input_info(const kiln_model* model, size_t index, kiln_tensor_info* out_info) {
  if (!model) return null_argument("kiln_model_input_info", "model");
  return tensor_info(model->inputs, index, "kiln_model_input_info", out_info);
}

kiln_status* kiln_model_output_info(const kiln_model* model, size_t index, kiln_tensor_info* out_info) {
  if (!model) return null_argument("kiln_model_output_info", "model");
  return tensor_info(model->outputs, index, "kiln_model_output_info", out_info);
}

kiln_status* kiln_model_run(kiln_model* model, const kiln_host_tensor* inputs, size_t num_inputs,
                            kiln_host_tensor* outputs, size_t num_outputs) {
  return guarded("kiln_model_run", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_run", "model");
    KILN_RT_TRY(kiln::rt::enqueue_model(model, inputs, num_inputs, outputs, num_outputs, "kiln_model_run"));
    return kiln::rt::synchronize_model(model, "kiln_model_run");
  });
}

kiln_status* kiln_model_enqueue(kiln_model* model, const kiln_host_tensor* inputs, size_t num_inputs,
                                kiln_host_tensor* outputs, size_t num_outputs) {
  return guarded("kiln_model_enqueue", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_enqueue", "model");
    return kiln::rt::enqueue_model(model, inputs, num_inputs, outputs, num_outputs, "kiln_model_enqueue");
  });
}

kiln_status* kiln_model_synchronize(kiln_model* model) {
  return guarded("kiln_model_synchronize", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_synchronize", "model");
    return kiln::rt::synchronize_model(model, "kiln_model_synchronize");
  });
}

kiln_status* kiln_model_device_time(const kiln_model* model, double* out_ms) {
  return guarded("kiln_model_device_time", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_device_time", "model");
    if (!out_ms) return null_argument("kiln_model_device_time", "out_ms");
    return kiln::rt::model_device_time(model, out_ms);
  });
}

size_t kiln_model_num_steps(const kiln_model* model) { return model ? model->steps.size() : 0; }

kiln_status* kiln_model_profile_steps(kiln_model* model, int32_t iterations, double* out_step_ms, size_t capacity) {
  return guarded("kiln_model_profile_steps", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_profile_steps", "model");
    if (!out_step_ms && capacity) return null_argument("kiln_model_profile_steps", "out_step_ms");
    return kiln::rt::profile_steps(model, iterations, out_step_ms, capacity);
  });
}

kiln_status* kiln_model_step_problem(const kiln_model* model, size_t step, char* out, size_t capacity) {
  return guarded("kiln_model_step_problem", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_step_problem", "model");
    if (!out) return null_argument("kiln_model_step_problem", "out");
    std::string problem;
    KILN_RT_TRY(kiln::rt::step_problem(model, step, &problem));
    if (problem.size() >= capacity)
      return make_status(KILN_STATUS_INVALID_ARGUMENT, "kiln_model_step_problem: capacity " + std::to_string(capacity) +
                                                           " is too small for the " + std::to_string(problem.size() + 1) +
                                                           " bytes of step " + std::to_string(step) + "'s descriptor");
    std::memcpy(out, problem.c_str(), problem.size() + 1);
    return nullptr;
  });
}

kiln_status* kiln_model_tune_step(kiln_model* model, size_t step, int32_t max_candidates, int32_t iterations,
                                  kiln_tune_result* out_result) {
  return guarded("kiln_model_tune_step", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_tune_step", "model");
    if (!out_result) return null_argument("kiln_model_tune_step", "out_result");
    if (out_result->struct_size < sizeof(kiln_tune_result))
      return make_status(KILN_STATUS_INVALID_ARGUMENT, "kiln_model_tune_step: out_result->struct_size is " +
                                                           std::to_string(out_result->struct_size) +
                                                           "; set it to sizeof(kiln_tune_result)");
    kiln::rt::TuneOutcome t;
    KILN_RT_TRY(kiln::rt::tune_step(model, step, max_candidates, iterations, &t));
    if (t.choice.size() >= sizeof out_result->choice)
      return make_status(KILN_STATUS_INTERNAL, "kiln_model_tune_step: choice '" + t.choice + "' is too long");
    out_result->candidates = t.candidates;
    out_result->best_ms = t.best_ms;
    out_result->heuristic_ms = t.heuristic_ms;
    std::memcpy(out_result->choice, t.choice.c_str(), t.choice.size() + 1);
    return nullptr;
  });
}

kiln_status* kiln_model_memory_report(const kiln_model* model, kiln_memory_report* out_report) {
  if (!model) return null_argument("kiln_model_memory_report", "model");
  if (!out_report) return null_argument("kiln_model_memory_report", "out_report");
  if (out_report->struct_size < sizeof(uint32_t))
    return make_status(KILN_STATUS_INVALID_ARGUMENT,
                       "kiln_model_memory_report: out_report->struct_size is " +
                           std::to_string(out_report->struct_size) + "; set it to sizeof(kiln_memory_report)");
  kiln::rt::CachingAllocator::Stats stats = model->runtime->allocator->stats();
  kiln_memory_report r{};
  r.weights = model->artifact->weights.size();
  r.activations = model->artifact->plan.arena_bytes;
  r.workspace = model->workspace_bytes;
  r.staging = model->staging_bytes;
  r.allocated = stats.allocated;
  r.reserved = stats.reserved;
  // Fill only what the caller's (possibly older, shorter) struct has room for.
  uint32_t size = out_report->struct_size;
  r.struct_size = size;
  std::memcpy(out_report, &r, std::min<size_t>(size, sizeof r));
  return nullptr;
}

const kiln_api* kiln_get_api(uint32_t version) {
  static const kiln_api api = {
      KILN_RUNTIME_API_VERSION,
      kiln_status_get_code,
      kiln_status_get_message,
      kiln_status_release,
      kiln_runtime_options_initialize,
      kiln_runtime_create,
      kiln_runtime_release,
      kiln_runtime_device_name,
      kiln_model_load_file,
      kiln_model_load_memory,
      kiln_model_release,
      kiln_model_num_inputs,
      kiln_model_num_outputs,
      kiln_model_input_info,
      kiln_model_output_info,
      kiln_model_run,
      kiln_model_memory_report,
      kiln_model_enqueue,
      kiln_model_synchronize,
      kiln_model_device_time,
      kiln_model_num_steps,
      kiln_model_profile_steps,
      kiln_model_step_problem,
      kiln_model_tune_step,
  };
  // One table serves every version: older hosts read only the prefix they know.
  return version >= 1 && version <= KILN_RUNTIME_API_VERSION ? &api : nullptr;
}

}  // extern "C"
