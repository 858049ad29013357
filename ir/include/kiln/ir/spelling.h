// Messages about unknown names: the closest known spelling, and how to load a plugin that may
// provide the name.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

/// What to append to "unknown <kind> 'x'" for anything a plugin can add (ops, passes, front
/// ends, backends, parallel strategies). Plain text, so ir/ can use it without knowing how
/// core/ finds plugins; the three ways listed are the loader's (see kiln/core/loader.h).
inline constexpr std::string_view kPluginHint =
    "a plugin may provide it: load plugins with --plugin-path DIR, KILN_PLUGIN_PATH=DIR1:DIR2 "
    "or [plugins] paths in the pipeline";

/// Levenshtein distance: insertions, deletions and substitutions each cost one.
inline size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1] ? 1u : 0u)});
      diag = up;
    }
  }
  return row[b.size()];
}

/// The known name closest to `name` when it is a likely misspelling (at most two edits, and
/// fewer edits than `name` has characters, so "x" does not suggest "y"); "" otherwise. Ties go
/// to the earliest of `known`.
inline std::string closest_name(std::string_view name, const std::vector<std::string>& known) {
  std::string best;
  size_t best_d = std::min<size_t>(3, name.size());
  for (const std::string& k : known) {
    const size_t d = edit_distance(name, k);
    if (d < best_d) {
      best_d = d;
      best = k;
    }
  }
  return best;
}

/// " (did you mean 'y'?)" for closest_name's answer, "" when there is none.
inline std::string did_you_mean(std::string_view name, const std::vector<std::string>& known) {
  const std::string best = closest_name(name, known);
  return best.empty() ? best : " (did you mean '" + best + "'?)";
}

}  // namespace kiln
