// Loads plugin libraries with Boost.DLL after checking their ABI version and build fingerprint.
#include "kiln/core/loader.h"

#include <dlfcn.h>

#include <algorithm>
#include <boost/dll/shared_library.hpp>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>

#include "kiln/plugin.h"

namespace kiln {

namespace fs = std::filesystem;

namespace {

/// Libraries whose register function ran, by canonical path. Leaked on purpose: plugins are
/// never unloaded, since registry entries point into their code until the process ends.
std::map<std::string, boost::dll::shared_library>& loaded() {
  static auto* libs = new std::map<std::string, boost::dll::shared_library>;
  return *libs;
}

std::string canonical_path(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  return ec ? fs::absolute(path).lexically_normal().string() : p.string();
}

std::string version_of(uint32_t major, uint32_t minor) {
  return std::to_string(major) + "." + std::to_string(minor);
}

/// The binary's own plugin folders: its folder and its ../lib/kiln/plugins.
std::vector<std::string> own_plugin_dirs() {
  std::vector<std::string> dirs;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    dirs.push_back(exe.parent_path().string());
    dirs.push_back(
        (exe.parent_path() / ".." / "lib" / "kiln" / "plugins").lexically_normal().string());
  }
  return dirs;
}

/// What plugin_paths_used() returns; leaked like loaded().
std::vector<std::string>& used_paths() {
  static auto* paths = new std::vector<std::string>;
  return *paths;
}

void note_used_path(const std::string& dir) {
  // The binary's own folders are left out: every kiln loads its own, and a reproducer
  // replayed by another build of kiln must load that build's plugins, not these.
  static const std::vector<std::string> own = [] {
    std::vector<std::string> out;
    for (const auto& d : own_plugin_dirs()) out.push_back(canonical_path(d));
    return out;
  }();
  std::error_code ec;
  const std::string path = fs::absolute(dir, ec).lexically_normal().string();
  if (ec || !fs::exists(path, ec)) return;
  if (std::find(own.begin(), own.end(), canonical_path(path)) != own.end()) return;
  auto& used = used_paths();
  if (std::find(used.begin(), used.end(), path) == used.end()) used.push_back(path);
}

}  // namespace

bool is_plugin_file_name(const std::string& file_name) {
  static constexpr std::string_view kPrefix = "kiln-plugin-", kSuffix = ".so";
  return file_name.size() > kPrefix.size() + kSuffix.size() && file_name.starts_with(kPrefix) &&
         file_name.ends_with(kSuffix);
}

std::vector<std::string> default_plugin_dirs() {
  std::vector<std::string> dirs = own_plugin_dirs();
  std::error_code ec;
  if (const char* env = std::getenv("KILN_PLUGIN_PATH")) {
    std::string_view rest = env;
    while (!rest.empty()) {
      const size_t colon = rest.find(':');
      const std::string entry(rest.substr(0, colon));
      if (!entry.empty()) dirs.push_back(fs::absolute(entry, ec).lexically_normal().string());
      rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
    }
  }
  return dirs;
}

Status load_plugin(const std::string& path, Registry& reg) {
  // Always an absolute path: dlopen then never searches the system library folders.
  const std::string file = canonical_path(path);
  if (loaded().count(file)) return ok_status();
  const std::string where = "plugin " + file;

  boost::dll::fs::error_code ec;
  boost::dll::shared_library lib(
      boost::dll::fs::path(file), ec,
      boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  if (ec || !lib.is_loaded()) {
    const char* why = dlerror();
    return failed_precondition(where + ": cannot load: " + (why ? why : ec.message()));
  }
  if (!lib.has(KILN_PLUGIN_ENTRY_SYMBOL))
    return failed_precondition(where + ": no '" KILN_PLUGIN_ENTRY_SYMBOL
                               "' symbol (not a kiln plugin, or built without KILN_PLUGIN)");
  auto entry = lib.get<const KilnPluginDescriptor*()>(KILN_PLUGIN_ENTRY_SYMBOL);
  const KilnPluginDescriptor* d = entry();
  if (!d) return failed_precondition(where + ": " KILN_PLUGIN_ENTRY_SYMBOL " returned null");

  const std::string ours = "(this kiln is " KILN_VERSION_STRING ")";
  if (d->abi_major != KILN_PLUGIN_ABI_MAJOR)
    return failed_precondition(where + ": ABI version " + version_of(d->abi_major, d->abi_minor) +
                               ", expected " + std::to_string(KILN_PLUGIN_ABI_MAJOR) + ".x " + ours);
  if (d->abi_minor > KILN_PLUGIN_ABI_MINOR)
    return failed_precondition(where + ": ABI version " + version_of(d->abi_major, d->abi_minor) +
                               ", expected at most " +
                               version_of(KILN_PLUGIN_ABI_MAJOR, KILN_PLUGIN_ABI_MINOR) + " " + ours);
  const std::string fingerprint = d->fingerprint ? d->fingerprint : "(none)";
  if (fingerprint != KILN_BUILD_FINGERPRINT)
    return failed_precondition(where + ": build fingerprint '" + fingerprint + "', expected '" +
                               KILN_BUILD_FINGERPRINT "' (rebuild the plugin against this kiln)");
  if (!d->register_fn) return failed_precondition(where + ": no register function");

  // From here on the library may own registry entries, so it stays loaded whatever happens.
  loaded().emplace(file, std::move(lib));
  reg.set_current_library(file);
  Status s;
  try {
    s = d->register_fn(reg);
  } catch (const std::exception& e) {
    s = internal_error(std::string("register function threw: ") + e.what());
  } catch (...) {
    s = internal_error("register function threw");
  }
  reg.set_current_library("");
  return s.ok() ? s : s.with_context(where);
}

Status load_plugins(const std::vector<std::string>& dirs, Registry& reg) {
  // Keep going after a refusal so that one report lists every bad plugin.
  std::string errors;
  StatusCode code = StatusCode::kOk;
  auto note = [&](const Status& s) {
    if (s.ok()) return;
    if (code == StatusCode::kOk) code = s.code();
    errors += (errors.empty() ? "" : "\n") + s.message();
  };
  for (const auto& dir : dirs) {
    note_used_path(dir);
    std::error_code ec;
    if (fs::is_regular_file(dir, ec)) {  // a plugin file named directly
      note(load_plugin(dir, reg));
      continue;
    }
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<fs::path> files;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
      if (is_plugin_file_name(it->path().filename().string())) files.push_back(it->path());
    if (ec) note(io_error("cannot list plugin folder " + dir + ": " + ec.message()));
    std::sort(files.begin(), files.end());
    for (const auto& f : files) note(load_plugin(f.string(), reg));
  }
  return code == StatusCode::kOk ? ok_status() : Status(code, errors);
}

std::vector<std::string> plugin_paths_used() { return used_paths(); }

std::vector<std::string> loaded_plugin_libraries() {
  std::vector<std::string> out;
  for (const auto& [path, lib] : loaded()) out.push_back(path);
  return out;
}

}  // namespace kiln
