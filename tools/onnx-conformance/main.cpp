// kiln-onnx-conformance: runs ONNX backend node tests (model.onnx + test_data_set_*) through
// import, the clean-up passes and a backend, and compares the outputs.
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kiln/core/driver.h"
#include "kiln/core/pass_manager.h"
#include "kiln/core/registry.h"
#include "onnx_tensor.h"

namespace fs = std::filesystem;
using namespace kiln;

namespace {

constexpr const char* kUsage =
    "usage: kiln-onnx-conformance DATA_DIR [--backend NAME[{OPTION=VALUE,...}]] [--filter REGEX]\n"
    "                             [--report FILE.json]\n"
    "                             [--expected-failures FILE] [--tolerances FILE] [--jobs N]\n"
    "                             [--timeout SECONDS] [--memory-limit MIB] [--verbose]\n"
    "Runs every test folder of DATA_DIR (model.onnx + test_data_set_*/input_*.pb, output_*.pb):\n"
    "import, canonicalize,cse,dce, the backend (default reference), then compares outputs\n"
    "(rtol 1e-3, atol 1e-5; exact for integers and bools). With --expected-failures, exits\n"
    "non-zero when a test outside the list fails or a listed one passes (on every backend);\n"
    "given more than once, the lists are joined (e.g. reference's and a backend's exceptions).\n"
    "Each test runs in its own process under --timeout (default 60 s) and --memory-limit\n"
    "(default 8192 MiB, 0: none).\n";

struct Tolerance {
  double rtol = 1e-3, atol = 1e-5;
};

struct Config {
  std::string data_dir, backend = "reference", report, tolerance_path;
  std::vector<std::string> expected_paths;  ///< --expected-failures, joined
  StageSpec backend_stage;  ///< --backend parsed as a pipeline stage (name and options)
  std::optional<std::regex> filter;
  std::string filter_text;
  int jobs = 0;
  double timeout = 60;
  int64_t memory_limit_mib = 8192;
  bool verbose = false;
};

enum class Outcome { kPass, kFail, kSkip };

struct Result {
  std::string name;
  Outcome outcome = Outcome::kFail;
  std::string message;
  double seconds = 0;
  std::string frozen;  ///< inputs bound as constants at import, comma-separated
};

// --- one test, run in a child process ----------------------------------------------------

std::vector<fs::path> sorted_entries(const fs::path& dir, const std::string& prefix) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path());
  // input_10.pb sorts after input_9.pb: order by the number after the prefix.
  auto number = [&](const fs::path& p) {
    const std::string s = p.stem().string().substr(prefix.size());
    return s.empty() || !std::isdigit(static_cast<unsigned char>(s[0])) ? -1L : std::stol(s);
  };
  std::sort(out.begin(), out.end(), [&](const fs::path& a, const fs::path& b) {
    return number(a) != number(b) ? number(a) < number(b) : a < b;
  });
  return out;
}

std::string value_str(const Tensor& t, int64_t i) {
  std::ostringstream s;
  s.precision(9);
  if (is_float(t.dtype())) s << t.get_f64(i);
  else s << t.get_i64(i);
  return s.str();
}

/// Compares one output; returns "" when it matches.
std::string compare(const Tensor& got, const Tensor& want, const Tolerance& tol) {
  if (got.dtype() != want.dtype() || got.shape() != want.shape())
    return "got " + got.type().str() + ", expected " + want.type().str();
  int64_t bad = 0, first = -1;
  const bool fl = is_float(want.dtype());
  for (int64_t i = 0; i < want.numel(); ++i) {
    bool ok;
    if (fl) {
      const double a = got.get_f64(i), e = want.get_f64(i);
      ok = (std::isnan(a) && std::isnan(e)) || a == e ||
           (std::isfinite(a) && std::isfinite(e) && std::fabs(a - e) <= tol.atol + tol.rtol * std::fabs(e));
    } else {
      ok = got.get_i64(i) == want.get_i64(i);
    }
    if (!ok && bad++ == 0) first = i;
  }
  if (bad == 0) return "";
  std::string m = std::to_string(bad) + " of " + std::to_string(want.numel()) + " elements differ; first at " +
                  std::to_string(first) + ": got " + value_str(got, first) + ", expected " + value_str(want, first);
  if (fl) {
    std::ostringstream t;
    t << " (rtol " << tol.rtol << ", atol " << tol.atol << ")";
    m += t.str();
  }
  return m;
}

/// What the runner needs to know of a model: its data inputs and declared element types.
struct ModelInfo {
  std::vector<std::string> inputs;    ///< graph inputs without an initializer, in order
  std::vector<int> input_types, output_types;
};

StatusOr<ModelInfo> read_model_info(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(auto model, onnx_fe::read_model_file(path, onnx_fe::ImportLimits{}));
  std::set<std::string> inits;
  for (const auto& t : model->graph().initializer()) inits.insert(t.name());
  ModelInfo info;
  for (const auto& vi : model->graph().input()) {
    if (inits.count(vi.name())) continue;
    if (!vi.type().has_tensor_type())
      return unimplemented("graph input '" + vi.name() + "' is not a tensor (a sequence, map or optional), which kiln does not support");
    info.inputs.push_back(vi.name());
    info.input_types.push_back(vi.type().tensor_type().elem_type());
  }
  for (const auto& vi : model->graph().output()) {
    if (!vi.type().has_tensor_type())
      return unimplemented("graph output '" + vi.name() + "' is not a tensor (a sequence, map or optional), which kiln does not support");
    info.output_types.push_back(vi.type().tensor_type().elem_type());
  }
  return info;
}

/// Reads a test tensor. The onnx test data stores bfloat16 tensors as their uint16 bit
/// patterns; those are read back as bfloat16 when the model declares that type.
StatusOr<Tensor> read_test_tensor(const fs::path& path, int declared) {
  onnx_fe::ImportLimits limits;
  KILN_ASSIGN_OR_RETURN(onnx_fe::TensorFile f, onnx_fe::read_tensor_file(path.string(), limits));
  constexpr int kUint16 = 4, kBfloat16 = 16;
  if (declared == kBfloat16 && f.proto->data_type() == kUint16) {
    f.proto->set_data_type(kBfloat16);
    onnx_fe::TensorSource src;
    src.owner = f.proto;
    return onnx_fe::tensor_from_proto(*f.proto, src, "tensor file '" + path.string() + "'");
  }
  return f.tensor;
}

Status run_data_set(const fs::path& test, const fs::path& set, const Config& cfg, const Tolerance& tol,
                    const ModelInfo& info, Registry& reg, std::set<std::string>& frozen) {
  const std::vector<std::string>& input_names = info.inputs;
  const std::vector<fs::path> in_files = sorted_entries(set, "input_");
  const std::vector<fs::path> out_files = sorted_entries(set, "output_");
  if (in_files.size() != input_names.size())
    return invalid_argument(set.filename().string() + " has " + std::to_string(in_files.size()) +
                            " inputs, the model takes " + std::to_string(input_names.size()));
  std::map<std::string, Tensor> inputs;
  std::vector<std::string> bindings;
  for (size_t i = 0; i < in_files.size(); ++i) {
    KILN_ASSIGN_OR_RETURN(inputs[input_names[i]], read_test_tensor(in_files[i], info.input_types[i]));
    bindings.push_back(input_names[i] + "=" + in_files[i].string());
  }
  // Inputs kiln needs at import (shapes, axes, counts) become constants; the front end picks which.
  KILN_ASSIGN_OR_RETURN(const FrontendInfo* fe, reg.frontend("onnx"));
  StageSpec frontend{"onnx", {}, {}};
  KILN_ASSIGN_OR_RETURN(frontend.options,
                        resolve_options(fe->options, {{"input-values", bindings}}, "frontend 'onnx'"));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Graph> g, import_model((test / "model.onnx").string(), frontend, reg));

  KILN_ASSIGN_OR_RETURN(std::vector<StageSpec> passes, parse_pass_list("canonicalize,cse,dce", reg));
  PassManagerOptions pm_opts;
  pm_opts.reproducer_dir = fs::temp_directory_path().string();
  PassManager pm(reg, pm_opts);
  KILN_RETURN_IF_ERROR(pm.run(*g, passes, "canonicalize,cse,dce"));

  for (const std::string& name : input_names) frozen.insert(name);
  for (int i = 0; i < g->num_inputs(); ++i) frozen.erase(g->input(i)->name());
  std::vector<Tensor> args;
  for (int i = 0; i < g->num_inputs(); ++i) {
    auto it = inputs.find(g->input(i)->name());
    if (it == inputs.end()) return not_found("no test data for graph input '" + g->input(i)->name() + "'");
    args.push_back(it->second);
  }
  KILN_ASSIGN_OR_RETURN(std::vector<Tensor> outs,
                        compile_and_run(*g, cfg.backend_stage, reg, args));
  if (outs.size() != out_files.size())
    return invalid_argument("the graph has " + std::to_string(outs.size()) + " outputs, the test expects " +
                            std::to_string(out_files.size()));
  for (size_t i = 0; i < outs.size(); ++i) {
    const int declared = i < info.output_types.size() ? info.output_types[i] : 0;
    KILN_ASSIGN_OR_RETURN(Tensor want, read_test_tensor(out_files[i], declared));
    const std::string diff = compare(outs[i], want, tol);
    if (!diff.empty())
      return invalid_argument(set.filename().string() + ": output " + std::to_string(i) + " '" +
                              graph_output_name(*g, static_cast<int>(i)) + "': " + diff);
  }
  return ok_status();
}

/// Runs one test folder; returns the outcome and a message, and the inputs the front end
/// bound as constants because kiln needs them at import.
std::pair<Outcome, std::string> run_test(const fs::path& test, const Config& cfg, const Tolerance& tol,
                                         Registry& reg, std::set<std::string>& frozen) {
  std::vector<fs::path> sets = sorted_entries(test, "test_data_set_");
  if (sets.empty()) return {Outcome::kSkip, "no test_data_set_* folder"};
  auto info = read_model_info((test / "model.onnx").string());
  if (!info.ok()) return {Outcome::kFail, info.status().message()};
  for (const fs::path& set : sets) {
    Status s = run_data_set(test, set, cfg, tol, *info, reg, frozen);
    if (!s.ok()) return {Outcome::kFail, s.message()};
  }
  return {Outcome::kPass, ""};
}

// --- lists ---------------------------------------------------------------------------------

/// Reads "name rest-of-line" entries, skipping blank lines and '#' comments.
StatusOr<std::map<std::string, std::string>> read_list(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found("cannot open '" + path + "'");
  std::map<std::string, std::string> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const size_t start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line[start] == '#') continue;
    const size_t end = line.find_first_of(" \t", start);
    const std::string name = line.substr(start, end - start);
    std::string rest = end == std::string::npos ? "" : line.substr(end);
    rest.erase(0, std::min(rest.size(), rest.find_first_not_of(" \t")));
    if (!out.emplace(name, rest).second)
      return invalid_argument(path + ":" + std::to_string(n) + ": '" + name + "' is listed twice");
  }
  return out;
}

StatusOr<std::map<std::string, std::string>> read_expected(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(auto list, read_list(path));
  for (const auto& [name, reason] : list)
    if (reason.empty()) return invalid_argument(path + ": '" + name + "' has no reason; give one per entry");
  return list;
}

StatusOr<std::map<std::string, Tolerance>> read_tolerances(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(auto list, read_list(path));
  std::map<std::string, Tolerance> out;
  for (const auto& [name, rest] : list) {
    std::istringstream in(rest);
    Tolerance t;
    if (!(in >> t.rtol >> t.atol))
      return invalid_argument(path + ": '" + name + "' needs 'rtol atol' after the name");
    out[name] = t;
  }
  return out;
}

// --- the parallel driver ---------------------------------------------------------------------

struct Running {
  pid_t pid;
  int fd;
  size_t index;
  std::chrono::steady_clock::time_point start;
  std::string buffer;
};

/// Forks a child for test `i`: it runs the test under a memory cap and writes
/// "<outcome>\n<frozen inputs>\n<message>" to the pipe.
std::optional<Running> start(size_t i, const fs::path& test, const Config& cfg, const Tolerance& tol,
                             Registry& reg) {
  int fds[2];
  if (pipe(fds) != 0) return std::nullopt;
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return std::nullopt;
  }
  if (pid == 0) {
    close(fds[0]);
    // A size guard: a test that tries to allocate beyond this fails instead of swapping.
    // (AddressSanitizer reserves terabytes of address space, so it runs without one.)
#if !defined(__SANITIZE_ADDRESS__)
    if (cfg.memory_limit_mib > 0) {
      const rlim_t bytes = static_cast<rlim_t>(cfg.memory_limit_mib) << 20;
      struct rlimit lim {bytes, bytes};
      setrlimit(RLIMIT_AS, &lim);
    }
#endif
    std::pair<Outcome, std::string> r;
    std::set<std::string> frozen;
    try {
      r = run_test(test, cfg, tol, reg, frozen);
    } catch (const std::exception& e) {
      r = {Outcome::kFail, std::string("exception: ") + e.what()};
    }
    std::string names;
    for (const std::string& n : frozen) names += (names.empty() ? "" : ",") + n;
    const std::string msg = std::to_string(static_cast<int>(r.first)) + "\n" + names + "\n" + r.second;
    for (size_t off = 0; off < msg.size();) {
      const ssize_t w = write(fds[1], msg.data() + off, msg.size() - off);
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
    _exit(0);
  }
  close(fds[1]);
  return Running{pid, fds[0], i, std::chrono::steady_clock::now(), {}};
}

Result finish(Running& r, const std::string& name, int status, bool timed_out, double timeout) {
  Result res;
  res.name = name;
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.start).count();
  if (timed_out) {
    res.message = "timed out after " + std::to_string(static_cast<int>(timeout)) + " s";
  } else if (WIFSIGNALED(status)) {
    res.message = std::string("crashed: ") + strsignal(WTERMSIG(status));
  } else if (r.buffer.empty()) {
    res.message = "the test process exited without a result";
  } else {
    const size_t nl = r.buffer.find('\n');
    const size_t nl2 = nl == std::string::npos ? nl : r.buffer.find('\n', nl + 1);
    res.outcome = static_cast<Outcome>(std::stoi(r.buffer.substr(0, nl)));
    if (nl2 != std::string::npos) {
      res.frozen = r.buffer.substr(nl + 1, nl2 - nl - 1);
      res.message = r.buffer.substr(nl2 + 1);
    }
  }
  return res;
}

std::vector<Result> run_all(const std::vector<fs::path>& tests, const Config& cfg,
                            const std::map<std::string, Tolerance>& tols, Registry& reg) {
  std::vector<Result> results(tests.size());
  std::vector<Running> running;
  size_t next = 0, done = 0;
  const int jobs = cfg.jobs > 0 ? cfg.jobs : std::max(1u, std::thread::hardware_concurrency());
  while (done < tests.size()) {
    while (next < tests.size() && static_cast<int>(running.size()) < jobs) {
      const std::string name = tests[next].filename().string();
      auto t = tols.find(name);
      auto r = start(next, tests[next], cfg, t == tols.end() ? Tolerance{} : t->second, reg);
      if (!r) {
        results[next] = {name, Outcome::kFail, "cannot start a test process", 0, ""};
        ++done;
      } else {
        running.push_back(std::move(*r));
      }
      ++next;
    }
    std::vector<pollfd> pfds;
    for (const Running& r : running) pfds.push_back({r.fd, POLLIN, 0});
    poll(pfds.data(), pfds.size(), 50);
    const auto now = std::chrono::steady_clock::now();
    for (size_t k = 0; k < running.size();) {
      Running& r = running[k];
      bool eof = false;
      if (pfds[k].revents & (POLLIN | POLLHUP | POLLERR)) {
        char buf[4096];
        const ssize_t n = read(r.fd, buf, sizeof buf);
        if (n > 0) r.buffer.append(buf, static_cast<size_t>(n));
        else eof = true;
      }
      const bool timed_out = !eof && std::chrono::duration<double>(now - r.start).count() > cfg.timeout;
      if (!eof && !timed_out) {
        ++k;
        continue;
      }
      if (timed_out) kill(r.pid, SIGKILL);
      int status = 0;
      waitpid(r.pid, &status, 0);
      close(r.fd);
      results[r.index] = finish(r, tests[r.index].filename().string(), status, timed_out, cfg.timeout);
      ++done;
      if (cfg.verbose) {
        const Result& res = results[r.index];
        std::cout << (res.outcome == Outcome::kPass ? "PASS " : res.outcome == Outcome::kSkip ? "SKIP " : "FAIL ")
                  << res.name << (res.message.empty() ? "" : ": " + res.message) << std::endl;
      }
      running.erase(running.begin() + static_cast<std::ptrdiff_t>(k));
      pfds.erase(pfds.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  return results;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\', o += static_cast<char>(ch);
    else if (ch == '\n') o += "\\n";
    else if (ch < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", ch);
      o += b;
    } else o += static_cast<char>(ch);
  }
  return o;
}

bool write_report(const std::string& path, const Config& cfg, const std::vector<Result>& results,
                  int passed, int failed, int skipped) {
  std::ofstream out(path);
  out << "{\n  \"data_dir\": \"" << json_escape(cfg.data_dir) << "\",\n  \"backend\": \"" << json_escape(cfg.backend)
      << "\",\n  \"passed\": " << passed << ",\n  \"failed\": " << failed << ",\n  \"skipped\": " << skipped
      << ",\n  \"tests\": [\n";
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const char* o = r.outcome == Outcome::kPass ? "pass" : r.outcome == Outcome::kSkip ? "skip" : "fail";
    out << "    {\"name\": \"" << json_escape(r.name) << "\", \"outcome\": \"" << o << "\", \"seconds\": " << r.seconds
        << ", \"inputs_bound_at_import\": \"" << json_escape(r.frozen) << "\", \"message\": \""
        << json_escape(r.message) << "\"}" << (i + 1 < results.size() ? "," : "") << "\n";
  }
  out << "  ]\n}\n";
  return static_cast<bool>(out);
}

int fail(const std::string& msg) {
  std::cerr << "kiln-onnx-conformance: error: " << msg << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> std::optional<std::string> {
      if (i + 1 >= args.size()) return std::nullopt;
      return args[++i];
    };
    std::optional<std::string> v;
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      return 0;
    } else if (a == "--verbose" || a == "-v") {
      cfg.verbose = true;
    } else if (a == "--backend" || a == "--filter" || a == "--report" || a == "--expected-failures" ||
               a == "--tolerances" || a == "--jobs" || a == "--timeout" || a == "--memory-limit") {
      if (!(v = value())) return fail("option " + a + " needs a value");
      try {
        if (a == "--backend") cfg.backend = *v;
        else if (a == "--report") cfg.report = *v;
        else if (a == "--expected-failures")
          cfg.expected_paths.push_back(*v);
        else if (a == "--tolerances") cfg.tolerance_path = *v;
        else if (a == "--jobs") cfg.jobs = std::stoi(*v);
        else if (a == "--timeout") cfg.timeout = std::stod(*v);
        else if (a == "--memory-limit") cfg.memory_limit_mib = std::stoll(*v);
        else {
          cfg.filter_text = *v;
          cfg.filter = std::regex(*v);
        }
      } catch (const std::exception&) {
        return fail("invalid value '" + *v + "' for " + a);
      }
    } else if (!a.empty() && a[0] == '-') {
      return fail("unknown option '" + a + "'\n" + kUsage);
    } else if (cfg.data_dir.empty()) {
      cfg.data_dir = a;
    } else {
      return fail("unexpected argument '" + a + "'");
    }
  }
  if (cfg.data_dir.empty()) return fail(std::string("missing DATA_DIR\n") + kUsage);
  if (!(cfg.timeout > 0) || cfg.jobs < 0 || cfg.memory_limit_mib < 0)
    return fail("--timeout must be positive, --jobs and --memory-limit not negative");

  Registry& reg = Registry::global();
  if (Status s = load_plugins_from({}, reg); !s.ok()) return fail(s.message());
  if (auto fe = reg.frontend("onnx"); !fe.ok()) return fail(fe.status().message());
  // The pipeline's backend stage syntax, e.g. cpu{threads=1}, validated against its options.
  const std::string stage_form =
      "--backend '" + cfg.backend + "': expected NAME or NAME{OPTION=VALUE,...}";
  if (cfg.backend.find_first_of("|@") != std::string::npos) return fail(stage_form);
  const std::string before = "| | ";
  auto backend = parse_pipeline_string(before + cfg.backend, reg);
  if (!backend.ok()) {
    // The error's column counts from the start of the pipeline text: from --backend's instead.
    std::string why = backend.status().message();
    const std::string at = "<pipeline>:1:";
    if (const size_t colon = why.find(':', at.size());
        why.starts_with(at) && colon != std::string::npos) {
      const int col = std::atoi(why.c_str() + at.size()) - static_cast<int>(before.size());
      why = "column " + std::to_string(std::max(col, 1)) + why.substr(colon);
    }
    return fail("--backend '" + cfg.backend + "': " + why);
  }
  if (backend->backend.name.empty()) return fail(stage_form);
  cfg.backend_stage = backend->backend;
  std::map<std::string, std::string> expected, listed_in;
  std::map<std::string, Tolerance> tols;
  for (const std::string& path : cfg.expected_paths) {
    auto e = read_expected(path);
    if (!e.ok()) return fail(e.status().message());
    for (const auto& [name, reason] : *e) {
      if (auto [it, fresh] = listed_in.emplace(name, path); !fresh)
        return fail("'" + name + "' is listed in both " + it->second + " and " + path);
      expected[name] = reason;
    }
  }
  if (!cfg.tolerance_path.empty()) {
    auto t = read_tolerances(cfg.tolerance_path);
    if (!t.ok()) return fail(t.status().message());
    tols = *t;
  }

  std::vector<fs::path> tests;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(cfg.data_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!fs::is_regular_file(e.path() / "model.onnx")) continue;
    if (cfg.filter && !std::regex_search(name, *cfg.filter)) continue;
    tests.push_back(e.path());
  }
  if (ec) return fail("cannot read '" + cfg.data_dir + "': " + ec.message());
  std::sort(tests.begin(), tests.end());
  std::set<std::string> names;
  for (const auto& t : tests) names.insert(t.filename().string());

  const std::vector<Result> results = run_all(tests, cfg, tols, reg);
  int passed = 0, failed = 0, skipped = 0, bound = 0;
  std::vector<std::string> unexpected_fail, unexpected_pass;
  for (const Result& r : results) {
    bound += !r.frozen.empty();
    const bool listed = expected.count(r.name) != 0;
    if (r.outcome == Outcome::kPass) {
      ++passed;
      if (listed) unexpected_pass.push_back(r.name);
    } else if (r.outcome == Outcome::kSkip) {
      ++skipped;
    } else {
      ++failed;
      if (!listed) unexpected_fail.push_back(r.name);
      if (!cfg.verbose && (!listed || cfg.expected_paths.empty()))
        std::cout << "FAIL " << r.name << ": " << r.message << "\n";
    }
  }
  std::vector<std::string> stale;
  if (!cfg.filter)
    for (const auto& [name, reason] : expected)
      if (!names.count(name)) stale.push_back(name);
  if (!cfg.report.empty() && !write_report(cfg.report, cfg, results, passed, failed, skipped))
    return fail("cannot write report '" + cfg.report + "'");

  int rc = failed > 0 ? 1 : 0;
  if (!cfg.expected_paths.empty()) {
    for (const auto& n : unexpected_fail) std::cout << "unexpected failure: " << n << "\n";
    for (const auto& n : unexpected_pass)
      std::cout << "unexpected pass (remove it from " << listed_in[n] << "): " << n << "\n";
    for (const auto& n : stale)
      std::cout << "listed test does not exist: " << n << " (" << listed_in[n] << ")\n";
    rc = unexpected_fail.empty() && unexpected_pass.empty() && stale.empty() ? 0 : 1;
  }
  if (bound > 0)
    std::cout << "note: " << bound << " tests had inputs kiln needs at import (shapes, axes, counts) bound as constants"
              << (cfg.report.empty() ? "" : " (see inputs_bound_at_import in the report)") << "\n";
  std::cout << passed << " passed, " << failed << " failed, " << skipped << " skipped" << std::endl;
  return rc;
}
