// Node attributes: ints, floats, strings, lists of those, tensors and dtypes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "kiln/ir/dtype.h"
#include "kiln/ir/tensor.h"

namespace kiln {

enum class AttrKind { kInt, kFloat, kString, kInts, kFloats, kStrings, kTensor, kDType };
const char* attr_kind_name(AttrKind k);

/// One attribute value. Booleans are ints (0/1). An int is accepted where a float is expected.
class Attribute {
 public:
  Attribute() : v_(int64_t{0}) {}
  Attribute(int64_t v) : v_(v) {}                                   // NOLINT
  Attribute(int v) : v_(int64_t{v}) {}                              // NOLINT
  Attribute(bool v) : v_(int64_t{v ? 1 : 0}) {}                     // NOLINT
  Attribute(double v) : v_(v) {}                                    // NOLINT
  Attribute(std::string v) : v_(std::move(v)) {}                    // NOLINT
  Attribute(const char* v) : v_(std::string(v)) {}                  // NOLINT
  Attribute(std::vector<int64_t> v) : v_(std::move(v)) {}           // NOLINT
  Attribute(std::vector<double> v) : v_(std::move(v)) {}            // NOLINT
  Attribute(std::vector<std::string> v) : v_(std::move(v)) {}       // NOLINT
  Attribute(Tensor v) : v_(std::move(v)) {}                         // NOLINT
  Attribute(DType v) : v_(v) {}                                     // NOLINT

  AttrKind kind() const { return static_cast<AttrKind>(v_.index()); }

  int64_t as_int() const { return std::get<int64_t>(v_); }
  double as_float() const {
    return kind() == AttrKind::kInt ? static_cast<double>(as_int()) : std::get<double>(v_);
  }
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const std::vector<int64_t>& as_ints() const { return std::get<std::vector<int64_t>>(v_); }
  std::vector<double> as_floats() const;  ///< an int list converts
  const std::vector<std::string>& as_strings() const { return std::get<std::vector<std::string>>(v_); }
  const Tensor& as_tensor() const { return std::get<Tensor>(v_); }
  DType as_dtype() const { return std::get<DType>(v_); }

  /// Whether this value can be read as `k` (int→float, int list→float list, empty list→any list).
  bool convertible_to(AttrKind k) const;
  /// Converts to `k` when convertible_to(k) (used to normalize parsed attributes to the schema).
  Attribute converted_to(AttrKind k) const;

  bool operator==(const Attribute& o) const;
  bool operator!=(const Attribute& o) const { return !(*this == o); }

 private:
  std::variant<int64_t, double, std::string, std::vector<int64_t>, std::vector<double>,
               std::vector<std::string>, Tensor, DType>
      v_;
};

/// Attributes of a node, sorted by name so printing is deterministic.
using AttrMap = std::map<std::string, Attribute>;

/// Whether attribute `name` is an annotation: a name starting with '_', which any op may carry
/// without declaring it. Annotations never change what an op computes (kernels and the
/// verifier ignore them); passes that compare nodes see them, so two nodes that differ only in
/// annotations are not merged (remat marks its recomputations `_remat` so cse keeps them).
inline bool is_annotation(const std::string& name) { return !name.empty() && name[0] == '_'; }

}  // namespace kiln
