// The kiln command line: dispatches to the subcommands and turns every failure into an exit code.
#include <exception>
#include <iostream>

#include "cli.h"
#include "kiln/plugin.h"

namespace kiln::cli {

namespace {

constexpr std::string_view kOverview = R"(usage: kiln <command> [options]

commands:
  plugins   list the plugins found and the options each one declares
  ops       list every op: operands, attributes, result rule, traits (--json, --markdown)
  import    read a model with a front end (e.g. .onnx) and write it as .kir
  opt       read a model, run passes on it, and print the resulting .kir
  run       read a model, run passes, compile it for a backend and run it
  compile   build a .kiln artifact with kernel images for GPU targets (no GPU needed)
  inspect   check a .kiln artifact and print what it holds
  cache     show or clear the kernel cache
  bench     time a .kiln artifact on the GPU (latency, device time, throughput, graphs on/off)
  checkpoint  save, reshard or print weights by logical tensor (topology-independent)
  plan      choose how to split a model over N devices (mesh, strategy) with a cost model
  train     run training steps (autodiff + optimizer pipeline) on .npy batches, with checkpoints
  launch    start one process per rank on this host (kiln launch -n 2 -- kiln run ...)
  calibrate record max|x| of every matmul/linear input over sample inputs (FP8 scales file)
  quant-report  per-layer and end-to-end SQNR of a quantizing pipeline against fp32

  kiln --version        print the version, plugin ABI and build fingerprint
  kiln --help           this text; `kiln <command> --help` for one command

Plugins are loaded from the kiln binary's folder, its ../lib/kiln/plugins, each folder in
$KILN_PLUGIN_PATH (colon-separated), then each --plugin-path.
Exit status: 0 success, 1 error, 2 malformed command line.
)";

constexpr std::string_view kPlugins = R"(usage: kiln plugins [--json] [--plugin-path DIR]...

List every front end, pass, backend and parallel strategy with its version, the library
that registered it, and its options (type, default, help).

  --json              print JSON instead of text
  --plugin-path DIR   also load the plugins in DIR (a folder or one plugin file); repeatable
)";

constexpr std::string_view kCommon = R"(
pipeline:
  --pipeline FILE     a pipeline TOML (front end, passes, backend, runtime, plugin paths)
  --passes LIST       passes in one-line form instead, e.g. "canonicalize{max-iterations=2},cse"
  --frontend NAME     read the model with this front end (default: by file extension)
  --plugin-path DIR   also load the plugins in DIR (a folder or one plugin file); repeatable
  --weights DIR       take the model's constants from a checkpoint (kiln checkpoint --help)

pass manager:
  --timing                  print the time each pass took
  --print-ir-after-all      print the IR after every pass
  --print-ir-after-change   print the IR after each pass that changed it
  --no-verify-each          do not run the verifier after each pass
  --reproducer-dir DIR      where a failing pass writes its reproducer (default: .)
)";

constexpr std::string_view kOpt = R"(usage: kiln opt IN [--pipeline FILE.toml | --passes LIST] [-o OUT.kir] [options]
       kiln opt --reproducer FILE [-o OUT.kir] [options]

Read the model IN, run the pipeline's passes, and print the result as .kir to OUT (large
constants then go to OUT.bin) or to stdout.

  -o, --output OUT.kir      write the result here instead of stdout
  --reproducer FILE         replay a reproducer a failing pass wrote: load the plugin paths it
                            records, then run its pipeline's passes on its IR
)";

constexpr std::string_view kRun = R"(usage: kiln run IN [--pipeline FILE.toml | --passes LIST] [--backend NAME]
                [--input NAME=@FILE.npy]... [--output NAME=@FILE.npy]... [options]

Read the model IN, run the pipeline's passes, compile it with the backend and run it.
Outputs not written to a file are printed: name, type, then the values (shortened when large).

  --backend NAME            compile with this backend (default: the pipeline's, else reference)
  --input NAME=@FILE.npy    value of graph input NAME; repeatable
  --output NAME=@FILE.npy   write graph output NAME to FILE; repeatable
  --random-inputs           fill inputs not given with seeded pseudo-random values
  --seed N                  seed for --random-inputs (default 0)
  --sym NAME=VALUE          size of symbolic dimension NAME (default: from the inputs, else 1)
  --collective-timeout S    a per-rank program on a cuda backend fails when its collectives
                            have not finished S seconds into a run (default 300)

A per-rank program (a graph over a mesh, marked per_rank) takes whole inputs and prints whole
outputs: each rank gets its piece. The reference backend runs every rank in this process; a
cuda backend runs one rank per process under a launcher (kiln launch, torchrun, srun, mpirun;
see docs/parallel-runtime.md), and rank 0 prints the outputs.
)";

}  // namespace

int cmd_import(Args& args);  // import_cmd.cpp
std::string import_usage();   // import_cmd.cpp
int cmd_calibrate(Args& args);       // calibrate_cmd.cpp
std::string calibrate_usage();       // calibrate_cmd.cpp
int cmd_quant_report(Args& args);    // quant_report_cmd.cpp
std::string quant_report_usage();    // quant_report_cmd.cpp
int cmd_ops(Args& args);             // ops_cmd.cpp
int cmd_plan(Args& args);            // plan_cmd.cpp
int cmd_checkpoint(Args& args);      // checkpoint_cmd.cpp
std::string checkpoint_usage();      // checkpoint_cmd.cpp
std::string plan_usage();            // plan_cmd.cpp
int cmd_train(Args& args);           // train_cmd.cpp
std::string train_usage();           // train_cmd.cpp
std::string ops_usage();             // ops_cmd.cpp

std::string usage_text(std::string_view command) {
  if (command == "plugins") return std::string(kPlugins);
  if (command == "ops") return ops_usage();
  if (command == "import") return import_usage();
  if (command == "opt") return std::string(kOpt) + std::string(kCommon);
  if (command == "run") return std::string(kRun) + std::string(kCommon);
  if (command == "compile") return artifact_usage_text(command) + std::string(kCommon);
  if (command == "bench") return bench_usage_text();
  if (command == "train") return train_usage();
  if (command == "calibrate") return calibrate_usage();
  if (command == "quant-report") return quant_report_usage();
  if (command == "launch") return launch_usage_text();
  if (command == "plan") return plan_usage();
  if (command == "checkpoint") return checkpoint_usage();
  if (!artifact_usage_text(command).empty()) return artifact_usage_text(command);
  return std::string(kOverview);
}

bool Args::at_option() const {
  return !done() && args_[i_].size() > 1 && args_[i_][0] == '-';
}

std::string Args::option() {
  std::string a = args_[i_++];
  inline_value_.reset();
  const size_t eq = a.find('=');
  if (a.starts_with("--") && eq != std::string::npos) {
    inline_value_ = a.substr(eq + 1);
    a.resize(eq);
  }
  return a;
}

std::string Args::value(const std::string& flag) {
  if (inline_value_) {
    std::string v = *inline_value_;
    inline_value_.reset();
    return v;
  }
  if (done()) throw UsageError{command_ + ": " + flag + " needs a value"};
  return args_[i_++];
}

void Args::no_value(const std::string& flag) {
  if (inline_value_) throw UsageError{command_ + ": " + flag + " takes no value"};
}

void Args::unknown(const std::string& flag) const {
  throw UsageError{command_ + ": unknown option '" + flag + "'"};
}

int report(const Status& s) {
  std::string_view msg = s.message();
  do {
    const size_t nl = msg.find('\n');
    std::cerr << "kiln: error: " << msg.substr(0, nl) << "\n";
    msg = nl == std::string_view::npos ? std::string_view() : msg.substr(nl + 1);
  } while (!msg.empty());
  return kExitError;
}

void note(const std::string& msg) { std::cerr << "kiln: note: " << msg << "\n"; }

namespace {

int dispatch(std::vector<std::string> argv) {
  if (argv.empty()) throw UsageError{"no command given"};
  const std::string command = argv[0];
  std::vector<std::string> rest(argv.begin() + 1, argv.end());
  if (command == "--version" || command == "version") {
    std::cout << "kiln " KILN_VERSION_STRING "\n"
              << "plugin ABI " << KILN_PLUGIN_ABI_MAJOR << "." << KILN_PLUGIN_ABI_MINOR << "\n"
              << "fingerprint: " KILN_BUILD_FINGERPRINT "\n";
    return kExitOk;
  }
  if (command == "--help" || command == "-h" || command == "help") {
    std::cout << usage_text(rest.empty() ? "" : rest[0]);
    return kExitOk;
  }
  for (const auto& a : rest) {
    if (a == "--") break;  // what follows belongs to another command (kiln launch)
    if (a == "--help" || a == "-h") {
      std::cout << usage_text(command);
      return kExitOk;
    }
  }
  Args args(std::move(rest), command);
  if (command == "plugins") return cmd_plugins(args);
  if (command == "ops") return cmd_ops(args);
  if (command == "import") return cmd_import(args);
  if (command == "opt") return cmd_opt(args);
  if (command == "run") return cmd_run(args);
  if (command == "compile") return cmd_compile(args);
  if (command == "inspect") return cmd_inspect(args);
  if (command == "cache") return cmd_cache(args);
  if (command == "bench") return cmd_bench(args);
  if (command == "plan") return cmd_plan(args);
  if (command == "checkpoint") return cmd_checkpoint(args);
  if (command == "calibrate") return cmd_calibrate(args);
  if (command == "quant-report") return cmd_quant_report(args);
  if (command == "launch") return cmd_launch(args);
  if (command == "train") return cmd_train(args);
  throw UsageError{"unknown command '" + command + "'"};
}

}  // namespace

}  // namespace kiln::cli

int main(int argc, char** argv) {
  using namespace kiln::cli;
  try {
    return dispatch(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const UsageError& e) {
    std::cerr << "kiln: error: " << e.message << "\n(run 'kiln --help' for usage)\n";
    return kExitUsage;
  } catch (const std::exception& e) {
    std::cerr << "kiln: error: internal error: " << e.what() << "\n";
    return kExitError;
  }
}
