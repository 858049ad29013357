// The C API (include/kiln/runtime.h): argument checks, exception barriers, the function table.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
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

/// Reads and validates the artifact at `path`.
kiln_status* read_artifact_at(const char* path, std::unique_ptr<kiln::artifact::Artifact>* out) {
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
  *out = kiln::artifact::read_artifact(std::move(bytes), path, &error);
  if (!*out) return make_status(KILN_STATUS_INVALID_ARGUMENT, error);
  return nullptr;
}

/// Loads `artifact` (`name` in messages) as one rank of a distributed run (`options` NULL: the defaults).
kiln_status* load_distributed(kiln_runtime* runtime, std::unique_ptr<kiln::artifact::Artifact> artifact, const std::string& name,
                              const kiln_distributed_options* options, const char* function, kiln_model** out) {
  kiln_distributed_options opts;
  kiln_distributed_options_initialize(&opts);
  if (options) {
    if (options->struct_size < sizeof(uint32_t))
      return make_status(KILN_STATUS_INVALID_ARGUMENT,
                         std::string(function) + ": options.struct_size is " + std::to_string(options->struct_size) +
                             "; fill the options with kiln_distributed_options_initialize first");
    std::memcpy(&opts, options, std::min<size_t>(options->struct_size, sizeof opts));
  }
  kiln::rt::DistributedSetup setup;
  if (kiln_status* st = kiln::rt::distributed_setup(runtime, artifact, name, opts, &setup)) {
    st->message = std::string(function) + ": " + st->message;
    return st;
  }
  return kiln::rt::load_model(runtime, std::move(artifact), out, &setup);
}

/// A model's input or output placement (kiln_model_input_placement).
kiln_status* tensor_placement(const kiln_model* m, bool input, size_t index, const char* function,
                              kiln_tensor_placement* out) {
  if (!m) return null_argument(function, "model");
  if (!out) return null_argument(function, "out_placement");
  if (out->struct_size < sizeof(kiln_tensor_placement))
    return make_status(KILN_STATUS_INVALID_ARGUMENT, std::string(function) + ": out_placement->struct_size is " +
                                                         std::to_string(out->struct_size) +
                                                         "; set it to sizeof(kiln_tensor_placement)");
  const auto& binds = input ? m->inputs : m->outputs;
  kiln_tensor_info info;
  KILN_RT_TRY(tensor_info(binds, index, function, &info));
  const kiln::artifact::Plan& plan = m->artifact->plan;
  if (plan.mesh.size() > KILN_MAX_MESH_AXES)
    return make_status(KILN_STATUS_UNSUPPORTED, std::string(function) + ": the mesh has more than " +
                                                    std::to_string(KILN_MAX_MESH_AXES) + " axes");
  const auto& placement = (input ? plan.input_placements : plan.output_placements)[index];
  const std::vector<int64_t> local(info.dims, info.dims + info.rank);
  const kiln::rt::Piece piece = kiln::rt::piece_of(local, placement, plan.mesh, m->coords);
  kiln_tensor_placement r{};
  r.struct_size = sizeof r;
  r.num_axes = static_cast<int32_t>(plan.mesh.size());
  for (size_t a = 0; a < plan.mesh.size(); ++a) {
    r.kinds[a] = KILN_PLACEMENT_REPLICATE;
    if (a >= placement.size()) continue;
    using Kind = kiln::artifact::PlanPlacement::Kind;
    if (placement[a].kind == Kind::kShard) {
      r.kinds[a] = KILN_PLACEMENT_SHARD;
      r.shard_dims[a] = placement[a].dim;
    } else if (placement[a].kind == Kind::kPartial) {
      r.kinds[a] = placement[a].reduce == "max" ? KILN_PLACEMENT_PARTIAL_MAX : KILN_PLACEMENT_PARTIAL_SUM;
    }
  }
  r.rank = info.rank;
  for (int d = 0; d < info.rank; ++d) {
    r.global_dims[d] = piece.global_dims[static_cast<size_t>(d)];
    r.offsets[d] = piece.offsets[static_cast<size_t>(d)];
  }
  r.partial = piece.partial ? 1 : 0;
  *out = r;
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


void kiln_distributed_options_initialize(kiln_distributed_options* options) {
  if (!options) return;
  *options = {};
  options->struct_size = sizeof(kiln_distributed_options);
  options->from_environment = 1;
  options->world_size = 1;
  options->collective_timeout_s = 300;
  options->bootstrap_timeout_s = 300;
}

kiln_status* kiln_model_load_file_distributed(kiln_runtime* runtime, const char* path,
                                              const kiln_distributed_options* options, kiln_model** out_model) {
  return guarded("kiln_model_load_file_distributed", [&]() -> kiln_status* {
    if (!out_model) return null_argument("kiln_model_load_file_distributed", "out_model");
    *out_model = nullptr;
    if (!runtime) return null_argument("kiln_model_load_file_distributed", "runtime");
    if (!path) return null_argument("kiln_model_load_file_distributed", "path");
    std::unique_ptr<kiln::artifact::Artifact> artifact;
    KILN_RT_TRY(read_artifact_at(path, &artifact));
    return load_distributed(runtime, std::move(artifact), path, options, "kiln_model_load_file_distributed", out_model);
  });
}

kiln_status* kiln_model_load_memory_distributed(kiln_runtime* runtime, const void* data, size_t size,
                                                const kiln_distributed_options* options, kiln_model** out_model) {
  return guarded("kiln_model_load_memory_distributed", [&]() -> kiln_status* {
    if (!out_model) return null_argument("kiln_model_load_memory_distributed", "out_model");
    *out_model = nullptr;
    if (!runtime) return null_argument("kiln_model_load_memory_distributed", "runtime");
    if (!data && size) return null_argument("kiln_model_load_memory_distributed", "data");
    std::string error;
    auto artifact = kiln::artifact::read_artifact(std::string(static_cast<const char*>(data), size), "<memory>", &error);
    if (!artifact) return make_status(KILN_STATUS_INVALID_ARGUMENT, error);
    return load_distributed(runtime, std::move(artifact), "<memory>", options, "kiln_model_load_memory_distributed",
                            out_model);
  });
}

kiln_status* kiln_model_mesh_info(const kiln_model* model, kiln_mesh_info* out_info) {
  if (!model) return null_argument("kiln_model_mesh_info", "model");
  if (!out_info) return null_argument("kiln_model_mesh_info", "out_info");
  if (out_info->struct_size < sizeof(kiln_mesh_info))
    return make_status(KILN_STATUS_INVALID_ARGUMENT, "kiln_model_mesh_info: out_info->struct_size is " +
                                                         std::to_string(out_info->struct_size) +
                                                         "; set it to sizeof(kiln_mesh_info)");
  const auto& mesh = model->artifact->plan.mesh;
  if (mesh.size() > KILN_MAX_MESH_AXES)
    return make_status(KILN_STATUS_UNSUPPORTED, "kiln_model_mesh_info: the mesh has more than " +
                                                    std::to_string(KILN_MAX_MESH_AXES) + " axes");
  kiln_mesh_info r{};
  r.struct_size = sizeof r;
  r.num_axes = static_cast<int32_t>(mesh.size());
  for (size_t a = 0; a < mesh.size(); ++a) {
    r.axis_names[a] = mesh[a].name.c_str();
    r.axis_sizes[a] = mesh[a].size;
    r.coords[a] = model->coords[a];
  }
  r.rank = model->rank;
  r.world_size = model->world_size;
  *out_info = r;
  return nullptr;
}

kiln_status* kiln_model_input_placement(const kiln_model* model, size_t index, kiln_tensor_placement* out_placement) {
  return tensor_placement(model, true, index, "kiln_model_input_placement", out_placement);
}

kiln_status* kiln_model_output_placement(const kiln_model* model, size_t index, kiln_tensor_placement* out_placement) {
  return tensor_placement(model, false, index, "kiln_model_output_placement", out_placement);
}

kiln_status* kiln_model_all_gather_host(kiln_model* model, const void* send, uint64_t bytes, void* recv) {
  return guarded("kiln_model_all_gather_host", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_all_gather_host", "model");
    if (bytes && !send) return null_argument("kiln_model_all_gather_host", "send");
    if (bytes && !recv) return null_argument("kiln_model_all_gather_host", "recv");
    return kiln::rt::all_gather_host(model, send, bytes, recv);
  });
}


kiln_status* kiln_model_load_file(kiln_runtime* runtime, const char* path, kiln_model** out_model) {
  return guarded("kiln_model_load_file", [&]() -> kiln_status* {
    if (!out_model) return null_argument("kiln_model_load_file", "out_model");
    *out_model = nullptr;
    if (!runtime) return null_argument("kiln_model_load_file", "runtime");
    if (!path) return null_argument("kiln_model_load_file", "path");
    std::unique_ptr<kiln::artifact::Artifact> artifact;
    KILN_RT_TRY(read_artifact_at(path, &artifact));
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

kiln_status* kiln_model_run_device(kiln_model* model, const kiln_device_tensor* inputs, size_t num_inputs,
                                   const kiln_device_tensor* outputs, size_t num_outputs, void* stream) {
  return guarded("kiln_model_run_device", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_run_device", "model");
    return kiln::rt::run_device(model, inputs, num_inputs, outputs, num_outputs, static_cast<cudaStream_t>(stream));
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

size_t kiln_model_num_variables(const kiln_model* model) { return model ? model->variables.size() : 0; }

kiln_status* kiln_model_variable_info(const kiln_model* model, size_t index, kiln_tensor_info* out_info) {
  if (!model) return null_argument("kiln_model_variable_info", "model");
  return tensor_info(model->variables, index, "kiln_model_variable_info", out_info);
}

kiln_status* kiln_model_read_variable(kiln_model* model, size_t index, void* data, uint64_t bytes) {
  return guarded("kiln_model_read_variable", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_read_variable", "model");
    if (!data && bytes) return null_argument("kiln_model_read_variable", "data");
    return kiln::rt::copy_variable(model, index, data, nullptr, bytes, "kiln_model_read_variable");
  });
}

kiln_status* kiln_model_write_variable(kiln_model* model, size_t index, const void* data, uint64_t bytes) {
  return guarded("kiln_model_write_variable", [&]() -> kiln_status* {
    if (!model) return null_argument("kiln_model_write_variable", "model");
    if (!data && bytes) return null_argument("kiln_model_write_variable", "data");
    return kiln::rt::copy_variable(model, index, nullptr, data, bytes, "kiln_model_write_variable");
  });
}

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
  r.weights = model->weights_bytes;
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
      kiln_distributed_options_initialize,
      kiln_model_load_file_distributed,
      kiln_model_load_memory_distributed,
      kiln_model_mesh_info,
      kiln_model_input_placement,
      kiln_model_output_placement,
      kiln_model_all_gather_host,
      kiln_model_run_device,
      kiln_model_num_variables,
      kiln_model_variable_info,
      kiln_model_read_variable,
      kiln_model_write_variable,
  };
  // One table serves every version: older hosts read only the prefix they know.
  return version >= 1 && version <= KILN_RUNTIME_API_VERSION ? &api : nullptr;
}

}  // extern "C"
