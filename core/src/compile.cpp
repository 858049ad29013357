// From an optimized graph to a .kiln artifact's contents (kiln/core/compile.h).
#include "kiln/core/compile.h"

#include <algorithm>

#include "kiln/core/driver.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"
#include "kiln/ir/walk.h"
#include "kiln/version.h"

namespace kiln {

namespace {

std::string join(const std::vector<std::string>& v, const std::string& sep = ", ") {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

/// Every value of `g` and of the graphs nested in it: inputs, then node results, a graph
/// before those nested in it.
std::vector<Value*> all_values(const Graph& g) {
  std::vector<Value*> out;
  walk_graphs(g, [&](const Graph& sub) {
    for (Value* v : sub.inputs()) out.push_back(v);
    for (const auto& n : sub.nodes())
      for (Value* v : n->results()) out.push_back(v);
  });
  return out;
}

/// Replaces bound symbols in every value's type, `g`'s regions included.
void substitute(Graph& g, const std::map<std::string, int64_t>& symbols, std::set<std::string>& seen) {
  for (Value* v : all_values(g)) {
    TensorType t = v->type();
    for (Dim& d : t.shape) {
      if (d.is_static() || d.is_unknown()) continue;
      seen.insert(d.symbol_name());
      if (auto it = symbols.find(d.symbol_name()); it != symbols.end()) d = Dim(it->second);
    }
    v->set_type(std::move(t));
  }
}

/// The first value whose shape is not static, or null.
const Value* first_dynamic(const Graph& g) {
  for (Value* v : all_values(g))
    if (!is_static(v->shape())) return v;
  return nullptr;
}

std::string plugin_id(const Registry& reg, PluginKind kind, const std::string& name) {
  auto e = reg.find(kind, name);
  return name + "@" + (e.ok() ? (*e)->version : std::string("?"));
}

/// The options `info` builds its targets with: the pipeline's for the pipeline's backend; for
/// another backend of the compile (they share one plan), the options the pipeline sets that it
/// declares with the same type, the rest at its defaults.
StatusOr<Options> backend_options(const BackendInfo& info, const Pipeline& p, const Registry& reg) {
  const std::string who = "backend '" + info.name + "'";
  if (info.name == p.backend.name) return p.backend.options;
  std::map<std::string, OptionValue> given;
  if (auto named = reg.backend(p.backend.name); named.ok())
    for (const OptionSpec& set : (*named)->options) {
      const auto v = p.backend.options.values().find(set.name);
      if (v == p.backend.options.values().end() || v->second == set.default_value) continue;
      for (const OptionSpec& own : info.options)
        if (own.name == set.name && own.type == set.type) given.emplace(own.name, v->second);
    }
  return resolve_options(info.options, given, who);
}

}  // namespace

bool image_serves(const ArtifactImage& im, const std::string& target) {
  return im.target == target || (target.starts_with("sm_") && im.target == "compute_" + target.substr(3));
}

StatusOr<std::vector<TargetGroup>> group_targets(const Pipeline& p, const Registry& reg,
                                                 const std::vector<std::string>& only_backends) {
  std::vector<TargetGroup> groups;
  for (const auto& name : only_backends) KILN_RETURN_IF_ERROR(reg.backend(name).status());
  for (const auto& t : p.targets) {
    std::vector<const BackendInfo*> builders;
    std::vector<std::string> known;
    for (const RegistryRow& row : reg.rows()) {
      if (row.kind != PluginKind::kBackend) continue;
      if (!only_backends.empty() &&
          std::find(only_backends.begin(), only_backends.end(), row.entry->name) == only_backends.end())
        continue;
      KILN_ASSIGN_OR_RETURN(const BackendInfo* be, reg.backend(row.entry->name));
      for (const auto& bt : be->targets) {
        known.push_back(bt + " (" + be->name + ")");
        if (bt == t) builders.push_back(be);
      }
    }
    const BackendInfo* chosen = builders.size() == 1 ? builders[0] : nullptr;
    for (const BackendInfo* be : builders)
      if (be->name == p.backend.name) chosen = be;
    if (builders.empty())
      return not_found("no backend builds target '" + t + "'; known targets: " + (known.empty() ? "(none)" : join(known)));
    if (!chosen) {
      std::vector<std::string> names;
      for (const BackendInfo* be : builders) names.push_back(be->name);
      return invalid_argument("target '" + t + "' is built by several backends (" + join(names) +
                              "); choose with --backend");
    }
    auto group = std::find_if(groups.begin(), groups.end(), [&](const auto& gr) { return gr.backend == chosen; });
    if (group == groups.end()) groups.push_back({chosen, {t}});
    else group->targets.push_back(t);
  }
  if (groups.empty()) return invalid_argument("no targets to compile for");
  return groups;
}

Status bind_symbols(Graph& g, const std::map<std::string, int64_t>& symbols, const std::set<std::string>& taken) {
  std::set<std::string> seen;
  substitute(g, symbols, seen);
  for (const auto& [name, size] : symbols)
    if (!seen.count(name) && !taken.count(name))
      return invalid_argument("--sym " + name + ": the model has no symbolic dimension '" + name + "'" +
                              (seen.empty() ? "" : "; its symbols: " + join({seen.begin(), seen.end()})));
  KILN_RETURN_IF_ERROR(infer_types(g));
  KILN_RETURN_IF_ERROR(verify(g));
  const Value* v = first_dynamic(g);
  if (!v) return ok_status();
  std::string sym;
  for (const Dim& d : v->shape())
    if (!d.is_static() && !d.is_unknown()) sym = d.symbol_name();
  const std::string what = v->is_graph_input() ? "input '" + graph_input_name(*v->graph(), v->index()) + "'"
                           : "value '%" + v->name() + "' (result of '" + v->producer()->op_name() + "')";
  if (!sym.empty())
    return invalid_argument(what + " has symbolic dimension '" + sym + "' (" + v->type().str() +
                            "); artifacts need static shapes: give --sym " + sym + "=N");
  return invalid_argument(what + " has a dimension unknown at compile time (" + v->type().str() +
                          "); artifacts need static shapes");
}

StatusOr<ArtifactContents> build_artifact_contents(const Graph& g, Pipeline& p, const Registry& reg,
                                                   const std::vector<TargetGroup>& groups) {
  if (groups.empty()) return invalid_argument("no targets to compile for");
  ArtifactContents contents;
  std::vector<std::string> plugins = {plugin_id(reg, PluginKind::kFrontend, p.frontend.name)};
  for (const auto& pass : p.passes) {
    // A parallel strategy sits in the pass list but is registered under its own kind.
    const std::string id = plugin_id(reg, pass.parallel ? PluginKind::kParallel : PluginKind::kPass, pass.name);
    if (std::find(plugins.begin() + 1, plugins.end(), id) == plugins.end()) plugins.push_back(id);
  }
  for (const auto& [info, targets] : groups) {
    const std::string who = "backend '" + info->name + "'";
    KILN_ASSIGN_OR_RETURN(Options opts, backend_options(*info, p, reg));
    KILN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> be, info->create(opts));
    if (!be) return internal_error(who + " created nothing");
    Status s = be->build_artifact(g, targets, contents);
    if (!s.ok()) return s.with_context(who);
    for (const auto& t : targets)
      if (std::none_of(contents.images.begin(), contents.images.end(), [&](const auto& im) { return image_serves(im, t); }))
        return internal_error(who + " produced no image for target '" + t + "'");
    plugins.push_back(plugin_id(reg, PluginKind::kBackend, info->name));
  }

  // The recorded pipeline names the first backend used, with the options it built with (which
  // every backend of the compile that declares them shared); `plugins` lists all of them.
  if (const BackendInfo* first = groups.front().backend; first->name != p.backend.name) {
    KILN_ASSIGN_OR_RETURN(Options opts, backend_options(*first, p, reg));
    p.backend = {first->name, std::move(opts), {}};
  }
  contents.meta["kiln_version"] = KILN_VERSION_STRING;
  contents.meta["targets"] = join(p.targets, ",");
  contents.meta["plugins"] = join(plugins, ",");
  contents.meta["pipeline"] = p.canonical(reg);
  return contents;
}

}  // namespace kiln
