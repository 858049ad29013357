// The persistent on-disk kernel cache: compiled kernel images keyed by everything that
// changes them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kiln/ir/status.h"

namespace kiln {

/// What a cache key covers. Every field changes the compiled bytes.
struct KernelCacheKey {
  std::string source;          ///< the full generated source
  std::string target;          ///< "sm_90a", "compute_90a", "x86-64-avx2", ...
  std::string compiler;        ///< e.g. "nvrtc 13.0"
  std::vector<std::string> options;  ///< compiler options in order
  std::string producer;        ///< plugin name and version, e.g. "cuda-sm90@0.1.0"

  /// Lowercase hex SHA-256 over a length-prefixed encoding of every field.
  std::string digest() const;
};

struct KernelCacheStats {
  std::string dir;
  uint64_t entries = 0;
  uint64_t bytes = 0;
};

/// Entries are files `<dir>/<2 hex>/<digest>.bin` holding a header (magic, format version,
/// payload size, payload SHA-256) and the payload. Writes go to a unique temporary file and
/// are renamed into place, so concurrent writers never expose a partial entry. A corrupt
/// entry is reported through `warning`, removed, and treated as a miss.
class KernelCache {
 public:
  /// `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
  static std::string default_dir();
  explicit KernelCache(std::string dir = default_dir());

  const std::string& dir() const { return dir_; }
  /// The payload, or nullopt on a miss (including a corrupt entry, described in `warning`).
  std::optional<std::string> lookup(const KernelCacheKey& key, std::string* warning = nullptr) const;
  Status store(const KernelCacheKey& key, const std::string& payload) const;
  StatusOr<KernelCacheStats> stats() const;
  /// Removes every entry (and only Kiln's entry files).
  Status clear() const;

 private:
  std::string dir_;
};

}  // namespace kiln
