// Pipelines as data: the TOML reader, the canonical one-line form and its parser.
#include "kiln/core/pipeline.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <toml++/toml.h>

#include "option_text.h"

namespace kiln {

namespace fs = std::filesystem;

namespace {

/// The settings of `[runtime]`, declared like plugin options so they validate and print alike.
const std::vector<OptionSpec>& runtime_specs() {
  static const std::vector<OptionSpec> specs = {
      {"threads", OptionType::kInt, int64_t{0}, "CPU threads (0 = all cores)"},
      {"cuda-graphs", OptionType::kBool, true, "capture launches into CUDA graphs"},
      {"device", OptionType::kString, std::string(), "device to run on (\"\" = best available)"},
  };
  return specs;
}

const std::vector<OptionSpec>& plugins_specs() {
  static const std::vector<OptionSpec> specs = {
      {"paths", OptionType::kStringList, std::vector<std::string>{}, "extra plugin folders"}};
  return specs;
}

Status runtime_from_options(const Options& o, RuntimeSettings& rt, const Location& loc) {
  rt.threads = o.get_int("threads");
  rt.cuda_graphs = o.get_bool("cuda-graphs");
  rt.device = o.get_string("device");
  if (rt.threads < 0) return error_at(loc, StatusCode::kInvalidArgument, "runtime 'threads' must be >= 0");
  return ok_status();
}

Options runtime_to_options(const RuntimeSettings& rt) {
  Options o;
  o.set("threads", rt.threads);
  o.set("cuda-graphs", rt.cuda_graphs);
  o.set("device", rt.device);
  return o;
}

std::string owner_name(PluginKind kind, const std::string& name) {
  return std::string(plugin_kind_name(kind)) + " '" + name + "'";
}

bool is_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
}

// ---------------------------------------------------------------------------------------------
// The one-line form:
//   frontend | pass{k=v},pass | backend{k=v}@target,target [| runtime{...}] [| plugins{...}]

class LineParser {
 public:
  LineParser(std::string_view text, const Registry& reg, Location base)
      : s_(text), reg_(reg), base_(std::move(base)) {}

  Location loc(size_t pos) const { return {base_.file, base_.line, base_.col + static_cast<int>(pos)}; }
  Status error(size_t pos, const std::string& msg) const {
    return error_at(loc(pos), StatusCode::kInvalidArgument, msg);
  }

  void skip_ws() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool at_end() { skip_ws(); return pos_ >= s_.size(); }
  char peek() { skip_ws(); return pos_ < s_.size() ? s_[pos_] : '\0'; }
  bool eat(char c) {
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  std::string what_is_here() {
    if (at_end()) return "end of text";
    return "'" + std::string(1, s_[pos_]) + "'";
  }

  /// True when the text has a '|' outside quoted strings.
  bool has_segments() const {
    bool quoted = false;
    for (size_t i = 0; i < s_.size(); ++i) {
      if (quoted && s_[i] == '\\') ++i;
      else if (s_[i] == '"') quoted = !quoted;
      else if (!quoted && s_[i] == '|') return true;
    }
    return false;
  }

  StatusOr<std::string> name() {
    skip_ws();
    const size_t start = pos_;
    while (pos_ < s_.size() && is_name_char(s_[pos_])) ++pos_;
    if (start == pos_) return error(start, "expected a name, found " + what_is_here());
    return std::string(s_.substr(start, pos_ - start));
  }

  StatusOr<std::string> quoted() {
    const size_t start = pos_++;
    std::string out;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      char c = s_[pos_++];
      if (c == '\\') {
        if (pos_ >= s_.size()) break;
        const char e = s_[pos_++];
        if (e == 'n') c = '\n';
        else if (e == 't') c = '\t';
        else if (e == 'r') c = '\r';
        else if (e == '"' || e == '\\') c = e;
        else if (e == 'x' && pos_ + 2 <= s_.size() && std::isxdigit(static_cast<unsigned char>(s_[pos_])) &&
                 std::isxdigit(static_cast<unsigned char>(s_[pos_ + 1]))) {
          c = static_cast<char>(std::stoi(std::string(s_.substr(pos_, 2)), nullptr, 16));
          pos_ += 2;
        } else {
          return error(pos_ - 2, "unknown escape '\\" + std::string(1, e) + "'");
        }
      }
      out += c;
    }
    if (pos_ >= s_.size()) return error(start, "unterminated string");
    ++pos_;
    return out;
  }

  StatusOr<OptionValue> scalar() {
    skip_ws();
    if (peek() == '"') {
      KILN_ASSIGN_OR_RETURN(std::string s, quoted());
      return OptionValue(std::move(s));
    }
    const size_t start = pos_;
    while (pos_ < s_.size() && detail::is_bare_char(s_[pos_])) ++pos_;
    if (start == pos_) return error(start, "expected a value, found " + what_is_here());
    auto v = detail::bare_option_value(s_.substr(start, pos_ - start));
    if (!v.ok()) return error(start, v.status().message());
    return v;
  }

  StatusOr<OptionValue> value() {
    if (!eat('[')) return scalar();
    const size_t start = pos_ - 1;
    std::vector<OptionValue> items;
    if (!eat(']')) {
      do {
        const size_t at = pos_;
        KILN_ASSIGN_OR_RETURN(OptionValue v, scalar());
        const OptionType t = option_value_type(v);
        if (t != OptionType::kInt && t != OptionType::kString)
          return error(at, std::string("list items must be ints or strings, found ") + option_type_name(t));
        items.push_back(std::move(v));
      } while (eat(','));
      if (!eat(']')) return error(pos_, "expected ',' or ']' in list, found " + what_is_here());
    }
    const bool ints = std::all_of(items.begin(), items.end(),
                                  [](const OptionValue& v) { return std::holds_alternative<int64_t>(v); });
    const bool strings = std::all_of(items.begin(), items.end(),
                                     [](const OptionValue& v) { return std::holds_alternative<std::string>(v); });
    if (!items.empty() && ints) {
      std::vector<int64_t> out;
      for (auto& v : items) out.push_back(std::get<int64_t>(v));
      return OptionValue(std::move(out));
    }
    if (!strings) return error(start, "list mixes ints and strings");
    std::vector<std::string> out;
    for (auto& v : items) out.push_back(std::get<std::string>(v));
    return OptionValue(std::move(out));
  }

  /// `{k=v,...}` (absent = no options), checked against `specs`.
  StatusOr<Options> options(const std::vector<OptionSpec>& specs, const std::string& owner) {
    std::map<std::string, OptionValue> given;
    if (eat('{') && !eat('}')) {
      do {
        skip_ws();
        const size_t key_pos = pos_;
        KILN_ASSIGN_OR_RETURN(std::string key, name());
        if (!eat('=')) return error(pos_, "expected '=' after option '" + key + "', found " + what_is_here());
        skip_ws();
        const size_t value_pos = pos_;
        KILN_ASSIGN_OR_RETURN(OptionValue v, value());
        if (given.count(key)) return error(key_pos, "option '" + key + "' given twice");
        // Check each option on its own so the error points at the key or value at fault.
        auto one = resolve_options(specs, {{key, v}}, owner);
        if (!one.ok()) {
          const bool declared = std::any_of(specs.begin(), specs.end(), [&](const OptionSpec& s) { return s.name == key; });
          return error(declared ? value_pos : key_pos, one.status().message());
        }
        given[key] = std::move(v);
      } while (eat(','));
      if (!eat('}')) return error(pos_, "expected ',' or '}' after options, found " + what_is_here());
    }
    return resolve_options(specs, given, owner);
  }

  /// `name{k=v,...}` of a registered plugin.
  StatusOr<StageSpec> stage(PluginKind kind) {
    skip_ws();
    StageSpec st;
    const size_t at = pos_;
    st.loc = loc(at);
    KILN_ASSIGN_OR_RETURN(st.name, name());
    auto entry = reg_.find(kind, st.name);
    if (!entry.ok()) return error(at, entry.status().message());
    KILN_ASSIGN_OR_RETURN(st.options, options((*entry)->options, owner_name(kind, st.name)));
    return st;
  }

  /// An optional front end or backend: nothing before the next '|' means "not named".
  StatusOr<StageSpec> optional_stage(PluginKind kind) {
    const char c = peek();
    if (c == '\0' || c == '|' || c == '@') return StageSpec{};
    return stage(kind);
  }

  StatusOr<std::vector<StageSpec>> pass_list() {
    std::vector<StageSpec> out;
    const char c = peek();
    if (c == '\0' || c == '|') return out;
    do {
      // A parallel strategy may stand among the passes, at the place it runs.
      skip_ws();
      const size_t at = pos_;
      auto word = name();
      pos_ = at;
      const bool parallel = word.ok() && !reg_.find(PluginKind::kPass, *word).ok() &&
                            reg_.find(PluginKind::kParallel, *word).ok();
      KILN_ASSIGN_OR_RETURN(StageSpec st, stage(parallel ? PluginKind::kParallel : PluginKind::kPass));
      st.parallel = parallel;
      if (parallel)
        for (const StageSpec& earlier : out)
          if (earlier.parallel)
            return error(at, "a pipeline runs one parallel strategy; '" + earlier.name + "' comes first");
      out.push_back(std::move(st));
    } while (eat(','));
    return out;
  }

  Status expect_end() {
    if (!at_end()) return error(pos_, "unexpected " + what_is_here());
    return ok_status();
  }

  StatusOr<Pipeline> pipeline() {
    Pipeline p;
    KILN_ASSIGN_OR_RETURN(p.frontend, optional_stage(PluginKind::kFrontend));
    if (!eat('|')) return error(pos_, "expected '|' after the frontend, found " + what_is_here());
    KILN_ASSIGN_OR_RETURN(p.passes, pass_list());
    if (!eat('|')) return error(pos_, "expected ',' or '|' after the passes, found " + what_is_here());
    KILN_ASSIGN_OR_RETURN(p.backend, optional_stage(PluginKind::kBackend));
    if (eat('@')) {
      do {
        const size_t at = pos_;
        KILN_ASSIGN_OR_RETURN(std::string t, name());
        KILN_RETURN_IF_ERROR(check_target(p.backend.name, t, loc(at)));
        p.targets.push_back(std::move(t));
      } while (eat(','));
    }
    bool seen_runtime = false, seen_plugins = false;
    while (eat('|')) {
      skip_ws();
      const size_t at = pos_;
      KILN_ASSIGN_OR_RETURN(std::string section, name());
      if (section == "runtime" && !seen_runtime) {
        seen_runtime = true;
        KILN_ASSIGN_OR_RETURN(Options o, options(runtime_specs(), "runtime settings"));
        KILN_RETURN_IF_ERROR(runtime_from_options(o, p.runtime, loc(at)));
      } else if (section == "plugins" && !seen_plugins) {
        seen_plugins = true;
        KILN_ASSIGN_OR_RETURN(Options o, options(plugins_specs(), "plugin settings"));
        p.plugin_paths = o.get_strings("paths");
      } else {
        return error(at, "expected 'runtime{...}' or 'plugins{...}' (each once), found '" + section + "'");
      }
    }
    KILN_RETURN_IF_ERROR(expect_end());
    return p;
  }

  Status check_target(const std::string& backend, const std::string& target, const Location& at) const {
    if (backend.empty()) return ok_status();
    auto info = reg_.backend(backend);
    if (!info.ok() || (*info)->targets.empty()) return ok_status();
    const auto& ts = (*info)->targets;
    if (std::find(ts.begin(), ts.end(), target) != ts.end()) return ok_status();
    std::string known;
    for (const auto& t : ts) known += (known.empty() ? "" : ", ") + t;
    return error_at(at, StatusCode::kInvalidArgument,
                    "backend '" + backend + "' cannot build for target '" + target + "'; its targets: " + known);
  }

 private:
  std::string_view s_;
  const Registry& reg_;
  Location base_;
  size_t pos_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The TOML form.

const char* toml_type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::array: return "array";
    case toml::node_type::table: return "table";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "nothing";
  }
}

class TomlReader {
 public:
  TomlReader(std::string file, const Registry* reg) : file_(std::move(file)), reg_(reg) {}

  Location loc(const toml::source_region& r) const {
    return {file_, static_cast<int>(r.begin.line), static_cast<int>(r.begin.column)};
  }
  Status error(const toml::source_region& r, const std::string& msg) const {
    return error_at(loc(r), StatusCode::kInvalidArgument, msg);
  }

  /// Refuses keys outside `allowed`, pointing at the first one in source order.
  Status check_keys(const toml::table& t, std::initializer_list<std::string_view> allowed,
                    const std::string& where) const {
    std::vector<const toml::key*> unknown;
    for (auto&& [k, v] : t)
      if (std::find(allowed.begin(), allowed.end(), k.str()) == allowed.end()) unknown.push_back(&k);
    if (unknown.empty()) return ok_status();
    auto first = *std::min_element(unknown.begin(), unknown.end(), [](const toml::key* a, const toml::key* b) {
      return std::pair(a->source().begin.line, a->source().begin.column) <
             std::pair(b->source().begin.line, b->source().begin.column);
    });
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    return error(first->source(), "unknown key '" + std::string(first->str()) + "' in " + where +
                                      "; expected one of: " + list);
  }

  Status type_error(const toml::node& n, const std::string& what, const char* want) const {
    return error(n.source(), what + " must be " + want + ", got " + toml_type_name(n));
  }

  StatusOr<std::string> string(const toml::node& n, const std::string& what) const {
    if (!n.is_string()) return type_error(n, what, "a string");
    return std::string(n.as_string()->get());
  }

  StatusOr<std::vector<std::string>> strings(const toml::node& n, const std::string& what) const {
    if (!n.is_array()) return type_error(n, what, "an array of strings");
    std::vector<std::string> out;
    for (const auto& item : *n.as_array()) {
      KILN_ASSIGN_OR_RETURN(std::string s, string(item, what + " entries"));
      out.push_back(std::move(s));
    }
    return out;
  }

  StatusOr<OptionValue> option_value(const toml::node& n, const std::string& key) const {
    if (auto* b = n.as_boolean()) return OptionValue(b->get());
    if (auto* i = n.as_integer()) return OptionValue(i->get());
    if (auto* f = n.as_floating_point()) return OptionValue(f->get());
    if (auto* s = n.as_string()) return OptionValue(s->get());
    if (auto* a = n.as_array()) {
      if (a->empty()) return OptionValue(std::vector<std::string>{});
      if (a->is_homogeneous(toml::node_type::integer)) {
        std::vector<int64_t> out;
        for (const auto& item : *a) out.push_back(item.as_integer()->get());
        return OptionValue(std::move(out));
      }
      if (a->is_homogeneous(toml::node_type::string)) {
        std::vector<std::string> out;
        for (const auto& item : *a) out.push_back(item.as_string()->get());
        return OptionValue(std::move(out));
      }
      return error(n.source(), "option '" + key + "': arrays must hold only integers or only strings");
    }
    return error(n.source(), "option '" + key + "': unsupported value type " + toml_type_name(n));
  }

  /// An `options` table checked against `specs`; errors point at the key or value at fault.
  StatusOr<Options> options(const toml::node* n, const std::vector<OptionSpec>& specs,
                            const std::string& owner) const {
    std::map<std::string, OptionValue> given;
    if (n) {
      if (!n->is_table()) return type_error(*n, "'options' of " + owner, "a table");
      std::vector<std::pair<const toml::key*, const toml::node*>> items;
      for (auto&& [k, v] : *n->as_table()) items.emplace_back(&k, &v);
      std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
        return std::pair(a.first->source().begin.line, a.first->source().begin.column) <
               std::pair(b.first->source().begin.line, b.first->source().begin.column);
      });
      for (auto [k, v] : items) {
        const std::string key(k->str());
        KILN_ASSIGN_OR_RETURN(OptionValue value, option_value(*v, key));
        auto one = resolve_options(specs, {{key, value}}, owner);
        if (!one.ok()) {
          const bool declared = std::any_of(specs.begin(), specs.end(), [&](const OptionSpec& s) { return s.name == key; });
          return error(declared ? v->source() : k->source(), one.status().message());
        }
        given[key] = std::move(value);
      }
    }
    return resolve_options(specs, given, owner);
  }

  /// A stage written as "name" (one-line syntax allowed) or as a table {name, options, ...}.
  StatusOr<StageSpec> stage(const toml::node& n, PluginKind kind, const std::string& where,
                            std::initializer_list<std::string_view> keys) const {
    if (auto* s = n.as_string()) {
      const Location at = loc(n.source());
      // Columns inside the string start one past the opening quote.
      LineParser lp(s->get(), *reg_, {at.file, at.line, at.col + 1});
      KILN_ASSIGN_OR_RETURN(StageSpec st, lp.stage(kind));
      KILN_RETURN_IF_ERROR(lp.expect_end());
      return st;
    }
    if (!n.is_table()) return type_error(n, where, "a string or a table");
    const toml::table& t = *n.as_table();
    KILN_RETURN_IF_ERROR(check_keys(t, keys, where));
    const toml::node* name_node = t.get("name");
    if (!name_node) return error(n.source(), where + " lacks 'name'");
    StageSpec st;
    KILN_ASSIGN_OR_RETURN(st.name, string(*name_node, "'name' in " + where));
    st.loc = loc(name_node->source());
    auto entry = reg_->find(kind, st.name);
    if (!entry.ok()) return error(name_node->source(), entry.status().message());
    KILN_ASSIGN_OR_RETURN(st.options, options(t.get("options"), (*entry)->options, owner_name(kind, st.name)));
    return st;
  }

  /// [parallel]: strategy, mesh, options, after. Inserts the strategy into the pass list.
  Status parallel(const toml::node& n, std::vector<StageSpec>& passes) const {
    if (!n.is_table()) return type_error(n, "'parallel'", "a table");
    const toml::table& t = *n.as_table();
    KILN_RETURN_IF_ERROR(check_keys(t, {"strategy", "mesh", "options", "after"}, "[parallel]"));
    const toml::node* name_node = t.get("strategy");
    if (!name_node) return error(n.source(), "[parallel] lacks 'strategy'");
    StageSpec st;
    st.parallel = true;
    KILN_ASSIGN_OR_RETURN(st.name, string(*name_node, "'strategy' in [parallel]"));
    st.loc = loc(name_node->source());
    auto entry = reg_->find(PluginKind::kParallel, st.name);
    if (!entry.ok()) return error(name_node->source(), entry.status().message());
    const std::string owner = owner_name(PluginKind::kParallel, st.name);
    KILN_ASSIGN_OR_RETURN(st.options, options(t.get("options"), (*entry)->options, owner));
    if (const toml::node* mesh = t.get("mesh")) {
      if (t.get("options") && t.get("options")->is_table() && t.get("options")->as_table()->get("mesh"))
        return error(mesh->source(), "[parallel] gives the mesh twice: as 'mesh' and in 'options'");
      KILN_ASSIGN_OR_RETURN(std::string text, string(*mesh, "'mesh' in [parallel]"));
      auto one = resolve_options((*entry)->options, {{"mesh", OptionValue(text)}}, owner);
      if (!one.ok()) return error(mesh->source(), one.status().message());
      st.options.set("mesh", text);
    }
    for (const StageSpec& s : passes)
      if (s.parallel) return error(n.source(), "a pipeline runs one parallel strategy; '" + s.name + "' is in 'passes'");
    // Default place: after the clean-up passes the list starts with (the strategy partitions a
    // tidy global graph; fusion, quantization and scheduling then work on the per-rank one).
    size_t at = 0;
    while (at < passes.size() && (passes[at].name == "canonicalize" || passes[at].name == "cse" || passes[at].name == "dce"))
      ++at;
    // A training step: after autodiff (and a remat right after it), so the strategy splits the
    // joint forward and backward graph and the optimizer updates from reduced gradients.
    for (size_t i = 0; i < passes.size(); ++i)
      if (passes[i].name == "autodiff") {
        at = i + 1;
        while (at < passes.size() && passes[at].name == "remat") ++at;
      }
    if (const toml::node* after = t.get("after")) {
      KILN_ASSIGN_OR_RETURN(std::string pass, string(*after, "'after' in [parallel]"));
      auto it = std::find_if(passes.begin(), passes.end(), [&](const StageSpec& s) { return s.name == pass; });
      if (it == passes.end()) return error(after->source(), "[parallel] after = '" + pass + "', which is not in 'passes'");
      at = static_cast<size_t>(it - passes.begin()) + 1;
    }
    passes.insert(passes.begin() + static_cast<std::ptrdiff_t>(at), std::move(st));
    return ok_status();
  }

  StatusOr<std::vector<std::string>> plugin_paths(const toml::table& root) const {
    const toml::node* n = root.get("plugins");
    if (!n) return std::vector<std::string>{};
    if (!n->is_table()) return type_error(*n, "'plugins'", "a table");
    KILN_RETURN_IF_ERROR(check_keys(*n->as_table(), {"paths"}, "[plugins]"));
    const toml::node* paths = n->as_table()->get("paths");
    if (!paths) return std::vector<std::string>{};
    KILN_ASSIGN_OR_RETURN(std::vector<std::string> out, strings(*paths, "'paths' in [plugins]"));
    // Relative paths are relative to the pipeline file, so a pipeline can ship with its plugins.
    std::error_code ec;
    const fs::path base = file_.starts_with("<") ? fs::current_path(ec) : fs::absolute(file_, ec).parent_path();
    for (auto& p : out) p = (base / p).lexically_normal().string();
    return out;
  }

  StatusOr<Pipeline> pipeline(const toml::table& root) const {
    KILN_RETURN_IF_ERROR(check_keys(root, {"frontend", "passes", "parallel", "backend", "runtime", "plugins"}, "the pipeline"));
    Pipeline p;
    if (const toml::node* n = root.get("frontend")) {
      KILN_ASSIGN_OR_RETURN(p.frontend, stage(*n, PluginKind::kFrontend, "[frontend]", {"name", "options"}));
    }
    if (const toml::node* n = root.get("passes")) {
      if (!n->is_array()) return type_error(*n, "'passes'", "an array of pass names or [[passes]] tables");
      for (const auto& item : *n->as_array()) {
        KILN_ASSIGN_OR_RETURN(StageSpec st, stage(item, PluginKind::kPass, "[[passes]]", {"name", "options"}));
        p.passes.push_back(std::move(st));
      }
    }
    if (const toml::node* n = root.get("parallel")) KILN_RETURN_IF_ERROR(parallel(*n, p.passes));
    if (const toml::node* n = root.get("backend")) {
      KILN_ASSIGN_OR_RETURN(p.backend, stage(*n, PluginKind::kBackend, "[backend]", {"name", "targets", "options"}));
      const toml::node* targets = n->is_table() ? n->as_table()->get("targets") : nullptr;
      if (targets) {
        KILN_ASSIGN_OR_RETURN(p.targets, strings(*targets, "'targets' in [backend]"));
        LineParser lp("", *reg_, {});
        for (size_t i = 0; i < p.targets.size(); ++i) {
          KILN_RETURN_IF_ERROR(lp.check_target(p.backend.name, p.targets[i], loc((*targets->as_array())[i].source())));
        }
      }
    }
    if (const toml::node* n = root.get("runtime")) {
      if (!n->is_table()) return type_error(*n, "'runtime'", "a table");
      KILN_RETURN_IF_ERROR(check_keys(*n->as_table(), {"threads", "cuda-graphs", "device"}, "[runtime]"));
      KILN_ASSIGN_OR_RETURN(Options o, options(n, runtime_specs(), "runtime settings"));
      KILN_RETURN_IF_ERROR(runtime_from_options(o, p.runtime, loc(n->source())));
    }
    KILN_ASSIGN_OR_RETURN(p.plugin_paths, plugin_paths(root));
    return p;
  }

 private:
  std::string file_;
  const Registry* reg_;
};

StatusOr<toml::table> parse_toml(std::string_view text, const std::string& filename) {
  try {
    return toml::parse(text, std::string_view(filename));
  } catch (const toml::parse_error& e) {
    std::string msg(e.description());
    if (!msg.empty()) msg[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(msg[0])));
    const Location at{filename, static_cast<int>(e.source().begin.line), static_cast<int>(e.source().begin.column)};
    return error_at(at, StatusCode::kInvalidArgument, msg);
  }
}

StatusOr<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("cannot open pipeline '" + path + "': " + std::strerror(errno));
  std::error_code ec;
  if (fs::is_directory(path, ec)) return io_error("cannot read pipeline '" + path + "': it is a directory");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return io_error("cannot read pipeline '" + path + "'");
  return text.str();
}

std::string stage_text(const Registry& reg, PluginKind kind, const StageSpec& s) {
  auto entry = reg.find(kind, s.name);
  static const std::vector<OptionSpec> none;
  return s.name + s.options.canonical(entry.ok() ? (*entry)->options : none);
}

}  // namespace

std::string Pipeline::canonical(const Registry& reg) const {
  std::vector<std::string> parts;
  parts.push_back(stage_text(reg, PluginKind::kFrontend, frontend));
  std::string list;
  for (size_t i = 0; i < passes.size(); ++i)
    list += (i ? "," : "") + stage_text(reg, passes[i].parallel ? PluginKind::kParallel : PluginKind::kPass, passes[i]);
  parts.push_back(list);
  std::string be = stage_text(reg, PluginKind::kBackend, backend);
  for (size_t i = 0; i < targets.size(); ++i) be += (i ? "," : "@") + targets[i];
  parts.push_back(be);
  const std::string rt = runtime_to_options(runtime).canonical(runtime_specs());
  if (!rt.empty()) parts.push_back("runtime" + rt);
  if (!plugin_paths.empty()) {
    Options o;
    o.set("paths", plugin_paths);
    parts.push_back("plugins" + o.canonical(plugins_specs()));
  }
  // Segments joined by " | "; an empty segment leaves just its bar ("kir | | reference").
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += out.empty() ? "|" : " |";
    if (!parts[i].empty()) out += (out.empty() ? "" : " ") + parts[i];
  }
  return out;
}

StatusOr<std::vector<std::string>> read_pipeline_plugin_paths(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(std::string text, read_text(path));
  KILN_ASSIGN_OR_RETURN(toml::table root, parse_toml(text, path));
  return TomlReader(path, nullptr).plugin_paths(root);
}

StatusOr<Pipeline> load_pipeline_file(const std::string& path, const Registry& reg) {
  KILN_ASSIGN_OR_RETURN(std::string text, read_text(path));
  return parse_pipeline_toml(text, path, reg);
}

StatusOr<Pipeline> parse_pipeline_toml(std::string_view text, const std::string& filename,
                                       const Registry& reg) {
  KILN_ASSIGN_OR_RETURN(toml::table root, parse_toml(text, filename));
  return TomlReader(filename, &reg).pipeline(root);
}

StatusOr<Pipeline> parse_pipeline_string(std::string_view text, const Registry& reg) {
  LineParser lp(text, reg, {"<pipeline>", 1, 1});
  if (lp.has_segments()) return lp.pipeline();
  Pipeline p;
  KILN_ASSIGN_OR_RETURN(p.passes, parse_pass_list(text, reg));
  return p;
}

StatusOr<std::vector<StageSpec>> parse_pass_list(std::string_view text, const Registry& reg) {
  LineParser lp(text, reg, {"<pipeline>", 1, 1});
  KILN_ASSIGN_OR_RETURN(std::vector<StageSpec> passes, lp.pass_list());
  KILN_RETURN_IF_ERROR(lp.expect_end());
  return passes;
}

StatusOr<OptionValue> parse_option_value(std::string_view text) {
  static const Registry none;  // a value names no plugin
  LineParser lp(text, none, {"<value>", 1, 1});
  KILN_ASSIGN_OR_RETURN(OptionValue v, lp.value());
  KILN_RETURN_IF_ERROR(lp.expect_end());
  return v;
}

}  // namespace kiln
