// The automatic parallelism planner: candidate search, the per-rank cost model, the report.
#include "planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>
#include <toml++/toml.h>
#include <unordered_set>

#include "kiln/core/memory_estimate.h"
#include "kiln/ir/op.h"
#include "partition.h"
#include "pipeline.h"
#include "strategies.h"

namespace kiln::parallel {
namespace {

/// The inputs a data-parallel axis splits, decided on the symbolic graph the way
/// shard_batch_inputs decides (before binding makes every batch dim static).
std::vector<std::string> batch_inputs(const Graph& g, const PlannerOptions& o) {
  return batch_input_names(g, o.batch_dim, o.inputs);
}

// ---- cost model --------------------------------------------------------------------------------

double matmul_rate(DType t, const DeviceModel& d) {
  switch (t) {
    case DType::kBF16: return d.bf16_flops;
    case DType::kF16: return d.f16_flops;
    case DType::kF8E4M3FN:
    case DType::kF8E5M2:
    case DType::kI8:
    case DType::kU8: return d.fp8_flops;
    default: return d.f32_flops;
  }
}

double elements(const Value* v) { return static_cast<double>(num_elements(v->shape())); }

int64_t static_dim(const Value* v, int64_t d) {
  const int64_t r = v->type().rank();
  if (d < 0) d += r;
  return d >= 0 && d < r ? v->shape()[static_cast<size_t>(d)].value() : 1;
}

bool is_collective(const std::string& op) {
  return op == "all_reduce" || op == "all_gather" || op == "reduce_scatter" || op == "all_to_all" ||
         op == "broadcast" || op == "send" || op == "recv";
}

/// A ring algorithm over `p` ranks: all-reduce moves 2(p-1)/p of the buffer through each link in
/// 2(p-1) steps, all-gather / reduce-scatter / all-to-all (p-1)/p in p-1 steps.
double collective_seconds(const Node& n, const Graph& g, const DeviceModel& d) {
  const std::string& op = n.op_name();
  const double bw = d.link_bytes_per_s, lat = d.link_latency_s;
  if (op == "send" || op == "recv") {
    const Value* v = op == "send" ? n.operand(0) : n.result();
    return static_cast<double>(value_bytes(*v)) / bw + lat;
  }
  const int axis = g.mesh().axis_index(n.get_string("axis"));
  const double p = axis >= 0 ? static_cast<double>(g.mesh().axes[static_cast<size_t>(axis)].size) : 1;
  if (p <= 1) return 0;
  const double in = static_cast<double>(value_bytes(*n.operand(0)));
  const double out = static_cast<double>(value_bytes(*n.result()));
  if (op == "all_reduce") return 2 * (p - 1) / p * in / bw + 2 * (p - 1) * lat;
  if (op == "all_gather") return (p - 1) / p * out / bw + (p - 1) * lat;
  if (op == "reduce_scatter" || op == "all_to_all") return (p - 1) / p * in / bw + (p - 1) * lat;
  return in / bw + (p - 1) * lat;  // broadcast, pipelined along the ring
}

// ---- candidates ----------------------------------------------------------------------------------

/// Sizes (elements) of the weights tensor parallelism could split, smallest first.
std::vector<int64_t> weight_sizes(const Graph& g) {
  std::set<int64_t> sizes;
  for (const auto& n : g.nodes()) {
    const std::string& op = n->op_name();
    if ((op != "linear" && op != "matmul" && op != "conv") || n->num_operands() < 2) continue;
    const Value* w = n->operand(1);
    const bool weight = w->is_graph_input() || (w->producer() && w->producer()->op_name() == "constant");
    if (weight && w->type().rank() >= 2) sizes.insert(num_elements(w->shape()));
  }
  return {sizes.begin(), sizes.end()};
}

/// Thresholds worth trying: split every weight, or only those of at least the k-th size
/// (at most `most` of them, spread over the sizes).
std::vector<int64_t> thresholds(const std::vector<int64_t>& sizes, size_t most = 4) {
  std::vector<int64_t> t = {0};
  if (sizes.size() <= 1) return t;
  const size_t n = sizes.size() - 1;  // sizes[1..]: splitting from sizes[0] is the same as 0
  const size_t take = std::min(n, most);
  for (size_t i = 0; i < take; ++i) t.push_back(sizes[1 + (take == n ? i : i * n / take)]);
  t.erase(std::unique(t.begin(), t.end()), t.end());
  return t;
}

DeviceMesh mesh_of(const Candidate& c) {
  DeviceMesh m;
  if (c.pp > 1) {
    m.axes.push_back({"pp", c.pp});
    return m;
  }
  if (c.dp > 1 || c.tp == 1) m.axes.push_back({"dp", c.dp});
  if (c.tp > 1) m.axes.push_back({"tp", c.tp});
  return m;
}

std::string seconds_str(double s) {
  char buf[32];
  if (s >= 1) std::snprintf(buf, sizeof buf, "%.3g s", s);
  else if (s >= 1e-3) std::snprintf(buf, sizeof buf, "%.3g ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.3g us", s * 1e6);
  return buf;
}

std::string rate_str(double v, const char* unit) {
  char buf[48];
  if (v >= 1e12) std::snprintf(buf, sizeof buf, "%.3g T%s", v / 1e12, unit);
  else std::snprintf(buf, sizeof buf, "%.3g G%s", v / 1e9, unit);
  return buf;
}

bool better(const Candidate& a, const Candidate& b, Objective o) {
  const double ta = a.step_s(), tb = b.step_s();
  const auto ma = a.memory_bytes(), mb = b.memory_bytes();
  if (o == Objective::kMemory) {
    if (ma != mb) return ma < mb;
    return ta < tb;
  }
  // Step times within 0.1% are a tie: take the smaller footprint.
  if (std::abs(ta - tb) > 1e-3 * std::max(ta, tb)) return ta < tb;
  return ma < mb;
}

}  // namespace

double node_flops(const Node& n) {
  const std::string& op = n.op_name();
  if (n.num_regions() > 0) {
    double f = 0;
    for (int k = 0; k < n.num_regions(); ++k)
      for (const auto& m : n.region(k).nodes()) f += node_flops(*m);
    return f;
  }
  if (n.num_results() == 0) return 0;
  const double out = elements(n.result());
  if (op == "linear" || op == "matmul" || op == "matmul_int4" || op == "scaled_matmul")
    return 2 * out * static_cast<double>(static_dim(n.operand(0), -1));
  if (op == "conv") {
    const Value* w = n.operand(1);
    return 2 * out * elements(w) / static_cast<double>(std::max<int64_t>(static_dim(w, 0), 1));
  }
  if (op == "attention") {
    const Value *q = n.operand(0), *k = n.operand(1), *v = n.operand(2);
    const double sq = static_cast<double>(static_dim(q, 2)), skv = static_cast<double>(static_dim(k, 2));
    double f = 2 * static_cast<double>(static_dim(q, 0) * static_dim(q, 1)) * sq * skv *
               static_cast<double>(static_dim(q, 3) + static_dim(v, 3));
    if (n.get_int("causal") != 0 && sq == skv) f *= 0.5;  // half the score matrix is masked
    return f;
  }
  return out;
}


// ---- symbols ---------------------------------------------------------------------------------

void bind_symbol_sizes(Graph& g, const std::map<std::string, int64_t>& dims, int64_t fallback,
                  std::map<std::string, int64_t>& used, std::set<std::string>& defaulted) {
  auto bind = [&](Value* v) {
    TensorType t = v->type();
    bool changed = false;
    for (Dim& d : t.shape) {
      if (d.is_static()) continue;
      const auto it = dims.find(d.symbol_name());
      const int64_t size = it != dims.end() ? it->second : fallback;
      if (it == dims.end()) defaulted.insert(d.symbol_name());
      used[d.symbol_name()] = size;
      d = Dim(size);
      changed = true;
    }
    if (changed) v->set_type(std::move(t));
  };
  for (Value* v : g.inputs()) bind(v);
  for (const auto& n : g.nodes()) {
    for (int i = 0; i < n->num_results(); ++i) bind(n->result(i));
    for (int k = 0; k < n->num_regions(); ++k) bind_symbol_sizes(n->region(k), dims, fallback, used, defaulted);
  }
}

// ---- device models ---------------------------------------------------------------------------------

StatusOr<DeviceModel> device_preset(const std::string& name) {
  DeviceModel d;
  // NVLink 4 through NVSwitch: 450 GB/s a direction per GPU, of which NCCL's ring reaches about
  // 80%; a ring step costs about 1.5 us. Used until bench/parallel/probe.py measures a link.
  d.link_bytes_per_s = 360e9;
  d.link_latency_s = 1.5e-6;
  if (name == "h200") {
    // Measured on an H200 with PyTorch: bf16 GEMM 4096^3 803 TFLOP/s, fp8 8192^3 1330, device
    // copy 4.27 TB/s (read + write). fp32 without tensor cores: 67 TFLOP/s peak, 75% of it.
    d.name = "h200 preset";
    d.bf16_flops = d.f16_flops = 800e12;
    d.fp8_flops = 1330e12;
    d.f32_flops = 50e12;
    d.hbm_bytes_per_s = 4.27e12;
    return d;
  }
  if (name == "h100") {
    // Measured on an H100 80GB HBM3 by bench/parallel/probe.py (bench/results/2026-12-07-probe-h100.toml):
    // GEMMs 8192^3 bf16 794, f16 765, fp8 1430, f32 51 TFLOP/s; device copy 3.03 TB/s (read + write).
    d.name = "h100 preset";
    d.bf16_flops = 794e12;
    d.f16_flops = 765e12;
    d.fp8_flops = 1430e12;
    d.f32_flops = 51e12;
    d.hbm_bytes_per_s = 3.03e12;
    return d;
  }
  return invalid_argument("unknown device '" + name + "' (known: h200, h100)");
}

StatusOr<DeviceModel> load_probe(const std::string& path, DeviceModel base) {
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    std::ostringstream msg;
    msg << "probe '" << path << "': " << e.description() << " at line " << e.source().begin.line;
    return invalid_argument(msg.str());
  }
  auto number = [&](const char* section, const char* key, double& out) -> Status {
    const toml::node* n = t[section][key].node();
    if (!n) return ok_status();
    std::optional<double> v = n->value<double>();
    if (!v || !(*v > 0))
      return invalid_argument("probe '" + path + "': [" + section + "] " + key + " must be a positive number");
    out = *v;
    return ok_status();
  };
  KILN_RETURN_IF_ERROR(number("matmul", "bf16", base.bf16_flops));
  KILN_RETURN_IF_ERROR(number("matmul", "f16", base.f16_flops));
  KILN_RETURN_IF_ERROR(number("matmul", "f32", base.f32_flops));
  KILN_RETURN_IF_ERROR(number("matmul", "fp8", base.fp8_flops));
  KILN_RETURN_IF_ERROR(number("memory", "bandwidth", base.hbm_bytes_per_s));
  KILN_RETURN_IF_ERROR(number("link", "bandwidth", base.link_bytes_per_s));
  KILN_RETURN_IF_ERROR(number("link", "latency", base.link_latency_s));
  base.link_measured = t["link"]["measured"].value_or(false);
  const std::string device = t["device"]["name"].value_or(std::string());
  base.name = "probe " + path + (device.empty() ? "" : " (" + device + ")");
  return base;
}

// ---- costing -----------------------------------------------------------------------------------------

double node_seconds(const Node& n, const DeviceModel& d) {
  if (n.num_regions() > 0 && n.op_name() != "fused") {  // a pipeline stage: its body, node by node
    double s = 0;
    for (int k = 0; k < n.num_regions(); ++k)
      for (const auto& m : n.region(k).nodes()) s += node_seconds(*m, d);
    return s;
  }
  if (n.num_results() == 0 || is_view_op(n.op_name()) || n.op_name() == "constant") return 0;
  double bytes = 0;
  std::unordered_set<const Value*> seen;
  for (int i = 0; i < n.num_operands(); ++i) {
    const Value* v = n.operand(i);
    // An embedding lookup reads the rows it picks, not its whole table.
    if (n.op_name() == "gather" && i == 0) bytes += static_cast<double>(value_bytes(*n.result()));
    else if (seen.insert(v).second) bytes += static_cast<double>(value_bytes(*v));
  }
  for (int i = 0; i < n.num_results(); ++i) bytes += static_cast<double>(value_bytes(*n.result(i)));
  const DType dt = n.num_operands() > 0 ? n.operand(0)->dtype() : n.result()->dtype();
  const bool contraction = n.op() && n.op()->has(kTraitContraction);
  const double rate = contraction ? matmul_rate(dt, d) : d.f32_flops;
  return std::max(node_flops(n) / rate, bytes / d.hbm_bytes_per_s);
}

// ---- costing (whole programs) ---------------------------------------------------------------------------------------

StatusOr<ProgramCost> cost_program(const Graph& g, const DeviceModel& d) {
  ProgramCost c;
  const StorageMap storage(g);
  std::unordered_set<const Value*> weights;
  auto note_weight = [&](const Value* v) {
    if (storage.is_free(v)) weights.insert(storage.root_of(v));
  };
  for (const auto& np : g.nodes()) {
    const Node& n = *np;
    bool all_free = n.num_results() > 0;
    for (int i = 0; i < n.num_results(); ++i) all_free &= storage.is_free(n.result(i));
    if (all_free || is_view_op(n.op_name())) continue;  // weight preparation folds at compile time
    for (const Value* v : n.operands()) note_weight(v);
    if (is_collective(n.op_name())) {
      c.comm_s += collective_seconds(n, g, d);
      ++c.collectives[n.op_name()];
      continue;
    }
    c.flops += node_flops(n);
    c.compute_s += node_seconds(n, d);
  }
  for (const Value* v : g.outputs()) note_weight(v);
  c.splits_nothing = true;
  for (const Value* in : g.inputs())
    for (const Placement& pl : in->sharding()) c.splits_nothing &= !pl.is_shard();
  for (const auto& n : g.nodes()) c.splits_nothing &= n->op_name() != "local_shard";
  for (const Value* w : weights) c.weight_bytes += value_bytes(*w);
  c.activation_bytes = peak_activation_bytes(g);
  return c;
}

// ---- search ------------------------------------------------------------------------------------------

std::string Candidate::mesh() const {
  std::string s;
  for (const auto& a : mesh_of(*this).axes) s += (s.empty() ? "" : ", ") + a.name + "=" + std::to_string(a.size);
  return s;
}

std::string Candidate::strategy() const {
  if (pp > 1) return "pipeline{mesh=\"" + mesh() + "\"}";
  if (tp == 1) return "data-parallel{mesh=\"" + mesh() + "\"}";
  std::string s = "tensor-parallel{mesh=\"" + mesh() + "\"";
  if (dp > 1) s += ",data-axis=\"dp\"";
  if (sequence_parallel) s += ",sequence-parallel=true";
  if (min_size > 0) s += ",min-size=" + std::to_string(min_size);
  return s + "}";
}

PipelineConfig pipeline_config(const Candidate& c, const PlannerOptions& o, std::vector<std::string> inputs) {
  PipelineConfig cfg;
  cfg.mesh = mesh_of(c);
  cfg.batch_dim = o.batch_dim;
  cfg.inputs = std::move(inputs);
  cfg.dims = o.dims;
  cfg.device = o.device;
  return cfg;
}

Status apply_candidate(Graph& g, const Candidate& c, const PlannerOptions& o) {
  const std::vector<std::string> inputs = batch_inputs(g, o);
  if (c.pp > 1) return apply_pipeline(g, pipeline_config(c, o, inputs), "auto").status();
  if (c.tp == 1) {
    DataParallelConfig cfg;
    cfg.mesh = mesh_of(c);
    cfg.axis = "dp";
    cfg.batch_dim = o.batch_dim;
    cfg.inputs = inputs;
    return apply_data_parallel(g, cfg, "auto");
  }
  TensorParallelConfig cfg;
  cfg.mesh = mesh_of(c);
  cfg.axis = "tp";
  cfg.data_axis = c.dp > 1 ? "dp" : "";
  cfg.sequence_parallel = c.sequence_parallel;
  cfg.sequence_dim = o.sequence_dim;
  cfg.batch_dim = o.batch_dim;
  cfg.min_size = c.min_size;
  cfg.inputs = inputs;
  return apply_tensor_parallel(g, cfg, "auto");
}

StatusOr<Plan> make_plan(const Graph& global, const PlannerOptions& o) {
  if (o.devices < 1) return invalid_argument("auto: devices must be >= 1, got " + std::to_string(o.devices));
  if (global.is_per_rank()) return failed_precondition("auto: graph @" + global.name() + " is already a per-rank program");
  if (!global.mesh().empty())
    return invalid_argument("auto: graph @" + global.name() + " already has mesh " + global.mesh().str() +
                            "; the planner chooses the mesh");
  Plan plan;
  plan.options = o;
  std::set<std::string> defaulted;
  std::unique_ptr<Graph> bound = global.clone();
  bind_symbol_sizes(*bound, o.dims, kSymbolicDimEstimate, plan.symbols, defaulted);
  plan.defaulted.assign(defaulted.begin(), defaulted.end());
  // The batch inputs come from the symbolic graph; binding made every batch dim static.
  PlannerOptions bound_options = o;
  bound_options.inputs = batch_inputs(global, o);

  std::vector<Candidate> space;
  const std::vector<int64_t> cuts = thresholds(weight_sizes(*bound));
  for (int64_t dp = o.devices; dp >= 1; --dp) {
    if (o.devices % dp) continue;
    const int64_t tp = o.devices / dp;
    if (tp == 1) {
      Candidate c;
      c.dp = dp;
      space.push_back(c);
      continue;
    }
    for (bool sp : {false, true})
      for (int64_t cut : cuts) {
        Candidate c;
        c.dp = dp, c.tp = tp, c.sequence_parallel = sp, c.min_size = cut;
        space.push_back(c);
      }
  }

  if (o.devices > 1) {  // pipeline stages over every device
    Candidate c;
    c.pp = o.devices;
    space.push_back(c);
  }

  std::vector<Candidate> fits;
  std::set<std::string> programs;  // candidates that build the same program are one candidate
  const Candidate* smallest = nullptr;
  std::vector<Candidate> all;
  for (Candidate c : space) {
    std::unique_ptr<Graph> g = bound->clone();
    if (c.pp > 1) {  // costed from its stages: GPipe's (M + S - 1) slots of the slowest one
      auto split = apply_pipeline(*g, pipeline_config(c, bound_options, bound_options.inputs), "auto");
      if (!split.ok()) {
        plan.rejected.push_back(c.strategy() + ": " + split.status().message());
        continue;
      }
      const double slots = static_cast<double>(split->microbatches + split->stages - 1);
      size_t slowest = 0;
      for (size_t s = 0; s < split->stage_seconds.size(); ++s)
        if (split->stage_seconds[s] > split->stage_seconds[slowest]) slowest = s;
      c.comm_s = slots * split->stage_send_seconds[slowest];
      c.compute_s = slots * split->stage_seconds[slowest] - c.comm_s;
      c.flops = static_cast<double>(split->microbatches) * split->stage_flops[slowest];
      c.weight_bytes = *std::max_element(split->stage_weight_bytes.begin(), split->stage_weight_bytes.end());
      c.activation_bytes = split->activation_bytes;
      c.collectives["send"] = static_cast<int>((split->stages - 1) * split->microbatches);
      all.push_back(c);
      continue;
    }
    Status st = apply_candidate(*g, c, bound_options);
    if (!st.ok()) {
      plan.rejected.push_back(c.strategy() + ": " + st.message());
      continue;
    }
    auto cost = cost_program(*g, o.device);
    if (!cost.ok()) return cost.status();
    c.compute_s = cost->compute_s, c.comm_s = cost->comm_s, c.flops = cost->flops;
    c.weight_bytes = cost->weight_bytes, c.activation_bytes = cost->activation_bytes;
    c.collectives = cost->collectives;
    c.splits_nothing = cost->splits_nothing && o.devices > 1;
    std::ostringstream key;
    key << c.dp << "x" << c.tp << "x" << c.pp << " " << c.step_s() << " " << c.memory_bytes();
    for (const auto& [op, k] : c.collectives) key << " " << op << k;
    if (!programs.insert(key.str()).second) continue;
    all.push_back(c);
  }
  for (const Candidate& c : all) {
    if (!smallest || c.memory_bytes() < smallest->memory_bytes()) smallest = &c;
    if (o.memory_limit && c.memory_bytes() > *o.memory_limit) {
      ++plan.over_limit;
      continue;
    }
    fits.push_back(c);
  }
  if (all.empty()) {
    std::string why = "auto: no way to split @" + global.name() + " over " + std::to_string(o.devices) + " devices";
    for (size_t i = 0; i < plan.rejected.size() && i < 3; ++i) why += "\n  " + plan.rejected[i];
    return invalid_argument(why);
  }
  if (fits.empty())
    return invalid_argument("auto: no plan fits memory-limit " + format_bytes(static_cast<double>(*o.memory_limit)) +
                            " per rank; the smallest footprint found is " +
                            format_bytes(static_cast<double>(smallest->memory_bytes())) + " per rank (" +
                            smallest->strategy() + ")");
  std::stable_sort(fits.begin(), fits.end(), [&](const Candidate& a, const Candidate& b) { return better(a, b, o.objective); });
  plan.ranked = fits;
  plan.chosen = fits.front();
  return plan;
}

std::vector<OptionSpec> planner_option_specs() {
  return {
      {"devices", OptionType::kInt, int64_t{1}, "number of devices (ranks) to split over"},
      {"objective", OptionType::kString, std::string("throughput"), "\"throughput\" (step time) or \"memory\" (per rank)"},
      {"memory-limit", OptionType::kString, std::string(""), "most memory a rank may use, e.g. \"80GiB\" (default: none)"},
      {"device", OptionType::kString, std::string("h200"), "device preset for the cost model: h200 or h100"},
      {"probe", OptionType::kString, std::string(""), "TOML from bench/parallel/probe.py: measured rates replacing the preset's"},
      {"dims", OptionType::kStringList, std::vector<std::string>{}, "symbol sizes for costing, e.g. [\"B=8\", \"T=2048\"] (default 64)"},
      {"batch-dim", OptionType::kInt, int64_t{0}, "the inputs' batch dim, for a data-parallel axis"},
      {"sequence-dim", OptionType::kInt, int64_t{1}, "the activations' sequence dim, for sequence parallelism"},
      {"inputs", OptionType::kStringList, std::vector<std::string>{},
       "inputs a data-parallel axis splits (default: every input whose batch dim is symbolic, else those whose batch dim is the first input's)"},
      {"print-plan", OptionType::kBool, true, "print the plan (choice, predictions, runners-up) on stderr"},
  };
}

StatusOr<std::map<std::string, int64_t>> parse_dims_option(const std::vector<std::string>& entries, const std::string& who) {
  std::map<std::string, int64_t> dims;
  for (const std::string& d : entries) {
    const auto eq = d.find('=');
    int64_t size = 0;
    try {
      size = eq == std::string::npos ? 0 : std::stoll(d.substr(eq + 1));
    } catch (const std::exception&) {
    }
    if (eq == std::string::npos || eq == 0 || size < 1)
      return invalid_argument(who + ": dims entry '" + d + "': expected NAME=SIZE with SIZE >= 1");
    dims[d.substr(0, eq)] = size;
  }
  return dims;
}

/// Planner options from a [parallel] section's (or `kiln plan`'s) values.
StatusOr<PlannerOptions> planner_options(const Options& o) {
  PlannerOptions p;
  p.devices = o.get_int("devices");
  if (p.devices < 1) return invalid_argument("auto: devices must be >= 1, got " + std::to_string(p.devices));
  const std::string& objective = o.get_string("objective");
  if (objective == "memory") p.objective = Objective::kMemory;
  else if (objective != "throughput")
    return invalid_argument("auto: objective must be \"throughput\" or \"memory\", got \"" + objective + "\"");
  if (!o.get_string("memory-limit").empty()) {
    KILN_ASSIGN_OR_RETURN(int64_t limit, parse_bytes(o.get_string("memory-limit")));
    p.memory_limit = limit;
  }
  KILN_ASSIGN_OR_RETURN(p.device, device_preset(o.get_string("device")));
  if (!o.get_string("probe").empty()) {
    KILN_ASSIGN_OR_RETURN(p.device, load_probe(o.get_string("probe"), p.device));
  }
  KILN_ASSIGN_OR_RETURN(p.dims, parse_dims_option(o.get_strings("dims"), "auto"));
  p.batch_dim = o.get_int("batch-dim");
  p.sequence_dim = o.get_int("sequence-dim");
  if (p.batch_dim < 0 || p.sequence_dim < 0) return invalid_argument("auto: batch-dim and sequence-dim must be >= 0");
  p.inputs = o.get_strings("inputs");
  return p;
}


// ---- reporting ---------------------------------------------------------------------------------------

std::string format_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 || b >= 100 ? "%.0f %s" : "%.3g %s", b, units[u]);  // 1010 KiB, not 1.01e+03
  return buf;
}

StatusOr<int64_t> parse_bytes(const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    return invalid_argument("memory size '" + text + "': expected a number with an optional unit (GiB, GB, MiB, ...)");
  }
  std::string unit = text.substr(used);
  unit.erase(0, unit.find_first_not_of(' '));
  const std::map<std::string, double> scale = {{"", 1},      {"B", 1},       {"KB", 1e3},          {"MB", 1e6},
                                               {"GB", 1e9},  {"TB", 1e12},   {"KiB", 1024.0},      {"MiB", 1048576.0},
                                               {"GiB", 1073741824.0},        {"TiB", 1099511627776.0}};
  const auto it = scale.find(unit);
  if (it == scale.end() || !(v > 0))
    return invalid_argument("memory size '" + text + "': expected a positive number with an optional unit (GiB, GB, MiB, ...)");
  return static_cast<int64_t>(v * it->second);
}

std::string format_plan(const Plan& p, int runners_up) {
  const PlannerOptions& o = p.options;
  const DeviceModel& d = o.device;
  std::ostringstream out;
  out << "plan for " << o.devices << " device" << (o.devices == 1 ? "" : "s") << ", objective "
      << (o.objective == Objective::kMemory ? "memory" : "throughput");
  if (o.memory_limit) out << ", memory limit " << format_bytes(static_cast<double>(*o.memory_limit)) << " per rank";
  out << "\n  cost model: " << d.name << ": matmul bf16 " << rate_str(d.bf16_flops, "FLOP/s") << ", f32 "
      << rate_str(d.f32_flops, "FLOP/s") << ", HBM " << rate_str(d.hbm_bytes_per_s, "B/s") << ", link "
      << rate_str(d.link_bytes_per_s, "B/s") << " + " << seconds_str(d.link_latency_s) << " a ring step"
      << (d.link_measured ? " (measured)" : " (default, not measured)") << "\n";
  if (!p.symbols.empty()) {
    out << "  symbols:";
    for (const auto& [k, v] : p.symbols) out << " " << k << "=" << v;
    if (!p.defaulted.empty()) {
      out << " (not given, costed at " << kSymbolicDimEstimate << ":";
      for (const auto& s : p.defaulted) out << " " << s;
      out << ")";
    }
    out << "\n";
  }
  const Candidate& c = p.chosen;
  auto collectives = [](const Candidate& k) {
    std::string s;
    for (const auto& [op, n] : k.collectives) s += (s.empty() ? "" : ", ") + std::to_string(n) + " " + op;
    return s.empty() ? std::string("none") : s;
  };
  out << "chosen: mesh " << c.mesh() << ", " << c.strategy()
      << (c.splits_nothing ? " (splits nothing: every rank computes the whole model)" : "") << "\n"
      << "  predicted step time " << seconds_str(c.step_s()) << " (compute " << seconds_str(c.compute_s)
      << ", communication " << seconds_str(c.comm_s) << "; collectives: " << collectives(c) << ")\n"
      << "  predicted memory per rank " << format_bytes(static_cast<double>(c.memory_bytes())) << " (weights "
      << format_bytes(static_cast<double>(c.weight_bytes)) << ", activations "
      << format_bytes(static_cast<double>(c.activation_bytes)) << ")\n";
  out << "candidates, best first (" << p.ranked.size() << " fit";
  if (p.over_limit) out << ", " << p.over_limit << " over the memory limit";
  if (!p.rejected.empty()) out << ", " << p.rejected.size() << " refused by the partitioner";
  out << "):\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-3s %-12s %-12s %-12s %-12s %s\n", "#", "step", "comm", "memory/rank", "mesh", "strategy");
  out << line;
  for (size_t i = 0; i < p.ranked.size() && i < static_cast<size_t>(runners_up) + 1; ++i) {
    const Candidate& k = p.ranked[i];
    std::snprintf(line, sizeof line, "  %-3zu %-12s %-12s %-12s %-12s %s\n", i + 1, seconds_str(k.step_s()).c_str(),
                  seconds_str(k.comm_s).c_str(), format_bytes(static_cast<double>(k.memory_bytes())).c_str(),
                  k.mesh().c_str(), k.strategy().c_str());
    out << line;
  }
  return out.str();
}

std::string plan_json(const Plan& p) {
  auto quote = [](const std::string& s) {
    std::string q = "\"";
    for (char ch : s) {
      if (ch == '\n') {
        q += "\\n";
        continue;
      }
      if (ch == '"' || ch == '\\') q += '\\';
      q += ch;
    }
    return q + "\"";
  };
  auto candidate = [&](const Candidate& c) {
    std::ostringstream o;
    o.precision(9);
    o << "{\"mesh\": " << quote(c.mesh()) << ", \"dp\": " << c.dp << ", \"tp\": " << c.tp << ", \"pp\": " << c.pp
      << ", \"sequence_parallel\": " << (c.sequence_parallel ? "true" : "false") << ", \"min_size\": " << c.min_size
      << ", \"strategy\": " << quote(c.strategy()) << ", \"splits_nothing\": " << (c.splits_nothing ? "true" : "false") << ", \"step_s\": " << c.step_s() << ", \"compute_s\": " << c.compute_s
      << ", \"comm_s\": " << c.comm_s << ", \"flops\": " << c.flops << ", \"weight_bytes\": " << c.weight_bytes
      << ", \"activation_bytes\": " << c.activation_bytes << ", \"memory_bytes\": " << c.memory_bytes()
      << ", \"collectives\": {";
    bool first = true;
    for (const auto& [op, n] : c.collectives) {
      o << (first ? "" : ", ") << quote(op) << ": " << n;
      first = false;
    }
    o << "}}";
    return o.str();
  };
  std::ostringstream out;
  out << "{\"devices\": " << p.options.devices << ", \"objective\": "
      << quote(p.options.objective == Objective::kMemory ? "memory" : "throughput") << ", \"device\": "
      << quote(p.options.device.name) << ", \"link_measured\": " << (p.options.device.link_measured ? "true" : "false")
      << ", \"chosen\": " << candidate(p.chosen) << ", \"candidates\": [";
  for (size_t i = 0; i < p.ranked.size(); ++i) out << (i ? ", " : "") << candidate(p.ranked[i]);
  out << "], \"over_limit\": " << p.over_limit << ", \"rejected\": [";
  for (size_t i = 0; i < p.rejected.size(); ++i) out << (i ? ", " : "") << quote(p.rejected[i]);
  out << "]}\n";
  return out.str();
}

}  // namespace kiln::parallel
