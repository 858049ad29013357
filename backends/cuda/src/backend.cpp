// The CUDA backend: builds .kiln artifact parts (plan, weights, NVRTC images) and runs graphs
// for `kiln run` through the runtime's C API.
#include "kiln/cuda/backend.h"

#include <cuda.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "kiln/core/artifact.h"
#include "kiln/cuda/autotune.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/distributed.h"
#include "kiln/ir/interpreter.h"
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

/// The architecture digits of a target or device name: "sm_90a" → "90", "compute_100f" → "100".
std::string arch_digits(const std::string& name) {
  const size_t us = name.find('_');
  if (us == std::string::npos) return "";
  std::string d;
  for (size_t i = us + 1; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) d += name[i];
  return d;
}

/// The names in `v` separated by `sep`.
std::string joined(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (const std::string& x : v) out += (out.empty() ? "" : sep) + x;
  return out;
}

/// Whether the plugin builds kernel images for `target`.
bool builds(const Capabilities& caps, const std::string& target) {
  return std::find(caps.targets.begin(), caps.targets.end(), target) != caps.targets.end();
}

/// The backend and shared memory per block the plan was lowered for: meta cuda_plan,
/// "<plugin> smem=<bytes>" (nullopt when absent or malformed).
std::optional<std::pair<std::string, int64_t>> plan_lowering(
    const std::map<std::string, std::string>& meta) {
  const auto it = meta.find("cuda_plan");
  if (it == meta.end()) return std::nullopt;
  const std::string& v = it->second;
  const size_t sp = v.find(" smem=");
  int64_t smem = 0;
  if (sp == std::string::npos) return std::nullopt;
  const auto [end, ec] = std::from_chars(v.data() + sp + 6, v.data() + v.size(), smem);
  if (ec != std::errc() || end != v.data() + v.size()) return std::nullopt;
  return std::pair{v.substr(0, sp), smem};
}

/// `plan` without the choices autotuning appended to its steps (" algo=..." to the line's end).
std::string without_tuned_choices(const std::string& plan) {
  std::string out;
  for (size_t at = 0; at < plan.size();) {
    size_t nl = plan.find('\n', at);
    if (nl == std::string::npos) nl = plan.size();
    const std::string line = plan.substr(at, nl - at);
    out += line.substr(0, line.starts_with("step ") ? line.find(" algo=") : std::string::npos);
    if (nl < plan.size()) out += '\n';
    at = nl + 1;
  }
  return out;
}

/// The speedup of a choice over the library's own, for the summary.
double speedup(const TunedChoice& c) { return c.best_ms > 0 ? c.heuristic_ms / c.best_ms : 1.0; }

std::string fixed2(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

std::string cuda_version() {
  return std::to_string(CUDA_VERSION / 1000) + "." + std::to_string(CUDA_VERSION % 1000 / 10);
}

class CudaBackend;

/// Compiles lazily per set of input shapes: symbolic dims are bound from the first inputs
/// that show them, and each binding gets its own artifact and loaded model. It keeps its own
/// copy of the backend's settings: callers may release the backend once it has compiled.
class CudaExecutable final : public Executable {
 public:
  CudaExecutable(std::unique_ptr<CudaBackend> backend, std::unique_ptr<Graph> g)
      : backend_(std::move(backend)), graph_(std::move(g)) {}
  ~CudaExecutable() override {
    for (auto& [key, model] : models_) kiln_model_release(model);
    kiln_runtime_release(runtime_);
  }
  StatusOr<std::vector<Tensor>> run(std::span<const Tensor> inputs) override;
  StatusOr<std::map<std::string, Tensor>> read_state() override;
  Status write_state(const std::map<std::string, Tensor>& values) override;

 private:
  std::unique_ptr<CudaBackend> backend_;
  std::unique_ptr<Graph> graph_;
  kiln_runtime* runtime_ = nullptr;
  std::map<std::string, kiln_model*> models_;
  /// The model of the latest run: its device memory holds the variables' current values.
  kiln_model* latest_ = nullptr;
  std::map<std::string, std::unique_ptr<Graph>> bound_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(Capabilities caps, const Options& o)
      : caps_(std::move(caps)), keep_source_(!o.has("keep-source") || o.get_bool("keep-source")) {
    opts_ = lowering_options(caps_, o);
    autotune_ = o.has("autotune") && o.get_bool("autotune");
    images_ = o.has("images") && !o.get_strings("images").empty() ? o.get_strings("images") : caps_.targets;
  }

  StatusOr<std::unique_ptr<Executable>> compile(const Graph& g) override {
    return std::unique_ptr<Executable>(std::make_unique<CudaExecutable>(std::make_unique<CudaBackend>(*this), g.clone()));
  }

  Status build_artifact(const Graph& g, const std::vector<std::string>& targets, ArtifactContents& out) override {
    for (const std::string& t : targets)
      if (!builds(caps_, t))
        return invalid_argument(caps_.plugin + ": cannot build for target '" + t + "'; it builds " +
                                joined(caps_.targets, ", "));
    // One plan serves every target: a generation added after another follows that plan's FP8
    // choice (a plan without FP8 GEMMs runs anywhere; one with them cannot run here without FP8)
    // and lowers as the plan's backend did (its plan shapes and shared-memory limit, recorded in
    // meta cuda_plan), so this generation's images define the kernels the plan launches, with
    // the launch shapes it gives them.
    LoweringOptions opts = opts_;
    if (!out.plan.empty()) {
      const bool plan_fp8 = out.plan.find(" a_scale=") != std::string::npos;
      if (plan_fp8 && !caps_.fp8)
        return failed_precondition(opts_.target + " has no FP8 tensor cores, but the plan built for the targets "
                                   "before it uses FP8 GEMMs; list this target first (a fallback=bf16 plan then "
                                   "serves every target)");
      opts.fp8 = plan_fp8;
      const std::optional<std::pair<std::string, int64_t>> by = plan_lowering(out.meta);
      if (!by)
        return failed_precondition(opts_.target +
                                   ": the plan built before is not a CUDA backend's "
                                   "(no meta cuda_plan), so this backend cannot add images to it");
      opts.target = by->first + ": target " + (targets.empty() ? "?" : targets[0]);
      opts.max_smem_per_block = by->second;
    }
    KILN_ASSIGN_OR_RETURN(LoweredGraph lowered, lower_graph(g, opts));
    if (out.plan.empty()) {
      out.plan = std::move(lowered.plan);
      out.weights = std::move(lowered.weights);
      out.meta["cuda_plan"] = caps_.plugin + " smem=" + std::to_string(opts.max_smem_per_block);
    } else if (without_tuned_choices(out.plan) != lowered.plan) {
      return internal_error(opts_.target + ": lowering the graph again gave another plan");
    }
    out.meta.emplace("cuda_version", cuda_version());
    out.meta.emplace("nvrtc_version", nvrtc_version());
    const std::string producer = caps_.plugin + "@" + caps_.version;
    for (const std::string& t : targets) {
      KILN_ASSIGN_OR_RETURN(std::string image, compile_cuda(lowered.source, t, producer));
      out.images.push_back({t, image_form(t), std::move(image)});
      if (keep_source_) out.sources[t] = lowered.source;
    }
    // Tuned once per plan: a later generation's backend sees the algo= fields and leaves them.
    if (autotune_ && out.plan.find(" algo=") == std::string::npos) {
      std::vector<std::string> warnings;
      KILN_ASSIGN_OR_RETURN(std::string summary, autotune_artifact(out, targets, {}, &warnings));
      for (const std::string& w : warnings) std::fprintf(stderr, "kiln: warning: %s\n", w.c_str());
      std::fprintf(stderr, "kiln: note: %s\n", summary.c_str());
      out.meta["autotune"] = summary;
    }
    return ok_status();
  }

  const Capabilities& caps() const { return caps_; }
  /// The images an executable's artifact holds (the `images` option; default every target).
  const std::vector<std::string>& images() const { return images_; }

 private:
  Capabilities caps_;
  std::vector<std::string> images_;
  LoweringOptions opts_;
  bool keep_source_;
  bool autotune_ = false;
};

StatusOr<std::vector<Tensor>> CudaExecutable::run(std::span<const Tensor> inputs) {
  const std::string& who = backend_->caps().plugin;
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
    art.meta = {{"kiln_version", KILN_VERSION_STRING}, {"created_by", "kiln run"},
                {"targets", joined(backend_->images(), ",")}};
    KILN_RETURN_IF_ERROR(backend_->build_artifact(*g, backend_->images(), art));
    const std::string bytes = serialize_artifact(art);
    // A per-rank program loads as this process's rank of its launcher (or alone, for one rank).
    const bool per_rank = g->is_per_rank() && !g->mesh().empty();
    if (runtime_ == nullptr) {
      kiln_runtime_options o;
      kiln_runtime_options_initialize(&o);
      std::string error;
      if (per_rank && (o.device_ordinal = dist::launch_device(&error)) < 0) return invalid_argument(who + ": " + error);
      KILN_RETURN_IF_ERROR(from_runtime(kiln_runtime_create(&o, &runtime_), who));
    }
    kiln_model* model = nullptr;
    KILN_RETURN_IF_ERROR(from_runtime(
        per_rank ? kiln_model_load_memory_distributed(runtime_, bytes.data(), bytes.size(), nullptr, &model)
                 : kiln_model_load_memory(runtime_, bytes.data(), bytes.size(), &model),
        who));
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
  latest_ = it->second;
  return results;
}

/// The graph's `variable` nodes by name.
std::map<std::string, Node*> variables_of(const Graph& g) {
  std::map<std::string, Node*> vars;
  for (const auto& n : g.nodes())
    if (n->op_name() == "variable") vars[n->get_string("name")] = n.get();
  return vars;
}

StatusOr<std::map<std::string, Tensor>> CudaExecutable::read_state() {
  const std::string& who = backend_->caps().plugin;
  std::map<std::string, Tensor> state;
  for (const auto& [name, n] : variables_of(*graph_)) state.emplace(name, n->attr("init")->as_tensor());
  if (latest_ == nullptr) return state;  // nothing ran yet: every variable holds its init
  for (size_t i = 0; i < kiln_model_num_variables(latest_); ++i) {
    kiln_tensor_info info{};
    KILN_RETURN_IF_ERROR(from_runtime(kiln_model_variable_info(latest_, i, &info), who));
    auto it = state.find(info.name);
    if (it == state.end()) return internal_error(who + ": the plan's variable '" + std::string(info.name) + "' is not in the graph");
    Tensor& t = it->second;
    if (static_cast<uint64_t>(t.nbytes()) != info.bytes)
      return internal_error(who + ": variable '" + it->first + "' has " + std::to_string(info.bytes) +
                            " bytes on the device, " + std::to_string(t.nbytes()) + " in the graph");
    KILN_RETURN_IF_ERROR(from_runtime(kiln_model_read_variable(latest_, i, t.mutable_data(), info.bytes), who));
  }
  return state;
}

Status CudaExecutable::write_state(const std::map<std::string, Tensor>& given) {
  const std::string& who = backend_->caps().plugin;
  const std::map<std::string, Node*> vars = variables_of(*graph_);
  // Everything is checked before anything changes, so a bad value leaves the state as it was.
  for (const auto& [name, t] : given) {
    auto it = vars.find(name);
    if (it == vars.end()) return not_found(who + ": the graph has no variable '" + name + "'");
    const TensorType want = it->second->result()->type();
    if (t.dtype() != want.dtype || t.shape() != static_sizes(want.shape))
      return invalid_argument(who + ": variable '" + name + "' is " + want.str() + ", the value given is " + t.type().str());
  }
  // A weight's low-precision copies follow it (computed here, on the host, as the step does).
  std::map<std::string, Tensor> values = given;
  std::optional<std::map<std::string, Tensor>> current;
  Status completed = complete_state_copies(*graph_, values, [&](const std::string& name) {
    if (!current) {
      auto state = read_state();
      current = state.ok() ? std::move(*state) : std::map<std::string, Tensor>{};
    }
    auto it = current->find(name);
    return it != current->end() ? it->second : vars.at(name)->attr("init")->as_tensor();
  });
  KILN_RETURN_IF_ERROR(completed.with_context(who));
  // The graph's inits, for models built from now on (other input shapes), and the device
  // memory of every model loaded already: weights before their copies (the runtime takes a
  // copy only after its weight, which it refreshes the copy from where it can).
  for (const auto& [name, t] : values) vars.at(name)->set_attr("init", Attribute(t));
  for (auto& [key, model] : models_) {
    for (const bool copies : {false, true})
      for (size_t i = 0; i < kiln_model_num_variables(model); ++i) {
        kiln_tensor_info info{};
        KILN_RETURN_IF_ERROR(from_runtime(kiln_model_variable_info(model, i, &info), who));
        auto it = values.find(info.name);
        if (it == values.end() || !state_copy_master(*vars.at(info.name)).empty() != copies) continue;
        KILN_RETURN_IF_ERROR(from_runtime(kiln_model_write_variable(model, i, it->second.data(), it->second.nbytes()), who));
      }
  }
  return ok_status();
}

}  // namespace

KernelCacheKey autotune_cache_key(const std::string& problem) {
  return KernelCacheKey{problem, "autotune", "", {"kiln-autotune-choice 1"}, std::string("kiln@") + KILN_VERSION_STRING};
}

std::string encode_tuned_choice(const TunedChoice& c) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6f %.6f", c.best_ms, c.heuristic_ms);
  return "kiln-autotune 1\nchoice " + c.choice + "\nms " + buf + "\n";
}

std::optional<TunedChoice> decode_tuned_choice(const std::string& payload) {
  // Exactly: "kiln-autotune 1\nchoice algo=...\nms BEST HEURISTIC\n", both times positive.
  const std::string head = "kiln-autotune 1\nchoice ";
  const size_t nl = payload.find('\n', head.size());
  if (!payload.starts_with(head) || nl == std::string::npos || payload.compare(nl, 4, "\nms ") != 0 ||
      !payload.ends_with("\n"))
    return std::nullopt;
  TunedChoice c;
  c.choice = payload.substr(head.size(), nl - head.size());
  if (!c.choice.starts_with("algo=") || c.choice.size() == 5) return std::nullopt;
  const char* end = payload.data() + payload.size() - 1;
  auto [p, e1] = std::from_chars(payload.data() + nl + 4, end, c.best_ms);
  if (e1 != std::errc() || p == end || *p != ' ') return std::nullopt;
  auto [q, e2] = std::from_chars(p + 1, end, c.heuristic_ms);
  if (e2 != std::errc() || q != end || !(c.best_ms > 0) || !(c.heuristic_ms > 0)) return std::nullopt;
  return c;
}

StatusOr<std::string> apply_tuned_choices(const std::string& plan, const std::map<size_t, std::string>& choices) {
  std::string out;
  size_t index = 0, applied = 0;
  for (size_t at = 0; at < plan.size();) {
    size_t nl = plan.find('\n', at);
    if (nl == std::string::npos) nl = plan.size();
    std::string line = plan.substr(at, nl - at);
    if (line.starts_with("step ")) {
      if (auto it = choices.find(index); it != choices.end()) {
        if (line.find(" algo=") != std::string::npos)
          return invalid_argument("autotune: plan step " + std::to_string(index) + " already has an algo=");
        line += " " + it->second;
        ++applied;
      }
      ++index;
    }
    out += line + (nl < plan.size() ? "\n" : "");
    at = nl + 1;
  }
  if (applied != choices.size())
    return invalid_argument("autotune: the plan has " + std::to_string(index) + " steps, a choice names step " +
                            std::to_string(choices.rbegin()->first));
  return out;
}

std::string autotune_target_for(const std::string& device, const std::vector<std::string>& targets) {
  const std::string want = arch_digits(device);
  for (const std::string& t : targets)
    if (!want.empty() && arch_digits(t) == want) return t;
  return "";
}

StatusOr<std::string> autotune_artifact(ArtifactContents& art, const std::vector<std::string>& targets,
                                        const AutotuneOptions& opts, std::vector<std::string>* warnings) {
  std::string wanted;
  for (const std::string& t : targets) wanted += (wanted.empty() ? "" : ", ") + t;
  const std::string keep = "; steps keep cuBLASLt's heuristic and cuDNN's load-time search";
  kiln_runtime_options ro;
  kiln_runtime_options_initialize(&ro);
  ro.use_cuda_graphs = 0;  // the model only serves timing: no warm-up run, no capture
  kiln_runtime* rt = nullptr;
  if (kiln_status* st = kiln_runtime_create(&ro, &rt)) {
    const bool no_device = kiln_status_get_code(st) == KILN_STATUS_NO_DEVICE;
    const std::string why = kiln_status_get_message(st);
    kiln_status_release(st);
    return "autotune: no CUDA device for " + wanted + " here" + (no_device ? "" : " (" + why + ")") + keep;
  }
  std::unique_ptr<kiln_runtime, void (*)(kiln_runtime*)> rt_guard(rt, kiln_runtime_release);
  const std::string device = kiln_runtime_device_name(rt);
  if (autotune_target_for(device, targets).empty())
    return "autotune: the CUDA device here is " + device + ", not " + wanted + keep;
  const std::string bytes = serialize_artifact(art);
  kiln_model* model = nullptr;
  if (kiln_status* st = kiln_model_load_memory(rt, bytes.data(), bytes.size(), &model)) {
    const std::string why = kiln_status_get_message(st);
    kiln_status_release(st);
    return "autotune: cannot load the plan on " + device + " (" + why + ")" + keep;
  }
  std::unique_ptr<kiln_model, void (*)(kiln_model*)> model_guard(model, kiln_model_release);

  KernelCache cache;
  std::map<std::string, TunedChoice> by_problem;  // each distinct problem is tuned once
  std::map<size_t, std::string> choices;
  int gemms = 0, gemms_cached = 0, convs = 0, convs_cached = 0;
  std::string best_label;
  double best_speedup = 0;
  for (size_t i = 0; i < kiln_model_num_steps(model); ++i) {
    char problem_buf[2048];
    KILN_RETURN_IF_ERROR(from_runtime(kiln_model_step_problem(model, i, problem_buf, sizeof problem_buf), "autotune"));
    const std::string problem = problem_buf;
    if (problem.empty()) continue;
    auto known = by_problem.find(problem);
    if (known == by_problem.end()) {
      const bool gemm = problem.starts_with("gemm");
      const KernelCacheKey key = autotune_cache_key(problem);
      std::string warning;
      std::optional<TunedChoice> c;
      if (std::optional<std::string> hit = cache.lookup(key, &warning)) {
        c = decode_tuned_choice(*hit);
        if (!c) warning = "autotune: cache entry for '" + problem.substr(0, problem.find(" |")) +
                          "' is not a tuned choice; re-tuning";
      }
      if (!warning.empty() && warnings) warnings->push_back(warning);
      const bool cached = c.has_value();
      if (!c) {
        kiln_tune_result r{};
        r.struct_size = sizeof r;
        KILN_RETURN_IF_ERROR(from_runtime(
            kiln_model_tune_step(model, i, opts.max_candidates, opts.iterations, &r), "autotune"));
        if (r.candidates == 0) continue;  // nothing ran here: the step keeps the library's choice
        c = TunedChoice{r.choice, r.best_ms, r.heuristic_ms};
        (void)cache.store(key, encode_tuned_choice(*c));  // a cache that cannot be written only costs time
      }
      (gemm ? gemms : convs)++;
      if (cached) (gemm ? gemms_cached : convs_cached)++;
      if (speedup(*c) > best_speedup) best_speedup = speedup(*c), best_label = problem.substr(0, problem.find(" |"));
      known = by_problem.emplace(problem, *c).first;
    }
    choices[i] = known->second.choice;
  }
  model_guard.reset();
  if (!choices.empty()) {
    KILN_ASSIGN_OR_RETURN(art.plan, apply_tuned_choices(art.plan, choices));
  }
  std::string summary = "autotune: " + std::to_string(gemms) + " gemm problem" + (gemms == 1 ? "" : "s") + " (" +
                        std::to_string(gemms_cached) + " from cache), " + std::to_string(convs) + " conv (" +
                        std::to_string(convs_cached) + " from cache) on " + device;
  if (!best_label.empty()) summary += "; best vs heuristic: " + fixed2(best_speedup) + "x on " + best_label;
  return summary;
}

LoweringOptions lowering_options(const Capabilities& caps, const Options& o) {
  LoweringOptions l;
  // allow-tf32 allows both kinds, as PyTorch's two flags set alike; each of the others one kind.
  const bool tf32 = o.has("allow-tf32") && o.get_bool("allow-tf32");
  l.allow_tf32 = tf32 || (o.has("allow-tf32-matmul") && o.get_bool("allow-tf32-matmul"));
  l.allow_tf32_conv = tf32 || (o.has("allow-tf32-conv") && o.get_bool("allow-tf32-conv"));
  if (o.has("conv")) l.conv = o.get_string("conv");
  if (o.has("depthwise")) l.depthwise = o.get_string("depthwise");
  if (o.has("conv1x1")) l.conv1x1 = o.get_string("conv1x1");
  l.int4_exact_zeros = o.has("int4-exact-zeros") && o.get_bool("int4-exact-zeros");
  l.fp8 = caps.fp8;
  l.max_smem_per_block = caps.max_smem_per_block;
  l.target = caps.plugin + ": target " + (caps.targets.empty() ? "?" : caps.targets[0]);
  return l;
}

Status register_backend(Registry& r, const Capabilities& caps) {
  BackendInfo info;
  info.name = caps.plugin;
  info.version = caps.version;
  info.summary = caps.summary;
  info.targets = caps.targets;
  info.options = {{"allow-tf32", OptionType::kBool, false,
                   "f32 GEMMs and convolutions may use tf32 tensor cores (both of the options below)"},
                  {"allow-tf32-matmul", OptionType::kBool, false,
                   "f32 matmuls and linears may use tf32 tensor cores (PyTorch's torch.backends.cuda.matmul.allow_tf32)"},
                  {"allow-tf32-conv", OptionType::kBool, false,
                   "f32 convolutions may use tf32 tensor cores (PyTorch's torch.backends.cudnn.allow_tf32)"},
                  {"autotune", OptionType::kBool, false,
                   "time cuBLASLt/cuDNN algorithms on this machine's GPU at compile time and record the fastest in "
                   "the plan (cached in the kernel cache)"},
                  {"keep-source", OptionType::kBool, true, "store the generated CUDA source in artifacts"},
                  {"conv", OptionType::kString, std::string("cudnn"),
                   "convolutions through cudnn (needs libcudnn.so.9 at run time) or gemm (im2col + cuBLASLt)"},
                  {"depthwise", OptionType::kString, std::string("kernel"),
                   "depthwise convolutions (groups == input channels) as a generated kernel that also applies the "
                   "bias, batch norm, activation and residual add after them (kernel), or as option conv says (cudnn)"},
                  {"conv1x1", OptionType::kString, std::string("gemm"),
                   "1x1 convolutions with unit strides, no padding and one group as one strided-batched cuBLASLt GEMM "
                   "with the bias, a residual add and a relu fused (gemm), or as option conv says (cudnn)"},
                  {"images", OptionType::kStringList, std::vector<std::string>{},
                   "the kernel images `kiln run` builds, a subset of the plugin's targets (default all; the runtime "
                   "loads the best one for the GPU): e.g. [compute_90] runs the portable PTX path"},
                  {"int4-exact-zeros", OptionType::kBool, false,
                   "asymmetric INT4 weights dequantize as (q - zero) * scale, as the reference does, "
                   "instead of q * scale + (-zero * scale) with -zero * scale rounded once to the "
                   "activations' half type (and packed with the scale at compile time): results closer "
                   "to the reference, without the packed pairs' speed-up (with the reordered weights "
                   "6-16% at M <= 64 on the H200, bench/results/2026-12-03-gpu-run15.md)"}};
  info.create = [caps](const Options& o) -> StatusOr<std::unique_ptr<Backend>> {
    if (o.has("conv") && o.get_string("conv") != "cudnn" && o.get_string("conv") != "gemm")
      return invalid_argument(caps.plugin + ": option conv='" + o.get_string("conv") + "' is not cudnn or gemm");
    if (o.has("depthwise") && o.get_string("depthwise") != "kernel" && o.get_string("depthwise") != "cudnn")
      return invalid_argument(caps.plugin + ": option depthwise='" + o.get_string("depthwise") +
                              "' is not kernel or cudnn");
    if (o.has("conv1x1") && o.get_string("conv1x1") != "gemm" && o.get_string("conv1x1") != "cudnn")
      return invalid_argument(caps.plugin + ": option conv1x1='" + o.get_string("conv1x1") + "' is not gemm or cudnn");
    if (o.has("images"))
      for (const std::string& t : o.get_strings("images"))
        if (!builds(caps, t))
          return invalid_argument(caps.plugin + ": option images names '" + t + "', not one of its targets (" +
                                  joined(caps.targets, ", ") + ")");
    return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(caps, o));
  };
  return r.add_backend(std::move(info));
}

}  // namespace kiln::cuda
