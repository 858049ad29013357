// Shared pieces of the kiln command line: argument reading, error reporting, subcommands.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/core/driver.h"
#include "kiln/ir/status.h"
#include "kiln/runtime.h"

namespace kiln::cli {

/// Exit codes: success, an error while working, a malformed command line.
inline constexpr int kExitOk = 0, kExitError = 1, kExitUsage = 2;

/// Thrown inside a subcommand for a malformed command line; main() prints it and exits 2.
struct UsageError {
  std::string message;
};

/// Reads `--flag`, `--flag VALUE` and `--flag=VALUE` arguments and positionals, in order.
class Args {
 public:
  Args(std::vector<std::string> args, std::string command)
      : args_(std::move(args)), command_(std::move(command)) {}

  bool done() const { return i_ >= args_.size(); }
  /// The next argument is an option ("-x" or "--x", but not "-" alone).
  bool at_option() const;
  /// Consumes the next argument as an option and returns its name ("--pipeline").
  std::string option();
  /// The option's value: the "=VALUE" part or the next argument.
  std::string value(const std::string& flag);
  /// Refuses a "=VALUE" given to a flag that takes none.
  void no_value(const std::string& flag);
  std::string positional() { return args_[i_++]; }
  [[noreturn]] void unknown(const std::string& flag) const;

 private:
  std::vector<std::string> args_;
  std::string command_;
  size_t i_ = 0;
  std::optional<std::string> inline_value_;
};

/// Prints each line of `s`'s message as "kiln: error: ..." and returns kExitError.
int report(const Status& s);
/// "kiln: note: ..." on stderr.
void note(const std::string& msg);

/// Reads the pass manager's flags (--timing, --print-ir-after-*, --no-verify-each,
/// --reproducer-dir) into `pm`; false when `flag` is not one of them.
bool pass_manager_flag(const std::string& flag, Args& args, PassManagerOptions& pm);

int cmd_plugins(Args& args);
int cmd_opt(Args& args);
int cmd_run(Args& args);
int cmd_compile(Args& args);
int cmd_inspect(Args& args);
int cmd_cache(Args& args);
/// `kiln bench` (bench_cmd.cpp) and its help.
int cmd_bench(Args& args);
std::string bench_usage_text();
/// A model loaded on its own runtime, released together.
struct LoadedModel {
  kiln_runtime* rt = nullptr;
  kiln_model* m = nullptr;
  LoadedModel() = default;
  LoadedModel(const LoadedModel&) = delete;
  LoadedModel& operator=(const LoadedModel&) = delete;
  ~LoadedModel() {
    kiln_model_release(m);
    kiln_runtime_release(rt);
  }
};

/// The message of a runtime status, which it releases; "" for success. After a failed
/// collective (KILN_STATUS_COLLECTIVE_FAILED) the device may still be busy with aborted work
/// and other ranks may be gone: it prints the error and exits the process at once.
std::string take_status(kiln_status* st);

/// `kiln launch` (launch_cmd.cpp) and its help.
int cmd_launch(Args& args);
std::string launch_usage_text();
/// `kiln run` of a per-rank program (mesh_run_cmd.cpp): `b` holds the whole inputs given,
/// `files` the outputs to write (name → .npy); the rest are printed.
int run_per_rank(const Graph& g, const Pipeline& p, const InputBindings& b,
                 const std::map<std::string, std::string>& files, double collective_timeout_s);
/// Prints the graph's outputs (name, type, values) or writes those named in `files` as .npy.
int print_outputs(const Graph& g, const std::vector<Tensor>& outs, const std::map<std::string, std::string>& files);
/// Loads plugins and the pipeline (a file, else the one-line `passes`), imports `model` and runs
/// the passes, or (`before_strategy`) those before the pipeline's parallel strategy, refusing a
/// strategy in `passes` (plan_cmd.cpp).
StatusOr<std::unique_ptr<Graph>> prepare_model(const std::string& model, const std::string& pipeline_file,
                                               const std::string& passes, const std::map<std::string, int64_t>& symbols,
                                               const std::vector<std::string>& plugin_paths, bool before_strategy);
/// Gives the tensors of checkpoint folder `dir`, whole, to `g`'s constants of the same names
/// (`--weights`, checkpoint_cmd.cpp).
Status load_checkpoint_weights(Graph& g, const std::string& dir);
/// Help of compile, inspect and cache ("" for other commands).
std::string artifact_usage_text(std::string_view command);

/// The help text of one subcommand ("" = the overview).
std::string usage_text(std::string_view command);

/// `s` as a JSON string literal, quotes included (for the --json and report outputs).
std::string json_string(std::string_view s);

}  // namespace kiln::cli
