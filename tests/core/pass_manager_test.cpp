// The pass manager: order, options, verification, IR printing, timing and reproducers.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "kiln/core/loader.h"
#include "kiln/core/pass_manager.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

TensorType f32(Shape s) { return TensorType{DType::kF32, std::move(s)}; }

/// A pass made of a function, so each test states what its passes do in one line.
class FnPass final : public Pass {
 public:
  explicit FnPass(std::function<StatusOr<bool>(Graph&)> fn) : fn_(std::move(fn)) {}
  StatusOr<bool> run(Graph& g) override { return fn_(g); }

 private:
  std::function<StatusOr<bool>(Graph&)> fn_;
};

/// Appends `count` neg nodes after output 0 (each run changes the graph).
StatusOr<bool> append_negs(Graph& g, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    Value* out = g.output(0);
    KILN_ASSIGN_OR_RETURN(Node * n, g.create_node("neg", {out}, {out->type()}));
    g.set_output(0, n->result());
  }
  return count > 0;
}

/// A registry holding the test passes:
///   append-neg{count=1}  appends negs         noop         changes nothing
///   fail                 returns an error     break-types  leaves a wrong result type
///   bad-create           cannot be created
Registry make_registry() {
  Registry reg;
  auto add = [&](std::string name, std::vector<OptionSpec> opts,
                 std::function<StatusOr<std::unique_ptr<Pass>>(const Options&)> create) {
    PassInfo info;
    info.name = std::move(name);
    info.version = "0.1.0";
    info.summary = "test pass";
    info.options = std::move(opts);
    info.create = std::move(create);
    REQUIRE(reg.add_pass(std::move(info)).ok());
  };
  auto make = [](std::function<StatusOr<bool>(Graph&)> fn) -> StatusOr<std::unique_ptr<Pass>> {
    return std::unique_ptr<Pass>(std::make_unique<FnPass>(std::move(fn)));
  };
  add("append-neg", {{"count", OptionType::kInt, int64_t{1}, "how many"}},
      [make](const Options& o) {
        const int64_t count = o.get_int("count");
        return make([count](Graph& g) { return append_negs(g, count); });
      });
  add("noop", {}, [make](const Options&) { return make([](Graph&) { return false; }); });
  add("fail", {}, [make](const Options&) {
    return make([](Graph&) -> StatusOr<bool> {
      return invalid_argument("told to fail\nsecond line");
    });
  });
  add("break-types", {}, [make](const Options&) {
    return make([](Graph& g) -> StatusOr<bool> {
      g.node_list().front()->result()->set_type(TensorType{DType::kF64, {2}});
      return true;
    });
  });
  add("bad-create", {}, [](const Options&) -> StatusOr<std::unique_ptr<Pass>> {
    return invalid_argument("bad-create: cannot be created");
  });
  return reg;
}

/// graph(%x: f32[2]) -> relu(%x)
std::unique_ptr<Graph> make_graph() {
  auto g = std::make_unique<Graph>("g");
  Value* x = g->add_input("x", f32({2}));
  auto relu = g->create_node("relu", {x}, {f32({2})});
  REQUIRE(relu.ok());
  g->set_outputs({(*relu)->result()});
  return g;
}

/// Options with the given changes applied to the defaults.
PassManagerOptions with(const std::function<void(PassManagerOptions&)>& change) {
  PassManagerOptions o;
  change(o);
  return o;
}

StageSpec stage(std::string name, std::map<std::string, OptionValue> opts = {}) {
  StageSpec s;
  s.name = std::move(name);
  for (auto& [k, v] : opts) s.options.set(k, v);
  return s;
}

/// A fresh empty folder for reproducers.
std::string temp_dir(const std::string& tag) {
  fs::path p = fs::temp_directory_path() /
               ("kiln-pm-test-" + std::to_string(::getpid()) + "-" + tag);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

/// The path after "; reproducer written to ", or "" when the message has none.
std::string reproducer_path(const Status& s) {
  const std::string marker = "; reproducer written to ";
  const size_t at = s.message().rfind(marker);
  return at == std::string::npos ? "" : s.message().substr(at + marker.size());
}

}  // namespace

TEST_CASE("passes run in order with their options, and timings record each one") {
  Registry reg = make_registry();
  auto g = make_graph();
  PassManager pm(reg, {});
  REQUIRE(pm.run(*g, {stage("append-neg", {{"count", int64_t{2}}}), stage("noop"),
                      stage("append-neg")},
                 "p")
              .ok());
  CHECK(g->num_nodes() == 4);  // relu + 2 + 1
  CHECK(verify(*g).ok());
  REQUIRE(pm.timings().size() == 3);
  CHECK(pm.timings()[0].pass == "append-neg{count=2}");
  CHECK(pm.timings()[0].changed);
  CHECK(pm.timings()[1].pass == "noop");
  CHECK_FALSE(pm.timings()[1].changed);
  CHECK(pm.timings()[2].pass == "append-neg");
  for (const PassTiming& t : pm.timings()) CHECK(t.seconds >= 0);
}

TEST_CASE("print-ir-after-all prints every pass, after-change only changing ones") {
  Registry reg = make_registry();
  const std::vector<StageSpec> passes = {stage("noop"), stage("append-neg")};
  {
    auto g = make_graph();
    std::ostringstream log;
    PassManager pm(reg, with([&](auto& o) { o.print_ir_after_all = true; o.log = &log; }));
    REQUIRE(pm.run(*g, passes, "p").ok());
    auto before = make_graph();
    const std::string expected = "// ----- IR after noop -----\n" + print_graph(*before) +
                                 "// ----- IR after append-neg -----\n" + print_graph(*g);
    CHECK(log.str() == expected);
  }
  {
    auto g = make_graph();
    std::ostringstream log;
    PassManager pm(reg, with([&](auto& o) { o.print_ir_after_change = true; o.log = &log; }));
    REQUIRE(pm.run(*g, passes, "p").ok());
    CHECK(log.str() == "// ----- IR after append-neg -----\n" + print_graph(*g));
  }
}

TEST_CASE("timing prints a table with a row per pass and a total") {
  Registry reg = make_registry();
  auto g = make_graph();
  std::ostringstream log;
  PassManager pm(reg, with([&](auto& o) { o.timing = true; o.log = &log; }));
  REQUIRE(pm.run(*g, {stage("append-neg"), stage("noop")}, "p").ok());
  std::vector<std::string> lines;
  std::istringstream in(log.str());
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  REQUIRE(lines.size() == 5);
  CHECK(lines[0] == "// ----- pass timing -----");
  CHECK(lines[1].rfind("pass ", 0) == 0);
  CHECK(lines[1].find("seconds") != std::string::npos);
  CHECK(lines[1].find("changed") != std::string::npos);
  CHECK(lines[2].rfind("append-neg ", 0) == 0);
  CHECK(lines[2].substr(lines[2].size() - 3) == "yes");
  CHECK(lines[3].rfind("noop ", 0) == 0);
  CHECK(lines[3].substr(lines[3].size() - 2) == "no");
  CHECK(lines[4].rfind("total ", 0) == 0);
  CHECK(lines[4].find("100.0%") != std::string::npos);
}

TEST_CASE("a failing pass stops the pipeline and writes a reproducer of the input IR") {
  Registry reg = make_registry();
  const std::string dir = temp_dir("fail");
  auto g = make_graph();
  const std::string input_ir = print_graph(*g);
  PassManager pm(
      reg, with([&](auto& o) {
        o.reproducer_dir = dir;
        o.reproducer_plugin_paths = {"/opt/kiln plugins", "/home/me/build/kiln-plugin-x.so"};
      }));
  Status s = pm.run(*g, {stage("append-neg"), stage("fail"), stage("append-neg")},
                    "kir | append-neg,fail,append-neg | reference");
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().rfind("pass 'fail' failed: told to fail\nsecond line; reproducer written to " +
                              dir + "/kiln-reproducer-" + std::to_string(::getpid()) + "-",
                          0) == 0);
  CHECK(pm.timings().size() == 2);  // the third pass never ran

  const std::string path = reproducer_path(s);
  REQUIRE(fs::exists(path));
  CHECK(fs::path(path).extension() == ".kir");
  std::vector<std::string> lines = read_lines(path);
  REQUIRE(lines.size() > 3);
  CHECK(lines[0] == "// kiln-reproducer: pipeline = \"kir | append-neg,fail,append-neg | reference\"");
  CHECK(lines[1] ==
        "// kiln-reproducer: plugin-paths = [\"/opt/kiln plugins\", "
        "/home/me/build/kiln-plugin-x.so]");
  CHECK(lines[2] == "// failed: fail: told to fail");
  // The rest is the IR as it entered the pipeline (before append-neg ran), and parses.
  std::ifstream in(path);
  std::stringstream all;
  all << in.rdbuf();
  const std::string text = all.str();
  CHECK(text.substr(text.find("graph @")) == input_ir);
  auto parsed = parse_graph(text, path);
  REQUIRE_MESSAGE(parsed.ok(), parsed.status().message());
  CHECK(print_graph(**parsed) == input_ir);
  fs::remove_all(dir);
}

TEST_CASE("a verifier failure after a pass names the pass and writes a reproducer") {
  Registry reg = make_registry();
  const std::string dir = temp_dir("verify");
  auto g = make_graph();
  PassManager pm(reg, with([&](auto& o) { o.reproducer_dir = dir; }));
  Status s = pm.run(*g, {stage("noop"), stage("break-types")}, "break-types");
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == StatusCode::kInternal);
  CHECK(s.message().rfind("verifier failed after pass 'break-types': ", 0) == 0);
  const std::string path = reproducer_path(s);
  REQUIRE(fs::exists(path));
  std::vector<std::string> lines = read_lines(path);
  REQUIRE(lines.size() > 3);
  CHECK(lines[2].rfind("// failed: break-types: verifier failed: ", 0) == 0);

  // Two failures in one process get two files.
  auto g2 = make_graph();
  Status s2 = pm.run(*g2, {stage("break-types")}, "break-types");
  CHECK(reproducer_path(s2) != path);
  CHECK(fs::exists(reproducer_path(s2)));
  fs::remove_all(dir);
}

TEST_CASE("without verify-each a broken graph passes through") {
  Registry reg = make_registry();
  auto g = make_graph();
  PassManager pm(reg, with([](auto& o) { o.verify_each = false; }));
  CHECK(pm.run(*g, {stage("break-types")}, "p").ok());
  CHECK_FALSE(verify(*g).ok());
}

TEST_CASE("an unwritable reproducer folder is reported in the message") {
  Registry reg = make_registry();
  auto g = make_graph();
  PassManager pm(reg, with([](auto& o) { o.reproducer_dir = "/nonexistent/kiln/folder"; }));
  Status s = pm.run(*g, {stage("fail")}, "fail");
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().rfind("pass 'fail' failed: told to fail\nsecond line; could not write a "
                          "reproducer: cannot write reproducer "
                          "'/nonexistent/kiln/folder/kiln-reproducer-",
                          0) == 0);
  CHECK(s.message().substr(s.message().size() - 5) == ".kir'");
}

TEST_CASE("unknown passes, bad options and failed creation fail before any pass runs") {
  Registry reg = make_registry();
  auto g = make_graph();
  const std::string before = print_graph(*g);
  PassManager pm(reg, {});

  Status unknown = pm.run(*g, {stage("append-neg"), stage("nosuchpass")}, "p");
  CHECK(unknown.code() == StatusCode::kNotFound);
  CHECK(unknown.message().find("unknown pass 'nosuchpass'; registered passes: append-neg, ") == 0);
  CHECK(unknown.message().find("; a plugin may provide it: load plugins with --plugin-path DIR") !=
        std::string::npos);

  Status bad_opt = pm.run(*g, {stage("append-neg", {{"cuont", int64_t{2}}})}, "p");
  CHECK(bad_opt.code() == StatusCode::kInvalidArgument);
  CHECK(bad_opt.message().find("'cuont'") != std::string::npos);

  Status bad_type = pm.run(*g, {stage("append-neg", {{"count", std::string("two")}})}, "p");
  CHECK(bad_type.code() == StatusCode::kInvalidArgument);
  CHECK(bad_type.message().find("count") != std::string::npos);

  Status no_create = pm.run(*g, {stage("append-neg"), stage("bad-create")}, "p");
  CHECK(no_create.message() == "bad-create: cannot be created");

  CHECK(print_graph(*g) == before);
  CHECK(pm.timings().empty());
}

TEST_CASE("an input graph that does not verify is refused up front") {
  Registry reg = make_registry();
  auto g = make_graph();
  g->node_list().front()->result()->set_type(TensorType{DType::kF64, {2}});
  PassManager pm(reg, {});
  Status s = pm.run(*g, {stage("noop")}, "noop");
  CHECK(s.message().rfind("verifier failed on the input graph: ", 0) == 0);
  CHECK(reproducer_path(s).empty());
  CHECK(pm.timings().empty());
}

TEST_CASE("read_reproducer reads back what the pass manager wrote") {
  Registry reg = make_registry();
  const std::string dir = temp_dir("read");
  auto g = make_graph();
  const std::vector<std::string> paths = {"/a/plugins", "/b c/kiln-plugin-\"q\".so", "true"};
  PassManager pm(reg, with([&](auto& o) {
                   o.reproducer_dir = dir;
                   o.reproducer_plugin_paths = paths;
                 }));
  const std::string pipeline =
      "kir | noop,fail{label=\"x | y\"} | reference | plugins{paths=[/a/plugins]}";
  const std::string path = reproducer_path(pm.run(*g, {stage("noop"), stage("fail")}, pipeline));
  auto r = read_reproducer(path);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r->pipeline == pipeline);
  CHECK(r->plugin_paths == paths);
  CHECK(r->failure == "fail: told to fail");
  fs::remove_all(dir);
}

TEST_CASE("a reproducer records the plugin paths this process loaded from by default") {
  Registry reg = make_registry();
  const std::string dir = temp_dir("used");
  const std::string fixture = std::string(KILN_BINARY_DIR) + "/fixtures/good";
  Registry plugins;
  REQUIRE(load_plugins({fixture, fixture + "/../no-such-folder"}, plugins).ok());
  const std::vector<std::string> used = plugin_paths_used();
  CHECK(std::find(used.begin(), used.end(), fs::path(fixture).lexically_normal().string()) !=
        used.end());
  // Folders that did not exist are left out, and nothing is listed twice.
  for (const auto& p : used) CHECK(p.find("no-such-folder") == std::string::npos);
  REQUIRE(load_plugins({fixture}, plugins).ok());
  CHECK(plugin_paths_used() == used);

  auto g = make_graph();
  PassManager pm(reg, with([&](auto& o) { o.reproducer_dir = dir; }));
  auto r = read_reproducer(reproducer_path(pm.run(*g, {stage("fail")}, "fail")));
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r->plugin_paths == used);
  fs::remove_all(dir);
}

TEST_CASE("read_reproducer refuses what is not a reproducer, naming the file") {
  const std::string dir = temp_dir("bad");
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  const std::string graph = "graph @g(%x: f32[2]) -> (f32[2]) {\n  return %x\n}\n";
  CHECK(read_reproducer(dir + "/missing.kir").status().message() ==
        "cannot open reproducer '" + dir + "/missing.kir': No such file or directory");
  const std::string plain = write("plain.kir", "// just a comment\n" + graph);
  CHECK(
      read_reproducer(plain).status().message() ==
      plain +
          ": not a kiln reproducer (no '// kiln-reproducer: pipeline = \"...\"' line at the top)");
  // Header lines below the IR do not count.
  CHECK_FALSE(
      read_reproducer(write("late.kir", graph + "// kiln-reproducer: pipeline = \"cse\"\n")).ok());
  const std::string unquoted =
      write("unquoted.kir", "// kiln-reproducer: pipeline = cse\n" + graph);
  CHECK(read_reproducer(unquoted).status().message() ==
        unquoted + ":1:32: expected pipeline = \"...\"");
  const std::string bad_paths = write("paths.kir",
                                      "// kiln-reproducer: pipeline = \"cse\"\n"
                                      "// kiln-reproducer: plugin-paths = [1, 2]\n" +
                                          graph);
  CHECK(read_reproducer(bad_paths).status().message() ==
        bad_paths + ":2:36: plugin-paths must be a list of strings, like [/a, \"/b c\"]");
  // Without plugin-paths (older reproducers) and with keys it does not know, it still reads.
  auto old = read_reproducer(write("old.kir",
                                   "// kiln-reproducer: pipeline = \"kir | cse |\"\n"
                                   "// kiln-reproducer: from-the-future = 1\n"
                                   "// failed: cse: boom\n" +
                                       graph));
  REQUIRE_MESSAGE(old.ok(), old.status().message());
  CHECK(old->pipeline == "kir | cse |");
  CHECK(old->plugin_paths.empty());
  CHECK(old->failure == "cse: boom");
  fs::remove_all(dir);
}
