// The .kir parser: text to a verified Graph, with "file:line:col: expected X, got Y" errors.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <unordered_map>

#include "kiln/ir/op.h"
#include "kiln/ir/spelling.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"
#include "text_lexer.h"

namespace kiln {
namespace {

using kir::describe;
using kir::Lexer;
using kir::Tok;
using kir::Token;
using kir::type_text;

// Side files hold raw little-endian bytes, which are then used in place.
static_assert(std::endian::native == std::endian::little, "side files assume a little-endian host");

constexpr int kMaxRegionDepth = 64;
/// Largest element count a type may have: keeps byte sizes (up to 8 per element) in int64.
constexpr int64_t kMaxElements = int64_t{1} << 59;

/// A read-only mmap of a side file; tensors wrapping it keep it alive through shared_ptr.
struct Mapping {
  const std::byte* data = nullptr;
  size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data) munmap(const_cast<std::byte*>(data), size);
  }
};

/// A numeric literal: an int (exact) or a float.
struct Number {
  bool is_float = false;
  int64_t i = 0;
  double d = 0.0;
  double as_double() const { return is_float ? d : static_cast<double>(i); }
};

std::string value_ref(const std::string& name) {
  std::string out;
  kir::append_name(out, '%', name);
  return out;
}

/// The inclusive range of integers a tensor element of dtype `t` can hold.
std::pair<int64_t, int64_t> int_range(DType t) {
  switch (t) {
    case DType::kI32: return {INT32_MIN, INT32_MAX};
    case DType::kI16: return {INT16_MIN, INT16_MAX};
    case DType::kI8: return {INT8_MIN, INT8_MAX};
    case DType::kU8: return {0, UINT8_MAX};
    case DType::kI4: return {-8, 7};
    case DType::kBool: return {0, 1};
    default: return {INT64_MIN, INT64_MAX};
  }
}

class Parser {
 public:
  Parser(std::string_view text, std::string filename)
      : lex_(text), file_(std::move(filename)),
        base_dir_(std::filesystem::path(file_).parent_path()) {
    advance();
  }

  StatusOr<std::unique_ptr<Graph>> parse() {
    KILN_ASSIGN_OR_RETURN(std::unique_ptr<Graph> g, parse_graph_def(0));
    if (tok_.kind != Tok::kEof) return unexpected("end of input");
    KILN_RETURN_IF_ERROR(verify(*g));
    // After verify, so a node whose declared type is wrong is reported as such first.
    for (const OutputCheck& c : output_checks_)
      if (c.value->type() != c.declared)
        return error(c.at, "expected return value of type " + type_text(c.declared) + ", got " +
                               value_ref(c.value->name()) + " of type " + type_text(c.value->type()));
    for (const OutputCheck& c : output_checks_)
      if (c.value->sharding() != c.declared_sharding)
        return error(c.at, "expected return value with placement '" + sharding_str(c.declared_sharding) + "', got " +
                               value_ref(c.value->name()) + " with '" + sharding_str(c.value->sharding()) + "'");
    return g;
  }

 private:
  using Scope = std::unordered_map<std::string, Value*>;

  void advance() { tok_ = lex_.next(); }
  bool consume_if(Tok k) {
    if (tok_.kind != k) return false;
    advance();
    return true;
  }
  Location loc(const Token& t) const { return Location{file_, t.line, t.col}; }
  Status error(const Token& t, const std::string& message,
               StatusCode code = StatusCode::kInvalidArgument) const {
    return error_at(loc(t), code, message);
  }
  /// "expected <what>, got <current token>", or the lexer's own message on a malformed token.
  Status unexpected(const std::string& what) const {
    if (tok_.kind == Tok::kError) return error(tok_, lex_.error());
    return error(tok_, "expected " + what + ", got " + describe(tok_));
  }
  Status expect(Tok k, const std::string& what) {
    if (tok_.kind != k) return unexpected(what);
    advance();
    return ok_status();
  }
  Status expect_keyword(std::string_view word) {
    if (!tok_.is_ident(word)) return unexpected("'" + std::string(word) + "'");
    advance();
    return ok_status();
  }
  /// The name in a %name or @name token (quoted names unescaped).
  static std::string name_of(const Token& t) {
    const std::string_view body = t.text.substr(1);
    return !body.empty() && body[0] == '"' ? kir::unquote(body) : std::string(body);
  }
  /// Whether the '{' just read opens regions ("{ graph @...") rather than attributes.
  bool regions_ahead() const {
    Lexer look = lex_;
    return look.next().is_ident("graph") && look.next().kind == Tok::kGlobal;
  }

  // graph @name(%in: type, ...) -> (type, ...) { node* return %v, ... }
  StatusOr<std::unique_ptr<Graph>> parse_graph_def(int depth) {
    if (!tok_.is_ident("graph")) return unexpected("'graph'");
    if (depth > kMaxRegionDepth)
      return error(tok_, "expected at most " + std::to_string(kMaxRegionDepth) +
                             " nested regions, got more");
    advance();
    if (tok_.kind != Tok::kGlobal) return unexpected("graph name '@name'");
    auto g = std::make_unique<Graph>(name_of(tok_));
    advance();
    Scope scope;
    KILN_RETURN_IF_ERROR(expect(Tok::kLParen, "'('"));
    if (tok_.kind != Tok::kRParen) {
      do {
        if (tok_.kind != Tok::kValue) return unexpected("input name '%name'");
        KILN_ASSIGN_OR_RETURN(std::string name, define_name(scope, {}));
        KILN_RETURN_IF_ERROR(expect(Tok::kColon, "':' after the input name"));
        KILN_ASSIGN_OR_RETURN(TensorType type, parse_type());
        KILN_ASSIGN_OR_RETURN(Sharding sharding, parse_sharding());
        scope[name] = g->add_input(name, std::move(type));
        scope[name]->set_sharding(std::move(sharding));
      } while (consume_if(Tok::kComma));
    }
    KILN_RETURN_IF_ERROR(expect(Tok::kRParen, "',' or ')'"));
    KILN_RETURN_IF_ERROR(expect(Tok::kArrow, "'->'"));
    KILN_RETURN_IF_ERROR(expect(Tok::kLParen, "'(' before the output types"));
    std::vector<TensorType> out_types;
    std::vector<std::string> out_names;  // "" where the output is named after its value
    std::vector<Sharding> out_shardings;
    if (tok_.kind != Tok::kRParen) {
      do {
        std::string out_name;
        if (tok_.kind == Tok::kValue) {
          out_name = name_of(tok_);
          if (out_name.empty()) return error(tok_, "expected an output name, got '%\"\"'");
          for (const auto& n : out_names)
            if (n == out_name) return error(tok_, "output name '%" + out_name + "' is used twice");
          advance();
          KILN_RETURN_IF_ERROR(expect(Tok::kColon, "':' after the output name"));
        }
        KILN_ASSIGN_OR_RETURN(TensorType type, parse_type());
        KILN_ASSIGN_OR_RETURN(Sharding sharding, parse_sharding());
        out_types.push_back(std::move(type));
        out_shardings.push_back(std::move(sharding));
        out_names.push_back(std::move(out_name));
      } while (consume_if(Tok::kComma));
    }
    KILN_RETURN_IF_ERROR(expect(Tok::kRParen, "',' or ')'"));
    if (depth == 0 && tok_.is_ident("mesh")) {
      advance();
      KILN_ASSIGN_OR_RETURN(DeviceMesh mesh, parse_mesh());
      g->set_mesh(std::move(mesh));
      if (tok_.is_ident("per_rank")) {
        g->set_per_rank(true);
        advance();
      }
    }
    KILN_RETURN_IF_ERROR(expect(Tok::kLBrace, "'{'"));
    while (!tok_.is_ident("return")) KILN_RETURN_IF_ERROR(parse_node(*g, scope, depth));

    const Token ret = tok_;
    advance();
    std::vector<Value*> outs;
    std::vector<Token> out_toks;
    if (tok_.kind == Tok::kValue) {
      do {
        out_toks.push_back(tok_);
        KILN_ASSIGN_OR_RETURN(Value * v, use_value(scope));
        outs.push_back(v);
      } while (consume_if(Tok::kComma));
    }
    if (outs.size() != out_types.size())
      return error(ret, "expected " + std::to_string(out_types.size()) +
                            " return values to match the signature, got " +
                            std::to_string(outs.size()));
    for (size_t i = 0; i < outs.size(); ++i)
      output_checks_.push_back(OutputCheck{out_toks[i], outs[i], std::move(out_types[i]), std::move(out_shardings[i])});
    g->set_outputs(std::move(outs), std::move(out_names));
    KILN_RETURN_IF_ERROR(expect(Tok::kRBrace, "'}' after the return values"));
    return g;
  }

  /// Reads a %name being defined; fails when it is already in scope or among `pending`.
  StatusOr<std::string> define_name(const Scope& scope, const std::vector<std::string>& pending) {
    std::string name = name_of(tok_);
    if (name.empty()) return error(tok_, "expected a value name, got '%\"\"'");
    bool taken = scope.count(name) != 0;
    for (const auto& p : pending) taken = taken || p == name;
    if (taken) return error(tok_, "redefinition of value " + value_ref(name));
    advance();
    return name;
  }

  StatusOr<Value*> use_value(const Scope& scope) {
    if (tok_.kind != Tok::kValue) return unexpected("value name '%name'");
    const std::string name = name_of(tok_);
    auto it = scope.find(name);
    if (it == scope.end())
      return error(tok_, "use of undefined value " + value_ref(name), StatusCode::kNotFound);
    advance();
    return it->second;
  }

  // [%r, ... =] op(%a, ...) [{attr = value, ...}] [: type, ...] [{ graph ... }]
  Status parse_node(Graph& g, Scope& scope, int depth) {
    const Token start = tok_;
    std::vector<std::string> names;
    if (tok_.kind == Tok::kValue) {
      do {
        if (tok_.kind != Tok::kValue) return unexpected("result name '%name'");
        KILN_ASSIGN_OR_RETURN(std::string name, define_name(scope, names));
        names.push_back(std::move(name));
      } while (consume_if(Tok::kComma));
      KILN_RETURN_IF_ERROR(expect(Tok::kEqual, "',' or '='"));
      if (tok_.kind != Tok::kIdent) return unexpected("op name");
    } else if (tok_.kind != Tok::kIdent) {
      return unexpected("'%name', op name or 'return'");
    }
    const std::string op(tok_.text);
    const OpDef* def = OpRegistry::global().find(op);
    if (!def) {
      std::vector<std::string> ops;
      for (const OpDef* d : OpRegistry::global().all()) ops.push_back(d->name);
      return error(
          tok_, "unknown op '" + op + "'" + did_you_mean(op, ops) + "; " + std::string(kPluginHint),
          StatusCode::kNotFound);
    }
    advance();

    KILN_RETURN_IF_ERROR(expect(Tok::kLParen, "'(' after the op name"));
    std::vector<Value*> operands;
    if (tok_.kind != Tok::kRParen) {
      do {
        KILN_ASSIGN_OR_RETURN(Value * v, use_value(scope));
        operands.push_back(v);
      } while (consume_if(Tok::kComma));
    }
    KILN_RETURN_IF_ERROR(expect(Tok::kRParen, "',' or ')'"));

    AttrMap attrs;
    if (tok_.kind == Tok::kLBrace && !regions_ahead()) KILN_RETURN_IF_ERROR(parse_attrs(*def, attrs));

    std::vector<TensorType> types;
    std::vector<Sharding> shardings;
    const Token colon = tok_;
    if (consume_if(Tok::kColon)) {
      do {
        KILN_ASSIGN_OR_RETURN(TensorType type, parse_type());
        KILN_ASSIGN_OR_RETURN(Sharding sharding, parse_sharding());
        types.push_back(std::move(type));
        shardings.push_back(std::move(sharding));
      } while (consume_if(Tok::kComma));
    } else if (!names.empty()) {
      return unexpected("':' and the result types");
    }
    if (types.size() != names.size())
      return error(colon, "expected " + std::to_string(names.size()) + " result types, got " +
                              std::to_string(types.size()));

    std::vector<std::unique_ptr<Graph>> regions;
    if (consume_if(Tok::kLBrace)) {
      do {
        KILN_ASSIGN_OR_RETURN(std::unique_ptr<Graph> region, parse_graph_def(depth + 1));
        regions.push_back(std::move(region));
      } while (tok_.is_ident("graph"));
      KILN_RETURN_IF_ERROR(expect(Tok::kRBrace, "'graph' or '}'"));
    }

    StatusOr<Node*> node = g.create_node(op, std::move(operands), std::move(types),
                                         std::move(attrs), nullptr, names);
    if (!node.ok()) return error_at(loc(start), node.status().code(), node.status().message());
    (*node)->set_loc(loc(start));
    for (auto& region : regions) (*node)->add_region(std::move(region));
    for (size_t i = 0; i < names.size(); ++i) {
      scope[names[i]] = (*node)->result(static_cast<int>(i));
      scope[names[i]]->set_sharding(std::move(shardings[i]));
    }
    return ok_status();
  }

  // '<' name '=' INT {',' name '=' INT} '>' after the keyword 'mesh'
  StatusOr<DeviceMesh> parse_mesh() {
    const Token start = tok_;
    KILN_RETURN_IF_ERROR(expect(Tok::kLAngle, "'<' after 'mesh'"));
    DeviceMesh mesh;
    do {
      if (tok_.kind != Tok::kIdent) return unexpected("mesh axis name");
      DeviceMesh::Axis axis{std::string(tok_.text), 0};
      advance();
      KILN_RETURN_IF_ERROR(expect(Tok::kEqual, "'=' after the mesh axis name"));
      if (tok_.kind != Tok::kInt) return unexpected("mesh axis size");
      const auto r = std::from_chars(tok_.text.data(), tok_.text.data() + tok_.text.size(), axis.size);
      if (r.ec != std::errc()) return error(tok_, "expected mesh axis size in the int64 range, got " + std::string(tok_.text));
      advance();
      mesh.axes.push_back(std::move(axis));
    } while (consume_if(Tok::kComma));
    KILN_RETURN_IF_ERROR(expect(Tok::kRAngle, "',' or '>'"));
    if (Status s = mesh.validate(); !s.ok()) return error(start, s.message());
    return mesh;
  }

  // Optional '<' placement {',' placement} '>' after a type: R, S(dim) or P(sum|max).
  StatusOr<Sharding> parse_sharding() {
    Sharding s;
    if (!consume_if(Tok::kLAngle)) return s;
    do {
      if (tok_.is_ident("R")) {
        s.push_back(Placement::replicate());
        advance();
        continue;
      }
      const bool shard = tok_.is_ident("S");
      if (!shard && !tok_.is_ident("P")) return unexpected("placement R, S(dim) or P(sum|max)");
      advance();
      KILN_RETURN_IF_ERROR(expect(Tok::kLParen, shard ? "'(' after 'S'" : "'(' after 'P'"));
      if (shard) {
        int64_t dim = 0;
        const auto r = tok_.kind == Tok::kInt
                           ? std::from_chars(tok_.text.data(), tok_.text.data() + tok_.text.size(), dim)
                           : std::from_chars_result{nullptr, std::errc::invalid_argument};
        if (r.ec != std::errc()) return unexpected("shard dim");
        s.push_back(Placement::shard(dim));
      } else {
        const std::optional<ReduceOp> op = tok_.kind == Tok::kIdent ? parse_reduce_op(std::string(tok_.text)) : std::nullopt;
        if (!op) return unexpected("'sum' or 'max'");
        s.push_back(Placement::partial(*op));
      }
      advance();
      KILN_RETURN_IF_ERROR(expect(Tok::kRParen, "')'"));
    } while (consume_if(Tok::kComma));
    KILN_RETURN_IF_ERROR(expect(Tok::kRAngle, "',' or '>'"));
    return s;
  }

  /// {name = value, ...}, each value normalized to the kind `def` declares for it.
  Status parse_attrs(const OpDef& def, AttrMap& attrs) {
    advance();  // '{'
    if (tok_.kind != Tok::kRBrace) {
      do {
        if (tok_.kind != Tok::kIdent) return unexpected("attribute name");
        const Token name_tok = tok_;
        const std::string name(tok_.text);
        if (attrs.count(name)) return error(name_tok, "duplicate attribute '" + name + "'");
        const AttrSpec* spec = def.find_attr(name);
        if (!spec && !is_annotation(name)) return error(name_tok, def.name + ": unknown attribute '" + name + "'");
        advance();
        KILN_RETURN_IF_ERROR(expect(Tok::kEqual, "'=' after the attribute name"));
        KILN_ASSIGN_OR_RETURN(Attribute value, parse_attr_value());
        if (!spec) {  // an annotation keeps the kind it is written in
          attrs.emplace(name, value);
          continue;
        }
        if (!value.convertible_to(spec->kind))
          return error(name_tok, def.name + ": expected " + attr_kind_name(spec->kind) +
                                     " for attribute '" + name + "', got " +
                                     attr_kind_name(value.kind()));
        attrs.emplace(name, value.converted_to(spec->kind));
      } while (consume_if(Tok::kComma));
    }
    return expect(Tok::kRBrace, "',' or '}'");
  }

  StatusOr<Attribute> parse_attr_value() {
    switch (tok_.kind) {
      case Tok::kInt:
      case Tok::kFloat:
      case Tok::kMinus: {
        KILN_ASSIGN_OR_RETURN(Number n, parse_number());
        return n.is_float ? Attribute(n.d) : Attribute(n.i);
      }
      case Tok::kString: {
        Attribute a(kir::unquote(tok_.text));
        advance();
        return a;
      }
      case Tok::kLBracket: return parse_list();
      case Tok::kIdent: {
        if (tok_.is_ident("true") || tok_.is_ident("false")) {
          Attribute a(int64_t{tok_.is_ident("true") ? 1 : 0});
          advance();
          return a;
        }
        if (tok_.is_ident("inf") || tok_.is_ident("nan")) {
          KILN_ASSIGN_OR_RETURN(Number n, parse_number());
          return Attribute(n.d);
        }
        if (tok_.is_ident("dense")) {
          KILN_ASSIGN_OR_RETURN(Tensor t, parse_dense());
          return Attribute(std::move(t));
        }
        if (auto dt = parse_dtype(tok_.text)) {
          advance();
          return Attribute(*dt);
        }
        break;
      }
      default: break;
    }
    return unexpected("attribute value");
  }

  /// [1, 2] (ints), [1.0, 2] (floats), ["a"] (strings) or [] (an empty int list).
  StatusOr<Attribute> parse_list() {
    advance();  // '['
    std::vector<Number> nums;
    std::vector<std::string> strs;
    bool any_float = false;
    if (tok_.kind != Tok::kRBracket) {
      do {
        if (tok_.kind == Tok::kString && nums.empty()) {
          strs.push_back(kir::unquote(tok_.text));
          advance();
          continue;
        }
        if (!strs.empty()) return unexpected("string");
        if (!starts_number()) return unexpected(nums.empty() ? "list element" : "number");
        KILN_ASSIGN_OR_RETURN(Number n, parse_number());
        any_float = any_float || n.is_float;
        nums.push_back(n);
      } while (consume_if(Tok::kComma));
    }
    KILN_RETURN_IF_ERROR(expect(Tok::kRBracket, "',' or ']'"));
    if (!strs.empty()) return Attribute(std::move(strs));
    if (any_float) {
      std::vector<double> v;
      v.reserve(nums.size());
      for (const Number& n : nums) v.push_back(n.as_double());
      return Attribute(std::move(v));
    }
    std::vector<int64_t> v;
    v.reserve(nums.size());
    for (const Number& n : nums) v.push_back(n.i);
    return Attribute(std::move(v));
  }

  bool starts_number() const {
    return tok_.kind == Tok::kInt || tok_.kind == Tok::kFloat || tok_.kind == Tok::kMinus ||
           tok_.is_ident("inf") || tok_.is_ident("nan");
  }

  /// [-](int | float | inf | nan); ints must fit int64, floats f64.
  StatusOr<Number> parse_number() {
    const Token start = tok_;
    const bool neg = consume_if(Tok::kMinus);
    const std::string sign = neg ? "-" : "";
    Number n;
    const char* b = tok_.text.data();
    const char* e = b + tok_.text.size();
    if (tok_.kind == Tok::kInt) {
      uint64_t mag = 0;
      const auto r = std::from_chars(b, e, mag);
      const uint64_t limit = neg ? uint64_t{1} << 63 : uint64_t{INT64_MAX};
      if (r.ec != std::errc() || mag > limit)
        return error(start, "expected integer in the int64 range, got " + sign +
                                std::string(tok_.text));
      n.i = neg ? static_cast<int64_t>(0 - mag) : static_cast<int64_t>(mag);
    } else if (tok_.kind == Tok::kFloat) {
      const auto r = std::from_chars(b, e, n.d);
      if (r.ec != std::errc() || r.ptr != e)
        return error(start, "expected float in the f64 range, got " + sign +
                                std::string(tok_.text));
      n.is_float = true;
      if (neg) n.d = -n.d;
    } else if (tok_.is_ident("inf") || tok_.is_ident("nan")) {
      n.is_float = true;
      n.d = tok_.is_ident("inf") ? std::numeric_limits<double>::infinity()
                                 : std::numeric_limits<double>::quiet_NaN();
      if (neg) n.d = -n.d;
    } else {
      return unexpected("number");
    }
    advance();
    return n;
  }

  // dtype[dim, ...] where dim is an integer >= 0, a symbol (bare or quoted) or '?'
  StatusOr<TensorType> parse_type() {
    const Token start = tok_;
    if (tok_.kind != Tok::kIdent) return unexpected("type");
    const std::optional<DType> dt = parse_dtype(tok_.text);
    if (!dt) return unexpected("dtype");
    advance();
    KILN_RETURN_IF_ERROR(expect(Tok::kLBracket, "'[' after the dtype"));
    TensorType type{*dt, {}};
    if (tok_.kind != Tok::kRBracket) {
      do {
        if (tok_.kind == Tok::kInt) {
          int64_t v = 0;
          const auto r = std::from_chars(tok_.text.data(), tok_.text.data() + tok_.text.size(), v);
          if (r.ec != std::errc())
            return error(tok_, "expected dim in the int64 range, got " + std::string(tok_.text));
          type.shape.emplace_back(v);
        } else if (tok_.kind == Tok::kIdent) {
          type.shape.push_back(Dim::symbol(std::string(tok_.text)));
        } else if (tok_.kind == Tok::kString) {
          std::string sym = kir::unquote(tok_.text);
          if (sym.empty()) return unexpected("dim symbol");
          type.shape.push_back(Dim::symbol(std::move(sym)));
        } else if (tok_.kind == Tok::kQuestion) {
          type.shape.push_back(Dim::unknown());
        } else if (tok_.kind == Tok::kMinus) {
          const Token minus = tok_;
          advance();
          return error(minus, "expected dim >= 0, got -" + std::string(tok_.text));
        } else {
          return unexpected("dim (integer, symbol or '?')");
        }
        advance();
      } while (consume_if(Tok::kComma));
    }
    KILN_RETURN_IF_ERROR(expect(Tok::kRBracket, "',' or ']'"));
    // Bound the static element count so sizes computed from types never overflow.
    int64_t n = 1;
    bool empty = false;
    for (const Dim& d : type.shape) empty = empty || (d.is_static() && d.value() == 0);
    for (const Dim& d : type.shape) {
      if (empty || !d.is_static()) continue;
      if (d.value() > kMaxElements / n)
        return error(start, "expected at most 2^59 elements, got " + type_text(type));
      n *= d.value();
    }
    return type;
  }

  // dense<type>[elem, ...] or dense<type>(file "path", offset N)
  StatusOr<Tensor> parse_dense() {
    advance();  // 'dense'
    KILN_RETURN_IF_ERROR(expect(Tok::kLAngle, "'<' after 'dense'"));
    const Token type_tok = tok_;
    KILN_ASSIGN_OR_RETURN(TensorType type, parse_type());
    if (!is_static(type.shape))
      return error(type_tok, "expected static shape in dense<...>, got " + type_text(type));
    KILN_RETURN_IF_ERROR(expect(Tok::kRAngle, "'>'"));
    std::vector<int64_t> dims = static_sizes(type.shape);
    const int64_t numel = num_elements(type.shape);
    if (tok_.kind == Tok::kLParen) return parse_file_ref(type.dtype, std::move(dims), numel);
    if (tok_.kind != Tok::kLBracket) return unexpected("'[' or '(' after dense<...>");

    const Token open = tok_;
    advance();
    const DType dt = type.dtype;
    const bool floating = is_float(dt);
    const auto [lo, hi] = int_range(dt);
    std::vector<double> floats;
    std::vector<int64_t> ints;
    int64_t count = 0;
    if (tok_.kind != Tok::kRBracket) {
      do {
        const Token elem = tok_;
        Number n;
        if (dt == DType::kBool && (tok_.is_ident("true") || tok_.is_ident("false"))) {
          n.i = tok_.is_ident("true") ? 1 : 0;
          advance();
        } else {
          if (!starts_number()) return unexpected(std::string(dtype_name(dt)) + " element");
          KILN_ASSIGN_OR_RETURN(n, parse_number());
        }
        if (!floating && n.is_float)
          return error(elem, "expected integer element for " + std::string(dtype_name(dt)) +
                                 ", got float");
        if (!floating && (n.i < lo || n.i > hi))
          return error(elem, "expected " + std::string(dtype_name(dt)) + " element in [" +
                                 std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                                 std::to_string(n.i));
        // Stop storing past numel: the count is reported below, memory stays bounded.
        if (count < numel) {
          if (floating) floats.push_back(n.as_double());
          else ints.push_back(n.i);
        }
        ++count;
      } while (consume_if(Tok::kComma));
    }
    KILN_RETURN_IF_ERROR(expect(Tok::kRBracket, "',' or ']'"));
    if (count != numel)
      return error(open, "expected " + std::to_string(numel) + " elements for " +
                             type_text(type) + ", got " + std::to_string(count));
    if (!floating) return Tensor::from_i64(dt, std::move(dims), ints);
    Tensor t(dt, std::move(dims));
    for (size_t i = 0; i < floats.size(); ++i) store_float(t, static_cast<int64_t>(i), floats[i]);
    return t;
  }

  /// Stores element `i` so that printing reproduces the literal: unlike set_f64 this keeps
  /// the sign of NaN and the infinities of f8e5m2 (whose cast saturates).
  static void store_float(Tensor& t, int64_t i, double v) {
    if (t.dtype() == DType::kF8E5M2) t.mutable_data_as<uint8_t>()[i] = f64_to_f8e5m2_bits(v, false);
    else t.set_f64(i, v);
    if (std::isnan(v) && std::signbit(v)) {
      const int64_t size = dtype_bits(t.dtype()) / 8;  // every float dtype has whole bytes
      t.mutable_data()[i * size + size - 1] |= std::byte{0x80};  // little-endian sign bit
    }
  }

  // (file "relative/path", offset N): the bytes live in a side file next to the .kir.
  StatusOr<Tensor> parse_file_ref(DType dt, std::vector<int64_t> dims, int64_t numel) {
    advance();  // '('
    KILN_RETURN_IF_ERROR(expect_keyword("file"));
    if (tok_.kind != Tok::kString) return unexpected("side file path string");
    const Token path_tok = tok_;
    const std::string rel = kir::unquote(tok_.text);
    advance();
    KILN_RETURN_IF_ERROR(expect(Tok::kComma, "','"));
    KILN_RETURN_IF_ERROR(expect_keyword("offset"));
    const Token off_tok = tok_;
    if (tok_.kind != Tok::kInt) return unexpected("offset (an integer >= 0)");
    KILN_ASSIGN_OR_RETURN(Number off, parse_number());
    KILN_RETURN_IF_ERROR(expect(Tok::kRParen, "')'"));

    KILN_ASSIGN_OR_RETURN(std::shared_ptr<const Mapping> file, map_side_file(rel, path_tok));
    const auto offset = static_cast<uint64_t>(off.i);
    const auto nbytes = static_cast<uint64_t>(dtype_storage_bytes(dt, numel));
    if (offset > file->size || nbytes > file->size - offset)
      return error(off_tok, "side file '" + rel + "': " + std::to_string(nbytes) +
                                " bytes at offset " + std::to_string(offset) +
                                " exceed its size of " + std::to_string(file->size) + " bytes",
                   StatusCode::kOutOfRange);
    const std::byte* bytes = file->data + offset;
    // Wrap in place when aligned (the printer always aligns); copy odd offsets so element
    // loads stay aligned.
    if (offset % 64 == 0) return Tensor::wrap(dt, std::move(dims), bytes, file);
    Tensor t(dt, std::move(dims));
    if (nbytes) std::memcpy(t.mutable_data(), bytes, nbytes);
    return t;
  }

  StatusOr<std::shared_ptr<const Mapping>> map_side_file(const std::string& rel, const Token& at) {
    namespace fs = std::filesystem;
    const fs::path p(rel);
    if (rel.empty()) return error(at, "expected side file path, got empty string");
    if (p.has_root_path())
      return error(at, "expected relative side file path, got '" + rel + "'");
    for (const fs::path& part : p)
      if (part == "..") return error(at, "expected side file path without '..', got '" + rel + "'");
    if (auto it = side_files_.find(rel); it != side_files_.end()) return it->second;

    const std::string full = (base_dir_ / p).string();
    const int fd = ::open(full.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      return error(at, "cannot open side file '" + rel + "': " + std::strerror(err),
                   err == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError);
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return error(at, "expected side file '" + rel + "' to be a regular file",
                   StatusCode::kIoError);
    }
    auto mapping = std::make_shared<Mapping>();
    mapping->size = static_cast<size_t>(st.st_size);
    if (mapping->size > 0) {
      void* addr = mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (addr == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        return error(at, "cannot map side file '" + rel + "': " + std::strerror(err),
                     StatusCode::kIoError);
      }
      mapping->data = static_cast<const std::byte*>(addr);
    }
    ::close(fd);
    side_files_.emplace(rel, mapping);
    return std::shared_ptr<const Mapping>(std::move(mapping));
  }

  /// A graph output and the type its signature declares, checked after verification.
  struct OutputCheck {
    Token at;
    const Value* value;
    TensorType declared;
    Sharding declared_sharding;
  };

  Lexer lex_;
  Token tok_;
  std::vector<OutputCheck> output_checks_;
  std::string file_;
  std::filesystem::path base_dir_;
  std::map<std::string, std::shared_ptr<const Mapping>> side_files_;
};

}  // namespace

StatusOr<std::unique_ptr<Graph>> parse_graph(std::string_view text, const std::string& filename) {
  return Parser(text, filename).parse();
}

StatusOr<std::unique_ptr<Graph>> parse_graph_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    const int err = errno;
    return Status(err == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError,
                  "cannot read '" + path + "': " + std::strerror(err));
  }
  std::string text;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return io_error("cannot read '" + path + "'");
  return parse_graph(text, path);
}

}  // namespace kiln
