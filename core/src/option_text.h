// The text syntax of option values shared by options.cpp (printing) and pipeline.cpp (parsing).
#pragma once

#include <string>
#include <string_view>

#include "kiln/core/options.h"

namespace kiln::detail {

/// Characters an unquoted value or a stage name may contain.
inline bool is_bare_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-' || c == '.' || c == '/' || c == ':' || c == '+' || c == '~' || c == '@';
}

/// Reads an unquoted token: true/false, an int, a float (with '.', 'e', inf or nan), else a
/// string. Fails only for an int literal out of the int64 range.
StatusOr<OptionValue> bare_option_value(std::string_view token);

/// `"text"` with \" \\ \n \t \r and \xHH escapes for other control bytes.
std::string quote_option_string(std::string_view s);

}  // namespace kiln::detail
