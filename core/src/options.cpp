// Typed plugin options: canonical value text, typed getters, and checking values against specs.
#include "kiln/core/options.h"

#include <algorithm>
#include <cassert>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "kiln/ir/spelling.h"
#include "option_text.h"

namespace kiln {

const char* option_type_name(OptionType t) {
  switch (t) {
    case OptionType::kBool: return "bool";
    case OptionType::kInt: return "int";
    case OptionType::kFloat: return "float";
    case OptionType::kString: return "string";
    case OptionType::kStringList: return "string-list";
    case OptionType::kIntList: return "int-list";
  }
  return "?";
}

OptionType option_value_type(const OptionValue& v) {
  // The variant's alternatives are declared in OptionType's order.
  return static_cast<OptionType>(v.index());
}

namespace detail {

StatusOr<OptionValue> bare_option_value(std::string_view token) {
  if (token == "true") return OptionValue(true);
  if (token == "false") return OptionValue(false);
  std::string_view num = token;
  const bool plus = !num.empty() && num[0] == '+';
  if (plus) num.remove_prefix(1);  // from_chars takes '-' but not '+'
  if (num.empty() || (plus && num[0] == '-')) return OptionValue(std::string(token));
  const char* end = num.data() + num.size();
  std::string_view digits = num[0] == '-' ? num.substr(1) : num;
  bool is_int = !digits.empty();
  for (char c : digits) is_int = is_int && c >= '0' && c <= '9';
  if (is_int) {
    int64_t v = 0;
    auto [p, ec] = std::from_chars(num.data(), end, v);
    if (ec != std::errc() || p != end)
      return invalid_argument("integer " + std::string(token) + " is out of range");
    return OptionValue(v);
  }
  double d = 0;
  auto [p, ec] = std::from_chars(num.data(), end, d);
  if (p == end && ec == std::errc::result_out_of_range)
    return invalid_argument("float " + std::string(token) + " is out of range");
  if (p == end && ec == std::errc()) return OptionValue(d);
  return OptionValue(std::string(token));
}

std::string quote_option_string(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace detail

namespace {

std::string string_text(const std::string& s) {
  bool bare = !s.empty();
  for (char c : s) bare = bare && detail::is_bare_char(c);
  // A bare token must read back as a string, not as a bool or a number.
  if (bare) {
    auto v = detail::bare_option_value(s);
    bare = v.ok() && std::holds_alternative<std::string>(*v);
  }
  return bare ? s : detail::quote_option_string(s);
}

std::string float_text(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, d);
  std::string s(buf, ec == std::errc() ? p : buf);
  // Keep the float visible as a float when read back.
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

template <typename T, typename F>
std::string list_text(const std::vector<T>& v, F item) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + item(v[i]);
  return out + "]";
}

}  // namespace

std::string option_value_str(const OptionValue& v) {
  switch (option_value_type(v)) {
    case OptionType::kBool: return std::get<bool>(v) ? "true" : "false";
    case OptionType::kInt: return std::to_string(std::get<int64_t>(v));
    case OptionType::kFloat: return float_text(std::get<double>(v));
    case OptionType::kString: return string_text(std::get<std::string>(v));
    case OptionType::kStringList: return list_text(std::get<std::vector<std::string>>(v), string_text);
    case OptionType::kIntList:
      return list_text(std::get<std::vector<int64_t>>(v), [](int64_t x) { return std::to_string(x); });
  }
  return "";
}

namespace {

// A getter used with the wrong name or type is a bug in the plugin, not bad input.
template <typename T>
const T& get_as(const std::map<std::string, OptionValue>& values, const std::string& name) {
  static const T empty{};
  auto it = values.find(name);
  if (it == values.end() || !std::holds_alternative<T>(it->second)) {
    assert(false && "Options: undeclared option or wrong type");
    return empty;
  }
  return std::get<T>(it->second);
}

}  // namespace

bool Options::get_bool(const std::string& name) const { return get_as<bool>(values_, name); }
int64_t Options::get_int(const std::string& name) const { return get_as<int64_t>(values_, name); }
double Options::get_float(const std::string& name) const {
  auto it = values_.find(name);
  if (it != values_.end() && std::holds_alternative<int64_t>(it->second))
    return static_cast<double>(std::get<int64_t>(it->second));
  return get_as<double>(values_, name);
}
const std::string& Options::get_string(const std::string& name) const {
  return get_as<std::string>(values_, name);
}
const std::vector<std::string>& Options::get_strings(const std::string& name) const {
  return get_as<std::vector<std::string>>(values_, name);
}
const std::vector<int64_t>& Options::get_ints(const std::string& name) const {
  return get_as<std::vector<int64_t>>(values_, name);
}

std::string Options::canonical(const std::vector<OptionSpec>& specs) const {
  std::string out;
  for (const auto& [name, value] : values_) {
    bool is_default = false;
    for (const auto& s : specs)
      if (s.name == name) is_default = s.default_value == value;
    if (is_default) continue;
    out += (out.empty() ? "" : ",") + name + "=" + option_value_str(value);
  }
  return out.empty() ? out : "{" + out + "}";
}

namespace {

/// Converts `v` to `want` where that loses nothing: int to float, an empty list to either list.
bool coerce(OptionValue& v, OptionType want) {
  const OptionType have = option_value_type(v);
  if (have == want) return true;
  if (have == OptionType::kInt && want == OptionType::kFloat) {
    v = static_cast<double>(std::get<int64_t>(v));
    return true;
  }
  const bool empty_list = (have == OptionType::kStringList && std::get<std::vector<std::string>>(v).empty()) ||
                          (have == OptionType::kIntList && std::get<std::vector<int64_t>>(v).empty());
  if (empty_list && want == OptionType::kIntList) { v = std::vector<int64_t>{}; return true; }
  if (empty_list && want == OptionType::kStringList) { v = std::vector<std::string>{}; return true; }
  return false;
}

}  // namespace

StatusOr<Options> resolve_options(const std::vector<OptionSpec>& specs,
                                  const std::map<std::string, OptionValue>& given,
                                  const std::string& owner) {
  Options out;
  for (const auto& [name, value] : given) {
    const OptionSpec* spec = nullptr;
    for (const auto& s : specs)
      if (s.name == name) spec = &s;
    if (!spec) {
      std::vector<std::string> names;
      std::string known;
      for (const auto& s : specs) {
        names.push_back(s.name);
        known += (known.empty() ? "" : ", ") + s.name;
      }
      std::string msg = "unknown option '" + name + "' for " + owner + did_you_mean(name, names);
      msg += specs.empty() ? "; it takes no options" : "; known: " + known;
      return invalid_argument(msg);
    }
    OptionValue v = value;
    if (!coerce(v, spec->type))
      return invalid_argument("option '" + name + "' for " + owner + " expects " +
                              option_type_name(spec->type) + ", got " +
                              option_type_name(option_value_type(value)) + " " +
                              (std::holds_alternative<std::string>(value)
                                   ? detail::quote_option_string(std::get<std::string>(value))
                                   : option_value_str(value)));
    out.set(name, std::move(v));
  }
  for (const auto& s : specs)
    if (!out.has(s.name)) out.set(s.name, s.default_value);
  return out;
}

}  // namespace kiln
