// Attribute kinds, conversions and equality.
#include "kiln/ir/attribute.h"

#include <cmath>

namespace kiln {

const char* attr_kind_name(AttrKind k) {
  switch (k) {
    case AttrKind::kInt: return "int";
    case AttrKind::kFloat: return "float";
    case AttrKind::kString: return "string";
    case AttrKind::kInts: return "int list";
    case AttrKind::kFloats: return "float list";
    case AttrKind::kStrings: return "string list";
    case AttrKind::kTensor: return "tensor";
    case AttrKind::kDType: return "dtype";
  }
  return "unknown";
}

std::vector<double> Attribute::as_floats() const {
  if (kind() == AttrKind::kInts) {
    const auto& ints = as_ints();
    return std::vector<double>(ints.begin(), ints.end());
  }
  return std::get<std::vector<double>>(v_);
}

namespace {
bool is_empty_list(const Attribute& a) {
  switch (a.kind()) {
    case AttrKind::kInts: return a.as_ints().empty();
    case AttrKind::kFloats: return a.as_floats().empty();
    case AttrKind::kStrings: return a.as_strings().empty();
    default: return false;
  }
}
bool is_list(AttrKind k) {
  return k == AttrKind::kInts || k == AttrKind::kFloats || k == AttrKind::kStrings;
}
}  // namespace

bool Attribute::convertible_to(AttrKind k) const {
  if (kind() == k) return true;
  if (k == AttrKind::kFloat && kind() == AttrKind::kInt) return true;
  if (k == AttrKind::kFloats && kind() == AttrKind::kInts) return true;
  if (is_list(k) && is_empty_list(*this)) return true;
  return false;
}

Attribute Attribute::converted_to(AttrKind k) const {
  if (kind() == k) return *this;
  switch (k) {
    case AttrKind::kFloat: return Attribute(as_float());
    case AttrKind::kFloats: return is_empty_list(*this) ? Attribute(std::vector<double>{})
                                                        : Attribute(as_floats());
    case AttrKind::kInts: return Attribute(std::vector<int64_t>{});
    case AttrKind::kStrings: return Attribute(std::vector<std::string>{});
    default: return *this;
  }
}

bool Attribute::operator==(const Attribute& o) const {
  if (kind() != o.kind()) return false;
  if (kind() == AttrKind::kTensor) return as_tensor().identical(o.as_tensor());
  if (kind() == AttrKind::kFloat) {
    // Bitwise, so NaN equals NaN and CSE/printing agree.
    const double a = std::get<double>(v_), b = std::get<double>(o.v_);
    return a == b ? std::signbit(a) == std::signbit(b) : (a != a && b != b);
  }
  switch (kind()) {
    case AttrKind::kInt: return as_int() == o.as_int();
    case AttrKind::kString: return as_string() == o.as_string();
    case AttrKind::kInts: return as_ints() == o.as_ints();
    case AttrKind::kFloats: return as_floats() == o.as_floats();
    case AttrKind::kStrings: return as_strings() == o.as_strings();
    case AttrKind::kDType: return as_dtype() == o.as_dtype();
    default: return false;
  }
}

}  // namespace kiln
