// The CUDA backend: builds .kiln artifact parts (plan, weights, NVRTC images) and runs graphs
// for `kiln run` through the runtime's C API.
#include "kiln/cuda/backend.h"

#include <cuda.h>

#include <algorithm>
#include <map>
#include <memory>

#include "kiln/core/artifact.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/op.h"
#include "kiln/runtime.h"
#include "kiln/version.h"

namespace kiln::cuda {
namespace {

/// The runtime's status as a Kiln Status (releasing it).
Status from_runtime(kiln_status* s, const std::string& what) {
  if (s == nullptr) return ok_status();
  const std::string msg = what + ": " + kiln_status_get_message(s);
  const kiln_status_code code = kiln_status_get_code(s);
  kiln_status_release(s);
  switch (code) {
    case KILN_STATUS_INVALID_ARGUMENT: return invalid_argument(msg);
    case KILN_STATUS_NOT_FOUND: return not_found(msg);
    case KILN_STATUS_UNSUPPORTED:
    case KILN_STATUS_NO_DEVICE: return failed_precondition(msg);
    default: return internal_error(msg);
  }
}

std::string cuda_version() {
  return std::to_string(CUDA_VERSION / 1000) + "." + std::to_string(CUDA_VERSION % 1000 / 10);
}

class CudaBackend;

/// Compiles lazily per set of input shapes: symbolic dims are bound from the first inputs
/// that show them, and each binding gets its own artifact and loaded model.
class CudaExecutable final : public Executable {
 public:
  CudaExecutable(CudaBackend& backend, std::unique_ptr<Graph> g) : backend_(backend), graph_(std::move(g)) {}
  ~CudaExecutable() override {
    for (auto& [key, model] : models_) kiln_model_release(model);
    kiln_runtime_release(runtime_);
  }
  StatusOr<std::vector<Tensor>> run(std::span<const Tensor> inputs) override;

 private:
  CudaBackend& backend_;
  std::unique_ptr<Graph> graph_;
  kiln_runtime* runtime_ = nullptr;
  std::map<std::string, kiln_model*> models_;
  std::map<std::string, std::unique_ptr<Graph>> bound_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(Capabilities caps, const Options& o)
      : caps_(std::move(caps)), keep_source_(!o.has("keep-source") || o.get_bool("keep-source")) {
    opts_.allow_tf32 = o.has("allow-tf32") && o.get_bool("allow-tf32");
    if (o.has("conv")) opts_.conv = o.get_string("conv");
    opts_.fp8 = caps_.fp8;
    opts_.target = caps_.plugin + ": target " + (caps_.targets.empty() ? "?" : caps_.targets[0]);
  }

  StatusOr<std::unique_ptr<Executable>> compile(const Graph& g) override {
    return std::unique_ptr<Executable>(std::make_unique<CudaExecutable>(*this, g.clone()));
  }

  Status build_artifact(const Graph& g, const std::vector<std::string>& targets, ArtifactContents& out) override {
    for (const std::string& t : targets)
      if (std::find(caps_.targets.begin(), caps_.targets.end(), t) == caps_.targets.end()) {
        std::string known;
        for (const std::string& k : caps_.targets) known += (known.empty() ? "" : ", ") + k;
        return invalid_argument(caps_.plugin + ": cannot build for target '" + t + "'; it builds " + known);
      }
    // One plan serves every target: a generation added after another follows that plan's FP8
    // choice (a plan without FP8 GEMMs runs anywhere; one with them cannot run here without FP8).
    LoweringOptions opts = opts_;
    if (!out.plan.empty()) {
      const bool plan_fp8 = out.plan.find(" a_scale=") != std::string::npos;
      if (plan_fp8 && !caps_.fp8)
        return failed_precondition(opts_.target + " has no FP8 tensor cores, but the plan built for the targets "
                                   "before it uses FP8 GEMMs; list this target first (a fallback=bf16 plan then "
                                   "serves every target)");
      opts.fp8 = plan_fp8;
    }
    KILN_ASSIGN_OR_RETURN(LoweredGraph lowered, lower_graph(g, opts));
    if (out.plan.empty()) {
      out.plan = std::move(lowered.plan);
      out.weights = std::move(lowered.weights);
    }
    out.meta.emplace("cuda_version", cuda_version());
    out.meta.emplace("nvrtc_version", nvrtc_version());
    const std::string producer = caps_.plugin + "@" + caps_.version;
    for (const std::string& t : targets) {
      KILN_ASSIGN_OR_RETURN(std::string image, compile_cuda(lowered.source, t, producer));
      out.images.push_back({t, image_form(t), std::move(image)});
      if (keep_source_) out.sources[t] = lowered.source;
    }
    return ok_status();
  }

  const Capabilities& caps() const { return caps_; }

 private:
  Capabilities caps_;
  LoweringOptions opts_;
  bool keep_source_;
};

StatusOr<std::vector<Tensor>> CudaExecutable::run(std::span<const Tensor> inputs) {
  const std::string& who = backend_.caps().plugin;
  if (static_cast<int>(inputs.size()) != graph_->num_inputs())
    return invalid_argument(who + ": graph takes " + std::to_string(graph_->num_inputs()) + " inputs, got " +
                            std::to_string(inputs.size()));
  std::map<std::string, int64_t> symbols;
  std::string key;
  for (int i = 0; i < graph_->num_inputs(); ++i) {
    const Value* v = graph_->input(i);
    const Tensor& t = inputs[static_cast<size_t>(i)];
    if (t.dtype() != v->dtype() || t.rank() != v->type().rank())
      return invalid_argument(who + ": input " + std::to_string(i) + " is " + t.type().str() + ", expected " +
                              v->type().str());
    for (size_t d = 0; d < v->shape().size(); ++d)
      if (!v->shape()[d].is_static()) symbols.emplace(v->shape()[d].symbol_name(), t.shape()[d]);
    key += t.type().str() + ";";
  }
  auto it = models_.find(key);
  if (it == models_.end()) {
    std::unique_ptr<Graph> g = graph_->clone();
    KILN_RETURN_IF_ERROR(bind_symbols(*g, symbols).with_context(who));
    ArtifactContents art;
    art.meta = {{"kiln_version", KILN_VERSION_STRING}, {"created_by", "kiln run"}, {"targets", ""}};
    std::string targets;
    for (const std::string& t : backend_.caps().targets) targets += (targets.empty() ? "" : ",") + t;
    art.meta["targets"] = targets;
    KILN_RETURN_IF_ERROR(backend_.build_artifact(*g, backend_.caps().targets, art));
    const std::string bytes = serialize_artifact(art);
    if (runtime_ == nullptr) {
      kiln_runtime_options o;
      kiln_runtime_options_initialize(&o);
      KILN_RETURN_IF_ERROR(from_runtime(kiln_runtime_create(&o, &runtime_), who));
    }
    kiln_model* model = nullptr;
    KILN_RETURN_IF_ERROR(from_runtime(kiln_model_load_memory(runtime_, bytes.data(), bytes.size(), &model), who));
    it = models_.emplace(key, model).first;
    bound_[key] = std::move(g);
  }
  const Graph& g = *bound_[key];
  std::vector<kiln_host_tensor> in, out;
  for (const Tensor& t : inputs) in.push_back({const_cast<std::byte*>(t.data()), t.nbytes()});
  std::vector<Tensor> results;
  for (const Value* v : g.outputs()) results.emplace_back(v->dtype(), static_sizes(v->shape()));
  for (Tensor& t : results) out.push_back({t.mutable_data(), t.nbytes()});
  KILN_RETURN_IF_ERROR(from_runtime(kiln_model_run(it->second, in.data(), in.size(), out.data(), out.size()), who));
  return results;
}

}  // namespace

Status register_backend(Registry& r, const Capabilities& caps) {
  BackendInfo info;
  info.name = caps.plugin;
  info.version = caps.version;
  info.summary = caps.summary;
  info.targets = caps.targets;
  info.options = {{"allow-tf32", OptionType::kBool, false, "f32 matmuls may use tf32 tensor cores"},
                  {"keep-source", OptionType::kBool, true, "store the generated CUDA source in artifacts"},
                  {"conv", OptionType::kString, std::string("cudnn"),
                   "convolutions through cudnn (needs libcudnn.so.9 at run time) or gemm (im2col + cuBLASLt)"}};
  info.create = [caps](const Options& o) -> StatusOr<std::unique_ptr<Backend>> {
    if (o.has("conv") && o.get_string("conv") != "cudnn" && o.get_string("conv") != "gemm")
      return invalid_argument(caps.plugin + ": option conv='" + o.get_string("conv") + "' is not cudnn or gemm");
    return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(caps, o));
  };
  return r.add_backend(std::move(info));
}

}  // namespace kiln::cuda
