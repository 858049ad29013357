// CUDA lowering of persistent state and of amax (FP8 delayed scaling): a variable is a buffer
// in the weights section (device memory that lives as long as the loaded model, written by no
// one else), read in place; each assign is a copy into it at the very end of the plan, after
// every reader and after the output copies, which is the IR's "assigns apply after the run".
// An assign whose value an elementwise kernel computes from the variable's old value after its
// last other reader (an optimizer update) is written there in place instead, without a copy.
// FP8 delayed scaling's per-tensor updates (delayed_scaling_update) are one kernel for all
// tensors, in place, after those copies.
// Replaying a CUDA graph of the plan therefore advances the state on every replay.
#include <cmath>
#include <cstdio>

#include "lowerer.h"

namespace kiln::cuda::detail {

Status Lowerer::state_op(const Node& n) {
  const std::string& op = n.op_name();
  if (op == "amax") return amax(n);
  if (op == "delayed_scaling_update") return delayed_scaling_update(n);
  if (op == "delayed_scaling_step_scale") return delayed_scaling_step_scale(n);
  const std::string name = n.get_string("name");
  if (op == "assign") {
    assigns_.push_back({name, buf(n.operand(0)), &n});
    return ok_status();
  }
  // The plan names it on a `variable` line, for the runtime's kiln_model_read_variable.
  if (name.empty() || name.find_first_of(" \t\r\n=#") != std::string::npos)
    return unsupported(n, "variable name '" + name + "' cannot be written in a plan (empty, or a space, '=' or '#' in it)");
  // A weight buffer holding init, marked "state" until finish_state so that nothing folds it
  // or reads it at compile time (fold, weight_tensor); the plan calls it a weight.
  KILN_RETURN_IF_ERROR(weight(n.result(), n.attr("init")->as_tensor()));
  const int id = buf(n.result());
  bufs_[id].kind = "state";
  variables_[name] = id;
  if (!n.get_string("copy_of").empty()) copy_of_[name] = n.get_string("copy_of");
  return ok_status();
}

std::string Lowerer::amax_fold(const std::string& acc, const std::string& v) {
  return "{ const unsigned b_ = __float_as_uint(fabsf((float)" + v + ")); " + acc + " = b_ > " + acc + " ? b_ : " + acc +
         "; }";
}

std::string Lowerer::amax_combine(const std::string& acc, const std::string& out) {
  return "  " + acc + " = kiln_block_reduce(" + acc + ", 0u, [](unsigned a, unsigned b) { return a > b ? a : b; });\n" +
         "  if (threadIdx.x == 0 && " + acc + " != 0u) atomicMax(" + out + ", " + acc + ");\n";
}

Status Lowerer::amax(const Node& n) {
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  if (t == DType::kF8E4M3FN || t == DType::kF8E5M2) return unsupported_dtype(n, t);
  // A quantize of the same tensor whose scale is at hand (FP8 delayed scaling's, a weight's)
  // reduces this amax as it goes: fp8.cpp.
  if (const Node* q = standalone_partner(n, "quantize")) {
    absorbed_.insert(q);
    return quantize_with_amax(*q, n);
  }
  const int out = activation_for(n.result());
  const int64_t count = product(sizes_of(x));
  // |x| as f32 bits: non-negative floats order like their bit patterns, and every nan (its
  // sign cleared by fabsf) sorts above inf, so an integer max yields max |x|, or nan if any
  // element is nan, as the reference does. The result starts at +0.
  steps_.push_back({"step memset dst=b" + std::to_string(out) + " bytes=4", {out}});
  if (count == 0) return ok_status();
  const std::string body =
      "  unsigned m = 0u;\n"
      "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < " + int_literal(count) +
      "; i += (long long)gridDim.x * blockDim.x) {\n"
      "    " + amax_fold("m", load_expr(t, "x[i]")) + "\n  }\n" + amax_combine("m", "y");
  const std::string name = kernel_name("amax");
  add_kernel(name, "const " + st + "* __restrict__ x, unsigned* __restrict__ y", body);
  launch(name, std::min<int64_t>((count + kBlock - 1) / kBlock, 1024), {buf(x), out});
  return ok_status();
}

namespace {

/// The variable `v` is read from, when it is one (its name), else "".
std::string variable_name(const Value* v) {
  const Node* p = v->producer();
  return p != nullptr && p->op_name() == "variable" ? p->get_string("name") : "";
}

/// Whether `r`'s only use is an assign to variable `name`.
bool only_assigned_to(const Value* r, const std::string& name) {
  return !name.empty() && r->uses().size() == 1 && r->uses()[0].user != nullptr &&
         r->uses()[0].user->op_name() == "assign" && r->uses()[0].user->get_string("name") == name;
}

// One block per tensor. The roll goes from the last chunk of the history to the first, each
// chunk read whole before it is written, so that in place every old element is read before
// the chunk below overwrites it. The max is a nan-propagating one, as reduce_max's.
constexpr const char* kScaleUpdateDevice = R"(
__device__ __forceinline__ float kiln_nanmax(float a, float b) { return isnan(a) ? a : ((isnan(b) || b > a) ? b : a); }
__device__ __forceinline__ void kiln_delayed_scaling(const float* amax, const float* hin, float* hout, int h,
                                                     const float* sin, float* sout, float factor, bool use_max,
                                                     const unsigned char* due) {
  const float a = amax[0];
  float m = a;
  for (int base = ((h - 1) / (int)blockDim.x) * (int)blockDim.x; base >= 0; base -= (int)blockDim.x) {
    const int j = base + (int)threadIdx.x;
    const float v = j < h ? (j == 0 ? a : hin[j - 1]) : a;
    __syncthreads();
    if (j < h) hout[j] = v;
    m = kiln_nanmax(m, v);
  }
  m = kiln_block_reduce(m, a, [](float x, float y) { return kiln_nanmax(x, y); });
  if (threadIdx.x != 0) return;
  if (!use_max) m = a;
  const bool update = m > 0.0f && m <= 3.402823466e38f && (due == nullptr || due[0] != 0);
  sout[0] = update ? m * factor : sin[0];
}
// delayed_scaling_step_scale: the delayed scale once the history holds a positive amax (a nan
// in it counts as none), else the current amax's where it is finite and positive.
__device__ __forceinline__ float kiln_step_scale(const float* amax, const float* hist, int h, const float* scale,
                                                 float factor) {
  float seen = hist[0];
  for (int j = 1; j < h; ++j) seen = kiln_nanmax(seen, hist[j]);
  const float a = amax[0];
  return seen > 0.0f ? scale[0] : ((a > 0.0f && a <= 3.402823466e38f) ? a * factor : scale[0]);
}
)";

/// Where node `n` stands in its graph's node list.
size_t position(const Node& n) {
  size_t i = 0;
  for (const auto& m : n.graph()->nodes()) {
    if (m.get() == &n) return i;
    ++i;
  }
  return i;
}

}  // namespace

Status Lowerer::delayed_scaling_update(const Node& n) {
  ScaleUpdate u;
  u.amax = buf(n.operand(0));
  u.hist_in = buf(n.operand(1));
  u.scale_in = buf(n.operand(2));
  if (n.num_operands() == 4) u.due = buf(n.operand(3));
  u.history = product(sizes_of(n.operand(1)));
  if (u.history > (int64_t{1} << 30)) return unsupported(n, "history of " + std::to_string(u.history) + " elements");
  u.use_max = n.get_string("algorithm", "max") == "max";
  u.factor = delayed_scale_factor(n);
  const std::string hist = variable_name(n.operand(1)), scale = variable_name(n.operand(2));
  auto var = [&](const std::string& name, int id) {
    auto v = variables_.find(name);
    return v != variables_.end() && v->second == id;
  };
  if (only_assigned_to(n.result(0), hist) && only_assigned_to(n.result(1), scale) && hist != scale &&
      var(hist, u.hist_in) && var(scale, u.scale_in)) {
    // Each assign then copies a variable onto itself: finish_state skips it.
    val_[n.result(0)] = u.hist_out = u.hist_in;
    val_[n.result(1)] = u.scale_out = u.scale_in;
    scale_updates_.push_back(u);
    return ok_status();
  }
  u.hist_out = activation_for(n.result(0));
  u.scale_out = activation_for(n.result(1));
  scale_update_kernel({u});
  return ok_status();
}

void Lowerer::need_delayed_scaling() {
  if (delayed_scaling_device_) return;
  delayed_scaling_device_ = true;
  source_ += kScaleUpdateDevice;
}

float Lowerer::delayed_scale_factor(const Node& n) {
  const Attribute* f = n.attr("dtype");
  const DType format = f != nullptr ? f->as_dtype() : DType::kF8E4M3FN;
  return static_cast<float>(std::ldexp(1.0, static_cast<int>(n.get_int("margin", 0))) / f8_max_finite(format));
}

Status Lowerer::delayed_scaling_step_scale(const Node& n) {
  const int out = activation_for(n.result());
  const int64_t h = product(sizes_of(n.operand(1)));
  // Every block of the requantize reads the whole history: short ones only.
  const Node* requantize = nullptr;
  bool later = true;
  for (const Use& u : n.result()->uses())
    if (u.user != nullptr && u.user->op_name() == "requantize" && u.index == 3 && requantize == nullptr &&
        u.user->graph() == n.graph())
      requantize = u.user;
  if (requantize != nullptr && h <= 64) {
    const size_t at = position(*requantize);
    for (const Use& u : n.result()->uses())
      if (u.user != requantize && (u.user == nullptr || u.user->graph() != n.graph() || position(*u.user) <= at))
        later = false;
    if (later) {
      step_scales_in_requantize_.insert(&n);
      return ok_status();
    }
  }
  need_delayed_scaling();
  const std::string factor = literal(DType::kF32, delayed_scale_factor(n));
  const std::string name = kernel_name("step_scale");
  add_kernel(name, "const float* a, const float* h, const float* s, float* y",
             "  if (blockIdx.x == 0 && threadIdx.x == 0) y[0] = kiln_step_scale(a, h, " + std::to_string(h) + ", s, " +
                 factor + ");\n");
  launch(name, 1, {buf(n.operand(0)), buf(n.operand(1)), buf(n.operand(2)), out});
  return ok_status();
}

void Lowerer::scale_update_kernel(const std::vector<ScaleUpdate>& updates) {
  if (updates.empty()) return;
  need_delayed_scaling();
  std::string params, body = "  switch (blockIdx.x) {\n";
  std::vector<int> args;
  for (size_t i = 0; i < updates.size(); ++i) {
    const ScaleUpdate& u = updates[i];
    const std::string k = std::to_string(i);
    const bool in_place = u.hist_in == u.hist_out && u.scale_in == u.scale_out;
    params += std::string(i ? ", " : "") + "const float* a" + k + ", float* h" + k + ", float* s" + k;
    args.insert(args.end(), {u.amax, u.hist_out, u.scale_out});
    std::string hin = "h" + k, sin = "s" + k;
    if (!in_place) {
      params += ", const float* hi" + k + ", const float* si" + k;
      args.insert(args.end(), {u.hist_in, u.scale_in});
      hin = "hi" + k;
      sin = "si" + k;
    }
    std::string due = "nullptr";
    if (u.due >= 0) {
      params += ", const unsigned char* d" + k;
      args.push_back(u.due);
      due = "d" + k;
    }
    char factor[64];
    std::snprintf(factor, sizeof factor, "%af", static_cast<double>(u.factor));
    body += "    case " + k + ": kiln_delayed_scaling(a" + k + ", " + hin + ", h" + k + ", " + std::to_string(u.history) +
            ", " + sin + ", s" + k + ", " + factor + ", " + (u.use_max ? "true" : "false") + ", " + due +
            "); break;\n";
  }
  body += "  }\n";
  const std::string name = kernel_name("delayed_scaling");
  add_kernel(name, params, body);
  launch(name, static_cast<int64_t>(updates.size()), args);
}

std::set<const Node*> Lowerer::write_assigns_in_place() {
  // The first and last step that touches each root buffer.
  std::vector<int> first(bufs_.size(), -1), last(bufs_.size(), -1);
  for (size_t s = 0; s < steps_.size(); ++s)
    for (int b : steps_[s].buffers) {
      const int r = root(b);
      if (first[r] < 0) first[r] = static_cast<int>(s);
      last[r] = static_cast<int>(s);
    }
  // A variable another assign copies from must keep its old value to the end.
  std::set<int> copied_from;
  for (const Assign& a : assigns_) copied_from.insert(root(a.src));
  std::set<const Node*> placed;
  for (const Assign& a : assigns_) {
    auto v = variables_.find(a.name);
    if (v == variables_.end()) continue;
    const int dst = v->second, r = root(a.src);
    // An alias must come after its base in the plan (the runtime resolves them in order).
    if (r <= dst || bufs_[r].kind != "activation" || !whole_root(a.src) || copied_from.count(dst)) continue;
    if (bufs_[r].dtype != bufs_[dst].dtype || bufs_[r].bytes != bufs_[dst].bytes || bufs_[r].bytes == 0) continue;
    // The step that writes the new value first: no step after it may read the old one, and it
    // may itself read the old one only as an elementwise kernel reading, at each element it
    // writes, the old value the new one is computed from.
    const int w = first[r];
    if (w < 0 || last[dst] > w) continue;
    if (last[dst] == w) {
      auto e = elementwise_steps_.find(static_cast<size_t>(w));
      if (e == elementwise_steps_.end() || e->second.other_reads.count(dst) || !e->second.same_element.count({dst, r}))
        continue;
    }
    bufs_[r].kind = "alias";
    bufs_[r].base = dst;
    bufs_[r].offset = 0;
    for (Buffer& b : bufs_)
      if (b.kind == "alias" && b.base == r) b.base = dst;
    first[dst] = std::min(first[dst] < 0 ? w : first[dst], w);
    last[dst] = std::max(last[dst], last[r]);
    placed.insert(a.node);
  }
  return placed;
}

Status Lowerer::finish_state() {
  const std::set<const Node*> in_place = write_assigns_in_place();
  // A source that is (a view of) a variable's own buffer is read before any assign lands: it is
  // copied aside first, so assigns between variables see the values from before the run.
  std::vector<std::pair<int, int>> copies;  // (src, dst)
  for (const Assign& a : assigns_) {
    if (in_place.count(a.node)) continue;
    auto v = variables_.find(a.name);
    if (v == variables_.end()) return unsupported(*a.node, "no variable named '" + a.name + "' in this graph");
    const int dst = v->second;
    int src = a.src;
    if (src == dst) continue;  // assigning a variable its own value changes nothing
    if (bufs_[root(src)].kind == "state") {
      const int tmp = add_buffer("activation", bufs_[src].dtype, bufs_[src].shape);
      steps_.push_back({"step copy src=b" + std::to_string(src) + " dst=b" + std::to_string(tmp) + " bytes=" +
                            std::to_string(bufs_[tmp].bytes),
                        {src, tmp}});
      src = tmp;
    }
    if (bufs_[src].bytes != bufs_[dst].bytes)
      return unsupported(*a.node, "value of " + std::to_string(bufs_[src].bytes) + " bytes for variable '" + a.name +
                                      "' of " + std::to_string(bufs_[dst].bytes));
    copies.push_back({src, dst});
  }
  for (const auto& [src, dst] : copies)
    if (bufs_[dst].bytes > 0)
      steps_.push_back({"step copy src=b" + std::to_string(src) + " dst=b" + std::to_string(dst) + " bytes=" +
                            std::to_string(bufs_[dst].bytes),
                        {src, dst}});
  // Last: every other reader of the old histories and scales (and every copy aside) is done.
  // A block per tensor, at most 64 a launch (the kernel's parameters stay small).
  constexpr size_t kUpdatesPerLaunch = 64;
  for (size_t i = 0; i < scale_updates_.size(); i += kUpdatesPerLaunch)
    scale_update_kernel({scale_updates_.begin() + static_cast<std::ptrdiff_t>(i),
                         scale_updates_.begin() + static_cast<std::ptrdiff_t>(std::min(i + kUpdatesPerLaunch, scale_updates_.size()))});
  for (const auto& [name, id] : variables_) bufs_[id].kind = "weight";
  return ok_status();
}

}  // namespace kiln::cuda::detail
