// The plugin ABI: the one entry point every Kiln plugin exports, and the macro that writes it.
//
//   static kiln::Status register_my_pass(kiln::Registry& r) { return r.add_pass({...}); }
//   KILN_PLUGIN("my-plugin", "0.1.0", register_my_pass)
//
// The loader checks the ABI version and the build fingerprint before calling anything else,
// and refuses a mismatch naming the file, what it found and what it expected.
#pragma once

#include <cstdint>

#include "kiln/core/registry.h"
#include "kiln/version.h"

/// Bumped when a change breaks plugins built against older headers. 2: Executable gained the
/// virtual read_state/write_state (training checkpoints), so an older backend's vtable is short.
#define KILN_PLUGIN_ABI_MAJOR 2
/// Bumped when headers grow compatibly; a plugin needing a newer minor is refused.
#define KILN_PLUGIN_ABI_MINOR 0

#define KILN_STRINGIFY_INNER(x) #x
#define KILN_STRINGIFY(x) KILN_STRINGIFY_INNER(x)

#if defined(__clang__)
#define KILN_COMPILER_ID "clang " __clang_version__
#elif defined(__GNUC__)
#define KILN_COMPILER_ID "gcc " __VERSION__
#else
#define KILN_COMPILER_ID "unknown-compiler"
#endif

#if defined(_LIBCPP_VERSION)
#define KILN_STDLIB_ID "libc++ " KILN_STRINGIFY(_LIBCPP_VERSION)
#elif defined(_GLIBCXX_RELEASE)
#define KILN_STDLIB_ID "libstdc++ " KILN_STRINGIFY(_GLIBCXX_RELEASE) " cxx11abi=" KILN_STRINGIFY(_GLIBCXX_USE_CXX11_ABI)
#else
#define KILN_STDLIB_ID "unknown-stdlib"
#endif

/// Everything that must match between Kiln and a plugin for C++ types to cross safely.
#define KILN_BUILD_FINGERPRINT \
  KILN_COMPILER_ID "; " KILN_STDLIB_ID "; kiln " KILN_VERSION_STRING

extern "C" {

/// What `kiln_plugin_entry` returns. The first two fields keep their place forever so that
/// any Kiln can read the ABI version of any plugin.
struct KilnPluginDescriptor {
  uint32_t abi_major;
  uint32_t abi_minor;
  const char* fingerprint;  ///< KILN_BUILD_FINGERPRINT of the plugin's build
  const char* name;         ///< the library's name, e.g. "kiln-core-passes"
  const char* version;      ///< the library's version
  kiln::Status (*register_fn)(kiln::Registry&);
};

typedef const KilnPluginDescriptor* (*KilnPluginEntryFn)(void);
}

/// The exported symbol's name.
#define KILN_PLUGIN_ENTRY_SYMBOL "kiln_plugin_entry"

/// Defines the plugin's entry point. Use once per shared library.
#define KILN_PLUGIN(NAME, VERSION, REGISTER_FN)                                          \
  extern "C" __attribute__((visibility("default"))) const KilnPluginDescriptor*          \
  kiln_plugin_entry(void) {                                                              \
    static const KilnPluginDescriptor descriptor = {KILN_PLUGIN_ABI_MAJOR,               \
                                                    KILN_PLUGIN_ABI_MINOR,               \
                                                    KILN_BUILD_FINGERPRINT, NAME, VERSION, \
                                                    &REGISTER_FN};                       \
    return &descriptor;                                                                  \
  }
