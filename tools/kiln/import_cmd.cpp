// `kiln import`: read a model with a front end (by extension or --frontend) and write it as .kir.
#include <charconv>
#include <iostream>
#include <map>
#include <memory>

#include "cli.h"
#include "kiln/core/driver.h"
#include "kiln/ir/text.h"

namespace kiln::cli {

namespace {

constexpr std::string_view kImport = R"(usage: kiln import IN [-o OUT.kir] [--frontend NAME] [--frontend-option KEY=VALUE]...
                   [--plugin-path DIR]...

Read the model IN with a front end (picked by IN's extension, e.g. .onnx, unless --frontend
names one), verify it, and print it as .kir to OUT (large constants then go to OUT.bin) or to
stdout. No passes run: the result is what the front end produced.

  -o, --output OUT.kir          write the result here instead of stdout
  --frontend NAME               read IN with this front end
  --frontend-option KEY=VALUE   set one of the front end's options (see `kiln plugins`);
                                lists are comma-separated; repeatable
  --plugin-path DIR             also load the plugins in DIR (a folder or one plugin file)
)";

/// Converts `text` to the option's declared type.
StatusOr<OptionValue> parse_option(const OptionSpec& spec, const std::string& text) {
  auto split = [](const std::string& s) {
    std::vector<std::string> parts;
    for (size_t p = 0; p <= s.size();) {
      const size_t q = std::min(s.find(',', p), s.size());
      if (q > p) parts.push_back(s.substr(p, q - p));
      p = q + 1;
    }
    return parts;
  };
  auto integer = [&](const std::string& s) -> StatusOr<int64_t> {
    int64_t v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || p != s.data() + s.size() || s.empty())
      return invalid_argument("option '" + spec.name + "' must be an integer, got '" + s + "'");
    return v;
  };
  switch (spec.type) {
    case OptionType::kBool:
      if (text == "true" || text == "1") return OptionValue(true);
      if (text == "false" || text == "0") return OptionValue(false);
      return invalid_argument("option '" + spec.name + "' must be true or false, got '" + text + "'");
    case OptionType::kInt: {
      KILN_ASSIGN_OR_RETURN(int64_t v, integer(text));
      return OptionValue(v);
    }
    case OptionType::kFloat: {
      try {
        size_t used = 0;
        const double v = std::stod(text, &used);
        if (used == text.size()) return OptionValue(v);
      } catch (const std::exception&) {
      }
      return invalid_argument("option '" + spec.name + "' must be a number, got '" + text + "'");
    }
    case OptionType::kString: return OptionValue(text);
    case OptionType::kStringList: return OptionValue(split(text));
    case OptionType::kIntList: {
      std::vector<int64_t> v;
      for (const std::string& s : split(text)) {
        KILN_ASSIGN_OR_RETURN(int64_t x, integer(s));
        v.push_back(x);
      }
      return OptionValue(v);
    }
  }
  return internal_error("unknown option type");
}

}  // namespace

std::string import_usage() { return std::string(kImport); }

int cmd_import(Args& args) {
  std::string model, output, frontend;
  std::vector<std::string> plugin_paths;
  std::vector<std::pair<std::string, std::string>> options;  // key, text
  while (!args.done()) {
    if (!args.at_option()) {
      if (!model.empty()) throw UsageError{"import: more than one input model ('" + model + "', '" + args.positional() + "')"};
      model = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (flag == "-o" || flag == "--output") {
      output = args.value(flag);
    } else if (flag == "--frontend") {
      frontend = args.value(flag);
    } else if (flag == "--plugin-path") {
      plugin_paths.push_back(args.value(flag));
    } else if (flag == "--frontend-option") {
      const std::string kv = args.value(flag);
      const size_t eq = kv.find('=');
      if (eq == 0 || eq == std::string::npos) throw UsageError{"--frontend-option expects KEY=VALUE, got '" + kv + "'"};
      options.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
    } else {
      args.unknown(flag);
    }
  }
  if (model.empty()) throw UsageError{"import: no input model given"};

  Registry& reg = Registry::global();
  if (Status s = load_plugins_from(plugin_paths, reg); !s.ok()) return report(s);
  auto fe = frontend.empty() ? reg.frontend_for_path(model) : reg.frontend(frontend);
  if (!fe.ok()) return report(fe.status());
  std::map<std::string, OptionValue> given;
  for (const auto& [key, text] : options) {
    const OptionSpec* spec = nullptr;
    for (const OptionSpec& o : (*fe)->options)
      if (o.name == key) spec = &o;
    if (!spec) {
      // resolve_options names the known options in its error.
      given[key] = OptionValue(text);
      continue;
    }
    auto v = parse_option(*spec, text);
    if (!v.ok()) return report(v.status().with_context("frontend '" + (*fe)->name + "'"));
    given[key] = std::move(*v);
  }
  StageSpec stage{(*fe)->name, {}, {}};
  auto opts = resolve_options((*fe)->options, given, "frontend '" + (*fe)->name + "'");
  if (!opts.ok()) return report(opts.status());
  stage.options = std::move(*opts);
  auto g = import_model(model, stage, reg);
  if (!g.ok()) return report(g.status());
  if (output.empty()) {
    std::cout << print_graph(**g);
    std::cout.flush();
    return std::cout ? kExitOk : report(io_error("cannot write to stdout"));
  }
  PrintOptions po;
  po.side_file = output + ".bin";
  if (Status s = print_graph_to_file(**g, output, po); !s.ok()) return report(s);
  return kExitOk;
}

}  // namespace kiln::cli
