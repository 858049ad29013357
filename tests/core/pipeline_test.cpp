// Tests for pipelines: the TOML reader, its located errors, the one-line form and round trips.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>

#include "kiln/core/pipeline.h"
#include "kiln/ir/spelling.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

/// What every unknown-plugin message ends with.
const std::string hint = "; " + std::string(kPluginHint);

class NoOpPass final : public Pass {
 public:
  StatusOr<bool> run(Graph&) override { return false; }
};

/// A registry shaped like the in-tree plugins, plus a pass with every option type.
const Registry& test_registry() {
  static const Registry* reg = [] {
    auto* r = new Registry;
    auto pass = [&](std::string name, std::vector<OptionSpec> opts) {
      PassInfo p;
      p.name = std::move(name);
      p.options = std::move(opts);
      p.create = [](const Options&) -> StatusOr<std::unique_ptr<Pass>> { return std::unique_ptr<Pass>(std::make_unique<NoOpPass>()); };
      REQUIRE(r->add_pass(std::move(p)).ok());
    };
    pass("canonicalize", {{"max-iterations", OptionType::kInt, int64_t{10}, ""},
                          {"fold-limit-bytes", OptionType::kInt, int64_t{1} << 20, ""}});
    pass("cse", {});
    pass("dce", {});
    pass("all-types", {{"flag", OptionType::kBool, false, ""},
                       {"count", OptionType::kInt, int64_t{3}, ""},
                       {"ratio", OptionType::kFloat, 0.5, ""},
                       {"label", OptionType::kString, std::string("x"), ""},
                       {"tags", OptionType::kStringList, std::vector<std::string>{}, ""},
                       {"sizes", OptionType::kIntList, std::vector<int64_t>{1, 2}, ""}});
    FrontendInfo fe;
    fe.name = "kir";
    fe.extensions = {".kir"};
    fe.options = {{"strict", OptionType::kBool, true, ""}};
    fe.import = [](const std::string&, const Options&) -> StatusOr<std::unique_ptr<Graph>> { return std::make_unique<Graph>(); };
    REQUIRE(r->add_frontend(std::move(fe)).ok());
    auto backend = [&](std::string name, std::vector<std::string> targets, std::vector<OptionSpec> opts) {
      BackendInfo b;
      b.name = std::move(name);
      b.targets = std::move(targets);
      b.options = std::move(opts);
      b.create = [](const Options&) -> StatusOr<std::unique_ptr<Backend>> { return unimplemented("test"); };
      REQUIRE(r->add_backend(std::move(b)).ok());
    };
    backend("reference", {"cpu"}, {});
    backend("cuda", {"sm_80", "sm_90a"}, {{"opt-level", OptionType::kInt, int64_t{2}, ""}});
    return r;
  }();
  return *reg;
}

StatusOr<Pipeline> toml(std::string_view text) { return parse_pipeline_toml(text, "p.toml", test_registry()); }

std::string toml_error(std::string_view text) {
  auto p = toml(text);
  return p.ok() ? "(no error)" : p.status().message();
}

std::string line_error(std::string_view text) {
  auto p = parse_pipeline_string(text, test_registry());
  return p.ok() ? "(no error)" : p.status().message();
}

/// canonical() then parse_pipeline_string() gives back the same pipeline and the same text.
void check_round_trip(const Pipeline& p) {
  const std::string line = p.canonical(test_registry());
  CAPTURE(line);
  auto back = parse_pipeline_string(line, test_registry());
  REQUIRE(back.ok());
  CHECK(*back == p);
  CHECK(back->canonical(test_registry()) == line);
}

}  // namespace

TEST_CASE("pipeline TOML: the full form") {
  auto p = toml(R"(frontend = "kir"
[[passes]]
name = "canonicalize"
options = { max-iterations = 4 }
[[passes]]
name = "cse"
[backend]
name = "cuda"
targets = ["sm_90a", "sm_80"]
options = { opt-level = 3 }
[runtime]
threads = 4
cuda-graphs = false
device = "cuda:1"
)");
  REQUIRE(p.ok());
  CHECK(p->frontend.name == "kir");
  CHECK(p->frontend.options.get_bool("strict"));
  CHECK(p->frontend.loc.str() == "p.toml:1:13");  // the name, inside the quotes
  REQUIRE(p->passes.size() == 2);
  CHECK(p->passes[0].name == "canonicalize");
  CHECK(p->passes[0].options.get_int("max-iterations") == 4);
  CHECK(p->passes[0].options.get_int("fold-limit-bytes") == 1 << 20);
  CHECK(p->passes[0].loc.str() == "p.toml:3:8");
  CHECK(p->passes[1].name == "cse");
  CHECK(p->backend.name == "cuda");
  CHECK(p->backend.options.get_int("opt-level") == 3);
  CHECK(p->targets == std::vector<std::string>{"sm_90a", "sm_80"});
  CHECK(p->runtime.threads == 4);
  CHECK_FALSE(p->runtime.cuda_graphs);
  CHECK(p->runtime.device == "cuda:1");
  CHECK(p->plugin_paths.empty());
  CHECK(p->canonical(test_registry()) ==
        "kir | canonicalize{max-iterations=4},cse | cuda{opt-level=3}@sm_90a,sm_80 | runtime{cuda-graphs=false,device=cuda:1,threads=4}");
  check_round_trip(*p);
}

TEST_CASE("pipeline TOML: short forms and defaults") {
  auto p = toml(R"(passes = ["canonicalize{max-iterations=2}", "dce"]
backend = "reference")");
  REQUIRE(p.ok());
  CHECK(p->frontend.name == "");
  REQUIRE(p->passes.size() == 2);
  CHECK(p->passes[0].options.get_int("max-iterations") == 2);
  CHECK(p->passes[1].loc.str() == "p.toml:1:46");  // inside the string, past its quote
  CHECK(p->backend.name == "reference");
  CHECK(p->runtime == RuntimeSettings{});
  CHECK(p->canonical(test_registry()) == "| canonicalize{max-iterations=2},dce | reference");
  check_round_trip(*p);

  auto table = toml("[frontend]\nname = \"kir\"\noptions = { strict = false }\n");
  REQUIRE(table.ok());
  CHECK_FALSE(table->frontend.options.get_bool("strict"));
  CHECK(table->canonical(test_registry()) == "kir{strict=false} | |");
  check_round_trip(*table);

  auto empty = toml("");
  REQUIRE(empty.ok());
  CHECK(empty->canonical(test_registry()) == "| |");
  check_round_trip(*empty);
}

TEST_CASE("pipeline TOML: option values of every type") {
  auto p = toml(R"([[passes]]
name = "all-types"
options = { flag = true, count = -5, ratio = 2, label = "two words", tags = ["a", "b,c"], sizes = [] }
)");
  REQUIRE(p.ok());
  const Options& o = p->passes[0].options;
  CHECK(o.get_bool("flag"));
  CHECK(o.get_int("count") == -5);
  CHECK(o.get_float("ratio") == 2.0);
  CHECK(o.get_string("label") == "two words");
  CHECK(o.get_strings("tags") == std::vector<std::string>{"a", "b,c"});
  CHECK(o.get_ints("sizes").empty());
  CHECK(p->canonical(test_registry()) ==
        "| all-types{count=-5,flag=true,label=\"two words\",ratio=2.0,sizes=[],tags=[a, \"b,c\"]} |");
  check_round_trip(*p);
}

TEST_CASE("pipeline TOML: errors point at file:line:col") {
  CHECK(toml_error("frontend = \"kir\"\n[[passes]]\nname = \"canonicalize\"\noptions = { max-iteration = 4 }\n") ==
        "p.toml:4:13: unknown option 'max-iteration' for pass 'canonicalize' (did you mean 'max-iterations'?); "
        "known: max-iterations, fold-limit-bytes");
  CHECK(toml_error("[[passes]]\nname = \"canonicalize\"\noptions = { max-iterations = \"4\" }\n") ==
        "p.toml:3:30: option 'max-iterations' for pass 'canonicalize' expects int, got string \"4\"");
  CHECK(toml_error("passes = [\"cse\", \"csee\"]") ==
        "p.toml:1:19: unknown pass 'csee' (did you mean 'cse'?); registered passes: all-types, "
        "canonicalize, cse, dce" +
            hint);
  CHECK(toml_error("[[passes]]\nname = \"nope\"") ==
        "p.toml:2:8: unknown pass 'nope'; registered passes: all-types, canonicalize, cse, dce" +
            hint);
  CHECK(toml_error("passes = [\"cse{x=1}\"]") == "p.toml:1:16: unknown option 'x' for pass 'cse'; it takes no options");
  CHECK(toml_error("frontend = \"kir\"\npass = [\"cse\"]\n") ==
        "p.toml:2:1: unknown key 'pass' in the pipeline; expected one of: frontend, passes, parallel, backend, runtime, plugins");
  CHECK(toml_error("[backend]\nname = \"reference\"\ntarget = [\"cpu\"]\n") ==
        "p.toml:3:1: unknown key 'target' in [backend]; expected one of: name, targets, options");
  CHECK(toml_error("[backend]\nname = \"reference\"\ntargets = [\"sm_90a\"]\n") ==
        "p.toml:3:12: backend 'reference' cannot build for target 'sm_90a'; its targets: cpu");
  CHECK(toml_error("[backend]\ntargets = [\"cpu\"]\n") == "p.toml:1:1: [backend] lacks 'name'");
  CHECK(toml_error("[[passes]]\nname = 3\n") == "p.toml:2:8: 'name' in [[passes]] must be a string, got integer");
  CHECK(toml_error("passes = \"cse\"") ==
        "p.toml:1:10: 'passes' must be an array of pass names or [[passes]] tables, got string");
  CHECK(toml_error("[[passes]]\nname = \"all-types\"\noptions = { sizes = [1, \"a\"] }") ==
        "p.toml:3:21: option 'sizes': arrays must hold only integers or only strings");
  CHECK(toml_error("[[passes]]\nname = \"all-types\"\noptions = { label = { a = 1 } }") ==
        "p.toml:3:21: option 'label': unsupported value type table");
  CHECK(toml_error("[[passes]]\nname = \"cse\"\noptions = 3") == "p.toml:3:11: 'options' of pass 'cse' must be a table, got integer");
  CHECK(toml_error("[runtime]\nthreads = -1\n") == "p.toml:1:1: runtime 'threads' must be >= 0");
  CHECK(toml_error("[runtime]\nthreads = \"4\"\n") ==
        "p.toml:2:11: option 'threads' for runtime settings expects int, got string \"4\"");
  CHECK(toml_error("[runtime]\ngraphs = true\n") ==
        "p.toml:2:1: unknown key 'graphs' in [runtime]; expected one of: threads, cuda-graphs, device");
  CHECK(toml_error("[plugins]\npaths = [1]\n") == "p.toml:2:10: 'paths' in [plugins] entries must be a string, got integer");
  // TOML syntax errors carry the parser's location.
  const std::string syntax = toml_error("passes = [\"cse\",\n");
  CHECK(syntax.starts_with("p.toml:"));
  CHECK(syntax.find(": error while parsing array") != std::string::npos);
  CHECK(toml_error("a = 1\na = 2\n").starts_with("p.toml:2:"));
}

TEST_CASE("pipeline files: plugin paths are relative to the file") {
  const fs::path dir = fs::temp_directory_path() / ("kiln-pipeline-test-" + std::to_string(::getpid()));
  fs::create_directories(dir / "sub");
  const std::string file = (dir / "sub" / "p.toml").string();
  std::ofstream(file) << "passes = [\"cse\"]\n[plugins]\npaths = [\"plugins\", \"../more\", \"/abs/x\"]\n";
  auto paths = read_pipeline_plugin_paths(file);
  REQUIRE(paths.ok());
  CHECK(*paths == std::vector<std::string>{(dir / "sub" / "plugins").string(), (dir / "more").string(), "/abs/x"});
  auto p = load_pipeline_file(file, test_registry());
  REQUIRE(p.ok());
  CHECK(p->plugin_paths == *paths);
  CHECK(p->passes.size() == 1);
  check_round_trip(*p);

  auto missing = load_pipeline_file((dir / "nope.toml").string(), test_registry());
  CHECK(missing.status().code() == StatusCode::kIoError);
  CHECK(missing.status().message() == "cannot open pipeline '" + (dir / "nope.toml").string() + "': No such file or directory");
  CHECK(load_pipeline_file(dir.string(), test_registry()).status().message() ==
        "cannot read pipeline '" + dir.string() + "': it is a directory");
  std::ofstream(file) << "[plugins]\npaths = \"x\"\n";
  CHECK(read_pipeline_plugin_paths(file).status().message() ==
        file + ":2:9: 'paths' in [plugins] must be an array of strings, got string");
  fs::remove_all(dir);
}

TEST_CASE("one-line form: parse and canonical") {
  auto p = parse_pipeline_string(" kir |canonicalize{ max-iterations = 3 }, cse| reference @ cpu ", test_registry());
  REQUIRE(p.ok());
  CHECK(p->frontend.name == "kir");
  REQUIRE(p->passes.size() == 2);
  CHECK(p->passes[0].options.get_int("max-iterations") == 3);
  CHECK(p->passes[1].loc.str() == "<pipeline>:1:43");
  CHECK(p->targets == std::vector<std::string>{"cpu"});
  CHECK(p->canonical(test_registry()) == "kir | canonicalize{max-iterations=3},cse | reference@cpu");

  // Without a '|', the text is a pass list.
  auto list = parse_pipeline_string("cse,dce", test_registry());
  REQUIRE(list.ok());
  CHECK(list->passes.size() == 2);
  CHECK(list->frontend.name.empty());
  CHECK(list->canonical(test_registry()) == "| cse,dce |");
}

TEST_CASE("one-line form: round trips exactly") {
  const char* lines[] = {
      "kir | canonicalize,cse,dce | reference",
      "kir{strict=false} | canonicalize{fold-limit-bytes=0,max-iterations=4} | cuda{opt-level=0}@sm_80,sm_90a",
      "| all-types{count=-9223372036854775808,flag=true,label=\"a \\\"b\\\" \\\\ c\\n\",ratio=1e-300,sizes=[-1, 0],tags=[\"\", \"1\", x, \"|\"]} |",
      "| all-types{ratio=-inf,label=\"{x=1}\"},all-types{ratio=0.1,label=true_ish} | @cpu",
      "kir | | reference | runtime{cuda-graphs=false,device=\"gpu 0\",threads=2} | plugins{paths=[/a/b, \"/c d/e\"]}",
      "| |",
  };
  for (const char* text : lines) {
    CAPTURE(text);
    auto p = parse_pipeline_string(text, test_registry());
    REQUIRE(p.ok());
    check_round_trip(*p);
  }
  // Built in code, with values that need quoting.
  Pipeline p;
  p.frontend.name = "kir";
  p.frontend.options = *resolve_options(test_registry().frontend("kir").value()->options, {}, "f");
  StageSpec s;
  s.name = "all-types";
  s.options = *resolve_options(test_registry().pass("all-types").value()->options,
                               {{"label", std::string("x,y}|z\t\x01")}, {"tags", std::vector<std::string>{"true", "-3", "a b"}},
                                {"ratio", 123456789.125}, {"sizes", std::vector<int64_t>{7}}},
                               "p");
  p.passes = {s, s};
  p.backend.name = "reference";
  p.targets = {"cpu"};
  p.runtime.threads = 8;
  p.plugin_paths = {"/x/y"};
  check_round_trip(p);
}

TEST_CASE("one-line form: errors give the column") {
  CHECK(line_error("kir | csee | reference") ==
        "<pipeline>:1:7: unknown pass 'csee' (did you mean 'cse'?); registered passes: all-types, "
        "canonicalize, cse, dce" +
            hint);
  CHECK(line_error("onnx | cse | reference") ==
        "<pipeline>:1:1: unknown frontend 'onnx'; registered frontends: kir" + hint);
  CHECK(line_error("kir | cse | ref") ==
        "<pipeline>:1:13: unknown backend 'ref'; registered backends: cuda, reference" + hint);
  CHECK(line_error("kir | cse,,dce | reference") == "<pipeline>:1:11: expected a name, found ','");
  CHECK(line_error("kir | cse dce | reference") == "<pipeline>:1:11: expected ',' or '|' after the passes, found 'd'");
  CHECK(line_error("kir | canonicalize{max-iterations=x} | reference") ==
        "<pipeline>:1:35: option 'max-iterations' for pass 'canonicalize' expects int, got string \"x\"");
  CHECK(line_error("kir | canonicalize{max-iteration=1} | reference") ==
        "<pipeline>:1:20: unknown option 'max-iteration' for pass 'canonicalize' (did you mean 'max-iterations'?); "
        "known: max-iterations, fold-limit-bytes");
  CHECK(line_error("kir | canonicalize{max-iterations=1,max-iterations=2} |") ==
        "<pipeline>:1:37: option 'max-iterations' given twice");
  CHECK(line_error("kir | canonicalize{max-iterations 1} |") ==
        "<pipeline>:1:35: expected '=' after option 'max-iterations', found '1'");
  CHECK(line_error("kir | canonicalize{max-iterations=1 |") ==
        "<pipeline>:1:37: expected ',' or '}' after options, found '|'");
  CHECK(line_error("kir | canonicalize{max-iterations=99999999999999999999} |") ==
        "<pipeline>:1:35: integer 99999999999999999999 is out of range");
  CHECK(line_error("kir | all-types{label=\"abc} |") == "<pipeline>:1:23: unterminated string");
  CHECK(line_error("kir | all-types{label=\"a\\q\"} |") == "<pipeline>:1:25: unknown escape '\\q'");
  CHECK(line_error("kir | all-types{sizes=[1, a]} |") == "<pipeline>:1:23: list mixes ints and strings");
  CHECK(line_error("kir | all-types{sizes=[1.5]} |") == "<pipeline>:1:24: list items must be ints or strings, found float");
  CHECK(line_error("kir | all-types{sizes=[1 2]} |") == "<pipeline>:1:26: expected ',' or ']' in list, found '2'");
  CHECK(line_error("kir | | reference@sm_90a") ==
        "<pipeline>:1:19: backend 'reference' cannot build for target 'sm_90a'; its targets: cpu");
  CHECK(line_error("kir | | reference | runtime{threads=-2}") == "<pipeline>:1:21: runtime 'threads' must be >= 0");
  CHECK(line_error("kir | | reference | runtime{} | runtime{}") ==
        "<pipeline>:1:33: expected 'runtime{...}' or 'plugins{...}' (each once), found 'runtime'");
  CHECK(line_error("kir | | reference | other") ==
        "<pipeline>:1:21: expected 'runtime{...}' or 'plugins{...}' (each once), found 'other'");
  CHECK(line_error("kir | | reference x") == "<pipeline>:1:19: unexpected 'x'");
  CHECK(line_error("kir cse | |") == "<pipeline>:1:5: expected '|' after the frontend, found 'c'");
}

TEST_CASE("parse_pass_list") {
  auto passes = parse_pass_list("canonicalize{max-iterations=2},cse", test_registry());
  REQUIRE(passes.ok());
  REQUIRE(passes->size() == 2);
  CHECK((*passes)[0].name == "canonicalize");
  CHECK((*passes)[0].options.get_int("max-iterations") == 2);
  CHECK((*passes)[1].name == "cse");
  auto empty = parse_pass_list("  ", test_registry());
  REQUIRE(empty.ok());
  CHECK(empty->empty());
  CHECK(parse_pass_list("cse|dce", test_registry()).status().message() == "<pipeline>:1:4: unexpected '|'");
  CHECK(parse_pass_list("canonicalize,csee", test_registry()).status().message() ==
        "<pipeline>:1:14: unknown pass 'csee' (did you mean 'cse'?); registered passes: all-types, "
        "canonicalize, cse, dce" +
            hint);
  CHECK(parse_pass_list("cse{", test_registry()).status().message() == "<pipeline>:1:5: expected a name, found end of text");
}

TEST_CASE("parse_option_value reads what option_value_str prints") {
  for (const OptionValue& v :
       {OptionValue(true), OptionValue(int64_t{-3}), OptionValue(0.5),
        OptionValue(std::string("text")), OptionValue(std::string("a \"b\"\n")),
        OptionValue(std::vector<std::string>{"/abs/dir", "with space", "3"}),
        OptionValue(std::vector<std::string>{}), OptionValue(std::vector<int64_t>{1, 2})}) {
    auto back = parse_option_value(option_value_str(v));
    REQUIRE_MESSAGE(back.ok(), back.status().message());
    CHECK(*back == v);
  }
  CHECK(parse_option_value("[a, b] x").status().message() == "<value>:1:8: unexpected 'x'");
  CHECK(parse_option_value("\"open").status().message() == "<value>:1:1: unterminated string");
}
