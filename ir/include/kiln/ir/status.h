// Status, StatusOr and source locations: how every Kiln API reports failure.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace kiln {

/// Where a piece of IR came from; `line == 0` means unknown.
struct Location {
  std::string file;
  int line = 0;
  int col = 0;

  bool known() const { return line > 0; }
  /// "file:line:col", or "" when unknown.
  std::string str() const {
    if (!known()) return {};
    return (file.empty() ? std::string("<input>") : file) + ":" + std::to_string(line) + ":" +
           std::to_string(col);
  }
};

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   ///< bad input: malformed file, bad option, wrong dtype
  kNotFound,          ///< unknown name, missing file
  kAlreadyExists,     ///< duplicate registration
  kUnimplemented,     ///< a backend or op that does not support this
  kFailedPrecondition,///< ABI mismatch, wrong state
  kOutOfRange,        ///< index or size out of bounds
  kIoError,           ///< reading or writing files
  kInternal,          ///< a bug in Kiln
};

const char* status_code_name(StatusCode code);

/// The result of an operation that can fail: a code and a message.
/// Messages are lowercase, with no final period; a location, when known, prefixes them.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  /// Prepends context: "while X: <message>".
  Status with_context(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status ok_status() { return {}; }
inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status already_exists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
inline Status unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status failed_precondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status out_of_range(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status io_error(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

/// An error located in a source file: "file:line:col: message" (or just message).
inline Status error_at(const Location& loc, StatusCode code, const std::string& message) {
  return Status(code, loc.known() ? loc.str() + ": " + message : message);
}

/// A value or the Status explaining why there is none.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : v_(std::move(value)) {}  // NOLINT(implicit)
  StatusOr(Status status) : v_(std::move(status)) {  // NOLINT(implicit)
    assert(!std::get<Status>(v_).ok() && "StatusOr built from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace kiln

#define KILN_CONCAT_INNER(a, b) a##b
#define KILN_CONCAT(a, b) KILN_CONCAT_INNER(a, b)

/// Returns the Status from the enclosing function when `expr` fails.
#define KILN_RETURN_IF_ERROR(expr)              \
  do {                                          \
    ::kiln::Status kiln_status_ = (expr);       \
    if (!kiln_status_.ok()) return kiln_status_; \
  } while (0)

/// `KILN_ASSIGN_OR_RETURN(auto x, f())`: binds the value or returns the error.
#define KILN_ASSIGN_OR_RETURN(lhs, expr) \
  KILN_ASSIGN_OR_RETURN_IMPL(KILN_CONCAT(kiln_statusor_, __LINE__), lhs, expr)
#define KILN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
