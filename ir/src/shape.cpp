// Shapes with static and symbolic dims: printing, broadcasting, axis normalization.
#include "kiln/ir/shape.h"

#include <cassert>

namespace kiln {

bool is_static(const Shape& s) {
  for (const Dim& d : s)
    if (!d.is_static()) return false;
  return true;
}

std::vector<int64_t> static_sizes(const Shape& s) {
  std::vector<int64_t> out;
  out.reserve(s.size());
  for (const Dim& d : s) {
    assert(d.is_static());
    out.push_back(d.value());
  }
  return out;
}

Shape shape_of(const std::vector<int64_t>& sizes) { return Shape(sizes.begin(), sizes.end()); }

int64_t num_elements(const Shape& s) {
  int64_t n = 1;
  for (const Dim& d : s) {
    if (!d.is_static()) return -1;
    n *= d.value();
  }
  return n;
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += s[i].str();
  }
  return out + "]";
}

std::string TensorType::str() const { return std::string(dtype_name(dtype)) + shape_str(shape); }

StatusOr<Shape> broadcast_shapes(const Shape& a, const Shape& b) {
  const size_t rank = std::max(a.size(), b.size());
  Shape out(rank);
  for (size_t i = 0; i < rank; ++i) {
    const Dim da = i < rank - a.size() ? Dim(1) : a[i - (rank - a.size())];
    const Dim db = i < rank - b.size() ? Dim(1) : b[i - (rank - b.size())];
    if (da == db) {
      out[i] = da;
    } else if (da.is_static() && da.value() == 1) {
      out[i] = db;
    } else if (db.is_static() && db.value() == 1) {
      out[i] = da;
    } else if (da.is_static() && db.is_static()) {
      return invalid_argument("cannot broadcast " + shape_str(a) + " with " + shape_str(b));
    } else if (da.is_static()) {
      out[i] = da;  // the symbol must be 1 or equal at run time
    } else if (db.is_static()) {
      out[i] = db;
    } else {
      out[i] = Dim::unknown();
    }
  }
  return out;
}

StatusOr<int64_t> normalize_axis(int64_t axis, int64_t rank) {
  if (axis < -rank || axis >= rank)
    return invalid_argument("axis " + std::to_string(axis) + " is out of range for rank " +
                            std::to_string(rank));
  return axis < 0 ? axis + rank : axis;
}

}  // namespace kiln
