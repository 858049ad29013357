// The process-wide plugin registry: front ends, passes, backends and parallel strategies by name.
#include "kiln/core/registry.h"

#include <algorithm>
#include <cctype>
#include <set>

#include "kiln/ir/spelling.h"

namespace kiln {

const char* plugin_kind_name(PluginKind k) {
  switch (k) {
    case PluginKind::kFrontend: return "frontend";
    case PluginKind::kPass: return "pass";
    case PluginKind::kBackend: return "backend";
    case PluginKind::kParallel: return "parallel";
  }
  return "?";
}

namespace {

const char* plural(PluginKind k) {
  switch (k) {
    case PluginKind::kFrontend: return "frontends";
    case PluginKind::kPass: return "passes";
    case PluginKind::kBackend: return "backends";
    case PluginKind::kParallel: return "parallel strategies";
  }
  return "?";
}

std::string library_name(const std::string& lib) { return lib.empty() ? "built-in" : lib; }

/// Checks what every entry must carry: a name, a create function, and options whose defaults
/// have the declared type.
template <typename Info>
Status check_entry(PluginKind kind, const Info& info, bool has_fn) {
  const std::string what = std::string(plugin_kind_name(kind)) + " '" + info.name + "'";
  if (info.name.empty()) return invalid_argument(std::string(plugin_kind_name(kind)) + " registered with an empty name");
  if (!has_fn) return invalid_argument(what + " has no create/import function");
  std::set<std::string> seen;
  for (const auto& o : info.options) {
    if (!seen.insert(o.name).second)
      return invalid_argument(what + ": option '" + o.name + "' is declared twice");
    if (option_value_type(o.default_value) != o.type)
      return invalid_argument(what + ": option '" + o.name + "' is declared " +
                              option_type_name(o.type) + " but its default is " +
                              option_type_name(option_value_type(o.default_value)));
  }
  return ok_status();
}

template <typename Info>
Status add_entry(std::map<std::string, Info>& table, PluginKind kind, Info info, bool has_fn,
                 const std::string& library) {
  KILN_RETURN_IF_ERROR(check_entry(kind, info, has_fn));
  info.library = library;
  auto it = table.find(info.name);
  if (it != table.end())
    return already_exists("duplicate " + std::string(plugin_kind_name(kind)) + " '" + info.name +
                          "': already registered by " + library_name(it->second.library) +
                          ", again by " + library_name(library));
  std::string name = info.name;
  table.emplace(std::move(name), std::move(info));
  return ok_status();
}

template <typename Info>
StatusOr<const Info*> lookup(const std::map<std::string, Info>& table, PluginKind kind,
                             const std::string& name) {
  auto it = table.find(name);
  if (it != table.end()) return &it->second;
  std::vector<std::string> names;
  for (const auto& [n, info] : table) names.push_back(n);
  std::string msg = "unknown " + (kind == PluginKind::kParallel ? std::string("parallel strategy") : std::string(plugin_kind_name(kind))) + " '" + name + "'" +
                    did_you_mean(name, names);
  if (names.empty()) {
    msg += "; no " + std::string(plural(kind)) + " are registered";
  } else {
    msg += "; registered " + std::string(plural(kind)) + ": " + names.front();
    for (size_t i = 1; i < names.size(); ++i) msg += ", " + names[i];
  }
  // The name may well be right and its plugin simply not loaded: say how to load one.
  return not_found(msg + "; " + std::string(kPluginHint));
}

}  // namespace

Registry& Registry::global() {
  // Leaked on purpose: entries hold functions living in plugins, which are never unloaded,
  // and nothing must run them after exit() began.
  static Registry* r = new Registry;
  return *r;
}

Status Registry::add_frontend(FrontendInfo info) {
  const bool fn = static_cast<bool>(info.import);
  return add_entry(frontends_, PluginKind::kFrontend, std::move(info), fn, current_library_);
}
Status Registry::add_pass(PassInfo info) {
  const bool fn = static_cast<bool>(info.create);
  return add_entry(passes_, PluginKind::kPass, std::move(info), fn, current_library_);
}
Status Registry::add_backend(BackendInfo info) {
  const bool fn = static_cast<bool>(info.create);
  return add_entry(backends_, PluginKind::kBackend, std::move(info), fn, current_library_);
}
Status Registry::add_parallel(ParallelInfo info) {
  const bool fn = static_cast<bool>(info.create);
  return add_entry(parallels_, PluginKind::kParallel, std::move(info), fn, current_library_);
}

StatusOr<const FrontendInfo*> Registry::frontend(const std::string& name) const {
  return lookup(frontends_, PluginKind::kFrontend, name);
}
StatusOr<const PassInfo*> Registry::pass(const std::string& name) const {
  return lookup(passes_, PluginKind::kPass, name);
}
StatusOr<const BackendInfo*> Registry::backend(const std::string& name) const {
  return lookup(backends_, PluginKind::kBackend, name);
}
StatusOr<const ParallelInfo*> Registry::parallel(const std::string& name) const {
  return lookup(parallels_, PluginKind::kParallel, name);
}

StatusOr<const FrontendInfo*> Registry::frontend_for_path(const std::string& path) const {
  // The longest matching extension wins, so ".tar.gz" beats ".gz".
  const FrontendInfo* best = nullptr;
  size_t best_len = 0;
  std::string known;
  for (const auto& [name, info] : frontends_) {
    for (const auto& ext : info.extensions) {
      known += (known.empty() ? "" : ", ") + name + " (" + ext + ")";
      if (ext.empty() || ext.size() > path.size() || ext.size() <= best_len) continue;
      const std::string tail = path.substr(path.size() - ext.size());
      if (std::equal(tail.begin(), tail.end(), ext.begin(), ext.end(), [](char a, char b) {
            return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
          })) {
        best = &info;
        best_len = ext.size();
      }
    }
  }
  if (best) return best;
  return not_found("no frontend reads '" + path + "'" +
                   (known.empty() ? std::string("; no frontends are registered")
                                  : "; known extensions: " + known) +
                   "; " + std::string(kPluginHint));
}

StatusOr<const PluginEntry*> Registry::find(PluginKind kind, const std::string& name) const {
  switch (kind) {
    case PluginKind::kFrontend: {
      KILN_ASSIGN_OR_RETURN(const FrontendInfo* e, frontend(name));
      return static_cast<const PluginEntry*>(e);
    }
    case PluginKind::kPass: {
      KILN_ASSIGN_OR_RETURN(const PassInfo* e, pass(name));
      return static_cast<const PluginEntry*>(e);
    }
    case PluginKind::kBackend: {
      KILN_ASSIGN_OR_RETURN(const BackendInfo* e, backend(name));
      return static_cast<const PluginEntry*>(e);
    }
    case PluginKind::kParallel: {
      KILN_ASSIGN_OR_RETURN(const ParallelInfo* e, parallel(name));
      return static_cast<const PluginEntry*>(e);
    }
  }
  return internal_error("bad plugin kind");
}

std::vector<RegistryRow> Registry::rows() const {
  std::vector<RegistryRow> out;
  for (const auto& [n, e] : frontends_) out.push_back({PluginKind::kFrontend, &e});
  for (const auto& [n, e] : passes_) out.push_back({PluginKind::kPass, &e});
  for (const auto& [n, e] : backends_) out.push_back({PluginKind::kBackend, &e});
  for (const auto& [n, e] : parallels_) out.push_back({PluginKind::kParallel, &e});
  return out;
}

}  // namespace kiln
