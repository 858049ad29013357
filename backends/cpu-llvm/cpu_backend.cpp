// The cpu backend plugin: plans a graph per input-shape signature, JIT-compiles its elementwise
// groups with LLVM, runs contractions through OpenBLAS and the rest through native or
// reference kernels, splitting outer loops across a thread pool.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

#include "cpu.h"
#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"
#include "kiln/plugin.h"

namespace kiln::cpu {
namespace {

/// How a step runs.
enum class StepKind { kJit, kNative, kAlias, kReference };

struct Step {
  const Node* node = nullptr;
  StepKind kind = StepKind::kReference;
  std::vector<int> in, out;          ///< value ids
  std::vector<DType> out_dtypes;
  std::vector<Sizes> out_shapes;
  std::vector<int> out_buffer;       ///< arena buffer of each result, -1: allocated per run
  std::vector<int> release;          ///< values dead after this step
  std::string fn_name;
  ElemFn fn = nullptr;
  int64_t rows = 0, cols = 0;
  bool const_weights = false;        ///< operand 1 is a constant of the plan
  mutable StepCache cache;           ///< kept across runs (a plan runs under its executable's lock)
};

/// Memory that a plan reuses across runs, so steps neither allocate nor zero their results.
struct Arena {
  std::vector<std::shared_ptr<std::byte[]>> buffers;
  std::vector<size_t> sizes;
};

/// One compiled specialization of the graph, for one set of input shapes.
struct Plan {
  std::vector<Step> steps;
  std::unique_ptr<JitModule> jit;
  std::map<int, Tensor> constants;  ///< value id -> folded constant
  int num_values = 0;
  std::vector<int> outputs;
  std::vector<bool> output_in_arena;  ///< per output: copied out of the arena after a run
  Arena arena;
};

/// Ops the native kernels cover (see cpu.h); anything else without a JIT lowering runs
/// through its reference kernel.
bool has_native(const std::string& op) {
  static const char* const kOps[] = {"matmul", "matmul_acc", "linear", "conv", "max_pool", "avg_pool",
                                     "softmax", "log_softmax", "layer_norm", "rms_norm",
                                     "reduce_sum", "reduce_mean", "reduce_max", "reduce_min",
                                     "reduce_prod", "transpose", "slice", "expand", "concat",
                                     "split", "gather", "attention", "scaled_matmul", "quantize",
                                     "requantize"};
  for (const char* o : kOps)
    if (op == o) return true;
  return false;
}

/// Ops whose result is their operand's bytes under a new shape: the step shares the buffer.
bool is_alias(const Node& n) {
  const std::string& op = n.op_name();
  return (op == "reshape" || op == "flatten" || op == "squeeze" || op == "unsqueeze" ||
          op == "identity") && n.num_results() == 1 && n.num_operands() >= 1;
}

/// The backend's options, as an executable keeps them.
struct CpuSettings {
  int threads = 1;       ///< worker threads (resolved: never 0)
  bool winograd = true;  ///< 3x3 stride-1 convs by Winograd F(2x2, 3x3)
  bool profile = false;  ///< per-plan and per-op reports on stderr
};

class CpuExecutable final : public Executable {
 public:
  CpuExecutable(std::unique_ptr<Graph> g, const CpuSettings& s)
      : graph_(std::move(g)), settings_(s), pool_(s.threads) {}

  StatusOr<std::map<std::string, Tensor>> read_state() override {
    std::lock_guard<std::mutex> lock(mu_);
    return interp_.state_of(*graph_);
  }
  Status write_state(const std::map<std::string, Tensor>& values) override {
    std::lock_guard<std::mutex> lock(mu_);
    return interp_.set_state(*graph_, values);
  }

  StatusOr<std::vector<Tensor>> run(std::span<const Tensor> inputs) override {
    if (static_cast<int>(inputs.size()) != graph_->num_inputs())
      return invalid_argument("cpu: the graph takes " + std::to_string(graph_->num_inputs()) +
                              " inputs, got " + std::to_string(inputs.size()));
    std::string sig;
    for (int i = 0; i < graph_->num_inputs(); ++i) {
      const TensorType want = graph_->input(i)->type();
      const Tensor& t = inputs[static_cast<size_t>(i)];
      if (t.dtype() != want.dtype || t.rank() != want.rank())
        return invalid_argument("cpu: input " + std::to_string(i) + " must be " + want.str() +
                                ", got " + t.type().str());
      sig += t.type().str() + ";";
    }
    std::lock_guard<std::mutex> lk(mu_);
    auto it = plans_.find(sig);
    if (it == plans_.end()) {
      KILN_ASSIGN_OR_RETURN(std::unique_ptr<Plan> p, build(inputs));
      it = plans_.emplace(sig, std::move(p)).first;
    }
    return execute(*it->second, inputs);
  }

  /// For tests: how many steps of the last plan built run compiled code, and whether its
  /// object code came from the kernel cache.
  const Plan* last_plan() const { return last_; }

 private:
  /// State of one plan while it is built.
  struct Builder {
    Plan& plan;
    std::unordered_map<const Value*, int> id;
    std::vector<TensorType> types;
    std::vector<int> root;  ///< value id -> the value owning its bytes (itself unless aliased)
    Interpreter interp;
    int group = 0;
    void add_value(const Value* v, TensorType t) {
      id[v] = static_cast<int>(types.size());
      root.push_back(static_cast<int>(types.size()));
      types.push_back(std::move(t));
    }
  };
  StatusOr<std::unique_ptr<Plan>> build(std::span<const Tensor> inputs);
  Status plan_nodes(Builder& b, const Graph& g);
  static void plan_memory(Plan& p, const std::vector<TensorType>& types, const std::vector<int>& root);
  StatusOr<std::vector<Tensor>> execute(const Plan& p, std::span<const Tensor> inputs);
  Status run_native(const Step& s, std::vector<Tensor>& in, std::vector<Tensor>& out, bool& done);

  std::unique_ptr<Graph> graph_;
  CpuSettings settings_;
  ThreadPool pool_;
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<Plan>> plans_;
  const Plan* last_ = nullptr;
  Interpreter interp_;  ///< variable/assign state, kept across runs (guarded by mu_)
};

StatusOr<std::unique_ptr<Plan>> CpuExecutable::build(std::span<const Tensor> inputs) {
  auto plan = std::make_unique<Plan>();
  plan->jit = std::make_unique<JitModule>();
  Builder b{*plan, {}, {}, {}, {}, 0};
  for (int i = 0; i < graph_->num_inputs(); ++i)
    b.add_value(graph_->input(i), inputs[static_cast<size_t>(i)].type());
  KILN_RETURN_IF_ERROR(plan_nodes(b, *graph_));
  for (const Value* v : graph_->outputs()) plan->outputs.push_back(b.id.at(v));
  plan->num_values = static_cast<int>(b.types.size());
  plan_memory(*plan, b.types, b.root);

  KILN_RETURN_IF_ERROR(plan->jit->finish());
  for (Step& s : plan->steps)
    if (s.kind == StepKind::kJit) s.fn = plan->jit->lookup(s.fn_name);
  if (settings_.profile) {
    size_t bytes = 0;
    for (size_t sz : plan->arena.sizes) bytes += sz;
    std::fprintf(stderr, "kiln cpu: plan of %zu steps, %d compiled kernels, object code %s, %d threads, "
                 "BLAS %s, arena %zu buffers / %.1f MiB\n",
                 plan->steps.size(), plan->jit->num_functions(),
                 plan->jit->num_functions() == 0 ? "not needed"
                 : plan->jit->cache_hit()        ? "from the kernel cache"
                                                 : "compiled",
                 pool_.threads(), blas_description().c_str(), plan->arena.buffers.size(),
                 static_cast<double>(bytes) / (1 << 20));
  }
  last_ = plan.get();
  return plan;
}

Status CpuExecutable::plan_nodes(Builder& b, const Graph& g) {
  Plan& plan = b.plan;
  for (const auto& up : g.nodes()) {
    const Node& n = *up;
    Step s;
    s.node = &n;
    std::vector<TensorType> operand_types;
    for (const Value* v : n.operands()) {
      s.in.push_back(b.id.at(v));
      operand_types.push_back(b.types[static_cast<size_t>(b.id.at(v))]);
    }
    StatusOr<std::vector<TensorType>> inferred = infer_node_types(n, operand_types);
    if (!inferred.ok()) return inferred.status().with_context("cpu");
    const std::vector<TensorType>& rt = *inferred;
    for (const TensorType& t : rt) {
      if (!is_static(t.shape))
        return invalid_argument("cpu: a result of '" + n.op_name() +
                                "' has a shape unknown before running it: " + t.str());
      s.out_dtypes.push_back(t.dtype);
      s.out_shapes.push_back(static_sizes(t.shape));
    }
    // Constants are evaluated once, here.
    if (n.op_name() == "constant") {
      std::vector<Tensor> out;
      out.emplace_back(s.out_dtypes[0], s.out_shapes[0]);
      KernelContext ctx{n, {}, out, b.interp};
      KILN_RETURN_IF_ERROR(n.op()->reference(ctx).with_context("cpu"));
      b.add_value(n.result(0), rt[0]);
      plan.constants[b.id.at(n.result(0))] = out[0];
      continue;
    }
    const bool fused = n.op_name() == "fused" && n.num_regions() == 1;
    const bool elementwise = fused || (n.op()->has(kTraitElementwise) && n.num_regions() == 0);
    bool same_shape = true;
    for (const Sizes& o : s.out_shapes) same_shape = same_shape && o == s.out_shapes[0];
    std::string why = "not elementwise";
    if (elementwise && same_shape && n.num_results() >= 1) {
      ElemGroup grp;
      grp.name = "k" + std::to_string(b.group++);
      if (fused) grp.body = &n.region(0);
      else grp.node = &n;
      for (int v : s.in) {
        grp.in_dtypes.push_back(b.types[static_cast<size_t>(v)].dtype);
        grp.in_shapes.push_back(static_sizes(b.types[static_cast<size_t>(v)].shape));
      }
      grp.out_dtypes = s.out_dtypes;
      grp.out_shape = s.out_shapes[0];
      grp.threads = pool_.threads();
      if (plan.jit->add_group(grp, &why)) {
        s.kind = StepKind::kJit;
        s.fn_name = grp.name;
        s.rows = grp.rows;
        s.cols = grp.cols;
      }
    }
    if (s.kind != StepKind::kJit && fused) {
      // A group the JIT cannot take whole (a reduction or softmax inside, from fuse-rows and
      // the like) runs its body node by node, each on its native kernel where it has one.
      const Graph& body = n.region(0);
      if (body.num_inputs() != n.num_operands() || body.num_outputs() != n.num_results())
        return invalid_argument("cpu: 'fused' body does not match the node's operands and results");
      for (int i = 0; i < body.num_inputs(); ++i) b.id[body.input(i)] = s.in[static_cast<size_t>(i)];
      KILN_RETURN_IF_ERROR(plan_nodes(b, body));
      for (int i = 0; i < n.num_results(); ++i) b.id[n.result(i)] = b.id.at(body.outputs()[static_cast<size_t>(i)]);
      continue;
    }
    if (s.kind != StepKind::kJit) {
      if (is_alias(n) && s.out_dtypes[0] == operand_types[0].dtype) s.kind = StepKind::kAlias;
      else if (has_native(n.op_name())) s.kind = StepKind::kNative;
      else if (settings_.profile)
        std::fprintf(stderr, "kiln cpu: '%s' runs on its reference kernel: %s\n", n.op_name().c_str(),
                     why.c_str());
    }
    for (int i = 0; i < n.num_results(); ++i) {
      b.add_value(n.result(i), rt[static_cast<size_t>(i)]);
      s.out.push_back(b.id.at(n.result(i)));
    }
    if (s.kind == StepKind::kAlias) b.root[static_cast<size_t>(s.out[0])] = b.root[static_cast<size_t>(s.in[0])];
    s.const_weights = s.in.size() > 1 && plan.constants.count(s.in[1]) > 0;
    plan.steps.push_back(std::move(s));
  }
  return ok_status();
}

void CpuExecutable::plan_memory(Plan& p, const std::vector<TensorType>& types, const std::vector<int>& root) {
  // Liveness: each value is released after its last use (graph outputs never are); a buffer
  // is free again once every value sharing it (aliases) is dead.
  const size_t nv = types.size();
  std::vector<int> last(nv, -1), root_last(nv, -1);
  for (size_t i = 0; i < p.steps.size(); ++i) {
    for (int v : p.steps[i].in) last[static_cast<size_t>(v)] = static_cast<int>(i);
    for (int v : p.steps[i].out) last[static_cast<size_t>(v)] = std::max(last[static_cast<size_t>(v)], static_cast<int>(i));
  }
  for (int v : p.outputs) last[static_cast<size_t>(v)] = -1;
  for (size_t v = 0; v < nv; ++v)
    if (last[v] >= 0) p.steps[static_cast<size_t>(last[v])].release.push_back(static_cast<int>(v));
  const int kForever = static_cast<int>(p.steps.size());
  for (size_t v = 0; v < nv; ++v) {
    int& rl = root_last[static_cast<size_t>(root[v])];
    rl = std::max(rl, last[v] < 0 ? kForever : last[v]);
  }
  for (int v : p.outputs) root_last[static_cast<size_t>(root[static_cast<size_t>(v)])] = kForever;
  // Results of compiled and native steps take arena buffers, greedily best-fit.
  std::vector<int> buffer_of(nv, -1), free_list;
  std::vector<std::vector<int>> frees(p.steps.size());
  for (size_t i = 0; i < p.steps.size(); ++i) {
    Step& s = p.steps[i];
    s.out_buffer.assign(s.out.size(), -1);
    const bool arena = s.kind == StepKind::kJit || s.kind == StepKind::kNative;
    for (size_t j = 0; arena && j < s.out.size(); ++j) {
      const size_t v = static_cast<size_t>(s.out[j]);
      int64_t numel = 1;
      for (int64_t d : static_sizes(types[v].shape)) numel *= d;
      const size_t need = std::max<size_t>(64, static_cast<size_t>(dtype_storage_bytes(types[v].dtype, numel)));
      // Best fit: the smallest free buffer that holds it, else the largest one, grown.
      int best = -1;
      auto size_of = [&](int f) { return p.arena.sizes[static_cast<size_t>(free_list[static_cast<size_t>(f)])]; };
      for (int f = 0; f < static_cast<int>(free_list.size()); ++f) {
        if (best < 0) best = f;
        else if (size_of(f) >= need) best = size_of(best) < need || size_of(f) < size_of(best) ? f : best;
        else if (size_of(best) < need && size_of(f) > size_of(best)) best = f;
      }
      int buf;
      if (best >= 0) {
        buf = free_list[static_cast<size_t>(best)];
        free_list.erase(free_list.begin() + best);
        p.arena.sizes[static_cast<size_t>(buf)] = std::max(p.arena.sizes[static_cast<size_t>(buf)], need);
      } else {
        buf = static_cast<int>(p.arena.sizes.size());
        p.arena.sizes.push_back(need);
      }
      buffer_of[v] = buf;
      s.out_buffer[j] = buf;
      const int rl = root_last[v];
      if (rl < kForever) frees[static_cast<size_t>(rl)].push_back(buf);
    }
    for (int buf : frees[i]) free_list.push_back(buf);
  }
  for (size_t sz : p.arena.sizes) {
    // 64-byte aligned and never zeroed: every kernel writes all of its results.
    auto* mem = static_cast<std::byte*>(std::aligned_alloc(64, (sz + 63) / 64 * 64));
    p.arena.buffers.emplace_back(mem, [](std::byte* q) { std::free(q); });
  }
  for (int v : p.outputs) p.output_in_arena.push_back(buffer_of[static_cast<size_t>(root[static_cast<size_t>(v)])] >= 0);
}

Status CpuExecutable::run_native(const Step& s, std::vector<Tensor>& in, std::vector<Tensor>& out,
                                 bool& done) {
  const Node& n = *s.node;
  const std::string& o = n.op_name();
  const Tensor* bias = in.size() > 2 ? &in[2] : nullptr;
  if (o == "matmul") done = run_matmul(pool_, in[0], in[1], out[0]);
  else if (o == "matmul_acc") done = run_matmul_acc(pool_, in[0], in[1], in[2], out[0]);
  else if (o == "linear") done = run_linear(pool_, in[0], in[1], bias, out[0]);
  else if (o == "conv")
    done = run_conv(pool_, n, in[0], in[1], bias, out[0], s.const_weights ? &s.cache : nullptr,
                    settings_.winograd);
  else if (o == "max_pool" || o == "avg_pool") done = run_pool(pool_, n, in[0], out[0], o == "max_pool");
  else if (o == "softmax" || o == "log_softmax") done = run_softmax(pool_, n, in[0], out[0], o == "log_softmax");
  else if (o == "layer_norm" || o == "rms_norm") done = run_norm(pool_, n, in, out[0], o == "rms_norm");
  else if (o.rfind("reduce_", 0) == 0) done = run_reduce(pool_, n, in[0], out[0]);
  else if (o == "transpose") done = run_transpose(pool_, n, in[0], out[0]);
  else if (o == "slice") done = run_slice(pool_, n, in[0], out[0]);
  else if (o == "expand") done = run_expand(pool_, in[0], out[0]);
  else if (o == "concat") done = run_concat(pool_, n, in, out[0]);
  else if (o == "split") done = run_split(pool_, n, in[0], out);
  else if (o == "attention") done = run_attention(pool_, n, in, out[0]);
  else if (o == "scaled_matmul") done = run_scaled_matmul(pool_, in, out[0]);
  else if (o == "quantize") done = run_quantize(pool_, in[0], in[1], out[0]);
  else if (o == "requantize") done = run_requantize(pool_, in, out[0]);
  else if (o == "gather") {
    KILN_ASSIGN_OR_RETURN(done, run_gather(pool_, n, in[0], in[1], out[0]));
  }
  return ok_status();
}

StatusOr<std::vector<Tensor>> CpuExecutable::execute(const Plan& p, std::span<const Tensor> inputs) {
  std::vector<Tensor> vals(static_cast<size_t>(p.num_values));
  for (size_t i = 0; i < inputs.size(); ++i) vals[i] = inputs[i];
  for (const auto& [v, t] : p.constants) vals[static_cast<size_t>(v)] = t;
  // Reference kernels run on the executable's interpreter: it holds the variables' state.
  Interpreter& interp = interp_;
  interp.discard_assigns();
  std::vector<void*> bufs;
  std::vector<Tensor> in, out;
  std::map<std::string, double> prof;
  for (const Step& s : p.steps) {
    const auto t0 = std::chrono::steady_clock::now();
    in.clear();
    out.clear();
    for (int v : s.in) in.push_back(vals[static_cast<size_t>(v)]);
    for (size_t i = 0; i < s.out.size(); ++i) {
      if (s.out_buffer[i] >= 0) {
        const auto& buf = p.arena.buffers[static_cast<size_t>(s.out_buffer[i])];
        out.push_back(Tensor::wrap(s.out_dtypes[i], s.out_shapes[i], buf.get(), buf));
      } else if (s.kind != StepKind::kAlias) {
        out.emplace_back(s.out_dtypes[i], s.out_shapes[i]);
      }
    }
    bool done = false;
    if (s.kind == StepKind::kJit) {
      bufs.clear();
      for (const Tensor& t : in) bufs.push_back(const_cast<std::byte*>(t.data()));
      for (Tensor& t : out) bufs.push_back(out_bytes(t));
      if (s.rows > 0 && s.cols > 0) {
        const ElemFn fn = s.fn;
        pool_.parallel_for(s.rows, std::max<int64_t>(1, 32768 / s.cols),
                           [&](int64_t rb, int64_t re) { fn(bufs.data(), rb, re); });
      }
      done = true;
    } else if (s.kind == StepKind::kAlias) {
      out.push_back(in[0].reshaped(s.out_shapes[0]));
      done = true;
    } else if (s.kind == StepKind::kNative) {
      KILN_RETURN_IF_ERROR(run_native(s, in, out, done));
    }
    if (!done) {
      // Reference kernels expect fresh zeroed results, not the arena's reused bytes.
      for (size_t i = 0; i < out.size(); ++i)
        if (s.out_buffer[i] >= 0) out[i] = Tensor(s.out_dtypes[i], s.out_shapes[i]);
      KernelContext ctx{*s.node, in, out, interp};
      KILN_RETURN_IF_ERROR(s.node->op()->reference(ctx).with_context("cpu"));
    }
    for (size_t i = 0; i < s.out.size(); ++i) vals[static_cast<size_t>(s.out[i])] = std::move(out[i]);
    for (int v : s.release) vals[static_cast<size_t>(v)] = Tensor();
    if (settings_.profile)
      prof[s.node->op_name() + (s.kind == StepKind::kJit     ? "[jit]"
                                : s.kind == StepKind::kAlias ? "[alias]"
                                : done                       ? "[native]"
                                                             : "[ref]")] +=
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  for (const auto& [k, ms] : prof) std::fprintf(stderr, "kiln cpu: %-24s %9.3f ms\n", k.c_str(), ms);
  interp.commit_assigns();  // every step ran: this run's assigns take effect for the next
  std::vector<Tensor> outs;
  for (size_t i = 0; i < p.outputs.size(); ++i) {
    const Tensor& t = vals[static_cast<size_t>(p.outputs[i])];
    if (!p.output_in_arena[i]) {
      outs.push_back(t);
      continue;
    }
    // The arena is rewritten by the next run: results leave it as copies.
    Tensor c(t.dtype(), t.shape());
    if (t.nbytes()) std::memcpy(c.mutable_data(), t.data(), t.nbytes());
    outs.push_back(std::move(c));
  }
  return outs;
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuSettings& s) : settings_(s) {}
  StatusOr<std::unique_ptr<Executable>> compile(const Graph& g) override {
    KILN_RETURN_IF_ERROR(verify(g).with_context("cpu"));
    return std::unique_ptr<Executable>(std::make_unique<CpuExecutable>(g.clone(), settings_));
  }

 private:
  CpuSettings settings_;
};

Status register_cpu_backend(Registry& r) {
  BackendInfo info;
  info.name = "cpu";
  info.version = "0.1.0";
  info.summary = "compiles graphs for the host CPU with LLVM (ORC JIT) and OpenBLAS";
  info.targets = {"cpu"};
  info.options = {
      {"threads", OptionType::kInt, int64_t{0},
       "worker threads (0: the pipeline's [runtime] threads, else one per hardware thread); more "
       "threads change how the compiled loops split their rows"},
      {"winograd", OptionType::kBool, true,
       "3x3 stride-1 convolutions with 16+ channels and 196+ pixels by Winograd F(2x2, 3x3), "
       "2.25x fewer multiply-adds than im2col; false computes them by im2col like the other "
       "convolutions (other rounding; to compare the two on a given CPU)"},
      {"profile", OptionType::kBool, false,
       "print each plan's summary, the ops left to reference kernels and per-op times of every run "
       "to stderr"}};
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Backend>> {
    const int64_t threads = o.has("threads") ? o.get_int("threads") : 0;
    if (threads < 0 || threads > 4096)
      return invalid_argument("cpu: option 'threads' must be 0..4096, got " +
                              std::to_string(threads));
    CpuSettings s;
    s.threads = threads > 0 ? static_cast<int>(threads)
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    s.winograd = !o.has("winograd") || o.get_bool("winograd");
    s.profile = o.has("profile") && o.get_bool("profile");
    return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(s));
  };
  return r.add_backend(std::move(info));
}

}  // namespace
}  // namespace kiln::cpu

KILN_PLUGIN("kiln-backend-cpu", "0.1.0", kiln::cpu::register_cpu_backend)
