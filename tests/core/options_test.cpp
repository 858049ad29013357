// Tests for typed plugin options: canonical value text, getters, resolve_options.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "kiln/core/options.h"

using namespace kiln;

namespace {

std::vector<OptionSpec> specs() {
  return {
      {"flag", OptionType::kBool, false, "a bool"},
      {"max-iterations", OptionType::kInt, int64_t{10}, "an int"},
      {"ratio", OptionType::kFloat, 0.5, "a float"},
      {"label", OptionType::kString, std::string("x"), "a string"},
      {"tags", OptionType::kStringList, std::vector<std::string>{}, "strings"},
      {"sizes", OptionType::kIntList, std::vector<int64_t>{1, 2}, "ints"},
  };
}

}  // namespace

TEST_CASE("option type names") {
  CHECK(std::string(option_type_name(OptionType::kBool)) == "bool");
  CHECK(std::string(option_type_name(OptionType::kInt)) == "int");
  CHECK(std::string(option_type_name(OptionType::kFloat)) == "float");
  CHECK(std::string(option_type_name(OptionType::kString)) == "string");
  CHECK(std::string(option_type_name(OptionType::kStringList)) == "string-list");
  CHECK(std::string(option_type_name(OptionType::kIntList)) == "int-list");
  CHECK(option_value_type(OptionValue(int64_t{1})) == OptionType::kInt);
  CHECK(option_value_type(OptionValue(std::vector<int64_t>{})) == OptionType::kIntList);
}

TEST_CASE("canonical value text") {
  CHECK(option_value_str(true) == "true");
  CHECK(option_value_str(false) == "false");
  CHECK(option_value_str(int64_t{3}) == "3");
  CHECK(option_value_str(int64_t{-7}) == "-7");
  CHECK(option_value_str(0.5) == "0.5");
  CHECK(option_value_str(4.0) == "4.0");    // stays a float when read back
  CHECK(option_value_str(-2.0) == "-2.0");
  CHECK(option_value_str(1e20) == "1e+20");
  CHECK(option_value_str(0.1) == "0.1");    // shortest text that reads back exactly
  CHECK(option_value_str(std::numeric_limits<double>::infinity()) == "inf");
  CHECK(option_value_str(-std::numeric_limits<double>::infinity()) == "-inf");
  CHECK(option_value_str(std::nan("")) == "nan");
  CHECK(option_value_str(std::string("abc")) == "abc");
  CHECK(option_value_str(std::string("sm_90a")) == "sm_90a");
  CHECK(option_value_str(std::string("cuda:0")) == "cuda:0");
  CHECK(option_value_str(std::string("/a/b.so")) == "/a/b.so");
  // Quoted when empty, when holding delimiters, or when bare text would read as another type.
  CHECK(option_value_str(std::string("")) == "\"\"");
  CHECK(option_value_str(std::string("a b")) == "\"a b\"");
  CHECK(option_value_str(std::string("a,b")) == "\"a,b\"");
  CHECK(option_value_str(std::string("x}")) == "\"x}\"");
  CHECK(option_value_str(std::string("true")) == "\"true\"");
  CHECK(option_value_str(std::string("12")) == "\"12\"");
  CHECK(option_value_str(std::string("-1.5")) == "\"-1.5\"");
  CHECK(option_value_str(std::string("nan")) == "\"nan\"");
  CHECK(option_value_str(std::string("say \"hi\"\\")) == "\"say \\\"hi\\\"\\\\\"");
  CHECK(option_value_str(std::string("a\nb\x01")) == "\"a\\nb\\x01\"");
  CHECK(option_value_str(std::vector<std::string>{"a", "b c"}) == "[a, \"b c\"]");
  CHECK(option_value_str(std::vector<int64_t>{1, -2}) == "[1, -2]");
  CHECK(option_value_str(std::vector<int64_t>{}) == "[]");
}

TEST_CASE("resolve_options fills defaults and keeps given values") {
  auto o = resolve_options(specs(), {{"max-iterations", int64_t{4}}, {"label", std::string("y")}}, "pass 'p'");
  REQUIRE(o.ok());
  CHECK(o->get_int("max-iterations") == 4);
  CHECK(o->get_string("label") == "y");
  CHECK(o->get_bool("flag") == false);
  CHECK(o->get_float("ratio") == 0.5);
  CHECK(o->get_strings("tags").empty());
  CHECK(o->get_ints("sizes") == std::vector<int64_t>{1, 2});
  CHECK(o->has("flag"));
  CHECK_FALSE(o->has("nope"));
  CHECK(o->values().size() == 6);
  // Only values that differ from the defaults, sorted by name.
  CHECK(o->canonical(specs()) == "{label=y,max-iterations=4}");
  auto d = resolve_options(specs(), {}, "pass 'p'");
  REQUIRE(d.ok());
  CHECK(d->canonical(specs()) == "");
  CHECK(*d != *o);
}

TEST_CASE("resolve_options converts ints to floats and empty lists to either list type") {
  auto o = resolve_options(specs(), {{"ratio", int64_t{2}}, {"sizes", std::vector<std::string>{}}}, "pass 'p'");
  REQUIRE(o.ok());
  CHECK(option_value_type(o->values().at("ratio")) == OptionType::kFloat);
  CHECK(o->get_float("ratio") == 2.0);
  CHECK(o->get_ints("sizes").empty());
  CHECK(o->canonical(specs()) == "{ratio=2.0,sizes=[]}");
  auto t = resolve_options(specs(), {{"tags", std::vector<int64_t>{}}}, "pass 'p'");
  REQUIRE(t.ok());
  CHECK(option_value_type(t->values().at("tags")) == OptionType::kStringList);
}

TEST_CASE("resolve_options errors") {
  auto unknown = resolve_options(specs(), {{"max-iteration", int64_t{4}}}, "pass 'canonicalize'");
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.status().code() == StatusCode::kInvalidArgument);
  CHECK(unknown.status().message() ==
        "unknown option 'max-iteration' for pass 'canonicalize' (did you mean 'max-iterations'?); "
        "known: flag, max-iterations, ratio, label, tags, sizes");
  auto far = resolve_options(specs(), {{"zzzzzz", true}}, "pass 'p'");
  REQUIRE_FALSE(far.ok());
  CHECK(far.status().message() == "unknown option 'zzzzzz' for pass 'p'; known: flag, max-iterations, ratio, label, tags, sizes");
  auto none = resolve_options({}, {{"x", true}}, "pass 'cse'");
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().message() == "unknown option 'x' for pass 'cse'; it takes no options");

  auto type = resolve_options(specs(), {{"max-iterations", std::string("four")}}, "pass 'p'");
  REQUIRE_FALSE(type.ok());
  CHECK(type.status().message() == "option 'max-iterations' for pass 'p' expects int, got string \"four\"");
  auto flt = resolve_options(specs(), {{"max-iterations", 1.5}}, "pass 'p'");
  REQUIRE_FALSE(flt.ok());
  CHECK(flt.status().message() == "option 'max-iterations' for pass 'p' expects int, got float 1.5");
  auto list = resolve_options(specs(), {{"sizes", std::vector<std::string>{"a"}}}, "pass 'p'");
  REQUIRE_FALSE(list.ok());
  CHECK(list.status().message() == "option 'sizes' for pass 'p' expects int-list, got string-list [a]");
  auto b = resolve_options(specs(), {{"flag", int64_t{1}}}, "pass 'p'");
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().message() == "option 'flag' for pass 'p' expects bool, got int 1");
}

TEST_CASE("Options::set and equality") {
  Options a, b;
  a.set("k", int64_t{1});
  b.set("k", int64_t{1});
  CHECK(a == b);
  b.set("k", int64_t{2});
  CHECK_FALSE(a == b);
  CHECK(b.get_int("k") == 2);
  // A value no spec declares is always shown.
  CHECK(b.canonical({}) == "{k=2}");
}
