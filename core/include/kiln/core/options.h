// Typed options that passes, front ends and backends declare, and their values.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "kiln/ir/status.h"

namespace kiln {

enum class OptionType { kBool, kInt, kFloat, kString, kStringList, kIntList };
const char* option_type_name(OptionType t);

using OptionValue =
    std::variant<bool, int64_t, double, std::string, std::vector<std::string>, std::vector<int64_t>>;

/// The type of a value as stored (an int literal where a float is declared is converted by
/// resolve_options).
OptionType option_value_type(const OptionValue& v);
/// Canonical text: true, 3, 0.5, "text" (quoted only when needed), [a, b].
std::string option_value_str(const OptionValue& v);

/// One declared option.
struct OptionSpec {
  std::string name;   ///< kebab-case, e.g. "max-iterations"
  OptionType type;
  OptionValue default_value;
  std::string help;
};

/// Resolved option values: every declared option present (given or default).
class Options {
 public:
  bool get_bool(const std::string& name) const;
  int64_t get_int(const std::string& name) const;
  double get_float(const std::string& name) const;
  const std::string& get_string(const std::string& name) const;
  const std::vector<std::string>& get_strings(const std::string& name) const;
  const std::vector<int64_t>& get_ints(const std::string& name) const;
  bool has(const std::string& name) const { return values_.count(name) != 0; }

  const std::map<std::string, OptionValue>& values() const { return values_; }
  void set(const std::string& name, OptionValue v) { values_[name] = std::move(v); }

  /// Only the values that differ from the specs' defaults, as "{a=1,b=x}" ("" when none):
  /// the canonical form used in pipelines.
  std::string canonical(const std::vector<OptionSpec>& specs) const;
  bool operator==(const Options& o) const { return values_ == o.values_; }

 private:
  std::map<std::string, OptionValue> values_;
};

/// Checks `given` against `specs` (unknown names, wrong types) and fills defaults.
/// `owner` names the plugin in messages ("unknown option 'x' for pass 'cse'; known: ...").
/// Ints are accepted for float options.
StatusOr<Options> resolve_options(const std::vector<OptionSpec>& specs,
                                  const std::map<std::string, OptionValue>& given,
                                  const std::string& owner);

}  // namespace kiln
