// Dimensions (static or symbolic), shapes and tensor types.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kiln/ir/dtype.h"
#include "kiln/ir/status.h"

namespace kiln {

/// One dimension: a static size, a named symbol ("B", "seq") or unknown ("?").
/// Two equal symbols in one graph denote the same size at run time.
class Dim {
 public:
  Dim() = default;
  Dim(int64_t value) : value_(value) {}  // NOLINT(implicit): shapes read naturally as {2, 3}
  static Dim fixed(int64_t v) { return Dim(v); }
  static Dim symbol(std::string name) { Dim d; d.value_ = -1; d.symbol_ = std::move(name); return d; }
  static Dim unknown() { return symbol("?"); }

  bool is_static() const { return symbol_.empty(); }
  bool is_unknown() const { return symbol_ == "?"; }
  int64_t value() const { return value_; }            ///< only meaningful when is_static()
  const std::string& symbol_name() const { return symbol_; }
  std::string str() const { return is_static() ? std::to_string(value_) : symbol_; }

  bool operator==(const Dim& o) const { return value_ == o.value_ && symbol_ == o.symbol_; }
  bool operator!=(const Dim& o) const { return !(*this == o); }

 private:
  int64_t value_ = 0;
  std::string symbol_;
};

using Shape = std::vector<Dim>;

bool is_static(const Shape& s);
/// The sizes of an all-static shape (asserts otherwise).
std::vector<int64_t> static_sizes(const Shape& s);
Shape shape_of(const std::vector<int64_t>& sizes);
/// Product of sizes; -1 when any dim is not static.
int64_t num_elements(const Shape& s);
/// "[2, B, ?]"
std::string shape_str(const Shape& s);

/// Numpy broadcasting of two shapes. Symbols broadcast with themselves and with 1;
/// a symbol against a different static size > 1 takes the static size; two different
/// symbols give "?" (checked at run time). Errors on static mismatch.
StatusOr<Shape> broadcast_shapes(const Shape& a, const Shape& b);

/// Maps a possibly negative axis into [0, rank); error when out of range.
StatusOr<int64_t> normalize_axis(int64_t axis, int64_t rank);

/// The type of an SSA value: element type and shape.
struct TensorType {
  DType dtype = DType::kF32;
  Shape shape;

  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  /// "f32[2, B]"
  std::string str() const;
  bool operator==(const TensorType& o) const { return dtype == o.dtype && shape == o.shape; }
  bool operator!=(const TensorType& o) const { return !(*this == o); }
};

}  // namespace kiln
