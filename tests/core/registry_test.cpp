// Tests for the plugin registry: adding, duplicates, lookups and their messages.
#include <doctest/doctest.h>

#include <memory>

#include "kiln/core/registry.h"
#include "kiln/ir/spelling.h"

using namespace kiln;

namespace {

class NoOpPass final : public Pass {
 public:
  StatusOr<bool> run(Graph&) override { return false; }
};

PassInfo pass_info(const std::string& name, std::vector<OptionSpec> options = {}) {
  PassInfo p;
  p.name = name;
  p.version = "1.2.3";
  p.summary = "does nothing";
  p.options = std::move(options);
  p.create = [](const Options&) -> StatusOr<std::unique_ptr<Pass>> { return std::unique_ptr<Pass>(std::make_unique<NoOpPass>()); };
  return p;
}

FrontendInfo frontend_info(const std::string& name, std::vector<std::string> exts) {
  FrontendInfo f;
  f.name = name;
  f.extensions = std::move(exts);
  f.import = [](const std::string&, const Options&) -> StatusOr<std::unique_ptr<Graph>> { return std::make_unique<Graph>(); };
  return f;
}

BackendInfo backend_info(const std::string& name) {
  BackendInfo b;
  b.name = name;
  b.create = [](const Options&) -> StatusOr<std::unique_ptr<Backend>> { return unimplemented("no"); };
  return b;
}

}  // namespace

TEST_CASE("plugin kind names") {
  CHECK(std::string(plugin_kind_name(PluginKind::kFrontend)) == "frontend");
  CHECK(std::string(plugin_kind_name(PluginKind::kPass)) == "pass");
  CHECK(std::string(plugin_kind_name(PluginKind::kBackend)) == "backend");
  CHECK(std::string(plugin_kind_name(PluginKind::kParallel)) == "parallel");
}

TEST_CASE("registry lookups and the unknown-name message") {
  Registry reg;
  REQUIRE(reg.add_pass(pass_info("dce")).ok());
  REQUIRE(reg.add_pass(pass_info("canonicalize")).ok());
  REQUIRE(reg.add_pass(pass_info("cse")).ok());
  auto cse = reg.pass("cse");
  REQUIRE(cse.ok());
  CHECK((*cse)->name == "cse");
  CHECK((*cse)->version == "1.2.3");
  CHECK((*cse)->library == "");
  auto bad = reg.pass("csee");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kNotFound);
  // A close name is suggested; every unknown name says how to load a plugin that may add it.
  CHECK(bad.status().message() ==
        "unknown pass 'csee' (did you mean 'cse'?); registered passes: canonicalize, cse, dce; "
        "a plugin may provide it: load plugins with --plugin-path DIR, "
        "KILN_PLUGIN_PATH=DIR1:DIR2 or [plugins] paths in the pipeline");
  const std::string hint = "; " + std::string(kPluginHint);
  CHECK(reg.pass("fold").status().message() ==
        "unknown pass 'fold'; registered passes: canonicalize, cse, dce" + hint);
  auto none = reg.backend("cuda");
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().message() == "unknown backend 'cuda'; no backends are registered" + hint);
  auto nofe = reg.frontend("onnx");
  CHECK(nofe.status().message() == "unknown frontend 'onnx'; no frontends are registered" + hint);
  auto nopar = reg.parallel("tp");
  CHECK(nopar.status().message() ==
        "unknown parallel strategy 'tp'; no parallel strategies are registered" + hint);

  auto found = reg.find(PluginKind::kPass, "dce");
  REQUIRE(found.ok());
  CHECK((*found)->name == "dce");
  auto missing = reg.find(PluginKind::kBackend, "x");
  CHECK(missing.status().message() == "unknown backend 'x'; no backends are registered" + hint);
  REQUIRE(reg.add_backend(backend_info("reference")).ok());
  CHECK(reg.find(PluginKind::kBackend, "refrence").status().message() ==
        "unknown backend 'refrence' (did you mean 'reference'?); registered backends: reference" +
            hint);
}

TEST_CASE("did-you-mean suggests only close misspellings") {
  const std::vector<std::string> known = {"canonicalize", "cse", "dce", "fuse-rows"};
  CHECK(closest_name("csee", known) == "cse");
  CHECK(closest_name("fuse_rows", known) == "fuse-rows");
  CHECK(closest_name("canonicalise", known) == "canonicalize");
  CHECK(closest_name("fuse-rowz-x", known) == "");  // three edits away
  CHECK(closest_name("ce", known) == "cse");        // ties go to the first known name
  CHECK(closest_name("x", {"y"}) == "");            // replacing every letter is no misspelling
  CHECK(closest_name("cse", {}) == "");
  CHECK(did_you_mean("dse", known) == " (did you mean 'cse'?)");
  CHECK(did_you_mean("nothing-like-it", known) == "");
  CHECK(edit_distance("kitten", "sitting") == 3);
  CHECK(edit_distance("", "abc") == 3);
}

TEST_CASE("duplicates name both libraries") {
  Registry reg;
  reg.set_current_library("/a/kiln-plugin-a.so");
  REQUIRE(reg.add_pass(pass_info("cse")).ok());
  reg.set_current_library("/b/kiln-plugin-b.so");
  Status dup = reg.add_pass(pass_info("cse"));
  CHECK(dup.code() == StatusCode::kAlreadyExists);
  CHECK(dup.message() == "duplicate pass 'cse': already registered by /a/kiln-plugin-a.so, again by /b/kiln-plugin-b.so");
  CHECK((*reg.pass("cse"))->library == "/a/kiln-plugin-a.so");  // the first one stays

  Registry builtin;
  REQUIRE(builtin.add_backend(backend_info("reference")).ok());
  builtin.set_current_library("/x/kiln-plugin-x.so");
  CHECK(builtin.add_backend(backend_info("reference")).message() ==
        "duplicate backend 'reference': already registered by built-in, again by /x/kiln-plugin-x.so");
  // Same name, different kind: no conflict.
  CHECK(builtin.add_pass(pass_info("reference")).ok());
}

TEST_CASE("entries are checked when added") {
  Registry reg;
  CHECK(reg.add_pass(pass_info("")).message() == "pass registered with an empty name");
  PassInfo no_fn = pass_info("p");
  no_fn.create = nullptr;
  CHECK(reg.add_pass(no_fn).message() == "pass 'p' has no create/import function");
  CHECK(reg.add_pass(pass_info("q", {{"n", OptionType::kInt, std::string("3"), ""}})).message() ==
        "pass 'q': option 'n' is declared int but its default is string");
  CHECK(reg.add_pass(pass_info("r", {{"n", OptionType::kInt, int64_t{1}, ""}, {"n", OptionType::kInt, int64_t{2}, ""}}))
            .message() == "pass 'r': option 'n' is declared twice");
  CHECK(reg.rows().empty());
}

TEST_CASE("frontend_for_path picks by extension") {
  Registry reg;
  REQUIRE(reg.add_frontend(frontend_info("kir", {".kir"})).ok());
  REQUIRE(reg.add_frontend(frontend_info("gz", {".gz"})).ok());
  REQUIRE(reg.add_frontend(frontend_info("tarball", {".tar.gz"})).ok());
  CHECK((*reg.frontend_for_path("/m/model.kir"))->name == "kir");
  CHECK((*reg.frontend_for_path("MODEL.KIR"))->name == "kir");
  CHECK((*reg.frontend_for_path("a.gz"))->name == "gz");
  CHECK((*reg.frontend_for_path("a.tar.gz"))->name == "tarball");  // longest match wins
  auto none = reg.frontend_for_path("model.onnx");
  REQUIRE_FALSE(none.ok());
  const std::string hint = "; " + std::string(kPluginHint);
  CHECK(
      none.status().message() ==
      "no frontend reads 'model.onnx'; known extensions: gz (.gz), kir (.kir), tarball (.tar.gz)" +
          hint);
  Registry empty;
  CHECK(empty.frontend_for_path("a.kir").status().message() ==
        "no frontend reads 'a.kir'; no frontends are registered" + hint);
}

TEST_CASE("rows are sorted by kind then name, with the library stamped") {
  Registry reg;
  reg.set_current_library("/lib/p.so");
  REQUIRE(reg.add_backend(backend_info("reference")).ok());
  REQUIRE(reg.add_pass(pass_info("dce")).ok());
  reg.set_current_library("");
  REQUIRE(reg.add_pass(pass_info("cse")).ok());
  REQUIRE(reg.add_frontend(frontend_info("kir", {".kir"})).ok());
  const auto rows = reg.rows();
  REQUIRE(rows.size() == 4);
  CHECK(rows[0].kind == PluginKind::kFrontend);
  CHECK(rows[1].entry->name == "cse");
  CHECK(rows[1].entry->library == "");
  CHECK(rows[2].entry->name == "dce");
  CHECK(rows[2].entry->library == "/lib/p.so");
  CHECK(rows[3].kind == PluginKind::kBackend);
  CHECK(rows[3].entry->library == "/lib/p.so");
}

TEST_CASE("the global registry is one object") {
  CHECK(&Registry::global() == &Registry::global());
}
