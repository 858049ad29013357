// Tests for the plugin loader: the test fixtures it must refuse, each with its message.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "kiln/core/loader.h"
#include "kiln/plugin.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

std::string fixture(const std::string& name) {
  return fs::weakly_canonical(std::string(KILN_BINARY_DIR) + "/fixtures/" + name + "/kiln-plugin-" + name + ".so").string();
}

std::string in_tree(const std::string& name) {
  return fs::weakly_canonical(std::string(KILN_PLUGIN_DIR) + "/kiln-plugin-" + name + ".so").string();
}

const std::string kThisKiln = "(this kiln is " KILN_VERSION_STRING ")";

}  // namespace

TEST_CASE("plugin file names") {
  CHECK(is_plugin_file_name("kiln-plugin-transforms.so"));
  CHECK(is_plugin_file_name("kiln-plugin-x.so"));
  CHECK_FALSE(is_plugin_file_name("kiln-plugin-.so"));
  CHECK_FALSE(is_plugin_file_name("libkiln-plugin-x.so"));
  CHECK_FALSE(is_plugin_file_name("kiln-plugin-x.so.1"));
  CHECK_FALSE(is_plugin_file_name("kiln-plugin-x.dylib"));
  CHECK_FALSE(is_plugin_file_name("libkiln_core.so"));
}

TEST_CASE("default plugin folders: the binary's, its ../lib/kiln/plugins, then KILN_PLUGIN_PATH") {
  const fs::path exe_dir = fs::read_symlink("/proc/self/exe").parent_path();
  ::unsetenv("KILN_PLUGIN_PATH");
  auto dirs = default_plugin_dirs();
  REQUIRE(dirs.size() == 2);
  CHECK(dirs[0] == exe_dir.string());
  CHECK(dirs[1] == (exe_dir.parent_path() / "lib" / "kiln" / "plugins").string());
  ::setenv("KILN_PLUGIN_PATH", "/opt/a::/opt/b", 1);
  dirs = default_plugin_dirs();
  ::unsetenv("KILN_PLUGIN_PATH");
  REQUIRE(dirs.size() == 4);
  CHECK(dirs[2] == "/opt/a");
  CHECK(dirs[3] == "/opt/b");
}

TEST_CASE("a good plugin registers its entries once, stamped with its library") {
  Registry reg;
  const std::string path = fixture("good");
  REQUIRE(load_plugin(path, reg).ok());
  auto p = reg.pass("fixture-identity");
  REQUIRE(p.ok());
  CHECK((*p)->library == path);
  CHECK((*p)->version == "9.8.7");
  CHECK((*p)->options.size() == 6);
  const auto libs = loaded_plugin_libraries();
  CHECK(std::find(libs.begin(), libs.end(), path) != libs.end());
  // A second load of the same file (here through a different spelling) is skipped.
  Registry again;
  CHECK(load_plugin(std::string(KILN_BINARY_DIR) + "/fixtures/good/../good/kiln-plugin-good.so", again).ok());
  CHECK_FALSE(again.pass("fixture-identity").ok());
}

TEST_CASE("refused: ABI major version") {
  Registry reg;
  Status s = load_plugin(fixture("abi-major"), reg);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message() == "plugin " + fixture("abi-major") + ": ABI version " + std::to_string(KILN_PLUGIN_ABI_MAJOR + 1) +
                           ".0, expected " + std::to_string(KILN_PLUGIN_ABI_MAJOR) + ".x " + kThisKiln);
  CHECK(reg.rows().empty());
  // Refused libraries are not remembered: trying again refuses again.
  CHECK(load_plugin(fixture("abi-major"), reg).message() == s.message());
}

TEST_CASE("refused: newer ABI minor version") {
  Registry reg;
  Status s = load_plugin(fixture("abi-minor"), reg);
  const std::string ours = std::to_string(KILN_PLUGIN_ABI_MAJOR) + "." + std::to_string(KILN_PLUGIN_ABI_MINOR);
  CHECK(s.message() == "plugin " + fixture("abi-minor") + ": ABI version " + std::to_string(KILN_PLUGIN_ABI_MAJOR) + "." +
                           std::to_string(KILN_PLUGIN_ABI_MINOR + 1) + ", expected at most " + ours + " " + kThisKiln);
}

TEST_CASE("refused: build fingerprint") {
  Registry reg;
  Status s = load_plugin(fixture("fingerprint"), reg);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message() == "plugin " + fixture("fingerprint") +
                           ": build fingerprint 'gcc 1.0.0; libstdc++ 1 cxx11abi=0; kiln 0.0.0', expected '" +
                           KILN_BUILD_FINGERPRINT "' (rebuild the plugin against this kiln)");
}

TEST_CASE("refused: no entry symbol") {
  Registry reg;
  Status s = load_plugin(fixture("no-entry"), reg);
  CHECK(s.message() == "plugin " + fixture("no-entry") +
                           ": no 'kiln_plugin_entry' symbol (not a kiln plugin, or built without KILN_PLUGIN)");
}

TEST_CASE("refused: not a shared library, and a missing file") {
  Registry reg;
  Status s = load_plugin(fixture("garbage"), reg);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  // The rest is the dynamic loader's own text, which names the file too.
  const std::string prefix = "plugin " + fixture("garbage") + ": cannot load: " + fixture("garbage") + ": ";
  CHECK(s.message().substr(0, prefix.size()) == prefix);
  CHECK(s.message().size() > prefix.size());

  Status missing = load_plugin("/nonexistent/kiln-plugin-x.so", reg);
  CHECK(missing.message() == "plugin /nonexistent/kiln-plugin-x.so: cannot load: /nonexistent/kiln-plugin-x.so: "
                             "cannot open shared object file: No such file or directory");
}

TEST_CASE("refused: a pass name the in-tree transforms plugin already registered") {
  Registry& reg = Registry::global();
  REQUIRE(load_plugins({KILN_PLUGIN_DIR}, reg).ok());
  REQUIRE(reg.pass("cse").ok());
  Status s = load_plugin(fixture("dup-cse"), reg);
  CHECK(s.code() == StatusCode::kAlreadyExists);
  CHECK(s.message() == "plugin " + fixture("dup-cse") + ": duplicate pass 'cse': already registered by " +
                           in_tree("transforms") + ", again by " + fixture("dup-cse"));
  CHECK((*reg.pass("cse"))->library == in_tree("transforms"));
}

TEST_CASE("load_plugins reports every refusal and skips missing folders") {
  Registry reg;
  const std::string fixtures = std::string(KILN_BINARY_DIR) + "/fixtures/";
  Status s = load_plugins({fixtures + "abi-major", fixtures + "no-such-folder", fixtures + "no-entry"}, reg);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  const std::string m = s.message();
  REQUIRE(std::count(m.begin(), m.end(), '\n') == 1);
  CHECK(m.substr(0, m.find('\n')).starts_with("plugin " + fixture("abi-major") + ": ABI version"));
  CHECK(m.substr(m.find('\n') + 1).starts_with("plugin " + fixture("no-entry") + ": no 'kiln_plugin_entry'"));
  CHECK(load_plugins({fixtures + "no-such-folder"}, reg).ok());
  // A plugin file may be named directly.
  CHECK(load_plugins({fixture("fingerprint")}, reg).message().starts_with("plugin " + fixture("fingerprint") + ": build fingerprint"));
}
