// The fusion decisions shared by fuse-rows and fuse-pointwise's candidates: which nodes anchor
// or join a group, mirroring what the CUDA lowering emits as one kernel.
#include "fusion_policy.h"

#include <algorithm>
#include <set>

#include "fusion.h"
#include "kiln/ir/op.h"

namespace kiln::fusion {
namespace {

/// Longest row a row kernel keeps in registers (the CUDA lowering's limit too).
constexpr int64_t kMaxRowLength = 32768;

bool static_float(const Value* v) {
  if (!is_float(v->dtype()) || v->dtype() == DType::kF8E4M3FN || v->dtype() == DType::kF8E5M2) return false;
  return std::all_of(v->shape().begin(), v->shape().end(), [](const Dim& d) { return d.is_static(); });
}

std::optional<RowSpace> space_of(const Value* x, int64_t axis) {
  const int64_t rank = static_cast<int64_t>(x->shape().size());
  if (rank == 0 || axis < 0 || axis >= rank) return std::nullopt;
  int64_t len = 1;
  for (int64_t d = axis; d < rank; ++d) len *= x->shape()[static_cast<size_t>(d)].value();
  if (len == 0 || len > kMaxRowLength) return std::nullopt;
  return RowSpace{x->shape(), axis};
}

}  // namespace

std::optional<RowSpace> row_anchor(const Node& n) {
  if (!n.op() || n.num_operands() < 1 || n.num_results() != 1 || has_side_effects(n)) return std::nullopt;
  for (const Value* v : n.operands())
    if (!static_float(v)) return std::nullopt;
  if (!static_float(n.result())) return std::nullopt;
  const Value* x = n.operand(0);
  const int64_t rank = static_cast<int64_t>(x->shape().size());
  auto norm = [&](int64_t a) { return a < 0 ? a + rank : a; };
  const std::string& op = n.op_name();
  if (op == "rms_norm" || op == "layer_norm") return space_of(x, norm(n.get_int("axis", -1)));
  if (op == "softmax" || op == "log_softmax") {
    if (norm(n.get_int("axis", -1)) != rank - 1) return std::nullopt;
    return space_of(x, rank - 1);
  }
  static const std::set<std::string> kReduce = {"reduce_sum", "reduce_mean", "reduce_max", "reduce_min",
                                                "reduce_prod"};
  if (!kReduce.count(op) || n.num_operands() != 1) return std::nullopt;
  // The reduced axes must be exactly the trailing dims [a, rank).
  std::vector<int64_t> axes = n.get_ints("axes");
  if (axes.empty())
    for (int64_t d = 0; d < rank; ++d) axes.push_back(d);
  for (int64_t& a : axes) a = norm(a);
  std::sort(axes.begin(), axes.end());
  axes.erase(std::unique(axes.begin(), axes.end()), axes.end());
  if (axes.empty() || axes.back() != rank - 1 || axes.front() != rank - static_cast<int64_t>(axes.size()))
    return std::nullopt;
  return space_of(x, axes.front());
}

RowValue row_value(const Shape& s, const RowSpace& space) {
  if (s == space.full) return RowValue::kFull;
  if (s.size() != space.full.size()) return RowValue::kNone;
  for (size_t d = 0; d < s.size(); ++d) {
    const bool trailing = static_cast<int64_t>(d) >= space.axis;
    if (!(trailing ? s[d] == Dim(1) : s[d] == space.full[d])) return RowValue::kNone;
  }
  return RowValue::kPerRow;
}

bool is_quantize_epilogue(const Node& n) {
  if (n.op_name() != "quantize" || n.num_operands() != 2 || n.num_results() != 1 || n.num_regions() > 0) return false;
  const DType q = n.result()->dtype();
  if (q != DType::kF8E4M3FN && q != DType::kF8E5M2) return false;
  const Value* s = n.operand(1);
  if (!static_float(n.operand(0)) || s->dtype() != DType::kF32 || has_unknown_dim(s->shape())) return false;
  for (const Dim& d : s->shape())
    if (d != Dim(1)) return false;
  return n.operand(0)->shape() == n.result()->shape();
}

bool is_amax_epilogue(const Node& n) {
  if (n.op_name() != "amax" || n.num_operands() != 1 || n.num_results() != 1 || n.num_regions() > 0) return false;
  return static_float(n.operand(0)) && n.result()->dtype() == DType::kF32 && n.result()->shape().empty();
}

bool is_epilogue_only(const Node& n) { return is_quantize_epilogue(n) || is_amax_epilogue(n); }

GroupKind group_kind(const Node& n) {
  if (row_anchor(n)) return GroupKind::kRows;
  if (is_epilogue_only(n)) return GroupKind::kPointwise;
  if (!n.op() || n.num_results() != 1 || n.num_regions() > 0 || has_side_effects(n)) return GroupKind::kNone;
  if (!n.op()->has(kTraitElementwise) && n.op_name() != "identity") return GroupKind::kNone;
  const Shape& out = n.result()->shape();
  if (has_unknown_dim(out)) return GroupKind::kNone;
  for (const Value* v : n.operands())
    if (has_unknown_dim(v->shape()) || !broadcasts_into(v->shape(), out)) return GroupKind::kNone;
  return GroupKind::kPointwise;
}

bool is_movement_member(const Node& n) {
  static const std::set<std::string> kMovement = {"transpose", "slice",   "concat",    "expand",  "reshape",
                                                  "flatten",   "squeeze", "unsqueeze", "identity"};
  if (!n.op() || !kMovement.count(n.op_name()) || n.num_results() != 1 || n.num_operands() < 1 ||
      n.num_regions() > 0 || has_side_effects(n))
    return false;
  auto is_static = [](const Value* v) {
    return std::all_of(v->shape().begin(), v->shape().end(), [](const Dim& d) { return d.is_static(); });
  };
  return is_static(n.result()) && std::all_of(n.operands().begin(), n.operands().end(), is_static);
}

bool can_join_rows(const Node& n, const RowSpace& space) {
  if (std::optional<RowSpace> s = row_anchor(n)) return *s == space;
  if (is_quantize_epilogue(n)) return row_value(n.result()->shape(), space) == RowValue::kFull;
  if (is_amax_epilogue(n)) return row_value(n.operand(0)->shape(), space) == RowValue::kFull;
  if (group_kind(n) != GroupKind::kPointwise || !static_float(n.result())) return false;
  // Operands broadcast into the result (group_kind), so a per-row op only sees per-row values.
  return row_value(n.result()->shape(), space) != RowValue::kNone;
}

bool is_running_sum_edge(const Node& producer, const Node& consumer) {
  return consumer.has_attr("_accumulate") && consumer.num_operands() > 0 && consumer.operand(0)->producer() == &producer;
}

bool can_fuse(const Node& producer, const Node& consumer, const std::optional<RowSpace>& space) {
  if (is_epilogue_only(producer) || is_running_sum_edge(producer, consumer)) return false;
  // A recomputation in the backward (the remat pass marks it) never joins the kernel of the
  // forward value it starts from: that would compute it in the forward and keep its result
  // alive until the backward, which is what recomputing avoids.
  if (consumer.has_attr("_remat") && !producer.has_attr("_remat")) return false;
  if (!space) return group_kind(producer) == GroupKind::kPointwise && group_kind(consumer) == GroupKind::kPointwise;
  if (!can_join_rows(producer, *space) || !can_join_rows(consumer, *space)) return false;
  // A reduction that drops its axes yields values a consumer would broadcast along the wrong dims.
  return row_value(producer.result()->shape(), *space) != RowValue::kNone;
}

}  // namespace kiln::fusion
