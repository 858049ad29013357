// Shared helpers for core op definitions: dtype checks, broadcasting, axes, attribute specs.
#include "ops/op_helpers.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace kiln {

bool dtype_in(DType t, uint32_t classes) {
  if (t == DType::kBool) return (classes & kBoolDType) != 0;
  if (is_float(t)) return (classes & kFloatDTypes) != 0;
  if (is_integer(t)) return (classes & (is_signed(t) ? kSignedIntDTypes : kUnsignedIntDTypes)) != 0;
  return false;
}

std::string dtype_classes_str(uint32_t classes) {
  std::vector<std::string> parts;
  if (classes & kFloatDTypes) parts.push_back("float");
  if ((classes & kIntDTypes) == kIntDTypes)
    parts.push_back("integer");
  else if (classes & kSignedIntDTypes)
    parts.push_back("signed integer");
  else if (classes & kUnsignedIntDTypes)
    parts.push_back("unsigned integer");
  if (classes & kBoolDType) parts.push_back("bool");
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i)
    s += (i == 0 ? "" : i + 1 == parts.size() ? " or " : ", ") + parts[i];
  return s;
}

std::string operand_name(const InferContext& ctx, int i) {
  const OpDef* op = ctx.node.op();
  if (op == nullptr || op->inputs.empty()) return "#" + std::to_string(i);
  // A variadic last input names every operand from its position on.
  size_t k = std::min(static_cast<size_t>(i), op->inputs.size() - 1);
  std::string n = op->inputs[k];
  while (!n.empty() && (n.back() == '?' || n.back() == '.')) n.pop_back();
  if (k != static_cast<size_t>(i)) n += "#" + std::to_string(static_cast<size_t>(i) - k);
  return n;
}

Status require_dtype(const InferContext& ctx, int i, uint32_t classes) {
  DType t = ctx.operand(i).dtype;
  if (dtype_in(t, classes)) return ok_status();
  return ctx.error("operand '" + operand_name(ctx, i) + "' must be " + dtype_classes_str(classes) +
                   ", got " + std::string(dtype_name(t)));
}

Status require_same_dtype(const InferContext& ctx, int i, int j) {
  DType a = ctx.operand(i).dtype, b = ctx.operand(j).dtype;
  if (a == b) return ok_status();
  return ctx.error("operands '" + operand_name(ctx, i) + "' and '" + operand_name(ctx, j) +
                   "' must have the same dtype, got " + std::string(dtype_name(a)) + " and " +
                   std::string(dtype_name(b)));
}

StatusOr<Shape> broadcast_operands(const InferContext& ctx, std::initializer_list<int> ids) {
  Shape out;
  bool ok = true;
  for (int i : ids) {
    StatusOr<Shape> s = broadcast_shapes(out, ctx.operand(i).shape);
    if (!s.ok()) {
      ok = false;
      break;
    }
    out = std::move(s).value();
  }
  if (ok) return out;
  std::string list;
  size_t n = 0;
  for (int i : ids) {
    if (n > 0) list += (n + 1 == ids.size()) ? " and " : ", ";
    list += "'" + operand_name(ctx, i) + "' " + ctx.operand(i).str();
    ++n;
  }
  return ctx.error("operands " + list + " do not broadcast");
}

Status require_flag(const InferContext& ctx, const std::string& name) {
  int64_t v = ctx.node.get_int(name);
  if (v == 0 || v == 1) return ok_status();
  return ctx.error("attribute '" + name + "' must be 0 or 1, got " + std::to_string(v));
}

StatusOr<int64_t> normalize_axis(const InferContext& ctx, int64_t axis, int64_t rank) {
  StatusOr<int64_t> a = normalize_axis(axis, rank);
  if (a.ok()) return a;
  return ctx.error("axis " + std::to_string(axis) + " is out of range for rank " +
                   std::to_string(rank));
}

StatusOr<std::vector<int64_t>> normalize_axes(const InferContext& ctx,
                                              const std::vector<int64_t>& axes, int64_t rank) {
  std::vector<int64_t> out;
  for (int64_t axis : axes) {
    KILN_ASSIGN_OR_RETURN(int64_t a, normalize_axis(ctx, axis, rank));
    if (std::find(out.begin(), out.end(), a) != out.end())
      return ctx.error("axis " + std::to_string(axis) + " appears more than once (as axis " +
                       std::to_string(a) + ")");
    out.push_back(a);
  }
  std::sort(out.begin(), out.end());
  return out;
}

AttrSpec attr_required(std::string name, AttrKind kind, std::string doc) {
  return AttrSpec{std::move(name), kind, true, std::nullopt, std::move(doc)};
}

AttrSpec attr_optional(std::string name, AttrKind kind, std::string doc) {
  return AttrSpec{std::move(name), kind, false, std::nullopt, std::move(doc)};
}

AttrSpec attr_default(std::string name, Attribute default_value, std::string doc) {
  AttrKind kind = default_value.kind();
  return AttrSpec{std::move(name), kind, false, std::move(default_value), std::move(doc)};
}

void add_op_or_die(OpRegistry& r, OpDef def) {
  std::string name = def.name;
  Status s = r.add(std::move(def));
  if (s.ok()) return;
  std::fprintf(stderr, "kiln: registering core op '%s' failed: %s\n", name.c_str(),
               s.message().c_str());
  std::abort();
}

std::pair<int64_t, int64_t> int_dtype_range(DType t) {
  const int bits = dtype_bits(t);
  const int64_t max = std::numeric_limits<int64_t>::max();
  if (!is_signed(t)) return {0, bits >= 64 ? max : (int64_t{1} << bits) - 1};
  if (bits >= 64) return {std::numeric_limits<int64_t>::min(), max};
  return {-(int64_t{1} << (bits - 1)), (int64_t{1} << (bits - 1)) - 1};
}

void copy_element(DType t, const std::byte* src, int64_t si, std::byte* dst, int64_t di) {
  if (t == DType::kI4) {
    auto nibble = (std::to_integer<unsigned>(src[si / 2]) >> (4 * (si % 2))) & 0xFu;
    std::byte& d = dst[di / 2];
    unsigned shift = 4 * static_cast<unsigned>(di % 2);
    d = std::byte{static_cast<unsigned char>((std::to_integer<unsigned>(d) & ~(0xFu << shift)) |
                                             (nibble << shift))};
    return;
  }
  const size_t bytes = static_cast<size_t>(dtype_bits(t) / 8);
  std::memcpy(dst + static_cast<size_t>(di) * bytes, src + static_cast<size_t>(si) * bytes, bytes);
}

}  // namespace kiln
