// Tokens and literal spelling of the .kir text format, shared by its printer and parser.
#pragma once

#include <string>
#include <string_view>

#include "kiln/ir/shape.h"

namespace kiln::kir {

enum class Tok {
  kEof,
  kError,     ///< a malformed token; Lexer::error() says why
  kIdent,     ///< [A-Za-z_][A-Za-z0-9_.]*: keywords, op names, dtypes, symbols, attribute names
  kValue,     ///< %name, %123 or %"quoted"
  kGlobal,    ///< @name or @"quoted"
  kInt,       ///< 123 (no sign: '-' is its own token)
  kFloat,     ///< 1.5, 1e-05, 2.5E+3
  kString,    ///< "text" with escapes
  kLParen, kRParen, kLBrace, kRBrace, kLBracket, kRBracket, kLAngle, kRAngle,
  kComma, kColon, kEqual, kArrow, kMinus, kQuestion,
};

/// One token: its kind, its exact source text, and where it starts (1-based, columns in bytes).
struct Token {
  Tok kind = Tok::kEof;
  std::string_view text;
  int line = 1;
  int col = 1;

  bool is_ident(std::string_view word) const { return kind == Tok::kIdent && text == word; }
};

/// Splits .kir text into tokens on demand (so huge inline tensors are never tokenized up
/// front). Copying a Lexer is cheap and gives lookahead.
class Lexer {
 public:
  explicit Lexer(std::string_view src) : src_(src) {}
  /// The next token; kEof forever at the end, kError (with error()) on malformed input.
  Token next();
  /// Why the last kError token is malformed: "expected ..., got ..." without a location.
  const std::string& error() const { return error_; }

 private:
  Token make(Tok kind, size_t begin, int line, int col) const;
  Token fail(std::string message, int line, int col);
  /// Scans a quoted string starting at pos_ (on the '"'); false on a malformed one.
  bool scan_string(int line, int col);
  /// Scans the name after a '%' or '@' sigil; false on a malformed one.
  bool scan_name(char sigil, int line, int col);

  std::string_view src_;
  size_t pos_ = 0;
  int line_ = 1;
  size_t line_start_ = 0;
  std::string error_;
  Token error_token_;
};

/// [A-Za-z_][A-Za-z0-9_.]* — what may appear bare as an identifier or dim symbol.
bool is_identifier(std::string_view s);
/// An identifier or all digits — what may follow '%' or '@' without quotes.
bool is_bare_name(std::string_view s);
/// Appends `s` as a double-quoted literal, escaping '"', '\' and control bytes.
void append_quoted(std::string& out, std::string_view s);
/// The contents of a string token validated by the lexer (`token` includes the quotes).
std::string unquote(std::string_view token);
/// Appends `v` in its shortest round-trip form, always recognisable as a float:
/// "1.0", "2.5", "1e-05", "inf", "-inf", "nan".
void append_double(std::string& out, double v);
/// Appends `name` after `sigil` ('%' or '@'), quoted when it is not a bare name.
void append_name(std::string& out, char sigil, std::string_view name);
/// Appends a type as .kir spells it: "f32[B, 784, ?]"; odd symbols are quoted.
void append_type(std::string& out, const TensorType& t);
std::string type_text(const TensorType& t);
/// Describes a token for "got ..." in diagnostics: "'foo'", "string \"x\"", "end of input".
std::string describe(const Token& t);

}  // namespace kiln::kir
