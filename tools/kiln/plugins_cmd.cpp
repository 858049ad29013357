// `kiln plugins`: every registered front end, pass, backend and strategy, as text or JSON.
#include <cmath>
#include <cstdio>
#include <iostream>

#include "cli.h"
#include "kiln/core/driver.h"
#include "kiln/core/loader.h"
#include "kiln/plugin.h"

namespace kiln::cli {

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

namespace {


template <typename T, typename F>
std::string json_array(const std::vector<T>& v, F item) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + item(v[i]);
  return out + "]";
}

std::string json_value(const OptionValue& v) {
  switch (option_value_type(v)) {
    case OptionType::kBool: return std::get<bool>(v) ? "true" : "false";
    case OptionType::kInt: return std::to_string(std::get<int64_t>(v));
    case OptionType::kFloat: {
      const double d = std::get<double>(v);
      // JSON has no inf or nan: give those as their option text.
      return std::isfinite(d) ? option_value_str(v) : json_string(option_value_str(v));
    }
    case OptionType::kString: return json_string(std::get<std::string>(v));
    case OptionType::kStringList: return json_array(std::get<std::vector<std::string>>(v), json_string);
    case OptionType::kIntList:
      return json_array(std::get<std::vector<int64_t>>(v), [](int64_t x) { return std::to_string(x); });
  }
  return "null";
}

std::string library_text(const std::string& lib) { return lib.empty() ? "built-in" : lib; }

/// Front ends' extensions and backends' targets, the one kind-specific detail worth showing.
std::vector<std::string> extras(const Registry& reg, const RegistryRow& row, std::string& label) {
  if (row.kind == PluginKind::kFrontend) {
    label = "extensions";
    auto fe = reg.frontend(row.entry->name);
    return fe.ok() ? (*fe)->extensions : std::vector<std::string>{};
  }
  if (row.kind == PluginKind::kBackend) {
    label = "targets";
    auto be = reg.backend(row.entry->name);
    return be.ok() ? (*be)->targets : std::vector<std::string>{};
  }
  label.clear();
  return {};
}

void print_json(const Registry& reg) {
  std::string out = "{\n  \"kiln\": \"" KILN_VERSION_STRING "\",\n";
  out += "  \"abi\": \"" + std::to_string(KILN_PLUGIN_ABI_MAJOR) + "." + std::to_string(KILN_PLUGIN_ABI_MINOR) + "\",\n";
  out += "  \"libraries\": " + json_array(loaded_plugin_libraries(), json_string) + ",\n";
  out += "  \"plugins\": [";
  const auto rows = reg.rows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const PluginEntry& e = *rows[i].entry;
    out += i ? ",\n" : "\n";
    out += "    {\"name\": " + json_string(e.name) + ", \"kind\": " + json_string(plugin_kind_name(rows[i].kind)) +
           ", \"version\": " + json_string(e.version) + ", \"summary\": " + json_string(e.summary) +
           ", \"library\": " + json_string(library_text(e.library));
    std::string label;
    const auto more = extras(reg, rows[i], label);
    if (!label.empty()) out += ", " + json_string(label) + ": " + json_array(more, json_string);
    out += ", \"options\": [";
    for (size_t k = 0; k < e.options.size(); ++k) {
      const OptionSpec& o = e.options[k];
      out += (k ? ", " : "") + std::string("{\"name\": ") + json_string(o.name) +
             ", \"type\": " + json_string(option_type_name(o.type)) +
             ", \"default\": " + json_value(o.default_value) + ", \"help\": " + json_string(o.help) + "}";
    }
    out += "]}";
  }
  out += rows.empty() ? "]\n}\n" : "\n  ]\n}\n";
  std::cout << out;
}

void print_text(const Registry& reg) {
  const auto rows = reg.rows();
  if (rows.empty()) {
    std::cout << "no plugins found (search folders: see `kiln --help`)\n";
    return;
  }
  size_t name_w = 4, kind_w = 4, version_w = 7;
  for (const auto& r : rows) {
    name_w = std::max(name_w, r.entry->name.size());
    kind_w = std::max(kind_w, std::string_view(plugin_kind_name(r.kind)).size());
    version_w = std::max(version_w, r.entry->version.size());
  }
  auto pad = [](const std::string& s, size_t w) { return s + std::string(w - std::min(w, s.size()), ' '); };
  // Name first and kind second, so `awk '$2 == "backend" {print $1}'` picks backends.
  for (const auto& r : rows) {
    const PluginEntry& e = *r.entry;
    std::cout << pad(e.name, name_w) << "  " << pad(plugin_kind_name(r.kind), kind_w) << "  "
              << pad(e.version, version_w) << "  " << e.summary << "\n";
    const std::string indent(name_w + 2, ' ');
    std::cout << indent << "library: " << library_text(e.library) << "\n";
    std::string label;
    const auto more = extras(reg, r, label);
    if (!label.empty() && !more.empty()) {
      std::string list;
      for (const auto& m : more) list += (list.empty() ? "" : ", ") + m;
      std::cout << indent << label << ": " << list << "\n";
    }
    for (const OptionSpec& o : e.options)
      std::cout << indent << "option " << o.name << ": " << option_type_name(o.type) << " = "
                << option_value_str(o.default_value) << (o.help.empty() ? "" : "  -- " + o.help) << "\n";
  }
}

}  // namespace

int cmd_plugins(Args& args) {
  bool json = false;
  std::vector<std::string> plugin_paths;
  while (!args.done()) {
    if (!args.at_option()) throw UsageError{"plugins: unexpected argument '" + args.positional() + "'"};
    const std::string flag = args.option();
    if (flag == "--json") {
      args.no_value(flag);
      json = true;
    } else if (flag == "--plugin-path") {
      plugin_paths.push_back(args.value(flag));
    } else {
      args.unknown(flag);
    }
  }
  Registry& reg = Registry::global();
  if (Status s = load_plugins_from(plugin_paths, reg); !s.ok()) return report(s);
  json ? print_json(reg) : print_text(reg);
  return kExitOk;
}

}  // namespace kiln::cli
