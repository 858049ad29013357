// `kiln plan`: the automatic parallelism planner on a model, without compiling it: which mesh
// and strategy it would choose for N devices, and its predictions for each candidate.
#include <charconv>
#include <iostream>

#include "cli.h"
#include "planner.h"

namespace kiln::cli {

namespace {

constexpr std::string_view kPlan = R"(usage: kiln plan MODEL --devices N [--objective throughput|memory] [--memory-limit SIZE]
                 [--device h200|h100] [--probe PROBE.toml] [--sym NAME=SIZE]... [--json] [options]

Choose how to split MODEL over N devices, as `[parallel] strategy = "auto"` would: every dp x tp
mesh of N devices, with and without sequence parallelism, and which weights to split, each
partitioned and costed per rank (FLOPs and bytes against a roofline, collectives as ring
algorithms, memory = weights + peak live activations). Prints the choice, its predicted step
time and memory per rank, and the runners-up. See docs/parallel.md.

  --devices N             devices (ranks) to split over
  --objective OBJ         throughput (shortest step, the default) or memory (smallest per rank)
  --memory-limit SIZE     most memory a rank may use, e.g. 80GiB, 16GB, 512MiB
  --device NAME           the cost model's preset: h200 (default) or h100
  --probe FILE.toml       measured rates (bench/parallel/probe.py) replacing the preset's
  --sym NAME=SIZE         size of a symbolic dim, for costing (default 64); repeatable
  --batch-dim D           the inputs' batch dim (default 0)
  --sequence-dim D        the activations' sequence dim, for sequence parallelism (default 1)
  --top K                 runners-up to print (default 4)
  --json                  print every candidate as JSON instead
  --passes LIST           passes before planning (default "canonicalize,cse")
  --pipeline FILE.toml    or a pipeline's passes before its [parallel] section
  --plugin-path DIR       also load the plugins in DIR; repeatable
)";

int64_t parse_int(const std::string& flag, const std::string& text, int64_t least) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || text.empty() || v < least)
    throw UsageError{"plan: " + flag + " expects an integer >= " + std::to_string(least) + ", got '" + text + "'"};
  return v;
}

}  // namespace

StatusOr<std::unique_ptr<Graph>> prepare_model(const std::string& model, const std::string& pipeline_file,
                                               const std::string& passes, const std::map<std::string, int64_t>& symbols,
                                               const std::vector<std::string>& plugin_paths, bool before_strategy) {
  Registry& reg = Registry::global();
  KILN_RETURN_IF_ERROR(load_plugins_from(plugin_paths, reg));
  Pipeline p;
  if (!pipeline_file.empty()) {
    KILN_ASSIGN_OR_RETURN(p, load_pipeline_with_plugins(pipeline_file, reg));
  } else {
    auto list = parse_pass_list(passes, reg);
    if (!list.ok()) return list.status().with_context("--passes");
    p.passes = std::move(*list);
  }
  if (before_strategy)
    for (size_t i = 0; i < p.passes.size(); ++i)
      if (p.passes[i].parallel) {
        if (pipeline_file.empty())
          return invalid_argument("--passes: '" + p.passes[i].name + "' is a parallel strategy; kiln plan chooses one");
        p.passes.resize(i);  // the graph the pipeline's own strategy would see
        break;
      }
  KILN_RETURN_IF_ERROR(resolve_pipeline_defaults(p, reg, model, /*need_backend=*/false));
  forward_symbols_to_frontend(p.frontend, symbols, reg);
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Graph> g, import_model(model, p.frontend, reg));
  KILN_RETURN_IF_ERROR(run_pipeline_passes(*g, p, reg, {}));
  return g;
}

std::string plan_usage() { return std::string(kPlan); }

int cmd_plan(Args& args) {
  std::string model, pipeline_file, passes = "canonicalize,cse";
  std::vector<std::string> plugin_paths;
  std::map<std::string, OptionValue> given;
  std::map<std::string, int64_t> symbols;
  std::vector<std::string> dims;
  bool json = false, devices_given = false;
  int top = 4;
  while (!args.done()) {
    if (!args.at_option()) {
      if (!model.empty()) throw UsageError{"plan: more than one model ('" + model + "', '" + args.positional() + "')"};
      model = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (flag == "--devices") {
      given["devices"] = parse_int(flag, args.value(flag), 1);
      devices_given = true;
    } else if (flag == "--objective" || flag == "--memory-limit" || flag == "--device" || flag == "--probe") {
      given[flag.substr(2)] = args.value(flag);
    } else if (flag == "--batch-dim" || flag == "--sequence-dim") {
      given[flag.substr(2)] = parse_int(flag, args.value(flag), 0);
    } else if (flag == "--sym") {
      const std::string v = args.value(flag);
      const size_t eq = v.find('=');
      if (eq == 0 || eq == std::string::npos) throw UsageError{"--sym expects NAME=SIZE, got '" + v + "'"};
      symbols[v.substr(0, eq)] = parse_int("--sym " + v.substr(0, eq), v.substr(eq + 1), 1);
      dims.push_back(v);
    } else if (flag == "--top") {
      top = static_cast<int>(parse_int(flag, args.value(flag), 0));
    } else if (flag == "--json") {
      args.no_value(flag);
      json = true;
    } else if (flag == "--passes") {
      passes = args.value(flag);
    } else if (flag == "--pipeline") {
      pipeline_file = args.value(flag);
    } else if (flag == "--plugin-path") {
      plugin_paths.push_back(args.value(flag));
    } else {
      args.unknown(flag);
    }
  }
  if (model.empty()) throw UsageError{"plan: no model given"};
  if (!devices_given) throw UsageError{"plan: --devices N is required"};
  given["dims"] = dims;

  auto options = resolve_options(parallel::planner_option_specs(), given, "kiln plan");
  if (!options.ok()) return report(options.status());
  auto planner = parallel::planner_options(*options);
  if (!planner.ok()) return report(planner.status());

  auto g = prepare_model(model, pipeline_file, passes, symbols, plugin_paths, /*before_strategy=*/true);
  if (!g.ok()) return report(g.status());
  auto plan = parallel::make_plan(**g, *planner);
  if (!plan.ok()) return report(plan.status());
  std::cout << (json ? parallel::plan_json(*plan) : parallel::format_plan(*plan, top));
  std::cout.flush();
  return std::cout ? kExitOk : report(io_error("cannot write to stdout"));
}

}  // namespace kiln::cli
