// Finding and loading plugin shared libraries (Boost.DLL). Plugins are never unloaded.
#pragma once

#include <string>
#include <vector>

#include "kiln/core/registry.h"
#include "kiln/ir/status.h"

namespace kiln {

/// File names the loader picks up in a search folder: "kiln-plugin-*.so".
bool is_plugin_file_name(const std::string& file_name);

/// The default search folders, in order: the running binary's folder, its
/// `../lib/kiln/plugins`, then each entry of $KILN_PLUGIN_PATH (colon-separated).
/// Never the system library search path.
std::vector<std::string> default_plugin_dirs();

/// Loads one plugin: checks ABI version and build fingerprint, then calls its register
/// function with `reg`. A library already loaded (same canonical path) is skipped.
Status load_plugin(const std::string& path, Registry& reg);

/// Loads every plugin file in each folder (sorted by name; missing folders are skipped).
Status load_plugins(const std::vector<std::string>& dirs, Registry& reg);

/// The plugin folders and files given to load_plugins so far that exist, other than the
/// binary's own folders: what --plugin-path, $KILN_PLUGIN_PATH and a pipeline's `[plugins]
/// paths` named. Absolute, each once, in first-use order. Crash reproducers record them so
/// that a replay loads the same plugins.
std::vector<std::string> plugin_paths_used();

/// Canonical paths of every library loaded so far.
std::vector<std::string> loaded_plugin_libraries();

}  // namespace kiln
