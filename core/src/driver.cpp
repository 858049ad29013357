// The compile driver: plugins, pipeline defaults, import, passes, compile and run, inputs.
#include "kiln/core/driver.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>
#include <unordered_map>

#include "kiln/core/loader.h"
#include "kiln/ir/mesh_run.h"
#include "kiln/ir/verifier.h"

namespace kiln {

namespace fs = std::filesystem;

Status load_plugins_from(const std::vector<std::string>& extra_dirs, Registry& reg,
                         bool use_default_dirs) {
  for (const auto& d : extra_dirs) {
    std::error_code ec;
    if (!fs::exists(d, ec)) return not_found("plugin path '" + d + "' does not exist");
  }
  std::vector<std::string> dirs = use_default_dirs ? default_plugin_dirs() : std::vector<std::string>{};
  dirs.insert(dirs.end(), extra_dirs.begin(), extra_dirs.end());
  return load_plugins(dirs, reg);
}

StatusOr<Pipeline> load_pipeline_with_plugins(const std::string& path, Registry& reg) {
  KILN_ASSIGN_OR_RETURN(std::vector<std::string> paths, read_pipeline_plugin_paths(path));
  for (const auto& d : paths) {
    std::error_code ec;
    if (!fs::exists(d, ec)) return not_found(path + ": plugin path '" + d + "' does not exist");
  }
  KILN_RETURN_IF_ERROR(load_plugins(paths, reg));
  return load_pipeline_file(path, reg);
}

Status resolve_pipeline_defaults(Pipeline& p, const Registry& reg, const std::string& model_path,
                                 bool need_backend) {
  if (p.frontend.name.empty()) {
    KILN_ASSIGN_OR_RETURN(const FrontendInfo* fe, reg.frontend_for_path(model_path));
    KILN_ASSIGN_OR_RETURN(p.frontend.options, resolve_options(fe->options, {}, "frontend '" + fe->name + "'"));
    p.frontend.name = fe->name;
  }
  if (need_backend && p.backend.name.empty()) {
    KILN_ASSIGN_OR_RETURN(const BackendInfo* be, reg.backend("reference"));
    KILN_ASSIGN_OR_RETURN(p.backend.options, resolve_options(be->options, {}, "backend 'reference'"));
    p.backend.name = be->name;
  }
  // [runtime] threads is the default of a backend's own int option `threads` (the cpu backend's)
  // where the backend leaves it at 0.
  if (p.runtime.threads > 0 && p.backend.options.has("threads") &&
      std::holds_alternative<int64_t>(p.backend.options.values().at("threads")) &&
      p.backend.options.get_int("threads") == 0)
    p.backend.options.set("threads", p.runtime.threads);
  return ok_status();
}

std::vector<StageSpec> default_compile_passes(const Registry& reg) {
  // Layout folding first, so fusion sees matmuls rather than transposes; attention before the
  // generic groups that would otherwise take its softmax; scheduling last, on the final nodes.
  static const char* const kOrder[] = {"canonicalize",    "cse",          "fold-layout",    "fuse-attention",
                                       "fuse-horizontal", "fuse-rows",    "fuse-pointwise", "dce",
                                       "schedule-memory"};
  std::vector<StageSpec> passes;
  for (const char* name : kOrder) {
    auto info = reg.pass(name);
    if (!info.ok()) continue;
    auto opts = resolve_options((*info)->options, {}, std::string("pass '") + name + "'");
    if (opts.ok()) passes.push_back({name, std::move(*opts), {}});
  }
  return passes;
}

void forward_symbols_to_frontend(StageSpec& frontend, const std::map<std::string, int64_t>& symbols,
                                 const Registry& reg) {
  if (symbols.empty()) return;
  auto fe = reg.frontend(frontend.name);
  if (!fe.ok()) return;
  bool declares_dims = false;
  for (const OptionSpec& o : (*fe)->options)
    declares_dims |= o.name == "dims" && o.type == OptionType::kStringList;
  if (!declares_dims) return;
  std::vector<std::string> dims;
  if (frontend.options.has("dims")) dims = frontend.options.get_strings("dims");
  for (const auto& [name, size] : symbols) {
    bool given = false;
    for (const std::string& d : dims) given |= d.rfind(name + "=", 0) == 0;
    if (!given) dims.push_back(name + "=" + std::to_string(size));
  }
  frontend.options.set("dims", dims);
}

StatusOr<std::unique_ptr<Graph>> import_model(const std::string& path, const StageSpec& frontend,
                                              const Registry& reg) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return not_found("model file '" + path + "' does not exist");
  if (!fs::is_regular_file(path, ec)) return invalid_argument("model '" + path + "' is not a regular file");
  KILN_ASSIGN_OR_RETURN(const FrontendInfo* fe, reg.frontend(frontend.name));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Graph> g, fe->import(path, frontend.options));
  if (!g) return internal_error("frontend '" + fe->name + "' returned no graph for '" + path + "'");
  Status v = verify(*g);
  if (!v.ok()) return v.with_context("frontend '" + fe->name + "' produced an invalid graph");
  return g;
}

Status run_pipeline_passes(Graph& g, const Pipeline& p, const Registry& reg,
                           const PassManagerOptions& opts, std::vector<PassTiming>* timings) {
  PassManager pm(reg, opts);
  Status s = pm.run(g, p.passes, p.canonical(reg));
  if (timings) *timings = pm.timings();
  return s;
}

Status prepare_pipeline(const PipelineRequest& r, Registry& reg, Pipeline& p) {
  if (!r.pipeline_file.empty()) {
    KILN_ASSIGN_OR_RETURN(p, load_pipeline_with_plugins(r.pipeline_file, reg));
  } else if (r.passes) {
    auto passes = parse_pass_list(*r.passes, reg);
    if (!passes.ok()) return passes.status().with_context("--passes");
    p.passes = std::move(*passes);
  }
  if (!r.frontend.empty() && r.frontend != p.frontend.name) {
    KILN_ASSIGN_OR_RETURN(const FrontendInfo* fe, reg.frontend(r.frontend));
    KILN_ASSIGN_OR_RETURN(p.frontend.options, resolve_options(fe->options, {}, "frontend '" + fe->name + "'"));
    p.frontend.name = fe->name;
  }
  if (!r.backend.empty() && r.backend != p.backend.name) {
    KILN_ASSIGN_OR_RETURN(const BackendInfo* be, reg.backend(r.backend));
    KILN_ASSIGN_OR_RETURN(p.backend.options, resolve_options(be->options, {}, "backend '" + be->name + "'"));
    p.backend.name = be->name;
    p.targets.clear();
  }
  KILN_RETURN_IF_ERROR(resolve_pipeline_defaults(p, reg, r.model, r.need_backend));
  forward_symbols_to_frontend(p.frontend, r.symbols, reg);
  return ok_status();
}

StatusOr<std::unique_ptr<Graph>> import_and_run_passes(const std::string& model, const Pipeline& p,
                                                       const Registry& reg, const PassManagerOptions& pm,
                                                       const std::function<Status(Graph&)>& before_passes) {
  std::fprintf(stderr, "pipeline: %s\n", p.canonical(reg).c_str());
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Graph> g, import_model(model, p.frontend, reg));
  if (before_passes) KILN_RETURN_IF_ERROR(before_passes(*g));
  KILN_RETURN_IF_ERROR(run_pipeline_passes(*g, p, reg, pm));
  return g;
}

StatusOr<std::unique_ptr<Executable>> compile_graph(const Graph& g, const StageSpec& backend, const Registry& reg) {
  KILN_ASSIGN_OR_RETURN(const BackendInfo* info, reg.backend(backend.name));
  const std::string who = "backend '" + info->name + "'";
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> be, info->create(backend.options));
  if (!be) return internal_error(who + " created nothing");
  auto exe = be->compile(g);
  if (!exe.ok()) return exe.status().with_context(who);
  if (!*exe) return internal_error(who + " compiled nothing");
  return std::move(*exe);
}

TensorType interface_type(const Graph& g, const Value* v) {
  if (!g.is_per_rank()) return v->type();
  return TensorType{v->dtype(), global_shape(v->shape(), v->sharding(), g.mesh())};
}

bool runs_stage(const Node& stage, const DeviceMesh& mesh, int64_t rank) {
  const std::string axis = stage.get_string("axis", "");
  if (axis.empty()) return stage.get_int("rank") == rank;
  const int a = mesh.axis_index(axis);
  return a >= 0 && mesh.coords(rank)[static_cast<size_t>(a)] == stage.get_int("rank");
}

StatusOr<std::unique_ptr<Graph>> program_of_rank(const Graph& g, int64_t rank) {
  std::unique_ptr<Graph> out = g.clone();
  std::vector<Node*> stages;
  for (Node* n : out->node_list())
    if (n->op_name() == "pipeline_stage") stages.push_back(n);
  for (Node* n : stages) {
    if (runs_stage(*n, out->mesh(), rank)) {  // inline the region in place of the node
      const Graph& body = n->region(0);
      std::unordered_map<const Value*, Value*> map;
      for (int i = 0; i < body.num_inputs(); ++i) map[body.input(i)] = n->operand(i);
      for (const auto& b : body.nodes()) {
        std::vector<Value*> operands;
        for (const Value* v : b->operands()) operands.push_back(map.at(v));
        std::vector<TensorType> types;
        std::vector<std::string> names;
        for (int i = 0; i < b->num_results(); ++i) types.push_back(b->result(i)->type()), names.push_back(b->result(i)->name());
        KILN_ASSIGN_OR_RETURN(Node * c, out->create_node(b->op_name(), operands, types, b->attrs(), n, names));
        c->set_loc(b->loc());
        for (int k = 0; k < b->num_regions(); ++k) c->add_region(b->region(k).clone());
        for (int i = 0; i < b->num_results(); ++i) map[b->result(i)] = c->result(i);
      }
      for (int i = 0; i < n->num_results(); ++i) {
        Value* v = map.at(body.output(i));
        v->set_sharding(n->result(i)->sharding());
        n->result(i)->replace_all_uses_with(v);
      }
    } else {  // another rank's stage: its results are zeros here (P(sum) terms)
      for (int i = 0; i < n->num_results(); ++i) {
        Value* r = n->result(i);
        const TensorType& t = r->type();
        KILN_ASSIGN_OR_RETURN(Node * zeros, out->create_node("constant", {}, {t}, {{"value", Attribute(Tensor(t.dtype, static_sizes(t.shape)))}},
                                                            n, {r->name()}));
        zeros->result()->set_sharding(r->sharding());
        r->replace_all_uses_with(zeros->result());
      }
    }
    KILN_RETURN_IF_ERROR(out->erase_node(n));
  }
  return out;
}

StatusOr<std::vector<Tensor>> compile_and_run(const Graph& g, const StageSpec& backend,
                                              const Registry& reg, std::span<const Tensor> inputs) {
  // The reference backend runs every rank of a mesh in this process; others run one rank per process.
  if (g.is_per_rank() && g.mesh().num_ranks() > 1 && backend.name != "reference")
    return unimplemented("graph '" + g.name() + "' is a per-rank program for a mesh of " +
                         std::to_string(g.mesh().num_ranks()) + " ranks " + g.mesh().str() +
                         ": in one process it runs on backend 'reference' (every rank simulated); on '" +
                         backend.name + "' start one process per rank (kiln launch -n " +
                         std::to_string(g.mesh().num_ranks()) + " -- kiln run ..., or torchrun/srun/mpirun)");
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Executable> exe, compile_graph(g, backend, reg));
  const std::string who = "backend '" + backend.name + "'";
  auto outs = exe->run(inputs);
  if (!outs.ok()) return outs.status().with_context(who);
  if (static_cast<int>(outs->size()) != g.num_outputs())
    return internal_error(who + " returned " + std::to_string(outs->size()) + " outputs, the graph has " +
                          std::to_string(g.num_outputs()));
  return outs;
}

std::string graph_input_name(const Graph& g, int i) {
  const std::string& n = g.input(i)->name();
  return n.empty() ? "input" + std::to_string(i) : n;
}

std::string graph_output_name(const Graph& g, int i) {
  const std::string& n = g.output_name(i);
  return n.empty() ? "output" + std::to_string(i) : n;
}

namespace {

/// splitmix64: tiny, fast, and the same sequence on every platform (unlike std distributions).
uint64_t next_random(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

Tensor random_tensor(DType dtype, const std::vector<int64_t>& shape, uint64_t seed) {
  Tensor t(dtype, shape);
  uint64_t state = seed;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const uint64_t r = next_random(state);
    if (is_float(dtype)) {
      t.set_f64(i, static_cast<double>(r >> 11) * 0x1.0p-52 - 1.0);  // 53 bits → [-1, 1)
    } else if (dtype == DType::kBool) {
      t.set_i64(i, static_cast<int64_t>(r >> 63));
    } else if (dtype == DType::kU8) {
      t.set_i64(i, static_cast<int64_t>(r >> 60));
    } else {
      t.set_i64(i, static_cast<int64_t>(r >> 60) - 8);
    }
  }
  return t;
}

StatusOr<std::vector<Tensor>> bind_inputs(const Graph& g, const InputBindings& b,
                                          std::vector<std::string>* notes) {
  std::set<std::string> names;
  for (int i = 0; i < g.num_inputs(); ++i) names.insert(graph_input_name(g, i));
  for (const auto& [name, t] : b.given) {
    if (names.count(name)) continue;
    std::string known;
    for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
    return not_found("graph '" + g.name() + "' has no input '" + name + "'; its inputs: " +
                     (known.empty() ? "(none)" : known));
  }

  // Symbols take their sizes from given tensors first, then from --sym, then default to 1.
  std::map<std::string, int64_t> sizes;
  std::map<std::string, std::string> bound_by;
  for (int i = 0; i < g.num_inputs(); ++i) {
    const std::string name = graph_input_name(g, i);
    auto it = b.given.find(name);
    if (it == b.given.end()) continue;
    const Tensor& t = it->second;
    const TensorType want = interface_type(g, g.input(i));
    const std::string mismatch = "input '" + name + "': got " + t.type().str() + ", expected " + want.str();
    if (t.dtype() != want.dtype || t.rank() != want.rank()) return invalid_argument(mismatch);
    for (int64_t d = 0; d < t.rank(); ++d) {
      const Dim& dim = want.shape[static_cast<size_t>(d)];
      const int64_t size = t.shape()[static_cast<size_t>(d)];
      if (dim.is_static()) {
        if (dim.value() != size) return invalid_argument(mismatch);
      } else if (!dim.is_unknown()) {
        auto [s, fresh] = sizes.emplace(dim.symbol_name(), size);
        if (!fresh && s->second != size)
          return invalid_argument(mismatch + " (symbol '" + dim.symbol_name() + "' is " +
                                  std::to_string(s->second) + " from input '" + bound_by[dim.symbol_name()] + "')");
        bound_by.emplace(dim.symbol_name(), name);
      }
    }
  }
  for (const auto& [sym, size] : b.symbols) {
    if (size < 0) return invalid_argument("symbol '" + sym + "' must be >= 0, got " + std::to_string(size));
    auto [s, fresh] = sizes.emplace(sym, size);
    if (!fresh && s->second != size)
      return invalid_argument("symbol '" + sym + "' given as " + std::to_string(size) + " but input '" +
                              bound_by[sym] + "' makes it " + std::to_string(s->second));
  }

  std::vector<Tensor> out;
  for (int i = 0; i < g.num_inputs(); ++i) {
    const std::string name = graph_input_name(g, i);
    auto it = b.given.find(name);
    if (it != b.given.end()) {
      out.push_back(it->second);
      continue;
    }
    const TensorType type = interface_type(g, g.input(i));
    if (!b.random)
      return invalid_argument("missing input '" + name + "' (" + type.str() +
                              "); give --input " + name + "=@FILE.npy or --random-inputs");
    std::vector<int64_t> shape;
    for (const Dim& d : type.shape) {
      if (d.is_static()) {
        shape.push_back(d.value());
        continue;
      }
      auto s = sizes.find(d.symbol_name());
      if (d.is_unknown() || s == sizes.end()) {
        if (!d.is_unknown()) sizes[d.symbol_name()] = 1;
        if (notes) notes->push_back("input '" + name + "': dimension '" + d.str() + "' set to 1 (use --sym to choose)");
        shape.push_back(1);
      } else {
        shape.push_back(s->second);
      }
    }
    // Each input gets its own stream, so adding an input does not change the others.
    out.push_back(random_tensor(type.dtype, shape, b.seed * 0x100000001b3ull + static_cast<uint64_t>(i)));
  }
  return out;
}

namespace {

std::string element_text(const Tensor& t, int64_t i) {
  if (t.dtype() == DType::kBool) return t.get_i64(i) ? "true" : "false";
  if (!is_float(t.dtype())) return std::to_string(t.get_i64(i));
  const double v = t.get_f64(i);
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*g", t.dtype() == DType::kF64 ? 10 : 6, v);
  return buf;
}

void format_dim(const Tensor& t, size_t dim, int64_t offset, const std::vector<int64_t>& strides,
                bool summarize, std::string& out) {
  const int64_t n = t.shape()[dim];
  out += '[';
  for (int64_t k = 0; k < n; ++k) {
    if (summarize && n > 6 && k == 3) {
      out += dim + 1 == t.shape().size() ? "..., " : "...,\n" + std::string(dim + 1, ' ');
      k = n - 3;
    }
    if (dim + 1 == t.shape().size()) out += element_text(t, offset + k);
    else format_dim(t, dim + 1, offset + k * strides[dim], strides, summarize, out);
    if (k + 1 < n) out += dim + 1 == t.shape().size() ? ", " : ",\n" + std::string(dim + 1, ' ');
  }
  out += ']';
}

}  // namespace

std::string format_tensor(const Tensor& t, int64_t max_elements) {
  if (t.rank() == 0) return element_text(t, 0);
  std::vector<int64_t> strides(t.shape().size(), 1);
  for (size_t d = t.shape().size() - 1; d > 0; --d) strides[d - 1] = strides[d] * t.shape()[d];
  std::string out;
  format_dim(t, 0, 0, strides, t.numel() > max_elements, out);
  return out;
}

}  // namespace kiln
