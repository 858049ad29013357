// `kiln compile`, `kiln inspect` and `kiln cache`: build .kiln artifacts, print them, manage the
// kernel cache.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <set>

#include "cli.h"
#include "kiln/artifact_reader.h"
#include "kiln/core/artifact.h"
#include "kiln/core/compile.h"
#include "kiln/core/driver.h"
#include "kiln/core/kernel_cache.h"
#include "kiln/core/memory_estimate.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"
#include "kiln/ir/walk.h"
#include "kiln/plugin.h"

namespace kiln::cli {

namespace {

constexpr std::string_view kCompile = R"(usage: kiln compile IN --target LIST [-o OUT.kiln] [--sym NAME=VALUE]... [options]

Read the model IN, run the pipeline's passes, bind its symbolic dimensions, and build one
.kiln artifact holding a kernel image for every target. Each target is built by the backend
plugin that lists it (`kiln plugins`). Artifacts have static shapes: every symbolic
dimension needs a --sym. Works without a GPU.

  --target LIST             comma-separated targets, e.g. sm_80,sm_90a,sm_100a
                            (default: the pipeline's [backend] targets)
  -o, --output OUT.kiln     where to write the artifact (default: IN with the extension .kiln)
  --sym NAME=VALUE          size of symbolic dimension NAME; repeatable
  --backend LIST            only these backends may build the targets (default: any that
                            lists a target; the pipeline's backend when several do)
  --rank K                  a pipeline-parallel program: build only rank K's program (its
                            stage); without it one artifact holds every rank's program and
                            each rank picks its own at load

Without --pipeline or --passes the standard passes run, those of them the loaded plugins
provide, in this order: canonicalize, cse, fold-layout, fuse-attention, fuse-horizontal,
fuse-rows, fuse-pointwise, dce, schedule-memory. --passes "" runs none.
)";

constexpr std::string_view kInspect = R"(usage: kiln inspect FILE.kiln [--json]

Check a .kiln artifact (header, checksums, plan) and print what it holds: Kiln version,
targets, pipeline, plugins, images, inputs, outputs, plan and memory sizes. Needs no GPU.

  --json              print JSON instead of text
)";

constexpr std::string_view kCache = R"(usage: kiln cache info|clear [--dir DIR]

  info                print the kernel cache's folder, entry count and size
  clear               remove every kernel cache entry

  --dir DIR           the cache folder (default: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln,
                      else ~/.cache/kiln)
)";

struct CompileFlags {
  std::string model, output, pipeline_file, frontend;
  std::optional<std::string> passes;
  std::vector<std::string> plugin_paths, targets, backends;
  std::map<std::string, int64_t> symbols;
  int64_t rank = -1;  ///< a pipeline's rank to compile (-1: not a pipeline)
  PassManagerOptions pm;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  for (size_t start = 0; start <= s.size();) {
    const size_t end = std::min(s.find(',', start), s.size());
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

std::string join(const std::vector<std::string>& v, const std::string& sep = ", ") {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

CompileFlags parse_compile(Args& args) {
  CompileFlags f;
  while (!args.done()) {
    if (!args.at_option()) {
      if (!f.model.empty()) throw UsageError{"compile: more than one input model ('" + f.model + "', '" + args.positional() + "')"};
      f.model = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (flag == "--target") {
      for (const auto& t : split_list(args.value(flag))) f.targets.push_back(t);
    } else if (flag == "--backend") {
      for (const auto& b : split_list(args.value(flag))) f.backends.push_back(b);
    } else if (flag == "-o" || flag == "--output") {
      f.output = args.value(flag);
    } else if (flag == "--sym") {
      const std::string v = args.value(flag);
      const size_t eq = v.find('=');
      int64_t n = 0;
      const char* end = v.data() + v.size();
      if (eq == 0 || eq == std::string::npos || std::from_chars(v.data() + eq + 1, end, n).ptr != end || eq + 1 == v.size() || n < 0)
        throw UsageError{"--sym expects NAME=VALUE with VALUE >= 0, got '" + v + "'"};
      if (!f.symbols.emplace(v.substr(0, eq), n).second) throw UsageError{"--sym " + v.substr(0, eq) + " given twice"};
    } else if (flag == "--rank") {
      const std::string v = args.value(flag);
      int64_t n = -1;
      if (std::from_chars(v.data(), v.data() + v.size(), n).ptr != v.data() + v.size() || v.empty() || n < 0)
        throw UsageError{"--rank expects a rank >= 0, got '" + v + "'"};
      f.rank = n;
    } else if (flag == "--pipeline") { f.pipeline_file = args.value(flag);
    } else if (flag == "--passes") { f.passes = args.value(flag);
    } else if (flag == "--frontend") { f.frontend = args.value(flag);
    } else if (flag == "--plugin-path") { f.plugin_paths.push_back(args.value(flag));
    } else if (flag == "--reproducer-dir") { f.pm.reproducer_dir = args.value(flag);
    } else if (flag == "--timing") { args.no_value(flag); f.pm.timing = true;
    } else if (flag == "--print-ir-after-all") { args.no_value(flag); f.pm.print_ir_after_all = true;
    } else if (flag == "--print-ir-after-change") { args.no_value(flag); f.pm.print_ir_after_change = true;
    } else if (flag == "--no-verify-each") { args.no_value(flag); f.pm.verify_each = false;
    } else {
      args.unknown(flag);
    }
  }
  if (f.model.empty()) throw UsageError{"compile: no input model given"};
  if (!f.pipeline_file.empty() && f.passes) throw UsageError{"compile: give --pipeline or --passes, not both"};
  std::set<std::string> seen;
  for (const auto& t : f.targets)
    if (!seen.insert(t).second) throw UsageError{"compile: target '" + t + "' given twice"};
  return f;
}

/// The estimated peak activation memory before and after the passes, and the arena the
/// plan actually reserves (its "arena bytes=" line).
std::string memory_summary(int64_t imported, int64_t compiled, const std::string& plan) {
  auto human = [](int64_t b) {
    const char* unit[] = {"B", "KiB", "MiB", "GiB"};
    double v = static_cast<double>(b);
    int u = 0;
    for (; u < 3 && v >= 1024; ++u) v /= 1024;
    char t[32];
    std::snprintf(t, sizeof t, u ? "%.2f %s" : "%.0f %s", v, unit[u]);
    return std::string(t);
  };
  char change[32];
  std::snprintf(change, sizeof change, "%+.1f%%", imported ? 100.0 * static_cast<double>(compiled - imported) / static_cast<double>(imported) : 0.0);
  std::string out = "  peak activation memory: " + human(imported) + " in import order, " + human(compiled) +
                    " as compiled (" + change + ")\n";
  if (const size_t at = plan.find("\narena bytes="); at != std::string::npos) {
    const std::string bytes = plan.substr(at + 13, plan.find('\n', at + 1) - at - 13);
    int64_t arena = 0;
    if (std::from_chars(bytes.data(), bytes.data() + bytes.size(), arena).ec == std::errc())
      out += "  plan arena: " + human(arena) + " (arena bytes=" + bytes + ")\n";
  }
  return out;
}

/// Everything after loading the pipeline; returns the artifact's size, and in `summary` a
/// line per target listing its images.
StatusOr<uint64_t> compile_artifact(const CompileFlags& f, Pipeline& p, Registry& reg, std::string* summary) {
  // Settled before the import, so a misspelt target fails at once.
  KILN_ASSIGN_OR_RETURN(std::vector<TargetGroup> groups, group_targets(p, reg, f.backends));

  forward_symbols_to_frontend(p.frontend, f.symbols, reg);
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Graph> g, import_model(f.model, p.frontend, reg));
  const std::unique_ptr<Graph> imported = g->clone();  // for the import-order peak memory
  KILN_RETURN_IF_ERROR(run_pipeline_passes(*g, p, reg, f.pm));
  std::set<std::string> taken;
  if (p.frontend.options.has("dims"))
    for (const std::string& d : p.frontend.options.get_strings("dims")) taken.insert(d.substr(0, d.find('=')));
  KILN_RETURN_IF_ERROR(bind_symbols(*imported, f.symbols, taken));
  // The imported graph checked every --sym is a symbol of the model; a strategy may have bound
  // some already (a pipeline passes static shapes between its stages).
  for (const auto& [name, size] : f.symbols) taken.insert(name);
  KILN_RETURN_IF_ERROR(bind_symbols(*g, f.symbols, taken));
  bool staged = false;
  for (const auto& n : g->nodes()) staged |= n->op_name() == "pipeline_stage";
  if (!staged && f.rank >= 0)
    return invalid_argument("--rank " + std::to_string(f.rank) + ": graph '" + g->name() +
                            "' is not a pipeline; every rank runs the same artifact");
  if (f.rank >= g->mesh().num_ranks())
    return invalid_argument("--rank " + std::to_string(f.rank) + " is not a rank of mesh " + g->mesh().str());

  // A pipeline's ranks run different programs: each distinct one is built once (the ranks of a
  // stage share it) and one artifact holds them all, unless --rank asks for one rank's.
  std::vector<int64_t> ranks;
  if (!staged) ranks = {-1};
  else if (f.rank >= 0) ranks = {f.rank};
  else for (int64_t r = 0; r < g->mesh().num_ranks(); ++r) ranks.push_back(r);
  std::map<std::string, std::string> built;  // the stages a rank runs -> its artifact
  std::vector<std::string> per_rank;
  ArtifactContents contents;
  for (int64_t r : ranks) {
    std::string key;
    if (r >= 0)
      for (const auto& n : g->nodes())
        if (n->op_name() == "pipeline_stage") key += runs_stage(*n, g->mesh(), r) ? '1' : '0';
    if (auto it = built.find(key); it != built.end()) {
      per_rank.push_back(it->second);
      continue;
    }
    std::unique_ptr<Graph> program;
    if (r >= 0) {
      KILN_ASSIGN_OR_RETURN(program, program_of_rank(*g, r));
    }
    const Graph& pg = program ? *program : *g;
    KILN_ASSIGN_OR_RETURN(contents, build_artifact_contents(pg, p, reg, groups));
    contents.meta["model"] = std::filesystem::path(f.model).filename().string();
    contents.meta["created_by"] = "kiln compile";
    if (f.rank >= 0) contents.meta["rank"] = std::to_string(f.rank);
    // The runtime's own reader checks the result, so a backend bug is caught here rather than
    // when the artifact is first loaded on a GPU machine.
    std::string error;
    const std::string bytes = serialize_artifact(contents);
    if (!artifact::read_artifact(bytes, "<compiled artifact>", &error))
      return internal_error("the backends produced an invalid artifact: " + error);
    if (ranks.size() > 1) *summary += "  program." + std::to_string(built.size()) + " (rank " + std::to_string(r) + "'s stage):\n";
    for (const auto& t : p.targets) {
      std::vector<std::string> sizes;
      for (const auto& im : contents.images)
        if (image_serves(im, t)) sizes.push_back(im.target + "." + im.form + " " + std::to_string(im.bytes.size()) + " bytes");
      *summary += "  " + t + ": " + join(sizes) + "\n";
    }
    *summary += memory_summary(peak_activation_bytes(*imported), peak_activation_bytes(pg), contents.plan);
    built.emplace(key, bytes);
    per_rank.push_back(bytes);
  }
  if (ranks.size() > 1) {
    std::map<std::string, std::string> meta = contents.meta;  // the last program's: the same compile
    contents = rank_program_contents(per_rank, std::move(meta));
    std::string error;
    const auto outer = artifact::read_artifact(serialize_artifact(contents), "<compiled artifact>", &error);
    if (!outer) return internal_error("an invalid artifact of per-rank programs: " + error);
    for (int64_t r : ranks)
      if (!artifact::rank_program(*outer, r, "<compiled artifact>", &error))
        return internal_error("an invalid artifact of per-rank programs: " + error);
  }
  KILN_RETURN_IF_ERROR(write_artifact(f.output, contents));
  std::error_code ec;
  const auto size = std::filesystem::file_size(f.output, ec);
  if (ec) return io_error("cannot read the size of '" + f.output + "': " + ec.message());
  return static_cast<uint64_t>(size);
}

}  // namespace

std::string artifact_usage_text(std::string_view command) {
  if (command == "compile") return std::string(kCompile);
  if (command == "inspect") return std::string(kInspect);
  if (command == "cache") return std::string(kCache);
  return "";
}

int cmd_compile(Args& args) {
  CompileFlags f = parse_compile(args);
  if (f.output.empty()) f.output = std::filesystem::path(f.model).replace_extension(".kiln").string();
  const auto start = std::chrono::steady_clock::now();

  Registry& reg = Registry::global();
  Pipeline p;
  if (Status s = load_plugins_from(f.plugin_paths, reg); !s.ok()) return report(s);
  if (!f.pipeline_file.empty()) {
    auto loaded = load_pipeline_with_plugins(f.pipeline_file, reg);
    if (!loaded.ok()) return report(loaded.status());
    p = std::move(*loaded);
  } else if (f.passes) {
    auto passes = parse_pass_list(*f.passes, reg);
    if (!passes.ok()) return report(passes.status().with_context("--passes"));
    p.passes = std::move(*passes);
  } else {
    p.passes = default_compile_passes(reg);
  }
  if (!f.frontend.empty()) {
    auto fe = reg.frontend(f.frontend);
    if (!fe.ok()) return report(fe.status());
    auto opts = resolve_options((*fe)->options, {}, "frontend '" + f.frontend + "'");
    if (!opts.ok()) return report(opts.status());
    p.frontend = {f.frontend, std::move(*opts), {}};
  }
  if (Status s = resolve_pipeline_defaults(p, reg, f.model, /*need_backend=*/false); !s.ok()) return report(s);
  if (!f.targets.empty()) p.targets = f.targets;
  if (p.targets.empty())
    return report(invalid_argument("compile: no targets; give --target (e.g. --target sm_90a) or [backend] targets in the pipeline"));

  std::string summary;
  auto size = compile_artifact(f, p, reg, &summary);
  if (!size.ok()) return report(size.status());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  char line[64];
  std::snprintf(line, sizeof line, "%.3f", secs);
  std::cout << "compiled " << f.model << " for " << join(p.targets) << " in " << line << " s: " << f.output << " ("
            << *size << " bytes)\n" << summary;
  std::cout.flush();
  return std::cout ? kExitOk : report(io_error("cannot write to stdout"));
}

int cmd_inspect(Args& args) {
  std::string file;
  bool json = false;
  while (!args.done()) {
    if (!args.at_option()) {
      if (!file.empty()) throw UsageError{"inspect: more than one file ('" + file + "', '" + args.positional() + "')"};
      file = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (flag != "--json") args.unknown(flag);
    args.no_value(flag);
    json = true;
  }
  if (file.empty()) throw UsageError{"inspect: no artifact given"};
  std::string error;
  auto a = artifact::read_artifact_file(file, &error);
  if (!a) return report(invalid_argument(error));
  if (!json) std::cout << "file: " << file << " (" << a->storage->size() << " bytes)\n";
  std::cout << artifact::describe(*a, json);
  std::cout.flush();
  return std::cout ? kExitOk : report(io_error("cannot write to stdout"));
}

int cmd_cache(Args& args) {
  std::string action, dir;
  while (!args.done()) {
    if (!args.at_option()) {
      if (!action.empty()) throw UsageError{"cache: more than one action ('" + action + "', '" + args.positional() + "')"};
      action = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (flag != "--dir") args.unknown(flag);
    dir = args.value(flag);
  }
  if (action != "info" && action != "clear")
    throw UsageError{action.empty() ? "cache: expected 'info' or 'clear'" : "cache: unknown action '" + action + "' (expected info or clear)"};
  const KernelCache cache(dir.empty() ? KernelCache::default_dir() : dir);
  auto stats = cache.stats();
  if (!stats.ok()) return report(stats.status());
  if (action == "info") {
    std::cout << "dir: " << stats->dir << "\nentries: " << stats->entries << "\nbytes: " << stats->bytes << "\n";
  } else {
    if (Status s = cache.clear(); !s.ok()) return report(s);
    std::cout << "removed " << stats->entries << " entries (" << stats->bytes << " bytes) from " << stats->dir << "\n";
  }
  std::cout.flush();
  return std::cout ? kExitOk : report(io_error("cannot write to stdout"));
}

}  // namespace kiln::cli
