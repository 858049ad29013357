// Tokenizer and literal spelling (names, strings, floats) of the .kir text format.
#include "text_lexer.h"

#include <charconv>
#include <cmath>

namespace kiln::kir {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_ident_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_ident_char(char c) { return is_ident_start(c) || is_digit(c) || c == '.'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
int hex_value(char c) { return is_digit(c) ? c - '0' : (c | 0x20) - 'a' + 10; }

const char kHexDigits[] = "0123456789abcdef";

/// Appends byte `c` readably for diagnostics: printable ASCII as is, others as \xHH.
void append_readable(std::string& out, char c) {
  const auto u = static_cast<unsigned char>(c);
  if (u >= 0x20 && u < 0x7f) {
    out += c;
  } else {
    out += "\\x";
    out += kHexDigits[u >> 4];
    out += kHexDigits[u & 15];
  }
}

}  // namespace

bool is_identifier(std::string_view s) {
  if (s.empty() || !is_ident_start(s[0])) return false;
  for (char c : s)
    if (!is_ident_char(c)) return false;
  return true;
}

bool is_bare_name(std::string_view s) {
  if (is_identifier(s)) return true;
  if (s.empty()) return false;
  for (char c : s)
    if (!is_digit(c)) return false;
  return true;
}

void append_quoted(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        // Bytes >= 0x80 pass through so UTF-8 stays readable.
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) append_readable(out, c);
        else out += c;
    }
  }
  out += '"';
}

std::string unquote(std::string_view token) {
  std::string out;
  if (token.size() < 2) return out;
  std::string_view body = token.substr(1, token.size() - 2);
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 >= body.size()) {
      out += body[i];
      continue;
    }
    const char e = body[++i];
    switch (e) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case 'x':
        if (i + 2 < body.size()) {
          out += static_cast<char>(hex_value(body[i + 1]) * 16 + hex_value(body[i + 2]));
          i += 2;
        }
        break;
      default: out += e;  // '"' and '\\'
    }
  }
  return out;
}

void append_double(std::string& out, double v) {
  if (std::isnan(v)) {
    out += std::signbit(v) ? "-nan" : "nan";
    return;
  }
  if (std::isinf(v)) {
    out += v < 0 ? "-inf" : "inf";
    return;
  }
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  const std::string_view s(buf, static_cast<size_t>(r.ptr - buf));
  out += s;
  // "1" would read back as an int; the suffix keeps the float kind across a round trip.
  if (s.find_first_of(".e") == std::string_view::npos) out += ".0";
}

void append_name(std::string& out, char sigil, std::string_view name) {
  out += sigil;
  if (is_bare_name(name)) out += name;
  else append_quoted(out, name);
}

void append_type(std::string& out, const TensorType& t) {
  out += dtype_name(t.dtype);
  out += '[';
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (i) out += ", ";
    const Dim& d = t.shape[i];
    if (d.is_static()) out += std::to_string(d.value());
    else if (d.is_unknown() || is_identifier(d.symbol_name())) out += d.symbol_name();
    else append_quoted(out, d.symbol_name());
  }
  out += ']';
}

std::string type_text(const TensorType& t) {
  std::string out;
  append_type(out, t);
  return out;
}

std::string describe(const Token& t) {
  if (t.kind == Tok::kEof) return "end of input";
  constexpr size_t kMax = 40;
  std::string out = t.kind == Tok::kString ? "string " : "'";
  const std::string_view text = t.text.substr(0, kMax);
  for (char c : text) append_readable(out, c);
  if (t.text.size() > kMax) out += "...";
  if (t.kind != Tok::kString) out += '\'';
  return out;
}

Token Lexer::make(Tok kind, size_t begin, int line, int col) const {
  return Token{kind, src_.substr(begin, pos_ - begin), line, col};
}

Token Lexer::fail(std::string message, int line, int col) {
  error_ = std::move(message);
  error_token_ = Token{Tok::kError, src_.substr(pos_, pos_ < src_.size() ? 1 : 0), line, col};
  // Stop here: later calls return end of input rather than guessing how to resync.
  pos_ = src_.size();
  return error_token_;
}

bool Lexer::scan_string(int line, int col) {
  ++pos_;  // opening quote
  while (pos_ < src_.size()) {
    const char c = src_[pos_];
    if (c == '"') {
      ++pos_;
      return true;
    }
    if (c == '\n') break;
    if (c == '\\') {
      const char e = pos_ + 1 < src_.size() ? src_[pos_ + 1] : '\0';
      if (e == 'n' || e == 't' || e == 'r' || e == '"' || e == '\\') {
        pos_ += 2;
        continue;
      }
      if (e == 'x' && pos_ + 3 < src_.size() && is_hex(src_[pos_ + 2]) && is_hex(src_[pos_ + 3])) {
        pos_ += 4;
        continue;
      }
      std::string got = "'\\";
      if (pos_ + 1 < src_.size()) append_readable(got, e);
      fail("expected escape sequence (\\n, \\t, \\r, \\\", \\\\ or \\xHH), got " + got + "'",
           line_, static_cast<int>(pos_ - line_start_) + 1);
      return false;
    }
    ++pos_;
  }
  fail(std::string("expected closing '\"' of string, got ") +
           (pos_ < src_.size() ? "end of line" : "end of input"),
       line, col);
  return false;
}

bool Lexer::scan_name(char sigil, int line, int col) {
  ++pos_;  // sigil
  const char c = pos_ < src_.size() ? src_[pos_] : '\0';
  if (c == '"') return scan_string(line, col);
  const std::string what = sigil == '%' ? "value name" : "graph name";
  if (is_ident_start(c)) {
    while (pos_ < src_.size() && is_ident_char(src_[pos_])) ++pos_;
    return true;
  }
  if (is_digit(c)) {
    while (pos_ < src_.size() && is_digit(src_[pos_])) ++pos_;
    if (pos_ < src_.size() && is_ident_char(src_[pos_])) {
      std::string got = "'";
      append_readable(got, src_[pos_]);
      fail("expected only digits in numeric " + what + ", got " + got + "'", line_,
           static_cast<int>(pos_ - line_start_) + 1);
      return false;
    }
    return true;
  }
  std::string got = "end of input";
  if (pos_ < src_.size()) {
    got = "'";
    append_readable(got, c);
    got += "'";
  }
  fail("expected " + what + " after '" + sigil + "', got " + got, line, col);
  return false;
}

Token Lexer::next() {
  // Skip whitespace and comments.
  while (pos_ < src_.size()) {
    const char c = src_[pos_];
    if (c == '\n') {
      ++pos_;
      ++line_;
      line_start_ = pos_;
    } else if (c == ' ' || c == '\t' || c == '\r') {
      ++pos_;
    } else if (c == '/' && pos_ + 1 < src_.size() && src_[pos_ + 1] == '/') {
      while (pos_ < src_.size() && src_[pos_] != '\n') ++pos_;
    } else {
      break;
    }
  }
  const int line = line_;
  const int col = static_cast<int>(pos_ - line_start_) + 1;
  const size_t begin = pos_;
  if (pos_ >= src_.size()) return Token{Tok::kEof, {}, line, col};

  const char c = src_[pos_];
  auto single = [&](Tok kind) {
    ++pos_;
    return make(kind, begin, line, col);
  };
  switch (c) {
    case '(': return single(Tok::kLParen);
    case ')': return single(Tok::kRParen);
    case '{': return single(Tok::kLBrace);
    case '}': return single(Tok::kRBrace);
    case '[': return single(Tok::kLBracket);
    case ']': return single(Tok::kRBracket);
    case '<': return single(Tok::kLAngle);
    case '>': return single(Tok::kRAngle);
    case ',': return single(Tok::kComma);
    case ':': return single(Tok::kColon);
    case '=': return single(Tok::kEqual);
    case '?': return single(Tok::kQuestion);
    case '-':
      if (pos_ + 1 < src_.size() && src_[pos_ + 1] == '>') {
        pos_ += 2;
        return make(Tok::kArrow, begin, line, col);
      }
      return single(Tok::kMinus);
    case '"':
      if (!scan_string(line, col)) return error_token_;
      return make(Tok::kString, begin, line, col);
    case '%':
    case '@':
      if (!scan_name(c, line, col)) return error_token_;
      return make(c == '%' ? Tok::kValue : Tok::kGlobal, begin, line, col);
    default: break;
  }
  if (is_ident_start(c)) {
    while (pos_ < src_.size() && is_ident_char(src_[pos_])) ++pos_;
    return make(Tok::kIdent, begin, line, col);
  }
  if (is_digit(c)) {
    bool is_float = false;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < src_.size() && is_digit(src_[pos_])) ++pos_;
      return pos_ > from;
    };
    auto bad = [&](const std::string& expected) {
      std::string got = "end of input";
      if (pos_ < src_.size()) {
        got = "'";
        append_readable(got, src_[pos_]);
        got += "'";
      }
      return fail("expected " + expected + " in number, got " + got, line_,
                  static_cast<int>(pos_ - line_start_) + 1);
    };
    digits();
    if (pos_ < src_.size() && src_[pos_] == '.') {
      ++pos_;
      is_float = true;
      if (!digits()) return bad("digit after '.'");
    }
    if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      ++pos_;
      is_float = true;
      if (pos_ < src_.size() && (src_[pos_] == '+' || src_[pos_] == '-')) ++pos_;
      if (!digits()) return bad("exponent digits");
    }
    if (pos_ < src_.size() && is_ident_char(src_[pos_])) return bad("separator after digits");
    return make(is_float ? Tok::kFloat : Tok::kInt, begin, line, col);
  }
  std::string got = "'";
  append_readable(got, c);
  return fail("expected a token, got " + got + "'", line, col);
}

}  // namespace kiln::kir
