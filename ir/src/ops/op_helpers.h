// Shared helpers for core op definitions: dtype checks, broadcasting, axes, attribute specs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "kiln/ir/op.h"

namespace kiln {

/// Classes of dtypes an operand may take; combine with `|`.
enum DTypeClass : uint32_t {
  kFloatDTypes = 1u << 0,        ///< f64 f32 f16 bf16 f8*
  kSignedIntDTypes = 1u << 1,    ///< i64 i32 i16 i8 i4
  kUnsignedIntDTypes = 1u << 2,  ///< u8
  kBoolDType = 1u << 3,
  kIntDTypes = kSignedIntDTypes | kUnsignedIntDTypes,
  kNumericDTypes = kFloatDTypes | kIntDTypes,
  kAnyDType = kNumericDTypes | kBoolDType,
};

/// Whether `t` belongs to one of `classes`.
bool dtype_in(DType t, uint32_t classes);
/// Readable list of classes for diagnostics: "float or signed integer".
std::string dtype_classes_str(uint32_t classes);

/// Operand `i`'s name as the op's schema declares it (without "?" or "..."), e.g. "x".
std::string operand_name(const InferContext& ctx, int i);

/// Fails with "operand 'x' must be float, got i32" unless operand `i`'s dtype is in `classes`.
Status require_dtype(const InferContext& ctx, int i, uint32_t classes);
/// Fails with "operands 'a' and 'b' must have the same dtype, got f32 and i32".
Status require_same_dtype(const InferContext& ctx, int i, int j);
/// Numpy-broadcasts the shapes of the listed operands (symbolic dims allowed); fails with
/// "operands 'a' f32[2, 3] and 'b' f32[4] do not broadcast".
StatusOr<Shape> broadcast_operands(const InferContext& ctx, std::initializer_list<int> ids);
/// Fails unless int attribute `name` (or its default) is 0 or 1.
Status require_flag(const InferContext& ctx, const std::string& name);

/// Maps a possibly negative axis into [0, rank); "axis 3 is out of range for rank 2".
StatusOr<int64_t> normalize_axis(const InferContext& ctx, int64_t axis, int64_t rank);
/// Normalizes a list of axes, rejecting out-of-range ones and duplicates (after mapping
/// negatives); the result is sorted ascending.
StatusOr<std::vector<int64_t>> normalize_axes(const InferContext& ctx,
                                              const std::vector<int64_t>& axes, int64_t rank);

/// Attribute specs: a required one, an optional one without default, and one whose kind
/// comes from its default value.
AttrSpec attr_required(std::string name, AttrKind kind, std::string doc);
AttrSpec attr_optional(std::string name, AttrKind kind, std::string doc);
AttrSpec attr_default(std::string name, Attribute default_value, std::string doc);

/// Adds `def` to `r`; a failure here is a bug in Kiln's op table, so it aborts with the
/// message instead of returning.
void add_op_or_die(OpRegistry& r, OpDef def);

/// The smallest and largest value of an integer dtype.
std::pair<int64_t, int64_t> int_dtype_range(DType t);

/// Wrapping int64 arithmetic. Integer kernels compute in int64 and wrap to the result width
/// on store (Tensor::set_i64); going through uint64 keeps the overflowing int64 cases defined.
inline int64_t wrap_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
inline int64_t wrap_sub(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b));
}
inline int64_t wrap_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}
inline int64_t wrap_neg(int64_t a) { return wrap_sub(0, a); }

/// Copies element `si` of `src` to element `di` of `dst` bit-exactly (both of dtype `t`;
/// i4 nibbles handled). Use for kernels that move values without arithmetic.
void copy_element(DType t, const std::byte* src, int64_t si, std::byte* dst, int64_t di);

}  // namespace kiln
