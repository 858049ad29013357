// The `kiln._kiln` extension module: plugins, pipelines, compiling models (files or graphs built
// in Python) to artifacts or to in-process executables. The Python package `kiln` wraps it.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "kiln/artifact_reader.h"
#include "kiln/core/compile.h"
#include "kiln/core/driver.h"
#include "kiln/core/loader.h"
#include "kiln/ir/op.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"
#include "kiln/version.h"
#include "kiln_py.h"

namespace kiln::py {

namespace {

Registry& registry() { return Registry::global(); }

/// Plugin folders are loaded once, on first use, from the folders the package names.
bool g_plugins_loaded = false;
std::vector<std::string> g_plugin_dirs;

void ensure_plugins() {
  if (g_plugins_loaded) return;
  g_plugins_loaded = true;
  std::vector<std::string> existing;
  for (const auto& d : g_plugin_dirs) {
    std::error_code ec;
    if (std::filesystem::exists(d, ec)) existing.push_back(d);
  }
  check(load_plugins_from(existing, registry()));
}

nb::object option_to_python(const OptionValue& v) {
  return std::visit([](const auto& x) -> nb::object { return nb::cast(x); }, v);
}

nb::list plugins_list() {
  ensure_plugins();
  nb::list out;
  for (const RegistryRow& row : registry().rows()) {
    nb::dict d;
    d["name"] = row.entry->name;
    d["kind"] = plugin_kind_name(row.kind);
    d["version"] = row.entry->version;
    d["summary"] = row.entry->summary;
    d["library"] = row.entry->library;
    nb::list opts;
    for (const OptionSpec& o : row.entry->options) {
      nb::dict od;
      od["name"] = o.name;
      od["type"] = option_type_name(o.type);
      od["default"] = option_to_python(o.default_value);
      od["help"] = o.help;
      opts.append(od);
    }
    d["options"] = opts;
    if (row.kind == PluginKind::kBackend) d["targets"] = take(registry().backend(row.entry->name))->targets;
    out.append(d);
  }
  return out;
}

/// A pipeline, validated against the loaded plugins.
struct PyPipeline {
  Pipeline p;
  std::string canonical() const { return p.canonical(registry()); }
};

PyPipeline pipeline_from_toml(const std::string& path) {
  ensure_plugins();
  return {take(load_pipeline_with_plugins(path, registry()))};
}

/// The one-line form ("kir | cse,dce | reference"), a bare pass list, or TOML text (any text
/// with a line break).
PyPipeline pipeline_from_string(const std::string& text) {
  ensure_plugins();
  if (text.find('\n') != std::string::npos) return {take(parse_pipeline_toml(text, "<string>", registry()))};
  return {take(parse_pipeline_string(text, registry()))};
}

/// A graph built in Python or read from a file; values refer into it.
struct PyGraph {
  std::shared_ptr<Graph> g;
};

struct PyValue {
  std::shared_ptr<Graph> owner;
  Value* v = nullptr;
};

nb::list shape_to_python(const Shape& s) {
  nb::list out;
  for (const Dim& d : s) {
    if (d.is_static()) out.append(d.value());
    else out.append(d.symbol_name());
  }
  return out;
}

Shape shape_from_python(const std::vector<std::variant<int64_t, std::string>>& dims) {
  Shape s;
  for (const auto& d : dims) {
    if (std::holds_alternative<int64_t>(d)) {
      if (std::get<int64_t>(d) < 0) throw KilnError("a dimension must be >= 0, got " + std::to_string(std::get<int64_t>(d)));
      s.push_back(Dim(std::get<int64_t>(d)));
    } else {
      const std::string& name = std::get<std::string>(d);
      s.push_back(name == "?" ? Dim::unknown() : Dim::symbol(name));
    }
  }
  return s;
}

DType parse_dtype_or_throw(const std::string& name) {
  auto t = parse_dtype(name);
  if (!t) throw KilnError("unknown dtype '" + name + "' (f64 f32 f16 bf16 f8e4m3fn f8e5m2 i64 i32 i16 i8 u8 i4 bool)");
  return *t;
}

/// A Python attribute value as the op's schema wants it (strings become dtypes for dtype
/// attributes; ints become floats for float ones).
Attribute attribute_from_python(const OpDef& op, const std::string& name, nb::handle v) {
  const AttrSpec* spec = op.find_attr(name);
  if (!spec) throw KilnError("op '" + op.name + "' has no attribute '" + name + "'");
  Attribute a;
  if (nb::isinstance<nb::bool_>(v)) a = Attribute(nb::cast<bool>(v));
  else if (nb::isinstance<nb::int_>(v)) a = Attribute(nb::cast<int64_t>(v));
  else if (nb::isinstance<nb::float_>(v)) a = Attribute(nb::cast<double>(v));
  else if (nb::isinstance<nb::str>(v)) {
    const std::string s = nb::cast<std::string>(v);
    a = spec->kind == AttrKind::kDType ? Attribute(parse_dtype_or_throw(s)) : Attribute(s);
  } else if (nb::isinstance<nb::list>(v) || nb::isinstance<nb::tuple>(v)) {
    nb::list items = nb::list(v);
    if (spec->kind == AttrKind::kStrings) a = Attribute(nb::cast<std::vector<std::string>>(items));
    else if (spec->kind == AttrKind::kFloats) a = Attribute(nb::cast<std::vector<double>>(items));
    else a = Attribute(nb::cast<std::vector<int64_t>>(items));
  } else if (nb::ndarray_check(v)) {
    a = Attribute(tensor_from_array(nb::cast<nb::ndarray<nb::ro>>(v), "attribute '" + name + "'"));
  } else {
    throw KilnError("attribute '" + name + "' of op '" + op.name + "': unsupported Python type " +
                    nb::cast<std::string>(nb::str(v.type())));
  }
  if (a.kind() != spec->kind) {
    if (!a.convertible_to(spec->kind))
      throw KilnError("attribute '" + name + "' of op '" + op.name + "' is " + attr_kind_name(spec->kind) +
                      ", got " + attr_kind_name(a.kind()));
    a = a.converted_to(spec->kind);
  }
  return a;
}

std::vector<PyValue> add_node(PyGraph& pg, const std::string& op, const std::vector<PyValue>& operands,
                              const nb::dict& attrs, int num_results, const std::vector<std::string>& names) {
  const OpDef* def = OpRegistry::global().find(op);
  if (!def) {
    ensure_plugins();  // plugins may add ops
    def = OpRegistry::global().find(op);
  }
  if (!def) throw KilnError("unknown op '" + op + "'; `kiln ops` lists them");
  AttrMap map;
  for (auto [k, v] : attrs) {
    const std::string key = nb::cast<std::string>(k);
    map[key] = attribute_from_python(*def, key, v);
  }
  std::vector<Value*> ins;
  std::vector<TensorType> types;
  for (const PyValue& pv : operands) {
    if (pv.owner != pg.g) throw KilnError("op '" + op + "': an operand belongs to another graph");
    ins.push_back(pv.v);
    types.push_back(pv.v->type());
  }
  if (num_results < 1) throw KilnError("op '" + op + "': num_results must be at least 1");
  Node* n = take(pg.g->create_node(op, ins, std::vector<TensorType>(static_cast<size_t>(num_results)), std::move(map),
                                   nullptr, names));
  auto inferred = infer_node_types(*n, types);
  if (!inferred.ok()) {
    (void)pg.g->erase_node(n);
    throw KilnError(inferred.status().message());
  }
  std::vector<PyValue> out;
  for (int i = 0; i < n->num_results(); ++i) {
    n->result(i)->set_type((*inferred)[static_cast<size_t>(i)]);
    out.push_back({pg.g, n->result(i)});
  }
  return out;
}

/// Something compiled for this process (reference or cpu backend): the graph it was compiled
/// from, for the interface, and the executable.
struct CompiledModel {
  std::shared_ptr<const Graph> graph;
  std::shared_ptr<Executable> exe;
  std::string pipeline;
};

/// A .kiln artifact in memory.
struct PyArtifact {
  std::string bytes;
  std::shared_ptr<artifact::Artifact> parsed;
};

PyArtifact artifact_from_bytes(std::string bytes, const std::string& name) {
  std::string error;
  auto a = artifact::read_artifact(bytes, name, &error);
  if (!a) throw KilnError(error);
  return {std::move(bytes), std::shared_ptr<artifact::Artifact>(std::move(a))};
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw KilnError("cannot open '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nb::list interface(const Graph& g, bool inputs) {
  nb::list out;
  const int n = inputs ? g.num_inputs() : g.num_outputs();
  for (int i = 0; i < n; ++i) {
    const Value* v = inputs ? g.input(i) : g.output(i);
    const TensorType t = interface_type(g, v);
    nb::dict d;
    d["name"] = inputs ? graph_input_name(g, i) : graph_output_name(g, i);
    d["dtype"] = std::string(dtype_name(t.dtype));
    d["shape"] = shape_to_python(t.shape);
    out.append(d);
  }
  return out;
}

using ModelArg = std::variant<std::string, PyGraph>;
using CompileResult = std::variant<PyArtifact, CompiledModel>;

/// kiln.compile: reads or clones the model, runs the pipeline's passes, then builds an
/// artifact for the targets, or compiles in-process when the backend makes no artifacts.
CompileResult compile_model(const ModelArg& model, const std::optional<PyPipeline>& pipeline,
                            const std::vector<std::string>& targets, const std::map<std::string, int64_t>& symbols,
                            const std::optional<std::string>& passes, const std::optional<std::string>& backend,
                            bool verify_each) {
  ensure_plugins();
  Registry& reg = registry();
  Pipeline p;
  if (pipeline) p = pipeline->p;
  else if (passes) p.passes = take(parse_pass_list(*passes, reg));
  else p.passes = default_compile_passes(reg);
  if (pipeline && passes) throw KilnError("give a pipeline or passes, not both");
  if (backend && *backend != p.backend.name) {
    const BackendInfo* be = take(reg.backend(*backend));
    p.backend = {be->name, take(resolve_options(be->options, {}, "backend '" + be->name + "'")), {}};
    p.targets.clear();
  }
  if (!targets.empty()) p.targets = targets;

  std::unique_ptr<Graph> g;
  std::string model_name;
  if (const auto* path = std::get_if<std::string>(&model)) {
    check(resolve_pipeline_defaults(p, reg, *path, /*need_backend=*/false));
    forward_symbols_to_frontend(p.frontend, symbols, reg);
    nb::gil_scoped_release nogil;
    g = take(import_model(*path, p.frontend, reg));
    model_name = std::filesystem::path(*path).filename().string();
  } else {
    const PyGraph& pg = std::get<PyGraph>(model);
    check(verify(*pg.g));
    g = pg.g->clone();
    model_name = g->name();
    p.frontend.name = "python";
  }

  PassManagerOptions pm;
  pm.verify_each = verify_each;
  {
    nb::gil_scoped_release nogil;
    check(run_pipeline_passes(*g, p, reg, pm));
  }

  // Targets go to the backends listing them; a backend that makes no artifacts (reference,
  // cpu) compiles for this process instead.
  std::vector<TargetGroup> groups;
  if (!p.targets.empty()) groups = take(group_targets(p, reg, {}));
  // Symbols the front end bound at import (onnx's dims) need not appear in the graph any more.
  std::set<std::string> taken;
  if (p.frontend.options.has("dims"))
    for (const std::string& d : p.frontend.options.get_strings("dims")) taken.insert(d.substr(0, d.find('=')));
  const bool in_process = groups.empty() || (groups.size() == 1 && (groups[0].backend->name == "reference" ||
                                                                    groups[0].backend->name == "cpu"));
  if (in_process) {
    if (!groups.empty() && p.backend.name != groups[0].backend->name) {
      const BackendInfo* be = groups[0].backend;
      p.backend = {be->name, take(resolve_options(be->options, {}, "backend '" + be->name + "'")), {}};
    }
    if (p.backend.name.empty()) check(resolve_pipeline_defaults(p, reg, "", /*need_backend=*/true));
    if (!symbols.empty()) check(bind_symbols(*g, symbols, taken));
    const BackendInfo* info = take(reg.backend(p.backend.name));
    std::unique_ptr<Backend> be = take(info->create(p.backend.options));
    if (!be) throw KilnError("backend '" + info->name + "' created nothing");
    std::unique_ptr<Executable> exe;
    {
      nb::gil_scoped_release nogil;
      auto compiled = be->compile(*g);
      if (!compiled.ok()) throw KilnError(compiled.status().with_context("backend '" + info->name + "'").message());
      exe = std::move(*compiled);
    }
    // The executable may refer to the backend; both live as long as the model.
    std::shared_ptr<Backend> keep_backend(std::move(be));
    std::shared_ptr<Executable> shared_exe(exe.release(), [keep_backend](Executable* e) { delete e; });
    return CompiledModel{std::shared_ptr<const Graph>(std::move(g)), shared_exe, p.canonical(reg)};
  }

  check(bind_symbols(*g, symbols, taken));
  ArtifactContents contents;
  {
    nb::gil_scoped_release nogil;
    contents = take(build_artifact_contents(*g, p, reg, groups));
  }
  contents.meta["model"] = model_name;
  contents.meta["created_by"] = "kiln python";
  std::string bytes = serialize_artifact(contents);
  return artifact_from_bytes(std::move(bytes), "<compiled artifact>");
}

std::vector<nb::object> run_compiled(const CompiledModel& cm, const std::vector<nb::ndarray<nb::ro>>& arrays,
                                     bool torch_out) {
  const Graph& g = *cm.graph;
  if (static_cast<int>(arrays.size()) != g.num_inputs())
    throw KilnError("model '" + g.name() + "' takes " + std::to_string(g.num_inputs()) + " inputs, got " +
                    std::to_string(arrays.size()));
  InputBindings b;
  for (int i = 0; i < g.num_inputs(); ++i) {
    const std::string name = graph_input_name(g, i);
    b.given.emplace(name, tensor_from_array(arrays[static_cast<size_t>(i)], "input '" + name + "'"));
  }
  std::vector<Tensor> inputs = take(bind_inputs(g, b));
  std::vector<Tensor> outs;
  {
    nb::gil_scoped_release nogil;
    outs = take(cm.exe->run(inputs));
  }
  std::vector<nb::object> result;
  for (Tensor& t : outs) {
    // The caller may write what it gets: an output sharing its bytes (an input, a constant of
    // the graph, another output) becomes a copy; one the executable handed over stays as is.
    (void)t.mutable_data();
    result.push_back(array_from_tensor(t, torch_out));
  }
  return result;
}

/// CompiledModel.run's fast path for dense host torch tensors of Kiln dtypes: they are wrapped
/// as Kiln tensors without DLPack exports, and the outputs come back as torch tensors viewing
/// Kiln's bytes. None for anything else (the general path converts, copies or explains).
nb::object run_compiled_torch(const CompiledModel& cm, nb::handle xs) {
  const TorchApi* api = torch_api();
  const Graph& g = *cm.graph;
  if (!api || !PyList_CheckExact(xs.ptr()) || PyList_GET_SIZE(xs.ptr()) != g.num_inputs() || g.num_inputs() == 0)
    return nb::none();
  InputBindings b;
  for (int i = 0; i < g.num_inputs(); ++i) {
    PyObject* x = PyList_GET_ITEM(xs.ptr(), i);
    TorchTensorView v;
    if (!read_torch_tensor(*api, x, v) || v.device >= 0) return nb::none();
    std::vector<int64_t> shape(v.dims, v.dims + v.rank);
    bool empty = false;
    for (int64_t d : shape) empty = empty || d == 0;
    b.given.emplace(graph_input_name(g, i),
                    empty ? Tensor(v.dtype, std::move(shape))
                          : Tensor::wrap(v.dtype, std::move(shape), static_cast<const std::byte*>(v.data),
                                         keep_object_alive(x)));
  }
  std::vector<Tensor> inputs = take(bind_inputs(g, b));
  std::vector<Tensor> outs;
  {
    nb::gil_scoped_release nogil;
    outs = take(cm.exe->run(inputs));
  }
  nb::list result;
  for (Tensor& t : outs) {
    (void)t.mutable_data();  // as run_compiled: an output sharing bytes becomes a copy
    result.append(torch_from_tensor(*api, std::move(t)));
  }
  return result;
}

}  // namespace

void bind_graph(nb::module_& m) {
  nb::class_<PyValue>(m, "Value", "a value of a graph being built: a graph input or a node's result")
      .def_prop_ro("dtype", [](const PyValue& v) { return std::string(dtype_name(v.v->dtype())); })
      .def_prop_ro("shape", [](const PyValue& v) { return shape_to_python(v.v->shape()); })
      .def_prop_ro("name", [](const PyValue& v) { return v.v->name(); })
      .def("__repr__", [](const PyValue& v) { return "<kiln.Value %" + v.v->name() + ": " + v.v->type().str() + ">"; });

  nb::class_<PyGraph>(m, "Graph", "a Kiln graph, built op by op from Python or read from a file")
      .def("__init__", [](PyGraph* self, const std::string& name) { new (self) PyGraph{std::make_shared<Graph>(name)}; },
           nb::arg("name") = "main")
      .def_static("parse", [](const std::string& text) { return PyGraph{std::shared_ptr<Graph>(take(parse_graph(text, "<string>")))}; },
                  nb::arg("text"), "parses .kir text")
      .def_static("load", [](const std::string& path, const std::optional<std::string>& frontend) {
            ensure_plugins();
            Pipeline p;
            if (frontend) p.frontend.name = *frontend;
            if (frontend) p.frontend.options = take(resolve_options(take(registry().frontend(*frontend))->options, {}, "frontend '" + *frontend + "'"));
            check(resolve_pipeline_defaults(p, registry(), path, false));
            return PyGraph{std::shared_ptr<Graph>(take(import_model(path, p.frontend, registry())))};
          }, nb::arg("path"), nb::arg("frontend") = nb::none(), "reads a model file with a front end (by extension unless named)")
      .def_prop_ro("name", [](const PyGraph& g) { return g.g->name(); })
      .def("add_input", [](PyGraph& g, const std::string& name, const std::string& dtype,
                           const std::vector<std::variant<int64_t, std::string>>& shape) {
            return PyValue{g.g, g.g->add_input(name, TensorType{parse_dtype_or_throw(dtype), shape_from_python(shape)})};
          }, nb::arg("name"), nb::arg("dtype"), nb::arg("shape"))
      .def("constant", [](PyGraph& g, nb::ndarray<nb::ro> array, const std::string& name) {
            // The tensor views the array's memory (no copy) and keeps the array alive.
            Tensor t = tensor_from_array(array, "constant '" + name + "'");
            AttrMap attrs{{"value", Attribute(t)}};
            Node* n = take(g.g->create_node("constant", {}, {t.type()}, std::move(attrs), nullptr, {name}));
            return PyValue{g.g, n->result()};
          }, nb::arg("array"), nb::arg("name") = "", "a constant holding the array's values (shared, not copied)")
      .def("add_node", &add_node, nb::arg("op"), nb::arg("operands"), nb::arg("attrs") = nb::dict(),
           nb::arg("num_results") = 1, nb::arg("names") = std::vector<std::string>{},
           "adds a node; result types come from the op's shape rule")
      .def("set_outputs", [](PyGraph& g, const std::vector<PyValue>& outs, const std::vector<std::string>& names) {
            std::vector<Value*> vs;
            for (const PyValue& v : outs) {
              if (v.owner != g.g) throw KilnError("set_outputs: a value belongs to another graph");
              vs.push_back(v.v);
            }
            if (!names.empty() && names.size() != vs.size()) throw KilnError("set_outputs: one name per output");
            g.g->set_outputs(vs, names);
          }, nb::arg("outputs"), nb::arg("names") = std::vector<std::string>{})
      .def_prop_ro("inputs", [](const PyGraph& g) { return interface(*g.g, true); })
      .def_prop_ro("outputs", [](const PyGraph& g) { return interface(*g.g, false); })
      .def_prop_ro("num_nodes", [](const PyGraph& g) { return g.g->num_nodes(); })
      .def("verify", [](const PyGraph& g) { check(verify(*g.g)); })
      .def("ops", [](const PyGraph& g) {
            std::vector<std::string> out;
            for (const auto& n : g.g->nodes()) out.push_back(n->op_name());
            return out;
          }, "the op of every top-level node, in order")
      .def("__str__", [](const PyGraph& g) { return print_graph(*g.g); });
}

NB_MODULE(_kiln, m) {
  m.doc() = "Kiln's C++ core for Python (use the `kiln` package)";
  nb::exception<KilnError>(m, "KilnError", PyExc_RuntimeError);
  // torch.compile's caches hold compiled parts (and so Kiln objects) until after this module is
  // torn down at exit; nanobind would report those as leaks.
  nb::set_leak_warnings(false);
  m.attr("__version__") = KILN_VERSION_STRING;

  m.def("_set_plugin_dirs", [](const std::vector<std::string>& dirs) { g_plugin_dirs = dirs; });
  m.def("load_plugins", [](const std::vector<std::string>& paths) {
        ensure_plugins();
        check(load_plugins_from(paths, registry(), /*use_default_dirs=*/false));
      }, nb::arg("paths"), "loads plugins from these folders or files");
  m.def("plugins", &plugins_list, "every loaded front end, pass, backend and parallel strategy");

  nb::class_<PyPipeline>(m, "Pipeline", "a front end, passes with options, a backend and its targets")
      .def_static("from_toml", &pipeline_from_toml, nb::arg("path"))
      .def_static("from_string", &pipeline_from_string, nb::arg("text"))
      .def_prop_ro("canonical", &PyPipeline::canonical)
      .def_prop_ro("frontend", [](const PyPipeline& p) { return p.p.frontend.name; })
      .def_prop_ro("passes", [](const PyPipeline& p) {
            std::vector<std::string> out;
            for (const auto& s : p.p.passes) out.push_back(s.name);
            return out;
          })
      .def_prop_ro("backend", [](const PyPipeline& p) { return p.p.backend.name; })
      .def_prop_ro("targets", [](const PyPipeline& p) { return p.p.targets; })
      .def("__eq__", [](const PyPipeline& a, const PyPipeline& b) { return a.p == b.p; })
      .def("__repr__", [](const PyPipeline& p) { return "kiln.Pipeline(\"" + p.canonical() + "\")"; });

  bind_graph(m);

  nb::class_<CompiledModel>(m, "CompiledModel", "a model compiled for this process (reference or cpu backend)")
      .def_prop_ro("inputs", [](const CompiledModel& c) { return interface(*c.graph, true); })
      .def_prop_ro("outputs", [](const CompiledModel& c) { return interface(*c.graph, false); })
      .def_prop_ro("pipeline", [](const CompiledModel& c) { return c.pipeline; })
      .def("_run", &run_compiled, nb::arg("inputs"), nb::arg("torch_out") = false)
      .def("_run_torch", &run_compiled_torch, nb::arg("inputs"));

  nb::class_<PyArtifact>(m, "Artifact", "a .kiln artifact in memory")
      .def_static("from_bytes", [](nb::bytes b) { return artifact_from_bytes(std::string(b.c_str(), b.size()), "<bytes>"); })
      .def_static("load", [](const std::string& path) { return artifact_from_bytes(read_file(path), path); }, nb::arg("path"))
      .def("save", [](const PyArtifact& a, const std::string& path) {
            const std::string tmp = path + ".tmp";
            {
              std::ofstream out(tmp, std::ios::binary);
              out.write(a.bytes.data(), static_cast<std::streamsize>(a.bytes.size()));
              if (!out) throw KilnError("cannot write '" + tmp + "'");
            }
            std::error_code ec;
            std::filesystem::rename(tmp, path, ec);
            if (ec) throw KilnError("cannot write '" + path + "': " + ec.message());
          }, nb::arg("path"))
      .def("to_bytes", [](const PyArtifact& a) { return nb::bytes(a.bytes.data(), a.bytes.size()); })
      .def("_describe_json", [](const PyArtifact& a) { return artifact::describe(*a.parsed, true); })
      .def("__str__", [](const PyArtifact& a) { return artifact::describe(*a.parsed, false); })
      .def("__len__", [](const PyArtifact& a) { return a.bytes.size(); });

  m.def("_compile", &compile_model, nb::arg("model"), nb::arg("pipeline") = nb::none(),
        nb::arg("targets") = std::vector<std::string>{}, nb::arg("symbols") = std::map<std::string, int64_t>{},
        nb::arg("passes") = nb::none(), nb::arg("backend") = nb::none(), nb::arg("verify_each") = true);

  bind_runtime(m);
  bind_torch(m);
}

}  // namespace kiln::py
