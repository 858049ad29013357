// The pass manager: runs registered passes with verification, timing, IR printing, reproducers.
#include "kiln/core/pass_manager.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>

#include "kiln/core/loader.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

namespace kiln {
namespace {

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// A reproducer's header: `//` comments, so the file stays plain .kir (docs/reproducers.md).
constexpr std::string_view kHeaderKey = "// kiln-reproducer: ";
constexpr std::string_view kFailedKey = "// failed: ";

/// Writes the IR that entered the pipeline, headed by the pipeline, the plugin paths and the
/// failure, to a fresh file in `dir`; returns its path.
StatusOr<std::string> write_reproducer(const std::string& dir, const Graph& input,
                                       const std::string& pipeline,
                                       const std::vector<std::string>& plugin_paths,
                                       const std::string& pass, const std::string& message) {
  // One counter per process, so that several failures in one run never overwrite each other;
  // files left by an earlier process with a recycled pid are skipped too.
  static std::atomic<int> counter{0};
  namespace fs = std::filesystem;
  const fs::path folder = dir.empty() ? fs::path(".") : fs::path(dir);
  fs::path path;
  std::error_code ec;
  do {
    path = folder / ("kiln-reproducer-" + std::to_string(::getpid()) + "-" +
                     std::to_string(counter++) + ".kir");
  } while (fs::exists(path, ec));
  std::ofstream out(path);
  if (!out) return io_error("cannot write reproducer '" + path.string() + "'");
  // The pipeline goes in raw: it is one line, and a reader takes all between the first and
  // the last quote. The paths use the option syntax, quoted where they need it.
  out << kHeaderKey << "pipeline = \"" << pipeline << "\"\n"
      << kHeaderKey << "plugin-paths = " << option_value_str(plugin_paths) << "\n"
      << kFailedKey << pass << ": " << first_line(message) << "\n"
      << print_graph(input);
  out.close();
  if (!out) return io_error("cannot write reproducer '" + path.string() + "'");
  return path.string();
}

void print_timing(std::ostream& log, const std::vector<PassTiming>& timings) {
  double total = 0;
  size_t width = 5;  // "total"
  for (const PassTiming& t : timings) {
    total += t.seconds;
    width = std::max(width, t.pass.size());
  }
  const int w = static_cast<int>(width);
  std::ostringstream out;
  out << std::fixed << std::left;
  out << "// ----- pass timing -----\n"
      << std::setw(w) << "pass" << std::right << std::setw(12) << "seconds" << std::setw(8) << "%"
      << "  changed\n";
  auto row = [&](const std::string& name, double seconds, const char* changed) {
    const double pct = total > 0 ? 100.0 * seconds / total : 0.0;
    out << std::left << std::setw(w) << name << std::right << std::setprecision(6)
        << std::setw(12) << seconds << std::setprecision(1) << std::setw(7) << pct << "%";
    if (changed) out << "  " << changed;
    out << "\n";
  };
  for (const PassTiming& t : timings) row(t.pass, t.seconds, t.changed ? "yes" : "no");
  row("total", total, nullptr);
  log << out.str();
}

}  // namespace

StatusOr<Reproducer> read_reproducer(const std::string& path) {
  std::ifstream in(path);
  if (!in) return io_error("cannot open reproducer '" + path + "': " + std::strerror(errno));
  Reproducer r;
  bool has_pipeline = false;
  std::string line;
  // The header is the run of `//` lines at the top; the first other line starts the IR.
  for (int n = 1; std::getline(in, line) && line.starts_with("//"); ++n) {
    if (line.starts_with(kFailedKey)) {
      r.failure = line.substr(kFailedKey.size());
      continue;
    }
    if (!line.starts_with(kHeaderKey)) continue;
    const std::string entry = line.substr(kHeaderKey.size());
    const size_t eq = entry.find(" = ");
    const std::string key = entry.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : entry.substr(eq + 3);
    const size_t col = eq == std::string::npos ? line.size() + 1 : kHeaderKey.size() + eq + 4;
    const Location at{path, n, static_cast<int>(col)};  // where the value starts
    if (key == "pipeline") {
      if (value.size() < 2 || value.front() != '"' || value.back() != '"')
        return error_at(at, StatusCode::kInvalidArgument, "expected pipeline = \"...\"");
      r.pipeline = value.substr(1, value.size() - 2);
      has_pipeline = true;
    } else if (key == "plugin-paths") {
      auto v = parse_option_value(value);
      if (v.ok() && option_value_type(*v) == OptionType::kStringList) {
        r.plugin_paths = std::get<std::vector<std::string>>(*v);
      } else {
        return error_at(at, StatusCode::kInvalidArgument,
                        "plugin-paths must be a list of strings, like [/a, \"/b c\"]");
      }
    }
  }
  if (in.bad()) return io_error("cannot read reproducer '" + path + "'");
  if (!has_pipeline)
    return invalid_argument(path + ": not a kiln reproducer (no '" + std::string(kHeaderKey) +
                            "pipeline = \"...\"' line at the top)");
  return r;
}

PassManager::PassManager(const Registry& reg, PassManagerOptions opts)
    : reg_(reg), opts_(std::move(opts)) {}

Status PassManager::run(Graph& g, const std::vector<StageSpec>& passes,
                        const std::string& canonical_pipeline) {
  timings_.clear();
  std::ostream& log = opts_.log ? *opts_.log : std::cerr;

  // Passes are created up front so a bad name or option fails before any IR is touched.
  struct Planned {
    const StageSpec* spec;
    std::string canonical;  // name plus non-default options, for logs
    std::unique_ptr<Pass> pass;
  };
  std::vector<Planned> plan;
  for (const StageSpec& spec : passes) {
    KILN_ASSIGN_OR_RETURN(const PassInfo* info, reg_.pass(spec.name));
    // Resolving again fills defaults for stages built by hand and is a no-op otherwise.
    KILN_ASSIGN_OR_RETURN(Options opts, resolve_options(info->options, spec.options.values(),
                                                        "pass '" + spec.name + "'"));
    auto pass = info->create(opts);
    if (!pass.ok()) return error_at(spec.loc, pass.status().code(), pass.status().message());
    plan.push_back({&spec, spec.name + opts.canonical(info->options), std::move(pass).value()});
  }

  if (opts_.verify_each) {
    Status s = verify(g);
    if (!s.ok()) return Status(s.code(), "verifier failed on the input graph: " + s.message());
  }
  // The reproducer holds the IR as it entered the pipeline, so replaying it replays every pass.
  const std::unique_ptr<Graph> input = g.clone();

  // `why` is the returned error; `detail` what the reproducer's header says after the name.
  auto fail = [&](const std::string& pass, const Status& why, const std::string& detail) {
    if (opts_.timing) print_timing(log, timings_);
    auto path =
        write_reproducer(opts_.reproducer_dir, *input, canonical_pipeline,
                         opts_.reproducer_plugin_paths.value_or(plugin_paths_used()), pass, detail);
    const std::string suffix = path.ok() ? "; reproducer written to " + path.value()
                                         : "; could not write a reproducer: " +
                                               path.status().message();
    return Status(why.code(), why.message() + suffix);
  };

  for (Planned& p : plan) {
    const std::string& name = p.spec->name;
    const auto start = std::chrono::steady_clock::now();
    StatusOr<bool> changed = p.pass->run(g);
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    timings_.push_back({p.canonical, elapsed.count(), changed.ok() && changed.value()});

    if (!changed.ok())
      return fail(name,
                  Status(changed.status().code(),
                         "pass '" + name + "' failed: " + changed.status().message()),
                  changed.status().message());
    if (opts_.verify_each) {
      Status s = verify(g);
      if (!s.ok())
        return fail(name,
                    internal_error("verifier failed after pass '" + name + "': " + s.message()),
                    "verifier failed: " + s.message());
    }
    if (opts_.print_ir_after_all || (opts_.print_ir_after_change && changed.value()))
      log << "// ----- IR after " << p.canonical << " -----\n" << print_graph(g);
  }
  if (opts_.timing) print_timing(log, timings_);
  return ok_status();
}

}  // namespace kiln
