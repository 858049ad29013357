// `kiln ops`: the op catalogue (core ops and those plugins add) as text, JSON or Markdown.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "cli.h"
#include "kiln/core/driver.h"
#include "kiln/core/loader.h"
#include "kiln/ir/op.h"
#include "kiln/version.h"

namespace kiln::cli {

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kOpsUsage =
    R"(usage: kiln ops [NAME]... [--json | --markdown] [--core] [--plugin-path DIR]...

List every registered op (Kiln's core set and those the loaded plugins add), or only the named
ones: operands, results and the rule that gives their types, attributes (kind, default, whether
required), traits, summary, and the library that registered it when it is not a core op.
Operand marks: "x?" is optional (may be left out at the end), "xs..." takes zero or more values;
a result "ys..." means the node decides how many results it has.

  --json              print JSON instead of text
  --markdown          print Markdown (docs/ops.md is `kiln ops --markdown --core`)
  --core              only Kiln's core ops: load no plugins
  --plugin-path DIR   also load the plugins in DIR (a folder or one plugin file); repeatable
)";

/// Trait names, in bit order.
std::vector<std::string> trait_names(const OpDef& op) {
  static const std::pair<OpTrait, const char*> kNames[] = {
      {kTraitElementwise, "elementwise"}, {kTraitBroadcast, "broadcast"},
      {kTraitReduction, "reduction"},     {kTraitView, "view"},
      {kTraitCommutative, "commutative"}, {kTraitContraction, "contraction"},
      {kTraitConstant, "constant"},       {kTraitHasRegions, "has-regions"},
      {kTraitSideEffects, "side-effects"}};
  std::vector<std::string> out;
  for (const auto& [bit, name] : kNames)
    if (op.has(bit)) out.push_back(name);
  return out;
}

std::string join(const std::vector<std::string>& items, const std::string& sep = ", ") {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

/// The shortest text that reads back as `v`.
std::string float_text(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

/// An attribute value as .kir writes it: 1, 0.5, "none", [1, 2], f32.
std::string attr_text(const Attribute& a) {
  auto list = [](const auto& items, auto item) {
    std::vector<std::string> parts;
    for (const auto& x : items) parts.push_back(item(x));
    return "[" + join(parts) + "]";
  };
  switch (a.kind()) {
    case AttrKind::kInt: return std::to_string(a.as_int());
    case AttrKind::kFloat: return float_text(a.as_float());
    case AttrKind::kString: return "\"" + a.as_string() + "\"";
    case AttrKind::kInts: return list(a.as_ints(), [](int64_t x) { return std::to_string(x); });
    case AttrKind::kFloats: return list(a.as_floats(), float_text);
    case AttrKind::kStrings:
      return list(a.as_strings(), [](const std::string& s) { return "\"" + s + "\""; });
    case AttrKind::kTensor: return a.as_tensor().type().str();
    case AttrKind::kDType: return std::string(dtype_name(a.as_dtype()));
  }
  return "?";
}

/// An attribute value as JSON.
std::string attr_json(const Attribute& a) {
  auto list = [](const auto& items, auto item) {
    std::vector<std::string> parts;
    for (const auto& x : items) parts.push_back(item(x));
    return "[" + join(parts) + "]";
  };
  // JSON has no nan or inf: give those as text.
  auto number = [](double v) {
    return std::isfinite(v) ? float_text(v) : json_string(float_text(v));
  };
  switch (a.kind()) {
    case AttrKind::kInt: return std::to_string(a.as_int());
    case AttrKind::kFloat: return number(a.as_float());
    case AttrKind::kString: return json_string(a.as_string());
    case AttrKind::kInts: return list(a.as_ints(), [](int64_t x) { return std::to_string(x); });
    case AttrKind::kFloats: return list(a.as_floats(), number);
    case AttrKind::kStrings:
      return list(a.as_strings(), [](const std::string& s) { return json_string(s); });
    case AttrKind::kTensor: return json_string(a.as_tensor().type().str());
    case AttrKind::kDType: return json_string(dtype_name(a.as_dtype()));
  }
  return "null";
}

/// "int = 0", "dtype, required", "ints, optional": an attribute's kind and default.
std::string attr_spec_text(const AttrSpec& a) {
  std::string out = attr_kind_name(a.kind);
  if (a.default_value) return out + " = " + attr_text(*a.default_value);
  return out + (a.required ? ", required" : ", optional");
}

std::string library_of(const OpDef& op) { return op.library.empty() ? "core" : op.library; }

/// "1 result", "no results", "variadic results".
std::string result_count(const OpDef& op) {
  const int n = op.fixed_outputs();
  if (n < 0) return "variadic results";
  return n == 0 ? "no results" : n == 1 ? "1 result" : std::to_string(n) + " results";
}

void print_text(const std::vector<const OpDef*>& ops) {
  size_t width = 0;
  for (const OpDef* op : ops) width = std::max(width, op->name.size());
  const std::string indent(width + 2, ' ');
  for (const OpDef* op : ops) {
    std::cout << op->name << std::string(width + 2 - op->name.size(), ' ') << op->summary << "\n";
    std::cout << indent << "operands: " << (op->inputs.empty() ? "none" : join(op->inputs)) << "\n";
    std::cout << indent << "results: " << (op->outputs.empty() ? "none" : join(op->outputs)) << " ("
              << result_count(*op) << "): " << op->result_rule << "\n";
    for (const AttrSpec& a : op->attrs)
      std::cout << indent << "attribute " << a.name << ": " << attr_spec_text(a)
                << (a.doc.empty() ? "" : "  -- " + a.doc) << "\n";
    if (op->num_regions > 0) std::cout << indent << "regions: " << op->num_regions << "\n";
    if (op->traits != kTraitNone)
      std::cout << indent << "traits: " << join(trait_names(*op)) << "\n";
    if (!op->library.empty()) std::cout << indent << "library: " << op->library << "\n";
  }
}

/// Operand or result names with their marks taken apart: {"name": "bias", "optional": true, ...}.
std::string json_names(const std::vector<std::string>& names) {
  std::vector<std::string> parts;
  for (std::string n : names) {
    const bool variadic = n.ends_with("..."), optional = n.ends_with("?");
    n.resize(n.size() - (variadic ? 3 : optional ? 1 : 0));
    parts.push_back("{\"name\": " + json_string(n) +
                    ", \"optional\": " + (optional ? "true" : "false") +
                    ", \"variadic\": " + (variadic ? "true" : "false") + "}");
  }
  return "[" + join(parts) + "]";
}

void print_json(const std::vector<const OpDef*>& ops) {
  std::string out = "{\n  \"kiln\": \"" KILN_VERSION_STRING "\",\n  \"ops\": [";
  for (size_t i = 0; i < ops.size(); ++i) {
    const OpDef& op = *ops[i];
    std::vector<std::string> attrs, traits;
    for (const AttrSpec& a : op.attrs)
      attrs.push_back("{\"name\": " + json_string(a.name) +
                      ", \"kind\": " + json_string(attr_kind_name(a.kind)) +
                      ", \"required\": " + (a.required ? "true" : "false") +
                      ", \"default\": " + (a.default_value ? attr_json(*a.default_value) : "null") +
                      ", \"doc\": " + json_string(a.doc) + "}");
    for (const std::string& t : trait_names(op)) traits.push_back(json_string(t));
    const int fixed = op.fixed_outputs();
    out += i ? ",\n" : "\n";
    out += "    {\"name\": " + json_string(op.name) + ", \"summary\": " + json_string(op.summary) +
           ", \"library\": " + json_string(library_of(op)) +
           ", \"operands\": " + json_names(op.inputs) + ", \"results\": " + json_names(op.outputs) +
           ", \"num_results\": " + (fixed < 0 ? "null" : std::to_string(fixed)) +
           ", \"result_rule\": " + json_string(op.result_rule) + ", \"attributes\": [" +
           join(attrs) + "], \"traits\": [" + join(traits) +
           "], \"regions\": " + std::to_string(op.num_regions) + "}";
  }
  out += ops.empty() ? "]\n}\n" : "\n  ]\n}\n";
  std::cout << out;
}

/// Text for a Markdown table cell: pipes escaped, so "|x|" stays in its cell.
std::string md(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

std::string md_code_list(const std::vector<std::string>& names) {
  if (names.empty()) return "none";
  std::vector<std::string> parts;
  for (const std::string& n : names) parts.push_back("`" + n + "`");
  return join(parts);
}

void print_markdown(const std::vector<const OpDef*>& ops, bool core_only) {
  std::string out = "# Kiln ops\n\n";
  out += core_only
             ? "Kiln's core op set, generated by `kiln ops --markdown --core` from the op table\n"
               "(`ir/src/ops/*.cpp`). Do not edit: after changing an op, run "
               "`scripts/gen-ops-doc.sh`\n"
               "(or `make docs`); the `docs_ops_md` test fails while this file is out of date.\n"
             : "Generated by `kiln ops --markdown` from the op table.\n";
  out +=
      "Plugins add ops of their own: `kiln ops` lists those too, with the library that registered "
      "each.\n\n"
      "Operand marks: `x?` is optional (may be left out at the end), `xs...` takes zero or more\n"
      "values; a result `ys...` means the node decides how many results it has. In result rules\n"
      "`[.., M, N]` is a shape whose leading dims `..` are the batch dims.\n\n";
  out += std::to_string(ops.size()) + " ops.\n\n| op | summary |\n|---|---|\n";
  for (const OpDef* op : ops)
    out += "| [`" + op->name + "`](#" + op->name + ") | " + md(op->summary) + " |\n";
  for (const OpDef* op : ops) {
    out += "\n## " + op->name + "\n\n" + md(op->summary) + "\n\n| | |\n|---|---|\n";
    out += "| operands | " + md_code_list(op->inputs) + " |\n";
    out += "| results | " + md_code_list(op->outputs) + " (" + result_count(*op) + ") |\n";
    out += "| result rule | " + md(op->result_rule) + " |\n";
    if (op->num_regions > 0) out += "| regions | " + std::to_string(op->num_regions) + " |\n";
    out += "| traits | " +
           (op->traits == kTraitNone ? std::string("none") : join(trait_names(*op))) + " |\n";
    if (!op->library.empty()) out += "| library | `" + op->library + "` |\n";
    if (op->attrs.empty()) continue;
    out += "\n| attribute | kind | default | meaning |\n|---|---|---|---|\n";
    for (const AttrSpec& a : op->attrs)
      out += "| `" + a.name + "` | " + attr_kind_name(a.kind) + " | " +
             (a.default_value ? "`" + md(attr_text(*a.default_value)) + "`"
              : a.required    ? "required"
                              : "optional") +
             " | " + md(a.doc) + " |\n";
  }
  std::cout << out;
}

}  // namespace

std::string ops_usage() { return std::string(kOpsUsage); }

int cmd_ops(Args& args) {
  bool json = false, markdown = false, core_only = false;
  std::vector<std::string> plugin_paths, names;
  while (!args.done()) {
    if (!args.at_option()) {
      names.push_back(args.positional());
      continue;
    }
    const std::string flag = args.option();
    if (flag == "--json" || flag == "--markdown" || flag == "--core") {
      args.no_value(flag);
      (flag == "--json" ? json : flag == "--markdown" ? markdown : core_only) = true;
    } else if (flag == "--plugin-path") {
      plugin_paths.push_back(args.value(flag));
    } else {
      args.unknown(flag);
    }
  }
  if (json && markdown) throw UsageError{"ops: give --json or --markdown, not both"};
  if (core_only && !plugin_paths.empty())
    throw UsageError{"ops: --core loads no plugins; drop --plugin-path"};
  if (!core_only) {
    Registry& reg = Registry::global();
    if (Status s = load_plugins_from(plugin_paths, reg); !s.ok()) return report(s);
  }
  std::vector<const OpDef*> ops;
  if (names.empty()) {
    ops = OpRegistry::global().all();
  } else {
    std::set<std::string> seen;
    for (const std::string& n : names) {
      const OpDef* op = OpRegistry::global().find(n);
      if (op == nullptr)
        return report(not_found("unknown op '" + n + "'" +
                                (core_only ? "; without --core, plugins may add it" : "") +
                                " (run `kiln ops` for the list)"));
      if (seen.insert(n).second) ops.push_back(op);
    }
  }
  if (json)
    print_json(ops);
  else if (markdown)
    print_markdown(ops, core_only);
  else
    print_text(ops);
  return kExitOk;
}

}  // namespace kiln::cli
