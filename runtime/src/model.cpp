// Loading a model onto the device (image, weights, arena, prepared steps, graph) and running it.
#include "model.h"
#include "host_round.h"
#include "timing_kernels.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <thread>
#include <cstring>
#include <map>
#include <set>
#include <string>

namespace kiln::rt {
namespace {

using artifact::PlanBuffer;
using artifact::PlanStep;

/// cuBLASLt's scratch when the plan asks for none: what it wants on Hopper for its fastest
/// kernels (PyTorch uses the same).
constexpr uint64_t kDefaultGemmWorkspace = 32ull << 20;
constexpr uint64_t kStagingAlign = 256;

/// Device lead-in of a timed run: KILN_TIMING_LEAD_US (whole microseconds, at most 10 s; 0 turns
/// it off), default 50. False for a value that is not one.
bool timing_lead_ns(unsigned long long* ns) {
  const char* e = std::getenv("KILN_TIMING_LEAD_US");
  *ns = kTimingLeadNs;
  if (!e || !*e) return true;
  unsigned long long us = 0;
  const char* end = e + std::strlen(e);
  auto [p, err] = std::from_chars(e, end, us);
  if (err != std::errc{} || p != end || us > 10'000'000) return false;
  *ns = us * 1000;
  return true;
}

kiln_status* invalid(std::string msg) {
  return make_status(KILN_STATUS_INVALID_ARGUMENT, std::move(msg));
}

/// "b3" → 3 (the reader has checked the reference).
int buffer_ref(const PlanStep& step, const char* key) {
  const std::string& v = step.attrs.at(key);
  int id = -1;
  std::from_chars(v.data() + 1, v.data() + v.size(), id);
  return id;
}

uint64_t step_bytes(const PlanStep& step) {
  uint64_t n = 0;
  const std::string& v = step.attrs.at("bytes");
  std::from_chars(v.data(), v.data() + v.size(), n);
  return n;
}

/// Loads the chosen image as a context-independent library (runtime API, no libcuda link).
kiln_status* load_image(kiln_model* m) {
  std::vector<std::string> names;
  for (const auto& [name, bytes] : m->artifact->images) names.push_back(name);
  ImageChoice choice = select_image(names, m->runtime->device.cc);
  if (choice.image.empty()) return make_status(KILN_STATUS_UNSUPPORTED, choice.error);
  m->image_name = choice.image;
  m->image_bytes = std::string(m->artifact->images.at(choice.image));
  char log[4096] = {};
  cudaJitOption options[] = {cudaJitErrorLogBuffer, cudaJitErrorLogBufferSizeBytes};
  void* values[] = {log, reinterpret_cast<void*>(uintptr_t{sizeof log})};
  cudaError_t err = cudaLibraryLoadData(&m->library, m->image_bytes.c_str(), options, values, 2,
                                        nullptr, nullptr, 0);
  if (err != cudaSuccess) {
    kiln_status* st = cuda_status(err, "cudaLibraryLoadData");
    bool unsupported = err == cudaErrorUnsupportedPtxVersion || err == cudaErrorNoKernelImageForDevice;
    bool corrupt = err == cudaErrorInvalidKernelImage || err == cudaErrorInvalidPtx ||
                   err == cudaErrorInvalidSource;
    st->code = unsupported ? KILN_STATUS_UNSUPPORTED
               : corrupt   ? KILN_STATUS_INVALID_ARGUMENT
                           : KILN_STATUS_DEVICE_ERROR;
    st->message = "loading image '" + m->image_name + "' on " + m->runtime->device.name + ": " +
                  st->message + (log[0] ? std::string(": ") + log : std::string());
    m->library = nullptr;
    return st;
  }
  return nullptr;
}

/// Points every plan buffer at device memory: arena, weights, or its alias base. Weights and
/// aliases that differ by rank point at this rank's bytes (rank_axis, rank_stride).
kiln_status* resolve_buffers(kiln_model* m) {
  const artifact::Plan& plan = m->artifact->plan;
  for (const PlanBuffer& b : plan.buffers) {
    if (b.id != static_cast<int>(m->buffers.size()))
      return invalid("plan: buffer ids must be 0..N-1 in order, found " + std::to_string(b.id));
    char* base = nullptr;
    uint64_t limit = 0, offset = rank_offset(b, plan.mesh, m->coords);
    switch (b.kind) {
      case PlanBuffer::Kind::kInput:
      case PlanBuffer::Kind::kOutput:
      case PlanBuffer::Kind::kActivation:
        base = static_cast<char*>(m->arena), limit = plan.arena_bytes;
        break;
      case PlanBuffer::Kind::kWeight:
        base = static_cast<char*>(m->weights), limit = m->weights_bytes;
        offset = m->weight_layout.device_offset(offset);
        break;
      case PlanBuffer::Kind::kAlias:
        if (b.base < 0 || b.base >= b.id) return invalid("plan: alias buffer " + std::to_string(b.id) + " has no earlier base");
        base = static_cast<char*>(m->buffers[static_cast<size_t>(b.base)].ptr);
        limit = m->buffers[static_cast<size_t>(b.base)].bytes;
        break;
    }
    if (offset > limit || b.bytes > limit - offset)
      return invalid("plan: buffer " + std::to_string(b.id) + " (" + std::to_string(b.bytes) +
                     " bytes at offset " + std::to_string(offset) + ") lies outside its " +
                     std::to_string(limit) + "-byte storage");
    m->buffers.push_back({base ? base + offset : nullptr, b.bytes, b.dtype});
  }
  return nullptr;
}

/// Uploads the weights this rank keeps (all of them, unless some differ by rank).
kiln_status* upload_weights(kiln_model* m) {
  const std::string_view w = m->artifact->weights;
  for (const auto& [at, bytes] : m->weight_layout.kept())
    KILN_CUDA_TRY(cudaMemcpy(static_cast<char*>(m->weights) + m->weight_layout.device_offset(at), w.data() + at, bytes,
                             cudaMemcpyHostToDevice));
  return nullptr;
}

kiln_status* make_bindings(kiln_model* m, const std::vector<std::pair<std::string, int>>& list,
                           std::vector<kiln_model::Binding>* out, bool staged = true) {
  for (const auto& [name, id] : list) {
    const PlanBuffer& b = m->artifact->plan.buffers.at(static_cast<size_t>(id));
    kiln_model::Binding bind;
    bind.info.name = name.c_str();
    if (!dtype_from_name(b.dtype, &bind.info.dtype))
      return invalid("plan: tensor '" + name + "' has unknown dtype '" + b.dtype + "'");
    if (b.shape.size() > KILN_MAX_RANK)
      return make_status(KILN_STATUS_UNSUPPORTED, "plan: tensor '" + name + "' has rank " +
                                                      std::to_string(b.shape.size()) + ", more than " +
                                                      std::to_string(KILN_MAX_RANK));
    bind.info.rank = static_cast<int32_t>(b.shape.size());
    for (size_t i = 0; i < b.shape.size(); ++i) bind.info.dims[i] = b.shape[i];
    bind.info.bytes = b.bytes;
    bind.device = m->buffers[static_cast<size_t>(id)].ptr;
    if (staged) {
      bind.staging_offset = m->staging_bytes;
      m->staging_bytes += (b.bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign;
    }
    out->push_back(bind);
  }
  return nullptr;
}

kiln_status* prepare_steps(kiln_model* m) {
  const artifact::Plan& plan = m->artifact->plan;
  std::map<std::string, cudaKernel_t> kernels;
  for (const std::string& name : plan.kernels) {
    cudaKernel_t k = nullptr;
    cudaError_t err = cudaLibraryGetKernel(&k, m->library, name.c_str());
    if (err != cudaSuccess) {
      kiln_status* st = cuda_status(err, "cudaLibraryGetKernel");
      st->code = KILN_STATUS_INVALID_ARGUMENT;
      // With lazy module loading (the CUDA default) a broken image loads "successfully" and
      // only fails here; say so rather than blaming a missing kernel.
      if (err == cudaErrorInvalidKernelImage || err == cudaErrorInvalidPtx ||
          err == cudaErrorNoKernelImageForDevice)
        st->message = "loading image '" + m->image_name + "': the driver refused it: " + st->message;
      else
        st->message = "image '" + m->image_name + "' has no kernel '" + name + "': " + st->message;
      return st;
    }
    kernels[name] = k;
  }
  auto buffer_of = [m](int id) -> const DeviceBuffer* {
    return id >= 0 && static_cast<size_t>(id) < m->buffers.size() ? &m->buffers[static_cast<size_t>(id)]
                                                                  : nullptr;
  };
  for (const PlanStep& ps : plan.steps) {
    kiln_model::Step s;
    s.kind = ps.kind;
    switch (ps.kind) {
      case PlanStep::Kind::kCollective:
        if (!m->comms) return make_status(KILN_STATUS_INTERNAL, "plan:" + std::to_string(ps.line) + ": no communicators");
        KILN_RT_TRY(CollectiveStep::create(ps, m->steps.size(), buffer_of, *m->comms, plan.mesh, &s.collective));
        m->collectives.push_back(s.collective.get());
        break;
      case PlanStep::Kind::kLaunch: {
        s.kernel = kernels.at(ps.kernel);
        s.grid = dim3(ps.grid[0], ps.grid[1], ps.grid[2]);
        s.block = dim3(ps.block[0], ps.block[1], ps.block[2]);
        s.smem = ps.smem;
        if (s.smem > 48 * 1024) {
          // Above 48 KiB a kernel must opt in to dynamic shared memory.
          if (static_cast<int>(s.smem) > m->runtime->device.max_smem_optin)
            return make_status(KILN_STATUS_UNSUPPORTED,
                               "plan:" + std::to_string(ps.line) + ": kernel '" + ps.kernel + "' needs " +
                                   std::to_string(s.smem) + " bytes of shared memory, " +
                                   m->runtime->device.name + " allows " +
                                   std::to_string(m->runtime->device.max_smem_optin));
          KILN_CUDA_TRY(cudaFuncSetAttribute(reinterpret_cast<const void*>(s.kernel),
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(s.smem)));
        }
        s.arg_values.resize(ps.args.size());
        for (size_t i = 0; i < ps.args.size(); ++i) {
          const artifact::LaunchArg& a = ps.args[i];
          uint64_t& slot = s.arg_values[i];
          if (a.kind == artifact::LaunchArg::Kind::kBuffer) {
            const DeviceBuffer* b = buffer_of(a.buffer);
            if (!b) return invalid("plan:" + std::to_string(ps.line) + ": undefined buffer " + std::to_string(a.buffer));
            std::memcpy(&slot, &b->ptr, sizeof b->ptr);
          } else if (a.kind == artifact::LaunchArg::Kind::kInt64) {
            std::memcpy(&slot, &a.i64, sizeof a.i64);
          } else {
            std::memcpy(&slot, &a.f32, sizeof a.f32);  // a float parameter: its first 4 bytes
          }
        }
        for (uint64_t& v : s.arg_values) s.arg_ptrs.push_back(&v);
        break;
      }
      case PlanStep::Kind::kGemm:
        if (!m->cublas) KILN_CUBLAS_TRY(cublasLtCreate(&m->cublas));
        KILN_RT_TRY(GemmStep::create(ps, buffer_of, m->cublas, m->workspace_bytes, &s.gemm));
        break;
      case PlanStep::Kind::kConv:
        if (!m->cudnn) KILN_RT_TRY(CudnnContext::create(ps, m->stream, &m->cudnn));
        KILN_RT_TRY(ConvStep::create(ps, buffer_of, *m->cudnn, m->workspace, m->workspace_bytes, &s.conv));
        break;
      case PlanStep::Kind::kCopy:
        s.src = buffer_of(buffer_ref(ps, "src"))->ptr;
        [[fallthrough]];
      case PlanStep::Kind::kMemset:
        s.dst = buffer_of(buffer_ref(ps, "dst"))->ptr;
        s.bytes = step_bytes(ps);
        break;
    }
    m->steps.push_back(std::move(s));
  }
  return nullptr;
}

kiln_status* enqueue_input_copies(kiln_model* m) {
  for (const kiln_model::Binding& in : m->inputs)
    if (in.info.bytes)
      KILN_CUDA_TRY(cudaMemcpyAsync(in.device, m->staging + in.staging_offset, in.info.bytes,
                                    cudaMemcpyHostToDevice, m->stream));
  return nullptr;
}

kiln_status* enqueue_step(kiln_model* m, kiln_model::Step& s) {
  switch (s.kind) {
    case PlanStep::Kind::kLaunch:
      KILN_CUDA_TRY(cudaLaunchKernel(reinterpret_cast<const void*>(s.kernel), s.grid, s.block,
                                     s.arg_ptrs.data(), s.smem, m->stream));
      break;
    case PlanStep::Kind::kGemm:
      KILN_RT_TRY(s.gemm->run(m->cublas, m->workspace, m->workspace_bytes, m->stream));
      break;
    case PlanStep::Kind::kConv:
      KILN_RT_TRY(s.conv->run(m->workspace, m->workspace_bytes));
      break;
    case PlanStep::Kind::kCopy:
      if (s.bytes) KILN_CUDA_TRY(cudaMemcpyAsync(s.dst, s.src, s.bytes, cudaMemcpyDeviceToDevice, m->stream));
      break;
    case PlanStep::Kind::kMemset:
      if (s.bytes) KILN_CUDA_TRY(cudaMemsetAsync(s.dst, 0, s.bytes, m->stream));
      break;
    case PlanStep::Kind::kCollective:
      KILN_RT_TRY(s.collective->enqueue(*m->comms, m->stream, std::chrono::steady_clock::now() + m->collective_timeout));
      break;
  }
  return nullptr;
}

kiln_status* enqueue_steps(kiln_model* m) {
  for (kiln_model::Step& s : m->steps) KILN_RT_TRY(enqueue_step(m, s));
  return nullptr;
}

kiln_status* enqueue_output_copies(kiln_model* m) {
  for (const kiln_model::Binding& out : m->outputs)
    if (out.info.bytes)
      KILN_CUDA_TRY(cudaMemcpyAsync(m->staging + out.staging_offset, out.device, out.info.bytes,
                                    cudaMemcpyDeviceToHost, m->stream));
  return nullptr;
}

/// Input copies, the plan's steps and output copies, on the model's stream.
kiln_status* enqueue(kiln_model* m) {
  KILN_RT_TRY(enqueue_input_copies(m));
  KILN_RT_TRY(enqueue_steps(m));
  return enqueue_output_copies(m);
}

/// One run's device work: the captured graph or the eager steps, with the copies inside the
/// graph unless timing, whose events must bracket the steps alone.
kiln_status* launch(kiln_model* m) {
  if (!m->steps_begin) {
    if (m->graph) return cuda_status(cudaGraphLaunch(m->graph, m->stream), "cudaGraphLaunch");
    return enqueue(m);
  }
  KILN_RT_TRY(enqueue_input_copies(m));
  // With KILN_TIMING_FLUSH_L2=1, L2 is swept clean of what the copies left there.
  if (m->l2_sweep) {
    unsigned never = 1;
    void* args[] = {&m->l2_flush, &m->l2_flush_bytes, &never};
    KILN_CUDA_TRY(cudaLaunchKernel(reinterpret_cast<const void*>(m->l2_sweep), dim3(kL2SweepBlocks),
                                   dim3(kL2SweepThreads), args, 0, m->stream));
  }
  // The device waits a little before the first event, so the steps are queued behind running
  // device work: the events then hold device time alone, not the host's launch of the graph
  // nor the hand-over from the copy engine (as PyTorch's peers are timed in bench/peer).
  if (m->lead_kernel) {
    void* args[] = {&m->lead_ns};
    KILN_CUDA_TRY(cudaLaunchKernel(reinterpret_cast<const void*>(m->lead_kernel), dim3(1), dim3(1), args, 0, m->stream));
  }
  KILN_CUDA_TRY(cudaEventRecord(m->steps_begin, m->stream));
  if (m->graph) KILN_CUDA_TRY(cudaGraphLaunch(m->graph, m->stream));
  else KILN_RT_TRY(enqueue_steps(m));
  KILN_CUDA_TRY(cudaEventRecord(m->steps_end, m->stream));
  return enqueue_output_copies(m);
}

/// Puts back the initial values of the weight-section buffers the plan writes (a model's state:
/// its variables, which kernels may update in place, and whatever copy steps write there),
/// after runs that must not count, such as the warm-up before graph capture.
kiln_status* reset_state(kiln_model* m) {
  const auto* base = static_cast<const unsigned char*>(m->weights);
  const uint64_t size = m->weights_bytes;
  std::set<std::pair<const void*, uint64_t>> written;  // (device address, bytes)
  for (const kiln_model::Binding& v : m->variables) written.insert({v.device, v.info.bytes});
  for (const kiln_model::Step& s : m->steps)
    if (s.kind == PlanStep::Kind::kCopy) written.insert({s.dst, s.bytes});
  for (const auto& [ptr, bytes] : written) {
    const auto* dst = static_cast<const unsigned char*>(ptr);
    if (!bytes || !dst || dst < base || dst >= base + size) continue;
    const uint64_t offset = m->weight_layout.section_offset(static_cast<uint64_t>(dst - base));
    KILN_CUDA_TRY(cudaMemcpy(const_cast<void*>(ptr), m->artifact->weights.data() + offset, bytes, cudaMemcpyHostToDevice));
  }
  return nullptr;
}

/// Prefixes a status's message with what was being done.
kiln_status* context(kiln_status* st, const std::string& what) {
  if (st) st->message = what + ": " + st->message;
  return st;
}

/// Conv steps the plan did not tune: cuDNN's one-shot search ranked the algorithms; re-time its
/// first few with warmed-up median launches and keep the fastest (once per problem).
kiln_status* settle_convs(kiln_model* m) {
  std::map<std::string, std::pair<cudnnConvolutionFwdAlgo_t, cudnnMathType_t>> settled;
  for (kiln_model::Step& s : m->steps) {
    if (!s.conv || s.conv->algorithm_from_plan()) continue;
    if (auto it = settled.find(s.conv->problem()); it != settled.end()) {
      KILN_RT_TRY(s.conv->use_algorithm(it->second));
      continue;
    }
    KILN_RT_TRY(context(s.conv->settle(m->workspace, m->workspace_bytes, m->stream, 4, 5), "timing conv algorithms"));
    settled.emplace(s.conv->problem(), s.conv->algorithm());
  }
  return nullptr;
}

/// Captures what `work` queues on the model's stream as a CUDA graph in `out` (null on failure).
kiln_status* capture(kiln_model* m, kiln_status* (*work)(kiln_model*), cudaGraphExec_t* out, const char* what) {
  KILN_CUDA_TRY(cudaStreamBeginCapture(m->stream, cudaStreamCaptureModeThreadLocal));
  kiln_status* st = work(m);
  cudaGraph_t graph = nullptr;
  cudaError_t end = cudaStreamEndCapture(m->stream, &graph);
  if (!st) st = cuda_status(end, "cudaStreamEndCapture");
  if (!st) st = cuda_status(cudaGraphInstantiate(out, graph, 0), "cudaGraphInstantiate");
  if (graph) cudaGraphDestroy(graph);
  if (st) *out = nullptr;
  return context(st, what);
}

/// Captures input copies, steps and output copies (the steps alone when timing) as one CUDA
/// graph. The staging and arena addresses never change, so the graph stays valid for every
/// later run.
kiln_status* capture_graph(kiln_model* m) {
  return capture(m, m->steps_begin ? enqueue_steps : enqueue, &m->graph, "capturing the plan as a CUDA graph");
}

}  // namespace

bool dtype_from_name(const std::string& name, kiln_dtype* out) {
  static const char* const kNames[] = {"f64", "f32", "f16", "bf16", "f8e4m3fn", "f8e5m2", "i64",
                                       "i32", "i16", "i8",  "u8",  "i4",   "bool"};
  for (int i = 0; i < static_cast<int>(std::size(kNames)); ++i)
    if (name == kNames[i]) {
      *out = static_cast<kiln_dtype>(i);
      return true;
    }
  return false;
}

kiln_status* finish_stream(kiln_model* m, const std::string& what) {
  if (!m->watchdog) return context(cuda_status(cudaStreamSynchronize(m->stream), "cudaStreamSynchronize"), what);
  KILN_CUDA_TRY(cudaEventRecord(m->run_done, m->stream));
  m->watchdog->arm(m->run_done, &m->collectives, m->rank_text);
  return m->watchdog->wait(what);
}

kiln_status* load_model(kiln_runtime* runtime, std::unique_ptr<artifact::Artifact> artifact,
                        kiln_model** out, const DistributedSetup* dist) {
  auto m = std::make_unique<kiln_model>();
  runtime->references.fetch_add(1);
  m->runtime = runtime;
  m->artifact = std::move(artifact);
  if (!m->artifact->rank_programs.empty())  // a distributed load has picked this rank's already
    return make_status(KILN_STATUS_UNSUPPORTED,
                       "the artifact holds the programs of " + std::to_string(m->artifact->rank_programs.size()) +
                           " ranks (a pipeline's stages): load it with kiln_model_load_file_distributed, one "
                           "process per rank, each picking its own program (docs/parallel-runtime.md)");
  const artifact::Plan& mesh_plan = m->artifact->plan;
  const bool has_collectives = std::any_of(mesh_plan.steps.begin(), mesh_plan.steps.end(),
                                           [](const PlanStep& s) { return s.kind == PlanStep::Kind::kCollective; });
  if (!dist && (artifact::mesh_ranks(mesh_plan) > 1 || has_collectives))
    return make_status(KILN_STATUS_UNSUPPORTED,
                       "the plan runs on a mesh of " + std::to_string(artifact::mesh_ranks(mesh_plan)) + " rank" +
                           (artifact::mesh_ranks(mesh_plan) == 1 ? "" : "s") + " (" + artifact::mesh_text(mesh_plan) +
                           ")" + (has_collectives ? " with collective steps" : "") +
                           ": load it with kiln_model_load_file_distributed, one process per rank "
                           "(docs/parallel-runtime.md)");
  if (dist) {
    m->rank = dist->launch.rank;
    m->world_size = dist->launch.world_size;
    m->collective_timeout = dist->collective_timeout;
  }
  m->rank_text = "rank " + std::to_string(m->rank) + " of " + std::to_string(m->world_size);
  m->coords = mesh_coords(mesh_plan.mesh, m->rank);
  {
    std::string error;
    if (!WeightLayout::build(mesh_plan, m->artifact->weights.size(), m->coords, &m->weight_layout, &error))
      return invalid(error);
    m->weights_bytes = m->weight_layout.device_bytes();
  }
  // The timing variables (see kiln_runtime_options.enable_timing), checked before any allocation.
  bool flush_l2 = false;
  if (runtime->options.enable_timing) {
    if (!timing_lead_ns(&m->lead_ns))
      return invalid("KILN_TIMING_LEAD_US must be a whole number of microseconds up to 10000000, got '" +
                     std::string(std::getenv("KILN_TIMING_LEAD_US")) + "'");
    const char* flush = std::getenv("KILN_TIMING_FLUSH_L2");
    if (flush && *flush && std::string(flush) != "0" && std::string(flush) != "1")
      return invalid("KILN_TIMING_FLUSH_L2 must be 0 or 1, got '" + std::string(flush) + "'");
    flush_l2 = flush && std::string(flush) == "1";
  }
  const artifact::Plan& plan = m->artifact->plan;
  KILN_CUDA_TRY(cudaSetDevice(runtime->device.ordinal));
  // The communicators first: a rank that cannot join fails before the uploads.
  if (dist && (dist->launch.world_size > 1 || has_collectives)) {
    KILN_RT_TRY(Communicators::create(dist->launch, plan.mesh, runtime->device.ordinal, dist->bootstrap_timeout,
                                      &m->comms));
    KILN_CUDA_TRY(cudaEventCreateWithFlags(&m->run_done, cudaEventDisableTiming));
    m->watchdog = std::make_unique<Watchdog>(*m->comms, runtime->device.ordinal, dist->collective_timeout);
  }
  if (!plan.kernels.empty()) KILN_RT_TRY(load_image(m.get()));

  CachingAllocator& alloc = *runtime->allocator;
  bool has_gemm = false;
  for (const PlanStep& s : plan.steps) has_gemm |= s.kind == PlanStep::Kind::kGemm || s.kind == PlanStep::Kind::kConv;
  m->workspace_bytes = plan.workspace_bytes ? plan.workspace_bytes : has_gemm ? kDefaultGemmWorkspace : 0;
  KILN_RT_TRY(alloc.allocate(m->weights_bytes, MemoryCategory::kWeights, &m->weights));
  KILN_RT_TRY(alloc.allocate(plan.arena_bytes, MemoryCategory::kActivations, &m->arena));
  KILN_RT_TRY(alloc.allocate(m->workspace_bytes, MemoryCategory::kWorkspace, &m->workspace));
  KILN_RT_TRY(context(upload_weights(m.get()), "uploading weights"));

  KILN_RT_TRY(resolve_buffers(m.get()));
  KILN_RT_TRY(make_bindings(m.get(), plan.inputs, &m->inputs));
  KILN_RT_TRY(make_bindings(m.get(), plan.outputs, &m->outputs));
  KILN_RT_TRY(make_bindings(m.get(), plan.variables, &m->variables, false));
  m->copy_of.assign(m->variables.size(), -1);
  m->copy_state.assign(m->variables.size(), kiln_model::kCopyIdle);
  for (size_t i = 0; i < plan.variables.size(); ++i) {
    auto c = plan.variable_copies.find(plan.variables[i].first);
    if (c == plan.variable_copies.end()) continue;
    for (size_t j = 0; j < plan.variables.size(); ++j)
      if (plan.variables[j].first == c->second) m->copy_of[i] = static_cast<int>(j);
  }
  if (m->staging_bytes) {
    void* p = nullptr;
    KILN_RT_TRY(context(cuda_status(cudaHostAlloc(&p, m->staging_bytes, cudaHostAllocDefault), "cudaHostAlloc"),
                        "allocating " + format_bytes(m->staging_bytes) + " of pinned staging"));
    m->staging = static_cast<unsigned char*>(p);
    std::memset(m->staging, 0, m->staging_bytes);
  }
  KILN_CUDA_TRY(cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking));
  if (runtime->options.enable_timing) {
    KILN_CUDA_TRY(cudaEventCreate(&m->steps_begin));
    KILN_CUDA_TRY(cudaEventCreate(&m->steps_end));
    if (flush_l2 || m->lead_ns) {
      KILN_RT_TRY(context(cuda_status(cudaLibraryLoadData(&m->timing_library, kTimingPtx, nullptr, nullptr, 0, nullptr,
                                                          nullptr, 0), "cudaLibraryLoadData"), "loading the timing kernels"));
      auto kernel = [&](cudaKernel_t* k, const char* name) {
        return context(cuda_status(cudaLibraryGetKernel(k, m->timing_library, name), "cudaLibraryGetKernel"),
                       std::string("loading the timing kernel ") + name);
      };
      if (m->lead_ns) KILN_RT_TRY(kernel(&m->lead_kernel, "kiln_timing_lead"));
      if (flush_l2) KILN_RT_TRY(kernel(&m->l2_sweep, "kiln_l2_sweep"));
    }
    if (flush_l2) {
      int l2 = 0;
      KILN_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, runtime->device.ordinal));
      m->l2_flush_bytes = l2_sweep_bytes(l2);
      KILN_RT_TRY(context(cuda_status(cudaMalloc(&m->l2_flush, m->l2_flush_bytes), "cudaMalloc"),
                          "allocating the L2 flush buffer (KILN_TIMING_FLUSH_L2)"));
      KILN_CUDA_TRY(cudaMemset(m->l2_flush, 0, m->l2_flush_bytes));
    }
  }
  KILN_RT_TRY(prepare_steps(m.get()));
  KILN_RT_TRY(settle_convs(m.get()));

  const bool graph_work = m->steps_begin ? !m->steps.empty() : !m->steps.empty() || m->staging_bytes;
  if (runtime->options.use_cuda_graphs && graph_work) {
    // One eager run first, on zeroed memory (so index inputs stay in range): libraries
    // finish their lazy initialization outside the capture, and a plan that faults fails
    // here with its own error rather than inside a graph.
    if (plan.arena_bytes) KILN_CUDA_TRY(cudaMemsetAsync(m->arena, 0, plan.arena_bytes, m->stream));
    KILN_RT_TRY(context(enqueue(m.get()), "warm-up run"));
    KILN_RT_TRY(finish_stream(m.get(), "warm-up run"));
    KILN_RT_TRY(context(reset_state(m.get()), "warm-up run"));  // the first real run sees the initial state
    KILN_RT_TRY(capture_graph(m.get()));
  }
  *out = m.release();
  return nullptr;
}

namespace {

/// Checks the buffers a run is given against the model's inputs or outputs (`what`): their
/// count, each one's size, data where bytes are expected.
template <typename Tensor>
kiln_status* check_buffers(const std::string& fn, const char* what, const std::vector<kiln_model::Binding>& binds,
                           const Tensor* given, size_t count) {
  if (count != binds.size())
    return invalid(fn + ": " + std::to_string(count) + " " + what + (count == 1 ? "" : "s") +
                   " given, the model has " + std::to_string(binds.size()));
  if (count && !given) return invalid(fn + ": " + what + "s is NULL");
  for (size_t i = 0; i < count; ++i) {
    const kiln_tensor_info& info = binds[i].info;
    if (given[i].bytes != info.bytes)
      return invalid(fn + ": " + what + " '" + info.name + "' has " + std::to_string(given[i].bytes) +
                     " bytes, the model expects " + std::to_string(info.bytes));
    if (info.bytes && !given[i].data) return invalid(fn + ": " + what + " '" + info.name + "' has no data");
  }
  return nullptr;
}

/// The plan's steps alone as a CUDA graph, for runs whose copies are not the staging ones.
kiln_status* steps_graph(kiln_model* m, cudaGraphExec_t* out) {
  // With timing the main graph holds the steps alone already.
  if (m->steps_begin || !m->graph) {
    *out = m->steps_begin ? m->graph : nullptr;
    return nullptr;
  }
  if (!m->steps_graph && !m->steps.empty())
    KILN_RT_TRY(capture(m, enqueue_steps, &m->steps_graph, "capturing the plan's steps as a CUDA graph"));
  *out = m->steps_graph;
  return nullptr;
}

}  // namespace

kiln_status* run_device(kiln_model* m, const kiln_device_tensor* inputs, size_t num_inputs,
                        const kiln_device_tensor* outputs, size_t num_outputs, cudaStream_t caller) {
  const std::string fn = "kiln_model_run_device";
  if (m->comms)
    return make_status(KILN_STATUS_UNSUPPORTED, fn + ": per-rank models (" + m->rank_text + ") run through kiln_model_run");
  KILN_RT_TRY(check_buffers(fn, "input", m->inputs, inputs, num_inputs));
  KILN_RT_TRY(check_buffers(fn, "output", m->outputs, outputs, num_outputs));
  KILN_RT_TRY(synchronize_model(m, fn.c_str()));
  KILN_RT_TRY(check_copies(m, fn.c_str()));
  KILN_CUDA_TRY(cudaSetDevice(m->runtime->device.ordinal));
  if (!m->caller_ready) KILN_CUDA_TRY(cudaEventCreateWithFlags(&m->caller_ready, cudaEventDisableTiming));
  if (!m->device_done) KILN_CUDA_TRY(cudaEventCreateWithFlags(&m->device_done, cudaEventDisableTiming));
  cudaGraphExec_t graph = nullptr;
  KILN_RT_TRY(steps_graph(m, &graph));
  KILN_CUDA_TRY(cudaEventRecord(m->caller_ready, caller));
  KILN_CUDA_TRY(cudaStreamWaitEvent(m->stream, m->caller_ready, 0));
  for (size_t i = 0; i < num_inputs; ++i)
    if (inputs[i].bytes)
      KILN_CUDA_TRY(cudaMemcpyAsync(m->inputs[i].device, inputs[i].data, inputs[i].bytes, cudaMemcpyDeviceToDevice, m->stream));
  if (graph) KILN_CUDA_TRY(cudaGraphLaunch(graph, m->stream));
  else KILN_RT_TRY(enqueue_steps(m));
  for (size_t i = 0; i < num_outputs; ++i)
    if (outputs[i].bytes)
      KILN_CUDA_TRY(cudaMemcpyAsync(outputs[i].data, m->outputs[i].device, outputs[i].bytes, cudaMemcpyDeviceToDevice, m->stream));
  KILN_CUDA_TRY(cudaEventRecord(m->device_done, m->stream));
  KILN_CUDA_TRY(cudaStreamWaitEvent(caller, m->device_done, 0));
  return nullptr;
}

kiln_status* enqueue_model(kiln_model* m, const kiln_host_tensor* inputs, size_t num_inputs,
                           kiln_host_tensor* outputs, size_t num_outputs, const char* function) {
  const std::string fn = function;
  KILN_RT_TRY(check_buffers(fn, "input", m->inputs, inputs, num_inputs));
  KILN_RT_TRY(check_buffers(fn, "output", m->outputs, outputs, num_outputs));
  // Staging holds one run's inputs and outputs: the previous run must be done with it.
  KILN_RT_TRY(synchronize_model(m, function));
  KILN_RT_TRY(check_copies(m, function));
  if (m->watchdog && !m->watchdog->failure().empty())
    return make_status(KILN_STATUS_COLLECTIVE_FAILED, fn + ": " + m->watchdog->failure());
  KILN_CUDA_TRY(cudaSetDevice(m->runtime->device.ordinal));
  for (size_t i = 0; i < num_inputs; ++i)
    if (inputs[i].bytes) std::memcpy(m->staging + m->inputs[i].staging_offset, inputs[i].data, inputs[i].bytes);
  if (kiln_status* st = launch(m)) {
    // Drain what was launched, so the next call starts from an idle stream (under the watchdog:
    // a collective already queued may wait for ranks that are gone).
    kiln_status_release(finish_stream(m, fn));
    (void)cudaGetLastError();
    return context(st, fn);
  }
  if (m->watchdog) {
    KILN_CUDA_TRY(cudaEventRecord(m->run_done, m->stream));
    m->watchdog->arm(m->run_done, &m->collectives, m->rank_text);
  }
  m->pending_outputs.assign(outputs, outputs + num_outputs);
  m->pending = true;
  return nullptr;
}

kiln_status* synchronize_model(kiln_model* m, const char* function) {
  if (!m->pending) return nullptr;
  m->pending = false;
  KILN_CUDA_TRY(cudaSetDevice(m->runtime->device.ordinal));
  // Faults inside kernels surface here; with communicators, so do stalled collectives.
  if (m->watchdog) KILN_RT_TRY(m->watchdog->wait(function));
  else KILN_RT_TRY(context(cuda_status(cudaStreamSynchronize(m->stream), "cudaStreamSynchronize"), function));
  for (size_t i = 0; i < m->pending_outputs.size(); ++i) {
    const kiln_host_tensor& out = m->pending_outputs[i];
    if (out.bytes) std::memcpy(out.data, m->staging + m->outputs[i].staging_offset, out.bytes);
  }
  m->pending_outputs.clear();
  m->timed = m->steps_begin != nullptr;
  return nullptr;
}

kiln_status* check_copies(kiln_model* m, const char* function) {
  for (size_t i = 0; i < m->variables.size(); ++i)
    if (m->copy_state[i] == kiln_model::kCopyStale)
      return invalid(
                         std::string(function) + ": variable '" + m->variables[i].info.name + "' is a copy of '" +
                             m->variables[static_cast<size_t>(m->copy_of[i])].info.name +
                             "', which was written without it: write the copy too (after its weight), as the "
                             "checkpoint that holds the weight holds it");
  // A run makes every copy its weight's again: writing one now would break that.
  std::fill(m->copy_state.begin(), m->copy_state.end(), kiln_model::kCopyIdle);
  return nullptr;
}

kiln_status* copy_variable(kiln_model* m, size_t index, void* read_to, const void* write_from, uint64_t bytes,
                           const char* function) {
  const std::string fn = function;
  if (index >= m->variables.size())
    return invalid(fn + ": index " + std::to_string(index) + " out of range: the model has " +
                   std::to_string(m->variables.size()) + " variables");
  const kiln_model::Binding& v = m->variables[index];
  if (bytes != v.info.bytes)
    return invalid(fn + ": variable '" + v.info.name + "' holds " + std::to_string(v.info.bytes) + " bytes, " +
                   std::to_string(bytes) + " given");
  const int master = m->copy_of[index];
  if (write_from && master >= 0 && m->copy_state[index] == kiln_model::kCopyIdle)
    return invalid(
                       fn + ": variable '" + v.info.name + "' is the low-precision copy of '" +
                           m->variables[static_cast<size_t>(master)].info.name +
                           "' that the training step keeps: write that weight (its bf16/f16 copies follow it), "
                           "then, for other copies, this one");
  KILN_RT_TRY(synchronize_model(m, function));
  KILN_CUDA_TRY(cudaSetDevice(m->runtime->device.ordinal));
  // On the model's stream, after anything kiln_model_run_device left there.
  if (bytes) {
    if (read_to) KILN_CUDA_TRY(cudaMemcpyAsync(read_to, v.device, bytes, cudaMemcpyDeviceToHost, m->stream));
    else KILN_CUDA_TRY(cudaMemcpyAsync(v.device, write_from, bytes, cudaMemcpyHostToDevice, m->stream));
  }
  KILN_RT_TRY(context(cuda_status(cudaStreamSynchronize(m->stream), "cudaStreamSynchronize"), fn));
  if (!write_from) return nullptr;
  if (master >= 0) {
    m->copy_state[index] = kiln_model::kCopyWritable;
    return nullptr;
  }
  // The weight's copies: a bf16/f16 cast of an f32 weight is refreshed here from the same bytes
  // (rounded as the step's cast kernel rounds); any other (f8, which needs its scale) must be
  // written next.
  for (size_t c = 0; c < m->variables.size(); ++c) {
    if (m->copy_of[c] != static_cast<int>(index)) continue;
    const kiln_model::Binding& copy = m->variables[c];
    std::vector<uint16_t> narrow;
    if (!round_f32_copy(v.info.dtype, copy.info.dtype, write_from, v.info.bytes, &narrow)) {
      m->copy_state[c] = kiln_model::kCopyStale;
      continue;
    }
    if (copy.info.bytes)
      KILN_CUDA_TRY(cudaMemcpyAsync(copy.device, narrow.data(), copy.info.bytes, cudaMemcpyHostToDevice, m->stream));
    KILN_RT_TRY(context(cuda_status(cudaStreamSynchronize(m->stream), "cudaStreamSynchronize"), fn));
    m->copy_state[c] = kiln_model::kCopyWritable;
  }
  return nullptr;
}

kiln_status* model_device_time(const kiln_model* m, double* out_ms) {
  if (!m->steps_begin)
    return make_status(KILN_STATUS_UNSUPPORTED,
                       "kiln_model_device_time: the runtime was created without enable_timing");
  if (!m->timed) return invalid("kiln_model_device_time: no timed run has completed yet");
  float ms = 0;
  KILN_RT_TRY(context(cuda_status(cudaEventElapsedTime(&ms, m->steps_begin, m->steps_end), "cudaEventElapsedTime"),
                      "kiln_model_device_time"));
  *out_ms = ms;
  return nullptr;
}

kiln_status* profile_steps(kiln_model* m, int iterations, double* out_step_ms, size_t capacity) {
  if (iterations < 1) return invalid("kiln_model_profile_steps: iterations must be at least 1, got " + std::to_string(iterations));
  if (capacity < m->steps.size())
    return invalid("kiln_model_profile_steps: capacity " + std::to_string(capacity) + " is less than the " +
                   std::to_string(m->steps.size()) + " steps of the plan");
  KILN_RT_TRY(synchronize_model(m, "kiln_model_profile_steps"));
  KILN_RT_TRY(check_copies(m, "kiln_model_profile_steps"));
  KILN_CUDA_TRY(cudaSetDevice(m->runtime->device.ordinal));
  std::vector<cudaEvent_t> events(m->steps.size() + 1, nullptr);
  auto destroy = [&] {
    for (cudaEvent_t e : events)
      if (e) (void)cudaEventDestroy(e);
  };
  kiln_status* st = nullptr;
  for (cudaEvent_t& e : events)
    if (!st) st = cuda_status(cudaEventCreate(&e), "cudaEventCreate");
  std::vector<double> total(m->steps.size(), 0.0);
  for (int it = 0; it < iterations && !st; ++it) {
    st = cuda_status(cudaEventRecord(events[0], m->stream), "cudaEventRecord");
    for (size_t i = 0; i < m->steps.size() && !st; ++i) {
      st = enqueue_step(m, m->steps[i]);
      if (!st) st = cuda_status(cudaEventRecord(events[i + 1], m->stream), "cudaEventRecord");
    }
    if (!st) st = finish_stream(m, "kiln_model_profile_steps");
    for (size_t i = 0; i < m->steps.size() && !st; ++i) {
      float ms = 0;
      st = cuda_status(cudaEventElapsedTime(&ms, events[i], events[i + 1]), "cudaEventElapsedTime");
      total[i] += ms;
    }
  }
  destroy();
  if (st) return context(st, "kiln_model_profile_steps");
  for (size_t i = 0; i < total.size(); ++i) out_step_ms[i] = total[i] / iterations;
  return nullptr;
}

}  // namespace kiln::rt

kiln_model::~kiln_model() {
  if (runtime) (void)cudaSetDevice(runtime->device.ordinal);
  const bool aborted = comms && comms->aborted();
  watchdog.reset();
  if (aborted && stream) {
    // The abort let the NCCL kernels exit; should the device still be busy after a while, the
    // model's memory is left to the process's exit rather than freed under running work.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (cudaStreamQuery(stream) == cudaErrorNotReady && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (cudaStreamQuery(stream) == cudaErrorNotReady) {
      // Freeing device memory would wait for the device: the memory, and the runtime holding
      // the allocator, stay until the process exits.
      (void)cudaGetLastError();
      return;
    }
  }
  if (stream) (void)cudaStreamSynchronize(stream);
  if (graph) (void)cudaGraphExecDestroy(graph);
  if (steps_graph) (void)cudaGraphExecDestroy(steps_graph);
  if (caller_ready) (void)cudaEventDestroy(caller_ready);
  if (device_done) (void)cudaEventDestroy(device_done);
  if (run_done) (void)cudaEventDestroy(run_done);
  if (steps_begin) (void)cudaEventDestroy(steps_begin);
  if (steps_end) (void)cudaEventDestroy(steps_end);
  steps.clear();  // gemm and conv descriptors before their handles
  cudnn.reset();
  if (cublas) (void)cublasLtDestroy(cublas);
  collectives.clear();
  comms.reset();
  if (stream) (void)cudaStreamDestroy(stream);
  if (library) (void)cudaLibraryUnload(library);
  if (timing_library) (void)cudaLibraryUnload(timing_library);
  if (l2_flush) (void)cudaFree(l2_flush);
  if (staging) (void)cudaFreeHost(staging);
  if (runtime) {
    runtime->allocator->release(weights);
    runtime->allocator->release(arena);
    runtime->allocator->release(workspace);
  }
  (void)cudaGetLastError();
  if (runtime) runtime->unref();
}
