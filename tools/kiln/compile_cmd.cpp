// `kiln opt` and `kiln run`: import a model, run a pipeline's passes, then print or execute it.
#include <charconv>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <set>

#include "cli.h"
#include "kiln/core/driver.h"
#include "kiln/core/npy.h"
#include "kiln/ir/text.h"

namespace kiln::cli {

namespace {

struct Flags {
  std::string model;
  std::string pipeline_file;
  std::optional<std::string> passes;
  std::string frontend;
  std::vector<std::string> plugin_paths;
  std::string weights;  ///< --weights DIR: a checkpoint replacing the model's constants
  PassManagerOptions pm;
  // opt
  std::string output_file;
  std::string reproducer;  ///< --reproducer FILE: replay it instead of reading a model
  // run
  std::string backend;
  std::vector<std::pair<std::string, std::string>> inputs, outputs;  // name, file
  bool random_inputs = false;
  uint64_t seed = 0;
  std::map<std::string, int64_t> symbols;
  double collective_timeout_s = 300;  ///< per-rank programs on a cuda backend
};

template <typename T>
T parse_number(const std::string& text, const std::string& what) {
  T v{};
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || text.empty())
    throw UsageError{what + " must be an integer, got '" + text + "'"};
  return v;
}

/// "NAME=@FILE" → {NAME, FILE}.
std::pair<std::string, std::string> name_at_file(const std::string& text, const std::string& flag) {
  const size_t eq = text.find('=');
  if (eq == 0 || eq == std::string::npos || eq + 1 >= text.size() || text[eq + 1] != '@' || eq + 2 == text.size())
    throw UsageError{flag + " expects NAME=@FILE.npy, got '" + text + "'"};
  return {text.substr(0, eq), text.substr(eq + 2)};
}

/// Reads the flags `opt` and `run` share; false when `flag` is not one of them.
bool common_flag(const std::string& flag, Args& args, Flags& f) {
  if (flag == "--pipeline") f.pipeline_file = args.value(flag);
  else if (flag == "--passes") f.passes = args.value(flag);
  else if (flag == "--frontend") f.frontend = args.value(flag);
  else if (flag == "--plugin-path") f.plugin_paths.push_back(args.value(flag));
  else if (flag == "--weights") f.weights = args.value(flag);
  else return pass_manager_flag(flag, args, f.pm);
  return true;
}

void check_common(const Flags& f, const std::string& command) {
  if (f.model.empty()) throw UsageError{command + ": no input model given"};
  if (!f.pipeline_file.empty() && f.passes) throw UsageError{command + ": give --pipeline or --passes, not both"};
}

/// Loads the plugins a reproducer names, then its pipeline, into `p`. The IR below the header
/// is the model: its front end is picked by the file's extension (.kir), whichever front end
/// read the original model.
Status load_reproducer(const Flags& f, Pipeline& p) {
  KILN_ASSIGN_OR_RETURN(Reproducer r, read_reproducer(f.reproducer));
  for (const auto& d : r.plugin_paths) {
    std::error_code ec;
    if (!std::filesystem::exists(d, ec))
      return not_found(f.reproducer + ": plugin path '" + d +
                       "' recorded in the reproducer does not exist; restore it, or edit the "
                       "reproducer's plugin-paths line");
  }
  std::vector<std::string> dirs = r.plugin_paths;
  dirs.insert(dirs.end(), f.plugin_paths.begin(), f.plugin_paths.end());
  Registry& reg = Registry::global();
  KILN_RETURN_IF_ERROR(load_plugins_from(dirs, reg));
  auto recorded = parse_pipeline_string(r.pipeline, reg);
  if (!recorded.ok()) return recorded.status().with_context(f.reproducer + ": its pipeline");
  p = std::move(*recorded);
  p.frontend = {};
  return ok_status();
}

/// Loads plugins and the pipeline, imports the model and runs the passes.
StatusOr<std::unique_ptr<Graph>> optimize(const Flags& f, Pipeline& p, bool need_backend) {
  Registry& reg = Registry::global();
  if (!f.reproducer.empty()) {
    KILN_RETURN_IF_ERROR(load_reproducer(f, p));  // cmd_opt refused --pipeline and --passes
  } else {
    KILN_RETURN_IF_ERROR(load_plugins_from(f.plugin_paths, reg));
  }
  PipelineRequest r{f.model, f.pipeline_file, f.passes, f.frontend, f.backend, f.symbols, need_backend};
  KILN_RETURN_IF_ERROR(prepare_pipeline(r, reg, p));
  auto load_weights = [&](Graph& g) { return f.weights.empty() ? ok_status() : load_checkpoint_weights(g, f.weights); };
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Graph> g, import_and_run_passes(f.model, p, reg, f.pm, load_weights));
  return g;
}

}  // namespace

bool pass_manager_flag(const std::string& flag, Args& args, PassManagerOptions& pm) {
  if (flag == "--reproducer-dir") pm.reproducer_dir = args.value(flag);
  else if (flag == "--timing") { args.no_value(flag); pm.timing = true; }
  else if (flag == "--print-ir-after-all") { args.no_value(flag); pm.print_ir_after_all = true; }
  else if (flag == "--print-ir-after-change") { args.no_value(flag); pm.print_ir_after_change = true; }
  else if (flag == "--no-verify-each") { args.no_value(flag); pm.verify_each = false; }
  else return false;
  return true;
}

int cmd_opt(Args& args) {
  Flags f;
  while (!args.done()) {
    if (!args.at_option()) {
      if (!f.model.empty()) throw UsageError{"opt: more than one input model ('" + f.model + "', '" + args.positional() + "')"};
      f.model = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (common_flag(flag, args, f)) continue;
    if (flag == "-o" || flag == "--output") f.output_file = args.value(flag);
    else if (flag == "--reproducer") f.reproducer = args.value(flag);
    else args.unknown(flag);
  }
  if (!f.reproducer.empty()) {
    // The reproducer is the model and names its own pipeline.
    if (!f.model.empty()) throw UsageError{"opt: give IN or --reproducer, not both"};
    if (!f.pipeline_file.empty() || f.passes || !f.frontend.empty())
      throw UsageError{
          "opt: --reproducer replays the pipeline it records; drop --pipeline, --passes and "
          "--frontend"};
    f.model = f.reproducer;
  }
  check_common(f, "opt");

  Pipeline p;
  auto g = optimize(f, p, /*need_backend=*/false);
  if (!g.ok()) return report(g.status());
  if (!f.reproducer.empty()) {
    auto r = read_reproducer(f.reproducer);
    if (r.ok() && !r->failure.empty())
      note("the reproducer recorded a failure (" + r->failure + "); this run passed");
  }
  if (f.output_file.empty()) {
    std::cout << print_graph(**g);
    std::cout.flush();
    return std::cout ? kExitOk : report(io_error("cannot write to stdout"));
  }
  PrintOptions po;
  po.side_file = f.output_file + ".bin";
  if (Status s = print_graph_to_file(**g, f.output_file, po); !s.ok()) return report(s);
  return kExitOk;
}

int cmd_run(Args& args) {
  Flags f;
  while (!args.done()) {
    if (!args.at_option()) {
      if (!f.model.empty()) throw UsageError{"run: more than one input model ('" + f.model + "', '" + args.positional() + "')"};
      f.model = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (common_flag(flag, args, f)) continue;
    if (flag == "--backend") {
      f.backend = args.value(flag);
    } else if (flag == "--input") {
      f.inputs.push_back(name_at_file(args.value(flag), flag));
    } else if (flag == "--output") {
      f.outputs.push_back(name_at_file(args.value(flag), flag));
    } else if (flag == "--random-inputs") {
      args.no_value(flag);
      f.random_inputs = true;
    } else if (flag == "--seed") {
      f.seed = parse_number<uint64_t>(args.value(flag), "--seed");
    } else if (flag == "--collective-timeout") {
      f.collective_timeout_s = static_cast<double>(parse_number<int64_t>(args.value(flag), "--collective-timeout"));
      if (f.collective_timeout_s < 1) throw UsageError{"--collective-timeout must be at least 1 second"};
    } else if (flag == "--sym") {
      const std::string v = args.value(flag);
      const size_t eq = v.find('=');
      if (eq == 0 || eq == std::string::npos) throw UsageError{"--sym expects NAME=VALUE, got '" + v + "'"};
      if (!f.symbols.emplace(v.substr(0, eq), parse_number<int64_t>(v.substr(eq + 1), "--sym " + v.substr(0, eq))).second)
        throw UsageError{"--sym " + v.substr(0, eq) + " given twice"};
    } else {
      args.unknown(flag);
    }
  }
  check_common(f, "run");
  std::set<std::string> seen;
  for (const auto& [name, file] : f.inputs)
    if (!seen.insert(name).second) throw UsageError{"--input " + name + " given twice"};
  seen.clear();
  for (const auto& [name, file] : f.outputs)
    if (!seen.insert(name).second) throw UsageError{"--output " + name + " given twice"};

  Pipeline p;
  auto g = optimize(f, p, /*need_backend=*/true);
  if (!g.ok()) return report(g.status());
  const Graph& graph = **g;

  std::map<std::string, std::string> output_files(f.outputs.begin(), f.outputs.end());
  for (const auto& [name, file] : output_files) {
    bool found = false;
    std::string known;
    for (int i = 0; i < graph.num_outputs(); ++i) {
      found = found || graph_output_name(graph, i) == name;
      known += (i ? ", " : "") + graph_output_name(graph, i);
    }
    if (!found)
      return report(not_found("graph '" + graph.name() + "' has no output '" + name + "'; its outputs: " + known));
  }

  InputBindings b;
  b.random = f.random_inputs;
  b.seed = f.seed;
  b.symbols = f.symbols;
  for (const auto& [name, file] : f.inputs) {
    std::optional<DType> want;
    for (int i = 0; i < graph.num_inputs(); ++i)
      if (graph_input_name(graph, i) == name) want = graph.input(i)->dtype();
    auto t = read_npy(file, want);
    if (!t.ok()) return report(t.status().with_context("input '" + name + "'"));
    b.given.emplace(name, std::move(*t));
  }
  // A per-rank program takes whole inputs, cut into each rank's piece (mesh_run_cmd.cpp).
  if (graph.is_per_rank() && !graph.mesh().empty())
    return run_per_rank(graph, p, b, output_files, f.collective_timeout_s);
  std::vector<std::string> notes;
  auto inputs = bind_inputs(graph, b, &notes);
  if (!inputs.ok()) return report(inputs.status());
  for (const auto& n : notes) note(n);

  auto outs = compile_and_run(graph, p.backend, Registry::global(), *inputs);
  if (!outs.ok()) return report(outs.status());
  return print_outputs(graph, *outs, output_files);
}

int print_outputs(const Graph& graph, const std::vector<Tensor>& outs, const std::map<std::string, std::string>& files) {
  for (int i = 0; i < graph.num_outputs(); ++i) {
    const std::string name = graph_output_name(graph, i);
    const Tensor& t = outs[static_cast<size_t>(i)];
    auto file = files.find(name);
    if (file != files.end()) {
      if (Status s = write_npy(file->second, t); !s.ok()) return report(s);
      continue;
    }
    std::cout << name << ": " << t.type().str() << "\n" << format_tensor(t) << "\n";
  }
  std::cout.flush();
  return std::cout ? kExitOk : report(io_error("cannot write to stdout"));
}

}  // namespace kiln::cli
