// `kiln calibrate`: runs a model on the reference interpreter over sample inputs and records the
// largest |x| of every matmul/linear activation input, the scales file quantize-fp8 reads.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "kiln/core/npy.h"
#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "quant_cli.h"

namespace kiln::cli {

namespace fs = std::filesystem;

namespace {

bool is_quant_pass(const std::string& name) {
  return name.starts_with("quantize-") || name.starts_with("convert-");
}

int64_t parse_count(const std::string& text, const std::string& what) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || text.empty() || v < 0)
    throw UsageError{what + " must be a non-negative integer, got '" + text + "'"};
  return v;
}

constexpr std::string_view kUsage = R"(usage: kiln calibrate MODEL [--pipeline FILE.toml | --passes LIST]
                      (--inputs DIR | --random-inputs N) [--seed N] [--sym NAME=VALUE]... -o SCALES.json

Run MODEL on the reference interpreter over sample inputs and write, for every activation that
feeds a matmul or linear, its largest magnitude max|x| (the quantize-fp8 pass's static scales:
scale = amax / 448 for E4M3). With a pipeline, the passes before its first quantize-*/convert-*
pass run first, so the value names match what quantize-fp8 sees.

  --inputs DIR          one input set per sub-folder of DIR (or DIR itself) with NAME.npy or
                        input_NAME.npy per graph input
  --random-inputs N     N seeded pseudo-random input sets instead
  --seed N              first seed for --random-inputs (default 0)
  --sym NAME=VALUE      size of symbolic dimension NAME
  -o, --output FILE     the scales file to write
  --plugin-path DIR     also load the plugins in DIR; repeatable
)";

}  // namespace

std::string calibrate_usage() { return std::string(kUsage); }

bool quant_flag(const std::string& flag, Args& args, QuantFlags& f) {
  if (flag == "--pipeline") f.pipeline_file = args.value(flag);
  else if (flag == "--passes") f.passes = args.value(flag);
  else if (flag == "--plugin-path") f.plugin_paths.push_back(args.value(flag));
  else if (flag == "--inputs") f.inputs_dir = args.value(flag);
  else if (flag == "--random-inputs") f.random_samples = parse_count(args.value(flag), flag);
  else if (flag == "--seed") f.seed = static_cast<uint64_t>(parse_count(args.value(flag), flag));
  else if (flag == "-o" || flag == "--output") f.output = args.value(flag);
  else if (flag == "--sym") {
    const std::string v = args.value(flag);
    const size_t eq = v.find('=');
    if (eq == 0 || eq == std::string::npos) throw UsageError{"--sym expects NAME=VALUE, got '" + v + "'"};
    f.symbols[v.substr(0, eq)] = parse_count(v.substr(eq + 1), "--sym " + v.substr(0, eq));
  } else {
    return false;
  }
  return true;
}

Status prepare_graphs(const QuantFlags& f, std::unique_ptr<Graph>* reference, std::unique_ptr<Graph>* quantized) {
  Registry& reg = Registry::global();
  KILN_RETURN_IF_ERROR(load_plugins_from(f.plugin_paths, reg));
  Pipeline p;
  if (!f.pipeline_file.empty()) {
    KILN_ASSIGN_OR_RETURN(p, load_pipeline_with_plugins(f.pipeline_file, reg));
  } else if (f.passes) {
    auto passes = parse_pass_list(*f.passes, reg);
    if (!passes.ok()) return passes.status().with_context("--passes");
    p.passes = std::move(*passes);
  }
  KILN_RETURN_IF_ERROR(resolve_pipeline_defaults(p, reg, f.model, /*need_backend=*/false));
  forward_symbols_to_frontend(p.frontend, f.symbols, reg);
  size_t first = p.passes.size(), last = 0;
  for (size_t i = 0; i < p.passes.size(); ++i)
    if (is_quant_pass(p.passes[i].name)) first = std::min(first, i), last = i + 1;
  if (quantized && first == p.passes.size())
    return invalid_argument("the pipeline has no quantize-* or convert-* pass; nothing to compare");
  Pipeline before = p, upto = p;
  before.passes.assign(p.passes.begin(), p.passes.begin() + static_cast<std::ptrdiff_t>(first));
  upto.passes.assign(p.passes.begin(), p.passes.begin() + static_cast<std::ptrdiff_t>(last));
  KILN_ASSIGN_OR_RETURN(*reference, import_model(f.model, p.frontend, reg));
  if (quantized) *quantized = (*reference)->clone();
  KILN_RETURN_IF_ERROR(run_pipeline_passes(**reference, before, reg, {}));
  if (quantized) KILN_RETURN_IF_ERROR(run_pipeline_passes(**quantized, upto, reg, {}));
  return ok_status();
}

StatusOr<std::vector<std::vector<Tensor>>> sample_inputs(const Graph& g, const QuantFlags& f) {
  std::vector<std::vector<Tensor>> sets;
  if (f.inputs_dir.empty()) {
    for (int64_t s = 0; s < f.random_samples; ++s) {
      InputBindings b;
      b.random = true;
      b.seed = f.seed + static_cast<uint64_t>(s);
      b.symbols = f.symbols;
      KILN_ASSIGN_OR_RETURN(std::vector<Tensor> in, bind_inputs(g, b));
      sets.push_back(std::move(in));
    }
    return sets;
  }
  std::error_code ec;
  if (!fs::is_directory(f.inputs_dir, ec)) return not_found("--inputs: '" + f.inputs_dir + "' is not a folder");
  std::vector<fs::path> dirs = {f.inputs_dir};
  for (const auto& e : fs::directory_iterator(f.inputs_dir, ec))
    if (e.is_directory()) dirs.push_back(e.path());
  std::sort(dirs.begin() + 1, dirs.end());
  for (const fs::path& d : dirs) {
    InputBindings b;
    b.symbols = f.symbols;
    for (int i = 0; i < g.num_inputs(); ++i) {
      const std::string name = graph_input_name(g, i);
      for (const std::string& file : {name + ".npy", "input_" + name + ".npy"}) {
        if (!fs::exists(d / file)) continue;
        auto t = read_npy((d / file).string(), g.input(i)->dtype());
        if (!t.ok()) return t.status().with_context("input '" + name + "'");
        b.given.emplace(name, std::move(*t));
        break;
      }
    }
    if (b.given.empty()) continue;  // a folder without inputs (e.g. DIR itself holding only sets)
    if (static_cast<int>(b.given.size()) != g.num_inputs())
      return not_found("--inputs: " + d.string() + " lacks some of the graph's " + std::to_string(g.num_inputs()) +
                       " inputs (NAME.npy or input_NAME.npy)");
    KILN_ASSIGN_OR_RETURN(std::vector<Tensor> in, bind_inputs(g, b));
    sets.push_back(std::move(in));
  }
  if (sets.empty()) return not_found("--inputs: no .npy input sets in '" + f.inputs_dir + "'");
  return sets;
}

StatusOr<std::vector<Tensor>> run_with_values(const Graph& g, const std::vector<std::string>& extra,
                                              const std::vector<Tensor>& inputs) {
  std::unique_ptr<Graph> c = g.clone();
  std::map<std::string, Value*> by_name;
  for (Value* v : c->inputs()) by_name[v->name()] = v;
  for (const auto& n : c->nodes())
    for (Value* v : n->results())
      if (!v->name().empty()) by_name[v->name()] = v;
  std::vector<Value*> outs = c->outputs();
  for (const std::string& name : extra) {
    auto it = by_name.find(name);
    if (it == by_name.end()) return not_found("graph '" + g.name() + "' has no value %" + name);
    outs.push_back(it->second);
  }
  c->set_outputs(outs);
  return Interpreter().run(*c, inputs);
}

int cmd_calibrate(Args& args) {
  QuantFlags f;
  while (!args.done()) {
    if (!args.at_option()) {
      if (!f.model.empty()) throw UsageError{"calibrate: more than one input model"};
      f.model = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (!quant_flag(flag, args, f)) args.unknown(flag);
  }
  if (f.model.empty()) throw UsageError{"calibrate: no input model given"};
  if (f.output.empty()) throw UsageError{"calibrate: no output file given (-o SCALES.json)"};
  if (f.inputs_dir.empty() == (f.random_samples == 0))
    throw UsageError{"calibrate: give exactly one of --inputs DIR and --random-inputs N"};

  std::unique_ptr<Graph> g;
  if (Status s = prepare_graphs(f, &g, nullptr); !s.ok()) return report(s);
  // The activations quantize-fp8 will quantize: the first operand of every matmul and linear.
  std::vector<std::string> names;
  for (const auto& n : g->nodes()) {
    if (n->op_name() != "matmul" && n->op_name() != "linear") continue;
    const std::string& name = n->operand(0)->name();
    if (name.empty()) return report(invalid_argument("calibrate: the input of " + n->op_name() + " %" +
                                                     n->result()->name() + " has no name"));
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  auto sets = sample_inputs(*g, f);
  if (!sets.ok()) return report(sets.status());
  std::vector<double> amax(names.size(), 0.0);
  for (const auto& in : *sets) {
    auto outs = run_with_values(*g, names, in);
    if (!outs.ok()) return report(outs.status());
    for (size_t i = 0; i < names.size(); ++i) {
      const Tensor& t = (*outs)[static_cast<size_t>(g->num_outputs()) + i];
      for (int64_t e = 0; e < t.numel(); ++e) amax[i] = std::max(amax[i], std::fabs(t.get_f64(e)));
    }
  }
  std::ofstream out(f.output);
  out << "{\n  \"kiln_fp8_scales\": 1,\n  \"model\": " << json_string(f.model) << ",\n  \"samples\": "
      << sets->size() << ",\n  \"amax\": {";
  for (size_t i = 0; i < names.size(); ++i) {
    char num[32];
    std::snprintf(num, sizeof num, "%.9g", amax[i]);
    out << (i ? ",\n    " : "\n    ") << json_string(names[i]) << ": " << num;
  }
  out << "\n  }\n}\n";
  out.close();
  if (!out) return report(io_error("calibrate: cannot write '" + f.output + "'"));
  note("calibrate: " + std::to_string(names.size()) + " activations over " + std::to_string(sets->size()) +
       " input sets -> " + f.output);
  return kExitOk;
}

}  // namespace kiln::cli
